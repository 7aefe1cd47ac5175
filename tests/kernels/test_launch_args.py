"""The FA2 forward and backward, FA1 and softmax kernels are launched with positional argument tuples.

Each test records the tuples a wrapper builds (nothing is launched) and pairs them with the
kernel's parameter names from ``inspect.signature(kernel.fn)``: the count must match and each
named slot must hold the value that name stands for.  Inputs are strided so that every stride
differs from its neighbours, and every optional feature is on, so a swapped pair shows.
CPU only: the recording replaces the launch.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from flashtile.kernels.fa1_fwd import _fa1_fwd_kernel
from flashtile.kernels.fa2_bwd import _bwd_dkdv_kernel, _bwd_dq_kernel, _bwd_preprocess
from flashtile.kernels.fa2_fwd import _fa2_fwd_kernel
from flashtile.kernels.softmax import _softmax_online_kernel
from flashtile.reference.masks import BlockMask
from flashtile.runtime import fa1_fwd as fa1_runtime
from flashtile.runtime import fa2_bwd as bwd_runtime
from flashtile.runtime import fa2_fwd as fwd_runtime
from flashtile.runtime import softmax as softmax_runtime


def _params(kernel) -> list[str]:
    while not inspect.isfunction(kernel):  # heuristics / JIT / interpreter wrappers
        kernel = kernel.fn
    return list(inspect.signature(kernel).parameters)


def _strided(b, h, n, d, perm, seed):
    """A (b, h, n, d) view of storage laid out in the order ``perm`` of (b, h, n, d), with padding on d."""
    g = torch.Generator().manual_seed(seed)
    sizes = (b, h, n, d + 3)
    store = torch.randn([sizes[i] for i in perm], generator=g)
    inv = [perm.index(i) for i in range(4)]
    return store.permute(inv)[..., :d]


def _named(kernel, dynamic, static) -> dict:
    names = _params(kernel)
    values = list(dynamic) + list(static)
    assert len(values) == len(names), (len(values), names)
    return dict(zip(names, values))


def _expect_strides(named, prefix, t):
    for suffix, s in zip(prefix[1], t.stride()):
        assert named[prefix[0] + suffix] == s, (prefix[0] + suffix, named[prefix[0] + suffix], s)


def _record(monkeypatch, module):
    calls = []
    monkeypatch.setattr(module, "launch", lambda kernel, grid, dynamic, static, **kw: calls.append((kernel, dynamic, static)))
    return calls


B, HQ, HK, NQ, NK, D = 2, 4, 2, 40, 56, 24


def _inputs():
    q = _strided(B, HQ, NQ, D, (0, 2, 1, 3), 1)  # (B, N, H, d) storage
    k = _strided(B, HK, NK, D, (2, 0, 1, 3), 2)
    v = _strided(B, HK, NK, D, (1, 0, 2, 3), 3)
    alibi = torch.rand(B, HQ)
    bias = torch.randn(HQ, 1, NK)  # broadcast over batch and query rows: stride 0 there
    mask = torch.ones(HQ, 3, 4, dtype=torch.bool)  # (Hq, Tr, Tc): broadcast over batch
    return q, k, v, alibi, bias, BlockMask(mask, (16, 16))


def test_forward_launch_matches_kernel_parameters(monkeypatch):
    calls = _record(monkeypatch, fwd_runtime)
    q, k, v, alibi, bias, bm = _inputs()
    out = torch.empty(B, HQ, NQ, D)
    rng = torch.tensor([5, 7], dtype=torch.int64)
    fwd_runtime.fa2_forward(q, k, v, softmax_scale=0.3, window_size=(9, 4), softcap=2.0, alibi_slopes=alibi,
                            bias=bias, dropout_p=0.2, rng_state=rng, block_mask=bm, out=out)
    (kernel, dynamic, static), = calls
    assert kernel is _fa2_fwd_kernel.fn
    a = _named(kernel, dynamic, static)
    assert a["Q"] is q and a["K"] is k and a["V"] is v and a["Out"] is out and a["Alibi"] is alibi and a["Rng"] is rng
    assert a["LSE"].shape == (B, HQ, NQ) and a["Bias"].shape == (B, HQ, NQ, NK)
    assert (a["sm_scale"], a["softcap"], a["dropout_p"]) == (0.3, 2.0, 0.2)
    for name, t in (("stride_q", q), ("stride_k", k), ("stride_v", v), ("stride_o", out)):
        last = "m" if name in ("stride_q", "stride_o") else "n"
        _expect_strides(a, (name, ("b", "h", last)), t)
    _expect_strides(a, ("stride_bias_", "bhmn"), a["Bias"])
    assert (a["stride_bias_b"], a["stride_bias_m"]) == (0, 0)
    assert (a["stride_alibi_b"], a["stride_alibi_h"]) == alibi.stride()
    assert (a["stride_cnt_b"], a["stride_idx_b"]) == (0, 0) and a["stride_cnt_h"] == a["KVCount"].stride(1)
    assert a["stride_cnt_r"] == a["KVCount"].stride(2) and a["stride_idx_r"] == a["KVIdx"].stride(2)
    assert a["stride_idx_h"] == a["KVIdx"].stride(1)
    want = dict(n_heads_q=HQ, n_bh=B * HQ, kv_group=HQ // HK, seqlen_q=NQ, seqlen_k=NK, head_dim=D,
                window_left=9, window_right=4, mask_block_m=16, mask_block_n=16, tune_nq=0, tune_nk=0,
                BLOCK_D=32, HAS_LEFT=True, HAS_RIGHT=True, HAS_SOFTCAP=True, HAS_ALIBI=True, HAS_BIAS=True,
                HAS_DROPOUT=True, IS_BLOCK_SPARSE=True, EVEN_D=False, DOT_PRECISION="tf32", UPCAST_DOT=False)
    assert {n: a[n] for n in want} == want
    assert a["EVEN_M"] == (NQ % a["BLOCK_M"] == 0) and a["EVEN_N"] == (NK % a["BLOCK_N"] == 0)


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_launches_match_kernel_parameters(monkeypatch, deterministic):
    calls = _record(monkeypatch, bwd_runtime)
    q, k, v, alibi, bias, bm = _inputs()
    dout = _strided(B, HQ, NQ, D, (1, 2, 0, 3), 4)
    out = _strided(B, HQ, NQ, D, (2, 1, 0, 3), 5)
    lse = torch.zeros(B, HQ, NQ)
    rng = torch.tensor([5, 7], dtype=torch.int64)
    dq, dk, dv = torch.empty(B, HQ, NQ, D), torch.empty(B, HK, NK, D), torch.empty(B, HK, NK, D)
    bwd_runtime.fa2_backward(dout, q, k, v, out, lse, softmax_scale=0.3, window_size=(9, 4), softcap=2.0,
                             alibi_slopes=alibi, bias=bias, dropout_p=0.2, rng_state=rng, block_mask=bm,
                             deterministic=deterministic, dq=dq, dk=dk, dv=dv)
    kernels = [c[0] for c in calls]
    assert kernels == [_bwd_preprocess, _bwd_dkdv_kernel] + ([_bwd_dq_kernel] if deterministic else [])
    pre = _named(*calls[0])
    assert pre["Out"] is out and pre["DOut"] is dout
    _expect_strides(pre, ("stride_o", "bhm"), out)
    _expect_strides(pre, ("stride_do", "bhm"), dout)
    assert (pre["n_heads_q"], pre["n_bh"], pre["seqlen_q"], pre["HEAD_DIM"], pre["BLOCK_D"]) == (HQ, B * HQ, NQ, D, 32)
    common = dict(n_heads_q=HQ, n_heads_k=HK, seqlen_q=NQ, seqlen_k=NK, mask_block_m=16, mask_block_n=16,
                  window_left=9, window_right=4, HEAD_DIM=D, BLOCK_D=32, HAS_LEFT=True, HAS_RIGHT=True,
                  HAS_SOFTCAP=True, HAS_ALIBI=True, HAS_BIAS=True, HAS_DROPOUT=True, IS_BLOCK_SPARSE=True,
                  DOT_PRECISION="tf32", UPCAST_DOT=False, USE_PDL=False, WIDE=False)
    for kernel, dynamic, static in calls[1:]:
        a = _named(kernel, dynamic, static)
        assert a["Q"] is q and a["K"] is k and a["V"] is v and a["DO"] is dout and a["Alibi"] is alibi
        assert a["Rng"] is rng and a["LSE"].shape == lse.shape and a["Delta"].shape == lse.shape
        assert (a["softmax_scale"], a["softcap"], a["dropout_p"]) == (0.3, 2.0, 0.2)
        assert a["dropout_scale"] == pytest.approx(1 / 0.8)
        for name, t, last in (("stride_q", q, "m"), ("stride_k", k, "n"), ("stride_v", v, "n"), ("stride_do", dout, "m")):
            _expect_strides(a, (name, ("b", "h", last)), t)
        _expect_strides(a, ("stride_bias_", "bhmn"), a["Bias"])
        assert (a["stride_alibi_b"], a["stride_alibi_h"]) == alibi.stride()
        assert {n: a[n] for n in common} == common
        lists = (a["BlockCount"], a["BlockIdx"])
        assert (a["stride_cnt_b"], a["stride_cnt_h"], a["stride_cnt_r"]) == (0, lists[0].stride(1), lists[0].stride(2))
        assert (a["stride_idx_b"], a["stride_idx_h"], a["stride_idx_r"]) == (0, lists[1].stride(1), lists[1].stride(2))
        if kernel is _bwd_dkdv_kernel:
            assert a["DK"] is dk and a["DV"] is dv and a["n_bh"] == B * HK
            _expect_strides(a, ("stride_dk", "bhn"), dk)
            _expect_strides(a, ("stride_dv", "bhn"), dv)
            assert a["ATOMIC_DQ"] == (not deterministic)
            if not deterministic:
                _expect_strides(a, ("stride_dq", "bhm"), a["DQacc"])
            assert a["EVEN_M"] == (NQ % a["BLOCK_M"] == 0) and a["EVEN_N"] == (NK % a["BLOCK_N"] == 0)
        else:
            assert a["DQ"] is dq and a["n_bh"] == B * HQ
            _expect_strides(a, ("stride_dq", "bhm"), dq)
            assert a["EVEN_M"] == (NQ % a["BLOCK_M"] == 0) and a["EVEN_N"] == (NK % a["BLOCK_N"] == 0)


def _packed(total, h, d, heads_outer, seed):
    """A (total, h, d) view with padding on d; ``heads_outer`` lays heads out slowest (so every stride differs)."""
    g = torch.Generator().manual_seed(seed)
    if heads_outer:
        return torch.randn(h, total, d + 3, generator=g).permute(1, 0, 2)[..., :d]
    return torch.randn(total, h, d + 3, generator=g)[..., :d]


def _same_view(x, packed):
    """x is the kernels' (1, H, total, d) view of the packed (total, H, d) tensor."""
    return x.shape == (1, packed.shape[1], packed.shape[0], packed.shape[2]) and x.data_ptr() == packed.data_ptr()


TQ, TK = 40, 56


@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_launches_match_kernel_parameters(monkeypatch, deterministic):
    """Packed batches: cu_seqlens, totals and max lengths in their slots; q/k/v/out as (1, H, total, d) views
    whose row stride is the packed tensor's token stride; LSE and D (Hq, total_q)."""
    fwd_calls, bwd_calls = _record(monkeypatch, fwd_runtime), _record(monkeypatch, bwd_runtime)
    q, k, v = _packed(TQ, HQ, D, False, 1), _packed(TK, HK, D, True, 2), _packed(TK, HK, D, False, 3)
    cu_q, cu_k = torch.tensor([0, 15, TQ], dtype=torch.int32), torch.tensor([0, 20, TK], dtype=torch.int32)
    alibi, rng = torch.rand(2, HQ), torch.tensor([5, 7], dtype=torch.int64)
    common = dict(softmax_scale=0.3, window_size=(9, 4), softcap=2.0, alibi_slopes=alibi, dropout_p=0.2,
                  rng_state=rng, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=25, max_seqlen_k=36)
    out, lse = fwd_runtime.fa2_forward(q, k, v, **common)
    (kernel, dynamic, static), = fwd_calls
    a = _named(kernel, dynamic, static)
    assert a["CuSeqQ"] is cu_q and a["CuSeqK"] is cu_k and a["Rng"] is rng and a["Alibi"] is alibi
    assert _same_view(a["Q"], q) and _same_view(a["K"], k) and _same_view(a["V"], v) and _same_view(a["Out"], out)
    assert a["LSE"] is lse and lse.shape == (HQ, TQ)
    for name, t in (("stride_q", q), ("stride_k", k), ("stride_v", v), ("stride_o", out)):
        last = "m" if name in ("stride_q", "stride_o") else "n"
        assert (a[name + "h"], a[name + last]) == (t.stride(1), t.stride(0)), name
    want = dict(n_heads_q=HQ, n_bh=2 * HQ, kv_group=HQ // HK, seqlen_q=25, seqlen_k=36, head_dim=D, total_q=TQ,
                total_k=TK, window_left=9, window_right=4, IS_VARLEN=True, PAGED=False, IS_BLOCK_SPARSE=False,
                HAS_BIAS=False, HAS_ALIBI=True, HAS_DROPOUT=True, EVEN_M=False, EVEN_N=False)
    assert {n: a[n] for n in want} == want
    assert (a["stride_alibi_b"], a["stride_alibi_h"]) == alibi.stride()

    dout = _packed(TQ, HQ, D, True, 4)
    dq, dk, dv = bwd_runtime.fa2_backward(dout, q, k, v, out, lse, deterministic=deterministic, **common)
    pre = _named(*bwd_calls[0])
    assert _same_view(pre["Out"], out) and _same_view(pre["DOut"], dout) and pre["CuSeqQ"] is cu_q
    assert (pre["seqlen_q"], pre["total_q"], pre["IS_VARLEN"], pre["stride_dom"]) == (25, TQ, True, dout.stride(0))
    assert pre["Delta"].shape == (HQ, TQ)
    for kernel, dynamic, static in bwd_calls[1:]:
        a = _named(kernel, dynamic, static)
        assert a["CuSeqQ"] is cu_q and a["CuSeqK"] is cu_k and a["Rng"] is rng
        assert _same_view(a["Q"], q) and _same_view(a["K"], k) and _same_view(a["V"], v) and _same_view(a["DO"], dout)
        assert a["LSE"].shape == (HQ, TQ) and a["Delta"].shape == (HQ, TQ)
        for name, t in (("stride_q", q), ("stride_k", k), ("stride_v", v), ("stride_do", dout)):
            last = "m" if name in ("stride_q", "stride_do") else "n"
            assert (a[name + "h"], a[name + last]) == (t.stride(1), t.stride(0)), name
        want = dict(n_heads_q=HQ, n_heads_k=HK, seqlen_q=25, seqlen_k=36, total_q=TQ, total_k=TK, IS_VARLEN=True,
                    EVEN_M=False, EVEN_N=False, HAS_DROPOUT=True, HAS_ALIBI=True)
        assert {n: a[n] for n in want} == want
        if kernel is _bwd_dkdv_kernel:
            assert _same_view(a["DK"], dk) and _same_view(a["DV"], dv) and a["n_bh"] == 2 * HK
            if not deterministic:
                assert a["DQacc"].shape == (1, HQ, TQ, D) and (a["stride_dqh"], a["stride_dqm"]) == (D, HQ * D)
        else:
            assert _same_view(a["DQ"], dq) and a["n_bh"] == 2 * HQ


def test_paged_forward_launch_matches_kernel_parameters(monkeypatch):
    calls = _record(monkeypatch, fwd_runtime)
    q = _packed(TQ, HQ, D, False, 1)
    pages = torch.randn(6, 32, HK, D)
    table = torch.zeros(2, 3, dtype=torch.int32)
    cu_q, cu_k = torch.tensor([0, 15, TQ], dtype=torch.int32), torch.tensor([0, 70, 90], dtype=torch.int32)
    fwd_runtime.fa2_forward(q, pages, pages, softmax_scale=0.3, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            max_seqlen_q=25, max_seqlen_k=70, block_table=table)
    (kernel, dynamic, static), = calls
    a = _named(kernel, dynamic, static)
    assert a["BlockTable"] is table and a["K"].shape == (6, HK, 32, D) and a["K"].data_ptr() == pages.data_ptr()
    assert (a["stride_kb"], a["stride_kh"], a["stride_kn"]) == (pages.stride(0), pages.stride(2), pages.stride(1))
    want = dict(stride_bt_b=3, page_size=32, n_pages=6, PAGED=True, IS_VARLEN=True, seqlen_k=70)
    assert {n: a[n] for n in want} == want and 32 % a["BLOCK_N"] == 0


class _Recorder:
    """Stands in for a jit kernel: ``kernel[grid](*args, **kw)`` records the call."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))


def test_fa1_and_softmax_launches_match_kernel_parameters(monkeypatch):
    fa1 = _Recorder(_fa1_fwd_kernel)
    monkeypatch.setattr(fa1_runtime, "_fa1_fwd_kernel", fa1)
    q = _strided(1, 2, 40, 16, (0, 2, 1, 3), 1)
    k = _strided(1, 2, 56, 16, (2, 0, 1, 3), 2)
    v = _strided(1, 2, 56, 16, (1, 0, 2, 3), 3)
    out = fa1_runtime.fa1_forward(q, k, v, sram_elems=4096, causal=True, softmax_scale=0.3)
    (args, kw), = fa1.calls
    names = _params(_fa1_fwd_kernel)
    a = dict(zip(names, args))
    constexprs = {n for n in kw if n in names}
    assert set(kw) - constexprs <= {"num_warps", "num_stages"} and not set(a) & constexprs
    assert len(args) + len(constexprs) == len(names) - 1  # EVEN_N comes from the kernel's heuristics
    assert a["Q"] is q and a["K"] is k and a["V"] is v and a["Out"] is out
    for name, t, last in (("stride_q", q, "m"), ("stride_k", k, "n"), ("stride_v", v, "n"), ("stride_out", out, "m")):
        _expect_strides(a, (name, ("b", "h", last)), t)
    assert [a[n] for n in ("n_heads", "seqlen_q", "seqlen_k", "head_dim", "sm_scale")] == [2, 40, 56, 16, 0.3]

    sm = _Recorder(_softmax_online_kernel)
    monkeypatch.setattr(softmax_runtime, "_softmax_online_kernel", sm)
    x = torch.randn(6, 50)[::2]
    y = softmax_runtime.softmax_online(x)
    (args, kw), = sm.calls
    a = dict(zip(_params(_softmax_online_kernel), args))
    assert a["X"].data_ptr() == x.data_ptr() and a["Y"].data_ptr() == y.data_ptr()
    assert len(args) + len(kw) - 1 == len(_params(_softmax_online_kernel)) and "BLOCK" in kw  # and num_warps
    assert (a["stride_x"], a["stride_y"], a["n"]) == (100, 50, 50)


def test_hopper_forward_launch_arguments(monkeypatch):
    """runtime.fa3_fwd.launch's tuples against fa3_fwd_kernel's parameters (GQA, ragged Nk, strided views)."""
    from flashtile.kernels.fa3_fwd import fa3_fwd_kernel
    from flashtile.runtime import fa3_fwd as fa3_runtime
    from flashtile.runtime import launch as launch_module

    calls = []
    monkeypatch.setattr(launch_module, "launch",
                        lambda kernel, grid, dynamic, static, **kw: calls.append((kernel, dynamic, static)))
    q = _strided(2, 6, 70, 40, (0, 2, 1, 3), seed=1)
    k, v = (_strided(2, 3, 45, 40, (2, 0, 1, 3), seed=s) for s in (2, 3))
    out = _strided(2, 6, 70, 40, (1, 2, 0, 3), seed=4)
    lse = torch.empty(2, 6, 70)
    cfg = fa3_runtime.Fa3Config(64, 32, 4, 1, True, False)
    fa3_runtime.launch(q, k, v, out, lse, 0.7, True, cfg)
    (kernel, dynamic, static), = calls
    named = _named(kernel, dynamic, static)
    assert named["Q"] is q and named["K"] is k and named["V"] is v and named["Out"] is out and named["LSE"] is lse
    assert named["qk_scale"] == 0.7
    for prefix, t in (("stride_q", q), ("stride_k", k), ("stride_v", v), ("stride_o", out)):
        _expect_strides(named, (prefix, ("b", "h", "m" if prefix in ("stride_q", "stride_o") else "n")), t)
    assert (named["n_heads"], named["kv_group"], named["seqlen_q"], named["seqlen_k"]) == (6, 2, 70, 45)
    assert named["num_m_tiles"] == 2 and named["HEAD_DIM"] == 40 and named["BLOCK_D"] == 64
    assert (named["BLOCK_M"], named["LOG2_BLOCK_M"], named["BLOCK_N"]) == (64, 6, 32)
    assert named["CAUSAL"] is True and named["EVEN_N"] is False
    assert named["WARP_SPEC"] is True and named["O_TMA"] is False
