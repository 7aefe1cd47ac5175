"""The FP8 forwards' V operand: V (B, Hk, Nk, d) rows copied transposed, (B, Hk, d, width) with keys along the
row (fp8 wgmma reads its B operand k-major only), zero past Nk; with ``PERMUTE`` each 32-key chunk in the order
of P's registers in the Gluon kernel (:func:`flashtile.kernels.fa3_gluon._p_operand`): column
32c + 16h + 4q + 2e + b holds key 32c + 16h + 8e + 2q + b.  Bytes only (the host passes uint8 views): one read
and one write of V, loads along d and stores along keys both contiguous.  Host: :mod:`flashtile.runtime.fa3_gluon`
(``fp8_v_operand``)."""

from __future__ import annotations

import triton
import triton.language as tl

from flashtile.kernels._common import unfold_pid

__all__ = ["fp8_v_transpose_kernel"]


@triton.jit
def _chunk_key(col, PERMUTE: tl.constexpr):
    """The key that output column ``col`` holds."""
    if PERMUTE:
        r = col % 32
        h = r // 16
        q = (r % 16) // 4
        e = (r % 4) // 2
        key = col - r + 16 * h + 8 * e + 2 * q + r % 2
    else:
        key = col
    return key


@triton.jit
def fp8_v_transpose_kernel(
    V, Vt, stride_vb, stride_vh, stride_vn, stride_tb, stride_th, stride_td, n_heads, n_bh, seqlen_k, width,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, PERMUTE: tl.constexpr,
):
    """Grid ``fold_grid(cdiv(width, BLOCK_K), B * Hk)``: output columns [tile * BLOCK_K, + BLOCK_K) of one (batch,
    kv head) for every d row; columns past ``width`` and rows past HEAD_DIM untouched, keys past ``seqlen_k``
    written 0."""
    tl.static_assert(BLOCK_K % 32 == 0)  # whole 32-key chunks per program
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tile, bh = unfold_pid()
    if bh >= n_bh:
        return
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    cols = tile * BLOCK_K + tl.arange(0, BLOCK_K)
    keys = _chunk_key(cols, PERMUTE=PERMUTE)
    dims = tl.arange(0, BLOCK_D)
    src = V + b * stride_vb + h * stride_vh + keys.to(tl.int64)[:, None] * stride_vn + dims[None, :]
    x = tl.load(src, mask=(keys < seqlen_k)[:, None] & (dims < HEAD_DIM)[None, :], other=0)
    dst = Vt + b * stride_tb + h * stride_th + dims.to(tl.int64)[:, None] * stride_td + cols[None, :]
    tl.store(dst, tl.trans(x), mask=(dims < HEAD_DIM)[:, None] & (cols < width)[None, :])
