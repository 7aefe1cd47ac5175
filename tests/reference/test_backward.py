"""Tests of the reference backward (recomputation by tiles, and the dense baseline).

The oracle is tests/_oracle.py's dense float64 forward (written from the
documented semantics, independently of flashtile.reference.masks)
differentiated by torch autograd; ``out`` and ``lse`` fed to the backward come
from that same forward.  Gradients must agree to the table's float64 entry,
1e-9 relative to the largest entry: float64 carries ~1e-16 per operation and a
gradient entry sums at most a few hundred products, so 1e-9 leaves room for
the conditioning of adversarial (+-1e4) logits and nothing more.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtile.reference.backward import BackwardResult, flash_attn_backward, standard_attention_backward
from flashtile.reference.masks import BlockMask, allowed_mask
from tests._oracle import assert_close, attention_ref_grads, ref_kwargs

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------
# The oracle: autograd of tests/_oracle.py


def oracle(q, k, v, dout, **opts):
    """(out, lse, dq, dk, dv) from autograd through tests._oracle.attention_ref; opts in the library's names."""
    opts = dict(opts)
    if "scale" in opts:
        opts["softmax_scale"] = opts.pop("scale")
    return attention_ref_grads(q, k, v, dout, **ref_kwargs(**opts))


def assert_grad_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within the table's tolerance for got's dtype (float64: 1e-9) of the largest entry; no NaN."""
    assert not torch.isnan(got).any()
    assert_close(got, want, what="gradient")


def make(seed, b, hq, hk, nq, nk, d, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g, dtype=torch.float64) * scale
    k = torch.randn(b, hk, nk, d, generator=g, dtype=torch.float64) * scale
    v = torch.randn(b, hk, nk, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, hq, nq, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def check_against_oracle(q, k, v, dout, block_sizes=(64, 64), **opts):
    """Both backward functions equal autograd of the dense oracle; returns the flash result."""
    out, lse, dq, dk, dv = oracle(q, k, v, dout, **opts)
    fa_opts = dict(opts)
    if "scale" in fa_opts:
        fa_opts["softmax_scale"] = fa_opts.pop("scale")
    res = flash_attn_backward(q, k, v, out, dout, lse, block_sizes=block_sizes, **fa_opts)
    assert isinstance(res, BackwardResult)
    for got, want in zip(res[:3], (dq, dk, dv)):
        assert_grad_close(got, want)
    for got, want in zip(standard_attention_backward(q, k, v, dout, **fa_opts), (dq, dk, dv)):
        assert_grad_close(got, want)
    return res, lse


# ---------------------------------------------------------------------------
# Hypothesis: shapes x every variant


def _block_mask(kind: str, nq: int, nk: int, bs: tuple[int, int], seed: int, b: int, hq: int) -> BlockMask | None:
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "random":
        return BlockMask.random(nq, nk, 0.6, bs, generator=g)
    if kind == "random_per_head":  # leading (B, Hq) dims: a different pattern per head
        tr, tc = math.ceil(nq / bs[0]), math.ceil(nk / bs[1])
        return BlockMask(torch.rand(b, hq, tr, tc, generator=g) < 0.5, bs)
    if kind == "causal":
        return BlockMask.causal(nq, nk, bs)
    if kind == "global_local":
        return BlockMask.global_local(nq, nk, global_blocks=1, local_blocks=1, block_size=bs)
    if kind == "strided_or_window":
        return BlockMask.strided(nq, nk, stride=3, block_size=bs) | BlockMask.sliding_window(nq, nk, (20, 5), bs)
    if kind == "random_and_causal":
        return BlockMask.random(nq, nk, 0.7, bs, generator=g) & BlockMask.causal(nq, nk, bs)
    raise AssertionError(kind)


BLOCK_KINDS = ["none", "random", "random_per_head", "causal", "global_local", "strided_or_window", "random_and_causal"]


@st.composite
def problems(draw):
    hk = draw(st.sampled_from([1, 2]))
    hq = hk * draw(st.sampled_from([1, 2, 4]))
    b = draw(st.sampled_from([1, 2]))
    nq = draw(st.integers(1, 150))
    nk = draw(st.integers(1, 150))
    d = draw(st.sampled_from([1, 2, 5, 16, 33, 64, 128]))
    bs = (draw(st.integers(8, 70)), draw(st.integers(8, 70)))
    causal = draw(st.booleans())
    left = draw(st.sampled_from([-1, 0, 3, 40]))
    right = 0 if causal else draw(st.sampled_from([-1, 0, 7, 40]))
    opts = dict(causal=causal, window_size=(left, right))
    opts["softcap"] = draw(st.sampled_from([0.0, 0.0, 2.0, 30.0]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed + 1)
    if draw(st.booleans()):
        shape = (hq,) if draw(st.booleans()) else (b, hq)
        opts["alibi_slopes"] = torch.rand(shape, generator=g, dtype=torch.float64)
    if draw(st.booleans()):
        opts["dropout_p"] = draw(st.sampled_from([0.1, 0.5]))
        shape = (b, hq, nq, nk) if draw(st.booleans()) else (nq, nk)  # broadcast over (B, Hq)
        opts["dropout_mask"] = torch.rand(shape, generator=g) >= opts["dropout_p"]
    opts["block_mask"] = _block_mask(draw(st.sampled_from(BLOCK_KINDS)), nq, nk, bs, seed, b, hq)
    data_scale = draw(st.sampled_from([1.0, 4.0]))
    return (seed, b, hq, hk, nq, nk, d, data_scale), bs, opts


@settings(max_examples=100, deadline=None)
@given(problems())
def test_matches_autograd_oracle(problem) -> None:
    (seed, b, hq, hk, nq, nk, d, data_scale), bs, opts = problem
    q, k, v, dout = make(seed, b, hq, hk, nq, nk, d, data_scale)
    res, _ = check_against_oracle(q, k, v, dout, block_sizes=bs, **opts)
    # the counts follow the closed form on every drawn problem (tiles = the mask's when given)
    tiles = opts["block_mask"].block_size if opts["block_mask"] is not None else bs
    allowed = allowed_mask(nq, nk, causal=opts["causal"], window_size=opts["window_size"], block_mask=opts["block_mask"])
    want = expected_counts(b, hq, hk, nq, nk, d, *tiles, allowed, opts)
    assert {key: getattr(res.counts, key) for key in want} == want


# ---------------------------------------------------------------------------
# Named variants


@pytest.mark.parametrize("nq,nk", [(20, 57), (57, 20), (33, 33), (1, 40), (40, 1)])
@pytest.mark.parametrize("window", [(-1, 0), (5, 0), (3, 2)])
def test_window_alignment(nq: int, nk: int, window: tuple[int, int]) -> None:
    """Causal and sliding windows are bottom-right aligned for Nq < Nk and Nq > Nk."""
    q, k, v, dout = make(nq * 100 + nk, 1, 2, 1, nq, nk, 8)
    causal = window[1] == 0
    res, lse = check_against_oracle(q, k, v, dout, block_sizes=(16, 12), causal=causal, window_size=window)
    empty = torch.isneginf(lse)
    if nq > nk and causal and window[0] < 0:
        # rows i with i + Nk - Nq < 0 see no key: exactly the first Nq - Nk rows
        assert empty[..., : nq - nk].all() and not empty[..., nq - nk :].any()
    assert (res.dq[empty] == 0).all()


def test_fully_masked_rows_give_no_gradient_and_no_nan() -> None:
    """Rows with lse = -inf contribute nothing to dK, dV, whatever dout holds, and get dQ = 0."""
    b, hq, hk, nq, nk, d = 2, 2, 1, 40, 30, 16
    q, k, v, dout = make(7, b, hq, hk, nq, nk, d)
    bm = BlockMask(torch.ones(3, 3, dtype=torch.bool), (16, 10))
    bm.mask[1, :] = False  # q rows 16..31 see nothing
    opts = dict(block_mask=bm, causal=True, softcap=5.0, alibi_slopes=torch.tensor([0.5, 0.25], dtype=torch.float64))
    res, lse = check_against_oracle(q, k, v, dout, **opts)
    empty = torch.isneginf(lse)
    assert empty[..., 16:32].all() and empty[..., :10].all()  # causal (Nq > Nk) empties rows 0..9 too
    assert (res.dq[empty] == 0).all()
    # huge dout on the empty rows changes nothing
    out, lse2, *_ = oracle(q, k, v, dout, **opts)
    dout2 = dout.clone()
    dout2[empty] = 1e30
    res2 = flash_attn_backward(q, k, v, out, dout2, lse2, **opts)
    for a, c in zip(res2[:3], res[:3]):
        assert not torch.isnan(a).any()
        torch.testing.assert_close(a, c, rtol=0, atol=0)


@pytest.mark.parametrize("nq,nk", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(nq: int, nk: int) -> None:
    q, k, v, dout = make(1, 1, 2, 2, nq, nk, 4)
    out = torch.zeros_like(q)
    lse = torch.full((1, 2, nq), NEG_INF, dtype=torch.float64)
    res = flash_attn_backward(q, k, v, out, dout, lse, block_sizes=(4, 4))
    assert res.dq.shape == q.shape and res.dk.shape == k.shape and res.dv.shape == v.shape
    for g in res[:3]:
        assert (g == 0).all()
    assert res.counts.flops == 0


@pytest.mark.parametrize("kind", ["pm1e4", "all_equal", "one_huge"])
@pytest.mark.parametrize("softcap", [0.0, 50.0])
def test_adversarial_logits(kind: str, softcap: float) -> None:
    b, hq, hk, nq, nk, d = 1, 2, 2, 37, 41, 8
    q, k, v, dout = make(11, b, hq, hk, nq, nk, d)
    if kind == "pm1e4":  # scores of +-1e4
        q = torch.sign(q) * 1e2
        k = torch.sign(k) * (1e2 / d) * math.sqrt(d)
    elif kind == "all_equal":
        k = k[:, :, :1].expand(b, hk, nk, d).clone()
    else:
        k[:, :, 17] = 1e3 * q[:, :, 0].mean(dim=1)  # one key far above the others for most rows
    check_against_oracle(q, k, v, dout, block_sizes=(16, 16), softcap=softcap, causal=True)


def test_dropout_mask_with_zero_p_is_used() -> None:
    """As in the forward references, a mask given with dropout_p = 0 drops entries (scale 1)."""
    q, k, v, dout = make(8, 1, 2, 1, 20, 30, 8)
    keep = torch.rand(1, 2, 20, 30, generator=torch.Generator().manual_seed(3)) > 0.3
    check_against_oracle(q, k, v, dout, block_sizes=(8, 8), dropout_p=0.0, dropout_mask=keep)


def test_dropout_mask_is_used() -> None:
    """Changing one kept entry of the keep mask changes dV: the mask is not ignored."""
    q, k, v, dout = make(3, 1, 1, 1, 9, 11, 4)
    keep = torch.ones(9, 11, dtype=torch.bool)
    keep[2, 5] = False
    res, _ = check_against_oracle(q, k, v, dout, block_sizes=(4, 4), dropout_p=0.3, dropout_mask=keep)
    out, lse, *_ = oracle(q, k, v, dout, dropout_p=0.3, dropout_mask=keep)
    res_all = flash_attn_backward(q, k, v, out, dout, lse, dropout_p=0.3, dropout_mask=torch.ones_like(keep))
    assert not torch.allclose(res.dv, res_all.dv)


@pytest.mark.parametrize("rank", [2, 3])
def test_lower_ranks(rank: int) -> None:
    """2-D (N, d) and 3-D (H, N, d) inputs give gradients of the same rank as the 4-D call."""
    q, k, v, dout = make(5, 1, 2, 2, 13, 19, 8)
    out, lse, dq, dk, dv = oracle(q, k, v, dout, causal=True)
    lead = (0, 0) if rank == 2 else (0,)
    res = flash_attn_backward(q[lead], k[lead], v[lead], out[lead], dout[lead], lse[lead], causal=True, block_sizes=(5, 7))
    for got, want in zip(res[:3], (dq, dk, dv)):
        assert got.dim() == rank
        assert_grad_close(got, want[lead])


def test_float32_dtype() -> None:
    """dtype=float32 computes in float32: within the table's float32 tolerance of float64."""
    q, k, v, dout = make(9, 1, 2, 1, 70, 90, 32)
    out, lse, dq, dk, dv = oracle(q, k, v, dout, causal=True)
    res = flash_attn_backward(q.float(), k.float(), v.float(), out.float(), dout.float(), lse.float(),
                              causal=True, dtype=None, block_sizes=(32, 32))
    for got, want in zip(res[:3], (dq, dk, dv)):
        assert got.dtype == torch.float32
        assert_grad_close(got, want)


# ---------------------------------------------------------------------------
# Counts


def expected_counts(b, hq, hk, nq, nk, d, br, bc, allowed, opts):
    """The closed form, from the tiles that hold at least one allowed element (B, Hq, Tr, Tc)."""
    visited = BlockMask.from_element_mask(allowed.expand(b, hq, nq, nk), (br, bc)).mask
    rows = torch.tensor([min(br, nq - i) for i in range(0, nq, br)], dtype=torch.int64)
    cols = torch.tensor([min(bc, nk - j) for j in range(0, nk, bc)], dtype=torch.int64)
    vis = visited.to(torch.int64)
    per_tile_rows = (vis * rows[:, None]).sum().item()  # sum over visited tiles of br_I
    per_tile_elems = (vis * rows[:, None] * cols[None, :]).sum().item()
    ops = 6 + 6 * (opts.get("softcap", 0) > 0) + 2 * (opts.get("alibi_slopes") is not None) + 2 * (opts.get("dropout_mask") is not None)
    return dict(
        reads=b * hq * (2 * nq * d + 2 * nk * d) + per_tile_rows * (3 * d + 2),
        writes=b * hq * (nq + 2 * nk * d) + per_tile_rows * d,
        flops=10 * per_tile_elems * d,
        nonmatmul_flops=b * hq * 2 * nq * d + ops * per_tile_elems + 2 * b * (hq - hk) * nk * d,
        visited_blocks=vis.sum().item(),
        skipped_blocks=vis.numel() - vis.sum().item(),
    )


@pytest.mark.parametrize(
    "nq,nk,br,bc,opts_name",
    [
        (100, 100, 32, 32, "dense"),
        (97, 130, 24, 40, "causal"),
        (130, 60, 17, 9, "causal"),
        (90, 90, 16, 16, "window"),
        (80, 96, 16, 16, "window_on_tile_edges"),
        (70, 110, 16, 20, "block"),
        (70, 110, 16, 20, "block_per_head"),
        (64, 80, 16, 16, "everything"),
    ],
)
def test_counts_equal_closed_form(nq, nk, br, bc, opts_name) -> None:
    b, hq, hk, d = 2, 4, 2, 8
    q, k, v, dout = make(nq + nk, b, hq, hk, nq, nk, d)
    g = torch.Generator().manual_seed(0)
    opts = {
        "dense": {},
        "causal": dict(causal=True),
        "window": dict(window_size=(10, 3)),
        # the window's edges fall exactly on tile boundaries: off-by-one visits would show
        "window_on_tile_edges": dict(window_size=(32, 16)),
        "block": dict(block_mask=BlockMask.random(nq, nk, 0.4, (br, bc), generator=g)),
        "block_per_head": dict(block_mask=BlockMask(torch.rand(b, hq, 5, 6, generator=g) < 0.5, (br, bc))),
        "everything": dict(causal=True, window_size=(20, 0), softcap=10.0,
                           alibi_slopes=torch.rand(hq, dtype=torch.float64), dropout_p=0.2,
                           dropout_mask=torch.rand(nq, nk, generator=g) > 0.2,
                           block_mask=BlockMask.global_local(nq, nk, block_size=(br, bc))),
    }[opts_name]
    out, lse, *_ = oracle(q, k, v, dout, **opts)
    res = flash_attn_backward(q, k, v, out, dout, lse, block_sizes=(br, bc), **opts)
    allowed = allowed_mask(nq, nk, causal=opts.get("causal", False), window_size=opts.get("window_size", (-1, -1)),
                           block_mask=opts.get("block_mask"))
    want = expected_counts(b, hq, hk, nq, nk, d, br, bc, allowed, opts)
    got = {key: getattr(res.counts, key) for key in want}
    assert got == want
    assert res.counts.extras == dict(init_writes=b * hq * nq * d, gqa_reduce_reads=2 * b * hq * nk * d,
                                     gqa_reduce_writes=2 * b * hk * nk * d)
    assert res.counts.extra_memory == b * hq * nq + 2 * b * hq * nk * d


@pytest.mark.parametrize("n,d,blk", [(128, 16, 32), (100, 8, 30), (64, 64, 64)])
def test_dense_counts_and_flops(n: int, d: int, blk: int) -> None:
    """Nothing skipped: the Tc form, and flops = 2.5 x the forward's 4 N^2 d per head."""
    q, k, v, dout = make(n, 1, 1, 1, n, n, d)
    out, lse, *_ = oracle(q, k, v, dout)
    c = flash_attn_backward(q, k, v, out, dout, lse, block_sizes=(blk, blk)).counts
    tc = math.ceil(n / blk)
    assert c.reads == 2 * n * d + 2 * n * d + tc * (3 * n * d + 2 * n)
    assert c.writes == n + 2 * n * d + tc * n * d
    assert c.flops == 2.5 * 4 * n * n * d
    assert c.skipped_blocks == 0 and c.visited_blocks == tc * tc
    assert c.extras["gqa_reduce_reads"] == 0 and c.extra_memory == n


def test_block_sparse_skips_io_and_flops() -> None:
    """Zero blocks cost nothing: the per-tile part of the traffic scales with the kept fraction."""
    nq = nk = 96
    d, bs = 8, (16, 16)
    q, k, v, dout = make(2, 1, 1, 1, nq, nk, d)
    fixed = 2 * nq * d + 2 * nk * d  # reads outside the tiles: O, dO, and K, V per kv block
    tiles = {}
    for name, mask in [("dense", torch.ones(6, 6, dtype=torch.bool)), ("half", torch.rand(6, 6, generator=torch.Generator().manual_seed(1)) < 0.5),
                       ("none", torch.zeros(6, 6, dtype=torch.bool))]:
        bm = BlockMask(mask, bs)
        out, lse, *_ = oracle(q, k, v, dout, block_mask=bm)
        res = flash_attn_backward(q, k, v, out, dout, lse, block_mask=bm)
        assert res.counts.visited_blocks == mask.sum().item()
        tiles[name] = (res.counts.reads - fixed, res.counts.flops, mask.sum().item())
    per_tile = (3 * 16 * d + 2 * 16, 10 * 16 * 16 * d)
    for reads, flops, kept in tiles.values():
        assert (reads, flops) == (kept * per_tile[0], kept * per_tile[1])
    assert tiles["none"][:2] == (0, 0)


def test_block_mask_sets_the_tiles() -> None:
    """With a block mask, block_sizes is ignored: the tiles are the mask's."""
    q, k, v, dout = make(4, 1, 1, 1, 50, 50, 4)
    bm = BlockMask.dense(50, 50, (10, 25))
    out, lse, *_ = oracle(q, k, v, dout)
    res = flash_attn_backward(q, k, v, out, dout, lse, block_mask=bm, block_sizes=(7, 7))
    assert res.counts.visited_blocks == 5 * 2


# ---------------------------------------------------------------------------
# Bad inputs


def _bad_cases():
    q, k, v, dout = make(0, 1, 2, 1, 8, 6, 4)
    out = torch.zeros_like(q)
    lse = torch.zeros(1, 2, 8, dtype=torch.float64)
    base = (q, k, v, out, dout, lse)
    cases = {
        "out shape": ((q, k, v, out[..., :3], dout, lse), {}, ValueError, "out"),
        "dout shape": ((q, k, v, out, dout[:, :, :5], lse), {}, ValueError, "dout"),
        "lse shape": ((q, k, v, out, dout, lse[..., :7]), {}, ValueError, "lse"),
        "lse nan": ((q, k, v, out, dout, lse.clone().fill_(float("nan"))), {}, ValueError, "lse"),
        "d = 0": ((q[..., :0], k[..., :0], v[..., :0], out[..., :0], dout[..., :0], lse), {}, ValueError, "head_dim"),
        "gqa": ((q[:, :1].expand(1, 3, 8, 4), k.expand(1, 2, 6, 4), v.expand(1, 2, 6, 4), out[:, :1].expand(1, 3, 8, 4),
                 dout[:, :1].expand(1, 3, 8, 4), lse[:, :1].expand(1, 3, 8)), {}, ValueError, "multiple"),
        "dropout no mask": (base, dict(dropout_p=0.1), ValueError, "dropout_mask"),
        "dropout range": (base, dict(dropout_p=1.0, dropout_mask=torch.ones(8, 6, dtype=torch.bool)), ValueError, "dropout_p"),
        "dropout mask dtype": (base, dict(dropout_p=0.1, dropout_mask=torch.ones(8, 6)), TypeError, "dropout_mask"),
        "dropout mask shape": (base, dict(dropout_p=0.1, dropout_mask=torch.ones(8, 5, dtype=torch.bool)), ValueError, "dropout_mask"),
        "block grid": (base, dict(block_mask=BlockMask.dense(8, 12, 4)), ValueError, "block_mask"),
        "block type": (base, dict(block_mask=torch.ones(2, 2, dtype=torch.bool)), TypeError, "block_mask"),
        "block sizes": (base, dict(block_sizes=(0, 4)), ValueError, "block_sizes"),
        "softcap": (base, dict(softcap=-1.0), ValueError, "softcap"),
        "alibi shape": (base, dict(alibi_slopes=torch.ones(3, dtype=torch.float64)), ValueError, "alibi_slopes"),
        "window": (base, dict(window_size=(-2, 0)), ValueError, "window_size"),
        "causal lookahead": (base, dict(causal=True, window_size=(-1, 2)), ValueError, "causal"),
        "int q": ((q.long(), k, v, out, dout, lse), {}, TypeError, "q"),
    }
    return cases


BAD = _bad_cases()


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_raise(name: str) -> None:
    args, kwargs, exc, word = BAD[name]
    with pytest.raises(exc, match=word):
        flash_attn_backward(*args, **kwargs)


def test_standard_backward_bad_inputs_raise() -> None:
    q, k, v, dout = make(0, 1, 2, 1, 8, 6, 4)
    with pytest.raises(ValueError, match="dout"):
        standard_attention_backward(q, k, v, dout[..., :2])
    with pytest.raises(ValueError, match="dropout_mask"):
        standard_attention_backward(q, k, v, dout, dropout_p=0.5)
