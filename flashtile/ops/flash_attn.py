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
``window_size`` may be a 2-element integer tensor (read back on the host: under
``torch.compile`` a graph break, so ``fullgraph=True`` needs a tuple).  One convention differs
on purpose: a query row that sees no key has LSE ``-inf`` here (the log of
an empty sum, which merges correctly with other splits), ``+inf`` in
flash-attn.  Dropout draws its Philox seed from torch's default generator,
so ``torch.manual_seed`` makes it reproducible.
"""

from __future__ import annotations

import torch

from flashtile.ops import validate
from flashtile.ops.autograd import attention, varlen_attention
from flashtile.reference.masks import BlockMask

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
]


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


def unpack(x: object, name: str, count: int, layout: str, dim: int = 2) -> tuple[torch.Tensor, ...]:
    """Views ``x.select(dim, 0)``, ``x.select(dim, 1)``, ...: gradients flow back into the packed tensor.
    ``dim`` 2 for (batch, seqlen, count, heads, d), 1 for the packed-batch (total, count, heads, d)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dim() != dim + 3 or x.shape[dim] != count:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(x.shape)}")
    return x.unbind(dim=dim)


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
    q, k, v = unpack(qkv, "qkv", 3, "(batch, seqlen, 3, nheads, headdim)")
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
    k, v = unpack(kv, "kv", 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    names = ("q", "kv[:, :, 0]", "kv[:, :, 1]")
    return _run(q, k, v, names, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_attn_probs, return_lse, block_mask)


# --------------------------------------------------------------------------- #
# Packed (variable-length) batches
# --------------------------------------------------------------------------- #
def _run_varlen(
    q, k, v, names, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cu_names, dropout_p, softmax_scale,
    causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table, return_lse, debug,
):
    """Validate a packed call (shapes, dtypes, devices: no value is read unless ``debug``), then run the op."""
    validate.check_qkv_tensors(names, q, k, v)
    paged = block_table is not None
    total_q, hq, hk, total_k, d, page_size = validate.check_varlen_dims(q, k, v, paged=paged, names=names)
    batch = validate.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, names=cu_names)
    max_names = ("max_seqlen_q", "max_seqlen_k") if cu_names[0] == "cu_seqlens_q" else ("max_seqlen", "max_seqlen")
    max_q = validate.check_max_seqlen(max_seqlen_q, max_names[0])
    max_k = validate.check_max_seqlen(max_seqlen_k, max_names[1])
    if total_q > 0 and (batch == 0 or max_q == 0):  # known without reading a value: q rows no sequence covers
        name = cu_names[0] if batch == 0 else max_names[0]
        raise ValueError(f"{name}: q has {total_q} tokens but {cu_names[0]} holds {batch} sequences "
                         f"of at most {max_names[0]} = {max_q} tokens")
    if paged:
        validate.check_block_table(block_table, q, batch)
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            raise ValueError(
                "block_table: the paged (block_table) forward has no backward; call it under torch.no_grad() "
                "or pass q, k, v that do not require grad"
            )
    for flag, name in ((deterministic, "deterministic"), (return_attn_probs, "return_attn_probs"),
                       (return_lse, "return_lse"), (debug, "debug")):
        _check_flag(flag, name)
    if debug:  # the one host read of the call: cu_seqlens (and block_table) values
        validate.check_cu_seqlens_values(
            cu_seqlens_q, cu_seqlens_k, total_q, None if paged else total_k, max_q, max_k,
            block_table=block_table, num_pages=k.shape[0] if paged else 0, page_size=page_size, names=cu_names,
            max_names=max_names,
        )
    # no sequence is longer than its packed tensor (or its block-table row): a larger max only grows the grid
    max_q = min(max_q, total_q)
    max_k = min(max_k, block_table.shape[1] * page_size if paged else total_k)
    window = validate.unbind_window(*validate.check_window(causal, window_size), max_q, max_k)
    scale = validate.check_softmax_scale(softmax_scale, d)
    softcap = validate.check_softcap(softcap)
    dropout_p = validate.check_dropout(dropout_p)
    if alibi_slopes is not None:
        validate.check_alibi(alibi_slopes, q, validate.AttnDims(batch, hq, hk, max_q, max_k, d))
    # the kernels index cu_seqlens and block_table rows with unit strides (no copy when they already are)
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    block_table = block_table.contiguous() if paged else None
    out, lse, _ = varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, softmax_scale=scale, causal=causal, window=window,
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, block_table=block_table,
        deterministic=deterministic,
    )
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    return_lse: bool = False,
    debug: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Exact attention over a packed batch of sequences of different lengths (flash-attn 2.x signature).

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim), or paged
    (num_pages, page_size, nheads_k, headdim) with ``block_table`` (batch, max_pages) int32.
    ``cu_seqlens_q`` / ``cu_seqlens_k``: int32 (batch + 1,) cumulative lengths on q's device;
    sequence b is rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1`` of q, attending to rows
    ``cu_seqlens_k[b] ..`` of k / v (paged: its first ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]``
    keys, key j in page ``block_table[b, j // page_size]``).  ``max_seqlen_q`` / ``max_seqlen_k``:
    ints at least the longest sequence (they size the grid; no host sync reads the lengths).
    Every option of :func:`flash_attn_func` applies per sequence: causal / window bottom-right
    aligned to each sequence's own (L_q, L_k), ALiBi (nheads,) or (batch, nheads), softcap,
    dropout, GQA, deterministic backward.  Zero-length sequences are allowed; a row that sees
    no key gives out 0 and lse -inf (and zero gradients).

    Returns out (total_q, nheads, headdim); with ``return_lse``, (out, lse) and with
    ``return_attn_probs`` (out, softmax_lse, None), lse (nheads, total_q) float32 as flash-attn's.
    ``block_table`` (chunked prefill against a paged cache) is forward only: a ValueError if a
    gradient is required.  Values are not read on the host: the kernels clamp each sequence to
    the packed tensors, to max_seqlen and to the page pool, so no value of cu_seqlens or
    block_table makes them touch memory outside the tensors.  The contract: cu_seqlens starts at
    0, does not decrease and ends at total (non-paged k), lengths <= max_seqlen, visited pages inside
    the pool; the forward kernel records a break in the device error word (the call returns, its
    rows are not meaningful) and ``flashtile.check_errors()`` raises a ValueError naming the
    argument.  ``debug=True`` checks the contract first (one device-to-host copy) and raises.
    """
    return _run_varlen(q, k, v, ("q", "k", "v"), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       ("cu_seqlens_q", "cu_seqlens_k"), dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, deterministic, return_attn_probs, block_table, return_lse, debug)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    return_lse: bool = False,
    debug: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """:func:`flash_attn_varlen_func` on qkv (total, 3, nheads, headdim) with one ``cu_seqlens``; the gradient is d(qkv)."""
    q, k, v = unpack(qkv, "qkv", 3, "(total, 3, nheads, headdim)", dim=1)
    return _run_varlen(q, k, v, ("qkv[:, 0]", "qkv[:, 1]", "qkv[:, 2]"), cu_seqlens, cu_seqlens, max_seqlen,
                       max_seqlen, ("cu_seqlens", "cu_seqlens"), dropout_p, softmax_scale, causal, window_size,
                       softcap, alibi_slopes, deterministic, return_attn_probs, None, return_lse, debug)


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] | torch.Tensor = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    return_lse: bool = False,
    debug: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """:func:`flash_attn_varlen_func` with kv (total_k, 2, nheads_k, headdim); gradients are dq and d(kv)."""
    k, v = unpack(kv, "kv", 2, "(total_k, 2, nheads_k, headdim)", dim=1)
    return _run_varlen(q, k, v, ("q", "kv[:, 0]", "kv[:, 1]"), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k, ("cu_seqlens_q", "cu_seqlens_k"), dropout_p, softmax_scale, causal, window_size,
                       softcap, alibi_slopes, deterministic, return_attn_probs, None, return_lse, debug)
