"""Float64 twin of an FP8 attention forward: FA3 (Shah et al. 2024) §3.3 "Low-precision with FP8".

What the FP8 kernel computes, step by step, with every rounding it performs
simulated and every other operation exact (float64):

1. q, k, v are ``float8_e4m3fn`` tensors with float32 descales (per tensor,
   per (batch, head) or per block of tokens -- §3.3 "block quantization"; see
   :mod:`flashtile.fp8`).  An e4m3 value times a float32 descale has at most
   4 + 24 significant bits, so dequantising in float64 is exact.
2. ``S = softmax_scale * (q_descale q)(k_descale k)ᵀ``: the kernel's wgmma
   accumulates in fp32 and folds the descales into the scale; here S is float64.
3. FA2's online softmax over key tiles of ``block_sizes[1]`` columns:
   ``m' = max(m, rowmax S)``, ``P~ = 2^8 exp(S - m')`` (FA3's code shifts the
   max by 8 octaves for FP8, ``Max_offset = 8``, so P~ spans e4m3's [0, 256]
   instead of [0, 1]), ``l' = e^{m - m'} l + rowsum(P~)`` from the unrounded P~.
4. **P~ rounded to e4m3** (:func:`round_e4m3`) before the second GEMM, whose
   other operand is the e4m3 V: ``O~' = e^{m - m'} O~ + round(P~) (v_descale v)``.
5. ``O = O~ / l``, ``LSE = m + log(l / 2^8)``.  The kernel then rounds O to
   bf16; the twin returns float64 (round it yourself to compare with a kernel).

Incoherent processing (§3.3: q and k multiplied by a random orthogonal
Hadamard matrix before quantising) happens before step 1:
:func:`flashtile.fp8.hadamard_rotate`.

``p_dtype`` generalises step 4: ``float8_e4m3fn`` (the default, FA3's FP8 path),
``float16`` / ``bfloat16`` (what an fp16 / bf16 FlashAttention kernel does
before P·V: torch's cast) or None (no rounding: the twin is then exact attention
of the dequantised inputs).  q, k, v may also be float tensors, used as they
are (descales default to 1), which is how the error experiment
(:mod:`flashtile.bench.fp8_error`) simulates fp16 and bf16 kernels.

Counting follows :func:`flashtile.reference.attention.flash_attn2` (elements,
not bytes; a kernel reads 1-byte e4m3 inputs and writes a 2-byte output):
Q blocks of ``block_sizes[0]`` rows outside, key tiles inside, fully masked
tiles skipped; descales are not counted.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from flashtile.fp8 import FP8, expand_descale
from flashtile.reference import _checks as checks
from flashtile.reference._common import AttnResult, IOCounts, expand_kv
from flashtile.reference.masks import allowed_mask

__all__ = ["round_e4m3", "fp8_attention", "P_SCALE"]

P_SCALE = 256.0  # 2^Max_offset: FA3 computes P~ = exp2(x - max + 8) for FP8
_E4M3_MAX = 448.0
_E4M3_MIN_EXP = -6  # exponent of the smallest normal; below it the spacing stays 2^-9 (subnormals)
_E4M3_MANTISSA = 3
_P_DTYPES = (FP8, torch.float16, torch.bfloat16, torch.float32)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest ``float8_e4m3fn`` value, in float64, by arithmetic (no fp8 cast).

    Equal to ``x.float().to(torch.float8_e4m3fn).double()`` for every input:
    the value is first rounded to float32 (torch's cast from float64 goes
    through float32, and the kernel holds P in fp32 registers), then to 3
    mantissa bits, ties to even, with subnormals below 2^-6 (spacing 2^-9);
    magnitudes past 448 (±inf included) saturate to ±448, as torch's cast does;
    NaN stays NaN; the sign of zero is kept.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating torch.Tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    x = x.to(torch.float32).to(torch.float64)
    a = x.abs()
    _, e = torch.frexp(a)  # a = f * 2^e, f in [0.5, 1): the leading bit is 2^(e-1)
    lead = torch.clamp(e - 1, min=_E4M3_MIN_EXP)
    quantum = torch.exp2((lead - _E4M3_MANTISSA).to(torch.float64))  # spacing of e4m3 values around a
    r = torch.round(a / quantum) * quantum  # exact quotient (power-of-two divisor); torch.round ties to even
    r = torch.where(torch.isnan(a), a, r.clamp(max=_E4M3_MAX))
    return torch.copysign(r, x)


def _check_input(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} must be a float8_e4m3fn (or floating) torch.Tensor, got {got}")
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D (B, H, N, d), got shape {tuple(x.shape)}")
    x64 = x.to(torch.float64)
    if x64.numel() and not bool(torch.isfinite(x64).all()):
        raise ValueError(f"{name} has NaN or inf entries")
    return x64


def _dequantized(
    x: torch.Tensor, descale: object, name: str, heads: int, block: int
) -> torch.Tensor:
    """``x`` (float64, (B, H, N, d)) times its descale expanded per token; the descale is checked."""
    if descale is None:
        return x
    dname = f"{name}_descale"
    if not isinstance(descale, torch.Tensor) or not descale.is_floating_point():
        raise TypeError(f"{dname} must be a floating (float32) torch.Tensor or None, got {type(descale).__name__}")
    d64 = descale.to(device=x.device, dtype=torch.float64)
    if d64.numel() and not bool((torch.isfinite(d64) & (d64 > 0)).all()):
        raise ValueError(f"{dname} must be finite and > 0")
    b, h, n, _ = x.shape
    return x * expand_descale(d64, b, heads, n, block_size=block, name=dname)


def fp8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    block_sizes: Sequence[int] = (128, 128),
    descale_blocks: Sequence[int] | None = None,
    p_dtype: torch.dtype | None = FP8,
    p_scale: float = P_SCALE,
) -> AttnResult:
    """Simulated FP8 attention forward (module docstring, steps 1-5), float64 ``AttnResult(out, lse, counts)``.

    q (B, Hq, Nq, d), k and v (B, Hk, Nk, d), Hq a multiple of Hk (GQA), usually
    ``float8_e4m3fn`` (any floating dtype is taken as exact values).  Descales:
    None (1), 0-dim (per tensor), (B, G) with G dividing the tensor's heads (per
    head; FA3 passes (B, Hk) for all three), or (B, H, ceil(N / block)) per block
    with ``descale_blocks = (q block, kv block)`` giving the block lengths.
    ``block_sizes = (Br, Bc)``: the kernel's query and key tiles (Bc decides the
    running max that P~ is taken against, hence its rounding).  ``p_dtype``: what
    P~ is rounded to before P·V (None: nothing); ``p_scale``: the factor P~
    carries (2^8 in FA3's FP8 path; 1 is plain FA2).  Causal is bottom-right
    aligned, as flash-attn; a fully masked row gives out 0 and LSE -inf.
    """
    q64, k64, v64 = _check_input(q, "q"), _check_input(k, "k"), _check_input(v, "v")
    b, hq, nq, d = q64.shape
    _, hk, nk, _ = k64.shape
    if k64.shape[0] != b or k64.shape[3] != d:
        raise ValueError(f"k shape {tuple(k.shape)} must be (B, Hk, Nk, d) with B = {b}, d = {d} of q")
    if tuple(v64.shape) != tuple(k64.shape):
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    if hk == 0 or hq % hk:
        raise ValueError(f"number of q heads ({hq}) must be a multiple of k/v heads ({hk})")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    scale = checks.softmax_scale(softmax_scale, d)
    br, bc = checks.block_sizes(block_sizes, "block_sizes")
    qb, kvb = (None, None) if descale_blocks is None else checks.block_sizes(descale_blocks, "descale_blocks")
    if p_dtype is not None and p_dtype not in _P_DTYPES:
        raise TypeError(f"p_dtype must be one of {', '.join(map(str, _P_DTYPES))} or None, got {p_dtype!r}")
    p_scale = checks.check_real(p_scale, "p_scale", what="a real number > 0")
    if not p_scale > 0:
        raise ValueError(f"p_scale must be > 0, got {p_scale}")

    q64 = _dequantized(q64, q_descale, "q", hq, qb)  # step 1: exact in float64
    k64 = expand_kv(_dequantized(k64, k_descale, "k", hk, kvb), hq)
    v64 = expand_kv(_dequantized(v64, v_descale, "v", hk, kvb), hq)
    allowed = allowed_mask(nq, nk, causal=causal, window_size=(-1, -1), device=q64.device)

    out = torch.zeros_like(q64)
    lse = torch.full((b, hq, nq), -math.inf, dtype=torch.float64, device=q64.device)
    c = IOCounts()
    heads = b * hq
    shift = math.log(p_scale)
    for q0 in range(0, nq, br):
        q1 = min(q0 + br, nq)
        c.read(heads * (q1 - q0) * d)
        acc = torch.zeros(b, hq, q1 - q0, d, dtype=torch.float64, device=q64.device)
        m = torch.full((b, hq, q1 - q0), -math.inf, dtype=torch.float64, device=q64.device)
        l = torch.zeros_like(m)
        for k0 in range(0, nk, bc):
            k1 = min(k0 + bc, nk)
            mask = allowed[q0:q1, k0:k1]
            if not bool(mask.any()):
                c.skipped_blocks += heads
                continue
            c.visited_blocks += heads
            c.read(heads * 2 * (k1 - k0) * d)
            c.flops += heads * 4 * (q1 - q0) * (k1 - k0) * d
            s = scale * (q64[:, :, q0:q1] @ k64[:, :, k0:k1].transpose(-1, -2))  # step 2
            s = s.masked_fill(~mask, -math.inf)
            m_new = torch.maximum(m, s.amax(-1))  # step 3
            base = torch.where(torch.isneginf(m_new), 0.0, m_new)  # a row masked so far: exp(-inf) = 0, not NaN
            p = torch.exp(s - base.unsqueeze(-1) + shift)
            alpha = torch.exp(m - base)
            l = alpha * l + p.sum(-1)
            acc = alpha.unsqueeze(-1) * acc + _round_p(p, p_dtype) @ v64[:, :, k0:k1]  # step 4
            m = m_new
        seen = l > 0
        out[:, :, q0:q1] = torch.where(seen.unsqueeze(-1), acc / torch.where(seen, l, 1.0).unsqueeze(-1), 0.0)
        lse[:, :, q0:q1] = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)) - shift, -math.inf)  # step 5
        c.write(heads * (q1 - q0) * (d + 1))
    c.extras["block_rows"], c.extras["block_cols"] = br, bc
    return AttnResult(out, lse, c)


def _round_p(p: torch.Tensor, p_dtype: torch.dtype | None) -> torch.Tensor:
    """P~ as the second GEMM reads it: rounded to e4m3 by :func:`round_e4m3`, to fp16/bf16/fp32 by torch's cast."""
    if p_dtype is None:
        return p
    if p_dtype == FP8:
        return round_e4m3(p)
    return p.to(p_dtype).to(torch.float64)
