"""`flashtile bench hopper-ablation`: the FA3 paper's ablation (§4.2, Table 2), measured on our Hopper kernel.

One kernel (:mod:`flashtile.kernels.fa3_fwd`), one switch changed at a time from its tuned config
(:func:`flashtile.runtime.fa3_fwd.fa3_config`; FP8: ``fa3_fp8_config``):

* ``tuned``              -- the config the dispatcher runs: warp-specialised (a producer warpgroup issuing
  TMA loads into a 2-stage shared-memory ring, two consumer warpgroups of 64 rows running wgmma and the
  softmax, ``setmaxnreg`` moving registers to them), O stored through TMA where it fits;
* ``no warp specialisation`` -- the same tiles with every warp a consumer (2 warpgroups = 8 warps,
  each loading its own tiles; Triton's software pipeliner overlaps loads of the next tile instead);
* ``1 stage``            -- warp-specialised with a 1-deep ring (the producer cannot run ahead);
* ``O by plain stores``  -- the epilogue without the TMA staging tile (flips ``o_tma``);
* ``fp8``                -- the same kernel in its FP8 mode (e4m3 inputs, per-head scales).

FA3's other two ingredients are not switches of that kernel: Triton 3.6's ``warp_specialize`` decides
itself how the consumer warpgroups interleave (no explicit ping-pong barrier), and it accepts one loop
with a branch-free body, which rules out FA3's intra-warpgroup pipelining (softmax of tile j under the
QKᵀ wgmma of tile j+1).  The JSON lists them under ``not_expressible`` for that kernel.  They are
switches of the Gluon kernel (:mod:`flashtile.kernels.fa3_gluon`, d = 64, 128, 256), measured as
``gluon`` (both on), ``gluon no ping-pong``, ``gluon no intra-warpgroup overlap``, ``gluon neither``, and
with the overlap as FA3 runs it (``GluonConfig.fence``: without it ptxas waits for the P V GEMM before the
softmax) ``gluon, softmax fenced`` and ``gluon no ping-pong, softmax fenced``, and with P carried in packed pairs
(``GluonConfig.pack_p``, the dispatch's at widths 33-128) ``gluon, P packed`` and ``gluon, softmax fenced, P packed``,
and with the ring's releases and the turns on hardware named barriers (``GluonConfig.named_bars``)
``gluon, P packed, named barriers``.

``backward=True`` (``--backward``) measures the Gluon backward instead (:mod:`flashtile.kernels.fa3_gluon_bwd`): its
table config, ``no ping-pong``, the narrow kernel's ``named barriers`` and both kernels' ``host descriptors``
(``GluonBwdConfig``), each checked against FA2's backward (dQ, dK, dV within 2e-2 of each one's max) and timed in
interleaved rounds; TFLOP/s = 2.5 x the forward's FLOPs / backward time.

Every variant is checked against the FA2 kernel's output on the same inputs before it is timed (within
2e-2 of max|out|; FP8 within 0.15, as far as e4m3 inputs put FA3's FP8 forward from bf16 on these inputs).
TFLOP/s = 4·B·H·N²·d / time (halved when causal); % of peak against 989 TFLOP/s (dense bf16, H100 SXM)
or 1979 (FP8).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from flashtile.bench.common import check_row, environment, median_ms, time_rounds

__all__ = ["VARIANTS", "NOT_EXPRESSIBLE", "PEAK_TFLOPS", "run_ablation", "plot"]

LOG2E = 1.0 / math.log(2.0)
PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}
NOT_EXPRESSIBLE = {  # in the Triton kernel; the Gluon rows measure both
    "ping-pong scheduling": "Triton 3.6's warp_specialize places the consumer warpgroups itself; there is no "
                            "named barrier to order one's softmax under the other's GEMMs",
    "intra-warpgroup overlap": "needs a software-pipelined loop (prologue, steady state, epilogue); Triton 3.6's "
                               "warp-specialised loop must be the only loop and branch-free",
}


def _tuned(cfg):
    return cfg


def _no_ws(cfg):
    return dataclasses.replace(cfg, warp_spec=False, num_warps=8, o_tma=cfg.o_tma)


def _one_stage(cfg):
    return dataclasses.replace(cfg, num_stages=1)


def _plain_o(cfg):
    return dataclasses.replace(cfg, o_tma=not cfg.o_tma)


VARIANTS: dict[str, Callable] = {
    "tuned": _tuned,
    "no warp specialisation": _no_ws,
    "1 stage": _one_stage,
    "O by plain stores": _plain_o,
    "fp8": _tuned,
}
# the Gluon kernel (flashtile/kernels/fa3_gluon.py), where FA3's two schedules are switches of GluonConfig; without
# the fence ptxas waits for the P V GEMM near the softmax's start (GluonConfig.fence)
_GLUON_OFF = dict(pingpong=False, intra=False, fence=False, pack_p=False, named_bars=False)
GLUON_VARIANTS = {
    "gluon": dict(_GLUON_OFF, pingpong=True, intra=True),
    "gluon no ping-pong": dict(_GLUON_OFF, intra=True),
    "gluon no intra-warpgroup overlap": dict(_GLUON_OFF, pingpong=True),
    "gluon neither": dict(_GLUON_OFF),
    "gluon, softmax fenced": dict(_GLUON_OFF, pingpong=True, intra=True, fence=True),
    "gluon no ping-pong, softmax fenced": dict(_GLUON_OFF, intra=True, fence=True),
    "gluon, P packed": dict(_GLUON_OFF, pingpong=True, intra=True, pack_p=True),
    "gluon, softmax fenced, P packed": dict(_GLUON_OFF, pingpong=True, intra=True, fence=True, pack_p=True),
    "gluon, P packed, named barriers": dict(_GLUON_OFF, pingpong=True, intra=True, pack_p=True, named_bars=True),
}
# the Gluon backward (flashtile/kernels/fa3_gluon_bwd.py): switches of its table config (gluon_bwd_config); named
# barriers are the narrow kernel's (d <= 128: the wide kernel's rows record the refusal), host descriptors both's
GLUON_BWD_VARIANTS = {
    "gluon bwd": {},
    "gluon bwd no ping-pong": dict(pingpong=False),
    "gluon bwd, named barriers": dict(named_bars=True),
    "gluon bwd, host descriptors": dict(host_desc=True),
    "gluon bwd, named barriers, host descriptors": dict(named_bars=True, host_desc=True),
    "gluon bwd, 64 q rows per step": dict(block_m=64),
    "gluon bwd, mbarriers": dict(named_bars=False),
    "gluon bwd, Pᵀ through shared memory": dict(pt_regs=False, pt_separate=True),
    # the wide kernel's (d > 128; the table's config below): dO in the Q ring, then the score GEMMs unsplit too
    "gluon bwd, dO in the Q ring": dict(do_stages=0),
    "gluon bwd, unsplit score GEMMs": dict(do_stages=0, split_s=False),
}


def default_grid(head_dims=(64, 128, 256), seqlens=(4096, 16384), total_tokens=16384):
    """bf16, B·N = 16k tokens, H = 2048 / d (the attention bench's grid)."""
    for d in head_dims:
        for n in seqlens:
            for causal in (False, True):
                yield d, n, max(1, total_tokens // n), 2048 // d, causal


def _point(d, n, b, h, causal, variants, progress=None, rounds=1) -> list[dict]:
    from flashtile.fp8 import quantize_per_head
    from flashtile.runtime import fa3_fwd
    from flashtile.runtime.decode import error_flags
    from flashtile.runtime.fa2_fwd import fa2_forward

    gen = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    scale = d ** -0.5
    ref, _ = fa2_forward(q, k, v, softmax_scale=scale, causal=causal)
    fa3_fwd.ensure_allocator()
    q8, qs = quantize_per_head(q, kv_heads=h)
    k8, ks = quantize_per_head(k)
    v8, vs = quantize_per_head(v)
    vt = torch.zeros(b, h, d, -(-n // 16) * 16, dtype=v8.dtype, device="cuda")
    vt[..., :n] = v8.transpose(2, 3)
    flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
    rows = []
    for name in variants:
        fp8 = name == "fp8"
        base = fa3_fwd.fa3_fp8_config(d, causal) if fp8 else fa3_fwd.fa3_config(d, causal, n, n)
        cfg = VARIANTS[name](base)
        out = torch.empty_like(q)
        lse = torch.empty(b, h, n, device="cuda")
        if fp8:
            def call():
                fa3_fwd.launch(q8, k8, vt, out, lse, scale * LOG2E, causal, cfg, descales=(qs, ks, vs),
                               err=error_flags(q.device)[1:])
        else:
            def call():
                fa3_fwd.launch(q, k, v, out, lse, scale * LOG2E, causal, cfg)
        row = dict(head_dim=d, seqlen=n, batch=b, heads=h, causal=causal, variant=name, config=dataclasses.asdict(cfg))
        if progress:
            progress(f"d={d} N={n} causal={causal} {name}")
        try:
            call()
            torch.cuda.synchronize()
            err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
            row["max_rel_err_vs_fa2"] = err
            # e4m3 inputs: FA3's FP8 forward sits as far from bf16 (attention bench, err column: 0.053 both)
            if err > (0.15 if fp8 else 2e-2):
                row["error"] = f"output differs from FA2's by {err:.3g} of max|out|: not timed"
            else:
                ms = median_ms(call)
                row["ms"] = ms
                row["tflops"] = flops / (ms * 1e-3) / 1e12
                row["pct_peak"] = 100 * row["tflops"] / PEAK_TFLOPS["fp8" if fp8 else "bf16"]
        except Exception as e:  # a config the compiler rejects (shared memory, a pass failure)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
        torch.cuda.empty_cache()
    rows.extend(_gluon_rows(d, n, b, h, causal, q, k, v, ref, flops, progress, rounds))
    return rows


def _gluon_rows(d, n, b, h, causal, q, k, v, ref, flops, progress=None, rounds=1) -> list[dict]:
    """The Gluon kernel's schedule rows: each variant checked against FA2's output, then the ones that pass timed
    in ``rounds`` interleaved rounds (:func:`~flashtile.bench.common.time_rounds`)."""
    from flashtile.runtime.fa3_gluon import GLUON_HEAD_DIMS, fa3_gluon_forward, gluon_config

    if d not in GLUON_HEAD_DIMS:
        return []
    rows, timed = [], []
    for name, switches in GLUON_VARIANTS.items():
        cfg = dataclasses.replace(gluon_config(d, causal), o_tma=True, **switches)
        row = dict(head_dim=d, seqlen=n, batch=b, heads=h, causal=causal, variant=name, config=dataclasses.asdict(cfg))
        rows.append(row)
        if progress:
            progress(f"d={d} N={n} causal={causal} {name}")
        out = torch.empty_like(q)

        def call(cfg=cfg, out=out):
            fa3_gluon_forward(q, k, v, softmax_scale=d ** -0.5, causal=causal, out=out, config=cfg)

        check_row(row, call, lambda out=out: [out], [ref], timed)
    time_rounds(timed, rounds, flops, PEAK_TFLOPS["bf16"], timer=median_ms)
    return rows


def _bwd_point(d, n, b, h, causal, progress=None, rounds=1) -> list[dict]:
    """:func:`_gluon_bwd_rows` on fresh bf16 inputs."""
    gen = torch.Generator(device="cuda").manual_seed(n + d + 1)
    q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    return _gluon_bwd_rows(d, n, b, h, causal, q, k, v, dout, progress, rounds)


def _gluon_bwd_rows(d, n, b, h, causal, q, k, v, dout, progress=None, rounds=1) -> list[dict]:
    """The Gluon backward's rows (:data:`GLUON_BWD_VARIANTS`): each variant's dQ, dK, dV checked against FA2's
    backward from the same O and LSE (within 2e-2 of each gradient's max), then the ones that pass timed as the
    forward's rows (backward alone: 2.5x the forward's FLOPs)."""
    from flashtile.runtime.fa2_bwd import fa2_backward
    from flashtile.runtime.fa2_fwd import fa2_forward
    from flashtile.runtime.fa3_gluon_bwd import GLUON_BWD_HEAD_DIMS, fa3_gluon_backward, gluon_bwd_config, variant_base

    if d not in GLUON_BWD_HEAD_DIMS:
        return []
    scale = d ** -0.5
    out, lse = fa2_forward(q, k, v, softmax_scale=scale, causal=causal)
    ref = fa2_backward(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal)
    flops = 2.5 * 4.0 * b * h * n * n * d / (2 if causal else 1)
    rows, timed = [], []
    for name, switches in GLUON_BWD_VARIANTS.items():
        cfg = dataclasses.replace(variant_base(gluon_bwd_config(d, causal), d, causal, switches), **switches)
        row = dict(head_dim=d, seqlen=n, batch=b, heads=h, causal=causal, variant=name, config=dataclasses.asdict(cfg))
        rows.append(row)
        if progress:
            progress(f"backward d={d} N={n} causal={causal} {name}")
        grads = [torch.empty_like(x) for x in (q, k, v)]

        def call(cfg=cfg, grads=grads):
            fa3_gluon_backward(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal, dq=grads[0], dk=grads[1],
                               dv=grads[2], config=cfg)

        check_row(row, call, lambda grads=grads: grads, ref, timed)
    time_rounds(timed, rounds, flops, PEAK_TFLOPS["bf16"], timer=median_ms)
    return rows


def run_ablation(grid=None, variants=tuple(VARIANTS), progress=None, rounds: int = 1, backward: bool = False) -> dict:
    """The payload ``{env, peak_tflops, not_expressible, rows}``; needs an sm_90 GPU.  ``variants``: the Triton
    kernel's rows (empty: the Gluon rows alone); ``rounds``: interleaved timing rounds of the Gluon rows;
    ``backward``: the Gluon backward's rows alone (:data:`GLUON_BWD_VARIANTS`)."""
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    if not isinstance(backward, bool):
        raise TypeError(f"backward must be a bool, got {type(backward).__name__}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise RuntimeError("`flashtile bench hopper-ablation` needs an sm_90 (Hopper) GPU")
    rows = []
    for d, n, b, h, causal in grid if grid is not None else default_grid():
        if backward:
            rows.extend(_bwd_point(d, n, b, h, causal, progress, rounds))
        else:
            rows.extend(_point(d, n, b, h, causal, variants, progress, rounds))
    return {
        "env": environment(),
        "peak_tflops": PEAK_TFLOPS,
        "direction": "backward" if backward else "forward",
        "flops_convention": ("2.5*4*B*H*N^2*d backward alone" if backward else "4*B*H*N^2*d forward") + ", /2 causal",
        "not_expressible": {} if backward else NOT_EXPRESSIBLE,
        "rows": rows,
    }


def plot(payload: dict, path) -> None:
    """% of peak per variant, one bar group per (d, N, causal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    groups = sorted({(r["head_dim"], r["seqlen"], r["causal"]) for r in rows})
    names = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(groups)), 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        ys = []
        for g in groups:
            hit = [r for r in rows if (r["head_dim"], r["seqlen"], r["causal"]) == g and r["variant"] == name]
            ys.append(hit[0].get("pct_peak", 0.0) if hit else 0.0)
        ax.bar([j + i * width for j in range(len(groups))], ys, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"d{d} {n // 1024}k{' C' if c else ''}" for d, n, c in groups], fontsize=8)
    ax.set_ylabel("% of dense peak")
    ax.set_title(f"Hopper {payload.get('direction', 'forward')} ablation, {payload['env'].get('device')}")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
