"""Attention masks and score modifiers, defined once for every algorithm.

Every reference algorithm and every Triton kernel in flashtile computes the
same function.  For one (batch b, query head h) pair, query row i and key
column j (0-indexed), with ``shift = Nk - Nq`` (bottom-right alignment, as
flash-attn >= 2.1):

    s_ij = scale * <q_i, k_j>                                  (raw score)
    s_ij = softcap * tanh(s_ij / softcap)        if softcap > 0
    s_ij = s_ij - slope_h * |i + shift - j|      if alibi_slopes is given
    allowed_ij = (left  < 0 or j >= i + shift - left)
             and (right < 0 or j <= i + shift + right)
             and block_mask[i // Br, j // Bc]     if a BlockMask is given
    p_ij  = exp(s_ij - lse_i) if allowed_ij else 0
    lse_i = log sum_{j allowed} exp(s_ij)  (-inf when row i has no allowed key)
    o_i   = sum_j p_ij * keep_ij / (1 - dropout_p) * v_j

``causal=True`` is the window ``(left, 0)``: it sets ``right = 0`` and keeps
``left``.  A row with no allowed key has output 0 and LSE -inf, never NaN.
Dropout is applied to P after the LSE is taken, with an explicit boolean
``keep`` mask so that kernels can be checked element by element.

This module owns that definition: :func:`allowed_mask`, :func:`score_bias`
and :func:`apply_score_mods` build it as dense tensors, and :class:`BlockMask`
is the block-level mask of block-sparse FlashAttention (Algorithm 5).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "normalize_window",
    "allowed_mask",
    "alibi_bias",
    "apply_score_mods",
    "BlockMask",
]


def normalize_window(causal: bool, window_size: Sequence[int] | None) -> tuple[int, int]:
    """Return ``(left, right)`` with -1 meaning unbounded; causal forces right = 0.

    Raises ``ValueError`` for a window that is not two integers >= -1.
    """
    if window_size is None:
        window_size = (-1, -1)
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(
            f"window_size must be a pair of ints (left, right) with -1 meaning unbounded, got {window_size!r}"
        ) from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {(left, right)}")
    if causal:
        if right > 0:
            raise ValueError(
                f"causal=True means window_size right = 0; got window_size={(left, right)}. "
                "Use causal=False with an explicit window for a look-ahead window."
            )
        right = 0
    return left, right


def allowed_mask(
    nq: int,
    nk: int,
    *,
    causal: bool = False,
    window_size: Sequence[int] | None = (-1, -1),
    block_mask: "BlockMask | None" = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean (Nq, Nk) mask (or (..., Nq, Nk) with a batched BlockMask): True where q_i may see k_j."""
    left, right = normalize_window(causal, window_size)
    i = torch.arange(nq, device=device).unsqueeze(1)
    j = torch.arange(nk, device=device).unsqueeze(0)
    diag = i + (nk - nq)
    ok = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    if block_mask is not None:
        ok = ok & block_mask.to_dense(nq, nk).to(device=ok.device)
    return ok


def alibi_bias(slopes: torch.Tensor, nq: int, nk: int) -> torch.Tensor:
    """ALiBi bias ``-slope_h * |i + Nk - Nq - j|``; slopes (H,) or (B, H) -> (..., H, Nq, Nk)."""
    i = torch.arange(nq, device=slopes.device).unsqueeze(1)
    j = torch.arange(nk, device=slopes.device).unsqueeze(0)
    dist = (i + (nk - nq) - j).abs().to(torch.float64)
    return -slopes.to(torch.float64)[..., None, None] * dist


def apply_score_mods(
    s: torch.Tensor,
    *,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    q_start: int = 0,
    k_start: int = 0,
    nq: int | None = None,
    nk: int | None = None,
) -> torch.Tensor:
    """Softcap then ALiBi on already-scaled scores ``s`` of shape (B, H, rows, cols).

    ``q_start``/``k_start`` locate the tile inside the full (Nq, Nk) score
    matrix so that blocked algorithms apply the bias with global indices.
    """
    if softcap and softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        rows, cols = s.shape[-2], s.shape[-1]
        nq = rows if nq is None else nq
        nk = cols if nk is None else nk
        i = torch.arange(q_start, q_start + rows, device=s.device).unsqueeze(1)
        j = torch.arange(k_start, k_start + cols, device=s.device).unsqueeze(0)
        dist = (i + (nk - nq) - j).abs().to(s.dtype)
        slopes = alibi_slopes.to(device=s.device, dtype=s.dtype)
        if slopes.dim() == 1:  # (H,)
            slopes = slopes.view(1, -1, 1, 1)
        else:  # (B, H)
            slopes = slopes.view(slopes.shape[0], slopes.shape[1], 1, 1)
        s = s - slopes * dist
    return s


def _count(value: object, name: str, minimum: int) -> int:
    """``value`` as an int >= ``minimum``: a Python or NumPy integer (not a bool, not a float such as 64.0)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _block_size(value: object, name: str) -> tuple[int, int]:
    """(Br, Bc) from an int (square blocks) or a pair of ints, each >= 1."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name} must be an int or a pair of ints (Br, Bc), got {value!r}")
        return _count(value[0], name, 1), _count(value[1], name, 1)
    return (_count(value, name, 1),) * 2


@dataclass(frozen=True)
class BlockMask:
    """Block-level mask of block-sparse FlashAttention (Algorithm 5).

    ``mask`` is a boolean tensor of shape (..., Tr, Tc) (leading dims broadcast
    over batch and heads); block (r, c) covers query rows [r*Br, (r+1)*Br) and
    key columns [c*Bc, (c+1)*Bc).  A False block is skipped entirely: no HBM
    traffic and no FLOPs.  The sparsity ``s`` of the paper is the fraction of
    blocks kept (``density``), so block-sparse IO is ``Theta(Nd + N^2 d^2 s / M)``.
    ``block_size`` is (Br, Bc) or one int for square blocks; sizes, counts and
    strides must be integers (64.0 is refused, not truncated).
    """

    mask: torch.Tensor
    block_size: tuple[int, int]

    def __post_init__(self) -> None:
        if not isinstance(self.mask, torch.Tensor):
            raise TypeError(
                f"BlockMask.mask must be a torch.bool tensor of shape (..., Tr, Tc), got {type(self.mask).__name__}"
            )
        if self.mask.dtype != torch.bool:
            raise TypeError(
                f"BlockMask.mask must be a torch.bool tensor of shape (..., Tr, Tc) (one entry per block), got "
                f"dtype {self.mask.dtype}; build one from an element mask with BlockMask.from_element_mask"
            )
        if self.mask.dim() < 2:
            raise ValueError(f"BlockMask.mask must have at least 2 dims (Tr, Tc), got shape {tuple(self.mask.shape)}")
        object.__setattr__(self, "block_size", _block_size(self.block_size, "BlockMask.block_size"))

    # -- geometry -----------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        """(Tr, Tc): number of query and key blocks."""
        return int(self.mask.shape[-2]), int(self.mask.shape[-1])

    @property
    def density(self) -> float:
        """Fraction of blocks kept: the sparsity factor s of Algorithm 5."""
        return float(self.mask.float().mean())

    @property
    def sparsity(self) -> float:
        """Alias for :attr:`density` (the paper calls the kept fraction s)."""
        return self.density

    def check_seqlens(self, nq: int, nk: int) -> None:
        """Raise ``ValueError`` unless the block grid covers exactly (Nq, Nk)."""
        br, bc = self.block_size
        want = (math.ceil(nq / br) if nq else 0, math.ceil(nk / bc) if nk else 0)
        if self.shape != want:
            raise ValueError(
                f"block_mask has block grid {self.shape} for block_size {self.block_size}, "
                f"but seqlen_q={nq}, seqlen_k={nk} need {want} = (ceil(Nq/Br), ceil(Nk/Bc))"
            )

    def to_dense(self, nq: int, nk: int) -> torch.Tensor:
        """Expand to a boolean element mask of shape (..., Nq, Nk)."""
        self.check_seqlens(nq, nk)
        br, bc = self.block_size
        m = self.mask.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)
        return m[..., :nq, :nk]

    # -- composition ----------------------------------------------------------
    def _combine(self, other: "BlockMask", op) -> "BlockMask":
        if not isinstance(other, BlockMask):
            return NotImplemented
        if other.block_size != self.block_size or other.shape != self.shape:
            raise ValueError(
                f"cannot combine BlockMasks with grids {self.shape}@{self.block_size} and {other.shape}@{other.block_size}"
            )
        return BlockMask(op(self.mask, other.mask), self.block_size)

    def __and__(self, other: "BlockMask") -> "BlockMask":
        return self._combine(other, torch.logical_and)

    def __or__(self, other: "BlockMask") -> "BlockMask":
        return self._combine(other, torch.logical_or)

    def __invert__(self) -> "BlockMask":
        return BlockMask(~self.mask, self.block_size)

    # -- constructors ---------------------------------------------------------
    @staticmethod
    def _grid(nq: int, nk: int, block_size: tuple[int, int] | int) -> tuple[int, int, int, int]:
        br, bc = _block_size(block_size, "block_size")
        nq, nk = _count(nq, "nq", 0), _count(nk, "nk", 0)
        return br, bc, math.ceil(nq / br), math.ceil(nk / bc)

    @classmethod
    def from_element_mask(cls, allowed: torch.Tensor, block_size: tuple[int, int] | int) -> "BlockMask":
        """Keep every block that contains at least one allowed element (``allowed``: bool, (..., Nq, Nk))."""
        if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
            got = allowed.dtype if isinstance(allowed, torch.Tensor) else type(allowed).__name__
            raise TypeError(f"allowed must be a torch.bool element mask of shape (..., Nq, Nk), got {got}")
        if allowed.dim() < 2:
            raise ValueError(f"allowed must have at least 2 dims (Nq, Nk), got shape {tuple(allowed.shape)}")
        nq, nk = allowed.shape[-2], allowed.shape[-1]
        br, bc, tr, tc = cls._grid(nq, nk, block_size)
        pad = torch.zeros(*allowed.shape[:-2], tr * br, tc * bc, dtype=torch.bool, device=allowed.device)
        pad[..., :nq, :nk] = allowed
        blocks = pad.view(*allowed.shape[:-2], tr, br, tc, bc).any(dim=-1).any(dim=-2)
        return cls(blocks, (br, bc))

    @classmethod
    def dense(cls, nq: int, nk: int, block_size: tuple[int, int] | int = 64) -> "BlockMask":
        br, bc, tr, tc = cls._grid(nq, nk, block_size)
        return cls(torch.ones(tr, tc, dtype=torch.bool), (br, bc))

    @classmethod
    def causal(cls, nq: int, nk: int, block_size: tuple[int, int] | int = 64) -> "BlockMask":
        """Blocks touched by the bottom-right-aligned causal mask."""
        br, bc, _, _ = cls._grid(nq, nk, block_size)
        return cls.from_element_mask(allowed_mask(nq, nk, causal=True), (br, bc))

    @classmethod
    def sliding_window(
        cls, nq: int, nk: int, window_size: Sequence[int], block_size: tuple[int, int] | int = 64
    ) -> "BlockMask":
        """Blocks touched by the element window (left, right)."""
        br, bc, _, _ = cls._grid(nq, nk, block_size)
        return cls.from_element_mask(allowed_mask(nq, nk, window_size=window_size), (br, bc))

    @classmethod
    def global_local(
        cls,
        nq: int,
        nk: int,
        *,
        global_blocks: int = 1,
        local_blocks: int = 1,
        block_size: tuple[int, int] | int = 64,
    ) -> "BlockMask":
        """Longformer/BigBird-style: ``global_blocks`` leading block rows and columns
        see / are seen by everything, plus a band of ``local_blocks`` blocks on each
        side of the (block) diagonal."""
        br, bc, tr, tc = cls._grid(nq, nk, block_size)
        global_blocks, local_blocks = _count(global_blocks, "global_blocks", 0), _count(local_blocks, "local_blocks", 0)
        r = torch.arange(tr).unsqueeze(1)
        c = torch.arange(tc).unsqueeze(0)
        # align the band bottom-right like the causal mask: diagonal block of row r
        diag = (r * br + (nk - nq)).clamp(min=0) // bc
        m = (c - diag).abs() <= local_blocks
        m |= r < global_blocks
        m |= c < global_blocks
        return cls(m, (br, bc))

    @classmethod
    def strided(
        cls, nq: int, nk: int, *, stride: int, block_size: tuple[int, int] | int = 64, local_blocks: int = 0
    ) -> "BlockMask":
        """Sparse-Transformer strided pattern: block (r, c) is kept when
        ``(diag(r) - c) % stride == 0`` or it lies within ``local_blocks`` of the diagonal."""
        stride, local_blocks = _count(stride, "stride", 1), _count(local_blocks, "local_blocks", 0)
        br, bc, tr, tc = cls._grid(nq, nk, block_size)
        r = torch.arange(tr).unsqueeze(1)
        c = torch.arange(tc).unsqueeze(0)
        diag = (r * br + (nk - nq)).clamp(min=0) // bc
        m = ((diag - c) % stride == 0) | ((c - diag).abs() <= local_blocks)
        return cls(m, (br, bc))

    @classmethod
    def random(
        cls, nq: int, nk: int, density: float, block_size: tuple[int, int] | int = 64, generator: torch.Generator | None = None
    ) -> "BlockMask":
        """Each block kept independently with probability ``density`` (for tests and benchmarks)."""
        if not 0.0 <= density <= 1.0:
            raise ValueError(f"density must be in [0, 1], got {density}")
        br, bc, tr, tc = cls._grid(nq, nk, block_size)
        return cls(torch.rand(tr, tc, generator=generator) < density, (br, bc))
