"""Host side of the Gluon Hopper backward (:mod:`flashtile.kernels.fa3_gluon_bwd`, FA3's Algorithm 3 with dQ by
fp32 atomic reductions), beside the Triton one in :mod:`flashtile.runtime.fa3_bwd`.

Status: correct on an H100 (52 GPU tests; ``dq_split`` at d <= 64 and ``dq_tma`` compile for sm_90a with Triton 3.6
and wait for their GPU run, docs/gluon_bwd.md) but slower than FA2's backward, so **not dispatched**:
:func:`prefer_gluon_bwd` says False unless ``ENABLED`` is set (the probe sets
``flashtile.runtime.fa3_gluon_bwd.ENABLED = True``, or the environment has ``FLASHTILE_GLUON_BWD=1`` when this
module is first imported).

``fa3_gluon_backward`` has :func:`flashtile.runtime.fa3_bwd.fa3_backward`'s contract on what it covers: bf16 / fp16
(B, H, N, d) views, head dims multiple of 8 up to 128, causal (bottom-right) or not, GQA / MQA (fp32 dK / dV
partials per q head summed here), ragged Nq / Nk; results in q's dtype, written into ``dq``, ``dk``, ``dv`` when
given.  Not deterministic (dQ is summed by atomics in any order): ``deterministic=True`` raises
``NotImplementedError`` (FA2's backward is the deterministic path).  Anything else it does not cover raises
``NotImplementedError`` naming the argument, so a dispatcher can fall back.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton

from flashtile.kernels._common import LOG2E

__all__ = ["GluonBwdConfig", "gluon_bwd_config", "smem_bytes", "fa3_gluon_backward", "gluon_bwd_launch",
           "prefer_gluon_bwd", "GLUON_BWD_HEAD_DIMS", "ENABLED", "BLOCK_N", "BLOCK_M"]

GLUON_BWD_HEAD_DIMS = tuple(range(8, 129, 8))  # TMA: 16-byte rows; dK and dV halves fill the registers at 128
BLOCK_N = 128  # kv rows per program (two consumer warpgroups of 64)
BLOCK_M = 64  # q rows per inner step
SMEM_LIMIT = 227 * 1024  # sm_90 shared memory per block
BIND_LAUNCH = True  # runtime.launch (bound once per signature); False: Triton's kernel[grid] on every call
POST_BLOCK = 64  # rows per program of the dQ postprocess
# the dispatch switch (prefer_gluon_bwd): off until a GPU run has checked the kernel
ENABLED = os.environ.get("FLASHTILE_GLUON_BWD", "0") == "1"


def block_d(d: int) -> int:
    """Width of every tile at head dim ``d``: the next power of two, at least 16 (wgmma K step)."""
    return max(16, triton.next_power_of_2(d))


@dataclass(frozen=True)
class GluonBwdConfig:
    """Ring depth of the Q / dO loads and the partitions' registers (``setmaxnreg``)."""

    num_stages: int = 2
    consumer_regs: int = 240  # the worker consumer; the default one gets what is left, at least as much
    producer_regs: int = 24
    # 32 < d <= 128: each warpgroup adds dQ's half of d over all 128 keys (both warpgroups' dSᵀ shared, two
    # buffers, mbarriers between the consumers) instead of all of d over its 64 keys: half the reductions
    dq_split: bool = False
    # dQ parts through an fp32 shared tile per warpgroup and one TMA bulk reduce-add per step, instead of
    # red.global.add.v2.f32 from registers; with dq_split, or d <= 64 (one 64 x 64 tile per warpgroup)
    dq_tma: bool = False
    # the consumers take turns issuing each step's first two GEMMs (an mbarrier each), as the forward's ping-pong
    pingpong: bool = False


def smem_bytes(cfg: GluonBwdConfig, d: int, esize: int = 2) -> int:
    """Shared memory of a config: K and V (128 rows each), ``num_stages`` Q and dO tiles of 64 rows (all
    ``block_d(d)`` wide), each warpgroup's 64 x 64 Pᵀ and dSᵀ tiles (two dSᵀ with ``dq_split``), with ``dq_tma``
    each warpgroup's fp32 64-row dQ tile (``block_d(d)`` wide, half that with ``dq_split``), under 1 KB of
    mbarriers (sm_90a compiles, Triton 3.6: 164544 B at d = 128 with 2 stages, 197360 with 3, 213776 with 3 and
    dq_split, 213728 with 2, dq_split and dq_tma; 99008 / 131824 at d = 64 with 2 / 4)."""
    bd = block_d(d)
    tiles = 6 if cfg.dq_split else 4
    dq_tiles = 2 * BLOCK_M * (bd // 2 if cfg.dq_split else bd) * 4 if cfg.dq_tma else 0
    return (2 * BLOCK_N + cfg.num_stages * 2 * BLOCK_M) * bd * esize + tiles * 64 * 64 * esize + dq_tiles + 1024


def gluon_bwd_config(d: int, causal: bool) -> GluonBwdConfig:
    """The config for head dim ``d`` (CPU-testable).  One program per SM either way (12 warps x 168 registers
    fill the register file), so the ring is as deep as shared memory allows, up to 4 stages: 4 at d <= 64, 3 at
    d <= 128.  ``dq_split`` at d > 64: +37-140 % on an H100 at d = 128 (bench/NOTES.md, "Gluon backward");
    ``scratch/gbwd_probe.py`` times 2 stages, ``dq_split`` at d <= 64 and ``dq_tma`` against the table."""
    del causal
    if d not in GLUON_BWD_HEAD_DIMS:
        raise NotImplementedError(f"the Gluon backward covers head dims multiple of 8 up to 128, got head_dim {d}")
    split = block_d(d) == 128
    cfg = GluonBwdConfig(num_stages=4, dq_split=split)
    while smem_bytes(cfg, d) > SMEM_LIMIT or (cfg.num_stages > 3 and block_d(d) > 64):
        cfg = GluonBwdConfig(num_stages=cfg.num_stages - 1, dq_split=split)
    return cfg


def _check_config(cfg, d: int, esize: int) -> None:
    if not isinstance(cfg, GluonBwdConfig):
        raise TypeError(f"config must be a GluonBwdConfig, got {type(cfg).__name__}")
    if not isinstance(cfg.num_stages, int) or cfg.num_stages < 2:
        # both consumers release a slot before it is refilled: one slot would serialise loads and GEMMs
        raise ValueError(f"config: num_stages must be an int >= 2, got {cfg}")
    regs, preg = cfg.consumer_regs, cfg.producer_regs
    if not 24 <= preg <= regs <= 256 or regs % 8 or preg % 8:
        raise ValueError(f"config: consumer_regs / producer_regs must be multiples of 8 in [24, 256], got {cfg}")
    # setmaxnreg: two consumer warpgroups and the producer (padded to 4 warps) share 64K registers
    if 2 * regs + preg > 512:
        raise ValueError(f"config: 2 x consumer_regs + producer_regs must be <= 512, got {cfg}")
    for name in ("dq_split", "dq_tma", "pingpong"):
        if not isinstance(getattr(cfg, name), bool):
            raise TypeError(f"config: {name} must be a bool, got {getattr(cfg, name)!r}")
    if cfg.dq_split and block_d(d) not in (64, 128):
        # each warpgroup reads half of K's columns: K is swizzled in half-rows (64 or 128 bytes), whole atoms
        raise ValueError(f"config: dq_split is True only for 32 < head_dim <= 128, got {cfg} at head_dim {d}")
    if cfg.dq_tma and not cfg.dq_split and block_d(d) > 64:
        # unsplit at d > 64 each warpgroup's dQ part is 64 x 128 fp32: two 32 KB tiles do not fit beside the ring
        raise ValueError(f"config: dq_tma is True only with dq_split or head_dim <= 64, got {cfg} at head_dim {d}")
    if smem_bytes(cfg, d, esize) > SMEM_LIMIT:
        raise ValueError(f"config {cfg} needs {smem_bytes(cfg, d, esize)} bytes of shared memory at head_dim {d}, "
                         f"over {SMEM_LIMIT}")


def _check(q, k, v, dout, out, lse) -> None:
    from flashtile.runtime.fa3_bwd import _check as check_fa3_bwd

    check_fa3_bwd(q, k, v, dout, out, lse)  # types, dtypes, shapes, GQA, one device, sm_90, descriptor-ready
    if q.shape[3] not in GLUON_BWD_HEAD_DIMS:
        raise NotImplementedError(f"the Gluon backward covers head dims multiple of 8 up to 128, got head_dim "
                                  f"{q.shape[3]}")
    if q.device.type != "cuda":
        raise NotImplementedError(f"fa3_gluon_backward needs an sm_90 (Hopper) CUDA device, got q on {q.device}")


def fa3_gluon_backward(
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
    config: GluonBwdConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` on (B, H, N, d) views, the contract of
    :func:`flashtile.runtime.fa3_bwd.fa3_backward`: q, dout, out (B, Hq, Nq, d), k, v (B, Hk, Nk, d), lse
    (B, Hq, Nq) natural log (-inf rows contribute nothing).  ``config`` overrides :func:`gluon_bwd_config`."""
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    softmax_scale = float(softmax_scale)
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if deterministic:
        raise NotImplementedError("deterministic=True: the Gluon backward sums dQ by atomics in any order; "
                                  "FA2's backward (runtime.fa2_bwd) is the deterministic path")
    _check(q, k, v, dout, out, lse)
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    if config is not None:
        _check_config(config, d, q.element_size())
    cfg = config if config is not None else gluon_bwd_config(d, causal)
    from flashtile.runtime.fa3_bwd import _preprocess, grad_buffers, grad_outputs, write_back
    from flashtile.runtime.fa3_fwd import ensure_allocator

    rets = grad_outputs(dq, dk, dv, q, k, v)
    if b * hq * nq == 0 or nk == 0:
        for ret in rets:
            ret.zero_()
        return rets
    lse = lse.to(dtype=torch.float32).contiguous()
    # GQA: fp32 partials per q head (one program per q head and kv tile), summed per group by write_back
    partials = hq > hk
    dq_buf, dk_buf, dv_buf = bufs = grad_buffers(rets, q, k, v, partials)
    ensure_allocator()  # device-side tensor descriptors: 128 bytes of global scratch each
    with torch.cuda.device(q.device):
        delta = _preprocess(out, dout, b, hq, nq, d)
        # rows padded to a multiple of 64 and BLOCK_D columns: the kernel's reductions need no mask
        dq_acc = torch.zeros((b * hq, triton.cdiv(nq, BLOCK_M) * BLOCK_M, block_d(d)), dtype=torch.float32,
                             device=q.device)
        gluon_bwd_launch(q, k, v, dout, lse, delta, dk_buf, dv_buf, dq_acc, softmax_scale, causal, cfg)
        dq_postprocess(dq_acc, dq_buf, softmax_scale)
    return write_back(rets, bufs, partials)


def gluon_bwd_launch(q, k, v, dout, lse, delta, dk, dv, dq_acc, softmax_scale: float, causal: bool,
                     cfg: GluonBwdConfig) -> None:
    """The Gluon kernel on checked views with work to do.  ``dk``, ``dv`` (B, Hk, Nk, d) in q's dtype, or
    (B, Hq, Nk, d) fp32 partials when Hq > Hk; ``dq_acc`` the zeroed (B * Hq, Nq rounded up to 64, block_d(d))
    fp32 accumulator; the descriptor allocator installed (``fa3_fwd.ensure_allocator``)."""
    from flashtile.kernels.fa3_gluon_bwd import fa3_gluon_bwd_kernel
    from flashtile.runtime.launch import launch as run_kernel

    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    num_n_tiles = triton.cdiv(nk, BLOCK_N)
    grid = (b * hq * num_n_tiles,)
    if grid[0] >= 2**31:
        raise NotImplementedError(f"B * Hq * cdiv(Nk, {BLOCK_N}) = {grid[0]} programs exceed the grid's axis 0")
    partial = dk.shape[1] != hk
    dynamic = (q, k, v, dout, lse, delta, dk, dv, dq_acc, softmax_scale * LOG2E, softmax_scale)
    static = (
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
        dq_acc.stride(0), hq, hq // hk, nq, nk, num_n_tiles,
        # constexprs, in the kernel's order
        d, block_d(d), cfg.num_stages, bool(causal), partial, cfg.consumer_regs, cfg.producer_regs, cfg.dq_split,
        cfg.dq_tma, cfg.pingpong,
    )
    # num_stages is Triton's software-pipelining option, unused by Gluon (3 is its default: same cache key)
    run_kernel(fa3_gluon_bwd_kernel, grid, dynamic, static, num_warps=4, num_stages=3, bind=BIND_LAUNCH)


def dq_postprocess(dq_acc: torch.Tensor, dq: torch.Tensor, softmax_scale: float) -> None:
    """dq = softmax_scale * dq_acc[:, :Nq, :d] in dq's dtype; dq (B, Hq, Nq, d) with unit stride on d (runs in
    Triton's interpreter too)."""
    from flashtile.kernels.fa3_gluon_bwd import dq_postprocess_kernel
    from flashtile.runtime.launch import launch as run_kernel

    b, hq, nq, d = dq.shape
    tiles = triton.cdiv(nq, POST_BLOCK)
    grid = (b * hq * tiles,)
    static = (dq_acc.stride(0), dq_acc.stride(1), *dq.stride()[:3], hq, nq, tiles, d, dq_acc.shape[2], POST_BLOCK)
    run_kernel(dq_postprocess_kernel, grid, (dq_acc, dq, float(softmax_scale)), static, num_warps=4, num_stages=1)


def prefer_gluon_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *, causal: bool,
    window: tuple[int, int], plain: bool, deterministic: bool, capability: tuple[int, int] | None = None,
) -> bool:
    """Whether ``ops.autograd._bwd_impl`` runs :func:`fa3_gluon_backward` on these (B, H, N, d) views: only with
    ``ENABLED`` (off by default), then what the kernel covers: ``plain`` (no softcap, ALiBi, bias, dropout,
    block mask), an unbounded window or causal, not ``deterministic``, bf16 / fp16, head dims multiple of 8 up
    to 128, descriptor-ready q, k, v, dout on an sm_90 device."""
    if not ENABLED:
        return False
    from flashtile.runtime.common import capability as device_capability
    from flashtile.runtime.fa3_fwd import HOPPER_DTYPES, _tma_ready

    if not plain or deterministic or q.device.type != "cuda" or q.dtype not in HOPPER_DTYPES:
        return False
    left, right = window
    if left != -1 or right != (0 if causal else -1) or q.shape[3] not in GLUON_BWD_HEAD_DIMS:
        return False
    if capability is None:
        capability = device_capability(q.get_device())
    return capability == (9, 0) and all(_tma_ready(x) for x in (q, k, v, dout))
