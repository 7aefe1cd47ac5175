"""Gluon Hopper forward prototype (kernels/fa3_gluon.py, runtime/fa3_gluon.py).

Gluon kernels do not run in Triton's interpreter (``gluon.jit`` builds a ``GluonJITFunction`` whatever
``TRITON_INTERPRET`` says, and a launch then looks for a GPU driver), so on the CPU only the config table,
the launcher's refusals and its argument list are tested; correctness is GPU-only (``pytest -m gpu``, sm_90)
and in scratch/gluon_probe.py.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch

from flashtile.runtime.fa3_gluon import (
    GLUON_HEAD_DIMS, SMEM_LIMIT, GluonConfig, block_d, fa3_gluon_forward, gluon_config, head_split, smem_bytes,
)
from tests._oracle import assert_close, attention_ref

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")


def test_config_table_fits():
    for d in GLUON_HEAD_DIMS:
        for causal in (False, True):
            cfg = gluon_config(d, causal)
            assert smem_bytes(cfg, d) <= SMEM_LIMIT
            assert cfg.num_stages >= 2 and cfg.block_n % 16 == 0 and cfg.num_wg in (2, 3)
    assert GLUON_HEAD_DIMS == tuple(range(8, 257, 8))
    pk = dict(pack_p=True)  # widths 33-128 carry P packed
    assert gluon_config(128, True) == GluonConfig(block_n=128, num_stages=3, **pk)
    assert gluon_config(128, False) == GluonConfig(block_n=128, num_stages=3, persistent=True, **pk)  # >= 128
    assert gluon_config(96, False) == GluonConfig(block_n=128, num_stages=4, **pk)  # 64 + 32 columns: a 4th stage
    assert gluon_config(112, True) == replace(gluon_config(128, True), split_d=False)  # 64 + 64: nothing saved
    assert gluon_config(192, False) == GluonConfig(block_n=64, num_stages=3, persistent=True)
    assert gluon_config(192, True) == GluonConfig(block_n=64, num_stages=3)  # 128 + 64 columns: a 3rd stage fits
    assert gluon_config(256, True) == GluonConfig(block_n=64, num_stages=2)
    assert gluon_config(64, True) == gluon_config(40, False) == GluonConfig(block_n=128, num_stages=3, num_wg=3, **pk)
    assert [gluon_config(d, False).pack_p for d in (24, 32, 40, 136, 256)] == [False, False, True, False, False]
    assert gluon_config(32, False).num_wg == 2
    # causal with many keys: persistent over dynamically claimed tiles, from tiles wider than 64
    assert gluon_config(128, True, many_keys=True) == GluonConfig(block_n=128, num_stages=3, persistent=True,
                                                                  dynamic=True, **pk)
    assert gluon_config(96, True, many_keys=True).dynamic and gluon_config(192, True, False, True).dynamic
    assert not gluon_config(64, True, many_keys=True).dynamic and not gluon_config(40, True, many_keys=True).persistent
    assert gluon_config(128, False, many_keys=True) == gluon_config(128, False)  # non-causal: static persistent
    # without a mask, narrower than 128 below 8k keys: static persistent too; causal rows unchanged by few_keys
    for d in (40, 64, 80, 96):  # d = 112: 128-wide tiles (64 + 64 saves nothing)
        assert gluon_config(d, False, few_keys=True) == replace(gluon_config(d, False), persistent=True)
        assert gluon_config(d, True, few_keys=True) == gluon_config(d, True)
    # from 8k keys without a mask (long_keys): one program per tile, but at width 64 the three consumers claim
    # tiles dynamically
    assert not any(gluon_config(d, False, long_keys=True).persistent for d in (40, 48, 80, 96))
    assert not gluon_config(64, False).persistent and not gluon_config(64, True, long_keys=True).persistent
    assert gluon_config(64, False, long_keys=True) == replace(gluon_config(64, False, few_keys=True), dynamic=True)
    assert gluon_config(56, False, long_keys=True).dynamic  # 56 runs 64-wide tiles (32 + 24 parts save nothing)
    assert gluon_config(128, False, few_keys=True) == gluon_config(128, False)  # persistent from width 128 anyway
    assert gluon_config(112, False, few_keys=True) == gluon_config(112, False)
    assert not gluon_config(32, False, few_keys=True).persistent  # no schedule at width <= 32: not measured there
    # 4k-8k causal keys at widths 33-64: two consumer warpgroups over dynamic tiles; not wider, not non-causal
    assert gluon_config(64, True, True, True, True) == replace(gluon_config(64, True, True), num_wg=2,
                                                               persistent=True, dynamic=True)
    assert gluon_config(40, True, mid_keys=True).num_wg == 2 and gluon_config(128, True, mid_keys=True).num_wg == 2
    assert not gluon_config(128, True, mid_keys=True).dynamic and gluon_config(64, False, mid_keys=True).num_wg == 3
    for d in (64, 96, 128, 192):  # host_desc is the caller's per-call choice, the rest of the row unchanged
        assert gluon_config(d, True, True) == replace(gluon_config(d, True), host_desc=True)
    assert [block_d(d) for d in (8, 16, 24, 40, 64, 72, 192, 256)] == [16, 16, 32, 64, 64, 128, 256, 256]
    for d in (0, 4, 100, 264):
        with pytest.raises(NotImplementedError):
            gluon_config(d, False)


def test_smem_estimate_matches_compile_reports():
    # Triton 3.6, sm_90a, bf16 (metadata.shared from scratch/cc_gluon.py): the estimate is above by < 1 KB
    unsplit = dict(split_d=False)
    for cfg, d, reported in [
        (GluonConfig(128, 2), 128, 164144), (GluonConfig(128, 3), 128, 229728),
        (GluonConfig(64, 2), 256, 196912), (GluonConfig(32, 4), 256, 196960),
        (GluonConfig(128, 2, o_tma=True), 128, 164304), (GluonConfig(64, 2, o_tma=True), 256, 197072),
        (GluonConfig(128, 2, o_coalesced=True), 128, 180432),
        (GluonConfig(128, 3, o_coalesced=True, **unsplit), 96, 246016),
        (GluonConfig(64, 2, o_coalesced=True, **unsplit), 192, 229584), (GluonConfig(128, 4), 8, 37216),
        (GluonConfig(128, 4, o_coalesced=True), 64, 164096),
        (GluonConfig(128, 2, num_wg=3), 64, 90392), (GluonConfig(128, 3, num_wg=3), 64, 123256),
        (GluonConfig(128, 4, num_wg=3, o_coalesced=True), 64, 180472),
        (GluonConfig(128, 3, num_wg=3, o_coalesced=True, **unsplit), 40, 147704),
        # head dim split in two parts: tiles D0 + D1 wide
        (GluonConfig(128, 3), 96, 172448), (GluonConfig(128, 4), 96, 221600),
        (GluonConfig(128, 4, o_tma=True), 96, 221696), (GluonConfig(128, 4), 80, 184736),
        (GluonConfig(128, 3, o_tma=True), 112, 229880), (GluonConfig(64, 3), 192, 197024),
        (GluonConfig(64, 4, num_wg=3), 96, 135608), (GluonConfig(64, 3, num_wg=3, o_tma=True), 72, 92824),
        (GluonConfig(128, 3, num_wg=3), 40, 92600),
    ]:
        assert 0 <= smem_bytes(cfg, d) - reported <= 1024, (cfg, d)
    # split with coalesced stores: the conversions' scratch is a bound, above by < 9 KB
    for cfg, d, reported in [
        (GluonConfig(128, 3, o_coalesced=True), 96, 188672), (GluonConfig(128, 3, o_coalesced=True), 80, 160000),
        (GluonConfig(64, 3, o_coalesced=True), 192, 213248), (GluonConfig(64, 4, num_wg=3, o_coalesced=True), 96, 168216),
        (GluonConfig(64, 3, num_wg=3, o_coalesced=True), 96, 143608),
        (GluonConfig(64, 3, num_wg=3, o_coalesced=True), 72, 121080),
        (GluonConfig(128, 3, num_wg=3, o_coalesced=True), 40, 108824),
    ]:
        assert 0 <= smem_bytes(cfg, d) - reported <= 9 * 1024, (cfg, d)


def test_head_split():
    """Two power-of-two parts, the first the largest power of two below d, the second >= 16 (wgmma K step)
    reaching past d by less than itself; unsplit: one block_d(d)-wide part."""
    assert [head_split(d) for d in (96, 80, 72, 112, 192, 136, 40, 24)] == [
        (64, 32), (64, 16), (64, 16), (64, 64), (128, 64), (128, 16), (32, 16), (16, 16)]
    for d in GLUON_HEAD_DIMS:
        d0, d1 = head_split(d)
        assert head_split(d, False) == (block_d(d), 0)
        if d1 == 0:
            assert d0 == block_d(d) and (d <= 16 or d0 == d)
            continue
        assert d0 < d < d0 + d1 <= block_d(d) or d0 + d1 == d
        assert d0 & (d0 - 1) == 0 and d1 & (d1 - 1) == 0 and 16 <= d1 <= d0
        assert d1 == 16 or d - d0 > d1 // 2  # the second part is the next power of two >= 16
    for d in (72, 80, 88, 96, 136, 144, 152, 160, 168, 176, 184, 192):  # the table splits where it narrows the tiles
        cfg = gluon_config(d, False)
        assert cfg.split_d and sum(cfg.widths(d)) < block_d(d)


def test_refusals_name_the_argument(monkeypatch):
    from flashtile.runtime import fa3_gluon

    q = torch.zeros(1, 1, 16, 64)
    h = q.half()
    with pytest.raises(NotImplementedError):
        fa3_gluon_forward(q, q, q, softmax_scale=0.125)  # fp32
    with pytest.raises(NotImplementedError):
        fa3_gluon_forward(h, h, h, softmax_scale=0.125)  # not an sm_90 CUDA device
    with pytest.raises(ValueError, match="q must be"):
        fa3_gluon_forward(h[0], h[0], h[0], softmax_scale=0.125)
    with pytest.raises(ValueError, match="softmax_scale"):
        fa3_gluon_forward(h, h, h, softmax_scale=float("nan"))
    with pytest.raises(TypeError, match="softmax_scale"):
        fa3_gluon_forward(h, h, h, softmax_scale="0.1")
    with pytest.raises(TypeError, match="config"):
        fa3_gluon_forward(h, h, h, softmax_scale=0.125, config=(128, 2))
    with pytest.raises(ValueError, match="num_stages"):
        fa3_gluon_forward(h, h, h, softmax_scale=0.125, config=GluonConfig(128, 1))  # one slot deadlocks
    with pytest.raises(ValueError, match="block_n"):
        fa3_gluon_forward(h, h, h, softmax_scale=0.125, config=GluonConfig(96, 2))  # masks need a power of two
    with pytest.raises(ValueError, match="num_wg"):
        fa3_gluon_forward(h, h, h, softmax_scale=0.125, config=GluonConfig(128, 2, num_wg=4))
    with pytest.raises(TypeError, match="split_d"):
        fa3_gluon_forward(h, h, h, softmax_scale=0.125, config=GluonConfig(128, 2, split_d=1))
    with pytest.raises(TypeError, match="persistent"):
        fa3_gluon_forward(h, h, h, softmax_scale=0.125, config=GluonConfig(128, 2, persistent=1))
    with pytest.raises(TypeError, match="host_desc"):
        fa3_gluon_forward(h, h, h, softmax_scale=0.125, config=GluonConfig(128, 2, host_desc=1))
    with pytest.raises(TypeError, match="dynamic"):
        fa3_gluon_forward(h, h, h, softmax_scale=0.125, config=GluonConfig(128, 2, persistent=True, dynamic=1))
    with pytest.raises(ValueError, match="dynamic needs persistent"):  # it schedules the persistent loop only
        fa3_gluon_forward(h, h, h, softmax_scale=0.125, config=GluonConfig(128, 2, dynamic=True))
    with pytest.raises(ValueError, match="fence places"):  # the overlap's wait: nothing to place without it
        fa3_gluon_forward(h, h, h, softmax_scale=0.125, config=GluonConfig(128, 2, intra=False, fence=True))
    for flag in ("pingpong", "fence", "pack_p", "named_bars", "wg_skip"):
        with pytest.raises(TypeError, match="intra, pingpong, fence, pack_p, named_bars and wg_skip must be bools"):
            fa3_gluon_forward(h, h, h, softmax_scale=0.125, config=GluonConfig(128, 2, **{flag: 1}))
    with pytest.raises(ValueError, match="named_bars has barriers for up to 4 ring stages"):
        fa3_gluon_forward(h, h, h, softmax_scale=0.125, config=GluonConfig(64, 5, named_bars=True))
    monkeypatch.setattr(fa3_gluon, "_check", lambda *a: None)  # past the device check
    # 3 consumers under 160 registers spill with 128-key tiles wider than 64 columns, and at 192 columns
    for d, block_n in [(128, 128), (96, 128), (80, 128), (192, 64)]:
        x = torch.zeros(1, 1, 16, d, dtype=torch.float16)
        with pytest.raises(ValueError, match="num_wg = 3.*block_n"):
            fa3_gluon_forward(x, x, x, softmax_scale=0.125, config=GluonConfig(block_n, 2, num_wg=3))
    with pytest.raises(ValueError, match="consumer_regs"):
        fa3_gluon_forward(h, h, h, softmax_scale=0.125, config=GluonConfig(128, 2, num_wg=3, consumer_regs=240))


@pytest.mark.parametrize("d,cfg", [
    (40, GluonConfig(128, 3, num_wg=3, o_coalesced=True, lpt_group=3)), (192, None), (128, None),
    (96, GluonConfig(64, 4, num_wg=3)), (96, GluonConfig(128, 3, split_d=False)),
    (128, GluonConfig(128, 3, persistent=True)), (96, GluonConfig(64, 4, num_wg=3, o_tma=True, persistent=True)),
    (128, GluonConfig(128, 3, persistent=True, dynamic=True)), (128, GluonConfig(128, 3, fence=True, pack_p=True)),
    (96, GluonConfig(128, 4, intra=False, pingpong=False)), (192, GluonConfig(64, 3, persistent=True, named_bars=True)),
    (96, GluonConfig(128, 4, pingpong=False, named_bars=True)), (192, GluonConfig(64, 3, wg_skip=True)),
])
def test_launcher_passes_the_kernels_arguments(monkeypatch, d, cfg):
    """The launcher's runtime arguments and constexprs, bound to the kernel's signature by position (as
    runtime.launch passes them): a mismatch would only show on a GPU.  Persistent: a grid of min(tiles,
    SMs) programs and the tile count as ``total_tiles``; otherwise one program per tile and no such
    parameter (None: a constexpr)."""
    import contextlib

    import flashtile.runtime.fa3_fwd as fa3_fwd
    import flashtile.runtime.launch as launch_mod
    from flashtile.kernels.fa3_gluon import fa3_gluon_kernel
    from flashtile.runtime import fa3_gluon

    calls = []
    monkeypatch.setattr(fa3_gluon, "_check", lambda *a: None)  # no sm_90 device here
    monkeypatch.setattr(fa3_fwd, "ensure_allocator", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(fa3_gluon, "sm_count", lambda index: 5)  # fewer SMs than the 2 x 4 x 2-3 tiles
    q = torch.zeros(2, 4, 300, d, dtype=torch.bfloat16)
    k = torch.zeros(2, 2, 500, d, dtype=torch.bfloat16)
    fa3_gluon_forward(q, k, k, softmax_scale=0.5, causal=True, config=cfg)
    (kernel, grid, dynamic, static), kw = calls[0]
    cfg = cfg or gluon_config(d, True)
    assert kernel is fa3_gluon_kernel and kernel.is_gluon() and kw["num_warps"] == 4 and kw["bind"]
    bound = dict(zip(inspect.signature(fa3_gluon_kernel.fn).parameters, (*dynamic, *static)))
    assert len(bound) == len(dynamic) + len(static) == len(inspect.signature(fa3_gluon_kernel.fn).parameters)
    assert bound["Q"] is q and bound["K"] is k and bound["qk_scale"] == pytest.approx(0.5 * 1.4426950408889634)
    assert (bound["n_heads"], bound["kv_group"], bound["seqlen_q"], bound["seqlen_k"]) == (4, 2, 300, 500)
    assert bound["stride_om"] == d and bound["stride_kh"] == 500 * d
    num_m_tiles = -(-300 // cfg.block_m)
    assert bound["num_m_tiles"] == num_m_tiles
    if cfg.persistent:
        assert grid == (5,) and bound["total_tiles"] == 2 * 4 * num_m_tiles and bound["PERSISTENT"] is True
    else:
        assert grid == (2 * 4 * num_m_tiles,) and bound["total_tiles"] is None and bound["PERSISTENT"] is False
    assert (bound["HEAD_DIM"], bound["NUM_WG"], bound["BLOCK_N"], bound["NUM_STAGES"]) == (
        d, cfg.num_wg, cfg.block_n, cfg.num_stages)
    assert (bound["BLOCK_D0"], bound["BLOCK_D1"]) == head_split(d, cfg.split_d) == {
        (40, True): (32, 16), (192, True): (128, 64), (128, True): (128, 0), (96, True): (64, 32),
        (96, False): (128, 0)}[d, cfg.split_d]
    assert (bound["CAUSAL"], bound["INTRA"], bound["PINGPONG"], bound["SKIP_MASK0"]) == (
        True, 2 if cfg.fence else int(cfg.intra), (2 if cfg.named_bars else 1) if cfg.pingpong else 0,
        cfg.skip_mask0)
    assert bound["INTRA"] == cfg.intra_mode() and type(bound["INTRA"]) is int  # 0 off, 1 on, 2 fenced
    assert bound["PACK_P"] is cfg.pack_p and bound["NAMED_RELEASE"] is cfg.named_bars
    assert type(bound["PINGPONG"]) is int  # 0 off, 1 turns on mbarriers, 2 on named barriers
    assert (bound["CONSUMER_REGS"], bound["PRODUCER_REGS"], bound["O_STORE"], bound["LPT_GROUP"]) == (
        cfg.regs(), cfg.producer(), cfg.o_store(), cfg.lpt_group)
    assert cfg.regs() == (240 if cfg.num_wg == 2 else 160)
    assert cfg.producer() == (32 if cfg.persistent and cfg.num_wg == 2 else 24)  # 0 spills, scratch/cc_gluon.py
    assert bound["HOST_DESC"] is False and all(bound[f"{t}_desc{i}"] is None for t in "qkvo" for i in (0, 1))
    assert bound["DYNAMIC"] is cfg.dynamic and (bound["tile_counter"] is None) is not cfg.dynamic
    assert bound["WG_SKIP"] is cfg.wg_skip  # a causal call


def _capture_launch(monkeypatch):
    """fa3_gluon_forward on CPU tensors up to the launch: the calls' (grid, bound arguments), and how often the
    descriptor scratch allocator was installed."""
    import contextlib

    import flashtile.runtime.fa3_fwd as fa3_fwd
    import flashtile.runtime.launch as launch_mod
    from flashtile.kernels.fa3_gluon import fa3_gluon_kernel
    from flashtile.runtime import fa3_gluon

    calls, allocs = [], []
    names = list(inspect.signature(fa3_gluon_kernel.fn).parameters)
    monkeypatch.setattr(fa3_gluon, "_check", lambda *a: None)
    monkeypatch.setattr(fa3_gluon, "ensure_allocator", lambda: allocs.append(1))
    monkeypatch.setattr(fa3_fwd, "ensure_allocator", lambda: allocs.append(1))
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(launch_mod, "launch", lambda kernel, grid, dynamic, static, **kw: calls.append(
        (grid, dict(zip(names, (*dynamic, *static))))))
    monkeypatch.setattr(fa3_gluon, "sm_count", lambda index: 5)
    return calls, allocs


@pytest.mark.parametrize("d,cfg", [
    (96, GluonConfig(64, 4, num_wg=3, o_tma=True, persistent=True, host_desc=True)),  # split 64 + 32, O by TMA
    (128, GluonConfig(128, 3, host_desc=True)),
    (192, GluonConfig(64, 3, o_tma=True, host_desc=True)),  # split 128 + 64
])
def test_launcher_passes_host_descriptors(monkeypatch, d, cfg):
    """host_desc: rank-4 descriptors over the (B, H, N, d) views with their own strides (here (B, N, H, d)
    storage, GQA 4:2), boxes [1, 1, 64 | block_n, D0 | D1] whose swizzle is the kernel tiles' (the kernel
    asserts it at compile time), the second part only when split, O only with o_tma; no scratch allocator."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    calls, allocs = _capture_launch(monkeypatch)
    q = torch.zeros(2, 300, 4, d, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.zeros(2, 500, 2, d, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.zeros(2, 2, 500, d, dtype=torch.bfloat16)  # contiguous (B, H, N, d)
    out = torch.zeros(2, 300, 4, d, dtype=torch.bfloat16).transpose(1, 2)
    fa3_gluon_forward(q, k, v, softmax_scale=0.5, causal=True, out=out, config=cfg)
    (_, bound), = calls
    assert bound["HOST_DESC"] is True and not allocs
    widths = head_split(d, cfg.split_d)
    assert (bound["BLOCK_D0"], bound["BLOCK_D1"]) == widths
    for t, x, rows in [("q", q, 64), ("k", k, cfg.block_n), ("v", v, cfg.block_n), ("o", out, 64)]:
        for i, width in enumerate(widths):
            desc = bound[f"{t}_desc{i}"]
            if width == 0 or (t == "o" and not cfg.o_tma):
                assert desc is None, (t, i)
                continue
            assert isinstance(desc, TensorDescriptor) and desc.base is x
            assert desc.shape == list(x.shape) and desc.strides == list(x.stride())
            assert desc.block_shape == [1, 1, rows, width]
            layout = gl.NVMMASharedLayout.get_default_for([rows, width], gl.bfloat16)  # the kernel tile's
            assert desc.layout.rank == 4 and desc.layout.swizzle_byte_width == layout.swizzle_byte_width
            # the unchecked construction equals the dataclass's own (its checks pass on these views)
            assert desc == TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, rows, width], desc.layout)
    assert bound["Q"] is q and bound["Out"] is out and bound["stride_om"] == 4 * d


def test_fp8_launch_refusals(monkeypatch):
    """gluon_args (shapes and strides only, CPU tensors): a config the FP8 kernel cannot run (key tiles not whole
    32-key chunks, a tile width it does not cover, more shared memory than fits) is refused by name before any
    launch (``fa3_forward_fp8(gluon_config=)`` takes any GluonConfig), the table's accepted; ints are ints."""
    from flashtile.runtime import fa3_gluon
    from flashtile.runtime.fa3_gluon import gluon_args, gluon_fp8_config

    monkeypatch.setattr(fa3_gluon, "sm_count", lambda index: 5)  # the persistent grid's size, no device here
    q8 = torch.zeros(1, 4, 300, 128, dtype=torch.float8_e4m3fn)
    vt = torch.zeros(1, 4, 128, 320, dtype=torch.float8_e4m3fn)  # fp8_v_operand's shape: Nk rounded up to 32
    ds = (torch.ones(1, 4),) * 3
    out = torch.zeros(1, 4, 300, 128, dtype=torch.bfloat16)
    assert gluon_args(q8, q8, vt, out, False, gluon_fp8_config(128, False), descales=ds).static
    for cfg, match in [(GluonConfig(16, 2), "whole 32-key chunks"), (GluonConfig(256, 4), "bytes of shared memory")]:
        with pytest.raises(ValueError, match=match):
            gluon_args(q8, q8, vt, out, False, cfg, descales=ds)
    x8 = torch.zeros(1, 4, 300, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="widths"):
        gluon_args(x8, x8, torch.zeros(1, 4, 32, 320, dtype=torch.float8_e4m3fn), x8.to(torch.bfloat16), False,
                   GluonConfig(128, 2), descales=ds)
    q = torch.zeros(1, 4, 300, 128, dtype=torch.bfloat16)
    for bad in (dict(block_n=64.0), dict(num_stages=True)):
        with pytest.raises(TypeError, match="must be an int"):
            fa3_gluon_forward(q, q, q, softmax_scale=0.5, config=replace(GluonConfig(64, 2), **bad))


@pytest.mark.parametrize("host_desc", [False, True])
def test_dynamic_launch_passes_a_fresh_zeroed_counter(monkeypatch, host_desc):
    """The dynamic scheduler's counter: one zeroed int32 on q's device per launch (each launch counts its
    claims from 0; no host sync, no state kept between calls), passed as ``tile_counter`` with DYNAMIC on;
    the persistent grid and tile count as without it."""
    calls, _ = _capture_launch(monkeypatch)
    q = torch.zeros(2, 4, 300, 128, dtype=torch.bfloat16)
    cfg = GluonConfig(128, 3, persistent=True, dynamic=True, host_desc=host_desc)
    for _ in range(2):
        fa3_gluon_forward(q, q, q, softmax_scale=0.5, causal=True, config=cfg)
        calls[-1][1]["tile_counter"].add_(7)  # what a launch's claims would leave behind
    (grid0, first), (grid1, second) = calls
    assert grid0 == grid1 == (5,) and first["total_tiles"] == second["total_tiles"] == 2 * 4 * 3
    assert first["DYNAMIC"] is True and first["PERSISTENT"] is True and first["HOST_DESC"] is host_desc
    for bound in (first, second):
        counter = bound["tile_counter"]
        assert counter.dtype == torch.int32 and counter.shape == (1,) and counter.device == q.device
    assert first["tile_counter"] is not second["tile_counter"]
    assert second["tile_counter"].item() == 7  # zero when launched
    fa3_gluon_forward(q, q, q, softmax_scale=0.5, causal=True, config=replace(cfg, dynamic=False))
    assert calls[-1][1]["DYNAMIC"] is False and calls[-1][1]["tile_counter"] is None


def test_host_descriptors_strides_of_unit_and_expanded_axes(monkeypatch):
    """A 0 stride on an axis of length 1 becomes a 16-byte one (same rows); an expanded axis (stride 0, length
    > 1: kv heads broadcast) cannot be a descriptor's: that launch builds its descriptors in the kernel,
    with the scratch allocator."""
    calls, allocs = _capture_launch(monkeypatch)
    cfg = GluonConfig(128, 3, host_desc=True)
    q = torch.zeros(1, 4, 1, 128, dtype=torch.float16).expand(2, 4, 1, 128)  # batch expanded: stride 0
    k = torch.zeros(1, 2, 300, 128, dtype=torch.float16)[:, :1]  # one kv head
    k0 = k.as_strided(k.shape, (0, 0, 128, 1))  # length-1 batch and head axes with stride 0
    fa3_gluon_forward(q[:1], k0, k0, softmax_scale=0.5, config=cfg)
    (_, bound), = calls
    assert bound["HOST_DESC"] is True and not allocs
    assert bound["k_desc0"].strides == [8, 8, 128, 1] and bound["q_desc0"].strides == [8, 128, 128, 1]
    fa3_gluon_forward(q, k.expand(2, 1, 300, 128), k.expand(2, 1, 300, 128), softmax_scale=0.5, config=cfg)
    _, bound = calls[-1]
    assert bound["HOST_DESC"] is False and allocs == [1]
    assert all(bound[f"{t}_desc{i}"] is None for t in "qkvo" for i in (0, 1))


def test_persistent_grid_is_at_most_the_tile_count(monkeypatch):
    """min(tiles, SMs): a problem with fewer tiles than SMs gets one program per tile, never an idle one."""
    import contextlib

    import flashtile.runtime.fa3_fwd as fa3_fwd
    import flashtile.runtime.launch as launch_mod
    from flashtile.kernels.fa3_gluon import fa3_gluon_kernel
    from flashtile.runtime import fa3_gluon

    grids = []
    monkeypatch.setattr(fa3_gluon, "_check", lambda *a: None)
    monkeypatch.setattr(fa3_fwd, "ensure_allocator", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(launch_mod, "launch", lambda kernel, grid, dynamic, static, **kw: grids.append(
        (grid, dynamic, static)))
    monkeypatch.setattr(fa3_gluon, "sm_count", lambda index: 132)
    cfg = GluonConfig(128, 3, persistent=True)
    for nq, tiles in [(1, 6), (128, 6), (129, 12), (30000, 3 * 2 * 235)]:
        q = torch.zeros(3, 2, nq, 64, dtype=torch.float16)
        fa3_gluon_forward(q, q, q, softmax_scale=0.125, config=cfg)
        grid, dynamic, static = grids[-1]
        bound = dict(zip(list(inspect.signature(fa3_gluon_kernel.fn).parameters)[len(dynamic):], static))
        assert grid == (min(tiles, 132),) and bound["total_tiles"] == tiles and bound["PERSISTENT"] is True


# --------------------------------------------------------------------------- #
# GPU (sm_90)
# --------------------------------------------------------------------------- #
SCHEDULES = {
    "both": {}, "intra": dict(pingpong=False), "pingpong": dict(intra=False),
    "neither": dict(intra=False, pingpong=False), "both+tma-store": dict(o_tma=True),
    "coalesced-store": dict(o_coalesced=True), "mask-tile-0": dict(skip_mask0=False),
    "3wg-intra": dict(num_wg=3, pingpong=False), "3wg-both": dict(num_wg=3),
    "lpt-3-heads": dict(lpt_group=3),  # 2 x 4 heads: groups of 3, 3 and 2
}


def _gpu_case(d, causal, cfg, nq, nk, seed=0, dtype=torch.bfloat16, contiguous=False):
    """GQA 4:2 (B, H, N, d) views of (B, N, H, d) storage, or with ``contiguous`` (B, H, N, d) tensors, against
    the float64 oracle; the output NaN-poisoned first.  Returns (out, lse)."""
    g = torch.Generator().manual_seed(d + nq + seed)

    def make(h, n, fill=None):
        shape = (2, h, n, d) if contiguous else (2, n, h, d)
        x = torch.randn(shape, generator=g).to("cuda", dtype) if fill is None else torch.full(
            shape, fill, dtype=dtype, device="cuda")
        return x if contiguous else x.transpose(1, 2)

    q, k, v = make(4, nq), make(2, nk), make(2, nk)
    out = make(4, nq, float("nan"))
    o, lse = fa3_gluon_forward(q, k, v, softmax_scale=d ** -0.5, causal=causal, out=out, config=cfg)
    ref_o, ref_lse = attention_ref(*(x.double().cpu() for x in (q, k, v)), scale=d ** -0.5, causal=causal)
    assert o is out and not torch.isnan(o).any() and not torch.isnan(lse).any()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), empty) and (o.cpu()[empty] == 0).all()
    assert_close(o, ref_o, o.dtype, o.device, "out")
    assert_close(lse, ref_lse, torch.float32, lse.device, "lse")
    return o, lse


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("nq,nk", [(1, 300), (333, 517), (517, 333)])
def test_gpu_matches_float64(d, causal, schedule, nq, nk):
    cfg = replace(gluon_config(d, causal), **SCHEDULES[schedule])
    if smem_bytes(cfg, d) > SMEM_LIMIT:
        cfg = replace(cfg, num_stages=2)
    if smem_bytes(cfg, d) > SMEM_LIMIT or (cfg.num_wg == 3 and d > 64):  # refused: spills at d = 128
        pytest.skip("config does not fit at this head dim")
    _gpu_case(d, causal, cfg, nq, nk)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [8, 40, 48, 56, 72, 96, 136, 192, 248])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("store", ["plain", "coalesced", "tma"])
def test_gpu_head_dims_not_a_power_of_two(d, causal, store):
    """Columns past d: zero-filled loads, masked or clipped stores (the output is NaN-poisoned first)."""
    cfg = replace(gluon_config(d, causal), o_coalesced=store == "coalesced", o_tma=store == "tma")
    if smem_bytes(cfg, d) > SMEM_LIMIT:
        cfg = replace(cfg, num_stages=2)
    for nq, nk in [(333, 517), (517, 333)]:
        _gpu_case(d, causal, cfg, nq, nk)


SPLIT_SCHEDULES = {
    "table": {}, "intra": dict(pingpong=False), "pingpong": dict(intra=False),
    "neither": dict(intra=False, pingpong=False), "tma-store": dict(o_tma=True),
    "coalesced-store": dict(o_coalesced=True), "3wg-64-keys": dict(num_wg=3, block_n=64, num_stages=3),
    "unsplit": dict(split_d=False),
}


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [80, 96, 112, 192])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", list(SPLIT_SCHEDULES))
def test_gpu_split_head_dims(d, causal, schedule):
    """The head dim as two tile parts (d = 80: 64 + 16, 96: 64 + 32, 112: 64 + 64 with 16 zero columns,
    192: 128 + 64) in every store mode and schedule, against the unsplit kernel's float64 oracle; GQA 4:2,
    ragged Nq / Nk, one query, causal bottom-right (the output is NaN-poisoned first)."""
    cfg = replace(gluon_config(d, causal), **{"split_d": True, **SPLIT_SCHEDULES[schedule]})
    while smem_bytes(cfg, d) > SMEM_LIMIT and cfg.num_stages > 2:
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.num_wg == 3 and d > 128:  # refused: 300 B of spills at 192 columns
        pytest.skip("three consumer warpgroups cover up to 128 columns")
    assert smem_bytes(cfg, d) <= SMEM_LIMIT
    assert (head_split(d, cfg.split_d)[1] > 0) == (schedule != "unsplit")
    for nq, nk in [(1, 300), (333, 517), (517, 333)]:
        _gpu_case(d, causal, cfg, nq, nk)


@pytest.mark.gpu
@hopper
def test_gpu_forward_builds_host_descriptors_for_large_calls(monkeypatch):
    """fa3_forward's Gluon launches take host-built descriptors from HOST_DESC_MIN_WORK (B Hq Nq Nk d) on, the
    in-kernel ones below it (Triton's per-call tensor-map encoding costs more host time than a small call saves)."""
    from flashtile.runtime import fa3_gluon
    from flashtile.runtime.fa3_fwd import fa3_forward

    seen = []
    real = fa3_gluon.gluon_launch
    monkeypatch.setattr(fa3_gluon, "gluon_launch", lambda *a: seen.append(a[-1].host_desc) or real(*a))
    for n in (256, 4096):  # 16 * n * n * 128: 2^27, 2^35
        q = torch.randn(1, 16, n, 128, device="cuda", dtype=torch.bfloat16)
        out, _ = fa3_forward(q, q, q, softmax_scale=0.1, causal=False)
        ref = attention_ref(*(x.double() for x in (q, q, q)), scale=0.1)[0]
        assert_close(out, ref, out.dtype, out.device, f"N = {n}")
    assert seen == [False, True]


@pytest.mark.gpu
@hopper
def test_gpu_forward_claims_causal_tiles_dynamically_from_many_keys(monkeypatch):
    """fa3_forward's causal Gluon launches take the dynamic scheduler from DYNAMIC_MIN_KEYS keys on (d = 128),
    one program per tile below; both match the oracle (Nq < Nk: bottom-right causal)."""
    from flashtile.runtime import fa3_gluon
    from flashtile.runtime.fa3_fwd import fa3_forward

    seen = []
    real = fa3_gluon.gluon_launch
    monkeypatch.setattr(fa3_gluon, "gluon_launch", lambda *a: seen.append(a[-1].dynamic) or real(*a))
    for nk in (fa3_gluon.DYNAMIC_MIN_KEYS - 8, fa3_gluon.DYNAMIC_MIN_KEYS):
        q = torch.randn(2, 3, 1000, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, 3, nk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out, lse = fa3_forward(q, k, v, softmax_scale=0.1, causal=True)
        ref_o, ref_lse = attention_ref(*(x.double() for x in (q, k, v)), scale=0.1, causal=True)
        assert_close(out, ref_o, out.dtype, out.device, f"out, Nk = {nk}")
        assert_close(lse, ref_lse, torch.float32, lse.device, f"lse, Nk = {nk}")
    assert seen == [False, True]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 48])
def test_gpu_narrow_causal_mid_keys_two_warpgroups_dynamic(monkeypatch, d):
    """Narrow causal tiles with Nk in NARROW_TWO_WG_KEYS run two consumer warpgroups over dynamic tiles (from the
    end of that range, three); GQA 4 / 2, Nq < Nk (bottom-right causal), tails; both match the oracle."""
    from flashtile.runtime import fa3_gluon
    from flashtile.runtime.fa3_fwd import fa3_forward

    seen = []
    real = fa3_gluon.gluon_launch
    monkeypatch.setattr(fa3_gluon, "gluon_launch", lambda *a: seen.append((a[-1].num_wg, a[-1].dynamic)) or real(*a))
    lo, hi = fa3_gluon.NARROW_TWO_WG_KEYS
    for nk in (lo + 40, hi):
        q = torch.randn(1, 4, 1000, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 2, nk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out, lse = fa3_forward(q, k, v, softmax_scale=0.1, causal=True)
        kk, vv = (x.repeat_interleave(2, dim=1) for x in (k, v))
        ref_o, ref_lse = attention_ref(*(x.double() for x in (q, kk, vv)), scale=0.1, causal=True)
        assert_close(out, ref_o, out.dtype, out.device, f"out, Nk = {nk}")
        assert_close(lse, ref_lse, torch.float32, lse.device, f"lse, Nk = {nk}")
    assert seen == [(2, True), (3, False)]


@pytest.mark.gpu
@hopper
def test_gpu_bound_launch_reuses_the_kernel_correctly():
    """Second and third calls of one signature go through runtime.launch's bound runner, new data each."""
    cfg = gluon_config(128, True)
    for seed in range(3):
        _gpu_case(128, True, cfg, 300, 700, seed=seed)


@pytest.mark.gpu
@hopper
def test_gpu_fp16_negative_scale_and_empty_keys():
    q = torch.randn(1, 2, 200, 128, device="cuda", dtype=torch.float16)
    o, lse = fa3_gluon_forward(q, q, q, softmax_scale=-0.2)
    ref_o, ref_lse = attention_ref(*(x.double().cpu() for x in (q, q, q)), scale=-0.2, causal=False)
    assert_close(o, ref_o, o.dtype, o.device, "out")
    assert_close(lse, ref_lse, torch.float32, lse.device, "lse")
    k = q[:, :, :0]
    o, lse = fa3_gluon_forward(q, k, k, softmax_scale=0.125)
    assert (o == 0).all() and torch.isneginf(lse).all()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [48, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_fp16_table_configs(d, causal):
    """fp16 through each head-dim row of the table (three consumer warpgroups at d <= 64, split tiles at 48 / 96 /
    192), ragged GQA shapes against the float64 oracle."""
    cfg = gluon_config(d, causal)
    for nq, nk in [(333, 517), (517, 333)]:
        _gpu_case(d, causal, cfg, nq, nk, dtype=torch.float16)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 96])
def test_gpu_back_to_back_on_two_streams(d):
    """Many launches in flight on two streams (CTAs of different launches sharing SMs): no hang, and every
    result equals the single launch's bit for bit (the kernel is deterministic)."""
    g = torch.Generator().manual_seed(d)
    q = torch.randn(2, 8, 2048, d, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(2, 8, 2048, d, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(2, 8, 2048, d, generator=g).to("cuda", torch.bfloat16)
    want, _ = fa3_gluon_forward(q, k, v, softmax_scale=d ** -0.5, causal=True)
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = []
    for i in range(40):
        s = streams[i % 2]
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            outs.append(fa3_gluon_forward(q, k, v, softmax_scale=d ** -0.5, causal=True)[0])
    torch.cuda.synchronize()
    assert all(torch.equal(o, want) for o in outs)


# --------------------------------------------------------------------------- #
# GPU (sm_90): the softmax fence and P packed in pairs (GluonConfig.fence, pack_p)
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("grid", ["tile", "persistent", "dynamic"])
@pytest.mark.parametrize("switches", [dict(fence=True), dict(pack_p=True), dict(fence=True, pack_p=True),
                                      dict(named_bars=True), dict(named_bars=True, pingpong=False)])
def test_gpu_schedule_switches_are_bitwise_the_same(monkeypatch, d, causal, grid, switches):
    """``fence`` moves only the P V GEMM's wait (after the softmax), ``pack_p`` rounds P in pairs with the
    same rounding and ``named_bars`` changes only how the ring and the turns synchronise: outputs and LSE bit for
    bit those of the kernel without them, and both against the float64 oracle; fp16 and bf16, GQA 4:2, ragged,
    one query; the persistent grids on 3 programs (ring slots and turns across tiles; named barriers left with
    unmatched arrivals at each program's exit)."""
    from flashtile.runtime import fa3_gluon

    extra = {"tile": dict(persistent=False, dynamic=False), "persistent": dict(persistent=True, dynamic=False),
             "dynamic": dict(persistent=True, dynamic=True)}[grid]
    cfg = replace(gluon_config(d, causal), fence=False, pack_p=False, **extra)  # both off (the table packs P)
    monkeypatch.setattr(fa3_gluon, "sm_count", lambda index: 3)
    for dtype in (torch.bfloat16, torch.float16):
        for nq, nk in [(517, 333), (333, 517), (1, 300)]:
            o_on, lse_on = _gpu_case(d, causal, replace(cfg, **switches), nq, nk, dtype=dtype)
            o_off, lse_off = _gpu_case(d, causal, cfg, nq, nk, dtype=dtype)
            assert torch.equal(o_on, o_off) and torch.equal(lse_on, lse_off), (dtype, nq, nk)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d,fields", [(64, {}), (64, dict(block_n=64)), (64, dict(num_wg=2)), (192, {}), (256, {}),
                                      (256, dict(o_tma=True)),
                                      (192, dict(pingpong=False)), (256, dict(named_bars=True)), (128, {}),
                                      (64, dict(block_n=64, named_bars=True)), (256, dict(host_desc=True)),
                                      (128, dict(block_n=64, num_stages=3))])
@pytest.mark.parametrize("grid", ["tile", "persistent", "dynamic"])
def test_gpu_wg_skip_is_bitwise_the_same(monkeypatch, d, fields, grid):
    """``wg_skip`` (causal: a warpgroup skips the kv tiles its rows see no key of) leaves out products with P = 0
    and masked maxima only: outputs and LSE bit for bit the kernel's without it, both against the float64 oracle;
    three consumers over 128-key tiles (one skipped tile) and 64-key ones (up to two), two consumers, the TMA store
    (Q rows reused), named barriers (with three consumers too), host descriptors, no ping-pong; Nq > Nk (rows without keys), Nq < Nk, one query; the persistent
    grids on 3 programs (turns, ring slots and the Q release across tiles)."""
    from flashtile.runtime import fa3_gluon

    extra = {"tile": dict(persistent=False, dynamic=False), "persistent": dict(persistent=True, dynamic=False),
             "dynamic": dict(persistent=True, dynamic=True)}[grid]
    cfg = replace(gluon_config(d, True), **fields, **extra)
    while smem_bytes(cfg, d) > SMEM_LIMIT and cfg.num_stages > 2:
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    monkeypatch.setattr(fa3_gluon, "sm_count", lambda index: 3)
    for nq, nk in [(517, 333), (333, 517), (1, 300), (700, 700)]:
        o_on, lse_on = _gpu_case(d, True, replace(cfg, wg_skip=True), nq, nk)
        o_off, lse_off = _gpu_case(d, True, cfg, nq, nk)
        assert torch.equal(o_on, o_off) and torch.equal(lse_on, lse_off), (nq, nk)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_wg_skip_fp8_is_bitwise_the_same(monkeypatch, d):
    """``wg_skip`` on the FP8 kernel (its table: three consumers over 64-key tiles at d = 64, two over 128-key tiles
    at 128 and 64-key ones at 256): outputs and LSE bit for bit those without it; the dynamic grid from 2k keys on 3
    programs (turns and ring slots across tiles)."""
    import flashtile.runtime.fa3_fwd as fa3_fwd
    from flashtile.runtime import fa3_gluon
    from flashtile.runtime.fa3_gluon import FP8_DYNAMIC_MIN_KEYS, gluon_fp8_config

    monkeypatch.setattr(fa3_gluon, "sm_count", lambda index: 3)
    fp8 = torch.float8_e4m3fn
    g = torch.Generator().manual_seed(d)
    for nq, nk in [(517, 333), (333, 517), (700, 700), (2100, 2100), (2000, 2100)]:
        q = (torch.randn(2, 4, nq, d, generator=g) * 4).to(fp8).cuda()
        k = (torch.randn(2, 2, nk, d, generator=g) * 4).to(fp8).cuda()
        v = (torch.randn(2, 2, nk, d, generator=g) * 4).to(fp8).cuda()
        scales = tuple((torch.rand(2, 2, generator=g) + 0.5).cuda() for _ in range(3))
        cfg = gluon_fp8_config(d, True, nk >= FP8_DYNAMIC_MIN_KEYS)
        on = fa3_fwd.fa3_forward_fp8(q, k, v, scales, softmax_scale=d ** -0.5, causal=True,
                                     gluon_config=replace(cfg, wg_skip=True))
        off = fa3_fwd.fa3_forward_fp8(q, k, v, scales, softmax_scale=d ** -0.5, causal=True, gluon_config=cfg)
        assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1]), (nq, nk)
        assert not torch.isnan(on[0]).any()


# --------------------------------------------------------------------------- #
# GPU (sm_90): persistent tile loop
# --------------------------------------------------------------------------- #
PERSISTENT_CASES = [(d, s) for d in (64, 128) for s in SCHEDULES] + [
    (d, s) for d in (96, 192) for s in ("table", "neither", "tma-store", "coalesced-store", "3wg-64-keys")] + [
    (256, s) for s in ("table", "neither", "tma-store")] + [  # two stages: K and V halves of a slot freed apart
    (40, "table"), (80, "table")]  # split narrow rows, persistent without a mask below 8k keys


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d,schedule", PERSISTENT_CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_persistent_matches_float64(monkeypatch, d, schedule, causal):
    """Persistent programs over many tiles each (the SM count patched to 3 and 7): ring slots, mbarrier
    parities and ping-pong turns carried across tiles, Q reloaded after q_empty, causal tiles that see no
    key (Nq > Nk: O = 0, LSE = -inf without loads) among tiles with work; GQA 4:2, ragged, one query."""
    from flashtile.runtime import fa3_gluon

    base = replace(gluon_config(d, causal), split_d=True)
    cfg = replace(base, persistent=True, **{**SCHEDULES, **SPLIT_SCHEDULES}[schedule])
    while smem_bytes(cfg, d) > SMEM_LIMIT and cfg.num_stages > 2:
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.num_wg == 3 and sum(cfg.widths(d)) > (128 if cfg.block_n <= 64 else 64):  # refused: spills
        pytest.skip("three consumer warpgroups: up to 64 columns, 128 with 64-key tiles")
    for sms in (3, 7):
        monkeypatch.setattr(fa3_gluon, "sm_count", lambda index, sms=sms: sms)
        for nq, nk in [(1, 300), (333, 517), (517, 333)]:
            _gpu_case(d, causal, cfg, nq, nk, seed=sms)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_persistent_fp16_real_grid(d, causal):
    """fp16, the device's own SM count and more tiles than SMs (2 x 8 heads x 4k queries: 352-512 tiles):
    the one-program-per-tile kernel's result on every head, and the float64 oracle's on two of them."""
    _fp16_real_grid_matches(d, causal, replace(gluon_config(d, causal), persistent=True))


def _fp16_real_grid_matches(d, causal, cfg):
    """``cfg`` (a persistent grid) on 2 x 8 heads x 4k fp16 queries at the device's SM count against one program
    per tile on every head and the float64 oracle on two heads; the output NaN-poisoned."""
    g = torch.Generator().manual_seed(d)
    q = torch.randn(2, 8, 4096, d, generator=g).to("cuda", torch.float16)
    k = torch.randn(2, 4, 4096, d, generator=g).to("cuda", torch.float16)
    v = torch.randn(2, 4, 4096, d, generator=g).to("cuda", torch.float16)
    per_tile = replace(cfg, persistent=False, dynamic=False)
    o1, lse1 = fa3_gluon_forward(q, k, v, softmax_scale=d ** -0.5, causal=causal, config=per_tile)
    poisoned = torch.full_like(q, float("nan"))
    o2, lse2 = fa3_gluon_forward(q, k, v, softmax_scale=d ** -0.5, causal=causal, out=poisoned, config=cfg)
    # the same per-tile arithmetic in the same order (every head, not just the oracle's two): equal up to the
    # rounding a different register allocation may bring; a skipped (NaN) or misplaced tile is far off
    torch.testing.assert_close(o2, o1, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse2, lse1, atol=1e-4, rtol=1e-5)
    # query heads 0-1 share kv head 0 (GQA 8:4)
    ref_o, ref_lse = attention_ref(q[:1, :2].double().cpu(), k[:1, :1].double().cpu(), v[:1, :1].double().cpu(),
                                   scale=d ** -0.5, causal=causal)
    assert_close(o2[:1, :2], ref_o, o2.dtype, o2.device, "out")
    assert_close(lse2[:1, :2], ref_lse, torch.float32, lse2.device, "lse")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 96])
def test_gpu_persistent_back_to_back_on_two_streams(d):
    """Many persistent launches in flight on two streams (programs of different launches sharing SMs, each
    launch looping over more tiles than SMs): no hang, every result equal to one launch's bit for bit."""
    _two_streams_bitwise(d, replace(gluon_config(d, True), persistent=True))


def _two_streams_bitwise(d, cfg):
    """40 causal launches of ``cfg`` alternating between two streams, each result equal to one launch's."""
    g = torch.Generator().manual_seed(d)
    q = torch.randn(2, 8, 2048, d, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(2, 8, 2048, d, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(2, 8, 2048, d, generator=g).to("cuda", torch.bfloat16)
    want, _ = fa3_gluon_forward(q, k, v, softmax_scale=d ** -0.5, causal=True, config=cfg)
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = []
    for i in range(40):
        s = streams[i % 2]
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            outs.append(fa3_gluon_forward(q, k, v, softmax_scale=d ** -0.5, causal=True, config=cfg)[0])
    torch.cuda.synchronize()
    assert all(torch.equal(o, want) for o in outs)


# --------------------------------------------------------------------------- #
# GPU (sm_90): host-built TMA descriptors (GluonConfig.host_desc)
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("store", ["plain", "tma"])
def test_gpu_host_descriptors_match_float64(monkeypatch, d, causal, persistent, store):
    """host_desc on and off against the float64 oracle and each other (the same arithmetic: equal bit for bit):
    rank-4 boxes zero-filled past each head's Nq / Nk and past d (split tiles at 96 / 192), GQA 4:2, ragged
    517 x 333 (causal: tiles that see no key) and 333 x 517, one query, (B, N, H, d) storage and contiguous
    (B, H, N, d), O by masked stores or by TMA; persistent with 3 programs (many tiles each: Q reloads after
    q_empty with no descriptor rebuild)."""
    from flashtile.runtime import fa3_gluon

    cfg = replace(gluon_config(d, causal), persistent=persistent, o_tma=store == "tma")
    while smem_bytes(cfg, d) > SMEM_LIMIT:
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    if persistent:
        monkeypatch.setattr(fa3_gluon, "sm_count", lambda index: 3)
    for contiguous in (False, True):
        for nq, nk in [(517, 333), (333, 517), (1, 300)]:
            o_host, lse_host = _gpu_case(d, causal, replace(cfg, host_desc=True), nq, nk, contiguous=contiguous)
            o_dev, lse_dev = _gpu_case(d, causal, cfg, nq, nk, contiguous=contiguous)
            assert torch.equal(o_host, o_dev) and torch.equal(lse_host, lse_dev), (contiguous, nq, nk)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("persistent", [False, True])
def test_gpu_host_descriptors_per_call(persistent):
    """The bound launch (runtime.launch) takes each call's descriptors: one signature, new tensors every
    call (a descriptor kept from the first call would read its tensors)."""
    cfg = replace(gluon_config(128, False), persistent=persistent, host_desc=True)
    for seed in range(3):
        _gpu_case(128, False, cfg, 300, 700, seed=seed)


@pytest.mark.gpu
@hopper
def test_gpu_host_descriptors_expanded_and_unit_axes():
    """An expanded kv batch axis (stride 0, length 2) falls back to in-kernel descriptors; length-1 axes
    with stride 0 take host descriptors (stride replaced); fp16; both against the float64 oracle."""
    cfg = replace(gluon_config(96, True), host_desc=True)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 200, 96, generator=g).to("cuda", torch.float16)
    kv = torch.randn(1, 2, 300, 96, generator=g).to("cuda", torch.float16)
    k, v = kv.expand(2, 2, 300, 96), (kv + 1).expand(2, 2, 300, 96)
    o, lse = fa3_gluon_forward(q, k, v, softmax_scale=0.1, causal=True, config=cfg)
    ref_o, ref_lse = attention_ref(q.double().cpu(), k.double().cpu(), v.double().cpu(), scale=0.1, causal=True)
    assert_close(o, ref_o, o.dtype, o.device, "out")
    assert_close(lse, ref_lse, torch.float32, lse.device, "lse")
    k1 = kv[:, :1].as_strided((1, 1, 300, 96), (0, 0, 96, 1))  # length-1 batch and head axes, stride 0
    q1 = q[:1, :2]
    o, lse = fa3_gluon_forward(q1, k1, k1, softmax_scale=0.1, causal=False, config=cfg)
    ref_o, ref_lse = attention_ref(q1.double().cpu(), k1.double().cpu(), k1.double().cpu(), scale=0.1)
    assert_close(o, ref_o, o.dtype, o.device, "out")
    assert_close(lse, ref_lse, torch.float32, lse.device, "lse")


# --------------------------------------------------------------------------- #
# GPU (sm_90): dynamic tile scheduler (GluonConfig.dynamic)
# --------------------------------------------------------------------------- #
def _dynamic(d, causal, host_desc, **kw):
    return replace(gluon_config(d, causal), persistent=True, dynamic=True, host_desc=host_desc, **kw)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("host_desc", [False, True])
def test_gpu_dynamic_matches_float64(monkeypatch, d, causal, host_desc):
    """Claimed tiles against the float64 oracle and the static round robin (the same per-tile arithmetic:
    equal bit for bit): 3 programs (many claims each: ring slots and parities, Q reloads, tiles that see no
    key handed over between tiles with work) and the device's SM count; GQA 4:2, ragged 517 x 333 and
    333 x 517, one query."""
    from flashtile.runtime import fa3_gluon

    cfg = _dynamic(d, causal, host_desc)
    real = fa3_gluon.sm_count(torch.cuda.current_device())
    for sms in (3, real):
        monkeypatch.setattr(fa3_gluon, "sm_count", lambda index, sms=sms: sms)
        for nq, nk in [(517, 333), (333, 517), (1, 300)]:
            o_dyn, lse_dyn = _gpu_case(d, causal, cfg, nq, nk, seed=sms)
            o_st, lse_st = _gpu_case(d, causal, replace(cfg, dynamic=False), nq, nk, seed=sms)
            assert torch.equal(o_dyn, o_st) and torch.equal(lse_dyn, lse_st), (sms, nq, nk)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("schedule", ["lpt-3-heads", "neither", "both+tma-store", "coalesced-store"])
def test_gpu_dynamic_schedules(monkeypatch, schedule):
    """Claims in the LPT_GROUP order and beside the other schedules / O stores (3 programs, causal, d = 128)."""
    from flashtile.runtime import fa3_gluon

    monkeypatch.setattr(fa3_gluon, "sm_count", lambda index: 3)
    cfg = _dynamic(128, True, False, **SCHEDULES[schedule])
    while smem_bytes(cfg, 128) > SMEM_LIMIT:  # the coalesced store's scratch leaves room for 2 stages
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    for nq, nk in [(517, 333), (333, 517)]:
        _gpu_case(128, True, cfg, nq, nk)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_dynamic_fp16_real_grid(d, causal):
    """fp16, the device's SM count and more tiles than SMs (2 x 8 heads x 4k queries: 352-512 tiles, so
    programs claim): the one-program-per-tile result on every head, the float64 oracle's on two."""
    _fp16_real_grid_matches(d, causal, _dynamic(d, causal, True))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_dynamic_back_to_back_on_two_streams(d):
    """40 dynamic launches in flight on two streams (each its own counter; programs of different launches
    sharing SMs, more tiles than SMs): no hang, every result equal to one launch's bit for bit (which program
    runs a tile does not change its arithmetic)."""
    _two_streams_bitwise(d, _dynamic(d, True, True))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_dynamic_cuda_graph_replays(d):
    """A captured dynamic launch replayed twice, its output NaN-poisoned before each replay: every replay
    runs every tile (the captured memset zeroes the counter; a counter left at its end value would let each
    program run its first tile only)."""
    cfg = _dynamic(d, True, True)
    g = torch.Generator().manual_seed(d)
    q = torch.randn(2, 8, 2048, d, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(2, 8, 2048, d, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(2, 8, 2048, d, generator=g).to("cuda", torch.bfloat16)
    want, want_lse = fa3_gluon_forward(q, k, v, softmax_scale=d ** -0.5, causal=True, config=cfg)  # compiled
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm the bound launch off the capture
        fa3_gluon_forward(q, k, v, softmax_scale=d ** -0.5, causal=True, config=cfg)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = fa3_gluon_forward(q, k, v, softmax_scale=d ** -0.5, causal=True, config=cfg)
    for _ in range(2):
        o.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o, want) and torch.equal(lse, want_lse)


def test_forward_passes_many_keys_from_dynamic_min_keys(monkeypatch):
    """fa3_fwd.forward_checked (the ops' entry) asks gluon_config for the dynamic causal grid from
    DYNAMIC_MIN_KEYS keys on, not below, and never without a mask; at d = 64 two warpgroups over dynamic tiles for
    causal keys in NARROW_TWO_WG_KEYS only, and without a mask a persistent grid below NARROW_PERSISTENT_MAX_KEYS
    (the launch itself stubbed: no sm_90 here)."""
    from flashtile.runtime import fa3_fwd, fa3_gluon

    seen = []
    monkeypatch.setattr(fa3_gluon, "gluon_launch", lambda *a: seen.append((a[-2], a[-1])))
    monkeypatch.setattr(fa3_fwd, "ensure_allocator", lambda: None)
    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    for nk, causal in ((fa3_gluon.DYNAMIC_MIN_KEYS - 1, True), (fa3_gluon.DYNAMIC_MIN_KEYS, True),
                       (fa3_gluon.DYNAMIC_MIN_KEYS, False)):
        k = torch.zeros(1, 2, nk, 128, dtype=torch.bfloat16)
        fa3_fwd.forward_checked(q, k, k, 0.1, causal)
    assert [(c, cfg.dynamic) for c, cfg in seen] == [(True, False), (True, True), (False, False)]
    seen.clear()
    q = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    lo, hi = fa3_gluon.NARROW_TWO_WG_KEYS
    for nk, causal in ((lo - 1, True), (lo, True), (hi - 1, True), (hi, True), (lo, False)):
        k = torch.zeros(1, 2, nk, 64, dtype=torch.bfloat16)
        fa3_fwd.forward_checked(q, k, k, 0.1, causal)
    assert [(cfg.num_wg, cfg.dynamic) for _, cfg in seen] == [(3, False), (2, True), (2, True), (3, False), (3, False)]
    seen.clear()  # without a mask below NARROW_PERSISTENT_MAX_KEYS keys: persistent (static) under width 128; from
    # there one program per tile, but dynamically claimed tiles at width 64
    for d in (64, 48):
        q = torch.zeros(1, 2, 64, d, dtype=torch.bfloat16)
        for nk in (fa3_gluon.NARROW_PERSISTENT_MAX_KEYS - 1, fa3_gluon.NARROW_PERSISTENT_MAX_KEYS):
            k = torch.zeros(1, 2, nk, d, dtype=torch.bfloat16)
            fa3_fwd.forward_checked(q, k, k, 0.1, False)
    assert [(cfg.persistent, cfg.dynamic) for _, cfg in seen] == [(True, False), (True, True), (True, False),
                                                                  (False, False)]


def test_fp8_v_operand_permutes_keys_per_chunk():
    """V's transpose with each 32-key chunk in the order of P's registers (kernel ``_p_operand``): column
    32c + 16h + 4q + 2e + b holds key 32c + 16h + 8e + 2q + b; zero past Nk, columns rounded up to 32 (the
    copy kernel interpreted, on a (B, N, H, d)-storage view)."""
    from flashtile.runtime.fa3_gluon import fp8_v_operand

    b, hk, nk, d = 2, 3, 70, 16
    v = (torch.randn(b, nk, hk, d) * 10).to(torch.float8_e4m3fn).transpose(1, 2)  # (B, Hk, Nk, d) view
    vt = fp8_v_operand(v).float()
    assert vt.shape == (b, hk, d, 96) and vt.is_contiguous()
    want = torch.zeros(b, hk, d, 96)
    for col in range(96):
        c, r = divmod(col, 32)
        h, r = divmod(r, 16)
        q, r = divmod(r, 4)
        e, bit = divmod(r, 2)
        key = 32 * c + 16 * h + 8 * e + 2 * q + bit
        if key < nk:
            want[..., col] = v[:, :, key].float()
    assert torch.equal(vt, want)
    assert torch.equal(fp8_v_operand(v[:, :, :64]).float(), want[..., :64])  # whole chunks only
    plain = fp8_v_operand(v, permute=False, multiple=16).float()  # the Triton FP8 kernel's operand
    assert plain.shape == (b, hk, d, 80) and torch.equal(plain[..., :nk], v.float().transpose(2, 3))
    assert (plain[..., nk:] == 0).all()
    assert fp8_v_operand(v[:, :, :0]).shape == (b, hk, d, 0)
    # the kernel's _p_operand: P's [N] keys as [N / 32, h, e, q, b], read in (h, q, e, b) order per chunk
    held = torch.arange(96).reshape(3, 2, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(96)
    for col in range(96):
        c, r = divmod(col, 32)
        assert held[col] == 32 * c + 16 * (r // 16) + 8 * ((r % 4) // 2) + 2 * ((r % 16) // 4) + r % 2


def test_fp8_v_operand_folds_many_heads(monkeypatch):
    """More (batch, kv head) pairs than one grid row holds: the pairs fold onto grid axis z (the last row's
    spare programs exit) and every pair is copied."""
    from flashtile.runtime import common
    from flashtile.runtime.fa3_gluon import fp8_v_operand

    monkeypatch.setattr(common, "GRID_YZ_MAX", 4)
    v = (torch.randn(3, 2, 40, 16) * 8).to(torch.float8_e4m3fn)  # 6 pairs: grid (2, 4, 2)
    plain = fp8_v_operand(v, permute=False, multiple=16).float()
    assert torch.equal(plain[..., :40], v.float().transpose(2, 3)) and (plain[..., 40:] == 0).all()


def test_fp8_config_table():
    from flashtile.runtime.fa3_gluon import FP8_WIDTHS, gluon_fp8_config

    for d in range(48, 257, 16):
        for causal in (False, True):
            cfg = gluon_fp8_config(d, causal, causal)
            assert smem_bytes(cfg, d, esize=1) <= SMEM_LIMIT and cfg.num_stages >= 2
            assert not (cfg.split_d or cfg.o_tma or cfg.host_desc)  # one column part, plain stores, device descs
            assert not cfg.pack_p  # the 8-bit P is its own operand
            base = gluon_config(block_d(d), causal, many_keys=causal)
            assert (cfg.num_wg, cfg.persistent, cfg.dynamic, cfg.intra) == (
                base.num_wg, base.persistent, base.dynamic, base.intra)
            assert cfg.pingpong == (block_d(d) != 256)  # measured: width 256 without ping-pong
    assert gluon_fp8_config(128, False).block_n == 128 and gluon_fp8_config(256, False).block_n == 64
    assert gluon_fp8_config(64, True).block_n == 64 and gluon_fp8_config(64, True).num_wg == 3
    assert gluon_fp8_config(256, True, block_n=128, num_stages=4).num_stages == 3  # 32 KB K and V tiles
    assert FP8_WIDTHS == (64, 128, 256)
    with pytest.raises(NotImplementedError):
        gluon_fp8_config(32, False)


def test_fp8_forward_launches_gluon_with_descales(monkeypatch):
    """fa3_forward_fp8 at a Gluon width: the Gluon kernel bound with e4m3 q / k, the permuted V operand, the
    descales and their strides, the error word and the FP8 config; the Triton kernel where GLUON_FP8 is off."""
    import flashtile.runtime.fa3_fwd as fa3_fwd
    from flashtile.runtime.fa3_gluon import FP8_DYNAMIC_MIN_KEYS, fp8_v_operand, gluon_fp8_config

    import flashtile.runtime.launch as launch_mod
    from flashtile.kernels.fa3_gluon import fa3_gluon_kernel

    real_launch = launch_mod.launch
    calls, _ = _capture_launch(monkeypatch)
    capture = launch_mod.launch
    # the V operand's copy kernel runs (interpreted); the Gluon launch is captured
    monkeypatch.setattr(launch_mod, "launch", lambda kernel, *a, **kw: (
        capture if kernel is fa3_gluon_kernel else real_launch)(kernel, *a, **kw))
    fp8 = torch.float8_e4m3fn
    q = (torch.randn(2, 4, 300, 128) * 4).to(fp8)
    k = (torch.randn(2, 2, 500, 128) * 4).to(fp8)
    v = (torch.randn(2, 2, 500, 128) * 4).to(fp8)
    qs, ks, vs = torch.rand(2, 2) + 0.5, torch.rand(2, 2) + 0.5, torch.rand(1, 2).expand(2, 2)
    out, lse = fa3_fwd.fa3_forward_fp8(q, k, v, (qs, ks, vs), softmax_scale=0.25, causal=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (2, 4, 300)
    (grid, bound), = calls
    cfg = gluon_fp8_config(128, True, 500 >= FP8_DYNAMIC_MIN_KEYS)
    assert bound["Q"] is q and bound["K"] is k and torch.equal(bound["V"].float(), fp8_v_operand(v).float())
    assert bound["QDescale"] is qs and bound["KDescale"] is ks and bound["VDescale"] is vs
    assert bound["Err"].dtype == torch.int32 and bound["Err"].numel() >= 1
    assert (bound["stride_qsb"], bound["stride_qsh"], bound["stride_vsb"], bound["stride_vsh"]) == (2, 1, 0, 1)
    assert bound["stride_vn"] == 512  # a (d, Nk rounded up to 32) row of the operand
    assert bound["qk_scale"] == pytest.approx(0.25 * 1.4426950408889634)
    assert (bound["BLOCK_N"], bound["NUM_STAGES"], bound["NUM_WG"], bound["BLOCK_D1"]) == (
        cfg.block_n, cfg.num_stages, cfg.num_wg, 0)
    assert fa3_fwd.fp8_block_sizes(128, True, 500) == (cfg.block_m, cfg.block_n)
    monkeypatch.setattr(fa3_fwd, "GLUON_FP8", False)
    triton_calls = []
    monkeypatch.setattr(fa3_fwd, "launch", lambda *a, **kw: triton_calls.append(kw))
    fa3_fwd.fa3_forward_fp8(q, k, v, (qs, ks, vs), softmax_scale=0.25, causal=True)
    assert len(calls) == 1 and len(triton_calls) == 1 and triton_calls[0]["descales"] == (qs, ks, vs)
    assert fa3_fwd.fp8_block_sizes(128, True, 500) == (128, fa3_fwd.fa3_fp8_config(128, True).block_n)
