"""Float64 oracle for the ops tests: dense attention built from flashtile/reference/masks.py.

Differentiable by torch autograd, so gradients come from the same definition
with no hand-written backward.  Fully masked rows give out 0 and lse -inf
with zero (not NaN) gradients: the softmax of such a row is taken over a
finite dummy row and then masked away.
"""

from __future__ import annotations

import torch

from flashtile.reference._common import expand_kv
from flashtile.reference.masks import BlockMask, allowed_mask, apply_score_mods


def attention64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
    keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Hq, Nq, d), k/v (B, Hk, Nk, d) float64 -> (out (B, Hq, Nq, d), lse (B, Hq, Nq))."""
    hq, nq, nk = q.shape[1], q.shape[2], k.shape[2]
    k, v = expand_kv(k, hq), expand_kv(v, hq)
    s = scale * q @ k.transpose(-1, -2)
    s = apply_score_mods(s, softcap=softcap, alibi_slopes=alibi)
    ok = allowed_mask(nq, nk, causal=causal, window_size=window, block_mask=block_mask, device=q.device)
    ok = ok.expand(s.shape)
    if bias is not None:
        bias = bias.to(torch.float64)
        ok = ok & (bias != float("-inf"))
        s = s + torch.where(ok, bias, 0.0)
    empty = ~ok.any(dim=-1, keepdim=True)
    rows = torch.where(empty, 0.0, torch.where(ok, s, float("-inf")))
    lse = torch.logsumexp(rows, dim=-1, keepdim=True)
    p = torch.where(ok, torch.exp(torch.where(ok, s, 0.0) - lse), 0.0)
    if keep is not None:
        p = p * keep.to(p.dtype) / (1.0 - dropout_p)
    return p @ v, torch.where(empty, float("-inf"), lse).squeeze(-1)


def grads64(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """d(sum(out * dout)) / d(inputs) by autograd."""
    return torch.autograd.grad(out, inputs, dout.to(out.dtype))


def tolerance(dtype: torch.dtype, device: str) -> float:
    """Relative tolerance against float64, by the precision of the kernel's arithmetic.

    fp32 through the interpreter is true fp32 (unit roundoff 6e-8, sums of
    <= 48 terms): 2e-5.  fp32 on GPU runs tl.dot in TF32 (10-bit mantissa,
    unit roundoff 5e-4 on each product): 2e-3.  fp16 (11-bit) and bf16 (8-bit)
    inputs and the P tile rounded before P @ V: 1e-2 and 3e-2.
    """
    if dtype == torch.float32:
        return 2e-5 if device == "cpu" else 2e-3
    return 1e-2 if dtype == torch.float16 else 3e-2


def assert_close64(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, device: str, what: str) -> None:
    """|actual - expected| <= tol * (|expected| + max|expected|), -inf entries matched exactly."""
    tol = tolerance(dtype, device)
    actual = actual.detach().to(device="cpu", dtype=torch.float64)
    expected = expected.detach().to(device="cpu", dtype=torch.float64)
    scale = float(expected[torch.isfinite(expected)].abs().max()) if torch.isfinite(expected).any() else 1.0
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * max(scale, 1e-3), msg=lambda m: f"{what}: {m}")
