"""Where does time go between the kernel and the public API?  (GPU only)

Times, on the same bf16 inputs in the (B, N, H, d) layout: the forward kernel
called directly with a (B, H, N, d) output, the kernel writing into a
(B, N, H, d) output view, and flash_attn_func; plus the host-side cost of one
flash_attn_func call (no synchronisation) to expose Python overhead.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flashtile import flash_attn_func  # noqa: E402
from flashtile.bench.common import median_ms  # noqa: E402
from flashtile.runtime.fa2_fwd import fa2_forward  # noqa: E402

for d, n, causal in ((128, 1024, True), (128, 4096, False), (64, 16384, True)):
    b, h = 16384 // n, 2048 // d
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    out_bnhd = torch.empty_like(q)
    t_direct = median_ms(lambda: fa2_forward(qt, kt, vt, softmax_scale=d**-0.5, causal=causal))
    t_view = median_ms(lambda: fa2_forward(qt, kt, vt, softmax_scale=d**-0.5, causal=causal, out=out_bnhd.transpose(1, 2)))
    t_api = median_ms(lambda: flash_attn_func(q, k, v, causal=causal))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        fa2_forward(qt, kt, vt, softmax_scale=d**-0.5, causal=causal)
    t_host_kernel = (time.perf_counter() - t0) / 50 * 1e3
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        flash_attn_func(q, k, v, causal=causal)
    t_host_api = (time.perf_counter() - t0) / 50 * 1e3
    torch.cuda.synchronize()
    print(f"d={d} n={n} causal={causal}: direct {flops / t_direct / 1e9:.0f} TF/s, into BNHD view {flops / t_view / 1e9:.0f}, "
          f"api {flops / t_api / 1e9:.0f}; host ms/call: kernel wrapper {t_host_kernel:.3f}, api {t_host_api:.3f}; "
          f"device ms direct {t_direct:.3f}")
