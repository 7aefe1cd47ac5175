"""Tests of the reference softmax variants, their state algebra and their counts.

Float64 throughout: results are compared with ``torch.softmax`` to the float64
entry of the tests' tolerance table (tests/_oracle.py: 1e-9, against a few
ulps of float64 per element after a sum of at most a few hundred terms); the
float32 check uses the table's float32 entry.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtile.reference.softmax import (
    SoftmaxState,
    block_online_softmax,
    merge_states,
    naive_softmax,
    online_softmax,
    safe_softmax,
    softmax_lse,
    state_of,
)
from tests._oracle import assert_close


VARIANTS = {
    "naive": naive_softmax,
    "safe": safe_softmax,
    "online": online_softmax,
    "block5": lambda x, **kw: block_online_softmax(x, 5, **kw),
    "block1": lambda x, **kw: block_online_softmax(x, 1, **kw),
}
STABLE = {k: v for k, v in VARIANTS.items() if k != "naive"}
NEG_INF = float("-inf")


def rows(seed: int, shape: tuple[int, ...], scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Within the table's tolerance for a's dtype (tests/_oracle.py) of b."""
    assert_close(a, b)


# ---------------------------------------------------------------------------
# Agreement with torch.softmax


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("shape", [(17,), (4, 33), (2, 3, 64), (3, 1)])
def test_matches_torch(name: str, shape: tuple[int, ...]) -> None:
    x = rows(sum(shape), shape)
    y = VARIANTS[name](x).y
    assert y.dtype == torch.float64 and y.shape == x.shape
    close(y, torch.softmax(x, dim=-1))


@pytest.mark.parametrize("name", list(STABLE))
def test_float32_input_upcast_and_float32_compute(name: str) -> None:
    x = rows(7, (5, 40)).float()
    ref = torch.softmax(x.double(), dim=-1)
    # default: computed in float64 from the float32 values, so as exact as float64
    close(STABLE[name](x).y, ref)
    # dtype=None keeps float32: a few float32 ulps of relative error
    y32 = STABLE[name](x, dtype=None).y
    assert y32.dtype == torch.float32
    close(y32, ref)


def test_softmax_lse_matches_logsumexp() -> None:
    x = rows(3, (6, 50))
    close(softmax_lse(x), torch.logsumexp(x, dim=-1))
    close(state_of(x).lse(), torch.logsumexp(x, dim=-1))


def test_online_state_matches_block_state() -> None:
    """The element-by-element recurrence and one-shot block reduction give the same (m, d)."""
    x = rows(11, (4, 70))
    s = state_of(x)
    assert torch.equal(s.m, x.amax(dim=-1))
    close(s.d, torch.exp(x - s.m[:, None]).sum(-1))
    close(softmax_lse(x), s.m + torch.log(s.d))


# ---------------------------------------------------------------------------
# State algebra (hypothesis)

finite = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, allow_infinity=False)
entry = st.one_of(finite, finite, finite, st.just(NEG_INF))
row_st = st.lists(entry, min_size=0, max_size=20)


def state_from(vals: list[float]) -> SoftmaxState:
    return state_of(torch.tensor(vals, dtype=torch.float64).reshape(1, len(vals)))


def same_state(a: SoftmaxState, b: SoftmaxState) -> None:
    assert torch.equal(a.m, b.m)
    assert not torch.isnan(a.d).any() and not torch.isnan(b.d).any()
    close(a.d, b.d)


@settings(max_examples=200, deadline=None)
@given(row_st, row_st, row_st)
def test_merge_associative_and_commutative(a: list, b: list, c: list) -> None:
    sa, sb, sc = state_from(a), state_from(b), state_from(c)
    same_state(merge_states(sa, sb), merge_states(sb, sa))
    same_state(merge_states(merge_states(sa, sb), sc), merge_states(sa, merge_states(sb, sc)))
    # merging the parts gives the state of the whole row
    same_state(merge_states(merge_states(sa, sb), sc), state_from(a + b + c))


@settings(max_examples=100, deadline=None)
@given(row_st)
def test_empty_is_identity(a: list) -> None:
    sa = state_from(a)
    e = SoftmaxState.empty((1,))
    for merged in (merge_states(e, sa), merge_states(sa, e)):
        # identity holds exactly, not just to rounding: d * exp(0) = d
        assert torch.equal(merged.m, sa.m) and torch.equal(merged.d, sa.d)


def test_empty_merge_empty_is_empty_without_nan() -> None:
    e = SoftmaxState.empty((3, 2))
    m = merge_states(e, e)
    assert torch.isneginf(m.m).all() and torch.equal(m.d, torch.zeros(3, 2, dtype=torch.float64))
    assert torch.isneginf(m.lse()).all()


# ---------------------------------------------------------------------------
# Any blocking, any order


@st.composite
def blocked_rows(draw):
    n = draw(st.integers(1, 300))
    block = draw(st.integers(1, 64))
    nb = -(-n // block)
    order = draw(st.permutations(list(range(nb))))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1.0, 30.0, 1e3]))
    n_masked = draw(st.integers(0, n))
    return n, block, order, seed, scale, n_masked


@settings(max_examples=150, deadline=None)
@given(blocked_rows())
def test_any_split_any_order_same_softmax(case) -> None:
    n, block, order, seed, scale, n_masked = case
    x = rows(seed, (2, n), scale)
    # mask a prefix of row 0 (possibly all of it) to mix masked and live blocks
    x[0, :n_masked] = NEG_INF
    y = block_online_softmax(x, block, order).y
    ref = online_softmax(x).y
    close(y, ref)
    close(y, torch.nan_to_num(torch.softmax(x, dim=-1), nan=0.0))


# ---------------------------------------------------------------------------
# Adversarial logits


@pytest.mark.parametrize("name", list(STABLE))
def test_huge_logits_stay_finite(name: str) -> None:
    x = torch.tensor([[1e4, -1e4, 0.0, 1e4 - 1.0], [-1e4, -1e4 + 2.0, -1e4, -1e4]], dtype=torch.float64)
    y = STABLE[name](x).y
    assert torch.isfinite(y).all()
    close(y, torch.softmax(x, dim=-1))
    close(y[0, :2], torch.tensor([1 / (1 + math.exp(-1.0)), 0.0], dtype=torch.float64))


def test_naive_overflows_and_underflows_where_safe_does_not() -> None:
    big = torch.tensor([[1e4, 0.0, 1.0]], dtype=torch.float64)
    assert torch.isnan(naive_softmax(big).y).any()  # inf / inf
    tiny = torch.full((1, 4), -1e4, dtype=torch.float64)
    assert torch.isnan(naive_softmax(tiny).y).all()  # 0 / 0 after underflow
    for f in STABLE.values():
        close(f(big).y, torch.softmax(big, -1))
        close(f(tiny).y, torch.full((1, 4), 0.25, dtype=torch.float64))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_all_equal_rows_are_uniform(name: str) -> None:
    for v in (0.0, 5.0, -700.0):
        x = torch.full((2, 13), v, dtype=torch.float64)
        close(VARIANTS[name](x).y, torch.full((2, 13), 1 / 13, dtype=torch.float64))


@pytest.mark.parametrize("name", list(STABLE))
def test_one_huge_value_takes_everything(name: str) -> None:
    x = rows(5, (3, 20))
    x[torch.arange(3), torch.tensor([0, 7, 19])] = 1e4
    expected = torch.zeros_like(x)
    expected[torch.arange(3), torch.tensor([0, 7, 19])] = 1.0
    close(STABLE[name](x).y, expected)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_neg_inf_entries_are_masked(name: str) -> None:
    x = rows(9, (3, 12))
    x[0, ::2] = NEG_INF
    x[1, 0] = NEG_INF
    x[2, 5:] = NEG_INF
    y = VARIANTS[name](x).y
    assert (y[torch.isneginf(x)] == 0).all()
    close(y, torch.softmax(x, dim=-1))
    close(y.sum(-1), torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_fully_masked_row_is_zero_not_nan(name: str) -> None:
    x = rows(2, (3, 9))
    x[1] = NEG_INF
    y = VARIANTS[name](x).y
    assert not torch.isnan(y).any()
    assert (y[1] == 0).all()
    close(y[[0, 2]], torch.softmax(x[[0, 2]], dim=-1))
    lse = softmax_lse(x)
    assert torch.isneginf(lse[1]) and torch.isfinite(lse[[0, 2]]).all()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_empty_rows(name: str) -> None:
    x = torch.empty(4, 0, dtype=torch.float64)
    r = VARIANTS[name](x)
    assert r.y.shape == (4, 0) and r.counts.hbm == 0 and r.counts.nonmatmul_flops == 0
    assert torch.isneginf(softmax_lse(x)).all()


# ---------------------------------------------------------------------------
# Counts


@pytest.mark.parametrize("n", [1, 7, 64, 100])
def test_access_counts_per_row(n: int) -> None:
    x = rows(n, (1, n))
    expected = {"naive": (2, 1), "safe": (3, 1), "online": (2, 1), "block5": (2, 1), "block1": (2, 1)}
    for name, (r, w) in expected.items():
        c = VARIANTS[name](x).counts
        assert (c.reads, c.writes, c.hbm) == (r * n, w * n, (r + w) * n), name
    assert safe_softmax(x).counts.hbm / online_softmax(x).counts.hbm == pytest.approx(4 / 3, rel=0, abs=0)


def test_counts_sum_over_rows_and_flop_closed_forms() -> None:
    shape, n = (2, 3, 50), 50
    x = rows(1, shape)
    r = 6  # rows
    assert naive_softmax(x).counts.nonmatmul_flops == 4 * r * n
    assert safe_softmax(x).counts.nonmatmul_flops == 7 * r * n
    assert online_softmax(x).counts.nonmatmul_flops == 10 * r * n
    for block in (1, 7, 50, 64):
        nb = -(-n // block)
        c = block_online_softmax(x, block).counts
        assert c.hbm == 3 * r * n
        assert c.nonmatmul_flops == 7 * r * n + 8 * r * (nb - 1)
        assert c.extras["merges"] == nb - 1


# ---------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("name", list(VARIANTS))
def test_integer_input_rejected(name: str) -> None:
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        VARIANTS[name](torch.arange(6).reshape(2, 3))


def test_other_bad_inputs() -> None:
    x = rows(0, (2, 10))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        online_softmax([1.0, 2.0])
    with pytest.raises(TypeError, match="block_size must be an int"):
        block_online_softmax(x, 2.5)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="block_size must be an int >= 1"):
            block_online_softmax(x, bad)
    for order in ([0, 1], [0, 1, 2, 2], [1, 2, 3], [0, 1, 2, 3], ["a", "b", "c"]):
        with pytest.raises(ValueError, match="order must be a permutation"):
            block_online_softmax(x, 4, order)  # 3 blocks
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        safe_softmax(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        online_softmax(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="at least 1 dimension"):
        safe_softmax(torch.tensor(1.0))
    with pytest.raises(TypeError, match="dtype must be a floating"):
        safe_softmax(x, dtype=torch.int32)
    with pytest.raises(ValueError, match="same row shape"):
        merge_states(SoftmaxState.empty((2,)), SoftmaxState.empty((3,)))
    with pytest.raises(TypeError, match="two SoftmaxState"):
        merge_states((torch.zeros(1), torch.zeros(1)), SoftmaxState.empty((1,)))
    # a tensor permutation is accepted
    close(block_online_softmax(x, 4, torch.tensor([2, 0, 1])).y, torch.softmax(x, -1))
