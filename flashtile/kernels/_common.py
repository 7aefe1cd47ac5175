"""Triton helpers shared by the attention kernels: tile GEMM, program index, tanh, Philox dropout.

Masks and score modifiers are in :mod:`flashtile.kernels.mask`, key/query block ranges in
:mod:`flashtile.kernels.block_info`; host code is in :mod:`flashtile.runtime.common`.
Forward and backward call the same dropout helpers, so the backward regenerates exactly
the forward's keep pattern.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def unfold_pid():
    """(tile, pair) of this program in a :func:`flashtile.runtime.common.fold_grid` grid; pair may reach past the last
    (batch, head) pair when the grid has more than one z-row (the caller's program then exits)."""
    return tl.program_id(0), tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)


@triton.jit
def multiple16(x):
    """``x``, a multiple of 16 (the host checked), as a value the compiler knows is one: what Triton's
    specialisation of an int argument divisible by 16 gives, for a ``do_not_specialize`` (per-call) one,
    so pointers offset by it stay 16-byte aligned (vector loads).  Two scalar instructions a program."""
    return (x >> 4) << 4


@triton.jit
def check_tiles(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Compile-time tile invariants of the FA2 kernels (HEAD_DIM: the largest head dim BLOCK_D must hold)."""
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0, "tl.dot tiles: BLOCK_M, BLOCK_N multiples of 16")
    tl.static_assert(BLOCK_D >= HEAD_DIM and BLOCK_D >= 16 and (BLOCK_D & (BLOCK_D - 1)) == 0,
                     "BLOCK_D: a power of two >= 16 holding the head dim")


@triton.jit
def tanh_(x):
    """tanh through exp (portable: also runs in the interpreter); saturates to +-1.  Below |x| = 1/8 its odd series
    to x^5 (truncation < 2e-7 relative): 1 - 2 / (e^2x + 1) cancels there to an absolute error of ~6e-8, which a
    softcap c multiplies in c * tanh(s / c) (c = 1e6 was 0.06 off)."""
    x2 = x * x
    series = x + x * x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0))
    return tl.where(tl.abs(x) < 0.125, series, 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


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


@triton.jit
def head_desc(base, rows, stride_row, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """(rows, HEAD_DIM) tensor descriptor of one head; loads past either bound read 0, stores there are dropped."""
    return tl.make_tensor_descriptor(base, shape=[rows, HEAD_DIM], strides=[stride_row, 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_D])


@triton.jit
def e4m3_exact(y):
    """fp32 ``y`` in [-448, 448] rounded to the nearest e4m3 value, ties to even, the sign of -0 kept, by fp32
    arithmetic; the final cast is then exact, so the result is bit for bit torch's cast on every backend
    (Triton's interpreter loses the carry into the exponent when it casts: 124.3 -> 64).  Spacing of e4m3
    values around |y|: 2^(e - 3) for exponent e >= -6 (subnormals below keep 2^-9); adding and subtracting
    1.5 * 2^23 rounds y / spacing (|.| <= 16) to an integer, ties to even."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    spacing = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    r = tl.abs(((y / spacing + 12582912.0) - 12582912.0) * spacing)
    r = (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # keep the sign (of -0 too)
    return r.to(tl.float8e4nv)


@triton.jit
def query_tile(num_m_tiles, n_heads, kv_group, LAST_FIRST: tl.constexpr):
    """``(bh, tile, off_b, off_h, off_hk)`` of a program of a 1-D grid of B * Hq * num_m_tiles query tiles,
    the tiles of one head adjacent (they share its K and V in L2); ``LAST_FIRST`` (causal) runs each head's
    tiles last-first, the longest rows first.  Batch and head offsets are int64."""
    pid = tl.program_id(0)
    bh = pid // num_m_tiles
    tile = pid % num_m_tiles
    if LAST_FIRST:
        tile = num_m_tiles - 1 - tile
    off_b = (bh // n_heads).to(tl.int64)
    off_h = (bh % n_heads).to(tl.int64)
    return bh, tile, off_b, off_h, off_h // kv_group
