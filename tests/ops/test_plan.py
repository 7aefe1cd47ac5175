"""flashtile.ops.plan: per-signature plans of the plain forward and backward, against the oracle and the
generic path (bitwise: the same kernels with the same arguments)."""

from __future__ import annotations

import math

import pytest
import torch
from tests._oracle import assert_close, attention_ref, grads_ref

from flashtile.ops import flash_attn_func, plan
from flashtile.ops.sdpa import scaled_dot_product_attention
from flashtile.runtime import fa3_fwd, fa3_gluon_bwd


def _generic(monkeypatch):
    """Patch a dispatch hook with an equivalent wrapper: every call then takes the generic path."""
    own_fwd, own_bwd = fa3_fwd.prefer_hopper, fa3_gluon_bwd.prefer_gluon_bwd
    monkeypatch.setattr(fa3_fwd, "prefer_hopper", lambda *a, **kw: own_fwd(*a, **kw))
    monkeypatch.setattr(fa3_gluon_bwd, "prefer_gluon_bwd", lambda *a, **kw: own_bwd(*a, **kw))


def _inputs(b, nq, nk, hq, hk, d, dtype, device, seed, layout="bnhd"):
    gen = torch.Generator().manual_seed(seed)

    def make(n, h):
        x = torch.randn(b, n, h, d, generator=gen, dtype=torch.float64)
        if layout == "bhnd":  # (B, H, N, d) storage seen as (B, N, H, d): other strides, same signature shape
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        return x.to(device=device, dtype=dtype)

    return make(nq, hq), make(nk, hk), make(nk, hk)


def _oracle(q, k, v, **kw):
    q64, k64, v64 = (x.detach().cpu().double().transpose(1, 2).requires_grad_() for x in (q, k, v))
    return attention_ref(q64, k64, v64, **kw), (q64, k64, v64)


CASES = [  # (causal, window, Hq, Hk, Nq, Nk, d, layout)
    (False, (-1, -1), 2, 2, 40, 56, 64, "bnhd"),
    (True, (-1, 0), 4, 2, 56, 40, 48, "bnhd"),
    (False, (8, 4), 2, 1, 33, 40, 40, "bhnd"),
    (True, (10, 0), 2, 2, 40, 40, 24, "bhnd"),
]


@pytest.mark.parametrize("case", CASES)
def test_planned_forward_matches_oracle_and_generic_path(case, device, monkeypatch):
    causal, window, hq, hk, nq, nk, d, layout = case
    dtype = torch.float32
    q, k, v = _inputs(2, nq, nk, hq, hk, d, dtype, device, 3, layout)
    kw = dict(causal=causal, window_size=window, return_lse=True)
    first = flash_attn_func(q, k, v, **kw)
    assert len(plan._FWD) == 1 and isinstance(next(iter(plan._FWD.values())), plan.ForwardPlan)
    again = flash_attn_func(q, k, v, **kw)  # the plan, found
    (ref, ref_lse), _ = _oracle(q, k, v, causal=causal, window=window)
    for out, lse in (first, again):
        assert out.shape == q.shape and out.stride() == q.new_empty(q.shape).stride() and out.dtype == dtype
        assert_close(out.transpose(1, 2), ref, dtype, device, "out")
        assert_close(lse, ref_lse, torch.float32, device, "lse")
    plan.clear()
    _generic(monkeypatch)
    out, lse = flash_attn_func(q, k, v, **kw)
    assert not plan._FWD  # a patched hook: no plan made
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


@pytest.mark.parametrize("case", CASES)
def test_planned_backward_matches_oracle_and_generic_path(case, device, monkeypatch):
    """The FA2 backward's plan (the interpreter's and any GPU's signatures without the Gluon backward): gradients
    against the oracle on the first (planning) and a later call, and bitwise against the generic path."""
    causal, window, hq, hk, nq, nk, d, layout = case
    dtype = torch.float32
    q, k, v = _inputs(2, nq, nk, hq, hk, d, dtype, device, 11, layout)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(12), dtype=torch.float64).to(device, dtype)

    def step():
        qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
        out = flash_attn_func(qs, ks, vs, causal=causal, window_size=window)
        return torch.autograd.grad(out, (qs, ks, vs), do)

    planned = [step() for _ in range(2)]
    assert [type(p).__name__ for p in plan._BWD.values()] == ["BackwardPlan"]
    (ref, _), leaves = _oracle(q, k, v, causal=causal, window=window)
    want = grads_ref(ref, leaves, do.cpu().double().transpose(1, 2))
    size = max(float(g.abs().max()) for g in want)
    for got in planned:
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert g.shape == w.transpose(1, 2).shape and g.is_contiguous()
            assert_close(g.transpose(1, 2), w, dtype, device, name, magnitude=size)
    plan.clear()
    _generic(monkeypatch)
    generic = step()
    assert not plan._BWD
    for name, g, p in zip(("dq", "dk", "dv"), generic, planned[1]):
        assert torch.equal(g, p), name


def test_plain_backward_both_dq_paths_bitwise(device, monkeypatch):
    """``fa2_bwd.plain_backward``'s run makes ``fa2_backward``'s launches: with atomic dQ (the interpreter's
    config) and with the separate dQ kernel, bitwise equal to the generic function's gradients."""
    from flashtile.runtime import fa2_bwd
    from flashtile.runtime.fa2_fwd import fa2_forward

    q, k, v = (x.transpose(1, 2) for x in _inputs(2, 40, 56, 4, 2, 32, torch.float32, device, 13))
    out, lse = fa2_forward(q, k, v, softmax_scale=0.3, causal=True)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(14)).to(device)
    own = fa2_bwd.bwd_config
    for atomic in (True, False):
        monkeypatch.setattr(fa2_bwd, "bwd_config", lambda *a: own(*a)._replace(atomic_dq=atomic))
        want = fa2_bwd.fa2_backward(do, q, k, v, out, lse, softmax_scale=0.3, causal=True)
        grads = [torch.empty_like(x) for x in (q, k, v)]
        run = fa2_bwd.plain_backward(do, q, k, v, out, lse, *grads, True, -1, 0)
        run(do, q, k, v, out, lse, *grads, 0.3)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want):
            assert torch.equal(g, w), (atomic, name)


def test_every_dispatch_switch_is_part_of_the_key(monkeypatch):
    """A plan decided under one value of a module switch or threshold is not reused under another: each is in
    ``plan._switches()``, which every plan key holds."""
    from flashtile.runtime import common, fa3_bwd, fa3_gluon

    switches = [(fa3_fwd, n) for n in ("ENABLED", "GLUON", "GLUON_FP8")] + [(fa3_gluon, n) for n in (
        "BIND_LAUNCH", "HOST_DESC_MIN_WORK", "DYNAMIC_MIN_KEYS", "FP8_DYNAMIC_MIN_KEYS", "NARROW_TWO_WG_KEYS",
        "NARROW_PERSISTENT_MAX_KEYS")] + [(fa3_gluon_bwd, "ENABLED"), (fa3_gluon_bwd, "BIND_LAUNCH"),
                                         (fa3_bwd, "ENABLED"), (common, "HOPPER_TRITON")]
    base = plan._switches()
    for module, name in switches:
        with monkeypatch.context() as m:
            m.setattr(module, name, object())
            assert plan._switches() != base, f"{module.__name__}.{name}"


def test_sdpa_layout_plan(device):
    """The SDPA drop-in (B, H, N, d) layout: a plan of its own, out a (B, H, N, d) view of (B, N, H, d) storage."""
    q, k, v = (x.transpose(1, 2) for x in _inputs(1, 40, 40, 2, 2, 32, torch.float32, device, 4))
    outs = [scaled_dot_product_attention(q, k, v, is_causal=True) for _ in range(2)]
    (ref, _), _ = _oracle(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    assert len(plan._FWD) == 1
    for out in outs:
        assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()
        assert_close(out, ref, torch.float32, device, "out")


def test_signature_changes_plan_again_and_scale_checked_per_call(device):
    """A new layout, window or dtype is a new signature; a scale <= 0 takes the generic path (the kernels'
    fast path needs a positive scale) with the same plan in place."""
    q, k, v = _inputs(1, 40, 40, 2, 2, 32, torch.float32, device, 5)
    flash_attn_func(q, k, v)
    flash_attn_func(q, k, v, causal=True)
    qt, kt, vt = _inputs(1, 40, 40, 2, 2, 32, torch.float32, device, 5, "bhnd")
    out_t = flash_attn_func(qt, kt, vt)
    assert len(plan._FWD) == 3
    (ref, _), _ = _oracle(q, k, v)
    assert_close(out_t.transpose(1, 2), ref, torch.float32, device, "other strides")
    for scale in (-0.3, 0.0):
        out = flash_attn_func(q, k, v, softmax_scale=scale)
        (ref, _), _ = _oracle(q, k, v, scale=scale)
        assert_close(out.transpose(1, 2), ref, torch.float32, device, f"scale {scale}")
    assert len(plan._FWD) == 3


def test_patched_hook_is_called_every_time(device, monkeypatch):
    """A test or tool that patches a dispatch hook sees it called on every call (no plan bypasses it)."""
    seen = []
    own = fa3_fwd.prefer_hopper
    monkeypatch.setattr(fa3_fwd, "prefer_hopper", lambda *a, **kw: seen.append(1) or own(*a, **kw))
    q, k, v = _inputs(1, 24, 24, 2, 2, 16, torch.float32, device, 6)
    for _ in range(3):
        flash_attn_func(q, k, v)
    assert len(seen) == 3 and not plan._FWD


def test_no_work_signatures_are_left_to_the_generic_path(device):
    q, k, v = _inputs(1, 24, 0, 2, 2, 16, torch.float32, device, 7)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)
    assert list(plan._FWD.values()) == [plan._NONE]


@pytest.mark.gpu
@pytest.mark.parametrize("d,hq,hk,causal,layout,n", [
    (128, 4, 4, False, "bnhd", 4096), (128, 8, 2, False, "bnhd", 4096), (64, 4, 4, True, "bhnd", 4096),
    (192, 2, 2, True, "bnhd", 4096), (96, 4, 4, False, "bhnd", 4096), (256, 2, 2, False, "bnhd", 4096),
    (64, 4, 4, True, "bnhd", 1024), (32, 2, 2, False, "bhnd", 8192),  # the FA2 backward: dQ kernel / atomics
    (64, 4, 4, False, "bhnd", 2048), (64, 8, 2, False, "bnhd", 2048),  # Gluon at 128-row steps; the group loop: FA2
])
def test_gpu_planned_fwd_bwd_matches_oracle_and_generic_path(d, hq, hk, causal, layout, n, monkeypatch):
    """Hopper forward and Gluon / FA2 backward plans (GQA with the group loop, both layouts, the wide kernel):
    against the oracle, and bitwise against the generic path."""
    dtype, nq, nk = torch.bfloat16, n, n
    q, k, v = _inputs(1, nq, nk, hq, hk, d, dtype, "cuda", 8, layout)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to("cuda", dtype)

    def step():
        qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
        out = flash_attn_func(qs, ks, vs, causal=causal)
        return (out, *torch.autograd.grad(out, (qs, ks, vs), do))

    from flashtile.runtime.fa2_bwd import bwd_config

    qb, kb = q.transpose(1, 2), k.transpose(1, 2)
    fa2 = not fa3_gluon_bwd.prefer_gluon_bwd(qb, kb, kb, qb, causal=causal, window=(-1, 0 if causal else -1),
                                             plain=True, deterministic=False)
    # the cases meant for FA2's backward take it (64-wide tiles: under 2k keys, under 4k on the GQA group loop)
    assert fa2 == (d <= 32 or (d <= 64 and (n < 2048 or (n < 4096 and hq > hk))))
    if fa2:  # atomics from 8k keys: both dQ paths of the plan
        assert bwd_config(d, dtype, causal, n, n, q.device).atomic_dq == (n >= 8192)
    planned = [step() for _ in range(2)]
    assert len(plan._FWD) == 1 and len(plan._BWD) == 1
    kinds = {type(p).__name__ for p in (*plan._FWD.values(), *plan._BWD.values())}
    assert kinds == {"ForwardPlan", "BackwardPlan"}, kinds
    (ref, _), leaves = _oracle(q, k, v, causal=causal)
    grads = grads_ref(ref, leaves, do.cpu().double().transpose(1, 2))
    size = max(float(g.abs().max()) for g in grads)
    for got in planned:
        assert_close(got[0].transpose(1, 2), ref, dtype, "cuda", "out")
        for name, g, want in zip(("dq", "dk", "dv"), got[1:], grads):
            assert_close(g.transpose(1, 2), want, dtype, "cuda", name, magnitude=size)
    plan.clear()
    _generic(monkeypatch)
    generic = step()
    assert not plan._FWD and not plan._BWD
    assert torch.equal(generic[0], planned[1][0]) and torch.equal(generic[2], planned[1][2])
    assert torch.equal(generic[3], planned[1][3])  # dK, dV: no atomics; dQ's fp32 reductions may reorder
    assert_close(generic[1], planned[1][1], dtype, "cuda", "dq vs generic", tol=1e-2)


def _fp8_inputs(b, n, hq, hk, d, device, seed):
    from flashtile.fp8 import quantize_per_head

    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, h, d, generator=gen).to(device) for h in (hq, hk, hk))
    q8, qs = quantize_per_head(q, layout="bnhd", kv_heads=hk)
    k8, ks = quantize_per_head(k, layout="bnhd")
    v8, vs = quantize_per_head(v, layout="bnhd")
    return (q8, k8, v8), dict(q_descale=qs, k_descale=ks, v_descale=vs)


def test_fp8_signature_without_hopper_kernel_keeps_the_generic_path(device, monkeypatch):
    """FP8 off Hopper (the dequantised fallback) records its signature as unplanned (on Hopper: planned), the
    same output on every call; a patched dispatch hook bypasses the table; a non-positive scale gets no plan."""
    (q8, k8, v8), ds = _fp8_inputs(1, 24, 2, 1, 32, device, 5)
    first = flash_attn_func(q8, k8, v8, causal=True, **ds)
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    assert len(plan._FP8) == 1
    assert isinstance(next(iter(plan._FP8.values())), plan.Fp8Plan) == hopper  # off Hopper: plan._NONE
    assert torch.equal(flash_attn_func(q8, k8, v8, causal=True, **ds), first)
    plan.clear()
    own = fa3_fwd.prefer_hopper_fp8
    monkeypatch.setattr(fa3_fwd, "prefer_hopper_fp8", lambda *a, **kw: own(*a, **kw))
    assert torch.equal(flash_attn_func(q8, k8, v8, causal=True, **ds), first)
    assert not plan._FP8
    monkeypatch.undo()
    assert plan.fp8_plan(q8, k8, v8, tuple(ds.values()), True, (-1, 0), 0.0) is None and not plan._FP8


def test_fp8_key_tells_which_tensor_is_misaligned():
    """The Hopper kernel's descriptors need q and k 16-byte aligned, V is copied: a misaligned q and a
    misaligned v are different signatures."""
    buf = torch.zeros(2 * 40 * 2 * 32 + 8, dtype=torch.uint8).view(torch.float8_e4m3fn)
    shape = (2, 40, 2, 32)
    aligned, shifted = buf[: buf.numel() - 8].view(shape), buf[8:].view(shape)
    ds = tuple(torch.ones(2, 2) for _ in range(3))
    q_off = plan._fp8_key(shifted, aligned, aligned, ds, False, (-1, -1))
    v_off = plan._fp8_key(aligned, aligned, shifted, ds, False, (-1, -1))
    assert q_off != v_off and plan._fp8_key(aligned, aligned, aligned, ds, False, (-1, -1)) == v_off


@pytest.mark.gpu
@pytest.mark.parametrize("d,hq,hk,causal,n", [
    (128, 4, 4, True, 1024), (128, 8, 2, False, 1000), (64, 6, 2, True, 2100), (256, 4, 2, False, 777),
    (256, 2, 2, True, 300), (96, 4, 4, False, 500), (128, 4, 2, True, 2500),  # the last: dynamic tile counter
])
def test_gpu_fp8_plan_matches_twin_and_generic_path(d, hq, hk, causal, n, monkeypatch):
    """The FP8 plan (Gluon kernel at widths 64 / 128 and causal 256, the Triton FP8 kernel at 256 without a
    mask): against the FP8 twin, bitwise against the generic path, per-call descales (broadcast ones and
    other values on the same signature), V with non-unit row strides."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 (Hopper) GPU")
    from tests.ops.test_fp8_attn import assert_fp8_close, twin

    (q8, k8, v8), ds = _fp8_inputs(2, n, hq, hk, d, "cuda", d + n)
    v_wide = torch.empty(2, n, hk, d + 32, dtype=v8.dtype, device="cuda")[..., :d]  # rows of stride d + 32
    v_wide.copy_(v8)
    planned = [flash_attn_func(q8, k8, v_wide, causal=causal, return_lse=True, **ds) for _ in range(2)]
    assert len(plan._FP8) == 1 and isinstance(next(iter(plan._FP8.values())), plan.Fp8Plan)
    ref = twin(q8, k8, v8, *ds.values(), causal, block_sizes=fa3_fwd.fp8_block_sizes(d, causal, n))
    assert_fp8_close(planned[0][0].transpose(1, 2), ref.out, f"d={d} causal={causal}")
    assert torch.equal(planned[0][0], planned[1][0]) and torch.equal(planned[0][1], planned[1][1])
    other = {name: x * 1.5 for name, x in ds.items()}  # same signature, other values
    planned_other = flash_attn_func(q8, k8, v_wide, causal=causal, return_lse=True, **other)
    assert len(plan._FP8) == 1
    ones = flash_attn_func(q8, k8, v_wide, causal=causal, return_lse=True)  # descales of ones
    plan.clear()
    own = fa3_fwd.prefer_hopper_fp8
    monkeypatch.setattr(fa3_fwd, "prefer_hopper_fp8", lambda *a, **kw: own(*a, **kw))
    for kw, want in ((ds, planned[0]), (other, planned_other), ({}, ones)):
        generic = flash_attn_func(q8, k8, v_wide, causal=causal, return_lse=True, **kw)
        assert not plan._FP8
        assert torch.equal(generic[0], want[0]) and torch.equal(generic[1], want[1])
