"""Host side of the row-softmax kernels: block size, checks, launches over rows.

:func:`softmax_online` and :func:`softmax_safe` are public teaching kernels (the IO lab calls them),
so they validate their own arguments.  Kernels: :mod:`flashtile.kernels.softmax`; write-up:
``docs/softmax.md``.
"""

from __future__ import annotations

import numbers

import torch
import triton

from flashtile.kernels.softmax import _softmax_online_kernel, _softmax_safe_kernel
from flashtile.ops.validate import SUPPORTED_DTYPES
from flashtile.runtime.common import GRID_X_MAX, check_device_mode, interpreting

__all__ = ["softmax_online", "softmax_safe", "softmax_block", "row_chunks"]

_GPU_MAX_BLOCK = 4096  # elements per block on a GPU: 16 KB of fp32 per program in registers
_CPU_MAX_BLOCK = 1024


# --------------------------------------------------------------------------- #
# Python wrappers
# --------------------------------------------------------------------------- #
def softmax_block(n: int, device: torch.device | str) -> int:
    """Default block: the row length rounded up to a power of two, at most 4096 on a GPU
    (1024 in the interpreter), at least 16."""
    cap = _CPU_MAX_BLOCK if interpreting(device) else _GPU_MAX_BLOCK
    return max(16, min(triton.next_power_of_2(max(n, 1)), cap))


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))  # 8 fp32 elements per thread per block


def _check(x: torch.Tensor, block_size: int | None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (softmax is over the last one), got a 0-d tensor")
    if block_size is not None:
        if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
            raise TypeError(f"block_size must be a power-of-two int >= 16 or None, got {type(block_size).__name__}")
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power-of-two int >= 16 or None, got {block_size}")
    check_device_mode(x.device)


def _launch(kernel, x: torch.Tensor, block_size: int | None) -> torch.Tensor:
    _check(x, block_size)
    n = x.shape[-1]
    if x.numel() == 0:
        return torch.empty_like(x)
    x2 = x.reshape(-1, n)  # a view whenever the leading dims allow it
    if n > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    y2 = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = softmax_block(n, x.device) if block_size is None else int(block_size)
    for start, rows in row_chunks(x2.shape[0]):
        xs, ys = (x2, y2) if rows == x2.shape[0] else (x2[start:start + rows], y2[start:start + rows])
        kernel[(rows,)](xs, ys, x2.stride(0), y2.stride(0), n, BLOCK=block, num_warps=_num_warps(block))
    return y2.view(x.shape)


def row_chunks(rows: int) -> list[tuple[int, int]]:
    """(first row, row count) of each launch: one program per row on grid axis x, whose
    CUDA limit is 2^31 - 1 programs, so a tensor with more rows takes several launches."""
    return [(start, min(GRID_X_MAX, rows - start)) for start in range(0, rows, GRID_X_MAX)]


def softmax_online(x: torch.Tensor, *, block_size: int | None = None) -> torch.Tensor:
    """Softmax over the last dim with the online normaliser: 2 reads + 1 write per element.

    ``x``: any shape, fp16 / bf16 / fp32; returns the same shape and dtype.
    ``block_size`` (a power of two >= 16) overrides :func:`softmax_block`.
    """
    return _launch(_softmax_online_kernel, x, block_size)


def softmax_safe(x: torch.Tensor, *, block_size: int | None = None) -> torch.Tensor:
    """Softmax over the last dim in three passes (max, sum, output): 3 reads + 1 write per element.

    Same arguments as :func:`softmax_online`.
    """
    return _launch(_softmax_safe_kernel, x, block_size)
