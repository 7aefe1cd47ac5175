"""Hopper (sm_90a) attention backward in Gluon for head dims above 128 (tiles 192 or 256 wide): the schedule of
:mod:`flashtile.kernels.fa3_gluon_bwd` (FA3's Algorithm 3, kv tiles outer, q tiles inner, dQ by fp32 reductions; the
math is FA2's Algorithm 2, float64 twin :func:`flashtile.reference.backward.flash_attn_backward`) with the two
consumer warpgroups splitting the head dim instead of the keys.

At d = 256 a warpgroup's dK and dV for 64 keys are 2 x 64 x 256 fp32, twice the registers it has, so one program
owns a kv tile of ``BLOCK_N = 64`` keys; warpgroup 0 owns columns [0, 128) of that tile's dK and dV (64 + 64
registers per thread, the narrow kernel's count at d = 128), warpgroup 1 columns [128, TILE_D), TILE_D = 192 up to d
= 192 and 256 above. Shared tiles have power-of-two shapes, so every operand tile is two column parts, a [64, 128]
``*_lo`` and a [64, TILE_D - 128] ``*_hi`` one. Each step (a q tile of 64 rows), both warpgroups compute the whole
Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (64 x 64, reduced over all of d) and so hold identical Pᵀ and dSᵀ: no exchange between
them, at the price of the two score GEMMs done twice (7 GEMM passes over the tile instead of 5). Then, in its
columns: dV += Pᵀ dO, dK += dSᵀ Q, and dQ_i's part = dS K added into the fp32 accumulator (``DQ_TMA``, the table's:
32 columns at a time through TMA reduce-adds; without it 64 at a time by ``red.global.add.v2.f32``). Partitions
(``gl.warp_specialize``): a producer warp (TMA: K, V once, then Q_i, dO_i and the q tile's log2-scaled LSE and D
rows from ``stats_preprocess_kernel``'s buffer into a ``NUM_STAGES``-deep ring) and the two consumer warpgroups;
``PINGPONG`` as in the narrow kernel. Pᵀ and dSᵀ reach the GEMMs that read them from shared memory through one tile
each per warpgroup. ``SPLIT_S`` (FA3's split): warpgroup w computes Sᵀ, dPᵀ only for q columns [32 w, 32 w + 32) and
writes its Pᵀ, dSᵀ columns into shared [64, 64] tiles (two buffers, ``ds_full`` / ``ds_empty`` between the
warpgroups) that both then read whole: 5 GEMM passes, one exchange per step. ``DQ_TMA``: dQ's parts go through a
[64, 32] fp32 shared tile per warpgroup and TMA bulk reduce-adds (FA3's way) instead of vector reductions from
registers; without ``SPLIT_S`` Pᵀ is then the dV GEMM's register operand, its shared tiles' 16 KB holding the
staging tiles; with it the staging tiles take their own 16 KB, beside two Pᵀ / dSᵀ buffers at TILE_D = 192 and one
at 256 (all that fits), or two there with ``DO_STAGES`` = 1 (dO in a one-slot ring of its own, released after the
dV GEMM).

Shared memory at TILE_D = 256, bf16: K, V 64 KB, 2 stages of Q and dO 128 KB, Pᵀ and dSᵀ 32 KB, statistics 1 KB: 225
KB of the 227 (177 KB at TILE_D = 192; 194 KB there with ``SPLIT_S`` and ``DQ_TMA``; with one dO buffer 210 KB at
256 with ``SPLIT_S``, ``DQ_TMA`` and two Pᵀ / dSᵀ buffers). TMA zero-fills columns past
d; stores are masked. The dQ accumulator's rows are ``BLOCK_D`` = 256 wide either way. The host launcher is
:mod:`flashtile.runtime.fa3_gluon_bwd`; descriptors need ``triton.set_allocator``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait

from flashtile.kernels.fa3_gluon_bwd import _dq_tma_add, _dq_tma_add3, _kv_tile_of, _load_rows, _program_bases
from flashtile.kernels.fa3_gluon_bwd import _program_rows, _q_tiles, _red_add, _turn_pass, _turn_wait

__all__ = ["fa3_gluon_bwd_wide_kernel", "WIDE_BLOCK_N"]

WIDE_BLOCK_N = 64  # keys per program (both consumer warpgroups' wgmma M)


@gluon.jit
def _desc_pair(T, rows, stride, lo_smem, hi_smem, HEAD_DIM: gl.constexpr, TILE_D: gl.constexpr):
    """Descriptors of a (rows, HEAD_DIM) operand for its [64, 128] low and [64, TILE_D - 128] high column parts
    (the layouts of ``lo_smem`` / ``hi_smem``; one descriptor when both boxes are 128 wide)."""
    lo = tma.make_tensor_descriptor(T, [rows, HEAD_DIM], [stride, 1], [64, 128], lo_smem.layout)
    if TILE_D == 256:
        hi = lo
    else:
        hi = tma.make_tensor_descriptor(T, [rows, HEAD_DIM], [stride, 1], [64, TILE_D - 128], hi_smem.layout)
    return lo, hi


@gluon.jit
def _wide_producer(Q, K, V, DO, Stats, k_lo, k_hi, v_lo, v_hi, q_lo, q_hi, do_lo, do_hi, stats_smem, kv_bar,
                   q_ready, do_ready, qdo_empty, do_empty, stride_qm, stride_kn, stride_vn, stride_dom, seqlen_q,
                   seqlen_k, stats_rows, start_n, first_m, n_iters, descs, coords, HEAD_DIM: gl.constexpr,
                   TILE_D: gl.constexpr, NUM_STAGES: gl.constexpr, DO_STAGES: gl.constexpr,
                   HOST_DESC: gl.constexpr):
    """K_j, V_j once, then Q_i, dO_i and the q tile's [LSE · log2 e, D] rows for the ``n_iters`` q tiles from
    ``first_m`` into ring slot it % NUM_STAGES; each operand in two column parts, [0, 128) into ``*_lo`` and
    [128, TILE_D) into ``*_hi`` (columns past HEAD_DIM and rows past N read 0).  ``DO_STAGES`` < NUM_STAGES: dO_i
    into its own ring's slot it % DO_STAGES once both consumers released it (``do_empty``, after their dV GEMM).
    ``HOST_DESC``: the loads go through the host's descriptors ``descs`` (Q, Q's high part, dO, dO's, K, K's, V,
    V's over (B, H, N, d), the flat statistics) at ``coords`` = (b, q head, kv head, this (batch, q head)'s
    statistics block) instead of descriptors built here over the head's base pointers."""
    dtype: gl.constexpr = k_lo.dtype
    if HOST_DESC:
        if TILE_D == 256:  # both column parts are [64, 128] boxes: the first descriptor serves both (the host's Nones)
            q_desc, _, do_desc, _, k_desc, _, v_desc, _, stats_desc = descs
            q_desc_hi = q_desc
            do_desc_hi = do_desc
            k_desc_hi = k_desc
            v_desc_hi = v_desc
        else:
            q_desc, q_desc_hi, do_desc, do_desc_hi, k_desc, k_desc_hi, v_desc, v_desc_hi, stats_desc = descs
        b, hq, hk, stats0 = coords
    else:
        q_desc, q_desc_hi = _desc_pair(Q, seqlen_q, stride_qm, q_lo, q_hi, HEAD_DIM, TILE_D)
        do_desc, do_desc_hi = _desc_pair(DO, seqlen_q, stride_dom, do_lo, do_hi, HEAD_DIM, TILE_D)
        k_desc, k_desc_hi = _desc_pair(K, seqlen_k, stride_kn, k_lo, k_hi, HEAD_DIM, TILE_D)
        v_desc, v_desc_hi = _desc_pair(V, seqlen_k, stride_vn, v_lo, v_hi, HEAD_DIM, TILE_D)
        stats_desc = tma.make_tensor_descriptor(Stats, [2 * stats_rows], [1], [64], stats_smem.layout)
        b = 0  # unread coordinates: the descriptors are the head's
        hq = 0
        hk = 0
        stats0 = 0
    box_bytes: gl.constexpr = 64 * TILE_D * dtype.primitive_bitwidth // 8  # both parts; zero-filled ones count too
    has_work = n_iters > 0  # consumers never wait for K / V without a q tile; no copy may outlive them
    mbarrier.expect(kv_bar, 2 * box_bytes, pred=has_work)
    _load_rows(k_desc, b, hk, start_n, kv_bar, k_lo.index(0), has_work, HOST_DESC=HOST_DESC, RANK3=False)
    _load_rows(k_desc_hi, b, hk, start_n, kv_bar, k_hi.index(0), has_work, HOST_DESC=HOST_DESC, RANK3=False, COL=128)
    _load_rows(v_desc, b, hk, start_n, kv_bar, v_lo.index(0), has_work, HOST_DESC=HOST_DESC, RANK3=False)
    _load_rows(v_desc_hi, b, hk, start_n, kv_bar, v_hi.index(0), has_work, HOST_DESC=HOST_DESC, RANK3=False, COL=128)
    for it in range(n_iters):
        slot = it % NUM_STAGES
        m0 = (first_m + it) * 64
        # parity of the previous round of this slot; the first round passes on fresh barriers
        mbarrier.wait(qdo_empty.index(slot), ((it // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(q_ready.index(slot), box_bytes + 2 * 64 * 4)
        _load_rows(q_desc, b, hq, m0, q_ready.index(slot), q_lo.index(slot), True, HOST_DESC=HOST_DESC, RANK3=False)
        _load_rows(q_desc_hi, b, hq, m0, q_ready.index(slot), q_hi.index(slot), True, HOST_DESC=HOST_DESC,
                   RANK3=False, COL=128)
        tma.async_copy_global_to_shared(stats_desc, [stats0 + m0], q_ready.index(slot), stats_smem.index(2 * slot))
        tma.async_copy_global_to_shared(stats_desc, [stats0 + stats_rows + m0], q_ready.index(slot),
                                        stats_smem.index(2 * slot + 1))
        dslot = it % DO_STAGES
        if DO_STAGES != NUM_STAGES:
            mbarrier.wait(do_empty.index(dslot), ((it // DO_STAGES) & 1) ^ 1)
        mbarrier.expect(do_ready.index(dslot), box_bytes)
        _load_rows(do_desc, b, hq, m0, do_ready.index(dslot), do_lo.index(dslot), True, HOST_DESC=HOST_DESC,
                   RANK3=False)
        _load_rows(do_desc_hi, b, hq, m0, do_ready.index(dslot), do_hi.index(dslot), True, HOST_DESC=HOST_DESC,
                   RANK3=False, COL=128)


@gluon.jit
def _step_tiles(z, slot, dslot, k_lo, k_hi, v_lo, v_hi, q_lo, q_hi, do_lo, do_hi, WG: gl.constexpr):
    """A q step's tiles: K, V (index ``z``, the opaque zero), ring slot ``slot``'s Q and ``dslot``'s dO as (low,
    high) column parts, then this warpgroup's part of Q, dO and K (warpgroup 0 the low one)."""
    k_t, k_t_hi = k_lo.index(z), k_hi.index(z)
    v_t, v_t_hi = v_lo.index(z), v_hi.index(z)
    q_s, q_s_hi = q_lo.index(slot), q_hi.index(slot)
    do_s, do_s_hi = do_lo.index(dslot), do_hi.index(dslot)
    if WG == 0:
        q_w, do_w, k_w = q_s, do_s, k_t
    else:
        q_w, do_w, k_w = q_s_hi, do_s_hi, k_t_hi
    return k_t, k_t_hi, v_t, v_t_hi, q_s, q_s_hi, do_s, do_s_hi, q_w, do_w, k_w


@gluon.jit
def _dq_first(ds_t, k_w, DQacc, m0, WG: gl.constexpr, BLOCK_D: gl.constexpr, DQ_TMA: gl.constexpr):
    """dQ_i's first column part of this warpgroup, dS K[:, first part] (32 columns with ``DQ_TMA``, else 64),
    issued asynchronously: ``(dq, a zero tile of its layout, the accumulator tile the reductions add into)``
    (its address computed before the GEMM is issued; unused with ``DQ_TMA``)."""
    PART: gl.constexpr = 32 if DQ_TMA else 64
    acc_tile = DQacc
    if not DQ_TMA:
        acc_tile = DQacc + m0.to(gl.int64) * BLOCK_D + WG * 128
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, PART, 16])
    dq_zero = gl.zeros([64, PART], gl.float32, layout=dq_layout)
    dq = warpgroup_mma(ds_t, k_w.slice(0, PART, dim=1), dq_zero, use_acc=False, is_async=True)
    return dq, dq_zero, acc_tile


@gluon.jit
def _dq_part_add(dq_desc, dq_tile, dq, row, col):
    """One dQ part's TMA reduce-add at (row, col) of this (batch, q head)'s accumulator: ``dq_desc`` = (the head's
    descriptor,) or (the host's over every head, the head's index)."""
    if len(dq_desc) == 2:
        _dq_tma_add3(dq_desc[0], dq_tile, dq, dq_desc[1], row, col)
    else:
        _dq_tma_add(dq_desc[0], dq_tile, dq, row, col)


@gluon.jit
def _dq_rest(dq, dq_zero, ds_t, k_w, acc_tile, dq_desc, dq_smem, m0, WG: gl.constexpr, BLOCK_D: gl.constexpr,
             WIDTH: gl.constexpr, DQ_TMA: gl.constexpr):
    """dQ_i[:, this warpgroup's WIDTH columns] += dS K: the first part (``dq``, retired) added, then the others
    computed and added — through the warpgroup's staging tile and TMA reduce-adds (``DQ_TMA``) or by vector
    reductions into ``acc_tile`` of the (rows, BLOCK_D) accumulator (rows padded to 64: no mask; int64 offsets).
    ``dq_desc``: (the head's rank-2 descriptor,), or (the host's rank-3 one over (B * Hq, rows, BLOCK_D), the
    (batch, q head) index)."""
    COL0: gl.constexpr = WG * 128
    PART: gl.constexpr = 32 if DQ_TMA else 64  # _dq_first's
    if DQ_TMA:
        _dq_part_add(dq_desc, dq_smem.index(WG), dq, m0, COL0)
        for c in gl.static_range(1, WIDTH // PART):
            dq = warpgroup_mma(ds_t, k_w.slice(c * PART, PART, dim=1), dq_zero, use_acc=False)
            _dq_part_add(dq_desc, dq_smem.index(WG), dq, m0, COL0 + c * PART)
    else:
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, PART, 16])
        _red_add(acc_tile, dq, N=PART, ROW_STRIDE=BLOCK_D, LAYOUT=dq_layout)
        for c in gl.static_range(1, WIDTH // PART):
            dq = warpgroup_mma(ds_t, k_w.slice(c * PART, PART, dim=1), dq_zero, use_acc=False)
            _red_add(acc_tile + c * PART, dq, N=PART, ROW_STRIDE=BLOCK_D, LAYOUT=dq_layout)


@gluon.jit
def _wide_q_step(it, dk, dv, k_lo, k_hi, v_lo, v_hi, q_lo, q_hi, do_lo, do_hi, pt_smem, ds_smem, stats_smem,
                 q_ready, do_ready, qdo_empty, turn_bars, DQacc, dq_desc, dq_smem, qk_scale, seqlen_q, seqlen_k,
                 first_m, kv_rows, WG: gl.constexpr, BLOCK_D: gl.constexpr, TILE_D: gl.constexpr, NUM_STAGES:
                 gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr, PINGPONG: gl.constexpr, DQ_TMA:
                 gl.constexpr):
    """q tile ``first_m + it`` against the program's 64 keys ``kv_rows``: this warpgroup's columns of dV, dK
    updated in registers, of dQ_i added into ``DQacc`` (this (batch, q head)'s (rows, BLOCK_D) accumulator;
    ``DQ_TMA``: 32-column parts through ``dq_smem`` and bulk reduce-adds on ``dq_desc``, Pᵀ a register operand)."""
    WIDTH: gl.constexpr = 128 if WG == 0 else TILE_D - 128  # this warpgroup's columns [128 WG, 128 WG + WIDTH)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 64, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, WIDTH, 16])
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = ds_smem.dtype

    slot = it % NUM_STAGES
    phase = (it // NUM_STAGES) & 1
    # K, V and this warpgroup's Pᵀ / dSᵀ tiles indexed by an opaque zero: constant indices let LLVM hoist the
    # wgmma descriptors (64-bit each) out of the q loop, and ptxas spills them
    z = gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [it], dtype=gl.int32, is_pure=True, pack=1)
    k_t, k_t_hi, v_t, v_t_hi, q_s, q_s_hi, do_s, do_s_hi, q_w, do_w, k_w = _step_tiles(
        z, slot, slot, k_lo, k_hi, v_lo, v_hi, q_lo, q_hi, do_lo, do_hi, WG=WG)
    pt_wg = pt_smem.index(WG + z)
    ds_wg = ds_smem.index(WG + z)
    m0 = (first_m + it) * 64
    zero_s = gl.zeros([64, 64], gl.float32, layout=s_layout)
    mbarrier.wait(q_ready.index(slot), phase)
    # dPᵀ - D accumulated onto -D (the rows of D, broadcast from the slot's statistics, made distinct registers)
    d_cols = gl.expand_dims(stats_smem.index(2 * slot + 1).load(col_s), 0) + zero_s
    minus_d = gl.inline_asm_elementwise("neg.f32 $0, $1;", "=r,r", [d_cols], dtype=gl.float32, is_pure=False,
                                        pack=1)
    _turn_wait(turn_bars, it, WG=WG, PINGPONG=PINGPONG)
    # the score GEMMs reduce over both column parts
    st = warpgroup_mma(k_t, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    st = warpgroup_mma(k_t_hi, q_s_hi.permute((1, 0)), st, is_async=True)
    mbarrier.wait(do_ready.index(slot), phase)
    dpt = warpgroup_mma(v_t, do_s.permute((1, 0)), minus_d, is_async=True)
    dpt = warpgroup_mma(v_t_hi, do_s_hi.permute((1, 0)), dpt, is_async=True)
    _turn_pass(turn_bars, WG=WG, PINGPONG=PINGPONG)
    st = warpgroup_mma_wait(2, deps=(st,))  # Sᵀ done, dPᵀ's two GEMMs may still run
    lse_cols = stats_smem.index(2 * slot).load(col_s)  # +inf past Nq and on rows that see no key: P = 0 there
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse_cols, 0))
    if MASKED:
        cols = gl.arange(0, 64, layout=col_s)
        # key n is seen by row m0 + c iff n < Nk and, causal, n - (Nk - Nq) - m0 <= c (bottom-right): one
        # per-row bound against the columns' constants (no per-element offset)
        keep = gl.expand_dims(kv_rows < seqlen_k, 1)
        if CAUSAL:
            keep = keep & (gl.expand_dims(kv_rows - (seqlen_k - seqlen_q) - m0, 1) <= gl.expand_dims(cols, 0))
        pt = gl.where(keep, pt, 0.0)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    if DQ_TMA:
        # Pᵀ as the dV GEMM's register operand: its shared tile's 16 KB hold the fp32 dQ staging tiles instead
        pt_a = gl.convert_layout(pt.to(dtype), a_layout)
        dv = warpgroup_mma(pt_a, do_w, dv, is_async=True)
    else:
        # the previous step's GEMMs reading Pᵀ and dSᵀ retired at its final wait
        pt_wg.store(pt.to(dtype))
        fence_async_shared()
        dv = warpgroup_mma(pt_wg, do_w, dv, is_async=True)
    dpt = warpgroup_mma_wait(1, deps=(dpt,))  # dPᵀ - D done, dV may still run
    dst16 = (pt * dpt).to(dtype)
    ds_wg.store(dst16)
    fence_async_shared()
    ds_a = gl.convert_layout(dst16, a_layout)
    dk = warpgroup_mma(ds_a, q_w, dk, is_async=True)
    # dQ_i[:, this warpgroup's columns] += dS K in 32- or 64-column parts (registers beside dK, dV)
    ds_t = ds_wg.permute((1, 0))
    dq, dq_zero, acc_tile = _dq_first(ds_t, k_w, DQacc, m0, WG=WG, BLOCK_D=BLOCK_D, DQ_TMA=DQ_TMA)
    if DQ_TMA:
        # pt_a and ds_a are read by the in-flight dV / dK GEMMs from registers: kept alive until this wait
        dv, dk, dq, pt_a, ds_a = warpgroup_mma_wait(0, deps=(dv, dk, dq, pt_a, ds_a))
    else:
        # ds_a is read by the in-flight dK GEMM from registers: kept alive until this wait
        dv, dk, dq, ds_a = warpgroup_mma_wait(0, deps=(dv, dk, dq, ds_a))
    mbarrier.arrive(qdo_empty.index(slot))  # Q_i and dO_i read for the last time
    _dq_rest(dq, dq_zero, ds_t, k_w, acc_tile, dq_desc, dq_smem, m0, WG=WG, BLOCK_D=BLOCK_D, WIDTH=WIDTH,
             DQ_TMA=DQ_TMA)
    return dk, dv


@gluon.jit
def _wide_q_step_split(it, dk, dv, k_lo, k_hi, v_lo, v_hi, q_lo, q_hi, do_lo, do_hi, pt_smem, ds_smem,
                       stats_smem, q_ready, do_ready, qdo_empty, do_empty, ds_full, ds_empty, turn_bars, DQacc, dq_desc,
                       dq_smem, qk_scale, seqlen_q, seqlen_k, first_m, kv_rows, WG: gl.constexpr,
                       BLOCK_D: gl.constexpr, TILE_D: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                       MASKED: gl.constexpr, PINGPONG: gl.constexpr, DQ_TMA: gl.constexpr, DO_STAGES: gl.constexpr):
    """``SPLIT_S``: as :func:`_wide_q_step`, but warpgroup w computes Sᵀ, dPᵀ, Pᵀ, dSᵀ only for q columns
    [32 w, 32 w + 32) of the tile (no score GEMM done twice) and writes them into the shared [64, 64] Pᵀ / dSᵀ
    tiles of buffer it % DS_BUFS, which both read whole once both wrote (``ds_full``); a buffer is rewritten once
    both warpgroups' GEMMs reading it two steps ago retired (``ds_empty``; with one buffer, the previous step).
    ``DQ_TMA``: dQ's parts as in :func:`_wide_q_step`.  ``DO_STAGES`` < NUM_STAGES: dO_i from its own ring, its slot
    released (``do_empty``) once this step's dV GEMM retired, before the dK / dQ GEMMs."""
    WIDTH: gl.constexpr = 128 if WG == 0 else TILE_D - 128
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 32, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, WIDTH, 16])
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = ds_smem.dtype

    slot = it % NUM_STAGES
    phase = (it // NUM_STAGES) & 1
    DS_BUFS: gl.constexpr = pt_smem.shape[0]  # Pᵀ / dSᵀ buffers: 2, or 1 where shared memory holds one only
    buf = it % DS_BUFS
    # K, V, the Pᵀ / dSᵀ buffers and a one-slot dO ring indexed by an opaque zero: constant indices let LLVM hoist
    # the wgmma descriptors (64-bit each) out of the q loop, and ptxas spills them
    z = gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [it], dtype=gl.int32, is_pure=True, pack=1)
    dslot = it % DO_STAGES + z
    k_t, k_t_hi, v_t, v_t_hi, q_s, q_s_hi, do_s, do_s_hi, q_w, do_w, k_w = _step_tiles(
        z, slot, dslot, k_lo, k_hi, v_lo, v_hi, q_lo, q_hi, do_lo, do_hi, WG=WG)
    pt_b = pt_smem.index(buf + z)
    ds_b = ds_smem.index(buf + z)
    m0 = (first_m + it) * 64
    zero_s = gl.zeros([64, 32], gl.float32, layout=s_layout)
    mbarrier.wait(q_ready.index(slot), phase)
    d_cols = gl.expand_dims(stats_smem.index(2 * slot + 1).slice(WG * 32, 32).load(col_s), 0) + zero_s
    minus_d = gl.inline_asm_elementwise("neg.f32 $0, $1;", "=r,r", [d_cols], dtype=gl.float32, is_pure=False,
                                        pack=1)
    _turn_wait(turn_bars, it, WG=WG, PINGPONG=PINGPONG)
    st = warpgroup_mma(k_t, q_s.slice(WG * 32, 32, dim=0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    st = warpgroup_mma(k_t_hi, q_s_hi.slice(WG * 32, 32, dim=0).permute((1, 0)), st, is_async=True)
    mbarrier.wait(do_ready.index(dslot), (it // DO_STAGES) & 1)
    dpt = warpgroup_mma(v_t, do_s.slice(WG * 32, 32, dim=0).permute((1, 0)), minus_d, is_async=True)
    dpt = warpgroup_mma(v_t_hi, do_s_hi.slice(WG * 32, 32, dim=0).permute((1, 0)), dpt, is_async=True)
    _turn_pass(turn_bars, WG=WG, PINGPONG=PINGPONG)
    st = warpgroup_mma_wait(2, deps=(st,))
    lse_cols = stats_smem.index(2 * slot).slice(WG * 32, 32).load(col_s)
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse_cols, 0))
    if MASKED:
        cols = gl.arange(0, 32, layout=col_s)
        rows = gl.convert_layout(kv_rows, gl.SliceLayout(1, s_layout))  # the same rows per thread at N = 32
        keep = gl.expand_dims(rows < seqlen_k, 1)
        if CAUSAL:  # one per-row bound against the columns' constants (no per-element offset)
            keep = keep & (gl.expand_dims(rows - (seqlen_k - seqlen_q) - m0 - WG * 32, 1) <= gl.expand_dims(cols, 0))
        pt = gl.where(keep, pt, 0.0)
    # the buffer's readers of DS_BUFS steps ago (both warpgroups) retired; the first round passes on fresh barriers
    mbarrier.wait(ds_empty.index(buf), ((it // DS_BUFS) & 1) ^ 1)
    pt_b.slice(WG * 32, 32, dim=1).store(pt.to(dtype))
    dpt = warpgroup_mma_wait(0, deps=(dpt,))
    ds_b.slice(WG * 32, 32, dim=1).store((pt * dpt).to(dtype))
    fence_async_shared()
    mbarrier.arrive(ds_full.index(buf))
    mbarrier.wait(ds_full.index(buf), (it // DS_BUFS) & 1)  # both warpgroups' columns written
    dv = warpgroup_mma(pt_b, do_w, dv, is_async=True)
    dk = warpgroup_mma(ds_b, q_w, dk, is_async=True)
    ds_t = ds_b.permute((1, 0))
    dq, dq_zero, acc_tile = _dq_first(ds_t, k_w, DQacc, m0, WG=WG, BLOCK_D=BLOCK_D, DQ_TMA=DQ_TMA)
    if DO_STAGES != NUM_STAGES:
        # groups retire in order: dV done, so dO_i is read for the last time; its slot refills under dK / dQ
        dv = warpgroup_mma_wait(2, deps=(dv,))
        mbarrier.arrive(do_empty.index(dslot))
    dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
    mbarrier.arrive(qdo_empty.index(slot))  # Q_i (and with one ring dO_i) read for the last time
    _dq_rest(dq, dq_zero, ds_t, k_w, acc_tile, dq_desc, dq_smem, m0, WG=WG, BLOCK_D=BLOCK_D, WIDTH=WIDTH,
             DQ_TMA=DQ_TMA)
    mbarrier.arrive(ds_empty.index(buf))  # this warpgroup's last read of the buffer retired
    return dk, dv


@gluon.jit
def _wide_steps(lo, hi, dk, dv, k_lo, k_hi, v_lo, v_hi, q_lo, q_hi, do_lo, do_hi, pt_smem, ds_smem, stats_smem,
                q_ready, do_ready, qdo_empty, do_empty, ds_full, ds_empty, turn_bars, DQacc, dq_desc, dq_smem, qk_scale,
                seqlen_q, seqlen_k, first_m, kv_rows, WG: gl.constexpr, BLOCK_D: gl.constexpr, TILE_D: gl.constexpr,
                NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, MASKED: gl.constexpr, PINGPONG: gl.constexpr,
                SPLIT_S: gl.constexpr, DQ_TMA: gl.constexpr, DO_STAGES: gl.constexpr):
    """Steps [lo, hi) of the q loop through :func:`_wide_q_step_split` (``SPLIT_S``) or :func:`_wide_q_step`."""
    for it in range(lo, hi):
        if SPLIT_S:
            dk, dv = _wide_q_step_split(it, dk, dv, k_lo, k_hi, v_lo, v_hi, q_lo, q_hi, do_lo, do_hi, pt_smem,
                                        ds_smem, stats_smem, q_ready, do_ready, qdo_empty, do_empty, ds_full, ds_empty,
                                        turn_bars, DQacc, dq_desc, dq_smem, qk_scale, seqlen_q, seqlen_k, first_m,
                                        kv_rows, WG=WG, BLOCK_D=BLOCK_D, TILE_D=TILE_D, NUM_STAGES=NUM_STAGES,
                                        CAUSAL=CAUSAL, MASKED=MASKED, PINGPONG=PINGPONG, DQ_TMA=DQ_TMA,
                                        DO_STAGES=DO_STAGES)
        else:
            dk, dv = _wide_q_step(it, dk, dv, k_lo, k_hi, v_lo, v_hi, q_lo, q_hi, do_lo, do_hi, pt_smem, ds_smem,
                                  stats_smem, q_ready, do_ready, qdo_empty, turn_bars, DQacc, dq_desc, dq_smem,
                                  qk_scale, seqlen_q, seqlen_k, first_m, kv_rows, WG=WG, BLOCK_D=BLOCK_D, TILE_D=TILE_D,
                                  NUM_STAGES=NUM_STAGES, CAUSAL=CAUSAL, MASKED=MASKED, PINGPONG=PINGPONG, DQ_TMA=DQ_TMA)
    return dk, dv


@gluon.jit
def _wide_consumer(DK, DV, DQacc, k_lo, k_hi, v_lo, v_hi, q_lo, q_hi, do_lo, do_hi, pt_smem, ds_smem, stats_smem,
                   dq_smem, kv_bar, q_ready, do_ready, qdo_empty, do_empty, ds_full, ds_empty, turn_bars, qk_scale,
                   softmax_scale, stride_dkn, stride_dvn, seqlen_q, seqlen_k, acc_rows, start_n, first_m, n_masked,
                   n_iters, DQDesc, dq_head, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr,
                   TILE_D: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                   SPLIT_S: gl.constexpr, DQ_TMA: gl.constexpr, DO_STAGES: gl.constexpr, HOST_DESC: gl.constexpr):
    """Columns [COL0, COL0 + WIDTH) of dK, dV (warpgroup 0 [0, 128), warpgroup 1 [128, TILE_D)) for keys
    [start_n, start_n + 64): the q loop (masked steps first: the causal diagonal, or every step when the kv tile
    crosses Nk), then dK · scale and dV stored."""
    gl.static_assert(gl.num_warps() == 4)
    COL0: gl.constexpr = WG * 128
    WIDTH: gl.constexpr = 128 if WG == 0 else TILE_D - 128
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, WIDTH, 16])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 64, 16])
    kv_rows = start_n + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([64, WIDTH], gl.float32, layout=acc_layout)
    dv = gl.zeros([64, WIDTH], gl.float32, layout=acc_layout)
    if DQ_TMA and HOST_DESC:
        gl.static_assert(DQDesc.layout.swizzle_byte_width == dq_smem.layout.swizzle_byte_width)
        dq_desc = (DQDesc, dq_head)  # the host's over (B * Hq, rows, BLOCK_D): coordinates [head, row, col]
    elif DQ_TMA:
        # this (batch, q head)'s accumulator rows (padded to 64: no box is clipped), boxes of dq_smem's tiles
        dq_desc = (tma.make_tensor_descriptor(DQacc, [acc_rows, BLOCK_D], [BLOCK_D, 1], [64, dq_smem.shape[2]],
                                              dq_smem.layout),)
    else:
        dq_desc = None
    if n_iters > 0:
        mbarrier.wait(kv_bar, 0)
        # masked steps first (the causal diagonal, or all when the kv tile crosses Nk), then unmasked ones
        dk, dv = _wide_steps(0, n_masked, dk, dv, k_lo, k_hi, v_lo, v_hi, q_lo, q_hi, do_lo, do_hi, pt_smem,
                             ds_smem, stats_smem, q_ready, do_ready, qdo_empty, do_empty, ds_full, ds_empty, turn_bars,
                             DQacc, dq_desc, dq_smem, qk_scale, seqlen_q, seqlen_k, first_m, kv_rows, WG=WG,
                             BLOCK_D=BLOCK_D, TILE_D=TILE_D, NUM_STAGES=NUM_STAGES, CAUSAL=CAUSAL, MASKED=True,
                             PINGPONG=PINGPONG, SPLIT_S=SPLIT_S, DQ_TMA=DQ_TMA, DO_STAGES=DO_STAGES)
        dk, dv = _wide_steps(n_masked, n_iters, dk, dv, k_lo, k_hi, v_lo, v_hi, q_lo, q_hi, do_lo, do_hi, pt_smem,
                             ds_smem, stats_smem, q_ready, do_ready, qdo_empty, do_empty, ds_full, ds_empty, turn_bars,
                             DQacc, dq_desc, dq_smem, qk_scale, seqlen_q, seqlen_k, first_m, kv_rows, WG=WG,
                             BLOCK_D=BLOCK_D, TILE_D=TILE_D, NUM_STAGES=NUM_STAGES, CAUSAL=CAUSAL, MASKED=False,
                             PINGPONG=PINGPONG, SPLIT_S=SPLIT_S, DQ_TMA=DQ_TMA, DO_STAGES=DO_STAGES)
        if DQ_TMA:
            tma.store_wait(0)  # the last reduce has read its tile before the program's shared memory is released
    dk = dk * softmax_scale
    out_dtype: gl.constexpr = DK.dtype.element_ty
    rows = start_n + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
    cols = COL0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, acc_layout))
    mask = gl.expand_dims(rows < seqlen_k, 1) & gl.expand_dims(cols < HEAD_DIM, 0)
    rows64 = rows.to(gl.int64)
    gl.store(DK + gl.expand_dims(rows64 * stride_dkn, 1) + gl.expand_dims(cols, 0), dk.to(out_dtype), mask=mask)
    gl.store(DV + gl.expand_dims(rows64 * stride_dvn, 1) + gl.expand_dims(cols, 0), dv.to(out_dtype), mask=mask)


@gluon.jit(do_not_specialize=["n_heads", "kv_group", "seqlen_q", "seqlen_k", "num_n_tiles", "lpt_heads",
                              "stride_acc_h", "total_q", "total_k"])
def fa3_gluon_bwd_wide_kernel(
    Q, K, V, DO, Stats, DK, DV, DQacc, CuQ, CuK,
    # HOST_DESC: descriptors over Q, Q's high part, dO, dO's, K, K's, V, V's (B, H, N, d; [1, 1, 64, 128] and
    # [1, 1, 64, TILE_D - 128] boxes, the high parts None at TILE_D 256), the flat statistics and DQacc (B * Hq,
    # rows, BLOCK_D); otherwise None
    QDesc, QDescHi, DODesc, DODescHi, KDesc, KDescHi, VDesc, VDescHi, StatsDesc, DQDesc,
    qk_scale,  # softmax_scale * log2(e), any sign
    softmax_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_acc_h,  # elements per (batch, q head) of DQacc: Nq rounded up to a multiple of 64, times BLOCK_D
    n_heads, kv_group, seqlen_q, seqlen_k, num_n_tiles, lpt_heads, total_q, total_k,
    HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, TILE_D: gl.constexpr, NUM_STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, GQA_PARTIAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    PINGPONG: gl.constexpr, SPLIT_S: gl.constexpr, DQ_TMA: gl.constexpr, IS_VARLEN: gl.constexpr,
    DO_STAGES: gl.constexpr, HOST_DESC: gl.constexpr,
):
    """1-D grid of B * Hq * cdiv(Nk, 64) programs in ``_kv_tile_of``'s order (groups of ``lpt_heads`` (batch, q head)
    pairs).  Stats is ``stats_preprocess_kernel``'s (B * Hq, 2, Nq rounded up to a multiple of 64) buffer, DQacc the
    zeroed (B * Hq, the same rows, BLOCK_D) fp32 accumulator.  DK, DV are indexed by the q head when ``GQA_PARTIAL``
    (fp32 partials), else by its kv head.  ``BLOCK_D`` is 256 (the head dim's next power of two, the accumulator's row),
    ``HEAD_DIM`` > 128, ``TILE_D`` the shared tiles' width (192 or 256).  ``IS_VARLEN``: a packed batch, as in
    :func:`flashtile.kernels.fa3_gluon_bwd.fa3_gluon_bwd_kernel`.  ``DO_STAGES`` (``SPLIT_S`` only, 1 or
    NUM_STAGES): dO in a ring of its own of that depth (FA3's single dO buffer at d = 256), whose 32 KB let both
    Pᵀ / dSᵀ buffers fit beside 256-wide tiles.  ``HOST_DESC`` (fixed length, ``DQ_TMA``): every load and dQ
    reduce-add through the host's descriptors (coordinates batch, head, row, column), none built in the kernel.
    Launch with ``num_warps=4``."""
    gl.static_assert(HEAD_DIM % 8 == 0)  # TMA: 16-byte row strides
    gl.static_assert(TILE_D >= HEAD_DIM)
    gl.static_assert(BLOCK_D == 256)  # the accumulator's row; each warpgroup's columns whole 64-column dQ parts
    gl.static_assert(TILE_D == 256 or TILE_D == 192)  # warpgroup 0 columns [0, 128), warpgroup 1 [128, TILE_D)
    gl.static_assert(NUM_STAGES >= 2)  # a slot is refilled once both consumers release it
    # dO's own ring (released after the dV GEMM, refilled under dK / dQ) is the split step's
    gl.static_assert(DO_STAGES == NUM_STAGES or (DO_STAGES == 1 and SPLIT_S))
    gl.static_assert(not HOST_DESC or (DQ_TMA and not IS_VARLEN))  # packed batches build per-sequence descriptors
    dtype: gl.constexpr = Q.dtype.element_ty
    bh, tile = _kv_tile_of(gl.program_id(0), num_n_tiles, lpt_heads)
    off_b = (bh // n_heads).to(gl.int64)
    off_h = (bh % n_heads).to(gl.int64)
    off_hk = off_h // kv_group
    start_n = tile * 64
    q_start, k_start, row0, seqlen_q, seqlen_k = _program_rows(CuQ, CuK, off_b, total_q, total_k, seqlen_q, seqlen_k,
                                                               IS_VARLEN=IS_VARLEN)
    if IS_VARLEN:
        if start_n >= seqlen_k:  # the grid spans the longest sequence's kv tiles: past this one's keys, no work
            return

    first_m, n_iters, n_masked = _q_tiles(start_n, seqlen_q, seqlen_k, BLOCK_N=64, CAUSAL=CAUSAL)

    # each operand in two column parts (shared tiles have power-of-two shapes): [0, 128) and [128, TILE_D)
    HI: gl.constexpr = TILE_D - 128
    lo_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 128], dtype)
    hi_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HI], dtype)
    tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], dtype)
    k_lo = gl.allocate_shared_memory(dtype, [1, 64, 128], lo_layout)  # one tile, indexed (_wide_q_step)
    k_hi = gl.allocate_shared_memory(dtype, [1, 64, HI], hi_layout)
    v_lo = gl.allocate_shared_memory(dtype, [1, 64, 128], lo_layout)
    v_hi = gl.allocate_shared_memory(dtype, [1, 64, HI], hi_layout)
    q_lo = gl.allocate_shared_memory(dtype, [NUM_STAGES, 64, 128], lo_layout)
    q_hi = gl.allocate_shared_memory(dtype, [NUM_STAGES, 64, HI], hi_layout)
    do_lo = gl.allocate_shared_memory(dtype, [DO_STAGES, 64, 128], lo_layout)
    do_hi = gl.allocate_shared_memory(dtype, [DO_STAGES, 64, HI], hi_layout)
    if SPLIT_S:
        # two buffers of the shared Pᵀ / dSᵀ tiles, each warpgroup writing 32 of their 64 columns: 64-byte swizzle
        # atoms, so each warpgroup's column slice is whole atoms
        half_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64,
                                                         element_bitwidth=dtype.primitive_bitwidth, rank=2)
        # with dQ's staging tiles beside 256-wide tiles one buffer each is all that fits with dO in the Q ring
        # (226 KB; two: 242 KB), two with one dO buffer (runtime.fa3_gluon_bwd.smem_bytes counts the same)
        DS_BUFS: gl.constexpr = 1 if DQ_TMA and TILE_D == 256 and DO_STAGES == NUM_STAGES else 2
        pt_smem = gl.allocate_shared_memory(dtype, [DS_BUFS, 64, 64], half_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [DS_BUFS, 64, 64], half_layout)
    elif DQ_TMA:
        ds_smem = gl.allocate_shared_memory(dtype, [2, 64, 64], tile_layout)  # one dSᵀ per warpgroup
        pt_smem = ds_smem  # unread: Pᵀ is the dV GEMM's register operand
    else:
        pt_smem = gl.allocate_shared_memory(dtype, [2, 64, 64], tile_layout)  # one Pᵀ per warpgroup
        ds_smem = gl.allocate_shared_memory(dtype, [2, 64, 64], tile_layout)  # one dSᵀ per warpgroup
    if DQ_TMA:
        # one fp32 [64, 32] dQ part per warpgroup, bulk reduce-added into the accumulator
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, 64, 32],
                                            gl.NVMMASharedLayout.get_default_for([64, 32], gl.float32))
    else:
        dq_smem = ds_smem  # unread: warp_specialize's arguments must be IR values
    # per ring slot the q tile's log2-scaled LSE and D rows, one [2, 64] TMA box (unswizzled: rows dense)
    stats_smem = gl.allocate_shared_memory(gl.float32, [2 * NUM_STAGES, 64],
                                           gl.NVMMASharedLayout.get_default_for([64], gl.float32))
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    if DO_STAGES != NUM_STAGES:  # dO's own ring: its slots' releases
        do_empty = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
    else:
        do_empty = qdo_empty  # unread: warp_specialize's arguments must be IR values
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # PINGPONG: one per consumer
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn_bars.index(i), count=1)  # PINGPONG: the other warpgroup's pass
    if SPLIT_S:
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):  # one arrival per warpgroup and use of a buffer
            mbarrier.init(ds_full.index(i), count=2)
            mbarrier.init(ds_empty.index(i), count=2)
    else:
        ds_full = turn_bars  # unread: warp_specialize's arguments must be IR values
        ds_empty = turn_bars
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        if DO_STAGES == NUM_STAGES:
            mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(qdo_empty.index(i), count=2)  # one arrival per consumer warpgroup
    if DO_STAGES != NUM_STAGES:
        for i in gl.static_range(DO_STAGES):
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(do_empty.index(i), count=2)

    q_base, do_base, k_base, v_base, dk_base, dv_base, acc_base, acc_rows, stats_base = _program_bases(
        Q, DO, K, V, DK, DV, DQacc, Stats, stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
        stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_dkb, stride_dkh, stride_dkn,
        stride_dvb, stride_dvh, stride_dvn, stride_acc_h, off_b, off_h, off_hk, bh, q_start, k_start, row0, seqlen_q,
        BLOCK_D=BLOCK_D, GQA_PARTIAL=GQA_PARTIAL, IS_VARLEN=IS_VARLEN)
    if HOST_DESC:
        descs = (QDesc, QDescHi, DODesc, DODescHi, KDesc, KDescHi, VDesc, VDescHi, StatsDesc)
        coords = (off_b.to(gl.int32), off_h.to(gl.int32), off_hk.to(gl.int32), bh * (2 * acc_rows))
    else:  # unread
        descs = (kv_bar,)
        coords = (bh,)
    # constexprs keep their kind only in tuples written in the call: each consumer's tuple spelled out with its WG
    gl.warp_specialize([
        (_wide_consumer, (dk_base, dv_base, acc_base, k_lo, k_hi, v_lo, v_hi, q_lo, q_hi, do_lo, do_hi, pt_smem,
         ds_smem, stats_smem, dq_smem, kv_bar, q_ready, do_ready, qdo_empty, do_empty, ds_full, ds_empty, turn_bars,
         qk_scale,
         softmax_scale, stride_dkn, stride_dvn, seqlen_q, seqlen_k, acc_rows, start_n, first_m, n_masked, n_iters,
         DQDesc, bh, 0, HEAD_DIM, BLOCK_D, TILE_D, NUM_STAGES, CAUSAL, PINGPONG, SPLIT_S, DQ_TMA, DO_STAGES,
         HOST_DESC)),
        (_wide_consumer, (dk_base, dv_base, acc_base, k_lo, k_hi, v_lo, v_hi, q_lo, q_hi, do_lo, do_hi, pt_smem,
         ds_smem, stats_smem, dq_smem, kv_bar, q_ready, do_ready, qdo_empty, do_empty, ds_full, ds_empty, turn_bars,
         qk_scale,
         softmax_scale, stride_dkn, stride_dvn, seqlen_q, seqlen_k, acc_rows, start_n, first_m, n_masked, n_iters,
         DQDesc, bh, 1, HEAD_DIM, BLOCK_D, TILE_D, NUM_STAGES, CAUSAL, PINGPONG, SPLIT_S, DQ_TMA, DO_STAGES,
         HOST_DESC)),
        (_wide_producer, (q_base, k_base, v_base, do_base, stats_base, k_lo, k_hi, v_lo, v_hi, q_lo, q_hi, do_lo,
         do_hi, stats_smem, kv_bar, q_ready, do_ready, qdo_empty, do_empty, stride_qm, stride_kn, stride_vn,
         stride_dom, seqlen_q, seqlen_k, acc_rows, start_n, first_m, n_iters, descs, coords, HEAD_DIM, TILE_D,
         NUM_STAGES, DO_STAGES, HOST_DESC)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
