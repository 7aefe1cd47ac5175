"""FP8 (``torch.float8_e4m3fn``) quantisation helpers and FA3's incoherent processing.

FA3 (Shah et al. 2024, §3.3 "Low-precision with FP8") runs attention on e4m3
inputs, each with a float32 *descale*: the kernel multiplies its QKᵀ by
``q_descale * k_descale`` and its output by ``v_descale``.  Every quantiser
here returns ``(x_fp8, descale)`` with

    x ≈ x_fp8.float() * descale            (descale broadcast as documented per function)

and the scale taken from the amax of the group it covers: ``descale = amax / 448``
(448 is e4m3's largest finite value), so the group's largest entry maps to ±448.
A group of zeros gets ``descale = 1`` (and zeros), never NaN.  Non-finite inputs
raise ``ValueError`` naming the argument: an inf would make every other entry of
its group 0.  (That check reads one bool back from the device: the helpers are
for preparing inputs, not for a per-step hot path.)

Granularities (x in ``layout`` "bhnd" = (B, H, N, d), SDPA's, or "bnhd" =
(B, N, H, d), flash-attn's):

* :func:`quantize_per_tensor` -- one scale; ``descale`` 0-dim.
* :func:`quantize_per_head` -- one per (batch, head): ``descale`` (B, H), the
  shape FA3's ``q_descale`` / ``k_descale`` / ``v_descale`` take.  With
  ``kv_heads`` the query heads of a GQA group share one: (B, kv_heads), as FA3
  requires of ``q_descale``.
* :func:`quantize_per_block` -- one per block of ``block_size`` consecutive
  tokens of one head (FA3 §3.3 "block quantization"): ``descale``
  (B, H, ceil(N / block_size)).

:func:`dequantize` inverts each of them.  :func:`hadamard_rotate` is FA3's
*incoherent processing*: q and k multiplied along head_dim by the same random
orthogonal matrix ``M = diag(s) H_d / sqrt(d)`` (s random ±1, H_d the Sylvester
Hadamard matrix), so ``(qM)(kM)ᵀ = qkᵀ`` while an outlier in one channel is
spread over all d of them before quantising.
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = [
    "E4M3_MAX",
    "quantize_per_tensor",
    "quantize_per_head",
    "quantize_per_block",
    "dequantize",
    "expand_descale",
    "hadamard_matrix",
    "hadamard_rotate",
]

E4M3_MAX = 448.0  # largest finite float8_e4m3fn: 1.75 * 2^8
FP8 = torch.float8_e4m3fn
HADAMARD_MAX = 4096  # the largest order hadamard_matrix builds (a d x d float64 matrix: 128 MiB)
_LAYOUTS = ("bhnd", "bnhd")


# ---------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------


def _check_input(x: object, name: str, ndim: int | None = None) -> torch.Tensor:
    """``x`` a finite floating tensor (of rank ``ndim`` when given); TypeError / ValueError naming ``name``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.element_size() == 1:
        raise TypeError(f"{name} must be a 16-, 32- or 64-bit floating-point tensor (not already float8), got dtype "
                        f"{x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} must be finite: it has inf or NaN entries, which have no e4m3 scale")
    if x.dtype == torch.float64 and x.numel() and float(x.abs().amax()) > torch.finfo(torch.float32).max:
        raise ValueError(f"{name} has entries beyond float32's range (max |x| = {float(x.abs().amax()):g}): "
                         f"the descales are float32")
    return x


def _check_layout(layout: object) -> str:
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be 'bhnd' (B, H, N, d) or 'bnhd' (B, N, H, d), got {layout!r}")
    return layout  # type: ignore[return-value]


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value}")
    return int(value)


def _to_bhnd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x if layout == "bhnd" else x.transpose(1, 2)


# ---------------------------------------------------------------------------
# quantisers
# ---------------------------------------------------------------------------


def _descale(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` in float32, 1 where amax = 0 (an all-zero group quantises to zeros), amax itself where the
    quotient underflows to 0 (subnormal groups: x / amax stays within [-1, 1])."""
    amax = amax.to(torch.float32)
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal (1 ulp off the CPU's quotient)
    d = amax / torch.full_like(amax, E4M3_MAX)
    return torch.where(d > 0, d, torch.where(amax > 0, amax, torch.ones_like(amax)))


def _cast(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """``x / descale`` rounded to e4m3; the clamp keeps a quotient rounded above 448 by the division finite."""
    return (x.to(torch.float32) / descale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for all of ``x`` (any shape): ``descale`` is a 0-dim float32 tensor, ``x ≈ x_fp8.float() * descale``."""
    x = _check_input(x, "x")
    descale = _descale(x.abs().amax() if x.numel() else torch.zeros((), device=x.device))
    return _cast(x, descale), descale


def quantize_per_head(
    x: torch.Tensor, *, layout: str = "bhnd", kv_heads: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per (batch, head) of a 4-D ``x``: ``descale`` (B, H) float32.

    ``x ≈ x_fp8.float() * descale[:, :, None, None]`` for layout "bhnd" and
    ``* descale[:, None, :, None]`` for "bnhd".  With ``kv_heads`` (a divisor of
    H) the H / kv_heads query heads of each GQA group share one scale and
    ``descale`` is (B, kv_heads), FA3's shape for ``q_descale``; expand it with
    ``descale.repeat_interleave(H // kv_heads, dim=1)``.
    """
    layout = _check_layout(layout)
    x = _check_input(x, "x", 4)
    xb = _to_bhnd(x, layout)
    b, h = xb.shape[:2]
    groups = h if kv_heads is None else _positive_int(kv_heads, "kv_heads")
    if h % groups:
        raise ValueError(f"kv_heads ({groups}) must divide the number of heads of x ({h})")
    amax = xb.abs().reshape(b, groups, -1).amax(-1) if xb.numel() else torch.zeros(b, groups, device=x.device)
    descale = _descale(amax)
    per_head = descale.repeat_interleave(h // groups, dim=1)
    out = _cast(xb, per_head[:, :, None, None])
    return (out if layout == "bhnd" else out.transpose(1, 2)), descale


def quantize_per_block(
    x: torch.Tensor, block_size: int = 128, *, layout: str = "bhnd"
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per block of ``block_size`` consecutive tokens of one (batch, head): ``descale`` (B, H, ceil(N / block_size)).

    Token n of head h uses ``descale[b, h, n // block_size]`` (the last block may be
    partial): ``x ≈ x_fp8.float() * dequantize``'s expansion of it.  FA3 quantises
    Q in blocks of its query tile and K, V in blocks of its key tile.
    """
    layout = _check_layout(layout)
    block = _positive_int(block_size, "block_size")
    x = _check_input(x, "x", 4)
    xb = _to_bhnd(x, layout)
    b, h, n, d = xb.shape
    nblocks = -(-n // block)
    pad = nblocks * block - n
    padded = torch.nn.functional.pad(xb.abs().to(torch.float32), (0, 0, 0, pad))
    amax = padded.reshape(b, h, nblocks, block * d).amax(-1) if padded.numel() else torch.zeros(b, h, nblocks, device=x.device)
    descale = _descale(amax)
    out = _cast(xb, _per_token(descale, block, n))
    return (out if layout == "bhnd" else out.transpose(1, 2)), descale


def _per_token(descale: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """(B, H, nblocks) block descales as (B, H, n, 1): token i gets block i // block's."""
    return descale.repeat_interleave(block, dim=-1)[..., :n, None]


def dequantize(
    x_fp8: torch.Tensor,
    descale: torch.Tensor,
    *,
    block_size: int | None = None,
    layout: str = "bhnd",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``x_fp8`` times ``descale`` in ``dtype``, for each quantiser's descale shape.

    ``descale`` 0-dim (per tensor), (B, G) with G dividing H (per head or GQA group),
    or (B, H, nblocks) with ``block_size`` given (per block).  The product is exact
    in float64 (3 mantissa bits times 24) and in float32 up to one rounding.
    """
    if not isinstance(x_fp8, torch.Tensor) or x_fp8.dtype != FP8:
        got = f"dtype {x_fp8.dtype}" if isinstance(x_fp8, torch.Tensor) else type(x_fp8).__name__
        raise TypeError(f"x_fp8 must be a torch.float8_e4m3fn tensor, got {got}")
    if not isinstance(descale, torch.Tensor) or not descale.is_floating_point():
        raise TypeError(f"descale must be a floating torch.Tensor, got {type(descale).__name__}")
    layout = _check_layout(layout)
    x = x_fp8.to(dtype)
    scale = descale.to(device=x.device, dtype=dtype)
    if scale.dim() == 0:
        return x * scale
    if x.dim() != 4:
        raise ValueError(f"x_fp8 must be 4-D for a per-head or per-block descale, got shape {tuple(x.shape)}")
    xb = _to_bhnd(x, layout)
    b, h, n, _ = xb.shape
    scale = expand_descale(scale, b, h, n, block_size=block_size, name="descale")
    out = xb * scale
    return out if layout == "bhnd" else out.transpose(1, 2)


def expand_descale(
    descale: torch.Tensor, b: int, h: int, n: int, *, block_size: int | None = None, name: str = "descale"
) -> torch.Tensor:
    """A descale of any supported shape as a (B, H, N, 1) per-token factor (broadcast views where possible).

    0-dim: per tensor; (B, G), G dividing H: per head or per GQA group of H / G
    heads; (B, H, ceil(N / block_size)): per block (``block_size`` required).
    ``ValueError`` naming ``name`` for any other shape.
    """
    if descale.dim() == 0:
        return descale.expand(b, h, n, 1)
    if descale.dim() == 2:
        bb, g = descale.shape
        if bb != b or g < 1 or h % g:
            raise ValueError(f"{name} of shape {tuple(descale.shape)} must be (B, G) = ({b}, G) with G dividing H = {h}")
        return descale.repeat_interleave(h // g, dim=1)[:, :, None, None].expand(b, h, n, 1)
    if descale.dim() == 3:
        if block_size is None:
            raise ValueError(f"{name} is per block (3-D, shape {tuple(descale.shape)}): pass its block_size")
        block = _positive_int(block_size, "block_size")
        want = (b, h, -(-n // block))
        if tuple(descale.shape) != want:
            raise ValueError(f"{name} must have shape (B, H, ceil(N / block_size)) = {want}, got {tuple(descale.shape)}")
        return _per_token(descale, block, n)
    raise ValueError(f"{name} must be 0-dim, (B, G) or (B, H, nblocks), got shape {tuple(descale.shape)}")


# ---------------------------------------------------------------------------
# incoherent processing
# ---------------------------------------------------------------------------


def hadamard_matrix(d: int, signs: torch.Tensor | None = None, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``diag(signs) H_d / sqrt(d)``: the Sylvester Hadamard matrix of order d (a power of two), orthonormal.

    ``signs`` (d,) of ±1 (None: all +1).  Its rows are orthonormal, so
    ``M Mᵀ = I`` and ``(qM)(kM)ᵀ = qkᵀ``.
    """
    d = _positive_int(d, "d")
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two for a Hadamard rotation, got {d}")
    if d > HADAMARD_MAX:
        raise ValueError(f"d must be at most {HADAMARD_MAX} (the matrix is d x d float64), got {d}")
    if signs is not None:
        if not isinstance(signs, torch.Tensor) or tuple(signs.shape) != (d,):
            got = tuple(signs.shape) if isinstance(signs, torch.Tensor) else type(signs).__name__
            raise ValueError(f"signs must be a ({d},) tensor of +-1, got {got}")
        if not bool((signs.abs() == 1).all()):
            raise ValueError("signs must hold +-1 only (other values make the matrix not orthogonal)")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(d)
    if signs is not None:
        h = signs.to(torch.float64).reshape(d, 1) * h
    return h.to(dtype)


def hadamard_rotate(
    q: torch.Tensor, k: torch.Tensor, seed: int | None = None, *, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA3's incoherent processing: ``(q M, k M, signs)`` with ``M = diag(signs) H_d / sqrt(d)``.

    q and k of any rank with the same last dim d (head_dim), a power of two;
    ``signs`` (d,) float of random ±1, drawn from ``torch.Generator().manual_seed(seed)``
    (or ``generator``; neither: torch's default generator).  M is orthogonal, so
    ``(qM)(kM)ᵀ = qkᵀ`` up to float64 rounding of the products (~1e-15
    relative); rotate q and k, not v.  The product is taken in float64 and returned
    in each input's dtype.  A kernel would apply the fast Walsh-Hadamard
    transform, O(d log d) per row; a d x d matmul is the same map.
    """
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point() or x.dtype == FP8:
            raise TypeError(f"{name} must be a floating-point tensor (rotate before quantising), got dtype {x.dtype}")
        if x.dim() == 0:
            raise ValueError(f"{name} must have a head_dim (last) axis, got a 0-dim tensor")
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"k head_dim {k.shape[-1]} must equal q head_dim {d}")
    if d & (d - 1) or d == 0 or d > HADAMARD_MAX:
        raise ValueError(f"head_dim of q and k must be a power of two up to {HADAMARD_MAX} for a Hadamard rotation, "
                         f"got {d}")
    if seed is not None and generator is not None:
        raise ValueError("pass seed or generator, not both")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        if not -2**63 <= seed < 2**64:
            raise ValueError(f"seed must be in [-2^63, 2^64) (torch.Generator.manual_seed's range), got {seed}")
        generator = torch.Generator().manual_seed(int(seed))
    elif generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    signs = torch.randint(0, 2, (d,), generator=generator, device=generator.device if generator is not None else "cpu")
    signs = (2 * signs - 1).to(torch.float64).cpu()
    m = hadamard_matrix(d, signs)
    rot = lambda x: (x.to(torch.float64) @ m.to(x.device)).to(x.dtype)  # noqa: E731
    return rot(q), rot(k), signs
