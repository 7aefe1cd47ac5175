"""Hopper backward kernels (kernels/fa3_bwd.py, runtime/fa3_bwd.py).

GPU tests (``pytest -m gpu``) need an sm_90 device.  On the CPU: the config table, the
wrapper's refusals, and both kernels through Triton's interpreter (which runs the tensor
descriptors and ignores ``warp_specialize``) on fp16 tiles (the interpreter's dot multiplies
bf16 bit patterns, see ``_common.mma``), against tests/_oracle.py's float64 gradients.
"""

from __future__ import annotations

import pytest
import torch

from flashtile.runtime import fa3_bwd
from flashtile.runtime.fa2_bwd import fa2_backward
from flashtile.runtime.fa3_bwd import (FA3_BWD_WIDE, Fa3BwdConfig, bwd_widths, fa3_backward, fa3_bwd_config, smem_bytes_dkdv,
                                       smem_bytes_dq)
from flashtile.runtime.fa3_gluon import block_d, head_split
from flashtile.runtime.fa3_fwd import SMEM_LIMIT, SUPPORTED_HEAD_DIMS
from tests._oracle import attention_ref_grads, rounding_slack, scores_ref
from tests.kernels.test_fa2_bwd import Ref, assert_exact_zeros, assert_grads, inputs, make

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def run(q, k, v, dout, *, causal=False, config=None, deterministic=False, **views):
    """Kernel gradients (from the oracle's O and LSE) and the oracle's, as tests/kernels/test_fa2_bwd.py's ``run``."""
    d = q.shape[3]
    scale = d ** -0.5
    out, lse, dq, dk, dv = attention_ref_grads(q, k, v, dout, scale=scale, causal=causal)
    f64 = [x.detach().double() for x in (q, k, v, dout)]
    ref = Ref(dq, dk, dv, rounding_slack(*f64, q.dtype, scale=scale, causal=causal))
    visible = torch.isfinite(scores_ref(*f64[:2], scale=scale, causal=causal)).cpu()
    got = fa3_backward(dout, q, k, v, out.to(device=q.device, dtype=q.dtype), lse.to(device=q.device, dtype=F32),
                       softmax_scale=scale, causal=causal, deterministic=deterministic, config=config, **views)
    return got, ref, visible


# --------------------------------------------------------------------------- #
# CPU: config table and refusals
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("d", SUPPORTED_HEAD_DIMS)
def test_config_fits_and_tiles(d):
    for causal in (False, True):
        cfg = fa3_bwd_config(d, causal)
        assert smem_bytes_dkdv(cfg, d) <= SMEM_LIMIT and smem_bytes_dq(cfg, d) <= SMEM_LIMIT
        assert cfg.block_n % 64 == 0 and cfg.dq_block_m % 64 == 0  # a 64-row wgmma per consumer warpgroup
        assert cfg.block_m % 16 == 0 and cfg.dq_block_n % 16 == 0
        assert not cfg.warp_spec or cfg.block_n == 128  # two consumers of 64 kv rows
        assert not cfg.dq_warp_spec  # Triton 3.6 fails to specialise the dQ loop (kernels/fa3_bwd.py)


def test_smem_estimate_matches_compile_reports():
    # Triton 3.6, sm_90a, bf16, metadata.shared of scratch/cc_bwd.py compiles: the estimate is the report + < 1 KB
    for kind, cfg, d, reported in [
        ("dkdv", Fa3BwdConfig(64, 128, 4, 2, True, 128, 64, 8, 2, False), 128, 147808),
        ("dkdv", Fa3BwdConfig(64, 128, 4, 2, True, 128, 64, 8, 2, False), 64, 82272),
        ("dkdv", Fa3BwdConfig(32, 64, 8, 2, False, 128, 64, 8, 1, False), 256, 131344),
        ("dkdv", Fa3BwdConfig(64, 128, 8, 2, False, 128, 64, 8, 1, False), 128, 131600),
        ("dq", Fa3BwdConfig(64, 128, 4, 2, True, 128, 64, 8, 2, False), 128, 131088),
        ("dq", Fa3BwdConfig(32, 64, 8, 2, False, 128, 64, 8, 1, False), 256, 196616),
        ("dq", Fa3BwdConfig(64, 128, 4, 2, True, 128, 64, 8, 2, False), 64, 65552),
        # split widths: 192 = 128 + 64, 160 = 128 + 32
        ("dkdv", Fa3BwdConfig(32, 64, 8, 3, False, 128, 64, 8, 2, False), 192, 123904),
        ("dkdv", Fa3BwdConfig(32, 64, 8, 3, False, 128, 64, 8, 2, False), 160, 103424),
        ("dq", Fa3BwdConfig(32, 64, 8, 3, False, 128, 64, 8, 2, False), 192, 196624),
        ("dq", Fa3BwdConfig(32, 64, 8, 3, False, 128, 64, 8, 2, False), 160, 163856),
    ]:
        est = smem_bytes_dkdv(cfg, d) if kind == "dkdv" else smem_bytes_dq(cfg, d)
        assert 0 <= est - reported <= 1024, (kind, cfg, d, est, reported)


def test_refuses_what_it_does_not_cover():
    q = torch.zeros(1, 1, 16, 64)
    lse = torch.zeros(1, 1, 16)
    with pytest.raises(NotImplementedError):
        fa3_backward(q, q, q, q, q, lse, softmax_scale=0.125)  # fp32
    h = q.half()
    h20 = torch.zeros(1, 1, 16, 20, dtype=F16)
    with pytest.raises(NotImplementedError):
        fa3_backward(h20, h20, h20, h20, h20, lse, softmax_scale=0.125)  # head dim not a multiple of 8
    with pytest.raises(ValueError, match="dout"):
        fa3_backward(h[:, :, :8], h, h, h, h, lse, softmax_scale=0.125)
    with pytest.raises(ValueError, match="lse"):
        fa3_backward(h, h, h, h, h, lse[0], softmax_scale=0.125)
    with pytest.raises(ValueError, match="q heads"):
        h3, h2 = torch.zeros(1, 3, 16, 64, dtype=F16), torch.zeros(1, 2, 16, 64, dtype=F16)
        fa3_backward(h3, h3, h2, h2, h3, torch.zeros(1, 3, 16), softmax_scale=0.125)


def test_refuses_out_without_unit_stride_on_d():
    """O's rows are read by pointers with adjacent columns (D = rowsum(dO o O), both backwards' preprocess): an
    out of another layout is refused by name, not read as if it were one."""
    from flashtile.runtime.fa3_gluon_bwd import fa3_gluon_backward

    h = torch.zeros(1, 1, 16, 64, dtype=F16)
    out = torch.zeros(1, 1, 64, 16, dtype=F16).transpose(2, 3)  # q's shape, stride 16 on d
    for backward in (fa3_backward, fa3_gluon_backward):
        with pytest.raises(NotImplementedError, match="out: "):
            backward(h, h, h, h, out, torch.zeros(1, 1, 16), softmax_scale=0.125)


@pytest.mark.parametrize("d", SUPPORTED_HEAD_DIMS)
def test_head_dim_split_widths(d):
    """Two power-of-two column parts (``head_split``) exactly where they are narrower than ``block_d(d)``
    (d = 192: 128 + 64; 200: one 256-wide part), one part otherwise and with ``split_d=False``."""
    d0, d1 = bwd_widths(d)
    assert d0 & (d0 - 1) == 0 and d1 & (d1 - 1) == 0 and d0 >= 16 and d0 + d1 >= d
    if sum(head_split(d)) < block_d(d):
        assert (d0, d1) == head_split(d) and d1 > 0 and d0 < d
    else:
        assert (d0, d1) == (block_d(d), 0)
    for causal in (False, True):
        cfg = fa3_bwd_config(d, causal)
        assert cfg.widths(d) == (d0, d1)
        assert Fa3BwdConfig(**{**cfg.__dict__, "split_d": False}).widths(d) == (block_d(d), 0)


@pytest.mark.parametrize("d", [128, 160, 192, 256])
def test_launch_passes_the_column_parts(monkeypatch, d):
    """Both kernels get BLOCK_D0 / BLOCK_D1 = ``cfg.widths(d)`` (d = 160: 128 + 32, d = 192: 128 + 64), and the
    unsplit width with ``split_d=False`` (launches recorded, not run)."""
    import flashtile.runtime.launch as launch_mod
    seen = []
    monkeypatch.setattr(launch_mod, "launch", lambda kernel, grid, dynamic, static, **kw: seen.append(
        (kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__,
         dict(zip(kernel.arg_names[len(dynamic):], static)))))
    q, k, v, do = inputs(1, 2, 1, 40, 30, d, F16, "cpu", seed=0)
    lse = torch.zeros(1, 2, 40)
    for split in (True, False):
        seen.clear()
        cfg = Fa3BwdConfig(**{**fa3_bwd_config(d, False).__dict__, "split_d": split})
        fa3_backward(do, q, k, v, do, lse, softmax_scale=0.1, config=cfg)
        kernels = {name: args for name, args in seen}
        assert set(kernels) >= {"fa3_bwd_dkdv_kernel", "fa3_bwd_dq_kernel"}
        want = head_split(d) if split and d & (d - 1) else (block_d(d), 0)
        for name in ("fa3_bwd_dkdv_kernel", "fa3_bwd_dq_kernel"):
            args = kernels[name]
            assert (args["HEAD_DIM"], args["BLOCK_D0"], args["BLOCK_D1"]) == (d, *want), (name, split)


def test_prefer_hopper_bwd_off_the_gpu():
    q = torch.zeros(1, 1, 16, 64, dtype=BF16)
    assert not fa3_bwd.prefer_hopper_bwd(q, q, q, q, causal=False, window=(-1, -1), plain=True)
    assert not fa3_bwd.prefer_hopper_bwd(q, q, q, q, causal=False, window=(-1, -1), plain=True,
                                         capability=(9, 0))  # a CPU tensor
    assert not fa3_bwd.hopper_bwd_wins(128, False, 4096)  # H100: FA2's backward wins at d <= 128
    assert fa3_bwd.hopper_bwd_wins(256, True, 4096)


# --------------------------------------------------------------------------- #
# CPU: both kernels through Triton's interpreter
# --------------------------------------------------------------------------- #
CPU_CFG = {ws: Fa3BwdConfig(32, 64, 4, 1, ws, 64, 32, 4, 1, ws) for ws in (False, True)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: CPU tensors")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk,warp_spec", [(100, 70, False), (45, 130, True), (64, 64, True)])
def test_interpreter_matches_oracle(causal, nq, nk, warp_spec):
    """GQA (2 q heads per kv head: the fp32 partials summed), head dim 40 padded to 64 by the
    descriptors, ragged tails on both sides, Nq > Nk and Nq < Nk under the bottom-right mask."""
    q, k, v, do = inputs(1, 4, 2, nq, nk, 40, F16, "cpu", seed=nq + nk)
    got, ref, visible = run(q, k, v, do, causal=causal, config=CPU_CFG[warp_spec])
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: CPU tensors")
@pytest.mark.parametrize("causal", [False, True])
def test_interpreter_atomic_dq(causal):
    """dQ by fp32 atomics in the unspecialised dK/dV kernel (GQA group loop, ragged tails); with
    ``deterministic=True`` the same config runs the dQ kernel instead."""
    cfg = Fa3BwdConfig(32, 64, 4, 1, False, 64, 32, 4, 1, False, atomic_dq=True)
    q, k, v, do = inputs(1, 4, 2, 90, 75, 32, F16, "cpu", seed=3)
    for deterministic in (False, True):
        got, ref, visible = run(q, k, v, do, causal=causal, config=cfg, deterministic=deterministic)
        assert_grads(got, ref)
        assert_exact_zeros(got, visible)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: CPU tensors")
@pytest.mark.parametrize("d", [64, 192, 256])
def test_interpreter_table_tiles(d):
    """The table's own tiles (128-row kv tiles with specialisation at d = 64, 8-warp 32 x 64 at d = 192, split
    128 + 64, and 256),
    causal with Nq > Nk: kv tiles cut by the diagonal and a ragged last tile on both sides."""
    q, k, v, do = inputs(1, 1, 1, 140, 130, d, F16, "cpu", seed=d)
    got, ref, visible = run(q, k, v, do, causal=True, config=fa3_bwd_config(d, True))
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: CPU tensors")
@pytest.mark.parametrize("d,causal,warp_spec,nq,nk", [(160, True, False, 70, 100), (192, False, True, 100, 45)])
def test_interpreter_head_split(d, causal, warp_spec, nq, nk):
    """Head dims tiled as two column parts (160 = 128 + 32, 192 = 128 + 64; columns 160-255 never loaded):
    GQA, ragged tails, against the oracle and against the same config unsplit."""
    cfg = CPU_CFG[warp_spec]
    assert cfg.widths(d) == head_split(d)
    q, k, v, do = inputs(1, 2, 1, nq, nk, d, F16, "cpu", seed=d)
    got, ref, visible = run(q, k, v, do, causal=causal, config=cfg)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)
    whole, _, _ = run(q, k, v, do, causal=causal, config=Fa3BwdConfig(**{**cfg.__dict__, "split_d": False}))
    for a, b in zip(got, whole):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: CPU tensors")
@pytest.mark.parametrize("causal", [False, True])
def test_interpreter_head_split_atomic_dq(causal):
    """dQ by fp32 atomics per column part (d = 136 = 128 + 16: 8 columns of the second part past d)."""
    cfg = Fa3BwdConfig(32, 64, 4, 1, False, 64, 32, 4, 1, False, atomic_dq=True)
    q, k, v, do = inputs(1, 2, 1, 50, 40, 136, F16, "cpu", seed=5)
    got, ref, visible = run(q, k, v, do, causal=causal, config=cfg, deterministic=False)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: CPU tensors")
def test_interpreter_flash_layout_views_and_outputs():
    """(B, N, H, d) storage for every input and gradient: strides go through, results land in the views."""
    b, h, n, d = 1, 2, 50, 32
    def view(x):
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    q, k, v, do = (view(x) for x in inputs(b, h, h, n, n, d, F16, "cpu", seed=7))
    grads = [torch.full((b, n, h, d), float("nan"), dtype=F16).transpose(1, 2) for _ in range(3)]
    got, ref, _ = run(q, k, v, do, causal=True, config=CPU_CFG[False], dq=grads[0], dk=grads[1], dv=grads[2])
    assert all(g is w for g, w in zip(got, grads))
    assert_grads(got, ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: CPU tensors")
def test_interpreter_empty_sequences():
    q, k, v, do = inputs(1, 2, 1, 0, 20, 16, F16, "cpu")
    dq, dk, dv = fa3_backward(do, q, k, v, do, torch.zeros(1, 2, 0), softmax_scale=0.25, config=CPU_CFG[False])
    assert dq.shape == q.shape and (dk == 0).all() and (dv == 0).all()


# --------------------------------------------------------------------------- #
# GPU (sm_90)
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 300), (333, 517), (517, 200), (1024, 1024)])
def test_gpu_matches_oracle(d, causal, nq, nk):
    q, k, v, do = inputs(2, 4, 2, nq, nk, d, BF16, "cuda", seed=d + nq)
    got, ref, visible = run(q, k, v, do, causal=causal)
    torch.cuda.synchronize()
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [4096, 8192])
def test_gpu_long_sequences_bf16(d, causal, n):
    q, k, v, do = inputs(1, 2, 1, n, n, d, BF16, "cuda", seed=n + d)
    got, ref, _ = run(q, k, v, do, causal=causal)
    torch.cuda.synchronize()
    assert_grads(got, ref)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_fp16_flash_layout_and_agrees_with_fa2(d):
    """fp16, (B, N, H, d) views with MQA: against the oracle and against FA2's backward."""
    b, hq, hk, n = 2, 4, 1, 777
    def view(x):
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    q, k, v, do = (view(x) for x in inputs(b, hq, hk, n, n, d, F16, "cuda", seed=d))
    got, ref, _ = run(q, k, v, do, causal=True)
    assert_grads(got, ref)
    out, lse = attention_ref_grads(q, k, v, do, scale=d ** -0.5, causal=True)[:2]
    fa2 = fa2_backward(do, q, k, v, out.to("cuda", F16), lse.to("cuda", F32), softmax_scale=d ** -0.5, causal=True,
                       deterministic=True)
    assert_grads(got, Ref(*fa2, ref.slack))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_atomic_dq(d, causal):
    """The unspecialised dK/dV kernel with dQ by atomics (``deterministic=False``), GQA."""
    cfg = Fa3BwdConfig(64, 128, 8, 2, False, 128, 64, 8, 2, False, atomic_dq=True) if d <= 128 else \
        Fa3BwdConfig(32, 64, 8, 2, False, 128, 64, 8, 1, False, atomic_dq=True)
    q, k, v, do = inputs(2, 4, 2, 1500, 1300, d, BF16, "cuda", seed=d)
    got, ref, visible = run(q, k, v, do, causal=causal, config=cfg, deterministic=False)
    torch.cuda.synchronize()
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [128, 256])
def test_gpu_deterministic_bitwise(d):
    """GQA, long rows: two calls agree bit for bit (no atomics; partials summed in a fixed order)."""
    q, k, v, do = inputs(2, 8, 2, 4096, 4096, d, BF16, "cuda", seed=1)
    lse = torch.randn(2, 8, 4096, device="cuda") + 8.0
    out = make((2, 8, 4096, d), BF16, "cuda", 2)
    runs = [fa3_backward(do, q, k, v, out, lse, softmax_scale=d ** -0.5, causal=True, deterministic=True)
            for _ in range(2)]
    for a, c in zip(*runs):
        assert torch.equal(a, c)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [136, 160, 192, 200, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(333, 517), (1100, 700)])
def test_gpu_head_split_matches_oracle(d, causal, nq, nk):
    """Head dims above 128 through the table's config (split into 128 + 16..64 where that narrows the tiles),
    GQA, ragged Nq / Nk both ways; the split result also against the unsplit config before the split."""
    q, k, v, do = inputs(2, 4, 2, nq, nk, d, BF16, "cuda", seed=d + nq)
    cfg = fa3_bwd_config(d, causal)
    got, ref, visible = run(q, k, v, do, causal=causal, config=cfg)
    torch.cuda.synchronize()
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)
    if cfg.widths(d)[1]:
        whole, _, _ = run(q, k, v, do, causal=causal, config=FA3_BWD_WIDE)
        assert_grads(whole, ref)
