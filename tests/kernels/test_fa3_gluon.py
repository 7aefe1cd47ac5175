"""Gluon Hopper forward prototype (kernels/fa3_gluon.py, runtime/fa3_gluon.py).

Gluon kernels do not run in Triton's interpreter (``gluon.jit`` builds a ``GluonJITFunction`` whatever
``TRITON_INTERPRET`` says, and a launch then looks for a GPU driver), so on the CPU only the config table,
the launcher's refusals and its argument list are tested; correctness is GPU-only (``pytest -m gpu``, sm_90)
and in scratch/gluon_probe.py.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from flashtile.runtime.fa3_gluon import (
    GLUON_HEAD_DIMS, SMEM_LIMIT, GluonConfig, fa3_gluon_forward, gluon_config, smem_bytes,
)
from tests._oracle import assert_close, attention_ref

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")


def test_config_table_fits():
    for d in GLUON_HEAD_DIMS:
        for causal in (False, True):
            cfg = gluon_config(d, causal)
            assert smem_bytes(cfg, d) <= SMEM_LIMIT
            assert cfg.num_stages >= 2 and cfg.block_n % 16 == 0 and cfg.intra and cfg.pingpong
    assert gluon_config(128, False) == GluonConfig(block_n=128, num_stages=3)
    assert gluon_config(256, True) == GluonConfig(block_n=64, num_stages=2)
    with pytest.raises(NotImplementedError):
        gluon_config(96, False)


def test_smem_estimate_matches_compile_reports():
    # Triton 3.6, sm_90a, bf16 (metadata.shared from scratch/cc_gluon.py): the estimate is above by < 1 KB
    for cfg, d, reported in [
        (GluonConfig(128, 2), 64, 82224), (GluonConfig(128, 3), 64, 115040),
        (GluonConfig(128, 2), 128, 164144), (GluonConfig(128, 3), 128, 229728),
        (GluonConfig(64, 2), 256, 196912), (GluonConfig(128, 3, o_tma=True), 128, 229880),
    ]:
        assert 0 <= smem_bytes(cfg, d) - reported <= 1024


def test_refusals_name_the_argument():
    q = torch.zeros(1, 1, 16, 64)
    h = q.half()
    with pytest.raises(NotImplementedError):
        fa3_gluon_forward(q, q, q, softmax_scale=0.125)  # fp32
    with pytest.raises(NotImplementedError):
        fa3_gluon_forward(h, h, h, softmax_scale=0.125)  # not an sm_90 CUDA device
    with pytest.raises(ValueError, match="q must be"):
        fa3_gluon_forward(h[0], h[0], h[0], softmax_scale=0.125)
    with pytest.raises(ValueError, match="softmax_scale"):
        fa3_gluon_forward(h, h, h, softmax_scale=float("nan"))
    with pytest.raises(TypeError, match="softmax_scale"):
        fa3_gluon_forward(h, h, h, softmax_scale="0.1")
    with pytest.raises(TypeError, match="config"):
        fa3_gluon_forward(h, h, h, softmax_scale=0.125, config=(128, 2))
    with pytest.raises(ValueError, match="num_stages"):
        fa3_gluon_forward(h, h, h, softmax_scale=0.125, config=GluonConfig(128, 1))  # one slot deadlocks
    with pytest.raises(ValueError, match="block_n"):
        fa3_gluon_forward(h, h, h, softmax_scale=0.125, config=GluonConfig(100, 2))


def test_launcher_passes_the_kernels_arguments():
    """The launcher passes 22 runtime arguments positionally and the constexprs by keyword: the kernel's
    signature must list them in that order (a mismatch would only show on a GPU)."""
    from flashtile.kernels.fa3_gluon import fa3_gluon_kernel

    params = list(inspect.signature(fa3_gluon_kernel.fn).parameters)
    assert params[:6] == ["Q", "K", "V", "Out", "LSE", "qk_scale"]
    assert params[18:23] == ["n_heads", "kv_group", "seqlen_q", "seqlen_k", "num_m_tiles"]
    assert params[23:] == ["HEAD_DIM", "BLOCK_N", "NUM_STAGES", "CAUSAL", "INTRA", "PINGPONG", "CONSUMER_REGS",
                           "PRODUCER_REGS", "O_TMA"]
    assert fa3_gluon_kernel.is_gluon()


# --------------------------------------------------------------------------- #
# GPU (sm_90)
# --------------------------------------------------------------------------- #
SCHEDULES = {"both": (True, True, False), "intra": (True, False, False), "pingpong": (False, True, False),
             "neither": (False, False, False), "both+tma-store": (True, True, True)}


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("nq,nk", [(1, 300), (333, 517), (517, 333)])
def test_gpu_matches_float64(d, causal, schedule, nq, nk):
    intra, pingpong, o_tma = SCHEDULES[schedule]
    base = gluon_config(d, causal)
    cfg = GluonConfig(base.block_n, base.num_stages, intra=intra, pingpong=pingpong, o_tma=o_tma)
    g = torch.Generator().manual_seed(d + nq)
    q = torch.randn(2, nq, 4, d, generator=g).to("cuda", torch.bfloat16).transpose(1, 2)  # GQA 4:2, BNHD storage
    k = torch.randn(2, nk, 2, d, generator=g).to("cuda", torch.bfloat16).transpose(1, 2)
    v = torch.randn(2, nk, 2, d, generator=g).to("cuda", torch.bfloat16).transpose(1, 2)
    out = torch.full((2, nq, 4, d), float("nan"), dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    o, lse = fa3_gluon_forward(q, k, v, softmax_scale=d ** -0.5, causal=causal, out=out, config=cfg)
    ref_o, ref_lse = attention_ref(*(x.double().cpu() for x in (q, k, v)), scale=d ** -0.5, causal=causal)
    assert o is out and not torch.isnan(o).any() and not torch.isnan(lse).any()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), empty) and (o.cpu()[empty] == 0).all()
    assert_close(o, ref_o, o.dtype, o.device, "out")
    assert_close(lse, ref_lse, torch.float32, lse.device, "lse")


@pytest.mark.gpu
@hopper
def test_gpu_fp16_negative_scale_and_empty_keys():
    q = torch.randn(1, 2, 200, 128, device="cuda", dtype=torch.float16)
    o, lse = fa3_gluon_forward(q, q, q, softmax_scale=-0.2)
    ref_o, ref_lse = attention_ref(*(x.double().cpu() for x in (q, q, q)), scale=-0.2, causal=False)
    assert_close(o, ref_o, o.dtype, o.device, "out")
    assert_close(lse, ref_lse, torch.float32, lse.device, "lse")
    k = q[:, :, :0]
    o, lse = fa3_gluon_forward(q, k, k, softmax_scale=0.125)
    assert (o == 0).all() and torch.isneginf(lse).all()
