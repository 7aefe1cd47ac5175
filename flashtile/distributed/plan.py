"""Which kernel calls one ring step makes: pure Python on sizes, cached per signature.

Positions.  The full sequence of ``P * n`` tokens is cut by a *layout* into each rank's
shard, a list of segments ``(global_start, local_start, length)``:

* ``contiguous``: rank r holds tokens ``[r n, (r + 1) n)``;
* ``zigzag``: the sequence is cut into 2P chunks of ``c = n / 2`` tokens and rank r holds
  chunks r and 2P - 1 - r (in that order), so that under a causal mask every rank owns one
  early and one late chunk and every ring step costs the same (Brandon et al. 2023,
  "Striped Attention"; the zigzag form of ring-flash-attention).

Mask.  Global key position ``kp`` is visible to global query position ``qp`` iff
``Nk - Nq - left <= kp - qp <= Nk - Nq + right`` (flash-attn's bottom-right-aligned
window over the *full* sequences, -1 = unbounded; causal is right = 0).  Inside one
pair of segments ``kp - qp = (j - i) + delta`` with i, j local row / column indices, so
the visible set is a band of constant ``j - i``: exactly what one FA2 kernel call with a
window computes (the kernel's band is ``j' - i' in [Nk' - Nq' - wl, Nk' - Nq' + wr]`` in
the call's own coordinates).  A step's plan is the fewest such calls (one for every step
of the plain causal and non-causal layouts) that cover every visible pair of (this rank's
queries, the visiting K/V block) exactly once.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

__all__ = ["LAYOUTS", "Call", "segments", "step_plan", "visible_pairs"]

LAYOUTS = ("zigzag", "contiguous")


class Call(NamedTuple):
    """One kernel call: query rows [r0, r1) of this rank against key rows [c0, c1) of the visiting block,
    with the kernel window (wl, wr) in the call's own bottom-right-aligned coordinates (-1 = unbounded)."""

    r0: int
    r1: int
    c0: int
    c1: int
    wl: int
    wr: int


def segments(layout: str, world: int, rank: int, n: int) -> tuple[tuple[int, int, int], ...]:
    """Rank ``rank``'s ``(global_start, local_start, length)`` segments of a shard of ``n`` tokens."""
    if layout == "contiguous":
        return ((rank * n, 0, n),)
    c = n // 2
    return ((rank * c, 0, c), ((2 * world - 1 - rank) * c, c, c))


def _clip(lo: float, hi: float, a: float, b: float) -> tuple[float, float] | None:
    lo, hi = max(lo, a), min(hi, b)
    return (lo, hi) if lo <= hi else None


def _pair_box(rows: tuple[int, int], cols: tuple[int, int], band: tuple[float, float]):
    """Bounding box ((i0, i1), (j0, j1)) of the band ``j - i in band`` inside rows x cols, or None."""
    (i0, i1), (j0, j1) = rows, cols
    if i0 >= i1 or j0 >= j1:
        return None
    lo, hi = band
    ri = _clip(j0 - hi, j1 - 1 - lo, i0, i1 - 1)
    rj = _clip(i0 + lo, i1 - 1 + hi, j0, j1 - 1)
    if ri is None or rj is None or _clip(lo, hi, j0 - (i1 - 1), (j1 - 1) - i0) is None:
        return None
    return (int(ri[0]), int(ri[1]) + 1), (int(rj[0]), int(rj[1]) + 1)


def _same_mask(rows, cols, want: tuple[float, float], have: tuple[float, float]) -> bool:
    """Whether bands ``want`` and ``have`` on ``j - i`` select the same cells of rows x cols."""
    (i0, i1), (j0, j1) = rows, cols
    if i0 >= i1 or j0 >= j1:
        return True
    a, b = j0 - (i1 - 1), (j1 - 1) - i0  # every value of j - i in the box, and only those
    return _clip(*want, a, b) == _clip(*have, a, b)


def _one_call(pairs, box) -> Call | None:
    """A single call over ``box`` that reproduces every pair's band, or None."""
    (r0, r1), (c0, c1) = box
    candidates = {pair_band for pair_band, _, _ in pairs} | {(-math.inf, math.inf)}
    for band in sorted(candidates):
        ok = all(
            _same_mask((max(r[0], r0), min(r[1], r1)), (max(c[0], c0), min(c[1], c1)), want, band)
            for want, r, c in pairs
        )
        if not ok:
            continue
        # in the call's coordinates i' = i - r0, j' = j - c0: j' - i' = (j - i) - c0 + r0
        lo, hi = band[0] - c0 + r0, band[1] - c0 + r0
        shift = (c1 - c0) - (r1 - r0)
        wl = -1 if lo == -math.inf or shift - lo >= c1 - c0 else int(shift - lo)
        wr = -1 if hi == math.inf or hi - shift >= r1 - r0 else int(hi - shift)
        # box is the bounding box of the visible cells, so the bottom-right diagonal lies in the band
        if wl < -1 or wr < -1:
            continue
        return Call(r0, r1, c0, c1, wl, wr)
    return None


def _union(boxes):
    return (min(b[0][0] for b in boxes), max(b[0][1] for b in boxes)), (
        min(b[1][0] for b in boxes), max(b[1][1] for b in boxes))


@lru_cache(maxsize=4096)
def step_plan(
    layout: str, world: int, rank: int, src: int, nq: int, nk: int, left: int, right: int
) -> tuple[Call, ...]:
    """The kernel calls of rank ``rank`` against the K/V block of rank ``src``.

    ``nq`` / ``nk``: tokens per rank (zigzag: even); ``left`` / ``right``: the global window,
    -1 unbounded (causal: right = 0).  Visible pairs are covered exactly once; an empty plan
    means the step is skipped.
    """
    offset = world * nk - world * nq  # bottom-right alignment of the full sequences
    lo = -math.inf if left < 0 else offset - left
    hi = math.inf if right < 0 else offset + right
    qsegs = segments(layout, world, rank, nq)
    ksegs = segments(layout, world, src, nk)
    per_q = []  # for each q segment: [(band on j - i, rows, cols, visible box)]
    for qg, ql, qn in qsegs:
        row = []
        for kg, kl, kn in ksegs:
            delta = (kg - kl) - (qg - ql)
            band = (lo - delta, hi - delta)
            rows, cols = (ql, ql + qn), (kl, kl + kn)
            row.append((band, rows, cols, _pair_box(rows, cols, band)))
        per_q.append(row)
    live = [p for row in per_q for p in row if p[3] is not None]
    if not live:
        return ()
    every = [(band, rows, cols) for row in per_q for band, rows, cols, _ in row]
    call = _one_call(every, _union([p[3] for p in live]))
    if call is not None:
        return (call,)
    calls = []
    for row in per_q:
        row_live = [p for p in row if p[3] is not None]
        if not row_live:
            continue
        call = _one_call([(band, rows, cols) for band, rows, cols, _ in row], _union([p[3] for p in row_live]))
        if call is not None:
            calls.append(call)
            continue
        for band, rows, cols, box in row_live:
            call = _one_call([(band, rows, cols)], box)
            assert call is not None, "a single band always fits its own bounding box"
            calls.append(call)
    return tuple(calls)


def visible_pairs(call: Call) -> list[tuple[int, int]]:
    """The (local row, local column) pairs a call computes, by the kernel's rule (for tests)."""
    nr, nc = call.r1 - call.r0, call.c1 - call.c0
    shift = nc - nr
    return [
        (call.r0 + i, call.c0 + j)
        for i in range(nr)
        for j in range(nc)
        if (call.wl < 0 or j >= i + shift - call.wl) and (call.wr < 0 or j <= i + shift + call.wr)
    ]
