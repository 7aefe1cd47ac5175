"""FP8 attention forward: ``flash_attn_func`` with float8_e4m3fn q, k, v and descales (ops/fp8_attn.py,
the FP8 mode of kernels/fa3_fwd.py).

Tolerances.  The kernel against its float64 twin (:func:`flashtile.reference.fp8.fp8_attention`, which
simulates the e4m3 rounding of P~ with the kernel's own key tile): through Triton's interpreter the
simulation is exact up to the bf16 output (bf16's 1e-2 row of the table).  On an H100 the tensor
cores' FP8 accumulation (not IEEE fp32: partial sums keep fewer mantissa bits) moves scores by ~1e-4,
enough to flip a few P~ roundings: measured max error 1.3-2.7% of max|out|, RMSE 3-6e-4 against the
twin on 500-row blocks, up to 3.4e-3 of max|out| on single rows; FA3's FP8 kernel measured 1.6-2.6%,
RMSE ~2e-3 against the same twin (bench/NOTES.md, "FP8 forward").  So 3e-2 of max|out| elementwise,
and RMSE <= 4e-3 of it plus twice the bf16 output's own rounding.  The dequantised fallback (FA2
kernel in fp32) is exact attention of the dequantised inputs: the fp32 / tf32 rows of the table.
"""

from __future__ import annotations

import pytest
import torch

import flashtile
from flashtile.fp8 import quantize_per_head
from flashtile.kernels._common import LOG2E
from flashtile.reference.fp8 import fp8_attention
from flashtile.runtime import fa3_fwd
from flashtile.runtime.decode import error_flags
from flashtile.runtime.fa3_fwd import Fa3Config
from tests._oracle import assert_close, attention_ref

FP8 = torch.float8_e4m3fn
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def quantised(b, hq, hk, nq, nk, d, device, seed=0):
    """Fresh N(0, 1) inputs quantised per (batch, kv head), in the flash layout (B, N, H, d)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, h, d, generator=g).to(device) for n, h in ((nq, hq), (nk, hk), (nk, hk)))
    q8, qs = quantize_per_head(q, layout="bnhd", kv_heads=hk)
    k8, ks = quantize_per_head(k, layout="bnhd")
    v8, vs = quantize_per_head(v, layout="bnhd")
    return q8, k8, v8, qs, ks, vs


def twin(q8, k8, v8, qs, ks, vs, causal, block_sizes=(128, 128), p_dtype=FP8):
    """The float64 FP8 twin on CPU copies, (B, H, N, d) in and out."""
    args = [x.transpose(1, 2).cpu() for x in (q8, k8, v8)] + [x.cpu() for x in (qs, ks, vs)]
    return fp8_attention(*args, causal=causal, block_sizes=block_sizes, p_dtype=p_dtype)


def dequantised(x8, ds):
    """(B, N, H, d) e4m3 times its (B, Hk) descale, float64 (B, H, N, d) for the oracle."""
    h, hk = x8.shape[2], ds.shape[1]
    x = x8.double().cpu() * ds.double().cpu().repeat_interleave(h // hk, dim=1)[:, None, :, None]
    return x.transpose(1, 2)


def assert_fp8_close(out, ref_out, what):
    """Elementwise 3e-2 of max|ref| and RMSE <= 4e-3 of it beyond the output's bf16 rounding (module docstring)."""
    out = out.double().cpu()
    scale = ref_out.abs().max().item()
    err = (out - ref_out).abs()
    assert not torch.isnan(out).any(), f"{what}: NaN"
    assert err.max().item() <= 3e-2 * scale, f"{what}: max error {err.max().item() / scale:.4f} of max|ref|"
    rmse = err.pow(2).mean().sqrt().item()
    # plus twice the RMSE that rounding the exact result to the bf16 output alone causes (small rows)
    floor = (ref_out.to(torch.bfloat16).double() - ref_out).pow(2).mean().sqrt().item()
    assert rmse <= 4e-3 * scale + 2 * floor, f"{what}: RMSE {rmse / scale:.2e} of max|ref| (bf16 floor {floor:.2e})"


# --------------------------------------------------------------------------- #
# CPU: the FP8 kernel through the interpreter, the API and its errors
# --------------------------------------------------------------------------- #
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: CPU tensors")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(70, 90), (90, 33)])
def test_interpreter_kernel_matches_twin(causal, nq, nk):
    b, hq, hk, d = 2, 2, 1, 32
    q8, k8, v8, qs, ks, vs = quantised(b, hq, hk, nq, nk, d, "cpu", seed=nq)
    qb, kb = q8.transpose(1, 2), k8.transpose(1, 2)
    vt = torch.zeros(b, hk, d, -(-nk // 16) * 16, dtype=FP8)
    vt[..., :nk] = v8.permute(0, 2, 3, 1)
    out = torch.full((b, hq, nq, d), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((b, hq, nq), float("nan"))
    err = torch.zeros(1, dtype=torch.int32)
    cfg = Fa3Config(64, 32, 4, 1, False)
    fa3_fwd.launch(qb, kb, vt, out, lse, d ** -0.5 * LOG2E, causal, cfg, descales=(qs, ks, vs), err=err)
    ref = twin(q8, k8, v8, qs, ks, vs, causal, block_sizes=(cfg.block_m, cfg.block_n))
    assert_close(out, ref.out, torch.bfloat16, "cpu", "out")
    assert_close(lse, ref.lse, torch.float32, "cpu", "lse")
    assert int(err) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: CPU tensors")
def test_interpreter_host_path(monkeypatch):
    """fa3_forward_fp8's host steps (V transposed and padded, outputs, the error word's slot, empty keys) on
    the CPU, with the device context and descriptor allocator lifted and the table's tile replaced."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(fa3_fwd, "ensure_allocator", lambda: None)
    monkeypatch.setattr(fa3_fwd, "fa3_fp8_config", lambda d, causal: Fa3Config(64, 32, 4, 1, False))
    q8, k8, v8, qs, ks, vs = quantised(1, 2, 1, 50, 37, 32, "cpu", seed=8)
    qb, kb, vb = (x.transpose(1, 2) for x in (q8, k8, v8))
    out, lse = fa3_fwd.fa3_forward_fp8(qb, kb, vb, (qs, ks, vs), softmax_scale=32 ** -0.5, causal=True)
    ref = twin(q8, k8, v8, qs, ks, vs, True, block_sizes=(64, 32))
    assert out.dtype == torch.bfloat16
    assert_close(out, ref.out, torch.bfloat16, "cpu", "out")
    assert_close(lse, ref.lse, torch.float32, "cpu", "lse")
    out, lse = fa3_fwd.fa3_forward_fp8(qb, kb[:, :, :0], vb[:, :, :0], (qs, ks, vs), softmax_scale=0.2)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: CPU tensors")
def test_interpreter_bad_descale_flags_and_zeroes_its_head():
    b, hq, hk, nq, nk, d = 1, 2, 2, 40, 40, 32
    q8, k8, v8, qs, ks, vs = quantised(b, hq, hk, nq, nk, d, "cpu", seed=3)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        ks_bad = ks.clone()
        ks_bad[0, 1] = bad
        vt = torch.zeros(b, hk, d, 48, dtype=FP8)
        vt[..., :nk] = v8.permute(0, 2, 3, 1)
        out = torch.full((b, hq, nq, d), float("nan"), dtype=torch.bfloat16)
        lse = torch.full((b, hq, nq), float("nan"))
        flashtile.check_errors()  # clear the record
        fa3_fwd.launch(q8.transpose(1, 2), k8.transpose(1, 2), vt, out, lse, d ** -0.5 * LOG2E, False,
                       Fa3Config(64, 32, 4, 1, False), descales=(qs, ks_bad, vs),
                       err=error_flags(torch.device("cpu"))[1:])
        assert (out[:, 1] == 0).all() and torch.isneginf(lse[:, 1]).all()
        ref = twin(q8, k8, v8, qs, ks, vs, False, block_sizes=(64, 32))
        assert_close(out[:, 0], ref.out[:, 0], torch.bfloat16, "cpu", "the other head")
        with pytest.raises(ValueError, match="q_descale \\* k_descale"):
            flashtile.check_errors()


def test_api_fallback_is_exact_attention_of_dequantised_inputs():
    """Off Hopper (here: the CPU) flash_attn_func runs FA2 on the dequantised inputs: bf16 out, and
    every feature the FP8 kernel lacks (window, softcap, GQA, ALiBi) works."""
    q8, k8, v8, qs, ks, vs = quantised(2, 4, 2, 33, 47, 16, DEV, seed=1)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEV)
    for kw in (dict(causal=True), dict(window_size=(5, 3), softcap=4.0), dict(alibi_slopes=slopes)):
        out, lse = flashtile.flash_attn_func(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs,
                                             return_lse=True, **kw)
        assert out.dtype == torch.bfloat16 and out.shape == q8.shape
        ref, ref_lse = attention_ref(
            dequantised(q8, qs), dequantised(k8, ks), dequantised(v8, vs), causal=kw.get("causal", False),
            window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0), alibi=kw.get("alibi_slopes"),
        )
        assert_close(out.transpose(1, 2), ref, torch.bfloat16, DEV, f"out {kw}")
        assert_close(lse, ref_lse, torch.float32, DEV, f"lse {kw}")


def test_api_descales_default_to_one_and_broadcast():
    q8, k8, v8, qs, ks, vs = quantised(2, 2, 2, 20, 20, 16, DEV, seed=2)
    one = torch.ones((), device=DEV)
    a = flashtile.flash_attn_func(q8, k8, v8)
    b = flashtile.flash_attn_func(q8, k8, v8, q_descale=one, k_descale=one.expand(2, 2), v_descale=None)
    assert torch.equal(a, b)
    c = flashtile.flash_attn_func(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs)
    d = flashtile.flash_attn_func(q8, k8, v8, q_descale=qs.t().contiguous().t(), k_descale=ks, v_descale=vs)
    assert torch.equal(c, d)  # a non-contiguous (B, Hk) descale is read at its strides


def test_api_errors_name_the_argument():
    q8, k8, v8, qs, ks, vs = quantised(2, 4, 2, 8, 8, 16, DEV, seed=4)
    bf = q8.to(torch.bfloat16)
    cases = [
        (TypeError, "k must be float8_e4m3fn", lambda: flashtile.flash_attn_func(q8, k8.to(torch.bfloat16), v8)),
        (TypeError, "q_descale must be float32", lambda: flashtile.flash_attn_func(q8, k8, v8, q_descale=qs.double())),
        (ValueError, "v_descale must have shape", lambda: flashtile.flash_attn_func(q8, k8, v8, v_descale=vs[:1, :1].expand(2, 1).repeat(1, 3))),
        (TypeError, "k_descale must be a torch.Tensor", lambda: flashtile.flash_attn_func(q8, k8, v8, k_descale=1.0)),
        (ValueError, "q_descale is for float8_e4m3fn", lambda: flashtile.flash_attn_func(bf, bf, bf, q_descale=qs)),
        (ValueError, "dropout_p must be 0", lambda: flashtile.flash_attn_func(q8, k8, v8, dropout_p=0.1)),
        (ValueError, "return_attn_probs", lambda: flashtile.flash_attn_func(q8, k8, v8, return_attn_probs=True)),
        (ValueError, "head_dim of k", lambda: flashtile.flash_attn_func(q8, k8[..., :8], v8[..., :8])),
    ]
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="q_descale must be on"):
            flashtile.flash_attn_func(q8, k8, v8, q_descale=qs.cpu())


def test_api_fp8_is_forward_only():
    q8, k8, v8, *_ = quantised(1, 2, 2, 8, 8, 16, DEV, seed=5)
    q8.requires_grad_(True)
    with pytest.raises(ValueError, match="forward only"):
        flashtile.flash_attn_func(q8, k8, v8)
    with torch.no_grad():
        assert flashtile.flash_attn_func(q8, k8, v8).dtype == torch.bfloat16


# --------------------------------------------------------------------------- #
# GPU (sm_90): the FP8 kernel
# --------------------------------------------------------------------------- #
def assert_kernel_matches_twin(d, causal, nq, nk, seed):
    """flash_attn_func on fresh e4m3 inputs (B 2, Hq 4, Hk 2) against the FP8 twin with the kernel's tiles."""
    q8, k8, v8, qs, ks, vs = quantised(2, 4, 2, nq, nk, d, "cuda", seed=seed)
    out, lse = flashtile.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs,
                                         return_lse=True)
    ref = twin(q8, k8, v8, qs, ks, vs, causal, block_sizes=fa3_fwd.fp8_block_sizes(d, causal, nk))
    assert_fp8_close(out.transpose(1, 2), ref.out, f"d={d} causal={causal} {nq}x{nk}")
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref.lse))
    # scores move by the tensor cores' FP8 accumulation (module docstring): LSE within 2e-3
    assert_close(lse, ref.lse, torch.float32, "cuda", "lse", tol=2e-3)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_kernel_matches_twin(d, causal, monkeypatch):
    calls = []
    real = fa3_fwd.fa3_forward_fp8
    monkeypatch.setattr(fa3_fwd, "fa3_forward_fp8", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for nq, nk in ((1, 1), (1, 300), (333, 517), (517, 200), (1024, 1024)):
        assert_kernel_matches_twin(d, causal, nq, nk, seed=d + nq + nk)
    assert len(calls) == 5, "every shape must run the FP8 kernel, not the dequantised fallback"


def test_gluon_fp8_dispatch(monkeypatch):
    """The Gluon FP8 kernel where it measured at least as fast (tile widths 64 and 128; 256 when causal), the
    Triton one elsewhere and with GLUON_FP8 off."""
    assert fa3_fwd.use_gluon_fp8(128, True) and fa3_fwd.use_gluon_fp8(96, False)
    assert fa3_fwd.use_gluon_fp8(64, True) and fa3_fwd.use_gluon_fp8(48, False)
    assert fa3_fwd.use_gluon_fp8(256, True) and fa3_fwd.use_gluon_fp8(160, True)
    assert not fa3_fwd.use_gluon_fp8(256, False) and not fa3_fwd.use_gluon_fp8(32, True)
    monkeypatch.setattr(fa3_fwd, "GLUON_FP8", False)
    assert not fa3_fwd.use_gluon_fp8(128, True)
    assert fa3_fwd.fp8_block_sizes(128, True, 4096) == (128, fa3_fwd.fa3_fp8_config(128, True).block_n)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [48, 64, 128, 160, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gluon_fp8_every_width(d, causal, monkeypatch):
    """The Gluon FP8 kernel at every width it covers, dispatched or not (forced here), against the twin:
    ragged and GQA shapes, the dynamic causal scheduler from 2k keys, a key count past a 32-key chunk."""
    monkeypatch.setattr(fa3_fwd, "use_gluon_fp8", lambda d, causal: True)
    flashtile.check_errors()  # clear the record
    for nq, nk in ((1, 1), (333, 517), (517, 70), (2100, 2100)):
        assert_kernel_matches_twin(d, causal, nq, nk, seed=d + nq)
    flashtile.check_errors()  # valid descales: nothing recorded


@pytest.mark.gpu
@hopper
def test_gpu_long_rows_and_layouts():
    """N = 8k keys (64 key tiles), a (B, H, N, d)-storage view for q, and a non-contiguous v."""
    q8, k8, v8, qs, ks, vs = quantised(1, 2, 1, 8192, 8192, 128, "cuda", seed=9)
    q_view = q8.transpose(1, 2).contiguous().transpose(1, 2)
    v_view = torch.empty(1, 8192, 1, 256, dtype=FP8, device="cuda")[..., :128]
    v_view.copy_(v8)
    for causal in (False, True):
        out = flashtile.flash_attn_func(q_view, k8, v_view, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs)
        rows = slice(8192 - 512, 8192)
        ref = twin(q8[:, rows], k8, v8, qs, ks, vs, causal, block_sizes=fa3_fwd.fp8_block_sizes(128, causal, 8192))
        assert_fp8_close(out[:, rows].transpose(1, 2), ref.out, f"causal={causal}")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d,causal,n,which,value", [
    (128, False, 300, 0, -2.0), (64, False, 300, 1, float("nan")), (128, True, 2100, 0, float("inf")),
    (256, True, 300, 2, float("nan")), (32, True, 300, 1, 0.0), (256, False, 300, 2, float("-inf")),
])
def test_gpu_bad_descale_is_reported_not_nan(d, causal, n, which, value):
    """A bad descale of one (batch, kv head) zeroes that head's rows (GQA: both of its q heads) and sets the
    error word, in each kernel and grid: Gluon one program per tile (d = 64, three warpgroups), persistent
    (128), dynamic causal (128 from 2k keys, 256), and the Triton kernel (32, 256 without a mask)."""
    q8, k8, v8, qs, ks, vs = quantised(2, 4, 2, n, n, d, "cuda", seed=11 + d)
    flashtile.check_errors()
    descales = [qs, ks, vs]
    bad = descales[which].clone()
    bad[1, 0] = value
    descales[which] = bad
    names = ("q_descale", "k_descale", "v_descale")
    out = flashtile.flash_attn_func(q8, k8, v8, causal=causal, **dict(zip(names, descales)))
    assert not out.isnan().any() and (out[1, :, :2] == 0).all()  # kv head 0 of batch 1: q heads 0 and 1
    with pytest.raises(ValueError, match="descale"):
        flashtile.check_errors()
    good = flashtile.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs)
    assert torch.equal(out[0], good[0]) and torch.equal(out[1, :, 2:], good[1, :, 2:])
    flashtile.check_errors()  # nothing recorded by the good call


@pytest.mark.gpu
@hopper
def test_gpu_graphs_compile_inference_mode():
    from tests._cuda import capture

    q8, k8, v8, qs, ks, vs = quantised(2, 4, 2, 1000, 1000, 128, "cuda", seed=12)

    def call():
        return flashtile.flash_attn_func(q8, k8, v8, causal=True, q_descale=qs, k_descale=ks, v_descale=vs)

    eager = call()
    with torch.inference_mode():
        assert torch.equal(call(), eager)
    compiled = torch.compile(call, fullgraph=True)
    assert torch.equal(compiled(), eager)
    graph, out = capture(call)
    q8.copy_(quantised(2, 4, 2, 1000, 1000, 128, "cuda", seed=13)[0])
    graph.replay()
    assert torch.equal(out, call())


@pytest.mark.gpu
@hopper
def test_gpu_fallback_head_dims_and_features():
    """d = 72 (not a multiple of 16) and softcap run dequantised on the FA2 kernel."""
    q8, k8, v8, qs, ks, vs = quantised(2, 4, 2, 200, 260, 72, "cuda", seed=14)
    out = flashtile.flash_attn_func(q8, k8, v8, causal=True, q_descale=qs, k_descale=ks, v_descale=vs)
    ref, _ = attention_ref(dequantised(q8, qs), dequantised(k8, ks), dequantised(v8, vs), causal=True)
    assert_close(out.transpose(1, 2), ref, torch.bfloat16, "cuda", "d=72")
    q8, k8, v8, qs, ks, vs = quantised(2, 4, 2, 200, 260, 128, "cuda", seed=15)
    out = flashtile.flash_attn_func(q8, k8, v8, softcap=5.0, q_descale=qs, k_descale=ks, v_descale=vs)
    ref, _ = attention_ref(dequantised(q8, qs), dequantised(k8, ks), dequantised(v8, vs), softcap=5.0)
    assert_close(out.transpose(1, 2), ref, torch.bfloat16, "cuda", "softcap")


def test_api_fallback_flags_bad_descales_like_the_kernel():
    """The dequantised path applies the Hopper kernel's descale rule: a q*k descale not in (0, inf) or a
    non-finite v descale zeroes that kv head's q heads (LSE -inf), leaves the others exact, and is reported."""
    q8, k8, v8, qs, ks, vs = quantised(2, 4, 2, 12, 12, 16, DEV, seed=6)
    good = flashtile.flash_attn_func(q8, k8, v8, causal=True, q_descale=qs, k_descale=ks, v_descale=vs)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        flashtile.check_errors()
        qs_bad = qs.clone()
        qs_bad[1, 0] = bad
        out, lse = flashtile.flash_attn_func(q8, k8, v8, causal=True, q_descale=qs_bad, k_descale=ks, v_descale=vs,
                                             return_lse=True)
        assert (out[1, :, :2] == 0).all() and torch.isneginf(lse[1, :2]).all()
        assert torch.equal(out[0], good[0]) and torch.equal(out[1, :, 2:], good[1, :, 2:])
        with pytest.raises(ValueError, match="q_descale"):
            flashtile.check_errors()
