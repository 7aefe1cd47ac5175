"""Reference attention forward passes, in float64, instrumented with HBM and FLOP counts.

Every function computes the attention defined in :mod:`flashtile.reference.masks`
(scale, softcap, ALiBi, causal / sliding window, block mask, dropout with an
explicit keep mask; fully masked rows give ``out = 0`` and ``lse = -inf``) and
returns :class:`~flashtile.reference._common.AttnResult` ``(out, lse, counts)``.
They differ in *how* they compute it, which is what the counts record:

* :func:`standard_attention` -- FA1 paper (Dao et al. 2022) Algorithm 0:
  S and P are materialised in HBM.
* :func:`flash_attn1` -- FA1 paper Algorithm 1 (with Algorithm 2's masking and
  dropout), KV-outer / Q-inner, the output normalised at every step; with a
  :class:`~flashtile.reference.masks.BlockMask` it is Algorithm 5,
  block-sparse FlashAttention (:func:`block_sparse_flash_attn`).
* :func:`flash_attn2` -- FA2 paper (Dao 2023) Algorithm 1: Q-outer / KV-inner,
  an unnormalised accumulator, one division at the end, fully masked tiles
  skipped.
* :func:`attention_online_softmax_rows`, :func:`attention_subsum`,
  :func:`attention_subsum_blocked` -- the per-element derivation of FA1 §3
  (and Zihao Ye's note "From Online Softmax to FlashAttention") on one head.

Layout: q (B, Hq, Nq, d), k and v (B, Hk, Nk, d), Hq a multiple of Hk (GQA:
q head h reads kv head h // (Hq // Hk)); 2-D (N, d) and 3-D (H, N, d) inputs
are accepted and the output has the input's rank.  Options (keyword only):
``softmax_scale`` (default 1/sqrt(d)), ``causal``, ``window_size``,
``softcap``, ``alibi_slopes`` (Hq,) or (B, Hq), ``dropout_p`` with
``dropout_mask`` (bool, broadcastable to (B, Hq, Nq, Nk), True = keep; used
whenever given, scaled by 1/(1 - dropout_p)), ``block_mask`` and ``dtype``
(the compute dtype, default float64; None keeps the input's).

Counting (conventions of :mod:`flashtile.reference._common`).  Counts are
summed over batch and heads: each of the B*Hq (batch, q head) pairs is counted
as a per-head algorithm would run it, so under GQA a kv head's K and V are read
once per q head that uses it.  ``flops`` is the matmul work, 2 per
multiply-add: 4*br*bc*d per visited (br x bc) tile.  The explicit dropout mask
is not counted as HBM traffic (a kernel regenerates it on chip from an RNG
state, FA1 Algorithm 2 line 1), and neither is reading the element mask
(a kernel derives it from indices).

``nonmatmul_flops`` counts one per element per arithmetic operation, exactly
as the code below performs them; ``where`` guards against ``-inf - (-inf)``
and masking (a predicate select) are not arithmetic and are not counted:

* each score element: scale (1), softcap ``c*tanh(s/c)`` (+3), ALiBi
  ``slope*dist`` and subtract (+2); dropout on P: keep-multiply and 1/(1-p)
  multiply (+2).
* softmax of a score element inside a tile: rowmax, subtract, exp, rowsum (4),
  plus the divide (1) where the algorithm divides per element (Algorithm 0).
* FA1 per visited tile and row: ``m_new = max`` (1), ``l_new`` = 2 sub +
  2 exp + 2 mul + add (7), ``l_i * e^{m_i - m_new}`` (1) = 9; per output
  element: rescale old O, scale P~V, add, divide by l_new (4).
* FA2 per visited tile and row: ``m_new = max(m, rowmax)`` (1), alpha = sub +
  exp (2), ``alpha * l`` and ``+ rowsum`` (2) = 5; per output element:
  ``alpha * O~`` and ``+ P~V`` (2).  Once per row at the end: divide each
  output element (d) and ``lse = m + log l`` (2).

So FA1 spends ``9*br + 4*br*d`` per visited tile against FA2's
``5*br + 2*br*d`` (FA2 paper §3.1: fewer non-matmul FLOPs).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import torch

from flashtile.reference import _checks as checks
from flashtile.reference._common import AttnResult, IOCounts, check_qkv, expand_kv
from flashtile.reference.masks import BlockMask, allowed_mask, apply_score_mods, normalize_window

__all__ = [
    "standard_attention",
    "flash_attn1",
    "block_sparse_flash_attn",
    "flash_attn2",
    "fa1_block_sizes",
    "attention_online_softmax_rows",
    "attention_subsum",
    "attention_subsum_blocked",
]

_NEG_INF = float("-inf")

# Per-element arithmetic of the score modifiers (module docstring).
_COST_SCALE = 1
_COST_SOFTCAP = 3  # s / c, tanh, * c
_COST_ALIBI = 2  # slope * dist, subtract
_COST_DROPOUT = 2  # * keep, * 1/(1-p)
_COST_TILE_SOFTMAX = 4  # rowmax, subtract, exp, rowsum
_FA1_PER_ROW = 9
_FA1_PER_OUT = 4
_FA2_PER_ROW = 5
_FA2_PER_OUT = 2
_LSE_PER_ROW = 2  # log, add


# ---------------------------------------------------------------------------
# Input validation and the shared problem description
# ---------------------------------------------------------------------------


@dataclass
class _Problem:
    """Canonical inputs of one call: tensors in (B, H, N, d), masks dense over (B, Hq, Nq, Nk)."""

    q: torch.Tensor
    k: torch.Tensor  # expanded to Hq heads (GQA)
    v: torch.Tensor
    added: int  # leading dims check_qkv added; stripped from the outputs
    scale: float
    softcap: float
    alibi: torch.Tensor | None
    dropout_p: float
    keep: torch.Tensor | None  # (B, Hq, Nq, Nk) bool, or None without dropout
    allowed: torch.Tensor  # (B, Hq, Nq, Nk) bool
    block_mask: BlockMask | None

    @property
    def b(self) -> int:
        return self.q.shape[0]

    @property
    def h(self) -> int:
        return self.q.shape[1]

    @property
    def nq(self) -> int:
        return self.q.shape[2]

    @property
    def nk(self) -> int:
        return self.k.shape[2]

    @property
    def d(self) -> int:
        return self.q.shape[3]

    @property
    def heads(self) -> int:
        """B * Hq: the number of per-head problems the counts are summed over."""
        return self.b * self.h

    def score_cost(self) -> int:
        """Arithmetic per score element before the softmax: scale, softcap, ALiBi."""
        return _COST_SCALE + (_COST_SOFTCAP if self.softcap > 0 else 0) + (_COST_ALIBI if self.alibi is not None else 0)

    def dropout_cost(self) -> int:
        return _COST_DROPOUT if self.keep is not None else 0


def _problem(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None,
    causal: bool,
    window_size: Sequence[int] | None,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    dropout_p: float,
    dropout_mask: torch.Tensor | None,
    block_mask: BlockMask | None,
    dtype: torch.dtype | None,
) -> _Problem:
    """Validate every argument and build the dense masks of the masks.py definition."""
    checks.compute_dtype(dtype)
    q, k, v, added = check_qkv(q, k, v, dtype)
    b, h, nq, d = q.shape
    nk = k.shape[2]
    scale = checks.softmax_scale(softmax_scale, d)
    cap = checks.softcap(softcap)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    normalize_window(causal, window_size)  # raises on a bad window before any work
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a flashtile.reference.masks.BlockMask, got {type(block_mask).__name__}")
        block_mask.check_seqlens(nq, nk)
        checks.broadcast_bool(block_mask.mask[..., :1, :1], (b, h, 1, 1), "block_mask.mask leading dims")
    shape = (b, h, nq, nk)
    p, keep = checks.dropout(dropout_p, dropout_mask, shape)
    allowed = allowed_mask(nq, nk, causal=causal, window_size=window_size, block_mask=block_mask, device=q.device)
    allowed = checks.broadcast_bool(allowed, shape, "the element mask")
    return _Problem(
        q=q,
        k=expand_kv(k, h),
        v=expand_kv(v, h),
        added=added,
        scale=scale,
        softcap=cap,
        alibi=checks.alibi_slopes(alibi_slopes, b, h, q.dtype),
        dropout_p=p,
        keep=keep,
        allowed=allowed,
        block_mask=block_mask,
    )


def _restore(x: torch.Tensor, added: int) -> torch.Tensor:
    """Strip the leading unit dims that check_qkv added, so the output has the input's rank."""
    for _ in range(added):
        x = x[0]
    return x


def _ranges(n: int, block: int) -> list[tuple[int, int]]:
    """[start, stop) of each block of ``block`` rows; the last one may be partial."""
    return [(s, min(s + block, n)) for s in range(0, n, block)]


# ---------------------------------------------------------------------------
# Tile arithmetic shared by the algorithms
# ---------------------------------------------------------------------------


def _scores(pb: _Problem, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    """Masked, modified scores of one tile, (B, H, br, bc); -inf where not allowed.

    ``S_ij = scale * Q_i K_j^T`` (FA1 Algorithm 1 line 9), then softcap and
    ALiBi with the tile's global offsets, then the mask (Algorithm 2 line 11).
    """
    (q0, q1), (k0, k1) = rows, cols
    s = pb.scale * (pb.q[:, :, q0:q1] @ pb.k[:, :, k0:k1].transpose(-1, -2))
    s = apply_score_mods(s, softcap=pb.softcap, alibi_slopes=pb.alibi, q_start=q0, k_start=k0, nq=pb.nq, nk=pb.nk)
    return s.masked_fill(~pb.allowed[:, :, q0:q1, k0:k1], _NEG_INF)


def _dropout(pb: _Problem, p: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    """``P * keep / (1 - p)`` on one tile (FA1 Algorithm 2 line 14); P itself when no mask is given."""
    if pb.keep is None:
        return p
    (q0, q1), (k0, k1) = rows, cols
    return p * pb.keep[:, :, q0:q1, k0:k1] * (1.0 / (1.0 - pb.dropout_p))


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """``m`` with -inf replaced by 0: on a masked row every score is -inf, so exp(s - 0) = 0, not NaN."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def _exp_diff(a: torch.Tensor, m_new: torch.Tensor) -> torch.Tensor:
    """``exp(a - m_new)`` with m_new = max(a, ...); 0 (not NaN) where both are -inf."""
    return torch.exp(a - _finite_or_zero(m_new))


def _safe_div(x: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """``x / l`` per row; l = 0 only on rows with nothing allowed, where x = 0 too and the result is 0."""
    l = l.unsqueeze(-1)
    return x / torch.where(l > 0, l, torch.ones_like(l))


def _lse(m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Natural-log sum-exp ``m + log l``; -inf on fully masked rows (m = -inf, l = 0)."""
    return torch.where(l > 0, _finite_or_zero(m) + torch.log(torch.where(l > 0, l, torch.ones_like(l))), _NEG_INF)


# ---------------------------------------------------------------------------
# Algorithm 0: standard attention
# ---------------------------------------------------------------------------


def standard_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] | None = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
    dtype: torch.dtype | None = torch.float64,
) -> AttnResult:
    """Standard attention, FA1 paper Algorithm 0: S and P round-trip through HBM.

    1. read Q, K; ``S = scale * Q K^T``; write S           (Nq*d + Nk*d reads, Nq*Nk writes)
    2. read S; ``P = softmax(S)``; write P                  (Nq*Nk reads, Nq*Nk writes)
    3. read P, V; ``O = P V``; write O                      (Nq*Nk + Nk*d reads, Nq*d writes)

    Per head: ``2(Nq + Nk) d + 4 Nq Nk`` accesses, i.e. ``4Nd + 4N^2`` for
    Nq = Nk = N (Theorem 2: Theta(Nd + N^2)); ``flops = 4 Nq Nk d``.  The score
    modifiers, the mask and dropout are fused into pass 2 (which already
    reads S and writes P), so they add no traffic.  The LSE (Nq per head) is
    not part of Algorithm 0 and is tallied apart in ``extras['lse_writes']``.

    ``extra_memory = 2 Nq Nk`` per head, summed over heads: S and P of all
    (batch, head) pairs are held at once, as a batched implementation does
    (P could overwrite S in place, but Algorithm 0 writes them separately).
    Pass 2 costs 5 nonmatmul flops per element (max, sub, exp, sum, divide)
    plus the score modifiers; the LSE 2 per row.
    """
    pb = _problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, dropout_mask, block_mask, dtype)
    nq, nk, d, heads = pb.nq, pb.nk, pb.d, pb.heads
    rows, cols = (0, nq), (0, nk)
    c = IOCounts()

    c.read(heads * (nq * d + nk * d))  # line 1: Q, K
    s = _scores(pb, rows, cols)
    c.write(heads * nq * nk)  # S

    c.read(heads * nq * nk)  # line 2: S
    m = s.amax(dim=-1) if nk else torch.full(s.shape[:-1], _NEG_INF, dtype=s.dtype)
    e = torch.exp(s - _finite_or_zero(m).unsqueeze(-1))
    l = e.sum(dim=-1)
    p = _safe_div(e, l)
    c.write(heads * nq * nk)  # P

    c.read(heads * (nq * nk + nk * d))  # line 3: P, V
    out = _dropout(pb, p, rows, cols) @ pb.v
    c.write(heads * nq * d)  # O

    c.flops = heads * 4 * nq * nk * d
    c.nonmatmul_flops = heads * (nq * nk * (pb.score_cost() + _COST_TILE_SOFTMAX + 1 + pb.dropout_cost()) + _LSE_PER_ROW * nq)
    c.extra_memory = heads * 2 * nq * nk
    c.visited_blocks = heads
    c.extras["lse_writes"] = heads * nq
    return AttnResult(_restore(out, pb.added), _restore(_lse(m, l), pb.added), c)


# ---------------------------------------------------------------------------
# FA1 Algorithm 1 (and Algorithm 5 with a block mask)
# ---------------------------------------------------------------------------


def fa1_block_sizes(sram_size: int, head_dim: int) -> tuple[int, int]:
    """Block sizes of FA1 Algorithm 1 line 1 from an SRAM of ``M`` elements.

    ``Bc = ceil(M / (4d))``, ``Br = min(ceil(M / (4d)), d)``: the four tiles
    Q_i, K_j, V_j, O_i of (B x d) elements then fit in M.  ``M < d`` cannot hold
    even one row and raises ``ValueError``.
    """
    if isinstance(sram_size, bool) or not isinstance(sram_size, numbers.Integral):
        raise TypeError(f"sram_size must be an int (SRAM size M in elements), got {type(sram_size).__name__}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    if sram_size < head_dim:
        raise ValueError(f"sram_size M = {sram_size} must be >= head_dim d = {head_dim} (one row of Q must fit in SRAM)")
    bc = math.ceil(sram_size / (4 * head_dim))
    return min(bc, head_dim), bc


def _fa1_blocks(
    d: int, sram_size: int | None, block_sizes: Sequence[int] | None, block_mask: BlockMask | None
) -> tuple[int, int]:
    """(Br, Bc) of one FA1 call: from the block mask, else block_sizes, else the SRAM size M."""
    if block_mask is not None:
        if block_sizes is not None and checks.block_sizes(block_sizes) != block_mask.block_size:
            raise ValueError(
                f"block_sizes {tuple(block_sizes)} must equal block_mask.block_size {block_mask.block_size} "
                "(Algorithm 5 tiles by the mask's blocks); omit block_sizes"
            )
        if sram_size is not None:
            fa1_block_sizes(sram_size, d)  # still validated, though the mask fixes the tiles
        return block_mask.block_size
    if (sram_size is None) == (block_sizes is None):
        raise ValueError(
            "flash_attn1 needs exactly one of sram_size (M in elements; Algorithm 1 line 1 derives "
            "Bc = ceil(M/4d), Br = min(Bc, d)) or block_sizes=(Br, Bc)"
        )
    if block_sizes is not None:
        return checks.block_sizes(block_sizes)
    return fa1_block_sizes(sram_size, d)  # type: ignore[arg-type]


def _block_live(pb: _Problem, tr: int, tc: int) -> torch.Tensor:
    """(B, H, Tr, Tc) bool: the tiles Algorithm 5 visits (all of them without a block mask)."""
    if pb.block_mask is None:
        return torch.ones(1, 1, 1, 1, dtype=torch.bool).expand(pb.b, pb.h, tr, tc)
    return torch.broadcast_to(pb.block_mask.mask, (pb.b, pb.h, tr, tc))


def flash_attn1(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sram_size: int | None = None,
    block_sizes: tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] | None = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
    dtype: torch.dtype | None = torch.float64,
) -> AttnResult:
    """FlashAttention, FA1 paper Algorithm 1, literally: KV blocks outside, Q blocks inside.

    Give exactly one of ``sram_size`` (M, line 1: ``Bc = ceil(M/4d)``,
    ``Br = min(ceil(M/4d), d)``) or ``block_sizes=(Br, Bc)``.  Line 2 puts
    ``O = 0``, ``l = 0``, ``m = -inf`` in HBM.  For each KV block j (line 5)
    K_j, V_j are loaded (line 6); for each Q block i (line 7) Q_i, O_i, l_i,
    m_i are loaded (line 8) and

        S_ij  = scale * Q_i K_j^T   (+ softcap, ALiBi, mask: Algorithm 2 line 11)   line 9
        m~_ij = rowmax(S_ij),  P~_ij = exp(S_ij - m~_ij),  l~_ij = rowsum(P~_ij)    line 10
        m_new = max(m_i, m~_ij),  l_new = e^{m_i - m_new} l_i + e^{m~_ij - m_new} l~_ij  line 11
        O_i  <- diag(l_new)^-1 (diag(l_i) e^{m_i - m_new} O_i + e^{m~_ij - m_new} P~_ij V_j)  line 12
        l_i  <- l_new,  m_i <- m_new                                             line 13

    with dropout applied to P~_ij before the product with V_j (Algorithm 2
    line 14; l keeps the undropped sum).  The LSE returned is ``m + log l``.

    HBM per head (reads + writes): ``sum_j [2 bc_j d + sum_i (3 br_i d + 4 br_i)]
    = 2 Nk d + Tc (3 Nq d + 4 Nq)``, which is the paper's
    ``Tc (2 Bc d + Tr (3 Br d + 4 Br))`` when the blocks divide N (partial
    last blocks are allowed).  Not in reads/writes, because Algorithm 1 does
    not count them either: the line-2 initialisation,
    ``extras['init_writes'] = Nq d + 2 Nq`` per head, and the final LSE
    (read m, l; write lse): ``extras['lse_reads'] = 2 Nq``,
    ``extras['lse_writes'] = Nq`` per head.  ``extra_memory`` is l and m,
    ``2 Nq`` per head.

    With ``block_mask`` this is Algorithm 5 (block-sparse FlashAttention):
    the tiles are the mask's blocks (``sram_size`` is then optional and
    ``block_sizes``, if given, must match), a zero block (i, j) costs no HBM
    and no FLOPs, and K_j, V_j are loaded only when column j has a kept block:
    ``sum_{j: column nonempty} 2 bc_j d + sum_{(i,j) kept} (3 br_i d + 4 br_i)``.
    Without a block mask every tile is visited, including tiles that a causal
    or window mask zeroes entirely (Algorithm 1 has no skipping).
    ``visited_blocks`` / ``skipped_blocks`` count tiles per head.
    """
    pb = _problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, dropout_mask, block_mask, dtype)
    br, bc = _fa1_blocks(pb.d, sram_size, block_sizes, block_mask)
    row_blocks, col_blocks = _ranges(pb.nq, br), _ranges(pb.nk, bc)
    live = _block_live(pb, len(row_blocks), len(col_blocks))
    nq, d, heads = pb.nq, pb.d, pb.heads
    c = IOCounts()

    # line 2: O, l, m initialised in HBM
    o = torch.zeros_like(pb.q)
    l = torch.zeros(pb.b, pb.h, nq, dtype=pb.q.dtype)
    m = torch.full_like(l, _NEG_INF)
    c.extras["init_writes"] = heads * (nq * d + 2 * nq)

    for j, cols in enumerate(col_blocks):  # line 5
        if not bool(live[..., j].any()):
            c.skipped_blocks += heads * len(row_blocks)
            continue
        c.read(int(live[..., j].any(dim=-1).sum()) * 2 * (cols[1] - cols[0]) * d)  # line 6: K_j, V_j
        for i, rows in enumerate(row_blocks):  # line 7
            keep = live[:, :, i, j]
            visited = int(keep.sum())
            c.visited_blocks += visited
            c.skipped_blocks += heads - visited
            if visited:
                _fa1_step(pb, c, o, l, m, rows, cols, keep, visited)

    c.extras["lse_reads"] = heads * 2 * nq
    c.extras["lse_writes"] = heads * nq
    c.extras["block_rows"], c.extras["block_cols"] = br, bc
    c.nonmatmul_flops += heads * _LSE_PER_ROW * nq
    c.extra_memory = heads * 2 * nq
    return AttnResult(_restore(o, pb.added), _restore(_lse(m, l), pb.added), c)


def _fa1_step(
    pb: _Problem,
    c: IOCounts,
    o: torch.Tensor,
    l: torch.Tensor,
    m: torch.Tensor,
    rows: tuple[int, int],
    cols: tuple[int, int],
    keep: torch.Tensor,
    visited: int,
) -> None:
    """Lines 8-13 of FA1 Algorithm 1 on tile (i, j), for the heads where ``keep`` (B, H) is True.

    Updates O, l, m (the "HBM" tensors) in place.  Heads whose block is zero
    (Algorithm 5) keep their old rows exactly.
    """
    (q0, q1), (k0, k1) = rows, cols
    br, bc, d = q1 - q0, k1 - k0, pb.d
    c.read(visited * (2 * br * d + 2 * br))  # line 8: Q_i, O_i, l_i, m_i
    o_i, l_i, m_i = o[:, :, q0:q1], l[:, :, q0:q1], m[:, :, q0:q1]

    s = _scores(pb, rows, cols)  # line 9
    m_t = s.amax(dim=-1)  # line 10
    p_t = torch.exp(s - _finite_or_zero(m_t).unsqueeze(-1))
    l_t = p_t.sum(dim=-1)
    m_new = torch.maximum(m_i, m_t)  # line 11
    alpha, beta = _exp_diff(m_i, m_new), _exp_diff(m_t, m_new)
    l_new = alpha * l_i + beta * l_t
    pv = _dropout(pb, p_t, rows, cols) @ pb.v[:, :, k0:k1]  # line 12 (Algorithm 2 line 14: dropout)
    o_new = _safe_div((l_i * alpha).unsqueeze(-1) * o_i + beta.unsqueeze(-1) * pv, l_new)

    sel = keep[:, :, None]
    o[:, :, q0:q1] = torch.where(sel[..., None], o_new, o_i)  # line 12: write O_i
    l[:, :, q0:q1] = torch.where(sel, l_new, l_i)  # line 13
    m[:, :, q0:q1] = torch.where(sel, m_new, m_i)
    c.write(visited * (br * d + 2 * br))

    c.flops += visited * 4 * br * bc * d
    per_elem = pb.score_cost() + _COST_TILE_SOFTMAX + pb.dropout_cost()
    c.nonmatmul_flops += visited * (br * bc * per_elem + br * _FA1_PER_ROW + br * d * _FA1_PER_OUT)


def block_sparse_flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] | None = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    dtype: torch.dtype | None = torch.float64,
) -> AttnResult:
    """Block-sparse FlashAttention, FA1 paper Algorithm 5: :func:`flash_attn1` tiled by ``block_mask``.

    Zero blocks are skipped (no HBM, no FLOPs), so the main-loop HBM count is
    ``sum_{j: column nonempty} 2 bc_j d + sum_{(i,j) kept} (3 br_i d + 4 br_i)``
    per head, shrinking with the fraction of kept blocks (Proposition 4:
    Theta(Nd + N^2 d^2 s / M)).
    """
    if block_mask is None:
        raise ValueError("block_sparse_flash_attn needs a block_mask (flashtile.reference.masks.BlockMask)")
    return flash_attn1(
        q,
        k,
        v,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        dropout_p=dropout_p,
        dropout_mask=dropout_mask,
        block_mask=block_mask,
        dtype=dtype,
    )


# ---------------------------------------------------------------------------
# FA2 Algorithm 1
# ---------------------------------------------------------------------------


def _tile_nonempty(pb: _Problem, br: int, bc: int) -> torch.Tensor:
    """(B, H, Tr, Tc) bool: True where tile (i, j) has at least one allowed element.

    For causal / window masks this is the contiguous band of KV blocks that a
    kernel computes from indices; with a block mask it also drops zero blocks.
    """
    b, h, nq, nk = pb.allowed.shape
    tr, tc = math.ceil(nq / br), math.ceil(nk / bc)
    pad = torch.zeros(b, h, tr * br, tc * bc, dtype=torch.bool)
    pad[:, :, :nq, :nk] = pb.allowed
    return pad.view(b, h, tr, br, tc, bc).any(dim=5).any(dim=3)


def flash_attn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_sizes: tuple[int, int] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] | None = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
    dtype: torch.dtype | None = torch.float64,
) -> AttnResult:
    """FlashAttention-2 forward, FA2 paper Algorithm 1: Q blocks outside, KV blocks inside.

    ``block_sizes=(Br, Bc)`` defaults to (64, 64), or to the block mask's
    block size when ``block_mask`` is given (an explicit different value
    raises).  For each Q block i (line 3), load Q_i (line 4), start
    ``O~ = 0, l = 0, m = -inf`` on chip (line 5), and for each KV block j
    (line 6) that has an allowed element, load K_j, V_j (line 7) and

        S   = scale * Q_i K_j^T  (+ softcap, ALiBi, mask)                    line 8
        m'  = max(m, rowmax(S)),  P~ = exp(S - m'),  l' = e^{m - m'} l + rowsum(P~)  line 9
        O~' = diag(e^{m - m'}) O~ + P~ V_j        (unnormalised, no division)  line 10

    (dropout multiplies P~ before the product with V_j; l keeps the undropped
    sum).  After the loop ``O_i = diag(l)^-1 O~`` (line 12) and
    ``L_i = m + log l`` (line 13) are written (lines 14-15).

    KV blocks with no allowed element for Q block i (beyond the causal
    diagonal, outside the window, or zero in the block mask) are neither
    loaded nor computed: ``skipped_blocks``.  HBM per head:
    ``sum_i [br_i d + sum_{j visited} 2 bc_j d + br_i d + br_i]``.
    ``extra_memory`` is 0: the LSE is an output.
    """
    pb = _problem(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, dropout_mask, block_mask, dtype)
    if block_mask is not None:
        if block_sizes is not None and checks.block_sizes(block_sizes) != block_mask.block_size:
            raise ValueError(
                f"block_sizes {tuple(block_sizes)} must equal block_mask.block_size {block_mask.block_size}; omit block_sizes"
            )
        br, bc = block_mask.block_size
    else:
        br, bc = checks.block_sizes((64, 64) if block_sizes is None else block_sizes)
    live = _tile_nonempty(pb, br, bc)
    out = torch.zeros_like(pb.q)
    lse = torch.full(pb.q.shape[:-1], _NEG_INF, dtype=pb.q.dtype)
    c = IOCounts()
    for i, rows in enumerate(_ranges(pb.nq, br)):  # line 3
        o_i, lse_i = _fa2_row_block(pb, c, live[:, :, i], rows, bc)
        out[:, :, rows[0] : rows[1]] = o_i
        lse[:, :, rows[0] : rows[1]] = lse_i
    c.extras["block_rows"], c.extras["block_cols"] = br, bc
    return AttnResult(_restore(out, pb.added), _restore(lse, pb.added), c)


def _fa2_row_block(
    pb: _Problem, c: IOCounts, live: torch.Tensor, rows: tuple[int, int], bc: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lines 4-15 of FA2 Algorithm 1 for one Q block; ``live`` (B, H, Tc) marks the KV blocks to visit."""
    q0, q1 = rows
    br, d, heads = q1 - q0, pb.d, pb.heads
    c.read(heads * br * d)  # line 4: Q_i
    acc = torch.zeros(pb.b, pb.h, br, d, dtype=pb.q.dtype)  # line 5: O~, l, m on chip
    l = torch.zeros(pb.b, pb.h, br, dtype=pb.q.dtype)
    m = torch.full_like(l, _NEG_INF)
    per_elem = pb.score_cost() + _COST_TILE_SOFTMAX + pb.dropout_cost()

    for j, cols in enumerate(_ranges(pb.nk, bc)):  # line 6
        keep = live[:, :, j]
        visited = int(keep.sum())
        c.visited_blocks += visited
        c.skipped_blocks += heads - visited
        if not visited:
            continue
        k0, k1 = cols
        c.read(visited * 2 * (k1 - k0) * d)  # line 7: K_j, V_j
        s = _scores(pb, rows, cols)  # line 8
        m_new = torch.maximum(m, s.amax(dim=-1))  # line 9
        p = torch.exp(s - _finite_or_zero(m_new).unsqueeze(-1))
        alpha = _exp_diff(m, m_new)
        l_new = alpha * l + p.sum(dim=-1)
        acc_new = alpha.unsqueeze(-1) * acc + _dropout(pb, p, rows, cols) @ pb.v[:, :, k0:k1]  # line 10
        sel = keep[:, :, None]
        m, l, acc = torch.where(sel, m_new, m), torch.where(sel, l_new, l), torch.where(sel[..., None], acc_new, acc)
        c.flops += visited * 4 * br * (k1 - k0) * d
        c.nonmatmul_flops += visited * (br * (k1 - k0) * per_elem + br * _FA2_PER_ROW + br * d * _FA2_PER_OUT)

    o_i = _safe_div(acc, l)  # line 12: the only division by l
    lse_i = _lse(m, l)  # line 13
    c.nonmatmul_flops += heads * (br * d + br * _LSE_PER_ROW)
    c.write(heads * (br * d + br))  # lines 14-15: O_i, L_i
    return o_i, lse_i


# ---------------------------------------------------------------------------
# The per-element derivation (FA1 §3; Ye, "From Online Softmax to FlashAttention")
# ---------------------------------------------------------------------------


def _single_head(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None,
    causal: bool,
    dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """Validate one head (Nq, d), (Nk, d), (Nk, d); return q, k, v, scale and the (Nq, Nk) allowed mask."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if isinstance(x, torch.Tensor) and x.dim() != 2:
            raise ValueError(f"{name} must be 2-D (N, d) for the single-head derivations, got shape {tuple(x.shape)}")
    checks.compute_dtype(dtype)
    q4, k4, v4, _ = check_qkv(q, k, v, dtype)
    qh, kh, vh = q4[0, 0], k4[0, 0], v4[0, 0]
    d = qh.shape[1]
    scale = checks.softmax_scale(softmax_scale, d)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    allowed = allowed_mask(qh.shape[0], kh.shape[0], causal=causal)
    return qh, kh, vh, scale, allowed


def attention_online_softmax_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    dtype: torch.dtype | None = torch.float64,
) -> AttnResult:
    """Two-pass attention per row with the online softmax of Milakov & Gimelshein.

    Materialise the score row ``x_j = scale * q_i . k_j``, then (pass 1) the
    running max and normaliser over j = 1..Nk:

        m_j = max(m_{j-1}, x_j),   d_j = d_{j-1} e^{m_{j-1} - m_j} + e^{x_j - m_j}

    and (pass 2) ``o_i = sum_j e^{x_j - m_N} / d_N  v_j``.  All rows advance
    together (the loop is over j).  Single head (N, d) only, with
    ``softmax_scale`` and ``causal``; counts are arithmetic only (no HBM model):
    ``flops = 4 Nq Nk d`` and 11 nonmatmul flops per score (scale; max, 2 sub,
    2 exp, mul, add; sub, exp, div) plus 2 per row for the LSE.
    """
    qh, kh, vh, scale, allowed = _single_head(q, k, v, softmax_scale, causal, dtype)
    nq, nk, d = qh.shape[0], kh.shape[0], qh.shape[1]
    x = (scale * (qh @ kh.T)).masked_fill(~allowed, _NEG_INF)
    m = torch.full((nq,), _NEG_INF, dtype=qh.dtype)
    den = torch.zeros(nq, dtype=qh.dtype)
    for j in range(nk):  # pass 1: online max and normaliser
        m_new = torch.maximum(m, x[:, j])
        den = den * _exp_diff(m, m_new) + _exp_diff(x[:, j], m_new)
        m = m_new
    p = _safe_div(torch.exp(x - _finite_or_zero(m).unsqueeze(-1)), den)  # pass 2
    c = IOCounts(flops=4 * nq * nk * d, nonmatmul_flops=11 * nq * nk + _LSE_PER_ROW * nq, visited_blocks=1)
    return AttnResult(p @ vh, _lse(m, den), c)


def attention_subsum(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    dtype: torch.dtype | None = torch.float64,
) -> AttnResult:
    """One-pass attention: the output itself follows the online-softmax recurrence.

    With ``x_j = scale * q . k_j`` and the pass-1 recurrence for ``m_j``,
    ``d'_j`` (see :func:`attention_online_softmax_rows`), the partial output

        o'_j = o'_{j-1} d'_{j-1} e^{m_{j-1} - m_j} / d'_j + e^{x_j - m_j} / d'_j  v_j

    equals ``sum_{t<=j} softmax(x_{1..j})_t v_t``, so o'_N is the attention
    output after a single loop over keys.  Single head, ``softmax_scale`` and
    ``causal`` only.  Per score: 11 nonmatmul flops (scale, max, sub+exp
    twice, mul, add, mul + div for the rescale factor, div for the new
    weight) plus d for rescaling o'; ``flops = 4 Nq Nk d``.
    """
    qh, kh, vh, scale, allowed = _single_head(q, k, v, softmax_scale, causal, dtype)
    nq, nk, d = qh.shape[0], kh.shape[0], qh.shape[1]
    x = (scale * (qh @ kh.T)).masked_fill(~allowed, _NEG_INF)
    m = torch.full((nq,), _NEG_INF, dtype=qh.dtype)
    den = torch.zeros(nq, dtype=qh.dtype)
    o = torch.zeros(nq, d, dtype=qh.dtype)
    for j in range(nk):
        m_new = torch.maximum(m, x[:, j])
        carried = den * _exp_diff(m, m_new)  # d'_{j-1} e^{m_{j-1} - m_j}
        weight = _exp_diff(x[:, j], m_new)  # e^{x_j - m_j}
        den_new = carried + weight
        safe = torch.where(den_new > 0, den_new, torch.ones_like(den_new))
        o = o * (carried / safe).unsqueeze(-1) + (weight / safe).unsqueeze(-1) * vh[j]
        m, den = m_new, den_new
    c = IOCounts(flops=4 * nq * nk * d, nonmatmul_flops=nq * nk * (11 + d) + _LSE_PER_ROW * nq, visited_blocks=1)
    return AttnResult(o, _lse(m, den), c)


def attention_subsum_blocked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    dtype: torch.dtype | None = torch.float64,
) -> AttnResult:
    """The one-pass recurrence of :func:`attention_subsum` over tiles of ``block_size`` keys.

    For a tile J of keys, with ``x_J`` its scores:

        m_new = max(m, max_J x),   d_new = d e^{m - m_new} + sum_J e^{x_J - m_new}
        o_new = o d e^{m - m_new} / d_new + sum_J e^{x_J - m_new} / d_new  v_J

    -- the tiling of FA1 §3.1, one row block covering all queries.  Single
    head, ``softmax_scale`` and ``causal`` only.  Per score: 6 nonmatmul flops
    (scale, max, sub, exp, sum, divide by d_new); per row and tile: 6 (max,
    sub, exp, mul, add, divide for the rescale factor) plus d to rescale o;
    ``flops = 4 Nq Nk d``.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    qh, kh, vh, scale, allowed = _single_head(q, k, v, softmax_scale, causal, dtype)
    nq, nk, d = qh.shape[0], kh.shape[0], qh.shape[1]
    m = torch.full((nq,), _NEG_INF, dtype=qh.dtype)
    den = torch.zeros(nq, dtype=qh.dtype)
    o = torch.zeros(nq, d, dtype=qh.dtype)
    tiles = _ranges(nk, int(block_size))
    for k0, k1 in tiles:
        x = (scale * (qh @ kh[k0:k1].T)).masked_fill(~allowed[:, k0:k1], _NEG_INF)
        m_new = torch.maximum(m, x.amax(dim=-1))
        carried = den * _exp_diff(m, m_new)
        w = torch.exp(x - _finite_or_zero(m_new).unsqueeze(-1))
        den_new = carried + w.sum(dim=-1)
        safe = torch.where(den_new > 0, den_new, torch.ones_like(den_new))
        o = o * (carried / safe).unsqueeze(-1) + (w / safe.unsqueeze(-1)) @ vh[k0:k1]
        m, den = m_new, den_new
    c = IOCounts(
        flops=4 * nq * nk * d,
        nonmatmul_flops=6 * nq * nk + len(tiles) * nq * (6 + d) + _LSE_PER_ROW * nq,
        visited_blocks=len(tiles),
    )
    return AttnResult(o, _lse(m, den), c)
