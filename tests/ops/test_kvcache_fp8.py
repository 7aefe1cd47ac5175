"""FP8 (float8_e4m3fn) KV cache in ``flash_attn_with_kvcache`` (``k_descale`` / ``v_descale``).

Oracle: :func:`tests._oracle.attention_ref` (float64) of the *dequantised* cache
(``k8 * k_descale``: exact in float64), at the bf16 / fp16 tolerance of the table, which
is what :func:`flashtile.reference.decoding.fp8_cache_decoding` computes (cross-checked
here).  The append's quantisation is checked bit for bit against torch's
``(x.float() / descale).clamp(-448, 448).to(float8_e4m3fn)`` and the float64 simulation
:func:`flashtile.reference.decoding.quantize_cache_rows`.
"""

from __future__ import annotations

import pytest
import torch
from tests._oracle import assert_close, attention_ref

from flashtile import flash_attn_with_kvcache, quantize_per_head
from flashtile.reference.decoding import fp8_cache_decoding, quantize_cache_rows

FP8 = torch.float8_e4m3fn


def rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def torch_quant(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """(B, N, Hk, d) new rows quantised with (B, Hk) descales, by torch's cast."""
    return (x.float() / descale[:, None, :, None].float()).clamp(-448, 448).to(FP8)


def dequant(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """(B, N, Hk, d) e4m3 times its (B, Hk) descale, float64 (exact)."""
    return x8.double() * descale.double()[:, None, :, None].to(x8.device)


def oracle(q, k_full, v_full, lens, **kw):
    """float64 attention of q (B, Nq, Hq, d) against keys [0, lens[b]) of (B, N, Hk, d) caches; flash-attn layout out."""
    lens = torch.as_tensor(lens).cpu().long()
    o, lse = attention_ref(
        q.double().cpu().transpose(1, 2), k_full.double().cpu().transpose(1, 2), v_full.double().cpu().transpose(1, 2),
        lens=lens, scale=q.shape[-1] ** -0.5, **kw,
    )
    return o.transpose(1, 2), lse


def fp8_problem(b, n, hq, hk, d, n_new, device, dtype=torch.bfloat16, seed=0):
    q = rand(b, 1, hq, d, seed=seed).to(device, dtype)
    k = rand(b, n, hk, d, seed=seed + 1, scale=2.0)
    v = rand(b, n, hk, d, seed=seed + 2)
    k8, kd = quantize_per_head(k, layout="bnhd")
    v8, vd = quantize_per_head(v, layout="bnhd")
    kn = rand(b, n_new, hk, d, seed=seed + 3, scale=2.0).to(device, dtype)
    vn = rand(b, n_new, hk, d, seed=seed + 4).to(device, dtype)
    return q, k8.to(device), v8.to(device), kd.to(device), vd.to(device), kn, vn, k, v


@pytest.mark.parametrize("paged", [False, True])
def test_fp8_cache_append_and_attend(device, paged):
    """GQA 4/2, an append of 2 rows, 3 splits, ragged lengths (one empty): the cache holds the rows
    quantised bit for bit as torch's cast, and the output matches float64 attention of the
    dequantised cache (and the float64 twin) at the bf16 tolerance."""
    b, n, hq, hk, d, n_new = 3, 64, 4, 2, 32, 2
    q, k8, v8, kd, vd, kn, vn, _, _ = fp8_problem(b, n, hq, hk, d, n_new, device)
    lens = torch.tensor([5, 40, 0], dtype=torch.int32, device=device)
    kw = dict(cache_seqlens=lens, k_descale=kd, v_descale=vd, num_splits=3, return_lse=True, causal=True)
    if paged:
        page = 16
        perm = torch.randperm(b * n // page, generator=torch.Generator().manual_seed(5))
        table = perm.view(b, n // page).to(device, torch.int32)
        k_pool, v_pool = torch.empty_like(k8.view(-1, page, hk, d)), torch.empty_like(v8.view(-1, page, hk, d))
        k_pool.view(torch.uint8)[table.long()] = k8.view(torch.uint8).view(b, -1, page, hk, d)
        v_pool.view(torch.uint8)[table.long()] = v8.view(torch.uint8).view(b, -1, page, hk, d)
        out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, kn, vn, block_table=table, **kw)
        k_after = k_pool.view(torch.uint8)[table.long()].reshape(b, n, hk, d).view(FP8)
        v_after = v_pool.view(torch.uint8)[table.long()].reshape(b, n, hk, d).view(FP8)
    else:
        k_after, v_after = k8, v8
        out, lse = flash_attn_with_kvcache(q, k8, v8, kn, vn, **kw)
    for x8, new, ds, name in ((k_after, kn, kd, "k"), (v_after, vn, vd, "v")):
        want = torch_quant(new, ds)
        sim = quantize_cache_rows(new.transpose(1, 2), ds).transpose(1, 2)
        for bi, start in enumerate(lens.tolist()):
            got = x8[bi, start : start + n_new]
            assert torch.equal(got.view(torch.uint8), want[bi].view(torch.uint8)), f"{name} rows of element {bi}"
            assert torch.equal(got.double(), sim[bi]), f"{name} rows of element {bi} vs round_e4m3"
    full = (lens + n_new).tolist()
    ref_o, ref_l = oracle(q, dequant(k_after, kd), dequant(v_after, vd), full, causal=True)
    assert_close(out, ref_o, what="out")
    assert_close(lse, ref_l, dtype=torch.float32, tol=1e-2, what="lse")
    twin = fp8_cache_decoding(
        q.double().transpose(1, 2), k_after.transpose(1, 2), v_after.transpose(1, 2), kd, vd,
        num_splits=3, cache_seqlens=full, causal=True,
    )
    assert_close(twin.out.transpose(1, 2), ref_o, dtype=torch.float64, what="twin")


def test_fp8_cache_fp16_window_softcap_single_split(device):
    """fp16 q, a sliding window and softcap, one split (the kernel writes the output itself)."""
    b, n, hq, hk, d = 2, 48, 2, 1, 16
    q, k8, v8, kd, vd, _, _, _, _ = fp8_problem(b, n, hq, hk, d, 0, device, dtype=torch.float16, seed=3)
    lens = [48, 17]
    out = flash_attn_with_kvcache(
        q, k8, v8, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device), k_descale=kd, v_descale=vd,
        window_size=(20, 0), softcap=5.0, num_splits=1,
    )
    ref, _ = oracle(q, dequant(k8, kd), dequant(v8, vd), lens, window=(20, 0), softcap=5.0)
    assert_close(out, ref, what="out")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy reports the fallback's overflow
def test_fp8_cache_unified_max_alibi_kernel_level_inference_mode(device):
    """FlashDecoding++ (a unified max far from the scores: every row falls back exactly) and ALiBi on an
    FP8 cache, through flash_decode (the kernel-level entry), under inference_mode."""
    from flashtile.runtime.decode import flash_decode

    b, n, hq, hk, d = 2, 40, 4, 1, 16
    q, k8, v8, kd, vd, _, _, _, _ = fp8_problem(b, n, hq, hk, d, 0, device, seed=7)
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4], device=device)
    lens = torch.tensor([40, 9], dtype=torch.int32, device=device)
    with torch.inference_mode():
        out, lse, flags = flash_decode(q, k8, v8, lens, alibi_slopes=slopes, unified_max=200.0, num_splits=2,
                                       return_recomputed=True, k_descale=kd, v_descale=vd)
    ref_o, ref_l = oracle(q, dequant(k8, kd), dequant(v8, vd), lens.tolist(), alibi=slopes.cpu().double())
    assert (flags != 0).all()
    assert_close(out, ref_o, what="out")
    assert_close(lse, ref_l, dtype=torch.bfloat16, what="lse")


def test_fp8_descales_at_any_offset_and_stride(device):
    """Descales that are views at a 4-byte offset (not 16-byte aligned) and transposed strides work,
    after a call with aligned ones (the launch is keyed by their alignment)."""
    b, n, hq, hk, d, n_new = 2, 32, 4, 2, 16, 1
    q, k8, v8, kd, vd, kn, vn, _, _ = fp8_problem(b, n, hq, hk, d, n_new, device, seed=9)
    lens = torch.tensor([3, 30], dtype=torch.int32, device=device)
    k_ref, v_ref = k8.clone(), v8.clone()
    want = flash_attn_with_kvcache(q, k_ref, v_ref, kn, vn, cache_seqlens=lens, k_descale=kd, v_descale=vd)
    kd_odd = torch.cat([torch.ones(1, device=device), kd.flatten()])[1:].view(b, hk)
    vd_t = vd.t().contiguous().t()
    got = flash_attn_with_kvcache(q, k8, v8, kn, vn, cache_seqlens=lens, k_descale=kd_odd, v_descale=vd_t)
    assert torch.equal(got, want)
    assert torch.equal(k8.view(torch.uint8), k_ref.view(torch.uint8))


def test_fp8_append_saturates_and_rounds_to_even(device):
    """New rows past ±448 * descale saturate to ±448; exact ties round to the even e4m3 neighbour;
    -0 keeps its sign; subnormals (below 2^-6) keep their 2^-9 spacing."""
    b, hk, d = 1, 1, 16
    kd = torch.full((b, hk), 0.5, device=device)
    vd = torch.full((b, hk), 1.0, device=device)
    vals = torch.tensor([1e4, -1e4, 460.0, 232.0, 104.0, 100.0, -0.0, 0.0, 2.0**-8 * 3, 2.0**-10, 9.0, 17.0,
                         -19.0, 1.0625, 300.0, -120.0]) * 0.5  # k / 0.5 = the values above
    kn = vals.view(1, 1, 1, d).to(device, torch.bfloat16)
    vn = kn.clone()
    k8 = torch.zeros(b, 16, hk, d, dtype=FP8, device=device)
    v8 = torch.zeros_like(k8)
    q = torch.ones(b, 1, 1, d, dtype=torch.bfloat16, device=device)
    flash_attn_with_kvcache(q, k8, v8, kn, vn, cache_seqlens=3, k_descale=kd, v_descale=vd)
    got = k8[0, 3, 0]
    want = torch_quant(kn, kd)[0, 0, 0]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got[0].item() == 448.0 and got[1].item() == -448.0
    assert torch.signbit(got[6].float()) and not torch.signbit(got[7].float())
    assert torch.equal(v8[0, 3, 0].view(torch.uint8), torch_quant(vn, vd)[0, 0, 0].view(torch.uint8))


def test_fp8_error_table(device):
    """The error an FP8 cache adds, next to a bf16 cache's, both against float64 attention of the
    unquantised (fp32) cache: the table in docs/decoding.md ("FP8 KV cache") comes from this
    test's shapes (B 2, Hq 8, Hk 2, d 64, 256 keys, 2 splits); its bounds are e4m3's rounding
    (2^-4 relative per element) averaged by the softmax, and bf16's tolerance."""
    b, n, hq, hk, d = 2, 256, 8, 2, 64
    q32 = rand(b, 1, hq, d, seed=11)
    k32, v32 = rand(b, n, hk, d, seed=12), rand(b, n, hk, d, seed=13)
    q = q32.to(device, torch.bfloat16)
    exact, _ = oracle(q, k32, v32, [n] * b)  # float64 of the bf16 q against the fp32 cache
    bf16 = flash_attn_with_kvcache(q, k32.to(device, torch.bfloat16), v32.to(device, torch.bfloat16), num_splits=2)
    k8, kd = quantize_per_head(k32, layout="bnhd")
    v8, vd = quantize_per_head(v32, layout="bnhd")
    fp8 = flash_attn_with_kvcache(q, k8.to(device), v8.to(device), k_descale=kd.to(device), v_descale=vd.to(device),
                                  num_splits=2)
    scale = float(exact.abs().max())
    err_bf16 = float((bf16.double().cpu() - exact).abs().max()) / scale
    err_fp8 = float((fp8.double().cpu() - exact).abs().max()) / scale
    twin, _ = oracle(q, dequant(k8, kd), dequant(v8, vd), [n] * b)
    err_twin = float((fp8.double().cpu() - twin).abs().max()) / scale
    print(f"\nmax |err| / max |ref| vs float64: bf16 cache {err_bf16:.2e}, fp8 cache {err_fp8:.2e}, "
          f"fp8 kernel vs its float64 twin {err_twin:.2e}")
    assert err_bf16 < 1e-2
    assert err_twin < 1e-2  # the kernel's own rounding is bf16's
    assert err_fp8 < 6.25e-2  # at most e4m3's per-element relative rounding, here averaged over 256 keys
    assert err_fp8 > err_bf16 / 4  # the quantisation is really there (e4m3 is 16x coarser than bf16)


def _args(device):
    q, k8, v8, kd, vd, kn, vn, _, _ = fp8_problem(2, 32, 2, 1, 16, 1, device, seed=21)
    return dict(q=q, k_cache=k8, v_cache=v8, k=kn, v=vn, cache_seqlens=4, k_descale=kd, v_descale=vd)


BAD = [
    ("k_descale is required", lambda a: a.update(k_descale=None), ValueError),
    ("v_descale is required", lambda a: a.update(v_descale=None), ValueError),
    ("k_descale must have dtype torch.float32", lambda a: a.update(k_descale=a["k_descale"].half()), TypeError),
    ("v_descale must have shape", lambda a: a.update(v_descale=a["v_descale"].view(-1)), ValueError),
    ("k_descale must have shape", lambda a: a.update(k_descale=torch.ones(2, 2, device=a["q"].device)), ValueError),
    ("k_descale must be a float32 torch.Tensor", lambda a: a.update(k_descale=1.0), TypeError),
    ("v_descale must be on the device", lambda a: a.update(v_descale=torch.ones(2, 1, device="meta")), ValueError),
    ("q must be torch.float16 or torch.bfloat16", lambda a: a.update(q=a["q"].float()), TypeError),
    ("v_cache must be torch.float8_e4m3fn", lambda a: a.update(v_cache=a["v_cache"].to(torch.bfloat16)), TypeError),
    ("k must have the dtype of q", lambda a: a.update(k=a["k"].to(FP8), v=a["v"].to(FP8)), TypeError),
    ("k_descale is only for", lambda a: a.update(k_cache=a["k_cache"].to(torch.bfloat16),
                                                v_cache=a["v_cache"].to(torch.bfloat16)), ValueError),
]


@pytest.mark.parametrize("match, change, exc", BAD, ids=[m.split()[0] + str(i) for i, (m, _, _) in enumerate(BAD)])
def test_fp8_bad_inputs_raise_before_writing(device, match, change, exc):
    args = _args(device)
    change(args)
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"].view(torch.uint8) if args["k_cache"].dtype == FP8 else args["k_cache"],
                       before[0].view(torch.uint8) if before[0].dtype == FP8 else before[0])


def test_fp8_debug_checks_descale_values(device):
    args = _args(device)
    args["v_descale"] = args["v_descale"].clone()
    args["v_descale"][1, 0] = 0.0
    before = args["k_cache"].clone()
    with pytest.raises(ValueError, match="v_descale must be finite and > 0"):
        flash_attn_with_kvcache(**args, debug=True)
    assert torch.equal(args["k_cache"].view(torch.uint8), before.view(torch.uint8))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy divides by the bad descale
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("which", ["k_descale", "v_descale"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0], ids=["nan", "inf", "zero", "negative"])
def test_fp8_bad_descale_values_output_empty_rows(device, which, bad, splits):
    """Without debug, a k or v descale of (element 0, kv head 1) that is not finite and > 0: that head's rows
    output 0 with lse -inf and append nothing, every other head is bit for bit the result with a good descale,
    and check_errors names the descales."""
    from flashtile import check_errors

    b, n, hq, hk, d = 2, 40, 4, 2, 16
    q, k8, v8, kd, vd, kn, vn, _, _ = fp8_problem(b, n, hq, hk, d, 1, device, seed=20)
    lens = torch.tensor([17, 30], dtype=torch.int32, device=device)
    ref_caches = k8.clone(), v8.clone()
    ref, ref_lse = flash_attn_with_kvcache(q, *ref_caches, kn, vn, cache_seqlens=lens, k_descale=kd, v_descale=vd,
                                           num_splits=splits, return_lse=True)
    descales = dict(k_descale=kd.clone(), v_descale=vd.clone())
    descales[which][0, 1] = bad
    caches = k8.clone(), v8.clone()
    out, lse = flash_attn_with_kvcache(q, *caches, kn, vn, cache_seqlens=lens, **descales, num_splits=splits,
                                       return_lse=True)
    with pytest.raises(ValueError, match="FP8 descales"):
        check_errors()
    heads = slice(2, 4)  # the q heads of kv head 1
    assert torch.equal(out[0, :, heads].float().cpu(), torch.zeros(1, 2, d))
    assert bool((lse[0, heads] == float("-inf")).all())
    keep = torch.ones(b, hq, dtype=torch.bool)
    keep[0, heads] = False
    assert torch.equal(out.transpose(1, 2)[keep], ref.transpose(1, 2)[keep]) and torch.equal(lse[keep], ref_lse[keep])
    for cache, ref_cache, x8 in zip(caches, ref_caches, (k8, v8)):
        as_bytes = lambda x: x.view(torch.uint8).cpu()  # noqa: E731
        assert torch.equal(as_bytes(cache[0, :, 1]), as_bytes(x8[0, :, 1])), "the bad head appended nothing"
        assert torch.equal(as_bytes(cache[:, :, 0]), as_bytes(ref_cache[:, :, 0]))
        assert torch.equal(as_bytes(cache[1]), as_bytes(ref_cache[1]))


# --------------------------------------------------------------------------- #
# GPU: at scale, in a CUDA graph, under inference_mode
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@pytest.mark.parametrize("batch, cache, paged", [(1, 131072, False), (8, 32768, True)])
def test_gpu_fp8_cache_at_scale(batch, cache, paged):
    """Hq 32 / Hk 8, d 128, bf16 q, heuristic splits; checked on two heads of two elements against
    float64 attention of the dequantised cache."""
    dev, hq, hk, d = "cuda", 32, 8, 128
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(batch, 1, hq, d, device=dev, generator=g, dtype=torch.bfloat16)
    k = torch.randn(batch, cache, hk, d, device=dev, generator=g)
    v = torch.randn(batch, cache, hk, d, device=dev, generator=g)
    k8, kd = quantize_per_head(k, layout="bnhd")
    v8, vd = quantize_per_head(v, layout="bnhd")
    del k, v
    lens = torch.randint(cache // 2, cache, (batch,), device=dev, generator=g, dtype=torch.int32)
    kw = dict(cache_seqlens=lens, k_descale=kd, v_descale=vd, causal=True)
    if paged:
        page = 256
        table = torch.randperm(batch * cache // page, device=dev, generator=g).view(batch, -1).int()
        kp, vp = torch.empty_like(k8).view(-1, page, hk, d), torch.empty_like(v8).view(-1, page, hk, d)
        kp.view(torch.uint8)[table.long()] = k8.view(torch.uint8).view(batch, -1, page, hk, d)  # bytes: no fp8 index_put needed
        vp.view(torch.uint8)[table.long()] = v8.view(torch.uint8).view(batch, -1, page, hk, d)
        out = flash_attn_with_kvcache(q, kp, vp, block_table=table, **kw)
    else:
        out = flash_attn_with_kvcache(q, k8, v8, **kw)
    for bi in {0, batch - 1}:
        n = int(lens[bi])
        for h in (0, hq - 1):
            kv = h // (hq // hk)
            kk = k8[bi, :n, kv].float().double() * kd[bi, kv].double()
            vv = v8[bi, :n, kv].float().double() * vd[bi, kv].double()
            p = torch.softmax((q[bi, 0, h].double() @ kk.T) * d**-0.5, -1)
            assert_close(out[bi, 0, h], p @ vv, what=f"b{bi} h{h}")


@pytest.mark.gpu
def test_gpu_fp8_error_table_at_scale():
    """The docs' error table at scale: B 4, 32k keys, Hq 32 / Hk 8, d 128, bf16 q; the FP8 and bf16
    caches' errors against float64 attention of the unquantised fp32 cache, on 4 heads of each element."""
    dev, b, n, hq, hk, d = "cuda", 4, 32768, 32, 8, 128
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(b, 1, hq, d, device=dev, generator=g).bfloat16()
    k = torch.randn(b, n, hk, d, device=dev, generator=g)
    v = torch.randn(b, n, hk, d, device=dev, generator=g)
    o16 = flash_attn_with_kvcache(q, k.bfloat16(), v.bfloat16())
    k8, kd = quantize_per_head(k, layout="bnhd")
    v8, vd = quantize_per_head(v, layout="bnhd")
    o8 = flash_attn_with_kvcache(q, k8, v8, k_descale=kd, v_descale=vd)
    errs = {"bf16": [], "fp8": []}
    for bi in range(b):
        for h in (0, 9, 18, 31):
            kv = h // (hq // hk)
            p = torch.softmax((q[bi, 0, h].double() @ k[bi, :, kv].double().T) * d**-0.5, -1)
            exact = p @ v[bi, :, kv].double()
            for name, o in (("bf16", o16), ("fp8", o8)):
                errs[name].append(float((o[bi, 0, h].double() - exact).norm() / exact.norm()))
    worst = {name: max(e) for name, e in errs.items()}
    print(f"\nrelative L2 error vs float64 at 32k keys (worst of 16 heads): {worst}")
    assert worst["bf16"] < 1e-2
    assert worst["fp8"] < 6.25e-2


@pytest.mark.gpu
def test_gpu_fp8_cache_graph_and_inference_mode():
    """An append + attend step with an FP8 cache captured in a CUDA graph under inference_mode:
    replays read the new lengths and descales, and each replay matches an eager call."""
    from tests._cuda import capture

    dev, b, n, hq, hk, d = "cuda", 4, 4096, 32, 8, 128
    with torch.inference_mode():
        q = torch.randn(b, 1, hq, d, device=dev, dtype=torch.bfloat16)
        k8, kd = quantize_per_head(torch.randn(b, n, hk, d, device=dev), layout="bnhd")
        v8, vd = quantize_per_head(torch.randn(b, n, hk, d, device=dev), layout="bnhd")
        kn, vn = (torch.randn(b, 1, hk, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        lens = torch.tensor([100, 2000, 4000, 0], device=dev, dtype=torch.int32)
        step = lambda: flash_attn_with_kvcache(q, k8, v8, kn, vn, cache_seqlens=lens, k_descale=kd, v_descale=vd)  # noqa: E731
        graph, static = capture(step)
        k_eager, v_eager = k8.clone(), v8.clone()
        for new_lens in ([7, 30, 4094, 1], [3000, 0, 12, 4000]):
            lens.copy_(torch.tensor(new_lens, device=dev, dtype=torch.int32))
            kd.mul_(1.5)
            graph.replay()
            want = flash_attn_with_kvcache(q, k_eager, v_eager, kn, vn, cache_seqlens=lens, k_descale=kd, v_descale=vd)
            torch.cuda.synchronize()
            assert torch.equal(static, want)
            assert torch.equal(k8.view(torch.uint8), k_eager.view(torch.uint8))


def test_fp8_launch_arguments_in_their_named_slots(monkeypatch):
    """The bound FP8 launches (decode and append) pass the descales in the KDescale / VDescale slots and bind
    their strides and KV_FP8 / QUANT under their names (the names equal the kernels' parameters).  CPU, nothing
    is launched."""
    import inspect

    from flashtile.runtime import decode as rd

    b, hq, hk, d = 2, 4, 2, 16
    q = torch.randn(b, 1, hq, d).bfloat16()
    k8 = torch.zeros(b, 32, hk, d, dtype=FP8)
    kd, vd = torch.rand(b, hk), torch.rand(hk, b).t()
    lens = torch.zeros(b, dtype=torch.int32)
    _, launch = rd.decode_launch(q, k8, k8, None, None, left=-1, right=-1, softcap=0.0, unified=False, num_splits=2,
                                 descales=(kd, vd))
    for label, args in launch.arguments.items():
        assert args.names() == tuple(inspect.signature(args.kernel.fn).parameters), label
    static = dict(launch.arguments["fused"].static)
    assert (static["stride_kds_b"], static["stride_kds_h"], static["stride_vds_b"], static["stride_vds_h"]) == (
        *kd.stride(), *vd.stride())
    assert static["KV_FP8"] is True
    recorded = []
    monkeypatch.setattr(launch, "fused", lambda *a: recorded.append(a))
    out, lse = torch.empty(b, 1, hq, d, dtype=torch.bfloat16), torch.empty(b, hq, 1)
    launch(q, k8, k8, lens, None, None, out, lse, None, 0.25, 0.0, None, (kd, vd))
    dyn = dict(zip(rd.SPLIT_DYNAMIC, recorded[0]))
    assert dyn["KDescale"] is kd and dyn["VDescale"] is vd
    kn = torch.zeros(b, 1, hk, d, dtype=torch.bfloat16)
    app = rd.append_launch(k8, k8, kn, kn, lens, None, (kd, vd))
    assert app.arguments.names() == tuple(inspect.signature(app.arguments.kernel.fn).parameters)
    assert dict(app.arguments.static)["QUANT"] is True
    got = []
    monkeypatch.setattr(app, "launcher", lambda *a: got.append(a))
    app(k8, k8, kn, kn, lens, None, (kd, vd))
    named = dict(zip(rd.APPEND_DYNAMIC, got[0]))
    assert named["KDescale"] is kd and named["VDescale"] is vd


# --------------------------------------------------------------------------- #
# fp16 MMAs for an FP8 cache (DecodeTuning.f16_mma)
# --------------------------------------------------------------------------- #
@pytest.fixture(params=[dict(), dict(f16_mma=True), dict(f16_mma=True, v_smem16=True), dict(v_smem16=True)],
                ids=["widen", "f16", "f16+v16", "v16"])
def fp8_mode(request):
    """The "fp8" tuning entry with exactly these modes (e4m3 widened to bf16 for bf16 MMAs when neither),
    the other knobs at the table's default, for the test; restored after it."""
    from flashtile.runtime.decode import DECODE_TUNING, set_decode_tuning

    modes = {"f16_mma": False, "v_smem16": False, **request.param}
    old = set_decode_tuning("fp8", DECODE_TUNING["fp8"]._replace(**modes))
    yield request.param
    set_decode_tuning("fp8", old)


@pytest.fixture
def f16_mma():
    from flashtile.runtime.decode import set_decode_tuning

    old = set_decode_tuning("fp8", f16_mma=True, v_smem16=True)
    yield
    set_decode_tuning("fp8", old)


@pytest.mark.parametrize("paged", [False, True])
def test_fp8_cache_modes_rows_of_any_magnitude(device, fp8_mode, paged):
    """fp16 MMAs / V staged as 16-bit: q rows far past fp16's range (3e5), tiny (1e-6) and zero (per-row
    power-of-two scales), an append, ragged lengths and 2 splits, against float64 attention of the
    dequantised cache; the bound launch really runs the modes."""
    from flashtile.runtime import decode as rd

    b, n, hq, hk, d, n_new = 2, 48, 4, 2, 32, 1
    q, k8, v8, kd, vd, kn, vn, _, _ = fp8_problem(b, n, hq, hk, d, n_new, device, seed=31)
    row_mag = torch.tensor([1.0, 3e5, 1e-6, 0.0], device=device)
    q = (q.float() * row_mag[None, None, :, None]).to(torch.bfloat16)
    lens = torch.tensor([47, 6], dtype=torch.int32, device=device)
    kw = dict(cache_seqlens=lens, k_descale=kd, v_descale=vd, num_splits=2, return_lse=True)
    if paged:
        page = 16
        table = torch.arange(b * n // page, device=device, dtype=torch.int32).flip(0).view(b, n // page)
        k_pool, v_pool = torch.empty_like(k8.view(-1, page, hk, d)), torch.empty_like(v8.view(-1, page, hk, d))
        k_pool.view(torch.uint8)[table.long()] = k8.view(torch.uint8).view(b, -1, page, hk, d)
        v_pool.view(torch.uint8)[table.long()] = v8.view(torch.uint8).view(b, -1, page, hk, d)
        out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, kn, vn, block_table=table, **kw)
        k8 = k_pool.view(torch.uint8)[table.long()].reshape(b, n, hk, d).view(FP8)
        v8 = v_pool.view(torch.uint8)[table.long()].reshape(b, n, hk, d).view(FP8)
    else:
        out, lse = flash_attn_with_kvcache(q, k8, v8, kn, vn, **kw)
    _, launch = rd.decode_launch(q, k8, v8, None, None, left=-1, right=-1, softcap=0.0, unified=False, num_splits=2,
                                 descales=(kd, vd))
    static = dict(launch.arguments["fused"].static)
    want = (fp8_mode.get("f16_mma", False), fp8_mode.get("v_smem16", False))
    assert (static["KV_F16_MMA"], static["KV_V_SMEM16"]) == want
    assert torch.isfinite(out).all()
    ref_o, ref_l = oracle(q, dequant(k8, kd), dequant(v8, vd), (lens + n_new).tolist())
    for h in range(hq):  # per head: each row's output against its own scale
        assert_close(out[:, :, h], ref_o[:, :, h], what=f"out head {h}")
    assert_close(lse, ref_l, dtype=torch.float32, tol=1e-2, what="lse")


def test_fp8_modes_only_where_they_apply(f16_mma):
    """The fp16 mode binds KV_F16_MMA for an FP8 cache with bf16 q on the safe path only: not for fp16 q
    (already fp16), FlashDecoding++ (its P may pass fp16's range) or a bf16 cache; KV_V_SMEM16 for any FP8
    cache, never a bf16 one.  CPU, nothing launched."""
    from flashtile.runtime import decode as rd

    b, hq, hk, d = 2, 4, 2, 16
    k8 = torch.zeros(b, 32, hk, d, dtype=FP8)
    ds = (torch.ones(b, hk), torch.ones(b, hk))

    def mode(q, cache, unified=False, descales=ds):
        _, launch = rd.decode_launch(q, cache, cache, None, None, left=-1, right=-1, softcap=0.0, unified=unified,
                                     num_splits=2, descales=descales)
        static = dict(launch.arguments["fused"].static)
        return static["KV_F16_MMA"], static["KV_V_SMEM16"]

    q = torch.zeros(b, 1, hq, d, dtype=torch.bfloat16)
    assert mode(q, k8) == (True, True)
    assert mode(q.half(), k8) == (False, True)
    assert mode(q, k8, unified=True) == (False, True)
    assert mode(q, k8.to(torch.bfloat16), descales=None) == (False, False)
    saved = dict(rd.DECODE_TUNING)
    try:
        rd.set_decode_tuning("default", f16_mma=True, v_smem16=True)  # no effect on a bf16 cache
        assert mode(q, k8.to(torch.bfloat16), descales=None) == (False, False)
        rd.set_decode_tuning("default", saved["default"])
        rd.set_decode_tuning("fp8", f16_mma=False, v_smem16=False)
        assert mode(q, k8) == (False, False)
    finally:  # later tests plan with the defaults
        for kind, tuning in saved.items():
            rd.set_decode_tuning(kind, tuning)


# the candidate tunings the GPU probe (scratch/fp8kv_probe.py) times, each checked here at scale
GPU_TUNINGS = {
    "v16-ps2": dict(per_sm=2, v_smem16=True),
    "f16v16-ps2": dict(per_sm=2, f16_mma=True, v_smem16=True),
    "n128-f16-ps2": dict(block_n=128, per_sm=2, f16_mma=True),
    "n128-f16v16-ps2": dict(block_n=128, per_sm=2, f16_mma=True, v_smem16=True),
    "n128-w8-f16v16-ps2": dict(block_n=128, num_warps=8, per_sm=2, f16_mma=True, v_smem16=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_TUNINGS))
def test_gpu_fp8_tunings_at_scale(name):
    """Each candidate "fp8" tuning: B 8 / 32k keys contiguous and B 2 / 16k keys paged (pages of 256), heuristic
    splits, and B 16 / 2k keys in one split (the kernel writes the output), ragged lengths, Hq 32 / Hk 8, d 128,
    bf16 q with head 1 of every group scaled by 1e5 (past fp16's range) and head 2 by 1e-5; against float64
    attention of the dequantised cache on 4 heads of 2 elements."""
    from flashtile.runtime.decode import set_decode_tuning

    dev, hq, hk, d = "cuda", 32, 8, 128
    old = set_decode_tuning("fp8", **GPU_TUNINGS[name])
    try:
        g = torch.Generator(device=dev).manual_seed(3)
        for batch, cache, paged, splits in ((8, 32768, False, 0), (2, 16384, True, 0), (16, 2048, False, 1)):
            q = torch.randn(batch, 1, hq, d, device=dev, generator=g)
            mag = torch.tensor([1.0, 1e5, 1e-5, 1.0] * (hq // 4), device=dev)
            q = (q * mag[None, None, :, None]).bfloat16()
            k8, kd = quantize_per_head(torch.randn(batch, cache, hk, d, device=dev, generator=g), layout="bnhd")
            v8, vd = quantize_per_head(torch.randn(batch, cache, hk, d, device=dev, generator=g), layout="bnhd")
            lens = torch.randint(1, cache + 1, (batch,), device=dev, generator=g, dtype=torch.int32)
            lens[0] = cache
            kw = dict(cache_seqlens=lens, k_descale=kd, v_descale=vd, causal=True, num_splits=splits)
            if paged:
                page = 256
                table = torch.randperm(batch * cache // page, device=dev, generator=g).view(batch, -1).int()
                kp, vp = torch.empty_like(k8).view(-1, page, hk, d), torch.empty_like(v8).view(-1, page, hk, d)
                kp.view(torch.uint8)[table.long()] = k8.view(torch.uint8).view(batch, -1, page, hk, d)
                vp.view(torch.uint8)[table.long()] = v8.view(torch.uint8).view(batch, -1, page, hk, d)
                out = flash_attn_with_kvcache(q, kp, vp, block_table=table, **kw)
            else:
                out = flash_attn_with_kvcache(q, k8, v8, **kw)
            assert torch.isfinite(out).all()
            for bi in {0, batch - 1}:
                n = int(lens[bi])
                for h in (0, 1, 2, hq - 1):
                    kv = h // (hq // hk)
                    kk = k8[bi, :n, kv].float().double() * kd[bi, kv].double()
                    vv = v8[bi, :n, kv].float().double() * vd[bi, kv].double()
                    p = torch.softmax((q[bi, 0, h].double() @ kk.T) * d**-0.5, -1)
                    assert_close(out[bi, 0, h], p @ vv, what=f"{name} B{batch} paged={paged} b{bi} h{h}")
    finally:
        set_decode_tuning("fp8", old)


@pytest.mark.gpu
@pytest.mark.parametrize("fill", [4, 8])
def test_gpu_bf16_fill_splits_at_batch_64(fill):
    """The "default" tuning with ``fill`` (B 64 then splits 2 / 3 ways and merges): B 64 / 4k keys, ragged,
    against float64 attention on 2 heads of 3 elements; the plan really splits."""
    from flashtile.runtime import decode as rd
    from flashtile.runtime.decode import set_decode_tuning

    dev, b, n, hq, hk, d = "cuda", 64, 4096, 32, 8, 128
    old = set_decode_tuning("default", fill=fill)
    try:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert rd.decode_plan(b, 1, hq, hk, d, None, n, 0, torch.device(dev)).n_splits == -(-fill * sms // (b * hk))
        g = torch.Generator(device=dev).manual_seed(4)
        q = torch.randn(b, 1, hq, d, device=dev, generator=g, dtype=torch.bfloat16)
        k = torch.randn(b, n, hk, d, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn(b, n, hk, d, device=dev, generator=g, dtype=torch.bfloat16)
        lens = torch.randint(1, n + 1, (b,), device=dev, generator=g, dtype=torch.int32)
        out = flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True)
        for bi in (0, 31, 63):
            m = int(lens[bi])
            for h in (0, hq - 1):
                kv = h // (hq // hk)
                p = torch.softmax((q[bi, 0, h].double() @ k[bi, :m, kv].double().T) * d**-0.5, -1)
                assert_close(out[bi, 0, h], p @ v[bi, :m, kv].double(), what=f"fill {fill} b{bi} h{h}")
    finally:
        set_decode_tuning("default", old)
