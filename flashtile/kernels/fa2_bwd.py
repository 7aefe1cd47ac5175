"""FlashAttention-2 backward pass in Triton (Dao 2023, Algorithm 2).

Notation for one (batch b, query head h), with the forward's outputs O and the
natural-log LSE L (B, Hq, Nq) saved:

    S    = scale * Q K^T, then softcap, ALiBi, bias, mask   (reference/masks.py)
    P    = exp(S - L)                      (recomputed; L = -inf rows give P = 0)
    Z    = keep / (1 - p)                  (dropout, regenerated from the Philox seed)
    dV   = (P o Z)^T dO                    (Alg. 2 line 11)
    dP   = (dO V^T) o Z                    (line 12)
    D    = rowsum(dO o O)                  (line 4; equals rowsum(P o dP))
    dS   = P o (dP - D)                    (line 13)
    dS  <- dS o (1 - t^2)  with t = tanh(scale * QK^T / softcap)   (softcap chain rule)
    dQ   = scale * dS K,   dK = scale * dS^T Q                     (lines 14-15)

Three kernels:

1. ``_bwd_preprocess``: D = rowsum(dO o O) in fp32, shape (B, Hq, Nq).
2. ``_bwd_dkdv_kernel``: one program per (kv tile, B * Hk pair).  One program owns one
   kv tile of one KV head: it loads K_j, V_j once and walks every q head of its
   GQA group and every q block that can see the tile (Alg. 2 outer loop over j,
   inner loop over i).  It works on transposed tiles S^T = K_j Q_i^T (BLOCK_N,
   BLOCK_M), as FA2's own backward does, so that dV += P^T dO and dK += dS^T Q
   take the score tile as the register operand and transpose only tiles loaded
   from memory (on Hopper a transposed shared-memory descriptor, no shuffle).
   The group's dK/dV contributions are summed in registers, so dK/dV need no
   atomics and are deterministic.  With
   ``deterministic=False`` the same program also adds dQ_i += scale * dS K_j
   into an fp32 buffer with ``tl.atomic_add`` (Alg. 2 line 15 as written):
   fewest matmuls, but the summation order of dQ depends on scheduling.
3. ``_bwd_dq_kernel`` (``deterministic=True``): one program per (q tile, B * Hq pair),
   one program per q tile walks its kv blocks and accumulates dQ in registers;
   the extra Q K^T and dO V^T recomputation buys bitwise reproducibility.  K_j^T
   and V_j^T are loaded transposed, so no register tile is transposed either.

Masking is split per tile pair: blocks that the window cuts (and the sequence
tail) go through the elementwise ``allowed`` mask; blocks entirely inside the
window skip it (``MASK`` constexpr).  Loads carry masks only where a tile can
cross the sequence end or the padded head dim (``EVEN_M``/``EVEN_N`` constexprs:
Nq, Nk multiples of the tiles; d a power of two >= 16).  Block-sparse masks
(FA1 Algorithm 5) restrict the walk to the listed blocks of
``flashtile.kernels._blocksparse``.

Grids (:func:`bwd_grids`): tiles on axis x, fastest, and the (batch, head) pairs folded
in by ``_common.fold_grid``, so any B * H launches within CUDA's grid limits.  Row
index x row stride can pass 2^31 elements (long sequences in the (B, N, H, d)
layout, an (N, N) bias): the host then sets ``WIDE`` and the kernels form row
offsets in 64 bits (``_row_offsets``); head and batch offsets are always 64-bit.  Dropout's Philox [seed, offset] is
read from an int64 device tensor (CUDA-graph safe).

fp32 inputs use ``tl.dot`` with input_precision "tf32" on the GPU (10-bit
mantissa products, fp32 accumulation): expect ~1e-3 relative gradient error,
not fp32 round-off.  Under the interpreter the products are exact fp32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashtile.kernels._blocksparse import BlockLists, kv_block_lists, q_block_lists
from flashtile.kernels._launch import launch
from flashtile.kernels._common import (
    LOG2E,
    SUPPORTED_DTYPES,
    allowed,
    check_device_mode,
    check_rng_state,
    dropout_keep,
    fold_grid,
    pdl_supported,
    philox_state,
    score_mods,
    unfold_pid,
    unit_last_stride,
)
from flashtile.reference.masks import BlockMask, normalize_window

__all__ = ["BwdConfig", "BwdGrids", "bwd_config", "bwd_grids", "fa2_backward"]

_LOG2E: tl.constexpr = tl.constexpr(LOG2E)
_MAX_HEAD_DIM = 256


# ---------------------------------------------------------------------------
# Configuration


class BwdConfig(NamedTuple):
    """Tile sizes of the backward kernels.

    ``block_m``/``block_n``: q rows per inner step / kv rows per program of the
    dK/dV kernel; ``dq_block_m``/``dq_block_n``: q rows per program / kv rows
    per inner step of the dQ kernel (also the preprocess tile).
    ``atomic_dq``: when the caller allows non-determinism, accumulate dQ with
    fp32 atomics inside the dK/dV kernel (True) or run the separate dQ kernel
    (False: recomputes S and dP, but needs no fp32 buffer, no memset, no
    conversion pass and no atomics; always used with ``deterministic=True``).
    """

    block_m: int
    block_n: int
    dq_block_m: int
    dq_block_n: int
    num_warps: int
    num_stages: int
    atomic_dq: bool = True


def _cap(tile: int, n: int) -> int:
    """Shrink a power-of-two tile to the problem: no tile larger than next_pow2(max(n, 16))."""
    return min(tile, max(16, triton.next_power_of_2(max(n, 1))))


def bwd_config(d: int, dtype: torch.dtype, causal: bool, nq: int, nk: int, device: torch.device | str) -> BwdConfig:
    """Pick the backward tiles: the only place tile sizes are chosen.

    Interpreter (CPU): 16/32 tiles, so that small test shapes still span
    several tiles and exercise the boundary/interior split and the tails.
    GPU: Hopper starting points (the lead tunes them on an H100).  The dK/dV
    program holds K_j, V_j and two fp32 (BLOCK_N, d) accumulators in registers,
    so BLOCK_N shrinks with d; the dQ program holds Q_i, dO_i and one
    accumulator, so it takes the larger q tile.  fp32 inputs double the shared
    memory per tile and get the smaller kv tile from d > 64 on.  ``causal`` is
    part of the key so tuned tables can specialise on it; the starting values
    are the same for both (only the diagonal tile pairs are masked either way).
    """
    del causal  # same starting tiles; see docstring
    if torch.device(device).type != "cuda":
        return BwdConfig(block_m=16, block_n=32, dq_block_m=32, dq_block_n=16, num_warps=4, num_stages=1)
    wide = dtype == torch.float32
    # Measured on an H100, bf16, fwd+bwd (bench/results/tune_fa2_bwd_H100_2026-11-23.json; the H200
    # runs of the same script agree): 64-row q steps over a 128-row kv tile with 8 warps and 3 stages
    # win at d = 64 and d = 128; 4 warps at d = 128 spill (two fp32 (128, 128) accumulators = 256
    # registers/thread) and run at half the speed.  The separate dQ kernel beats fp32 atomics at
    # d = 128 for every N (by 2-14%) and at d = 64 up to N = 4k; atomics win at d = 64 from N = 8k.
    if d <= 64:
        cfg = BwdConfig(64, 128, 128, 64, 8, 3, atomic_dq=nk >= 8192)
    elif d <= 128:
        cfg = BwdConfig(32, 64, 64, 32, 4, 2) if wide else BwdConfig(64, 128, 128, 64, 8, 3, atomic_dq=False)
    else:
        cfg = BwdConfig(16, 32, 32, 16, 4, 1) if wide else BwdConfig(32, 64, 64, 32, 8, 1)
    return cfg._replace(
        block_m=_cap(cfg.block_m, nq), block_n=_cap(cfg.block_n, nk),
        dq_block_m=_cap(cfg.dq_block_m, nq), dq_block_n=_cap(cfg.dq_block_n, nk),
    )


def _fit_tile(tile: int, mask_block: int) -> int:
    """Largest power of two <= tile dividing the mask block (mask blocks are multiples of 16)."""
    while mask_block % tile:
        tile //= 2
    return tile


def _fit_block_mask(cfg: BwdConfig, block_mask: BlockMask | None) -> BwdConfig:
    """Make every kernel tile divide the BlockMask's (Br, Bc): a tile never straddles two mask blocks."""
    if block_mask is None:
        return cfg
    br, bc = block_mask.block_size
    if br % 16 or bc % 16:
        raise ValueError(
            f"block_mask.block_size must be multiples of 16 for the Triton kernels (tl.dot tiles), got {(br, bc)}"
        )
    return cfg._replace(
        block_m=_fit_tile(cfg.block_m, br), block_n=_fit_tile(cfg.block_n, bc),
        dq_block_m=_fit_tile(cfg.dq_block_m, br), dq_block_n=_fit_tile(cfg.dq_block_n, bc),
    )


# ---------------------------------------------------------------------------
# Jit helpers shared by both inner loops
#
# Orientation: the dK/dV loop works on transposed score tiles S^T (BLOCK_N,
# BLOCK_M) so that both of its products with dO and Q take the score tile as
# the left operand straight from registers (dV += P^T dO, dK += dS^T Q) and
# only transpose tiles that were loaded from memory (a free change of the
# shared-memory descriptor on Hopper), never a register tile.  The dQ loop
# works on S (BLOCK_M, BLOCK_N) with K^T, V^T loaded transposed for the same
# reason.  The shared helpers of _common.py are written for (M, N) tiles; on
# S^T they are called with the roles of queries and keys swapped (derivations
# in _probs and _dropout_keep_t).


@triton.jit
def _row_offsets(offs_r, stride_r, WIDE: tl.constexpr):
    """Row index x row stride, in 64 bits when WIDE (some N x row stride reaches 2^31:
    long sequences in the (B, N, H, d) layout, an (N, N) bias), else in 32 bits.  The
    host decides (``_wide``), so common sizes keep 32-bit address arithmetic.  Built
    from the loop's row indices, the offsets are recomputed per tile: a 64-bit tile
    base plus loop-invariant 32-bit in-tile offsets, tried instead, spilled more under
    ptxas (sm_90a), the hoisted offsets staying live across the loop."""
    if WIDE:
        off = offs_r.to(tl.int64) * stride_r
    else:
        off = offs_r * stride_r
    return off


@triton.jit
def _load_tile(
    base, offs_r, stride_r, n_rows, offs_d,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, EVEN_R: tl.constexpr, TRANS: tl.constexpr, WIDE: tl.constexpr,
):
    """Tile of a (N, d) matrix with unit column stride, zero outside (N, d):
    (rows, D_PAD), or (D_PAD, rows) with TRANS (the transpose is pointer
    arithmetic, not a register shuffle).  EVEN_R says no row of the tile is
    past N; with a power-of-two d too the load carries no mask at all."""
    rows = _row_offsets(offs_r, stride_r, WIDE)
    if TRANS:
        ptrs = base + rows[None, :] + offs_d[:, None]
        row_ok = offs_r[None, :] < n_rows
        col_ok = offs_d[:, None] < HEAD_DIM
    else:
        ptrs = base + rows[:, None] + offs_d[None, :]
        row_ok = offs_r[:, None] < n_rows
        col_ok = offs_d[None, :] < HEAD_DIM
    if EVEN_R:
        if HEAD_DIM == D_PAD:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=col_ok, other=0.0)
    else:
        if HEAD_DIM == D_PAD:
            x = tl.load(ptrs, mask=row_ok, other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok & col_ok, other=0.0)
    return x


@triton.jit
def _load_rows(base, offs_r, stride_r, n_rows, offs_d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, WIDE: tl.constexpr):
    """(rows, D_PAD) tile with row and column masks (once-per-program loads)."""
    return _load_tile(base, offs_r, stride_r, n_rows, offs_d, HEAD_DIM, D_PAD, False, False, WIDE)


@triton.jit
def _store_rows(
    base, x, offs_r, stride_r, n_rows, offs_d, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, WIDE: tl.constexpr,
):
    ptrs = base + _row_offsets(offs_r, stride_r, WIDE)[:, None] + offs_d[None, :]
    if HEAD_DIM == D_PAD:
        mask = offs_r[:, None] < n_rows
    else:
        mask = (offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _load_vec(base, offs, n, EVEN: tl.constexpr):
    """Per-row statistic (D_i) of the tile; 0 past the sequence."""
    if EVEN:
        x = tl.load(base + offs)
    else:
        x = tl.load(base + offs, mask=offs < n, other=0.0)
    return x


@triton.jit
def _load_lse2(LSEh, offs_m, seqlen_q, EVEN: tl.constexpr):
    """L_i * log2(e) for the tile (so that P = exp2(S log2 e - L log2 e) costs one
    FMA per score), with -inf (empty row) and out-of-range rows mapped to +inf:
    exp2(S - inf) is exactly 0 there instead of exp(-inf + inf) = NaN."""
    if EVEN:
        lse = tl.load(LSEh + offs_m)
    else:
        lse = tl.load(LSEh + offs_m, mask=offs_m < seqlen_q, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E


@triton.jit
def _mm(a, b, DOT_PREC: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """a @ b with fp32 accumulation.  UPCAST_DOT works around the interpreter's
    bf16 matmul (it multiplies the raw uint16 storage); the operands are
    already rounded to bf16, so the result is what the tensor cores compute."""
    if UPCAST_DOT:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def _probs(
    qk, offs_m, offs_n, lse2, Biash, stride_bm, stride_bn, slope,
    seqlen_q, seqlen_k, softmax_scale, scale_log2, softcap, window_left, window_right, edge,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, MASK: tl.constexpr, TRANS: tl.constexpr, WIDE: tl.constexpr,
):
    """P = exp(S - L) from the raw products qk = Q K^T (Alg. 2 lines 9-10), S
    rebuilt exactly as the forward: scale, softcap, ALiBi, bias, mask.  With
    TRANS the tile is (BLOCK_N, BLOCK_M) = (Q K^T)^T and P^T comes back.
    Returns (P, t) with t = tanh(scale*qk/softcap) for the softcap derivative.
    With MASK, the elementwise mask is applied when the runtime scalar ``edge``
    is true (tiles inside the fully-allowed band skip it).

    Without score modifiers S log2 e = qk * (scale log2 e): one multiply.  On
    the transposed tile the _common.py helpers see keys as "queries":
      ALiBi  |i + Nk - Nq - j| = |j + Nq - Nk - i|: score_mods(kv rows, q cols, Nk, Nq);
      window j >= i + sh - left and j <= i + sh + right (sh = Nk - Nq) read as
             i <= j - sh + left and i >= j - sh - right: allowed() with (Nq, Nk)
             swapped (so its diagonal is j - sh), left/right swapped and its
             bounds check off; the key-tail check j < Nk is added here."""
    t = qk
    if HAS_SOFTCAP or HAS_ALIBI or HAS_BIAS:
        s = qk * softmax_scale
        if TRANS:
            s, t = score_mods(s, offs_n, offs_m, seqlen_k, seqlen_q, softcap, slope, HAS_SOFTCAP, HAS_ALIBI)
        else:
            s, t = score_mods(s, offs_m, offs_n, seqlen_q, seqlen_k, softcap, slope, HAS_SOFTCAP, HAS_ALIBI)
        if HAS_BIAS:
            # a dense (Nq, Nk) bias has row stride Nk: q row x Nk reaches 2^31 for Nq Nk >= 2^31
            rows_m = _row_offsets(offs_m, stride_bm, WIDE)
            rows_n = _row_offsets(offs_n, stride_bn, WIDE)
            if TRANS:
                in_seq = (offs_n[:, None] < seqlen_k) & (offs_m[None, :] < seqlen_q)
                ptrs = Biash + rows_n[:, None] + rows_m[None, :]
            else:
                in_seq = (offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k)
                ptrs = Biash + rows_m[:, None] + rows_n[None, :]
            s = s + tl.load(ptrs, mask=in_seq, other=0.0).to(tl.float32)
        s2 = s * _LOG2E
    else:
        s2 = qk * scale_log2
    if MASK:
        if edge:  # the tile pair is not inside the fully-allowed band (a scalar, per tile)
            if TRANS:
                ok = allowed(offs_n, offs_m, seqlen_k, seqlen_q, window_right, window_left, False, HAS_RIGHT, HAS_LEFT)
                ok = ok & (offs_n[:, None] < seqlen_k)
            else:
                ok = allowed(offs_m, offs_n, seqlen_q, seqlen_k, window_left, window_right, True, HAS_LEFT, HAS_RIGHT)
            s2 = tl.where(ok, s2, float("-inf"))
    if TRANS:
        p = tl.exp2(s2 - lse2[None, :])
    else:
        p = tl.exp2(s2 - lse2[:, None])
    return p, t


@triton.jit
def _dropout_keep_t(philox_seed, philox_offset, bh, offs_m, offs_n, seqlen_q, seqlen_k, dropout_p):
    """Keep-mask of the transposed (BLOCK_N, BLOCK_M) tile, bit-identical to
    ``dropout_keep`` on (M, N).  dropout_keep draws element (i, j) at counter
    off + (bh Nq + i) Nk + j.  Called with rows = keys j, "column offsets"
    i Nk (int64), one head of one row (seqlen_q = seqlen_k = 1, bh = 0) and the
    head's base folded into the offset, it draws at
    (off + bh Nq Nk) + j + i Nk: the same counter, so the same bit."""
    base = philox_offset + bh.to(tl.int64) * seqlen_q * seqlen_k
    cols = offs_m.to(tl.int64) * seqlen_k
    return dropout_keep(philox_seed, base, bh * 0, offs_n, cols, 1, 1, dropout_p)


@triton.jit
def _grad_scores(p, dp, t, delta, HAS_SOFTCAP: tl.constexpr):
    """dS = P o (dP - D) (Alg. 2 line 13; dP already carries the dropout factor Z;
    ``delta`` comes broadcast along the tile's key axis), times 1 - t^2 under
    softcap (d/dx c*tanh(x/c) = 1 - tanh^2).  The caller applies the softmax
    scale.  Orientation-agnostic: works on dS or dS^T."""
    ds = p * (dp - delta)
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    return ds


@triton.jit
def _q_range(
    start_n, seqlen_q, seqlen_k, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    """q-block starts that meet kv tile [n0, n0 + BLOCK_N): the window keeps
    key j for row i iff i + shift - left <= j <= i + shift + right (shift = Nk - Nq).

    Returns (lo, full_lo, full_hi, end): blocks in [lo, end) see the tile; those
    in [full_lo, full_hi) see all of it (no element mask needed): every row i of
    the block satisfies n0 + BLOCK_N - 1 <= i + shift + right and
    n0 >= i + shift - left, and the tile is not the sequence tail."""
    shift = seqlen_k - seqlen_q
    lo = 0
    end = seqlen_q
    full_lo = 0
    full_hi = seqlen_q
    if HAS_RIGHT:
        lo = tl.maximum(start_n - shift - window_right, 0) // BLOCK_M * BLOCK_M
        first = tl.maximum(start_n + BLOCK_N - 1 - shift - window_right, 0)
        full_lo = (first + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if HAS_LEFT:
        end = tl.minimum(start_n + BLOCK_N - shift + window_left, seqlen_q)
        last = start_n - shift + window_left - BLOCK_M + 1  # last allowed block start
        full_hi = tl.where(last >= 0, (tl.maximum(last, 0) // BLOCK_M + 1) * BLOCK_M, 0)
    full_hi = tl.where(start_n + BLOCK_N > seqlen_k, 0, full_hi)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), end)
    full_hi = tl.maximum(tl.minimum(full_hi, end), full_lo)
    return lo, full_lo, full_hi, end


@triton.jit
def _kv_range(
    start_m, seqlen_q, seqlen_k, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    """kv-block starts seen by q tile [m0, m0 + BLOCK_M): the mirror of
    :func:`_q_range`.  Returns (lo, full_lo, full_hi, end); interior blocks need
    n0 >= m0 + BLOCK_M - 1 + shift - left, n0 + BLOCK_N - 1 <= m0 + shift + right
    and n0 + BLOCK_N <= Nk."""
    shift = seqlen_k - seqlen_q
    lo = 0
    end = seqlen_k
    full_lo = 0
    full_hi = seqlen_k // BLOCK_N * BLOCK_N
    if HAS_LEFT:
        lo = tl.maximum(start_m + shift - window_left, 0) // BLOCK_N * BLOCK_N
        first = tl.maximum(start_m + BLOCK_M - 1 + shift - window_left, 0)
        full_lo = (first + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        last_row = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
        end = tl.minimum(last_row + shift + window_right + 1, seqlen_k)
        last = start_m + shift + window_right - BLOCK_N + 1  # last interior block start
        full_hi = tl.minimum(full_hi, tl.where(last >= 0, (tl.maximum(last, 0) // BLOCK_N + 1) * BLOCK_N, 0))
    full_lo = tl.minimum(tl.maximum(full_lo, lo), end)
    full_hi = tl.maximum(tl.minimum(full_hi, end), full_lo)
    return lo, full_lo, full_hi, end


# ---------------------------------------------------------------------------
# Kernels


@triton.jit
def _bwd_preprocess(
    Out, DOut, Delta,
    stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
    H_Q, n_bh, seqlen_q,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, USE_PDL: tl.constexpr, WIDE: tl.constexpr,
):
    """D_i = rowsum(dO_i o O_i) in fp32 (Alg. 2 line 4).  Grid: fold_grid(q tiles, B * Hq)."""
    if USE_PDL:  # let the dK/dV kernel start its programs (they wait for D before reading it)
        gdc_launch_dependents()
    pid_m, bh = unfold_pid()
    if bh >= n_bh:
        return
    b = (bh // H_Q).to(tl.int64)
    h = (bh % H_Q).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    o = _load_rows(Out + b * stride_ob + h * stride_oh, offs_m, stride_om, seqlen_q, offs_d, HEAD_DIM, D_PAD, WIDE)
    do = _load_rows(DOut + b * stride_dob + h * stride_doh, offs_m, stride_dom, seqlen_q, offs_d, HEAD_DIM, D_PAD, WIDE)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + bh.to(tl.int64) * seqlen_q + offs_m, delta, mask=offs_m < seqlen_q)



@triton.jit
def _dkdv_inner(
    dk, dv, k, v, Qh, DOh, LSEh, Deltah, DQh, Biash,
    stride_qm, stride_dom, stride_dqm, stride_bm, stride_bn,
    offs_n, offs_d, lo, hi, clear_lo, clear_hi, bh, slope,
    seqlen_q, seqlen_k, softmax_scale, scale_log2, softcap, window_left, window_right,
    dropout_p, dropout_scale, philox_seed, philox_offset,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_M: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr, MASK: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST_DOT: tl.constexpr, WIDE: tl.constexpr,
):
    """Alg. 2 inner loop (lines 8-16) for one kv tile over q blocks [lo, hi), in
    transposed orientation (tiles (BLOCK_N, BLOCK_M), as FA2's backward):

        S^T  = K_j Q_i^T          (Q_i^T loaded transposed)
        P^T  = exp2(S^T log2 e - (L_i log2 e)[None, :])
        dV  += (P^T o Z^T) dO_i
        dP^T = (V_j dO_i^T) o Z^T
        dS^T = P^T o (dP^T - D_i[None, :])
        dK  += dS^T Q_i           (unscaled; Q_i = (Q_i^T)^T read from shared memory)

    and with ATOMIC_DQ dQ_i += scale * (dS^T)^T K_j into the fp32 buffer: the
    only register transpose, paid by the atomic path alone.  With MASK, blocks
    starting outside [clear_lo, clear_hi) (the fully-allowed band) are masked."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qT = _load_tile(Qh, offs_m, stride_qm, seqlen_q, offs_d, HEAD_DIM, D_PAD, EVEN_M, True, WIDE)
        do = _load_tile(DOh, offs_m, stride_dom, seqlen_q, offs_d, HEAD_DIM, D_PAD, EVEN_M, False, WIDE)
        lse2 = _load_lse2(LSEh, offs_m, seqlen_q, EVEN_M)
        delta = _load_vec(Deltah, offs_m, seqlen_q, EVEN_M)
        pT, tT = _probs(
            _mm(k, qT, DOT_PREC, UPCAST_DOT), offs_m, offs_n, lse2, Biash, stride_bm, stride_bn, slope,
            seqlen_q, seqlen_k, softmax_scale, scale_log2, softcap, window_left, window_right,
            (start_m < clear_lo) | (start_m >= clear_hi), HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, MASK, True,
            WIDE,
        )
        dpT = _mm(v, tl.trans(do), DOT_PREC, UPCAST_DOT)
        pT_drop = pT
        if HAS_DROPOUT:
            # Z = keep / (1 - p) multiplies P in the forward, hence both P and dP here
            keepT = _dropout_keep_t(philox_seed, philox_offset, bh, offs_m, offs_n, seqlen_q, seqlen_k, dropout_p)
            pT_drop = tl.where(keepT, pT * dropout_scale, 0.0)
            dpT = tl.where(keepT, dpT * dropout_scale, 0.0)
        dv += _mm(pT_drop.to(do.dtype), do, DOT_PREC, UPCAST_DOT)
        dsT = _grad_scores(pT, dpT, tT, delta[None, :], HAS_SOFTCAP).to(qT.dtype)
        dk += _mm(dsT, tl.trans(qT), DOT_PREC, UPCAST_DOT)
        if ATOMIC_DQ:
            dq = _mm(tl.trans(dsT), k, DOT_PREC, UPCAST_DOT) * softmax_scale
            ptrs = DQh + _row_offsets(offs_m, stride_dqm, WIDE)[:, None] + offs_d[None, :]
            if EVEN_M and HEAD_DIM == D_PAD:
                tl.atomic_add(ptrs, dq, sem="relaxed")
            else:
                mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
                tl.atomic_add(ptrs, dq, mask=mask, sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV, DQacc, Slopes, Bias, BlkCount, BlkIndex, Rng,
    softmax_scale, softcap, dropout_p, dropout_scale,
    # ints and constexprs: fixed for a problem signature (kernels/_launch.py binds them once)
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqm,
    stride_sb, stride_sh,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_cb, stride_ch, stride_cn,
    stride_ib, stride_ih, stride_in,
    H_Q, H_K, n_bh, seqlen_q, seqlen_k, mask_block_m, mask_block_n,
    window_left, window_right,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_SPARSE: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST_DOT: tl.constexpr, USE_PDL: tl.constexpr, WIDE: tl.constexpr,
):
    """One kv tile of one KV head (Alg. 2 outer loop, lines 5-7 and 17-18),
    reduced over the GQA group's q heads in registers.  EVEN_M: Nq % BLOCK_M
    == 0, so q-side loads need no row mask; EVEN_N likewise for K_j, V_j.
    Grid: fold_grid(kv tiles, B * Hk); Rng: the int64 Philox [seed, offset]."""
    pid_n, bhk = unfold_pid()
    if bhk >= n_bh:
        return
    b = bhk // H_K
    hk = bhk % H_K
    group = H_Q // H_K
    b64 = b.to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    scale_log2 = softmax_scale * _LOG2E

    Kh = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    Vh = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh
    k = _load_tile(Kh, offs_n, stride_kn, seqlen_k, offs_d, HEAD_DIM, D_PAD, EVEN_N, False, WIDE)
    v = _load_tile(Vh, offs_n, stride_vn, seqlen_k, offs_d, HEAD_DIM, D_PAD, EVEN_N, False, WIDE)
    philox_seed, philox_offset = philox_state(Rng, HAS_DROPOUT)
    if USE_PDL:
        # programmatic dependent launch: this grid may start while the preprocess kernel runs
        # (everything read above predates it); D is read only after it has finished
        gdc_launch_dependents()
        gdc_wait()
    dk = tl.zeros((BLOCK_N, D_PAD), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, D_PAD), dtype=tl.float32)
    lo, full_lo, full_hi, end = _q_range(
        start_n, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )

    for g in range(0, group):
        h = hk * group + g
        h64 = h.to(tl.int64)
        bh = b * H_Q + h
        Qh = Q + b64 * stride_qb + h64 * stride_qh
        DOh = DO + b64 * stride_dob + h64 * stride_doh
        DQh = DQacc + b64 * stride_dqb + h64 * stride_dqh
        LSEh = LSE + bh.to(tl.int64) * seqlen_q
        Deltah = Delta + bh.to(tl.int64) * seqlen_q
        Biash = Bias + b64 * stride_bb + h64 * stride_bh
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Slopes + b64 * stride_sb + h64 * stride_sh)
        if BLOCK_SPARSE:
            # FA1 Alg. 5: only the q blocks listed for this kv block are visited
            c = (start_n // mask_block_n).to(tl.int64)
            count = tl.load(BlkCount + b64 * stride_cb + h64 * stride_ch + c * stride_cn)
            row = BlkIndex + b64 * stride_ib + h64 * stride_ih + c * stride_in
            for idx in range(0, count):
                r = tl.load(row + idx)
                blk_lo = tl.maximum(r * mask_block_m, lo)
                blk_hi = tl.minimum((r + 1) * mask_block_m, end)
                dk, dv = _dkdv_inner(
                    dk, dv, k, v, Qh, DOh, LSEh, Deltah, DQh, Biash,
                    stride_qm, stride_dom, stride_dqm, stride_bm, stride_bn,
                    offs_n, offs_d, blk_lo, blk_hi, full_lo, full_hi, bh, slope,
                    seqlen_q, seqlen_k, softmax_scale, scale_log2, softcap, window_left, window_right,
                    dropout_p, dropout_scale, philox_seed, philox_offset,
                    HEAD_DIM, D_PAD, BLOCK_M, EVEN_M, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                    HAS_BIAS, HAS_DROPOUT, ATOMIC_DQ, True, DOT_PREC, UPCAST_DOT, WIDE,
                )
        else:
            # one sweep over the q blocks that see this kv tile; blocks outside the fully-allowed
            # band [full_lo, full_hi) take the elementwise mask (a scalar branch per block)
            dk, dv = _dkdv_inner(
                dk, dv, k, v, Qh, DOh, LSEh, Deltah, DQh, Biash,
                stride_qm, stride_dom, stride_dqm, stride_bm, stride_bn,
                offs_n, offs_d, lo, end, full_lo, full_hi, bh, slope,
                seqlen_q, seqlen_k, softmax_scale, scale_log2, softcap, window_left, window_right,
                dropout_p, dropout_scale, philox_seed, philox_offset,
                HEAD_DIM, D_PAD, BLOCK_M, EVEN_M, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                HAS_BIAS, HAS_DROPOUT, ATOMIC_DQ, HAS_LEFT or HAS_RIGHT or not (EVEN_M and EVEN_N),
                DOT_PREC, UPCAST_DOT, WIDE,
            )

    dk = dk * softmax_scale
    _store_rows(DK + b64 * stride_dkb + hk.to(tl.int64) * stride_dkh, dk, offs_n, stride_dkn, seqlen_k,
                offs_d, HEAD_DIM, D_PAD, WIDE)
    _store_rows(DV + b64 * stride_dvb + hk.to(tl.int64) * stride_dvh, dv, offs_n, stride_dvn, seqlen_k,
                offs_d, HEAD_DIM, D_PAD, WIDE)


@triton.jit
def _dq_inner(
    dq, q, do, lse2, delta, Kh, Vh, Biash,
    stride_kn, stride_vn, stride_bm, stride_bn,
    offs_m, offs_d, lo, hi, clear_lo, clear_hi, bh, slope,
    seqlen_q, seqlen_k, softmax_scale, scale_log2, softcap, window_left, window_right,
    dropout_p, dropout_scale, philox_seed, philox_offset,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, MASK: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST_DOT: tl.constexpr, WIDE: tl.constexpr,
):
    """dQ_i += dS_ij K_j (unscaled) over kv blocks [lo, hi): the q-outer
    ordering of Alg. 2 line 15, so each dQ_i has a single writer.  K_j^T and
    V_j^T are loaded transposed, so S = Q_i K_j^T, dP = dO_i V_j^T and
    dQ_i += dS (K_j^T)^T move no register tile through shared memory.  With
    MASK, blocks starting outside [clear_lo, clear_hi) are masked, and K/V loads
    carry a row mask unless Nk is a multiple of BLOCK_N."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT = _load_tile(Kh, offs_n, stride_kn, seqlen_k, offs_d, HEAD_DIM, D_PAD, EVEN_N or not MASK, True, WIDE)
        vT = _load_tile(Vh, offs_n, stride_vn, seqlen_k, offs_d, HEAD_DIM, D_PAD, EVEN_N or not MASK, True, WIDE)
        p, t = _probs(
            _mm(q, kT, DOT_PREC, UPCAST_DOT), offs_m, offs_n, lse2, Biash, stride_bm, stride_bn, slope,
            seqlen_q, seqlen_k, softmax_scale, scale_log2, softcap, window_left, window_right,
            (start_n < clear_lo) | (start_n >= clear_hi), HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, MASK, False,
            WIDE,
        )
        dp = _mm(do, vT, DOT_PREC, UPCAST_DOT)
        if HAS_DROPOUT:
            keep = dropout_keep(philox_seed, philox_offset, bh, offs_m, offs_n, seqlen_q, seqlen_k, dropout_p)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = _grad_scores(p, dp, t, delta[:, None], HAS_SOFTCAP)
        dq += _mm(ds.to(kT.dtype), tl.trans(kT), DOT_PREC, UPCAST_DOT)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, Delta, DQ, Slopes, Bias, BlkCount, BlkIndex, Rng,
    softmax_scale, softcap, dropout_p, dropout_scale,
    # ints and constexprs: fixed for a problem signature (kernels/_launch.py binds them once)
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_sb, stride_sh,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_cb, stride_ch, stride_cm,
    stride_ib, stride_ih, stride_im,
    H_Q, H_K, n_bh, seqlen_q, seqlen_k, mask_block_m, mask_block_n,
    window_left, window_right,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_SPARSE: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST_DOT: tl.constexpr, USE_PDL: tl.constexpr, WIDE: tl.constexpr,
):
    """dQ of one q tile of one q head, accumulated in registers (deterministic).
    Grid: fold_grid(q tiles, B * Hq)."""
    pid_m, bh = unfold_pid()
    if bh >= n_bh:
        return
    b = bh // H_Q
    h = bh % H_Q
    hk = h // (H_Q // H_K)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = hk.to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    scale_log2 = softmax_scale * _LOG2E

    Qh = Q + b64 * stride_qb + h64 * stride_qh
    DOh = DO + b64 * stride_dob + h64 * stride_doh
    q = _load_tile(Qh, offs_m, stride_qm, seqlen_q, offs_d, HEAD_DIM, D_PAD, EVEN_M, False, WIDE)
    do = _load_tile(DOh, offs_m, stride_dom, seqlen_q, offs_d, HEAD_DIM, D_PAD, EVEN_M, False, WIDE)
    philox_seed, philox_offset = philox_state(Rng, HAS_DROPOUT)
    lse2 = _load_lse2(LSE + bh.to(tl.int64) * seqlen_q, offs_m, seqlen_q, EVEN_M)
    if USE_PDL:  # started during the dK/dV kernel: wait for it (and so for D) to finish
        gdc_wait()
    delta = _load_vec(Delta + bh.to(tl.int64) * seqlen_q, offs_m, seqlen_q, EVEN_M)
    Kh = K + b64 * stride_kb + hk64 * stride_kh
    Vh = V + b64 * stride_vb + hk64 * stride_vh
    Biash = Bias + b64 * stride_bb + h64 * stride_bh
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + b64 * stride_sb + h64 * stride_sh)
    dq = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
    lo, full_lo, full_hi, end = _kv_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )

    if BLOCK_SPARSE:
        r = (start_m // mask_block_m).to(tl.int64)
        count = tl.load(BlkCount + b64 * stride_cb + h64 * stride_ch + r * stride_cm)
        row = BlkIndex + b64 * stride_ib + h64 * stride_ih + r * stride_im
        for idx in range(0, count):
            c = tl.load(row + idx)
            blk_lo = tl.maximum(c * mask_block_n, lo)
            blk_hi = tl.minimum((c + 1) * mask_block_n, end)
            dq = _dq_inner(
                dq, q, do, lse2, delta, Kh, Vh, Biash, stride_kn, stride_vn, stride_bm, stride_bn,
                offs_m, offs_d, blk_lo, blk_hi, full_lo, full_hi, bh, slope,
                seqlen_q, seqlen_k, softmax_scale, scale_log2, softcap, window_left, window_right,
                dropout_p, dropout_scale, philox_seed, philox_offset,
                HEAD_DIM, D_PAD, BLOCK_N, EVEN_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                HAS_BIAS, HAS_DROPOUT, True, DOT_PREC, UPCAST_DOT, WIDE,
            )
    else:
        dq = _dq_inner(
            dq, q, do, lse2, delta, Kh, Vh, Biash, stride_kn, stride_vn, stride_bm, stride_bn,
            offs_m, offs_d, lo, end, full_lo, full_hi, bh, slope,
            seqlen_q, seqlen_k, softmax_scale, scale_log2, softcap, window_left, window_right,
            dropout_p, dropout_scale, philox_seed, philox_offset,
            HEAD_DIM, D_PAD, BLOCK_N, EVEN_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
            HAS_BIAS, HAS_DROPOUT, HAS_LEFT or HAS_RIGHT or not (EVEN_M and EVEN_N), DOT_PREC, UPCAST_DOT, WIDE,
        )

    dq = dq * softmax_scale
    _store_rows(DQ + b64 * stride_dqb + h64 * stride_dqh, dq, offs_m, stride_dqm, seqlen_q, offs_d, HEAD_DIM, D_PAD, WIDE)


# ---------------------------------------------------------------------------
# Host side: validation and launch


def _check_tensor(x, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype} (the dtype of q), got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} must be on {device} (the device of q), got {x.device}")


def _check_inputs(dout, q, k, v, out, lse) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, N, d), got shape {tuple(x.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    b, hq, nq, d = q.shape
    _, hk, nk, _ = k.shape
    if not 1 <= d <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{_MAX_HEAD_DIM}, got {d}")
    if hk == 0 or hq % hk:
        raise ValueError(f"number of q heads ({hq}) must be a multiple of k/v heads ({hk}) (GQA/MQA)")
    _check_tensor(k, "k", (b, hk, nk, d), q.dtype, q.device)
    _check_tensor(v, "v", (b, hk, nk, d), q.dtype, q.device)
    _check_tensor(out, "out", tuple(q.shape), q.dtype, q.device)
    _check_tensor(dout, "dout", tuple(q.shape), q.dtype, q.device)
    if not isinstance(lse, torch.Tensor) or not lse.is_floating_point():
        raise TypeError("lse must be a floating-point torch.Tensor (float32 from fa2_forward)")
    if tuple(lse.shape) != (b, hq, nq):
        raise ValueError(f"lse must have shape {(b, hq, nq)} = (B, Hq, Nq), got {tuple(lse.shape)}")
    check_device_mode(q.device)


def _check_scalars(softmax_scale, softcap, dropout_p, philox_seed, philox_offset) -> tuple[float, float, float]:
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite float, got {softmax_scale!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap >= 0 or math.isinf(softcap):
        raise ValueError(f"softcap must be a finite float >= 0 (0 disables it), got {softcap!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1], got {dropout_p!r}")
    for name, x in (("philox_seed", philox_seed), ("philox_offset", philox_offset)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError(f"{name} must be a non-negative int, got {x!r}")
    return float(softmax_scale), float(softcap), float(dropout_p)


def _slopes(alibi_slopes, b: int, hq: int, device) -> tuple[torch.Tensor | None, int, int]:
    """ALiBi slopes as fp32 plus (batch stride, head stride); (Hq,) broadcasts over batch."""
    if alibi_slopes is None:
        return None, 0, 0
    if not isinstance(alibi_slopes, torch.Tensor) or not alibi_slopes.is_floating_point():
        raise TypeError("alibi_slopes must be a floating-point torch.Tensor of shape (Hq,) or (B, Hq)")
    if tuple(alibi_slopes.shape) not in ((hq,), (b, hq)):
        raise ValueError(f"alibi_slopes must have shape ({hq},) or ({b}, {hq}), got {tuple(alibi_slopes.shape)}")
    s = alibi_slopes.to(device=device, dtype=torch.float32).contiguous()
    return (s, 0, s.stride(0)) if s.dim() == 1 else (s, s.stride(0), s.stride(1))


def _bias_view(bias, shape: tuple[int, int, int, int], device) -> torch.Tensor | None:
    """Bias expanded to (B, Hq, Nq, Nk) without copying (stride 0 on broadcast dims)."""
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        raise TypeError("bias must be a floating-point torch.Tensor broadcastable to (B, Hq, Nq, Nk)")
    if bias.device != device:
        raise ValueError(f"bias must be on {device} (the device of q), got {bias.device}")
    try:
        return bias.expand(*shape)
    except RuntimeError:
        raise ValueError(f"bias of shape {tuple(bias.shape)} is not broadcastable to (B, Hq, Nq, Nk) = {shape}") from None


def _grad_buffer(given, name: str, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer the kernel writes, tensor returned): the caller's view when usable."""
    if given is None:
        t = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        return t, t
    _check_tensor(given, name, tuple(like.shape), like.dtype, like.device)
    if given.shape[-1] > 1 and given.stride(-1) != 1:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device), given
    return given, given


class BwdGrids(NamedTuple):
    """Launch grids of the three backward kernels (each within CUDA's grid limits)."""

    preprocess: tuple[int, int, int]
    dkdv: tuple[int, int, int]
    dq: tuple[int, int, int]


def bwd_grids(b: int, hq: int, hk: int, nq: int, nk: int, cfg: BwdConfig) -> BwdGrids:
    """Tiles on the fast axis, (batch, head) pairs folded in by :func:`_common.fold_grid`."""
    q_tiles = fold_grid(triton.cdiv(nq, cfg.dq_block_m), b * hq)
    return BwdGrids(q_tiles, fold_grid(triton.cdiv(nk, cfg.block_n), b * hk), q_tiles)


def _wide(nq: int, q_side: tuple, nk: int, kv_side: tuple, bias: torch.Tensor | None) -> bool:
    """Whether some row index x row stride can reach 2^31 (an OR of strides bounds their
    maximum within a factor of 2, so this errs on the 64-bit side by at most that)."""
    sq = sk = 0
    for x in q_side:
        sq |= x.stride(2)
    for x in kv_side:
        sk |= x.stride(2)
    far = max(nq * sq, nk * sk)
    if bias is not None:
        far = max(far, nq * bias.stride(2) + nk * bias.stride(3))  # row and key offsets add up
    return far >= 2**31


def _list_args(lists: BlockLists | None, dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Block-list tensors and strides; a broadcast (size 1) leading dim gets stride 0."""
    if lists is None:
        return dummy, dummy, [0] * 6
    c, i = lists.counts, lists.indices
    def st(t, dim):
        return 0 if t.shape[dim] == 1 else t.stride(dim)
    return c, i, [st(c, 0), st(c, 1), c.stride(2), st(i, 0), st(i, 1), i.stride(2)]


def fa2_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    philox_seed: int = 0,
    philox_offset: int = 0,
    rng_state: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
    deterministic: bool = False,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of FlashAttention-2 (Dao 2023, Algorithm 2).

    q, dout, out: (B, Hq, Nq, d); k, v: (B, Hk, Nk, d) with Hq a multiple of
    Hk; any strides with unit stride on d.  lse: (B, Hq, Nq) natural log as
    returned by ``fa2_forward`` (-inf rows contribute nothing).  Returns dq
    (B, Hq, Nq, d), dk, dv (B, Hk, Nk, d) in q's dtype, written into ``dq``,
    ``dk``, ``dv`` when given.  ``deterministic=True`` uses the separate dQ
    kernel (bitwise reproducible); otherwise dQ is accumulated with fp32
    atomics inside the dK/dV kernel.  No gradient flows to bias or ALiBi.
    Dropout's Philox state: ``rng_state``, an int64 tensor [seed, offset] on
    q's device (read by the kernels, so a CUDA graph replays it with the values
    of each replay), or the ints ``philox_seed`` / ``philox_offset``.
    """
    _check_inputs(dout, q, k, v, out, lse)
    scale, softcap, dropout_p = _check_scalars(softmax_scale, softcap, dropout_p, philox_seed, philox_offset)
    left, right = normalize_window(bool(causal), window_size)
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a flashtile BlockMask or None, got {type(block_mask).__name__}")
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    dev = q.device
    slopes, stride_sb, stride_sh = _slopes(alibi_slopes, b, hq, dev)
    bias_x = _bias_view(bias, (b, hq, nq, nk), dev)
    if block_mask is not None:
        block_mask.check_seqlens(nq, nk)
    dq_buf, dq_ret = _grad_buffer(dq, "dq", q)
    dk_buf, dk_ret = _grad_buffer(dk, "dk", k)
    dv_buf, dv_ret = _grad_buffer(dv, "dv", v)

    if b * hq * nq == 0 or nk == 0:
        # nothing to attend to (Nk = 0) or nobody attending (Nq = 0): all gradients vanish
        for ret in (dq_ret, dk_ret, dv_ret):
            ret.zero_()
        return dq_ret, dk_ret, dv_ret

    q, k, v, dout, out = (unit_last_stride(x) for x in (q, k, v, dout, out))
    lse = lse.to(device=dev, dtype=torch.float32).contiguous()
    cfg = _fit_block_mask(bwd_config(d, q.dtype, bool(causal), nq, nk, dev), block_mask)
    d_pad = max(16, triton.next_power_of_2(d))
    on_gpu = dev.type == "cuda"

    # every int argument is fixed for the problem's signature (the Philox state is read from a
    # tensor): the kernels are bound once and launched from Triton's compiled objects
    # preprocess -> dK/dV -> dQ run back to back: each later kernel is launched as a programmatic
    # dependent of the one before (Hopper), so its programs start while that one drains
    pdl = pdl_supported(dev)
    delta = torch.empty(b, hq, nq, dtype=torch.float32, device=dev)
    atomic = not deterministic and cfg.atomic_dq
    qlists = q_block_lists(block_mask, b, hq, nq, nk, dev) if block_mask is not None else None
    klists = kv_block_lists(block_mask, b, hq, nq, nk, dev) if block_mask is not None and not atomic else None
    # zeroed before the preprocess kernel, so that nothing runs between it and its dependent
    dq_acc = torch.zeros(b, hq, nq, d, dtype=torch.float32, device=dev) if atomic else delta
    dq_acc_strides = list(dq_acc.stride()[:3]) if atomic else [0, 0, 0]
    grids = bwd_grids(b, hq, hk, nq, nk, cfg)
    # some row index x row stride reaches 2^31: the kernels form row offsets in 64 bits (WIDE)
    wide = _wide(nq, (q, dout, out, dq_buf, dq_acc), nk, (k, v, dk_buf, dv_buf), bias_x)
    launch(
        _bwd_preprocess, grids.preprocess, (out, dout, delta),
        (out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
         hq, b * hq, nq, d, d_pad, cfg.dq_block_m, pdl, wide), num_warps=4, num_stages=1,
    )
    rng = check_rng_state(rng_state, philox_seed, philox_offset, dev) if dropout_p > 0 else delta

    slopes_t = slopes if slopes is not None else delta
    bias_t = bias_x if bias_x is not None else delta
    bias_strides = list(bias_x.stride()) if bias_x is not None else [0, 0, 0, 0]
    features = (
        left >= 0, right >= 0, softcap > 0, slopes is not None,
        bias_x is not None, dropout_p > 0, block_mask is not None,
    )  # HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_DROPOUT, BLOCK_SPARSE
    precision = ("tf32", (not on_gpu) and q.dtype == torch.bfloat16)  # DOT_PREC, UPCAST_DOT
    # p = 1 drops everything: keep is never true, so the scale is never used
    dropout_scale = 1.0 / (1.0 - dropout_p) if dropout_p < 1.0 else 0.0
    mask_bm, mask_bn = block_mask.block_size if block_mask is not None else (1, 1)
    floats = (scale, softcap, dropout_p, dropout_scale)
    sizes = (hq, hk, nq, nk, mask_bm, mask_bn, left, right)

    # without a block mask the list pointers are never read: delta stands in (no dummy allocation)
    cnt, idx, list_strides = _list_args(qlists, delta)
    launch(
        _bwd_dkdv_kernel, grids.dkdv,
        (q, k, v, dout, lse, delta, dk_buf, dv_buf, dq_acc, slopes_t, bias_t, cnt, idx, rng, *floats),
        (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3],
         *dk_buf.stride()[:3], *dv_buf.stride()[:3], *dq_acc_strides,
         stride_sb, stride_sh, *bias_strides, *list_strides, *sizes[:2], b * hk, *sizes[2:],
         d, d_pad, cfg.block_m, cfg.block_n, nq % cfg.block_m == 0, nk % cfg.block_n == 0,
         *features, atomic, *precision, pdl, wide),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, pdl=pdl,
    )

    if atomic:
        dq_buf.copy_(dq_acc)
    else:
        cnt, idx, list_strides = _list_args(klists, delta)
        launch(
            _bwd_dq_kernel, grids.dq,
            (q, k, v, dout, lse, delta, dq_buf, slopes_t, bias_t, cnt, idx, rng, *floats),
            (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dq_buf.stride()[:3],
             stride_sb, stride_sh, *bias_strides, *list_strides, *sizes[:2], b * hq, *sizes[2:],
             d, d_pad, cfg.dq_block_m, cfg.dq_block_n, nq % cfg.dq_block_m == 0, nk % cfg.dq_block_n == 0,
             *features, *precision, pdl, wide),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, pdl=pdl,
        )

    for buf, ret in ((dq_buf, dq_ret), (dk_buf, dk_ret), (dv_buf, dv_ret)):
        if buf is not ret:
            ret.copy_(buf)
    return dq_ret, dk_ret, dv_ret
