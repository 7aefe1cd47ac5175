"""Cross-checks of the tests' oracle (tests/_oracle.py) against the library's reference layer and torch.

The oracle and ``flashtile.reference`` are written independently from the same
definition, so a bug in either shows as a disagreement here; torch's own SDPA
(float64, CPU) is a third implementation for the cases it covers, and a
per-element loop checks the mask formula itself.  Tolerance: the float64 entry
of the table.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtile.reference.attention import standard_attention
from flashtile.reference.backward import standard_attention_backward
from flashtile.reference.decoding import flash_decoding
from flashtile.reference.masks import BlockMask
from tests._oracle import assert_close, attention_ref, attention_ref_grads, ref_kwargs, scores_ref

F64 = torch.float64


def rand(g, *shape):
    return torch.randn(*shape, generator=g, dtype=F64)


@st.composite
def cases(draw):
    hk = draw(st.integers(1, 2))
    hq = hk * draw(st.sampled_from([1, 2, 3]))
    b, nq, nk = draw(st.integers(1, 2)), draw(st.integers(0, 24)), draw(st.integers(0, 24))
    d = draw(st.sampled_from([1, 5, 16]))
    causal = draw(st.booleans())
    window = (draw(st.sampled_from([-1, 0, 3])), 0 if causal else draw(st.sampled_from([-1, 0, 2])))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    opts = dict(
        softmax_scale=draw(st.sampled_from([None, 0.3, 2.0])), causal=causal, window_size=window,
        softcap=draw(st.sampled_from([0.0, 1.5])),
    )
    if draw(st.booleans()):
        opts["alibi_slopes"] = torch.rand((hq,) if draw(st.booleans()) else (b, hq), generator=g, dtype=F64)
    if draw(st.booleans()):
        opts["dropout_p"] = 0.25
        opts["dropout_mask"] = torch.rand(b, hq, nq, nk, generator=g) >= 0.25
    if draw(st.booleans()) and nq and nk:
        bs = (draw(st.integers(1, 8)), draw(st.integers(1, 8)))
        grid = torch.rand(-(-nq // bs[0]), -(-nk // bs[1]), generator=g) < 0.6
        opts["block_mask"] = BlockMask(grid, bs)
    q, k, v, dout = rand(g, b, hq, nq, d), rand(g, b, hk, nk, d), rand(g, b, hk, nk, d), rand(g, b, hq, nq, d)
    return (q, k, v, dout), opts


@settings(max_examples=80, deadline=None)
@given(cases())
def test_agrees_with_reference_forward_and_backward(case):
    (q, k, v, dout), opts = case
    out, lse, dq, dk, dv = attention_ref_grads(q, k, v, dout, **ref_kwargs(**opts))
    lib = standard_attention(q, k, v, **opts)
    assert_close(out, lib.out, what="out")
    assert_close(lse, lib.lse, what="lse")
    for name, got, want in zip("qkv", (dq, dk, dv), standard_attention_backward(q, k, v, dout, **opts)):
        assert not torch.isnan(got).any(), f"NaN in d{name}"
        assert_close(got, want, what=f"d{name}")


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 3), hk=st.integers(1, 2), group=st.sampled_from([1, 4]), nq=st.integers(1, 4),
    nk=st.integers(1, 30), causal=st.booleans(), left=st.sampled_from([-1, 0, 5]), softcap=st.sampled_from([0.0, 2.0]),
    alibi=st.booleans(), splits=st.integers(1, 4), seed=st.integers(0, 2**16),
)
def test_per_batch_lengths_agree_with_flash_decoding(b, hk, group, nq, nk, causal, left, softcap, alibi, splits, seed):
    g = torch.Generator().manual_seed(seed)
    hq = hk * group
    q, k, v = rand(g, b, hq, nq, 8), rand(g, b, hk, nk, 8), rand(g, b, hk, nk, 8)
    lens = torch.randint(0, nk + 1, (b,), generator=g)
    slopes = torch.rand(b, hq, generator=g, dtype=F64) if alibi else None
    out, lse = attention_ref(q, k, v, causal=causal, window=(left, -1), softcap=softcap, alibi=slopes, lens=lens)
    lib = flash_decoding(
        q, k, v, num_splits=splits, cache_seqlens=lens.tolist(), causal=causal, window_size=(left, -1),
        softcap=softcap, alibi_slopes=slopes,
    )
    assert_close(out, lib.out, what="out")
    assert_close(lse, lib.lse, what="lse")


@pytest.mark.parametrize("nq, nk", [(5, 9), (9, 5), (7, 7)])
@pytest.mark.parametrize("mask", ["none", "bool", "additive", "causal"])
def test_agrees_with_torch_sdpa(nq, nk, mask):
    """torch's SDPA in float64: GQA by enable_gqa, bool and additive masks, top-left causal as a bool mask."""
    g = torch.Generator().manual_seed(nq * nk)
    q, k, v = rand(g, 2, 4, nq, 6), rand(g, 2, 2, nk, 6), rand(g, 2, 2, nk, 6)
    attn = {
        "none": None,
        "bool": torch.rand(2, 1, nq, nk, generator=g) < 0.7,
        "additive": torch.where(torch.rand(1, 4, nq, nk, generator=g) < 0.8, rand(g, 1, 4, nq, nk), -math.inf),
        "causal": torch.ones(nq, nk, dtype=torch.bool).tril(),
    }[mask]
    out, _ = attention_ref(q, k, v, bias=attn)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, enable_gqa=True)
    seen = slice(None) if attn is None else (attn.expand(2, 4, nq, nk) != (False if attn.dtype == torch.bool else -math.inf)).any(-1)
    # torch gives NaN on rows with no visible key, the oracle 0: compare the rows that see a key
    assert_close(out[seen], want[seen], what="out")
    if attn is not None:
        assert (out[~seen] == 0).all()


@pytest.mark.parametrize("causal, window, lens", [(True, (-1, -1), None), (False, (2, 1), None), (True, (3, -1), [4, 0, 9])])
def test_visibility_is_the_documented_formula(causal, window, lens):
    """Per element: key j visible to row i iff i + L - Nq - left <= j <= i + L - Nq + right and j < L."""
    b, nq, nk = 3, 6, 9
    q, k = torch.zeros(b, 1, nq, 2, dtype=F64), torch.zeros(b, 1, nk, 2, dtype=F64)
    seen = scores_ref(q, k, causal=causal, window=window, lens=lens) > -math.inf
    left, right = window[0], 0 if causal else window[1]
    for bi in range(b):
        length = nk if lens is None else lens[bi]
        for i in range(nq):
            for j in range(nk):
                lo = -math.inf if left < 0 else i + length - nq - left
                hi = math.inf if right < 0 else i + length - nq + right
                assert bool(seen[bi, 0, i, j]) == (j < length and lo <= j <= hi), (bi, i, j)


def test_empty_rows_have_zero_output_minus_inf_lse_and_zero_gradients():
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = rand(g, 1, 2, 6, 4), rand(g, 1, 2, 3, 4), rand(g, 1, 2, 3, 4), rand(g, 1, 2, 6, 4)
    out, lse, dq, dk, dv = attention_ref_grads(q, k, v, dout, causal=True)  # rows 0..2 see no key
    assert (out[:, :, :3] == 0).all() and torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
    assert (dq[:, :, :3] == 0).all()
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
