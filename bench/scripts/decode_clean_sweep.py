"""Decode kernel configs timed with a clean L2 (read-only flush), against SDPA-flash, one process.

do_bench's write flush leaves L2 dirty, and at B=1 / 32k (134 MB of K/V) that write-back held every
tile configuration at 62-64 us (bench/NOTES.md attempt 11).  With the flush made read-only
(flashtile.bench.common.median_ms_clean_l2) this sweeps BLOCK_N x warps x stages x split counts
(the heuristic's, two and four programs per SM) at the points where the copy-bandwidth share is
lowest, each checked against SDPA-flash first.  Writes $OUT/decode_clean_sweep.json.

    PYTHONPATH=. python3 bench/scripts/decode_clean_sweep.py
"""
import itertools
import json
import os

import torch

from flashtile.bench.common import median_ms_clean_l2
from flashtile.bench.decode import copy_bandwidth, forced_decode
from flashtile.kernels import decode as dec

HQ, HK, D = 32, 8, 128


def sdpa_flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True
        ).transpose(1, 2)


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth()
    out = {"device": torch.cuda.get_device_name(), "copy_gbps": copy, "points": []}
    for b, n in ((1, 32768), (1, 131072), (8, 4096), (1, 4096)):
        torch.manual_seed(b + n)
        q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, n, HK, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        ref = sdpa_flash(q, k, v).float()
        base = dec.decode_plan(b, 1, HQ, HK, D, None, n, 0, q.device)
        kv_bytes = 2 * b * n * HK * D * 2
        t_sdpa = median_ms_clean_l2(lambda: sdpa_flash(q, k, v)) * 1e3
        splits = sorted({base.n_splits, max(1, 2 * sms // (b * HK)), max(1, 4 * sms // (b * HK))})
        rows = []
        for bn, warps, stages, s in itertools.product((64, 128), (4, 8), (2, 3, 4), splits):
            s = min(s, dec.MAX_SPLITS)
            rec = {"block_n": bn, "warps": warps, "stages": stages, "splits": s}
            try:
                run = forced_decode(q, k, v, lens, block_n=bn, num_warps=warps, num_stages=stages, n_splits=s)
                o = run()
                rec["err"] = float((o.float() - ref).norm() / ref.norm())
                assert rec["err"] < 2e-2, rec
                rec["us"] = median_ms_clean_l2(run) * 1e3
                rec["of_copy"] = kv_bytes / (rec["us"] * 1e-6) / 1e9 / copy
                rec["vs_sdpa"] = t_sdpa / rec["us"]
            except Exception as e:  # noqa: BLE001 - resources, compile errors: recorded
                rec["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            rows.append(rec)
        good = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        out["points"].append({"batch": b, "cache": n, "heuristic": base._asdict(), "sdpa_us": t_sdpa, "rows": rows})
        print(f"B={b} L={n} heuristic splits={base.n_splits} bn={base.block_n} sdpa {t_sdpa:.1f} us", flush=True)
        for r in good[:5]:
            print("   ", {k_: (round(v_, 3) if isinstance(v_, float) else v_) for k_, v_ in r.items()}, flush=True)
        cur = [r for r in rows if r.get("us") and r["block_n"] == base.block_n and r["warps"] == base.num_warps
               and r["stages"] == base.num_stages and r["splits"] == base.n_splits]
        print("    current:", cur, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "decode_clean_sweep.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
