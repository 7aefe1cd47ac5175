"""GPU probe of issue 15 (host cost of decoding through Hugging Face), branch hfdecode.  < 3 min on an H100.

1. host us per call, fixed vs growing key count, for flash_attn_func / flash_attn_with_kvcache / SDPA, with the
   growing cache both as slices of one buffer (strides fixed) and as a new (B, Hk, N, d) tensor per step (HF's
   DynamicCache: batch / head strides change too); plus how many Triton first calls / bindings the growing loop made;
2. device time at fixed shapes (CUDA graph of 20 calls, CUDA events), to compare with main's;
3. HF greedy generate of the 1.1B Llama of `flashtile bench train` (bf16, B 2, prompt 4096 / 1024, 64 new tokens):
   prefill ms and decode ms per token, flashtile vs sdpa, and whether their tokens agree.

Writes $OUT/hfdecode_probe.json (or ./hfdecode_probe.json) and prints a table.
Run: python scratch/hfdecode_probe.py [--quick]
"""
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flashtile  # noqa: E402
from flashtile.runtime import decode as rd  # noqa: E402
from flashtile.runtime import launch as rl  # noqa: E402

QUICK = "--quick" in sys.argv
dev = "cuda"
B, HQ, HK, D, N0 = 2, 32, 8, 64, 4096
GROW = 60 if QUICK else 150
result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}


def sync():
    torch.cuda.synchronize()


# --------------------------------------------------------------------------- host cost
first_calls = [0]
_orig_first = rl.KernelLauncher._first_call


def _counting_first(self, dynamic):
    first_calls[0] += 1
    return _orig_first(self, dynamic)


rl.KernelLauncher._first_call = _counting_first

g = torch.Generator(device=dev).manual_seed(0)
q = torch.randn(B, 1, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
kbig = torch.randn(B, N0 + 2 * GROW + 64, HK, D, device=dev, dtype=torch.bfloat16, generator=g)
vbig = torch.randn_like(kbig)
# HF DynamicCache layout: one new contiguous (B, Hk, N, d) tensor per step, seen as (B, N, Hk, d)
kdyn = [kbig[:, :N0 + i].transpose(1, 2).contiguous().transpose(1, 2) for i in range(GROW + 20)]
vdyn = [vbig[:, :N0 + i].transpose(1, 2).contiguous().transpose(1, 2) for i in range(GROW + 20)]


def host_us(f, grow, reps=GROW):
    for i in range(20):
        f(i if grow else 0)
    sync()
    n_first, n_bound = first_calls[0], rl._bound.cache_info().currsize
    n_launch = rd._decode_launch.cache_info().currsize
    t = time.perf_counter()
    for i in range(reps):
        f(20 + i if grow else 0)
    sync()
    us = (time.perf_counter() - t) / reps * 1e6
    return dict(us=us, first_calls=first_calls[0] - n_first, new_bindings=rl._bound.cache_info().currsize - n_bound,
                new_decode_launches=rd._decode_launch.cache_info().currsize - n_launch)


sdpa = torch.nn.functional.scaled_dot_product_attention
cases = {
    "flash_attn_func sliced": lambda i: flashtile.flash_attn_func(q, kbig[:, :N0 + i], vbig[:, :N0 + i], causal=True),
    "flash_attn_func dyncache": lambda i: flashtile.flash_attn_func(q, kdyn[i], vdyn[i], causal=True),
    "flash_attn_with_kvcache sliced": lambda i: flashtile.flash_attn_with_kvcache(
        q, kbig[:, :N0 + i], vbig[:, :N0 + i], causal=True),
    "flash_attn_with_kvcache dyncache": lambda i: flashtile.flash_attn_with_kvcache(q, kdyn[i], vdyn[i], causal=True),
    "sdpa dyncache": lambda i: sdpa(q.transpose(1, 2), kdyn[i].transpose(1, 2), vdyn[i].transpose(1, 2),
                                    is_causal=False, enable_gqa=True),
}
host = {}
for name, f in cases.items():
    with torch.no_grad():
        host[name] = dict(fixed=host_us(f, False), growing=host_us(f, True))
    print(f"{name:36s} fixed {host[name]['fixed']['us']:7.1f} us  growing {host[name]['growing']['us']:7.1f} us  "
          f"(growing loop: {host[name]['growing']['first_calls']} Triton first calls, "
          f"{host[name]['growing']['new_bindings']} new FA2 bindings, "
          f"{host[name]['growing']['new_decode_launches']} new decode launches)", flush=True)
result["host_us_per_call"] = host

# --------------------------------------------------------------------------- device time at fixed shapes
def graph_us(f, calls=20, reps=10):
    """Device us per call: a CUDA graph of ``calls`` calls replayed ``reps`` times (median), host excluded."""
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                f()
        torch.cuda.current_stream().wait_stream(s)
        sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                f()
        graph.replay()
        sync()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            sync()
            times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def fixed_shapes():
    out = {}
    for nq, nk, d, causal in ((1, 4096, 64, True), (1, 32768, 128, True), (4096, 4096, 64, True),
                              (4096, 4096, 128, True), (2048, 2048, 128, False)):
        b, hq, hk = (2, 32, 8)
        qq = torch.randn(b, nq, hq, d, device=dev, dtype=torch.bfloat16)
        kk = torch.randn(b, nk, hk, d, device=dev, dtype=torch.bfloat16)
        vv = torch.randn_like(kk)
        key = f"flash_attn_func b{b} hq{hq} hk{hk} nq{nq} nk{nk} d{d} causal={causal}"
        try:
            out[key] = graph_us(lambda: flashtile.flash_attn_func(qq, kk, vv, causal=causal))
        except Exception as e:  # noqa: BLE001
            out[key] = f"{type(e).__name__}: {e}"[:200]
        if nq == 1:
            key = f"flash_attn_with_kvcache b{b} hq{hq} hk{hk} nk{nk} d{d}"
            try:
                out[key] = graph_us(lambda: flashtile.flash_attn_with_kvcache(qq, kk, vv, causal=causal))
            except Exception as e:  # noqa: BLE001
                out[key] = f"{type(e).__name__}: {e}"[:200]
        print(f"{key:70s} {out[key] if isinstance(out[key], str) else f'{out[key]:8.1f} us'}", flush=True)
        del qq, kk, vv
    return out


result["device_us_fixed_shapes"] = fixed_shapes()

# --------------------------------------------------------------------------- HF generate
try:
    import flashtile.integrations.transformers  # noqa: F401
    from flashtile.bench.train import _inference_provider, build_model

    model = build_model("1b", dev, torch.bfloat16)
    vocab = model.config.vocab_size
    hf = {}
    for prompt in ((1024,) if QUICK else (4096, 1024)):
        rows = {}
        for provider in ("flashtile", "sdpa"):
            r = _inference_provider(model, provider, 2, prompt, 32 if QUICK else 64, vocab, dev, 1, 2 if QUICK else 3)
            rows[provider] = r
            print(f"HF generate prompt {prompt} {provider:10s} prefill {r['prefill_ms']:8.2f} ms  decode "
                  f"{r['decode_ms_per_token']:7.2f} ms/token", flush=True)
        same = rows["flashtile"]["tokens"] == rows["sdpa"]["tokens"]
        for r in rows.values():
            r.pop("tokens")
        hf[prompt] = dict(rows, tokens_equal=same,
                          decode_speedup_vs_sdpa=rows["sdpa"]["decode_ms_per_token"] / rows["flashtile"]["decode_ms_per_token"])
        print(f"  tokens equal: {same}; decode sdpa/flashtile = {hf[prompt]['decode_speedup_vs_sdpa']:.3f}", flush=True)
    result["hf_generate"] = hf
except Exception as e:  # noqa: BLE001
    result["hf_generate"] = f"{type(e).__name__}: {e}"[:300]
    print("HF generate failed:", result["hf_generate"], flush=True)

path = os.path.join(os.environ.get("OUT", "."), "hfdecode_probe.json")
with open(path, "w") as fh:
    json.dump(result, fh, indent=1)
print("wrote", path)
