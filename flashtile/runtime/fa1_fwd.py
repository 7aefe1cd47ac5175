"""Host side of the FlashAttention-1 teaching kernel: tiles from the SRAM size, grid, checks, launch.

:func:`fa1_forward` is public (the IO lab calls it directly), so it validates its own arguments.
Kernel: :mod:`flashtile.kernels.fa1_fwd`; algorithm: ``docs/fa1.md``.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton

from flashtile.kernels.fa1_fwd import _fa1_fwd_kernel
from flashtile.ops.validate import MAX_HEAD_DIM, SUPPORTED_DTYPES
from flashtile.runtime.common import GRID_X_MAX, check_device_mode, interpreting, unit_last_stride

__all__ = ["fa1_forward", "fa1_tiles", "fa1_grid"]

_MIN_TILE = 16  # smallest tl.dot operand dimension
_MAX_TILE = 128


# --------------------------------------------------------------------------- #
# Tiles
# --------------------------------------------------------------------------- #
def _pow2_floor(x: int) -> int:
    return 1 << (int(x).bit_length() - 1)


def fa1_tiles(sram_elems: int, d: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) the kernel uses for an SRAM of ``sram_elems`` elements (M) and head dim d.

    Algorithm 1 line 1 gives ``Bc = ceil(M / 4d)``, ``Br = min(Bc, d)``; each is
    rounded down to a power of two (tl.dot tiles), then clamped to
    [16, 128] (to [16, 64] when d > 128): so for ``M < 64 d`` the tiles are
    larger than the paper's, and for large M smaller.
    """
    _check_sram(sram_elems, d)
    bc = -(-sram_elems // (4 * d))
    br = min(bc, d)
    cap = _MAX_TILE if d <= 128 else _MAX_TILE // 2

    def clamp(x: int) -> int:
        return min(max(_pow2_floor(x), _MIN_TILE), cap)

    return clamp(br), clamp(bc)


def _num_warps(block_m: int, block_n: int) -> int:
    # the score tile is block_m x block_n fp32; keep it near 32 registers per thread
    return 4 if block_m * block_n <= 64 * 64 else 8


def fa1_grid(b: int, h: int) -> tuple[int]:
    """One program per (batch, head) on grid axis x (CUDA allows 2^31 - 1 there; y and z only 65535)."""
    if b * h > GRID_X_MAX:
        raise ValueError(f"batch * heads = {b * h} exceeds the {GRID_X_MAX} programs FA1's grid allows")
    return (b * h,)


# --------------------------------------------------------------------------- #
# Python wrapper
# --------------------------------------------------------------------------- #
def _check_sram(sram_elems: object, d: int) -> None:
    if isinstance(sram_elems, bool) or not isinstance(sram_elems, numbers.Integral):
        raise TypeError(f"sram_elems must be an int (SRAM size M in elements), got {type(sram_elems).__name__}")
    if sram_elems < d:
        raise ValueError(f"sram_elems (M) must be >= head_dim d = {d} so one row fits in SRAM, got {sram_elems}")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """A public teaching kernel: checks its own arguments, with the constants of :mod:`flashtile.ops.validate`."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(x.shape)}")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    check_device_mode(q.device)
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} must equal v shape {tuple(v.shape)}")
    b, h, _, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d):
        raise ValueError(
            f"k and v must be (B, H, Nk, d) = ({b}, {h}, Nk, {d}) like q (FA1 has no GQA), got {tuple(k.shape)}"
        )
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {d}")


def fa1_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sram_elems: int,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-1 forward (Algorithm 1) with tiles from an SRAM of ``sram_elems`` elements.

    q: (B, H, Nq, d); k, v: (B, H, Nk, d); one dtype among fp16 / bf16 / fp32;
    any strides (a non-unit stride on d is copied); 1 <= d <= 256 and
    ``sram_elems >= d``.  ``softmax_scale`` defaults to 1/sqrt(d); ``causal`` is
    bottom-right aligned.  Returns the output (B, H, Nq, d) in q's dtype, and
    with ``return_lse=True`` also the natural-log LSE (B, H, Nq) fp32,
    ``m + log l`` from the HBM state (-inf on rows that see no key).
    """
    _check_inputs(q, k, v)
    b, h, nq, d = q.shape
    nk = k.shape[2]
    _check_sram(sram_elems, d)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be a finite float or None, got {softmax_scale}")
    device = q.device
    out = torch.empty((b, h, nq, d), dtype=q.dtype, device=device)
    lse_state = torch.empty((2, b * h, nq), dtype=torch.float32, device=device)  # line 2's l and m
    if b * h * nq == 0 or nk == 0:  # nothing to attend to: every row is empty
        out.zero_()
        lse = torch.full((b, h, nq), float("-inf"), dtype=torch.float32, device=device)
        return (out, lse) if return_lse else out
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)

    block_m, block_n = fa1_tiles(sram_elems, d)
    block_d = max(_MIN_TILE, triton.next_power_of_2(d))
    o32 = torch.empty((b * h, nq, block_d), dtype=torch.float32, device=device)
    l_hbm, m_hbm = lse_state[0], lse_state[1]
    _fa1_fwd_kernel[fa1_grid(b, h)](
        q, k, v, out, o32, l_hbm, m_hbm,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        h, nq, nk, d, scale,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, CAUSAL=causal,
        DOT_PRECISION="tf32",  # fp32 inputs on TF32 tensor cores; fp16 / bf16 ignore it
        UPCAST_DOT=q.dtype == torch.bfloat16 and interpreting(device),
        num_warps=_num_warps(block_m, block_n), num_stages=1,
    )
    if not return_lse:
        return out
    l_fin, m_fin = l_hbm.view(b, h, nq), m_hbm.view(b, h, nq)
    empty = l_fin == 0
    lse = torch.where(empty, float("-inf"), m_fin + torch.log(torch.where(empty, 1.0, l_fin)))
    return out, lse
