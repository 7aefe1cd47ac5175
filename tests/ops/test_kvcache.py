"""Tests of ``flash_attn_with_kvcache`` (flashtile/ops/kvcache.py): append then attend.

Oracle: :func:`tests._oracle.attention_ref` (dense float64, independent of flashtile)
with per-element lengths ``lens = cache_seqlens + Nnew``, so causal / window / ALiBi are
bottom-right aligned per element.  Tolerances are the table of :mod:`tests._oracle`
(fp32 in the interpreter 2e-5).
"""

from __future__ import annotations

import math

import pytest
import torch
from tests._cuda import capture
from tests._oracle import assert_close, attention_ref

from flashtile.ops.kvcache import check_errors, flash_attn_with_kvcache
from flashtile.runtime.decode import MAX_SPLITS


def oracle(q, k_full, v_full, lens, *, causal, window=(-1, -1), softcap=0.0, alibi=None):
    """q (B, Nq, Hq, d), k_full / v_full (B, N, Hk, d) holding each element's keys in [0, lens[b]): (out (B, Nq, Hq, d), lse)."""
    lens = torch.as_tensor(lens).cpu().long()
    # slots at or past lens[b] are never read: zero them so a NaN guard there cannot reach the oracle's 0 * v
    unused = (torch.arange(k_full.shape[1]).view(1, -1) >= lens.view(-1, 1)).view(*lens.shape, -1, 1, 1)
    k64, v64 = (x.detach().cpu().double().masked_fill(unused, 0.0).transpose(1, 2) for x in (k_full, v_full))
    o, l = attention_ref(
        q.detach().cpu().double().transpose(1, 2), k64, v64, lens=lens,
        scale=q.shape[-1] ** -0.5, causal=causal, window=window, softcap=softcap,
        alibi=None if alibi is None else alibi.double().cpu(),
    )
    return o.transpose(1, 2), l


def rand(*shape, device, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def scattered_pool(b, max_pages, page_size, hk, d, device, spare=2, seed=0):
    """A page pool with random contents and a block table whose pages are a random permutation."""
    total = b * max_pages + spare
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[: b * max_pages]
    table = perm.view(b, max_pages).to(device=device, dtype=torch.int32)
    k_pool = rand(total, page_size, hk, d, device=device, seed=seed + 1)
    v_pool = rand(total, page_size, hk, d, device=device, seed=seed + 2)
    return k_pool, v_pool, table


def logical(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The contiguous view (B, max_pages * page_size, Hk, d) of a paged pool."""
    b, pages = table.shape
    return pool[table.long()].reshape(b, pages * pool.shape[1], *pool.shape[2:])


# --------------------------------------------------------------------------- #
# append + attend
# --------------------------------------------------------------------------- #
def test_append_contiguous(device):
    b, n, hq, hk, d, n_new = 3, 48, 4, 2, 32, 2
    k_cache, v_cache = rand(b, n, hk, d, device=device, seed=1), rand(b, n, hk, d, device=device, seed=2)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k_new, v_new = rand(b, n_new, hk, d, device=device, seed=3), rand(b, n_new, hk, d, device=device, seed=4)
    q = rand(b, n_new, hq, d, device=device, seed=5)
    lens = torch.tensor([5, 0, 46], dtype=torch.int32, device=device)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, num_splits=2, return_lse=True,
                                       causal=True)
    # the cache holds the new rows at [L_b, L_b + Nnew) and nothing else changed
    expect_k, expect_v = before_k.clone(), before_v.clone()
    for i, length in enumerate(lens.tolist()):
        expect_k[i, length : length + n_new] = k_new[i]
        expect_v[i, length : length + n_new] = v_new[i]
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    assert torch.equal(lens.cpu(), torch.tensor([5, 0, 46], dtype=torch.int32)), "cache_seqlens is not advanced"
    ref_out, ref_lse = oracle(q, expect_k, expect_v, [l + n_new for l in lens.tolist()], causal=True)
    assert_close(out, ref_out, torch.float32, device, "out")
    assert_close(lse, ref_lse, torch.float32, device, "lse")


@pytest.mark.parametrize("page_size", [16, 32])
def test_append_paged(device, page_size):
    """New tokens cross a page boundary; pages are scattered; GQA Hq = 4 Hk."""
    b, hq, hk, d, n_new, max_pages = 2, 8, 2, 16, 3, 4
    k_pool, v_pool, table = scattered_pool(b, max_pages, page_size, hk, d, device, seed=page_size)
    before_k, before_v = logical(k_pool, table), logical(v_pool, table)
    spare = torch.ones(k_pool.shape[0], dtype=torch.bool)
    spare[table.flatten().long().cpu()] = False
    spare_before = k_pool[spare.to(device)].clone()
    k_new, v_new = rand(b, n_new, hk, d, device=device, seed=7), rand(b, n_new, hk, d, device=device, seed=8)
    q = rand(b, 1, hq, d, device=device, seed=9)
    lens = torch.tensor([page_size - 1, 1], dtype=torch.int32, device=device)
    out = flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=lens, block_table=table, num_splits=3,
                                  causal=True)
    after_k, after_v = logical(k_pool, table), logical(v_pool, table)
    for i, length in enumerate(lens.tolist()):
        before_k[i, length : length + n_new] = k_new[i]
        before_v[i, length : length + n_new] = v_new[i]
    assert torch.equal(after_k, before_k) and torch.equal(after_v, before_v)
    assert torch.equal(k_pool[spare.to(device)], spare_before), "pages outside the block table were written"
    ref_out, _ = oracle(q, after_k, after_v, [l + n_new for l in lens.tolist()], causal=True)
    assert_close(out, ref_out, torch.float32, device, "out")


def test_int_and_none_seqlens_mqa_mods(device):
    """cache_seqlens as an int and as None (the full cache); MQA; window, softcap, ALiBi; no append."""
    b, n, hq, d = 2, 40, 4, 16
    k_cache, v_cache = rand(b, n, 1, d, device=device, seed=11), rand(b, n, 1, d, device=device, seed=12)
    q = rand(b, 2, hq, d, device=device, seed=13)
    alibi = torch.rand(b, hq, generator=torch.Generator().manual_seed(0)).to(device)
    kw = dict(causal=True, window_size=(9, 0), softcap=3.0, alibi_slopes=alibi)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=25, return_lse=True, **kw)
    ref_out, ref_lse = oracle(q, k_cache, v_cache, [25, 25], causal=True, window=(9, 0), softcap=3.0, alibi=alibi)
    assert_close(out, ref_out, torch.float32, device, "out (int cache_seqlens)")
    assert_close(lse, ref_lse, torch.float32, device, "lse (int cache_seqlens)")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, causal=False)
    ref_out, _ = oracle(q, k_cache, v_cache, [n, n], causal=False)
    assert_close(out, ref_out, torch.float32, device, "out (cache_seqlens=None)")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy reports the intended overflow
def test_unified_max_through_api(device):
    b, n, hq, hk, d = 2, 64, 4, 2, 32
    k_cache, v_cache = rand(b, n, hk, d, device=device, seed=21), rand(b, n, hk, d, device=device, seed=22)
    q = rand(b, 1, hq, d, device=device, seed=23)
    q[1] *= 200.0  # element 1 leaves the safe range around phi = 0 and is recomputed
    lens = torch.tensor([60, 64], dtype=torch.int32, device=device)
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, unified_max=0.0, num_splits=2, return_softmax_lse=True, causal=True
    )
    ref_out, ref_lse = oracle(q, k_cache, v_cache, [60, 64], causal=True)
    assert_close(out, ref_out, torch.float32, device, "out")
    assert_close(lse, ref_lse, torch.float32, device, "lse")


def test_inputs_requiring_grad_run_without_autograd(device):
    q = rand(1, 1, 2, 16, device=device, seed=31).requires_grad_()
    k_cache, v_cache = rand(1, 16, 1, 16, device=device, seed=32), rand(1, 16, 1, 16, device=device, seed=33)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=16, causal=True)
    assert not out.requires_grad and out.grad_fn is None
    ref_out, _ = oracle(q.detach(), k_cache, v_cache, [16], causal=True)
    assert_close(out, ref_out, torch.float32, device, "out")


# --------------------------------------------------------------------------- #
# validation: every bad input raises before the cache is written (values inside
# tensor cache_seqlens / block_table: with debug=True; without it see test_kvcache_safety.py)
# --------------------------------------------------------------------------- #
def _base(device):
    b, hq, hk, d, page = 2, 4, 2, 16, 16
    k_pool, v_pool, table = scattered_pool(b, 2, page, hk, d, device, seed=40)
    q = rand(b, 1, hq, d, device=device, seed=41)
    k_new, v_new = rand(b, 1, hk, d, device=device, seed=42), rand(b, 1, hk, d, device=device, seed=43)
    lens = torch.tensor([3, 30], dtype=torch.int32, device=device)
    return dict(q=q, k_cache=k_pool, v_cache=v_pool, k=k_new, v=v_new, cache_seqlens=lens, block_table=table)


def _bad_table(a):
    t = a["block_table"].clone()
    t[1, 1] = a["k_cache"].shape[0]  # page 1 of element 1 is used (30 + 1 keys > 16)
    return t


BAD = [
    ("block_table", lambda a: dict(block_table=_bad_table(a), debug=True), ValueError),
    ("block_table", lambda a: dict(block_table=a["block_table"].long()), TypeError),
    ("block_table", lambda a: dict(block_table=a["block_table"][:1]), ValueError),
    ("cache too small", lambda a: dict(cache_seqlens=a["cache_seqlens"] + torch.tensor([0, 2], dtype=torch.int32)
                                       .to(a["q"].device), debug=True), ValueError),
    ("cache_seqlens", lambda a: dict(cache_seqlens=a["cache_seqlens"][:1]), ValueError),
    ("cache_seqlens", lambda a: dict(cache_seqlens=a["cache_seqlens"].float()), TypeError),
    (">= 0", lambda a: dict(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32, device=a["q"].device),
                            debug=True), ValueError),
    ("cache too small", lambda a: dict(cache_seqlens=2**32 + 5, k=None, v=None), ValueError),
    ("cache_seqlens", lambda a: dict(cache_seqlens=a["cache_seqlens"][:, None].expand(2, 2)), ValueError),
    ("cache_batch_idx", lambda a: dict(cache_batch_idx=torch.zeros(2, dtype=torch.int32)), ValueError),  # + block_table
    ("cache_leftpad", lambda a: dict(cache_leftpad=torch.zeros(2, dtype=torch.int32)), ValueError),  # + block_table
    ("rotary_interleaved", lambda a: dict(rotary_interleaved=1), TypeError),
    ("return_softmax_lse", lambda a: dict(return_softmax_lse=None), TypeError),
    ("debug", lambda a: dict(debug="yes"), TypeError),
    ("window_size", lambda a: dict(window_size=torch.tensor([1.0, 0.0])), ValueError),
    ("page_size", lambda a: dict(k_cache=a["k_cache"][:, :8], v_cache=a["v_cache"][:, :8]), ValueError),
    ("multiple of the heads", lambda a: dict(q=a["q"][:, :, :3]), ValueError),
    ("head_dim", lambda a: dict(q=a["q"][..., :8]), ValueError),
    ("dtype", lambda a: dict(q=a["q"].double()), TypeError),
    ("dtype of k_cache", lambda a: dict(k=a["k"].half(), v=a["v"].half()), TypeError),
    ("k and v", lambda a: dict(v=None), ValueError),
    ("seqlen_new", lambda a: dict(k=a["k"][:, :, :1], v=a["v"][:, :, :1]), ValueError),
    ("same dtype", lambda a: dict(q=a["q"].half()), TypeError),
    ("num_splits", lambda a: dict(num_splits=-1), ValueError),
    ("num_splits", lambda a: dict(num_splits=MAX_SPLITS + 1), ValueError),
    ("unified_max", lambda a: dict(unified_max=math.nan), ValueError),
    ("unified_max", lambda a: dict(unified_max=math.inf), ValueError),
    ("window_size", lambda a: dict(window_size=(-2, 0)), ValueError),
    ("alibi_slopes", lambda a: dict(alibi_slopes=torch.ones(3, device=a["q"].device)), ValueError),
]


@pytest.mark.parametrize("match, change, exc", BAD, ids=[f"{i}-{m}" for i, (m, _, _) in enumerate(BAD)])
def test_bad_inputs_raise_before_writing(device, match, change, exc):
    args = _base(device)
    snapshot = (args["k_cache"].clone(), args["v_cache"].clone())
    args.update(change(args))
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**args)
    pool_k = args["k_cache"] if args["k_cache"].shape == snapshot[0].shape else None
    if pool_k is not None:
        assert torch.equal(pool_k, snapshot[0]) and torch.equal(args["v_cache"], snapshot[1])


def test_debug_reads_values_every_call(device):
    """With debug=True the values of cache_seqlens / block_table are read on every call (no memo):
    an in-place change to either, however it was made, raises before anything is written."""
    args = _base(device)
    args["debug"] = True
    args.pop("k"), args.pop("v")
    flash_attn_with_kvcache(**args)
    snapshot = args["k_cache"].clone()
    args["cache_seqlens"].data[1] = args["block_table"].shape[1] * args["k_cache"].shape[1] + 1
    with pytest.raises(ValueError, match="cache too small"):
        flash_attn_with_kvcache(**args)
    args["cache_seqlens"].data[1] = 30
    flash_attn_with_kvcache(**args)
    args["block_table"].data[1, 1] = args["k_cache"].shape[0]
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"], snapshot)
    check_errors()  # nothing was launched with the bad values


@pytest.mark.parametrize(
    "change, exc",
    [
        (dict(causal=1), TypeError),  # 1 == True and hashes alike: the memo keys on the type too
        (dict(window_size=(3.0, 0)), ValueError),
        (dict(softmax_scale=True), TypeError),
        (dict(softcap=-1.0), ValueError),
        (dict(num_splits=False), ValueError),
        (dict(window_size=[3, 0]), None),  # a list is accepted (checked in full, not memoised)
    ],
)
def test_signature_memo_still_checks_every_argument(device, change, exc):
    """Checks run once per call signature; a call that differs in any checked argument,
    its type included, is checked again (and fails or passes as it would alone)."""
    args = _base(device)
    args.pop("k"), args.pop("v")
    args["window_size"] = (3, 0)
    first = flash_attn_with_kvcache(**args)
    assert torch.equal(flash_attn_with_kvcache(**args), first)  # memo hit, same answer
    args.update(change)
    if exc is None:
        torch.testing.assert_close(flash_attn_with_kvcache(**args), first, rtol=0, atol=0)
    else:
        with pytest.raises(exc):
            flash_attn_with_kvcache(**args)


def test_signature_memo_int_seqlens_value(device):
    """An int cache_seqlens is part of the signature by value: a too-large one still raises."""
    q = rand(2, 1, 2, 16, device=device, seed=52)
    k_cache = rand(2, 32, 1, 16, device=device, seed=53)
    v_cache = rand(2, 32, 1, 16, device=device, seed=54)
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=20)
    with pytest.raises(ValueError, match="cache too small"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=33)


def test_contiguous_cache_batch_mismatch(device):
    q = rand(2, 1, 2, 16, device=device, seed=50)
    k_cache = rand(3, 16, 1, 16, device=device, seed=51)
    with pytest.raises(ValueError, match="batch of k_cache"):
        flash_attn_with_kvcache(q, k_cache, k_cache.clone(), cache_seqlens=4)


# --------------------------------------------------------------------------- #
# GPU
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@pytest.mark.parametrize("batch, cache", [(1, 16384), (8, 4096)])
def test_gpu_decode_step_paged(batch, cache):
    """One decoding step at realistic sizes: bf16, Hq 32, Hk 8, d 128, page 256, append 1 token."""
    hq, hk, d, page = 32, 8, 128, 256
    pages = cache // page
    k_pool, v_pool, table = scattered_pool(batch, pages, page, hk, d, "cuda", seed=batch)
    k_pool, v_pool = k_pool.bfloat16(), v_pool.bfloat16()
    q = rand(batch, 1, hq, d, device="cuda", seed=1).bfloat16()
    k_new = rand(batch, 1, hk, d, device="cuda", seed=2).bfloat16()
    v_new = rand(batch, 1, hk, d, device="cuda", seed=3).bfloat16()
    lens = torch.full((batch,), cache - 1, dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=lens, block_table=table)
    ref, _ = oracle(q, logical(k_pool, table), logical(v_pool, table), [cache] * batch, causal=False)
    assert_close(out, ref, what="out")


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    """A decoding step captured in a CUDA graph: each replay appends the token written into the
    static k/v buffers at the length written into the static cache_seqlens, and matches eager."""
    batch, cache, hq, hk, d, page = 4, 2048, 32, 8, 128, 256
    k_pool, v_pool, table = scattered_pool(batch, cache // page, page, hk, d, "cuda", seed=7)
    k_pool, v_pool = k_pool.bfloat16(), v_pool.bfloat16()
    q, k_new, v_new = (rand(batch, 1, h, d, device="cuda", seed=s).bfloat16() for h, s in ((hq, 8), (hk, 9), (hk, 10)))
    lens = torch.tensor([100, 700, 1500, 2000], dtype=torch.int32, device="cuda")

    def step():
        return flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=lens, block_table=table)

    def step_pp():  # FlashDecoding++ over the same cache, new token included; its fallback stays on the device
        return flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lens + 1, block_table=table, unified_max=0.0)

    graph, (static_out, static_pp) = capture(lambda: (step(), step_pp()))
    for t in range(3):  # new inputs written into the captured buffers, as a serving loop does
        new_q = rand(batch, 1, hq, d, device="cuda", seed=20 + t)
        if t == 1:
            new_q[1] *= 300.0  # element 1's scores leave the unified max's range: its splits fall back
        q.copy_(new_q)
        k_new.copy_(rand(batch, 1, hk, d, device="cuda", seed=30 + t))
        lens += 1
        graph.replay()
        k_snapshot, v_snapshot = k_pool.clone(), v_pool.clone()
        eager = flash_attn_with_kvcache(q, k_snapshot, v_snapshot, k_new, v_new, cache_seqlens=lens, block_table=table)
        assert torch.equal(k_snapshot, k_pool) and torch.equal(v_snapshot, v_pool)  # same append, same place
        assert torch.equal(static_out, eager)
        assert torch.equal(static_pp, step_pp())
        ref, _ = oracle(q, logical(k_pool, table), logical(v_pool, table), (lens + 1).tolist(), causal=False)
        assert_close(static_out, ref, torch.bfloat16, "cuda", f"replay {t} vs float64 oracle")
        assert_close(static_pp, ref, torch.bfloat16, "cuda", f"replay {t} (FlashDecoding++) vs float64 oracle")
        err = (static_pp.float() - eager.float()).abs().max() / eager.float().abs().max()
        assert err < 1e-2, f"replay {t}: FlashDecoding++ vs safe, max error {err:.2e}"


@pytest.mark.gpu
def test_gpu_misaligned_q_after_aligned_calls():
    """The kernels are bound once per signature and launched directly after; a q that starts
    2 bytes off a 16-byte boundary (same shape and strides) must not reuse a kernel compiled
    for aligned addresses: every call matches the reference."""
    b, n, hq, hk, d = 2, 3000, 32, 8, 128
    k = rand(b, n, hk, d, device="cuda", seed=60).bfloat16()
    v = rand(b, n, hk, d, device="cuda", seed=61).bfloat16()
    lens = torch.tensor([2999, 1234], dtype=torch.int32, device="cuda")
    buf = rand(b * hq * d + 8, device="cuda", seed=62).bfloat16()
    for offset in (0, 0, 1, 1, 0):
        q = buf[offset : offset + b * hq * d].view(b, 1, hq, d)
        out = flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
        ref, _ = oracle(q, k, v, lens, causal=False)
        assert_close(out, ref, what=f"offset {offset}")


def test_int_cache_seqlens_checked_every_call_without_growing_the_memo(device):
    """A decoding loop that advances an int cache_seqlens reuses one memo entry, and a value out of range
    after valid calls of the same signature still raises before anything is written."""
    from flashtile.ops import kvcache

    q = rand(1, 1, 2, 16, device=device, seed=1)
    kc, vc = (rand(1, 24, 2, 16, device=device, seed=s) for s in (2, 3))
    before = len(kvcache._CALLS)
    outs = [flash_attn_with_kvcache(q, kc, vc, cache_seqlens=n, causal=True) for n in range(1, 9)]
    assert len(kvcache._CALLS) <= before + 1
    ref, _ = oracle(q, kc, vc, [8], causal=True)
    assert_close(outs[-1], ref, torch.float32, device, "out (int cache_seqlens = 8)")
    for bad in (25, -1):
        with pytest.raises(ValueError, match="cache_seqlens|cache too small"):
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=bad, causal=True)
