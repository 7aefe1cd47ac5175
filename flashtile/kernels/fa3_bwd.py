"""Hopper (sm_90) attention backward: TMA tensor descriptors feeding wgmma, in Triton.

The algorithm is FlashAttention-2's backward (Dao 2023, Algorithm 2; :mod:`flashtile.kernels.fa2_bwd`)
for the plain case (no softcap, ALiBi, bias, dropout, window other than causal), split in two
kernels after D = rowsum(dO o O) (FA2's ``_bwd_preprocess``):

* ``fa3_bwd_dkdv_kernel``: one kv tile of ``BLOCK_N`` keys of one *q* head per program; K_j, V_j
  are loaded once (descriptor -> shared memory), then the loop over the q tiles that see the kv
  tile loads Q_i, dO_i by descriptor and the LSE_i, D_i rows, and in transposed orientation (the
  score tile as wgmma's register A operand, as FA2's dK/dV kernel)

      S^T = K_j Q_i^T,  P^T = exp2(S^T scale log2e - LSE_i log2e),  dV_j += P^T dO_i,
      dP^T = V_j dO_i^T,  dS^T = P^T o (dP^T - D_i),  dK_j += dS^T Q_i  (scaled at the end).

  Warp-specialised (``WARP_SPEC``), the two consumer warpgroups own 64 kv rows each
  (``BLOCK_N = 128``): dK/dV reduce over q rows, which stay whole in each consumer.
  GQA: specialised, a program owns one q head and, with ``group > 1``, writes fp32 partial dK,
  dV of its q head (the host sums each group: Triton 3.6's specialisation takes one loop, so
  the q heads of a group cannot be a loop around it); unspecialised (``GROUP_LOOP``), a program
  owns one kv head and sweeps its group's q heads, dK, dV reduced in registers;
* dQ by fp32 atomics inside the dK/dV loop (``ATOMIC_DQ``, unspecialised configs with
  ``deterministic=False``; the specialisation pass fails on an atomic in its loop), or
* ``fa3_bwd_dq_kernel``: one q tile per program, loop over kv tiles (K_j, V_j by descriptor):
  dQ_i += dS K_j, one writer per row (deterministic, no atomics).  ``WARP_SPEC`` does not
  compile with Triton 3.6 (``WSLowerToken.cpp:73`` assertion in ``NVGPUWarpSpecialization``,
  offline, sm_90a): the third wgmma, dS K_j, is what trips it (with it replaced by a row sum the
  loop specialises; loading K_j a second time for it does not help), so the table runs it
  unspecialised, band and diagonal in two loops.

Ragged tails need no element mask: descriptors zero-fill Q, dO, K, V past the sequence, an
LSE of +inf (rows past Nq, or rows with no key, LSE -inf) makes P exactly 0 there, and a zero
K or V row contributes nothing to dQ; stores past the end are dropped.  Causal (bottom-right)
masks elementwise on the tiles that the diagonal crosses; with specialisation on every tile
(one branch-free loop).  Row indices on the split axis come from ``tile << LOG2_BLOCK`` (Triton
3.6's pass shifts a ``tile * BLOCK`` base by 64 rows in the second consumer and splits the
``arange`` too: see :mod:`flashtile.kernels.fa3_fwd`).  Host side: :mod:`flashtile.runtime.fa3_bwd`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtile.kernels._common import LOG2E, head_desc, query_tile
from flashtile.kernels.block_info import kv_block_range, q_block_range

__all__ = ["fa3_bwd_dkdv_kernel", "fa3_bwd_dq_kernel"]

_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _lse2(LSEh, offs_m, seqlen_q):
    """LSE_i log2(e) of the rows, +inf for rows past Nq and rows with no key (LSE -inf): P = 0 there."""
    lse = tl.load(LSEh + offs_m, mask=offs_m < seqlen_q, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E


@triton.jit
def _store_rows(base, x, offs_r, stride_r, n_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Plain masked store of a (rows, BLOCK_D) tile (no TMA staging tile in shared memory)."""
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = base + offs_r.to(tl.int64)[:, None] * stride_r + offs_d[None, :]
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=(offs_r < n_rows)[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def _dkdv_step(dk, dv, k, v, q_desc, do_desc, LSEh, Deltah, DQh, stride_dqm, start_m, offs_n, shift, seqlen_q,
               scale_log2, softmax_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
               MASKED: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """One q tile [start_m, start_m + BLOCK_M) into the kv tile's dK, dV (transposed orientation)."""
    q = q_desc.load([start_m, 0])
    do = do_desc.load([start_m, 0])
    offs_m = start_m + tl.arange(0, BLOCK_M)
    lse2 = _lse2(LSEh, offs_m, seqlen_q)
    delta = tl.load(Deltah + offs_m, mask=offs_m < seqlen_q, other=0.0)
    st = tl.dot(k, q.T)
    pt = tl.math.exp2(st * scale_log2 - lse2[None, :])
    if MASKED:  # key n sees row m iff n <= m + Nk - Nq
        pt = tl.where(offs_n[:, None] <= offs_m[None, :] + shift, pt, 0.0)
    dv = tl.dot(pt.to(do.dtype), do, dv)
    dpt = tl.dot(v, do.T)
    dst = pt * (dpt - delta[None, :])
    dst = dst.to(q.dtype)
    dk = tl.dot(dst, q, dk)
    if ATOMIC_DQ:  # unspecialised only (the pass fails on an atomic in the loop): dQ_i += scale dS K_j, fp32
        dq = tl.dot(tl.trans(dst), k) * softmax_scale
        offs_d = tl.arange(0, BLOCK_D)
        ptrs = DQh + offs_m.to(tl.int64)[:, None] * stride_dqm + offs_d[None, :]
        tl.atomic_add(ptrs, dq, mask=(offs_m < seqlen_q)[:, None] & (offs_d < HEAD_DIM)[None, :], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["n_heads", "kv_group", "seqlen_q", "seqlen_k", "num_n_tiles"])
def fa3_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV, DQacc,
    softmax_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqm,
    n_heads, kv_group, seqlen_q, seqlen_k, num_n_tiles,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOG2_BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WARP_SPEC: tl.constexpr, GROUP_LOOP: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):
    """1-D grid of B * H * cdiv(Nk, BLOCK_N) programs, kv tiles of one head adjacent.  H is the q heads
    (DK, DV indexed by q head: the outputs when ``kv_group == 1``, else fp32 partials) unless
    ``GROUP_LOOP`` (unspecialised only): then H is the kv heads and each program sweeps the q heads of
    its group, dK, dV reduced in registers."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_N % 64 == 0)  # 64 kv rows per consumer warpgroup (wgmma M)
    tl.static_assert(BLOCK_M % 16 == 0)
    tl.static_assert(BLOCK_N == 1 << LOG2_BLOCK_N)
    tl.static_assert(not (WARP_SPEC and GROUP_LOOP))  # the specialisation pass takes one loop, not two nested
    tl.static_assert(not (WARP_SPEC and ATOMIC_DQ))  # nor an atomic in it
    pid = tl.program_id(0)
    bh = pid // num_n_tiles
    tile = pid % num_n_tiles
    if GROUP_LOOP:
        n_kv_heads = n_heads // kv_group
        off_b = (bh // n_kv_heads).to(tl.int64)
        off_hk = (bh % n_kv_heads).to(tl.int64)
        off_h0 = off_hk * kv_group
        off_out = off_hk
    else:
        off_b = (bh // n_heads).to(tl.int64)
        off_h0 = (bh % n_heads).to(tl.int64)
        off_hk = off_h0 // kv_group
        off_out = off_h0
    start_n = tile * BLOCK_N
    scale_log2 = softmax_scale * _LOG2E

    k_desc = head_desc(K + off_b * stride_kb + off_hk * stride_kh, seqlen_k, stride_kn,
                        HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_N, BLOCK_D=BLOCK_D)
    v_desc = head_desc(V + off_b * stride_vb + off_hk * stride_vh, seqlen_k, stride_vn,
                        HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_N, BLOCK_D=BLOCK_D)
    # not from start_n: see the module docstring (the specialisation pass splits this axis)
    offs_n = (tile << LOG2_BLOCK_N) + tl.arange(0, BLOCK_N)
    k = k_desc.load([start_n, 0])
    v = v_desc.load([start_n, 0])
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    shift = seqlen_k - seqlen_q
    # causal is the window (-1, 0): q tiles from lo see the kv tile, those from full_lo see all of it
    lo, full_lo, _full_hi, hi = q_block_range(start_n, start_n + BLOCK_N, seqlen_q, seqlen_k, -1, 0,
                                              BLOCK_M=BLOCK_M, HAS_LEFT=False, HAS_RIGHT=CAUSAL)
    if WARP_SPEC:  # one branch-free loop: every tile takes the mask when causal
        q_desc = head_desc(Q + off_b * stride_qb + off_h0 * stride_qh, seqlen_q, stride_qm,
                            HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_M, BLOCK_D=BLOCK_D)
        do_desc = head_desc(DO + off_b * stride_dob + off_h0 * stride_doh, seqlen_q, stride_dom,
                             HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_M, BLOCK_D=BLOCK_D)
        LSEh = LSE + (off_b * n_heads + off_h0) * seqlen_q
        Deltah = Delta + (off_b * n_heads + off_h0) * seqlen_q
        for start_m in tl.range(lo, hi, BLOCK_M, warp_specialize=True):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            dk, dv = _dkdv_step(dk, dv, k, v, q_desc, do_desc, LSEh, Deltah, DQacc, stride_dqm, start_m, offs_n,
                                shift, seqlen_q, scale_log2, softmax_scale, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                                BLOCK_M=BLOCK_M, MASKED=CAUSAL, ATOMIC_DQ=False)
    else:
        for g in range(0, kv_group if GROUP_LOOP else 1):
            off_h = off_h0 + g
            q_desc = head_desc(Q + off_b * stride_qb + off_h * stride_qh, seqlen_q, stride_qm,
                                HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_M, BLOCK_D=BLOCK_D)
            do_desc = head_desc(DO + off_b * stride_dob + off_h * stride_doh, seqlen_q, stride_dom,
                                 HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_M, BLOCK_D=BLOCK_D)
            LSEh = LSE + (off_b * n_heads + off_h) * seqlen_q
            Deltah = Delta + (off_b * n_heads + off_h) * seqlen_q
            DQh = DQacc + off_b * stride_dqb + off_h * stride_dqh
            # the diagonal tiles masked, then the band unmasked
            for start_m in tl.range(lo, full_lo, BLOCK_M):
                start_m = tl.multiple_of(start_m, BLOCK_M)
                dk, dv = _dkdv_step(dk, dv, k, v, q_desc, do_desc, LSEh, Deltah, DQh, stride_dqm, start_m, offs_n,
                                    shift, seqlen_q, scale_log2, softmax_scale, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                                    BLOCK_M=BLOCK_M, MASKED=True, ATOMIC_DQ=ATOMIC_DQ)
            for start_m in tl.range(full_lo, hi, BLOCK_M):
                start_m = tl.multiple_of(start_m, BLOCK_M)
                dk, dv = _dkdv_step(dk, dv, k, v, q_desc, do_desc, LSEh, Deltah, DQh, stride_dqm, start_m, offs_n,
                                    shift, seqlen_q, scale_log2, softmax_scale, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                                    BLOCK_M=BLOCK_M, MASKED=False, ATOMIC_DQ=ATOMIC_DQ)

    dk = dk * softmax_scale
    _store_rows(DK + off_b * stride_dkb + off_out * stride_dkh, dk, offs_n, stride_dkn, seqlen_k,
                HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D)
    _store_rows(DV + off_b * stride_dvb + off_out * stride_dvh, dv, offs_n, stride_dvn, seqlen_k,
                HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D)


@triton.jit
def _dq_step(dq, q, do, lse2, delta, k_desc, v_desc, start_n, offs_m, shift, scale_log2,
             BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """One kv tile [start_n, start_n + BLOCK_N) into the q tile's dQ (unscaled)."""
    k = k_desc.load([start_n, 0])
    v = v_desc.load([start_n, 0])
    s = tl.dot(q, k.T)
    p = tl.math.exp2(s * scale_log2 - lse2[:, None])
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        p = tl.where(offs_n[None, :] <= offs_m[:, None] + shift, p, 0.0)
    dp = tl.dot(do, v.T)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq)


@triton.jit(do_not_specialize=["n_heads", "kv_group", "seqlen_q", "seqlen_k", "num_m_tiles"])
def fa3_bwd_dq_kernel(
    Q, K, V, DO, LSE, Delta, DQ,
    softmax_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    n_heads, kv_group, seqlen_q, seqlen_k, num_m_tiles,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, LOG2_BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """1-D grid of B * Hq * cdiv(Nq, BLOCK_M) programs; causal runs each head's tiles last-first."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_M % 64 == 0)
    tl.static_assert(BLOCK_N % 16 == 0)
    tl.static_assert(BLOCK_M == 1 << LOG2_BLOCK_M)
    bh, tile, off_b, off_h, off_hk = query_tile(num_m_tiles, n_heads, kv_group, LAST_FIRST=CAUSAL)
    start_m = tile * BLOCK_M
    scale_log2 = softmax_scale * _LOG2E

    q_desc = head_desc(Q + off_b * stride_qb + off_h * stride_qh, seqlen_q, stride_qm,
                        HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_M, BLOCK_D=BLOCK_D)
    do_desc = head_desc(DO + off_b * stride_dob + off_h * stride_doh, seqlen_q, stride_dom,
                         HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_M, BLOCK_D=BLOCK_D)
    k_desc = head_desc(K + off_b * stride_kb + off_hk * stride_kh, seqlen_k, stride_kn,
                        HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_N, BLOCK_D=BLOCK_D)
    v_desc = head_desc(V + off_b * stride_vb + off_hk * stride_vh, seqlen_k, stride_vn,
                        HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_N, BLOCK_D=BLOCK_D)

    # not from start_m: see the module docstring (the specialisation pass splits this axis)
    offs_m = (tile << LOG2_BLOCK_M) + tl.arange(0, BLOCK_M)
    q = q_desc.load([start_m, 0])
    do = do_desc.load([start_m, 0])
    lse2 = _lse2(LSE + bh.to(tl.int64) * seqlen_q, offs_m, seqlen_q)
    delta = tl.load(Delta + bh.to(tl.int64) * seqlen_q + offs_m, mask=offs_m < seqlen_q, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    shift = seqlen_k - seqlen_q
    _lo, _full_lo, full_hi, hi = kv_block_range(start_m, start_m + BLOCK_M, seqlen_q, seqlen_k, -1, 0,
                                                BLOCK_N=BLOCK_N, HAS_LEFT=False, HAS_RIGHT=CAUSAL)
    if WARP_SPEC:
        for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=True):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            dq = _dq_step(dq, q, do, lse2, delta, k_desc, v_desc, start_n, offs_m, shift, scale_log2,
                          BLOCK_N=BLOCK_N, MASKED=CAUSAL)
    else:  # the band unmasked, then the diagonal tiles masked (ragged Nk needs no mask: zero K rows)
        if CAUSAL:
            band_hi = full_hi
        else:
            band_hi = hi
        for start_n in tl.range(0, band_hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            dq = _dq_step(dq, q, do, lse2, delta, k_desc, v_desc, start_n, offs_m, shift, scale_log2,
                          BLOCK_N=BLOCK_N, MASKED=False)
        for start_n in tl.range(band_hi, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            dq = _dq_step(dq, q, do, lse2, delta, k_desc, v_desc, start_n, offs_m, shift, scale_log2,
                          BLOCK_N=BLOCK_N, MASKED=True)

    dq = dq * softmax_scale
    _store_rows(DQ + off_b * stride_dqb + off_h * stride_dqh, dq, offs_m, stride_dqm, seqlen_q,
                HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D)
