"""scaled_dot_product_attention against torch.nn.functional.scaled_dot_product_attention.

torch's SDPA is run on CPU in float64 on the same inputs: its semantics (top-left
``is_causal``, bool masks with True = take part, enable_gqa) are the oracle,
without its own fp32 rounding in the comparison.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests._oracle import assert_close

import flashtile.runtime.fa2_fwd as fa2_fwd_module
from flashtile.runtime.common import dropout_keep_mask
from flashtile.ops import next_philox_state, scaled_dot_product_attention


def _inputs(shape_q, shape_kv, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device) for s in (shape_q, shape_kv, shape_kv)]


def _compare_with_torch(q, k, v, device, **kw):
    """Forward and all three gradients of ours (fp32) vs torch's SDPA (float64, CPU)."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = scaled_dot_product_attention(*leaves, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(99)).to(device)
    out.backward(dout)
    refs = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
    kw64 = dict(kw)
    mask = kw.get("attn_mask")
    if mask is not None:
        kw64["attn_mask"] = mask.cpu() if mask.dtype == torch.bool else mask.cpu().double()
    ref = F.scaled_dot_product_attention(*refs, **kw64)
    ref.backward(dout.cpu().double())
    assert out.shape == ref.shape
    assert_close(out, ref, torch.float32, device, "out")
    for name, got, want in zip(("dq", "dk", "dv"), leaves, refs):
        assert_close(got.grad, want.grad, torch.float32, device, name)


@pytest.mark.parametrize("nq,nk", [(24, 40), (40, 24), (33, 33)])
def test_is_causal_is_top_left_aligned(nq, nk, device):
    q, k, v = _inputs((2, 2, nq, 16), (2, 2, nk, 16), device, seed=nq * 100 + nk)
    _compare_with_torch(q, k, v, device, is_causal=True)


def test_bool_mask_broadcast_with_fully_masked_row(device):
    q, k, v = _inputs((2, 2, 20, 16), (2, 2, 36, 16), device, seed=1)
    mask = torch.rand(20, 36, generator=torch.Generator().manual_seed(2)) > 0.4
    mask[3] = False  # torch (and flashtile) give 0 for a row that sees nothing
    _compare_with_torch(q, k, v, device, attn_mask=mask.to(device))


def test_bool_mask_per_batch(device):
    q, k, v = _inputs((2, 2, 20, 8), (2, 2, 24, 8), device, seed=3)
    mask = torch.rand(2, 1, 20, 24, generator=torch.Generator().manual_seed(4)) > 0.3
    mask[..., 0] = True
    _compare_with_torch(q, k, v, device, attn_mask=mask.to(device))


def test_float_mask_with_neg_inf_and_scale(device):
    q, k, v = _inputs((1, 3, 20, 16), (1, 3, 30, 16), device, seed=5)
    gen = torch.Generator().manual_seed(6)
    mask = torch.randn(1, 3, 20, 30, generator=gen)
    mask[torch.rand(1, 3, 20, 30, generator=gen) < 0.2] = float("-inf")
    mask[..., 5] = 0.0
    _compare_with_torch(q, k, v, device, attn_mask=mask.to(device), scale=0.5)


def test_enable_gqa_causal(device):
    q, k, v = _inputs((1, 4, 24, 16), (1, 2, 40, 16), device, seed=7)
    _compare_with_torch(q, k, v, device, is_causal=True, enable_gqa=True)


def test_three_dim_inputs_with_mask(device):
    q, k, v = _inputs((2, 20, 8), (2, 24, 8), device, seed=8)
    mask = torch.tril(torch.ones(20, 24, dtype=torch.bool), diagonal=2)
    _compare_with_torch(q, k, v, device, attn_mask=mask.to(device))


def test_mask_reaches_kernel_as_stride_zero_view(device, monkeypatch):
    """A (Nq, Nk) mask must not be expanded in memory to (B, H, Nq, Nk)."""
    seen = {}
    real = fa2_fwd_module.fa2_forward

    def spy(*args, **kwargs):
        seen["strides"] = kwargs["bias"].stride()
        seen["shape"] = tuple(kwargs["bias"].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(fa2_fwd_module, "fa2_forward", spy)
    q, k, v = _inputs((2, 3, 16, 8), (2, 3, 16, 8), device, seed=9)
    scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool, device=device))
    assert seen["shape"] == (2, 3, 16, 16)
    assert seen["strides"][:2] == (0, 0)


def test_dropout_reproducible_and_matches_keep_mask(device):
    """scale=0 and v=1 make every output element (kept keys of the row) / (N * (1 - p)): the
    dropout applied is exactly the keep-mask of the (seed, offset) the call drew, and
    torch.manual_seed replays it."""
    q, k, _ = _inputs((1, 2, 32, 8), (1, 2, 32, 8), device, seed=10)
    v = torch.ones(1, 2, 32, 8, device=device)
    torch.manual_seed(7)
    seed, offset = next_philox_state(device)
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.25, scale=0.0)
    torch.manual_seed(7)
    b = scaled_dot_product_attention(q, k, v, dropout_p=0.25, scale=0.0)
    assert torch.equal(a, b)
    keep = dropout_keep_mask(seed, offset, 1, 2, 32, 32, 0.25, device)
    assert not keep.all()
    want = (keep.sum(-1).double() / (32 * 0.75)).unsqueeze(-1).expand(a.shape)
    assert_close(a, want, torch.float32, device, "dropped out")


def test_output_layout_is_torch_flash_backends_and_gradients_follow(device):
    """The output is a (B, H, N, d) view of (B, N, H, d) storage, so the model code's next step
    out.transpose(1, 2).reshape(B, N, H * d) copies nothing; inputs with any strides (here the usual
    transposed views of projections, and a non-contiguous head_dim slice) give torch's gradients."""
    gen = torch.Generator().manual_seed(12)
    b, n, h, d = 2, 24, 3, 16
    proj = torch.randn(b, n, 3 * h * d, generator=gen).to(device)
    q_, k_, v_ = proj.view(b, n, 3, h, d).unbind(2)
    leaves = [x.detach().clone().requires_grad_() for x in (q_, k_, v_)]  # (B, N, H, d) leaves
    query, key, value = (x.transpose(1, 2) for x in leaves)  # (B, H, N, d) views, SDPA's input
    out = scaled_dot_product_attention(query, key, value, is_causal=True)
    assert out.shape == (b, h, n, d)
    assert out.transpose(1, 2).is_contiguous()
    merged = out.transpose(1, 2).reshape(b, n, h * d)
    assert merged.data_ptr() == out.data_ptr()  # a view: no copy
    dmerged = torch.randn(merged.shape, generator=gen).to(device)
    merged.backward(dmerged)
    refs = [x.detach().cpu().double().requires_grad_() for x in (q_, k_, v_)]
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in refs), is_causal=True)
    ref.transpose(1, 2).reshape(b, n, h * d).backward(dmerged.cpu().double())
    assert_close(out, ref, torch.float32, device, "out")
    for name, got, want in zip(("dq", "dk", "dv"), leaves, refs):
        assert_close(got.grad, want.grad, torch.float32, device, name)


def test_three_dim_output_layout(device):
    q, k, v = _inputs((2, 20, 8), (2, 24, 8), device, seed=13)
    out = scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 20, 8) and out.transpose(0, 1).is_contiguous()
    ref = F.scaled_dot_product_attention(q.cpu().double(), k.cpu().double(), v.cpu().double())
    assert_close(out, ref, torch.float32, device, "out")


def test_float32_mask_on_half_queries(device):
    """torch's SDPA takes a float32 additive mask with fp16 / bf16 queries (bool, float32 or query's dtype): so does
    the drop-in, adding it in fp32."""
    from flashtile.ops import scaled_dot_product_attention as sdpa

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=g).to(device, torch.float16) for _ in range(3))
    mask = torch.randn(16, 16, generator=g).to(device)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    torch.testing.assert_close(sdpa(q, k, v, attn_mask=mask).float(), ref, rtol=2e-2, atol=2e-3)
