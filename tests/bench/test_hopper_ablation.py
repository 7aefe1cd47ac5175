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
    """Each Gluon row runs the kernel with its switches over the table's config; a fenced row keeps intra."""
    n = len(ha.GLUON_VARIANTS)
    configs, _ = _fake_gluon(monkeypatch, [1.0] * n)
    q = torch.randn(1, 2, 8, 128)
    rows = ha._gluon_rows(128, 8, 1, 2, True, q, q, q, q, 1.0)
    assert [r["variant"] for r in rows] == list(ha.GLUON_VARIANTS)
    for (name, switches), cfg, row in zip(ha.GLUON_VARIANTS.items(), configs[:n], rows):
        assert {key: getattr(cfg, key) for key in switches} == switches and cfg.o_tma
        assert set(switches) == {"pingpong", "intra", "fence", "pack_p", "named_bars"}
        assert not cfg.fence or cfg.intra
        assert row["config"] == dataclasses.asdict(cfg) and "error" not in row
    on = {key: sum(v[key] for v in ha.GLUON_VARIANTS.values()) for key in ("fence", "pack_p", "named_bars")}
    assert on == {"fence": 3, "pack_p": 3, "named_bars": 1}
    # the named-barrier row differs from "gluon, P packed" in that switch alone
    named, packed = ha.GLUON_VARIANTS["gluon, P packed, named barriers"], ha.GLUON_VARIANTS["gluon, P packed"]
    assert {key for key in named if named[key] != packed[key]} == {"named_bars"}


def test_gluon_rows_time_in_interleaved_rounds(monkeypatch):
    """``rounds``: every variant once per round, in the same order each round; a row's ms is the median of its
    rounds (``ms_rounds`` in round order) and its TFLOP/s follow from it."""
    n = len(ha.GLUON_VARIANTS)
    times = [float(10 * r + i + 1) for r in (0, 2, 1) for i in range(n)]  # round 2 slowest, round 1 fastest
    _, timed = _fake_gluon(monkeypatch, list(times))
    q = torch.randn(1, 2, 8, 128)
    rows = ha._gluon_rows(128, 8, 1, 2, False, q, q, q, q, 4e9, rounds=3)
    order = [{key: getattr(c, key) for key in ha._GLUON_OFF} for c in timed]
    assert order == list(ha.GLUON_VARIANTS.values()) * 3
    for i, row in enumerate(rows):
        assert row["ms_rounds"] == [i + 1.0, 21.0 + i, 11.0 + i] and row["ms"] == 11.0 + i
        assert row["tflops"] == pytest.approx(4e9 / ((11.0 + i) * 1e-3) / 1e12)
    with pytest.raises(ValueError, match="rounds"):
        ha.run_ablation([], rounds=0)
    with pytest.raises(TypeError, match="backward"):
        ha.run_ablation([], backward=1)


def _fake_gluon_bwd(monkeypatch, times, wrong=()):
    """Backward rows on the CPU: FA2's forward and backward stand-ins return (q, lse) and (q, k, v); the Gluon
    backward, with the real config checks, writes q, k, v into the given gradients (k's negated for the variants
    named in ``wrong``) and records its config; each timing returns the next of ``times``."""
    import flashtile.runtime.fa2_bwd as fa2_bwd
    import flashtile.runtime.fa2_fwd as fa2_fwd
    import flashtile.runtime.fa3_gluon_bwd as rb

    configs, timed = [], []
    wrong_cfgs = [dataclasses.replace(rb.gluon_bwd_config(128, False), **ha.GLUON_BWD_VARIANTS[w]) for w in wrong]

    def backward(dout, q, k, v, out, lse, *, softmax_scale, causal, dq, dk, dv, config):
        rb._check_config(config, q.shape[3], q.element_size())
        configs.append(config)
        dq.copy_(q), dk.copy_(-k if config in wrong_cfgs else k), dv.copy_(v)

    def median_ms(call):
        call()
        timed.append(configs[-1])
        return times.pop(0)

    monkeypatch.setattr(fa2_fwd, "fa2_forward", lambda q, k, v, *, softmax_scale, causal: (q, q[..., 0].float()))
    monkeypatch.setattr(fa2_bwd, "fa2_backward", lambda dout, q, k, v, out, lse, *, softmax_scale, causal: (q, k, v))
    monkeypatch.setattr(rb, "fa3_gluon_backward", backward)
    monkeypatch.setattr(ha, "median_ms", median_ms)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return configs, timed


def test_gluon_bwd_rows_switch_check_and_time(monkeypatch):
    """Each backward row runs the table's config with its switches, is checked against FA2's gradients (a wrong dK
    is not timed) and timed in interleaved rounds at 2.5x the forward's FLOPs; the wide kernel's rows record the
    refusal of the narrow kernel's switches."""
    n = len(ha.GLUON_BWD_VARIANTS)
    configs, timed = _fake_gluon_bwd(monkeypatch, [float(i + 1) for i in range(2 * (n - 1))],
                                     wrong=("gluon bwd, host descriptors",))
    q, k, v = (torch.randn(1, 2, 8, 128, dtype=torch.bfloat16) for _ in range(3))
    rows = ha._gluon_bwd_rows(128, 8, 1, 2, False, q, k, v, q, rounds=2)
    from flashtile.runtime.fa3_gluon_bwd import gluon_bwd_config

    assert [r["variant"] for r in rows] == list(ha.GLUON_BWD_VARIANTS)
    for (name, switches), cfg in zip(ha.GLUON_BWD_VARIANTS.items(), configs[:n]):
        assert cfg == dataclasses.replace(gluon_bwd_config(128, False), **switches)
    by = {r["variant"]: r for r in rows}
    assert "not timed" in by["gluon bwd, host descriptors"]["error"] and "ms" not in by["gluon bwd, host descriptors"]
    assert by["gluon bwd"]["max_rel_err_vs_fa2"] == 0.0
    good = [name for name in ha.GLUON_BWD_VARIANTS if name != "gluon bwd, host descriptors"]
    assert [c.named_bars for c in timed] == [ha.GLUON_BWD_VARIANTS[g].get("named_bars", False) for g in good] * 2
    flops = 2.5 * 4.0 * 1 * 2 * 8 * 8 * 128
    for i, name in enumerate(good):
        assert by[name]["ms_rounds"] == [i + 1.0, n + i] and by[name]["ms"] == (i + 1.0 + n + i) / 2
        assert by[name]["tflops"] == pytest.approx(flops / (by[name]["ms"] * 1e-3) / 1e12)
    configs.clear()
    wide_cfgs, _ = _fake_gluon_bwd(monkeypatch, [1.0] * 7)
    x = torch.randn(1, 2, 8, 256, dtype=torch.bfloat16)
    wide = {r["variant"]: r for r in ha._gluon_bwd_rows(256, 8, 1, 2, True, x, x, x, x)}
    assert "tflops" in wide["gluon bwd"] and "tflops" in wide["gluon bwd no ping-pong"]
    # dO's own ring and the split score GEMMs (the table's above 128) switched off one after the other
    assert [(c.do_stages, c.split_s) for c in wide_cfgs[:2]] == [(1, True), (1, True)]
    assert wide["gluon bwd, dO in the Q ring"]["config"]["do_stages"] == 0 and "tflops" in wide[
        "gluon bwd, dO in the Q ring"] and "tflops" in wide["gluon bwd, unsplit score GEMMs"]
    assert not wide["gluon bwd, unsplit score GEMMs"]["config"]["split_s"]
    # the wide kernel's steps are 64 rows and its barriers mbarriers anyway; it takes host descriptors too
    assert "tflops" in wide["gluon bwd, 64 q rows per step"] and "tflops" in wide["gluon bwd, mbarriers"]
    assert "tflops" in wide["gluon bwd, host descriptors"] and wide["gluon bwd, host descriptors"]["config"]["host_desc"]
    for name in ("gluon bwd, named barriers", "gluon bwd, named barriers, host descriptors"):  # the narrow kernel's
        assert "tflops" not in wide[name]
        assert wide[name]["error"].startswith("ValueError") and "head_dim 128" in wide[name]["error"]
    # 64-wide tiles: the table's 128-row steps; host descriptors and the 64-row variant from the 64-row config
    configs, _ = _fake_gluon_bwd(monkeypatch, [1.0] * 2 * len(ha.GLUON_BWD_VARIANTS))
    x = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    ha._gluon_bwd_rows(64, 8, 1, 2, True, x, x, x, x)
    steps = {name: cfg.block_m for name, cfg in zip(ha.GLUON_BWD_VARIANTS, configs)}
    assert steps == {"gluon bwd": 128, "gluon bwd no ping-pong": 128, "gluon bwd, named barriers": 128,
                     "gluon bwd, host descriptors": 64, "gluon bwd, named barriers, host descriptors": 64,
                     "gluon bwd, 64 q rows per step": 64, "gluon bwd, mbarriers": 128,
                     "gluon bwd, Pᵀ through shared memory": 128, "gluon bwd, dO in the Q ring": 128,
                     "gluon bwd, unsplit score GEMMs": 128}


@pytest.mark.skipif(HOPPER, reason="the refusal off Hopper")
def test_refuses_without_hopper(capsys):
    assert cli.main(["bench", "hopper-ablation", "--head-dims", "128"]) == 2
    assert "sm_90" in capsys.readouterr().out
    assert cli.main(["bench", "hopper-ablation", "--backward", "--head-dims", "128"]) == 2
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


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_gpu_backward_one_point(tmp_path):
    """Every backward switch of the narrow kernel checked against FA2's gradients and timed."""
    payload = ha.run_ablation([(128, 2048, 2, 8, True)], backward=True, rounds=2)
    rows = {r["variant"]: r for r in payload["rows"]}
    assert set(rows) == set(ha.GLUON_BWD_VARIANTS) and payload["direction"] == "backward"
    for row in rows.values():
        assert "tflops" in row and row["max_rel_err_vs_fa2"] < 2e-2 and len(row["ms_rounds"]) == 2, row
    ha.plot(payload, tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 0
