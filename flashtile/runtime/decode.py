"""Host side of split-KV decoding: plans, bound launches, device buffers and the wrappers.

:func:`run_decode` launches the kernels of :mod:`flashtile.kernels.decode` for arguments the caller
has validated (:func:`flashtile.ops.kvcache.flash_attn_with_kvcache` validates once per call
signature); :func:`flash_decode` is a kernel-level convenience that goes through the same checks.
The algorithm and the untrusted-index contract are in ``docs/decoding.md``.
"""

from __future__ import annotations

import functools
import math
from contextlib import nullcontext
import threading
from typing import NamedTuple, Sequence

import torch
import triton

from flashtile.kernels._common import LOG2E
from flashtile.kernels.decode import (
    ERR_BLOCK_TABLE, ERR_SEQLENS, FLAG_ABOVE, FLAG_BELOW, FLAG_OVERFLOW,
    ERR_BATCH_IDX, ERR_CU_SEQLENS_Q,
    _append_kernel, _clear_error_bits_kernel, _decode_merge_kernel, _decode_split_kernel,
)
from flashtile.reference.decoding import default_safe_range
from flashtile.runtime.common import fold_grid, interpreting, unit_last_stride
from flashtile.runtime.launch import KernelLauncher

__all__ = [
    "flash_decode",
    "run_decode",
    "decode_plan",
    "DecodePlan",
    "decode_launch",
    "aligned16",
    "wide_tile",
    "DecodeLaunch",
    "append_launch",
    "AppendLaunch",
    "KernelArgs",
    "alibi_args",
    "decode_config",
    "num_splits_heuristic",
    "decode_splits",
    "DecodeTuning",
    "DECODE_TUNING",
    "tuning_generation",
    "set_decode_tuning",
    "default_unified_range",
    "arrival_counters",
    "error_flags",
    "take_errors",
    "MAX_SPLITS",
    "FLAG_ABOVE",
    "FLAG_BELOW",
    "FLAG_OVERFLOW",
    "ERR_SEQLENS",
    "ERR_BLOCK_TABLE",
    "ERR_BATCH_IDX",
    "ERR_CU_SEQLENS_Q",
    "KVFeatures",
    "NO_FEATURES",
    "Rotary",
]

MAX_SPLITS = 128  # workspace rows per output row; also the merge tile's width bound


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


class DecodeTuning(NamedTuple):
    """Tile and split knobs of the split kernel for one kind of cache (:data:`DECODE_TUNING`).

    ``block_n``: keys per tile at d > 64 (twice as many at d <= 64); ``per_sm`` / ``per_sm_paged``:
    resident programs per SM the split count aims at for a contiguous / paged cache; ``fill``:
    programs per SM aimed at once the unsplit grid exceeds ``per_sm`` per SM (0: ``2 per_sm`` when
    ``per_sm > 1``, else no split, :func:`num_splits_heuristic`); ``f16_mma``: an FP8 cache with bf16
    q runs both MMAs in fp16 (:func:`flashtile.kernels.decode._pow2_rows`; FP8 only, safe path only);
    ``v_smem16``: an FP8 V tile is widened in registers and staged for the MMA as 16-bit (read with
    ``ldmatrix.trans``) instead of as e4m3 (read one byte per ``LDS``); FP8 only."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    per_sm: int = 1
    per_sm_paged: int = 2
    fill: int = 0
    f16_mma: bool = False
    v_smem16: bool = False


# The defaults, by cache kind ("fp8": float8_e4m3fn caches; "default": caches of q's dtype), from the H100
# probe (bench/NOTES.md, "FP8 cache and the B64 gap"; scratch/fp8kv_probe.py swaps entries through
# set_decode_tuning): fill 4 (B64 split in two) 1.01x FA3 at 16k-32k, 0.92x unsplit; FP8 128-key tiles, fp16
# MMAs and 2 programs per SM 1.5-1.9x 64-key tiles with bf16 MMAs at >= 16k (v_smem16, 3-4 stages: slower).
DECODE_TUNING: dict[str, DecodeTuning] = {
    "default": DecodeTuning(fill=4),
    "fp8": DecodeTuning(block_n=128, per_sm=2, f16_mma=True),
}
# called after DECODE_TUNING changes, to drop what was planned under the old entries (the ops' memos register here)
_TUNING_LISTENERS: list = []
_TUNING_GENERATION = 0  # bumped by every change: part of the ops' memo keys, so no racing call keeps a stale entry


def tuning_generation() -> int:
    """How many times :func:`set_decode_tuning` has changed :data:`DECODE_TUNING` (memo keys include it)."""
    return _TUNING_GENERATION


def on_tuning_change(forget) -> None:
    """Register ``forget()`` (no arguments) to run whenever :func:`set_decode_tuning` changes the table."""
    _TUNING_LISTENERS.append(forget)


def set_decode_tuning(kind: str, tuning: DecodeTuning | None = None, **changes) -> DecodeTuning:
    """Replace ``DECODE_TUNING[kind]`` (``kind`` "default" or "fp8") by ``tuning`` or by the current entry
    with ``changes`` applied, and forget every plan and launch memoised under the old one.  Returns
    the previous entry (so a caller can restore it)."""
    if kind not in DECODE_TUNING:
        raise ValueError(f"kind must be one of {sorted(DECODE_TUNING)}, got {kind!r}")
    if tuning is not None and not isinstance(tuning, DecodeTuning):
        raise TypeError(f"tuning must be a DecodeTuning, got {type(tuning).__name__}")
    old = DECODE_TUNING[kind]
    new = (tuning if tuning is not None else old)._replace(**changes)
    for name, top in (("block_n", 256), ("num_warps", 16), ("num_stages", 6), ("per_sm", 32), ("per_sm_paged", 32)):
        value = getattr(new, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
            raise ValueError(f"{name} must be an int in [1, {top}], got {value!r}")
    if new.block_n & (new.block_n - 1) or new.block_n < 16 or new.num_warps & (new.num_warps - 1):
        raise ValueError(f"block_n (>= 16) and num_warps must be powers of two, got {new.block_n}, {new.num_warps}")
    for name in ("f16_mma", "v_smem16"):
        if not isinstance(getattr(new, name), bool):
            raise TypeError(f"{name} must be a bool, got {type(getattr(new, name)).__name__}")
    if not isinstance(new.fill, int) or isinstance(new.fill, bool) or not 0 <= new.fill <= 64:
        raise ValueError(f"fill must be an int in [0, 64], got {new.fill!r}")
    global _TUNING_GENERATION
    with _LOCK:
        DECODE_TUNING[kind] = new
        _TUNING_GENERATION += 1
        _decode_plan.cache_clear()
        _block_n.cache_clear()
        _decode_launch.cache_clear()
        for forget in _TUNING_LISTENERS:
            forget()
    return old


def decode_config(
    d: int, rows: int, page_size: int | None, device: torch.device | str, fp8: bool = False,
    tuning: DecodeTuning | None = None,
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for ``rows = G * Nq`` packed rows.

    BLOCK_M: the packed rows rounded up to a power of two, at least 16 (the
    MMA minimum; Hq 32 / Hk 8 decoding has 4 rows, so 16 is the flat-GEMM
    tile) and at most 128 (beyond, the row tiles become a grid dimension).
    65-128 rows (a GQA group of 8 with 9-16 query tokens) take one 128-row tile
    on 8 warps, so the kv head's K/V are read once, not once per 64-row tile
    (not yet timed against two 64-row tiles: ``flashtile bench decode --features``).
    BLOCK_N, warps, stages: :data:`DECODE_TUNING` of the cache kind (``fp8``); for a
    16-bit cache 64 keys at d > 64 and 128 at d <= 64 keep 16 KB per operand in
    flight per stage with 3 stages (on an H100 no tile, warp or stage count swept
    beat this by more than noise).  At most 16K elements per K or V tile (the FP8 entry's 128 keys at
    d = 256 take 64).  It is shrunk to divide ``page_size`` so a tile
    never crosses a page.  ``tuning``: the entry to use (default: the table's, read once).  Interpreter: 16-key tiles so small test caches span
    many tiles.  64- and 128-row tiles run on at least 8 warps (register spills at 4).
    """
    block_m = min(128, max(16, triton.next_power_of_2(rows)))
    if tuning is None:
        tuning = DECODE_TUNING["fp8" if fp8 else "default"]
    if interpreting(device):
        block_n, warps, stages = 16, 4, 1
    else:
        block_n, warps, stages = tuning.block_n * (2 if d <= 64 else 1), tuning.num_warps, tuning.num_stages
        block_n = max(16, min(block_n, 16384 // max(16, triton.next_power_of_2(d))))
    if block_m >= 64 and not interpreting(device):
        # 64- and 128-row tiles (many query tokens, or a cascade's shared prefix) on 8 warps: at 4, ptxas
        # (sm_90a, d = 128) spills 1.2 KB a thread for 64 rows (2 KB paged), none at 8 (0.3 KB paged)
        warps = max(warps, 8)
    if page_size is not None:
        block_n = min(block_n, _lowbit(page_size))
    return block_m, block_n, warps, stages


def num_splits_heuristic(
    batch_kv_heads: int, row_tiles: int, max_seqlen: int, sm_count: int, block_n: int = 64, per_sm: int = 1,
    fill: int = 0,
) -> int:
    """Number of kv splits when ``num_splits=0`` (measured reasons: ``docs/decoding.md``, "Tiles and split count").

    With ``P = batch_kv_heads * row_tiles`` programs unsplit, aim at ``per_sm``
    resident programs per SM: ``S = floor(per_sm * sm_count / P)``; a grid
    already past that takes ``ceil(fill sm_count / P)`` with ``fill`` programs
    per SM (``fill = 0``: ``2 per_sm`` when ``per_sm > 1``, else 1 split).
    One program per SM suits a contiguous cache (it beat two by 2-3 %
    on an H100); a paged cache wants two (``per_sm=2``: each tile's address
    waits on a block-table load).  S is then clamped to ``[1, T]`` with
    ``T = ceil(max_seqlen / block_n)`` tiles and to ``MAX_SPLITS``, and balanced
    (``S = ceil(T / ceil(T / S))``: the same work with no empty split).
    ``max_seqlen`` is the cache's capacity, known without a device sync.
    """
    programs = max(1, batch_kv_heads * row_tiles)
    tiles = max(1, -(-max_seqlen // block_n))
    slots = per_sm * sm_count
    if fill == 0 and per_sm > 1:
        fill = 2 * per_sm
    if programs <= slots:
        s = slots // programs
    else:
        s = -(-fill * sm_count // programs) if fill else 1
    s = max(1, min(s, tiles, MAX_SPLITS))
    return int(-(-tiles // -(-tiles // s)))


def decode_splits(
    batch: int, kv_heads: int, cache_len: int, kv_dtype: torch.dtype, sm_count: int, *,
    row_tiles: int = 1, paged: bool = False, block_n: int | None = None, d: int = 128,
    tuning: DecodeTuning | None = None,
) -> int:
    """The split count ``num_splits=0`` picks: :func:`num_splits_heuristic` with the knobs of
    :data:`DECODE_TUNING` for a cache of ``kv_dtype`` (``torch.float8_e4m3fn``: the "fp8" entry),
    its ``block_n`` at head dim ``d`` (or ``block_n``) and ``per_sm`` / ``per_sm_paged``.
    A pure function of its arguments and the table (or the given ``tuning`` entry)."""
    if tuning is None:
        tuning = DECODE_TUNING["fp8" if kv_dtype == torch.float8_e4m3fn else "default"]
    if block_n is None:
        block_n = tuning.block_n * (2 if d <= 64 else 1)
    per_sm = tuning.per_sm_paged if paged else tuning.per_sm
    return num_splits_heuristic(batch * kv_heads, row_tiles, cache_len, sm_count, block_n, per_sm, tuning.fill)


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
# plans, device buffers, launches
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
    f16_mma: bool = False  # an FP8 cache's MMAs in fp16 (DecodeTuning.f16_mma)
    v_smem16: bool = False  # an FP8 V tile staged as 16-bit (DecodeTuning.v_smem16)


# 64 registers a thread at 4 warps; Hq 32 / Hk 8 / d 128 with 16 splits merges in one load
_MERGE_TILE = 8192


def decode_plan(
    b: int, nq: int, hq: int, hk: int, d: int, page_size: int | None, capacity: int, num_splits: int,
    device: torch.device, fp8: bool = False,
) -> DecodePlan:
    """:func:`decode_config`, the split count and the merge tile for one shape (``fp8``: float8_e4m3fn
    caches, :data:`DECODE_TUNING`'s "fp8" entry, read once).  Pure function of its arguments and the
    entry, memoised on both: a decoding loop asks for the same shape every step, and a short-cache
    step's host time is comparable to its device time."""
    tuning = DECODE_TUNING["fp8" if fp8 else "default"]
    # the split heuristic sees the capacity only through its count of BLOCK_N-key tiles: memoised on that,
    # a cache growing by one key per call plans anew once per tile (and the launches are memoised per plan)
    tiles = -(-capacity // _block_n(d, page_size, device, fp8, tuning)) if num_splits == 0 else 0
    return _decode_plan(b, nq, hq, hk, d, page_size, tiles, num_splits, device, fp8, tuning)


@functools.lru_cache(maxsize=256)
def _block_n(d: int, page_size: int | None, device: torch.device, fp8: bool, tuning: DecodeTuning) -> int:
    """The key tile of :func:`decode_config` (it does not depend on the packed rows)."""
    return decode_config(d, 1, page_size, device, fp8, tuning)[1]


@functools.lru_cache(maxsize=1024)
def _decode_plan(
    b: int, nq: int, hq: int, hk: int, d: int, page_size: int | None, tiles: int, num_splits: int,
    device: torch.device, fp8: bool, tuning: DecodeTuning,
) -> DecodePlan:
    rows = (hq // hk) * nq
    block_m, block_n, warps, stages = decode_config(d, rows, page_size, device, fp8, tuning)
    row_tiles = triton.cdiv(rows, block_m)
    if num_splits == 0:
        num_splits = decode_splits(
            b, hk, tiles * block_n, torch.float8_e4m3fn if fp8 else torch.bfloat16, _sm_count(device),
            row_tiles=row_tiles, paged=page_size is not None, block_n=block_n, tuning=tuning,
        )
    block_d = max(16, triton.next_power_of_2(d))
    # the merge loads (MERGE_M, MERGE_S, BLOCK_D) fp32 partials at once: at most _MERGE_TILE elements
    merge_s = max(2, min(triton.next_power_of_2(num_splits), _MERGE_TILE // (2 * block_d)))
    merge_m = max(2, min(triton.next_power_of_2(min(rows, block_m)), _MERGE_TILE // (merge_s * block_d)))
    return DecodePlan(
        block_m, block_n, block_d, warps, stages, num_splits, row_tiles, merge_m, merge_s, interpreting(device),
        fp8 and tuning.f16_mma, fp8 and tuning.v_smem16,
    )


def alibi_args(alibi: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(fp32 slopes, batch stride, head stride) of validated slopes of shape (Hq,) or (B, Hq)."""
    alibi = alibi.to(torch.float32)
    return (alibi, 0, alibi.stride(0)) if alibi.dim() == 1 else (alibi, alibi.stride(0), alibi.stride(1))


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


def error_flags(device: torch.device, caller: str = "flash_attn_with_kvcache") -> torch.Tensor:
    """The int32 error words (shape (2,)) of ``device``, created zeroed on first use: word 0 is ORed
    atomically by the decode, append and packed-forward kernels (:data:`ERR_SEQLENS`, ...),
    word 1 (``error_flags(d)[1:]``) by kernels that can only store, the FP8 forward's ``ERR_DESCALE``
    (a plain read-modify-write there cannot drop a decode kernel's bit from word 0).  ``caller``
    names the function in the error raised when the first use falls inside a CUDA-graph capture."""
    key = _device_key(device)
    buf = _ERRORS.get(key)
    if buf is None:
        with _LOCK:
            buf = _ERRORS.get(key)
            if buf is None:
                if _capturing(device):  # its zero-fill would be recorded into the graph, not run now
                    raise RuntimeError(
                        f"{caller}: call it once on this device outside CUDA-graph capture "
                        "(a warm-up) before capturing it"
                    )
                # a normal tensor even under inference_mode, so check_errors can clear it anywhere
                with torch.inference_mode(False):
                    buf = _ERRORS[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return buf


def take_errors() -> list[tuple[torch.device, int]]:
    """``(device, bits)`` of every device whose error word is set, clearing it (one device
    sync per device that has run a decode kernel)."""
    found = []
    for buf in list(_ERRORS.values()):
        if buf.is_cuda:  # kernels on any stream of the device may still be ORing bits in
            torch.cuda.synchronize(buf.device)
        word0, word1 = buf.tolist()
        bits = word0 | word1
        if bits:
            with torch.inference_mode(False), torch.cuda.device(buf.device) if buf.is_cuda else nullcontext():
                # only the bits read: one set since (a kernel on another stream) stays for the next check
                _clear_error_bits_kernel[(1,)](buf, ~word0, ~word1)
            found.append((buf.device, bits))
    return found


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (False on CPU)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class KernelArgs(NamedTuple):
    """What one bound launch passes to its kernel, by position: the names of the per-call
    arguments (in the order the launch's ``__call__`` passes them), then the arguments bound once
    as ``(name, value)`` pairs.  The names are checked against the kernel's parameters by a test
    (``tests/kernels/test_decode.py``); the launch path uses only the values."""

    kernel: object  # the triton.JITFunction
    dynamic: tuple[str, ...]
    static: tuple[tuple[str, object], ...]

    def names(self) -> tuple[str, ...]:
        return self.dynamic + tuple(name for name, _ in self.static)

    def bind(self, grid: Sequence[int], options: dict, check: Sequence[int]) -> KernelLauncher:
        return KernelLauncher(self.kernel, grid, tuple(value for _, value in self.static), options, check=check)


# per-call arguments of the split kernel, in DecodeLaunch.__call__'s order
SPLIT_DYNAMIC = (
    "Q", "K", "V", "BlockTable", "SeqlensK", "Alibi", "Work", "FPart", "Count", "Out", "LSE", "Flags", "Err",
    "KDescale", "VDescale",
    "CacheBatchIdx", "LeftPad", "CuSeqlensQ", "RotCos", "RotSin",
    "sm_scale", "softcap", "phi2", "lo2", "hi2",
    "stride_kb", "stride_kh", "stride_vb", "stride_vh", "capacity",  # per-call ints (a growing cache)
)
MERGE_DYNAMIC = ("Work", "FPart", "Out", "LSE", "Flags", "CuSeqlensQ")
APPEND_DYNAMIC = (
    "K", "V", "KNew", "VNew", "BlockTable", "SeqlensK", "Err", "KDescale", "VDescale", "CacheBatchIdx", "RotCos", "RotSin",
)
# the caller's tensors always passed (their 16-byte alignment may vary per call, so it is keyed)
_CALLER_TENSORS = ("Q", "K", "V", "BlockTable", "SeqlensK", "Alibi")
_APPEND_CALLER_TENSORS = ("K", "V", "KNew", "VNew", "BlockTable", "SeqlensK")


def _check_slots(dynamic: tuple[str, ...], always: tuple[str, ...], optional: dict[str, bool]) -> tuple[int, ...]:
    """Positions in ``dynamic`` of the caller's tensors whose alignment is keyed: ``always``, and the
    ``optional`` ones in use (an unused slot gets one of our aligned allocations, never checked)."""
    return tuple(dynamic.index(n) for n in (*always, *(n for n, used in optional.items() if used)))


class Rotary(NamedTuple):
    """Rotary embedding fused into the append (k) and the q load: ``rotary_dim / 2`` columns of the
    (seqlen_ro, rotary_dim / 2) cos / sin tables (contiguous), their dtype, GPT-J pairs (``interleaved``)
    or GPT-NeoX halves, and whether q token t sits at ``cache_seqlens + t`` (causal or windowed) or
    every token at ``cache_seqlens`` (flash-attn's rule)."""

    rot_half: int
    seqlen_ro: int
    dtype: torch.dtype
    interleaved: bool
    per_token: bool


class KVFeatures(NamedTuple):
    """The optional inputs of one call signature (hashable, part of the launch keys).

    ``batch_idx``: cache_batch_idx is given (contiguous cache; ``k_cache.shape[0]`` rows);
    ``leftpad``: cache_leftpad is given; ``varlen_q``: ``(batch, max_seqlen_q)`` when q is
    (total_q, Hq, d) with cu_seqlens_q; ``rotary``: a :class:`Rotary` or None."""

    batch_idx: bool = False
    leftpad: bool = False
    varlen_q: tuple[int, int] | None = None
    rotary: Rotary | None = None


NO_FEATURES = KVFeatures()


class DecodeLaunch:
    """The decode kernels for one problem signature, their static arguments bound once.

    A signature is everything but the data: the shapes, strides and dtype of q,
    the caches' head dim, heads, row strides and whether 16 divides their batch
    (page) and head strides (``kv_aligned``), the block table's row stride and
    page size, the ALiBi slopes' strides, the window, whether softcap /
    FlashDecoding++ are on, the :class:`DecodePlan`, the dtype and stride of the
    lengths, the tokens appended before the attention (``seqlen_add``, added to
    every length), the page count (cache rows) the kernel clamps against, and
    the device.  The capacity and the batch and head strides of the caches are
    read from the tensors per call (a cache that grows by one key a step keeps
    its launch; the split count, which the capacity sets, is in the plan).
    :func:`decode_launch` memoises one instance per signature.  Calling it
    allocates the fp32 workspace and launches through
    :class:`~flashtile.runtime.launch.KernelLauncher` (Triton's per-call
    argument binding cost 28 us for 48 arguments against 11 us for a direct
    launch of the compiled kernel on the H100 host):

    * one split: kernel 1 alone, which writes the outputs;
    * eagerly: kernel 1 with the merge fused (its arrival counters from
      :func:`arrival_counters`): one launch;
    * while a CUDA graph is captured: kernel 1, then kernel 2 (the merge) as
      a second node, because a graph replayed on any stream, or two graphs
      replayed at once, must not share counters, and zeroing fresh ones in the
      graph would cost a node as well.  In a graph the launch costs no host time.

    ``arguments`` maps ``"fused"`` / ``"split"`` / ``"merge"`` to the
    :class:`KernelArgs` of each launch this signature uses.
    """

    def __init__(
        self, plan: DecodePlan, b: int, nq: int, hq: int, hk: int, d: int, dtype: torch.dtype,
        q_strides: tuple[int, ...], kv_row_strides: tuple[int, int], kv_aligned: bool,
        bt_stride: int | None, page_size: int | None, alibi_strides: tuple[int, int] | None,
        left: int, right: int, has_softcap: bool, unified: bool,
        sl_dtype: torch.dtype, sl_stride: int, seqlen_add: int, num_pages: int,
        device: torch.device, descale_strides: tuple[int, int, int, int] | None = None,
        features: KVFeatures = NO_FEATURES, total_q: int = 0, full_length: bool = False,
    ) -> None:
        s = plan.n_splits
        self.full_length = full_length
        self.empty = b * hq * nq == 0  # no output row: nothing to launch
        self.err = error_flags(device)
        self.write_out = s == 1  # one split is the answer: no workspace, no merge
        self.rows = b * hq * nq * s  # partials: one per (batch element, head, token, split)
        self.lse_offset = self.rows * plan.block_d
        self.counters = b * hk * plan.row_tiles  # one per program tile (batch element, kv head, row tile)
        self.unified = unified
        self.kv_aligned = kv_aligned
        out_strides = (
            # the output is allocated contiguous: (B, Nq, Hq, d), or (total_q, Hq, d) for varlen q
            ("stride_ob", 0 if features.varlen_q else nq * hq * d), ("stride_om", hq * d), ("stride_oh", d),
        )
        rot = features.rotary
        feature_ints = (
            ("n_cache_batch", num_pages), ("total_q", total_q),
            ("rot_half", rot.rot_half if rot else 0), ("seqlen_ro", rot.seqlen_ro if rot else 0),
        )
        feature_flags = (
            ("HAS_BATCH_IDX", features.batch_idx), ("HAS_LEFTPAD", features.leftpad),
            ("VARLEN_Q", features.varlen_q is not None), ("ROTARY", rot is not None),
            ("ROT_INTERLEAVED", bool(rot and rot.interleaved)), ("ROT_PER_TOKEN", bool(rot and rot.per_token)),
        )
        shape = (
            ("n_heads_q", hq), ("n_heads_k", hk), ("kv_group", hq // hk), ("seqlen_q", nq), ("head_dim", d),
            ("n_splits", s),
        )
        static = (
            *zip(("stride_qb", "stride_qm", "stride_qh"), q_strides[:3]),
            ("stride_kn", kv_row_strides[0]), ("stride_vn", kv_row_strides[1]),
            ("stride_bt_b", bt_stride or 0), ("stride_sl", sl_stride),
            *zip(("stride_alibi_b", "stride_alibi_h"), alibi_strides or (0, 0)),
            *out_strides, *shape,
            ("window_left", left), ("window_right", right), ("lse_offset", self.lse_offset),
            ("seqlen_add", seqlen_add), ("num_pages", num_pages),
            *zip(("stride_kds_b", "stride_kds_h", "stride_vds_b", "stride_vds_h"), descale_strides or (0, 0, 0, 0)),
            *feature_ints,
            ("BLOCK_M", plan.block_m), ("BLOCK_N", plan.block_n), ("BLOCK_D", plan.block_d),
            ("PAGED", page_size is not None), ("PAGE_SIZE", page_size or 1),
            ("HAS_LEFT", left >= 0), ("HAS_RIGHT", right >= 0),
            ("HAS_SOFTCAP", has_softcap), ("HAS_ALIBI", alibi_strides is not None),
            ("UNIFIED", unified), ("DOT_PRECISION", "tf32"),
            ("UPCAST_DOT", dtype == torch.bfloat16 and plan.interpret),
            ("EVEN_D", plan.block_d == d), ("WRITE_OUT", self.write_out),
        )
        merge = (("MERGE_M", plan.merge_m), ("MERGE_S", plan.merge_s))
        options = dict(num_warps=plan.num_warps, num_stages=plan.num_stages)
        grid = (b * hk, s, plan.row_tiles)
        # q, caches, block table, lengths and slopes come from the caller; the workspace, counters,
        # flags and outputs are aligned allocations
        fp8 = descale_strides is not None
        # fp16 MMAs for an FP8 cache: with bf16 q, on the safe path (FlashDecoding++'s P may pass fp16's range)
        f16_mma = fp8 and plan.f16_mma and not unified and dtype == torch.bfloat16
        flags = (
            ("KV_FP8", fp8), ("KV_F16_MMA", f16_mma), ("KV_V_SMEM16", fp8 and plan.v_smem16), *feature_flags,
            ("KV_ALIGNED", kv_aligned), ("FULL_LENGTH", full_length),
            ("WIDE_TILE", wide_tile(plan.block_n, plan.block_d, *kv_row_strides)),
        )
        check = _check_slots(SPLIT_DYNAMIC, _CALLER_TENSORS, {
            "KDescale": fp8, "VDescale": fp8, "CacheBatchIdx": features.batch_idx, "LeftPad": features.leftpad,
            "CuSeqlensQ": features.varlen_q is not None, "RotCos": rot is not None, "RotSin": rot is not None,
        })
        fused = KernelArgs(_decode_split_kernel, SPLIT_DYNAMIC, (*static, ("FUSED", not self.write_out), *merge, *flags))
        self.arguments = {"fused": fused}
        self.fused = fused.bind(grid, options, check=check)
        self.split = self.merge = None
        if not self.write_out:
            split = KernelArgs(_decode_split_kernel, SPLIT_DYNAMIC, (*static, ("FUSED", False), *merge, *flags))
            # one packed row a program, on one warp (two at 8K merge-tile elements): of 1/2/4 rows a
            # program on 1/2/4 warps, the fastest in a graph (B=1: 0.7-1.6 us less than one row tile a program)
            warps = max(1, min(4, 2 * plan.merge_s * plan.block_d // 4096))
            merge_args = KernelArgs(_decode_merge_kernel, MERGE_DYNAMIC, (
                *out_strides, *shape, ("lse_offset", self.lse_offset), ("n_bh", b * hk), ("total_q", total_q),
                ("BLOCK_M", 1), ("MERGE_M", 2), ("MERGE_S", plan.merge_s), ("BLOCK_D", plan.block_d),
                ("UNIFIED", unified), ("VARLEN_Q", features.varlen_q is not None),
            ))
            self.arguments.update(split=split, merge=merge_args)
            self.split = split.bind(grid, options, check=check)
            merge_check = _check_slots(MERGE_DYNAMIC, (), {"CuSeqlensQ": features.varlen_q is not None})
            if b:  # an empty batch launches nothing (__call__ returns first)
                self.merge = merge_args.bind(fold_grid(hq // hk * nq, b * hk), dict(num_warps=warps), check=merge_check)

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens_k: torch.Tensor,
        block_table: torch.Tensor | None, alibi: torch.Tensor | None,
        out: torch.Tensor, lse: torch.Tensor, flags: torch.Tensor | None,
        scale: float, softcap: float, unified: tuple[float, float, float] | None,
        descales: tuple[torch.Tensor, torch.Tensor] | None = None, extra: tuple | None = None,
    ) -> None:
        """Launch; the kernels write ``out``, ``lse`` and, with ``unified``, ``flags`` (and OR index
        errors into :func:`error_flags`).  Unused pointer slots get a tensor that is already at
        hand (never dereferenced).  ``seqlens_k``: int32 or int64 lengths before the append, of
        this signature's dtype and stride (ignored, may be None, for a ``full_length`` launch: every
        element attends to the whole cache).  ``descales``: the fp32 (k_descale, v_descale) of an
        FP8 cache, of this signature's strides.  ``extra``: the contiguous tensors (cache_batch_idx,
        cache_leftpad, cu_seqlens_q, rotary_cos, rotary_sin) of this signature's
        :class:`KVFeatures`, None where absent (or ``extra`` None: all absent).  Absent tensors'
        slots get ``lse`` (an aligned allocation, so their alignment is not checked per call)."""
        if self.empty:
            return
        flags = lse if flags is None else flags
        if self.full_length:  # the kernel reads no length: its slots get an aligned allocation
            seqlens_k = lse
        idx, pad, cu, cos, sin = extra if extra is not None else (None,) * 5
        if self.write_out:
            work = f_part = count = lse
        else:
            work = torch.empty(self.lse_offset + self.rows, dtype=torch.float32, device=q.device)
            f_part = torch.empty(self.rows, dtype=torch.int8, device=q.device) if self.unified else work
            graph = _capturing(q.device)
            count = work if graph else arrival_counters(q.device, self.counters)
        phi, lo, hi = unified if unified is not None else (0.0, 0.0, 0.0)
        ks, vs = k_cache.stride(), v_cache.stride()
        if self.kv_aligned and (ks[0] | ks[2] | vs[0] | vs[2]) & 15:
            _misaligned(ks, vs)
        capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
        args = (  # SPLIT_DYNAMIC
            q, k_cache, v_cache, seqlens_k if block_table is None else block_table, seqlens_k,
            seqlens_k if alibi is None else alibi, work, f_part, count, out, lse, flags, self.err,
            *(descales if descales is not None else (lse, lse)),
            lse if idx is None else idx, lse if pad is None else pad, lse if cu is None else cu,
            lse if cos is None else cos, lse if sin is None else sin,
            scale, softcap, phi * LOG2E, lo * LOG2E, hi * LOG2E,
            ks[0], ks[2], vs[0], vs[2], capacity,
        )
        if self.write_out or not graph:
            self.fused(*args)
        else:
            self.split(*args)
            self.merge(work, f_part, out, lse, flags, lse if cu is None else cu)  # MERGE_DYNAMIC


def _misaligned(ks: tuple[int, ...], vs: tuple[int, ...]) -> None:
    """A launch built with KV_ALIGNED (its kernel rounds the batch / head strides down to multiples of 16)
    called with a cache whose strides are not: raise, naming the cache."""
    name, st = ("k_cache", ks) if (ks[0] | ks[2]) & 15 else ("v_cache", vs)
    raise ValueError(
        f"{name}: batch and head strides ({st[0]}, {st[2]}) must be multiples of 16 for this launch, which was "
        "built for 16-aligned strides (get the launch for these caches from decode_launch)"
    )


@functools.lru_cache(maxsize=256)  # thread-safe; keyed by device among the rest of the signature
def _decode_launch(*signature) -> DecodeLaunch:
    return DecodeLaunch(*signature)


def decode_launch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor | None,
    alibi: tuple[torch.Tensor, int, int] | None, *, left: int, right: int, softcap: float, unified: bool,
    num_splits: int, seqlens_k: torch.Tensor | None = None, seqlen_add: int = 0,
    descales: tuple[torch.Tensor, torch.Tensor] | None = None, features: KVFeatures = NO_FEATURES,
    full_length: bool = False,
) -> tuple[DecodePlan, DecodeLaunch]:
    """The plan and the memoised :class:`DecodeLaunch` of these (validated) arguments' signature.

    ``seqlens_k`` (its dtype and stride; None: contiguous int32) and ``seqlen_add`` (the
    tokens appended before attending) are part of the signature, and so is ``full_length`` (no
    lengths at all: every element attends to the whole cache, no length tensor is built or read;
    ``seqlen_add`` must be 0), and so are the strides of
    ``descales`` (an FP8 cache's (k_descale, v_descale), or None).  The launch is keyed by
    q's device.

    With one query token a right window bound allows every key before the cache's end
    (token Nq - 1 sees keys ``j <= L - 1 + right``), so it is dropped: causal single-token
    decoding runs the unmasked kernel, as SDPA does (2 % less device time at B=1, 32k keys).

    ``features``: the optional inputs (:class:`KVFeatures`); with ``varlen_q`` q is
    (total_q, Hq, d), attended as ``varlen_q = (batch, max_seqlen_q)`` padded elements."""
    total_q = 0
    if features.varlen_q is not None:
        total_q, hq, d = q.shape
        b, nq = features.varlen_q
        q_strides = (0, *q.stride())
    else:
        b, nq, hq, d = q.shape
        q_strides = q.stride()
    if nq == 1 and right >= 0:
        right = -1
    hk = k_cache.shape[2]
    paged = block_table is not None
    rows = k_cache.shape[1]
    capacity = block_table.shape[1] * rows if paged else rows
    plan = decode_plan(b, nq, hq, hk, d, rows if paged else None, capacity, num_splits, q.device, descales is not None)
    sl = (torch.int32, 1) if seqlens_k is None else (seqlens_k.dtype, seqlens_k.stride(0))
    ks, vs = k_cache.stride(), v_cache.stride()
    launch = _decode_launch(
        plan, b, nq, hq, hk, d, q.dtype, q_strides, (ks[1], vs[1]), aligned16(ks[0], ks[2], vs[0], vs[2]),
        block_table.stride(0) if paged else None, rows if paged else None,
        alibi[1:] if alibi is not None else None, left, right, softcap > 0, unified,
        *sl, seqlen_add, k_cache.shape[0], q.device, _descale_strides(descales), features, total_q, full_length,
    )
    return plan, launch


def aligned16(*strides: int) -> bool:
    """Whether 16 divides every one of ``strides`` (the kernels' KV_ALIGNED for per-call strides)."""
    acc = 0
    for st in strides:
        acc |= st
    return acc & 15 == 0


def wide_tile(block_n: int, block_d: int, *row_strides: int) -> bool:
    """Whether a K/V tile's largest in-tile offset, ``(block_n - 1) * row stride + block_d - 1``, passes int32."""
    return (block_n - 1) * max(row_strides) + block_d - 1 >= 2**31


def _descale_strides(descales: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[int, int, int, int] | None:
    """(k_descale strides, v_descale strides) of an FP8 cache's (B, Hk) descales, or None."""
    return None if descales is None else (*descales[0].stride(), *descales[1].stride())


class AppendLaunch:
    """The append kernel for one signature, bound once: grid fold_grid(Nnew * Hk, B), one head row of d
    elements a program, for k and v together.  ``arguments``: its :class:`KernelArgs`."""

    def __init__(
        self, b: int, n_new: int, hk: int, d: int, k_strides: tuple[int, ...], v_strides: tuple[int, ...],
        kn_strides: tuple[int, ...], vn_strides: tuple[int, ...], bt_stride: int | None, page_size: int | None,
        sl_stride: int, capacity: int, num_pages: int, device: torch.device,
        descale_strides: tuple[int, int, int, int] | None = None,
        batch_idx: bool = False, rotary: Rotary | None = None,
    ) -> None:
        self.err = error_flags(device)
        self.arguments = KernelArgs(_append_kernel, APPEND_DYNAMIC, (
            *zip(("stride_kb", "stride_kn", "stride_kh"), k_strides[:3]),
            *zip(("stride_vb", "stride_vn", "stride_vh"), v_strides[:3]),
            *zip(("stride_knb", "stride_knn", "stride_knh"), kn_strides[:3]),
            *zip(("stride_vnb", "stride_vnn", "stride_vnh"), vn_strides[:3]),
            ("stride_bt_b", bt_stride or 0), ("stride_sl", sl_stride),
            ("n_new", n_new), ("capacity", capacity), ("num_pages", num_pages), ("head_dim", d),
            ("n_heads_k", hk), ("n_batch", b),
            *zip(("stride_kds_b", "stride_kds_h", "stride_vds_b", "stride_vds_h"), descale_strides or (0, 0, 0, 0)),
            ("n_cache_batch", num_pages), ("rot_half", rotary.rot_half if rotary else 0),
            ("BLOCK_D", max(16, triton.next_power_of_2(d))), ("PAGED", page_size is not None),
            ("PAGE_SIZE", page_size or 1), ("QUANT", descale_strides is not None),
            ("HAS_BATCH_IDX", batch_idx), ("ROTARY", rotary is not None),
            ("ROT_INTERLEAVED", bool(rotary and rotary.interleaved)),
        ))
        quant = descale_strides is not None
        check = _check_slots(APPEND_DYNAMIC, _APPEND_CALLER_TENSORS, {
            "KDescale": quant, "VDescale": quant, "CacheBatchIdx": batch_idx,
            "RotCos": rotary is not None, "RotSin": rotary is not None,
        })
        # Nnew * Hk rows fastest, batch elements folded past 65535 (y, z stop there); nothing to append: no launch
        self.launcher = None
        if b * n_new * hk:
            self.launcher = self.arguments.bind(fold_grid(n_new * hk, b), dict(num_warps=1), check=check)

    def __call__(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        seqlens_k: torch.Tensor, block_table: torch.Tensor | None,
        descales: tuple[torch.Tensor, torch.Tensor] | None = None,
        batch_idx: torch.Tensor | None = None, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
    ) -> None:
        # APPEND_DYNAMIC; descales: an FP8 cache's (k_descale, v_descale); absent tensors' slots get the
        # error word (an aligned allocation, so their alignment is not checked per call)
        if self.launcher is None:
            return
        err = self.err
        self.launcher(
            k_cache, v_cache, k, v, seqlens_k if block_table is None else block_table, seqlens_k, err,
            *(descales if descales is not None else (err, err)),
            err if batch_idx is None else batch_idx, err if cos is None else cos, err if sin is None else sin,
        )


@functools.lru_cache(maxsize=256)
def _append_launch(*signature) -> AppendLaunch:
    return AppendLaunch(*signature[:-4])


def append_launch(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    seqlens_k: torch.Tensor, block_table: torch.Tensor | None,
    descales: tuple[torch.Tensor, torch.Tensor] | None = None, features: KVFeatures = NO_FEATURES,
) -> AppendLaunch:
    """The memoised :class:`AppendLaunch` writing k, v (B, Nnew, Hk, d) into the caches at
    positions ``seqlens_k[b] + i`` (validated shapes; the values are not trusted).  With
    ``descales`` (an FP8 cache's (k_descale, v_descale)) the rows are quantised on the way in
    (after rotary); ``features``: its ``batch_idx`` and ``rotary`` apply to the append."""
    b, n_new, hk, d = k.shape
    paged = block_table is not None
    rows = k_cache.shape[1]
    return _append_launch(
        b, n_new, hk, d, k_cache.stride(), v_cache.stride(), k.stride(), v.stride(),
        block_table.stride(0) if paged else None, rows if paged else None, seqlens_k.stride(0),
        block_table.shape[1] * rows if paged else rows, k_cache.shape[0], k_cache.device,
        _descale_strides(descales), features.batch_idx, features.rotary,
        k_cache.dtype, k.dtype, seqlens_k.dtype, block_table is not None,  # dtypes: one launcher per dtype
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
    descales: tuple[torch.Tensor, torch.Tensor] | None = None,
    features: KVFeatures = NO_FEATURES,
    extra: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The decode launch for validated arguments: ``(out, lse, flags)``.  No checks here.

    For callers that validated the shapes already (``flash_attn_with_kvcache``):
    q (B, Nq, Hq, d) and the caches with unit stride on d, ``seqlens_k`` int32
    or int64 (B,) (any stride), or None (every element attends to the whole cache, no append), block
    table with unit stride on dim 1,
    ``alibi`` from :func:`alibi_args` or None, the window already normalised,
    ``unified`` = (phi, lo, hi) or None.  Element b attends to keys
    ``[0, seqlens_k[b] + seqlen_add)``; lengths and block-table entries are not
    trusted (clamped / masked on the device, errors in :func:`error_flags`).  ``flags`` is None unless
    ``unified`` is set or ``return_flags`` asks for (zero) flags.  ``launch``:
    the :func:`decode_launch` of these arguments, when the caller kept it.  ``descales``:
    (k_descale, v_descale) fp32 (B, Hk) of float8_e4m3fn caches (q fp16/bf16).
    No host synchronisation: FlashDecoding++'s fallback happens in the kernel.
    ``features`` / ``extra``: the optional inputs (:class:`KVFeatures`, and the tensors of
    :meth:`DecodeLaunch.__call__`); with ``varlen_q`` q, ``out`` are (total_q, Hq, d) and
    ``lse`` (Hq, total_q).
    """
    dev = q.device
    if features.varlen_q is not None:
        total_q, hq, d = q.shape
        b, nq = features.varlen_q
        out = torch.empty((total_q, hq, d), dtype=q.dtype, device=dev)
        lse = torch.empty((hq, total_q), dtype=torch.float32, device=dev)
    else:
        b, nq, hq, d = q.shape
        out = torch.empty((b, nq, hq, d), dtype=q.dtype, device=dev)
        lse = torch.empty((b, hq, nq), dtype=torch.float32, device=dev)
    if launch is None:
        launch = decode_launch(
            q, k_cache, v_cache, block_table, alibi, unified=unified is not None,
            left=left, right=right, softcap=softcap, num_splits=num_splits, seqlens_k=seqlens_k, seqlen_add=seqlen_add,
            descales=descales, features=features, full_length=seqlens_k is None,
        )[1]
    flags = None
    if unified is not None:
        flags = torch.empty((b, hq, nq), dtype=torch.int32, device=dev)  # the kernel writes every row
    elif return_flags:
        flags = torch.zeros((b, hq, nq), dtype=torch.int32, device=dev)
    if out.numel() == 0:
        return out, lse, flags
    launch(q, k_cache, v_cache, seqlens_k, block_table, alibi[0] if alibi is not None else None,
           out, lse, flags, scale, softcap, unified, descales, extra)
    return out, lse, flags


def _check_safe_range(safe_range: object) -> tuple[float, float]:
    ok = isinstance(safe_range, (tuple, list)) and len(safe_range) == 2
    ok = ok and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in safe_range)
    if not ok or not (math.isfinite(safe_range[0]) and math.isfinite(safe_range[1]) and safe_range[0] < safe_range[1]):
        raise ValueError(f"safe_range must be a pair (lo, hi) of finite floats, lo < hi, got {safe_range!r}")
    return float(safe_range[0]), float(safe_range[1])


def flash_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | int | None,
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
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """Split-KV decoding without an append: returns ``(out, lse)`` (plus the recomputed-row flags if asked).

    The kernel-level view of :func:`flashtile.flash_attn_with_kvcache`: the arguments go
    through the op's own checks (one definition of each, errors naming the op's arguments),
    then :func:`run_decode`; what this adds is FlashDecoding++'s ``safe_range`` and its
    per-row flags.  q (B, Nq, Hq, d); caches (B, Nk_max, Hk, d), or (num_pages, page_size,
    Hk, d) with ``block_table`` (B, max_pages) int32; ``cache_seqlens`` (B,) int32 or int64
    (or an int, or None: the capacity): element b attends to keys [0, cache_seqlens[b])
    (tensor values are not trusted: see ``docs/decoding.md``).
    ``out`` is (B, Nq, Hq, d) in q's dtype, ``lse`` (B, Hq, Nq) fp32 natural log, -inf on
    rows with no allowed key (output 0).  ``unified_max`` switches to FlashDecoding++ with
    ``phi = unified_max`` and ``safe_range`` (natural units, default
    :func:`default_unified_range`); with ``return_recomputed`` a third value (B, Hq, Nq)
    int32 holds each row's flag bits (FLAG_ABOVE, FLAG_BELOW, FLAG_OVERFLOW) ORed over its
    splits, all zero on the safe path.  ``k_descale`` / ``v_descale``: float32 (B, Hk) descales
    of float8_e4m3fn caches (as the op).  Forward only (no autograd).
    """
    from flashtile.ops.kvcache import prepare_call  # the op's checks; imported late: ops builds on runtime

    call = prepare_call(
        q, k_cache, v_cache, None, None, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap,
        True, alibi_slopes, num_splits, True, False, unified_max, False, k_descale, v_descale,
    )
    unified = call.unified
    if safe_range is not None:
        lo, hi = _check_safe_range(safe_range)
        unified = None if unified is None else (unified[0], lo, hi)
    if isinstance(cache_seqlens, int):  # checked by the op against the capacity (None: the launch reads no length)
        cache_seqlens = torch.full((call.dims.batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if block_table is not None and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    out, lse, flags = run_decode(
        unit_last_stride(q), k_cache, v_cache, cache_seqlens, block_table,
        alibi_args(alibi_slopes) if alibi_slopes is not None else None,
        scale=call.scale, softcap=call.softcap, left=call.left, right=call.right, num_splits=num_splits,
        unified=unified, return_flags=return_recomputed, launch=call.launch,
        descales=(k_descale, v_descale) if call.fp8 else None,
    )
    return (out, lse, flags) if return_recomputed else (out, lse)
