"""``flash_attn_with_kvcache``'s optional inputs: fused rotary, ``cache_batch_idx``, ``cache_leftpad``,
multi-token and ragged (``cu_seqlens_q``) queries, alone and combined with paged caches, GQA,
windows, softcap and split-KV.

Oracle: :func:`flashtile.reference.decoding.kvcache_step` (float64 twin of the whole step),
itself tied to :func:`tests._oracle.attention_ref` and to complex multiplication below.
Interpreter shapes are small (head_dim 16-32, caches of 32-64 keys, 16-key tiles).
"""

from __future__ import annotations

import pytest
import torch
from tests._cuda import capture
from tests._oracle import assert_close, attention_ref

from flashtile.ops.kvcache import check_errors, flash_attn_with_kvcache
from flashtile.reference.decoding import apply_rotary, kvcache_step


def rand(*shape, device, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def tables(seqlen_ro, half, device, seed, dtype=torch.float32):
    angle = torch.rand(seqlen_ro, half, generator=torch.Generator().manual_seed(seed)) * 6.3
    return torch.cos(angle).to(device=device, dtype=dtype), torch.sin(angle).to(device=device, dtype=dtype)


def paged(b, max_pages, page, hk, d, device, seed):
    total = b * max_pages + 2
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[: b * max_pages]
    table = perm.view(b, max_pages).to(device=device, dtype=torch.int32)
    return rand(total, page, hk, d, device=device, seed=seed + 1), rand(total, page, hk, d, device=device, seed=seed + 2), table


def logical(pool, table):
    b, pages = table.shape
    return pool[table.long()].reshape(b, pages * pool.shape[1], *pool.shape[2:])


def ints(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


# --------------------------------------------------------------------------- #
# the twin against independent definitions
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_twin_is_complex_multiplication(interleaved):
    """Each rotated pair is the complex number x1 + i x2 times e^{i theta} (RoFormer eq. 34)."""
    x = torch.randn(2, 3, 4, 10, dtype=torch.float64)
    theta = torch.rand(7, 3, dtype=torch.float64) * 6.3
    pos = torch.tensor([[0, 4, 6], [2, 2, 5]])
    got = apply_rotary(x, theta.cos(), theta.sin(), pos, interleaved=interleaved)
    rot = x[..., :6]
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :3], rot[..., 3:])
    z = torch.complex(x1, x2) * torch.polar(torch.ones_like(theta), theta)[pos].unsqueeze(-2)
    want = torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved else torch.cat((z.real, z.imag), -1)
    torch.testing.assert_close(got[..., :6], want, rtol=0, atol=1e-12)
    assert torch.equal(got[..., 6:], x[..., 6:]), "dims past rotary_dim pass through"


def test_step_twin_matches_oracle():
    """Gather, append, leftpad and ragged queries of the twin equal the dense oracle with the
    gathered cache, per-element lengths and a boolean mask for the left padding."""
    b, n, hq, hk, d, n_new = 3, 24, 4, 2, 8, 2
    kc, vc = torch.randn(4, n, hk, d, dtype=torch.float64), torch.randn(4, n, hk, d, dtype=torch.float64)
    k, v = torch.randn(b, n_new, hk, d, dtype=torch.float64), torch.randn(b, n_new, hk, d, dtype=torch.float64)
    cu = [0, 1, 4, 6]
    q = torch.randn(cu[-1], hq, d, dtype=torch.float64)
    lens, rows, pads = [3, 0, 20], [2, 0, 1], [1, 0, 7]
    out, lse, kc2, vc2 = kvcache_step(q, kc, vc, k, v, lens, cache_batch_idx=rows, cache_leftpad=pads,
                                      cu_seqlens_q=cu, causal=True, window_size=(9, -1))
    for i in range(b):
        expect = kc[rows[i]].clone()
        expect[lens[i] : lens[i] + n_new] = k[i]
        assert torch.equal(kc2[rows[i]], expect)
        length = lens[i] + n_new
        keys = torch.arange(n)
        visible = (keys >= pads[i]) & (keys < length)
        o, l = attention_ref(q[cu[i] : cu[i + 1]].transpose(0, 1)[None], kc2[rows[i]].transpose(0, 1)[None],
                             vc2[rows[i]].transpose(0, 1)[None], lens=[length], causal=True, window=(9, 0),
                             bias=visible.view(1, 1, 1, n))
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], o[0].transpose(0, 1), rtol=0, atol=1e-12)
        torch.testing.assert_close(lse[:, cu[i] : cu[i + 1]], l[0], rtol=0, atol=1e-12)
    assert torch.equal(kc2[3], kc[3]), "a row no element uses is untouched"


# --------------------------------------------------------------------------- #
# kernels against the twin
# --------------------------------------------------------------------------- #
def _check(out, lse, k_after, v_after, ref, device, dtype=torch.float32, label=""):
    ref_out, ref_lse, ref_k, ref_v = ref
    assert_close(out, ref_out, dtype, device, f"out {label}")
    assert_close(lse, ref_lse, dtype, device, f"lse {label}")
    assert_close(k_after, ref_k, dtype, device, f"k_cache {label}")
    assert torch.equal(v_after.cpu().double(), ref_v), "v is appended as given"


@pytest.mark.parametrize("interleaved, causal, half", [(True, True, 8), (False, False, 5), (False, True, 16)])
def test_rotary_contiguous(device, interleaved, causal, half):
    """k rotated at cache_seqlens + i as it is appended; q at cache_seqlens + t (causal) or at
    cache_seqlens for every token (not causal); partial rotary (rotary_dim 10 or 16 of 32) and full."""
    b, n, hq, hk, d, n_new = 2, 48, 4, 2, 32, 2
    kc, vc = rand(b, n, hk, d, device=device, seed=1), rand(b, n, hk, d, device=device, seed=2)
    k, v = rand(b, n_new, hk, d, device=device, seed=3), rand(b, n_new, hk, d, device=device, seed=4)
    q = rand(b, 2, hq, d, device=device, seed=5)
    cos, sin = tables(n, half, device, seed=6)
    lens = ints([7, 30], device)
    ref = kvcache_step(q.cpu(), kc.cpu(), vc.cpu(), k.cpu(), v.cpu(), lens.tolist(), rotary=(cos.cpu(), sin.cpu(), interleaved),
                       causal=causal)
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, lens, causal=causal, rotary_interleaved=interleaved,
                                       num_splits=2, return_lse=True)
    _check(out, lse, kc, vc, ref, device)


def test_batch_idx_leftpad_window_alibi(device):
    """cache_batch_idx picks rows of a larger cache (the others stay byte-identical), cache_leftpad
    masks each element's first keys; with a causal window, ALiBi and a split count that leaves
    whole splits inside the padding."""
    b, n, hq, hk, d, n_new = 3, 64, 2, 1, 16, 1
    kc, vc = rand(5, n, hk, d, device=device, seed=11), rand(5, n, hk, d, device=device, seed=12)
    before_k, before_v = kc.clone(), vc.clone()
    k, v = rand(b, n_new, hk, d, device=device, seed=13), rand(b, n_new, hk, d, device=device, seed=14)
    q = rand(b, 1, hq, d, device=device, seed=15)
    lens, rows, pads = ints([40, 0, 62], device), ints([3, 0, 1], device), ints([33, 0, 5], device)
    alibi = torch.rand(hq, generator=torch.Generator().manual_seed(16)).to(device)
    kw = dict(causal=True, window_size=(20, 0), alibi_slopes=alibi)
    ref = kvcache_step(q.cpu(), kc.cpu(), vc.cpu(), k.cpu(), v.cpu(), lens.tolist(), cache_batch_idx=rows.tolist(),
                       cache_leftpad=pads.tolist(), **{**kw, "alibi_slopes": alibi.cpu()})
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, cache_batch_idx=rows, cache_leftpad=pads,
                                       num_splits=4, return_lse=True, **kw)
    _check(out, lse, kc, vc, ref, device)
    for row in (2, 4):
        assert torch.equal(kc[row], before_k[row]) and torch.equal(vc[row], before_v[row])
    check_errors()


def test_paged_gqa_rotary_multi_token_softcap(device):
    """Speculative step: 3 query tokens and 3 new keys crossing a page boundary, scattered pages,
    GQA 4:1 (12 packed rows), NeoX rotary, softcap, 3 splits; fp32 and bf16 tables."""
    b, hq, hk, d, page, pages, n_new = 2, 8, 2, 16, 16, 3, 3
    k_pool, v_pool, table = paged(b, pages, page, hk, d, device, seed=20)
    k, v = rand(b, n_new, hk, d, device=device, seed=23), rand(b, n_new, hk, d, device=device, seed=24)
    q = rand(b, n_new, hq, d, device=device, seed=25)
    cos, sin = tables(pages * page, 8, device, seed=26)
    lens = ints([14, 40], device)
    ref = kvcache_step(q.cpu(), logical(k_pool, table).cpu(), logical(v_pool, table).cpu(), k.cpu(), v.cpu(),
                       lens.tolist(), rotary=(cos.cpu(), sin.cpu(), False), causal=True, softcap=2.0)
    out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cos, sin, lens, block_table=table, causal=True,
                                       softcap=2.0, rotary_interleaved=False, num_splits=3, return_lse=True)
    _check(out, lse, logical(k_pool, table), logical(v_pool, table), ref, device)


def test_varlen_queries_paged_rotary(device):
    """Ragged queries (FA3's cu_seqlens_q): 1, 4, 0 and 3 tokens, causal aligned to each element's
    own count, GQA, paged, rotary; out (total_q, Hq, d), lse (Hq, total_q).  Also unsplit."""
    b, hq, hk, d, page, pages, n_new = 4, 4, 2, 16, 16, 2, 1
    k_pool, v_pool, table = paged(b, pages, page, hk, d, device, seed=30)
    k, v = rand(b, n_new, hk, d, device=device, seed=33), rand(b, n_new, hk, d, device=device, seed=34)
    cu = ints([0, 1, 5, 5, 8], device)
    q = rand(8, hq, d, device=device, seed=35)
    cos, sin = tables(pages * page, 6, device, seed=36)
    lens = ints([3, 20, 9, 31], device)
    for splits in (3, 1):
        kp, vp = k_pool.clone(), v_pool.clone()
        ref = kvcache_step(q.cpu(), logical(k_pool, table).cpu(), logical(v_pool, table).cpu(), k.cpu(), v.cpu(),
                           lens.tolist(), rotary=(cos.cpu(), sin.cpu(), True), cu_seqlens_q=cu.tolist(), causal=True)
        out, lse = flash_attn_with_kvcache(q, kp, vp, k, v, cos, sin, lens, block_table=table, causal=True,
                                           num_splits=splits, return_lse=True, cu_seqlens_q=cu, max_seqlen_q=4)
        assert out.shape == (8, hq, d) and lse.shape == (hq, 8)
        _check(out, lse, logical(kp, table), logical(vp, table), ref, device, label=f"splits={splits}")
    check_errors()


def test_multi_token_matches_token_by_token(device):
    """A 4-token causal step equals four 1-token steps (each appending its own token): the packed
    multi-token tile is bottom-right aligned to the cache length after the append."""
    b, n, hq, hk, d, nq = 1, 32, 4, 1, 16, 4
    kc, vc = rand(b, n, hk, d, device=device, seed=40), rand(b, n, hk, d, device=device, seed=41)
    k, v = rand(b, nq, hk, d, device=device, seed=42), rand(b, nq, hk, d, device=device, seed=43)
    q = rand(b, nq, hq, d, device=device, seed=44)
    cos, sin = tables(n, 8, device, seed=45)
    kc1, vc1 = kc.clone(), vc.clone()
    together = flash_attn_with_kvcache(q, kc1, vc1, k, v, cos, sin, 10, causal=True)
    kc2, vc2 = kc.clone(), vc.clone()
    steps = [flash_attn_with_kvcache(q[:, t : t + 1], kc2, vc2, k[:, t : t + 1], v[:, t : t + 1], cos, sin, 10 + t,
                                     causal=True) for t in range(nq)]
    assert_close(together, torch.cat(steps, 1).double(), torch.float32, device, "out")
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)


def test_gqa8_sixteen_tokens_in_one_tile(device):
    """A GQA group of 8 with 16 tokens (128 packed rows) runs as one row tile per kv head, causal,
    with rotary and a window, split in 2."""
    from flashtile.runtime.decode import decode_plan

    b, n, hq, hk, d, nq = 1, 48, 8, 1, 16, 16
    assert decode_plan(b, nq, hq, hk, d, None, n, 2, torch.device(device)).row_tiles == 1
    kc, vc = rand(b, n, hk, d, device=device, seed=90), rand(b, n, hk, d, device=device, seed=91)
    k, v = rand(b, nq, hk, d, device=device, seed=92), rand(b, nq, hk, d, device=device, seed=93)
    q = rand(b, nq, hq, d, device=device, seed=94)
    cos, sin = tables(n, 4, device, seed=95)
    ref = kvcache_step(q.cpu(), kc.cpu(), vc.cpu(), k.cpu(), v.cpu(), [20], rotary=(cos.cpu(), sin.cpu(), True),
                       causal=True, window_size=(12, 0))
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, 20, causal=True, window_size=(12, 0), num_splits=2,
                                       return_lse=True)
    _check(out, lse, kc, vc, ref, device)


# --------------------------------------------------------------------------- #
# untrusted values, bad arguments
# --------------------------------------------------------------------------- #
def test_bad_batch_idx_and_cu_seqlens_are_never_dereferenced(device):
    """Without debug an out-of-range cache_batch_idx entry reads and writes nothing (that element's
    output is 0), the others are exact, and check_errors names it; a cu_seqlens_q span past total_q
    is clamped and named."""
    b, n, hk, d = 2, 32, 1, 16
    kc, vc = rand(3, n, hk, d, device=device, seed=50), rand(3, n, hk, d, device=device, seed=51)
    before = kc.clone(), vc.clone()
    k, v = rand(b, 1, hk, d, device=device, seed=52), rand(b, 1, hk, d, device=device, seed=53)
    q = rand(b, 1, 2, d, device=device, seed=54)
    lens = ints([4, 9], device)
    out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, cache_batch_idx=ints([3, 2], device), causal=True)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        check_errors()
    assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu()))
    ref = kvcache_step(q.cpu(), before[0].cpu(), before[1].cpu(), k.cpu(), v.cpu(), [4, 9], cache_batch_idx=[0, 2], causal=True)
    assert_close(out[1:], ref[0][1:], torch.float32, device, "good element")
    assert torch.equal(kc[:2], before[0][:2]) and torch.equal(vc[:2], before[1][:2]), "the bad element wrote nothing"
    out = flash_attn_with_kvcache(q.view(2, 2, d), kc[:2], vc[:2], cache_seqlens=lens, cu_seqlens_q=ints([0, 1, 7], device),
                                  max_seqlen_q=2)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        check_errors()


UNCOVERED = [  # (cu_seqlens_q, max_seqlen_q) over 5 packed rows
    ([1, 2, 5], 3),  # starts past 0
    ([0, 1, 3], 2),  # ends before total_q
    ([0, 2, 2], 2),  # ends before total_q after an empty span
    ([0, 4, 5], 2),  # a span longer than max_seqlen_q: rows 2, 3 in the middle
    ([0, 3, 1], 3),  # decreasing
    ([-3, 2, 9], 3),  # outside [0, total_q] at both ends
]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("cu, max_q", UNCOVERED, ids=[str(c) for c, _ in UNCOVERED])
def test_rows_outside_every_cu_seqlens_q_span_are_empty(device, monkeypatch, cu, max_q, splits):
    """Packed q rows that no clamped span computes come back as out 0 and lse -inf (not the memory of
    torch.empty, poisoned with NaN here), the computed ones are finite, and check_errors names cu_seqlens_q."""
    hq, hk, d, n = 4, 2, 16, 48
    kc, vc = rand(2, n, hk, d, device=device, seed=70), rand(2, n, hk, d, device=device, seed=71)
    q = rand(5, hq, d, device=device, seed=72)
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        x = real_empty(*args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", poisoned)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=ints([20, 40], device), cu_seqlens_q=ints(cu, device),
                                       max_seqlen_q=max_q, num_splits=splits, return_lse=True, causal=True)
    monkeypatch.setattr(torch, "empty", real_empty)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        check_errors()
    covered = torch.zeros(5, dtype=torch.bool)
    for b in range(2):
        start = min(max(cu[b], 0), 5)
        covered[start : start + min(max(cu[b + 1] - start, 0), max_q, 5 - start)] = True
    out, lse = out.cpu(), lse.cpu()
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[~covered], torch.zeros_like(out[~covered]))
    assert bool((lse[:, ~covered] == float("-inf")).all())
    if cu == sorted(cu):  # decreasing spans overlap other elements' rows, which then race (each value defined)
        assert bool(lse[:, covered].isfinite().all())


def _base(device):
    b, n, hq, hk, d = 2, 32, 4, 2, 16
    return dict(
        q=rand(b, 1, hq, d, device=device, seed=60), k_cache=rand(3, n, hk, d, device=device, seed=61),
        v_cache=rand(3, n, hk, d, device=device, seed=62), k=rand(b, 1, hk, d, device=device, seed=63),
        v=rand(b, 1, hk, d, device=device, seed=64), cache_seqlens=ints([3, 30], device),
        cache_batch_idx=ints([2, 0], device), rotary_cos=tables(n, 4, device, 65)[0],
        rotary_sin=tables(n, 4, device, 65)[1], cache_leftpad=ints([1, 0], device),
    )


def _varlen(a):
    return dict(q=a["q"].view(2, 4, 16), cu_seqlens_q=ints([0, 1, 2], a["q"].device), max_seqlen_q=1)


BAD = [
    ("rotary_cos", lambda a: dict(rotary_cos=a["rotary_cos"].double()), TypeError),
    ("rotary_sin", lambda a: dict(rotary_sin=a["rotary_sin"].half()), TypeError),
    ("rotary_cos", lambda a: dict(rotary_cos=a["rotary_cos"][:, 0]), ValueError),
    ("seqlen_ro", lambda a: dict(rotary_cos=a["rotary_cos"][:31], rotary_sin=a["rotary_sin"][:31]), ValueError),
    ("rotary_dim", lambda a: dict(rotary_cos=a["rotary_cos"].repeat(1, 3), rotary_sin=a["rotary_sin"].repeat(1, 3)),
     ValueError),
    ("same shape", lambda a: dict(rotary_sin=a["rotary_sin"][:, :2]), ValueError),
    ("together", lambda a: dict(rotary_sin=None), ValueError),
    ("need the new keys", lambda a: dict(k=None, v=None), ValueError),
    ("cache_batch_idx", lambda a: dict(cache_batch_idx=a["cache_batch_idx"].long()), TypeError),
    ("cache_batch_idx", lambda a: dict(cache_batch_idx=a["cache_batch_idx"][:1]), ValueError),
    ("cache_batch_idx", lambda a: dict(cache_batch_idx=ints([3, 0], a["q"].device), debug=True), ValueError),
    ("both 0", lambda a: dict(cache_batch_idx=ints([0, 0], a["q"].device), debug=True), ValueError),
    ("batch of k_cache", lambda a: dict(cache_batch_idx=None), ValueError),
    ("block_table", lambda a: dict(block_table=torch.zeros(2, 2, dtype=torch.int32, device=a["q"].device)), ValueError),
    ("cache_leftpad", lambda a: dict(cache_leftpad=ints([4, 0], a["q"].device), debug=True), ValueError),
    ("cache_leftpad cannot", lambda a: dict(cache_batch_idx=None, k_cache=a["k_cache"][:, :16], v_cache=a["v_cache"][:, :16],
                                            block_table=ints([[0, 1], [2, 0]], a["q"].device)), ValueError),
    ("cache_leftpad", lambda a: dict(cache_leftpad=[1, 0]), TypeError),
    ("cu_seqlens_q", lambda a: {**_varlen(a), "cu_seqlens_q": ints([0, 1, 2], a["q"].device).long()}, TypeError),
    ("cu_seqlens_q", lambda a: {**_varlen(a), "cu_seqlens_q": ints([0, 2, 2], a["q"].device), "debug": True},
     ValueError),
    ("max_seqlen_q", lambda a: {**_varlen(a), "max_seqlen_q": None}, ValueError),
    ("max_seqlen_q", lambda a: {**_varlen(a), "max_seqlen_q": 3}, ValueError),
    ("max_seqlen_q", lambda a: dict(max_seqlen_q=2), ValueError),
    ("3-D", lambda a: {**_varlen(a), "q": a["q"]}, ValueError),
]


@pytest.mark.parametrize("match, change, exc", BAD, ids=[f"{i}-{m}" for i, (m, _, _) in enumerate(BAD)])
def test_bad_inputs_raise_before_writing(device, match, change, exc):
    args = _base(device)
    caches = args["k_cache"], args["v_cache"]  # a change may pass views of them
    snapshot = caches[0].clone(), caches[1].clone()
    flash_attn_with_kvcache(**{**args, "k": None, "v": None, "rotary_cos": None, "rotary_sin": None})  # valid
    args.update(change(args))
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**args)
    assert torch.equal(caches[0], snapshot[0]) and torch.equal(caches[1], snapshot[1])
    check_errors()


def test_memo_keys_on_the_new_arguments(device):
    """The per-signature memo tells calls apart by the new arguments: with and without rotary,
    interleaved or not, with a batch index or not, and a new cache_batch_idx value is read each call."""
    a = _base(device)
    a.pop("cache_leftpad")
    outs = []
    for change in (dict(), dict(rotary_interleaved=False), dict(rotary_cos=None, rotary_sin=None),
                   dict(cache_batch_idx=ints([1, 0], device))):
        kc = a["k_cache"].clone()
        outs.append(flash_attn_with_kvcache(**{**a, **change, "k_cache": kc}))
    for i in range(len(outs)):
        for j in range(i):
            assert not torch.equal(outs[i], outs[j]), (i, j)
    kc = a["k_cache"].clone()
    again = flash_attn_with_kvcache(**{**a, "k_cache": kc})
    assert torch.equal(again, outs[0])


# --------------------------------------------------------------------------- #
# GPU
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
def test_gpu_bf16_paged_rotary_multi_token(interleaved):
    """bf16, d 128, 32/8 heads, 4 query tokens against caches up to 8k in 256-key pages, rotary_dim 64."""
    dev, dt = "cuda", torch.bfloat16
    b, hq, hk, d, page, pages, n_new = 4, 32, 8, 128, 256, 32, 4
    k_pool, v_pool, table = (x.to(dt) if x.is_floating_point() else x for x in paged(b, pages, page, hk, d, dev, seed=70))
    k, v = rand(b, n_new, hk, d, device=dev, seed=73, dtype=dt), rand(b, n_new, hk, d, device=dev, seed=74, dtype=dt)
    q = rand(b, n_new, hq, d, device=dev, seed=75, dtype=dt)
    cos, sin = tables(pages * page, 32, dev, seed=76)
    lens = ints([0, 1000, 4097, pages * page - n_new], dev)
    ref = kvcache_step(q.cpu(), logical(k_pool, table).cpu(), logical(v_pool, table).cpu(), k.cpu(), v.cpu(),
                       lens.tolist(), rotary=(cos.cpu(), sin.cpu(), interleaved), causal=True, window_size=(3000, 0))
    out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cos, sin, lens, block_table=table, causal=True,
                                       window_size=(3000, 0), rotary_interleaved=interleaved, return_lse=True)
    _check(out, lse, logical(k_pool, table), logical(v_pool, table), ref, dev, dtype=dt)
    check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [0, 1])
def test_gpu_bf16_gqa8_sixteen_tokens(splits):
    """bf16, Hq 64 / Hk 8, 16 query tokens: 128 packed rows in one tile on 8 warps; 4k cache, causal,
    leftpad and batch index, heuristic and single split."""
    dev, dt = "cuda", torch.bfloat16
    b, n, hq, hk, d, nq = 3, 4096, 64, 8, 128, 16
    kc, vc = rand(4, n, hk, d, device=dev, seed=100, dtype=dt), rand(4, n, hk, d, device=dev, seed=101, dtype=dt)
    k, v = rand(b, nq, hk, d, device=dev, seed=102, dtype=dt), rand(b, nq, hk, d, device=dev, seed=103, dtype=dt)
    q = rand(b, nq, hq, d, device=dev, seed=104, dtype=dt)
    lens, rows, pads = ints([0, 2000, n - nq], dev), ints([3, 1, 0], dev), ints([0, 700, 4000], dev)
    ref = kvcache_step(q.cpu(), kc.cpu(), vc.cpu(), k.cpu(), v.cpu(), lens.tolist(), cache_batch_idx=rows.tolist(),
                       cache_leftpad=pads.tolist(), causal=True)
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, cache_batch_idx=rows, cache_leftpad=pads,
                                       causal=True, num_splits=splits, return_lse=True)
    assert_close(out, ref[0], dt, dev, "out")
    assert_close(lse, ref[1], dt, dev, "lse")
    check_errors()


@pytest.mark.gpu
def test_gpu_cuda_graph_rotary_batch_idx_leftpad_varlen():
    """One captured step with rotary, cache_batch_idx, cache_leftpad and ragged queries, replayed with
    new cache_seqlens / cache_batch_idx / cache_leftpad / cu_seqlens_q values written in place: each
    replay equals an eager call with those values (and the float64 twin)."""
    dev, dt = "cuda", torch.bfloat16
    b, n, hq, hk, d = 4, 2048, 16, 4, 128
    kc0, vc0 = rand(6, n, hk, d, device=dev, seed=80, dtype=dt), rand(6, n, hk, d, device=dev, seed=81, dtype=dt)
    k, v = rand(b, 1, hk, d, device=dev, seed=82, dtype=dt), rand(b, 1, hk, d, device=dev, seed=83, dtype=dt)
    q = rand(10, hq, d, device=dev, seed=84, dtype=dt)
    cos, sin = tables(n, 64, dev, seed=85, dtype=dt)
    lens, rows, pads, cu = ints([5, 100, 2000, 0], dev), ints([5, 0, 2, 3], dev), ints([0, 50, 1000, 0], dev), ints([0, 4, 5, 9, 10], dev)
    kc, vc = kc0.clone(), vc0.clone()
    kw = dict(causal=True, cache_batch_idx=rows, cache_leftpad=pads, cu_seqlens_q=cu, max_seqlen_q=4)

    def step():
        return flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, lens, **kw)

    graph, captured = capture(step)
    for new_lens, new_rows, new_pads, new_cu in (
        ([7, 1500, 30, 2046], [1, 4, 0, 2], [3, 0, 29, 2000], [0, 1, 5, 9, 10]),
        ([0, 0, 2047, 11], [3, 2, 1, 0], [0, 0, 0, 11], [0, 4, 8, 8, 10]),
    ):
        for t, val in ((lens, new_lens), (rows, new_rows), (pads, new_pads), (cu, new_cu)):
            t.copy_(ints(val, dev))
        kc.copy_(kc0), vc.copy_(vc0)
        graph.replay()
        replayed = captured.clone()
        kc.copy_(kc0), vc.copy_(vc0)
        eager = step()
        torch.testing.assert_close(replayed, eager, rtol=0, atol=0)
        ref = kvcache_step(q.cpu(), kc0.cpu(), vc0.cpu(), k.cpu(), v.cpu(), new_lens, rotary=(cos.cpu(), sin.cpu(), True),
                           cache_batch_idx=new_rows, cache_leftpad=new_pads, cu_seqlens_q=new_cu, causal=True)
        assert_close(eager, ref[0], dt, dev, "out")
    check_errors()


def test_plain_calls_keep_the_plain_path(device):
    """A call without the optional inputs records the shared NO_FEATURES (the per-call path tests
    identity to skip gathering their tensors) and binds the kernels with every feature switch off."""
    from flashtile.ops import kvcache as op
    from flashtile.runtime.decode import NO_FEATURES

    a = _base(device)
    plain = dict(q=a["q"], k_cache=a["k_cache"][:2], v_cache=a["v_cache"][:2], cache_seqlens=a["cache_seqlens"])
    flash_attn_with_kvcache(**plain, causal=True, softcap=1.5)
    call = next(c for key, c in op._CALLS.items() if key[-7:] == ((None,),) * 5 + (type(None), None) and c.softcap == 1.5)
    assert call.features is NO_FEATURES
    static = dict(call.launch.arguments["fused"].static)
    assert not any(static[n] for n in ("HAS_BATCH_IDX", "HAS_LEFTPAD", "VARLEN_Q", "ROTARY"))
