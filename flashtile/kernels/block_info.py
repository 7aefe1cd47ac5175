"""Which key blocks a query tile visits, and which query blocks a key tile visits (causal / sliding window).

Bottom-right-aligned window: key j is visible to query i iff
``i + Nk - Nq - left <= j <= i + Nk - Nq + right``, a bound of -1 being unbounded
(``HAS_LEFT`` / ``HAS_RIGHT`` False).  Each helper returns ``(lo, full_lo, full_hi, hi)``:
the tiles starting at ``lo, lo + BLOCK, ...`` below ``hi`` hold every visible pair of
the caller's rows (tiles outside are never loaded), and those starting in
``[full_lo, full_hi)`` are visible for every pair and inside the sequence, so they
skip the element mask; ``lo <= full_lo <= full_hi <= hi`` (as flash-attn's
``BlockInfo.get_n_block_min_max`` / ``get_m_block_min_max``).  The forward, both
backward kernels and split-KV decoding take their ranges from here.  Divisions
only see non-negative operands (Triton's integer division truncates toward 0).

:func:`seqlen_info` gives a program its batch element's place in a packed (variable-length)
batch: the start row and the length of its q and k sequences, read from ``cu_seqlens`` and
clamped to the tensors (flash-attn's ``BlockInfo`` with ``Is_even_MN = false``);
:func:`seqlen_errors` says whether the stored values break the packed-batch contract.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_block_range(
    start_m, end_m, seqlen_q, seqlen_k, window_left, window_right,
    BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    """Key tiles of BLOCK_N keys for query rows [start_m, end_m) (``end_m`` may pass Nq: the
    band stays exact for the padding rows, the range ends at the last real row's right edge).

    ``lo`` is a multiple of BLOCK_N; ``hi <= Nk``; the full band ends at the last whole tile."""
    shift = seqlen_k - seqlen_q
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = (tl.maximum(start_m + shift - window_left, 0) // BLOCK_N) * BLOCK_N
        # clear of the left edge: the tile's first key is visible to the last row
        full_lo = tl.cdiv(tl.maximum(end_m - 1 + shift - window_left, 0), BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(tl.minimum(end_m, seqlen_q) + shift + window_right, 0), seqlen_k)
        # clear of the right edge: the tile's last key is visible to the first row
        full_hi = tl.minimum(full_hi, (tl.maximum(start_m + shift + window_right + 1, 0) // BLOCK_N) * BLOCK_N)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def q_block_range(
    start_n, end_n, seqlen_q, seqlen_k, window_left, window_right,
    BLOCK_M: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    """Query tiles of BLOCK_M rows that see keys [start_n, end_n): the mirror of
    :func:`kv_block_range` (key i sees row j iff ``j - shift - right <= i <= j - shift + left``).

    ``lo`` is a multiple of BLOCK_M; ``hi <= Nq``; the band is empty for a key tile that
    passes Nk (its tail keys need the element mask) and may hold the last, partial query
    block (its padding rows are never stored)."""
    shift = seqlen_k - seqlen_q
    lo = 0
    hi = seqlen_q
    full_lo = 0
    full_hi = seqlen_q
    if HAS_RIGHT:
        lo = (tl.maximum(start_n - shift - window_right, 0) // BLOCK_M) * BLOCK_M
        # the block's first row sees the tile's last key
        full_lo = tl.cdiv(tl.maximum(end_n - 1 - shift - window_right, 0), BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(tl.maximum(end_n - shift + window_left, 0), seqlen_q)
        # the block's last row sees the tile's first key
        full_hi = (tl.maximum(start_n - shift + window_left + 1, 0) // BLOCK_M) * BLOCK_M
    full_hi = tl.where(end_n > seqlen_k, 0, full_hi)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _raw_range(CuSeq, off_b):
    """``(cu[b], cu[b + 1])`` as stored, in int64."""
    b64 = off_b.to(tl.int64)
    start = tl.load(CuSeq + b64).to(tl.int64)
    end = tl.load(CuSeq + b64 + 1).to(tl.int64)
    return start, end


@triton.jit
def _packed_range_bad(CuSeq, off_b, last_b, total, max_len, ENDS_AT_TOTAL: tl.constexpr):
    """Whether sequence ``off_b``'s stored range breaks the packed-batch contract that
    :func:`_packed_range` otherwise clamps silently: start outside [0, total], end below start or past
    total, length above ``max_len``; and cu[0] != 0, or (ENDS_AT_TOTAL) cu[B] != total, which would leave
    rows outside every sequence."""
    start, end = _raw_range(CuSeq, off_b)
    bad = (start < 0) | (start > total) | (end < start) | (end > total) | (end - start > max_len)
    bad = bad | ((off_b == 0) & (start != 0))
    if ENDS_AT_TOTAL:
        bad = bad | ((off_b == last_b) & (end != total))
    return bad


@triton.jit
def _packed_range(CuSeq, off_b, total, max_len):
    """(start, length) of sequence ``off_b`` of a packed batch: rows [cu[b], cu[b + 1]) clamped in
    int64 to [0, total], the length capped at ``max_len`` (the host sized the grid and the 32-bit
    in-tile offsets for it), so no value of ``cu`` reaches outside the packed tensor."""
    start, end = _raw_range(CuSeq, off_b)
    start = tl.minimum(tl.maximum(start, 0), total)
    end = tl.minimum(tl.maximum(end, start), total)
    length = tl.minimum(end - start, max_len).to(tl.int32)
    return start, length


@triton.jit
def seqlen_info(CuSeqQ, CuSeqK, off_b, seqlen_q, seqlen_k, total_q, total_k, IS_VARLEN: tl.constexpr):
    """``(q_start, len_q, k_start, len_k)`` of batch element ``off_b``: with IS_VARLEN the int64 first
    row and the int32 length of its sequences in the packed q / k (``seqlen_q`` / ``seqlen_k`` being
    ``max_seqlen_q`` / ``max_seqlen_k``); otherwise ``(0, seqlen_q, 0, seqlen_k)`` and no load."""
    if IS_VARLEN:
        q_start, len_q = _packed_range(CuSeqQ, off_b, total_q, seqlen_q)
        k_start, len_k = _packed_range(CuSeqK, off_b, total_k, seqlen_k)
    else:
        q_start = 0
        len_q = seqlen_q
        k_start = 0
        len_k = seqlen_k
    return q_start, len_q, k_start, len_k


@triton.jit
def seqlen_errors(CuSeqQ, CuSeqK, off_b, n_batch, seqlen_q, seqlen_k, total_q, total_k, K_ENDS_AT_TOTAL: tl.constexpr):
    """``(q_bad, k_bad)``: whether batch element ``off_b`` of ``n_batch`` has q / k values that
    :func:`seqlen_info` (IS_VARLEN, same arguments) clamps, or that leave packed rows outside every
    sequence (``K_ENDS_AT_TOTAL`` False: k lives in pages, so cu_seqlens_k may end anywhere); two more
    loads each, for the one program that reports them."""
    q_bad = _packed_range_bad(CuSeqQ, off_b, n_batch - 1, total_q, seqlen_q, ENDS_AT_TOTAL=True)
    k_bad = _packed_range_bad(CuSeqK, off_b, n_batch - 1, total_k, seqlen_k, ENDS_AT_TOTAL=K_ENDS_AT_TOTAL)
    return q_bad, k_bad


@triton.jit
def seq_base(X, off_b, off_h, start, stride_b, stride_h, stride_m, IS_VARLEN: tl.constexpr):
    """Pointer to row 0 of (batch element, head) in a (B, H, N, d) view: batch ``off_b``, or with
    IS_VARLEN row ``start`` (int64) of the packed (1, H, total, d) view; 64-bit offsets."""
    if IS_VARLEN:
        base = X + off_h.to(tl.int64) * stride_h + start * stride_m
    else:
        base = X + off_b.to(tl.int64) * stride_b + off_h.to(tl.int64) * stride_h
    return base
