"""Tests of the Triton softmax kernels (online: 2 reads + 1 write; safe: 3 reads + 1 write).

Oracles: torch.softmax in float64 and the float64 references of
flashtile.reference.softmax.  Tolerances: the table of tests/_oracle.py for
the output dtype, with ``tf32=False`` (no matmul: fp32 is true fp32 on a GPU
too).  Inputs are rounded to the test dtype before the oracle runs, so only
the kernel's arithmetic and output rounding are measured.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtile.runtime.softmax import softmax_block, softmax_online, softmax_safe
from flashtile.reference.softmax import block_online_softmax, safe_softmax
from tests._oracle import assert_close

KERNELS = [softmax_online, softmax_safe]


def oracle(x: torch.Tensor) -> torch.Tensor:
    y = torch.softmax(x.double().cpu(), dim=-1)
    return torch.nan_to_num(y, nan=0.0)  # rows of only -inf: 0 by definition (torch gives NaN)


def close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Within the table's tolerance for y's dtype (tests/_oracle.py); no matmul, so no TF32 entry."""
    assert_close(y, ref, tf32=False)


def randn(*shape, dtype=torch.float32, device="cpu", scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, block", [(1, None), (37, None), (200, 16), (130, 64)])
def test_matches_torch(kernel, dtype, n, block, device):
    # (200, 16) and (130, 64): rows of 13 and 3 blocks, both with a ragged tail
    x = randn(3, n, dtype=dtype, device=device, seed=n)
    y = kernel(x, block_size=block)
    assert y.dtype == dtype and y.shape == x.shape
    close(y, oracle(x))


def test_row_chunks_respect_grid_limit():
    """One program per row on grid axis x (CUDA: at most 2^31 - 1): more rows take several launches."""
    from flashtile.runtime.softmax import row_chunks

    assert row_chunks(5) == [(0, 5)]
    assert row_chunks(2**31 + 5) == [(0, 2**31 - 1), (2**31 - 1, 6)]


@pytest.mark.parametrize("kernel", [softmax_online, softmax_safe])
def test_rows_split_over_launches(kernel, device, monkeypatch):
    """With the per-launch row limit shrunk to 3, a 7-row tensor runs as launches of 3, 3 and 1
    rows: every row is still written once, from its own input row."""
    from flashtile.runtime import softmax

    monkeypatch.setattr(softmax, "GRID_X_MAX", 3)
    x = randn(7, 37, device=device, seed=4)
    close(kernel(x), oracle(x))


@pytest.mark.parametrize("kernel, ref", [(softmax_online, block_online_softmax), (softmax_safe, safe_softmax)])
def test_matches_reference_variant(kernel, ref, device):
    x = randn(4, 100, device=device, seed=1)
    y = kernel(x, block_size=32)
    expected = ref(x.cpu(), 32).y if ref is block_online_softmax else ref(x.cpu()).y
    close(y, expected)


@pytest.mark.parametrize("kernel", KERNELS)
def test_minus_inf_rows_and_entries(kernel, device):
    x = randn(4, 80, device=device, seed=2)
    x[0] = float("-inf")  # fully masked row -> zeros, never NaN
    x[1, ::3] = float("-inf")  # scattered masked entries
    x[2, :48] = float("-inf")  # the first three blocks masked: online starts from m = -inf
    x[3, 60:] = float("-inf")  # masked tail
    y = kernel(x, block_size=16)
    assert torch.equal(y[0].cpu(), torch.zeros(80))
    assert torch.equal(y[1, ::3].cpu(), torch.zeros(27)) and torch.equal(y[2, :48].cpu(), torch.zeros(48))
    close(y, oracle(x))
    close(y[1:].sum(-1), torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("kernel", KERNELS)
def test_large_logits_do_not_overflow(kernel, device):
    # exp(1e4) overflows fp32: the max subtraction (running, for online) keeps every exponent <= 0
    x = randn(2, 70, device=device, seed=3, scale=1e4)
    x[1, 5] = 3e4  # a late large max forces the online rescale of earlier blocks
    y = kernel(x, block_size=16)
    assert torch.isfinite(y).all()
    close(y, oracle(x))


@pytest.mark.parametrize("kernel", KERNELS)
def test_any_shape_and_strides(kernel, device):
    x = randn(2, 3, 40, device=device, seed=4)
    close(kernel(x), oracle(x))  # leading dims are rows
    xt = randn(40, 6, device=device, seed=5).t()  # non-unit last stride
    close(kernel(xt), oracle(xt))
    rows = randn(10, 32, device=device, seed=6)[::3]  # row stride 96, unit last stride
    close(kernel(rows), oracle(rows))
    one = randn(25, device=device, seed=7)  # a single 1-D row
    close(kernel(one), oracle(one))


@pytest.mark.parametrize("kernel", KERNELS)
def test_empty(kernel, device):
    assert kernel(torch.empty(0, 8, device=device)).shape == (0, 8)
    assert kernel(torch.empty(3, 0, device=device)).shape == (3, 0)


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 150), log_block=st.integers(4, 7), seed=st.integers(0, 2**16))
def test_random_shapes_both_variants_agree(rows, n, log_block, seed):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = randn(rows, n, device=device, seed=seed)
    ref = oracle(x)
    for kernel in KERNELS:
        close(kernel(x, block_size=2**log_block), ref)


def test_default_block():
    assert softmax_block(1, "cpu") == 16 and softmax_block(100, "cpu") == 128
    assert softmax_block(10**6, "cpu") == 1024  # capped: longer rows loop over blocks


@pytest.mark.parametrize(
    "x, kwargs, exc, match",
    [
        ([1.0, 2.0], {}, TypeError, "torch.Tensor"),
        (torch.zeros(2, 3, dtype=torch.float64), {}, TypeError, "float16"),
        (torch.zeros(2, 3, dtype=torch.int32), {}, TypeError, "float16"),
        (torch.tensor(1.0), {}, ValueError, "0-d"),
        (torch.zeros(2, 3), {"block_size": 24}, ValueError, "block_size"),
        (torch.zeros(2, 3), {"block_size": 8}, ValueError, "block_size"),
        (torch.zeros(2, 3), {"block_size": True}, TypeError, "block_size"),
    ],
)
@pytest.mark.parametrize("kernel", KERNELS)
def test_bad_input_raises(kernel, x, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        kernel(x, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1000, 4096, 65536])
def test_gpu_realistic(kernel, dtype, n):
    x = randn(4096 * 1024 // n, n, dtype=dtype, device="cuda", seed=n)
    x[0] = float("-inf")
    y = kernel(x)
    close(y, oracle(x))
