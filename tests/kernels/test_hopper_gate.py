"""The Triton-release gate of the Hopper kernels (``runtime.common.hopper_target`` / ``require_hopper``)."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

from flashtile.runtime import common


def test_triton_release_parses_versions():
    assert common.triton_release("3.6.0") == (3, 6) and common.triton_release("3.10.2") == (3, 10)
    assert common.triton_release("3.7.0+git1a2b3c") == (3, 7) and common.triton_release("3.8.0rc1") == (3, 8)
    assert common.triton_release("nightly") == (0, 0) and common.triton_release("") == (0, 0)


def test_hopper_target_needs_sm90_and_a_tested_triton(monkeypatch):
    """sm_90 and a tested Triton: True; another release: False with one warning per process naming both versions;
    other capabilities: False without a warning."""
    monkeypatch.setattr(common, "_warned", [])
    monkeypatch.setattr(common, "HOPPER_TRITON", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert common.hopper_target((9, 0)) and not common.hopper_target((8, 0))
        assert not common.hopper_target((10, 0))
    monkeypatch.setattr(common, "HOPPER_TRITON", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not common.hopper_target((8, 6))  # not a Hopper device: nothing to say
    with pytest.warns(UserWarning, match=r"tested on Triton 3\.6.*FLASHTILE_ANY_TRITON=1"):
        assert not common.hopper_target((9, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not common.hopper_target((9, 0))  # once per process


def test_require_hopper_names_the_reason(monkeypatch):
    monkeypatch.setattr(common, "capability", lambda index: (8, 0))
    monkeypatch.setattr(common, "HOPPER_TRITON", True)
    with pytest.raises(NotImplementedError, match="fa3_forward needs an sm_90"):
        common.require_hopper("fa3_forward", 0)
    monkeypatch.setattr(common, "capability", lambda index: (9, 0))
    common.require_hopper("fa3_forward", 0)
    monkeypatch.setattr(common, "HOPPER_TRITON", False)
    with pytest.raises(NotImplementedError, match=r"fa3_backward is tested on Triton 3\.6, got Triton"):
        common.require_hopper("fa3_backward", 0)


@pytest.mark.parametrize("env", ["1", "0", None])
def test_gate_reads_the_environment(env):
    """FLASHTILE_ANY_TRITON=1 lifts the gate; otherwise it is open on Triton 3.6.x alone."""
    import os

    import triton

    environ = {k: v for k, v in os.environ.items() if k != "FLASHTILE_ANY_TRITON"}
    if env is not None:
        environ["FLASHTILE_ANY_TRITON"] = env
    code = "import flashtile.runtime.common as c; print(c.HOPPER_TRITON)"
    got = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert got == str(env == "1" or triton.__version__.startswith("3.6."))


def test_one_warning_from_many_threads(monkeypatch):
    """Threads racing through a closed gate warn once between them."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(common, "_warned", [])
    monkeypatch.setattr(common, "HOPPER_TRITON", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ThreadPoolExecutor(8) as pool:
            assert not any(pool.map(lambda _: common.hopper_target((9, 0)), range(64)))
    assert sum("FA2 kernels" in str(w.message) for w in caught) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="needs an sm_90 GPU")
def test_gpu_untested_triton_runs_fa2(monkeypatch):
    """On an sm_90 GPU with the gate closed, flash_attn_func's forward and backward launch no Hopper kernel (the
    FA2 ones), warn, and match the calls with the gate open."""
    from flashtile import flash_attn_func
    from flashtile.runtime import fa3_bwd, fa3_fwd, fa3_gluon, fa3_gluon_bwd

    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, dout = (torch.randn(2, 2048, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for _ in range(4))

    def run():
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out = flash_attn_func(qg, kg, vg, causal=True)
        out.backward(dout)
        return out, qg.grad, kg.grad, vg.grad

    from flashtile.ops import plan
    from flashtile.runtime import launch

    kernels = []
    for name in ("_bound", "_unbound"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda kernel, *a, real=real: (kernels.append(kernel), real(kernel, *a))[1])
    hopper_modules = {m.__name__.replace("runtime", "kernels") for m in (fa3_fwd, fa3_bwd, fa3_gluon, fa3_gluon_bwd)}

    def launched_hopper():
        mods = {getattr(getattr(k, "fn", k), "__module__", "") for k in kernels}
        kernels.clear()
        return {m for m in mods if m in hopper_modules or m.endswith("fa3_gluon_bwd_wide")}

    plan.clear()  # plans made earlier replay their launchers without asking runtime.launch again
    want = run()
    assert launched_hopper(), "the open gate launched no Hopper kernel: the test would prove nothing"
    monkeypatch.setattr(common, "HOPPER_TRITON", False)
    monkeypatch.setattr(common, "_warned", [])
    with pytest.warns(UserWarning, match="FA2 kernels"):
        got = run()
    assert not launched_hopper()
    for g, w in zip(got, want):
        assert (g.float() - w.float()).abs().max() <= 2e-2 * w.float().abs().max()
