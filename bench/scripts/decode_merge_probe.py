"""The merge's cost on the device: fused into the split kernel, or a second kernel of 1/2/4 rows a program.

Bf16, Hq 32, Hk 8, d 128, Nq 1, B = 1 at 1k / 4k / 32k keys (16 splits, 4 packed rows per kv head).
Times, after a 1 GB read-only L2 flush (flashtile.bench.common.median_ms_clean_l2): the eager call
(kernel 1 with the merge fused), and CUDA-graph replays of kernel 1 alone (no merge: the floor), of
kernel 1 + the merge kernel as `DecodeLaunch` captures it (one program per row tile), and of kernel 1
+ the merge kernel with ROWS rows a program and W warps.  Every variant's output is checked against
the eager call's first.  Writes $OUT/decode_merge_probe.json.

    PYTHONPATH=. python3 bench/scripts/decode_merge_probe.py
"""
import json
import os

import torch
import triton

from flashtile.bench.common import environment, median_ms_clean_l2
from flashtile.bench.decode import _graphed
from flashtile.kernels import decode as dec
from flashtile.kernels._launch import KernelLauncher

HQ, HK, D = 32, 8, 128


def main():
    out = {"env": environment(), "command": "PYTHONPATH=. python3 bench/scripts/decode_merge_probe.py", "points": []}
    timer = lambda fn: median_ms_clean_l2(fn, flush_bytes=1 << 30) * 1e3  # noqa: E731
    for n in (1024, 4096, 32768):
        torch.manual_seed(n)
        b = 1
        q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, n, HK, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        plan, launch = dec.decode_launch(q, k, v, None, None, left=-1, right=-1, softcap=0.0, unified=False, num_splits=0)
        o = torch.empty_like(q)
        lse = torch.empty(b, HQ, 1, device="cuda", dtype=torch.float32)
        work = torch.empty(launch.lse_offset + launch.rows, dtype=torch.float32, device="cuda")
        args = (q, k, v, lens, lens, lens, work, work, work, o, lse, lse, D ** -0.5, 0.0, 0.0, 0.0, 0.0)
        eager = lambda: launch(q, k, v, lens, None, None, o, lse, None, D ** -0.5, 0.0, None)  # noqa: E731
        eager()
        want = o.clone()
        rec = {"cache": n, "plan": plan._asdict(), "us": {}, "err": {}}
        rec["us"]["eager fused"] = timer(eager)
        rec["us"]["graph split only"] = timer(_graphed(lambda: launch.split(*args)))

        def two(merge):
            def run():
                launch.split(*args)
                merge(work, work, o, lse, lse)
            return run

        rec["us"]["graph split + tile merge"] = timer(_graphed(two(launch.merge)))
        so = (HQ * D, HQ * D, D)
        shape = (HQ, HK, HQ // HK, 1, D, plan.n_splits)
        rows = HQ // HK
        for per in (1, 2, 4):
            for warps in (1, 2, 4):
                m = KernelLauncher(
                    dec._decode_merge_kernel, (b * HK, triton.cdiv(rows, per)),
                    (*so, *shape, launch.lse_offset, per, max(2, per), plan.merge_s, plan.block_d, False),
                    dict(num_warps=warps), check=(),
                )
                name = f"graph split + merge {per} rows/{warps} warps"
                o.fill_(float("nan"))
                two(m)()
                rec["err"][name] = float((o.float() - want.float()).abs().max())
                rec["us"][name] = timer(_graphed(two(m)))
        out["points"].append(rec)
        print(f"B=1 L={n} splits={plan.n_splits}", flush=True)
        for name, us in rec["us"].items():
            print(f"  {name:40s} {us:7.1f} us   err {rec['err'].get(name, 0.0):.1e}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "decode_merge_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
