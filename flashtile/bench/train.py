"""`flashtile bench train`: a Llama-style decoder through Hugging Face transformers, end to end.

The model is built from a transformers ``LlamaConfig`` (random init, no download): ``--size 1b`` is
Llama-3.2-1B's shape with a 32k vocabulary (hidden 2048, 16 layers, 32 query / 8 key-value heads,
head dim 64, MLP 8192: 1.1B parameters), bf16; ``--size tiny`` (hidden 64, 2 layers) is the CPU smoke
configuration (``--quick``), which runs the same code paths through Triton's interpreter.

Three measurements, each provider in this process, from the same initial weights:

* ``train_packed`` — one training step (forward, backward, AdamW step) on ``batch`` rows of ``seqlen``
  tokens, each row a pack of documents of mixed lengths (log-uniform between ``seqlen / 64`` and
  ``seqlen``, the last one cut to fit).  Providers:

  - ``flashtile``: ``attn_implementation="flashtile"``, rows packed, ``position_ids`` restarting at each
    document -> the varlen kernels (no padding, no mask);
  - ``flex``: ``attn_implementation="flex_attention"``, the same packed rows; transformers builds a
    document-causal BlockMask from the ``position_ids``;
  - ``sdpa`` / ``sdpa-flash`` / ``sdpa-cudnn``: ``attn_implementation="sdpa"`` (default dispatch, or one
    backend forced) on the documents padded instead: one document per row, right-padded, causal, no
    mask (a right pad is never seen by a real token under a causal mask), rows grouped into
    micro-batches of at most ``batch * seqlen`` token slots whose gradients accumulate before the one
    optimizer step.

  Every provider computes the same loss (the sum over the same (position, next token) pairs, divided
  by their count: no target crosses a document boundary), recorded from its first step as a check.
  ``tokens_per_s`` counts the real tokens of the step; ``peak_gib`` is the CUDA allocator's peak
  during the timed steps (weights, gradients, AdamW state and activations).
* ``train_unpadded`` — the same step on unpacked rows (one sequence per row, B·N = ``unpadded_tokens``)
  at each of ``unpadded_seqlens``: ``flashtile`` vs ``sdpa`` (transformers' default).
* ``inference`` — prefill of ``batch`` prompts of ``prompt`` tokens (forward filling a KV cache,
  last logits only) and greedy ``generate()`` of ``new_tokens`` tokens: prefill ms and tokens/s,
  decode ms per token (``(generate - prefill) / (new_tokens - 1)``): ``flashtile`` vs ``sdpa``, in
  ``INFERENCE_ROUNDS`` interleaved rounds (the providers alternating which goes first; each figure the median
  over rounds): both steps are host-bound at this size, and one provider timed after the other read 0.80-1.02x
  for the same code.

A provider that fails (missing backend, out of memory) is recorded with its error, not fatal.
Times are medians of wall-clock steps bracketed by device synchronisation.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from typing import Callable

import torch

from flashtile.bench.common import environment, write_json

__all__ = ["PROVIDERS", "SIZES", "run_train_bench", "document_rows", "plot"]

PROVIDERS = ("flashtile", "flex", "sdpa", "sdpa-flash", "sdpa-cudnn")
SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=32000),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=128),
}
# the run's shape: (batch, seqlen) of the packed step, unpacked B·N and contexts, inference prompt / new tokens
INFERENCE_ROUNDS = 3  # interleaved rounds of the prefill / decoding measurement
FULL = dict(batch=2, seqlen=8192, unpadded_tokens=16384, unpadded_seqlens=(4096, 16384), prompt=4096, new_tokens=64,
            warmup=2, reps=5)
QUICK = dict(batch=2, seqlen=64, unpadded_tokens=128, unpadded_seqlens=(32, 64), prompt=32, new_tokens=3,
             warmup=1, reps=1)


def document_rows(batch: int, seqlen: int, seed: int = 0) -> list[list[int]]:
    """Document lengths packed into each of ``batch`` rows of ``seqlen`` tokens: log-uniform in
    [max(2, seqlen / 64), seqlen], the last document of a row cut to what is left."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = math.log(max(2, seqlen // 64)), math.log(seqlen)
    rows = []
    for _ in range(batch):
        row, left = [], seqlen
        while left > 0:
            n = int(math.exp(lo + (hi - lo) * torch.rand((), generator=g).item()))
            row.append(min(max(n, 2), left))
            left -= row[-1]
        rows.append(row)
    return rows


def _packed_inputs(rows: list[list[int]], vocab: int, device, seed: int = 1) -> tuple[dict, list[torch.Tensor]]:
    """(kwargs of the packed step, the documents' token tensors)."""
    g = torch.Generator().manual_seed(seed)
    seqlen = sum(rows[0])
    ids = torch.randint(3, vocab, (len(rows), seqlen), generator=g)
    pos = torch.cat([torch.cat([torch.arange(n) for n in row]).unsqueeze(0) for row in rows])
    labels = ids.masked_fill(pos == 0, -100)  # no target crosses into the next document
    docs = [ids[r, s - n: s] for r, row in enumerate(rows) for n, s in zip(row, _ends(row))]
    kw = dict(input_ids=ids.to(device), position_ids=pos.to(device), labels=labels.to(device))
    return kw, docs


def _ends(row: list[int]) -> list[int]:
    out, acc = [], 0
    for n in row:
        acc += n
        out.append(acc)
    return out


def _padded_microbatches(docs: list[torch.Tensor], budget: int, device) -> list[dict]:
    """One right-padded document per row, longest first, grouped so rows x longest <= budget slots."""
    order = sorted(docs, key=len, reverse=True)
    groups, cur = [], []
    for d in order:
        if cur and (len(cur) + 1) * len(cur[0]) > budget:
            groups.append(cur)
            cur = []
        cur.append(d)
    groups.append(cur)
    out = []
    for grp in groups:
        width = len(grp[0])
        ids = torch.zeros(len(grp), width, dtype=torch.long)
        labels = torch.full((len(grp), width), -100, dtype=torch.long)
        for r, d in enumerate(grp):
            ids[r, :len(d)] = d
            labels[r, 1:len(d)] = d[1:]
        out.append(dict(input_ids=ids.to(device), labels=labels.to(device)))
    return out


def _targets(batches: list[dict]) -> int:
    """Number of (position, next token) pairs the loss averages (transformers shifts labels by one)."""
    return sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn: Callable[[], object], device, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _backend(provider: str):
    if provider in ("sdpa-flash", "sdpa-cudnn"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.FLASH_ATTENTION if provider == "sdpa-flash" else SDPBackend.CUDNN_ATTENTION)
    return contextlib.nullcontext()


def _implementation(provider: str) -> str:
    return {"flashtile": "flashtile", "flex": "flex_attention"}.get(provider, "sdpa")


def build_model(size: str, device, dtype):
    """A random-init ``LlamaForCausalLM`` of ``SIZES[size]`` with ``attn_implementation="flashtile"``."""
    import transformers

    import flashtile.integrations.transformers  # noqa: F401  (registers "flashtile")

    cfg = transformers.LlamaConfig(**SIZES[size], max_position_embeddings=1 << 17, pad_token_id=0,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="flashtile")
    return model.to(device=device, dtype=dtype)


def _set_implementation(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):  # transformers >= 4.54
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def _measure(device, fn: Callable[[], object], warmup: int, reps: int) -> dict:
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    ms = _median_ms(fn, device, warmup, reps)
    return dict(ms=ms, peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)


def _train_provider(model, snapshot, provider: str, batches: list[dict], n_targets: int, tokens: int,
                    device, warmup: int, reps: int) -> dict:
    model.load_state_dict(snapshot)
    _set_implementation(model, _implementation(provider))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=torch.device(device).type == "cuda")
    first: list[float] = []

    def step():
        total = 0.0
        with _backend(provider):
            for kw in batches:
                loss = model(**kw, use_cache=False, num_items_in_batch=n_targets).loss
                loss.backward()
                total = total + loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not first:
            first.append(float(total))

    try:
        res = _measure(device, step, warmup, reps)
        res.update(provider=provider, tokens_per_s=tokens / (res["ms"] * 1e-3), loss=first[0],
                   microbatches=len(batches))
    finally:
        del opt
        model.zero_grad(set_to_none=True)
    return res


def _guarded(provider: str, fn: Callable[[], dict]) -> dict:
    try:
        return fn()
    except Exception as e:  # a missing backend or an OOM is a result, not a crash
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return dict(provider=provider, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")


def _inference_provider(model, provider: str, batch: int, prompt: int, new_tokens: int, vocab: int,
                        device, warmup: int, reps: int) -> dict:
    _set_implementation(model, _implementation(provider))
    model.eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (batch, prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    with torch.no_grad(), _backend(provider):
        pre = _measure(device, lambda: model(ids, use_cache=True, logits_to_keep=1), warmup, reps)
        out: list[torch.Tensor] = []
        gen = _measure(device, lambda: out.append(model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)),
            min(warmup, 1), reps)
        tokens = out[-1][:, prompt:]
    return dict(provider=provider, prefill_ms=pre["ms"], prefill_tokens_per_s=batch * prompt / (pre["ms"] * 1e-3),
                generate_ms=gen["ms"], decode_ms_per_token=(gen["ms"] - pre["ms"]) / max(1, new_tokens - 1),
                peak_gib=None if pre["peak_gib"] is None else max(pre["peak_gib"], gen["peak_gib"]),
                tokens=tokens.tolist())


def run_train_bench(out_dir, *, size: str | None = None, quick: bool = False, providers=PROVIDERS, device=None,
                    progress: Callable[[str], None] = lambda what: None, **shape) -> dict:
    """Run the three measurements and write ``train_<device>.json``; returns the payload (``path`` added).
    ``size`` defaults to "tiny" with ``quick`` (the CPU smoke shapes), else "1b"; ``shape`` overrides
    entries of ``FULL`` / ``QUICK`` (batch, seqlen, ...)."""
    size = size or ("tiny" if quick else "1b")
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        raise ValueError(f"providers: unknown {unknown!r}; choose from {list(PROVIDERS)}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {list(SIZES)}, got {size!r}")
    bad = set(shape) - set(FULL)
    if bad:
        raise ValueError(f"unknown shape options {sorted(bad)}; choose from {sorted(FULL)}")
    sh = {**(QUICK if quick else FULL), **shape}
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = torch.device(device).type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(size, device, dtype)
    vocab = model.config.vocab_size
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = sum(p.numel() for p in model.parameters())
    payload = dict(env=environment(), size=size, quick=quick, dtype=str(dtype).replace("torch.", ""),
                   params=params, config=SIZES[size], shape={k: list(v) if isinstance(v, tuple) else v
                                                             for k, v in sh.items()})

    def usable(p: str) -> str | None:
        if p in ("flex", "sdpa-flash", "sdpa-cudnn") and not cuda:
            return "needs a CUDA GPU"
        return None

    # packed documents
    rows = document_rows(sh["batch"], sh["seqlen"])
    packed, docs = _packed_inputs(rows, vocab, device)
    padded = _padded_microbatches(docs, sh["batch"] * sh["seqlen"], device)
    n_targets = _targets([packed])
    assert n_targets == _targets(padded), "packed and padded layouts must average the same targets"
    tokens = sh["batch"] * sh["seqlen"]
    payload["documents"] = dict(rows=rows, count=len(docs), padded_slots=sum(b["input_ids"].numel() for b in padded))
    results = []
    for p in providers:
        progress(f"train packed: {p}")
        why = usable(p)
        batches = [packed] if p in ("flashtile", "flex") else padded
        results.append(dict(provider=p, error=why) if why else _guarded(p, lambda: _train_provider(
            model, snapshot, p, batches, n_targets, tokens, device, sh["warmup"], sh["reps"])))
    payload["train_packed"] = results

    # unpacked rows, flashtile vs transformers' default sdpa
    unpadded = []
    for n in sh["unpadded_seqlens"]:
        b = max(1, sh["unpadded_tokens"] // n)
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(3, vocab, (b, n), generator=g).to(device)
        kw = dict(input_ids=ids, labels=ids)
        for p in ("flashtile", "sdpa"):
            progress(f"train unpadded N={n}: {p}")
            r = _guarded(p, lambda: _train_provider(model, snapshot, p, [kw], b * (n - 1), b * n, device,
                                                    sh["warmup"], sh["reps"]))
            unpadded.append(dict(seqlen=n, batch=b, **r))
    payload["train_unpadded"] = unpadded

    # prefill and decoding, the providers interleaved over rounds
    model.load_state_dict(snapshot)
    rounds: dict[str, list[dict]] = {"flashtile": [], "sdpa": []}
    for r in range(INFERENCE_ROUNDS):
        for p in (("flashtile", "sdpa") if r % 2 == 0 else ("sdpa", "flashtile")):
            progress(f"inference round {r + 1}/{INFERENCE_ROUNDS}: {p}")
            rounds[p].append(_guarded(p, lambda: _inference_provider(
                model, p, sh["batch"], sh["prompt"], sh["new_tokens"], vocab, device, sh["warmup"] if r == 0 else 0,
                max(1, sh["reps"] // 2))))
    payload["inference"] = [_median_rounds(rows) for rows in rounds.values()]
    payload["ratios"] = ratios(payload)
    payload["path"] = str(write_json(payload, out_dir, "train"))
    return payload


def _median_rounds(rows: list[dict]) -> dict:
    """One provider's inference rounds as one row: the first error if any, else each time the median over the
    rounds (the peak memory the largest; the tokens of the first round, the same in every one)."""
    for row in rows:
        if "error" in row:
            return row
    out = dict(rows[0])
    for key in ("prefill_ms", "prefill_tokens_per_s", "generate_ms", "decode_ms_per_token"):
        out[key] = statistics.median(row[key] for row in rows)
    peaks = [row["peak_gib"] for row in rows if row["peak_gib"] is not None]
    out["peak_gib"] = max(peaks) if peaks else None
    out["rounds"] = len(rows)
    return out


def ratios(payload: dict) -> dict:
    """flashtile's speed over each peer's (> 1: flashtile faster), per measurement."""
    out: dict = {}

    def speed(rows, key):
        return {r["provider"]: r[key] for r in rows if r.get(key)}

    packed = speed(payload.get("train_packed", []), "tokens_per_s")
    if "flashtile" in packed:
        out["train_packed"] = {p: packed["flashtile"] / v for p, v in packed.items() if p != "flashtile"}
    for n in sorted({r["seqlen"] for r in payload.get("train_unpadded", [])}):
        s = speed([r for r in payload["train_unpadded"] if r["seqlen"] == n], "tokens_per_s")
        if "flashtile" in s and "sdpa" in s:
            out[f"train_unpadded_{n}"] = {"sdpa": s["flashtile"] / s["sdpa"]}
    inf = {r["provider"]: r for r in payload.get("inference", []) if "error" not in r}
    if "flashtile" in inf and "sdpa" in inf:
        out["prefill"] = {"sdpa": inf["sdpa"]["prefill_ms"] / inf["flashtile"]["prefill_ms"]}
        out["decode"] = {"sdpa": inf["sdpa"]["decode_ms_per_token"] / inf["flashtile"]["decode_ms_per_token"]}
    return out


def plot(payload: dict, path) -> None:
    """Bars of training tokens/s (packed and unpadded) and inference speed per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ok = [r for r in payload["train_packed"] if r.get("tokens_per_s")]
    axes[0].bar([r["provider"] for r in ok], [r["tokens_per_s"] / 1e3 for r in ok])
    axes[0].set_title(f"training step, packed documents ({payload['shape']['batch']}x{payload['shape']['seqlen']})")
    axes[0].set_ylabel("k tokens / s")
    un = [r for r in payload["train_unpadded"] if r.get("tokens_per_s")]
    axes[1].bar([f"{r['provider']}\nN={r['seqlen']}" for r in un], [r["tokens_per_s"] / 1e3 for r in un])
    axes[1].set_title("training step, unpadded rows")
    inf = [r for r in payload["inference"] if r.get("prefill_ms")]
    x = range(len(inf))
    axes[2].bar([i - 0.2 for i in x], [r["prefill_tokens_per_s"] / 1e3 for r in inf], width=0.4, label="prefill k tok/s")
    axes[2].bar([i + 0.2 for i in x], [1e3 / r["decode_ms_per_token"] if r["decode_ms_per_token"] > 0 else 0
                                       for r in inf], width=0.4, label="decode steps / s")
    axes[2].set_xticks(list(x), [r["provider"] for r in inf])
    axes[2].legend()
    axes[2].set_title("inference")
    fig.suptitle(f"{payload['size']} Llama-style model, {payload['dtype']}, {payload['env']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
