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

Kernel 2 (``_decode_merge_kernel``), grid ``(Nq * Hq, B)``: one program per
output row merges its S partials (FA1 Algorithm 1, lines 11-12, done once
across splits):

    lse = log sum_c exp(LSE_c),    O = sum_c exp(LSE_c - lse) O_c

(all LSE_c = -inf: O = 0, lse = -inf) and writes ``out`` (B, Nq, Hq, d) in the
dtype of q and ``lse`` (B, Hq, Nq) fp32.

FlashDecoding++ (``unified_max = phi``, Section 3 "asynchronized softmax"):
kernel 1 takes no running max; it accumulates ``num = sum_j exp(s_j - phi) v_j``
and ``den = sum_j exp(s_j - phi)`` (fp32, P rounded to the input dtype for the
P V product as on the safe path) and stores these *unnormalised* sums in the
partial slots; kernel 2 just adds them, ``O = num / den``, ``lse = phi + log den``.
Kernel 1 also flags, per row and split, an allowed score with ``s - phi``
above ``hi`` (bit 1: exp2 could overflow) or below ``lo`` (bit 2: the term
could lose precision), and kernel 2 ORs the flags over splits and adds bit 4
when the summed num/den is not finite.  The *fallback* then reruns both
kernels on the safe path for the batch elements with any flagged row (a
``BatchIdx`` list maps the grid's batch slot to the element, so only those
elements are recomputed, all of their rows, exactly).  Reading the flags
costs one device-to-host sync per call.  ``[lo, hi]`` defaults to
:func:`default_unified_range`.

Paged cache: ``k_cache`` / ``v_cache`` (num_pages, page_size, Hk, d) and
``block_table`` (B, max_pages) int32, logical page p of element b living in
physical page ``block_table[b, p]``.  ``BLOCK_N`` divides ``page_size``
(a multiple of 16) and tiles start at multiples of ``BLOCK_N``, so a tile
never straddles two pages: one scalar block-table load per tile.  Without a
block table the cache is (B, Nk_max, Hk, d).

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
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashtile.kernels._launch import KernelLauncher
from flashtile.kernels._common import (
    LN2, LOG2E, allowed, check_kernel_tensors, interpreting, mma, pdl_supported, score_mods, unit_last_stride,
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
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_SPLITS = 128  # workspace rows per output row; also the merge tile's width bound

_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)

# flag bits of the FlashDecoding++ path (see the module docstring)
FLAG_ABOVE, FLAG_BELOW, FLAG_OVERFLOW = 1, 2, 4
_FLAG_ABOVE, _FLAG_BELOW, _FLAG_OVERFLOW = tl.constexpr(1), tl.constexpr(2), tl.constexpr(4)


# --------------------------------------------------------------------------- #
# Triton kernels
# --------------------------------------------------------------------------- #
@triton.jit
def _tile_offsets(
    BlockTable, off_b, start_n, stride_bt_b, stride_kb, stride_kn, stride_vb, stride_vn,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    """64-bit element offsets of key ``start_n`` in K and in V, relative to the
    (batch element, kv head) base pointers.

    Paged: the tile lies inside logical page ``start_n // PAGE_SIZE`` (BLOCK_N
    divides PAGE_SIZE), so one scalar block-table load per tile serves both K
    and V; ``stride_kb`` is then the page stride and the base pointers carry
    only the head offset.  Contiguous: the base pointers carry the batch offset."""
    if PAGED:
        page = tl.load(BlockTable + off_b.to(tl.int64) * stride_bt_b + start_n // PAGE_SIZE).to(tl.int64)
        row = (start_n % PAGE_SIZE).to(tl.int64)
        k_off = page * stride_kb + row * stride_kn
        v_off = page * stride_vb + row * stride_vn
    else:
        k_off = start_n.to(tl.int64) * stride_kn
        v_off = start_n.to(tl.int64) * stride_vn
    return k_off, v_off


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
def _decode_split_kernel(
    Q, K, V, BlockTable, SeqlensK, BatchIdx, Alibi,
    Work,  # fp32 workspace: partial outputs (slots, Hq, Nq, S, BLOCK_D), then at lse_offset partial LSEs (slots, Hq, Nq, S)
    FPart,  # int8 flags per partial (FlashDecoding++ only)
    Out, Lse,  # final outputs, written here directly when WRITE_OUT (one split, safe path)
    sm_scale, softcap, phi2, lo2, hi2,  # floats; phi2/lo2/hi2: unified max and its safe range, base-2 units
    # ints (fixed for a problem signature: kernels/_launch.py binds them once)
    stride_qb, stride_qn, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_bt_b, stride_alibi_b, stride_alibi_h,
    stride_ob, stride_on, stride_oh,
    n_heads_q, n_heads_k, kv_group, seqlen_q, head_dim, n_splits, window_left, window_right, lse_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    UNIFIED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    EVEN_D: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, WRITE_OUT: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One split of one (batch slot, kv head) for ``BLOCK_M`` packed (head, token) rows.

    ``EVEN_D`` (head_dim == BLOCK_D) drops the head-dim mask: a mask that varies
    along the contiguous axis stops Triton from issuing 16-byte vector loads,
    and the K/V loads are the whole cost of decoding."""
    if USE_PDL:  # the merge kernel may start its programs now; they wait for this grid to finish
        gdc_launch_dependents()
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    slot = pid_bh // n_heads_k
    off_hk = pid_bh % n_heads_k
    if HAS_BATCH_IDX:
        off_b = tl.load(BatchIdx + slot)
    else:
        off_b = slot
    seqlen_k = tl.load(SeqlensK + off_b)

    # packed rows: r -> (q head off_hk * G + r // Nq, token r % Nq)
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < kv_group * seqlen_q
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

    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    flag = tl.zeros((BLOCK_M,), dtype=tl.int32)
    qk_scale = sm_scale * _LOG2E
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + offs_n0
        kv_ok = offs_n < seqlen_k
        k_off, v_off = _tile_offsets(
            BlockTable, off_b, start_n, stride_bt_b, stride_kb, stride_kn, stride_vb, stride_vn, PAGED, PAGE_SIZE
        )
        k = tl.load(k_head + k_off + k_tile, mask=kv_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_head + v_off + v_tile, mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        s, ok = _tile_scores(
            q, k, offs_t, offs_n, seqlen_q, seqlen_k, qk_scale, sm_scale, softcap, slope,
            window_left, window_right, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, UPCAST_DOT,
        )
        if UNIFIED:
            # FlashDecoding++: exp against the fixed phi, no max, no rescaling of acc
            dev = s - phi2
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

    if UNIFIED:
        o_part = acc  # numerator; the denominator goes to the LSE slot
        l_part = l_i
    else:
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        o_part = acc / l_safe[:, None]
        l_part = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * _LN2)

    if WRITE_OUT:
        # a single split is already the answer (the merge of one partial is the identity)
        o_ptrs = Out + off_b.to(tl.int64) * stride_ob + (offs_t * stride_on + offs_h * stride_oh)[:, None] + offs_d[None, :]
        tl.store(o_ptrs, o_part.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(Lse + (off_b * n_heads_q + offs_h) * seqlen_q + offs_t, l_part, mask=row_ok)
    else:
        # workspace row of (slot, head, token) is contiguous over the S splits
        prow = ((slot * n_heads_q + offs_h) * seqlen_q + offs_t).to(tl.int64) * n_splits + split
        tl.store(Work + prow[:, None] * BLOCK_D + offs_d[None, :], o_part, mask=row_ok[:, None])
        tl.store(Work + lse_offset + prow, l_part, mask=row_ok)
        if UNIFIED:
            tl.store(FPart + prow, flag.to(tl.int8), mask=row_ok)


@triton.jit
def _decode_merge_kernel(
    Work, FPart, Out, Lse, Flags, BatchIdx,
    phi,
    stride_ob, stride_on, stride_oh,
    n_heads_q, seqlen_q, head_dim, n_splits, lse_offset,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, UNIFIED: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Merge the S partials of output row (slot, q head h, token t) (FA1 Algorithm 1, lines 11-12).

    With ``USE_PDL`` it is launched as a programmatic dependent of kernel 1 (its launch
    overlaps kernel 1's last programs) and waits for kernel 1 before reading the partials."""
    if USE_PDL:
        gdc_wait()
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    off_h = pid // seqlen_q
    off_t = pid % seqlen_q
    if HAS_BATCH_IDX:
        off_b = tl.load(BatchIdx + slot)
    else:
        off_b = slot
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_splits
    prow = ((slot * n_heads_q + off_h) * seqlen_q + off_t).to(tl.int64) * n_splits
    o = tl.load(Work + (prow + offs_s)[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    if UNIFIED:
        den_parts = tl.load(Work + lse_offset + prow + offs_s, mask=s_ok, other=0.0)
        num = tl.sum(o, 0)
        den = tl.sum(den_parts, 0)
        flag = tl.max(tl.load(FPart + prow + offs_s, mask=s_ok, other=0).to(tl.int32), 0)
        # NaN compares False, so NaN as well as +-inf counts as not finite
        finite = (tl.min((tl.abs(num) < float("inf")).to(tl.int32), 0) == 1) & (den < float("inf"))
        flag = flag | tl.where(finite, 0, _FLAG_OVERFLOW)
        live = den > 0.0  # den = 0 with no below-flag: the row has no allowed key
        den_safe = tl.where(live, den, 1.0)
        out = num / den_safe
        lse = tl.where(live, phi + tl.log(den_safe), float("-inf"))
        tl.store(Flags + (off_b * n_heads_q + off_h) * seqlen_q + off_t, flag)
    else:
        lses = tl.load(Work + lse_offset + prow + offs_s, mask=s_ok, other=float("-inf"))
        m = tl.max(lses, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.math.exp2((lses - m_safe) * _LOG2E)  # -inf partials (empty, masked) weigh 0
        tot = tl.sum(w, 0)
        live = tot > 0.0
        tot_safe = tl.where(live, tot, 1.0)
        out = tl.sum(w[:, None] * o, 0) / tot_safe
        lse = tl.where(live, m_safe + tl.log(tot_safe), float("-inf"))
    o_ptrs = Out + off_b.to(tl.int64) * stride_ob + off_t * stride_on + off_h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_d < head_dim)
    tl.store(Lse + (off_b * n_heads_q + off_h) * seqlen_q + off_t, lse)


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
    """Launch parameters of one problem shape: tiles, warps, stages, split count and row tiles."""

    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int
    n_splits: int
    row_tiles: int  # tiles of BLOCK_M packed (head, token) rows per kv head
    block_s: int  # merge tile over the splits: next power of two >= n_splits, at least 2
    interpret: bool  # Triton's interpreter runs the kernels (CPU tensors or TRITON_INTERPRET=1)


@functools.lru_cache(maxsize=1024)
def decode_plan(
    b: int, nq: int, hq: int, hk: int, d: int, page_size: int | None, capacity: int, num_splits: int,
    device: torch.device,
) -> DecodePlan:
    """:func:`decode_config` and the split count for one shape.  Pure function of its
    integer arguments, memoised: a decoding loop asks for the same shape every step,
    and the host time of a short-cache step is the budget (bench/NOTES.md)."""
    rows = (hq // hk) * nq
    block_m, block_n, warps, stages = decode_config(d, rows, page_size, device)
    row_tiles = triton.cdiv(rows, block_m)
    if num_splits == 0:
        num_splits = num_splits_heuristic(
            b * hk, row_tiles, capacity, _sm_count(device), block_n, per_sm=1 if page_size is None else 2
        )
    block_d = max(16, triton.next_power_of_2(d))
    block_s = max(2, triton.next_power_of_2(num_splits))
    return DecodePlan(block_m, block_n, block_d, warps, stages, num_splits, row_tiles, block_s, interpreting(device))


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
    if tuple(seqlens_k.shape) != (b,):
        raise ValueError(f"seqlens_k must have shape (B,) = ({b},), got {tuple(seqlens_k.shape)}")
    if seqlens_k.device != device:
        raise ValueError(f"seqlens_k must be on the device of q ({device}), got {seqlens_k.device}")
    return seqlens_k.to(torch.int32).contiguous()


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


class DecodeLaunch:
    """Kernel 1 and kernel 2 for one problem signature, their static arguments bound once.

    A signature is everything but the data: the shapes, strides and dtype of q
    and the caches, the block table's row stride and page size, the ALiBi
    slopes' strides, the window, whether softcap / FlashDecoding++ / a batch
    index are on, and the :class:`DecodePlan`.  :func:`decode_launch` memoises
    one instance per signature; calling it allocates the fp32 workspace and
    launches both kernels through :class:`~flashtile.kernels._launch.KernelLauncher`
    (Triton's argument binding done once per signature, bench/NOTES.md attempt 10).
    """

    def __init__(
        self, plan: DecodePlan, b: int, nq: int, hq: int, hk: int, d: int, dtype: torch.dtype,
        q_strides: tuple[int, ...], k_strides: tuple[int, ...], v_strides: tuple[int, ...],
        bt_stride: int | None, page_size: int | None, alibi_strides: tuple[int, int] | None,
        left: int, right: int, has_softcap: bool, unified: bool, slots: int | None, pdl: bool = False,
    ) -> None:
        has_batch_idx = slots is not None  # slot i runs batch element batch_idx[i]
        slots = b if slots is None else slots
        s = plan.n_splits
        self.write_out = s == 1 and not unified
        self.rows = slots * hq * nq * s  # partials: one per (slot, head, token, split)
        self.lse_offset = self.rows * plan.block_d
        self.unified = unified
        so = (nq * hq * d, hq * d, d)  # the output is allocated contiguous
        static = (
            *q_strides[:3], *k_strides[:3], *v_strides[:3],
            bt_stride or 0, *(alibi_strides or (0, 0)), *so,
            hq, hk, hq // hk, nq, d, s, left, right, self.lse_offset,
            # constexprs, in the kernel's order
            plan.block_m, plan.block_n, plan.block_d, page_size is not None, page_size or 1,
            left >= 0, right >= 0, has_softcap, alibi_strides is not None,
            unified, "tf32", dtype == torch.bfloat16 and plan.interpret,
            plan.block_d == d, has_batch_idx, self.write_out, pdl and not self.write_out,
        )  # USE_PDL: kernel 1 lets a dependent kernel 2 start early (a no-op for a plain launch)
        options = dict(num_warps=plan.num_warps, num_stages=plan.num_stages)
        # q, caches, block table, lengths, batch index and slopes come from the caller; the workspace,
        # flags and outputs are fresh allocations (aligned)
        self.split = KernelLauncher(
            _decode_split_kernel, (slots * hk, s, plan.row_tiles), static, options, check=range(7)
        )
        self.merge = self.merge_pdl = None
        if not self.write_out:
            merge_static = (*so, hq, nq, d, s, self.lse_offset, plan.block_s, plan.block_d, unified, has_batch_idx)
            warps = dict(num_warps=4 if plan.block_d >= 128 else 2)
            grid = (nq * hq, slots)
            self.merge = KernelLauncher(_decode_merge_kernel, grid, (*merge_static, False), warps, check=(5,))
            # eagerly, kernel 2 goes as a programmatic dependent of kernel 1 (its launch hidden behind
            # kernel 1: -1 to -2 us per call on an H100); inside a CUDA graph, where launches are
            # back to back already, the plain launch measured 0.3-0.6 us faster (bench/NOTES.md attempt 15)
            self.merge_pdl = (
                KernelLauncher(_decode_merge_kernel, grid, (*merge_static, True), dict(warps, launch_pdl=True), check=(5,))
                if pdl else None
            )

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens_k: torch.Tensor,
        block_table: torch.Tensor | None, batch_idx: torch.Tensor | None, alibi: torch.Tensor | None,
        out: torch.Tensor, lse: torch.Tensor, flags: torch.Tensor | None,
        scale: float, softcap: float, unified: tuple[float, float, float] | None,
    ) -> None:
        """Launch kernel 1 over the batch slots (slot i is element ``batch_idx[i]``, or i), then
        kernel 2 unless one split on the safe path wrote ``out`` / ``lse`` itself.  Unused
        pointer slots get a tensor that is already at hand (never dereferenced)."""
        if self.write_out:
            work = f_part = lse
        else:
            work = torch.empty(self.lse_offset + self.rows, dtype=torch.float32, device=q.device)
            f_part = torch.empty(self.rows, dtype=torch.int8, device=q.device) if self.unified else work
        phi, lo, hi = unified if unified is not None else (0.0, 0.0, 0.0)
        self.split(
            q, k_cache, v_cache, seqlens_k if block_table is None else block_table, seqlens_k,
            seqlens_k if batch_idx is None else batch_idx, seqlens_k if alibi is None else alibi,
            work, f_part, out, lse,
            scale, softcap, phi * LOG2E, lo * LOG2E, hi * LOG2E,
        )
        if self.merge is not None:
            pdl = self.merge_pdl is not None and not torch.cuda.is_current_stream_capturing()
            (self.merge_pdl if pdl else self.merge)(
                work, f_part, out, lse, lse if flags is None else flags, lse if batch_idx is None else batch_idx, phi
            )


@functools.lru_cache(maxsize=256)
def _decode_launch(*signature) -> DecodeLaunch:
    return DecodeLaunch(*signature)


def decode_launch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor | None,
    alibi: tuple[torch.Tensor, int, int] | None, *, left: int, right: int, softcap: float, unified: bool,
    num_splits: int, slots: int | None = None,
) -> tuple[DecodePlan, DecodeLaunch]:
    """The plan and the memoised :class:`DecodeLaunch` of these (validated) arguments' signature."""
    b, nq, hq, d = q.shape
    hk = k_cache.shape[2]
    paged = block_table is not None
    rows = k_cache.shape[1]
    plan = decode_plan(
        b, nq, hq, hk, d, rows if paged else None, block_table.shape[1] * rows if paged else rows, num_splits, q.device
    )
    launch = _decode_launch(
        plan, b, nq, hq, hk, d, q.dtype, q.stride(), k_cache.stride(), v_cache.stride(),
        block_table.stride(0) if paged else None, rows if paged else None,
        alibi[1:] if alibi is not None else None, left, right, softcap > 0, unified, slots, pdl_supported(q.device),
    )
    return plan, launch


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The launches of :func:`flash_decode` without its argument checks: ``(out, lse, flags)``.

    For callers that validated everything already (``flash_attn_with_kvcache``):
    q (B, Nq, Hq, d) and the caches with unit stride on d, ``seqlens_k`` int32
    (B,) within the capacity, used block-table entries in range (unit stride
    on dim 1), ``alibi`` from :func:`alibi_args` or None, the window already
    normalised, ``unified`` = (phi, lo, hi) or None.  ``flags`` is None unless
    ``unified`` is set or ``return_flags`` asks for (zero) flags.  ``launch``:
    the :func:`decode_launch` of these arguments, when the caller kept it.
    """
    b, nq, hq, d = q.shape
    dev = q.device
    kw = dict(left=left, right=right, softcap=softcap, num_splits=num_splits)
    if launch is None:
        launch = decode_launch(q, k_cache, v_cache, block_table, alibi, unified=unified is not None, **kw)[1]
    out = torch.empty((b, nq, hq, d), dtype=q.dtype, device=dev)
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=dev)
    flags = None
    if unified is not None:
        flags = torch.empty((b, hq, nq), dtype=torch.int32, device=dev)  # kernel 2 writes every row
    elif return_flags:
        flags = torch.zeros((b, hq, nq), dtype=torch.int32, device=dev)
    if out.numel() == 0:
        return out, lse, flags
    slopes = alibi[0] if alibi is not None else None
    launch(q, k_cache, v_cache, seqlens_k, block_table, None, slopes, out, lse, flags, scale, softcap, unified)
    if unified is not None:
        # FlashDecoding++ fallback: batch elements with a flagged row rerun the max-based path (a host read)
        redo = (flags.view(b, -1) != 0).any(dim=1).nonzero().flatten().to(torch.int32)
        if redo.numel():
            _, safe = decode_launch(
                q, k_cache, v_cache, block_table, alibi, unified=False, slots=int(redo.numel()), **kw
            )
            safe(q, k_cache, v_cache, seqlens_k, block_table, redo, slopes, out, lse, flags, scale, softcap, None)
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
    b attends to keys [0, seqlens_k[b]) (entries are trusted: the caller
    validates them against the capacity and the block table).  One dtype among
    fp16 / bf16 / fp32, Hq a multiple of Hk, 1 <= d <= 256.  ``out`` is
    (B, Nq, Hq, d) in q's dtype, ``lse`` (B, Hq, Nq) fp32 natural log, -inf on
    rows with no allowed key (output 0).  ``num_splits = 0`` picks
    :func:`num_splits_heuristic`; explicit values 1..128 are honoured (more
    splits than tiles leaves splits empty).  ``unified_max`` switches to
    FlashDecoding++'s asynchronous softmax with ``phi = unified_max`` and
    ``safe_range`` (natural units, default :func:`default_unified_range`);
    with ``return_recomputed`` a third value (B, Hq, Nq) int32 holds each
    row's flag bits (1 above, 2 below, 4 overflow), all zero on the safe path;
    every batch element with a nonzero flag was recomputed, all of its rows,
    by the safe path.  Forward only (no autograd).
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
