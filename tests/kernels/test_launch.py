"""KernelLauncher: Triton's binding once per alignment, the compiled kernel launched directly after.

The CPU tests drive the launcher with a stand-in kernel that records how it
is called (the interpreter has no compiled kernels); the GPU test launches a
real kernel both ways and compares.
"""

import pytest
import torch

from flashtile.runtime.launch import KernelLauncher


class _Compiled:
    """Stands in for triton's CompiledKernel: ``compiled[grid](*args)`` launches."""

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class _Jit:
    """Stands in for a JITFunction: ``fn[grid](*args, **options)`` binds, launches and returns the compiled kernel."""

    def __init__(self, compiled=True):
        self.log = []
        self.compiled = compiled

    def __getitem__(self, grid):
        def run(*args, **options):
            self.log.append(("jit", grid, args, options))
            return _Compiled(self.log) if self.compiled else None

        return run


def _aligned(n=64, dtype=torch.float32):
    return torch.empty(n, dtype=dtype)


def test_binds_once_then_launches_directly():
    fn = _Jit()
    la = KernelLauncher(fn, (4, 2), static=(7, 8, True), options={"num_warps": 4})
    x, y = _aligned(), _aligned()
    la(x, y, 0.5)
    la(x, y, 0.25)
    la(_aligned(), _aligned(), 1.0)
    kinds = [e[0] for e in fn.log]
    assert kinds == ["jit", "direct", "direct"]
    assert fn.log[0][1] == (4, 2, 1) and fn.log[0][3] == {"num_warps": 4}
    # the direct launch gets the dynamic arguments first, then the static ones, unchanged
    assert fn.log[1][2] == (x, y, 0.25, 7, 8, True)


def test_new_alignment_goes_through_triton_once():
    fn = _Jit()
    la = KernelLauncher(fn, (1,), static=(3,), options={})
    buf = torch.empty(64, dtype=torch.float16)
    assert buf.data_ptr() % 16 == 0
    la(buf, 1.0)
    la(buf[1:], 1.0)  # 2 bytes off: Triton would specialise differently
    la(buf[1:], 1.0)
    la(buf, 1.0)
    assert [e[0] for e in fn.log] == ["jit", "jit", "direct", "direct"]


def test_only_checked_positions_are_keyed_and_others_must_be_aligned():
    fn = _Jit()
    la = KernelLauncher(fn, (1,), static=(), options={}, check=(0,))
    buf = torch.empty(64, dtype=torch.float16)
    la(buf, _aligned())
    la(buf[1:], _aligned())
    assert [e[0] for e in fn.log] == ["jit", "jit"]
    la2 = KernelLauncher(_Jit(), (1,), static=(), options={}, check=(0,))
    with pytest.raises(ValueError, match="16-byte aligned"):
        la2(buf, buf[1:])


def test_dtype_change_is_refused_when_triton_binds():
    # the dtype is part of the caller's launcher key (not re-checked per call); when a call
    # goes through Triton's binding anyway, a changed dtype is an error, not a silent recompile
    fn = _Jit()
    la = KernelLauncher(fn, (1,), static=(), options={})
    la(torch.empty(64, dtype=torch.float16))
    with pytest.raises(TypeError, match="one launcher per dtype"):
        la(torch.empty(65, dtype=torch.float32)[1:])


def test_no_compiled_kernel_means_triton_every_time():
    fn = _Jit(compiled=False)  # what the interpreter returns
    la = KernelLauncher(fn, (2, 2, 2), static=(1,), options={})
    for _ in range(3):
        la(_aligned())
    assert [e[0] for e in fn.log] == ["jit"] * 3


class _NamedJit(_Jit):
    """A stand-in that declares its parameters and ``do_not_specialize`` list, as a JITFunction does."""

    def __init__(self, arg_names, do_not_specialize):
        super().__init__()
        self.arg_names, self.do_not_specialize = list(arg_names), list(do_not_specialize)


def test_per_call_ints_keep_one_binding():
    # a growing cache's key count rides with the tensors: one binding serves every value
    fn = _NamedJit(("X", "scale", "n", "BLOCK"), ("n",))
    la = KernelLauncher(fn, (1,), static=(64,), options={})
    x = _aligned()
    for n in (7, 16, 1, 300):  # 16 and 1 are the values Triton would specialise on
        la(x, 0.5, n)
    assert [e[0] for e in fn.log] == ["jit", "direct", "direct", "direct"]
    assert fn.log[-1][2] == (x, 0.5, 300, 64)


def test_per_call_int_past_int32_is_keyed():
    # Triton passes an int from 2^31 on as i64: a kernel compiled for i32 must not see it
    fn = _NamedJit(("X", "n"), (1,))
    la = KernelLauncher(fn, (1,), static=(), options={})
    x = _aligned()
    for n in (5, 2**31, 2**31 + 7, 6, -(2**31) - 1, 2**63):
        la(x, n)
    assert [e[0] for e in fn.log] == ["jit", "jit", "direct", "direct", "direct", "jit"]  # i32, i64, u64


def test_specialised_per_call_int_is_refused():
    fn = _NamedJit(("X", "n", "m"), ("m",))
    la = KernelLauncher(fn, (1,), static=(), options={})
    with pytest.raises(ValueError, match=r"\['n'\].*do_not_specialize"):
        la(_aligned(), 3, 4)


def test_real_kernels_do_not_specialise_their_per_call_ints():
    """The FA2 forward's and the decode kernel's per-call ints (what a growing cache changes) are
    ``do_not_specialize`` (else one kept kernel would be wrong for other values)."""
    import inspect

    from flashtile.kernels.fa2_fwd import _fa2_fwd_kernel
    from flashtile.runtime.decode import SPLIT_DYNAMIC, _decode_split_kernel

    def unspecialised(kernel):
        while not hasattr(kernel, "do_not_specialize") and not hasattr(kernel, "kwargs"):
            kernel = kernel.fn
        dns = getattr(kernel, "do_not_specialize", None) or kernel.kwargs["do_not_specialize"]
        names = list(inspect.signature(kernel.fn).parameters)
        return names, {names[i] if isinstance(i, int) else i for i in dns}

    names, dns = unspecialised(_fa2_fwd_kernel)
    per_call = names[names.index("dropout_p") + 1:names.index("stride_qb")]
    assert per_call == ["stride_kb", "stride_kh", "stride_vb", "stride_vh", "seqlen_k", "tune_nk"]
    assert set(per_call) <= dns
    names, dns = unspecialised(_decode_split_kernel)
    per_call = list(SPLIT_DYNAMIC[SPLIT_DYNAMIC.index("hi2") + 1:])
    assert per_call == names[names.index("hi2") + 1:names.index("stride_qb")] and set(per_call) <= dns


def test_grid_rank_is_checked():
    with pytest.raises(ValueError, match="grid"):
        KernelLauncher(_Jit(), (), static=(), options={})


@pytest.mark.gpu
def test_gpu_direct_launch_matches_triton_launch():
    """A real kernel through the launcher (first call via Triton, then direct, then a misaligned input)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    import triton
    import triton.language as tl

    @triton.jit
    def axpy(X, Y, Out, a, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(X + offs, mask=ok)
        y = tl.load(Y + offs, mask=ok)
        tl.store(Out + offs, a * x + y, mask=ok)

    n = 1000
    la = KernelLauncher(axpy, (triton.cdiv(n, 128),), static=(n, 128), options={"num_warps": 4}, check=(0, 1))
    for offset in (0, 0, 1, 1, 0):
        xb = torch.randn(n + 8, device="cuda")
        y = torch.randn(n, device="cuda")
        x = xb[offset : offset + n]
        out = torch.full((n,), float("nan"), device="cuda")
        la(x, y, out, 1.5)
        torch.testing.assert_close(out, 1.5 * x + y, rtol=0, atol=1e-6)
    assert len(la._runners[torch.cuda.current_device()]) == 2  # one compiled launch per alignment


def test_launch_passes_programmatic_dependent_launch_option():
    from flashtile.runtime.launch import launch

    for bind in (True, False):
        fn = _Jit()
        launch(fn, (2,), (_aligned(),), (5,), num_warps=4, num_stages=2, bind=bind, pdl=True)
        launch(fn, (2,), (_aligned(),), (5,), num_warps=4, num_stages=2, bind=bind)
        assert fn.log[0][3] == {"num_warps": 4, "num_stages": 2, "launch_pdl": True}
        assert fn.log[1][3] == {"num_warps": 4, "num_stages": 2}  # a separate launcher, without it


def test_no_dependent_launch_off_the_gpu():
    from flashtile.runtime.common import pdl_supported

    assert pdl_supported("cpu") is False


def test_compiled_launches_are_kept_per_current_device(monkeypatch):
    """A compiled kernel is loaded into the current device's context: a launcher that has bound on
    device 0 binds again (through Triton) when device 1 is current, and keeps one entry per device."""
    import flashtile.runtime.launch as launch_module

    current = [0]
    monkeypatch.setattr(launch_module, "_current_device", lambda: current[0])
    fn = _Jit()
    la = KernelLauncher(fn, (1,), static=(), options={})
    buf = torch.empty(64, dtype=torch.float16)
    la(buf, 1.0)
    la(buf, 1.0)
    current[0] = 1
    la(buf, 1.0)
    la(buf, 1.0)
    la(buf[1:], 1.0)  # a second alignment on device 1 must not be launched from device 0's entries
    current[0] = 0
    la(buf, 1.0)
    la(buf[1:], 1.0)
    assert [e[0] for e in fn.log] == ["jit", "direct", "jit", "direct", "jit", "direct", "jit"]
    assert sorted(la._runners) == [0, 1]
    assert len(la._runners[0]) == 2 and len(la._runners[1]) == 2


def test_bound_launchers_are_keyed_by_the_tensors_device():
    from flashtile.runtime.launch import _bound, launch

    fn = _Jit()
    _bound.cache_clear()
    launch(fn, (2,), (_aligned(),), (5,), num_warps=4, num_stages=2)
    launch(fn, (2,), (torch.empty(64, device="meta"),), (5,), num_warps=4, num_stages=2)
    assert _bound.cache_info().currsize == 2


def test_concurrent_first_calls_keep_every_entry(monkeypatch):
    """Threads binding different (device, alignment) keys at once: no entry is lost, every later call is direct."""
    import threading

    import flashtile.runtime.launch as launch_module

    local = threading.local()
    monkeypatch.setattr(launch_module, "_current_device", lambda: getattr(local, "device", 0))
    fn = _Jit()
    la = KernelLauncher(fn, (1,), static=(), options={})
    buf = torch.empty(64, dtype=torch.float16)
    barrier = threading.Barrier(8)
    errors = []

    def work(i):
        try:
            local.device = i % 4
            view = buf[i // 4 :]  # two alignments
            barrier.wait()
            for _ in range(50):
                la(view, float(i))
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(la._runners) == [0, 1, 2, 3] and all(len(r) == 2 for r in la._runners.values())
    jit_calls = sum(e[0] == "jit" for e in fn.log)
    assert jit_calls == 8 and len(fn.log) == 8 * 50  # one bind per (device, alignment), none lost


def test_per_call_int_past_the_parameters_is_refused():
    # more dynamic arguments than the kernel has parameters: the ValueError, not an IndexError
    fn = _NamedJit(("X", "n"), ("n",))
    la = KernelLauncher(fn, (1,), static=(), options={})
    with pytest.raises(ValueError, match=r"#2.*do_not_specialize"):
        la(_aligned(), 3, 4)
