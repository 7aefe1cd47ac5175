"""BlockMask -> per-block index lists for the kernels (Algorithm 5 on a Q-outer loop).

The forward kernel walks, for q-block r, only the kv blocks listed in
``kv_indices[b, h, r, :kv_count[b, h, r]]``; the dK/dV kernel walks, for kv-block
c, only ``q_indices[b, h, c, :q_count[b, h, c]]``.  Skipped blocks are never
loaded, so HBM traffic and FLOPs scale with the mask's density s.

Lists are int32, ascending, padded with 0 past the count.  Leading mask dims
are kept as (Bm, Hm) with Bm in {1, B} and Hm in {1, Hq}: the kernels index
them with stride 0 on a broadcast dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashtile.reference.masks import BlockMask


class BlockLists(NamedTuple):
    counts: torch.Tensor  # (Bm, Hm, T_outer) int32
    indices: torch.Tensor  # (Bm, Hm, T_outer, T_inner) int32
    block_size: tuple[int, int]  # (Br, Bc) of the mask


def _as_4d(mask: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """Broadcastable (..., Tr, Tc) bool -> (Bm, Hm, Tr, Tc) with Bm in {1, B}, Hm in {1, H}."""
    if mask.dim() > 4:
        raise ValueError(f"block_mask.mask must have at most 4 dims (B, H, Tr, Tc), got shape {tuple(mask.shape)}")
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    bm, hm = mask.shape[:2]
    if bm not in (1, batch) or hm not in (1, heads):
        raise ValueError(
            f"block_mask leading dims {(bm, hm)} must broadcast to (batch, heads) = {(batch, heads)}"
        )
    return mask


def _lists(mask4: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # stable sort puts the kept blocks (True) first, in ascending block order
    counts = mask4.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort((~mask4).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    keep = torch.arange(mask4.shape[-1], device=mask4.device) < counts.unsqueeze(-1)
    return counts.contiguous(), torch.where(keep, order, torch.zeros_like(order)).contiguous()


def kv_block_lists(block_mask: BlockMask, batch: int, heads: int, nq: int, nk: int, device) -> BlockLists:
    """For each q block, the kv blocks to visit (forward and dQ passes)."""
    block_mask.check_seqlens(nq, nk)
    m = _as_4d(block_mask.mask.to(device), batch, heads)
    counts, idx = _lists(m)
    return BlockLists(counts, idx, block_mask.block_size)


def q_block_lists(block_mask: BlockMask, batch: int, heads: int, nq: int, nk: int, device) -> BlockLists:
    """For each kv block, the q blocks that visit it (dK/dV pass): the transposed lists."""
    block_mask.check_seqlens(nq, nk)
    m = _as_4d(block_mask.mask.to(device), batch, heads).transpose(-1, -2)
    counts, idx = _lists(m)
    return BlockLists(counts, idx, block_mask.block_size)
