"""Ring attention over packed variable-length batches (:func:`ring_flash_attn_varlen_func`).

Every sequence of the batch is sharded across the P ranks in the ring's layout
(:func:`~flashtile.distributed.shard_packed`: 1 / P of each sequence on every rank, so the local
``cu_seqlens`` are the same on all ranks), and the K/V shards rotate as in :mod:`.ring`.  A step's work
for one sequence is that sequence's :func:`~flashtile.distributed.plan.step_plan` (the window taken over
the full sequence); the step runs it for all sequences at once: the i-th call of every sequence's plan with
the same kernel window becomes one pseudo-sequence of one packed FA2 call (rows and key columns gathered
by index where they are not the whole shard), whose partial output merges into the rows it came from
through its LSE (:func:`.ring.merge_partial_`).  The backward replays the same calls with the global output
and LSE; dQ, dK, dV accumulate in float32 (scatter-added), dK / dV travelling with their block.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from flashtile.distributed.plan import LAYOUTS, step_plan
from flashtile.distributed.ring import (_bits, _check_agreement, _flag, _rotate, _wait, merge_partial_,
                                        rotate_backward)
from flashtile.distributed.sharding import resolve_group
from flashtile.ops import validate
from flashtile.ops.autograd import _first_order_only, _varlen_fwd_impl
from flashtile.runtime.common import on_tensor_device
from flashtile.runtime.fa2_bwd import fa2_backward

__all__ = ["ring_flash_attn_varlen_func"]


class _Packed(NamedTuple):
    """One packed kernel call of a ring step: rows / cols index this rank's q and the visiting K/V block
    (None: all of them, in order), one pseudo-sequence per member call, the kernel window (wl, wr)."""

    wl: int
    wr: int
    rows: torch.Tensor | None
    cols: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


@dataclass(frozen=True)
class _VarlenRing:
    group: dist.ProcessGroup
    rank: int
    world: int
    send_to: int
    recv_from: int
    scale: float
    softcap: float
    deterministic: bool
    steps: tuple  # per step t (visiting block of rank - t): its _Packed calls


def _index(spans: list[tuple[int, int]], total: int, device) -> torch.Tensor | None:
    """The packed positions of ``spans`` in order, or None when they are exactly [0, total)."""
    if sum(b - a for a, b in spans) == total and all(a == b0 for (a, _), (_, b0) in zip(spans[1:], spans)) and (
            not spans or spans[0][0] == 0):
        return None
    return torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in spans]).to(device)


def _cu(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


@functools.lru_cache(maxsize=64)  # a training loop's batches repeat their lengths often enough to pay for it
def _schedule(layout: str, world: int, rank: int, lens_q: tuple[int, ...], lens_k: tuple[int, ...], left: int,
              right: int, device) -> tuple:
    """Per step, the packed calls (:class:`_Packed`) covering every visible (query, key) pair of every sequence
    once: the i-th call of each sequence's plan, grouped by kernel window (a sequence has one i-th call, and the
    sequences' rows are disjoint, so no row appears twice in a call)."""
    total_q, total_k = sum(lens_q), sum(lens_k)
    steps = []
    for t in range(world):
        src = (rank - t) % world
        groups: dict[tuple[int, int, int], tuple[list, list]] = {}
        q0 = k0 = 0
        for nq, nk in zip(lens_q, lens_k):
            if nq and nk:
                wl, wr = validate.unbind_window(left, right, world * nq, world * nk)
                for i, c in enumerate(step_plan(layout, world, rank, src, nq, nk, wl, wr)):
                    rows, cols = groups.setdefault((i, c.wl, c.wr), ([], []))
                    rows.append((q0 + c.r0, q0 + c.r1))
                    cols.append((k0 + c.c0, k0 + c.c1))
            q0, k0 = q0 + nq, k0 + nk
        calls = []
        for (_, wl, wr), (rows, cols) in sorted(groups.items()):
            lq, lk = [b - a for a, b in rows], [b - a for a, b in cols]
            calls.append(_Packed(wl, wr, _index(rows, total_q, device), _index(cols, total_k, device),
                                 _cu(lq, device), _cu(lk, device), max(lq), max(lk)))
        steps.append(tuple(calls))
    return tuple(steps)


class PackedShards(NamedTuple):
    """What :func:`check_packed` found: sizes, the local lengths (read on the host) and the options."""

    total_q: int
    total_k: int
    heads_q: int
    heads_k: int
    head_dim: int
    max_q: int
    max_k: int
    lens_q: tuple[int, ...]
    lens_k: tuple[int, ...]
    left: int
    right: int
    scale: float
    softcap: float
    dropout_p: float

    def signature(self, layout: str, dtype: torch.dtype, deterministic: bool, *extra: int) -> tuple[int, ...]:
        """The ints every rank must agree on: sizes, a CRC of each side's lengths, layout, window, dtype, options."""
        crc = [zlib.crc32(struct.pack(f"<{len(x)}q", *x)) for x in (self.lens_q, self.lens_k)]
        return (len(self.lens_q), self.total_q, self.total_k, self.heads_q, self.heads_k, self.head_dim, *crc,
                LAYOUTS.index(layout), self.left, self.right, validate.SUPPORTED_DTYPES.index(dtype),
                *(_bits(x) for x in (self.scale, self.softcap, self.dropout_p)), int(deterministic), *extra)


SIGNATURE_FIELDS = ("(batch, total_q, total_k, heads_q, heads_k, head_dim, crc32 of the q lengths, of the k "
                    "lengths, layout, window left, right, dtype, ...)")


def check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout, causal, window_size,
                 softmax_scale, softcap, dropout_p, deterministic, return_attn_probs, return_lse) -> PackedShards:
    """The packed distributed functions' argument checks that need no communication (before any collective, as
    the fixed-length ones'): tensors, the local cu_seqlens and their values, layout, options, flags."""
    validate.check_qkv_tensors(("q", "k", "v"), q, k, v)
    total_q, hq, hk, total_k, d, _ = validate.check_varlen_dims(q, k, v, paged=False)
    validate.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q)
    max_q = validate.check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    max_k = validate.check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    validate.check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_q, max_k)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    left, right = validate.check_window(causal, window_size)
    scale = validate.check_softmax_scale(softmax_scale, d)
    cap = validate.check_softcap(softcap)
    p = validate.check_dropout(dropout_p)
    _flag(deterministic, "deterministic")
    _flag(return_attn_probs, "return_attn_probs")
    _flag(return_lse, "return_lse")
    lens_q, lens_k = (tuple(torch.diff(c).tolist()) for c in (cu_seqlens_q, cu_seqlens_k))
    return PackedShards(total_q, total_k, hq, hk, d, max_q, max_k, lens_q, lens_k, left, right, scale, cap, p)


def check_zigzag_lengths(layout: str, shards: PackedShards) -> None:
    """A zigzag shard holds two equal chunks of each sequence: every local length even.  Called after the ranks
    agreed on the lengths, so that all of them raise, none waiting in a collective."""
    if layout != "zigzag":
        return
    for name, lens in (("cu_seqlens_q", shards.lens_q), ("cu_seqlens_k", shards.lens_k)):
        odd = [i for i, n in enumerate(lens) if n % 2]
        if odd:
            raise ValueError(f"{name}: a zigzag shard holds two equal chunks of each sequence, so every local "
                             f"length must be even; sequences {odd[:8]} are not (use layout='contiguous')")


def _take(x: torch.Tensor, index: torch.Tensor | None, dim: int = 0) -> torch.Tensor:
    return x if index is None else x.index_select(dim, index)


def _ring_forward(q, k, v, ring: _VarlenRing):
    total_q, hq, d = q.shape
    out = torch.zeros((total_q, hq, d), dtype=torch.float32, device=q.device)
    lse = torch.full((hq, total_q), -math.inf, dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v)) if ring.world > 1 else (k, v)
    for t, calls in enumerate(ring.steps):
        if t + 1 < ring.world:
            kv_next, reqs = _rotate(kv, ring)  # posted before this step's kernels: the transfer overlaps them
        for c in calls:
            o, l, _ = _varlen_fwd_impl(
                _take(q, c.rows), _take(kv[0], c.cols), _take(kv[1], c.cols), c.cu_q, c.cu_k, None, None, c.max_q,
                c.max_k, ring.scale, c.wr == 0, c.wl, c.wr, ring.softcap, 0.0, ring.deterministic)
            part_o, part_l = _take(out, c.rows), _take(lse, c.rows, 1)
            merge_partial_(part_o.unsqueeze(0), part_l.unsqueeze(0), o.unsqueeze(0), l.unsqueeze(0))
            if c.rows is not None:  # the rows of one call are distinct: copy the merged ones back
                out.index_copy_(0, c.rows, part_o)
                lse.index_copy_(1, c.rows, part_l)
        if t + 1 < ring.world:
            _wait(reqs)
            kv = kv_next
    return out.to(q.dtype), lse


@on_tensor_device
def _call_backward(dout, q, k, v, out, lse, c: _Packed, ring: _VarlenRing, dq, dk, dv) -> None:
    """FA2's packed backward of one call with the global out / LSE, into float32 dq, dk, dv."""
    fa2_backward(dout, q, k, v, out, lse, softmax_scale=ring.scale, causal=c.wr == 0, window_size=(c.wl, c.wr),
                 softcap=ring.softcap, deterministic=ring.deterministic, dq=dq, dk=dk, dv=dv, cu_seqlens_q=c.cu_q,
                 cu_seqlens_k=c.cu_k, max_seqlen_q=c.max_q, max_seqlen_k=c.max_k)


def _ring_backward(dout, q, k, v, out, lse, ring: _VarlenRing):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

    def step(t, kv, dkv):
        for c in ring.steps[t]:
            q_c = _take(q, c.rows)
            k_c = _take(kv[0], c.cols)
            dq_c = torch.empty(q_c.shape, dtype=torch.float32, device=q.device)
            dk_c, dv_c = (torch.empty(k_c.shape, dtype=torch.float32, device=k.device) for _ in range(2))
            _call_backward(_take(dout, c.rows), q_c, k_c, _take(kv[1], c.cols), _take(out, c.rows),
                           _take(lse, c.rows, 1), c, ring, dq_c, dk_c, dv_c)
            for acc, index, g in ((dq, c.rows, dq_c), (dkv[0], c.cols, dk_c), (dkv[1], c.cols, dv_c)):
                if index is None:
                    acc += g
                else:
                    acc.index_add_(0, index, g)

    dkv = rotate_backward(k, v, ring, step)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingVarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):
        out, lse = _ring_forward(q, k, v, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @_first_order_only
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        return (*_ring_backward(dout, q, k, v, out, lse, ctx.ring), None)


@torch.compiler.disable
def ring_flash_attn_varlen_func(
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
    ranks of ``group`` (make the shards with :func:`~flashtile.distributed.shard_packed`).

    q: (total_q / P, nheads, headdim), k, v: (total_k / P, nheads_k, headdim): this rank's shard;
    ``cu_seqlens_q`` / ``cu_seqlens_k``: the *local* cumulative lengths (int32, each sequence's 1 / P, the same on
    every rank; a global length a multiple of 2P for ``zigzag``, of P for ``contiguous``), ``max_seqlen_*`` their
    maxima.  causal, window_size, softcap, softmax_scale, GQA and deterministic mean what they mean in
    ``flash_attn_varlen_func`` over the *full* sequences (bottom-right aligned per sequence).  ``dropout_p`` > 0
    and ``alibi_slopes`` raise ``NotImplementedError`` (:func:`~flashtile.distributed.ulysses_flash_attn_varlen_func`
    has both).  Every rank passes the same shapes, lengths and options (checked at every call: one all_gather
    of a few ints, lengths as a CRC).

    Returns this rank's shard of the output (q's layout); with return_lse ``(out, lse)``, lse (nheads,
    total_q / P) float32; with return_attn_probs ``(out, lse, None)``.  Differentiable in q, k, v.
    ``torch.compile`` runs it eagerly (a graph break).
    """
    shards = check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, layout, causal,
                          window_size, softmax_scale, softcap, dropout_p, deterministic, return_attn_probs, return_lse)
    pg = resolve_group(group)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    # the refusals after the agreement (ALiBi's presence in it): a rank raising alone would leave the others
    # waiting in a collective
    _check_agreement(pg, q.device, shards.signature(layout, q.dtype, deterministic, int(alibi_slopes is not None)),
                     kind="ring-varlen", fields=SIGNATURE_FIELDS, every_call=True)
    if shards.dropout_p > 0:
        raise NotImplementedError("dropout_p: the packed ring has no dropout yet (ulysses_flash_attn_varlen_func has)")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not supported by ring attention yet (use "
                                  "ulysses_flash_attn_varlen_func)")
    check_zigzag_lengths(layout, shards)
    ring = _VarlenRing(
        group=pg, rank=rank, world=world, send_to=dist.get_global_rank(pg, (rank + 1) % world),
        recv_from=dist.get_global_rank(pg, (rank - 1) % world), scale=shards.scale, softcap=shards.softcap,
        deterministic=deterministic,
        steps=_schedule(layout, world, rank, shards.lens_q, shards.lens_k, shards.left, shards.right, q.device),
    )
    out, lse = _RingVarlenAttention.apply(q, k, v, ring)
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out
