"""The block ranges of kernels/block_info.py against a brute-force enumeration of visible (row, key) pairs.

CPU (Triton's interpreter): a small kernel writes each tile's ``(lo, full_lo, full_hi, hi)``.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from flashtile.kernels.block_info import kv_block_range, q_block_range


@triton.jit
def _ranges_kernel(
    Out, seqlen_q, seqlen_k, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    KV_SIDE: tl.constexpr,
):
    t = tl.program_id(0)
    if KV_SIDE:  # tile t of the queries: its key range
        r = kv_block_range(t * BLOCK_M, t * BLOCK_M + BLOCK_M, seqlen_q, seqlen_k, window_left, window_right,
                           BLOCK_N, HAS_LEFT, HAS_RIGHT)
    else:  # tile t of the keys: its query range
        r = q_block_range(t * BLOCK_N, t * BLOCK_N + BLOCK_N, seqlen_q, seqlen_k, window_left, window_right,
                          BLOCK_M, HAS_LEFT, HAS_RIGHT)
    tl.store(Out + 4 * t + 0, r[0])
    tl.store(Out + 4 * t + 1, r[1])
    tl.store(Out + 4 * t + 2, r[2])
    tl.store(Out + 4 * t + 3, r[3])


def _ranges(nq, nk, left, right, bm, bn, kv_side):
    tiles = -(-nq // bm) if kv_side else -(-nk // bn)
    out = torch.full((tiles, 4), -7, dtype=torch.int32)
    _ranges_kernel[(tiles,)](out, nq, nk, left, right, BLOCK_M=bm, BLOCK_N=bn, HAS_LEFT=left >= 0,
                             HAS_RIGHT=right >= 0, KV_SIDE=kv_side)
    return out.tolist()


def _visible(i, j, nq, nk, left, right):
    d = i + nk - nq
    return (left < 0 or j >= d - left) and (right < 0 or j <= d + right)


def _check(nq, nk, left, right, bm, bn):
    vis = {(i, j) for i in range(nq) for j in range(nk) if _visible(i, j, nq, nk, left, right)}
    for kv_side, (outer, inner) in ((True, (bm, bn)), (False, (bn, bm))):
        n_outer, n_inner = (nq, nk) if kv_side else (nk, nq)
        for t, (lo, full_lo, full_hi, hi) in enumerate(_ranges(nq, nk, left, right, bm, bn, kv_side)):
            ctx = (nq, nk, left, right, bm, bn, "kv" if kv_side else "q", t, (lo, full_lo, full_hi, hi))
            assert 0 <= lo <= full_lo <= full_hi <= max(hi, lo) and hi <= n_inner, ctx
            assert lo % inner == 0, ctx
            rows = range(t * outer, min(t * outer + outer, n_outer))
            pair = (lambda a, b: (a, b)) if kv_side else (lambda a, b: (b, a))
            visited = set(range(lo, max(hi, lo), inner))
            for start in range(0, n_inner, inner):
                cols = range(start, min(start + inner, n_inner))
                seen = [pair(a, b) in vis for a in rows for b in cols]
                if start not in visited:
                    assert not any(seen), ("visible pair in a skipped tile", start, ctx)
                if full_lo <= start < full_hi:
                    # key tiles of the band lie inside Nk; a query block may pass Nq (padding rows are never stored)
                    assert (start + inner <= n_inner or not kv_side) and all(seen), ("masked pair in the band", start, ctx)
            # every visible pair lies in a visited tile, and below hi
            for a in rows:
                for b in range(n_inner):
                    if pair(a, b) in vis:
                        assert lo <= b < hi, ("visible pair outside [lo, hi)", a, b, ctx)


def test_block_ranges_match_brute_force():
    windows = [(-1, -1), (-1, 0), (0, 0), (3, 0), (-1, 5), (20, 7), (2, -1), (0, -1), (40, 40), (1, 1)]
    shapes = [(1, 1), (7, 7), (16, 16), (33, 17), (17, 33), (5, 70), (70, 5), (48, 96), (100, 64)]
    for (nq, nk), (left, right), (bm, bn) in itertools.product(shapes, windows, [(16, 16), (16, 32), (32, 16)]):
        _check(nq, nk, left, right, bm, bn)
