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
from flashtile.runtime.launch import launch

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


def _tiles(d: int, dtype: torch.dtype, right: int, nq: int, nk: int, device, heavy: bool, block_mask):
    """:func:`fwd_config`, with the tiles shrunk to divide a block mask's (Br, Bc)
    (both multiples of 16, so the tiles stay >= 16)."""
    block_m, block_n, num_warps, num_stages = fwd_config(d, dtype, right >= 0, nq, nk, device, heavy=heavy)
    if block_mask is not None:
        br, bc = block_mask.block_size
        block_m, block_n = min(block_m, _lowbit(br)), min(block_n, _lowbit(bc))
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
    """
    left, right = int(window_size[0]), 0 if causal else int(window_size[1])
    softmax_scale, softcap, dropout_p = float(softmax_scale), float(softcap), float(dropout_p)
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    device = q.device
    shape = (b, hq, nq, d)
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=device)
    alibi, s_ab, s_ah = lse, 0, 0
    if alibi_slopes is not None:  # (Hq,) broadcasts over the batch
        alibi = alibi_slopes
        s_ab, s_ah = (0, alibi.stride(0)) if alibi.dim() == 1 else alibi.stride()
    # stride 0 on broadcast dims: nothing is materialised
    bias_t = bias.expand(shape[:3] + (nk,)) if bias is not None else lse
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
    plain = softcap == 0 and alibi_slopes is None and bias is None
    if plain and softmax_scale <= 0:
        # the kernel's fast path takes the row max of unscaled scores and multiplies
        # it by the scale, which needs a scale > 0 (0 * -inf is NaN on masked rows):
        # (-q)·k |scale| is the same score exactly (negation is exact), and a zero
        # scale makes every score 0, as zero queries at scale 1 do
        q, softmax_scale = (-q, -softmax_scale) if softmax_scale < 0 else (torch.zeros_like(q), 1.0)

    heavy = dropout_p > 0 or bias is not None
    block_m, block_n, num_warps, num_stages = _tiles(d, q.dtype, right, nq, nk, device, heavy, block_mask)
    counts, idx, cnt_strides, idx_strides, (br, bc) = _sparse_args(block_mask, b, hq, nq, nk, device, lse)
    block_d = max(16, triton.next_power_of_2(d))
    rng = check_rng_state(rng_state, int(philox_seed), int(philox_offset), device) if dropout_p > 0 else lse
    dynamic = (q, k, v, target, lse, bias_t, alibi, counts, idx, rng, softmax_scale, softcap, dropout_p)
    ints = (
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        target.stride(0), target.stride(1), target.stride(2),
        *bias_strides, s_ab, s_ah, *cnt_strides, *idx_strides,
        hq, b * hq, hq // hk, nq, nk, d,
        left, right,
        br, bc, nq // 128, nk // 128,
    )
    flags = dict(
        BLOCK_D=block_d,
        HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0,
        HAS_SOFTCAP=softcap > 0, HAS_ALIBI=alibi_slopes is not None, HAS_BIAS=bias is not None,
        HAS_DROPOUT=dropout_p > 0, IS_BLOCK_SPARSE=block_mask is not None,
        EVEN_D=block_d == d,
        DOT_PRECISION="tf32",  # fp32 inputs on TF32 tensor cores; fp16 / bf16 ignore it
        UPCAST_DOT=q.dtype == torch.bfloat16 and interpreting(device),
    )
    if os.environ.get("FLASHTILE_AUTOTUNE") == "1" and block_mask is None and not interpreting(device):
        grid = lambda meta: fwd_grid(b, hq, nq, meta["BLOCK_M"])  # noqa: E731
        _autotuned_kernel()[grid](*dynamic, *ints, **flags)
    else:
        # EVEN_M / EVEN_N, which the kernel's ``triton.heuristics`` derives per call, are passed
        # here so the kernel can be bound once per signature (the Philox state is a tensor)
        constexprs = (
            block_m, block_n, block_d, flags["HAS_LEFT"], flags["HAS_RIGHT"], flags["HAS_SOFTCAP"],
            flags["HAS_ALIBI"], flags["HAS_BIAS"], flags["HAS_DROPOUT"], flags["IS_BLOCK_SPARSE"],
            nq % block_m == 0, nk % block_n == 0, flags["EVEN_D"], flags["DOT_PRECISION"], flags["UPCAST_DOT"],
        )
        launch(_fa2_fwd_kernel.fn, fwd_grid(b, hq, nq, block_m), dynamic, ints + constexprs,
               num_warps=num_warps, num_stages=num_stages)

    if result is not target:  # ``out`` had a non-unit stride on d
        result.copy_(target)
    return result, lse
