"""`flashtile bench ring`: the torchrun command it builds and the FLOP count it reports (the run needs GPUs)."""

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
