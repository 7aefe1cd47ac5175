"""Tests of the reference attention forwards: values against a dense oracle, and exact counts.

Every algorithm runs in float64 and is compared with the tests' oracle,
``tests._oracle.attention_ref``, a dense implementation written from the
documented semantics independently of ``flashtile.reference.masks``.
Tolerance: the table's float64 entry (1e-9 relative to the largest output
magnitude).  The tiled algorithms differ from the oracle only in the order of
float64 sums of at most a few hundred terms and in the rescaling by
``exp(m_old - m_new)``, i.e. a few hundred ulps (~1e-13) at worst; the margin
still catches any wrong term (a missing rescale is an O(1) error).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtile.reference.attention import (
    attention_online_softmax_rows,
    attention_subsum,
    attention_subsum_blocked,
    block_sparse_flash_attn,
    fa1_block_sizes,
    flash_attn1,
    flash_attn2,
    standard_attention,
)
from flashtile.reference.masks import BlockMask
from tests._oracle import assert_close, attention_ref, tolerance

RTOL = tolerance(torch.float64)
NEG_INF = float("-inf")
F64 = torch.float64




@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The reference loops run thousands of tiny matmuls, for which torch's thread pool
    only adds synchronisation (10x slower on a loaded 2-core machine); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------
# Helpers (the oracle is tests/_oracle.py's attention_ref)


def check(res, ref_out, ref_lse):
    """out and LSE within the table's float64 tolerance of the oracle; LSE -inf exactly where the oracle's is; no NaN."""
    out, lse = res.out, res.lse
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close(out, ref_out, what="out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert_close(lse, ref_lse, what="lse")


def qkv(seed, b, hq, hk, nq, nk, d, qscale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g, dtype=F64) * qscale
    k = torch.randn(b, hk, nk, d, generator=g, dtype=F64)
    v = torch.randn(b, hk, nk, d, generator=g, dtype=F64)
    return q, k, v


def algorithms(br, bc):
    """Every 4-D algorithm, with the given tiles where it takes tiles."""
    return {
        "standard": standard_attention,
        "fa1": lambda *a, **kw: flash_attn1(*a, block_sizes=(br, bc), **kw),
        "fa2": lambda *a, **kw: flash_attn2(*a, block_sizes=(br, bc), **kw),
    }


def fa1_main_hbm(nq, nk, d, br, bc):
    """Per-head HBM of FA1 Algorithm 1's main loop: sum_j [2 bc_j d + sum_i (3 br_i d + 4 br_i)]."""
    total = 0
    for k0 in range(0, nk, bc):
        total += 2 * (min(k0 + bc, nk) - k0) * d
        for q0 in range(0, nq, br):
            bri = min(q0 + br, nq) - q0
            total += 3 * bri * d + 4 * bri
    return total


# ---------------------------------------------------------------------------
# Values: hypothesis-drawn shapes and options


@st.composite
def problems(draw):
    b = draw(st.integers(1, 2))
    hk = draw(st.integers(1, 2))
    hq = hk * draw(st.sampled_from([1, 2, 4]))
    nq, nk = draw(st.integers(1, 200)), draw(st.integers(1, 200))
    d = draw(st.sampled_from([1, 3, 16, 37, 64, 128]))
    # at most ~6 tiles per side keeps the Python tile loops fast; partial last tiles are common
    br = draw(st.integers(max(1, -(-nq // 6)), nq + 3))
    bc = draw(st.integers(max(1, -(-nk // 6)), nk + 3))
    causal = draw(st.booleans())
    left = draw(st.sampled_from([-1, 0, 1, 7, 50]))
    right = draw(st.sampled_from([-1, 0] if causal else [-1, 0, 3, 40]))
    opts = dict(
        causal=causal,
        window=(left, right),
        softcap=draw(st.sampled_from([0.0, 0.7, 30.0])),
        scale=draw(st.sampled_from([None, 0.05, 1.3])),
        seed=draw(st.integers(0, 2**16)),
    )
    alibi = draw(st.sampled_from([None, "h", "bh"]))
    dropout = draw(st.sampled_from([0.0, 0.3]))
    return b, hq, hk, nq, nk, d, br, bc, alibi, dropout, opts


@settings(max_examples=60, deadline=None)
@given(problems())
def test_all_algorithms_match_oracle(prob):
    b, hq, hk, nq, nk, d, br, bc, alibi, dropout, o = prob
    q, k, v = qkv(o["seed"], b, hq, hk, nq, nk, d)
    g = torch.Generator().manual_seed(o["seed"] + 1)
    slopes = None if alibi is None else torch.rand((hq,) if alibi == "h" else (b, hq), generator=g, dtype=F64)
    keep = torch.rand(b, hq, nq, nk, generator=g) >= dropout if dropout else None
    ref = attention_ref(q, k, v, scale=o["scale"], causal=o["causal"], window=o["window"], softcap=o["softcap"],
                 alibi=slopes, dropout_p=dropout, keep=keep)
    for name, fn in algorithms(br, bc).items():
        res = fn(q, k, v, softmax_scale=o["scale"], causal=o["causal"], window_size=o["window"],
                 softcap=o["softcap"], alibi_slopes=slopes, dropout_p=dropout, dropout_mask=keep)
        check(res, *ref)


@pytest.mark.parametrize("nq,nk", [(13, 40), (40, 13), (33, 33)])
@pytest.mark.parametrize("window", [(-1, -1), (5, -1), (0, 0)])
def test_causal_alignment_and_fully_masked_rows(nq, nk, window):
    """Bottom-right causal; with Nq > Nk the first Nq - Nk rows see nothing: out 0, LSE -inf."""
    q, k, v = qkv(nq * nk, 1, 2, 1, nq, nk, 8)
    ref = attention_ref(q, k, v, causal=True, window=window)
    masked_rows = max(0, nq - nk)
    for fn in algorithms(6, 7).values():
        res = fn(q, k, v, causal=True, window_size=window)
        check(res, *ref)
        assert torch.all(res.out[:, :, :masked_rows] == 0)
        assert torch.all(torch.isneginf(res.lse[:, :, :masked_rows]))
        assert torch.isfinite(res.lse[:, :, masked_rows:]).all()


def test_dropout_mask_broadcasts_and_scales():
    """A (Nq, Nk) keep mask broadcasts over batch and heads; kept weights are scaled by 1/(1-p)."""
    q, k, v = qkv(3, 2, 2, 2, 20, 30, 8)
    keep = torch.rand(20, 30, generator=torch.Generator().manual_seed(4)) > 0.5
    ref = attention_ref(q, k, v, dropout_p=0.5, keep=keep)
    for fn in algorithms(7, 9).values():
        check(fn(q, k, v, dropout_p=0.5, dropout_mask=keep), *ref)
    # all-ones keep: the output is the undropped one times 1/(1-p)
    plain = standard_attention(q, k, v)
    full = flash_attn2(q, k, v, dropout_p=0.5, dropout_mask=torch.ones(20, 30, dtype=torch.bool))
    torch.testing.assert_close(full.out, 2 * plain.out, rtol=RTOL, atol=RTOL)
    torch.testing.assert_close(full.lse, plain.lse, rtol=RTOL, atol=RTOL)


@pytest.mark.parametrize("case", ["huge_q", "neg_huge_q", "equal_rows", "one_huge"])
def test_adversarial_logits(case):
    q, k, v = qkv(11, 1, 2, 2, 24, 31, 16)
    if case == "huge_q":
        q = q * 1e4
    elif case == "neg_huge_q":
        q = q * -1e4
    elif case == "equal_rows":
        q = torch.zeros_like(q)  # every score 0: uniform weights, lse = log(#allowed)
    else:
        k[:, :, 17] = 0
        k[:, :, 17, 0] = 1e5
        q[..., 0] = 1.0  # key 17 scores 2.5e4, the rest O(1)
    for causal in (False, True):
        ref = attention_ref(q, k, v, causal=causal)
        for fn in algorithms(5, 6).values():
            check(fn(q, k, v, causal=causal), *ref)
    if case == "equal_rows":
        lse = flash_attn1(q, k, v, block_sizes=(5, 6)).lse
        torch.testing.assert_close(lse, torch.full_like(lse, math.log(31)), rtol=RTOL, atol=0)


def test_input_rank_is_preserved_and_gqa_matches_repeated_heads():
    q, k, v = qkv(5, 1, 4, 2, 19, 23, 8)
    full = flash_attn2(q, k, v, block_sizes=(4, 8), causal=True)
    repeated = standard_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), causal=True)
    torch.testing.assert_close(full.out, repeated.out, rtol=RTOL, atol=RTOL)
    three = flash_attn1(q[0], k[0], v[0], block_sizes=(4, 8), causal=True)
    assert three.out.dim() == 3 and three.lse.shape == (4, 19)
    torch.testing.assert_close(three.out, full.out[0], rtol=RTOL, atol=RTOL)
    two = standard_attention(q[0, 2], k[0, 1], v[0, 1], causal=True)
    assert two.out.shape == (19, 8) and two.lse.shape == (19,)
    torch.testing.assert_close(two.out, full.out[0, 2], rtol=RTOL, atol=RTOL)


def test_compute_dtype_none_keeps_float32():
    """dtype=None computes in the input's float32: ~1e-5 relative to the float64 result."""
    q, k, v = qkv(6, 1, 2, 2, 30, 30, 16)
    ref = standard_attention(q, k, v, causal=True)
    res = flash_attn2(q.float(), k.float(), v.float(), causal=True, block_sizes=(8, 8), dtype=None)
    assert res.out.dtype == torch.float32
    assert_close(res.out, ref.out, what="out")  # the table's float32 entry


# ---------------------------------------------------------------------------
# Block masks (Algorithm 5)

NQ, NK, BLK = 45, 70, (8, 16)
MASKS = {
    "dense": lambda: BlockMask.dense(NQ, NK, BLK),
    "causal": lambda: BlockMask.causal(NQ, NK, BLK),
    "sliding": lambda: BlockMask.sliding_window(NQ, NK, (10, 5), BLK),
    "global_local": lambda: BlockMask.global_local(NQ, NK, global_blocks=1, local_blocks=1, block_size=BLK),
    "strided": lambda: BlockMask.strided(NQ, NK, stride=2, block_size=BLK),
    "random": lambda: BlockMask.random(NQ, NK, 0.4, BLK, generator=torch.Generator().manual_seed(0)),
    "element": lambda: BlockMask.from_element_mask(torch.rand(NQ, NK, generator=torch.Generator().manual_seed(1)) > 0.97, BLK),
    "and": lambda: BlockMask.strided(NQ, NK, stride=2, block_size=BLK) & BlockMask.causal(NQ, NK, BLK),
    "or": lambda: BlockMask.strided(NQ, NK, stride=3, block_size=BLK) | BlockMask.global_local(NQ, NK, block_size=BLK),
    "per_head": lambda: BlockMask(torch.rand(2, 4, 6, 5, generator=torch.Generator().manual_seed(2)) > 0.5, BLK),
    "empty_cols": lambda: _empty_cols(),
}


def _empty_cols() -> BlockMask:
    """Per-head mask with whole KV columns (and a whole Q row) empty: those K_j, V_j are never loaded."""
    m = torch.rand(2, 4, 6, 5, generator=torch.Generator().manual_seed(3)) > 0.3
    m[:, :, :, 1] = False
    m[0, 1:3, :, 4] = False
    m[1, 2, 3, :] = False  # a fully masked block row: out 0, lse -inf
    return BlockMask(m, BLK)


@pytest.mark.parametrize("name", list(MASKS))
def test_block_masks_match_oracle(name):
    bm = MASKS[name]()
    q, k, v = qkv(7, 2, 4, 2, NQ, NK, 12)
    for causal in (False, True):
        ref = attention_ref(q, k, v, causal=causal, block_mask=bm)
        for fn in (standard_attention, block_sparse_flash_attn, flash_attn1, flash_attn2):
            if fn is block_sparse_flash_attn:
                res = fn(q, k, v, bm, causal=causal)
            else:
                res = fn(q, k, v, causal=causal, block_mask=bm)
            check(res, *ref)


@pytest.mark.parametrize("name", ["random", "and", "per_head", "causal", "empty_cols"])
def test_block_sparse_hbm_count(name):
    """Main loop: sum over nonempty columns of 2 bc_j d + sum over kept blocks of (3 br_i d + 4 br_i)."""
    bm = MASKS[name]()
    b, hq, d = 2, 4, 12
    q, k, v = qkv(8, b, hq, 2, NQ, NK, d)
    res = block_sparse_flash_attn(q, k, v, bm)
    live = bm.mask.expand(b, hq, *bm.shape)
    br, bc = BLK
    expected = 0
    for j in range(bm.shape[1]):
        bcj = min((j + 1) * bc, NK) - j * bc
        expected += int(live[..., j].any(-1).sum()) * 2 * bcj * d
        for i in range(bm.shape[0]):
            bri = min((i + 1) * br, NQ) - i * br
            expected += int(live[..., i, j].sum()) * (3 * bri * d + 4 * bri)
    assert res.counts.hbm == expected
    kept = int(live.sum())
    assert res.counts.visited_blocks == kept
    assert res.counts.skipped_blocks == live.numel() - kept
    assert res.counts.flops == sum(
        int(live[..., i, j].sum()) * 4 * (min((i + 1) * br, NQ) - i * br) * (min((j + 1) * bc, NK) - j * bc) * d
        for i in range(bm.shape[0]) for j in range(bm.shape[1])
    )


def test_block_sparse_count_shrinks_with_density():
    """Blocks dividing N and every column kept: (HBM - 2 Nk d) is exactly proportional to the kept blocks."""
    n, d, blk = 64, 8, 8
    q, k, v = qkv(9, 1, 1, 1, n, n, d)
    dense = block_sparse_flash_attn(q, k, v, BlockMask.dense(n, n, blk)).counts.hbm
    band = BlockMask.global_local(n, n, global_blocks=1, local_blocks=1, block_size=blk)
    assert bool(band.mask.any(0).all())
    sparse = block_sparse_flash_attn(q, k, v, band).counts.hbm
    kv = 2 * n * d
    assert (sparse - kv) * band.mask.numel() == (dense - kv) * int(band.mask.sum())
    assert sparse < dense


# ---------------------------------------------------------------------------
# Exact counts


@pytest.mark.parametrize("b,h,n,d", [(1, 1, 64, 16), (2, 3, 50, 8)])
def test_standard_hbm_is_4Nd_plus_4N2(b, h, n, d):
    q, k, v = qkv(10, b, h, h, n, n, d)
    c = standard_attention(q, k, v).counts
    assert c.hbm == b * h * (4 * n * d + 4 * n * n)
    assert c.flops == b * h * 4 * n * n * d
    assert c.extra_memory == b * h * 2 * n * n
    c2 = standard_attention(q[..., :30, :], k, v).counts  # Nq != Nk: 2(Nq + Nk) d + 4 Nq Nk
    assert c2.hbm == b * h * (2 * (30 + n) * d + 4 * 30 * n)


@pytest.mark.parametrize("nq,nk,br,bc", [(64, 64, 16, 32), (37, 53, 8, 10), (5, 200, 7, 64), (20, 20, 32, 32)])
def test_fa1_hbm_exact_with_partial_blocks(nq, nk, br, bc):
    b, hq, hk, d = 2, 4, 2, 12
    q, k, v = qkv(12, b, hq, hk, nq, nk, d)
    c = flash_attn1(q, k, v, block_sizes=(br, bc)).counts
    tc, tr = math.ceil(nk / bc), math.ceil(nq / br)
    per_head = 2 * nk * d + tc * (3 * nq * d + 4 * nq)
    assert per_head == fa1_main_hbm(nq, nk, d, br, bc)
    assert c.hbm == b * hq * per_head  # K/V counted per q head under GQA
    if nq % br == 0 and nk % bc == 0:  # the paper's form
        assert per_head == tc * (2 * bc * d + tr * (3 * br * d + 4 * br))
    assert c.extras["init_writes"] == b * hq * (nq * d + 2 * nq)
    assert c.extras["lse_writes"] == b * hq * nq
    assert c.visited_blocks == b * hq * tr * tc and c.skipped_blocks == 0
    assert c.flops == b * hq * 4 * nq * nk * d


@pytest.mark.parametrize("m,d,expected", [(1024, 16, (16, 16)), (1000, 64, (4, 4)), (4096, 8, (8, 128)), (5, 5, (1, 1))])
def test_fa1_block_sizes_from_sram(m, d, expected):
    """Algorithm 1 line 1: Bc = ceil(M / 4d), Br = min(ceil(M / 4d), d)."""
    assert fa1_block_sizes(m, d) == expected
    q, k, v = qkv(13, 1, 1, 1, 40, 40, d)
    res = flash_attn1(q, k, v, sram_size=m)
    check(res, *attention_ref(q, k, v))
    assert res.counts.hbm == fa1_main_hbm(40, 40, d, *expected)


@pytest.mark.parametrize("nq,nk,br,bc", [(64, 64, 16, 16), (37, 53, 8, 10), (53, 37, 10, 8)])
def test_fa2_hbm_and_causal_skipping(nq, nk, br, bc):
    b, hq, d = 1, 2, 8
    q, k, v = qkv(14, b, hq, 1, nq, nk, d)
    shift = nk - nq
    tr, tc = math.ceil(nq / br), math.ceil(nk / bc)
    dense = flash_attn2(q, k, v, block_sizes=(br, bc)).counts
    assert dense.skipped_blocks == 0
    assert dense.hbm == b * hq * (2 * nq * d + nq + tr * 2 * nk * d)
    causal = flash_attn2(q, k, v, block_sizes=(br, bc), causal=True).counts
    expected_hbm, skipped = 0, 0
    for i in range(tr):
        bri = min((i + 1) * br, nq) - i * br
        last_key = i * br + bri - 1 + shift  # the last row of the block sees keys <= this
        expected_hbm += 2 * bri * d + bri
        for j in range(tc):
            if j * bc > last_key:
                skipped += 1
            else:
                expected_hbm += 2 * (min((j + 1) * bc, nk) - j * bc) * d
    assert skipped > 0
    assert causal.skipped_blocks == b * hq * skipped
    assert causal.visited_blocks == b * hq * (tr * tc - skipped)
    assert causal.hbm == b * hq * expected_hbm
    assert causal.hbm < dense.hbm and causal.flops < dense.flops
    assert dense.extra_memory == 0


@pytest.mark.parametrize("opts", [{}, {"causal": True}, {"softcap": 5.0, "alibi_slopes": torch.tensor([0.5, 0.25])}])
@pytest.mark.parametrize("nq,nk,d,blk", [(64, 64, 16, 16), (10, 7, 4, 16), (50, 90, 32, 24)])
def test_fa2_fewer_nonmatmul_flops_than_fa1(opts, nq, nk, d, blk):
    """FA1 rescales and divides O at every inner step; FA2 rescales only and divides once."""
    q, k, v = qkv(15, 1, 2, 2, nq, nk, d)
    c1 = flash_attn1(q, k, v, block_sizes=(blk, blk), **opts).counts
    c2 = flash_attn2(q, k, v, block_sizes=(blk, blk), **opts).counts
    assert c2.nonmatmul_flops < c1.nonmatmul_flops
    if not opts.get("causal"):  # same tiles visited: the gap is (9-5) br + (4-2) br d per tile, minus the final divide
        tiles = math.ceil(nq / blk) * math.ceil(nk / blk)
        gap = 2 * (tiles * (4 * blk + 2 * blk * d) - nq * d)  # two heads
        if nq % blk == 0:
            assert c1.nonmatmul_flops - c2.nonmatmul_flops == gap


# ---------------------------------------------------------------------------
# Per-element derivations


@settings(max_examples=40, deadline=None)
@given(
    nq=st.integers(1, 90),
    nk=st.integers(1, 90),
    d=st.sampled_from([1, 5, 32, 64]),
    causal=st.booleans(),
    scale=st.sampled_from([None, 0.3, 4.0]),
    blk=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_derivations_match_oracle(nq, nk, d, causal, scale, blk, seed):
    q, k, v = qkv(seed, 1, 1, 1, nq, nk, d, qscale=3.0)
    out, lse = attention_ref(q, k, v, scale=scale, causal=causal)
    ref = (out[0, 0], lse[0, 0])
    q, k, v = q[0, 0], k[0, 0], v[0, 0]
    std = standard_attention(q, k, v, softmax_scale=scale, causal=causal)
    check(std, *ref)
    for res in (
        attention_online_softmax_rows(q, k, v, softmax_scale=scale, causal=causal),
        attention_subsum(q, k, v, softmax_scale=scale, causal=causal),
        attention_subsum_blocked(q, k, v, blk, softmax_scale=scale, causal=causal),
    ):
        check(res, *ref)
        assert res.counts.flops == std.counts.flops


def test_blocked_subsum_rescales_less_than_per_key_subsum():
    q, k, v = qkv(16, 1, 1, 1, 32, 64, 16)
    q, k, v = q[0, 0], k[0, 0], v[0, 0]
    per_key = attention_subsum(q, k, v).counts.nonmatmul_flops
    blocked = attention_subsum_blocked(q, k, v, 16).counts.nonmatmul_flops
    assert blocked < per_key
    assert attention_subsum_blocked(q, k, v, 1).counts.nonmatmul_flops > blocked


# ---------------------------------------------------------------------------
# Bad inputs


def _t(*shape):
    return torch.zeros(*shape, dtype=F64)


Q, K, V = _t(1, 2, 8, 4), _t(1, 2, 8, 4), _t(1, 2, 8, 4)
BAD = [
    ("k head_dim", ValueError, lambda: standard_attention(Q, _t(1, 2, 8, 5), V)),
    ("v shape", ValueError, lambda: flash_attn2(Q, K, _t(1, 2, 9, 4))),
    ("must all be 2-D", ValueError, lambda: flash_attn2(_t(8, 4), K, V)),
    ("head_dim d must be >= 1", ValueError, lambda: standard_attention(_t(1, 1, 8, 0), _t(1, 1, 8, 0), _t(1, 1, 8, 0))),
    ("multiple of k/v heads", ValueError, lambda: flash_attn1(_t(1, 3, 8, 4), K, V, block_sizes=(4, 4))),
    ("sram_size M = 3", ValueError, lambda: flash_attn1(Q, K, V, sram_size=3)),
    ("exactly one of sram_size", ValueError, lambda: flash_attn1(Q, K, V)),
    ("exactly one of sram_size", ValueError, lambda: flash_attn1(Q, K, V, sram_size=64, block_sizes=(4, 4))),
    ("sram_size must be an int", TypeError, lambda: flash_attn1(Q, K, V, sram_size=64.0)),
    ("block_sizes must be a pair", ValueError, lambda: flash_attn2(Q, K, V, block_sizes=(0, 4))),
    ("block_sizes must be a pair", ValueError, lambda: flash_attn1(Q, K, V, block_sizes=4)),
    ("block grid", ValueError, lambda: flash_attn2(Q, K, V, block_mask=BlockMask.dense(16, 8, 4))),
    ("must equal block_mask.block_size", ValueError,
     lambda: flash_attn2(Q, K, V, block_sizes=(2, 2), block_mask=BlockMask.dense(8, 8, 4))),
    ("block_mask must be", TypeError, lambda: flash_attn1(Q, K, V, block_mask=torch.ones(2, 2, dtype=torch.bool))),
    ("needs a block_mask", ValueError, lambda: block_sparse_flash_attn(Q, K, V, None)),
    ("dropout_p must be in [0, 1)", ValueError, lambda: standard_attention(Q, K, V, dropout_p=1.0)),
    ("dropout_p must be in [0, 1)", ValueError, lambda: standard_attention(Q, K, V, dropout_p=-0.1)),
    ("needs an explicit dropout_mask", ValueError, lambda: flash_attn2(Q, K, V, dropout_p=0.1)),
    ("dropout_mask must be a torch.bool", TypeError,
     lambda: flash_attn2(Q, K, V, dropout_p=0.1, dropout_mask=torch.ones(8, 8))),
    ("not broadcastable", ValueError,
     lambda: flash_attn2(Q, K, V, dropout_p=0.1, dropout_mask=torch.ones(7, 8, dtype=torch.bool))),
    ("alibi_slopes must have shape", ValueError, lambda: standard_attention(Q, K, V, alibi_slopes=_t(3))),
    ("alibi_slopes must be a floating", TypeError, lambda: standard_attention(Q, K, V, alibi_slopes=torch.ones(2, dtype=torch.long))),
    ("softcap must be >= 0", ValueError, lambda: flash_attn1(Q, K, V, block_sizes=(4, 4), softcap=-1.0)),
    ("window_size", ValueError, lambda: flash_attn2(Q, K, V, window_size=(-2, 0))),
    ("causal=True means", ValueError, lambda: flash_attn2(Q, K, V, causal=True, window_size=(-1, 3))),
    ("softmax_scale must be finite", ValueError, lambda: flash_attn2(Q, K, V, softmax_scale=float("nan"))),
    ("dtype must be a floating", TypeError, lambda: flash_attn2(Q, K, V, dtype=torch.int32)),
    ("q must be a floating-point", TypeError, lambda: flash_attn2(Q.long(), K, V)),
    ("must be 2-D", ValueError, lambda: attention_subsum(Q, K, V)),
    ("block_size must be a positive", ValueError, lambda: attention_subsum_blocked(Q[0, 0], K[0, 0], V[0, 0], 0)),
]


@pytest.mark.parametrize("match,exc,call", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_inputs_raise(match, exc, call):
    with pytest.raises(exc, match=match.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        call()
