"""Tests of the Triton FlashAttention-1 kernel (FA1 Algorithm 1) against the float64 references.

On CPU the kernel runs in Triton's interpreter (tests/conftest.py), so shapes
are tiny; tests marked ``gpu`` use realistic sizes.

Oracle and tolerances: tests/_oracle.py (dense float64 attention; the table's
entry for the input dtype, relative to max|ref|).  The LSE is computed from the
fp32 l and m in HBM in every dtype, so it is held to the float32 entry: its
error is that of the fp32 score GEMM on the rounded inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtile.iomodel import fa1_block_sizes
from flashtile.runtime.fa1_fwd import fa1_forward, fa1_grid, fa1_tiles
from flashtile.reference.attention import flash_attn1
from tests._oracle import assert_close, attention_ref


def inputs(b, h, nq, nk, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dtype) for n in (nq, nk, nk))
    return q.to(device), k.to(device), v.to(device)


def check(q, k, v, sram, causal, device, scale=None):
    out, lse = fa1_forward(q, k, v, sram_elems=sram, causal=causal, softmax_scale=scale, return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal, scale=scale)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == torch.float32
    assert_close(out, ref_out, what="out")
    assert torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(ref_lse).cpu())
    assert_close(lse, ref_lse, what="lse")
    return out, lse.cpu().double()


# --------------------------------------------------------------------------- #
# tiles
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "sram, d, tiles",
    [
        (16, 16, (16, 16)),  # M = d: Bc = 1, raised to the 16 of tl.dot
        (4 * 16 * 64, 16, (16, 64)),  # Bc = 64 > Br = d = 16
        (4 * 32 * 32, 32, (32, 32)),  # Br = Bc = d
        (4 * 24 * 50, 24, (16, 32)),  # Bc = 50 -> 32, Br = 24 -> 16 (rounded down)
        (228 * 1024 // 2, 64, (64, 128)),  # an H100 SM in bf16: Bc = 456 capped at 128, Br = d
        (228 * 1024 // 2, 256, (64, 64)),  # d > 128: both capped at 64
    ],
)
def test_tiles_follow_line_1(sram, d, tiles):
    assert fa1_tiles(sram, d) == tiles
    br, bc = fa1_block_sizes(sram, d)  # the paper's tiles bound the kernel's from above, beyond 16
    assert tiles[0] <= max(br, 16) and tiles[1] <= max(bc, 16)


# --------------------------------------------------------------------------- #
# correctness in every dtype
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference(dtype, causal, device):
    # N = 37 is a tail for both tiles, d = 24 pads to 32
    q, k, v = inputs(1, 2, 37, 37, 24, dtype, device)
    check(q, k, v, 4 * 24 * 40, causal, device)


@pytest.mark.parametrize("sram, d", [(4 * 16 * 64, 16), (4 * 32 * 32, 32), (16, 16)])
def test_several_sram_sizes(sram, d, device):
    # Br < Bc; Br = Bc = d; the smallest M (Bc raised to 16); Nk = 70 is a tail of every Bc
    q, k, v = inputs(2, 1, 33, 70, d, torch.float32, device, seed=1)
    check(q, k, v, sram, False, device)


def test_same_state_as_reference_algorithm_1(device):
    """Same tiles as the float64 Algorithm 1: the running O, l, m agree at the end."""
    q, k, v = inputs(1, 1, 40, 50, 16, torch.float32, device, seed=2)
    sram = 4 * 16 * 32
    out, lse = fa1_forward(q, k, v, sram_elems=sram, causal=True, return_lse=True)
    ref = flash_attn1(q.cpu(), k.cpu(), v.cpu(), block_sizes=fa1_tiles(sram, 16), causal=True)
    assert_close(out, ref.out, what="out")
    assert_close(lse, ref.lse, what="lse")


def test_causal_more_queries_than_keys_gives_empty_rows(device):
    # bottom-right aligned: rows i < Nq - Nk see no key, their output is 0 and LSE -inf
    q, k, v = inputs(1, 1, 40, 20, 16, torch.float16, device, seed=3)
    out, lse = check(q, k, v, 4 * 16 * 16, True, device)
    assert torch.equal(out[..., :20, :].cpu(), torch.zeros(1, 1, 20, 16, dtype=torch.float16))
    assert torch.isneginf(lse[..., :20]).all() and torch.isfinite(lse[..., 20:]).all()


def test_causal_fewer_queries_than_keys(device):
    q, k, v = inputs(1, 1, 17, 45, 16, torch.float32, device, seed=4)
    check(q, k, v, 4 * 16 * 16, True, device, scale=0.3)


def test_strided_inputs(device):
    # (B, N, H, d) tensors viewed as (B, H, N, d): non-contiguous, unit stride on d
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 30, 2, 16, generator=g).to(device).transpose(1, 2) for _ in range(3))
    check(q, k, v, 4 * 16 * 16, False, device)


def test_no_keys_gives_zeros(device):
    q, k, v = inputs(1, 1, 5, 0, 16, torch.float32, device)
    out, lse = fa1_forward(q, k, v, sram_elems=64, return_lse=True)
    assert torch.equal(out.cpu(), torch.zeros(1, 1, 5, 16)) and torch.isneginf(lse).all()


@settings(max_examples=6, deadline=None)
@given(
    nq=st.integers(1, 40),
    nk=st.integers(1, 40),
    d=st.sampled_from([8, 16, 20]),
    sram_mult=st.integers(1, 16),
    causal=st.booleans(),
)
def test_random_shapes(nq, nk, d, sram_mult, causal):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = inputs(1, 1, nq, nk, d, torch.float32, device, seed=nq * 41 + nk)
    check(q, k, v, 4 * d * sram_mult, causal, device)


# --------------------------------------------------------------------------- #
# bad input
# --------------------------------------------------------------------------- #
def _t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((_t(1, 1, 8, 32),) * 3, dict(sram_elems=31), ValueError, "sram_elems"),
        ((_t(1, 1, 8, 32),) * 3, dict(sram_elems=64.0), TypeError, "sram_elems"),
        ((_t(1, 1, 8, 32),) * 3, dict(sram_elems=True), TypeError, "sram_elems"),
        ((_t(1, 1, 8, 320),) * 3, dict(sram_elems=4096), ValueError, "head_dim"),
        ((_t(1, 1, 8, 32), _t(1, 1, 8, 16), _t(1, 1, 8, 16)), dict(sram_elems=64), ValueError, "k and v"),
        ((_t(1, 2, 8, 32), _t(1, 1, 8, 32), _t(1, 1, 8, 32)), dict(sram_elems=64), ValueError, "GQA"),
        ((_t(1, 1, 8, 32), _t(1, 1, 8, 32), _t(1, 1, 9, 32)), dict(sram_elems=64), ValueError, "v shape"),
        ((_t(8, 32),) * 3, dict(sram_elems=64), ValueError, "4-D"),
        ((_t(1, 1, 8, 32, dtype=torch.float64),) * 3, dict(sram_elems=64), TypeError, "float16"),
        ((_t(1, 1, 8, 32), _t(1, 1, 8, 32, dtype=torch.float16), _t(1, 1, 8, 32)), dict(sram_elems=64), TypeError, "dtype"),
        ((_t(1, 1, 8, 32),) * 3, dict(sram_elems=64, softmax_scale=math.inf), ValueError, "softmax_scale"),
        ((_t(1, 1, 8, 32),) * 3, dict(sram_elems=64, causal=1), TypeError, "causal"),
    ],
)
def test_bad_input_raises(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fa1_forward(*args, **kwargs)


# --------------------------------------------------------------------------- #
# GPU, realistic sizes
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_realistic(dtype, causal):
    q, k, v = inputs(2, 4, 2048, 2048, 64, dtype, "cuda", seed=7)
    out = fa1_forward(q, k, v, sram_elems=228 * 1024 // 2, causal=causal)
    ref_out, _ = attention_ref(q, k, v, causal=causal)  # Nq = Nk: bottom-right causal is torch's top-left
    assert_close(out, ref_out, what="out")


@pytest.mark.gpu
@pytest.mark.parametrize("sram", [4 * 64 * 16, 4 * 64 * 64, 4 * 64 * 128])
def test_gpu_sram_sizes_fp32(sram):
    q, k, v = inputs(1, 2, 1000, 1500, 64, torch.float32, "cuda", seed=8)
    out = fa1_forward(q, k, v, sram_elems=sram)
    ref_out, _ = attention_ref(q, k, v)
    assert_close(out, ref_out, what="out")


def test_grid_within_cuda_limits():
    """One program per (batch, head) on grid axis x (CUDA: 2^31 - 1; y and z stop at 65535)."""
    assert fa1_grid(2048, 32) == (65536,)
    assert fa1_grid(70000, 3) == (210000,)
    with pytest.raises(ValueError, match="batch \\* heads"):
        fa1_grid(2**20, 2**11)
