"""Tests of the Triton FlashAttention-2 backward kernels against float64 autograd.

The oracle is tests/_oracle.py: float64 ``attention_ref`` (independent of flashtile)
and its autograd gradients (``attention_ref_grads``).  Its out (cast to the kernel
dtype) and LSE (float32) are what the kernel receives, so these tests do not depend
on the forward kernel.  Without a GPU the kernels run in Triton's interpreter
(tests/conftest.py): shapes stay small (N <= 80, d <= 64 except one d = 80 and one
d = 256 case).

Tolerance: the table of tests/_oracle.py for the gradients' dtype, elementwise, relative
to the largest entry of dq, dk, dv (a gradient that cancels to ~0, e.g. dq of a row seeing
one key, keeps rounding of that size), plus ``rounding_slack`` for the rounding of the
stored O that D = rowsum(dO o O) reads.
Exact zeros are required where the math gives exact zeros (rows with no
allowed key, keys no query sees): the kernels must produce P = 0 there, not a
small number and never NaN.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtile.runtime.common import dropout_keep_mask
from flashtile.runtime.fa2_bwd import BwdConfig, _fit_block_mask, bwd_config, fa2_backward
from flashtile.reference.masks import BlockMask
from tests._oracle import assert_close, attention_ref_grads, rounding_slack, scores_ref, tolerance

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


# --------------------------------------------------------------------------- #
# comparison with the float64 oracle
# --------------------------------------------------------------------------- #
class Ref(NamedTuple):
    """The oracle's gradients and the bounds :func:`rounding_slack` gives for storing O in the kernel dtype."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    slack: tuple[float, float, float]


def make(shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def inputs(b, hq, hk, nq, nk, d, dtype, device, seed=0):
    """q, k, v, dout; scores of O(1) so that softmax is neither flat nor one-hot."""
    return (
        make((b, hq, nq, d), dtype, device, seed),
        make((b, hk, nk, d), dtype, device, seed + 1),
        make((b, hk, nk, d), dtype, device, seed + 2),
        make((b, hq, nq, d), dtype, device, seed + 3),
    )


def run(q, k, v, dout, *, deterministic=False, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
        bias=None, block_mask=None, dropout_p=0.0, seed=0, offset=0, scale=None, **views):
    """Kernel gradients and oracle gradients for the same inputs."""
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    keep = None
    if dropout_p > 0:
        keep = dropout_keep_mask(seed, offset, b, hq, nq, nk, dropout_p, q.device)
    ref_kw = dict(scale=scale, causal=causal, window=window, softcap=softcap, alibi=alibi, bias=bias,
                  block_mask=block_mask, keep=keep, dropout_p=dropout_p)
    out, lse, dq, dk, dv = attention_ref_grads(q, k, v, dout, **ref_kw)
    f64 = [x.detach().double() for x in (q, k, v, dout)]
    ref = Ref(dq, dk, dv, rounding_slack(*f64, q.dtype, **ref_kw))
    visible = torch.isfinite(scores_ref(*f64[:2], scale=scale, causal=causal, window=window, softcap=softcap,
                                        alibi=alibi, bias=bias, block_mask=block_mask)).cpu()
    got = fa2_backward(
        dout, q, k, v, out.to(device=q.device, dtype=q.dtype), lse.to(device=q.device, dtype=F32),
        softmax_scale=scale, causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi,
        bias=bias, dropout_p=dropout_p, philox_seed=seed, philox_offset=offset, block_mask=block_mask,
        deterministic=deterministic, **views,
    )
    return got, ref, lse.cpu(), visible


def assert_grads(got, ref: Ref):
    """dq, dk, dv within the table's tolerance for their dtype, relative to the largest gradient entry."""
    size = max((float(r.abs().max()) for r in ref[:3] if r.numel()), default=0.0)
    for name, g, r, extra in zip(("dq", "dk", "dv"), got, ref[:3], ref.slack):
        assert_close(g, r, what=name, magnitude=size, slack=extra)


def assert_exact_zeros(got, visible):
    """Structural zeros: a query row with no visible key has dq = 0 exactly, and a
    key no query of its GQA group sees has dk = dv = 0 exactly (P = 0 there)."""
    dq, dk, dv = (g.detach().cpu() for g in got)
    b, hq, nq, nk = dq.shape[0], dq.shape[1], dq.shape[2], dk.shape[2]
    visible = visible.expand(b, hq, nq, nk)
    assert (dq[~visible.any(dim=-1)] == 0).all(), "dq rows with no visible key must be exactly 0"
    seen = visible.reshape(b, dk.shape[1], hq // dk.shape[1], nq, nk).any(dim=3).any(dim=2)
    assert (dk[~seen] == 0).all() and (dv[~seen] == 0).all(), "unseen keys must get dk = dv = 0 exactly"


# --------------------------------------------------------------------------- #
# dtypes, both dQ strategies
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_dense_matches_oracle(device, dtype, deterministic):
    q, k, v, do = inputs(2, 2, 2, 40, 56, 32, dtype, device)
    got, ref, _, _ = run(q, k, v, do, deterministic=deterministic)
    assert all(g.dtype == dtype for g in got)
    assert_grads(got, ref)


def test_softmax_scale_is_used(device):
    q, k, v, do = inputs(1, 2, 2, 24, 40, 16, F32, device, seed=3)
    got, ref, _, _ = run(q, k, v, do, scale=0.9, deterministic=True)
    assert_grads(got, ref)


# --------------------------------------------------------------------------- #
# masks
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("nq,nk", [(24, 72), (72, 24), (48, 48)])
def test_causal(device, nq, nk, deterministic):
    q, k, v, do = inputs(1, 2, 2, nq, nk, 32, F32, device, seed=nq)
    got, ref, lse, visible = run(q, k, v, do, causal=True, deterministic=deterministic)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)
    if nq > nk:  # bottom-right alignment leaves the first Nq - Nk rows with no key
        assert torch.isneginf(lse[..., : nq - nk]).all()
        assert (got[0].cpu()[:, :, : nq - nk] == 0).all()


@pytest.mark.parametrize(
    "window,causal,nq,nk,deterministic",
    [
        ((8, 4), False, 40, 64, True),
        ((0, 0), False, 64, 40, False),
        ((20, -1), False, 48, 48, True),
        ((-1, 5), False, 33, 70, False),
        ((3, -1), True, 70, 33, True),
    ],
)
def test_sliding_window(device, window, causal, nq, nk, deterministic):
    q, k, v, do = inputs(1, 2, 1, nq, nk, 16, F32, device, seed=nq + nk)
    got, ref, _, visible = run(q, k, v, do, window=window, causal=causal, deterministic=deterministic)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


@settings(max_examples=12, deadline=None)
@given(
    nq=st.integers(1, 70),
    nk=st.integers(1, 70),
    left=st.integers(-1, 40),
    right=st.integers(-1, 40),
    causal=st.booleans(),
    deterministic=st.booleans(),
)
def test_window_geometry_property(nq, nk, left, right, causal, deterministic):
    """Any window over any lengths: the boundary/interior split of the q and kv
    loops must visit exactly the allowed pairs (a wrong split shows as wrong
    gradients or a missing block)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    window = (left, 0 if causal else right)
    q, k, v, do = inputs(1, 1, 1, nq, nk, 16, F32, device, seed=nq * 97 + nk)
    got, ref, _, visible = run(q, k, v, do, window=window, causal=causal, deterministic=deterministic)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


# --------------------------------------------------------------------------- #
# score modifiers
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("deterministic", [True, False])
def test_softcap(device, deterministic):
    # scores up to ~3 * cap: tanh saturates, so a missing (1 - t^2) factor is visible
    q, k, v, do = inputs(1, 2, 2, 40, 48, 32, F32, device, seed=5)
    got, ref, _, _ = run(q, k, v, do, softcap=2.0, scale=0.5, deterministic=deterministic)
    assert_grads(got, ref)
    # the cap matters at this scale: uncapped gradients are far outside the tolerance
    _, _, dq_plain, _, _ = attention_ref_grads(q, k, v, do, scale=0.5)
    assert (dq_plain - ref[0]).norm() > 100 * tolerance(F32, device) * ref[0].norm()


@pytest.mark.parametrize("slopes_shape", ["heads", "batch_heads"])
def test_alibi(device, slopes_shape):
    b, hq = 2, 2
    q, k, v, do = inputs(b, hq, 1, 36, 52, 16, F32, device, seed=7)
    shape = (hq,) if slopes_shape == "heads" else (b, hq)
    slopes = (torch.rand(shape, generator=torch.Generator().manual_seed(1)) * 0.5).to(device)
    got, ref, _, _ = run(q, k, v, do, alibi=slopes, causal=slopes_shape == "heads",
                      deterministic=slopes_shape == "heads")
    assert_grads(got, ref)


@pytest.mark.parametrize("deterministic", [True, False])
def test_bias_broadcast_with_inf(device, deterministic):
    """Bias (1, Hq, Nq, Nk)-broadcast from (Hq, 1, Nk) plus a per-row term; -inf
    entries mask, a fully -inf row has lse -inf and zero gradients."""
    b, hq, nq, nk = 2, 2, 30, 44
    q, k, v, do = inputs(b, hq, hq, nq, nk, 16, F32, device, seed=9)
    bias = make((hq, nq, nk), F32, "cpu", 11)
    bias[0, :, 5:9] = -math.inf  # some keys hidden from every query of head 0
    bias[1, 3, :] = -math.inf  # query row 3 of head 1 sees nothing
    bias = bias.to(device)
    got, ref, lse, visible = run(q, k, v, do, bias=bias, deterministic=deterministic)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)
    assert torch.isneginf(lse[:, 1, 3]).all()
    assert (got[0].cpu()[:, 1, 3] == 0).all()


def test_bias_row_broadcast_and_all_mods(device):
    """Bias of shape (Nk,) (stride 0 on three dims) with softcap, ALiBi and causal together."""
    q, k, v, do = inputs(1, 2, 1, 40, 40, 32, F32, device, seed=13)
    bias = make((40,), F32, device, 17, scale=0.5)
    slopes = torch.tensor([0.25, 0.0625], device=device)
    got, ref, _, _ = run(q, k, v, do, bias=bias, alibi=slopes, softcap=3.0, causal=True, deterministic=True)
    assert_grads(got, ref)


# --------------------------------------------------------------------------- #
# dropout
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "deterministic,causal,dtype", [(True, False, F32), (False, True, F32), (True, True, BF16)]
)
def test_dropout(device, deterministic, causal, dtype):
    q, k, v, do = inputs(2, 2, 1, 40, 56, 32, dtype, device, seed=21)
    got, ref, _, _ = run(q, k, v, do, dropout_p=0.3, seed=1234, offset=64, causal=causal, deterministic=deterministic)
    assert_grads(got, ref)


def test_dropout_state_from_a_device_tensor(device):
    """rng_state (the int64 [seed, offset] tensor the op draws on the device, read by the
    kernels) replays exactly the keep-mask of the same pair passed as ints, 64-bit values included."""
    seed, offset = 2**40 + 5, 2**33 + 7
    q, k, v, do = inputs(1, 2, 1, 40, 48, 16, F32, device, seed=27)
    got, ref, lse, _ = run(q, k, v, do, dropout_p=0.3, seed=seed, offset=offset, deterministic=True)
    assert_grads(got, ref)
    rng = torch.tensor([seed, offset], dtype=torch.int64, device=device)
    out = make(q.shape, F32, device, 28)
    kw = dict(softmax_scale=0.25, dropout_p=0.3, deterministic=True)
    from_ints = fa2_backward(do, q, k, v, out, lse.to(device=device, dtype=F32), philox_seed=seed, philox_offset=offset, **kw)
    from_tensor = fa2_backward(do, q, k, v, out, lse.to(device=device, dtype=F32), rng_state=rng, **kw)
    for a, c in zip(from_ints, from_tensor):
        assert torch.equal(a, c)


def test_dropout_mask_mismatch_is_detected(device):
    """The oracle is sensitive to the keep pattern: a different seed must fail."""
    q, k, v, do = inputs(1, 1, 1, 32, 32, 16, F32, device, seed=23)
    keep = dropout_keep_mask(99, 0, 1, 1, 32, 32, 0.3, device)
    out, lse, *ref = attention_ref_grads(q, k, v, do, scale=0.25, keep=keep, dropout_p=0.3)
    got = fa2_backward(do, q, k, v, out.float().to(device), lse.float().to(device), softmax_scale=0.25,
                       dropout_p=0.3, philox_seed=98)
    err = ((got[2].double() - ref[2]).norm() / ref[2].norm()).item()
    assert err > 0.1


# --------------------------------------------------------------------------- #
# GQA / MQA
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("hq,hk", [(4, 2), (3, 1)])
def test_gqa_mqa(device, hq, hk, deterministic):
    q, k, v, do = inputs(1, hq, hk, 33, 47, 16, F32, device, seed=hq)
    got, ref, _, _ = run(q, k, v, do, causal=True, deterministic=deterministic)
    assert got[1].shape == k.shape and got[2].shape == v.shape
    assert_grads(got, ref)


# --------------------------------------------------------------------------- #
# block-sparse
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("deterministic", [True, False])
def test_block_mask_random_with_causal(device, deterministic):
    nq, nk = 64, 80
    bm = BlockMask.random(nq, nk, 0.5, block_size=(32, 16), generator=torch.Generator().manual_seed(4))
    q, k, v, do = inputs(1, 2, 2, nq, nk, 16, F32, device, seed=31)
    got, ref, _, visible = run(q, k, v, do, block_mask=bm, causal=True, deterministic=deterministic)
    assert_grads(got, ref)
    assert_exact_zeros(got, visible)


def test_block_mask_per_head_gqa(device):
    """A (Hq, Tr, Tc) mask under GQA: each q head of a group walks its own lists."""
    nq, nk, hq = 48, 40, 4
    g = torch.Generator().manual_seed(8)
    mask = torch.rand(hq, 3, 3, generator=g) < 0.6
    mask[:, :, 0] = True
    bm = BlockMask(mask, (16, 16))
    q, k, v, do = inputs(1, hq, 2, nq, nk, 16, F32, device, seed=33)
    got, ref, _, _ = run(q, k, v, do, block_mask=bm, window=(20, 8), deterministic=True)
    assert_grads(got, ref)
    got_atomic, _, _, _ = run(q, k, v, do, block_mask=bm, window=(20, 8), deterministic=False)
    assert_grads(got_atomic, ref)


# --------------------------------------------------------------------------- #
# tails, head dims, layouts
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "nq,nk,d,deterministic",
    [(1, 1, 8, True), (17, 33, 24, False), (33, 17, 80, True), (5, 9, 256, False), (19, 23, 1, True)],
)
def test_tails_and_head_dims(device, nq, nk, d, deterministic):
    q, k, v, do = inputs(1, 2, 1, nq, nk, d, F32, device, seed=d)
    got, ref, _, _ = run(q, k, v, do, deterministic=deterministic, causal=nq == 17)
    assert_grads(got, ref)


@pytest.mark.parametrize("deterministic", [True, False])
def test_flash_layout_views_in_and_out(device, deterministic):
    """(B, N, H, d) storage seen through .transpose(1, 2), gradients written into
    such views, and one input with a non-unit stride along d."""
    b, hq, hk, nq, nk, d = 2, 2, 1, 36, 44, 16

    def bnhd(n, h, seed):
        return make((b, n, h, d), F32, device, seed).transpose(1, 2)

    q, k, v, do = bnhd(nq, hq, 0), bnhd(nk, hk, 1), bnhd(nk, hk, 2), bnhd(nq, hq, 3)
    v_strided = make((b, hk, nk, 2 * d), F32, device, 4)[..., ::2]
    assert not q.is_contiguous() and v_strided.stride(-1) == 2
    views = {
        "dq": torch.full((b, nq, hq, d), math.nan, device=device).transpose(1, 2),
        "dk": torch.full((b, nk, hk, d), math.nan, device=device).transpose(1, 2),
        "dv": torch.full((b, hk, nk, 2 * d), math.nan, device=device)[..., ::2],
    }
    got, ref, _, _ = run(q, k, v_strided, do, causal=True, deterministic=deterministic, **views)
    for name, g in zip(("dq", "dk", "dv"), got):
        assert g is views[name], f"{name} must be returned as the given view"
    assert_grads(got, ref)


@pytest.mark.parametrize("nq,nk", [(0, 16), (16, 0)])
def test_empty_sequences(device, nq, nk):
    q, k, v, do = inputs(1, 2, 1, nq, nk, 16, F32, device)
    dq = torch.full_like(q, math.nan)
    dk = torch.full_like(k, math.nan)
    dv = torch.full_like(v, math.nan)
    lse = torch.full((1, 2, nq), -math.inf, device=device)
    got = fa2_backward(do, q, k, v, torch.zeros_like(q), lse, softmax_scale=0.25, dq=dq, dk=dk, dv=dv)
    for g in got:
        assert (g == 0).all()


# --------------------------------------------------------------------------- #
# determinism
# --------------------------------------------------------------------------- #
def test_deterministic_is_bitwise_reproducible(device):
    """deterministic=True: same bits on every run (the GPU test below repeats this
    at scale, where the atomic path would reorder the dQ sums)."""
    q, k, v, do = inputs(1, 4, 2, 40, 56, 16, BF16, device, seed=41)
    first, ref, _, _ = run(q, k, v, do, causal=True, deterministic=True)
    second, _, _, _ = run(q, k, v, do, causal=True, deterministic=True)
    for a, c in zip(first, second):
        assert torch.equal(a, c)
    assert_grads(first, ref)


def test_nondeterministic_follows_config_choice_of_dq_kernel(device, monkeypatch):
    """deterministic=False with a config that prefers the dQ kernel (atomic_dq=False) runs
    exactly the deterministic kernels, so it gives the same bits as deterministic=True."""
    import flashtile.runtime.fa2_bwd as fb

    q, k, v, do = inputs(1, 2, 1, 40, 56, 16, BF16, device, seed=43)
    det, ref, _, _ = run(q, k, v, do, causal=True, deterministic=True)
    base = fb.bwd_config
    monkeypatch.setattr(fb, "bwd_config", lambda *a, **kw: base(*a, **kw)._replace(atomic_dq=False))
    routed, _, _, _ = run(q, k, v, do, causal=True, deterministic=False)
    for a, c in zip(det, routed):
        assert torch.equal(a, c)
    assert_grads(routed, ref)


# --------------------------------------------------------------------------- #
# configuration and argument checks
# --------------------------------------------------------------------------- #
def test_bwd_config_interpreter_and_gpu_tiles():
    assert bwd_config(64, F16, False, 64, 64, "cpu") == BwdConfig(16, 32, 32, 16, 4, 1)
    small_d = bwd_config(64, BF16, True, 8192, 8192, "cuda")
    big_d = bwd_config(256, BF16, True, 8192, 8192, "cuda")
    assert small_d == BwdConfig(64, 128, 128, 64, 8, 3, atomic_dq=True)
    assert not bwd_config(64, BF16, True, 2048, 2048, "cuda").atomic_dq  # measured: the dQ kernel wins below 8k
    assert bwd_config(128, BF16, True, 8192, 8192, "cuda") == BwdConfig(64, 128, 128, 64, 8, 3, atomic_dq=False)
    assert big_d == BwdConfig(32, 64, 64, 32, 8, 1)
    assert big_d.block_m * big_d.block_n < small_d.block_m * small_d.block_n
    assert bwd_config(128, F32, False, 8192, 8192, "cuda").block_n < bwd_config(128, BF16, False, 8192, 8192, "cuda").block_n
    # short sequences do not get tiles longer than the sequence (rounded to a power of two >= 16)
    tiny = bwd_config(64, BF16, False, 5, 20, "cuda")
    assert (tiny.block_m, tiny.block_n, tiny.dq_block_m, tiny.dq_block_n) == (16, 32, 16, 32)
    for cfg in (small_d, big_d, tiny):
        for t in cfg[:4]:
            assert t >= 16 and t & (t - 1) == 0


def test_tiles_fit_block_mask():
    cfg = BwdConfig(64, 128, 128, 64, 8, 2)
    fit = _fit_block_mask(cfg, BlockMask.dense(256, 256, block_size=(48, 32)))
    assert fit[:4] == (16, 32, 16, 32)
    assert 48 % fit.block_m == 0 and 32 % fit.block_n == 0
    assert _fit_block_mask(cfg, None) == cfg


def _args(device, **over):
    q, k, v, do = inputs(1, 2, 1, 8, 8, 16, F32, device)
    a = dict(dout=do, q=q, k=k, v=v, out=torch.zeros_like(q), lse=torch.zeros(1, 2, 8, device=device))
    a.update(over)
    return a


@pytest.mark.parametrize(
    "kw,exc",
    [
        ({"rng_state": torch.zeros(2, dtype=torch.int32)}, TypeError),
        ({"rng_state": torch.zeros(3, dtype=torch.int64)}, ValueError),
        ({"rng_state": torch.zeros(2, dtype=torch.int64), "philox_seed": 3}, ValueError),
    ],
)
def test_bad_rng_state_raises(kw, exc):
    """The kernels read two int64 from rng_state: fa2_backward checks the tensor it reads (the other
    arguments are validated once by the public ops, tests/ops/test_ops_validate.py)."""
    a = _args("cpu")
    with pytest.raises(exc, match="rng_state"):
        fa2_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], softmax_scale=0.25, dropout_p=0.1, **kw)


# --------------------------------------------------------------------------- #
# GPU: long sequences against the float64 oracle on the device
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@pytest.mark.parametrize("n", [2048, 8192, 16384])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_long_sequences_bf16(n, d, causal, deterministic):
    hq, hk = 2, 1
    q, k, v, do = inputs(1, hq, hk, n, n, d, BF16, "cuda", seed=n + d)
    # float64 on the GPU: at n = 16384 the (1, 2, n, n) scores are 4.3 GB, autograd keeps a few of them
    got, ref, _, _ = run(q, k, v, do, causal=causal, deterministic=deterministic)
    torch.cuda.synchronize()
    assert_grads(got, ref)


@pytest.mark.gpu
def test_gpu_deterministic_bitwise_long():
    """Many q heads per kv head and long rows: the case where atomics would reorder."""
    q, k, v, do = inputs(2, 8, 2, 4096, 4096, 128, BF16, "cuda", seed=1)
    # reproducibility needs no true forward: any O and LSE exercise the same sums
    lse = torch.randn(2, 8, 4096, device="cuda") + 8.0
    out = make((2, 8, 4096, 128), BF16, "cuda", 2)
    runs = [fa2_backward(do, q, k, v, out, lse, softmax_scale=128 ** -0.5, causal=True, deterministic=True)
            for _ in range(2)]
    for a, c in zip(*runs):
        assert torch.equal(a, c)


@pytest.mark.gpu
def test_gpu_dependent_launch_changes_no_bit(monkeypatch):
    """On Hopper the dK/dV and dQ kernels start as programmatic dependents of the kernel before
    them and wait for it before reading D; a missing wait would read D half-written.  Gradients
    with dependent launch must equal those of plain launches bit for bit (deterministic dQ)."""
    from flashtile.runtime import fa2_bwd

    if not fa2_bwd.pdl_supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    q, k, v, do = inputs(4, 16, 4, 2048, 2048, 128, BF16, "cuda", seed=5)
    lse = torch.randn(4, 16, 2048, device="cuda") + 8.0
    out = make((4, 16, 2048, 128), BF16, "cuda", 6)

    def grads():
        return fa2_backward(do, q, k, v, out, lse, softmax_scale=128 ** -0.5, causal=True, deterministic=True)

    with_pdl = grads()
    monkeypatch.setattr(fa2_bwd, "pdl_supported", lambda device: False)
    plain = grads()
    for a, c in zip(with_pdl, plain):
        assert torch.isfinite(a).all()
        assert torch.equal(a, c)


# --------------------------------------------------------------------------- #
# Launch grids: CUDA allows 2^31 - 1 programs on axis x, 65535 on y and z
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "b,hq,hk,nq,nk,d",
    [(2048, 32, 32, 16, 16, 16), (2048, 32, 8, 16, 16, 16), (70000, 1, 1, 16, 16, 64), (1, 70000, 1, 16, 16, 64),
     (1, 64, 1, 263168, 263168, 128), (2**20, 2**11 - 1, 2**11 - 1, 1, 1, 16), (8, 16, 16, 2**26, 2**26, 64)],
)
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_grids_within_cuda_limits(b, hq, hk, nq, nk, d, dtype):
    """The grid of every backward kernel, at the GPU tile sizes, fits CUDA's limits and has a
    program for every (tile, batch-head) pair: B * H > 65535 used to go on axis y."""
    from flashtile.runtime import common as _common
    from flashtile.runtime.fa2_bwd import bwd_grids

    cfg = bwd_config(d, dtype, True, nq, nk, "cuda")
    grids = bwd_grids(b, hq, hk, nq, nk, cfg)
    for name, grid, tiles, pairs in (
        ("preprocess", grids.preprocess, -(-nq // cfg.dq_block_m), b * hq),
        ("dkdv", grids.dkdv, -(-nk // cfg.block_n), b * hk),
        ("dq", grids.dq, -(-nq // cfg.dq_block_m), b * hq),
    ):
        assert len(grid) == 3 and grid[0] == tiles <= _common.GRID_X_MAX, (name, grid)
        assert all(1 <= g <= _common.GRID_YZ_MAX for g in grid[1:]), (name, grid)
        assert grid[1] * grid[2] >= pairs > grid[1] * (grid[2] - 1), (name, grid)  # every pair, < 1 row spare


def test_wide_row_strides(device):
    """Inputs and gradient views with a row stride of TILE_ROW_STRIDE_MAX (the forward's limit
    for 32-bit in-tile offsets; the backward forms row offsets in 64 bits) give the gradients
    of contiguous inputs, written into the given views."""
    from flashtile.runtime.common import TILE_ROW_STRIDE_MAX, wide_rows

    q, k, v, do = inputs(1, 1, 1, 2, 2, 16, F32, device, seed=41)
    out, lse = make(q.shape, F32, device, 42), make((1, 1, 2), F32, device, 43)

    def spread(x):  # same values, row stride TILE_ROW_STRIDE_MAX
        y = torch.zeros(TILE_ROW_STRIDE_MAX * 2, device=device).as_strided(x.shape, (0, 0, TILE_ROW_STRIDE_MAX, 1))
        return y.copy_(x)

    assert wide_rows(spread(q)) and not wide_rows(q, k, v)
    kw = dict(softmax_scale=0.25, causal=True)
    want = fa2_backward(do, q, k, v, out, lse, **kw)
    views = [spread(torch.zeros_like(x)) for x in (q, k, v)]
    got = fa2_backward(*(spread(x) for x in (do, q, k, v, out)), lse, dq=views[0], dk=views[1], dv=views[2], **kw)
    for g, view, w in zip(got, views, want):
        assert g is view
        assert torch.equal(g, w)


def test_wide_decision():
    """64-bit row offsets (WIDE) exactly when some row index x row stride can reach 2^31."""
    from flashtile.runtime.fa2_bwd import _wide

    def view(b, h, n, d, seq_major=False):  # (B, H, N, d) view, strides only (no storage)
        shape = (b, n, h, d) if seq_major else (b, h, n, d)
        t = torch.empty_strided(shape, torch.empty(shape, device="meta").stride(), device="meta")
        return t.transpose(1, 2) if seq_major else t

    flash = view(1, 128, 263168, 64, seq_major=True)  # row stride 8192: 263168 * 8192 > 2^31
    assert _wide(263168, (flash,), 263168, (flash,), None)
    small = view(2, 8, 4096, 128)
    assert not _wide(4096, (small,), 4096, (small,), None)
    one = view(1, 1, 47104, 64)  # q, k, v small, but an (n, n) bias has row stride n
    bias = torch.empty(47104, 47104, device="meta").expand(1, 1, 47104, 47104)
    assert _wide(47104, (one,), 47104, (one,), bias) and not _wide(47104, (one,), 47104, (one,), None)


@pytest.mark.parametrize("deterministic", [False, True])
def test_wide_offsets_give_the_same_gradients(device, monkeypatch, deterministic):
    """The 64-bit row-offset variant of the kernels (taken for tensors past 2^31 elements, which
    the interpreter cannot hold) matches the oracle on a small problem, bias and dropout included."""
    from flashtile.runtime import fa2_bwd

    monkeypatch.setattr(fa2_bwd, "_wide", lambda *args: True)
    q, k, v, do = inputs(2, 2, 1, 40, 56, 16, F32, device, seed=33)
    bias = make((1, 2, 40, 56), F32, device, 34)
    got, ref, _, _ = run(q, k, v, do, causal=True, bias=bias, dropout_p=0.2, seed=5, offset=9,
                         deterministic=deterministic)
    assert_grads(got, ref)


@pytest.mark.parametrize("deterministic", [False, True])
def test_folded_grid_runs_every_pair_once(device, monkeypatch, deterministic):
    """With axis y shrunk to a few programs, the (batch, head) pairs spill onto axis z with a
    partial last row (its extra programs must exit): forward, dropout keep-mask and every
    backward kernel still match the float64 oracle, so each pair ran exactly once."""
    from flashtile.runtime import common as _common
    from flashtile.runtime.fa2_fwd import fa2_forward

    if device == "cuda":
        pytest.skip("the interpreter's grid is the point here; the GPU runs the real grids")
    q, k, v, do = inputs(3, 2, 1, 40, 56, 16, F32, device, seed=31)
    full_keep = dropout_keep_mask(11, 3, 3, 2, 40, 56, 0.25, device)
    monkeypatch.setattr(_common, "GRID_YZ_MAX", 4)  # 6 q-head and 3 kv-head pairs: z-rows of 4
    assert torch.equal(dropout_keep_mask(11, 3, 3, 2, 40, 56, 0.25, device), full_keep)
    got, ref, _, _ = run(q, k, v, do, causal=True, dropout_p=0.25, seed=11, offset=3, deterministic=deterministic)
    assert_grads(got, ref)
    out, lse = fa2_forward(q, k, v, softmax_scale=0.25, causal=True)
    ref_out, ref_lse, *_ = attention_ref_grads(q, k, v, do, scale=0.25, causal=True)
    assert_close(out, ref_out, what="out")
    assert_close(lse, ref_lse, what="lse")
