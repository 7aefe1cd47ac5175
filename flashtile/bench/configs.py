"""`flashtile bench configs`: the config the dispatch runs at each point against named variants of it.

A tuning probe for the Hopper kernels, one GPU call: per (head dim, N, causal) the dispatched config
(``gluon-fwd``: :func:`flashtile.runtime.fa3_fwd.gluon_dispatch_config` for the shape, host descriptors, persistent
and dynamic grids included; ``gluon-bwd``: :func:`flashtile.runtime.fa3_gluon_bwd.dispatch_config`; ``gluon-fp8``:
the Gluon FP8 kernel's ``gluon_fp8_config``, through ``fa3_forward_fp8`` with V's operand copy, on inputs
quantised per (batch, head)) is the row ``dispatch``, and each variant is that config with some fields replaced
(``--variant "name: field=value ..."``).  Every row is first checked against FA2's kernel on the same inputs
(outputs, or dQ / dK / dV, within 2e-2 of each one's max; FP8: the dequantised inputs, within 6e-2), then the
rows that pass, with FA3's forward as a peer where its wheel imports (``gluon-fwd``, ``gluon-fp8``), are
timed in interleaved rounds (``bench.common.time_rounds``), so the machine's drift hits every row alike.  bf16,
B·N = 16k tokens, H·d = 2048, inputs in flash-attn's (B, N, H, d) layout; TFLOP/s = 4·B·H·N²·d / time (halved
when causal), 2.5× that for the backward alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from flashtile.bench.common import check_row, environment, median_ms, time_rounds

__all__ = ["ROUTINES", "parse_variant", "run_configs"]

ROUTINES = ("gluon-fwd", "gluon-bwd", "gluon-fp8")


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``"3wg dynamic: num_wg=3 dynamic=True"`` -> ``("3wg dynamic", {"num_wg": 3, "dynamic": True})`` (values as
    Python literals); ``ValueError`` naming the spec when it is malformed or its name is ``dispatch``."""
    from flashtile.bench.sm90 import parse_overrides

    name, sep, fields = spec.partition(":")
    name = name.strip()
    if not sep or not name or not fields.split():
        raise ValueError(f"--variant takes 'name: field=value ...', got {spec!r}")
    if name == "dispatch":
        raise ValueError("--variant: 'dispatch' names the dispatched config's own row")
    return name, parse_overrides(fields.split())


def _rows(routine: str, d: int, n: int, b: int, h: int, causal: bool, q, k, v, dout, variants: dict, fa3,
          progress=None, rounds: int = 1) -> list[dict]:
    """The point's rows on (B, N, H, d) inputs: ``dispatch``, each variant, and ``fa3`` (``gluon-fwd``, when given
    FA3's interface), each checked against FA2 and timed (``time_rounds``)."""
    from flashtile.runtime import fa3_fwd, fa3_gluon, fa3_gluon_bwd
    from flashtile.runtime.fa2_bwd import fa2_backward
    from flashtile.runtime.fa2_fwd import fa2_forward

    qv, kv, vv, dov = (x.transpose(1, 2) for x in (q, k, v, dout))  # the kernels' (B, H, N, d) views
    scale = d ** -0.5
    tol, peak = 2e-2, 989.0
    if routine == "gluon-fp8":
        from flashtile.fp8 import quantize_per_head
        from flashtile.runtime.fa3_gluon import FP8_DYNAMIC_MIN_KEYS, gluon_fp8_config

        # e4m3 per (batch, head); FA2 runs the dequantised inputs (in bf16), which P's e4m3 rounding in the
        # kernel moves by a few % of max|out|: the check only catches broken configs (the twin tests the rest)
        hk = k.shape[2]  # FA3's descales are per (batch, kv head), q's shared by a GQA group
        (q8, qs), (k8, ks), (v8, vs) = (quantize_per_head(x, layout="bnhd", kv_heads=hk) for x in (q, k, v))
        qv, kv, vv = ((x8.float() * ds.repeat_interleave(x8.shape[2] // hk, dim=1)[:, None, :, None])
                      .to(torch.bfloat16).transpose(1, 2) for x8, ds in ((q8, qs), (k8, ks), (v8, vs)))
        q8v, k8v, v8v = (x.transpose(1, 2) for x in (q8, k8, v8))
        tol, peak = 6e-2, 1979.0
    out_ref, lse = fa2_forward(qv, kv, vv, softmax_scale=scale, causal=causal)
    flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
    if routine == "gluon-fwd":
        base = fa3_fwd.gluon_dispatch_config(qv, kv, causal)
        ref = [out_ref]
    elif routine == "gluon-fp8":
        # the Gluon FP8 kernel's table config at this point (forced where the dispatch runs the Triton kernel)
        try:
            base = gluon_fp8_config(d, causal, n >= FP8_DYNAMIC_MIN_KEYS)
        except NotImplementedError as e:  # a width the Gluon FP8 kernel does not cover
            return [dict(head_dim=d, seqlen=n, batch=b, heads=h, causal=causal, variant="dispatch", fields={},
                         error=f"NotImplementedError: {e}")]
        ref = [out_ref]
    else:
        base = fa3_gluon_bwd.dispatch_config(qv, kv, causal)
        ref = fa2_backward(dov, qv, kv, vv, out_ref, lse, softmax_scale=scale, causal=causal)
        flops *= 2.5
    rows, timed = [], []
    for name, fields in {"dispatch": {}, **variants}.items():
        row = dict(head_dim=d, seqlen=n, batch=b, heads=h, causal=causal, variant=name, fields=fields)
        rows.append(row)
        if progress:
            progress(f"{routine} d={d} N={n} causal={causal} {name}")
        try:
            if routine == "gluon-bwd":
                cfg = dataclasses.replace(fa3_gluon_bwd.variant_base(base, d, causal, fields), **fields)
            else:
                cfg = dataclasses.replace(base, **fields)
        except TypeError as e:  # a field the config does not have
            row["error"] = f"TypeError: {e}"
            continue
        row["config"] = dataclasses.asdict(cfg)
        if routine == "gluon-fp8":
            outs = [torch.empty_like(qv)]

            def call(cfg=cfg, outs=outs):
                fa3_fwd.fa3_forward_fp8(q8v, k8v, v8v, (qs, ks, vs), softmax_scale=scale, causal=causal, out=outs[0],
                                        gluon_config=cfg)
        elif routine == "gluon-fwd":
            outs = [torch.empty_like(qv)]

            def call(cfg=cfg, outs=outs):
                fa3_gluon.fa3_gluon_forward(qv, kv, vv, softmax_scale=scale, causal=causal, out=outs[0], config=cfg)
        else:
            outs = [torch.empty_like(x) for x in (qv, kv, vv)]

            def call(cfg=cfg, outs=outs):
                fa3_gluon_bwd.fa3_gluon_backward(dov, qv, kv, vv, out_ref, lse, softmax_scale=scale, causal=causal,
                                                 dq=outs[0], dk=outs[1], dv=outs[2], config=cfg)

        check_row(row, call, lambda outs=outs: outs, ref, timed, tol=tol)
    if fa3 is not None and routine in ("gluon-fwd", "gluon-fp8"):
        row = dict(head_dim=d, seqlen=n, batch=b, heads=h, causal=causal, variant="fa3", fields={})
        rows.append(row)
        got = []

        if routine == "gluon-fp8":
            def peer():
                got[:] = [fa3.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs)]
        else:
            def peer():
                got[:] = [fa3.flash_attn_func(q, k, v, causal=causal)]

        def peer_out():
            out = got[0][0] if isinstance(got[0], tuple) else got[0]
            return [out.transpose(1, 2)]

        check_row(row, peer, peer_out, ref, timed, tol=tol)
    time_rounds(timed, rounds, flops, peak=peak, timer=median_ms)
    return rows


def run_configs(routine: str, grid, variants: dict[str, dict[str, Any]], rounds: int = 3, progress=None,
                peers: bool = True, gqa: int = 1) -> dict:
    """The payload ``{env, routine, variants, rows}`` over ``grid`` ((d, N, causal) triples); needs an sm_90 GPU.
    ``gqa``: query heads per kv head (K and V get H / gqa heads; the backward's group loop times only so).
    ``peers``: FA3's forward as a row of ``gluon-fwd`` / ``gluon-fp8`` points where ``fa3_fwd_interface`` imports
    (its FP8 forward transposes V in the kernel; the Gluon FP8 rows time V's operand copy too)."""
    if routine not in ROUTINES:
        raise ValueError(f"routine must be one of {', '.join(ROUTINES)}, got {routine!r}")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    if not isinstance(gqa, int) or isinstance(gqa, bool) or gqa < 1:
        raise ValueError(f"gqa must be an int >= 1, got {gqa!r}")
    for d, _, _ in grid:
        if max(1, 2048 // d) % gqa:
            raise ValueError(f"gqa = {gqa} must divide the {max(1, 2048 // d)} heads at d = {d} (H * d = 2048)")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise RuntimeError("`flashtile bench configs` needs an sm_90 (Hopper) GPU")
    fa3 = None
    if peers and routine in ("gluon-fwd", "gluon-fp8"):
        try:
            import fa3_fwd_interface as fa3
        except ImportError:
            fa3 = None
    rows = []
    for d, n, causal in grid:
        b, h = max(1, 16384 // n), max(1, 2048 // d)
        gen = torch.Generator(device="cuda").manual_seed(n + d + 7)
        q, k, v, dout = (torch.randn(b, n, h // gqa if i in (1, 2) else h, d, device="cuda", dtype=torch.bfloat16,
                                     generator=gen) for i in range(4))
        rows.extend(_rows(routine, d, n, b, h, causal, q, k, v, dout, variants, fa3, progress, rounds))
        torch.cuda.empty_cache()
    return {"env": environment(), "routine": routine, "variants": variants, "gqa": gqa,
            "flops_convention": "4*B*H*N^2*d forward, /2 causal" + (", x2.5 backward alone" if routine == "gluon-bwd"
                                                                     else ""),
            "rows": rows}
