"""Every bad argument raises TypeError / ValueError naming the argument and what is accepted.

None of these calls reaches a kernel: validation runs first, so they cost nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashtile.ops import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    scaled_dot_product_attention,
)
from flashtile.reference.masks import BlockMask


@pytest.fixture(autouse=True)
def _accept_cpu_tensors(monkeypatch):
    """Validation of CPU tensors passes the device check only under the interpreter; set it
    even on a GPU machine (nothing here launches a kernel)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def t(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


Q, KV = (1, 32, 4, 16), (1, 48, 2, 16)  # flash layout (B, N, H, d)


def fa(**kw):
    """flash_attn_func on valid q/k/v (Hq=4, Hk=2, Nq=32, Nk=48, d=16) with one argument overridden."""
    args = {"q": t(*Q), "k": t(*KV), "v": t(*KV)}
    args.update(kw)
    return flash_attn_func(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def sd(**kw):
    """scaled_dot_product_attention on valid (B, H, N, d) inputs with one argument overridden."""
    args = {"query": t(1, 2, 8, 16), "key": t(1, 2, 12, 16), "value": t(1, 2, 12, 16)}
    args.update(kw)
    return scaled_dot_product_attention(**args)


FLASH_CASES = {
    "q_not_tensor": (lambda: fa(q=[1.0]), TypeError, r"q must be a torch.Tensor"),
    "float64": (lambda: fa(q=t(*Q, dtype=torch.float64)), TypeError, r"q must have dtype torch.float16, torch.bfloat16 or torch.float32"),
    "int_v": (lambda: fa(v=t(*KV, dtype=torch.int32)), TypeError, r"v must have dtype"),
    "mixed_dtypes": (lambda: fa(k=t(*KV, dtype=torch.float16)), TypeError, r"q and k must have the same dtype"),
    "devices": (lambda: fa(k=t(*KV, device="meta")), ValueError, r"q and k must be on the same device"),
    "rank": (lambda: fa(q=t(32, 4, 16)), ValueError, r"q must be 4-D \(batch, seqlen, heads, head_dim\)"),
    "head_dim_0": (lambda: fa(q=t(1, 32, 4, 0), k=t(1, 48, 2, 0), v=t(1, 48, 2, 0)), ValueError, r"head_dim of q must be in 1..256, got 0"),
    "head_dim_257": (lambda: fa(q=t(1, 4, 4, 257), k=t(1, 4, 2, 257), v=t(1, 4, 2, 257)), ValueError, r"head_dim of q must be in 1..256, got 257"),
    "head_dims_differ": (lambda: fa(k=t(1, 48, 2, 8)), ValueError, r"head_dim of k \(8\) must equal head_dim of q \(16\)"),
    "v_head_dim": (lambda: fa(v=t(1, 48, 2, 32)), ValueError, r"head_dim of v \(32\) must equal head_dim of q"),
    "batch": (lambda: fa(k=t(2, 48, 2, 16), v=t(2, 48, 2, 16)), ValueError, r"batch of k \(2\) must equal batch of q \(1\)"),
    "kv_shapes": (lambda: fa(v=t(1, 40, 2, 16)), ValueError, r"k shape .* must equal v shape"),
    "gqa_ratio": (lambda: fa(k=t(1, 48, 3, 16), v=t(1, 48, 3, 16)), ValueError, r"heads of q \(4\) must be a multiple of the heads of k/v \(3\)"),
    "window_neg": (lambda: fa(window_size=(-2, 0)), ValueError, r"window_size must be a pair of ints \(left, right\), each >= -1"),
    "window_triple": (lambda: fa(window_size=(1, 2, 3)), ValueError, r"window_size must be a pair"),
    "window_float": (lambda: fa(window_size=(1.5, 2)), ValueError, r"window_size must be a pair of ints"),
    "causal_type": (lambda: fa(causal="yes"), TypeError, r"causal must be a bool"),
    "softcap_neg": (lambda: fa(softcap=-1.0), ValueError, r"softcap must be a finite float >= 0"),
    "softcap_huge": (lambda: fa(softcap=3e38), ValueError, r"softcap must be at most 1e\+30"),
    "softcap_type": (lambda: fa(softcap="1"), TypeError, r"softcap must be a float \(a Python or NumPy real scalar\), got str"),
    "dropout_one": (lambda: fa(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
    "dropout_neg": (lambda: fa(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\)"),
    "scale_nan": (lambda: fa(softmax_scale=float("nan")), ValueError, r"softmax_scale must be a finite float"),
    "scale_inf": (lambda: fa(softmax_scale=float("inf")), ValueError, r"softmax_scale must be a finite float"),
    "scale_type": (lambda: fa(softmax_scale=torch.tensor(1.0)), TypeError, r"softmax_scale must be a float \(a Python or NumPy real scalar\), got Tensor"),
    "alibi_shape": (lambda: fa(alibi_slopes=t(2)), ValueError, r"alibi_slopes must have shape \(nheads,\) = \(4,\) or \(batch, nheads\) = \(1, 4\)"),
    "alibi_kv_heads": (lambda: fa(alibi_slopes=t(1, 2)), ValueError, r"alibi_slopes must have shape"),
    "alibi_dtype": (lambda: fa(alibi_slopes=t(4, dtype=torch.float16)), TypeError, r"alibi_slopes must have dtype torch.float32"),
    "alibi_grad": (lambda: fa(alibi_slopes=t(4).requires_grad_()), ValueError, r"alibi_slopes does not support gradients"),
    "block_mask_type": (lambda: fa(block_mask=torch.ones(2, 3, dtype=torch.bool)), TypeError, r"block_mask must be a flashtile.reference.masks.BlockMask"),
    "block_mask_grid": (lambda: fa(block_mask=BlockMask(torch.ones(2, 2, dtype=torch.bool), (16, 16))), ValueError, r"block_mask has block grid \(2, 2\).*need \(2, 3\)"),
    "block_mask_lead": (lambda: fa(block_mask=BlockMask(torch.ones(1, 3, 2, 3, dtype=torch.bool), (16, 16))), ValueError, r"block_mask.mask leading dims \(1, 3\) must broadcast to \(batch, heads\) = \(1, 4\)"),
    "block_mask_size": (lambda: fa(block_mask=BlockMask(torch.ones(4, 6, dtype=torch.bool), (8, 8))), ValueError, r"block_mask.block_size must be multiples of 16"),
    "deterministic_type": (lambda: fa(deterministic=1), TypeError, r"deterministic must be a bool"),
    "return_attn_probs_type": (lambda: fa(return_attn_probs=1), TypeError, r"return_attn_probs must be a bool"),
    "window_bool": (lambda: fa(window_size=(True, 2)), ValueError, r"window_size must be a pair of ints"),
    "window_float_tensor": (lambda: fa(window_size=torch.tensor([1.0, 2.0])), ValueError, r"window_size must be a pair of ints"),
    "window_tensor_len3": (lambda: fa(window_size=torch.tensor([1, 2, 3])), ValueError, r"window_size must be a pair of ints"),
    "window_tensor_neg": (lambda: fa(window_size=torch.tensor([-3, 2])), ValueError, r"window_size must be a pair of ints"),
    "window_numpy_float": (lambda: fa(window_size=(np.float32(2), 1)), ValueError, r"window_size must be a pair of ints"),
    "softcap_bool": (lambda: fa(softcap=True), TypeError, r"softcap must be a float"),
    "softcap_numpy_bool": (lambda: fa(softcap=np.bool_(True)), TypeError, r"softcap must be a float"),
    "dropout_bool": (lambda: fa(dropout_p=False), TypeError, r"dropout_p must be a float"),
    "scale_numpy_nan": (lambda: fa(softmax_scale=np.float64("nan")), ValueError, r"softmax_scale must be a finite float"),
    "qkv_shape": (lambda: flash_attn_qkvpacked_func(t(1, 8, 2, 2, 16)), ValueError, r"qkv must have shape \(batch, seqlen, 3, nheads, headdim\)"),
    "kv_shape": (lambda: flash_attn_kvpacked_func(t(*Q), t(1, 48, 3, 2, 16)), ValueError, r"kv must have shape \(batch, seqlen_k, 2, nheads_k, headdim\)"),
    "kv_packed_dtype": (lambda: flash_attn_kvpacked_func(t(*Q), t(1, 48, 2, 2, 16, dtype=torch.bfloat16)), TypeError, r"q and kv\[:, :, 0\] must have the same dtype"),
}

SDPA_CASES = {
    "mask_and_causal": (lambda: sd(attn_mask=t(8, 12), is_causal=True), ValueError, r"attn_mask and is_causal=True cannot both be set"),
    "heads_without_gqa": (lambda: sd(key=t(1, 1, 12, 16), value=t(1, 1, 12, 16)), ValueError, r"pass enable_gqa=True"),
    "gqa_ratio": (lambda: sd(query=t(1, 3, 8, 16), enable_gqa=True), ValueError, r"heads of query \(3\) must be a multiple of the heads of key/value \(2\)"),
    "rank_2": (lambda: sd(query=t(8, 16), key=t(12, 16), value=t(12, 16)), ValueError, r"query, key, value must all be 4-D .* or all 3-D"),
    "rank_mixed": (lambda: sd(query=t(2, 8, 16)), ValueError, r"must all be 4-D"),
    "value_head_dim": (lambda: sd(value=t(1, 2, 12, 8)), ValueError, r"head_dim of value \(8\) must equal head_dim of query \(16\)"),
    "mask_shape": (lambda: sd(attn_mask=t(8, 11)), ValueError, r"attn_mask of shape \(8, 11\) is not broadcastable to \(1, 2, 8, 12\)"),
    "mask_rank": (lambda: sd(attn_mask=t(1, 1, 1, 8, 12)), ValueError, r"attn_mask of shape .* is not broadcastable"),
    "mask_dtype": (lambda: sd(attn_mask=t(8, 12, dtype=torch.int64)), TypeError, r"attn_mask must be bool .* float32 or of query's dtype"),
    "mask_other_float": (lambda: sd(attn_mask=t(8, 12, dtype=torch.float64)), TypeError, r"attn_mask must be bool .* float32 or of query's dtype"),
    "mask_grad": (lambda: sd(attn_mask=t(8, 12).requires_grad_()), ValueError, r"gradients with respect to attn_mask are not supported"),
    "mask_device": (lambda: sd(attn_mask=t(8, 12, device="meta")), ValueError, r"attn_mask must be on the device of query"),
    "scale_nan": (lambda: sd(scale=float("nan")), ValueError, r"^scale must be a finite float"),
    "dropout": (lambda: sd(dropout_p=1.5), ValueError, r"dropout_p must be in \[0, 1\)"),
    "dtype": (lambda: sd(query=t(1, 2, 8, 16, dtype=torch.float64)), TypeError, r"query must have dtype"),
    "gqa_type": (lambda: sd(enable_gqa=None), TypeError, r"enable_gqa must be a bool"),
    "causal_type": (lambda: sd(is_causal=1), TypeError, r"is_causal must be a bool"),
    "scale_type": (lambda: sd(scale="0.5"), TypeError, r"^scale must be a float"),
    "scale_bool": (lambda: sd(scale=True), TypeError, r"^scale must be a float"),
    "scale_tensor": (lambda: sd(scale=torch.tensor(0.5)), TypeError, r"^scale must be a float"),
    "dropout_type": (lambda: sd(dropout_p="0.1"), TypeError, r"^dropout_p must be a float"),
    "query_type": (lambda: sd(query=[1.0]), TypeError, r"^query must be a torch.Tensor"),
    "key_dtype": (lambda: sd(key=t(1, 2, 12, 16, dtype=torch.float16)), TypeError, r"^query and key must have the same dtype"),
    "value_device": (lambda: sd(value=t(1, 2, 12, 16, device="meta")), ValueError, r"^query and value must be on the same device"),
    "key_batch": (lambda: sd(key=t(2, 2, 12, 16), value=t(2, 2, 12, 16)), ValueError, r"^batch of key \(2\) must equal batch of query"),
}


@pytest.mark.parametrize("case", list(FLASH_CASES))
def test_flash_attn_rejects(case):
    call, exc, pattern = FLASH_CASES[case]
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_rejects(case):
    call, exc, pattern = SDPA_CASES[case]
    with pytest.raises(exc, match=pattern):
        call()


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"Move the tensors to CUDA .* or set TRITON_INTERPRET=1"):
        fa()
    with pytest.raises(ValueError, match=r"query is a CPU tensor"):
        sd()


FLASH_ONLY_NAMES = ("softmax_scale", "window_size", " causal=", " q ", " k ", " v ", " kv ")


@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_errors_name_sdpa_arguments(case):
    """No SDPA error talks about flash-attn's argument names (softmax_scale, q, k, v)."""
    call, exc, _ = SDPA_CASES[case]
    with pytest.raises(exc) as info:
        call()
    message = f" {info.value} "
    assert not any(name in message for name in FLASH_ONLY_NAMES), message


class _Recorder:
    """Stands in for the op: records the validated arguments, returns zeros."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, **kw):
        self.calls.append(kw)
        b, n, h = (q.shape[0], q.shape[1], q.shape[2]) if kw["seq_major"] else (q.shape[0], q.shape[2], q.shape[1])
        return torch.zeros_like(q), torch.zeros(b, h, n), torch.zeros(2, dtype=torch.int64)


@pytest.fixture
def recorder(monkeypatch):
    import flashtile.ops.flash_attn as flash_module
    import flashtile.ops.sdpa as sdpa_module

    rec = _Recorder()
    monkeypatch.setattr(flash_module, "attention", rec)
    monkeypatch.setattr(sdpa_module, "attention", rec)
    return rec


def test_numpy_scalars_are_accepted_like_python_ones(recorder):
    fa(softmax_scale=np.float32(0.3), softcap=np.float64(2.5), dropout_p=np.float32(0.25),
       window_size=(np.int64(5), np.int32(3)))
    fa(softmax_scale=np.int64(2), window_size=np.array([4, -1]))
    sd(scale=np.float32(0.3), dropout_p=np.float16(0.5))
    first, second, third = recorder.calls
    assert first["softmax_scale"] == float(np.float32(0.3)) and type(first["softmax_scale"]) is float
    assert first["softcap"] == 2.5 and first["dropout_p"] == 0.25
    assert first["window"] == (5, 3) and all(type(w) is int for w in first["window"])
    assert second["softmax_scale"] == 2.0 and second["window"] == (4, -1)
    assert third["softmax_scale"] == float(np.float32(0.3)) and third["dropout_p"] == 0.5


def test_window_size_tensor_and_causal_right_bound_follow_flash_attn(recorder):
    fa(window_size=torch.tensor([6, 2]))
    fa(causal=True, window_size=(4, 2))  # flash-attn sets the right bound to 0 under causal
    fa(causal=True, window_size=torch.tensor([-1, 7], dtype=torch.int32))
    assert [c["window"] for c in recorder.calls] == [(6, 2), (4, 0), (-1, 0)]
    assert [c["causal"] for c in recorder.calls] == [False, True, True]


def test_return_attn_probs_gives_flash_attn_triple(recorder):
    out, lse, probs = fa(return_attn_probs=True)
    assert out.shape == Q and lse.shape == (1, 4, 32) and probs is None
    out2, lse2, probs2 = fa(return_attn_probs=True, return_lse=True)
    assert probs2 is None and lse2.shape == lse.shape
    assert isinstance(fa(), torch.Tensor)
    # flash-attn's positional order: ..., deterministic, return_attn_probs
    triple = flash_attn_func(t(*Q), t(*KV), t(*KV), 0.0, None, False, (-1, -1), 0.0, None, False, True)
    assert len(triple) == 3 and triple[2] is None
    packed = flash_attn_qkvpacked_func(t(1, 8, 3, 2, 16), return_attn_probs=True)
    assert len(packed) == 3 and packed[2] is None
    kvp = flash_attn_kvpacked_func(t(*Q), t(1, 48, 2, 2, 16), return_attn_probs=True)
    assert len(kvp) == 3 and kvp[2] is None


def test_check_constants_and_execution_mode_defined_once():
    """SUPPORTED_DTYPES and MAX_HEAD_DIM live in ops/validate.py, interpreting() in runtime/common.py:
    the kernel modules import them instead of keeping copies that can disagree."""
    import re
    from pathlib import Path

    import flashtile

    root = Path(flashtile.__file__).parent
    pattern = re.compile(r"^(SUPPORTED_DTYPES|MAX_HEAD_DIM|_MAX_HEAD_DIM)\s*=|^def (interpreting|_interpreting)\(", re.M)
    found = sorted(
        (m.group(1) or m.group(2), str(path.relative_to(root)))
        for path in root.rglob("*.py") if "reference" not in path.parts
        for m in pattern.finditer(path.read_text())
    )
    assert found == [
        ("MAX_HEAD_DIM", "ops/validate.py"), ("SUPPORTED_DTYPES", "ops/validate.py"),
        ("interpreting", "runtime/common.py"),
    ], found


def test_window_bounds_past_the_sequence_are_unbounded(device):
    """A window bound that cannot exclude any key (left >= Nk, right >= Nq), up to 2^63 - 1, gives the unwindowed
    result: the kernels' int32 range arithmetic never sees it (2^31 - 1 used to wrap and drop every key)."""
    from flashtile import flash_attn_func, flash_attn_with_kvcache
    from flashtile.ops import validate

    assert validate.unbind_window(40, 8, 8, 40) == (-1, -1)
    assert validate.unbind_window(39, 7, 8, 40) == (39, 7)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 40, 1, 16, generator=g).to(device)
    k, v = (torch.randn(1, 8, 1, 16, generator=g).to(device) for _ in range(2))
    ref = flash_attn_func(q, k, v)
    for window in ((2**31 - 1, -1), (-1, 2**31 - 1), (2**63 - 1, 2**63 - 1)):
        torch.testing.assert_close(flash_attn_func(q, k, v, window_size=window), ref)
    kc, vc = (torch.randn(1, 32, 1, 16, generator=g).to(device) for _ in range(2))
    qd = torch.randn(1, 4, 1, 16, generator=g).to(device)
    base = flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=20)
    for window in ((2**31 - 1, -1), (-1, 2**31 - 1)):
        torch.testing.assert_close(flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=20, window_size=window), base)


def _sparse(x):
    return x.to_sparse()


def _kvc(**kw):
    from flashtile import flash_attn_with_kvcache

    args = dict(q=t(1, 1, 4, 16), k_cache=t(1, 32, 2, 16), v_cache=t(1, 32, 2, 16))
    args.update(kw)
    return flash_attn_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)


def _fp8(**kw):
    from flashtile import flash_attn_func as fa_

    e4 = torch.float8_e4m3fn
    args = dict(q=t(*Q).to(e4), k=t(*KV).to(e4), v=t(*KV).to(e4))
    args.update(kw)
    return fa_(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def _varlen(**kw):
    from flashtile import flash_attn_varlen_func

    cu = torch.tensor([0, 8], dtype=torch.int32)
    args = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
    args.update(kw)
    return flash_attn_varlen_func(t(8, 2, 16), t(8, 2, 16), t(8, 2, 16), args["cu_seqlens_q"], args["cu_seqlens_k"],
                                  8, 8)


def _merge(**kw):
    from flashtile import merge_attention_states

    args = dict(o1=t(1, 4, 2, 16), lse1=t(1, 2, 4), o2=t(1, 4, 2, 16), lse2=t(1, 2, 4))
    args.update(kw)
    return merge_attention_states(**args)


NOT_ADDRESSABLE = {  # sparse layouts and meta tensors hold no memory the kernels can read: refused by name
    "q_sparse": (lambda: fa(q=_sparse(t(*Q))), TypeError, r"^q must be a dense \(strided\) tensor"),
    "all_meta": (lambda: fa(q=t(*Q, device="meta"), k=t(*KV, device="meta"), v=t(*KV, device="meta")), ValueError,
                 r"^q is a meta tensor"),
    "alibi_sparse": (lambda: fa(alibi_slopes=_sparse(t(4))), TypeError, r"^alibi_slopes must be a dense"),
    "alibi_meta": (lambda: fa(alibi_slopes=t(4, device="meta")), ValueError, r"^alibi_slopes must be on the device"),
    "block_mask_sparse": (lambda: fa(block_mask=BlockMask(_sparse(torch.ones(2, 3, dtype=torch.bool)), (16, 16))),
                          TypeError, r"^block_mask.mask must be a dense"),
    "block_mask_meta": (lambda: fa(block_mask=BlockMask(torch.ones(2, 3, dtype=torch.bool, device="meta"), (16, 16))),
                        ValueError, r"^block_mask.mask is a meta tensor"),
    "attn_mask_sparse": (lambda: sd(attn_mask=_sparse(torch.ones(8, 12, dtype=torch.bool))), TypeError,
                         r"^attn_mask must be a dense"),
    "cu_seqlens_sparse": (lambda: _varlen(cu_seqlens_k=_sparse(torch.tensor([0, 8], dtype=torch.int32))), TypeError,
                          r"^cu_seqlens_k must be a dense"),
    "k_cache_sparse": (lambda: _kvc(k_cache=_sparse(t(1, 32, 2, 16))), TypeError, r"^k_cache must be a dense"),
    "cache_seqlens_sparse": (lambda: _kvc(cache_seqlens=_sparse(torch.tensor([3], dtype=torch.int32))), TypeError,
                             r"^cache_seqlens must be a dense"),
    "cache_batch_idx_meta": (lambda: _kvc(cache_batch_idx=torch.zeros(1, dtype=torch.int32, device="meta")),
                             ValueError, r"^cache_batch_idx must be on the device of q"),
    "rotary_sparse": (lambda: _kvc(rotary_cos=_sparse(t(32, 4)), rotary_sin=t(32, 4)), TypeError,
                      r"^rotary_cos must be a dense"),
    "new_k_sparse": (lambda: _kvc(k=_sparse(t(1, 1, 2, 16)), v=t(1, 1, 2, 16)), TypeError, r"^k must be a dense"),
    "fp8_descale_sparse": (lambda: _fp8(k_descale=_sparse(torch.ones(1, 2))), TypeError, r"^k_descale must be a dense"),
    "fp8_meta": (lambda: _fp8(q=t(*Q, device="meta").to(torch.float8_e4m3fn), k=t(*KV, device="meta").to(
        torch.float8_e4m3fn), v=t(*KV, device="meta").to(torch.float8_e4m3fn)), ValueError, r"^q is a meta tensor"),
    "merge_meta": (lambda: _merge(o1=t(1, 4, 2, 16, device="meta")), ValueError, r"^o1 is a meta tensor"),
    "merge_lse_sparse": (lambda: _merge(lse2=_sparse(t(1, 2, 4))), TypeError, r"^lse2 must be a dense"),
}


@pytest.mark.parametrize("case", list(NOT_ADDRESSABLE))
def test_tensors_without_addressable_memory_are_refused(case):
    call, exc, pattern = NOT_ADDRESSABLE[case]
    with pytest.raises(exc, match=pattern):
        call()


def test_sequences_past_2_30_are_refused():
    """Lengths the kernels' int32 tile ranges cannot hold (a query length of 2^31 + 1 wrapped a tile start to
    -2^31 and wrote before the output): refused by name before any launch; stride-0 views, so no memory."""
    from flashtile import flash_attn_varlen_func, flash_attn_with_kvcache

    big = 2**30 + 1
    long_q = torch.zeros(1, 1, 1, 8).expand(1, big, 1, 8)
    short = torch.zeros(1, 4, 1, 8)
    with pytest.raises(ValueError, match=r"^seqlen of q must be at most 2\^30"):
        flash_attn_func(long_q, short, short)
    with pytest.raises(ValueError, match=r"^seqlen of k must be at most 2\^30"):
        flash_attn_func(short, long_q, long_q)
    with pytest.raises(ValueError, match=r"^query.* must be at most 2\^30|^seqlen of query"):
        scaled_dot_product_attention(long_q.transpose(1, 2), short.transpose(1, 2), short.transpose(1, 2))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^max_seqlen_k must be in \[0, 2\^30\]"):
        flash_attn_varlen_func(short[0], short[0], short[0], cu, cu, 4, big)
    with pytest.raises(ValueError, match=r"capacity \(1073741825 tokens\) must be at most 2\^30"):
        flash_attn_with_kvcache(short[:, :1], long_q, long_q, cache_seqlens=3)
    with pytest.raises(ValueError, match=r"^seqlen of q must be at most 2\^30"):
        flash_attn_with_kvcache(long_q, short, short)
