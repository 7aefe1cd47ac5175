"""Tests of flashtile.reference.decoding: Flash-Decoding and FlashDecoding++.

Every result is compared with tests/_oracle.py's dense float64 oracle (masked
softmax per batch element, with Nk replaced by that element's cache length),
to the table's tolerance for the result's dtype: float64 1e-9 relative,
float16 1e-2 (fp16 has a 2^-11 unit roundoff, and scores of size ~10 carry
~5e-3 absolute error into exp).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtile.reference._common import IOCounts
from flashtile.reference.decoding import (
    DecodePPInfo,
    chunk_bounds,
    default_safe_range,
    estimate_phi,
    flash_decoding,
    flashdecoding_pp,
    merge_partials,
)
from tests._oracle import assert_close, attention_ref, scores_ref



# ---------------------------------------------------------------------------
# the oracle
# ---------------------------------------------------------------------------


def oracle_scores(q, k, lens, *, slopes=None, **mods):
    """Per (b, h): tests._oracle's modified scores (Nq, L_b), -inf on keys the row may not see."""
    s = scores_ref(q, k, lens=lens, alibi=slopes, **mods)
    return {(b, h): s[b, h, :, : int(lens[b])] for b in range(s.shape[0]) for h in range(s.shape[1])}


def oracle(q, k, v, lens, *, slopes=None, **mods):
    """tests._oracle's attention with per-element lengths: (out (B, Hq, Nq, d), lse (B, Hq, Nq)) in float64."""
    return attention_ref(q, k, v, lens=lens, alibi=slopes, **mods)


def make_inputs(seed, bsz=3, hq=4, hk=1, nq=3, nk=13, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, hq, nq, d, generator=g, dtype=dtype)
    k = torch.randn(bsz, hk, nk, d, generator=g, dtype=dtype)
    v = torch.randn(bsz, hk, nk, d, generator=g, dtype=dtype)
    return q, k, v


MODS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (2, 1)},
    "causal_window": {"causal": True, "window": (3, 0)},
    "softcap": {"softcap": 0.7, "scale": 2.0},
    "alibi": {"slopes": torch.tensor([0.5, 0.25, 0.125, 1.0], dtype=torch.float64)},
    "all": {"causal": True, "window": (4, -1), "softcap": 1.5, "slopes": torch.tensor([0.3, 0.1, 0.7, 0.2])},
}


def api_kwargs(mods):
    """Translate oracle keyword names into the library's."""
    return {
        "causal": mods.get("causal", False),
        "window_size": mods.get("window", (-1, -1)),
        "softcap": mods.get("softcap", 0.0),
        "alibi_slopes": mods.get("slopes"),
        "softmax_scale": mods.get("scale"),
    }


# ---------------------------------------------------------------------------
# Flash-Decoding against the oracle
# ---------------------------------------------------------------------------


def test_chunk_bounds_cover_the_range_evenly():
    for length in range(0, 12):
        for splits in range(1, 15):
            bounds = chunk_bounds(length, splits)
            assert len(bounds) == splits
            assert bounds[0][0] == 0 and bounds[-1][1] == length
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [hi - lo for lo, hi in bounds]
            assert max(sizes) - min(sizes) <= 1
            assert sum(s == 0 for s in sizes) == max(0, splits - length)


@pytest.mark.parametrize("name", list(MODS))
def test_flash_decoding_every_split_count_and_order(name):
    """num_splits = 1 .. L + 2 (empty chunks included), random merge orders, ragged lengths 13, 0, 1."""
    mods = MODS[name]
    q, k, v = make_inputs(1, bsz=3, hq=4, hk=1, nq=3, nk=13)
    lens = [13, 0, 1]
    want_out, want_lse = oracle(q, k, v, lens, **mods)
    g = torch.Generator().manual_seed(7)
    for splits in range(1, 13 + 3):
        order = torch.randperm(splits, generator=g)
        res = flash_decoding(q, k, v, num_splits=splits, cache_seqlens=torch.tensor(lens), order=order, **api_kwargs(mods))
        assert_close(res.out, want_out)
        assert_close(res.lse, want_lse)
        assert not torch.isnan(res.out).any()
    # length 0 means no key at all: out 0, lse -inf
    assert (res.out[1] == 0).all() and (res.lse[1] == -math.inf).all()


@st.composite
def decode_case(draw):
    hk = draw(st.sampled_from([1, 2]))
    hq = hk * draw(st.sampled_from([1, 2, 4]))
    bsz = draw(st.integers(1, 3))
    nq = draw(st.integers(1, 8))
    nk = draw(st.integers(1, 40))
    d = draw(st.integers(1, 16))
    lens = draw(st.lists(st.sampled_from([0, 1, nk, draw(st.integers(0, nk))]), min_size=bsz, max_size=bsz))
    left = draw(st.integers(-1, 6))
    right = draw(st.integers(-1, 3))
    causal = draw(st.booleans())
    mods = {"causal": causal, "window": (left, 0 if causal and right > 0 else right)}
    if draw(st.booleans()):
        mods["softcap"] = draw(st.floats(0.2, 5.0))
    if draw(st.booleans()):
        mods["slopes"] = torch.rand(bsz, hq, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    splits = draw(st.integers(1, max(lens) + 2))
    order = draw(st.permutations(range(splits)))
    seed = draw(st.integers(0, 2**16))
    return dict(bsz=bsz, hq=hq, hk=hk, nq=nq, nk=nk, d=d, lens=lens, mods=mods, splits=splits, order=order, seed=seed)


@settings(max_examples=60, deadline=None)
@given(decode_case())
def test_flash_decoding_matches_oracle(case):
    q, k, v = make_inputs(case["seed"], case["bsz"], case["hq"], case["hk"], case["nq"], case["nk"], case["d"])
    # scale the scores up so the softmax is far from uniform
    q = 3.0 * q
    want_out, want_lse = oracle(q, k, v, case["lens"], **case["mods"])
    res = flash_decoding(
        q, k, v, num_splits=case["splits"], cache_seqlens=case["lens"], order=case["order"], **api_kwargs(case["mods"])
    )
    assert_close(res.out, want_out)
    assert_close(res.lse, want_lse)
    assert res.counts == expected_fd_counts(case["lens"], case["hq"], case["nq"], case["d"], case["splits"])


def test_flash_decoding_accepts_2d_and_3d_inputs():
    q, k, v = make_inputs(3, bsz=1, hq=2, hk=2, nq=2, nk=9)
    full = flash_decoding(q, k, v, num_splits=4)
    three = flash_decoding(q[0], k[0], v[0], num_splits=4)
    two = flash_decoding(q[0, 1], k[0, 1], v[0, 1], num_splits=4, cache_seqlens=[9])
    assert three.out.shape == (2, 2, 8) and two.lse.shape == (2,)
    assert_close(three.out, full.out[0])
    assert_close(two.out, full.out[0, 1])
    assert_close(two.lse, full.lse[0, 1])


def test_flash_decoding_in_float16_stays_within_half_precision():
    q, k, v = make_inputs(4, bsz=2, hq=4, hk=2, nq=4, nk=64, d=16, dtype=torch.float16)
    res = flash_decoding(q, k, v, num_splits=5, cache_seqlens=[64, 37], causal=True, dtype=torch.float16)
    want_out, want_lse = oracle(q.double(), k.double(), v.double(), [64, 37], causal=True)
    assert res.out.dtype == torch.float16
    assert_close(res.out, want_out, what="out")
    assert_close(res.lse, want_lse, what="lse")


# ---------------------------------------------------------------------------
# merge_partials
# ---------------------------------------------------------------------------


@st.composite
def partials(draw):
    n = draw(st.integers(1, 7))
    rows = draw(st.integers(1, 5))
    d = draw(st.integers(1, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    outs = torch.randn(n, rows, d, generator=g, dtype=torch.float64)
    lses = 30 * torch.randn(n, rows, generator=g, dtype=torch.float64)
    empty = torch.rand(n, rows, generator=g) < draw(st.sampled_from([0.0, 0.3, 1.0]))
    lses = lses.masked_fill(empty, -math.inf)
    outs = outs.masked_fill(empty.unsqueeze(-1), 0.0)  # an empty partial is (0, -inf)
    return outs, lses, draw(st.permutations(range(n))), draw(st.integers(0, n))


@settings(max_examples=80, deadline=None)
@given(partials())
def test_merge_is_exact_order_independent_and_associative(case):
    outs, lses, order, cut = case
    out, lse = merge_partials(outs, lses)
    # the definition, written with logsumexp
    want_lse = torch.logsumexp(lses, dim=0)
    w = torch.where(torch.isfinite(want_lse), torch.exp(lses - want_lse), torch.zeros(()))
    want_out = (w.unsqueeze(-1) * outs).sum(dim=0)
    assert_close(lse, want_lse)
    assert_close(out, want_out)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    # any order
    out_p, lse_p = merge_partials(outs, lses, order=order)
    assert_close(out_p, out)
    assert_close(lse_p, lse)
    # merging two merged groups (associativity); an empty group is (0, -inf)
    groups = []
    for part in (slice(0, cut), slice(cut, None)):
        if outs[part].shape[0]:
            groups.append(merge_partials(outs[part], lses[part]))
    out_g, lse_g = merge_partials(torch.stack([o for o, _ in groups]), torch.stack([m for _, m in groups]))
    assert_close(out_g, out)
    assert_close(lse_g, lse)


def test_merge_of_all_empty_partials_is_zero_and_minus_inf():
    out, lse = merge_partials(torch.zeros(3, 2, 4), torch.full((3, 2), -math.inf))
    assert (out == 0).all() and (lse == -math.inf).all()


# ---------------------------------------------------------------------------
# counts
# ---------------------------------------------------------------------------


def expected_fd_counts(lens, hq, nq, d, splits):
    """The module docstring's closed form summed over batch elements and query heads."""
    c = IOCounts()
    for length in lens:
        c.reads += hq * (nq * d + 2 * length * d + splits * nq * (d + 1))
        c.writes += hq * (splits * nq * (d + 1) + nq * d + nq)
        c.flops += hq * 4 * nq * length * d
        c.nonmatmul_flops += hq * (
            4 * nq * length + min(splits, length) * nq * (d + 2) + nq * (2 * splits * (d + 3) + 2)
        )
        c.extra_memory += hq * splits * nq * (d + 1)
    c.extras["num_splits"] = splits
    return c


def expected_pp_counts(lens, hq, nq, d, splits):
    c = expected_fd_counts(lens, hq, nq, d, splits)
    c.nonmatmul_flops = sum(hq * (5 * nq * length + nq * (splits * (d + 1) + d + 2)) for length in lens)
    return c


@pytest.mark.parametrize("splits", [1, 2, 5, 20])
def test_flash_decoding_counts_equal_the_closed_form(splits):
    q, k, v = make_inputs(5, bsz=3, hq=4, hk=1, nq=2, nk=11, d=6)
    lens = [11, 0, 4]
    res = flash_decoding(q, k, v, num_splits=splits, cache_seqlens=lens, causal=True)
    assert res.counts == expected_fd_counts(lens, 4, 2, 6, splits)
    # spelled out for one (b, h) with L = 11, S = 5: reads 2*6 + 2*11*6 + 5*2*7 = 214
    if splits == 5:
        single = flash_decoding(q[:1, :1], k[:1, :1], v[:1, :1], num_splits=5)
        assert single.counts.reads == 214 and single.counts.writes == 5 * 2 * 7 + 2 * 6 + 2


# ---------------------------------------------------------------------------
# FlashDecoding++
# ---------------------------------------------------------------------------


def true_max(q, k, lens, **mods):
    return max(float(s.max()) for s in oracle_scores(q, k, lens, **mods).values() if s.numel() and torch.isfinite(s).any())


@pytest.mark.parametrize("name", ["plain", "causal", "softcap", "alibi", "all"])
@pytest.mark.parametrize("offset", [0.0, -2.0, 5.0])
def test_flashdecoding_pp_near_the_true_max_needs_no_fallback(name, offset):
    mods = MODS[name]
    q, k, v = make_inputs(6, bsz=3, hq=4, hk=2, nq=4, nk=30, d=8)
    lens = [30, 1, 17]
    samples = torch.cat([s.flatten() for s in oracle_scores(q, k, lens, **mods).values()])
    phi = estimate_phi(samples, quantile=1.0) + offset
    assert phi == true_max(q, k, lens, **mods) + offset
    res, info = flashdecoding_pp(q, k, v, phi=phi, num_splits=4, cache_seqlens=lens, **api_kwargs(mods))
    want_out, want_lse = oracle(q, k, v, lens, **mods)
    assert isinstance(info, DecodePPInfo) and info.num_recomputed == 0 and info.rows() == []
    assert_close(res.out, want_out)
    assert_close(res.lse, want_lse)
    assert res.counts == expected_pp_counts(lens, 4, 4, 8, 4)


def adversarial_inputs():
    """Small scores everywhere except two rows: (0, 1, 2) far above phi, (1, 3, 0) far below.

    Every key has a first coordinate >= 0.5, so a query row (C, 0, ..., 0)
    scores at least 0.5 C / sqrt(d) on every key, and (-C, 0, ...) at most minus that.
    """
    q, k, v = make_inputs(8, bsz=2, hq=4, hk=2, nq=3, nk=20, d=4)
    k[..., 0] = k[..., 0].abs() + 0.5
    lens = [20, 12]
    phi = true_max(q, k, lens)
    c = 4e3  # scale * 0.5 * C = 1e3: phi is a few units, so the row sits ~1e3 above (below) it
    q[0, 1, 2] = torch.tensor([c, 0.0, 0.0, 0.0])
    q[1, 3, 0] = torch.tensor([-c, 0.0, 0.0, 0.0])
    return q, k, v, lens, phi


def test_flashdecoding_pp_falls_back_on_exactly_the_affected_rows():
    q, k, v, lens, phi = adversarial_inputs()
    res, info = flashdecoding_pp(q, k, v, phi=phi, num_splits=3, cache_seqlens=lens)
    scores = oracle_scores(q, k, lens)
    assert float(scores[0, 1][2].min()) - phi > 990 and float(scores[1, 3][0].max()) - phi < -990
    assert info.rows() == [(0, 1, 2), (1, 3, 0)]
    assert info.above.nonzero().tolist() == [[0, 1, 2]]
    assert info.below.nonzero().tolist() == [[1, 3, 0]]
    assert not info.overflowed.any()
    want_out, want_lse = oracle(q, k, v, lens)
    assert_close(res.out, want_out)
    assert_close(res.lse, want_lse)
    # without the fallback these rows would be inf/NaN (above) and 0/0 (below)
    assert float(want_lse[0, 1, 2]) > phi + 700 and float(want_lse[1, 3, 0]) < phi - 700
    # fallback IO: one (b, h) per row, r = 1, L = 20 and 12, d = 4
    base = expected_pp_counts(lens, 4, 3, 4, 3)
    assert res.counts.extras["fallback_rows"] == 2
    assert res.counts.reads == base.reads + (4 + 2 * 20 * 4) + (4 + 2 * 12 * 4)
    assert res.counts.writes == base.writes + 2 * (4 + 1)
    assert res.counts.flops == base.flops + 4 * 20 * 4 + 4 * 12 * 4


def test_flashdecoding_pp_flags_follow_the_safe_range():
    """With a custom range the flagged set is exactly {rows with an allowed s - phi outside [a, b]}."""
    q, k, v = make_inputs(9, bsz=2, hq=4, hk=4, nq=5, nk=25, d=8)
    q = 2.5 * q
    lens = [25, 9]
    phi, (a, b) = 0.5, (-3.0, 2.0)
    res, info = flashdecoding_pp(q, k, v, phi=phi, num_splits=4, cache_seqlens=lens, causal=True, safe_range=(a, b))
    scores = oracle_scores(q, k, lens, causal=True)
    want_above = torch.zeros(2, 4, 5, dtype=torch.bool)
    want_below = torch.zeros(2, 4, 5, dtype=torch.bool)
    for (bi, h), s in scores.items():
        dev = s - phi
        want_above[bi, h] = (torch.isfinite(dev) & (dev > b)).any(dim=-1)
        want_below[bi, h] = (torch.isfinite(dev) & (dev < a)).any(dim=-1)
    assert torch.equal(info.above, want_above) and torch.equal(info.below, want_below)
    assert 0 < info.num_recomputed < info.recomputed.numel()
    want_out, want_lse = oracle(q, k, v, lens, causal=True)
    assert_close(res.out, want_out)
    assert_close(res.lse, want_lse)


def test_flashdecoding_pp_in_float16_falls_back_on_a_wide_spread():
    """fp16 exp overflows past s - phi = 11.1: a wide score spread must trigger the fallback."""
    q, k, v = make_inputs(10, bsz=2, hq=4, hk=2, nq=2, nk=48, d=16, dtype=torch.float16)
    q = (4.0 * q).half()  # scores with std ~4: rows span far more than the fp16 safe range
    lens = [48, 30]
    q64, k64, v64 = q.double(), k.double(), v.double()
    samples = torch.cat([s.flatten() for s in oracle_scores(q64, k64, lens).values()])
    phi = estimate_phi(samples, quantile=0.5)
    res, info = flashdecoding_pp(q, k, v, phi=phi, num_splits=4, cache_seqlens=lens, dtype=torch.float16)
    assert info.safe_range == default_safe_range(torch.float16, 48)
    assert info.above.any() and info.below.any()
    assert res.out.dtype == torch.float16 and torch.isfinite(res.out).all()
    want_out, want_lse = oracle(q64, k64, v64, lens)
    assert_close(res.out, want_out, what="out")
    assert_close(res.lse, want_lse, what="lse")
    # the flagged rows are the ones whose exp(s - phi) would overflow fp16 or lose precision
    worst = max(float(s.max()) - phi for s in oracle_scores(q64, k64, lens).values())
    assert torch.exp(torch.tensor(worst, dtype=torch.float16)) * 48 == math.inf


def test_flashdecoding_pp_in_float16_near_the_max_matches():
    q, k, v = make_inputs(11, bsz=1, hq=2, hk=1, nq=3, nk=24, d=16, dtype=torch.float16)
    q64, k64, v64 = q.double(), k.double(), v.double()
    phi = true_max(q64, k64, [24])
    res, info = flashdecoding_pp(q, k, v, phi=phi, num_splits=3, dtype=torch.float16)
    # scores are N(0, 1): the spread below the max stays inside the fp16 range (-6.93)
    assert info.num_recomputed == 0
    want_out, _ = oracle(q64, k64, v64, [24])
    assert_close(res.out, want_out, what="out")


def test_flashdecoding_pp_catches_accumulator_overflow():
    """In fp16, exp(2) * 2e4 = 1.5e5 > 65504 although s - phi = 2 is inside the range."""
    q = torch.tensor([[[[1.0, 0.0]]]], dtype=torch.float16)
    k = torch.tensor([[[[2.0, 0.0]]]], dtype=torch.float16)
    v = torch.tensor([[[[2e4, -1.0]]]], dtype=torch.float16)
    res, info = flashdecoding_pp(q, k, v, phi=0.0, num_splits=1, softmax_scale=1.0, dtype=torch.float16)
    assert not info.above.any() and not info.below.any()
    assert info.overflowed.tolist() == [[[True]]] and info.num_recomputed == 1
    assert res.out.tolist() == [[[[2e4, -1.0]]]] and float(res.lse) == 2.0


def test_estimate_phi_is_the_nearest_rank_quantile_of_finite_scores():
    x = torch.tensor([3.0, -math.inf, 1.0, 2.0, 4.0, -math.inf])
    assert estimate_phi(x, quantile=1.0) == 4.0
    assert estimate_phi(x, quantile=0.5) == 2.0
    assert estimate_phi(x, quantile=0.01) == 1.0


def test_default_safe_range_comes_from_the_dtype_exp_range():
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        a, b = default_safe_range(dtype, 100)
        info = torch.finfo(dtype)
        assert math.isclose(a, math.log(16 * info.tiny)) and math.isclose(b, math.log(info.max / 1600))
        # at the edges exp is still normal, and 100 terms times |v| <= 16 stay finite
        assert torch.exp(torch.tensor(a, dtype=torch.float64)).to(dtype) >= info.tiny
        assert 100 * math.exp(b) * 16 <= info.max * (1 + 1e-12)
        assert math.isfinite(float(torch.exp(torch.tensor(b, dtype=dtype))))


# ---------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------


def test_bad_inputs_raise():
    q, k, v = make_inputs(12, bsz=2, hq=4, hk=2, nq=2, nk=6, d=4)
    with pytest.raises(ValueError, match="num_splits"):
        flash_decoding(q, k, v, num_splits=0)
    with pytest.raises(TypeError, match="num_splits"):
        flash_decoding(q, k, v, num_splits=2.0)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 7"):
        flash_decoding(q, k, v, num_splits=2, cache_seqlens=[6, 7])
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_decoding(q, k, v, num_splits=2, cache_seqlens=[-1, 3])
    with pytest.raises(ValueError, match=r"cache_seqlens must have shape \(B,\)"):
        flash_decoding(q, k, v, num_splits=2, cache_seqlens=torch.tensor([6, 6, 6]))
    with pytest.raises(TypeError, match="cache_seqlens"):
        flash_decoding(q, k, v, num_splits=2, cache_seqlens=torch.tensor([6.0, 6.0]))
    with pytest.raises(ValueError, match="multiple"):
        flash_decoding(q[:, :3], k, v, num_splits=2)
    with pytest.raises(ValueError, match="order"):
        flash_decoding(q, k, v, num_splits=3, order=[0, 1, 1])
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_decoding(q, k, v, num_splits=2, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="window_size"):
        flash_decoding(q, k, v, num_splits=2, window_size=(-2, 0))
    with pytest.raises(ValueError, match="softcap"):
        flash_decoding(q, k, v, num_splits=2, softcap=-1.0)
    with pytest.raises(ValueError, match="safe_range"):
        flashdecoding_pp(q, k, v, phi=0.0, num_splits=2, safe_range=(3.0, 1.0))
    with pytest.raises(ValueError, match="phi"):
        flashdecoding_pp(q, k, v, phi=math.nan, num_splits=2)
    with pytest.raises(ValueError, match="num_splits"):
        flashdecoding_pp(q, k, v, phi=0.0, num_splits=-1)
    with pytest.raises(ValueError, match="lses"):
        merge_partials(torch.zeros(3, 2, 4), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="lses"):
        merge_partials(torch.zeros(2, 1, 4), torch.tensor([[0.0], [math.nan]]))
    with pytest.raises(ValueError, match="quantile"):
        estimate_phi(torch.ones(3), quantile=0.0)
    with pytest.raises(ValueError, match="finite score"):
        estimate_phi(torch.full((3,), -math.inf))
