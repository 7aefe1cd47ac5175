"""``flash_attn_with_kvcache``: decoding against a contiguous or paged KV cache (flash-attn 2.x semantics).

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

The append is one small Triton kernel (:func:`flashtile.runtime.decode.append_launch`,
a scatter of ``2 B Nnew Hk d`` elements, negligible next to reading the cache).
``cache_seqlens`` is not updated (as in flash-attn): the caller advances it.

Memory safety does not depend on the *values* of ``cache_seqlens`` and
``block_table``, however they were written (torch ops, ``.numpy()``,
``.data``, DLPack, a custom kernel, a CUDA-graph replay): the kernels read
them on the device and never trust them.  A length outside
``[0, capacity - Nnew]`` writes nothing and is clamped to ``[0, capacity]``
for the attention (int64 lengths are clamped in int64, so none wraps into
range); a used block-table entry outside ``[0, num_pages)`` is an absent page
(not written, not read, contributes nothing).  Either sets a bit of a small
per-device error word; :func:`check_errors` (``flashtile.check_errors()``)
reads and clears it (one device sync) and raises a ``ValueError`` naming
``cache_seqlens`` / ``block_table``.  The outputs of a call that set the
word are not meaningful (the kernels' side: ``docs/decoding.md``).  What the op itself checks:

* an int ``cache_seqlens`` (or None) is checked on the host, which is free:
  a value outside ``[0, capacity - Nnew]`` raises before anything is written;
* a tensor ``cache_seqlens`` and the block table's entries are *not* read on
  the host by default (that would be a device sync every call): errors are
  left in the error word for :func:`check_errors`, which a serving loop calls
  when it can afford a sync (e.g. once per step, or in its health checks);
* ``debug=True`` reads them on the host first (one sync; skipped while a CUDA
  graph is captured) and raises the ``ValueError`` before anything is written.

The other checks read only shapes, strides, dtypes, devices and Python
values, so their outcome is remembered per *call signature*
(:func:`_call_key`): a decoding loop pays for them, and for building the
kernels' launches, once per shape, and every later step goes straight to the
launches (bound once, :mod:`flashtile.runtime.launch`: one kernel eagerly,
two with an append).  The memo is a bounded, module-level dictionary,
mutated under a lock (reads are lock-free), so threads (one per GPU) may
decode concurrently.  The launch runs under a device guard for q's device.

CUDA graphs: a call can be captured (the safe path and FlashDecoding++, whose
exact fallback happens in the kernel), as inference engines capture a decoding
step to take the host out of it.  Each replay reads whatever the caller has
written into the captured ``cache_seqlens`` and ``block_table`` since, with
the same device-side clamping and error word.  Decoding is inference: there
is no autograd: the kernels read inputs that require grad as plain data
and the outputs do not require grad.  It runs under ``torch.inference_mode()``
and ``torch.no_grad()``, and on inference tensors outside them.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import torch

from flashtile.kernels.fa2_fwd import ERR_CU_SEQLENS, ERR_VARLEN_BLOCK_TABLE
from flashtile.kernels.fa3_fwd import ERR_DESCALE
from flashtile.ops import validate
from flashtile.runtime.common import on_tensor_device, unit_last_stride
from flashtile.runtime.decode import (
    ERR_BLOCK_TABLE, ERR_SEQLENS, MAX_SPLITS, AppendLaunch, DecodeLaunch, aligned16, alibi_args, append_launch,
    decode_launch, default_unified_range, on_tuning_change, run_decode, take_errors, tuning_generation,
)
from flashtile.runtime.decode import ERR_BATCH_IDX, ERR_CU_SEQLENS_Q, NO_FEATURES, KVFeatures, Rotary

__all__ = ["flash_attn_with_kvcache", "check_errors"]


def _check_flag(x: object, name: str) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(x).__name__}")
    return x


def _check_layout(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, paged: bool,
    varlen: tuple[int, int] | None = None, batch_idx: bool = False,
) -> validate.AttnDims:
    """q (B, Nq, Hq, d); caches (B, Nk_max, Hk, d) or, paged, (num_pages, page_size, Hk, d).
    ``varlen = (B, max_seqlen_q)``: q is (total_q, Hq, d); ``batch_idx``: a contiguous cache
    may have any number of rows (cache_batch_idx picks them)."""
    if varlen is not None:
        if q.dim() != 3:
            raise ValueError(f"q must be 3-D (total_q, nheads, head_dim) with cu_seqlens_q, got shape {tuple(q.shape)}")
        q = torch.empty((varlen[0], varlen[1], *q.shape[1:]), device="meta")  # the padded (B, max_seqlen_q) shape
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dim() != 4:
            paged_cache = paged and name != "q"
            layout = "(num_pages, page_size, nheads_k, head_dim)" if paged_cache else "(batch, seqlen, nheads, head_dim)"
            raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(x.shape)}")
    b, nq, hq, d = q.shape
    if nq < 1:
        raise ValueError(f"q must hold at least one query token (dim 1 >= 1), got shape {tuple(q.shape)}")
    validate.check_seqlen(nq, "q")
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
    elif k_cache.shape[0] != b and not batch_idx:
        raise ValueError(
            f"batch of k_cache ({k_cache.shape[0]}) must equal batch of q ({b}); "
            "pass block_table for a paged cache of shape (num_pages, page_size, nheads_k, head_dim)"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have unit stride on head_dim (they are updated in place)")
    return validate.AttnDims(b, hq, hk, nq, rows, d)


def _check_new_kv(k: object, v: object, k_cache: torch.Tensor, dims: validate.AttnDims, dtype: torch.dtype) -> int:
    """New keys/values: both None, or both (B, Nnew, Hk, d) in ``dtype`` (the cache's, q's for an FP8
    cache) on the cache's device.  Returns Nnew."""
    if k is None and v is None:
        return 0
    if k is None or v is None:
        raise ValueError("k and v must be given together (new keys and values to append) or both be None")
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
        validate.check_dense(x, name)
        if x.dtype != dtype:
            whose = "q (an FP8 cache takes new rows in q's dtype and quantises them)" if dtype != k_cache.dtype else "k_cache"
            raise TypeError(f"{name} must have the dtype of {whose} ({dtype}), got {x.dtype}")
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


def _reach(shape: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    """The largest element offset from the first element of a tensor of this shape and these strides, or None
    when two of its indices share an element (a sufficient test: each stride, over the dims longer than 1 in
    increasing order, exceeds the offset the smaller ones reach; a stride 0 from ``expand`` fails it)."""
    reach = 0
    if 0 in shape:
        return 0
    for stride, size in sorted((st, n) for n, st in zip(shape, strides) if n > 1):
        if stride <= reach:
            return None
        reach += (size - 1) * stride
    return reach


def _check_writable(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """With new k/v the caches are written in place: each must have distinct elements.  Returns their reaches."""
    reaches = []
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        reach = _reach(tuple(x.shape), x.stride())
        if reach is None:
            raise ValueError(
                f"{name} has elements shared between indices (strides {tuple(x.stride())} for shape {tuple(x.shape)}, "
                "e.g. a stride 0 from expand()), so appending k/v into it in place would be ambiguous; pass a cache "
                "with distinct elements (e.g. .contiguous())"
            )
        reaches.append(reach)
    return reaches[0], reaches[1]


def _check_apart(k_cache: torch.Tensor, v_cache: torch.Tensor, reaches: tuple[int, int]) -> None:
    """With new k/v: no element of k_cache is one of v_cache.  Per call (it depends on the addresses): one
    comparison when their spans are disjoint; else, for equal strides, the two as one tensor with a leading
    axis of stride ``v - k`` must have distinct elements (a K/V pair interleaved in one allocation passes)."""
    size = k_cache.element_size()
    delta = v_cache.data_ptr() - k_cache.data_ptr()
    if delta >= (reaches[0] + 1) * size or -delta >= (reaches[1] + 1) * size or k_cache.numel() == 0:
        return
    if delta % size == 0 and k_cache.stride() == v_cache.stride():
        if _reach((2, *k_cache.shape), (abs(delta) // size, *k_cache.stride())) is not None:
            return
    raise ValueError(
        "k_cache and v_cache share memory (their elements overlap), so appending k and v into them in place "
        "would overwrite one with the other; pass separate caches"
    )


FP8 = torch.float8_e4m3fn


def _check_cache_dtypes(q: object, k_cache: object, v_cache: object) -> bool:
    """q, k_cache, v_cache: one supported dtype, or an FP8 (float8_e4m3fn) k_cache and v_cache with a
    float16 / bfloat16 q.  Returns whether the cache is FP8."""
    fp8 = isinstance(k_cache, torch.Tensor) and k_cache.dtype == FP8
    if not fp8:
        validate.check_qkv_tensors(("q", "k_cache", "v_cache"), q, k_cache, v_cache)
        return False
    validate.check_qkv_tensors(("q",), q)
    if not isinstance(v_cache, torch.Tensor) or v_cache.dtype != FP8:
        got = v_cache.dtype if isinstance(v_cache, torch.Tensor) else type(v_cache).__name__
        raise TypeError(f"v_cache must be torch.float8_e4m3fn like k_cache, got {got}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q must be torch.float16 or torch.bfloat16 with a float8_e4m3fn cache, got {q.dtype}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        validate.check_dense(x, name)
        if x.device != q.device:
            raise ValueError(f"q and {name} must be on the same device; got {q.device} and {x.device}")
    return True


def _check_descales(k_descale: object, v_descale: object, fp8: bool, q: torch.Tensor, dims: validate.AttnDims):
    """FA3's descales of an FP8 cache: float32 (batch, nheads_k) tensors on q's device, both given exactly
    when the cache is float8_e4m3fn.  Returns (k_descale, v_descale) or None."""
    if not fp8:
        for name, x in (("k_descale", k_descale), ("v_descale", v_descale)):
            if x is not None:
                raise ValueError(f"{name} is only for a torch.float8_e4m3fn k_cache/v_cache; pass None with this cache")
        return None
    want = (dims.batch, dims.heads_k)
    for name, x in (("k_descale", k_descale), ("v_descale", v_descale)):
        if x is None:
            raise ValueError(
                f"{name} is required with a float8_e4m3fn cache: a float32 tensor of shape (batch, nheads_k) = {want} "
                "(x = x_fp8 * descale, see flashtile.quantize_per_head)"
            )
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a float32 torch.Tensor of shape (batch, nheads_k), got {type(x).__name__}")
        validate.check_dense(x, name)
        if x.dtype != torch.float32:
            raise TypeError(f"{name} must have dtype torch.float32, got {x.dtype}")
        if tuple(x.shape) != want:
            raise ValueError(f"{name} must have shape (batch, nheads_k) = {want}, got {tuple(x.shape)}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {x.device}")
    return k_descale, v_descale


def _check_descale_values(descales: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``debug=True`` only (a device sync): every descale finite and > 0."""
    for name, x in zip(("k_descale", "v_descale"), descales):
        if not bool((torch.isfinite(x) & (x > 0)).all()):
            raise ValueError(f"{name} must be finite and > 0 everywhere")


def _check_block_table(block_table: object, q: torch.Tensor, b: int) -> None:
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(
            "block_table must be an int32 torch.Tensor of shape (batch, max_pages) or None, "
            f"got {type(block_table).__name__}"
        )
    validate.check_dense(block_table, "block_table")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must have dtype torch.int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != b or block_table.shape[1] == 0:
        raise ValueError(f"block_table must have shape (batch, max_pages) = ({b}, >= 1), got {tuple(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"block_table must be on the device of q ({q.device}), got {block_table.device}")


def _seqlens_check(cache_seqlens: object, q: torch.Tensor, b: int) -> None:
    """``cache_seqlens`` is None (the full capacity is in use), an int, or an int32/int64 (B,) tensor
    (any stride) on q's device."""
    if cache_seqlens is None or (isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool)):
        return
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            "cache_seqlens must be an int, an int32 (or int64) torch.Tensor of shape (batch,) or None, got "
            + (str(cache_seqlens.dtype) if isinstance(cache_seqlens, torch.Tensor) else type(cache_seqlens).__name__)
        )
    validate.check_dense(cache_seqlens, "cache_seqlens")
    if tuple(cache_seqlens.shape) != (b,):
        raise ValueError(f"cache_seqlens must have shape (batch,) = ({b},), got {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens must be on the device of q ({q.device}), got {cache_seqlens.device}")


def _check_lengths(
    host: list[int], n_new: int, capacity: int, block_table: torch.Tensor | None, num_pages: int, page_size: int
) -> None:
    """Every element's final length fits its cache, and every page it uses exists (reading the
    block table is a device sync: only for ``debug=True``)."""
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


def _check_index_vector(x: object, name: str, q: torch.Tensor, n: int, what: str) -> None:
    """An int32 tensor of shape (n,) on q's device (cache_batch_idx, cache_leftpad, cu_seqlens_q)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor of shape {what} or None, got {type(x).__name__}")
    validate.check_dense(x, name)
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {x.dtype}")
    if tuple(x.shape) != (n,):
        raise ValueError(f"{name} must have shape {what} = ({n},), got {tuple(x.shape)}")
    if x.device != q.device:
        raise ValueError(f"{name} must be on the device of q ({q.device}), got {x.device}")


def _check_varlen_q(cu_seqlens_q: object, max_seqlen_q: object, q: object) -> tuple[int, int] | None:
    """``(B, max_seqlen_q)`` for varlen queries (FA3's kvcache extension), or None without them."""
    if cu_seqlens_q is None:
        if max_seqlen_q is not None:
            raise ValueError("max_seqlen_q is only used with cu_seqlens_q (pass both, or neither)")
        return None
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 2:
        raise ValueError(
            "cu_seqlens_q must be an int32 torch.Tensor of shape (batch + 1,), batch >= 1, got "
            + (str(tuple(cu_seqlens_q.shape)) if isinstance(cu_seqlens_q, torch.Tensor) else type(cu_seqlens_q).__name__)
        )
    _check_index_vector(cu_seqlens_q, "cu_seqlens_q", q, cu_seqlens_q.shape[0], "(batch + 1,)")
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or not 1 <= max_seqlen_q <= max(q.shape[0], 1):
        raise ValueError(
            f"max_seqlen_q must be an int in [1, total_q = q.shape[0] = {q.shape[0]}] with cu_seqlens_q, got {max_seqlen_q!r}"
        )
    return cu_seqlens_q.shape[0] - 1, max_seqlen_q


def _check_rotary(
    cos: object, sin: object, q: torch.Tensor, head_dim: int, n_new: int, capacity: int, interleaved: bool,
    per_token: bool,
) -> Rotary | None:
    """cos / sin (seqlen_ro, rotary_dim / 2) in q's dtype or float32, rotary_dim even and <= head_dim,
    seqlen_ro >= the cache capacity (flash-attn's rule), applied only with new keys."""
    if cos is None and sin is None:
        return None
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together (or both be None)")
    for name, x in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
        validate.check_dense(x, name)
        if x.dtype not in (q.dtype, torch.float32):
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}) or torch.float32, got {x.dtype}")
        if x.dim() != 2 or x.shape[1] < 1:
            raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2), got {tuple(x.shape)}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {x.device}")
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        raise ValueError(
            f"rotary_cos ({tuple(cos.shape)}, {cos.dtype}) and rotary_sin ({tuple(sin.shape)}, {sin.dtype}) "
            "must have the same shape and dtype"
        )
    seqlen_ro, half = cos.shape
    if 2 * half > head_dim:
        raise ValueError(f"rotary_cos: rotary_dim = 2 * {half} = {2 * half} must be <= head_dim ({head_dim})")
    if seqlen_ro < capacity:
        raise ValueError(
            f"rotary_cos: seqlen_ro = {seqlen_ro} rows must cover the cache capacity ({capacity} positions)"
        )
    if n_new == 0:
        raise ValueError("rotary_cos / rotary_sin need the new keys k and v (rotary is applied to the appended k and to q)")
    return Rotary(half, seqlen_ro, cos.dtype, interleaved, per_token)


def _check_extras(
    host_lens: list[int], n_new: int, cache_batch_idx: torch.Tensor | None, n_cache: int,
    cache_leftpad: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None, max_seqlen_q: int, total_q: int,
) -> None:
    """``debug=True``: the values of cache_batch_idx, cache_leftpad and cu_seqlens_q (one device sync)."""
    if cache_batch_idx is not None:
        seen: dict[int, int] = {}
        for b, row in enumerate(cache_batch_idx.tolist()):
            if not 0 <= row < n_cache:
                raise ValueError(f"cache_batch_idx[{b}] = {row} is out of range: must lie in [0, k_cache.shape[0]) = [0, {n_cache})")
            if n_new and row in seen:  # two elements appending into one cache row race on its slots
                raise ValueError(f"cache_batch_idx[{seen[row]}] and cache_batch_idx[{b}] are both {row}: with new k/v "
                                 "each batch element must append into its own cache row")
            seen[row] = b
    if cache_leftpad is not None:
        for b, (pad, length) in enumerate(zip(cache_leftpad.tolist(), host_lens)):
            if not 0 <= pad <= length:
                raise ValueError(f"cache_leftpad[{b}] = {pad} must lie in [0, cache_seqlens[{b}]] = [0, {length}]")
    if cu_seqlens_q is not None:
        cu = cu_seqlens_q.tolist()
        if cu[0] != 0 or cu[-1] != total_q:
            raise ValueError(f"cu_seqlens_q must start at 0 and end at total_q = {total_q}, got {cu[0]} .. {cu[-1]}")
        for b in range(len(cu) - 1):
            if not 0 <= cu[b + 1] - cu[b] <= max_seqlen_q:
                raise ValueError(
                    f"cu_seqlens_q[{b + 1}] - cu_seqlens_q[{b}] = {cu[b + 1] - cu[b]} must lie in [0, max_seqlen_q] = [0, {max_seqlen_q}]"
                )


def check_errors() -> None:
    """Raise ``ValueError`` if a decode or append kernel has seen an out-of-range ``cache_seqlens``
    or ``block_table`` entry, the FP8 forward a bad descale, or the packed (varlen) forward a
    ``cu_seqlens`` / ``block_table`` value it clamped, since the last call, and clear the record.

    Reads each device's error word (one device sync per device that has run the decode
    kernels; not allowed while a CUDA graph is captured).  The calls that saw a bad value
    touched no memory outside their tensors (lengths clamped, absent pages masked, nothing
    written for a bad length or page), but their outputs are not meaningful."""
    found = take_errors()
    if not found:
        return
    msgs = []
    for device, bits in found:
        if bits & ERR_SEQLENS:
            msgs.append(
                f"cache_seqlens out of range on {device}: some cache_seqlens[b] < 0 or cache_seqlens[b] + "
                "seqlen_new > capacity (k_cache.shape[1], or max_pages * page_size with a block_table); "
                "the length was clamped and nothing was appended for that element"
            )
        if bits & ERR_DESCALE:
            msgs.append(
                f"FP8 descales out of range on {device}: some q_descale * k_descale not in (0, inf) or a "
                "non-finite v_descale (flash_attn_func with float8_e4m3fn inputs), or a k_descale / v_descale of "
                "a float8_e4m3fn KV cache not finite and > 0 (flash_attn_with_kvcache: nothing was appended for "
                "that head); those heads output 0"
            )
        if bits & ERR_BLOCK_TABLE:
            msgs.append(
                f"block_table entry out of range on {device}: a used entry lies outside [0, num_pages) "
                "(num_pages = k_cache.shape[0]); the page was treated as absent (not read, not written)"
            )
        if bits & ERR_BATCH_IDX:
            msgs.append(
                f"cache_batch_idx entry out of range on {device}: an entry lies outside [0, k_cache.shape[0]); "
                "that element read no key and appended nothing"
            )
        if bits & ERR_CU_SEQLENS_Q:
            msgs.append(
                f"cu_seqlens_q out of range on {device}: a span [cu_seqlens_q[b], cu_seqlens_q[b + 1]) left "
                "[0, total_q] or was longer than max_seqlen_q (it was clamped), or cu_seqlens_q[0] != 0 or "
                "cu_seqlens_q[-1] != total_q; q rows outside every span output 0 with lse -inf"
            )
        if bits & ERR_CU_SEQLENS:
            msgs.append(
                f"cu_seqlens_q / cu_seqlens_k out of range on {device} (flash_attn_varlen_func): a span "
                "[cu_seqlens[b], cu_seqlens[b + 1]) started below 0 or past the packed token count, decreased, "
                "ended past the token count or was longer than max_seqlen_q / max_seqlen_k (or block_table's "
                "max_pages * page_size); it was clamped and those rows are not meaningful"
            )
        if bits & ERR_VARLEN_BLOCK_TABLE:
            msgs.append(
                f"block_table entry out of range on {device} (flash_attn_varlen_func): a used entry lies outside "
                "[0, num_pages) (num_pages = k.shape[0]); it was clamped into the pool and those rows are not meaningful"
            )
    raise ValueError("; ".join(msgs) + " (flashtile.check_errors)")


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
    return_lse: bool
    launch: DecodeLaunch  # the kernel's bound launch (q with unit last stride)
    append: AppendLaunch | None  # the append's bound launch (k, v with unit last stride), with Nnew > 0
    fp8: bool = False  # float8_e4m3fn caches with (k_descale, v_descale)
    features: KVFeatures = NO_FEATURES  # cache_batch_idx / cache_leftpad / cu_seqlens_q / rotary in use
    window: tuple[int, int] = (-1, -1)  # (left, right) as given (causal folded in), before unbind_window
    # a contiguous cache's (length, k_cache strides, v_cache strides) these checks ran on (None: paged); a
    # call whose cache differs there (a cache grown by a key) re-runs only what depends on them (_regrown)
    grown: tuple | None = None
    # capacities (lo, hi] whose plan is the launch's (the split count follows the count of BLOCK_N-key tiles)
    plan_span: tuple[int, int] = (1, 0)
    reaches: tuple[int, int] = (0, 0)  # with new k/v: k_cache's and v_cache's largest element offsets (_check_apart)


def prepare_call(
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap,
    rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, return_lse, unified_max, debug,
    k_descale=None, v_descale=None,
    rotary_cos=None, rotary_sin=None, cache_batch_idx=None, cache_leftpad=None, cu_seqlens_q=None, max_seqlen_q=None,
) -> _Call:
    """Every check of the arguments except the contents of tensor cache_seqlens / block_table
    (and of cache_batch_idx / cache_leftpad / cu_seqlens_q and the descales); raises on bad input.
    Also the checks of :func:`flashtile.runtime.decode.flash_decode`."""
    fp8 = _check_cache_dtypes(q, k_cache, v_cache)
    paged = block_table is not None
    varlen = _check_varlen_q(cu_seqlens_q, max_seqlen_q, q)
    for name, x in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if x is not None and paged:
            raise ValueError(f"{name} cannot be combined with block_table (a paged cache), as in flash-attn")
    dims = _check_layout(q, k_cache, v_cache, paged, varlen, cache_batch_idx is not None)
    # (batch, nheads_k) descales index q's batch element (FA3's), also with cache_batch_idx
    descales = _check_descales(k_descale, v_descale, fp8, q, dims)
    if cache_batch_idx is not None:
        _check_index_vector(cache_batch_idx, "cache_batch_idx", q, dims.batch, "(batch,)")
    if cache_leftpad is not None:
        _check_index_vector(cache_leftpad, "cache_leftpad", q, dims.batch, "(batch,)")
    if paged:
        _check_block_table(block_table, q, dims.batch)
    n_new = _check_new_kv(k, v, k_cache, dims, q.dtype if fp8 else k_cache.dtype)
    reaches = _check_writable(k_cache, v_cache) if n_new else (0, 0)
    left, right = validate.check_window(_check_flag(causal, "causal"), window_size)
    scale = validate.check_softmax_scale(softmax_scale, dims.head_dim)
    softcap = validate.check_softcap(softcap)
    _check_flag(rotary_interleaved, "rotary_interleaved")
    if alibi_slopes is not None:
        validate.check_alibi(alibi_slopes, q, dims)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [0, {MAX_SPLITS}] (0 = heuristic), got {num_splits!r}")
    want_lse = _check_flag(return_softmax_lse, "return_softmax_lse") | _check_flag(return_lse, "return_lse")
    _check_flag(debug, "debug")
    if unified_max is not None:
        if isinstance(unified_max, bool) or not isinstance(unified_max, (int, float)) or not math.isfinite(unified_max):
            raise ValueError(f"unified_max must be a finite float or None, got {unified_max!r}")
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if paged else page_size
    _check_capacity(capacity)
    local = left >= 0 or right >= 0  # flash-attn: causal or local puts q token t at cache_seqlens + t
    window = (left, right)
    left, right = validate.unbind_window(left, right, dims.seqlen_q, capacity)  # L_b <= capacity
    rotary = _check_rotary(rotary_cos, rotary_sin, q, dims.head_dim, n_new, capacity, rotary_interleaved, local)
    features = KVFeatures(cache_batch_idx is not None, cache_leftpad is not None, varlen, rotary)
    if features == NO_FEATURES:
        features = NO_FEATURES  # the per-call path tests identity
    _seqlens_check(cache_seqlens, q, dims.batch)
    if not isinstance(cache_seqlens, torch.Tensor):  # an int or None: checked on the host, for free
        _check_lengths([capacity if cache_seqlens is None else cache_seqlens], n_new, capacity, None, 0, 0)
    unified = None if unified_max is None else (float(unified_max), *default_unified_range(q.dtype, capacity))
    bt = block_table if not paged or block_table.stride(1) == 1 else block_table.contiguous()
    lens = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    plan, launch = decode_launch(
        unit_last_stride(q), k_cache, v_cache, bt, alibi_args(alibi_slopes) if alibi_slopes is not None else None,
        left=left, right=right, softcap=softcap, unified=unified is not None, num_splits=num_splits,
        seqlens_k=lens, seqlen_add=n_new, descales=descales, features=features, full_length=cache_seqlens is None,
    )
    append = None
    if n_new:
        lens_like = lens if lens is not None else torch.empty(dims.batch, dtype=torch.int32, device=q.device)
        append = append_launch(
            k_cache, v_cache, unit_last_stride(k), unit_last_stride(v), lens_like, bt, descales, features,
        )
    return _Call(
        dims, n_new, left, right, scale, softcap, paged, page_size, capacity, unified, want_lse, launch, append, fp8,
        features, window, None if paged else (capacity, k_cache.stride(), v_cache.stride()),
        _plan_span(plan.block_n, capacity, num_splits), reaches,
    )


def _plan_span(block_n: int, capacity: int, num_splits: int) -> tuple[int, int]:
    """Capacities (lo, hi] with as many ``block_n``-key tiles as ``capacity`` (the split heuristic sees only that
    count, :func:`flashtile.runtime.decode.decode_plan`); every capacity with a given ``num_splits``."""
    if num_splits:
        return (-1, 2**31)
    tiles = -(-capacity // block_n)
    return ((tiles - 1) * block_n, tiles * block_n)


def _check_capacity(capacity: int) -> None:
    if capacity > validate.MAX_SEQLEN:
        raise ValueError(f"the cache capacity ({capacity} tokens) must be at most 2^30 (the kernels' int32 tile "
                         "ranges)")


def _regrown(call: _Call, q, k_cache, v_cache, k, v, cache_seqlens, alibi_slopes, num_splits, descales) -> _Call:
    """``call`` for a contiguous cache whose length or batch / head strides differ from those it was checked
    with (a cache that grows by a key a step, as Hugging Face's DynamicCache): the checks, window and plan that
    depend on the capacity run again; the launches are memoised per plan and take the strides per call."""
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache shape {tuple(k_cache.shape)} must equal v_cache shape {tuple(v_cache.shape)}")
    capacity = k_cache.shape[1]
    _check_capacity(capacity)
    rot = call.features.rotary
    if rot is not None and rot.seqlen_ro < capacity:
        raise ValueError(
            f"rotary_cos: seqlen_ro = {rot.seqlen_ro} rows must cover the cache capacity ({capacity} positions)"
        )
    left, right = validate.unbind_window(*call.window, call.dims.seqlen_q, capacity)
    ks, vs = k_cache.stride(), v_cache.stride()
    lo, hi = call.plan_span
    if (
        lo < capacity <= hi and not call.n_new and call.unified is None and left == call.left and right == call.right
        and aligned16(ks[0], ks[2], vs[0], vs[2]) == call.launch.kv_aligned
    ):  # the same plan and constexprs: the launch takes the new capacity and strides per call
        return call._replace(
            dims=call.dims._replace(seqlen_k=capacity), page_size=capacity, capacity=capacity, grown=(capacity, ks, vs),
        )
    unified = None if call.unified is None else (call.unified[0], *default_unified_range(q.dtype, capacity))
    lens = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    plan, launch = decode_launch(
        unit_last_stride(q), k_cache, v_cache, None, alibi_args(alibi_slopes) if alibi_slopes is not None else None,
        left=left, right=right, softcap=call.softcap, unified=unified is not None, num_splits=num_splits,
        seqlens_k=lens, seqlen_add=call.n_new, descales=descales, features=call.features,
        full_length=cache_seqlens is None,
    )
    append = call.append
    if call.n_new:
        lens_like = lens if lens is not None else torch.empty(call.dims.batch, dtype=torch.int32, device=q.device)
        append = append_launch(
            k_cache, v_cache, unit_last_stride(k), unit_last_stride(v), lens_like, None, descales, call.features,
        )
    return call._replace(
        dims=call.dims._replace(seqlen_k=capacity), left=left, right=right, page_size=capacity, capacity=capacity,
        unified=unified, launch=launch, append=append, grown=(capacity, ks, vs),
        plan_span=_plan_span(plan.block_n, capacity, num_splits),
        reaches=_check_writable(k_cache, v_cache) if call.n_new else (0, 0),
    )


_ABSENT = (None,)  # the key of an optional tensor argument left out


def _tensor_key(x: object) -> tuple:
    """What the checks read from an optional tensor argument (AttributeError if it is no tensor)."""
    if x is None:
        return _ABSENT
    return (type(x), x.shape, x.stride(), x.dtype, x.device, x.requires_grad)


def _cache_key(x: object, paged: bool) -> tuple:
    """What the checks read from k_cache / v_cache, less a contiguous (B, Nk_max, Hk, d) cache's length and
    batch / head strides, which :func:`_regrown` checks when they change (AttributeError if it is no tensor)."""
    shape, stride = x.shape, x.stride()
    if paged or len(shape) != 4:
        return (type(x), shape, stride, x.dtype, x.device)
    return (type(x), shape[0], shape[2], shape[3], stride[1], stride[3], x.dtype, x.device)


def _call_key(
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap,
    rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, return_lse, unified_max, debug,
    k_descale=None, v_descale=None,
    rotary_cos=None, rotary_sin=None, cache_batch_idx=None, cache_leftpad=None, cu_seqlens_q=None, max_seqlen_q=None,
) -> tuple | None:
    """Everything :func:`prepare_call` reads, as a key (led by the tuning generation), or None (then the call
    is checked in full); a key with an unhashable value is found unhashable by the memo's lookup.

    Shapes, strides, dtypes and devices of the tensors (of a contiguous cache all but its length and
    its batch / head strides, see :func:`_cache_key`); the Python arguments
    by value *and type* (``1`` and ``True`` hash alike, but only one of them
    is a valid ``causal``); for ``cache_seqlens`` its kind, stride and dtype
    (an int's range is checked on every call, outside the memo).  Two calls with equal keys pass or fail
    the checks alike, so a decoding loop runs them once per signature (run every
    call, they cost about as much host time as a short-cache step's kernels take)."""
    if type(window_size) is not tuple:
        return None
    try:
        paged = block_table is not None
        # absent optional tensors (most calls) key as _ABSENT without a call
        return (
            tuning_generation(), type(q), q.shape, q.stride(), q.dtype, q.device,
            _cache_key(k_cache, paged), _cache_key(v_cache, paged),
            _ABSENT if k is None else _tensor_key(k), _ABSENT if v is None else _tensor_key(v),
            _ABSENT if block_table is None else _tensor_key(block_table),
            _ABSENT if alibi_slopes is None else _tensor_key(alibi_slopes),
            _tensor_key(cache_seqlens) if isinstance(cache_seqlens, torch.Tensor)
            else (type(cache_seqlens),),  # an int's value is checked per call (a decoding loop advances it)
            type(softmax_scale), softmax_scale, type(causal), causal, window_size, tuple(map(type, window_size)),
            type(softcap), softcap, type(rotary_interleaved), rotary_interleaved,
            type(num_splits), num_splits, type(return_softmax_lse), return_softmax_lse,
            type(return_lse), return_lse, type(unified_max), unified_max, type(debug), debug,
            _ABSENT if k_descale is None else _tensor_key(k_descale),
            _ABSENT if v_descale is None else _tensor_key(v_descale),
            _ABSENT if rotary_cos is None else _tensor_key(rotary_cos),
            _ABSENT if rotary_sin is None else _tensor_key(rotary_sin),
            _ABSENT if cache_batch_idx is None else _tensor_key(cache_batch_idx),
            _ABSENT if cache_leftpad is None else _tensor_key(cache_leftpad),
            _ABSENT if cu_seqlens_q is None else _tensor_key(cu_seqlens_q), type(max_seqlen_q), max_seqlen_q,
        )
    except (AttributeError, TypeError, IndexError):  # no tensor where one belongs: full checks
        return None


# checked call signatures -> _Call (bounded; a model decodes with a handful of signatures);
# mutated under _CALLS_LOCK, read without it (a dict lookup is atomic)
_CALLS: dict[tuple, _Call] = {}
_CALLS_MAX = 64
_CALLS_LOCK = threading.Lock()


def _forget_calls() -> None:
    """A memoised call holds a launch planned under DECODE_TUNING: dropped when the table changes (the keys
    also carry the table's generation, so a call planned concurrently with the change is never found)."""
    with _CALLS_LOCK:
        _CALLS.clear()


on_tuning_change(_forget_calls)


def _remember(key: tuple, call: _Call) -> None:
    with _CALLS_LOCK:
        if key not in _CALLS and len(_CALLS) >= _CALLS_MAX:
            _CALLS.pop(next(iter(_CALLS)))
        _CALLS[key] = call


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | int | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    unified_max: float | None = None,
    return_lse: bool = False,
    debug: bool = False,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q against a KV cache, after appending the new k/v in place (flash-attn 2.x semantics).

    The positional order and defaults are flash-attn 2.x's (``causal=False``).
    Shapes: q (B, Nq, Hq, d), Nq >= 1; contiguous caches (B, Nk_max, Hk, d) or,
    with ``block_table`` (B, max_pages) int32, paged caches
    (num_pages, page_size, Hk, d) with page_size a multiple of 16; k, v
    (B, Nnew, Hk, d) or None; ``cache_seqlens`` int32 or int64 (B,) (any
    stride), an int, or None (= the cache is full: Nk_max, or
    max_pages * page_size).  Hq a multiple of Hk (GQA / MQA); one dtype among
    fp16, bf16, fp32.  ``window_size`` a pair (tuple, list or 2-element int
    tensor, read on the host: a CUDA tensor costs a sync); with ``causal`` its
    right bound is 0.  Returns ``out``
    (B, Nq, Hq, d) in q's dtype, and with ``return_softmax_lse`` (or its alias
    ``return_lse``) also ``lse`` (B, Hq, Nq) float32 (natural log; -inf on
    rows with no allowed key).  ``num_splits = 0`` picks the split count from
    the SM count, B * Hk and the cache capacity.

    Rotary (flash-attn's): ``rotary_cos`` / ``rotary_sin`` (seqlen_ro, rotary_dim / 2),
    in q's dtype or float32, rotary_dim even and <= d, seqlen_ro >= the capacity, with k and
    v given: new key i of element b is rotated at position ``cache_seqlens[b] + i`` as it is
    appended, and q token t at ``cache_seqlens[b] + t`` when ``causal`` or a window is set,
    else every token at ``cache_seqlens[b]``; ``rotary_interleaved`` pairs dims (2j, 2j + 1)
    (GPT-J), else (j, j + rotary_dim / 2) (GPT-NeoX).  Positions are cache indices (with
    ``cache_leftpad`` too, as in flash-attn's tests).  ``cache_batch_idx`` int32 (B,): element
    b uses row ``cache_batch_idx[b]`` of a contiguous cache of any batch size.
    ``cache_leftpad`` int32 (B,): element b's keys start at ``cache_leftpad[b]`` (earlier keys are
    masked; masks and ALiBi are still aligned to the cache end).  Neither combines with
    ``block_table`` (as in flash-attn 2).  Queries of 1-16 tokens run in one kernel (all
    tokens of a kv head's GQA group packed into one row tile up to 128 rows); ragged queries
    (FA3's extension, keyword-only): ``cu_seqlens_q`` int32 (B + 1,) and ``max_seqlen_q`` with q
    (total_q, Hq, d); out is then (total_q, Hq, d) and lse (Hq, total_q), element b's tokens are
    ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` and the causal mask is aligned to its own count.

    flashtile extras (keyword-only): ``unified_max`` switches to
    FlashDecoding++'s asynchronous softmax with that fixed max (exact: flagged
    rows are recomputed); ``debug=True`` reads a tensor ``cache_seqlens`` and
    the block table on the host (one device sync) and raises ``ValueError``
    for an out-of-range value before anything is written (also of ``cache_batch_idx``,
    ``cache_leftpad`` and ``cu_seqlens_q``).

    FP8 cache (keyword-only ``k_descale``, ``v_descale``, FA3's names and shapes):
    ``k_cache`` / ``v_cache`` of dtype ``torch.float8_e4m3fn`` hold ``x / descale`` rounded
    to e4m3, with float32 descales of shape (B, Hk) (one per batch element and kv head,
    e.g. from :func:`flashtile.quantize_per_head` with ``layout="bnhd"``); q (and the new
    k, v) are float16 or bfloat16, and so is the output.  The kernel loads the e4m3 tiles,
    widens them to q's dtype, folds ``k_descale`` into the softmax scale and multiplies each
    partial output by ``v_descale`` once.  New k, v are quantised on the append with the
    same descales: ``(x / descale)`` in fp32, saturated to ±448, rounded to nearest even.
    The descales' values are not read on the host (they must be finite and > 0; ``debug``
    checks them; without it a bad one's (batch element, kv head) appends nothing and outputs 0
    with lse -inf, and :func:`check_errors` reports it).  Both are required with an FP8 cache
    and rejected with any other.  They combine with every option above: a rotated new key is quantised after its rotation, and
    with ``cache_batch_idx`` the descales stay indexed by q's batch element (FA3's).

    Bad shapes, dtypes, devices and Python values raise before the cache is
    written, and so does an out-of-range int ``cache_seqlens``, and, with new k/v, a
    ``k_cache`` / ``v_cache`` whose elements are shared between indices (``expand``) or
    with the other cache (the append writes them in place).  Out-of-range
    values *inside* a tensor ``cache_seqlens`` or ``block_table`` never make a
    kernel touch memory outside its tensors; without ``debug`` they are
    reported by :func:`check_errors` (``flashtile.check_errors()``), not by
    this call (see the module docstring).
    """
    args = (
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal, window_size, softcap,
        rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, return_lse, unified_max, debug,
        k_descale, v_descale,
        rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, cu_seqlens_q, max_seqlen_q,
    )
    key = _call_key(*args)  # it leads with the tuning generation
    call = None
    if key is not None:
        try:
            call = _CALLS.get(key)
        except TypeError:  # an unhashable value among the arguments: full checks, nothing memoised
            key = None
    if call is None:
        call = prepare_call(*args)
        if key is not None:
            _remember(key, call)
    else:
        grown = call.grown
        if grown is not None and (
            k_cache.shape[1] != grown[0] or v_cache.shape[1] != grown[0] or k_cache.stride() != grown[1]
            or v_cache.stride() != grown[2]
        ):
            call = _regrown(call, q, k_cache, v_cache, k, v, cache_seqlens, alibi_slopes, num_splits,
                            (k_descale, v_descale) if call.fp8 else None)
            _remember(key, call)
        if type(cache_seqlens) is int:
            _check_lengths([cache_seqlens], call.n_new, call.capacity, None, 0, 0)
    if call.n_new:
        _check_apart(k_cache, v_cache, call.reaches)
    extra = None
    if call.features is not NO_FEATURES:
        extra = tuple(
            x if x is None or x.is_contiguous() else x.contiguous()
            for x in (cache_batch_idx, cache_leftpad, cu_seqlens_q, rotary_cos, rotary_sin)
        )
    return _run(
        q, call, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes, num_splits, debug,
        (k_descale, v_descale) if call.fp8 else None, extra,
    )


@on_tensor_device
def _run(
    q, call: _Call, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes, num_splits, debug,
    descales=None, extra=None,
):
    """The launches of one checked call: the append (if any), then the attention."""
    if isinstance(cache_seqlens, torch.Tensor) or cache_seqlens is None:
        lens = cache_seqlens  # None: the launch (FULL_LENGTH) attends to the whole cache and reads no length
    else:
        lens = torch.full((call.dims.batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    if call.paged and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    host_lens = None
    if debug and not capturing:
        # debug checks the block table's used pages whatever cache_seqlens is (tensor, int or None)
        if isinstance(cache_seqlens, torch.Tensor):
            host_lens = cache_seqlens.tolist()
        else:
            host_lens = [call.capacity if cache_seqlens is None else cache_seqlens] * call.dims.batch
        _check_lengths(host_lens, call.n_new, call.capacity, block_table, k_cache.shape[0], call.page_size)
    if debug and descales is not None and not capturing:
        _check_descale_values(descales)
    idx, pad, cu, cos, sin = extra if extra is not None else (None,) * 5
    if debug and extra is not None and not capturing:
        _check_extras(
            host_lens, call.n_new, idx, k_cache.shape[0], pad, cu, call.dims.seqlen_q, q.shape[0] if cu is not None else 0
        )
    if call.n_new:
        call.append(
            k_cache, v_cache, unit_last_stride(k), unit_last_stride(v), lens, block_table, descales,
            batch_idx=idx, cos=cos, sin=sin,
        )
    out, lse, _ = run_decode(
        unit_last_stride(q), k_cache, v_cache, lens, block_table,
        alibi_args(alibi_slopes) if alibi_slopes is not None else None,
        scale=call.scale, softcap=call.softcap, left=call.left, right=call.right, num_splits=num_splits,
        unified=call.unified, launch=call.launch, seqlen_add=call.n_new, descales=descales,
        features=call.features, extra=extra,
    )
    return (out, lse) if call.return_lse else out
