"""In-process checks of the ring's pieces: step plans, shard layouts, the LSE merge, argument errors
and torch.compile, on a one-rank gloo group (no spawning)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from flashtile.distributed.plan import LAYOUTS, Call, segments, step_plan, visible_pairs
from flashtile.distributed.sharding import shard_sequence, unshard_sequence
from flashtile.reference.ring import shard_positions
from tests._oracle import assert_close


def _positions(layout, world, rank, n):
    pos = [0] * n
    for g, loc, ln in segments(layout, world, rank, n):
        pos[loc:loc + ln] = range(g, g + ln)
    return pos


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_step_plans_cover_every_visible_pair_once(layout):
    for world in (1, 2, 3, 4):
        for nq, nk in ((4, 4), (6, 6), (2, 6), (6, 2), (5, 5), (3, 7)):
            if layout == "zigzag" and (nq % 2 or nk % 2):
                continue
            for left in (-1, 0, 1, 3, 9):
                for right in (-1, 0, 2):
                    shift = world * (nk - nq)
                    for rank in range(world):
                        for src in range(world):
                            qp, kp = _positions(layout, world, rank, nq), _positions(layout, world, src, nk)
                            want = sorted(
                                (i, j) for i in range(nq) for j in range(nk)
                                if (left < 0 or kp[j] - qp[i] >= shift - left)
                                and (right < 0 or kp[j] - qp[i] <= shift + right)
                            )
                            got = sorted(p for c in step_plan(layout, world, rank, src, nq, nk, left, right)
                                         for p in visible_pairs(c))
                            assert got == want, (layout, world, nq, nk, left, right, rank, src)


def test_plain_causal_zigzag_is_one_equal_call_per_step():
    for world in (2, 4, 8):
        for rank in range(world):
            plans = [step_plan("zigzag", world, rank, src, 8, 8, -1, 0) for src in range(world)]
            assert all(len(p) == 1 for p in plans)
            off_diagonal = [p[0] for src, p in enumerate(plans) if src != rank]
            assert {(c.r1 - c.r0) * (c.c1 - c.c0) for c in off_diagonal} == {32}  # half of the 8 x 8 block
            assert all(c.wl == c.wr == -1 for c in off_diagonal)


def test_shard_layouts_agree_with_the_reference_and_round_trip():
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    for layout in ("zigzag", "contiguous"):
        shards = [shard_sequence(x, (r, 4), layout=layout) for r in range(4)]
        for r, s in enumerate(shards):
            assert torch.equal(s, x[:, shard_positions(24, 4, r, layout)])
        assert torch.equal(unshard_sequence(shards, layout=layout), x)
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_sequence(x[:, :20], (0, 4), layout="zigzag")
    with pytest.raises(ValueError, match="layout"):
        shard_sequence(x, (0, 4), layout="striped")
    with pytest.raises(ValueError, match="rank"):
        shard_sequence(x, (4, 4))


def test_packed_shards_round_trip_and_refuse_bad_lengths():
    """Every sequence of a packed batch sharded as one sequence is; local cu_seqlens 1 / P of the global ones."""
    from flashtile.distributed import shard_packed, unshard_packed

    lens = [16, 0, 8, 24]
    cu = torch.tensor([0, 16, 16, 24, 48], dtype=torch.int32)
    x = torch.arange(48 * 3).view(48, 3)
    for layout in ("zigzag", "contiguous"):
        shards = [shard_packed(x, cu, (r, 2), layout=layout) for r in range(2)]
        for r, (s, local) in enumerate(shards):
            assert local.dtype == torch.int32 and local.tolist() == [0, 8, 8, 12, 24]
            starts = [0, 16, 16, 24]
            want = torch.cat([x[a:a + n][shard_positions(n, 2, r, layout)] for a, n in zip(starts, lens)])
            assert torch.equal(s, want)
        assert torch.equal(unshard_packed([s for s, _ in shards], shards[0][1], layout=layout), x)
    with pytest.raises(ValueError, match="shards must have one shape"):
        unshard_packed([shards[0][0], shards[1][0][:-2]], shards[0][1])
    with pytest.raises(ValueError, match=r"sequence 2\).*multiple of 4"):
        shard_packed(x[:46], torch.tensor([0, 16, 16, 22, 46], dtype=torch.int32), (0, 2))
    with pytest.raises(ValueError, match="end at the packed length 48"):
        shard_packed(x, torch.tensor([0, 16, 40], dtype=torch.int32), (0, 2))
    with pytest.raises(ValueError, match="never decrease"):
        shard_packed(x, torch.tensor([0, 24, 16, 48], dtype=torch.int32), (0, 2))
    with pytest.raises(TypeError, match="int32"):
        shard_packed(x, cu.long(), (0, 2))


def test_packed_ring_refusals_name_the_argument():
    """Checked before any communication: every rank raises the same error without a collective."""
    from flashtile.distributed import ring_flash_attn_varlen_func

    q, k = torch.zeros(12, 2, 16), torch.zeros(12, 1, 16)
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    call = lambda *a, **kw: ring_flash_attn_varlen_func(*(a or (q, k, k, cu, cu, 8, 8)), **kw)  # noqa: E731
    for args, kw, err, word in [
        ((q, k, k, cu.long(), cu, 8, 8), {}, TypeError, "cu_seqlens_q"),
        ((q, k, k, cu, cu, 8, "8"), {}, TypeError, "max_seqlen_k"),
        ((q, k, k, torch.tensor([0, 4, 10], dtype=torch.int32), cu, 8, 8), {}, ValueError, "cu_seqlens_q"),
        ((q.view(12, 32), k, k, cu, cu, 8, 8), {}, ValueError, "q must be 3-D"),
        ((), dict(layout="striped"), ValueError, "layout"),
        ((), dict(window_size=(2,)), ValueError, "window_size"),
    ]:
        with pytest.raises(err, match=word):
            call(*args, **kw)
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        call()  # the arguments pass: the group comes next


def test_packed_schedule_covers_every_visible_pair_once():
    """Every (query, key) pair the mask lets through, of every sequence, is computed by exactly one packed call of
    one step (and no pair across sequences, no row or column twice in a call), on random lengths (empty ones
    too), layouts, 1-4 ranks, windows and causal."""
    import collections
    import random

    from flashtile.distributed.ring_varlen import _schedule

    rng = random.Random(0)

    def positions(layout, world, rank, lens):  # (sequence, global position) of each local packed row
        out = []
        for s, n in enumerate(lens):
            pos = [0] * n
            for g, loc, ln in segments(layout, world, rank, n):
                pos[loc:loc + ln] = range(g, g + ln)
            out += [(s, p) for p in pos]
        return out

    for _ in range(60):
        layout, world = rng.choice(LAYOUTS), rng.randint(1, 4)
        step = 2 if layout == "zigzag" else 1
        lq, lk = ([step * rng.randint(0, 3) for _ in range(3)] for _ in range(2))
        causal = rng.random() < 0.4
        left, right = rng.choice([-1, 0, 1, 3, 7]), 0 if causal else rng.choice([-1, 0, 2, 5])
        for rank in range(world):
            seen, want = collections.Counter(), collections.Counter()
            gq = positions(layout, world, rank, lq)
            for t, calls in enumerate(_schedule(layout, world, rank, tuple(lq), tuple(lk), left, right, "cpu")):
                gk = positions(layout, world, (rank - t) % world, lk)
                for c in calls:
                    rows = range(len(gq)) if c.rows is None else c.rows.tolist()
                    cols = range(len(gk)) if c.cols is None else c.cols.tolist()
                    assert len(set(rows)) == len(rows) and len(set(cols)) == len(cols)
                    cq, ck = c.cu_q.tolist(), c.cu_k.tolist()
                    for m in range(len(cq) - 1):
                        sub = Call(cq[m], cq[m + 1], ck[m], ck[m + 1], c.wl, c.wr)
                        for i, j in visible_pairs(sub):
                            a, b = gq[rows[i]], gk[cols[j]]
                            assert a[0] == b[0], "a pair across sequences"
                            seen[(a, b)] += 1
            for (s, qp) in gq:
                nq, nk = world * lq[s], world * lk[s]
                for kp in range(nk):
                    d = kp - qp
                    if (left < 0 or d >= nk - nq - left) and (right < 0 or d <= nk - nq + right):
                        want[((s, qp), (s, kp))] += 1
            assert seen == want, (layout, world, rank, lq, lk, left, right)


def test_packed_ulysses_refusals_name_the_argument():
    """Checked before any communication, as the packed ring's."""
    from flashtile.distributed import ulysses_flash_attn_varlen_func

    q, k = torch.zeros(12, 2, 16), torch.zeros(12, 1, 16)
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    call = lambda **kw: ulysses_flash_attn_varlen_func(q, k, k, cu, cu, 8, 8, **kw)  # noqa: E731
    for kw, err, word in [(dict(layout="striped"), ValueError, "layout"),
                          (dict(dropout_p=1.0), ValueError, "dropout_p"), (dict(softcap=-1.0), ValueError, "softcap"),
                          (dict(alibi_slopes=torch.zeros(3)), ValueError, "alibi_slopes"),
                          (dict(return_lse=1), TypeError, "return_lse")]:
        with pytest.raises(err, match=word):
            call(**kw)
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        call()


def test_merge_partial_is_the_exact_lse_merge_and_never_nan():
    from flashtile.distributed.ring import merge_partial_

    g = torch.Generator().manual_seed(0)
    out_a, out_b = (torch.randn(1, 4, 2, 8, generator=g) for _ in range(2))
    lse_a, lse_b = (torch.randn(1, 2, 4, generator=g) for _ in range(2))
    inf = math.inf
    lse_a[0, 0, :2], lse_b[0, 0, 1:3] = -inf, -inf  # row 1: both empty; row 0: a empty; row 2: b empty
    out_a[0, :2, 0], out_b[0, 1:3, 0] = 0.0, 0.0
    lse = torch.logaddexp(lse_a.double(), lse_b.double())
    safe = torch.where(lse == -inf, 0.0, lse)
    w = lambda l: torch.exp(l.double() - safe).transpose(1, 2).unsqueeze(-1)  # noqa: E731
    want = w(lse_a) * out_a.double() + w(lse_b) * out_b.double()
    out, got_lse = out_a.clone(), lse_a.clone()
    merge_partial_(out, got_lse, out_b, lse_b)
    assert not out.isnan().any()
    assert_close(out, want, what="out")
    assert_close(got_lse, lse, what="lse")


@pytest.fixture(scope="module")
def one_rank():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _qkv(n=8, hq=2, hk=2, requires_grad=False):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(1, n, h, 16, generator=g).requires_grad_(requires_grad) for h in (hq, hk, hk)]


def test_one_rank_equals_flash_attn_func_and_compiles_with_a_graph_break(one_rank):
    from flashtile import flash_attn_func
    from flashtile.distributed import ring_flash_attn_func

    q, k, v = _qkv(requires_grad=True)
    fn = lambda q, k, v: ring_flash_attn_func(q, k, v, one_rank, causal=True) * 2  # noqa: E731
    out = torch.compile(fn, backend="eager")(q, k, v)
    out.sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    want = flash_attn_func(q, k, v, causal=True) * 2
    want.sum().backward()
    assert_close(out, want, what="out")
    for name, a, x in zip("qkv", grads, (q, k, v)):
        assert_close(a, x.grad, what=f"d{name}")


def test_packed_ring_refusals_after_the_agreement(one_rank):
    """The packed ring's dropout and ALiBi refusals come after the ranks' agreement (one rank raising alone would
    leave the others waiting): on a group they name the argument."""
    from flashtile.distributed import ring_flash_attn_varlen_func

    q, k = torch.zeros(12, 2, 16), torch.zeros(12, 1, 16)
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        ring_flash_attn_varlen_func(q, k, k, cu, cu, 8, 8, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        ring_flash_attn_varlen_func(q, k, k, cu, cu, 8, 8, alibi_slopes=torch.zeros(2))


def test_argument_errors_name_the_argument(one_rank):
    from flashtile.distributed import ring_flash_attn_func, ulysses_flash_attn_func

    q, k, v = _qkv()
    with pytest.raises(ValueError, match="layout"):
        ring_flash_attn_func(q, k, v, layout="striped")
    with pytest.raises(ValueError, match="q: a zigzag shard"):
        ring_flash_attn_func(*_qkv(n=7))
    with pytest.raises(ValueError, match="dropout_p"):
        ring_flash_attn_func(q, k, v, dropout_p=1.0)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        ring_flash_attn_func(q, k, v, alibi_slopes=torch.ones(2))
    with pytest.raises(TypeError, match="group"):
        ring_flash_attn_func(q, k, v, group="world")
    with pytest.raises(TypeError, match="k must have dtype"):
        ring_flash_attn_func(q, k.double(), v)
    with pytest.raises(ValueError, match="window_size"):
        ring_flash_attn_func(q, k, v, window_size=(-2, 0))
    with pytest.raises(TypeError, match="deterministic"):
        ring_flash_attn_func(q, k, v, deterministic=1)
    with pytest.raises(ValueError, match="layout"):
        ulysses_flash_attn_func(q, k, v, layout="striped")


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, window_size=(300, 0)), dict(),
                                dict(causal=True, dropout_p=0.1)], ids=["causal", "window", "full", "dropout"])
def test_one_rank_on_gpu_bf16(one_rank, kw):
    """The compiled kernels through the ring's entry points (forward with a given Philox state, backward
    into float32 buffers), B=2, N=2048, Hq=8, Hk=2, d=128 bf16: as accurate as flash_attn_func."""
    from flashtile import flash_attn_func
    from flashtile.distributed import ring_flash_attn_func
    from flashtile.ops.autograd import next_philox_state
    from flashtile.runtime.common import dropout_keep_mask
    from tests._oracle import attention_ref_grads

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(2, 2048, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                     for h in (8, 2, 2, 8))
    seed, offset = next_philox_state("cuda")
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = ring_flash_attn_func(*leaves, one_rank, **kw)
    out.backward(dout)
    ring = (out, *(x.grad for x in leaves))
    p = kw.get("dropout_p", 0.0)
    keep = dropout_keep_mask(seed, offset, 2, 8, 2048, 2048, p, "cuda") if p else None
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    ref = attention_ref_grads(t(q), t(k), t(v), t(dout), causal=kw.get("causal", False),
                              window=kw.get("window_size", (-1, -1)), keep=keep, dropout_p=p)
    ref = (t(ref[0]), *(t(x) for x in ref[2:]))
    err = lambda a, r: float((a.detach().double() - r).abs().max() / r.abs().max())  # noqa: E731
    if not p:  # flash_attn_func would draw another mask
        for x in leaves:
            x.grad = None
        single_out = flash_attn_func(*leaves, **kw)
        single_out.backward(dout)
        single = (single_out, *(x.grad for x in leaves))
        for what, a, s, r in zip(("out", "dq", "dk", "dv"), ring, single, ref):
            assert err(a, r) <= 1.5 * err(s, r) + 1e-3, f"{what}: {err(a, r):.2e} vs flash_attn_func {err(s, r):.2e}"
    for what, a, r in zip(("out", "dq", "dk", "dv"), ring, ref):
        assert err(a, r) <= 1.5e-2, f"{what}: {err(a, r):.2e}"
