"""FlashAttention-2 forward kernel (FA2 paper, Algorithm 1): jit code only.

One program owns one query tile of one (batch, head) pair, keeps the online-softmax state
in registers and walks the key tiles that :func:`flashtile.kernels.block_info.kv_block_range`
gives it, masking only the tiles outside the fully-visible band.  Grid, strides, tiles and the
launch are in :mod:`flashtile.runtime.fa2_fwd`; the algorithm is written up in ``docs/fa2.md``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashtile.kernels._common import LN2, LOG2E, check_tiles, dropout_keep, mma, multiple16, philox_state, unfold_pid
from flashtile.kernels.block_info import kv_block_range, seq_base, seqlen_errors, seqlen_info
from flashtile.kernels.mask import allowed, score_mods

__all__ = ["ERR_CU_SEQLENS", "ERR_VARLEN_BLOCK_TABLE"]

_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)

# bits of the device error word (runtime.decode.error_flags) the packed (IS_VARLEN) forward sets:
# cu_seqlens_q / cu_seqlens_k values that break the packed contract, a visited block_table page outside the pool
ERR_CU_SEQLENS, ERR_VARLEN_BLOCK_TABLE = 32, 64
_ERR_CU_SEQLENS, _ERR_VARLEN_BLOCK_TABLE = tl.constexpr(ERR_CU_SEQLENS), tl.constexpr(ERR_VARLEN_BLOCK_TABLE)
_PAGE_CHUNK = tl.constexpr(64)  # block-table entries checked per step by _bad_pages


@triton.jit
def _load_bias(ptrs, offs_m, offs_n, seqlen_q, seqlen_k, CHECK_M: tl.constexpr, CHECK_N: tl.constexpr):
    """(BLOCK_M, BLOCK_N) additive bias tile in fp32; out-of-range entries read as 0
    (their scores are masked or their rows never stored)."""
    if CHECK_M and CHECK_N:
        b = tl.load(ptrs, mask=(offs_m < seqlen_q)[:, None] & (offs_n < seqlen_k)[None, :], other=0.0)
    elif CHECK_M:
        b = tl.load(ptrs, mask=(offs_m < seqlen_q)[:, None], other=0.0)
    elif CHECK_N:
        b = tl.load(ptrs, mask=(offs_n < seqlen_k)[None, :], other=0.0)
    else:
        b = tl.load(ptrs)
    return b.to(tl.float32)


@triton.jit
def _bad_pages(bt_row, len_q, len_k, page_size, n_pages, window_left, window_right,
               BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Whether a page some query tile of the sequence visits (``_fwd_tiles``, PAGED) lies outside
    [0, n_pages), i.e. is clamped there: the pages of the key tiles every row together may see."""
    lo, _full_lo, _full_hi, hi = kv_block_range(
        0, len_q, len_q, len_k, window_left, window_right, BLOCK_N=BLOCK_N, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT
    )
    p_lo = lo // page_size
    p_hi = tl.where(len_q > 0, tl.cdiv(hi, page_size), p_lo)
    n_bad = 0
    for p0 in range(p_lo, p_hi, _PAGE_CHUNK):
        offs = p0 + tl.arange(0, _PAGE_CHUNK)
        page = tl.load(bt_row + offs, mask=offs < p_hi, other=0)
        n_bad += tl.sum(((page < 0) | (page >= n_pages)).to(tl.int32), 0)
    return n_bad > 0


@triton.jit
def _varlen_errors(CuSeqQ, CuSeqK, bt_row, off_b, n_batch, len_q, len_k, seqlen_q, seqlen_k, total_q, total_k,
                   page_size, n_pages, window_left, window_right,
                   BLOCK_N: tl.constexpr, PAGED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Error-word bits of batch element ``off_b``: ERR_CU_SEQLENS when its q or k range breaks the packed
    contract (:func:`seqlen_errors`), with PAGED ERR_VARLEN_BLOCK_TABLE when a page it visits is outside the pool."""
    q_bad, k_bad = seqlen_errors(
        CuSeqQ, CuSeqK, off_b, n_batch, seqlen_q, seqlen_k, total_q, total_k, K_ENDS_AT_TOTAL=not PAGED
    )
    bits = tl.where(q_bad | k_bad, _ERR_CU_SEQLENS, 0)
    if PAGED:
        pages_bad = _bad_pages(bt_row, len_q, len_k, page_size, n_pages, window_left, window_right,
                               BLOCK_N=BLOCK_N, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT)
        bits = bits | tl.where(pages_bad, _ERR_VARLEN_BLOCK_TABLE, 0)
    return bits


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i,  # running state: (BLOCK_M, BLOCK_D) fp32, (BLOCK_M,) fp32, (BLOCK_M,) fp32
    q,  # (BLOCK_M, BLOCK_D) query tile, input dtype
    k_base, v_base,  # K and V of this (batch, kv head): scalar pointers
    stride_kn, stride_vn,
    bt_row, page_size, n_pages, stride_kpage, stride_vpage,  # PAGED: block-table row of this sequence, pages
    bias_base,  # bias rows of this tile at key 0: (BLOCK_M, 1) pointers (unused without HAS_BIAS)
    stride_bias_n,
    offs_m, offs_d, start, end,  # visit kv tiles starting at start, start + BLOCK_N, ... < end
    clear_lo, clear_hi,  # with MASKED: tiles starting in [clear_lo, clear_hi) skip the elementwise mask
    seqlen_q, seqlen_k, head_dim,
    qk_scale, sm_scale, softcap, slope, window_left, window_right,
    dropout_p, philox_seed, philox_offset, bh, drop_nq, drop_nk,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # some tiles need the elementwise causal / window / tail mask
    PAGED: tl.constexpr,  # K/V rows of key j live in page bt_row[j // page_size] (BLOCK_N divides page_size)
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Online-softmax update over kv tiles [start, end) (FA2 Algorithm 1, lines 6-11).

    ``MASKED=False``: every tile is inside the sequence and the window of every
    row, so nothing is masked.  ``MASKED=True``: a tile is masked unless it
    starts in [clear_lo, clear_hi) (a scalar branch per tile, so one loop, one
    software pipeline, covers the band and its edges); the band never holds the
    tile crossing a ragged end of K.  K/V loads never carry a row mask.
    """
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        # tile pointers = scalar 64-bit tile base (key index * row stride can pass
        # 2^31) + small 32-bit in-tile offsets: rebuilt per tile rather than kept
        # live across the loop as 64-bit pointer tensors (registers)
        if PAGED:
            # a page index outside the pool is clamped into it: no block-table value reaches past K/V
            page = tl.load(bt_row + start_n // page_size)
            page = tl.minimum(tl.maximum(page, 0), n_pages - 1).to(tl.int64)
            r64 = (start_n % page_size).to(tl.int64)
            k_tile = k_base + page * stride_kpage + r64 * stride_kn
            v_tile = v_base + page * stride_vpage + r64 * stride_vn
        else:
            n64 = start_n.to(tl.int64)
            k_tile = k_base + n64 * stride_kn
            v_tile = v_base + n64 * stride_vn
        if MASKED and not EVEN_N:
            # the tile crossing the end of K reads its last key again in place of the missing rows (their
            # scores are masked, so they add exactly 0): no K/V load needs a row mask, interior tiles
            # (every tile of a long packed sequence but its last) load as the even fixed-length path does
            rows = tl.minimum(offs_n0, seqlen_k - 1 - start_n)
        else:
            rows = offs_n0
        k_ptrs = k_tile + (rows[None, :] * stride_kn + offs_d[:, None])
        v_ptrs = v_tile + (rows[:, None] * stride_vn + offs_d[None, :])
        if EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            d_ok = offs_d < head_dim
            k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)

        qk = mma(q, k, None, DOT_PRECISION, UPCAST_DOT)
        if HAS_SOFTCAP or HAS_ALIBI or HAS_BIAS:
            s, _ = score_mods(qk * sm_scale, offs_m, offs_n, seqlen_q, seqlen_k, softcap, slope, HAS_SOFTCAP, HAS_ALIBI)
            if HAS_BIAS:
                bias_ptrs = (bias_base + start_n.to(tl.int64) * stride_bias_n) + offs_n0[None, :] * stride_bias_n
                bias = _load_bias(bias_ptrs, offs_m, offs_n, seqlen_q, seqlen_k, not EVEN_M, MASKED and not EVEN_N)
                s = s + bias
            s = s * _LOG2E  # natural units -> base 2
            if MASKED:
                if (start_n < clear_lo) | (start_n >= clear_hi):
                    ok = allowed(offs_m, offs_n, seqlen_q, seqlen_k, window_left, window_right, not EVEN_N, HAS_LEFT, HAS_RIGHT)
                    s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            s_scale = 1.0
        else:
            # plain scores stay unscaled: rowmax(qk) * qk_scale is the scaled max
            # (qk_scale >= 0, the wrapper makes it so), and the scale rides in the
            # exp2 argument below as one fused multiply-add per element
            s = qk
            if MASKED:
                if (start_n < clear_lo) | (start_n >= clear_hi):
                    ok = allowed(offs_m, offs_n, seqlen_q, seqlen_k, window_left, window_right, not EVEN_N, HAS_LEFT, HAS_RIGHT)
                    s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            s_scale = qk_scale
        if MASKED or HAS_BIAS:
            # safe max: a row with no allowed key so far keeps m = -inf; subtracting 0
            # instead makes P = exp2(-inf) = 0 rather than exp2(nan).  Unmasked tiles
            # without a bias (which may hold -inf) have finite scores, so finite m_new.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        p = tl.math.exp2(s * s_scale - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:
            # after the row statistics: l and the LSE stay dropout-free
            keep = dropout_keep(philox_seed, philox_offset, bh, offs_m, offs_n, drop_nq, drop_nk, dropout_p)
            p = tl.where(keep, p, 0.0)
        acc = acc * alpha[:, None]
        # P is rounded to the input dtype for the second GEMM (fp16/bf16 tensor cores)
        acc = mma(p.to(v.dtype), v, acc, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_range(
    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
    bt_row, page_size, n_pages, stride_kpage, stride_vpage, bias_base, stride_bias_n,
    offs_m, offs_d, lo, hi, full_lo, full_hi,
    seqlen_q, seqlen_k, head_dim,
    qk_scale, sm_scale, softcap, slope, window_left, window_right,
    dropout_p, philox_seed, philox_offset, bh, drop_nq, drop_nk,
    BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Visit kv tiles in [lo, hi); those in the fully-allowed band [full_lo, full_hi) need no mask.

    ``lo`` is a multiple of BLOCK_N; ``full_lo``/``full_hi`` are multiples of
    BLOCK_N, clamped here into [lo, hi].  When a mask is possible (a window
    edge, the causal diagonal or a ragged last tile) the sweep is still one
    loop, and a scalar branch per tile skips the elementwise mask inside the
    band: three loops (edge, band, edge) would each be software-pipelined on
    their own, and on short rows the K/V loads of a one-tile edge loop wait
    unhidden (measured +4-22% time at N <= 2k causal on an H100).
    """
    a = tl.minimum(tl.maximum(full_lo, lo), hi)
    b = tl.maximum(tl.minimum(full_hi, hi), a)
    if HAS_LEFT or HAS_RIGHT or not EVEN_N:
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
            bt_row, page_size, n_pages, stride_kpage, stride_vpage, bias_base, stride_bias_n,
            offs_m, offs_d, lo, hi, a, b, seqlen_q, seqlen_k, head_dim,
            qk_scale, sm_scale, softcap, slope, window_left, window_right,
            dropout_p, philox_seed, philox_offset, bh, drop_nq, drop_nk,
            BLOCK_N, True, PAGED, HAS_LEFT, HAS_RIGHT, EVEN_M, EVEN_N, EVEN_D,
            HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_DROPOUT, DOT_PRECISION, UPCAST_DOT,
        )
    else:  # no mask anywhere: [a, b) = [lo, hi)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
            bt_row, page_size, n_pages, stride_kpage, stride_vpage, bias_base, stride_bias_n,
            offs_m, offs_d, a, b, a, b, seqlen_q, seqlen_k, head_dim,
            qk_scale, sm_scale, softcap, slope, window_left, window_right,
            dropout_p, philox_seed, philox_offset, bh, drop_nq, drop_nk,
            BLOCK_N, False, PAGED, HAS_LEFT, HAS_RIGHT, EVEN_M, EVEN_N, EVEN_D,
            HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_DROPOUT, DOT_PRECISION, UPCAST_DOT,
        )
    return acc, l_i, m_i


@triton.heuristics(
    {
        "EVEN_M": lambda a: a["seqlen_q"] % a["BLOCK_M"] == 0,
        "EVEN_N": lambda a: a["seqlen_k"] % a["BLOCK_N"] == 0,
    }
)
# lengths-derived ints that only feed arithmetic: no recompiles when they hit 1 or a multiple of 16; the
# per-call ones (a growing cache's key count and K/V strides) may change between launches of one binding
@triton.jit(do_not_specialize=[
    "stride_kb", "stride_kh", "stride_vb", "stride_vh", "seqlen_k", "tune_nk",
    "tune_nq", "window_left", "window_right", "total_q", "total_k",
])
def _fa2_fwd_kernel(
    Q, K, V, Out, LSE, Bias, Alibi, KVCount, KVIdx, Rng, CuSeqQ, CuSeqK, BlockTable, Err,
    sm_scale, softcap, dropout_p,
    # per-call ints (runtime/launch.py passes them with the tensors): what a decoding loop advances
    stride_kb, stride_kh, stride_vb, stride_vh, seqlen_k, tune_nk,
    # ints and constexprs: fixed for a problem signature (runtime/launch.py binds them once)
    stride_qb, stride_qh, stride_qm,
    stride_kn,
    stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    stride_alibi_b, stride_alibi_h,
    stride_cnt_b, stride_cnt_h, stride_cnt_r,
    stride_idx_b, stride_idx_h, stride_idx_r,
    n_heads_q, n_bh, kv_group, seqlen_q, head_dim,
    total_q, total_k, stride_bt_b, page_size, n_pages,
    window_left, window_right,
    mask_block_m, mask_block_n,
    tune_nq,  # autotune key buckets (Nq // 128; tune_nk: Nk // 128); unused by the body
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, IS_BLOCK_SPARSE: tl.constexpr, IS_VARLEN: tl.constexpr, PAGED: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    KV_ALIGNED: tl.constexpr,  # 16 divides the per-call K/V strides (the divisibility specialisation gave)
):
    """Grid ``fwd_grid``: fold_grid(cdiv(Nq, BLOCK_M), B * Hq); a program computes O
    and LSE for rows [m * BLOCK_M, (m + 1) * BLOCK_M) of query head h of batch b.

    The query-tile index is the fastest grid dimension, so programs running
    together share one head's K and V in L2 (making it the slowest dimension,
    to dispatch every head's heaviest causal tile first, measured 10-20% slower
    on an H200).  Within a head, tiles run last-to-first
    so the causal tiles with the most kv work start first.  Rng: the int64
    Philox [seed, offset] of dropout.

    IS_VARLEN (packed batch): q/k/v/out are (1, H, total, d) views, batch element b owns
    rows ``[cu_seqlens[b], cu_seqlens[b + 1])`` (:func:`seqlen_info`), ``seqlen_q`` /
    ``seqlen_k`` are ``max_seqlen_q`` / ``max_seqlen_k`` (the grid, and the dropout
    counters' row and column counts), LSE is (H, total_q).  PAGED: K/V are
    (pages, H, page_size, d) views (``stride_kb`` is the page stride), key j of
    batch b in page ``BlockTable[b, j // page_size]``.  Err (IS_VARLEN only): the int32 error word; the
    program of query tile 0, head 0 of each batch element ORs in :func:`_varlen_errors`' bits."""
    check_tiles(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HEAD_DIM=16)
    if KV_ALIGNED:
        stride_kb, stride_kh = multiple16(stride_kb), multiple16(stride_kh)
        stride_vb, stride_vh = multiple16(stride_vb), multiple16(stride_vh)
    tile, bh = unfold_pid()
    if bh >= n_bh:
        return
    pid_m = tl.num_programs(0) - 1 - tile
    off_h = bh % n_heads_q
    off_b = bh // n_heads_q
    off_hk = off_h // kv_group  # GQA: q head h reads kv head h // (Hq / Hk)
    q_start, len_q, k_start, len_k = seqlen_info(
        CuSeqQ, CuSeqK, off_b, seqlen_q, seqlen_k, total_q, total_k, IS_VARLEN=IS_VARLEN
    )
    start_m = pid_m * BLOCK_M
    if IS_VARLEN:
        if (pid_m == 0) & (off_h == 0):  # one reporter per batch element: rare atomics
            bits = _varlen_errors(
                CuSeqQ, CuSeqK, BlockTable + off_b.to(tl.int64) * stride_bt_b, off_b, n_bh // n_heads_q, len_q, len_k,
                seqlen_q, seqlen_k, total_q, total_k, page_size, n_pages, window_left, window_right,
                BLOCK_N=BLOCK_N, PAGED=PAGED, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT,
            )
            if bits != 0:
                tl.atomic_or(Err, bits)
        if start_m >= len_q:  # the grid covers max_seqlen_q rows; this sequence ends earlier
            return
    philox_seed, philox_offset = philox_state(Rng, HAS_DROPOUT)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m64 = offs_m.to(tl.int64)

    # batch/head (or packed-row) offsets in 64 bits so tensors beyond 2^31 elements address correctly
    q_base = seq_base(Q, off_b, off_h, q_start, stride_qb, stride_qh, stride_qm, IS_VARLEN=IS_VARLEN)
    o_base = seq_base(Out, off_b, off_h, q_start, stride_ob, stride_oh, stride_om, IS_VARLEN=IS_VARLEN)
    if PAGED:
        k_base = K + off_hk.to(tl.int64) * stride_kh
        v_base = V + off_hk.to(tl.int64) * stride_vh
        bt_row = BlockTable + off_b.to(tl.int64) * stride_bt_b
    else:
        k_base = seq_base(K, off_b, off_hk, k_start, stride_kb, stride_kh, stride_kn, IS_VARLEN=IS_VARLEN)
        v_base = seq_base(V, off_b, off_hk, k_start, stride_vb, stride_vh, stride_vn, IS_VARLEN=IS_VARLEN)
        bt_row = BlockTable

    q_ptrs = q_base + m64[:, None] * stride_qm + offs_d[None, :]
    bias_base = Bias
    if HAS_BIAS:
        bias_base = (
            Bias + off_b.to(tl.int64) * stride_bias_b + off_h.to(tl.int64) * stride_bias_h
            + m64[:, None] * stride_bias_m
        )
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + off_b.to(tl.int64) * stride_alibi_b + off_h.to(tl.int64) * stride_alibi_h).to(tl.float32)

    # Algorithm 1 line 4: load Q_i once; it stays in registers for the whole kv sweep
    if EVEN_M and EVEN_D:
        q = tl.load(q_ptrs)
    elif EVEN_D:
        q = tl.load(q_ptrs, mask=(offs_m < len_q)[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=(offs_m < len_q)[:, None] & (offs_d < head_dim)[None, :], other=0.0)

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    qk_scale = sm_scale * _LOG2E

    # kv tiles any row of this tile may see; those in [full_lo, full_hi) need no element mask
    lo, full_lo, full_hi, hi = kv_block_range(
        start_m, start_m + BLOCK_M, len_q, len_k, window_left, window_right, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )

    if IS_BLOCK_SPARSE:
        # FA1 Algorithm 5: visit only the kv blocks listed for this tile's mask row;
        # BLOCK_M divides the mask's Br, so the tile lies inside one mask row
        row = (start_m // mask_block_m).to(tl.int64)
        cnt_ptr = KVCount + off_b.to(tl.int64) * stride_cnt_b + off_h.to(tl.int64) * stride_cnt_h + row * stride_cnt_r
        idx_base = KVIdx + off_b.to(tl.int64) * stride_idx_b + off_h.to(tl.int64) * stride_idx_h + row * stride_idx_r
        n_blocks = tl.load(cnt_ptr)
        for t in range(0, n_blocks):
            c = tl.load(idx_base + t)
            b_lo = tl.maximum(c * mask_block_n, lo)
            b_hi = tl.minimum(c * mask_block_n + mask_block_n, hi)
            acc, l_i, m_i = _fwd_range(
                acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                bt_row, page_size, n_pages, stride_kb, stride_vb, bias_base, stride_bias_n,
                offs_m, offs_d, b_lo, tl.maximum(b_hi, b_lo), full_lo, full_hi,
                len_q, len_k, head_dim,
                qk_scale, sm_scale, softcap, slope, window_left, window_right,
                dropout_p, philox_seed, philox_offset, bh, seqlen_q, seqlen_k,
                BLOCK_N, PAGED, HAS_LEFT, HAS_RIGHT, EVEN_M, EVEN_N, EVEN_D,
                HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_DROPOUT, DOT_PRECISION, UPCAST_DOT,
            )
    else:
        acc, l_i, m_i = _fwd_range(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
            bt_row, page_size, n_pages, stride_kb, stride_vb, bias_base, stride_bias_n,
            offs_m, offs_d, lo, hi, full_lo, full_hi,
            len_q, len_k, head_dim,
            qk_scale, sm_scale, softcap, slope, window_left, window_right,
            dropout_p, philox_seed, philox_offset, bh, seqlen_q, seqlen_k,
            BLOCK_N, PAGED, HAS_LEFT, HAS_RIGHT, EVEN_M, EVEN_N, EVEN_D,
            HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_DROPOUT, DOT_PRECISION, UPCAST_DOT,
        )

    # Algorithm 1 lines 12-15: one deferred division, LSE, writes; empty rows (l = 0) give 0 / -inf
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * _LN2)

    o_ptrs = o_base + m64[:, None] * stride_om + offs_d[None, :]
    if IS_VARLEN:  # LSE (H, total_q), as flash-attn's varlen softmax_lse
        lse_ptrs = LSE + off_h.to(tl.int64) * total_q + q_start + offs_m
    else:
        lse_ptrs = LSE + bh.to(tl.int64) * seqlen_q + offs_m
    if EVEN_M and EVEN_D:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty))
    elif EVEN_D:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m < len_q)[:, None])
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m < len_q)[:, None] & (offs_d < head_dim)[None, :])
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=offs_m < len_q)
