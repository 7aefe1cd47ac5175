"""Reference attention backward: recomputation by tiles, and the dense baseline.

The forward keeps only ``O`` and the natural-log ``lse`` (FA2: ``L_i = m_i +
log l_i``).  The backward recomputes every score tile from ``Q``, ``K`` and
``lse`` instead of reading an (Nq x Nk) matrix ``P`` from HBM: FA1 paper (Dao
et al. 2022) Algorithm 4, "backward pass by recomputation", in the FA2 (Dao
2023, Algorithm 2) formulation, which takes ``D_i = rowsum(dO_i * O_i)`` once
in a preprocessing pass (FA1 recomputes it inside the inner loop, reading
``O_i`` every time).

For one (batch, query head) pair, with ``t`` the tile of rows i of q block
``I`` and columns j of kv block ``J`` (``Z`` the dropout keep mask):

    D          = rowsum(dO * O)                      (Nq,)   preprocessing
    for each kv block J:                                     outer loop
        load K_J, V_J;  dK_J = dV_J = 0 on chip
        for each q block I visiting J:                       inner loop
            load Q_I, dO_I, lse_I, D_I, dQ_I
            S_raw = scale * Q_I K_J^T                        (br, bc)
            S     = cap * tanh(S_raw / cap)   (softcap > 0)
            S     = S - slope * |i + Nk - Nq - j|   (ALiBi)
            P     = exp(S - lse_I) where allowed and lse_I > -inf, else 0
            P_d   = P * Z / (1 - p)
            dV_J += P_d^T dO_I
            dP    = (dO_I V_J^T) * Z / (1 - p)
            dS    = P * (dP - D_I)
            dS    = dS * (1 - tanh^2(S_raw / cap))   (softcap chain rule)
            dQ_I += scale * dS K_J                   (read-modify-write in HBM)
            dK_J += scale * dS^T Q_I
        write dK_J, dV_J

``D_i = sum_j P_ij dP_ij`` holds with dropout too (``O_i = sum_j P_ij Z_ij
v_j / (1-p)``), so ``dS = P * (dP - D)`` is the softmax Jacobian applied to
``dP`` (FA1 Appendix B.2, eq. for dS).  ALiBi and the masks are constants
added to S: they pass the gradient through unchanged and give none to q or k.

Visited blocks.  The tiles are ``(Br, Bc) = block_sizes``, or the block
mask's ``block_size`` when a :class:`~flashtile.reference.masks.BlockMask`
is given (Algorithm 5: the mask's blocks are the tiles; ``block_sizes`` is
then ignored).  The last tile of a dimension may be partial.  Tile ``(I, J)``
of head (b, h) is *visited* iff the block mask keeps it and the window
(causal = right 0, bottom-right aligned) allows at least one element of it,
i.e., with ``shift = Nk - Nq`` and rows [r0, r1), columns [c0, c1):

    (left  < 0 or c1 - 1 >= r0 + shift - left) and
    (right < 0 or c0     <= r1 - 1 + shift + right)

(the allowed columns of rows r0..r1-1 form one interval, since each row's
window slides by one).  A tile that is not visited costs no HBM access and
no FLOP: every element of it has ``P = 0``, so it contributes nothing.

HBM accesses (elements; :mod:`flashtile.reference._common`), per (batch,
query head), with ``br_I``, ``bc_J`` the (possibly partial) tile sizes and
``V_J`` the set of q blocks visiting kv block J::

    reads  = 2 Nq d                                  (O, dO for D)
           + sum_J [ 2 bc_J d                        (K_J, V_J)
                     + sum_{I in V_J} (3 br_I d + 2 br_I) ]  (Q_I, dO_I, dQ_I; lse_I, D_I)
    writes = Nq                                      (D)
           + sum_J [ 2 bc_J d                        (dK_J, dV_J)
                     + sum_{I in V_J} br_I d ]       (dQ_I)

so ``hbm = 2 Nq d + Nq + sum_J [4 bc_J d + sum_{I in V_J} (4 br_I d + 2 br_I)]``.
Every kv block loads K_J, V_J and writes dK_J, dV_J even when no q block
visits it (a kernel program per kv block does so; the write stores zeros).
With nothing skipped (Tc = ceil(Nk / Bc) kv blocks):

    reads  = 2 Nq d + 2 Nk d + Tc (3 Nq d + 2 Nq)
    writes = Nq + 2 Nk d + Tc Nq d
    hbm    = 2 Nq d + Nq + 4 Nk d + Tc (4 Nq d + 2 Nq)

which is Theta(Nq Nk d^2 / M) for Bc ~ M / (4d): the backward half of FA1
Theorem 5.  Counts are summed over batch and query heads (B * Hq times the
per-head count): with GQA each query head's program loads the K, V of its
kv head and writes its own dK, dV into an expanded (B, Hq, Nk, d) buffer.
Kept out of ``reads``/``writes`` and recorded in ``counts.extras``:

* ``init_writes`` = B Hq Nq d: zeroing dQ before the accumulation
  (FA1 Algorithm 4 initialises dQ = 0 in HBM);
* ``gqa_reduce_reads`` = 2 B Hq Nk d and ``gqa_reduce_writes`` = 2 B Hk Nk d:
  the pass that sums the expanded dK, dV over the Hq/Hk query heads of each
  kv head (both 0 when Hq = Hk).

The dropout keep mask stands in for the on-chip RNG state of the forward
(FA1 Algorithm 4 regenerates the mask from the saved seed), the ALiBi slope
is one scalar per head and the block mask is index metadata: none of the
three is counted as HBM traffic.

FLOPs.  Five matmuls per visited tile (S recompute, dV, dP, dQ, dK), each
``2 br bc d``: ``flops = 10 br bc d`` per visited tile, so a dense problem
costs ``10 Nq Nk d`` per head = 2.5 x the forward's ``4 Nq Nk d``.
``nonmatmul_flops`` per element of a visited tile, as the code does it:
scale 1, subtract lse 1, exp 1, ``dP - D`` 1, ``* P`` 1, ``scale * dS`` 1
(shared by dQ and dK) = 6; softcap +6 (div, tanh, mul; square, ``1 -``,
mul); ALiBi +2 (slope * distance, subtract); dropout +2 (``P * Z/(1-p)`` and
``dP * Z/(1-p)``, ``Z/(1-p)`` being a select).  Plus ``2 Nq d`` per head
for D (multiply, add) and ``2 B (Hq - Hk) Nk d`` in all for the adds of the
GQA reduction.  Masking selects (``where``) are predicates, not arithmetic,
and are not counted.

``extra_memory`` = B Hq Nq (D) + 2 B Hq Nk d (the expanded dK, dV) when
Hq != Hk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from flashtile.reference import _checks as checks
from flashtile.reference._common import IOCounts, check_qkv, expand_kv
from flashtile.reference.masks import BlockMask, allowed_mask, apply_score_mods, normalize_window

__all__ = ["BackwardResult", "flash_attn_backward", "standard_attention_backward"]

# nonmatmul flops per element of a visited tile (see the module docstring)
_OPS_BASE = 6  # scale, - lse, exp, dP - D, * P, scale * dS
_OPS_SOFTCAP = 6  # forward: div, tanh, mul; chain rule: t*t, 1 - t^2, mul
_OPS_ALIBI = 2  # slope * |distance|, subtract
_OPS_DROPOUT = 2  # P * Z/(1-p), dP * Z/(1-p)
_MATMULS_PER_TILE = 5  # S, dV, dP, dQ, dK


class BackwardResult(NamedTuple):
    """``dq`` like q, ``dk``/``dv`` like k/v (input rank kept); ``counts`` summed over batch and heads."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    counts: IOCounts


@dataclass
class _Problem:
    """Validated inputs in canonical (B, H, N, d) form and the resolved options."""

    q: torch.Tensor  # (B, Hq, Nq, d)
    k: torch.Tensor  # (B, Hk, Nk, d)
    v: torch.Tensor  # (B, Hk, Nk, d)
    dout: torch.Tensor  # (B, Hq, Nq, d)
    added: int  # leading dims check_qkv added (0, 1 or 2)
    scale: float
    left: int
    right: int
    softcap: float
    slopes: torch.Tensor | None  # (B, Hq) or None
    dropout_p: float
    keep: torch.Tensor | None  # bool view broadcast to (B, Hq, Nq, Nk), or None
    block_mask: BlockMask | None
    blocks: torch.Tensor | None  # bool (B, Hq, Tr, Tc) view of block_mask, or None

    @property
    def dims(self) -> tuple[int, int, int, int, int, int]:
        """(B, Hq, Hk, Nq, Nk, d)."""
        b, hq, nq, d = self.q.shape
        return b, hq, self.k.shape[1], nq, self.k.shape[2], d


# ---------------------------------------------------------------------------
# Input checks


def _check_block_mask(block_mask: BlockMask | None, b: int, hq: int, nq: int, nk: int) -> torch.Tensor | None:
    """The block grid of ``block_mask`` as a bool (B, Hq, Tr, Tc) view (its leading dims broadcast)."""
    if block_mask is None:
        return None
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a flashtile.reference.masks.BlockMask or None, got {type(block_mask).__name__}")
    block_mask.check_seqlens(nq, nk)
    grid = (b, hq, *block_mask.shape)
    if block_mask.mask.dim() > 4:
        raise ValueError(f"block_mask.mask must have at most 4 dims (B, H, Tr, Tc), got {tuple(block_mask.mask.shape)}")
    try:
        return block_mask.mask.broadcast_to(grid)
    except RuntimeError:
        raise ValueError(
            f"block_mask.mask of shape {tuple(block_mask.mask.shape)} does not broadcast to (B, Hq, Tr, Tc) = {grid}"
        ) from None


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    *,
    softmax_scale: float | None,
    causal: bool,
    window_size: Sequence[int] | None,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    dropout_p: float,
    dropout_mask: torch.Tensor | None,
    block_mask: BlockMask | None,
    dtype: torch.dtype | None,
) -> _Problem:
    """Validate every argument shared by the two backward functions."""
    checks.compute_dtype(dtype)
    q_shape = q.shape if isinstance(q, torch.Tensor) else None
    q4, k4, v4, added = check_qkv(q, k, v, dtype)
    dout4 = checks.tensor_like(dout, "dout", q_shape, dtype).reshape(q4.shape)
    b, hq, nq, d = q4.shape
    nk = k4.shape[2]
    left, right = normalize_window(bool(causal), window_size)
    p, keep = checks.dropout(dropout_p, dropout_mask, (b, hq, nq, nk))
    return _Problem(
        q=q4,
        k=k4,
        v=v4,
        dout=dout4,
        added=added,
        scale=checks.softmax_scale(softmax_scale, d),
        left=left,
        right=right,
        softcap=checks.softcap(softcap),
        slopes=checks.alibi_slopes(alibi_slopes, b, hq, q4.dtype),
        dropout_p=p,
        keep=keep,
        block_mask=block_mask,
        blocks=_check_block_mask(block_mask, b, hq, nq, nk),
    )


def _restore(x: torch.Tensor, added: int) -> torch.Tensor:
    """Drop the leading dims that :func:`check_qkv` added, giving back the input's rank."""
    for _ in range(added):
        x = x.squeeze(0)
    return x


# ---------------------------------------------------------------------------
# Tiles


def _window_hits(r0: int, r1: int, c0: int, c1: int, shift: int, left: int, right: int) -> bool:
    """True when the window allows some element of rows [r0, r1) x columns [c0, c1).

    Row i allows columns [i + shift - left, i + shift + right]; over the rows
    of the tile these intervals slide by one, so their union is the single
    interval [r0 + shift - left, r1 - 1 + shift + right].
    """
    if left >= 0 and c1 - 1 < r0 + shift - left:
        return False
    if right >= 0 and c0 > r1 - 1 + shift + right:
        return False
    return True


def _window_tile(r0: int, r1: int, c0: int, c1: int, shift: int, left: int, right: int, device) -> torch.Tensor:
    """Bool (r1 - r0, c1 - c0): the window part of ``allowed_ij`` (masks.py) with global indices."""
    i = torch.arange(r0, r1, device=device).unsqueeze(1)
    j = torch.arange(c0, c1, device=device).unsqueeze(0)
    ok = torch.ones(r1 - r0, c1 - c0, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= i + shift - left
    if right >= 0:
        ok &= j <= i + shift + right
    return ok


def _visits(pb: _Problem, br: int, bc: int) -> torch.Tensor:
    """Bool (B, Hq, Tr, Tc): tile (I, J) of head (b, h) is visited (module docstring)."""
    b, hq, _, nq, nk, _ = pb.dims
    tr, tc = math.ceil(nq / br), math.ceil(nk / bc)
    window = torch.tensor(
        [
            [_window_hits(i * br, min(nq, (i + 1) * br), j * bc, min(nk, (j + 1) * bc), nk - nq, pb.left, pb.right)
             for j in range(tc)]
            for i in range(tr)
        ],
        dtype=torch.bool,
    ).reshape(tr, tc)
    vis = window.expand(b, hq, tr, tc)
    return vis & pb.blocks if pb.blocks is not None else vis.clone()


def _tile_ops(pb: _Problem) -> int:
    """nonmatmul flops per element of a visited tile, for the options in force."""
    ops = _OPS_BASE
    if pb.softcap > 0:
        ops += _OPS_SOFTCAP
    if pb.slopes is not None:
        ops += _OPS_ALIBI
    if pb.keep is not None:
        ops += _OPS_DROPOUT
    return ops


def _scores(pb: _Problem, qi: torch.Tensor, kj: torch.Tensor, slopes: torch.Tensor | None, r0: int, c0: int):
    """Recompute the score tile: returns (S after softcap and ALiBi, tanh(S_raw/cap) or None).

    ``qi`` (n, br, d), ``kj`` (n, bc, d) for the n visiting heads; ``slopes`` (n,).
    """
    _, _, _, nq, nk, _ = pb.dims
    s = pb.scale * (qi @ kj.transpose(-1, -2))
    t = None
    if pb.softcap > 0:
        t = torch.tanh(s / pb.softcap)
        s = pb.softcap * t
    if slopes is not None:
        # masks.apply_score_mods owns the bias; the n visiting heads play the role of H
        s = apply_score_mods(s.unsqueeze(0), alibi_slopes=slopes, q_start=r0, k_start=c0, nq=nq, nk=nk).squeeze(0)
    return s, t


def _probabilities(s: torch.Tensor, lse: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``P = exp(S - lse)`` on allowed entries of rows with a finite lse, 0 elsewhere.

    ``lse = -inf`` marks a fully masked row: it is replaced by 0 before the
    subtraction so that no ``exp(+inf)`` is ever formed, then masked out.
    """
    live = torch.isfinite(lse).unsqueeze(-1)
    lse_safe = torch.where(live, lse.unsqueeze(-1), torch.zeros_like(lse.unsqueeze(-1)))
    return torch.where(allowed & live, torch.exp(s - lse_safe), torch.zeros_like(s))


def _keep_scale(keep: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    """``Z / (1 - p)`` as a select between ``1/(1-p)`` and 0."""
    kept = torch.tensor(1.0 / (1.0 - p), dtype=dtype, device=keep.device)
    return torch.where(keep, kept, torch.zeros((), dtype=dtype, device=keep.device))


def _grad_scores(pb: _Problem, p: torch.Tensor, dp: torch.Tensor, d_rows: torch.Tensor, t: torch.Tensor | None):
    """``scale * dS_raw``: the softmax Jacobian, then the softcap chain rule, then the score scale.

        dS     = P * (dP - D)               (D_i = rowsum(dO_i * O_i))
        dS_raw = dS * (1 - tanh^2(S_raw / cap))   when softcap > 0
    ALiBi is additive: it passes dS through unchanged.
    """
    ds = p * (dp - d_rows.unsqueeze(-1))
    if t is not None:
        ds = ds * (1.0 - t * t)
    return pb.scale * ds


# ---------------------------------------------------------------------------
# Backward by recomputation


def _preprocess(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """``D = rowsum(dO * O)`` (FA2 Algorithm 2's preprocessing): (B, Hq, Nq)."""
    return (dout * out).sum(dim=-1)


def _kv_block(
    pb: _Problem,
    j: int,
    bc: int,
    br: int,
    kx: torch.Tensor,
    vx: torch.Tensor,
    lse: torch.Tensor,
    d_rows: torch.Tensor,
    dq: torch.Tensor,
    visits: torch.Tensor,
    counts: IOCounts,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One iteration of the outer loop: the (B, Hq, bc_J, d) tiles dK_J, dV_J.

    Accumulates into ``dq`` (the read-modify-write of dQ_I in HBM) and into ``counts``.
    """
    b, hq, _, nq, nk, d = pb.dims
    c0, c1 = j * bc, min(nk, (j + 1) * bc)
    kj_all, vj_all = kx[:, :, c0:c1], vx[:, :, c0:c1]  # load K_J, V_J
    counts.read(b * hq * 2 * (c1 - c0) * d)
    dk_j = torch.zeros_like(kj_all)  # on chip
    dv_j = torch.zeros_like(vj_all)
    ops = _tile_ops(pb)
    for i in range(visits.shape[2]):
        vis = visits[:, :, i, j]  # (B, Hq) heads for which tile (I, J) is visited
        n = int(vis.sum())
        if n == 0:
            continue
        r0, r1 = i * br, min(nq, (i + 1) * br)
        rows, cols = r1 - r0, c1 - c0
        qi, doi = pb.q[:, :, r0:r1][vis], pb.dout[:, :, r0:r1][vis]  # (n, br, d)
        lse_i, d_i = lse[:, :, r0:r1][vis], d_rows[:, :, r0:r1][vis]  # (n, br)
        kj, vj = kj_all[vis], vj_all[vis]  # (n, bc, d)
        counts.read(n * (3 * rows * d + 2 * rows))  # Q_I, dO_I, dQ_I; lse_I, D_I
        slopes = pb.slopes[vis] if pb.slopes is not None else None
        s, t = _scores(pb, qi, kj, slopes, r0, c0)
        allowed = _window_tile(r0, r1, c0, c1, nk - nq, pb.left, pb.right, s.device)
        p = _probabilities(s, lse_i, allowed)
        dp = doi @ vj.transpose(-1, -2)
        if pb.keep is not None:
            z = _keep_scale(pb.keep[:, :, r0:r1, c0:c1][vis], pb.dropout_p, p.dtype)
            dv_j[vis] += (p * z).transpose(-1, -2) @ doi
            dp = dp * z
        else:
            dv_j[vis] += p.transpose(-1, -2) @ doi
        ds = _grad_scores(pb, p, dp, d_i, t)  # already carries the score scale
        dq[:, :, r0:r1][vis] += ds @ kj  # write dQ_I back
        counts.write(n * rows * d)
        dk_j[vis] += ds.transpose(-1, -2) @ qi
        counts.flops += n * _MATMULS_PER_TILE * 2 * rows * cols * d
        counts.nonmatmul_flops += n * ops * rows * cols
        counts.visited_blocks += n
    counts.write(b * hq * 2 * (c1 - c0) * d)  # write dK_J, dV_J
    return dk_j, dv_j


def _reduce_gqa(x: torch.Tensor, hk: int) -> torch.Tensor:
    """Sum the expanded (B, Hq, N, d) gradient over the Hq/Hk query heads of each kv head."""
    b, hq, n, d = x.shape
    return x.view(b, hk, hq // hk, n, d).sum(dim=2)


def flash_attn_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] | None = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
    block_sizes: Sequence[int] = (64, 64),
    dtype: torch.dtype | None = torch.float64,
) -> BackwardResult:
    """Gradients of attention by recomputation (FA1 Algorithm 4, FA2 Algorithm 2), instrumented.

    Shapes: q, out, dout (B, Hq, Nq, d); k, v (B, Hk, Nk, d) with Hq a
    multiple of Hk (GQA: q head h uses kv head h // (Hq/Hk)); lse (B, Hq, Nq)
    natural log, -inf on fully masked rows.  2-D (N, d) and 3-D (H, N, d)
    inputs are accepted (lse then (Nq,) or (H, Nq)) and the gradients come
    back in the input's rank.  The options have the meaning of
    :mod:`flashtile.reference.masks`; ``dropout_mask`` is the bool keep mask
    the forward used, of any rank that broadcasts to (B, Hq, Nq, Nk) (the
    forward accepts the same masks), required when ``dropout_p > 0``.  ``block_sizes = (Br, Bc)`` are the tiles,
    replaced by ``block_mask.block_size`` when a block mask is given.
    Computation in ``dtype`` (None: q's dtype).

    Returns dq like q, dk and dv like k and v (dK, dV of a kv head summed
    over the query heads sharing it) and the counts of the module docstring:
    per (batch, query head)
    ``reads = 2 Nq d + sum_J [2 bc_J d + sum_{I in V_J} (3 br_I d + 2 br_I)]``,
    ``writes = Nq + sum_J [2 bc_J d + sum_{I in V_J} br_I d]``,
    ``flops = 10 br_I bc_J d`` per visited tile (2.5 x the forward's 4 Nq Nk d
    when dense).  Raises ValueError/TypeError naming the bad argument.
    """
    pb = _prepare(
        q, k, v, dout,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_mask=dropout_mask,
        block_mask=block_mask, dtype=dtype,
    )
    b, hq, hk, nq, nk, d = pb.dims
    out4 = checks.tensor_like(out, "out", q.shape, dtype).reshape(pb.q.shape)
    lse4 = checks.tensor_like(lse, "lse", q.shape[:-1], dtype).reshape(b, hq, nq)
    if torch.isnan(lse4).any() or torch.isposinf(lse4).any():
        raise ValueError("lse must be finite or -inf (fully masked rows); it contains NaN or +inf")
    br, bc = block_mask.block_size if block_mask is not None else checks.block_sizes(block_sizes)

    counts = IOCounts()
    d_rows = _preprocess(out4, pb.dout)
    counts.read(b * hq * 2 * nq * d)  # O, dO
    counts.write(b * hq * nq)  # D
    counts.nonmatmul_flops += b * hq * 2 * nq * d
    dq = torch.zeros_like(pb.q)
    counts.extras["init_writes"] = b * hq * nq * d  # dQ = 0 in HBM

    kx, vx = expand_kv(pb.k, hq), expand_kv(pb.v, hq)
    dk_x, dv_x = torch.zeros_like(kx), torch.zeros_like(vx)  # per-query-head dK, dV
    visits = _visits(pb, br, bc)
    for j in range(visits.shape[3]):
        c0, c1 = j * bc, min(nk, (j + 1) * bc)
        dk_x[:, :, c0:c1], dv_x[:, :, c0:c1] = _kv_block(pb, j, bc, br, kx, vx, lse4, d_rows, dq, visits, counts)
    counts.skipped_blocks = visits.numel() - counts.visited_blocks

    grouped = hq != hk
    counts.extras["gqa_reduce_reads"] = 2 * b * hq * nk * d if grouped else 0
    counts.extras["gqa_reduce_writes"] = 2 * b * hk * nk * d if grouped else 0
    counts.nonmatmul_flops += 2 * b * (hq - hk) * nk * d
    counts.extra_memory = b * hq * nq + (2 * b * hq * nk * d if grouped else 0)
    dk, dv = _reduce_gqa(dk_x, hk), _reduce_gqa(dv_x, hk)
    return BackwardResult(_restore(dq, pb.added), _restore(dk, pb.added), _restore(dv, pb.added), counts)


# ---------------------------------------------------------------------------
# Dense baseline


def standard_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] | None = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
    dtype: torch.dtype | None = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense backward of standard attention (FA1 Appendix B.2): P, dP and dS materialised.

    Recomputes the forward in full: ``S`` (B, Hq, Nq, Nk) with the score
    mods, ``P = softmax`` over allowed keys (0 on fully masked rows), then

        dV = P_d^T dO,   dP = (dO V^T) * Z/(1-p),   D_i = sum_j P_ij dP_ij,
        dS = P * (dP - D),   dQ = scale * dS_raw K,   dK = scale * dS_raw^T Q

    with ``P_d = P * Z/(1-p)`` and ``dS_raw`` the softcap chain rule applied
    to dS.  Same arguments and shapes as :func:`flash_attn_backward` (no
    out/lse: they are recomputed; no tiles).  Returns ``(dq, dk, dv)`` in the
    input's rank.  Uncounted: it is the O(Nq Nk)-memory baseline.
    """
    pb = _prepare(
        q, k, v, dout,
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_mask=dropout_mask,
        block_mask=block_mask, dtype=dtype,
    )
    b, hq, hk, nq, nk, d = pb.dims
    kx, vx = expand_kv(pb.k, hq), expand_kv(pb.v, hq)
    s = pb.scale * (pb.q @ kx.transpose(-1, -2))
    t = None
    if pb.softcap > 0:
        t = torch.tanh(s / pb.softcap)
        s = pb.softcap * t
    s = apply_score_mods(s, alibi_slopes=pb.slopes)
    allowed = allowed_mask(nq, nk, window_size=(pb.left, pb.right), block_mask=pb.block_mask).to(s.device)
    allowed = allowed.expand(b, hq, nq, nk)
    live = allowed.any(dim=-1, keepdim=True)
    # fully masked rows: softmax over a row of zeros, then masked to 0 -- never -inf - -inf
    s_live = torch.where(allowed, s, torch.full_like(s, float("-inf")))
    s_live = torch.where(live, s_live, torch.zeros_like(s))
    p = torch.where(allowed, torch.softmax(s_live, dim=-1), torch.zeros_like(s))
    dp = pb.dout @ vx.transpose(-1, -2)
    if pb.keep is not None:
        z = _keep_scale(pb.keep, pb.dropout_p, p.dtype)
        p_d, dp = p * z, dp * z
    else:
        p_d = p
    d_rows = (p * dp).sum(dim=-1)
    ds = _grad_scores(pb, p, dp, d_rows, t)
    dq = ds @ kx
    dk = _reduce_gqa(ds.transpose(-1, -2) @ pb.q, hk)
    dv = _reduce_gqa(p_d.transpose(-1, -2) @ pb.dout, hk)
    return _restore(dq, pb.added), _restore(dk, pb.added), _restore(dv, pb.added)
