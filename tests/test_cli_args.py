"""`flashtile` command line: bad sizes and seeds are argument errors naming the flag, an unwritable --out is one line
(no traceback)."""

from __future__ import annotations

import pytest

from flashtile import cli


@pytest.mark.parametrize("argv,flag", [
    (["bench", "fp8-error", "--seqlen", "0"], "--seqlen"),
    (["bench", "fp8-error", "--batch", "-1"], "--batch"),
    (["bench", "train", "--quick", "--batch", "0"], "--batch"),
    (["bench", "configs", "gluon-fwd", "--rounds", "0"], "--rounds"),
    (["bench", "attention", "--seqlens", "1024", "0"], "--seqlens"),
    (["demo", "--seed", str(2**70)], "--seed"),
    (["bench", "fp8-error", "--seed", str(-2**63 - 1)], "--seed"),
])
def test_bad_sizes_and_seeds_are_argument_errors(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_unwritable_out_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = cli.main(["bench", "fp8-error", "--batch", "1", "--heads", "1", "--seqlen", "16", "--head-dim", "16",
                     "--out", str(blocker / "sub")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("flashtile: ") and "Traceback" not in err


def test_demo_runs_on_the_cpu(tmp_path):
    """README's first set-up line: `flashtile demo` in a fresh process on a machine without a GPU (the
    interpreter set by the command itself): exit 0 with the reference, IO and kernel tables."""
    import os
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU demo (with a GPU it compiles and times the kernels)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the command sets it without a GPU
    env["COLUMNS"] = "200"
    res = subprocess.run([sys.executable, "-m", "flashtile.cli", "demo"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    for title in ("Reference algorithms (float64)", "HBM accesses vs SRAM size", "split-KV decoding"):
        assert title in res.stdout, title
