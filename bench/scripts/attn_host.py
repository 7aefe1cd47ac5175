"""Short causal attention: host-bound or kernel-bound?  (GPU only, one process.)

For the grid points that miss issue 3's targets (and a control), times ours and SDPA-flash:
host µs per call (back-to-back, no sync), eager do_bench medians (the bench's measurement),
and the CUDA kernels' own time per call from torch.profiler (the host taken out).
Forward under no_grad, and a forward+backward step.  Writes $OUT/attn_host.json.

    PYTHONPATH=. python3 bench/scripts/attn_host.py
"""
import json
import os
import sys
import time

import torch

from flashtile import flash_attn_func
from flashtile.bench.common import median_ms

POINTS = ((128, 1024, True), (128, 2048, True), (64, 1024, True), (64, 2048, True), (128, 4096, False))


def sdpa_flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
        ).transpose(1, 2)


def ours(q, k, v, causal):
    return flash_attn_func(q, k, v, causal=causal)


def host_us(fn, n=50):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def kernel_us(fn, n=10):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    total, names = 0.0, {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = getattr(e, "device_time", None)
            t = e.cuda_time if t is None else t
            total += t
            names[e.name[:40]] = names.get(e.name[:40], 0.0) + t / n
    return total / n, {k: round(v, 1) for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:6]}


def main():
    rows = []
    for d, n, causal in POINTS:
        b, h = 16384 // n, 2048 // d
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn_like(q)
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        row = {"d": d, "n": n, "causal": causal, "b": b, "h": h}
        for name, fn in (("ours", ours), ("sdpa", sdpa_flash)):
            def fwd():
                with torch.no_grad():
                    return fn(q, k, v, causal)

            def step():
                for x in (qg, kg, vg):
                    x.grad = None
                fn(qg, kg, vg, causal).backward(dout)

            for mode, f, mult in (("fwd", fwd, 1.0), ("fwdbwd", step, 3.5)):
                r = {"host_us": host_us(f), "eager_us": median_ms(f) * 1e3}
                try:
                    r["kernel_us"], r["kernels"] = kernel_us(f)
                except Exception as e:  # noqa: BLE001 - no CUPTI: report and go on
                    r["kernel_us"], r["kernels"] = None, repr(e)[:100]
                r["tflops_eager"] = mult * flops / (r["eager_us"] * 1e-6) / 1e12
                if r["kernel_us"]:
                    r["tflops_kernel"] = mult * flops / (r["kernel_us"] * 1e-6) / 1e12
                row[f"{name}_{mode}"] = r
        for mode in ("fwd", "fwdbwd"):
            o, s = row[f"ours_{mode}"], row[f"sdpa_{mode}"]
            row[f"x_{mode}_eager"] = s["eager_us"] / o["eager_us"]
            if o["kernel_us"] and s["kernel_us"]:
                row[f"x_{mode}_kernel"] = s["kernel_us"] / o["kernel_us"]
        rows.append(row)
        print(f"d={d} n={n} causal={causal}:", flush=True)
        for mode in ("fwd", "fwdbwd"):
            o, s = row[f"ours_{mode}"], row[f"sdpa_{mode}"]
            print(f"  {mode}: eager x{row[f'x_{mode}_eager']:.2f} kernel x{row.get(f'x_{mode}_kernel', float('nan')):.2f} | "
                  f"ours host {o['host_us']:.0f} eager {o['eager_us']:.0f} kern {o['kernel_us']} | "
                  f"sdpa host {s['host_us']:.0f} eager {s['eager_us']:.0f} kern {s['kernel_us']}", flush=True)
            print(f"     ours kernels {o['kernels']}\n     sdpa kernels {s['kernels']}", flush=True)
    os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "."), "attn_host.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
