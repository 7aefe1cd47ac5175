"""`flashtile bench tune`: the FA2 kernels' tile configs, swept against SDPA in one process.

The sweep is declared by :data:`FWD_CANDIDATES`, :data:`BWD_CANDIDATES` and :func:`tune_sweep`: per grid
point (bf16, batch·seqlen = 16k tokens, heads = 2048 / d, as `flashtile bench attention`) the library's
own choice (``fwd_config`` / ``bwd_config``, reported as ``"heuristic"``) and every candidate are run.
Each config is first checked against fp32 math attention (the forward on sampled rows of two heads,
the backward's dQ, dK, dV on one head); a config over :data:`TOLERANCE` or one that fails to compile
is reported, not timed.  The others are timed with do_bench medians next to SDPA-flash and cuDNN.
Forward points time ``fa2_forward``; backward points time a forward + backward step (both with the
dQ accumulated by fp32 atomics and with the separate dQ kernel).  The candidates are forced by
patching the runtime's public ``fwd_config`` / ``bwd_config`` (the one place each picks its tiles)
for the duration of one call, see :func:`forced_config`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from flashtile.bench.attention import reference_rows, sdpa_fn
from flashtile.bench.common import attention_flops, environment, median_ms, rel_err, write_json

__all__ = [
    "BWD_CANDIDATES", "FWD_CANDIDATES", "MODES", "PEERS", "TOLERANCE", "TunePoint",
    "forced_config", "run_tune", "tune_sweep",
]

MODES = ("fwd", "bwd")
PEERS = ("sdpa-flash", "sdpa-cudnn")
# relative error vs fp32 math over which a config is wrong (bf16 inputs, fp32 accumulation)
TOLERANCE = {"fwd": 2e-2, "bwd": 3e-2}

# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward kernel, per head dim
FWD_CANDIDATES: dict[int, tuple[tuple[int, int, int, int], ...]] = {
    64: ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 4), (128, 32, 4, 4),
         (256, 64, 8, 3)),
    128: ((128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3),
          (256, 64, 8, 2)),
}
# (block_m, block_n, dq_block_m, dq_block_n, num_warps, num_stages) of ``BwdConfig``, per head dim;
# each is run with atomic_dq True and False
BWD_CANDIDATES: dict[int, tuple[tuple[int, int, int, int, int, int], ...]] = {
    64: ((64, 128, 128, 64, 8, 3), (128, 128, 128, 128, 8, 2), (64, 128, 128, 128, 8, 3)),
    128: ((64, 128, 128, 64, 8, 2), (64, 128, 128, 32, 8, 2), (64, 128, 64, 64, 8, 2), (64, 128, 128, 64, 8, 3)),
}


@dataclass(frozen=True)
class TunePoint:
    """One grid point of the sweep and the configs run there (``None``: the library's own choice)."""

    mode: str  # "fwd" or "bwd" (timed as forward + backward)
    head_dim: int
    seqlen: int
    batch: int
    heads: int
    causal: bool
    candidates: tuple  # None first, then FWD_CANDIDATES / BWD_CANDIDATES entries (bwd: (tiles, atomic_dq))

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.heads, self.seqlen, self.head_dim, self.causal, self.mode == "bwd")


def tune_sweep(
    modes=MODES, head_dims=(64, 128), seqlens=(1024, 4096, 16384), causal=(False, True), total_tokens: int = 16384,
) -> list[TunePoint]:
    """The declared grid: every (mode, head dim, seqlen, causal) with its candidate configs."""
    modes, head_dims, seqlens, causal = tuple(modes), tuple(head_dims), tuple(seqlens), tuple(causal)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {modes}")
    bad = [d for d in head_dims if d not in FWD_CANDIDATES or d not in BWD_CANDIDATES]
    if bad or not head_dims:
        raise ValueError(f"head_dims must be a non-empty subset of {sorted(FWD_CANDIDATES)} (the dims with "
                         f"declared candidates), got {head_dims}")
    if not seqlens or any(not isinstance(n, int) or n < 1 for n in seqlens):
        raise ValueError(f"seqlens must be positive ints, got {seqlens}")
    if not causal or any(not isinstance(c, bool) for c in causal):
        raise ValueError(f"causal must be a non-empty tuple of bools, got {causal}")
    points = []
    for mode in modes:
        for d in head_dims:
            if mode == "fwd":
                cands = (None, *FWD_CANDIDATES[d])
            else:
                cands = (None, *((c, a) for c in BWD_CANDIDATES[d] for a in (True, False)))
            for n in seqlens:
                for c in causal:
                    points.append(TunePoint(mode, d, n, max(1, total_tokens // n), 2048 // d, c, cands))
    return points


@contextlib.contextmanager
def forced_config(mode: str, cfg) -> Iterator[None]:
    """Within the block, the FA2 forward (``mode="fwd"``, ``cfg`` a 4-tuple of :data:`FWD_CANDIDATES`) or
    backward (``"bwd"``, ``cfg`` = (6-tuple of :data:`BWD_CANDIDATES`, atomic_dq)) uses ``cfg`` for every
    shape; ``cfg=None`` leaves the library's choice.  Not thread-safe (it swaps a module attribute)."""
    from flashtile.runtime import fa2_bwd, fa2_fwd

    if cfg is None:
        yield
        return
    if mode == "fwd":
        module, name, value = fa2_fwd, "fwd_config", tuple(cfg)
    elif mode == "bwd":
        tiles, atomic = cfg
        module, name, value = fa2_bwd, "bwd_config", fa2_bwd.BwdConfig(*tiles, atomic_dq=bool(atomic))
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    saved = getattr(module, name)
    setattr(module, name, lambda *args, **kwargs: value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def _describe(mode: str, cfg) -> str:
    if cfg is None:
        return "heuristic"
    if mode == "fwd":
        return "{}x{}/w{}/s{}".format(*cfg)
    tiles, atomic = cfg
    return "{}x{}+dq{}x{}/w{}/s{}".format(*tiles) + ("/atomic" if atomic else "/dq-kernel")


def _inputs(pt: TunePoint):
    torch.manual_seed(pt.seqlen * 7 + pt.head_dim)
    shape = (pt.batch, pt.seqlen, pt.heads, pt.head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    return q, k, v, dout


def _fwd_runner(pt: TunePoint, q, k, v):
    from flashtile.runtime.fa2_fwd import fa2_forward

    ref, idx = reference_rows(q, k, v, pt.causal)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, N, d) views

    def step():
        return fa2_forward(qt, kt, vt, softmax_scale=pt.head_dim**-0.5, causal=pt.causal)

    def error() -> float:
        o, _ = step()
        return rel_err(o[:1, : ref.shape[1], idx].float(), ref)

    return step, error


def _bwd_runner(pt: TunePoint, q, k, v, dout):
    from flashtile.runtime.fa2_bwd import fa2_backward
    from flashtile.runtime.fa2_fwd import fa2_forward

    # gradient reference: fp32 math attention on batch 0, head 0
    q1, k1, v1 = (x[:1, :, :1].float().requires_grad_() for x in (q, k, v))
    sdpa_fn("sdpa-math")(q1, k1, v1, pt.causal).backward(dout[:1, :, :1].float())
    refs = [x.grad.transpose(1, 2) for x in (q1, k1, v1)]  # (1, 1, N, d)
    qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, dout))
    scale = pt.head_dim**-0.5

    def step():
        o, lse = fa2_forward(qt, kt, vt, softmax_scale=scale, causal=pt.causal)
        return fa2_backward(dot, qt, kt, vt, o, lse, softmax_scale=scale, causal=pt.causal)

    def error() -> float:
        grads = step()
        return max(rel_err(g[:1, :1].float(), r) for g, r in zip(grads, refs))

    return step, error


def _peer_ms(pt: TunePoint, name: str, q, k, v, dout) -> float:
    fn = sdpa_fn(name)
    if pt.mode == "fwd":
        with torch.no_grad():
            return median_ms(lambda: fn(q, k, v, pt.causal))
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    return median_ms(lambda: fn(qg, kg, vg, pt.causal).backward(dout), grad_to_none=[qg, kg, vg])


def run_point(pt: TunePoint) -> dict:
    """Check, then time, every config of ``pt``; returns the JSON-able row."""
    q, k, v, dout = _inputs(pt)
    row = {"mode": pt.mode, "head_dim": pt.head_dim, "seqlen": pt.seqlen, "batch": pt.batch, "heads": pt.heads,
           "causal": pt.causal, "flops": pt.flops, "peers": {}, "configs": []}
    for name in PEERS:
        try:
            row["peers"][name] = pt.flops / (_peer_ms(pt, name, q, k, v, dout) * 1e-3) / 1e12
        except Exception as e:  # a backend that does not support this point
            row["peers"][name] = None
            row.setdefault("peer_errors", {})[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    step, error = _fwd_runner(pt, q, k, v) if pt.mode == "fwd" else _bwd_runner(pt, q, k, v, dout)
    for cfg in pt.candidates:
        entry = {"config": _describe(pt.mode, cfg), "tiles": cfg, "err": None, "tflops": None}
        try:
            with forced_config(pt.mode, cfg), torch.no_grad():
                entry["err"] = error()
                if entry["err"] <= TOLERANCE[pt.mode]:
                    entry["tflops"] = pt.flops / (median_ms(step) * 1e-3) / 1e12
                else:
                    entry["error"] = f"rel err {entry['err']:.3g} > {TOLERANCE[pt.mode]}: not timed"
        except Exception as e:  # a config that does not compile or launch here
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        row["configs"].append(entry)
    timed = [c for c in row["configs"] if c["tflops"]]
    row["best"] = max(timed, key=lambda c: c["tflops"])["config"] if timed else None
    torch.cuda.empty_cache()
    return row


def run_tune(points: list[TunePoint], out_dir, progress: Callable[[str], None] | None = None) -> dict:
    """Run ``points`` (from :func:`tune_sweep`); writes ``tune_<device>.json`` under ``out_dir`` after every
    point (a run stopped early keeps what it measured) and returns the payload with its ``path``."""
    if not torch.cuda.is_available():
        raise RuntimeError("`flashtile bench tune` needs a CUDA GPU")
    payload = {"env": environment(), "tolerance": TOLERANCE, "peers": list(PEERS),
               "flops_convention": "4*B*H*N^2*d forward, /2 causal, x3.5 fwd+bwd", "points": []}
    path = None
    for pt in points:
        if progress:
            progress(f"{pt.mode} d={pt.head_dim} N={pt.seqlen} causal={pt.causal}")
        payload["points"].append(run_point(pt))
        path = write_json(payload, out_dir, "tune")
    payload["path"] = str(path)
    return payload
