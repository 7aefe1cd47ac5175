"""Reference ring attention: the sequence sharded over P ranks, K/V blocks visited in ring order.

Ring attention (Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise Transformers")
shards the N tokens of q, k, v over P ranks.  At step t = 0 .. P-1, rank r holds the K/V
block of rank ``src = (r - t) mod P`` (each step every rank passes its block to rank r + 1)
and computes, for its own queries, the partial softmax result over that block alone:

    m_b   = max_{j in block} s_ij,   l_b = sum_{j in block} exp(s_ij - m_b)
    LSE_b = m_b + log l_b,           O_b = sum_{j in block} exp(s_ij - LSE_b) v_j

(an empty or fully masked block gives O_b = 0, LSE_b = -inf).  Two partial results over
disjoint key sets combine exactly, FA1 paper Algorithm 1 lines 10-12 (the (m, l) merge
of :func:`flashtile.reference.softmax.merge_states`) written on LSEs, as Flash-Decoding's
reduction (:func:`flashtile.reference.decoding.merge_partials`):

    LSE = log(exp(LSE_a) + exp(LSE_b)),   O = exp(LSE_a - LSE) O_a + exp(LSE_b - LSE) O_b,

because exp(LSE_b - LSE) O_b = sum_{j in b} exp(s_ij - LSE) v_j.  After P steps every key
has been merged once, so O and LSE are those of full attention, in any ring order.

Masks use *global* positions: a rank's shard is a set of token positions given by the
layout (``contiguous``: tokens [r N/P, (r+1) N/P); ``zigzag``: chunks r and 2P-1-r of 2P),
and key position kp is visible to query position qp iff
``Nk - Nq - left <= kp - qp <= Nk - Nq + right`` (bottom-right aligned, -1 unbounded;
causal: right = 0), so the result equals :mod:`flashtile.reference.attention` on the full
sequence.  The kernels' counterpart is :mod:`flashtile.distributed.ring`.

Counts: ``visited_blocks`` / ``skipped_blocks`` are the (rank, step) pairs with / without a
visible key; ``extras["pairs_per_rank"]`` the visible (query, key) pairs each rank computes per batch element and head
(zigzag makes them equal under a causal mask); ``extras["kv_elements_sent"]`` the K and V
elements passed around the ring in the forward (every rank sends its block P - 1 times).
"""

from __future__ import annotations

import math

import torch

from flashtile.reference._common import AttnResult, IOCounts, check_qkv, expand_kv

__all__ = ["ring_attention", "shard_positions"]


def shard_positions(n: int, world: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """The global token positions rank ``rank`` holds of a sequence of ``n``, in shard order."""
    if layout == "contiguous":
        if n % world:
            raise ValueError(f"n ({n}) must be a multiple of world ({world}) for the contiguous layout")
        per = n // world
        return torch.arange(rank * per, (rank + 1) * per)
    if layout == "zigzag":
        if n % (2 * world):
            raise ValueError(f"n ({n}) must be a multiple of 2 * world ({2 * world}) for the zigzag layout")
        c = n // (2 * world)
        return torch.cat((torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c)))
    raise ValueError(f"layout must be 'zigzag' or 'contiguous', got {layout!r}")


def _partial(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(O_b, LSE_b) of masked scores s (B, H, n, m) against v (B, H, m, d); -inf rows give (0, -inf)."""
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(m == -math.inf, 0.0, m)
    p = torch.exp(s - m)
    ell = p.sum(dim=-1, keepdim=True)
    out = torch.where(ell > 0, (p @ v) / torch.where(ell > 0, ell, 1.0), 0.0)
    lse = torch.where(ell > 0, m + torch.log(torch.where(ell > 0, ell, 1.0)), -math.inf)
    return out, lse.squeeze(-1)


def _merge(out_a, lse_a, out_b, lse_b):
    """The exact merge of two partial results over disjoint key sets (module docstring)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(lse == -math.inf, 0.0, lse)
    w_a = torch.where(lse_a == -math.inf, 0.0, torch.exp(lse_a - safe)).unsqueeze(-1)
    w_b = torch.where(lse_b == -math.inf, 0.0, torch.exp(lse_b - safe)).unsqueeze(-1)
    return w_a * out_a + w_b * out_b, lse


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    world: int,
    *,
    layout: str = "zigzag",
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    softcap: float = 0.0,
) -> AttnResult:
    """Full-sequence q (B, Hq, Nq, d), k / v (B, Hk, Nk, d) attended as ``world`` ranks of a ring would.

    Returns the full (out, lse) in float64, assembled from every rank's shard, and the counts."""
    q, k, v, _ = check_qkv(q, k, v)
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    k, v = expand_kv(k, hq), expand_kv(v, hq)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    qpos = [shard_positions(nq, world, r, layout) for r in range(world)]
    kpos = [shard_positions(nk, world, r, layout) for r in range(world)]
    out = torch.zeros_like(q)
    lse = torch.full((b, hq, nq), -math.inf, dtype=q.dtype)
    counts = IOCounts()
    pairs = []
    for rank in range(world):
        qr = q[:, :, qpos[rank]]
        o_r = torch.zeros_like(qr)
        l_r = torch.full(qr.shape[:3], -math.inf, dtype=q.dtype)
        seen = 0
        for step in range(world):
            src = (rank - step) % world
            s = scale * (qr @ k[:, :, kpos[src]].transpose(-1, -2))
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            rel = kpos[src].view(1, -1) - qpos[rank].view(-1, 1) - (nk - nq)  # kp - qp - (Nk - Nq)
            visible = torch.ones_like(rel, dtype=torch.bool)
            if left >= 0:
                visible &= rel >= -left
            if right >= 0:
                visible &= rel <= right
            if not visible.any():
                counts.skipped_blocks += 1
                continue
            counts.visited_blocks += 1
            seen += int(visible.sum())
            o_b, l_b = _partial(torch.where(visible, s, -math.inf), v[:, :, kpos[src]])
            o_r, l_r = _merge(o_r, l_r, o_b, l_b)
        out[:, :, qpos[rank]] = o_r
        lse[:, :, qpos[rank]] = l_r
        pairs.append(seen)
    counts.extras["pairs_per_rank"] = pairs
    counts.extras["kv_elements_sent"] = world * (world - 1) * 2 * b * hk * (nk // world) * d  # only the kv heads travel
    return AttnResult(out, lse, counts)
