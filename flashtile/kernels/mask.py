"""Element masks and score modifiers of one (BLOCK_M, BLOCK_N) tile, as :mod:`flashtile.reference.masks`
defines them: the bottom-right-aligned causal / sliding window, the sequence tail, softcap and ALiBi."""

from __future__ import annotations

import triton
import triton.language as tl

from flashtile.kernels._common import tanh_

# bound on |slope * distance| (fp32, with headroom for log2(e) and the score): a larger slope is clamped to
# ALIBI_SCORE_MAX / span, where the gap between distance levels (>= 4e27) already makes the softmax an argmax
ALIBI_SCORE_MAX = tl.constexpr(1e37)
ALIBI_PAD = tl.constexpr(256)  # the largest tile side: padding rows / columns reach distance max(Nq, Nk) + 256


@triton.jit
def score_mods(
    s,  # (BLOCK_M, BLOCK_N) fp32 scores already multiplied by softmax_scale
    offs_m,
    offs_n,
    seqlen_q,
    seqlen_k,
    softcap,
    slope,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
):
    """Softcap then ALiBi, as in reference/masks.py (slopes past ``ALIBI_SCORE_MAX`` / span clamped: the same
    probabilities, the LSE of the clamped slope).  Returns (s, t) where t is tanh(s_raw / softcap) when
    HAS_SOFTCAP (the backward needs 1 - t^2), else s."""
    t = s
    if HAS_SOFTCAP:
        t = tanh_(s / softcap)
        s = softcap * t
    if HAS_ALIBI:
        dist = (offs_m[:, None] + (seqlen_k - seqlen_q)) - offs_n[None, :]
        dist = tl.where(dist < 0, -dist, dist)
        # span: above every |dist| of the tile, padding included, and the same for every kernel and tile shape
        # (forward, backward and decode must clamp alike: the backward rebuilds P from the forward's LSE)
        tl.static_assert(offs_m.shape[0] <= ALIBI_PAD and offs_n.shape[0] <= ALIBI_PAD)
        span = (tl.maximum(seqlen_q, seqlen_k) + ALIBI_PAD).to(tl.float32)
        lim = ALIBI_SCORE_MAX / span
        slope = tl.where(slope > lim, lim, tl.where(slope < -lim, -lim, slope))  # NaN stays NaN
        s = s - slope * dist.to(tl.float32)
    return s, t


@triton.jit
def allowed(
    offs_m,
    offs_n,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    CHECK_BOUNDS: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
):
    """Boolean (BLOCK_M, BLOCK_N) tile: key j is inside the sequence and the window
    of query i (``right = 0`` is causal).  Row bounds are the caller's business
    (out-of-range query rows are never stored)."""
    ok = tl.full((offs_m.shape[0], offs_n.shape[0]), 1, tl.int1)
    if CHECK_BOUNDS:
        ok = ok & (offs_n[None, :] < seqlen_k)
    diag = offs_m[:, None] + (seqlen_k - seqlen_q)
    if HAS_LEFT:
        ok = ok & (offs_n[None, :] >= diag - window_left)
    if HAS_RIGHT:
        ok = ok & (offs_n[None, :] <= diag + window_right)
    return ok
