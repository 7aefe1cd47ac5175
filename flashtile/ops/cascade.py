"""Shared-prefix (cascade) decoding and the LSE merge of two attention states.

Many requests that share a prompt prefix (a system prompt, few-shot examples, a document)
attend to the same prefix keys.  Decoding them as independent requests reads the prefix's
KV once per request; :func:`cascade_attention_with_kvcache` reads it once for all of them:

1. **prefix**: the queries of all B requests become the rows of *one* batch element
   (``q.reshape(1, B·Nq, Hq, d)``), so the split-KV decode kernel packs
   ``B · Nq · Hq / Hk`` rows per kv head into its row tiles (a flat GEMM against the
   shared pages, read once per row tile instead of once per request), with no mask:
   every query token sees the whole prefix;
2. **suffix**: each request against its own cache, exactly
   :func:`~flashtile.ops.kvcache.flash_attn_with_kvcache` (append, causal, splits, paging);
3. **merge**: the two states of every query row combine by
   :func:`merge_attention_states` (one Triton kernel).

The result is attention over ``prefix ++ own cache`` (``docs/decoding.md``, "Shared-prefix
(cascade) decoding"; float64 twin :func:`flashtile.reference.decoding.cascade_decoding`).
Both decode launches and the merge are graph-capturable and read no value on the host.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton

from flashtile.kernels.merge import _merge_states_kernel
from flashtile.ops import validate
from flashtile.ops.kvcache import flash_attn_with_kvcache
from flashtile.runtime.common import on_tensor_device
from flashtile.runtime.launch import KernelLauncher

__all__ = ["merge_attention_states", "cascade_attention_with_kvcache"]

_MERGE_ELEMENTS = 1024  # rows x BLOCK_D a program merges: ptxas (sm_90a, 4 warps) spills from 2048 (bf16, d = 128)


def _check_state(o: object, lse: object, on: str, ln: str) -> None:
    if not isinstance(o, torch.Tensor):
        raise TypeError(f"{on} must be a torch.Tensor, got {type(o).__name__}")
    validate.check_dense(o, on)
    validate.check_has_data(o, on)
    if o.dtype not in validate.SUPPORTED_DTYPES:
        raise TypeError(f"{on} must have dtype torch.float16, torch.bfloat16 or torch.float32, got {o.dtype}")
    if o.dim() != 4 or not 1 <= o.shape[-1] <= validate.MAX_HEAD_DIM:
        raise ValueError(f"{on} must be 4-D (batch, seqlen, nheads, head_dim), head_dim <= {validate.MAX_HEAD_DIM}, "
                         f"got shape {tuple(o.shape)}")
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"{ln} must be a torch.Tensor, got {type(lse).__name__}")
    validate.check_dense(lse, ln)
    if lse.dtype != torch.float32:
        raise TypeError(f"{ln} must have dtype torch.float32, got {lse.dtype}")
    b, n, h, _ = o.shape
    if tuple(lse.shape) != (b, h, n):
        raise ValueError(f"{ln} must have shape (batch, nheads, seqlen) = {(b, h, n)} to match {on}, got {tuple(lse.shape)}")
    if lse.device != o.device:
        raise ValueError(f"{ln} must be on the device of {on} ({o.device}), got {lse.device}")


@functools.lru_cache(maxsize=256)
def _merge_launcher(rows: int, d: int, strides: tuple, dims: tuple, device: torch.device, dtype: torch.dtype):
    block_d = max(16, triton.next_power_of_2(d))
    block_r = max(1, _MERGE_ELEMENTS // block_d)
    return KernelLauncher(
        _merge_states_kernel, (triton.cdiv(rows, block_r),), (*strides, *dims, block_r, block_d),
        dict(num_warps=4), check=range(6),
    )


@on_tensor_device
def _merge(o1, lse1, o2, lse2):
    b, n, h, d = o1.shape
    out = torch.empty((b, n, h, d), dtype=o1.dtype, device=o1.device)
    lse = torch.empty((b, h, n), dtype=torch.float32, device=o1.device)
    if out.numel() == 0:
        return out, lse
    strides = (*o1.stride()[:3], *lse1.stride(), *o2.stride()[:3], *lse2.stride(), *out.stride()[:3], *lse.stride())
    launch = _merge_launcher(b * n * h, d, strides, (n, h, d, b * n * h), o1.device, o1.dtype)
    launch(o1, lse1, o2, lse2, out, lse)
    return out, lse


def merge_attention_states(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states of the same query rows over disjoint key sets: ``(o, lse)``.

    ``o1``, ``o2`` (B, N, H, d) (flash-attn layout; fp16, bf16 or fp32, one dtype, any strides
    with unit stride on d, else copied), ``lse1``, ``lse2`` (B, H, N) float32 natural-log LSEs as
    :func:`flash_attn_with_kvcache` / ``flash_attn_func`` return them (any strides).  Returns
    ``o = (e^{lse1} o1 + e^{lse2} o2) / (e^{lse1} + e^{lse2})`` in o1's dtype and
    ``lse = logaddexp(lse1, lse2)`` float32, computed against ``max(lse1, lse2)`` (no overflow for
    any difference).  A state with LSE -inf (no key) weighs 0; both -inf: o = 0, lse = -inf.
    LSEs must not be NaN or +inf (not checked: reading them would be a device sync).  One Triton
    kernel, no host sync, CUDA-graph capturable; float64 twin
    :func:`flashtile.reference.decoding.merge_partials` (two partials).
    """
    _check_state(o1, lse1, "o1", "lse1")
    _check_state(o2, lse2, "o2", "lse2")
    if o2.shape != o1.shape:
        raise ValueError(f"o2 shape {tuple(o2.shape)} must equal o1 shape {tuple(o1.shape)}")
    if o2.dtype != o1.dtype:
        raise TypeError(f"o1 and o2 must have the same dtype, got {o1.dtype} and {o2.dtype}")
    if o2.device != o1.device:
        raise ValueError(f"o2 must be on the device of o1 ({o1.device}), got {o2.device}")
    validate.check_qkv_tensors(("o1",), o1)  # a CPU tensor needs the interpreter
    o1 = o1 if o1.stride(-1) == 1 else o1.contiguous()
    o2 = o2 if o2.stride(-1) == 1 else o2.contiguous()
    return _merge(o1, lse1, o2, lse2)


def _check_prefix(q, prefix_k_cache, prefix_v_cache, k_cache, prefix_block_table) -> None:
    """The prefix caches in the suffix caches' layout, for batch 1, checked under their own names (the inner call
    would say k_cache / v_cache)."""
    if isinstance(k_cache, torch.Tensor) and k_cache.dtype == torch.float8_e4m3fn:
        raise TypeError("cascade_attention_with_kvcache takes float16, bfloat16 or float32 caches, not float8_e4m3fn")
    for name, x in (("prefix_k_cache", prefix_k_cache), ("prefix_v_cache", prefix_v_cache)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (1, prefix_len, nheads_k, head_dim) or paged "
                             f"(num_pages, page_size, nheads_k, head_dim), got shape {tuple(x.shape)}")
        if isinstance(k_cache, torch.Tensor) and k_cache.dim() == 4 and x.shape[2:] != k_cache.shape[2:]:
            raise ValueError(f"{name} must have k_cache's (nheads_k, head_dim) = {tuple(k_cache.shape[2:])}, "
                             f"got {tuple(x.shape[2:])}")
        if isinstance(k_cache, torch.Tensor) and x.dtype != k_cache.dtype:
            raise TypeError(f"{name} must have the dtype of k_cache ({k_cache.dtype}), got {x.dtype}")
        validate.check_dense(x, name)
        if isinstance(q, torch.Tensor) and x.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {x.device}")
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on head_dim")
    if prefix_k_cache.shape != prefix_v_cache.shape:
        raise ValueError(f"prefix_k_cache shape {tuple(prefix_k_cache.shape)} must equal prefix_v_cache shape "
                         f"{tuple(prefix_v_cache.shape)}")
    if prefix_block_table is None and prefix_k_cache.shape[0] != 1:
        raise ValueError(f"prefix_k_cache must have batch 1 (one prefix shared by every request), "
                         f"got shape {tuple(prefix_k_cache.shape)}")
    if prefix_block_table is not None and (
        not isinstance(prefix_block_table, torch.Tensor) or prefix_block_table.dim() != 2 or prefix_block_table.shape[0] != 1
    ):
        raise ValueError("prefix_block_table must be an int32 tensor of shape (1, max_pages) (one shared prefix)")


def cascade_attention_with_kvcache(
    q: torch.Tensor,
    prefix_k_cache: torch.Tensor,
    prefix_v_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | int | None = None,
    *,
    prefix_seqlen: torch.Tensor | int | None = None,
    prefix_block_table: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    softcap: float = 0.0,
    num_splits: int = 0,
    prefix_num_splits: int = 0,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decoding for B requests that share one prefix: attention of q over ``prefix ++ own cache``.

    ``q`` (B, Nq, Hq, d).  The shared prefix: ``prefix_k_cache`` / ``prefix_v_cache``
    (1, P_max, Hk, d), or paged (num_pages, page_size, Hk, d) with ``prefix_block_table``
    (1, max_pages) int32 (the pages may live in the same pool as the requests' own pages);
    ``prefix_seqlen`` its length (an int, a (1,) int32/int64 tensor, or None = its capacity).
    Each request's own tokens: ``k_cache`` / ``v_cache`` / ``k`` / ``v`` / ``cache_seqlens`` /
    ``block_table`` exactly as :func:`flash_attn_with_kvcache` (the new k, v are appended to the
    request's own cache, in place).  Request b attends to the P prefix keys, then keys
    ``[0, cache_seqlens[b] + Nnew)`` of its own cache.

    Masks: every query token sees the whole prefix; ``causal`` applies to the own part,
    bottom-right aligned as flash-attn (the same mask as on the concatenated sequence when each
    request's own length is at least Nq, as in decoding).  ``softcap`` and ``softmax_scale``
    apply to both parts.  Windows and ALiBi, which would depend on the prefix position, are
    not offered.  ``num_splits`` / ``prefix_num_splits``: the split counts (0 = heuristic) of
    the two decode launches.  Returns ``out`` (B, Nq, Hq, d) in q's dtype, and with
    ``return_lse`` also ``lse`` (B, Hq, Nq) float32.  Three launches (prefix, suffix with its
    append, merge), no host sync, CUDA-graph capturable.
    """
    _check_prefix(q, prefix_k_cache, prefix_v_cache, k_cache, prefix_block_table)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4-D tensor (batch, seqlen, nheads, head_dim), got {getattr(q, 'shape', q)}")
    if isinstance(prefix_seqlen, np.integer):
        prefix_seqlen = int(prefix_seqlen)
    if isinstance(prefix_seqlen, bool) or not (prefix_seqlen is None or isinstance(prefix_seqlen, (int, torch.Tensor))):
        raise TypeError(f"prefix_seqlen must be an int, a (1,) int32 / int64 tensor or None, got "
                        f"{type(prefix_seqlen).__name__}")
    if isinstance(prefix_seqlen, torch.Tensor) and (tuple(prefix_seqlen.shape) != (1,)
                                                    or prefix_seqlen.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"prefix_seqlen must be an int or a (1,) int32 / int64 tensor, got shape "
                         f"{tuple(prefix_seqlen.shape)} and dtype {prefix_seqlen.dtype}")
    if isinstance(prefix_seqlen, int):
        cap = prefix_k_cache.shape[1] * (1 if prefix_block_table is None else prefix_block_table.shape[1])
        if not 0 <= prefix_seqlen <= cap:
            raise ValueError(f"prefix_seqlen = {prefix_seqlen} must lie in [0, {cap}] (the prefix cache's capacity)")
    b, nq, hq, d = q.shape
    # every request's rows as one batch element: its rows share each prefix tile the kernel loads;
    # first, as it writes nothing: a bad prefix argument raises before the own caches are appended to
    out_p, lse_p = flash_attn_with_kvcache(
        q.reshape(1, b * nq, hq, d), prefix_k_cache, prefix_v_cache, cache_seqlens=prefix_seqlen,
        block_table=prefix_block_table, softmax_scale=softmax_scale, causal=False, softcap=softcap,
        num_splits=prefix_num_splits, return_lse=True,
    )
    out_s, lse_s = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table, softmax_scale=softmax_scale,
        causal=causal, softcap=softcap, num_splits=num_splits, return_lse=True,
    )
    out, lse = _merge(out_s, lse_s, out_p.view(b, nq, hq, d), lse_p.view(hq, b, nq).permute(1, 0, 2))
    return (out, lse) if return_lse else out
