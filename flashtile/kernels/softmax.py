"""Row softmax as Triton kernels: the online (2 reads + 1 write) and the safe (3 reads + 1 write) variant.

These are the GPU counterparts of :func:`flashtile.reference.softmax.online_softmax`
(in its block form, :func:`~flashtile.reference.softmax.block_online_softmax`)
and :func:`~flashtile.reference.softmax.safe_softmax`.  A softmax of a long
row is memory-bound, so the number of passes over HBM sets its speed:

* :func:`softmax_safe` (Milakov & Gimelshein 2018, Algorithm 2): pass 1 reads
  x for ``m = max x``; pass 2 reads x for ``l = sum exp(x - m)``; pass 3
  reads x and writes ``y = exp(x - m) / l``.  4 accesses per element.
* :func:`softmax_online` (their Algorithm 3, as FA1 Section 3.1 tiles it):
  pass 1 reads x once and carries the running max and normaliser over the
  row's blocks of ``BLOCK`` elements,

      m_new = max(m, max_k x_k),   l = l * exp(m - m_new) + sum_k exp(x_k - m_new)

  (the merge of FA1 Algorithm 1, lines 10-11); pass 2 reads x and writes y.
  3 accesses per element, so safe / online = 4 / 3 in bytes
  (:func:`flashtile.iomodel.softmax_accesses`).

The kernels never keep a row on chip between passes, even when it would fit
in one block: the point is to measure the access counts above.  Both take a
tensor of any shape and work on its last dimension (rows of any length: a row
longer than one block loops over blocks), in fp16, bf16 or fp32, with fp32
arithmetic and the output in the input's dtype.  One program per row.
``-inf`` entries are masked entries; a row of only ``-inf`` gives zeros
(``m = -inf`` is replaced by 0 in the exponents and ``l = 0`` by 1 in the
division, so neither ``-inf - -inf`` nor ``0 / 0`` is evaluated).  ``+inf`` and
NaN are not checked (that would cost another pass) and give NaN.
"""

from __future__ import annotations

import numbers
import os

import torch
import triton
import triton.language as tl

from flashtile.kernels._common import GRID_X_MAX

__all__ = ["softmax_online", "softmax_safe", "softmax_block", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_GPU_MAX_BLOCK = 4096  # elements per block on a GPU: 16 KB of fp32 per program in registers
_CPU_MAX_BLOCK = 1024


# --------------------------------------------------------------------------- #
# Triton kernels
# --------------------------------------------------------------------------- #
@triton.jit
def _load(row_ptr, offs, n):
    """One block of the row in fp32; positions past the row read as -inf (weight exp(-inf) = 0)."""
    return tl.load(row_ptr + offs, mask=offs < n, other=float("-inf")).to(tl.float32)


@triton.jit
def _safe(m):
    """-inf -> 0, so that ``x - safe(m)`` stays -inf (not NaN) on a row of only -inf."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _write(x_row, y_row, n, m, l, BLOCK: tl.constexpr):
    """Output pass shared by both variants: read x, write ``y = exp(x - m) / l`` (1 read + 1 write)."""
    offs0 = tl.arange(0, BLOCK)
    m_s = _safe(m)
    inv_l = 1.0 / tl.where(l > 0.0, l, 1.0)  # l = 0 only on a row of -inf, where exp(x - m_s) = 0
    for start in range(0, n, BLOCK):
        offs = start + offs0
        x = _load(x_row, offs, n)
        y = tl.exp(x - m_s) * inv_l
        tl.store(y_row + offs, y.to(y_row.dtype.element_ty), mask=offs < n)


@triton.jit
def _softmax_online_kernel(X, Y, stride_x, stride_y, n, BLOCK: tl.constexpr):
    """Program r: softmax of row r in two passes (online statistics, then output)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    offs0 = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.zeros([], tl.float32)
    for start in range(0, n, BLOCK):  # pass 1: max and normaliser together
        x = _load(x_row, start + offs0, n)
        m_new = tl.maximum(m, tl.max(x, 0))
        # rescale the normaliser of the blocks seen so far to the new max, add this block's
        l = l * tl.exp(m - _safe(m_new)) + tl.sum(tl.exp(x - _safe(m_new)), 0)
        m = m_new
    _write(x_row, y_row, n, m, l, BLOCK)  # pass 2


@triton.jit
def _softmax_safe_kernel(X, Y, stride_x, stride_y, n, BLOCK: tl.constexpr):
    """Program r: softmax of row r in three passes (max, sum, output)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    offs0 = tl.arange(0, BLOCK)
    m_vec = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(0, n, BLOCK):  # pass 1: max (elementwise across blocks, reduced once)
        m_vec = tl.maximum(m_vec, _load(x_row, start + offs0, n))
    m = tl.max(m_vec, 0)
    m_s = _safe(m)
    l_vec = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n, BLOCK):  # pass 2: normaliser
        l_vec += tl.exp(_load(x_row, start + offs0, n) - m_s)
    l = tl.sum(l_vec, 0)
    _write(x_row, y_row, n, m, l, BLOCK)  # pass 3


# --------------------------------------------------------------------------- #
# Python wrappers
# --------------------------------------------------------------------------- #
def _interpreting(device: torch.device) -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or device.type == "cpu"


def softmax_block(n: int, device: torch.device | str) -> int:
    """Default block: the row length rounded up to a power of two, at most 4096 on a GPU
    (1024 in the interpreter), at least 16."""
    cap = _CPU_MAX_BLOCK if _interpreting(torch.device(device)) else _GPU_MAX_BLOCK
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
    if x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ValueError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing flashtile.kernels")
    if x.device.type != "cpu" and _interpreting(x.device):
        raise ValueError(f"TRITON_INTERPRET=1 runs kernels on CPU tensors; got a tensor on {x.device}")


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
