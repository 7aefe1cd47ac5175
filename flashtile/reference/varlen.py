"""Variable-length (packed) attention in float64: the semantics of ``flash_attn_varlen_func``.

A packed batch stores B sequences back to back: q is (total_q, Hq, d) and sequence b owns
rows ``[cu_seqlens_q[b], cu_seqlens_q[b + 1])``; k and v are (total_k, Hk, d) with
``cu_seqlens_k`` likewise, or paged, (pages, page_size, Hk, d) with ``block_table[b, p]`` the
page holding keys ``p * page_size ...`` of sequence b (whose length is
``cu_seqlens_k[b + 1] - cu_seqlens_k[b]``).  Each sequence is attended on its own with every
option applied to it alone (causal / window bottom-right aligned to *its* lengths, ALiBi
distances inside it), exactly as flash-attn 2.x's varlen API defines it (flash-attn >= 2.1
for the causal alignment).  This twin is that definition read literally: a loop over the
sequences, each one a call of :func:`flashtile.reference.attention.flash_attn2` (FA2 paper,
Algorithm 1), outputs and LSEs packed back; its counts are the sum of the sequences' counts.
"""

from __future__ import annotations

from typing import Callable

import torch

from flashtile.reference._common import AttnResult, IOCounts
from flashtile.reference.attention import flash_attn2

__all__ = ["varlen_attention", "unpack_kv"]


def _bounds(cu_seqlens: torch.Tensor, name: str) -> list[int]:
    cu = [int(x) for x in cu_seqlens.tolist()]
    if len(cu) < 1 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{name} must start at 0 and be non-decreasing, got {cu}")
    return cu


def unpack_kv(
    x: torch.Tensor, cu_seqlens_k: torch.Tensor, b: int, block_table: torch.Tensor | None = None
) -> torch.Tensor:
    """Keys (or values) of sequence ``b`` as (L_b, Hk, d): rows of the packed tensor, or the pages
    ``block_table[b, :ceil(L_b / page_size)]`` of a paged one, concatenated and cut to L_b."""
    cu = _bounds(cu_seqlens_k, "cu_seqlens_k")
    length = cu[b + 1] - cu[b]
    if block_table is None:
        return x[cu[b]:cu[b + 1]]
    page_size = x.shape[1]
    pages = block_table[b, : -(-length // page_size)].long()
    return x[pages].reshape(-1, *x.shape[2:])[:length]


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    algorithm: Callable[..., AttnResult] = flash_attn2,
    **kwargs,
) -> AttnResult:
    """Packed attention: ``out`` (total_q, Hq, d), ``lse`` (Hq, total_q) (flash-attn's varlen layout).

    ``alibi_slopes`` (Hq,) or (B, Hq); ``dropout_mask`` (B, Hq, max_seqlen_q, max_seqlen_k) bool,
    sequence b reading its top-left (L_q, L_k) corner (the kernels' keep-mask layout,
    :func:`flashtile.runtime.common.dropout_keep_mask` with batch B and the max lengths); the other
    keywords (softmax_scale, causal, window_size, softcap, dropout_p, dtype) go to ``algorithm``
    unchanged for every sequence.
    """
    cu_q = _bounds(cu_seqlens_q, "cu_seqlens_q")
    cu_k = _bounds(cu_seqlens_k, "cu_seqlens_k")
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length, got {len(cu_q)} and {len(cu_k)}")
    total_q, hq, d = q.shape
    dtype = kwargs.get("dtype", torch.float64) or q.dtype
    out = torch.zeros(total_q, hq, d, dtype=dtype, device=q.device)
    lse = torch.full((hq, total_q), float("-inf"), dtype=dtype, device=q.device)
    counts = IOCounts()
    for b in range(len(cu_q) - 1):
        q0, q1 = cu_q[b], cu_q[b + 1]
        kb, vb = unpack_kv(k, cu_seqlens_k, b, block_table), unpack_kv(v, cu_seqlens_k, b, block_table)
        if q1 == q0:
            continue
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b : b + 1]
        keep = None if dropout_mask is None else dropout_mask[b : b + 1, :, : q1 - q0, : kb.shape[0]]
        res = algorithm(
            q[q0:q1].transpose(0, 1).unsqueeze(0), kb.transpose(0, 1).unsqueeze(0), vb.transpose(0, 1).unsqueeze(0),
            alibi_slopes=slopes, dropout_mask=keep, **kwargs,
        )
        out[q0:q1] = res.out[0].transpose(0, 1).to(dtype)
        lse[:, q0:q1] = res.lse[0].to(dtype)
        counts = counts + res.counts
    return AttnResult(out, lse, counts)
