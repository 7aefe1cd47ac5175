"""The tests' one attention oracle and one tolerance table.

:func:`attention_ref` is dense float64 attention written directly from the
documented semantics (README, ``flash_attn_func``'s docstring), independent of
the library: it builds every mask from indices here and imports nothing from
``flashtile``, so a bug in ``flashtile.reference.masks`` shows up as a
disagreement (tests/reference/test_oracle.py cross-checks the two).  For one
(batch b, query head h), query row i, key column j, with ``Nk`` replaced by
``L_b`` when per-batch key lengths ``lens`` are given (decoding):

    s_ij  = scale * <q_i, k_{h // (Hq // Hk), j}>               scale = 1/sqrt(d) by default
    s_ij  = softcap * tanh(s_ij / softcap)                       if softcap > 0
    s_ij -= slope_h * |i + Nk - Nq - j|                           ALiBi, slopes (Hq,) or (B, Hq)
    s_ij += bias_ij                                               additive bias (-inf masks)
    visible_ij = i + Nk - Nq - left <= j <= i + Nk - Nq + right   -1 = unbounded; causal sets right = 0
             and j < L_b and bool bias_ij and block_grid[i // Br, j // Bc]
    lse_i = log sum_{j visible} exp(s_ij)                         -inf when row i sees no key
    o_i   = sum_{j visible} exp(s_ij - lse_i) * keep_ij / (1 - dropout_p) * v_j

A row that sees no key has output 0 and LSE -inf, and zero (not NaN)
gradients: the oracle is differentiable by torch autograd, so the backward
oracle is autograd of the same definition (:func:`attention_ref_grads`).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = [
    "TOLERANCE",
    "assert_close",
    "attention_ref",
    "attention_ref_grads",
    "attention_varlen_ref",
    "attention_varlen_ref_grads",
    "backend",
    "grads_ref",
    "rounding_bounds",
    "rounding_slack",
    "ref_kwargs",
    "scores_ref",
    "tolerance",
]

# --------------------------------------------------------------------------- #
# tolerances: relative to max|ref| (see assert_close), by the precision of the arithmetic
# --------------------------------------------------------------------------- #
TOLERANCE: dict[tuple[torch.dtype, str], float] = {
    # float64 algorithms vs this oracle differ only in the order of float64 sums (1.1e-16 per op, a few
    # hundred terms) and in the conditioning of +-1e4 adversarial logits in the backward
    (torch.float64, "interpreter"): 1e-9,
    (torch.float64, "gpu"): 1e-9,
    # true fp32 (unit roundoff 6e-8) over sums of <= a few hundred terms
    (torch.float32, "interpreter"): 2e-5,
    # tl.dot runs fp32 matmuls in TF32 (10-bit mantissa: unit roundoff 4.9e-4 on each product)
    (torch.float32, "gpu"): 2e-3,
    # fp16 inputs (unit roundoff 4.9e-4), P rounded to fp16 before P @ V, output rounded
    (torch.float16, "interpreter"): 1e-2,
    (torch.float16, "gpu"): 1e-2,
    # bf16 inputs (unit roundoff 3.9e-3), P rounded to bf16 before P @ V, output rounded: ~2.5 u relative
    # to max|ref| (the bound is tol * (|ref| + max|ref|), so 2 tol on the largest entries)
    (torch.bfloat16, "interpreter"): 1e-2,
    (torch.bfloat16, "gpu"): 1e-2,
}


def backend(device: torch.device | str) -> str:
    """'gpu' for a CUDA device (kernels compiled), else 'interpreter' (Triton's interpreter, or plain torch)."""
    return "gpu" if torch.device(device).type == "cuda" else "interpreter"


def tolerance(dtype: torch.dtype, device: torch.device | str = "cpu", *, tf32: bool = True) -> float:
    """The table's entry for ``dtype`` on ``device``.

    ``tf32=False`` for kernels with no matmul (softmax): their fp32 is true fp32 on a GPU too.
    """
    where = backend(device)
    if dtype == torch.float32 and not tf32:
        where = "interpreter"
    return TOLERANCE[(dtype, where)]


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    what: str = "",
    *,
    tol: float | None = None,
    tf32: bool = True,
    magnitude: float | None = None,
    slack: float = 0.0,
) -> None:
    """|actual - expected| <= tol * (|expected| + max|expected|) elementwise; infinities matched exactly, no NaN.

    ``dtype`` / ``device`` default to ``actual``'s (the precision the kernel computed in); ``tol``
    overrides the table.  ``magnitude`` replaces max|expected| where the result cancels to far below
    the size of its terms (dq of a row with one visible key is 0 up to rounding of dO.v - D: pass
    the largest of dq, dk, dv); ``slack`` is added to the absolute tolerance (see :func:`rounding_slack`).
    Shapes must agree exactly.
    """
    dtype = actual.dtype if dtype is None else dtype
    device = actual.device if device is None else device
    tol = tolerance(dtype, device, tf32=tf32) if tol is None else tol
    actual = actual.detach().to(device="cpu", dtype=torch.float64)
    expected = expected.detach().to(device="cpu", dtype=torch.float64)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    finite = torch.isfinite(expected)
    scale = float(expected[finite].abs().max()) if finite.any() else 1.0
    scale = scale if magnitude is None else max(scale, magnitude)
    torch.testing.assert_close(
        actual, expected, rtol=tol, atol=tol * max(scale, 1e-3) + slack, msg=lambda m: f"{what} (tol {tol:g}): {m}"
    )


# --------------------------------------------------------------------------- #
# the oracle
# --------------------------------------------------------------------------- #
def _block_grid(block_mask: object) -> tuple[torch.Tensor, tuple[int, int]]:
    """(grid, (Br, Bc)) from a ``(grid, block_size)`` pair or any object with ``.mask`` and ``.block_size``."""
    if isinstance(block_mask, tuple):
        grid, size = block_mask
    else:
        grid, size = block_mask.mask, block_mask.block_size
    br, bc = (size, size) if isinstance(size, int) else size
    return grid, (int(br), int(bc))


def scores_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    block_mask: object = None,
    lens: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """The modified scores (B, Hq, Nq, Nk) in float64, -inf exactly where key j is not visible to row i.

    Arguments as :func:`attention_ref`; differentiable in q, k (and a float bias).
    """
    f64 = torch.float64
    dev = q.device
    q, k = q.to(f64), k.to(dev, f64)
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    if hk < 1 or hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    k = k[:, torch.arange(hq, device=dev) // (hq // hk)]  # GQA: query head h reads kv head h // (Hq // Hk)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

    s = scale * (q @ k.transpose(-1, -2))
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)

    length = torch.full((b,), nk, dtype=torch.long, device=dev) if lens is None else torch.as_tensor(lens).to(dev, torch.long)
    if length.shape != (b,) or bool((length < 0).any()) or bool((length > nk).any()):
        raise ValueError(f"lens must be (B,) = ({b},) lengths in [0, {nk}], got {length.tolist()}")
    i = torch.arange(nq, device=dev).view(1, 1, nq, 1)
    j = torch.arange(nk, device=dev).view(1, 1, 1, nk)
    diag = i + (length - nq).view(b, 1, 1, 1)  # key column of query row i's bottom-right-aligned diagonal

    if alibi is not None:
        slopes = alibi.to(dev, f64)
        slopes = slopes.view(1, hq, 1, 1) if slopes.dim() == 1 else slopes.view(b, hq, 1, 1)
        s = s - slopes * (diag - j).abs().to(f64)

    left, right = (int(w) for w in window)
    if causal:
        right = 0
    visible = (j < length.view(b, 1, 1, 1)).expand(b, hq, nq, nk)
    if left >= 0:
        visible = visible & (j >= diag - left)
    if right >= 0:
        visible = visible & (j <= diag + right)
    if block_mask is not None:
        grid, (br, bc) = _block_grid(block_mask)
        want = (-(-nq // br), -(-nk // bc))
        if tuple(grid.shape[-2:]) != want:
            raise ValueError(f"block grid {tuple(grid.shape[-2:])} does not tile ({nq}, {nk}) by {(br, bc)}: want {want}")
        dense = grid.to(dev).repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)[..., :nq, :nk]
        visible = visible & dense
    if bias is not None:
        bias = bias.to(dev)
        if bias.dtype == torch.bool:
            visible = visible & bias
        else:
            bias = bias.to(f64)
            visible = visible & (bias != -math.inf)
            s = s + torch.where(visible, bias, 0.0)
    return torch.where(visible, s, -math.inf)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    block_mask: object = None,
    keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    lens: Sequence[int] | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 attention: q (B, Hq, Nq, d), k / v (B, Hk, Nk, d) -> (out (B, Hq, Nq, d), lse (B, Hq, Nq)).

    ``bias`` broadcastable to (B, Hq, Nq, Nk): bool (True = visible) or float (added; -inf masks).
    ``block_mask``: a ``(grid, (Br, Bc))`` pair, grid bool (..., ceil(Nq/Br), ceil(Nk/Bc)) broadcast over
    (B, Hq), or a ``BlockMask`` (read through ``.mask`` / ``.block_size``).  ``keep`` bool broadcastable
    to (B, Hq, Nq, Nk): dropout's keep-mask, kept entries scaled by 1/(1 - dropout_p).  ``lens`` (B,):
    batch element b sees keys [0, L_b) only, every alignment taken with Nk = L_b.  Computed in float64
    on q's device, differentiable in q, k, v (and a float bias).
    """
    masked = scores_ref(
        q, k, scale=scale, causal=causal, window=window, softcap=softcap, alibi=alibi, bias=bias,
        block_mask=block_mask, lens=lens,
    )
    hq, hk = q.shape[1], k.shape[1]
    v = v.to(q.device, torch.float64)[:, torch.arange(hq, device=q.device) // (hq // hk)]
    empty = ~(masked > -math.inf).any(dim=-1, keepdim=True)
    # an empty row takes its LSE over finite zeros, so exp(-inf - lse) = 0 there and no gradient is NaN
    lse = torch.logsumexp(torch.where(empty, 0.0, masked), dim=-1, keepdim=True)
    p = torch.exp(masked - lse)
    if keep is not None:
        p = p * keep.to(q.device, torch.float64) / (1.0 - dropout_p)
    return p @ v, torch.where(empty, -math.inf, lse).squeeze(-1)


def ref_kwargs(
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    block_mask: object = None,
) -> dict:
    """The library's keyword names (flash_attn_func / flashtile.reference) as :func:`attention_ref`'s."""
    return dict(
        scale=softmax_scale, causal=causal, window=window_size, softcap=softcap, alibi=alibi_slopes,
        dropout_p=dropout_p, keep=dropout_mask, block_mask=block_mask,
    )


def grads_ref(out: torch.Tensor, inputs: Sequence[torch.Tensor], dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """d(sum(out * dout)) / d(inputs) by autograd."""
    return torch.autograd.grad(out, tuple(inputs), dout.to(out.device, out.dtype))


def attention_ref_grads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, **kwargs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, dq, dk, dv) in float64: :func:`attention_ref` and its gradients against ``dout``."""
    q, k, v = (x.detach().to(torch.float64).requires_grad_(True) for x in (q, k, v))
    out, lse = attention_ref(q, k, v, **kwargs)
    dq, dk, dv = grads_ref(out, (q, k, v), dout)
    return out.detach(), lse.detach(), dq, dk, dv


def _seq_keys(x: torch.Tensor, lo: int, hi: int, b: int, block_table: torch.Tensor | None) -> torch.Tensor:
    """Rows [lo, hi) of a packed (total, H, d) tensor, or the first hi - lo rows of sequence b's
    pages (pages, page_size, H, d) under ``block_table`` (B, max_pages)."""
    if block_table is None:
        return x[lo:hi]
    n = hi - lo
    pages = block_table[b, : -(-n // x.shape[1])].long().to(x.device)
    return x[pages].reshape(-1, *x.shape[2:])[:n]


def attention_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: Sequence[int] | torch.Tensor,
    cu_seqlens_k: Sequence[int] | torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    alibi: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (variable-length) :func:`attention_ref`: q (total_q, Hq, d), k / v (total_k, Hk, d), or
    paged (pages, page_size, Hk, d) with ``block_table``; sequence b is rows [cu_q[b], cu_q[b + 1]) of q
    and [cu_k[b], cu_k[b + 1]) of k (paged: keys 0 .. cu_k[b + 1] - cu_k[b] - 1 of its pages), attended
    on its own with every alignment taken in its own lengths.  ``alibi`` (Hq,) or (B, Hq); ``keep``
    (B, Hq, >= Lq_b, >= Lk_b), sequence b reading its top-left corner.  Returns (out (total_q, Hq, d),
    lse (Hq, total_q)) in float64, differentiable in q, k, v."""
    cu_q = [int(x) for x in torch.as_tensor(cu_seqlens_q).tolist()]
    cu_k = [int(x) for x in torch.as_tensor(cu_seqlens_k).tolist()]
    outs, lses = [], []
    hq, d = q.shape[1], q.shape[2]
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1).unsqueeze(0)
        kb = _seq_keys(k, cu_k[b], cu_k[b + 1], b, block_table).transpose(0, 1).unsqueeze(0)
        vb = _seq_keys(v, cu_k[b], cu_k[b + 1], b, block_table).transpose(0, 1).unsqueeze(0)
        slopes = alibi if alibi is None or alibi.dim() == 1 else alibi[b : b + 1]
        kp = None if keep is None else keep[b : b + 1, :, : qb.shape[2], : kb.shape[2]]
        o, l = attention_ref(qb, kb, vb, alibi=slopes, keep=kp, **kwargs)
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    if not outs:
        return q.new_zeros((0, hq, d), dtype=torch.float64), q.new_zeros((hq, 0), dtype=torch.float64)
    return torch.cat(outs, 0), torch.cat(lses, 1)


def attention_varlen_ref_grads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, cu_seqlens_q, cu_seqlens_k, **kwargs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, dq, dk, dv) in float64: :func:`attention_varlen_ref` and its gradients against ``dout``
    (rows of k / v outside every sequence get gradient 0)."""
    q, k, v = (x.detach().to(torch.float64).requires_grad_(True) for x in (q, k, v))
    out, lse = attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout.to(out.device, out.dtype), allow_unused=True)
    dq, dk, dv = (torch.zeros_like(x) if g is None else g for x, g in ((q, dq), (k, dk), (v, dv)))
    return out.detach(), lse.detach(), dq, dk, dv


def score_slack(q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype, device: torch.device | str,
                scale: float | None = None) -> float:
    """Bound on the LSE error the score GEMM's rounding causes: ``tol * |scale| * max_ij sum_c |q_ic k_jc|``
    (tol: the table's entry for ``dtype`` on ``device``).  An LSE is a softmax-weighted mean of its row's
    scores plus a term the scores' shifts do not change, so it moves by at most the largest score error; it
    matters where a score cancels to far below its terms (one key with q . k ~ 0).  q, k (B, H, N, d) float64,
    Hq a multiple of Hk."""
    if not q.numel() or not k.numel():
        return 0.0
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else abs(scale)
    group = q.shape[1] // k.shape[1]
    ka = k.abs().repeat_interleave(group, dim=1)
    return tolerance(dtype, device) * scale * float((q.abs() @ ka.transpose(-1, -2)).max())


def rounding_slack(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, dtype: torch.dtype, **kwargs
) -> tuple[float, float, float]:
    """Bounds on the dq, dk errors that storing O in ``dtype`` causes in a FlashAttention backward.

    The backward takes D_i = rowsum(dO_i * O_i) from O as stored (FA2, Algorithm 2), so
    |dD_i| <= u * sum_c |dO_ic O_ic| (u: the unit roundoff of ``dtype``), and with
    dS_ij = P_ij (dP_ij - D_i): |d dq_i| <= scale * |dD_i| * max|k|,
    |d dk_j| <= scale * sum_{i, heads of j's group} P_ij |dD_i| * max|q|.  It matters where a gradient
    cancels to far below the size of its terms (dq of a row with one visible key is exactly 0).
    Inputs (B, H, N, d) in float64; ``kwargs`` as :func:`attention_ref`.  dv gets no such term: 0.
    """
    dq_bound, dk_bound = rounding_bounds(q, k, v, dout, dtype, **kwargs)
    if not dq_bound.numel() or not dk_bound.numel():
        return 0.0, 0.0, 0.0
    return float(dq_bound.max()), float(dk_bound.max()), 0.0


def rounding_bounds(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, dtype: torch.dtype, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rounding_slack`'s bounds per query row and per key: ``(dq_bound (B, Hq, Nq), dk_bound (B, Hk, Nk))``,
    float64 on the inputs' device (a causal call's late keys are seen by few rows: their bound is far below the
    early keys', which the maximum reports)."""
    u = torch.finfo(dtype).eps / 2
    out, lse = attention_ref(q, k, v, **kwargs)
    score_kw = {key: val for key, val in kwargs.items() if key not in ("keep", "dropout_p")}
    p = torch.exp(scores_ref(q, k, **score_kw) - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    delta = u * (dout.to(torch.float64) * out).abs().sum(-1)  # (B, Hq, Nq)
    scale = kwargs.get("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else abs(scale)  # a bound: |scale| (negative scales too)
    b, hq, nq, _ = q.shape
    hk, nk = k.shape[1], k.shape[2]
    if not delta.numel() or not k.numel():
        return delta.new_zeros(b, hq, nq), delta.new_zeros(b, hk, nk)
    per_key = (p * delta.unsqueeze(-1)).sum(-2).view(b, hk, hq // hk, nk).sum(2)
    return scale * delta * float(k.abs().max()), scale * per_key * float(q.abs().max())
