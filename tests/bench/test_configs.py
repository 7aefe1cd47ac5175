"""`flashtile bench configs` (bench/configs.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashtile import cli
from flashtile.bench import configs

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def test_parse_variant():
    assert configs.parse_variant("3wg dynamic: num_wg=3 dynamic=True") == ("3wg dynamic", dict(num_wg=3, dynamic=True))
    for bad, word in (("nofields", "name: field=value"), (":num_wg=3", "name: field=value"),
                      ("a:", "name: field=value"), ("dispatch: num_wg=3", "dispatched"),
                      ("a: num_wg", "name=value")):
        with pytest.raises(ValueError, match=word):
            configs.parse_variant(bad)


def _fakes(monkeypatch, times, wrong=()):
    """The routine on the CPU: FA2's stand-ins return q (forward) and (q, k, v) (backward) on the kernels' views;
    the Gluon kernels (their config checks real) write the same, negated for configs whose fields match a variant
    in ``wrong``; each timing returns the next of ``times``.  Returns the configs each kernel ran, in order."""
    import flashtile.bench.configs as mod
    import flashtile.runtime.fa2_bwd as fa2_bwd
    import flashtile.runtime.fa2_fwd as fa2_fwd
    import flashtile.runtime.fa3_gluon as rg
    import flashtile.runtime.fa3_gluon_bwd as rb

    ran = []

    def sign(cfg):
        return -1.0 if any(all(getattr(cfg, k) == v for k, v in w.items()) for w in wrong) else 1.0

    def forward(q, k, v, *, softmax_scale, causal, out, config):
        rg._check_config(config)
        ran.append(config)
        out.copy_(q * sign(config))

    def backward(dout, q, k, v, out, lse, *, softmax_scale, causal, dq, dk, dv, config):
        rb._check_config(config, q.shape[3], q.element_size())
        ran.append(config)
        dq.copy_(q * sign(config)), dk.copy_(k), dv.copy_(v)

    def median_ms(call):
        call()
        return times.pop(0)

    monkeypatch.setattr(fa2_fwd, "fa2_forward", lambda q, k, v, *, softmax_scale, causal: (q, q[..., 0].float()))
    monkeypatch.setattr(fa2_bwd, "fa2_backward", lambda dout, q, k, v, out, lse, *, softmax_scale, causal: (q, k, v))
    monkeypatch.setattr(rg, "fa3_gluon_forward", forward)
    monkeypatch.setattr(rb, "fa3_gluon_backward", backward)
    monkeypatch.setattr(mod, "median_ms", median_ms)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return ran


def _inputs(b, n, h, d):
    return [torch.randn(b, n, h, d, dtype=torch.bfloat16) for _ in range(4)]


def test_forward_rows_start_from_the_dispatched_config(monkeypatch):
    """``dispatch`` is the config the forward's dispatch picks for the shape; each variant replaces its fields; a
    variant whose output is wrong, or whose field the config lacks, is not timed; the rest are timed in
    interleaved rounds, TFLOP/s from the median."""
    from flashtile.runtime.fa3_fwd import gluon_dispatch_config

    variants = {"2wg": dict(num_wg=2), "wrong": dict(block_n=64), "typo": dict(num_wgs=3)}
    ran = _fakes(monkeypatch, [1.0, 2.0, 3.0, 4.0], wrong=({"block_n": 64},))
    q, k, v, dout = _inputs(2, 256, 4, 64)
    rows = configs._rows("gluon-fwd", 64, 256, 2, 4, True, q, k, v, dout, variants, None, rounds=2)
    by = {r["variant"]: r for r in rows}
    assert list(by) == ["dispatch", "2wg", "wrong", "typo"]
    base = gluon_dispatch_config(q.transpose(1, 2), k.transpose(1, 2), True)
    assert base.num_wg == 3 and ran[0] == base and ran[1] == dataclasses.replace(base, num_wg=2)
    assert by["dispatch"]["config"] == dataclasses.asdict(base) and by["2wg"]["fields"] == dict(num_wg=2)
    assert "not timed" in by["wrong"]["error"] and "ms" not in by["wrong"]
    assert by["typo"]["error"].startswith("TypeError") and "num_wgs" in by["typo"]["error"]
    assert by["dispatch"]["ms_rounds"] == [1.0, 3.0] and by["2wg"]["ms_rounds"] == [2.0, 4.0]
    flops = 4.0 * 2 * 4 * 256 * 256 * 64 / 2
    assert by["2wg"]["tflops"] == pytest.approx(flops / (3.0e-3) / 1e12)


def test_backward_rows_and_the_fa3_peer(monkeypatch):
    """``gluon-bwd``: the table config and variants checked on dQ, dK, dV against FA2's, 2.5x the forward's FLOPs;
    a peer row appears only for the forward (FA3's wheel has no backward); the config check's refusal recorded."""
    from flashtile.runtime.fa3_gluon_bwd import gluon_bwd_config

    ran = _fakes(monkeypatch, [1.0, 2.0])

    class NoFA3:
        @staticmethod
        def flash_attn_func(*a, **kw):
            raise AssertionError("no peer for the backward")

    q, k, v, dout = _inputs(1, 128, 2, 128)
    variants = {"named": dict(named_bars=True), "five stages": dict(num_stages=5)}
    rows = configs._rows("gluon-bwd", 128, 128, 1, 2, False, q, k, v, dout, variants, NoFA3, rounds=1)
    by = {r["variant"]: r for r in rows}
    assert list(by) == ["dispatch", "named", "five stages"]
    assert ran[:2] == [gluon_bwd_config(128, False), dataclasses.replace(gluon_bwd_config(128, False), named_bars=True)]
    assert by["five stages"]["error"].startswith("ValueError")
    assert by["named"]["tflops"] == pytest.approx(2.5 * 4.0 * 1 * 2 * 128 * 128 * 128 / 2.0e-3 / 1e12)


def test_forward_peer_row(monkeypatch):
    """FA3's forward, on the same (B, N, H, d) tensors, checked against FA2 and timed beside the rows."""
    _fakes(monkeypatch, [1.0, 2.0])
    seen = []

    class FA3:
        @staticmethod
        def flash_attn_func(q, k, v, causal):
            seen.append(q)
            return q.clone(), None

    q, k, v, dout = _inputs(1, 128, 2, 64)
    rows = configs._rows("gluon-fwd", 64, 128, 1, 2, False, q, k, v, dout, {}, FA3, rounds=1)
    assert [r["variant"] for r in rows] == ["dispatch", "fa3"] and seen[0] is q
    assert rows[1]["max_rel_err_vs_fa2"] == 0.0 and rows[1]["ms"] == 2.0


def test_fp8_rows_quantise_and_run_the_gluon_fp8_config(monkeypatch):
    """``gluon-fp8``: e4m3 inputs per (batch, head), the Gluon FP8 table config (forced through
    ``fa3_forward_fp8(gluon_config=)``) and variants, checked against FA2 on the dequantised inputs, FA3's FP8
    forward with the descales as the peer, % of the FP8 peak."""
    from flashtile.runtime import fa3_fwd
    from flashtile.runtime.fa3_gluon import gluon_fp8_config

    _fakes(monkeypatch, [1.0, 2.0, 3.0])
    ran = []

    def fp8_forward(q8, k8, v8, descales, *, softmax_scale, causal, out, gluon_config):
        ran.append(gluon_config)
        assert q8.dtype == torch.float8_e4m3fn and descales[0].shape == (1, 2)
        out.copy_((q8.float() * descales[0][:, :, None, None]).to(torch.bfloat16))

    class FA3:
        @staticmethod
        def flash_attn_func(q, k, v, causal, q_descale, k_descale, v_descale):
            assert q.dtype == torch.float8_e4m3fn and q_descale.shape == (1, 2)
            return ((q.float() * q_descale[:, None, :, None]).to(torch.bfloat16),)

    monkeypatch.setattr(fa3_fwd, "fa3_forward_fp8", fp8_forward)
    q, k, v, dout = _inputs(1, 128, 2, 128)
    rows = configs._rows("gluon-fp8", 128, 128, 1, 2, False, q, k, v, dout, {"2 stages": dict(num_stages=2)}, FA3,
                         rounds=1)
    by = {r["variant"]: r for r in rows}
    assert list(by) == ["dispatch", "2 stages", "fa3"] and all("error" not in r for r in rows)
    assert ran[:2] == [gluon_fp8_config(128, False), dataclasses.replace(gluon_fp8_config(128, False), num_stages=2)]
    assert by["fa3"]["max_rel_err_vs_fa2"] == 0.0
    flops = 4.0 * 1 * 2 * 128 * 128 * 128
    assert by["2 stages"]["pct_peak"] == pytest.approx(100 * flops / 2.0e-3 / 1e12 / 1979.0)


def test_gqa_must_divide_the_heads():
    """``gqa`` (query heads per kv head) is checked before any GPU work: an int >= 1 dividing H = 2048 / d."""
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="gqa must be an int"):
            configs.run_configs("gluon-bwd", [(64, 1024, False)], {}, gqa=bad)
    with pytest.raises(ValueError, match="gqa = 3 must divide the 32 heads at d = 64"):
        configs.run_configs("gluon-bwd", [(64, 1024, False)], {}, gqa=3)


@pytest.mark.skipif(HOPPER, reason="the refusal off Hopper")
def test_cli_refuses_without_hopper(capsys):
    assert cli.main(["bench", "configs", "gluon-fwd", "--variant", "a: num_wg=3"]) == 2
    assert "sm_90" in capsys.readouterr().out
    assert cli.main(["bench", "configs", "gluon-bwd", "--variant", "dispatch: named_bars=True"]) == 2
    assert "dispatched" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_gpu_one_point(tmp_path):
    payload = configs.run_configs("gluon-bwd", [(128, 2048, True)], {"named": dict(named_bars=True)}, rounds=1)
    rows = {r["variant"]: r for r in payload["rows"]}
    assert set(rows) == {"dispatch", "named"}
    for row in rows.values():
        assert "tflops" in row and row["max_rel_err_vs_fa2"] < 2e-2, row


def test_ratio_table_pivots_points_and_marks_failures():
    """The configs / banded CLI table: a line per point, a column per variant with TFLOP/s and the ratio to the
    base column, "failed" for a recorded error, "—" for a missing row."""
    from rich.console import Console

    rows = [dict(d=64, variant="dispatch", tflops=400.0), dict(d=64, variant="named", tflops=420.0),
            dict(d=64, variant="bad", error="x"), dict(d=128, variant="dispatch", tflops=500.0)]
    console = Console(width=200, record=True)
    console.print(cli._ratio_table("t", rows, ("d",), lambda r: (r["d"],), "variant", "dispatch"))
    lines = [ln for ln in console.export_text().splitlines() if ln.startswith("│")]
    assert [[c.strip() for c in ln.split("│")[1:-1]] for ln in lines] == [
        ["64", "400 (1.00x)", "420 (1.05x)", "failed"], ["128", "500 (1.00x)", "—", "—"]]
