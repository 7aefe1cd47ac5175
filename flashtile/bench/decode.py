"""`flashtile bench decode`: split-KV decoding against PyTorch's attention backends (GPU only).

Grid: bf16, Hq 32, Hk 8, d 128, one query token (Nq = 1), batch 1 / 8 / 64,
cache length L = 1k / 4k / 32k / 128k, every element using its full cache.
Points whose buffers (contiguous cache, paged pool and the gathered copy of
the baseline: three caches of ``2 B L Hk d * 2`` bytes) do not fit in ~60 GB
are skipped and listed.  Every point times, in this process, on one set of
random inputs:

* ``flashtile``        — :func:`flashtile.ops.kvcache.flash_attn_with_kvcache`, contiguous cache
* ``flashtile-paged``  — the same with 256-key pages in random physical order
* ``flashtile-pp``     — contiguous, FlashDecoding++ (``unified_max=0``)
* ``flashtile-kernel`` — :func:`flashtile.runtime.decode.flash_decode` on the contiguous cache: the
  op's checks on every call (no signature memo), no append
* ``sdpa-flash``       — SDPA, FLASH_ATTENTION backend, ``enable_gqa=True``, on (B, H, L, d) views of the contiguous cache
* ``sdpa-cudnn``       — SDPA, CUDNN_ATTENTION backend, same views
* ``gather+sdpa``      — the paged baseline: gather the pages into a contiguous cache, then SDPA flash
* ``fa3``              — FlashAttention-3's ``flash_attn_with_kvcache`` on the contiguous cache (``fa3_fwd_interface``,
  when importable; ``speedup["fa3"]`` and ``speedup["clean L2: fa3"]`` = t_fa3 / t_ours)
* ``flashtile-graph`` / ``flashtile-paged-graph`` / ``sdpa-flash-graph`` — ``flashtile``, ``flashtile-paged``
  and ``sdpa-flash`` captured in a CUDA graph and replayed: device time without the host
  (``speedup["graph: sdpa-flash"]`` and ``speedup["graph: paged/contiguous"]`` pair them)

Short-cache calls take ~10-30 µs on the device and ~50-100 µs on the host, so
their eager times depend on how much of the host time do_bench's L2 flush
hides, and on the host's noise.  Each provider is therefore timed in
``ROUNDS`` interleaved rounds (every provider once per round), and the point
reports the median of its round medians.

(with Nq = 1 the bottom-right causal mask allows every key, so SDPA runs unmasked.)

Feature points (:data:`FEATURE_POINTS`, ``payload["features"]``; ``--features`` runs only these): a
decoding step that appends its new tokens, causal, with and without the options of
``flash_attn_with_kvcache``, next to FlashAttention-3's ``flash_attn_with_kvcache``
(``fa3_fwd_interface``, when importable; never a dependency) with the same arguments:

* ``rotary``: B 64, 4k cache, 1 token, full-width rotary (interleaved): ``flashtile`` vs
  ``flashtile-rotary`` (``speedup["rotary/plain"]``: the cost of the fused rotary, target <= 5 %),
  ``fa3`` / ``fa3-rotary``;
* ``q_len 4``: B 32, 8k cache, 4 query tokens and 4 new keys (speculative step): ``flashtile``,
  ``fa3``, and our 1-token step on the same cache (``flashtile-1tok``: what packing 4 tokens costs);
* ``q_len 16, Hq 64``: B 8, 8k cache, 16 tokens of a GQA group of 8 (128 packed rows, one 128-row tile).
Throughput is the rate the K/V cache is read, ``2 B L Hk d * 2 bytes / time``,
compared with a device-to-device copy measured in the same run (bytes read
+ written per second): decoding is a streaming read of the cache, so the copy
bandwidth is its practical ceiling.  Two copies: a 2 GB one (``copy_gbps``,
the asymptote) and, per point, one moving the point's own K/V bytes
(``copy_gbps_same_bytes``), which pays the same fixed costs of a timed call.  Ratios: ``speedup[peer] = t_peer / t_ours``
(> 1: we are faster), ``of_copy_bw = GB/s / copy_gbps`` and
``of_copy_bw_same_bytes = GB/s / copy_gbps_same_bytes``.

do_bench empties L2 before each call by writing 256 MB, which leaves the call an
L2 full of someone else's dirty lines to write back (50 MB on an H100: 27%
of the traffic of a 134 MB cache read).  The ``CLEAN_TIMED`` providers are also
timed after a read-only flush (:func:`flashtile.bench.common.median_ms_clean_l2`):
``gbps_clean_l2``, ``of_copy_bw_clean_l2`` (against the 2 GB copy, which that
write-back does not move) and ``speedup["clean L2: sdpa-flash"]``.  That flush
is long (``CLEAN_FLUSH``), so these times are the device's even at short caches,
where an eager call's 50-100 µs of host time would otherwise decide the do_bench
ratio (its rounds there flip between host- and device-bound).

:func:`run_tile_sweep` (``flashtile bench decode --sweep-tiles``) times the split kernel's
tile configurations (BLOCK_N x warps x stages x split counts) under the same clean-L2
timer, each checked against SDPA-flash first, to revisit :func:`~flashtile.runtime.decode.decode_config`
and :func:`~flashtile.runtime.decode.num_splits_heuristic` on a new GPU.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch

from flashtile.bench.common import environment, median_ms, median_ms_clean_l2, rel_err, write_json

__all__ = [
    "run_decode_bench", "run_tile_sweep", "run_fp8_cascade_bench", "copy_bandwidth", "forced_decode", "host_us",
    "PROVIDERS", "GRID", "FEATURE_POINTS", "feature_point",
]

HQ, HK, D, PAGE = 32, 8, 128, 256
GRID = {"batch": (1, 8, 64), "cache": (1024, 4096, 32768, 131072)}
PROVIDERS = (
    "flashtile", "flashtile-paged", "flashtile-pp", "flashtile-kernel", "sdpa-flash", "sdpa-cudnn", "gather+sdpa",
    "flashtile-graph", "flashtile-paged-graph", "sdpa-flash-graph",
)
ROUNDS = 3  # eager medians per provider, taken in interleaved rounds; the point reports their median
HOST_TIMED = ("flashtile", "flashtile-paged", "sdpa-flash")
CLEAN_TIMED = ("flashtile", "flashtile-paged", "flashtile-pp", "sdpa-flash", "sdpa-cudnn", "fa3")  # also timed after a read-only L2 flush
# that flush reads 1 GB (~0.35 ms on an H100): long enough that the host has enqueued the timed call (50-100 us
# on the bench host) before the GPU reaches it, so a short-cache call is timed on the device, not the host
CLEAN_FLUSH = 1 << 30
MEMORY_LIMIT = 60e9  # bytes the three cache copies of a point may take


def copy_bandwidth(nbytes: int = 2 << 30, timer: Callable[[Callable[[], object]], float] = median_ms) -> float:
    """GB/s of ``dst.copy_(src)`` on a ``nbytes`` buffer, counting bytes read + written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _sdpa(backend) -> Callable:
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):  # (B, H, N, d) views
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return run


def _inputs(batch: int, cache: int):
    """q (B, 1, Hq, d), contiguous caches (B, L, Hk, d), and their paged copy (scattered 256-key pages)."""
    q = torch.randn(batch, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, cache, HK, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pages = cache // PAGE
    perm = torch.randperm(batch * pages, device="cuda")
    table = perm.view(batch, pages).to(torch.int32)
    k_pool = torch.empty(batch * pages, PAGE, HK, D, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.empty_like(k_pool)
    k_pool[perm] = k.view(batch * pages, PAGE, HK, D)  # logical page p of b -> physical perm[b * pages + p]
    v_pool[perm] = v.view(batch * pages, PAGE, HK, D)
    lens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
    return q, k, v, k_pool, v_pool, table, lens


def _providers(q, k, v, k_pool, v_pool, table, lens) -> dict[str, Callable[[], torch.Tensor]]:
    """Zero-argument closures returning (B, 1, Hq, d) outputs."""
    from torch.nn.attention import SDPBackend

    from flashtile.ops.kvcache import flash_attn_with_kvcache
    from flashtile.runtime.decode import flash_decode

    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # views, no copies
    flash, cudnn = _sdpa(SDPBackend.FLASH_ATTENTION), _sdpa(SDPBackend.CUDNN_ATTENTION)
    b, pages = table.shape

    def gather_sdpa():
        kg = k_pool[table.long()].view(b, pages * PAGE, HK, D)
        vg = v_pool[table.long()].view(b, pages * PAGE, HK, D)
        return flash(qh, kg.transpose(1, 2), vg.transpose(1, 2)).transpose(1, 2)

    ours = lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True)  # noqa: E731
    paged = lambda: flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lens, block_table=table, causal=True)  # noqa: E731
    sdpa = lambda: flash(qh, kh, vh).transpose(1, 2)  # noqa: E731
    fns = {
        "flashtile": ours,
        "flashtile-paged": paged,
        "flashtile-pp": lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True, unified_max=0.0),
        "flashtile-kernel": lambda: flash_decode(q, k, v, lens, causal=True)[0],
        "sdpa-flash": lambda: flash(qh, kh, vh).transpose(1, 2),
        "sdpa-cudnn": lambda: cudnn(qh, kh, vh).transpose(1, 2),
        "gather+sdpa": gather_sdpa,
        "flashtile-graph": _graphed(ours),
        "flashtile-paged-graph": _graphed(paged),
        "sdpa-flash-graph": _graphed(sdpa),
    }
    fa3, _why = _fa3_kvcache()
    if fa3 is not None:  # FA3's split-KV decode on the same contiguous cache and lengths
        fns["fa3"] = lambda: _first(fa3(q, k, v, cache_seqlens=lens, causal=True))
    return fns


def forced_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, *,
    block_n: int, num_warps: int, num_stages: int, n_splits: int,
) -> Callable[[], torch.Tensor]:
    """A contiguous-cache decode call (safe path, no window) with its tile config forced, for config
    sweeps: ``n_splits`` goes through :func:`~flashtile.runtime.decode.decode_plan` (which sizes the
    merge tile from it), the tile, warps and stages replace the heuristic's.  Returns ``run() -> out``."""
    from flashtile.runtime.decode import DecodeLaunch, aligned16, decode_plan

    b, nq, hq, d = q.shape
    hk = k.shape[2]
    plan = decode_plan(b, nq, hq, hk, d, None, k.shape[1], n_splits, q.device)
    plan = plan._replace(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    launch = DecodeLaunch(plan, b, nq, hq, hk, d, q.dtype, q.stride(), (k.stride(1), v.stride(1)),
                          aligned16(k.stride(0), k.stride(2), v.stride(0), v.stride(2)),
                          None, None, None, -1, -1, False, False,
                          lens.dtype, lens.stride(0), 0, k.shape[0], q.device)

    def run() -> torch.Tensor:
        out = torch.empty_like(q)
        lse = torch.empty(b, hq, nq, device=q.device, dtype=torch.float32)
        launch(q, k, v, lens, None, None, out, lse, None, d ** -0.5, 0.0, None)
        return out

    return run


def _graphed(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``fn`` captured in a CUDA graph (how serving engines run a decoding step): the
    replay has no Python and no launch overhead, so its time is the device's.  Captured
    lazily, on first use, so a provider that fails to capture is reported, not fatal."""
    state: dict = {}

    def run() -> torch.Tensor:
        if not state:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            state["graph"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(state["graph"]):
                state["out"] = fn()
        state["graph"].replay()
        return state["out"]

    return run


def host_us(fn: Callable[[], object], n: int = 200) -> float:
    """Host microseconds per call: wall clock of ``n`` back-to-back calls with no sync
    inside (the device queue absorbs the launches), after one warm call."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def _point(batch: int, cache: int, copy_gbps: float) -> dict:
    kv_bytes = 2 * batch * cache * HK * D * 2
    q, k, v, k_pool, v_pool, table, lens = _inputs(batch, cache)
    fns = _providers(q, k, v, k_pool, v_pool, table, lens)
    ref = None
    row = {"batch": batch, "cache": cache, "kv_bytes": kv_bytes, "ms": {}, "gbps": {}, "err": {}}
    rounds: dict[str, list[float]] = {}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            if name in row["ms"]:  # failed in an earlier round
                continue
            try:
                if name not in rounds:
                    out = fn()
                    torch.cuda.synchronize()
                    row["err"][name] = out
                    if ref is None and name == "sdpa-flash":
                        ref = out
                rounds.setdefault(name, []).append(median_ms(fn))
            except Exception as e:  # a backend may not support GQA / this shape: record why
                row["ms"][name] = None
                row["err"][name] = f"unsupported: {type(e).__name__}: {str(e)[:160]}"
                rounds.pop(name, None)
    for name, times in rounds.items():
        row["ms"][name] = statistics.median(times)
        row["gbps"][name] = kv_bytes / (row["ms"][name] * 1e-3) / 1e9
    row["rounds_ms"] = rounds
    # errors against SDPA flash (or our own contiguous result when SDPA flash is unavailable)
    base = ref if ref is not None else row["err"].get("flashtile")
    for name, out in list(row["err"].items()):
        if isinstance(out, torch.Tensor):
            row["err"][name] = rel_err(out, base) if isinstance(base, torch.Tensor) else None
    mine = row["ms"].get("flashtile")
    row["speedup"] = {
        peer: (t / mine if mine and t else None)
        for peer, t in row["ms"].items()
        if not peer.startswith("flashtile") and not peer.endswith("-graph")
    }
    if row["ms"].get("flashtile-graph") and row["ms"].get("sdpa-flash-graph"):
        row["speedup"]["graph: sdpa-flash"] = row["ms"]["sdpa-flash-graph"] / row["ms"]["flashtile-graph"]
    if row["ms"].get("flashtile-graph") and row["ms"].get("flashtile-paged-graph"):
        row["speedup"]["graph: paged/contiguous"] = row["ms"]["flashtile-graph"] / row["ms"]["flashtile-paged-graph"]
    paged = row["ms"].get("flashtile-paged")
    if paged and row["ms"].get("gather+sdpa"):
        row["speedup"]["paged_vs_gather+sdpa"] = row["ms"]["gather+sdpa"] / paged
    row["of_copy_bw"] = {name: g / copy_gbps for name, g in row["gbps"].items()}
    # the same ceiling at this point's size: a copy whose reads + writes equal the K/V bytes, timed the
    # same way.  do_bench's L2 flush leaves ~L2-size of dirty lines whose write-back overlaps the timed
    # call; over a 2 GB copy that is noise, over a 134 MB cache (B=1, 32k) it is ~20% of the time.
    row["copy_gbps_same_bytes"] = copy_bandwidth(kv_bytes // 2)
    row["of_copy_bw_same_bytes"] = {name: g / row["copy_gbps_same_bytes"] for name, g in row["gbps"].items()}
    # the same providers with L2 flushed by a read (no dirty lines left for the call to write back)
    clean: dict[str, list[float]] = {}
    for _ in range(ROUNDS):
        for name in CLEAN_TIMED:
            if row["ms"].get(name):
                clean.setdefault(name, []).append(median_ms_clean_l2(fns[name], flush_bytes=CLEAN_FLUSH))
    row["ms_clean_l2"] = {name: statistics.median(t) for name, t in clean.items()}
    row["gbps_clean_l2"] = {name: kv_bytes / (ms * 1e-3) / 1e9 for name, ms in row["ms_clean_l2"].items()}
    row["of_copy_bw_clean_l2"] = {name: g / copy_gbps for name, g in row["gbps_clean_l2"].items()}
    row["copy_gbps_same_bytes_clean_l2"] = copy_bandwidth(
        kv_bytes // 2, timer=lambda fn: median_ms_clean_l2(fn, flush_bytes=CLEAN_FLUSH)
    )
    for peer in ("sdpa-flash", "fa3"):
        if row["ms_clean_l2"].get("flashtile") and row["ms_clean_l2"].get(peer):
            row["speedup"][f"clean L2: {peer}"] = row["ms_clean_l2"][peer] / row["ms_clean_l2"]["flashtile"]
    if row["ms_clean_l2"].get("flashtile") and row["ms_clean_l2"].get("flashtile-pp"):
        # FlashDecoding++'s speed against our safe path (> 1: the unified max is faster)
        row["speedup"]["clean L2: unified/safe"] = row["ms_clean_l2"]["flashtile"] / row["ms_clean_l2"]["flashtile-pp"]
    # do_bench flushes L2 before each call, which gives the host a head start of the flush's
    # duration: a call whose host time exceeds it is timed partly on the host.  Reported so
    # that a reader sees which side bounds a short-cache point.
    row["host_us"] = {name: host_us(fns[name]) for name in HOST_TIMED if row["ms"].get(name)}
    del q, k, v, k_pool, v_pool, table, lens, fns, ref, base
    torch.cuda.empty_cache()
    return row


# (name, batch, cache, query tokens = new tokens, rotary, q heads): Hk 8, d 128 throughout
FEATURE_POINTS = (
    ("rotary", 64, 4096, 1, True, HQ), ("q_len 4", 32, 8192, 4, False, HQ), ("q_len 16, Hq 64", 8, 8192, 16, False, 64),
)


def _fa3_kvcache():
    """FA3's ``flash_attn_with_kvcache`` if ``fa3_fwd_interface`` imports, else None and why not."""
    try:
        import fa3_fwd_interface as fa3
    except ImportError as e:
        return None, f"fa3_fwd_interface not importable ({e})"
    return fa3.flash_attn_with_kvcache, None


def feature_point(name: str, batch: int, cache: int, n_tok: int, rotary: bool, hq: int = HQ) -> dict:
    """One :data:`FEATURE_POINTS` entry: do_bench and clean-L2 medians (ms) of each provider, their
    errors against ``flashtile`` with the same arguments, and the ratios."""
    from flashtile.ops.kvcache import flash_attn_with_kvcache

    torch.manual_seed(batch + cache + n_tok)
    dt = torch.bfloat16
    q = torch.randn(batch, n_tok, hq, D, device="cuda", dtype=dt)
    k_cache = torch.randn(batch, cache, HK, D, device="cuda", dtype=dt)
    v_cache = torch.randn_like(k_cache)
    k_new = torch.randn(batch, n_tok, HK, D, device="cuda", dtype=dt)
    v_new = torch.randn_like(k_new)
    lens = torch.full((batch,), cache - n_tok, dtype=torch.int32, device="cuda")  # the step fills the cache
    angle = torch.rand(cache, D // 2, device="cuda") * 6.3
    cos, sin = angle.cos().to(dt), angle.sin().to(dt)
    rot = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=True)
    kw = dict(k=k_new, v=v_new, cache_seqlens=lens, causal=True)
    fns: dict[str, Callable[[], torch.Tensor]] = {
        "flashtile": lambda: flash_attn_with_kvcache(q, k_cache, v_cache, **kw),
    }
    if rotary:
        fns["flashtile-rotary"] = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, **kw, **rot)
    else:
        fns["flashtile-1tok"] = lambda: flash_attn_with_kvcache(
            q[:, :1], k_cache, v_cache, k=k_new[:, :1], v=v_new[:, :1], cache_seqlens=lens, causal=True
        )
    fa3, why = _fa3_kvcache()
    if fa3 is not None:
        first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
        fns["fa3"] = lambda: first(fa3(q, k_cache, v_cache, **kw))
        if rotary:
            fns["fa3-rotary"] = lambda: first(fa3(q, k_cache, v_cache, **kw, **rot))
    row = {"name": name, "batch": batch, "cache": cache, "tokens": n_tok, "rotary": rotary, "heads_q": hq, "ms": {}, "ms_clean_l2": {},
           "err": {}, "unavailable": {} if fa3 is not None else {"fa3": why}}
    outs = {}
    for prov, fn in fns.items():
        try:
            outs[prov] = fn().float()
            torch.cuda.synchronize()
            row["ms"][prov] = median_ms(fn)
            row["ms_clean_l2"][prov] = median_ms_clean_l2(fn, flush_bytes=CLEAN_FLUSH)
        except Exception as e:  # noqa: BLE001 - a peer may reject these arguments: recorded
            row["unavailable"][prov] = f"{type(e).__name__}: {str(e)[:160]}"
    # each call appends the same rows again, so every output is that of the same cache contents
    same_args = {"fa3": "flashtile", "fa3-rotary": "flashtile-rotary"}
    for prov, base in same_args.items():
        if prov in outs and base in outs:
            row["err"][prov] = rel_err(outs[prov], outs[base])
    t, c = row["ms"], row["ms_clean_l2"]
    ratios = {}
    for label, num, den in (("rotary/plain", "flashtile-rotary", "flashtile"), ("fa3", "fa3", "flashtile"),
                            ("fa3-rotary", "fa3-rotary", "flashtile-rotary"), ("4tok/1tok", "flashtile", "flashtile-1tok")):
        if num in c and den in c:
            # rotary/plain and 4tok/1tok: our time with / without (> 1: slower); fa3*: t_fa3 / t_ours (> 1: we are faster)
            ratios[label] = c[num] / c[den]
            ratios[f"do_bench: {label}"] = t[num] / t[den]
    row["speedup"] = ratios
    del q, k_cache, v_cache, k_new, v_new, outs, fns
    torch.cuda.empty_cache()
    return row


def run_decode_bench(out_dir, progress: Callable[[str], None] | None = None, *, features_only: bool = False) -> dict:
    """Run the grid and the :data:`FEATURE_POINTS` on the current GPU (only the latter with
    ``features_only``), write ``decode_<device>_<date>.json`` (``decode_features_...``) to
    ``out_dir``, return the payload."""
    if not torch.cuda.is_available():
        raise RuntimeError("`flashtile bench decode` needs a CUDA GPU")
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth()
    points, skipped = [], []
    for batch in () if features_only else GRID["batch"]:
        for cache in GRID["cache"]:
            need = 3 * 2 * batch * cache * HK * D * 2
            free = torch.cuda.mem_get_info()[0]
            if need > min(MEMORY_LIMIT, 0.9 * free):
                skipped.append({"batch": batch, "cache": cache, "bytes_needed": need})
                continue
            if progress:
                progress(f"decode B={batch} L={cache}")
            points.append(_point(batch, cache, copy_gbps))
    features = []
    for point in FEATURE_POINTS:
        if progress:
            progress(f"decode feature {point[0]} B={point[1]} L={point[2]}")
        features.append(feature_point(*point))
    payload = {
        "env": environment(),
        "shape": {"dtype": "bfloat16", "heads_q": HQ, "heads_k": HK, "head_dim": D, "seqlen_q": 1, "page_size": PAGE},
        "providers": list(PROVIDERS),
        "copy_gbps": copy_gbps,
        "throughput_convention": "GB/s = 2*B*L*Hk*d*2 bytes (K+V read once) / time; copy = bytes read+written / time",
        "ratio_convention": (
            "speedup[peer] = t_peer / t_flashtile; of_copy_bw = GB/s / copy GB/s (2 GB copy); "
            "of_copy_bw_same_bytes = GB/s / GB/s of a copy moving the point's K/V bytes"
        ),
        "points": points,
        "skipped": skipped,
        "features": features,
        "features_convention": (
            "ms: do_bench medians; ms_clean_l2: after a 1 GB read-only flush; speedup[rotary/plain] and [4tok/1tok] "
            "= our time with / without (clean L2); speedup[fa3*] = t_fa3 / t_ours; err: relative error against "
            "flashtile with the same arguments"
        ),
    }
    payload["path"] = str(write_json(payload, out_dir, "decode_features" if features_only else "decode"))
    return payload


SWEEP_POINTS = ((1, 4096), (1, 32768), (1, 131072), (8, 4096), (8, 32768), (64, 4096))
SWEEP_TILES = {"block_n": (64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4), "splits": (0.5, 1, 2)}


def run_tile_sweep(
    out_dir, progress: Callable[[str], None] | None = None, points=SWEEP_POINTS, tiles: dict = SWEEP_TILES,
) -> dict:
    """Time every split-kernel config of ``tiles`` (split counts as multiples of the heuristic's)
    at ``points`` (batch, cache) of the bench's shape, contiguous cache, clean-L2 device times; write
    ``decode_tiles_<device>.json`` to ``out_dir`` and return the payload.  Each config's output is
    checked against SDPA-flash first (relative error < 2e-2); a config that fails to compile or to
    match is recorded with its error.  ``best`` per point lists the five fastest configs next to the
    heuristic's."""
    import itertools

    from torch.nn.attention import SDPBackend

    from flashtile.runtime.decode import MAX_SPLITS, decode_plan

    if not torch.cuda.is_available():
        raise RuntimeError("`flashtile bench decode --sweep-tiles` needs a CUDA GPU")
    flash = _sdpa(SDPBackend.FLASH_ATTENTION)
    timer = lambda fn: median_ms_clean_l2(fn, flush_bytes=CLEAN_FLUSH) * 1e3  # noqa: E731
    copy_gbps = copy_bandwidth(timer=lambda fn: median_ms_clean_l2(fn, flush_bytes=CLEAN_FLUSH))
    rows = []
    for batch, cache in points:
        if progress:
            progress(f"tile sweep B={batch} L={cache}")
        torch.manual_seed(batch + cache)
        q, k, v, _, _, _, lens = _inputs(batch, cache)
        ref = flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        base = decode_plan(batch, 1, HQ, HK, D, None, cache, 0, q.device)
        kv_bytes = 2 * batch * cache * HK * D * 2
        sdpa_us = timer(lambda: flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))
        configs = []
        grid = itertools.product(*(tiles[k_] for k_ in SWEEP_TILES))
        for block_n, warps, stages, mult in grid:
            splits = max(1, min(MAX_SPLITS, int(base.n_splits * mult)))
            rec = {"block_n": block_n, "num_warps": warps, "num_stages": stages, "splits": splits}
            try:
                run = forced_decode(q, k, v, lens, block_n=block_n, num_warps=warps, num_stages=stages, n_splits=splits)
                rec["err"] = rel_err(run(), ref)
                if not rec["err"] < 2e-2:
                    raise AssertionError(f"relative error {rec['err']:.2e} against SDPA-flash")
                rec["us"] = timer(run)
                rec["of_copy_bw"] = kv_bytes / (rec["us"] * 1e-6) / 1e9 / copy_gbps
                rec["vs_sdpa_flash"] = sdpa_us / rec["us"]
            except Exception as e:  # noqa: BLE001 - resources, compile errors, wrong results: recorded
                rec["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            configs.append(rec)
        heuristic = {"block_n": base.block_n, "num_warps": base.num_warps, "num_stages": base.num_stages,
                     "splits": base.n_splits}
        timed = sorted((c for c in configs if "us" in c), key=lambda c: c["us"])
        rows.append({
            "batch": batch, "cache": cache, "kv_bytes": kv_bytes, "sdpa_flash_us": sdpa_us, "heuristic": heuristic,
            "heuristic_us": next((c["us"] for c in timed if all(c[k_] == v_ for k_, v_ in heuristic.items())), None),
            "best": timed[:5], "configs": configs,
        })
        del q, k, v, lens, ref
        torch.cuda.empty_cache()
    payload = {
        "env": environment(),
        "shape": {"dtype": "bfloat16", "heads_q": HQ, "heads_k": HK, "head_dim": D, "seqlen_q": 1},
        "tiles": {k_: list(tiles[k_]) for k_ in SWEEP_TILES},
        "timer": f"median_ms_clean_l2, {CLEAN_FLUSH >> 20} MB read flush",
        "copy_gbps_clean_l2": copy_gbps,
        "points": rows,
    }
    payload["path"] = str(write_json(payload, out_dir, "decode_tiles"))
    return payload


# --------------------------------------------------------------------------- #
# FP8 KV cache and shared-prefix (cascade) decoding
# --------------------------------------------------------------------------- #
FP8_POINTS = ((1, 32768), (1, 131072), (8, 32768), (8, 131072))
FP8_PROVIDERS = ("flashtile-bf16", "flashtile-fp8", "flashtile-fp8-paged", "flashtile-fp8-graph", "sdpa-flash",
                 "fa3-bf16", "fa3-fp8")
CASCADE_POINT = {"batch": 64, "prefix": 32768, "own": 1024}
CASCADE_PREFIX_SPLITS = (0, 8, 16, 32)  # prefix_num_splits of the cascade's prefix launch (0: heuristic)


def _timed(fns: dict, ref: torch.Tensor | None, kv_bytes_of: dict) -> dict:
    """Clean-L2 device ms of every provider (after one checked call), GB/s of its cache bytes, and its
    error against ``ref``; a provider that raises is recorded with its reason."""
    row = {"ms": {}, "gbps": {}, "err": {}}
    for name, fn in fns.items():
        try:
            out = fn()
            torch.cuda.synchronize()
            row["err"][name] = rel_err(out, ref) if ref is not None else None
            row["ms"][name] = statistics.median(
                median_ms_clean_l2(fn, flush_bytes=CLEAN_FLUSH) for _ in range(ROUNDS)
            )
            if name in kv_bytes_of:
                row["gbps"][name] = kv_bytes_of[name] / (row["ms"][name] * 1e-3) / 1e9
        except Exception as e:  # noqa: BLE001 - a peer may not support the shape or dtype: recorded
            row["ms"][name] = None
            row["err"][name] = f"unsupported: {type(e).__name__}: {str(e)[:160]}"
    return row


def _fp8_point(batch: int, cache: int) -> dict:
    from torch.nn.attention import SDPBackend

    from flashtile.fp8 import quantize_per_head
    from flashtile.ops.kvcache import flash_attn_with_kvcache

    q, k, v, k_pool, v_pool, table, lens = _inputs(batch, cache)
    k8, kd = quantize_per_head(k, layout="bnhd")
    v8, vd = quantize_per_head(v, layout="bnhd")
    del k_pool, v_pool
    # the paged FP8 pool holds the contiguous cache's e4m3 pages (same (B, Hk) descales) in the table's order;
    # copied as bytes (index_put of float8 is not implemented on every torch build)
    k8p, v8p = torch.empty_like(k8).view(-1, PAGE, HK, D), torch.empty_like(v8).view(-1, PAGE, HK, D)
    k8p.view(torch.uint8)[table.flatten().long()] = k8.view(torch.uint8).view(-1, PAGE, HK, D)
    v8p.view(torch.uint8)[table.flatten().long()] = v8.view(torch.uint8).view(-1, PAGE, HK, D)
    flash = _sdpa(SDPBackend.FLASH_ATTENTION)
    fa3, fa3_missing = _fa3_kvcache()
    fp8 = lambda: flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, causal=True, k_descale=kd, v_descale=vd)  # noqa: E731
    fns = {
        "flashtile-bf16": lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True),
        "flashtile-fp8": fp8,
        "flashtile-fp8-paged": lambda: flash_attn_with_kvcache(
            q, k8p, v8p, cache_seqlens=lens, block_table=table, causal=True, k_descale=kd, v_descale=vd),
        "flashtile-fp8-graph": _graphed(fp8),
        "sdpa-flash": lambda: flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2),
    }
    if fa3 is not None:
        q8, qd = quantize_per_head(q, layout="bnhd", kv_heads=HK)  # FA3's FP8 kernel takes e4m3 q too
        fns["fa3-bf16"] = lambda: _first(fa3(q, k, v, cache_seqlens=lens, causal=True))
        fns["fa3-fp8"] = lambda: _first(fa3(q8, k8, v8, cache_seqlens=lens, causal=True,
                                             q_descale=qd, k_descale=kd, v_descale=vd))
    bytes16 = 2 * batch * cache * HK * D * 2
    kv_bytes = {name: bytes16 // 2 if "fp8" in name else bytes16 for name in fns}
    ref = flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True)
    row = {"batch": batch, "cache": cache, **_timed(fns, ref, kv_bytes)}
    if fa3 is None:
        row["ms"]["fa3-bf16"] = row["ms"]["fa3-fp8"] = None
        row["err"]["fa3-bf16"] = row["err"]["fa3-fp8"] = fa3_missing
    ms = row["ms"]
    row["speedup"] = {
        name: ms[name] / ms["flashtile-fp8"] for name in ms if ms.get(name) and ms.get("flashtile-fp8") and name != "flashtile-fp8"
    }
    del q, k, v, k8, v8, k8p, v8p, table, lens, fns, ref
    torch.cuda.empty_cache()
    return row


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _cascade_point(batch: int, prefix: int, own: int) -> dict:
    """``batch`` requests sharing ``prefix`` keys, each with ``own`` keys of its own (+1 appended per step is not
    timed: the caches are read-only here), bf16, Hq 32 / Hk 8 / d 128, one query token, causal."""
    from flashtile.ops.cascade import cascade_attention_with_kvcache
    from flashtile.ops.kvcache import flash_attn_with_kvcache

    dev = "cuda"
    q = torch.randn(batch, 1, HQ, D, device=dev, dtype=torch.bfloat16)
    pk = torch.randn(1, prefix, HK, D, device=dev, dtype=torch.bfloat16)
    pv = torch.randn_like(pk)
    kc = torch.randn(batch, own, HK, D, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lens = torch.full((batch,), own, dtype=torch.int32, device=dev)
    # unshared, contiguous: each request holds its own copy of the prefix
    k_full = torch.cat([pk.expand(batch, -1, -1, -1), kc], dim=1)
    v_full = torch.cat([pv.expand(batch, -1, -1, -1), vc], dim=1)
    full_lens = torch.full((batch,), prefix + own, dtype=torch.int32, device=dev)
    # unshared, paged: every block table points at the same prefix pages (shared memory, read per request)
    pp, po = prefix // PAGE, own // PAGE
    k_pool = torch.cat([pk.view(pp, PAGE, HK, D), kc.reshape(batch * po, PAGE, HK, D)])
    v_pool = torch.cat([pv.view(pp, PAGE, HK, D), vc.reshape(batch * po, PAGE, HK, D)])
    table = torch.cat([
        torch.arange(pp, device=dev).expand(batch, pp),
        pp + torch.arange(batch * po, device=dev).view(batch, po),
    ], dim=1).to(torch.int32)

    def cascade(splits=0):
        return lambda: cascade_attention_with_kvcache(  # noqa: E731
            q, pk, pv, kc, vc, cache_seqlens=lens, causal=True, prefix_num_splits=splits)

    unshared = lambda: flash_attn_with_kvcache(q, k_full, v_full, cache_seqlens=full_lens, causal=True)  # noqa: E731
    paged = lambda: flash_attn_with_kvcache(  # noqa: E731
        q, k_pool, v_pool, cache_seqlens=full_lens, block_table=table, causal=True)
    fns = {f"cascade-splits{s}" if s else "cascade": cascade(s) for s in CASCADE_PREFIX_SPLITS}
    fns.update({
        "cascade-graph": _graphed(cascade()),
        "unshared": unshared,
        "unshared-graph": _graphed(unshared),
        "unshared-paged-shared-pages": paged,
    })
    ref = unshared()
    bytes_unshared = 2 * batch * (prefix + own) * HK * D * 2
    row = {"batch": batch, "prefix": prefix, "own": own, **_timed(fns, ref, {"unshared": bytes_unshared})}
    ms = row["ms"]
    row["speedup"] = {  # > 1: the cascade is faster
        peer: ms[peer] / ms["cascade"]
        for peer in ("unshared", "unshared-paged-shared-pages") if ms.get(peer) and ms.get("cascade")
    }
    if ms.get("cascade-graph") and ms.get("unshared-graph"):
        row["speedup"]["graph: unshared"] = ms["unshared-graph"] / ms["cascade-graph"]
    best = min((ms[n], n) for n in fns if n.startswith("cascade") and ms.get(n))
    row["best_cascade"] = {"name": best[1], "ms": best[0], "speedup_vs_unshared": (ms.get("unshared") or 0) / best[0]}
    del q, pk, pv, kc, vc, k_full, v_full, k_pool, v_pool, fns, ref
    torch.cuda.empty_cache()
    return row


def run_fp8_cascade_bench(out_dir, progress: Callable[[str], None] | None = None) -> dict:
    """``flashtile bench decode --fp8-cascade``: the FP8-cache points (``FP8_POINTS``: FP8 vs bf16 cache,
    contiguous and paged, FA3 as a peer when importable) and the cascade point (``CASCADE_POINT``:
    shared vs unshared), clean-L2 device times; writes ``decode_fp8_cascade_<device>.json``."""
    if not torch.cuda.is_available():
        raise RuntimeError("`flashtile bench decode --fp8-cascade` needs a CUDA GPU")
    torch.manual_seed(0)
    fp8_rows = []
    for batch, cache in FP8_POINTS:
        if progress:
            progress(f"fp8 cache B={batch} L={cache}")
        fp8_rows.append(_fp8_point(batch, cache))
    if progress:
        progress("cascade {batch} x ({prefix} shared + {own} own)".format(**CASCADE_POINT))
    cascade = _cascade_point(**CASCADE_POINT)
    payload = {
        "env": environment(),
        "shape": {"dtype": "bfloat16 q/out", "heads_q": HQ, "heads_k": HK, "head_dim": D, "seqlen_q": 1, "page_size": PAGE},
        "timer": f"median_ms_clean_l2, {CLEAN_FLUSH >> 20} MB read flush, median of {ROUNDS} rounds",
        "ratio_convention": "speedup[peer] = t_peer / t_ours (fp8: t / t_flashtile-fp8; cascade: t / t_cascade)",
        "err_convention": "relative L2 error against flashtile on the bf16 cache (fp8) / the unshared call (cascade)",
        "fp8_points": fp8_rows,
        "cascade": cascade,
    }
    payload["path"] = str(write_json(payload, out_dir, "decode_fp8_cascade"))
    return payload


if __name__ == "__main__":  # pragma: no cover - convenience entry point on a GPU machine
    import sys

    res = run_decode_bench(sys.argv[1] if len(sys.argv) > 1 else "bench/results", progress=print)
    for p in res["points"]:
        best = {k: round(v, 1) for k, v in p["gbps"].items()}
        print(p["batch"], p["cache"], best, {k: (round(v, 2) if v else v) for k, v in p["speedup"].items()})
    print("copy GB/s", round(res["copy_gbps"], 1), "->", res["path"])
    sys.exit(0 if math.isfinite(res["copy_gbps"]) else 1)
