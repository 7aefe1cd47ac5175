"""Tests of the closed-form HBM counts and FLOP counts (flashtile.iomodel.hbm / flops).

All quantities are exact integers, so equalities are exact; the only
tolerances are the Theta-form constants, which come from the bounds
derived in the docstrings (quoted at each test).
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flashtile.iomodel import (
    attention_flops,
    backward_hbm,
    block_sparse_hbm,
    block_sparse_hbm_bound,
    causal_pairs,
    decoding_hbm,
    decoding_reads_writes,
    exact_causal_fraction,
    fa1_block_sizes,
    fa1_hbm,
    fa1_hbm_theorem2,
    fa1_init_writes,
    fa2_hbm,
    fa2_visited_blocks,
    lower_bound_hbm,
    softmax_accesses,
    standard_hbm,
    to_bytes,
)
from flashtile.reference.masks import BlockMask, allowed_mask

FAST = settings(max_examples=60, deadline=None)


# -- a literal loop simulation of the tiled algorithms, independent of the closed forms --


def simulate_fa1(nq: int, nk: int, d: int, br: int, bc: int) -> int:
    """Walk FA1 Algorithm 1 block by block and add up every load and store."""
    hbm = 0
    for c0 in range(0, nk, bc):
        hbm += 2 * (min(c0 + bc, nk) - c0) * d  # K_j, V_j
        for r0 in range(0, nq, br):
            rows = min(r0 + br, nq) - r0
            hbm += rows * d + rows * d + 2 * rows  # load Q_i, O_i, l_i, m_i
            hbm += rows * d + 2 * rows  # store O_i, l_i, m_i
    return hbm


def dense_visited(nq, nk, br, bc, causal=False, window=(-1, -1), block_mask=None) -> torch.Tensor:
    """Visited tiles from the element mask of masks.py: a tile is visited iff it has an allowed element."""
    allowed = allowed_mask(nq, nk, causal=causal, window_size=window, block_mask=block_mask)
    return BlockMask.from_element_mask(allowed, (br, bc)).mask


# -- softmax and Algorithm 0 ----------------------------------------------------------------


def test_softmax_accesses_per_element_and_ratio():
    assert [softmax_accesses(10, v) for v in ("naive", "safe", "online", "block_online")] == [30, 40, 30, 30]
    assert Fraction(softmax_accesses(77, "safe"), softmax_accesses(77, "online")) == Fraction(4, 3)
    assert softmax_accesses(5, "safe", rows=3) == 60


def test_standard_hbm_is_4nd_plus_4n2():
    for n, d in [(1, 1), (128, 64), (1000, 96)]:
        assert standard_hbm(n, n, d) == 4 * n * d + 4 * n * n
    assert standard_hbm(3, 5, 2) == 2 * 8 * 2 + 4 * 15
    assert standard_hbm(3, 5, 2, batch=2, heads=4) == 8 * standard_hbm(3, 5, 2)


# -- FA1 -----------------------------------------------------------------------------------------


def test_fa1_block_sizes_two_regimes():
    # M <= 4 d^2: Br = Bc = ceil(M / 4d); M > 4 d^2: Br capped at d.
    assert fa1_block_sizes(4 * 64 * 64, 64) == (64, 64)
    assert fa1_block_sizes(1000, 64) == (4, 4)
    assert fa1_block_sizes(64, 64) == (1, 1)
    assert fa1_block_sizes(100_000, 64) == (64, 391)


@FAST
@given(d=st.integers(1, 128), extra=st.integers(0, 5000), t=st.integers(1, 6))
def test_fa1_equals_theorem2_when_blocks_divide(d, extra, t):
    m = d + extra
    br, bc = fa1_block_sizes(m, d)
    n = math.lcm(br, bc) * t
    assert fa1_hbm(n, n, d, sram_size=m) == fa1_hbm_theorem2(n, d, m)


@FAST
@given(n=st.integers(1, 300), d=st.integers(1, 64), extra=st.integers(0, 3000))
def test_theorem2_overcounts_partial_blocks(n, d, extra):
    m = d + extra
    exact = fa1_hbm(n, n, d, sram_size=m)
    assert fa1_hbm_theorem2(n, d, m) >= exact


@FAST
@given(nq=st.integers(0, 90), nk=st.integers(0, 90), d=st.integers(1, 16), br=st.integers(1, 40), bc=st.integers(1, 40))
def test_fa1_closed_form_matches_loop_simulation(nq, nk, d, br, bc):
    assert fa1_hbm(nq, nk, d, block_sizes=(br, bc)) == simulate_fa1(nq, nk, d, br, bc)
    assert fa1_init_writes(nq, d) == nq * d + 2 * nq


@st.composite
def n_d_m(draw, regime: str):
    """(N, d, M) with M in [d, N d] (Proposition 3's range) and in the given SRAM regime."""
    d = draw(st.integers(1, 256))
    n = draw(st.integers(1, 8192))
    lo, hi = (d, min(4 * d * d, n * d)) if regime == "small" else (4 * d * d + 1, n * d)
    assume(lo <= hi)
    return n, d, draw(st.integers(lo, hi))


@pytest.mark.parametrize("regime", ["small", "large"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_fa1_is_theta_n2d2_over_m_in_both_regimes(regime, data):
    # Tc in [4Nd/(M + 4d), 4Nd/M + 1] gives 12M/(M + 4d) >= 2.4 <= ratio <= 12 + 16/d + 3 + 4/d + 2 <= 37.
    n, d, m = data.draw(n_d_m(regime))
    ratio = fa1_hbm(n, n, d, sram_size=m) / lower_bound_hbm(n, d, m)
    assert 2.4 <= ratio <= 37.0
    # Proposition 3 up to the constant: FA1 is never below the lower-bound order.
    assert fa1_hbm(n, n, d, sram_size=m) >= 2 * lower_bound_hbm(n, d, m)


@FAST
@given(d=st.integers(1, 128), bc=st.integers(1, 64), k=st.integers(32, 200))
def test_doubling_m_halves_the_quadratic_term(d, bc, k):
    # M a multiple of 4d makes Bc = M/4d exactly, so 2M gives Bc' = 2Bc; with N >= 32 Bc
    # the ceilings move the ratio Tc/Tc' at most to [2/(1 + 1/16), 2 + 1/16].
    m = 4 * d * bc
    n = k * bc + (k % 7)
    quad = [fa1_hbm(n, n, d, sram_size=mm) - 2 * n * d for mm in (m, 2 * m)]
    assert 1.88 <= quad[0] / quad[1] <= 2.0625


@FAST
@given(d=st.integers(1, 128), extra=st.integers(0, 50_000), k=st.integers(16, 64))
def test_standard_dominates_fa1_for_large_sram(d, extra, k):
    # M >= 16 d^2 gives Bc >= 4d, so FA1 ~ 2Nd + (N/4d)(3Nd + 4N) < 4Nd + 4N^2.
    m = 16 * d * d + extra
    n = max(k * d, -(-m // d))  # keep M <= N d
    assert fa1_hbm(n, n, d, sram_size=m) < standard_hbm(n, n, d)


def test_fa1_is_worse_than_standard_with_tiny_sram():
    # M = d gives Bc = 1: K, V read once but O, l, m re-read for every key: 3 N^2 d > 4 N^2 for d >= 2.
    for n, d in [(64, 2), (256, 64)]:
        assert fa1_hbm(n, n, d, sram_size=d) > standard_hbm(n, n, d)


# -- block-sparse ---------------------------------------------------------------------------------


@FAST
@given(
    tr=st.integers(1, 8),
    tc=st.integers(1, 8),
    br=st.integers(1, 16),
    bc=st.integers(1, 16),
    d=st.integers(1, 32),
    seed=st.integers(0, 2**16),
    density=st.floats(0.0, 1.0),
)
def test_block_sparse_scales_with_kept_blocks(tr, tc, br, bc, d, seed, density):
    n_q, n_k = tr * br, tc * bc
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(tr, tc, generator=g) < density
    keep[0, :] = True  # every key column nonempty, so K/V traffic is fixed at 2 Nk d
    bm = BlockMask(keep, (br, bc))
    dense = fa1_hbm(n_q, n_k, d, block_sizes=(br, bc))
    assert block_sparse_hbm(BlockMask.dense(n_q, n_k, (br, bc)), d, n_q, n_k) == dense
    sparse_quad = block_sparse_hbm(bm, d, n_q, n_k) - 2 * n_k * d
    # The quadratic term is exactly the kept fraction s of the dense one.
    assert Fraction(sparse_quad, dense - 2 * n_k * d) == Fraction(int(keep.sum()), tr * tc)


def test_block_sparse_partial_blocks_and_empty_columns():
    # Nq = 10, Nk = 7 with 4 x 3 blocks: rows 4, 4, 2 and columns 3, 3, 1.
    keep = torch.tensor([[1, 0, 0], [0, 0, 0], [1, 0, 1]], dtype=torch.bool)
    d = 5
    want = 2 * 3 * d + (3 * 4 * d + 4 * 4) + (3 * 2 * d + 4 * 2)  # column 0: rows 0 and 2
    want += 2 * 1 * d + (3 * 2 * d + 4 * 2)  # column 2: row 2; column 1 is never loaded
    assert block_sparse_hbm(BlockMask(keep, (4, 3)), d, 10, 7) == want
    assert block_sparse_hbm(BlockMask(torch.zeros(3, 3, dtype=torch.bool), (4, 3)), d, 10, 7) == 0


def test_block_sparse_leading_dims_are_heads():
    m = BlockMask.random(40, 40, 0.5, 8, generator=torch.Generator().manual_seed(1))
    two = BlockMask(torch.stack([m.mask, ~m.mask]), m.block_size)
    assert block_sparse_hbm(two, 4, 40, 40) == block_sparse_hbm(m, 4, 40, 40) + block_sparse_hbm(~m, 4, 40, 40)
    # (1, 2, Tr, Tc) broadcast over batch 3: each head counted 3 times.
    b3 = BlockMask(two.mask.unsqueeze(0), m.block_size)
    assert block_sparse_hbm(b3, 4, 40, 40, batch=3, heads=2) == 3 * block_sparse_hbm(two, 4, 40, 40)
    with pytest.raises(ValueError, match="broadcast"):
        block_sparse_hbm(b3, 4, 40, 40, batch=3, heads=5)


def test_block_sparse_bound_is_linear_in_s():
    n, d, m = 4096, 64, 24576
    base = block_sparse_hbm_bound(n, d, m, 0.0)
    assert base == n * d
    assert block_sparse_hbm_bound(n, d, m, 1.0) - base == pytest.approx(n * n * d * d / m)
    assert block_sparse_hbm_bound(n, d, m, 0.25) - base == pytest.approx(0.25 * (n * n * d * d / m))


# -- FA2 and the backward --------------------------------------------------------------------------


@FAST
@given(
    nq=st.integers(0, 70),
    nk=st.integers(0, 70),
    br=st.integers(1, 20),
    bc=st.integers(1, 20),
    causal=st.booleans(),
    left=st.integers(-1, 30),
    right=st.integers(-1, 30),
    density=st.sampled_from([None, 0.3, 0.8]),
    seed=st.integers(0, 2**16),
)
def test_visited_tiles_match_the_element_mask(nq, nk, br, bc, causal, left, right, density, seed):
    window = (left, 0 if causal and right != -1 else right)
    bm = None
    if density is not None:
        bm = BlockMask.random(nq, nk, density, (br, bc), generator=torch.Generator().manual_seed(seed))
    want = int(dense_visited(nq, nk, br, bc, causal, window, bm).sum())
    assert fa2_visited_blocks(nq, nk, block_sizes=(br, bc), causal=causal, window_size=window, block_mask=bm) == want


@pytest.mark.parametrize("n,b", [(256, 64), (1000, 64), (4096, 128), (100, 7)])
def test_fa2_causal_visits_about_half(n, b):
    t = -(-n // b)
    visited = fa2_visited_blocks(n, n, block_sizes=(b, b), causal=True)
    assert visited == t * (t + 1) // 2  # the diagonal tiles are kept: (T + 1) / 2T of them
    assert abs(visited / t**2 - 0.5) <= 1 / (2 * t)
    full, causal = (fa2_hbm(n, n, 64, block_sizes=(b, b), causal=c) for c in (False, True))
    q_o_lse = 2 * n * 64 + n  # not affected by the mask
    # K/V traffic: row block i reads the i + 1 key blocks 0..i (the last one partial).
    partial = n - (t - 1) * b
    kv_causal = sum(2 * 64 * (i * b + (partial if i == t - 1 else b)) for i in range(t))
    assert causal - q_o_lse == kv_causal
    if n % b == 0:
        assert Fraction(causal - q_o_lse, full - q_o_lse) == Fraction(t + 1, 2 * t)


def test_fa2_dense_closed_form_and_example():
    # no mask: 2 Nq d + Nq + 2 Tr Nk d (K, V once per query block)
    for nq, nk, d, br, bc in [(100, 70, 8, 16, 32), (64, 64, 64, 64, 64), (1, 500, 16, 64, 64)]:
        tr = -(-nq // br)
        assert fa2_hbm(nq, nk, d, block_sizes=(br, bc)) == 2 * nq * d + nq + 2 * tr * nk * d
    # Nq = Nk = 8, 4 x 4 tiles, d = 2, window (0, 0): only the 2 diagonal tiles are visited.
    assert fa2_hbm(8, 8, 2, block_sizes=(4, 4), window_size=(0, 0)) == 2 * (8 + 16 + 8 + 4)


def test_fa2_block_mask_tiles_and_heads():
    bm = BlockMask.causal(50, 70, 16)
    assert fa2_hbm(50, 70, 4, block_mask=bm) == fa2_hbm(50, 70, 4, block_sizes=(16, 16), causal=True)
    assert fa2_hbm(50, 70, 4, block_mask=bm, batch=2, heads=3) == 6 * fa2_hbm(50, 70, 4, block_mask=bm)
    with pytest.raises(ValueError, match="block_mask.block_size"):
        fa2_hbm(50, 70, 4, block_mask=bm, block_sizes=(32, 32))


@FAST
@given(nq=st.integers(1, 90), nk=st.integers(1, 90), d=st.integers(1, 16), br=st.integers(1, 32), bc=st.integers(1, 32))
def test_backward_closed_form(nq, nk, d, br, bc):
    tc = -(-nk // bc)
    dense = 2 * nq * d + nq + 4 * nk * d + tc * (4 * nq * d + 2 * nq)
    assert backward_hbm(nq, nk, d, block_sizes=(br, bc)) == dense
    # Causal visits a subset of the tiles (the same ones as the forward), so it never costs more.
    causal = backward_hbm(nq, nk, d, block_sizes=(br, bc), causal=True)
    assert causal <= dense
    nothing = BlockMask(torch.zeros(-(-nq // br), tc, dtype=torch.bool), (br, bc))
    assert backward_hbm(nq, nk, d, block_mask=nothing) == 2 * nq * d + nq + 4 * nk * d


# -- decoding ---------------------------------------------------------------------------------------


def test_decoding_reads_and_writes():
    rw = decoding_reads_writes(2, 1000, 64, 4)
    assert rw.reads == 2 * 64 + 2 * 1000 * 64 + 4 * 2 * 65
    assert rw.writes == 4 * 2 * 65 + 2 * 64 + 2
    assert decoding_hbm(2, 1000, 64, 4) == rw.total
    # each extra split costs one partial (O, LSE) written and read back per query row
    assert decoding_hbm(3, 500, 32, 9) - decoding_hbm(3, 500, 32, 1) == 8 * 2 * 3 * 33


# -- FLOPs --------------------------------------------------------------------------------------------


def test_attention_flops_conventions():
    fwd = attention_flops(2, 8, 1024, 1024, 64)
    assert fwd == 4 * 2 * 8 * 1024 * 1024 * 64
    assert attention_flops(2, 8, 1024, 1024, 64, causal=True) * 2 == fwd
    assert attention_flops(2, 8, 1024, 1024, 64, mode="bwd") == 2.5 * fwd
    assert attention_flops(2, 8, 1024, 1024, 64, mode="fwd_bwd") == 3.5 * fwd
    assert attention_flops(1, 1, 3, 5, 7, causal=True, mode="bwd") == 5 * 3 * 5 * 7


@FAST
@given(nq=st.integers(0, 60), nk=st.integers(0, 60))
def test_exact_causal_fraction_counts_allowed_pairs(nq, nk):
    assert causal_pairs(nq, nk) == int(allowed_mask(nq, nk, causal=True).sum())
    if nq == nk and nq:
        assert exact_causal_fraction(nq, nk) == pytest.approx((nq + 1) / (2 * nq), rel=1e-15)


# -- bytes and bad input ----------------------------------------------------------------------------


def test_to_bytes():
    assert to_bytes(100, 2) == 200
    assert to_bytes(100, "fp32") == 400
    assert to_bytes(standard_hbm(64, 64, 64), "bf16") == 2 * standard_hbm(64, 64, 64)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: standard_hbm(-1, 4, 4), ValueError, "nq"),
        (lambda: standard_hbm(4, 4, 0), ValueError, "d must be"),
        (lambda: standard_hbm(4.0, 4, 4), TypeError, "nq"),
        (lambda: standard_hbm(True, 4, 4), TypeError, "nq"),
        (lambda: fa1_block_sizes(63, 64), ValueError, "sram_size"),
        (lambda: fa1_block_sizes(64, 0), ValueError, "d must be"),
        (lambda: fa1_hbm(8, 8, 4), ValueError, "exactly one"),
        (lambda: fa1_hbm(8, 8, 4, sram_size=64, block_sizes=(2, 2)), ValueError, "exactly one"),
        (lambda: fa1_hbm(8, 8, 4, block_sizes=(0, 2)), ValueError, "block_sizes"),
        (lambda: fa1_hbm(8, 8, 4, block_sizes=7), TypeError, "block_sizes"),
        (lambda: lower_bound_hbm(8, 4, 3), ValueError, "sram_size"),
        (lambda: lower_bound_hbm(8, 4, 33), ValueError, "sram_size"),
        (lambda: block_sparse_hbm(torch.ones(2, 2, dtype=torch.bool), 4, 8, 8), TypeError, "block_mask"),
        (lambda: block_sparse_hbm(BlockMask.dense(8, 8, 4), 4, 9, 8), ValueError, "block grid"),
        (lambda: block_sparse_hbm_bound(8, 4, 16, 1.5), ValueError, "s "),
        (lambda: fa2_hbm(8, 8, 4, window_size=(-2, 0)), ValueError, "window_size"),
        (lambda: fa2_hbm(8, 8, 4, causal=True, window_size=(2, 3)), ValueError, "causal"),
        (lambda: backward_hbm(8, 8, 4, block_sizes=(4,)), TypeError, "block_sizes"),
        (lambda: decoding_hbm(1, 10, 4, 0), ValueError, "num_splits"),
        (lambda: softmax_accesses(4, "fast"), ValueError, "variant"),
        (lambda: attention_flops(1, 1, 4, 4, 4, mode="fwd+bwd"), ValueError, "mode"),
        (lambda: to_bytes(10, "int4"), ValueError, "bytes_per_element"),
    ],
)
def test_bad_inputs_raise(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
