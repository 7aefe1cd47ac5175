"""flash_attn_func and the packed variants against the float64 oracle: forward, LSE, gradients."""

from __future__ import annotations

import math

import pytest
import torch
from tests._oracle import assert_close, attention_ref, grads_ref

from flashtile.runtime.common import dropout_keep_mask
from flashtile.ops import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, next_philox_state
from flashtile.reference.masks import BlockMask


def _bnhd(b, n, h, d, dtype, device, gen):
    return torch.randn(b, n, h, d, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


def _leaf64(x: torch.Tensor) -> torch.Tensor:
    """Flash layout (B, N, H, d) -> float64 (B, H, N, d) leaf for the oracle."""
    return x.detach().to(device="cpu", dtype=torch.float64).transpose(1, 2).requires_grad_()


def _check(q, k, v, dtype, device, *, oracle_kw, gen, **kw):
    """Run flash_attn_func forward + backward and compare out, lse, dq, dk, dv with the oracle."""
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    out.backward(dout)
    q64, k64, v64 = _leaf64(q), _leaf64(k), _leaf64(v)
    scale = kw.get("softmax_scale") or 1.0 / math.sqrt(q.shape[-1])
    ref, ref_lse = attention_ref(q64, k64, v64, scale=scale, **oracle_kw)
    dq, dk, dv = grads_ref(ref, (q64, k64, v64), dout.cpu().double().transpose(1, 2))
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert_close(out.transpose(1, 2), ref, dtype, device, "out")
    assert_close(lse, ref_lse, torch.float32, device, "lse")
    for name, got, want in (("dq", q.grad, dq), ("dk", k.grad, dk), ("dv", v.grad, dv)):
        assert got.shape == want.transpose(1, 2).shape
        assert_close(got.transpose(1, 2), want, dtype, device, name)


# (flash_attn_func kwargs, oracle kwargs, Hq, Hk, Nq, Nk): each case exercises one option on a
# shape with several 16 x 32 interpreter tiles and ragged tails
CASES = {
    "plain": ({}, {}, 2, 2, 40, 40),
    "causal_nq_lt_nk": ({"causal": True}, {"causal": True}, 2, 2, 24, 40),
    "causal_nq_gt_nk_empty_rows": ({"causal": True}, {"causal": True}, 2, 1, 40, 24),
    "window": ({"window_size": (8, 4)}, {"window": (8, 4)}, 2, 2, 33, 40),
    "causal_left_window": ({"causal": True, "window_size": (10, -1)}, {"causal": True, "window": (10, 0)}, 2, 2, 40, 40),
    "softcap": ({"softcap": 2.0, "softmax_scale": 0.9}, {"softcap": 2.0}, 2, 2, 24, 40),
    "gqa": ({}, {}, 4, 2, 24, 40),
    "mqa_causal": ({"causal": True}, {"causal": True}, 3, 1, 40, 40),
    # flash-attn's conventions: causal sets the right bound to 0, a window may be an int tensor
    "causal_drops_right_bound": ({"causal": True, "window_size": (10, 5)}, {"causal": True, "window": (10, 0)}, 2, 2, 24, 40),
    "window_tensor": ({"window_size": torch.tensor([8, 4])}, {"window": (8, 4)}, 2, 2, 33, 40),
}


@pytest.mark.parametrize("case", list(CASES))
def test_options_match_oracle(case, device):
    kw, oracle_kw, hq, hk, nq, nk = CASES[case]
    gen = torch.Generator().manual_seed(list(CASES).index(case))
    q = _bnhd(2, nq, hq, 16, torch.float32, device, gen)
    k, v = _bnhd(2, nk, hk, 16, torch.float32, device, gen), _bnhd(2, nk, hk, 16, torch.float32, device, gen)
    _check(q, k, v, torch.float32, device, oracle_kw=oracle_kw, gen=gen, **kw)


@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi_matches_oracle(per_batch, device):
    gen = torch.Generator().manual_seed(11)
    shape = (2, 3) if per_batch else (3,)
    slopes = (torch.rand(shape, generator=gen) * 0.5).to(device)
    q = _bnhd(2, 24, 3, 8, torch.float32, device, gen)
    k, v = _bnhd(2, 40, 3, 8, torch.float32, device, gen), _bnhd(2, 40, 3, 8, torch.float32, device, gen)
    _check(q, k, v, torch.float32, device, oracle_kw={"alibi": slopes.cpu(), "causal": True}, gen=gen,
           alibi_slopes=slopes, causal=True)


def test_block_mask_matches_oracle(device):
    gen = torch.Generator().manual_seed(12)
    # per-head masks, (1, H, Tr, Tc), with an all-False block row (rows 16..31 see nothing)
    mask = torch.tensor([[[1, 0, 1], [0, 0, 0], [1, 1, 0]], [[0, 1, 1], [1, 0, 0], [1, 0, 1]]], dtype=torch.bool)
    bm = BlockMask(mask.unsqueeze(0), (16, 16))
    q = _bnhd(2, 40, 2, 16, torch.float32, device, gen)
    k, v = _bnhd(2, 36, 2, 16, torch.float32, device, gen), _bnhd(2, 36, 2, 16, torch.float32, device, gen)
    _check(q, k, v, torch.float32, device, oracle_kw={"block_mask": bm, "window": (24, -1)}, gen=gen,
           block_mask=bm, window_size=(24, -1))


def test_head_dim_not_power_of_two_and_sdpa_layout_strides(device):
    """d = 24 pads the tile to 32; q/k/v arrive as transposes of (B, H, N, d) tensors (non-contiguous)."""
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 2, n, 24, generator=gen).to(device).transpose(1, 2) for n in (20, 36, 36))
    assert not q.is_contiguous()
    _check(q, k, v, torch.float32, device, oracle_kw={"causal": True}, gen=gen, causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype, device):
    gen = torch.Generator().manual_seed(14)
    q = _bnhd(1, 24, 2, 32, dtype, device, gen)
    k, v = _bnhd(1, 40, 2, 32, dtype, device, gen), _bnhd(1, 40, 2, 32, dtype, device, gen)
    _check(q, k, v, dtype, device, oracle_kw={"causal": True}, gen=gen, causal=True)


def test_fully_masked_rows_give_zero_and_neg_inf(device):
    """Causal with Nq > Nk: the first Nq - Nk query rows see no key (bottom-right alignment)."""
    gen = torch.Generator().manual_seed(15)
    q = _bnhd(1, 20, 2, 8, torch.float32, device, gen).requires_grad_()
    k = _bnhd(1, 8, 2, 8, torch.float32, device, gen).requires_grad_()
    v = _bnhd(1, 8, 2, 8, torch.float32, device, gen).requires_grad_()
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    out.sum().backward()
    assert torch.equal(out[:, :12], torch.zeros_like(out[:, :12]))
    assert torch.isneginf(lse[..., :12]).all() and torch.isfinite(lse[..., 12:]).all()
    assert torch.equal(q.grad[:, :12], torch.zeros_like(q.grad[:, :12]))
    assert all(torch.isfinite(g).all() for g in (q.grad, k.grad, v.grad))


def test_qkvpacked_gradient_reaches_packed_tensor(device):
    gen = torch.Generator().manual_seed(16)
    qkv = torch.randn(2, 24, 3, 2, 16, generator=gen).to(device).requires_grad_()
    out, lse = flash_attn_qkvpacked_func(qkv, causal=True, return_lse=True)
    dout = torch.randn(out.shape, generator=gen).to(device)
    out.backward(dout)
    q64, k64, v64 = (_leaf64(x) for x in qkv.unbind(2))
    ref, ref_lse = attention_ref(q64, k64, v64, scale=16**-0.5, causal=True)
    grads = grads_ref(ref, (q64, k64, v64), dout.cpu().double().transpose(1, 2))
    want = torch.stack([g.transpose(1, 2) for g in grads], dim=2)
    assert qkv.grad.shape == qkv.shape
    assert_close(out.transpose(1, 2), ref, torch.float32, device, "out")
    assert_close(lse, ref_lse, torch.float32, device, "lse")
    assert_close(qkv.grad, want, torch.float32, device, "dqkv")


def test_kvpacked_gqa_gradient_reaches_packed_tensor(device):
    gen = torch.Generator().manual_seed(17)
    q = _bnhd(1, 20, 4, 16, torch.float32, device, gen).requires_grad_()
    kv = torch.randn(1, 36, 2, 2, 16, generator=gen).to(device).requires_grad_()
    out = flash_attn_kvpacked_func(q, kv, window_size=(6, 6), softmax_scale=0.3)
    dout = torch.randn(out.shape, generator=gen).to(device)
    out.backward(dout)
    q64, k64, v64 = _leaf64(q), *(_leaf64(x) for x in kv.unbind(2))
    ref, _ = attention_ref(q64, k64, v64, scale=0.3, window=(6, 6))
    dq, dk, dv = grads_ref(ref, (q64, k64, v64), dout.cpu().double().transpose(1, 2))
    assert_close(out.transpose(1, 2), ref, torch.float32, device, "out")
    assert_close(q.grad.transpose(1, 2), dq, torch.float32, device, "dq")
    assert_close(kv.grad, torch.stack([dk.transpose(1, 2), dv.transpose(1, 2)], dim=2), torch.float32, device, "dkv")


def test_dropout_forward_and_backward_replay_the_keep_mask(device):
    """The op's (seed, offset) rebuilds its keep-mask; the backward must regenerate the same one."""
    gen = torch.Generator().manual_seed(18)
    p = 0.3
    q = _bnhd(2, 24, 2, 16, torch.float32, device, gen)
    k, v = _bnhd(2, 40, 1, 16, torch.float32, device, gen), _bnhd(2, 40, 1, 16, torch.float32, device, gen)
    seed, offset = next_philox_state(device)
    keep = dropout_keep_mask(seed, offset, 2, 2, 24, 40, p, device).cpu()
    assert 0.5 < keep.float().mean() < 0.9  # the mask really drops something
    _check(q, k, v, torch.float32, device, oracle_kw={"causal": True, "keep": keep, "dropout_p": p}, gen=gen,
           dropout_p=p, causal=True)


def test_dropout_reproducible_under_manual_seed(device):
    gen = torch.Generator().manual_seed(19)
    q, k, v = (_bnhd(1, 16, 2, 8, torch.float32, device, gen) for _ in range(3))

    def run():
        return flash_attn_func(q, k, v, dropout_p=0.5)

    torch.manual_seed(1234)
    first, second = run(), run()
    torch.manual_seed(1234)
    again = run()
    assert torch.equal(first, again)
    assert not torch.equal(first, second)  # the generator advanced between calls


def test_deterministic_backward_is_bitwise_reproducible(device):
    gen = torch.Generator().manual_seed(20)
    q = _bnhd(1, 40, 4, 16, torch.float32, device, gen)
    k, v = _bnhd(1, 40, 1, 16, torch.float32, device, gen), _bnhd(1, 40, 1, 16, torch.float32, device, gen)
    dout = _bnhd(1, 40, 4, 16, torch.float32, device, gen)

    def grads():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        flash_attn_func(*leaves, deterministic=True).backward(dout)
        return [x.grad for x in leaves]

    for a, b in zip(grads(), grads()):
        assert torch.equal(a, b)


def test_empty_key_sequence(device):
    q = torch.randn(1, 5, 2, 8, device=device)
    k = v = torch.randn(1, 0, 2, 8, device=device)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_return_attn_probs_returns_out_lse_and_no_matrix(device):
    """flash-attn's return_attn_probs=True: (out, softmax_lse, S_dmask); S_dmask is None here."""
    gen = torch.Generator().manual_seed(21)
    q = _bnhd(1, 24, 2, 16, torch.float32, device, gen)
    k, v = _bnhd(1, 40, 2, 16, torch.float32, device, gen), _bnhd(1, 40, 2, 16, torch.float32, device, gen)
    out, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs is None
    ref, ref_lse = attention_ref(_leaf64(q), _leaf64(k), _leaf64(v), scale=0.25, causal=True)
    assert_close(out.transpose(1, 2), ref, torch.float32, device, "out")
    assert_close(lse, ref_lse, torch.float32, device, "lse")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_every_head_dim_bucket_runs_fwd_bwd(dtype):
    """Each head-dim bucket of the tile tables (and odd dims inside them) compiles within the
    device's shared memory and matches the oracle, forward and backward, in fp32 (4-byte tiles)
    and bf16; GQA 4:2, causal (above d = 128 the Gluon backward's fp32 partials; below, at 170 keys, FA2's) and not
    (the Gluon backward's group loop from d = 72)."""
    gen = torch.Generator().manual_seed(7)
    for d in (8, 40, 64, 72, 96, 112, 128, 160, 192, 200, 256):
        for causal in (True, False):
            q = _bnhd(2, 150, 4, d, dtype, "cuda", gen).requires_grad_(True)
            k = _bnhd(2, 170, 2, d, dtype, "cuda", gen).requires_grad_(True)
            v = _bnhd(2, 170, 2, d, dtype, "cuda", gen).requires_grad_(True)
            do = _bnhd(2, 150, 4, d, dtype, "cuda", gen)
            out = flash_attn_func(q, k, v, causal=causal)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
            q64, k64, v64 = (_leaf64(x) for x in (q, k, v))
            ref, _ = attention_ref(q64, k64, v64, causal=causal)
            rdq, rdk, rdv = grads_ref(ref, (q64, k64, v64), do.transpose(1, 2).double().cpu())
            assert_close(out.transpose(1, 2), ref, dtype, "cuda", f"out d={d} causal={causal}")
            size = max(float(r.abs().max()) for r in (rdq, rdk, rdv))  # as the kernel tests' assert_grads
            for name, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
                assert_close(got.transpose(1, 2), want, dtype, "cuda", f"{name} d={d} causal={causal}",
                             magnitude=size)


def test_direct_op_calls_are_checked_before_any_kernel(device):
    """``torch.ops.flashtile.flash_attn_fwd`` / ``_bwd`` called directly (no public wrapper in front): mismatched
    q, k, v, a non-finite scale, a dout unlike out raise ValueError naming the argument, before a kernel reads
    anything (the kernels trust ops.validate, which the public functions run)."""
    q = torch.randn(1, 8, 2, 16, device=device)
    k = torch.randn(1, 8, 1, 16, device=device)
    opts = (None, None, None, 0, 0, 0.25, False, -1, -1, 0.0, 0.0, False, True)
    fwd = torch.ops.flashtile.flash_attn_fwd
    with pytest.raises(ValueError, match="one shape"):
        fwd(q, k, torch.randn(1, 9, 1, 16, device=device), *opts)
    with pytest.raises(ValueError, match="dtype and device"):
        fwd(q, k, k.double(), *opts)
    with pytest.raises(ValueError, match="head_dim"):
        fwd(q, torch.randn(1, 8, 1, 8, device=device), torch.randn(1, 8, 1, 8, device=device), *opts)
    with pytest.raises(ValueError, match="multiple"):
        fwd(*(torch.randn(1, 8, h, 16, device=device) for h in (3, 2, 2)), *opts)
    if device == "cuda":  # CPU tensors on a GPU machine: refused, not handed to a compiled launch
        with pytest.raises(ValueError, match="CPU tensors"):
            fwd(q.cpu(), k.cpu(), k.cpu(), *opts)
    with pytest.raises(ValueError, match="softmax_scale"):
        fwd(q, k, k, *opts[:5], float("nan"), *opts[6:])
    out, lse, rng = fwd(q, k, k, *opts)
    bwd = torch.ops.flashtile.flash_attn_bwd
    for bad in (out[:, :4], out.double(), out.unsqueeze(0)):
        with pytest.raises(ValueError, match="dout"):
            bwd(bad, q, k, k, out, lse, rng, *opts)
    # out / lse smaller than q's rows (the kernels would read past them), then the optional tensors
    small = out[:, :4].contiguous()
    with pytest.raises(ValueError, match="^out must have q's shape"):
        bwd(small, q, k, k, small, lse, rng, *opts)
    for bad_lse in (lse[:, :1].contiguous(), lse.double(), lse.transpose(1, 2).contiguous().transpose(1, 2)):
        with pytest.raises(ValueError, match="^lse must be"):
            bwd(out, q, k, k, out, bad_lse, rng, *opts)
    slopes = torch.full((1000,), 0.5, device=device)
    with pytest.raises(ValueError, match="alibi_slopes"):
        fwd(q, k, k, None, slopes[:1], *opts[2:])
    with pytest.raises(ValueError, match="^bias must"):
        fwd(q, k, k, torch.zeros(3, 8, 8, device=device), *opts[1:])
    with pytest.raises(ValueError, match="block_size"):
        fwd(q, k, k, None, None, torch.ones(1, 1, 8, 8, dtype=torch.bool, device=device), 1, 1, *opts[5:])
    with pytest.raises(ValueError, match="alibi_slopes"):
        bwd(out, q, k, k, out, lse, rng, None, slopes[:1], *opts[2:])


def test_backward_with_an_undefined_output_gradient(device):
    """Gradients are not materialised for out, lse, rng_state: a graph where out's gradient is undefined (a
    Function that drops it) gives no gradient to q, k, v instead of a kernel run on zeros."""
    class DropGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.detach().clone()

        @staticmethod
        def backward(ctx, g):
            return None

    q, k, v = (torch.randn(1, 8, 2, 16, device=device, requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v)
    y = DropGrad.apply(out).sum() + q.sum()  # q also reached directly: backward runs
    y.backward()
    assert k.grad is None and v.grad is None and torch.equal(q.grad, torch.ones_like(q))


def test_forward_without_gradients_skips_autograd_function(device, monkeypatch):
    """Under no_grad, inference_mode, or with inputs that do not require grad, the eager forward (fixed-length
    and packed) runs without autograd.Function's bookkeeping and gives the same output; inputs that require
    grad still go through it and get gradients."""
    from flashtile.ops import autograd, flash_attn_varlen_func

    gen = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(1, 40, 2, 32, generator=gen).to(device) for _ in range(3))
    want = flash_attn_func(q, k, v, causal=True)
    cu = torch.tensor([0, 17, 40], dtype=torch.int32, device=device)
    packed = [x[0] for x in (q, k, v)]
    want_packed = flash_attn_varlen_func(*packed, cu, cu, 23, 23, causal=True)

    def refuse(*a):
        raise AssertionError("autograd.Function used without gradients to track")

    monkeypatch.setattr(autograd._EagerAttention, "apply", refuse)
    monkeypatch.setattr(autograd._EagerVarlenAttention, "apply", refuse)
    for ctx in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        with ctx():
            assert torch.equal(flash_attn_func(q, k, v, causal=True), want)
            assert torch.equal(flash_attn_varlen_func(*packed, cu, cu, 23, 23, causal=True), want_packed)
    monkeypatch.undo()
    qg = q.clone().requires_grad_()
    out = flash_attn_func(qg, k, v, causal=True)
    assert out.grad_fn is not None and torch.equal(out.detach(), want)
    out.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


def test_double_backward_raises_instead_of_dropping_terms(device):
    """A gradient taken with create_graph=True cannot be differentiated again (no double backward): the second
    backward raises rather than treating dq as a constant (which silently dropped the penalty's gradient)."""
    from flashtile.ops import flash_attn_varlen_func, scaled_dot_product_attention

    q, k, v = (torch.randn(2, 9, 2, 16, device=device, requires_grad=True) for _ in range(3))
    calls = [lambda: flash_attn_func(q, k, v),
             lambda: scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
             lambda: flash_attn_varlen_func(q[0], k[0], v[0], *(torch.tensor([0, 4, 9], dtype=torch.int32,
                                                                             device=device),) * 2, 5, 5)]
    for call in calls:
        for upstream in (lambda o: o.square().sum(), lambda o: (o * torch.randn_like(o)).sum()):
            o = call()  # the second upstream gradient is a constant (once_differentiable let that one through)
            gq, = torch.autograd.grad(upstream(o), q, create_graph=True)
            assert gq.requires_grad
            with pytest.raises(RuntimeError, match="no double backward"):
                (o.sum() + gq.square().sum()).backward()


@pytest.mark.parametrize("fwd_tiles", [None, (32, 32), (16, 16)], ids=["dispatch", "fwd32x32", "fwd16x16"])
def test_alibi_slopes_past_fp32_range_give_the_argmax(device, fwd_tiles, monkeypatch):
    """Slopes whose |slope| * distance overflows fp32 (rows where every key's score would be -inf gave NaN): the
    kernels clamp them where softmax is already an argmax over distance, so out and the gradients equal the float64
    oracle's; the LSE equals it where the nearest key is at distance 0, and stays finite elsewhere.  The forward
    kernel, its backward and the decode kernel (flash_attn_with_kvcache) all take the clamp."""
    from flashtile import flash_attn_with_kvcache
    from flashtile.runtime import fa2_fwd

    if fwd_tiles is not None:  # the forward's tiles unlike the backward's: both must clamp alike (LSE -> P)
        monkeypatch.setattr(fa2_fwd, "fwd_config", lambda *a, **kw: (*fwd_tiles, 4, 1))
    gen = torch.Generator().manual_seed(21)
    nq, nk, h = 40, 24, 4  # Nq > Nk: the first 16 rows' nearest key is at distance 16 - i
    slopes = torch.tensor([1e38, -1e38, 3e37, 0.25]).to(device)
    q = _bnhd(1, nq, h, 16, torch.float32, device, gen).requires_grad_()
    k, v = (_bnhd(1, nk, h, 16, torch.float32, device, gen).requires_grad_() for _ in range(2))
    out, lse = flash_attn_func(q, k, v, alibi_slopes=slopes, return_lse=True)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device=device, dtype=torch.float32)
    out.backward(dout)
    q64, k64, v64 = _leaf64(q), _leaf64(k), _leaf64(v)
    ref, ref_lse = attention_ref(q64, k64, v64, scale=0.25, alibi=slopes.cpu())
    dq, dk, dv = grads_ref(ref, (q64, k64, v64), dout.cpu().double().transpose(1, 2))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close(out.transpose(1, 2), ref, torch.float32, device, "out")
    # one-hot rows: dq, dk cancel to 0 up to the rounding of dO.v - D (tf32 on a GPU), so the scale is the gradients'
    scale = max(float(g.abs().max()) for g in (dq, dk, dv))
    for name, got, want in (("dq", q.grad, dq), ("dk", k.grad, dk), ("dv", v.grad, dv)):
        assert_close(got.transpose(1, 2), want, torch.float32, device, name, magnitude=scale)
        assert_close(got.transpose(1, 2)[:, 3], want[:, 3], torch.float32, device, f"{name} (plain slope)")
    near = nq - nk  # rows from here have a key at distance 0
    assert_close(lse[:, [0, 2, 3], near:], ref_lse[:, [0, 2, 3], near:], torch.float32, device, "lse")
    assert_close(lse[:, 3], ref_lse[:, 3], torch.float32, device, "lse (plain slope)")
    # decode: 2 new query rows against the 24-key cache, bottom-right aligned as above
    qd = q.detach()[:, -2:].contiguous()
    got = flash_attn_with_kvcache(qd, k.detach().contiguous(), v.detach().contiguous(), alibi_slopes=slopes)
    want, _ = attention_ref(_leaf64(qd), k64.detach(), v64.detach(), scale=0.25, alibi=slopes.cpu())
    assert_close(got.transpose(1, 2), want, torch.float32, device, "decode out")
