"""Host side of the FlashAttention-2 backward: tiles, grids, the 64-bit offset decision and :func:`fa2_backward`.

:func:`fa2_backward` trusts its caller (:mod:`flashtile.ops` validates at the public boundary,
:mod:`flashtile.ops.validate`).  It keeps the checks that guard memory from values the boundary
does not see: ``check_rng_state`` (the kernels read two int64 from ``rng_state``), the block
lists' ``check_seqlens`` (the kernels index one list per tile) and ``fold_grid``'s CUDA grid
limits.  Kernels: :mod:`flashtile.kernels.fa2_bwd`; algorithm: ``docs/fa2.md``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from flashtile.kernels.fa2_bwd import _bwd_dkdv_kernel, _bwd_dq_kernel, _bwd_preprocess
from flashtile.reference.masks import BlockMask
from flashtile.runtime.blocksparse import BlockLists, kv_block_lists, q_block_lists
from flashtile.runtime.common import check_rng_state, fold_grid, pdl_supported, unit_last_stride
from flashtile.runtime.launch import launch, launcher

__all__ = ["BwdConfig", "BwdGrids", "BwdLaunches", "bwd_config", "bwd_grids", "fa2_backward", "plain_backward"]


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
    # Measured on an H100, bf16, fwd+bwd (tile sweep of `flashtile bench tune`; an H200 agrees):
    # 64-row q steps over a 128-row kv tile with 8 warps and 3 stages win at d = 64 and d = 128; 4 warps at d = 128 spill (two fp32 (128, 128) accumulators = 256
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
    """Make every kernel tile divide the BlockMask's (Br, Bc), multiples of 16: a tile never straddles two mask blocks."""
    if block_mask is None:
        return cfg
    br, bc = block_mask.block_size
    return cfg._replace(
        block_m=_fit_tile(cfg.block_m, br), block_n=_fit_tile(cfg.block_n, bc),
        dq_block_m=_fit_tile(cfg.dq_block_m, br), dq_block_n=_fit_tile(cfg.dq_block_n, bc),
    )


# ---------------------------------------------------------------------------
# Host side: validation and launch


def _slopes(alibi_slopes, b: int, hq: int) -> tuple[torch.Tensor | None, int, int]:
    """ALiBi slopes (float32, on q's device) plus (batch stride, head stride); (Hq,) broadcasts over batch."""
    if alibi_slopes is None:
        return None, 0, 0
    s = alibi_slopes
    return (s, 0, s.stride(0)) if s.dim() == 1 else (s, s.stride(0), s.stride(1))


def _grad_buffer(given, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer the kernel writes, tensor returned): the caller's view (of ``like``'s shape) when its d is unit-stride."""
    if given is None:
        t = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        return t, t
    if given.shape[-1] > 1 and given.stride(-1) != 1:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device), given
    return given, given


class BwdGrids(NamedTuple):
    """Launch grids of the three backward kernels (each within CUDA's grid limits)."""

    preprocess: tuple[int, int, int]
    dkdv: tuple[int, int, int]
    dq: tuple[int, int, int]


def bwd_grids(b: int, hq: int, hk: int, nq: int, nk: int, cfg: BwdConfig) -> BwdGrids:
    """Tiles on the fast axis, (batch, head) pairs folded in by :func:`flashtile.runtime.common.fold_grid`."""
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


def _list_strides(lists: BlockLists | None) -> list[int]:
    """Block-list strides; a broadcast (size 1) leading dim gets stride 0."""
    if lists is None:
        return [0] * 6
    c, i = lists.counts, lists.indices

    def st(t, dim):
        return 0 if t.shape[dim] == 1 else t.stride(dim)

    return [st(c, 0), st(c, 1), c.stride(2), st(i, 0), st(i, 1), i.stride(2)]


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
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of FlashAttention-2 (Dao 2023, Algorithm 2).  Trusts its caller:
    the arguments are those :mod:`flashtile.ops.validate` accepts (the public ops check them once).

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

    Packed (variable-length) batch, when ``cu_seqlens_q`` is given: as
    :func:`flashtile.runtime.fa2_fwd.fa2_forward`'s (q, dout, out (total_q, Hq, d), k, v
    (total_k, Hk, d), lse (Hq, total_q); no bias, block mask or block table); the
    kernels clamp every cu_seqlens range to the tensors and to max_seqlen.
    """
    scale, softcap, dropout_p = float(softmax_scale), float(softcap), float(dropout_p)
    left, right = int(window_size[0]), 0 if causal else int(window_size[1])
    varlen = cu_seqlens_q is not None
    dq_buf, dq_ret = _grad_buffer(dq, q)
    dk_buf, dk_ret = _grad_buffer(dk, k)
    dv_buf, dv_ret = _grad_buffer(dv, v)
    written = (dq_buf, dk_buf, dv_buf)  # in the caller's layout (the kernels get views of them)
    if varlen:
        # the kernels' (batch, heads, rows, d) views: one packed "batch" of total rows
        total_q, total_k = q.shape[0], k.shape[0]
        b, nq, nk = cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k)
        empty = total_q == 0 or total_k == 0 or b == 0 or nq == 0 or nk == 0
        q, k, v, dout, out, dq_buf, dk_buf, dv_buf = (
            x.transpose(0, 1).unsqueeze(0) for x in (q, k, v, dout, out, dq_buf, dk_buf, dv_buf)
        )
        _, hq, _, d = q.shape
        hk = k.shape[1]
    else:
        total_q = total_k = 0
        b, hq, nq, d = q.shape
        hk, nk = k.shape[1], k.shape[2]
        empty = b * hq * nq == 0 or nk == 0
    dev = q.device
    bias_x = bias.expand(b, hq, nq, nk) if bias is not None else None  # stride 0 on broadcast dims

    if empty:
        # nothing to attend to (Nk = 0) or nobody attending (Nq = 0): all gradients vanish
        for ret in (dq_ret, dk_ret, dv_ret):
            ret.zero_()
        return dq_ret, dk_ret, dv_ret

    q, k, v, dout, out = (unit_last_stride(x) for x in (q, k, v, dout, out))
    lse = lse.to(device=dev, dtype=torch.float32).contiguous()
    cfg = _fit_block_mask(bwd_config(d, q.dtype, bool(causal), nq, nk, dev), block_mask)
    atomic = not deterministic and cfg.atomic_dq
    qlists = q_block_lists(block_mask, b, hq, nq, nk, dev) if block_mask is not None else None
    klists = kv_block_lists(block_mask, b, hq, nq, nk, dev) if block_mask is not None and not atomic else None
    delta, dq_acc = _scratch(atomic, varlen, b, hq, nq, d, total_q, dev)
    launches = _bwd_launches(
        q, k, v, dout, out, dq_buf, dk_buf, dv_buf, dq_acc if atomic else None, cfg,
        b=b, hq=hq, hk=hk, nq=nq, nk=nk, d=d, total_q=total_q, total_k=total_k, varlen=varlen, left=left,
        right=right, softcap=softcap, alibi_slopes=alibi_slopes, bias_x=bias_x, dropout_p=dropout_p,
        block_mask=block_mask, qlists=qlists, klists=klists,
    )
    cu_q = cu_seqlens_q if varlen else delta  # not read without IS_VARLEN
    cu_k = cu_seqlens_k if varlen else delta
    kernel, grid, static, options = launches.preprocess
    launch(kernel, grid, (out, dout, delta, cu_q), static, **options)
    rng = check_rng_state(rng_state, philox_seed, philox_offset, dev) if dropout_p > 0 else delta
    slopes_t = alibi_slopes if alibi_slopes is not None else delta
    bias_t = bias_x if bias_x is not None else delta
    floats = (scale, softcap, dropout_p, 1.0 / (1.0 - dropout_p))  # dropout_p < 1 (ops.validate.check_dropout)
    # without a block mask the list pointers are never read: delta stands in (no dummy allocation)
    cnt, idx = (qlists.counts, qlists.indices) if qlists is not None else (delta, delta)
    kernel, grid, static, options = launches.dkdv
    launch(kernel, grid, (q, k, v, dout, lse, delta, dk_buf, dv_buf, dq_acc, slopes_t, bias_t, cnt, idx, rng, cu_q,
                          cu_k, *floats), static, **options)
    if atomic:
        dq_buf.copy_(dq_acc)
    else:
        cnt, idx = (klists.counts, klists.indices) if klists is not None else (delta, delta)
        kernel, grid, static, options = launches.dq
        launch(kernel, grid, (q, k, v, dout, lse, delta, dq_buf, slopes_t, bias_t, cnt, idx, rng, cu_q, cu_k,
                              *floats), static, **options)

    for buf, ret in zip(written, (dq_ret, dk_ret, dv_ret)):
        if buf is not ret:
            ret.copy_(buf)
    return dq_ret, dk_ret, dv_ret


def _scratch(atomic: bool, varlen: bool, b: int, hq: int, nq: int, d: int, total_q: int, dev) -> tuple:
    """(delta, dq_acc): D = rowsum(dO o O) per row, and the zeroed fp32 dQ accumulator with ``atomic`` (else
    ``delta`` stands in, unread).  Zeroed before the preprocess kernel, so that nothing runs between it and its
    dependent."""
    delta = torch.empty((hq, total_q) if varlen else (b, hq, nq), dtype=torch.float32, device=dev)
    if not atomic:
        return delta, delta
    if varlen:
        return delta, torch.zeros(total_q, hq, d, dtype=torch.float32, device=dev).transpose(0, 1).unsqueeze(0)
    return delta, torch.zeros(b, hq, nq, d, dtype=torch.float32, device=dev)


class BwdLaunches(NamedTuple):
    """(kernel, grid, static arguments, launch options) of each backward kernel for one problem signature;
    ``dq`` None with dQ accumulated atomically in the dK/dV kernel."""

    preprocess: tuple
    dkdv: tuple
    dq: tuple | None


def _bwd_launches(q, k, v, dout, out, dq_buf, dk_buf, dv_buf, dq_acc, cfg: BwdConfig, *, b: int, hq: int, hk: int,
                  nq: int, nk: int, d: int, total_q: int, total_k: int, varlen: bool, left: int, right: int,
                  softcap: float, alibi_slopes, bias_x, dropout_p: float, block_mask, qlists, klists) -> BwdLaunches:
    """Everything of the three launches that the problem's signature fixes (the kernels' (B, H, N, d) views with
    unit stride on d; ``dq_acc`` the atomic accumulator or None): every int and constexpr is static, so each
    launch is bound once (``runtime.launch``).  Preprocess -> dK/dV -> dQ run back to back: each later kernel is
    launched as a programmatic dependent of the one before (Hopper), so its programs start while that one drains."""
    dev = q.device
    atomic = dq_acc is not None
    pdl = pdl_supported(dev)
    block_d = max(16, triton.next_power_of_2(d))
    grids = bwd_grids(b, hq, hk, nq, nk, cfg)
    # some row index x row stride reaches 2^31: the kernels form row offsets in 64 bits (WIDE)
    wide = _wide(nq, (q, dout, out, dq_buf) + ((dq_acc,) if atomic else ()), nk, (k, v, dk_buf, dv_buf), bias_x)
    preprocess = (
        _bwd_preprocess, grids.preprocess,
        (out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
         hq, b * hq, nq, total_q, d, block_d, cfg.dq_block_m, pdl, wide, varlen),
        dict(num_warps=4, num_stages=1),
    )
    _, stride_alibi_b, stride_alibi_h = _slopes(alibi_slopes, b, hq)
    bias_strides = list(bias_x.stride()) if bias_x is not None else [0, 0, 0, 0]
    features = (
        left >= 0, right >= 0, softcap > 0, alibi_slopes is not None,
        bias_x is not None, dropout_p > 0, block_mask is not None,
    )  # HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_BIAS, HAS_DROPOUT, IS_BLOCK_SPARSE
    precision = ("tf32", dev.type != "cuda" and q.dtype == torch.bfloat16)  # DOT_PRECISION, UPCAST_DOT
    mask_bm, mask_bn = block_mask.block_size if block_mask is not None else (1, 1)
    sizes = (hq, hk, nq, nk, total_q, total_k, mask_bm, mask_bn, left, right)
    dq_acc_strides = list(dq_acc.stride()[:3]) if atomic else [0, 0, 0]

    def even(n: int, tile: int) -> bool:  # no row of a tile past its sequence (packed lengths vary: never)
        return not varlen and n % tile == 0

    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, pdl=pdl)
    dkdv = (
        _bwd_dkdv_kernel, grids.dkdv,
        (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3],
         *dk_buf.stride()[:3], *dv_buf.stride()[:3], *dq_acc_strides,
         stride_alibi_b, stride_alibi_h, *bias_strides, *_list_strides(qlists), *sizes[:2], b * hk, *sizes[2:],
         d, block_d, cfg.block_m, cfg.block_n, even(nq, cfg.block_m), even(nk, cfg.block_n),
         *features, atomic, *precision, pdl, wide, varlen),
        options,
    )
    if atomic:
        return BwdLaunches(preprocess, dkdv, None)
    dq = (
        _bwd_dq_kernel, grids.dq,
        (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dq_buf.stride()[:3],
         stride_alibi_b, stride_alibi_h, *bias_strides, *_list_strides(klists), *sizes[:2], b * hq, *sizes[2:],
         d, block_d, cfg.dq_block_m, cfg.dq_block_n, even(nq, cfg.dq_block_m), even(nk, cfg.dq_block_n),
         *features, *precision, pdl, wide, varlen),
        options,
    )
    return BwdLaunches(preprocess, dkdv, dq)


def plain_backward(dout, q, k, v, out, lse, dq, dk, dv, causal: bool, left: int, right: int):
    """A fixed-length backward without softcap, ALiBi, bias, dropout, block mask or determinism, prepared for the
    signature of these (B, H, N, d) views (``lse`` (B, Hq, Nq) float32 contiguous; ``dq``, ``dk``, ``dv`` the
    gradients' views; ``causal`` and the window ``left`` / ``right`` as :func:`fa2_backward` takes them):
    ``run(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale)`` makes :func:`fa2_backward`'s launches, bound once
    (``runtime.launch.launcher``), on tensors of that signature.  None where :func:`fa2_backward` would do
    more (no rows or keys, a non-unit stride on d, an lse it would convert)."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    if b * hq * nq == 0 or nk == 0:
        return None
    if any(x.stride(-1) != 1 for x in (dout, q, k, v, out, dq, dk, dv)):
        return None
    if lse.dtype != torch.float32 or not lse.is_contiguous() or lse.shape != (b, hq, nq):
        return None
    dev = q.device
    cfg = bwd_config(d, q.dtype, bool(causal), nq, nk, dev)
    atomic = cfg.atomic_dq
    delta, dq_acc = _scratch(atomic, False, b, hq, nq, d, 0, dev)
    launches = _bwd_launches(
        q, k, v, dout, out, dq, dk, dv, dq_acc if atomic else None, cfg, b=b, hq=hq, hk=hk, nq=nq, nk=nk, d=d,
        total_q=0, total_k=0, varlen=False, left=left, right=right, softcap=0.0, alibi_slopes=None, bias_x=None,
        dropout_p=0.0, block_mask=None, qlists=None, klists=None,
    )

    def bind(entry, dynamic):
        kernel, grid, static, options = entry
        return launcher(kernel, grid, dynamic, static, **options)

    floats = (1.0, 0.0, 0.0, 1.0)
    dq_view = (dq.shape, dq.stride())
    pre = bind(launches.preprocess, (out, dout, delta, delta))
    dkdv = bind(launches.dkdv, (q, k, v, dout, lse, delta, dk, dv, dq_acc, delta, delta, delta, delta, delta,
                                delta, delta, *floats))
    dq_kernel = None if atomic else bind(launches.dq, (q, k, v, dout, lse, delta, dq, delta, delta, delta, delta,
                                                       delta, delta, delta, *floats))

    def run(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale: float) -> None:
        delta, dq_acc = _scratch(atomic, False, b, hq, nq, d, 0, dev)
        pre(out, dout, delta, delta)
        floats = (softmax_scale, 0.0, 0.0, 1.0)
        dkdv(q, k, v, dout, lse, delta, dk, dv, dq_acc, delta, delta, delta, delta, delta, delta, delta, *floats)
        if atomic:  # dq may come in another layout of the same storage: the example's view of it
            dq.as_strided(dq_view[0], dq_view[1]).copy_(dq_acc)
        else:
            dq_kernel(q, k, v, dout, lse, delta, dq, delta, delta, delta, delta, delta, delta, delta, *floats)

    return run
