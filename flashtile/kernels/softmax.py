"""Row softmax kernels, online (2 reads + 1 write per element) and safe (3 reads + 1 write): jit code only.

Host side: :mod:`flashtile.runtime.softmax`; the pass structure and access counts are written up
in ``docs/softmax.md``.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
