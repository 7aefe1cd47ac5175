"""FlashAttention-2 forward pass as one Triton kernel family (FA2 paper, Algorithm 1).

One program owns one query tile Q_i of ``BLOCK_M`` rows of one (batch, head)
pair.  It loads Q_i once and streams the key/value tiles K_j, V_j through SRAM
(the outer loop over query tiles of FA2 Algorithm 1, lines 3-4, is the grid).
For every visited tile it keeps, per row, in fp32 registers (Algorithm 1,
lines 8-10; units are base 2, so ``exp`` below is ``exp2``):

    S     = Q_i K_j^T * scale * log2(e)          (natural-unit scores times log2 e)
    m_new = max(m, rowmax(S))
    P     = exp2(S - m_new)
    l     = exp2(m - m_new) * l + rowsum(P)
    acc   = exp2(m - m_new) * acc + P V_j        (unnormalised output)

and after the last tile (lines 12-13) divides once, ``O_i = acc / l``, and
writes ``LSE_i = (m + log2 l) * ln 2`` (natural log).  The division is
deferred: FA1's Algorithm 1 rescales O by ``diag(l)^-1`` every iteration, FA2
keeps the numerator only, saving one (BLOCK_M x d) divide per tile.

Masking splits the kv range of a query tile into three segments:

    [lo, full_lo)        boundary tiles: left window edge   (elementwise mask)
    [full_lo, full_hi)   tiles allowed for every row        (no mask work at all)
    [full_hi, hi)        boundary tiles: causal diagonal / right window edge /
                         sequence tail                      (elementwise mask)

and kv tiles outside [lo, hi) are never loaded (the "causal masking" block
skipping of the FA2 paper's forward pass, extended to both window edges).  One
loop walks all three segments: a scalar test per tile decides whether the
elementwise mask is applied, so the K/V pipeline runs across the segment
edges instead of restarting at each.  Block-sparse attention (FA1 Algorithm 5)
runs the same walk inside every kv block listed for the query tile's mask row
by :func:`flashtile.kernels._blocksparse.kv_block_lists`.

Softcap, ALiBi and the additive bias move the scores off the single fused
``scale * log2 e`` multiply: with any of them the scores are formed in natural
units through :func:`flashtile.kernels._common.score_mods`, then multiplied by
log2 e.  Rows that see no key keep ``m = -inf``; a *safe* max (0 in its place)
keeps ``exp2(-inf - -inf)`` from ever being evaluated, so those rows end with
``l = 0``, output 0 and LSE -inf.

Dropout (FA1 Algorithm 2) multiplies P by the keep mask after the row
statistics (rowmax, rowsum) are taken, so l and the LSE are dropout-free; the ``1 / (1 - p)``
factor is applied once to the output at the end.

fp32 inputs use ``tl.dot(..., input_precision="tf32")`` on the GPU (10-bit
mantissa products, fp32 accumulation: ~3e-4 relative per product); the
interpreter multiplies in full fp32.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from flashtile.kernels._blocksparse import kv_block_lists
from flashtile.kernels._launch import launch
from flashtile.kernels._common import (
    LN2,
    LOG2E,
    SUPPORTED_DTYPES,
    TILE_ROW_STRIDE_MAX,
    allowed,
    check_kernel_tensors,
    check_rng_state,
    dropout_keep,
    fold_grid,
    interpreting,
    mma,
    philox_state,
    score_mods,
    unfold_pid,
    unit_last_stride,
    wide_rows,
)
from flashtile.reference.masks import BlockMask, normalize_window

__all__ = ["fa2_forward", "fwd_config", "fwd_grid", "SUPPORTED_DTYPES", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256


# --------------------------------------------------------------------------- #
# Triton kernel
# --------------------------------------------------------------------------- #
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)


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
def _fwd_tiles(
    acc, l_i, m_i,  # running state: (BLOCK_M, BLOCK_D) fp32, (BLOCK_M,) fp32, (BLOCK_M,) fp32
    q,  # (BLOCK_M, BLOCK_D) query tile, input dtype
    k_base, v_base,  # K and V of this (batch, kv head): scalar pointers
    stride_kn, stride_vn,
    bias_base,  # bias rows of this tile at key 0: (BLOCK_M, 1) pointers (unused without HAS_BIAS)
    stride_bias_n,
    offs_m, offs_d, start, end,  # visit kv tiles starting at start, start + BLOCK_N, ... < end
    clear_lo, clear_hi,  # with MASKED: tiles starting in [clear_lo, clear_hi) skip the elementwise mask
    seqlen_q, seqlen_k, head_dim,
    qk_scale, sm_scale, softcap, slope, window_left, window_right,
    dropout_p, philox_seed, philox_offset, bh,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # some tiles need the elementwise causal / window / tail mask
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Online-softmax update over kv tiles [start, end) (FA2 Algorithm 1, lines 6-11).

    ``MASKED=False``: every tile is inside the sequence and the window of every
    row, so loads carry no bounds check and nothing is masked.  ``MASKED=True``:
    loads are bounds-checked when Nk is ragged, and a tile is masked unless it
    starts in [clear_lo, clear_hi) (a scalar branch per tile, so one loop, one
    software pipeline, covers the band and its edges).
    """
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        # tile pointers = scalar 64-bit tile base (key index * row stride can pass
        # 2^31) + small 32-bit in-tile offsets: rebuilt per tile rather than kept
        # live across the loop as 64-bit pointer tensors (registers)
        n64 = start_n.to(tl.int64)
        k_ptrs = (k_base + n64 * stride_kn) + (offs_n0[None, :] * stride_kn + offs_d[:, None])
        v_ptrs = (v_base + n64 * stride_vn) + (offs_n0[:, None] * stride_vn + offs_d[None, :])
        if MASKED and not EVEN_N:
            kv_ok = offs_n < seqlen_k
            if EVEN_D:
                k = tl.load(k_ptrs, mask=kv_ok[None, :], other=0.0)
                v = tl.load(v_ptrs, mask=kv_ok[:, None], other=0.0)
            else:
                d_ok = offs_d < head_dim
                k = tl.load(k_ptrs, mask=kv_ok[None, :] & d_ok[:, None], other=0.0)
                v = tl.load(v_ptrs, mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        else:
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
                bias_ptrs = (bias_base + n64 * stride_bias_n) + offs_n0[None, :] * stride_bias_n
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
            keep = dropout_keep(philox_seed, philox_offset, bh, offs_m, offs_n, seqlen_q, seqlen_k, dropout_p)
            p = tl.where(keep, p, 0.0)
        acc = acc * alpha[:, None]
        # P is rounded to the input dtype for the second GEMM (fp16/bf16 tensor cores)
        acc = mma(p.to(v.dtype), v, acc, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_range(
    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, bias_base, stride_bias_n,
    offs_m, offs_d, lo, hi, full_lo, full_hi,
    seqlen_q, seqlen_k, head_dim,
    qk_scale, sm_scale, softcap, slope, window_left, window_right,
    dropout_p, philox_seed, philox_offset, bh,
    BLOCK_N: tl.constexpr,
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
    unhidden (bench/NOTES.md attempt 14: +4-22% at N <= 2k causal on an H100).
    """
    a = tl.minimum(tl.maximum(full_lo, lo), hi)
    b = tl.maximum(tl.minimum(full_hi, hi), a)
    if HAS_LEFT or HAS_RIGHT or not EVEN_N:
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, bias_base, stride_bias_n,
            offs_m, offs_d, lo, hi, a, b, seqlen_q, seqlen_k, head_dim,
            qk_scale, sm_scale, softcap, slope, window_left, window_right,
            dropout_p, philox_seed, philox_offset, bh,
            BLOCK_N, True, HAS_LEFT, HAS_RIGHT, EVEN_M, EVEN_N, EVEN_D,
            HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_DROPOUT, DOT_PRECISION, UPCAST_DOT,
        )
    else:  # no mask anywhere: [a, b) = [lo, hi)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, bias_base, stride_bias_n,
            offs_m, offs_d, a, b, a, b, seqlen_q, seqlen_k, head_dim,
            qk_scale, sm_scale, softcap, slope, window_left, window_right,
            dropout_p, philox_seed, philox_offset, bh,
            BLOCK_N, False, HAS_LEFT, HAS_RIGHT, EVEN_M, EVEN_N, EVEN_D,
            HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_DROPOUT, DOT_PRECISION, UPCAST_DOT,
        )
    return acc, l_i, m_i


@triton.heuristics(
    {
        "EVEN_M": lambda a: a["seqlen_q"] % a["BLOCK_M"] == 0,
        "EVEN_N": lambda a: a["seqlen_k"] % a["BLOCK_N"] == 0,
    }
)
# lengths-derived ints that only feed arithmetic: no recompiles when they hit 1 or a multiple of 16
@triton.jit(do_not_specialize=["tune_nq", "tune_nk", "window_left", "window_right"])
def _fa2_fwd_kernel(
    Q, K, V, Out, LSE, Bias, Alibi, KVCount, KVIdx, Rng,
    sm_scale, softcap, dropout_p,
    # ints and constexprs: fixed for a problem signature (kernels/_launch.py binds them once)
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    stride_alibi_b, stride_alibi_h,
    stride_cnt_b, stride_cnt_h, stride_cnt_r,
    stride_idx_b, stride_idx_h, stride_idx_r,
    n_heads, n_bh, kv_group, seqlen_q, seqlen_k, head_dim,
    window_left, window_right,
    mask_block_m, mask_block_n,
    tune_nq, tune_nk,  # autotune key buckets (Nq // 128, Nk // 128); unused by the body
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, IS_BLOCK_SPARSE: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Grid ``fwd_grid``: fold_grid(cdiv(Nq, BLOCK_M), B * Hq); a program computes O
    and LSE for rows [m * BLOCK_M, (m + 1) * BLOCK_M) of query head h of batch b.

    The query-tile index is the fastest grid dimension, so programs running
    together share one head's K and V in L2 (making it the slowest dimension,
    to dispatch every head's heaviest causal tile first, cost 10-20% on an
    H200: bench/NOTES.md, attempt 4).  Within a head, tiles run last-to-first
    so the causal tiles with the most kv work start first.  Rng: the int64
    Philox [seed, offset] of dropout."""
    tile, bh = unfold_pid()
    if bh >= n_bh:
        return
    pid_m = tl.num_programs(0) - 1 - tile
    off_h = bh % n_heads
    off_b = bh // n_heads
    off_hk = off_h // kv_group  # GQA: q head h reads kv head h // (Hq / Hk)
    philox_seed, philox_offset = philox_state(Rng, HAS_DROPOUT)

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m64 = offs_m.to(tl.int64)

    # batch/head offsets in 64 bits so tensors beyond 2^31 elements address correctly
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hk.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hk.to(tl.int64) * stride_vh
    o_base = Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh

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
        q = tl.load(q_ptrs, mask=(offs_m < seqlen_q)[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=(offs_m < seqlen_q)[:, None] & (offs_d < head_dim)[None, :], other=0.0)

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    qk_scale = sm_scale * _LOG2E

    # kv range reachable by any row of this tile (key j allowed for row i iff
    # i + shift - left <= j <= i + shift + right, shift = Nk - Nq); tiles outside
    # it are fully masked and never loaded
    shift = seqlen_k - seqlen_q
    last_m = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = (tl.maximum(start_m + shift - window_left, 0) // BLOCK_N) * BLOCK_N
        # a tile is clear of the left edge when its first key is allowed for the tile's last row
        full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + shift - window_left, 0), BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(last_m + shift + window_right + 1, 0), seqlen_k)
        # ... and clear of the right edge when its last key is allowed for the tile's first row
        full_hi = tl.minimum(full_hi, (tl.maximum(start_m + shift + window_right + 1, 0) // BLOCK_N) * BLOCK_N)

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
                acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, bias_base, stride_bias_n,
                offs_m, offs_d, b_lo, tl.maximum(b_hi, b_lo), full_lo, full_hi,
                seqlen_q, seqlen_k, head_dim,
                qk_scale, sm_scale, softcap, slope, window_left, window_right,
                dropout_p, philox_seed, philox_offset, bh,
                BLOCK_N, HAS_LEFT, HAS_RIGHT, EVEN_M, EVEN_N, EVEN_D,
                HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_DROPOUT, DOT_PRECISION, UPCAST_DOT,
            )
    else:
        acc, l_i, m_i = _fwd_range(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, bias_base, stride_bias_n,
            offs_m, offs_d, lo, hi, full_lo, full_hi,
            seqlen_q, seqlen_k, head_dim,
            qk_scale, sm_scale, softcap, slope, window_left, window_right,
            dropout_p, philox_seed, philox_offset, bh,
            BLOCK_N, HAS_LEFT, HAS_RIGHT, EVEN_M, EVEN_N, EVEN_D,
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
    lse_ptrs = LSE + bh.to(tl.int64) * seqlen_q + offs_m
    if EVEN_M and EVEN_D:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty))
    elif EVEN_D:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m < seqlen_q)[:, None])
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m < seqlen_q)[:, None] & (offs_d < head_dim)[None, :])
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)


# --------------------------------------------------------------------------- #
# Tile configuration
# --------------------------------------------------------------------------- #
def fwd_config(
    d: int,
    dtype: torch.dtype,
    causal: bool,
    nq: int,
    nk: int,
    device: torch.device | str,
    *,
    heavy: bool = False,
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for head dim ``d``.

    The one place tiles are chosen (tests monkeypatch it to force other tilings).
    Interpreter: 16 x 32 tiles, so small test shapes still span several tiles
    and tails.  GPU: Hopper starting points, to be tuned on an H100.  Budgets:
    shared memory ``(num_stages - 1) * 2 * BLOCK_N * d * bytes`` (K and V) plus the
    Q tile must stay under 227 KB; the fp32 accumulator and score tile,
    ``BLOCK_M * (d + BLOCK_N)`` floats, are spread over ``32 * num_warps``
    threads of at most 255 registers.  ``heavy`` (dropout or an additive bias:
    the Philox state and the bias tile are extra live registers) doubles the
    warps, or halves BLOCK_N for d = 128, which ptxas -v on sm_90a showed to
    remove the spills.  ``causal`` is part of the key for tuning; the
    starting table does not use it yet.
    """
    if interpreting(device):
        return 16, 32, 4, 1
    wide = dtype == torch.float32  # 4-byte tiles: halve BLOCK_N to keep the shared-memory footprint
    # Measured on an H200, bf16 (bench/results/tune_fa2_fwd_H200_2026-11-23_run{1,2}.json): 128x64 with
    # 8 warps wins at d = 64 for every N; at d = 128, 128x64 / 8 warps without a mask, 128x128 / 8 warps
    # under a causal or window mask from N = 4k (fewer diagonal tiles), and 64x64 / 4 warps causal at N <= 1k.
    if d <= 64:
        block_m, block_n, warps, stages = 128, 64 if not wide else 32, 8, 3
    elif d <= 128:
        if causal and nk <= 1024 and not wide:
            block_m, block_n, warps, stages = 64, 64, 4, 3
        else:
            block_m, block_n, warps, stages = 128, 128 if causal and not (wide or heavy) else 64, 8, 3
    else:
        block_m, block_n, warps, stages = 64, 64 if not wide else 32, 8, 2
    if nq <= 64:  # decoding-like: a 128-row tile would be mostly padding
        block_m = 64
    return block_m, block_n, warps, stages


SMEM_BUDGET = 200 * 1024  # bytes of shared memory for the Q tile and the K/V pipeline (H100: 227 KB)
REG_BUDGET = 160  # fp32 registers per thread for the accumulator and the score tile (of 255)


def _autotune_configs() -> list[triton.Config]:
    """Search space of the FLASHTILE_AUTOTUNE=1 path, around :func:`fwd_config`'s table."""
    space = [
        (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 4, 4),
        (64, 64, 4, 3), (64, 64, 8, 2), (64, 128, 4, 2), (64, 32, 4, 2),
    ]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in space]


def _fits(block_m: int, block_n: int, num_warps: int, num_stages: int, block_d: int, esize: int) -> bool:
    """Shared memory: Q tile + ``num_stages - 1`` K/V tile pairs (Triton's pipeliner
    keeps num_stages - 1 loads in flight: 128x128 tiles at d = 128 with 3 stages,
    160 KB by this count, compile and run on Hopper's 227 KB, 224 KB would not);
    registers: the fp32 accumulator (BLOCK_M x d) and scores (BLOCK_M x BLOCK_N) per thread."""
    smem = (block_m + max(1, num_stages - 1) * 2 * block_n) * block_d * esize
    regs = block_m * (block_d + block_n) / (32 * num_warps)
    return smem <= SMEM_BUDGET and regs <= REG_BUDGET


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop the configs that cannot fit the head dim (``early_config_prune`` hook)."""
    block_d = kwargs["BLOCK_D"]
    esize = named_args["Q"].element_size()
    keep = [c for c in configs if _fits(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, block_d, esize)]
    return keep or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


@functools.cache
def _autotuned_kernel():
    # keyed on d, causal / window, Nq // 128, Nk // 128 and the register-heavy
    # features; the autotuner appends the tensor dtypes itself
    return triton.autotune(
        configs=_autotune_configs(),
        key=["head_dim", "HAS_LEFT", "HAS_RIGHT", "HAS_DROPOUT", "HAS_BIAS", "tune_nq", "tune_nk"],
        prune_configs_by={"early_config_prune": _prune},
    )(_fa2_fwd_kernel)


# --------------------------------------------------------------------------- #
# Python wrapper
# --------------------------------------------------------------------------- #
def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check_kernel_tensors(("q", "k", "v"), (q, k, v))
    b, hq, _, d = q.shape
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {d}")
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch of k {k.shape[0]} and v {v.shape[0]} must equal batch of q {b}")
    if k.shape[3] != d or v.shape[3] != d:
        raise ValueError(f"head_dim of k {k.shape[3]} and v {v.shape[3]} must equal head_dim of q {d}")
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} must equal v shape {tuple(v.shape)}")
    hk = k.shape[1]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"number of q heads ({hq}) must be a multiple of k/v heads ({hk}) (GQA/MQA)")


def _check_alibi(alibi: torch.Tensor, b: int, hq: int, device: torch.device) -> tuple[torch.Tensor, int, int]:
    if not isinstance(alibi, torch.Tensor) or not alibi.is_floating_point():
        raise TypeError("alibi_slopes must be a floating-point torch.Tensor of shape (Hq,) or (B, Hq)")
    if alibi.shape == (hq,):
        alibi = alibi.to(device=device, dtype=torch.float32)
        return alibi, 0, alibi.stride(0)
    if alibi.shape == (b, hq):
        alibi = alibi.to(device=device, dtype=torch.float32)
        return alibi, alibi.stride(0), alibi.stride(1)
    raise ValueError(f"alibi_slopes must have shape (Hq,) = ({hq},) or (B, Hq) = ({b}, {hq}), got {tuple(alibi.shape)}")


def _check_bias(bias: torch.Tensor, shape: tuple[int, int, int, int], device: torch.device) -> torch.Tensor:
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        raise TypeError(
            "bias must be a floating-point torch.Tensor (additive, -inf masks) broadcastable to "
            f"(B, Hq, Nq, Nk) = {shape}; convert a boolean mask with torch.where(mask, 0.0, -inf)"
        )
    if bias.device != device:
        raise ValueError(f"bias must be on the device of q ({device}), got {bias.device}")
    try:
        return bias.expand(shape)  # stride 0 on broadcast dims: nothing is materialised
    except RuntimeError:
        raise ValueError(f"bias of shape {tuple(bias.shape)} is not broadcastable to (B, Hq, Nq, Nk) = {shape}") from None


def _check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"out must have shape {shape}, dtype {dtype} and device {device}; "
            f"got {tuple(out.shape)}, {out.dtype}, {out.device}"
        )


def _check_scalars(softmax_scale: float, softcap: float, dropout_p: float) -> tuple[float, float, float]:
    softmax_scale, softcap, dropout_p = float(softmax_scale), float(softcap), float(dropout_p)
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite float, got {softmax_scale}")
    if not (softcap >= 0.0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return softmax_scale, softcap, dropout_p


def _check_block_mask(block_mask: BlockMask, nq: int, nk: int) -> None:
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a flashtile.reference.masks.BlockMask, got {type(block_mask).__name__}")
    br, bc = block_mask.block_size
    if br % 16 or bc % 16:
        raise ValueError(f"block_mask.block_size must be multiples of 16 for the kernels, got {(br, bc)}")
    block_mask.check_seqlens(nq, nk)


def _sparse_args(block_mask: BlockMask | None, b: int, hq: int, nq: int, nk: int, device, dummy: torch.Tensor):
    """Per-q-block kv block lists and their strides (stride 0 on a broadcast
    batch / head dim of the mask), plus the mask's (Br, Bc)."""
    if block_mask is None:
        return dummy, dummy, [0, 0, 0], [0, 0, 0], (1, 1)
    lists = kv_block_lists(block_mask, b, hq, nq, nk, device)
    counts, idx = lists.counts, lists.indices

    def strides(t: torch.Tensor) -> list[int]:
        return [st if n > 1 else 0 for st, n in zip(t.stride()[:2], t.shape[:2])] + [t.stride(2)]

    return counts, idx, strides(counts), strides(idx), lists.block_size


def _lowbit(x: int) -> int:
    """Largest power of two dividing x."""
    return x & -x


def _tiles(d: int, dtype: torch.dtype, right: int, nq: int, nk: int, device, heavy: bool, block_mask):
    """:func:`fwd_config`, with the tiles shrunk to divide a block mask's (Br, Bc)
    (both multiples of 16, so the tiles stay >= 16)."""
    block_m, block_n, num_warps, num_stages = fwd_config(d, dtype, right >= 0, nq, nk, device, heavy=heavy)
    if block_mask is not None:
        br, bc = block_mask.block_size
        block_m, block_n = min(block_m, _lowbit(br)), min(block_n, _lowbit(bc))
    return block_m, block_n, num_warps, num_stages


def fwd_grid(b: int, hq: int, nq: int, block_m: int) -> tuple[int, int, int]:
    """Launch grid of the forward kernel: query tiles fastest, the B * Hq pairs folded in by
    :func:`_common.fold_grid` (any batch and head count within CUDA's grid limits)."""
    return fold_grid(triton.cdiv(nq, block_m), b * hq)


def fa2_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    philox_seed: int = 0,
    philox_offset: int = 0,
    rng_state: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 forward: returns ``(out, lse)``.

    q: (B, Hq, Nq, d); k, v: (B, Hk, Nk, d), any strides with unit stride on d
    (others are copied), one dtype among fp16 / bf16 / fp32, Hq a multiple of Hk,
    1 <= d <= 256.  ``out`` (B, Hq, Nq, d) is in q's dtype (written into the
    given view when passed); ``lse`` (B, Hq, Nq) float32 is the natural-log
    sum-exp of the modified, masked scores, -inf on rows that see no key (whose
    output is 0).  Semantics of every option: :mod:`flashtile.reference.masks`.
    Dropout's Philox state: ``rng_state``, an int64 tensor [seed, offset] on q's
    device (read by the kernel: CUDA-graph safe), or the ints ``philox_seed`` /
    ``philox_offset``.
    """
    _check_inputs(q, k, v)
    left, right = normalize_window(causal, window_size)
    softmax_scale, softcap, dropout_p = _check_scalars(softmax_scale, softcap, dropout_p)
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    device = q.device
    shape = (b, hq, nq, d)
    if out is not None:
        _check_out(out, shape, q.dtype, device)
    if block_mask is not None:
        _check_block_mask(block_mask, nq, nk)
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=device)
    alibi, s_ab, s_ah = _check_alibi(alibi_slopes, b, hq, device) if alibi_slopes is not None else (lse, 0, 0)
    bias_t = _check_bias(bias, (b, hq, nq, nk), device) if bias is not None else lse
    bias_strides = bias_t.stride() if bias is not None else (0, 0, 0, 0)

    # the kernel writes through unit-stride-d views only; otherwise via a temporary
    target = out if out is not None and out.stride(-1) == 1 else torch.empty(shape, dtype=q.dtype, device=device)
    result = out if out is not None else target
    if b * hq * nq == 0:
        return result, lse
    if nk == 0:  # no keys: every row is empty (and a zero-size K has no pointer to launch with)
        result.zero_()
        lse.fill_(float("-inf"))
        return result, lse
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    if wide_rows(k, v):  # 32-bit in-tile offsets of the K/V tiles (q and out rows use 64-bit)
        k, v = k.contiguous(), v.contiguous()
    if bias is not None and bias_t.stride(3) >= TILE_ROW_STRIDE_MAX:  # the same for the bias's key axis
        bias_t = bias_t.contiguous()
        bias_strides = bias_t.stride()
    plain = softcap == 0 and alibi_slopes is None and bias is None
    if plain and softmax_scale <= 0:
        # the kernel's fast path takes the row max of unscaled scores and multiplies
        # it by the scale, which needs a scale > 0 (0 * -inf is NaN on masked rows):
        # (-q)·k |scale| is the same score exactly (negation is exact), and a zero
        # scale makes every score 0, as zero queries at scale 1 do
        q, softmax_scale = (-q, -softmax_scale) if softmax_scale < 0 else (torch.zeros_like(q), 1.0)

    heavy = dropout_p > 0 or bias is not None
    block_m, block_n, num_warps, num_stages = _tiles(d, q.dtype, right, nq, nk, device, heavy, block_mask)
    counts, idx, cnt_strides, idx_strides, (br, bc) = _sparse_args(block_mask, b, hq, nq, nk, device, lse)
    block_d = max(16, triton.next_power_of_2(d))
    rng = check_rng_state(rng_state, int(philox_seed), int(philox_offset), device) if dropout_p > 0 else lse
    dynamic = (q, k, v, target, lse, bias_t, alibi, counts, idx, rng, softmax_scale, softcap, dropout_p)
    ints = (
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        target.stride(0), target.stride(1), target.stride(2),
        *bias_strides, s_ab, s_ah, *cnt_strides, *idx_strides,
        hq, b * hq, hq // hk, nq, nk, d,
        left, right,
        br, bc, nq // 128, nk // 128,
    )
    flags = dict(
        BLOCK_D=block_d,
        HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0,
        HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None, HAS_BIAS=bias is not None,
        HAS_DROPOUT=dropout_p > 0, IS_BLOCK_SPARSE=block_mask is not None,
        EVEN_D=block_d == d,
        DOT_PRECISION="tf32",  # fp32 inputs on TF32 tensor cores; fp16 / bf16 ignore it
        UPCAST_DOT=q.dtype == torch.bfloat16 and interpreting(device),
    )
    if os.environ.get("FLASHTILE_AUTOTUNE") == "1" and block_mask is None and not interpreting(device):
        grid = lambda meta: fwd_grid(b, hq, nq, meta["BLOCK_M"])  # noqa: E731
        _autotuned_kernel()[grid](*dynamic, *ints, **flags)
    else:
        # EVEN_M / EVEN_N, which the kernel's ``triton.heuristics`` derives per call, are passed
        # here so the kernel can be bound once per signature (the Philox state is a tensor)
        constexprs = (
            block_m, block_n, block_d, flags["HAS_LEFT"], flags["HAS_RIGHT"], flags["HAS_SOFTCAP"],
            flags["HAS_ALIBI"], flags["HAS_BIAS"], flags["HAS_DROPOUT"], flags["IS_BLOCK_SPARSE"],
            nq % block_m == 0, nk % block_n == 0, flags["EVEN_D"], flags["DOT_PRECISION"], flags["UPCAST_DOT"],
        )
        launch(_fa2_fwd_kernel.fn, fwd_grid(b, hq, nq, block_m), dynamic, ints + constexprs,
               num_warps=num_warps, num_stages=num_stages)

    if result is not target:  # ``out`` had a non-unit stride on d
        result.copy_(target)
    return result, lse
