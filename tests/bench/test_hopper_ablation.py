"""`flashtile bench hopper-ablation` (bench/hopper_ablation.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashtile import cli
from flashtile.bench import hopper_ablation as ha
from flashtile.runtime.fa3_fwd import fa3_config

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def test_each_variant_changes_one_switch():
    base = fa3_config(128, False, 4096, 4096)
    changed = {name: {f.name for f in dataclasses.fields(base)
                      if getattr(fn(base), f.name) != getattr(base, f.name)} for name, fn in ha.VARIANTS.items()}
    assert changed["tuned"] == set() and changed["fp8"] == set()
    assert changed["1 stage"] == {"num_stages"} and changed["O by plain stores"] == {"o_tma"}
    assert changed["no warp specialisation"] <= {"warp_spec", "num_warps"} and "warp_spec" in changed["no warp specialisation"]
    assert set(ha.NOT_EXPRESSIBLE) == {"ping-pong scheduling", "intra-warpgroup overlap"}


def _fake_gluon(monkeypatch, times):
    """Gluon rows on the CPU: the kernel copies q into ``out`` (FA2's stand-in output is q: error 0) and records its
    config; each timing returns the next of ``times``."""
    import flashtile.runtime.fa3_gluon as rg

    configs, timed = [], []

    def forward(q, k, v, *, softmax_scale, causal, out, config):
        out.copy_(q)
        configs.append(config)

    def median_ms(call):
        call()
        timed.append(configs[-1])
        return times.pop(0)

    monkeypatch.setattr(rg, "fa3_gluon_forward", forward)
    monkeypatch.setattr(ha, "median_ms", median_ms)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return configs, timed


def test_gluon_rows_switch_the_schedules(monkeypatch):
    """Each Gluon row runs the kernel with its (pingpong, intra, fence, pack_p) switches; a fenced row keeps intra."""
    n = len(ha.GLUON_VARIANTS)
    configs, _ = _fake_gluon(monkeypatch, [1.0] * n)
    q = torch.randn(1, 2, 8, 128)
    rows = ha._gluon_rows(128, 8, 1, 2, True, q, q, q, q, 1.0)
    assert [r["variant"] for r in rows] == list(ha.GLUON_VARIANTS)
    for (name, (pingpong, intra, fence, pack_p)), cfg in zip(ha.GLUON_VARIANTS.items(), configs[:n]):
        assert (cfg.pingpong, cfg.intra, cfg.fence, cfg.pack_p, cfg.o_tma) == (pingpong, intra, fence, pack_p, True)
        assert not fence or intra
    assert [sum(v[i] for v in ha.GLUON_VARIANTS.values()) for i in (2, 3)] == [3, 2]


def test_gluon_rows_time_in_interleaved_rounds(monkeypatch):
    """``rounds``: every variant once per round, in the same order each round; a row's ms is the median of its
    rounds (``ms_rounds`` in round order) and its TFLOP/s follow from it."""
    n = len(ha.GLUON_VARIANTS)
    times = [float(10 * r + i + 1) for r in (0, 2, 1) for i in range(n)]  # round 2 slowest, round 1 fastest
    _, timed = _fake_gluon(monkeypatch, list(times))
    q = torch.randn(1, 2, 8, 128)
    rows = ha._gluon_rows(128, 8, 1, 2, False, q, q, q, q, 4e9, rounds=3)
    order = [(c.pingpong, c.intra, c.fence, c.pack_p) for c in timed]
    assert order == list(ha.GLUON_VARIANTS.values()) * 3
    for i, row in enumerate(rows):
        assert row["ms_rounds"] == [i + 1.0, 21.0 + i, 11.0 + i] and row["ms"] == 11.0 + i
        assert row["tflops"] == pytest.approx(4e9 / ((11.0 + i) * 1e-3) / 1e12)
    with pytest.raises(ValueError, match="rounds"):
        ha.run_ablation([], rounds=0)


@pytest.mark.skipif(HOPPER, reason="the refusal off Hopper")
def test_refuses_without_hopper(capsys):
    assert cli.main(["bench", "hopper-ablation", "--head-dims", "128"]) == 2
    assert "sm_90" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_gpu_one_point(tmp_path):
    payload = ha.run_ablation([(128, 2048, 2, 8, True)])
    rows = {r["variant"]: r for r in payload["rows"]}
    assert set(rows) == set(ha.VARIANTS) | set(ha.GLUON_VARIANTS)
    assert "tflops" in rows["tuned"] and rows["tuned"]["max_rel_err_vs_fa2"] < 2e-2, rows["tuned"]
    assert "tflops" in rows["fp8"] and rows["fp8"]["max_rel_err_vs_fa2"] < 0.15, rows["fp8"]
    ha.plot(payload, tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 0
