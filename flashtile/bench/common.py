"""Benchmark plumbing shared by every `flashtile bench` sub-command.

Timing follows the device method: ``triton.testing.do_bench`` medians (CUDA
events, warm-up excluded), fresh random inputs, every speed claim a ratio to a
peer measured in the same process.  Results are written as JSON with the
command line, device name, library versions and date, so a committed file says
how it was made.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch


def median_ms(fn: Callable[[], Any], *, warmup: int = 25, rep: int = 100, grad_to_none=None) -> float:
    """Median time of ``fn`` in milliseconds (do_bench: warm-up and repetitions in ms)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"))


def median_ms_clean_l2(fn: Callable[[], Any], *, reps: int = 100, warmup: int = 10, flush_bytes: int = 256 << 20) -> float:
    """Median time of ``fn`` in milliseconds with L2 emptied of dirty lines before each call.

    do_bench empties L2 by *writing* a 256 MB buffer, so the timed call starts with
    an L2 full of dirty lines (50 MB on an H100) whose write-back to HBM competes
    with the call's own reads: 50 MB more traffic for a call that reads 134 MB,
    none of it the call's.  Here the flush *reads* a buffer
    instead (a sum), which leaves L2 cold for the call's data and clean.  Each
    call is bracketed by CUDA events; warm-up calls are not timed."""
    flush = torch.ones(flush_bytes // 4, dtype=torch.float32, device="cuda")
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.sum()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    del flush
    return float(times[len(times) // 2])


def attention_flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool, with_bwd: bool = False) -> float:
    """Matmul FLOPs of attention over ``seqlen`` tokens (FlashAttention's convention): forward 4 B H N^2 d, halved
    causal; forward + backward 3.5x that (the backward's five matmuls against the forward's two)."""
    fwd = 4.0 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    return fwd * (3.5 if with_bwd else 1.0)


def environment() -> dict:
    """Device and software facts recorded next to every result."""
    import triton

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1))
    return env


def write_json(payload: dict, out_dir: str | os.PathLike, stem: str) -> Path:
    """Write ``payload`` to ``out_dir/stem_<device>.json`` and return the path.

    One current result per routine and device: a new run replaces the file (its history is in git)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = payload.get("env", {}).get("device", "cpu").replace(" ", "-")
    path = out / f"{stem}_{dev}.json"
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (0 when both are empty)."""
    x, ref = x.double(), ref.double()
    den = ref.norm()
    if den == 0:
        return float((x - ref).norm())
    return float((x - ref).norm() / den)


def check_row(row: dict, call, got, ref, timed: list, against: str = "fa2", tol: float = 2e-2) -> None:
    """Run ``call`` once; its outputs ``got()`` within ``tol`` of each of ``ref``'s max|x| put (row, call) in
    ``timed``, else the row records why not (the error, or a refusal: a config the kernel or the compiler
    rejects).  ``against`` names the reference in the row (``max_rel_err_vs_<against>``) and the message."""
    try:
        call()
        torch.cuda.synchronize()
        err = max(float((g.float() - r.float()).abs().max() / r.float().abs().max()) for g, r in zip(got(), ref))
        row[f"max_rel_err_vs_{against}"] = err
        if err > tol:
            row["error"] = f"output differs from the {against} reference by {err:.3g} of max|out|: not timed"
        else:
            timed.append((row, call))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def time_rounds(timed: list, rounds: int, flops: float, peak: float = 989.0, timer=None) -> None:
    """``rounds`` interleaved rounds (every row once per round, in the same order): a row's ms is the median over
    rounds (``ms_rounds`` each round's), so that the run-to-run drift of the machine hits every variant alike;
    TFLOP/s from ``flops`` and % of ``peak`` (TFLOP/s, dense bf16 H100 SXM by default).  ``timer``: ms of one call
    (:func:`median_ms` by default)."""
    timer = timer or median_ms
    for _ in range(rounds):
        for row, call in timed:
            row.setdefault("ms_rounds", []).append(timer(call))
    for row, _ in timed:
        ms = statistics.median(row["ms_rounds"])
        row.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
        row["pct_peak"] = 100 * row["tflops"] / peak
