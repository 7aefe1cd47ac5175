"""A decoding loop whose KV cache grows by one key per call (Hugging Face's DynamicCache): every call is
right, and the launches are bound once, not once per key count.

The cache is what transformers keeps: a new contiguous (B, Hk, N, d) tensor per step, handed over as a
(B, N, Hk, d) view, so the key count and the batch / head strides change every call.  Oracle:
:func:`tests._oracle.attention_ref`.  The GPU tests also check that the compiled kernel is reused (the
interpreter has none) and that a per-call int past int32 gets its own kernel.
"""

from __future__ import annotations

import pytest
import torch
from tests._oracle import assert_close, attention_ref

import flashtile
from flashtile.ops import kvcache as kvcache_module
from flashtile.runtime import decode as decode_module
from flashtile.runtime import fa2_fwd, fa3_fwd
from flashtile.runtime import launch as launch_module


def _cache(b, hk, n, d, device, seed):
    """A (B, Hk, n, d) contiguous tensor seen as (B, n, Hk, d), as transformers' cache layers hand it over."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, hk, n, d, generator=g).to(device).transpose(1, 2)


def _ref(q, k, v, **kw):
    out, lse = attention_ref(*(x.double().transpose(1, 2) for x in (q, k, v)), **kw)
    return out.transpose(1, 2), lse


@pytest.mark.parametrize("d, bindings", [(16, 1), (24, 2)])
def test_flash_attn_func_growing_cache_binds_once(device, d, bindings):
    """Keys 33..38 (the interpreter's 32-key tiles: EVEN_N stays False).  At d = 16 every K/V stride is a
    multiple of 16: one binding; at d = 24 the head stride N * 24 is one every other step: two (KV_ALIGNED)."""
    dev = device
    b, hq, hk = 1, 4, 2
    q = torch.randn(b, 1, hq, d, generator=torch.Generator().manual_seed(0)).to(dev)
    launch_module._bound.cache_clear()
    for n in range(33, 39):
        k, v = _cache(b, hk, n, d, dev, seed=n), _cache(b, hk, n, d, dev, seed=100 + n)
        out = flashtile.flash_attn_func(q, k, v, causal=True)
        want, _ = _ref(q, k, v, causal=True)
        assert_close(out, want, what=f"N = {n}")
    assert launch_module._bound.cache_info().currsize == bindings


@pytest.mark.parametrize("d, launches", [(16, 1), (24, 2)])
def test_kvcache_growing_cache_checks_and_plans_once(device, monkeypatch, d, launches):
    """Keys 33..40 (three 16-key tiles in the interpreter: one plan): the full checks run once, one decode
    launch serves every step (two at d = 24, whose head stride N * 24 is a multiple of 16 every other
    step: KV_ALIGNED, which rounds the strides down to multiples of 16, must follow it); each step
    matches the oracle over all its keys.  Without cache_seqlens no length tensor is built (FULL_LENGTH:
    the kernel takes the capacity, a per-call int): no ``torch.full`` per step."""
    dev = device
    b, hq, hk = 2, 4, 2
    q = torch.randn(b, 1, hq, d, generator=torch.Generator().manual_seed(1)).to(dev)
    kvcache_module._forget_calls()
    decode_module._decode_launch.cache_clear()
    full_checks = []
    prepare = kvcache_module.prepare_call
    monkeypatch.setattr(kvcache_module, "prepare_call", lambda *a: full_checks.append(1) or prepare(*a))
    fills = []
    real_full = torch.full
    for n in range(33, 41):
        k, v = _cache(b, hk, n, d, dev, seed=n), _cache(b, hk, n, d, dev, seed=200 + n)
        with monkeypatch.context() as m:  # the op's own calls only (the oracle builds tensors too)
            m.setattr(torch, "full", lambda *a, **kw: fills.append(a) or real_full(*a, **kw))
            out = flashtile.flash_attn_with_kvcache(q, k, v, causal=True)
        want, _ = _ref(q, k, v, causal=True)
        assert_close(out, want, what=f"N = {n}")
    assert len(full_checks) == 1
    assert decode_module._decode_launch.cache_info().currsize == launches
    assert fills == []


def test_kvcache_growing_cache_follows_the_plan(monkeypatch):
    """Keys 8..40 in the interpreter (16-key tiles, 8 SMs): the split count follows the tile count (one split
    at one tile, two from two tiles on), and at every step the op launches what :func:`decode_launch` plans for
    that cache (a step that keeps its launch does so only within its plan).  Nothing is launched."""
    b, hq, hk, d = 2, 4, 2, 16
    q = torch.randn(b, 1, hq, d)
    kvcache_module._forget_calls()
    used = []
    monkeypatch.setattr(kvcache_module, "run_decode",
                        lambda q, *a, launch, **kw: used.append(launch) or (torch.zeros_like(q), None, None))
    for n in range(8, 41):
        k, v = _cache(b, hk, n, d, "cpu", seed=n), _cache(b, hk, n, d, "cpu", seed=400 + n)
        flashtile.flash_attn_with_kvcache(q, k, v, causal=True)
        want = decode_module.decode_launch(q, k, v, None, None, left=-1, right=0, softcap=0.0, unified=False,
                                           num_splits=0, full_length=True)[1]
        assert used[-1] is want, n
    assert len({id(x) for x in used}) >= 2


def test_kvcache_growing_cache_rechecks_what_the_length_sets(device):
    """What depends on the capacity follows the cache as it grows on the memoised path: a window that cannot
    bind at 3-5 keys and binds from 6 on, an int ``cache_seqlens`` against the new capacity, and rotary
    tables that must cover it (ValueErrors naming the argument)."""
    dev = device
    b, hq, hk, d = 1, 2, 1, 16
    q = torch.randn(b, 2, hq, d, generator=torch.Generator().manual_seed(2)).to(dev)
    kvcache_module._forget_calls()
    for n in range(3, 9):
        k, v = _cache(b, hk, n, d, dev, seed=n), _cache(b, hk, n, d, dev, seed=300 + n)
        out = flashtile.flash_attn_with_kvcache(q, k, v, causal=True, window_size=(4, 0))
        want, _ = _ref(q, k, v, causal=True, window=(4, 0))
        assert_close(out, want, what=f"window, N = {n}")
    k, v = _cache(b, hk, 9, d, dev, seed=9), _cache(b, hk, 9, d, dev, seed=309)
    out = flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=7, causal=True, window_size=(4, 0))
    want, _ = _ref(q, k[:, :7], v[:, :7], causal=True, window=(4, 0))
    assert_close(out, want, what="cache_seqlens 7 of 9")
    with pytest.raises(ValueError, match="cache_seqlens"):
        flashtile.flash_attn_with_kvcache(q, k[:, :6], v[:, :6], cache_seqlens=7, causal=True, window_size=(4, 0))
    with pytest.raises(ValueError, match="v_cache shape"):  # only k grew: v is never read past its end
        flashtile.flash_attn_with_kvcache(q, _cache(b, hk, 10, d, dev, 0), v, causal=True, window_size=(4, 0))

    cos = torch.ones(6, 4, device=dev)
    new = torch.zeros(b, 1, hk, d, device=dev)
    kw = dict(rotary_cos=cos, rotary_sin=torch.zeros_like(cos), cache_seqlens=0, causal=True)
    flashtile.flash_attn_with_kvcache(q, _cache(b, hk, 6, d, dev, 0), _cache(b, hk, 6, d, dev, 1), new, new, **kw)
    with pytest.raises(ValueError, match="rotary_cos"):
        flashtile.flash_attn_with_kvcache(q, _cache(b, hk, 7, d, dev, 0), _cache(b, hk, 7, d, dev, 1), new, new, **kw)


# --------------------------------------------------------------------------- #
# GPU: the compiled kernels are reused; a per-call int past int32 is keyed
# --------------------------------------------------------------------------- #
def _count_first_calls(monkeypatch) -> list:
    calls = []
    real = launch_module.KernelLauncher._first_call

    def counting(self, dynamic):
        calls.append(1)
        return real(self, dynamic)

    monkeypatch.setattr(launch_module.KernelLauncher, "_first_call", counting)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_growing_cache_reuses_compiled_kernels(monkeypatch, dtype, d):
    """200 steps from 1000 keys, HF layout, Hq 32 / Hk 8: every step matches the oracle, and Triton's own
    launch path runs only for new constexpr variants, not per step.  FA2: one per (tile config, EVEN_N,
    KV_ALIGNED) that the steps' key counts select; ``fwd_config`` switches tiles with the key count (d = 128
    causal: 64 x 64 tiles up to 1024 keys, 64 x 128 above) and EVEN_N holds at multiples of BLOCK_N, so d = 128
    takes 4 variants here and d = 64 two, however many steps run.  Decode: one per plan (a new split count)."""
    b, hq, hk, n0, steps = 2, 32, 8, 1000, 200
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=dtype, generator=g)
    kfull = torch.randn(b, hk, n0 + steps, d, device="cuda", dtype=dtype, generator=g)
    vfull = torch.randn_like(kfull)
    firsts = _count_first_calls(monkeypatch)
    kvcache_module._forget_calls()
    variants = {"flash_attn_func": set(), "flash_attn_with_kvcache": set()}
    for fn in ("flash_attn_func", "flash_attn_with_kvcache"):
        firsts.clear()
        for i in range(steps):
            n = n0 + i
            k = kfull[:, :, :n].contiguous().transpose(1, 2)
            v = vfull[:, :, :n].contiguous().transpose(1, 2)
            out = getattr(flashtile, fn)(q, k, v, causal=True)
            if i % 20 == 0:
                want, _ = _ref(q, k, v, causal=True)
                assert_close(out, want, what=f"{fn} N = {n}")
            if fn == "flash_attn_func":  # the FA2 kernel's constexprs that vary with the key count and strides
                assert not fa3_fwd.prefer_hopper(*(x.transpose(1, 2) for x in (q, k, v)), causal=True,
                                                 window=(-1, 0), plain=True)
                tiles = fa2_fwd.fwd_config(d, dtype, True, 1, n, q.device)
                kv_aligned = decode_module.aligned16(k.stride(0), k.stride(2), v.stride(0), v.stride(2))
                variants[fn].add((tiles, n % tiles[1] == 0, kv_aligned))
            else:
                variants[fn].add(decode_module.decode_plan(b, 1, hq, hk, d, None, n, 0, q.device))
        # at most one Triton launch per variant (a decode plan: its fused launch)
        assert len(firsts) <= len(variants[fn]), (fn, len(firsts), variants[fn])


@pytest.mark.gpu
def test_gpu_per_call_stride_past_int32_gets_its_own_kernel():
    """A cache whose batch stride passes 2^31 elements (a view of an 8 GiB buffer per K and V) between calls
    with ordinary ones: Triton passes that int as i64, so the kept kernel is keyed by the width; all right."""
    b, hq, hk, d, n = 2, 8, 2, 64, 300
    rows = 2**31 // (hk * d) + 64  # batch stride rows * hk * d >= 2^31
    big_k = torch.empty(b, rows, hk, d, device="cuda", dtype=torch.bfloat16)
    big_v = torch.empty_like(big_k)
    g = torch.Generator(device="cuda").manual_seed(0)
    big_k[:, :n].normal_(generator=g)
    big_v[:, :n].normal_(generator=g)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    small_k, small_v = big_k[:, :n].contiguous(), big_v[:, :n].contiguous()
    want, _ = _ref(q, small_k, small_v, causal=True)
    kvcache_module._forget_calls()
    for fn in (flashtile.flash_attn_func, flashtile.flash_attn_with_kvcache):
        for k, v, what in ((small_k, small_v, "i32"), (big_k[:, :n], big_v[:, :n], "i64"), (small_k, small_v, "i32"),
                           (big_k[:, :n], big_v[:, :n], "i64")):
            assert_close(fn(q, k, v, causal=True), want, what=f"{fn.__name__} {what}")
