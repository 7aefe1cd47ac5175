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
  cache works; a static cache's unused tail (keys past the mask) is never read.
* packed sequences: no mask, ``position_ids`` restarting inside a row (a new document wherever a
  position is not its predecessor + 1, transformers' rule) -> one ragged batch, document by
  document, through the varlen function; ``cu_seq_lens_q/k`` + ``max_length_q/k`` keyword arguments
  (transformers' ``FlashAttentionKwargs``, e.g. from ``DataCollatorWithFlattening``) are used as
  given, with no device read.
* a 4-D mask (a model's own mask, or mask functions that are not causal / sliding / padding): the
  dense mask through :func:`flashtile.scaled_dot_product_attention`.

The ragged plans (indices, cumulative lengths, max lengths: one host read each) are computed once
per mask / ``position_ids`` tensor and reused by every layer of the forward (keyed on the tensor's
identity and version counter).

Window convention: transformers' causal ``sliding_window = w`` lets query i see keys
``i - w < j <= i`` (w keys, itself included), which is flash-attn's ``window_size=(w - 1, 0)``;
its bidirectional window ``|i - j| <= w`` is ``(w, w)``.  ``scaling``, ``softcap`` and ``dropout``
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


# (kind, id(tensor), nq, nk) -> (weakref to the tensor, its version, plan); the layers of one forward share them
_PLANS: dict = {}
_PLAN_SLOTS = 16


def _memo(kind: str, t: torch.Tensor, nq: int, nk: int, build):
    if t.is_inference() or torch.compiler.is_compiling():  # no version counter / no host reads to save
        return build()
    key = (kind, id(t), nq, nk)
    hit = _PLANS.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    plan = build()
    with _LOCK:
        if len(_PLANS) >= _PLAN_SLOTS:
            _PLANS.clear()
        _PLANS[key] = (weakref.ref(t), t._version, plan)
    return plan


def _cumulative(lens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))


def _padding_plan(mask: torch.Tensor, nq: int, nk: int, causal: bool = True) -> _Ragged:
    """Plan for a (B, L) padding mask (nonzero = real token) over nk cached keys and the last nq queries.

    Not causal (an encoder, or cross-attention, where the mask is the *keys'* and the queries are
    another sequence): the mask selects keys only and every query row is kept, as SDPA does."""
    mask = mask.bool()
    if mask.shape[1] > nk:  # the mask covers more than this layer keeps (a sliding cache): its last nk columns
        mask = mask[:, -nk:]
    keys = mask.shape[1]  # a static cache's slots past the mask are unused
    if not causal:
        k_lens = mask.sum(1, dtype=torch.int32)
        q_lens = torch.full_like(k_lens, nq)
        max_k = int(k_lens.max())
        return _Ragged(None, mask.flatten().nonzero().squeeze(1), keys, _cumulative(q_lens), _cumulative(k_lens),
                       nq, max_k)
    if nq > keys:
        raise ValueError(
            f"attention_mask covers {keys} keys but there are {nq} queries: the mask must cover every query token"
        )
    q_mask = mask[:, keys - nq:]
    k_lens = mask.sum(1, dtype=torch.int32)
    k_index = mask.flatten().nonzero().squeeze(1)
    if nq == keys:
        q_lens, q_index = k_lens, k_index
    else:
        q_lens = q_mask.sum(1, dtype=torch.int32)
        q_index = q_mask.flatten().nonzero().squeeze(1)
    max_q, max_k = torch.stack((q_lens.max(), k_lens.max())).tolist()
    return _Ragged(q_index, k_index, keys, _cumulative(q_lens), _cumulative(k_lens), max_q, max_k)


def _packed_plan(position_ids: torch.Tensor, batch: int, n: int) -> _Ragged | None:
    """Plan for documents packed along each row (a document starts where a position is not its
    predecessor + 1, and at every row start); None when each row is one document."""
    pos = position_ids.expand(batch, n)
    starts = torch.ones(batch, n, dtype=torch.bool, device=pos.device)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
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
    return (w - 1, 0) if causal else (w, w)


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
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("s_aux (attention sinks) is not supported by flashtile")
    if kwargs.get("block_table") is not None and kwargs.get("k_cache") is not None:
        raise NotImplementedError("block_table with k_cache / v_cache (transformers' paged continuous batching) "
                                  "is not supported by flashtile's integration")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    d, dv = query.shape[-1], value.shape[-1]
    if dv < d:  # the kernels need value's head dim = query's (e.g. MLA): pad, then crop the output
        value = torch.nn.functional.pad(value, (0, d - dv))
    if attention_mask is not None and attention_mask.dim() == 4:
        return _dense(query, key, value, attention_mask, dropout, scaling, softcap)[..., :dv], None

    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    b, nq, nk = q.shape[0], q.shape[1], k.shape[1]
    opts = dict(dropout_p=float(dropout), softmax_scale=scaling, causal=causal,
                window_size=_window(sliding_window, causal), softcap=float(softcap or 0.0))
    plan = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be a 2-D (batch, keys) padding mask or a 4-D mask, "
                             f"got shape {tuple(attention_mask.shape)}")
        plan = _memo("pad" if causal else "pad-keys", attention_mask, nq, nk,
                     lambda: _padding_plan(attention_mask, nq, nk, causal))
    else:
        plan = _given_plan(kwargs, nk)
        position_ids = kwargs.get("position_ids")
        if plan is None and position_ids is not None and nq == nk > 1:
            plan = _memo("packed", position_ids, nq, nk, lambda: _packed_plan(position_ids, b, nq))
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


def flashtile_mask(*args, attention_mask: torch.Tensor | None = None, kv_length: int | None = None,
                   use_vmap: bool = False, **kwargs) -> torch.Tensor | None:
    """transformers' mask-interface function: the 2-D (batch, keys) padding mask, its last
    ``kv_length`` columns, or None when no key is padded (the attention function then runs the
    fixed-length kernel; causal and sliding windows are the kernels' own).  Mask functions that are
    not causal / sliding / padding / packing (``use_vmap``: a model's ``or``/``and`` overlays) get
    transformers' dense SDPA mask, which the attention function runs through the masked path."""
    if use_vmap:
        from transformers.masking_utils import sdpa_mask

        return sdpa_mask(*args, attention_mask=attention_mask, kv_length=kv_length, use_vmap=True,
                         **{**kwargs, "allow_is_causal_skip": False})
    if attention_mask is None:
        return None
    if kv_length is not None:
        attention_mask = attention_mask[:, -kv_length:]
    if (kv_length is None or attention_mask.shape[1] == kv_length) and bool(attention_mask.all()):
        return None
    return attention_mask


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
