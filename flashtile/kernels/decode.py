"""Split-KV decoding in Triton: Flash-Decoding and FlashDecoding++, over a contiguous or paged KV cache.

Decoding runs ``Nq`` (1..a few) new query tokens against a long cache.  The
FA2 grid (FA2 paper, Algorithm 1: one program per query block and head) has
almost no parallelism then, so Flash-Decoding also splits the *keys*
(float64 twin: :func:`flashtile.reference.decoding.flash_decoding`).

Kernel 1 (``_decode_split_kernel``), grid ``(B * Hk, S, cdiv(G * Nq, BLOCK_M))``
with ``G = Hq / Hk``: program (b·Hk + h, c, m) owns kv head h of batch element
b, split c of its visible key range, and a tile of ``BLOCK_M`` *packed rows*.
Row r of the packing is query token ``t = r mod Nq`` of q head ``h G + r div Nq``:
all the q heads of one GQA group and all the query tokens share one tile, so
each K/V tile is loaded once per group and multiplied as one "flat GEMM"
(FlashDecoding++, Hong et al. 2023, Section 4: decoding's GEMMs have few
rows, padded to the 16-row MMA minimum instead of 64 or 128).

The split covers a contiguous, ``BLOCK_N``-aligned chunk of the keys
``[kv_lo, kv_hi)`` that any row of the batch element may see (causal and
window bounds are applied first, so a sliding window over a long cache is
split, not the cache): with ``T = cdiv(kv_hi - kv_lo, BLOCK_N)`` tiles, split
c gets tiles ``[c ceil(T/S), (c+1) ceil(T/S))`` (empty when c ceil(T/S) >= T;
flash-attn's ``num_n_blocks_per_split``).  Every split runs FA2's online
softmax in base 2 over its tiles (Algorithm 1, lines 8-10):

    S_t   = Q K_t^T * scale * log2 e,  m' = max(m, rowmax S_t),  P = exp2(S_t - m')
    l     = exp2(m - m') l + rowsum P,  acc = exp2(m - m') acc + P V_t

and writes a *normalised* partial ``O_c = acc / l`` and ``LSE_c = (m + log2 l) ln 2``
(natural log; an empty split or fully masked row writes (0, -inf)) to fp32
workspaces of shape (B, Hq, Nq, S, d) and (B, Hq, Nq, S).  Normalised partials
are bounded by max|v|, so the workspace never overflows, and they are exactly
the inputs of :func:`flashtile.reference.decoding.merge_partials`.

The merge (FA1 Algorithm 1, lines 11-12, done once across splits), for the
packed rows of one tile:

    lse = log sum_c exp(LSE_c),    O = sum_c exp(LSE_c - lse) O_c

(all LSE_c = -inf: O = 0, lse = -inf), writing ``out`` (B, Nq, Hq, d) in the
dtype of q and ``lse`` (B, Hq, Nq) fp32.  Called eagerly, kernel 1 merges too:
each program increments its tile's arrival counter (acq_rel, after a barrier
that orders every thread's partial stores before it), and the program that
arrives last merges the tile's rows and resets the counter to zero for the
next launch (:func:`arrival_counters`).  While a CUDA graph is captured the
merge is a second kernel (``_decode_merge_kernel``, one program per packed
row, bitwise the same merge) instead (see :class:`DecodeLaunch`).  With one split kernel 1 writes the
outputs itself.

FlashDecoding++ (``unified_max = phi``, Section 3 "asynchronized softmax"):
the split's sweep takes no running max; it accumulates ``num = sum_j exp(s_j - phi) v_j``
and ``den = sum_j exp(s_j - phi)`` (fp32, P rounded to the input dtype for the
P V product as on the safe path), so no tile rescales the accumulator, and its
partial is ``(num / den, phi + log den)``.  It flags, per row, an allowed score
with ``s - phi`` above ``hi`` (bit 1: exp2 could overflow) or below ``lo``
(bit 2: the term could lose precision), and a non-finite ``num`` / ``den``
(bit 4).  The *fallback* is exact and stays on the device: a program with a
flagged row reruns its own keys on the safe path (every row of its tile), so
only the splits that left the range pay, and there is no host round trip (the
call can be captured in a CUDA graph).  The merge ORs the flags over splits
into ``flags`` (B, Hq, Nq).  ``[lo, hi]`` defaults to :func:`default_unified_range`.

Paged cache: ``k_cache`` / ``v_cache`` (num_pages, page_size, Hk, d) and
``block_table`` (B, max_pages) int32, logical page p of element b living in
physical page ``block_table[b, p]``.  ``BLOCK_N`` divides ``page_size``
(a multiple of 16) and tiles start at multiples of ``BLOCK_N``, so a tile
never straddles two pages: one scalar block-table load per tile.  Without a
block table the cache is (B, Nk_max, Hk, d).

Indices are not trusted (memory safety must not depend on a host check that
a caller's write can bypass): each program reads its length
``seqlens_k[b] + seqlen_add`` (int32 or int64, any stride) and clamps it to
``[0, capacity]`` in int64, and a block-table entry outside
``[0, num_pages)`` is an absent page (its tile is neither read nor counted).
Either ORs a bit (:data:`ERR_SEQLENS`, :data:`ERR_BLOCK_TABLE`) into the
device's error word (:func:`error_flags`), which ``flashtile.check_errors()``
reads.  The in-place append of new keys/values (:func:`_append_kernel`, one
program per (element, token, kv head)) writes nothing for an element whose
length is out of range, nor into an absent page, and reports the same bits.

Masks are the definition in :mod:`flashtile.reference.masks` with ``Nk``
replaced by the element's own length ``L_b = seqlens_k[b]``: query t sees key
j iff ``L_b - Nq + t - left <= j <= L_b - Nq + t + right``, and ALiBi uses
``|t + L_b - Nq - j|``; both come from :mod:`flashtile.kernels._common` with
the packed rows' token indices.  Every visited tile is masked elementwise
(decoding is memory-bound: the mask is free next to the K/V loads).
"""

from __future__ import annotations

import functools
import math
import threading
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flashtile.kernels._launch import KernelLauncher
from flashtile.kernels._common import (
    LN2, LOG2E, allowed, check_kernel_tensors, interpreting, mma, score_mods, unit_last_stride,
)
from flashtile.reference.decoding import default_safe_range
from flashtile.reference.masks import normalize_window

__all__ = [
    "flash_decode",
    "run_decode",
    "decode_plan",
    "decode_launch",
    "DecodeLaunch",
    "alibi_args",
    "decode_config",
    "num_splits_heuristic",
    "default_unified_range",
    "SUPPORTED_DTYPES",
    "MAX_HEAD_DIM",
    "MAX_SPLITS",
    "append_launch",
    "AppendLaunch",
    "error_flags",
    "take_errors",
    "ERR_SEQLENS",
    "ERR_BLOCK_TABLE",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_SPLITS = 128  # workspace rows per output row; also the merge tile's width bound

_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)

# flag bits of the FlashDecoding++ path (see the module docstring)
FLAG_ABOVE, FLAG_BELOW, FLAG_OVERFLOW = 1, 2, 4
_FLAG_ABOVE, _FLAG_BELOW, _FLAG_OVERFLOW = tl.constexpr(1), tl.constexpr(2), tl.constexpr(4)

# error bits of the per-device error word (:func:`error_flags`): a length outside [0, capacity], a
# used block-table entry outside [0, num_pages)
ERR_SEQLENS, ERR_BLOCK_TABLE = 1, 2
_ERR_SEQLENS, _ERR_BLOCK_TABLE = tl.constexpr(1), tl.constexpr(2)


# --------------------------------------------------------------------------- #
# Triton kernels
# --------------------------------------------------------------------------- #
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
def _checked_length(SeqlensK, off_b, stride_sl, seqlen_add, capacity):
    """``(L, bad)``: the attended length ``cache_seqlens[b] + seqlen_add`` clamped to ``[0, capacity]``
    (in int64, so no int64 length wraps into range) and whether the stored length was out of range."""
    raw = tl.load(SeqlensK + off_b.to(tl.int64) * stride_sl).to(tl.int64)
    bad = (raw < 0) | (raw > capacity - seqlen_add)
    length = tl.minimum(tl.maximum(raw + seqlen_add, 0), capacity)
    return length.to(tl.int32), bad


@triton.jit
def _tile_scores(
    q, k, offs_t, offs_n, seqlen_q, seqlen_k, qk_scale, sm_scale, softcap, slope,
    window_left, window_right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Modified scores of one tile in base-2 units, (BLOCK_M, BLOCK_N) fp32, and
    the allowed mask (sequence tail, causal / window).  ``offs_t`` are the packed
    rows' token indices, ``slope`` their ALiBi slopes as a (BLOCK_M, 1) column."""
    qk = mma(q, k, None, DOT_PRECISION, UPCAST_DOT)
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
):
    """Keys ``[start, end)`` of one split for the packed rows: ``(acc, l, m, flag, bad_page)`` in base 2.

    Safe (FA2 Algorithm 1, lines 8-10): running max ``m``, ``acc`` and ``l`` rescaled by
    ``exp2(m - m')`` whenever it grows.  ``UNIFIED`` (FlashDecoding++): ``m = phi2`` fixed,
    no max and no rescaling, and ``flag`` marks rows with an allowed score outside
    ``phi2 + [lo2, hi2]`` (bit 1 above, bit 2 below; padded rows never flag).  A tile whose
    page is absent (block-table entry outside ``[0, num_pages)``) is neither read nor
    counted, and sets ``bad_page``."""
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
        s, ok = _tile_scores(
            q, k, offs_t, offs_n, seqlen_q, seqlen_k, qk_scale, sm_scale, softcap, slope,
            window_left, window_right, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, UPCAST_DOT,
        )
        if PAGED:
            ok = ok & kv_ok[None, :]
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
def _merge_rows(
    Work, FPart, Out, Lse, Flags, off_b, off_hk, r_lo, r_hi,
    stride_ob, stride_on, stride_oh, n_heads_q, kv_group, seqlen_q, head_dim, n_splits, lse_offset,
    MERGE_M: tl.constexpr, MERGE_S: tl.constexpr, BLOCK_D: tl.constexpr, UNIFIED: tl.constexpr,
):
    """Merge the S partials of packed rows ``[r_lo, r_hi)`` into ``out`` / ``lse`` (FA1 Algorithm 1, lines 11-12):

        lse = log sum_c exp(LSE_c),    O = sum_c exp(LSE_c - lse) O_c

    (all LSE_c = -inf: O = 0, lse = -inf).  ``MERGE_M`` rows and ``MERGE_S`` splits per
    load, one (MERGE_M, MERGE_S, BLOCK_D) tile: the partials are read with wide loads in
    parallel, not one split after another (bench/NOTES.md attempt 8), and chunks of
    splits combine by the same running-max rescaling as the key tiles.  Loads bypass
    L1 (``.cg``): the partials were written by other SMs during this launch."""
    offs_d = tl.arange(0, BLOCK_D)
    for r0 in range(r_lo, r_hi, MERGE_M):
        offs_r = r0 + tl.arange(0, MERGE_M)
        r_ok = offs_r < r_hi
        offs_t = offs_r % seqlen_q
        offs_h = off_hk * kv_group + offs_r // seqlen_q
        row = (off_b * n_heads_q + offs_h) * seqlen_q + offs_t  # index into (B, Hq, Nq)
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
        o_ptrs = Out + off_b.to(tl.int64) * stride_ob + (offs_t * stride_on + offs_h * stride_oh)[:, None] + offs_d[None, :]
        tl.store(o_ptrs, (acc / tot_safe[:, None]).to(Out.dtype.element_ty), mask=r_ok[:, None] & (offs_d < head_dim)[None, :])
        tl.store(Lse + row, lse, mask=r_ok)
        if UNIFIED:
            tl.store(Flags + row, flag, mask=r_ok)


@triton.jit
def _decode_merge_kernel(
    Work, FPart, Out, Lse, Flags,
    stride_ob, stride_on, stride_oh,
    n_heads_q, n_heads_k, kv_group, seqlen_q, head_dim, n_splits, lse_offset,
    BLOCK_M: tl.constexpr, MERGE_M: tl.constexpr, MERGE_S: tl.constexpr, BLOCK_D: tl.constexpr,
    UNIFIED: tl.constexpr,
):
    """Kernel 2 (CUDA-graph capture only): program (b·Hk + h, m) merges packed rows
    ``[m BLOCK_M, (m + 1) BLOCK_M)`` of kv head h of batch element b, with the fused merge's
    code and split chunk (a graph replay gives the same bits as an eager call: GPU test)."""
    pid_bh = tl.program_id(0)
    r_lo = tl.program_id(1) * BLOCK_M
    _merge_rows(
        Work, FPart, Out, Lse, Flags, pid_bh // n_heads_k, pid_bh % n_heads_k, r_lo,
        tl.minimum(r_lo + BLOCK_M, kv_group * seqlen_q),
        stride_ob, stride_on, stride_oh, n_heads_q, kv_group, seqlen_q, head_dim, n_splits, lse_offset,
        MERGE_M, MERGE_S, BLOCK_D, UNIFIED,
    )


@triton.jit
def _decode_split_kernel(
    Q, K, V, BlockTable, SeqlensK, Alibi,
    Work,  # fp32 workspace: partial outputs (B, Hq, Nq, S, BLOCK_D), then at lse_offset partial LSEs (B, Hq, Nq, S)
    FPart,  # int8 flags per partial (FlashDecoding++ only)
    Count,  # int32 arrival counter per (batch element, kv head, row tile), FUSED only: zero on entry and exit
    Out, Lse, Flags,  # final outputs (Flags: FlashDecoding++ only)
    Err,  # int32 error bits of the device (ERR_SEQLENS, ERR_BLOCK_TABLE), ORed into
    sm_scale, softcap, phi2, lo2, hi2,  # floats; phi2/lo2/hi2: unified max and its safe range, base-2 units
    # ints (fixed for a problem signature: kernels/_launch.py binds them once)
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_bt_b, stride_sl, stride_alibi_b, stride_alibi_h,
    stride_ob, stride_on, stride_oh,
    n_heads_q, n_heads_k, kv_group, seqlen_q, head_dim, n_splits, window_left, window_right, lse_offset,
    seqlen_add, capacity, num_pages,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    UNIFIED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    EVEN_D: tl.constexpr, WRITE_OUT: tl.constexpr,
    FUSED: tl.constexpr, MERGE_M: tl.constexpr, MERGE_S: tl.constexpr,
):
    """One split of one (batch element, kv head) for ``BLOCK_M`` packed (head, token) rows;
    with ``FUSED`` the split that finishes last for those rows also merges all their splits.

    ``EVEN_D`` (head_dim == BLOCK_D) drops the head-dim mask: a mask that varies
    along the contiguous axis stops Triton from issuing 16-byte vector loads,
    and the K/V loads are the whole cost of decoding.

    Memory safety does not trust the indices: the length ``SeqlensK[b] + seqlen_add`` is
    clamped to ``[0, capacity]`` and absent pages are masked (:func:`_sweep`); either one
    ORs its bit into ``Err`` (once per (batch element, kv head) program of split 0, row tile 0)."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    off_b = pid_bh // n_heads_k
    off_hk = pid_bh % n_heads_k
    seqlen_k, bad_len = _checked_length(SeqlensK, off_b, stride_sl, seqlen_add, capacity)
    reporter = (split == 0) & (pid_m == 0)
    if bad_len & reporter:
        tl.atomic_or(Err, _ERR_SEQLENS)

    # packed rows: r -> (q head off_hk * G + r // Nq, token r % Nq)
    n_rows = kv_group * seqlen_q
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < n_rows
    offs_t = offs_r % seqlen_q
    offs_h = off_hk * kv_group + offs_r // seqlen_q
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    if EVEN_D:
        d_ok = offs_d < BLOCK_D  # all true, and known constant along d
    q_ptrs = (Q + off_b.to(tl.int64) * stride_qb) + (offs_t * stride_qn + offs_h * stride_qh)[:, None] + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    slope = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
    if HAS_ALIBI:
        sl = tl.load(Alibi + off_b * stride_alibi_b + offs_h * stride_alibi_h, mask=row_ok, other=0.0)
        slope = sl.to(tl.float32)[:, None]

    # keys any row may see: [L - Nq - left, L - 1 + right] (token 0's left edge, token Nq-1's right edge)
    kv_lo = 0
    kv_hi = seqlen_k
    if HAS_LEFT:
        kv_lo = (tl.maximum(seqlen_k - seqlen_q - window_left, 0) // BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        kv_hi = tl.minimum(tl.maximum(seqlen_k + window_right, 0), seqlen_k)
    n_tiles = tl.cdiv(tl.maximum(kv_hi - kv_lo, 0), BLOCK_N)
    per_split = tl.cdiv(n_tiles, n_splits)
    start = kv_lo + split * per_split * BLOCK_N
    end = tl.minimum(kv_lo + (split + 1) * per_split * BLOCK_N, kv_hi)

    # (batch element, kv head) base pointers; the paged batch offset comes per tile
    k_head = K + off_hk.to(tl.int64) * stride_kh
    v_head = V + off_hk.to(tl.int64) * stride_vh
    if not PAGED:
        k_head += off_b.to(tl.int64) * stride_kb
        v_head += off_b.to(tl.int64) * stride_vb
    k_tile = tl.arange(0, BLOCK_N)[None, :] * stride_kn + offs_d[:, None]  # (D, N): K^T
    v_tile = tl.arange(0, BLOCK_N)[:, None] * stride_vn + offs_d[None, :]  # (N, D)

    acc, l_i, m_i, flag, bad_page = _sweep(
        q, k_head, v_head, k_tile, v_tile, BlockTable, off_b, start, end, offs_t, row_ok, d_ok,
        seqlen_q, seqlen_k, sm_scale, softcap, slope, phi2, lo2, hi2, window_left, window_right,
        stride_bt_b, stride_kb, stride_kn, stride_vb, stride_vn, num_pages,
        BLOCK_M, BLOCK_N, BLOCK_D, PAGED, PAGE_SIZE, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
        UNIFIED, DOT_PRECISION, UPCAST_DOT,
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
            acc, l_i, m_i, _, _ = _sweep(
                q, k_head, v_head, k_tile, v_tile, BlockTable, off_b, start, end, offs_t, row_ok, d_ok,
                seqlen_q, seqlen_k, sm_scale, softcap, slope, phi2, lo2, hi2, window_left, window_right,
                stride_bt_b, stride_kb, stride_kn, stride_vb, stride_vn, num_pages,
                BLOCK_M, BLOCK_N, BLOCK_D, PAGED, PAGE_SIZE, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                False, DOT_PRECISION, UPCAST_DOT,
            )

    # normalised partial: O_c = acc / l, LSE_c = (m + log2 l) ln 2 (an empty split or masked row: 0, -inf)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o_part = acc / l_safe[:, None]
    l_part = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * _LN2)
    row = (off_b * n_heads_q + offs_h) * seqlen_q + offs_t  # index into (B, Hq, Nq)
    if WRITE_OUT:
        # a single split is already the answer (the merge of one partial is the identity)
        o_ptrs = Out + off_b.to(tl.int64) * stride_ob + (offs_t * stride_on + offs_h * stride_oh)[:, None] + offs_d[None, :]
        tl.store(o_ptrs, o_part.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(Lse + row, l_part, mask=row_ok)
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
            # instead of two: the same device time, one launch less of host time (bench/NOTES.md
            # attempt 17).
            tl.debug_barrier()
            counter = Count + pid_bh * tl.num_programs(2) + pid_m
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n_splits - 1:
                tl.store(counter, 0)
                r_lo = pid_m * BLOCK_M
                _merge_rows(
                    Work, FPart, Out, Lse, Flags, off_b, off_hk, r_lo, tl.minimum(r_lo + BLOCK_M, n_rows),
                    stride_ob, stride_on, stride_oh, n_heads_q, kv_group, seqlen_q, head_dim, n_splits, lse_offset,
                    MERGE_M, MERGE_S, BLOCK_D, UNIFIED,
                )


@triton.jit
def _append_kernel(
    K, V, KNew, VNew, BlockTable, SeqlensK, Err,
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_knb, stride_knn, stride_knh, stride_vnb, stride_vnn, stride_vnh,
    stride_bt_b, stride_sl, n_new, capacity, num_pages, head_dim,
    BLOCK_D: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    """Program (b, i, h) stores row (b, i, h) of the new keys/values at position ``SeqlensK[b] + i``
    of element b's cache (paged: through ``BlockTable``).

    Nothing trusts the indices: an element whose ``SeqlensK[b]`` lies outside
    ``[0, capacity - n_new]`` writes nothing and ORs ERR_SEQLENS into ``Err``; a row whose
    page lies outside ``[0, num_pages)`` is not written and ORs ERR_BLOCK_TABLE."""
    off_b = tl.program_id(0)
    i = tl.program_id(1)
    h = tl.program_id(2)
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
        page_ok = len_ok
        k_off = off_b.to(tl.int64) * stride_kb + pos * stride_kn
        v_off = off_b.to(tl.int64) * stride_vb + pos * stride_vn
    ok = len_ok & page_ok
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    src_k = KNew + off_b.to(tl.int64) * stride_knb + i.to(tl.int64) * stride_knn + h.to(tl.int64) * stride_knh
    src_v = VNew + off_b.to(tl.int64) * stride_vnb + i.to(tl.int64) * stride_vnn + h.to(tl.int64) * stride_vnh
    kn = tl.load(src_k + offs_d, mask=d_ok, other=0.0)
    vn = tl.load(src_v + offs_d, mask=d_ok, other=0.0)
    w_ok = offs_d < tl.where(ok, head_dim, 0)  # nothing of a rejected row is stored
    tl.store(K + k_off + h.to(tl.int64) * stride_kh + offs_d, kn, mask=w_ok)
    tl.store(V + v_off + h.to(tl.int64) * stride_vh + offs_d, vn, mask=w_ok)
    bits = tl.where(len_ok, tl.where(page_ok, 0, _ERR_BLOCK_TABLE), _ERR_SEQLENS)
    if (bits != 0) & (h == 0):
        tl.atomic_or(Err, bits)


# --------------------------------------------------------------------------- #
# configuration
# --------------------------------------------------------------------------- #
@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (8 for the interpreter), looked up once per device."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def _lowbit(x: int) -> int:
    """Largest power of two dividing x."""
    return x & -x


def decode_config(d: int, rows: int, page_size: int | None, device: torch.device | str) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for ``rows = G * Nq`` packed rows.

    BLOCK_M: the packed rows rounded up to a power of two, at least 16 (the
    MMA minimum; Hq 32 / Hk 8 decoding has 4 rows, so 16 is the flat-GEMM
    tile) and at most 64 (beyond, the row tiles become a grid dimension).
    BLOCK_N: keys per tile; K/V tiles of ``BLOCK_N * d`` elements are the only
    large loads, so 64 keys at d > 64 and 128 at d <= 64 keep 16 KB per
    operand in flight per stage with 3 stages (Hopper starting points, not yet
    tuned).  It is shrunk to divide ``page_size`` so a tile never crosses a
    page.  Interpreter: 16-key tiles so small test caches span many tiles.
    """
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    if interpreting(device):
        block_n, warps, stages = 16, 4, 1
    elif d <= 64:
        block_n, warps, stages = 128, 4, 3
    else:
        block_n, warps, stages = 64, 4, 3
    if page_size is not None:
        block_n = min(block_n, _lowbit(page_size))
    return block_m, block_n, warps, stages


def num_splits_heuristic(
    batch_kv_heads: int, row_tiles: int, max_seqlen: int, sm_count: int, block_n: int = 64, per_sm: int = 1
) -> int:
    """Number of kv splits when ``num_splits=0``.

    Without splitting the grid has ``P = batch_kv_heads * row_tiles`` programs;
    splitting aims at ``per_sm`` resident programs per SM.  Decoding is a
    streaming read.  On a contiguous cache one program per SM already keeps
    HBM busy (each has ``num_stages`` K/V tiles in flight): measured on an H100
    (bf16, Hq 32, Hk 8, d 128, 64-key tiles, CUDA-graph replays,
    ``bench/results/decode_tiles_H100_2026-11-23.json``) one per SM beat two
    by 2-3 % at every point (B=1: 16 splits, not 32, at 4k-128k; B=8: 2, not 4;
    B=64: 1, not 2).  A paged cache wants two (``per_sm=2``): each tile's
    address waits on a block-table load, and with one program per SM the paged
    path fell to 0.79-0.86x of the contiguous one at B=1 and 8 (two per SM:
    0.98-1.05x; ``bench/results/decode_NVIDIA-H100-80GB-HBM3_2026-11-23*.json``).
    So ``S = floor(per_sm * sm_count / P)``; a grid already past that many
    programs takes ``ceil(2 per_sm sm_count / P)`` (two waves' worth, 1 when
    one program per SM).  S is at least 1 and at most the
    ``T = ceil(max_seqlen / block_n)`` tiles (one tile per split, the most a
    short cache can use), then balanced: the kernel gives each split
    ``ceil(T / S)`` tiles, so ``S = ceil(T / ceil(T / S))`` is the same work
    with no empty split.  Clamped to [1, MAX_SPLITS].  ``max_seqlen`` is the
    cache's capacity, known without a device sync.
    """
    programs = max(1, batch_kv_heads * row_tiles)
    tiles = max(1, -(-max_seqlen // block_n))
    slots = per_sm * sm_count
    if programs <= slots:
        s = slots // programs
    else:
        s = -(-2 * slots // programs) if per_sm > 1 else 1
    s = max(1, min(s, tiles, MAX_SPLITS))
    return int(-(-tiles // -(-tiles // s)))


def default_unified_range(dtype: torch.dtype, max_seqlen: int) -> tuple[float, float]:
    """Safe range [lo, hi] (natural units) of ``s - phi`` on the FlashDecoding++ path.

    exp and the sums run in fp32, so the range is
    :func:`flashtile.reference.decoding.default_safe_range` of float32 for
    ``max_seqlen`` terms (lo = -84.6, hi = 85.95 - log n).  P is rounded to
    the input dtype for the P V product: bf16 has fp32's exponent range, but
    fp16 overflows above 65504, so for fp16 ``hi`` is also capped at
    ``log(65504) - log 16 = 8.3`` and ``lo`` raised to fp16's ``log(tiny) + log 16 = -6.9``
    (below it the fp16 P loses relative precision): with fp16 inputs the
    unified max must sit within a few units of every score, or rows fall back.
    """
    lo, hi = default_safe_range(torch.float32, max(1, max_seqlen))
    if dtype == torch.float16:
        lo16, hi16 = default_safe_range(torch.float16, 1)
        lo, hi = max(lo, lo16), min(hi, hi16)
    return lo, hi


# --------------------------------------------------------------------------- #
# Python wrapper
# --------------------------------------------------------------------------- #
class DecodePlan(NamedTuple):
    """Launch parameters of one problem shape: tiles, warps, stages, split count, row tiles, merge tile."""

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    n_splits: int
    row_tiles: int  # tiles of BLOCK_M packed (head, token) rows per kv head
    merge_m: int  # packed rows per load of the fused merge
    merge_s: int  # splits per load of the merge
    interpret: bool  # Triton's interpreter runs the kernels (CPU tensors or TRITON_INTERPRET=1)


# 64 registers a thread at 4 warps; Hq 32 / Hk 8 / d 128 with 16 splits merges in one load
_MERGE_TILE = 8192


@functools.lru_cache(maxsize=1024)
def decode_plan(
    b: int, nq: int, hq: int, hk: int, d: int, page_size: int | None, capacity: int, num_splits: int,
    device: torch.device,
) -> DecodePlan:
    """:func:`decode_config`, the split count and the merge tile for one shape.  Pure function
    of its integer arguments, memoised: a decoding loop asks for the same shape every step,
    and the host time of a short-cache step is the budget (bench/NOTES.md)."""
    rows = (hq // hk) * nq
    block_m, block_n, warps, stages = decode_config(d, rows, page_size, device)
    row_tiles = triton.cdiv(rows, block_m)
    if num_splits == 0:
        num_splits = num_splits_heuristic(
            b * hk, row_tiles, capacity, _sm_count(device), block_n, per_sm=1 if page_size is None else 2
        )
    block_d = max(16, triton.next_power_of_2(d))
    # the merge loads (MERGE_M, MERGE_S, BLOCK_D) fp32 partials at once: at most _MERGE_TILE elements
    merge_s = max(2, min(triton.next_power_of_2(num_splits), _MERGE_TILE // (2 * block_d)))
    merge_m = max(2, min(triton.next_power_of_2(min(rows, block_m)), _MERGE_TILE // (merge_s * block_d)))
    return DecodePlan(
        block_m, block_n, block_d, warps, stages, num_splits, row_tiles, merge_m, merge_s, interpreting(device)
    )


def _check_shapes(q, k_cache, v_cache, block_table) -> tuple[int, int, int, int, int, int]:
    """(B, Nq, Hq, Hk, d, capacity) after checking q (B, Nq, Hq, d) against the cache layout."""
    b, nq, hq, d = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache shape {tuple(k_cache.shape)} must equal v_cache shape {tuple(v_cache.shape)}")
    _, rows, hk, dk = k_cache.shape
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim of q must be in 1..{MAX_HEAD_DIM}, got {d}")
    if dk != d:
        raise ValueError(f"head_dim of k_cache/v_cache ({dk}) must equal head_dim of q ({d})")
    if hk == 0 or hq % hk:
        raise ValueError(f"heads of q ({hq}) must be a multiple of the heads of k_cache/v_cache ({hk}) (GQA/MQA)")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have unit stride on head_dim (the kernel vectorises along d)")
    if block_table is None:
        if k_cache.shape[0] != b:
            raise ValueError(f"batch of k_cache ({k_cache.shape[0]}) must equal batch of q ({b}) without a block_table")
        return b, nq, hq, hk, d, rows
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
        raise TypeError("block_table must be an int32 torch.Tensor of shape (B, max_pages)")
    if block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must have shape (B, max_pages) = ({b}, ...), got {tuple(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"block_table must be on the device of q ({q.device}), got {block_table.device}")
    if rows % 16 or rows == 0:
        raise ValueError(f"page_size (dim 1 of a paged k_cache) must be a positive multiple of 16, got {rows}")
    return b, nq, hq, hk, d, block_table.shape[1] * rows


def _check_seqlens_k(seqlens_k: torch.Tensor, b: int, device: torch.device) -> torch.Tensor:
    if not isinstance(seqlens_k, torch.Tensor) or seqlens_k.dtype not in (torch.int32, torch.int64):
        raise TypeError("seqlens_k must be an int32 (or int64) torch.Tensor of shape (B,)")
    if seqlens_k.dim() != 1:
        raise ValueError(f"seqlens_k must have shape (B,) = ({b},), got {tuple(seqlens_k.shape)}")
    if tuple(seqlens_k.shape) != (b,):
        raise ValueError(f"seqlens_k must have shape (B,) = ({b},), got {tuple(seqlens_k.shape)}")
    if seqlens_k.device != device:
        raise ValueError(f"seqlens_k must be on the device of q ({device}), got {seqlens_k.device}")
    return seqlens_k  # int32 or int64, any stride: the kernel reads and clamps it as it is


def alibi_args(alibi: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(fp32 slopes, batch stride, head stride) of validated slopes of shape (Hq,) or (B, Hq)."""
    alibi = alibi.to(torch.float32)
    return (alibi, 0, alibi.stride(0)) if alibi.dim() == 1 else (alibi, alibi.stride(0), alibi.stride(1))


def _check_alibi(alibi: torch.Tensor, b: int, hq: int, device: torch.device) -> tuple[torch.Tensor, int, int]:
    if not isinstance(alibi, torch.Tensor) or not alibi.is_floating_point():
        raise TypeError(f"alibi_slopes must be a floating-point torch.Tensor of shape ({hq},) or ({b}, {hq})")
    if tuple(alibi.shape) not in ((hq,), (b, hq)):
        raise ValueError(f"alibi_slopes must have shape (Hq,) = ({hq},) or (B, Hq) = ({b}, {hq}), got {tuple(alibi.shape)}")
    return alibi_args(alibi.to(device))


def _check_scalars(softmax_scale, softcap, num_splits, unified_max, safe_range, dtype, capacity):
    softmax_scale, softcap = float(softmax_scale), float(softcap)
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite float, got {softmax_scale}")
    if not (softcap >= 0.0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be a finite float >= 0 (0 disables it), got {softcap}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [0, {MAX_SPLITS}] (0 = heuristic), got {num_splits!r}")
    if unified_max is None:
        return softmax_scale, softcap, None
    phi = float(unified_max)
    if not math.isfinite(phi):
        raise ValueError(f"unified_max must be a finite float or None, got {unified_max!r}")
    if safe_range is None:
        lo, hi = default_unified_range(dtype, capacity)
    else:
        try:
            lo, hi = (float(x) for x in safe_range)
        except (TypeError, ValueError):
            raise ValueError(f"safe_range must be a pair (lo, hi) of finite floats, lo < hi, got {safe_range!r}") from None
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"safe_range must be a pair (lo, hi) of finite floats, lo < hi, got {safe_range!r}")
    return softmax_scale, softcap, (phi, lo, hi)


# Arrival counters of the fused merge, one buffer per (device, stream): each launch leaves its
# counters at zero (the last program of a tile resets its own), so launches that follow one another
# on a stream can share a buffer; launches on different streams may overlap and must not.
_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}
_COUNTERS_MAX = 64
# serialises every mutation of this module's device caches (reads are plain dict lookups): one
# thread per GPU is a usual serving layout
_LOCK = threading.Lock()


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """``n`` zeroed int32 counters for one fused launch on the current stream of ``device``.

    CUDA: a buffer kept per (device, stream), grown when needed, for at most
    ``_COUNTERS_MAX`` streams (the oldest is dropped; the caching allocator
    keeps a dropped buffer's memory stream-ordered).  Never used while a CUDA
    graph is captured (:meth:`DecodeLaunch.__call__` launches two kernels
    then).  CPU (Triton's interpreter): a fresh buffer per call."""
    if device.type != "cuda":
        return torch.zeros(n, dtype=torch.int32, device=device)
    index = _device_index(device)
    key = (index, torch.cuda.current_stream(index).cuda_stream)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    with _LOCK:
        buf = _COUNTERS.get(key)
        if buf is None or buf.numel() < n:
            if buf is None and len(_COUNTERS) >= _COUNTERS_MAX:
                _COUNTERS.pop(next(iter(_COUNTERS)))
            with torch.inference_mode(False):
                buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
            _COUNTERS[key] = buf
    return buf


# The error word of each device (never evicted: a captured CUDA graph keeps its address).
_ERRORS: dict[tuple[str, int | None], torch.Tensor] = {}


def _device_key(device: torch.device) -> tuple[str, int | None]:
    return (device.type, _device_index(device) if device.type == "cuda" else device.index)


def error_flags(device: torch.device) -> torch.Tensor:
    """The int32 error word (shape (1,)) of ``device`` that the decode and append kernels OR
    :data:`ERR_SEQLENS` / :data:`ERR_BLOCK_TABLE` into; created zeroed on first use."""
    key = _device_key(device)
    buf = _ERRORS.get(key)
    if buf is None:
        with _LOCK:
            buf = _ERRORS.get(key)
            if buf is None:
                # a normal tensor even under inference_mode, so check_errors can clear it anywhere
                with torch.inference_mode(False):
                    buf = _ERRORS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return buf


def take_errors() -> list[tuple[torch.device, int]]:
    """``(device, bits)`` of every device whose error word is set, clearing it (one device
    sync per device that has run a decode kernel)."""
    found = []
    for buf in list(_ERRORS.values()):
        bits = int(buf.item())
        if bits:
            with torch.inference_mode(False):
                buf.zero_()
            found.append((buf.device, bits))
    return found


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (False on CPU)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class DecodeLaunch:
    """The decode kernels for one problem signature, their static arguments bound once.

    A signature is everything but the data: the shapes, strides and dtype of q
    and the caches, the block table's row stride and page size, the ALiBi
    slopes' strides, the window, whether softcap / FlashDecoding++ are on,
    the :class:`DecodePlan`, the dtype and stride of the lengths, the tokens
    appended before the attention (``seqlen_add``, added to every length), the
    capacity and page count the kernel clamps against, and the device.  :func:`decode_launch` memoises one instance per
    signature.  Calling it allocates the fp32 workspace and launches, through
    :class:`~flashtile.kernels._launch.KernelLauncher` (Triton's argument
    binding done once per signature, bench/NOTES.md attempt 10):

    * one split: kernel 1 alone, which writes the outputs;
    * eagerly: kernel 1 with the merge fused (its arrival counters from
      :func:`arrival_counters`): one launch;
    * while a CUDA graph is captured: kernel 1, then kernel 2 (the merge) as
      a second node, because a graph replayed on any stream, or two graphs
      replayed at once, must not share counters, and zeroing fresh ones in the
      graph would cost a node as well.  In a graph the launch costs no host time.
    """

    def __init__(
        self, plan: DecodePlan, b: int, nq: int, hq: int, hk: int, d: int, dtype: torch.dtype,
        q_strides: tuple[int, ...], k_strides: tuple[int, ...], v_strides: tuple[int, ...],
        bt_stride: int | None, page_size: int | None, alibi_strides: tuple[int, int] | None,
        left: int, right: int, has_softcap: bool, unified: bool,
        sl_dtype: torch.dtype, sl_stride: int, seqlen_add: int, capacity: int, num_pages: int,
        device: torch.device,
    ) -> None:
        s = plan.n_splits
        self.err = error_flags(device)
        self.write_out = s == 1  # one split is the answer: no workspace, no merge
        self.rows = b * hq * nq * s  # partials: one per (batch element, head, token, split)
        self.lse_offset = self.rows * plan.block_d
        self.counters = b * hk * plan.row_tiles  # one per program tile (batch element, kv head, row tile)
        self.unified = unified
        so = (nq * hq * d, hq * d, d)  # the output is allocated contiguous
        shape = (hq, hk, hq // hk, nq, d, s)
        static = (
            *q_strides[:3], *k_strides[:3], *v_strides[:3],
            bt_stride or 0, sl_stride, *(alibi_strides or (0, 0)), *so,
            *shape, left, right, self.lse_offset, seqlen_add, capacity, num_pages,
            # constexprs, in the kernel's order
            plan.block_m, plan.block_n, plan.block_d, page_size is not None, page_size or 1,
            left >= 0, right >= 0, has_softcap, alibi_strides is not None,
            unified, "tf32", dtype == torch.bfloat16 and plan.interpret,
            plan.block_d == d, self.write_out,
        )
        options = dict(num_warps=plan.num_warps, num_stages=plan.num_stages)
        grid = (b * hk, s, plan.row_tiles)
        # q, caches, block table, lengths and slopes come from the caller; the workspace, counters,
        # flags and outputs are aligned allocations
        merge = (plan.merge_m, plan.merge_s)
        self.fused = KernelLauncher(_decode_split_kernel, grid, (*static, not self.write_out, *merge), options, check=range(6))
        self.split = self.merge = None
        if not self.write_out:
            self.split = KernelLauncher(_decode_split_kernel, grid, (*static, False, *merge), options, check=range(6))
            # one packed row a program, on one warp (two at 8K merge-tile elements): of 1/2/4 rows a
            # program on 1/2/4 warps, the fastest in a graph (bench/NOTES.md attempt 17)
            warps = max(1, min(4, 2 * plan.merge_s * plan.block_d // 4096))
            self.merge = KernelLauncher(
                _decode_merge_kernel, (b * hk, hq // hk * nq),
                (*so, *shape, self.lse_offset, 1, 2, plan.merge_s, plan.block_d, unified),
                dict(num_warps=warps), check=(),
            )

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens_k: torch.Tensor,
        block_table: torch.Tensor | None, alibi: torch.Tensor | None,
        out: torch.Tensor, lse: torch.Tensor, flags: torch.Tensor | None,
        scale: float, softcap: float, unified: tuple[float, float, float] | None,
    ) -> None:
        """Launch; the kernels write ``out``, ``lse`` and, with ``unified``, ``flags`` (and OR index
        errors into :func:`error_flags`).  Unused pointer slots get a tensor that is already at
        hand (never dereferenced).  ``seqlens_k``: int32 or int64 lengths before the append, of
        this signature's dtype and stride."""
        flags = lse if flags is None else flags
        if self.write_out:
            work = f_part = count = lse
        else:
            work = torch.empty(self.lse_offset + self.rows, dtype=torch.float32, device=q.device)
            f_part = torch.empty(self.rows, dtype=torch.int8, device=q.device) if self.unified else work
            graph = _capturing(q.device)
            count = work if graph else arrival_counters(q.device, self.counters)
        phi, lo, hi = unified if unified is not None else (0.0, 0.0, 0.0)
        args = (
            q, k_cache, v_cache, seqlens_k if block_table is None else block_table, seqlens_k,
            seqlens_k if alibi is None else alibi, work, f_part, count, out, lse, flags, self.err,
            scale, softcap, phi * LOG2E, lo * LOG2E, hi * LOG2E,
        )
        if self.write_out or not graph:
            self.fused(*args)
        else:
            self.split(*args)
            self.merge(work, f_part, out, lse, flags)


@functools.lru_cache(maxsize=256)  # thread-safe; keyed by device among the rest of the signature
def _decode_launch(*signature) -> DecodeLaunch:
    return DecodeLaunch(*signature)


def decode_launch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor | None,
    alibi: tuple[torch.Tensor, int, int] | None, *, left: int, right: int, softcap: float, unified: bool,
    num_splits: int, seqlens_k: torch.Tensor | None = None, seqlen_add: int = 0,
) -> tuple[DecodePlan, DecodeLaunch]:
    """The plan and the memoised :class:`DecodeLaunch` of these (validated) arguments' signature.

    ``seqlens_k`` (its dtype and stride; None: contiguous int32) and ``seqlen_add`` (the
    tokens appended before attending) are part of the signature.  The launch is keyed by
    q's device.

    With one query token a right window bound allows every key before the cache's end
    (token Nq - 1 sees keys ``j <= L - 1 + right``), so it is dropped: causal single-token
    decoding runs the unmasked kernel, as SDPA does (-2 % device time at B=1, 32k keys: 52.7 -> 51.5 us,
    bench/NOTES.md attempt 18)."""
    b, nq, hq, d = q.shape
    if nq == 1 and right >= 0:
        right = -1
    hk = k_cache.shape[2]
    paged = block_table is not None
    rows = k_cache.shape[1]
    capacity = block_table.shape[1] * rows if paged else rows
    plan = decode_plan(b, nq, hq, hk, d, rows if paged else None, capacity, num_splits, q.device)
    sl = (torch.int32, 1) if seqlens_k is None else (seqlens_k.dtype, seqlens_k.stride(0))
    launch = _decode_launch(
        plan, b, nq, hq, hk, d, q.dtype, q.stride(), k_cache.stride(), v_cache.stride(),
        block_table.stride(0) if paged else None, rows if paged else None,
        alibi[1:] if alibi is not None else None, left, right, softcap > 0, unified,
        *sl, seqlen_add, capacity, k_cache.shape[0], q.device,
    )
    return plan, launch


class AppendLaunch:
    """The append kernel (:func:`_append_kernel`) for one signature, bound once: grid (B, Nnew, Hk),
    one head row of d elements a program, for k and v together."""

    def __init__(
        self, b: int, n_new: int, hk: int, d: int, k_strides: tuple[int, ...], v_strides: tuple[int, ...],
        kn_strides: tuple[int, ...], vn_strides: tuple[int, ...], bt_stride: int | None, page_size: int | None,
        sl_stride: int, capacity: int, num_pages: int, device: torch.device,
    ) -> None:
        self.err = error_flags(device)
        static = (
            *k_strides[:3], *v_strides[:3], *kn_strides[:3], *vn_strides[:3], bt_stride or 0, sl_stride,
            n_new, capacity, num_pages, d,
            max(16, triton.next_power_of_2(d)), page_size is not None, page_size or 1,
        )
        self.launcher = KernelLauncher(_append_kernel, (b, n_new, hk), static, dict(num_warps=1), check=range(6))

    def __call__(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        seqlens_k: torch.Tensor, block_table: torch.Tensor | None,
    ) -> None:
        self.launcher(k_cache, v_cache, k, v, seqlens_k if block_table is None else block_table, seqlens_k, self.err)


@functools.lru_cache(maxsize=256)
def _append_launch(*signature) -> AppendLaunch:
    return AppendLaunch(*signature[:-3])


def append_launch(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    seqlens_k: torch.Tensor, block_table: torch.Tensor | None,
) -> AppendLaunch:
    """The memoised :class:`AppendLaunch` writing k, v (B, Nnew, Hk, d) into the caches at
    positions ``seqlens_k[b] + i`` (validated shapes; the values are not trusted)."""
    b, n_new, hk, d = k.shape
    paged = block_table is not None
    rows = k_cache.shape[1]
    return _append_launch(
        b, n_new, hk, d, k_cache.stride(), v_cache.stride(), k.stride(), v.stride(),
        block_table.stride(0) if paged else None, rows if paged else None, seqlens_k.stride(0),
        block_table.shape[1] * rows if paged else rows, k_cache.shape[0], k_cache.device,
        k_cache.dtype, seqlens_k.dtype, block_table is not None,  # dtypes: one launcher per dtype
    )


def run_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens_k: torch.Tensor,
    block_table: torch.Tensor | None,
    alibi: tuple[torch.Tensor, int, int] | None,
    *,
    scale: float,
    softcap: float,
    left: int,
    right: int,
    num_splits: int,
    unified: tuple[float, float, float] | None,
    return_flags: bool = False,
    launch: DecodeLaunch | None = None,
    seqlen_add: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The launch of :func:`flash_decode` without its argument checks: ``(out, lse, flags)``.

    For callers that validated the shapes already (``flash_attn_with_kvcache``):
    q (B, Nq, Hq, d) and the caches with unit stride on d, ``seqlens_k`` int32
    or int64 (B,) (any stride), block table with unit stride on dim 1,
    ``alibi`` from :func:`alibi_args` or None, the window already normalised,
    ``unified`` = (phi, lo, hi) or None.  Element b attends to keys
    ``[0, seqlens_k[b] + seqlen_add)``; lengths and block-table entries are not
    trusted (clamped / masked on the device, errors in :func:`error_flags`).  ``flags`` is None unless
    ``unified`` is set or ``return_flags`` asks for (zero) flags.  ``launch``:
    the :func:`decode_launch` of these arguments, when the caller kept it.
    No host synchronisation: FlashDecoding++'s fallback happens in the kernel.
    """
    b, nq, hq, d = q.shape
    dev = q.device
    if launch is None:
        launch = decode_launch(
            q, k_cache, v_cache, block_table, alibi, unified=unified is not None,
            left=left, right=right, softcap=softcap, num_splits=num_splits, seqlens_k=seqlens_k, seqlen_add=seqlen_add,
        )[1]
    out = torch.empty((b, nq, hq, d), dtype=q.dtype, device=dev)
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=dev)
    flags = None
    if unified is not None:
        flags = torch.empty((b, hq, nq), dtype=torch.int32, device=dev)  # the kernel writes every row
    elif return_flags:
        flags = torch.zeros((b, hq, nq), dtype=torch.int32, device=dev)
    if out.numel() == 0:
        return out, lse, flags
    launch(q, k_cache, v_cache, seqlens_k, block_table, alibi[0] if alibi is not None else None,
           out, lse, flags, scale, softcap, unified)
    return out, lse, flags


def flash_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    unified_max: float | None = None,
    safe_range: tuple[float, float] | None = None,
    return_recomputed: bool = False,
):
    """Split-KV decoding: returns ``(out, lse)`` (plus the recomputed-row flags if asked).

    q (B, Nq, Hq, d); caches (B, Nk_max, Hk, d), or (num_pages, page_size, Hk, d)
    with ``block_table`` (B, max_pages) int32; ``seqlens_k`` (B,) int32: element
    b attends to keys [0, seqlens_k[b]) (entries are not trusted: a length outside
    [0, capacity] is clamped and a block-table entry outside [0, num_pages) is
    masked, either setting a bit of :func:`error_flags`, which
    ``flashtile.check_errors()`` reads).  One dtype among
    fp16 / bf16 / fp32, Hq a multiple of Hk, 1 <= d <= 256.  ``out`` is
    (B, Nq, Hq, d) in q's dtype, ``lse`` (B, Hq, Nq) fp32 natural log, -inf on
    rows with no allowed key (output 0).  ``num_splits = 0`` picks
    :func:`num_splits_heuristic`; explicit values 1..128 are honoured (more
    splits than tiles leaves splits empty).  ``unified_max`` switches to
    FlashDecoding++'s asynchronous softmax with ``phi = unified_max`` and
    ``safe_range`` (natural units, default :func:`default_unified_range`);
    with ``return_recomputed`` a third value (B, Hq, Nq) int32 holds each
    row's flag bits (1 above, 2 below, 4 overflow) ORed over its splits, all
    zero on the safe path; a split with a flagged row was recomputed exactly by
    the safe path, on the device.  Forward only (no autograd).
    """
    check_kernel_tensors(("q", "k_cache", "v_cache"), (q, k_cache, v_cache))
    b, nq, hq, hk, d, capacity = _check_shapes(q, k_cache, v_cache, block_table)
    left, right = normalize_window(causal, window_size)
    seqlens_k = _check_seqlens_k(seqlens_k, b, q.device)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    scale, softcap, unified = _check_scalars(scale, softcap, num_splits, unified_max, safe_range, q.dtype, capacity)
    alibi = _check_alibi(alibi_slopes, b, hq, q.device) if alibi_slopes is not None else None
    if block_table is not None and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    out, lse, flags = run_decode(
        unit_last_stride(q), k_cache, v_cache, seqlens_k, block_table, alibi,
        scale=scale, softcap=softcap, left=left, right=right, num_splits=num_splits, unified=unified,
        return_flags=return_recomputed,
    )
    return (out, lse, flags) if return_recomputed else (out, lse)
