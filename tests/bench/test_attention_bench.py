"""`flashtile bench attention`'s providers, without a GPU."""

import importlib.util

import pytest
import torch

from flashtile.bench.attention import PROVIDERS, make_providers


def test_fa3_is_an_optional_peer():
    """FA3 is a provider of the default grid, never a dependency: without its interface the column
    is reported unsupported with the reason (the bench catches the error per point)."""
    assert "fa3" in PROVIDERS
    fn = make_providers(["fa3"])["fa3"]
    if importlib.util.find_spec("fa3_fwd_interface") is not None:
        pytest.skip("fa3_fwd_interface is installed here")
    x = torch.zeros(1, 1, 1, 8)
    with pytest.raises(RuntimeError, match="fa3_fwd_interface"):
        fn(x, x, x, False)


def test_unknown_provider_is_named():
    with pytest.raises(ValueError, match="'nope'"):
        make_providers(["nope"])


def test_varlen_bench_lengths_and_equal_flops_batch():
    """The packed batch of `bench attention --varlen` sums to its token count with lengths in [lo, hi],
    and the fixed-length batch it is compared with has its attention FLOPs within 10%."""
    from flashtile.bench.attention import equal_flops_batch, varlen_lengths

    for seed in range(3):
        lens = varlen_lengths(65536, 128, 8192, seed)
        assert sum(lens) == 65536 and all(128 <= n <= 8192 + 128 for n in lens) and len(set(lens)) > 3
        b, n = equal_flops_batch(lens)
        assert n % 128 == 0 and abs(b * n * n / sum(x * x for x in lens) - 1) < 0.1


def test_varlen_bench_is_a_cli_option():
    from flashtile.cli import build_parser

    args = build_parser().parse_args(["bench", "attention", "--varlen", "--causal", "yes"])
    assert args.varlen and args.causal == "yes"


def test_varlen_bench_routine_runs(monkeypatch):
    """The routine end to end on the CPU (interpreter, tiny batch, timing stubbed): every point has the median of
    its interleaved rounds (each round starting at the next provider) for each provider, and TFLOP/s count the
    FLOPs inside the sequences."""
    from flashtile.bench import attention as ab

    timed = []

    def fake_ms(fn, grad_to_none=None):
        fn()
        timed.append(len(timed))
        return float((len(timed) - 1) % 6 + 1)  # calls v f | f v | v f: varlen 1, 4, 5, fixed 2, 3, 6

    monkeypatch.setattr(ab, "median_ms", fake_ms)
    payload = ab.run_varlen(providers=("flashtile-varlen", "flashtile-fixed"), total=96, lo=16, hi=48, head_dim=16,
                            heads=1, causal_modes=(True,), dtype=torch.float32, device="cpu")
    assert sum(payload["lengths"]) == 96 and len(payload["points"]) == 2 and payload["rounds"] == 3
    assert len(timed) == 2 * 3 * 2  # modes x rounds x providers
    sq = sum(n * n for n in payload["lengths"])
    for p in payload["points"]:
        assert p["ms"] == {"flashtile-varlen": 4.0, "flashtile-fixed": 3.0}  # without the rotation: 3 and 4
        mult = 3.5 if p["mode"] == "fwd_bwd" else 1.0
        assert p["tflops"]["flashtile-varlen"] == pytest.approx(4 * 16 * sq / 2 * mult / 4e-3 / 1e12)


def test_gqa_grid_reference_and_sdpa_provider():
    """`bench attention --heads 32 --gqa 4`: the grid's q heads as given, the sampled reference rows read each q
    head's kv head (h // 4), and the SDPA provider takes fewer kv heads (its output equals the expanded-heads one)."""
    from flashtile.bench.attention import default_grid, reference_rows, sdpa_fn
    from flashtile.cli import build_parser

    args = build_parser().parse_args(["bench", "attention", "--heads", "32", "--gqa", "4", "--seqlens", "8192"])
    assert (args.heads, args.gqa) == (32, 4)
    assert {g[3] for g in default_grid(head_dims=(128,), seqlens=(8192,), heads=32)} == {32}
    assert [g[:4] for g in default_grid(head_dims=(64,), seqlens=(4096,))] == [(64, 4096, 4, 32)] * 2
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 40, 8, 16, generator=gen)
    k, v = (torch.randn(1, 40, 2, 16, generator=gen) for _ in range(2))
    wide = [x.repeat_interleave(4, dim=2) for x in (k, v)]
    for causal in (False, True):
        ref, idx = reference_rows(q, k, v, causal, heads=6, rows=13)
        full, idx_full = reference_rows(q, *wide, causal, heads=6, rows=13)
        assert torch.equal(idx, idx_full) and torch.allclose(ref, full, atol=1e-6)
        got = sdpa_fn("sdpa-math")(q, k, v, causal)
        assert torch.allclose(got, sdpa_fn("sdpa-math")(q, *wide, causal), atol=1e-6)
        assert torch.allclose(got[:1, idx, :6].transpose(1, 2), ref, atol=1e-5)


def test_gqa_that_does_not_divide_the_heads_is_refused(monkeypatch):
    from flashtile import cli
    from flashtile.bench import attention as ab

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ab, "make_providers", lambda names: pytest.fail("ran a grid whose heads --gqa does not divide"))
    args = cli.build_parser().parse_args(["bench", "attention", "--head-dims", "96", "--gqa", "4", "--seqlens", "1024"])
    assert cli._cmd_bench_attention(args) == 2  # 2048 / 96 = 21 heads


def test_gqa_options_are_refused_where_they_do_not_apply(monkeypatch):
    from flashtile import cli
    from flashtile.bench import attention as ab

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ab, "run_varlen", lambda **kw: pytest.fail("ran --varlen with --gqa"))
    args = cli.build_parser().parse_args(["bench", "attention", "--varlen", "--gqa", "2"])
    assert cli._cmd_bench_attention(args) == 2
    with pytest.raises(ValueError, match="heads"):
        list(ab.default_grid(heads=0))
    monkeypatch.setattr(ab, "make_providers", lambda names: pytest.fail("providers built before the grid check"))
    with pytest.raises(ValueError, match="gqa 4 must divide"):
        ab.run(providers=("flashtile",), grid=[(64, 1024, 16, 32, False), (96, 1024, 16, 21, False)], gqa=4)
