"""The float64 FP8 twin: e4m3 rounding by arithmetic equals torch's cast, and the twin is exact attention
of its dequantised inputs except for the rounding of P, whose error stays within e4m3's bound."""

from __future__ import annotations

import math

import pytest
import torch

from flashtile.fp8 import FP8, dequantize, quantize_per_block, quantize_per_head, quantize_per_tensor
from flashtile.reference.fp8 import P_SCALE, fp8_attention, round_e4m3
from tests._oracle import attention_ref

F64 = torch.float64


def _e4m3_values() -> torch.Tensor:
    """Every float8_e4m3fn bit pattern as float64 (NaN included)."""
    return torch.arange(256, dtype=torch.uint8).view(FP8).to(F64)


def _tricky_values() -> torch.Tensor:
    """Representables, the midpoints between neighbours (ties), a hair either side, subnormals, past 448, specials."""
    vals = _e4m3_values()
    pos = torch.unique(vals[torch.isfinite(vals) & (vals >= 0)])
    mid = (pos[1:] + pos[:-1]) / 2
    hair = mid * 2.0**-20 + 2.0**-30
    past = torch.tensor([448.0, 449.0, 463.99, 464.0, 464.01, 479.0, 480.0, 481.0, 1e4, 3.4e38, math.inf])
    tiny = torch.tensor([2.0**-9, 2.0**-10, 2.0**-10 * 1.01, 2.0**-10 * 0.99, 3 * 2.0**-10, 2.0**-12, 1e-30, 0.0])
    one_side = torch.cat([pos, mid, mid + hair, mid - hair, past, tiny])
    return torch.cat([one_side, -one_side, torch.tensor([math.nan, -0.0])])


@pytest.mark.parametrize("src", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_round_e4m3_equals_torch_cast(src):
    """Ties (to even), subnormals, saturation at ±448 (inf included), NaN and -0, from every source dtype:
    bit for bit what ``x.float().to(float8_e4m3fn)`` gives (torch casts float64 through float32)."""
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(20000, generator=g, dtype=F64) * torch.exp2(torch.randint(-14, 11, (20000,), generator=g).to(F64))
    x = torch.cat([_tricky_values(), spread]).to(src)
    got = round_e4m3(x)
    want = x.to(FP8).to(F64) if src != F64 else x.float().to(FP8).to(F64)
    assert got.dtype == F64
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok])
    assert torch.equal(torch.signbit(got[ok]), torch.signbit(want[ok]))  # -0 stays -0
    assert got[ok].abs().max() == 448.0  # the inputs past 448 saturated


def test_round_e4m3_is_identity_on_e4m3_and_ties_go_to_even():
    vals = _e4m3_values()
    finite = vals[~torch.isnan(vals)]
    assert torch.equal(round_e4m3(finite), finite)
    # 1.0625 is halfway between 1 (mantissa 000) and 1.125 (001): even is 1; 1.1875 -> 1.25 (010)
    assert round_e4m3(torch.tensor([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10])).tolist() == [1.0, 1.25, 0.0, 2.0**-8]


def test_round_e4m3_rejects_non_float():
    with pytest.raises(TypeError, match="x must be"):
        round_e4m3(torch.arange(3))


def _qkv(b=2, hq=4, hk=2, nq=70, nk=90, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g, dtype=F64)
    k = torch.randn(b, hk, nk, d, generator=g, dtype=F64)
    v = torch.randn(b, hk, nk, d, generator=g, dtype=F64)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 2, 70, 90, 32), (1, 2, 2, 90, 40, 16)])  # GQA Nq < Nk; Nq > Nk: empty rows
def test_twin_without_rounding_is_exact_attention(causal, shape):
    b, hq, hk, nq, nk, d = shape
    q, k, v = _qkv(b, hq, hk, nq, nk, d)
    res = fp8_attention(q, k, v, causal=causal, softmax_scale=0.3, block_sizes=(32, 24), p_dtype=None)
    out, lse = attention_ref(q, k, v, causal=causal, scale=0.3)
    torch.testing.assert_close(res.out, out, rtol=0, atol=1e-12)
    assert torch.equal(torch.isneginf(res.lse), torch.isneginf(lse))
    fin = torch.isfinite(lse)
    torch.testing.assert_close(res.lse[fin], lse[fin], rtol=0, atol=1e-12)
    if causal and nq > nk:
        assert bool(torch.isneginf(res.lse).any()) and bool((res.out[torch.isneginf(res.lse)] == 0).all())


@pytest.mark.parametrize("granularity", ["tensor", "head", "block"])
def test_twin_dequantises_e4m3_inputs_exactly(granularity):
    """FP8 inputs with their descales, P unrounded: exact attention of the dequantised (float64) inputs."""
    q, k, v = _qkv()
    kw = {}
    if granularity == "tensor":
        (q8, qs), (k8, ks), (v8, vs) = (quantize_per_tensor(x) for x in (q, k, v))
    elif granularity == "head":
        (q8, qs), (k8, ks), (v8, vs) = quantize_per_head(q, kv_heads=2), quantize_per_head(k), quantize_per_head(v)
        assert qs.shape == ks.shape == vs.shape == (2, 2)  # FA3's (batch, kv_heads) for all three
    else:
        (q8, qs), (k8, ks), (v8, vs) = quantize_per_block(q, 32), quantize_per_block(k, 16), quantize_per_block(v, 16)
        kw = dict(descale_blocks=(32, 16))
    blocks = kw.get("descale_blocks", (None, None))
    deq = [dequantize(x8, s, block_size=bs, dtype=F64) for x8, s, bs in ((q8, qs, blocks[0]), (k8, ks, blocks[1]), (v8, vs, blocks[1]))]
    res = fp8_attention(q8, k8, v8, qs, ks, vs, p_dtype=None, **kw)
    out, lse = attention_ref(*deq)
    torch.testing.assert_close(res.out, out, rtol=0, atol=1e-12)
    torch.testing.assert_close(res.lse, lse, rtol=0, atol=1e-12)
    assert not torch.equal(deq[0], q)  # the inputs were rounded: the test compares against the rounded values


@pytest.mark.parametrize("causal", [False, True])
def test_p_rounded_to_e4m3_error_within_bound(causal):
    """P~ = 2^8 exp(S - m) rounded to e4m3: |error| <= 2^-4 P~ + 2^-10 (subnormal half-spacing), so
    |O - O_exact| <= (2^-4 + Nk 2^-10 / 2^8) max|v| (l >= 2^8: the row max contributes 2^8)."""
    q, k, v = _qkv(nq=64, nk=96)
    exact = attention_ref(q, k, v, causal=causal)[0]
    res = fp8_attention(q, k, v, causal=causal, block_sizes=(32, 32))
    err = (res.out - exact).abs().max()
    bound = (2.0**-4 + q.shape[2] * 2.0**-10 / P_SCALE) * v.abs().max()
    assert 0 < err <= bound
    # LSE comes from the unrounded sum, as the kernel's row sum is taken before P is converted
    torch.testing.assert_close(res.lse, attention_ref(q, k, v, causal=causal)[1], rtol=0, atol=1e-12)


def test_p_scale_moves_p_out_of_e4m3_subnormals():
    """FA3's 2^8 shift of P: with p_scale = 1, entries below 2^-6 lose precision and the error grows."""
    q, k, v = _qkv(nq=64, nk=256, d=16)
    q = q * 3  # sharper softmax: many small P entries
    exact = attention_ref(q, k, v)[0]
    shifted = (fp8_attention(q, k, v).out - exact).pow(2).mean()
    unshifted = (fp8_attention(q, k, v, p_scale=1.0).out - exact).pow(2).mean()
    assert shifted < unshifted


def test_p_rounded_to_bf16_uses_bf16_precision():
    q, k, v = _qkv()
    exact = attention_ref(q, k, v)[0]
    err = (fp8_attention(q, k, v, p_dtype=torch.bfloat16, p_scale=1.0).out - exact).abs().max()
    assert 0 < err <= 2.0**-8 * v.abs().max()


def test_counts_follow_fa2():
    b, hq, hk, n, d = 1, 2, 1, 100, 16
    q, k, v = _qkv(b, hq, hk, n, n, d)
    c = fp8_attention(q, k, v, block_sizes=(32, 32)).counts
    assert c.flops == 4 * b * hq * n * n * d
    assert c.reads == b * hq * (n * d + 4 * 2 * n * d)  # Q once; K, V once per each of the 4 Q blocks
    assert c.writes == b * hq * n * (d + 1)
    causal = fp8_attention(q, k, v, block_sizes=(32, 32), causal=True).counts
    assert causal.skipped_blocks == b * hq * 6 and causal.flops < c.flops  # 4x4 tiles, 6 above the diagonal


def test_twin_errors_name_the_argument():
    q, k, v = _qkv(b=1, hq=2, hk=2, nq=8, nk=8, d=8)
    q8, qs = quantize_per_tensor(q)
    with pytest.raises(TypeError, match="^q must"):
        fp8_attention(q.long(), k, v)
    with pytest.raises(ValueError, match="^k must be 4-D"):
        fp8_attention(q, k[0], v)
    with pytest.raises(ValueError, match="^v has NaN"):
        fp8_attention(q, k, torch.full_like(v, math.nan))
    with pytest.raises(ValueError, match="^v shape"):
        fp8_attention(q, k, v[..., :4])
    with pytest.raises(ValueError, match="q_descale must be finite and > 0"):
        fp8_attention(q8, k, v, torch.tensor(math.nan))
    with pytest.raises(ValueError, match="k_descale of shape"):
        fp8_attention(q, k, v, None, torch.ones(1, 3))
    with pytest.raises(ValueError, match="v_descale is per block"):
        fp8_attention(q, k, v, None, None, torch.ones(1, 2, 1))
    with pytest.raises(TypeError, match="q_descale must be"):
        fp8_attention(q8, k, v, 0.5)
    with pytest.raises(TypeError, match="p_dtype"):
        fp8_attention(q, k, v, p_dtype=torch.int8)
    with pytest.raises(ValueError, match="p_scale"):
        fp8_attention(q, k, v, p_scale=0.0)
    with pytest.raises(TypeError, match="causal"):
        fp8_attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match="block_sizes"):
        fp8_attention(q, k, v, block_sizes=(0, 8))
    with pytest.raises(ValueError, match="q heads"):
        fp8_attention(q[:, :1], k, v)
