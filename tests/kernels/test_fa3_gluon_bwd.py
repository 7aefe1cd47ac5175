"""Gluon Hopper backward (kernels/fa3_gluon_bwd.py, runtime/fa3_gluon_bwd.py).

Gluon kernels do not run in Triton's interpreter, so on the CPU: the config table, the wrapper's refusals, the
launcher's argument lists (bound to the kernels' signatures), the dQ postprocess (plain Triton, interpreted) and
the autograd hook and its switch.  Gradients against the float64 oracle are GPU-only (``pytest -m gpu``, sm_90).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import subprocess
import sys
from dataclasses import replace
from typing import NamedTuple

import pytest
import torch

from flashtile.runtime import fa3_gluon_bwd
from flashtile.runtime.fa3_gluon_bwd import (
    GLUON_BWD_HEAD_DIMS, SMEM_LIMIT, GluonBwdConfig, block_d, dq_postprocess, fa3_gluon_backward, gluon_bwd_config,
    smem_bytes, stats_preprocess,
)
from tests._oracle import assert_close, attention_ref_grads, rounding_bounds, rounding_slack, scores_ref
from tests.kernels.test_fa2_bwd import Ref, assert_exact_zeros, inputs
from tests.kernels.test_fa2_bwd import assert_grads as assert_grads_whole

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


# --------------------------------------------------------------------------- #
# CPU: config table, refusals, argument lists, postprocess, dispatch switch
# --------------------------------------------------------------------------- #
def test_config_table_fits():
    assert GLUON_BWD_HEAD_DIMS == tuple(range(8, 257, 8))
    for d in GLUON_BWD_HEAD_DIMS:
        for causal in (False, True):
            cfg = gluon_bwd_config(d, causal)
            assert 2 <= cfg.num_stages <= 4 and smem_bytes(cfg, d) <= SMEM_LIMIT
            assert 2 * cfg.consumer_regs + cfg.producer_regs <= 512
    # dQ split, through TMA, ping-pong from 64-wide tiles (the probe's best); 2 stages fit beside it at 128, where
    # Pᵀ is the dV GEMM's register operand (pt_regs), packed calls too
    both = dict(dq_split=True, dq_tma=True, pingpong=True, stats_smem=True, pt_separate=True)
    regs = dict(both, pt_separate=False, pt_regs=True)
    assert gluon_bwd_config(128, False) == gluon_bwd_config(72, True) == GluonBwdConfig(num_stages=2, **regs)
    assert gluon_bwd_config(96, True, block_m=64) == gluon_bwd_config(96, True)
    assert fa3_gluon_bwd.varlen_config(128, True) == GluonBwdConfig(num_stages=2, **regs)
    assert fa3_gluon_bwd.varlen_config(64, True) == gluon_bwd_config(64, True, block_m=64)
    assert all(gluon_bwd_config(d, c).pt_regs == (block_d(d) == 128) for d in GLUON_BWD_HEAD_DIMS for c in (0, 1))
    # 64-wide tiles: 128 q rows per step on 2 stages with named barriers; the 64-row config on 4 on request
    assert gluon_bwd_config(64, True) == gluon_bwd_config(40, False) == GluonBwdConfig(
        num_stages=2, dq_swizzle32=True, named_bars=True, block_m=128, **both)
    assert gluon_bwd_config(64, True, block_m=64) == GluonBwdConfig(num_stages=4, dq_swizzle32=True, **both)
    assert gluon_bwd_config(32, True) == gluon_bwd_config(8, False) == GluonBwdConfig(num_stages=4)
    # above 128 the wide kernel: dQ through TMA, the split score GEMMs and dO in its own one-slot ring at both tile
    # widths, packed calls too
    wide = GluonBwdConfig(num_stages=2, pingpong=True, stats_smem=True, dq_tma=True, split_s=True, do_stages=1)
    assert gluon_bwd_config(200, False) == gluon_bwd_config(256, True) == gluon_bwd_config(136, False) == wide
    assert fa3_gluon_bwd.varlen_config(256, True) == fa3_gluon_bwd.varlen_config(192, False) == wide
    # group_loop (the caller's group_loop_wins) up to 128 where the statistics go through shared memory
    assert gluon_bwd_config(128, True, True) == replace(gluon_bwd_config(128, True), group_loop=True)
    assert gluon_bwd_config(64, False, True).group_loop and not gluon_bwd_config(64, False).group_loop
    # the group loop keeps 64-row steps (128 with it not yet run on a GPU)
    assert gluon_bwd_config(64, False, True) == replace(gluon_bwd_config(64, False, block_m=64), group_loop=True)
    assert gluon_bwd_config(256, False, True) == wide and gluon_bwd_config(32, True, True) == GluonBwdConfig(4)
    # named barriers only with 128-row steps (timed there, bench/NOTES.md); host descriptors are the dispatch's
    assert all(gluon_bwd_config(d, c, g).named_bars == (gluon_bwd_config(d, c, g).block_m == 128)
               and not gluon_bwd_config(d, c, g).host_desc
               for d in (32, 64, 96, 128, 256) for c in (False, True) for g in (False, True))
    for d in (0, 4, 100, 264):
        with pytest.raises(NotImplementedError, match="head_dim"):
            gluon_bwd_config(d, False)


def test_smem_estimate_matches_compile_reports():
    # Triton 3.6, sm_90a, bf16 (metadata.shared from scratch/cc_gluon_bwd.py): the estimate is above by < 1 KB
    for stages, d, reported in [(2, 128, 164544), (3, 128, 197360), (2, 64, 99008), (3, 64, 115440),
                                (4, 64, 131824), (2, 16, 49856), (2, 96, 164544)]:
        assert 0 <= smem_bytes(GluonBwdConfig(num_stages=stages), d) - reported <= 1024, (stages, d)
    for stages, reported in [(2, 180960), (3, 213776)]:
        assert 0 <= smem_bytes(GluonBwdConfig(num_stages=stages, dq_split=True), 128) - reported <= 1024, stages
    # the wide kernel (scratch/cc_gluon_bwd_wide.py): 192-wide tiles up to d = 192, 256-wide above; dQ through TMA
    # (the table's) or from registers, split_s
    for d, stages, flags, reported in [(256, 2, {}, 230896),
                                       (256, 2, dict(split_s=True, dq_tma=False, pt_separate=True), 230960),
                                       (200, 2, dict(dq_tma=False, pt_separate=True), 230896),
                                       (192, 2, dict(split_s=False), 181744), (136, 3, dict(split_s=False), 231456),
                                       (160, 2, dict(dq_tma=False, pt_separate=True), 181744),
                                       (192, 2, dict(split_s=True, dq_tma=False, pt_separate=True), 181808),
                                       (192, 2, {}, 198224),  # split_s with dQ through TMA
                                       (256, 2, dict(split_s=True), 230992),  # one Pᵀ / dSᵀ buffer there
                                       # the table's: dO in its own one-slot ring, two buffers at both widths
                                       # (`flashtile bench sm90 gluon-bwd --head-dims 192 256`, Triton 3.6)
                                       (256, 2, dict(split_s=True, do_stages=1), 214640),
                                       (192, 2, dict(split_s=True, do_stages=1), 173680)]:
        cfg = GluonBwdConfig(num_stages=stages, pingpong=True, stats_smem=True, dq_tma=True, split_s=d <= 192)
        cfg = replace(cfg, **flags)
        assert gluon_bwd_config(d, False) == cfg or "do_stages" not in flags
        assert 0 <= smem_bytes(cfg, d) - reported <= 1024 and reported <= SMEM_LIMIT, (d, stages, flags)
    assert fa3_gluon_bwd.wide_tile_d(136) == fa3_gluon_bwd.wide_tile_d(192) == 192
    assert fa3_gluon_bwd.wide_tile_d(200) == fa3_gluon_bwd.wide_tile_d(256) == 256
    # dq_split at d = 64 (K swizzled in 64-byte half-rows), dq_tma's fp32 dQ tiles (one per warpgroup)
    for stages, d, split, tma, reported in [(4, 64, True, False, 148240), (4, 64, False, True, 164592),
                                            (4, 64, True, True, 164624), (2, 64, True, True, 131808),
                                            (4, 16, False, True, 66288), (4, 32, False, True, 99056),
                                            (3, 64, True, False, 131856), (2, 128, True, True, 213728)]:
        cfg = GluonBwdConfig(num_stages=stages, dq_split=split, dq_tma=tma)
        assert 0 <= smem_bytes(cfg, d) - reported <= 1024, cfg
    assert smem_bytes(GluonBwdConfig(num_stages=3, dq_split=True, dq_tma=True), 128) > SMEM_LIMIT
    # stats_smem: num_stages pairs of 64 fp32 row statistics beside the table's configs; dq_swizzle32 and
    # pt_separate lay out the same tiles
    for stages, d, sw_pt, reported in [(2, 128, False, 214512), (4, 64, False, 166432), (2, 128, True, 214496),
                                       (4, 64, True, 166448)]:
        cfg = GluonBwdConfig(num_stages=stages, dq_split=True, dq_tma=True, pingpong=True, stats_smem=True,
                             dq_swizzle32=sw_pt, pt_separate=sw_pt, release_once=sw_pt and stages == 2)
        assert 0 <= smem_bytes(cfg, d) - reported <= 1024 and smem_bytes(cfg, d) <= SMEM_LIMIT, cfg


def _shared_pt(cfg: GluonBwdConfig) -> GluonBwdConfig:
    """``cfg`` with Pᵀ through its shared tile (the table takes it as a register operand at 128-wide tiles): the
    switches of that path (pt_separate, release_once) are tested on it."""
    return replace(cfg, pt_regs=False, pt_separate=True) if cfg.pt_regs else cfg


def _rows(nq: int, block_m: int = 64) -> int:
    """Rows of a fixed-length call's dQ accumulator and statistics: Nq padded to whole steps of the config."""
    return -(-nq // block_m) * block_m


def _args(d=64, nq=16, nk=16, dtype=F16, hq=1, hk=1):
    q = torch.zeros(1, hq, nq, d, dtype=dtype)
    k = torch.zeros(1, hk, nk, d, dtype=dtype)
    return q, k, k, q, q, torch.zeros(1, hq, nq)  # dout, q, k, v, out, lse


def test_refusals_name_the_argument(monkeypatch):
    dout, q, k, v, out, lse = _args()
    with pytest.raises(NotImplementedError):
        fa3_gluon_backward(*(x.float() for x in (dout, q, k, v, out)), lse, softmax_scale=0.125)  # fp32
    with pytest.raises(NotImplementedError, match="device"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125)  # not an sm_90 CUDA device
    with pytest.raises(ValueError, match="q must be"):
        fa3_gluon_backward(dout, q[0], k, v, out, lse, softmax_scale=0.125)
    with pytest.raises(ValueError, match="lse"):
        fa3_gluon_backward(dout, q, k, v, out, lse[0], softmax_scale=0.125)
    with pytest.raises(ValueError, match="softmax_scale"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=float("inf"))
    with pytest.raises(TypeError, match="softmax_scale"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale="0.1")
    with pytest.raises(TypeError, match="causal"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, causal=1)
    with pytest.raises(NotImplementedError, match="deterministic"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, deterministic=True)
    monkeypatch.setattr(fa3_gluon_bwd, "_check", lambda *a: None)  # past the device check
    with pytest.raises(TypeError, match="config"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, config=(2,))
    with pytest.raises(ValueError, match="num_stages"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, config=GluonBwdConfig(num_stages=1))
    with pytest.raises(ValueError, match="consumer_regs"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, config=GluonBwdConfig(consumer_regs=256))
    with pytest.raises(ValueError, match="shared memory"):
        d128 = _args(d=128)
        fa3_gluon_backward(*d128, softmax_scale=0.125, config=GluonBwdConfig(num_stages=5))
    with pytest.raises(ValueError, match="dq_split"):  # d = 32: 32-byte half-rows of K
        fa3_gluon_backward(*_args(d=32), softmax_scale=0.125, config=GluonBwdConfig(dq_split=True))
    with pytest.raises(TypeError, match="dq_split"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, config=GluonBwdConfig(dq_split=1))
    with pytest.raises(ValueError, match="dq_tma"):  # d = 128 unsplit: two 32 KB fp32 tiles
        fa3_gluon_backward(*_args(d=128), softmax_scale=0.125, config=GluonBwdConfig(num_stages=2, dq_tma=True))
    with pytest.raises(TypeError, match="dq_tma"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, config=GluonBwdConfig(dq_tma="yes"))
    with pytest.raises(TypeError, match="pingpong"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, config=GluonBwdConfig(pingpong=None))
    with pytest.raises(TypeError, match="stats_smem"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, config=GluonBwdConfig(stats_smem=1))
    with pytest.raises(TypeError, match="dq_swizzle32"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, config=GluonBwdConfig(dq_swizzle32=0))
    with pytest.raises(TypeError, match="pt_separate"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, config=GluonBwdConfig(pt_separate="no"))
    with pytest.raises(ValueError, match="dq_swizzle32"):  # it lays out dq_tma's tiles
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, config=GluonBwdConfig(dq_swizzle32=True))
    with pytest.raises(TypeError, match="release_once"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, config=GluonBwdConfig(release_once=1))
    for cfg in (GluonBwdConfig(release_once=True), GluonBwdConfig(num_stages=3, dq_split=True, release_once=True)):
        with pytest.raises(ValueError, match="release_once"):  # the ring slot and the dSᵀ buffer must coincide
            fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, config=cfg)
    with pytest.raises(ValueError, match="shared memory"):
        fa3_gluon_backward(*_args(d=128), softmax_scale=0.125,
                           config=GluonBwdConfig(num_stages=3, dq_split=True, dq_tma=True))
    for d, cfg in [(64, GluonBwdConfig(dq_split=True)), (40, GluonBwdConfig(dq_tma=True)),
                   (64, GluonBwdConfig(num_stages=4, dq_split=True, dq_tma=True)),
                   (128, GluonBwdConfig(dq_split=True, dq_tma=True)), (8, GluonBwdConfig(pingpong=True)),
                   (128, GluonBwdConfig(dq_split=True, dq_tma=True, pingpong=True, stats_smem=True)),
                   (64, GluonBwdConfig(num_stages=4, dq_tma=True, dq_swizzle32=True, pt_separate=True)),
                   (128, GluonBwdConfig(num_stages=2, dq_split=True, release_once=True))]:
        fa3_gluon_bwd._check_config(cfg, d, 2)  # accepted
    with pytest.raises(TypeError, match="named_bars"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, config=GluonBwdConfig(named_bars=1))
    # hardware barrier ids 5-8 hold 4 ring slots; release_once is an mbarrier's double use; the wide kernel has none
    for d, bad in [(64, GluonBwdConfig(num_stages=5, named_bars=True)),
                   (128, GluonBwdConfig(num_stages=2, dq_split=True, release_once=True, named_bars=True)),
                   (256, replace(gluon_bwd_config(256, False), named_bars=True))]:
        with pytest.raises(ValueError, match="named_bars"):
            fa3_gluon_bwd._check_config(bad, d, 2)
    for d in (40, 64, 96, 128):
        fa3_gluon_bwd._check_config(replace(gluon_bwd_config(d, True), named_bars=True), d, 2)  # accepted
    with pytest.raises(ValueError, match="dk"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, dk=torch.zeros(1, 1, 15, 64, dtype=F16))
    with pytest.raises(TypeError, match="dq"):
        fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=0.125, dq=[0.0])


def test_block_m_128_configs(monkeypatch):
    """``block_m`` 128 (q rows per step): accepted at 64-wide tiles with the row-split dQ and the statistics
    through shared memory, on 2 ring stages (231936 B compiled at d = 64, sm_90a, Triton 3.6; 3 do not fit);
    anything else a ValueError naming config; the kernel gets BLOCK_M and the accumulator whole 128-row blocks."""
    base = replace(gluon_bwd_config(64, False), num_stages=2, block_m=128)
    for d in (40, 48, 56, 64):
        fa3_gluon_bwd._check_config(base, d, 2)  # accepted
        fa3_gluon_bwd._check_config(replace(base, dq_tma=False, dq_swizzle32=False, named_bars=True), d, 2)
        fa3_gluon_bwd._check_config(replace(base, group_loop=True), d, 2)
    assert 0 <= smem_bytes(base, 64) - 231936 <= 1024 and smem_bytes(base, 64) <= SMEM_LIMIT
    assert smem_bytes(replace(base, num_stages=3), 64) > SMEM_LIMIT
    # pt_regs: no Pᵀ tiles (199088 B compiled at d = 64, 128-row steps; 231456 at d = 128 with 3 stages)
    p128 = replace(gluon_bwd_config(128, False), pt_regs=True, pt_separate=False, num_stages=3)
    fa3_gluon_bwd._check_config(p128, 128, 2)
    assert 0 <= smem_bytes(p128, 128) - 231456 <= 1024
    fa3_gluon_bwd._check_config(replace(base, pt_regs=True, pt_separate=False), 64, 2)
    assert 0 <= smem_bytes(replace(base, pt_regs=True, pt_separate=False), 64) - 199088 <= 1024
    for d, bad in [(64, replace(base, pt_regs=True)), (256, replace(gluon_bwd_config(256, False), pt_regs=True))]:
        with pytest.raises(ValueError, match="pt_regs"):
            fa3_gluon_bwd._check_config(bad, d, 2)
    with pytest.raises(TypeError, match="pt_regs"):
        fa3_gluon_bwd._check_config(replace(base, pt_regs=1, pt_separate=False), 64, 2)
    for d, bad, what in [(64, replace(base, block_m=96), "block_m must be"), (64, replace(base, block_m=True),
                                                                            "block_m must be"),
                         (128, replace(gluon_bwd_config(128, False), block_m=128), "block_m 128"),
                         (32, replace(base, dq_split=False, dq_tma=False, dq_swizzle32=False), "block_m 128"),
                         (64, replace(base, dq_split=False), "block_m 128"),
                         (64, replace(base, stats_smem=False), "block_m 128"),
                         (64, replace(base, host_desc=True), "block_m 128"),
                         (64, replace(base, num_stages=3), "shared memory")]:
        with pytest.raises(ValueError, match=what):
            fa3_gluon_bwd._check_config(bad, d, 2)
    calls = _record_launches(monkeypatch)
    b, hq, nq, nk, d = 2, 4, 300, 500, 64
    q = torch.zeros(b, hq, nq, d, dtype=BF16)
    k = torch.zeros(b, hq, nk, d, dtype=BF16)
    fa3_gluon_backward(q, q, k, k, q, torch.zeros(b, hq, nq), softmax_scale=0.5, causal=True, config=base)
    bound = dict(zip(inspect.signature(calls[1][0][0].fn).parameters, (*calls[1][0][2], *calls[1][0][3])))
    assert bound["BLOCK_M"] == 128 and bound["DQ_SPLIT"] is True and bound["NUM_STAGES"] == 2
    assert bound["PT_REGS"] is False
    assert bound["DQacc"].shape == (b * hq, _rows(nq, 128), 64) == (b * hq, 384, 64)
    assert bound["LSE"].shape == (b * hq, 2, 384)
    calls.clear()
    fa3_gluon_backward(q, q, k, k, q, torch.zeros(b, hq, nq), softmax_scale=0.5, causal=True,
                       config=gluon_bwd_config(64, True, block_m=64))
    bound = dict(zip(inspect.signature(calls[1][0][0].fn).parameters, (*calls[1][0][2], *calls[1][0][3])))
    assert bound["BLOCK_M"] == 64 and bound["DQacc"].shape == (b * hq, 320, 64)  # 64-row steps: 64-row padding
    # the switches reach the kernel: pt_regs, and the group loop at 128-row steps (GQA 4:2, kv-head programs)
    for fields, hk in [(dict(pt_regs=True, pt_separate=False), hq), (dict(group_loop=True), 2),
                       (dict(group_loop=True, pt_regs=True, pt_separate=False), 2)]:
        calls.clear()
        kg = torch.zeros(b, hk, nk, d, dtype=BF16)
        fa3_gluon_backward(q, q, kg, kg, q, torch.zeros(b, hq, nq), softmax_scale=0.5, causal=True,
                           config=replace(base, **fields))
        bound = dict(zip(inspect.signature(calls[1][0][0].fn).parameters, (*calls[1][0][2], *calls[1][0][3])))
        assert bound["BLOCK_M"] == 128 and bound["PT_REGS"] is fields.get("pt_regs", False), fields
        assert bound["GROUP_LOOP"] is fields.get("group_loop", False) and calls[1][0][1] == (b * hk * 4,)
        assert bound["LSE"].shape == (b * hq, 2, 384) and bound["DQacc"].shape == (b * hq, 384, 64)
    for bad in (96, True, 0):
        with pytest.raises(ValueError, match="block_m"):
            gluon_bwd_config(64, True, block_m=bad)
    for d, group_loop in ((128, False), (64, True)):
        with pytest.raises(ValueError, match="block_m 128"):
            gluon_bwd_config(d, True, group_loop, block_m=128)
    # bench variants asking for 64-row steps or host descriptors start from the 64-row table config
    table = gluon_bwd_config(64, True)
    assert fa3_gluon_bwd.variant_base(table, 64, True, dict(host_desc=True)) == gluon_bwd_config(64, True, block_m=64)
    assert fa3_gluon_bwd.variant_base(table, 64, True, dict(block_m=64)) == gluon_bwd_config(64, True, block_m=64)
    assert fa3_gluon_bwd.variant_base(table, 64, True, dict(named_bars=False)) is table


def test_do_stages_configs(monkeypatch):
    """``do_stages`` 1 (dO in a one-slot ring of its own): the wide kernel's split step only; at 256-wide tiles it
    leaves room for both Pᵀ / dSᵀ buffers (214640 B compiled at d = 256, sm_90a, Triton 3.6; dO in the Q ring with
    one buffer: 230992), at 192-wide ones for a third Q stage; the kernel gets DO_STAGES."""
    base = replace(gluon_bwd_config(256, False), split_s=True, do_stages=1)
    for d in (136, 192, 200, 256):
        fa3_gluon_bwd._check_config(base, d, 2)  # accepted
    fa3_gluon_bwd._check_config(replace(base, dq_tma=False, pt_separate=True), 256, 2)
    fa3_gluon_bwd._check_config(replace(base, num_stages=3), 192, 2)
    assert 0 <= smem_bytes(base, 256) - 214640 <= 1024
    assert 0 <= smem_bytes(replace(base, do_stages=0), 256) - 230992 <= 1024
    assert base.do_depth() == 1 and replace(base, do_stages=0).do_depth() == 2
    for d, bad, what in [(256, replace(base, do_stages=2), "do_stages must be"),
                         (256, replace(base, do_stages=True), "do_stages must be"),
                         (256, replace(base, split_s=False), "do_stages 1 needs"),
                         (128, replace(gluon_bwd_config(128, False), do_stages=1), "do_stages 1 needs"),
                         (256, replace(base, num_stages=3), "shared memory")]:
        with pytest.raises(ValueError, match=what):
            fa3_gluon_bwd._check_config(bad, d, 2)
    calls = _record_launches(monkeypatch)
    q = torch.zeros(1, 2, 100, 256, dtype=BF16)
    fa3_gluon_backward(q, q, q, q, q, torch.zeros(1, 2, 100), softmax_scale=0.5, config=base)
    bound = dict(zip(inspect.signature(calls[1][0][0].fn).parameters, (*calls[1][0][2], *calls[1][0][3])))
    assert bound["DO_STAGES"] == 1 and bound["NUM_STAGES"] == 2 and bound["SPLIT_S"] is True


def test_wide_configs_refuse_what_the_wide_kernel_does_not_have(monkeypatch):
    """Above d = 128 a config must describe the wide kernel (no dQ split / swizzle / release-once, the statistics
    through shared memory, Pᵀ in its own tiles exactly when dQ is reduced from registers): anything else is a
    ValueError naming config, before any launch."""
    monkeypatch.setattr(fa3_gluon_bwd, "_check", lambda *a: None)  # no sm_90 device here
    # dq_tma: Pᵀ a register operand, no tile of its own
    base = GluonBwdConfig(num_stages=2, pingpong=True, stats_smem=True, dq_tma=True)
    registers = replace(base, dq_tma=False, pt_separate=True)  # dQ reduced from registers, Pᵀ in its own tiles
    table = gluon_bwd_config(256, False)  # dO in its own one-slot ring
    for cfg in (base, registers, replace(registers, split_s=True), replace(base, pingpong=False), table):
        for d in (136, 192, 256):
            fa3_gluon_bwd._check_config(cfg, d, 2)  # accepted
    for bad in (dict(stats_smem=False), dict(pt_separate=True), dict(dq_tma=False),
                dict(release_once=True, dq_split=True), dict(dq_split=True), dict(dq_swizzle32=True)):
        with pytest.raises(ValueError, match="config: above head_dim 128"):
            fa3_gluon_backward(*_args(d=192), softmax_scale=0.125, config=replace(base, **bad))
    # split_s with dQ through TMA, with 2 ring stages only unless dO has its own one-slot ring (192-wide tiles)
    fa3_gluon_bwd._check_config(replace(base, split_s=True), 136, 2)
    fa3_gluon_bwd._check_config(replace(base, split_s=True), 256, 2)
    with pytest.raises(ValueError, match="shared memory"):
        fa3_gluon_backward(*_args(d=192), softmax_scale=0.125, config=replace(base, split_s=True, num_stages=3))
    fa3_gluon_bwd._check_config(replace(table, num_stages=3), 192, 2)
    with pytest.raises(ValueError, match="shared memory"):
        fa3_gluon_backward(*_args(d=256), softmax_scale=0.125, config=replace(table, num_stages=3))
    fa3_gluon_bwd._check_config(replace(base, num_stages=3), 192, 2)  # 192-wide tiles: a third ring stage fits
    with pytest.raises(ValueError, match="shared memory"):  # 256-wide ones: not
        fa3_gluon_backward(*_args(d=200), softmax_scale=0.125, config=replace(base, num_stages=3))
    with pytest.raises(ValueError, match="shared memory"):
        fa3_gluon_backward(*_args(d=192), softmax_scale=0.125, config=replace(base, num_stages=4))
    with pytest.raises(ValueError, match="split_s is True only above head_dim 128"):  # a wide-kernel flag
        fa3_gluon_backward(*_args(d=128), softmax_scale=0.125, config=replace(gluon_bwd_config(128, False),
                                                                              split_s=True))


def _record_launches(monkeypatch) -> list:
    """The launchers' host steps on CPU tensors: no sm_90 check, allocator or device guard; every kernel launch
    recorded as ``((kernel, grid, dynamic, static), kwargs)`` instead of run."""
    import flashtile.runtime.fa3_fwd as fa3_fwd
    import flashtile.runtime.launch as launch_mod

    calls: list = []
    monkeypatch.setattr(fa3_gluon_bwd, "_check", lambda *a: None)
    monkeypatch.setattr(fa3_fwd, "ensure_allocator", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **kw: calls.append((a, kw)))
    return calls


@pytest.mark.parametrize("d,group_loop", [(128, False), (64, True), (96, False)])
def test_launcher_host_descriptors(monkeypatch, d, group_loop):
    """``host_desc``: the kernel gets descriptors over the whole q, k, v, dout (rank 4, [1, 1, 64, block_d] boxes in
    the tiles' swizzle, K's in half rows with dq_split), the flat statistics and the (B * Hq, rows, block_d)
    accumulator (the staging tiles' boxes and swizzle), HOST_DESC set; an expanded (stride 0) head axis, a packed
    batch or the flag off leave them to the kernel (Nones, HOST_DESC False)."""
    calls = _record_launches(monkeypatch)
    b, hq, hk, nq, nk = 2, 4, 2, 300, 500
    q = torch.zeros(b, nq, hq, d, dtype=BF16).transpose(1, 2)  # (B, N, H, d) storage
    k, v = (torch.zeros(b, hk, nk, d, dtype=BF16) for _ in range(2))
    lse = torch.zeros(b, hq, nq)
    cfg = replace(gluon_bwd_config(d, True, group_loop, block_m=64), host_desc=True)
    fa3_gluon_backward(q, q, k, v, q, lse, softmax_scale=0.5, causal=True, config=cfg)
    (kernel, grid, dynamic, static), _ = calls[1]
    bound = dict(zip(inspect.signature(kernel.fn).parameters, (*dynamic, *static)))
    bd = block_d(d)
    assert bound["HOST_DESC"] is True and bound["GROUP_LOOP"] is group_loop
    for name, x in (("QDesc", q), ("KDesc", k), ("VDesc", v), ("DODesc", q)):
        desc = bound[name]
        assert desc.base is x and desc.shape == list(x.shape) and desc.strides == list(x.stride())
        assert desc.block_shape == [1, 1, 64, bd]
        # the tiles' swizzle: K in half rows (dq_split: each warpgroup's column half whole atoms), the rest default
        assert desc.layout.swizzle_byte_width == (bd if name == "KDesc" else min(128, 2 * bd))
    stats, acc = bound["StatsDesc"], bound["DQDesc"]
    assert stats.base is bound["LSE"] and stats.shape == [bound["LSE"].numel()] and stats.block_shape == [64]
    assert acc.base is bound["DQacc"] and acc.shape == list(bound["DQacc"].shape) == [b * hq, _rows(nq), bd]
    assert acc.block_shape == [1, 64, bd // 2] and acc.layout.element_bitwidth == 32
    assert acc.layout.swizzle_byte_width == (32 if bd == 64 else 128)  # dq_swizzle32 at 64-wide tiles
    # kernel-built descriptors: the flag off, or an expanded head axis (no rank-4 stride for it)
    for qq, c in ((q, replace(cfg, host_desc=False)), (q[:, :1].expand(b, hq, nq, d), cfg)):
        calls.clear()
        fa3_gluon_backward(qq, qq, k, v, qq, lse, softmax_scale=0.5, causal=True, config=c)
        bound = dict(zip(inspect.signature(calls[1][0][0].fn).parameters, (*calls[1][0][2], *calls[1][0][3])))
        assert bound["HOST_DESC"] is False
        assert all(bound[n] is None for n in ("QDesc", "KDesc", "VDesc", "DODesc", "StatsDesc", "DQDesc"))


@pytest.mark.parametrize("d", [136, 192, 256])
def test_launcher_wide_host_descriptors(monkeypatch, d):
    """``host_desc`` above d = 128 (the wide kernel): descriptors over the whole q, dout, k, v, two column parts each
    ([1, 1, 64, 128] boxes and [1, 1, 64, TILE_D - 128] ones, the same descriptor at 256-wide tiles) in the tiles'
    swizzles, the flat statistics, the (B * Hq, rows, 256) accumulator in [1, 64, 32] boxes (the staging tiles');
    HOST_DESC set; the flag off or an expanded head axis leave them to the kernel (Nones); refused without dq_tma."""
    from flashtile.kernels.fa3_gluon_bwd_wide import fa3_gluon_bwd_wide_kernel

    calls = _record_launches(monkeypatch)
    b, hq, hk, nq, nk = 2, 4, 2, 300, 500
    q = torch.zeros(b, nq, hq, d, dtype=BF16).transpose(1, 2)  # (B, N, H, d) storage
    dout = torch.zeros(b, hq, nq, d, dtype=BF16)  # (B, H, N, d): strides unlike q's
    k = torch.zeros(b, hk, nk, d, dtype=BF16)
    v = torch.zeros(b, nk, hk, d, dtype=BF16).transpose(1, 2)  # strides unlike k's
    lse = torch.zeros(b, hq, nq)
    cfg = replace(gluon_bwd_config(d, True), host_desc=True)
    fa3_gluon_backward(dout, q, k, v, q, lse, softmax_scale=0.5, causal=True, config=cfg)
    (kernel, grid, dynamic, static), _ = calls[1]
    assert kernel is fa3_gluon_bwd_wide_kernel
    bound = dict(zip(inspect.signature(kernel.fn).parameters, (*dynamic, *static)))
    assert len(bound) == len(inspect.signature(kernel.fn).parameters) and bound["HOST_DESC"] is True
    hi = fa3_gluon_bwd.wide_tile_d(d) - 128
    for name, x in (("QDesc", q), ("DODesc", dout), ("KDesc", k), ("VDesc", v)):
        lo, high = bound[name], bound[name + "Hi"]
        for desc, width in ((lo, 128), (high, hi)):
            if desc is None:  # 256-wide tiles: the kernel reads both parts through the first
                assert hi == 128 and desc is high
                continue
            assert desc.base is x and desc.shape == list(x.shape) and desc.strides == list(x.stride())
            assert desc.block_shape == [1, 1, 64, width] and desc.layout.swizzle_byte_width == min(128, 2 * width)
        assert (high is None) is (hi == 128)
    stats, acc = bound["StatsDesc"], bound["DQDesc"]
    assert stats.base is bound["Stats"] and stats.shape == [bound["Stats"].numel()] and stats.block_shape == [64]
    assert acc.base is bound["DQacc"] and acc.shape == list(bound["DQacc"].shape) == [b * hq, _rows(nq), 256]
    assert acc.block_shape == [1, 64, 32] and acc.layout.element_bitwidth == 32 and acc.layout.rank == 3
    assert acc.layout.swizzle_byte_width == 128  # the [64, 32] fp32 staging tiles'
    names = ("QDesc", "QDescHi", "DODesc", "DODescHi", "KDesc", "KDescHi", "VDesc", "VDescHi", "StatsDesc", "DQDesc")
    for qq, c in ((q, replace(cfg, host_desc=False)), (q[:, :1].expand(b, hq, nq, d), cfg)):
        calls.clear()
        fa3_gluon_backward(qq, qq, k, v, qq, lse, softmax_scale=0.5, causal=True, config=c)
        bound = dict(zip(inspect.signature(calls[1][0][0].fn).parameters, (*calls[1][0][2], *calls[1][0][3])))
        assert bound["HOST_DESC"] is False and all(bound[n] is None for n in names)
    with pytest.raises(ValueError, match="host_desc above head_dim 128 needs dq_tma"):
        fa3_gluon_backward(q, q, k, v, q, lse, softmax_scale=0.5,
                           config=replace(cfg, dq_tma=False, pt_separate=True, split_s=False, do_stages=0))


def test_plan_builds_host_descriptors_per_call(monkeypatch):
    """``backward_plan`` with a ``host_desc`` config (the table's once timed): HOST_DESC bound, and each run passes
    descriptors over that run's own q, k, v, dout, statistics and accumulator; without it, Nones."""
    import flashtile.runtime.fa3_fwd as fa3_fwd
    import flashtile.runtime.launch as launch_mod

    runs = []

    def launcher(kernel, grid, dynamic, static, **kw):
        return lambda *dyn: runs.append((kernel, dyn, static))

    monkeypatch.setattr(launch_mod, "launcher", launcher)
    monkeypatch.setattr(fa3_fwd, "ensure_allocator", lambda: None)
    b, h, n, d = 2, 4, 300, 128
    q1, q2 = (torch.zeros(b, h, n, d, dtype=BF16) for _ in range(2))
    lse = torch.zeros(b, h, n)
    for host in (True, False):
        cfg = replace(gluon_bwd_config(d, True), host_desc=host)
        monkeypatch.setattr(fa3_gluon_bwd, "dispatch_config", lambda q, k, causal, cfg=cfg: cfg)
        run = fa3_gluon_bwd.backward_plan(q1, q1, q1, q1, q1, lse, q1, q1, q1, True)
        for q in (q1, q2):
            runs.clear()
            run(q, q, q, q, q, lse, q, q, q, 0.125)
            kernel, dyn, static = runs[1]
            bound = dict(zip(inspect.signature(kernel.fn).parameters, (*dyn, *static)))
            assert bound["HOST_DESC"] is host
            if host:
                assert all(bound[name].base is q for name in ("QDesc", "KDesc", "VDesc", "DODesc"))
                assert bound["StatsDesc"].base is bound["LSE"] and bound["DQDesc"].base is bound["DQacc"]
            else:
                assert all(bound[name] is None for name in ("QDesc", "KDesc", "VDesc", "DODesc", "StatsDesc",
                                                            "DQDesc"))


def test_host_descriptors_where_they_win(monkeypatch):
    """``dispatch_config`` takes host descriptors on the narrow kernel from HOST_DESC_MIN_WORK: 128-wide tiles at
    every length, 64-wide up to HOST_DESC_NARROW_MAX_KEYS keys; never with the group loop, the wide kernel or
    32-wide tiles."""
    from flashtile.runtime.fa3_gluon import HOST_DESC_MIN_WORK

    wins = fa3_gluon_bwd.host_desc_wins
    top = fa3_gluon_bwd.HOST_DESC_NARROW_MAX_KEYS
    assert wins(128, 16, 16, 1024, 1024, False) and wins(128, 1, 16, 16384, 16384, False) and wins(96, 4, 8, 4096,
                                                                                                   4096, False)
    assert wins(64, 16, 32, 1024, top, False) and not wins(64, 4, 32, 4096, top + 1, False)
    assert not wins(128, 16, 16, 1024, 1024, True)  # group loop
    assert not wins(192, 16, 16, 1024, 1024, False) and not wins(32, 16, 16, 1024, 1024, False)
    n = 256  # work just under and at the host-encoding threshold
    b = HOST_DESC_MIN_WORK // (n * n * 128)
    assert wins(128, b, 1, n, n, False) and not wins(128, b - 1, 1, n, n, False)
    q = torch.zeros(16, 16, 1024, 128, dtype=BF16)
    assert fa3_gluon_bwd.dispatch_config(q, q, True) == replace(gluon_bwd_config(128, True), host_desc=True)
    q = torch.zeros(1, 2, 64, 128, dtype=BF16)
    assert fa3_gluon_bwd.dispatch_config(q, q, False) == gluon_bwd_config(128, False)
    # 64-wide tiles: host descriptors (up to 1k keys) with the 64-row config, 128-row steps otherwise; the GQA
    # group loop on 64-row steps
    q = torch.zeros(16, 32, 1024, 64, dtype=BF16)
    want = replace(gluon_bwd_config(64, True, block_m=64), host_desc=True)
    assert fa3_gluon_bwd.dispatch_config(q, q, True) == want and want.block_m == 64 and want.num_stages == 4
    q = torch.zeros(4, 32, 4096, 64, dtype=BF16)
    assert fa3_gluon_bwd.dispatch_config(q, q, True) == gluon_bwd_config(64, True)
    assert gluon_bwd_config(64, True).block_m == 128 and gluon_bwd_config(64, True).named_bars
    k = torch.zeros(4, 8, 4096, 64, dtype=BF16)
    monkeypatch.setattr(fa3_gluon_bwd, "group_loop_wins", lambda *a: True)
    got = fa3_gluon_bwd.dispatch_config(q, k, True)
    assert got.group_loop and got.block_m == 64 and not got.named_bars


def test_plan_host_descriptors_over_the_planned_layout(monkeypatch):
    """The op's plan calls ``run`` with its own (B, N, H, d) tensors (flash-attn's layout): the host descriptors
    keep the (B, H, N, d) geometry the kernel indexes ([b, head, row, 0]) with each call's addresses, as the
    kernel's own strides do."""
    import flashtile.runtime.fa3_fwd as fa3_fwd
    import flashtile.runtime.launch as launch_mod
    from flashtile.ops import plan as plan_mod

    runs = []
    monkeypatch.setattr(launch_mod, "launcher",
                        lambda kernel, grid, dynamic, static, **kw: lambda *dyn: runs.append((kernel, dyn, static)))
    monkeypatch.setattr(fa3_fwd, "ensure_allocator", lambda: None)
    cfg = replace(gluon_bwd_config(128, True), host_desc=True)
    monkeypatch.setattr(fa3_gluon_bwd, "dispatch_config", lambda q, k, causal: cfg)
    monkeypatch.setattr(fa3_gluon_bwd, "prefer_gluon_bwd", lambda *a, **kw: True)
    b, n, h, d = 2, 300, 4, 128
    x = torch.zeros(b, n, h, d, dtype=BF16)
    lse = torch.zeros(b, h, n)
    plan = plan_mod._make_backward(x, x, x, x, x, lse, True, (-1, 0), True)
    for y in (x, torch.zeros_like(x)):
        runs.clear()
        plan(y, y, y, y, y, lse, 0.125)
        kernel, dyn, static = runs[1]
        bound = dict(zip(inspect.signature(kernel.fn).parameters, (*dyn, *static)))
        for name in ("QDesc", "KDesc", "VDesc", "DODesc"):
            desc = bound[name]
            assert desc.base.data_ptr() == y.data_ptr()
            assert desc.shape == [b, h, n, d] and desc.strides == list(y.transpose(1, 2).stride()), name
        assert [bound["stride_qb"], bound["stride_qh"], bound["stride_qm"]] == bound["QDesc"].strides[:3]


def test_statistics_span_past_int32_is_refused_or_avoided(monkeypatch):
    """The narrow kernel reads the rows' statistics through a 1-D descriptor of int32 coordinates spanning the
    group loop's heads: a span from 2^31 elements is refused by the launcher (ValueError naming the group loop),
    the dispatch keeps fp32 partials instead of the group loop there, and prefer_gluon_bwd declines one head past
    it (FA2's backward runs it); only shapes are read (meta tensors)."""
    import flashtile.runtime.fa3_gluon as fa3_gluon

    monkeypatch.setattr(fa3_gluon, "sm_count", lambda index: 132)
    meta = dict(dtype=BF16, device="meta")
    b, hq, hk, nq, nk, d = 1, 64, 1, 2**24, 128, 64  # 2 x 2^24 rows x 64 heads = 2^31
    q, k = torch.empty(b, hq, nq, d, **meta), torch.empty(b, hk, nk, d, **meta)
    cfg = replace(gluon_bwd_config(d, False, True), block_m=64)
    acc = torch.empty(b * hq, nq, d, dtype=F32, device="meta")
    with pytest.raises(ValueError, match="group_loop = True"):
        fa3_gluon_bwd.gluon_bwd_args(q, k, k, q, k, k, acc, False, cfg)
    assert not fa3_gluon_bwd.dispatch_config(q, k, False).group_loop
    q1 = torch.empty(b, hq, 2**24 - 128, d, **meta)  # just under: the group loop stays
    assert fa3_gluon_bwd.dispatch_config(q1, k, False).group_loop
    monkeypatch.setattr(fa3_gluon_bwd, "_prefer_views", lambda *a: True)  # the views' checks want a CUDA device
    keys = torch.empty(1, 1, 4096, 128, **meta)
    for rows, ok in [(2**30 - 128, True), (2**30, False)]:
        one = torch.empty(1, 1, rows, 128, **meta)
        assert fa3_gluon_bwd.prefer_gluon_bwd(one, keys, keys, one, causal=False, window=(-1, -1), plain=True,
                                              deterministic=False) is ok, rows


def test_launcher_group_loop(monkeypatch):
    """``group_loop`` (GQA): one program per (batch, kv head, kv tile), GROUP_LOOP set, dK / dV written straight
    into the kv heads' gradients in q's dtype (no fp32 partials, no sum on the host); refused without stats_smem
    and above head_dim 128."""
    calls = _record_launches(monkeypatch)
    b, hq, hk, nq, nk, d = 2, 8, 2, 300, 500, 128
    q = torch.zeros(b, nq, hq, d, dtype=BF16).transpose(1, 2)
    k = torch.zeros(b, hk, nk, d, dtype=BF16)
    lse = torch.zeros(b, hq, nq)
    cfg = gluon_bwd_config(d, True, True)
    dq, dk, dv = fa3_gluon_backward(q, q, k, k, q, lse, softmax_scale=0.5, causal=True, config=cfg)
    (kernel, grid, dynamic, static), _ = calls[1]
    bound = dict(zip(inspect.signature(kernel.fn).parameters, (*dynamic, *static)))
    assert bound["GROUP_LOOP"] is True and bound["GQA_PARTIAL"] is False
    assert grid == (b * hk * 4,) and bound["num_n_tiles"] == 4  # kv heads, not q heads
    assert bound["DK"] is dk and bound["DV"] is dv and dk.dtype == BF16 and dk.shape == (b, hk, nk, d)
    assert (bound["n_heads"], bound["kv_group"]) == (hq, hq // hk)
    for bad in (dict(stats_smem=False), ):
        with pytest.raises(ValueError, match="group_loop"):
            fa3_gluon_backward(q, q, k, k, q, lse, softmax_scale=0.5, config=replace(cfg, **bad))
    with pytest.raises(ValueError, match="group_loop"):
        fa3_gluon_backward(*_args(d=192), softmax_scale=0.125,
                           config=replace(gluon_bwd_config(192, False), group_loop=True))


def test_kv_tile_order():
    """The kernels' program order (host twin ``kv_tile_order``): a permutation of (unit, kv tile) for any group
    size; one unit a group is each unit's tiles in turn (the grid's plain order); otherwise groups of ``group``
    units, the first one the smaller when they do not divide, tile-major inside a group, so each group's first kv
    tiles come first."""
    for units, tiles, group in [(128, 16, 18), (21, 46, 6), (1, 64, 1), (7, 3, 7), (32, 64, 6), (5, 1, 4), (9, 2, 1)]:
        order = [fa3_gluon_bwd.kv_tile_order(p, tiles, units, group) for p in range(units * tiles)]
        assert sorted(order) == [(u, t) for u in range(units) for t in range(tiles)]
        if group == 1:
            assert order == [(p // tiles, p % tiles) for p in range(units * tiles)]
            continue
        first = units % group or group  # the first group's units; then whole groups
        bounds = [0, first] + list(range(first + group, units + 1, group))
        for lo, hi in zip(bounds, bounds[1:]):
            part = order[lo * tiles:hi * tiles]
            assert {u for u, _ in part} == set(range(lo, hi))
            assert [t for _, t in part] == sorted(t for _, t in part)  # the group's tile 0s, then its tile 1s ...


def test_lpt_heads_rule_and_launch(monkeypatch):
    """``lpt``: about two waves of programs a group (capped at the units there are), passed as ``lpt_heads`` to
    causal fixed-length launches of both kernels (units: (batch, q head), or kv head with the group loop); 1 (the
    plain order) without a causal mask, with the flag off and for packed batches.  Under the list-scheduling model
    the rule stands on (one program per SM, a program's time 1 + its q steps), the order's makespan is within 2.5 %
    of the ideal on the benchmark's causal shapes at 1k-8k keys, where each unit's tiles in turn leave 4-8 %."""
    import heapq

    assert fa3_gluon_bwd.lpt_heads(128, 16, 132) == 18 and fa3_gluon_bwd.lpt_heads(8, 16, 132) == 8
    assert fa3_gluon_bwd.lpt_heads(32, 64, 132) == 6 and fa3_gluon_bwd.lpt_heads(1, 1, 132) == 1

    def makespan(units, tiles, bn, group):
        heap = [0.0] * 132
        for p in range(units * tiles):
            _, t = fa3_gluon_bwd.kv_tile_order(p, tiles, units, group)
            heapq.heappush(heap, heapq.heappop(heap) + 1 + tiles * bn // 64 - t * bn // 64)
        total = units * sum(1 + tiles * bn // 64 - t * bn // 64 for t in range(tiles))
        return max(heap) / (total / 132)

    for units, n, bn in [(128, 1024, 64), (32, 4096, 64), (40, 4096, 64), (256, 1024, 128), (64, 4096, 128),
                         (32, 8192, 128), (160, 1024, 64)]:
        tiles = n // bn
        assert makespan(units, tiles, bn, fa3_gluon_bwd.lpt_heads(units, tiles, 132)) < 1.025
        assert makespan(units, tiles, bn, 1) > 1.04

    calls = _record_launches(monkeypatch)
    for d, group_loop, hk in [(128, False, 8), (64, True, 2), (256, False, 8)]:
        b, hq, n = 8, 8, 1000  # units 64 (16 with the group loop): groups of 34 / 18 at 128-key tiles, 32 at 64
        q = torch.zeros(b, hq, n, d, dtype=BF16)
        k = torch.zeros(b, hk, n, d, dtype=BF16)
        lse = torch.zeros(b, hq, n)
        for causal, lpt, want in [(True, True, None), (False, True, 1), (True, False, 1)]:
            cfg = replace(gluon_bwd_config(d, causal, group_loop, block_m=64), lpt=lpt)
            calls.clear()
            fa3_gluon_backward(q, q, k, k, q, lse, softmax_scale=0.5, causal=causal, config=cfg)
            (kernel, grid, dynamic, static), _ = calls[1]
            bound = dict(zip(inspect.signature(kernel.fn).parameters, (*dynamic, *static)))
            units = b * (hk if group_loop else hq)
            assert grid == (units * bound["num_n_tiles"],)
            assert bound["lpt_heads"] == (want or fa3_gluon_bwd.lpt_heads(units, bound["num_n_tiles"], 132)), \
                (d, causal, lpt)
            assert want or 1 < bound["lpt_heads"] < units or group_loop  # a rule, not one group of everything


def test_backward_into_paths(monkeypatch):
    """The ops' entry: no kernel and zero gradients without rows or keys; the kernels straight into the given
    gradients when Hq == Hk; under GQA into fp32 per-q-head partials, summed into dk / dv per kv head."""
    launched = []

    def fake_launch(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, cfg):
        launched.append((dq, dk, dv, cfg))
        dq.fill_(1.0), dk.fill_(2.0), dv.fill_(3.0)

    monkeypatch.setattr(fa3_gluon_bwd, "_launch_all", fake_launch)
    q = torch.zeros(1, 2, 8, 64, dtype=BF16)
    grads = [torch.full_like(q, float("nan")) for _ in range(3)]
    fa3_gluon_bwd.backward_into(q, q, q[:, :, :0], q[:, :, :0], q, torch.zeros(1, 2, 8), grads[0], grads[1][:, :, :0],
                                grads[2][:, :, :0], 0.1, False)
    assert not launched and (grads[0] == 0).all()  # no keys: dq is 0, no launch
    fa3_gluon_bwd.backward_into(q, q, q, q, q, torch.zeros(1, 2, 8), *grads, 0.1, True)
    assert launched[-1][0] is grads[0] and launched[-1][1] is grads[1] and launched[-1][3] == gluon_bwd_config(64, True)
    k = torch.zeros(1, 1, 8, 64, dtype=BF16)
    dk, dv = torch.empty_like(k), torch.empty_like(k)
    rule = []
    monkeypatch.setattr(fa3_gluon_bwd, "group_loop_wins", lambda *a: rule.append(a) or False)
    fa3_gluon_bwd.backward_into(q, q, k, k, q, torch.zeros(1, 2, 8), grads[0], dk, dv, 0.1, False)
    assert rule[-1] == (False, 1, 1, 8, None)  # causal, B, Hk, Nk, q's device index
    partial_dk = launched[-1][1]
    assert partial_dk.dtype == F32 and partial_dk.shape == (1, 2, 8, 64)  # per q head
    assert not launched[-1][3].group_loop
    assert (dk == 4.0).all() and (dv == 6.0).all()  # two q heads' partials summed into the kv head
    monkeypatch.setattr(fa3_gluon_bwd, "group_loop_wins", lambda *a: True)
    fa3_gluon_bwd.backward_into(q, q, k, k, q, torch.zeros(1, 2, 8), grads[0], dk, dv, 0.1, True)
    assert launched[-1][1] is dk and launched[-1][2] is dv and launched[-1][3] == gluon_bwd_config(64, True, True)


def test_group_loop_rule(monkeypatch):
    """``group_loop_wins``: non-causal always; causal from 3 programs (B * Hk * kv tiles of 128) per SM."""
    import flashtile.runtime.fa3_gluon as fa3_gluon

    monkeypatch.setattr(fa3_gluon, "sm_count", lambda index: 132)
    wins = fa3_gluon_bwd.group_loop_wins
    assert wins(False, 1, 1, 1, 0) and wins(False, 1, 2, 16384, 0)
    assert wins(True, 1, 4, 16384, 0) and wins(True, 4, 4, 4096, 0) and wins(True, 1, 1, 396 * 128, 0)
    assert not wins(True, 1, 2, 16384, 0) and not wins(True, 4, 2, 4096, 0) and not wins(True, 1, 1, 395 * 128, 0)


@pytest.mark.parametrize("d,hq,hk,causal,split,tma", [(40, 4, 2, True, False, False), (128, 2, 2, False, True, False),
                                                     (64, 2, 1, False, True, True)])
def test_launcher_passes_the_kernels_arguments(monkeypatch, d, hq, hk, causal, split, tma):
    """The launchers' runtime arguments and constexprs, bound to the kernels' signatures by position (as
    runtime.launch passes them): a mismatch would only show on a GPU."""
    from flashtile.kernels.fa3_gluon_bwd import dq_postprocess_kernel, fa3_gluon_bwd_kernel

    calls = _record_launches(monkeypatch)
    b, nq, nk = 2, 300, 500
    q = torch.zeros(b, nq, hq, d, dtype=BF16).transpose(1, 2)  # (B, N, H, d) storage
    k = torch.zeros(b, hk, nk, d, dtype=BF16)
    lse = torch.zeros(b, hq, nq)
    cfg = GluonBwdConfig(num_stages=2, dq_split=True, dq_tma=tma, pingpong=tma) if split else GluonBwdConfig(4)
    dq, dk, dv = fa3_gluon_backward(q, q, k, k, q, lse, softmax_scale=-0.5, causal=causal, config=cfg)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape and dk.dtype == BF16
    kernels = [c[0][0] for c in calls]
    assert kernels[1:] == [fa3_gluon_bwd_kernel, dq_postprocess_kernel]  # after FA2's preprocess (D)

    (kernel, grid, dynamic, static), kw = calls[1]
    params = list(inspect.signature(kernel.fn).parameters)
    bound = dict(zip(params, (*dynamic, *static)))
    assert kernel.is_gluon() and kw["num_warps"] == 4 and kw["bind"] and len(params) == len(dynamic) + len(static)
    assert bound["Q"] is q and bound["K"] is k and bound["DO"] is q and bound["LSE"] is lse  # fp32, contiguous
    assert bound["qk_scale"] == pytest.approx(-0.5 * 1.4426950408889634) and bound["softmax_scale"] == -0.5
    assert (bound["n_heads"], bound["kv_group"], bound["seqlen_q"], bound["seqlen_k"]) == (hq, hq // hk, nq, nk)
    assert bound["stride_qm"] == hq * d and bound["stride_kn"] == d and bound["num_n_tiles"] == 4
    assert grid == (b * hq * 4,)
    cfg = cfg or gluon_bwd_config(d, causal)
    assert (bound["HEAD_DIM"], bound["BLOCK_D"], bound["NUM_STAGES"], bound["CAUSAL"], bound["DQ_SPLIT"],
            bound["DQ_TMA"], bound["PINGPONG"]) == (d, block_d(d), cfg.num_stages, causal, cfg.dq_split, cfg.dq_tma,
                                                cfg.pingpong)
    assert (bound["CONSUMER_REGS"], bound["PRODUCER_REGS"]) == (240, 24)
    acc = bound["DQacc"]
    assert acc.dtype == F32 and acc.shape == (b * hq, _rows(nq), block_d(d)) and bound["stride_acc_h"] == _rows(nq) * block_d(d)
    assert not acc.any()  # zeroed: the kernel only adds
    if hq > hk:  # GQA: fp32 partials per q head, summed on the host
        assert bound["GQA_PARTIAL"] and bound["DK"].dtype == F32 and bound["DK"].shape == (b, hq, nk, d)
    else:
        assert not bound["GQA_PARTIAL"] and bound["DK"] is dk and bound["DV"] is dv
    assert bound["Delta"].shape == (b, hq, nq) and bound["Delta"].dtype == F32

    (kernel, grid, dynamic, static), kw = calls[2]
    post = dict(zip(inspect.signature(kernel.fn).parameters, (*dynamic, *static)))
    assert post["DQacc"] is acc and post["DQ"] is dq and post["scale"] == -0.5
    assert (post["stride_acc_h"], post["stride_acc_m"], post["n_heads"], post["seqlen_q"]) == (
        _rows(nq) * block_d(d), block_d(d), hq, nq)
    assert (post["HEAD_DIM"], post["BLOCK_D"]) == (d, block_d(d)) and grid == (b * hq * post["num_tiles"],)
    assert post["num_tiles"] * post["BLOCK"] >= nq > (post["num_tiles"] - 1) * post["BLOCK"]


def test_launcher_stats_smem_passes_the_padded_statistics(monkeypatch):
    """``stats_smem``: the statistics preprocess runs instead of FA2's, and its (B * Hq, 2, Nq rounded up to 64)
    buffer is the kernel's LSE (rows padded as the dQ accumulator's: the kernel derives one from the other)."""
    from flashtile.kernels.fa3_gluon_bwd import dq_postprocess_kernel, fa3_gluon_bwd_kernel, stats_preprocess_kernel

    calls = _record_launches(monkeypatch)
    b, hq, hk, nq, nk, d = 2, 4, 2, 300, 500, 128
    q = torch.zeros(b, nq, hq, d, dtype=BF16).transpose(1, 2)
    k = torch.zeros(b, hk, nk, d, dtype=BF16)
    lse = torch.zeros(b, nq, hq).transpose(1, 2)  # strided: read in place by the preprocess
    cfg = GluonBwdConfig(num_stages=2, dq_split=True, dq_tma=True, pingpong=True, stats_smem=True, pt_separate=True)
    fa3_gluon_backward(q, q, k, k, q, lse, softmax_scale=0.5, causal=True, config=cfg)
    assert [c[0][0] for c in calls] == [stats_preprocess_kernel, fa3_gluon_bwd_kernel, dq_postprocess_kernel]

    (kernel, grid, dynamic, static), _ = calls[0]
    pre = dict(zip(inspect.signature(kernel.fn).parameters, (*dynamic, *static)))
    assert pre["LSE"] is lse and pre["Out"] is q and pre["DOut"] is q
    assert (pre["stride_lb"], pre["stride_lh"], pre["stride_lm"]) == lse.stride()
    assert (pre["n_heads"], pre["n_bh"], pre["seqlen_q"], pre["stats_rows"]) == (hq, b * hq, nq, _rows(nq))
    assert grid[0] * pre["BLOCK"] == _rows(nq) and grid[1] * grid[2] >= b * hq

    (kernel, grid, dynamic, static), _ = calls[1]
    bound = dict(zip(inspect.signature(kernel.fn).parameters, (*dynamic, *static)))
    stats = bound["LSE"]
    assert stats is pre["Stats"] and stats.shape == (b * hq, 2, _rows(nq)) and stats.dtype == F32 and stats.is_contiguous()
    assert bound["STATS_SMEM"] is True and bound["stride_acc_h"] // bound["BLOCK_D"] == _rows(nq)
    assert (bound["NUM_STAGES"], bound["DQ_SPLIT"], bound["DQ_TMA"], bound["PINGPONG"]) == (2, True, True, True)
    assert (bound["DQ_SWIZZLE32"], bound["PT_SEPARATE"], bound["RELEASE_ONCE"]) == (False, True, False)
    assert bound["NAMED_BARS"] is False
    # the preprocess zeroes the accumulator the kernel adds into (no separate memset)
    assert pre["ZERO_ACC"] is True and pre["DQacc"] is bound["DQacc"]

    calls.clear()
    fa3_gluon_backward(q, q, k, k, q, lse, softmax_scale=0.5, causal=True, config=GluonBwdConfig(num_stages=2))
    bound = dict(zip(inspect.signature(calls[1][0][0].fn).parameters, (*calls[1][0][2], *calls[1][0][3])))
    assert bound["STATS_SMEM"] is False and bound["LSE"].shape == (b, hq, nq)  # the flag off: as before
    assert bound["DQ_SWIZZLE32"] is False and bound["PT_SEPARATE"] is False and bound["RELEASE_ONCE"] is False
    calls.clear()
    fa3_gluon_backward(q, q, k, k, q, lse, softmax_scale=0.5, causal=True, config=replace(cfg, named_bars=True))
    bound = dict(zip(inspect.signature(calls[1][0][0].fn).parameters, (*calls[1][0][2], *calls[1][0][3])))
    assert bound["NAMED_BARS"] is True and bound["PINGPONG"] is True


def test_launcher_wide_kernel_arguments(monkeypatch):
    """d > 128: the statistics kernel (zeroing the accumulator), the wide kernel over 64-key tiles (192-wide at
    d = 192, the accumulator's rows 256 wide), then the dQ postprocess; arguments bound to the wide kernel's
    signature by position, GQA partials."""
    from flashtile.kernels.fa3_gluon_bwd import dq_postprocess_kernel, stats_preprocess_kernel
    from flashtile.kernels.fa3_gluon_bwd_wide import fa3_gluon_bwd_wide_kernel

    calls = _record_launches(monkeypatch)
    b, hq, hk, nq, nk, d = 2, 4, 2, 300, 500, 192
    q = torch.zeros(b, nq, hq, d, dtype=BF16).transpose(1, 2)
    k = torch.zeros(b, hk, nk, d, dtype=BF16)
    lse = torch.zeros(b, hq, nq)
    fa3_gluon_backward(q, q, k, k, q, lse, softmax_scale=0.5, causal=True)
    assert [c[0][0] for c in calls] == [stats_preprocess_kernel, fa3_gluon_bwd_wide_kernel, dq_postprocess_kernel]
    pre = dict(zip(inspect.signature(calls[0][0][0].fn).parameters, (*calls[0][0][2], *calls[0][0][3])))
    (kernel, grid, dynamic, static), kw = calls[1]
    params = list(inspect.signature(kernel.fn).parameters)
    bound = dict(zip(params, (*dynamic, *static)))
    assert kernel.is_gluon() and kw["num_warps"] == 4 and len(params) == len(dynamic) + len(static)
    assert bound["Stats"] is pre["Stats"] and bound["DQacc"] is pre["DQacc"] and pre["ZERO_ACC"] is True
    assert bound["DQacc"].shape == (b * hq, _rows(nq), 256) and bound["stride_acc_h"] == _rows(nq) * 256
    assert (bound["HEAD_DIM"], bound["BLOCK_D"], bound["TILE_D"], bound["NUM_STAGES"], bound["CAUSAL"],
            bound["PINGPONG"], bound["SPLIT_S"], bound["DQ_TMA"]) == (d, 256, 192, 2, True, True, True, True)
    assert bound["DO_STAGES"] == 1  # dO in its own one-slot ring (the table's)
    assert bound["num_n_tiles"] == 8 and grid == (b * hq * 8,)  # 64-key tiles
    assert bound["GQA_PARTIAL"] and bound["DK"].dtype == F32 and bound["DK"].shape == (b, hq, nk, d)
    assert (bound["n_heads"], bound["kv_group"], bound["seqlen_q"], bound["seqlen_k"]) == (hq, 2, nq, nk)
    assert bound["qk_scale"] == pytest.approx(0.5 * 1.4426950408889634) and bound["softmax_scale"] == 0.5


@pytest.mark.parametrize("d", [40, 72, 136])
def test_stats_preprocess_matches_torch(d):
    """Interpreted: row 0 LSE · log2 e (+inf on a -inf row and past Nq), row 1 rowsum(dO∘O) (0 past Nq), rows padded
    to 64; O in (B, N, H, d) storage, LSE strided; programs of 64, 32 and 16 rows (``rows_per_program``)."""
    import math

    assert fa3_gluon_bwd.rows_per_program(d) == {40: 64, 72: 32, 136: 16}[d]
    assert [fa3_gluon_bwd.rows_per_program(x) for x in (64, 128, 192, 256)] == [64] * 4
    b, h, nq = 2, 3, 70
    g = torch.Generator().manual_seed(1)
    out = torch.randn(b, nq, h, d, generator=g).to(BF16).transpose(1, 2)
    dout = torch.randn(b, h, nq, d, generator=g).to(BF16)
    lse = torch.randn(b, nq, h, generator=g).transpose(1, 2)
    lse[0, 1, 5] = lse[1, 2, nq - 1] = float("-inf")  # rows that see no key
    acc = torch.full((b * h, 128, block_d(d)), float("nan"))
    stats = stats_preprocess(out, dout, lse, acc)
    assert stats.shape == (b * h, 2, 128) and stats.dtype == F32
    assert (acc == 0).all()  # the dQ accumulator zeroed, padding rows and columns too
    with pytest.raises(ValueError, match="dq_acc"):
        stats_preprocess(out, dout, lse, acc[:, :64])
    ref_d = (out.double() * dout.double()).sum(-1).reshape(b * h, nq)
    ref_l = lse.double().reshape(b * h, nq) / math.log(2)
    ref_l = torch.where(torch.isinf(ref_l), float("inf"), ref_l)
    assert_close(stats[:, 1, :nq], ref_d, F32, "cpu", "D", magnitude=float(ref_d.abs().max()))
    assert torch.equal(stats[:, 0, :nq].isinf(), ref_l.isinf()) and (stats[:, 0, :nq][ref_l.isinf()] > 0).all()
    fin = ref_l.isfinite()
    assert_close(stats[:, 0, :nq][fin], ref_l[fin], F32, "cpu", "LSE log2e", magnitude=float(ref_l[fin].abs().max()))
    assert (stats[:, 0, nq:] == float("inf")).all() and (stats[:, 1, nq:] == 0).all()


@pytest.mark.parametrize("dtype,d", [(BF16, 40), (F16, 64), (BF16, 72), (F16, 136)])
def test_dq_postprocess_scales_and_casts(dtype, d):
    """Interpreted: dq = scale * acc[:, :Nq, :d] into a (B, N, H, d)-strided view; padding rows and columns unread;
    programs of 64, 32 and 16 rows."""
    b, h, nq, bd = 2, 3, 100, block_d(d)
    g = torch.Generator().manual_seed(d)
    acc = torch.randn(b * h, 128, bd, generator=g)
    acc[:, nq:] = float("nan")  # padding: never read
    acc[:, :, d:] = float("nan")
    dq = torch.full((b, nq, h, d), float("nan"), dtype=dtype).transpose(1, 2)
    dq_postprocess(acc, dq, -0.3)
    ref = acc.double().view(b, h, 128, bd)[:, :, :nq, :d] * -0.3
    assert_close(dq, ref, dtype, "cpu", "dq", tol=torch.finfo(dtype).eps)  # one rounding to dtype


def _varlen_row0(starts):
    from flashtile.kernels.fa3_gluon_bwd import VARLEN_PAD

    return [(s + 3) // 4 * 4 + VARLEN_PAD * i for i, s in enumerate(starts)]


# packed batches: an empty sequence, lengths under, at and over 64, one row
VARLEN_LENS = [70, 0, 64, 1, 130]


@pytest.mark.parametrize("d", [40, 136])
def test_varlen_stats_preprocess_layout(d):
    """Interpreted, packed batch: each sequence's [2, rows rounded up to 64] block at its padded offset of the head's
    (Hq, 2 * varlen_rows) statistics (LSE · log2 e then D, +inf / 0 on its padding rows), its accumulator rows
    zeroed, no other row written; the rows come from the device cu_seqlens, clamped (a bad entry stays inside);
    programs of 64 rows and of 16 (every 64-row box still covered)."""
    import math

    from flashtile.kernels.fa3_gluon_bwd import varlen_rows

    h = 3
    total = sum(VARLEN_LENS)
    cu = torch.tensor([0, *torch.tensor(VARLEN_LENS).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    out = torch.randn(total, h, d, generator=g).to(BF16)
    dout = torch.randn(total, h, d, generator=g).to(BF16)
    lse = torch.randn(h, total, generator=g)
    lse[1, 3] = float("-inf")
    rows = varlen_rows(total, len(VARLEN_LENS))
    acc = torch.full((h, rows, block_d(d)), float("nan"))
    pv = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731 (the kernels' packed view)
    stats = stats_preprocess(pv(out), pv(dout), lse.unsqueeze(0), acc, varlen=(cu, max(VARLEN_LENS)))
    assert stats.shape == (h, 2 * rows)
    written = torch.zeros(h, 2 * rows, dtype=torch.bool)
    for (start, n), row0 in zip(zip(cu[:-1].tolist(), VARLEN_LENS), _varlen_row0(cu[:-1].tolist())):
        padded = -(-n // 64) * 64
        blk = stats[:, 2 * row0: 2 * row0 + 2 * padded].view(h, 2, padded)
        written[:, 2 * row0: 2 * row0 + 2 * padded] = True
        ref_d = (out[start:start + n].double() * dout[start:start + n].double()).sum(-1).T
        ref_l = lse[:, start:start + n].double() / math.log(2)
        assert_close(blk[:, 1, :n], ref_d, F32, "cpu", "D", magnitude=1.0)
        fin = ref_l.isfinite()
        assert_close(blk[:, 0, :n][fin], ref_l[fin], F32, "cpu", "LSE log2e", magnitude=1.0)
        assert (blk[:, 0, :n][~fin] == float("inf")).all()
        assert (blk[:, 0, n:] == float("inf")).all() and (blk[:, 1, n:] == 0).all()
        assert (acc[:, row0:row0 + padded] == 0).all()
        acc[:, row0:row0 + padded] = float("nan")
    assert acc.isnan().all()  # no other accumulator row written
    with pytest.raises(ValueError, match="dq_acc"):
        stats_preprocess(pv(out), pv(dout), lse.unsqueeze(0), acc[:, :64], varlen=(cu, max(VARLEN_LENS)))
    # cu_seqlens negative, past the tensors, decreasing, extreme; max_seqlen above and below the real lengths:
    # clamped, every write inside the statistics and accumulator (their rows after a guard band stay untouched)
    real_empty = torch.empty
    n_stats, n_acc = h * 2 * rows, h * rows * block_d(d)
    for bad, max_len in [([-5, 10**6, 3, 2, 9, total + 7], 130), ([0, 2**31 - 1, -2**31, 5, 5, 1], 400),
                         ([0, 70, 70, 134, 135, 265], 3), ([200, 100, 0, 265, 265, 265], 500)]:
        stats_flat = torch.full((n_stats + 4096,), 7.0)
        acc_flat = torch.full((n_acc + 4096,), 7.0)
        torch.empty = lambda *a, **kw: stats_flat[:n_stats].view(h, 2 * rows)  # the statistics buffer  # noqa: E731
        try:
            stats_preprocess(pv(out), pv(dout), lse.unsqueeze(0), acc_flat[:n_acc].view(h, rows, block_d(d)),
                             varlen=(torch.tensor(bad, dtype=torch.int32), max_len))
        finally:
            torch.empty = real_empty
        assert (stats_flat[n_stats:] == 7.0).all() and (acc_flat[n_acc:] == 7.0).all(), bad


@pytest.mark.parametrize("dtype,d", [(BF16, 40), (F16, 64), (BF16, 200)])
def test_varlen_dq_postprocess(dtype, d):
    """Interpreted, packed batch: dq's rows of sequence b = scale * its accumulator rows at the padded offset."""
    from flashtile.kernels.fa3_gluon_bwd import varlen_rows

    h, bd = 2, block_d(d)
    total = sum(VARLEN_LENS)
    cu = torch.tensor([0, *torch.tensor(VARLEN_LENS).cumsum(0).tolist()], dtype=torch.int32)
    acc = torch.randn(h, varlen_rows(total, len(VARLEN_LENS)), bd, generator=torch.Generator().manual_seed(d))
    dq = torch.full((total, h, d), float("nan"), dtype=dtype)
    dq_postprocess(acc, dq.transpose(0, 1).unsqueeze(0), 0.7, varlen=(cu, max(VARLEN_LENS)))
    for start, n, row0 in zip(cu[:-1].tolist(), VARLEN_LENS, _varlen_row0(cu[:-1].tolist())):
        ref = acc[:, row0:row0 + n, :d].double().transpose(0, 1) * 0.7
        assert_close(dq[start:start + n], ref, dtype, "cpu", "dq", tol=torch.finfo(dtype).eps)


def test_varlen_launcher_and_refusals(monkeypatch):
    """The packed backward: statistics, the narrow kernel with IS_VARLEN over B * Hq * cdiv(max_seqlen_k, 128)
    programs on (1, H, total, d) views, then the postprocess; GQA partials summed per kv head; the dispatch
    rule (``prefer_gluon_bwd_varlen``); head dims outside 40-128, a bad lse or cu_seqlens refused naming the
    argument."""
    from flashtile.kernels.fa3_gluon_bwd import fa3_gluon_bwd_kernel, varlen_rows

    calls = _record_launches(monkeypatch)
    hq, hk, d = 4, 2, 128
    total_q, total_k = sum(VARLEN_LENS), 300
    cu_q = torch.tensor([0, *torch.tensor(VARLEN_LENS).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, 60, 60, 200, 201, 300], dtype=torch.int32)
    q = torch.zeros(total_q, hq, d, dtype=BF16)
    k = torch.zeros(total_k, hk, d, dtype=BF16)
    lse = torch.zeros(hq, total_q)
    dq, dk, dv = fa3_gluon_bwd.fa3_gluon_varlen_backward(q, q, k, k, q, lse, cu_q, cu_k, 130, 140,
                                                         softmax_scale=0.5, causal=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dk.dtype == BF16
    (kernel, grid, dynamic, static), kw = calls[1]
    bound = dict(zip(inspect.signature(kernel.fn).parameters, (*dynamic, *static)))
    assert kernel is fa3_gluon_bwd_kernel and bound["IS_VARLEN"] is True and bound["GROUP_LOOP"] is False
    assert bound["CuQ"] is not None and torch.equal(bound["CuQ"], cu_q) and torch.equal(bound["CuK"], cu_k)
    assert (bound["seqlen_q"], bound["seqlen_k"], bound["total_q"], bound["total_k"]) == (130, 140, total_q, total_k)
    assert grid == (5 * hq * 2,) and bound["num_n_tiles"] == 2  # sequences x q heads x cdiv(140, 128)
    assert bound["lpt_heads"] == 1  # packed: each sequence's kv tiles in turn, lpt or not
    assert bound["Q"].shape == (1, hq, total_q, d) and bound["stride_qm"] == hq * d
    rows = varlen_rows(total_q, 5)
    assert bound["DQacc"].shape == (hq, rows, 128) and bound["stride_acc_h"] == rows * 128
    assert bound["LSE"].shape == (hq, 2 * rows) and bound["STATS_SMEM"]
    assert bound["GQA_PARTIAL"] and bound["DK"].dtype == F32 and bound["DK"].shape == (1, hq, total_k, d)
    pre = dict(zip(inspect.signature(calls[0][0][0].fn).parameters, (*calls[0][0][2], *calls[0][0][3])))
    post = dict(zip(inspect.signature(calls[2][0][0].fn).parameters, (*calls[2][0][2], *calls[2][0][3])))
    assert pre["IS_VARLEN"] and post["IS_VARLEN"] and pre["Stats"] is bound["LSE"] and post["DQacc"] is bound["DQacc"]
    with pytest.raises(NotImplementedError, match="head_dim"):
        fa3_gluon_bwd.fa3_gluon_varlen_backward(q[..., :32], q[..., :32], k[..., :32], k[..., :32], q[..., :32], lse,
                                                cu_q, cu_k, 130, 140, softmax_scale=0.5)
    with pytest.raises(ValueError, match="lse"):
        fa3_gluon_bwd.fa3_gluon_varlen_backward(q, q, k, k, q, lse.T, cu_q, cu_k, 130, 140, softmax_scale=0.5)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        fa3_gluon_bwd.fa3_gluon_varlen_backward(q, q, k, k, q, lse, cu_q.long(), cu_k, 130, 140, softmax_scale=0.5)
    with pytest.raises(ValueError, match="softmax_scale"):
        fa3_gluon_bwd.fa3_gluon_varlen_backward(q, q, k, k, q, lse, cu_q, cu_k, 130, 140, softmax_scale=math.nan)
    calls.clear()  # no keys anywhere: zero gradients, no launch
    got = fa3_gluon_bwd.fa3_gluon_varlen_backward(q, q, k, k, q, lse, cu_q, cu_k, 130, 0, softmax_scale=0.5)
    assert not calls and all((g == 0).all() for g in got)
    # dispatch: on by default, refused on CPU tensors (the sm_90 part: test_gpu_varlen_*), and where the
    # fixed-length rule would keep FA2 (64-wide tiles under 2k keys), and with VARLEN off
    assert fa3_gluon_bwd.VARLEN is True
    args = dict(causal=False, window=(-1, -1), plain=True, deterministic=False, capability=(9, 0), max_seqlen_k=140,
                n_seqs=2)
    assert not fa3_gluon_bwd.prefer_gluon_bwd_varlen(q, k, k, q, **args)  # a CPU tensor
    monkeypatch.setattr(fa3_gluon_bwd, "_prefer_views", lambda *a: True)  # as on an sm_90 device
    assert fa3_gluon_bwd.prefer_gluon_bwd_varlen(q, k, k, q, **args)
    q64, k64 = q[..., :64], k[..., :64]
    assert not fa3_gluon_bwd.prefer_gluon_bwd_varlen(q64, k64, k64, q64, **args)
    # packed at 64-wide tiles (64-row steps): from 4k keys, where the fixed-length rule takes 2k
    assert fa3_gluon_bwd.gluon_bwd_wins(64, False, 2048)
    assert not fa3_gluon_bwd.prefer_gluon_bwd_varlen(q64, k64, k64, q64, **{**args, "max_seqlen_k": 4095})
    assert fa3_gluon_bwd.prefer_gluon_bwd_varlen(q64, k64, k64, q64, **{**args, "max_seqlen_k": 4096})
    assert not fa3_gluon_bwd.prefer_gluon_bwd_varlen(q[..., :32], k[..., :32], k[..., :32], q[..., :32], **args)
    assert not fa3_gluon_bwd.prefer_gluon_bwd_varlen(q, k, k, q, **{**args, "n_seqs": 5})  # padding > total_q
    monkeypatch.setattr(fa3_gluon_bwd, "VARLEN", False)
    assert not fa3_gluon_bwd.prefer_gluon_bwd_varlen(q, k, k, q, **args)


def test_varlen_wide_launcher(monkeypatch):
    """Above d = 128 the packed backward launches the wide kernel with IS_VARLEN (192-wide tiles at d = 192, 64-key
    tiles: B * Hq * cdiv(max_seqlen_k, 64) programs); dispatched with ``VARLEN_WIDE`` (on), not without it."""
    from flashtile.kernels.fa3_gluon_bwd_wide import fa3_gluon_bwd_wide_kernel

    calls = _record_launches(monkeypatch)
    cu_q = torch.tensor([0, *torch.tensor(VARLEN_LENS).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, 60, 60, 200, 201, 300], dtype=torch.int32)
    q = torch.zeros(sum(VARLEN_LENS), 2, 192, dtype=BF16)
    k = torch.zeros(300, 2, 192, dtype=BF16)
    fa3_gluon_bwd.fa3_gluon_varlen_backward(q, q, k, k, q, torch.zeros(2, q.shape[0]), cu_q, cu_k, 130, 140,
                                            softmax_scale=0.5)
    (kernel, grid, dynamic, static), _ = calls[1]
    bound = dict(zip(inspect.signature(kernel.fn).parameters, (*dynamic, *static)))
    assert kernel is fa3_gluon_bwd_wide_kernel and bound["IS_VARLEN"] is True and bound["TILE_D"] == 192
    assert grid == (5 * 2 * 3,) and bound["CuQ"] is not None and bound["total_k"] == 300 and not bound["GQA_PARTIAL"]
    args = dict(causal=False, window=(-1, -1), plain=True, deterministic=False, capability=(9, 0), max_seqlen_k=140,
                n_seqs=2)
    monkeypatch.setattr(fa3_gluon_bwd, "_prefer_views", lambda *a: True)  # as on an sm_90 device
    assert fa3_gluon_bwd.VARLEN_WIDE is True and fa3_gluon_bwd.prefer_gluon_bwd_varlen(q, k, k, q, **args)
    monkeypatch.setattr(fa3_gluon_bwd, "VARLEN_WIDE", False)
    assert not fa3_gluon_bwd.prefer_gluon_bwd_varlen(q, k, k, q, **args)


def test_varlen_fits():
    """The packed backward's batch rule: padding at most doubling the statistics / accumulator rows, at most 2^18
    programs or 8x those with keys (one long sequence among many short ones: FA2), fewer than 2^31 programs."""
    fits = fa3_gluon_bwd.varlen_fits
    assert fits(40, 16, 65536, 65536, 8192)  # the bench's batch: 40 sequences of 128..8k
    assert not fits(2000, 32, 2000 * 16, 2000 * 16, 16)  # 16-token sequences: 68 rows of padding each
    assert not fits(500, 32, 8192 + 499 * 200, 8192 + 499 * 200, 8192)  # one 8k sequence, 499 of 200: idle grid
    assert fits(500, 32, 500 * 300, 500 * 300, 300)
    assert not fits(2**20, 2**12, 2**40, 2**40, 2**20)  # >= 2^31 programs


def test_varlen_op_routes_to_the_gluon_backward(monkeypatch):
    """``_varlen_bwd_impl``: with ``prefer_gluon_bwd_varlen`` true, the packed Gluon backward gets the op's
    tensors, cu_seqlens, max_seqlen, scale and causal flag; softcap / ALiBi / dropout / windows reach the rule as
    not plain or windowed, and FA2's backward runs instead."""
    from flashtile.ops import autograd

    seen, got = [], []
    monkeypatch.setattr(fa3_gluon_bwd, "prefer_gluon_bwd_varlen", lambda *a, **kw: seen.append(kw) or kw["plain"])
    monkeypatch.setattr(fa3_gluon_bwd, "fa3_gluon_varlen_backward",
                        lambda *a, **kw: got.append((a, kw)) or tuple(torch.zeros_like(x) for x in a[1:4]))
    q = torch.randn(10, 2, 16)
    k = torch.randn(12, 1, 16)
    cu_q, cu_k = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    lse = torch.zeros(2, 10)
    rng = torch.zeros(2, dtype=torch.int64)
    autograd._varlen_bwd_impl(q, q, k, k, q, lse, rng, cu_q, cu_k, None, None, 6, 7, 0.25, True, -1, 0, 0.0, 0.0,
                              False)
    (args, kw), = got
    assert args[0] is q and args[2] is k and args[6] is cu_q and args[7] is cu_k and args[8:] == (6, 7)
    assert kw == dict(softmax_scale=0.25, causal=True)
    assert seen[-1]["max_seqlen_k"] == 7 and seen[-1]["n_seqs"] == 2 and seen[-1]["window"] == (-1, 0)
    grads = autograd._varlen_bwd_impl(q, q, k, k, q, lse, rng, cu_q, cu_k, None, None, 6, 7, 0.25, True, -1, 0,
                                      5.0, 0.0, False)  # softcap: not plain, FA2 (interpreted)
    assert not seen[-1]["plain"] and len(got) == 1 and grads[0].shape == q.shape


@pytest.mark.parametrize("causal", [False, True])
def test_float64_twin_at_the_kernels_tiling(causal):
    """The kernel's algorithm (kv tiles of 128 outer, q tiles of 64 inner, dQ summed over kv tiles) is
    reference.backward.flash_attn_backward with block_sizes = (64, 128): equal to the oracle on ragged GQA shapes
    whose tiles cross Nq, Nk and the diagonal."""
    from flashtile.reference.backward import flash_attn_backward

    for nq, nk in [(133, 300), (300, 133)]:
        q, k, v, do = inputs(1, 4, 2, nq, nk, 16, torch.float64, "cpu", seed=nq)
        out, lse, dq, dk, dv = attention_ref_grads(q, k, v, do, scale=0.3, causal=causal)
        got = flash_attn_backward(q, k, v, out, do, lse, softmax_scale=0.3, causal=causal, block_sizes=(64, 128))
        for name, a, r in zip(("dq", "dk", "dv"), got[:3], (dq, dk, dv)):
            assert_close(a, r, torch.float64, "cpu", name)


def test_gqa_group_loop_keeps_fa2_under_4k_keys_at_64_wide_tiles(monkeypatch):
    """64-wide tiles from 2k keys were measured at 128-row steps: a GQA call that takes the group loop (64-row
    steps) stays on FA2's backward under 4k keys; multi-head calls take Gluon from 2k."""
    monkeypatch.setattr(fa3_gluon_bwd, "_prefer_views", lambda *a: True)  # as on an sm_90 device
    kw = dict(causal=False, window=(-1, -1), plain=True, deterministic=False)

    def prefer(hq, hk, n):
        q = torch.zeros(1, hq, n, 64, dtype=BF16)
        k = torch.zeros(1, hk, n, 64, dtype=BF16)
        return fa3_gluon_bwd.prefer_gluon_bwd(q, k, k, q, **kw)

    assert fa3_gluon_bwd.dispatch_config(torch.zeros(1, 8, 2048, 64), torch.zeros(1, 2, 2048, 64), False).group_loop
    assert prefer(8, 8, 2048) and not prefer(8, 2, 2048) and not prefer(8, 2, 4095) and prefer(8, 2, 4096)
    assert not prefer(8, 8, 2047)


def test_tiled_gradient_check_catches_what_the_whole_tensor_check_misses():
    """The per-tile check (``assert_grads`` with a :class:`TiledRef`): a causal call's last keys' dk zeroed or
    sign-flipped passes the whole-tensor tolerance (the early keys' size and rounding bound) but not the tile's;
    the oracle's own gradients pass both."""
    from tests.kernels.test_fa2_bwd import inputs as f64_inputs

    q, k, v, do = f64_inputs(1, 2, 1, 512, 512, 64, torch.float64, "cpu", seed=3)
    q, k, v, do = (x.to(BF16).double() for x in (q, k, v, do))  # bf16 values, float64 arithmetic
    _, _, dq, dk, dv = attention_ref_grads(q, k, v, do, scale=0.125, causal=True)
    ref = tiled_ref(dq, dk, dv, [q, k, v, do], BF16, scale=0.125, causal=True)
    grads = tuple(g.to(BF16) for g in (dq, dk, dv))
    assert_grads(grads, ref, tile=64)
    for bad_dk in (torch.cat([dk[:, :, :-64], 0 * dk[:, :, -64:]], 2), torch.cat([dk[:, :, :-64], -dk[:, :, -64:]], 2)):
        bad = (grads[0], bad_dk.to(BF16), grads[2])
        assert_grads_whole(bad, ref)  # the whole tensor's tolerance lets it through
        with pytest.raises(AssertionError, match="dk keys 448"):
            assert_grads(bad, ref, tile=64)


def test_dispatch_rule():
    """Measured (``gluon_bwd_wins``): 128-wide tiles at every length without a mask and from 1k keys causal, 64-wide
    from 2k keys, narrower never (the rest of ``prefer_gluon_bwd`` on CUDA tensors: ``test_gpu_dispatch_rule``)."""
    wins = fa3_gluon_bwd.gluon_bwd_wins
    assert all(wins(d, False, 1) and wins(d, True, 1024) for d in (72, 96, 128))
    assert not any(wins(d, True, 1023) for d in (72, 96, 128))
    assert wins(64, False, 2048) and wins(40, True, 16384) and not wins(64, False, 2047) and not wins(48, True, 1024)
    # 64 q rows per step (the GQA group loop, packed calls): from 4k keys
    assert not wins(64, False, 4095, 64) and wins(64, True, 4096, 64) and wins(96, True, 1024, 64)
    assert not wins(32, False, 1 << 20)
    assert all(wins(d, c, 1) for d in (136, 160, 192, 200, 248, 256) for c in (False, True))  # the wide kernel
    assert fa3_gluon_bwd.ENABLED is True

    q = torch.empty(1, 2, 64, 128, dtype=torch.bfloat16)
    assert not fa3_gluon_bwd.prefer_gluon_bwd(q, q, q, q, causal=False, window=(-1, -1), plain=True,
                                              deterministic=False, capability=(9, 0))  # a CPU tensor


def test_dispatch_switch_off_keeps_fa2(monkeypatch):
    """``_bwd_impl`` calls the Gluon backward only with ``ENABLED`` and ``prefer_gluon_bwd`` True: with the switch
    off the FA2 path runs (interpreted) and the Gluon one is never called."""
    from flashtile import flash_attn_func

    monkeypatch.setattr(fa3_gluon_bwd, "ENABLED", False)
    q, k, v = (torch.randn(1, 8, 1, 16, dtype=F32, requires_grad=True) for _ in range(3))
    seen = []

    def fake(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal):
        seen.append((q.shape, softmax_scale, causal))
        for g in (dq, dk, dv):
            g.fill_(7.0)

    monkeypatch.setattr(fa3_gluon_bwd, "prefer_gluon_bwd", lambda *a, **kw: True)
    monkeypatch.setattr(fa3_gluon_bwd, "backward_into", fake)
    flash_attn_func(q, k, v, causal=True).sum().backward()
    assert not seen and not (q.grad == 7.0).all()  # the switch is off: FA2's backward ran

    monkeypatch.setattr(fa3_gluon_bwd, "ENABLED", True)
    q.grad = k.grad = v.grad = None
    flash_attn_func(q, k, v, causal=True, softmax_scale=0.3).sum().backward()
    assert seen == [((1, 1, 8, 16), 0.3, True)] and all((x.grad == 7.0).all() for x in (q, k, v))


def test_env_var_turns_the_switch_off():
    code = "import flashtile.runtime.fa3_gluon_bwd as m; print(m.ENABLED)"
    env = {**os.environ, "FLASHTILE_GLUON_BWD": "0"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr[-2000:]


# --------------------------------------------------------------------------- #
# GPU (sm_90)
# --------------------------------------------------------------------------- #
class TiledRef(NamedTuple):
    """:class:`Ref` with :func:`rounding_bounds`' per-row / per-key bounds, for the per-tile check."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    slack: tuple[float, float, float]
    bounds: tuple[torch.Tensor, torch.Tensor]


def tiled_ref(dq, dk, dv, f64, dtype, **kwargs) -> TiledRef:
    """The oracle's gradients with the stored-O rounding bounds of the float64 inputs ``f64`` (q, k, v, dO)."""
    dq_bound, dk_bound = rounding_bounds(*f64, dtype, **kwargs)
    empty = not (dq_bound.numel() and dk_bound.numel())  # rounding_slack's maxima, without a second oracle run
    slack = (0.0, 0.0, 0.0) if empty else (float(dq_bound.max()), float(dk_bound.max()), 0.0)
    return TiledRef(dq, dk, dv, slack, (dq_bound.cpu(), dk_bound.cpu()))


def assert_grads(got, ref, tile: int = 128):
    """:func:`assert_grads_whole`, then (for a :class:`TiledRef`) each ``tile`` rows of dq (query axis) and of dk,
    dv (key axis) against that tile's own largest entry and its own rounding bound: a causal 4k call's late keys
    (and early queries) have gradients and bounds far below the early keys' (seen by ~N queries), so an error
    confined to them hides under the whole tensor's tolerance."""
    assert_grads_whole(got, ref)
    if not isinstance(ref, TiledRef) or not all(g.numel() for g in got):
        return
    where = got[0].device
    dq, dk, dv = (g.detach().cpu().double() for g in got)
    rq, rk, rv = (r.detach().cpu().double() for r in ref[:3])
    bq, bk = ref.bounds
    for start in range(0, dq.shape[2], tile):
        part = slice(start, start + tile)
        assert_close(dq[:, :, part], rq[:, :, part], dtype=got[0].dtype, device=where, what=f"dq rows {start}+",
                     magnitude=float(rq[:, :, part].abs().max()), slack=float(bq[:, :, part].max()))
    for start in range(0, dk.shape[2], tile):
        part = slice(start, start + tile)
        size = max(float(rk[:, :, part].abs().max()), float(rv[:, :, part].abs().max()))
        for name, g, r, extra in (("dk", dk, rk, float(bk[:, :, part].max())), ("dv", dv, rv, 0.0)):
            assert_close(g[:, :, part], r[:, :, part], dtype=got[1].dtype, device=where, what=f"{name} keys {start}+",
                         magnitude=size, slack=extra)


def run(q, k, v, dout, *, causal=False, config=None, scale=None, **views):
    """Kernel gradients (from the oracle's O and LSE) and the oracle's, as tests/kernels/test_fa3_bwd.py's ``run``."""
    scale = q.shape[3] ** -0.5 if scale is None else scale
    out, lse, dq, dk, dv = attention_ref_grads(q, k, v, dout, scale=scale, causal=causal)
    f64 = [x.detach().double() for x in (q, k, v, dout)]
    ref = tiled_ref(dq, dk, dv, f64, q.dtype, scale=scale, causal=causal)
    visible = torch.isfinite(scores_ref(*f64[:2], scale=scale, causal=causal)).cpu()
    got = fa3_gluon_backward(dout, q, k, v, out.to(device=q.device, dtype=q.dtype), lse.to(device=q.device, dtype=F32),
                             softmax_scale=scale, causal=causal, config=config, **views)
    torch.cuda.synchronize()
    run.last_out_lse = (out, lse)  # the oracle's O and LSE, for a second backward on the same inputs
    return got, ref, visible


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 300), (333, 517), (517, 333)])
@pytest.mark.parametrize("hq,hk", [(4, 2), (2, 2)])
def test_gpu_matches_oracle(d, causal, nq, nk, hq, hk):
    q, k, v, do = inputs(2, hq, hk, nq, nk, d, BF16, "cuda", seed=d + nq)
    got, ref, visible = run(q, k, v, do, causal=causal)
    assert all(g.dtype == BF16 for g in got)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [136, 192, 200, 248, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(1, 300), (333, 517), (517, 333), (64, 64), (100, 40)])
def test_gpu_wide_kernel_matches_oracle(d, causal, nq, nk):
    """The wide kernel (d > 128, the warpgroups splitting the head dim), GQA 4:2, ragged Nq / Nk, the table's
    config (dQ through TMA); gradients against the float64 oracle, exact zeros where no row sees a key."""
    q, k, v, do = inputs(2, 4, 2, nq, nk, d, BF16, "cuda", seed=d + nq + causal)
    got, ref, visible = run(q, k, v, do, causal=causal)
    assert all(g.dtype == BF16 for g in got)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


# the wide kernel's variants as config flags: the table's (dQ through TMA, Pᵀ a register operand; with the split
# score GEMMs beside 192-wide tiles), dQ reduced from registers, that with the split score GEMMs, the split score
# GEMMs with dQ through TMA (one Pᵀ / dSᵀ buffer beside 256-wide tiles) and dQ through TMA unsplit (the table's
# above 192)
WIDE_VARIANTS = {"default": {}, "registers": dict(dq_tma=False, pt_separate=True, split_s=False),
                 "split_s": dict(split_s=True, dq_tma=False, pt_separate=True), "split_s_tma": dict(split_s=True),
                 "tma_unsplit": dict(split_s=False), "split_s_do1": dict(split_s=True, do_stages=1),
                 "split_s_do1_regs": dict(split_s=True, do_stages=1, dq_tma=False, pt_separate=True)}


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("variant,d", [(v, d) for v in ("split_s", "registers") for d in (136, 192, 200, 256)]
                         + [("tma_unsplit", d) for d in (136, 160, 192)]
                         + [("split_s_tma", d) for d in (136, 160, 192, 200, 256)]
                         + [("split_s_do1", d) for d in (136, 192, 200, 256)] + [("split_s_do1_regs", 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("nq,nk", [(1, 300), (333, 517), (517, 333), (100, 40)])
def test_gpu_wide_variants_match_oracle(variant, d, causal, pingpong, nq, nk):
    """``split_s`` (each warpgroup 32 of the 64 q columns of Sᵀ / dPᵀ, Pᵀ and dSᵀ exchanged through shared tiles;
    dQ from registers, or through TMA with ``split_s_tma``) and ``registers`` (dQ reduced from registers, Pᵀ in its
    own tiles; the table's dq_tma is ``test_gpu_wide_kernel_matches_oracle``), ``split_s_do1`` (dO in a one-slot ring
    of its own, released after the dV GEMM; both Pᵀ / dSᵀ buffers at 256-wide tiles): GQA 4:2, ragged Nq / Nk,
    ping-pong on and off, against the float64 oracle."""
    q, k, v, do = inputs(2, 4, 2, nq, nk, d, BF16, "cuda", seed=d + nk + causal)
    cfg = replace(gluon_bwd_config(d, causal), pingpong=pingpong, **WIDE_VARIANTS[variant])
    got, ref, visible = run(q, k, v, do, causal=causal, config=cfg)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("d,variant", [(d, v) for d in (192, 256) for v in ("default", "split_s", "registers")]
                         + [(192, "3 stages"), (192, "tma_unsplit"), (256, "split_s_tma"), (256, "split_s_do1"),
                            (192, "split_s_do1 3 stages")])
def test_gpu_wide_kernel_fp16_schedules_and_long_sequence(pingpong, variant, d):
    """fp16, ping-pong on and off, each dQ / score variant (and 3 ring stages with 192-wide tiles), 2000 x 3000
    (many q steps, several kv programs per head, unmasked interior tiles), MQA."""
    q, k, v, do = inputs(1, 3, 1, 2000, 3000, d, F16, "cuda", seed=5 + pingpong)
    # 3 stages: without split_s (with it and dO in the Q ring the dQ staging tiles leave room for 2; with one dO
    # buffer 3 Q stages fit at 192-wide tiles)
    flags = dict(num_stages=3, split_s=False) if variant == "3 stages" else dict(
        num_stages=3, split_s=True, do_stages=1) if variant == "split_s_do1 3 stages" else WIDE_VARIANTS[variant]
    cfg = replace(gluon_bwd_config(d, True), pingpong=pingpong, **flags)
    for causal in (False, True):
        got, ref, visible = run(q, k, v, do, causal=causal, config=cfg)
        assert_grads(got, ref)
        assert_exact_zeros(got, visible)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hk,nq,nk", [(4, 2, 333, 517), (8, 1, 517, 333), (4, 4, 200, 300), (6, 2, 1, 300)])
@pytest.mark.parametrize("dq_tma", [True, False])
def test_gpu_group_loop_matches_oracle(d, causal, hq, hk, nq, nk, dq_tma):
    """``group_loop``: the kernel loops over each kv head's q heads (GQA 2:1, MQA 8:1, 1:1, one query row),
    dK / dV summed in registers; against the float64 oracle, with the dQ reduce-adds through TMA or registers."""
    q, k, v, do = inputs(2, hq, hk, nq, nk, d, BF16, "cuda", seed=d + hq + nq + causal)
    cfg = gluon_bwd_config(d, causal, True)  # as dispatched with the group loop
    if not dq_tma:
        cfg = replace(cfg, dq_tma=False, dq_swizzle32=False)
    got, ref, visible = run(q, k, v, do, causal=causal, config=cfg)
    assert all(g.dtype == BF16 for g in got)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("flags", [dict(pingpong=False), dict(release_once=True)])
def test_gpu_group_loop_seq_major_views_and_schedules(flags):
    """``group_loop`` on (B, N, H, d) storage (head stride below the row stride in the rank-3 descriptors), with
    ping-pong off, and with ``release_once`` (the producer then waits on the dSᵀ buffers across head boundaries);
    GQA 4:1, causal, ragged."""
    q, k, v, do = (x.transpose(1, 2).contiguous().transpose(1, 2)
                   for x in inputs(2, 4, 1, 333, 517, 128, BF16, "cuda", seed=41))
    assert q.stride(1) < q.stride(2)  # (B, N, H, d) storage
    cfg = replace(gluon_bwd_config(128, True), group_loop=True, **flags)
    got, ref, visible = run(q, k, v, do, causal=True, config=cfg)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [8, 40, 72, 96, 120])
def test_gpu_head_dims_not_a_power_of_two(d):
    """Columns past d: zero-filled loads, masked dK / dV stores, the accumulator's padding never copied."""
    q, k, v, do = inputs(1, 4, 1, 300, 200, d, BF16, "cuda", seed=d)
    got, ref, visible = run(q, k, v, do, causal=True)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d,stages,split,tma", [(64, 2, False, False), (64, 3, False, False), (128, 2, False, False),
                                                (128, 2, True, False), (128, 3, True, False), (128, 2, True, True),
                                                (64, 4, True, False), (64, 2, True, False), (64, 4, False, True),
                                                (64, 4, True, True), (40, 4, True, True), (16, 4, False, True),
                                                (24, 4, False, True)])
def test_gpu_ring_depths_dq_split_and_dq_tma(d, stages, split, tma):
    q, k, v, do = inputs(1, 2, 2, 700, 600, d, BF16, "cuda", seed=stages)
    got, ref, _ = run(q, k, v, do, causal=False, config=GluonBwdConfig(num_stages=stages, dq_split=split, dq_tma=tma))
    assert_grads(got, ref)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d,stages,split,tma", [(64, 4, False, False), (64, 4, False, True), (64, 4, True, True),
                                                (128, 3, False, False), (128, 3, True, False), (128, 2, True, True),
                                                (40, 4, True, True)])
def test_gpu_pingpong(d, stages, split, tma):
    """The consumers take turns issuing Sᵀ and dPᵀ (two mbarriers); with dq_split they also meet at ds_full."""
    q, k, v, do = inputs(2, 4, 2, 700, 600, d, BF16, "cuda", seed=stages)
    cfg = GluonBwdConfig(num_stages=stages, dq_split=split, dq_tma=tma, pingpong=True)
    got, ref, _ = run(q, k, v, do, causal=True, config=cfg)
    assert_grads(got, ref)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d,tma,pingpong", [(128, False, False), (128, True, False), (128, True, True), (64, False, False),
                                             (64, True, False), (64, True, True)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(1, 300), (333, 517), (517, 333)])
def test_gpu_dq_split_matches_oracle(d, tma, pingpong, causal, nq, nk):
    """dq_split: the consumers share their dSᵀ tiles through two buffers and four mbarriers (d = 64: K in 64-byte
    swizzled half-rows); dq_tma: each warpgroup's dQ part through its shared tile and a TMA bulk reduce-add.  Odd
    and even step counts per program, GQA 4:2; pingpong: the consumers' turns."""
    q, k, v, do = inputs(2, 4, 2, nq, nk, d, BF16, "cuda", seed=nq)
    cfg = GluonBwdConfig(num_stages=2 if tma and d == 128 else 3, dq_split=True, dq_tma=tma, pingpong=pingpong)
    got, ref, visible = run(q, k, v, do, causal=causal, config=cfg)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,hq,hk,nq,nk", [(2, 4, 2, 333, 517), (2, 4, 2, 517, 333), (1, 2, 2, 1, 300)])
def test_gpu_stats_smem_matches_oracle(d, causal, b, hq, hk, nq, nk):
    """stats_smem on the table's config: LSE · log2 e and D TMA-loaded with Q_i (padded rows: +inf, 0), read from
    shared memory.  Causal 517 x 333: rows 0-183 see no key (LSE -inf: P = 0, dq = 0 exactly); GQA 4:2; Nq = 1."""
    q, k, v, do = inputs(b, hq, hk, nq, nk, d, BF16, "cuda", seed=nq + d)
    cfg = replace(gluon_bwd_config(d, causal), stats_smem=True)
    got, ref, visible = run(q, k, v, do, causal=causal, config=cfg)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d,causal,nq,nk,flags", [
    *[(d, c, nq, nk, "all") for d in (64, 128) for c in (False, True) for nq, nk in [(333, 517), (517, 333)]],
    (128, False, 333, 517, "dq_swizzle32"), (128, True, 517, 333, "pt_separate"),
    (128, True, 333, 517, "release_once")])
def test_gpu_dq_swizzle32_pt_separate_release_once(d, causal, nq, nk, flags):
    """dq_swizzle32 (the fp32 dQ tiles in 32-byte atoms: 8-column bulk reduces from the 4 warps), pt_separate
    (Pᵀ in its own allocation), release_once (2 stages: ds_empty frees the ring slot too), all with stats_smem and
    each alone, on the table's config (release_once where it has 2 stages: d = 128)."""
    table = _shared_pt(gluon_bwd_config(d, causal, block_m=64))  # the 64-row config's switches, Pᵀ in shared memory
    if flags == "all":
        on = dict(stats_smem=True, dq_swizzle32=True, pt_separate=True, release_once=table.num_stages == 2)
    else:
        on = {flags: True}
    q, k, v, do = inputs(2, 4, 2, nq, nk, d, BF16, "cuda", seed=nq + d + 1)
    got, ref, visible = run(q, k, v, do, causal=causal, config=replace(table, **on))
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d,causal,shape,flags", [
    *[(d, c, (2, 4, 2, 333, 517), {}) for d in (64, 128) for c in (False, True)],
    (96, True, (2, 4, 2, 517, 333), {}), (40, False, (1, 2, 2, 1, 300), {}),
    (128, True, (1, 2, 2, 4096, 4096), {}), (64, False, (1, 2, 2, 4096, 4096), {}),
    (128, False, (2, 4, 2, 333, 517), dict(pingpong=False)), (64, True, (2, 4, 2, 333, 517), dict(dq_tma=False,
                                                                                                  dq_swizzle32=False)),
    (64, True, (2, 4, 2, 517, 333), dict(dq_split=False)), (128, True, (2, 4, 1, 333, 517), dict(group_loop=True)),
    (128, False, (1, 4, 2, 700, 600), dict(num_stages=2, dq_split=False, dq_tma=False, stats_smem=False,
                                           pt_separate=False))])
def test_gpu_named_bars(d, causal, shape, flags):
    """``named_bars`` on the table's configs (ring releases, turns and the dSᵀ rendezvous on hardware barriers;
    no ds_empty): ragged, GQA, one query row, 64 ring rounds at 4k; with ping-pong off, dQ by register reductions,
    unsplit dQ (no rendezvous), group_loop across heads, and the plain config (mbarrier-free ring only)."""
    _check_switch(d, causal, shape, dict(named_bars=True, **flags), seed=shape[3] + d + 3 * causal)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d,causal,shape,flags", [
    *[(d, c, (2, 4, 2, 333, 517), {}) for d in (64, 48) for c in (False, True)],
    *[(64, c, (2, 4, 2, 517, 333), {}) for c in (False, True)],
    (40, True, (1, 2, 2, 1, 300), {}), (64, False, (1, 2, 2, 300, 1), {}),
    (64, True, (1, 2, 2, 4096, 4096), {}), (64, False, (1, 2, 1, 4096, 4096), {}),
    (64, True, (2, 4, 2, 333, 517), dict(dq_tma=False, dq_swizzle32=False)),
    (64, True, (2, 4, 2, 333, 517), dict(dq_swizzle32=False)),
    (64, False, (2, 4, 2, 517, 333), dict(pingpong=False)),
    (64, True, (2, 4, 2, 333, 517), dict(named_bars=True)), (64, True, (1, 2, 2, 4096, 4096), dict(named_bars=True)),
    (64, False, (2, 4, 2, 333, 517), dict(release_once=True)),
    (64, True, (2, 8, 2, 333, 517), dict(group_loop=True)), (64, False, (1, 8, 2, 4096, 4096), dict(group_loop=True)),
    (64, True, (2, 8, 2, 333, 517), dict(group_loop=True, named_bars=True)),
    (48, False, (2, 6, 2, 517, 333), dict(group_loop=True, named_bars=True, dq_tma=False, dq_swizzle32=False)),
    *[(64, c, (2, 4, 2, 333, 517), dict(pt_regs=True, pt_separate=False, named_bars=True)) for c in (False, True)],
    (64, True, (1, 2, 2, 4096, 4096), dict(pt_regs=True, pt_separate=False)),
    (40, False, (2, 4, 2, 517, 333), dict(pt_regs=True, pt_separate=False, dq_tma=False, dq_swizzle32=False))])
def test_gpu_block_m_128(d, causal, shape, flags):
    """``block_m`` 128 (FA3's d = 64 tiles; dQ split by rows): ragged Nq / Nk both ways, GQA partials, one query
    row and one key, 32 ring rounds at 4k (the causal diagonal crossing a 128-row tile twice), dQ by register
    reductions, 128-byte swizzled dQ tiles, without ping-pong, named barriers, release_once, the GQA group loop
    (with and without named barriers), Pᵀ as the dV GEMM's register operand (``pt_regs``)."""
    fields = {**dict(block_m=128, num_stages=2, named_bars=False), **flags}  # mbarriers unless the case says
    _check_switch(d, causal, shape, fields, seed=shape[3] + d + 7 * causal)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d,causal,shape,flags", [
    *[(d, c, (2, 4, 2, 333, 517), {}) for d in (128, 96) for c in (False, True)],
    *[(128, c, (2, 4, 2, 517, 333), dict(num_stages=3)) for c in (False, True)],
    (128, True, (1, 2, 2, 4096, 4096), dict(num_stages=3)), (80, False, (1, 2, 2, 1, 300), dict(num_stages=3)),
    (128, True, (2, 4, 1, 333, 517), dict(group_loop=True)), (128, False, (2, 4, 2, 333, 517), dict(named_bars=True)),
    (128, True, (2, 4, 2, 333, 517), dict(host_desc=True, num_stages=3)),
    (128, False, (1, 4, 2, 700, 600), dict(num_stages=3, dq_split=False, dq_tma=False, stats_smem=False)),
    (64, True, (2, 8, 2, 333, 517), dict(group_loop=True)), (32, False, (2, 4, 2, 333, 517), {})])
def test_gpu_pt_regs(d, causal, shape, flags):
    """``pt_regs`` (Pᵀ the dV GEMM's register operand, no Pᵀ tiles) on the 64-row table's configs at 128-wide tiles:
    ragged both ways, GQA, one query row, 4k, 3 ring stages (what the freed tiles make room for), the group loop,
    named barriers, host descriptors, dQ by register reductions without the statistics in shared memory; at 64- and
    32-wide tiles too (the group loop's 64-row steps at d = 64, no dQ split at d = 32)."""
    _check_switch(d, causal, shape, dict(pt_regs=True, pt_separate=False, **flags), seed=shape[3] + d + 11 * causal)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d,causal,shape,flags", [
    (128, True, (2, 8, 8, 4096, 4096), {}), (128, True, (3, 4, 2, 1000, 1500), {}),
    (128, True, (3, 4, 2, 1500, 1000), {}),
    (64, True, (4, 8, 2, 2048, 2048), dict(group_loop=True)), (64, True, (3, 8, 8, 2048, 2048), dict(block_m=128)),
    (96, True, (5, 3, 3, 700, 700), {}), (256, True, (3, 7, 7, 2000, 2000), {}), (192, True, (2, 5, 5, 1500, 1000), {}),
    (128, False, (2, 4, 2, 333, 517), {})])
def test_gpu_lpt_order(d, causal, shape, flags):
    """``lpt`` (programs in groups of units, each group's first kv tiles first): every kv tile of every unit run
    once, whichever group it falls in — groups that do not divide the units (the short first group), GQA with
    fp32 partials and with the group loop (kv-head units), 128-row steps, Nq < Nk and Nq > Nk, both kernels; a
    call without a causal mask (the plain order)."""
    _check_switch(d, causal, shape, dict(lpt=True, **flags), seed=shape[3] + d + 13 * causal)


def _check_switch(d, causal, shape, fields, seed, layout="bhnd"):
    """The table's config (its 64-row one unless ``fields`` sets ``block_m``) with ``fields`` replaced against the
    float64 oracle on (b, hq, hk, nq, nk) ``shape`` inputs stored (B, H, N, d) or (B, N, H, d) (``layout``),
    structural zeros exact."""
    b, hq, hk, nq, nk = shape
    q, k, v, do = inputs(b, hq, hk, nq, nk, d, BF16, "cuda", seed=seed)
    if layout == "bnhd":
        q, k, v, do = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, do))
    # the 64-row table config unless the case sets block_m
    base = gluon_bwd_config(d, causal, block_m=None if "block_m" in fields else 64)
    got, ref, visible = run(q, k, v, do, causal=causal, config=replace(base, **fields))
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d,causal,shape,flags", [
    *[(d, c, (2, 4, 2, 333, 517), {}) for d in (64, 128) for c in (False, True)],
    (96, True, (2, 4, 2, 517, 333), {}), (40, False, (1, 2, 2, 1, 300), {}), (128, True, (1, 2, 2, 4096, 4096), {}),
    (128, True, (2, 4, 1, 333, 517), dict(group_loop=True)), (64, False, (2, 8, 2, 300, 200), dict(group_loop=True)),
    (128, False, (2, 4, 2, 333, 517), dict(named_bars=True)),
    (128, False, (1, 4, 2, 700, 600), dict(num_stages=2, dq_split=False, dq_tma=False, stats_smem=False,
                                           pt_separate=False)),
    *[(d, c, (2, 4, 2, 333, 517), {}) for d in (136, 192, 256) for c in (False, True)],
    (256, True, (1, 3, 3, 1, 300), {}), (200, False, (2, 4, 1, 517, 333), {}), (192, True, (1, 2, 2, 2048, 2048), {}),
    (256, False, (2, 4, 2, 333, 517), dict(split_s=False, do_stages=0))])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_gpu_host_descriptors(d, causal, shape, flags, layout):
    """``host_desc``: the kernels' loads and dQ reduce-adds through descriptors built on the host over the whole
    tensors (coordinates batch, head, row): ragged, GQA partials and the group loop, one query row, 4k, with named
    barriers, the plain config (no statistics or dQ tiles: K / V / Q / dO only); the wide kernel (two column parts
    per operand, 192- and 256-wide tiles, split score GEMMs or not, 2k); (B, H, N, d) and (B, N, H, d) storage."""
    _check_switch(d, causal, shape, dict(host_desc=True, **flags), seed=shape[3] + d + 5 * causal, layout=layout)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d,stages", [(128, 2), (64, 4)])
def test_gpu_stats_smem_long_sequence_and_plain_config(d, stages):
    """stats_smem with dq_swizzle32, pt_separate (and release_once at d = 128: 2 stages) over 32 ring rounds
    (N = 4k, causal) on the table's config; then fp16 without split and ping-pong (d = 64: unsplit dq_tma, its
    64-column tile in 8 swizzle-32 boxes)."""
    q, k, v, do = inputs(1, 2, 2, 4096, 4096, d, BF16, "cuda", seed=d)
    cfg = replace(_shared_pt(gluon_bwd_config(d, True, block_m=64)), stats_smem=True, dq_swizzle32=True,
                  pt_separate=True, release_once=stages == 2)
    got, ref, _ = run(q, k, v, do, causal=True, config=cfg)
    assert_grads(got, ref)
    q, k, v, do = inputs(1, 2, 1, 300, 200, d, F16, "cuda", seed=stages)
    tma = dict(dq_tma=True, dq_swizzle32=True) if d <= 64 else {}
    cfg = GluonBwdConfig(num_stages=stages, stats_smem=True, pt_separate=True, **tma)
    got, ref, visible = run(q, k, v, do, causal=True, config=cfg)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_dq_tma_long_sequence_many_programs_per_row(causal):
    """N = 4k, d = 64, no split, ping-pong: 32 kv-tile programs bulk-add into each dQ row (the accumulator's
    reduce-adds race only with each other); 64 steps of turns per program."""
    q, k, v, do = inputs(1, 2, 2, 4096, 4096, 64, BF16, "cuda", seed=13)
    got, ref, _ = run(q, k, v, do, causal=causal, config=GluonBwdConfig(num_stages=4, dq_tma=True, pingpong=True))
    assert_grads(got, ref)


@pytest.mark.gpu
@hopper
def test_gpu_fp16_negative_scale_strided_outputs_and_empty_keys():
    d = 128
    q, k, v, do = inputs(2, 2, 1, 257, 129, d, F16, "cuda", seed=5)
    grads = [torch.full((2, x.shape[2], x.shape[1], d), float("nan"), dtype=F16, device="cuda").transpose(1, 2)
             for x in (q, k, v)]
    got, ref, _ = run(q, k, v, do, scale=-0.2, causal=True, dq=grads[0], dk=grads[1], dv=grads[2])
    assert all(g is w for g, w in zip(got, grads))
    assert_grads(got, ref)
    k0 = k[:, :, :0]
    dq, dk, dv = fa3_gluon_backward(do, q, k0, k0, q, torch.zeros(2, 2, 257, device="cuda"), softmax_scale=0.1)
    assert (dq == 0).all() and dk.numel() == 0


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_long_sequence_against_fa2(causal):
    """N = 8k, d = 128: against the oracle and FA2's backward (many kv-tile programs adding into one dQ row)."""
    from flashtile.runtime.fa2_bwd import fa2_backward

    q, k, v, do = inputs(1, 2, 1, 8192, 8192, 128, BF16, "cuda", seed=11)
    got, ref, _ = run(q, k, v, do, causal=causal)
    assert_grads(got, ref)
    out, lse = run.last_out_lse
    fa2 = fa2_backward(do, q, k, v, out.to("cuda", BF16), lse.to("cuda", F32), softmax_scale=128 ** -0.5,
                       causal=causal, deterministic=True)
    assert_grads(got, Ref(*fa2, ref.slack))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [40, 64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_fp16_table_configs(d, causal):
    """The table's config in fp16, as dispatched (d = 40-64: dq_swizzle32 too), GQA 4:2, ragged both ways."""
    q, k, v, do = inputs(2, 4, 2, 333, 517, d, F16, "cuda", seed=d + causal)
    got, ref, visible = run(q, k, v, do, causal=causal)
    assert all(g.dtype == F16 for g in got)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("table", [True, False])
def test_gpu_dq_accumulator_rows_past_int32(table):
    """Nq = 2^24 + 192 at d = 128: offsets into the fp32 dQ accumulator (row * 128 elements) pass 2^31 (the dQ
    postprocess; without dq_tma also the kernel's reductions).  q and dO are 0 outside the last 256 rows, whose
    LSE is -inf elsewhere (P = 0), so dK, dV and those rows' dQ are the oracle's on that slice and every other
    row's dQ is exactly 0.  ~27 GB."""
    n, tail, d, scale = 2**24 + 192, 256, 128, 128 ** -0.5
    qt, k, v, dot = inputs(1, 1, 1, tail, 128, d, BF16, "cuda", seed=19)
    out_t, lse_t, dq_t, dk_t, dv_t = attention_ref_grads(qt, k, v, dot, scale=scale)
    q, do, out = (torch.zeros(1, 1, n, d, dtype=BF16, device="cuda") for _ in range(3))
    lse = torch.full((1, 1, n), float("-inf"), device="cuda")
    for full, part in ((q, qt), (do, dot), (out, out_t), (lse, lse_t)):
        full[:, :, -tail:] = part.to(device="cuda", dtype=full.dtype)
    cfg = gluon_bwd_config(d, False) if table else GluonBwdConfig(num_stages=2)
    dq, dk, dv = fa3_gluon_backward(do, q, k, v, out, lse, softmax_scale=scale, config=cfg)
    slack = rounding_slack(*(x.double() for x in (qt, k, v, dot)), BF16, scale=scale)
    assert_grads((dq[:, :, -tail:], dk, dv), Ref(dq_t, dk_t, dv_t, slack))
    assert not dq[:, :, :-tail].any()


@pytest.mark.gpu
@hopper
def test_gpu_dispatch_rule():
    def prefer(dtype=BF16, d=128, n=64, **kw):
        q = torch.empty(1, 2, n, d, dtype=dtype, device="cuda")
        args = dict(causal=False, window=(-1, -1), plain=True, deterministic=False)
        return fa3_gluon_bwd.prefer_gluon_bwd(q, q, q, q, **{**args, **kw})

    assert prefer() and prefer(d=96, n=1024, causal=True, window=(-1, 0)) and prefer(d=64, n=8192)
    assert prefer(dtype=torch.float16) and not prefer(d=96, causal=True, window=(-1, 0))  # causal under 1k keys: FA2
    assert not prefer(d=64) and not prefer(d=32, n=8192) and not prefer(dtype=torch.float32)
    assert prefer(d=136) and prefer(d=256, causal=True, window=(-1, 0))  # the wide kernel
    assert not prefer(window=(8, -1)) and not prefer(plain=False) and not prefer(deterministic=True)
    assert not prefer(capability=(10, 0)) and not prefer(causal=True)  # causal needs window (-1, 0)


@pytest.mark.gpu
@hopper
def test_gpu_autograd_hook(monkeypatch):
    """With the switch on, flash_attn_func's backward runs the Gluon kernel and matches FA2's (switch off); causal,
    1000 queries against 1030 keys (from 1k keys: ``gluon_bwd_wins``)."""
    from flashtile import flash_attn_func

    monkeypatch.setattr(fa3_gluon_bwd, "ENABLED", False)
    q, k, v, do = (x.transpose(1, 2).contiguous().requires_grad_() for x in inputs(2, 8, 2, 1000, 1030, 128, BF16,
                                                                                    "cuda", seed=3))
    called = []
    real = fa3_gluon_bwd.backward_into
    monkeypatch.setattr(fa3_gluon_bwd, "backward_into", lambda *a, **kw: called.append(1) or real(*a, **kw))
    base = torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), do.detach())
    assert not called
    monkeypatch.setattr(fa3_gluon_bwd, "ENABLED", True)
    mine = torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), do.detach())
    assert called
    size = max(float(g.abs().max()) for g in base)
    for name, a, b in zip(("dq", "dk", "dv"), mine, base):
        assert_close(a, b.double(), what=name, magnitude=size)


def _varlen_case(lens_q, lens_k, hq, hk, d, seed):
    """Packed bf16 q, k, v, dout on the GPU built from per-sequence (1, H, N, d) inputs, with the oracle's out / lse
    packed and its per-sequence gradients."""
    seqs = [inputs(1, hq, hk, nq, nk, d, BF16, "cuda", seed=seed + i) for i, (nq, nk) in enumerate(zip(lens_q, lens_k))]
    pack = lambda xs: torch.cat([x[0].transpose(0, 1) for x in xs]).contiguous()  # noqa: E731
    q, k, v, do = (pack([s[j] for s in seqs]) for j in range(4))
    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    return seqs, (q, k, v, do), cu(lens_q), cu(lens_k)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hk", [(4, 2), (2, 2)])
@pytest.mark.parametrize("lens", ["mixed", "one", "tiny"])
def test_gpu_varlen_matches_oracle(d, causal, hq, hk, lens):
    """The packed Gluon backward against the float64 oracle per sequence: lengths under / at / over the tiles, an
    empty q sequence, an empty kv sequence, Nq != Nk (bottom-right causal); one long sequence; 300 tiny ones;
    max_seqlen above the real maxima.  Structural zeros exact."""
    _check_varlen(d, causal, hq, hk, lens)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_varlen_named_bars(monkeypatch, d, causal):
    """The packed backward with ``named_bars`` (its config is the table's: switched on there): mixed lengths
    with empty sequences, GQA 4:2 (programs of an empty sequence return before the partitions start)."""
    table = fa3_gluon_bwd.gluon_bwd_config
    monkeypatch.setattr(fa3_gluon_bwd, "gluon_bwd_config",
                        lambda d, causal, *a, **kw: replace(table(d, causal, *a, **kw), named_bars=True))
    _check_varlen(d, causal, 4, 2, "mixed")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [160, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_varlen_wide_kernel_matches_oracle(d, causal):
    """The packed backward above d = 128 (the wide kernel, 192- and 256-wide tiles): mixed lengths, GQA 4:2."""
    _check_varlen(d, causal, 4, 2, "mixed")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", ["mixed", "one"])
def test_gpu_varlen_fixed_length_table(monkeypatch, d, causal, lens):
    """The packed backward on the fixed-length table's 64-row config (``varlen_config``): Pᵀ as a register operand
    at d = 128, dO in its own one-slot ring beside the split score GEMMs above; the config reaches the launch."""
    table = gluon_bwd_config(d, causal, block_m=64)
    assert (table.pt_regs or table.do_stages == 1) and fa3_gluon_bwd.varlen_config(d, causal) == table
    seen = []
    real = fa3_gluon_bwd.gluon_bwd_launch
    monkeypatch.setattr(fa3_gluon_bwd, "gluon_bwd_launch", lambda *a, **kw: seen.append((a, kw)) or real(*a, **kw))
    _check_varlen(d, causal, 4, 2, lens)
    cfgs = [kw["cfg"] if "cfg" in kw else a[11] for a, kw in seen]
    assert cfgs and all(c == table for c in cfgs), f"the table's config did not reach the launch: {cfgs}"


def _check_varlen(d, causal, hq, hk, lens):
    lens_q, lens_k = {"mixed": ([70, 0, 64, 1, 333, 200], [90, 40, 64, 0, 517, 128]), "one": ([1000], [1000]),
                      "tiny": ([1 + i % 5 for i in range(300)], [1 + (i * 7) % 9 for i in range(300)])}[lens]
    seqs, (q, k, v, do), cu_q, cu_k = _varlen_case(lens_q, lens_k, hq, hk, d, seed=d + hq + len(lens_q))
    scale = d ** -0.5
    refs = [attention_ref_grads(*s, scale=scale, causal=causal) for s in seqs]
    out = torch.cat([r[0][0].transpose(0, 1) for r in refs]).to(device="cuda", dtype=BF16)
    lse = torch.cat([r[1][0] for r in refs], dim=1).to(device="cuda", dtype=F32)
    got = fa3_gluon_bwd.fa3_gluon_varlen_backward(do, q, k, v, out, lse, cu_q, cu_k, max(lens_q) + 5,
                                                  max(lens_k) + 3, softmax_scale=scale, causal=causal)
    torch.cuda.synchronize()
    offs_q, offs_k = cu_q.tolist(), cu_k.tolist()
    for i, (s, r) in enumerate(zip(seqs, refs)):
        part = (got[0][offs_q[i]:offs_q[i + 1]], got[1][offs_k[i]:offs_k[i + 1]], got[2][offs_k[i]:offs_k[i + 1]])
        part = tuple(x.transpose(0, 1).unsqueeze(0) for x in part)
        f64 = [x.double() for x in s]
        ref = tiled_ref(*r[2:], f64, BF16, scale=scale, causal=causal)
        assert_grads(part, ref)
        visible = torch.isfinite(scores_ref(*f64[:2], scale=scale, causal=causal)).cpu()
        assert_exact_zeros(part, visible)


@pytest.mark.gpu
@hopper
def test_gpu_varlen_dispatch_through_flash_attn_varlen_func(monkeypatch):
    """With ``VARLEN`` on (the default), flash_attn_varlen_func's backward runs the packed Gluon backward (GQA 4:1,
    causal, d = 128) and its gradients match FA2's packed backward (``VARLEN`` off) on the same forward."""
    import flashtile

    lens = [300, 5, 1024, 77]
    _, (q, k, v, do), cu_q, cu_k = _varlen_case(lens, lens, 8, 2, 128, seed=3)
    grads = {}
    real = fa3_gluon_bwd.fa3_gluon_varlen_backward
    for on in (False, True):
        monkeypatch.setattr(fa3_gluon_bwd, "VARLEN", on)
        called = []
        monkeypatch.setattr(fa3_gluon_bwd, "fa3_gluon_varlen_backward",
                            lambda *a, **kw: called.append(1) or real(*a, **kw))
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = flashtile.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens), max(lens), causal=True)
        grads[on] = torch.autograd.grad(out, leaves, do)
        assert bool(called) == on
    for name, a, b in zip(("dq", "dk", "dv"), grads[True], grads[False]):
        assert_close(a, b.double(), BF16, "cuda", name, magnitude=max(float(g.abs().max()) for g in grads[False]))
