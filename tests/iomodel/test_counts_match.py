"""The instrumented references count exactly what the closed forms of flashtile.iomodel say.

Each test runs a reference algorithm of :mod:`flashtile.reference` on a
hypothesis-drawn problem (shape, GQA, SRAM size / tiles, masks) and checks
its ``counts.reads + counts.writes`` against the matching closed form of
:mod:`flashtile.iomodel.hbm` -- an exact integer equality, so any change to
either side's loop structure shows up here.  References sum their counts over
batch and query heads; the closed forms get ``batch`` and ``heads`` (or the
mask's leading dims) to do the same.  Shapes stay small: the references are
float64 Python loops over tiles.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtile.iomodel import (
    attention_flops,
    backward_hbm,
    block_sparse_hbm,
    causal_pairs,
    decoding_hbm,
    decoding_reads_writes,
    fa1_block_sizes,
    fa1_hbm,
    fa1_init_writes,
    fa2_hbm,
    fa2_visited_blocks,
    softmax_accesses,
    standard_hbm,
)
from flashtile.reference.attention import block_sparse_flash_attn, flash_attn1, flash_attn2, standard_attention
from flashtile.reference.backward import flash_attn_backward
from flashtile.reference.decoding import flash_decoding
from flashtile.reference.masks import BlockMask
from flashtile.reference.softmax import block_online_softmax, naive_softmax, online_softmax, safe_softmax

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def problems(draw, max_n: int = 40):
    """q (B, Hq, Nq, d), k and v (B, Hk, Nk, d) with Hq = g * Hk, from a seeded generator."""
    b, hk, g = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    nq, nk, d = draw(st.integers(1, max_n)), draw(st.integers(1, max_n)), draw(st.integers(1, 16))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(b, hk * g, nq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hk, nk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, hk, nk, d, generator=gen, dtype=torch.float64)
    return q, k, v, gen


@st.composite
def windows(draw):
    """(causal, window_size), including one-sided and empty-band windows."""
    causal = draw(st.booleans())
    left = draw(st.integers(-1, 12))
    right = 0 if causal else draw(st.integers(-1, 12))
    return causal, (left, right)


def random_block_mask(draw, gen, b: int, hq: int, nq: int, nk: int, br: int, bc: int) -> BlockMask:
    """A random BlockMask with leading dims (), (Hq,) or (B, 1): one grid per head or broadcast."""
    lead = draw(st.sampled_from([(), (hq,), (b, 1)]))
    density = draw(st.sampled_from([0.2, 0.6, 1.0]))
    grid = (-(-nq // br), -(-nk // bc))
    return BlockMask(torch.rand(*lead, *grid, generator=gen) < density, (br, bc))


def dims(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int]:
    b, hq, nq, d = q.shape
    return b, hq, nq, k.shape[2], d


# -- Algorithm 0 and FA1 ---------------------------------------------------------------------------


@SETTINGS
@given(prob=problems(), mask=windows())
def test_standard_attention(prob, mask):
    q, k, v, _ = prob
    b, hq, nq, nk, d = dims(q, k)
    causal, window = mask
    res = standard_attention(q, k, v, causal=causal, window_size=window)
    # Algorithm 0 materialises all of S and P whatever the mask.
    assert res.counts.hbm == standard_hbm(nq, nk, d, batch=b, heads=hq)
    assert res.counts.flops == attention_flops(b, hq, nq, nk, d)


@SETTINGS
@given(prob=problems(max_n=30), data=st.data())
def test_flash_attn1_with_sram_size(prob, data):
    q, k, v, _ = prob
    b, hq, nq, nk, d = dims(q, k)
    m = data.draw(st.integers(d, 4 * d * 12), label="sram_size")
    causal, window = data.draw(windows(), label="mask")
    res = flash_attn1(q, k, v, sram_size=m, causal=causal, window_size=window)
    assert res.counts.reads + res.counts.writes == fa1_hbm(nq, nk, d, sram_size=m, batch=b, heads=hq)
    assert res.counts.extras["init_writes"] == fa1_init_writes(nq, d, batch=b, heads=hq)
    assert (res.counts.extras["block_rows"], res.counts.extras["block_cols"]) == fa1_block_sizes(m, d)
    assert res.counts.flops == attention_flops(b, hq, nq, nk, d)  # Algorithm 1 skips nothing


@SETTINGS
@given(prob=problems(), br=st.integers(1, 16), bc=st.integers(1, 16))
def test_flash_attn1_with_block_sizes(prob, br, bc):
    q, k, v, _ = prob
    b, hq, nq, nk, d = dims(q, k)
    res = flash_attn1(q, k, v, block_sizes=(br, bc))
    assert res.counts.hbm == fa1_hbm(nq, nk, d, block_sizes=(br, bc), batch=b, heads=hq)


@SETTINGS
@given(prob=problems(), br=st.integers(1, 12), bc=st.integers(1, 12), data=st.data())
def test_block_sparse_flash_attn(prob, br, bc, data):
    q, k, v, gen = prob
    b, hq, nq, nk, d = dims(q, k)
    bm = random_block_mask(data.draw, gen, b, hq, nq, nk, br, bc)
    res = block_sparse_flash_attn(q, k, v, bm)
    assert res.counts.hbm == block_sparse_hbm(bm, d, nq, nk, batch=b, heads=hq)
    kept = int(torch.broadcast_to(bm.mask, (b, hq, *bm.shape)).sum())
    assert res.counts.visited_blocks == kept


# -- FA2 forward and the backward ------------------------------------------------------------------


@st.composite
def tiled_case(draw):
    """A problem with tiles and any mix of causal / window / block mask."""
    q, k, v, gen = draw(problems())
    b, hq, nq, nk, _ = dims(q, k)
    causal, window = draw(windows())
    br, bc = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    bm = random_block_mask(draw, gen, b, hq, nq, nk, br, bc) if draw(st.booleans()) else None
    return q, k, v, causal, window, (br, bc), bm


@SETTINGS
@given(case=tiled_case())
def test_flash_attn2(case):
    q, k, v, causal, window, tiles, bm = case
    b, hq, nq, nk, d = dims(q, k)
    kw = dict(causal=causal, window_size=window, block_mask=bm)
    res = flash_attn2(q, k, v, block_sizes=None if bm is not None else tiles, **kw)
    model = dict(block_sizes=None if bm is not None else tiles, batch=b, heads=hq, **kw)
    assert res.counts.hbm == fa2_hbm(nq, nk, d, **model)
    assert res.counts.visited_blocks == fa2_visited_blocks(nq, nk, **model)
    if causal and window[0] < 0 and bm is None:
        # the visited tiles cover every allowed pair, so the work is at least the exact causal work
        assert res.counts.flops >= 4 * d * b * hq * causal_pairs(nq, nk)


@SETTINGS
@given(case=tiled_case())
def test_flash_attn_backward(case):
    q, k, v, causal, window, tiles, bm = case
    b, hq, nq, nk, d = dims(q, k)
    kw = dict(causal=causal, window_size=window, block_mask=bm)
    fwd = flash_attn2(q, k, v, **kw)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(nq * nk + d), dtype=torch.float64)
    res = flash_attn_backward(q, k, v, fwd.out, dout, fwd.lse, block_sizes=tiles, **kw)
    model = dict(block_sizes=None if bm is not None else tiles, batch=b, heads=hq, **kw)
    assert res.counts.reads + res.counts.writes == backward_hbm(nq, nk, d, **model)
    visited = fa2_visited_blocks(nq, nk, **model)
    assert res.counts.visited_blocks == visited
    if not causal and window == (-1, -1) and bm is None:
        assert res.counts.flops == attention_flops(b, hq, nq, nk, d, mode="bwd")


# -- decoding and softmax -------------------------------------------------------------------------------


@SETTINGS
@given(prob=problems(max_n=60), nq=st.integers(1, 4), splits=st.integers(1, 7), data=st.data())
def test_flash_decoding(prob, nq, splits, data):
    q, k, v, _ = prob
    q = q[:, :, :nq]  # decoding: a few query rows (fewer if the drawn problem has fewer)
    b, hq, nq, nk, d = dims(q, k)
    lengths = data.draw(st.lists(st.integers(0, nk), min_size=b, max_size=b), label="cache_seqlens")
    res = flash_decoding(q, k, v, num_splits=splits, cache_seqlens=torch.tensor(lengths))
    per_head = [decoding_reads_writes(nq, L, d, splits) for L in lengths]
    assert res.counts.reads == hq * sum(rw.reads for rw in per_head)
    assert res.counts.writes == hq * sum(rw.writes for rw in per_head)
    assert res.counts.hbm == hq * sum(decoding_hbm(nq, L, d, splits) for L in lengths)


@pytest.mark.parametrize("variant", ["naive", "safe", "online", "block_online"])
@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(0, 50), block=st.integers(1, 16))
def test_softmax_variants(variant, rows, n, block):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows * 100 + n), dtype=torch.float64)
    fn = {
        "naive": naive_softmax,
        "safe": safe_softmax,
        "online": online_softmax,
        "block_online": lambda t: block_online_softmax(t, block),
    }[variant]
    assert fn(x).counts.hbm == softmax_accesses(n, variant, rows=rows)
