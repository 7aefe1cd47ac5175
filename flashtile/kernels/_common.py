"""Triton helpers shared by every attention kernel (forward, backward, decoding).

They implement, tile by tile, the definition in :mod:`flashtile.reference.masks`:
softcap, ALiBi, the bottom-right-aligned causal / sliding-window mask, the
sequence-tail mask, and the dropout keep-mask.  Forward and backward call the
same helpers so the backward regenerates exactly the scores and the dropout
pattern the forward used.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------- #
# Host-side checks shared by the kernel wrappers
# --------------------------------------------------------------------------- #
def interpreting(device: torch.device | str) -> bool:
    """True when the kernels run through Triton's interpreter (CPU tensors or TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or torch.device(device).type == "cpu"


def pdl_supported(device: torch.device | str) -> bool:
    """Whether kernels on ``device`` may use programmatic dependent launch (Hopper and later).

    A kernel launched with ``launch_pdl=True`` is started while the kernel before
    it in the stream is still running; it must call ``gdc_wait()`` before it
    reads anything that kernel writes (``griddepcontrol`` is an sm_90 instruction)."""
    device = torch.device(device)
    if interpreting(device) or device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def check_kernel_tensors(names: Sequence[str], tensors: Sequence[torch.Tensor], ndim: int = 4) -> None:
    """Each tensor is a ``ndim``-D fp16/bf16/fp32 tensor; all share one dtype and one
    device, and that device matches the execution mode (CPU only with the interpreter)."""
    for name, x in zip(names, tensors):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
        if x.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    listed = ", ".join(names)
    if len({x.dtype for x in tensors}) != 1:
        raise TypeError(f"{listed} must share one dtype, got {', '.join(str(x.dtype) for x in tensors)}")
    if len({x.device for x in tensors}) != 1:
        raise ValueError(f"{listed} must be on one device, got {', '.join(str(x.device) for x in tensors)}")
    check_device_mode(tensors[0].device)


def check_device_mode(device: torch.device) -> None:
    """CPU tensors run only through the interpreter, and the interpreter only on CPU tensors."""
    env_on = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type == "cpu" and not env_on:
        raise ValueError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing flashtile.kernels")
    if device.type != "cpu" and env_on:
        raise ValueError(f"TRITON_INTERPRET=1 runs kernels on CPU tensors; got tensors on {device}")


# CUDA's grid limits: axis x up to 2^31 - 1 programs, axes y and z up to 65535
GRID_X_MAX = 2**31 - 1
GRID_YZ_MAX = 65535


def fold_grid(n_tiles: int, n_bh: int) -> tuple[int, int, int]:
    """Grid (tiles, Y, Z) for ``n_tiles`` tiles of each of ``n_bh`` (batch, head) pairs within
    CUDA's limits: program (x, y, z) owns tile x of pair z * Y + y (:func:`unfold_pid`).  The
    tile index stays fastest and the pairs follow in order, as in a (tiles, pairs) grid; axis
    z carries the pairs past 65535 (the last z-row's programs past the last pair exit).  The
    tile index is program_id(0) itself, no division: a divided-out index is a value the kernel
    must keep live, where program_id is re-read for free (ptxas, sm_90a: larger spills)."""
    if n_tiles > GRID_X_MAX:
        raise ValueError(f"{n_tiles} tiles per (batch, head) exceed CUDA's {GRID_X_MAX} programs on grid axis x")
    if n_bh > GRID_X_MAX - GRID_YZ_MAX:  # the kernels index pairs, spare programs included, in int32
        raise ValueError(f"batch * heads = {n_bh} exceeds the {GRID_X_MAX - GRID_YZ_MAX} (batch, head) pairs the kernels index")
    y = min(n_bh, GRID_YZ_MAX)
    return n_tiles, y, -(-n_bh // y)  # y * z < n_bh + y <= 2^31 - 1, so z < 65535


@triton.jit
def unfold_pid():
    """(tile, pair) of this program in a :func:`fold_grid` grid; pair may reach past the last
    (batch, head) pair when the grid has more than one z-row (the caller's program then exits)."""
    return tl.program_id(0), tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)


# Tiles are addressed from a 64-bit base plus 32-bit in-tile offsets (tile row x row stride,
# tiles of at most 256 rows): a row stride below this keeps those offsets under 2^31
TILE_ROW_STRIDE_MAX = 2**31 // 256


def wide_rows(*tensors: torch.Tensor) -> bool:
    """Whether some tensor's row stride (dim -2) would overflow 32-bit in-tile offsets: a bitwise
    OR bounds the maximum because the limit is a power of two."""
    acc = 0
    for x in tensors:
        acc |= x.stride(-2)
    return acc >= TILE_ROW_STRIDE_MAX


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """The kernels vectorise along the last dim: copy only when its stride is not 1."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


@triton.jit
def tanh_(x):
    """tanh through exp (portable: also runs in the interpreter); saturates to +-1."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def mma(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``acc + a @ b`` on the tensor cores (``acc`` may be None).  ``UPCAST_DOT`` is for
    Triton's interpreter only, whose dot multiplies bf16 *bit patterns* (it stores bf16
    as uint16): operands go to fp32 first, which is exact for bf16."""
    if UPCAST_DOT:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        c = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return c


@triton.jit
def score_mods(
    s,  # (BLOCK_M, BLOCK_N) fp32 scores already multiplied by softmax_scale
    offs_m,
    offs_n,
    seqlen_q,
    seqlen_k,
    softcap,
    slope,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
):
    """Softcap then ALiBi, as in reference/masks.py.  Returns (s, t) where t is
    tanh(s_raw / softcap) when HAS_SOFTCAP (the backward needs 1 - t^2), else s."""
    t = s
    if HAS_SOFTCAP:
        t = tanh_(s / softcap)
        s = softcap * t
    if HAS_ALIBI:
        dist = (offs_m[:, None] + (seqlen_k - seqlen_q)) - offs_n[None, :]
        dist = tl.where(dist < 0, -dist, dist)
        s = s - slope * dist.to(tl.float32)
    return s, t


@triton.jit
def allowed(
    offs_m,
    offs_n,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    CHECK_BOUNDS: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
):
    """Boolean (BLOCK_M, BLOCK_N) tile: key j is inside the sequence and the window
    of query i (``right = 0`` is causal).  Row bounds are the caller's business
    (out-of-range query rows are never stored)."""
    ok = tl.full((offs_m.shape[0], offs_n.shape[0]), 1, tl.int1)
    if CHECK_BOUNDS:
        ok = ok & (offs_n[None, :] < seqlen_k)
    diag = offs_m[:, None] + (seqlen_k - seqlen_q)
    if HAS_LEFT:
        ok = ok & (offs_n[None, :] >= diag - window_left)
    if HAS_RIGHT:
        ok = ok & (offs_n[None, :] <= diag + window_right)
    return ok


@triton.jit
def philox_state(Rng, HAS_DROPOUT: tl.constexpr):
    """(seed, offset) of the call, read from the int64 device tensor [seed, offset] (a kernel
    argument that stays the same tensor across CUDA-graph replays while its values change)."""
    if HAS_DROPOUT:
        seed = tl.load(Rng)
        offset = tl.load(Rng + 1)
    else:
        seed = tl.zeros([], tl.int64)
        offset = tl.zeros([], tl.int64)
    return seed, offset


def check_rng_state(rng_state, philox_seed: int, philox_offset: int, device: torch.device) -> torch.Tensor:
    """The int64 [seed, offset] tensor on ``device`` that the kernels read for dropout:
    ``rng_state`` itself when given, else one built from the two ints (a host-to-device copy:
    callers on a hot path or in a CUDA graph pass a device tensor)."""
    if rng_state is None:
        for name, x in (("philox_seed", philox_seed), ("philox_offset", philox_offset)):
            if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 2**63:
                raise ValueError(f"{name} must be an int in [0, 2^63), got {x!r}")
        return torch.tensor([philox_seed, philox_offset], dtype=torch.int64, device=device)
    if not isinstance(rng_state, torch.Tensor) or rng_state.dtype != torch.int64:
        got = rng_state.dtype if isinstance(rng_state, torch.Tensor) else type(rng_state).__name__
        raise TypeError(f"rng_state must be an int64 torch.Tensor [seed, offset], got {got}")
    if tuple(rng_state.shape) != (2,):
        raise ValueError(f"rng_state must have shape (2,) = [seed, offset], got {tuple(rng_state.shape)}")
    if rng_state.device != device:
        raise ValueError(f"rng_state must be on {device} (the device of q), got {rng_state.device}")
    if philox_seed or philox_offset:
        raise ValueError("pass either rng_state or philox_seed / philox_offset, not both")
    return rng_state if rng_state.stride(0) == 1 else rng_state.contiguous()


@triton.jit
def dropout_keep(philox_seed, philox_offset, bh, offs_m, offs_n, seqlen_q, seqlen_k, dropout_p):
    """Keep-mask of dropout for the tile: True with probability 1 - p.

    Counter of element (bh, i, j) = philox_offset + (bh * Nq + i) * Nk + j, in
    64-bit so any tensor size works; the key is ``philox_seed``."""
    row = bh.to(tl.int64) * seqlen_q + offs_m.to(tl.int64)
    counter = philox_offset + row[:, None] * seqlen_k + offs_n.to(tl.int64)[None, :]
    return tl.rand(philox_seed, counter) >= dropout_p


@triton.jit
def _dropout_mask_kernel(
    Out,  # (BH, Nq, Nk) int8
    philox_seed,
    philox_offset,
    n_bh,
    seqlen_q,
    seqlen_k,
    dropout_p,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m, bh = unfold_pid()
    if bh >= n_bh:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    base = Out + bh.to(tl.int64) * seqlen_q * seqlen_k
    for start_n in range(0, seqlen_k, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keep = dropout_keep(philox_seed, philox_offset, bh, offs_m, offs_n, seqlen_q, seqlen_k, dropout_p)
        ptrs = base + offs_m.to(tl.int64)[:, None] * seqlen_k + offs_n[None, :]
        tl.store(ptrs, keep.to(tl.int8), mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k))


def dropout_keep_mask(
    philox_seed: int,
    philox_offset: int,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    dropout_p: float,
    device: torch.device | str,
) -> torch.Tensor:
    """Materialise the keep-mask the kernels use, shape (batch, heads, Nq, Nk) bool.

    For tests and debugging: feed it to the reference (``dropout_mask=``) to check
    a kernel's dropout element by element."""
    out = torch.empty(batch * heads, seqlen_q, seqlen_k, dtype=torch.int8, device=device)
    if out.numel():
        grid = fold_grid(triton.cdiv(seqlen_q, 16), batch * heads)
        _dropout_mask_kernel[grid](
            out, philox_seed, philox_offset, batch * heads, seqlen_q, seqlen_k, float(dropout_p), BLOCK_M=16, BLOCK_N=32,
        )
    return out.view(batch, heads, seqlen_q, seqlen_k).bool()
