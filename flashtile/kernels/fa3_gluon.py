"""Hopper (sm_90a) attention forward in Gluon: the FA3 schedules Triton 3.6's automatic warp specialisation
cannot express (FA3, Shah et al. 2024, §3.1 ping-pong, §3.2 intra-warpgroup overlap).

One program owns a query tile of ``2 * WG_M`` rows of one (batch, head) pair and runs three partitions
(``gl.warp_specialize``):

* a producer (1 warp) issuing the TMA loads: Q once, then K_j and V_j into a ``NUM_STAGES``-deep ring,
  each slot guarded by ``k_ready`` / ``v_ready`` (tx-count mbarriers) and ``kv_empty`` (both consumers
  release it after their P V GEMM);
* two consumer warpgroups (the default partition and a 4-warp worker), each owning ``WG_M`` = 64 rows of
  the tile, running the online softmax (base 2, ``scale * log2 e`` folded into the exp2 argument, the
  division deferred to the end, LSE in natural log; rows that see no key: output 0, LSE -inf).

Schedules, each a constexpr so an ablation can switch it off:

* ``INTRA`` (intra-warpgroup overlap): iteration j issues S_j = Q K_jᵀ and O += P_{j-1} V_{j-1} as async
  wgmma, waits for S_j only, runs the softmax of S_j while the P V GEMM runs, then waits for it and
  rescales O; off, both GEMMs are waited for before the softmax;
* ``PINGPONG``: the two consumers take turns issuing their GEMMs (a pair of count-1 mbarriers, each
  consumer arrives on the other's after issuing), so one warpgroup's softmax runs while the other's GEMMs
  occupy the tensor cores.

Causal (bottom-right) and ragged Nk: the kv tiles every row of the program sees in full run an unmasked
loop, the tiles crossed by the diagonal or the end of K a masked one (tile 0 is always the masked
prologue of the pipeline).  Ragged Nq / Nk: per-head device-side tensor descriptors zero-fill loads past
the head's end; the output goes out through masked stores, or (``O_TMA``) a TMA store staged in the
warpgroup's Q rows.  The host launcher is
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
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """TMA loads of Q (once) and of K_j, V_j for j < ``n_tiles`` into ring slot j % NUM_STAGES."""
    dtype: gl.constexpr = Q.dtype.element_ty
    # per-head descriptors: loads past Nq / Nk of this head read 0
    q_desc = tma.make_tensor_descriptor(Q, [seqlen_q, HEAD_DIM], [stride_qm, 1], [BLOCK_M, HEAD_DIM],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype))
    k_desc = tma.make_tensor_descriptor(K, [seqlen_k, HEAD_DIM], [stride_kn, 1], [BLOCK_N, HEAD_DIM],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype))
    v_desc = tma.make_tensor_descriptor(V, [seqlen_k, HEAD_DIM], [stride_vn, 1], [BLOCK_N, HEAD_DIM],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype))
    q_bytes: gl.constexpr = BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8
    kv_bytes: gl.constexpr = BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
    has_work = n_tiles > 0  # consumers never wait for Q when there is no tile; no copy may outlive them
    mbarrier.expect(q_bar, q_bytes, pred=has_work)
    tma.async_copy_global_to_shared(q_desc, [start_m, 0], q_bar, q_smem, pred=has_work)
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
    """Ping-pong: wait until it is this warpgroup's turn to issue GEMMs (its ``turn``-th turn).
    Warpgroup 0 goes first: its turn 0 waits for parity 1, which a fresh barrier reports complete."""
    if PINGPONG:
        mbarrier.wait(turn_bars.index(WG), (turn + 1 + WG) & 1)
    return turn + 1


@gluon.jit
def _turn_pass(turn_bars, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: GEMMs issued, the other warpgroup's turn."""
    if PINGPONG:
        mbarrier.arrive(turn_bars.index(1 - WG))


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
             BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, WG: gl.constexpr, MASKED: gl.constexpr,
             INTRA: gl.constexpr, PINGPONG: gl.constexpr):
    """Tile j >= 1: S_j = Q K_jᵀ and O += P_{j-1} V_{j-1} issued together, the softmax of S_j beside the
    P V GEMM (``INTRA``) or after it, then O rescaled and slot j - 1 released."""
    slot = j % NUM_STAGES
    prev = (j - 1) % NUM_STAGES
    mbarrier.wait(k_ready.index(slot), (j // NUM_STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((j - 1) // NUM_STAGES) & 1)
    turn = _turn_wait(turn_bars, turn, WG, PINGPONG)
    s = warpgroup_mma(q_wg, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    acc = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
    _turn_pass(turn_bars, WG, PINGPONG)
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
def _consumer(Out, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars,
              qk_scale, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles,
              WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, INTRA: gl.constexpr, PINGPONG: gl.constexpr, O_TMA: gl.constexpr):
    """Rows [start_m + WG * WG_M, + WG_M) of the tile: the kv loop, then O / l and the LSE."""
    gl.static_assert(gl.num_warps() == 4)
    M: gl.constexpr = 64
    dtype: gl.constexpr = Out.dtype.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
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
    acc = gl.zeros([M, HEAD_DIM], gl.float32, layout=o_layout)
    if n_tiles > 0:
        s_zero = gl.zeros([M, BLOCK_N], gl.float32, layout=s_layout)
        q_wg = q_smem.slice(WG * M, M)
        mbarrier.wait(q_bar, 0)
        # prologue: S_0 and its softmax (masked: tile 0 may be the diagonal one)
        mbarrier.wait(k_ready.index(0), 0)
        turn = _turn_wait(turn_bars, 0, WG, PINGPONG)
        s = warpgroup_mma(q_wg, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        _turn_pass(turn_bars, WG, PINGPONG)
        s = warpgroup_mma_wait(0, deps=(s,))
        p, m_i, l_i, _alpha = _softmax_step(s, m_i, l_i, qk_scale, 0, last_key, BLOCK_N=BLOCK_N, MASKED=True)
        p_prev = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, full_tiles):
            acc, p_prev, m_i, l_i, turn = _kv_iter(
                j, acc, p_prev, m_i, l_i, turn, q_wg, k_smem, v_smem, k_ready, v_ready, kv_empty, turn_bars,
                qk_scale, last_key, s_zero, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, WG=WG, MASKED=False,
                INTRA=INTRA, PINGPONG=PINGPONG)
        for j in range(gl.maximum(full_tiles, 1), n_tiles):
            acc, p_prev, m_i, l_i, turn = _kv_iter(
                j, acc, p_prev, m_i, l_i, turn, q_wg, k_smem, v_smem, k_ready, v_ready, kv_empty, turn_bars,
                qk_scale, last_key, s_zero, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, WG=WG, MASKED=True,
                INTRA=INTRA, PINGPONG=PINGPONG)
        # epilogue: O += P_{n-1} V_{n-1}
        last = n_tiles - 1
        mbarrier.wait(v_ready.index(last % NUM_STAGES), (last // NUM_STAGES) & 1)
        turn = _turn_wait(turn_bars, turn, WG, PINGPONG)
        acc = warpgroup_mma(p_prev, v_smem.index(last % NUM_STAGES), acc, is_async=True)
        _turn_pass(turn_bars, WG, PINGPONG)
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
        mbarrier.arrive(kv_empty.index(last % NUM_STAGES))

    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * _LN2)
    gl.store(LSE + lse_row0 + rows, lse, mask=rows < seqlen_q)
    out = acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, row_o), 1)
    if O_TMA:
        # staged in this warpgroup's Q rows (its last S GEMM has retired); the descriptor drops rows past Nq
        o_desc = tma.make_tensor_descriptor(Out, [seqlen_q, HEAD_DIM], [stride_om, 1], [M, HEAD_DIM],
                                            gl.NVMMASharedLayout.get_default_for([M, HEAD_DIM], dtype))
        o_stage = q_smem.slice(WG * M, M)
        o_stage.store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [row0, 0], o_stage)
        tma.store_wait(0)
    else:
        rows_o = row0 + gl.arange(0, M, layout=row_o)
        cols_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = Out + gl.expand_dims(rows_o.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols_o, 0)
        gl.store(o_ptrs, out.to(dtype), mask=gl.expand_dims(rows_o < seqlen_q, 1))


@gluon.jit(do_not_specialize=["n_heads", "kv_group", "seqlen_q", "seqlen_k", "num_m_tiles"])
def fa3_gluon_kernel(
    Q, K, V, Out, LSE,
    qk_scale,  # softmax_scale * log2(e), > 0
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    n_heads, kv_group, seqlen_q, seqlen_k, num_m_tiles,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    INTRA: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    O_TMA: gl.constexpr,
):
    """1-D grid of B * Hq * cdiv(Nq, 128) programs, the query tiles of one head adjacent (they share its
    K and V in L2); causal runs each head's tiles last-first, the longest rows first.  Launch with
    ``num_warps=4`` (the default partition is consumer 0)."""
    BLOCK_M: gl.constexpr = 2 * 64
    gl.static_assert(HEAD_DIM % 16 == 0)
    gl.static_assert(BLOCK_N % 16 == 0)
    # a consumer frees slot j - 1 only after waiting for K_j: one slot would deadlock
    gl.static_assert(NUM_STAGES >= 2)
    dtype: gl.constexpr = Q.dtype.element_ty
    pid = gl.program_id(0)
    bh = pid // num_m_tiles
    tile = pid % num_m_tiles
    if CAUSAL:
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

    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(2):
        mbarrier.init(turn_bars.index(i), count=1)

    q_base = Q + off_b * stride_qb + off_h * stride_qh
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    o_base = Out + off_b * stride_ob + off_h * stride_oh
    lse_row0 = bh.to(gl.int64) * seqlen_q
    gl.warp_specialize(
        [
            (_consumer_wg0, (o_base, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars,
                             qk_scale, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles,
                             HEAD_DIM, BLOCK_N, NUM_STAGES, CAUSAL, INTRA, PINGPONG, O_TMA)),
            (_consumer_wg1, (o_base, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars,
                             qk_scale, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles,
                             HEAD_DIM, BLOCK_N, NUM_STAGES, CAUSAL, INTRA, PINGPONG, O_TMA)),
            (_producer, (q_base, k_base, v_base, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                         stride_qm, stride_kn, stride_vn, seqlen_q, seqlen_k, start_m, n_tiles,
                         HEAD_DIM, gl.constexpr(BLOCK_M), BLOCK_N, NUM_STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


@gluon.jit
def _consumer_wg0(Out, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars,
                  qk_scale, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles,
                  HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, INTRA: gl.constexpr, PINGPONG: gl.constexpr, O_TMA: gl.constexpr):
    _consumer(Out, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars,
              qk_scale, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles,
              WG=0, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, CAUSAL=CAUSAL, INTRA=INTRA,
              PINGPONG=PINGPONG, O_TMA=O_TMA)


@gluon.jit
def _consumer_wg1(Out, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars,
                  qk_scale, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles,
                  HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, INTRA: gl.constexpr, PINGPONG: gl.constexpr, O_TMA: gl.constexpr):
    _consumer(Out, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn_bars,
              qk_scale, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles,
              WG=1, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, CAUSAL=CAUSAL, INTRA=INTRA,
              PINGPONG=PINGPONG, O_TMA=O_TMA)
