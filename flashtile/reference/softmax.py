"""Reference softmax: naive, safe, online and block-online, instrumented.

This is the one-dimensional kernel of FlashAttention: the FA1 paper (Dao et
al. 2022, Section 3.1, "Tiling") computes the softmax of a row in blocks by
carrying, per row, a running maximum ``m`` and a running normaliser ``l``
(called ``d`` here, after Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax") and merging block statistics with

    m = max(m_a, m_b),   d = d_a * exp(m_a - m) + d_b * exp(m_b - m)

(FA1 Algorithm 1, lines 11-12; FA2 Algorithm 1, line 8 keeps the same
statistics).  The softmax is taken over the last dimension; every leading
dimension indexes independent rows.  Computation is in float64 unless a
``dtype`` is given (``dtype=None`` keeps the input's own floating dtype).

Masked entries are ``-inf``.  A row whose entries are all ``-inf`` (a fully
masked row) has ``y = 0`` everywhere and log-sum-exp ``-inf``, never NaN,
matching :mod:`flashtile.reference.masks`.  ``+inf`` and NaN are rejected.

Counting (per row of length ``n``; :class:`~flashtile.reference._common.IOCounts`
summed over rows).  An *access* is one element read from or written to HBM.
``nonmatmul_flops`` counts one per element per arithmetic operation: exp,
add (a running sum started at 0 counts one add per element), max (a running
max started at -inf counts one compare per element), subtract, multiply,
divide.  The ``where`` guards that keep ``-inf - (-inf)`` from producing NaN
are predicates on the mask, not arithmetic, and are not counted.

=================  =====================  ===========================================
variant            accesses per element   nonmatmul flops per element
=================  =====================  ===========================================
naive              2 reads + 1 write = 3  exp + add | exp + div                    = 4
safe               3 reads + 1 write = 4  max | sub + exp + add | sub + exp + div   = 7
online             2 reads + 1 write = 3  max + 2 sub + 2 exp + mul + add
                                          | sub + exp + div                        = 10
block online       2 reads + 1 write = 3  max + sub + exp + add | sub + exp + div   = 7
                                          plus 8 per row per merge of two states
=================  =====================  ===========================================

(``|`` separates passes over HBM; the block variant's first pass does the
max and the sum of one block on-chip, after a single read of the block.)  A merge costs max + 2 sub + 2 exp +
2 mul + add = 8 per row; a row cut into ``nb`` blocks needs ``nb - 1``
merges.  The block variant reads each block once into on-chip memory and
takes its max and its sum of exponentials there, so it keeps the online
variant's 3 accesses per element: safe / online = 4 / 3.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple, Sequence

import torch

from flashtile.reference._common import IOCounts, as_float

__all__ = [
    "SoftmaxResult",
    "SoftmaxState",
    "merge_states",
    "state_of",
    "naive_softmax",
    "safe_softmax",
    "online_softmax",
    "block_online_softmax",
    "softmax_lse",
]

# Arithmetic per element of each piece of work (see the module table).
_FLOPS_NAIVE = 4  # exp + add (pass 1), exp + div (pass 2)
_FLOPS_SAFE = 7  # max (pass 1), sub + exp + add (pass 2), sub + exp + div (pass 3)
_FLOPS_ONLINE_STEP = 7  # max + 2 sub + 2 exp + mul + add
_FLOPS_STATE = 4  # max, then sub + exp + add, on one on-chip block
_FLOPS_OUTPUT = 3  # sub + exp + div
_FLOPS_MERGE = 8  # max + 2 sub + 2 exp + 2 mul + add, per row


class SoftmaxResult(NamedTuple):
    """``y``: the softmax, same shape as the input; ``counts``: summed over rows."""

    y: torch.Tensor
    counts: IOCounts


class SoftmaxState(NamedTuple):
    """Running statistics of a (part of a) row: ``m`` its max, ``d = sum exp(x - m)``.

    Both have the shape of the leading (row) dims.  The state of an empty
    row, ``(-inf, 0)``, is the identity of :func:`merge_states`.  The
    log-sum-exp of the row is ``m + log d``.
    """

    m: torch.Tensor
    d: torch.Tensor

    @staticmethod
    def empty(
        shape: Sequence[int] | torch.Size,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
    ) -> "SoftmaxState":
        """The identity state ``(m, d) = (-inf, 0)`` for rows of the given shape."""
        m = torch.full(tuple(shape), float("-inf"), dtype=dtype, device=device)
        return SoftmaxState(m, torch.zeros_like(m))

    def lse(self) -> torch.Tensor:
        """Natural-log sum-exp ``m + log d``; ``-inf`` for an empty state."""
        # m = -inf only with d = 0, so this is -inf + -inf = -inf, not NaN.
        return self.m + torch.log(self.d)


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """``m`` with ``-inf`` replaced by 0, so ``x - m`` stays ``-inf`` (not NaN) on masked rows.

    Where ``m = -inf`` every entry it is subtracted from is ``-inf`` too, and
    ``exp(-inf - 0) = 0`` is the value the masked row should contribute.
    """
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def merge_states(a: SoftmaxState, b: SoftmaxState) -> SoftmaxState:
    """Merge the states of two disjoint parts of the same rows.

        m = max(m_a, m_b)
        d = d_a * exp(m_a - m) + d_b * exp(m_b - m)

    (FA1 Algorithm 1, lines 11-12, the ``m_i^new``, ``l_i^new`` update.)
    Commutative, associative up to rounding, with identity
    :meth:`SoftmaxState.empty`; two empty states merge to an empty state
    without NaN.  Costs 8 flops per row (max, 2 sub, 2 exp, 2 mul, add).
    """
    if not isinstance(a, SoftmaxState) or not isinstance(b, SoftmaxState):
        raise TypeError(
            f"merge_states takes two SoftmaxState, got {type(a).__name__} and {type(b).__name__}"
        )
    if a.m.shape != b.m.shape:
        raise ValueError(f"states must have the same row shape, got {tuple(a.m.shape)} and {tuple(b.m.shape)}")
    m = torch.maximum(a.m, b.m)
    m_safe = _finite_or_zero(m)
    d = a.d * torch.exp(a.m - m_safe) + b.d * torch.exp(b.m - m_safe)
    return SoftmaxState(m, d)


def _check_input(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Validate ``x`` (floating, at least 1-D, no NaN or +inf) and cast it to ``dtype``."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    x = as_float(x, "x", dtype)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (softmax is over the last one), got a 0-d tensor")
    if torch.isnan(x).any() or torch.isposinf(x).any():
        raise ValueError("x must not contain NaN or +inf; use -inf for masked entries")
    return x


def _counts(rows: int, n: int, reads: int, writes: int, flops_per_elem: int) -> IOCounts:
    """Counts for ``rows`` rows of length ``n`` with the given per-element costs."""
    c = IOCounts()
    c.read(rows * n * reads)
    c.write(rows * n * writes)
    c.nonmatmul_flops = rows * n * flops_per_elem
    return c


def _rows(x: torch.Tensor) -> int:
    """Number of rows: the product of the leading dims (1 for a 1-D row)."""
    return math.prod(x.shape[:-1])


def _normalise(x: torch.Tensor, state: SoftmaxState) -> torch.Tensor:
    """Output pass ``y = exp(x - m) / d`` (sub + exp + div per element); 0 on masked rows."""
    m_safe = _finite_or_zero(state.m).unsqueeze(-1)
    # d = 0 only on fully masked rows, where the numerator is exp(-inf) = 0 as well.
    d = state.d.unsqueeze(-1)
    d_safe = torch.where(d > 0, d, torch.ones_like(d))
    return torch.exp(x - m_safe) / d_safe


def naive_softmax(x: torch.Tensor, dtype: torch.dtype | None = torch.float64) -> SoftmaxResult:
    """``y = exp(x) / sum_j exp(x_j)`` with no max subtracted (Milakov & Gimelshein, Algorithm 1).

    Pass 1 reads x and sums ``exp(x)``; pass 2 reads x again and writes
    ``y``: 3 accesses and 4 flops (exp + add | exp + div) per element.

    Not safe, deliberately: ``exp`` overflows to ``inf`` once a logit exceeds
    about 709.78 in float64 (88.72 in float32), giving ``inf / inf = NaN``;
    and when every logit is below about -745 the sum underflows to 0, giving
    ``0 / 0 = NaN``.  Only a row of all ``-inf`` (fully masked, detected
    from the input, not from the sum) is defined to give ``y = 0``.
    """
    x = _check_input(x, dtype)
    rows, n = _rows(x), x.shape[-1]
    e = torch.exp(x)
    d = e.sum(dim=-1, keepdim=True)
    masked = torch.isneginf(x).all(dim=-1, keepdim=True)
    y = torch.exp(x) / torch.where(masked, torch.ones_like(d), d)
    return SoftmaxResult(y, _counts(rows, n, reads=2, writes=1, flops_per_elem=_FLOPS_NAIVE))


def safe_softmax(x: torch.Tensor, dtype: torch.dtype | None = torch.float64) -> SoftmaxResult:
    """``y = exp(x - max x) / sum_j exp(x_j - max x)`` (Milakov & Gimelshein, Algorithm 2; FA1 Section 3.1).

    Pass 1 reads x for ``m = max x``; pass 2 reads x for
    ``d = sum exp(x - m)``; pass 3 reads x and writes ``y = exp(x - m) / d``:
    4 accesses and 7 flops (max | sub + exp + add | sub + exp + div) per
    element.  Every exponent is <= 0, so nothing overflows and ``d >= 1``
    on any row with a finite entry.
    """
    x = _check_input(x, dtype)
    rows, n = _rows(x), x.shape[-1]
    state = state_of(x, dtype=None)
    y = _normalise(x, state)
    return SoftmaxResult(y, _counts(rows, n, reads=3, writes=1, flops_per_elem=_FLOPS_SAFE))


def _online_state(x: torch.Tensor) -> SoftmaxState:
    """The online normaliser recurrence, one column at a time, all rows at once.

        m_0 = -inf, d_0 = 0
        m_j = max(m_{j-1}, x_j)
        d_j = d_{j-1} * exp(m_{j-1} - m_j) + exp(x_j - m_j)

    (Milakov & Gimelshein, Algorithm 3, lines 1-6.)  One read of x and 7
    flops per element (max, 2 sub, 2 exp, mul, add).
    """
    state = SoftmaxState.empty(x.shape[:-1], dtype=x.dtype, device=x.device)
    m, d = state.m, state.d
    for j in range(x.shape[-1]):
        x_j = x[..., j]
        m_new = torch.maximum(m, x_j)
        m_safe = _finite_or_zero(m_new)
        d = d * torch.exp(m - m_safe) + torch.exp(x_j - m_safe)
        m = m_new
    return SoftmaxState(m, d)


def online_softmax(x: torch.Tensor, dtype: torch.dtype | None = torch.float64) -> SoftmaxResult:
    """Softmax with the max and the normaliser found in one pass (Milakov & Gimelshein, Algorithm 3).

    Pass 1 runs the recurrence of :func:`_online_state` over the row (one
    read per element); pass 2 reads x and writes ``y_j = exp(x_j - m_n) / d_n``.
    3 accesses and 10 flops per element.
    """
    x = _check_input(x, dtype)
    rows, n = _rows(x), x.shape[-1]
    y = _normalise(x, _online_state(x))
    c = _counts(rows, n, reads=2, writes=1, flops_per_elem=_FLOPS_ONLINE_STEP + _FLOPS_OUTPUT)
    return SoftmaxResult(y, c)


def softmax_lse(x: torch.Tensor, dtype: torch.dtype | None = torch.float64) -> torch.Tensor:
    """Natural log-sum-exp over the last dim, ``m_n + log d_n`` of the online state.

    Shape ``x.shape[:-1]``; ``-inf`` for a fully masked or empty row.  This
    is the ``L_i`` that FA2 Algorithm 1 (line 13) stores for the backward pass.
    """
    x = _check_input(x, dtype)
    return _online_state(x).lse()


def state_of(x_block: torch.Tensor, dtype: torch.dtype | None = torch.float64) -> SoftmaxState:
    """State ``(m, d)`` of a block: ``m = max_j x_j``, ``d = sum_j exp(x_j - m)``.

    (FA1 Algorithm 1, line 10: ``m~_ij = rowmax(S_ij)``, ``l~_ij = rowsum(P~_ij)``.)
    The block is read once; max, then sub + exp + add per element are done
    on-chip (4 flops per element).  An empty block gives the empty state.
    """
    x_block = _check_input(x_block, dtype)
    if x_block.shape[-1] == 0:
        return SoftmaxState.empty(x_block.shape[:-1], dtype=x_block.dtype, device=x_block.device)
    m = x_block.amax(dim=-1)
    d = torch.exp(x_block - _finite_or_zero(m).unsqueeze(-1)).sum(dim=-1)
    return SoftmaxState(m, d)


def _check_order(order: Sequence[int] | torch.Tensor | None, nb: int) -> list[int]:
    """Return ``order`` as a list, checking it is a permutation of ``range(nb)``."""
    if order is None:
        return list(range(nb))
    if isinstance(order, torch.Tensor):
        order = order.tolist()
    try:
        perm = [operator.index(i) for i in order]
    except TypeError:
        raise ValueError(f"order must be a permutation of the block indices 0..{nb - 1}, got {order!r}") from None
    if sorted(perm) != list(range(nb)):
        raise ValueError(f"order must be a permutation of the block indices 0..{nb - 1} ({nb} blocks), got {perm}")
    return perm


def block_online_softmax(
    x: torch.Tensor,
    block_size: int,
    order: Sequence[int] | torch.Tensor | None = None,
    dtype: torch.dtype | None = torch.float64,
) -> SoftmaxResult:
    """Softmax from per-block states merged in any order (FA1 Section 3.1, Algorithm 1 lines 10-12).

    The row is cut into ``nb = ceil(n / block_size)`` blocks ``x[b*B:(b+1)*B]``
    (the last may be partial).  Each block is read once and reduced to its
    state with :func:`state_of`; the states are folded with
    :func:`merge_states` in ``order`` (a permutation of ``range(nb)``,
    default ascending), which by associativity and commutativity gives the
    row's ``(m, d)`` whatever the order; the output pass then writes
    ``y = exp(x - m) / d``.  3 accesses and 7 flops per element, plus
    8 flops per row for each of the ``nb - 1`` merges.
    """
    x = _check_input(x, dtype)
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int >= 1, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size}")
    rows, n = _rows(x), x.shape[-1]
    nb = -(-n // block_size)
    perm = _check_order(order, nb)
    state = SoftmaxState.empty(x.shape[:-1], dtype=x.dtype, device=x.device)
    for k, b in enumerate(perm):
        block_state = state_of(x[..., b * block_size : (b + 1) * block_size], dtype=None)
        # The first block's state is taken as is: folding it into the empty
        # state would be an exact no-op and is not counted as a merge.
        state = block_state if k == 0 else merge_states(state, block_state)
    y = _normalise(x, state)
    c = _counts(rows, n, reads=2, writes=1, flops_per_elem=_FLOPS_STATE + _FLOPS_OUTPUT)
    c.nonmatmul_flops += rows * max(nb - 1, 0) * _FLOPS_MERGE
    c.extras["merges"] = max(nb - 1, 0)
    return SoftmaxResult(y, c)
