"""The attention ops run on their tensors' device, whichever CUDA device is current.

Triton launches on the current device, so the ops make the tensors' device
current around forward and backward.  The CPU test drives the guard with a
stand-in argument and a recorded ``torch.cuda.device``; the multi-GPU test
runs forward and backward on cuda:1 with cuda:0 current against the float64
oracle (and on cuda:0 around it, so launch caches keyed on one device only
would launch on the wrong one).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from tests._oracle import assert_close, attention_ref, grads_ref

import flashtile.ops.autograd as autograd_module
from flashtile.ops import flash_attn_func, scaled_dot_product_attention


class _Arg:
    def __init__(self, device):
        self.device = torch.device(device)

    def get_device(self):
        return self.device.index if self.device.type == "cuda" else -1


def test_guard_enters_the_tensors_device_only_when_it_is_not_current(monkeypatch):
    entered, seen = [], []
    current = [0]

    @contextlib.contextmanager
    def fake_device(index):
        entered.append(index)
        before, current[0] = current[0], index
        try:
            yield
        finally:
            current[0] = before

    from flashtile.runtime import common as common_module

    monkeypatch.setattr(common_module, "cuda_device_index", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", fake_device)
    guarded = autograd_module._on_tensor_device(lambda *args: seen.append(current[0]) or len(args))

    assert guarded(_Arg("cuda:1"), 2, 3) == 3
    assert guarded(_Arg("cuda:0"), 2) == 2
    assert guarded(_Arg("cpu")) == 1
    current[0] = 1
    guarded(_Arg("cuda:1"))
    assert entered == [1]  # only the first call had another device current
    assert seen == [1, 0, 0, 1]  # the body always ran with the tensors' device current (cpu: untouched)
    assert current[0] == 1


def test_on_device_enters_only_another_device(monkeypatch):
    """The kernel wrappers' ``on_device(x)``: ``torch.cuda.device`` only when x's device is not current."""
    entered = []
    from flashtile.runtime import common as common_module

    monkeypatch.setattr(common_module, "cuda_device_index", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: entered.append(index) or contextlib.nullcontext())
    for arg in (_Arg("cuda:0"), _Arg("cpu"), _Arg("cuda:1")):
        with common_module.on_device(arg):
            pass
    assert entered == [1]


def test_forward_and_backward_impls_are_guarded():
    assert autograd_module._fwd_impl.__wrapped__ is not None
    assert autograd_module._bwd_impl.__wrapped__ is not None


def _leaf64(x):
    return x.detach().to(device="cpu", dtype=torch.float64).transpose(1, 2).requires_grad_()


def _flash_on(device, seed):
    """flash_attn_func fwd + bwd on ``device`` vs the float64 oracle."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 70, 4, 64, generator=gen).to(device).requires_grad_()
    k, v = (torch.randn(2, 90, 2, 64, generator=gen).to(device).requires_grad_() for _ in range(2))
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.device == q.device and lse.device == q.device
    dout = torch.randn(out.shape, generator=gen).to(device)
    out.backward(dout)
    q64, k64, v64 = _leaf64(q), _leaf64(k), _leaf64(v)
    ref, ref_lse = attention_ref(q64, k64, v64, scale=1.0 / math.sqrt(64), causal=True)
    grads = grads_ref(ref, (q64, k64, v64), dout.cpu().double().transpose(1, 2))
    assert_close(out.transpose(1, 2), ref, torch.float32, "cuda", f"out on {device}")
    assert_close(lse, ref_lse, torch.float32, "cuda", f"lse on {device}")
    for name, x, want in zip(("dq", "dk", "dv"), (q, k, v), grads):
        assert x.grad.device == x.device
        assert_close(x.grad.transpose(1, 2), want, torch.float32, "cuda", f"{name} on {device}")


@pytest.mark.multigpu
def test_ops_run_on_the_tensors_device_not_the_current_one():
    torch.cuda.set_device(0)
    _flash_on("cuda:0", 0)
    _flash_on("cuda:1", 1)  # cuda:0 current
    _flash_on("cuda:0", 2)
    assert torch.cuda.current_device() == 0
    with torch.cuda.device(1):
        _flash_on("cuda:0", 3)  # and the other way round
        assert torch.cuda.current_device() == 1
    # SDPA goes through the same ops
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=gen) for _ in range(3))
    leaves = [x.to("cuda:1").requires_grad_() for x in (q, k, v)]
    out = scaled_dot_product_attention(*leaves, is_causal=True)
    out.sum().backward()
    refs = [x.double().requires_grad_() for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*refs, is_causal=True)
    ref.sum().backward()
    assert_close(out, ref, torch.float32, "cuda", "sdpa out on cuda:1")
    for name, got, want in zip(("dq", "dk", "dv"), leaves, refs):
        assert_close(got.grad, want.grad, torch.float32, "cuda", f"sdpa {name} on cuda:1")
