"""Host side of the Hopper forward kernel (:mod:`flashtile.kernels.fa3_fwd`).

``fa3_forward`` owns the grid, the strides, the descriptor scratch allocator
and the tile choice per head dim.  It covers what the kernel covers: bf16 /
fp16, head dims 8..256 in steps of 8 (tuned at 64, 128, 256), causal or not
(bottom-right aligned), GQA/MQA, ragged Nq / Nk, LSE output; anything else
raises ``NotImplementedError`` so a dispatcher can fall back to the FA2 kernel.
The public ops call it where :func:`prefer_hopper` says it beats the FA2 kernel.
``fa3_varlen_forward`` is the same kernel on a packed batch (``flash_attn_varlen_func``'s forward,
where :func:`prefer_hopper_varlen` says).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton

from flashtile.kernels._common import LOG2E
from flashtile.runtime.common import capability as device_capability
from flashtile.runtime.common import hopper_target, require_hopper
from flashtile.runtime.common import check_descriptor_grid, descriptor_grid_fits, on_device

__all__ = ["Fa3Config", "fa3_config", "fa3_fp8_config", "fa3_forward", "forward_checked", "fa3_forward_fp8",
           "banded_args",
           "fa3_varlen_forward", "launch", "smem_bytes", "packed_view", "prefer_hopper_varlen",
           "ensure_allocator", "outputs", "positive_scale", "SUPPORTED_HEAD_DIMS", "FP8_HEAD_DIMS", "ENABLED",
           "GLUON", "GLUON_VARLEN", "VARLEN_GRID", "use_gluon", "prefer_hopper", "prefer_hopper_fp8", "hopper_wins",
           "fp8_forward_plan"]

HOPPER_DTYPES = (torch.float16, torch.bfloat16)  # the subset of ops.validate.SUPPORTED_DTYPES the kernel covers
SUPPORTED_HEAD_DIMS = tuple(range(8, 257, 8))  # TMA: each row stride a multiple of 16 bytes
FP8_HEAD_DIMS = tuple(range(32, 257, 16))  # 16-byte rows of 1-byte elements; fp8 wgmma steps k by 32
FP8 = torch.float8_e4m3fn
SMEM_LIMIT = 227 * 1024  # sm_90 shared memory per block


@dataclass(frozen=True)
class Fa3Config:
    """Tile shape and launch options of one kernel instance."""

    block_m: int
    block_n: int
    num_warps: int  # warps per consumer warpgroup set; warp specialisation adds a producer warpgroup
    num_stages: int
    warp_spec: bool
    o_tma: bool = True  # store O through a descriptor (a shared-memory staging tile) or plain stores


def fa3_config(d: int, causal: bool, nq: int, nk: int) -> Fa3Config:
    """The config for head dim ``d`` (a table: no device query, so CPU-testable).

    From the H100 sweep in bench/NOTES.md ("Hopper forward, first step") (bf16, B*N = 16k, H*d = 2048, N 1k-16k):
    d <= 64: 256 x 128 warp-specialised without a mask, the unspecialised two-loop kernel at
    128 x 64 under the causal mask (the specialised one masks every tile); d <= 128:
    128 x 128 specialised, 2 stages (3 do not fit 227 KB); d <= 256: 128 x 64 specialised,
    2 stages with O written by plain stores (its TMA staging tile leaves room for 1 stage only)."""
    del nq, nk  # one row per head-dim bucket so far
    if d <= 64:
        return Fa3Config(128, 64, 8, 3, False) if causal else Fa3Config(256, 128, 4, 2, True)
    if d <= 128:
        return Fa3Config(128, 128, 4, 2, True)
    return Fa3Config(128, 64, 4, 2, True, o_tma=False)


def fa3_fp8_config(d: int, causal: bool) -> Fa3Config:
    """The config of the FP8 kernel, from the H100 sweep in bench/NOTES.md ("FP8 forward"): e4m3 tiles
    take half the shared memory of bf16 ones, so d <= 128 runs 128 x 256 tiles without a mask (807 vs
    687 TFLOP/s for 128 x 128 at N = 16k; 128 x 128 under the causal mask) and d = 256 128 x 128 with O
    through TMA (224 KB); 3 stages give NaN under Triton 3.6's warp specialisation, as in bf16."""
    if d <= 128:
        return Fa3Config(128, 128, 4, 2, True) if causal else Fa3Config(128, 256, 4, 2, True)
    return Fa3Config(128, 128, 4, 2, True)


def smem_bytes(cfg: Fa3Config, d: int, esize: int = 2, out_esize: int | None = None) -> int:
    """Shared memory the config needs, as Triton 3.6 lays it out for sm_90a (compile reports, offline):
    the Q tile, a ring of ``num_stages`` K and V tiles, the O tile's staging (a TMA source tile with
    warp specialisation, aliased with Q without; a quarter tile of layout-conversion scratch for plain
    stores) and under 1 KB of barriers; ``ptxas``-checked within 1 KB above."""
    bd = max(16, 1 << (d - 1).bit_length())
    tile_q = cfg.block_m * bd * esize
    tile_o = cfg.block_m * bd * (esize if out_esize is None else out_esize)
    o_stage = (tile_o if cfg.warp_spec else max(0, tile_o - tile_q)) if cfg.o_tma else tile_o // 4
    return tile_q + o_stage + cfg.num_stages * 2 * cfg.block_n * bd * esize + 1024


def _allocator(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for the in-kernel tensor descriptors (128 bytes each, 4 per program)."""
    del alignment, stream  # the caching allocator's blocks are 512-byte aligned
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Install the scratch allocator unless the caller already set one."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_allocator)


# False sends every forward to the FA2 kernel (benchmarks and tests compare the two paths)
ENABLED = True
# False keeps the Triton Hopper kernel where the Gluon one would run (benchmarks and tests compare them)
GLUON = True
# the packed forward's grid: "max" B * cdiv(max_seqlen_q, BLOCK_M) tiles per head (idle past each sequence's end),
# "packed" total_q // BLOCK_M + B slots per head (a binary search over cu_seqlens_q per program), "auto" packed
# where the max grid has over twice the slots (an idle program costs a launch and the cu_seqlens loads)
VARLEN_GRID = "auto"
# False keeps packed forwards on the Triton Hopper kernel where the Gluon one would run (``use_gluon``; one program
# per slot of the packed grid, the cu_seqlens reported by a kernel of their own)
GLUON_VARLEN = True
# the widest head dim whose packed forwards take the Gluon kernel (wider: the Triton Hopper kernel)
VARLEN_GLUON_MAX_D = 192


def use_gluon(d: int, causal: bool) -> bool:
    """Whether :func:`fa3_forward` runs the Gluon kernel (:mod:`flashtile.runtime.fa3_gluon`: explicit
    producer/consumer partitions, ping-pong, intra-warpgroup overlap, a separate masked diagonal loop, the
    head dim split into two power-of-two tile parts) rather than the Triton one: for 32 < d <= 192 and d = 256
    (d = 200-248, 256-wide tiles with zero columns, stay on the Triton kernel until measured).  H100,
    bf16, B*N = 16k, H*d = 2048 (bench/NOTES.md, "Forward dispatch", "two tile parts", "K released before V"),
    Gluon / Triton TFLOP/s: d = 64 501 / 461 at 16k, 414 / 391 at 4k; d = 96 529 / 438 and 516 / 439, causal
    484 / 342 and 388 / 355; d = 128 595 / 574 and 566 / 475, causal 578 / 502 and 428 / 353; d = 192 664 / 522
    and 604 / 505, causal 550 / 462 and 511 / 430; d = 256 (two stages, K's slot freed before V's) 674 / 631 at
    16k, 717 / 648 at 4k, causal 637 / 522 and 584 / 499."""
    del causal
    return GLUON and (32 < d <= 192 or d == 256)


def _tma_ready(x: torch.Tensor) -> bool:
    """Tensor descriptors need a 16-byte aligned base, unit stride on d, 16-byte strides and a nonzero row
    stride (an expanded sequence axis has stride 0, which a descriptor's row stride cannot be)."""
    es = x.element_size()
    return (
        x.stride(3) == 1 and (x.stride(2) > 0 or x.shape[2] <= 1) and x.data_ptr() % 16 == 0
        and all((s * es) % 16 == 0 for s in x.stride()[:3])
    )


def hopper_wins(d: int, causal: bool, nk: int, packed: bool = False) -> bool:
    """The measured part of :func:`prefer_hopper`: head dim ``d`` (covered: multiples of 8 up to 256),
    causal or not, ``nk`` keys; ``packed``: a packed batch, whose grid has no dynamic scheduler (d = 128 causal
    then from 2k keys, as measured with one program per tile).

    Through ``flash_attn_func`` on an H100 (bf16, B*N = 16k, H*d = 2048; ``flashtile bench dispatch``,
    bench/NOTES.md "Dispatch sweep"), the Hopper path (Gluon for 32 < d <= 192 then) against the FA2 kernel:
    d > 128 1.4-2.6x at every N; 64 < d < 128 1.1-1.5x at 1k-2k causal or not (d = 96 causal 1k 2.5x; causal
    below 1k unmeasured: FA2);
    d = 128 1.2x from 1k without a mask, causal 1.04x at 1k (over dynamic tiles; one program per tile 0.95x)
    and 1.22x at 2k; 32 < d <= 64 0.76-0.97x at 1k,
    1.03-1.17x from 2k without a mask, causal 0.72-0.75x at 2k, from 4k keys (two consumer warpgroups over
    dynamic tiles 1.05-1.06x at 4k, the three-warpgroup table 1.1-1.25x from 8k; bench/NOTES.md "d = 64 / 48 causal
    forward").  d <= 32 was not measured: FA2."""
    if d not in SUPPORTED_HEAD_DIMS or d <= 32:
        return False
    if d <= 64:  # causal from 4k: two consumer warpgroups, dynamic tiles (fa3_gluon.NARROW_TWO_WG_KEYS)
        return nk >= (4096 if causal else 2048)
    return d > 128 or not causal or nk >= (2048 if packed and d == 128 else 1024)  # causal below 1k: unmeasured


def prefer_hopper(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, window: tuple[int, int],
    plain: bool, capability: tuple[int, int] | None = None,
) -> bool:
    """Whether the forward on (B, H, N, d) views q, k, v runs the Hopper kernel instead of FA2's.

    ``plain``: no softcap, ALiBi, bias, dropout or block mask (the kernel has none of them);
    the window must be unbounded, or causal; then :func:`hopper_wins` decides."""
    return _prefer(q, k, v, causal, window, plain, k.shape[2], q.shape[0] * q.shape[1] * triton.cdiv(q.shape[2], 64),
                   capability)


def _prefer(q, k, v, causal: bool, window: tuple[int, int], plain: bool, nk: int, programs: int, capability,
            packed: bool = False) -> bool:
    """:func:`prefer_hopper` on (B, H, N, d) views with ``nk`` keys per sequence; ``programs`` a bound on the
    grid (its in-kernel descriptors' scratch: ``descriptor_grid_fits``; a bound also where the Gluon kernel would
    build its descriptors on the host, so B * H * N from 2^27 rows runs FA2); ``packed``: :func:`hopper_wins`'s."""
    if not descriptor_grid_fits(programs):
        return False
    if not (ENABLED and plain) or q.device.type != "cuda" or q.dtype not in HOPPER_DTYPES:
        return False
    left, right = window
    if left != -1 or right != (0 if causal else -1):
        return False
    if not hopper_wins(q.shape[3], causal, nk, packed):
        return False
    if capability is None:
        capability = device_capability(q.get_device())
    return hopper_target(capability) and _tma_ready(q) and _tma_ready(k) and _tma_ready(v)


def packed_view(x: torch.Tensor) -> torch.Tensor:
    """The kernel's (1, H, total, d) view of a packed (total, H, d) tensor."""
    return x.transpose(0, 1).unsqueeze(0)


def prefer_hopper_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, window: tuple[int, int], plain: bool,
    max_seqlen_k: int, n_seqs: int, capability: tuple[int, int] | None = None,
) -> bool:
    """Whether the forward on a packed batch of ``n_seqs`` sequences (q (total_q, Hq, d), k, v (total_k, Hk, d))
    runs the Hopper kernel (a grid of at most 2 Hq (total_q // 64 + B) programs: ``descriptor_grid_fits``):
    :func:`prefer_hopper`'s rule with the longest sequence's ``max_seqlen_k`` keys as Nk (the long sequences
    hold most of the FLOPs).  ``plain`` also excludes a ``block_table``; no keys at all stays with FA2.  H100,
    64k tokens of 128..8k-token sequences, 2048 / d heads (bench/NOTES.md, "Gluon packed forward"), non-causal /
    causal TFLOP/s of the Hopper path (Gluon's packed grid at d <= 192, Triton's at 256): d = 64 444 / 348, 96
    455 / 397, 128 564 / 472, 192 556 / 487, 256 569 / 552; FA2's packed kernel: d = 64 413 / 352 (causal: a tie),
    96 322 / 330, causal 128 377, 192 187, 256 260."""
    if k.shape[0] == 0:
        return False
    programs = 2 * q.shape[1] * (q.shape[0] // 64 + n_seqs)  # either grid of either kernel (launch, gluon_launch)
    return _prefer(packed_view(q), packed_view(k), packed_view(v), causal, window, plain, max_seqlen_k, programs,
                   capability, packed=True)


def prefer_hopper_fp8(
    q: torch.Tensor, k: torch.Tensor, *, causal: bool, window: tuple[int, int], plain: bool, softmax_scale: float,
    capability: tuple[int, int] | None = None,
) -> bool:
    """Whether e4m3 (B, H, N, d) views q, k run the FP8 Hopper kernel (V is copied transposed, any layout):
    sm_90, no softcap / ALiBi (``plain``), an unbounded or causal window, a positive scale, head dims
    multiple of 16, tensor-descriptor-ready q, k and a grid inside its descriptors' scratch (``descriptor_grid_fits``).
    Otherwise the caller dequantises."""
    if not (ENABLED and plain) or q.device.type != "cuda" or q.dtype != FP8 or q.shape[3] not in FP8_HEAD_DIMS:
        return False
    if not descriptor_grid_fits(q.shape[0] * q.shape[1] * triton.cdiv(q.shape[2], 64)):
        return False
    left, right = window
    if left != -1 or right != (0 if causal else -1) or not 0 < softmax_scale < math.inf:
        return False
    if capability is None:
        capability = device_capability(q.get_device())
    return hopper_target(capability) and _tma_ready(q) and _tma_ready(k)


def fa3_forward_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    descales: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    softmax_scale: float,
    causal: bool = False,
    out: torch.Tensor | None = None,
    gluon_config=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 Hopper forward on e4m3 (B, H, N, d) views with float32 ``descales`` (q, k, v) broadcast to
    (B, Hk): ``(out, lse)``, out bf16.  Callers check :func:`prefer_hopper_fp8` first; the descales'
    values are checked in the kernel (a q * k product not in (0, inf) or a non-finite v descale sets
    the device error word's ``ERR_DESCALE`` bit, read by ``flashtile.check_errors()``, and outputs 0).
    ``gluon_config``: a ``GluonConfig`` the Gluon FP8 kernel runs instead of the dispatch's (ablations, `bench
    configs gluon-fp8`)."""
    from flashtile.kernels.fa3_fwd import fa3_fwd_kernel  # noqa: F401  (the error bit's home)
    from flashtile.runtime.decode import error_flags

    b, hk, nk, d = k.shape
    if q.device.type == "cuda":  # CPU tensors: the Triton kernel through the interpreter (tests)
        require_hopper("fa3_forward_fp8", q.get_device())
    if out is not None and not _tma_ready(out):
        raise ValueError("out must be descriptor-ready: unit stride on d, 16-byte aligned base and strides")
    from flashtile.runtime.fa3_gluon import FP8_KEY_CHUNK, _check_config, fp8_v_operand, gluon_launch

    if gluon_config is not None:
        _check_config(gluon_config)
    out, lse, work = outputs(q, k, out, torch.bfloat16)
    if not work:
        return out, lse
    ensure_allocator()
    err = error_flags(q.device, "flash_attn_func")[1:]
    with on_device(q):
        if gluon_config is not None:
            gluon_cfg, triton_cfg, multiple = gluon_config, None, FP8_KEY_CHUNK
        else:
            gluon_cfg, triton_cfg, multiple = _fp8_route(d, causal, nk)
        vt = fp8_v_operand(v, permute=gluon_cfg is not None, multiple=multiple)
        if gluon_cfg is not None:
            gluon_launch(q, k, vt, out, lse, float(softmax_scale), causal, gluon_cfg, fp8=(descales, err))
        else:
            launch(q, k, vt, out, lse, float(softmax_scale) * LOG2E, causal, triton_cfg, descales=descales, err=err)
    return out, lse


def _fp8_route(d: int, causal: bool, nk: int):
    """``(gluon_cfg, triton_cfg, multiple)`` of an FP8 forward (the generic path's and the plan's): the Gluon
    kernel's config and None, or None and the Triton kernel's; ``multiple``: V's operand (``fp8_v_operand``)
    padded to whole 32-key chunks, permuted, for Gluon, to 16 bytes for the Triton kernel's descriptor."""
    from flashtile.runtime.fa3_gluon import FP8_KEY_CHUNK

    gluon_cfg = _gluon_fp8_cfg(d, causal, nk)
    if gluon_cfg is not None:
        return gluon_cfg, None, FP8_KEY_CHUNK
    return None, fa3_fp8_config(d, causal), 16


def fp8_forward_plan(q, k, v, descales, out, lse, causal: bool):
    """The launches of :func:`fa3_forward_fp8` prepared for the signature of these e4m3 (B, H, N, d) views (work
    to do, as :func:`prefer_hopper_fp8` accepts them, ``v`` with unit stride on d; ``descales`` broadcast to
    (B, Hk); ``out`` / ``lse`` example outputs): ``(run, vt_shape)``, ``run(q, k, v, vt, out, lse, descales,
    softmax_scale)`` for tensors of that signature (any views with their addresses; ``vt`` a fresh tensor of
    ``vt_shape``, V's operand, which the first launch writes) and ``softmax_scale > 0``."""
    from flashtile.kernels.fa3_fwd import fa3_fwd_kernel
    from flashtile.kernels.fp8_v import fp8_v_transpose_kernel
    from flashtile.runtime import fa3_gluon
    from flashtile.runtime.decode import error_flags
    from flashtile.runtime.launch import launcher

    d, nk = q.shape[3], k.shape[2]
    err = error_flags(q.device, "flash_attn_func")[1:]  # zeroed in place by take_errors: the view stays valid
    gluon_cfg, cfg, multiple = _fp8_route(d, causal, nk)
    vt = torch.empty(fa3_gluon.fp8_v_shape(v.shape, multiple), dtype=v.dtype, device=v.device)
    grid, static = fa3_gluon.fp8_v_args(v, vt, gluon_cfg is not None)
    copy = launcher(fp8_v_transpose_kernel, grid, (v.view(torch.uint8), vt.view(torch.uint8)), static, num_warps=4,
                    num_stages=1)
    if gluon_cfg is not None:
        args = fa3_gluon.gluon_args(q, k, vt, out, causal, gluon_cfg, None, descales)

        def dynamic(q, k, vt, out, lse, descales, softmax_scale):
            return fa3_gluon.gluon_dynamic(args, q, k, vt, out, lse, softmax_scale, fp8=(descales, err))

        kernel = fa3_gluon.gluon_launcher(args, dynamic(q, k, vt, out, lse, descales, 1.0))
    else:
        def dynamic(q, k, vt, out, lse, descales, softmax_scale):
            return launch_dynamic(q, k, vt, out, lse, softmax_scale * LOG2E, descales, err)

        grid, static = launch_args(q, k, vt, out, causal, cfg, descales)
        kernel = launcher(fa3_fwd_kernel, grid, dynamic(q, k, vt, out, lse, descales, 1.0), static,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def fp8_run(q, k, v, vt, out, lse, descales, softmax_scale: float) -> None:
        ensure_allocator()  # device-side tensor descriptors: 128 bytes of global scratch each
        copy(v.view(torch.uint8), vt.view(torch.uint8))
        kernel(*dynamic(q, k, vt, out, lse, descales, softmax_scale))

    return fp8_run, vt.shape


# False keeps the FP8 forward on the Triton kernel (benchmarks and tests compare the two)
GLUON_FP8 = True


def _gluon_fp8_cfg(d: int, causal: bool, nk: int):
    """The Gluon FP8 kernel's config for a call at head dim ``d`` with ``nk`` keys, or None: the Triton FP8
    kernel runs it (:func:`use_gluon_fp8`)."""
    if not use_gluon_fp8(d, causal):
        return None
    from flashtile.runtime.fa3_gluon import FP8_DYNAMIC_MIN_KEYS, gluon_fp8_config

    return gluon_fp8_config(d, causal, nk >= FP8_DYNAMIC_MIN_KEYS)


def fp8_block_sizes(d: int, causal: bool, nk: int) -> tuple[int, int]:
    """(query rows, keys) per tile of the FP8 kernel :func:`fa3_forward_fp8` runs at head dim ``d`` with ``nk``
    keys: P is rounded to e4m3 against each key tile's running max, so the float64 twin
    (``reference.fp8``) takes these to match it."""
    gluon_cfg, triton_cfg, _ = _fp8_route(d, causal, nk)
    cfg = gluon_cfg or triton_cfg
    return cfg.block_m, cfg.block_n


def use_gluon_fp8(d: int, causal: bool) -> bool:
    """Whether :func:`fa3_forward_fp8` runs the Gluon kernel (its unmasked loop beside a masked diagonal one,
    intra-warpgroup overlap, ping-pong below width 256, the dynamic causal scheduler, P's registers as the
    second GEMM's operand without shuffles) rather than the Triton one (every tile masked when causal,
    128 x 256 tiles without a mask): head dims of tile width 64 or 128, and 256 when causal.  H100,
    B*N = 16k, H*d = 2048, interleaved rounds (bench/NOTES.md "Gluon FP8 forward" and its schedule ablation),
    Gluon / Triton TFLOP/s: causal d = 128 601 / 479 at 4k, 789 / 619 at 16k; causal d = 64 359 / 291 and
    487 / 369; without a mask 0.98-1.03x at d = 64 and 128 (within the rounds' spread); d = 256 causal 722 / 700
    and 948 / 877 (no ping-pong), without a mask 914 / 1032 and 1034 / 1101."""
    from flashtile.runtime.fa3_gluon import block_d

    width = block_d(d)
    return GLUON_FP8 and (width in (64, 128) or (width == 256 and causal))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (B, H, N, d) tensor")
    if q.dtype not in HOPPER_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise NotImplementedError(f"fa3_forward covers fp16 / bf16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, "
                                  f"{v.dtype}")
    dev = q.device
    if dev.type != "cuda":
        raise NotImplementedError("fa3_forward needs an sm_90 (Hopper) CUDA device")
    require_hopper("fa3_forward", q.get_device())
    b, hq, _, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or k.device != dev or v.device != dev:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} must match q {tuple(q.shape)} in batch and head_dim")
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({k.shape[1]})")
    if d not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"fa3_forward covers head dims multiple of 8 up to 256, got {d}")
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        if x is None:
            continue
        if not _tma_ready(x):
            raise NotImplementedError(
                f"{name}: fa3_forward needs unit stride on d, a nonzero row stride, 16-byte aligned base and strides"
            )


def outputs(q: torch.Tensor, k: torch.Tensor, out: torch.Tensor | None, out_dtype: torch.dtype):
    """``(out, lse, work)`` of a Hopper forward on (B, H, N, d) views: ``out`` (a given view checked against
    q's shape, ``out_dtype`` and device), ``lse`` (B, Hq, Nq) float32; ``work`` False when no kernel is
    needed (no query rows, or no keys: every row empty, out 0 and lse -inf already written)."""
    b, hq, nq, _ = q.shape
    if out is None:
        out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    elif tuple(out.shape) != tuple(q.shape) or out.dtype != out_dtype or out.device != q.device:
        raise ValueError(f"out must have q's shape, dtype {out_dtype} and q's device, got {tuple(out.shape)}, "
                         f"{out.dtype}, {out.device}")
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=q.device)
    if b * hq * nq == 0:
        return out, lse, False
    if k.shape[2] == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse, False
    return out, lse, True


def positive_scale(q: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, float]:
    """``(q, scale)`` with the same scores and ``scale > 0``: the kernels scale the row max of raw scores.
    (-q)·k |scale| is the same score exactly, and a zero scale makes every score 0, as zero queries do."""
    if softmax_scale > 0:
        return q, softmax_scale
    return (-q, -softmax_scale) if softmax_scale < 0 else (torch.zeros_like(q), 1.0)


def fa3_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = False,
    out: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hopper attention forward on (B, H, N, d) views: returns ``(out, lse)``.

    Same contract as :func:`flashtile.kernels.fa2_fwd.fa2_forward` for the
    options it takes: ``out`` in q's dtype (written into the given view when
    passed), ``lse`` (B, Hq, Nq) float32 natural-log sum-exp, -inf (and a zero
    output) on rows that see no key.  ``window_size`` (flash-attn's, bottom-right aligned; with ``causal`` its
    right bound is 0) and ``softcap`` run the Triton kernel (:func:`banded_args`; the dispatch does not send them
    here until timed)."""
    from flashtile.ops import validate

    _check(q, k, v, out)
    softmax_scale = float(softmax_scale)
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    left, right = validate.check_window(causal, window_size)
    cap = validate.check_softcap(softcap)
    if cap == 0.0 and (left, right) == (-1, 0 if causal else -1):
        return forward_checked(q, k, v, softmax_scale, causal, out)
    out, lse, work = outputs(q, k, out, q.dtype)
    if work:
        q, softmax_scale = positive_scale(q, softmax_scale)
        ensure_allocator()
        nq, nk = q.shape[2], k.shape[2]
        kernel_causal, window, caps, qk_scale = banded_args(left, right, cap, softmax_scale, nq, nk)
        # a window masks a band as causal does: the causal row's tiles (d = 64: the non-causal ones spill 408 B)
        cfg = fa3_config(q.shape[3], kernel_causal or window != (-1, -1), nq, nk)
        with on_device(q):
            launch(q, k, v, out, lse, qk_scale, kernel_causal, cfg, window=window, softcap=caps)
    return out, lse


def banded_args(left: int, right: int, softcap: float, softmax_scale: float, nq: int, nk: int) -> tuple:
    """The Triton kernel's (causal, window, softcap pair, qk_scale) for a checked window (left, right) (-1
    unbounded; causal is right = 0), ``softcap`` (0: none) and a positive scale: bounds that cannot bind dropped
    (``unbind_window``), the plain causal window as the kernel's causal flag, softcap as (scale / cap,
    cap * log2 e) with qk_scale 1 (the scores then come in log2 units), else qk_scale = scale * log2 e."""
    from flashtile.ops.validate import unbind_window

    left, right = unbind_window(left, right, nq, nk)
    causal = left == -1 and right == 0
    window = (-1, -1) if causal else (left, right)
    if softcap > 0:
        return causal, window, (softmax_scale / softcap, softcap * LOG2E), 1.0
    return causal, window, None, softmax_scale * LOG2E


def forward_checked(q, k, v, softmax_scale: float, causal: bool, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fa3_forward` without its checks, for ``ops.autograd._fwd_impl`` after :func:`prefer_hopper`
    (the public wrappers checked shapes, GQA and a finite ``softmax_scale``; ``out`` None or the op's own)."""
    d, nq, nk = q.shape[3], q.shape[2], k.shape[2]
    out, lse, work = outputs(q, k, out, q.dtype)
    if not work:
        return out, lse
    q, softmax_scale = positive_scale(q, softmax_scale)
    ensure_allocator()  # device-side tensor descriptors: 128 bytes of global scratch each
    if use_gluon(d, causal):
        from flashtile.runtime.fa3_gluon import gluon_launch

        gluon_launch(q, k, v, out, lse, softmax_scale, causal, gluon_dispatch_config(q, k, causal))
        return out, lse
    with on_device(q):
        launch(q, k, v, out, lse, softmax_scale * LOG2E, causal, fa3_config(d, causal, nq, nk))
    return out, lse


def gluon_dispatch_config(q, k, causal: bool):
    """The Gluon config of a forward on these (B, H, N, d) views (``fa3_gluon.gluon_config``'s row for the head
    dim, host descriptors from ``HOST_DESC_MIN_WORK``, the causal schedulers by key count)."""
    from flashtile.runtime.fa3_gluon import (DYNAMIC_MIN_KEYS, HOST_DESC_MIN_WORK, NARROW_PERSISTENT_MAX_KEYS,
                                             NARROW_TWO_WG_KEYS, gluon_config)

    d, nq, nk = q.shape[3], q.shape[2], k.shape[2]
    big = q.shape[0] * q.shape[1] * nq * nk * d >= HOST_DESC_MIN_WORK
    lo, hi = NARROW_TWO_WG_KEYS
    return gluon_config(d, causal, big, nk >= DYNAMIC_MIN_KEYS, lo <= nk < hi, nk < NARROW_PERSISTENT_MAX_KEYS,
                        nk >= NARROW_PERSISTENT_MAX_KEYS)


def forward_plan(q, k, v, out, lse, causal: bool):
    """The launch of :func:`forward_checked` prepared for the signature of these (B, H, N, d) views (work to do,
    descriptor-ready, as :func:`prefer_hopper` accepts them; ``out`` / ``lse`` example outputs): a callable
    ``run(q, k, v, out, lse, softmax_scale)`` for tensors of that signature (any views with their addresses)
    and ``softmax_scale > 0``."""
    from flashtile.kernels.fa3_fwd import fa3_fwd_kernel
    from flashtile.runtime.launch import launcher

    d, nq, nk = q.shape[3], q.shape[2], k.shape[2]
    if use_gluon(d, causal):
        from flashtile.runtime import fa3_gluon

        cfg = gluon_dispatch_config(q, k, causal)
        args = fa3_gluon.gluon_args(q, k, v, out, causal, cfg)
        run = fa3_gluon.gluon_launcher(args, fa3_gluon.gluon_dynamic(args, q, k, v, out, lse, 1.0))
        device_desc = args.descs is None

        def gluon_run(q, k, v, out, lse, softmax_scale: float) -> None:
            if device_desc:
                ensure_allocator()  # device-side tensor descriptors: 128 bytes of global scratch each
            run(*fa3_gluon.gluon_dynamic(args, q, k, v, out, lse, softmax_scale))

        return gluon_run
    cfg = fa3_config(d, causal, nq, nk)
    grid, static = launch_args(q, k, v, out, causal, cfg)
    run = launcher(fa3_fwd_kernel, grid, launch_dynamic(q, k, v, out, lse, 1.0), static, num_warps=cfg.num_warps,
                   num_stages=cfg.num_stages)

    def triton_run(q, k, v, out, lse, softmax_scale: float) -> None:
        ensure_allocator()
        run(*launch_dynamic(q, k, v, out, lse, softmax_scale * LOG2E))

    return triton_run


def fa3_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hopper forward on a packed batch: q (total_q, Hq, d), k, v (total_k, Hk, d), int32 (B + 1,)
    ``cu_seqlens_*`` on q's device; returns ``(out, lse)``, out (total_q, Hq, d) in q's dtype, lse
    (Hq, total_q) float32 -- :func:`flashtile.runtime.fa2_fwd.fa2_forward`'s packed contract (causal
    bottom-right per sequence).  The cu_seqlens values are not read on the host: the kernel clamps each
    sequence to the tensors and ``max_seqlen_*`` and sets ``ERR_CU_SEQLENS`` in the device error word
    (word 1: it can only store) for values that break the contract.  Callers check
    :func:`prefer_hopper_varlen` first; what it refuses raises as in :func:`fa3_forward`."""
    from flashtile.ops.validate import check_cu_seqlens, check_max_seqlen
    from flashtile.runtime.decode import error_flags

    qv, kv, vv = packed_view(q), packed_view(k), packed_view(v)
    _check(qv, kv, vv, None)
    total_q, hq, d = q.shape
    b = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q)  # types, shapes, device: the kernel reads B + 1 of each
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    max_q, max_k = check_max_seqlen(max_seqlen_q, "max_seqlen_q"), check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((hq, total_q), dtype=torch.float32, device=q.device)
    if total_q == 0:
        return out, lse
    if b == 0 or max_q == 0:  # no program has a row to write
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    softmax_scale = float(softmax_scale)
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    q, softmax_scale = positive_scale(q, softmax_scale)
    qv = packed_view(q)
    if k.shape[0] == 0:  # every key range clamps to empty and no K/V row is read: q's rows stand in
        kv = vv = qv[:, : kv.shape[1], :0]
        max_k = 0
    err = error_flags(q.device, caller="flash_attn_varlen_func")[1:]  # exists already under capture, or raises
    ensure_allocator()
    gluon_cfg = None
    # packed: the Gluon kernel as measured and GPU-tested up to d = 192 (bench/NOTES.md "Gluon packed forward")
    if GLUON_VARLEN and use_gluon(d, causal) and d <= VARLEN_GLUON_MAX_D:
        from flashtile.runtime.fa3_gluon import gluon_config

        gluon_cfg = replace(gluon_config(d, causal), persistent=False, dynamic=False, host_desc=False)
    if gluon_cfg is not None:
        from flashtile.kernels.fa3_fwd import cu_seqlens_report_kernel
        from flashtile.runtime.fa3_gluon import gluon_launch

        cfg = gluon_cfg
        with on_device(q):
            cu_seqlens_report_kernel[(b,)](cu_seqlens_q, cu_seqlens_k, err, b, max_q, max_k, total_q, kv.shape[2])
            if max_k == 0:  # no key anywhere: no descriptor over an empty K
                out.zero_()
                lse.fill_(float("-inf"))
                return out, lse
            gluon_launch(qv, kv, vv, packed_view(out), lse, softmax_scale, causal, cfg,
                         varlen=(cu_seqlens_q, cu_seqlens_k, max_q, max_k))
        return out, lse
    with on_device(q):
        launch(qv, kv, vv, packed_view(out), lse, softmax_scale * LOG2E, causal, fa3_config(d, causal, max_q, max_k),
               err=err, varlen=(cu_seqlens_q, cu_seqlens_k, max_q, max_k))
    return out, lse


def launch(q, k, v, out, lse, qk_scale: float, causal: bool, cfg: Fa3Config, descales=None, err=None,
           varlen=None, window=(-1, -1), softcap: tuple[float, float] | None = None) -> None:
    """One kernel launch on checked (B, H, N, d) views (also used by the interpreter test on CPU tensors).

    FP8: ``v`` is V transposed, (B, Hk, d, Nk) with unit stride on Nk; ``descales`` the (q, k, v)
    float32 descales broadcast to (B, Hk); ``err`` the device's int32 error word (FP8 or packed).
    Packed batch: ``varlen`` = ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)``, the views
    (1, H, total, d) (:func:`packed_view`), ``lse`` (Hq, total_q).  ``window`` / ``softcap``:
    :func:`launch_args`'s (16-bit only)."""
    from flashtile.kernels.fa3_fwd import fa3_fwd_kernel
    from flashtile.runtime.launch import launch as run_kernel

    grid, static = launch_args(q, k, v, out, causal, cfg, descales, varlen, window, softcap)
    dynamic = launch_dynamic(q, k, v, out, lse, qk_scale, descales, err, varlen)
    # bound once per problem signature (runtime.launch): through Triton's per-call binding the d = 128,
    # 1k-key forward ran at 0.56x FA2's throughput on an H100, bound once at 1.03-1.05x
    run_kernel(fa3_fwd_kernel, grid, dynamic, static, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def launch_dynamic(q, k, v, out, lse, qk_scale: float, descales=None, err=None, varlen=None) -> tuple:
    """:func:`launch`'s per-call arguments: the tensors (placeholders: ``lse``, never read) and the scale."""
    qs = ks = vs = lse
    if descales is not None:
        qs, ks, vs = descales
    cu_q, cu_k = (varlen[0], varlen[1]) if varlen is not None else (lse, lse)
    return (q, k, v, out, lse, qs, ks, vs, lse if err is None else err, cu_q, cu_k, float(qk_scale))


def launch_args(q, k, v, out, causal: bool, cfg: Fa3Config, descales=None, varlen=None, window=(-1, -1),
                softcap: tuple[float, float] | None = None) -> tuple[tuple, tuple]:
    """(grid, static arguments) of :func:`launch` on these views: only shapes and strides are read (of
    ``varlen``, its ints and cu_seqlens_q's length).  ``window``: a sliding window's (left, right), -1 unbounded
    (not causal); ``softcap``: (scale / cap, cap * log2 e), the launch's qk_scale then 1."""
    fp8 = descales is not None
    left, right = window
    if causal and (left, right) != (-1, -1):
        raise ValueError(f"window: the kernel takes causal as its own flag, got causal with window {window}")
    window_args = (None if left < 0 else int(left), None if right < 0 else int(right),
                   *(softcap if softcap is not None else (None, None)))
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    total_q, total_k = nq, nk
    packed_grid, search_steps = False, 0
    if varlen is not None:
        cu_q, _, nq, nk = varlen
        b = cu_q.shape[0] - 1
    n_batch = b
    num_m_tiles = triton.cdiv(nq, cfg.block_m)
    if varlen is not None and b > 0:
        slots = total_q // cfg.block_m + b  # per head: every sequence's tiles, at most b idle
        packed_grid = VARLEN_GRID == "packed" or (VARLEN_GRID == "auto" and b * num_m_tiles > 2 * slots)
        if packed_grid:  # one "batch" of slots (kernels/fa3_fwd._packed_slot), bit_length(b - 1) halvings each
            num_m_tiles, b, search_steps = slots, 1, (b - 1).bit_length()
    grid = (b * hq * num_m_tiles,)  # one axis: its limit is 2^31 - 1, y and z stop at 65535
    check_descriptor_grid(grid[0], "the Hopper forward")
    if fp8:
        qs, ks, vs = descales
        scale_strides = (qs.stride(0), qs.stride(1), ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1))
    else:
        scale_strides = (0,) * 6
    static = (
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *scale_strides,
        hq, hq // hk, nq, nk, num_m_tiles, n_batch, total_q, total_k, search_steps,
        *window_args,
        # constexprs, in the kernel's order: HEAD_DIM, BLOCK_D, BLOCK_M, LOG2_BLOCK_M, BLOCK_N, CAUSAL, EVEN_N,
        # WARP_SPEC, O_TMA, FP8, EXACT_E4M3, IS_VARLEN (packed: lengths unknown on the host, so never EVEN_N),
        # PACKED_GRID
        d, max(16, triton.next_power_of_2(d)), cfg.block_m, cfg.block_m.bit_length() - 1, cfg.block_n,
        bool(causal), varlen is None and nk % cfg.block_n == 0, cfg.warp_spec, cfg.o_tma, fp8, fp8 and not q.is_cuda,
        varlen is not None, packed_grid,
    )
    return grid, static
