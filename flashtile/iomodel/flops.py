"""FLOP counts of attention, in the convention of the FlashAttention benchmarks.

A multiply-add is 2 FLOPs, so the forward's two matmuls, ``S = Q K^T`` and
``O = P V``, cost ``2 Nq Nk d`` each: ``4 B H Nq Nk d`` in all (the softmax
is not counted; it is O(Nq Nk), not O(Nq Nk d)).  The backward does five
matmuls of the same size (recompute S, dV, dP, dQ, dK: FA2 paper,
Algorithm 2), ``10 B H Nq Nk d`` = 2.5 x the forward.  Causal attention is
charged half, the convention of flash-attn's benchmarks, which is exact
only as N grows (the diagonal is kept: :func:`exact_causal_fraction` gives
the true fraction, ``(N + 1) / 2N`` for Nq = Nk = N).
"""

from __future__ import annotations

from flashtile.iomodel.hbm import _int

__all__ = ["FLOP_MODES", "attention_flops", "causal_pairs", "exact_causal_fraction"]

# Multiple of the forward's 4 B H Nq Nk d, in halves to stay in integers.
FLOP_MODES: dict[str, int] = {"fwd": 2, "bwd": 5, "fwd_bwd": 7}


def attention_flops(
    batch: int, heads: int, nq: int, nk: int, d: int, *, causal: bool = False, mode: str = "fwd"
) -> int:
    """Matmul FLOPs: fwd ``4 B H Nq Nk d``, bwd 2.5 x fwd, fwd_bwd 3.5 x fwd; causal halves each.

    ``mode`` is one of ``"fwd"``, ``"bwd"``, ``"fwd_bwd"``.  The causal
    halving is flash-attn's convention (stated for Nq = Nk); it is applied
    for any Nq, Nk, so use :func:`exact_causal_fraction` for the true work.
    """
    if mode not in FLOP_MODES:
        raise ValueError(f"mode must be one of {sorted(FLOP_MODES)}, got {mode!r}")
    b, h = _int("batch", batch, 0), _int("heads", heads, 0)
    nq, nk, d = _int("nq", nq, 0), _int("nk", nk, 0), _int("d", d, 1)
    # 4 X * (FLOP_MODES / 2) = 2 X * FLOP_MODES, halved again for causal.
    flops = 2 * b * h * nq * nk * d * FLOP_MODES[mode]
    return flops // 2 if causal else flops


def causal_pairs(nq: int, nk: int) -> int:
    """Number of (i, j) pairs allowed by the bottom-right-aligned causal mask.

    Row i sees keys ``j <= i + Nk - Nq``, i.e. ``clamp(i + Nk - Nq + 1, 0, Nk)``
    of them.  With ``s = Nk - Nq >= 0`` every row is inside the key range:
    ``sum_i (i + s + 1) = Nq (Nq + 1) / 2 + Nq s``.  With ``s < 0`` the first
    ``-s`` rows see nothing and the rest see 1..Nk keys: ``Nk (Nk + 1) / 2``.
    """
    nq, nk = _int("nq", nq, 0), _int("nk", nk, 0)
    s = nk - nq
    if s >= 0:
        return nq * (nq + 1) // 2 + nq * s
    return nk * (nk + 1) // 2


def exact_causal_fraction(nq: int, nk: int) -> float:
    """Fraction of the Nq x Nk score matrix the bottom-right causal mask allows (0 for an empty one)."""
    total = _int("nq", nq, 0) * _int("nk", nk, 0)
    return causal_pairs(nq, nk) / total if total else 0.0
