"""Differential fuzz of the public API against the float64 oracle (tests/_oracle.py).

Hypothesis draws shapes (batch, GQA ratios, Nq != Nk, head dims up to 256 and
not powers of two), dtypes, every mask and score modifier, memory layouts
(transposed and strided views whose storage outside the view is NaN), and
fresh random inputs per example (a drawn seed); forward and backward of
``flash_attn_func`` and ``scaled_dot_product_attention``, and
``flash_attn_with_kvcache`` (append, contiguous and paged caches whose unused
slots and pages are NaN, 1-4 splits, FlashDecoding++'s unified max).  Every comparison uses the table of tests/_oracle.py.

Sized for CI through Triton's interpreter (small N, ~1-2 minutes on 2 cores);
the ``ci`` hypothesis profile of tests/conftest.py replays the same examples
every run.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashtile
from flashtile import BlockMask
from flashtile.runtime.common import dropout_keep_mask
from flashtile.ops import next_philox_state
from tests._oracle import assert_close, attention_ref, attention_ref_grads, rounding_slack, score_slack

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [1, 8, 16, 24, 40, 64, 72, 100, 128, 160, 256]
LAYOUTS = ["contiguous", "transposed", "strided"]


def fuzz(examples: int) -> settings:
    """The active profile's settings (``ci``: derandomized) with ``examples`` examples and no deadline."""
    return settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def tensor(shape, dtype, layout, g, *, seq_dim=1, head_dim=2):
    """Random ``shape`` tensor on DEVICE viewed in ``layout``; storage the view does not cover holds NaN.

    transposed: the sequence and head dims are swapped in memory; strided: every other sequence row
    of a buffer with one spare head and 3 spare columns.  Built on DEVICE (``.to`` of a view with gaps
    would copy it contiguous).  The result is a leaf (autograd-ready).
    """
    values = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    if layout == "contiguous":
        return values
    if layout == "transposed":
        return values.transpose(seq_dim, head_dim).contiguous().transpose(seq_dim, head_dim)
    big = list(shape)
    big[seq_dim] *= 2
    big[head_dim] += 1
    big[-1] += 3
    buf = torch.full(big, math.nan, dtype=dtype, device=DEVICE)
    idx = [slice(None)] * len(shape)
    idx[seq_dim] = slice(None, None, 2)
    idx[head_dim] = slice(0, shape[head_dim])
    idx[-1] = slice(0, shape[-1])
    x = buf[tuple(idx)]
    x.copy_(values)
    return x.detach()


def f64_bhnd(x: torch.Tensor) -> torch.Tensor:
    """(B, N, H, d) in any dtype -> float64 (B, H, N, d) on the CPU."""
    return x.detach().to("cpu", torch.float64).transpose(1, 2)


def grad_magnitude(*grads: torch.Tensor) -> float:
    """The largest entry of the three gradients: dq and dk cancel to ~0 (one visible key) but keep rounding of that size."""
    return max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)


# --------------------------------------------------------------------------- #
# flash_attn_func
# --------------------------------------------------------------------------- #
@st.composite
def flash_cases(draw):
    hk = draw(st.integers(1, 2))
    causal = draw(st.booleans())
    c = dict(
        b=draw(st.integers(1, 2)), hk=hk, hq=hk * draw(st.sampled_from([1, 2, 3])),
        nq=draw(st.integers(1, 40)), nk=draw(st.integers(1, 40)), d=draw(st.sampled_from(HEAD_DIMS)),
        dtype=draw(st.sampled_from(DTYPES)), layout=draw(st.sampled_from(LAYOUTS)),
        causal=causal, window=(draw(st.sampled_from([-1, 0, 3, 17])), 0 if causal else draw(st.sampled_from([-1, 0, 5]))),
        softcap=draw(st.sampled_from([0.0, 0.0, 2.0, 30.0])), scale=draw(st.sampled_from([None, 0.5, 1.7])),
        alibi=draw(st.sampled_from([None, "h", "bh"])), dropout=draw(st.sampled_from([0.0, 0.0, 0.25])),
        block=draw(st.sampled_from([None, (16, 16), (16, 32), (32, 16)])), lead=draw(st.sampled_from([(), "h", "b"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    return c


@fuzz(150)
@given(flash_cases())
def test_flash_attn_func(c):
    g = torch.Generator().manual_seed(c["seed"])
    b, hq, hk, nq, nk, d, dtype = c["b"], c["hq"], c["hk"], c["nq"], c["nk"], c["d"], c["dtype"]
    q = tensor((b, nq, hq, d), dtype, c["layout"], g).requires_grad_()
    k = tensor((b, nk, hk, d), dtype, c["layout"], g).requires_grad_()
    v = tensor((b, nk, hk, d), dtype, c["layout"], g).requires_grad_()
    alibi = None
    if c["alibi"]:
        alibi = torch.rand((hq,) if c["alibi"] == "h" else (b, hq), generator=g).to(DEVICE)
    block_mask = None
    if c["block"]:
        br, bc = c["block"]
        lead = {(): (), "h": (1, hq), "b": (b, 1)}[c["lead"]]
        grid = torch.rand(*lead, -(-nq // br), -(-nk // bc), generator=g) < 0.7
        block_mask = BlockMask(grid.to(DEVICE), (br, bc))
    keep = None
    if c["dropout"]:
        seed, offset = next_philox_state(DEVICE)
        keep = dropout_keep_mask(seed, offset, b, hq, nq, nk, c["dropout"], DEVICE).cpu()

    out, lse = flash_attn_func_call(q, k, v, c, alibi, block_mask)
    dout = torch.randn(out.shape, generator=g).to(dtype).to(DEVICE)
    out.backward(dout)

    inputs = (f64_bhnd(q), f64_bhnd(k), f64_bhnd(v), f64_bhnd(dout))
    mods = dict(
        scale=c["scale"], causal=c["causal"], window=c["window"], softcap=c["softcap"],
        alibi=None if alibi is None else alibi.cpu(), keep=keep, dropout_p=c["dropout"],
        block_mask=None if block_mask is None else (block_mask.mask.cpu(), block_mask.block_size),
    )
    ref_out, ref_lse, dq, dk, dv = attention_ref_grads(*inputs, **mods)
    slack = rounding_slack(*inputs, dtype, **mods)
    assert out.dtype == dtype and out.shape == (b, nq, hq, d) and torch.isfinite(out).all()
    assert_close(out.transpose(1, 2), ref_out, dtype, DEVICE, "out")
    assert_close(lse, ref_lse, dtype, DEVICE, "lse", slack=score_slack(inputs[0], inputs[1], dtype, DEVICE, c["scale"]))
    size = grad_magnitude(dq, dk, dv)
    for name, x, want, extra in zip(("dq", "dk", "dv"), (q, k, v), (dq, dk, dv), slack):
        assert x.grad.dtype == dtype and torch.isfinite(x.grad).all(), f"{name} is not finite"
        assert_close(x.grad.transpose(1, 2), want, dtype, DEVICE, name, magnitude=size, slack=extra)


def flash_attn_func_call(q, k, v, c, alibi, block_mask):
    return flashtile.flash_attn_func(
        q, k, v, dropout_p=c["dropout"], softmax_scale=c["scale"], causal=c["causal"], window_size=c["window"],
        softcap=c["softcap"], alibi_slopes=alibi, return_lse=True, block_mask=block_mask,
    )


# --------------------------------------------------------------------------- #
# scaled_dot_product_attention
# --------------------------------------------------------------------------- #
@st.composite
def sdpa_cases(draw):
    hk = draw(st.integers(1, 2))
    return dict(
        b=draw(st.integers(1, 2)), hk=hk, hq=hk * draw(st.sampled_from([1, 2, 4])),
        nq=draw(st.integers(1, 40)), nk=draw(st.integers(1, 40)), d=draw(st.sampled_from(HEAD_DIMS)),
        dtype=draw(st.sampled_from(DTYPES)), layout=draw(st.sampled_from(LAYOUTS)),
        mask=draw(st.sampled_from([None, "bool", "additive", "is_causal"])),
        mask_shape=draw(st.sampled_from(["nn", "11nn", "b1nn", "1hnn", "bhnn"])),
        scale=draw(st.sampled_from([None, 0.3, 1.2])), seed=draw(st.integers(0, 2**31 - 1)),
    )


@fuzz(80)
@given(sdpa_cases())
def test_scaled_dot_product_attention(c):
    g = torch.Generator().manual_seed(c["seed"])
    b, hq, hk, nq, nk, d, dtype = c["b"], c["hq"], c["hk"], c["nq"], c["nk"], c["d"], c["dtype"]
    # (B, H, N, d): the sequence is dim 2, heads dim 1
    q = tensor((b, hq, nq, d), dtype, c["layout"], g, seq_dim=2, head_dim=1).requires_grad_()
    k = tensor((b, hk, nk, d), dtype, c["layout"], g, seq_dim=2, head_dim=1).requires_grad_()
    v = tensor((b, hk, nk, d), dtype, c["layout"], g, seq_dim=2, head_dim=1).requires_grad_()
    shape = {"nn": (nq, nk), "11nn": (1, 1, nq, nk), "b1nn": (b, 1, nq, nk), "1hnn": (1, hq, nq, nk), "bhnn": (b, hq, nq, nk)}
    attn_mask, bias = None, None
    if c["mask"] == "bool":
        attn_mask = torch.rand(shape[c["mask_shape"]], generator=g) < 0.75
    elif c["mask"] == "additive":
        m = torch.randn(shape[c["mask_shape"]], generator=g)
        attn_mask = torch.where(torch.rand(m.shape, generator=g) < 0.85, m, -math.inf).to(dtype)
    elif c["mask"] == "is_causal":
        bias = torch.ones(nq, nk, dtype=torch.bool).tril()  # torch's is_causal is top-left aligned
    if attn_mask is not None:
        bias = attn_mask
        attn_mask = attn_mask.to(DEVICE)

    out = flashtile.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=c["mask"] == "is_causal", scale=c["scale"], enable_gqa=hq != hk
    )
    dout = torch.randn(out.shape, generator=g).to(dtype).to(DEVICE)
    out.backward(dout)

    f64 = [x.detach().to("cpu", torch.float64) for x in (q, k, v, dout)]
    ref_out, _, dq, dk, dv = attention_ref_grads(*f64, scale=c["scale"], bias=bias)
    slack = rounding_slack(*f64, dtype, scale=c["scale"], bias=bias)
    assert out.dtype == dtype and out.shape == (b, hq, nq, d) and torch.isfinite(out).all()
    assert_close(out, ref_out, dtype, DEVICE, "out")
    size = grad_magnitude(dq, dk, dv)
    for name, x, want, extra in zip(("dq", "dk", "dv"), (q, k, v), (dq, dk, dv), slack):
        assert torch.isfinite(x.grad).all(), f"{name} is not finite"
        assert_close(x.grad, want, dtype, DEVICE, name, magnitude=size, slack=extra)


# --------------------------------------------------------------------------- #
# flash_attn_with_kvcache
# --------------------------------------------------------------------------- #
# the keyword that asks for the LSE (flash-attn 2.x spells it return_softmax_lse)
_KVCACHE_PARAMS = inspect.signature(flashtile.flash_attn_with_kvcache).parameters
LSE_KW = "return_softmax_lse" if "return_softmax_lse" in _KVCACHE_PARAMS else "return_lse"


@st.composite
def kvcache_cases(draw):
    hk = draw(st.integers(1, 2))
    paged = draw(st.booleans())
    page = draw(st.sampled_from([16, 32]))
    pages = draw(st.integers(1, 3))
    capacity = pages * page if paged else draw(st.integers(1, 48))
    n_new = draw(st.integers(0, min(3, capacity)))
    b = draw(st.integers(1, 3))
    causal = draw(st.booleans())
    return dict(
        b=b, hk=hk, hq=hk * draw(st.sampled_from([1, 2, 4])), nq=draw(st.integers(1, 4)), n_new=n_new,
        d=draw(st.sampled_from([8, 16, 40, 64, 100, 128])), dtype=draw(st.sampled_from(DTYPES)),
        paged=paged, page=page, pages=pages, capacity=capacity, spare=draw(st.integers(0, 2)),
        lens=draw(st.lists(st.integers(0, capacity - n_new), min_size=b, max_size=b)),
        splits=draw(st.integers(1, 4)), causal=causal,
        window=(draw(st.sampled_from([-1, 0, 3, 9])), 0 if causal else draw(st.sampled_from([-1, 0, 2]))),
        softcap=draw(st.sampled_from([0.0, 0.0, 3.0])), scale=draw(st.sampled_from([None, 0.4])),
        alibi=draw(st.sampled_from([None, "h", "bh"])), q_layout=draw(st.sampled_from(["contiguous", "transposed"])),
        unified_max=draw(st.sampled_from([None, None, 0.0, 4.0])), seed=draw(st.integers(0, 2**31 - 1)),
    )


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy reports unified_max's overflow
@fuzz(150)
@given(kvcache_cases())
def test_flash_attn_with_kvcache(c):
    g = torch.Generator().manual_seed(c["seed"])
    b, hq, hk, nq, n_new, d, dtype, cap = c["b"], c["hq"], c["hk"], c["nq"], c["n_new"], c["d"], c["dtype"], c["capacity"]
    lens = torch.tensor(c["lens"], dtype=torch.int32)
    end = lens.long() + n_new  # each element's length after the append

    # the logical cache (B, capacity, Hk, d): slots at or past the new length are NaN, never read
    logical_k = torch.randn(b, cap, hk, d, generator=g).to(dtype)
    logical_v = torch.randn(b, cap, hk, d, generator=g).to(dtype)
    unused = torch.arange(cap).view(1, cap) >= end.view(b, 1)
    logical_k[unused], logical_v[unused] = math.nan, math.nan
    k_new = torch.randn(b, n_new, hk, d, generator=g).to(dtype)
    v_new = torch.randn(b, n_new, hk, d, generator=g).to(dtype)
    expect_k, expect_v = logical_k.clone(), logical_v.clone()
    for i, length in enumerate(c["lens"]):
        expect_k[i, length : length + n_new], expect_v[i, length : length + n_new] = k_new[i], v_new[i]

    block_table = None
    if c["paged"]:
        page, pages = c["page"], c["pages"]
        total = b * pages + c["spare"]
        table = torch.randperm(total, generator=g)[: b * pages].view(b, pages)
        k_cache = torch.full((total, page, hk, d), math.nan, dtype=dtype)  # pages outside the table stay NaN
        v_cache = torch.full((total, page, hk, d), math.nan, dtype=dtype)
        k_cache[table] = logical_k.view(b, pages, page, hk, d)
        v_cache[table] = logical_v.view(b, pages, page, hk, d)
        block_table = table.to(torch.int32).to(DEVICE)
        k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    else:
        k_cache, v_cache = logical_k.to(DEVICE), logical_v.to(DEVICE)
    q = tensor((b, nq, hq, d), dtype, c["q_layout"], g)
    alibi = None
    if c["alibi"]:
        alibi = torch.rand((hq,) if c["alibi"] == "h" else (b, hq), generator=g).to(DEVICE)
    seqlens = lens.to(DEVICE)

    out, lse = flashtile.flash_attn_with_kvcache(
        q, k_cache, v_cache, k=k_new.to(DEVICE) if n_new else None, v=v_new.to(DEVICE) if n_new else None,
        cache_seqlens=seqlens, block_table=block_table, softmax_scale=c["scale"], causal=c["causal"],
        window_size=c["window"], softcap=c["softcap"], alibi_slopes=alibi, num_splits=c["splits"],
        unified_max=c["unified_max"], **{LSE_KW: True},
    )

    got_k, got_v = k_cache.cpu(), v_cache.cpu()
    if c["paged"]:
        got_k, got_v = got_k[table].reshape(b, cap, hk, d), got_v[table].reshape(b, cap, hk, d)
        spare = torch.ones(k_cache.shape[0], dtype=torch.bool)
        spare[table.flatten()] = False
        assert k_cache[spare.to(DEVICE)].isnan().all() and v_cache[spare.to(DEVICE)].isnan().all(), "a spare page was written"
    for name, got, want in (("k_cache", got_k, expect_k), ("v_cache", got_v, expect_v)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{name} after the append: {m}")
    assert torch.equal(seqlens.cpu(), lens), "cache_seqlens must not be advanced"

    ref_out, ref_lse = attention_ref(
        f64_bhnd(q), f64_bhnd(expect_k.nan_to_num(0.0)), f64_bhnd(expect_v.nan_to_num(0.0)), lens=end,
        scale=c["scale"], causal=c["causal"], window=c["window"], softcap=c["softcap"],
        alibi=None if alibi is None else alibi.cpu(),
    )
    assert out.dtype == dtype and out.shape == (b, nq, hq, d) and torch.isfinite(out).all()
    assert_close(out.transpose(1, 2), ref_out, dtype, DEVICE, "out")
    slack = score_slack(f64_bhnd(q), f64_bhnd(expect_k.nan_to_num(0.0)), dtype, DEVICE, c["scale"])
    assert_close(lse, ref_lse, dtype, DEVICE, "lse", slack=slack)
