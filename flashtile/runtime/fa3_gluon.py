"""Host side of the Gluon Hopper forward (:mod:`flashtile.kernels.fa3_gluon`), a prototype beside
:mod:`flashtile.runtime.fa3_fwd` (not yet dispatched to).

``fa3_gluon_forward`` has :func:`flashtile.runtime.fa3_fwd.fa3_forward`'s contract on what it covers:
bf16 / fp16 (B, H, N, d) views, GQA / MQA, causal (bottom-right) or not, ragged Nq / Nk, ``(out, lse)``
with LSE in natural log, -inf and a zero output on rows that see no key.  Head dims 64, 128 and 256 only
(the kernel's aranges and wgmma N need a power of two >= 64); anything else raises ``NotImplementedError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton

from flashtile.kernels._common import LOG2E

__all__ = ["GluonConfig", "gluon_config", "smem_bytes", "fa3_gluon_forward", "GLUON_HEAD_DIMS", "BLOCK_M"]

GLUON_HEAD_DIMS = (64, 128, 256)
BLOCK_M = 128  # two consumer warpgroups of 64 query rows
SMEM_LIMIT = 227 * 1024  # sm_90 shared memory per block


@dataclass(frozen=True)
class GluonConfig:
    """Tile and schedule of one kernel instance (``intra`` and ``pingpong`` are the FA3 schedules)."""

    block_n: int
    num_stages: int
    intra: bool = True
    pingpong: bool = True
    consumer_regs: int = 240  # setmaxnreg of the worker consumer warpgroup (the default one gets the rest)
    producer_regs: int = 24
    o_tma: bool = False  # O through a TMA store staged in shared memory, or masked plain stores


def smem_bytes(cfg: GluonConfig, d: int, esize: int = 2) -> int:
    """Shared memory of a config: the Q tile, ``num_stages`` K and V tiles and under 1 KB of mbarriers
    (the sm_90a compile reports 164144 bytes for d = 128, 128 x 128, 2 stages: 160 KB + 48 B)."""
    return BLOCK_M * d * esize + cfg.num_stages * 2 * cfg.block_n * d * esize + 1024


def gluon_config(d: int, causal: bool) -> GluonConfig:
    """The config for head dim ``d`` (a table, CPU-testable): 128-key tiles at d <= 128 with the deepest
    ring that fits 227 KB (3 stages), 64-key tiles at d = 256 with 2 stages (Q alone is 64 KB)."""
    del causal  # one table for both until the H100 sweep says otherwise
    if d not in GLUON_HEAD_DIMS:
        raise NotImplementedError(f"the Gluon forward covers head dims {GLUON_HEAD_DIMS}, got {d}")
    if d <= 128:
        cfg = GluonConfig(block_n=128, num_stages=3)
    else:
        cfg = GluonConfig(block_n=64, num_stages=2)
    while smem_bytes(cfg, d) > SMEM_LIMIT and cfg.num_stages > 2:
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


def _check_config(cfg) -> None:
    if not isinstance(cfg, GluonConfig):
        raise TypeError(f"config must be a GluonConfig, got {type(cfg).__name__}")
    if cfg.block_n % 16 or not 16 <= cfg.block_n <= 256 or cfg.num_stages < 2:
        # a consumer frees ring slot j - 1 only after waiting for K_j: one slot would deadlock
        raise ValueError(f"config: block_n must be a multiple of 16 in [16, 256] and num_stages >= 2, got {cfg}")


def _check(q, k, v, out) -> None:
    from flashtile.runtime.fa3_fwd import _check as check_fa3

    check_fa3(q, k, v, out)  # types, dtypes, shapes, GQA, sm_90, descriptor-ready strides
    d = q.shape[3]
    if d not in GLUON_HEAD_DIMS:
        raise NotImplementedError(f"the Gluon forward covers head dims {GLUON_HEAD_DIMS}, got {d}")


def fa3_gluon_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = False,
    out: torch.Tensor | None = None,
    config: GluonConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hopper attention forward on (B, H, N, d) views through the Gluon kernel: ``(out, lse)``, as
    :func:`flashtile.runtime.fa3_fwd.fa3_forward`.  ``config`` overrides :func:`gluon_config` (ablations)."""
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    softmax_scale = float(softmax_scale)
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if config is not None:
        _check_config(config)
    _check(q, k, v, out)
    cfg = config if config is not None else gluon_config(q.shape[3], causal)
    if config is not None and smem_bytes(cfg, q.shape[3], q.element_size()) > SMEM_LIMIT:
        raise ValueError(f"config {cfg} needs {smem_bytes(cfg, q.shape[3], q.element_size())} bytes of shared "
                         f"memory at d = {q.shape[3]}, over {SMEM_LIMIT}")
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must have the shape, dtype and device of q, got {tuple(out.shape)}, {out.dtype}")
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=q.device)
    if b * hq * nq == 0:
        return out, lse
    if nk == 0:  # no keys: every row is empty
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    if softmax_scale <= 0:
        # the kernel scales the row max of raw scores, which needs a scale > 0: (-q)·k |scale| is the
        # same score exactly, and a zero scale makes every score 0, as zero queries do
        q, softmax_scale = (-q, -softmax_scale) if softmax_scale < 0 else (torch.zeros_like(q), 1.0)
    num_m_tiles = triton.cdiv(nq, BLOCK_M)
    grid = (b * hq * num_m_tiles,)
    if grid[0] >= 2**31:
        raise NotImplementedError(f"B * H * cdiv(Nq, {BLOCK_M}) = {grid[0]} programs exceed the grid's axis 0")
    from flashtile.kernels.fa3_gluon import fa3_gluon_kernel
    from flashtile.runtime.fa3_fwd import ensure_allocator

    ensure_allocator()  # device-side tensor descriptors: 128 bytes of global scratch each
    with torch.cuda.device(q.device):
        fa3_gluon_kernel[grid](
            q, k, v, out, lse, softmax_scale * LOG2E,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            hq, hq // hk, nq, nk, num_m_tiles,
            HEAD_DIM=d, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, CAUSAL=bool(causal),
            INTRA=cfg.intra, PINGPONG=cfg.pingpong, CONSUMER_REGS=cfg.consumer_regs,
            PRODUCER_REGS=cfg.producer_regs, O_TMA=cfg.o_tma, num_warps=4,
        )
    return out, lse
