"""Closed-form HBM access counts of every algorithm in flashtile.

An *access* is one element read from or written to HBM, the unit of the
FlashAttention papers (Dao et al. 2022, "FlashAttention", Section 3.2;
multiply by the element size for bytes, see :func:`to_bytes`).  Everything
here is pure integer arithmetic on the loop structure of each algorithm, so
the instrumented references in :mod:`flashtile.reference` must report
exactly these numbers (``tests/iomodel/test_counts_match.py`` checks it).

Counts are per (batch, head) pair.  The functions that take ``batch`` and
``heads`` multiply by ``batch * heads``; with a :class:`BlockMask` whose
``mask`` has leading dims, each leading slice is one head (see
:func:`_mask_instances` for how the two combine).

Notation: ``Nq, Nk`` sequence lengths, ``d`` head dim, ``M`` on-chip SRAM
size in elements, ``Br x Bc`` tiles, ``Tr = ceil(Nq/Br)``, ``Tc = ceil(Nk/Bc)``;
``br_i`` and ``bc_j`` are the actual sizes of query block i and key block j
(the last block of each may be partial).

Closed forms (per head):

====================  ==========================================================
Algorithm 0           ``2 (Nq + Nk) d + 4 Nq Nk``
FA1, Algorithm 1      ``2 Nk d + Tc (3 Nq d + 4 Nq)``  (+ ``Nq d + 2 Nq`` init)
Theorem 2 form        ``Tc (2 Bc d + Tr (3 Br d + 4 Br))``
Block-sparse (Alg 5)  ``sum_{j nonempty} 2 bc_j d + sum_{(i,j) kept} (3 br_i d + 4 br_i)``
FA2, Algorithm 1      ``sum_i [br_i d + sum_{j visited} 2 bc_j d + br_i d + br_i]``
Backward (Alg 4/FA2)  ``2 Nq d + Nq + sum_j [4 bc_j d + sum_{i visited} (4 br_i d + 2 br_i)]``
Flash-Decoding        ``Nq d + 2 L d + 2 S Nq (d + 1) + Nq d + Nq``
Lower bound (Prop 3)  ``N^2 d^2 / M``  (order only, constant-free)
====================  ==========================================================
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple, Sequence

from flashtile.reference.masks import BlockMask, normalize_window

__all__ = [
    "SOFTMAX_VARIANTS",
    "softmax_accesses",
    "standard_hbm",
    "fa1_block_sizes",
    "fa1_hbm",
    "fa1_init_writes",
    "fa1_hbm_theorem2",
    "lower_bound_hbm",
    "block_sparse_hbm",
    "block_sparse_hbm_bound",
    "fa2_visited_blocks",
    "fa2_hbm",
    "backward_hbm",
    "ReadsWrites",
    "decoding_reads_writes",
    "decoding_hbm",
    "BYTES_PER_ELEMENT",
    "to_bytes",
]


# -- argument checks ------------------------------------------------------------


def _int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; TypeError for non-integers (bool included)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= {minimum}, got bool {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__} {value!r}") from None
    if v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v}")
    return v


def _pair(name: str, value: object) -> tuple[int, int]:
    """A pair of positive ints, e.g. ``block_sizes = (Br, Bc)``."""
    try:
        a, b = value  # type: ignore[misc]
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a pair of ints (Br, Bc) >= 1, got {value!r}") from None
    return _int(f"{name}[0]", a, 1), _int(f"{name}[1]", b, 1)


def _blocks(n: int, b: int) -> list[int]:
    """Sizes of the ``ceil(n / b)`` blocks of length ``b`` covering ``n`` (last one partial)."""
    return [min(b, n - s) for s in range(0, n, b)]


def _batch_heads(batch: int, heads: int) -> int:
    return _int("batch", batch, 1) * _int("heads", heads, 1)


# -- softmax ----------------------------------------------------------------------

SOFTMAX_VARIANTS: dict[str, int] = {"naive": 3, "safe": 4, "online": 3, "block_online": 3}


def softmax_accesses(n: int, variant: str, *, rows: int = 1) -> int:
    """HBM accesses of a softmax over ``rows`` rows of length ``n``.

    Milakov & Gimelshein (2018), Algorithms 1-3, per element: naive = 2 reads
    + 1 write = 3; safe = 3 reads (max pass, sum pass, output pass) + 1 write
    = 4; online = 2 reads + 1 write = 3 (max and normaliser found in one
    pass); block_online (FA1 Section 3.1, tiling) reads each block once, so
    also 3.  Hence safe / online = 4 / 3.
    """
    n = _int("n", n, 0)
    rows = _int("rows", rows, 0)
    if variant not in SOFTMAX_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(SOFTMAX_VARIANTS)}, got {variant!r}")
    return SOFTMAX_VARIANTS[variant] * n * rows


# -- Algorithm 0 -----------------------------------------------------------------


def standard_hbm(nq: int, nk: int, d: int, *, batch: int = 1, heads: int = 1) -> int:
    """Standard attention (FA1 paper, Algorithm 0), materialising S and P in HBM.

    Line 1 reads Q, K (Nq d + Nk d) and writes S (Nq Nk); line 2 reads S and
    writes P (2 Nq Nk); line 3 reads P, V (Nq Nk + Nk d) and writes O (Nq d):

        2 (Nq + Nk) d + 4 Nq Nk     (= 4 N d + 4 N^2 when Nq = Nk = N)

    i.e. Theta(Nd + N^2) accesses (FA1 Theorem 2).
    """
    nq, nk, d = _int("nq", nq, 0), _int("nk", nk, 0), _int("d", d, 1)
    return _batch_heads(batch, heads) * (2 * (nq + nk) * d + 4 * nq * nk)


# -- FlashAttention-1, Algorithm 1 -------------------------------------------------


def fa1_block_sizes(sram_size: int, d: int) -> tuple[int, int]:
    """Tile sizes of FA1 Algorithm 1, line 1: ``Bc = ceil(M / 4d)``, ``Br = min(ceil(M / 4d), d)``.

    ``M`` (``sram_size``) is in elements; it must hold at least one row of
    K, so ``M >= d`` (Algorithm 1 assumes it).  Returns ``(Br, Bc)``.
    """
    d = _int("d", d, 1)
    m = _int("sram_size", sram_size, 1)
    if m < d:
        raise ValueError(f"sram_size (M, in elements) must be >= d = {d}, got {m}")
    bc = -(-m // (4 * d))
    return min(bc, d), bc


def _fa1_tiles(sram_size: int | None, block_sizes: Sequence[int] | None, d: int) -> tuple[int, int]:
    if (sram_size is None) == (block_sizes is None):
        raise ValueError("give exactly one of sram_size (M, elements) or block_sizes (Br, Bc)")
    if block_sizes is not None:
        return _pair("block_sizes", block_sizes)
    return fa1_block_sizes(sram_size, d)  # type: ignore[arg-type]


def fa1_hbm(
    nq: int,
    nk: int,
    d: int,
    *,
    sram_size: int | None = None,
    block_sizes: Sequence[int] | None = None,
    batch: int = 1,
    heads: int = 1,
) -> int:
    """HBM accesses of the main loop of FA1 Algorithm 1, exact for any Nq, Nk.

    Outer loop over key blocks j (line 5: load K_j, V_j, ``2 bc_j d``);
    inner loop over query blocks i (line 8: load Q_i, O_i, l_i, m_i,
    ``2 br_i d + 2 br_i``; lines 12-13: write O_i, l_i, m_i, ``br_i d + 2 br_i``):

        sum_j [2 bc_j d + sum_i (3 br_i d + 4 br_i)] = 2 Nk d + Tc (3 Nq d + 4 Nq)

    with ``Tc = ceil(Nk / Bc)``.  Partial last blocks are included exactly;
    ``Br`` drops out because the inner loop always sweeps all Nq rows.  The
    initialisation of O, l, m in HBM (line 2) is excluded: see
    :func:`fa1_init_writes`.  Tiles come from ``sram_size`` via
    :func:`fa1_block_sizes` or directly from ``block_sizes = (Br, Bc)``.
    """
    nq, nk, d = _int("nq", nq, 0), _int("nk", nk, 0), _int("d", d, 1)
    _, bc = _fa1_tiles(sram_size, block_sizes, d)
    tc = -(-nk // bc)
    return _batch_heads(batch, heads) * (2 * nk * d + tc * (3 * nq * d + 4 * nq))


def fa1_init_writes(nq: int, d: int, *, batch: int = 1, heads: int = 1) -> int:
    """FA1 Algorithm 1, line 2: ``O = 0, l = 0, m = -inf`` written to HBM: ``Nq d + 2 Nq``."""
    nq, d = _int("nq", nq, 0), _int("d", d, 1)
    return _batch_heads(batch, heads) * (nq * d + 2 * nq)


def fa1_hbm_theorem2(n: int, d: int, sram_size: int) -> int:
    """The FA1 count as the paper writes it (proof of Theorem 2), for Nq = Nk = n:

        Tc (2 Bc d + Tr (3 Br d + 4 Br)),   Tr = ceil(n / Br), Tc = ceil(n / Bc)

    It charges every block as a full one, so it equals :func:`fa1_hbm` when
    Br and Bc divide n and over-counts the partial blocks otherwise.  With
    ``Tc ~ 4 n d / M`` it is Theta(n^2 d^2 / M).
    """
    n, d = _int("n", n, 0), _int("d", d, 1)
    br, bc = fa1_block_sizes(sram_size, d)
    tr, tc = -(-n // br), -(-n // bc)
    return tc * (2 * bc * d + tr * (3 * br * d + 4 * br))


def lower_bound_hbm(n: int, d: int, sram_size: int) -> float:
    """``n^2 d^2 / M``: FA1 Proposition 3, the order of the IO lower bound.

    No exact attention algorithm does ``o(N^2 d^2 / M)`` HBM accesses for all
    ``M`` in ``[d, N d]``.  The proposition is asymptotic, so this is the
    order only, without a constant: compare it up to constants (FA1 stays
    within a small constant factor of it, see ``tests/iomodel/test_hbm.py``).
    Raises ``ValueError`` outside the range ``d <= M <= n d`` where the
    proposition is stated.
    """
    n, d = _int("n", n, 1), _int("d", d, 1)
    m = _int("sram_size", sram_size, 1)
    if not d <= m <= n * d:
        raise ValueError(f"sram_size must lie in [d, n*d] = [{d}, {n * d}] (FA1 Proposition 3), got {m}")
    return n * n * d * d / m


# -- block masks, per head ----------------------------------------------------------


def _mask_instances(
    block_mask: BlockMask | None, nq: int, nk: int, batch: int | None, heads: int | None
) -> list[tuple[list[list[bool]] | None, int]]:
    """The distinct per-head block grids and how many (batch, head) pairs use each.

    Without ``batch``/``heads`` every leading slice of ``block_mask.mask`` is
    one head (a 2-D mask is one head).  With them, the leading dims must
    broadcast to ``(batch, heads)`` (like the kernels' (B, H, Tr, Tc) masks)
    and each slice is counted as often as it is repeated by the broadcast.
    """
    b = 1 if batch is None else _int("batch", batch, 1)
    h = 1 if heads is None else _int("heads", heads, 1)
    if block_mask is None:
        return [(None, b * h)]
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a flashtile.reference.masks.BlockMask or None, got {type(block_mask).__name__}")
    block_mask.check_seqlens(nq, nk)
    mask = block_mask.mask
    tr, tc = block_mask.shape
    lead = tuple(int(s) for s in mask.shape[:-2])
    repeat = 1
    if batch is not None or heads is not None:
        if len(lead) > 2 or any(s not in (1, t) for s, t in zip(lead[::-1], (h, b))):
            raise ValueError(f"block_mask leading dims {lead} must broadcast to (batch, heads) = {(b, h)}")
        repeat = b * h // math.prod(lead)
    grids = mask.reshape(math.prod(lead), tr, tc).tolist()
    return [(g, repeat) for g in grids]


DEFAULT_BLOCK_SIZES = (64, 64)


def _loop_tiles(block_sizes: Sequence[int] | None, block_mask: BlockMask | None) -> tuple[int, int]:
    """Tiles of the FA2-order loops: the mask's blocks when there is a mask, else ``block_sizes``.

    ``None`` picks the mask's block size, or (64, 64) without a mask; an
    explicit size that disagrees with the mask's is an error, since the
    loop skips whole mask blocks.
    """
    if block_sizes is None:
        return block_mask.block_size if block_mask is not None else DEFAULT_BLOCK_SIZES
    tiles = _pair("block_sizes", block_sizes)
    if block_mask is not None and block_mask.block_size != tiles:
        raise ValueError(
            f"block_sizes {tiles} must equal block_mask.block_size {block_mask.block_size} "
            "(or be None): the tiles of the loop are the mask's blocks"
        )
    return tiles


# -- block-sparse FlashAttention, Algorithm 5 -------------------------------------------


def block_sparse_hbm(
    block_mask: BlockMask, d: int, nq: int, nk: int, *, batch: int | None = None, heads: int | None = None
) -> int:
    """Exact HBM accesses of block-sparse FlashAttention (FA1 Algorithm 5) on FA1's loop order.

    Tiles are the mask's blocks.  Key block j is loaded (``2 bc_j d``) only
    if its column holds a kept block; a kept block (i, j) costs the inner
    step of Algorithm 1 (``3 br_i d + 4 br_i``, lines 8, 12, 13); a zero
    block costs nothing (Algorithm 5, line 8: "if M_ij != 0"):

        sum_{j: column j nonempty} 2 bc_j d + sum_{(i, j) kept} (3 br_i d + 4 br_i)

    With every block kept this is :func:`fa1_hbm` for the same tiles.
    Leading mask dims are heads and are summed over; ``batch``/``heads``
    broadcast them (see :func:`_mask_instances`).
    """
    nq, nk, d = _int("nq", nq, 0), _int("nk", nk, 0), _int("d", d, 1)
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a flashtile.reference.masks.BlockMask, got {type(block_mask).__name__}")
    br, bc = block_mask.block_size
    rows, cols = _blocks(nq, br), _blocks(nk, bc)
    total = 0
    for grid, repeat in _mask_instances(block_mask, nq, nk, batch, heads):
        per_head = 0
        for j, bc_j in enumerate(cols):
            kept = [br_i for i, br_i in enumerate(rows) if grid[i][j]]
            if kept:
                per_head += 2 * bc_j * d + sum(3 * br_i * d + 4 * br_i for br_i in kept)
        total += repeat * per_head
    return total


def block_sparse_hbm_bound(n: int, d: int, sram_size: int, s: float) -> float:
    """``n d + n^2 d^2 s / M``: the order of block-sparse FA1's IO (FA1 Proposition 4).

    ``s`` is the fraction of nonzero blocks (:attr:`BlockMask.density`).  As
    in the paper this is a Theta form without constants; the exact count is
    :func:`block_sparse_hbm`.
    """
    n, d = _int("n", n, 0), _int("d", d, 1)
    m = _int("sram_size", sram_size, 1)
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 <= s <= 1.0:
        raise ValueError(f"s (fraction of kept blocks) must be a number in [0, 1], got {s!r}")
    return n * d + n * n * d * d * s / m


# -- FlashAttention-2 forward -------------------------------------------------------


def _band_hits(r0: int, r1: int, c0: int, c1: int, shift: int, left: int, right: int) -> bool:
    """Does rows [r0, r1) x cols [c0, c1) contain an element allowed by the window?

    Row i allows ``i + shift - left <= j <= i + shift + right`` (masks.py).
    Consecutive rows slide that interval by one and it is never empty, so
    over the rows the allowed columns form the single interval
    ``[r0 + shift - left, r1 - 1 + shift + right]``; the tile is hit iff
    that interval meets ``[c0, c1 - 1]``.
    """
    if r0 >= r1 or c0 >= c1:
        return False
    if left >= 0 and r0 + shift - left > c1 - 1:
        return False
    if right >= 0 and r1 - 1 + shift + right < c0:
        return False
    return True


def _visited_grid(
    nq: int, nk: int, block_sizes: tuple[int, int], left: int, right: int, grid: list[list[bool]] | None
) -> list[list[bool]]:
    """Tile (i, j) is visited unless the window masks all of it or the block mask drops it."""
    br, bc = block_sizes
    shift = nk - nq
    return [
        [
            (grid is None or grid[i][j]) and _band_hits(r0, min(r0 + br, nq), c0, min(c0 + bc, nk), shift, left, right)
            for j, c0 in enumerate(range(0, nk, bc))
        ]
        for i, r0 in enumerate(range(0, nq, br))
    ]


def _tiled(
    nq: int,
    nk: int,
    d: int,
    block_sizes: Sequence[int] | None,
    causal: bool,
    window_size: Sequence[int] | None,
    block_mask: BlockMask | None,
    batch: int | None,
    heads: int | None,
) -> tuple[int, int, int, tuple[int, int], list[tuple[list[list[bool]], int]]]:
    """Shared checks of the tiled forward/backward: the visited grid of every head."""
    nq, nk, d = _int("nq", nq, 0), _int("nk", nk, 0), _int("d", d, 1)
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a flashtile.reference.masks.BlockMask or None, got {type(block_mask).__name__}")
    tiles = _loop_tiles(block_sizes, block_mask)
    left, right = normalize_window(bool(causal), window_size)
    heads_grids = [
        (_visited_grid(nq, nk, tiles, left, right, grid), repeat)
        for grid, repeat in _mask_instances(block_mask, nq, nk, batch, heads)
    ]
    return nq, nk, d, tiles, heads_grids


def fa2_visited_blocks(
    nq: int,
    nk: int,
    *,
    block_sizes: Sequence[int] | None = None,
    causal: bool = False,
    window_size: Sequence[int] | None = (-1, -1),
    block_mask: BlockMask | None = None,
    batch: int | None = None,
    heads: int | None = None,
) -> int:
    """Number of (query block, key block) tiles the tiled loops visit, summed over heads.

    A tile is skipped when every element in it is masked by the causal /
    sliding window (bottom-right aligned, as :func:`flashtile.reference.masks.allowed_mask`)
    or when ``block_mask`` drops it.  Tiles are ``block_sizes``, by default
    the mask's blocks with a mask and (64, 64) without.  Out of ``Tr * Tc`` tiles, causal with Nq = Nk visits
    ``Tr (Tr + 1) / 2`` for square tiles: about half.
    """
    _, _, _, _, heads_grids = _tiled(nq, nk, 1, block_sizes, causal, window_size, block_mask, batch, heads)
    return sum(repeat * sum(map(sum, vis)) for vis, repeat in heads_grids)


def fa2_hbm(
    nq: int,
    nk: int,
    d: int,
    *,
    block_sizes: Sequence[int] | None = None,
    causal: bool = False,
    window_size: Sequence[int] | None = (-1, -1),
    block_mask: BlockMask | None = None,
    batch: int | None = None,
    heads: int | None = None,
) -> int:
    """HBM accesses of the FA2 forward (FA2 paper, Algorithm 1), exact.

    Outer loop over query blocks i: load Q_i (line 4, ``br_i d``); inner loop
    over the visited key blocks j: load K_j, V_j (line 6, ``2 bc_j d``); then
    write O_i (line 14, ``br_i d``) and L_i (line 15, ``br_i``):

        sum_i [br_i d + sum_{j visited} 2 bc_j d + br_i d + br_i]

    With nothing masked this is ``2 Nq d + Nq + 2 Tr Nk d``: K and V are
    read once per query block, O is written once.  Visited tiles as in
    :func:`fa2_visited_blocks`.
    """
    nq, nk, d, (br, bc), heads_grids = _tiled(nq, nk, d, block_sizes, causal, window_size, block_mask, batch, heads)
    rows, cols = _blocks(nq, br), _blocks(nk, bc)
    total = 0
    for vis, repeat in heads_grids:
        per_head = 0
        for i, br_i in enumerate(rows):
            kv = sum(2 * bc_j * d for j, bc_j in enumerate(cols) if vis[i][j])
            per_head += br_i * d + kv + br_i * d + br_i
        total += repeat * per_head
    return total


# -- backward ----------------------------------------------------------------------------


def backward_hbm(
    nq: int,
    nk: int,
    d: int,
    *,
    block_sizes: Sequence[int] | None = None,
    causal: bool = False,
    window_size: Sequence[int] | None = (-1, -1),
    block_mask: BlockMask | None = None,
    batch: int | None = None,
    heads: int | None = None,
) -> int:
    """HBM accesses of the backward by recomputation (FA1 Algorithm 4 in the FA2 form), exact.

    Preprocessing ``D_i = rowsum(dO_i * O_i)`` (FA2 Algorithm 2, line 4):
    reads O, dO (``2 Nq d``), writes D (``Nq``).  Then the KV-outer loop:
    load K_j, V_j (``2 bc_j d``); for each visited query block i load Q_i,
    dO_i (``2 br_i d``), L_i, D_i (``2 br_i``), read and write back dQ_i
    (``2 br_i d``); finally write dK_j, dV_j (``2 bc_j d``):

        2 Nq d + Nq + sum_j [4 bc_j d + sum_{i visited} (4 br_i d + 2 br_i)]

    This is the loop of :func:`flashtile.reference.backward.flash_attn_backward`;
    visited tiles as in :func:`fa2_visited_blocks`.
    """
    nq, nk, d, (br, bc), heads_grids = _tiled(nq, nk, d, block_sizes, causal, window_size, block_mask, batch, heads)
    rows, cols = _blocks(nq, br), _blocks(nk, bc)
    total = 0
    for vis, repeat in heads_grids:
        per_head = 2 * nq * d + nq
        for j, bc_j in enumerate(cols):
            q_side = sum(4 * br_i * d + 2 * br_i for i, br_i in enumerate(rows) if vis[i][j])
            per_head += 4 * bc_j * d + q_side
        total += repeat * per_head
    return total


# -- decoding -------------------------------------------------------------------------------


class ReadsWrites(NamedTuple):
    """HBM reads and writes, in elements."""

    reads: int
    writes: int

    @property
    def total(self) -> int:
        return self.reads + self.writes


def decoding_reads_writes(nq: int, L: int, d: int, num_splits: int) -> ReadsWrites:
    """Flash-Decoding (Dao et al. 2023) per (batch, query head), split into reads and writes.

    Each of the S = ``num_splits`` chunks of the KV cache (length ``L``)
    reads its share of K and V and the queries, and writes a partial output
    and LSE per query row (``Nq (d + 1)``); the merge re-reads the S
    partials and writes O and LSE:

        reads  = Nq d + 2 L d + S Nq (d + 1)
        writes = S Nq (d + 1) + Nq d + Nq

    The queries are charged once, as in the reference (they stay on chip
    across chunks of one program).
    """
    nq, L, d = _int("nq", nq, 0), _int("L", L, 0), _int("d", d, 1)
    s = _int("num_splits", num_splits, 1)
    partials = s * nq * (d + 1)
    return ReadsWrites(nq * d + 2 * L * d + partials, partials + nq * d + nq)


def decoding_hbm(nq: int, L: int, d: int, num_splits: int) -> int:
    """Total HBM accesses of Flash-Decoding per (batch, query head): see :func:`decoding_reads_writes`."""
    return decoding_reads_writes(nq, L, d, num_splits).total


# -- bytes ------------------------------------------------------------------------------------

BYTES_PER_ELEMENT: dict[str, int] = {"fp8": 1, "bf16": 2, "fp16": 2, "tf32": 4, "fp32": 4, "fp64": 8}


def to_bytes(accesses: int | float, bytes_per_element: int | str = 2) -> float:
    """Element accesses -> bytes; ``bytes_per_element`` is an int or a dtype name of :data:`BYTES_PER_ELEMENT`."""
    if isinstance(bytes_per_element, str):
        if bytes_per_element not in BYTES_PER_ELEMENT:
            raise ValueError(
                f"bytes_per_element must be a positive int or one of {sorted(BYTES_PER_ELEMENT)}, got {bytes_per_element!r}"
            )
        bytes_per_element = BYTES_PER_ELEMENT[bytes_per_element]
    bpe = _int("bytes_per_element", bytes_per_element, 1)
    if isinstance(accesses, bool) or not isinstance(accesses, (int, float)) or accesses < 0:
        raise ValueError(f"accesses must be a number >= 0, got {accesses!r}")
    return accesses * bpe
