"""`flashtile bench attention`: our FA2 kernels against PyTorch's attention backends.

Every grid point builds one set of random bf16 inputs in the (batch, seqlen,
heads, head_dim) layout that model code produces, and times, in this process:

* ``flashtile``      — :func:`flashtile.flash_attn_func` (the Hopper forward where it is chosen, else FA2)
* ``flashtile-fa2``  — the same with the Hopper forward switched off (the FA2 kernels only)
* ``sdpa-flash``     — ``scaled_dot_product_attention`` restricted to the FLASH_ATTENTION backend (FA2 CUDA)
* ``sdpa-cudnn``     — the CUDNN_ATTENTION backend
* ``sdpa-efficient`` — the EFFICIENT_ATTENTION backend (xFormers' memory-efficient kernel)
* ``flex``           — ``torch.compile(flex_attention)`` with a causal BlockMask when causal
* ``fa3``            — FlashAttention-3's forward (``fa3_fwd_interface``, an optional peer: the column
  reads "unsupported" when it is not importable, and for forward + backward, which it lacks)
* ``flashtile-fp8`` / ``fa3-fp8`` — the FP8 forwards (FA3's API) on the same inputs quantised to e4m3
  per (batch, kv head) once per point, outside the timed region (forward only; not in the default set)

SDPA and FlexAttention receive ``x.transpose(1, 2)`` views of the same tensors.
Throughput uses the FlashAttention convention: 4·B·H·N²·d FLOPs forward,
halved when causal, ×3.5 for forward + backward (backward = 2.5 × forward).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from flashtile.bench.common import attention_flops, environment, median_ms, rel_err

PROVIDERS = ("flashtile", "flashtile-fa2", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex", "fa3",
             "flashtile-fp8", "fa3-fp8")
DEFAULT_PROVIDERS = PROVIDERS[:7]


@dataclass
class Point:
    head_dim: int
    seqlen: int
    batch: int
    heads: int
    causal: bool
    mode: str  # "fwd" or "fwd_bwd"
    ms: dict = field(default_factory=dict)  # provider -> median ms (None when unsupported)
    tflops: dict = field(default_factory=dict)
    err: dict = field(default_factory=dict)  # provider -> rel err of the forward output vs fp32 math (sampled heads)
    kv_heads: int = 0  # GQA / MQA: heads of k and v (0: as many as q's)

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.heads, self.seqlen, self.head_dim, self.causal,
                               self.mode == "fwd_bwd")


def default_grid(total_tokens: int = 16384, head_dims=(64, 128), seqlens=(1024, 2048, 4096, 8192, 16384),
                 heads: int | None = None):
    """bf16, batch·seqlen = 16k tokens, heads = 2048 / head_dim (the issue's grid) unless ``heads`` is given."""
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
        raise ValueError(f"heads must be None (2048 / head_dim) or a positive int, got {heads!r}")
    for d in head_dims:
        for n in seqlens:
            for causal in (False, True):
                yield d, n, max(1, total_tokens // n), heads or 2048 // d, causal


def sdpa_fn(backend_name: str) -> Callable:
    """``fn(q, k, v, causal)`` on (B, N, H, d) tensors through one SDPA backend: ``"sdpa-flash"``,
    ``"sdpa-cudnn"``, ``"sdpa-efficient"`` or ``"sdpa-math"`` (the backend is forced, so an
    unsupported point raises instead of falling back)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "sdpa-flash": SDPBackend.FLASH_ATTENTION,
        "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
        "sdpa-math": SDPBackend.MATH,
    }[backend_name]

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                enable_gqa=k.shape[2] != q.shape[2],
            ).transpose(1, 2)

    return run


def _flex_fn():
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # one compiled graph per shape: raise the cache so Dynamo never falls back to eager
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    compiled = torch.compile(flex_attention, dynamic=False)
    masks: dict = {}

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def run(q, k, v, causal):
        n = q.shape[1]
        bm = None
        if causal:
            if n not in masks:
                masks[n] = create_block_mask(causal_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device=q.device)
            bm = masks[n]
        return compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm,
                        enable_gqa=k.shape[2] != q.shape[2]).transpose(1, 2)

    return run


def _flashtile_fn(hopper: bool = True):
    from flashtile import flash_attn_func
    from flashtile.runtime import fa3_fwd

    def run(q, k, v, causal):
        saved, fa3_fwd.ENABLED = fa3_fwd.ENABLED, hopper and fa3_fwd.ENABLED
        try:
            return flash_attn_func(q, k, v, causal=causal)
        finally:
            fa3_fwd.ENABLED = saved

    return run


def _fa3_or_missing():
    """``(fa3_fwd_interface, None)`` if it imports (an optional peer, never a dependency), else ``(None, a
    provider that raises why not)``."""
    try:
        import fa3_fwd_interface as fa3
    except ImportError as e:
        reason = f"fa3_fwd_interface not importable ({e})"

        def missing(q, k, v, causal):
            raise RuntimeError(reason)

        return None, missing
    return fa3, None


def _fa3_fn():
    """FA3's forward if its interface imports, else a function that says why not."""
    fa3, missing = _fa3_or_missing()
    if fa3 is None:
        return missing

    def run(q, k, v, causal):
        out = fa3.flash_attn_func(q, k, v, causal=causal)
        out = out[0] if isinstance(out, tuple) else out
        if q.requires_grad:
            raise RuntimeError("the FA3 forward wheel has no backward")
        return out

    return run


def _fp8_fn(peer: str):
    """An FP8 forward (ours or FA3's) on e4m3 copies of the bf16 inputs, quantised once per input set."""
    from flashtile.fp8 import quantize_per_head

    if peer == "fa3":
        fa3, missing = _fa3_or_missing()
        if fa3 is None:
            return missing
        attn = fa3.flash_attn_func
    else:
        from flashtile import flash_attn_func as attn
    memo: dict = {}

    def run(q, k, v, causal):
        if q.requires_grad:
            raise RuntimeError("FP8 attention is forward only")
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), tuple(q.shape), tuple(k.shape))
        if memo.get("key") != key:
            hk = k.shape[2]
            q8, qs = quantize_per_head(q, layout="bnhd", kv_heads=hk)
            k8, ks = quantize_per_head(k, layout="bnhd")
            v8, vs = quantize_per_head(v, layout="bnhd")
            memo.update(key=key, args=(q8, k8, v8), kw=dict(q_descale=qs, k_descale=ks, v_descale=vs))
        out = attn(*memo["args"], causal=causal, **memo["kw"])
        return out[0] if isinstance(out, tuple) else out

    return run


def make_providers(names) -> dict[str, Callable]:
    out = {}
    for name in names:
        if name in ("flashtile", "flashtile-fa2"):
            out[name] = _flashtile_fn(hopper=name == "flashtile")
        elif name.startswith("sdpa-"):
            out[name] = sdpa_fn(name)
        elif name == "flex":
            out[name] = _flex_fn()
        elif name == "fa3":
            out[name] = _fa3_fn()
        elif name in ("flashtile-fp8", "fa3-fp8"):
            out[name] = _fp8_fn(name.split("-")[0])
        else:
            raise ValueError(f"unknown provider {name!r}; choose from {PROVIDERS + ('sdpa-math',)}")
    return out


def reference_rows(q, k, v, causal, heads=2, rows=256):
    """fp32 math attention of batch 0 on the first ``heads`` heads and ``rows`` evenly spaced query rows
    (cheap: no N×N for every head).  q, k, v: (B, N, H, d).  Returns ``(ref, idx)``: ``ref`` is
    (1, heads, len(idx), d) float32 and ``idx`` the query rows, so an output ``o`` (B, N, H, d) is
    compared as ``o[:1, idx, :heads].transpose(1, 2)``."""
    n, heads = q.shape[1], min(heads, q.shape[2])
    kv = [i * k.shape[2] // q.shape[2] for i in range(heads)]  # the kv head of each sampled q head (GQA)
    qs = q[:1, :, :heads].float().transpose(1, 2)  # (1, h, n, d)
    ks = k[:1, :, kv].float().transpose(1, 2)
    vs = v[:1, :, kv].float().transpose(1, 2)
    idx = torch.linspace(0, n - 1, min(rows, n), device=q.device).long()
    s = (qs[:, :, idx] @ ks.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > idx[:, None], float("-inf"))
    return torch.softmax(s, dim=-1) @ vs, idx


def run_point(providers: dict, d: int, n: int, b: int, h: int, causal: bool, modes=("fwd", "fwd_bwd"),
              dtype=torch.bfloat16, gqa: int = 1):
    """One grid point: q (b, n, h, d), k and v with ``h // gqa`` heads."""
    torch.manual_seed(n * 7 + d)
    dev = "cuda"
    q = torch.randn(b, n, h, d, device=dev, dtype=dtype)
    k, v = (torch.randn(b, n, h // gqa, d, device=dev, dtype=dtype) for _ in range(2))
    dout = torch.randn_like(q)
    ref, idx = reference_rows(q, k, v, causal)
    results = []
    for mode in modes:
        pt = Point(d, n, b, h, causal, mode, kv_heads=h // gqa)
        for name, fn in providers.items():
            try:
                if mode == "fwd":
                    with torch.no_grad():
                        o = fn(q, k, v, causal)
                        pt.err[name] = rel_err(o[:1, idx, :2].transpose(1, 2).float(), ref)
                        ms = median_ms(lambda: fn(q, k, v, causal))
                else:
                    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

                    def step():
                        fn(qg, kg, vg, causal).backward(dout)

                    ms = median_ms(step, grad_to_none=[qg, kg, vg])
            except Exception as e:  # a backend that does not support this point
                pt.ms[name] = None
                pt.err.setdefault(name, f"unsupported: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}")
                continue
            pt.ms[name] = ms
            pt.tflops[name] = pt.flops / (ms * 1e-3) / 1e12
        results.append(pt)
        torch.cuda.empty_cache()
    return results


def peak_extra_memory(providers: dict, d=128, n=4096, b=4, h=16, causal=False) -> dict:
    """Peak memory a forward allocates beyond its inputs (MiB), incl. SDPA-math for scale."""
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = {}
    for name, fn in {**providers, "sdpa-math": sdpa_fn("sdpa-math")}.items():
        try:
            with torch.no_grad():
                fn(q, k, v, causal)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                fn(q, k, v, causal)
                torch.cuda.synchronize()
                out[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        except Exception as e:
            out[name] = f"unsupported: {type(e).__name__}"
    return out


def run(providers=PROVIDERS, grid=None, modes=("fwd", "fwd_bwd"), progress=None, gqa: int = 1) -> dict:
    """Run the grid (``gqa`` q heads per kv head); returns the JSON-able payload (env, points, memory)."""
    if not torch.cuda.is_available():
        raise RuntimeError("`flashtile bench attention` needs a CUDA GPU")
    if isinstance(gqa, bool) or not isinstance(gqa, int) or gqa < 1:
        raise ValueError(f"gqa must be a positive int (q heads per kv head), got {gqa!r}")
    grid = list(grid if grid is not None else default_grid())
    for d, _, _, h, _ in grid:  # before any point is timed
        if h % gqa:
            raise ValueError(f"gqa {gqa} must divide the q heads of every point, got {h} at head_dim {d}")
    fns = make_providers(providers)
    points = []
    for i, (d, n, b, h, causal) in enumerate(grid):
        if progress:
            progress(i, len(grid), f"d={d} N={n} causal={causal}")
        points.extend(run_point(fns, d, n, b, h, causal, modes, gqa=gqa))
    return {
        "env": environment(),
        "providers": list(providers),
        "flops_convention": "4*B*H*N^2*d forward, /2 causal, x3.5 fwd+bwd",
        "points": [asdict(p) | {"flops": p.flops} for p in points],
        "peak_extra_memory_mib": peak_extra_memory(fns),
        "peak_extra_memory_shape": "d=128 N=4096 B=4 H=16 (multi-head, non-causal forward)",
    }


def ratios(payload: dict, ours: str = "flashtile") -> list[dict]:
    """Per point: our TFLOP/s and the ratio to each peer (ours / peer)."""
    rows = []
    for p in payload["points"]:
        r = {k: p[k] for k in ("head_dim", "seqlen", "batch", "heads", "causal", "mode")}
        r["kv_heads"] = p.get("kv_heads") or p["heads"]
        r["tflops"] = p["tflops"]
        mine = p["tflops"].get(ours)
        r["ratio"] = {
            peer: (mine / t if mine and t else None) for peer, t in p["tflops"].items() if peer != ours
        }
        rows.append(r)
    return rows


def plot(payload: dict, path) -> None:
    """TFLOP/s against seqlen, one panel per (head_dim, causal, mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = payload["points"]
    panels = sorted({(p["head_dim"], p["causal"], p["mode"]) for p in pts})
    cols = 4
    rows_n = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), squeeze=False)
    for ax, (d, causal, mode) in zip(axes.flat, panels):
        sel = [p for p in pts if (p["head_dim"], p["causal"], p["mode"]) == (d, causal, mode)]
        for prov in payload["providers"]:
            xs = [p["seqlen"] for p in sel if p["tflops"].get(prov)]
            ys = [p["tflops"][prov] for p in sel if p["tflops"].get(prov)]
            if xs:
                ax.plot(xs, ys, marker="o", label=prov, linewidth=2.5 if prov == "flashtile" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_title(f"d={d} {'causal' if causal else 'full'} {mode}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"attention, bf16, {payload['env'].get('device')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- #
# Packed (variable-length) batches: `flashtile bench attention --varlen`
# --------------------------------------------------------------------------- #
VARLEN_PROVIDERS = ("flashtile-varlen", "flashtile-fixed", "flex-document")


def varlen_lengths(total: int = 65536, lo: int = 128, hi: int = 8192, seed: int = 0) -> list[int]:
    """Sequence lengths drawn log-uniformly from [lo, hi] until they sum to ``total`` (the last one is
    cut to fit and dropped if that leaves it shorter than ``lo``, its tokens going to the one before)."""
    gen = torch.Generator().manual_seed(seed)
    lens: list[int] = []
    while sum(lens) < total:
        u = float(torch.rand((), generator=gen))
        lens.append(int(round(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))))))
    lens[-1] -= sum(lens) - total
    if lens[-1] < lo and len(lens) > 1:
        last = lens.pop()
        lens[-1] += last
    return lens


def equal_flops_batch(lens: list[int], multiple: int = 128) -> tuple[int, int]:
    """(batch, seqlen) of a fixed-length batch with about the attention FLOPs of ``lens``
    (sum L^2 = B N^2): N the root-mean-square length rounded to ``multiple``, B rounded to match."""
    sq = sum(n * n for n in lens)
    n = max(multiple, int(round(math.sqrt(sq / len(lens)) / multiple)) * multiple)
    return max(1, int(round(sq / (n * n)))), n


def _attn_flops(sq_sum: float, heads: int, d: int, causal: bool, mode: str) -> float:
    f = 4.0 * heads * d * sq_sum / (2 if causal else 1)
    return f * (3.5 if mode == "fwd_bwd" else 1.0)


def _no_grad_ms(fn, inputs) -> float:
    with torch.no_grad():
        return median_ms(lambda: fn(*inputs))


def _flex_document_fn(lens: list[int], causal: bool, device):
    """FlexAttention over the packed batch as one sequence with a document mask (one compiled kernel)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))

    def document(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    total = sum(lens)
    mask = create_block_mask(document, B=None, H=None, Q_LEN=total, KV_LEN=total, device=device)
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v):  # (total, H, d) -> (1, H, total, d) views
        o = compiled(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=mask)
        return o[0].transpose(0, 1)

    return run


def run_varlen(
    providers=VARLEN_PROVIDERS, total: int = 65536, lo: int = 128, hi: int = 8192, head_dim: int = 128,
    heads: int = 16, modes=("fwd", "fwd_bwd"), causal_modes=(False, True), seed: int = 0, dtype=torch.bfloat16,
    device: str = "cuda", rounds: int = 3,
) -> dict:
    """A packed batch of lengths from ``varlen_lengths`` timed through ``flash_attn_varlen_func`` and
    FlexAttention with a document mask, and a fixed-length ``flash_attn_func`` batch of the same
    attention FLOPs (:func:`equal_flops_batch`).  TFLOP/s count only the FLOPs inside each sequence; each time
    is the median of ``rounds`` interleaved rounds, each round starting at the next provider (one process's
    clock drift and order effects reach every provider alike)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("`flashtile bench attention --varlen` needs a CUDA GPU")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    from flashtile import flash_attn_func, flash_attn_varlen_func

    dev = device
    lens = varlen_lengths(total, lo, hi, seed)
    fb, fn_len = equal_flops_batch(lens)
    sq = float(sum(n * n for n in lens))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=dev)
    torch.manual_seed(seed)
    q, k, v = (torch.randn(total, heads, head_dim, device=dev, dtype=dtype) for _ in range(3))
    qf, kf, vf = (torch.randn(fb, fn_len, heads, head_dim, device=dev, dtype=dtype) for _ in range(3))
    points = []
    for causal in causal_modes:
        fns: dict[str, tuple[Callable, tuple, float]] = {}
        for name in providers:
            if name == "flashtile-varlen":
                f = lambda q, k, v, c=causal: flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=c)  # noqa: E731
                fns[name] = (f, (q, k, v), sq)
            elif name == "flashtile-fixed":
                fns[name] = (lambda q, k, v, c=causal: flash_attn_func(q, k, v, causal=c), (qf, kf, vf), fb * fn_len**2)
            elif name == "flex-document":
                try:
                    fns[name] = (_flex_document_fn(lens, causal, dev), (q, k, v), sq)
                except Exception as e:  # an optional peer: reported, not fatal
                    fns[name] = (None, (str(e).splitlines() or [''])[0][:120], sq)
            else:
                raise ValueError(f"unknown provider {name!r}; choose from {VARLEN_PROVIDERS}")
        for mode in modes:
            pt = {"causal": causal, "mode": mode, "ms": {}, "tflops": {}, "err": {}}
            runs: dict[str, Callable[[], float]] = {}
            for name, (fn, inputs, _) in fns.items():
                if fn is None:
                    pt["ms"][name], pt["err"][name] = None, f"unsupported: {inputs}"
                elif mode == "fwd":
                    runs[name] = lambda fn=fn, inputs=inputs: _no_grad_ms(fn, inputs)
                else:
                    leaves = [x.detach().requires_grad_() for x in inputs]
                    dout = torch.randn_like(leaves[0])
                    runs[name] = lambda fn=fn, leaves=leaves, dout=dout: median_ms(
                        lambda: fn(*leaves).backward(dout), grad_to_none=leaves)
            times: dict[str, list[float]] = {name: [] for name in runs}
            for r in range(rounds):  # each round starts at another provider: drift and order effects even out
                order = list(runs)[r % max(1, len(runs)):] + list(runs)[: r % max(1, len(runs))]
                for name in order:
                    if name in pt["err"]:
                        continue
                    try:
                        times[name].append(runs[name]())
                    except Exception as e:
                        first = (str(e).splitlines() or [""])[0][:120]
                        pt["ms"][name], pt["err"][name] = None, f"unsupported: {type(e).__name__}: {first}"
            for name, ts in times.items():
                if name in pt["err"]:
                    continue
                ms = statistics.median(ts)
                pt["ms"][name] = ms
                pt["tflops"][name] = _attn_flops(fns[name][2], heads, head_dim, causal, mode) / (ms * 1e-3) / 1e12
            points.append(pt)
            if dev == "cuda":
                torch.cuda.empty_cache()
    return {
        "env": environment(),
        "providers": list(providers),
        "lengths": lens,
        "fixed_batch": {"batch": fb, "seqlen": fn_len, "flops_ratio": fb * fn_len**2 / sq},
        "head_dim": head_dim,
        "heads": heads,
        "flops_convention": "4*H*d*sum(L_i^2) forward, /2 causal, x3.5 fwd+bwd",
        "rounds": rounds,
        "points": points,
    }
