"""Programmatic dependent launch (PDL) on and off, against SDPA-flash in one process.

Attention (bf16, batch·seqlen = 16k tokens, heads = 2048/d, as `flashtile bench attention`):
  forward; forward+backward with the backward's kernels launched with and without PDL.
Decode (bf16, q heads 32, kv heads 8, d 128, as `flashtile bench decode`): eager calls with the
  merge kernel launched with and without PDL; CUDA-graph replays (which always launch it plainly).
The first version of this script (results/loop_pdl_H100_2026-11-23.json) also toggled a temporary
ONE_LOOP switch of the kernels, removed after that run (bench/NOTES.md attempt 14).
Every variant is first checked against fp32 math (sampled rows; gradients against SDPA-flash's),
then timed in ROUNDS interleaved rounds (do_bench medians; the point reports the median round).
Writes $OUT/loop_pdl.json and prints a table.

    PYTHONPATH=. python3 bench/scripts/loop_pdl.py [--quick]
"""
import json
import os
import statistics
import sys

import torch
from triton.testing import do_bench

from flashtile import flash_attn_func
from flashtile.bench.attention import _reference_rows
from flashtile.bench.common import environment, median_ms, rel_err
from flashtile.bench.decode import _graphed
from flashtile.kernels import decode as dec
from flashtile.kernels import fa2_bwd
from flashtile.ops import kvcache

ROUNDS = 3
QUICK = "--quick" in sys.argv


def sdpa_flash(q, k, v, causal, window=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=q.shape[2] != k.shape[2]
        ).transpose(1, 2)


_PDL = fa2_bwd.pdl_supported


def set_variant(pdl: bool) -> None:
    fa2_bwd.pdl_supported = lambda dev: pdl and _PDL(dev)


def rounds(fns: dict) -> dict:
    """Median over ROUNDS of each provider's do_bench median, providers interleaved per round."""
    out = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            out[name].append(fn())
    return {name: statistics.median(v) for name, v in out.items()}, out


def attention_point(d, n, causal, window=(-1, -1)):
    b, h = max(1, 16384 // n), 2048 // d
    torch.manual_seed(n + d)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    row = {"d": d, "n": n, "b": b, "h": h, "causal": causal, "window": list(window), "err": {}}
    if window == (-1, -1):
        ref, idx = _reference_rows(q, k, v, causal)
    # gradients of SDPA-flash (fp32 accumulate, bf16 out) as the reference for the backward variants
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    have_peer = window == (-1, -1)
    if have_peer:
        sdpa_flash(qg, kg, vg, causal).backward(dout)
        gref = [x.grad.float() for x in (qg, kg, vg)]

    def ours(pdl):
        def f(x, y, z):
            set_variant(pdl)
            return flash_attn_func(x, y, z, causal=causal, window_size=window)
        return f

    fwd, fb = {}, {}
    f = ours(True)
    with torch.no_grad():
        o = f(q, k, v)
    if have_peer:
        row["err"]["fwd"] = rel_err(o[:1, idx, :2].transpose(1, 2).float(), ref)
    fwd["ours"] = lambda: median_ms(lambda: f(q, k, v))
    if have_peer:
        fwd["sdpa-flash"] = lambda: median_ms(lambda: sdpa_flash(q, k, v, causal))
    for pdl in (False, True):
        f = ours(pdl)
        for x in (qg, kg, vg):
            x.grad = None
        f(qg, kg, vg).backward(dout)
        if have_peer:
            row["err"][f"bwd pdl={int(pdl)}"] = max(rel_err(x.grad.float(), r) for x, r in zip((qg, kg, vg), gref))
        fb[f"ours pdl={int(pdl)}"] = (
            lambda f=f: median_ms(lambda: f(qg, kg, vg).backward(dout), grad_to_none=[qg, kg, vg])
        )
    if have_peer:
        fb["sdpa-flash"] = lambda: median_ms(
            lambda: sdpa_flash(qg, kg, vg, causal).backward(dout), grad_to_none=[qg, kg, vg]
        )
    row["fwd_ms"], row["fwd_rounds"] = rounds(fwd)
    row["fwd_bwd_ms"], row["fwd_bwd_rounds"] = rounds(fb)
    row["fwd_tflops"] = {k_: flops / (ms * 1e-3) / 1e12 for k_, ms in row["fwd_ms"].items()}
    row["fwd_bwd_tflops"] = {k_: 3.5 * flops / (ms * 1e-3) / 1e12 for k_, ms in row["fwd_bwd_ms"].items()}
    set_variant(True)
    return row


def graph_us(fn):
    """Median µs of ``fn`` replayed from a CUDA graph (the bench's own capture helper)."""
    return median_ms(_graphed(fn)) * 1e3


def decode_point(b, n):
    hq, hk, d = 32, 8, 128
    torch.manual_seed(b * 7 + n)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, n, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    ref = sdpa_flash(q, k, v, False).float()
    orig = dec.pdl_supported
    row = {"batch": b, "cache": n, "err": {}}
    fns_graph, fns_eager = {}, {}
    f = lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)  # noqa: E731
    for pdl in (False, True):
        set_decode_pdl(pdl, orig)
        row["err"][f"pdl={int(pdl)}"] = float((f().float() - ref).norm() / ref.norm())
        fns_eager[f"ours pdl={int(pdl)}"] = (lambda p=pdl: (set_decode_pdl(p, orig), do_bench(f, return_mode="median") * 1e3)[1])
    set_decode_pdl(True, orig)
    fns_graph["ours"] = lambda: graph_us(f)
    fns_graph["sdpa-flash"] = lambda: graph_us(lambda: sdpa_flash(q, k, v, False))
    fns_eager["sdpa-flash"] = lambda: do_bench(lambda: sdpa_flash(q, k, v, False), return_mode="median") * 1e3
    row["graph_us"], row["graph_rounds"] = rounds(fns_graph)
    row["eager_us"], row["eager_rounds"] = rounds(fns_eager)
    set_decode_pdl(True, orig)
    nbytes = 2 * b * n * hk * d * 2
    row["gbps_graph"] = {k_: nbytes / (us * 1e-6) / 1e9 for k_, us in row["graph_us"].items()}
    return row


def set_decode_pdl(p, orig):
    dec.pdl_supported = lambda dev: p and orig(dev)
    dec._decode_launch.cache_clear()
    kvcache._CALLS.clear()


from flashtile.ops.kvcache import flash_attn_with_kvcache  # noqa: E402


def main():
    out = {"env": environment(), "command": "PYTHONPATH=. python3 bench/scripts/loop_pdl.py" + (" --quick" if QUICK else ""),
           "attention": [], "decode": []}
    points = [(128, 1024, True), (128, 2048, True), (64, 1024, True), (64, 2048, True), (128, 4096, True),
              (64, 4096, True), (128, 8192, True), (128, 1000, False), (128, 4096, False)]
    if QUICK:
        points = points[:4]
    for d, n, causal in points:
        row = attention_point(d, n, causal)
        out["attention"].append(row)
        print(json.dumps({k_: row[k_] for k_ in ("d", "n", "causal", "fwd_tflops", "fwd_bwd_tflops", "err")},
                         default=lambda x: round(x, 4)), flush=True)
    row = attention_point(128, 4096, False, window=(512, 0))
    out["attention"].append(row)
    print(json.dumps({k_: row[k_] for k_ in ("d", "n", "window", "fwd_tflops", "fwd_bwd_tflops")},
                     default=lambda x: round(x, 4)), flush=True)
    for b, n in ((1, 1024), (1, 4096), (1, 32768), (8, 32768), (1, 131072)):
        row = decode_point(b, n)
        out["decode"].append(row)
        print(json.dumps({k_: row[k_] for k_ in ("batch", "cache", "graph_us", "eager_us", "err")},
                         default=lambda x: round(x, 3)), flush=True)
    path = os.path.join(os.environ.get("OUT", "."), "loop_pdl.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)

    print("\nattention: TFLOP/s, ratio to SDPA-flash")
    for r in out["attention"]:
        peer_f = r["fwd_tflops"].get("sdpa-flash")
        peer_b = r["fwd_bwd_tflops"].get("sdpa-flash")
        fw = " ".join(f"{k_.replace('ours ', '')}={v_:.0f}" + (f"({v_ / peer_f:.3f})" if peer_f else "")
                      for k_, v_ in r["fwd_tflops"].items() if k_ != "sdpa-flash")
        fb = " ".join(f"{k_.replace('ours ', '')}={v_:.0f}" + (f"({v_ / peer_b:.3f})" if peer_b else "")
                      for k_, v_ in r["fwd_bwd_tflops"].items() if k_ != "sdpa-flash")
        print(f"d={r['d']} n={r['n']} causal={r['causal']} win={r['window']}\n  fwd: {fw}\n  f+b: {fb}")
    print("\ndecode: us (graph / eager)")
    for r in out["decode"]:
        print(r["batch"], r["cache"], {k_: round(v_, 1) for k_, v_ in r["graph_us"].items()},
              {k_: round(v_, 1) for k_, v_ in r["eager_us"].items()})


if __name__ == "__main__":
    main()
