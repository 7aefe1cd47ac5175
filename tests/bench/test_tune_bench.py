"""`flashtile bench tune`: the declared sweep, its argument parsing and the forced-config switch, without a
GPU (the forced configs run through the interpreter); the GPU test sweeps one small point of each mode."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from flashtile.bench.tune import BWD_CANDIDATES, FWD_CANDIDATES, MODES, TOLERANCE, forced_config, tune_sweep
from flashtile.cli import build_parser, main, tune_points
from flashtile.runtime import fa2_bwd, fa2_fwd


def _parse(*argv):
    return build_parser().parse_args(["bench", "tune", *argv])


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def test_default_sweep_is_both_modes_the_whole_grid():
    args = _parse()
    points = tune_points(args)
    assert args.func.__name__ == "_cmd_bench_tune" and args.out == "bench/results"
    want = {(m, d, n, c) for m in MODES for d in (64, 128) for n in (1024, 4096, 16384) for c in (False, True)}
    got = [(p.mode, p.head_dim, p.seqlen, p.causal) for p in points]
    assert sorted(got) == sorted(want) and len(got) == len(want)
    for p in points:
        assert p.batch * p.seqlen == 16384 and p.heads * p.head_dim == 2048


@pytest.mark.parametrize("flag, mode", [("--fwd", "fwd"), ("--bwd", "bwd")])
def test_one_mode_and_its_candidates(flag, mode):
    points = tune_points(_parse(flag, "--head-dims", "128", "--seqlens", "2048", "--causal", "yes"))
    (p,) = points
    assert (p.mode, p.head_dim, p.seqlen, p.causal) == (mode, 128, 2048, True)
    assert p.candidates[0] is None  # the library's own choice is always measured first
    if mode == "fwd":
        assert p.candidates[1:] == FWD_CANDIDATES[128]
    else:
        assert p.candidates[1:] == tuple((c, a) for c in BWD_CANDIDATES[128] for a in (True, False))
    assert p.flops == 4.0 * 8 * 16 * 2048**2 * 128 / 2 * (3.5 if mode == "bwd" else 1.0)


def test_declared_candidates_are_launchable_shapes():
    """Power-of-two tiles of at least 16 rows, 4 or 8 warps; the backward's build a ``BwdConfig``."""
    for d, cands in FWD_CANDIDATES.items():
        for bm, bn, warps, stages in cands:
            assert _pow2(bm) and _pow2(bn) and min(bm, bn) >= 16 and warps in (4, 8) and stages >= 1, (d, bm, bn)
    for d, cands in BWD_CANDIDATES.items():
        for c in cands:
            cfg = fa2_bwd.BwdConfig(*c)
            assert all(_pow2(t) and t >= 16 for t in cfg[:4]) and cfg.num_warps in (4, 8), (d, c)
    assert set(FWD_CANDIDATES) == set(BWD_CANDIDATES)
    assert all(0 < t < 0.1 for t in TOLERANCE.values()) and set(TOLERANCE) == set(MODES)


def test_bad_sweep_arguments_are_named(capsys):
    with pytest.raises(ValueError, match="head_dims"):
        tune_sweep(head_dims=(96,))
    with pytest.raises(ValueError, match="seqlens"):
        tune_sweep(seqlens=(0,))
    with pytest.raises(ValueError, match="modes"):
        tune_sweep(modes=("fwd_bwd",))
    with pytest.raises(SystemExit):
        _parse("--head-dims", "96")  # argparse: not a declared head dim
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:  # argparse: sizes are ints >= 1
        main(["bench", "tune", "--seqlens", "0"])
    assert exit_.value.code == 2 and "argument --seqlens" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_tune_refuses_without_gpu(capsys):
    assert main(["bench", "tune", "--fwd", "--seqlens", "1024"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_forced_config_is_used_and_restored():
    fwd_before, bwd_before = fa2_fwd.fwd_config, fa2_bwd.bwd_config
    with forced_config("fwd", (32, 16, 4, 1)):
        assert fa2_fwd.fwd_config(64, torch.bfloat16, True, 4096, 4096, "cuda", heavy=True) == (32, 16, 4, 1)
    with forced_config("bwd", ((16, 32, 32, 16, 4, 1), False)):
        cfg = fa2_bwd.bwd_config(64, torch.bfloat16, True, 4096, 4096, "cuda")
        assert cfg == fa2_bwd.BwdConfig(16, 32, 32, 16, 4, 1, atomic_dq=False)
    with forced_config("fwd", None):
        assert fa2_fwd.fwd_config is fwd_before
    with pytest.raises(RuntimeError), forced_config("fwd", (32, 16, 4, 1)):
        raise RuntimeError("a failing config")
    assert fa2_fwd.fwd_config is fwd_before and fa2_bwd.bwd_config is bwd_before
    with pytest.raises(ValueError, match="mode"), forced_config("fwd_bwd", (32, 16, 4, 1)):
        pass


def test_forced_configs_compute_the_same_attention(device):
    """A forced tiling (other than the heuristic's) gives the heuristic's forward and gradients."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 40, 16, generator=g).to(device) for _ in range(4))

    def step():
        o, lse = fa2_fwd.fa2_forward(q, k, v, softmax_scale=0.25, causal=True)
        return (o, *fa2_bwd.fa2_backward(do, q, k, v, o, lse, softmax_scale=0.25, causal=True))

    want = step()
    with forced_config("fwd", (32, 16, 4, 1)), forced_config("bwd", ((32, 16, 16, 32, 4, 1), False)):
        got = step()
    tol = 1e-5 if device == "cpu" else 3e-3
    for w, x in zip(want, got):
        assert (w - x).abs().max().item() <= tol * max(1.0, w.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_tune_one_point(tmp_path, mode):
    """One small point with the heuristic and two candidates: each config is checked and timed (or carries
    its error), the heuristic is among the timed ones, and the JSON is written."""
    from flashtile.bench.tune import run_tune

    (pt,) = tune_sweep(modes=(mode,), head_dims=(64,), seqlens=(1024,), causal=(True,))
    pt = dataclasses.replace(pt, candidates=pt.candidates[:3])
    payload = run_tune([pt], tmp_path)
    (row,) = payload["points"]
    assert len(row["configs"]) == 3
    assert all((c["tflops"] is not None) != ("error" in c) for c in row["configs"])
    heur = row["configs"][0]
    assert heur["config"] == "heuristic" and heur["tflops"] and heur["err"] <= TOLERANCE[mode]
    assert row["best"] is not None and row["peers"]["sdpa-flash"]
    assert Path(payload["path"]).exists()
