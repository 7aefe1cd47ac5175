"""Hopper (sm_90a) attention forward in Gluon: the FA3 schedules Triton 3.6's automatic warp specialisation
cannot express (FA3, Shah et al. 2024, §3.1 ping-pong, §3.2 intra-warpgroup overlap).

One program owns a query tile of ``NUM_WG * WG_M`` rows (NUM_WG = 2 or 3) of one (batch, head) pair and runs
``NUM_WG + 1`` partitions (``gl.warp_specialize``):

* a producer (1 warp) issuing the TMA loads: Q once, then K_j and V_j into a ``NUM_STAGES``-deep ring,
  each slot guarded by ``k_ready`` / ``v_ready`` (tx-count mbarriers) and ``kv_empty`` (both consumers
  release it after their P V GEMM);
* ``NUM_WG`` consumer warpgroups (the default partition and 4-warp workers), each owning ``WG_M`` = 64 rows of
  the tile, running the online softmax (base 2, ``scale * log2 e`` folded into the exp2 argument, the
  division deferred to the end, LSE in natural log; rows that see no key: output 0, LSE -inf).

Schedules, each a constexpr so an ablation can switch it off:

* ``INTRA`` (intra-warpgroup overlap): iteration j issues S_j = Q K_jᵀ and O += P_{j-1} V_{j-1} as async
  wgmma, waits for S_j only, runs the softmax of S_j while the P V GEMM runs, then waits for it and
  rescales O; off, both GEMMs are waited for before the softmax;
* ``PINGPONG``: the consumers take turns issuing their GEMMs, round robin (one count-1 mbarrier each,
  a consumer arrives on the next one's after issuing), so one warpgroup's softmax runs while another's
  GEMMs occupy the tensor cores.
* ``SKIP_MASK0``: tile 0 (the pipeline's prologue) runs unmasked when every row of the program sees it all.

Causal (bottom-right) and ragged Nk: the kv tiles every row of the program sees in full run an unmasked
loop, the tiles crossed by the diagonal or the end of K a masked one.  Ragged Nq / Nk and head dims that
are not a power of two: per-head device-side tensor descriptors with ``BLOCK_D``-wide boxes zero-fill loads
past the head's end and past d; the output goes out through masked stores (``O_STORE`` 0: from the wgmma
layout, 1: through a row-contiguous layout) or a TMA store staged in the warpgroup's Q rows (2).  The host launcher is
:mod:`flashtile.runtime.fa3_gluon`; descriptors need ``triton.set_allocator``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from flashtile.kernels._common import LN2

__all__ = ["fa3_gluon_kernel", "WG_M"]

WG_M = 64  # query rows per consumer warpgroup (wgmma M = 16 per warp x 4 warps)
_LN2 = gl.constexpr(LN2)


@gluon.jit
def _producer(Q, K, V, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
              stride_qm, stride_kn, stride_vn, seqlen_q, seqlen_k, start_m, n_tiles,
              HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, NUM_WG: gl.constexpr, BLOCK_N: gl.constexpr,
              NUM_STAGES: gl.constexpr):
    """TMA loads of Q (once, one 64-row box per consumer) and of K_j, V_j for j < ``n_tiles`` into ring slot
    j % NUM_STAGES.  Boxes are BLOCK_D wide: columns past HEAD_DIM read 0, as rows past Nq / Nk do."""
    dtype: gl.constexpr = Q.dtype.element_ty
    q_desc = tma.make_tensor_descriptor(Q, [seqlen_q, HEAD_DIM], [stride_qm, 1], [64, BLOCK_D],
                                        gl.NVMMASharedLayout.get_default_for([64, BLOCK_D], dtype))
    k_desc = tma.make_tensor_descriptor(K, [seqlen_k, HEAD_DIM], [stride_kn, 1], [BLOCK_N, BLOCK_D],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype))
    v_desc = tma.make_tensor_descriptor(V, [seqlen_k, HEAD_DIM], [stride_vn, 1], [BLOCK_N, BLOCK_D],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype))
    # a box's transaction bytes count its zero-filled part too
    q_bytes: gl.constexpr = NUM_WG * 64 * BLOCK_D * dtype.primitive_bitwidth // 8
    kv_bytes: gl.constexpr = BLOCK_N * BLOCK_D * dtype.primitive_bitwidth // 8
    has_work = n_tiles > 0  # consumers never wait for Q when there is no tile; no copy may outlive them
    mbarrier.expect(q_bar, q_bytes, pred=has_work)
    for w in gl.static_range(NUM_WG):
        # a box wholly past Nq (the last tile's upper warpgroups) re-reads the tile's first rows instead:
        # those rows' outputs are never stored, and no box lies wholly out of bounds
        q_row = start_m + w * 64
        q_row = gl.where(q_row < seqlen_q, q_row, start_m)
        tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem.index(w), pred=has_work)
    for j in range(n_tiles):
        slot = j % NUM_STAGES
        # parity of the previous round of this slot; the first round passes on fresh barriers
        mbarrier.wait(kv_empty.index(slot), ((j // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(slot), kv_bytes)
        tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.expect(v_ready.index(slot), kv_bytes)
        tma.async_copy_global_to_shared(v_desc, [j * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _turn_wait(turn_bars, turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait until it is this warpgroup's turn to issue GEMMs (its ``turn``-th turn).  Turns go
    round the consumers in order; warpgroup 0 goes first: its turn 0 waits for parity 1, which a fresh
    barrier reports complete, every other warpgroup's turn t for phase t of its barrier."""
    if PINGPONG:
        if WG == 0:
            mbarrier.wait(turn_bars.index(WG), (turn + 1) & 1)
        else:
            mbarrier.wait(turn_bars.index(WG), turn & 1)
    return turn + 1


@gluon.jit
def _turn_pass(turn_bars, WG: gl.constexpr, NUM_WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: GEMMs issued, the next warpgroup's turn."""
    if PINGPONG:
        mbarrier.arrive(turn_bars.index((WG + 1) % NUM_WG))


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, start_n, last_key, BLOCK_N: gl.constexpr, MASKED: gl.constexpr):
    """Online softmax of the raw scores ``s`` of kv tile ``start_n``: (p, m, l, alpha).  Unmasked scores
    stay unscaled: ``rowmax(s) * qk_scale`` is the scaled max because ``qk_scale > 0`` (host-checked)."""
    if MASKED:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        s = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(last_key, 1), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    if MASKED:
        # a row with no allowed key so far keeps m = -inf: subtract 0, never -inf - -inf
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _kv_iter(j, acc, p_prev, m_i, l_i, turn, q_wg, k_smem, v_smem, k_ready, v_ready, kv_empty, turn_bars,
             qk_scale, last_key, s_zero,
             BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, WG: gl.constexpr, NUM_WG: gl.constexpr,
             MASKED: gl.constexpr, INTRA: gl.constexpr, PINGPONG: gl.constexpr):
    """Tile j >= 1: S_j = Q K_jᵀ and O += P_{j-1} V_{j-1} issued together, the softmax of S_j beside the
    P V GEMM (``INTRA``) or after it, then O rescaled and slot j - 1 released."""
    slot = j % NUM_STAGES
    prev = (j - 1) % NUM_STAGES
    mbarrier.wait(k_ready.index(slot), (j // NUM_STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((j - 1) // NUM_STAGES) & 1)
    turn = _turn_wait(turn_bars, turn, WG, PINGPONG)
    s = warpgroup_mma(q_wg, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    acc = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
    _turn_pass(turn_bars, WG, NUM_WG, PINGPONG)
    if INTRA:
        s = warpgroup_mma_wait(1, deps=(s,))  # groups retire in order: S_j is done, P V may still run
    else:
        s, acc, p_prev = warpgroup_mma_wait(0, deps=(s, acc, p_prev))
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, j * BLOCK_N, last_key, BLOCK_N=BLOCK_N,
                                       MASKED=MASKED)
    # p_prev is read by the in-flight wgmma from registers: kept alive until this wait
    acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
    mbarrier.arrive(kv_empty.index(prev))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
    p_next = gl.convert_layout(p.to(p_prev.dtype), p_prev.type.layout)
    return acc, p_next, m_i, l_i, turn


@gluon.jit
def _prologue(q_wg, k_smem, k_ready, turn_bars, m_i, l_i, qk_scale, last_key, s_zero, full_tiles,
              BLOCK_N: gl.constexpr, WG: gl.constexpr, NUM_WG: gl.constexpr, PINGPONG: gl.constexpr,
              SKIP_MASK0: gl.constexpr):
    """S_0 and its softmax: masked unless ``SKIP_MASK0`` and every row sees all of tile 0."""
    mbarrier.wait(k_ready.index(0), 0)
    turn = _turn_wait(turn_bars, 0, WG, PINGPONG)
    s = warpgroup_mma(q_wg, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    _turn_pass(turn_bars, WG, NUM_WG, PINGPONG)
    s = warpgroup_mma_wait(0, deps=(s,))
    if SKIP_MASK0:
        if full_tiles > 0:
            p, m_i, l_i, _alpha = _softmax_step(s, m_i, l_i, qk_scale, 0, last_key, BLOCK_N=BLOCK_N, MASKED=False)
        else:
            p, m_i, l_i, _alpha = _softmax_step(s, m_i, l_i, qk_scale, 0, last_key, BLOCK_N=BLOCK_N, MASKED=True)
    else:
        p, m_i, l_i, _alpha = _softmax_step(s, m_i, l_i, qk_scale, 0, last_key, BLOCK_N=BLOCK_N, MASKED=True)
    return p, m_i, l_i, turn


@gluon.jit
def _consumer(Out, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars,
              qk_scale, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles,
              WG: gl.constexpr, NUM_WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr,
              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, INTRA: gl.constexpr,
              PINGPONG: gl.constexpr, SKIP_MASK0: gl.constexpr, O_STORE: gl.constexpr):
    """Rows [start_m + WG * 64, + 64) of the tile: the kv loop, then O / l and the LSE.  ``O_STORE``:
    0 masked stores from the wgmma layout, 1 the same through a row-contiguous (16-byte) layout, 2 a TMA
    store staged in this warpgroup's Q rows."""
    gl.static_assert(gl.num_warps() == 4)
    M: gl.constexpr = 64
    dtype: gl.constexpr = Out.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    row0 = start_m + WG * M
    rows = row0 + gl.arange(0, M, layout=row_s)
    # key j is allowed for row i iff j <= last_key[i]: j < Nk, and j <= i + Nk - Nq when causal (bottom-right)
    last_key = gl.full([M], seqlen_k - 1, gl.int32, layout=row_s)
    if CAUSAL:
        last_key = gl.minimum(last_key, rows + (seqlen_k - seqlen_q))
    m_i = gl.full([M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([M], gl.float32, layout=row_s)
    acc = gl.zeros([M, BLOCK_D], gl.float32, layout=o_layout)
    if n_tiles > 0:
        s_zero = gl.zeros([M, BLOCK_N], gl.float32, layout=s_layout)
        q_wg = q_smem.index(WG)
        mbarrier.wait(q_bar, 0)
        p, m_i, l_i, turn = _prologue(q_wg, k_smem, k_ready, turn_bars, m_i, l_i, qk_scale, last_key, s_zero,
                                      full_tiles, BLOCK_N=BLOCK_N, WG=WG, NUM_WG=NUM_WG, PINGPONG=PINGPONG,
                                      SKIP_MASK0=SKIP_MASK0)
        p_prev = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, full_tiles):
            acc, p_prev, m_i, l_i, turn = _kv_iter(
                j, acc, p_prev, m_i, l_i, turn, q_wg, k_smem, v_smem, k_ready, v_ready, kv_empty, turn_bars,
                qk_scale, last_key, s_zero, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, WG=WG, NUM_WG=NUM_WG,
                MASKED=False, INTRA=INTRA, PINGPONG=PINGPONG)
        for j in range(gl.maximum(full_tiles, 1), n_tiles):
            acc, p_prev, m_i, l_i, turn = _kv_iter(
                j, acc, p_prev, m_i, l_i, turn, q_wg, k_smem, v_smem, k_ready, v_ready, kv_empty, turn_bars,
                qk_scale, last_key, s_zero, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, WG=WG, NUM_WG=NUM_WG,
                MASKED=True, INTRA=INTRA, PINGPONG=PINGPONG)
        # epilogue: O += P_{n-1} V_{n-1}
        last = n_tiles - 1
        mbarrier.wait(v_ready.index(last % NUM_STAGES), (last // NUM_STAGES) & 1)
        turn = _turn_wait(turn_bars, turn, WG, PINGPONG)
        acc = warpgroup_mma(p_prev, v_smem.index(last % NUM_STAGES), acc, is_async=True)
        _turn_pass(turn_bars, WG, NUM_WG, PINGPONG)
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
        mbarrier.arrive(kv_empty.index(last % NUM_STAGES))

    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * _LN2)
    gl.store(LSE + lse_row0 + rows, lse, mask=rows < seqlen_q)
    out = (acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, row_o), 1)).to(dtype)
    if O_STORE == 2:
        # staged in this warpgroup's Q rows (its last S GEMM has retired); the descriptor drops rows past
        # Nq and columns past HEAD_DIM
        o_desc = tma.make_tensor_descriptor(Out, [seqlen_q, HEAD_DIM], [stride_om, 1], [M, BLOCK_D],
                                            gl.NVMMASharedLayout.get_default_for([M, BLOCK_D], dtype))
        if row0 < seqlen_q:  # no box wholly out of bounds (the last tile's upper warpgroups)
            o_stage = q_smem.index(WG)
            o_stage.store(out)
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [row0, 0], o_stage)
            tma.store_wait(0)
    else:
        if O_STORE == 1:
            # 16 bytes per thread, a row's threads adjacent: full 128-byte lines per warp store
            TPW_D: gl.constexpr = BLOCK_D // 8
            st_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // TPW_D, TPW_D],
                                                       warps_per_cta=[4, 1], order=[1, 0])
        else:
            st_layout: gl.constexpr = o_layout
        out = gl.convert_layout(out, st_layout)
        rows_o = row0 + gl.arange(0, M, layout=gl.SliceLayout(1, st_layout))
        cols_o = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, st_layout))
        o_ptrs = Out + gl.expand_dims(rows_o.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols_o, 0)
        o_mask = gl.expand_dims(rows_o < seqlen_q, 1)
        if BLOCK_D != HEAD_DIM:
            o_mask = o_mask & gl.expand_dims(cols_o < HEAD_DIM, 0)
        gl.store(o_ptrs, out, mask=o_mask)


@gluon.jit(do_not_specialize=["n_heads", "kv_group", "seqlen_q", "seqlen_k", "num_m_tiles"])
def fa3_gluon_kernel(
    Q, K, V, Out, LSE,
    qk_scale,  # softmax_scale * log2(e), > 0
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    n_heads, kv_group, seqlen_q, seqlen_k, num_m_tiles,
    HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, NUM_WG: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, INTRA: gl.constexpr, PINGPONG: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, SKIP_MASK0: gl.constexpr, O_STORE: gl.constexpr,
    LPT_GROUP: gl.constexpr,
):
    """1-D grid of B * Hq * cdiv(Nq, 64 * NUM_WG) programs, the query tiles of one head adjacent (they share
    its K and V in L2); causal runs each head's tiles last-first, the longest rows first, or with
    ``LPT_GROUP`` > 0 the longest tiles of each group of that many heads first.  Launch with
    ``num_warps=4`` (the default partition is consumer 0).  ``HEAD_DIM`` is d, ``BLOCK_D`` the power of
    two >= max(d, 16) every tile is wide (the columns past d are zero in Q, K, V and never stored)."""
    BLOCK_M: gl.constexpr = NUM_WG * 64
    gl.static_assert(HEAD_DIM % 8 == 0)  # TMA: 16-byte row strides and box width
    gl.static_assert(BLOCK_D >= HEAD_DIM)
    gl.static_assert(BLOCK_D >= 16)
    gl.static_assert(BLOCK_N % 16 == 0)
    gl.static_assert(NUM_WG == 2 or NUM_WG == 3)
    # a consumer frees slot j - 1 only after waiting for K_j: one slot would deadlock
    gl.static_assert(NUM_STAGES >= 2)
    dtype: gl.constexpr = Q.dtype.element_ty
    pid = gl.program_id(0)
    bh = pid // num_m_tiles
    tile = pid % num_m_tiles
    if CAUSAL:
        if LPT_GROUP > 0:
            # groups of LPT_GROUP heads; inside a group the longest tiles of all its heads first, so the
            # CTAs in flight share a few heads' K and V in L2 and the short tiles fill the tail
            per_group = LPT_GROUP * num_m_tiles
            group = pid // per_group
            r = pid % per_group
            heads = gl.minimum(LPT_GROUP, gl.num_programs(0) // num_m_tiles - group * LPT_GROUP)
            bh = group * LPT_GROUP + r % heads
            tile = num_m_tiles - 1 - r // heads
        else:
            tile = num_m_tiles - 1 - tile
    off_b = (bh // n_heads).to(gl.int64)
    off_h = (bh % n_heads).to(gl.int64)
    off_hk = off_h // kv_group
    start_m = tile * BLOCK_M

    # kv tiles: [0, full_tiles) seen in full by every row of the program, [full_tiles, n_tiles) masked
    if CAUSAL:
        key_end = gl.minimum(seqlen_k, start_m + BLOCK_M + seqlen_k - seqlen_q)  # last row's key bound
        full_end = gl.minimum(seqlen_k, start_m + 1 + seqlen_k - seqlen_q)  # first row's key bound
    else:
        key_end = seqlen_k
        full_end = seqlen_k
    n_tiles = gl.cdiv(gl.maximum(key_end, 0), BLOCK_N)
    full_tiles = gl.maximum(full_end, 0) // BLOCK_N

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_WG, 64, BLOCK_D], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=NUM_WG)  # one arrival per consumer warpgroup
    for i in gl.static_range(NUM_WG):
        mbarrier.init(turn_bars.index(i), count=1)

    q_base = Q + off_b * stride_qb + off_h * stride_qh
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    o_base = Out + off_b * stride_ob + off_h * stride_oh
    lse_row0 = bh.to(gl.int64) * seqlen_q
    # constexprs keep their kind only in tuples written in the call (a tuple bound to a name makes them values)
    if NUM_WG == 2:
        gl.warp_specialize([
            (_consumer_wg0, (o_base, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars, qk_scale, stride_om,
             lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles, NUM_WG, HEAD_DIM, BLOCK_D, BLOCK_N,
             NUM_STAGES, CAUSAL, INTRA, PINGPONG, SKIP_MASK0, O_STORE)),
            (_consumer_wg1, (o_base, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars, qk_scale, stride_om,
             lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles, NUM_WG, HEAD_DIM, BLOCK_D, BLOCK_N,
             NUM_STAGES, CAUSAL, INTRA, PINGPONG, SKIP_MASK0, O_STORE)),
            (_producer, (q_base, k_base, v_base, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, stride_qm,
             stride_kn, stride_vn, seqlen_q, seqlen_k, start_m, n_tiles, HEAD_DIM, BLOCK_D, NUM_WG, BLOCK_N,
             NUM_STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer_wg0, (o_base, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars, qk_scale, stride_om,
             lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles, NUM_WG, HEAD_DIM, BLOCK_D, BLOCK_N,
             NUM_STAGES, CAUSAL, INTRA, PINGPONG, SKIP_MASK0, O_STORE)),
            (_consumer_wg1, (o_base, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars, qk_scale, stride_om,
             lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles, NUM_WG, HEAD_DIM, BLOCK_D, BLOCK_N,
             NUM_STAGES, CAUSAL, INTRA, PINGPONG, SKIP_MASK0, O_STORE)),
            (_consumer_wg2, (o_base, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars, qk_scale, stride_om,
             lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles, NUM_WG, HEAD_DIM, BLOCK_D, BLOCK_N,
             NUM_STAGES, CAUSAL, INTRA, PINGPONG, SKIP_MASK0, O_STORE)),
            (_producer, (q_base, k_base, v_base, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, stride_qm,
             stride_kn, stride_vn, seqlen_q, seqlen_k, start_m, n_tiles, HEAD_DIM, BLOCK_D, NUM_WG, BLOCK_N,
             NUM_STAGES)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _consumer_wg0(Out, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars,
                  qk_scale, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles,
                  NUM_WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_N: gl.constexpr,
                  NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, INTRA: gl.constexpr, PINGPONG: gl.constexpr,
                  SKIP_MASK0: gl.constexpr, O_STORE: gl.constexpr):
    _consumer(Out, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars,
              qk_scale, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles,
              WG=0, NUM_WG=NUM_WG, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES,
              CAUSAL=CAUSAL, INTRA=INTRA, PINGPONG=PINGPONG, SKIP_MASK0=SKIP_MASK0, O_STORE=O_STORE)


@gluon.jit
def _consumer_wg1(Out, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars,
                  qk_scale, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles,
                  NUM_WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_N: gl.constexpr,
                  NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, INTRA: gl.constexpr, PINGPONG: gl.constexpr,
                  SKIP_MASK0: gl.constexpr, O_STORE: gl.constexpr):
    _consumer(Out, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars,
              qk_scale, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles,
              WG=1, NUM_WG=NUM_WG, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES,
              CAUSAL=CAUSAL, INTRA=INTRA, PINGPONG=PINGPONG, SKIP_MASK0=SKIP_MASK0, O_STORE=O_STORE)


@gluon.jit
def _consumer_wg2(Out, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars,
                  qk_scale, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles,
                  NUM_WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_N: gl.constexpr,
                  NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, INTRA: gl.constexpr, PINGPONG: gl.constexpr,
                  SKIP_MASK0: gl.constexpr, O_STORE: gl.constexpr):
    _consumer(Out, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars,
              qk_scale, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles,
              WG=2, NUM_WG=NUM_WG, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES,
              CAUSAL=CAUSAL, INTRA=INTRA, PINGPONG=PINGPONG, SKIP_MASK0=SKIP_MASK0, O_STORE=O_STORE)
