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

Head-dim split (``BLOCK_D1 > 0``): the head dim is tiled as columns [0, BLOCK_D0) and [BLOCK_D0,
BLOCK_D0 + BLOCK_D1), two powers of two (d = 192: 128 + 64; ``runtime.fa3_gluon.head_split``), so no GEMM
pays for the columns up to ``next_power_of_2(d)``: Q, K, V, dO come as two descriptor boxes per tile,
S = Q0 K0^T + Q1 K1^T and dP = dO0 V0^T + dO1 V1^T accumulate over both, and dV, dK, dQ are one
accumulator per part, stored per part; accumulators travel as tuples ``(dK0[, dK1], dV0[, dV1])``.
With ``BLOCK_D1 = 0`` the kernels are the unsplit ones (``BLOCK_D0`` = the padded head dim).

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
def _store_parts(base, x0, x1, offs_r, stride_r, n_rows, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr,
                 BLOCK_D1: tl.constexpr):
    """Columns [0, BLOCK_D0) from ``x0`` and, split, [BLOCK_D0, HEAD_DIM) from ``x1``."""
    _store_rows(base, x0, offs_r, stride_r, n_rows, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D0)
    if BLOCK_D1 > 0:
        _store_rows(base + BLOCK_D0, x1, offs_r, stride_r, n_rows, HEAD_DIM=HEAD_DIM - BLOCK_D0, BLOCK_D=BLOCK_D1)


@triton.jit
def _atomic_dq(DQh, dq, offs_m, stride_dqm, seqlen_q, COL0: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """fp32 ``dq`` added into columns [COL0, COL0 + BLOCK_D) of the rows (those past Nq or HEAD_DIM dropped)."""
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = DQh + COL0 + offs_m.to(tl.int64)[:, None] * stride_dqm + offs_d[None, :]
    tl.atomic_add(ptrs, dq, mask=(offs_m < seqlen_q)[:, None] & (offs_d < HEAD_DIM - COL0)[None, :], sem="relaxed")


@triton.jit
def _head_descs(base, rows, stride_row, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D0: tl.constexpr,
                BLOCK_D1: tl.constexpr):
    """Descriptors of one head, a tuple: boxes of BLOCK_D0 columns and, split, of BLOCK_D1 (loaded at column
    BLOCK_D0; TMA zero-fills the columns past HEAD_DIM)."""
    desc0 = head_desc(base, rows, stride_row, HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_ROWS, BLOCK_D=BLOCK_D0)
    if BLOCK_D1 > 0:
        return desc0, head_desc(base, rows, stride_row, HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_ROWS, BLOCK_D=BLOCK_D1)
    else:
        return (desc0,)


@triton.jit
def _load_parts(descs, row, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr):
    """Rows [row, + box) of a head as a tuple of its column parts."""
    x0 = descs[0].load([row, 0])
    if BLOCK_D1 > 0:
        return x0, descs[1].load([row, BLOCK_D0])
    else:
        return (x0,)


@triton.jit
def _zeros_parts(rows: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr):
    """A zero fp32 (rows, width) accumulator per column part, a tuple."""
    if BLOCK_D1 > 0:
        return tl.zeros((rows, BLOCK_D0), dtype=tl.float32), tl.zeros((rows, BLOCK_D1), dtype=tl.float32)
    else:
        return (tl.zeros((rows, BLOCK_D0), dtype=tl.float32),)


@triton.jit
def _dkdv_step(acc, k, v, q_descs, do_descs, LSEh, Deltah, DQh, stride_dqm, start_m, offs_n, shift, seqlen_q,
               scale_log2, softmax_scale, HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
               BLOCK_M: tl.constexpr, MASKED: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """One q tile [start_m, start_m + BLOCK_M) into the kv tile's ``acc`` = (dK0, dV0), split (dK0, dK1, dV0, dV1)
    (transposed orientation); ``k``, ``v`` and the descriptors are tuples of column parts."""
    if BLOCK_D1 > 0:
        dk0, dk1, dv0, dv1 = acc
    else:
        dk0, dv0 = acc
    q = _load_parts(q_descs, start_m, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
    do = _load_parts(do_descs, start_m, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    lse2 = _lse2(LSEh, offs_m, seqlen_q)
    delta = tl.load(Deltah + offs_m, mask=offs_m < seqlen_q, other=0.0)
    st = tl.dot(k[0], q[0].T)
    if BLOCK_D1 > 0:
        st = tl.dot(k[1], q[1].T, st)
    pt = tl.math.exp2(st * scale_log2 - lse2[None, :])
    if MASKED:  # key n sees row m iff n <= m + Nk - Nq
        pt = tl.where(offs_n[:, None] <= offs_m[None, :] + shift, pt, 0.0)
    dv0 = tl.dot(pt.to(do[0].dtype), do[0], dv0)
    if BLOCK_D1 > 0:
        dv1 = tl.dot(pt.to(do[1].dtype), do[1], dv1)
    dpt = tl.dot(v[0], do[0].T)
    if BLOCK_D1 > 0:
        dpt = tl.dot(v[1], do[1].T, dpt)
    dst = pt * (dpt - delta[None, :])
    dst = dst.to(q[0].dtype)
    dk0 = tl.dot(dst, q[0], dk0)
    if BLOCK_D1 > 0:
        dk1 = tl.dot(dst, q[1], dk1)
    if ATOMIC_DQ:  # unspecialised only (the pass fails on an atomic in the loop): dQ_i += scale dS K_j, fp32
        dq0 = tl.dot(tl.trans(dst), k[0]) * softmax_scale
        _atomic_dq(DQh, dq0, offs_m, stride_dqm, seqlen_q, COL0=0, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D0)
        if BLOCK_D1 > 0:
            dq1 = tl.dot(tl.trans(dst), k[1]) * softmax_scale
            _atomic_dq(DQh, dq1, offs_m, stride_dqm, seqlen_q, COL0=BLOCK_D0, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D1)
    if BLOCK_D1 > 0:
        return dk0, dk1, dv0, dv1
    else:
        return dk0, dv0


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
    HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOG2_BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WARP_SPEC: tl.constexpr, GROUP_LOOP: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):
    """1-D grid of B * H * cdiv(Nk, BLOCK_N) programs, kv tiles of one head adjacent.  H is the q heads
    (DK, DV indexed by q head: the outputs when ``kv_group == 1``, else fp32 partials) unless
    ``GROUP_LOOP`` (unspecialised only): then H is the kv heads and each program sweeps the q heads of
    its group, dK, dV reduced in registers.  Head dim as columns [0, BLOCK_D0) and, when ``BLOCK_D1 > 0``,
    [BLOCK_D0, BLOCK_D0 + BLOCK_D1)."""
    tl.static_assert(BLOCK_D0 + BLOCK_D1 >= HEAD_DIM)
    tl.static_assert(BLOCK_D1 == 0 or BLOCK_D0 < HEAD_DIM)
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

    k_descs = _head_descs(K + off_b * stride_kb + off_hk * stride_kh, seqlen_k, stride_kn,
                          HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_N, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
    v_descs = _head_descs(V + off_b * stride_vb + off_hk * stride_vh, seqlen_k, stride_vn,
                          HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_N, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
    # not from start_n: see the module docstring (the specialisation pass splits this axis)
    offs_n = (tile << LOG2_BLOCK_N) + tl.arange(0, BLOCK_N)
    k = _load_parts(k_descs, start_n, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
    v = _load_parts(v_descs, start_n, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
    # the dK parts, then the dV parts
    acc = _zeros_parts(BLOCK_N, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1) + \
        _zeros_parts(BLOCK_N, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
    shift = seqlen_k - seqlen_q
    # causal is the window (-1, 0): q tiles from lo see the kv tile, those from full_lo see all of it
    lo, full_lo, _full_hi, hi = q_block_range(start_n, start_n + BLOCK_N, seqlen_q, seqlen_k, -1, 0,
                                              BLOCK_M=BLOCK_M, HAS_LEFT=False, HAS_RIGHT=CAUSAL)
    if WARP_SPEC:  # one branch-free loop: every tile takes the mask when causal
        q_descs = _head_descs(Q + off_b * stride_qb + off_h0 * stride_qh, seqlen_q, stride_qm,
                              HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_M, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
        do_descs = _head_descs(DO + off_b * stride_dob + off_h0 * stride_doh, seqlen_q, stride_dom,
                               HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_M, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
        LSEh = LSE + (off_b * n_heads + off_h0) * seqlen_q
        Deltah = Delta + (off_b * n_heads + off_h0) * seqlen_q
        for start_m in tl.range(lo, hi, BLOCK_M, warp_specialize=True):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            acc = _dkdv_step(acc, k, v, q_descs, do_descs, LSEh, Deltah, DQacc, stride_dqm, start_m, offs_n,
                             shift, seqlen_q, scale_log2, softmax_scale, HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0,
                             BLOCK_D1=BLOCK_D1, BLOCK_M=BLOCK_M, MASKED=CAUSAL, ATOMIC_DQ=False)
    else:
        for g in range(0, kv_group if GROUP_LOOP else 1):
            off_h = off_h0 + g
            q_descs = _head_descs(Q + off_b * stride_qb + off_h * stride_qh, seqlen_q, stride_qm,
                                  HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_M, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
            do_descs = _head_descs(DO + off_b * stride_dob + off_h * stride_doh, seqlen_q, stride_dom,
                                   HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_M, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
            LSEh = LSE + (off_b * n_heads + off_h) * seqlen_q
            Deltah = Delta + (off_b * n_heads + off_h) * seqlen_q
            DQh = DQacc + off_b * stride_dqb + off_h * stride_dqh
            # the diagonal tiles masked, then the band unmasked
            for start_m in tl.range(lo, full_lo, BLOCK_M):
                start_m = tl.multiple_of(start_m, BLOCK_M)
                acc = _dkdv_step(acc, k, v, q_descs, do_descs, LSEh, Deltah, DQh, stride_dqm, start_m, offs_n,
                                 shift, seqlen_q, scale_log2, softmax_scale, HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0,
                                 BLOCK_D1=BLOCK_D1, BLOCK_M=BLOCK_M, MASKED=True, ATOMIC_DQ=ATOMIC_DQ)
            for start_m in tl.range(full_lo, hi, BLOCK_M):
                start_m = tl.multiple_of(start_m, BLOCK_M)
                acc = _dkdv_step(acc, k, v, q_descs, do_descs, LSEh, Deltah, DQh, stride_dqm, start_m, offs_n,
                                 shift, seqlen_q, scale_log2, softmax_scale, HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0,
                                 BLOCK_D1=BLOCK_D1, BLOCK_M=BLOCK_M, MASKED=False, ATOMIC_DQ=ATOMIC_DQ)

    if BLOCK_D1 > 0:
        dk0, dk1, dv0, dv1 = acc
        dk1 = dk1 * softmax_scale
    else:
        dk0, dv0 = acc
        dk1 = None
        dv1 = None
    dk0 = dk0 * softmax_scale
    _store_parts(DK + off_b * stride_dkb + off_out * stride_dkh, dk0, dk1, offs_n, stride_dkn, seqlen_k,
                 HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
    _store_parts(DV + off_b * stride_dvb + off_out * stride_dvh, dv0, dv1, offs_n, stride_dvn, seqlen_k,
                 HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)


@triton.jit
def _dq_step(acc, q, do, lse2, delta, k_descs, v_descs, start_n, offs_m, shift, scale_log2,
             BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """One kv tile [start_n, start_n + BLOCK_N) into the q tile's ``acc`` = (dQ0[, dQ1]) (unscaled); ``q``,
    ``do`` and the descriptors are tuples of column parts."""
    k = _load_parts(k_descs, start_n, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
    v = _load_parts(v_descs, start_n, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
    s = tl.dot(q[0], k[0].T)
    if BLOCK_D1 > 0:
        s = tl.dot(q[1], k[1].T, s)
    p = tl.math.exp2(s * scale_log2 - lse2[:, None])
    if MASKED:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        p = tl.where(offs_n[None, :] <= offs_m[:, None] + shift, p, 0.0)
    dp = tl.dot(do[0], v[0].T)
    if BLOCK_D1 > 0:
        dp = tl.dot(do[1], v[1].T, dp)
    ds = p * (dp - delta[:, None])
    if BLOCK_D1 > 0:
        ds = ds.to(k[0].dtype)
        return tl.dot(ds, k[0], acc[0]), tl.dot(ds, k[1], acc[1])
    else:
        return (tl.dot(ds.to(k[0].dtype), k[0], acc[0]),)


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
    HEAD_DIM: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
    BLOCK_M: tl.constexpr, LOG2_BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """1-D grid of B * Hq * cdiv(Nq, BLOCK_M) programs; causal runs each head's tiles last-first.  Head dim as
    columns [0, BLOCK_D0) and, when ``BLOCK_D1 > 0``, [BLOCK_D0, BLOCK_D0 + BLOCK_D1)."""
    tl.static_assert(BLOCK_D0 + BLOCK_D1 >= HEAD_DIM)
    tl.static_assert(BLOCK_D1 == 0 or BLOCK_D0 < HEAD_DIM)
    tl.static_assert(BLOCK_M % 64 == 0)
    tl.static_assert(BLOCK_N % 16 == 0)
    tl.static_assert(BLOCK_M == 1 << LOG2_BLOCK_M)
    bh, tile, off_b, off_h, off_hk = query_tile(num_m_tiles, n_heads, kv_group, LAST_FIRST=CAUSAL)
    start_m = tile * BLOCK_M
    scale_log2 = softmax_scale * _LOG2E

    q_descs = _head_descs(Q + off_b * stride_qb + off_h * stride_qh, seqlen_q, stride_qm,
                          HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_M, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
    do_descs = _head_descs(DO + off_b * stride_dob + off_h * stride_doh, seqlen_q, stride_dom,
                           HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_M, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
    k_descs = _head_descs(K + off_b * stride_kb + off_hk * stride_kh, seqlen_k, stride_kn,
                          HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_N, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
    v_descs = _head_descs(V + off_b * stride_vb + off_hk * stride_vh, seqlen_k, stride_vn,
                          HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_N, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)

    # not from start_m: see the module docstring (the specialisation pass splits this axis)
    offs_m = (tile << LOG2_BLOCK_M) + tl.arange(0, BLOCK_M)
    q = _load_parts(q_descs, start_m, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
    do = _load_parts(do_descs, start_m, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
    lse2 = _lse2(LSE + bh.to(tl.int64) * seqlen_q, offs_m, seqlen_q)
    delta = tl.load(Delta + bh.to(tl.int64) * seqlen_q + offs_m, mask=offs_m < seqlen_q, other=0.0)
    acc = _zeros_parts(BLOCK_M, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
    shift = seqlen_k - seqlen_q
    _lo, _full_lo, full_hi, hi = kv_block_range(start_m, start_m + BLOCK_M, seqlen_q, seqlen_k, -1, 0,
                                                BLOCK_N=BLOCK_N, HAS_LEFT=False, HAS_RIGHT=CAUSAL)
    if WARP_SPEC:
        for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=True):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc = _dq_step(acc, q, do, lse2, delta, k_descs, v_descs, start_n, offs_m, shift, scale_log2,
                           BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1, BLOCK_N=BLOCK_N, MASKED=CAUSAL)
    else:  # the band unmasked, then the diagonal tiles masked (ragged Nk needs no mask: zero K rows)
        if CAUSAL:
            band_hi = full_hi
        else:
            band_hi = hi
        for start_n in tl.range(0, band_hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc = _dq_step(acc, q, do, lse2, delta, k_descs, v_descs, start_n, offs_m, shift, scale_log2,
                           BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1, BLOCK_N=BLOCK_N, MASKED=False)
        for start_n in tl.range(band_hi, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc = _dq_step(acc, q, do, lse2, delta, k_descs, v_descs, start_n, offs_m, shift, scale_log2,
                           BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1, BLOCK_N=BLOCK_N, MASKED=True)

    dq0 = acc[0] * softmax_scale
    dq1 = None
    if BLOCK_D1 > 0:
        dq1 = acc[1] * softmax_scale
    _store_parts(DQ + off_b * stride_dqb + off_h * stride_dqh, dq0, dq1, offs_m, stride_dqm, seqlen_q,
                 HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1)
