"""Host side of the FlashAttention-2 forward: tiles, autotune plumbing, grid and :func:`fa2_forward`.

:func:`fa2_forward` trusts its caller (:mod:`flashtile.ops` validates at the public boundary,
:mod:`flashtile.ops.validate`).  It keeps the checks that guard memory from values the boundary
does not see: ``check_rng_state`` (the kernel reads two int64 from ``rng_state``), the block
lists' ``check_seqlens`` (the kernel indexes one list per query tile) and ``fold_grid``'s CUDA grid
limits.  Kernel: :mod:`flashtile.kernels.fa2_fwd`; algorithm: ``docs/fa2.md``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from flashtile.kernels.fa2_fwd import _fa2_fwd_kernel
from flashtile.reference.masks import BlockMask
from flashtile.runtime.blocksparse import kv_block_lists
from flashtile.runtime.common import (
    TILE_ROW_STRIDE_MAX,
    check_rng_state,
    fold_grid,
    interpreting,
    unit_last_stride,
    wide_rows,
)
from flashtile.runtime.decode import aligned16, error_flags
from flashtile.runtime.launch import launch, launcher

__all__ = ["fa2_forward", "fwd_config", "fwd_grid"]


# --------------------------------------------------------------------------- #
# Tile configuration
# --------------------------------------------------------------------------- #
def fwd_config(
    d: int,
    dtype: torch.dtype,
    causal: bool,
    nq: int,
    nk: int,
    device: torch.device | str,
    *,
    heavy: bool = False,
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for head dim ``d``.

    The one place tiles are chosen (tests monkeypatch it to force other tilings).
    Interpreter: 16 x 32 tiles, so small test shapes still span several tiles
    and tails.  GPU: Hopper starting points, to be tuned on an H100.  Budgets:
    shared memory ``num_stages * 2 * BLOCK_N * d * bytes`` (K and V) plus the
    Q tile must stay under 227 KB; the fp32 accumulator and score tile,
    ``BLOCK_M * (d + BLOCK_N)`` floats, are spread over ``32 * num_warps``
    threads of at most 255 registers.  ``heavy`` (dropout or an additive bias:
    the Philox state and the bias tile are extra live registers) doubles the
    warps, or halves BLOCK_N for d = 128, which ptxas -v on sm_90a showed to
    remove the spills.  ``causal`` is part of the key for tuning; the
    starting table does not use it yet.
    """
    if interpreting(device):
        return 16, 32, 4, 1
    wide = dtype == torch.float32  # 4-byte tiles: halve BLOCK_N to keep the shared-memory footprint
    # Measured on an H200, bf16 (tile sweep of `flashtile bench tune`): 128x64 with
    # 8 warps wins at d = 64 for every N; at d = 128, 128x64 / 8 warps without a mask, 128x128 / 8 warps
    # under a causal or window mask from N = 4k (fewer diagonal tiles), and 64x64 / 4 warps causal at N <= 1k.
    if d <= 64:
        block_m, block_n, warps, stages = 128, 64 if not wide else 32, 8, 3
    elif d <= 128:
        if causal and nk <= 1024 and not wide:
            block_m, block_n, warps, stages = 64, 64, 4, 3
        else:
            # fp32: the Q tile and 3 stages of 128 x 64 K and V tiles need 256 KB, 2 stages 192 KB (of 227)
            block_m, block_n, warps, stages = 128, 128 if causal and not (wide or heavy) else 64, 8, 2 if wide else 3
    else:
        block_m, block_n, warps, stages = 64, 64 if not wide else 32, 8, 2
    if nq <= 64:  # decoding-like: a 128-row tile would be mostly padding
        block_m = 64
    return block_m, block_n, warps, stages


SMEM_BUDGET = 200 * 1024  # bytes of shared memory for the Q tile and the K/V pipeline (H100: 227 KB)
REG_BUDGET = 160  # fp32 registers per thread for the accumulator and the score tile (of 255)


def _autotune_configs() -> list[triton.Config]:
    """Search space of the FLASHTILE_AUTOTUNE=1 path, around :func:`fwd_config`'s table."""
    space = [
        (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 4, 4),
        (64, 64, 4, 3), (64, 64, 8, 2), (64, 128, 4, 2), (64, 32, 4, 2),
    ]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in space]


def _fits(block_m: int, block_n: int, num_warps: int, num_stages: int, block_d: int, esize: int) -> bool:
    """Shared memory: Q tile + ``num_stages - 1`` K/V tile pairs (Triton's pipeliner
    keeps num_stages - 1 loads in flight: 128x128 tiles at d = 128 with 3 stages,
    160 KB by this count, compile and run on Hopper's 227 KB, 224 KB would not);
    registers: the fp32 accumulator (BLOCK_M x d) and scores (BLOCK_M x BLOCK_N) per thread."""
    smem = (block_m + max(1, num_stages - 1) * 2 * block_n) * block_d * esize
    regs = block_m * (block_d + block_n) / (32 * num_warps)
    return smem <= SMEM_BUDGET and regs <= REG_BUDGET


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop the configs that cannot fit the head dim (``early_config_prune`` hook)."""
    block_d = kwargs["BLOCK_D"]
    esize = named_args["Q"].element_size()
    keep = [c for c in configs if _fits(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, block_d, esize)]
    return keep or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


@functools.cache
def _autotuned_kernel():
    # keyed on d, causal / window, Nq // 128, Nk // 128 and the register-heavy
    # features; the autotuner appends the tensor dtypes itself
    return triton.autotune(
        configs=_autotune_configs(),
        key=["head_dim", "HAS_LEFT", "HAS_RIGHT", "HAS_DROPOUT", "HAS_BIAS", "tune_nq", "tune_nk"],
        prune_configs_by={"early_config_prune": _prune},
    )(_fa2_fwd_kernel)


# --------------------------------------------------------------------------- #
# Python wrapper
# --------------------------------------------------------------------------- #
def _sparse_args(block_mask: BlockMask | None, b: int, hq: int, nq: int, nk: int, device, dummy: torch.Tensor):
    """Per-q-block kv block lists and their strides (stride 0 on a broadcast
    batch / head dim of the mask), plus the mask's (Br, Bc)."""
    if block_mask is None:
        return dummy, dummy, [0, 0, 0], [0, 0, 0], (1, 1)
    lists = kv_block_lists(block_mask, b, hq, nq, nk, device)
    counts, idx = lists.counts, lists.indices

    def strides(t: torch.Tensor) -> list[int]:
        return [st if n > 1 else 0 for st, n in zip(t.stride()[:2], t.shape[:2])] + [t.stride(2)]

    return counts, idx, strides(counts), strides(idx), lists.block_size


def _lowbit(x: int) -> int:
    """Largest power of two dividing x."""
    return x & -x


def _tiles(d: int, dtype: torch.dtype, right: int, nq: int, nk: int, device, heavy: bool, block_mask, page_size=0):
    """:func:`fwd_config`, with the tiles shrunk to divide a block mask's (Br, Bc)
    (both multiples of 16, so the tiles stay >= 16), and BLOCK_N to divide a K/V page."""
    block_m, block_n, num_warps, num_stages = fwd_config(d, dtype, right >= 0, nq, nk, device, heavy=heavy)
    if block_mask is not None:
        br, bc = block_mask.block_size
        block_m, block_n = min(block_m, _lowbit(br)), min(block_n, _lowbit(bc))
    if page_size:
        block_n = min(block_n, _lowbit(page_size))
    return block_m, block_n, num_warps, num_stages


def fwd_grid(b: int, hq: int, nq: int, block_m: int) -> tuple[int, int, int]:
    """Launch grid of the forward kernel: query tiles fastest, the B * Hq pairs folded in by
    :func:`flashtile.runtime.common.fold_grid` (any batch and head count within CUDA's grid limits)."""
    return fold_grid(triton.cdiv(nq, block_m), b * hq)


def fa2_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
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
    out: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 forward: returns ``(out, lse)``.  Trusts its caller: the arguments are
    those :mod:`flashtile.ops.validate` accepts (the public ops check them once).

    q: (B, Hq, Nq, d); k, v: (B, Hk, Nk, d), any strides (a non-unit stride on d
    is copied), one dtype among fp16 / bf16 / fp32, Hq a multiple of Hk,
    1 <= d <= 256; ``alibi_slopes`` float32 (Hq,) or (B, Hq) and ``bias``
    broadcastable to (B, Hq, Nq, Nk) on q's device; ``window_size`` ints >= -1,
    right bound ignored under ``causal``.  ``out`` (B, Hq, Nq, d) is in q's dtype (written into the
    given view when passed); ``lse`` (B, Hq, Nq) float32 is the natural-log
    sum-exp of the modified, masked scores, -inf on rows that see no key (whose
    output is 0).  Semantics of every option: :mod:`flashtile.reference.masks`.
    Dropout's Philox state: ``rng_state``, an int64 tensor [seed, offset] on q's
    device (read by the kernel: CUDA-graph safe), or the ints ``philox_seed`` /
    ``philox_offset``.

    Packed (variable-length) batch, when ``cu_seqlens_q`` is given: q (total_q, Hq, d),
    k, v (total_k, Hk, d) or, with ``block_table`` (B, max_pages) int32, paged
    (pages, page_size, Hk, d); ``cu_seqlens_q`` / ``cu_seqlens_k`` int32 (B + 1,) on q's device,
    ``max_seqlen_q`` / ``max_seqlen_k`` ints.  Sequence b is rows
    [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q (likewise of k, or keys
    0 .. cu_seqlens_k[b + 1] - cu_seqlens_k[b] - 1 of its pages); every option applies per
    sequence (causal bottom-right aligned per sequence).  Returns out (total_q, Hq, d) and lse
    (Hq, total_q).  The kernel clamps every cu_seqlens range to the tensors and to max_seqlen
    and every page index to the pool, so no value reads or writes outside them, and records a
    clamp in the device error word (``ERR_CU_SEQLENS`` / ``ERR_VARLEN_BLOCK_TABLE``, raised by
    ``flashtile.check_errors()``); ``flashtile.ops.validate.check_cu_seqlens_values`` checks the
    values on the host.
    Not with ``bias`` or ``block_mask``.
    """
    left, right = int(window_size[0]), 0 if causal else int(window_size[1])
    softmax_scale, softcap, dropout_p = float(softmax_scale), float(softcap), float(dropout_p)
    varlen = cu_seqlens_q is not None
    device = q.device
    if varlen:
        return _varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), block_table, out,
            softmax_scale=softmax_scale, left=left, right=right, softcap=softcap, alibi_slopes=alibi_slopes,
            dropout_p=dropout_p, philox_seed=philox_seed, philox_offset=philox_offset, rng_state=rng_state,
        )
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    shape = (b, hq, nq, d)
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=device)
    # stride 0 on broadcast dims: nothing is materialised
    bias_t = bias.expand(shape[:3] + (nk,)) if bias is not None else None
    bias_strides = bias_t.stride() if bias is not None else (0, 0, 0, 0)

    # the kernel writes through unit-stride-d views only; otherwise via a temporary
    target = out if out is not None and out.stride(-1) == 1 else torch.empty(shape, dtype=q.dtype, device=device)
    result = out if out is not None else target
    if b * hq * nq == 0:
        return result, lse
    if nk == 0:  # no keys: every row is empty (and a zero-size K has no pointer to launch with)
        result.zero_()
        lse.fill_(float("-inf"))
        return result, lse
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    if wide_rows(k, v):  # 32-bit in-tile offsets of the K/V tiles (q and out rows use 64-bit)
        k, v = k.contiguous(), v.contiguous()
    if bias is not None and bias_t.stride(3) >= TILE_ROW_STRIDE_MAX:  # the same for the bias's key axis
        bias_t = bias_t.contiguous()
        bias_strides = bias_t.stride()
    q, softmax_scale = _positive_scale(q, softmax_scale, softcap == 0 and alibi_slopes is None and bias is None)

    rng = check_rng_state(rng_state, int(philox_seed), int(philox_offset), device) if dropout_p > 0 else None
    sparse = _sparse_args(block_mask, b, hq, nq, nk, device, lse)
    extra = dict(bias_t=bias_t, alibi=alibi_slopes, counts=sparse[0], idx=sparse[1], rng=rng, softcap=softcap,
                 dropout_p=dropout_p)
    if os.environ.get("FLASHTILE_AUTOTUNE") == "1" and block_mask is None and not interpreting(device):
        ints, flags, _, per_call = _kernel_args(q, k, v, target, left, right, softcap, alibi_slopes, bias_t,
                                                bias_strides, block_mask, sparse, dropout_p, device)
        grid = lambda meta: fwd_grid(b, hq, nq, meta["BLOCK_M"])  # noqa: E731
        _autotuned_kernel()[grid](*_dynamic(q, k, v, target, lse, softmax_scale, per_call, **extra), *ints, **flags)
    else:
        grid, static, options, per_call = _launch_args(q, k, v, target, left, right, softcap, alibi_slopes, bias_t,
                                                       bias_strides, block_mask, sparse, dropout_p, device)
        launch(_fa2_fwd_kernel.fn, grid, _dynamic(q, k, v, target, lse, softmax_scale, per_call, **extra), static,
               **options)

    if result is not target:  # ``out`` had a non-unit stride on d
        result.copy_(target)
    return result, lse


def _dynamic(q, k, v, out, lse, softmax_scale: float, per_call: tuple, *, bias_t=None, alibi=None, counts=None,
             idx=None, rng=None, softcap: float = 0.0, dropout_p: float = 0.0) -> tuple:
    """The forward kernel's per-call arguments (fixed-length batch); what a feature leaves unread is ``lse``."""
    return (q, k, v, out, lse, lse if bias_t is None else bias_t, lse if alibi is None else alibi,
            lse if counts is None else counts, lse if idx is None else idx, lse if rng is None else rng,
            lse, lse, lse, lse, softmax_scale, softcap, dropout_p, *per_call)


def _kernel_args(q, k, v, out, left: int, right: int, softcap: float, alibi_slopes, bias_t, bias_strides, block_mask,
                 sparse, dropout_p: float, device):
    """(int arguments, keyword constexprs, (BLOCK_M, BLOCK_N, num_warps, num_stages), per-call ints) of a
    fixed-length forward on (B, H, N, d) views with unit stride on d; ``sparse``: :func:`_sparse_args` of
    ``block_mask``."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    s_ab = s_ah = 0
    if alibi_slopes is not None:  # (Hq,) broadcasts over the batch
        s_ab, s_ah = (0, alibi_slopes.stride(0)) if alibi_slopes.dim() == 1 else alibi_slopes.stride()
    heavy = dropout_p > 0 or bias_t is not None
    _, _, cnt_strides, idx_strides, (br, bc) = sparse
    tiles = _tiles(d, q.dtype, right, nq, nk, device, heavy, block_mask)
    block_d = max(16, triton.next_power_of_2(d))
    # the key count and K/V batch / head strides go per call: a decoding loop's growing cache keeps one binding
    per_call = (k.stride(0), k.stride(1), v.stride(0), v.stride(1), nk, nk // 128)
    ints = (
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(2),
        v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *bias_strides, s_ab, s_ah, *cnt_strides, *idx_strides,
        hq, b * hq, hq // hk, nq, d,
        0, 0, 0, 1, 1,  # total_q, total_k, stride_bt_b, page_size, n_pages: packed / paged batches only
        left, right,
        br, bc, nq // 128,
    )
    flags = dict(
        BLOCK_D=block_d,
        HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0,
        HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None, HAS_BIAS=bias_t is not None,
        HAS_DROPOUT=dropout_p > 0, IS_BLOCK_SPARSE=block_mask is not None, IS_VARLEN=False, PAGED=False,
        EVEN_D=block_d == d,
        DOT_PRECISION="tf32",  # fp32 inputs on TF32 tensor cores; fp16 / bf16 ignore it
        UPCAST_DOT=q.dtype == torch.bfloat16 and interpreting(device),
        KV_ALIGNED=aligned16(*per_call[:4]),
    )
    return ints, flags, tiles, per_call


def _launch_args(q, k, v, out, left: int, right: int, softcap: float, alibi_slopes, bias_t, bias_strides, block_mask,
                 sparse, dropout_p: float, device):
    """(grid, static arguments, launch options, per-call ints) of the bound forward launch: the ints of
    :func:`_kernel_args` and the constexprs in the kernel's order; EVEN_M / EVEN_N, which the kernel's
    ``triton.heuristics`` derives per call, are passed so that it can be bound once per signature."""
    ints, flags, (block_m, block_n, num_warps, num_stages), per_call = _kernel_args(
        q, k, v, out, left, right, softcap, alibi_slopes, bias_t, bias_strides, block_mask, sparse, dropout_p, device)
    b, hq, nq, _ = q.shape
    constexprs = (
        block_m, block_n, flags["BLOCK_D"], flags["HAS_LEFT"], flags["HAS_RIGHT"], flags["HAS_SOFTCAP"],
        flags["HAS_ALIBI"], flags["HAS_BIAS"], flags["HAS_DROPOUT"], flags["IS_BLOCK_SPARSE"], False, False,
        nq % block_m == 0, k.shape[2] % block_n == 0, flags["EVEN_D"], flags["DOT_PRECISION"], flags["UPCAST_DOT"],
        flags["KV_ALIGNED"],
    )
    options = dict(num_warps=num_warps, num_stages=num_stages)
    return fwd_grid(b, hq, nq, block_m), ints + constexprs, options, per_call


def plain_forward(q, k, v, out, lse, left: int, right: int):
    """A fixed-length forward without softcap, ALiBi, bias, dropout or block mask, prepared for the signature of
    these (B, H, N, d) views (``out`` (B, Hq, Nq, d), ``lse`` (B, Hq, Nq) float32, window ``left`` / ``right``):
    ``run(q, k, v, out, lse, softmax_scale)`` launches the kernel bound once (``runtime.launch.launcher``) on
    tensors of that signature (any views with their addresses) with ``softmax_scale > 0``.  None where
    :func:`fa2_forward` would do more than that one launch (no rows or keys, a non-unit stride on d, K / V rows
    too far apart for 32-bit tile offsets, autotuning)."""
    b, hq, nq, _ = q.shape
    if b * hq * nq == 0 or k.shape[2] == 0 or os.environ.get("FLASHTILE_AUTOTUNE") == "1":
        return None
    if any(x.stride(-1) != 1 and x.shape[-1] != 1 for x in (q, k, v, out)) or wide_rows(k, v):
        return None
    grid, static, options, per_call = _launch_args(q, k, v, out, left, right, 0.0, None, None, (0, 0, 0, 0), None,
                                                   _sparse_args(None, b, hq, nq, k.shape[2], q.device, None), 0.0,
                                                   q.device)
    bound = launcher(_fa2_fwd_kernel.fn, grid, _dynamic(q, k, v, out, lse, 1.0, per_call), static, **options)

    def run(q, k, v, out, lse, softmax_scale: float) -> None:
        bound(*_dynamic(q, k, v, out, lse, softmax_scale, per_call))

    return run


def _positive_scale(q: torch.Tensor, softmax_scale: float, plain: bool) -> tuple[torch.Tensor, float]:
    """The kernel's fast path (``plain``: no softcap, ALiBi or bias) takes the row max of unscaled
    scores and multiplies it by the scale, which needs a scale > 0 (0 * -inf is NaN on masked rows):
    (-q)·k |scale| is the same score exactly (negation is exact), and a zero scale makes every
    score 0, as zero queries at scale 1 do."""
    if plain and softmax_scale <= 0:
        return (-q, -softmax_scale) if softmax_scale < 0 else (torch.zeros_like(q), 1.0)
    return q, softmax_scale


def _varlen_forward(
    q, k, v, cu_q, cu_k, max_q, max_k, block_table, out, *, softmax_scale, left, right, softcap, alibi_slopes,
    dropout_p, philox_seed, philox_offset, rng_state,
):
    """:func:`fa2_forward` on a packed batch: the same kernel with IS_VARLEN (and PAGED with a block table)."""
    total_q, hq, d = q.shape
    paged = block_table is not None
    hk = k.shape[-2]
    b = cu_q.shape[0] - 1
    device = q.device
    lse = torch.empty((hq, total_q), dtype=torch.float32, device=device)
    target = out if out is not None and out.stride(-1) == 1 else torch.empty(q.shape, dtype=q.dtype, device=device)
    result = out if out is not None else target
    total_k = k.shape[0] * k.shape[1] if paged else k.shape[0]
    if total_q == 0:
        return result, lse
    if b == 0 or max_q == 0 or hq == 0 or (paged and total_k == 0):
        # no program has a row to write (or no page to read): rows left over see no key
        result.zero_()
        lse.fill_(float("-inf"))
        return result, lse
    q, k, v = unit_last_stride(q), unit_last_stride(k), unit_last_stride(v)
    if total_k == 0:  # every key range clamps to empty, so K/V are never read: q stands in for their pointer
        k = v = q[:0]
        max_k = 0
    q, softmax_scale = _positive_scale(q, softmax_scale, softcap == 0 and alibi_slopes is None)
    # the kernel's (batch, heads, rows, d) views: one packed "batch" of total rows, or (pages, H, page_size, d)
    qv, ov = q.transpose(0, 1).unsqueeze(0), target.transpose(0, 1).unsqueeze(0)
    if paged:
        kv_, vv = k.transpose(1, 2), v.transpose(1, 2)
        page_size, n_pages = k.shape[1], k.shape[0]
        bt, stride_bt = block_table, block_table.stride(0)
        total_k = 2**31 - 1  # keys are reached through pages: lengths are clamped to max_seqlen_k only
    else:
        kv_, vv = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        page_size, n_pages, bt, stride_bt = 0, 1, lse, 0
    if wide_rows(kv_, vv):  # 32-bit in-tile offsets of the K/V tiles, as in the fixed-length path
        kv_, vv = kv_.contiguous(), vv.contiguous()
    alibi, s_ab, s_ah = lse, 0, 0
    if alibi_slopes is not None:
        alibi = alibi_slopes
        s_ab, s_ah = (0, alibi.stride(0)) if alibi.dim() == 1 else alibi.stride()
    heavy = dropout_p > 0
    block_m, block_n, num_warps, num_stages = _tiles(d, q.dtype, right, max_q, max_k, device, heavy, None, page_size)
    block_d = max(16, triton.next_power_of_2(d))
    rng = check_rng_state(rng_state, int(philox_seed), int(philox_offset), device) if dropout_p > 0 else lse
    err = error_flags(device, caller="flash_attn_varlen_func")  # exists already under CUDA-graph capture, or raises
    per_call = (kv_.stride(0), kv_.stride(1), vv.stride(0), vv.stride(1), max_k, max_k // 128)
    dynamic = (qv, kv_, vv, ov, lse, lse, alibi, lse, lse, rng, cu_q, cu_k, bt, err, softmax_scale, softcap,
               dropout_p, *per_call)
    ints = (
        0, qv.stride(1), qv.stride(2),
        kv_.stride(2),
        vv.stride(2),
        0, ov.stride(1), ov.stride(2),
        0, 0, 0, 0, s_ab, s_ah, 0, 0, 0, 0, 0, 0,
        hq, b * hq, hq // hk, max_q, d,
        total_q, total_k, stride_bt, max(page_size, 1), n_pages,
        left, right,
        1, 1, max_q // 128,
    )
    constexprs = (
        block_m, block_n, block_d, left >= 0, right >= 0, softcap > 0, alibi_slopes is not None, False,
        dropout_p > 0, False, True, paged, False, False, block_d == d, "tf32",
        q.dtype == torch.bfloat16 and interpreting(device), aligned16(*per_call[:4]),
    )
    launch(_fa2_fwd_kernel.fn, fwd_grid(b, hq, max_q, block_m), dynamic, ints + constexprs,
           num_warps=num_warps, num_stages=num_stages)
    if result is not target:
        result.copy_(target)
    return result, lse
