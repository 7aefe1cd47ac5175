"""Host side of the Gluon Hopper backward (:mod:`flashtile.kernels.fa3_gluon_bwd`, FA3's Algorithm 3 with dQ by
fp32 reductions), beside the Triton one in :mod:`flashtile.runtime.fa3_bwd`.

Above d = 128 the wide kernel (:mod:`flashtile.kernels.fa3_gluon_bwd_wide`: the warpgroups split the head dim).
Dispatched where :func:`gluon_bwd_wins` says (H100, bench/NOTES.md "Gluon backward", "Dispatch sweep, backward",
"Gluon backward above 128"): every head dim from 72 to 128, 40-64 from 2k keys (packed: 4k), 136-256; ``ENABLED`` (environment
``FLASHTILE_GLUON_BWD=0`` when this module is first imported turns it off) gates the dispatch.

``fa3_gluon_backward`` has :func:`flashtile.runtime.fa3_bwd.fa3_backward`'s contract on what it covers: bf16 / fp16
(B, H, N, d) views, head dims multiple of 8 up to 256, causal (bottom-right) or not, GQA / MQA (fp32 dK / dV
partials per q head summed here), ragged Nq / Nk; results in q's dtype, written into ``dq``, ``dk``, ``dv`` when
given.  Not deterministic (dQ is summed by atomics in any order): ``deterministic=True`` raises
``NotImplementedError`` (FA2's backward is the deterministic path).  Anything else it does not cover raises
``NotImplementedError`` naming the argument, so a dispatcher can fall back.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import torch
import triton

from flashtile.kernels._common import LOG2E
from flashtile.runtime.common import check_descriptor_grid, descriptor_grid_fits, on_device
from flashtile.runtime.fa3_gluon import block_d, sm_count  # one tile-width rule for the Gluon forward and backward

__all__ = ["GluonBwdConfig", "gluon_bwd_config", "smem_bytes", "fa3_gluon_backward", "backward_into",
           "fa3_gluon_varlen_backward", "prefer_gluon_bwd_varlen", "varlen_fits", "VARLEN", "VARLEN_HEAD_DIMS",
           "VARLEN_WIDE",
           "gluon_bwd_launch", "prefer_gluon_bwd", "gluon_bwd_wins", "wide_tile_d", "GLUON_BWD_HEAD_DIMS",
           "WIDE_HEAD_DIMS", "ENABLED", "BLOCK_N", "BLOCK_M"]

GLUON_BWD_HEAD_DIMS = tuple(range(8, 257, 8))  # TMA: 16-byte rows
# the wide kernel (kernels.fa3_gluon_bwd_wide), its warpgroups splitting the head dim: tiles 192 or 256 wide
WIDE_HEAD_DIMS = tuple(range(136, 257, 8))
BLOCK_N = 128  # kv rows per program of the narrow kernel (two consumer warpgroups of 64; the wide one: 64)
BLOCK_M = 64  # q rows per inner step (GluonBwdConfig.block_m: 128 at 64-wide tiles)
SMEM_LIMIT = 227 * 1024  # sm_90 shared memory per block
BIND_LAUNCH = True  # runtime.launch (bound once per signature); False: Triton's kernel[grid] on every call
POST_BLOCK = 64  # rows per program of the dQ postprocess
# the dispatch switch (prefer_gluon_bwd)
ENABLED = os.environ.get("FLASHTILE_GLUON_BWD", "1") != "0"
# False keeps packed (varlen) backwards on FA2's kernel (:func:`fa3_gluon_varlen_backward` otherwise)
VARLEN = True
# the packed backward's head dims: the kernels with the statistics through shared memory (tiles 64 wide and more)
VARLEN_HEAD_DIMS = tuple(range(40, 257, 8))
# False keeps packed backwards above d = 128 (the wide kernel) on FA2's kernel (H100, d = 192 / 256, 64k tokens:
# fwd+bwd 1.5-2.0x through the wide kernel, bench/NOTES.md "Packed wide backward")
VARLEN_WIDE = True


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
    # the q tile's log2-scaled LSE and D rows TMA-loaded with Q_i into the ring (FA3's way, from the padded buffer
    # of stats_preprocess) and read by the consumers straight into the score columns' layout, instead of a global
    # load and a layout conversion (shared-memory round trip, its barriers) each per step
    stats_smem: bool = False
    # with dq_tma: the fp32 dQ tiles in 32-byte swizzle atoms (bank-conflict-free stores from the wgmma accumulator
    # layout; 8-column bulk reduces) instead of 128-byte ones (2-way conflicts)
    dq_swizzle32: bool = False
    # Pᵀ tiles in their own shared allocation instead of beside the dSᵀ ones: one bar.sync fewer per step (Triton's
    # barrier analysis tells allocations apart, not tiles of one)
    pt_separate: bool = False
    # with dq_split and 2 stages: the dSᵀ buffer's release (ds_empty) also frees the Q / dO ring slot (same index and
    # phase every step): one mbarrier arrive, and its two bar.sync, fewer per step
    release_once: bool = False
    # the wide kernel (d > 128): each warpgroup computes Sᵀ / dPᵀ for 32 of the 64 q columns and the two exchange
    # Pᵀ and dSᵀ through shared tiles (FA3's split), instead of both computing all 64 (two score GEMMs done twice)
    split_s: bool = False
    # GQA (narrow kernel, with stats_smem): one program per (batch, kv head, kv tile) looping over the kv head's q
    # heads, dK / dV summed in registers and stored once, instead of fp32 partials per q head summed by torch
    group_loop: bool = False
    # the ring releases, the ping-pong turns and (dq_split) the dSᵀ rendezvous on hardware named barriers (bar.arrive /
    # bar.sync, FA3's) instead of mbarriers, whose single-thread arrives Triton brackets with warpgroup bar.syncs;
    # the narrow kernel, up to 4 stages, not with release_once
    named_bars: bool = False
    # the TMA descriptors (Q, K, V, dO over (B, H, N, d), two column parts each in the wide kernel, the statistics,
    # the dQ accumulator) built on the host per call, instead of in the kernel per program (each a tensormap written
    # to global scratch and two proxy fences, serial in the producer before its first load); fixed-length calls only
    # (the wide kernel: with dq_tma)
    host_desc: bool = False
    # q rows per step: 64, or 128 (FA3's d = 64 tiles: Sᵀ / dPᵀ 64 x 128 per warpgroup, half the steps and their
    # barriers, dQ split by rows); with dq_split and stats_smem at 64-wide tiles (d = 40-64), fixed-length calls
    # without host_desc (a packed call runs 64; the table takes 128 there except with the group loop)
    block_m: int = 64
    # the wide kernel with split_s: dO in a ring of its own this deep (1: FA3's single dO buffer at d = 256, released
    # after the dV GEMM and refilled under dK / dQ, its 32 KB letting both Pᵀ / dSᵀ buffers fit beside 256-wide
    # tiles); 0: dO in the Q ring (num_stages deep)
    do_stages: int = 0
    # the narrow kernel: Pᵀ the dV GEMM's register operand (FA3's Mma_dKV_is_RS), no Pᵀ tiles, store, fence or
    # barrier; not with pt_separate (sm_90a: 601 instructions per 128-row step against 654 at d = 64; at d = 128 450
    # against 468 per step and room for a third ring stage, 231456 B; at the table's configs no spills non-causal,
    # 4-112 B causal; others spill more: docs/gluon_bwd.md)
    pt_regs: bool = False
    # causal, fixed length: the kv tiles in groups of ``lpt_heads`` (batch, head) units, the first kv tiles (which see
    # the most q tiles) of a whole group first (:func:`kv_tile_order`), instead of each unit's tiles in turn, whose
    # last unit's longest tile starts in the grid's last wave
    lpt: bool = False

    def do_depth(self) -> int:
        """The kernels' DO_STAGES: dO's ring depth."""
        return self.do_stages or self.num_stages


def smem_bytes(cfg: GluonBwdConfig, d: int, esize: int = 2) -> int:
    """Shared memory of a config: K and V (128 rows each), ``num_stages`` Q and dO tiles of ``block_m`` rows (all
    ``block_d(d)`` wide), each warpgroup's 64 x ``block_m`` Pᵀ and dSᵀ tiles (two dSᵀ with ``dq_split``), with
    ``dq_tma`` each warpgroup's fp32 64-row dQ tile (``block_d(d)`` wide, half that with ``dq_split`` at 64-row
    steps), with ``stats_smem`` ``num_stages`` pairs of ``block_m`` fp32 row statistics, under 1 KB of mbarriers
    (sm_90a compiles, Triton 3.6: 164544 B at d = 128 with 2 stages, 197360 with 3, 213776 with 3 and dq_split, 213728
    with 2, dq_split and dq_tma, 214512 with stats_smem too; 99008 / 131824 at d = 64 with 2 / 4; 231936 at 128
    rows; without the two Pᵀ tiles with ``pt_regs``).  The wide kernel (d > 128): K and V of 64 rows, the ring of
    ``num_stages`` Q and ``do_depth()`` dO tiles (``wide_tile_d(d)`` wide), two Pᵀ and two dSᵀ tiles (or two dSᵀ and
    two fp32 [64, 32] dQ tiles; all six with ``split_s`` and ``dq_tma`` at 192-wide tiles or with one dO buffer, one
    Pᵀ and one dSᵀ beside the dQ tiles at 256-wide ones otherwise), the statistics (230896 B compiled at d = 256, 2
    stages; 181744 / 231456 at d = 192, 2 / 3 stages; 214640 at 256 with ``split_s`` and one dO buffer)."""
    bd = block_d(d)
    bm = cfg.block_m
    if d in WIDE_HEAD_DIMS:
        stats = cfg.num_stages * 2 * BLOCK_M * 4
        # split_s with dq_tma: two Pᵀ / dSᵀ buffers beside the staging tiles at 192-wide tiles or with dO's own
        # single buffer, one at 256-wide ones otherwise (the kernel's DS_BUFS, fa3_gluon_bwd_wide_kernel)
        two_bufs = wide_tile_d(d) == 192 or cfg.do_depth() < cfg.num_stages
        dq_tiles = 2 * 64 * 32 * 4 if cfg.split_s and cfg.dq_tma and two_bufs else 0
        ring = (cfg.num_stages + cfg.do_depth()) * BLOCK_M
        return (2 * 64 + ring) * wide_tile_d(d) * esize + 4 * 64 * 64 * esize + dq_tiles + stats + 1024
    # [64, block_m] dSᵀ tiles (two buffers with dq_split) and Pᵀ ones (none with pt_regs)
    tiles = (4 if cfg.dq_split else 2) + (0 if cfg.pt_regs else 2)
    # each warpgroup's fp32 dQ part: 64 rows, half of d when split by columns (block_m 64)
    dq_tiles = 2 * 64 * (bd // 2 if cfg.dq_split and bm == 64 else bd) * 4 if cfg.dq_tma else 0
    stats = cfg.num_stages * 2 * bm * 4 if cfg.stats_smem else 0
    return (2 * BLOCK_N + cfg.num_stages * 2 * bm) * bd * esize + tiles * 64 * bm * esize + dq_tiles + stats + 1024


def wide_tile_d(d: int) -> int:
    """Columns of the wide kernel's tiles at head dim ``d`` (> 128): warpgroup 0 takes [0, 128), warpgroup 1
    [128, wide_tile_d(d)), 64 or 128 columns (shared tiles have power-of-two shapes: two column parts)."""
    return 192 if d <= 192 else 256


@functools.lru_cache(maxsize=None)  # per backward call: a table lookup, memoised (16 us of host time unmemoised)
def gluon_bwd_config(d: int, causal: bool, group_loop: bool = False, *,
                     block_m: int | None = None) -> GluonBwdConfig:
    """The config for head dim ``d`` (CPU-testable).  One program per SM either way (12 warps x 168 registers
    fill the register file), so the ring is as deep as shared memory allows: 4 stages at d <= 64, 2 at d <= 128
    (what fits beside the fp32 dQ tiles).  dQ split between the consumers (half the reductions each), staged in
    shared memory and reduced by TMA, and ping-pong: H100, bf16, B*N = 16k, H*d = 2048 (``scratch/gbwd_probe.py``,
    bench/NOTES.md): d = 128 443 TFLOP/s at 16k non-causal vs 371 for register reductions; d = 64 352 vs 235.
    The q tile's LSE and D through shared memory with Q (``stats_smem``) and Pᵀ in its own buffer
    (``pt_separate``): +10-16 % at 1k / 4k (d = 128: 292 / 453 vs 255 / 390 non-causal); 32-byte swizzled dQ
    tiles (``dq_swizzle32``) only at 64-wide tiles (+7 % there, -13 % at 4k with 128-wide ones).  Above 128 the
    wide kernel: 2 stages (all that fits), ping-pong, the statistics through shared memory (it has no
    other path) and dQ through 32-column staging tiles and TMA reduce-adds (``dq_tma``, Pᵀ then a register operand):
    1.06-1.41x the Triton Hopper backward and 1.13-1.30x the wide kernel's register reductions at d = 136-256,
    1k / 4k (``scratch/gwide2_probe.py``); the split score GEMMs (``split_s``; at 192-wide tiles their two Pᵀ /
    dSᵀ buffers fit beside the staging tiles: backward alone 1.08-1.23x at d = 192, 1.06-1.16x at 160, 1.03-1.07x at
    136, 1k-16k, ``scratch/gsplit192_probe.py``; at 256-wide tiles only with dO's own one-slot ring, below, on one
    buffer 0.90-1.07x: ``scratch/gsplit256_probe.py``).  ``group_loop`` (GQA, up to d = 128): the caller's
    :func:`group_loop_wins`.  ``named_bars`` stays off at 64 q rows per step (0.97-1.01x, bench/NOTES.md "Gluon
    backward: named barriers and host descriptors"); ``host_desc`` is the caller's (:func:`dispatch_config`).
    64-wide tiles (d = 40-64) take 128 q rows per step (``block_m``, FA3's d = 64 tiles: 2 stages are what fit)
    with named barriers: backward alone 1.03-1.08x the 64-row config at d = 48 / 64 from 4k keys, causal and not
    (H200, ``flashtile bench configs gluon-bwd``, bench/NOTES.md "Gluon backward: 128 q rows per step");
    ``block_m=64`` asks for the 64-row config (packed calls, host descriptors); the group loop keeps it too (128 rows
    with the group loop compile, but have not run on a GPU yet).  128-wide tiles (d = 72-128) take Pᵀ as the dV
    GEMM's register operand (``pt_regs``, FA3's Mma_dKV_is_RS): backward alone 1.02-1.08x the shared-tile config at
    d = 96 / 128, 1k-16k, causal and not, 576 TFLOP/s at d = 128 16k non-causal (H100, ``flashtile bench configs
    gluon-bwd``, bench/NOTES.md "pt_regs timed"), packed calls too (``varlen_config``).  The wide
    kernel takes dO in a one-slot ring of its own (``do_stages``, which needs ``split_s``, now at 256-wide tiles too):
    backward alone 1.02-1.13x at d = 256, 1.01-1.04x at d = 192, 1k-16k (H100, bench/NOTES.md "do_stages timed")."""
    del causal
    if block_m is not None and (isinstance(block_m, bool) or block_m not in (64, 128)):
        raise ValueError(f"block_m must be None (the table's), 64 or 128, got {block_m!r}")
    if block_m == 128 and (block_d(d) != 64 or group_loop):
        raise ValueError(f"block_m 128 is a config of 64-wide tiles without the group loop in the table, got "
                         f"head_dim {d}, group_loop {group_loop}")
    if d not in GLUON_BWD_HEAD_DIMS:
        raise NotImplementedError(f"the Gluon backward covers head dims multiple of 8 up to 256, got head_dim {d}")
    if d in WIDE_HEAD_DIMS:  # dO in its own one-slot ring beside the split score GEMMs: 1.01-1.13x (d = 192 / 256)
        return GluonBwdConfig(num_stages=2, pingpong=True, stats_smem=True, dq_tma=True, split_s=True, do_stages=1)
    if block_d(d) <= 32:  # not dispatched (gluon_bwd_wins): the configuration the GPU tests checked there
        return GluonBwdConfig(num_stages=4)
    if block_d(d) == 64 and block_m != 64 and not group_loop:
        return GluonBwdConfig(num_stages=2, dq_split=True, dq_tma=True, pingpong=True, stats_smem=True,
                              pt_separate=True, dq_swizzle32=True, named_bars=True, block_m=128)
    if block_d(d) == 128:  # Pᵀ the dV GEMM's register operand: 1.02-1.08x at d = 96 / 128 (2 stages; 3: 0.95-1.03x)
        return GluonBwdConfig(num_stages=2, dq_split=True, dq_tma=True, pingpong=True, stats_smem=True,
                              pt_regs=True, group_loop=group_loop)
    cfg = GluonBwdConfig(num_stages=4, dq_split=True, dq_tma=True, pingpong=True, stats_smem=True, pt_separate=True,
                         dq_swizzle32=block_d(d) == 64, group_loop=group_loop)
    while smem_bytes(cfg, d) > SMEM_LIMIT and cfg.num_stages > 2:
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


def varlen_config(d: int, causal: bool) -> GluonBwdConfig:
    """The packed backward's config: the table's at 64-row steps (its per-sequence padding), no group loop (fp32
    partials under GQA).  Pᵀ as a register operand (d = 72-128) and dO's own ring (d > 128) as the fixed-length
    table: packed fwd+bwd 1.04-1.06x at d = 128, 1.06-1.07x at d = 256 against the shared Pᵀ tile / dO in the Q
    ring (H100, 64k tokens of 128..8k-token sequences, bench/NOTES.md "Packed backward on the table's config")."""
    return gluon_bwd_config(d, causal, block_m=64)


def variant_base(cfg: GluonBwdConfig, d: int, causal: bool, fields: dict) -> GluonBwdConfig:
    """The config a bench variant's ``fields`` replace: for a 128-row ``cfg`` whose variant asks for 64-row steps or
    host descriptors (64-row boxes), the 64-row table config (its stages and barriers), else ``cfg``."""
    if cfg.block_m == 128 and (fields.get("block_m") == 64 or fields.get("host_desc") is True):
        return gluon_bwd_config(d, causal, cfg.group_loop, block_m=64)
    return cfg


def group_loop_wins(causal: bool, b: int, hk: int, nk: int, device_index: int) -> bool:
    """GQA (Hq > Hk) up to d = 128: one program per kv head looping over its q heads (``group_loop``) against fp32
    partials per q head summed on the host (H100, bf16, B*N = 16k, ``scratch/ggqa_probe.py``, bench/NOTES.md):
    fwd+bwd 1.0-1.45x with groups of 4 / 8 non-causal and causal at 512 or more programs; causal with 256
    programs (group 8, B*Hk = 4-16) 0.78-0.95x, the diagonal's uneven programs then filling the SMs one wave."""
    from flashtile.runtime.fa3_gluon import sm_count

    return not causal or b * hk * triton.cdiv(nk, BLOCK_N) >= 3 * sm_count(device_index)


def gluon_bwd_wins(d: int, causal: bool, nk: int, block_m: int = 128) -> bool:
    """The measured part of :func:`prefer_gluon_bwd`, against FA2's backward (H100, bf16, B*N = 16k, H*d = 2048):
    128-wide tiles (d = 72-128) backward alone 1.04-1.20x at 1k-16k (``scratch/gbwd_probe.py``), fwd+bwd through
    ``flash_attn_func`` 1.0-1.2x at 1k-4k except causal 1k at d = 80-96 (0.96-0.99x; ``flashtile bench
    dispatch``, bench/NOTES.md "Dispatch sweep, backward"); 64-wide tiles (128-row steps) fwd+bwd 1.06-1.11x at
    2k, 1.11-1.15x at 4k (d = 48, 64), 0.85-1.03x at 1k (bench/NOTES.md "... the 64-wide backward's dispatch"; at
    ``block_m`` = 64 q rows per step, the GQA group loop's and packed calls' configs, from 4k),
    backward alone 1.09-1.10x at 16k; narrower tiles unmeasured (FA2).  The wide kernel
    against the Triton Hopper backward ("Gluon backward above 128"), backward alone with dQ through TMA (the
    table's): 1.06-1.41x at d = 136-256, 1k-16k (``scratch/gwide_probe.py``, ``scratch/gwide2_probe.py``): every
    d > 128.  Causal under 1k keys with 128-wide tiles: FA2 (d = 128, 512 keys, fwd+bwd in interleaved rounds,
    ``scratch/gshort_probe.py``: 144 vs 133 TFLOP/s; at 1k 216 vs 219, 2k 306 vs 302)."""
    width = block_d(d)
    if width == 128:
        return not causal or nk >= 1024
    return (width == 64 and nk >= (2048 if block_m == 128 else 4096)) or d in WIDE_HEAD_DIMS


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
    for name in ("dq_split", "dq_tma", "pingpong", "stats_smem", "dq_swizzle32", "pt_separate", "release_once",
                 "split_s", "group_loop", "named_bars", "host_desc", "pt_regs", "lpt"):
        if not isinstance(getattr(cfg, name), bool):
            raise TypeError(f"config: {name} must be a bool, got {getattr(cfg, name)!r}")
    if d in WIDE_HEAD_DIMS:
        # the wide kernel: the statistics through shared memory; dQ by reductions from registers with Pᵀ in its own
        # tiles, or (dq_tma) through 32-column staging tiles with Pᵀ a register operand (with split_s Pᵀ is in the
        # split's shared buffers either way, and pt_separate follows dq_tma all the same); a config saying otherwise
        # would not describe what runs
        if cfg.dq_split or cfg.dq_swizzle32 or cfg.release_once or not cfg.stats_smem or \
                cfg.pt_separate == cfg.dq_tma:
            raise ValueError(f"config: above head_dim 128 only num_stages, registers, pingpong, split_s, dq_tma and "
                             f"do_stages vary (stats_smem True, pt_separate = not dq_tma, the other dQ flags False), got "
                             f"{cfg} at head_dim {d}")
    else:
        if cfg.split_s:
            raise ValueError(f"config: split_s is True only above head_dim 128 (the wide kernel), got {cfg} at "
                             f"head_dim {d}")
        if cfg.dq_tma and not cfg.dq_split and block_d(d) > 64:
            # unsplit at d > 64 each warpgroup's dQ part is 64 x 128 fp32: two 32 KB tiles do not fit beside the ring
            raise ValueError(f"config: dq_tma is True only with dq_split or head_dim <= 64, got {cfg} at "
                             f"head_dim {d}")
    if cfg.group_loop and (d in WIDE_HEAD_DIMS or not cfg.stats_smem):
        # the loop's q-head steps read each head's statistics through the ring (stats_smem); the wide kernel has none
        raise ValueError(f"config: group_loop is True only up to head_dim 128 and with stats_smem, got {cfg} at "
                         f"head_dim {d}")
    if cfg.dq_split and block_d(d) not in (64, 128):
        # each warpgroup reads half of K's columns: K is swizzled in half-rows (64 or 128 bytes), whole atoms
        raise ValueError(f"config: dq_split is True only for 32 < head_dim <= 128, got {cfg} at head_dim {d}")
    if cfg.dq_swizzle32 and not cfg.dq_tma:
        raise ValueError(f"config: dq_swizzle32 is True only with dq_tma (it lays out the shared dQ tiles), got {cfg}")
    if cfg.named_bars and (d in WIDE_HEAD_DIMS or cfg.release_once or cfg.num_stages > 4):
        # the narrow kernel's barrier ids 5-8 hold at most 4 ring slots; release_once is an mbarrier's double use
        raise ValueError(f"config: named_bars is True only up to head_dim 128, with at most 4 stages and without "
                         f"release_once, got {cfg} at head_dim {d}")
    if cfg.host_desc and d in WIDE_HEAD_DIMS and not cfg.dq_tma:
        # the wide kernel's host descriptors include the dQ staging tiles' reduce-add one
        raise ValueError(f"config: host_desc above head_dim 128 needs dq_tma, got {cfg} at head_dim {d}")
    if cfg.release_once and not (cfg.dq_split and cfg.num_stages == 2):
        raise ValueError(f"config: release_once is True only with dq_split and num_stages 2, got {cfg}")
    if not isinstance(cfg.do_stages, int) or isinstance(cfg.do_stages, bool) or cfg.do_stages not in (0, 1):
        raise ValueError(f"config: do_stages must be 0 (dO in the Q ring) or 1, got {cfg}")
    if cfg.pt_regs and (d in WIDE_HEAD_DIMS or cfg.pt_separate):
        raise ValueError(f"config: pt_regs is True only up to head_dim 128 and without pt_separate (no Pᵀ tiles), got "
                         f"{cfg} at head_dim {d}")
    if cfg.do_stages == 1 and not (d in WIDE_HEAD_DIMS and cfg.split_s):
        # dO's own ring is released after the dV GEMM of the wide kernel's split step
        raise ValueError(f"config: do_stages 1 needs the wide kernel (head_dim above 128) with split_s, got {cfg} "
                         f"at head_dim {d}")
    if not isinstance(cfg.block_m, int) or isinstance(cfg.block_m, bool) or cfg.block_m not in (64, 128):
        raise ValueError(f"config: block_m must be 64 or 128, got {cfg}")
    if cfg.block_m == 128 and (block_d(d) != 64 or d in WIDE_HEAD_DIMS or not cfg.dq_split or not cfg.stats_smem
                               or cfg.host_desc):
        # 64 x 128 fp32 Sᵀ and dPᵀ per warpgroup leave registers for dK / dV of 64 columns only
        raise ValueError(f"config: block_m 128 needs head_dim 40-64 with dq_split and stats_smem, without host_desc, "
                         f"got {cfg} at head_dim {d}")
    if smem_bytes(cfg, d, esize) > SMEM_LIMIT:
        raise ValueError(f"config {cfg} needs {smem_bytes(cfg, d, esize)} bytes of shared memory at head_dim {d}, "
                         f"over {SMEM_LIMIT}")


def _check(q, k, v, dout, out, lse) -> None:
    from flashtile.runtime.fa3_bwd import _check as check_fa3_bwd

    check_fa3_bwd(q, k, v, dout, out, lse)  # types, dtypes, shapes, GQA, one device, sm_90, descriptor-ready
    if q.shape[3] not in GLUON_BWD_HEAD_DIMS:
        raise NotImplementedError(f"the Gluon backward covers head dims multiple of 8 up to 256, got head_dim "
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
        cfg = config
    else:
        cfg = dispatch_config(q, k, causal)
    from flashtile.runtime.fa3_bwd import grad_buffers, grad_outputs, write_back

    rets = grad_outputs(dq, dk, dv, q, k, v)
    if b * hq * nq == 0 or nk == 0:
        for ret in rets:
            ret.zero_()
        return rets
    # GQA: fp32 partials per q head (one program per q head and kv tile), summed per group by write_back, unless
    # the kernel loops over the group's q heads itself (group_loop)
    partials = hq > hk and not cfg.group_loop
    bufs = grad_buffers(rets, q, k, v, partials)
    with on_device(q):
        _launch_all(dout, q, k, v, out, lse, *bufs, softmax_scale, causal, cfg)
    return write_back(rets, bufs, partials)


def backward_into(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale: float, causal: bool) -> None:
    """:func:`fa3_gluon_backward` for ``ops.autograd._bwd_impl`` after :func:`prefer_gluon_bwd`, without its
    checks: q, k, v, out, lse as the forward checked and produced them, dout with q's shape, dtype and device,
    dq, dk, dv fresh tensors with unit stride on d; q's device current."""
    b, hq, nq, _ = q.shape
    hk, nk = k.shape[1], k.shape[2]
    if b * hq * nq == 0 or nk == 0:
        for grad in (dq, dk, dv):
            grad.zero_()
        return
    cfg = dispatch_config(q, k, causal)
    if hq == hk or cfg.group_loop:
        _launch_all(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, cfg)
        return
    from flashtile.runtime.fa3_bwd import grad_buffers, write_back

    bufs = grad_buffers((dq, dk, dv), q, k, v, True)
    _launch_all(dout, q, k, v, out, lse, *bufs, softmax_scale, causal, cfg)
    write_back((dq, dk, dv), bufs, True)


# keys up to which a backward with 64-wide tiles takes host-built descriptors (``host_desc_wins``)
HOST_DESC_NARROW_MAX_KEYS = 1024


def host_desc_wins(d: int, b: int, hq: int, nq: int, nk: int, group_loop: bool) -> bool:
    """Whether the narrow kernel's descriptors are built on the host (``host_desc``): H100, bf16, B*N = 16k,
    H*d = 2048, 5 interleaved rounds (bench/NOTES.md "Gluon backward: named barriers and host descriptors"),
    backward alone host / in-kernel descriptors: d = 128 1.00-1.08x at 1k-16k (1.04 / 1.08 at 1k non-causal /
    causal; d = 72-120 share its 128-wide tiles, not timed), d = 64 1.04 / 1.11 at 1k but 0.92-0.99 from 4k, so
    64-wide tiles up to ``HOST_DESC_NARROW_MAX_KEYS`` keys only; from ``fa3_gluon.HOST_DESC_MIN_WORK`` (the
    launch encodes each descriptor on the host, tens of us a call); not with ``group_loop`` (not timed there)."""
    from flashtile.runtime.fa3_gluon import HOST_DESC_MIN_WORK

    if group_loop or d in WIDE_HEAD_DIMS or block_d(d) <= 32 or b * hq * nq * nk * d < HOST_DESC_MIN_WORK:
        return False
    return block_d(d) > 64 or nk <= HOST_DESC_NARROW_MAX_KEYS


def dispatch_config(q, k, causal: bool) -> GluonBwdConfig:
    """:func:`gluon_bwd_config` of a backward on these (B, H, N, d) views: the group loop under GQA up to d = 128
    where :func:`group_loop_wins`, host descriptors where :func:`host_desc_wins` (the launch keeps them only where
    they fit)."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    group_loop = (hq > hk and d not in WIDE_HEAD_DIMS and group_loop_wins(causal, b, hk, nk, q.device.index)
                  and _stats_fit(nq, hq // hk, 128))
    if host_desc_wins(d, b, hq, nq, nk, group_loop):
        # host descriptors have 64-row boxes: the 64-row config
        return replace(gluon_bwd_config(d, causal, group_loop, block_m=64), host_desc=True)
    return gluon_bwd_config(d, causal, group_loop)


def backward_plan(dout, q, k, v, out, lse, dq, dk, dv, causal: bool):
    """:func:`backward_into`'s launches prepared for the signature of these views (as :func:`prefer_gluon_bwd`
    accepts them, work to do; ``dq``, ``dk``, ``dv`` example gradients): a callable ``run(dout, q, k, v, out,
    lse, dq, dk, dv, softmax_scale)`` for tensors of that signature (any views with their addresses), or None
    where :func:`backward_into` does more than its three launches (fp32 partials under GQA, the statistics
    without shared memory)."""
    from flashtile.kernels.fa3_gluon_bwd import dq_postprocess_kernel, stats_preprocess_kernel
    from flashtile.runtime.fa3_fwd import ensure_allocator
    from flashtile.runtime.launch import launcher

    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    if b * hq * nq == 0 or nk == 0:
        return None
    cfg = dispatch_config(q, k, causal)
    if not (hq == hk or cfg.group_loop) or not cfg.stats_smem:
        return None
    s_grid, s_static, stats_shape, acc_shape = stats_args(out, dout, lse, True, row_pad=cfg.block_m)
    dev = q.device
    acc = torch.empty(acc_shape, dtype=torch.float32, device=dev)
    stats = torch.empty(stats_shape, dtype=torch.float32, device=dev)
    cfg = _host_desc_or_not(cfg, q, k, v, dout, stats, None)
    # the planning views' (B, H, N, d) geometry: run() gets the op's tensors, (B, N, H, d) in flash-attn's layout
    descs = (functools.partial(host_descriptors, cfg=cfg, geometry=desc_geometry(q, k, v, dout)) if cfg.host_desc
             else lambda *views: _no_descs(d))
    kernel, grid, static = gluon_bwd_args(q, k, v, dout, dk, dv, acc, causal, cfg)
    p_grid, p_static = post_args(acc, dq)
    stats_run = launcher(stats_preprocess_kernel, s_grid, (out, dout, lse, stats, acc, lse), s_static, num_warps=4,
                         num_stages=1)
    wide = d in WIDE_HEAD_DIMS
    main_run = launcher(kernel, grid, _bwd_dynamic(wide, q, k, v, dout, stats, stats, dk, dv, acc, acc, acc, 1.0,
                                                   descs(q, k, v, dout, stats, acc)),
                        static, num_warps=4, num_stages=3, bind=BIND_LAUNCH)
    post_run = launcher(dq_postprocess_kernel, p_grid, (acc, dq, acc, 1.0), p_static, num_warps=4, num_stages=1)

    def run(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale: float) -> None:
        ensure_allocator()  # device-side tensor descriptors: 128 bytes of global scratch each
        acc = torch.empty(acc_shape, dtype=torch.float32, device=dev)
        stats = torch.empty(stats_shape, dtype=torch.float32, device=dev)
        stats_run(out, dout, lse, stats, acc, lse)  # also zeroes the dQ accumulator
        main_run(*_bwd_dynamic(wide, q, k, v, dout, stats, stats, dk, dv, acc, acc, acc, softmax_scale,
                               descs(q, k, v, dout, stats, acc)))
        post_run(acc, dq, acc, float(softmax_scale))

    return run


def _launch_all(dout, q, k, v, out, lse, dq_buf, dk_buf, dv_buf, softmax_scale: float, causal: bool,
                cfg: GluonBwdConfig) -> None:
    """The statistics, the kernel into a zeroed fp32 dQ accumulator, then dQ's scaling into ``dq_buf``, on
    checked views with work to do (``dk_buf``, ``dv_buf``: fp32 per-q-head partials under GQA)."""
    from flashtile.runtime.fa3_fwd import ensure_allocator

    b, hq, nq, d = q.shape
    ensure_allocator()  # device-side tensor descriptors: 128 bytes of global scratch each
    # rows padded to whole steps (cfg.block_m rows) and BLOCK_D columns: the kernel's reductions need no mask
    acc_shape = (b * hq, triton.cdiv(nq, cfg.block_m) * cfg.block_m, block_d(d))
    if cfg.stats_smem:
        # LSE · log2 e and D in one padded (B * Hq, 2, rows) buffer, passed as the kernel's LSE (Delta unread);
        # the same kernel zeroes the accumulator
        dq_acc = torch.empty(acc_shape, dtype=torch.float32, device=q.device)
        lse = delta = stats_preprocess(out, dout, lse, dq_acc, row_pad=cfg.block_m)
    else:
        from flashtile.runtime.fa3_bwd import _preprocess

        dq_acc = torch.zeros(acc_shape, dtype=torch.float32, device=q.device)
        lse = lse.to(dtype=torch.float32).contiguous()
        delta = _preprocess(out, dout, b, hq, nq, d)
    gluon_bwd_launch(q, k, v, dout, lse, delta, dk_buf, dv_buf, dq_acc, softmax_scale, causal, cfg)
    dq_postprocess(dq_acc, dq_buf, softmax_scale)


def fa3_gluon_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                              max_seqlen_k: int, *, softmax_scale: float, causal: bool = False):
    """Gradients ``(dq, dk, dv)`` of a packed batch: q, dout, out (total_q, Hq, d), k, v (total_k, Hk, d), lse
    (Hq, total_q) natural log, int32 (B + 1,) ``cu_seqlens_*`` on q's device (causal bottom-right per sequence).
    The narrow kernel over B * Hq * cdiv(max_seqlen_k, 128) programs (above d = 128 the wide one, 64-key tiles),
    each sequence's rows from the cu_seqlens (read on the device, clamped to the tensors: a bad value gives wrong
    rows, never an access outside them); head dims 40-256 (``VARLEN_HEAD_DIMS``).  GQA through fp32 dK / dV
    partials per q head."""
    from flashtile.kernels.fa3_gluon_bwd import varlen_rows
    from flashtile.ops.validate import check_cu_seqlens, check_max_seqlen
    from flashtile.runtime.fa3_bwd import grad_buffers, write_back
    from flashtile.runtime.fa3_fwd import ensure_allocator, packed_view

    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout), ("out", out)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a (total, heads, head_dim) tensor, got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(lse, torch.Tensor) or lse.shape != (q.shape[1], q.shape[0]):
        raise ValueError(f"lse must be a (Hq, total_q) = {(q.shape[1], q.shape[0])} tensor, got "
                         f"{getattr(lse, 'shape', type(lse).__name__)}")
    qv, kv, vv, dov, ov = (packed_view(x) for x in (q, k, v, dout, out))
    _check(qv, kv, vv, dov, ov, lse.unsqueeze(0))
    d = q.shape[2]
    if d not in VARLEN_HEAD_DIMS:
        raise NotImplementedError(f"the packed Gluon backward covers head dims 40-256 (multiples of 8), got "
                                  f"head_dim {d}")
    n_seqs = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q)
    # no sequence is longer than its packed tensor (the grids are sized by these)
    max_q = min(check_max_seqlen(max_seqlen_q, "max_seqlen_q"), q.shape[0])
    max_k = min(check_max_seqlen(max_seqlen_k, "max_seqlen_k"), k.shape[0])
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    rets = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    if n_seqs == 0 or max_q == 0 or max_k == 0 or q.shape[0] == 0 or k.shape[0] == 0:
        for ret in rets:
            ret.zero_()
        return rets
    cfg = varlen_config(d, causal)
    hq, hk = q.shape[1], k.shape[1]
    partials = hq > hk
    views = tuple(packed_view(r) for r in rets)
    bufs = grad_buffers(views, qv, kv, vv, partials)
    rows = varlen_rows(q.shape[0], n_seqs)
    ensure_allocator()
    with on_device(q):
        dq_acc = torch.empty((hq, rows, block_d(d)), dtype=torch.float32, device=q.device)
        stats = stats_preprocess(ov, dov, lse.unsqueeze(0), dq_acc, varlen=(cu_q, max_q))
        gluon_bwd_launch(qv, kv, vv, dov, stats, stats, bufs[1], bufs[2], dq_acc, float(softmax_scale), causal, cfg,
                         varlen=(cu_q, cu_k, max_q, max_k))
        dq_postprocess(dq_acc, bufs[0], float(softmax_scale), varlen=(cu_q, max_q))
        write_back(views, bufs, partials)
    return rets


def prefer_gluon_bwd_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                            causal: bool, window: tuple[int, int], plain: bool, deterministic: bool,
                            max_seqlen_k: int, n_seqs: int, capability: tuple[int, int] | None = None) -> bool:
    """Whether a packed backward of ``n_seqs`` sequences (q (total_q, Hq, d), ...) runs
    :func:`fa3_gluon_varlen_backward`: ``VARLEN`` and ``ENABLED``, head dims 40-256 (40-128 without ``VARLEN_WIDE``)
    where :func:`gluon_bwd_wins`
    says so for the longest sequence's keys at 64-row steps, a batch the padded layout and the grid suit
    (:func:`varlen_fits`),
    then what :func:`prefer_gluon_bwd` asks of the views (plain, an unbounded or causal window, not
    deterministic, bf16 / fp16, descriptor-ready, sm_90).  H100, 64k tokens of 128..8k-token sequences, H 16, d = 128
    (``flashtile bench attention --varlen``, bench/NOTES.md "Packed Gluon backward"): fwd+bwd 477 / 392 TFLOP/s
    non-causal / causal against 373 / 305 with FA2's packed backward."""
    if not (VARLEN and ENABLED) or q.shape[-1] not in VARLEN_HEAD_DIMS:
        return False
    if q.shape[-1] in WIDE_HEAD_DIMS and not VARLEN_WIDE:
        return False
    if not gluon_bwd_wins(q.shape[-1], causal, max_seqlen_k, varlen_config(q.shape[-1], causal).block_m):
        return False
    from flashtile.kernels.fa3_gluon_bwd_wide import WIDE_BLOCK_N

    block_n = WIDE_BLOCK_N if q.shape[-1] in WIDE_HEAD_DIMS else BLOCK_N
    if not varlen_fits(n_seqs, q.shape[1], q.shape[0], k.shape[0], min(max_seqlen_k, k.shape[0]), block_n):
        return False
    from flashtile.kernels.fa3_gluon_bwd import varlen_rows

    if not _stats_fit(varlen_rows(q.shape[0], n_seqs), 1, 4):
        return False
    from flashtile.runtime.fa3_fwd import packed_view

    return _prefer_views(packed_view(q), packed_view(k), packed_view(v), packed_view(dout), causal, window, plain,
                         deterministic, capability)


def varlen_fits(n_seqs: int, hq: int, total_q: int, total_k: int, max_seqlen_k: int, block_n: int = BLOCK_N) -> bool:
    """Whether the packed backward's layout and grid suit a batch: the per-sequence padding of the statistics and
    the dQ accumulator (``VARLEN_PAD`` rows each) at most doubles them, and the grid (every sequence spans the
    longest one's kv tiles; an idle program returns at once, but each gets its descriptors' ~1 KB of global
    scratch) holds at most 2^18 programs or 8x those with keys (the bench's 40 sequences of 128..8k at H 16:
    41k programs, 4.6x), and whose scratch stays inside Triton's int32 offsets (``descriptor_grid_fits``);
    ``block_n`` keys per program (the wide kernel's: 64).  Otherwise FA2's packed backward (no such overheads)."""
    from flashtile.kernels.fa3_gluon_bwd import VARLEN_PAD

    programs = n_seqs * hq * triton.cdiv(max_seqlen_k, block_n)
    busy = hq * (triton.cdiv(total_k, block_n) + n_seqs)
    return (VARLEN_PAD * n_seqs <= total_q and programs <= max(8 * busy, 2**18)
            and descriptor_grid_fits(programs, backward=True))


def gluon_bwd_launch(q, k, v, dout, lse, delta, dk, dv, dq_acc, softmax_scale: float, causal: bool,
                     cfg: GluonBwdConfig, varlen=None) -> None:
    """The Gluon kernel (the wide one above d = 128) on checked views with work to do.  ``dk``, ``dv``
    (B, Hk, Nk, d) in q's dtype, or (B, Hq, Nk, d) fp32 partials when Hq > Hk; ``dq_acc`` the zeroed
    (B * Hq, Nq rounded up to cfg.block_m, block_d(d)) fp32 accumulator; the descriptor allocator installed
    (``fa3_fwd.ensure_allocator``).  With ``cfg.stats_smem`` ``lse`` is :func:`stats_preprocess`'s buffer (its rows
    padded as ``dq_acc``'s) and ``delta`` unread.  ``varlen`` = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k): a packed batch on (1, H, total, d) views, ``lse`` / ``dq_acc`` in the padded per-head layout
    of :func:`stats_preprocess` (the narrow kernel only)."""
    from flashtile.runtime.launch import launch as run_kernel

    cfg = _host_desc_or_not(cfg, q, k, v, dout, lse, varlen)
    kernel, grid, static = gluon_bwd_args(q, k, v, dout, dk, dv, dq_acc, causal, cfg, varlen)
    cu = varlen[:2] if varlen is not None else (dq_acc, dq_acc)  # unread placeholders without a packed batch
    descs = host_descriptors(q, k, v, dout, lse, dq_acc, cfg) if cfg.host_desc else _no_descs(q.shape[3])
    dynamic = _bwd_dynamic(q.shape[3] in WIDE_HEAD_DIMS, q, k, v, dout, lse, delta, dk, dv, dq_acc, *cu,
                           softmax_scale, descs)
    # num_stages is Triton's software-pipelining option, unused by Gluon (3 is its default: same cache key)
    run_kernel(kernel, grid, dynamic, static, num_warps=4, num_stages=3, bind=BIND_LAUNCH)


def _host_desc_or_not(cfg: GluonBwdConfig, q, k, v, dout, lse, varlen) -> GluonBwdConfig:
    """``cfg`` as launched: ``host_desc`` kept only on a fixed-length call that :func:`host_desc_fits` (else the
    kernel builds its descriptors, the same loads)."""
    if cfg.host_desc and (varlen is not None or not host_desc_fits(q, k, v, dout, lse.numel() if cfg.stats_smem
                                                                         else 0)):
        return replace(cfg, host_desc=False)
    return cfg


def _no_descs(d: int) -> tuple:
    """The kernel's descriptor parameters without host descriptors (constexpr Nones): 10 for the wide kernel, 6."""
    return (None,) * (10 if d in WIDE_HEAD_DIMS else 6)


def _bwd_dynamic(wide: bool, q, k, v, dout, lse, delta, dk, dv, dq_acc, cu_q, cu_k, softmax_scale: float,
                 descs: tuple) -> tuple:
    """The per-call arguments of :func:`gluon_bwd_launch`'s kernel (the ``wide`` one takes no ``delta``; ``descs``:
    :func:`host_descriptors` or :func:`_no_descs`)."""
    if wide:
        return (q, k, v, dout, lse, dk, dv, dq_acc, cu_q, cu_k, *descs, softmax_scale * LOG2E, softmax_scale)
    return (q, k, v, dout, lse, delta, dk, dv, dq_acc, cu_q, cu_k, *descs, softmax_scale * LOG2E, softmax_scale)


def host_desc_fits(q, k, v, dout, stats_numel: int) -> bool:
    """Whether a fixed-length call can take host descriptors: no expanded (stride 0) batch or head axis in q, k, v,
    dout, and the statistics' flat coordinates (``stats_numel`` floats) below 2^31 (the kernel's i32)."""
    from flashtile.runtime.fa3_gluon import _desc_strides

    return stats_numel < 2 ** 31 and all(_desc_strides(x) is not None for x in (q, k, v, dout))


def host_descriptors(q, k, v, dout, stats, dq_acc, cfg: GluonBwdConfig, geometry=None) -> tuple:
    """The narrow kernel's ``HOST_DESC`` descriptors (QDesc, KDesc, VDesc, DODesc, StatsDesc, DQDesc; the wide one's:
    :func:`_wide_host_descriptors`) over these
    views (:func:`host_desc_fits`): rank 4 over (B, H, N, d) with [1, 1, 64, block_d] boxes in the kernel's tiles'
    swizzle (K's in half rows with ``dq_split``), rank 1 over the statistics (64-float boxes; None without
    ``stats_smem``), rank 3 over the (B * Hq, rows, block_d) accumulator with the dQ staging tiles' boxes and swizzle
    (None without ``dq_tma``).  ``geometry``: :func:`desc_geometry` of the (B, H, N, d) views q, k, v, dout were
    planned on, whose addresses they have in any layout (a plan's call passes the op's own tensors); None: these
    views' own.  The kernel's arguments were checked: built bare (``fa3_gluon.bare_descriptor``)."""
    from flashtile.runtime.fa3_gluon import bare_descriptor

    if q.shape[3] in WIDE_HEAD_DIMS:
        return _wide_host_descriptors(q, k, v, dout, stats, dq_acc, geometry)
    (box4, l4, lk), stats_l, (dq_box, dq_l) = _desc_layouts(block_d(q.shape[3]), q.dtype, cfg.dq_split, cfg.dq_tma,
                                                            cfg.dq_swizzle32, cfg.stats_smem)
    xs = (q, k, v, dout)
    geometry = geometry or desc_geometry(*xs)
    descs = [bare_descriptor(x, shape, strides, box4, lk if i == 1 else l4)
             for i, (x, (shape, strides)) in enumerate(zip(xs, geometry))]
    descs.append(None if stats_l is None else bare_descriptor(stats, [stats.numel()], [1], [64], stats_l))
    descs.append(None if dq_l is None else bare_descriptor(dq_acc, list(dq_acc.shape), list(dq_acc.stride()), dq_box,
                                                           dq_l))
    return tuple(descs)


def _wide_host_descriptors(q, k, v, dout, stats, dq_acc, geometry=None) -> tuple:
    """The wide kernel's ``HOST_DESC`` descriptors (Q, Q's high part, dO, dO's, K, K's, V, V's, the statistics, the
    dQ accumulator): rank 4 over (B, H, N, d) with [1, 1, 64, 128] boxes for columns [0, 128) and [1, 1, 64,
    TILE_D - 128] ones for the rest (None at 256-wide tiles: the kernel reads both parts through the first, one
    encoding a call fewer each), the tiles' swizzles; rank 1 over the statistics; rank 3 over the (B * Hq, rows, 256)
    accumulator with [1, 64, 32] boxes (the dQ staging tiles')."""
    from flashtile.runtime.fa3_gluon import bare_descriptor

    hi = wide_tile_d(q.shape[3]) - 128
    l_lo, l_hi, stats_l, dq_l = _wide_desc_layouts(hi, q.dtype)
    geometry = geometry or desc_geometry(q, k, v, dout)
    descs = []
    for x, (shape, strides) in zip((q, dout, k, v), (geometry[0], geometry[3], geometry[1], geometry[2])):
        lo = bare_descriptor(x, shape, strides, [1, 1, 64, 128], l_lo)
        descs += [lo, None if hi == 128 else bare_descriptor(x, shape, strides, [1, 1, 64, hi], l_hi)]
    descs.append(bare_descriptor(stats, [stats.numel()], [1], [64], stats_l))
    descs.append(bare_descriptor(dq_acc, list(dq_acc.shape), list(dq_acc.stride()), [1, 64, 32], dq_l))
    return tuple(descs)


@functools.lru_cache(maxsize=None)
def _wide_desc_layouts(hi: int, dtype: torch.dtype) -> tuple:
    """The wide kernel's box layouts: its [64, 128] and [64, hi] column parts', the statistics', the rank-3 dQ staging
    tiles' ([64, 32] fp32)."""
    from triton.experimental.gluon import language as gl

    from flashtile.runtime.fa3_gluon import _box_layout

    sw = gl.NVMMASharedLayout.get_default_for([64, 32], gl.float32).swizzle_byte_width
    return (_box_layout(64, 128, dtype), _box_layout(64, hi, dtype),
            gl.NVMMASharedLayout.get_default_for([64], gl.float32),
            gl.NVMMASharedLayout(swizzle_byte_width=sw, element_bitwidth=32, rank=3))


def desc_geometry(*views) -> tuple:
    """(shape, descriptor strides) of each (B, H, N, d) view, as :func:`host_descriptors` lays its rank-4
    descriptors over them."""
    from flashtile.runtime.fa3_gluon import _desc_strides

    return tuple((list(x.shape), _desc_strides(x)) for x in views)


@functools.lru_cache(maxsize=None)
def _desc_layouts(bd: int, dtype: torch.dtype, dq_split: bool, dq_tma: bool, dq_swizzle32: bool,
                  stats_smem: bool) -> tuple:
    """((box, layout, K's layout) of the rank-4 boxes, the statistics' layout or None, (box, layout) of the dQ
    accumulator's rank-3 boxes or (None, None)): the swizzles of the kernel's shared tiles."""
    from triton.experimental.gluon import language as gl

    from flashtile.runtime.fa3_gluon import _box_layout

    l4 = _box_layout(64, bd, dtype)
    # dq_split: K swizzled in half rows, each warpgroup's column half whole swizzle atoms (the kernel's k_layout)
    lk = gl.NVMMASharedLayout(swizzle_byte_width=bd, element_bitwidth=16, rank=4) if dq_split else l4
    stats_l = gl.NVMMASharedLayout.get_default_for([64], gl.float32) if stats_smem else None
    if dq_tma:
        dqn = bd // 2 if dq_split else bd
        sw = 32 if dq_swizzle32 else gl.NVMMASharedLayout.get_default_for([64, dqn], gl.float32).swizzle_byte_width
        dq = ([1, 64, dqn], gl.NVMMASharedLayout(swizzle_byte_width=sw, element_bitwidth=32, rank=3))
    else:
        dq = (None, None)
    return ([1, 1, 64, bd], l4, lk), stats_l, dq


def _stats_fit(rows: int, heads: int, row_pad: int) -> bool:
    """Whether the 1-D statistics descriptor over ``heads`` adjacent heads of ``rows`` query rows padded to
    ``row_pad`` stays inside its int32 box coordinates."""
    return 2 * triton.cdiv(rows, row_pad) * row_pad * heads < 2**31


def lpt_heads(units: int, num_n_tiles: int, sms: int) -> int:
    """Units ((batch, head) pairs) per group of :func:`kv_tile_order`: about two waves of programs on ``sms`` SMs a
    group, so the first kv tiles of the last group start before the grid's last wave (list-scheduling model of
    one program per SM, a program's time its q steps: the last wave's idle SMs 4-7 % of the call one unit at a time
    at 1k-8k, 0-2 % this way; bench/NOTES.md "Backward tile order")."""
    return max(1, min(units, 2 * -(-sms // max(num_n_tiles, 1))))


def kv_tile_order(pid: int, num_n_tiles: int, units: int, group: int) -> tuple[int, int]:
    """(unit, kv tile) of program ``pid`` of the backward kernels' grid (``units * num_n_tiles`` programs): the host
    twin of ``kernels.fa3_gluon_bwd._kv_tile_of`` (groups of ``group`` units, tile-major inside a group, the first
    group the smaller when ``group`` does not divide ``units``)."""
    pad = (group - units % group) % group
    g = (pid + pad * num_n_tiles) // (group * num_n_tiles)
    first = max(g * group - pad, 0)
    heads = min(g * group + group - pad, units) - first
    r = pid - first * num_n_tiles
    return first + r % heads, r // heads


def _sms(device: torch.device) -> int:
    """SMs of a CUDA device (an H100's 132 for a CPU tensor: the host logic's tests)."""
    if device.type != "cuda":
        return 132
    return sm_count(device.index if device.index is not None else torch.cuda.current_device())


def gluon_bwd_args(q, k, v, dout, dk, dv, dq_acc, causal: bool, cfg: GluonBwdConfig, varlen=None) -> tuple:
    """(kernel, grid, static arguments) of :func:`gluon_bwd_launch` on these views: only shapes, strides and the
    device's SM count (``lpt``) are read (of ``varlen``, its ints and cu_seqlens_q's length); ``cfg`` as launched
    (:func:`_host_desc_or_not`)."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    total_q, total_k = nq, nk
    if varlen is not None:
        cu_q, _, nq, nk = varlen
        b = cu_q.shape[0] - 1
    wide = d in WIDE_HEAD_DIMS
    if wide or cfg.stats_smem:  # the wide kernel reads them through its 1-D descriptor always
        from flashtile.kernels.fa3_gluon_bwd import varlen_rows

        rows = varlen_rows(total_q, b) if varlen is not None else nq
        heads = hq // hk if cfg.group_loop and not wide else 1
        if not _stats_fit(rows, heads, 4 if varlen is not None else cfg.block_m):
            raise ValueError(f"the Gluon backward's statistics of {heads} head(s) x {rows} query rows exceed its "
                             f"descriptor's int32 coordinates (group_loop = {cfg.group_loop})")
    if wide:
        from flashtile.kernels.fa3_gluon_bwd_wide import WIDE_BLOCK_N as block_n
    else:
        block_n = BLOCK_N
    num_n_tiles = triton.cdiv(nk, block_n)
    group_loop = cfg.group_loop and not wide
    units = b * (hk if group_loop else hq)
    grid = (units * num_n_tiles,)
    check_descriptor_grid(grid[0], "the Gluon backward", backward=True)
    group = lpt_heads(units, num_n_tiles, _sms(q.device)) if cfg.lpt and causal and varlen is None else 1
    partial = dk.shape[1] != hk
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dk.stride()[:3],
               *dv.stride()[:3], dq_acc.stride(0), hq, hq // hk, nq, nk, num_n_tiles, group)
    if wide:
        from flashtile.kernels.fa3_gluon_bwd_wide import fa3_gluon_bwd_wide_kernel as kernel

        # constexprs, in the kernel's order
        static = (*strides, total_q, total_k, d, block_d(d), wide_tile_d(d), cfg.num_stages, bool(causal), partial,
                  cfg.consumer_regs, cfg.producer_regs, cfg.pingpong, cfg.split_s, cfg.dq_tma, varlen is not None,
                  cfg.do_depth(), cfg.host_desc)
    else:
        from flashtile.kernels.fa3_gluon_bwd import fa3_gluon_bwd_kernel as kernel

        static = (*strides, total_q, total_k, d, block_d(d), cfg.num_stages, bool(causal), partial,
                  cfg.consumer_regs, cfg.producer_regs, cfg.dq_split, cfg.dq_tma, cfg.pingpong, cfg.stats_smem,
                  cfg.dq_swizzle32, cfg.pt_separate, cfg.release_once, group_loop, varlen is not None, cfg.named_bars,
                  cfg.host_desc, cfg.block_m, cfg.pt_regs)
    return kernel, grid, static


def stats_preprocess(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                     dq_acc: torch.Tensor | None = None, varlen=None, row_pad: int = BLOCK_M) -> torch.Tensor:
    """The (B * Hq, 2, Nq rounded up to ``row_pad``) fp32 row statistics of ``stats_smem``: [:, 0] LSE · log2 e
    (+inf past Nq and where LSE is -inf), [:, 1] D = rowsum(dO∘O) (0 past Nq); ``row_pad`` the config's
    ``block_m`` (a multiple of the kernel's 64-row statistics block).  out, dout (B, Hq, Nq, d) with unit stride on d,
    lse (B, Hq, Nq) fp32 (runs in Triton's interpreter too).  ``dq_acc``: the backward's contiguous (B * Hq, rows,
    block_d(d)) fp32 accumulator, zeroed by the same kernel.  ``varlen`` = (cu_seqlens_q, max_seqlen_q): a packed
    batch, out / dout (1, Hq, total_q, d) views, lse (1, Hq, total_q); the statistics (Hq, 2 * R) and ``dq_acc`` (Hq,
    R, block_d(d)), R = ``varlen_rows(total_q, B)``, each sequence's [2, rows rounded up to 64] block at its padded
    offset (``kernels.fa3_gluon_bwd.VARLEN_PAD``)."""
    from flashtile.kernels.fa3_gluon_bwd import stats_preprocess_kernel
    from flashtile.runtime.launch import launch as run_kernel

    zero_acc = dq_acc is not None
    grid, static, stats_shape, acc_shape = stats_args(out, dout, lse, zero_acc, varlen, row_pad)
    if zero_acc and (dq_acc.shape != acc_shape or not dq_acc.is_contiguous() or dq_acc.dtype != torch.float32):
        raise ValueError(f"dq_acc must be a contiguous fp32 {acc_shape} tensor, got {tuple(dq_acc.shape)} "
                         f"{dq_acc.dtype}")
    stats = torch.empty(stats_shape, dtype=torch.float32, device=out.device)
    cu_q = varlen[0] if varlen is not None else lse  # unread without a packed batch
    run_kernel(stats_preprocess_kernel, grid, (out, dout, lse, stats, dq_acc if zero_acc else stats, cu_q), static,
               num_warps=4, num_stages=1)
    return stats


def rows_per_program(d: int) -> int:
    """Rows per program of :func:`stats_preprocess` and :func:`dq_postprocess`: 64, or where the head dim leaves
    masked columns in a tile wider than 64 (d not a multiple of 64) 4096 / block_d(d), the d = 64 tile's elements
    (sm_90a, Triton 3.6, 64 rows: the statistics took 163 registers at d = 72-120, 255 and 144 B of spills at
    d = 136-248; the dQ scaling 255 and 12 B of spills at d = 72-120 (odd multiples of 8), 254 at 136-248; with
    these rows 40-78 and 62-125 registers, no spills)."""
    bd = block_d(d)
    return BLOCK_M if d % 64 == 0 or bd <= 64 else 4096 // bd


def stats_args(out, dout, lse, zero_acc: bool, varlen=None, row_pad: int = BLOCK_M) -> tuple:
    """(grid, static arguments, statistics shape, accumulator shape) of :func:`stats_preprocess` on these views
    (shapes and strides read; of ``varlen``, cu_seqlens_q's length and max_seqlen_q)."""
    from flashtile.kernels.fa3_gluon_bwd import varlen_rows
    from flashtile.runtime.common import fold_grid

    _, hq, nq, d = out.shape
    rows_per = rows_per_program(d)  # divides 64: whole programs cover each 64-row box
    if varlen is None:
        b, total_q = out.shape[0], 0
        rows = triton.cdiv(nq, row_pad) * row_pad
        stats_shape = (b * hq, 2, rows)
        acc_shape = (b * hq, rows, block_d(d))
        tiles = rows // rows_per
    else:
        cu_q, max_q = varlen
        b, total_q = cu_q.shape[0] - 1, nq
        rows = varlen_rows(total_q, b)
        stats_shape = (hq, 2 * rows)
        acc_shape = (hq, rows, block_d(d))
        # each sequence's rows rounded up to 64 (the kernel's boxes), the longest one's included
        tiles, nq = triton.cdiv(max_q, BLOCK_M) * (BLOCK_M // rows_per), max_q
    static = (*out.stride()[:3], *dout.stride()[:3], *lse.stride(), hq, b * hq, nq, rows, total_q, d, block_d(d),
              rows_per, zero_acc, varlen is not None)
    return fold_grid(tiles, b * hq), static, stats_shape, acc_shape


def dq_postprocess(dq_acc: torch.Tensor, dq: torch.Tensor, softmax_scale: float, varlen=None) -> None:
    """dq = softmax_scale * dq_acc[:, :Nq, :d] in dq's dtype; dq (B, Hq, Nq, d) with unit stride on d (runs in
    Triton's interpreter too).  ``varlen`` = (cu_seqlens_q, max_seqlen_q): dq a (1, Hq, total_q, d) view, dq_acc
    in :func:`stats_preprocess`'s padded per-head layout."""
    from flashtile.kernels.fa3_gluon_bwd import dq_postprocess_kernel
    from flashtile.runtime.launch import launch as run_kernel

    grid, static = post_args(dq_acc, dq, varlen)
    cu_q = varlen[0] if varlen is not None else dq_acc  # unread without a packed batch
    run_kernel(dq_postprocess_kernel, grid, (dq_acc, dq, cu_q, float(softmax_scale)), static, num_warps=4,
               num_stages=1)


def post_args(dq_acc, dq, varlen=None) -> tuple:
    """(grid, static arguments) of :func:`dq_postprocess` (shapes and strides read)."""
    b, hq, nq, d = dq.shape
    total_q = 0
    if varlen is not None:
        cu_q, max_q = varlen
        b, total_q, nq = cu_q.shape[0] - 1, nq, max_q
    block = min(POST_BLOCK, rows_per_program(d))
    tiles = triton.cdiv(nq, block)
    static = (dq_acc.stride(0), dq_acc.stride(1), *dq.stride()[:3], hq, nq, tiles, total_q, d, dq_acc.shape[2],
              block, varlen is not None)
    return (b * hq * tiles,), static


def prefer_gluon_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *, causal: bool,
    window: tuple[int, int], plain: bool, deterministic: bool, capability: tuple[int, int] | None = None,
) -> bool:
    """Whether ``ops.autograd._bwd_impl`` runs the Gluon backward (:func:`backward_into`) on these (B, H, N, d)
    views: only with ``ENABLED``, then what the kernels cover: ``plain`` (no softcap, ALiBi, bias, dropout,
    block mask), an unbounded window or causal, not ``deterministic``, bf16 / fp16, head dims multiple of 8 up
    to 256, descriptor-ready q, k, v, dout on an sm_90 device; then :func:`gluon_bwd_wins` (at 64-wide tiles for
    the q rows per step of :func:`dispatch_config`'s choice)."""
    if not ENABLED or q.shape[3] not in GLUON_BWD_HEAD_DIMS or not gluon_bwd_wins(q.shape[3], causal, k.shape[2]):
        return False
    if not descriptor_grid_fits(q.shape[0] * q.shape[1] * triton.cdiv(k.shape[2], 64), backward=True):  # 64-key tiles+
        return False
    if not _stats_fit(q.shape[2], 1, 128):
        return False
    if not _prefer_views(q, k, v, dout, causal, window, plain, deterministic, capability):
        return False
    # 64-wide tiles: the threshold depends on the steps the call takes (the GQA group loop keeps 64 rows)
    return block_d(q.shape[3]) != 64 or gluon_bwd_wins(q.shape[3], causal, k.shape[2],
                                                       dispatch_config(q, k, causal).block_m)


def _prefer_views(q, k, v, dout, causal: bool, window: tuple[int, int], plain: bool, deterministic: bool,
                  capability) -> bool:
    """What the Gluon kernels ask of (B, H, N, d) views and options, the head dim aside (see
    :func:`prefer_gluon_bwd`)."""
    from flashtile.runtime.common import capability as device_capability
    from flashtile.runtime.common import hopper_target
    from flashtile.runtime.fa3_fwd import HOPPER_DTYPES, _tma_ready

    if not plain or deterministic or q.device.type != "cuda" or q.dtype not in HOPPER_DTYPES:
        return False
    left, right = window
    if left != -1 or right != (0 if causal else -1):
        return False
    if capability is None:
        capability = device_capability(q.get_device())
    return hopper_target(capability) and all(_tma_ready(x) for x in (q, k, v, dout))
