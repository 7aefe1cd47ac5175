"""Reference decoding: Flash-Decoding and FlashDecoding++'s asynchronous softmax.

Decoding runs a few query tokens (``Nq`` = 1..8: the new token, or a short
speculative draft) against a long KV cache.  With so few query rows the FA2
grid (one program per query block and head, FA2 paper Algorithm 1) has too
little parallelism, so Flash-Decoding (Dao, Haziza, Massa, Sizov 2023, blog
post "Flash-Decoding for long-context inference") also splits the *keys*.

Layout: ``q`` (B, Hq, Nq, d), ``k_cache`` / ``v_cache`` (B, Hk, Nk, d) with
``Hq`` a multiple of ``Hk`` (GQA: q head h reads kv head h // (Hq // Hk)).
``cache_seqlens`` (B,) says batch element b uses only keys [0, L_b) of its
cache, ``0 <= L_b <= Nk``.  Every mask option means what
:mod:`flashtile.reference.masks` says with ``Nk`` replaced by that batch
element's own ``L_b``: causal and windows are bottom-right aligned against
``L_b`` (shift ``L_b - Nq``) and ALiBi measures ``|i + L_b - Nq - j|``.  A row
with no allowed key (e.g. ``L_b = 0``) has output 0 and LSE -inf.

Flash-Decoding
--------------
The key range [0, L) is cut into ``S = num_splits`` contiguous chunks
``J_c = [floor(c L / S), floor((c+1) L / S))`` (sizes differ by at most one;
chunks are empty when S > L).  Chunk c computes, per query row, the same
partial statistics as one FA2 row block (FA2 Algorithm 1, lines 9-13):

    m_c   = max_{j in J_c} s_j,      l_c = sum_{j in J_c} exp(s_j - m_c)
    LSE_c = m_c + log l_c,           O_c = sum_{j in J_c} exp(s_j - LSE_c) v_j

(an empty or fully masked chunk gives O_c = 0, LSE_c = -inf).  A second pass
merges the S partials, which is FA1 Algorithm 1's statistics merge (lines
11-12) done once across all splits instead of step by step:

    LSE = log sum_c exp(LSE_c),      O = sum_c exp(LSE_c - LSE) O_c

exact because exp(LSE_c - LSE) O_c = sum_{j in J_c} exp(s_j - LSE) v_j.  The
result does not depend on S or on the merge order except through rounding.

Counting (per batch element b and *query* head h, with L = L_b; the counts of
a call are the sums over b and h).  The reference charges the K/V cache once
per query head: a GQA kernel that loads a kv head once for its Hq/Hk query
heads reads ``2 L d`` per kv head instead.  ``q`` is charged once.  Every
split writes its partial, even an empty one (it writes (0, -inf)), and the
merge always runs, also for S = 1:

    reads  = Nq d  +  2 L d  +  S Nq (d + 1)      (q, K and V, partials re-read by the merge)
    writes = S Nq (d + 1)  +  Nq d  +  Nq         (partials, then O and LSE)
    flops  = 4 Nq L d                             (Q K^T and P V, 2 per multiply-add)
    nonmatmul_flops = 4 Nq L                      (max, subtract, exp, sum per score)
                    + min(S, L) Nq (d + 2)        (non-empty chunks: O_c / l_c, log + add for LSE_c)
                    + Nq (2 S (d + 3) + 2)        (merge: see :func:`merge_partials`)
    extra_memory = S Nq (d + 1)                   (the partials, summed over b and h)

Score modifications (scale, softcap, ALiBi) and mask predicates are not
counted as nonmatmul flops, like the ``where`` guards in
:mod:`flashtile.reference.softmax`.  Masked keys inside [0, L) are still
loaded and computed: the reference does not skip them.

FlashDecoding++ (asynchronous softmax with a unified max value)
----------------------------------------------------------------
Hong et al. 2023, "FlashDecoding++: Faster Large Language Model Inference on
GPUs", Section 3: the max m_c is the only reason chunks must rescale each
other.  Replacing it by one fixed value ``phi`` for every chunk,

    num = sum_c sum_{j in J_c} exp(s_j - phi) v_j,   den = sum_c sum_{j in J_c} exp(s_j - phi)
    O = num / den,                                   LSE = phi + log den

is mathematically the softmax for *any* phi; chunks just add their partial
numerators and denominators, with no max and no synchronisation.  It is
numerically exact as long as every ``s_j - phi`` lies in a safe range [a, b]
of the compute dtype (see :func:`default_safe_range`).  Each chunk checks its
scores against [a, b]; a row with any score outside is recomputed with the
safe (max-based, single split) path: the *fallback*.  Rows whose accumulators
overflow anyway (|v| larger than the range assumes) are caught by a final
finiteness check and recomputed too.  :class:`DecodePPInfo` lists them.

FlashDecoding++ counts per (b, h): the same reads and writes as Flash-Decoding
(numerator d + denominator 1 per partial row), ``flops = 4 Nq L d`` and

    nonmatmul_flops = 5 Nq L                       (subtract phi, exp, sum, 2 range compares)
                    + Nq (S (d + 1) + d + 2)       (add S partials, divide by den, log + add)

plus, for a fallback on r rows of one (b, h): reads ``r d + 2 L d``, writes
``r (d + 1)``, flops ``4 r L d``, nonmatmul ``4 r L + r (d + 2)`` (the
single-chunk safe path on those rows only; tallied also in ``counts.extras``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from flashtile.reference import _checks as checks
from flashtile.reference._common import AttnResult, IOCounts, as_float, check_qkv, expand_kv
from flashtile.reference.masks import allowed_mask, apply_score_mods, normalize_window

__all__ = [
    "chunk_bounds",
    "merge_partials",
    "flash_decoding",
    "default_safe_range",
    "estimate_phi",
    "DecodePPInfo",
    "flashdecoding_pp",
    "quantize_cache_rows",
    "fp8_cache_decoding",
    "cascade_decoding",
    "apply_rotary",
    "kvcache_step",
]

# Headroom factor of the default safe range: 16 = 2^4 (see default_safe_range).
_HEADROOM = math.log(16.0)


# ---------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------


def _check_order(order: Sequence[int] | torch.Tensor | None, n: int) -> list[int]:
    """Return ``order`` as a list, checking it is a permutation of 0..n-1."""
    if order is None:
        return list(range(n))
    try:
        perm = [int(i) for i in (order.tolist() if isinstance(order, torch.Tensor) else order)]
    except (TypeError, ValueError):
        raise ValueError(f"order must be a permutation of the split indices 0..{n - 1}, got {order!r}") from None
    if sorted(perm) != list(range(n)):
        raise ValueError(f"order must be a permutation of the split indices 0..{n - 1} ({n} splits), got {perm}")
    return perm


def _check_seqlens(cache_seqlens: torch.Tensor | Sequence[int] | None, batch: int, nk: int) -> list[int]:
    if cache_seqlens is None:
        return [nk] * batch
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.is_floating_point() or cache_seqlens.is_complex() or cache_seqlens.dtype == torch.bool:
            raise TypeError(f"cache_seqlens must be an integer tensor of shape (B,), got dtype {cache_seqlens.dtype}")
        lens = cache_seqlens
    else:
        try:
            lens = torch.as_tensor([int(x) for x in cache_seqlens], dtype=torch.int64)
        except (TypeError, ValueError):
            raise TypeError(f"cache_seqlens must be an int tensor or a sequence of ints, got {cache_seqlens!r}") from None
    if tuple(lens.shape) != (batch,):
        raise ValueError(f"cache_seqlens must have shape (B,) = ({batch},), got {tuple(lens.shape)}")
    out = [int(x) for x in lens.tolist()]
    for b, length in enumerate(out):
        if not 0 <= length <= nk:
            raise ValueError(
                f"cache_seqlens[{b}] = {length} must lie in [0, {nk}] (the cache holds Nk = {nk} keys)"
            )
    return out


# ---------------------------------------------------------------------------
# the decoding problem: scores and masks of one batch element
# ---------------------------------------------------------------------------


@dataclass
class _Decode:
    """Canonical inputs: q (B, Hq, Nq, d), k and v expanded to (B, Hq, Nk, d)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    lengths: list[int]
    scale: float
    softcap: float
    slopes: torch.Tensor | None
    causal: bool
    window: tuple[int, int]
    added: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, hq, nq, d = self.q.shape
        return b, hq, nq, d

    def allowed(self, b: int) -> torch.Tensor:
        """(Nq, L_b) mask, bottom-right aligned against this element's own length."""
        nq = self.q.shape[2]
        return allowed_mask(nq, self.lengths[b], causal=self.causal, window_size=self.window)

    def scores(self, b: int, start: int, stop: int) -> torch.Tensor:
        """Modified scores (Hq, Nq, stop - start) of keys [start, stop) in the compute dtype."""
        q = self.q[b]
        s = self.scale * (q @ self.k[b, :, start:stop].transpose(-1, -2))
        slopes = None if self.slopes is None else self.slopes[b : b + 1]
        s = apply_score_mods(
            s.unsqueeze(0),
            softcap=self.softcap,
            alibi_slopes=slopes,
            k_start=start,
            nq=q.shape[1],
            nk=self.lengths[b],
        )
        return s.squeeze(0)

    def restore(self, x: torch.Tensor) -> torch.Tensor:
        """Drop the leading dims that :func:`check_qkv` added to 2-D / 3-D inputs."""
        for _ in range(self.added):
            x = x.squeeze(0)
        return x


def _prepare(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens,
    softmax_scale: float | None,
    causal: bool,
    window_size: Sequence[int] | None,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    dtype: torch.dtype | None,
) -> _Decode:
    checks.compute_dtype(dtype)
    q, k, v, added = check_qkv(q, k_cache, v_cache, dtype)
    batch, hq, _, d = q.shape
    lengths = _check_seqlens(cache_seqlens, batch, k.shape[2])
    scale = checks.softmax_scale(softmax_scale, d)
    cap = checks.softcap(softcap)
    window = normalize_window(bool(causal), window_size)
    # float64 whatever the compute dtype, as before: the score code casts them once
    slopes = checks.alibi_slopes(alibi_slopes, batch, hq, torch.float64)
    return _Decode(q, expand_kv(k, hq), expand_kv(v, hq), lengths, scale, cap, slopes, bool(causal), window, added)


def chunk_bounds(length: int, num_splits: int) -> list[tuple[int, int]]:
    """Split [0, length) into ``num_splits`` contiguous chunks as equal as possible.

    Chunk c is ``[floor(c L / S), floor((c+1) L / S))``: sizes differ by at most
    one, and ``S - L`` chunks are empty when ``S > L``.
    """
    num_splits = checks.positive_int(num_splits, "num_splits")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    cuts = [c * length // num_splits for c in range(num_splits + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


# ---------------------------------------------------------------------------
# Flash-Decoding
# ---------------------------------------------------------------------------


def _safe_partial(
    s: torch.Tensor, allowed: torch.Tensor, v: torch.Tensor, counts: IOCounts
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised partial (O_c, LSE_c) of one chunk: s (H, R, n), allowed (R, n), v (H, n, d).

    m = rowmax, l = rowsum exp(s - m), LSE = m + log l, O = (exp(s - m) v) / l
    (FA2 Algorithm 1, lines 9-13, for a single key block).  Rows with no
    allowed key give (0, -inf): their max is -inf and is replaced by 0 so that
    exp(-inf - 0) = 0 instead of NaN.
    """
    h, r, n = s.shape
    d = v.shape[-1]
    if n == 0:  # an empty split writes (0, -inf) without arithmetic
        return s.new_zeros(h, r, d), s.new_full((h, r), -math.inf)
    masked = s.masked_fill(~allowed, -math.inf)
    m = masked.amax(dim=-1)
    m_safe = torch.where(m == -math.inf, torch.zeros_like(m), m)
    p = torch.exp(masked - m_safe.unsqueeze(-1))
    l = p.sum(dim=-1)
    live = l > 0
    l_safe = torch.where(live, l, torch.ones_like(l))
    out = torch.where(live.unsqueeze(-1), (p @ v) / l_safe.unsqueeze(-1), torch.zeros((), dtype=s.dtype))
    lse = torch.where(live, m_safe + torch.log(l_safe), torch.full_like(l, -math.inf))
    counts.flops += 4 * h * r * n * d
    counts.nonmatmul_flops += 4 * h * r * n + h * r * (d + 2)
    return out, lse


def merge_partials(
    outs: torch.Tensor,
    lses: torch.Tensor,
    order: Sequence[int] | torch.Tensor | None = None,
    counts: IOCounts | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine S normalised partials: outs (S, ..., d), lses (S, ...) -> (out (..., d), lse (...)).

    lse = log sum_i exp(LSE_i),   O = sum_i exp(LSE_i - lse) O_i

    computed as Flash-Decoding's reduction: m = max_i LSE_i, then the sums
    ``sum_i exp(LSE_i - m)`` and ``sum_i w_i O_i`` accumulated in ``order`` (a
    permutation of 0..S-1; default 0, 1, ..., S-1).  Partials with LSE_i = -inf
    have weight 0; if all are -inf the row is fully masked: O = 0, lse = -inf,
    no NaN.  The function is associative and commutative up to rounding: any
    order, or merging merged groups, gives the same result.

    If ``counts`` is given, the merge is tallied on it per output row: reads
    S (d + 1) (every partial), writes d + 1 (O and LSE), nonmatmul flops
    2 S (d + 3) + 2 (max, subtract, exp, sum over the S LSEs, log + add; then
    subtract + exp for the weights, multiply + add per output element).
    """
    outs = as_float(outs, "outs", None)
    lses = as_float(lses, "lses", outs.dtype)
    if outs.dim() < 2 or outs.shape[0] == 0:
        raise ValueError(f"outs must have shape (S, ..., d) with S >= 1, got {tuple(outs.shape)}")
    if tuple(lses.shape) != tuple(outs.shape[:-1]):
        raise ValueError(f"lses must have shape (S, ...) = {tuple(outs.shape[:-1])} to match outs, got {tuple(lses.shape)}")
    if torch.isnan(lses).any() or (lses == math.inf).any():
        raise ValueError("lses must not contain NaN or +inf (use -inf for an empty partial)")
    n_splits, d = outs.shape[0], outs.shape[-1]
    perm = _check_order(order, n_splits)
    m = lses.amax(dim=0)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    total = torch.zeros_like(m)
    for i in perm:
        total = total + torch.exp(lses[i] - m)
    lse = torch.where(total > 0, m + torch.log(total), torch.full_like(total, -math.inf))
    lse_safe = torch.where(lse == -math.inf, torch.zeros_like(lse), lse)
    out = torch.zeros_like(outs[0])
    for i in perm:
        # exp(-inf - finite) = 0: empty partials and fully masked rows drop out
        out = out + torch.exp(lses[i] - lse_safe).unsqueeze(-1) * outs[i]
    if counts is not None:
        rows = lse.numel()
        counts.read(n_splits * rows * (d + 1))
        counts.write(rows * (d + 1))
        counts.nonmatmul_flops += rows * (2 * n_splits * (d + 3) + 2)
    return out, lse


def flash_decoding(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_splits: int,
    cache_seqlens: torch.Tensor | Sequence[int] | None = None,
    order: Sequence[int] | torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] | None = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dtype: torch.dtype | None = torch.float64,
) -> AttnResult:
    """Flash-Decoding: split the KV range of every batch element into ``num_splits`` chunks.

    Each chunk yields a normalised partial (O_c, LSE_c) and :func:`merge_partials`
    combines them in ``order`` (see the module docstring for the math and the
    exact counts).  ``q`` (B, Hq, Nq, d), caches (B, Hk, Nk, d) (2-D and 3-D
    accepted, as in :func:`~flashtile.reference._common.check_qkv`);
    ``cache_seqlens`` (B,) ints in [0, Nk] (default: the full cache).  Returns
    ``AttnResult(out (B, Hq, Nq, d), lse (B, Hq, Nq), counts)`` in ``dtype``.
    """
    prob = _prepare(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dtype=dtype,
    )
    n_splits = checks.positive_int(num_splits, "num_splits")
    perm = _check_order(order, n_splits)
    batch, hq, nq, d = prob.shape
    out = prob.q.new_zeros(batch, hq, nq, d)
    lse = prob.q.new_zeros(batch, hq, nq)
    counts = IOCounts()
    for b in range(batch):
        allowed = prob.allowed(b)
        counts.read(hq * nq * d)
        partials = []
        for start, stop in chunk_bounds(prob.lengths[b], n_splits):
            counts.read(2 * hq * (stop - start) * d)
            s = prob.scores(b, start, stop)
            partials.append(_safe_partial(s, allowed[:, start:stop], prob.v[b, :, start:stop], counts))
            counts.write(hq * nq * (d + 1))
        outs = torch.stack([o for o, _ in partials])
        lses = torch.stack([m for _, m in partials])
        out[b], lse[b] = merge_partials(outs, lses, perm, counts)
        counts.extra_memory += n_splits * hq * nq * (d + 1)
    counts.extras["num_splits"] = n_splits
    return AttnResult(prob.restore(out), prob.restore(lse), counts)


# ---------------------------------------------------------------------------
# FlashDecoding++: asynchronous softmax with a unified max value
# ---------------------------------------------------------------------------


def default_safe_range(dtype: torch.dtype, n_terms: int = 1) -> tuple[float, float]:
    """Safe range [a, b] for ``s - phi`` in the compute ``dtype`` when summing ``n_terms`` exponentials.

    ``exp`` in a dtype is finite up to ``log(finfo.max)`` and a normal number
    (full relative precision) down to ``log(finfo.tiny)``.  Keeping 16x (2^4)
    headroom at both ends:

        a = log(tiny) + log 16
        b = log(max)  - log 16 - log(n_terms)

    The upper end lets ``n_terms`` terms, each multiplied by a value with
    |v| <= 16, be summed without overflow (n e^b 16 <= max).  The lower end
    keeps every term at least 16 times the smallest normal number, so a row
    whose terms are all in range cannot lose its denominator, and the
    absolute error of a product that rounds into the subnormals is below
    2^-4 ulp of the denominator.  Values:

        float64: a = -705.6, b = 707.01 - log n  (log max = 709.78)
        float32: a =  -84.6, b =  85.95 - log n  (log max =  88.72)
        bfloat16: as float32 to 0.1 (same exponent range)
        float16: a =   -6.93, b =  8.32 - log n  (log max =  11.09, log tiny = -9.70)
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if isinstance(n_terms, bool) or not isinstance(n_terms, int) or n_terms < 1:
        raise ValueError(f"n_terms must be an int >= 1, got {n_terms!r}")
    info = torch.finfo(dtype)
    lo = math.log(info.tiny) + _HEADROOM
    hi = math.log(info.max) - _HEADROOM - math.log(n_terms)
    return lo, hi


def estimate_phi(sample_scores: torch.Tensor | Sequence[float], quantile: float = 0.999) -> float:
    """Pick the unified max value phi as a high quantile of a sample of (modified) scores.

    FlashDecoding++ sets phi offline from statistics of the model's softmax
    inputs.  A phi near the top of the distribution keeps ``exp(s - phi) <= ~1``
    for nearly all scores, so the upper end of the safe range is rarely left,
    while the lower end is reached only by scores more than |a| below phi.
    Uses the nearest-rank quantile of the finite entries (masked -inf scores
    are ignored); ``quantile = 1`` returns the sample maximum.
    """
    x = torch.as_tensor(sample_scores, dtype=torch.float64).flatten()
    q = checks.check_real(quantile, "quantile")
    if not 0.0 < q <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {quantile!r}")
    if torch.isnan(x).any() or (x == math.inf).any():
        raise ValueError("sample_scores must not contain NaN or +inf")
    x = x[torch.isfinite(x)]
    if x.numel() == 0:
        raise ValueError("sample_scores must contain at least one finite score")
    rank = max(1, math.ceil(q * x.numel()))
    return float(torch.sort(x).values[rank - 1])


@dataclass(frozen=True)
class DecodePPInfo:
    """What FlashDecoding++'s asynchronous softmax had to recompute.

    Masks have the shape of the LSE, (B, Hq, Nq) (or fewer dims for 2-D / 3-D
    inputs).  ``above``: some allowed score had s - phi > b (exp would
    overflow); ``below``: some had s - phi < a (exp loses precision, or the
    row vanishes); ``overflowed``: every score was inside the range, yet the
    accumulated numerator / denominator was not finite and positive (|v| above
    what the range assumes).  ``recomputed`` is their union: the rows redone
    by the safe path.
    """

    phi: float
    safe_range: tuple[float, float]
    recomputed: torch.Tensor
    above: torch.Tensor
    below: torch.Tensor
    overflowed: torch.Tensor

    @property
    def num_recomputed(self) -> int:
        return int(self.recomputed.sum())

    def rows(self) -> list[tuple[int, ...]]:
        """Indices (b, h, row) (as many as the masks have dims) of the recomputed rows."""
        return [tuple(int(i) for i in idx) for idx in self.recomputed.nonzero().tolist()]


def _async_chunk(
    s: torch.Tensor, allowed: torch.Tensor, v: torch.Tensor, phi: float, lo: float, hi: float, counts: IOCounts
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised partial of one chunk with the unified max: (num, den, above, below).

    num = sum_j exp(s_j - phi) v_j (H, R, d), den = sum_j exp(s_j - phi) (H, R);
    above / below flag rows with an allowed s_j - phi outside [lo, hi].  No
    max is taken, so the chunk needs nothing from the others.
    """
    h, r, n = s.shape
    d = v.shape[-1]
    dev = s - phi
    above = ((dev > hi) & allowed).any(dim=-1)
    below = ((dev < lo) & allowed).any(dim=-1)
    e = torch.where(allowed, torch.exp(dev), torch.zeros((), dtype=s.dtype))
    counts.flops += 4 * h * r * n * d
    counts.nonmatmul_flops += 5 * h * r * n
    return e @ v, e.sum(dim=-1), above, below


def _fallback(prob: _Decode, b: int, allowed: torch.Tensor, redo: torch.Tensor, counts: IOCounts):
    """Safe (max-based, single split) recomputation of the rows ``redo`` (Hq, Nq) of element b."""
    length = prob.lengths[b]
    s = prob.scores(b, 0, length)
    tally = IOCounts()
    out, lse = _safe_partial(s, allowed, prob.v[b, :, :length], tally)
    # the kernel redoes only the flagged rows: charge r of the Nq rows of each head
    d = prob.q.shape[-1]
    rows = int(redo.sum())
    heads = int(redo.any(dim=-1).sum())
    reads = rows * d + heads * 2 * length * d
    writes = rows * (d + 1)
    counts.read(reads)
    counts.write(writes)
    counts.flops += 4 * rows * length * d
    counts.nonmatmul_flops += 4 * rows * length + rows * (d + 2)
    for key, val in (("fallback_reads", reads), ("fallback_writes", writes), ("fallback_rows", rows)):
        counts.extras[key] = counts.extras.get(key, 0) + val
    return out, lse


def _check_range(safe_range: tuple[float, float] | None, prob: _Decode) -> tuple[float, float]:
    if safe_range is None:
        return default_safe_range(prob.q.dtype, max([1, *prob.lengths]))
    try:
        lo, hi = safe_range
    except (TypeError, ValueError):
        raise ValueError(f"safe_range must be a pair (a, b) of finite floats with a < b, got {safe_range!r}") from None
    lo, hi = checks.check_real(lo, "safe_range[0]"), checks.check_real(hi, "safe_range[1]")
    if not lo < hi:
        raise ValueError(f"safe_range must be a pair (a, b) of finite floats with a < b, got {safe_range!r}")
    return lo, hi


def _async_row_block(
    prob: _Decode, b: int, allowed: torch.Tensor, phi: float, lo: float, hi: float, n_splits: int, counts: IOCounts
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """All chunks of batch element b, then the sum of their partials (the merge).

    Returns (num (Hq, Nq, d), den (Hq, Nq), above, below) with the flags
    or-ed over chunks.  IO as Flash-Decoding: q once, K and V once, one
    partial (num d + den 1) written and re-read per split and row, then O and
    LSE written.
    """
    _, hq, nq, d = prob.shape
    num = prob.q.new_zeros(hq, nq, d)
    den = prob.q.new_zeros(hq, nq)
    above = torch.zeros(hq, nq, dtype=torch.bool)
    below = torch.zeros(hq, nq, dtype=torch.bool)
    counts.read(hq * nq * d)
    for start, stop in chunk_bounds(prob.lengths[b], n_splits):
        counts.read(2 * hq * (stop - start) * d)
        s = prob.scores(b, start, stop)
        num_c, den_c, above_c, below_c = _async_chunk(
            s, allowed[:, start:stop], prob.v[b, :, start:stop], phi, lo, hi, counts
        )
        counts.write(hq * nq * (d + 1))
        counts.read(hq * nq * (d + 1))  # the merge re-reads this partial...
        num, den = num + num_c, den + den_c  # ...and adds it: no rescaling, any order
        above, below = above | above_c, below | below_c
    counts.write(hq * nq * (d + 1))
    counts.nonmatmul_flops += hq * nq * (n_splits * (d + 1) + d + 2)
    return num, den, above, below


def flashdecoding_pp(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    phi: float,
    num_splits: int,
    safe_range: tuple[float, float] | None = None,
    cache_seqlens: torch.Tensor | Sequence[int] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] | None = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dtype: torch.dtype | None = torch.float64,
) -> tuple[AttnResult, DecodePPInfo]:
    """FlashDecoding++ decoding with the unified max value ``phi`` (Hong et al. 2023, Section 3).

    Every chunk computes exp(s - phi) directly (``s`` is the fully modified
    score: scaled, softcapped, ALiBi-biased); the partial numerators and
    denominators are summed over chunks; O = num / den, LSE = phi + log den.
    Rows with an allowed score outside ``phi + safe_range`` (default
    :func:`default_safe_range` of the compute dtype with n = max L_b), or
    with non-finite accumulators, are recomputed by the safe path.  ``dtype``
    is the compute dtype of the scores, exp and sums (float16 simulates a
    half-precision kernel; torch may accumulate a reduction internally in
    float32, but every stored partial is rounded to ``dtype``).  Returns
    ``(AttnResult(out, lse, counts), DecodePPInfo)``; counts in the module docstring.
    """
    prob = _prepare(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, dtype=dtype,
    )
    phi = checks.check_real(phi, "phi")
    n_splits = checks.positive_int(num_splits, "num_splits")
    lo, hi = _check_range(safe_range, prob)
    batch, hq, nq, d = prob.shape
    out = prob.q.new_zeros(batch, hq, nq, d)
    lse = prob.q.new_zeros(batch, hq, nq)
    flags = {key: torch.zeros(batch, hq, nq, dtype=torch.bool) for key in ("above", "below", "overflowed")}
    counts = IOCounts()
    for b in range(batch):
        allowed = prob.allowed(b)
        num, den, above, below = _async_row_block(prob, b, allowed, phi, lo, hi, n_splits, counts)
        live = allowed.any(dim=-1).expand(hq, nq)
        bad = live & ~(torch.isfinite(num).all(dim=-1) & torch.isfinite(den) & (den > 0))
        ok = live & ~bad
        den_safe = torch.where(ok, den, torch.ones_like(den))
        out[b] = torch.where(ok.unsqueeze(-1), num / den_safe.unsqueeze(-1), torch.zeros((), dtype=num.dtype))
        lse[b] = torch.where(ok, phi + torch.log(den_safe), torch.full_like(den, -math.inf))
        redo = above | below | bad
        if redo.any():
            safe_out, safe_lse = _fallback(prob, b, allowed, redo, counts)
            out[b] = torch.where(redo.unsqueeze(-1), safe_out, out[b])
            lse[b] = torch.where(redo, safe_lse, lse[b])
        flags["above"][b], flags["below"][b], flags["overflowed"][b] = above, below, bad & ~(above | below)
        counts.extra_memory += n_splits * hq * nq * (d + 1)
    counts.extras["num_splits"] = n_splits
    recomputed = flags["above"] | flags["below"] | flags["overflowed"]
    info = DecodePPInfo(
        phi, (lo, hi), prob.restore(recomputed), *(prob.restore(flags[k]) for k in ("above", "below", "overflowed"))
    )
    return AttnResult(prob.restore(out), prob.restore(lse), counts), info


# ---------------------------------------------------------------------------
# FP8 (e4m3) KV cache
# ---------------------------------------------------------------------------


def quantize_cache_rows(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """What the append of an FP8 cache stores, in float64 (e4m3 values): ``round_e4m3(x / descale)``.

    ``x`` (B, Hk, N, d) new keys or values (any floating dtype), ``descale`` (B, Hk) float32:
    ``x / descale`` is taken in float32 (as the kernel divides), saturated to ±448 and
    rounded to the nearest e4m3 value, ties to even (:func:`flashtile.reference.fp8.round_e4m3`).
    """
    from flashtile.reference.fp8 import round_e4m3

    x = as_float(x, "x", torch.float32)
    scale = as_float(descale, "descale", torch.float32).to(x.device)
    if x.dim() != 4 or tuple(scale.shape) != tuple(x.shape[:2]):
        raise ValueError(f"x must be (B, Hk, N, d) and descale (B, Hk); got {tuple(x.shape)} and {tuple(scale.shape)}")
    return round_e4m3(x / scale[:, :, None, None])


def fp8_cache_decoding(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_descale: torch.Tensor,
    v_descale: torch.Tensor,
    *,
    num_splits: int,
    cache_seqlens: torch.Tensor | Sequence[int] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] | None = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> AttnResult:
    """Float64 twin of decoding against an FP8 KV cache (FA3's per-(batch, kv head) descales).

    ``k_cache`` / ``v_cache`` (B, Hk, Nk, d) hold e4m3 values (``float8_e4m3fn``, or the
    float64 values :func:`quantize_cache_rows` returns), ``k_descale`` / ``v_descale``
    (B, Hk) float32, so key j of kv head h is ``k_descale[b, h] * k_cache[b, h, j]``: a
    product of a 4-bit and a 24-bit significand, exact in float64.  The kernel computes
    ``s = (sm_scale k_descale) q . k8`` and ``O = v_descale (P v8)``, the same numbers up to
    its fp32 / bf16 rounding; this twin is exact attention of the dequantised cache,
    computed by :func:`flash_decoding` (same splits, merge and counts; counts in elements).
    The error of an FP8 cache against float64 attention of the unquantised keys and values
    is this twin's error plus the kernel's: ``docs/decoding.md``, "FP8 KV cache".
    """
    k64 = as_float(k_cache.to(torch.float32) if k_cache.dtype == torch.float8_e4m3fn else k_cache, "k_cache")
    v64 = as_float(v_cache.to(torch.float32) if v_cache.dtype == torch.float8_e4m3fn else v_cache, "v_cache")
    for name, x, c in (("k_descale", k_descale, k64), ("v_descale", v_descale, v64)):
        if not isinstance(x, torch.Tensor) or c.dim() != 4 or tuple(x.shape) != tuple(c.shape[:2]):
            raise ValueError(f"{name} must be a (B, Hk) tensor for caches (B, Hk, Nk, d); got {getattr(x, 'shape', x)}")
    kd = as_float(k_descale, "k_descale").to(k64.device)
    vd = as_float(v_descale, "v_descale").to(v64.device)
    return flash_decoding(
        q, k64 * kd[:, :, None, None], v64 * vd[:, :, None, None], num_splits=num_splits, cache_seqlens=cache_seqlens,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes,
    )


# ---------------------------------------------------------------------------
# shared-prefix (cascade) decoding
# ---------------------------------------------------------------------------


def cascade_decoding(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_splits: int,
    prefix_num_splits: int = 1,
    cache_seqlens: torch.Tensor | Sequence[int] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    softcap: float = 0.0,
) -> AttnResult:
    """Float64 twin of shared-prefix decoding (:func:`flashtile.ops.cascade.cascade_attention_with_kvcache`).

    q (B, Hq, Nq, d); the shared prefix ``prefix_k`` / ``prefix_v`` (1, Hk, P, d); each
    request's own caches (B, Hk, Nk, d) with ``cache_seqlens``.  Request b attends to the P
    prefix keys, all visible, then to keys [0, L_b) of its own cache (``causal`` bottom-right
    aligned on that part):

    1. prefix: the B·Nq query rows of all requests as the rows of one element,
       :func:`flash_decoding` against the prefix (read once: the counts charge it once);
    2. suffix: :func:`flash_decoding` of each request against its own cache;
    3. :func:`merge_partials` of the two partials of every row
       (``o = (e^{lse1} o1 + e^{lse2} o2) / (e^{lse1} + e^{lse2})``, ``lse = logaddexp``).

    Exact: the result is softmax attention over the concatenation (what the tests check).
    """
    q = as_float(q, "q")
    if q.dim() != 4 or prefix_k.dim() != 4 or prefix_k.shape[0] != 1:
        raise ValueError(f"q must be (B, Hq, Nq, d) and prefix_k (1, Hk, P, d); got {tuple(q.shape)}, {tuple(prefix_k.shape)}")
    b, hq, nq, d = q.shape
    rows = q.permute(1, 0, 2, 3).reshape(1, hq, b * nq, d)
    pre = flash_decoding(
        rows, prefix_k, prefix_v, num_splits=prefix_num_splits, softmax_scale=softmax_scale, softcap=softcap,
    )
    own = flash_decoding(
        q, k_cache, v_cache, num_splits=num_splits, cache_seqlens=cache_seqlens, softmax_scale=softmax_scale,
        causal=causal, softcap=softcap,
    )
    o_p = pre.out.reshape(hq, b, nq, d).permute(1, 0, 2, 3)
    l_p = pre.lse.reshape(hq, b, nq).permute(1, 0, 2)
    counts = pre.counts + own.counts
    out, lse = merge_partials(torch.stack([own.out, o_p]), torch.stack([own.lse, l_p]), counts=counts)
    return AttnResult(out, lse, counts)


# ---------------------------------------------------------------------------
# a whole flash_attn_with_kvcache step: gather, rotary, append, leftpad, ragged queries
# ---------------------------------------------------------------------------


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, *, interleaved: bool
) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021, RoFormer, eq. 34) as flash-attn applies it, in float64.

    ``x`` (..., n, H, d), ``positions`` (..., n) integer row indices into ``cos`` / ``sin``
    (seqlen_ro, r) with ``2 r <= d``.  Pair p of the first ``2 r`` dims, ``(2p, 2p + 1)``
    (``interleaved``, GPT-J) or ``(p, p + r)`` (GPT-NeoX), becomes
    ``(x1 cos - x2 sin, x2 cos + x1 sin)`` at angle row ``positions``; the other dims pass through."""
    r = cos.shape[-1]
    x = x.to(torch.float64)
    c = cos.to(torch.float64)[positions.long()].unsqueeze(-2)  # (..., n, 1, r)
    s = sin.to(torch.float64)[positions.long()].unsqueeze(-2)
    rot, rest = x[..., : 2 * r], x[..., 2 * r :]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :r], rot[..., r:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((out, rest), dim=-1)


def kvcache_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: Sequence[int],
    *,
    rotary: tuple[torch.Tensor, torch.Tensor, bool] | None = None,
    cache_batch_idx: Sequence[int] | None = None,
    cache_leftpad: Sequence[int] | None = None,
    cu_seqlens_q: Sequence[int] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    descales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 twin of one ``flash_attn_with_kvcache`` call (flash-attn 2.x semantics, FA3's ragged q).

    Layouts are the op's: q (B, Nq, Hq, d), or (total_q, Hq, d) with ``cu_seqlens_q``; a
    contiguous cache (B_cache, Nk, Hk, d); k, v (B, Nnew, Hk, d) or None.  Per element b, with
    row ``c = cache_batch_idx[b]`` (default b), ``n = cache_seqlens[b]`` and ``p = cache_leftpad[b]``:

    1. new key i is rotated at position ``n + i`` (``rotary = (cos, sin, interleaved)``) and
       written with v at row ``n + i`` of cache row c;
    2. q token t is rotated at ``n + t`` if causal or windowed, else at ``n`` (at most the last
       row of the tables, as the kernel clamps it);
    3. the token attends to keys ``[p, L)``, ``L = n + Nnew``, masks bottom-right aligned to L
       and to its own query count (:func:`flashtile.reference.masks.allowed_mask`, ALiBi's
       distance likewise), an empty row giving 0 and LSE -inf.

    FP8 cache (``descales = (k_descale, v_descale)``, (B, Hk) float32): the caches hold e4m3
    values (``float8_e4m3fn`` or their float64 values); the new rows of step 1 (k after its
    rotation) are stored as :func:`quantize_cache_rows` with element b's descales, and step 3
    attends to the dequantised rows ``descale[b, h] * cache[c, j, h]`` (as :func:`fp8_cache_decoding`;
    the descales belong to q's element b, also when ``cache_batch_idx`` picks row c).

    Returns ``(out, lse, k_cache_after, v_cache_after)`` in float64: out in q's layout, lse
    (B, Hq, Nq) or (Hq, total_q); the caches are updated copies (the inputs are not written;
    FP8: the e4m3 values, not dequantised)."""
    kc, vc = k_cache.to(torch.float64).clone(), v_cache.to(torch.float64).clone()
    batch = len(cache_seqlens)
    rows = list(range(batch)) if cache_batch_idx is None else [int(x) for x in cache_batch_idx]
    pads = [0] * batch if cache_leftpad is None else [int(x) for x in cache_leftpad]
    n_new = 0 if k is None else k.shape[1]
    left, right = normalize_window(bool(causal), window_size)
    local = left >= 0 or right >= 0
    hq, d = q.shape[-2], q.shape[-1]
    hk = kc.shape[2]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    if cu_seqlens_q is None:
        spans = [(b, 0, q.shape[1]) for b in range(batch)]
    else:
        cu = [int(x) for x in cu_seqlens_q]
        spans = [(None, cu[b], cu[b + 1] - cu[b]) for b in range(batch)]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((batch, hq, q.shape[1]) if cu_seqlens_q is None else (hq, q.shape[0]), -math.inf, dtype=torch.float64)
    for b in range(batch):
        n, row, pad = int(cache_seqlens[b]), rows[b], pads[b]
        if n_new:
            kn = k[b].to(torch.float64)
            if rotary is not None:
                kn = apply_rotary(kn, rotary[0], rotary[1], torch.arange(n, n + n_new), interleaved=rotary[2])
            vn = v[b].to(torch.float64)
            if descales is not None:  # rows (Nnew, Hk, d) quantised as the (1, Hk, Nnew, d) of quantize_cache_rows
                kn, vn = (
                    quantize_cache_rows(x.transpose(0, 1)[None], ds[b][None])[0].transpose(0, 1)
                    for x, ds in ((kn, descales[0]), (vn, descales[1]))
                )
            kc[row, n : n + n_new] = kn
            vc[row, n : n + n_new] = vn
        length = n + n_new
        _, start, nq = spans[b]
        qb = q[b] if cu_seqlens_q is None else q[start : start + nq]
        qb = qb.to(torch.float64)
        if rotary is not None:
            pos = torch.arange(n, n + nq) if local else torch.full((nq,), n)
            pos = pos.clamp(max=rotary[0].shape[0] - 1)  # tokens past the table (Nq > Nnew at a full cache) take its last row
            qb = apply_rotary(qb, rotary[0], rotary[1], pos, interleaved=rotary[2])
        kb, vb = kc[row, :length], vc[row, :length]  # (L, Hk, d)
        if descales is not None:
            kb = kb * descales[0][b].to(torch.float64)[None, :, None]
            vb = vb * descales[1][b].to(torch.float64)[None, :, None]
        keys = expand_kv(kb.transpose(0, 1).unsqueeze(0), hq)[0]  # (Hq, L, d)
        vals = expand_kv(vb.transpose(0, 1).unsqueeze(0), hq)[0]
        s = scale * (qb.transpose(0, 1) @ keys.transpose(-1, -2))  # (Hq, nq, L)
        slopes = None
        if alibi_slopes is not None:
            slopes = (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]).to(torch.float64)[None]
        s = apply_score_mods(s.unsqueeze(0), softcap=softcap, alibi_slopes=slopes, nq=nq, nk=length)[0]
        ok = allowed_mask(nq, length, causal=causal, window_size=window_size)
        ok &= torch.arange(length).unsqueeze(0) >= pad
        s = torch.where(ok, s, -math.inf)
        live = ok.any(-1)  # (nq,)
        m = torch.where(live, s.amax(-1), 0.0)
        p = torch.exp(s - m[..., None])
        tot = p.sum(-1)
        o = torch.where(live[:, None], (p @ vals) / torch.where(live, tot, 1.0)[..., None], 0.0)  # (Hq, nq, d)
        l = torch.where(live, m + torch.log(torch.where(live, tot, 1.0)), -math.inf)
        if cu_seqlens_q is None:
            out[b] = o.transpose(0, 1)
            lse[b] = l
        else:
            out[start : start + nq] = o.transpose(0, 1)
            lse[:, start : start + nq] = l
    return out, lse, kc, vc
