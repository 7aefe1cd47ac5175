"""Where the fixed ~10 us of a B=1 decode call goes: our kernels against read floors, one process, clean L2.

At B=1 / 32k (134 MB of K/V) our decode reads at 0.85 of the 2 GB copy's bandwidth while a copy of the
same traffic after the same read-only flush runs at ~1.0 (bench/NOTES.md attempt 16).  This times, with
flashtile.bench.common.median_ms_clean_l2 (eager and as CUDA-graph replays):

* ours (flash_attn_with_kvcache, safe path and FlashDecoding++ with unified_max=0); the first run
  (results/decode_floor_H100_2026-11-23.json) timed the two-kernel version and its split kernel alone;
* read floors over the same K and V bytes: a Triton kernel that only loads and sums them, with our grid
  (kv heads x splits, a loop over 64-key tiles), one program per SM over a flat partition, and many small
  programs (one or two tiles each, scheduled dynamically like a copy); torch's own sum;
* a copy of the same traffic, an almost empty kernel (the timer's floor), SDPA flash and cuDNN.

    PYTHONPATH=. python3 bench/scripts/decode_floor.py        # writes $OUT/decode_floor.json
"""
import json
import os

import torch
import triton
import triton.language as tl

from flashtile.bench.common import median_ms_clean_l2
from flashtile.bench.decode import _graphed, _sdpa, copy_bandwidth
from flashtile.kernels import decode as dec
from flashtile.ops.kvcache import flash_attn_with_kvcache

HQ, HK, D = 32, 8, 128


@triton.jit
def _read_loop(K, V, Sink, keys_per_prog, n_keys, BLOCK_N: tl.constexpr, D: tl.constexpr, HK: tl.constexpr):
    """Program p reads keys [p*keys_per_prog, (p+1)*keys_per_prog) of the flattened (key, head) rows."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_N)
    offs = rows[:, None] * D + tl.arange(0, D)[None, :]
    acc = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    start = pid * keys_per_prog
    end = tl.minimum(start + keys_per_prog, n_keys)
    for i in range(start, end, BLOCK_N):
        ok = (i + rows) < end
        k = tl.load(K + i.to(tl.int64) * D + offs, mask=ok[:, None], other=0.0)
        v = tl.load(V + i.to(tl.int64) * D + offs, mask=ok[:, None], other=0.0)
        acc += k.to(tl.float32) * v.to(tl.float32)
    tl.store(Sink + pid, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _read_head_split(K, V, Sink, n, splits, BLOCK_N: tl.constexpr, D: tl.constexpr, HK: tl.constexpr):
    """Our decode grid without the math: program (h, c) reads split c of kv head h (strided rows)."""
    h = tl.program_id(0)
    c = tl.program_id(1)
    per = tl.cdiv(tl.cdiv(n, BLOCK_N), splits) * BLOCK_N
    rows = tl.arange(0, BLOCK_N)
    offs = rows[:, None] * (HK * D) + tl.arange(0, D)[None, :]
    acc = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    base = h * D
    for i in range(c * per, tl.minimum((c + 1) * per, n), BLOCK_N):
        k = tl.load(K + base + i.to(tl.int64) * (HK * D) + offs)
        v = tl.load(V + base + i.to(tl.int64) * (HK * D) + offs)
        acc += k.to(tl.float32) * v.to(tl.float32)
    tl.store(Sink + h * splits + c, tl.sum(tl.sum(acc, 1), 0))


def main():
    from torch.nn.attention import SDPBackend

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth(timer=median_ms_clean_l2)
    out = {"device": torch.cuda.get_device_name(), "sm_count": sms, "copy_gbps_2GB_clean": copy, "points": []}
    tiny = torch.zeros(1, device="cuda")
    out["empty_us"] = median_ms_clean_l2(lambda: tiny.add_(1)) * 1e3
    for b, n in ((1, 32768), (1, 131072), (1, 4096)):
        torch.manual_seed(n)
        q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, n, HK, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        kv_bytes = 2 * k.numel() * k.element_size()
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, N, d) views for SDPA
        ref = _sdpa(SDPBackend.FLASH_ATTENTION)(qt, kt, vt).transpose(1, 2).float()
        plan = dec.decode_plan(b, 1, HQ, HK, D, None, n, 0, q.device)

        def ours():
            return flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)

        def ours_pp():
            return flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, unified_max=0.0)

        err = float((ours().float() - ref).norm() / ref.norm())
        err_pp = float((ours_pp().float() - ref).norm() / ref.norm())
        assert err < 2e-2 and err_pp < 2e-2, (err, err_pp)
        sink = torch.empty(1 << 16, device="cuda")
        kf, vf = k.view(-1, D), v.view(-1, D)
        n_rows = kf.shape[0]
        kv = torch.stack([k, v])

        def flat(progs, bn=64, warps=4, stages=3):
            per = triton.cdiv(triton.cdiv(n_rows, progs), bn) * bn
            grid = (triton.cdiv(n_rows, per),)
            return lambda: _read_loop[grid](kf, vf, sink, per, n_rows, BLOCK_N=bn, D=D, HK=HK,
                                            num_warps=warps, num_stages=stages)

        def head_split(splits, bn=64, warps=4, stages=3):
            return lambda: _read_head_split[(HK, splits)](k, v, sink, n, splits, BLOCK_N=bn, D=D, HK=HK,
                                                          num_warps=warps, num_stages=stages)

        cands = {
            "ours": ours,
            "ours_pp": ours_pp,
            f"read_heads_x{plan.n_splits}": head_split(plan.n_splits),
            f"read_flat_{sms}": flat(sms),
            f"read_flat_{2 * sms}": flat(2 * sms),
            f"read_flat_{4 * sms}": flat(4 * sms),
            "read_flat_2tiles": flat(triton.cdiv(n_rows, 128)),
            "read_flat_8tiles": flat(triton.cdiv(n_rows, 512)),
            "torch_sum": lambda: kv.sum(dtype=torch.float32),
            "copy_same_traffic": (lambda src=k.view(-1), dst=torch.empty_like(k).view(-1): dst.copy_(src)),
            "sdpa_flash": lambda: _sdpa(SDPBackend.FLASH_ATTENTION)(qt, kt, vt),
            "sdpa_cudnn": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION)(qt, kt, vt),
        }
        rec = {"batch": b, "cache": n, "kv_bytes": kv_bytes, "plan": plan._asdict(), "err": err, "err_pp": err_pp, "eager_us": {},
               "graph_us": {}}
        for name, fn in cands.items():
            try:
                fn()
                torch.cuda.synchronize()
                rec["eager_us"][name] = median_ms_clean_l2(fn) * 1e3
                if name in ("ours", "ours_pp", "sdpa_flash") or name.startswith("read_"):
                    rec["graph_us"][name] = median_ms_clean_l2(_graphed(fn)) * 1e3
            except Exception as e:  # noqa: BLE001 - recorded, the rest still runs
                rec.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:160]}"
        out["points"].append(rec)
        print(f"B={b} L={n} {kv_bytes / 1e6:.0f} MB splits={plan.n_splits} err={err:.1e}", flush=True)
        for name in cands:
            e, g = rec["eager_us"].get(name), rec["graph_us"].get(name)
            share = kv_bytes / (e * 1e-6) / 1e9 / copy if e else float("nan")
            print(f"  {name:22s} eager {e or float('nan'):8.1f} us  graph {g or float('nan'):8.1f} us  "
                  f"share(eager) {share:.3f}", flush=True)
        print("  errors:", rec.get("errors"), flush=True)
    print(f"copy 2GB clean {copy:.0f} GB/s, empty kernel {out['empty_us']:.1f} us")
    with open(os.path.join(os.environ.get("OUT", "."), "decode_floor.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
