"""FlashAttention-1 forward pass as a Triton teaching kernel (FA1 paper, Algorithm 1).

This kernel follows Algorithm 1 of Dao et al. 2022 line by line, including the
parts that FlashAttention-2 later removed, so that its HBM traffic can be
measured (``ncu``) and compared with the closed form of
:func:`flashtile.iomodel.fa1_hbm`:

    line 1   Bc = ceil(M / 4d),  Br = min(ceil(M / 4d), d)          (host: :func:`fa1_tiles`)
    line 2   O = 0, l = 0, m = -inf written to HBM                   (the kernel itself)
    line 5   for j in 0..Tc-1:                     (KV blocks: OUTER loop)
    line 6       load K_j, V_j
    line 7       for i in 0..Tr-1:                 (query blocks: INNER loop)
    line 8           load Q_i, O_i, l_i, m_i from HBM
    line 9           S_ij = scale * Q_i K_j^T                          (Br x Bc)
    line 10          m~ = rowmax(S_ij), P~ = exp(S_ij - m~), l~ = rowsum(P~)
    line 11          m_new = max(m_i, m~),  l_new = e^{m_i - m_new} l_i + e^{m~ - m_new} l~
    line 12          O_i <- diag(l_new)^-1 (diag(l_i) e^{m_i - m_new} O_i + e^{m~ - m_new} P~ V_j)  -> HBM
    line 13          l_i <- l_new, m_i <- m_new                                                      -> HBM

so every inner step reads and writes O_i, l_i, m_i in HBM and normalises O_i
(FA2 keeps them in registers and divides once).  Per (batch, head):

    2 Nk d + Tc (3 Nq d + 4 Nq)  element accesses,  plus  Nq d + 2 Nq  for line 2,

exactly :func:`flashtile.iomodel.fa1_hbm` and :func:`flashtile.iomodel.fa1_init_writes`
at the tiles the kernel really uses.  Element sizes differ: Q, K, V are in the
input dtype, while O, l, m live in HBM as fp32 (the running O is rescaled Tc
times; rounding it to bf16 at every step would add Tc roundings).  On the last
KV step (j = Tc - 1) line 12 writes O_i straight into the output tensor in the
input dtype instead of the fp32 buffer: that is the "cast at the end", and it
costs no extra pass.

Grid: one program per (batch, head).  Consecutive KV iterations of a program
update the same O rows, so a program that owns a whole (batch, head) is the
only reader and writer of its O, l, m: race-free without atomics.  Inside the
program the stores of step (j, i) and the loads of step (j + 1, i) may be done
by different threads, so a block-level barrier (``tl.debug_barrier``, which is
``__syncthreads`` and orders global memory within the block) follows the
stores of every step.  The price is parallelism: B*H programs, one per SM at
most; that is the FA1-vs-FA2 lesson, not an accident.

Tiles.  ``tl.dot`` needs power-of-two tiles of at least 16, so the paper's
``Br``, ``Bc`` are rounded *down* to a power of two and raised to 16 if
smaller (when ``M < 64 d`` the kernel's tiles then exceed M; documented, not
hidden).  They are also capped (128, and 64 when d > 128) to bound the
registers of the K_j, V_j tiles that stay live across the inner loop and of
the (Br x Bc) score tile.  :func:`fa1_tiles` returns the tiles used; evaluate
the IO model with ``block_sizes=fa1_tiles(M, d)`` to predict the kernel.

Masking.  Causal is bottom-right aligned (key j allowed for row i iff
``j <= i + Nk - Nq``, :mod:`flashtile.reference.masks`).  FA1 did not skip
tiles, and neither does this kernel: every (i, j) tile is visited, masked
elements are set to -inf, and a row with no allowed key so far keeps
``m = -inf, l = 0, O = 0`` (a "safe" max of 0 replaces -inf in the exponents,
so ``exp(-inf - -inf)`` is never evaluated, and O is divided by l only where
``l > 0``).  Fully masked rows therefore end with output 0 (and LSE -inf).
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from flashtile.kernels._common import (
    GRID_X_MAX, SUPPORTED_DTYPES, allowed, check_kernel_tensors, interpreting, mma, unit_last_stride,
)

__all__ = ["fa1_forward", "fa1_tiles", "fa1_grid", "SUPPORTED_DTYPES", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256
_MIN_TILE = 16  # smallest tl.dot operand dimension
_MAX_TILE = 128


# --------------------------------------------------------------------------- #
# Triton kernel
# --------------------------------------------------------------------------- #
@triton.jit
def _safe(m):
    """-inf -> 0, so that ``x - safe(m)`` stays -inf (not NaN) on rows with no key yet."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _init_state(o_base, l_base, m_base, stride_om, seqlen_q, offs_d, head_dim,
                BLOCK_M: tl.constexpr):
    """Algorithm 1 line 2: O = 0 (Nq x d), l = 0, m = -inf (Nq) in HBM, for this head."""
    offs_r = tl.arange(0, BLOCK_M)
    for start_m in range(0, seqlen_q, BLOCK_M):
        offs_m = start_m + offs_r
        row_ok = offs_m < seqlen_q
        o_ptrs = o_base + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :]
        tl.store(o_ptrs, tl.zeros((BLOCK_M, offs_d.shape[0]), tl.float32),
                 mask=row_ok[:, None] & (offs_d < head_dim)[None, :])
        tl.store(l_base + offs_m, tl.zeros((BLOCK_M,), tl.float32), mask=row_ok)
        tl.store(m_base + offs_m, tl.full((BLOCK_M,), float("-inf"), tl.float32), mask=row_ok)


@triton.jit
def _inner_step(
    k, v,  # K_j^T (BLOCK_D, BLOCK_N) and V_j (BLOCK_N, BLOCK_D), on chip for the whole inner loop
    q_base, o_base, out_base, l_base, m_base,
    stride_qm, stride_om, stride_outm,
    start_m, offs_n, offs_d, seqlen_q, seqlen_k, head_dim, sm_scale, is_last,
    BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, EVEN_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Lines 8-13 of Algorithm 1 for query block i = start_m / BLOCK_M and the given K_j, V_j."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m64 = offs_m.to(tl.int64)
    row_ok = offs_m < seqlen_q
    tile_ok = row_ok[:, None] & (offs_d < head_dim)[None, :]

    # line 8: Q_i, O_i, l_i, m_i from HBM (rows past Nq read as an empty state and are never stored)
    q = tl.load(q_base + m64[:, None] * stride_qm + offs_d[None, :], mask=tile_ok, other=0.0)
    o_ptrs = o_base + m64[:, None] * stride_om + offs_d[None, :]
    o = tl.load(o_ptrs, mask=tile_ok, other=0.0)
    l_i = tl.load(l_base + offs_m, mask=row_ok, other=0.0)
    m_i = tl.load(m_base + offs_m, mask=row_ok, other=float("-inf"))

    # line 9: S_ij = scale * Q_i K_j^T, masked elements -inf (no tile is skipped)
    s = mma(q, k, None, DOT_PRECISION, UPCAST_DOT) * sm_scale
    if CAUSAL or not EVEN_N:
        ok = allowed(offs_m, offs_n, seqlen_q, seqlen_k, -1, 0, not EVEN_N, False, CAUSAL)
        s = tl.where(ok, s, float("-inf"))

    # line 10: block statistics
    m_t = tl.max(s, 1)
    p = tl.exp(s - _safe(m_t)[:, None])
    l_t = tl.sum(p, 1)

    # line 11: merged statistics
    m_new = tl.maximum(m_i, m_t)
    alpha = tl.exp(m_i - _safe(m_new))  # e^{m_i - m_new}
    beta = tl.exp(m_t - _safe(m_new))  # e^{m~ - m_new}
    l_new = alpha * l_i + beta * l_t

    # line 12: rescale the old (normalised) O_i back to a numerator, add P~ V_j, renormalise.
    # P~ is rounded to V's dtype for the tensor-core GEMM, as in every FlashAttention kernel.
    pv = mma(p.to(v.dtype), v, None, DOT_PRECISION, UPCAST_DOT)
    num = (l_i * alpha)[:, None] * o + beta[:, None] * pv
    inv_l = 1.0 / tl.where(l_new > 0.0, l_new, 1.0)  # l_new = 0 only where num = 0 (no key yet)
    o = num * inv_l[:, None]
    if is_last:  # the last KV step writes the result, in the input dtype, to the output
        out_ptrs = out_base + m64[:, None] * stride_outm + offs_d[None, :]
        tl.store(out_ptrs, o.to(out_base.dtype.element_ty), mask=tile_ok)
    else:
        tl.store(o_ptrs, o, mask=tile_ok)
    # line 13
    tl.store(l_base + offs_m, l_new, mask=row_ok)
    tl.store(m_base + offs_m, m_new, mask=row_ok)
    # the next KV step reads these rows back, possibly in other threads of the block
    tl.debug_barrier()


@triton.heuristics({"EVEN_N": lambda a: a["seqlen_k"] % a["BLOCK_N"] == 0})
@triton.jit
def _fa1_fwd_kernel(
    Q, K, V, Out, O32, L, M,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_outb, stride_outh, stride_outm,
    n_heads, seqlen_q, seqlen_k, head_dim, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Grid (B * H,): program bh runs all of Algorithm 1 for one (batch, head).

    O32 (B*H, Nq, BLOCK_D) fp32, L and M (B*H, Nq) fp32 are the HBM state of line 2."""
    bh = tl.program_id(0)
    off_b = bh // n_heads
    off_h = bh % n_heads
    bh64 = bh.to(tl.int64)
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = K + off_b.to(tl.int64) * stride_kb + off_h.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_h.to(tl.int64) * stride_vh
    out_base = Out + off_b.to(tl.int64) * stride_outb + off_h.to(tl.int64) * stride_outh
    o_base = O32 + bh64 * seqlen_q * BLOCK_D
    l_base = L + bh64 * seqlen_q
    m_base = M + bh64 * seqlen_q
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim

    _init_state(o_base, l_base, m_base, BLOCK_D, seqlen_q, offs_d, head_dim, BLOCK_M)  # line 2
    tl.debug_barrier()

    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(0, seqlen_k, BLOCK_N):  # line 5
        offs_n = start_n + offs_n0
        n64 = offs_n.to(tl.int64)
        kv_ok = offs_n < seqlen_k
        # line 6: K_j (loaded transposed, BLOCK_D x BLOCK_N) and V_j
        k = tl.load(k_base + n64[None, :] * stride_kn + offs_d[:, None], mask=kv_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_base + n64[:, None] * stride_vn + offs_d[None, :], mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        is_last = start_n + BLOCK_N >= seqlen_k
        for start_m in range(0, seqlen_q, BLOCK_M):  # line 7
            _inner_step(
                k, v, q_base, o_base, out_base, l_base, m_base,
                stride_qm, BLOCK_D, stride_outm,
                start_m, offs_n, offs_d, seqlen_q, seqlen_k, head_dim, sm_scale, is_last,
                BLOCK_M, CAUSAL, EVEN_N, DOT_PRECISION, UPCAST_DOT,
            )


# --------------------------------------------------------------------------- #
# Tiles
# --------------------------------------------------------------------------- #
def _pow2_floor(x: int) -> int:
    return 1 << (int(x).bit_length() - 1)


def fa1_tiles(sram_elems: int, d: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) the kernel uses for an SRAM of ``sram_elems`` elements (M) and head dim d.

    Algorithm 1 line 1 gives ``Bc = ceil(M / 4d)``, ``Br = min(Bc, d)``; each is
    rounded down to a power of two (tl.dot tiles), then clamped to
    [16, 128] (to [16, 64] when d > 128): so for ``M < 64 d`` the tiles are
    larger than the paper's, and for large M smaller.
    """
    _check_sram(sram_elems, d)
    bc = -(-sram_elems // (4 * d))
    br = min(bc, d)
    cap = _MAX_TILE if d <= 128 else _MAX_TILE // 2

    def clamp(x: int) -> int:
        return min(max(_pow2_floor(x), _MIN_TILE), cap)

    return clamp(br), clamp(bc)


def _num_warps(block_m: int, block_n: int) -> int:
    # the score tile is block_m x block_n fp32; keep it near 32 registers per thread
    return 4 if block_m * block_n <= 64 * 64 else 8


def fa1_grid(b: int, h: int) -> tuple[int]:
    """One program per (batch, head) on grid axis x (CUDA allows 2^31 - 1 there; y and z only 65535)."""
    if b * h > GRID_X_MAX:
        raise ValueError(f"batch * heads = {b * h} exceeds the {GRID_X_MAX} programs FA1's grid allows")
    return (b * h,)


# --------------------------------------------------------------------------- #
# Python wrapper
# --------------------------------------------------------------------------- #
def _check_sram(sram_elems: object, d: int) -> None:
    if isinstance(sram_elems, bool) or not isinstance(sram_elems, numbers.Integral):
        raise TypeError(f"sram_elems must be an int (SRAM size M in elements), got {type(sram_elems).__name__}")
    if sram_elems < d:
        raise ValueError(f"sram_elems (M) must be >= head_dim d = {d} so one row fits in SRAM, got {sram_elems}")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check_kernel_tensors(("q", "k", "v"), (q, k, v))
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} must equal v shape {tuple(v.shape)}")
    b, h, _, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d):
        raise ValueError(
            f"k and v must be (B, H, Nk, d) = ({b}, {h}, Nk, {d}) like q (FA1 has no GQA), got {tuple(k.shape)}"
        )
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {d}")


def fa1_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sram_elems: int,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-1 forward (Algorithm 1) with tiles from an SRAM of ``sram_elems`` elements.

    q: (B, H, Nq, d); k, v: (B, H, Nk, d); one dtype among fp16 / bf16 / fp32;
    any strides (a non-unit stride on d is copied); 1 <= d <= 256 and
    ``sram_elems >= d``.  ``softmax_scale`` defaults to 1/sqrt(d); ``causal`` is
    bottom-right aligned.  Returns the output (B, H, Nq, d) in q's dtype, and
    with ``return_lse=True`` also the natural-log LSE (B, H, Nq) fp32,
    ``m + log l`` from the HBM state (-inf on rows that see no key).
    """
    _check_inputs(q, k, v)
    b, h, nq, d = q.shape
    nk = k.shape[2]
    _check_sram(sram_elems, d)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be a finite float or None, got {softmax_scale}")
    device = q.device
    out = torch.empty((b, h, nq, d), dtype=q.dtype, device=device)
    lse_state = torch.empty((2, b * h, nq), dtype=torch.float32, device=device)  # line 2's l and m
    if b * h * nq == 0 or nk == 0:  # nothing to attend to: every row is empty
        out.zero_()
        lse = torch.full((b, h, nq), float("-inf"), dtype=torch.float32, device=device)
        return (out, lse) if return_lse else out
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)

    block_m, block_n = fa1_tiles(sram_elems, d)
    block_d = max(_MIN_TILE, triton.next_power_of_2(d))
    o32 = torch.empty((b * h, nq, block_d), dtype=torch.float32, device=device)
    l_hbm, m_hbm = lse_state[0], lse_state[1]
    _fa1_fwd_kernel[fa1_grid(b, h)](
        q, k, v, out, o32, l_hbm, m_hbm,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        h, nq, nk, d, scale,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, CAUSAL=causal,
        DOT_PRECISION="tf32",  # fp32 inputs on TF32 tensor cores; fp16 / bf16 ignore it
        UPCAST_DOT=q.dtype == torch.bfloat16 and interpreting(device),
        num_warps=_num_warps(block_m, block_n), num_stages=1,
    )
    if not return_lse:
        return out
    l_fin, m_fin = l_hbm.view(b, h, nq), m_hbm.view(b, h, nq)
    empty = l_fin == 0
    lse = torch.where(empty, float("-inf"), m_fin + torch.log(torch.where(empty, 1.0, l_fin)))
    return out, lse
