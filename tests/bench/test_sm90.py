"""`flashtile bench sm90` (bench/sm90.py): offline sm_90a compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flashtile.bench import sm90


def test_parse_overrides():
    assert sm90.parse_overrides(["named_bars=True", "num_stages=3", "block_n=64"]) == dict(
        named_bars=True, num_stages=3, block_n=64)
    assert sm90.parse_overrides(None) == {}
    for bad, word in (("named_bars", "name=value"), ("3x=1", "name=value"), ("num_stages=three", "num_stages")):
        with pytest.raises(ValueError, match=word):
            sm90.parse_overrides([bad])


def test_refuses_interpreted_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        with sm90.offline_sm90():
            pass


def test_stand_ins_are_restored(monkeypatch):
    """Inside: Triton's active driver reports sm_90 and launches are recorded, not run; after: both as before."""
    from triton.runtime import driver

    from flashtile.runtime import fa3_gluon, launch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    before = (launch._bound, launch._unbound, fa3_gluon.sm_count, driver._active)
    with sm90.offline_sm90() as calls:
        assert driver.active.get_current_target().arch == 90 and fa3_gluon.sm_count(0) == sm90.SMS
        launch.launch(object(), (1,), (torch.zeros(1), 1.0), (2,), num_warps=4, num_stages=1)
        assert len(calls) == 1 and calls[0].grid == (1,) and calls[0].static == (2,)
    assert (launch._bound, launch._unbound, fa3_gluon.sm_count, driver._active) == before


def _cli(*args, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["COLUMNS"] = "250"
    return subprocess.run([sys.executable, "-m", "flashtile.cli", "bench", "sm90", *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)


def test_cli_compiles_fa2_for_sm90(tmp_path):
    """FA2's forward compiled for sm_90a on this (GPU-less) machine: registers and spills from ptxas, the PTX
    written without debug lines, the JSON naming the routine, one row per head dim."""
    res = _cli("fa2-fwd", "--head-dims", "32", "64", "--causal", "yes", "--out", "res", "--dump", "ptx",
               tmp_path=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    payload = json.loads((tmp_path / "res" / "sm90-fa2-fwd_offline-sm90a.json").read_text())
    assert payload["routine"] == "fa2-fwd" and payload["env"]["device"] == "offline-sm90a"
    assert [(r["head_dim"], r["causal"]) for r in payload["rows"]] == [(32, True), (64, True)]
    for row in payload["rows"]:
        (k,) = row["kernels"]
        assert "error" not in k, k
        assert 0 < k["registers"] <= 255 and k["spill_stores"] >= 0 and k["shared_bytes"] > 0
        ptx = (tmp_path / "ptx" / f"fa2-fwd_d{row['head_dim']}_c_0_{k['kernel']}.ptx").read_text()
        assert ".entry" in ptx and ".loc" not in ptx and "sm_90a" in ptx
    assert "fa2-fwd compiled for sm_90a" in res.stdout


def test_cli_refuses_bad_overrides(tmp_path):
    res = _cli("gluon-bwd", "--head-dims", "64", "--set", "named_barz=True", tmp_path=tmp_path)
    assert res.returncode == 2 and "no field named_barz" in res.stdout, res.stdout + res.stderr
    res = _cli("fa2-bwd", "--head-dims", "64", "--set", "num_stages=2", tmp_path=tmp_path)
    assert res.returncode == 2 and "fa2-bwd takes no config overrides" in res.stdout, res.stdout + res.stderr
    res = _cli("gluon-bwd", "--head-dims", "256", "--set", "named_bars=True", tmp_path=tmp_path)
    assert res.returncode == 2 and "named_bars" in res.stdout, res.stdout + res.stderr  # the config check's refusal


def _listing(lines: list[str]) -> str:
    return "\n".join(f"        /*{16 * i:04x}*/                   {text} ;" for i, text in enumerate(lines))


def test_sass_loops_innermost_spans_and_spill_traffic():
    body = ["NOP"] * 300
    body[10] = "STL [R1+0x4], R2"  # before any loop: not counted
    body[120] = "@P0 LDL R3, [R1+0x4]"
    body[130] = "STL.64 [R1+0x8], R4"
    body[150] = f"@!P1 BRA 0x{16 * 140:x}"  # a 11-instruction spin loop inside the inner loop: too short to count
    body[199] = f"@P2 BRA 0x{16 * 100:x}"  # inner loop: 100 .. 199
    body[260] = f"BRA 0x{16 * 50:x}"  # outer loop holding the inner one
    body[280] = f"BRA.U 0x{16 * 290:x}"  # a forward branch
    fn_b = ["NOP"] * 80
    fn_b[79] = "BRA 0x0"  # a second function's loop, addresses from 0 again
    loops = sm90.sass_loops(_listing(body) + "\n\tFunction : second\n" + _listing(fn_b))
    assert loops == [dict(start=0, instructions=80, local=0), dict(start=16 * 100, instructions=100, local=2)]
    assert sm90.sass_loops(_listing(body), min_size=5)[0] == dict(start=16 * 140, instructions=11, local=0)
    assert sm90.sass_loops("") == []


_CACHE_SCRIPT = """
from flashtile.bench import sm90
from flashtile.kernels.fa2_fwd import _fa2_fwd_kernel as jit
while not hasattr(jit, "device_caches"):
    jit = jit.fn
caches = jit.device_caches
assert 0 not in caches
row = sm90.compile_routine("fa2-fwd", 32, False, 256)
assert "error" not in row["kernels"][0], row
assert 0 not in caches, "sm_90a binaries left in the cache for device 0"
marker = caches[0] = ("a real GPU's cache",)
sm90.compile_routine("fa2-fwd", 32, False, 256)
assert caches[0] is marker, "device 0's cache not put back"
print("ok")
"""


def test_compiles_leave_the_kernels_device_caches_as_they_were(tmp_path):
    """The sm_90a binaries stay out of the kernel's cache for device 0 (a process using a GPU afterwards would
    launch them there), and an entry it had before comes back (compiled, so in a process without the
    interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr



_FP8_SCRIPT = """
import torch
from flashtile.bench import sm90
from flashtile.runtime import fa3_gluon
with sm90.offline_sm90() as calls:
    cfg = sm90._call("gluon-fp8", 128, True, 2048, {})
assert cfg == fa3_gluon.gluon_fp8_config(128, True, True), cfg
assert [sm90._name(c.kernel) for c in calls] == ["fp8_v_transpose_kernel", "fa3_gluon_kernel"], calls
q = calls[1].dynamic[0]
assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (8, 16, 2048, 128), q.shape
print("ok")
"""


def test_fp8_routine_records_the_fp8_forwards_launches(tmp_path):
    """``gluon-fp8``: V's operand copy, then the Gluon kernel on e4m3 tiles with the FP8 config of the shape
    (launches recorded, not compiled; a process without the interpreter, as Gluon needs)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _FP8_SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
