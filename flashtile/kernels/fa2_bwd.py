"""FlashAttention-2 backward kernels (Dao 2023, Algorithm 2): jit code only.

``_bwd_preprocess`` (D = rowsum(dO o O)), ``_bwd_dkdv_kernel`` (one kv tile per program, dK/dV
in registers, optionally dQ by fp32 atomics) and ``_bwd_dq_kernel`` (one q tile per program,
deterministic dQ).  Block ranges come from :mod:`flashtile.kernels.block_info`, masks and score
modifiers from :mod:`flashtile.kernels.mask`.  Grids, strides, tiles and launches are in
:mod:`flashtile.runtime.fa2_bwd`; the algorithm is written up in ``docs/fa2.md``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashtile.kernels._common import LOG2E, check_tiles, dropout_keep, mma, philox_state, unfold_pid
from flashtile.kernels.block_info import kv_block_range, q_block_range, seq_base, seqlen_info
from flashtile.kernels.mask import allowed, score_mods

_LOG2E: tl.constexpr = tl.constexpr(LOG2E)


# ---------------------------------------------------------------------------
# Jit helpers shared by both inner loops
#
# Orientation: the dK/dV loop works on transposed score tiles S^T (BLOCK_N,
# BLOCK_M) so that both of its products with dO and Q take the score tile as
# the left operand straight from registers (dV += P^T dO, dK += dS^T Q) and
# only transpose tiles that were loaded from memory (a free change of the
# shared-memory descriptor on Hopper), never a register tile.  The dQ loop
# works on S (BLOCK_M, BLOCK_N) with K^T, V^T loaded transposed for the same
# reason.  The helpers of kernels/mask.py are written for (M, N) tiles; on
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
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_R: tl.constexpr, TRANS: tl.constexpr, WIDE: tl.constexpr,
):
    """Tile of a (N, d) matrix with unit column stride, zero outside (N, d):
    (rows, BLOCK_D), or (BLOCK_D, rows) with TRANS (the transpose is pointer
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
        if HEAD_DIM == BLOCK_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=col_ok, other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            x = tl.load(ptrs, mask=row_ok, other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok & col_ok, other=0.0)
    return x


@triton.jit
def _in_range(offs_r, n_rows, EVEN_R: tl.constexpr):
    """Row indices of a tile that starts inside [0, n_rows), those past the end replaced by the last row
    (loaded without a row mask; the caller makes their contribution 0), unchanged when EVEN_R."""
    if EVEN_R:
        rows = offs_r
    else:
        rows = tl.minimum(offs_r, n_rows - 1)
    return rows


@triton.jit
def _load_rows(base, offs_r, stride_r, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr):
    """(rows, BLOCK_D) tile with row and column masks (once-per-program loads)."""
    return _load_tile(base, offs_r, stride_r, n_rows, offs_d, HEAD_DIM, BLOCK_D, False, False, WIDE)


@triton.jit
def _store_rows(
    base, x, offs_r, stride_r, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr,
):
    ptrs = base + _row_offsets(offs_r, stride_r, WIDE)[:, None] + offs_d[None, :]
    if HEAD_DIM == BLOCK_D:
        mask = offs_r[:, None] < n_rows
    else:
        mask = (offs_r[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _row_stats(X, bh, off_h, q_start, seqlen_q, total_q, IS_VARLEN: tl.constexpr):
    """Row 0 of this (batch, head)'s per-row statistic (LSE, D): (B, H, Nq) contiguous, or
    (H, total_q) for a packed batch (flash-attn's varlen softmax_lse layout)."""
    if IS_VARLEN:
        base = X + off_h.to(tl.int64) * total_q + q_start
    else:
        base = X + bh.to(tl.int64) * seqlen_q
    return base


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
def _probs(
    qk, offs_m, offs_n, lse2, Biash, stride_bias_m, stride_bias_n, slope,
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
    the transposed tile the kernels/mask.py helpers see keys as "queries":
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
            rows_m = _row_offsets(offs_m, stride_bias_m, WIDE)
            rows_n = _row_offsets(offs_n, stride_bias_n, WIDE)
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


# ---------------------------------------------------------------------------
# Kernels


@triton.jit(do_not_specialize=["total_q"])  # packed totals change every batch: no recompiles
def _bwd_preprocess(
    Out, DOut, Delta, CuSeqQ,
    stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
    n_heads_q, n_bh, seqlen_q, total_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, USE_PDL: tl.constexpr, WIDE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """D_i = rowsum(dO_i o O_i) in fp32 (Alg. 2 line 4).  Grid: fold_grid(q tiles, B * Hq).
    IS_VARLEN: packed rows as in the forward kernel, D (H, total_q)."""
    check_tiles(BLOCK_M=BLOCK_M, BLOCK_N=16, BLOCK_D=BLOCK_D, HEAD_DIM=HEAD_DIM)
    if USE_PDL:  # let the dK/dV kernel start its programs (they wait for D before reading it)
        gdc_launch_dependents()
    pid_m, bh = unfold_pid()
    if bh >= n_bh:
        return
    b = bh // n_heads_q
    h = bh % n_heads_q
    q_start, len_q, _, _ = seqlen_info(CuSeqQ, CuSeqQ, b, seqlen_q, seqlen_q, total_q, total_q, IS_VARLEN=IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if IS_VARLEN:
        if start_m >= len_q:
            return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    Oh = seq_base(Out, b, h, q_start, stride_ob, stride_oh, stride_om, IS_VARLEN=IS_VARLEN)
    DOh = seq_base(DOut, b, h, q_start, stride_dob, stride_doh, stride_dom, IS_VARLEN=IS_VARLEN)
    o = _load_rows(Oh, offs_m, stride_om, len_q, offs_d, HEAD_DIM, BLOCK_D, WIDE)
    do = _load_rows(DOh, offs_m, stride_dom, len_q, offs_d, HEAD_DIM, BLOCK_D, WIDE)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    Deltah = _row_stats(Delta, bh, h, q_start, seqlen_q, total_q, IS_VARLEN=IS_VARLEN)
    tl.store(Deltah + offs_m, delta, mask=offs_m < len_q)



@triton.jit
def _dkdv_inner(
    dk, dv, k, v, Qh, DOh, LSEh, Deltah, DQh, Biash,
    stride_qm, stride_dom, stride_dqm, stride_bias_m, stride_bias_n,
    offs_n, offs_d, lo, hi, clear_lo, clear_hi, bh, slope,
    seqlen_q, seqlen_k, softmax_scale, scale_log2, softcap, window_left, window_right,
    dropout_p, dropout_scale, philox_seed, philox_offset, drop_nq, drop_nk,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_M: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr, MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, WIDE: tl.constexpr,
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
        # the block crossing a ragged end of q reads its last row again in place of the missing rows: their
        # LSE loads as +inf, so P = 0 there and they add exactly 0; no Q / dO load needs a row mask
        rows_m = _in_range(offs_m, seqlen_q, EVEN_M)
        qT = _load_tile(Qh, rows_m, stride_qm, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True, True, WIDE)
        do = _load_tile(DOh, rows_m, stride_dom, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True, False, WIDE)
        lse2 = _load_lse2(LSEh, offs_m, seqlen_q, EVEN_M)
        delta = _load_vec(Deltah, offs_m, seqlen_q, EVEN_M)
        pT, tT = _probs(
            mma(k, qT, None, DOT_PRECISION, UPCAST_DOT), offs_m, offs_n, lse2, Biash, stride_bias_m, stride_bias_n, slope,
            seqlen_q, seqlen_k, softmax_scale, scale_log2, softcap, window_left, window_right,
            (start_m < clear_lo) | (start_m >= clear_hi), HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, MASK, True,
            WIDE,
        )
        dpT = mma(v, tl.trans(do), None, DOT_PRECISION, UPCAST_DOT)
        pT_drop = pT
        if HAS_DROPOUT:
            # Z = keep / (1 - p) multiplies P in the forward, hence both P and dP here
            keepT = _dropout_keep_t(philox_seed, philox_offset, bh, offs_m, offs_n, drop_nq, drop_nk, dropout_p)
            pT_drop = tl.where(keepT, pT * dropout_scale, 0.0)
            dpT = tl.where(keepT, dpT * dropout_scale, 0.0)
        dv += mma(pT_drop.to(do.dtype), do, None, DOT_PRECISION, UPCAST_DOT)
        dsT = _grad_scores(pT, dpT, tT, delta[None, :], HAS_SOFTCAP).to(qT.dtype)
        dk += mma(dsT, tl.trans(qT), None, DOT_PRECISION, UPCAST_DOT)
        if ATOMIC_DQ:
            dq = mma(tl.trans(dsT), k, None, DOT_PRECISION, UPCAST_DOT) * softmax_scale
            ptrs = DQh + _row_offsets(offs_m, stride_dqm, WIDE)[:, None] + offs_d[None, :]
            if EVEN_M and HEAD_DIM == BLOCK_D:
                tl.atomic_add(ptrs, dq, sem="relaxed")
            else:
                mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
                tl.atomic_add(ptrs, dq, mask=mask, sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["total_q", "total_k"])  # packed totals change every batch: no recompiles
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV, DQacc, Alibi, Bias, BlockCount, BlockIdx, Rng, CuSeqQ, CuSeqK,
    softmax_scale, softcap, dropout_p, dropout_scale,
    # ints and constexprs: fixed for a problem signature (runtime/launch.py binds them once)
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqm,
    stride_alibi_b, stride_alibi_h,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    stride_cnt_b, stride_cnt_h, stride_cnt_r,
    stride_idx_b, stride_idx_h, stride_idx_r,
    n_heads_q, n_heads_k, n_bh, seqlen_q, seqlen_k, total_q, total_k, mask_block_m, mask_block_n,
    window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, IS_BLOCK_SPARSE: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, USE_PDL: tl.constexpr, WIDE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """One kv tile of one KV head (Alg. 2 outer loop, lines 5-7 and 17-18),
    reduced over the GQA group's q heads in registers.  EVEN_M: Nq % BLOCK_M
    == 0, so q-side loads need no row mask; EVEN_N likewise for K_j, V_j.
    Grid: fold_grid(kv tiles, B * Hk); Rng: the int64 Philox [seed, offset].
    IS_VARLEN: packed rows, LSE and D (H, total_q), as in the forward kernel."""
    check_tiles(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HEAD_DIM=HEAD_DIM)
    pid_n, bhk = unfold_pid()
    if bhk >= n_bh:
        return
    b = bhk // n_heads_k
    hk = bhk % n_heads_k
    q_start, len_q, k_start, len_k = seqlen_info(
        CuSeqQ, CuSeqK, b, seqlen_q, seqlen_k, total_q, total_k, IS_VARLEN=IS_VARLEN
    )
    start_n = pid_n * BLOCK_N
    if IS_VARLEN:
        if start_n >= len_k:  # the grid covers max_seqlen_k keys; this sequence ends earlier
            return
    group = n_heads_q // n_heads_k
    b64 = b.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    scale_log2 = softmax_scale * _LOG2E

    Kh = seq_base(K, b, hk, k_start, stride_kb, stride_kh, stride_kn, IS_VARLEN=IS_VARLEN)
    Vh = seq_base(V, b, hk, k_start, stride_vb, stride_vh, stride_vn, IS_VARLEN=IS_VARLEN)
    k = _load_tile(Kh, offs_n, stride_kn, len_k, offs_d, HEAD_DIM, BLOCK_D, EVEN_N, False, WIDE)
    v = _load_tile(Vh, offs_n, stride_vn, len_k, offs_d, HEAD_DIM, BLOCK_D, EVEN_N, False, WIDE)
    philox_seed, philox_offset = philox_state(Rng, HAS_DROPOUT)
    if USE_PDL:
        # programmatic dependent launch: this grid may start while the preprocess kernel runs
        # (everything read above predates it); D is read only after it has finished
        gdc_launch_dependents()
        gdc_wait()
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    lo, full_lo, full_hi, end = q_block_range(
        start_n, start_n + BLOCK_N, len_q, len_k, window_left, window_right, BLOCK_M, HAS_LEFT, HAS_RIGHT
    )

    for g in range(0, group):
        h = hk * group + g
        h64 = h.to(tl.int64)
        bh = b * n_heads_q + h
        Qh = seq_base(Q, b, h, q_start, stride_qb, stride_qh, stride_qm, IS_VARLEN=IS_VARLEN)
        DOh = seq_base(DO, b, h, q_start, stride_dob, stride_doh, stride_dom, IS_VARLEN=IS_VARLEN)
        DQh = seq_base(DQacc, b, h, q_start, stride_dqb, stride_dqh, stride_dqm, IS_VARLEN=IS_VARLEN)
        LSEh = _row_stats(LSE, bh, h, q_start, seqlen_q, total_q, IS_VARLEN=IS_VARLEN)
        Deltah = _row_stats(Delta, bh, h, q_start, seqlen_q, total_q, IS_VARLEN=IS_VARLEN)
        Biash = Bias + b64 * stride_bias_b + h64 * stride_bias_h
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Alibi + b64 * stride_alibi_b + h64 * stride_alibi_h)
        if IS_BLOCK_SPARSE:
            # FA1 Alg. 5: only the q blocks listed for this kv block are visited
            c = (start_n // mask_block_n).to(tl.int64)
            count = tl.load(BlockCount + b64 * stride_cnt_b + h64 * stride_cnt_h + c * stride_cnt_r)
            row = BlockIdx + b64 * stride_idx_b + h64 * stride_idx_h + c * stride_idx_r
            for idx in range(0, count):
                r = tl.load(row + idx)
                blk_lo = tl.maximum(r * mask_block_m, lo)
                blk_hi = tl.minimum((r + 1) * mask_block_m, end)
                dk, dv = _dkdv_inner(
                    dk, dv, k, v, Qh, DOh, LSEh, Deltah, DQh, Biash,
                    stride_qm, stride_dom, stride_dqm, stride_bias_m, stride_bias_n,
                    offs_n, offs_d, blk_lo, blk_hi, full_lo, full_hi, bh, slope,
                    len_q, len_k, softmax_scale, scale_log2, softcap, window_left, window_right,
                    dropout_p, dropout_scale, philox_seed, philox_offset, seqlen_q, seqlen_k,
                    HEAD_DIM, BLOCK_D, BLOCK_M, EVEN_M, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                    HAS_BIAS, HAS_DROPOUT, ATOMIC_DQ, True, DOT_PRECISION, UPCAST_DOT, WIDE,
                )
        else:
            # one sweep over the q blocks that see this kv tile; blocks outside the fully-allowed
            # band [full_lo, full_hi) take the elementwise mask (a scalar branch per block)
            dk, dv = _dkdv_inner(
                dk, dv, k, v, Qh, DOh, LSEh, Deltah, DQh, Biash,
                stride_qm, stride_dom, stride_dqm, stride_bias_m, stride_bias_n,
                offs_n, offs_d, lo, end, full_lo, full_hi, bh, slope,
                len_q, len_k, softmax_scale, scale_log2, softcap, window_left, window_right,
                dropout_p, dropout_scale, philox_seed, philox_offset, seqlen_q, seqlen_k,
                HEAD_DIM, BLOCK_D, BLOCK_M, EVEN_M, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                HAS_BIAS, HAS_DROPOUT, ATOMIC_DQ, HAS_LEFT or HAS_RIGHT or not (EVEN_M and EVEN_N),
                DOT_PRECISION, UPCAST_DOT, WIDE,
            )

    dk = dk * softmax_scale
    DKh = seq_base(DK, b, hk, k_start, stride_dkb, stride_dkh, stride_dkn, IS_VARLEN=IS_VARLEN)
    DVh = seq_base(DV, b, hk, k_start, stride_dvb, stride_dvh, stride_dvn, IS_VARLEN=IS_VARLEN)
    _store_rows(DKh, dk, offs_n, stride_dkn, len_k, offs_d, HEAD_DIM, BLOCK_D, WIDE)
    _store_rows(DVh, dv, offs_n, stride_dvn, len_k, offs_d, HEAD_DIM, BLOCK_D, WIDE)


@triton.jit
def _dq_inner(
    dq, q, do, lse2, delta, Kh, Vh, Biash,
    stride_kn, stride_vn, stride_bias_m, stride_bias_n,
    offs_m, offs_d, lo, hi, clear_lo, clear_hi, bh, slope,
    seqlen_q, seqlen_k, softmax_scale, scale_log2, softcap, window_left, window_right,
    dropout_p, dropout_scale, philox_seed, philox_offset, drop_nq, drop_nk,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, WIDE: tl.constexpr,
):
    """dQ_i += dS_ij K_j (unscaled) over kv blocks [lo, hi): the q-outer
    ordering of Alg. 2 line 15, so each dQ_i has a single writer.  K_j^T and
    V_j^T are loaded transposed, so S = Q_i K_j^T, dP = dO_i V_j^T and
    dQ_i += dS (K_j^T)^T move no register tile through shared memory.  With
    MASK, blocks starting outside [clear_lo, clear_hi) are masked (the band never
    holds the tile crossing a ragged end of K)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # the tile crossing a ragged end of K reads its last key again in place of the missing rows (outside
        # the band, so their scores are masked and they add exactly 0): no K / V load needs a row mask
        rows_n = _in_range(offs_n, seqlen_k, EVEN_N or not MASK)
        kT = _load_tile(Kh, rows_n, stride_kn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, True, True, WIDE)
        vT = _load_tile(Vh, rows_n, stride_vn, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, True, True, WIDE)
        p, t = _probs(
            mma(q, kT, None, DOT_PRECISION, UPCAST_DOT), offs_m, offs_n, lse2, Biash, stride_bias_m, stride_bias_n, slope,
            seqlen_q, seqlen_k, softmax_scale, scale_log2, softcap, window_left, window_right,
            (start_n < clear_lo) | (start_n >= clear_hi), HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, MASK, False,
            WIDE,
        )
        dp = mma(do, vT, None, DOT_PRECISION, UPCAST_DOT)
        if HAS_DROPOUT:
            keep = dropout_keep(philox_seed, philox_offset, bh, offs_m, offs_n, drop_nq, drop_nk, dropout_p)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = _grad_scores(p, dp, t, delta[:, None], HAS_SOFTCAP)
        dq += mma(ds.to(kT.dtype), tl.trans(kT), None, DOT_PRECISION, UPCAST_DOT)
    return dq


@triton.jit(do_not_specialize=["total_q", "total_k"])  # packed totals change every batch: no recompiles
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, Delta, DQ, Alibi, Bias, BlockCount, BlockIdx, Rng, CuSeqQ, CuSeqK,
    softmax_scale, softcap, dropout_p, dropout_scale,
    # ints and constexprs: fixed for a problem signature (runtime/launch.py binds them once)
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_alibi_b, stride_alibi_h,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
    stride_cnt_b, stride_cnt_h, stride_cnt_r,
    stride_idx_b, stride_idx_h, stride_idx_r,
    n_heads_q, n_heads_k, n_bh, seqlen_q, seqlen_k, total_q, total_k, mask_block_m, mask_block_n,
    window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, IS_BLOCK_SPARSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, USE_PDL: tl.constexpr, WIDE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """dQ of one q tile of one q head, accumulated in registers (deterministic).
    Grid: fold_grid(q tiles, B * Hq).  IS_VARLEN: packed rows, as in the forward kernel."""
    check_tiles(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HEAD_DIM=HEAD_DIM)
    pid_m, bh = unfold_pid()
    if bh >= n_bh:
        return
    b = bh // n_heads_q
    h = bh % n_heads_q
    q_start, len_q, k_start, len_k = seqlen_info(
        CuSeqQ, CuSeqK, b, seqlen_q, seqlen_k, total_q, total_k, IS_VARLEN=IS_VARLEN
    )
    start_m = pid_m * BLOCK_M
    if IS_VARLEN:
        if start_m >= len_q:
            return
    hk = h // (n_heads_q // n_heads_k)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    scale_log2 = softmax_scale * _LOG2E

    Qh = seq_base(Q, b, h, q_start, stride_qb, stride_qh, stride_qm, IS_VARLEN=IS_VARLEN)
    DOh = seq_base(DO, b, h, q_start, stride_dob, stride_doh, stride_dom, IS_VARLEN=IS_VARLEN)
    q = _load_tile(Qh, offs_m, stride_qm, len_q, offs_d, HEAD_DIM, BLOCK_D, EVEN_M, False, WIDE)
    do = _load_tile(DOh, offs_m, stride_dom, len_q, offs_d, HEAD_DIM, BLOCK_D, EVEN_M, False, WIDE)
    philox_seed, philox_offset = philox_state(Rng, HAS_DROPOUT)
    lse2 = _load_lse2(_row_stats(LSE, bh, h, q_start, seqlen_q, total_q, IS_VARLEN=IS_VARLEN), offs_m, len_q, EVEN_M)
    if USE_PDL:  # started during the dK/dV kernel: wait for it (and so for D) to finish
        gdc_wait()
    delta = _load_vec(_row_stats(Delta, bh, h, q_start, seqlen_q, total_q, IS_VARLEN=IS_VARLEN), offs_m, len_q, EVEN_M)
    Kh = seq_base(K, b, hk, k_start, stride_kb, stride_kh, stride_kn, IS_VARLEN=IS_VARLEN)
    Vh = seq_base(V, b, hk, k_start, stride_vb, stride_vh, stride_vn, IS_VARLEN=IS_VARLEN)
    Biash = Bias + b64 * stride_bias_b + h64 * stride_bias_h
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + b64 * stride_alibi_b + h64 * stride_alibi_h)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    lo, full_lo, full_hi, end = kv_block_range(
        start_m, start_m + BLOCK_M, len_q, len_k, window_left, window_right, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )

    if IS_BLOCK_SPARSE:
        r = (start_m // mask_block_m).to(tl.int64)
        count = tl.load(BlockCount + b64 * stride_cnt_b + h64 * stride_cnt_h + r * stride_cnt_r)
        row = BlockIdx + b64 * stride_idx_b + h64 * stride_idx_h + r * stride_idx_r
        for idx in range(0, count):
            c = tl.load(row + idx)
            blk_lo = tl.maximum(c * mask_block_n, lo)
            blk_hi = tl.minimum((c + 1) * mask_block_n, end)
            dq = _dq_inner(
                dq, q, do, lse2, delta, Kh, Vh, Biash, stride_kn, stride_vn, stride_bias_m, stride_bias_n,
                offs_m, offs_d, blk_lo, blk_hi, full_lo, full_hi, bh, slope,
                len_q, len_k, softmax_scale, scale_log2, softcap, window_left, window_right,
                dropout_p, dropout_scale, philox_seed, philox_offset, seqlen_q, seqlen_k,
                HEAD_DIM, BLOCK_D, BLOCK_N, EVEN_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                HAS_BIAS, HAS_DROPOUT, True, DOT_PRECISION, UPCAST_DOT, WIDE,
            )
    else:
        dq = _dq_inner(
            dq, q, do, lse2, delta, Kh, Vh, Biash, stride_kn, stride_vn, stride_bias_m, stride_bias_n,
            offs_m, offs_d, lo, end, full_lo, full_hi, bh, slope,
            len_q, len_k, softmax_scale, scale_log2, softcap, window_left, window_right,
            dropout_p, dropout_scale, philox_seed, philox_offset, seqlen_q, seqlen_k,
            HEAD_DIM, BLOCK_D, BLOCK_N, EVEN_N, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
            HAS_BIAS, HAS_DROPOUT, HAS_LEFT or HAS_RIGHT or not (EVEN_M and EVEN_N), DOT_PRECISION, UPCAST_DOT, WIDE,
        )

    dq = dq * softmax_scale
    DQh = seq_base(DQ, b, h, q_start, stride_dqb, stride_dqh, stride_dqm, IS_VARLEN=IS_VARLEN)
    _store_rows(DQh, dq, offs_m, stride_dqm, len_q, offs_d, HEAD_DIM, BLOCK_D, WIDE)
