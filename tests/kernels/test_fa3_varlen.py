"""Hopper forward on packed (variable-length) batches: kernels/fa3_fwd.py with IS_VARLEN,
runtime/fa3_fwd.fa3_varlen_forward and its dispatch from flash_attn_varlen_func.

CPU: the kernel through Triton's interpreter (tensor descriptors run there; ``warp_specialize`` is
ignored) on fp16 packed batches holding every edge at once (empty q and k sequences, causal rows with
no key, ragged tails, GQA, max_seqlen above the real maximum), bad cu_seqlens values, the launch's
host-side arguments and the dispatch from the public op.  GPU (``-m gpu``, sm_90): compiled, bf16 and
fp16, head dims 64..256, against the float64 oracle.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

from flashtile.kernels._common import LOG2E
from flashtile.kernels.fa2_fwd import ERR_CU_SEQLENS
from flashtile.ops.kvcache import check_errors
from flashtile.runtime import fa3_fwd
from flashtile.runtime.decode import error_flags
from flashtile.runtime.fa3_fwd import Fa3Config, fa3_varlen_forward, packed_view, prefer_hopper_varlen
from tests._oracle import assert_close, attention_varlen_ref, attention_varlen_ref_grads

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 (Hopper) GPU")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: CPU tensors")

# per-sequence (L_q, L_k): empty q, empty k, q longer than k (causal rows with no key), one-row q, ragged tails
LENS_Q = [5, 0, 70, 16, 1, 40]
LENS_K = [9, 4, 45, 0, 30, 40]
SMALL = Fa3Config(64, 32, 4, 1, False)  # interpreter tiles: several query and key tiles per sequence


def _cu(lens, device):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


def _packed(lens_q, lens_k, hq, hk, d, device, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=gen).to(device, dtype)
    k, v = (torch.randn(sum(lens_k), hk, d, generator=gen).to(device, dtype) for _ in range(2))
    return q, k, v


def _assert_matches(out, lse, lens_q, lens_k, q, k, v, scale, causal):
    """Every row written (no NaN), -inf LSE and an exact-zero output exactly on rows that see no key,
    then out / LSE within the dtype's tolerance of the float64 oracle."""
    ref_out, ref_lse = attention_varlen_ref(*(x.detach().double().cpu() for x in (q, k, v)), _cu(lens_q, "cpu"),
                                            _cu(lens_k, "cpu"), scale=scale, causal=causal)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten rows"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), empty), "lse must be -inf exactly on rows with no key"
    assert (out.cpu().transpose(0, 1)[empty] == 0).all(), "rows with no allowed key must output exactly 0"
    assert_close(out, ref_out, out.dtype, out.device, "out")
    assert_close(lse, ref_lse, torch.float32, lse.device, "lse")


@pytest.fixture
def host_on_cpu(monkeypatch):
    """fa3_varlen_forward's host steps on CPU tensors: the device check lifted, the Triton kernel (the interpreter
    runs no Gluon) with the interpreter's tiles."""
    monkeypatch.setattr(fa3_fwd, "GLUON_VARLEN", False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(fa3_fwd, "_check", lambda *a: None)
    monkeypatch.setattr(fa3_fwd, "ensure_allocator", lambda: None)
    monkeypatch.setattr(fa3_fwd, "fa3_config", lambda d, causal, nq, nk: SMALL)
    empty = torch.empty

    def poisoned(*args, **kwargs):  # outputs NaN until written: an unwritten row fails _assert_matches
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


# --------------------------------------------------------------------------- #
# CPU: the kernel through Triton's interpreter
# --------------------------------------------------------------------------- #
@cpu_only
@pytest.mark.parametrize("grid", ["max", "packed"])
@pytest.mark.parametrize("causal", [False, True])
def test_interpreter_varlen_kernel(monkeypatch, causal, grid):
    """Both loop forms (warp-specialised: every tile masked; unspecialised: full tiles, then masked ones) and
    both O stores, GQA 2 / 1, d 48 (descriptor padded to 64), max_seqlen above the real maximum; both grids
    (B * cdiv(max_seqlen_q, BLOCK_M) tiles per head, or total_q // BLOCK_M + B slots searched in cu_seqlens_q)."""
    monkeypatch.setattr(fa3_fwd, "VARLEN_GRID", grid)
    hq, hk, d = 2, 1, 48
    q, k, v = _packed(LENS_Q, LENS_K, hq, hk, d, "cpu", torch.float16)
    cu_q, cu_k = _cu(LENS_Q, "cpu"), _cu(LENS_K, "cpu")
    err = torch.zeros(1, dtype=torch.int32)
    for warp_spec, o_tma in ((False, True), (True, False)):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((hq, q.shape[0]), float("nan"))
        fa3_fwd.launch(packed_view(q), packed_view(k), packed_view(v), packed_view(out), lse, d ** -0.5 * LOG2E,
                       causal, Fa3Config(64, 32, 4, 1, warp_spec, o_tma), err=err,
                       varlen=(cu_q, cu_k, max(LENS_Q) + 30, max(LENS_K) + 1))
        _assert_matches(out, lse, LENS_Q, LENS_K, q, k, v, d ** -0.5, causal)
    assert int(err) == 0, "good cu_seqlens must not set the error word"


@cpu_only
@pytest.mark.parametrize("grid", ["max", "packed"])
def test_interpreter_varlen_bad_cu_seqlens_stay_inside_and_are_recorded(monkeypatch, host_on_cpu, grid):
    """Whatever cu_seqlens hold, the packed Hopper forward reads and writes only inside q/k/v/out/lse (the
    tensors are views into NaN-filled storage: a read outside would put NaN into covered rows, a write
    outside would change the guard bands) and records ERR_CU_SEQLENS for check_errors(), on either grid."""
    monkeypatch.setattr(fa3_fwd, "VARLEN_GRID", grid)
    h, d, guard = 2, 16, 64 * 2 * 16

    def guarded(rows, seed):
        store = torch.full((guard * 2 + rows * h * d,), float("nan"), dtype=torch.float16)
        view = store[guard: guard + rows * h * d].view(rows, h, d)
        view.copy_(torch.randn(rows, h, d, generator=torch.Generator().manual_seed(seed)))
        return store, view

    def covered(cu, total, max_len):
        rows = torch.zeros(total, dtype=torch.bool)
        for lo, hi in zip(cu, cu[1:]):
            start = min(max(lo, 0), total)
            end = min(max(hi, start), total)
            rows[start: start + min(end - start, max_len)] = True
        return rows

    (sq, q), (sk, k), (sv, v) = guarded(8, 0), guarded(10, 1), guarded(10, 2)
    check_errors()
    for cu_q, cu_k in [([0, 50, 8], [0, -7, 10]), ([-100, 3, 2**31 - 1], [0, 4, 10]),
                       ([0, 3, 8], [2**31 - 1, 0, -2**31]), ([0, 8, 0, 8], [0, 4, 6, 10])]:
        rq = covered(cu_q, 8, 6) if grid == "max" else torch.zeros(8, dtype=torch.bool)  # packed: slots may skip rows
        out, lse = fa3_varlen_forward(q, k, v, torch.tensor(cu_q, dtype=torch.int32),
                                      torch.tensor(cu_k, dtype=torch.int32), 6, 7, softmax_scale=0.25, causal=True)
        assert not torch.isnan(out[rq]).any() and not torch.isnan(lse[:, rq]).any()
        for store in (sq, sk, sv):
            assert torch.isnan(store[:guard]).all() and torch.isnan(store[-guard:]).all()
        assert int(error_flags(torch.device("cpu"))[1]) & ERR_CU_SEQLENS
        with pytest.raises(ValueError, match="cu_seqlens_q / cu_seqlens_k out of range"):
            check_errors()
    fa3_varlen_forward(q, k, v, _cu([3, 5], "cpu"), _cu([4, 6], "cpu"), 5, 6, softmax_scale=0.25)
    check_errors()  # good values record nothing


@cpu_only
def test_interpreter_varlen_host_path(host_on_cpu):
    """fa3_varlen_forward: the sign of the scale, no keys at all (every row empty), no rows."""
    q, k, v = _packed(LENS_Q, LENS_K, 2, 1, 32, "cpu", torch.float16, seed=4)
    cu_q, cu_k = _cu(LENS_Q, "cpu"), _cu(LENS_K, "cpu")
    for scale in (-0.3, 0.0):
        out, lse = fa3_varlen_forward(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), softmax_scale=scale, causal=True)
        _assert_matches(out, lse, LENS_Q, LENS_K, q, k, v, scale, True)
    out, lse = fa3_varlen_forward(q, k[:0], v[:0], cu_q, _cu([0] * len(LENS_K), "cpu"), max(LENS_Q), 0,
                                  softmax_scale=0.3)
    assert (out == 0).all() and torch.isneginf(lse).all()
    check_errors()
    out, lse = fa3_varlen_forward(q[:0], k, v, _cu([0, 0], "cpu"), _cu([0, k.shape[0]], "cpu"), 0, 9,
                                  softmax_scale=0.3)
    assert out.shape == (0, 2, 32) and lse.shape == (2, 0)


# --------------------------------------------------------------------------- #
# CPU: host-side arguments of the launch (no kernel run)
# --------------------------------------------------------------------------- #
def test_varlen_launch_arguments(monkeypatch, host_on_cpu):
    """Grid B * Hq * cdiv(max_seqlen_q, BLOCK_M); the packed views' strides; max_seqlen as seqlen_q/k; B, total_q,
    total_k; IS_VARLEN on, EVEN_N off; cu_seqlens, the error word's store-only slot (word 1) and a positive scale."""
    import flashtile.runtime.launch as launch_mod

    seen = {}
    monkeypatch.setattr(launch_mod, "launch", lambda fn, grid, dynamic, static, **kw: seen.update(
        grid=grid, dynamic=dynamic, static=static, kw=kw))
    q, k, v = _packed([3, 200, 0], [7, 300, 5], 4, 2, 64, "cpu", torch.float16)
    cu_q, cu_k = _cu([3, 200, 0], "cpu"), _cu([7, 300, 5], "cpu")
    fa3_varlen_forward(q, k, v, cu_q, cu_k, 250, 301, softmax_scale=-0.5, causal=True)
    assert seen["grid"] == (3 * 4 * 4,)  # cdiv(250, 64) = 4 query tiles per (sequence, head)
    qs, ks, vs, out, lse, _, _, _, err, cq, ck, scale = seen["dynamic"]
    assert cq is cu_q and ck is cu_k and scale == pytest.approx(0.5 * LOG2E)
    assert err.data_ptr() == error_flags(torch.device("cpu")).data_ptr() + 4  # word 1: the kernel only stores
    assert qs.shape == (1, 4, 203, 64) and lse.shape == (4, 203) and out.shape == (1, 4, 203, 64)
    static = seen["static"]
    strides, ints, window, consts = static[:18], static[18:27], static[27:31], static[31:]
    assert window == (None,) * 4  # no sliding window or softcap: no parameters
    assert strides[:3] == qs.stride()[:3] and strides[1:3] == (64, 4 * 64) and strides[4:6] == (64, 2 * 64)
    # heads, group, max_q, max_k, tiles, B, total_q, total_k, search steps
    assert ints == (4, 2, 250, 301, 4, 3, 203, 312, 0)
    # HEAD_DIM, BLOCK_D, BLOCK_M, LOG2_BLOCK_M, BLOCK_N, CAUSAL, EVEN_N, WARP_SPEC, O_TMA, FP8, EXACT_E4M3, IS_VARLEN,
    # PACKED_GRID: the max grid (12 tiles per head) is not over twice the packed one (203 // 64 + 3 = 6 slots)
    assert consts == (64, 64, 64, 6, 32, True, False, False, True, False, False, True, False)
    # lengths 1, 1, 300: 3 * cdiv(300, 64) = 15 tiles per head against 302 // 64 + 3 = 7 slots -> the packed grid
    q, k, v = _packed([1, 1, 300], [1, 1, 300], 4, 2, 64, "cpu", torch.float16)
    fa3_varlen_forward(q, k, v, _cu([1, 1, 300], "cpu"), _cu([1, 1, 300], "cpu"), 300, 300, softmax_scale=1.0)
    assert seen["grid"] == (4 * 7,)
    assert seen["static"][18:27] == (4, 2, 300, 300, 7, 3, 302, 302, 2)  # bit_length(3 - 1) = 2 halvings
    assert seen["static"][-1] is True


# --------------------------------------------------------------------------- #
# CPU: dispatch from flash_attn_varlen_func
# --------------------------------------------------------------------------- #
@cpu_only
def test_public_op_dispatches_plain_packed_forwards(monkeypatch, host_on_cpu):
    """flash_attn_varlen_func asks prefer_hopper_varlen with plain = no block_table / ALiBi / softcap / dropout and
    the longest sequence's keys; where it says yes the Hopper forward runs (here through the interpreter), and
    FA2's backward takes its out and LSE: out, LSE and gradients match the oracle."""
    from flashtile import flash_attn_varlen_func

    asked, launched = [], []
    monkeypatch.setattr(fa3_fwd, "prefer_hopper_varlen", lambda q, k, v, **kw: asked.append(kw) or kw["plain"])
    real = fa3_fwd.launch
    monkeypatch.setattr(fa3_fwd, "launch", lambda *a, **kw: launched.append(kw["varlen"]) or real(*a, **kw))
    q, k, v = _packed(LENS_Q, LENS_K, 2, 1, 16, "cpu", torch.float16, seed=5)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).half()
    cu_q, cu_k = _cu(LENS_Q, "cpu"), _cu(LENS_K, "cpu")
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = flash_attn_varlen_func(qg, kg, vg, cu_q, cu_k, max(LENS_Q), 60, causal=True, return_lse=True)
    out.backward(dout)
    assert launched and asked[-1] == dict(causal=True, window=(-1, 0), plain=True, max_seqlen_k=60, n_seqs=6)
    ref = attention_varlen_ref_grads(q, k, v, dout, cu_q, cu_k, causal=True)
    assert_close(out, ref[0], torch.float16, "cpu", "out")
    assert_close(lse, ref[1], torch.float32, "cpu", "lse")
    size = max(float(g.abs().max()) for g in ref[2:])
    for name, g, r in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), ref[2:]):
        assert_close(g, r, torch.float16, "cpu", name, magnitude=size)
    launched.clear()
    with torch.no_grad():
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), softcap=5.0)
    assert not launched and asked[-1]["plain"] is False


def test_prefer_hopper_varlen_gates():
    """CPU tensors, fp32, a bounded window, non-plain calls and no keys at all never take the Hopper kernel."""
    q = torch.empty(4096, 2, 128, dtype=torch.bfloat16)
    kw = dict(causal=False, window=(-1, -1), plain=True, max_seqlen_k=8192, n_seqs=1, capability=(9, 0))
    assert not prefer_hopper_varlen(q, q, q, **kw)  # CPU
    assert not prefer_hopper_varlen(q, q, q, **(kw | dict(plain=False)))
    assert not prefer_hopper_varlen(q, q, q, **(kw | dict(window=(128, -1))))
    assert not prefer_hopper_varlen(q, q[:0], q[:0], **kw)


def test_prefer_hopper_varlen_follows_the_fixed_rule(monkeypatch):
    """A packed batch asks the fixed-length rule with the longest sequence's keys (as a packed batch: d = 128 causal
    from 2k keys), causal or not, every head dim."""
    q = torch.empty(4096, 2, 128, dtype=torch.bfloat16)
    asked = []
    packed = []
    monkeypatch.setattr(fa3_fwd, "_prefer", lambda *a, **k: asked.append(a) or packed.append(k) or True)
    kw = dict(plain=True, max_seqlen_k=8192, n_seqs=3, capability=(9, 0))
    assert prefer_hopper_varlen(q, q, q, causal=False, window=(-1, -1), **kw)
    assert prefer_hopper_varlen(q, q, q, causal=True, window=(-1, 0), **kw)
    q64 = q[..., :64]
    assert prefer_hopper_varlen(q64, q64, q64, causal=False, window=(-1, -1), **kw)
    assert packed == [dict(packed=True)] * 3  # hopper_wins's packed rule: no dynamic grid for packed batches
    assert [a[3] for a in asked] == [False, True, False] and {a[6] for a in asked} == {8192}
    assert {a[7] for a in asked} == {2 * 2 * (4096 // 64 + 3)}  # the grid bound: 2 Hq (total_q // 64 + B)
    assert asked[2][0].shape == (1, 2, 4096, 64)  # the kernel's packed view


def test_descriptor_grids_stay_inside_their_scratch(monkeypatch):
    """Grids whose in-kernel descriptors' scratch would pass Triton's int32 offsets (programs x 1 KB >= 2^31 forward,
    x 2 KB backward): each public rule asks ``descriptor_grid_fits`` with its grid's bound and direction (fixed
    and packed forward, both backwards; that a False sends the call to FA2 on a GPU:
    ``test_gpu_many_sequences_stay_inside_the_descriptor_scratch``); the packed backward's rule from 2^20 programs."""
    from flashtile.runtime import common, fa3_bwd, fa3_gluon_bwd

    assert common.descriptor_grid_fits(2**21 - 1) and not common.descriptor_grid_fits(2**21)
    assert common.descriptor_grid_fits(2**20 - 1, backward=True) and not common.descriptor_grid_fits(2**20, True)
    with pytest.raises(NotImplementedError, match="int32 scratch offsets"):
        common.check_descriptor_grid(2**21, "a kernel")
    fits = []
    record = lambda n, backward=False: fits.append((n, backward)) or False  # noqa: E731
    monkeypatch.setattr(fa3_fwd, "descriptor_grid_fits", record)
    monkeypatch.setattr(fa3_gluon_bwd, "descriptor_grid_fits", record)
    monkeypatch.setattr(fa3_bwd, "descriptor_grid_fits", record)
    q = torch.empty(2, 3, 1000, 128, dtype=torch.bfloat16)  # (B, H, N, d) views
    kw = dict(causal=False, window=(-1, -1), plain=True, capability=(9, 0))
    assert not fa3_fwd.prefer_hopper(q, q, q, **kw)
    assert not fa3_gluon_bwd.prefer_gluon_bwd(q, q, q, q, deterministic=False, **kw)
    assert not fa3_bwd.prefer_hopper_bwd(q, q, q, q, **kw)
    p = torch.empty(4096, 3, 128, dtype=torch.bfloat16)  # packed (total, H, d)
    assert not prefer_hopper_varlen(p, p, p, max_seqlen_k=4096, n_seqs=5, **kw)
    assert fits == [(96, False), (96, True), (96, True), (2 * 3 * (4096 // 64 + 5), False)]  # 2 * 3 * cdiv(1000, 64)
    monkeypatch.undo()
    # 1024 sequences x 32 heads x cdiv(max_seqlen_k, 128) programs, about 1/8 of them with keys
    assert fa3_gluon_bwd.varlen_fits(1024, 32, 2**22, 2**22, 4096 - 128)  # 2^20 - 2^15 programs
    assert not fa3_gluon_bwd.varlen_fits(1024, 32, 2**22, 2**22, 4096)  # 2^20


def test_descriptor_launchers_refuse_grids_past_their_scratch(monkeypatch):
    """With every grid's scratch past 2^31 bytes (DESC_SCRATCH_BYTES raised), the forward launchers (Triton, Gluon
    with device descriptors) raise NotImplementedError before any kernel runs."""
    from flashtile.runtime import common, fa3_gluon
    import flashtile.runtime.launch as launch_mod

    monkeypatch.setattr(common, "DESC_SCRATCH_BYTES", 2**31)
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **kw: pytest.fail("a kernel was launched"))
    q = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 64)
    with pytest.raises(NotImplementedError, match="int32 scratch offsets"):
        fa3_fwd.launch(q, q, q, q.clone(), lse, 0.1, False, fa3_fwd.fa3_config(64, False, 64, 64))
    cfg = fa3_gluon.gluon_config(64, False)
    with pytest.raises(NotImplementedError, match="int32 scratch offsets"):
        fa3_gluon.gluon_launch(q, q, q, q.clone(), lse, 0.1, False, cfg)


def test_varlen_forward_checks_its_cu_seqlens(monkeypatch):
    """The packed Hopper entry point refuses cu_seqlens that would make the kernel read past them, by name."""
    monkeypatch.setattr(fa3_fwd, "_check", lambda *a: None)  # no sm_90 device here; these checks come after it
    q = torch.empty(8, 2, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    for bad_q, bad_k, match in ((cu, cu[:2], "same length"), (cu.long(), cu, "cu_seqlens_q must have dtype"),
                                (cu, cu.view(1, 3), "cu_seqlens_k must be 1-D")):
        with pytest.raises((ValueError, TypeError), match=match):
            fa3_fwd.fa3_varlen_forward(q, q, q, bad_q, bad_k, 4, 4, softmax_scale=0.1)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        fa3_fwd.fa3_varlen_forward(q, q, q, cu, cu, -1, 4, softmax_scale=0.1)


def test_gluon_varlen_launch_and_report(monkeypatch):
    """``GLUON_VARLEN``: a packed forward on the Gluon path runs the cu_seqlens report kernel (interpreted here:
    a decreasing cu_seqlens_q sets ERR_CU_SEQLENS in the store-only error word), then the Gluon kernel with
    IS_VARLEN over Hq * (total_q // 128 + B) programs, one per slot of the packed grid, device descriptors; no
    launch but the report without keys; on by default."""
    import flashtile.runtime.launch as launch_mod
    from flashtile.kernels.fa3_gluon import fa3_gluon_kernel

    assert fa3_fwd.GLUON_VARLEN is True
    monkeypatch.setattr(fa3_fwd, "_check", lambda *a: None)  # no sm_90 device here
    monkeypatch.setattr(fa3_fwd, "ensure_allocator", lambda: None)
    calls = []
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **kw: calls.append((a, kw)))
    q, k, v = _packed(LENS_Q, LENS_K, 4, 2, 128, "cpu", torch.bfloat16)
    cu_q, cu_k = _cu(LENS_Q, "cpu"), _cu(LENS_K, "cpu")
    err = error_flags(q.device, caller="test")
    err.zero_()
    fa3_varlen_forward(q, k, v, cu_q, cu_k, 70, 50, softmax_scale=0.1, causal=True)
    assert int(err[1]) == 0  # a valid batch reports nothing
    (kernel, grid, dynamic, static), kw = calls[-1]
    bound = dict(zip(inspect.signature(kernel.fn).parameters, (*dynamic, *static)))
    assert kernel is fa3_gluon_kernel and bound["IS_VARLEN"] is True
    assert not bound["PERSISTENT"] and not bound["HOST_DESC"] and not bound["DYNAMIC"]
    assert bound["CuQ"] is cu_q and bound["CuK"] is cu_k
    assert (bound["seqlen_q"], bound["seqlen_k"], bound["total_q"], bound["total_k"]) == (70, 50, q.shape[0],
                                                                                          k.shape[0])
    slots = q.shape[0] // 128 + len(LENS_Q)
    assert grid == (4 * slots,) and bound["num_m_tiles"] == slots  # heads x slots
    assert bound["n_batch"] == len(LENS_Q) and bound["search_steps"] == (len(LENS_Q) - 1).bit_length()
    assert bound["Q"].shape == (1, 4, q.shape[0], 128) and bound["LSE"].shape == (4, q.shape[0])
    bad = cu_q.clone()
    bad[2] = 1  # a decrease
    fa3_varlen_forward(q, k, v, bad, cu_k, 70, 50, softmax_scale=0.1)
    assert int(err[1]) & ERR_CU_SEQLENS
    err.zero_()
    calls.clear()
    out, lse = fa3_varlen_forward(q, k[:0], v[:0], cu_q, _cu([0] * len(LENS_K), "cpu"), 70, 0, softmax_scale=0.1)
    assert not calls and (out == 0).all() and torch.isneginf(lse).all()


def test_packed_forward_above_varlen_gluon_max_d_runs_the_triton_kernel(monkeypatch):
    """Packed forwards wider than ``VARLEN_GLUON_MAX_D`` (d = 256, where the dense forward runs Gluon) launch the
    Triton Hopper kernel; at the limit, the Gluon kernel."""
    import flashtile.runtime.launch as launch_mod
    from flashtile.kernels.fa3_fwd import fa3_fwd_kernel
    from flashtile.kernels.fa3_gluon import fa3_gluon_kernel

    monkeypatch.setattr(fa3_fwd, "_check", lambda *a: None)  # no sm_90 device here
    monkeypatch.setattr(fa3_fwd, "ensure_allocator", lambda: None)
    calls = []
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **kw: calls.append(a[0]))
    cu_q, cu_k = _cu(LENS_Q, "cpu"), _cu(LENS_K, "cpu")
    for d, want in ((256, fa3_fwd_kernel), (fa3_fwd.VARLEN_GLUON_MAX_D, fa3_gluon_kernel)):
        assert fa3_fwd.use_gluon(d, True)
        q, k, v = _packed(LENS_Q, LENS_K, 2, 1, d, "cpu", torch.bfloat16)
        calls.clear()
        fa3_varlen_forward(q, k, v, cu_q, cu_k, 70, 50, softmax_scale=0.1, causal=True)
        assert calls[-1] is want, d


# --------------------------------------------------------------------------- #
# GPU (sm_90)
# --------------------------------------------------------------------------- #
GPU_LENS_Q = [0, 300, 1, 129, 1000, 64, 0, 513, 77]
GPU_LENS_K = [5, 200, 700, 129, 1000, 0, 0, 777, 1]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grid", ["max", "packed"])
def test_gpu_varlen_matches_float64(monkeypatch, d, causal, dtype, grid):
    """Empty q / k sequences, L_q != L_k per sequence (causal rows with no key), GQA 4 / 2, max_seqlen above
    the real maximum, every row written; both grids of the Triton kernel (the Gluon one's: below)."""
    monkeypatch.setattr(fa3_fwd, "VARLEN_GRID", grid)
    monkeypatch.setattr(fa3_fwd, "GLUON_VARLEN", False)
    q, k, v = _packed(GPU_LENS_Q, GPU_LENS_K, 4, 2, d, "cuda", dtype, seed=d)
    out, lse = fa3_varlen_forward(q, k, v, _cu(GPU_LENS_Q, "cuda"), _cu(GPU_LENS_K, "cuda"), 1200, 1100,
                                  softmax_scale=d ** -0.5, causal=causal)
    _assert_matches(out, lse, GPU_LENS_Q, GPU_LENS_K, q, k, v, d ** -0.5, causal)
    check_errors()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_varlen_one_sequence_and_many_tiny_ones(causal):
    """One 3000-token sequence (q 2000 rows) and 1000 sequences of 0-20 tokens, bf16, d 128."""
    q, k, v = _packed([2000], [3000], 8, 8, 128, "cuda", torch.bfloat16, seed=1)
    out, lse = fa3_varlen_forward(q, k, v, _cu([2000], "cuda"), _cu([3000], "cuda"), 2000, 3000,
                                  softmax_scale=0.1, causal=causal)
    _assert_matches(out, lse, [2000], [3000], q, k, v, 0.1, causal)
    gen = torch.Generator().manual_seed(2)
    lq, lk = (torch.randint(0, 21, (1000,), generator=gen).tolist() for _ in range(2))
    q, k, v = _packed(lq, lk, 4, 1, 128, "cuda", torch.bfloat16, seed=3)
    out, lse = fa3_varlen_forward(q, k, v, _cu(lq, "cuda"), _cu(lk, "cuda"), 20, 20, softmax_scale=0.1,
                                  causal=causal)
    _assert_matches(out, lse, lq, lk, q, k, v, 0.1, causal)
    check_errors()


@pytest.mark.gpu
@hopper
def test_gpu_public_op_runs_hopper_varlen_then_backward(monkeypatch):
    """flash_attn_varlen_func, bf16, d 128, sequences up to 4k: the forward takes the Hopper path (the Gluon
    kernel) causal or not, the packed backward its out and LSE; out, LSE and gradients match the oracle."""
    from flashtile import flash_attn_varlen_func
    from flashtile.runtime import fa3_gluon
    from tests._oracle import rounding_slack

    launched = []
    real = fa3_gluon.gluon_launch
    monkeypatch.setattr(fa3_gluon, "gluon_launch", lambda *a, **kw: launched.append(kw.get("varlen")) or real(*a, **kw))
    lens = [4096, 1, 700, 0, 1500]
    q, k, v = _packed(lens, lens, 8, 2, 128, "cuda", torch.bfloat16, seed=7)
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    cu = _cu(lens, "cuda")
    for causal in (False, True):
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out, lse = flash_attn_varlen_func(qg, kg, vg, cu, cu, 4096, 4096, causal=causal, return_lse=True)
        out.backward(dout)
        assert launched and launched[-1] is not None, "the Hopper packed forward was not used"
        launched.clear()
        pick = slice(4097, 4797)  # sequence 2: the float64 oracle of the 4k one is large
        ref = attention_varlen_ref_grads(q[pick], k[pick], v[pick], dout[pick], [0, 700], [0, 700], causal=causal)
        assert_close(out[pick], ref[0], torch.bfloat16, "cuda", "out")
        assert_close(lse[:, pick], ref[1], torch.float32, "cuda", "lse")
        bhnd = [x[pick].double().transpose(0, 1).unsqueeze(0) for x in (q, k, v, dout)]
        slack = rounding_slack(*bhnd, torch.bfloat16, causal=causal)
        size = max(float(g.abs().max()) for g in ref[2:])
        for name, g, r, extra in zip(("dq", "dk", "dv"), (qg.grad[pick], kg.grad[pick], vg.grad[pick]), ref[2:],
                                     slack):
            assert_close(g, r, torch.bfloat16, "cuda", name, magnitude=size, slack=extra)


@pytest.mark.gpu
@hopper
def test_gpu_misaligned_packed_tensors_fall_back_to_fa2(monkeypatch):
    """A q whose base is not 16-byte aligned, or a k whose heads are not 16 bytes apart, runs the FA2 kernel
    (tensor descriptors need 16-byte aligned bases and strides) and is still right."""
    from flashtile import flash_attn_varlen_func

    from flashtile.runtime import fa3_gluon

    launched = []
    monkeypatch.setattr(fa3_fwd, "launch", lambda *a, **kw: launched.append(1))
    monkeypatch.setattr(fa3_gluon, "gluon_launch", lambda *a, **kw: launched.append(2))
    lens = [1000, 3000]
    q, k, v = _packed(lens, lens, 4, 4, 128, "cuda", torch.bfloat16, seed=8)
    q_off = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape).copy_(q)
    k_wide = torch.empty(k.shape[0], 4, 132, device="cuda", dtype=k.dtype)[..., :128].copy_(k)  # heads 264 bytes apart
    assert q_off.data_ptr() % 16 and (k_wide.stride(1) * 2) % 16
    cu = _cu(lens, "cuda")
    for qq, kk in ((q_off, k), (q, k_wide)):
        assert not prefer_hopper_varlen(qq, kk, v, causal=False, window=(-1, -1), plain=True, max_seqlen_k=3000,
                                        n_seqs=2)
        out, lse = flash_attn_varlen_func(qq, kk, v, cu, cu, 3000, 3000, return_lse=True)
        assert not launched
        _assert_matches(out[:1000], lse[:, :1000], [1000], [1000], q[:1000], k[:1000], v[:1000], 128 ** -0.5, False)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("grid", ["max", "packed", "gluon"])
def test_gpu_varlen_bad_cu_seqlens_stay_inside_and_are_recorded(monkeypatch, grid):
    """Compiled: bad values are clamped (no NaN from the guard bands, which stay untouched) and recorded; the
    Triton kernel's two grids and the Gluon kernel's packed one."""
    from flashtile.runtime import fa3_gluon

    monkeypatch.setattr(fa3_fwd, "VARLEN_GRID", "packed" if grid == "gluon" else grid)
    monkeypatch.setattr(fa3_fwd, "GLUON_VARLEN", grid == "gluon")
    ran = []
    real = fa3_gluon.gluon_launch
    monkeypatch.setattr(fa3_gluon, "gluon_launch", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    h, d, guard = 2, 64, 1 << 16

    def guarded(rows, seed):
        store = torch.full((guard * 2 + rows * h * d,), float("nan"), device="cuda", dtype=torch.bfloat16)
        view = store[guard: guard + rows * h * d].view(rows, h, d)
        view.copy_(torch.randn(rows, h, d, generator=torch.Generator().manual_seed(seed)))
        return store, view

    (sq, q), (sk, k), (sv, v) = guarded(300, 0), guarded(500, 1), guarded(500, 2)
    check_errors()
    for cu_q, cu_k in [([0, 5000, 300], [0, -7, 500]), ([-100, 3, 2**31 - 1], [0, 4, 500]),
                       ([0, 3, 300], [2**31 - 1, 0, -2**31])]:
        out, lse = fa3_varlen_forward(q, k, v, torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
                                      torch.tensor(cu_k, dtype=torch.int32, device="cuda"), 297, 400,
                                      softmax_scale=0.125, causal=False)
        if grid == "max":  # the packed grid's slots follow cu_seqlens_q, so bad values may leave rows unwritten
            first = slice(0, 3) if cu_q[1] == 3 else slice(0, 297)
            assert not torch.isnan(out[first]).any() and not torch.isnan(lse[:, first]).any()
        for store in (sq, sk, sv):
            assert torch.isnan(store[:guard]).all() and torch.isnan(store[-guard:]).all()
        assert bool(ran) == (grid == "gluon")
        with pytest.raises(ValueError, match="cu_seqlens_q / cu_seqlens_k out of range"):
            check_errors()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("gluon", [True, False])
def test_gpu_varlen_offsets_past_2_31_elements(monkeypatch, gluon):
    """1025 sequences of 2048 tokens, 8 heads, d 128 (4.3 GB as q, k and v): the last ones start past element 2^31;
    the Gluon and the Triton packed kernels."""
    monkeypatch.setattr(fa3_fwd, "GLUON_VARLEN", gluon)
    hq, d, n = 8, 128, 2048
    lens = [n] * (2**31 // (hq * d * n) + 1)
    x = torch.randn(sum(lens), hq, d, device="cuda", dtype=torch.bfloat16)
    cu = _cu(lens, "cuda")
    out, lse = fa3_varlen_forward(x, x, x, cu, cu, n, n, softmax_scale=d ** -0.5)
    last = len(lens) - 1
    assert int(cu[last]) * hq * d >= 2**31
    for b in (0, last):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want = attention_varlen_ref(x[rows], x[rows], x[rows], [0, n], [0, n])
        assert_close(out[rows], want[0], torch.bfloat16, "cuda", f"seq {b} out")
        assert_close(lse[:, rows], want[1], torch.float32, "cuda", f"seq {b} lse")


@pytest.mark.gpu
@hopper
def test_gpu_varlen_cuda_graph_replay_records_bad_values():
    """Captured after a warm-up: a replay equals the eager call's bits; cu_seqlens_k written past the packed
    keys before a replay is recorded, good values again record nothing."""
    from flashtile import flash_attn_varlen_func

    q, k, v = _packed([1000, 2000], [1500, 2500], 8, 2, 128, "cuda", torch.bfloat16)
    cu_q, cu_k = _cu([1000, 2000], "cuda"), _cu([1500, 2500], "cuda")
    kw = dict(causal=False)
    assert prefer_hopper_varlen(q, k, v, causal=False, window=(-1, -1), plain=True, max_seqlen_k=2500, n_seqs=2)
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2000, 2500, **kw)
    torch.cuda.synchronize()
    check_errors()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2000, 2500, **kw)
    graph.replay()
    assert torch.equal(out, flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2000, 2500, **kw))
    check_errors()
    cu_k.copy_(_cu([1500, 3000], "cuda"))
    graph.replay()
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        check_errors()
    cu_k.copy_(_cu([1500, 2500], "cuda"))
    graph.replay()
    check_errors()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 96, 128, 192])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gluon_varlen_matches_float64(monkeypatch, d, causal, dtype):
    """``GLUON_VARLEN`` (the Gluon kernel, one program per slot of the packed grid): empty q / k
    sequences, L_q != L_k, GQA 4 / 2, max_seqlen above the real maximum, every row written; then one 3000-key
    sequence and 1000 tiny ones; a decreasing cu_seqlens_q reported by check_errors."""
    from flashtile.runtime import fa3_gluon

    monkeypatch.setattr(fa3_fwd, "GLUON_VARLEN", True)
    ran = []
    real = fa3_gluon.gluon_launch
    monkeypatch.setattr(fa3_gluon, "gluon_launch", lambda *a, **kw: ran.append(kw["varlen"]) or real(*a, **kw))
    q, k, v = _packed(GPU_LENS_Q, GPU_LENS_K, 4, 2, d, "cuda", dtype, seed=d + 1)
    out, lse = fa3_varlen_forward(q, k, v, _cu(GPU_LENS_Q, "cuda"), _cu(GPU_LENS_K, "cuda"), 1200, 1100,
                                  softmax_scale=d ** -0.5, causal=causal)
    _assert_matches(out, lse, GPU_LENS_Q, GPU_LENS_K, q, k, v, d ** -0.5, causal)
    check_errors()
    assert ran, "the Gluon packed forward did not run"
    gen = torch.Generator().manual_seed(d)
    lq = [2000] + torch.randint(0, 21, (1000,), generator=gen).tolist()
    lk = [3000] + torch.randint(0, 21, (1000,), generator=gen).tolist()
    q, k, v = _packed(lq, lk, 4, 1, d, "cuda", dtype, seed=3)
    out, lse = fa3_varlen_forward(q, k, v, _cu(lq, "cuda"), _cu(lk, "cuda"), 2000, 3000, softmax_scale=0.1,
                                  causal=causal)
    _assert_matches(out, lse, lq, lk, q, k, v, 0.1, causal)
    check_errors()
    bad = _cu(lq, "cuda")
    bad[2] = 0
    fa3_varlen_forward(q, k, v, bad, _cu(lk, "cuda"), 2000, 3000, softmax_scale=0.1, causal=causal)
    with pytest.raises(ValueError, match="cu_seqlens"):
        check_errors()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d", [64, 128, 192])
def test_gpu_gluon_varlen_wg_skip_is_bitwise_the_same(monkeypatch, d):
    """``wg_skip`` on the packed Gluon forward (each program's rows and key bound from its own sequence; L_q > L_k
    leaves rows without keys, L_q < L_k shifts the diagonal): outputs and LSE bit for bit the table's, at 64-key
    tiles under three consumers too (two tiles skipped)."""
    from dataclasses import replace

    from flashtile.runtime import fa3_gluon

    monkeypatch.setattr(fa3_fwd, "GLUON_VARLEN", True)
    real = fa3_gluon.gluon_launch
    q, k, v = _packed(GPU_LENS_Q, GPU_LENS_K, 4, 2, d, "cuda", torch.bfloat16, seed=d + 7)
    cu_q, cu_k = _cu(GPU_LENS_Q, "cuda"), _cu(GPU_LENS_K, "cuda")
    base = fa3_varlen_forward(q, k, v, cu_q, cu_k, 1200, 1100, softmax_scale=d ** -0.5, causal=True)
    _assert_matches(*base, GPU_LENS_Q, GPU_LENS_K, q, k, v, d ** -0.5, True)
    variants = [dict(wg_skip=True)] + ([dict(wg_skip=True, block_n=64)] if d == 64 else [])
    for fields in variants:
        ran = []

        def launch(*a, fields=fields, ran=ran, **kw):
            ran.append(a[7])
            return real(*a[:7], replace(a[7], **fields), *a[8:], **kw)

        monkeypatch.setattr(fa3_gluon, "gluon_launch", launch)
        out, lse = fa3_varlen_forward(q, k, v, cu_q, cu_k, 1200, 1100, softmax_scale=d ** -0.5, causal=True)
        assert ran, "the Gluon packed forward did not run"
        assert torch.equal(out, base[0]) and torch.equal(lse, base[1]), fields


@pytest.mark.gpu
@hopper
def test_gpu_many_sequences_stay_inside_the_descriptor_scratch():
    """One 4096-token sequence and 5.6M one-token ones, one head, d 128: the Hopper packed grids' descriptor scratch
    would pass 2^31 bytes (an illegal address before the rule), so the dispatch runs FA2 and the Hopper entry point
    refuses; each one-token row attends to its own key: out = v there."""
    from flashtile import flash_attn_varlen_func

    lens = [4096] + [1] * 5_600_000
    total = sum(lens)
    q, k, v = (torch.randn(total, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = _cu(lens, "cuda")
    assert not prefer_hopper_varlen(q, k, v, causal=False, window=(-1, -1), plain=True, max_seqlen_k=4096,
                                    n_seqs=len(lens))
    assert prefer_hopper_varlen(q[:4096], k[:4096], v[:4096], causal=False, window=(-1, -1), plain=True,
                                max_seqlen_k=4096, n_seqs=1)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 4096, 4096)
    torch.cuda.synchronize()
    assert torch.equal(out[4096:], v[4096:])
    want = attention_varlen_ref(q[:512], k[:4096], v[:4096], [0, 512], [0, 4096])
    assert_close(out[:512], want[0], torch.bfloat16, "cuda", "long sequence out")
    with pytest.raises(NotImplementedError, match="int32 scratch offsets"):
        fa3_varlen_forward(q, k, v, cu, cu, 4096, 4096, softmax_scale=128 ** -0.5)
