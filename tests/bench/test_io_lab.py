"""CPU tests of the IO lab's pure parts: byte models, ncu CSV parsing, pairing, plotting.

The timed experiments need a GPU and are run by hand (``run_io_lab``); what
can go wrong without one -- a byte model that disagrees with the instrumented
reference, a parser that misreads ncu's units -- is checked here.
"""

from __future__ import annotations

import pytest
import torch

from flashtile.bench import io_lab
from flashtile.bench.io_lab import NCU_METRICS, fa1_model_bytes, fa2_model_bytes, parse_ncu_csv, roofline_points
from flashtile.iomodel import fa2_hbm
from flashtile.runtime.fa1_fwd import fa1_tiles
from flashtile.reference.attention import flash_attn1
from flashtile.reference.masks import BlockMask


@pytest.mark.parametrize("nq, nk, d, sram", [(40, 70, 16, 4 * 16 * 64), (33, 33, 8, 64)])
def test_fa1_model_matches_reference_counts(nq, nk, d, sram):
    """The kernel's model = the float64 Algorithm 1's counted reads, writes and line-2 init, at the kernel's tiles."""
    tiles = fa1_tiles(sram, d)
    c = flash_attn1(torch.zeros(1, 2, nq, d), torch.zeros(1, 2, nk, d), torch.zeros(1, 2, nk, d), block_sizes=tiles).counts
    model = fa1_model_bytes(nq, nk, d, tiles, heads=2)
    assert model["accesses"] == c.reads + c.writes + c.extras["init_writes"]
    # with 4-byte inputs every access is 4 bytes: the per-tensor split adds up to the access count
    assert fa1_model_bytes(nq, nk, d, tiles, in_bytes=4, heads=2)["total"] == 4 * model["accesses"]
    # 2-byte inputs: Q, K, V and the final output write are 2 bytes, the rest 4
    tc = -(-nk // tiles[1])
    assert model["total"] == 4 * model["accesses"] - 2 * 2 * (2 * nk * d + tc * nq * d + nq * d)


def test_fa2_model_bytes():
    mask = BlockMask.random(256, 256, 0.5, (64, 32), generator=torch.Generator().manual_seed(0))
    elems = fa2_hbm(256, 256, 16, block_mask=mask)
    assert fa2_model_bytes(256, 256, 16, block_mask=mask, lse_bytes=2) == 2 * elems
    assert fa2_model_bytes(256, 256, 16, block_mask=mask) == 2 * elems + 2 * 256  # LSE in fp32


NCU_TEXT = """==PROF== Connected to process 4242 (/usr/bin/python3)
==PROF== Profiling "_fa1_fwd_kernel" - 0: 0%....50%....100% - 3 passes
"ID","Process ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum","lts__t_sectors_srcunit_tex_op_read.sum"
"","","","Mbyte","Kbyte","sector"
"0","4242","_fa1_fwd_kernel","1.50","2,048.00","1,000"
"1","4242","_fa2_fwd_kernel","0.25","n/a","32"
==PROF== Disconnected from process 4242
"""


def test_parse_ncu_csv_units_separators_and_missing():
    rows = parse_ncu_csv(NCU_TEXT)
    assert [r["kernel"] for r in rows] == ["_fa1_fwd_kernel", "_fa2_fwd_kernel"]
    assert rows[0]["dram__bytes_read.sum"] == pytest.approx(1.5e6)
    assert rows[0]["dram__bytes_write.sum"] == pytest.approx(2.048e6)
    assert rows[0]["lts__t_sectors_srcunit_tex_op_read.sum"] == 1000
    assert rows[1]["dram__bytes_write.sum"] is None  # "n/a"
    assert rows[0]["lts__t_sectors_srcunit_tex_op_write.sum"] is None  # not in the header
    assert parse_ncu_csv("==ERROR== ERR_NVGPUCTRPERM") == []


def test_attach_pairs_in_launch_order_and_reports_missing():
    cfgs = [dict(kind="fa1", n=8, model_bytes=100), dict(kind="fa1", n=16, model_bytes=400), dict(kind="fa2", model_bytes=50)]
    row = lambda name, rd: {"kernel": name, NCU_METRICS[0]: rd, NCU_METRICS[1]: 10.0, NCU_METRICS[2]: 3.0, NCU_METRICS[3]: 1.0}  # noqa: E731
    out = io_lab._attach(cfgs, [row("_fa1_fwd_kernel", 90.0), row("_fa2_fwd_kernel", 40.0), row("_fa1_fwd_kernel", 390.0)])
    assert [(r["kind"], r.get("n"), r["dram_bytes"]) for r in out] == [("fa1", 8, 100.0), ("fa1", 16, 400.0), ("fa2", None, 50.0)]
    assert out[0]["dram_over_model"] == 1.0 and out[0]["l2_bytes"] == 4 * 32
    missing = io_lab._attach(cfgs, [row("_fa1_fwd_kernel", 90.0)])
    assert any("expected 2 fa1 kernels" in r.get("error", "") for r in missing)


def test_roofline_points_and_plot(tmp_path):
    results = {
        "roof": {"bandwidth_Bps": 3e12, "bf16_flops": 7e14},
        "fa1_vs_fa2": {"rows": [{"seqlen": 1024, "flops": 8e12, "model_bytes": {"fa1": 4e10, "fa2": 1e10}, "tflops": {"fa1": 50.0, "fa2": None}}]},
        "softmax": {"rows": [{"n": 1024, "rows": 1000, "ms": {"online": 0.002, "safe": None}}]},
    }
    pts = roofline_points(results)
    assert [(p["kind"], p["intensity"]) for p in pts] == [("fa1", 200.0), ("softmax-online", 7 / 6)]
    assert pts[1]["tflops"] == pytest.approx(7 * 1024 * 1000 / 2e-6 / 1e12)
    out = io_lab.roofline_plot(results, tmp_path / "roof.png")
    assert (tmp_path / "roof.png").stat().st_size > 0 and out["points"] == pts


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_gpu_experiments_refuse_without_gpu(tmp_path):
    for fn in (io_lab.fa1_vs_fa2, io_lab.softmax_bandwidth, io_lab.ncu_fa1_dram, io_lab.measure_roof):
        with pytest.raises(RuntimeError, match="CUDA GPU"):
            fn()
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        io_lab.run_io_lab(tmp_path)
