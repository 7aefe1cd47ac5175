"""torch.compile traces the public functions as custom ops (no graph break); opcheck on the ops."""

from __future__ import annotations

import pytest
import torch

import flashtile.ops.autograd  # noqa: F401  (registers the flashtile:: ops)
from flashtile.ops import flash_attn_func, scaled_dot_product_attention


def _block(q, k, v, mask):
    """A small model step: causal flash-attn on (B, N, H, d), then SDPA with a bool mask on its output."""
    a = flash_attn_func(q, k, v, causal=True, softcap=3.0)
    x = a.transpose(1, 2)
    b = scaled_dot_product_attention(x, x, x, attn_mask=mask, scale=0.5)
    return (b * b).sum() + a.sum()


def _leaves(device, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 24, 2, 16, generator=gen).to(device)
    k, v = (torch.randn(1, 24, 1, 16, generator=gen).to(device) for _ in range(2))
    return [x.requires_grad_() for x in (q, k, v)]


def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    mask = (torch.rand(24, 24, generator=torch.Generator().manual_seed(1)) > 0.3).to(device)
    mask[:, 0] = True
    eager_in, compiled_in = _leaves(device, 2), _leaves(device, 2)
    eager = _block(*eager_in, mask)
    eager.backward()
    compiled_fn = torch.compile(_block, fullgraph=True, backend="aot_eager")  # a graph break raises here
    compiled = compiled_fn(*compiled_in, mask)
    compiled.backward()
    # same kernels, same order of launches: bitwise equal up to the fp32 additions torch reorders
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    for a, b in zip(compiled_in, eager_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


def test_compiled_dropout_draws_a_fresh_seed_each_call(device):
    """The seed is drawn inside the op, so a compiled graph does not freeze it as a constant,
    and torch.manual_seed replays compiled calls exactly like eager ones."""
    torch._dynamo.reset()
    q, k, v = (x.detach() for x in _leaves(device, 3))

    def f(q, k, v):
        return flash_attn_func(q, k, v, dropout_p=0.5)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    first, second = compiled(q, k, v), compiled(q, k, v)
    torch.manual_seed(5)
    eager = f(q, k, v)
    assert not torch.equal(first, second)
    assert torch.equal(first, eager)


def _fwd_args(q, k, v, seq_major):
    # bias, alibi, block mask tensor, mask_block_q, mask_block_k, scale, causal, left, right, softcap, dropout_p,
    # deterministic, seq_major
    return (q, k, v, None, None, None, 0, 0, 0.25, True, -1, 0, 0.0, 0.0, False, seq_major)


@pytest.mark.parametrize("seq_major", [True, False])
def test_opcheck_forward_op(seq_major, device):
    q, k, v = (x.detach().requires_grad_() for x in _leaves(device, 4))
    if not seq_major:
        q, k, v = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    torch.library.opcheck(torch.ops.flashtile.flash_attn_fwd.default, _fwd_args(q, k, v, seq_major))


def test_opcheck_backward_op(device):
    q, k, v = (x.detach() for x in _leaves(device, 5))
    out, lse, rng = torch.ops.flashtile.flash_attn_fwd(*_fwd_args(q, k, v, True))
    dout = torch.randn_like(out)
    args = (dout, q, k, v, out, lse, rng, None, None, None, 0, 0, 0.25, True, -1, 0, 0.0, 0.0, False, True)
    torch.library.opcheck(torch.ops.flashtile.flash_attn_bwd.default, args)


def test_compile_fullgraph_flash_attn_fidelity_options(device):
    """return_attn_probs's triple, causal with a right bound, and SDPA's (B, N, H, d)-storage output
    trace without a graph break and give the eager results and layout."""
    torch._dynamo.reset()

    def f(q, k, v):
        out, lse, probs = flash_attn_func(q, k, v, causal=True, window_size=(8, 3), return_attn_probs=True)
        x = out.transpose(1, 2)
        y = scaled_dot_product_attention(x, x, x, scale=0.5)
        return y, lse, probs

    q, k, v = (x.detach() for x in _leaves(device, 6))
    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert eager[2] is None and compiled[2] is None
    assert compiled[0].transpose(1, 2).is_contiguous() and eager[0].transpose(1, 2).is_contiguous()
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-6, atol=1e-6)


def test_compile_fullgraph_with_changing_float_options(device):
    """softmax_scale and softcap that change between calls of one compiled function: after the first recompile
    dynamo passes them as symbolic floats, which the finiteness checks must trace (math.isfinite does not)."""
    q, k, v = _leaves(device, 4)

    def f(q, k, v, scale, cap):
        return flash_attn_func(q, k, v, softmax_scale=scale, softcap=cap, causal=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for scale, cap in ((0.1, 1.0), (0.2, 2.0), (0.3, 3.0)):
        torch.testing.assert_close(compiled(q, k, v, scale, cap), f(q, k, v, scale, cap), rtol=1e-5, atol=1e-5)
