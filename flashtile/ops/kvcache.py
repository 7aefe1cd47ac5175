"""``flash_attn_with_kvcache``: decoding against a contiguous or paged KV cache (flash-attn semantics).

One call does what a decoding step of an LLM needs:

1. if new keys/values ``k``, ``v`` (B, Nnew, Hk, d) are given, write them into
   the cache *in place* at positions ``cache_seqlens[b] .. cache_seqlens[b] + Nnew - 1``
   of batch element b (through ``block_table`` for a paged cache);
2. attend with q (B, Nq, Hq, d) to keys ``[0, L_b)``, ``L_b = cache_seqlens[b] + Nnew``,
   with the split-KV kernels of :mod:`flashtile.kernels.decode` (Flash-Decoding,
   or FlashDecoding++ with ``unified_max``).

Masks follow :mod:`flashtile.reference.masks` with ``Nk`` replaced by ``L_b``
(bottom-right aligned to each element's own length): with ``causal=True``,
query t of Nq sees keys ``j <= L_b - Nq + t``; so a step that appends its own
Nq tokens lets token t see itself and everything before it.

The append is plain torch advanced indexing (one ``index_put_`` per cache): it
is a scatter of ``2 B Nnew Hk d`` elements, negligible next to reading the
cache, and needs no kernel of its own.  ``cache_seqlens`` is not updated (as
in flash-attn): the caller advances it.

Validation reads ``cache_seqlens`` and the used block-table entries on the host
(one device sync) so that a bad index fails with a ``ValueError`` before any
write or launch, instead of corrupting memory.  The sync also stalls the host
until the GPU drains, so a validated (cache_seqlens, block_table) pair is
remembered: a later call with the *same tensor objects*, unmodified (PyTorch's
version counter of each is unchanged: every in-place torch op bumps it), the
same capacity, page pool and ``Nnew`` skips the read.  The layers of one
decoding step share these tensors, so a model syncs once per step, not once
per layer.  (A write that bypasses the version counter, e.g. a custom kernel
storing into ``cache_seqlens``, is not seen; such callers pass fresh tensors.)
An int ``cache_seqlens`` with a contiguous cache is checked on the host
without any sync.

The other checks read only shapes, strides, dtypes, devices and Python
values, so their outcome is remembered per *call signature*
(:func:`_call_key`): a decoding loop pays for them, and for building the
kernels' launch, once per shape, and every later step goes straight to the
launch (bound once, :mod:`flashtile.kernels._launch`: one kernel eagerly).  Both
memos are bounded, module-level dictionaries.

CUDA graphs: a call can be captured (the safe path and FlashDecoding++, whose
exact fallback happens in the kernel), as inference engines capture a decoding
step to take the host out of it.
During capture the length / block-table check is skipped (device memory
cannot be read then, and each replay uses whatever the caller has written
into the captured ``cache_seqlens`` and ``block_table`` since): keeping them
in range is then the caller's contract.  Decoding is inference: there
is no autograd: the kernels read inputs that require grad as plain data
and the outputs do not require grad.
"""

from __future__ import annotations

import math
import weakref
from typing import NamedTuple

import torch

from flashtile.kernels._common import unit_last_stride
from flashtile.kernels.decode import MAX_SPLITS, DecodeLaunch, alibi_args, decode_launch, default_unified_range, run_decode
from flashtile.ops import validate

__all__ = ["flash_attn_with_kvcache"]


def _check_flag(x: object, name: str) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(x).__name__}")
    return x


def _check_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, paged: bool) -> validate.AttnDims:
    """q (B, Nq, Hq, d); caches (B, Nk_max, Hk, d) or, paged, (num_pages, page_size, Hk, d)."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dim() != 4:
            paged_cache = paged and name != "q"
            layout = "(num_pages, page_size, nheads_k, head_dim)" if paged_cache else "(batch, seqlen, nheads, head_dim)"
            raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(x.shape)}")
    b, nq, hq, d = q.shape
    if nq < 1:
        raise ValueError(f"q must hold at least one query token (dim 1 >= 1), got shape {tuple(q.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache shape {tuple(k_cache.shape)} must equal v_cache shape {tuple(v_cache.shape)}")
    rows, hk, dk = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if not 1 <= d <= validate.MAX_HEAD_DIM:
        raise ValueError(f"head_dim of q must be in 1..{validate.MAX_HEAD_DIM}, got {d}")
    if dk != d:
        raise ValueError(f"head_dim of k_cache/v_cache ({dk}) must equal head_dim of q ({d})")
    if hk == 0 or hq % hk:
        raise ValueError(
            f"number of heads of q ({hq}) must be a multiple of the heads of k_cache/v_cache ({hk}) "
            "(GQA/MQA: q head h reads kv head h // (Hq // Hk))"
        )
    if paged:
        if rows == 0 or rows % 16:
            raise ValueError(f"page_size (dim 1 of a paged k_cache) must be a positive multiple of 16, got {rows}")
    elif k_cache.shape[0] != b:
        raise ValueError(
            f"batch of k_cache ({k_cache.shape[0]}) must equal batch of q ({b}); "
            "pass block_table for a paged cache of shape (num_pages, page_size, nheads_k, head_dim)"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have unit stride on head_dim (they are updated in place)")
    return validate.AttnDims(b, hq, hk, nq, rows, d)


def _check_new_kv(k: object, v: object, k_cache: torch.Tensor, dims: validate.AttnDims) -> int:
    """New keys/values: both None, or both (B, Nnew, Hk, d) in the cache's dtype and device.  Returns Nnew."""
    if k is None and v is None:
        return 0
    if k is None or v is None:
        raise ValueError("k and v must be given together (new keys and values to append) or both be None")
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
        if x.dtype != k_cache.dtype:
            raise TypeError(f"{name} must have the dtype of k_cache ({k_cache.dtype}), got {x.dtype}")
        if x.device != k_cache.device:
            raise ValueError(f"{name} must be on the device of k_cache ({k_cache.device}), got {x.device}")
        want = (dims.batch, x.shape[1] if x.dim() == 4 else -1, dims.heads_k, dims.head_dim)
        if x.dim() != 4 or tuple(x.shape) != want:
            raise ValueError(
                f"{name} must have shape (batch, seqlen_new, nheads_k, head_dim) = "
                f"({dims.batch}, Nnew, {dims.heads_k}, {dims.head_dim}), got {tuple(x.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} must equal v shape {tuple(v.shape)}")
    return int(k.shape[1])


def _check_block_table(block_table: object, q: torch.Tensor, b: int) -> None:
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(
            "block_table must be an int32 torch.Tensor of shape (batch, max_pages) or None, "
            f"got {type(block_table).__name__}"
        )
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must have dtype torch.int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != b or block_table.shape[1] == 0:
        raise ValueError(f"block_table must have shape (batch, max_pages) = ({b}, >= 1), got {tuple(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"block_table must be on the device of q ({q.device}), got {block_table.device}")


def _seqlens_check(cache_seqlens: object, q: torch.Tensor, b: int) -> None:
    """``cache_seqlens`` is None (the full capacity is in use), an int, or an int32/int64 (B,) tensor on q's device."""
    if cache_seqlens is None or (isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool)):
        return
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            "cache_seqlens must be an int, an int32 torch.Tensor of shape (batch,) or None, got "
            + (str(cache_seqlens.dtype) if isinstance(cache_seqlens, torch.Tensor) else type(cache_seqlens).__name__)
        )
    if tuple(cache_seqlens.shape) != (b,):
        raise ValueError(f"cache_seqlens must have shape (batch,) = ({b},), got {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens must be on the device of q ({q.device}), got {cache_seqlens.device}")


def _check_lengths(
    host: list[int], n_new: int, capacity: int, block_table: torch.Tensor | None, num_pages: int, page_size: int
) -> None:
    """Every element's final length fits its cache, and every page it uses exists
    (the block-table check reads one bool back: a device sync)."""
    for b, length in enumerate(host):
        if length < 0:
            raise ValueError(f"cache_seqlens[{b}] = {length} must be >= 0")
        if length + n_new > capacity:
            where = "max_pages * page_size" if block_table is not None else "k_cache.shape[1]"
            raise ValueError(
                f"cache too small: cache_seqlens[{b}] + seqlen_new = {length} + {n_new} = {length + n_new} "
                f"exceeds the capacity {where} = {capacity}"
            )
    if block_table is None:
        return
    used = torch.tensor([-(-(length + n_new) // page_size) for length in host], device=block_table.device)
    pages = torch.arange(block_table.shape[1], device=block_table.device)
    in_use = pages[None, :] < used[:, None]
    bad = in_use & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, p = (int(i) for i in bad.nonzero()[0].tolist())
        raise ValueError(
            f"block_table[{b}, {p}] = {int(block_table[b, p])} is out of range: entries of used pages "
            f"must lie in [0, num_pages) = [0, {num_pages})"
        )


# validated (cache_seqlens, block_table) pairs: key -> ((weakref, version, data_ptr) per tensor)
_VALIDATED: dict[tuple, tuple] = {}
_VALIDATED_MAX = 16


def _fingerprint(x: object) -> tuple:
    """Identity and content version of a tensor: the same live object, storage and version counter."""
    return (weakref.ref(x), x._version, x.data_ptr()) if isinstance(x, torch.Tensor) else (None,)


def _same(fp: tuple, x: object) -> bool:
    if not isinstance(x, torch.Tensor):
        return fp == (None,)
    ref, version, ptr = fp
    return ref() is x and x._version == version and x.data_ptr() == ptr


def _validate_lengths(
    cache_seqlens: object, lens: torch.Tensor, n_new: int, capacity: int,
    block_table: torch.Tensor | None, num_pages: int, page_size: int,
) -> None:
    """:func:`_check_lengths`, skipped when this exact, unmodified (cache_seqlens, block_table) pair
    passed it before, and skipped while a CUDA graph is being captured (nothing can be read back then)."""
    is_tensor = isinstance(cache_seqlens, torch.Tensor)
    if not is_tensor and block_table is None:  # an int or None against a contiguous cache: host-only, no sync
        _check_lengths([capacity if cache_seqlens is None else cache_seqlens] * lens.shape[0], n_new, capacity, None, 0, 0)
        return
    key = (id(cache_seqlens) if is_tensor else cache_seqlens, id(block_table), n_new, capacity, num_pages, page_size)
    hit = _VALIDATED.get(key)
    if hit is not None and _same(hit[0], cache_seqlens) and _same(hit[1], block_table):
        return
    if lens.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    host = lens.tolist() if is_tensor else [capacity if cache_seqlens is None else cache_seqlens] * lens.shape[0]
    _check_lengths(host, n_new, capacity, block_table, num_pages, page_size)
    if len(_VALIDATED) >= _VALIDATED_MAX:
        _VALIDATED.pop(next(iter(_VALIDATED)))
    _VALIDATED[key] = (_fingerprint(cache_seqlens), _fingerprint(block_table))


def _append(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    lens: torch.Tensor, block_table: torch.Tensor | None,
) -> None:
    """Scatter k, v (B, Nnew, Hk, d) into the caches at positions lens[b] + i (paged: through the block table)."""
    b, n_new = k.shape[0], k.shape[1]
    pos = lens.to(torch.int64)[:, None] + torch.arange(n_new, device=k.device)[None, :]  # (B, Nnew)
    if block_table is None:
        rows = torch.arange(b, device=k.device)[:, None].expand(b, n_new)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
    else:
        page_size = k_cache.shape[1]
        page = torch.gather(block_table.to(torch.int64), 1, pos // page_size)
        k_cache[page, pos % page_size] = k
        v_cache[page, pos % page_size] = v



class _Call(NamedTuple):
    """What the checks of one call signature established (see :func:`_call_key`)."""

    dims: validate.AttnDims
    n_new: int
    left: int
    right: int
    scale: float
    softcap: float
    paged: bool
    page_size: int
    capacity: int
    unified: tuple[float, float, float] | None
    launch: DecodeLaunch  # the kernel's bound launch (q with unit last stride)


def _prepare(
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap,
    alibi_slopes, num_splits, return_lse, unified_max,
) -> _Call:
    """Every check of the arguments except the contents of cache_seqlens / block_table; raises on bad input."""
    validate.check_qkv_tensors(("q", "k_cache", "v_cache"), q, k_cache, v_cache)
    paged = block_table is not None
    dims = _check_layout(q, k_cache, v_cache, paged)
    if paged:
        _check_block_table(block_table, q, dims.batch)
    n_new = _check_new_kv(k, v, k_cache, dims)
    left, right = validate.check_window(_check_flag(causal, "causal"), window_size)
    scale = validate.check_softmax_scale(softmax_scale, dims.head_dim)
    softcap = validate.check_softcap(softcap)
    if alibi_slopes is not None:
        validate.check_alibi(alibi_slopes, q, dims)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [0, {MAX_SPLITS}] (0 = heuristic), got {num_splits!r}")
    _check_flag(return_lse, "return_lse")
    if unified_max is not None:
        if isinstance(unified_max, bool) or not isinstance(unified_max, (int, float)) or not math.isfinite(unified_max):
            raise ValueError(f"unified_max must be a finite float or None, got {unified_max!r}")
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if paged else page_size
    _seqlens_check(cache_seqlens, q, dims.batch)
    unified = None if unified_max is None else (float(unified_max), *default_unified_range(q.dtype, capacity))
    bt = block_table if not paged or block_table.stride(1) == 1 else block_table.contiguous()
    launch = decode_launch(
        unit_last_stride(q), k_cache, v_cache, bt, alibi_args(alibi_slopes) if alibi_slopes is not None else None,
        left=left, right=right, softcap=softcap, unified=unified is not None, num_splits=num_splits,
    )[1]
    return _Call(dims, n_new, left, right, scale, softcap, paged, page_size, capacity, unified, launch)


def _tensor_key(x: object) -> tuple:
    """What the checks read from an optional tensor argument (AttributeError if it is no tensor)."""
    if x is None:
        return (None,)
    return (type(x), x.shape, x.stride(), x.dtype, x.device, x.requires_grad)


def _call_key(
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap,
    alibi_slopes, num_splits, return_lse, unified_max,
) -> tuple | None:
    """Everything :func:`_prepare` reads, as a hashable key, or None (then the call is checked in full).

    Shapes, strides, dtypes and devices of the tensors; the Python arguments
    by value *and type* (``1`` and ``True`` hash alike, but only one of them
    is a valid ``causal``); for ``cache_seqlens`` its kind and, when an int,
    its value.  Two calls with equal keys pass or fail the checks alike, so a
    decoding loop runs them once per signature (their cost is the host time
    of a short-cache step, bench/NOTES.md attempt 10)."""
    if type(window_size) is not tuple:
        return None
    try:
        key = (
            type(q), q.shape, q.stride(), q.dtype, q.device,
            type(k_cache), k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device,
            type(v_cache), v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
            _tensor_key(k), _tensor_key(v), _tensor_key(block_table), _tensor_key(alibi_slopes),
            (type(cache_seqlens), cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.device)
            if isinstance(cache_seqlens, torch.Tensor) else (type(cache_seqlens), cache_seqlens),
            type(softmax_scale), softmax_scale, type(causal), causal, window_size, tuple(map(type, window_size)),
            type(softcap), softcap, type(num_splits), num_splits, type(return_lse), return_lse,
            type(unified_max), unified_max,
        )
        hash(key)
    except (AttributeError, TypeError):  # not a tensor where one belongs, an unhashable value: full checks
        return None
    return key


# checked call signatures -> _Call (bounded; a model decodes with a handful of signatures)
_CALLS: dict[tuple, _Call] = {}
_CALLS_MAX = 64


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | int | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    unified_max: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q against a KV cache, after appending the new k/v in place (flash-attn semantics).

    Shapes: q (B, Nq, Hq, d), Nq >= 1; contiguous caches (B, Nk_max, Hk, d) or,
    with ``block_table`` (B, max_pages) int32, paged caches
    (num_pages, page_size, Hk, d) with page_size a multiple of 16; k, v
    (B, Nnew, Hk, d) or None; ``cache_seqlens`` int32 (B,), an int, or None
    (= the cache is full: Nk_max, or max_pages * page_size).  Hq a multiple of
    Hk (GQA / MQA); one dtype among fp16, bf16, fp32.  Returns ``out``
    (B, Nq, Hq, d) in q's dtype, and with ``return_lse`` also ``lse``
    (B, Hq, Nq) float32 (natural log; -inf on rows with no allowed key).
    ``num_splits = 0`` picks the split count from the SM count, B * Hk and the
    cache capacity; ``unified_max`` switches to FlashDecoding++'s
    asynchronous softmax with that fixed max (exact: flagged rows are
    recomputed).  Every bad argument raises before the cache is written.
    """

    key = _call_key(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap,
        alibi_slopes, num_splits, return_lse, unified_max,
    )
    call = _CALLS.get(key) if key is not None else None
    if call is None:
        call = _prepare(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap,
            alibi_slopes, num_splits, return_lse, unified_max,
        )
        if key is not None:
            if len(_CALLS) >= _CALLS_MAX:
                _CALLS.pop(next(iter(_CALLS)))
            _CALLS[key] = call
    b = call.dims.batch
    if isinstance(cache_seqlens, torch.Tensor):
        lens = cache_seqlens if cache_seqlens.dtype == torch.int32 else cache_seqlens.to(torch.int32)
    else:
        lens = torch.full((b,), call.capacity if cache_seqlens is None else cache_seqlens, dtype=torch.int32, device=q.device)
    _validate_lengths(cache_seqlens, lens, call.n_new, call.capacity, block_table, k_cache.shape[0], call.page_size)

    if call.n_new:
        with torch.no_grad():  # the caches may be leaves that require grad; the append is not differentiable
            _append(k_cache, v_cache, k, v, lens, block_table)
        lens = lens + call.n_new
    if call.paged and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    # everything is validated: launch without flash_decode's second round of checks (host time is
    # the cost of a short-cache step)
    out, lse, _ = run_decode(
        unit_last_stride(q), k_cache, v_cache, lens, block_table,
        alibi_args(alibi_slopes) if alibi_slopes is not None else None,
        scale=call.scale, softcap=call.softcap, left=call.left, right=call.right, num_splits=num_splits,
        unified=call.unified, launch=call.launch,
    )
    return (out, lse) if return_lse else out
