"""Cut a full sequence into this rank's shard, and put the shards back together.

``zigzag``: the sequence of N tokens is cut into 2P chunks of N / (2P) and rank r holds
chunks r and 2P - 1 - r, in that order (under a causal mask every rank then does the same
work); ``contiguous``: rank r holds tokens [r N / P, (r + 1) N / P).  The ring functions
take the layout of their inputs as ``layout=``; shards made here have that layout.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from flashtile.distributed.plan import LAYOUTS, segments

__all__ = [
    "resolve_group",
    "shard_sequence",
    "unshard_sequence",
    "zigzag_shard",
    "zigzag_unshard",
    "contiguous_shard",
    "contiguous_unshard",
    "shard_packed",
    "unshard_packed",
]


def resolve_group(group: object, *, name: str = "group") -> dist.ProcessGroup:
    """A ProcessGroup from None (the default group), a ProcessGroup or a 1-D DeviceMesh."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"{name}: torch.distributed is not initialised (call torch.distributed.init_process_group first)"
        )
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without DeviceMesh
        DeviceMesh = ()  # noqa: N806
    if DeviceMesh and isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"{name} must be a 1-D DeviceMesh (pass mesh[dim_name] for one dimension), got {group.ndim}-D"
            )
        return group.get_group()
    raise TypeError(f"{name} must be None, a torch.distributed ProcessGroup or a 1-D DeviceMesh, "
                    f"got {type(group).__name__}")


def _rank_world(group_or_rank_world: object) -> tuple[int, int]:
    if isinstance(group_or_rank_world, (tuple, list)):
        if len(group_or_rank_world) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                     for x in group_or_rank_world):
            raise TypeError(f"group must be a ProcessGroup, a DeviceMesh or a (rank, world_size) pair of ints, "
                            f"got {group_or_rank_world!r}")
        rank, world = group_or_rank_world
        if not 0 <= rank < world:
            raise ValueError(f"group: rank must be in [0, world_size), got (rank, world_size) = {(rank, world)}")
        return rank, world
    group = resolve_group(group_or_rank_world)
    return dist.get_rank(group), dist.get_world_size(group)


def _check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _chunk_len(n: int, world: int, layout: str, name: str) -> int:
    parts = 2 * world if layout == "zigzag" else world
    if n % parts:
        raise ValueError(f"{name}: a {layout} layout over {world} ranks needs the sequence length to be a "
                         f"multiple of {parts}, got {n}")
    return n // world


def shard_sequence(x: torch.Tensor, group: object = None, *, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """This rank's shard of the full sequence ``x`` (sequence along ``dim``), a new contiguous tensor.

    ``group``: a ProcessGroup, a 1-D DeviceMesh, None (the default group) or ``(rank, world_size)``."""
    _check_layout(layout)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    rank, world = _rank_world(group)
    n = _chunk_len(x.shape[dim], world, layout, "x")
    parts = [x.narrow(dim, g, ln) for g, _, ln in segments(layout, world, rank, n)]
    return torch.cat(parts, dim=dim).contiguous()


def _assemble(shards: Sequence[torch.Tensor], layout: str, dim: int) -> torch.Tensor:
    world = len(shards)
    n = shards[0].shape[dim]
    if layout == "zigzag" and n % 2:
        raise ValueError(f"shards: a zigzag shard holds two equal chunks, got an odd length {n}")
    pieces: list[tuple[int, torch.Tensor]] = []
    for rank, x in enumerate(shards):
        if x.shape != shards[0].shape:
            raise ValueError(f"shards must have one shape, got {tuple(shards[0].shape)} and {tuple(x.shape)}")
        pieces += [(g, x.narrow(dim, loc, ln)) for g, loc, ln in segments(layout, world, rank, n)]
    return torch.cat([p for _, p in sorted(pieces, key=lambda t: t[0])], dim=dim)


def _shards(x: torch.Tensor | Sequence[torch.Tensor], group: object) -> list[torch.Tensor]:
    """Every rank's shard in rank order: ``x`` this rank's (gathered over ``group``), or the list itself."""
    if isinstance(x, torch.Tensor):
        pg = resolve_group(group)
        shards = [torch.empty_like(x) for _ in range(dist.get_world_size(pg))]
        dist.all_gather(shards, x.contiguous(), group=pg)
        return shards
    if isinstance(x, (list, tuple)) and x and all(isinstance(s, torch.Tensor) for s in x):
        return list(x)
    raise TypeError("x must be this rank's shard (a torch.Tensor) or a non-empty list of every rank's shard")


def unshard_sequence(
    x: torch.Tensor | Sequence[torch.Tensor], group: object = None, *, layout: str = "zigzag", dim: int = 1
) -> torch.Tensor:
    """The full sequence from shards: ``x`` this rank's shard (gathered over ``group``, no autograd),
    or the list of every rank's shard in rank order (no communication)."""
    _check_layout(layout)
    shards = _shards(x, group)
    return _assemble(shards, layout, dim)


def zigzag_shard(x: torch.Tensor, group: object = None, dim: int = 1) -> torch.Tensor:
    """Rank r's chunks r and 2P - 1 - r of 2P (:func:`shard_sequence` with ``layout="zigzag"``)."""
    return shard_sequence(x, group, layout="zigzag", dim=dim)


def zigzag_unshard(x: torch.Tensor | Sequence[torch.Tensor], group: object = None, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`zigzag_shard` (:func:`unshard_sequence` with ``layout="zigzag"``)."""
    return unshard_sequence(x, group, layout="zigzag", dim=dim)


def contiguous_shard(x: torch.Tensor, group: object = None, dim: int = 1) -> torch.Tensor:
    """Rank r's tokens [r N / P, (r + 1) N / P) (:func:`shard_sequence` with ``layout="contiguous"``)."""
    return shard_sequence(x, group, layout="contiguous", dim=dim)


def contiguous_unshard(x: torch.Tensor | Sequence[torch.Tensor], group: object = None, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`contiguous_shard`."""
    return unshard_sequence(x, group, layout="contiguous", dim=dim)


def _lengths(cu_seqlens: object, name: str, total: int) -> list[int]:
    """The per-sequence lengths of an int32 (batch + 1,) cumulative-length tensor over ``total`` packed tokens
    (read on the host), checked: starts at 0, non-decreasing, ends at ``total``."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise TypeError(f"{name} must be a 1-D int32 torch.Tensor (batch + 1,), got "
                        f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")
    cu = cu_seqlens.tolist()
    if not cu or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{name} must start at 0, never decrease and end at the packed length {total}, got {cu}")
    return [b - a for a, b in zip(cu, cu[1:])]


def shard_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, group: object = None, *,
                 layout: str = "zigzag") -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of a packed batch ``x`` (total, ...): every sequence of ``cu_seqlens`` cut as
    :func:`shard_sequence` cuts one (its length a multiple of P, 2P for ``zigzag``), the shards packed in order.
    Returns ``(shard, local cu_seqlens)``, the local lengths 1 / P of the global ones (the same on every rank),
    which is what :func:`~flashtile.distributed.ring_flash_attn_varlen_func` takes."""
    _check_layout(layout)
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise TypeError(f"x must be a packed (total, ...) torch.Tensor, got {type(x).__name__}")
    rank, world = _rank_world(group)
    lens = _lengths(cu_seqlens, "cu_seqlens", x.shape[0])
    parts, start = [], 0
    for i, n in enumerate(lens):
        local = _chunk_len(n, world, layout, f"cu_seqlens (sequence {i})")
        parts += [x.narrow(0, start + g, ln) for g, _, ln in segments(layout, world, rank, local)]
        start += n
    local_cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).div(world, rounding_mode="floor")
    shard = torch.cat(parts) if parts else x.new_empty((0,) + tuple(x.shape[1:]))
    return shard.contiguous(), local_cu.to(device=cu_seqlens.device, dtype=torch.int32)


def unshard_packed(x: torch.Tensor | Sequence[torch.Tensor], cu_seqlens: torch.Tensor, group: object = None, *,
                   layout: str = "zigzag", dim: int = 0) -> torch.Tensor:
    """The full packed batch from shards made by :func:`shard_packed` (tokens along ``dim``): ``x`` this rank's
    shard (gathered over ``group``, no autograd) or the list of every rank's shard in rank order;
    ``cu_seqlens``: the *local* cumulative lengths."""
    _check_layout(layout)
    shards = _shards(x, group)
    for s in shards:
        if s.shape != shards[0].shape:
            raise ValueError(f"shards must have one shape, got {tuple(shards[0].shape)} and {tuple(s.shape)}")
    lens = _lengths(cu_seqlens, "cu_seqlens", shards[0].shape[dim])
    seqs, start = [], 0
    for n in lens:
        seqs.append(_assemble([s.narrow(dim, start, n) for s in shards], layout, dim))
        start += n
    return torch.cat(seqs, dim=dim) if seqs else shards[0]
