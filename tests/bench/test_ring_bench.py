"""`flashtile bench ring`: the torchrun command it builds and the FLOP count it reports (the run needs GPUs)."""

import pytest

from flashtile.bench.ring import attention_flops, build_parser
from flashtile.cli import build_parser as cli_parser, ring_command


def test_cli_launches_torchrun_with_the_options():
    args = cli_parser().parse_args(["bench", "ring", "--nproc", "4", "--seqlens", "1024", "2048", "--causal", "yes",
                                    "--kv-heads", "4"])
    cmd = ring_command(args)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    rest = cmd[cmd.index("flashtile.bench.ring") + 1:]
    back = build_parser().parse_args(rest)
    assert back.seqlens == [1024, 2048] and back.causal == "yes" and back.kv_heads == 4


def test_flops_halve_under_causal_and_backward_is_two_and_a_half_forwards():
    full = attention_flops(2, 4, 1024, 64, causal=False, with_bwd=False)
    assert full == 4 * 2 * 4 * 1024 * 1024 * 64
    assert attention_flops(2, 4, 1024, 64, causal=True, with_bwd=False) == full / 2
    assert attention_flops(2, 4, 1024, 64, causal=False) == 3.5 * full


@pytest.mark.multigpu
def test_bench_ring_runs_on_two_gpus(tmp_path):
    import json
    import subprocess

    args = cli_parser().parse_args(["bench", "ring", "--nproc", "2", "--seqlens", "4096", "--causal", "yes",
                                    "--heads", "8", "--kv-heads", "2", "--reps", "3", "--warmup", "1",
                                    "--out", str(tmp_path)])
    done = subprocess.run(ring_command(args), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("ring_2x_*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["ring_ms"] > 0 and row["ulysses_ms"] > 0 and row["one_gpu_shard_ms"] > 0
    assert row["layout"] == "zigzag" and row["world"] == 2
