"""`flashtile bench banded` (bench/banded.py)."""

from __future__ import annotations

import pytest
import torch

from flashtile import cli
from flashtile.bench import banded

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("nq,nk", [(7, 7), (5, 9), (9, 4)])
@pytest.mark.parametrize("left,right", [(-1, -1), (-1, 0), (2, 0), (3, 1), (-1, 2), (0, 0)])
def test_visible_pairs_counts_the_mask(nq, nk, left, right):
    shift = nk - nq
    brute = sum(1 for i in range(nq) for j in range(nk)
                if (left < 0 or j >= i + shift - left) and (right < 0 or j <= i + shift + right))
    assert banded.visible_pairs(nq, nk, left, right) == brute


def test_rows_check_against_fp32_and_time(monkeypatch):
    """Every provider is checked against fp32 rows with the window and softcap (a wrong one is not timed), the
    rest timed in interleaved rounds at 4·B·H·d·pairs FLOPs."""
    import flashtile.bench.banded as mod

    left, right, cap = 5, 0, 2.0
    q, k, v = (torch.randn(2, 40, 3, 16) for _ in range(3))
    ref, idx = banded._reference_rows(q, k, v, left, right, cap)
    # a stand-in "kernel": fp32 attention of every row with the same mask and softcap, through the reference
    full, _ = banded._reference_rows(q, k, v, left, right, cap, heads=3, rows=40)

    def good(q, k, v):
        return full.transpose(0, 1).unsqueeze(0).expand(2, -1, -1, -1)

    times = [1.0, 2.0, 3.0, 4.0]
    monkeypatch.setattr(mod, "median_ms", lambda call: (call(), times.pop(0))[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    rows = banded._point_rows(16, 40, 2, 3, left, right, cap, q, k, v,
                              {"good": good, "wrong": lambda q, k, v: good(q, k, v) + 1.0}, rounds=2)
    by = {r["provider"]: r for r in rows}
    assert by["good"]["max_rel_err_vs_fp32"] < 1e-6 and by["good"]["ms_rounds"] == [1.0, 2.0]
    assert "not timed" in by["wrong"]["error"]
    flops = 4.0 * 2 * 3 * 16 * banded.visible_pairs(40, 40, left, right)
    assert by["good"]["tflops"] == pytest.approx(flops / 1.5e-3 / 1e12)
    # the reference itself: a window row sees exactly its band (others weight 0)
    assert ref.shape == (2, len(idx), 16)


@pytest.mark.parametrize("nq,nk,left,right,cap", [(40, 40, 5, 0, 2.0), (30, 50, 4, 3, 0.0), (50, 30, -1, 0, 1.5),
                                                  (33, 33, -1, -1, 0.0)])
def test_reference_rows_are_the_oracle(nq, nk, left, right, cap):
    """The bench's check uses the float64 oracle's semantics (bottom-right windows, softcap, empty rows 0)."""
    from tests._oracle import attention_ref

    q = torch.randn(1, nq, 2, 16, dtype=torch.float64)
    k, v = (torch.randn(1, nk, 2, 16, dtype=torch.float64) for _ in range(2))
    ref, idx = banded._reference_rows(q, k, v, left, right, cap, rows=nq)
    want, _ = attention_ref(*(x.transpose(1, 2) for x in (q, k, v)), scale=16 ** -0.5, window=(left, right),
                            softcap=cap)
    assert torch.allclose(ref.double(), want[0][:, idx], atol=1e-5)


def test_fa3_refuses_a_window():
    with pytest.raises(NotImplementedError, match="sliding window"):
        banded._fa3(4, 0, False, 0.0)(None, None, None)


@pytest.mark.skipif(HOPPER, reason="the refusal off Hopper")
def test_cli_refuses_without_hopper(capsys):
    assert cli.main(["bench", "banded", "--seqlens", "1024"]) == 2
    assert "sm_90" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_gpu_one_point():
    payload = banded.run_banded([(128, 2048, 512, 0, 0.0), (128, 2048, -1, 0, 30.0)],
                                providers=("flashtile", "hopper-banded"), rounds=1)
    for row in payload["rows"]:
        assert "tflops" in row and row["max_rel_err_vs_fp32"] < 2e-2, row
