"""Ring attention: context parallelism over a process group with the FA2 kernels.

Each of the P ranks holds a shard of the sequence (``layout``: :mod:`flashtile.distributed.sharding`).
Forward: the K/V block visits every rank around the ring (rank r sends to r + 1 and receives
from r - 1 with ``batch_isend_irecv``); the transfer of the next block is posted before the
attention of the block in hand, so communication overlaps the kernels.  Each step runs the FA2
forward on (this rank's queries, the visiting block) with the window the step's plan gives
(:mod:`flashtile.distributed.plan`), returning a partial output and its LSE, and partials merge
exactly through their LSEs (FA1 paper, Algorithm 1 lines 10-12, done once per block as in
Flash-Decoding; float64 twin: :mod:`flashtile.reference.ring`):

    lse = log(exp(lse_a) + exp(lse_b)),    out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b.

Backward: the same rotation, running the FA2 backward on every step with the *global* output and
LSE (so ``P_ij = exp(S_ij - L_i)`` and ``D_i = rowsum(dO_i * O_i)`` are the full softmax's); dQ
accumulates locally in float32, and the float32 dK/dV accumulators travel with their K/V block
and arrive at the block's owner after the last step.  Only the kv heads travel (GQA).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashtile.distributed.plan import LAYOUTS, step_plan
from flashtile.distributed.sharding import resolve_group
from flashtile.ops import validate
from flashtile.ops.autograd import _first_order_only, _fwd_impl, _philox
from flashtile.ops.flash_attn import unpack
from flashtile.runtime.common import on_tensor_device
from flashtile.runtime.fa2_bwd import fa2_backward

__all__ = [
    "ring_flash_attn_func",
    "ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_kvpacked_func",
    "merge_partial_",
]

@dataclass(frozen=True)
class _Ring:
    """One call's fixed parameters: the group, this rank's neighbours and the mask."""

    group: dist.ProcessGroup
    rank: int
    world: int
    send_to: int  # global rank of (rank + 1) % world
    recv_from: int  # global rank of (rank - 1) % world
    layout: str
    nq: int
    nk: int
    scale: float
    left: int
    right: int
    softcap: float
    dropout_p: float
    deterministic: bool

    def plan(self, src: int):
        return step_plan(self.layout, self.world, self.rank, src, self.nq, self.nk, self.left, self.right)

    def philox_offset(self, src: int, index: int, batch: int, heads: int) -> int:
        """Start of the Philox counters of call ``index`` of the step against ``src``'s block, past the
        call's base offset: each call owns ``batch * heads * nq * nk`` counters (the kernel counts
        (bh * rows + i) * cols + j from its offset), disjoint over ranks, steps and calls."""
        return ((self.rank * self.world + src) * MAX_CALLS + index) * batch * heads * self.nq * self.nk


MAX_CALLS = 4  # calls a step makes at most: one per (query segment, key segment) pair, 2 x 2


def merge_partial_(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Merge partial ``(out_b, lse_b)`` into ``(out, lse)`` in place.

    out / out_b (B, N, H, d), out float32; lse / lse_b (B, H, N) float32, -inf for an empty
    partial.  ``out += sigmoid(lse_b - lse) (out_b - out)`` is ``exp(lse_b - lse') out_b +
    exp(lse - lse') out`` with ``lse' = logaddexp(lse, lse_b)``; an empty ``b`` has weight 0
    (also when both are empty: no NaN), an empty ``out`` weight 0 against a non-empty ``b``.
    """
    diff = torch.where(lse_b == -math.inf, -math.inf, lse_b - lse)
    out.lerp_(out_b.to(out.dtype), torch.sigmoid(diff).transpose(1, 2).unsqueeze(-1))
    lse.copy_(torch.logaddexp(lse, lse_b))


def _rotate(x: torch.Tensor, ring: _Ring) -> tuple[torch.Tensor, list]:
    """Post send of ``x`` to the next rank and receive of its twin from the previous one."""
    buf = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x, ring.send_to, ring.group),
        dist.P2POp(dist.irecv, buf, ring.recv_from, ring.group),
    ]
    return buf, dist.batch_isend_irecv(ops)


def _wait(reqs: list) -> None:
    for r in reqs:
        r.wait()


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring):
    b, nq, hq, d = q.shape
    out = torch.zeros((b, nq, hq, d), dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, nq), -math.inf, dtype=torch.float32, device=q.device)
    fresh = True  # out / lse still hold the empty state everywhere
    kv = torch.stack((k, v)) if ring.world > 1 else (k, v)
    # dropout: one Philox draw per ring call; each kernel call gets its own counter range (see _Ring)
    base = _philox(q.device) if ring.dropout_p > 0 else None
    rngs = []
    for t in range(ring.world):
        src = (ring.rank - t) % ring.world
        if t + 1 < ring.world:
            kv_next, reqs = _rotate(kv, ring)  # posted before this step's kernels: the transfer overlaps them
        for index, c in enumerate(ring.plan(src)):
            if base is not None:
                rng = base.clone()
                rng[1] += ring.philox_offset(src, index, b, hq)
                rngs.append(rng)
            o, l, _ = _fwd_impl(
                q[:, c.r0:c.r1], kv[0][:, c.c0:c.c1], kv[1][:, c.c0:c.c1], None, None, None, 0, 0,
                ring.scale, c.wr == 0, c.wl, c.wr, ring.softcap, ring.dropout_p, ring.deterministic, True,
                rngs[-1] if base is not None else None,
            )
            if fresh and c.r1 - c.r0 == nq:
                out.copy_(o)
                lse.copy_(l)
            else:
                merge_partial_(out[:, c.r0:c.r1], lse[:, :, c.r0:c.r1], o, l)
            fresh = False
        if t + 1 < ring.world:
            _wait(reqs)
            kv = kv_next
    rng = torch.stack(rngs) if rngs else torch.zeros(0, 2, dtype=torch.int64)
    return out.to(q.dtype), lse, rng


@on_tensor_device
def _block_backward(dout, q, k, v, out, lse, rng, c, ring: _Ring, dq, dk, dv) -> None:
    """FA2 backward of one plan call with the global out / LSE, writing float32 dq, dk, dv (B, N, H, d):
    per-step gradients are summed over the ring, so they are not rounded to the input dtype first."""
    t = lambda x: x.transpose(1, 2)  # noqa: E731 - the kernels' (B, H, N, d) views
    fa2_backward(
        t(dout), t(q), t(k), t(v), t(out), lse,
        softmax_scale=ring.scale, causal=c.wr == 0, window_size=(c.wl, c.wr), softcap=ring.softcap,
        dropout_p=ring.dropout_p, rng_state=rng, deterministic=ring.deterministic, dq=t(dq), dk=t(dk), dv=t(dv),
    )


def rotate_backward(k: torch.Tensor, v: torch.Tensor, ring, step) -> torch.Tensor:
    """The backward's ring: K/V rotate as in the forward, and at step t ``step(t, kv, dkv)`` adds this rank's part
    of the visiting block's dK, dV into ``dkv`` (float32 (2, *k.shape), zeroed), which then travels with its block
    and reaches the block's owner after the last step.  Returns this rank's own block's dkv."""
    kv = torch.stack((k, v)) if ring.world > 1 else (k, v)
    dkv_in, dkv_reqs = None, None
    for t in range(ring.world):
        if t + 1 < ring.world:
            kv_next, kv_reqs = _rotate(kv, ring)
        dkv = torch.zeros((2,) + tuple(k.shape), dtype=torch.float32, device=k.device)
        step(t, kv, dkv)
        if dkv_reqs is not None:
            _wait(dkv_reqs)
            dkv += dkv_in  # this block's accumulator, from the rank that held it one step ago
        if ring.world > 1:
            # after the last step the accumulator goes to the block's owner, rank + 1
            dkv_in, dkv_reqs = _rotate(dkv, ring)
        else:
            dkv_in = dkv
        if t + 1 < ring.world:
            _wait(kv_reqs)
            kv = kv_next
    if dkv_reqs is not None:
        _wait(dkv_reqs)
    return dkv_in


def _ring_backward(dout, q, k, v, out, lse, rngs, ring: _Ring):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    calls = 0

    def step(t, kv, dkv):
        nonlocal calls
        src = (ring.rank - t) % ring.world
        for index, c in enumerate(ring.plan(src)):
            rows, cols = slice(c.r0, c.r1), slice(c.c0, c.c1)
            dq_c = torch.empty(q[:, rows].shape, dtype=torch.float32, device=q.device)
            # the step's first call writes its dK/dV straight into the (zeroed) accumulator; later calls
            # of the step may share its key columns, so they go through scratch and add
            dk_c, dv_c = (dkv[0, :, cols], dkv[1, :, cols]) if index == 0 else (
                torch.empty_like(dkv[0, :, cols]), torch.empty_like(dkv[1, :, cols]))
            _block_backward(
                dout[:, rows], q[:, rows], kv[0][:, cols], kv[1][:, cols], out[:, rows], lse[:, :, rows],
                rngs[calls] if ring.dropout_p > 0 else None, c, ring, dq_c, dk_c, dv_c,
            )
            calls += 1
            dq[:, rows] += dq_c
            if index > 0:
                dkv[0, :, cols] += dk_c
                dkv[1, :, cols] += dv_c

    dkv = rotate_backward(k, v, ring, step)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):
        out, lse, rngs = _ring_forward(q, k, v, ring)
        ctx.save_for_backward(q, k, v, out, lse, rngs)
        ctx.ring = ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @_first_order_only
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, rngs = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, rngs, ctx.ring)
        return dq, dk, dv, None


# (group, kind) pairs whose first call has been checked: every rank makes that check at its first call of a kind on
# the group (calls on a group run in lockstep), so no rank can skip an all_gather that another makes
_CHECKED: set = set()
_FIELDS = "(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, layout, ...)"


def _check_agreement(group: dist.ProcessGroup, device: torch.device, sig: tuple[int, ...], kind: str = "ring",
                     fields: str = _FIELDS, every_call: bool = False) -> None:
    """At the first call of ``kind`` on ``group`` (at every call with ``every_call``: packed batches, whose lengths
    change per call): every rank passes the same shapes and options (else the ring would hang or mix garbage).
    One all_gather of a few ints; ``fields`` names them in the error."""
    if not every_call and (group, kind) in _CHECKED:
        return
    where = device if dist.get_backend(group) != "gloo" else torch.device("cpu")
    mine = torch.tensor(sig, dtype=torch.int64, device=where)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    rows = [tuple(x.tolist()) for x in every]
    if any(r != rows[0] for r in rows):
        raise ValueError(
            "q, k, v: every rank of the group must pass shards of one shape and the same options "
            "(softmax_scale, softcap, dropout_p, deterministic, window, layout, dtype); "
            f"{fields} per rank: {rows}"
        )
    _CHECKED.add((group, kind))


def _bits(x: float) -> int:
    """A float option as the int64 of its IEEE bits (ranks must agree on it exactly)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _flag(x: object, name: str) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(x).__name__}")
    return x


def _run(q, k, v, names, group, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
         deterministic, return_attn_probs, return_lse, layout):
    validate.check_qkv_tensors(names, q, k, v)
    dims = validate.check_dims(q, k, v, seq_major=True, names=names)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    left, right = validate.check_window(causal, window_size)
    scale = validate.check_softmax_scale(softmax_scale, dims.head_dim)
    softcap = validate.check_softcap(softcap)
    dropout_p = validate.check_dropout(dropout_p)
    _flag(deterministic, "deterministic")
    _flag(return_attn_probs, "return_attn_probs")
    _flag(return_lse, "return_lse")
    pg = resolve_group(group)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    # the window over the full sequences; a bound that cannot bind becomes unbounded
    left, right = validate.unbind_window(left, right, world * dims.seqlen_q, world * dims.seqlen_k)
    sig = (dims.batch, dims.seqlen_q, dims.seqlen_k, dims.heads_q, dims.heads_k, dims.head_dim,
           LAYOUTS.index(layout), left, right, validate.SUPPORTED_DTYPES.index(q.dtype),
           *(_bits(x) for x in (scale, softcap, dropout_p)), int(deterministic), int(alibi_slopes is not None))
    _check_agreement(pg, q.device, sig)
    # refused after the agreement: a rank raising alone would leave the others waiting in a collective
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not supported by ring attention yet (use ulysses_flash_attn_func)")
    # shape checks after the agreement: no rank raises while the others wait in a collective
    if layout == "zigzag":
        for name, n in ((names[0], dims.seqlen_q), (names[1], dims.seqlen_k)):
            if n % 2:
                raise ValueError(f"{name}: a zigzag shard holds two equal chunks, so its seqlen must be even, "
                                 f"got {n} (use layout='contiguous' or pad the sequence)")
    ring = _Ring(
        group=pg, rank=rank, world=world,
        send_to=dist.get_global_rank(pg, (rank + 1) % world),
        recv_from=dist.get_global_rank(pg, (rank - 1) % world),
        layout=layout, nq=dims.seqlen_q, nk=dims.seqlen_k, scale=scale, left=left, right=right,
        softcap=softcap, dropout_p=dropout_p, deterministic=deterministic,
    )
    out, lse = _RingAttention.apply(q, k, v, ring)
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


@torch.compiler.disable
def ring_flash_attn_func(
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
    """:func:`flashtile.flash_attn_func` over a sequence sharded across the ranks of ``group``.

    q: (batch, seqlen_q / P, nheads, headdim), k, v: (batch, seqlen_k / P, nheads_k, headdim):
    this rank's shards in ``layout`` ("zigzag": chunks r and 2P - 1 - r of 2P, the balanced
    layout for causal; "contiguous": tokens [r N / P, (r + 1) N / P)); make them with
    :func:`~flashtile.distributed.zigzag_shard` / :func:`~flashtile.distributed.contiguous_shard`.
    Every rank passes the same shapes and options (ALiBi included, which raises on every rank), checked by one
    all_gather at a group's first call only (a per-call check would cost a host sync); a rank that differs
    later waits in the ring.  ``group``: None (the default group), a
    ProcessGroup or a 1-D DeviceMesh.  causal, window_size, softcap, softmax_scale, GQA and
    deterministic mean what they mean in ``flash_attn_func`` over the *full* sequences
    (bottom-right aligned); ``dropout_p`` draws one Philox state per call from the device's default
    generator and gives every kernel call of the ring its own counter range (the masks differ from
    ``flash_attn_func``'s, the distribution does not); ``alibi_slopes`` raises ``NotImplementedError``.

    Returns this rank's shard of the output (q's layout); with return_lse ``(out, lse)``, lse
    (batch, nheads, seqlen_q / P) float32; with return_attn_probs ``(out, lse, None)``.
    Differentiable in q, k, v.  ``torch.compile`` runs it eagerly (a graph break: the ring's
    point-to-point transfers are not traced).
    """
    return _run(q, k, v, ("q", "k", "v"), group, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_attn_probs, return_lse, layout)


@torch.compiler.disable
def ring_flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
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
    """:func:`ring_flash_attn_func` on qkv (batch, seqlen / P, 3, nheads, headdim); the gradient is d(qkv)."""
    q, k, v = unpack(qkv, "qkv", 3, "(batch, seqlen, 3, nheads, headdim)")
    return _run(q, k, v, ("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"), group, dropout_p, softmax_scale,
                causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, return_lse, layout)


@torch.compiler.disable
def ring_flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
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
    """:func:`ring_flash_attn_func` with kv (batch, seqlen_k / P, 2, nheads_k, headdim); gradients dq and d(kv)."""
    k, v = unpack(kv, "kv", 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return _run(q, k, v, ("q", "kv[:, :, 0]", "kv[:, :, 1]"), group, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, deterministic, return_attn_probs, return_lse, layout)
