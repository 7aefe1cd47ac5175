"""flash-attn compatible functions: ``flash_attn_func`` and its packed variants.

Same call signatures as ``flash_attn.flash_attn_func`` (flash-attn 2.x), on
the (batch, seqlen, heads, head_dim) layout, computing the function defined in
:mod:`flashtile.reference.masks` (FA2 paper, Algorithm 1 forward, Algorithm 2
backward):

    S = softmax_scale * Q K^T, softcap, ALiBi, window / causal (bottom-right),
    L = logsumexp(S) per row,  O = dropout(exp(S - L)) V.

Additions to flash-attn: ``return_lse=True`` returns ``(out, lse)``, and
``block_mask`` adds block-sparse attention (FA1 paper, Algorithm 5).
``return_attn_probs=True`` returns flash-attn's ``(out, softmax_lse, S_dmask)``
with ``S_dmask = None``: FlashAttention never materialises the Nq x Nk
matrix, and flash-attn itself fills it only for testing, with dropout
(``return_softmax and dropout_p > 0``), documenting it as not guaranteed to
have the right scaling.  As in flash-attn, ``causal=True`` sets the right
window bound to 0 (a right bound given with it is ignored), and
``window_size`` may be a 2-element integer tensor.  One convention differs
on purpose: a query row that sees no key has LSE ``-inf`` here (the log of
an empty sum, which merges correctly with other splits), ``+inf`` in
flash-attn.  Dropout draws its Philox seed from torch's default generator,
so ``torch.manual_seed`` makes it reproducible.
"""

from __future__ import annotations

import torch

from flashtile.ops import validate
from flashtile.ops.autograd import attention
from flashtile.reference.masks import BlockMask

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func"]


def _check_flag(x: object, name: str) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(x).__name__}")
    return x


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    names: tuple[str, str, str],
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    return_attn_probs: bool,
    return_lse: bool,
    block_mask: BlockMask | None,
    descales: tuple = (None, None, None),
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Validate every argument (naming it as the caller knows it), then run the op."""
    if isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn:
        return _run_fp8(q, k, v, names, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                        deterministic, return_attn_probs, return_lse, block_mask, descales)
    for name, ds in zip(("q_descale", "k_descale", "v_descale"), descales):
        if ds is not None:
            raise ValueError(f"{name} is for float8_e4m3fn {names[0]}, {names[1]}, {names[2]} (FP8 attention); "
                             f"{names[0]} is {getattr(q, 'dtype', type(q).__name__)}")
    validate.check_qkv_tensors(names, q, k, v)
    dims = validate.check_dims(q, k, v, seq_major=True, names=names)
    window = validate.unbind_window(*validate.check_window(causal, window_size), dims.seqlen_q, dims.seqlen_k)
    scale = validate.check_softmax_scale(softmax_scale, dims.head_dim)
    softcap = validate.check_softcap(softcap)
    dropout_p = validate.check_dropout(dropout_p)
    if alibi_slopes is not None:
        validate.check_alibi(alibi_slopes, q, dims)
    if block_mask is not None:
        validate.check_block_mask(block_mask, dims)
    _check_flag(deterministic, "deterministic")
    _check_flag(return_attn_probs, "return_attn_probs")
    _check_flag(return_lse, "return_lse")
    out, lse, _ = attention(
        q, k, v, seq_major=True, softmax_scale=scale, causal=causal, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, block_mask=block_mask, deterministic=deterministic,
    )
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


def _run_fp8(q, k, v, names, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
             return_attn_probs, return_lse, block_mask, descales):
    """FA3's FP8 forward (:mod:`flashtile.ops.fp8_attn`): e4m3 q, k, v, float32 descales, bf16 out."""
    from flashtile.ops.fp8_attn import check_fp8_inputs, fp8_forward

    dims, descales = check_fp8_inputs(names, q, k, v, descales, dropout_p, return_attn_probs)
    window = validate.unbind_window(*validate.check_window(causal, window_size), dims.seqlen_q, dims.seqlen_k)
    scale = validate.check_softmax_scale(softmax_scale, dims.head_dim)
    softcap = validate.check_softcap(softcap)
    if alibi_slopes is not None:
        validate.check_alibi(alibi_slopes, q, dims)
    if block_mask is not None:
        raise ValueError("block_mask is not available with FP8 inputs")
    _check_flag(deterministic, "deterministic")
    _check_flag(return_lse, "return_lse")
    out, lse = fp8_forward(q, k, v, descales, softmax_scale=scale, causal=causal, window=window, softcap=softcap,
                           alibi_slopes=alibi_slopes)
    return (out, lse) if return_lse else out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    return_lse: bool = False,
    block_mask: BlockMask | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Exact attention, FlashAttention-2 kernels (FlashAttention-3's on Hopper GPUs).

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim)
    with nheads a multiple of nheads_k (MQA/GQA: q head h reads kv head
    h // (nheads // nheads_k)); fp16, bf16 or fp32 (fp32 matmuls run in TF32
    on GPU); 1 <= headdim <= 256.

    softmax_scale defaults to 1/sqrt(headdim).  causal / window_size=(left,
    right) are aligned to the bottom-right corner of the score matrix (key j
    is visible to query i iff i + Nk - Nq - left <= j <= i + Nk - Nq + right,
    -1 = unbounded); window_size is a pair of ints or a 2-element integer
    tensor, and causal=True sets right = 0 whatever window_size says (as
    flash-attn does).  softcap > 0 applies s -> softcap * tanh(s / softcap);
    alibi_slopes (nheads,) or (batch, nheads) float32 subtracts
    slope * |i + Nk - Nq - j|.  dropout_p drops attention probabilities after
    the softmax normalisation.  deterministic=True makes the backward
    bitwise reproducible.  block_mask restricts attention to the kept blocks.
    Scalars may be Python or NumPy numbers.

    Returns out (batch, seqlen_q, nheads, headdim); with return_lse,
    (out, lse), lse (batch, nheads, seqlen_q) float32 being the natural-log
    sum-exp of each score row; with return_attn_probs, flash-attn's
    (out, softmax_lse, S_dmask) with S_dmask None (the attention matrix is
    never materialised).  A query row that sees no key has out row 0 and
    lse -inf (flash-attn reports +inf there).

    FP8 (FA3's API, forward only): float8_e4m3fn q, k, v with float32
    q_descale, k_descale, v_descale of shape (batch, nheads_k) (None: 1;
    anything broadcasting to that shape), meaning q ~ q_fp8 * q_descale[b, h_k],
    give a bfloat16 out; see :mod:`flashtile.ops.fp8_attn` for which kernel runs.
    """
    return _run(q, k, v, ("q", "k", "v"), dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_attn_probs, return_lse, block_mask,
                (q_descale, k_descale, v_descale))


def _unpack(x: object, name: str, count: int, layout: str) -> tuple[torch.Tensor, ...]:
    """Views ``x[:, :, 0]``, ``x[:, :, 1]``, ...: gradients flow back into the packed tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dim() != 5 or x.shape[2] != count:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(x.shape)}")
    return x.unbind(dim=2)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    return_lse: bool = False,
    block_mask: BlockMask | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """:func:`flash_attn_func` on qkv (batch, seqlen, 3, nheads, headdim); the gradient is d(qkv)."""
    q, k, v = _unpack(qkv, "qkv", 3, "(batch, seqlen, 3, nheads, headdim)")
    names = ("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]")
    return _run(q, k, v, names, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_attn_probs, return_lse, block_mask)


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    return_lse: bool = False,
    block_mask: BlockMask | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """:func:`flash_attn_func` with kv (batch, seqlen_k, 2, nheads_k, headdim); gradients are dq and d(kv)."""
    k, v = _unpack(kv, "kv", 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    names = ("q", "kv[:, :, 0]", "kv[:, :, 1]")
    return _run(q, k, v, names, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_attn_probs, return_lse, block_mask)
