"""Programmatic dependent launch (PDL) on and off, against SDPA-flash in one process.

Attention (bf16, batch·seqlen = 16k tokens, heads = 2048/d, as `flashtile bench attention`):
  forward; forward+backward with the backward's kernels launched with and without PDL.
The decode half of the results (the merge kernel launched with and without PDL) was measured by the
version of this script before bench/NOTES.md attempt 17, which folded the merge into the split kernel.
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

from flashtile import flash_attn_func
from flashtile.bench.attention import _reference_rows
from flashtile.bench.common import environment, median_ms, rel_err
from flashtile.runtime import fa2_bwd

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


def main():
    out = {"env": environment(), "command": "PYTHONPATH=. python3 bench/scripts/loop_pdl.py" + (" --quick" if QUICK else ""),
           "attention": []}
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


if __name__ == "__main__":
    main()
