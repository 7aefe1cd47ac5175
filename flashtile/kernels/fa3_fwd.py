"""Hopper (sm_90) attention forward: TMA tensor descriptors feeding wgmma, in Triton.

One program owns one query tile of ``BLOCK_M`` rows of one (batch, head) pair,
as in :mod:`flashtile.kernels.fa2_fwd`, with the same online softmax (base 2,
``scale * log2 e`` folded into the exp2 argument, the division deferred to the
end, LSE in natural log, -inf and a zero output for rows that see no key).
What changes is how tiles move: Q, K, V and O go through per-(batch, head)
tensor descriptors (``tl.make_tensor_descriptor``: the bulk tensor copy engine
loads into shared memory, the wgmma reads its operands from there, and the
descriptor's bounds zero-fill ragged tails, so no load carries a mask).  The
host wrapper is :mod:`flashtile.runtime.fa3_fwd`; device-side descriptors need
``triton.set_allocator`` (it installs one).

Two ways through the kv range of a tile, chosen by ``WARP_SPEC``:

* warp-specialised (``tl.range(..., warp_specialize=True)``): the compiler
  splits the loop into a producer warpgroup issuing the TMA loads and two
  consumer warpgroups of 64 rows each (wgmma and softmax), with ``setmaxnreg``
  moving registers to the consumers.  Triton 3.6's Hopper pass accepts one
  loop with a branch-free body (a second loop, or tiles unrolled beside it,
  fail to compile; a branch in it turns it off), so when any tile may need a
  mask (causal, ragged Nk) every tile gets it;
* unspecialised: two loops, the tiles every row sees in full (no mask work),
  then the tiles crossed by the causal diagonal or the end of K (elementwise
  mask, safe max).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtile.kernels._common import LN2
from flashtile.kernels.block_info import kv_block_range

__all__ = ["fa3_fwd_kernel"]

_LN2 = tl.constexpr(LN2)


@triton.jit
def _head_desc(base, rows, stride_row, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """(rows, HEAD_DIM) descriptor of one head; loads past either bound read 0, stores there are dropped."""
    return tl.make_tensor_descriptor(base, shape=[rows, HEAD_DIM], strides=[stride_row, 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_D])


@triton.jit
def _kv_step(
    acc, l_i, m_i, q, k_desc, v_desc, start_n, last_key, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):
    """One online-softmax update with kv tile [start_n, start_n + BLOCK_N).

    Unmasked scores stay unscaled: ``rowmax(qk) * qk_scale`` is the scaled max
    because the wrapper makes ``qk_scale > 0``."""
    k = k_desc.load([start_n, 0])
    qk = tl.dot(q, k.T)
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        qk = tl.where(offs_n[None, :] <= last_key[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if MASKED:
        # a row with no allowed key so far keeps m = -inf: subtract 0, never -inf - -inf
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.math.exp2(qk * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = v_desc.load([start_n, 0])
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _kv_sweep(
    acc, l_i, m_i, q, k_desc, v_desc, lo, hi, last_key, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """Visit kv tiles lo, lo + BLOCK_N, ... < hi (lo a multiple of BLOCK_N)."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _kv_step(acc, l_i, m_i, q, k_desc, v_desc, start_n, last_key, qk_scale,
                                 BLOCK_N=BLOCK_N, MASKED=MASKED)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["n_heads", "kv_group", "seqlen_q", "seqlen_k", "num_m_tiles"])
def fa3_fwd_kernel(
    Q, K, V, Out, LSE,
    qk_scale,  # softmax_scale * log2(e), > 0
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    n_heads, kv_group, seqlen_q, seqlen_k, num_m_tiles,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, LOG2_BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_N: tl.constexpr, WARP_SPEC: tl.constexpr, O_TMA: tl.constexpr,
):
    """1-D grid of B * Hq * cdiv(Nq, BLOCK_M) programs, query tiles of one head adjacent
    (they share that head's K and V in L2); causal runs each head's tiles last-first,
    the longest rows first."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_M % 64 == 0)  # 64 rows per consumer warpgroup (wgmma M)
    tl.static_assert(BLOCK_N % 16 == 0)
    tl.static_assert(BLOCK_M == 1 << LOG2_BLOCK_M)
    pid = tl.program_id(0)
    bh = pid // num_m_tiles
    tile = pid % num_m_tiles
    if CAUSAL:
        tile = num_m_tiles - 1 - tile
    off_b = (bh // n_heads).to(tl.int64)
    off_h = (bh % n_heads).to(tl.int64)
    off_hk = off_h // kv_group
    start_m = tile * BLOCK_M

    q_desc = _head_desc(Q + off_b * stride_qb + off_h * stride_qh, seqlen_q, stride_qm,
                        HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_M, BLOCK_D=BLOCK_D)
    k_desc = _head_desc(K + off_b * stride_kb + off_hk * stride_kh, seqlen_k, stride_kn,
                        HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_N, BLOCK_D=BLOCK_D)
    v_desc = _head_desc(V + off_b * stride_vb + off_hk * stride_vh, seqlen_k, stride_vn,
                        HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_N, BLOCK_D=BLOCK_D)
    o_base = Out + off_b * stride_ob + off_h * stride_oh
    if O_TMA:
        o_desc = _head_desc(o_base, seqlen_q, stride_om, HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_M, BLOCK_D=BLOCK_D)

    # not from start_m: Triton 3.6's WS pass shifts start_m by 64 rows in consumer 2 and splits the arange too
    offs_m = (tile << LOG2_BLOCK_M) + tl.arange(0, BLOCK_M)
    q = q_desc.load([start_m, 0])
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)

    # key j is allowed for row i iff j <= last_key[i]: j < Nk, and j <= i + Nk - Nq when causal (bottom-right)
    last_key = tl.full((BLOCK_M,), seqlen_k - 1, tl.int32)
    if CAUSAL:
        last_key = tl.minimum(last_key, offs_m + (seqlen_k - seqlen_q))
    # causal is the window (-1, 0); tiles below full_hi are clear of the diagonal and of the end of K
    _lo, _full_lo, full_hi, hi = kv_block_range(start_m, start_m + BLOCK_M, seqlen_q, seqlen_k, -1, 0,
                                                BLOCK_N=BLOCK_N, HAS_LEFT=False, HAS_RIGHT=CAUSAL)
    if WARP_SPEC:  # one loop (see the module docstring); the all-tiles mask still beats two loops at d >= 128
        acc, l_i, m_i = _kv_sweep(acc, l_i, m_i, q, k_desc, v_desc, 0, hi, last_key, qk_scale,
                                  BLOCK_N=BLOCK_N, MASKED=CAUSAL or not EVEN_N, WARP_SPEC=True)
    else:
        acc, l_i, m_i = _kv_sweep(acc, l_i, m_i, q, k_desc, v_desc, 0, full_hi, last_key, qk_scale,
                                  BLOCK_N=BLOCK_N, MASKED=False, WARP_SPEC=False)
        acc, l_i, m_i = _kv_sweep(acc, l_i, m_i, q, k_desc, v_desc, full_hi, hi, last_key, qk_scale,
                                  BLOCK_N=BLOCK_N, MASKED=True, WARP_SPEC=False)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (1.0 / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * _LN2)
    if O_TMA:
        o_desc.store([start_m, 0], out.to(Out.dtype.element_ty))
    else:  # plain stores: no O staging tile in shared memory (with specialisation it is not aliased with Q's)
        offs_d = tl.arange(0, BLOCK_D)
        o_ptrs = o_base + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m < seqlen_q)[:, None] & (offs_d < HEAD_DIM)[None, :])
    tl.store(LSE + bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
