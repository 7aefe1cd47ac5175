"""`flashtile bench sm90`: the kernels compiled for sm_90a (Hopper) without running them, on any machine.

Triton's own compiler runs against a stand-in driver that reports an sm_90 target, on the launches the runtime's
wrappers make for CPU tensors of the requested shape (recorded at ``runtime.launch``, never run); ``ptxas -v``
from the installed Triton then reports each kernel's registers and spills, and the PTX its barrier instructions.
This answers, at no device time: does a config compile on this Triton, does it spill, did a change leave a
kernel's PTX as it was (``--dump``: the PTX, and the SASS with ``--sass``, per kernel, to compare two trees; with
``--sass`` each kernel's innermost loops, their instructions and spill traffic, :func:`sass_loops`).

Routines: ``fa2-fwd`` / ``fa2-bwd`` (the FA2 kernels' dispatched tiles), ``hopper-fwd`` (the Triton Hopper forward,
``fa3_fwd.fa3_config``), ``gluon-fwd`` (the Gluon forward, the dispatch's ``GluonConfig`` for the shape),
``gluon-fp8`` (its e4m3 form, ``gluon_fp8_config``) and ``gluon-bwd`` (the Gluon backward, ``gluon_bwd_config``); ``overrides`` (``--set name=value``) replace fields of
the Hopper routines' configs.  Needs ``TRITON_INTERPRET`` unset (interpreted kernels do not compile).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import torch

__all__ = ["ROUTINES", "offline_sm90", "parse_overrides", "compile_routine", "ptxas_report", "sass_loops"]

ROUTINES = ("fa2-fwd", "fa2-bwd", "hopper-fwd", "gluon-fwd", "gluon-fp8", "gluon-bwd")
SMS = 132  # an H100 SXM's multiprocessors: the persistent grids' size


class Launch(NamedTuple):
    kernel: Any
    grid: tuple
    dynamic: tuple
    static: tuple
    num_warps: int
    num_stages: int


class _Sm90Driver:
    """What ``JITFunction.run`` asks of the active driver before compiling (device, stream, target)."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def offline_sm90():
    """Within: Triton targets sm_90 whatever the machine, and every launch of the runtime's wrappers is recorded in
    the yielded list instead of run (with the device guard, descriptor allocator, SM count and the Gluon
    kernels' device checks stood in); on exit all of it is restored (and each compiled kernel's device cache by
    compile_routine)."""
    from triton.runtime import driver

    from flashtile.runtime import fa3_fwd, fa3_gluon, fa3_gluon_bwd, launch

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: the kernels are interpreted and do not compile; unset it")
    calls: list[Launch] = []

    def bound(kernel, grid, static, num_warps, num_stages, pdl, dtypes, device):
        return lambda *dynamic: calls.append(Launch(kernel, grid, dynamic, static, num_warps, num_stages))

    def unbound(kernel, grid, static, num_warps, num_stages, pdl, *dynamic):
        calls.append(Launch(kernel, grid, dynamic, static, num_warps, num_stages))

    def nothing(*args, **kwargs):
        return None

    stand_ins = ((launch, "_bound", bound), (launch, "_unbound", unbound),
                 (torch.cuda, "device", lambda index: contextlib.nullcontext()),
                 (fa3_fwd, "ensure_allocator", nothing), (fa3_gluon, "ensure_allocator", nothing),
                 (fa3_gluon, "sm_count", lambda index: SMS), (fa3_gluon, "_check", nothing),
                 (fa3_gluon_bwd, "_check", nothing))
    previous = driver._active
    with contextlib.ExitStack() as stack:
        for owner, name, value in stand_ins:
            stack.enter_context(mock.patch.object(owner, name, value))
        driver.set_active(_Sm90Driver())
        try:
            yield calls
        finally:
            driver._active = previous


@contextlib.contextmanager
def _own_device_cache(fn):
    """``fn``'s cache for the stand-in driver's device (0) set aside while it compiles for sm_90a and put back
    after: a real GPU's binaries are not reused for the stand-in target, nor sm_90a's launched on the GPU later."""
    while not hasattr(fn, "device_caches"):  # autotuner / heuristics wrappers hold the JITFunction as .fn
        fn = fn.fn
    caches = fn.device_caches
    had = 0 in caches
    saved = caches.pop(0, None)
    try:
        yield
    finally:
        caches.pop(0, None)
        if had:
            caches[0] = saved


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["named_bars=True", "num_stages=3"]`` -> ``{"named_bars": True, "num_stages": 3}`` (values as Python
    literals); a malformed item raises ``ValueError`` naming it."""
    out: dict[str, Any] = {}
    for item in items or ():
        name, sep, text = item.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"--set takes name=value, got {item!r}")
        try:
            out[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ValueError(f"--set {name}: {text!r} is not a Python literal") from None
    return out


def _replace(cfg, overrides: dict[str, Any], routine: str):
    names = {f.name for f in dataclasses.fields(cfg)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"--set: {routine}'s {type(cfg).__name__} has no field {', '.join(unknown)} "
                         f"(fields: {', '.join(sorted(names))})")
    return dataclasses.replace(cfg, **overrides)


def _call(routine: str, d: int, causal: bool, n: int, overrides: dict[str, Any]):
    """Make the routine's wrapper calls on CPU tensors (B * N = 16k tokens, H * d = 2048, at least one of each);
    returns the config used (None for FA2's)."""
    from flashtile.runtime import fa2_bwd, fa2_fwd, fa3_fwd, fa3_gluon, fa3_gluon_bwd

    b, h = max(1, 16384 // n), max(1, 2048 // d)
    q = torch.zeros(b, h, n, d, dtype=torch.bfloat16)
    lse = torch.zeros(b, h, n)
    scale = d ** -0.5
    if routine.startswith("fa2"):
        if overrides:
            raise ValueError(f"--set: {routine} takes no config overrides (its tiles are the dispatch's)")
        if routine == "fa2-fwd":
            fa2_fwd.fa2_forward(q, q, q, softmax_scale=scale, causal=causal)
        else:
            fa2_bwd.fa2_backward(q, q, q, q, q, lse, softmax_scale=scale, causal=causal)
        return None
    if routine == "hopper-fwd":
        cfg = _replace(fa3_fwd.fa3_config(d, causal, n, n), overrides, routine)
        fa3_fwd.launch(q, q, q, torch.zeros_like(q), lse, scale * fa3_fwd.LOG2E, causal, cfg)
    elif routine == "gluon-fwd":
        cfg = _replace(fa3_fwd.gluon_dispatch_config(q, q, causal), overrides, routine)
        fa3_gluon.fa3_gluon_forward(q, q, q, softmax_scale=scale, causal=causal, config=cfg)
    elif routine == "gluon-fp8":
        q8 = q.to(torch.float8_e4m3fn)
        cfg = _replace(fa3_gluon.gluon_fp8_config(d, causal, n >= fa3_gluon.FP8_DYNAMIC_MIN_KEYS), overrides, routine)
        ones = torch.ones(b, h)
        err = torch.zeros(2, dtype=torch.int32)
        fa3_gluon.gluon_launch(q8, q8, fa3_gluon.fp8_v_operand(q8), torch.zeros_like(q), lse, scale, causal, cfg,
                               fp8=((ones, ones, ones), err))
    elif routine == "gluon-bwd":
        base = fa3_gluon_bwd.variant_base(fa3_gluon_bwd.gluon_bwd_config(d, causal), d, causal, overrides)
        cfg = _replace(base, overrides, routine)
        fa3_gluon_bwd.fa3_gluon_backward(q, q, q, q, q, lse, softmax_scale=scale, causal=causal, config=cfg)
    else:
        raise ValueError(f"routine must be one of {', '.join(ROUTINES)}, got {routine!r}")
    return cfg


def _tool(name: str) -> str:
    """A CUDA binary the installed Triton ships: the ptxas it assembles sm_90 with (``get_ptxas(90)``: the
    bundled names differ between releases), or cuobjdump; else the one on PATH."""
    import triton

    if name == "ptxas":
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else name


def ptxas_report(ptx: str) -> dict[str, Any]:
    """``ptxas -v --gpu-name sm_90a`` on ``ptx``: registers, spill stores / loads (bytes), and the PTX's
    ``bar.sync`` / ``bar.arrive`` counts (hardware named and CTA barriers; mbarrier operations not counted)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([_tool("ptxas"), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"ptxas failed: {res.stderr.strip()[-400:]}")

    def total(pattern: str) -> int:
        return sum(int(x) for x in re.findall(pattern, res.stderr))

    regs = [int(x) for x in re.findall(r"Used (\d+) registers", res.stderr)]
    return dict(registers=max(regs) if regs else None, spill_stores=total(r"(\d+) bytes spill stores"),
                spill_loads=total(r"(\d+) bytes spill loads"),
                bar_sync=len(re.findall(r"\b(?:bar|barrier)(?:\.cta)?\.sync\b", ptx)),
                bar_arrive=len(re.findall(r"\b(?:bar|barrier)(?:\.cta)?\.arrive\b", ptx)))


_SASS_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_SASS_BACK = re.compile(r"\bBRA\b[^;]*?\b0x([0-9a-f]+)")


def sass_loops(sass: str, min_size: int = 64) -> list[dict[str, int]]:
    """The innermost loops of a ``cuobjdump -sass`` listing: spans closed by a branch to a lower address, at least
    ``min_size`` instructions long, holding no other such span (barrier spin loops are shorter), in address order,
    each as ``{"start", "instructions", "local"}`` (``local``: spill traffic, LDL / STL, inside the loop)."""
    loops = []
    for body in re.split(r"\n\s*Function\s*:", sass):
        instrs = [(int(m.group(1), 16), m.group(2)) for m in _SASS_INSTR.finditer(body)]
        if len(instrs) < 2:
            continue
        step = instrs[1][0] - instrs[0][0]
        spans = []
        for addr, text in instrs:
            m = _SASS_BACK.search(text)
            if m and int(m.group(1), 16) < addr and (addr - int(m.group(1), 16)) // step + 1 >= min_size:
                spans.append((int(m.group(1), 16), addr))
        for lo, hi in spans:
            if any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b in spans):
                continue  # holds a loop: not innermost
            local = sum(1 for addr, text in instrs if lo <= addr <= hi and re.match(r"(@!?U?P\w+\s+)?(LDL|STL)\b",
                                                                                   text.strip()))
            loops.append(dict(start=lo, instructions=(hi - lo) // step + 1, local=local))
    return sorted(loops, key=lambda x: x["start"])


def _summary(e: BaseException) -> str:
    """One line for a compile failure: the innermost cause's last line that is not source or a caret (Triton's
    CompilationError chains one frame per inlined call, the reason at the bottom)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and ln.strip() != "^"]
    said = [ln for ln in lines if "Error" in ln or "error" in ln] or lines[-1:]
    return f"{type(e).__name__}: {said[-1] if said else ''}"[:300]


def _name(kernel) -> str:
    fn = getattr(kernel, "fn", kernel)
    return getattr(fn, "__name__", type(kernel).__name__)


def compile_routine(routine: str, d: int, causal: bool, n: int = 4096, overrides: dict[str, Any] | None = None,
                    dump: str | os.PathLike | None = None, sass: bool = False) -> dict[str, Any]:
    """One row: the routine's launches for (head dim ``d``, ``causal``, ``n`` tokens) compiled for sm_90a, each
    kernel's :func:`ptxas_report` (or the compile error, in one line), the config as a dict.  ``dump``: each
    kernel's PTX (and with ``sass`` its SASS) written to that folder as ``<routine>_d<d>_<c|nc>_<i>_<kernel>``."""
    overrides = overrides or {}
    row: dict[str, Any] = dict(routine=routine, head_dim=d, causal=causal, seqlen=n, overrides=overrides)
    with offline_sm90() as calls:
        cfg = _call(routine, d, causal, n, overrides)
        row["config"] = dataclasses.asdict(cfg) if cfg is not None else None
        kernels = []
        for i, call in enumerate(calls):
            fn = call.kernel if hasattr(call.kernel, "warmup") else getattr(call.kernel, "fn", call.kernel)
            entry: dict[str, Any] = dict(kernel=_name(call.kernel))
            try:
                with _own_device_cache(fn):
                    compiled = fn.warmup(*call.dynamic, *call.static, grid=call.grid, num_warps=call.num_warps,
                                         num_stages=call.num_stages)
            except Exception as e:  # the compiler's refusal is the answer (an API this Triton lacks, a resource)
                entry["error"] = _summary(e)
                kernels.append(entry)
                continue
            ptx = compiled.asm["ptx"]
            entry.update(ptxas_report(ptx), shared_bytes=getattr(compiled.metadata, "shared", None))
            if dump is not None:
                stem = Path(dump) / f"{routine}_d{d}_{'c' if causal else 'nc'}_{i}_{entry['kernel']}"
                stem.parent.mkdir(parents=True, exist_ok=True)
                # debug locations (.loc / .file) shift with any edit of the source: left out, so equal PTX means
                # equal code
                stem.with_suffix(".ptx").write_text(
                    "\n".join(ln for ln in ptx.split(".section\t.debug")[0].splitlines()
                              if not ln.lstrip().startswith((".loc", ".file"))) + "\n")
                if sass:
                    cubin = stem.with_suffix(".cubin")
                    cubin.write_bytes(compiled.asm["cubin"])
                    out = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True)
                    stem.with_suffix(".sass").write_text(out.stdout)
                    cubin.unlink()
                    entry["inner_loops"] = sass_loops(out.stdout)
            kernels.append(entry)
    row["kernels"] = kernels
    return row
