"""GPU-only tests of sizes the interpreter cannot reach: tensors past 2^31 elements, grids past
CUDA's 65535 programs on axes y/z, and dropout captured in a CUDA graph.

Run on an H100 80GB: ``python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_large.py``.
Each test stays under ~20 s and ~45 GB.  The ``*_small`` tests run the same checks at sizes the
interpreter handles, so the checking code itself is exercised without a GPU.  No n x n float64 reference is formed: with a causal
window (32, 0) a query row depends on 33 keys only, so slices of rows are checked against
tests/_oracle.py's float64 oracle computed on the slice (rows [a, b) with keys [lo, b) keep the
bottom-right alignment: row a + i still sits on key a + i); a full additive mask is checked against
the equivalent built-in mask (same gradients) and against the oracle on a few rows.  Tolerances:
the table of tests/_oracle.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashtile
from flashtile.runtime.common import dropout_keep_mask
from flashtile.ops.autograd import attention
from tests._cuda import capture
from tests._oracle import assert_close, attention_ref_grads, rounding_slack

BF16 = torch.bfloat16
I32_MAX = 2**31 - 1


def check_slice(q, k, v, dout, out, grads, *, keys=slice(None), grad_tol=None, **kw):
    """out, dq and dk, dv (keys ``keys`` of the slice) of one (B, H, M, d) slice against
    :func:`attention_ref_grads` on that slice (``kw`` as :func:`attention_ref`), with the table's
    tolerance for q's dtype (``grad_tol`` overrides it for the gradients), relative to the largest
    oracle gradient, plus the slack of O stored in q's dtype."""
    ref_out, _, *ref = attention_ref_grads(q, k, v, dout, **kw)
    slack = rounding_slack(*(x.detach().double() for x in (q, k, v, dout)), q.dtype, **kw)
    size = max(float(r.abs().max()) for r in ref)
    assert_close(out, ref_out, q.dtype, what="out")
    for name, g, r, extra, part in zip(("dq", "dk", "dv"), grads, ref, slack, (slice(None), keys, keys)):
        assert_close(g, r[..., part, :], q.dtype, what=name, tol=grad_tol, magnitude=size, slack=extra)


def context_alive(device: str) -> None:
    """A CUDA error in a kernel poisons the context: the next op or sync raises."""
    if device == "cuda":
        torch.cuda.synchronize()
    assert (torch.arange(4, device=device) + 1).sum().item() == 10


# --------------------------------------------------------------------------- #
# Tensors past 2^31 elements
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_window_grads_past_2_pow_31(deterministic):
    """flash-attn layout (1, N, 128, 64), causal window (32, 0): q, k, v, dq, dk, dv (and with
    deterministic=False the fp32 atomic dQ buffer, d = 64 and N >= 8192) all exceed 2^31
    elements, so row index x row stride (8192) does too: the old backward killed the context.
    Checked on slices (first, middle, last rows of the first and last head) against float64."""
    assert 263168 * 128 * 64 > I32_MAX
    check_window_slices(263168, 128, 64, deterministic, "cuda")


@pytest.mark.parametrize("deterministic", [False, True])
def test_window_slices_small(deterministic, device):
    """The slice checks of the test above on a size the interpreter runs."""
    check_window_slices(150, 2, 16, deterministic, device)


def check_window_slices(n, h, d, deterministic, device, w=32):
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, n, h, d, device=device, dtype=BF16, generator=gen) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    out = flashtile.flash_attn_func(q, k, v, causal=True, window_size=(w, 0), deterministic=deterministic)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    context_alive(device)
    for g in (out, dq, dk, dv):
        assert torch.isfinite(g).all()
    scale = d ** -0.5
    rows_per_slice = min(96, n // 3)  # > w: some keys of each slice get all their rows
    for a in (0, n // 2, n - rows_per_slice):
        b = a + rows_per_slice
        lo = max(0, a - w)  # first key any of rows [a, b) sees
        for head in (0, h - 1):
            def sl(x, r0, r1, head=head):  # rows [r0, r1) of one head: (1, 1, rows, d)
                return x[:, r0:r1, head : head + 1].transpose(1, 2)

            # key j gets gradient from rows j .. j + w: complete in the slice for keys [a, b - w), or to the end
            k1 = b if b == n else b - w
            check_slice(sl(q, a, b), sl(k, lo, b), sl(v, lo, b), sl(dout, a, b), sl(out, a, b),
                        (sl(dq, a, b), sl(dk, a, k1), sl(dv, a, k1)), keys=slice(a - lo, k1 - lo),
                        scale=scale, causal=True, window=(w, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_additive_mask_past_2_pow_31(deterministic):
    """An (n, n) additive mask with n = 47104 has 2.2e9 > 2^31 elements: its row offsets
    (row x n) overflowed int32 in the backward.  A causal mask given as -inf above the diagonal
    must give the gradients of is_causal=True (any misplaced bias read would not), and the
    first and last rows must match float64.  deterministic=False takes the fp32 atomic dQ path
    (d = 64, N >= 8192), True the separate dQ kernel."""
    assert 47104 * 47104 > I32_MAX
    check_additive_mask(47104, 64, deterministic, "cuda")


@pytest.mark.parametrize("deterministic", [False, True])
def test_additive_mask_small(deterministic, device):
    """The checks of the test above on a size the interpreter runs."""
    check_additive_mask(80, 16, deterministic, device)


def check_additive_mask(n, d, deterministic, device):
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v, dout = (torch.randn(1, 1, n, d, device=device, dtype=BF16, generator=gen) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    mask = torch.full((n, n), -math.inf, device=device, dtype=BF16).triu_(1)
    scale = d ** -0.5

    def run(bias, causal):
        if not deterministic:  # the public path of the report
            out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal)
        else:
            out, _, _ = attention(q, k, v, seq_major=False, softmax_scale=scale, causal=causal,
                                  window=(-1, 0) if causal else (-1, -1),
                                  bias=None if bias is None else bias.expand(1, 1, n, n), deterministic=True)
        return out, *torch.autograd.grad(out, (q, k, v), dout)

    masked = run(mask, False)
    context_alive(device)
    del mask
    builtin = run(None, True)
    for name, a, c in zip(("out", "dq", "dk", "dv"), masked, builtin):
        assert torch.isfinite(a).all(), name
        assert_close(a, c, what=name)
    out, dq = masked[0], masked[1]
    for a, b in ((0, 32), (n - 32, n)):
        # rows [a, b) with keys [0, b), causal: bottom-right alignment puts row a + i on key a + i
        rows = [q[:, :, a:b], k[:, :, :b], v[:, :, :b], dout[:, :, a:b]]
        ref_out, _, rq, _, _ = attention_ref_grads(*rows, scale=scale, causal=True)
        slack, _, _ = rounding_slack(*(x.detach().double() for x in rows), BF16, scale=scale, causal=True)
        assert_close(out[:, :, a:b], ref_out, what="out rows")
        assert_close(dq[:, :, a:b], rq, what="dq rows", slack=slack)


@pytest.mark.gpu
def test_bias_row_offsets_past_2_pow_31_inside_one_tile():
    """A (64, Nk) bias with Nk = 3 * 2^24: q row x row stride (Nk) passes 2^31 from row 43 on,
    inside a single 64-row tile, so the in-tile offsets themselves need 64 bits.  The bias
    -|i + Nk - Nq - j| / 8 is ALiBi with slope 1/8 (exact in bf16 wherever exp does not
    underflow): out and gradients must equal the alibi_slopes call's (fp32 atomic dQ path)."""
    nq, nk, d, slope = 64, 3 * 2**24, 16, 0.125
    assert (nq - 1) * nk > I32_MAX
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, dout = (torch.randn(1, 1, nq, d, device="cuda", dtype=BF16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 1, nk, d, device="cuda", dtype=BF16, generator=gen) for _ in range(2))
    for x in (q, k, v):
        x.requires_grad_()
    bias = torch.empty(nq, nk, device="cuda", dtype=BF16)
    keys = torch.arange(nk, device="cuda", dtype=torch.int64)  # float32 is not exact past 2^24 keys
    for i in range(nq):
        bias[i] = -(keys - (i + nk - nq)).abs().to(torch.float32) * slope
    del keys
    scale = d ** -0.5

    def run(**kw):
        out, _, _ = attention(q, k, v, seq_major=False, softmax_scale=scale, causal=False, window=(-1, -1), **kw)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    biased = run(bias=bias.expand(1, 1, nq, nk))
    context_alive("cuda")
    del bias
    alibi = run(alibi_slopes=torch.full((1,), slope, device="cuda"))
    for name, a, c in zip(("out", "dq", "dk", "dv"), biased, alibi):
        assert torch.isfinite(a).all(), name
        if name in ("dk", "dv"):
            # keys >= 1984 before every row's diagonal have bias <= -248: P underflows to exactly 0 in
            # both paths, so their dk, dv are 0 exactly (checked on the device: 805M entries)
            assert not a[..., :-2048, :].any() and not c[..., :-2048, :].any(), name
            a, c = a[..., -2048:, :], c[..., -2048:, :]
        assert_close(a, c, what=name)


# --------------------------------------------------------------------------- #
# Batch x heads past CUDA's 65535 programs on grid axes y / z
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@pytest.mark.parametrize("b,h", [(2048, 32), (70000, 1)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_many_batch_heads(b, h, deterministic):
    """B * H = 65536 (and B = 70000) used to put B * H (or B) on a grid axis limited to 65535:
    the backward failed with "invalid argument" (the forward refused B > 65535)."""
    check_many_heads(b, h, deterministic, "cuda")


def test_many_heads_check_small(device):
    check_many_heads(3, 2, True, device)


def check_many_heads(b, h, deterministic, device, n=16, d=16):
    gen = torch.Generator(device=device).manual_seed(2)
    q, k, v, dout = (torch.randn(b, n, h, d, device=device, dtype=torch.float16, generator=gen) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    out = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    context_alive(device)
    bhnd = lambda x: x.transpose(1, 2)  # noqa: E731
    check_slice(bhnd(q), bhnd(k), bhnd(v), bhnd(dout), bhnd(out), [bhnd(g) for g in grads], scale=d ** -0.5, causal=True)


# --------------------------------------------------------------------------- #
# Dropout in a CUDA graph
# --------------------------------------------------------------------------- #
def test_next_philox_state_peeks_the_draw_of_the_next_call(device):
    """next_philox_state does not advance the generator and names the exact [seed, offset] the
    next dropout call draws on the device (the state the keep-mask tests rebuild)."""
    from flashtile.ops.autograd import next_philox_state

    q, k, v = (torch.randn(1, 1, 16, 16, device=device) for _ in range(3))
    peek = next_philox_state(device)
    assert next_philox_state(device) == peek
    _, _, rng = attention(q, k, v, seq_major=False, softmax_scale=0.25, causal=False, window=(-1, -1), dropout_p=0.5)
    assert rng.device.type == torch.device(device).type and rng.dtype == torch.int64
    assert tuple(rng.tolist()) == peek
    assert next_philox_state(device) != peek


@pytest.mark.gpu
def test_dropout_fwd_bwd_captured_in_cuda_graph():
    """Forward and backward with dropout captured once, replayed twice: every replay draws a
    new [seed, offset] on the device (so the two replays differ), and each replay's output and
    gradients are those of the float64 oracle under the keep-mask of the state it drew."""
    b, h, n, d, p = 2, 2, 64, 32, 0.3
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", generator=gen) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    scale = d ** -0.5

    def step():
        out, _, rng = attention(q, k, v, seq_major=False, softmax_scale=scale, causal=False, window=(-1, -1),
                                dropout_p=p)
        return (out, rng, *torch.autograd.grad(out, (q, k, v), dout))

    graph, static = capture(step, warmup=2)

    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replays.append([x.clone() for x in static])
    assert not torch.equal(replays[0][1], replays[1][1]), "a replay must draw a new Philox state"
    assert not torch.equal(replays[0][0], replays[1][0])
    for out, rng, dq, dk, dv in replays:
        seed, offset = rng.tolist()
        keep = dropout_keep_mask(seed, offset, b, h, n, n, p, "cuda")
        assert 0.5 < keep.float().mean().item() < 0.9
        # fp32 inputs run the products in TF32 (u = 2^-11); a gradient passes three chained products: 2x the table
        check_slice(q, k, v, dout, out, (dq, dk, dv), grad_tol=4e-3, scale=scale, keep=keep, dropout_p=p)


@pytest.mark.gpu
def test_dropout_public_api_captures_and_never_syncs():
    """scaled_dot_product_attention with dropout: eager forward + backward make no host sync
    (sync debug mode "error" raises on one), and a captured call replays with new randomness."""
    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))

    def step():
        out = flashtile.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
        return (out, *torch.autograd.grad(out.float().sum(), (q, k, v)))

    step()  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph, static = capture(step)
    graph.replay()
    first = [x.clone() for x in static]
    graph.replay()
    torch.cuda.synchronize()
    for a, c in zip(first, static):
        assert torch.isfinite(a).all()
        assert not torch.equal(a, c)
