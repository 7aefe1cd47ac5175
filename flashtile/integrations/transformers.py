"""Hugging Face transformers: ``attn_implementation="flashtile"``.

Importing this module registers flashtile with transformers' attention interface and mask
interface (``register()`` does the same explicitly, and can register under another name)::

    import flashtile.integrations.transformers  # noqa: F401  (registers "flashtile")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flashtile")

What each attention call runs (q, k, v arrive as (batch, heads, seqlen, head_dim) views and are
handed to the kernels as (batch, seqlen, heads, head_dim) views, no copy):

* no padding mask: :func:`flashtile.flash_attn_func` on the fixed-length batch; with a KV cache
  (q_len 1, or a prefill chunk shorter than the cache) causal is bottom-right aligned, which is what
  a cache needs: query i of the chunk sits at key position ``Nk - Nq + i``.  Decoding steps (at most
  16 query tokens, eval mode, no dropout, no gradient, not under ``torch.compile``) run
  :func:`flashtile.flash_attn_with_kvcache` on the cache as it is (no append, every key attended; the
  same bottom-right masks): split-KV with the GQA group's rows packed into one tile, where FA2 would
  run 1-row tiles, and its launch is bound once however the cache grows (``runtime.launch``).
* a 2-D padding mask (the mask function below hands the model's (batch, keys) mask through, or
  ``None`` when nothing is padded): the real tokens are gathered into one ragged batch,
  :func:`flashtile.flash_attn_varlen_func` runs on it, and the output is scattered back (padded
  query rows get 0).  Queries are the last ``q_len`` columns of the mask, so left padding with a
  cache works; a static cache's unused tail (keys past the mask) is never read.  Without a 2-D mask, a call
  whose keys outnumber the written slots (a static cache: ``q_offset + q_length - kv_offset < kv_length``) gets
  an all-ones mask of the written slots from the mask function, and the layers attend views of those keys
  (under ``torch.compile``, where the fill level is a traced tensor, transformers' dense mask).
* packed sequences: where transformers itself keeps documents apart (its mask function carries
  ``packed_sequence_mask_function``: ``position_ids`` restarting inside a row, no 2-D mask, no cache),
  the mask function returns the documents' ragged plan and the attention function runs it document by
  document through the varlen function; ``position_ids`` alone never split a row.  With no mask,
  ``cu_seq_lens_q/k`` + ``max_length_q/k`` keyword arguments (transformers' ``FlashAttentionKwargs``, e.g.
  from ``DataCollatorWithFlattening``) are used as given, with no device read.
* a 4-D mask (a model's own mask, or mask functions other than causal / sliding / padding / packing,
  e.g. or/and overlays, block-wise image overlays, chunked attention): the dense mask through
  :func:`flashtile.scaled_dot_product_attention`.

Ragged plans (indices, cumulative lengths, max lengths: one host read each) are computed once per
forward: a packed plan in the mask function; a padding plan at the first layer, reused by the others for
the mask view the mask function returned (a fresh view per forward, so a later write to the caller's
mask, bumping its version counter or not, is read by the next forward).  A 2-D mask that did not come
from the mask function is planned at every call.

Window convention: transformers' causal ``sliding_window = w`` lets query i see keys
``i - w < j <= i`` (w keys, itself included), which is flash-attn's ``window_size=(w - 1, 0)``;
a bidirectional model passes ``w`` one above its mask's ``|i - j| <= w - 1`` (transformers' flash contract,
ModernBERT's ``config.sliding_window + 1``): ``(w - 1, w - 1)``.  A window over a 2-D mask with holes (real
tokens not contiguous in a row) would count compacted positions: such calls take the dense masked path.  ``scaling``, ``softcap`` and ``dropout``
(the model passes 0 in eval mode) go to the kernels as they are.

transformers (>= 5) treats every implementation whose name contains "flash" as a flash-attn
build and pre-loads one at model init; :func:`register` makes that pre-load return flashtile's
functions for the names it registered, and leaves every other name to transformers.
"""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

import torch

__all__ = ["NAME", "register", "flashtile_attention_forward", "flashtile_mask"]

NAME = "flashtile"
_REGISTERED: set[str] = set()
_LOCK = threading.Lock()


class _Ragged(NamedTuple):
    """One ragged batch: rows kept from the flattened (B * Nq) queries and (B * keys) keys (None: all,
    in order), the keys read per row, cumulative lengths (int32, B' + 1) and max lengths."""

    q_index: torch.Tensor | None
    k_index: torch.Tensor | None
    keys: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    holes: bool = False  # windowed plans: a row's real tokens are not contiguous (compacted positions would be wrong)


class _PackedMask:
    """flashtile_mask's answer where transformers packs documents: their plan over a (batch, n) grid."""

    __slots__ = ("batch", "n", "plan")

    def __init__(self, batch: int, n: int, plan: _Ragged):
        self.batch, self.n, self.plan = batch, n, plan


# id(view) -> (weakref, {spec: plan}); flashtile_mask makes a new view each forward: no content check, no sync
_PLANS: dict = {}
_PLAN_SLOTS = 16


def _own(mask: torch.Tensor) -> torch.Tensor:
    """Register a view flashtile_mask returns (new each forward) so that the layers share its plans."""
    if torch.compiler.is_compiling():
        return mask
    key = id(mask)

    def drop(ref, key=key):  # no lock: it may run from a garbage collection inside a locked block
        if _PLANS.get(key, (None,))[0] is ref:
            _PLANS.pop(key, None)

    with _LOCK:
        if len(_PLANS) >= _PLAN_SLOTS:
            _PLANS.clear()
        _PLANS[key] = (weakref.ref(mask, drop), {})
    return mask


def _all_written(mask) -> bool:
    """``mask`` is flashtile_mask's all-ones mask of a static cache's written slots (this forward's)."""
    entry = _PLANS.get(id(mask)) if isinstance(mask, torch.Tensor) else None
    return entry is not None and entry[0]() is mask and entry[1].get("written", False)


def _mask_plan(mask: torch.Tensor, causal: bool, nq: int, nk: int, windowed: bool = False) -> _Ragged:
    entry = _PLANS.get(id(mask))
    if entry is None or entry[0]() is not mask:  # not a view of this forward's mask function: plan it now
        return _padding_plan(mask, nq, nk, causal, windowed)
    spec = (causal, windowed, tuple(mask.shape), nq, nk)
    plan = entry[1].get(spec)
    if plan is None:
        plan = entry[1][spec] = _padding_plan(mask, nq, nk, causal, windowed)
    return plan


def _padding_to_dense(mask: torch.Tensor, nq: int, nk: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """A (B, L) padding mask as the (B, 1, nq, keys) boolean mask of the real positions (queries the last nq
    columns; causal and the window counted in columns, as transformers' own masks)."""
    mask = mask.bool()
    if mask.shape[1] > nk:
        mask = mask[:, -nk:]
    from flashtile.reference.masks import allowed_mask

    keys = mask.shape[1]
    ok = allowed_mask(nq, keys, causal=causal, window_size=window, device=mask.device)  # bottom-right aligned
    return torch.nn.functional.pad(mask[:, None, None, :] & ok, (0, nk - keys))  # a static cache's unused slots: False


def _cumulative(lens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))


def _padding_plan(mask: torch.Tensor, nq: int, nk: int, causal: bool = True, windowed: bool = False) -> _Ragged:
    """Plan for a (B, L) padding mask (nonzero = real token) over nk cached keys and the last nq queries.

    Not causal (an encoder, or cross-attention, where the mask is the *keys'* and the queries are
    another sequence): the mask selects keys only and every query row is kept, as SDPA does; with a window
    (``windowed``) over self-attention the queries are compacted as the keys are, so that each real query
    stays aligned with its own key (padded query rows then get 0)."""
    mask = mask.bool()
    if mask.shape[1] > nk:  # the mask covers more than this layer keeps (a sliding cache): its last nk columns
        mask = mask[:, -nk:]
    keys = mask.shape[1]  # a static cache's slots past the mask are unused
    k_lens = mask.sum(1, dtype=torch.int32)
    k_index = mask.flatten().nonzero().squeeze(1)
    holes_t = k_lens.new_zeros(())
    if windowed:  # only a window reads it: real tokens contiguous iff each row's first-to-last span holds only them
        cols = torch.arange(keys, device=mask.device)
        first = torch.where(mask, cols, keys).amin(1)
        last = torch.where(mask, cols, -1).amax(1)
        holes_t = ((last - first + 1).clamp_min(0) != k_lens).any()
    if not causal and not (windowed and nq == keys):
        q_lens = torch.full_like(k_lens, nq)
        max_k, holes = torch.stack((k_lens.max(), holes_t.to(k_lens.dtype))).tolist()
        return _Ragged(None, k_index, keys, _cumulative(q_lens), _cumulative(k_lens), nq, max_k, bool(holes))
    if nq > keys:
        raise ValueError(
            f"attention_mask covers {keys} keys but there are {nq} queries: the mask must cover every query token"
        )
    q_mask = mask[:, keys - nq:]
    if nq == keys:
        q_lens, q_index = k_lens, k_index
    else:
        q_lens = q_mask.sum(1, dtype=torch.int32)
        q_index = q_mask.flatten().nonzero().squeeze(1)
    max_q, max_k, holes = torch.stack((q_lens.max(), k_lens.max(), holes_t.to(k_lens.dtype))).tolist()
    return _Ragged(q_index, k_index, keys, _cumulative(q_lens), _cumulative(k_lens), max_q, max_k, bool(holes))


def _packed_plan(doc_ids: torch.Tensor) -> _Ragged | None:
    """Plan for transformers' (batch, n) packed-sequence ids (a document starts where the id changes,
    and at every row start); None when each row is one document."""
    batch, n = doc_ids.shape
    starts = torch.ones(batch, n, dtype=torch.bool, device=doc_ids.device)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = starts.flatten().nonzero().squeeze(1)
    if first.numel() == batch:
        return None
    bounds = torch.cat((first, first.new_full((1,), batch * n))).to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    return _Ragged(None, None, n, bounds, bounds, longest, longest)


def _window(sliding_window: int | None, causal: bool) -> tuple[int, int]:
    if sliding_window is None or sliding_window <= 0:
        return (-1, -1)
    w = int(sliding_window)
    return (w - 1, 0) if causal else (w - 1, w - 1)


def _run_ragged(q, k, v, plan: _Ragged, opts: dict) -> torch.Tensor:
    from flashtile import flash_attn_varlen_func

    b, nq, hq, d = q.shape
    qf = q.reshape(b * nq, hq, d)
    kf = k[:, :plan.keys].reshape(b * plan.keys, *k.shape[2:])
    vf = v[:, :plan.keys].reshape(b * plan.keys, *v.shape[2:])
    if plan.q_index is not None:
        qf = qf.index_select(0, plan.q_index)
    if plan.k_index is not None:
        kf, vf = kf.index_select(0, plan.k_index), vf.index_select(0, plan.k_index)
    out = flash_attn_varlen_func(qf, kf, vf, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, **opts)
    if plan.q_index is not None:
        out = out.new_zeros(b * nq, hq, out.shape[-1]).index_copy(0, plan.q_index, out)
    return out.view(b, nq, hq, -1)


def _given_plan(kwargs: dict, nk: int) -> _Ragged | None:
    """transformers' FlashAttentionKwargs (cu_seq_lens_q/k, max_length_q/k over the flattened batch)."""
    if kwargs.get("cu_seq_lens_q") is None:  # the usual call: checked first, without building the list
        return None
    given = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    if any(x is None for x in given):
        return None
    cu_q, cu_k, max_q, max_k = given
    return _Ragged(None, None, nk, cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k))


def _dense(q, k, v, mask, dropout, scaling, softcap) -> torch.Tensor:
    from flashtile import scaled_dot_product_attention

    if softcap:
        raise NotImplementedError("softcap with a 4-D attention_mask: flashtile's masked (SDPA) path has no softcap")
    if mask.dtype not in (torch.bool, q.dtype):
        mask = mask.to(q.dtype)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask[..., : k.shape[2]], dropout_p=dropout, scale=scaling,
                                       enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def flashtile_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface function: query (B, Hq, Nq, d), key / value (B, Hk, Nk, d)
    -> ((B, Nq, Hq, d), None).  See the module docstring for the cases."""
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{name} ({_UNSUPPORTED_KWARGS[name]}) is not supported by flashtile's "
                                      "attention; use another attn_implementation for this model")
    if kwargs.get("block_table") is not None and kwargs.get("k_cache") is not None:
        raise NotImplementedError("block_table with k_cache / v_cache (transformers' paged continuous batching) "
                                  "is not supported by flashtile's integration")
    if kwargs.get("output_attentions", False):
        _warn_once("flashtile attention does not return attention weights (output_attentions=True gives None); "
                   "use attn_implementation='eager' for them")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    d, dv = query.shape[-1], value.shape[-1]
    if dv < d:  # the kernels need value's head dim = query's (e.g. MLA): pad, then crop the output
        value = torch.nn.functional.pad(value, (0, d - dv))
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        return _dense(query, key, value, attention_mask, dropout, scaling, softcap)[..., :dv], None

    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if _all_written(attention_mask):  # views of the written slots: the fixed-length or decode kernels, no plan
        slots = attention_mask.shape[1]
        k, v, attention_mask = k[:, :slots], v[:, :slots], None
    b, nq, nk = q.shape[0], q.shape[1], k.shape[1]
    opts = dict(dropout_p=float(dropout), softmax_scale=scaling, causal=causal,
                window_size=_window(sliding_window, causal), softcap=float(softcap or 0.0))
    if isinstance(attention_mask, _PackedMask):
        if (b, nq, nk) != (attention_mask.batch, attention_mask.n, attention_mask.n):
            raise ValueError(f"packed-sequence plan covers batch {attention_mask.batch} x {attention_mask.n} tokens, "
                             f"got batch {b} with {nq} queries and {nk} keys")
        plan = attention_mask.plan
    elif attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != b:
            raise ValueError(f"attention_mask must be a 2-D (batch={b}, keys) padding mask or a 4-D mask, "
                             f"got shape {tuple(attention_mask.shape)}")
        windowed = opts["window_size"] != (-1, -1)
        plan = _mask_plan(attention_mask, causal, nq, nk, windowed)
        if windowed and plan.holes:
            dense = _padding_to_dense(attention_mask, nq, nk, causal, opts["window_size"])
            return _dense(query, key, value, dense, dropout, scaling, softcap)[..., :dv], None
    else:
        plan = _given_plan(kwargs, nk)
    if plan is None and _decoding_step(module, q, k, v, dropout):
        from flashtile import flash_attn_with_kvcache

        out = flash_attn_with_kvcache(q, k, v, causal=causal, softmax_scale=scaling, window_size=opts["window_size"],
                                      softcap=opts["softcap"])
    elif plan is None:
        from flashtile import flash_attn_func

        out = flash_attn_func(q, k, v, **opts)
    else:
        out = _run_ragged(q, k, v, plan, opts)
    return (out if dv == d else out[..., :dv]), None


# keyword arguments of transformers' attention functions that change the scores: refused rather than dropped
_UNSUPPORTED_KWARGS = {"s_aux": "attention sinks", "sinks": "attention sinks", "position_bias": "an additive bias",
                       "indices": "sparse key selection", "topk_indices": "sparse key selection"}

_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        import warnings

        warnings.warn(message, stacklevel=3)


_DECODE_MAX_Q = 16  # query tokens the split-KV decode kernel packs into one row tile per kv head


def _decoding_step(module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> bool:
    """Whether a (B, Nq, H, d) call without a mask runs the decode kernel: a few query tokens against a
    non-empty cache with unit stride on d, an attention module in eval mode and no dropout, no gradient (the
    decode op is inference-only), and eager (``flash_attn_func`` is the op ``torch.compile`` traces).  The
    tracing test comes first: under ``torch.compile`` / ``torch.export`` the size tests below would add guards
    on the query and key counts (an export with a dynamic sequence length then fails its range constraints)."""
    if torch.compiler.is_compiling() or getattr(module, "training", False):
        return False
    if q.shape[1] > _DECODE_MAX_Q or k.shape[1] == 0 or dropout or k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    return not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))


_MASK_CODES: tuple | None = None  # (codes of the mask functions expressed here, packed_sequence_mask_function's)


def _mask_codes() -> tuple:
    global _MASK_CODES
    if _MASK_CODES is None:
        from transformers import masking_utils as mu

        made = [lambda: mu.causal_mask_function, lambda: mu.bidirectional_mask_function,
                lambda: mu.and_masks(mu.causal_mask_function), lambda: mu.sliding_window_overlay(1),
                lambda: mu.sliding_window_bidirectional_overlay(1),
                lambda: mu.remap_positions_for_packed_sequence(mu.causal_mask_function, None)]
        known = set()
        for make in made:
            try:
                known.add(make().__code__)
            except AttributeError:  # an older transformers without it: such masks go dense
                pass
        try:
            packed = mu.packed_sequence_mask_function(None).__code__
            known.add(packed)
        except AttributeError:
            packed = None
        _MASK_CODES = (frozenset(known), packed)
    return _MASK_CODES


def _read_mask_function(fn) -> tuple[bool, torch.Tensor | None]:
    """(whether every function composed into ``fn`` is causal / bidirectional / sliding / packing, which the
    kernels express; transformers' packed-sequence ids where it packs documents, else None)."""
    known, packed_code = _mask_codes()
    packed, todo = None, [fn]
    while todo:
        f = todo.pop()
        code = getattr(f, "__code__", None)
        if code not in known:
            return False, None
        for cell in f.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if code is packed_code:
                packed = value
            elif isinstance(value, (tuple, list)):
                todo.extend(x for x in value if callable(x))
            elif callable(value):
                todo.append(value)
    return True, packed


def flashtile_mask(*args, attention_mask: torch.Tensor | None = None, kv_length: int | None = None,
                   use_vmap: bool = False, mask_function=None, **kwargs):
    """transformers' mask-interface function: a view of the 2-D (batch, keys) padding mask's last
    ``kv_length`` columns, or None when no key is padded (the attention function then runs the fixed-length
    kernel; causal and sliding windows are the kernels' own); where transformers packs documents (no 2-D
    mask, no cache, ``position_ids`` restarting), their ragged plan.  Any other mask function (``use_vmap``:
    a model's ``or``/``and`` overlays; block-wise, chunked or unknown ones) gets transformers' dense SDPA
    mask, which the attention function runs through the masked path."""
    expressible, packed = (True, None) if mask_function is None else _read_mask_function(mask_function)
    if use_vmap or not expressible or (packed is not None and attention_mask is not None):
        from transformers.masking_utils import sdpa_mask

        if mask_function is not None:
            kwargs["mask_function"] = mask_function
        return sdpa_mask(*args, attention_mask=attention_mask, kv_length=kv_length, use_vmap=use_vmap,
                         **{**kwargs, "allow_is_causal_skip": False})
    if packed is not None:
        plan = _packed_plan(packed.to(kwargs.get("device") or packed.device))
        return None if plan is None else _PackedMask(packed.shape[0], packed.shape[1], plan)
    if attention_mask is None:
        written = _written_slots(args, kwargs, kv_length)
        if written is None:
            return None
        if written < 0:  # a static cache's fill level is a traced tensor: transformers' dense mask
            from transformers.masking_utils import sdpa_mask

            if mask_function is not None:
                kwargs["mask_function"] = mask_function
            return sdpa_mask(*args, attention_mask=None, kv_length=kv_length, use_vmap=use_vmap,
                             **{**kwargs, "allow_is_causal_skip": False})
        # no padding, but key slots past the written ones (a static cache): an all-ones mask of the written slots (a
        # tensor: generate() hands it back to the mask functions), marked so that the layers attend those keys' views
        batch = _mask_arg(args, kwargs, "batch_size", 0)
        written_mask = _own(torch.ones(batch, written, dtype=torch.bool, device=kwargs.get("device")))
        if not torch.compiler.is_compiling():
            _PLANS[id(written_mask)][1]["written"] = True
        return written_mask
    attention_mask = attention_mask[:, -kv_length:] if kv_length is not None else attention_mask[:, :]
    if (kv_length is None or attention_mask.shape[1] == kv_length) and bool(attention_mask.all()):
        return None
    return _own(attention_mask)


_MASK_ARGS = ("batch_size", "q_length", "kv_length", "q_offset", "kv_offset")  # sdpa_mask's leading parameters


def _mask_arg(args: tuple, kwargs: dict, name: str, default):
    i = _MASK_ARGS.index(name)
    return args[i] if len(args) > i else kwargs.get(name, default)


def _written_slots(args: tuple, kwargs: dict, kv_length: int | None) -> int | None:
    """Key slots holding tokens when a mask call covers more (``kv_length``: a static cache's capacity): their
    count, None when every slot is written (or unknown), -1 when the fill level is a tensor being traced."""
    q_length, q_offset = _mask_arg(args, kwargs, "q_length", None), _mask_arg(args, kwargs, "q_offset", 0)
    kv_offset = _mask_arg(args, kwargs, "kv_offset", 0)
    if kv_length is None or q_length is None:
        return None
    if isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor):
        if torch.compiler.is_compiling():
            return -1
        q_offset, kv_offset = int(q_offset), int(kv_offset)  # one host read, as the padding plan's
    written = int(q_offset) + int(q_length) - int(kv_offset)
    return written if 0 < written < kv_length else None


def _guard_flash_preload() -> None:
    """transformers >= 5 pre-loads a flash-attn build at model init for every implementation name
    containing "flash"; for the names registered here, hand it flashtile's functions instead."""
    try:
        from transformers import modeling_utils
    except ImportError:
        return
    original = getattr(modeling_utils, "lazy_import_flash_attention", None)
    if original is None or getattr(original, "_flashtile_guard", False):
        return

    def lazy_import_flash_attention(implementation, *args, **kwargs):
        if implementation in _REGISTERED:
            import flashtile

            fns = (flashtile.flash_attn_func, getattr(flashtile, "flash_attn_varlen_func", None),
                   flashtile.flash_attn_with_kvcache, None, None)
            return fns, (dict, dict)
        return original(implementation, *args, **kwargs)

    lazy_import_flash_attention._flashtile_guard = True
    modeling_utils.lazy_import_flash_attention = lazy_import_flash_attention


def register(name: str = NAME) -> None:
    """Register flashtile as ``attn_implementation=name`` (default "flashtile") with transformers'
    ``AttentionInterface`` and ``AttentionMaskInterface``.  Idempotent; done on import for "flashtile"."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    with _LOCK:
        _REGISTERED.add(name)
    AttentionInterface.register(name, flashtile_attention_forward)
    AttentionMaskInterface.register(name, flashtile_mask)
    _guard_flash_preload()


register()
