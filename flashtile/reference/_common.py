"""Shared plumbing of the reference layer: the IO counter, input checks, GQA expansion.

Counting convention (used by every instrumented reference and by
:mod:`flashtile.iomodel`): one *access* is one element read from or written
to HBM (the paper counts elements, not bytes: multiply by the element size
for bytes).  ``flops`` counts matmul work as 2 per multiply-add, so one
(Nq x d) @ (d x Nk) product costs ``2 * Nq * Nk * d``.  ``nonmatmul_flops``
counts every other arithmetic operation on scores (max, subtract, exp, sum,
rescale, divide), one per element per operation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch

__all__ = ["IOCounts", "AttnResult", "check_qkv", "expand_kv", "as_float"]


@dataclass
class IOCounts:
    """HBM traffic and arithmetic performed by one instrumented algorithm."""

    reads: int = 0
    writes: int = 0
    flops: int = 0
    nonmatmul_flops: int = 0
    extra_memory: int = 0  # peak HBM elements held beyond the inputs and the output
    skipped_blocks: int = 0
    visited_blocks: int = 0
    extras: dict = field(default_factory=dict)  # algorithm-specific tallies (documented where set)

    @property
    def hbm(self) -> int:
        """Total HBM accesses (reads + writes)."""
        return self.reads + self.writes

    def read(self, n: int) -> None:
        self.reads += int(n)

    def write(self, n: int) -> None:
        self.writes += int(n)

    def __add__(self, other: "IOCounts") -> "IOCounts":
        out = IOCounts()
        for f in fields(self):
            if f.name == "extras":
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(out, f.name, max(a, b) if f.name == "extra_memory" else a + b)
        out.extras = {**self.extras, **other.extras}
        return out

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extras"}
        d["hbm"] = self.hbm
        d.update(self.extras)
        return d


class AttnResult(NamedTuple):
    """What every reference attention function returns.

    ``out``: (B, Hq, Nq, d); ``lse``: (B, Hq, Nq) natural-log sum-exp of the
    (modified, masked) scores, -inf on fully masked rows; ``counts``: the
    instrumented :class:`IOCounts` (per call, summed over batch and heads).
    """

    out: torch.Tensor
    lse: torch.Tensor
    counts: IOCounts


def as_float(x: torch.Tensor, name: str, dtype: torch.dtype | None = torch.float64) -> torch.Tensor:
    """Check ``x`` is a floating tensor and cast it to ``dtype`` (None keeps its own)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x if dtype is None else x.to(dtype)


def check_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = torch.float64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """Validate and canonicalise q, k, v to (B, H, N, d).

    Accepts 2-D (N, d), 3-D (H, N, d) or 4-D (B, H, N, d) tensors (all three the
    same rank).  Returns ``(q, k, v, squeezed)`` where ``squeezed`` tells how many
    leading dims were added (callers use :func:`restore` style slicing).
    Raises ``ValueError`` naming the argument on any inconsistency.
    """
    q = as_float(q, "q", dtype)
    k = as_float(k, "k", dtype)
    v = as_float(v, "v", dtype)
    if not (q.dim() == k.dim() == v.dim()) or q.dim() not in (2, 3, 4):
        raise ValueError(
            "q, k, v must all be 2-D (N, d), 3-D (H, N, d) or 4-D (B, H, N, d); "
            f"got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    added = 4 - q.dim()
    for _ in range(added):
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    b, hq, nq, d = q.shape
    bk, hk, nk, dk = k.shape
    if d == 0:
        raise ValueError("head_dim d must be >= 1, got 0")
    if dk != d:
        raise ValueError(f"k head_dim {dk} must equal q head_dim {d}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v shape {tuple(v.shape)} must match k shape {tuple(k.shape)} in (B, H, N)")
    if v.shape[3] != d:
        raise ValueError(f"v head_dim {v.shape[3]} must equal q head_dim {d}")
    if bk != b:
        raise ValueError(f"batch of k/v ({bk}) must equal batch of q ({b})")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"number of q heads ({hq}) must be a multiple of k/v heads ({hk}) (GQA/MQA)")
    return q, k, v, added


def expand_kv(x: torch.Tensor, hq: int) -> torch.Tensor:
    """Repeat the kv heads of ``x`` (B, Hk, N, d) so each of the Hq query heads has its own (GQA)."""
    hk = x.shape[1]
    return x if hk == hq else x.repeat_interleave(hq // hk, dim=1)
