"""Hopper (sm_90a) attention forward in Gluon: the FA3 schedules Triton 3.6's automatic warp specialisation
cannot express (FA3, Shah et al. 2024, §3.1 ping-pong, §3.2 intra-warpgroup overlap).

One program owns a query tile of ``NUM_WG * WG_M`` rows (NUM_WG = 2 or 3) of one (batch, head) pair and runs
``NUM_WG + 1`` partitions (``gl.warp_specialize``):

* a producer (1 warp) issuing the TMA loads: Q once, then K_j and V_j into a ``NUM_STAGES``-deep ring,
  each slot guarded by ``k_ready`` / ``v_ready`` (tx-count mbarriers) and ``kv_empty`` (2 * NUM_STAGES
  barriers: entry ``slot`` frees the slot's K tile, every consumer arriving once its S GEMM has retired, entry
  ``NUM_STAGES + slot`` its V tile, after the P V GEMM; so K_{j+2} loads while V_j is still read; with
  ``NAMED_RELEASE`` hardware named barriers 5 + entry instead, ``_release`` / ``_acquire``);
* ``NUM_WG`` consumer warpgroups (the default partition and 4-warp workers), each owning ``WG_M`` = 64 rows of
  the tile, running the online softmax (base 2, ``scale * log2 e`` folded into the exp2 argument, the
  division deferred to the end, LSE in natural log; rows that see no key: output 0, LSE -inf).

Schedules, each a constexpr so an ablation can switch it off:

* ``INTRA`` (intra-warpgroup overlap): iteration j issues S_j = Q K_jᵀ and O += P_{j-1} V_{j-1} as async
  wgmma, waits for S_j only, runs the softmax of S_j while the P V GEMM runs, then waits for it and
  rescales O; 0, both GEMMs are waited for before the softmax.  1 leaves the wait's place to ptxas, which
  hoists it above straight-line code towards S's wait (sm_90a SASS: after 0-4 of the 66 exp2 of a d = 64 /
  128 iteration, 0 of 34 at d = 192, 5-13 of 34 at d = 256; FP8 d = 128: 0); 2 runs the softmax as a block
  of its own (a branch on ``qk_scale >= 0``, never false), which keeps the wait after its last exp2;
* ``PINGPONG``: the consumers take turns issuing their GEMMs, round robin (one count-1 mbarrier each,
  a consumer arrives on the next one's after issuing; 2: a named barrier each, ``_named_bar``), so one
  warpgroup's softmax runs while another's GEMMs occupy the tensor cores.
* ``SKIP_MASK0``: tile 0 (the pipeline's prologue) runs unmasked when every row of the program sees it all.
* ``PACK_P`` (16-bit): P rounded in pairs by one opaque ``cvt.rn.bf16x2.f32`` / ``f16x2`` each, the same rounding
  as ``p.to``; LLVM folds ``p.to`` through the loop's phi, carrying P in fp32 and rounding and re-pairing it
  (PRMT) between the S and the P V GEMM issues.

Head-dim split: the head dim is tiled as ``BLOCK_D0`` columns and, when ``BLOCK_D1 > 0``, a second part of
``BLOCK_D1`` columns starting at ``BLOCK_D0`` (both powers of two, e.g. d = 96 as 64 + 32), so a head dim
that is not a power of two does not pay for a ``next_pow2(d)``-wide tile: Q, K, V each land in two shared
tiles, S = Q0 K0ᵀ + Q1 K1ᵀ (two chained async wgmmas) and O is two accumulators, O_i += P V_i.

Causal (bottom-right) and ragged Nk: the kv tiles every row of the program sees in full run an unmasked
loop, the tiles crossed by the diagonal or the end of K a masked one.  Ragged Nq / Nk and columns past d:
per-head device-side tensor descriptors of the (N, d) head zero-fill loads past the head's end and past d;
the output goes out through masked stores (``O_STORE`` 0: from the wgmma layout, 1: through a
row-contiguous layout) or a TMA store staged in the warpgroup's Q rows (2).  The host launcher is
:mod:`flashtile.runtime.fa3_gluon`; descriptors need ``triton.set_allocator``.  ``HOST_DESC``: rank-4
descriptors over the (B, H, N, d) tensors come from the host as kernel parameters instead (coordinates
(b, h, row, column): the same zero fill past each head's N and past d), nothing is built in the kernel.

Persistent (``PERSISTENT``): min(tiles, SMs) programs, program p running tiles p, p + P, ... of the same tile
order (static round robin; causal: over the last-first / ``LPT_GROUP`` order), so a program's prologue
(barriers, setmaxnreg) is paid once and tile t's epilogue (O / LSE stores) overlaps the loads of tile t + 1.
Ring slots and parities follow a running kv-iteration count, the Q barrier's parity a running count of
tiles with work, the ping-pong turns run on; a ``q_empty`` barrier (one arrival per consumer: done with Q
and with the tile's last K / V load; with ``O_STORE`` 2 after its O store) gates the next tile's Q load and
(without ``HOST_DESC``) descriptor rebuild.  Tiles that see no key (causal, Nq > Nk) load nothing and store O = 0,
LSE = -inf.
``DYNAMIC`` (persistent only): program p runs tile p, then the tiles its producer claims (``P +
atomic_add(tile_counter, 1)``, the counter zeroed by the caller per launch) in the same order, each claim
handed to the consumers through a two-slot shared-memory ring (``_ring_put`` / ``_ring_get``); a claim past
the last tile stops both sides.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from flashtile.kernels._common import LN2
# @triton.jit helpers of scalar ops: Gluon code generates them as its own (the same PTX as a Gluon copy)
from flashtile.kernels.fa3_fwd import ERR_DESCALE, _descales, _descales_ok, _packed_slot

__all__ = ["fa3_gluon_kernel", "packed_range", "WG_M"]

WG_M = 64  # query rows per consumer warpgroup (wgmma M = 16 per warp x 4 warps)
_LN2 = gl.constexpr(LN2)
_P_OCTAVES = gl.constexpr(8.0)  # FP8: P~ = 2^8 exp(S - m), as kernels/fa3_fwd.py and reference/fp8.py
_ERR_DESCALE = gl.constexpr(ERR_DESCALE)


@gluon.jit
def packed_range(Cu, b, total, max_len):
    """(start, length) of sequence ``b`` of a packed batch, as :func:`flashtile.kernels.block_info._packed_range`
    gives it: rows [Cu[b], Cu[b + 1]) clamped in int64 to [0, total], the length (int32) capped at ``max_len``,
    so no value of the cu_seqlens reaches outside the packed tensors (values that break the contract give wrong
    rows)."""
    start = gl.minimum(gl.maximum(gl.load(Cu + b).to(gl.int64), 0), total)
    end = gl.minimum(gl.maximum(gl.load(Cu + b + 1).to(gl.int64), start), total)
    return start, gl.minimum(end - start, max_len).to(gl.int32)


@gluon.jit
def _head_desc(X, seqlen, stride, HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, WIDTH: gl.constexpr):
    """Descriptor of one (seqlen, HEAD_DIM) row-major head with ROWS x WIDTH boxes: a box's part past the
    last row or column reads 0 and is dropped when stored."""
    dtype: gl.constexpr = X.dtype.element_ty
    return tma.make_tensor_descriptor(X, [seqlen, HEAD_DIM], [stride, 1], [ROWS, WIDTH],
                                      gl.NVMMASharedLayout.get_default_for([ROWS, WIDTH], dtype))


@gluon.constexpr_function
def _same_swizzle(a, b):
    """Whether two NVMMA shared layouts place a tile's bytes alike (leading unit dims aside)."""
    return (a.swizzle_byte_width, a.element_bitwidth, a.transposed) == (b.swizzle_byte_width, b.element_bitwidth,
                                                                       b.transposed)


@gluon.jit
def _unit4(tile):
    """A [ROWS, WIDTH] shared tile as the [1, 1, ROWS, WIDTH] box of a host descriptor over (B, H, N, d): the
    same bytes (leading unit dims), which the descriptor's swizzle must match (Triton does not check it)."""
    view = tile.reshape([1, 1, tile.shape[0], tile.shape[1]])
    return view


@gluon.jit
def _load(src, row, bar, tiles, idx, pred, BLOCK_D0: gl.constexpr, BLOCK_D1: gl.constexpr,
          HOST_DESC: gl.constexpr):
    """TMA copies of rows [row, + box) into ``tiles[i].index(idx)``: columns [0, BLOCK_D0) and, when split,
    [BLOCK_D0, BLOCK_D0 + BLOCK_D1), both counted on ``bar``.  ``src``: (desc0, desc1) of one head, or with
    ``HOST_DESC`` (desc0, desc1, b, h) of the (B, H, N, d) tensor and the head's coordinates."""
    if HOST_DESC:
        gl.static_assert(_same_swizzle(src[0].layout, tiles[0].layout))
        tma.async_copy_global_to_shared(src[0], [src[2], src[3], row, 0], bar, _unit4(tiles[0].index(idx)),
                                        pred=pred)
        if BLOCK_D1 > 0:
            gl.static_assert(_same_swizzle(src[1].layout, tiles[1].layout))
            tma.async_copy_global_to_shared(src[1], [src[2], src[3], row, BLOCK_D0], bar,
                                            _unit4(tiles[1].index(idx)), pred=pred)
    else:
        tma.async_copy_global_to_shared(src[0], [row, 0], bar, tiles[0].index(idx), pred=pred)
        if BLOCK_D1 > 0:
            tma.async_copy_global_to_shared(src[1], [row, BLOCK_D0], bar, tiles[1].index(idx), pred=pred)


@gluon.jit
def _tile_coords(tile_id, total_tiles, n_heads, kv_group, num_m_tiles, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, LPT_GROUP: gl.constexpr):
    """(bh, off_b, off_h, off_hk, start_m, full_tiles, n_tiles) of tile ``tile_id`` of ``total_tiles`` =
    B * Hq * num_m_tiles: the query tiles of one (batch, head) pair ``bh`` adjacent (they share its K and V
    in L2); causal runs each head's tiles last-first, the longest rows first, or with ``LPT_GROUP`` > 0 the
    longest tiles of each group of that many heads first.  Kv tiles [0, full_tiles) are seen in full by
    every row of the tile, [full_tiles, n_tiles) masked; n_tiles = 0 when no row sees a key.  Batch, query
    head and kv head (``off_*``) are int64 (offsets into multi-GB tensors)."""
    bh = tile_id // num_m_tiles
    tile = tile_id % num_m_tiles
    if CAUSAL:
        if LPT_GROUP > 0:
            # groups of LPT_GROUP heads; inside a group the longest tiles of all its heads first, so the
            # CTAs in flight share a few heads' K and V in L2 and the short tiles fill the tail
            per_group = LPT_GROUP * num_m_tiles
            group = tile_id // per_group
            r = tile_id % per_group
            heads = gl.minimum(LPT_GROUP, total_tiles // num_m_tiles - group * LPT_GROUP)
            bh = group * LPT_GROUP + r % heads
            tile = num_m_tiles - 1 - r // heads
        else:
            tile = num_m_tiles - 1 - tile
    off_b = (bh // n_heads).to(gl.int64)
    off_h = (bh % n_heads).to(gl.int64)
    off_hk = off_h // kv_group
    start_m = tile * BLOCK_M
    full_tiles, n_tiles = _kv_tiles(start_m, seqlen_q, seqlen_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)
    return bh, off_b, off_h, off_hk, start_m, full_tiles, n_tiles


@gluon.jit
def _kv_tiles(start_m, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(full_tiles, n_tiles) of the query tile at ``start_m``: kv tiles [0, full_tiles) seen in full by every
    row, [full_tiles, n_tiles) masked; n_tiles = 0 when no row sees a key."""
    if CAUSAL:
        key_end = gl.minimum(seqlen_k, start_m + BLOCK_M + seqlen_k - seqlen_q)  # last row's key bound
        full_end = gl.minimum(seqlen_k, start_m + 1 + seqlen_k - seqlen_q)  # first row's key bound
    else:
        key_end = seqlen_k
        full_end = seqlen_k
    n_tiles = gl.cdiv(gl.maximum(key_end, 0), BLOCK_N)
    full_tiles = gl.maximum(full_end, 0) // BLOCK_N
    return full_tiles, n_tiles


@gluon.jit
def _producer_tile(Q, K, V, q_tiles, k_tiles, v_tiles, q_bar, k_ready, v_ready, kv_empty,
                   stride_qm, stride_kn, stride_vn, seqlen_q, seqlen_k, start_m, n_tiles, it0,
                   HEAD_DIM: gl.constexpr, BLOCK_D0: gl.constexpr, BLOCK_D1: gl.constexpr, NUM_WG: gl.constexpr,
                   BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, HOST_DESC: gl.constexpr,
                   NAMED_RELEASE: gl.constexpr):
    """TMA loads of one tile's Q (one 64-row box per consumer) and of K_j, V_j for j < ``n_tiles`` into ring
    slot (it0 + j) % NUM_STAGES (``it0``: kv iterations of the program's earlier tiles).  Columns past
    HEAD_DIM read 0, as rows past Nq / Nk do.  ``Q``, ``K``, ``V``: the head's base pointers (descriptors
    built here), or with ``HOST_DESC`` (desc0, desc1, b, h) as ``_load`` takes them."""
    if HOST_DESC:
        dtype: gl.constexpr = Q[0].dtype
        q_src = Q
        k_src = K
        v_src = V
    else:
        dtype: gl.constexpr = Q.dtype.element_ty
        q_desc = _head_desc(Q, seqlen_q, stride_qm, HEAD_DIM, 64, BLOCK_D0)
        k_desc = _head_desc(K, seqlen_k, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D0)
        if dtype.primitive_bitwidth == 8:
            # FP8: V stored transposed, (HEAD_DIM, Nk rounded up to 32) rows of stride stride_vn, keys permuted
            # per 32-key chunk (``_p_operand``) and zero past Nk; rows past d read 0
            v_desc = tma.make_tensor_descriptor(V, [HEAD_DIM, gl.cdiv(seqlen_k, 32) * 32], [stride_vn, 1],
                                                [BLOCK_D0, BLOCK_N],
                                                gl.NVMMASharedLayout.get_default_for([BLOCK_D0, BLOCK_N], dtype))
        else:
            v_desc = _head_desc(V, seqlen_k, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D0)
        if BLOCK_D1 > 0:
            q_desc1 = _head_desc(Q, seqlen_q, stride_qm, HEAD_DIM, 64, BLOCK_D1)
            k_desc1 = _head_desc(K, seqlen_k, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D1)
            v_desc1 = _head_desc(V, seqlen_k, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D1)
        else:  # unread
            q_desc1 = q_desc
            k_desc1 = k_desc
            v_desc1 = v_desc
        q_src = (q_desc, q_desc1)
        k_src = (k_desc, k_desc1)
        v_src = (v_desc, v_desc1)
    # a box's transaction bytes count its zero-filled part too
    q_bytes: gl.constexpr = NUM_WG * 64 * (BLOCK_D0 + BLOCK_D1) * dtype.primitive_bitwidth // 8
    kv_bytes: gl.constexpr = BLOCK_N * (BLOCK_D0 + BLOCK_D1) * dtype.primitive_bitwidth // 8
    has_work = n_tiles > 0  # consumers never wait for Q when there is no tile; no copy may outlive them
    mbarrier.expect(q_bar, q_bytes, pred=has_work)
    for w in gl.static_range(NUM_WG):
        # a box wholly past Nq (the last tile's upper warpgroups) re-reads the tile's first rows instead:
        # those rows' outputs are never stored, and no box lies wholly out of bounds
        q_row = start_m + w * 64
        q_row = gl.where(q_row < seqlen_q, q_row, start_m)
        _load(q_src, q_row, q_bar, q_tiles, w, has_work, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1, HOST_DESC=HOST_DESC)
    for j in range(n_tiles):
        it = it0 + j
        slot = it % NUM_STAGES
        # parity of the previous round of this slot; the first round passes on fresh barriers
        phase = ((it // NUM_STAGES) & 1) ^ 1
        _acquire(kv_empty, slot, it, phase, NUM_WG=NUM_WG, NUM_STAGES=NUM_STAGES,
                 NAMED_RELEASE=NAMED_RELEASE)  # K_{j - NUM_STAGES}'s S GEMMs retired
        mbarrier.expect(k_ready.index(slot), kv_bytes)
        _load(k_src, j * BLOCK_N, k_ready.index(slot), k_tiles, slot, True, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1,
              HOST_DESC=HOST_DESC)
        _acquire(kv_empty, NUM_STAGES + slot, it, phase, NUM_WG=NUM_WG, NUM_STAGES=NUM_STAGES,
                 NAMED_RELEASE=NAMED_RELEASE)  # V_{j - NUM_STAGES}'s P V GEMMs retired
        mbarrier.expect(v_ready.index(slot), kv_bytes)
        if dtype.primitive_bitwidth == 8:  # FP8: the (BLOCK_D0, BLOCK_N) tile of V's transpose (unsplit)
            tma.async_copy_global_to_shared(v_src[0], [0, j * BLOCK_N], v_ready.index(slot), v_tiles[0].index(slot))
        else:
            _load(v_src, j * BLOCK_N, v_ready.index(slot), v_tiles, slot, True, BLOCK_D0=BLOCK_D0,
                  BLOCK_D1=BLOCK_D1, HOST_DESC=HOST_DESC)


@gluon.jit
def _producer(Q, K, V, q_tiles, k_tiles, v_tiles, q_bar, k_ready, v_ready, kv_empty,
              stride_qm, stride_kn, stride_vn, seqlen_q, seqlen_k, start_m, n_tiles,
              HEAD_DIM: gl.constexpr, BLOCK_D0: gl.constexpr, BLOCK_D1: gl.constexpr, NUM_WG: gl.constexpr,
              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, HOST_DESC: gl.constexpr,
              NAMED_RELEASE: gl.constexpr):
    """One program, one tile: its loads from ring slot 0 on."""
    _producer_tile(Q, K, V, q_tiles, k_tiles, v_tiles, q_bar, k_ready, v_ready, kv_empty,
                   stride_qm, stride_kn, stride_vn, seqlen_q, seqlen_k, start_m, n_tiles, 0,
                   HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1, NUM_WG=NUM_WG, BLOCK_N=BLOCK_N,
                   NUM_STAGES=NUM_STAGES, HOST_DESC=HOST_DESC, NAMED_RELEASE=NAMED_RELEASE)


@gluon.jit
def _producer_persistent_tile(Q, K, V, q_tiles, k_tiles, v_tiles, q_bar, q_empty, k_ready, v_ready, kv_empty,
                              stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                              stride_vb, stride_vh, stride_vn, n_heads, kv_group, seqlen_q, seqlen_k, num_m_tiles,
                              total_tiles, tile_id, kv_it, q_count, HEAD_DIM: gl.constexpr, BLOCK_D0: gl.constexpr,
                              BLOCK_D1: gl.constexpr, NUM_WG: gl.constexpr, BLOCK_N: gl.constexpr,
                              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, LPT_GROUP: gl.constexpr,
                              HOST_DESC: gl.constexpr, NAMED_RELEASE: gl.constexpr):
    """The loads of tile ``tile_id`` after ``kv_it`` kv iterations and ``q_count`` tiles with work:
    (kv_it, q_count) after it."""
    bh, off_b, off_h, off_hk, start_m, full_tiles, n_tiles = _tile_coords(
        tile_id, total_tiles, n_heads, kv_group, num_m_tiles, seqlen_q, seqlen_k, BLOCK_M=NUM_WG * 64,
        BLOCK_N=BLOCK_N, CAUSAL=CAUSAL, LPT_GROUP=LPT_GROUP)
    if n_tiles > 0:
        # the first tile passes on the fresh barrier
        mbarrier.wait(q_empty, (q_count & 1) ^ 1)
        if HOST_DESC:
            b32 = off_b.to(gl.int32)
            _producer_tile((Q[0], Q[1], b32, off_h.to(gl.int32)), (K[0], K[1], b32, off_hk.to(gl.int32)),
                           (V[0], V[1], b32, off_hk.to(gl.int32)), q_tiles, k_tiles, v_tiles, q_bar,
                           k_ready, v_ready, kv_empty, stride_qm, stride_kn, stride_vn, seqlen_q, seqlen_k,
                           start_m, n_tiles, kv_it, HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1,
                           NUM_WG=NUM_WG, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, HOST_DESC=True,
                           NAMED_RELEASE=NAMED_RELEASE)
        else:
            # invariant: the descriptors (one global scratch slot per call site) are rebuilt only here,
            # after q_empty, when every load issued with the previous ones has completed: each consumer
            # arrives after waiting for the previous tile's Q, last K and last V
            _producer_tile(Q + off_b * stride_qb + off_h * stride_qh,
                           K + off_b * stride_kb + off_hk * stride_kh,
                           V + off_b * stride_vb + off_hk * stride_vh, q_tiles, k_tiles, v_tiles, q_bar,
                           k_ready, v_ready, kv_empty, stride_qm, stride_kn, stride_vn, seqlen_q, seqlen_k,
                           start_m, n_tiles, kv_it, HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1,
                           NUM_WG=NUM_WG, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, HOST_DESC=False,
                           NAMED_RELEASE=NAMED_RELEASE)
    kv_it += n_tiles
    q_count += (n_tiles > 0).to(gl.int32)
    return kv_it, q_count


@gluon.jit
def _ring_put(sched, n, value):
    """Dynamic scheduler: the producer hands the ``n``-th next tile index ``value`` to the consumers through
    slot n % 2 of the ring ``sched`` = (counter, ring, full, empty); the slot's previous value read (every
    consumer arrived on ``empty``; the first round passes on fresh barriers)."""
    slot = n % 2
    mbarrier.wait(sched[3].index(slot), ((n // 2) & 1) ^ 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    sched[1].index(slot).store(gl.full([1], value, gl.int32, layout))
    mbarrier.arrive(sched[2].index(slot))


@gluon.jit
def _ring_get(sched, n):
    """Dynamic scheduler: a consumer's ``n``-th next tile index, from slot n % 2 of the ring, then the slot
    released (one arrival per consumer warpgroup, after the warpgroup's barrier: every warp has read it)."""
    slot = n % 2
    mbarrier.wait(sched[2].index(slot), (n // 2) & 1)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    value = gl.max(sched[1].index(slot).load(layout), axis=0)
    gl.thread_barrier()
    mbarrier.arrive(sched[3].index(slot))
    return value


@gluon.jit
def _producer_persistent(Q, K, V, q_tiles, k_tiles, v_tiles, q_bar, q_empty, k_ready, v_ready, kv_empty, sched,
                         stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                         stride_vb, stride_vh, stride_vn, n_heads, kv_group, seqlen_q, seqlen_k, num_m_tiles,
                         total_tiles, HEAD_DIM: gl.constexpr, BLOCK_D0: gl.constexpr, BLOCK_D1: gl.constexpr,
                         NUM_WG: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                         CAUSAL: gl.constexpr, LPT_GROUP: gl.constexpr, HOST_DESC: gl.constexpr,
                         DYNAMIC: gl.constexpr, NAMED_RELEASE: gl.constexpr):
    """Loads of tiles pid, pid + P, ... (P programs), or with ``DYNAMIC`` of pid, then of the tiles the
    program claims (P + the global counter's old value, in claim order), each claim made once the previous
    tile's loads are issued and handed to the consumers (``_ring_put``; a value >= total_tiles stops both).
    The kv ring index runs on across tiles; a tile's Q waits for ``q_empty`` (every consumer done with the
    previous Q and every K / V load of the previous tile).  Tiles that see no key load nothing (the consumers
    count tiles with work the same way).  ``HOST_DESC``: ``Q``, ``K``, ``V`` are (desc0, desc1) pairs of host
    descriptors, nothing is rebuilt."""
    kv_it = 0  # kv iterations issued so far: ring slot and parity
    q_count = 0  # tiles with work so far: q_empty's parity
    if DYNAMIC:
        tile_id = gl.program_id(0)
        n = 0  # tiles claimed so far: the scheduler ring's slot and parity
        while tile_id < total_tiles:
            kv_it, q_count = _producer_persistent_tile(
                Q, K, V, q_tiles, k_tiles, v_tiles, q_bar, q_empty, k_ready, v_ready, kv_empty,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                n_heads, kv_group, seqlen_q, seqlen_k, num_m_tiles, total_tiles, tile_id, kv_it, q_count,
                HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1, NUM_WG=NUM_WG, BLOCK_N=BLOCK_N,
                NUM_STAGES=NUM_STAGES, CAUSAL=CAUSAL, LPT_GROUP=LPT_GROUP, HOST_DESC=HOST_DESC,
                NAMED_RELEASE=NAMED_RELEASE)
            # the counter counts claims past the first P tiles; relaxed: only its atomicity matters
            tile_id = gl.num_programs(0) + gl.atomic_add(sched[0], 1, sem="relaxed")
            _ring_put(sched, n, tile_id)
            n += 1
    else:
        for tile_id in range(gl.program_id(0), total_tiles, gl.num_programs(0)):
            kv_it, q_count = _producer_persistent_tile(
                Q, K, V, q_tiles, k_tiles, v_tiles, q_bar, q_empty, k_ready, v_ready, kv_empty,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                n_heads, kv_group, seqlen_q, seqlen_k, num_m_tiles, total_tiles, tile_id, kv_it, q_count,
                HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1, NUM_WG=NUM_WG, BLOCK_N=BLOCK_N,
                NUM_STAGES=NUM_STAGES, CAUSAL=CAUSAL, LPT_GROUP=LPT_GROUP, HOST_DESC=HOST_DESC,
                NAMED_RELEASE=NAMED_RELEASE)


# hardware named barriers (``_named_bar``): Triton's warp specialisation takes 0 (default partition), 1 (the whole
# CTA) and 2 + i (worker partition i: up to 4 with three consumers and the producer, whose one warp never uses its
# own); the ring slots' releases from 5 (K, then V: at most 8), the ping-pong turns from 13 (at most 3)
_RING_BAR0 = gl.constexpr(5)
_TURN_BAR0 = gl.constexpr(13)


@gluon.jit
def _named_bar(ARRIVE: gl.constexpr, bar_id, threads):
    """``bar.arrive`` (``ARRIVE``, no wait) or ``bar.sync`` on hardware barrier ``bar_id`` by every thread of the
    calling partition, the barrier completing once ``threads`` threads have arrived (FA3's named barriers): no
    shared memory, so none of the warpgroup ``bar.sync`` Triton puts before an mbarrier arrive."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    ids = gl.full([32 * gl.num_warps()], bar_id, gl.int32, layout)
    counts = gl.full([32 * gl.num_warps()], threads, gl.int32, layout)
    if ARRIVE:
        gl.inline_asm_elementwise("mov.u32 $0, $1;\nbar.arrive $1, $2;", "=r,r,r", [ids, counts], dtype=gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("mov.u32 $0, $1;\nbar.sync $1, $2;", "=r,r,r", [ids, counts], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _release(kv_empty, index, NUM_WG: gl.constexpr, NAMED_RELEASE: gl.constexpr):
    """A consumer warpgroup done with ring entry ``index`` (slot s: K, NUM_STAGES + s: V): an mbarrier arrival, or
    with ``NAMED_RELEASE`` a named-barrier arrival the producer's ``_acquire`` completes."""
    if NAMED_RELEASE:
        _named_bar(True, _RING_BAR0 + index, 32 + 128 * NUM_WG)
    else:
        mbarrier.arrive(kv_empty.index(index))


@gluon.jit
def _acquire(kv_empty, index, it, phase, NUM_WG: gl.constexpr, NUM_STAGES: gl.constexpr,
             NAMED_RELEASE: gl.constexpr):
    """The producer's wait for ring entry ``index`` of kv iteration ``it`` to be free (every consumer released the
    previous round's; the first round passes): mbarrier parity ``phase``, or the named barrier of ``_release``
    (the one warp of the producer plus the consumers' 128 threads each)."""
    if NAMED_RELEASE:
        if it >= NUM_STAGES:
            _named_bar(False, _RING_BAR0 + index, 32 + 128 * NUM_WG)
    else:
        mbarrier.wait(kv_empty.index(index), phase)


@gluon.jit
def _turn_wait(turn_bars, turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: wait until it is this warpgroup's turn to issue GEMMs (its ``turn``-th turn).  Turns go
    round the consumers in order; warpgroup 0 goes first: its turn 0 waits for parity 1, which a fresh
    barrier reports complete, every other warpgroup's turn t for phase t of its barrier.  ``PINGPONG`` 2: the
    turns on named barriers (``_named_bar``, the waiter's 128 threads and the passer's; warpgroup 0's turn 0
    does not wait, and the last pass of a program is left unmatched at its exit)."""
    if PINGPONG == 2:
        if WG == 0:
            if turn > 0:
                _named_bar(False, _TURN_BAR0 + WG, 256)
        else:
            _named_bar(False, _TURN_BAR0 + WG, 256)
    elif PINGPONG:
        if WG == 0:
            mbarrier.wait(turn_bars.index(WG), (turn + 1) & 1)
        else:
            mbarrier.wait(turn_bars.index(WG), turn & 1)
    return turn + 1


@gluon.jit
def _turn_pass(turn_bars, WG: gl.constexpr, NUM_WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: GEMMs issued, the next warpgroup's turn."""
    if PINGPONG == 2:
        _named_bar(True, _TURN_BAR0 + (WG + 1) % NUM_WG, 256)
    elif PINGPONG:
        mbarrier.arrive(turn_bars.index((WG + 1) % NUM_WG))


@gluon.jit
def _qk(q_wg, k_tiles, slot, s_zero, BLOCK_D1: gl.constexpr):
    """S = Q0 K0ᵀ (+ Q1 K1ᵀ when split) of ring slot ``slot``, async: one wgmma commit group per part, the
    second accumulating on the first."""
    s = warpgroup_mma(q_wg[0], k_tiles[0].index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if BLOCK_D1 > 0:
        s = warpgroup_mma(q_wg[1], k_tiles[1].index(slot).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _pv(p, v_tiles, slot, acc0, acc1, BLOCK_D1: gl.constexpr):
    """O_i += P V_i of ring slot ``slot``, async: one wgmma commit group per part.  FP8 (8-bit tiles): ``p`` is
    fp32 in the operand's layout, rounded here (``_p_operand``); the slot holds Vᵀ, (width, BLOCK_N), read as
    the k-major B operand that fp8 wgmma needs (unsplit)."""
    if v_tiles[0].dtype.primitive_bitwidth == 8:
        acc0 = warpgroup_mma(p.to(v_tiles[0].dtype), v_tiles[0].index(slot).permute((1, 0)), acc0, is_async=True)
    else:
        acc0 = warpgroup_mma(p, v_tiles[0].index(slot), acc0, is_async=True)
    if BLOCK_D1 > 0:
        acc1 = warpgroup_mma(p, v_tiles[1].index(slot), acc1, is_async=True)
    return acc0, acc1


@gluon.jit
def _wait_pv(acc0, acc1, p, BLOCK_D1: gl.constexpr):
    """Every wgmma retired; O and P (read by the P V GEMMs from registers, kept alive until here) back.  FP8
    carries P in fp32 (``_p_operand``): its 8-bit operand could not pass through the wait (Triton 3.6 lowers
    16- to 64-bit values only), and ptxas keeps a wgmma's input registers until its wait_group (none of the
    kernel's compiles reports serialised wgmmas)."""
    if p.dtype == gl.float32:
        if BLOCK_D1 > 0:
            acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
        else:
            acc0 = warpgroup_mma_wait(0, deps=(acc0,))
    elif BLOCK_D1 > 0:
        acc0, acc1, p = warpgroup_mma_wait(0, deps=(acc0, acc1, p))
    else:
        acc0, p = warpgroup_mma_wait(0, deps=(acc0, p))
    return acc0, acc1, p


@gluon.jit
def _wait_s(s, acc0, acc1, p, BLOCK_D1: gl.constexpr, INTRA: gl.constexpr):
    """S back in registers: with ``INTRA`` only S (groups retire in order: the P V groups issued after it
    may still run), otherwise every group (FP8's fp32 P as in :func:`_wait_pv`)."""
    if INTRA:
        if BLOCK_D1 > 0:
            s = warpgroup_mma_wait(2, deps=(s,))
        else:
            s = warpgroup_mma_wait(1, deps=(s,))
    elif p.dtype == gl.float32:
        if BLOCK_D1 > 0:
            s, acc0, acc1 = warpgroup_mma_wait(0, deps=(s, acc0, acc1))
        else:
            s, acc0 = warpgroup_mma_wait(0, deps=(s, acc0))
    else:
        if BLOCK_D1 > 0:
            s, acc0, acc1, p = warpgroup_mma_wait(0, deps=(s, acc0, acc1, p))
        else:
            s, acc0, p = warpgroup_mma_wait(0, deps=(s, acc0, p))
    return s, acc0, acc1, p


@gluon.jit
def _p_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr, PACK: gl.constexpr = False):
    """P (``p``, fp32 in S's wgmma layout) as the A operand of the P V GEMMs in ``dtype``, their input dtype.
    16-bit: the same registers.  8-bit (FP8): within every 32-key chunk a thread's accumulator holds keys
    2q + {0, 1, 8, 9, 16, 17, 24, 25} (q = lane % 4) where the k_width-4 operand wants k 4q + {0, 1, 2, 3,
    16, ..., 19}; read in that order the registers are the operand as they stand (no shuffles) if V's keys
    are permuted alike: operand column 32c + 16h + 4q + 2e + b holds key 32c + 16h + 8e + 2q + b
    (``runtime.fa3_gluon.fp8_v_operand`` stores V so).  The 8-bit operand stays fp32 until ``_pv`` rounds it:
    an 8-bit loop-carried value is unpacked and repacked byte by byte every iteration (sm_90a SASS at
    d = 128: 733 PRMTs against 160)."""
    if dtype.primitive_bitwidth == 8:
        M: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1]
        x = gl.reshape(p, [M, N // 32, 2, 2, 4, 2])  # key = 32c + 16h + 8e + 2q + b
        x = gl.permute(x, (0, 1, 2, 4, 3, 5))  # (c, h, q, e, b)
        operand = gl.convert_layout(gl.reshape(x, [M, N]), p_layout)  # a renaming of registers
    elif PACK:
        # pairs rounded by one cvt each (the same RN rounding), opaque to LLVM: P stays packed across the loop's
        # phi; ``p.to`` is folded through it (P carried in fp32, rounded and re-paired by PRMT at the next GEMM)
        if dtype == gl.bfloat16:
            packed = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.bfloat16,
                                               is_pure=True, pack=2)
        else:
            packed = gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.float16,
                                               is_pure=True, pack=2)
        operand = gl.convert_layout(packed, p_layout)
    else:
        operand = gl.convert_layout(p.to(dtype), p_layout)
    return operand


@gluon.jit
def _rows_times(acc, x):
    """acc * x[:, None] for a per-row vector ``x`` of any row layout."""
    return acc * gl.expand_dims(gl.convert_layout(x, gl.SliceLayout(1, acc.type.layout)), 1)


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, start_n, last_key, BLOCK_N: gl.constexpr, MASKED: gl.constexpr,
                  FP8: gl.constexpr = False):
    """Online softmax of the raw scores ``s`` of kv tile ``start_n``: (p, m, l, alpha).  Unmasked scores
    stay unscaled: ``rowmax(s) * qk_scale`` is the scaled max because ``qk_scale > 0`` (host-checked, and
    with FP8 made so per tile).  FP8: P~ = 2^8 exp(S - m) spans e4m3's [0, 256] (FA3's Max_offset; l carries
    the 2^8 too)."""
    if MASKED:
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        s = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(last_key - start_n, 1), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    if MASKED:
        # a row with no allowed key so far keeps m = -inf: subtract 0, never -inf - -inf
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    if FP8:
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use - _P_OCTAVES, 1))
    else:
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _kv_iter(j, it0, acc0, acc1, p_prev, m_i, l_i, turn, q_wg, k_tiles, v_tiles, k_ready, v_ready, kv_empty,
             turn_bars, qk_scale, last_key, s_zero,
             BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, WG: gl.constexpr, NUM_WG: gl.constexpr,
             BLOCK_D1: gl.constexpr, MASKED: gl.constexpr, INTRA: gl.constexpr, PINGPONG: gl.constexpr,
             PACK_P: gl.constexpr, NAMED_RELEASE: gl.constexpr):
    """Tile j >= 1: S_j = Q K_jᵀ and O += P_{j-1} V_{j-1} issued together, the softmax of S_j beside the
    P V GEMM (``INTRA``) or after it (K_j released once S_j is back), then O rescaled and V_{j - 1} released.
    Ring slots and parities count from ``it0`` (kv iterations of the program's earlier tiles), key offsets
    from j."""
    it = it0 + j
    slot = it % NUM_STAGES
    prev = (it - 1) % NUM_STAGES
    mbarrier.wait(k_ready.index(slot), (it // NUM_STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((it - 1) // NUM_STAGES) & 1)
    turn = _turn_wait(turn_bars, turn, WG, PINGPONG)
    s = _qk(q_wg, k_tiles, slot, s_zero, BLOCK_D1=BLOCK_D1)
    acc0, acc1 = _pv(p_prev, v_tiles, prev, acc0, acc1, BLOCK_D1=BLOCK_D1)
    _turn_pass(turn_bars, WG, NUM_WG, PINGPONG)
    s, acc0, acc1, p_prev = _wait_s(s, acc0, acc1, p_prev, BLOCK_D1=BLOCK_D1, INTRA=INTRA)
    _release(kv_empty, slot, NUM_WG=NUM_WG, NAMED_RELEASE=NAMED_RELEASE)
    if INTRA == 2:
        # a block boundary: ptxas hoists the P V wait above straight-line code, not into a branch; always true
        # (qk_scale positive on the host, 0 if it underflows fp32; FP8 tiles' > 0)
        in_block = qk_scale >= 0
    else:
        in_block: gl.constexpr = True
    if in_block:
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, j * BLOCK_N, last_key, BLOCK_N=BLOCK_N,
                                           MASKED=MASKED, FP8=k_tiles[0].dtype.primitive_bitwidth == 8)
    else:  # never taken
        p = s
        alpha = m_i
    acc0, acc1, p_prev = _wait_pv(acc0, acc1, p_prev, BLOCK_D1=BLOCK_D1)
    _release(kv_empty, NUM_STAGES + prev, NUM_WG=NUM_WG, NAMED_RELEASE=NAMED_RELEASE)
    acc0 = _rows_times(acc0, alpha)
    if BLOCK_D1 > 0:
        acc1 = _rows_times(acc1, alpha)
    p_next = _p_operand(p, dtype=k_tiles[0].dtype, p_layout=gl.constexpr(p_prev.type.layout), PACK=PACK_P)
    return acc0, acc1, p_next, m_i, l_i, turn


@gluon.jit
def _prologue(q_wg, k_tiles, k_ready, kv_empty, turn_bars, m_i, l_i, qk_scale, last_key, s_zero, full_tiles, it0,
              turn,
              BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, WG: gl.constexpr, NUM_WG: gl.constexpr,
              BLOCK_D1: gl.constexpr, PINGPONG: gl.constexpr, SKIP_MASK0: gl.constexpr,
              NAMED_RELEASE: gl.constexpr):
    """S_0 (ring iteration ``it0``, ping-pong turn ``turn``) and its softmax: masked unless ``SKIP_MASK0``
    and every row sees all of tile 0."""
    FP8: gl.constexpr = k_tiles[0].dtype.primitive_bitwidth == 8
    slot = it0 % NUM_STAGES
    mbarrier.wait(k_ready.index(slot), (it0 // NUM_STAGES) & 1)
    turn = _turn_wait(turn_bars, turn, WG, PINGPONG)
    s = _qk(q_wg, k_tiles, slot, s_zero, BLOCK_D1=BLOCK_D1)
    _turn_pass(turn_bars, WG, NUM_WG, PINGPONG)
    s = warpgroup_mma_wait(0, deps=(s,))
    _release(kv_empty, slot, NUM_WG=NUM_WG, NAMED_RELEASE=NAMED_RELEASE)
    if SKIP_MASK0:
        if full_tiles > 0:
            p, m_i, l_i, _alpha = _softmax_step(s, m_i, l_i, qk_scale, 0, last_key, BLOCK_N=BLOCK_N, MASKED=False,
                                               FP8=FP8)
        else:
            p, m_i, l_i, _alpha = _softmax_step(s, m_i, l_i, qk_scale, 0, last_key, BLOCK_N=BLOCK_N, MASKED=True,
                                               FP8=FP8)
    else:
        p, m_i, l_i, _alpha = _softmax_step(s, m_i, l_i, qk_scale, 0, last_key, BLOCK_N=BLOCK_N, MASKED=True,
                                           FP8=FP8)
    return p, m_i, l_i, turn


@gluon.jit
def _store_rows(Out, out, row0, stride_om, seqlen_q, COL0: gl.constexpr, HEAD_DIM: gl.constexpr,
                O_STORE: gl.constexpr):
    """Masked stores of ``out`` (64 rows x its width) at rows [row0, + 64), columns [COL0, + width): rows past
    Nq and columns past HEAD_DIM dropped.  ``O_STORE`` 1: through a row-contiguous layout (16 bytes per
    thread, a row's threads adjacent: full 128-byte lines per warp store), else from the wgmma layout."""
    M: gl.constexpr = out.shape[0]
    WIDTH: gl.constexpr = out.shape[1]
    if O_STORE == 1:
        TPW_D: gl.constexpr = WIDTH // 8
        st_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // TPW_D, TPW_D],
                                                   warps_per_cta=[4, 1], order=[1, 0])
    else:
        st_layout: gl.constexpr = out.type.layout
    out = gl.convert_layout(out, st_layout)
    rows_o = row0 + gl.arange(0, M, layout=gl.SliceLayout(1, st_layout))
    cols_o = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, st_layout))
    if COL0 > 0:
        cols_o = cols_o + COL0
    o_ptrs = Out + gl.expand_dims(rows_o.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols_o, 0)
    o_mask = gl.expand_dims(rows_o < seqlen_q, 1)
    if COL0 + WIDTH != HEAD_DIM:
        o_mask = o_mask & gl.expand_dims(cols_o < HEAD_DIM, 0)
    gl.store(o_ptrs, out, mask=o_mask)


@gluon.jit
def _store_staged(Out, q_wg, out0, out1, row0, stride_om, seqlen_q, HEAD_DIM: gl.constexpr,
                  BLOCK_D0: gl.constexpr, BLOCK_D1: gl.constexpr, HOST_DESC: gl.constexpr):
    """O through a TMA store staged in this warpgroup's Q rows (its last S GEMM has retired); the descriptor
    drops rows past Nq and columns past HEAD_DIM.  ``Out``: the head's base pointer, or with ``HOST_DESC``
    (pointer, desc0, desc1, b, h), ``_out_target``'s tuple."""
    M: gl.constexpr = 64
    if not HOST_DESC:
        o_desc = _head_desc(Out, seqlen_q, stride_om, HEAD_DIM, M, BLOCK_D0)
        if BLOCK_D1 > 0:
            o_desc1 = _head_desc(Out, seqlen_q, stride_om, HEAD_DIM, M, BLOCK_D1)
    if row0 < seqlen_q:  # no box wholly out of bounds (the last tile's upper warpgroups)
        q_wg[0].store(out0)
        if BLOCK_D1 > 0:
            q_wg[1].store(out1)
        fence_async_shared()
        if HOST_DESC:
            gl.static_assert(_same_swizzle(Out[1].layout, q_wg[0].layout))
            tma.async_copy_shared_to_global(Out[1], [Out[3], Out[4], row0, 0], _unit4(q_wg[0]))
            if BLOCK_D1 > 0:
                gl.static_assert(_same_swizzle(Out[2].layout, q_wg[1].layout))
                tma.async_copy_shared_to_global(Out[2], [Out[3], Out[4], row0, BLOCK_D0], _unit4(q_wg[1]))
        else:
            tma.async_copy_shared_to_global(o_desc, [row0, 0], q_wg[0])
            if BLOCK_D1 > 0:
                tma.async_copy_shared_to_global(o_desc1, [row0, BLOCK_D0], q_wg[1])
        tma.store_wait(0)


@gluon.jit
def _store_staged_persistent(Out, q_wg, q_empty, out0, out1, row0, stride_om, seqlen_q, n_tiles,
                             HEAD_DIM: gl.constexpr, BLOCK_D0: gl.constexpr, BLOCK_D1: gl.constexpr,
                             CAUSAL: gl.constexpr, HOST_DESC: gl.constexpr):
    """Persistent ``O_STORE`` 2: a tile with work stages O in its Q rows, then (store complete) releases
    them on ``q_empty``; a tile without work does not own the Q tiles (the producer may be loading the
    next tile's Q there) and stores its zeros with plain masked stores.  Not causal, every tile has work
    (Nk >= 1: the host launches nothing otherwise)."""
    if not CAUSAL:
        _store_staged(Out, q_wg, out0, out1, row0, stride_om, seqlen_q, HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0,
                      BLOCK_D1=BLOCK_D1, HOST_DESC=HOST_DESC)
        mbarrier.arrive(q_empty)
    elif n_tiles > 0:
        _store_staged(Out, q_wg, out0, out1, row0, stride_om, seqlen_q, HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0,
                      BLOCK_D1=BLOCK_D1, HOST_DESC=HOST_DESC)
        mbarrier.arrive(q_empty)
    else:
        o_ptr = _out_ptr(Out, HOST_DESC=HOST_DESC, O_STORE=2)
        _store_rows(o_ptr, out0, row0, stride_om, seqlen_q, COL0=0, HEAD_DIM=HEAD_DIM, O_STORE=0)
        if BLOCK_D1 > 0:
            _store_rows(o_ptr, out1, row0, stride_om, seqlen_q, COL0=BLOCK_D0, HEAD_DIM=HEAD_DIM, O_STORE=0)


@gluon.jit
def _out_target(o_ptr, o_descs, b, h, HOST_DESC: gl.constexpr, O_STORE: gl.constexpr):
    """What a consumer stores its tile through: the head's base pointer ``o_ptr``, or with host descriptors
    and a TMA store (``O_STORE`` 2) (o_ptr, desc0, desc1, b, h) (``o_descs``: the (desc0, desc1) pair)."""
    if HOST_DESC and O_STORE == 2:
        target = (o_ptr, o_descs[0], o_descs[1], b.to(gl.int32), h.to(gl.int32))
    else:
        target = o_ptr
    return target


@gluon.jit
def _out_ptr(Out, HOST_DESC: gl.constexpr, O_STORE: gl.constexpr):
    """The head's base pointer of an ``_out_target``."""
    if HOST_DESC and O_STORE == 2:
        o_ptr = Out[0]
    else:
        o_ptr = Out
    return o_ptr


@gluon.jit
def _fp8_scales(ds, off_b, off_hk, qk_scale):
    """FP8: (the tile's score scale, v descale, whether the descales are valid) of (batch, kv head)
    ``(off_b, off_hk)``; ``ds`` = (QDescale, KDescale, VDescale, Err, their (batch, head) strides, ...).  The
    Triton FP8 kernel's loads and validity rule (``kernels.fa3_fwd._descales`` / ``_descales_ok``); an invalid
    tile runs at scale 1 and its outputs are replaced (``_consumer_tile``)."""
    qk_ds, v_ds = _descales(ds[0], ds[1], ds[2], off_b, off_hk, *ds[4:10])
    ok = _descales_ok(qk_ds, qk_scale, v_ds)
    scale = qk_scale * qk_ds
    scale = gl.where(scale > 0.0, gl.minimum(scale, 1e30), 1.0)
    return scale, v_ds, ok


@gluon.jit
def _skip_tiles(k_ready, v_ready, kv_empty, turn_bars, turn, it_from, it_to, WG: gl.constexpr,
                NUM_WG: gl.constexpr, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                NAMED_RELEASE: gl.constexpr):
    """Ring iterations [it_from, it_to) this warpgroup has no key of: each slot released once loaded (a release
    before the load could complete the slot's previous round for a warpgroup still reading it) and its ping-pong
    turn passed, one turn per iteration, so every consumer takes the same turns and releases; returns the turn."""
    for it in range(it_from, it_to):
        slot = it % NUM_STAGES
        mbarrier.wait(k_ready.index(slot), (it // NUM_STAGES) & 1)
        turn = _turn_wait(turn_bars, turn, WG, PINGPONG)
        _turn_pass(turn_bars, WG, NUM_WG, PINGPONG)
        _release(kv_empty, slot, NUM_WG=NUM_WG, NAMED_RELEASE=NAMED_RELEASE)
        mbarrier.wait(v_ready.index(slot), (it // NUM_STAGES) & 1)
        _release(kv_empty, NUM_STAGES + slot, NUM_WG=NUM_WG, NAMED_RELEASE=NAMED_RELEASE)
    return turn


@gluon.jit
def _consumer_tile(Out, LSE, q_tiles, k_tiles, v_tiles, q_bar, q_empty, k_ready, v_ready, kv_empty, turn_bars,
                   qk_scale, fp8s, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles, it0, q_phase,
                   turn0, WG: gl.constexpr, NUM_WG: gl.constexpr,
                   HEAD_DIM: gl.constexpr, BLOCK_D0: gl.constexpr, BLOCK_D1: gl.constexpr, BLOCK_N: gl.constexpr,
                   NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                   INTRA: gl.constexpr, PINGPONG: gl.constexpr, SKIP_MASK0: gl.constexpr, O_STORE: gl.constexpr,
                   PERSISTENT: gl.constexpr, HOST_DESC: gl.constexpr, PACK_P: gl.constexpr,
                   NAMED_RELEASE: gl.constexpr, WG_SKIP: gl.constexpr = False):
    """Rows [start_m + WG * 64, + 64) of one tile: the kv loop (ring iterations from ``it0``, Q barrier
    parity ``q_phase``, ping-pong turns from ``turn0``), then O / l and the LSE.  ``WG_SKIP`` (causal): the kv
    tiles past this warpgroup's last row's keys (the tile's other warpgroups see them) are not computed, only
    waited for, released and their ping-pong turns passed (``_skip_tiles``).  ``O_STORE``: 0 masked
    stores from the wgmma layout, 1 the same through a row-contiguous (16-byte) layout, 2 a TMA store
    staged in this warpgroup's Q rows.  ``PERSISTENT``: arrive on ``q_empty`` once done with Q and with
    every K / V load of a tile with work.  ``Out``: an ``_out_target``.  FP8 (e4m3 tiles; O bf16):
    ``qk_scale`` is the tile's (times the q and k descales), ``fp8s`` = (v descale, whether the descales are
    valid, the error word); otherwise ``fp8s`` is unread."""
    gl.static_assert(gl.num_warps() == 4)
    M: gl.constexpr = 64
    o_ptr = _out_ptr(Out, HOST_DESC=HOST_DESC, O_STORE=O_STORE)
    dtype: gl.constexpr = o_ptr.dtype.element_ty
    in_dtype: gl.constexpr = k_tiles[0].dtype  # P's too: the second GEMM runs in the inputs' precision
    FP8: gl.constexpr = in_dtype.primitive_bitwidth == 8
    KI: gl.constexpr = 256 // in_dtype.primitive_bitwidth  # wgmma K step: 16 (16-bit), 32 (8-bit)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, KI])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_D0, KI])
    # P is the A operand of both P V GEMMs: its register layout depends on M and K only, not on O's width
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=32 // in_dtype.primitive_bitwidth)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    row0 = start_m + WG * M
    rows = row0 + gl.arange(0, M, layout=row_s)
    # key j is allowed for row i iff j <= last_key[i]: j < Nk, and j <= i + Nk - Nq when causal (bottom-right)
    last_key = gl.full([M], seqlen_k - 1, gl.int32, layout=row_s)
    if CAUSAL:
        last_key = gl.minimum(last_key, rows + (seqlen_k - seqlen_q))
    m_i = gl.full([M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([M], gl.float32, layout=row_s)
    acc0 = gl.zeros([M, BLOCK_D0], gl.float32, layout=o_layout)
    if BLOCK_D1 > 0:
        o1_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_D1, KI])
        acc1 = gl.zeros([M, BLOCK_D1], gl.float32, layout=o1_layout)
        q_wg = (q_tiles[0].index(WG), q_tiles[1].index(WG))
    else:
        acc1 = acc0  # unread
        q_wg = (q_tiles[0].index(WG),)
    n_own = n_tiles
    if WG_SKIP:  # causal (the kernel's static_assert)
        # this warpgroup's last row's key bound; at least tile 0 (rows that see no key run it masked)
        own_end = gl.minimum(seqlen_k, row0 + M + seqlen_k - seqlen_q)
        n_own = gl.minimum(n_tiles, gl.maximum(gl.cdiv(gl.maximum(own_end, 0), BLOCK_N), 1))
    if n_tiles > 0:
        s_zero = gl.zeros([M, BLOCK_N], gl.float32, layout=s_layout)
        mbarrier.wait(q_bar, q_phase)
        p, m_i, l_i, turn = _prologue(q_wg, k_tiles, k_ready, kv_empty, turn_bars, m_i, l_i, qk_scale, last_key,
                                      s_zero,
                                      full_tiles, it0, turn0, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, WG=WG,
                                      NUM_WG=NUM_WG, BLOCK_D1=BLOCK_D1, PINGPONG=PINGPONG,
                                      SKIP_MASK0=SKIP_MASK0, NAMED_RELEASE=NAMED_RELEASE)
        p_prev = _p_operand(p, dtype=in_dtype, p_layout=p_layout, PACK=PACK_P)
        for j in range(1, gl.minimum(full_tiles, n_own)):
            acc0, acc1, p_prev, m_i, l_i, turn = _kv_iter(
                j, it0, acc0, acc1, p_prev, m_i, l_i, turn, q_wg, k_tiles, v_tiles, k_ready, v_ready, kv_empty,
                turn_bars, qk_scale, last_key, s_zero, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, WG=WG,
                NUM_WG=NUM_WG, BLOCK_D1=BLOCK_D1, MASKED=False, INTRA=INTRA, PINGPONG=PINGPONG,
                PACK_P=PACK_P, NAMED_RELEASE=NAMED_RELEASE)
        for j in range(gl.maximum(full_tiles, 1), n_own):
            acc0, acc1, p_prev, m_i, l_i, turn = _kv_iter(
                j, it0, acc0, acc1, p_prev, m_i, l_i, turn, q_wg, k_tiles, v_tiles, k_ready, v_ready, kv_empty,
                turn_bars, qk_scale, last_key, s_zero, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, WG=WG,
                NUM_WG=NUM_WG, BLOCK_D1=BLOCK_D1, MASKED=True, INTRA=INTRA, PINGPONG=PINGPONG,
                PACK_P=PACK_P, NAMED_RELEASE=NAMED_RELEASE)
        # epilogue: O += P_{n-1} V_{n-1}
        last = it0 + n_own - 1
        mbarrier.wait(v_ready.index(last % NUM_STAGES), (last // NUM_STAGES) & 1)
        if PERSISTENT:
            if O_STORE != 2:
                if n_own == n_tiles:
                    # Q's last S GEMM has retired and every K / V load of the tile has landed: the producer may
                    # load the next tile's Q and rebuild its descriptors while this epilogue runs
                    mbarrier.arrive(q_empty)
        turn = _turn_wait(turn_bars, turn, WG, PINGPONG)
        acc0, acc1 = _pv(p_prev, v_tiles, last % NUM_STAGES, acc0, acc1, BLOCK_D1=BLOCK_D1)
        _turn_pass(turn_bars, WG, NUM_WG, PINGPONG)
        acc0, acc1, p_prev = _wait_pv(acc0, acc1, p_prev, BLOCK_D1=BLOCK_D1)
        _release(kv_empty, NUM_STAGES + last % NUM_STAGES, NUM_WG=NUM_WG, NAMED_RELEASE=NAMED_RELEASE)
        if WG_SKIP:
            turn = _skip_tiles(k_ready, v_ready, kv_empty, turn_bars, turn, it0 + n_own, it0 + n_tiles, WG=WG,
                               NUM_WG=NUM_WG, NUM_STAGES=NUM_STAGES, PINGPONG=PINGPONG, NAMED_RELEASE=NAMED_RELEASE)
            if PERSISTENT:
                if O_STORE != 2:
                    if n_own < n_tiles:
                        mbarrier.arrive(q_empty)  # every K / V load of the tile has landed (_skip_tiles waited)

    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    if FP8:
        v_ds, scale_ok, err = fp8s
        lse = gl.where(empty | (not scale_ok), float("-inf"), (m_i + gl.log2(l_safe) - _P_OCTAVES) * _LN2)
        gl.store(LSE + lse_row0 + rows, lse, mask=rows < seqlen_q)
        # descales that break the kernel's contract: output 0, LSE -inf, the error word's bit (every writer
        # ORs the same bit)
        out_scale = v_ds / l_safe
        if not scale_ok:
            gl.atomic_or(err, _ERR_DESCALE)
        # a select, not a product with 0: the rows' accumulators may hold NaN under a bad descale
        out0 = gl.where(scale_ok, _rows_times(acc0, out_scale), 0.0).to(dtype)
    else:
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * _LN2)
        gl.store(LSE + lse_row0 + rows, lse, mask=rows < seqlen_q)
        out_scale = 1.0 / l_safe
        out0 = _rows_times(acc0, out_scale).to(dtype)
    if BLOCK_D1 > 0:
        out1 = _rows_times(acc1, out_scale).to(dtype)
    else:
        out1 = out0  # unread
    if O_STORE == 2:
        if PERSISTENT:
            _store_staged_persistent(Out, q_wg, q_empty, out0, out1, row0, stride_om, seqlen_q, n_tiles,
                                     HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1, CAUSAL=CAUSAL,
                                     HOST_DESC=HOST_DESC)
        else:
            _store_staged(Out, q_wg, out0, out1, row0, stride_om, seqlen_q, HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0,
                          BLOCK_D1=BLOCK_D1, HOST_DESC=HOST_DESC)
    else:
        _store_rows(o_ptr, out0, row0, stride_om, seqlen_q, COL0=0, HEAD_DIM=HEAD_DIM, O_STORE=O_STORE)
        if BLOCK_D1 > 0:
            _store_rows(o_ptr, out1, row0, stride_om, seqlen_q, COL0=BLOCK_D0, HEAD_DIM=HEAD_DIM, O_STORE=O_STORE)


@gluon.jit
def _consumer(Out, LSE, q_tiles, k_tiles, v_tiles, q_bar, k_ready, v_ready, kv_empty, turn_bars,
              qk_scale, fp8s, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles,
              WG: gl.constexpr, NUM_WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D0: gl.constexpr,
              BLOCK_D1: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              INTRA: gl.constexpr, PINGPONG: gl.constexpr, SKIP_MASK0: gl.constexpr, O_STORE: gl.constexpr,
              HOST_DESC: gl.constexpr, PACK_P: gl.constexpr, NAMED_RELEASE: gl.constexpr,
              WG_SKIP: gl.constexpr = False):
    """One program, one tile: ring slot 0, Q parity 0 and ping-pong turn 0 on fresh barriers; ``Out``: an
    ``_out_target``; ``qk_scale``, ``fp8s``: the tile's, as ``_consumer_tile`` takes them."""
    _consumer_tile(Out, LSE, q_tiles, k_tiles, v_tiles, q_bar, q_bar, k_ready, v_ready, kv_empty, turn_bars,
                   qk_scale, fp8s, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles, 0, 0, 0,
                   WG=WG, NUM_WG=NUM_WG, HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1,
                   BLOCK_N=BLOCK_N,
                   NUM_STAGES=NUM_STAGES, CAUSAL=CAUSAL, INTRA=INTRA, PINGPONG=PINGPONG, SKIP_MASK0=SKIP_MASK0,
                   O_STORE=O_STORE, PERSISTENT=False, HOST_DESC=HOST_DESC, PACK_P=PACK_P, NAMED_RELEASE=NAMED_RELEASE,
                   WG_SKIP=WG_SKIP)


@gluon.jit
def _consumer_persistent_tile(Out, LSE, q_tiles, k_tiles, v_tiles, q_bar, q_empty, k_ready, v_ready, kv_empty,
                              turn_bars, qk_scale, ds, stride_ob, stride_oh, stride_om, n_heads, seqlen_q, seqlen_k,
                              num_m_tiles, total_tiles, tile_id, kv_it, turn, WG: gl.constexpr,
                              NUM_WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D0: gl.constexpr,
                              BLOCK_D1: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                              CAUSAL: gl.constexpr, INTRA: gl.constexpr, PINGPONG: gl.constexpr,
                              SKIP_MASK0: gl.constexpr, O_STORE: gl.constexpr, LPT_GROUP: gl.constexpr,
                              HOST_DESC: gl.constexpr, PACK_P: gl.constexpr, NAMED_RELEASE: gl.constexpr,
                              WG_SKIP: gl.constexpr = False):
    """Tile ``tile_id`` after ``kv_it`` kv iterations and ``turn`` ping-pong turns: (kv_it, turn) after it.
    ``ds``: FP8, the kernel's descale tuple (``_fp8_scales``) with Hq / Hk last; otherwise unread."""
    bh, off_b, off_h, off_hk, start_m, full_tiles, n_tiles = _tile_coords(
        tile_id, total_tiles, n_heads, 1, num_m_tiles, seqlen_q, seqlen_k, BLOCK_M=NUM_WG * 64,
        BLOCK_N=BLOCK_N, CAUSAL=CAUSAL, LPT_GROUP=LPT_GROUP)
    if k_tiles[0].dtype.primitive_bitwidth == 8:
        tile_scale, v_ds, scale_ok = _fp8_scales(ds, off_b, off_h // ds[10], qk_scale)
        fp8s = (v_ds, scale_ok, ds[3])
    else:
        tile_scale = qk_scale
        fp8s = ds
    if HOST_DESC and O_STORE == 2:
        o_dst = _out_target(Out[0] + off_b * stride_ob + off_h * stride_oh, (Out[1], Out[2]), off_b, off_h,
                            HOST_DESC=HOST_DESC, O_STORE=O_STORE)
    else:
        o_dst = Out + off_b * stride_ob + off_h * stride_oh
    _consumer_tile(o_dst, LSE, q_tiles, k_tiles, v_tiles, q_bar, q_empty,
                   k_ready, v_ready, kv_empty, turn_bars, tile_scale, fp8s, stride_om, bh.to(gl.int64) * seqlen_q,
                   seqlen_q, seqlen_k, start_m, full_tiles, n_tiles, kv_it, (turn - kv_it) & 1, turn, WG=WG,
                   NUM_WG=NUM_WG,
                   HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0, BLOCK_D1=BLOCK_D1, BLOCK_N=BLOCK_N,
                   NUM_STAGES=NUM_STAGES, CAUSAL=CAUSAL, INTRA=INTRA,
                   PINGPONG=PINGPONG, SKIP_MASK0=SKIP_MASK0, O_STORE=O_STORE, PERSISTENT=True,
                   HOST_DESC=HOST_DESC, PACK_P=PACK_P, NAMED_RELEASE=NAMED_RELEASE, WG_SKIP=WG_SKIP)
    kv_it += n_tiles
    turn += gl.where(n_tiles > 0, n_tiles + 1, 0)
    return kv_it, turn


@gluon.jit
def _consumer_persistent(Out, LSE, q_tiles, k_tiles, v_tiles, q_bar, q_empty, k_ready, v_ready, kv_empty,
                         turn_bars, sched, qk_scale, ds, stride_ob, stride_oh, stride_om, n_heads, seqlen_q,
                         seqlen_k, num_m_tiles, total_tiles, WG: gl.constexpr, NUM_WG: gl.constexpr,
                         HEAD_DIM: gl.constexpr,
                         BLOCK_D0: gl.constexpr, BLOCK_D1: gl.constexpr, BLOCK_N: gl.constexpr,
                         NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, INTRA: gl.constexpr,
                         PINGPONG: gl.constexpr, SKIP_MASK0: gl.constexpr, O_STORE: gl.constexpr,
                         LPT_GROUP: gl.constexpr, HOST_DESC: gl.constexpr, DYNAMIC: gl.constexpr,
                         PACK_P: gl.constexpr, NAMED_RELEASE: gl.constexpr, WG_SKIP: gl.constexpr = False):
    """Tiles pid, pid + P, ... (P programs), or with ``DYNAMIC`` pid and then the tiles the producer hands
    over (``_ring_get``, read after each tile; a value >= total_tiles stops), as the producer walks them: the
    ring index, the Q barrier's parity (tiles with work so far) and the ping-pong turn (n + 1 turns per tile
    of n > 0 kv tiles, the same for every consumer) run on across tiles.  ``Out``: the output's base pointer,
    or with host descriptors and ``O_STORE`` 2 (pointer, desc0, desc1)."""
    kv_it = 0
    turn = 0  # n + 1 per tile with n > 0 kv tiles: turn - kv_it counts the tiles with work (Q parity)
    if DYNAMIC:
        tile_id = gl.program_id(0)
        n = 0
        while tile_id < total_tiles:
            kv_it, turn = _consumer_persistent_tile(
                Out, LSE, q_tiles, k_tiles, v_tiles, q_bar, q_empty, k_ready, v_ready, kv_empty, turn_bars,
                qk_scale, ds, stride_ob, stride_oh, stride_om, n_heads, seqlen_q, seqlen_k, num_m_tiles, total_tiles,
                tile_id, kv_it, turn, WG=WG, NUM_WG=NUM_WG, HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0,
                BLOCK_D1=BLOCK_D1, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, CAUSAL=CAUSAL, INTRA=INTRA,
                PINGPONG=PINGPONG, SKIP_MASK0=SKIP_MASK0, O_STORE=O_STORE, LPT_GROUP=LPT_GROUP,
                HOST_DESC=HOST_DESC, PACK_P=PACK_P, NAMED_RELEASE=NAMED_RELEASE, WG_SKIP=WG_SKIP)
            tile_id = _ring_get(sched, n)
            n += 1
    else:
        for tile_id in range(gl.program_id(0), total_tiles, gl.num_programs(0)):
            kv_it, turn = _consumer_persistent_tile(
                Out, LSE, q_tiles, k_tiles, v_tiles, q_bar, q_empty, k_ready, v_ready, kv_empty, turn_bars,
                qk_scale, ds, stride_ob, stride_oh, stride_om, n_heads, seqlen_q, seqlen_k, num_m_tiles, total_tiles,
                tile_id, kv_it, turn, WG=WG, NUM_WG=NUM_WG, HEAD_DIM=HEAD_DIM, BLOCK_D0=BLOCK_D0,
                BLOCK_D1=BLOCK_D1, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES, CAUSAL=CAUSAL, INTRA=INTRA,
                PINGPONG=PINGPONG, SKIP_MASK0=SKIP_MASK0, O_STORE=O_STORE, LPT_GROUP=LPT_GROUP,
                HOST_DESC=HOST_DESC, PACK_P=PACK_P, NAMED_RELEASE=NAMED_RELEASE, WG_SKIP=WG_SKIP)


@gluon.jit(do_not_specialize=["n_heads", "kv_group", "seqlen_q", "seqlen_k", "num_m_tiles", "total_tiles", "total_q",
                              "total_k", "n_batch", "search_steps"])
def fa3_gluon_kernel(
    Q, K, V, Out, LSE,
    tile_counter,  # DYNAMIC: one int32 the caller zeroes per launch (claims past the first P tiles); else None
    CuQ, CuK,  # IS_VARLEN: the int32 (B + 1,) cu_seqlens; otherwise None
    # FP8 (e4m3 Q, K, V): float32 descales per (batch, kv head) and the int32 error word; otherwise None
    QDescale, KDescale, VDescale, Err,
    qk_scale,  # softmax_scale * log2(e), > 0
    # HOST_DESC: host TMA descriptors over the (B, H, N, d) views, boxes [1, 1, rows, BLOCK_D0 | BLOCK_D1]
    # (Q: 64 rows, K / V: BLOCK_N, O with O_STORE 2: 64); the *_desc1 with BLOCK_D1 > 0; otherwise None
    q_desc0, q_desc1, k_desc0, k_desc1, v_desc0, v_desc1, o_desc0, o_desc1,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb, stride_vsh,  # FP8: the descales'; otherwise None
    n_heads, kv_group, seqlen_q, seqlen_k, num_m_tiles,
    total_tiles,  # PERSISTENT: B * Hq * num_m_tiles; otherwise None (a constexpr: no parameter)
    # IS_VARLEN: the packed row counts, B, and _packed_slot's halvings bit_length(B - 1); otherwise None
    total_q, total_k, n_batch, search_steps,
    HEAD_DIM: gl.constexpr, BLOCK_D0: gl.constexpr, BLOCK_D1: gl.constexpr, NUM_WG: gl.constexpr,
    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, INTRA: gl.constexpr,
    PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, SKIP_MASK0: gl.constexpr,
    O_STORE: gl.constexpr, LPT_GROUP: gl.constexpr, PERSISTENT: gl.constexpr, HOST_DESC: gl.constexpr,
    DYNAMIC: gl.constexpr, IS_VARLEN: gl.constexpr, PACK_P: gl.constexpr, NAMED_RELEASE: gl.constexpr,
    WG_SKIP: gl.constexpr,
):
    """1-D grid of B * Hq * cdiv(Nq, 64 * NUM_WG) programs, one per tile, or with ``PERSISTENT`` of at most
    ``total_tiles`` (that count) programs looping over tiles pid, pid + grid, ...; tile order
    (``_tile_coords``): the query tiles of one head adjacent (they share its K and V in L2); causal runs each
    head's tiles last-first, the longest rows first, or with ``LPT_GROUP`` > 0 the longest tiles of each
    group of that many heads first.  Launch with
    ``num_warps=4`` (the default partition is consumer 0).  ``HEAD_DIM`` is d; the tiles cover columns
    [0, BLOCK_D0) and, when ``BLOCK_D1 > 0``, [BLOCK_D0, BLOCK_D0 + BLOCK_D1) (powers of two >= 16; the
    columns past d are zero in Q, K, V and never stored).  ``HOST_DESC``: the loads (and the O_STORE 2
    stores) go through the host-built descriptors at coordinates (b, h, row, column), nothing is built on the
    device (no global scratch); otherwise per-head descriptors are built in the kernel from the pointers.
    ``IS_VARLEN`` (one program per slot, descriptors built here): a packed batch of ``n_batch`` sequences, Q, K,
    V, Out (1, H, total, d) views, LSE (Hq, total_q), ``seqlen_q`` / ``seqlen_k`` the longest sequence's lengths,
    ``num_m_tiles`` = total_q // BLOCK_M + B slots per head (``fa3_fwd._packed_slot`` maps a slot to its sequence and
    query tile; at most B idle); each program reads its sequence's rows from CuQ / CuK (``packed_range``:
    clamped to the tensors) and its descriptors and stores stop at the sequence's end."""
    BLOCK_M: gl.constexpr = NUM_WG * 64
    gl.static_assert(HEAD_DIM % 8 == 0)  # TMA: 16-byte row strides and box width
    gl.static_assert(BLOCK_D0 + BLOCK_D1 >= HEAD_DIM)
    gl.static_assert(BLOCK_D0 >= 16)  # wgmma K step
    gl.static_assert((BLOCK_D0 & (BLOCK_D0 - 1)) == 0)
    # the second part starts inside the head (no box wholly out of bounds) and is a power of two >= 16
    gl.static_assert(BLOCK_D1 == 0 or (BLOCK_D0 < HEAD_DIM and BLOCK_D1 >= 16 and BLOCK_D1 <= BLOCK_D0))
    gl.static_assert((BLOCK_D1 & (BLOCK_D1 - 1)) == 0)
    gl.static_assert(BLOCK_N % 16 == 0)
    gl.static_assert(NUM_WG == 2 or NUM_WG == 3)
    # one slot would load K_{j+1} only after S_j and V_j only after P V_{j-1}: no overlap of loads and GEMMs
    gl.static_assert(NUM_STAGES >= 2)
    gl.static_assert(not NAMED_RELEASE or NUM_STAGES <= 4)  # ring barriers 5-12, below the turns' 13-15
    gl.static_assert(PERSISTENT or not DYNAMIC)  # the scheduler hands out the persistent loop's tiles
    gl.static_assert(not (IS_VARLEN and (PERSISTENT or HOST_DESC)))
    gl.static_assert(CAUSAL or not WG_SKIP)  # only a causal mask leaves a warpgroup without keys of a tile
    dtype: gl.constexpr = Q.dtype.element_ty
    # FP8 (8-bit Q, K, V; O bf16): V comes transposed, (B, Hk, HEAD_DIM, Nk rounded up to 32) rows of stride
    # stride_vn, keys permuted per 32-key chunk (``_p_operand``), as
    # (BLOCK_D0, BLOCK_N) tiles; one column part, device descriptors, O not staged in Q's (8-bit) tiles
    FP8: gl.constexpr = dtype.primitive_bitwidth == 8
    gl.static_assert(not FP8 or (BLOCK_D1 == 0 and not HOST_DESC and not IS_VARLEN and O_STORE != 2))
    if FP8:
        ds = (QDescale, KDescale, VDescale, Err, stride_qsb, stride_qsh, stride_ksb, stride_ksh, stride_vsb,
              stride_vsh, kv_group)
    else:  # unread
        ds = (QDescale,)
    if not PERSISTENT:
        bh, off_b, off_h, off_hk, start_m, full_tiles, n_tiles = _tile_coords(
            gl.program_id(0), gl.num_programs(0), n_heads, kv_group, num_m_tiles, seqlen_q, seqlen_k,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL, LPT_GROUP=LPT_GROUP)
        if IS_VARLEN:
            # one "batch" of slots per head: the slot's sequence and query tile, then that sequence's rows
            seq, tile = _packed_slot(CuQ, start_m // BLOCK_M, n_batch, total_q, search_steps, BLOCK_M=BLOCK_M)
            q_start, seqlen_q = packed_range(CuQ, seq, total_q, seqlen_q)
            k_start, seqlen_k = packed_range(CuK, seq, total_k, seqlen_k)
            # an idle slot: nothing to load, compute or store (tile tested before any product: any int for
            # decreasing cu_seqlens)
            if (tile < 0) | (tile >= gl.cdiv(seqlen_q, BLOCK_M)):
                return
            start_m = tile * BLOCK_M
            full_tiles, n_tiles = _kv_tiles(start_m, seqlen_q, seqlen_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                            CAUSAL=CAUSAL)

    q_smem = gl.allocate_shared_memory(dtype, [NUM_WG, 64, BLOCK_D0],
                                       gl.NVMMASharedLayout.get_default_for([64, BLOCK_D0], dtype))
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_D0],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D0], dtype))
    if FP8:
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_D0, BLOCK_N],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_D0, BLOCK_N], dtype))
    else:
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_D0],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D0], dtype))
    if BLOCK_D1 > 0:
        q_smem1 = gl.allocate_shared_memory(dtype, [NUM_WG, 64, BLOCK_D1],
                                            gl.NVMMASharedLayout.get_default_for([64, BLOCK_D1], dtype))
        k_smem1 = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_D1],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D1], dtype))
        v_smem1 = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_D1],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D1], dtype))
        q_tiles = (q_smem, q_smem1)
        k_tiles = (k_smem, k_smem1)
        v_tiles = (v_smem, v_smem1)
    else:
        q_tiles = (q_smem,)
        k_tiles = (k_smem,)
        v_tiles = (v_smem,)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [2 * NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=NUM_WG)  # K_i free: one arrival per consumer warpgroup
        mbarrier.init(kv_empty.index(NUM_STAGES + i), count=NUM_WG)  # V_i free
    for i in gl.static_range(NUM_WG):
        mbarrier.init(turn_bars.index(i), count=1)

    if HOST_DESC:
        if BLOCK_D1 > 0:
            q_pair = (q_desc0, q_desc1)
            k_pair = (k_desc0, k_desc1)
            v_pair = (v_desc0, v_desc1)
        else:  # the second of each pair unread
            q_pair = (q_desc0, q_desc0)
            k_pair = (k_desc0, k_desc0)
            v_pair = (v_desc0, v_desc0)
        if O_STORE == 2:
            if BLOCK_D1 > 0:
                o_pair = (o_desc0, o_desc1)
            else:
                o_pair = (o_desc0, o_desc0)

    if PERSISTENT:
        if HOST_DESC:
            q_src = q_pair
            k_src = k_pair
            v_src = v_pair
            if O_STORE == 2:
                o_dst = (Out, o_pair[0], o_pair[1])
            else:
                o_dst = Out
        else:
            q_src = Q
            k_src = K
            v_src = V
            o_dst = Out
        # one arrival per consumer warpgroup: done with the tile's Q and its last K / V
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_empty, count=NUM_WG)
        if DYNAMIC:
            # the scheduler ring: two tile indices, each written by the producer (``full``, one arrival) and
            # read by every consumer (``empty``, one arrival per warpgroup)
            ring = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
            ring_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            ring_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(ring_full.index(i), count=1)
                mbarrier.init(ring_empty.index(i), count=NUM_WG)
            sched = (tile_counter, ring, ring_full, ring_empty)
        else:  # unread
            sched = (q_empty,)
        if NUM_WG == 2:
            gl.warp_specialize([
                (_consumer_persistent, (o_dst, LSE, q_tiles, k_tiles, v_tiles, q_bar, q_empty, k_ready, v_ready,
                 kv_empty, turn_bars, sched, qk_scale, ds, stride_ob, stride_oh, stride_om, n_heads, seqlen_q, seqlen_k,
                 num_m_tiles, total_tiles, 0, NUM_WG, HEAD_DIM, BLOCK_D0, BLOCK_D1, BLOCK_N, NUM_STAGES, CAUSAL, INTRA,
                 PINGPONG, SKIP_MASK0, O_STORE, LPT_GROUP, HOST_DESC, DYNAMIC, PACK_P, NAMED_RELEASE,
                 WG_SKIP)),
                (_consumer_persistent, (o_dst, LSE, q_tiles, k_tiles, v_tiles, q_bar, q_empty, k_ready, v_ready,
                 kv_empty, turn_bars, sched, qk_scale, ds, stride_ob, stride_oh, stride_om, n_heads, seqlen_q, seqlen_k,
                 num_m_tiles, total_tiles, 1, NUM_WG, HEAD_DIM, BLOCK_D0, BLOCK_D1, BLOCK_N, NUM_STAGES, CAUSAL, INTRA,
                 PINGPONG, SKIP_MASK0, O_STORE, LPT_GROUP, HOST_DESC, DYNAMIC, PACK_P, NAMED_RELEASE,
                 WG_SKIP)),
                (_producer_persistent, (q_src, k_src, v_src, q_tiles, k_tiles, v_tiles, q_bar, q_empty, k_ready,
                 v_ready, kv_empty, sched, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb,
                 stride_vh, stride_vn, n_heads, kv_group, seqlen_q, seqlen_k, num_m_tiles, total_tiles, HEAD_DIM,
                 BLOCK_D0, BLOCK_D1, NUM_WG, BLOCK_N, NUM_STAGES, CAUSAL, LPT_GROUP, HOST_DESC, DYNAMIC,
                 NAMED_RELEASE)),
                ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer_persistent, (o_dst, LSE, q_tiles, k_tiles, v_tiles, q_bar, q_empty, k_ready, v_ready,
                 kv_empty, turn_bars, sched, qk_scale, ds, stride_ob, stride_oh, stride_om, n_heads, seqlen_q, seqlen_k,
                 num_m_tiles, total_tiles, 0, NUM_WG, HEAD_DIM, BLOCK_D0, BLOCK_D1, BLOCK_N, NUM_STAGES, CAUSAL, INTRA,
                 PINGPONG, SKIP_MASK0, O_STORE, LPT_GROUP, HOST_DESC, DYNAMIC, PACK_P, NAMED_RELEASE,
                 WG_SKIP)),
                (_consumer_persistent, (o_dst, LSE, q_tiles, k_tiles, v_tiles, q_bar, q_empty, k_ready, v_ready,
                 kv_empty, turn_bars, sched, qk_scale, ds, stride_ob, stride_oh, stride_om, n_heads, seqlen_q, seqlen_k,
                 num_m_tiles, total_tiles, 1, NUM_WG, HEAD_DIM, BLOCK_D0, BLOCK_D1, BLOCK_N, NUM_STAGES, CAUSAL, INTRA,
                 PINGPONG, SKIP_MASK0, O_STORE, LPT_GROUP, HOST_DESC, DYNAMIC, PACK_P, NAMED_RELEASE,
                 WG_SKIP)),
                (_consumer_persistent, (o_dst, LSE, q_tiles, k_tiles, v_tiles, q_bar, q_empty, k_ready, v_ready,
                 kv_empty, turn_bars, sched, qk_scale, ds, stride_ob, stride_oh, stride_om, n_heads, seqlen_q, seqlen_k,
                 num_m_tiles, total_tiles, 2, NUM_WG, HEAD_DIM, BLOCK_D0, BLOCK_D1, BLOCK_N, NUM_STAGES, CAUSAL, INTRA,
                 PINGPONG, SKIP_MASK0, O_STORE, LPT_GROUP, HOST_DESC, DYNAMIC, PACK_P, NAMED_RELEASE,
                 WG_SKIP)),
                (_producer_persistent, (q_src, k_src, v_src, q_tiles, k_tiles, v_tiles, q_bar, q_empty, k_ready,
                 v_ready, kv_empty, sched, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb,
                 stride_vh, stride_vn, n_heads, kv_group, seqlen_q, seqlen_k, num_m_tiles, total_tiles, HEAD_DIM,
                 BLOCK_D0, BLOCK_D1, NUM_WG, BLOCK_N, NUM_STAGES, CAUSAL, LPT_GROUP, HOST_DESC, DYNAMIC,
                 NAMED_RELEASE)),
                ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        if HOST_DESC:
            b32 = off_b.to(gl.int32)
            q_src = (q_pair[0], q_pair[1], b32, off_h.to(gl.int32))
            k_src = (k_pair[0], k_pair[1], b32, off_hk.to(gl.int32))
            v_src = (v_pair[0], v_pair[1], b32, off_hk.to(gl.int32))
            if O_STORE == 2:
                o_dst = _out_target(Out + off_b * stride_ob + off_h * stride_oh, o_pair, off_b, off_h,
                                    HOST_DESC=HOST_DESC, O_STORE=O_STORE)
            else:
                o_dst = Out + off_b * stride_ob + off_h * stride_oh
        elif IS_VARLEN:
            q_src = Q + q_start * stride_qm + off_h * stride_qh
            k_src = K + k_start * stride_kn + off_hk * stride_kh
            v_src = V + k_start * stride_vn + off_hk * stride_vh
            o_dst = Out + q_start * stride_om + off_h * stride_oh
        else:
            q_src = Q + off_b * stride_qb + off_h * stride_qh
            k_src = K + off_b * stride_kb + off_hk * stride_kh
            v_src = V + off_b * stride_vb + off_hk * stride_vh
            o_dst = Out + off_b * stride_ob + off_h * stride_oh
        if IS_VARLEN:
            lse_row0 = off_h * total_q + q_start  # LSE (Hq, total_q)
        else:
            lse_row0 = bh.to(gl.int64) * seqlen_q
        if FP8:
            tile_scale, v_ds, scale_ok = _fp8_scales(ds, off_b, off_hk, qk_scale)
            fp8s = (v_ds, scale_ok, Err)
        else:
            tile_scale = qk_scale
            fp8s = ds
        # constexprs keep their kind only in tuples written in the call (a tuple bound to a name makes them
        # values): the consumers' argument tuples are spelled out, each with its WG
        if NUM_WG == 2:
            gl.warp_specialize([
                (_consumer, (o_dst, LSE, q_tiles, k_tiles, v_tiles, q_bar, k_ready, v_ready, kv_empty, turn_bars,
                 tile_scale, fp8s, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles, 0, NUM_WG,
                 HEAD_DIM, BLOCK_D0, BLOCK_D1, BLOCK_N, NUM_STAGES, CAUSAL, INTRA, PINGPONG, SKIP_MASK0, O_STORE,
                 HOST_DESC, PACK_P, NAMED_RELEASE, WG_SKIP)),
                (_consumer, (o_dst, LSE, q_tiles, k_tiles, v_tiles, q_bar, k_ready, v_ready, kv_empty, turn_bars,
                 tile_scale, fp8s, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles, 1, NUM_WG,
                 HEAD_DIM, BLOCK_D0, BLOCK_D1, BLOCK_N, NUM_STAGES, CAUSAL, INTRA, PINGPONG, SKIP_MASK0, O_STORE,
                 HOST_DESC, PACK_P, NAMED_RELEASE, WG_SKIP)),
                (_producer, (q_src, k_src, v_src, q_tiles, k_tiles, v_tiles, q_bar, k_ready, v_ready, kv_empty,
                 stride_qm, stride_kn, stride_vn, seqlen_q, seqlen_k, start_m, n_tiles, HEAD_DIM, BLOCK_D0, BLOCK_D1,
                 NUM_WG, BLOCK_N, NUM_STAGES, HOST_DESC, NAMED_RELEASE)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (o_dst, LSE, q_tiles, k_tiles, v_tiles, q_bar, k_ready, v_ready, kv_empty, turn_bars,
                 tile_scale, fp8s, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles, 0, NUM_WG,
                 HEAD_DIM, BLOCK_D0, BLOCK_D1, BLOCK_N, NUM_STAGES, CAUSAL, INTRA, PINGPONG, SKIP_MASK0, O_STORE,
                 HOST_DESC, PACK_P, NAMED_RELEASE, WG_SKIP)),
                (_consumer, (o_dst, LSE, q_tiles, k_tiles, v_tiles, q_bar, k_ready, v_ready, kv_empty, turn_bars,
                 tile_scale, fp8s, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles, 1, NUM_WG,
                 HEAD_DIM, BLOCK_D0, BLOCK_D1, BLOCK_N, NUM_STAGES, CAUSAL, INTRA, PINGPONG, SKIP_MASK0, O_STORE,
                 HOST_DESC, PACK_P, NAMED_RELEASE, WG_SKIP)),
                (_consumer, (o_dst, LSE, q_tiles, k_tiles, v_tiles, q_bar, k_ready, v_ready, kv_empty, turn_bars,
                 tile_scale, fp8s, stride_om, lse_row0, seqlen_q, seqlen_k, start_m, full_tiles, n_tiles, 2, NUM_WG,
                 HEAD_DIM, BLOCK_D0, BLOCK_D1, BLOCK_N, NUM_STAGES, CAUSAL, INTRA, PINGPONG, SKIP_MASK0, O_STORE,
                 HOST_DESC, PACK_P, NAMED_RELEASE, WG_SKIP)),
                (_producer, (q_src, k_src, v_src, q_tiles, k_tiles, v_tiles, q_bar, k_ready, v_ready, kv_empty,
                 stride_qm, stride_kn, stride_vn, seqlen_q, seqlen_k, start_m, n_tiles, HEAD_DIM, BLOCK_D0, BLOCK_D1,
                 NUM_WG, BLOCK_N, NUM_STAGES, HOST_DESC, NAMED_RELEASE)),
            ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
