"""Triton kernels of split-KV decoding (Flash-Decoding, FlashDecoding++) over a contiguous or paged KV cache.

Jit code only: the split kernel with its fused merge, the merge kernel used
while a CUDA graph is captured, and the in-place append.  Grids, strides,
plans and launches are in :mod:`flashtile.runtime.decode`; the algorithm,
layouts and the untrusted-index contract are written up in ``docs/decoding.md``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtile.kernels._common import LN2, LOG2E, e4m3_exact, mma, multiple16, unfold_pid
from flashtile.kernels.block_info import kv_block_range
from flashtile.kernels.fa3_fwd import ERR_DESCALE
from flashtile.kernels.mask import allowed, score_mods

__all__ = [
    "FLAG_ABOVE",
    "FLAG_BELOW",
    "FLAG_OVERFLOW",
    "ERR_SEQLENS",
    "ERR_BLOCK_TABLE",
    "ERR_BATCH_IDX",
    "ERR_CU_SEQLENS_Q",
]

_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)

# per-row flag bits of the FlashDecoding++ path: a score above / below phi's safe range, non-finite sums
FLAG_ABOVE, FLAG_BELOW, FLAG_OVERFLOW = 1, 2, 4
_FLAG_ABOVE, _FLAG_BELOW = tl.constexpr(FLAG_ABOVE), tl.constexpr(FLAG_BELOW)
_FLAG_OVERFLOW = tl.constexpr(FLAG_OVERFLOW)

# bits of the per-device error word: a length outside [0, capacity], a used block-table entry outside [0, num_pages)
ERR_SEQLENS, ERR_BLOCK_TABLE = 1, 2
_ERR_SEQLENS, _ERR_BLOCK_TABLE = tl.constexpr(ERR_SEQLENS), tl.constexpr(ERR_BLOCK_TABLE)
# a cache_batch_idx entry outside [0, cache batch); a cu_seqlens_q span outside [0, total_q] or > max_seqlen_q, or
# cu_seqlens_q not running from 0 to total_q
ERR_BATCH_IDX, ERR_CU_SEQLENS_Q = 4, 8
_ERR_BATCH_IDX, _ERR_CU_SEQLENS_Q = tl.constexpr(ERR_BATCH_IDX), tl.constexpr(ERR_CU_SEQLENS_Q)
# an FP8 cache's k or v descale of (batch element, kv head) not finite and > 0 (the FP8 forward's bit)
_ERR_DESCALE = tl.constexpr(ERR_DESCALE)


@triton.jit
def _descale_ok(x):
    """Whether a descale is finite and > 0 (NaN fails every comparison)."""
    return (x > 0.0) & (x < float("inf"))


@triton.jit
def _tile_offsets(
    BlockTable, off_b, start_n, stride_bt_b, stride_kb, stride_kn, stride_vb, stride_vn, num_pages,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    """64-bit element offsets of key ``start_n`` in K and in V, relative to the
    (batch element, kv head) base pointers, and whether the tile's page exists.

    Paged: the tile lies inside logical page ``start_n // PAGE_SIZE`` (BLOCK_N
    divides PAGE_SIZE), so one scalar block-table load per tile serves both K
    and V; ``stride_kb`` is then the page stride and the base pointers carry
    only the head offset.  A page outside ``[0, num_pages)`` is absent: its
    offsets point at page 0 and the caller masks every load of the tile.
    Contiguous: the base pointers carry the batch offset; the page always exists."""
    if PAGED:
        page = tl.load(BlockTable + off_b.to(tl.int64) * stride_bt_b + start_n // PAGE_SIZE).to(tl.int64)
        page_ok = (page >= 0) & (page < num_pages)
        page = tl.where(page_ok, page, 0)
        row = (start_n % PAGE_SIZE).to(tl.int64)
        k_off = page * stride_kb + row * stride_kn
        v_off = page * stride_vb + row * stride_vn
    else:
        page_ok = start_n >= 0
        k_off = start_n.to(tl.int64) * stride_kn
        v_off = start_n.to(tl.int64) * stride_vn
    return k_off, v_off, page_ok


@triton.jit
def _checked_length(SeqlensK, off_b, stride_sl, seqlen_add, capacity, FULL_LENGTH: tl.constexpr):
    """``(L, bad)``: the attended length ``cache_seqlens[b] + seqlen_add`` clamped to ``[0, capacity]``
    (in int64, so no int64 length wraps into range) and whether the stored length was out of range.
    ``FULL_LENGTH`` (no cache_seqlens, so no append: ``seqlen_add`` 0): every slot, ``L = capacity``, nothing read."""
    if FULL_LENGTH:
        raw = (off_b * 0 + capacity - seqlen_add).to(tl.int64)
    else:
        raw = tl.load(SeqlensK + off_b.to(tl.int64) * stride_sl).to(tl.int64)
    bad = (raw < 0) | (raw > capacity - seqlen_add)
    length = tl.minimum(tl.maximum(raw + seqlen_add, 0), capacity)
    return length.to(tl.int32), bad


@triton.jit
def _cache_row(CacheBatchIdx, off_b, n_cache_batch, HAS_BATCH_IDX: tl.constexpr):
    """``(row, bad)``: the cache row of batch element ``off_b`` (``cache_batch_idx[b]``, or b) as int64;
    an entry outside ``[0, n_cache_batch)`` becomes row 0 and ``bad`` (the caller then reads and writes nothing)."""
    if HAS_BATCH_IDX:
        raw = tl.load(CacheBatchIdx + off_b.to(tl.int64)).to(tl.int64)
        bad = (raw < 0) | (raw >= n_cache_batch)
        row = tl.where(bad, 0, raw)
    else:
        row = off_b.to(tl.int64)
        bad = off_b < 0  # False
    return row, bad


@triton.jit
def _q_span(CuSeqlensQ, off_b, last_b, seqlen_q, total_q, VARLEN_Q: tl.constexpr):
    """``(start, n, end, bad)``: element b's query rows ``[start, start + n)`` (int64 start): with ``VARLEN_Q``
    from ``cu_seqlens_q[b:b + 2]`` clamped to ``[0, total_q]`` and ``n <= seqlen_q`` (= max_seqlen_q),
    ``end`` = ``cu_seqlens_q[b + 1]`` clamped to ``[0, total_q]``, ``bad`` when clamping changed them or
    when ``cu_seqlens_q[0] != 0`` (b = 0) or ``cu_seqlens_q[B] != total_q`` (b = ``last_b``): packed rows
    outside every span (:func:`_store_empty_rows` covers them); else ``(0, seqlen_q, seqlen_q, False)``."""
    if VARLEN_Q:
        lo = tl.load(CuSeqlensQ + off_b.to(tl.int64)).to(tl.int64)
        hi = tl.load(CuSeqlensQ + off_b.to(tl.int64) + 1).to(tl.int64)
        start = tl.minimum(tl.maximum(lo, 0), total_q)
        end = tl.minimum(tl.maximum(hi, 0), total_q)
        n = tl.minimum(tl.minimum(tl.maximum(hi - start, 0), seqlen_q), total_q - start)
        bad = (start != lo) | (n != hi - lo) | ((off_b == 0) & (lo != 0)) | ((off_b == last_b) & (hi != total_q))
        n = n.to(tl.int32)
    else:
        start = off_b.to(tl.int64) * 0
        n = seqlen_q
        end = start + seqlen_q
        bad = off_b < 0  # False
    return start, n, end, bad


@triton.jit
def _store_empty_rows(
    Out, LSE, off_b, last_b, start, stop, end, off_hk, kv_group, stride_om, stride_oh, total_q, head_dim,
    BLOCK_D: tl.constexpr,
):
    """Out 0 and lse -inf on the packed rows element ``off_b`` leaves uncomputed, for kv head ``off_hk``'s q heads:
    ``[stop, end)`` (``stop = start + n``, ``(start, n, end)`` of :func:`_q_span`), for element 0 also
    ``[0, start)`` and for the last (``last_b``) ``[end, total_q)``.  Every row of ``[0, total_q)`` then lies in
    some element's span or in one of these (a row ``r`` in ``[cu[0], cu[B])`` has some b with
    ``cu[b] <= r < cu[b + 1]``), whatever ``cu_seqlens_q`` holds."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    zero = tl.zeros((BLOCK_D,), dtype=Out.dtype.element_ty)
    for part in range(0, 3):
        lo = tl.where(part == 0, stop, tl.where(part == 1, 0, end))
        first = tl.where(off_b == 0, start, 0)
        tail = tl.where(off_b == last_b, total_q, 0)
        hi = tl.where(part == 0, end, tl.where(part == 1, first, tail))
        for g in range(0, kv_group):
            h = (off_hk * kv_group + g).to(tl.int64)
            for tok in range(lo, hi):
                tl.store(Out + tok * stride_om + h * stride_oh + offs_d, zero, mask=d_ok)
                tl.store(LSE + h * total_q + tok, float("-inf"))


@triton.jit
def _rotary_load(
    base, pos, ok, offs_d, d_ok, RotCos, RotSin, rot_half, INTERLEAVED: tl.constexpr,
):
    """Rows at ``base`` (pointer (M, 1), or scalar) loaded in fp32 and rotated at positions ``pos``
    (same shape, in range; ``ok`` an (M, 1) or (1, D) mask tensor) over the first ``2 rot_half`` dims (flash-attn's rotary): pair (x1, x2) becomes
    ``(x1 cos - x2 sin, x2 cos + x1 sin)`` with ``cos = RotCos[pos, j]``, pairs ``(2j, 2j + 1)``
    (``INTERLEAVED``, GPT-J) or ``(j, j + rot_half)`` (GPT-NeoX); the other dims pass through.
    Each pair's partner is a second load of the same (cached) row."""
    rot = offs_d < 2 * rot_half
    if INTERLEAVED:
        partner = offs_d ^ 1
        j = offs_d // 2
        first = (offs_d % 2) == 0
    else:
        first = offs_d < rot_half
        partner = tl.where(first, offs_d + rot_half, offs_d - rot_half)
        j = tl.where(first, offs_d, offs_d - rot_half)
    partner = tl.where(rot, partner, offs_d)
    j = tl.where(rot, j, 0)
    x = tl.load(base + offs_d[None, :], mask=ok & d_ok[None, :], other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=ok & (rot & d_ok)[None, :], other=0.0).to(tl.float32)
    cs = pos.to(tl.int64) * rot_half + j[None, :]
    cs_ok = ok & rot[None, :]
    c = tl.load(RotCos + cs, mask=cs_ok, other=1.0).to(tl.float32)
    s = tl.load(RotSin + cs, mask=cs_ok, other=0.0).to(tl.float32)
    return x * c + tl.where(first, -1.0, 1.0)[None, :] * xp * s


@triton.jit
def _pow2_rows(q):
    """``(q16, q_row)``: the rows of q (bf16) in fp16 as ``q16 = q / q_row`` with ``q_row`` ((BLOCK_M, 1) fp32)
    the power of two taking each row's largest |q| into [2^14, 2^15) (2^-126 for a zero row: any finite scale is exact there).  Both steps are
    exact but for entries below 2^-28 of their row's largest (fp16 subnormals), so no row overflows fp16
    and ``q16 . k = (q . k) / q_row`` to fp32 accumulation.  The exponent is read from the bits (no log2)."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.abs(qf), 1)
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # 0 for zero and subnormal rows
    shift = tl.minimum(tl.maximum(141 - tl.maximum(biased, 1), -126), 126)  # 14 - (biased - 127)
    scale = ((shift + 127) << 23).to(tl.float32, bitcast=True)
    q_row = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    return (qf * scale[:, None]).to(tl.float16), q_row[:, None]


@triton.jit
def _tile_scores(
    q, k, offs_t, offs_n, seqlen_q, seqlen_k, qk_scale, sm_scale, softcap, slope,
    window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, q_row, Q_ROW_SCALE: tl.constexpr,
):
    """Modified scores of one tile in base-2 units, (BLOCK_M, BLOCK_N) fp32, and
    the allowed mask (sequence tail, causal / window).  ``offs_t`` are the packed
    rows' token indices, ``slope`` their ALiBi slopes as a (BLOCK_M, 1) column,
    ``q_row`` (``Q_ROW_SCALE``) the power of two each row of q was divided by."""
    qk = mma(q, k, None, DOT_PRECISION, UPCAST_DOT)
    if Q_ROW_SCALE:
        qk = qk * q_row  # exact: a power of two
    if HAS_SOFTCAP or HAS_ALIBI:
        s, _ = score_mods(qk * sm_scale, offs_t, offs_n, seqlen_q, seqlen_k, softcap, slope, HAS_SOFTCAP, HAS_ALIBI)
        s = s * _LOG2E
    else:
        s = qk * qk_scale  # scale and log2 e in one multiply
    ok = allowed(offs_t, offs_n, seqlen_q, seqlen_k, window_left, window_right, True, HAS_LEFT, HAS_RIGHT)
    return s, ok


@triton.jit
def _sweep(
    q, k_head, v_head, k_tile, v_tile, BlockTable, off_b, start, end, offs_t, row_ok, d_ok,
    seqlen_q, seqlen_k, sm_scale, softcap, slope, phi2, lo2, hi2, window_left, window_right,
    stride_bt_b, stride_kb, stride_kn, stride_vb, stride_vn, num_pages,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, UNIFIED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    key_lo, HAS_LEFTPAD: tl.constexpr, q_row, Q_ROW_SCALE: tl.constexpr, V_SMEM16: tl.constexpr,
):
    """Keys ``[start, end)`` of one split for the packed rows: ``(acc, l, m, flag, bad_page)`` in base 2.

    Safe (FA2 Algorithm 1, lines 8-10): running max ``m``, ``acc`` and ``l`` rescaled by
    ``exp2(m - m')`` whenever it grows.  ``UNIFIED`` (FlashDecoding++): ``m = phi2`` fixed,
    no max and no rescaling, and ``flag`` marks rows with an allowed score outside
    ``phi2 + [lo2, hi2]`` (bit 1 above, bit 2 below; padded rows never flag).  A tile whose
    page is absent (block-table entry outside ``[0, num_pages)``) is neither read nor
    counted, and sets ``bad_page``.  ``HAS_LEFTPAD``: keys below ``key_lo`` are masked (cache_leftpad).
    ``Q_ROW_SCALE``: q's rows were multiplied by ``1 / q_row`` ((BLOCK_M, 1), powers of two), undone on the scores.
    ``V_SMEM16`` (FP8 cache): V is widened before it is staged for the MMA (see the select below)."""
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    flag = tl.zeros((BLOCK_M,), dtype=tl.int32)
    if UNIFIED:
        m_i = tl.zeros((BLOCK_M,), dtype=tl.float32) + phi2
    else:
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    qk_scale = sm_scale * _LOG2E
    offs_n0 = tl.arange(0, BLOCK_N)
    bad_page = start < 0  # False: the split's start is never negative
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        k_off, v_off, page_ok = _tile_offsets(
            BlockTable, off_b, start_n, stride_bt_b, stride_kb, stride_kn, stride_vb, stride_vn, num_pages,
            PAGED, PAGE_SIZE,
        )
        limit = seqlen_k
        if PAGED:
            # an absent page ends the keys at the tile's start: nothing of it is read or counted
            limit = tl.where(page_ok, seqlen_k, 0)
            bad_page = bad_page | (page_ok == 0)
        kv_ok = offs_n < limit
        k = tl.load(k_head + k_off + k_tile, mask=kv_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_head + v_off + v_tile, mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        # an FP8 cache is widened (exactly) to q's dtype for both MMAs, fp16 under KV_F16_MMA (a no-op for
        # a cache of q's dtype); its descales are folded into sm_scale and the partial output by the caller
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        if V_SMEM16:
            # a select on the widened tile keeps the widening in the load's layout: V then reaches the MMA as a
            # 16-bit tile in shared memory read by ldmatrix.trans, not one LDS.U8 an element (sm_90 has no 8-bit
            # transposing ldmatrix; the masked keys are 0 already)
            v = tl.where(kv_ok[:, None], v, 0.0)
        s, ok = _tile_scores(
            q, k, offs_t, offs_n, seqlen_q, seqlen_k, qk_scale, sm_scale, softcap, slope,
            window_left, window_right, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, UPCAST_DOT,
            q_row, Q_ROW_SCALE=Q_ROW_SCALE,
        )
        if PAGED:
            ok = ok & kv_ok[None, :]
        if HAS_LEFTPAD:
            ok = ok & (offs_n >= key_lo)[None, :]
        if UNIFIED:
            dev = s - phi2
            ok = ok & row_ok[:, None]
            flag = flag | tl.max((ok & (dev > hi2)).to(tl.int32), 1) * _FLAG_ABOVE
            flag = flag | tl.max((ok & (dev < lo2)).to(tl.int32), 1) * _FLAG_BELOW
            p = tl.where(ok, tl.math.exp2(dev), 0.0)
            l_i = l_i + tl.sum(p, 1)
            acc = mma(p.to(v.dtype), v, acc, DOT_PRECISION, UPCAST_DOT)
        else:
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # safe max: rows with nothing allowed yet keep m = -inf; exp2(-inf - 0) = 0, not NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = mma(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION, UPCAST_DOT)
            m_i = m_new
    return acc, l_i, m_i, flag, bad_page


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _out_rows(
    off_b, offs_h, offs_t, q_start, stride_ob, stride_om, stride_oh, n_heads_q, seqlen_q, total_q,
    VARLEN_Q: tl.constexpr,
):
    """64-bit element offsets of rows (b, h, t) in ``Out`` and their indices in ``LSE``: (B, Nq, Hq, d) and
    (B, Hq, Nq), or with ``VARLEN_Q`` (total_q, Hq, d) and (Hq, total_q) at row ``q_start + t``."""
    if VARLEN_Q:
        tok = q_start + offs_t.to(tl.int64)
        o_off = tok * stride_om + offs_h.to(tl.int64) * stride_oh
        lse_row = offs_h.to(tl.int64) * total_q + tok
    else:
        o_off = off_b.to(tl.int64) * stride_ob + offs_t.to(tl.int64) * stride_om + offs_h.to(tl.int64) * stride_oh
        lse_row = (off_b.to(tl.int64) * n_heads_q + offs_h) * seqlen_q + offs_t
    return o_off, lse_row


@triton.jit
def _merge_rows(
    Work, FPart, Out, LSE, Flags, off_b, off_hk, r_lo, r_hi,
    stride_ob, stride_om, stride_oh, n_heads_q, kv_group, seqlen_q, head_dim, n_splits, lse_offset,
    MERGE_M: tl.constexpr, MERGE_S: tl.constexpr, BLOCK_D: tl.constexpr, UNIFIED: tl.constexpr,
    CuSeqlensQ, total_q, VARLEN_Q: tl.constexpr,
):
    """Merge the S partials of packed rows ``[r_lo, r_hi)`` into ``out`` / ``lse`` (FA1 Algorithm 1, lines 11-12):

        lse = log sum_c exp(LSE_c),    O = sum_c exp(LSE_c - lse) O_c

    (all LSE_c = -inf: O = 0, lse = -inf).  ``MERGE_M`` rows and ``MERGE_S`` splits per
    load, one (MERGE_M, MERGE_S, BLOCK_D) tile: the partials are read with wide loads in
    parallel (merging split by split made the call ~1.4x slower at B=1, 1k-4k keys), and chunks of
    splits combine by the same running-max rescaling as the key tiles.  Loads bypass
    L1 (``.cg``): the partials were written by other SMs during this launch.  ``VARLEN_Q``: rows
    past the element's query count are padding (neither merged nor stored)."""
    offs_d = tl.arange(0, BLOCK_D)
    q_start, q_len, _end, _bad_span = _q_span(CuSeqlensQ, off_b, -1, seqlen_q, total_q, VARLEN_Q)
    for r0 in range(r_lo, r_hi, MERGE_M):
        offs_r = r0 + tl.arange(0, MERGE_M)
        r_ok = offs_r < r_hi
        offs_t = offs_r % seqlen_q
        offs_h = off_hk * kv_group + offs_r // seqlen_q
        if VARLEN_Q:
            r_ok = r_ok & (offs_t < q_len)
        row = (off_b.to(tl.int64) * n_heads_q + offs_h) * seqlen_q + offs_t  # index into (B, Hq, Nq), 64-bit
        prow = row.to(tl.int64) * n_splits
        m = tl.full((MERGE_M,), float("-inf"), dtype=tl.float32)
        tot = tl.zeros((MERGE_M,), dtype=tl.float32)
        acc = tl.zeros((MERGE_M, BLOCK_D), dtype=tl.float32)
        flag = tl.zeros((MERGE_M,), dtype=tl.int32)
        for c0 in range(0, n_splits, MERGE_S):
            offs_c = c0 + tl.arange(0, MERGE_S)
            ok = r_ok[:, None] & (offs_c < n_splits)[None, :]
            idx = prow[:, None] + offs_c[None, :]
            lses = tl.load(Work + lse_offset + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(
                Work + idx[:, :, None] * BLOCK_D + offs_d[None, None, :], mask=ok[:, :, None], other=0.0,
                cache_modifier=".cg",
            )
            m_new = tl.maximum(m, tl.max(lses, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            w = tl.math.exp2((lses - m_safe[:, None]) * _LOG2E)  # -inf partials (empty, masked) weigh 0
            alpha = tl.math.exp2((m - m_safe) * _LOG2E)
            tot = tot * alpha + tl.sum(w, 1)
            acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
            m = m_new
            if UNIFIED:
                f = tl.load(FPart + idx, mask=ok, other=0, cache_modifier=".cg").to(tl.int32)
                flag = flag | tl.reduce(f, 1, _bit_or)
        live = tot > 0.0
        tot_safe = tl.where(live, tot, 1.0)
        lse = tl.where(live, tl.where(m == float("-inf"), 0.0, m) + tl.log(tot_safe), float("-inf"))
        o_off, lse_row = _out_rows(
            off_b, offs_h, offs_t, q_start, stride_ob, stride_om, stride_oh, n_heads_q, seqlen_q, total_q, VARLEN_Q,
        )
        tl.store(Out + o_off[:, None] + offs_d[None, :], (acc / tot_safe[:, None]).to(Out.dtype.element_ty), mask=r_ok[:, None] & (offs_d < head_dim)[None, :])
        tl.store(LSE + lse_row, lse, mask=r_ok)
        if UNIFIED:
            tl.store(Flags + row, flag, mask=r_ok)


@triton.jit
def _decode_merge_kernel(
    Work, FPart, Out, LSE, Flags,
    CuSeqlensQ,  # int32 (B + 1,) with VARLEN_Q (else any tensor, unused)
    stride_ob, stride_om, stride_oh,
    n_heads_q, n_heads_k, kv_group, seqlen_q, head_dim, n_splits, lse_offset, n_bh,
    total_q,
    BLOCK_M: tl.constexpr, MERGE_M: tl.constexpr, MERGE_S: tl.constexpr, BLOCK_D: tl.constexpr,
    UNIFIED: tl.constexpr,
    VARLEN_Q: tl.constexpr,
):
    """Kernel 2 (CUDA-graph capture only): in a ``fold_grid(row tiles, B·Hk)`` grid, program
    (m, b·Hk + h) merges packed rows ``[m BLOCK_M, (m + 1) BLOCK_M)`` of kv head h of batch element
    b, with the fused merge's code and split chunk (a graph replay gives the same bits as an eager
    call: GPU test)."""
    pid_m, pid_bh = unfold_pid()
    if pid_bh >= n_bh:
        return
    r_lo = pid_m * BLOCK_M
    _merge_rows(
        Work, FPart, Out, LSE, Flags, pid_bh // n_heads_k, pid_bh % n_heads_k, r_lo,
        tl.minimum(r_lo + BLOCK_M, kv_group * seqlen_q),
        stride_ob, stride_om, stride_oh, n_heads_q, kv_group, seqlen_q, head_dim, n_splits, lse_offset,
        MERGE_M, MERGE_S, BLOCK_D, UNIFIED, CuSeqlensQ, total_q, VARLEN_Q,
    )


# per-call ints: a contiguous cache that grows between calls (a Hugging Face DynamicCache) changes them
@triton.jit(do_not_specialize=["stride_kb", "stride_kh", "stride_vb", "stride_vh", "capacity"])
def _decode_split_kernel(
    Q, K, V, BlockTable, SeqlensK, Alibi,
    Work,  # fp32 workspace: partial outputs (B, Hq, Nq, S, BLOCK_D), then at lse_offset partial LSEs (B, Hq, Nq, S)
    FPart,  # int8 flags per partial (FlashDecoding++ only)
    Count,  # int32 arrival counter per (batch element, kv head, row tile), FUSED only: zero on entry and exit
    Out, LSE, Flags,  # final outputs (Flags: FlashDecoding++ only)
    Err,  # int32 error bits of the device (ERR_SEQLENS, ERR_BLOCK_TABLE), ORed into
    KDescale, VDescale,  # fp32 (B, Hk) descales of a float8_e4m3fn cache (KV_FP8 only)
    # int32 (B,) cache_batch_idx / cache_leftpad, int32 (B + 1,) cu_seqlens_q, rotary cos / sin (seqlen_ro, rot_half)
    # (each read only under its constexpr below; otherwise any tensor at hand)
    CacheBatchIdx, LeftPad, CuSeqlensQ, RotCos, RotSin,
    sm_scale, softcap, phi2, lo2, hi2,  # floats; phi2/lo2/hi2: unified max and its safe range, base-2 units
    # per-call ints: K/V batch (page) and head strides, the capacity lengths are clamped to
    stride_kb, stride_kh, stride_vb, stride_vh, capacity,
    # ints (fixed for a problem signature: runtime/launch.py binds them once)
    stride_qb, stride_qm, stride_qh,
    stride_kn,
    stride_vn,
    stride_bt_b, stride_sl, stride_alibi_b, stride_alibi_h,
    stride_ob, stride_om, stride_oh,
    n_heads_q, n_heads_k, kv_group, seqlen_q, head_dim, n_splits, window_left, window_right, lse_offset,
    seqlen_add, num_pages,
    stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
    n_cache_batch, total_q, rot_half, seqlen_ro,  # k_cache.shape[0]; q rows (VARLEN_Q); rotary_dim / 2; cos rows
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    UNIFIED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    EVEN_D: tl.constexpr, WRITE_OUT: tl.constexpr,
    FUSED: tl.constexpr, MERGE_M: tl.constexpr, MERGE_S: tl.constexpr,
    KV_FP8: tl.constexpr, KV_F16_MMA: tl.constexpr, KV_V_SMEM16: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr, VARLEN_Q: tl.constexpr,
    ROTARY: tl.constexpr, ROT_INTERLEAVED: tl.constexpr, ROT_PER_TOKEN: tl.constexpr,
    KV_ALIGNED: tl.constexpr,  # 16 divides the per-call K/V strides (the divisibility specialisation gave)
    FULL_LENGTH: tl.constexpr,  # no cache_seqlens: every element attends to all `capacity` slots (SeqlensK unread)
    WIDE_TILE: tl.constexpr,  # in-tile K/V offsets need 64 bits (runtime.decode.wide_tile)
):
    """One split of one (batch element, kv head) for ``BLOCK_M`` packed (head, token) rows;
    with ``FUSED`` the split that finishes last for those rows also merges all their splits.

    ``EVEN_D`` (head_dim == BLOCK_D) drops the head-dim mask: a mask that varies
    along the contiguous axis stops Triton from issuing 16-byte vector loads,
    and the K/V loads are the whole cost of decoding.

    Memory safety does not trust the indices: the length ``SeqlensK[b] + seqlen_add`` is
    clamped to ``[0, capacity]`` and absent pages are masked (:func:`_sweep`); either one
    ORs its bit into ``Err`` (once per (batch element, kv head) program of split 0, row tile 0).
    So does a ``cache_batch_idx`` entry outside ``[0, n_cache_batch)`` (the element reads no key)
    and, with ``VARLEN_Q``, a ``cu_seqlens_q`` span outside ``[0, total_q]`` or longer than
    ``seqlen_q`` (= max_seqlen_q; clamped, :func:`_q_span`), or ``cu_seqlens_q[0] != 0`` or
    ``cu_seqlens_q[B] != total_q``; then packed rows no span computes are stored as out 0, lse -inf
    (:func:`_store_empty_rows`).  ``KV_FP8``: a k or v descale of (b, kv head) not finite and > 0 ORs
    ERR_DESCALE, and the program reads no key (its rows output 0, lse -inf).

    ``HAS_LEFTPAD``: keys below ``cache_leftpad[b]`` (clamped to ``[0, L]``) are masked and their
    tiles skipped.  ``ROTARY``: q is rotated on load (:func:`_rotary_load`) at position
    ``cache_seqlens[b] + t`` (``ROT_PER_TOKEN``: causal or windowed) or ``cache_seqlens[b]``
    for every token, clamped to ``[0, seqlen_ro)``.

    ``KV_F16_MMA`` (FP8 cache, bf16 q, safe path): q's rows are scaled by powers of two into fp16
    (:func:`_pow2_rows`) and both MMAs run in fp16, so an e4m3 key or value widens exactly with one
    ``cvt.rn.f16x2.e4m3x2`` per two elements (to bf16 it takes that and two more conversions).
    ``KV_V_SMEM16`` (FP8 cache): the V tile is widened in registers before the MMA stages it (:func:`_sweep`)."""
    tl.static_assert(not (PAGED and (HAS_BATCH_IDX or HAS_LEFTPAD)), "batch index / leftpad: contiguous cache only")
    tl.static_assert(KV_FP8 or not (KV_F16_MMA or KV_V_SMEM16), "fp16 MMAs / V staging are modes of an FP8 cache")
    tl.static_assert(not (KV_F16_MMA and UNIFIED), "fp16 MMAs: safe path only (P <= 1)")
    if KV_ALIGNED:
        stride_kb, stride_kh = multiple16(stride_kb), multiple16(stride_kh)
        stride_vb, stride_vh = multiple16(stride_vb), multiple16(stride_vh)
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    off_b = pid_bh // n_heads_k
    off_hk = pid_bh % n_heads_k
    seqlen_k, bad_len = _checked_length(SeqlensK, off_b, stride_sl, seqlen_add, capacity, FULL_LENGTH=FULL_LENGTH)
    reporter = (split == 0) & (pid_m == 0)
    if bad_len & reporter:
        tl.atomic_or(Err, _ERR_SEQLENS)
    cache_b, bad_row = _cache_row(CacheBatchIdx, off_b, n_cache_batch, HAS_BATCH_IDX)
    q_start, q_len, _q_end, _bad_span = _q_span(CuSeqlensQ, off_b, -1, seqlen_q, total_q, VARLEN_Q)
    if HAS_BATCH_IDX:
        if bad_row & reporter:
            tl.atomic_or(Err, _ERR_BATCH_IDX)
    base_len = seqlen_k - seqlen_add  # cache_seqlens[b] (clamped): the first new token's position
    if HAS_BATCH_IDX:
        seqlen_k = tl.where(bad_row, 0, seqlen_k)  # an absent cache row: no key is read
    if KV_FP8:
        k_ds = tl.load(KDescale + off_b.to(tl.int64) * stride_kds_b + off_hk.to(tl.int64) * stride_kds_h)
        v_ds = tl.load(VDescale + off_b.to(tl.int64) * stride_vds_b + off_hk.to(tl.int64) * stride_vds_h)
        ds_ok = _descale_ok(k_ds) & _descale_ok(v_ds)
        if (ds_ok == 0) & reporter:
            tl.atomic_or(Err, _ERR_DESCALE)
        seqlen_k = tl.where(ds_ok, seqlen_k, 0)  # a bad descale: no key is read, the rows output 0 / lse -inf
    key_lo = seqlen_k * 0
    if HAS_LEFTPAD:
        key_lo = tl.minimum(tl.maximum(tl.load(LeftPad + off_b.to(tl.int64)), 0), seqlen_k)

    # packed rows: r -> (q head off_hk * G + r // Nq, token r % Nq)
    n_rows = kv_group * seqlen_q
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < n_rows
    offs_t = offs_r % seqlen_q
    offs_h = off_hk * kv_group + offs_r // seqlen_q
    if VARLEN_Q:
        row_ok = row_ok & (offs_t < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    if EVEN_D:
        d_ok = offs_d < BLOCK_D  # all true, and known constant along d
    q_rows = (Q + off_b.to(tl.int64) * stride_qb) + ((q_start + offs_t.to(tl.int64)) * stride_qm + offs_h.to(tl.int64) * stride_qh)[:, None]
    if ROTARY:
        pos = tl.zeros((BLOCK_M,), dtype=tl.int32) + base_len
        if ROT_PER_TOKEN:
            pos = pos + offs_t
        pos = tl.minimum(tl.maximum(pos, 0), seqlen_ro - 1)
        q = _rotary_load(
            q_rows, pos[:, None], row_ok[:, None], offs_d, d_ok, RotCos, RotSin, rot_half, ROT_INTERLEAVED,
        ).to(Q.dtype.element_ty)
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_row = tl.full((BLOCK_M, 1), 1.0, dtype=tl.float32)
    if KV_F16_MMA:
        q, q_row = _pow2_rows(q)
    slope = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
    if HAS_ALIBI:
        sl = tl.load(Alibi + off_b.to(tl.int64) * stride_alibi_b + offs_h.to(tl.int64) * stride_alibi_h, mask=row_ok,
                     other=0.0)
        slope = sl.to(tl.float32)[:, None]

    # keys any token may see: [L - Nq - left, L - 1 + right] (token 0's left edge, token Nq-1's right edge)
    kv_lo, _kv_full_lo, _kv_full_hi, kv_hi = kv_block_range(
        0, q_len, q_len, seqlen_k, window_left, window_right,
        BLOCK_N=BLOCK_N, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT,
    )
    if HAS_LEFTPAD:
        kv_lo = tl.maximum(kv_lo, (key_lo // BLOCK_N) * BLOCK_N)
    n_tiles = tl.cdiv(tl.maximum(kv_hi - kv_lo, 0), BLOCK_N)
    per_split = tl.cdiv(n_tiles, n_splits)
    start = kv_lo + split * per_split * BLOCK_N
    end = tl.minimum(kv_lo + (split + 1) * per_split * BLOCK_N, kv_hi)

    # (batch element, kv head) base pointers; the paged batch offset comes per tile
    k_head = K + off_hk.to(tl.int64) * stride_kh
    v_head = V + off_hk.to(tl.int64) * stride_vh
    if not PAGED:
        k_head += cache_b * stride_kb
        v_head += cache_b * stride_vb
    tile_n = tl.arange(0, BLOCK_N)
    if WIDE_TILE:
        tile_n = tile_n.to(tl.int64)  # (BLOCK_N - 1) * row stride + BLOCK_D reaches 2^31: 64-bit in-tile offsets
    k_tile = tile_n[None, :] * stride_kn + offs_d[:, None]  # (D, N): K^T
    v_tile = tile_n[:, None] * stride_vn + offs_d[None, :]  # (N, D)
    if KV_FP8:
        # s = sm_scale (q . k_descale k8): the k descale is one scalar of this program, folded into the scale
        sm_scale = sm_scale * tl.where(ds_ok, k_ds, 1.0)

    acc, l_i, m_i, flag, bad_page = _sweep(
        q, k_head, v_head, k_tile, v_tile, BlockTable, off_b, start, end, offs_t, row_ok, d_ok,
        q_len, seqlen_k, sm_scale, softcap, slope, phi2, lo2, hi2, window_left, window_right,
        stride_bt_b, stride_kb, stride_kn, stride_vb, stride_vn, num_pages,
        BLOCK_M, BLOCK_N, BLOCK_D, PAGED, PAGE_SIZE, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
        UNIFIED, DOT_PRECISION, UPCAST_DOT, key_lo, HAS_LEFTPAD, q_row, Q_ROW_SCALE=KV_F16_MMA, V_SMEM16=KV_V_SMEM16,
    )
    if PAGED:
        if bad_page & (pid_m == 0):
            tl.atomic_or(Err, _ERR_BLOCK_TABLE)
    if UNIFIED:
        # bit 4: the fp32 sums overflowed (|v| large enough that exp(s - phi) v passes fp32's range);
        # NaN compares False, so NaN counts as not finite too
        not_finite = tl.max(tl.where(tl.abs(acc) < float("inf"), 0, 1), 1) + tl.where(l_i < float("inf"), 0, 1)
        flag = flag | tl.where((not_finite > 0) & row_ok, _FLAG_OVERFLOW, 0)
        if tl.max(flag, 0) != 0:
            # FlashDecoding++'s fallback, done here: this split's rows are recomputed exactly on the
            # safe path (its keys are read again; no host round trip, so a CUDA graph can hold it)
            acc, l_i, m_i, _flag_again, _bad_page_again = _sweep(
                q, k_head, v_head, k_tile, v_tile, BlockTable, off_b, start, end, offs_t, row_ok, d_ok,
                q_len, seqlen_k, sm_scale, softcap, slope, phi2, lo2, hi2, window_left, window_right,
                stride_bt_b, stride_kb, stride_kn, stride_vb, stride_vn, num_pages,
                BLOCK_M, BLOCK_N, BLOCK_D, PAGED, PAGE_SIZE, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                False, DOT_PRECISION, UPCAST_DOT, key_lo, HAS_LEFTPAD, q_row, Q_ROW_SCALE=KV_F16_MMA, V_SMEM16=KV_V_SMEM16,
            )

    # normalised partial: O_c = acc / l, LSE_c = (m + log2 l) ln 2 (an empty split or masked row: 0, -inf)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o_part = acc / l_safe[:, None]
    if KV_FP8:
        # P (v_descale v8) = v_descale (P v8): the v descale scales the partial once, outside the key loop
        # (a bad one read no key: its partial 0 is scaled by 0, not by NaN or inf)
        v_ds = tl.load(VDescale + off_b.to(tl.int64) * stride_vds_b + off_hk.to(tl.int64) * stride_vds_h)
        o_part = o_part * tl.where(_descale_ok(v_ds), v_ds, 0.0)
    l_part = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * _LN2)
    row = (off_b.to(tl.int64) * n_heads_q + offs_h) * seqlen_q + offs_t  # index into (B, Hq, Nq), 64-bit
    if WRITE_OUT:
        # a single split is already the answer (the merge of one partial is the identity)
        o_off, lse_row = _out_rows(
            off_b, offs_h, offs_t, q_start, stride_ob, stride_om, stride_oh, n_heads_q, seqlen_q, total_q, VARLEN_Q,
        )
        tl.store(Out + o_off[:, None] + offs_d[None, :], o_part.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE + lse_row, l_part, mask=row_ok)
        if UNIFIED:
            tl.store(Flags + row, flag, mask=row_ok)
    else:
        # workspace row of (batch element, head, token) is contiguous over the S splits
        prow = row.to(tl.int64) * n_splits + split
        tl.store(Work + prow[:, None] * BLOCK_D + offs_d[None, :], o_part, mask=row_ok[:, None])
        tl.store(Work + lse_offset + prow, l_part, mask=row_ok)
        if UNIFIED:
            tl.store(FPart + prow, flag.to(tl.int8), mask=row_ok)
        if FUSED:
            # Arrival: every thread's stores above precede the release (a barrier, then one acq_rel
            # atomic per program); the program that arrives last acquires them all, merges the
            # tile's rows and resets the counter for the next launch on this stream.  One launch
            # instead of two: the same device time, one launch less of host time.
            tl.debug_barrier()
            counter = Count + pid_bh * tl.num_programs(2) + pid_m
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n_splits - 1:
                tl.store(counter, 0)
                r_lo = pid_m * BLOCK_M
                _merge_rows(
                    Work, FPart, Out, LSE, Flags, off_b, off_hk, r_lo, tl.minimum(r_lo + BLOCK_M, n_rows),
                    stride_ob, stride_om, stride_oh, n_heads_q, kv_group, seqlen_q, head_dim, n_splits, lse_offset,
                    MERGE_M, MERGE_S, BLOCK_D, UNIFIED, CuSeqlensQ, total_q, VARLEN_Q,
                )
    if VARLEN_Q:
        if reporter:
            # the span read again with its end and the whole-range check: neither stays live across the key loop
            last_b = tl.num_programs(0) // n_heads_k - 1
            q_start, q_len, q_end, bad_span = _q_span(CuSeqlensQ, off_b, last_b, seqlen_q, total_q, VARLEN_Q)
            if bad_span:
                tl.atomic_or(Err, _ERR_CU_SEQLENS_Q)
                # every packed row outside the computed spans gets out 0 / lse -inf
                _store_empty_rows(Out, LSE, off_b, last_b, q_start, q_start + q_len, q_end, off_hk, kv_group,
                                  stride_om, stride_oh, total_q, head_dim, BLOCK_D)


@triton.jit
def _quantize_e4m3(x, descale):
    """``x / descale`` (fp32, correctly rounded) saturated to [-448, 448] and rounded to e4m3 (ties to even):
    bit for bit torch's ``(x.float() / descale).clamp(-448, 448).to(torch.float8_e4m3fn)``."""
    y = tl.math.div_rn(x.to(tl.float32), descale)
    return e4m3_exact(tl.minimum(tl.maximum(y, -448.0), 448.0))


@triton.jit
def _append_kernel(
    K, V, KNew, VNew, BlockTable, SeqlensK, Err,
    KDescale, VDescale,  # fp32 (B, Hk) descales of a float8_e4m3fn cache (QUANT only)
    CacheBatchIdx, RotCos, RotSin,  # int32 (B,) cache rows; rotary tables (seqlen_ro, rot_half); read under their constexprs
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_knb, stride_knn, stride_knh, stride_vnb, stride_vnn, stride_vnh,
    stride_bt_b, stride_sl, n_new, capacity, num_pages, head_dim, n_heads_k, n_batch,
    stride_kds_b, stride_kds_h, stride_vds_b, stride_vds_h,
    n_cache_batch, rot_half,
    BLOCK_D: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr, ROTARY: tl.constexpr, ROT_INTERLEAVED: tl.constexpr,
):
    """In a ``fold_grid(Nnew·Hk, B)`` grid, program (i·Hk + h, b) stores row (b, i, h) of the new
    keys/values at position ``SeqlensK[b] + i`` of element b's cache (paged: through ``BlockTable``).

    Nothing trusts the indices: an element whose ``SeqlensK[b]`` lies outside
    ``[0, capacity - n_new]`` writes nothing and ORs ERR_SEQLENS into ``Err``; a row whose
    page lies outside ``[0, num_pages)`` is not written and ORs ERR_BLOCK_TABLE; with ``HAS_BATCH_IDX``
    the row goes to cache row ``CacheBatchIdx[b]``, and one outside ``[0, n_cache_batch)`` writes nothing
    and ORs ERR_BATCH_IDX.  ``ROTARY``: the key row is rotated at its position ``SeqlensK[b] + i``
    before it is stored (the capacity is at most the cos/sin rows, checked on the host).  ``QUANT``: k and v
    (k after rotary) are quantised to e4m3 with the descales of element b before the store; a descale not
    finite and > 0 stores nothing and ORs ERR_DESCALE."""
    tl.static_assert(not (PAGED and HAS_BATCH_IDX), "cache_batch_idx indexes a contiguous cache only")
    t, off_b = unfold_pid()
    if off_b >= n_batch:
        return
    i = t // n_heads_k
    h = t % n_heads_k
    raw = tl.load(SeqlensK + off_b.to(tl.int64) * stride_sl).to(tl.int64)
    len_ok = (raw >= 0) & (raw <= capacity - n_new)
    pos = tl.where(len_ok, raw + i, 0)
    if PAGED:
        page = tl.load(BlockTable + off_b.to(tl.int64) * stride_bt_b + pos // PAGE_SIZE).to(tl.int64)
        page_ok = (page >= 0) & (page < num_pages)
        page = tl.where(page_ok, page, 0)
        k_off = page * stride_kb + (pos % PAGE_SIZE) * stride_kn
        v_off = page * stride_vb + (pos % PAGE_SIZE) * stride_vn
    else:
        cache_b, bad_row = _cache_row(CacheBatchIdx, off_b, n_cache_batch, HAS_BATCH_IDX)
        page_ok = len_ok & (bad_row == 0)
        k_off = cache_b * stride_kb + pos * stride_kn
        v_off = cache_b * stride_vb + pos * stride_vn
    ok = len_ok & page_ok
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    src_k = KNew + off_b.to(tl.int64) * stride_knb + i.to(tl.int64) * stride_knn + h.to(tl.int64) * stride_knh
    src_v = VNew + off_b.to(tl.int64) * stride_vnb + i.to(tl.int64) * stride_vnn + h.to(tl.int64) * stride_vnh
    vn = tl.load(src_v + offs_d, mask=d_ok, other=0.0)
    if QUANT:
        # the (B, Hk) descales belong to q's batch element b (FA3's), also when cache_batch_idx picks the row
        k_ds = tl.load(KDescale + off_b.to(tl.int64) * stride_kds_b + h.to(tl.int64) * stride_kds_h)
        v_ds = tl.load(VDescale + off_b.to(tl.int64) * stride_vds_b + h.to(tl.int64) * stride_vds_h)
        ds_ok = _descale_ok(k_ds) & _descale_ok(v_ds)
        ok = ok & ds_ok  # a bad descale: nothing of the row is stored
        if (ds_ok == 0) & (i == 0):
            tl.atomic_or(Err, _ERR_DESCALE)
        vn = _quantize_e4m3(vn, v_ds)
    w_ok = offs_d < tl.where(ok, head_dim, 0)  # nothing of a rejected row is stored
    k_dst = K + k_off + h.to(tl.int64) * stride_kh
    if ROTARY:
        ok_row = (offs_d < tl.where(ok, BLOCK_D, 0))[None, :]  # (1, D): a scalar mask does not broadcast in the interpreter
        kr = _rotary_load(src_k, pos, ok_row, offs_d, d_ok, RotCos, RotSin, rot_half, ROT_INTERLEAVED)
        if QUANT:
            kq = _quantize_e4m3(kr, k_ds)  # the rotated fp32 key, rounded once (to e4m3)
        else:
            kq = kr.to(K.dtype.element_ty)
        tl.store(k_dst + offs_d[None, :], kq, mask=w_ok[None, :])
    else:
        kn = tl.load(src_k + offs_d, mask=d_ok, other=0.0)
        if QUANT:
            kn = _quantize_e4m3(kn, k_ds)
        tl.store(k_dst + offs_d, kn, mask=w_ok)
    tl.store(V + v_off + h.to(tl.int64) * stride_vh + offs_d, vn, mask=w_ok)
    bits = tl.where(len_ok, tl.where(page_ok, 0, _ERR_BLOCK_TABLE), _ERR_SEQLENS)
    if HAS_BATCH_IDX:
        bits = tl.where(len_ok & (bad_row != 0), _ERR_BATCH_IDX, bits)
    if (bits != 0) & (h == 0):
        tl.atomic_or(Err, bits)


@triton.jit(do_not_specialize=["keep0", "keep1"])  # one compile whatever bits are cleared
def _clear_error_bits_kernel(Err, keep0, keep1):
    """Error words &= keep, atomically: a bit a kernel on another stream sets meanwhile survives (a plain zero-fill
    could drop it between the host's read and the clear)."""
    tl.atomic_and(Err, keep0)
    tl.atomic_and(Err + 1, keep1)
