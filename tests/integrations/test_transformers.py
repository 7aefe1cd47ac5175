"""``attn_implementation="flashtile"`` in Hugging Face transformers models.

Tiny random-weight models built from configs (no downloads).  Each test builds the same weights twice,
once with flashtile and once with transformers' own attention ("sdpa"; "eager" for Gemma 2, whose
softcap SDPA does not support), and compares logits, the gradients of one training step and greedy
generations.  On the CPU the kernels run through Triton's interpreter in fp32 (tolerance: fp32's
table entry, relative to max|ref|); the GPU tests run bf16 and bound flashtile's error by SDPA's own
bf16 error against a float64 model.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashtile.integrations.transformers as ft  # noqa: E402  (registers "flashtile")
from tests._oracle import assert_close  # noqa: E402

VOCAB, SEQ = 128, 24
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, attention_dropout=0.0)


def _config(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(**COMMON)
    if kind == "qwen2":
        return transformers.Qwen2Config(**COMMON)
    if kind == "mistral":  # a window shorter than the sequence, so it masks keys
        return transformers.MistralConfig(**COMMON, sliding_window=6)
    if kind == "gemma2":  # softcap that bites at these score sizes, sliding then global layers
        return transformers.Gemma2Config(**{**COMMON, "head_dim": 32}, sliding_window=7,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
                                         query_pre_attn_scalar=32,
                                         layer_types=["sliding_attention", "full_attention"])
    raise ValueError(kind)


def _reference_impl(kind: str) -> str:
    return "eager" if kind == "gemma2" else "sdpa"


def _models(kind: str, device: str = "cpu", dtype=torch.float32, seed: int = 0):
    """(flashtile model, reference model) with identical weights; weights drawn large enough that
    attention scores are O(1) (transformers' 0.02 init leaves every softmax nearly uniform)."""
    cfg = _config(kind)
    torch.manual_seed(seed)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="flashtile")
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3 if "embed" in name else 0.25)
    theirs = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                           attn_implementation=_reference_impl(kind))
    theirs.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == "flashtile"
    return ours.to(device, dtype).eval(), theirs.to(device, dtype).eval()


def _ids(batch: int, n: int, seed: int = 1, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, n), generator=g).to(device)


def test_registered_on_import():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping["flashtile"] is ft.flashtile_attention_forward
    assert AttentionMaskInterface._global_mapping["flashtile"] is ft.flashtile_mask


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gemma2"])
def test_logits_and_grads_match(kind):
    """Forward logits, then one training step's parameter gradients (train mode, no dropout)."""
    ours, theirs = _models(kind)
    ids = _ids(2, SEQ)
    for m in (ours, theirs):
        m.train()
    out_ours = ours(ids, labels=ids)
    out_theirs = theirs(ids, labels=ids)
    assert_close(out_ours.logits, out_theirs.logits, what=f"{kind} logits")
    out_ours.loss.backward()
    out_theirs.loss.backward()
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        assert_close(p.grad, theirs_params[name].grad, what=f"{kind} grad {name}")


def test_window_reaches_exactly_sliding_window_keys():
    """transformers' sliding_window = w: query i sees keys i - w < j <= i (w keys).  Changing the key
    exactly w positions back must not change row i; changing the one w - 1 back must."""
    w, n, d = 5, 12, 16

    class Module(torch.nn.Module):
        is_causal = True

    q, k, v = (torch.randn(1, 2, n, d, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3))
    base, _ = ft.flashtile_attention_forward(Module(), q, k, v, None, sliding_window=w)
    i = n - 1
    for back, changes in ((w, False), (w - 1, True)):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, i - back] += 1.0
        v2[:, :, i - back] += 1.0
        out, _ = ft.flashtile_attention_forward(Module(), q, k2, v2, None, sliding_window=w)
        moved = (out[0, i] - base[0, i]).abs().max().item()
        assert (moved > 1e-3) == changes, (back, moved)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_greedy_generate_matches(kind):
    """A prompt longer than the sliding windows, then decoding through the KV cache (q_len 1,
    bottom-right causal against the cache)."""
    ours, theirs = _models(kind)
    ids = _ids(2, 12, seed=3)
    kw = dict(max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        got, want = ours.generate(ids, **kw), theirs.generate(ids, **kw)
    assert got.shape == want.shape == (2, 16)
    assert torch.equal(got, want)


def test_decoding_steps_run_the_decode_kernel(monkeypatch):
    """Prompt 20 (> 16 query tokens: flash_attn_func), then 2 cached steps per layer through
    flash_attn_with_kvcache (q_len 1 against the grown cache); tokens equal SDPA's.  A training forward
    (gradients) of a short sequence stays on flash_attn_func."""
    import flashtile

    calls = []
    for name in ("flash_attn_func", "flash_attn_with_kvcache"):
        real = getattr(flashtile, name)
        monkeypatch.setattr(flashtile, name, lambda *a, _f=real, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    ours, theirs = _models("llama")
    ids = _ids(2, 20, seed=6)
    kw = dict(max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        got, want = ours.generate(ids, **kw), theirs.generate(ids, **kw)
    assert torch.equal(got, want)
    layers = ours.config.num_hidden_layers
    assert calls == ["flash_attn_func"] * layers + ["flash_attn_with_kvcache"] * (2 * layers)
    calls.clear()
    ours.train()
    ours(ids[:, :8], labels=ids[:, :8]).loss.backward()
    assert calls == ["flash_attn_func"] * layers


def test_decoding_step_in_train_mode_runs_flash_attn_func(monkeypatch):
    """One query token against a cache under no_grad with dropout 0 takes the decode kernel in eval mode only:
    a module in train mode stays on flash_attn_func (the path that applies the module's dropout)."""
    import flashtile

    calls = []
    for name in ("flash_attn_func", "flash_attn_with_kvcache"):
        real = getattr(flashtile, name)
        monkeypatch.setattr(flashtile, name, lambda *a, _f=real, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    module = torch.nn.Module()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 1, 16, generator=g)
    k, v = torch.randn(1, 2, 9, 16, generator=g), torch.randn(1, 2, 9, 16, generator=g)
    with torch.no_grad():
        for training in (False, True):
            out, _ = ft.flashtile_attention_forward(module.train(training), q, k, v, None)
            ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
            assert_close(out, ref.transpose(1, 2), what=f"training={training}")
    assert calls == ["flash_attn_with_kvcache", "flash_attn_func"]


def _padding_mask(side: str, lens: list[int], n: int) -> torch.Tensor:
    mask = torch.zeros(len(lens), n, dtype=torch.long)
    for b, length in enumerate(lens):
        if side == "left":
            mask[b, n - length:] = 1
        else:
            mask[b, :length] = 1
    return mask


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches(side):
    """Padded rows (one unpadded) -> ragged varlen batch -> re-padded: logits at real tokens and
    gradients equal the reference's (padded positions carry no loss)."""
    ours, theirs = _models("mistral")
    n = 16
    ids = _ids(3, n, seed=4)
    mask = _padding_mask(side, [16, 11, 5], n)
    labels = ids.masked_fill(mask == 0, -100)
    for m in (ours, theirs):
        m.train()
    a = ours(ids, attention_mask=mask, labels=labels)
    b = theirs(ids, attention_mask=mask, labels=labels)
    real = mask.bool()
    assert_close(a.logits[real], b.logits[real], what=f"{side}-padded logits")
    a.loss.backward()
    b.loss.backward()
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert_close(p.grad, theirs_params[name].grad, what=f"{side}-padded grad {name}")


def test_left_padded_generate_matches():
    ours, theirs = _models("gemma2")
    ids = _ids(2, 10, seed=5)
    mask = _padding_mask("left", [10, 6], 10)
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got, want = ours.generate(ids, **kw), theirs.generate(ids, **kw)
    assert torch.equal(got, want)


def test_static_cache_generate_matches():
    """A static cache holds more key slots than tokens: the padding mask (kept for flash-type
    implementations under a static cache) is shorter than the keys, whose unused tail is never read."""
    ours, theirs = _models("llama")
    ids = _ids(2, 10, seed=5)
    mask = _padding_mask("left", [10, 6], 10)
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        got, want = ours.generate(ids, **kw), theirs.generate(ids, **kw)
    assert torch.equal(got, want)


@pytest.mark.skipif(not transformers.__version__.startswith("5"), reason="transformers 5's mask-function signature")
def test_overlay_mask_functions_get_a_dense_mask():
    """A model's or-overlay (here: the first 4 tokens see each other) cannot be expressed by causal
    + padding: the mask function hands the dense mask transformers' SDPA would get."""
    from transformers.masking_utils import causal_mask_function, or_masks, sdpa_mask

    def prefix(b, h, q, kv):
        return (q < 4) & (kv < 4)

    kw = dict(batch_size=1, q_length=8, kv_length=8, q_offset=0, kv_offset=0,
              mask_function=or_masks(causal_mask_function, prefix), attention_mask=None, device="cpu")
    got = ft.flashtile_mask(**kw, use_vmap=True)
    want = sdpa_mask(**kw, use_vmap=True, allow_is_causal_skip=False)
    assert got is not None and got.dim() == 4 and torch.equal(got, want)
    assert bool(got[0, 0, 0, 3]) and not bool(got[0, 0, 5, 6])


def _assert_documents_match(packed: torch.Tensor, ids: torch.Tensor, docs: list[list[int]], theirs) -> None:
    """Each packed document's logits equal the reference model's on that document alone (transformers
    < 4.54's SDPA path does not keep packed documents apart, so the reference runs them one by one)."""
    with torch.no_grad():
        for r, row in enumerate(docs):
            start = 0
            for length in row:
                doc = ids[r:r + 1, start:start + length]
                alone = theirs(doc, position_ids=torch.arange(length).unsqueeze(0), use_cache=False).logits
                assert_close(packed[r:r + 1, start:start + length], alone, what=f"row {r} document at {start}")
                start += length


def test_packed_position_ids_match():
    """Two rows, each packing documents (position_ids restart at 0)."""
    ours, theirs = _models("llama")
    docs = [[7, 9, 8], [13, 11]]
    ids = _ids(2, 24, seed=6)
    pos = torch.cat([torch.cat([torch.arange(L) for L in row]).unsqueeze(0) for row in docs])
    with torch.no_grad():
        packed = ours(ids, position_ids=pos, use_cache=False).logits
    _assert_documents_match(packed, ids, docs, theirs)


def test_packed_cu_seqlens_kwargs():
    """transformers' FlashAttentionKwargs (flattened batch of one row) are used as given: the
    position_ids here do not restart, so only cu_seq_lens can keep the documents apart."""
    ours, theirs = _models("qwen2")
    lens = [9, 6, 9]
    ids = _ids(1, sum(lens), seed=7)
    cu = torch.tensor([0, 9, 15, 24], dtype=torch.int32)
    with torch.no_grad():
        packed = ours(ids, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9).logits
    # rotary positions follow position_ids (0..23 here); the reference gets the same positions per document
    with torch.no_grad():
        start = 0
        for length in lens:
            alone = theirs(ids[:, start:start + length], position_ids=torch.arange(start, start + length)[None],
                           use_cache=False).logits
            assert_close(packed[:, start:start + length], alone, what=f"document at {start}")
            start += length


def test_four_d_mask_runs_dense():
    """A model-supplied 4-D boolean mask goes through the masked path."""
    ours, theirs = _models("llama")
    n = 12
    ids = _ids(1, n, seed=8)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    mask[6:, :6] = False  # two blocks that do not see each other
    mask4 = mask[None, None]
    with torch.no_grad():
        a = ours(ids, attention_mask=mask4).logits
        b = theirs(ids, attention_mask=mask4).logits
    assert_close(a, b, what="4-D mask logits")


def test_dropout_in_training():
    """attention_dropout reaches the kernels in train mode only: train-mode logits differ from eval's,
    are reproducible under the same seed, and eval mode matches the reference."""
    cfg_models = _models("llama")
    ours = cfg_models[0]
    for layer in ours.model.layers:
        layer.self_attn.attention_dropout = 0.5
    ids = _ids(1, 16, seed=9)
    with torch.no_grad():
        ev = ours.eval()(ids).logits
        ours.train()
        torch.manual_seed(0)
        t1 = ours(ids).logits
        torch.manual_seed(0)
        t2 = ours(ids).logits
    assert torch.isfinite(t1).all()
    assert torch.equal(t1, t2)
    assert (t1 - ev).abs().max() > 1e-2
    assert_close(ev, cfg_models[1](ids).logits.detach(), what="eval logits")


def test_bad_masks_raise():
    class Module(torch.nn.Module):
        is_causal = True

    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="attention_mask"):
        ft.flashtile_attention_forward(Module(), q, q, q, torch.ones(1, 2, 4, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="s_aux"):
        ft.flashtile_attention_forward(Module(), q, q, q, None, s_aux=torch.zeros(2))
    with pytest.raises(NotImplementedError, match="block_table"):
        ft.flashtile_attention_forward(Module(), q, q, q, None, block_table=torch.zeros(1, 1, dtype=torch.int32),
                                       k_cache=q, v_cache=q)


def test_padding_plan_once_per_forward(monkeypatch):
    """One forward computes the padding plan once (its host reads), not once per layer; the next forward
    plans again and reads the mask as it is then (here rewritten in place without a version bump)."""
    calls = []
    real = ft._padding_plan
    monkeypatch.setattr(ft, "_padding_plan", lambda *a: calls.append(1) or real(*a))
    ours, theirs = _models("llama")
    ids = _ids(2, 8, seed=11)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8], dtype=torch.bool)
    for step in range(2):
        if step:
            mask.numpy()[1, :3] = False
        with torch.no_grad():
            a = ours(ids, attention_mask=mask, use_cache=False).logits
            b = theirs(ids, attention_mask=mask, use_cache=False).logits
        assert_close(a[mask], b[mask], what=f"forward {step}")
        assert len(calls) == step + 1


def test_padding_mask_rewritten_in_place_is_reread():
    """A 2-D mask handed to the attention function directly, rewritten between calls by writes that leave
    its version counter alone (numpy, ``.data``): each call attends to the mask as it is then."""
    class Module(torch.nn.Module):
        is_causal = True

    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, 2, 6, 16, generator=g) for _ in range(3))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :2] = False
    for write in (None, lambda m: m.numpy().__setitem__((1, slice(0, 3)), False),
                  lambda m: m.data.__setitem__((0, slice(0, 4)), False)):
        if write is not None:
            write(mask)
        out, _ = ft.flashtile_attention_forward(Module(), q, k, v, mask)
        dense = torch.ones(6, 6, dtype=torch.bool).tril() & mask[:, None, None, :]
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                               attn_mask=dense).transpose(1, 2)
        assert_close(out[mask], ref[mask], what=f"mask {mask.int().tolist()}")


@pytest.mark.parametrize("change", ["batch", "rewrite"])
def test_packed_position_ids_reread_every_forward(change):
    """One position_ids object at batch 1 then at batch 2, or rewritten in place without a version bump
    (numpy): each forward's logits equal SDPA's (a plan kept for the object covered batch 1's rows only,
    or the old documents)."""
    ours, theirs = _models("llama")
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
    for step, batch in enumerate((1, 2) if change == "batch" else (2, 2)):
        if step and change == "rewrite":
            pos.numpy()[:] = [[0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
        ids = _ids(batch, 12, seed=13 + step)
        with torch.no_grad():
            a = ours(ids, position_ids=pos, use_cache=False).logits
            b = theirs(ids, position_ids=pos, use_cache=False).logits
        assert_close(a, b, what=f"forward {step}, batch {batch}")


@pytest.mark.parametrize("mask, use_cache", [(True, False), (False, True), (True, True)])
def test_position_ids_jump_splits_no_row_where_transformers_keeps_one(mask, use_cache):
    """transformers splits rows at position_ids jumps only with no 2-D mask and no cache; with either
    (a tokenizer's all-ones mask, or use_cache=True) each row stays one sequence, as under SDPA."""
    ours, theirs = _models("llama")
    ids = _ids(2, 12, seed=16)
    pos = torch.cat([torch.arange(6), torch.arange(100, 106)])[None].expand(2, 12)
    kw = dict(position_ids=pos, use_cache=use_cache, attention_mask=torch.ones_like(ids) if mask else None)
    with torch.no_grad():
        assert_close(ours(ids, **kw).logits, theirs(ids, **kw).logits, what=f"mask={mask} use_cache={use_cache}")


def test_mask_functions_the_kernels_cannot_express_go_dense():
    """A mask function with a part other than causal / sliding / packing (here transformers' block-wise
    image overlay and its chunked attention, which it hands over with use_vmap off) gets SDPA's dense mask;
    transformers' packed-sequence function gets the documents' plan."""
    mu = pytest.importorskip("transformers.masking_utils")
    if not all(hasattr(mu, n) for n in ("blockwise_overlay", "chunked_causal_mask_function",
                                        "packed_sequence_mask_function", "remap_positions_for_packed_sequence")):
        pytest.skip("transformers without block-wise / chunked / packed mask functions")
    kw = dict(batch_size=1, q_length=8, kv_length=8, q_offset=0, kv_offset=0, attention_mask=None, device="cpu")
    blocks = torch.tensor([[-1, 0, 0, 0, -1, -1, 1, 1]])
    for fn in (mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(blocks)),
               mu.chunked_causal_mask_function(3, torch.zeros(1, dtype=torch.long))):
        got = ft.flashtile_mask(**kw, mask_function=fn)
        want = mu.sdpa_mask(**kw, mask_function=fn, allow_is_causal_skip=False)
        assert got is not None and got.dim() == 4 and torch.equal(got, want)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    docs = mu.find_packed_sequence_indices(pos)
    fn = mu.and_masks(mu.remap_positions_for_packed_sequence(mu.sliding_window_causal_mask_function(2), pos),
                      mu.packed_sequence_mask_function(docs))
    got = ft.flashtile_mask(**kw, mask_function=fn)
    assert isinstance(got, ft._PackedMask) and got.plan.cu_q.tolist() == [0, 3, 5, 8] and got.plan.max_q == 3
    assert ft.flashtile_mask(**kw, mask_function=mu.sliding_window_causal_mask_function(2)) is None


def test_mask_function_passes_padding_only():
    m = torch.ones(2, 6, dtype=torch.bool)
    assert ft.flashtile_mask(batch_size=2, attention_mask=m, kv_length=6) is None
    assert ft.flashtile_mask(batch_size=2, attention_mask=None, kv_length=6) is None
    m[0, 0] = False
    assert torch.equal(ft.flashtile_mask(batch_size=2, attention_mask=m, kv_length=6), m)
    assert ft.flashtile_mask(batch_size=2, attention_mask=m, kv_length=5) is None  # the padded key fell out


# --------------------------------------------------------------------------- #
# GPU: bf16, flashtile's error bounded by SDPA's own bf16 error against a float64 model
# --------------------------------------------------------------------------- #
def _bf16_error_bound(kind: str, run):
    ours, theirs = _models(kind, device="cuda", dtype=torch.bfloat16)
    _, exact = _models(kind, device="cuda", dtype=torch.float64)  # same seed: the same weights
    with torch.no_grad():
        ref = run(exact).double()
        e_ours = (run(ours).double() - ref)
        e_theirs = (run(theirs).double() - ref)
    scale = ref.abs().max().item()
    assert torch.isfinite(e_ours).all()
    assert e_ours.abs().max().item() <= 2 * e_theirs.abs().max().item() + 1e-2 * scale, kind


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gemma2"])
def test_gpu_bf16_logits(kind):
    ids = _ids(4, 256, device="cuda")
    _bf16_error_bound(kind, lambda m: m(ids).logits)


@pytest.mark.gpu
def test_gpu_bf16_padded_and_packed():
    ids = _ids(3, 200, device="cuda")
    mask = _padding_mask("left", [200, 150, 37], 200).cuda()
    real = mask.bool()
    _bf16_error_bound("mistral", lambda m: m(ids, attention_mask=mask).logits[real])
    pos = torch.cat([torch.arange(L) for L in (64, 100, 36)]).cuda().unsqueeze(0).expand(3, -1)
    _bf16_error_bound("llama", lambda m: m(ids, position_ids=pos, use_cache=False).logits)


@pytest.mark.gpu
def test_gpu_bf16_generate_runs():
    ours, theirs = _models("gemma2", device="cuda", dtype=torch.bfloat16)
    ids = _ids(2, 64, device="cuda")
    with torch.no_grad():
        got = ours.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    assert got.shape == (2, 80)


@pytest.mark.gpu
def test_gpu_bf16_static_cache_windows_and_holes():
    """The CPU tests' static-cache, window and mask-hole paths compiled, in bf16: a static cache without a mask
    (the written slots only), a sliding window over right padding (queries compacted with their keys) and over a
    mask with a hole (the dense path), each within SDPA's own bf16 error of the float64 model."""
    x = _ids(1, 48, seed=3, device="cuda")

    def static(m):
        cache = transformers.StaticCache(config=m.config, max_cache_len=128)
        return m(x, past_key_values=cache, use_cache=True).logits

    _bf16_error_bound("llama", static)
    ids = _ids(2, 64, seed=8, device="cuda")
    right = _padding_mask("right", [64, 40], 64).cuda()
    _bf16_error_bound("mistral", lambda m: m(ids, attention_mask=right).logits[right.bool()])
    holes = torch.ones(2, 64, dtype=torch.long, device="cuda")
    holes[0, 20:30] = 0
    holes[1, :5] = 0
    _bf16_error_bound("mistral", lambda m: m(ids, attention_mask=holes).logits[holes.bool()])


def test_cross_attention_padding_mask_selects_keys_only():
    """Not causal with a (B, keys) mask and fewer or more queries than keys (cross-attention: BART and
    Whisper pass the encoder's padding mask): every query row attends to the unpadded keys, as SDPA does."""
    class Module(torch.nn.Module):
        is_causal = False

    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 2, 12, 16, generator=g)
    v = torch.randn(2, 2, 12, 16, generator=g)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, 8:] = False  # the first encoder row is right-padded
    mask[1, :3] = False  # the second left-padded
    for nq in (4, 12, 16):
        q = torch.randn(2, 2, nq, 16, generator=g)
        out, _ = ft.flashtile_attention_forward(Module(), q, k, v, mask, is_causal=False)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), attn_mask=mask[:, None, None, :]).transpose(1, 2)
        assert out.shape == ref.shape
        assert_close(out, ref, what=f"cross-attention, {nq} queries")


def test_export_with_dynamic_sequence_length():
    """torch.export of the attention function with dynamic query and key counts: the decoding-step test
    must not run its size tests under tracing (they guarded the query count to one side of 16, and the
    export failed its range constraints)."""
    class Module(torch.nn.Module):
        is_causal = True

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return ft.flashtile_attention_forward(Module(), q, k, v, None)[0]

    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 20, 16, generator=g)
    k, v = torch.randn(2, 2, 30, 16, generator=g), torch.randn(2, 2, 30, 16, generator=g)
    s, n = torch.export.Dim("s", min=2, max=64), torch.export.Dim("n", min=2, max=128)
    ep = torch.export.export(Attention(), (q, k, v), dynamic_shapes=({2: s}, {2: n}, {2: n}), strict=False)
    assert sorted((r.lower, r.upper) for r in ep.range_constraints.values()) == [(2, 64), (2, 128)]


def test_static_cache_without_a_mask_reads_only_written_slots():
    """A StaticCache and no attention_mask (the hand-written static-cache loop): the key slots past the written
    ones were attended (causal aligned to the cache's end); the mask function now hands a mask of the written
    slots. Prefill and a decoding step equal the reference's."""
    ours, theirs = _models("llama")
    x = _ids(1, 8, seed=3)
    outs = []
    for m in (ours, theirs):
        cache = transformers.StaticCache(config=m.config, max_cache_len=32)
        with torch.no_grad():
            first = m(x, past_key_values=cache, use_cache=True).logits
            step = m(first[:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits
        outs.append((first, step))
    assert_close(outs[0][0], outs[1][0], what="static prefill")
    assert_close(outs[0][1], outs[1][1], what="static decoding step")


def test_bidirectional_window_follows_transformers_flash_contract():
    """ModernBERT's local layers pass sliding_window = config.sliding_window + 1 for a mask |i - j| <= sliding_window
    (transformers' flash contract: window (w - 1, w - 1)); with right padding the queries are compacted too, so each
    stays aligned with its key."""
    if not hasattr(transformers, "ModernBertConfig"):
        pytest.skip("no ModernBERT in this transformers")
    cfg = transformers.ModernBertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, local_attention=8, global_attn_every_n_layers=2,
                                        pad_token_id=0, max_position_embeddings=64)
    torch.manual_seed(0)
    ours = transformers.AutoModel.from_config(copy.deepcopy(cfg), attn_implementation="flashtile")
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3 if "embed" in name else 0.25)
    theirs = transformers.AutoModel.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    theirs.load_state_dict(ours.state_dict())
    ours.eval(), theirs.eval()
    x = _ids(2, 20, seed=3)
    masks = [None, _padding_mask("right", [20, 14], 20), _padding_mask("left", [20, 14], 20)]
    with torch.no_grad():
        for mask in masks:
            a, b = ours(x, attention_mask=mask).last_hidden_state, theirs(x, attention_mask=mask).last_hidden_state
            real = torch.ones(2, 20, dtype=torch.bool) if mask is None else mask.bool()
            assert_close(a[real], b[real], what=f"modernbert, mask {None if mask is None else mask.tolist()}")


def test_window_over_a_mask_with_holes_runs_dense():
    """Real tokens not contiguous in a row (a hole in the 2-D mask) with a sliding window: compacting them would
    count the window in compacted positions; such calls run the dense masked path and equal the reference."""
    ours, theirs = _models("mistral")
    x = _ids(2, 14, seed=8)
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[0, 5:8] = 0
    mask[1, :2] = 0  # left padding only: the ragged path, as before
    with torch.no_grad():
        a, b = ours(x, attention_mask=mask).logits, theirs(x, attention_mask=mask).logits
    assert_close(a[mask.bool()], b[mask.bool()], what="window over a mask with a hole")


def test_score_changing_kwargs_are_refused():
    """Keyword arguments the kernels do not express (T5's position_bias, attention sinks, sparse key indices)
    raise instead of being dropped (T5's logits were silently wrong)."""
    q = torch.zeros(1, 2, 4, 16)
    module = torch.nn.Module()
    for name in ("position_bias", "sinks", "s_aux", "indices"):
        with pytest.raises(NotImplementedError, match=name):
            ft.flashtile_attention_forward(module, q, q, q, None, **{name: torch.zeros(1)})
    if hasattr(transformers, "T5Config"):
        cfg = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                    decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
        try:
            model = transformers.AutoModelForSeq2SeqLM.from_config(cfg, attn_implementation="flashtile").eval()
        except (ValueError, ImportError):
            return  # a transformers whose T5 does not take attention-interface implementations: nothing to run
        with pytest.raises(NotImplementedError, match="position_bias"):
            model(input_ids=_ids(1, 6), decoder_input_ids=_ids(1, 3, seed=2))


def test_output_attentions_warns_once():
    q = torch.zeros(1, 2, 4, 16)
    ft._WARNED.clear()
    with pytest.warns(UserWarning, match="output_attentions"):
        out, weights = ft.flashtile_attention_forward(torch.nn.Module(), q, q, q, None, output_attentions=True)
    assert weights is None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ft.flashtile_attention_forward(torch.nn.Module(), q, q, q, None, output_attentions=True)


def test_static_cache_generate_under_a_name_without_flash():
    """register() under another name: transformers then drops the all-ones mask of a static-cache generate()
    (it keeps it only for flash-named implementations), so the mask function sees no mask and a static cache:
    the same tokens and scores as the reference."""
    ft.register("tile")
    ours, theirs = _models("llama")
    tile = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(ours.config), attn_implementation="tile")
    tile.load_state_dict(ours.state_dict())
    tile.eval()
    x = _ids(2, 8, seed=3)
    kw = dict(max_new_tokens=4, do_sample=False, cache_implementation="static", attention_mask=torch.ones_like(x),
              output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        a, b = tile.generate(x, **kw), theirs.generate(x, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for i, (sa, sb) in enumerate(zip(a.scores, b.scores)):
        assert_close(sa, sb, what=f"static generate score {i}")
