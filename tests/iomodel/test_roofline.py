"""Tests of the roofline model (flashtile.iomodel.roofline).

Datasheet numbers are checked exactly; derived quantities are exact
arithmetic on them, compared at float64 rounding (rel 1e-12).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtile.iomodel import (
    A100,
    H100,
    H200,
    Device,
    arithmetic_intensity,
    attainable_flops,
    attention_flops,
    attention_hbm_bytes,
    attention_intensity,
    fa1_hbm,
    get_device,
    ridge_point,
    roofline_table,
    standard_hbm,
)

REL = 1e-12


def test_presets():
    assert A100.peak("bf16") == A100.peak("fp16") == 312e12
    assert (A100.peak("tf32"), A100.peak("fp32")) == (156e12, 19.5e12)
    assert (A100.bandwidth, A100.sram_bytes, A100.num_sms) == (2.039e12, 192 * 1024, 108)
    assert (H100.peak("bf16"), H100.peak("fp8"), H100.peak("tf32"), H100.peak("fp32")) == (989e12, 1979e12, 494e12, 67e12)
    assert (H100.bandwidth, H100.sram_bytes, H100.num_sms) == (3.35e12, 228 * 1024, 132)
    assert H200.peak_flops == H100.peak_flops
    assert (H200.bandwidth, H200.num_sms) == (4.8e12, 132)
    assert A100.peak("bfloat16") == 312e12  # alias
    assert A100.sram_elements(2) == 96 * 1024


def test_get_device_and_custom_device():
    assert get_device("a100") is A100 and get_device("H100") is H100 and get_device("h200") is H200
    mine = Device("toy", {"bf16": 100e12}, bandwidth=1e12, sram_bytes=64 * 1024, num_sms=10)
    assert get_device(mine) is mine
    assert ridge_point(mine) == pytest.approx(100.0, rel=REL)
    with pytest.raises(ValueError, match="device name"):
        get_device("v100")
    with pytest.raises(ValueError, match="dtype"):
        A100.peak("fp8")  # the A100 has no FP8 tensor cores


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(peak_flops={}), "peak_flops"),
        (dict(peak_flops={"bf16": -1.0}), "peak_flops"),
        (dict(bandwidth=0.0), "bandwidth"),
        (dict(sram_bytes=0), "sram_bytes"),
        (dict(num_sms=0), "num_sms"),
        (dict(name=""), "name"),
    ],
)
def test_bad_device_raises(kwargs, match):
    base = dict(name="x", peak_flops={"bf16": 1e12}, bandwidth=1e11, sram_bytes=1024, num_sms=1)
    with pytest.raises(ValueError, match=match):
        Device(**{**base, **kwargs})


def test_ridge_points():
    assert ridge_point(A100) == pytest.approx(312e12 / 2.039e12, rel=REL)
    assert ridge_point("H100", "fp8") == pytest.approx(1979e12 / 3.35e12, rel=REL)
    # H200: same compute, more bandwidth, so a lower ridge than the H100.
    assert ridge_point(H200) < ridge_point(H100)


@settings(max_examples=100, deadline=None)
@given(intensity=st.floats(0.0, 1e4), dev=st.sampled_from([A100, H100, H200]), dtype=st.sampled_from(["bf16", "tf32", "fp32"]))
def test_attainable_is_min_of_the_two_roofs(intensity, dev, dtype):
    got = attainable_flops(intensity, dev, dtype)
    assert got == min(dev.peak(dtype), dev.bandwidth * intensity)
    if intensity < ridge_point(dev, dtype):
        assert got < dev.peak(dtype)
    else:
        assert got == dev.peak(dtype)


def test_arithmetic_intensity_and_bad_inputs():
    assert arithmetic_intensity(300.0, 100) == 3.0
    with pytest.raises(ValueError, match="bytes_moved"):
        arithmetic_intensity(1.0, 0)
    with pytest.raises(ValueError, match="intensity"):
        attainable_flops(-1.0, A100)
    with pytest.raises(ValueError, match="algorithm"):
        attention_intensity(1024, 64, "fa3")


def test_attention_intensity_definitions_and_limits():
    n, d = 4096, 64
    assert attention_intensity(n, d, "standard") == pytest.approx(
        attention_flops(1, 1, n, n, d) / (2 * standard_hbm(n, n, d)), rel=REL
    )
    assert attention_hbm_bytes(n, d, "fa1", sram_size=8192, bytes_per_element=4) == 4 * fa1_hbm(n, n, d, sram_size=8192)
    # standard: 4 n^2 d / (2 (4 n d + 4 n^2)) -> d / 2 FLOP/byte in bf16
    assert attention_intensity(1 << 20, d, "standard") == pytest.approx(d / 2, rel=1e-3)
    # FA1: ~ M / (3 b d) once N >> Bc; grows with SRAM
    m = A100.sram_elements(2)
    assert attention_intensity(1 << 16, d, "fa1", sram_size=m) == pytest.approx(m / (3 * 2 * d), rel=0.1)
    assert attention_intensity(n, d, "fa1", sram_size=2 * m) > attention_intensity(n, d, "fa1", sram_size=m)


@pytest.mark.parametrize("dev", [A100, H100, H200])
def test_standard_is_memory_bound_and_fa1_compute_bound(dev):
    rows = roofline_table(dev, ns=(1024, 4096, 16384), d=64, algorithms=("standard", "fa1"))
    for r in rows:
        ridge = ridge_point(dev, "bf16")
        assert r.bound == ("memory" if r.intensity < ridge else "compute")
        assert r.attainable == pytest.approx(min(dev.peak("bf16"), dev.bandwidth * r.intensity), rel=REL)
        assert r.flops == attention_flops(1, 1, r.n, r.n, 64)
        assert r.intensity == pytest.approx(r.flops / r.hbm_bytes, rel=REL)
        if r.algorithm == "standard":
            assert r.bound == "memory" and r.attainable < 0.25 * dev.peak("bf16")
    # With one SM's SRAM, FA1 on the A100 crosses the ridge at long sequences.
    if dev is A100:
        assert all(r.bound == "compute" for r in rows if r.algorithm == "fa1")


def test_roofline_table_shape_of_rows():
    rows = roofline_table("H100", ns=(512, 2048), d=128)
    assert [(r.algorithm, r.n) for r in rows] == [(a, n) for a in ("standard", "fa1", "fa2") for n in (512, 2048)]
    fa2 = [r for r in rows if r.algorithm == "fa2"]
    assert fa2[1].hbm_bytes > fa2[0].hbm_bytes  # K/V re-read once per query block: grows like n^2
