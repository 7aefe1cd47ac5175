"""`flashtile bench dispatch`: the grid, the forced-path and recording switches, the budget and the JSON, without a
GPU (tiny fp32 points through the interpreter, where only the FA2 path runs); the GPU test runs one point per mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashtile.bench import dispatch as db
from flashtile.bench.attention import default_grid
from flashtile.cli import build_parser, dispatch_points, main
from flashtile.runtime import fa2_bwd, fa2_fwd, fa3_bwd, fa3_fwd, fa3_gluon_bwd

TINY = ("--head-dims", "16", "--seqlens", "32", "--dtype", "fp32", "--total-tokens", "32", "--hidden", "16")
POINT_FIELDS = {"mode", "head_dim", "seqlen", "batch", "heads", "causal", "dtype", "flops", "paths", "chosen", "best",
                "regret"}


def _switches():
    return {(m.__name__, n): getattr(m, n) for m, n in (
        (fa3_fwd, "ENABLED"), (fa3_fwd, "GLUON"), (fa3_fwd, "hopper_wins"), (fa3_fwd, "use_gluon"),
        (fa3_bwd, "ENABLED"), (fa3_bwd, "hopper_bwd_wins"), (fa3_gluon_bwd, "ENABLED"),
        (fa3_gluon_bwd, "gluon_bwd_wins"), (fa2_fwd, "fa2_forward"), (fa2_bwd, "fa2_backward"),
        (fa3_fwd, "launch"), (fa3_bwd, "fa3_backward"), (fa3_gluon_bwd, "backward_into"))}


def _tiny(mode="fwd", causal=True):
    (pt,) = db.dispatch_sweep((mode,), (16,), (32,), (causal,), "fp32", total_tokens=32, hidden=16)
    return pt


def test_default_grid_is_every_head_dim_in_bench_attention_shapes():
    args = build_parser().parse_args(["bench", "dispatch"])
    points = dispatch_points(args)
    assert args.func.__name__ == "_cmd_bench_dispatch" and args.out == "bench/results" and args.budget_s == 540
    want = {(m, d, n, c) for m in db.MODES for d in range(8, 257, 8) for n in (1024, 4096) for c in (False, True)}
    got = [(p.mode, p.head_dim, p.seqlen, p.causal) for p in points]
    assert sorted(got) == sorted(want) and len(got) == len(want)
    assert [p.head_dim for p in points] == sorted(p.head_dim for p in points)  # head dim outermost
    for p in points:
        assert p.dtype == "bf16" and p.batch * p.seqlen == 16384 and p.heads == max(1, 2048 // p.head_dim)
    shapes = {(d, n, b, h) for d, n, b, h, _ in default_grid(head_dims=(64, 128), seqlens=(1024, 4096))}
    assert shapes == {(p.head_dim, p.seqlen, p.batch, p.heads) for p in points if p.head_dim in (64, 128)}
    (p,) = db.dispatch_sweep(("bwd",), (72,), (2048,), (True,))
    assert p.flops == 4.0 * 8 * 28 * 2048**2 * 72 / 2 * 3.5


def test_bad_arguments_are_named(tmp_path, capsys):
    for kwargs, name in (({"head_dims": (0,)}, "head_dims"), ({"head_dims": (264,)}, "head_dims"),
                         ({"seqlens": (0,)}, "seqlens"), ({"modes": ("fwd_bwd",)}, "modes"),
                         ({"causal": ("yes",)}, "causal"), ({"dtype": "fp8"}, "dtype"), ({"hidden": 0}, "hidden")):
        with pytest.raises(ValueError, match=name):
            db.dispatch_sweep(**kwargs)
    with pytest.raises(ValueError, match="budget_s"):
        db.run_dispatch([], tmp_path, budget_s=-1)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:  # argparse: sizes are ints >= 1
        main(["bench", "dispatch", "--seqlens", "0"])
    assert exit_.value.code == 2 and "argument --seqlens" in capsys.readouterr().err
    assert main(["bench", "dispatch", *TINY, "--budget-s", "0", "--out", str(tmp_path)]) == 2
    assert "budget-s" in capsys.readouterr().out
    with pytest.raises(ValueError, match="path"), db.forced_path("fwd", "fa3"):
        pass
    with pytest.raises(ValueError, match="mode"), db.forced_path("fwd_bwd", "fa2"):
        pass


def test_forced_path_sets_the_switches_and_restores_them():
    """Inside the block the forced path passes the runtime's own rule wherever the kernel covers the head dim;
    on exit, also on an exception, every switch is the object it was."""
    before = _switches()
    with db.forced_path("fwd", "fa2"):
        assert fa3_fwd.ENABLED is False
    with db.forced_path("fwd", "hopper-triton"):
        assert fa3_fwd.ENABLED and not fa3_fwd.use_gluon(128, False)
        assert fa3_fwd.hopper_wins(16, True, 1024) and not fa3_fwd.hopper_wins(20, False, 1024)
    with db.forced_path("fwd", "gluon"):
        assert fa3_fwd.ENABLED and fa3_fwd.use_gluon(256, True) and fa3_fwd.hopper_wins(64, True, 128)
    with db.forced_path("bwd", "fa2"):
        assert not fa3_gluon_bwd.ENABLED and not fa3_bwd.ENABLED
    with db.forced_path("bwd", "hopper-triton"):
        assert not fa3_gluon_bwd.ENABLED and fa3_bwd.ENABLED and fa3_bwd.hopper_bwd_wins(64, True, 1024)
    with db.forced_path("bwd", "gluon"):
        assert fa3_gluon_bwd.ENABLED and not fa3_bwd.ENABLED and fa3_gluon_bwd.gluon_bwd_wins(16, False, 128)
    assert _switches() == before
    for mode in db.MODES:
        for path in db.PATHS:
            with pytest.raises(RuntimeError, match="inside"), db.forced_path(mode, path), db.recorded_paths(mode):
                raise RuntimeError("an error inside a forced path")
            assert _switches() == before, (mode, path)


def test_a_failing_path_is_reported_and_the_switches_restored(monkeypatch):
    """An exception inside a forced, recorded call is the path's ``failed`` status; the run goes on and leaves every
    switch as it was."""
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(fa2_fwd, "fa2_forward", broken)
    before = _switches()
    row = db.run_point(_tiny("fwd"), "cpu")
    assert _switches() == before
    fa2 = row["paths"]["fa2"]
    assert fa2["status"] == "failed" and "no kernel here" in fa2["reason"] and fa2["tflops"] is None
    assert row["chosen"] is None and "no kernel here" in row["chosen_error"]
    assert row["best"] is None and row["regret"] is None


def test_a_wrong_path_is_reported_not_timed(monkeypatch):
    """A path whose output is off fp32 math by more than the tolerance is ``wrong``, with its error, and not timed."""
    original = fa2_fwd.fa2_forward

    def off_by_half(*args, **kwargs):
        o, lse = original(*args, **kwargs)
        o.mul_(1.5)
        return o, lse

    def no_timing(*args, **kwargs):
        raise AssertionError("a wrong path was timed")

    monkeypatch.setattr(fa2_fwd, "fa2_forward", off_by_half)
    monkeypatch.setattr(db, "_wall_ms", no_timing)
    row = db.run_point(_tiny("fwd"), "cpu")
    fa2 = row["paths"]["fa2"]
    assert fa2["status"] == "wrong" and fa2["err"] > db.TOLERANCE["fwd"] and "not timed" in fa2["reason"]
    assert fa2["ms"] is None and row["chosen"] == "fa2" and row["best"] is None and row["regret"] is None


def test_chosen_is_the_path_the_runtime_dispatch_takes(monkeypatch):
    """``chosen`` is observed, not derived: with the runtime's Gluon-backward predicate saying yes (its kernel
    stood in for by FA2's), the backward point's chosen path is ``gluon``, and the forced ``gluon`` path runs it."""
    def gluon_stand_in(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal):
        fa2_bwd.fa2_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal, dq=dq, dk=dk, dv=dv)

    monkeypatch.setattr(fa3_gluon_bwd, "prefer_gluon_bwd", lambda *args, **kwargs: fa3_gluon_bwd.ENABLED)
    monkeypatch.setattr(fa3_gluon_bwd, "backward_into", gluon_stand_in)
    with db.recorded_paths("bwd") as seen:
        x = torch.randn(1, 8, 1, 16, requires_grad=True)
        from flashtile import flash_attn_func

        flash_attn_func(x, x, x).sum().backward()
    assert seen == ["gluon", "fa2"]  # the stand-in's own FA2 call comes second
    row = db.run_point(_tiny("bwd", causal=False), "cpu")
    assert row["chosen"] == "gluon" and row["chosen_note"]
    assert row["paths"]["gluon"]["status"] == "ok" and row["paths"]["gluon"]["err"] < 1e-4
    assert row["paths"]["fa2"]["status"] == "ok" and row["best"] in ("fa2", "gluon") and row["regret"] >= 1


def test_budget_skips_points_and_resume_runs_them(tmp_path, monkeypatch):
    """Past the budget the remaining paths of a point and the remaining points are skipped; the JSON written
    holds what ran and names what did not; a resumed run keeps the finished rows and runs the others."""
    now = [0.0]
    monkeypatch.setattr(db, "_clock", lambda: now[0])
    real = db.run_point

    def run_point(pt, device, deadline):
        row = real(pt, device, deadline)
        now[0] += 10.0  # each point takes 10 s of the fake clock
        return row

    monkeypatch.setattr(db, "run_point", run_point)
    points = db.dispatch_sweep(("fwd",), (8, 16, 24), (32,), (True,), "fp32", total_tokens=32, hidden=16)
    payload = db.run_dispatch(points, tmp_path, budget_s=15, device="cpu")
    assert [p["head_dim"] for p in payload["points"]] == [8, 16]
    assert payload["skipped"] == [{"mode": "fwd", "head_dim": 24, "seqlen": 32, "causal": True, "dtype": "fp32"}]
    assert json.loads(Path(payload["path"]).read_text())["skipped"] == payload["skipped"]
    row = real(points[0], "cpu", deadline=-1.0)  # a deadline already passed: every path skipped
    assert all(e["status"] == "skipped" and e["reason"] == "budget" for e in row["paths"].values())
    assert row["best"] is None and row["regret"] is None

    # --resume: the finished rows are kept, the skipped point and a row with a skipped path run again
    stored = json.loads(Path(payload["path"]).read_text())
    stored["points"][1]["paths"]["gluon"]["status"] = "skipped"
    Path(payload["path"]).write_text(json.dumps(stored))
    ran = []
    monkeypatch.setattr(db, "run_point",
                        lambda pt, device, deadline: ran.append(pt.head_dim) or real(pt, device, deadline))
    again = db.run_dispatch(points, tmp_path, budget_s=None, device="cpu", resume=True)
    assert ran == [16, 24] and again["resumed"] == 1 and again["skipped"] == []
    assert [p["head_dim"] for p in again["points"]] == [8, 16, 24] and again["points"][0] == stored["points"][0]
    fresh = db.run_dispatch(points[:1], tmp_path, budget_s=None, device="cpu")  # without resume: runs again
    assert ran == [16, 24, 8] and fresh["resumed"] == 0
    pytest.importorskip("matplotlib")
    db.plot(again, tmp_path / "dispatch.png")
    assert (tmp_path / "dispatch.png").stat().st_size > 0


def test_cli_tiny_grid_writes_the_documented_json(tmp_path, capsys):
    """The command end to end on a tiny grid: a table row per point and the JSON fields; without a GPU only FA2
    runs (checked against fp32 math), each Hopper path n/a with its reason, and the dispatch picks FA2."""
    assert main(["bench", "dispatch", *TINY, "--causal", "both", "--out", str(tmp_path), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "regret" in out and "wrote" in out
    (path,) = tmp_path.glob("dispatch_*.json")
    payload = json.loads(path.read_text())
    assert {"env", "paths", "tolerance", "budget_s", "points", "skipped", "elapsed_s"} <= set(payload)
    assert payload["paths"] == list(db.PATHS) and payload["skipped"] == [] and payload["budget_s"] == 540
    assert sorted((p["mode"], p["causal"]) for p in payload["points"]) == sorted(
        (m, c) for m in db.MODES for c in (False, True))
    for p in payload["points"]:
        assert POINT_FIELDS <= set(p) and set(p["paths"]) == set(db.PATHS)
        assert (p["head_dim"], p["seqlen"], p["batch"], p["heads"], p["dtype"]) == (16, 32, 1, 1, "fp32")
        for e in p["paths"].values():
            assert e["status"] in ("ok", "n/a", "wrong", "failed", "skipped")
            assert (e["status"] == "ok") == (e["tflops"] is not None) and (e["status"] == "ok") == (e["ms"] is not None)
            assert e["status"] == "ok" or e["reason"]
        fa2 = p["paths"]["fa2"]
        assert fa2["status"] == "ok" and fa2["err"] < 1e-4 and fa2["tflops"] == pytest.approx(
            p["flops"] / (fa2["ms"] * 1e-3) / 1e12)
        if not torch.cuda.is_available():
            assert all(p["paths"][x]["status"] == "n/a" and "sm_90" in p["paths"][x]["reason"]
                       for x in ("hopper-triton", "gluon"))
            assert (p["chosen"], p["best"], p["regret"]) == ("fa2", "fa2", 1.0)


@pytest.mark.gpu
def test_gpu_dispatch_one_point_per_mode(tmp_path):
    """d = 64, N = 1024, bf16 on the GPU: every path is checked and timed (or carries its reason), the chosen path
    is a timed one and the regret at least 1; above d = 128 the Gluon backward is n/a without running."""
    points = db.dispatch_sweep(db.MODES, (64,), (1024,), (False,))
    payload = db.run_dispatch(points, tmp_path, budget_s=300)
    for row in payload["points"]:
        assert all((e["status"] == "ok") == (e["tflops"] is not None) for e in row["paths"].values())
        assert row["paths"]["fa2"]["status"] == "ok" and row["chosen"] in db.PATHS
        assert row["paths"][row["chosen"]]["status"] == "ok" and row["regret"] >= 1.0
        if torch.cuda.get_device_capability() == (9, 0):
            assert all(e["status"] == "ok" for e in row["paths"].values()), row
    (wide,) = db.dispatch_sweep(("bwd",), (192,), (1024,), (True,))
    q = torch.randn(1, 8, 2, 192, device="cuda", dtype=torch.bfloat16)
    why = db._not_covered(wide, "gluon", q)
    assert why is not None and ("128" in why or "sm_90" in why)
    assert Path(payload["path"]).exists()
