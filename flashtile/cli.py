"""`flashtile` command line: `flashtile demo`, `flashtile bench [attention|decode|io|tune|dispatch|fp8-error|hopper-ablation|ring|train|sm90|configs|banded]`."""

from __future__ import annotations

import argparse
import os
import sys


def _use_interpreter_without_gpu() -> None:
    """Without a GPU the Triton kernels run through Triton's interpreter; the
    variable must be set before any kernel module is imported."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"


def _cmd_demo(args: argparse.Namespace) -> int:
    _use_interpreter_without_gpu()
    from flashtile.demo import run_demo

    return run_demo(seed=args.seed, kernels=not args.no_kernels)


def _cmd_bench_attention(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from flashtile.bench import attention as ab
    from flashtile.bench.common import write_json

    console = Console()
    if not torch.cuda.is_available():
        console.print("[red]`flashtile bench attention` needs a CUDA GPU[/red]")
        return 2
    if getattr(args, "varlen", False):
        if getattr(args, "heads", None) is not None or getattr(args, "gqa", 1) != 1:
            console.print("[red]--heads / --gqa are options of the grid, not of --varlen (2048 / d heads)[/red]")
            return 2
        return _bench_attention_varlen(args, console)
    gqa = getattr(args, "gqa", 1)
    grid = list(ab.default_grid(head_dims=args.head_dims, seqlens=args.seqlens, heads=getattr(args, "heads", None)))
    if args.causal != "both":
        grid = [g for g in grid if g[4] == (args.causal == "yes")]
    with Progress(console=console, transient=True) as prog:
        task = prog.add_task("bench", total=len(grid))

        def progress(i, n, what):
            prog.update(task, completed=i, description=what)

        try:
            payload = ab.run(providers=args.providers, grid=grid, modes=args.modes, progress=progress, gqa=gqa)
        except ValueError as e:  # checked before any point is timed (--gqa against the heads: --heads sets them)
            console.print(f"[red]{e}[/red]")
            return 2
    rows = ab.ratios(payload)
    peers = [p for p in args.providers if p != "flashtile"]
    table = Table(title=f"attention TFLOP/s (bf16 inputs; -fp8: quantised to e4m3) on {payload['env']['device']} (ratio = flashtile / peer)")
    for col in ("d", "N", "B×H", "causal", "mode", "flashtile", *peers):
        table.add_column(col, justify="right")
    for r in rows:
        t = r["tflops"]
        hk = "" if r["kv_heads"] == r["heads"] else f"/{r['kv_heads']}"
        cells = [str(r["head_dim"]), str(r["seqlen"]), f"{r['batch']}×{r['heads']}{hk}", "y" if r["causal"] else "n",
                 r["mode"]]
        cells.append(f"{t['flashtile']:.0f}" if t.get("flashtile") else "—")
        for p in peers:
            ratio = r["ratio"].get(p)
            cells.append(f"{t[p]:.0f} ({ratio:.2f}×)" if t.get(p) and ratio else "—")
        table.add_row(*cells)
    console.print(table)
    mem = payload["peak_extra_memory_mib"]
    console.print("peak extra forward memory (MiB, d=128 N=4k B=4 H=16): " + ", ".join(
        f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in mem.items()))
    path = write_json(payload, args.out, args.name)
    console.print(f"wrote {path}")
    if not args.no_plot:
        try:
            png = path.with_suffix(".png")
            ab.plot(payload, png)
            console.print(f"wrote {png}")
        except ImportError:
            console.print("matplotlib not installed: no plot (pip install 'flashtile[bench]')")
    return 0


def _bench_attention_varlen(args: argparse.Namespace, console) -> int:
    """`flashtile bench attention --varlen`: a packed 64k-token batch (lengths 128..8k)."""
    from rich.table import Table

    from flashtile.bench import attention as ab
    from flashtile.bench.common import write_json

    head_dims = args.head_dims if args.head_dims != [64, 128] else [128]
    causal_modes = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    payloads = [ab.run_varlen(head_dim=d, heads=2048 // d, modes=args.modes, causal_modes=causal_modes)
                for d in head_dims]
    for payload in payloads:
        fixed = payload["fixed_batch"]
        table = Table(title=f"packed batch: {len(payload['lengths'])} sequences, {sum(payload['lengths'])} tokens, "
                            f"d={payload['head_dim']}, H={payload['heads']} (fixed: {fixed['batch']}x{fixed['seqlen']}, "
                            f"{fixed['flops_ratio']:.2f}x the FLOPs); TFLOP/s on {payload['env']['device']}")
        for col in ("causal", "mode", *ab.VARLEN_PROVIDERS):
            table.add_column(col, justify="right")
        for p in payload["points"]:
            t = p["tflops"]
            table.add_row("y" if p["causal"] else "n", p["mode"],
                          *[f"{t[n]:.0f}" if t.get(n) else "—" for n in ab.VARLEN_PROVIDERS])
        console.print(table)
    name = "attention-varlen" if args.name == "attention" else args.name
    path = write_json({"env": payloads[0]["env"], "runs": payloads}, args.out, name)
    console.print(f"wrote {path}")
    return 0


def _cmd_bench_decode(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from flashtile.bench.decode import run_decode_bench, run_tile_sweep

    console = Console()
    if not torch.cuda.is_available():
        console.print("[red]`flashtile bench decode` needs a CUDA GPU[/red]")
        return 2
    if args.fp8_cascade:
        from flashtile.bench.decode import run_fp8_cascade_bench

        with console.status("FP8 cache and cascade decoding") as status:
            payload = run_fp8_cascade_bench(args.out, progress=lambda what: status.update(str(what)))
        table = Table(title=f"FP8 KV cache on {payload['env']['device']} (clean-L2 µs; × = peer time / FP8 time)")
        for c in ("batch", "cache", "fp8 µs", "× bf16 cache", "× fp8 paged", "× sdpa-flash", "× FA3 bf16", "× FA3 fp8",
                  "fp8 err vs bf16"):
            table.add_column(c, justify="right")
        for p in payload["fp8_points"]:
            sp, ms = p["speedup"], p["ms"]
            f = lambda x: f"{x:.2f}" if isinstance(x, float) else "—"  # noqa: E731
            table.add_row(str(p["batch"]), str(p["cache"]), f"{(ms.get('flashtile-fp8') or float('nan')) * 1e3:.0f}",
                          f(sp.get("flashtile-bf16")), f(sp.get("flashtile-fp8-paged")), f(sp.get("sdpa-flash")),
                          f(sp.get("fa3-bf16")), f(sp.get("fa3-fp8")), f(p["err"].get("flashtile-fp8")))
        console.print(table)
        c = payload["cascade"]
        console.print(f"cascade {c['batch']} x ({c['prefix']} shared + {c['own']} own): "
                      + ", ".join(f"{k} {v * 1e3:.0f} µs" for k, v in c["ms"].items() if v)
                      + "; speedups " + ", ".join(f"{k} {v:.2f}x" for k, v in c["speedup"].items()))
        console.print(f"wrote {payload['path']}")
        return 0
    if args.sweep_tiles:
        with console.status("decode tile sweep") as status:
            payload = run_tile_sweep(args.out, progress=lambda what: status.update(str(what)))
        table = Table(title=f"decode tile sweep on {payload['env']['device']} (clean-L2 µs)")
        for c in ("batch", "cache", "heuristic (BLOCK_N/warps/stages/splits)", "µs", "best", "µs", "sdpa-flash µs"):
            table.add_column(c, justify="right")
        for p in payload["points"]:
            h, best = p["heuristic"], (p["best"] or [{}])[0]
            cfg = lambda c: "/".join(str(c.get(k, "—")) for k in ("block_n", "num_warps", "num_stages", "splits"))  # noqa: E731
            table.add_row(str(p["batch"]), str(p["cache"]), cfg(h), f"{p['heuristic_us'] or float('nan'):.1f}",
                          cfg(best), f"{best.get('us', float('nan')):.1f}", f"{p['sdpa_flash_us']:.1f}")
        console.print(table)
        console.print(f"wrote {payload['path']}")
        return 0
    with console.status("decoding benchmark") as status:
        payload = run_decode_bench(
            args.out, progress=lambda what: status.update(str(what)), features_only=args.features
        )
    table = Table(title=f"decode bf16 on {payload['env']['device']}: GB/s of K+V read; × = peer time / our time")
    cols = ("batch", "cache", "ours GB/s", "paged GB/s", "× sdpa-flash: do_bench / clean L2", "× sdpa-cudnn",
            "× gather+sdpa (paged)",
            "graphs: × sdpa-flash / paged÷contig speed", "host µs ours / sdpa", "of copy bw: 2 GB / same bytes / clean L2")
    for c in cols:
        table.add_column(c, justify="right")

    def fmt(x, spec):
        return format(x, spec) if x else "—"

    for p in payload.get("points", []):
        g, sp, h = p.get("gbps", {}), p.get("speedup", {}), p.get("host_us", {})
        cb, cs, cc = p.get("of_copy_bw", {}), p.get("of_copy_bw_same_bytes", {}), p.get("of_copy_bw_clean_l2", {})
        table.add_row(
            str(p["batch"]), str(p["cache"]), fmt(g.get("flashtile"), ".0f"), fmt(g.get("flashtile-paged"), ".0f"),
            f"{fmt(sp.get('sdpa-flash'), '.2f')} / {fmt(sp.get('clean L2: sdpa-flash'), '.2f')}",
            fmt(sp.get("sdpa-cudnn"), ".2f"), fmt(sp.get("paged_vs_gather+sdpa"), ".2f"),
            f"{fmt(sp.get('graph: sdpa-flash'), '.2f')} / {fmt(sp.get('graph: paged/contiguous'), '.2f')}", f"{fmt(h.get('flashtile'), '.0f')} / {fmt(h.get('sdpa-flash'), '.0f')}",
            f"{fmt(cb.get('flashtile'), '.2f')} / {fmt(cs.get('flashtile'), '.2f')} / {fmt(cc.get('flashtile'), '.2f')}",
        )
    console.print(table)
    console.print(f"device copy bandwidth: {payload.get('copy_gbps', float('nan')):.0f} GB/s (read + write)")
    feat = Table(title="decode features (clean-L2 µs; ratios: ours with/without, or t_fa3 / t_ours)")
    for c in ("point", "batch", "cache", "tokens", "µs by provider", "ratios", "unavailable"):
        feat.add_column(c, justify="right")
    for p in payload.get("features", []):
        us = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in p["ms_clean_l2"].items())
        ratios = ", ".join(f"{k} {v:.3f}" for k, v in p["speedup"].items() if not k.startswith("do_bench"))
        feat.add_row(p["name"], str(p["batch"]), str(p["cache"]), str(p["tokens"]), us, ratios,
                     "; ".join(f"{k}: {v[:60]}" for k, v in p["unavailable"].items()))
    console.print(feat)
    console.print(f"wrote {payload['path']}")
    return 0


def _cmd_bench_io(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from flashtile.bench.io_lab import run_io_lab

    console = Console()
    if not torch.cuda.is_available():
        console.print("[red]`flashtile bench io` needs a CUDA GPU[/red]")
        return 2
    with console.status("IO lab: FA1 vs FA2, softmax bandwidth, ncu DRAM bytes, roofline"):
        payload = run_io_lab(args.out)
    console.print_json(data={k: v for k, v in payload.items() if k in ("fa1_vs_fa2", "softmax_bandwidth")}, default=str)
    console.print(f"results written under {args.out}")
    return 0


def _cmd_bench_tune(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from flashtile.bench.tune import run_tune

    console = Console()
    try:
        points = tune_points(args)
    except ValueError as e:
        console.print(f"[red]{e}[/red]")
        return 2
    if not torch.cuda.is_available():
        console.print("[red]`flashtile bench tune` needs a CUDA GPU[/red]")
        return 2
    with console.status("FA2 tile sweep") as status:
        payload = run_tune(points, args.out, progress=lambda what: status.update(str(what)))
    table = Table(title=f"FA2 tile sweep, bf16 TFLOP/s on {payload['env']['device']} (bwd = forward + backward)")
    for c in ("mode", "d", "N", "causal", "heuristic", "best config", "best", "best / heuristic", "sdpa-flash",
              "sdpa-cudnn", "wrong or failed"):
        table.add_column(c, justify="right")

    def fmt(x):
        return f"{x:.0f}" if x else "—"

    for r in payload["points"]:
        by_name = {c["config"]: c for c in r["configs"]}
        heur = by_name["heuristic"]["tflops"]
        best = by_name[r["best"]]["tflops"] if r["best"] else None
        bad = sum(1 for c in r["configs"] if not c["tflops"])
        table.add_row(r["mode"], str(r["head_dim"]), str(r["seqlen"]), "y" if r["causal"] else "n", fmt(heur),
                      r["best"] or "—", fmt(best), f"{best / heur:.3f}" if best and heur else "—",
                      fmt(r["peers"].get("sdpa-flash")), fmt(r["peers"].get("sdpa-cudnn")), str(bad))
    console.print(table)
    console.print(f"wrote {payload['path']}")
    return 0


def dispatch_points(args: argparse.Namespace) -> list:
    """The grid `flashtile bench dispatch` runs for parsed ``args``."""
    from flashtile.bench.dispatch import dispatch_sweep

    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    return dispatch_sweep(args.modes, args.head_dims, args.seqlens, causal, args.dtype, args.total_tokens, args.hidden)


def _cmd_bench_dispatch(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console()
    try:
        points = dispatch_points(args)
        if args.budget_s is not None and not args.budget_s > 0:
            raise ValueError(f"--budget-s must be positive, got {args.budget_s}")
    except ValueError as e:
        console.print(f"[red]{e}[/red]")
        return 2
    _use_interpreter_without_gpu()
    from flashtile.bench import dispatch as db

    with Progress(console=console, transient=True) as prog:
        task = prog.add_task("dispatch", total=len(points))

        def progress(i, n, what):
            prog.update(task, completed=i, description=what)

        payload = db.run_dispatch(points, args.out, budget_s=args.budget_s, resume=args.resume, progress=progress)
    table = Table(title=f"kernel paths per head dim, {args.dtype} TFLOP/s on {payload['env']['device']} "
                        f"(bwd = forward + backward; triton = hopper-triton; regret = t(chosen) / t(best))")
    short = {"hopper-triton": "triton"}  # column width: the table fits 80 columns
    for col in ("d", "N", "causal", "mode", *(short.get(p, p) for p in db.PATHS), "chosen", "best", "regret"):
        table.add_column(col, justify="right")

    def cell(e):
        if e["status"] == "ok":
            return f"{e['tflops']:.0f}" if e["tflops"] >= 1 else f"{e['tflops']:.2g}"
        return {"wrong": "wrong", "failed": "failed", "skipped": "skipped"}.get(e["status"], "n/a")

    for r in payload["points"]:
        table.add_row(str(r["head_dim"]), str(r["seqlen"]), "y" if r["causal"] else "n", r["mode"],
                      *[cell(r["paths"][p]) for p in db.PATHS], short.get(r["chosen"], r["chosen"] or "—"),
                      short.get(r["best"], r["best"] or "—"),
                      f"{r['regret']:.3f}" if r["regret"] else "—")
    console.print(table)
    if payload["resumed"]:
        console.print(f"{payload['resumed']} points kept from the previous run (--resume)")
    if payload["skipped"]:
        console.print(f"budget of {args.budget_s} s spent: {len(payload['skipped'])} points skipped (in the JSON; "
                      f"--resume runs them)")
    console.print(f"wrote {payload['path']}")
    if not args.no_plot and payload["points"]:
        try:
            from pathlib import Path

            png = Path(payload["path"]).with_suffix(".png")
            db.plot(payload, png)
            console.print(f"wrote {png}")
        except ImportError:
            console.print("matplotlib not installed: no plot (pip install 'flashtile[bench]')")
    return 0


def _cmd_bench_fp8_error(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from flashtile.bench.fp8_error import run_fp8_error

    console = Console()
    try:
        with console.status("FP8 error experiment (float64 twin on the CPU)") as status:
            payload = run_fp8_error(
                args.out, batch=args.batch, heads=args.heads, seqlen=args.seqlen, head_dim=args.head_dim,
                causal=args.causal, seed=args.seed, progress=lambda what: status.update(str(what)),
                kernels=args.kernels,
            )
    except (ValueError, RuntimeError) as e:
        console.print(f"[red]{e}[/red]")
        return 2
    c = payload["config"]
    table = Table(title=f"attention RMSE vs float64, q/k/v ~ N(0,1) + 0.1% N(0,10²) outliers "
                        f"(B={c['batch']} H={c['heads']} N={c['seqlen']} d={c['head_dim']})")
    for col in ("method", "RMSE", "per-tensor FP8 RMSE / RMSE"):
        table.add_column(col, justify="right")
    for r in payload["rows"]:
        table.add_row(r["method"], f"{r['rmse']:.2e}" if r["rmse"] is not None else r.get("note", "—"),
                      f"{r['ratio']:.2f}×" if r["ratio"] else "—")
    console.print(f"wrote {payload['path']}")
    console.print(table)
    return 0


def _cmd_bench_hopper_ablation(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from flashtile.bench import hopper_ablation as ha
    from flashtile.bench.common import write_json

    console = Console()
    grid = [g for g in ha.default_grid(head_dims=args.head_dims, seqlens=args.seqlens)]
    try:
        with console.status("Hopper ablation") as status:
            payload = ha.run_ablation(grid, variants=() if args.gluon_only else tuple(ha.VARIANTS),
                                      progress=lambda what: status.update(what), rounds=args.rounds,
                                      backward=args.backward)
    except (RuntimeError, ValueError) as e:
        console.print(f"[red]{e}[/red]")
        return 2
    table = Table(title=f"Hopper {payload['direction']} ablation on {payload['env']['device']}: TFLOP/s "
                        f"(% of dense peak)")
    variants = list(dict.fromkeys(r["variant"] for r in payload["rows"]))
    for col in ("d", "N", "causal", *variants):
        table.add_column(col, justify="right")
    for d, n, causal in dict.fromkeys((r["head_dim"], r["seqlen"], r["causal"]) for r in payload["rows"]):
        cells = [str(d), str(n), "y" if causal else "n"]
        for name in variants:
            r = next(r for r in payload["rows"]
                     if (r["head_dim"], r["seqlen"], r["causal"], r["variant"]) == (d, n, causal, name))
            cells.append(f"{r['tflops']:.0f} ({r['pct_peak']:.0f}%)" if "tflops" in r else "—")
        table.add_row(*cells)
    console.print(table)
    for what, why in payload["not_expressible"].items():
        console.print(f"{what}: not measured ({why})")
    path = write_json(payload, args.out, "hopper-ablation-bwd" if args.backward else "hopper-ablation")
    console.print(f"wrote {path}")
    try:
        ha.plot(payload, path.with_suffix(".png"))
        console.print(f"wrote {path.with_suffix('.png')}")
    except ImportError:
        console.print("matplotlib not installed: no plot (pip install 'flashtile[bench]')")
    return 0


def _cmd_bench_sm90(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from flashtile.bench import sm90
    from flashtile.bench.common import environment, write_json

    console = Console()
    try:
        overrides = sm90.parse_overrides(args.set)
        rows = [sm90.compile_routine(args.routine, d, causal, args.seqlen, overrides, args.dump, args.sass)
                for d in args.head_dims for causal in ([False, True] if args.causal == "both" else
                                                       [args.causal == "yes"])]
    except (RuntimeError, ValueError, NotImplementedError) as e:
        console.print(f"[red]{e}[/red]")
        return 2
    table = Table(title=f"{args.routine} compiled for sm_90a (Triton {environment()['triton']}, offline)")
    cols = ["d", "causal", "kernel", "registers", "spills st / ld (B)", "bar.sync / bar.arrive", "shared (B)"]
    if args.sass and args.dump:
        cols.append("inner loops: instr (local ops)")
    for col in cols:
        table.add_column(col, justify="right")
    for row in rows:
        for k in row["kernels"]:
            if "error" in k:
                table.add_row(str(row["head_dim"]), "y" if row["causal"] else "n", k["kernel"],
                              f"[red]{k['error']}[/red]", *[""] * (len(cols) - 4))
            else:
                loops = [" ".join(f"{x['instructions']}" + (f" ({x['local']})" if x["local"] else "")
                                  for x in k["inner_loops"])] if "inner_loops" in k else []
                table.add_row(str(row["head_dim"]), "y" if row["causal"] else "n", k["kernel"], str(k["registers"]),
                              f"{k['spill_stores']} / {k['spill_loads']}", f"{k['bar_sync']} / {k['bar_arrive']}",
                              str(k["shared_bytes"]), *loops)
    console.print(table)
    if args.out:
        env = dict(environment(), device="offline-sm90a")
        path = write_json(dict(env=env, routine=args.routine, rows=rows), args.out, f"sm90-{args.routine}")
        console.print(f"wrote {path}")
    return 0


def _ratio_table(title: str, rows: list[dict], point_cols: tuple[str, ...], point, column: str, base: str):
    """A rich table with a line per point (``point(row)``: its cells) and a column per ``row[column]``: TFLOP/s and
    the ratio to the ``base`` column's, "failed" where the row recorded an error, "—" where there is no row."""
    from rich.table import Table

    table = Table(title=title)
    names = list(dict.fromkeys(r[column] for r in rows))
    for col in (*point_cols, *names):
        table.add_column(col, justify="right")
    for key in dict.fromkeys(point(r) for r in rows):
        at = {r[column]: r for r in rows if point(r) == key}
        ref = at.get(base, {}).get("tflops")
        cells = [str(x) for x in key]
        for name in names:
            r = at.get(name, {})
            if "tflops" not in r:
                cells.append("[red]failed[/red]" if "error" in r else "—")
            else:
                cells.append(f"{r['tflops']:.0f}" + (f" ({r['tflops'] / ref:.2f}x)" if ref else ""))
        table.add_row(*cells)
    return table


def _cmd_bench_configs(args: argparse.Namespace) -> int:
    from rich.console import Console

    from flashtile.bench import configs
    from flashtile.bench.common import write_json

    console = Console()
    try:
        variants = dict(configs.parse_variant(spec) for spec in args.variant or ())
        grid = [(d, n, c) for d in args.head_dims for n in args.seqlens
                for c in ([False, True] if args.causal == "both" else [args.causal == "yes"])]
        with console.status(f"configs {args.routine}") as status:
            payload = configs.run_configs(args.routine, grid, variants, rounds=args.rounds,
                                          progress=lambda what: status.update(what), gqa=args.gqa)
    except (RuntimeError, ValueError) as e:
        console.print(f"[red]{e}[/red]")
        return 2
    console.print(_ratio_table(f"{args.routine} on {payload['env']['device']}: TFLOP/s (x the dispatched config)",
                               payload["rows"], ("d", "N", "causal"),
                               lambda r: (r["head_dim"], r["seqlen"], "y" if r["causal"] else "n"), "variant",
                               "dispatch"))
    for r in payload["rows"]:
        if "error" in r:
            console.print(f"d={r['head_dim']} N={r['seqlen']} causal={r['causal']} {r['variant']}: {r['error']}")
    path = write_json(payload, args.out, f"configs-{args.routine}")
    console.print(f"wrote {path}")
    return 0


def _cmd_bench_banded(args: argparse.Namespace) -> int:
    from rich.console import Console

    from flashtile.bench import banded
    from flashtile.bench.common import write_json

    console = Console()
    grid = [(d, n, args.window[0], args.window[1], c) for d in args.head_dims for n in args.seqlens
            for c in args.softcap]
    try:
        with console.status("banded") as status:
            payload = banded.run_banded(grid, tuple(args.providers), rounds=args.rounds,
                                        progress=lambda what: status.update(what))
    except (RuntimeError, ValueError) as e:
        console.print(f"[red]{e}[/red]")
        return 2
    title = f"windows / softcap on {payload['env']['device']}: TFLOP/s (x flashtile as dispatched)"
    console.print(_ratio_table(title, payload["rows"], ("d", "N", "window", "softcap"),
                               lambda r: (r["head_dim"], r["seqlen"], tuple(r["window"]), r["softcap"]), "provider",
                               "flashtile"))
    for r in payload["rows"]:
        if "error" in r:
            console.print(f"d={r['head_dim']} N={r['seqlen']} {r['provider']}: {r['error']}")
    path = write_json(payload, args.out, "banded")
    console.print(f"wrote {path}")
    return 0


def ring_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command `flashtile bench ring` runs: one process per GPU, the options passed through."""
    from flashtile.bench.ring import to_argv

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
            "-m", "flashtile.bench.ring", *to_argv(args)]


def _cmd_bench_ring(args: argparse.Namespace) -> int:
    import subprocess

    import torch

    if torch.cuda.device_count() < 2 and args.nproc > 1:
        print(f"`flashtile bench ring` needs {args.nproc} CUDA GPUs, found {torch.cuda.device_count()}")
        return 2
    return subprocess.call(ring_command(args))


def _cmd_bench_train(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not torch.cuda.is_available() and not args.quick:
        console.print("[red]`flashtile bench train` needs a CUDA GPU (or --quick: the tiny CPU smoke run)[/red]")
        return 2
    _use_interpreter_without_gpu()
    from pathlib import Path

    from flashtile.bench.train import plot, run_train_bench

    shape = {k: v for k, v in (("batch", args.batch), ("seqlen", args.seqlen)) if v is not None}
    try:
        with console.status("training / inference benchmark") as status:
            payload = run_train_bench(args.out, size=args.size, quick=args.quick,
                                      providers=args.providers, progress=lambda what: status.update(str(what)),
                                      **shape)
    except ValueError as e:
        console.print(f"[red]{e}[/red]")
        return 2
    sh = payload["shape"]
    table = Table(title=f"{payload['size']} model ({payload['params'] / 1e9:.2f}B params, {payload['dtype']}) "
                        f"on {payload['env']['device']}: training step")
    for c in ("layout", "provider", "ms", "k tokens/s", "peak GiB", "loss", "error"):
        table.add_column(c, justify="right")

    def fmt(x, spec):
        return format(x, spec) if isinstance(x, (int, float)) else "—"

    for r in payload["train_packed"]:
        table.add_row(f"packed {sh['batch']}x{sh['seqlen']}", r["provider"], fmt(r.get("ms"), ".1f"),
                      fmt((r.get("tokens_per_s") or 0) / 1e3 or None, ".1f"), fmt(r.get("peak_gib"), ".1f"),
                      fmt(r.get("loss"), ".5f"), r.get("error") or "")
    for r in payload["train_unpadded"]:
        table.add_row(f"unpadded {r['batch']}x{r['seqlen']}", r["provider"], fmt(r.get("ms"), ".1f"),
                      fmt((r.get("tokens_per_s") or 0) / 1e3 or None, ".1f"), fmt(r.get("peak_gib"), ".1f"),
                      fmt(r.get("loss"), ".5f"), r.get("error") or "")
    console.print(table)
    rounds = max((r.get("rounds", 1) for r in payload["inference"]), default=1)
    inf = Table(title=f"inference: prefill {sh['batch']}x{sh['prompt']}, greedy decoding of {sh['new_tokens']} tokens "
                      f"(medians of {rounds} interleaved rounds)")
    for c in ("provider", "prefill ms", "prefill k tokens/s", "decode ms/token", "peak GiB", "error"):
        inf.add_column(c, justify="right")
    for r in payload["inference"]:
        inf.add_row(r["provider"], fmt(r.get("prefill_ms"), ".1f"), fmt((r.get("prefill_tokens_per_s") or 0) / 1e3 or None, ".1f"),
                    fmt(r.get("decode_ms_per_token"), ".2f"), fmt(r.get("peak_gib"), ".1f"), r.get("error") or "")
    console.print(inf)
    console.print("flashtile speed / peer speed: " + str({k: {p: round(x, 3) for p, x in v.items()}
                                                         for k, v in payload["ratios"].items()}))
    console.print(f"wrote {payload['path']}")
    if not args.no_plot:
        try:
            png = Path(payload["path"]).with_suffix(".png")
            plot(payload, png)
            console.print(f"wrote {png}")
        except ImportError:
            console.print("matplotlib not installed: no plot (pip install 'flashtile[bench]')")
    return 0


def tune_points(args: argparse.Namespace) -> list:
    """The sweep `flashtile bench tune` runs for parsed ``args`` (``--fwd`` / ``--bwd``; neither: both)."""
    from flashtile.bench.tune import MODES, tune_sweep

    modes = [m for m in MODES if getattr(args, m)] or list(MODES)
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    return tune_sweep(modes, args.head_dims, args.seqlens, causal)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _positive(text: str) -> int:
    """argparse type: an int >= 1 (sizes, rounds)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def _seed(text: str) -> int:
    """argparse type: a seed torch's manual_seed takes, seed + 1 included: [-2^63, 2^64 - 1)."""
    value = int(text)
    if not -2**63 <= value < 2**64 - 1:
        raise argparse.ArgumentTypeError(f"must be in [-2^63, 2^64 - 1), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashtile", description="The FlashAttention family in Python.")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run every algorithm on random inputs and print errors, IO and FLOP counts")
    demo.add_argument("--seed", type=_seed, default=0)
    demo.add_argument("--no-kernels", action="store_true", help="skip the Triton kernel section")
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser("bench", help="GPU benchmarks against PyTorch's attention backends")
    bsub = bench.add_subparsers(dest="what")
    att = bsub.add_parser("attention", help="FA2 forward and forward+backward vs SDPA backends and FlexAttention")
    from flashtile.bench.attention import DEFAULT_PROVIDERS, PROVIDERS

    att.add_argument("--providers", nargs="+", default=list(DEFAULT_PROVIDERS), choices=list(PROVIDERS),
                     help="flashtile-fp8 / fa3-fp8 (FP8 forwards) are not in the default set")
    att.add_argument("--head-dims", nargs="+", type=_positive, default=[64, 128])
    att.add_argument("--seqlens", nargs="+", type=_positive, default=[1024, 2048, 4096, 8192, 16384])
    att.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    att.add_argument("--modes", nargs="+", choices=["fwd", "fwd_bwd"], default=["fwd", "fwd_bwd"])
    att.add_argument("--out", default="bench/results")
    att.add_argument("--name", default="attention", help="result file stem (<name>_<device>.json)")
    att.add_argument("--no-plot", action="store_true")
    att.add_argument("--heads", type=_positive, default=None, help="q heads of every point (default 2048 / d)")
    att.add_argument("--gqa", type=_positive, default=1,
                     help="q heads per kv head (GQA; 1: multi-head); FLOPs count the q heads")
    att.add_argument("--varlen", action="store_true",
                     help="instead of the grid: a packed batch of 64k tokens (lengths 128..8k) through "
                          "flash_attn_varlen_func vs a fixed-length batch of equal FLOPs and FlexAttention "
                          "with a document mask (d from --head-dims, default 128)")
    att.set_defaults(func=_cmd_bench_attention)
    dec = bsub.add_parser("decode", help="split-KV decoding (contiguous and paged cache) vs SDPA flash/cuDNN")
    dec.add_argument("--out", default="bench/results")
    dec.add_argument("--sweep-tiles", action="store_true",
                     help="instead of the grid: time the split kernel's tile configs (BLOCK_N, warps, stages, splits)")
    dec.add_argument("--fp8-cascade", action="store_true",
                     help="instead of the grid: FP8 vs bf16 KV cache (B 1/8, 32k/128k; FA3 if importable) and "
                          "shared-prefix cascade (64 x (32k shared + 1k own)) vs unshared")
    dec.add_argument("--features", action="store_true",
                     help="only the feature points: fused rotary (B64, 4k) and 4-token steps (B32, 8k), with FA3 if importable")
    dec.set_defaults(func=_cmd_bench_decode)
    iol = bsub.add_parser("io", help="IO lab: FA1 vs FA2, online vs safe softmax, ncu DRAM bytes vs Theorem 2, roofline")
    iol.add_argument("--out", default="bench/results")
    iol.set_defaults(func=_cmd_bench_io)
    tune = bsub.add_parser("tune", help="FA2 forward / backward tile-config sweep, each config checked, then timed "
                                        "against SDPA flash and cuDNN")
    from flashtile.bench.tune import FWD_CANDIDATES

    tune.add_argument("--fwd", action="store_true", help="sweep the forward kernel's tiles")
    tune.add_argument("--bwd", action="store_true", help="sweep the backward kernels' tiles (timed as fwd+bwd)")
    tune.add_argument("--head-dims", nargs="+", type=_positive, default=[64, 128], choices=sorted(FWD_CANDIDATES))
    tune.add_argument("--seqlens", nargs="+", type=_positive, default=[1024, 4096, 16384])
    tune.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    tune.add_argument("--out", default="bench/results")
    tune.set_defaults(func=_cmd_bench_tune)
    dsp = bsub.add_parser("dispatch", help="per head dim, each kernel path (FA2, Triton Hopper, Gluon) forced, "
                                          "checked and timed, next to the path the dispatcher picks")
    from flashtile.bench.dispatch import DEFAULT_HEAD_DIMS, DTYPES

    dsp.add_argument("--head-dims", nargs="+", type=_positive, default=list(DEFAULT_HEAD_DIMS),
                     help="default: every multiple of 8 up to 256")
    dsp.add_argument("--seqlens", nargs="+", type=_positive, default=[1024, 4096])
    dsp.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    dsp.add_argument("--modes", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"],
                     help="bwd: forward + backward, the backward's path forced")
    dsp.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    dsp.add_argument("--total-tokens", type=_positive, default=16384, help="batch x seqlen (batch = max(1, this // N))")
    dsp.add_argument("--hidden", type=_positive, default=2048, help="heads x head dim (heads = max(1, this // d))")
    dsp.add_argument("--budget-s", type=float, default=540.0,
                     help="wall-clock seconds after which the remaining points are skipped (the JSON is still written)")
    dsp.add_argument("--out", default="bench/results")
    dsp.add_argument("--resume", action="store_true",
                     help="keep the points already in --out's dispatch_<device>.json and run the rest (a sweep longer "
                          "than one command: the same command again)")
    dsp.add_argument("--no-plot", action="store_true")
    dsp.set_defaults(func=_cmd_bench_dispatch)
    abl = bsub.add_parser("hopper-ablation", help="the Hopper forward with warp specialisation, pipelining stages, "
                                                  "the TMA epilogue and FP8 switched one at a time (FA3's ablation)")
    abl.add_argument("--head-dims", nargs="+", type=_positive, default=[64, 128, 256])
    abl.add_argument("--seqlens", nargs="+", type=_positive, default=[4096, 16384])
    abl.add_argument("--rounds", type=_positive, default=1, help="interleaved timing rounds of the Gluon rows (median)")
    abl.add_argument("--gluon-only", action="store_true", help="the Gluon kernel's schedule rows only")
    abl.add_argument("--backward", action="store_true",
                     help="the Gluon backward's switches instead (JSON hopper-ablation-bwd_<device>.json)")
    abl.add_argument("--out", default="bench/results")
    abl.set_defaults(func=_cmd_bench_hopper_ablation)
    s90 = bsub.add_parser("sm90", help="compile a kernel family for sm_90a without a GPU (Triton's compiler, ptxas): "
                                       "registers, spills, barriers per config; --dump writes the PTX / SASS")
    s90.add_argument("routine", choices=["fa2-fwd", "fa2-bwd", "hopper-fwd", "gluon-fwd", "gluon-fp8", "gluon-bwd"])
    s90.add_argument("--head-dims", nargs="+", type=_positive, default=[64, 128])
    s90.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    s90.add_argument("--seqlen", type=_positive, default=4096, help="tokens per sequence (B * N = 16k, H * d = 2048)")
    s90.add_argument("--set", nargs="+", metavar="NAME=VALUE", help="config fields of the Hopper routines, e.g. "
                                                                   "named_bars=True num_stages=3")
    s90.add_argument("--dump", default=None, help="folder for each kernel's PTX (debug lines left out)")
    s90.add_argument("--sass", action="store_true", help="with --dump: the SASS too (cuobjdump)")
    s90.add_argument("--out", default=None, help="folder for the JSON (sm90-<routine>_offline-sm90a.json)")
    s90.set_defaults(func=_cmd_bench_sm90)
    cfs = bsub.add_parser("configs", help="the dispatched Hopper config against named variants of it (checked "
                                          "against FA2, timed in interleaved rounds, FA3 beside the forward)")
    cfs.add_argument("routine", choices=["gluon-fwd", "gluon-bwd", "gluon-fp8"])
    cfs.add_argument("--variant", action="append", metavar="'NAME: FIELD=VALUE ...'",
                     help="a config variant (repeatable), e.g. '3wg dynamic: num_wg=3 persistent=True dynamic=True'")
    cfs.add_argument("--head-dims", nargs="+", type=_positive, default=[64, 128])
    cfs.add_argument("--seqlens", nargs="+", type=_positive, default=[4096, 16384])
    cfs.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    cfs.add_argument("--rounds", type=_positive, default=3, help="interleaved timing rounds (median)")
    cfs.add_argument("--gqa", type=_positive, default=1, help="query heads per kv head (e.g. 4: GQA 16 / 4 at d = 128)")
    cfs.add_argument("--out", default="bench/results")
    cfs.set_defaults(func=_cmd_bench_configs)
    bnd = bsub.add_parser("banded", help="sliding windows and softcap, forward: the dispatch, the Triton Hopper "
                                         "kernel's banded forward, FlexAttention, FA3 (softcap)")
    bnd.add_argument("--head-dims", nargs="+", type=_positive, default=[128])
    bnd.add_argument("--seqlens", nargs="+", type=_positive, default=[16384])
    bnd.add_argument("--window", nargs=2, type=int, default=[4096, 0], metavar=("LEFT", "RIGHT"),
                     help="flash-attn's window_size (-1 unbounded; (L, 0) is causal with a window)")
    bnd.add_argument("--softcap", nargs="+", type=float, default=[0.0])
    bnd.add_argument("--providers", nargs="+", default=["flashtile", "hopper-banded", "flex", "fa3"],
                     choices=["flashtile", "hopper-banded", "flex", "fa3"])
    bnd.add_argument("--rounds", type=_positive, default=3)
    bnd.add_argument("--out", default="bench/results")
    bnd.set_defaults(func=_cmd_bench_banded)
    fp8 = bsub.add_parser("fp8-error", help="FA3's FP8 error experiment on the CPU: RMSE of fp16/bf16 and per-tensor, "
                                             "block and Hadamard-rotated FP8 attention on outlier inputs")
    fp8.add_argument("--batch", type=_positive, default=1)
    fp8.add_argument("--heads", type=_positive, default=4)
    fp8.add_argument("--seqlen", type=_positive, default=1024)
    fp8.add_argument("--head-dim", type=_positive, default=128, help="a power of two (Hadamard rotation)")
    fp8.add_argument("--causal", action="store_true")
    fp8.add_argument("--seed", type=_seed, default=0)
    fp8.add_argument("--kernels", action="store_true", help="also run our bf16 / FP8 kernels and FA3's FP8 (GPU)")
    fp8.add_argument("--out", default="bench/results")
    fp8.set_defaults(func=_cmd_bench_fp8_error)
    ring = bsub.add_parser("ring", help="ring / Ulysses context parallelism on P GPUs (torchrun) vs one GPU and "
                                        "torch's context_parallel (launches torchrun)")
    from flashtile.bench.ring import add_arguments as ring_arguments

    ring.add_argument("--nproc", type=int, default=max(2, _gpu_count()), help="GPUs (processes) to run on")
    ring_arguments(ring)
    ring.set_defaults(func=_cmd_bench_ring)
    trn = bsub.add_parser("train", help="a ~1B Llama-style model through transformers: training step on packed documents "
                                        "(flashtile varlen vs SDPA padded vs FlexAttention document mask), unpadded "
                                        "steps, prefill and decoding")
    from flashtile.bench.train import PROVIDERS as TRAIN_PROVIDERS, SIZES

    trn.add_argument("--providers", nargs="+", default=list(TRAIN_PROVIDERS), choices=list(TRAIN_PROVIDERS))
    trn.add_argument("--size", choices=list(SIZES), default=None, help="model shape (default 1b; --quick: tiny)")
    trn.add_argument("--quick", action="store_true", help="tiny model and shapes: a CPU smoke run through the interpreter")
    trn.add_argument("--batch", type=_positive, default=None, help="rows of the packed step and of the inference batch")
    trn.add_argument("--seqlen", type=_positive, default=None, help="tokens per packed row (default 8192; --quick: 64)")
    trn.add_argument("--out", default="bench/results")
    trn.add_argument("--no-plot", action="store_true")
    trn.set_defaults(func=_cmd_bench_train)
    bench.set_defaults(func=_cmd_bench_attention, **{k: att.get_default(k) for k in
                       ("providers", "head_dims", "seqlens", "causal", "modes", "out", "name", "no_plot", "varlen",
                        "heads", "gqa")})
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except OSError as e:  # an --out folder that cannot be made or written
        print(f"flashtile: {e.strerror or e}: {e.filename or ''}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
