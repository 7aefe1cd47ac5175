"""Host side of the Gluon Hopper forward (:mod:`flashtile.kernels.fa3_gluon`), beside the Triton one in
:mod:`flashtile.runtime.fa3_fwd`, whose ``fa3_forward`` runs it where ``use_gluon`` says (32 < d <= 192 and
d = 256; packed batches up to d = 192).

``fa3_gluon_forward`` has :func:`flashtile.runtime.fa3_fwd.fa3_forward`'s contract on what it covers:
bf16 / fp16 (B, H, N, d) views, GQA / MQA, causal (bottom-right) or not, ragged Nq / Nk, ``(out, lse)``
with LSE in natural log, -inf and a zero output on rows that see no key.  Head dims: every multiple of 8 up
to 256, tiled as one power of two or, split (``head_split``), as two (d = 96: 64 + 32); TMA zero-fills the
columns past d.
Launches are bound once per problem signature (:func:`flashtile.runtime.launch.launch`); ``BIND_LAUNCH =
False`` sends every call through Triton's own ``kernel[grid]`` path instead.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton

from flashtile.kernels._common import LOG2E
from flashtile.runtime.common import check_descriptor_grid, fold_grid, on_device
from flashtile.runtime.fa3_fwd import _check as check_fa3
from flashtile.runtime.fa3_fwd import ensure_allocator, outputs, positive_scale

__all__ = ["GluonConfig", "gluon_config", "gluon_fp8_config", "FP8_WIDTHS", "fp8_v_operand", "fp8_v_shape",
           "fp8_v_args", "smem_bytes", "fa3_gluon_forward", "gluon_launch",
           "GLUON_HEAD_DIMS", "BLOCK_M", "block_d", "head_split", "sm_count"]

GLUON_HEAD_DIMS = tuple(range(8, 257, 8))  # TMA needs 16-byte rows: d a multiple of 8 (2-byte dtypes)
BLOCK_M = 128  # query rows of the default two consumer warpgroups (64 each); GluonConfig.block_m in general
SMEM_LIMIT = 227 * 1024  # sm_90 shared memory per block
BIND_LAUNCH = True  # runtime.launch (bound once per signature); False: Triton's kernel[grid] on every call


def block_d(d: int) -> int:
    """Width of every tile at head dim ``d``: the next power of two, at least 16 (wgmma K step)."""
    return max(16, 1 << (d - 1).bit_length())  # not triton.next_power_of_2: several calls per backward


@functools.lru_cache(maxsize=None)
def head_split(d: int, split: bool = True) -> tuple[int, int]:
    """The kernel's (BLOCK_D0, BLOCK_D1): tiles of columns [0, D0) and [D0, D0 + D1) covering head dim ``d``.
    Split (``split`` and d > 16 not a power of two): D0 the largest power of two below d, D1 the next power
    of two >= max(d - D0, 16) (d = 96: 64 + 32, 80: 64 + 16, 112: 64 + 64, 192: 128 + 64); otherwise
    (``block_d(d)``, 0)."""
    bd = block_d(d)
    if not split or d <= 16 or bd == d:
        return bd, 0
    d0 = bd // 2
    return d0, block_d(d - d0)


@dataclass(frozen=True)
class GluonConfig:
    """Tile and schedule of one kernel instance (``intra`` and ``pingpong`` are the FA3 schedules)."""

    block_n: int
    num_stages: int
    intra: bool = True
    pingpong: bool = True
    consumer_regs: int = 0  # setmaxnreg of the worker consumers (the default one gets the rest); 0: regs()
    producer_regs: int = 0  # setmaxnreg of the producer; 0: producer()
    o_tma: bool = False  # O through a TMA store staged in shared memory, or masked plain stores
    num_wg: int = 2  # consumer warpgroups of 64 query rows each (2 or 3; FA3 runs 3 at d = 64)
    skip_mask0: bool = True  # tile 0 unmasked when every row of the program sees all of it
    o_coalesced: bool = False  # plain stores through a row-contiguous layout (16 B per thread), not o_tma
    lpt_group: int = 0  # causal: longest tiles first across groups of this many heads (0: per head)
    split_d: bool = True  # a head dim that is not a power of two as two power-of-two parts (head_split)
    persistent: bool = False  # min(tiles, SMs) programs looping over the tiles (sm_count), not one per tile
    # TMA descriptors built on the host (kernel parameters over the (B, H, N, d) views), not per tile in the kernel
    host_desc: bool = False
    # persistent only: each program's tiles after its first claimed from a global counter in the tile order
    # (dynamic scheduling, FA3's for causal), not the static round robin pid, pid + P, ...
    dynamic: bool = False
    # intra only: the softmax as a block of its own, ptxas's P V wait after it (docs/gluon_fa3.md; H100 geomean 1.0)
    fence: bool = False
    # 16-bit: P rounded in pairs by one opaque cvt each, carried packed (the same rounding; sm_90a: 477 vs 502
    # instructions per d = 128 iteration, no PRMT); FP8 rounds its own operand
    pack_p: bool = False
    # the ring slots' releases and the ping-pong turns on hardware named barriers (bar.arrive / bar.sync, FA3's
    # turns) instead of mbarriers, whose single-thread arrive Triton precedes with a warpgroup bar.sync (3 a kv tile);
    # off: 0.99-1.01x at d = 128 (H200, bench/NOTES.md "Gluon backward: 128 q rows per step")
    named_bars: bool = False
    # causal: a consumer warpgroup whose rows see no key of a program's last kv tiles (64-key tiles under 128 rows,
    # 128-key tiles under 192) skips their GEMMs and softmax, only releasing the slots and passing its turns
    wg_skip: bool = False

    @property
    def block_m(self) -> int:
        return 64 * self.num_wg

    def regs(self) -> int:
        """Worker consumers' registers: ``consumer_regs``, or 240 with 2 warpgroups and 160 with 3 (the
        most that 64K registers allow next to a 24-register producer, FA3's split)."""
        return self.consumer_regs or (240 if self.num_wg == 2 else 160)

    def producer(self) -> int:
        """Producer's registers: ``producer_regs``, or 24 (FA3's), 32 when persistent with 2 consumer
        warpgroups (sm_90a compiles: its tile loop spills 28 B under 24 at d = 192 causal, nothing under 32;
        with 3 warpgroups 3 x 160 + 32 would leave the default consumer 160, which spills more)."""
        return self.producer_regs or (32 if self.persistent and self.num_wg == 2 else 24)

    def intra_mode(self) -> int:
        """The kernel's INTRA: 0 off, 1 on, 2 on with the softmax fenced (``fence``)."""
        return 2 if self.intra and self.fence else int(self.intra)

    def pingpong_mode(self) -> int:
        """The kernel's PINGPONG: 0 off, 1 turns on mbarriers, 2 on named barriers (``named_bars``)."""
        return 2 if self.pingpong and self.named_bars else int(self.pingpong)

    def o_store(self) -> int:
        """The kernel's O_STORE: 0 wgmma-layout stores, 1 coalesced stores, 2 TMA store."""
        return 2 if self.o_tma else 1 if self.o_coalesced else 0

    def widths(self, d: int) -> tuple[int, int]:
        """The kernel's (BLOCK_D0, BLOCK_D1) at head dim ``d``."""
        return head_split(d, self.split_d)


def smem_bytes(cfg: GluonConfig, d: int, esize: int = 2) -> int:
    """Shared memory of a config: the Q tile, ``num_stages`` K and V tiles (all ``sum(cfg.widths(d))``
    wide), under 1 KB of mbarriers, and with ``o_coalesced`` the layout conversions' scratch: unsplit, per
    consumer warpgroup max(8 KB, half its O tile) (sm_90a compiles: +16288 B at d = 128 x 2 warpgroups,
    +24824 B at d = 64 x 3, +32672 B at d = 192; 164144 bytes in all for d = 128, 128 x 128, 2 stages, plain
    stores); split, a bound: (warpgroups + 1) x min(8 KB, the first part's 64-row tile) (compiles: +16224 B
    with 2 warpgroups; with 3, +16224 B at d = 40, +28512 B at 80, +32608 B at 96)."""
    d0, d1 = cfg.widths(d)
    width = d0 + d1
    conv = 0
    if cfg.o_coalesced and not cfg.o_tma:
        tile = 64 * d0 * esize
        conv = (cfg.num_wg + 1) * min(8192, tile) if d1 else cfg.num_wg * min(tile, max(8192, tile // 2))
    return cfg.block_m * width * esize + cfg.num_stages * 2 * cfg.block_n * width * esize + 1024 + conv


# B * Hq * Nq * Nk * d from which a call builds its TMA descriptors on the host (H100, scratch/gdesc_probe.py:
# +1-23 % device time, the most at 1k keys; about +35 us of host time per call, Triton's per-call tensor-map
# encoding): from 2^32 (17 GFLOP, ~35 us of kernel time) the device time saved outweighs the host time
HOST_DESC_MIN_WORK = 1 << 32
# keys from which a causal call with tiles wider than 64 claims its tiles dynamically (gluon_config's ``many_keys``;
# H100, 5 interleaved rounds at 1k: 1.05-1.11x one program per tile at d = 96 / 128 / 192, 1.03x at 256)
DYNAMIC_MIN_KEYS = 1024
# the FP8 forward's threshold (its own rows were measured from 2k keys)
FP8_DYNAMIC_MIN_KEYS = 2048
# keys below which a call without a mask and tiles 33-127 wide loops persistently over the tiles (gluon_config's
# ``few_keys``; H100, 3 interleaved rounds, d = 40-112: 1.0-1.2x one program per tile at 1k-4k, 0.93-1.07x at 16k)
NARROW_PERSISTENT_MAX_KEYS = 8192
# keys [lo, hi) in which a causal call with tiles 33-64 wide runs two consumer warpgroups over dynamically claimed
# tiles (gluon_config's ``mid_keys``): three warpgroups win from 8k, FA2 below 4k (hopper_wins)
NARROW_TWO_WG_KEYS = (4096, 8192)


@functools.lru_cache(maxsize=None)  # per call of fa3_forward: a table lookup, memoised
def gluon_config(d: int, causal: bool, host_desc: bool = False, many_keys: bool = False,
                 mid_keys: bool = False, few_keys: bool = False, long_keys: bool = False) -> GluonConfig:
    """The config for head dim ``d`` (a table per tile width, CPU-testable).  The head dim is split
    (``head_split``) where that narrows the tiles (d = 40, 48, 72-96, 136-192), not where the two parts are
    as wide as ``block_d(d)`` (24, 56, 104-120, 200-248).  Rows by width, from the H100 probes (bf16,
    B*N = 16k, H*d = 2048; bench/NOTES.md, "Gluon forward", "Forward dispatch", "Persistent"): <= 32 two consumers and
    no schedule, 128-key tiles, 3 stages; <= 64 three 64-row consumers with both schedules (FA3's d = 64
    shape: 501 vs 403 TFLOP/s for two consumers at 16k, 414 vs 353 at 4k); 80-96 (split) both schedules,
    128-key tiles, 4 stages (221600 B at d = 96); 128 both schedules, 128-key tiles, 3 stages (229728 B);
    144-192 (split) both schedules, 64-key tiles, 3 stages (197024 B at d = 192; 128-key tiles need 240 KB
    at 2 stages); 256 both schedules, 64-key tiles, 2 stages (Q alone is 64 KB).  Causal takes the same
    rows: the masked-tile-0 / TMA-store variants differed from them by less than the run-to-run spread.
    Non-causal from width 128 loops persistently over the tiles (+2 to +13 % at 1k-16k, d = 128 / 192); widths
    33-127 do with ``few_keys`` (the caller's Nk < ``NARROW_PERSISTENT_MAX_KEYS``), not from 8k keys (d = 64 at
    16k 0.93x, d = 40 / 80 0.93-0.99x).  Causal with ``many_keys`` (the caller's Nk >= ``DYNAMIC_MIN_KEYS``) and
    tiles wider than 64 loops persistently over dynamically claimed tiles (``dynamic``; static round robin lost,
    0.65-0.9x): dynamic / one program per tile 1.01-1.09x at 2k-16k for d = 96, 128, 192, 256 in interleaved
    rounds, 1.03-1.11x at 1k (medians of 5 rounds), d = 64 0.88-1.0x (bench/NOTES.md, "dynamic tile scheduler",
    "Short calls: persistent grids").  Causal with
    ``mid_keys`` (the caller's Nk in ``NARROW_TWO_WG_KEYS``) and tiles 33-64 wide: two consumer warpgroups over
    dynamically claimed tiles, 1.05-1.06x FA2 at 4k keys where the three-warpgroup row ran 0.93-1.0x (d = 64 and
    48, also GQA 32 / 8; bench/NOTES.md "d = 64 / 48 causal forward", ``results/g64gqa-fwd-probe_*.json``); from
    8k that row wins (428 vs 400 TFLOP/s).  Widths 33-128 carry P packed (``pack_p``; interleaved rounds, 4k-16k,
    packed / not: d = 64 1.006-1.096 in 24 of 24 samples, d = 128 0.95-1.05, median 1.015, d = 96 median 1.003;
    d = 192 / 256 medians 0.99-1.0: not there; bench/NOTES.md "P carried packed").  Non-causal at width 64 with
    ``long_keys`` (the caller's Nk >= ``NARROW_PERSISTENT_MAX_KEYS``): the three consumers over dynamically claimed
    tiles, 1.09x one program per
    tile at d = 64, 16k (1.00x at 4k; bench/NOTES.md "Masked tiles"; widths 33-63 not timed, left as they were).
    ``host_desc``: the caller's choice (``HOST_DESC_MIN_WORK``)."""
    if d not in GLUON_HEAD_DIMS:
        raise NotImplementedError(f"the Gluon forward covers head dims multiple of 8 up to 256, got {d}")
    d0, d1 = head_split(d)
    split = d1 == 0 or d0 + d1 < block_d(d)  # split_d=False where the parts are as wide as block_d(d)
    width = d0 + d1 if split else block_d(d)
    if width <= 32:
        cfg = GluonConfig(block_n=128, num_stages=3, intra=False, pingpong=False, split_d=split)
    elif width <= 64:
        cfg = GluonConfig(block_n=128, num_stages=3, num_wg=3, split_d=split)
    elif width < 128:
        cfg = GluonConfig(block_n=128, num_stages=4, split_d=split)
    elif width == 128:
        cfg = GluonConfig(block_n=128, num_stages=3, split_d=split)
    elif width < 256:
        cfg = GluonConfig(block_n=64, num_stages=3, split_d=split)
    else:
        cfg = GluonConfig(block_n=64, num_stages=2, split_d=split)
    if 32 < width <= 128:
        cfg = replace(cfg, pack_p=True)
    if not causal and (width >= 128 or (few_keys and width > 32)):
        cfg = replace(cfg, persistent=True)
    elif not causal and long_keys and width == 64:
        cfg = replace(cfg, persistent=True, dynamic=True)
    elif causal and many_keys and width > 64:
        cfg = replace(cfg, persistent=True, dynamic=True)
    elif causal and mid_keys and 32 < width <= 64:
        cfg = replace(cfg, num_wg=2, persistent=True, dynamic=True)
    if host_desc:
        cfg = replace(cfg, host_desc=True)
    while smem_bytes(cfg, d) > SMEM_LIMIT and cfg.num_stages > 2:
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


# FP8 (e4m3) widths the Gluon kernel runs (one power-of-two column part, V transposed); others: the Triton kernel
FP8_WIDTHS = (64, 128, 256)
# keys per chunk of the FP8 V operand's permutation (the kernel's ``_p_operand``: fp8 wgmma's 32-deep k step)
FP8_KEY_CHUNK = 32


@functools.lru_cache(maxsize=None)
def gluon_fp8_config(d: int, causal: bool, many_keys: bool = False, block_n: int = 0,
                     num_stages: int = 0) -> GluonConfig:
    """The config of the FP8 forward at head dim ``d`` (``block_d(d)`` in ``FP8_WIDTHS``): the bf16 row of that
    width (consumer warpgroups, schedules, persistent / dynamic grid, ``many_keys`` the caller's Nk >=
    ``FP8_DYNAMIC_MIN_KEYS``; not its two-warpgroup variant for 4k-8k causal keys at width 64: 321 vs 359 TFLOP/s
    at 4k, nor its short-call persistent grid ``few_keys``) with the column part unsplit, plain stores (O is bf16,
    Q's tiles 8-bit: no staging there), P as FP8's own operand (``pack_p`` off) and 1-byte tiles: ``block_n`` (0:
    128 keys at width 128, 64 elsewhere) and ``num_stages`` (0: 3), the stages then lowered to what fits, at
    least 2 (ValueError otherwise).  sm_90a compiles with P carried in fp32 (kernel ``_p_operand``): 128-key tiles
    spill 148-348 B with three 160-register consumers (width 64) and 80 B with serialised wgmmas at width 256,
    64-key tiles nothing; H100 (bench/NOTES.md "Gluon FP8 forward"): width 64 causal 16k 447 vs 397 TFLOP/s for
    128 keys.
    Width 256 without ping-pong: 1.01-1.06x with it (its 64-key GEMMs are short beside the softmax of a
    256-wide O); narrower widths keep it (0.97-1.0x without)."""
    width = block_d(d)
    if width not in FP8_WIDTHS:
        raise NotImplementedError(f"the Gluon FP8 forward covers head dims of widths {FP8_WIDTHS}, got d = {d}")
    cfg = replace(gluon_config(width, causal, many_keys=many_keys), split_d=False, o_tma=False, host_desc=False,
                  pack_p=False, block_n=block_n or (128 if width == 128 else 64), num_stages=num_stages or 3,
                  pingpong=width != 256)
    while smem_bytes(cfg, d, esize=1) > SMEM_LIMIT and cfg.num_stages > 2:
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    if smem_bytes(cfg, d, esize=1) > SMEM_LIMIT:
        raise ValueError(f"block_n = {cfg.block_n} at d = {d} needs {smem_bytes(cfg, d, esize=1)} bytes of shared "
                         f"memory at 2 stages, over {SMEM_LIMIT}")
    return cfg


def fp8_v_shape(v_shape, multiple: int = FP8_KEY_CHUNK) -> tuple[int, int, int, int]:
    """Shape of :func:`fp8_v_operand` of a V of shape ``v_shape`` (B, Hk, Nk, d): (B, Hk, d, Nk rounded up to
    ``multiple``)."""
    b, hk, nk, d = v_shape
    return b, hk, d, -(-nk // multiple) * multiple


def fp8_v_args(v: torch.Tensor, vt: torch.Tensor, permute: bool) -> tuple[tuple, tuple]:
    """(grid, static arguments) of the copy of V (B, Hk, Nk, d), unit stride on d, into ``vt`` =
    :func:`fp8_v_shape` of it (``kernels/fp8_v.py``, launched on byte views of both); only shapes and strides
    are read."""
    b, hk, nk, d = v.shape
    width = vt.shape[3]
    block_k = 64
    grid = fold_grid(triton.cdiv(width, block_k), b * hk)
    static = (v.stride(0), v.stride(1), v.stride(2), vt.stride(0), vt.stride(1), vt.stride(2), hk, b * hk, nk, width,
              d, block_d(d), block_k, permute)
    return grid, static


def fp8_v_operand(v: torch.Tensor, permute: bool = True, multiple: int = FP8_KEY_CHUNK) -> torch.Tensor:
    """V (B, Hk, Nk, d) e4m3 as an FP8 kernel reads it: transposed, (B, Hk, d, Nk rounded up to ``multiple``),
    zero past Nk; with ``permute`` (the Gluon kernel's, ``multiple`` 32) the keys of every 32-key chunk in the
    order of P's registers (kernel ``_p_operand``): column 32c + 16h + 4q + 2e + b holds key
    32c + 16h + 8e + 2q + b.  One kernel (``kernels/fp8_v.py``) over byte views: H100, 32 MB of V, ~220 us
    through torch's strided copy."""
    from flashtile.kernels.fp8_v import fp8_v_transpose_kernel
    from flashtile.runtime.launch import launch as run_kernel

    if permute and multiple % FP8_KEY_CHUNK:
        raise ValueError(f"multiple must be a multiple of {FP8_KEY_CHUNK} with permute, got {multiple}")
    vt = torch.empty(fp8_v_shape(v.shape, multiple), dtype=v.dtype, device=v.device)
    if vt.numel() == 0:
        return vt
    if v.stride(3) != 1:
        v = v.contiguous()
    grid, static = fp8_v_args(v, vt, permute)
    run_kernel(fp8_v_transpose_kernel, grid, (v.view(torch.uint8), vt.view(torch.uint8)), static, num_warps=4,
               num_stages=1)
    return vt


def _check_config(cfg) -> None:
    if not isinstance(cfg, GluonConfig):
        raise TypeError(f"config must be a GluonConfig, got {type(cfg).__name__}")
    for name in ("block_n", "num_stages"):
        if not isinstance(getattr(cfg, name), int) or isinstance(getattr(cfg, name), bool):
            raise TypeError(f"config: {name} must be an int, got {cfg}")
    if cfg.block_n not in (16, 32, 64, 128, 256) or cfg.num_stages < 2:
        # one slot would serialise every load behind a GEMM (the kernel's static_assert); the masks' aranges need
        # a power of two
        raise ValueError(f"config: block_n must be a power of two in [16, 256] and num_stages >= 2, got {cfg}")
    if not isinstance(cfg.split_d, bool):
        raise TypeError(f"config: split_d must be a bool, got {cfg}")
    if not isinstance(cfg.persistent, bool):
        raise TypeError(f"config: persistent must be a bool, got {cfg}")
    if not isinstance(cfg.host_desc, bool):
        raise TypeError(f"config: host_desc must be a bool, got {cfg}")
    if not isinstance(cfg.dynamic, bool):
        raise TypeError(f"config: dynamic must be a bool, got {cfg}")
    if not all(isinstance(x, bool) for x in (cfg.intra, cfg.pingpong, cfg.fence, cfg.pack_p, cfg.named_bars,
                                             cfg.wg_skip)):
        raise TypeError(f"config: intra, pingpong, fence, pack_p, named_bars and wg_skip must be bools, got {cfg}")
    if cfg.named_bars and cfg.num_stages > 4:
        raise ValueError(f"config: named_bars has barriers for up to 4 ring stages, got {cfg}")
    if cfg.fence and not cfg.intra:
        raise ValueError(f"config: fence places the wait of the intra-warpgroup overlap, got it without intra: {cfg}")
    if cfg.dynamic and not cfg.persistent:
        raise ValueError(f"config: dynamic needs persistent (it schedules the persistent tile loop), got {cfg}")
    if not isinstance(cfg.lpt_group, int) or not 0 <= cfg.lpt_group <= 1024:
        raise ValueError(f"config: lpt_group must be an int in [0, 1024], got {cfg}")
    if cfg.num_wg not in (2, 3):
        raise ValueError(f"config: num_wg must be 2 or 3, got {cfg}")
    if not isinstance(cfg.producer_regs, int) or not isinstance(cfg.consumer_regs, int):
        raise TypeError(f"config: consumer_regs / producer_regs must be ints, got {cfg}")
    if not 24 <= cfg.producer() <= cfg.regs() <= 256 or cfg.regs() % 8 or cfg.producer() % 8:
        raise ValueError(f"config: consumer_regs / producer_regs must be multiples of 8 in [24, 256], got {cfg}")
    # setmaxnreg: num_wg + 1 partitions of 128 threads (the producer padded to 4 warps) share 64K registers;
    # the default consumer gets what the workers leave, at least consumer_regs
    if cfg.num_wg * cfg.regs() + cfg.producer() > 512:
        raise ValueError(f"config: num_wg x consumer_regs + producer_regs must be <= 512, got {cfg}")


def _check(q, k, v, out) -> None:
    check_fa3(q, k, v, out)  # types, dtypes, shapes, GQA, sm_90, descriptor-ready strides
    d = q.shape[3]
    if d not in GLUON_HEAD_DIMS:
        raise NotImplementedError(f"the Gluon forward covers head dims multiple of 8 up to 256, got {d}")


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
    width = sum(cfg.widths(q.shape[3]))
    if cfg.num_wg == 3 and width > 64 and (cfg.block_n > 64 or width > 128):
        # 160 registers per consumer thread: with 128-key tiles ptxas spills 0.2 KB at d = 80 (split) to
        # 1.3-1.7 KB at d = 128; 64-key tiles spill nothing up to 144 columns, 300 B at 192
        # (scratch/cc_gluon.py)
        raise ValueError(f"config: num_wg = 3 covers tiles up to 64 columns, or up to 128 with block_n <= 64; "
                         f"got {width} columns at d = {q.shape[3]} and block_n = {cfg.block_n}")
    if config is not None and smem_bytes(cfg, q.shape[3], q.element_size()) > SMEM_LIMIT:
        raise ValueError(f"config {cfg} needs {smem_bytes(cfg, q.shape[3], q.element_size())} bytes of shared "
                         f"memory at d = {q.shape[3]}, over {SMEM_LIMIT}")
    out, lse, work = outputs(q, k, out, q.dtype)
    if work:
        q, softmax_scale = positive_scale(q, softmax_scale)
        if not cfg.host_desc:
            ensure_allocator()  # device-side tensor descriptors: 128 bytes of global scratch each
        gluon_launch(q, k, v, out, lse, softmax_scale, causal, cfg)
    return out, lse


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device ``device_index`` (132 on an H100 SXM), memoised."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_NO_DESCS = (None,) * 8  # the kernel's q_desc0 ... o_desc1 without host descriptors (constexprs: no parameters)


@functools.lru_cache(maxsize=None)
def _box_layout(rows: int, width: int, dtype: torch.dtype):
    """The shared layout of a [1, 1, rows, width] descriptor box: the swizzle the kernel's [rows, width] tiles
    have (``get_default_for``; leading unit dims change neither the bytes nor the swizzle)."""
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, width], gl_dtype)


def _desc_strides(x: torch.Tensor) -> list[int] | None:
    """``x``'s strides for a rank-4 descriptor: a 0 stride on an axis of length 1 becomes 8 elements (any
    16-byte multiple addresses the same rows); None where an axis longer than 1 has stride 0 (an expanded
    batch or head axis, left to the in-kernel descriptors)."""
    strides = list(x.stride())
    if 0 in strides:
        for i, (n, st) in enumerate(zip(x.shape, strides)):
            if st == 0:
                if n > 1:
                    return None
                strides[i] = 8
    return strides


@functools.lru_cache(maxsize=None)
def _desc_plan(d0: int, d1: int, block_n: int, o_tma: bool, dtype: torch.dtype) -> tuple:
    """Per kernel argument ``q_desc0`` ... ``o_desc1``: (tensor index in q, k, v, out; box; its layout), or
    None (the second part when unsplit, ``d1`` 0; O unless ``o_tma``).  Keyed on ints: hashing a GluonConfig
    per call costs more than the descriptors."""
    plan = []
    for i, rows in enumerate((64, block_n, block_n, 64)):
        for width in (d0, d1):
            if width == 0 or (i == 3 and not o_tma):
                plan.append(None)
            else:
                plan.append((i, [1, 1, rows, width], _box_layout(rows, width, dtype)))
    return tuple(plan)


def _desc_entries(q, k, v, out, cfg: GluonConfig) -> tuple | None:
    """Per kernel argument ``q_desc0`` ... ``o_desc1``: None (not passed) or (tensor index in q, k, v, out,
    shape, strides, box, layout) of a host descriptor over that view; None where a stride rules them out
    (``_desc_strides``).  Only shapes, strides and the dtype are read."""
    xs = (q, k, v, out)
    strides = [_desc_strides(x) for x in xs]
    if None in strides:
        return None
    shapes = [list(x.shape) for x in xs]
    return tuple(None if e is None else (e[0], shapes[e[0]], strides[e[0]], e[1], e[2])
                 for e in _desc_plan(*cfg.widths(q.shape[3]), cfg.block_n, cfg.o_tma, q.dtype))


def bare_descriptor(base: torch.Tensor, shape: list, strides: list, box: list, layout):
    """A Gluon host ``TensorDescriptor`` built without the dataclass's checks (16-byte base and strides, unit
    stride on d, positive dims), which are the callers' argument checks (~0.4 vs 2.6 us each)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    desc = TensorDescriptor.__new__(TensorDescriptor)
    desc.__dict__.update(base=base, shape=shape, strides=strides, block_shape=box, layout=layout)
    return desc


def _descriptors(entries: tuple, xs: tuple) -> list:
    """Gluon host ``TensorDescriptor`` s of :func:`_desc_entries` over the tensors ``xs`` (q, k, v, out: any
    views with the addresses of the ones the entries were made from; checked by fa3_fwd._check and outputs)."""
    return [None if e is None else bare_descriptor(xs[e[0]], *e[1:]) for e in entries]


class GluonArgs(NamedTuple):
    """What one Gluon forward launch takes besides the tensors and the scale, fixed by the problem's signature
    (shapes, strides, dtype, config): grid, the static arguments, the host descriptors' plan (``_desc_entries``;
    None: device-side descriptors) and whether a tile counter is needed (``cfg.dynamic``)."""

    grid: tuple
    static: tuple
    descs: tuple | None
    counter: bool


def gluon_args(q, k, v, out, causal: bool, cfg: GluonConfig, varlen=None, descales=None) -> GluonArgs:
    """:class:`GluonArgs` of :func:`gluon_launch` on these views (only their shapes, strides and dtype are read;
    ``varlen`` as there, its tensors unread; ``descales`` FP8's (q, k, v) descales, their strides read)."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    bm = cfg.block_m
    # constexprs: no parameters without a packed batch
    total_q = total_k = n_batch = search_steps = None
    if varlen is not None:
        if cfg.persistent or cfg.host_desc:
            raise ValueError(f"a packed batch runs one program per slot with device descriptors, got {cfg}")
        cu_q, _, max_q, max_k = varlen
        n_batch, total_q, total_k, nq, nk = cu_q.shape[0] - 1, nq, nk, max_q, max_k
        # one "batch" of total_q // bm + B slots per head (kernels/fa3_fwd._packed_slot): at most B idle
        b, num_m_tiles, search_steps = 1, total_q // bm + n_batch, (n_batch - 1).bit_length()
    else:
        num_m_tiles = triton.cdiv(nq, bm)
    total_tiles = b * hq * num_m_tiles
    if total_tiles >= 2**31:
        shape = "Hq * (total_q // BLOCK_M + B)" if varlen is not None else "B * H * cdiv(Nq, BLOCK_M)"
        raise NotImplementedError(f"{total_tiles} tiles ({shape}, BLOCK_M {bm}) exceed the grid's axis 0")
    if cfg.persistent:
        grid = (min(total_tiles, sm_count(q.device.index)),)
        persistent_tiles = total_tiles  # the kernel's loop bound
    else:
        grid = (total_tiles,)
        persistent_tiles = None  # a constexpr: the one-tile-per-program kernel has no such parameter
    descs = _desc_entries(q, k, v, out, cfg) if cfg.host_desc else None
    if descs is None:
        check_descriptor_grid(grid[0], "the Gluon forward")
    if descales is not None:
        if cfg.host_desc or cfg.o_tma or varlen is not None or cfg.widths(d)[1]:
            raise ValueError(f"the FP8 kernel runs one column part, device descriptors and no O staging, got {cfg}")
        if cfg.block_n % FP8_KEY_CHUNK:
            raise ValueError(f"config: FP8 key tiles are whole {FP8_KEY_CHUNK}-key chunks (P's operand order), got "
                             f"block_n = {cfg.block_n}")
        if block_d(d) not in FP8_WIDTHS:
            raise ValueError(f"the Gluon FP8 kernel covers head dims of widths {FP8_WIDTHS}, got d = {d}")
        if smem_bytes(cfg, d, esize=1) > SMEM_LIMIT:
            raise ValueError(f"config {cfg} needs {smem_bytes(cfg, d, esize=1)} bytes of shared memory at d = {d} "
                             f"(FP8), over {SMEM_LIMIT}")
        want = fp8_v_shape((b, hk, nk, d))
        if tuple(v.shape) != want or v.stride(3) != 1:
            # the kernel's V descriptor spans Nk rounded up to a whole chunk, columns of unit stride
            raise ValueError(f"v must be fp8_v_operand of V, (B, Hk, d, Nk rounded up to {FP8_KEY_CHUNK}) = "
                             f"{want} with unit stride on its last dim, got {tuple(v.shape)} strides {v.stride()}")
        qs, ks, vs = descales
        scale_strides = (qs.stride(0), qs.stride(1), ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1))
    else:
        scale_strides = (None,) * 6  # constexprs: no parameters
    static = (
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *scale_strides,
        hq, hq // hk, nq, nk, num_m_tiles, persistent_tiles, total_q, total_k, n_batch, search_steps,
        # constexprs, in the kernel's order
        d, *cfg.widths(d), cfg.num_wg, cfg.block_n, cfg.num_stages, bool(causal), cfg.intra_mode(),
        cfg.pingpong_mode(), cfg.regs(), cfg.producer(), cfg.skip_mask0, cfg.o_store(), cfg.lpt_group, cfg.persistent,
        descs is not None, cfg.dynamic, varlen is not None, cfg.pack_p, cfg.named_bars, cfg.wg_skip and bool(causal),
    )
    return GluonArgs(grid, static, descs, cfg.dynamic)


def gluon_dynamic(args: GluonArgs, q, k, v, out, lse, softmax_scale: float, cu_q=None, cu_k=None,
                  fp8=None) -> tuple:
    """The per-call arguments of a launch with :class:`GluonArgs` ``args``: the tensors (any views with the
    addresses of the ones ``args`` were made from), a fresh tile counter, FP8's ``((q, k, v) descales, error
    word)``, the scale, the host descriptors."""
    counter = torch.zeros(1, dtype=torch.int32, device=q.device) if args.counter else None
    descs = _NO_DESCS if args.descs is None else _descriptors(args.descs, (q, k, v, out))
    scales = (None,) * 4 if fp8 is None else (*fp8[0], fp8[1])
    return (q, k, v, out, lse, counter, cu_q, cu_k, *scales, softmax_scale * LOG2E, *descs)


def gluon_launch(q, k, v, out, lse, softmax_scale: float, causal: bool, cfg: GluonConfig, varlen=None,
                 fp8=None) -> None:
    """One launch on checked views with ``softmax_scale > 0`` and work to do (``fa3_fwd.outputs``);
    unless ``cfg.host_desc``, the descriptor allocator installed (``fa3_fwd.ensure_allocator``).
    ``cfg.persistent``: a grid of min(tiles, SMs) programs, program p running tiles p, p + grid, ... of the
    kernel's tile order, or with ``cfg.dynamic`` tile p, then tiles grid + c (c: a global int32 counter's
    old value, one atomic add per claim).  Invariant: the counter is a fresh ``torch.zeros`` per launch on
    the launch's stream (a memset kernel ordered before it: no host sync; each launch, each stream and
    each CUDA-graph replay, which replays the memset, counts from 0; the caching allocator keeps it alive
    until the launch has run).  ``cfg.host_desc``: TMA descriptors built here (``_desc_entries``), or, where a
    stride rules them out, in the kernel as without it.  ``varlen`` = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k): a packed batch on (1, H, total, d) views, lse (Hq, total_q); ``cfg`` one program per slot
    of the packed grid with device descriptors.  ``fp8`` = ((q, k, v) float32 descales broadcast to (B, Hk), the
    int32 error word): e4m3 q, k and ``v`` = :func:`fp8_v_operand` of V ((B, Hk, d, Nk rounded up to 32), keys
    permuted per 32-key chunk; checked in :func:`gluon_args`), ``out`` bf16 (``fa3_fwd.fa3_forward_fp8``)."""
    from flashtile.kernels.fa3_gluon import fa3_gluon_kernel
    from flashtile.runtime.launch import launch as run_kernel

    args = gluon_args(q, k, v, out, causal, cfg, varlen, None if fp8 is None else fp8[0])
    if cfg.host_desc and args.descs is None:
        ensure_allocator()
    cu = varlen[:2] if varlen is not None else (None, None)
    dynamic = gluon_dynamic(args, q, k, v, out, lse, softmax_scale, *cu, fp8=fp8)
    with on_device(q):
        # num_stages is Triton's software-pipelining option, unused by Gluon (3 is its default: same cache key)
        run_kernel(fa3_gluon_kernel, args.grid, dynamic, args.static, num_warps=4, num_stages=3, bind=BIND_LAUNCH)


def gluon_launcher(args: GluonArgs, dynamic: tuple):
    """The bound launch of :func:`gluon_launch` for :class:`GluonArgs` ``args`` (``dynamic``: one call's
    :func:`gluon_dynamic`), for a plan to keep."""
    from flashtile.kernels.fa3_gluon import fa3_gluon_kernel
    from flashtile.runtime.launch import launcher

    return launcher(fa3_gluon_kernel, args.grid, dynamic, args.static, num_warps=4, num_stages=3, bind=BIND_LAUNCH)
