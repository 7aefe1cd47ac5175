"""Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on FlashAttention-2 kernels.

Same signature and semantics as torch's SDPA on (batch, heads, seqlen,
head_dim) tensors (3-D (heads, seqlen, head_dim) also accepted):

    out = dropout(softmax(scale * Q K^T + M)) V,   scale = 1/sqrt(E) by default,

with ``M`` from ``attn_mask`` (bool: True = take part, False -> -inf; float:
added) or from ``is_causal``.  Two alignments must be told apart: torch's
``is_causal`` is TOP-LEFT aligned (query i sees keys j <= i, the mask
``ones(L, S).tril(0)``), while the kernels' causal window is bottom-right
aligned (j <= i + Nk - Nq).  The mapping, exact for every Nq, Nk:

* Nq <= Nk: keys j >= Nq are invisible to every row (j <= i <= Nq - 1), so
  attending to ``k[..., :Nq, :]`` with the (now square) causal mask is the
  same function and skips the dead keys; their gradient is 0 by slicing.
* Nq > Nk: the window ``(left, right) = (-1, Nq - Nk)`` gives
  j <= i + (Nk - Nq) + (Nq - Nk) = i.

Limitations against torch: value's head dim must equal query's, dtypes are
fp16 / bf16 / fp32 only, and no gradient flows to ``attn_mask``.
"""

from __future__ import annotations

import torch

from flashtile.ops import validate
from flashtile.ops.autograd import attention

__all__ = ["scaled_dot_product_attention"]


def _as_bias(attn_mask: torch.Tensor, dtype: torch.dtype, full: tuple[int, int, int, int]) -> torch.Tensor:
    """Additive bias, an expanded (B, H, Nq, Nk) view of the mask's own storage (stride 0 on broadcast dims)."""
    if attn_mask.dtype == torch.bool:
        # materialised at the mask's own (unbroadcast) size only
        attn_mask = torch.full(attn_mask.shape, float("-inf"), dtype=dtype, device=attn_mask.device).masked_fill(
            attn_mask, 0.0
        )
    return attn_mask.expand(full)


def _causal_top_left(
    k: torch.Tensor, v: torch.Tensor, nq: int, nk: int
) -> tuple[torch.Tensor, torch.Tensor, bool, tuple[int, int]]:
    """(k, v, causal, window) reproducing torch's top-left ``is_causal`` on the bottom-right kernels.

    With dropout the keep-mask is then that of the sliced (Nq, Nq) problem;
    torch's own dropout pattern cannot be reproduced anyway (another RNG).
    """
    if nq <= nk:
        return k[:, :, :nq], v[:, :, :nq], True, (-1, 0)
    return k, v, False, (-1, nq - nk)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Like ``torch.nn.functional.scaled_dot_product_attention``; returns (B, Hq, Nq, d) (or (Hq, Nq, d)).

    The output is, like that of torch's flash and cuDNN backends, a
    (B, Hq, Nq, d) view of (B, Nq, Hq, d) contiguous storage:
    ``out.transpose(1, 2)`` is contiguous.  Inputs may have any strides (one
    whose head_dim stride is not 1 is copied first).
    Errors name torch's arguments (``query``, ``scale``, ``attn_mask``, ...).

    query (B, Hq, Nq, d), key / value (B, Hk, Nk, d): Hk must equal Hq unless
    ``enable_gqa=True`` (then Hq must be a multiple of Hk and query head h
    reads kv head h // (Hq // Hk), as torch's repeat_interleave does).
    ``attn_mask`` broadcastable to (B, Hq, Nq, Nk) is never expanded in
    memory.  Setting both ``attn_mask`` and ``is_causal`` raises, as in torch.
    Dropout is applied whenever ``dropout_p > 0`` (pass 0.0 in eval, like torch).
    """
    names = ("query", "key", "value")
    validate.check_qkv_tensors(names, query, key, value)
    ndim = query.dim()
    if ndim not in (3, 4) or key.dim() != ndim or value.dim() != ndim:
        raise ValueError(
            "query, key, value must all be 4-D (batch, heads, seqlen, head_dim) or all 3-D (heads, seqlen, head_dim); "
            f"got shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    q, k, v = (x.unsqueeze(0) for x in (query, key, value)) if ndim == 3 else (query, key, value)
    for flag, name in ((is_causal, "is_causal"), (enable_gqa, "enable_gqa")):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool (True or False), got {type(flag).__name__}")
    if not enable_gqa and k.shape[1] != q.shape[1]:
        raise ValueError(
            f"query has {q.shape[1]} heads but key/value have {k.shape[1]}: pass enable_gqa=True for "
            "grouped-query attention (query heads a multiple of key/value heads)"
        )
    dims = validate.check_dims(q, k, v, seq_major=False, names=names)
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal=True cannot both be set: fold the causal mask into attn_mask")
    softmax_scale = validate.check_softmax_scale(scale, dims.head_dim, name="scale")
    dropout_p = validate.check_dropout(dropout_p, name="dropout_p")

    bias = None
    if attn_mask is not None:
        validate.check_attn_mask(attn_mask, query, dims, ndim)
        bias = _as_bias(attn_mask, q.dtype, (dims.batch, dims.heads_q, dims.seqlen_q, dims.seqlen_k))
    causal, window = False, (-1, -1)
    if is_causal:
        k, v, causal, window = _causal_top_left(k, v, dims.seqlen_q, dims.seqlen_k)

    # out is a (B, H, N, d) view of (B, N, H, d) storage, as torch's flash / cuDNN backends return
    # it, so the usual out.transpose(1, 2).reshape(B, N, H * d) that follows copies nothing
    out, _, _ = attention(
        q, k, v, seq_major=False, softmax_scale=softmax_scale, causal=causal, window=window,
        bias=bias, dropout_p=dropout_p,
    )
    return out.squeeze(0) if ndim == 3 else out
