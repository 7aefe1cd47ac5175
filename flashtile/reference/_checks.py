"""Argument checks shared by the reference forward, backward and decoding.

Each check raises ``TypeError`` for an argument of the wrong kind and
``ValueError`` for one of the right kind with a bad value; the message names
the argument and says what is accepted.  Each returns the value in the form
the algorithms use (a Python float or int, a tensor cast or broadcast), so a
caller writes ``scale = softmax_scale(value, d)`` and never re-checks.
"""

from __future__ import annotations

import math
import numbers

import torch

from flashtile.reference._common import as_float

__all__ = [
    "check_real",
    "positive_int",
    "compute_dtype",
    "softmax_scale",
    "softcap",
    "alibi_slopes",
    "broadcast_bool",
    "dropout",
    "block_sizes",
    "tensor_like",
]

_FULL = "(B, Hq, Nq, Nk)"


def check_real(value: object, name: str, *, minimum: float | None = None, what: str = "a real number") -> float:
    """``value`` as a finite float, at least ``minimum`` when that is given.

    Accepts any ``numbers.Real`` (int, float, NumPy scalars) and 0-dim real
    tensors; rejects bool (``True`` is not a scale) and strings with
    ``TypeError``, and NaN, +-inf or a value below ``minimum`` with
    ``ValueError``.  ``what`` names the accepted kind in the TypeError message.
    """
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool and not value.is_complex():
        # decoding accepted 0-dim tensors (e.g. a phi computed with torch): keep that
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    x = float(value)
    if minimum is None:
        if not math.isfinite(x):
            raise ValueError(f"{name} must be finite, got {value!r}")
    elif not (math.isfinite(x) and x >= minimum):
        raise ValueError(f"{name} must be >= {minimum:g} and finite, got {value!r}")
    return x


def positive_int(value: object, name: str) -> int:
    """``value`` as an int >= 1: ``TypeError`` for a non-integer (bool and 2.0 included), ``ValueError`` below 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value}")
    return int(value)


def compute_dtype(dtype: object) -> torch.dtype | None:
    """``dtype`` is a floating ``torch.dtype`` or None (None keeps the inputs' dtype); ``TypeError`` otherwise."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(
            f"dtype must be a floating torch.dtype (e.g. torch.float64) or None (keep the inputs' dtype), got {dtype!r}"
        )
    return dtype


def softmax_scale(value: object, d: int) -> float:
    """The score scale: ``1/sqrt(d)`` for None, otherwise a finite real number (any sign)."""
    if value is None:
        return 1.0 / math.sqrt(d)
    return check_real(value, "softmax_scale", what="a real number or None (= 1/sqrt(d))")


def softcap(value: object) -> float:
    """The tanh softcap: a finite real number >= 0, where 0 disables it."""
    return check_real(value, "softcap", minimum=0.0, what="a real number >= 0 (0 disables it)")


def alibi_slopes(slopes: object, b: int, h: int, dtype: torch.dtype | None) -> torch.Tensor | None:
    """ALiBi slopes of shape (Hq,) or (B, Hq), returned as a (B, Hq) tensor in ``dtype``; None stays None.

    A (Hq,) vector is shared by every batch element (a broadcast view, no
    copy).  ``TypeError`` for anything but a floating tensor, ``ValueError``
    for any other shape.  ``dtype`` None keeps the slopes' own dtype.
    """
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor) or not slopes.is_floating_point():
        got = f"dtype {slopes.dtype}" if isinstance(slopes, torch.Tensor) else type(slopes).__name__
        raise TypeError(f"alibi_slopes must be a floating torch.Tensor of shape (Hq,) or (B, Hq), got {got}")
    if tuple(slopes.shape) not in ((h,), (b, h)):
        raise ValueError(
            f"alibi_slopes must have shape (Hq,) = ({h},) or (B, Hq) = ({b}, {h}), got {tuple(slopes.shape)}"
        )
    slopes = as_float(slopes, "alibi_slopes", dtype)
    return slopes.expand(b, h)


def broadcast_bool(x: torch.Tensor, shape: tuple[int, ...], name: str, dims: str = _FULL) -> torch.Tensor:
    """``x`` broadcast (a view) to ``shape``, whose axes ``dims`` names; ``ValueError`` naming ``name`` if it cannot be."""
    try:
        return torch.broadcast_to(x, shape)
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(x.shape)} is not broadcastable to {dims} = {tuple(shape)}") from None


def dropout(p: object, mask: object, shape: tuple[int, int, int, int]) -> tuple[float, torch.Tensor | None]:
    """``(p, keep)``: ``dropout_p`` in [0, 1) and the bool keep mask broadcast to ``shape`` = (B, Hq, Nq, Nk).

    The mask may have any rank up to 4 as long as it broadcasts (right-aligned,
    as in torch): (Nq, Nk), (Hq, Nq, Nk), (1, Hq, Nq, Nk), ... whatever the
    rank of q, k, v.  It is required when p > 0 and, when given, used whatever
    p is (with p = 0 it still drops entries, scaling the kept ones by 1).
    ``keep`` is None when there is no mask.
    """
    p = check_real(p, "dropout_p", what="a real number in [0, 1)")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    if mask is None:
        if p > 0:
            raise ValueError(
                f"dropout_p = {p} > 0 needs an explicit dropout_mask (bool, True = keep) "
                f"broadcastable to {_FULL} = {tuple(shape)}"
            )
        return p, None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = f"dtype {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"dropout_mask must be a torch.bool tensor (True = keep) broadcastable to {_FULL}, got {got}")
    return p, broadcast_bool(mask, shape, "dropout_mask")


def block_sizes(value: object, name: str = "block_sizes") -> tuple[int, int]:
    """``(Br, Bc)``: a pair of positive ints (NumPy ints too, bools not); ``ValueError`` otherwise."""
    try:
        br, bc = value  # type: ignore[misc]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair of positive ints (Br, Bc), got {value!r}") from None
    if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1 for x in (br, bc)):
        raise ValueError(f"{name} must be a pair of positive ints (Br, Bc), got {value!r}")
    return int(br), int(bc)


def tensor_like(x: object, name: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    """``x`` a floating tensor of exactly ``shape`` (cast to ``dtype``; None keeps its own)."""
    x = as_float(x, name, dtype)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    return x
