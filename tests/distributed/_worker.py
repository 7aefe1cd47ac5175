"""Body of the spawned ranks of tests/distributed: gloo on CPU, kernels through Triton's interpreter.

Each rank builds the same full q, k, v, dout from the case's seed, runs the distributed function
on its shard (forward and backward), and rank 0 saves the gathered out, lse, dq, dk, dv (or the
error a case expects) for the parent test to check.
"""

from __future__ import annotations

import os
from datetime import timedelta


def full_inputs(case: dict, device="cpu"):
    """The case's full-sequence q, k, v, dout (batch, seqlen, heads, d), identical on every rank."""
    import torch

    g = torch.Generator().manual_seed(case["seed"])
    b, n, hq, hk, d = case["batch"], case["seqlen"], case["hq"], case["hk"], case["d"]
    dtype = getattr(torch, case.get("dtype", "float32"))
    shapes = ((b, n, hq, d), (b, n, hk, d), (b, n, hk, d), (b, n, hq, d))
    xs = tuple(torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes)
    if case.get("same_heads"):  # every head the same inputs: what tells their outputs apart is dropout alone
        xs = tuple(x[:, :, :1].expand(x.shape).contiguous() for x in xs)
    return xs


def packed_inputs(case: dict, device="cpu"):
    """A packed case's full q, k, v, dout (total, heads, d) and global int32 cu_seqlens_q / _k (``lens_q`` /
    ``lens_k``: the sequences' global lengths), identical on every rank."""
    import torch

    g = torch.Generator().manual_seed(case["seed"])
    lens_q, lens_k = case["lens_q"], case.get("lens_k", case["lens_q"])
    hq, hk, d = case["hq"], case["hk"], case["d"]
    shapes = ((sum(lens_q), hq, d), (sum(lens_k), hk, d), (sum(lens_k), hk, d), (sum(lens_q), hq, d))
    dtype = getattr(torch, case.get("dtype", "float32"))
    xs = tuple(torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes)
    cu = [torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
          for lens in (lens_q, lens_k)]
    return xs, cu[0], cu[1]


def _run_varlen(case, q, k, v, dout, cu_q, cu_k, group, me, size):
    """The packed ring on this rank's shards; (out, lse, dq, dk, dv) gathered back to full packed tensors."""
    import torch

    from flashtile.distributed import ring_varlen, sharding, ulysses

    layout = case["layout"]
    if case.get("expect_error"):  # shards the sharding helper would refuse: 1 / P of each length, from the front
        cq, ck = (torch.div(c, size, rounding_mode="floor").to(torch.int32) for c in (cu_q, cu_k))
        if case["expect_error"] == "lengths" and me == 0:  # one rank's sequences cut elsewhere, the same totals
            cq = ck = torch.tensor([0, 1] + cq.tolist()[2:], dtype=torch.int32)
        qs, ks, vs, ds = q[:int(cq[-1])], k[:int(ck[-1])], v[:int(ck[-1])], dout[:int(cq[-1])]
    else:
        (qs, cq), (ks, ck), (vs, _), (ds, _) = (sharding.shard_packed(x, cu, (me, size), layout=layout)
                                                for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k), (dout, cu_q)))
    leaves = [x.detach().requires_grad_(True) for x in (qs, ks, vs)]
    max_q, max_k = (int(c.diff().max()) if c.numel() > 1 else 0 for c in (cq, ck))
    fn = ulysses.ulysses_flash_attn_varlen_func if case["fn"] == "ulysses-varlen" else \
        ring_varlen.ring_flash_attn_varlen_func
    kw = dict(causal=case.get("causal", False), window_size=case.get("window", (-1, -1)),
              softcap=case.get("softcap", 0.0), layout=layout, return_lse=True)
    if case.get("alibi"):
        kw["alibi_slopes"] = torch.tensor(case["alibi"], dtype=torch.float32, device=q.device)
    if case.get("expect_error") == "dropout" and me == 0:  # an option only the other ranks refuse with it
        kw["dropout_p"] = 0.1
    out, lse = fn(*leaves, cq, ck, max_q, max_k, group, **kw)
    out.backward(ds)
    gather = lambda x, cu, dim=0: sharding.unshard_packed(  # noqa: E731
        x.detach().contiguous(), cu, group, layout=layout, dim=dim).cpu()
    return (gather(out, cq), gather(lse, cq, 1), gather(leaves[0].grad, cq), gather(leaves[1].grad, ck),
            gather(leaves[2].grad, ck))


def _call(case, fn, q, k, v, group):
    import torch

    kw = dict(causal=case.get("causal", False), window_size=case.get("window", (-1, -1)),
              softcap=case.get("softcap", 0.0), deterministic=case.get("deterministic", False), return_lse=True,
              dropout_p=case.get("dropout", 0.0))
    if case.get("layout") is not None:
        kw["layout"] = case["layout"]
    if case.get("alibi"):
        kw["alibi_slopes"] = torch.tensor(case["alibi"], dtype=torch.float32, device=q.device)
    api = case.get("api", "func")
    if api == "qkvpacked":
        qkv = torch.stack((q, k, v), dim=2).detach().requires_grad_(True)
        out, lse = fn["qkvpacked"](qkv, group, **kw)
        return out, lse, (qkv,)
    if api == "kvpacked":
        qq = q.detach().requires_grad_(True)
        kv = torch.stack((k, v), dim=2).detach().requires_grad_(True)
        out, lse = fn["kvpacked"](qq, kv, group, **kw)
        return out, lse, (qq, kv)
    qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
    out, lse = fn["func"](qq, kk, vv, group, **kw)
    return out, lse, (qq, kk, vv)


def _grads(api, leaves):
    if api == "qkvpacked":
        return leaves[0].grad.unbind(2)
    if api == "kvpacked":
        return (leaves[0].grad, *leaves[1].grad.unbind(2))
    return tuple(x.grad for x in leaves)


def _split(dist, world: int, size: int):
    """Groups of ``size`` consecutive ranks (every rank creates every group, as new_group requires)."""
    if size == world:
        return None  # the default group
    groups = [dist.new_group(list(range(first, first + size))) for first in range(0, world, size)]
    return groups[dist.get_rank() // size]


def run(rank: int, world: int, port: int, stages: list, result_path: str, backend: str = "gloo") -> None:
    """One rank: ``backend`` "gloo" (CPU, Triton's interpreter) or "nccl" (GPU ``rank``).

    ``stages``: ``(size, cases)`` pairs; a size below ``world`` splits the ranks into groups of
    ``size`` consecutive ranks that run the cases side by side (so groups whose ranks are not
    0..size-1 are exercised too).  Each group's first rank saves ``{result_path}.{size}.{group}``."""
    if backend == "gloo":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    from flashtile.distributed import ring, sharding, ulysses

    fns = {
        "ring": {"func": ring.ring_flash_attn_func, "qkvpacked": ring.ring_flash_attn_qkvpacked_func,
                 "kvpacked": ring.ring_flash_attn_kvpacked_func},
        "ulysses": {"func": ulysses.ulysses_flash_attn_func},
    }
    for size, cases in stages:
        results = {}
        stage_group = _split(dist, world, size)
        me = rank % size  # rank inside the group
        for case in cases:
            group = stage_group
            if case.get("mesh"):
                from torch.distributed.device_mesh import init_device_mesh

                assert size == world, "a mesh case runs on all ranks"
                group = init_device_mesh(device.type, (world,))
            layout = case.get("layout") or "contiguous"
            if case["fn"].endswith("-varlen"):
                (q, k, v, dout), cu_q, cu_k = packed_inputs(case, device)
                try:
                    results[case["name"]] = _run_varlen(case, q, k, v, dout, cu_q, cu_k, group, me, size)
                except Exception as e:  # noqa: BLE001 - a case that expects an error: the parent checks it
                    if not case.get("expect_error"):
                        raise
                    results[case["name"]] = (type(e).__name__, str(e))
                continue
            q, k, v, dout = full_inputs(case, device)
            if case.get("expect_error"):
                group = _split(dist, world, size) or dist.new_group(list(range(world)))  # checked at a group's first call
                # "unequal": the group's first shard is longer than the others'; otherwise equal shards
                n = q.shape[1] // size + (2 if me == 0 and case["expect_error"] == "unequal" else 0)
                if case["expect_error"] == "softcap" and me == 0:  # one rank's options differ
                    case = {**case, "softcap": 2.0}
                if case["expect_error"] == "alibi" and me == 0:  # one rank passes what the ring refuses
                    case = {**case, "alibi": [0.5] * case.get("hq", 2)}
                try:
                    _call(case, fns[case["fn"]], q[:, :n], k[:, :n], v[:, :n], group)
                    results[case["name"]] = "no error"
                except Exception as e:  # noqa: BLE001 - the parent checks the type and message
                    results[case["name"]] = (type(e).__name__, str(e))
                continue
            shard = lambda x: sharding.shard_sequence(x, (me, size), layout=layout)  # noqa: E731
            if case.get("same_heads"):  # every rank's generators seeded alike, as a training script does
                torch.manual_seed(case["seed"])
            if case.get("dropout"):
                from flashtile.ops.autograd import next_philox_state

                states = [None] * size  # each rank's (seed, offset) of the coming call
                dist.all_gather_object(states, next_philox_state(device), group=group)
                results[case["name"] + ":philox"] = states
            out, lse, leaves = _call(case, fns[case["fn"]], shard(q), shard(k), shard(v), group)
            if case.get("double_backward"):  # a constant upstream gradient, then a penalty on dq: must raise
                gq, = torch.autograd.grad((out * shard(dout)).sum(), leaves[0], create_graph=True)
                try:
                    gq.square().sum().backward()
                    results[case["name"]] = "no error"
                except RuntimeError as e:
                    results[case["name"]] = ("RuntimeError", str(e))
                continue
            out.backward(shard(dout))
            grads = _grads(case.get("api", "func"), leaves)
            gather = lambda x, dim=1: sharding.unshard_sequence(  # noqa: E731
                x.detach().contiguous(), group, layout=layout, dim=dim).cpu()
            results[case["name"]] = tuple([gather(out), gather(lse, 2)] + [gather(g) for g in grads])
        if me == 0:
            torch.save(results, f"{result_path}.{size}.{rank // size}")
    dist.barrier()
    dist.destroy_process_group()
