"""Hopper forward kernel (kernels/fa3_fwd.py, runtime/fa3_fwd.py).

GPU tests (``pytest -m gpu``) need an sm_90 device.  On the CPU: the config
table, the wrapper's refusals, and the kernel itself through Triton's
interpreter (which runs ``tl.make_tensor_descriptor`` loads and stores and
ignores ``warp_specialize``) on fp16 tiles; bf16 is GPU-only here because the
interpreter's dot multiplies bf16 bit patterns (see ``_common.mma``).
"""

from __future__ import annotations

import pytest
import torch

from flashtile.kernels._common import LOG2E
from flashtile.runtime import fa3_fwd
from flashtile.runtime.fa3_fwd import SMEM_LIMIT, Fa3Config, fa3_config, fa3_forward, smem_bytes
from tests._oracle import assert_close, attention_ref

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")


def oracle(q, k, v, scale, causal):
    """tests/_oracle.py's float64 attention (bottom-right causal) on CPU copies of (B, H, N, d) views."""
    q, k, v = (x.detach().double().cpu() for x in (q, k, v))
    return attention_ref(q, k, v, scale=scale, causal=causal)


def assert_matches(out, lse, ref_out, ref_lse):
    """The shared tolerance table for out's dtype (LSE at fp32's), plus the exact conventions: no NaN
    (every row written), -inf LSE and an exact-zero output on rows with no allowed key."""
    assert not torch.isnan(out).any(), "NaN in out (unwritten rows?)"
    assert not torch.isnan(lse).any(), "NaN in lse (unwritten rows?)"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse.detach().cpu()), empty), "lse must be -inf exactly on rows with no key"
    assert (out.detach().cpu()[empty] == 0).all(), "rows with no allowed key must output exactly 0"
    assert_close(out, ref_out, out.dtype, out.device, "out")
    assert_close(lse, ref_lse, torch.float32, lse.device, "lse")


def qkv(b, hq, hk, nq, nk, d, dtype, device, seq_major=False, seed=0):
    """Fresh random inputs as (B, H, N, d) views; ``seq_major`` gives flash-attn's (B, N, H, d) storage."""
    g = torch.Generator().manual_seed(seed)

    def mk(h, n):
        x = torch.randn(b, n, h, d, generator=g) if seq_major else torch.randn(b, h, n, d, generator=g)
        x = x.to(device=device, dtype=dtype)
        return x.transpose(1, 2) if seq_major else x

    return mk(hq, nq), mk(hk, nk), mk(hk, nk)


# --------------------------------------------------------------------------- #
# CPU: config table and refusals (no launch)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("d", fa3_fwd.SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_config_fits_and_tiles(d, causal):
    cfg = fa3_config(d, causal, 4096, 4096)
    assert smem_bytes(cfg, d) <= SMEM_LIMIT
    assert cfg.block_m % 64 == 0 and cfg.block_n % 16 == 0 and cfg.block_m & (cfg.block_m - 1) == 0
    assert cfg.num_warps in (4, 8) and cfg.num_stages >= 1


def test_config_table_rows():
    assert fa3_config(128, False, 16384, 16384) == Fa3Config(128, 128, 4, 2, True)
    assert fa3_config(256, True, 4096, 4096) == Fa3Config(128, 64, 4, 2, True, o_tma=False)
    assert fa3_config(64, False, 4096, 4096) == Fa3Config(256, 128, 4, 2, True)
    assert fa3_config(64, True, 4096, 4096) == Fa3Config(128, 64, 8, 3, False)


def test_smem_estimate_matches_compile_reports():
    # Triton 3.6, sm_90a, bf16 (metadata.shared): the estimate is the report rounded up by < 1 KB
    for cfg, d, reported in [
        (Fa3Config(128, 128, 4, 2, True), 128, 197024),
        (Fa3Config(128, 64, 4, 1, True), 256, 197016),
        (Fa3Config(256, 128, 4, 2, True), 64, 131488),
        (Fa3Config(128, 128, 8, 3, False), 128, 230400),
        (Fa3Config(128, 64, 8, 3, False), 64, 66560),
        (Fa3Config(128, 64, 4, 2, True, o_tma=False), 256, 213280),
    ]:
        assert 0 <= smem_bytes(cfg, d) - reported <= 1024


def test_refuses_what_it_does_not_cover():
    q = torch.zeros(1, 1, 16, 64)
    with pytest.raises(NotImplementedError):
        fa3_forward(q, q, q, softmax_scale=0.125)  # fp32
    h = q.half()
    with pytest.raises(NotImplementedError):
        fa3_forward(h, h, h, softmax_scale=0.125)  # not an sm_90 CUDA device
    with pytest.raises(ValueError):
        fa3_forward(h[0], h[0], h[0], softmax_scale=0.125)  # not 4-D


# --------------------------------------------------------------------------- #
# CPU: the kernel through Triton's interpreter
# --------------------------------------------------------------------------- #
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: CPU tensors")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk,warp_spec", [(100, 100, False), (70, 45, True), (40, 90, False), (64, 64, True)])
def test_interpreter_kernel(causal, nq, nk, warp_spec):
    b, hq, hk, d = 2, 2, 1, 48  # GQA, head dim padded to 64 by the descriptor
    q, k, v = qkv(b, hq, hk, nq, nk, d, torch.float16, "cpu", seq_major=True)
    out = torch.full((b, nq, hq, d), float("nan"), dtype=torch.float16).transpose(1, 2)
    lse = torch.full((b, hq, nq), float("nan"))
    for o_tma in (True, False):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        fa3_fwd.launch(q, k, v, out, lse, d ** -0.5 * LOG2E, causal, Fa3Config(64, 32, 4, 1, warp_spec, o_tma))
        assert_matches(out, lse, *oracle(q, k, v, d ** -0.5, causal))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: CPU tensors")
@pytest.mark.parametrize("window,causal,softcap", [
    ((5, 3), False, 0.0), ((20, -1), False, 0.0), ((-1, 7), False, 0.0), ((9, 0), True, 0.0),
    ((-1, -1), False, 2.5), ((-1, 0), True, 1.5), ((12, 4), False, 3.0), ((0, 0), False, 0.0)])
@pytest.mark.parametrize("nq,nk,warp_spec", [(100, 100, False), (70, 45, True), (40, 90, False), (64, 130, True)])
def test_interpreter_window_and_softcap(window, causal, softcap, nq, nk, warp_spec):
    """A sliding window (both bounds, either alone, causal's (left, 0), the diagonal alone) and softcap through
    :func:`banded_args` and the kernel, against the float64 oracle: rows a window leaves empty (Nq > Nk with
    bottom-right alignment) output 0 and LSE -inf; both loop forms (warp-specialised: every tile masked)."""
    from flashtile.ops.validate import check_window

    b, hq, hk, d = 2, 2, 1, 48
    q, k, v = qkv(b, hq, hk, nq, nk, d, torch.float16, "cpu", seq_major=True, seed=nq + nk)
    scale = d ** -0.5
    left, right = check_window(causal, window)
    kernel_causal, kwin, caps, qk_scale = fa3_fwd.banded_args(left, right, softcap, scale, nq, nk)
    assert kernel_causal == (left == -1 and right == 0)
    for o_tma in (True, False):
        out = torch.full((b, nq, hq, d), float("nan"), dtype=torch.float16).transpose(1, 2)
        lse = torch.full((b, hq, nq), float("nan"))
        fa3_fwd.launch(q, k, v, out, lse, qk_scale, kernel_causal, Fa3Config(64, 32, 4, 1, warp_spec, o_tma),
                       window=kwin, softcap=caps)
        qd, kd, vd = (x.detach().double() for x in (q, k, v))
        assert_matches(out, lse, *attention_ref(qd, kd, vd, scale=scale, causal=causal, window=window,
                                                softcap=softcap))


def test_banded_args():
    """Bounds that cannot bind dropped; causal's window as the kernel's flag; softcap folded into the scores."""
    assert fa3_fwd.banded_args(-1, 0, 0.0, 0.5, 100, 100) == (True, (-1, -1), None, 0.5 * LOG2E)
    assert fa3_fwd.banded_args(200, 0, 0.0, 0.5, 100, 100) == (True, (-1, -1), None, 0.5 * LOG2E)  # left >= Nk
    assert fa3_fwd.banded_args(8, 0, 0.0, 0.5, 100, 100) == (False, (8, 0), None, 0.5 * LOG2E)
    assert fa3_fwd.banded_args(8, 500, 0.0, 0.5, 100, 100) == (False, (8, -1), None, 0.5 * LOG2E)  # right >= Nq
    assert fa3_fwd.banded_args(-1, -1, 4.0, 0.5, 10, 10) == (False, (-1, -1), (0.125, 4.0 * LOG2E), 1.0)
    with pytest.raises(ValueError, match="causal"):
        fa3_fwd.launch_args(*qkv(1, 1, 1, 8, 8, 16, torch.float16, "cpu"), torch.zeros(1, 1, 8, 16), True,
                            Fa3Config(64, 32, 4, 1, False), window=(3, 0))


# --------------------------------------------------------------------------- #
# GPU (sm_90)
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(512, 512), (333, 517), (517, 200), (1, 300), (1000, 1000)])
def test_matches_float64(d, causal, nq, nk):
    q, k, v = qkv(2, 4, 2, nq, nk, d, torch.bfloat16, "cuda", seq_major=True, seed=d + nq)
    out = torch.full((2, nq, 4, d), float("nan"), dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    o, lse = fa3_forward(q, k, v, softmax_scale=d ** -0.5, causal=causal, out=out)
    assert o is out
    assert_matches(o, lse, *oracle(q, k, v, d ** -0.5, causal))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("window,causal,softcap", [((256, 0), False, 0.0), ((300, 100), False, 0.0),
                                                   ((-1, -1), False, 30.0), ((-1, 0), True, 50.0),
                                                   ((128, 0), True, 20.0)])
@pytest.mark.parametrize("nq,nk", [(1000, 1000), (333, 517), (517, 200)])
def test_gpu_window_and_softcap_match_float64(d, window, causal, softcap, nq, nk):
    """``fa3_forward`` with a sliding window and / or softcap (the Triton kernel, warp-specialised where its
    table says) against the float64 oracle; rows a window leaves empty output 0, LSE -inf."""
    q, k, v = qkv(2, 4, 2, nq, nk, d, torch.bfloat16, "cuda", seq_major=True, seed=d + nq + nk)
    out = torch.full((2, nq, 4, d), float("nan"), dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    o, lse = fa3_forward(q, k, v, softmax_scale=d ** -0.5, causal=causal, out=out, window_size=window,
                         softcap=softcap)
    qd, kd, vd = (x.detach().double().cpu() for x in (q, k, v))
    assert_matches(o, lse, *attention_ref(qd, kd, vd, scale=d ** -0.5, causal=causal, window=window,
                                          softcap=softcap))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fp16_and_bhnd_layout(d, causal):
    q, k, v = qkv(1, 3, 3, 384, 640, d, torch.float16, "cuda", seed=d)
    o, lse = fa3_forward(q, k, v, softmax_scale=0.3, causal=causal)
    assert o.dtype == torch.float16 and lse.shape == (1, 3, 384)
    assert_matches(o, lse, *oracle(q, k, v, 0.3, causal))


@pytest.mark.gpu
@hopper
def test_negative_and_zero_scale():
    q, k, v = qkv(1, 2, 2, 200, 200, 128, torch.bfloat16, "cuda", seed=1)
    for scale in (-0.2, 0.0):
        o, lse = fa3_forward(q, k, v, softmax_scale=scale)
        assert_matches(o, lse, *oracle(q, k, v, scale, False))


@pytest.mark.gpu
@hopper
def test_empty_keys_and_queries():
    q, k, v = qkv(1, 2, 2, 10, 0, 64, torch.bfloat16, "cuda")
    o, lse = fa3_forward(q, k, v, softmax_scale=0.125)
    assert (o == 0).all() and torch.isneginf(lse).all()
    q, k, v = qkv(1, 2, 2, 0, 10, 64, torch.bfloat16, "cuda")
    o, lse = fa3_forward(q, k, v, softmax_scale=0.125)
    assert o.shape == (1, 2, 0, 64) and lse.shape == (1, 2, 0)


@pytest.mark.gpu
@hopper
def test_many_heads_one_grid_axis():
    # B * H = 70000 > 65535: the grid folds everything into axis 0
    q, k, v = qkv(70000, 1, 1, 16, 16, 64, torch.bfloat16, "cuda")
    o, lse = fa3_forward(q, k, v, softmax_scale=0.125, causal=True)
    ref_o, ref_lse = oracle(q[-50:], k[-50:], v[-50:], 0.125, True)
    assert_matches(o[-50:], lse[-50:], ref_o, ref_lse)


# --------------------------------------------------------------------------- #
# dispatch from the public ops (CPU: no launch)
# --------------------------------------------------------------------------- #
def test_hopper_wins_follows_the_measured_table():
    from flashtile.runtime.fa3_fwd import hopper_wins

    assert not hopper_wins(32, True, 16384) and not hopper_wins(16, False, 16384)  # d <= 32: FA2
    assert hopper_wins(64, False, 2048) and not hopper_wins(64, False, 1024) and hopper_wins(48, False, 4096)
    assert hopper_wins(64, True, 8192) and hopper_wins(48, True, 4096) and not hopper_wins(64, True, 4095)
    assert hopper_wins(128, False, 1024) and hopper_wins(96, False, 4096)
    assert not hopper_wins(128, True, 1023) and hopper_wins(128, True, 1024) and hopper_wins(96, True, 1024)
    # a packed batch's grid has no dynamic scheduler: d = 128 causal from 2k keys there, the rest unchanged
    assert not hopper_wins(128, True, 2047, packed=True) and hopper_wins(128, True, 2048, packed=True)
    assert hopper_wins(96, True, 1024, packed=True) and hopper_wins(128, False, 1024, packed=True)
    assert not hopper_wins(80, True, 1023) and hopper_wins(112, True, 1024) and hopper_wins(72, False, 1024)
    assert hopper_wins(256, True, 1024) and hopper_wins(192, False, 1024)
    assert not hopper_wins(100, False, 4096)  # not a multiple of 8: no tensor descriptor


def test_gluon_covers_head_dims_above_32_to_256(monkeypatch):
    """The Gluon kernel's range (measured at 64, 96, 128, 192 and 256; the dims between share those tile widths,
    but 200-248: unmeasured, on the Triton kernel)."""
    from flashtile.runtime.fa3_fwd import use_gluon

    assert all(use_gluon(d, c) for d in (40, 64, 72, 96, 128, 136, 192, 256) for c in (False, True))
    assert not any(use_gluon(d, False) for d in (8, 16, 24, 32, 200, 248))
    monkeypatch.setattr(fa3_fwd, "GLUON", False)
    assert not use_gluon(128, False)


def test_prefer_hopper_gates():
    """Only plain (no softcap/ALiBi/bias/dropout/block mask), unbounded-or-causal, fp16/bf16 CUDA calls;
    a CPU tensor never dispatches, whatever the capability claimed."""
    from flashtile.runtime import fa3_fwd

    q = torch.empty(1, 2, 16384, 256, dtype=torch.bfloat16)
    kw = dict(causal=False, window=(-1, -1), plain=True, capability=(9, 0))
    assert not fa3_fwd.prefer_hopper(q, q, q, **kw)  # CPU
    assert not fa3_fwd.prefer_hopper(q, q, q, **(kw | dict(plain=False)))
    assert not fa3_fwd.prefer_hopper(q, q, q, **(kw | dict(window=(128, 0))))


@pytest.mark.gpu
def test_gpu_public_op_dispatches_to_hopper_and_matches(monkeypatch):
    """flash_attn_func at d = 256 runs the Gluon Hopper forward on an sm_90 GPU (``use_gluon``), then the
    backward: out, LSE and gradients match the float64 oracle."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    from flashtile import flash_attn_func
    from flashtile.runtime import fa3_fwd
    from tests._oracle import assert_close, attention_ref_grads, rounding_slack

    from flashtile.runtime import fa3_gluon

    calls = []
    for module, name in ((fa3_fwd, "launch"), (fa3_gluon, "gluon_launch")):  # the Triton and Gluon kernels
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **k: (calls.append(name), real(*a, **k)))
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v, dout = (torch.randn(2, 1000, 4, 256, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    f64 = [x.double().transpose(1, 2) for x in (q, k, v, dout)]
    for causal in (False, True):
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out, lse = flash_attn_func(qg, kg, vg, causal=causal, return_lse=True)
        out.backward(dout)
        assert calls == ["gluon_launch"], f"the Gluon forward was not used: {calls}"
        calls.clear()
        ref, ref_lse, dq, dk, dv = attention_ref_grads(*f64, scale=256 ** -0.5, causal=causal)
        slack = rounding_slack(*f64, torch.bfloat16, scale=256 ** -0.5, causal=causal)
        assert_close(out.transpose(1, 2), ref, what="out")
        assert_close(lse, ref_lse, torch.bfloat16, what="lse")
        size = max(float(g.abs().max()) for g in (dq, dk, dv))
        for name, g, r, extra in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), (dq, dk, dv), slack):
            assert_close(g.transpose(1, 2), r, what=name, magnitude=size, slack=extra)


@pytest.mark.gpu
def test_gpu_hopper_path_in_graphs_compile_and_inference_mode():
    """The Hopper forward behind flash_attn_func replays in a CUDA graph (its descriptor scratch comes from the
    caching allocator, graph-safe), traces under torch.compile and runs under inference_mode: every result
    equals the eager call's bits."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    from flashtile import flash_attn_func
    from tests._cuda import capture

    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 2048, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    assert fa3_fwd.prefer_hopper(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=False,
                                 window=(-1, -1), plain=True)
    eager = flash_attn_func(q, k, v)
    graph, static = capture(lambda: flash_attn_func(q, k, v))
    q2 = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=gen)
    q.copy_(q2)
    graph.replay()
    assert torch.equal(static, flash_attn_func(q2, k, v))
    compiled = torch.compile(lambda a, b, c: flash_attn_func(a, b, c), fullgraph=True)
    assert torch.equal(compiled(q, k, v), flash_attn_func(q, k, v))
    with torch.inference_mode():
        assert torch.equal(flash_attn_func(q, k, v), static)
    assert not torch.equal(eager, static)  # the replay saw the new q


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: CPU tensors")
@pytest.mark.parametrize("gluon", [False, True])
def test_interpreter_host_path(monkeypatch, gluon):
    """fa3_forward's host steps (outputs, empty cases, the sign of the scale, the Gluon/Triton choice) on the
    CPU: the device check is lifted and the Gluon launch replaced by the Triton kernel with the same
    arguments, both through the interpreter."""
    import contextlib

    from flashtile.runtime import fa3_gluon

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(fa3_fwd, "_check", lambda *a: None)
    monkeypatch.setattr(fa3_fwd, "ensure_allocator", lambda: None)
    monkeypatch.setattr(fa3_fwd, "fa3_config", lambda d, causal, nq, nk: Fa3Config(64, 32, 4, 1, False))
    monkeypatch.setattr(fa3_fwd, "use_gluon", lambda d, causal: gluon)
    launched = []

    def triton_instead(q, k, v, out, lse, scale, causal, cfg):
        launched.append(scale)
        fa3_fwd.launch(q, k, v, out, lse, scale * LOG2E, causal, Fa3Config(64, 32, 4, 1, False))

    monkeypatch.setattr(fa3_gluon, "gluon_launch", triton_instead)
    q, k, v = qkv(1, 2, 1, 70, 45, 32, torch.float16, "cpu")
    for scale in (0.3, -0.3, 0.0):
        out, lse = fa3_forward(q, k, v, softmax_scale=scale, causal=True)
        assert_matches(out, lse, *oracle(q, k, v, scale, True))
    assert len(launched) == (3 if gluon else 0) and all(s > 0 for s in launched)
    out, lse = fa3_forward(q, k[:, :, :0], v[:, :, :0], softmax_scale=0.3)
    assert (out == 0).all() and torch.isneginf(lse).all()
    with pytest.raises(ValueError, match="out must have"):
        fa3_forward(q, k, v, softmax_scale=0.3, out=torch.empty(1, 2, 70, 16, dtype=torch.float16))
