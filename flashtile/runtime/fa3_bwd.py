"""Host side of the Hopper backward kernels (:mod:`flashtile.kernels.fa3_bwd`).

``fa3_backward`` owns the grids, the strides, the tile choice per head dim and the GQA
reduction; D = rowsum(dO o O) comes from FA2's preprocess kernel.  It covers what the kernels
cover: bf16 / fp16, head dims 8..256 in steps of 8, causal (bottom-right) or not, GQA/MQA,
ragged Nq / Nk, LSE from either forward; anything else raises ``NotImplementedError`` so that a
dispatcher falls back to :func:`flashtile.runtime.fa2_bwd.fa2_backward`.  Deterministic (dQ has
one writer per row, GQA partials are summed in a fixed order) unless the config asks for atomic dQ
and the caller passes ``deterministic=False``.  ``ops.autograd._bwd_impl`` calls it where
:func:`prefer_hopper_bwd` says so (head dims above 128, :func:`hopper_bwd_wins`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import triton

from flashtile.runtime.common import capability as device_capability
from flashtile.runtime.common import hopper_target, require_hopper
from flashtile.runtime.common import check_descriptor_grid, descriptor_grid_fits
from flashtile.runtime.fa3_fwd import HOPPER_DTYPES, SMEM_LIMIT, SUPPORTED_HEAD_DIMS, ensure_allocator, _tma_ready
from flashtile.runtime.fa3_gluon import block_d, head_split

__all__ = ["Fa3BwdConfig", "fa3_bwd_config", "bwd_widths", "FA3_BWD_WIDE", "fa3_backward", "prefer_hopper_bwd",
           "hopper_bwd_wins", "ENABLED", "smem_bytes_dkdv", "smem_bytes_dq"]


@dataclass(frozen=True)
class Fa3BwdConfig:
    """Tiles and launch options of the two kernels: dK/dV (``block_n`` kv rows per program, ``block_m`` q rows
    per step) and dQ (``dq_block_m`` q rows per program, ``dq_block_n`` kv rows per step)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_spec: bool
    dq_block_m: int
    dq_block_n: int
    dq_num_warps: int
    dq_num_stages: int
    dq_warp_spec: bool
    atomic_dq: bool = False  # unspecialised dK/dV only, when the caller allows non-determinism: dQ by fp32 atomics
    split_d: bool = True  # a head dim that is not a power of two as two power-of-two column parts (head_split)

    def widths(self, d: int) -> tuple[int, int]:
        """The kernels' (BLOCK_D0, BLOCK_D1) at head dim ``d`` (:func:`bwd_widths`)."""
        return bwd_widths(d, self.split_d)


@functools.lru_cache(maxsize=None)  # on every launch
def bwd_widths(d: int, split: bool = True) -> tuple[int, int]:
    """(BLOCK_D0, BLOCK_D1) at head dim ``d``: ``head_split`` where its two parts are narrower than
    ``block_d(d)`` (d = 136-192: 128 + 16..64; 40-48, 72-96), else one part of ``block_d(d)`` (BLOCK_D1 = 0)."""
    d0, d1 = head_split(d, split)
    return (d0, d1) if d0 + d1 < block_d(d) else (block_d(d), 0)


# d > 128 as one next_power_of_2(d) part, 32 x 64 dK/dV tiles: the baseline scratch/bsplit_probe.py times the table against
FA3_BWD_WIDE = Fa3BwdConfig(32, 64, 8, 2, False, 128, 64, 8, 1, False, split_d=False)


def fa3_bwd_config(d: int, causal: bool) -> Fa3BwdConfig:
    """The config for head dim ``d`` (a table, CPU-testable).  d <= 128 (not dispatched there: the Gluon
    backward or FA2's run): warp-specialised dK/dV with two consumers of 64 kv rows.  Above 128, the H100 probe
    (``scratch/bsplit_probe.py``, bench/NOTES.md "Hopper backward, head-dim split"; bf16, B*N = 16k): dK/dV
    unspecialised 64 q x 64 kv rows over 8 warps, 2 stages, dQ 128 q x 32 kv rows, 2 stages — 1.20-1.45x
    ``FA3_BWD_WIDE`` at d = 192 (split), 1.22-1.57x at 160, 1.08-1.24x at 256, the best candidate everywhere."""
    del causal  # one row per tile width so far
    if d <= 128:
        return Fa3BwdConfig(64, 128, 4, 2, True, 128, 64, 8, 2, False)
    return Fa3BwdConfig(64, 64, 8, 2, False, 128, 32, 8, 2, False)


def smem_bytes_dkdv(cfg: Fa3BwdConfig, d: int, esize: int = 2) -> int:
    """Shared memory of the dK/dV kernel as Triton 3.6 lays it out for sm_90a (compile reports, offline):
    K, V tiles, a ring of ``num_stages`` Q, dO tiles (all ``sum(cfg.widths(d))`` wide), with specialisation
    one more (BLOCK_N, BLOCK_M) tile (a score tile staged between the consumers' wgmmas), under 1 KB of barriers."""
    bd = sum(cfg.widths(d))
    ws = cfg.block_n * cfg.block_m * esize if cfg.warp_spec else 0
    return 2 * cfg.block_n * bd * esize + cfg.num_stages * 2 * cfg.block_m * bd * esize + ws + 1024


def smem_bytes_dq(cfg: Fa3BwdConfig, d: int, esize: int = 2) -> int:
    """Shared memory of the unspecialised dQ kernel: Q, dO tiles, a ring of K, V tiles (``sum(cfg.widths(d))``
    wide), under 1 KB of barriers."""
    bd = sum(cfg.widths(d))
    return 2 * cfg.dq_block_m * bd * esize + cfg.dq_num_stages * 2 * cfg.dq_block_n * bd * esize + 1024


# False sends every backward to the FA2 kernels (benchmarks and tests compare the two paths)
ENABLED = True


def hopper_bwd_wins(d: int, causal: bool, nk: int) -> bool:
    """The measured part of :func:`prefer_hopper_bwd`.  H100, bf16, B*N = 16k, H*d = 2048 (bench/NOTES.md,
    "Hopper backward, first GPU run"), backward alone against FA2's: d = 256 1.4-1.6x without a mask
    (170-197 vs 107-120 TFLOP/s), 1.05-1.2x causal; at d = 64 and 128 FA2's backward is faster (0.78-0.98x)."""
    del causal, nk
    return d > 128


def prefer_hopper_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *, causal: bool,
    window: tuple[int, int], plain: bool, capability: tuple[int, int] | None = None,
) -> bool:
    """Whether the backward on (B, H, N, d) views runs the Hopper kernels instead of FA2's.

    ``plain``: no softcap, ALiBi, bias, dropout or block mask; the window must be unbounded, or
    causal; q, k, v, dout descriptor-ready (``dout`` is the one most likely not to be; O is read by
    pointers); then :func:`hopper_bwd_wins` decides.  Called from ``ops.autograd._bwd_impl`` as
    ``prefer_hopper_bwd(qb, kb, vb, dob, causal=causal, window=(window_left, window_right), plain=plain)``
    with ``plain`` as in ``_fwd_impl``, then ``fa3_backward(dob, qb, kb, vb, ob, lse, softmax_scale=...,
    causal=causal, deterministic=deterministic, dq=..., dk=..., dv=...)`` on the same (B, H, N, d) views."""
    # both kernels' grids (64-row tiles and wider) inside their descriptors' scratch
    if not descriptor_grid_fits(q.shape[0] * q.shape[1] * triton.cdiv(max(q.shape[2], k.shape[2]), 64), backward=True):
        return False
    if not (ENABLED and plain) or q.device.type != "cuda" or q.dtype not in HOPPER_DTYPES:
        return False
    left, right = window
    if left != -1 or right != (0 if causal else -1):
        return False
    if not hopper_bwd_wins(q.shape[3], causal, k.shape[2]):
        return False
    if capability is None:
        capability = device_capability(q.get_device())
    return hopper_target(capability) and all(_tma_ready(x) for x in (q, k, v, dout))


def _check(q, k, v, dout, out, lse) -> None:
    for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (B, H, N, d) tensor")
    if q.dtype not in HOPPER_DTYPES or any(x.dtype != q.dtype for x in (k, v, dout, out)):
        raise NotImplementedError(f"fa3_backward covers fp16 / bf16 q, k, v, dout, out of one dtype, got {q.dtype}, "
                                  f"{k.dtype}, {v.dtype}, {dout.dtype}, {out.dtype}")
    b, hq, nq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} must match q {tuple(q.shape)} in batch and head_dim")
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(f"dout {tuple(dout.shape)} and out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (b, hq, nq):
        raise ValueError(f"lse must be a (B, Hq, Nq) = {(b, hq, nq)} tensor")
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({k.shape[1]})")
    if d not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"fa3_backward covers head dims multiple of 8 up to 256, got {d}")
    dev = q.device
    if any(x.device != dev for x in (k, v, dout, out, lse)):
        raise ValueError("q, k, v, dout, out and lse must be on one device")
    if dev.type == "cuda":
        require_hopper("fa3_backward", q.get_device())
    for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        if not _tma_ready(x):
            raise NotImplementedError(
                f"{name}: fa3_backward needs unit stride on d, a nonzero row stride, 16-byte aligned base and strides"
            )
    if out.stride(3) != 1:  # D = rowsum(dO o O) reads O's rows by pointers, columns adjacent
        raise NotImplementedError(f"out: fa3_backward needs unit stride on d, got strides {tuple(out.stride())}")


def _grad_out(given, like: torch.Tensor, name: str) -> torch.Tensor:
    if given is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if not isinstance(given, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(given).__name__}")
    if tuple(given.shape) != tuple(like.shape) or given.dtype != like.dtype or given.device != like.device:
        raise ValueError(f"{name} must have the shape, dtype and device of its input, got {tuple(given.shape)}, "
                         f"{given.dtype}, {given.device}")
    return given


def grad_outputs(dq, dk, dv, q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients' destinations: the given views (checked against their inputs) or new tensors."""
    return _grad_out(dq, q, "dq"), _grad_out(dk, k, "dk"), _grad_out(dv, v, "dv")


def grad_buffers(rets, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, partials: bool):
    """Where the kernels write: a destination with unit stride on d itself, else a buffer like its input;
    ``partials``: dK / dV as fp32 per q head (B, Hq, Nk, d), summed per group by :func:`write_back`."""
    dq_ret, dk_ret, dv_ret = rets
    dq_buf = dq_ret if dq_ret.stride(-1) == 1 else torch.empty_like(q)
    if partials:
        shape = (q.shape[0], q.shape[1], k.shape[2], k.shape[3])
        return dq_buf, *(torch.empty(shape, dtype=torch.float32, device=q.device) for _ in range(2))
    dk_buf = dk_ret if dk_ret.stride(-1) == 1 else torch.empty_like(k)
    dv_buf = dv_ret if dv_ret.stride(-1) == 1 else torch.empty_like(v)
    return dq_buf, dk_buf, dv_buf


def write_back(rets, bufs, partials: bool):
    """Copy each buffer into its destination (dK / dV ``partials`` summed over each kv head's q heads)."""
    (dq_ret, dk_ret, dv_ret), (dq_buf, dk_buf, dv_buf) = rets, bufs
    if partials:
        b, hk, nk, d = dk_ret.shape
        group = dk_buf.shape[1] // hk
        dk_ret.copy_(dk_buf.view(b, hk, group, nk, d).sum(2))
        dv_ret.copy_(dv_buf.view(b, hk, group, nk, d).sum(2))
    else:
        if dk_buf is not dk_ret:
            dk_ret.copy_(dk_buf)
        if dv_buf is not dv_ret:
            dv_ret.copy_(dv_buf)
    if dq_buf is not dq_ret:
        dq_ret.copy_(dq_buf)
    return dq_ret, dk_ret, dv_ret


def fa3_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = False,
    deterministic: bool = False,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    config: Fa3BwdConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) on (B, H, N, d) views, the contract of
    :func:`flashtile.runtime.fa2_bwd.fa2_backward` for the plain case: q, dout, out (B, Hq, Nq, d),
    k, v (B, Hk, Nk, d), lse (B, Hq, Nq) natural log (-inf rows contribute nothing); results in q's
    dtype, written into ``dq``, ``dk``, ``dv`` when given (any strides).  ``deterministic=False``
    lets an unspecialised config with ``atomic_dq`` accumulate dQ by fp32 atomics in the dK/dV kernel
    instead of running the dQ kernel.  ``config`` overrides the table (probes)."""
    _check(q, k, v, dout, out, lse)
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    rets = grad_outputs(dq, dk, dv, q, k, v)
    if b * hq * nq == 0 or nk == 0:
        for ret in rets:
            ret.zero_()
        return rets
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {scale}")
    cfg = config or fa3_bwd_config(d, causal)
    group = hq // hk
    dev = q.device
    lse = lse.to(dtype=torch.float32).contiguous()
    group_loop = group > 1 and not cfg.warp_spec  # unspecialised: the group's q heads in the kernel
    # specialised with GQA: fp32 partials per q head (one program per q head: one WS loop)
    partials = group > 1 and not group_loop
    dq_buf, dk_buf, dv_buf = bufs = grad_buffers(rets, q, k, v, partials)

    atomic = cfg.atomic_dq and not cfg.warp_spec and not deterministic
    if dev.type == "cuda":
        ensure_allocator()
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        dq_acc = torch.zeros((b, hq, nq, d), dtype=torch.float32, device=dev) if atomic else None
        delta = _preprocess(out, dout, b, hq, nq, d)
        launch_dkdv(q, k, v, dout, lse, delta, dk_buf, dv_buf, scale, causal, cfg, group_loop, dq_acc)
        if atomic:
            dq_buf.copy_(dq_acc)
        else:
            launch_dq(q, k, v, dout, lse, delta, dq_buf, scale, causal, cfg)

    return write_back(rets, bufs, partials)


def _preprocess(out, dout, b, hq, nq, d) -> torch.Tensor:
    """D = rowsum(dO o O), (B, Hq, Nq) float32, by FA2's preprocess kernel."""
    from flashtile.kernels.fa2_bwd import _bwd_preprocess
    from flashtile.runtime.common import fold_grid
    from flashtile.runtime.launch import launch as run_kernel

    block = 128 if out.is_cuda else 32
    delta = torch.empty(b, hq, nq, dtype=torch.float32, device=out.device)
    wide = max(nq * out.stride(2), nq * dout.stride(2)) >= 2**31
    run_kernel(
        _bwd_preprocess, fold_grid(triton.cdiv(nq, block), b * hq), (out, dout, delta, delta),
        (out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
         hq, b * hq, nq, nq, d, max(16, triton.next_power_of_2(d)), block, False, wide, False),
        num_warps=4, num_stages=1,
    )
    return delta


def launch_dkdv(q, k, v, dout, lse, delta, dk, dv, scale: float, causal: bool, cfg: Fa3BwdConfig,
                group_loop: bool = False, dq_acc: torch.Tensor | None = None) -> None:
    """The dK/dV kernel on checked views; ``dk``, ``dv`` indexed (B, Hk, Nk, d), or (B, Hq, Nk, d) GQA
    partials unless ``group_loop`` (unspecialised configs: the kernel sweeps each group's q heads).
    ``dq_acc``: a zeroed fp32 (B, Hq, Nq, d) buffer that the kernel adds dQ into (unspecialised only)."""
    from flashtile.kernels.fa3_bwd import fa3_bwd_dkdv_kernel
    from flashtile.runtime.launch import launch as run_kernel

    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    num_n_tiles = triton.cdiv(nk, cfg.block_n)
    grid = (b * (hk if group_loop else hq) * num_n_tiles,)
    check_descriptor_grid(grid[0], "the Hopper dK/dV kernel", backward=True)
    static = (
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
        *(dq_acc.stride()[:3] if dq_acc is not None else (0, 0, 0)),
        hq, hq // hk, nq, nk, num_n_tiles,
        # HEAD_DIM, BLOCK_D0, BLOCK_D1, BLOCK_M, BLOCK_N, LOG2_BLOCK_N, CAUSAL, WARP_SPEC, GROUP_LOOP, ATOMIC_DQ
        d, *cfg.widths(d), cfg.block_m, cfg.block_n, cfg.block_n.bit_length() - 1,
        bool(causal), cfg.warp_spec, bool(group_loop), dq_acc is not None,
    )
    acc = dq_acc if dq_acc is not None else delta  # unread placeholder without atomics
    run_kernel(fa3_bwd_dkdv_kernel, grid, (q, k, v, dout, lse, delta, dk, dv, acc, float(scale)), static,
               num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def launch_dq(q, k, v, dout, lse, delta, dq, scale: float, causal: bool, cfg: Fa3BwdConfig) -> None:
    """The dQ kernel on checked views."""
    from flashtile.kernels.fa3_bwd import fa3_bwd_dq_kernel
    from flashtile.runtime.launch import launch as run_kernel

    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    num_m_tiles = triton.cdiv(nq, cfg.dq_block_m)
    grid = (b * hq * num_m_tiles,)
    check_descriptor_grid(grid[0], "the Hopper dQ kernel", backward=True)
    static = (
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dq.stride()[:3],
        hq, hq // hk, nq, nk, num_m_tiles,
        # HEAD_DIM, BLOCK_D0, BLOCK_D1, BLOCK_M, LOG2_BLOCK_M, BLOCK_N, CAUSAL, WARP_SPEC
        d, *cfg.widths(d), cfg.dq_block_m, cfg.dq_block_m.bit_length() - 1, cfg.dq_block_n,
        bool(causal), cfg.dq_warp_spec,
    )
    run_kernel(fa3_bwd_dq_kernel, grid, (q, k, v, dout, lse, delta, dq, float(scale)), static,
               num_warps=cfg.dq_num_warps, num_stages=cfg.dq_num_stages)
