"""Hopper (sm_90a) attention backward in Gluon: FA3's dK/dV-stationary schedule with dQ by fp32 atomics
(FA3, Shah et al. 2024, Algorithm 3 and its appendix; the math is FA2's Algorithm 2, whose float64 twin is
:func:`flashtile.reference.backward.flash_attn_backward`: kv tiles outer, q tiles inner, dQ accumulated).

One program owns a kv tile of ``BLOCK_N = 128`` keys of one (batch, q head) and runs three partitions
(``gl.warp_specialize``):

* a producer (1 warp): TMA loads of K_j and V_j once (two 64-row boxes each, one per consumer), then Q_i and
  dO_i (``BLOCK_M``-row boxes) into a ``NUM_STAGES``-deep ring for every q tile i that sees the kv tile (causal,
  bottom-right: from the first q tile whose last row reaches the tile's first key); slots guarded by
  ``q_ready`` / ``do_ready`` (tx-count) and ``qdo_empty`` (both consumers release a slot after its last GEMM);
* two consumer warpgroups (the default partition and a 4-warp worker), each owning 64 of the 128 kv rows:
  Sᵀ = K Qᵀ, Pᵀ = exp2(Sᵀ·scale·log2e − LSE·log2e) (masked on the causal diagonal and past Nk; rows that see no key
  and rows past Nq have LSE treated as +inf, so P = 0 there), dPᵀ − D = V dOᵀ accumulated onto −D, dV += Pᵀ dO (Pᵀ
  through shared memory, or with ``PT_REGS`` the register A operand), dSᵀ = Pᵀ∘(dPᵀ − D), dK += dSᵀ Q (the register
  A operand); dSᵀ also goes to this warpgroup's shared tile and dQ_i += dS K_half is wgmmas reading it transposed,
  64 columns at a time, each fp32 result added into the (B·Hq, Nq padded to whole q tiles, BLOCK_D) accumulator by
  vector reductions (``red.global.add.v2.f32``, unmasked: the accumulator's padding absorbs rows past Nq and columns
  past d).

``DQ_SPLIT`` (BLOCK_D 64 or 128): warpgroup w computes dQ_i[:, w·BLOCK_D/2 : (w+1)·BLOCK_D/2] over all 128 keys from
both warpgroups' dSᵀ tiles (double-buffered, ``ds_full`` / ``ds_empty``), half the reductions; K is swizzled in
half-rows so each warpgroup's column slice is whole swizzle atoms.  With ``BLOCK_M`` = 128 (64-wide tiles: q tiles of
128 rows, Sᵀ / dPᵀ 64 x 128 per warpgroup) the split is by rows instead: warpgroup w computes rows [64 w, 64 w + 64)
of dQ_i from both dSᵀ tiles' q columns [64 w, 64 w + 64) (whole swizzle atoms) and all of K.  ``DQ_TMA`` (with
``DQ_SPLIT``, or BLOCK_D <= 64): the warpgroup's fp32 dQ part goes to its shared tile and one TMA bulk reduce-add
(``cp.reduce.async.bulk.tensor``, FA3's way) adds it into the accumulator, instead of per-thread reductions.
``PINGPONG``: the consumers take turns issuing each step's Sᵀ and dPᵀ GEMMs (``turn_bars``), warpgroup 0 first, so one
warpgroup's exp2 and dSᵀ overlap the other's GEMMs (the forward's schedule, ``fa3_gluon._turn_wait``). ``STATS_SMEM``:
the q tile's LSE·log2e and D rows (``stats_preprocess_kernel``'s padded buffer) come with Q_i through the TMA ring and
are read from shared memory straight into the score columns' layout, instead of global loads and layout conversions
per step.  ``DQ_SWIZZLE32`` (with ``DQ_TMA``): the dQ tiles in 32-byte swizzle atoms (conflict-free stores from the
accumulator layout).  ``PT_SEPARATE``: Pᵀ in its own shared allocation (one ``bar.sync`` fewer per step).
``RELEASE_ONCE`` (``DQ_SPLIT``, 2 stages): ``ds_empty`` also frees the ring slot. ``NAMED_BARS``: the ring releases,
the ping-pong turns and (``DQ_SPLIT``) the dSᵀ rendezvous on hardware named barriers (FA3's), with no ``ds_empty``
(the rendezvous of the step between orders the rewrite), instead of mbarriers, each of whose arrives Triton brackets
with warpgroup ``bar.sync``s. ``GROUP_LOOP`` (GQA, with ``STATS_SMEM``): one program per (batch, kv head, kv tile)
runs the q loop for each of the kv head's q heads in turn (Q, dO and the dQ accumulator through rank-3 [group, rows,
d] descriptors, the ring and ping-pong counters running on across heads), so dK / dV are summed in registers and
stored once in q's dtype. docs/gluon_bwd.md, "Per-step overhead".

dK is scaled by ``softmax_scale`` at the end; dK and dV are stored in the output pointers' dtype (q's dtype,
or fp32 per-q-head partials that the host sums for GQA).  dQ = scale · accumulator is written by
``dq_postprocess_kernel`` (plain Triton: it runs in the interpreter).  D = rowsum(dO∘O) comes from FA2's
preprocess kernel (``STATS_SMEM``: from ``stats_preprocess_kernel``, plain Triton too).  Not deterministic (the
atomics' order varies); FA2's backward is the deterministic path.
The host launcher is :mod:`flashtile.runtime.fa3_gluon_bwd`; descriptors need ``triton.set_allocator``.

Every flag is checked against the float64 oracle on an H100 (``pytest -m gpu tests/kernels/test_fa3_gluon_bwd.py``);
which ones the table takes, and where the backward is dispatched, is ``runtime.fa3_gluon_bwd`` (bench/NOTES.md,
"Gluon backward").
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from triton._C.libtriton import ir as _ir
from triton.experimental.gluon.language._core import builtin as _builtin

from flashtile.kernels._common import LOG2E, unfold_pid
from flashtile.kernels.block_info import _packed_range
from flashtile.kernels.fa3_gluon import _named_bar, _unit4, packed_range

__all__ = ["fa3_gluon_bwd_kernel", "dq_postprocess_kernel", "stats_preprocess_kernel", "varlen_rows", "WG_N",
           "BLOCK_M", "VARLEN_PAD"]

WG_N = 64  # kv rows per consumer warpgroup (wgmma M = 16 per warp x 4 warps)
BLOCK_M = 64  # q rows per inner step (the N of the Sᵀ / dPᵀ wgmmas); the kernels' BLOCK_M constexpr: 64 or 128
_LOG2E = gl.constexpr(LOG2E)
# packed batches: sequence b's rows of the statistics and the dQ accumulator start at row
# 4 * ceil(start / 4) + VARLEN_PAD * b of its head's block (a 16-byte aligned start; at most 3 + 63 rows of padding
# before the next sequence's), so each head holds total_q + VARLEN_PAD * B rows (``varlen_rows``)
VARLEN_PAD = 68
_VARLEN_PAD = gl.constexpr(VARLEN_PAD)
# hardware named barriers of ``NAMED_BARS`` (``fa3_gluon._named_bar``): Triton's warp specialisation takes 0-3 here
# (default partition, whole CTA, the two workers); the ring slots' releases from 5 (at most 4 stages), the
# ping-pong turns 9 and 10, the dSᵀ rendezvous 11
_RING_BAR0 = gl.constexpr(5)
_TURN_BAR0 = gl.constexpr(9)
_DS_BAR = gl.constexpr(11)
# arrivals completing a ring release: both consumer warpgroups and the producer's one warp
_RING_THREADS = gl.constexpr(2 * 128 + 32)


def varlen_rows(total_q: int, n_seqs: int) -> int:
    """Rows per head of the statistics and dQ accumulator of a packed batch (a multiple of 4)."""
    return (total_q + VARLEN_PAD * n_seqs + 3) // 4 * 4


@gluon.jit
def _seq_range(Cu, b, total, max_len):
    """Sequence ``b`` (int64) of a packed batch: (start, length, row0), start and length as
    :func:`flashtile.kernels.fa3_gluon.packed_range` clamps them, row0 (int64) its first row of the padded
    statistics / accumulator blocks."""
    start, length = packed_range(Cu, b, total, max_len)
    return start, length, (start + 3) // 4 * 4 + _VARLEN_PAD * b


@triton.jit
def _seq_range_tl(Cu, b, total, max_len):
    """:func:`_seq_range` for the Triton kernels (``block_info._packed_range``'s clamps, the same rows)."""
    start, length = _packed_range(Cu, b, total, max_len)
    return start, length, (start + 3) // 4 * 4 + _VARLEN_PAD * b


@gluon.jit
def _program_rows(CuQ, CuK, off_b, total_q, total_k, seqlen_q, seqlen_k, IS_VARLEN: gl.constexpr):
    """(q_start, k_start, row0, seqlen_q, seqlen_k) of a program of batch element ``off_b`` (narrow and wide
    kernels): with ``IS_VARLEN`` sequence off_b's first rows and lengths (:func:`_seq_range`, the arguments being
    the longest lengths), otherwise zeros and the arguments as they are."""
    if IS_VARLEN:
        q_start, seqlen_q, row0 = _seq_range(CuQ, off_b, total_q, seqlen_q)
        k_start, seqlen_k, _ = _seq_range(CuK, off_b, total_k, seqlen_k)
    else:  # unread
        q_start = 0
        k_start = 0
        row0 = 0
    return q_start, k_start, row0, seqlen_q, seqlen_k


@gluon.jit
def _program_bases(Q, DO, K, V, DK, DV, DQacc, Stats, stride_qb, stride_qh, stride_qm, stride_dob, stride_doh,
                   stride_dom, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_dkb, stride_dkh,
                   stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_acc_h, off_b, off_h, off_hk, bh, q_start,
                   k_start, row0, seqlen_q, BLOCK_D: gl.constexpr, GQA_PARTIAL: gl.constexpr,
                   IS_VARLEN: gl.constexpr):
    """A program's (q, dO, k, v, dK, dV, dQ accumulator) base pointers, its accumulator rows and its [2, rows]
    statistics block (narrow and wide kernels): batch ``off_b``'s heads, or (``IS_VARLEN``) sequence ``off_b``'s
    rows from ``q_start`` / ``k_start`` of the packed views and its statistics / accumulator rows from ``row0``
    (``_seq_range``) of its head's padded blocks; dK / dV by the q head under ``GQA_PARTIAL``.  64-bit offsets."""
    if GQA_PARTIAL:
        dk_head = off_h
    else:
        dk_head = off_hk
    if IS_VARLEN:
        q_row = q_start.to(gl.int64)
        k_row = k_start.to(gl.int64)
        q_base = Q + q_row * stride_qm + off_h * stride_qh
        do_base = DO + q_row * stride_dom + off_h * stride_doh
        k_base = K + k_row * stride_kn + off_hk * stride_kh
        v_base = V + k_row * stride_vn + off_hk * stride_vh
        dk_base = DK + k_row * stride_dkn + dk_head * stride_dkh
        dv_base = DV + k_row * stride_dvn + dk_head * stride_dvh
        head_rows = stride_acc_h // BLOCK_D
        acc_rows = (seqlen_q + 63) // 64 * 64
        acc_base = DQacc + (off_h * head_rows + row0) * BLOCK_D
        stats_base = Stats + off_h * (2 * head_rows) + 2 * row0  # [2, acc_rows]: LSE rows, then D rows
    else:
        q_base = Q + off_b * stride_qb + off_h * stride_qh
        do_base = DO + off_b * stride_dob + off_h * stride_doh
        k_base = K + off_b * stride_kb + off_hk * stride_kh
        v_base = V + off_b * stride_vb + off_hk * stride_vh
        dk_base = DK + off_b * stride_dkb + dk_head * stride_dkh
        dv_base = DV + off_b * stride_dvb + dk_head * stride_dvh
        bh64 = bh.to(gl.int64)
        acc_base = DQacc + bh64 * stride_acc_h
        # rows of one head's accumulator (< 2^31; stride_acc_h passes 2^31 from Nq = 2^24): TMA offsets are i32
        acc_rows = (stride_acc_h // BLOCK_D).to(gl.int32)
        # this (batch, q head)'s [2, acc_rows] block of the padded statistics (same row padding as DQacc)
        stats_base = Stats + bh64 * (2 * acc_rows)
    return q_base, do_base, k_base, v_base, dk_base, dv_base, acc_base, acc_rows, stats_base


@gluon.constexpr_function
def _red_asm(n, row_stride):
    """PTX adding a thread's n // 2 elements of a [64, n] fp32 tile in the wgmma accumulator layout to a
    row-major tile of ``row_stride`` floats per row at ``$base``, as ``n // 4`` vector reductions
    (red.v2.f32, sm_90).  Element 2p + e sits at row r + 8 (p % 2), column c + 8 (p // 2) + e, where
    r = 16 (warp % 4) + lane // 4 and c = 2 (lane % 4) (Triton's layout, checked on the PTX of a load).
    One asm for the whole tile: the address is one register plus immediates, where per-element pointer
    tensors made ptxas hoist 32 64-bit addresses per tile and spill at d = 128."""
    per_thread = n // 2
    body = ["{", ".reg .b32 gbt, gbr, gbc;", ".reg .b64 gba;"]
    body += [f"mov.b32 ${i}, 0;" for i in range(per_thread)]
    body += ["mov.u32 gbt, %tid.x;", "shr.u32 gbr, gbt, 1;", "and.b32 gbr, gbr, 48;", "bfe.u32 gbc, gbt, 2, 3;",
             "or.b32 gbr, gbr, gbc;", "shl.b32 gbc, gbt, 1;", "and.b32 gbc, gbc, 6;",
             f"mad.lo.u32 gbr, gbr, {row_stride}, gbc;", f"mad.wide.u32 gba, gbr, 4, ${2 * per_thread};"]
    for p in range(per_thread // 2):
        off = 4 * (8 * (p % 2) * row_stride + 8 * (p // 2))
        v0, v1 = per_thread + 2 * p, per_thread + 2 * p + 1
        body.append(f"red.global.add.relaxed.gpu.v2.f32 [gba+{off}], {{${v0}, ${v1}}};")
    body.append("}")
    return "\n".join(body)


@gluon.constexpr_function
def _red_constraints(n):
    """Output and input constraints of :func:`_red_asm`'s asm: a dummy result, the values, the address."""
    return ",".join(["=r"] * (n // 2) + ["r"] * (n // 2) + ["l"] * (n // 2))


@_builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``cp.reduce.async.bulk.tensor ... .add`` of the shared tile ``src`` into ``tensor_desc``'s box at ``coord``
    (one bulk group; ``tma.store_wait`` waits for its read of ``src``).  Triton 3.6's Gluon builder has the op,
    its ``tma`` module does not name it (3.9's ``tma.async_atomic_add`` is this call)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _red_add(base, tile, N: gl.constexpr, ROW_STRIDE: gl.constexpr, LAYOUT: gl.constexpr):
    """``*base[r, c] += tile[r, c]`` for a [64, N] fp32 tile in the wgmma accumulator layout, rows
    ``ROW_STRIDE`` floats apart; no mask (the caller's buffer covers the whole tile)."""
    addr = base.to(gl.int64) + gl.zeros([64, N], gl.int64, layout=LAYOUT)
    gl.inline_asm_elementwise(_red_asm(N, ROW_STRIDE), _red_constraints(N), [tile, addr], dtype=gl.int32,
                              is_pure=False, pack=N // 2)


@gluon.jit
def _dq_tma_add3(dq_desc, dq_tile, dq, g, row, col, WAITED: gl.constexpr = False):
    """:func:`_dq_tma_add` into head ``g`` of a rank-3 accumulator descriptor: [group, rows, BLOCK_D] built in the
    kernel (``GROUP_LOOP``), or the host's over (B * Hq, rows, BLOCK_D) (``HOST_DESC``)."""
    if not WAITED:
        tma.store_wait(0)
        gl.thread_barrier()
    dq_tile.store(dq)
    fence_async_shared()
    gl.thread_barrier()
    _tma_reduce_add(dq_desc, [g, row, col], dq_tile.reshape([1, dq_tile.shape[0], dq_tile.shape[1]]))


@gluon.jit
def _dq_tma_add(dq_desc, dq_tile, dq, row, col, WAITED: gl.constexpr = False):
    """``dq`` (fp32, this warpgroup's registers) added into the accumulator's box at (row, col) by one TMA bulk
    reduce-add from the warpgroup's shared tile ``dq_tile``.  ``WAITED``: the issuing threads waited for their
    previous reduces before a barrier of the whole warpgroup (``NAMED_BARS``' dSᵀ rendezvous), so no wait and no
    warpgroup barrier here (Triton 3.6 still follows that earlier wait with a warpgroup ``bar.sync`` of its own)."""
    if not WAITED:
        tma.store_wait(0)  # the issuing threads' previous reduces have read the tile (a step ago: no stall expected)
        gl.thread_barrier()  # ... before any thread of the warpgroup overwrites it
    dq_tile.store(dq)
    fence_async_shared()  # generic-proxy writes visible to the bulk copy
    gl.thread_barrier()  # every thread's part written before the one-thread issue
    _tma_reduce_add(dq_desc, [row, col], dq_tile)


@gluon.jit
def _turn_wait(turn_bars, it, WG: gl.constexpr, PINGPONG: gl.constexpr, NAMED: gl.constexpr = False):
    """Ping-pong: wait for this warpgroup's turn to issue step ``it``'s Sᵀ and dPᵀ GEMMs.  Warpgroup 0 goes first
    (step 0 waits for parity 1: a fresh barrier passes), then each waits for the other's pass of the same step
    (warpgroup 1) or of the previous one (warpgroup 0); the two are never more than one phase apart.  ``NAMED``:
    on named barriers (the waiter's 128 threads and the passer's), warpgroup 0's step 0 not waiting; the last
    pass of a program is left unmatched at its exit."""
    if PINGPONG and NAMED:
        if WG == 0:
            if it > 0:
                _named_bar(False, _TURN_BAR0, 256)
        else:
            _named_bar(False, _TURN_BAR0 + 1, 256)
    elif PINGPONG:
        if WG == 0:
            mbarrier.wait(turn_bars.index(0), (it + 1) & 1)
        else:
            mbarrier.wait(turn_bars.index(1), it & 1)


@gluon.jit
def _turn_pass(turn_bars, WG: gl.constexpr, PINGPONG: gl.constexpr, NAMED: gl.constexpr = False):
    """Ping-pong: this step's first GEMMs are queued; the other warpgroup's turn."""
    if PINGPONG and NAMED:
        _named_bar(True, _TURN_BAR0 + 1 - WG, 256)
    elif PINGPONG:
        mbarrier.arrive(turn_bars.index(1 - WG))


@gluon.jit
def _kv_tile_of(pid, num_n_tiles, lpt_heads):
    """(unit, kv tile) of program ``pid``, a unit being a (batch, head) pair (``GROUP_LOOP``: kv head): the kv tiles
    of groups of ``lpt_heads`` units in turn, tile-major inside a group (the first kv tiles, which see the most q
    tiles under a causal mask, of all its units first), the first group the smaller when the units do not split
    evenly; 1: each unit's kv tiles adjacent.  The twin on the host is
    :func:`flashtile.runtime.fa3_gluon_bwd.kv_tile_order`."""
    units = gl.num_programs(0) // num_n_tiles
    pad = (lpt_heads - units % lpt_heads) % lpt_heads  # the first group is pad units short
    group = (pid + pad * num_n_tiles) // (lpt_heads * num_n_tiles)
    first = gl.maximum(group * lpt_heads - pad, 0)
    heads = gl.minimum(group * lpt_heads + lpt_heads - pad, units) - first
    r = pid - first * num_n_tiles
    return first + r % heads, r // heads


@gluon.jit
def _q_tiles(start_n, seqlen_q, seqlen_k, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr = 64):
    """(first_m, n_iters, n_masked) of the kv tile of ``BLOCK_N`` keys from ``start_n``: its q tiles of ``BLOCK_M``
    rows run from the first whose last row sees key start_n (causal), the first n_masked crossing the diagonal or,
    when the kv tile crosses Nk, all of them (shared by the narrow and the wide kernel)."""
    num_m_tiles = gl.cdiv(seqlen_q, BLOCK_M)
    shift = seqlen_k - seqlen_q  # row m sees keys n <= m + shift (causal)
    if CAUSAL:
        first_m = gl.maximum(start_n - shift, 0) // BLOCK_M
        # tiles whose first row sees the tile's last key run unmasked: m0 >= start_n + BLOCK_N - 1 - shift
        full_m = gl.cdiv(gl.maximum(start_n + (BLOCK_N - 1) - shift, 0), BLOCK_M)
    else:
        first_m = 0
        full_m = 0
    first_m = gl.minimum(first_m, num_m_tiles)
    n_iters = num_m_tiles - first_m
    n_masked = gl.minimum(gl.maximum(full_m - first_m, 0), n_iters)
    if start_n + BLOCK_N > seqlen_k:
        n_masked = n_iters
    return first_m, n_iters, n_masked


@gluon.jit
def _slot_acquire(qdo_empty, slot, step, NUM_STAGES: gl.constexpr, NAMED_BARS: gl.constexpr):
    """The producer's wait for ring ``slot`` before loading ring step ``step``: both consumers released the slot's
    previous round (the first round passes): mbarrier parity, or with ``NAMED_BARS`` the named barrier of
    ``_slot_release``."""
    if NAMED_BARS:
        if step >= NUM_STAGES:
            _named_bar(False, _RING_BAR0 + slot, _RING_THREADS)
    else:
        mbarrier.wait(qdo_empty.index(slot), ((step // NUM_STAGES) & 1) ^ 1)


@gluon.jit
def _slot_release(qdo_empty, slot, NAMED_BARS: gl.constexpr):
    """A consumer warpgroup's GEMMs reading ring ``slot`` (Q_i, dO_i) retired: an mbarrier arrival, or with
    ``NAMED_BARS`` a named-barrier arrival (no wait; a program's last rounds stay unmatched at its exit)."""
    if NAMED_BARS:
        _named_bar(True, _RING_BAR0 + slot, _RING_THREADS)
    else:
        mbarrier.arrive(qdo_empty.index(slot))


@gluon.jit
def _load_rows(desc, b, head, row, bar, tile, pred, HOST_DESC: gl.constexpr, RANK3: gl.constexpr,
               COL: gl.constexpr = 0):
    """TMA copy of the [rows, width] box at (``row``, ``COL``) into ``tile`` (its shape): through a host descriptor
    over (B, H, N, d) at (b, head, row, COL), a per-program rank-3 one over the group's heads at (head, row, COL), or a
    per-head one."""
    if HOST_DESC:
        gl.static_assert(desc.layout.swizzle_byte_width == tile.layout.swizzle_byte_width)
        tma.async_copy_global_to_shared(desc, [b, head, row, COL], bar, _unit4(tile), pred=pred)
    elif RANK3:
        tma.async_copy_global_to_shared(desc, [head, row, COL], bar,
                                        tile.reshape([1, tile.shape[0], tile.shape[1]]), pred=pred)
    else:
        tma.async_copy_global_to_shared(desc, [row, COL], bar, tile, pred=pred)


@gluon.jit
def _producer(Q, K, V, DO, Stats, k_smem, v_smem, q_smem, do_smem, stats_smem, kv_bar, q_ready, do_ready,
              qdo_empty, stride_qm, stride_kn, stride_vn, stride_dom, seqlen_q, seqlen_k, stats_rows, start_n,
              first_m, n_iters, group, stride_qh, stride_doh, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr,
              NUM_STAGES: gl.constexpr, STATS_SMEM: gl.constexpr, GROUP_LOOP: gl.constexpr,
              NAMED_BARS: gl.constexpr, QDesc, KDesc, VDesc, DODesc, StatsDesc, off_b, off_h, off_hk, bh,
              HOST_DESC: gl.constexpr, BLOCK_M: gl.constexpr):
    """K, V halves once, then Q_i, dO_i (``BLOCK_M`` rows) for the ``n_iters`` q tiles from ``first_m`` into ring slot
    it % NUM_STAGES, once both consumers released the slot's previous round (``_slot_acquire``).  Boxes are
    BLOCK_D wide: columns past HEAD_DIM read 0, as rows past Nq / Nk do.
    ``STATS_SMEM``: the q tile's rows of ``Stats`` (2 x ``stats_rows``: log2-scaled LSE, D; padded, never
    clipped) into ``stats_smem``'s slot too, counted on ``q_ready``.  ``HOST_DESC``: the loads go through the
    host's descriptors (``QDesc`` ... ``StatsDesc``) at this program's (``off_b``, ``off_h``, ``off_hk``, ``bh``)
    instead of descriptors built here over the program's base pointers."""
    box_layout: gl.constexpr = q_smem.layout  # [BLOCK_M, BLOCK_D] boxes of Q and dO
    if HOST_DESC:
        gl.static_assert(BLOCK_M == 64)  # the host's boxes are 64 rows
        # the host's descriptors over the whole (B, H, N, d) tensors and the flat statistics: coordinates
        # (b, head, row, 0) and (head's block + row); nothing built here
        q_desc = QDesc
        do_desc = DODesc
        k_desc = KDesc
        v_desc = VDesc
        stats_desc = StatsDesc
        b = off_b.to(gl.int32)
        q_head0 = off_h.to(gl.int32)  # with GROUP_LOOP the group's first q head
        kv_head = off_hk.to(gl.int32)
        stats_head0 = bh
    else:
        b = 0
        q_head0 = 0
        kv_head = 0
        stats_head0 = 0
        if GROUP_LOOP:
            # the group's q heads as one rank-3 tensor (coordinates [g, row, 0]): no descriptor rebuilt per head
            # while copies of the previous one are in flight
            box3: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, BLOCK_D], q_smem.dtype)
            gl.static_assert(box3.swizzle_byte_width == box_layout.swizzle_byte_width)
            q_desc = tma.make_tensor_descriptor(Q, [group, seqlen_q, HEAD_DIM], [stride_qh, stride_qm, 1],
                                                [1, BLOCK_M, BLOCK_D], box3)
            do_desc = tma.make_tensor_descriptor(DO, [group, seqlen_q, HEAD_DIM], [stride_doh, stride_dom, 1],
                                                 [1, BLOCK_M, BLOCK_D], box3)
        else:
            q_desc = tma.make_tensor_descriptor(Q, [seqlen_q, HEAD_DIM], [stride_qm, 1], [BLOCK_M, BLOCK_D],
                                                box_layout)
            do_desc = tma.make_tensor_descriptor(DO, [seqlen_q, HEAD_DIM], [stride_dom, 1], [BLOCK_M, BLOCK_D],
                                                 box_layout)
        k_desc = tma.make_tensor_descriptor(K, [seqlen_k, HEAD_DIM], [stride_kn, 1], [64, BLOCK_D], k_smem.layout)
        v_desc = tma.make_tensor_descriptor(V, [seqlen_k, HEAD_DIM], [stride_vn, 1], [64, BLOCK_D], v_smem.layout)
        if STATS_SMEM:
            # the group's heads' [2, stats_rows] blocks are adjacent (Stats is (B * Hq, 2, rows))
            n_heads_here = group if GROUP_LOOP else 1
            stats_desc = tma.make_tensor_descriptor(Stats, [2 * stats_rows * n_heads_here], [1], [BLOCK_M],
                                                    stats_smem.layout)
        else:
            stats_desc = None
    # a box's transaction bytes count its zero-filled part too
    box_bytes: gl.constexpr = BLOCK_M * BLOCK_D * q_smem.dtype.primitive_bitwidth // 8
    kv_box_bytes: gl.constexpr = 64 * BLOCK_D * q_smem.dtype.primitive_bitwidth // 8
    if STATS_SMEM:
        q_bytes: gl.constexpr = box_bytes + 2 * BLOCK_M * 4
    else:
        q_bytes: gl.constexpr = box_bytes
    has_work = n_iters > 0  # consumers never wait for K / V without a q tile; no copy may outlive them
    mbarrier.expect(kv_bar, 4 * kv_box_bytes, pred=has_work)
    for w in gl.static_range(2):
        # a half wholly past Nk re-reads the tile's first rows (no box lies wholly out of bounds); its keys
        # are masked by index and its dK / dV rows never stored
        k_row = start_n + w * 64
        k_row = gl.where(k_row < seqlen_k, k_row, start_n)
        _load_rows(k_desc, b, kv_head, k_row, kv_bar, k_smem.index(w), has_work, HOST_DESC=HOST_DESC, RANK3=False)
        _load_rows(v_desc, b, kv_head, k_row, kv_bar, v_smem.index(w), has_work, HOST_DESC=HOST_DESC, RANK3=False)
    gl.static_assert(STATS_SMEM or not GROUP_LOOP)
    for g in range(group if GROUP_LOOP else 1):
        for it in range(n_iters):
            step = g * n_iters + it  # the ring runs on across the group's heads
            slot = step % NUM_STAGES
            m0 = (first_m + it) * BLOCK_M
            _slot_acquire(qdo_empty, slot, step, NUM_STAGES=NUM_STAGES, NAMED_BARS=NAMED_BARS)
            mbarrier.expect(q_ready.index(slot), q_bytes)
            _load_rows(q_desc, b, q_head0 + g, m0, q_ready.index(slot), q_smem.index(slot), True,
                       HOST_DESC=HOST_DESC, RANK3=GROUP_LOOP)
            if STATS_SMEM:
                srow = (stats_head0 + g) * (2 * stats_rows) + m0
                tma.async_copy_global_to_shared(stats_desc, [srow], q_ready.index(slot), stats_smem.index(2 * slot))
                tma.async_copy_global_to_shared(stats_desc, [srow + stats_rows], q_ready.index(slot),
                                                stats_smem.index(2 * slot + 1))
            mbarrier.expect(do_ready.index(slot), box_bytes)
            _load_rows(do_desc, b, q_head0 + g, m0, do_ready.index(slot), do_smem.index(slot), True,
                       HOST_DESC=HOST_DESC, RANK3=GROUP_LOOP)


@gluon.jit
def _q_step(it, dk, dv, k_smem, v_smem, ds_smem, q_smem, do_smem, q_ready, do_ready, qdo_empty, ds_full, ds_empty,
            turn_bars, LSE, Delta, DQacc, dq_desc, dq_smem, stats_smem, pt_smem,
            qk_scale, seqlen_q, seqlen_k, first_m, kv_rows, step, g,
            WG: gl.constexpr, BLOCK_D: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
            MASKED: gl.constexpr, DQ_SPLIT: gl.constexpr, DQ_TMA: gl.constexpr, PINGPONG: gl.constexpr,
            STATS_SMEM: gl.constexpr, PT_SEPARATE: gl.constexpr, RELEASE_ONCE: gl.constexpr,
            GROUP_LOOP: gl.constexpr, NAMED_BARS: gl.constexpr, HOST_DESC: gl.constexpr, BLOCK_M: gl.constexpr,
            PT_REGS: gl.constexpr):
    """q tile ``first_m + it`` (``BLOCK_M`` rows) against this warpgroup's 64 kv rows ``kv_rows``: dV, dK updated in
    registers, dQ's partial added into the accumulator (``DQ_TMA``: through ``dq_smem`` and ``dq_desc``, a rank-3 one
    at head ``g`` with ``GROUP_LOOP`` or ``HOST_DESC``).  LSE, Delta, DQacc point at this (batch, q head);
    ``STATS_SMEM``: the q tile's log2-scaled LSE and D rows come from the ring slot of ``stats_smem`` instead
    (``_producer``)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_D, 16])
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = ds_smem.dtype

    slot = step % NUM_STAGES  # step: the ring's count (it, or with GROUP_LOOP counted across the group's heads)
    phase = (step // NUM_STAGES) & 1
    # this warpgroup's K, V, dS, Pᵀ tiles indexed by WG + an opaque zero: with a constant index LLVM hoists their
    # 28 wgmma descriptors (64-bit each) out of the q loop and ptxas spills them at d = 128
    z = gl.inline_asm_elementwise("mov.b32 $0, 0;", "=r,r", [step], dtype=gl.int32, is_pure=True, pack=1)
    k_wg = k_smem.index(WG + z)
    v_wg = v_smem.index(WG + z)
    m0 = (first_m + it) * BLOCK_M
    if not STATS_SMEM:
        # row statistics of the q tile read before the waits in a compact layout (1 register each), moved to
        # the score columns' layout (16 registers each) only where used: kept early, they spill at d = 128
        vec: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[4],
                                             order=[0])
        rows_v = m0 + gl.arange(0, BLOCK_M, layout=vec)
        # past Nq and on rows that see no key (LSE -inf) the +inf makes P = 0
        lse_v = gl.load(LSE + rows_v, mask=rows_v < seqlen_q, other=float("inf"))
        lse_v = gl.where(lse_v == float("-inf"), float("inf"), lse_v * _LOG2E)
        delta_v = gl.load(Delta + rows_v, mask=rows_v < seqlen_q, other=0.0)
    zero_s = gl.zeros([64, BLOCK_M], gl.float32, layout=s_layout)

    q_s = q_smem.index(slot)
    do_s = do_smem.index(slot)
    if STATS_SMEM:
        # rows of the slot's [2, BLOCK_M] tile (LSE, D) read straight into the score columns' layout: broadcast
        # shared loads, no layout conversion; they landed with Q_i (q_ready)
        mbarrier.wait(q_ready.index(slot), phase)
        d_cols = gl.expand_dims(stats_smem.index(2 * slot + 1).load(col_s), 0) + zero_s
    else:
        d_cols = gl.expand_dims(gl.convert_layout(delta_v, col_s), 0) + zero_s
    # dPᵀ - D: the GEMM accumulates onto -D, so D is not held beside Pᵀ and dPᵀ (spills at d = 128).  The
    # rows of -D are equal: an asm per element makes them distinct registers (shared ones are copied into
    # the accumulator, and ptxas then waits for the Sᵀ GEMM before issuing this one)
    minus_d = gl.inline_asm_elementwise("neg.f32 $0, $1;", "=r,r", [d_cols], dtype=gl.float32, is_pure=False,
                                        pack=1)
    if not STATS_SMEM:
        mbarrier.wait(q_ready.index(slot), phase)
    # PINGPONG: the tensor cores take one warpgroup's Sᵀ, dPᵀ before the other's, so its exp2 and dSᵀ run beside them
    _turn_wait(turn_bars, step, WG=WG, PINGPONG=PINGPONG, NAMED=NAMED_BARS)
    st = warpgroup_mma(k_wg, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(slot), phase)
    dpt = warpgroup_mma(v_wg, do_s.permute((1, 0)), minus_d, is_async=True)
    _turn_pass(turn_bars, WG=WG, PINGPONG=PINGPONG, NAMED=NAMED_BARS)
    st = warpgroup_mma_wait(1, deps=(st,))  # groups retire in order: Sᵀ done, dPᵀ may still run
    if STATS_SMEM:
        lse_cols = stats_smem.index(2 * slot).load(col_s)  # +inf past Nq and on rows that see no key: P = 0 there
    else:
        lse_cols = gl.convert_layout(lse_v, col_s)
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse_cols, 0))
    if MASKED:
        cols = gl.arange(0, BLOCK_M, layout=col_s)
        # key n is seen by row m0 + c iff n < Nk and, causal, n - (Nk - Nq) - m0 <= c (bottom-right): one
        # per-row bound against the columns' constants (no per-element offset)
        keep = gl.expand_dims(kv_rows < seqlen_k, 1)
        if CAUSAL:
            keep = keep & (gl.expand_dims(kv_rows - (seqlen_k - seqlen_q) - m0, 1) <= gl.expand_dims(cols, 0))
        pt = gl.where(keep, pt, 0.0)
    # Pᵀ reaches the dV GEMM through shared memory (the previous step's GEMMs reading these tiles retired at its
    # final wait), or with PT_REGS as its register operand (no Pᵀ tile, store, fence or barrier; 16-32 registers
    # alive while the GEMM runs)
    NDS: gl.constexpr = 2 if DQ_SPLIT else 1  # dSᵀ buffers per warpgroup
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    if PT_REGS:
        pt_a = gl.convert_layout(pt.to(dtype), a_layout)
        dv = warpgroup_mma(pt_a, do_s, dv, is_async=True)
    else:
        if PT_SEPARATE:
            pt_wg = pt_smem.index(WG + z)
        else:
            pt_wg = ds_smem.index(2 * NDS + WG + z)
        pt_wg.store(pt.to(dtype))
        fence_async_shared()
        dv = warpgroup_mma(pt_wg, do_s, dv, is_async=True)
    dpt = warpgroup_mma_wait(1, deps=(dpt,))  # dPᵀ - D done, dV may still run
    dst = pt * dpt
    dst16 = dst.to(dtype)
    if DQ_SPLIT:
        # both warpgroups read each other's dSᵀ: two buffers, a buffer rewritten once both dQ GEMMs of two
        # steps ago retired (the first round passes on fresh barriers)
        buf = step % 2
        if not NAMED_BARS:
            # (NAMED_BARS: implied by the rendezvous of step - 1, which the other warpgroup reached after retiring
            # its GEMMs of step - 2)
            mbarrier.wait(ds_empty.index(buf), ((step // 2) & 1) ^ 1)
        ds_wg = ds_smem.index(2 * buf + WG + z)
    else:
        # the previous step's dQ GEMMs reading this tile retired at its final wait
        ds_wg = ds_smem.index(WG + z)
    ds_wg.store(dst16)
    fence_async_shared()
    ds_a = gl.convert_layout(dst16, a_layout)
    dk = warpgroup_mma(ds_a, q_s, dk, is_async=True)
    # the accumulator has BLOCK_D columns and its rows padded to a multiple of BLOCK_M: no mask; int64 (Nq * BLOCK_D
    # passes 2^31 from Nq = 2^24 at BLOCK_D = 128)
    acc_tile = DQacc + m0.to(gl.int64) * BLOCK_D
    if DQ_SPLIT:
        # BLOCK_M 64: dQ_i[:, WG half of d] = dS K over all 128 keys, one 64 x BLOCK_D / 2 result per warpgroup;
        # BLOCK_M 128: dQ_i[WG half of the rows, :] (FA3's split at d = 64), one 64 x BLOCK_D result; either way
        # half the reductions of the unsplit dQ
        if BLOCK_M == 128:
            DQN: gl.constexpr = BLOCK_D
            DQ_ROW: gl.constexpr = WG * 64
            DQ_COL: gl.constexpr = 0
        else:
            DQN: gl.constexpr = BLOCK_D // 2
            DQ_ROW: gl.constexpr = 0
            DQ_COL: gl.constexpr = WG * DQN
            # K's swizzle is DQN elements wide (kernel body): each slice starts on a swizzle atom
            gl.static_assert(DQN * dtype.primitive_bitwidth // 8 == k_smem.layout.swizzle_byte_width)
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQN, 16])
        if NAMED_BARS:
            if DQ_TMA:
                # the issuing threads' previous reduces have read the dQ tile, before the rendezvous orders that
                # for the whole warpgroup (_dq_tma_add's WAITED)
                tma.store_wait(0)
            _named_bar(False, _DS_BAR, 256)  # both warpgroups' dSᵀ stored and fenced
        else:
            mbarrier.arrive(ds_full.index(buf))
            mbarrier.wait(ds_full.index(buf), (step // 2) & 1)
        if BLOCK_M == 128:
            # this warpgroup's 64 q columns of both dSᵀ tiles (whole 128-byte swizzle atoms) against all of K
            ds_0 = ds_smem.index(2 * buf + z).slice(DQ_ROW, 64, dim=1)
            ds_1 = ds_smem.index(2 * buf + 1 + z).slice(DQ_ROW, 64, dim=1)
            k_0 = k_smem.index(z)
            k_1 = k_smem.index(1 + z)
        else:
            ds_0 = ds_smem.index(2 * buf + z)
            ds_1 = ds_smem.index(2 * buf + 1 + z)
            k_0 = k_smem.index(z).slice(DQ_COL, DQN, dim=1)
            k_1 = k_smem.index(1 + z).slice(DQ_COL, DQN, dim=1)
        dq = warpgroup_mma(ds_0.permute((1, 0)), k_0, gl.zeros([64, DQN], gl.float32, layout=dq_layout),
                           use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_1.permute((1, 0)), k_1, dq, is_async=True)
        # ds_a (and with PT_REGS pt_a) is read by the in-flight dK (dV) GEMM from registers: alive until this wait
        if PT_REGS:
            dv, dk, dq, ds_a, pt_a = warpgroup_mma_wait(0, deps=(dv, dk, dq, ds_a, pt_a))
        else:
            dv, dk, dq, ds_a = warpgroup_mma_wait(0, deps=(dv, dk, dq, ds_a))
        if NAMED_BARS:
            _slot_release(qdo_empty, slot, NAMED_BARS=True)  # Q_i and dO_i read for the last time
        else:
            if not RELEASE_ONCE:  # RELEASE_ONCE: ds_empty's arrive releases the ring slot too (kernel body)
                mbarrier.arrive(qdo_empty.index(slot))  # Q_i and dO_i read for the last time
            mbarrier.arrive(ds_empty.index(buf))
        if DQ_TMA:
            if GROUP_LOOP or HOST_DESC:
                _dq_tma_add3(dq_desc, dq_smem.index(WG), dq, g, m0 + DQ_ROW, DQ_COL, WAITED=NAMED_BARS)
            else:
                _dq_tma_add(dq_desc, dq_smem.index(WG), dq, m0 + DQ_ROW, DQ_COL, WAITED=NAMED_BARS)
        else:
            _red_add(acc_tile + (DQ_ROW * BLOCK_D + DQ_COL), dq, N=DQN, ROW_STRIDE=BLOCK_D, LAYOUT=dq_layout)
    else:
        gl.static_assert(BLOCK_M == 64)  # 128 q rows: a 128-row dQ part per warpgroup (64 fp32 registers more)
        # dQ_i += dS K_half in DQ_CHUNK-column parts: one part's fp32 accumulator (32 registers) beside dK, dV
        DQ_CHUNK: gl.constexpr = 64 if BLOCK_D > 64 else BLOCK_D
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_CHUNK, 16])
        dq_zero = gl.zeros([64, DQ_CHUNK], gl.float32, layout=dq_layout)
        ds_t = ds_wg.permute((1, 0))
        dq = warpgroup_mma(ds_t, k_wg.slice(0, DQ_CHUNK, dim=1), dq_zero, use_acc=False, is_async=True)
        # ds_a (and with PT_REGS pt_a) is read by the in-flight dK (dV) GEMM from registers: alive until this wait
        if PT_REGS:
            dv, dk, dq, ds_a, pt_a = warpgroup_mma_wait(0, deps=(dv, dk, dq, ds_a, pt_a))
        else:
            dv, dk, dq, ds_a = warpgroup_mma_wait(0, deps=(dv, dk, dq, ds_a))
        _slot_release(qdo_empty, slot, NAMED_BARS=NAMED_BARS)  # Q_i and dO_i read for the last time
        if DQ_TMA:
            gl.static_assert(DQ_CHUNK == BLOCK_D)  # one 64 x BLOCK_D fp32 tile per warpgroup and step
            if GROUP_LOOP or HOST_DESC:
                _dq_tma_add3(dq_desc, dq_smem.index(WG), dq, g, m0, 0)
            else:
                _dq_tma_add(dq_desc, dq_smem.index(WG), dq, m0, 0)
        else:
            _red_add(acc_tile, dq, N=DQ_CHUNK, ROW_STRIDE=BLOCK_D, LAYOUT=dq_layout)
            for c in gl.static_range(1, BLOCK_D // DQ_CHUNK):
                dq = warpgroup_mma(ds_t, k_wg.slice(c * DQ_CHUNK, DQ_CHUNK, dim=1), dq_zero, use_acc=False)
                _red_add(acc_tile + c * DQ_CHUNK, dq, N=DQ_CHUNK, ROW_STRIDE=BLOCK_D, LAYOUT=dq_layout)
    return dk, dv


@gluon.jit
def _consumer(DK, DV, LSE, Delta, DQacc, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, stats_smem, pt_smem, kv_bar,
              q_ready, do_ready, qdo_empty, ds_full, ds_empty, turn_bars, qk_scale, softmax_scale, stride_dkn,
              stride_dvn, seqlen_q, seqlen_k, acc_rows, start_n, first_m, n_masked, n_iters, group, stride_acc_h,
              WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, NUM_STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, DQ_SPLIT: gl.constexpr, DQ_TMA: gl.constexpr, PINGPONG: gl.constexpr,
              STATS_SMEM: gl.constexpr, PT_SEPARATE: gl.constexpr, RELEASE_ONCE: gl.constexpr,
              GROUP_LOOP: gl.constexpr, NAMED_BARS: gl.constexpr, DQDesc, dq_head0, HOST_DESC: gl.constexpr,
              BLOCK_M: gl.constexpr, PT_REGS: gl.constexpr):
    """kv rows [start_n + WG * 64, + 64): the q loop over tiles of ``BLOCK_M`` rows (masked steps first: the causal
    diagonal, or every step when the kv tile crosses Nk; with ``GROUP_LOOP`` that loop for each of the kv head's
    ``group`` q heads, DQacc their first's accumulator, heads ``stride_acc_h`` apart), then dK · scale and dV stored.
    ``HOST_DESC``: dQ's reduce-adds through the host's descriptor ``DQDesc`` over the whole accumulator, at head
    ``dq_head0`` (+ the group's head)."""
    gl.static_assert(gl.num_warps() == 4)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_D, 16])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    row0 = start_n + WG * 64
    kv_rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([64, BLOCK_D], gl.float32, layout=acc_layout)
    dv = gl.zeros([64, BLOCK_D], gl.float32, layout=acc_layout)
    if DQ_TMA:
        if HOST_DESC:
            dq_desc = DQDesc  # (B * Hq, rows, BLOCK_D), coordinates [head, row, col]
        elif GROUP_LOOP:
            # the group's accumulators as one rank-3 tensor (coordinates [g, row, col])
            dq3: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=dq_smem.layout.swizzle_byte_width,
                                                     element_bitwidth=32, rank=3)
            dq_desc = tma.make_tensor_descriptor(DQacc, [group, acc_rows, BLOCK_D], [stride_acc_h, BLOCK_D, 1],
                                                 [1, 64, dq_smem.shape[2]], dq3)
        else:
            # this (batch, q head)'s accumulator rows (padded to BLOCK_M: no box clipped), boxes of dq_smem's tiles
            dq_desc = tma.make_tensor_descriptor(DQacc, [acc_rows, BLOCK_D], [BLOCK_D, 1],
                                                 [64, dq_smem.shape[2]], dq_smem.layout)
    else:
        dq_desc = None
    if GROUP_LOOP:
        if n_iters > 0:
            mbarrier.wait(kv_bar, 0)
            for g in range(group):
                acc_g = DQacc + g.to(gl.int64) * stride_acc_h  # the reductions' base (without DQ_TMA)
                for it in range(0, n_masked):
                    dk, dv = _q_step(it, dk, dv, k_smem, v_smem, ds_smem, q_smem, do_smem, q_ready, do_ready,
                                     qdo_empty, ds_full, ds_empty, turn_bars, LSE, Delta, acc_g, dq_desc, dq_smem,
                                     stats_smem, pt_smem, qk_scale, seqlen_q, seqlen_k, first_m, kv_rows,
                                     g * n_iters + it, dq_head0 + g, WG=WG, BLOCK_D=BLOCK_D, NUM_STAGES=NUM_STAGES,
                                     CAUSAL=CAUSAL, MASKED=True, DQ_SPLIT=DQ_SPLIT, DQ_TMA=DQ_TMA,
                                     PINGPONG=PINGPONG, STATS_SMEM=STATS_SMEM, PT_SEPARATE=PT_SEPARATE,
                                     RELEASE_ONCE=RELEASE_ONCE, GROUP_LOOP=True,
                                     NAMED_BARS=NAMED_BARS, HOST_DESC=HOST_DESC, BLOCK_M=BLOCK_M,
                                     PT_REGS=PT_REGS)
                for it in range(n_masked, n_iters):
                    dk, dv = _q_step(it, dk, dv, k_smem, v_smem, ds_smem, q_smem, do_smem, q_ready, do_ready,
                                     qdo_empty, ds_full, ds_empty, turn_bars, LSE, Delta, acc_g, dq_desc, dq_smem,
                                     stats_smem, pt_smem, qk_scale, seqlen_q, seqlen_k, first_m, kv_rows,
                                     g * n_iters + it, dq_head0 + g, WG=WG, BLOCK_D=BLOCK_D, NUM_STAGES=NUM_STAGES,
                                     CAUSAL=CAUSAL, MASKED=False, DQ_SPLIT=DQ_SPLIT, DQ_TMA=DQ_TMA,
                                     PINGPONG=PINGPONG, STATS_SMEM=STATS_SMEM, PT_SEPARATE=PT_SEPARATE,
                                     RELEASE_ONCE=RELEASE_ONCE, GROUP_LOOP=True,
                                     NAMED_BARS=NAMED_BARS, HOST_DESC=HOST_DESC, BLOCK_M=BLOCK_M,
                                     PT_REGS=PT_REGS)
            if DQ_TMA:
                tma.store_wait(0)
    elif n_iters > 0:
        mbarrier.wait(kv_bar, 0)
        for it in range(0, n_masked):
            dk, dv = _q_step(it, dk, dv, k_smem, v_smem, ds_smem, q_smem, do_smem, q_ready, do_ready, qdo_empty,
                             ds_full, ds_empty, turn_bars, LSE, Delta, DQacc, dq_desc, dq_smem, stats_smem, pt_smem,
                             qk_scale, seqlen_q, seqlen_k, first_m, kv_rows, it, dq_head0, WG=WG, BLOCK_D=BLOCK_D,
                             NUM_STAGES=NUM_STAGES, CAUSAL=CAUSAL, MASKED=True, DQ_SPLIT=DQ_SPLIT, DQ_TMA=DQ_TMA,
                             PINGPONG=PINGPONG, STATS_SMEM=STATS_SMEM, PT_SEPARATE=PT_SEPARATE,
                             RELEASE_ONCE=RELEASE_ONCE, GROUP_LOOP=False,
                             NAMED_BARS=NAMED_BARS, HOST_DESC=HOST_DESC, BLOCK_M=BLOCK_M,
                                     PT_REGS=PT_REGS)
        for it in range(n_masked, n_iters):
            dk, dv = _q_step(it, dk, dv, k_smem, v_smem, ds_smem, q_smem, do_smem, q_ready, do_ready, qdo_empty,
                             ds_full, ds_empty, turn_bars, LSE, Delta, DQacc, dq_desc, dq_smem, stats_smem, pt_smem,
                             qk_scale, seqlen_q, seqlen_k, first_m, kv_rows, it, dq_head0, WG=WG, BLOCK_D=BLOCK_D,
                             NUM_STAGES=NUM_STAGES, CAUSAL=CAUSAL, MASKED=False, DQ_SPLIT=DQ_SPLIT, DQ_TMA=DQ_TMA,
                             PINGPONG=PINGPONG, STATS_SMEM=STATS_SMEM, PT_SEPARATE=PT_SEPARATE,
                             RELEASE_ONCE=RELEASE_ONCE, GROUP_LOOP=False,
                             NAMED_BARS=NAMED_BARS, HOST_DESC=HOST_DESC, BLOCK_M=BLOCK_M,
                                     PT_REGS=PT_REGS)
        if DQ_TMA:
            tma.store_wait(0)  # the last reduce has read its tile before the program's shared memory is released
    dk = dk * softmax_scale
    out_dtype: gl.constexpr = DK.dtype.element_ty
    rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, acc_layout))
    mask = gl.expand_dims(rows < seqlen_k, 1)
    if BLOCK_D != HEAD_DIM:
        mask = mask & gl.expand_dims(cols < HEAD_DIM, 0)
    rows64 = rows.to(gl.int64)
    gl.store(DK + gl.expand_dims(rows64 * stride_dkn, 1) + gl.expand_dims(cols, 0), dk.to(out_dtype), mask=mask)
    gl.store(DV + gl.expand_dims(rows64 * stride_dvn, 1) + gl.expand_dims(cols, 0), dv.to(out_dtype), mask=mask)


@gluon.jit(do_not_specialize=["n_heads", "kv_group", "seqlen_q", "seqlen_k", "num_n_tiles", "lpt_heads",
                              "stride_acc_h", "total_q", "total_k"])
def fa3_gluon_bwd_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV, DQacc, CuQ, CuK,
    # HOST_DESC: descriptors over Q, K, V, DO (B, H, N, d), the flat statistics and DQacc (B * Hq, rows, BLOCK_D);
    # otherwise None
    QDesc, KDesc, VDesc, DODesc, StatsDesc, DQDesc,
    qk_scale,  # softmax_scale * log2(e), any sign
    softmax_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_acc_h,  # elements per (batch, q head) of DQacc: Nq rounded up to a multiple of BLOCK_M, times BLOCK_D
    n_heads, kv_group, seqlen_q, seqlen_k, num_n_tiles, lpt_heads, total_q, total_k,
    HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    GQA_PARTIAL: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, DQ_SPLIT: gl.constexpr,
    DQ_TMA: gl.constexpr, PINGPONG: gl.constexpr, STATS_SMEM: gl.constexpr, DQ_SWIZZLE32: gl.constexpr,
    PT_SEPARATE: gl.constexpr, RELEASE_ONCE: gl.constexpr, GROUP_LOOP: gl.constexpr, IS_VARLEN: gl.constexpr,
    NAMED_BARS: gl.constexpr, HOST_DESC: gl.constexpr, BLOCK_M: gl.constexpr, PT_REGS: gl.constexpr,
):
    """1-D grid of B * Hq * cdiv(Nk, 128) programs (``GROUP_LOOP``: B * Hk * cdiv(Nk, 128), each looping over its kv
    head's q heads; requires ``STATS_SMEM``) in ``_kv_tile_of``'s order (groups of ``lpt_heads`` units).  LSE and Delta
    are (B, Hq, Nq) fp32 contiguous, DQacc the zeroed (B * Hq, Nq rounded up to a multiple of BLOCK_M, BLOCK_D) fp32
    accumulator.  DK, DV are indexed by the q head when ``GQA_PARTIAL`` (fp32 partials), else by its kv head.
    ``HEAD_DIM`` is d, ``BLOCK_D`` the power of two >= max(d, 16); ``DQ_SPLIT``, ``DQ_TMA``, ``STATS_SMEM``,
    ``DQ_SWIZZLE32``, ``PT_SEPARATE``, ``RELEASE_ONCE`` as in the module's docstring (``STATS_SMEM``: LSE is the
    (B * Hq, 2, Nq rounded up to a multiple of BLOCK_M) fp32 buffer of ``stats_preprocess_kernel``, Delta unread).
    ``IS_VARLEN`` (a packed batch; needs ``STATS_SMEM``, not ``GROUP_LOOP``): B is the number of sequences, the tensors
    are (1, H, total, d) views, ``seqlen_q`` / ``seqlen_k`` the longest sequence's lengths, sequence b's rows [CuQ[b], CuQ[b + 1]) and
    [CuK[b], CuK[b + 1]) (clamped: ``_seq_range``), its statistics and accumulator rows at ``VARLEN_PAD``-padded
    offsets of each head's ``stride_acc_h / BLOCK_D`` rows.  ``total_q`` / ``total_k`` are read only then.
    ``BLOCK_M``: q rows per step, 64, or 128 (FA3's d = 64 tiles: Sᵀ / dPᵀ 64 x 128 per warpgroup, dQ split by rows;
    with ``DQ_SPLIT``, BLOCK_D <= 64, fixed length, no ``HOST_DESC``: DQacc and the statistics padded to 128 rows).
    ``PT_REGS``: Pᵀ the dV GEMM's register operand, no Pᵀ tiles (FA3's Mma_dKV_is_RS; not with ``PT_SEPARATE``).
    Launch with ``num_warps=4``."""
    gl.static_assert(HEAD_DIM % 8 == 0)  # TMA: 16-byte row strides and box width
    gl.static_assert(BLOCK_D >= HEAD_DIM)
    gl.static_assert(BLOCK_D >= 16)
    gl.static_assert(BLOCK_D <= 128)  # dK and dV halves: 2 x BLOCK_D / 2 fp32 registers per consumer thread
    # a slot is refilled only after both consumers release it: one slot would serialise load and compute
    gl.static_assert(NUM_STAGES >= 2)
    gl.static_assert(BLOCK_M == 64 or BLOCK_M == 128)
    # 128 q rows: Sᵀ, dPᵀ 64 fp32 registers each beside dK, dV (BLOCK_D / 2 each): only up to 64 columns
    gl.static_assert(BLOCK_M == 64 or (DQ_SPLIT and BLOCK_D <= 64 and not IS_VARLEN))
    dtype: gl.constexpr = Q.dtype.element_ty
    bh, tile = _kv_tile_of(gl.program_id(0), num_n_tiles, lpt_heads)
    if GROUP_LOOP:
        # one program per (batch, kv head, kv tile), looping over the kv head's kv_group q heads: dK, dV summed
        # in registers (no fp32 partials per q head); bh is the group's first (batch, q head)
        gl.static_assert(STATS_SMEM and not GQA_PARTIAL)
        n_kv_heads = n_heads // kv_group
        off_b = (bh // n_kv_heads).to(gl.int64)
        off_hk = (bh % n_kv_heads).to(gl.int64)
        off_h = off_hk * kv_group
        bh = (off_b * n_heads + off_h).to(gl.int32)
    else:
        off_b = (bh // n_heads).to(gl.int64)
        off_h = (bh % n_heads).to(gl.int64)
        off_hk = off_h // kv_group
    start_n = tile * 128
    gl.static_assert(not IS_VARLEN or (STATS_SMEM and not GROUP_LOOP))
    q_start, k_start, row0, seqlen_q, seqlen_k = _program_rows(CuQ, CuK, off_b, total_q, total_k, seqlen_q, seqlen_k,
                                                               IS_VARLEN=IS_VARLEN)
    if IS_VARLEN:
        if start_n >= seqlen_k:  # the grid spans the longest sequence's kv tiles: past this one's keys, no work
            return

    first_m, n_iters, n_masked = _q_tiles(start_n, seqlen_q, seqlen_k, BLOCK_N=128, CAUSAL=CAUSAL, BLOCK_M=BLOCK_M)

    box_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_D], dtype)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_M], dtype)
    # DQ_SPLIT at BLOCK_M 64: warpgroup w reads K's columns [w, w + 1) * BLOCK_D / 2, so K is swizzled in
    # half-rows (128 B at d = 128, the default; 64 B at d = 64) and each slice starts on a swizzle atom
    gl.static_assert(not DQ_SPLIT or BLOCK_D == 64 or BLOCK_D == 128)
    if DQ_SPLIT and BLOCK_M == 64:
        k_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=BLOCK_D * dtype.primitive_bitwidth // 16,
                                                      element_bitwidth=dtype.primitive_bitwidth, rank=2)
    else:
        k_layout: gl.constexpr = box_layout
    k_smem = gl.allocate_shared_memory(dtype, [2, 64, BLOCK_D], k_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, 64, BLOCK_D], box_layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_D], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_D], q_layout)
    NDS: gl.constexpr = 2 if DQ_SPLIT else 1  # dSᵀ buffers per warpgroup
    # dSᵀ of warpgroup w in buffer b at 2 b + w, its Pᵀ at 2 NDS + w (PT_SEPARATE: at w of pt_smem)
    gl.static_assert(not (PT_REGS and PT_SEPARATE))
    if PT_REGS:
        ds_smem = gl.allocate_shared_memory(dtype, [2 * NDS, 64, BLOCK_M], ds_layout)
        pt_smem = ds_smem  # unread: Pᵀ is a register operand
    elif PT_SEPARATE:
        # Pᵀ in its own allocation: Triton's barrier analysis (per allocation) then needs no bar.sync between the
        # dV GEMM's read of Pᵀ and the dSᵀ store
        ds_smem = gl.allocate_shared_memory(dtype, [2 * NDS, 64, BLOCK_M], ds_layout)
        pt_smem = gl.allocate_shared_memory(dtype, [2, 64, BLOCK_M], ds_layout)
    else:
        ds_smem = gl.allocate_shared_memory(dtype, [2 * NDS + 2, 64, BLOCK_M], ds_layout)
        pt_smem = ds_smem  # unread
    if DQ_TMA:
        # one fp32 tile per warpgroup: its 64 x (BLOCK_D / 2 split by columns, else BLOCK_D) dQ part, bulk
        # reduce-added
        gl.static_assert(DQ_SPLIT or BLOCK_D <= 64)  # d = 128 unsplit: two 32 KB tiles do not fit beside the ring
        DQN: gl.constexpr = BLOCK_D // 2 if DQ_SPLIT and BLOCK_M == 64 else BLOCK_D
        if DQ_SWIZZLE32:
            # 32-byte swizzle atoms: a half-warp's 8-byte accumulator stores (4 rows x 32 bytes) hit 32 distinct
            # banks, where the 128-byte swizzle maps rows r and r ^ 1 onto the same ones (2-way conflicts); the
            # bulk reduce is then 8-column boxes, one per atom (Triton splits it, spread over the 4 warps)
            dq_layout_s: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=32, rank=2)
        else:
            dq_layout_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, DQN], gl.float32)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, 64, DQN], dq_layout_s)
    else:
        dq_smem = ds_smem  # unread: warp_specialize's arguments must be IR values
    if STATS_SMEM:
        # per ring slot the q tile's log2-scaled LSE and D rows, two BLOCK_M-float TMA boxes (unswizzled: rows dense)
        stats_smem = gl.allocate_shared_memory(gl.float32, [2 * NUM_STAGES, BLOCK_M],
                                               gl.NVMMASharedLayout.get_default_for([BLOCK_M], gl.float32))
    else:
        stats_smem = ds_smem  # unread
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # PINGPONG: one per consumer
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(2):  # DQ_SPLIT: each warpgroup arrives once per use of a dSᵀ buffer
        mbarrier.init(ds_full.index(i), count=2)
        mbarrier.init(ds_empty.index(i), count=2)
        mbarrier.init(turn_bars.index(i), count=1)  # PINGPONG: the other warpgroup's pass
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(qdo_empty.index(i), count=2)  # one arrival per consumer warpgroup

    q_base, do_base, k_base, v_base, dk_base, dv_base, acc_base, acc_rows, stats_base = _program_bases(
        Q, DO, K, V, DK, DV, DQacc, LSE, stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
        stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_dkb, stride_dkh, stride_dkn,
        stride_dvb, stride_dvh, stride_dvn, stride_acc_h, off_b, off_h, off_hk, bh, q_start, k_start, row0, seqlen_q,
        BLOCK_D=BLOCK_D, GQA_PARTIAL=GQA_PARTIAL, IS_VARLEN=IS_VARLEN)
    if IS_VARLEN:
        lse_base = LSE  # unread (STATS_SMEM)
        delta_base = Delta
    else:
        lse_base = LSE + bh.to(gl.int64) * seqlen_q
        delta_base = Delta + bh.to(gl.int64) * seqlen_q
    gl.static_assert(NUM_STAGES <= 4 or not NAMED_BARS)  # ring release barriers 5-8
    gl.static_assert(not (RELEASE_ONCE and NAMED_BARS))
    gl.static_assert(not (HOST_DESC and IS_VARLEN))  # packed batches build per-sequence descriptors
    if HOST_DESC:
        dq_head0 = bh
    else:
        dq_head0 = 0
    if RELEASE_ONCE:
        # with dQ split and 2 stages, step it's ring slot and dSᵀ buffer are both it % 2, released by both consumers
        # after the same wait with the same phase: the producer waits on ds_empty, one arrive (2 bar.sync) fewer
        gl.static_assert(DQ_SPLIT and NUM_STAGES == 2)
        slot_free = ds_empty
    else:
        slot_free = qdo_empty
    # constexprs keep their kind only in tuples written in the call: each consumer's tuple spelled out with its WG
    gl.warp_specialize([
        (_consumer, (dk_base, dv_base, lse_base, delta_base, acc_base, k_smem, v_smem, q_smem, do_smem, ds_smem,
         dq_smem, stats_smem, pt_smem, kv_bar, q_ready, do_ready, qdo_empty, ds_full, ds_empty, turn_bars, qk_scale,
         softmax_scale, stride_dkn, stride_dvn, seqlen_q, seqlen_k, acc_rows, start_n, first_m, n_masked, n_iters,
         kv_group, stride_acc_h, 0, HEAD_DIM, BLOCK_D, NUM_STAGES, CAUSAL, DQ_SPLIT, DQ_TMA, PINGPONG, STATS_SMEM,
         PT_SEPARATE, RELEASE_ONCE, GROUP_LOOP, NAMED_BARS, DQDesc, dq_head0, HOST_DESC, BLOCK_M, PT_REGS)),
        (_consumer, (dk_base, dv_base, lse_base, delta_base, acc_base, k_smem, v_smem, q_smem, do_smem, ds_smem,
         dq_smem, stats_smem, pt_smem, kv_bar, q_ready, do_ready, qdo_empty, ds_full, ds_empty, turn_bars, qk_scale,
         softmax_scale, stride_dkn, stride_dvn, seqlen_q, seqlen_k, acc_rows, start_n, first_m, n_masked, n_iters,
         kv_group, stride_acc_h, 1, HEAD_DIM, BLOCK_D, NUM_STAGES, CAUSAL, DQ_SPLIT, DQ_TMA, PINGPONG, STATS_SMEM,
         PT_SEPARATE, RELEASE_ONCE, GROUP_LOOP, NAMED_BARS, DQDesc, dq_head0, HOST_DESC, BLOCK_M, PT_REGS)),
        (_producer, (q_base, k_base, v_base, do_base, stats_base, k_smem, v_smem, q_smem, do_smem, stats_smem, kv_bar,
         q_ready, do_ready, slot_free, stride_qm, stride_kn, stride_vn, stride_dom, seqlen_q, seqlen_k, acc_rows,
         start_n, first_m, n_iters, kv_group, stride_qh, stride_doh, HEAD_DIM, BLOCK_D, NUM_STAGES, STATS_SMEM,
         GROUP_LOOP, NAMED_BARS, QDesc, KDesc, VDesc, DODesc, StatsDesc, off_b, off_h, off_hk, bh, HOST_DESC,
         BLOCK_M)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


@triton.jit(do_not_specialize=["stride_acc_h", "seqlen_q", "num_tiles", "total_q"])
def dq_postprocess_kernel(
    DQacc, DQ, CuQ, scale,
    stride_acc_h, stride_acc_m, stride_dqb, stride_dqh, stride_dqm,
    n_heads, seqlen_q, num_tiles, total_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """dQ = scale * accumulator, cast to dQ's dtype.  1-D grid of B * Hq * ``num_tiles`` programs of ``BLOCK``
    rows; the accumulator is (B * Hq, rows >= Nq, BLOCK_D) fp32, dQ (B, Hq, Nq, HEAD_DIM), unit stride on d.
    ``IS_VARLEN``: B sequences of a packed batch (``seqlen_q`` the longest), dQ a (1, Hq, total_q, d) view, the
    accumulator (Hq, ``varlen_rows``, BLOCK_D) with sequence b's rows at its padded offset (the Gluon kernel's)."""
    pid = tl.program_id(0)
    bh = pid // num_tiles
    rows = (pid % num_tiles) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK_D)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    if IS_VARLEN:
        start, seqlen_q, row0 = _seq_range_tl(CuQ, b, total_q, seqlen_q)
        acc_tile = DQacc + h * stride_acc_h + row0 * stride_acc_m
        dq_tile = DQ + h * stride_dqh + start.to(tl.int64) * stride_dqm
    else:
        acc_tile = DQacc + bh.to(tl.int64) * stride_acc_h
        dq_tile = DQ + b * stride_dqb + h * stride_dqh
    row_ok = rows < seqlen_q
    rows64 = rows.to(tl.int64)  # Nq * BLOCK_D passes 2^31 from Nq = 2^24 at BLOCK_D = 128
    acc = tl.load(acc_tile + rows64[:, None] * stride_acc_m + cols[None, :], mask=row_ok[:, None], other=0.0)
    ptrs = dq_tile + rows64[:, None] * stride_dqm + cols[None, :]
    tl.store(ptrs, (acc * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & (cols < HEAD_DIM)[None, :])


@triton.jit(do_not_specialize=["n_bh", "seqlen_q", "stats_rows", "total_q"])
def stats_preprocess_kernel(
    Out, DOut, LSE, Stats, DQacc, CuQ,
    stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom, stride_lb, stride_lh, stride_lm,
    n_heads, n_bh, seqlen_q, stats_rows, total_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, ZERO_ACC: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """The Gluon backward's row statistics for ``STATS_SMEM``: Stats (B * Hq, 2, ``stats_rows``) fp32, row 0 the
    LSE times log2(e) (+inf past Nq and where LSE is -inf, so P = exp2(S log2e - it) is 0 there unmasked), row 1
    D = rowsum(dO o O) (0 past Nq).  ``stats_rows`` is Nq rounded up to a multiple of 64 (whole TMA boxes; the host
    pads to 128), a multiple of ``BLOCK``; grid ``fold_grid(stats_rows // BLOCK, n_bh)``.  O, dO (B, Hq, Nq, HEAD_DIM)
    with unit stride on d; LSE (B, Hq, Nq) fp32, any strides.  ``ZERO_ACC``: also zero this block of rows of DQacc,
    the backward's (B * Hq, ``stats_rows``, BLOCK_D) fp32 accumulator (one launch fewer than a separate memset).
    ``IS_VARLEN``: B sequences of a packed batch (``seqlen_q`` the longest), O, dO (1, Hq, total_q, d) views, LSE (Hq,
    total_q) as (1, Hq, total_q); Stats (Hq, 2 * ``stats_rows``) and DQacc (Hq, ``stats_rows``, BLOCK_D) with
    ``stats_rows`` = ``varlen_rows``: sequence b's [2, its rows rounded up to 64] block at its padded offset."""
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tile, bh = unfold_pid()
    if bh >= n_bh:
        return
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    rows = tile * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK_D)
    rows64 = rows.to(tl.int64)
    if IS_VARLEN:
        start, seqlen_q, row0 = _seq_range_tl(CuQ, b, total_q, seqlen_q)
        padded = (seqlen_q + 63) // 64 * 64  # this sequence's rows of the kernel's boxes
        if tile * BLOCK >= padded:
            return
        o_tile = Out + h * stride_oh + start.to(tl.int64) * stride_om
        do_tile = DOut + h * stride_doh + start.to(tl.int64) * stride_dom
        lse_tile = LSE + h * stride_lh + start.to(tl.int64) * stride_lm
        base = Stats + h * (2 * stats_rows) + 2 * row0
        d_rows = padded
        acc_tile = DQacc + (h * stats_rows + row0) * BLOCK_D
    else:
        o_tile = Out + b * stride_ob + h * stride_oh
        do_tile = DOut + b * stride_dob + h * stride_doh
        lse_tile = LSE + b * stride_lb + h * stride_lh
        base = Stats + bh.to(tl.int64) * (2 * stats_rows)
        d_rows = stats_rows
        acc_tile = DQacc + bh.to(tl.int64) * stats_rows * BLOCK_D
    in_q = rows < seqlen_q
    mask = in_q[:, None] & (cols < HEAD_DIM)[None, :]
    o = tl.load(o_tile + rows64[:, None] * stride_om + cols[None, :], mask=mask, other=0.0)
    do = tl.load(do_tile + rows64[:, None] * stride_dom + cols[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    lse = tl.load(lse_tile + rows64 * stride_lm, mask=in_q, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse.to(tl.float32) * _LOG2E)
    tl.store(base + rows, lse2)
    tl.store(base + d_rows + rows, delta)
    if ZERO_ACC:
        tl.store(acc_tile + rows64[:, None] * BLOCK_D + cols[None, :], tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32))
