"""An FP8 (float8_e4m3fn) KV cache together with ``flash_attn_with_kvcache``'s optional inputs: fused
rotary (the rotated key is quantised on the append), multi-token and ragged queries, ``cache_batch_idx``
and ``cache_leftpad``; and the launches' per-call alignment checks with unaligned caller tensors.

Oracle: :func:`flashtile.reference.decoding.kvcache_step` with ``descales`` (float64 twin of the whole
step: new rows rotated, then quantised by :func:`~flashtile.reference.decoding.quantize_cache_rows`,
attention over the dequantised cache), at bf16's tolerance.
"""

from __future__ import annotations

import pytest
import torch
from tests._oracle import assert_close

from flashtile import flash_attn_with_kvcache, quantize_per_head
from flashtile.ops.kvcache import check_errors
from flashtile.reference.decoding import kvcache_step

FP8 = torch.float8_e4m3fn


def rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def tables(seqlen_ro, half, seed):
    angle = torch.rand(seqlen_ro, half, generator=torch.Generator().manual_seed(seed)) * 6.3
    return torch.cos(angle), torch.sin(angle)


def ints(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def assert_within_one_e4m3_step(got8: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Stored e4m3 values equal the twin's, or (a fp32 rotation a rounding away from a tie) its neighbour:
    |got - want| <= 2^-3 |want| + 2^-9 (e4m3's spacing, subnormals included)."""
    got = got8.double().cpu()
    gap = (got - want).abs()
    assert bool((gap <= want.abs() * 2.0**-3 + 2.0**-9).all()), f"{what}: max gap {gap.max().item()}"
    assert (gap > 0).float().mean().item() < 0.01, f"{what}: most values must equal the twin's exactly"


@pytest.mark.parametrize("interleaved", [True, False])
def test_fp8_cache_rotary_multi_token(device, interleaved):
    """GQA 4/2, 3 query tokens and 3 new rows (causal: token t rotated at cache_seqlens + t), partial
    rotary (rotary_dim 12 of 32), 2 splits, bf16 q: the appended keys are rotated then quantised with
    element b's k_descale (the bytes the twin stores), and out / lse match the twin."""
    b, n, hq, hk, d, nq = 2, 48, 4, 2, 32, 3
    k8, kd = quantize_per_head(rand(b, n, hk, d, seed=1, scale=2.0), layout="bnhd")
    v8, vd = quantize_per_head(rand(b, n, hk, d, seed=2), layout="bnhd")
    k8, v8, kd, vd = (x.to(device) for x in (k8, v8, kd, vd))
    k = rand(b, nq, hk, d, seed=3, scale=2.0).to(device, torch.bfloat16)
    v = rand(b, nq, hk, d, seed=4).to(device, torch.bfloat16)
    q = rand(b, nq, hq, d, seed=5).to(device, torch.bfloat16)
    cos, sin = tables(n, 6, seed=6)
    lens = [7, 40]
    ref_out, ref_lse, ref_k, ref_v = kvcache_step(
        q.cpu(), k8.cpu(), v8.cpu(), k.cpu(), v.cpu(), lens, rotary=(cos, sin, interleaved), causal=True,
        descales=(kd.cpu(), vd.cpu()),
    )
    out, lse = flash_attn_with_kvcache(
        q, k8, v8, k, v, cos.to(device), sin.to(device), ints(lens, device), causal=True,
        rotary_interleaved=interleaved, num_splits=2, return_lse=True, k_descale=kd, v_descale=vd,
    )
    assert k8.dtype == FP8 and out.dtype == torch.bfloat16
    assert_within_one_e4m3_step(k8, ref_k, "rotated, quantised keys")
    assert torch.equal(v8.double().cpu(), ref_v), "v quantised as the twin (no rotation)"
    assert_close(out, ref_out, torch.bfloat16, device, "out")
    assert_close(lse, ref_lse, torch.bfloat16, device, "lse")
    check_errors()


def test_fp8_cache_batch_idx_leftpad_ragged_rotary(device):
    """FP8 cache of 4 rows picked by cache_batch_idx (descales indexed by q's element, FA3's), left
    padding, ragged queries (2, 0 and 3 tokens), NeoX rotary, not causal (every token at
    cache_seqlens), 3 splits; the rows no element uses keep their bytes."""
    b, n, hq, hk, d, n_new = 3, 48, 2, 1, 16, 2
    k8, _ = quantize_per_head(rand(4, n, hk, d, seed=11), layout="bnhd")
    v8, _ = quantize_per_head(rand(4, n, hk, d, seed=12), layout="bnhd")
    kd = (torch.rand(b, hk, generator=torch.Generator().manual_seed(13)) * 0.02 + 0.005).to(device)
    vd = (torch.rand(b, hk, generator=torch.Generator().manual_seed(14)) * 0.02 + 0.005).to(device)
    k8, v8 = k8.to(device), v8.to(device)
    before = k8.clone(), v8.clone()
    k = rand(b, n_new, hk, d, seed=15).to(device, torch.bfloat16)
    v = rand(b, n_new, hk, d, seed=16).to(device, torch.bfloat16)
    cu = [0, 2, 2, 5]
    q = rand(cu[-1], hq, d, seed=17).to(device, torch.bfloat16)
    cos, sin = tables(n, 4, seed=18)
    lens, rows, pads = [20, 5, 33], [3, 0, 2], [6, 0, 30]
    ref_out, ref_lse, ref_k, ref_v = kvcache_step(
        q.cpu(), k8.cpu(), v8.cpu(), k.cpu(), v.cpu(), lens, rotary=(cos, sin, False), cache_batch_idx=rows,
        cache_leftpad=pads, cu_seqlens_q=cu, descales=(kd.cpu(), vd.cpu()),
    )
    out, lse = flash_attn_with_kvcache(
        q, k8, v8, k, v, cos.to(device), sin.to(device), ints(lens, device), cache_batch_idx=ints(rows, device),
        cache_leftpad=ints(pads, device), rotary_interleaved=False, num_splits=3, return_lse=True,
        cu_seqlens_q=ints(cu, device), max_seqlen_q=3, k_descale=kd, v_descale=vd,
    )
    assert out.shape == (cu[-1], hq, d) and lse.shape == (hq, cu[-1])
    assert_within_one_e4m3_step(k8, ref_k, "rotated, quantised keys")
    assert torch.equal(v8.double().cpu(), ref_v)
    assert torch.equal(k8[1].view(torch.uint8), before[0][1].view(torch.uint8)), "an unused row keeps its bytes"
    assert torch.equal(v8[1].view(torch.uint8), before[1][1].view(torch.uint8))
    assert_close(out, ref_out, torch.bfloat16, device, "out")
    assert_close(lse, ref_lse, torch.bfloat16, device, "lse")
    check_errors()


def test_unaligned_caller_tensors_in_every_slot(device):
    """Caller tensors 4 bytes past an aligned allocation (cache_seqlens, cache_batch_idx, cache_leftpad,
    the descales) are keyed per call, whichever optional inputs are in use: a plain append with such a
    cache_seqlens view, then an FP8 call with all of them, each equal to the call on aligned copies."""
    b, n, hq, hk, d = 2, 32, 2, 1, 16

    def view(values, dtype=torch.int32):  # (len,) starting one element into its allocation
        return torch.tensor([0, *values], dtype=dtype, device=device)[1:]

    kc, vc = rand(b, n, hk, d, seed=21).to(device), rand(b, n, hk, d, seed=22).to(device)
    k, v, q = rand(b, 1, hk, d, seed=23).to(device), rand(b, 1, hk, d, seed=24).to(device), rand(b, 1, hq, d, seed=25).to(device)
    lens = view([4, 9])
    assert lens.data_ptr() % 16
    kc2, vc2 = kc.clone(), vc.clone()
    got = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)
    want = flash_attn_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=lens.clone(), causal=True)
    assert torch.equal(got, want) and torch.equal(kc, kc2)

    k8, _ = quantize_per_head(rand(3, n, hk, d, seed=26), layout="bnhd")
    v8, _ = quantize_per_head(rand(3, n, hk, d, seed=27), layout="bnhd")
    k8, v8 = k8.to(device), v8.to(device)
    kd = torch.tensor([0.0, 0.01, 0.02], device=device)[1:].view(b, hk)
    vd = torch.tensor([0.0, 0.03, 0.01], device=device)[1:].view(b, hk)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    kw = dict(cache_seqlens=view([4, 9]), cache_batch_idx=view([2, 0]), cache_leftpad=view([1, 3]), causal=True)
    k8b, v8b = k8.clone(), v8.clone()
    got = flash_attn_with_kvcache(qb, k8, v8, kb, vb, k_descale=kd, v_descale=vd, **kw)
    aligned = {name: x.clone() for name, x in kw.items() if isinstance(x, torch.Tensor)}
    want = flash_attn_with_kvcache(qb, k8b, v8b, kb, vb, k_descale=kd.clone(), v_descale=vd.clone(), causal=True, **aligned)
    assert torch.equal(got, want)
    assert torch.equal(k8.view(torch.uint8), k8b.view(torch.uint8))
    check_errors()


def test_error_bits_are_distinct_and_each_is_reported(monkeypatch):
    """The device error word's bits (decode lengths, block table, cache_batch_idx, cu_seqlens_q, and the FP8
    forward's descales) are distinct powers of two, and check_errors names each one, alone and together."""
    from flashtile.kernels.fa3_fwd import ERR_DESCALE
    from flashtile.ops import kvcache
    from flashtile.runtime.decode import ERR_BATCH_IDX, ERR_BLOCK_TABLE, ERR_CU_SEQLENS_Q, ERR_SEQLENS

    named = {ERR_SEQLENS: "cache_seqlens out of range", ERR_BLOCK_TABLE: "block_table entry out of range",
             ERR_BATCH_IDX: "cache_batch_idx entry out of range", ERR_CU_SEQLENS_Q: "cu_seqlens_q out of range",
             ERR_DESCALE: "FP8 descales out of range"}
    assert len(named) == 5 and all(bit > 0 and bit & (bit - 1) == 0 for bit in named)
    word = 0
    for bit, name in named.items():
        word |= bit
        monkeypatch.setattr(kvcache, "take_errors", lambda bit=bit: [(torch.device("cpu"), bit)])
        with pytest.raises(ValueError) as err:
            kvcache.check_errors()
        assert name in str(err.value) and all(other not in str(err.value) for other in named.values() if other != name)
    monkeypatch.setattr(kvcache, "take_errors", lambda: [(torch.device("cpu"), word)])
    with pytest.raises(ValueError) as err:
        kvcache.check_errors()
    assert all(name in str(err.value) for name in named.values())


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_fp8_cache_rotary_gqa8_sixteen_tokens(paged):
    """FP8 cache on the GPU with rotary (NeoX, rotary_dim 64 of 128) and Hq 64 / Hk 8 x 16 query tokens:
    128 packed rows in one tile on 8 warps, causal, 4k keys (256-key pages when paged), the heuristic's
    splits; the appended keys are the twin's rotated, quantised bytes (to one e4m3 step) and out / lse
    match the twin at bf16's tolerance."""
    dev, dt = "cuda", torch.bfloat16
    b, n, hq, hk, d, nq, page = 2, 4096, 64, 8, 128, 16, 256
    k8, kd = quantize_per_head(rand(b, n, hk, d, seed=31, scale=2.0), layout="bnhd")
    v8, vd = quantize_per_head(rand(b, n, hk, d, seed=32), layout="bnhd")
    k = rand(b, nq, hk, d, seed=33, scale=2.0).to(dev, dt)
    v = rand(b, nq, hk, d, seed=34).to(dev, dt)
    q = rand(b, nq, hq, d, seed=35).to(dev, dt)
    cos, sin = tables(n, 32, seed=36)
    lens = [n // 4, n - nq]
    ref_out, ref_lse, ref_k, _ = kvcache_step(q.cpu(), k8, v8, k.cpu(), v.cpu(), lens, rotary=(cos, sin, False),
                                              causal=True, descales=(kd, vd))
    kw = dict(causal=True, rotary_interleaved=False, return_lse=True, k_descale=kd.to(dev), v_descale=vd.to(dev))
    if paged:  # pages of element b in reverse order
        table = torch.arange(b * (n // page), dtype=torch.int32).view(b, -1).flip(1).contiguous()
        k_pool, v_pool = (x.reshape(b * (n // page), page, hk, d)[table.view(-1).argsort()].to(dev) for x in (k8, v8))
        out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cos.to(dev), sin.to(dev), ints(lens, dev),
                                           block_table=table.to(dev), **kw)
        k_after = k_pool.cpu()[table.view(-1).long()].view(b, n, hk, d)
    else:
        k_after = k8.to(dev)
        out, lse = flash_attn_with_kvcache(q, k_after, v8.to(dev), k, v, cos.to(dev), sin.to(dev), ints(lens, dev), **kw)
    assert_within_one_e4m3_step(k_after, ref_k, "rotated, quantised keys")
    assert_close(out, ref_out, dt, dev, "out")
    assert_close(lse, ref_lse, dt, dev, "lse")
    check_errors()
