"""flash_attn_func called from several threads at once: every call gets its own correct result.

Launch caches (runtime/launch.py) are filled concurrently here: threads
share problem signatures (one launcher, raced first calls) or not (new
entries published while others read).  On CPU the kernels run in Triton's
interpreter, whose state is module-global, so the launches themselves are
serialised by the launcher; the caches and everything around them are not.
"""

from __future__ import annotations

import math
import threading

import torch
from tests._oracle import assert_close, attention_ref, grads_ref

from flashtile.runtime.launch import _bound
from flashtile.ops import flash_attn_func

# (Nq, Nk, Hq, Hk, causal): two threads per signature
SIGNATURES = [(24, 40, 2, 1, True), (33, 20, 2, 2, False), (24, 40, 2, 1, True), (33, 20, 2, 2, False)]


def _inputs(i, device):
    nq, nk, hq, hk, _ = SIGNATURES[i]
    gen = torch.Generator().manual_seed(100 + i)
    q = torch.randn(1, nq, hq, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, nk, hk, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(1, nq, hq, 16, generator=gen, dtype=torch.float64)
    return [x.to(device=device, dtype=torch.float32) for x in (q, k, v, dout)]


def test_concurrent_calls_each_match_the_oracle(device):
    _bound.cache_clear()  # the threads race to create and fill the launchers
    results, errors = {}, []
    barrier = threading.Barrier(len(SIGNATURES))

    def work(i):
        try:
            q, k, v, dout = _inputs(i, device)
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            barrier.wait()
            out, lse = flash_attn_func(q, k, v, causal=SIGNATURES[i][4], return_lse=True)
            out.backward(dout)
            results[i] = (out.detach(), lse, q.grad, k.grad, v.grad)
        except Exception as e:  # noqa: BLE001  (re-raised in the main thread below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(SIGNATURES))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert sorted(results) == list(range(len(SIGNATURES)))
    for i, (out, lse, dq, dk, dv) in results.items():
        q, k, v, dout = (x.detach().cpu().double().transpose(1, 2) for x in _inputs(i, device))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        ref, ref_lse = attention_ref(q, k, v, scale=1.0 / math.sqrt(16), causal=SIGNATURES[i][4])
        grads = grads_ref(ref, (q, k, v), dout)
        assert_close(out.transpose(1, 2), ref, torch.float32, device, f"out of thread {i}")
        assert_close(lse, ref_lse, torch.float32, device, f"lse of thread {i}")
        for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
            assert_close(got.transpose(1, 2), want, torch.float32, device, f"{name} of thread {i}")
