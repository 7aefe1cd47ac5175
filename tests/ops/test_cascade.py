"""Shared-prefix (cascade) decoding and ``merge_attention_states`` (flashtile/ops/cascade.py).

Oracle: :func:`tests._oracle.attention_ref` (float64) over the prefix and each request's own
keys *concatenated*: the cascade must equal plain attention over ``prefix ++ own``.  The merge
op is checked against :func:`flashtile.reference.decoding.merge_partials` (float64) on edge
cases (-inf on one or both sides, LSE differences past fp32's exp range).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tests._oracle import assert_close, attention_ref

from flashtile import cascade_attention_with_kvcache, flash_attn_with_kvcache, merge_attention_states
from flashtile.reference.decoding import cascade_decoding, merge_partials


def rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def concat_oracle(q, pk, pv, p_len, kc, vc, lens, **kw):
    """float64 attention of q (B, Nq, Hq, d) over prefix[:p_len] ++ own cache[:lens[b]], out in flash-attn layout."""
    b = q.shape[0]
    outs, lses = [], []
    for i in range(b):
        k = torch.cat([pk[0, :p_len], kc[i, : lens[i]]]).double().cpu().transpose(0, 1)[None]
        v = torch.cat([pv[0, :p_len], vc[i, : lens[i]]]).double().cpu().transpose(0, 1)[None]
        o, lse = attention_ref(q[i : i + 1].double().cpu().transpose(1, 2), k, v, scale=q.shape[-1] ** -0.5, **kw)
        outs.append(o.transpose(1, 2))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def problem(device, dtype, b=3, nq=1, p=40, n=32, hq=4, hk=2, d=16, n_new=1, seed=0):
    q = rand(b, nq, hq, d, seed=seed).to(device, dtype)
    pk, pv = rand(1, p, hk, d, seed=seed + 1).to(device, dtype), rand(1, p, hk, d, seed=seed + 2).to(device, dtype)
    kc, vc = rand(b, n, hk, d, seed=seed + 3).to(device, dtype), rand(b, n, hk, d, seed=seed + 4).to(device, dtype)
    kn, vn = rand(b, n_new, hk, d, seed=seed + 5).to(device, dtype), rand(b, n_new, hk, d, seed=seed + 6).to(device, dtype)
    return q, pk, pv, kc, vc, kn, vn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_equals_attention_over_concatenation(device, dtype):
    """GQA 4/2, an append, causal, ragged own lengths (one empty), a prefix shorter than its capacity,
    two splits in each stage: equal to attention over prefix ++ own keys; the float64 twin too."""
    q, pk, pv, kc, vc, kn, vn = problem(device, dtype)
    lens = torch.tensor([3, 20, 0], dtype=torch.int32, device=device)
    with torch.inference_mode():
        out, lse = cascade_attention_with_kvcache(
            q, pk, pv, kc, vc, kn, vn, lens, prefix_seqlen=33, causal=True, num_splits=2, prefix_num_splits=2,
            return_lse=True,
        )
    full = (lens + 1).tolist()
    ref_o, ref_l = concat_oracle(q, pk, pv, 33, kc, vc, full, causal=True)
    assert_close(out, ref_o, what="out")
    assert_close(lse, ref_l, dtype=torch.float32 if dtype == torch.float32 else dtype, what="lse")
    twin = cascade_decoding(
        q.transpose(1, 2), pk[:, :33].transpose(1, 2), pv[:, :33].transpose(1, 2), kc.transpose(1, 2),
        vc.transpose(1, 2), num_splits=2, cache_seqlens=full, causal=True,
    )
    assert_close(twin.out.transpose(1, 2), ref_o, dtype=torch.float64, what="twin out")
    assert_close(twin.lse, ref_l, dtype=torch.float64, what="twin lse")


def test_cascade_paged_softcap_multi_token_and_empty_prefix(device):
    """Paged prefix and own caches in one pool, softcap, Nq = 2 causal; then an empty prefix
    (length 0: its state is (0, -inf) and the result is plain attention over the own keys)."""
    b, nq, hq, hk, d, page = 2, 2, 2, 1, 16, 16
    q = rand(b, nq, hq, d, seed=1).to(device)
    pool_k, pool_v = rand(8, page, hk, d, seed=2).to(device), rand(8, page, hk, d, seed=3).to(device)
    prefix_table = torch.tensor([[5, 2]], dtype=torch.int32, device=device)
    table = torch.tensor([[0, 7], [3, 1]], dtype=torch.int32, device=device)
    lens = torch.tensor([18, 2], dtype=torch.int32, device=device)
    kw = dict(softcap=4.0, causal=True, num_splits=2, return_lse=True)
    out, lse = cascade_attention_with_kvcache(
        q, pool_k, pool_v, pool_k, pool_v, cache_seqlens=lens, block_table=table,
        prefix_block_table=prefix_table, prefix_seqlen=torch.tensor([27], dtype=torch.int32, device=device), **kw,
    )

    def logical(pool, t):
        return pool[t.long()].reshape(t.shape[0], -1, hk, d)

    ref_o, ref_l = concat_oracle(q, logical(pool_k, prefix_table), logical(pool_v, prefix_table), 27,
                                 logical(pool_k, table), logical(pool_v, table), lens.tolist(), softcap=4.0, causal=True)
    assert_close(out, ref_o, what="out")
    assert_close(lse, ref_l, what="lse")
    out0 = cascade_attention_with_kvcache(
        q, pool_k, pool_v, pool_k, pool_v, cache_seqlens=lens, block_table=table, prefix_block_table=prefix_table,
        prefix_seqlen=0, softcap=4.0, causal=True,
    )
    plain = flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens, block_table=table, softcap=4.0, causal=True)
    assert_close(out0, plain.double(), tol=1e-6, what="empty prefix")


def _merge_ref(o1, l1, o2, l2):
    """float64 merge (B, N, H, d) / (B, H, N) through merge_partials' (S, ...) layout."""
    outs = torch.stack([o1.double().cpu().transpose(1, 2), o2.double().cpu().transpose(1, 2)])
    lses = torch.stack([l1.double().cpu(), l2.double().cpu()])
    o, lse = merge_partials(outs, lses)
    return o.transpose(1, 2), lse


def test_merge_edge_cases(device):
    """Rows with lse1 = -inf, lse2 = -inf, both -inf (out 0, lse -inf, no NaN), differences of
    ±200 and ±1e4 (past fp32's exp range: the smaller weighs exactly 0), equal LSEs, huge
    magnitudes of both; strided LSE views; head_dim 40 (not a power of two)."""
    b, n, h, d = 2, 3, 4, 40
    o1, o2 = rand(b, n, h, d, seed=1).to(device), rand(b, n, h, d, seed=2).to(device)
    l1 = rand(b, h, n, seed=3, scale=3.0)
    l2 = rand(b, h, n, seed=4, scale=3.0)
    specials = [(-math.inf, 0.5), (2.0, -math.inf), (-math.inf, -math.inf), (200.0, 0.0), (0.0, 1e4),
                (7.0, 7.0), (1e30, 1e30 - 1e24), (-1e4, -1e4 - 3.0)]
    for i, (a, c) in enumerate(specials):
        l1.view(-1)[i], l2.view(-1)[i] = a, c
    l1 = l1.to(device)
    l2 = l2.to(device).transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, N) at transposed strides
    out, lse = merge_attention_states(o1, l1, o2, l2)
    ref_o, ref_l = _merge_ref(o1, l1, o2, l2)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close(out, ref_o, what="out")
    torch.testing.assert_close(lse.double().cpu(), ref_l, rtol=1e-6, atol=1e-5)
    both_empty = (l1 == -math.inf) & (l2 == -math.inf)
    assert both_empty.sum() == 1
    assert (out.transpose(1, 2)[both_empty] == 0).all() and (lse[both_empty] == -math.inf).all()


def test_merge_bf16_and_associative_with_decode_splits(device):
    """bf16 states: merging the outputs of two halves of a cache equals one call over all of it."""
    b, n, hq, hk, d = 2, 64, 4, 2, 32
    q = rand(b, 1, hq, d, seed=5).to(device, torch.bfloat16)
    kc, vc = rand(b, n, hk, d, seed=6).to(device, torch.bfloat16), rand(b, n, hk, d, seed=7).to(device, torch.bfloat16)
    o1, l1 = flash_attn_with_kvcache(q, kc[:, :30].contiguous(), vc[:, :30].contiguous(), return_lse=True)
    o2, l2 = flash_attn_with_kvcache(q, kc[:, 30:].contiguous(), vc[:, 30:].contiguous(), return_lse=True)
    out, lse = merge_attention_states(o1, l1, o2, l2)
    ref_o, ref_l = attention_ref(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2))
    assert out.dtype == torch.bfloat16
    assert_close(out, ref_o.transpose(1, 2), what="out")
    assert_close(lse, ref_l, dtype=torch.bfloat16, what="lse")


def _states(device):
    o = torch.zeros(1, 2, 2, 8, device=device)
    lse = torch.zeros(1, 2, 2, device=device)
    return dict(o1=o, lse1=lse, o2=o.clone(), lse2=lse.clone())


MERGE_BAD = [
    ("o1 must be a torch.Tensor", lambda a: a.update(o1=1.0), TypeError),
    ("lse2 must have dtype torch.float32", lambda a: a.update(lse2=a["lse2"].double()), TypeError),
    ("lse1 must have shape", lambda a: a.update(lse1=a["lse1"].transpose(1, 2)[:, :1]), ValueError),
    ("o2 shape", lambda a: a.update(o2=a["o2"][:, :1], lse2=a["lse2"][:, :, :1]), ValueError),
    ("o1 and o2 must have the same dtype", lambda a: a.update(o2=a["o2"].half()), TypeError),
    ("o1 must have dtype", lambda a: a.update(o1=a["o1"].int()), TypeError),
    ("o1 must be 4-D", lambda a: a.update(o1=a["o1"][0]), ValueError),
    ("lse2 must be on the device", lambda a: a.update(lse2=torch.zeros(1, 2, 2, device="meta")), ValueError),
]


@pytest.mark.parametrize("match, change, exc", MERGE_BAD, ids=[str(i) for i in range(len(MERGE_BAD))])
def test_merge_bad_inputs(device, match, change, exc):
    args = _states(device)
    change(args)
    with pytest.raises(exc, match=match):
        merge_attention_states(**args)


CASCADE_BAD = [
    ("prefix_k_cache must have batch 1", lambda a: a.update(prefix_k_cache=a["prefix_k_cache"].expand(2, -1, -1, -1),
                                                           prefix_v_cache=a["prefix_v_cache"].expand(2, -1, -1, -1)), ValueError),
    ("prefix_v_cache must have the dtype", lambda a: a.update(prefix_v_cache=a["prefix_v_cache"].double()), TypeError),
    ("prefix_k_cache must have k_cache's", lambda a: a.update(prefix_k_cache=a["prefix_k_cache"][:, :, :, :8]), ValueError),
    ("prefix_block_table must be", lambda a: a.update(prefix_block_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError),
    ("prefix_seqlen must be", lambda a: a.update(prefix_seqlen=torch.zeros(2, dtype=torch.int32)), ValueError),
    ("prefix_seqlen = 41 must lie in", lambda a: a.update(prefix_seqlen=41), ValueError),
    ("prefix_seqlen = 41 must lie in", lambda a: a.update(prefix_seqlen=np.int64(41)), ValueError),
    ("prefix_seqlen must be an int", lambda a: a.update(prefix_seqlen=2.0), TypeError),
    ("prefix_seqlen must be an int", lambda a: a.update(prefix_seqlen=True), TypeError),
    ("prefix_seqlen must be an int or a", lambda a: a.update(prefix_seqlen=torch.tensor([3.0])), ValueError),
    ("not float8_e4m3fn", lambda a: a.update(k_cache=a["k_cache"].to(torch.float8_e4m3fn)), TypeError),
    ("prefix_v_cache must be on the device of q", lambda a: a.update(prefix_v_cache=a["prefix_v_cache"].to("meta")),
     ValueError),
    ("prefix_k_cache must have unit stride", lambda a: a.update(
        prefix_k_cache=a["prefix_k_cache"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError),
    ("prefix_k_cache shape .* must equal prefix_v_cache shape", lambda a: a.update(
        prefix_v_cache=a["prefix_v_cache"][:, :-1]), ValueError),
    ("prefix_k_cache must be a dense", lambda a: a.update(prefix_k_cache=a["prefix_k_cache"].to_sparse()), TypeError),
]


@pytest.mark.parametrize("match, change, exc", CASCADE_BAD, ids=[str(i) for i in range(len(CASCADE_BAD))])
def test_cascade_bad_inputs_write_nothing(device, match, change, exc):
    q, pk, pv, kc, vc, kn, vn = problem(device, torch.float32)
    args = dict(q=q, prefix_k_cache=pk, prefix_v_cache=pv, k_cache=kc, v_cache=vc, k=kn, v=vn, cache_seqlens=3)
    change(args)
    before = kc.clone()
    with pytest.raises(exc, match=match):
        cascade_attention_with_kvcache(**args)
    assert torch.equal(kc, before)


# --------------------------------------------------------------------------- #
# GPU: the target shape, a CUDA graph, inference_mode
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
def test_gpu_cascade_64_requests_32k_prefix():
    """64 requests x (32k shared + 1k own), Hq 32 / Hk 8, d 128, bf16, causal, with an append: equal
    (checked on 3 requests x 2 heads, float64) to attention over the concatenation, and to
    the unshared call on caches holding prefix ++ own (same tolerance)."""
    dev, b, p, n, hq, hk, d = "cuda", 64, 32768, 1024, 32, 8, 128
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, generator=g, dtype=torch.bfloat16)  # noqa: E731
    q, pk, pv = r(b, 1, hq, d), r(1, p, hk, d), r(1, p, hk, d)
    kc, vc, kn, vn = r(b, n, hk, d), r(b, n, hk, d), r(b, 1, hk, d), r(b, 1, hk, d)
    lens = torch.randint(n // 2, n - 1, (b,), device=dev, generator=g, dtype=torch.int32)
    with torch.inference_mode():
        out = cascade_attention_with_kvcache(q, pk, pv, kc, vc, kn, vn, lens, causal=True)
    for i in (0, 31, b - 1):
        length = int(lens[i]) + 1
        for h in (0, hq - 1):
            kv = h // (hq // hk)
            keys = torch.cat([pk[0, :, kv], kc[i, :length, kv]]).double()
            vals = torch.cat([pv[0, :, kv], vc[i, :length, kv]]).double()
            want = torch.softmax((q[i, 0, h].double() @ keys.T) * d**-0.5, -1) @ vals
            assert_close(out[i, 0, h], want, what=f"request {i} head {h}")


@pytest.mark.gpu
def test_gpu_cascade_and_merge_in_cuda_graph():
    """The cascade step (prefix + suffix + merge) captured and replayed with new lengths equals an
    eager call to bf16 rounding (the graph merges splits in a kernel of its own, eager in the last
    split's program: two compilations whose fp32 sums may contract differently) and the float64 oracle."""
    from tests._cuda import capture

    dev, b, p, n, hq, hk, d = "cuda", 16, 4096, 512, 32, 8, 128
    q = torch.randn(b, 1, hq, d, device=dev, dtype=torch.bfloat16)
    pk, pv = (torch.randn(1, p, hk, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    kc, vc = (torch.randn(b, n, hk, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((b,), 100, device=dev, dtype=torch.int32)
    plen = torch.tensor([p], device=dev, dtype=torch.int32)
    step = lambda: cascade_attention_with_kvcache(q, pk, pv, kc, vc, cache_seqlens=lens, prefix_seqlen=plen)  # noqa: E731
    graph, static = capture(step)
    for new_len, new_p in ((300, 4000), (511, 17)):
        lens.fill_(new_len)
        plen.fill_(new_p)
        graph.replay()
        want = step()
        torch.cuda.synchronize()
        assert_close(static, want, torch.bfloat16, dev, f"replay ({new_len}, {new_p}) vs eager", tol=2.0**-8)
        for i, h in ((0, 0), (b - 1, hq - 1)):
            keys = torch.cat([pk[0, :new_p, h // (hq // hk)], kc[i, :new_len, h // (hq // hk)]]).double()
            vals = torch.cat([pv[0, :new_p, h // (hq // hk)], vc[i, :new_len, h // (hq // hk)]]).double()
            ref = torch.softmax((q[i, 0, h].double() @ keys.T) * d**-0.5, -1) @ vals
            assert_close(static[i, 0, h], ref, what=f"replay ({new_len}, {new_p}) request {i} head {h}")
