"""The benchmark modules and the CLI use only public and runtime APIs, and the decode bench's forced-config
launch (the tile sweep's building block) computes decoding correctly; the GPU test runs the sweep on one small point."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

import flashtile
import flashtile.bench
import flashtile.cli
from flashtile.bench.decode import forced_decode
from flashtile.runtime.decode import flash_decode


def _private_flashtile_imports(path: Path) -> list[str]:
    """``from flashtile... import _x``, imports of a ``_``-prefixed flashtile module, and ``mod._x``
    on a name bound to a flashtile module or object."""
    tree = ast.parse(path.read_text())
    bound, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flashtile"):
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(node.module)
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{node.module}.{alias.name}")
                bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("flashtile"):
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(alias.name)
                    bound.add((alias.asname or alias.name).split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
            and node.attr.startswith("_") and not node.attr.startswith("__")
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_bench_imports_no_private_names():
    """Every module of flashtile/bench and the CLI that drives them."""
    files = sorted(Path(flashtile.bench.__file__).parent.glob("*.py")) + [Path(flashtile.cli.__file__)]
    names = {f.name for f in files}
    assert {"attention.py", "decode.py", "io_lab.py", "common.py", "tune.py", "cli.py"} <= names
    found = {f.name: _private_flashtile_imports(f) for f in files}
    assert not any(found.values()), found


def test_no_probe_scripts_beside_the_driver():
    """The benchmarks are routines of `flashtile bench`: no stand-alone scripts under bench/."""
    bench_dir = Path(flashtile.__file__).resolve().parents[1] / "bench"
    assert not list(bench_dir.rglob("*.py"))


def test_private_import_detector_finds_them(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from flashtile.kernels._common import LOG2E\nfrom flashtile.runtime import decode as d\n"
                   "from flashtile.bench.decode import _graphed\nx = d._capturing\n")
    assert _private_flashtile_imports(src) == [
        "flashtile.kernels._common", "flashtile.bench.decode._graphed", "d._capturing",
    ]


@pytest.mark.parametrize("block_n, splits", [(16, 3), (32, 1), (32, 4)])
def test_forced_decode_matches_flash_decode(device, block_n, splits):
    """A forced tile config gives the heuristic's answer (any tile, any split count is exact)."""
    g = torch.Generator().manual_seed(block_n + splits)
    b, n, hq, hk, d = 2, 70, 4, 2, 32
    q = torch.randn(b, 1, hq, d, generator=g).to(device)
    k = torch.randn(b, n, hk, d, generator=g).to(device)
    v = torch.randn(b, n, hk, d, generator=g).to(device)
    lens = torch.tensor([70, 23], dtype=torch.int32, device=device)
    run = forced_decode(q, k, v, lens, block_n=block_n, num_warps=4, num_stages=1, n_splits=splits)
    want, _ = flash_decode(q, k, v, lens)
    got = run()
    assert got.shape == want.shape and torch.isfinite(got).all()
    tol = 1e-5 if device == "cpu" else 3e-3
    assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


@pytest.mark.gpu
def test_gpu_tile_sweep_one_point(tmp_path):
    """The sweep on one small point: every config is timed or carries its error, the heuristic's
    config is among the timed ones, and the JSON is written."""
    from flashtile.bench.decode import run_tile_sweep

    tiles = {"block_n": (64,), "num_warps": (4,), "num_stages": (2, 3), "splits": (1, 2)}  # 4 configs, ~10 s
    payload = run_tile_sweep(tmp_path, points=((1, 4096),), tiles=tiles)
    (point,) = payload["points"]
    n_configs = math.prod(len(v) for v in tiles.values())
    assert len(point["configs"]) == n_configs
    assert all(("us" in c) != ("error" in c) for c in point["configs"])
    assert point["heuristic_us"] is not None and point["best"][0]["us"] <= point["heuristic_us"]
    assert Path(payload["path"]).exists()


@pytest.mark.gpu
def test_gpu_fp8_cascade_bench_small(tmp_path, monkeypatch):
    """`flashtile bench decode --fp8-cascade` end to end on small points: every flashtile provider timed,
    the FP8 cache's error against the bf16 cache's output at e4m3's scale, the cascade's at bf16's."""
    import flashtile.bench.decode as bd

    monkeypatch.setattr(bd, "FP8_POINTS", ((1, 4096),))
    monkeypatch.setattr(bd, "CASCADE_POINT", {"batch": 4, "prefix": 4096, "own": 512})
    monkeypatch.setattr(bd, "ROUNDS", 1)
    payload = bd.run_fp8_cascade_bench(tmp_path)
    row = payload["fp8_points"][0]
    for name in ("flashtile-bf16", "flashtile-fp8", "flashtile-fp8-paged", "flashtile-fp8-graph"):
        assert row["ms"][name] > 0, (name, row["err"][name])
        assert row["err"][name] < 0.1, name
    c = payload["cascade"]
    for name in ("cascade", "cascade-graph", "unshared", "unshared-paged-shared-pages"):
        assert c["ms"][name] > 0, (name, c["err"][name])
        assert c["err"][name] < 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("name, tokens, rotary", [("rotary", 1, True), ("q_len 4", 4, False)])
def test_gpu_feature_point_small(name, tokens, rotary):
    """A feature point at a small size (B 2, 1k cache): our providers are timed (clean L2 and do_bench)
    with their ratio, and FA3, where importable, agrees with us on the same arguments."""
    from flashtile.bench.decode import feature_point

    row = feature_point(name, 2, 1024, tokens, rotary)
    ours = ("flashtile", "flashtile-rotary") if rotary else ("flashtile", "flashtile-1tok")
    assert all(row["ms_clean_l2"][p] > 0 and row["ms"][p] > 0 for p in ours), row
    assert ("rotary/plain" if rotary else "4tok/1tok") in row["speedup"]
    for peer, err in row["err"].items():
        assert err < 2e-2, (peer, err)
