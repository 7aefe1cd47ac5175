"""`flashtile bench banded`: sliding windows and softcap on Hopper, forward.

Per (head dim, N, window, softcap) point, bf16, B·N = 16k tokens, H·d = 2048, inputs in flash-attn's (B, N, H, d)
layout, the providers:

* ``flashtile``: ``flash_attn_func`` as dispatched (windows and softcap run the FA2 kernel today);
* ``hopper-banded``: the Triton Hopper kernel's banded forward (:func:`flashtile.runtime.fa3_fwd.fa3_forward` with
  ``window_size`` / ``softcap``), the candidate for the dispatch;
* ``flex``: FlexAttention with the same mask (``mask_mod``) and softcap (``score_mod``), compiled per shape;
* ``fa3``: FA3's forward where its wheel imports and the point has no window (the wheel has none), softcap only.

Each provider's output is first checked against fp32 attention on sampled rows (2 heads, 256 rows; within 2e-2
relative), then the providers that pass are timed in interleaved rounds (``bench.common.time_rounds``).  TFLOP/s
count the visible (query, key) pairs exactly: 4·B·H·d·pairs / time.  Window semantics are flash-attn's (bottom-right
aligned; ``causal`` is the window (left, 0)).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from flashtile.bench.common import check_row, environment, median_ms, time_rounds

__all__ = ["PROVIDERS", "visible_pairs", "run_banded"]

PROVIDERS = ("flashtile", "hopper-banded", "flex", "fa3")


def visible_pairs(nq: int, nk: int, left: int, right: int) -> int:
    """(query, key) pairs with ``i + Nk - Nq - left <= j <= i + Nk - Nq + right`` (-1 unbounded), 0 <= j < Nk."""
    shift = nk - nq
    total = 0
    for i in range(nq):
        lo = 0 if left < 0 else max(0, i + shift - left)
        hi = nk - 1 if right < 0 else min(nk - 1, i + shift + right)
        total += max(0, hi - lo + 1)
    return total


def _reference_rows(q, k, v, left: int, right: int, softcap: float, heads: int = 2, rows: int = 256):
    """fp32 attention of batch 0, the first ``heads`` heads, ``rows`` evenly spaced query rows: ``(ref, idx)``,
    ref (heads, len(idx), d); an output o (B, N, H, d) compares as ``o[0, idx, :heads].transpose(0, 1)``."""
    n, nk, d = q.shape[1], k.shape[1], q.shape[3]
    qs, ks, vs = (x[0, :, :heads].float().transpose(0, 1) for x in (q, k, v))
    idx = torch.linspace(0, n - 1, min(rows, n), device=q.device).long()
    s = qs[:, idx] @ ks.transpose(-1, -2) / math.sqrt(d)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    j = torch.arange(nk, device=q.device)[None, :]
    i = idx[:, None] + (nk - n)
    seen = torch.ones_like(s[0], dtype=torch.bool)
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    s = s.masked_fill(~seen, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ vs, idx


def _providers(names, left: int, right: int, softcap: float) -> dict[str, Callable]:
    """``name -> fn(q, k, v)`` on (B, N, H, d) tensors, the point's window and softcap bound in."""
    from flashtile import flash_attn_func
    from flashtile.runtime.fa3_fwd import fa3_forward

    causal = right == 0 and left < 0
    window = (left, right)
    out = {}
    for name in names:
        if name == "flashtile":
            out[name] = lambda q, k, v: flash_attn_func(q, k, v, window_size=window, softcap=softcap)
        elif name == "hopper-banded":
            def banded(q, k, v):
                t = lambda x: x.transpose(1, 2)  # noqa: E731 - the kernel's (B, H, N, d) views
                return t(fa3_forward(t(q), t(k), t(v), softmax_scale=q.shape[-1] ** -0.5, window_size=window,
                                     softcap=softcap)[0])
            out[name] = banded
        elif name == "flex":
            out[name] = _flex(left, right, softcap)
        elif name == "fa3":
            out[name] = _fa3(left, right, causal, softcap)
        else:
            raise ValueError(f"unknown provider {name!r}; choose from {PROVIDERS}")
    return out


def _flex(left: int, right: int, softcap: float):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks: dict = {}

    def run(q, k, v):
        n, nk = q.shape[1], k.shape[1]
        shift = nk - n

        def mask_mod(b, h, qi, kj):
            seen = kj >= 0
            if left >= 0:
                seen = seen & (kj >= qi + shift - left)
            if right >= 0:
                seen = seen & (kj <= qi + shift + right)
            return seen

        def cap_mod(score, b, h, qi, kj):
            return softcap * torch.tanh(score / softcap)

        if (n, nk) not in masks:
            masks[(n, nk)] = create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=nk, device=q.device)
        return compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=masks[(n, nk)],
                        score_mod=cap_mod if softcap > 0 else None).transpose(1, 2)

    return run


def _fa3(left: int, right: int, causal: bool, softcap: float):
    def run(q, k, v):
        if (left, right) not in ((-1, -1), (-1, 0)):
            raise NotImplementedError("the FA3 wheel has no sliding window")
        import fa3_fwd_interface as fa3

        out = fa3.flash_attn_func(q, k, v, causal=causal, softcap=softcap)
        return out[0] if isinstance(out, tuple) else out

    return run


def _point_rows(d, n, b, h, left, right, softcap, q, k, v, providers: dict, rounds: int, progress=None):
    ref, idx = _reference_rows(q, k, v, left, right, softcap)
    flops = 4.0 * b * h * d * visible_pairs(n, k.shape[1], left, right)
    rows, timed = [], []
    for name, fn in providers.items():
        row = dict(head_dim=d, seqlen=n, batch=b, heads=h, window=[left, right], softcap=softcap, provider=name)
        rows.append(row)
        if progress:
            progress(f"d={d} N={n} window=({left}, {right}) softcap={softcap} {name}")
        got = []

        def call(fn=fn, got=got):
            got[:] = [fn(q, k, v)]

        check_row(row, call, lambda got=got: [got[0][0, idx, :2].transpose(0, 1)], [ref], timed, against="fp32")
    time_rounds(timed, rounds, flops, timer=median_ms)
    return rows


def run_banded(grid, providers=PROVIDERS, rounds: int = 3, progress=None) -> dict:
    """The payload ``{env, rows}`` over ``grid`` ((d, N, left, right, softcap) tuples); needs an sm_90 GPU."""
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise RuntimeError("`flashtile bench banded` needs an sm_90 (Hopper) GPU")
    rows = []
    for d, n, left, right, softcap in grid:
        b, h = max(1, 16384 // n), max(1, 2048 // d)
        gen = torch.Generator(device="cuda").manual_seed(n + d + 11)
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        with torch.no_grad():
            rows.extend(_point_rows(d, n, b, h, left, right, softcap, q, k, v,
                                    _providers(providers, left, right, softcap), rounds, progress))
        torch.cuda.empty_cache()
    return {"env": environment(), "flops_convention": "4*B*H*d*(visible query-key pairs)", "rows": rows}
