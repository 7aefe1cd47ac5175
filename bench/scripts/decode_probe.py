"""Where does a short-cache decoding call spend its time?  (GPU only; one process.)

1. host microseconds per call (wall clock of 300 back-to-back calls, no sync inside):
   SDPA-flash, our op, flash_decode, a bare Triton launch of a kernel with 1 / 16 / 48 arguments,
   a direct launch of the compiled kernel object, torch.empty.
2. GPU microseconds per call with the host taken out (one call captured in a CUDA graph, replayed under
   do_bench): SDPA flash / cuDNN and flash_decode at num_splits 1..64, several (batch, cache) points.
Writes $OUT/decode_probe.json and prints a table.
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from flashtile.bench.decode import _graphed, host_us as _bench_host_us
from flashtile.kernels import decode as dec
from flashtile.ops.kvcache import flash_attn_with_kvcache

HQ, HK, D = 32, 8, 128


def host_us(fn):
    return _bench_host_us(fn, n=300)


def graph_us(fn):
    replay = _graphed(fn)
    replay()  # captures
    return do_bench(replay, return_mode="median") * 1e3


@triton.jit
def _k1(X):
    tl.store(X, 1.0)


@triton.jit
def _k16(X, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
    tl.store(X, (a1 + a15).to(tl.float32))


@triton.jit
def _k48(X, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20,
         a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32, a33, a34, a35, a36, a37, a38, a39, a40,
         a41, a42, a43, a44, a45, a46, a47):
    tl.store(X, (a1 + a47).to(tl.float32))


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return run


def main():
    from torch.nn.attention import SDPBackend
    out = {"device": torch.cuda.get_device_name(), "host_us": {}, "gpu_us": []}
    x = torch.zeros(4, device="cuda")
    ints = list(range(3, 50))
    out["host_us"]["triton_1arg"] = host_us(lambda: _k1[(1,)](x))
    out["host_us"]["triton_16arg"] = host_us(lambda: _k16[(1,)](x, *ints[:15]))
    out["host_us"]["triton_48arg"] = host_us(lambda: _k48[(1,)](x, *ints[:47]))
    try:
        ck = _k48.warmup(x, *ints[:47], grid=(1,))
        r = ck[(1, 1, 1)]
        out["host_us"]["compiled_48arg_direct"] = host_us(lambda: r(x, *ints[:47]))
    except Exception as e:  # noqa: BLE001
        out["host_us"]["compiled_48arg_direct"] = repr(e)
    out["host_us"]["torch_empty"] = host_us(lambda: torch.empty(1024, device="cuda"))
    out["host_us"]["torch_full"] = host_us(lambda: torch.full((8,), 3, dtype=torch.int32, device="cuda"))

    flash, cudnn = sdpa(SDPBackend.FLASH_ATTENTION), sdpa(SDPBackend.CUDNN_ATTENTION)
    for b, L in ((1, 1024), (1, 4096), (8, 1024), (8, 4096), (1, 32768), (8, 32768), (64, 1024)):
        q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, L, HK, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        row = {"batch": b, "cache": L}
        if (b, L) == (1, 1024):
            out["host_us"]["sdpa_flash"] = host_us(lambda: flash(qt, kt, vt))
            out["host_us"]["op"] = host_us(lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens))
            out["host_us"]["op_int_seqlens"] = host_us(lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=L))
            out["host_us"]["flash_decode_s1"] = host_us(lambda: dec.flash_decode(q, k, v, lens, num_splits=1))
            out["host_us"]["flash_decode_s16"] = host_us(lambda: dec.flash_decode(q, k, v, lens, num_splits=16))
        row["sdpa_flash"] = graph_us(lambda: flash(qt, kt, vt))
        row["sdpa_cudnn"] = graph_us(lambda: cudnn(qt, kt, vt))
        row["sdpa_flash_eager_dobench"] = do_bench(lambda: flash(qt, kt, vt), return_mode="median") * 1e3
        row["op_eager_dobench"] = do_bench(lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens), return_mode="median") * 1e3
        row["heuristic_splits"] = dec.num_splits_heuristic(b * HK, 1, L, torch.cuda.get_device_properties(0).multi_processor_count,
                                                           dec.decode_config(D, 4, None, q.device)[1])
        ref = flash(qt, kt, vt).transpose(1, 2).float()
        for s in (0, 1, 2, 4, 8, 16, 32, 64):
            o, _ = dec.flash_decode(q, k, v, lens, num_splits=s)
            err = float((o.float() - ref).norm() / ref.norm())
            assert err < 2e-2, (b, L, s, err)
            row[f"fd_s{s}"] = graph_us(lambda: dec.flash_decode(q, k, v, lens, num_splits=s))
        out["gpu_us"].append(row)
        print(row, flush=True)
    print(json.dumps(out["host_us"], indent=1))
    os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "."), "decode_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
