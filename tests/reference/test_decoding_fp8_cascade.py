"""Float64 twins of FP8-cache and shared-prefix decoding (flashtile/reference/decoding.py) against the oracle."""

from __future__ import annotations

import torch
from tests._oracle import assert_close, attention_ref

from flashtile.fp8 import quantize_per_head
from flashtile.reference.decoding import cascade_decoding, flash_decoding, fp8_cache_decoding, quantize_cache_rows


def test_quantize_cache_rows_is_torchs_cast():
    """round_e4m3 of x / descale equals torch's saturating float8_e4m3fn cast of the fp32 quotient, for
    normal values, ties, subnormals, zeros of both signs and values past 448."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 64, 16, generator=g) * torch.exp2(torch.randint(-12, 10, (2, 3, 64, 16), generator=g).float())
    x.view(-1)[:6] = torch.tensor([-0.0, 0.0, 1e6, -1e6, 13.0, 2.0**-9 * 3])
    descale = torch.rand(2, 3, generator=g) + 0.25
    got = quantize_cache_rows(x, descale)
    want = (x / descale[:, :, None, None]).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float64)
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


def test_fp8_cache_decoding_is_attention_of_the_dequantised_cache():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 1, 16, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, 2, 40, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g)
    k8, kd = quantize_per_head(k)
    v8, vd = quantize_per_head(v)
    res = fp8_cache_decoding(q, k8, v8, kd, vd, num_splits=3, cache_seqlens=[40, 7], softcap=3.0)
    deq_k = k8.double() * kd.double()[:, :, None, None]
    deq_v = v8.double() * vd.double()[:, :, None, None]
    ref_o, ref_l = attention_ref(q, deq_k, deq_v, lens=[40, 7], softcap=3.0)
    assert_close(res.out, ref_o, dtype=torch.float64)
    assert_close(res.lse, ref_l, dtype=torch.float64)
    same = flash_decoding(q, deq_k, deq_v, num_splits=3, cache_seqlens=[40, 7], softcap=3.0)
    assert res.counts.hbm == same.counts.hbm


def test_cascade_decoding_is_attention_over_the_concatenation_and_reads_the_prefix_once():
    g = torch.Generator().manual_seed(2)
    b, hq, hk, nq, d, p, n = 3, 4, 2, 2, 8, 24, 10
    q = torch.randn(b, hq, nq, d, generator=g, dtype=torch.float64)
    pk, pv = torch.randn(1, hk, p, d, generator=g), torch.randn(1, hk, p, d, generator=g)
    kc, vc = torch.randn(b, hk, n, d, generator=g), torch.randn(b, hk, n, d, generator=g)
    lens = [10, 2, 5]  # each own part at least Nq long: the cascade's mask is then the concatenation's causal mask
    res = cascade_decoding(q, pk, pv, kc, vc, num_splits=2, prefix_num_splits=3, cache_seqlens=lens, causal=True)
    full_k = torch.cat([pk.expand(b, -1, -1, -1), kc], dim=2)
    full_v = torch.cat([pv.expand(b, -1, -1, -1), vc], dim=2)
    full_lens = [p + n_own for n_own in lens]
    ref_o, ref_l = attention_ref(q, full_k, full_v, causal=True, lens=full_lens)
    assert_close(res.out, ref_o, dtype=torch.float64)
    assert_close(res.lse, ref_l, dtype=torch.float64)
    # the prefix K/V is charged once per query head for all requests, not once per request: the cascade reads
    # (b - 1) prefixes less than the unshared decode, up to the second merge's re-read of 2 partials a row
    unshared = flash_decoding(q, full_k, full_v, num_splits=2, cache_seqlens=full_lens, causal=True).counts.reads
    saved = unshared - res.counts.reads
    extra = 2 * b * hq * nq * (d + 1) + b * hq * nq * d + 3 * b * hq * nq * (d + 1)  # merge, q of the prefix rows, splits
    assert (b - 1) * 2 * hq * p * d - extra <= saved <= (b - 1) * 2 * hq * p * d
