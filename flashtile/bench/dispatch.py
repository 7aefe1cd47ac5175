"""`flashtile bench dispatch`: per head dim, every kernel path's time next to the path the dispatcher takes.

Each point (mode, head dim, seqlen, causal; batch·seqlen = 16k tokens, heads = max(1, 2048 // d), as
`flashtile bench attention`) runs through :func:`flashtile.flash_attn_func` with each path of :data:`PATHS`
forced by :func:`forced_path`:

* forward (``mode="fwd"``, under ``torch.no_grad``): ``fa2`` (the FA2 Triton kernel), ``hopper-triton`` (the
  Triton Hopper kernel), ``gluon`` (the Gluon Hopper kernel);
* backward (``mode="bwd"``, timed as forward + backward, the forward at the default dispatch): ``fa2``
  (FA2's kernels), ``hopper-triton`` (``runtime.fa3_bwd``), ``gluon`` (``runtime.fa3_gluon_bwd``).

A path is forced by the module switches (``fa3_fwd.ENABLED`` / ``GLUON``, ``fa3_bwd.ENABLED``,
``fa3_gluon_bwd.ENABLED``) and by replacing the measured rule it must pass (``hopper_wins``, ``use_gluon``,
``hopper_bwd_wins``, ``gluon_bwd_wins``) with the kernel's coverage for the duration of the block; the
coverage checks of the ``prefer_*`` predicates stay, so a path they refuse (Hopper off sm_90, the Gluon backward
above d = 128, ...) is reported ``"n/a"`` with the reason and not run.  Every path that runs is first checked
against fp32 math (the forward on sampled rows of two heads, the gradients on one head) and over
:data:`TOLERANCE` reported, not timed.  ``chosen`` is the path the default dispatch runs, observed by
recording which kernel entry point the call reaches (:func:`recorded_paths`), so it is the runtime's own
decision; ``best`` the fastest timed path; ``regret`` = t(chosen) / t(best).

``budget_s`` bounds the wall clock: past it the remaining paths and points are recorded as skipped, and the
JSON (written after every point) still holds everything measured; ``resume`` keeps the rows a previous run wrote
there and runs the rest.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from flashtile.bench.attention import reference_rows, sdpa_fn
from flashtile.bench.common import attention_flops, environment, median_ms, rel_err, write_json

__all__ = [
    "DEFAULT_HEAD_DIMS", "DTYPES", "MODES", "PATHS", "TOLERANCE", "DispatchPoint", "dispatch_sweep", "forced_path",
    "recorded_paths", "run_dispatch", "run_point", "plot",
]

MODES = ("fwd", "bwd")
PATHS = ("fa2", "hopper-triton", "gluon")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# every head dim the Hopper kernels cover (multiples of 8 up to 256)
DEFAULT_HEAD_DIMS = tuple(range(8, 257, 8))
# relative error vs fp32 math over which a path is wrong (bf16 inputs, fp32 accumulation; bench tune's bounds)
TOLERANCE = {"fwd": 2e-2, "bwd": 3e-2}

# the first function of each path that the dispatch calls (a module attribute read at call time), per mode
_ENTRIES = {
    "fwd": (("fa2", "flashtile.runtime.fa2_fwd", "fa2_forward"),
            ("hopper-triton", "flashtile.runtime.fa3_fwd", "launch"),
            ("gluon", "flashtile.runtime.fa3_gluon", "gluon_launch")),
    "bwd": (("fa2", "flashtile.runtime.fa2_bwd", "fa2_backward"),
            ("hopper-triton", "flashtile.runtime.fa3_bwd", "fa3_backward"),
            ("gluon", "flashtile.runtime.fa3_gluon_bwd", "backward_into")),
}


@dataclass(frozen=True)
class DispatchPoint:
    """One grid point: every path of :data:`PATHS` runs (or is reported n/a) there."""

    mode: str  # "fwd" or "bwd" (timed as forward + backward)
    head_dim: int
    seqlen: int
    batch: int
    heads: int
    causal: bool
    dtype: str = "bf16"

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.heads, self.seqlen, self.head_dim, self.causal, self.mode == "bwd")

    @property
    def key(self) -> tuple:
        return (self.mode, self.head_dim, self.seqlen, self.causal, self.dtype)


def dispatch_sweep(
    modes=MODES, head_dims=DEFAULT_HEAD_DIMS, seqlens=(1024, 4096), causal=(False, True), dtype: str = "bf16",
    total_tokens: int = 16384, hidden: int = 2048,
) -> list[DispatchPoint]:
    """The grid, head dim outermost (a run cut by its budget has whole head dims): batch = max(1, total_tokens
    // N), heads = max(1, hidden // d)."""
    modes, head_dims, seqlens, causal = tuple(modes), tuple(head_dims), tuple(seqlens), tuple(causal)
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {modes}")
    if not head_dims or any(not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= 256 for d in head_dims):
        raise ValueError(f"head_dims must be ints in [1, 256] (flash_attn_func's range), got {head_dims}")
    if not seqlens or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in seqlens):
        raise ValueError(f"seqlens must be positive ints, got {seqlens}")
    if not causal or any(not isinstance(c, bool) for c in causal):
        raise ValueError(f"causal must be a non-empty tuple of bools, got {causal}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    for name, x in (("total_tokens", total_tokens), ("hidden", hidden)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")
    return [DispatchPoint(m, d, n, max(1, total_tokens // n), max(1, hidden // d), c, dtype)
            for d in dict.fromkeys(head_dims) for n in dict.fromkeys(seqlens) for c in dict.fromkeys(causal)
            for m in dict.fromkeys(modes)]


def _covered(d: int, causal: bool, nk: int) -> bool:
    from flashtile.runtime.fa3_fwd import SUPPORTED_HEAD_DIMS

    return d in SUPPORTED_HEAD_DIMS


def _always(*args) -> bool:
    return True


@contextlib.contextmanager
def forced_path(mode: str, path: str) -> Iterator[None]:
    """Within the block, ``flash_attn_func``'s forward (``mode="fwd"``) or backward (``"bwd"``) takes ``path``
    wherever the kernel's coverage allows: the switches set, the measured rule (``*_wins``, ``use_gluon``)
    replaced by coverage.  The other direction keeps its default dispatch.  Restored on exit, also on an
    exception; not thread-safe (it swaps module attributes)."""
    from flashtile.runtime import fa3_bwd, fa3_fwd, fa3_gluon_bwd

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if mode == "fwd":
        sets = {(fa3_fwd, "ENABLED"): path != "fa2"}
        if path != "fa2":
            sets[(fa3_fwd, "GLUON")] = path == "gluon"
            sets[(fa3_fwd, "hopper_wins")] = _covered
        if path == "gluon":
            sets[(fa3_fwd, "use_gluon")] = _always
    else:
        sets = {(fa3_gluon_bwd, "ENABLED"): path == "gluon", (fa3_bwd, "ENABLED"): path == "hopper-triton"}
        if path == "gluon":
            sets[(fa3_gluon_bwd, "gluon_bwd_wins")] = _always  # prefer_gluon_bwd checks the head dims itself
        if path == "hopper-triton":
            sets[(fa3_bwd, "hopper_bwd_wins")] = _covered
    saved = {key: getattr(*key) for key in sets}
    try:
        for (module, name), value in sets.items():
            setattr(module, name, value)
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


@contextlib.contextmanager
def recorded_paths(mode: str) -> Iterator[list]:
    """Within the block, the list yielded collects the path (:data:`PATHS`) of every ``mode`` kernel entry the
    dispatch calls, in call order.  Restored on exit, also on an exception."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    seen: list[str] = []
    saved = []
    try:
        for path, module_name, attr in _ENTRIES[mode]:
            module = importlib.import_module(module_name)
            original = getattr(module, attr)
            saved.append((module, attr, original))

            def wrapper(*args, __path=path, __fn=original, **kwargs):
                seen.append(__path)
                return __fn(*args, **kwargs)

            setattr(module, attr, functools.wraps(original)(wrapper))
        yield seen
    finally:
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)


def _not_covered(pt: DispatchPoint, path: str, q: torch.Tensor) -> str | None:
    """Why ``path`` cannot run at ``pt`` on ``q``'s device (None: it can), asked of the runtime's own
    ``prefer_*`` predicates with :func:`forced_path` active, so only coverage decides."""
    if path == "fa2":
        return None
    from flashtile.runtime import fa3_bwd, fa3_fwd, fa3_gluon_bwd
    from flashtile.runtime.common import capability

    qb = q.transpose(1, 2)
    window = (-1, 0 if pt.causal else -1)
    with forced_path(pt.mode, path):
        if pt.mode == "fwd":
            ok = fa3_fwd.prefer_hopper(qb, qb, qb, causal=pt.causal, window=window, plain=True)
        elif path == "gluon":
            ok = fa3_gluon_bwd.prefer_gluon_bwd(qb, qb, qb, qb, causal=pt.causal, window=window, plain=True,
                                                deterministic=False)
        else:
            ok = fa3_bwd.prefer_hopper_bwd(qb, qb, qb, qb, causal=pt.causal, window=window, plain=True)
    if ok:
        return None
    if q.device.type != "cuda":
        return f"needs an sm_90 CUDA device (tensors on {q.device.type})"
    cap = capability(q.get_device())
    if cap != (9, 0):
        return f"needs sm_90 (device is sm_{cap[0]}{cap[1]})"
    if q.dtype not in fa3_fwd.HOPPER_DTYPES:
        return f"covers fp16 / bf16, not {pt.dtype}"
    if pt.head_dim not in fa3_fwd.SUPPORTED_HEAD_DIMS:
        return "covers head dims multiple of 8 up to 256"
    if pt.mode == "bwd" and path == "gluon" and pt.head_dim not in fa3_gluon_bwd.GLUON_BWD_HEAD_DIMS:
        return "the Gluon backward covers head dims multiple of 8 up to 128"
    return "refused by the dispatcher's coverage checks"


def _wall_ms(fn: Callable[[], object], reps: int = 3, grad_to_none=None) -> float:
    """Median wall time without a GPU (interpreter: a smoke test of the routine, not a measurement)."""
    fn()
    times = []
    for _ in range(reps):
        for x in grad_to_none or ():
            x.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def _time_ms(fn, device: str, grad_to_none=None) -> float:
    if device == "cuda":
        return median_ms(fn, grad_to_none=grad_to_none)
    return _wall_ms(fn, grad_to_none=grad_to_none)


def _inputs(pt: DispatchPoint, device: str):
    torch.manual_seed(pt.seqlen * 7 + pt.head_dim)
    shape = (pt.batch, pt.seqlen, pt.heads, pt.head_dim)
    return tuple(torch.randn(shape, device=device, dtype=DTYPES[pt.dtype]) for _ in range(4))


def _runner(pt: DispatchPoint, q, k, v, dout):
    """``(step, error)``: one timed call, and its relative error vs fp32 math (max over outputs)."""
    from flashtile import flash_attn_func

    if pt.mode == "fwd":
        ref, idx = reference_rows(q, k, v, pt.causal)

        def step():
            with torch.no_grad():
                return flash_attn_func(q, k, v, causal=pt.causal)

        def error() -> float:
            o = step()
            return rel_err(o[:1, idx, : ref.shape[1]].transpose(1, 2).float(), ref)

        return step, error, None
    # gradient reference: fp32 math attention on batch 0, head 0
    q1, k1, v1 = (x[:1, :, :1].float().requires_grad_() for x in (q, k, v))
    sdpa_fn("sdpa-math")(q1, k1, v1, pt.causal).backward(dout[:1, :, :1].float())
    refs = [x.grad for x in (q1, k1, v1)]
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def step():
        flash_attn_func(*leaves, causal=pt.causal).backward(dout)

    def error() -> float:
        for x in leaves:
            x.grad = None
        step()
        return max(rel_err(x.grad[:1, :, :1].float(), r) for x, r in zip(leaves, refs))

    return step, error, leaves


def _short(e: BaseException) -> str:
    text = str(e).splitlines()[0][:200] if str(e) else ""
    return f"{type(e).__name__}: {text}"


_clock = time.monotonic  # the budget's clock (tests replace it)


def _over(deadline: float | None) -> bool:
    return deadline is not None and _clock() >= deadline


def run_point(pt: DispatchPoint, device: str | None = None, deadline: float | None = None) -> dict:
    """Every path of ``pt``: coverage, then the error check, then the time; returns the JSON-able row.

    ``paths[name]``: ``status`` one of ``"ok"`` (``ms``, ``tflops``, ``err``), ``"n/a"`` (``reason``: the kernel does
    not cover the point), ``"wrong"`` (``err`` over :data:`TOLERANCE`), ``"failed"`` (``reason``: the exception),
    ``"skipped"`` (the budget ran out).  ``chosen``: the default dispatch's path (None if it could not run);
    ``best``: the fastest ``"ok"`` path; ``regret``: t(chosen) / t(best) (None unless both are timed)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    q, k, v, dout = _inputs(pt, device)
    row = {"mode": pt.mode, "head_dim": pt.head_dim, "seqlen": pt.seqlen, "batch": pt.batch, "heads": pt.heads,
           "causal": pt.causal, "dtype": pt.dtype, "flops": pt.flops, "paths": {}}
    step, error, leaves = _runner(pt, q, k, v, dout)
    try:
        with recorded_paths(pt.mode) as seen:
            step()
        row["chosen"] = seen[0] if seen else None
        if len(set(seen)) > 1:
            row["chosen_note"] = f"one call reached {seen}"
    except Exception as e:  # the default dispatch itself fails here: reported, the forced paths still run
        row["chosen"], row["chosen_error"] = None, _short(e)
    for path in PATHS:
        entry: dict = {"status": None, "ms": None, "tflops": None, "err": None}
        row["paths"][path] = entry
        if _over(deadline):
            entry.update(status="skipped", reason="budget")
            continue
        why = _not_covered(pt, path, q)
        if why is not None:
            entry.update(status="n/a", reason=why)
            continue
        try:
            with forced_path(pt.mode, path):
                with recorded_paths(pt.mode) as seen:  # not around the timed calls: no wrapper in their host time
                    entry["err"] = error()
                if not seen or seen[0] != path:
                    raise RuntimeError(f"the forced call ran {seen or 'no recorded kernel'}, not {path}")
                if not entry["err"] <= TOLERANCE[pt.mode]:  # NaN included
                    entry.update(status="wrong", reason=f"rel err {entry['err']:.3g} > {TOLERANCE[pt.mode]}: not timed")
                    continue
                ms = _time_ms(step, device, grad_to_none=leaves)
            entry.update(status="ok", ms=ms, tflops=pt.flops / (ms * 1e-3) / 1e12)
        except Exception as e:  # a path that does not compile or launch here
            entry.update(status="failed", reason=_short(e))
    timed = {p: e["ms"] for p, e in row["paths"].items() if e["status"] == "ok"}
    row["best"] = min(timed, key=timed.get) if timed else None
    chosen_ms = timed.get(row["chosen"])
    row["regret"] = chosen_ms / timed[row["best"]] if chosen_ms and row["best"] else None
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def _row_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in ("mode", "head_dim", "seqlen", "causal", "dtype", "batch", "heads"))


def _point_key(pt: DispatchPoint) -> tuple:
    return (pt.mode, pt.head_dim, pt.seqlen, pt.causal, pt.dtype, pt.batch, pt.heads)


def _finished_rows(out_dir, env: dict) -> list[dict]:
    """The rows of the ``dispatch_<device>.json`` that :func:`run_dispatch` writes under ``out_dir`` for ``env``'s
    device, less those with a path skipped by the budget ([] without a readable file)."""
    path = Path(out_dir) / f"dispatch_{env.get('device', 'cpu').replace(' ', '-')}.json"  # common.write_json's name
    try:
        rows = json.loads(path.read_text()).get("points", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [r for r in rows if isinstance(r, dict) and isinstance(r.get("paths"), dict)
            and all(isinstance(e, dict) and e.get("status") != "skipped" for e in r["paths"].values())]


def run_dispatch(
    points: list[DispatchPoint], out_dir, *, budget_s: float | None = 540.0, device: str | None = None,
    resume: bool = False, progress: Callable[[int, int, str], None] | None = None,
) -> dict:
    """Run ``points`` (from :func:`dispatch_sweep`) until ``budget_s`` seconds of wall clock have passed (None: no
    bound); writes ``dispatch_<device>.json`` under ``out_dir`` after every point (a run stopped early keeps what
    it measured) and once at the end, and returns the payload with its ``path``.  ``device``: ``"cuda"`` when
    available, else ``"cpu"`` (the interpreter: every Hopper path n/a, times are wall-clock smoke numbers).
    ``resume``: the rows already in that file (same device) are kept, not run again (``resumed`` counts those of
    this grid), so a sweep longer than one command's time limit is the same command repeated."""
    if budget_s is not None and not (isinstance(budget_s, (int, float)) and budget_s > 0 and math.isfinite(budget_s)):
        raise ValueError(f"budget_s must be a positive number of seconds or None, got {budget_s!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    start = _clock()
    deadline = None if budget_s is None else start + budget_s
    env = environment()
    done = {_row_key(r): r for r in _finished_rows(out_dir, env)} if resume else {}
    grid = {_point_key(pt) for pt in points}
    payload = {"env": env, "paths": list(PATHS), "tolerance": TOLERANCE, "budget_s": budget_s,
               "flops_convention": "4*B*H*N^2*d forward, /2 causal, x3.5 fwd+bwd",
               "timing": "do_bench median" if device == "cuda" else "wall-clock median (interpreter smoke run)",
               "points": [r for k, r in done.items() if k not in grid],  # earlier rows outside this grid, kept
               "skipped": [], "resumed": 0, "elapsed_s": 0.0}
    for i, pt in enumerate(points):
        what = f"{pt.mode} d={pt.head_dim} N={pt.seqlen} causal={pt.causal}"
        if _point_key(pt) in done:
            payload["points"].append(done[_point_key(pt)])
            payload["resumed"] += 1
            continue
        if _over(deadline):
            payload["skipped"].append({"mode": pt.mode, "head_dim": pt.head_dim, "seqlen": pt.seqlen,
                                       "causal": pt.causal, "dtype": pt.dtype})
            continue
        if progress:
            progress(i, len(points), what)
        payload["points"].append(run_point(pt, device, deadline))
        payload["elapsed_s"] = round(_clock() - start, 1)
        write_json(payload, out_dir, "dispatch")
    payload["elapsed_s"] = round(_clock() - start, 1)
    payload["path"] = str(write_json(payload, out_dir, "dispatch"))
    return payload


def plot(payload: dict, path) -> None:
    """TFLOP/s of each path against the head dim, one panel per (mode, seqlen, causal); a ring marks the path
    the dispatcher chose at each head dim."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = payload["points"]
    panels = sorted({(p["mode"], p["seqlen"], p["causal"]) for p in pts})
    if not panels:
        return
    cols = min(4, len(panels))
    rows_n = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), squeeze=False)
    for ax, (mode, n, causal) in zip(axes.flat, panels):
        sel = sorted((p for p in pts if (p["mode"], p["seqlen"], p["causal"]) == (mode, n, causal)),
                     key=lambda p: p["head_dim"])
        for name in payload["paths"]:
            xy = [(p["head_dim"], p["paths"][name]["tflops"]) for p in sel if p["paths"][name]["tflops"]]
            if xy:
                ax.plot(*zip(*xy), marker="o", markersize=3, label=name)
        chosen = [(p["head_dim"], p["paths"][p["chosen"]]["tflops"]) for p in sel
                  if p.get("chosen") and p["paths"][p["chosen"]]["tflops"]]
        if chosen:
            ax.scatter(*zip(*chosen), s=60, facecolors="none", edgecolors="k", label="chosen")
        ax.set_title(f"{mode} N={n} {'causal' if causal else 'full'}")
        ax.set_xlabel("head dim")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"dispatch sweep, {pts[0]['dtype']}, {payload['env'].get('device')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
