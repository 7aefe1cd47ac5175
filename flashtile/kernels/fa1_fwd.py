"""FlashAttention-1 forward kernel (FA1 paper, Algorithm 1 line by line, for teaching and the IO lab): jit code only.

Host side (tiles from the SRAM size, grid, checks, launch): :mod:`flashtile.runtime.fa1_fwd`;
the algorithm and its HBM traffic are written up in ``docs/fa1.md``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtile.kernels._common import mma
from flashtile.kernels.mask import allowed


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
