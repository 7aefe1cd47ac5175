"""flash_attn_varlen_func and its packed variants against the float64 oracle (tests/_oracle.py).

CPU: fp32 through Triton's interpreter on small packed batches that hold every edge at once:
zero-length q and k sequences, q longer and shorter than k (causal rows that see no key),
ragged tails, GQA.  GPU (``-m gpu``): large packed batches in bf16, many tiny sequences,
offsets past 2^31 elements.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests._oracle import assert_close, attention_varlen_ref, attention_varlen_ref_grads, rounding_slack

from flashtile.ops import (
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    next_philox_state,
)
from flashtile.ops.kvcache import check_errors
from flashtile.reference.varlen import varlen_attention
from flashtile.runtime.common import dropout_keep_mask

# per-sequence (L_q, L_k): empty q, empty k, q longer than k (causal rows with no key), one-row q
LENS_Q = [5, 0, 37, 16, 1, 20]
LENS_K = [9, 4, 20, 0, 30, 20]


def _cu(lens, device):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)


def _packed(lens_q, lens_k, hq, hk, d, device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hq, d, generator=gen).to(device, dtype)
    k, v = (torch.randn(sum(lens_k), hk, d, generator=gen).to(device, dtype) for _ in range(2))
    dout = torch.randn(sum(lens_q), hq, d, generator=gen).to(device, dtype)
    return q, k, v, dout


def _run(q, k, v, dout, cu_q, cu_k, max_q, max_k, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **kw)
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def _check(got, want, dtype, device, slack=(0.0, 0.0, 0.0)):
    """out, lse, then dq, dk, dv relative to the largest oracle gradient (a row with one visible key has
    dq 0 up to rounding of terms that size), plus ``slack`` (:func:`rounding_slack`: O stored in ``dtype``)."""
    size = max((float(w.abs().max()) for w in want[2:] if w.numel()), default=0.0)
    for i, (name, a, b) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), got, want)):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        if i < 2:
            assert_close(a, b, dtype if name != "lse" else torch.float32, device, name)
        else:
            assert_close(a, b, dtype, device, name, magnitude=size, slack=slack[i - 2])


CASES = {
    "plain": ({}, {}),
    "causal": ({"causal": True}, {"causal": True}),
    "window_softcap_alibi_batch": (
        {"window_size": (7, 3), "softcap": 3.0}, {"window": (7, 3), "softcap": 3.0}
    ),
    "causal_alibi_heads": ({"causal": True, "window_size": (9, -1)}, {"causal": True, "window": (9, 0)}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_varlen_matches_oracle(case, device):
    kw, ref_kw = CASES[case]
    hq, hk, d = 4, 2, 24
    q, k, v, dout = _packed(LENS_Q, LENS_K, hq, hk, d, device)
    cu_q, cu_k = _cu(LENS_Q, device), _cu(LENS_K, device)
    if "alibi" in case:
        shape = (len(LENS_Q), hq) if case.endswith("batch") else (hq,)
        kw["alibi_slopes"] = ref_kw["alibi"] = torch.rand(shape, generator=torch.Generator().manual_seed(3)).to(device)
    got = _run(q, k, v, dout, cu_q, cu_k, max(LENS_Q), max(LENS_K), **kw)
    want = attention_varlen_ref_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), cu_q.cpu(), cu_k.cpu(),
                                      **{**ref_kw, "alibi": None if "alibi" not in ref_kw else ref_kw["alibi"].cpu()})
    _check(got, want, torch.float32, device)


def test_varlen_empty_rows_and_sequences(device):
    """Causal rows with no visible key (L_q > L_k), zero-length k: out 0, LSE -inf, dq 0, never NaN;
    keys of a sequence with no query get dk = dv = 0."""
    q, k, v, dout = _packed(LENS_Q, LENS_K, 2, 2, 16, device)
    cu_q, cu_k = _cu(LENS_Q, device), _cu(LENS_K, device)
    out, lse, dq, dk, dv = _run(q, k, v, dout, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=True)
    rows = torch.zeros(sum(LENS_Q), dtype=torch.bool)
    for b, (lq, lk) in enumerate(zip(LENS_Q, LENS_K)):
        rows[int(cu_q[b]) : int(cu_q[b]) + max(lq - lk, 0)] = True  # causal bottom-right: the first Lq - Lk rows
    assert rows.any()
    assert torch.equal(out.cpu()[rows], torch.zeros_like(out.cpu()[rows]))
    assert torch.isneginf(lse.cpu()[:, rows]).all() and torch.isfinite(lse.cpu()[:, ~rows]).all()
    assert torch.equal(dq.cpu()[rows], torch.zeros_like(dq.cpu()[rows]))
    keys = slice(int(cu_k[1]), int(cu_k[2]))  # sequence 1: four keys, no query
    assert torch.equal(dk.cpu()[keys], torch.zeros_like(dk.cpu()[keys]))
    assert torch.equal(dv.cpu()[keys], torch.zeros_like(dv.cpu()[keys]))
    for x in (out, dq, dk, dv):
        assert torch.isfinite(x).all()


def test_varlen_dropout_under_kernel_keep_mask(device):
    """Dropout is compared under the kernel's own keep-mask: counters laid out as a (B, H,
    max_seqlen_q, max_seqlen_k) batch, sequence b reading the top-left corner of its slice."""
    lq, lk, p = [12, 0, 30], [20, 7, 25], 0.3
    q, k, v, dout = _packed(lq, lk, 2, 1, 16, device, seed=4)
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)
    seed, offset = next_philox_state(device)
    keep = dropout_keep_mask(seed, offset, len(lq), 2, max(lq), max(lk), p, device).cpu()
    got = _run(q, k, v, dout, cu_q, cu_k, max(lq), max(lk), dropout_p=p, causal=True)
    want = attention_varlen_ref_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), cu_q.cpu(), cu_k.cpu(),
                                      causal=True, keep=keep, dropout_p=p)
    _check(got, want, torch.float32, device)


def test_varlen_deterministic_backward_is_bitwise(device):
    q, k, v, dout = _packed([17, 33], [40, 9], 4, 2, 16, device, seed=5)
    cu_q, cu_k = _cu([17, 33], device), _cu([40, 9], device)
    a = _run(q, k, v, dout, cu_q, cu_k, 33, 40, deterministic=True)
    b = _run(q, k, v, dout, cu_q, cu_k, 33, 40, deterministic=True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    atomic = _run(q, k, v, dout, cu_q, cu_k, 33, 40)  # the atomic dQ path agrees within rounding
    for x, y in zip(a, atomic):
        assert_close(x, y, torch.float32, device)


def test_single_sequence_is_flash_attn_func(device):
    """One sequence packed = the fixed-length call on batch 1 (the same kernel, flag off there)."""
    q, k, v, dout = _packed([40], [24], 2, 1, 16, device, seed=6)
    got = _run(q, k, v, dout, _cu([40], device), _cu([24], device), 40, 24, causal=True)
    qf, kf, vf = (x.detach().clone().unsqueeze(0).requires_grad_() for x in (q, k, v))
    out, lse = flash_attn_func(qf, kf, vf, causal=True, return_lse=True)
    out.backward(dout.unsqueeze(0))
    for a, b in zip(got, (out[0], lse[0], qf.grad[0], kf.grad[0], vf.grad[0])):
        assert_close(a, b, torch.float32, device)


def test_many_tiny_sequences_and_loose_max_seqlen(device):
    """120 sequences of 0-3 tokens, max_seqlen larger than any real length (and than the totals)."""
    gen = torch.Generator().manual_seed(7)
    lq = torch.randint(0, 4, (120,), generator=gen).tolist()
    lk = torch.randint(0, 4, (120,), generator=gen).tolist()
    q, k, v, dout = _packed(lq, lk, 1, 1, 16, device, seed=8)
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)
    got = _run(q, k, v, dout, cu_q, cu_k, 64, 1000, causal=True)
    want = attention_varlen_ref_grads(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), cu_q.cpu(), cu_k.cpu(), causal=True)
    _check(got, want, torch.float32, device)


def test_packed_variants_share_storage_gradients(device):
    import flashtile

    for name in ("flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"):
        assert name in flashtile.__all__ and getattr(flashtile, name) is globals()[name]
    lens = [9, 0, 21]
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(sum(lens), 3, 2, 16, generator=gen).to(device).requires_grad_()
    cu = _cu(lens, device)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True)
    out.sum().backward()
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv.unbind(1))
    ref = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    ref.sum().backward()
    assert torch.equal(out, ref)
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], 1))
    kv = torch.stack([k.detach(), v.detach()], 1).requires_grad_()
    out2, lse, s = flash_attn_varlen_kvpacked_func(q.detach(), kv, cu, cu, max(lens), max(lens), causal=True,
                                                   return_attn_probs=True)
    assert torch.equal(out2, ref) and s is None and lse.shape == (2, sum(lens))


def test_paged_forward_matches_oracle(device):
    """Chunked prefill against a paged cache: new queries attend to cached + new keys through the block table."""
    lq, lk, page, hk = [7, 0, 19], [40, 16, 23], 16, 2
    gen = torch.Generator().manual_seed(10)
    n_pages = 12
    k_cache, v_cache = (torch.randn(n_pages, page, hk, 16, generator=gen).to(device) for _ in range(2))
    table = torch.randperm(n_pages, generator=gen)[:9].view(3, 3).to(torch.int32).to(device)
    q = torch.randn(sum(lq), 4, 16, generator=gen).to(device)
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)
    for kw in ({"causal": True}, {"window_size": (10, 2), "softcap": 2.0}):
        out, lse = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lq), max(lk), block_table=table,
                                          return_lse=True, debug=True, **kw)
        ref_kw = {"causal": kw.get("causal", False), "window": kw.get("window_size", (-1, -1)),
                  "softcap": kw.get("softcap", 0.0)}
        want = attention_varlen_ref(q.cpu(), k_cache.cpu(), v_cache.cpu(), cu_q.cpu(), cu_k.cpu(),
                                    block_table=table.cpu(), **ref_kw)
        _check((out, lse), want, torch.float32, device)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_varlen_func(q.requires_grad_(), k_cache, v_cache, cu_q, cu_k, max(lq), max(lk), block_table=table)


def test_strided_cu_seqlens_and_block_table(device):
    """cu_seqlens and block_table with the right values but not unit strides (a column of a wider tensor, a
    transposed copy, an expanded row) give the contiguous tensors' results: the kernels read them as contiguous."""
    lq, lk, page, hk = [7, 0, 19], [40, 16, 23], 16, 2
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache = (torch.randn(12, page, hk, 16, generator=gen).to(device) for _ in range(2))
    table = torch.randperm(12, generator=gen)[:9].view(3, 3).to(torch.int32).to(device)
    q = torch.randn(sum(lq), 4, 16, generator=gen).to(device)
    cu_q, cu_k = _cu(lq, device), _cu(lk, device)
    strided = lambda cu: torch.stack([cu, torch.full_like(cu, 10**6)], 1)[:, 0]  # noqa: E731 - stride 2, junk between
    want = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lq), max(lk), block_table=table, causal=True)
    got = flash_attn_varlen_func(q, k_cache, v_cache, strided(cu_q), strided(cu_k), max(lq), max(lk),
                                 block_table=table.t().contiguous().t(), causal=True)
    assert not strided(cu_q).is_contiguous() and torch.equal(got, want)
    one_page = torch.tensor([[1], [3], [5]], dtype=torch.int32, device=device).expand(3, 2)  # stride (1, 0)
    want = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, _cu([16, 0, 10], device), max(lq), 16,
                                  block_table=one_page.contiguous())
    got = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, _cu([16, 0, 10], device), max(lq), 16, block_table=one_page)
    assert torch.equal(got, want)
    qf, kf, vf, dout = _packed(LENS_Q, LENS_K, 2, 2, 16, device)
    want = _run(qf, kf, vf, dout, _cu(LENS_Q, device), _cu(LENS_K, device), max(LENS_Q), max(LENS_K), causal=True)
    got = _run(qf, kf, vf, dout, strided(_cu(LENS_Q, device)), strided(_cu(LENS_K, device)), max(LENS_Q),
               max(LENS_K), causal=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_reference_twin_matches_oracle():
    """flashtile.reference.varlen (FA2 Algorithm 1 per sequence) against the oracle, paged and not."""
    q, k, v, _ = _packed(LENS_Q, LENS_K, 4, 2, 8, "cpu", dtype=torch.float64, seed=11)
    cu_q, cu_k = _cu(LENS_Q, "cpu"), _cu(LENS_K, "cpu")
    alibi = torch.rand(len(LENS_Q), 4, dtype=torch.float32)
    res = varlen_attention(q, k, v, cu_q, cu_k, causal=True, alibi_slopes=alibi, block_sizes=(8, 8))
    want = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, alibi=alibi)
    assert_close(res.out, want[0], torch.float64, "cpu", "out")
    assert_close(res.lse, want[1], torch.float64, "cpu", "lse")
    assert res.counts.flops > 0


# --------------------------------------------------------------------------- #
# argument checks and memory safety
# --------------------------------------------------------------------------- #
def _bad_call(device, **over):
    q, k, v, _ = _packed([3, 5], [4, 6], 2, 2, 16, device)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=_cu([3, 5], device), cu_seqlens_k=_cu([4, 6], device),
                max_seqlen_q=5, max_seqlen_k=6)
    args.update(over)
    return flash_attn_varlen_func(**args)


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize(
    "over, exc, match",
    [
        (lambda d: {"cu_seqlens_q": torch.tensor([0, 3, 8], device=d)}, TypeError, "cu_seqlens_q.*int32"),
        (lambda d: {"cu_seqlens_k": [0, 4, 10]}, TypeError, "cu_seqlens_k"),
        (lambda d: {"cu_seqlens_q": _i32([[0, 3, 8]], d)}, ValueError, "cu_seqlens_q.*1-D"),
        (lambda d: {"cu_seqlens_k": _i32([0, 10], d)}, ValueError, "same length"),
        (lambda d: {"cu_seqlens_q": _i32([0, 3, 8], "meta")}, ValueError, "cu_seqlens_q.*device"),
        (lambda d: {"max_seqlen_q": 5.0}, TypeError, "max_seqlen_q"),
        (lambda d: {"max_seqlen_k": -1}, ValueError, "max_seqlen_k"),
        (lambda d: {"max_seqlen_q": 0}, ValueError, "max_seqlen_q"),  # 8 q rows, no sequence may hold one
        (lambda d: {"q": torch.zeros(8, 2, 16, device=d)[None]}, ValueError, "q must be 3-D"),
    ],
)
def test_bad_arguments_raise_before_launch(over, exc, match, device):
    with pytest.raises(exc, match=match):
        _bad_call(device, **over(device))


@pytest.mark.parametrize(
    "cu_q, cu_k, max_q, max_k, match",
    [
        ([1, 3, 8], [0, 4, 10], 5, 6, r"cu_seqlens_q\[0\] must be 0"),
        ([0, 6, 8], [0, 4, 10], 6, 6, None),  # valid: different split
        ([0, 9, 8], [0, 4, 10], 9, 6, "cu_seqlens_q must be non-decreasing"),
        ([0, 3, 7], [0, 4, 10], 5, 6, r"cu_seqlens_q\[-1\] must equal .* \(8\)"),
        ([0, 3, 8], [0, 4, 11], 5, 7, r"cu_seqlens_k\[-1\]"),
        ([0, 3, 8], [0, 4, 10], 4, 6, "max_seqlen_q .* smaller"),
        ([0, 3, 8], [0, 4, 10], 5, 5, "max_seqlen_k .* smaller"),
    ],
)
def test_bad_cu_seqlens_values_raise_with_debug(cu_q, cu_k, max_q, max_k, match, device):
    kw = dict(cu_seqlens_q=_i32(cu_q, device), cu_seqlens_k=_i32(cu_k, device), max_seqlen_q=max_q, max_seqlen_k=max_k)
    if match is None:
        _bad_call(device, debug=True, **kw)
        return
    with pytest.raises(ValueError, match=match):
        _bad_call(device, debug=True, **kw)


def test_any_cu_seqlens_values_stay_inside_the_tensors(device):
    """Without debug no value is read on the host: whatever cu_seqlens / block_table hold, the kernels
    (forward, backward, paged) read and write only inside q/k/v/out/lse/grads.  The tensors are views
    into NaN-filled storage: a read outside them would put NaN into the results, a write outside
    would change the guard bands."""
    d, h = 16, 2
    guard = 64 * h * d

    def guarded(rows):
        store = torch.full((guard * 2 + rows * h * d,), float("nan"), device=device)
        view = store[guard : guard + rows * h * d].view(rows, h, d)
        view.copy_(torch.randn(rows, h, d, generator=torch.Generator().manual_seed(rows)))
        return store, view

    def rows(cu, total, max_len):
        """Rows each sequence covers once clamped as the kernels clamp it (rows outside every range are
        never written: their contents are whatever the allocation held)."""
        covered = torch.zeros(total, dtype=torch.bool)
        for lo, hi in zip(cu, cu[1:]):
            start = min(max(lo, 0), total)
            end = min(max(hi, start), total)
            covered[start : start + min(end - start, max_len)] = True
        return covered

    (sq, q), (sk, k), (sv, v) = guarded(8), guarded(10), guarded(10)
    bad = [
        ([0, 50, 8], [0, -7, 10]), ([-100, 3, 2**31 - 1], [0, 4, 10]), ([0, 3, 8], [2**31 - 1, 0, -2**31]),
        ([0, 8, 8], [0, 10, 10]),
    ]
    for cu_q, cu_k in bad:
        rq, rk = rows(cu_q, 8, 6), rows(cu_k, 10, 7)
        cu_q, cu_k = _i32(cu_q, device), _i32(cu_k, device)
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        out, lse = flash_attn_varlen_func(qg, kg, vg, cu_q, cu_k, 6, 7, return_lse=True)
        out.backward(torch.ones_like(out))
        assert rq.any()
        for x, covered in ((out, rq), (qg.grad, rq), (kg.grad, rk), (vg.grad, rk)):
            assert not torch.isnan(x.cpu()[covered]).any()
        assert not torch.isnan(lse.cpu()[:, rq]).any()
        for store in (sq, sk, sv):
            assert torch.isnan(store[:guard]).all() and torch.isnan(store[-guard:]).all()
        with pytest.raises(ValueError, match="cu_seqlens_q / cu_seqlens_k out of range"):
            check_errors()
    # the paged forward with page indices outside the pool
    pages = torch.randn(3, 16, h, d, device=device)
    table = _i32([[5, -1], [2**31 - 1, 0]], device)
    store, pages = guarded(3 * 16)
    pages = pages.view(3, 16, h, d)
    out = flash_attn_varlen_func(q, pages, pages, _i32([0, 3, 8], device), _i32([0, 32, 60], device), 5, 1000,
                                 block_table=table)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="block_table entry out of range"):  # recorded by the forward kernel
        check_errors()
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = 5"):
        flash_attn_varlen_func(q, pages, pages, _i32([0, 3, 8], device), _i32([0, 32, 60], device), 5, 32,
                               block_table=table, debug=True)


@pytest.mark.parametrize(
    "cu_q, cu_k, max_q, max_k, match",
    [
        ([0, 5, 3, 8], [0, 4, 6, 10], 5, 6, "cu_seqlens_q"),  # decreasing
        ([0, 3, 8], [0, 4, 12], 5, 8, "cu_seqlens_k"),  # past the total
        ([0, 3, 8], [0, 4, 10], 4, 6, "max_seqlen"),  # a length above max_seqlen_q
        ([-3, 3, 8], [0, 4, 10], 6, 6, "cu_seqlens_q"),  # negative
        ([0, 3, 7], [0, 4, 10], 5, 6, "cu_seqlens_q"),  # ends before the total: row 7 in no sequence
    ],
)
def test_bad_cu_seqlens_values_are_recorded_without_debug(cu_q, cu_k, max_q, max_k, match, device):
    """Without debug the call returns (no host read), the forward kernel records the clamp in the device error
    word and check_errors() raises naming the argument; it clears the word, so a good call leaves it clear."""
    check_errors()  # a clear word to start from
    q, k, v, _ = _packed([3, 5], [4, 6], 2, 2, 16, device)
    out = flash_attn_varlen_func(q, k, v, _i32(cu_q, device), _i32(cu_k, device), max_q, max_k)
    assert out.shape == q.shape
    with pytest.raises(ValueError, match=match):
        check_errors()
    flash_attn_varlen_func(q, k, v, _cu([3, 5], device), _cu([4, 6], device), 5, 6, causal=True)
    check_errors()


def test_empty_k_runs_the_kernel_and_records_bad_cu_seqlens_k(device):
    """No keys at all: every row is empty (out 0, LSE -inf), and cu_seqlens_k claiming keys is still recorded."""
    check_errors()
    q, _, _, _ = _packed([3, 5], [0, 0], 2, 2, 16, device)
    k = torch.zeros(0, 2, 16, device=device)
    out, lse = flash_attn_varlen_func(q, k, k, _cu([3, 5], device), _cu([0, 0], device), 5, 0, return_lse=True)
    assert torch.equal(out.cpu(), torch.zeros_like(out.cpu())) and torch.isneginf(lse.cpu()).all()
    check_errors()
    flash_attn_varlen_func(q, k, k, _cu([3, 5], device), _i32([0, 2, 2], device), 5, 2)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        check_errors()


def test_bad_block_table_recorded_only_for_visited_pages(device):
    """The paged forward records a page index outside the pool that a key tile reads (ERR_VARLEN_BLOCK_TABLE),
    and not one in a block-table column past the sequence's keys or left of its window."""
    check_errors()
    pages = torch.randn(4, 16, 1, 16, device=device)
    q = torch.randn(2, 1, 16, device=device)
    cu_q, cu_k = _cu([1, 1], device), _cu([20, 40], device)
    for table, window, bad in (
        ([[0, 1, -1], [2, 3, 1]], (-1, -1), False),  # column 2 of sequence 0: past its 20 keys
        ([[0, 1, 0], [9, 3, 0]], (4, 0), False),  # page 9 holds keys 0..15, left of sequence 1's window
        ([[0, 1, 0], [9, 3, 0]], (-1, -1), True),
        ([[0, 4, 0], [0, 1, 0]], (-1, -1), True),
    ):
        flash_attn_varlen_func(q, pages, pages, cu_q, cu_k, 1, 40, block_table=_i32(table, device), window_size=window)
        if bad:
            with pytest.raises(ValueError, match="block_table"):
                check_errors()
        else:
            check_errors()


def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()
    lens = [9, 20]
    q, k, v, dout = _packed(lens, lens, 2, 1, 16, device, seed=12)
    cu = _cu(lens, device)

    def step(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu, cu, 20, 20, causal=True, softcap=2.0)

    eager = _run(q, k, v, dout, cu, cu, 20, 20, causal=True, softcap=2.0)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = torch.compile(step, fullgraph=True, backend="aot_eager")(*leaves)
    out.backward(dout)
    torch.testing.assert_close(out, eager[0], rtol=1e-6, atol=1e-6)
    for a, b in zip([x.grad for x in leaves], eager[2:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_opcheck_varlen_ops(device):
    """torch.library.opcheck on both packed ops (schema, fake tensors, autograd registration)."""
    lens = [5, 0, 9]
    q, k, v, dout = _packed(lens, lens, 1, 1, 16, device, seed=13)
    cu = _cu(lens, device)
    opts = (9, 9, 0.25, True, -1, 0, 0.0, 0.0, False)  # max_q, max_k, scale, causal, left, right, softcap, p, det
    fwd_args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu, cu, None, None, *opts)
    torch.library.opcheck(torch.ops.flashtile.flash_attn_varlen_fwd.default, fwd_args)
    out, lse, rng = torch.ops.flashtile.flash_attn_varlen_fwd(*(x.detach() if torch.is_tensor(x) else x for x in fwd_args))
    bwd_args = (dout, q.detach(), k.detach(), v.detach(), out, lse, rng, cu, cu, None, None, *opts)
    torch.library.opcheck(torch.ops.flashtile.flash_attn_varlen_bwd.default, bwd_args)


# --------------------------------------------------------------------------- #
# GPU: large packed batches
# --------------------------------------------------------------------------- #
def _lengths(total, lo, hi, seed):
    gen = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        lens.append(int(torch.randint(lo, hi + 1, (1,), generator=gen)))
    lens[-1] -= sum(lens) - total
    return lens


def _check_slices(got, q, k, v, dout, lens_q, lens_k, picks, dtype, **ref_kw):
    """Oracle on a few sequences only (float64 on the GPU): each is its own attention problem."""
    cu_q, cu_k = _cu(lens_q, "cpu"), _cu(lens_k, "cpu")
    for b in picks:
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        want = attention_varlen_ref_grads(q[rq], k[rk], v[rk], dout[rq], [0, lens_q[b]], [0, lens_k[b]], **ref_kw)
        as_bhnd = [x.detach().double().transpose(0, 1).unsqueeze(0) for x in (q[rq], k[rk], v[rk], dout[rq])]
        slack = rounding_slack(*as_bhnd, dtype, **ref_kw)
        cut = (got[0][rq], got[1][:, rq], got[2][rq], got[3][rk], got[4][rk])
        _check(cut, want, dtype, q.device, slack)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hopper", [True, False])
def test_gpu_large_packed_batch_bf16(monkeypatch, causal, hopper):
    """64k tokens, lengths 128..8k, H 16 / Hk 4, d 128, bf16: forward + backward vs the oracle on
    the shortest, the longest and a middle sequence; the forward on the Hopper kernel (on sm_90) or forced
    onto the FA2 kernel."""
    from flashtile.runtime import fa3_fwd

    monkeypatch.setattr(fa3_fwd, "ENABLED", hopper)
    lens = _lengths(65536, 128, 8192, seed=13)
    q, k, v, dout = _packed(lens, lens, 16, 4, 128, "cuda", torch.bfloat16, seed=14)
    got = _run(q, k, v, dout, _cu(lens, "cuda"), _cu(lens, "cuda"), max(lens), max(lens), causal=causal)
    # the float64 oracle of an 8k sequence would hold ~40 GB of scores and their graph: check the
    # shortest sequence and the two longest under 3k (every sequence runs in the same launch)
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    short = [i for i in order if lens[i] <= 3072]
    _check_slices(got, q, k, v, dout, lens, lens, [order[0], *short[-2:]], torch.bfloat16, causal=causal)


@pytest.mark.gpu
def test_gpu_many_tiny_sequences():
    """20k sequences of 0-7 tokens (q and k lengths drawn apart), causal, fp16."""
    gen = torch.Generator().manual_seed(15)
    lq = torch.randint(0, 8, (20000,), generator=gen).tolist()
    lk = torch.randint(0, 8, (20000,), generator=gen).tolist()
    q, k, v, dout = _packed(lq, lk, 8, 2, 64, "cuda", torch.float16, seed=16)
    got = _run(q, k, v, dout, _cu(lq, "cuda"), _cu(lk, "cuda"), 7, 7, causal=True)
    want = attention_varlen_ref_grads(q[: int(sum(lq[:500]))].cpu(), k[: int(sum(lk[:500]))].cpu(),
                                      v[: int(sum(lk[:500]))].cpu(), dout[: int(sum(lq[:500]))].cpu(),
                                      _cu(lq[:500], "cpu"), _cu(lk[:500], "cpu"), causal=True)
    n_q, n_k = int(sum(lq[:500])), int(sum(lk[:500]))
    cut = (got[0][:n_q], got[1][:, :n_q], got[2][:n_q], got[3][:n_k], got[4][:n_k])
    _check(cut, want, torch.float16, "cuda")


@pytest.mark.gpu
def test_gpu_offsets_past_2_31_elements():
    """total_q x row stride > 2^31: 1025 sequences of 2048 tokens, 8 heads, d 128, bf16 (4.3 GB, used as
    q, k and v); the last sequences start past element 2^31, so their row offsets need 64 bits."""
    hq, d, n = 8, 128, 2048
    lens = [n] * (2**31 // (hq * d * n) + 1)
    x = torch.randn(sum(lens), hq, d, device="cuda", dtype=torch.bfloat16)
    cu = _cu(lens, "cuda")
    out, lse = flash_attn_varlen_func(x, x, x, cu, cu, n, n, causal=True, return_lse=True)
    last = len(lens) - 1
    assert int(cu[last]) * hq * d >= 2**31
    for b in (0, last):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want = attention_varlen_ref(x[rows], x[rows], x[rows], [0, n], [0, n], causal=True)
        assert_close(out[rows], want[0], torch.bfloat16, "cuda", f"seq {b} out")
        assert_close(lse[:, rows], want[1], torch.float32, "cuda", f"seq {b} lse")


@pytest.mark.gpu
def test_gpu_chunked_prefill_paged_cache():
    """8 sequences: 512-token chunks (one empty) against 1k-6k cached keys in a shuffled pool of 256-token pages,
    bf16, causal, GQA 32 / 8, d 128, against the oracle on every sequence."""
    gen = torch.Generator().manual_seed(17)
    lq = [512, 0, 300, 512, 17, 512, 512, 200]
    lk = [1024, 4096, 6000, 2048, 17, 5000, 512, 3000]
    page, hk, d = 256, 8, 128
    max_pages = -(-max(lk) // page)
    n_pages = len(lk) * max_pages
    k_cache, v_cache = (torch.randn(n_pages, page, hk, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    table = torch.randperm(n_pages, generator=gen).view(len(lk), max_pages).to(torch.int32).cuda()
    q = torch.randn(sum(lq), 32, d, generator=gen).to("cuda", torch.bfloat16)
    cu_q, cu_k = _cu(lq, "cuda"), _cu(lk, "cuda")
    out, lse = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lq), max(lk), causal=True,
                                      block_table=table, return_lse=True, debug=True)
    want = attention_varlen_ref(q, k_cache, v_cache, cu_q, cu_k, block_table=table, causal=True)
    _check((out, lse), want, torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_gpu_bad_cu_seqlens_recorded_under_cuda_graph_replay():
    """A varlen forward captured in a CUDA graph (after an eager warm-up, which creates the error word) records
    cu_seqlens values written into its static tensor before a replay; a replay with good values records nothing."""
    q, k, v, _ = _packed([100, 200], [150, 250], 4, 2, 64, "cuda", torch.float16)
    cu_q, cu_k = _cu([100, 200], "cuda"), _cu([150, 250], "cuda")
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 250, causal=True)  # warm-up: compile, error word
    torch.cuda.synchronize()
    check_errors()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 250, causal=True)
    graph.replay()
    want = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 250, causal=True)
    assert torch.equal(out, want)
    check_errors()
    cu_k.copy_(_cu([150, 300], "cuda"))  # past the 400 packed keys
    graph.replay()
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        check_errors()
    cu_k.copy_(_cu([150, 250], "cuda"))
    graph.replay()
    check_errors()
