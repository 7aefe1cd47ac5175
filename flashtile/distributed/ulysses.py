"""All-to-all head parallelism ("Ulysses", Jacobs et al. 2023, DeepSpeed-Ulysses).

Each rank holds a sequence shard (B, N / P, H, d) of q, k, v.  One ``all_to_all_single`` per
tensor trades it for all N tokens of H / P heads; every rank then runs ordinary
:func:`flashtile.flash_attn_func` on its heads over the full sequence (so every option of
``flash_attn_func`` works: dropout, ALiBi, windows, softcap), and one more all-to-all trades the
output back to sequence shards.  The backward is the same exchanges in reverse.  Heads (q and
kv) must be multiples of P.  Traffic: 4 all-to-alls of (B, N / P, H, d) per forward, against
ring attention's P - 1 transfers of the K/V shard (docs/distributed.md compares them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashtile.distributed.plan import LAYOUTS, segments
from flashtile.distributed.ring import _check_agreement
from flashtile.distributed.ring_varlen import SIGNATURE_FIELDS, check_packed, check_zigzag_lengths
from flashtile.distributed.sharding import resolve_group
from flashtile.ops import validate
from flashtile.ops.autograd import philox_stream

__all__ = ["ulysses_flash_attn_func", "ulysses_flash_attn_varlen_func"]


def _a2a(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like keeps a permuted view's strides
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, world: int) -> torch.Tensor:
    """(B, n, H, d) sequence shard -> (B, P n, H / P, d): every rank's shard (rank order) of head group ``rank``."""
    b, n, h, d = x.shape
    parts = x.reshape(b, n, world, h // world, d).permute(2, 0, 1, 3, 4)  # (P: head group, B, n, H / P, d)
    got = _a2a(parts, group)  # (P: source rank, B, n, H / P, d)
    return got.permute(1, 0, 2, 3, 4).reshape(b, world * n, h // world, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, world: int) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`: (B, P n, H / P, d) -> (B, n, H, d)."""
    b, pn, hh, d = x.shape
    n = pn // world
    parts = x.reshape(b, world, n, hh, d).permute(1, 0, 2, 3, 4)  # (P: destination rank, B, n, H / P, d)
    got = _a2a(parts, group)  # (P: head group, B, n, H / P, d)
    return got.permute(1, 2, 0, 3, 4).reshape(b, n, world * hh, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        return _seq_to_heads(x, group, world)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, ctx.world), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        return _heads_to_seq(x, group, world)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group, ctx.world), None, None


def _order(layout: str, world: int, n: int, device) -> torch.Tensor | None:
    """Index of each global position in the rank-order concatenation of the shards (None: identity)."""
    return None if layout == "contiguous" else _packed_order(layout, world, (n,), device)


@torch.compiler.disable
def ulysses_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: object = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    layout: str = "zigzag",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """:func:`flashtile.flash_attn_func` over sequence shards, by all-to-all head parallelism.

    Arguments and results as :func:`~flashtile.distributed.ring_flash_attn_func` (same layouts);
    nheads must be a multiple of the group size P, nheads_k a multiple or a divisor of P (fewer kv heads
    than ranks are repeated before the exchange).  ``alibi_slopes`` ((nheads,) or
    (batch, nheads), all heads) and ``dropout_p`` are supported.  ``torch.compile`` runs it eagerly.
    """
    from flashtile.ops.flash_attn import flash_attn_func

    names = ("q", "k", "v")
    validate.check_qkv_tensors(names, q, k, v)
    dims = validate.check_dims(q, k, v, seq_major=True, names=names)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    pg = resolve_group(group)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    # before any check that depends on shapes: a rank must not raise while the others wait
    _check_agreement(pg, q.device, (dims.batch, dims.seqlen_q, dims.seqlen_k, dims.heads_q, dims.heads_k,
                                    dims.head_dim, LAYOUTS.index(layout), validate.SUPPORTED_DTYPES.index(q.dtype)),
                     kind="ulysses")
    if dims.heads_q % world:
        raise ValueError(f"q: ulysses splits the heads over the {world} ranks, so its heads ({dims.heads_q}) "
                         f"must be a multiple of {world} (use ring_flash_attn_func)")
    if dims.heads_k % world and world % dims.heads_k:
        raise ValueError(f"k: ulysses splits the kv heads over the {world} ranks, so their number ({dims.heads_k}) "
                         f"must be a multiple or a divisor of {world} (use ring_flash_attn_func)")
    if layout == "zigzag" and (dims.seqlen_q % 2 or dims.seqlen_k % 2):
        raise ValueError(f"q, k: a zigzag shard holds two equal chunks, so seqlen must be even, "
                         f"got {dims.seqlen_q} and {dims.seqlen_k}")
    if alibi_slopes is not None:
        validate.check_alibi(alibi_slopes, q, dims)
        hh = dims.heads_q // world
        alibi_slopes = alibi_slopes[..., rank * hh:(rank + 1) * hh]
    if dims.heads_k < world:
        # fewer kv heads than ranks: each is repeated world / Hk times, so q head h still reads kv head
        # h // (Hq / Hk) (GQA), and its gradient sums over the copies
        k, v = (x.repeat_interleave(world // dims.heads_k, dim=2) for x in (k, v))
    qh, kh, vh = (_SeqToHeads.apply(x, pg, world) for x in (q, k, v))
    q_order, k_order = _order(layout, world, dims.seqlen_q, q.device), _order(layout, world, dims.seqlen_k, q.device)
    if q_order is not None:
        qh, kh, vh = qh[:, q_order], kh[:, k_order], vh[:, k_order]
    with philox_stream(rank):  # head groups of ranks seeded alike drop independently
        out, lse = flash_attn_func(
            qh, kh, vh, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic, return_lse=True,
        )
    if q_order is not None:
        # back to rank order: position q_order[g] of the concatenation holds global token g
        out = _unpermute(out, q_order, 1)
        lse = _unpermute(lse, q_order, 2)
    out = _HeadsToSeq.apply(out, pg, world)
    with torch.no_grad():
        lse = _heads_to_seq(lse.transpose(1, 2).unsqueeze(-1), pg, world).squeeze(-1).transpose(1, 2).contiguous()
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


def _unpermute(x: torch.Tensor, order: torch.Tensor, dim: int) -> torch.Tensor:
    """y with y.index_select(dim, order) == x: the inverse of ``x = y[..., order, ...]`` (differentiable)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return x.index_select(dim, inverse)


def _packed_order(layout: str, world: int, lens: list[int], device) -> torch.Tensor:
    """Index of each position of the global packed batch (sequence i of length P n_i at its place) in the
    rank-order concatenation of the packed shards (``sharding.shard_packed``: rank r's shard is the r-th block of
    sum(n_i) rows, sequence i's segments at its local offset)."""
    total = sum(lens)
    where = torch.empty(world * total, dtype=torch.long)
    g0 = l0 = 0
    for n in lens:
        for rank in range(world):
            for g, loc, ln in segments(layout, world, rank, n):
                where[g0 + g:g0 + g + ln] = torch.arange(rank * total + l0 + loc, rank * total + l0 + loc + ln)
        g0, l0 = g0 + world * n, l0 + n
    return where.to(device)


@torch.compiler.disable
def ulysses_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    group: object = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    layout: str = "zigzag",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """:func:`flashtile.flash_attn_varlen_func` over a packed batch whose every sequence is sharded across the
    ranks (:func:`~flashtile.distributed.shard_packed`), by all-to-all head parallelism: arguments and results as
    :func:`~flashtile.distributed.ring_flash_attn_varlen_func` (local ``cu_seqlens``), heads as
    :func:`ulysses_flash_attn_func` (nheads a multiple of P, nheads_k a multiple or a divisor); ``alibi_slopes``
    and ``dropout_p`` are supported.  ``torch.compile`` runs it eagerly."""
    from flashtile.ops.flash_attn import flash_attn_varlen_func

    sh = check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout, causal, window_size,
                      softmax_scale, softcap, dropout_p, deterministic, return_attn_probs, return_lse)
    hq, hk = sh.heads_q, sh.heads_k
    if alibi_slopes is not None:
        validate.check_alibi(alibi_slopes, q, validate.AttnDims(len(sh.lens_q), hq, hk, sh.max_q, sh.max_k,
                                                                sh.head_dim))
    pg = resolve_group(group)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    # before any check that depends on shapes: a rank must not raise while the others wait
    _check_agreement(pg, q.device, sh.signature(layout, q.dtype, deterministic, alibi_slopes is not None),
                     kind="ulysses-varlen", fields=SIGNATURE_FIELDS, every_call=True)
    check_zigzag_lengths(layout, sh)
    if hq % world:
        raise ValueError(f"q: ulysses splits the heads over the {world} ranks, so its heads ({hq}) must be a "
                         f"multiple of {world} (use ring_flash_attn_varlen_func)")
    if hk % world and world % hk:
        raise ValueError(f"k: ulysses splits the kv heads over the {world} ranks, so their number ({hk}) must be a "
                         f"multiple or a divisor of {world} (use ring_flash_attn_varlen_func)")
    if alibi_slopes is not None:
        hh = hq // world
        alibi_slopes = alibi_slopes[..., rank * hh:(rank + 1) * hh]
    if hk < world:
        k, v = (x.repeat_interleave(world // hk, dim=1) for x in (k, v))
    qh, kh, vh = (_SeqToHeads.apply(x.unsqueeze(0), pg, world).squeeze(0) for x in (q, k, v))
    q_order = _packed_order(layout, world, sh.lens_q, q.device)
    k_order = _packed_order(layout, world, sh.lens_k, q.device)
    qh, kh, vh = qh.index_select(0, q_order), kh.index_select(0, k_order), vh.index_select(0, k_order)
    cu_q, cu_k = (c * world for c in (cu_seqlens_q, cu_seqlens_k))
    with philox_stream(rank):
        out, lse = flash_attn_varlen_func(
            qh, kh, vh, cu_q, cu_k, world * sh.max_q, world * sh.max_k, dropout_p=dropout_p,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, deterministic=deterministic, return_lse=True,
        )
    out = _HeadsToSeq.apply(_unpermute(out, q_order, 0).unsqueeze(0), pg, world).squeeze(0)
    with torch.no_grad():
        lse = _unpermute(lse, q_order, 1)  # (Hq / P, P total_q)
        lse = _heads_to_seq(lse.t().unsqueeze(0).unsqueeze(-1), pg, world).squeeze(-1).squeeze(0).t().contiguous()
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out
