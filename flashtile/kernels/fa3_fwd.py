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

Packed batches (``IS_VARLEN``, ``flash_attn_varlen_func``): the grid spans ``max_seqlen_q`` tiles per
(sequence, head) as in :mod:`flashtile.kernels.fa2_fwd`, or (``PACKED_GRID``) ``total_q // BLOCK_M + B``
slots per head, each program finding its sequence in ``cu_seqlens_q``; each program reads its sequence's rows from
``cu_seqlens`` (clamped to the tensors by :func:`flashtile.kernels.block_info.seqlen_info`) and builds its
descriptors at the sequence's first row with its length as their bound, so its tails read 0 and its
stores stop at its end; the tiles past a sequence's end run nothing (an ``if`` around the tile: the
warp-specialised loop survives inside it, an early return fails Triton 3.6's pass).

FP8 (``FP8=True``, FA3 §3.3): e4m3 q, k and V stored transposed ((d, Nk) rows:
fp8 wgmma reads its B operand k-major only), float32 descales per (batch, kv
head) folded into the score scale and the output; P~ = 2^8 exp(S - m) is
rounded to e4m3 for the second GEMM, as :mod:`flashtile.reference.fp8` simulates.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtile.kernels._common import LN2, e4m3_exact, head_desc, query_tile, tanh_
from flashtile.kernels.block_info import kv_block_range, seq_base, seqlen_errors, seqlen_info
from flashtile.kernels.fa2_fwd import ERR_CU_SEQLENS

__all__ = ["fa3_fwd_kernel", "cu_seqlens_report_kernel", "ERR_DESCALE"]

_LN2 = tl.constexpr(LN2)
_P_OCTAVES = tl.constexpr(8.0)  # FP8: P~ = 2^8 exp(S - m), see reference/fp8.py's P_SCALE
ERR_DESCALE = 16  # bit of the device error word (runtime.decode.error_flags): a q*k descale product not in (0, inf)
_ERR_DESCALE = tl.constexpr(ERR_DESCALE)
_ERR_CU_SEQLENS = tl.constexpr(ERR_CU_SEQLENS)


@triton.jit
def _to_e4m3(p, EXACT: tl.constexpr):
    """``p`` (finite, in [0, 448]) rounded to e4m3, ties to even: the hardware cast, or ``EXACT`` (Triton's
    interpreter, whose cast drops the carry into the exponent) by fp32 arithmetic."""
    if EXACT:
        p8 = e4m3_exact(p)
    else:
        p8 = p.to(tl.float8e4nv)
    return p8


@triton.jit
def _descales(QDescale, KDescale, VDescale, off_b, off_hk, stride_qsb, stride_qsh, stride_ksb, stride_ksh,
              stride_vsb, stride_vsh):
    """FP8: (q descale * k descale, v descale) of (batch, kv head) ``(off_b, off_hk)``."""
    q_ds = tl.load(QDescale + off_b * stride_qsb + off_hk * stride_qsh)
    k_ds = tl.load(KDescale + off_b * stride_ksb + off_hk * stride_ksh)
    v_ds = tl.load(VDescale + off_b * stride_vsb + off_hk * stride_vsh)
    return q_ds * k_ds, v_ds


@triton.jit
def _descales_ok(qk_ds, qk_scale, v_ds):
    """The row-max shortcut needs a positive finite score scale ``qk_scale * qk_ds`` (``qk_scale`` > 0; the
    fp32 product overflows to inf where it is not finite); v's descale only needs to be finite."""
    return (qk_ds > 0.0) & (qk_ds * qk_scale < float("inf")) & (tl.abs(v_ds) < float("inf"))


@triton.jit
def _kv_step(
    acc, l_i, m_i, q, k_desc, v_desc, start_n, last_key, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, FP8: tl.constexpr, EXACT_E4M3: tl.constexpr,
    first_key=None, softcap=None,
):
    """One online-softmax update with kv tile [start_n, start_n + BLOCK_N).

    Unmasked scores stay unscaled: ``rowmax(qk) * qk_scale`` is the scaled max
    because the wrapper makes ``qk_scale > 0`` (the kernel checks it with FP8 descales).
    ``first_key`` (a sliding window's left edge): keys below it are masked too.  ``softcap`` = (scale / cap,
    cap * log2 e): S becomes cap * tanh(S * scale / cap) in log2 units, and the wrapper passes ``qk_scale`` 1."""
    k = k_desc.load([start_n, 0])
    qk = tl.dot(q, k.T)
    if softcap is not None:
        qk = tanh_(qk * softcap[0]) * softcap[1]
    if MASKED:
        # per-row bounds moved to the tile's own columns: no per-element key offset
        cols = tl.arange(0, BLOCK_N)
        if first_key is not None:
            seen = (cols[None, :] <= (last_key - start_n)[:, None]) & (cols[None, :] >= (first_key - start_n)[:, None])
            qk = tl.where(seen, qk, float("-inf"))
        else:
            qk = tl.where(cols[None, :] <= (last_key - start_n)[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if MASKED:
        # a row with no allowed key so far keeps m = -inf: subtract 0, never -inf - -inf
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    if FP8:
        # P~ = 2^8 exp(S - m) spans e4m3's [0, 256] instead of [0, 1] (FA3's Max_offset; l carries the 2^8 too)
        p = tl.math.exp2(qk * qk_scale - (m_use - _P_OCTAVES)[:, None])
    else:
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if FP8:
        vt = v_desc.load([0, start_n])  # V stored transposed: fp8 wgmma takes its B operand k-major only
        acc = tl.dot(_to_e4m3(p, EXACT=EXACT_E4M3), vt.T, acc)
    else:
        v = v_desc.load([start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _kv_sweep(
    acc, l_i, m_i, q, k_desc, v_desc, lo, hi, last_key, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, WARP_SPEC: tl.constexpr, FP8: tl.constexpr,
    EXACT_E4M3: tl.constexpr, first_key=None, softcap=None,
):
    """Visit kv tiles lo, lo + BLOCK_N, ... < hi (lo a multiple of BLOCK_N)."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _kv_step(acc, l_i, m_i, q, k_desc, v_desc, start_n, last_key, qk_scale,
                                 BLOCK_N=BLOCK_N, MASKED=MASKED, FP8=FP8, EXACT_E4M3=EXACT_E4M3,
                                 first_key=first_key, softcap=softcap)
    return acc, l_i, m_i


@triton.jit
def _varlen_report(CuSeqQ, CuSeqK, Err, off_b, n_batch, seqlen_q, seqlen_k, total_q, total_k, reporter):
    """IS_VARLEN: OR ERR_CU_SEQLENS into the error word when batch element ``off_b``'s stored ranges break the
    packed contract (``reporter``: one program per batch element).  A plain read-modify-write into the store-only
    word, as the FP8 bit's (every writer ORs the same bit): Triton 3.6's warp specialisation fails on an atomic
    before the loop too (offline sm_90a compile)."""
    q_bad, k_bad = seqlen_errors(CuSeqQ, CuSeqK, off_b, n_batch, seqlen_q, seqlen_k, total_q, total_k,
                                 K_ENDS_AT_TOTAL=True)
    bad = reporter & (q_bad | k_bad)
    tl.store(Err, tl.load(Err, mask=bad, other=0) | _ERR_CU_SEQLENS, mask=bad)


@triton.jit
def cu_seqlens_report_kernel(CuSeqQ, CuSeqK, Err, n_batch, seqlen_q, seqlen_k, total_q, total_k):
    """:func:`_varlen_report` as a kernel of its own, one program per sequence, for packed forwards whose kernel
    does not report (the Gluon one): ``seqlen_*`` the max_seqlen arguments."""
    off_b = tl.program_id(0)
    _varlen_report(CuSeqQ, CuSeqK, Err, off_b, n_batch, seqlen_q, seqlen_k, total_q, total_k, True)


@triton.jit
def _slot_start(CuSeqQ, b, total_q, BLOCK_M: tl.constexpr):
    """First slot of sequence ``b`` in the packed grid: its start row (clamped to [0, total_q]) // BLOCK_M + b."""
    start = tl.minimum(tl.maximum(tl.load(CuSeqQ + b).to(tl.int64), 0), total_q)
    return (start // BLOCK_M).to(tl.int32) + b


@triton.jit
def _packed_slot(CuSeqQ, slot, n_batch, total_q, n_steps, BLOCK_M: tl.constexpr):
    """``(b, tile)`` of grid slot ``slot`` in the packed grid: sequence b owns the slots [s(b), s(b + 1)) of
    :func:`_slot_start`, at least cdiv(L_b, BLOCK_M) of them (the floor of its end row minus that of its start, plus
    one), so total_q // BLOCK_M + B slots per head hold every tile and at most B are idle.  b is the last sequence
    with s(b) <= slot, found by ``n_steps`` = bit_length(B - 1) halvings of [0, B); tile = slot - s(b) is negative
    only for decreasing cu_seqlens (the caller skips it)."""
    lo = 0
    hi = n_batch
    s_lo = _slot_start(CuSeqQ, 0, total_q, BLOCK_M=BLOCK_M)
    for _ in range(n_steps):
        mid = (lo + hi) // 2
        s_mid = _slot_start(CuSeqQ, mid, total_q, BLOCK_M=BLOCK_M)
        right = s_mid <= slot
        lo = tl.where(right, mid, lo)
        s_lo = tl.where(right, s_mid, s_lo)
        hi = tl.where(right, hi, mid)
    return lo, slot - s_lo


@triton.jit
def _query_tile_fwd(
    Q, K, V, Out, LSE, QDescale, KDescale, VDescale, Err, qk_scale,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om, stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
    seqlen_q, total_q, bh, tile, off_b, off_h, off_hk, q_start, len_q, k_start, len_k,
    window_left, window_right, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, LOG2_BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_N: tl.constexpr, WARP_SPEC: tl.constexpr, O_TMA: tl.constexpr,
    FP8: tl.constexpr, EXACT_E4M3: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """O and LSE of query tile ``tile`` (rows from ``tile * BLOCK_M``) of head ``off_h`` of one sequence: rows
    ``q_start ..`` (``len_q`` of them) against keys ``k_start ..`` (``len_k``), both in the kernel's views.
    ``window_left`` / ``window_right``: a sliding window's bounds (bottom-right aligned, as ``causal``'s), None
    where unbounded; ``softcap``: (scale / cap, cap * log2 e) or None."""
    qk_scale_in = qk_scale
    start_m = tile * BLOCK_M
    q_base = seq_base(Q, off_b, off_h, q_start, stride_qb, stride_qh, stride_qm, IS_VARLEN=IS_VARLEN)
    k_base = seq_base(K, off_b, off_hk, k_start, stride_kb, stride_kh, stride_kn, IS_VARLEN=IS_VARLEN)
    v_base = seq_base(V, off_b, off_hk, k_start, stride_vb, stride_vh, stride_vn, IS_VARLEN=IS_VARLEN)
    o_base = seq_base(Out, off_b, off_h, q_start, stride_ob, stride_oh, stride_om, IS_VARLEN=IS_VARLEN)
    q_desc = head_desc(q_base, len_q, stride_qm, HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_M, BLOCK_D=BLOCK_D)
    k_desc = head_desc(k_base, len_k, stride_kn, HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_N, BLOCK_D=BLOCK_D)
    if FP8:  # V as (d, Nk) rows: stride_vn is then the stride of one d row
        v_desc = tl.make_tensor_descriptor(v_base, shape=[HEAD_DIM, len_k],
                                           strides=[stride_vn, 1], block_shape=[BLOCK_D, BLOCK_N])
        qk_ds, _ = _descales(QDescale, KDescale, VDescale, off_b, off_hk, stride_qsb, stride_qsh,
                                 stride_ksb, stride_ksh, stride_vsb, stride_vsh)
        # a safe scale here (NaN or <= 0 -> 1, inf -> finite); the check that flags them follows the loop
        qk_scale = tl.where(qk_scale * qk_ds > 0.0, tl.minimum(qk_scale * qk_ds, 1e30), 1.0)
    else:
        v_desc = head_desc(v_base, len_k, stride_vn, HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_N, BLOCK_D=BLOCK_D)
    if O_TMA:
        o_desc = head_desc(o_base, len_q, stride_om, HEAD_DIM=HEAD_DIM, BLOCK_ROWS=BLOCK_M, BLOCK_D=BLOCK_D)

    # not from start_m: Triton 3.6's WS pass shifts start_m by 64 rows in consumer 2 and splits the arange too
    offs_m = (tile << LOG2_BLOCK_M) + tl.arange(0, BLOCK_M)
    q = q_desc.load([start_m, 0])
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)

    # key j is allowed for row i iff j <= last_key[i]: j < Nk, and j <= i + Nk - Nq when causal (bottom-right)
    last_key = tl.full((BLOCK_M,), len_k - 1, tl.int32)
    if CAUSAL:
        last_key = tl.minimum(last_key, offs_m + (len_k - len_q))
    if window_left is None and window_right is None:
        # causal is the window (-1, 0); tiles below full_hi are clear of the diagonal and of the end of K
        _lo, _full_lo, full_hi, hi = kv_block_range(start_m, start_m + BLOCK_M, len_q, len_k, -1, 0,
                                                    BLOCK_N=BLOCK_N, HAS_LEFT=False, HAS_RIGHT=CAUSAL)
        if WARP_SPEC:  # one loop (see the module docstring); the all-tiles mask still beats two loops at d >= 128
            acc, l_i, m_i = _kv_sweep(acc, l_i, m_i, q, k_desc, v_desc, 0, hi, last_key, qk_scale,
                                      BLOCK_N=BLOCK_N, MASKED=CAUSAL or not EVEN_N, WARP_SPEC=True, FP8=FP8,
                                      EXACT_E4M3=EXACT_E4M3, softcap=softcap)
        else:
            acc, l_i, m_i = _kv_sweep(acc, l_i, m_i, q, k_desc, v_desc, 0, full_hi, last_key, qk_scale,
                                      BLOCK_N=BLOCK_N, MASKED=False, WARP_SPEC=False, FP8=FP8, EXACT_E4M3=EXACT_E4M3,
                                      softcap=softcap)
            acc, l_i, m_i = _kv_sweep(acc, l_i, m_i, q, k_desc, v_desc, full_hi, hi, last_key, qk_scale,
                                      BLOCK_N=BLOCK_N, MASKED=True, WARP_SPEC=False, FP8=FP8, EXACT_E4M3=EXACT_E4M3,
                                      softcap=softcap)
    else:
        # a sliding window: j in [i + Nk - Nq - left, i + Nk - Nq + right] (a None bound unbounded); its tiles
        # [lo, hi), those in [full_lo, full_hi) clear of both edges and of the end of K
        tl.static_assert(not CAUSAL, "causal is the window (left, 0): the wrapper passes it as one")
        left = -1 if window_left is None else window_left
        right = -1 if window_right is None else window_right
        first_key = None  # no left bound: no second compare
        if window_left is not None:
            first_key = offs_m + (len_k - len_q) - left
        if window_right is not None:
            last_key = tl.minimum(last_key, offs_m + (len_k - len_q) + right)
        lo, full_lo, full_hi, hi = kv_block_range(start_m, start_m + BLOCK_M, len_q, len_k, left, right,
                                                  BLOCK_N=BLOCK_N, HAS_LEFT=window_left is not None,
                                                  HAS_RIGHT=window_right is not None)
        if WARP_SPEC:
            acc, l_i, m_i = _kv_sweep(acc, l_i, m_i, q, k_desc, v_desc, lo, hi, last_key, qk_scale,
                                      BLOCK_N=BLOCK_N, MASKED=True, WARP_SPEC=True, FP8=FP8, EXACT_E4M3=EXACT_E4M3,
                                      first_key=first_key, softcap=softcap)
        else:
            acc, l_i, m_i = _kv_sweep(acc, l_i, m_i, q, k_desc, v_desc, lo, full_lo, last_key, qk_scale,
                                      BLOCK_N=BLOCK_N, MASKED=True, WARP_SPEC=False, FP8=FP8, EXACT_E4M3=EXACT_E4M3,
                                      first_key=first_key, softcap=softcap)
            acc, l_i, m_i = _kv_sweep(acc, l_i, m_i, q, k_desc, v_desc, full_lo, full_hi, last_key, qk_scale,
                                      BLOCK_N=BLOCK_N, MASKED=False, WARP_SPEC=False, FP8=FP8, EXACT_E4M3=EXACT_E4M3,
                                      softcap=softcap)
            acc, l_i, m_i = _kv_sweep(acc, l_i, m_i, q, k_desc, v_desc, full_hi, hi, last_key, qk_scale,
                                      BLOCK_N=BLOCK_N, MASKED=True, WARP_SPEC=False, FP8=FP8, EXACT_E4M3=EXACT_E4M3,
                                      first_key=first_key, softcap=softcap)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if FP8:
        # loaded again and tested by other ops: a comparison used on both sides of the warp-specialised loop
        # breaks Triton 3.6's pass
        qk_ds, v_ds = _descales(QDescale, KDescale, VDescale, off_b, off_hk, stride_qsb, stride_qsh,
                                stride_ksb, stride_ksh, stride_vsb, stride_vsh)
        scale_ok = _descales_ok(qk_ds, qk_scale_in, v_ds)
        out = acc * (v_ds / l_safe)[:, None]
        out = tl.where(scale_ok, out, 0.0)
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe) - _P_OCTAVES) * _LN2)
        lse = tl.where(scale_ok, lse, float("-inf"))
        # a plain read-modify-write (every writer ORs the same bit): Triton 3.6's warp specialisation
        # fails on an atomic after the loop, and is turned off by a branch there
        tl.store(Err, tl.load(Err) | _ERR_DESCALE, mask=not scale_ok)
    else:
        out = acc * (1.0 / l_safe)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * _LN2)
    if O_TMA:
        o_desc.store([start_m, 0], out.to(Out.dtype.element_ty))
    else:  # plain stores: no O staging tile in shared memory (with specialisation it is not aliased with Q's)
        offs_d = tl.arange(0, BLOCK_D)
        o_ptrs = o_base + offs_m.to(tl.int64)[:, None] * stride_om + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m < len_q)[:, None] & (offs_d < HEAD_DIM)[None, :])
    if IS_VARLEN:  # LSE (H, total_q), as flash-attn's varlen softmax_lse
        lse_ptrs = LSE + off_h * total_q + q_start + offs_m
    else:
        lse_ptrs = LSE + bh.to(tl.int64) * seqlen_q + offs_m
    tl.store(lse_ptrs, lse, mask=offs_m < len_q)


@triton.jit(do_not_specialize=["n_heads", "kv_group", "seqlen_q", "seqlen_k", "num_m_tiles", "n_batch", "total_q",
                               "total_k", "search_steps", "window_left", "window_right"])
def fa3_fwd_kernel(
    Q, K, V, Out, LSE,
    QDescale, KDescale, VDescale, Err,  # FP8: float32 descales indexed [b, kv head]; FP8 or IS_VARLEN: the int32 error word
    CuSeqQ, CuSeqK,  # IS_VARLEN only: int32 (B + 1,) cumulative sequence lengths
    qk_scale,  # softmax_scale * log2(e), > 0
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
    n_heads, kv_group, seqlen_q, seqlen_k, num_m_tiles,
    n_batch, total_q, total_k, search_steps,  # IS_VARLEN only: B, rows of the packed q and k; PACKED_GRID's halvings
    # a sliding window's bounds (not causal; None: unbounded) and softcap's (scale / cap, cap * log2 e) (qk_scale
    # then 1); all None: no parameter
    window_left, window_right, softcap_in, softcap_out,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, LOG2_BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_N: tl.constexpr, WARP_SPEC: tl.constexpr, O_TMA: tl.constexpr,
    FP8: tl.constexpr, EXACT_E4M3: tl.constexpr, IS_VARLEN: tl.constexpr, PACKED_GRID: tl.constexpr,
):
    """1-D grid of B * Hq * cdiv(Nq, BLOCK_M) programs, query tiles of one head adjacent
    (they share that head's K and V in L2); causal runs each head's tiles last-first,
    the longest rows first.

    IS_VARLEN (packed batch): q/k/v/out are (1, H, total, d) views, batch element b owns rows
    ``[cu_seqlens[b], cu_seqlens[b + 1])`` clamped as :func:`seqlen_info` does, ``seqlen_q`` / ``seqlen_k``
    are ``max_seqlen_q`` / ``max_seqlen_k``, LSE is (H, total_q).  The grid spans B * Hq * cdiv(max_seqlen_q,
    BLOCK_M) tiles, or with PACKED_GRID Hq * (total_q // BLOCK_M + B) slots (:func:`_packed_slot`: at most B
    idle per head however the lengths spread).  The descriptors start at the sequence's first row with the
    sequence's length as their bound, so tails read 0 and stores past the sequence are dropped; tiles past the
    end do nothing.  One program per batch element (head 0) reports bad cu_seqlens values (ERR_CU_SEQLENS, as
    the FA2 packed forward)."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_M % 64 == 0)  # 64 rows per consumer warpgroup (wgmma M)
    tl.static_assert(BLOCK_N % 16 == 0)
    tl.static_assert(BLOCK_M == 1 << LOG2_BLOCK_M)
    tl.static_assert(not (IS_VARLEN and (FP8 or EVEN_N)), "packed batches: bf16 / fp16, ragged lengths")
    tl.static_assert(IS_VARLEN or not PACKED_GRID)
    tl.static_assert(not FP8 or (softcap_in is None and window_left is None and window_right is None))
    softcap = None
    if softcap_in is not None:
        softcap = (softcap_in, softcap_out)
    bh, tile, off_b, off_h, off_hk = query_tile(num_m_tiles, n_heads, kv_group, LAST_FIRST=CAUSAL)
    if PACKED_GRID:  # num_m_tiles slots per head (one "batch"): the slot's sequence and tile come from cu_seqlens_q
        slot = tile
        off_b, tile = _packed_slot(CuSeqQ, slot, n_batch, total_q, search_steps, BLOCK_M=BLOCK_M)
        report_b = tl.minimum(slot, n_batch - 1)  # slot b of head 0 checks sequence b, whatever cu_seqlens hold
        reporter = (off_h == 0) & (slot < n_batch)
    else:
        report_b = off_b
        reporter = (tile == 0) & (off_h == 0)
    q_start, len_q, k_start, len_k = seqlen_info(CuSeqQ, CuSeqK, off_b, seqlen_q, seqlen_k, total_q, total_k,
                                                 IS_VARLEN=IS_VARLEN)
    if IS_VARLEN:
        _varlen_report(CuSeqQ, CuSeqK, Err, report_b, n_batch, seqlen_q, seqlen_k, total_q, total_k, reporter)
        # idle grid slots skip the tile: a structured if, as Triton 3.6's warp specialisation fails on an early
        # return (an unstructured branch) and accepts its loop inside an if
        if (tile >= 0) & (tile < tl.cdiv(len_q, BLOCK_M)):  # no product: tile is any int for bad cu_seqlens
            _query_tile_fwd(
                Q, K, V, Out, LSE, QDescale, KDescale, VDescale, Err, qk_scale,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                stride_ob, stride_oh, stride_om, stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
                seqlen_q, total_q, bh, tile, off_b, off_h, off_hk, q_start, len_q, k_start, len_k,
                window_left, window_right, softcap,
                HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, LOG2_BLOCK_M=LOG2_BLOCK_M, BLOCK_N=BLOCK_N,
                CAUSAL=CAUSAL, EVEN_N=EVEN_N, WARP_SPEC=WARP_SPEC, O_TMA=O_TMA, FP8=FP8, EXACT_E4M3=EXACT_E4M3,
                IS_VARLEN=True,
            )
    else:
        _query_tile_fwd(
            Q, K, V, Out, LSE, QDescale, KDescale, VDescale, Err, qk_scale,
            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
            stride_ob, stride_oh, stride_om, stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh,
            seqlen_q, total_q, bh, tile, off_b, off_h, off_hk, q_start, len_q, k_start, len_k,
            window_left, window_right, softcap,
            HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, LOG2_BLOCK_M=LOG2_BLOCK_M, BLOCK_N=BLOCK_N,
            CAUSAL=CAUSAL, EVEN_N=EVEN_N, WARP_SPEC=WARP_SPEC, O_TMA=O_TMA, FP8=FP8, EXACT_E4M3=EXACT_E4M3,
            IS_VARLEN=False,
        )
