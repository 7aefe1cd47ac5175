"""Context-parallel attention benchmark: ring / Ulysses over P GPUs against one GPU and PyTorch's context_parallel.

Run under torchrun, one process per GPU (``flashtile bench ring --nproc 4`` launches it):

    torchrun --nproc-per-node 4 -m flashtile.bench.ring --seqlens 16384 65536 --causal yes

For each total length N it times forward + backward (median of ``--reps`` after warm-up, CUDA
events around each step, the slowest rank's time) of

* ``ring``: :func:`flashtile.distributed.ring_flash_attn_func` on N / P tokens per GPU
  (zigzag layout when causal, contiguous otherwise);
* ``ulysses``: :func:`flashtile.distributed.ulysses_flash_attn_func` (when P divides the q heads and the kv heads divide or are divided by P);
* ``one_gpu_shard``: :func:`flashtile.flash_attn_func` on one GPU over an N / P-token sequence
  (the per-GPU work a sequence shard would be without context parallelism);
* ``one_gpu_full``: the same over all N tokens on one GPU (ideal scaling: its time / P), when it fits;
* ``torch_cp``: ``torch.distributed.tensor.experimental.context_parallel`` around SDPA (kv heads
  repeated to the query heads: its ring needs equal heads), when the installed torch has it.

and reports per-GPU TFLOP/s (attention matmul FLOPs of the full problem / P / time; causal
halves them).  Rank 0 writes ``bench/results/ring_<P>x<device>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Callable

import torch
import torch.distributed as dist

from flashtile.bench.common import attention_flops as _attention_flops

__all__ = ["main", "attention_flops"]


def attention_flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool, with_bwd: bool = True) -> float:
    """:func:`flashtile.bench.common.attention_flops`, forward + backward by default (ring attention trains)."""
    return _attention_flops(batch, heads, seqlen, head_dim, causal, with_bwd)


def _time_ms(step: Callable[[], None], reps: int, warmup: int, group=None) -> float:
    """Median ms of ``step`` on this rank; with ``group``, the slowest rank's median."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if group is not None:
            dist.barrier(group=group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = torch.tensor([statistics.median(times)], device="cuda")
    if group is not None:
        dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return float(ms.item())


def _fwd_bwd(fn, leaves, dout):
    def step():
        for x in leaves:
            x.grad = None
        fn(*leaves).backward(dout)
    return step


def _torch_cp_step(q, k, v, dout, causal, world):
    """fwd + bwd of SDPA under torch's context_parallel on full (B, H, N, d) buffers, or a reason it is unavailable."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
    except ImportError as e:
        return None, f"unavailable: {e}"
    mesh = init_device_mesh("cuda", (world,))
    qf, kf, vf, df = (x.detach().transpose(1, 2).contiguous() for x in (q, k, v, dout))

    def step():
        leaves = [x.detach().clone().requires_grad_(True) for x in (qf, kf, vf)]
        grad = df.clone()
        with context_parallel(mesh, buffers=[*leaves, grad], buffer_seq_dims=[2, 2, 2, 2]):
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
            out.backward(grad)
    try:
        step()
    except Exception as e:  # noqa: BLE001 - the experimental API changes between torch releases
        return None, f"failed: {type(e).__name__}: {e}"
    return step, "ok"


def run(args: argparse.Namespace) -> dict:
    from flashtile import flash_attn_func
    from flashtile.bench.common import environment
    from flashtile.distributed import ring_flash_attn_func, shard_sequence, ulysses_flash_attn_func

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    b, hq, hk, d = args.batch, args.heads, args.kv_heads, args.head_dim
    rows = []
    for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]:
        layout = "zigzag" if causal else "contiguous"
        for n in args.seqlens:
            g = torch.Generator(device="cuda").manual_seed(n)
            full = [torch.randn(b, n, h, d, device="cuda", dtype=dtype, generator=g) for h in (hq, hk, hk, hq)]
            shard = [shard_sequence(x, None, layout=layout).requires_grad_(i < 3) for i, x in enumerate(full)]
            row = {"seqlen": n, "causal": causal, "layout": layout, "world": world}
            per_gpu_flops = attention_flops(b, hq, n, d, causal) / world
            ring = lambda q, k, v: ring_flash_attn_func(q, k, v, causal=causal, layout=layout)  # noqa: E731
            ms = _time_ms(_fwd_bwd(ring, shard[:3], shard[3]), args.reps, args.warmup, dist.group.WORLD)
            row["ring_ms"], row["ring_tflops_per_gpu"] = ms, per_gpu_flops / ms / 1e9
            if hq % world == 0 and (hk % world == 0 or world % hk == 0):
                uly = lambda q, k, v: ulysses_flash_attn_func(q, k, v, causal=causal, layout=layout)  # noqa: E731
                ms = _time_ms(_fwd_bwd(uly, shard[:3], shard[3]), args.reps, args.warmup, dist.group.WORLD)
                row["ulysses_ms"], row["ulysses_tflops_per_gpu"] = ms, per_gpu_flops / ms / 1e9
            one = lambda q, k, v: flash_attn_func(q, k, v, causal=causal)  # noqa: E731
            local = [x.detach()[:, : n // world].clone().requires_grad_(i < 3) for i, x in enumerate(full)]
            ms = _time_ms(_fwd_bwd(one, local[:3], local[3]), args.reps, args.warmup)
            row["one_gpu_shard_ms"] = ms
            row["one_gpu_shard_tflops"] = attention_flops(b, hq, n // world, d, causal) / ms / 1e9
            try:
                leaves = [x.detach().clone().requires_grad_(i < 3) for i, x in enumerate(full)]
                ms = _time_ms(_fwd_bwd(one, leaves[:3], leaves[3]), args.reps, args.warmup)
                row["one_gpu_full_ms"], row["ideal_ms"] = ms, ms / world
                row["scaling_efficiency"] = (ms / world) / row["ring_ms"]
            except torch.OutOfMemoryError:
                row["one_gpu_full_ms"] = "out of memory"
            torch.cuda.empty_cache()
            rep = hq // hk
            step, status = _torch_cp_step(full[0], full[1].repeat_interleave(rep, 2), full[2].repeat_interleave(rep, 2),
                                          full[3], causal, world)
            row["torch_cp"] = status
            if step is not None:
                ms = _time_ms(step, args.reps, args.warmup, dist.group.WORLD)
                row["torch_cp_ms"], row["torch_cp_tflops_per_gpu"] = ms, per_gpu_flops / ms / 1e9
            rows.append(row)
            if rank == 0:
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    config = dict(batch=b, heads=hq, kv_heads=hk, head_dim=d, dtype=args.dtype, reps=args.reps, warmup=args.warmup)
    return {"env": environment(), "config": config, "rows": rows}


_OPTIONS = ("seqlens", "causal", "batch", "heads", "kv_heads", "head_dim", "dtype", "reps", "warmup", "out")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The benchmark's options (shared with `flashtile bench ring`)."""
    p.add_argument("--seqlens", nargs="+", type=int, default=[16384, 32768, 65536])
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="bench/results")
    return p


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog="python -m flashtile.bench.ring", description=__doc__.split("\n\n")[0]))


def to_argv(args: argparse.Namespace) -> list[str]:
    """Parsed options back to command-line arguments (for the torchrun launch)."""
    argv = []
    for name in _OPTIONS:
        value = getattr(args, name)
        argv += [f"--{name.replace('_', '-')}", *(str(x) for x in (value if isinstance(value, list) else [value]))]
    return argv


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc-per-node P -m flashtile.bench.ring ... "
                         "(or `flashtile bench ring --nproc P`)")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        payload = run(args)
        if dist.get_rank() == 0:
            from flashtile.bench.common import write_json

            path = write_json(payload, args.out, f"ring_{dist.get_world_size()}x")
            print(f"wrote {path}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
