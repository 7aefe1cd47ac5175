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
