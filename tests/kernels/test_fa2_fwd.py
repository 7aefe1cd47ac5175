"""Tests of the Triton FlashAttention-2 forward kernel against a dense float64 oracle.

On a machine without a GPU the kernel runs in Triton's interpreter (see
tests/conftest.py), so shapes here are small (N <= ~100).  Tests marked ``gpu``
use long sequences and compare a few hundred rows with a row-chunked
reference that never materialises the N x N score matrix.

Oracle and tolerances: tests/_oracle.py (float64 ``attention_ref``, independent of flashtile;
elementwise ``assert_close`` with the table's entry for the output's dtype, and for the fp32 LSE).
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtile.ops import validate
from flashtile.runtime import fa2_fwd
from flashtile.runtime.common import dropout_keep_mask
from flashtile.runtime.fa2_fwd import fa2_forward, fwd_config
from flashtile.reference.masks import BlockMask
from tests._oracle import assert_close, attention_ref


# --------------------------------------------------------------------------- #
# oracle and comparison
# --------------------------------------------------------------------------- #
def assert_matches(out, lse, ref_out, ref_lse):
    """out and lse against the oracle with the table's tolerances; empty rows exactly 0 (and LSE -inf)."""
    empty = torch.isneginf(ref_lse).cpu()
    assert (out.detach().cpu()[empty] == 0).all(), "rows with no allowed key must output exactly 0"
    assert_close(out, ref_out, what="out")
    assert_close(lse, ref_lse, what="lse")


def qkv(b, hq, hk, nq, nk, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, n: torch.randn(b, h, n, d, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return mk(hq, nq), mk(hk, nk), mk(hk, nk)


def run_and_check(device, *, b=2, hq=2, hk=2, nq=48, nk=48, d=32, dtype=torch.float32, seed=0, **kw):
    q, k, v = qkv(b, hq, hk, nq, nk, d, dtype, device, seed)
    scale = kw.pop("scale", d ** -0.5)
    keep = kw.pop("keep", None)
    out, lse = fa2_forward(q, k, v, softmax_scale=scale, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.is_contiguous()
    ref_kw = dict(
        causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
        alibi=kw.get("alibi_slopes"), bias=kw.get("bias"), block_mask=kw.get("block_mask"),
        keep=keep, dropout_p=kw.get("dropout_p", 0.0),
    )
    ref_out, ref_lse = attention_ref(q, k, v, scale=scale, **ref_kw)
    assert_matches(out, lse, ref_out, ref_lse)
    return out, lse, ref_lse


# --------------------------------------------------------------------------- #
# dtypes, head dims, tails
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nq,nk", [(64, 64), (37, 53)])
def test_dense_matches_oracle(device, dtype, nq, nk):
    run_and_check(device, nq=nq, nk=nk, dtype=dtype)


@pytest.mark.parametrize("d", [1, 8, 48, 80])
def test_head_dims_padded_to_power_of_two(device, d):
    # d not a power of two >= 16: the tile is padded and loads/stores masked along d
    run_and_check(device, b=1, hq=2, hk=1, nq=33, nk=45, d=d, causal=True)


def test_head_dim_256(device):
    run_and_check(device, b=1, hq=1, hk=1, nq=20, nk=40, d=256, dtype=torch.float16)


def test_scale_is_used(device):
    out, _, _ = run_and_check(device, b=1, hq=1, hk=1, nq=24, nk=40, scale=0.9)
    out2, _, _ = run_and_check(device, b=1, hq=1, hk=1, nq=24, nk=40, scale=0.2)
    assert (out - out2).abs().max() > 1e-2


# --------------------------------------------------------------------------- #
# causal and local (sliding-window) masks, bottom-right aligned
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("nq,nk", [(40, 40), (24, 70), (70, 24), (1, 77)])
def test_causal(device, nq, nk):
    _, _, ref_lse = run_and_check(device, nq=nq, nk=nk, causal=True)
    if nq > nk:  # rows i < Nq - Nk see no key under bottom-right alignment
        assert torch.isneginf(ref_lse[..., : nq - nk]).all()


@pytest.mark.parametrize(
    "window,causal", [((8, 0), False), ((5, 7), False), ((-1, 3), False), ((10, -1), False), ((0, 0), False), ((6, -1), True)]
)
def test_windows(device, window, causal):
    run_and_check(device, nq=45, nk=67, window_size=window, causal=causal)


def test_fully_masked_rows_are_zero_not_nan(device):
    # window (0, 0) with Nq > Nk: rows i < Nq - Nk have an empty window
    out, lse, _ = run_and_check(device, b=1, hq=2, hk=2, nq=60, nk=20, window_size=(0, 0))
    assert (out[:, :, :40] == 0).all() and torch.isneginf(lse[:, :, :40]).all()
    assert torch.isfinite(lse[:, :, 40:]).all()


@settings(max_examples=80, deadline=None)
@given(
    nq=st.integers(1, 80),
    nk=st.integers(1, 80),
    left=st.integers(-1, 40),
    right=st.integers(-1, 40),
    causal=st.booleans(),
    tiles=st.sampled_from([(16, 16), (16, 32), (32, 16), (32, 64), (64, 32)]),
    sparse_block=st.sampled_from([None, (32, 32), (16, 64)]),
)
def test_mask_geometry_any_tiling(nq, nk, left, right, causal, tiles, sparse_block):
    """The three-segment kv walk (left edge / unmasked band / right edge), alone
    and inside the listed blocks of a block mask, under any tiling."""
    window = (left, 0 if causal else right)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mask = None
    if sparse_block is not None:
        mask = BlockMask.random(nq, nk, 0.6, sparse_block, generator=torch.Generator().manual_seed(nq + 131 * nk))
    with mock.patch.object(fa2_fwd, "fwd_config", lambda *a, **kw: (*tiles, 4, 1)):
        run_and_check(device, b=1, hq=1, hk=1, nq=nq, nk=nk, d=16, causal=causal, window_size=window,
                      block_mask=mask, seed=nq * 97 + nk)


@settings(max_examples=20, deadline=None)
@given(
    nq=st.integers(1, 70),
    nk=st.integers(1, 70),
    d=st.sampled_from([8, 16, 40, 64]),
    heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    causal=st.booleans(),
    softcap=st.sampled_from([0.0, 2.5]),
    alibi=st.booleans(),
    dropout_p=st.sampled_from([0.0, 0.4]),
)
def test_random_feature_combinations(nq, nk, d, heads, dtype, causal, softcap, alibi, dropout_p):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hq, hk = heads
    slopes = torch.linspace(0.1, 0.6, hq).to(device) if alibi else None
    keep = dropout_keep_mask(3, 17, 1, hq, nq, nk, dropout_p, device) if dropout_p else None
    run_and_check(device, b=1, hq=hq, hk=hk, nq=nq, nk=nk, d=d, dtype=dtype, causal=causal, softcap=softcap,
                  alibi_slopes=slopes, dropout_p=dropout_p, philox_seed=3, philox_offset=17, keep=keep)


def test_fully_masked_kv_tiles_are_never_loaded(device):
    """NaN-poison keys that no row of the first query tile may see: if the kernel
    loaded their tiles, 0 * NaN would reach the output of that tile's rows."""
    nq = nk = 96
    block_m, block_n = 16, 16  # causal: query tile 0 needs kv tile 0 only
    q, k, v = qkv(1, 1, 1, nq, nk, 32, torch.float32, device)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, block_n:] = float("nan")
    v2[:, :, block_n:] = float("nan")
    with mock.patch.object(fa2_fwd, "fwd_config", lambda *a, **kw: (block_m, block_n, 4, 1)):
        out, lse = fa2_forward(q, k2, v2, softmax_scale=32 ** -0.5, causal=True)
    ref_out, ref_lse = attention_ref(q, k, v, causal=True)
    rows = slice(0, block_m)
    assert_matches(out[:, :, rows], lse[:, :, rows], ref_out[:, :, rows], ref_lse[:, :, rows])
    assert torch.isnan(out[:, :, block_m:]).any()  # the poison is real: later tiles do load it


def test_window_skips_tiles_left_of_the_band(device):
    # Nq=16, Nk=160, causal with left=10: rows see keys [i + 134, i + 144] only
    nq, nk, d = 16, 160, 16
    q, k, v = qkv(1, 1, 1, nq, nk, d, torch.float32, device)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :128] = float("nan")  # every tiling with BLOCK_N <= 128 skips these
    v2[:, :, :128] = float("nan")
    out, lse = fa2_forward(q, k2, v2, softmax_scale=d ** -0.5, causal=True, window_size=(10, -1))
    ref_out, ref_lse = attention_ref(q, k, v, causal=True, window=(10, -1))
    assert_matches(out, lse, ref_out, ref_lse)


# --------------------------------------------------------------------------- #
# score modifiers: softcap, ALiBi, additive bias
# --------------------------------------------------------------------------- #
def test_softcap(device):
    out, _, _ = run_and_check(device, nq=40, nk=56, softcap=1.5, scale=1.0, causal=True)
    plain, _, _ = run_and_check(device, nq=40, nk=56, scale=1.0, causal=True)
    assert (out - plain).abs().max() > 1e-2  # the cap really changed the scores


@pytest.mark.parametrize("cap", [1e3, 1e6, 1e30])
def test_softcap_large_caps_keep_fp32_accuracy(device, cap):
    """Caps far above the scores (s / c tiny): tanh's series keeps c * tanh(s / c) at fp32 accuracy (through
    1 - 2 / (e^2x + 1) alone, c = 1e6 put the scores 0.06 off)."""
    run_and_check(device, nq=40, nk=56, softcap=cap, scale=1.0, causal=True)


@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi(device, per_batch):
    b, h = 2, 4
    shape = (b, h) if per_batch else (h,)
    slopes = (torch.rand(shape, generator=torch.Generator().manual_seed(3)) * 0.5 + 0.05).to(device)
    run_and_check(device, b=b, hq=h, hk=2, nq=35, nk=50, alibi_slopes=slopes, causal=per_batch)


def test_bias_float_broadcast_over_batch(device):
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(1, 2, 30, 44, generator=g).to(device)  # broadcast over batch
    run_and_check(device, b=2, hq=2, hk=2, nq=30, nk=44, bias=bias)


def test_bias_from_boolean_mask_with_empty_rows(device):
    # (Nq, Nk) mask broadcast over batch and heads; row 3 and row 17 see nothing
    g = torch.Generator().manual_seed(6)
    keep = torch.rand(30, 44, generator=g) < 0.6
    keep[3] = False
    keep[17] = False
    bias = torch.where(keep, 0.0, -math.inf).to(device)
    out, lse, _ = run_and_check(device, b=2, hq=2, hk=1, nq=30, nk=44, bias=bias, dtype=torch.float16)
    assert (out[:, :, [3, 17]] == 0).all() and torch.isneginf(lse[:, :, [3, 17]]).all()


def test_bias_with_alibi_and_softcap_order(device):
    # order of the definition: softcap, then ALiBi, then the bias
    slopes = torch.tensor([0.3, 0.1], device=device)
    bias = torch.randn(30, 44, generator=torch.Generator().manual_seed(7)).to(device)
    run_and_check(device, b=1, hq=2, hk=2, nq=30, nk=44, softcap=2.0, alibi_slopes=slopes, bias=bias, window_size=(12, 4))


# --------------------------------------------------------------------------- #
# dropout
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_matches_explicit_keep_mask(device, causal):
    b, h, nq, nk, p = 2, 2, 40, 52, 0.3
    keep = dropout_keep_mask(1234, 77, b, h, nq, nk, p, device)
    assert keep.any() and not keep.all()
    run_and_check(device, b=b, hq=h, hk=h, nq=nq, nk=nk, dropout_p=p, philox_seed=1234, philox_offset=77,
                  keep=keep, causal=causal)


def test_dropout_lse_is_dropout_free(device):
    q, k, v = qkv(1, 2, 2, 32, 40, 16, torch.float32, device)
    _, lse_drop = fa2_forward(q, k, v, softmax_scale=0.25, dropout_p=0.5, philox_seed=9)
    _, lse = fa2_forward(q, k, v, softmax_scale=0.25)
    assert torch.equal(lse_drop, lse)


def test_dropout_state_from_a_device_tensor(device):
    """rng_state, the int64 [seed, offset] tensor read by the kernel (what the op draws on the
    device), gives exactly the output of the same pair passed as ints; wrong ones are refused."""
    q, k, v = qkv(1, 2, 2, 32, 40, 16, torch.float32, device)
    seed, offset = 2**41 + 3, 2**35 + 1
    want, _ = fa2_forward(q, k, v, softmax_scale=0.25, dropout_p=0.4, philox_seed=seed, philox_offset=offset)
    rng = torch.tensor([seed, offset], dtype=torch.int64, device=device)
    got, _ = fa2_forward(q, k, v, softmax_scale=0.25, dropout_p=0.4, rng_state=rng)
    assert torch.equal(got, want)
    with pytest.raises(TypeError, match="rng_state"):
        fa2_forward(q, k, v, softmax_scale=0.25, dropout_p=0.4, rng_state=rng.float())
    with pytest.raises(ValueError, match="rng_state"):
        fa2_forward(q, k, v, softmax_scale=0.25, dropout_p=0.4, rng_state=rng[:1])
    with pytest.raises(ValueError, match="philox_seed"):
        fa2_forward(q, k, v, softmax_scale=0.25, dropout_p=0.4, philox_seed=-1)


def test_wide_kv_row_strides_are_compacted(device):
    """K/V tiles use 32-bit in-tile offsets (key x row stride): k, v whose row stride reaches
    TILE_ROW_STRIDE_MAX go through compact copies and give the output of contiguous inputs."""
    from flashtile.runtime.common import TILE_ROW_STRIDE_MAX, wide_rows

    q, k, v = qkv(1, 1, 1, 3, 2, 16, torch.float32, device)

    def spread(x):  # same values, row stride TILE_ROW_STRIDE_MAX
        y = torch.zeros(TILE_ROW_STRIDE_MAX * 2, device=device).as_strided(x.shape, (0, 0, TILE_ROW_STRIDE_MAX, 1))
        return y.copy_(x)

    assert wide_rows(spread(k)) and not wide_rows(k, v)
    want, want_lse = fa2_forward(q, k, v, softmax_scale=0.25)
    got, lse = fa2_forward(q, spread(k), spread(v), softmax_scale=0.25)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize(
    "b,hq,nq", [(2048, 32, 16), (70000, 1, 16), (1, 70000, 16), (1, 64, 263168), (2**20, 2**11 - 1, 1), (1, 1, 2**31 - 1)]
)
def test_grid_within_cuda_limits(b, hq, nq):
    """The forward's grid at every GPU tile size fits CUDA's limits (2^31 - 1 programs on x,
    65535 on y and z) with a program per (q tile, batch-head) pair: B or Hq > 65535 used to be
    refused."""
    from flashtile.runtime.common import GRID_X_MAX, GRID_YZ_MAX

    for block_m in (64, 128):
        grid = fa2_fwd.fwd_grid(b, hq, nq, block_m)
        tiles = -(-nq // block_m)
        assert len(grid) == 3 and grid[0] == tiles <= GRID_X_MAX
        assert 1 <= grid[1] <= GRID_YZ_MAX and 1 <= grid[2] <= GRID_YZ_MAX
        assert grid[1] * grid[2] >= b * hq > grid[1] * (grid[2] - 1)
    with pytest.raises(ValueError, match="batch \\* heads"):
        fa2_fwd.fwd_grid(2**20, 2**11, 1, 64)  # 2^31 pairs: past what int32 pair indices reach


# --------------------------------------------------------------------------- #
# GQA / MQA and layouts
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("hq,hk", [(4, 2), (6, 1)])
def test_gqa_mqa(device, hq, hk):
    run_and_check(device, b=2, hq=hq, hk=hk, nq=33, nk=41, causal=hq == 4)


def test_flash_attn_layout_transposed_views_and_out(device):
    # (B, N, H, d) tensors seen as (B, H, N, d) views: non-contiguous heads and rows
    b, n, hq, hk, d = 2, 37, 4, 2, 32
    g = torch.Generator().manual_seed(11)
    q = torch.randn(b, n, hq, d, generator=g).to(device).transpose(1, 2)
    k = torch.randn(b, n + 9, hk, d, generator=g).to(device).transpose(1, 2)
    v = torch.randn(b, n + 9, hk, d, generator=g).to(device).transpose(1, 2)
    out_buf = torch.full((b, n, hq, d), float("nan"), device=device)
    out, lse = fa2_forward(q, k, v, softmax_scale=d ** -0.5, causal=True, out=out_buf.transpose(1, 2))
    assert out.data_ptr() == out_buf.data_ptr()
    ref_out, ref_lse = attention_ref(q, k, v, causal=True)
    assert_matches(out_buf.transpose(1, 2), lse, ref_out, ref_lse)


def test_non_unit_last_stride_inputs_and_out(device):
    q, k, v = qkv(1, 2, 2, 24, 30, 32, torch.float32, device)
    qs, ks, vs = (torch.stack([x, x], dim=-1).flatten(-2)[..., ::2] for x in (q, k, v))  # same values, d-stride 2
    out_buf = torch.zeros(1, 2, 24, 64, device=device)
    out, lse = fa2_forward(qs, ks, vs, softmax_scale=0.2, out=out_buf[..., ::2])
    assert out.data_ptr() == out_buf.data_ptr()
    ref_out, ref_lse = attention_ref(q, k, v, scale=0.2)
    assert_matches(out_buf[..., ::2], lse, ref_out, ref_lse)
    assert (out_buf[..., 1::2] == 0).all()  # the view's gaps are untouched


# --------------------------------------------------------------------------- #
# empty and degenerate sequences
# --------------------------------------------------------------------------- #
def test_empty_keys(device):
    q, k, v = qkv(2, 2, 2, 9, 0, 16, torch.float16, device)
    out, lse = fa2_forward(q, k, v, softmax_scale=0.25)
    assert out.shape == (2, 2, 9, 16) and (out == 0).all() and torch.isneginf(lse).all()


def test_empty_queries(device):
    q, k, v = qkv(2, 2, 2, 0, 12, 16, torch.float32, device)
    out, lse = fa2_forward(q, k, v, softmax_scale=0.25, causal=True)
    assert out.shape == (2, 2, 0, 16) and lse.shape == (2, 2, 0)


def test_single_query_decoding(device):
    run_and_check(device, b=3, hq=4, hk=1, nq=1, nk=70, dtype=torch.bfloat16, causal=True)


# --------------------------------------------------------------------------- #
# block-sparse (Algorithm 5)
# --------------------------------------------------------------------------- #
NQ_BS, NK_BS = 70, 90


@pytest.mark.parametrize(
    "make,causal",
    [
        (lambda: BlockMask.causal(NQ_BS, NK_BS, 32), True),
        (lambda: BlockMask.sliding_window(NQ_BS, NK_BS, (20, 0), (16, 32)), False),
        (lambda: BlockMask.global_local(NQ_BS, NK_BS, global_blocks=1, local_blocks=1, block_size=32), False),
        (lambda: BlockMask.strided(NQ_BS, NK_BS, stride=2, block_size=(32, 16)), True),
        (lambda: BlockMask.random(NQ_BS, NK_BS, 0.5, (48, 80), generator=torch.Generator().manual_seed(1)), False),
    ],
)
def test_block_sparse_constructors(device, make, causal):
    run_and_check(device, nq=NQ_BS, nk=NK_BS, block_mask=make(), causal=causal)


def test_block_sparse_per_head_masks_with_empty_block_rows(device):
    g = torch.Generator().manual_seed(2)
    m = torch.rand(2, 2, 3, 3, generator=g) < 0.5
    m[0, 1, 1] = False  # rows 32..63 of (batch 0, head 1) see nothing
    m[1, 0, 0] = True
    mask = BlockMask(m, (32, 32))
    out, lse, _ = run_and_check(device, nq=NQ_BS, nk=NK_BS, window_size=(40, 10), block_mask=mask, dropout_p=0.2,
                                philox_seed=5, keep=dropout_keep_mask(5, 0, 2, 2, NQ_BS, NK_BS, 0.2, device))
    assert (out[0, 1, 32:64] == 0).all() and torch.isneginf(lse[0, 1, 32:64]).all()


def test_block_sparse_skips_unlisted_blocks(device):
    # key block 1 is dropped for every query block: poisoning it must not reach the output
    mask = BlockMask.dense(NQ_BS, NK_BS, 32)
    m = mask.mask.clone()
    m[:, 1] = False
    mask = BlockMask(m, (32, 32))
    q, k, v = qkv(1, 2, 1, NQ_BS, NK_BS, 32, torch.float32, device)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 32:64] = float("nan")
    v2[:, :, 32:64] = float("inf")
    out, lse = fa2_forward(q, k2, v2, softmax_scale=32 ** -0.5, block_mask=mask)
    ref_out, ref_lse = attention_ref(q, k, v, block_mask=mask)
    assert_matches(out, lse, ref_out, ref_lse)


def test_block_mask_grid_must_cover_the_sequences(device):
    """The block lists are indexed per query tile: a grid that does not cover (Nq, Nk) is refused
    (block sizes are checked at the public boundary, tests/ops/test_ops_validate.py)."""
    q, k, v = qkv(1, 1, 1, 40, 40, 16, torch.float32, device)
    with pytest.raises(ValueError, match="block grid"):
        fa2_forward(q, k, v, softmax_scale=0.25, block_mask=BlockMask.dense(40, 72, 16))


# --------------------------------------------------------------------------- #
# everything at once
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combination(device, dtype):
    """causal + GQA + window + softcap + ALiBi + dropout + ragged tails."""
    b, hq, hk, nq, nk, p = 2, 4, 2, 45, 61, 0.25
    keep = dropout_keep_mask(42, 1000, b, hq, nq, nk, p, device)
    slopes = torch.linspace(0.05, 0.4, hq).to(device)
    run_and_check(device, b=b, hq=hq, hk=hk, nq=nq, nk=nk, d=24, dtype=dtype, causal=True, window_size=(17, -1),
                  softcap=3.0, alibi_slopes=slopes, dropout_p=p, philox_seed=42, philox_offset=1000, keep=keep)


# --------------------------------------------------------------------------- #
# tile configuration
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", validate.SUPPORTED_DTYPES)
def test_gpu_config_table_and_autotune_space_fit_hopper_budgets(monkeypatch, dtype):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read by fwd_config only: ask for the GPU table
    esize = torch.empty(0, dtype=dtype).element_size()
    for d in (1, 16, 48, 64, 80, 128, 192, 256):
        block_d = max(16, 1 << (d - 1).bit_length())
        for n in (1, 64, 4096):
            for heavy in (False, True):
                bm, bn, warps, stages = fwd_config(d, dtype, True, n, n, "cuda", heavy=heavy)
                assert bm >= 16 and bn >= 16 and bm & (bm - 1) == 0 and bn & (bn - 1) == 0
                assert fa2_fwd._fits(bm, bn, warps, stages, block_d, esize), (d, n, heavy)
        space = fa2_fwd._autotune_configs()
        kept = fa2_fwd._prune(space, {"Q": torch.empty(0, dtype=dtype)}, BLOCK_D=block_d)
        assert kept and all(
            fa2_fwd._fits(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, block_d, esize) for c in kept
        )
        if block_d == 256:
            assert len(kept) < len(space)  # the big tiles cannot hold a 256-wide head


# --------------------------------------------------------------------------- #
# GPU: long sequences against a row-chunked reference
# --------------------------------------------------------------------------- #
def rows_reference(q, k, v, rows, *, causal=False, window=(-1, -1), chunk=64):
    """float64 attention for the query rows ``rows`` only (never N x N), on q's device: per row
    chunk, scores (chunk, Nk), masked, softmax, times V.  Returns (out, lse) of
    shape (B, Hq, len(rows), d) and (B, Hq, len(rows))."""
    nq, nk = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    kf = k.double().repeat_interleave(group, 1)
    vf = v.double().repeat_interleave(group, 1)
    left, right = window[0], (0 if causal else window[1])
    outs, lses = [], []
    j = torch.arange(nk, device=q.device)
    for start in range(0, len(rows), chunk):
        r = rows[start : start + chunk].to(q.device)
        s = (q[:, :, r].double() @ kf.transpose(-1, -2)) * q.shape[-1] ** -0.5
        diag = (r + nk - nq)[:, None]
        ok = torch.ones(len(r), nk, dtype=torch.bool, device=q.device)
        if left >= 0:
            ok &= j[None] >= diag - left
        if right >= 0:
            ok &= j[None] <= diag + right
        s = s.masked_fill(~ok, -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), 0.0)
        outs.append(p @ vf)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def check_rows(q, k, v, out, lse, *, n_rows=256, causal=False, window=(-1, -1), seed=0):
    nq = q.shape[2]
    g = torch.Generator().manual_seed(seed)
    rows = torch.unique(torch.cat([torch.randint(0, nq, (n_rows,), generator=g), torch.tensor([0, nq - 1])]))
    ref_out, ref_lse = rows_reference(q, k, v, rows, causal=causal, window=window)
    r = rows.to(q.device)
    assert_matches(out[:, :, r], lse[:, :, r], ref_out, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "b,hq,hk,n,d,causal",
    [
        (2, 4, 2, 4096, 64, False),
        (2, 4, 2, 4096, 64, True),
        (1, 4, 4, 8192, 128, True),
        (1, 2, 1, 16384, 128, False),
        (1, 2, 2, 4096, 256, True),
    ],
)
def test_gpu_long_sequences_bf16(b, hq, hk, n, d, causal):
    q, k, v = qkv(b, hq, hk, n, n, d, torch.bfloat16, "cuda")
    out, lse = fa2_forward(q, k, v, softmax_scale=d ** -0.5, causal=causal)
    check_rows(q, k, v, out, lse, causal=causal)


@pytest.mark.gpu
def test_gpu_window_and_ragged_lengths_bf16():
    q, k, v = qkv(2, 8, 2, 3000, 5003, 128, torch.bfloat16, "cuda")
    out, lse = fa2_forward(q, k, v, softmax_scale=128 ** -0.5, window_size=(512, 128))
    check_rows(q, k, v, out, lse, window=(512, 128))


@pytest.mark.gpu
def test_gpu_single_head_131072_causal():
    q, k, v = qkv(1, 1, 1, 131072, 131072, 64, torch.bfloat16, "cuda")
    out, lse = fa2_forward(q, k, v, softmax_scale=64 ** -0.5, causal=True)
    check_rows(q, k, v, out, lse, n_rows=300, causal=True)


@pytest.mark.gpu
def test_gpu_offsets_beyond_2_pow_31():
    # batch 1 of q and out starts at element 2^31: 32-bit offsets would wrap
    b, h, n, d = 2, 1, 512, 64
    big = 2**31
    qbuf = torch.empty(big + h * n * d, dtype=torch.bfloat16, device="cuda")
    obuf = torch.zeros(big + h * n * d, dtype=torch.bfloat16, device="cuda")
    q = qbuf.as_strided((b, h, n, d), (big, n * d, d, 1))
    q.copy_(torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16))
    _, k, v = qkv(b, h, h, n, n, d, torch.bfloat16, "cuda")
    out, lse = fa2_forward(q, k, v, softmax_scale=d ** -0.5, causal=True, out=obuf.as_strided((b, h, n, d), (big, n * d, d, 1)))
    ref_out, ref_lse = attention_ref(q, k, v, causal=True)
    assert_matches(out, lse, ref_out, ref_lse)


@pytest.mark.gpu
def test_gpu_fp32_tf32_and_autotune(monkeypatch):
    q, k, v = qkv(1, 4, 4, 1000, 1100, 64, torch.float32, "cuda")
    out, lse = fa2_forward(q, k, v, softmax_scale=0.125, causal=True)
    assert_matches(out, lse, *attention_ref(q, k, v, scale=0.125, causal=True))
    monkeypatch.setenv("FLASHTILE_AUTOTUNE", "1")
    q, k, v = (x.half() for x in (q, k, v))
    out, lse = fa2_forward(q, k, v, softmax_scale=0.125, causal=True)
    assert_matches(out, lse, *attention_ref(q, k, v, scale=0.125, causal=True))


@pytest.mark.gpu
def test_gpu_block_sparse_bf16():
    n = 4096
    mask = BlockMask.global_local(n, n, global_blocks=1, local_blocks=2, block_size=128)
    q, k, v = qkv(2, 4, 4, n, n, 64, torch.bfloat16, "cuda")
    out, lse = fa2_forward(q, k, v, softmax_scale=0.125, block_mask=mask)
    ref_out, ref_lse = attention_ref(q[:, :, :512], k, v, block_mask=BlockMask(mask.mask[:4], (128, 128)))
    # first 512 rows: block-mask rows 0..3 (Nq < Nk for the oracle shifts nothing: no causal/window)
    assert_matches(out[:, :, :512], lse[:, :, :512], ref_out, ref_lse)


@pytest.mark.parametrize("scale", [-0.3, 0.0])
@pytest.mark.parametrize("causal", [False, True])
def test_nonpositive_scale(device, scale, causal):
    # the fast path takes the row max of unscaled scores; a negative scale is routed
    # through -q, and a zero scale gives uniform weights over the allowed keys
    run_and_check(device, nq=40, nk=56, scale=scale, causal=causal)
