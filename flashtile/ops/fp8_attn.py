"""FP8 attention forward (FA3 §3.3) behind ``flash_attn_func(..., q_descale=, k_descale=, v_descale=)``.

FA3's API: ``float8_e4m3fn`` q, k, v in the flash-attn layout (B, N, H, d) and float32 descales of
shape (batch, kv_heads) -- ``q ≈ q_fp8 * q_descale[b, h // (Hq / Hk)]`` and likewise k, v -- give a
bfloat16 output; forward only.  On an sm_90 GPU, for head dims multiple of 16 without softcap or
ALiBi and with an unbounded or causal window, the FP8 Hopper kernel runs
(:func:`flashtile.runtime.fa3_fwd.fa3_forward_fp8`: P rounded to e4m3 for the second GEMM, what
:func:`flashtile.reference.fp8.fp8_attention` simulates).  Anything else (other GPUs, the CPU
interpreter, windows, softcap, ALiBi, other head dims) runs the FA2 kernel on the dequantised
inputs in float32: the same function without FP8's rounding of P, at no FP8 speed-up.

Descales are device tensors whose values the host never reads (no sync): the Hopper kernel checks
them and a q·k descale product not in (0, inf), or a non-finite v descale, gives that head a zero
output and sets a bit that ``flashtile.check_errors()`` reports as a ``ValueError``.
"""

from __future__ import annotations

from typing import Optional

import torch

from flashtile.ops import validate
from flashtile.runtime.common import interpreting, on_tensor_device

__all__ = ["FP8", "check_fp8_inputs", "fp8_forward", "flash_attn_fp8_fwd"]

FP8 = torch.float8_e4m3fn
_DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def check_fp8_inputs(names, q, k, v, descales, dropout_p, return_attn_probs):
    """q, k, v e4m3 on one device; the descales float32 on it, broadcastable to (batch, kv_heads) and
    returned expanded to it (None: 1); FP8 is forward only.  Errors name the argument."""
    for name, x in zip(names, (q, k, v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        validate.check_dense(x, name)
        if x.dtype != FP8:
            raise TypeError(f"{name} must be float8_e4m3fn like {names[0]} (FP8 attention), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{names[0]} and {name} must be on the same device; got {q.device} and {x.device}")
    validate.check_has_data(q, names[0])
    if q.device.type == "cpu" and not interpreting():
        raise ValueError(f"{names[0]} is a CPU tensor: the kernels need a CUDA device (or TRITON_INTERPRET=1)")
    dims = validate.check_dims(q, k, v, seq_major=True, names=names)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError(f"FP8 attention is forward only: {names[0]}, {names[1]}, {names[2]} must not require grad "
                         "(or run it under torch.no_grad())")
    if validate.check_dropout(dropout_p) != 0.0:
        raise ValueError(f"dropout_p must be 0 with FP8 inputs (forward-only inference), got {dropout_p}")
    if return_attn_probs:
        raise ValueError("return_attn_probs is not available with FP8 inputs")
    shape = (dims.batch, dims.heads_k)
    out = []
    for name, ds in zip(_DESCALE_NAMES, descales):
        if ds is None:
            out.append(torch.ones(shape, dtype=torch.float32, device=q.device))
            continue
        if not isinstance(ds, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(ds).__name__}")
        validate.check_dense(ds, name)
        if ds.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {ds.dtype}")
        if ds.device != q.device:
            raise ValueError(f"{name} must be on {names[0]}'s device {q.device}, got {ds.device}")
        if ds.dim() > 2 or any(n not in (1, want) for n, want in zip(reversed(ds.shape), reversed(shape))):
            raise ValueError(
                f"{name} must have shape (batch, kv_heads) = {shape} (or broadcast to it), got {tuple(ds.shape)}"
            )
        out.append(ds.expand(shape))
    return dims, tuple(out)


@torch.library.custom_op("flashtile::flash_attn_fp8_fwd", mutates_args=())
def flash_attn_fp8_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: torch.Tensor,
    k_descale: torch.Tensor,
    v_descale: torch.Tensor,
    alibi_slopes: Optional[torch.Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``: out (B, Nq, Hq, d) bfloat16, lse (B, Hq, Nq) float32, from e4m3 (B, N, H, d)
    q, k, v and float32 (B, Hk) descales (checked by the caller)."""
    return _fp8_impl(q, k, v, q_descale, k_descale, v_descale, alibi_slopes, softmax_scale, causal,
                     window_left, window_right, softcap)


@on_tensor_device
def _fp8_impl(q, k, v, q_descale, k_descale, v_descale, alibi_slopes, softmax_scale, causal, window_left,
              window_right, softcap):
    from flashtile.ops.plan import fp8_plan
    from flashtile.runtime.fa3_fwd import fa3_forward_fp8, prefer_hopper_fp8

    plain = alibi_slopes is None and softcap == 0
    descales = (q_descale, k_descale, v_descale)
    if plain:
        plan = fp8_plan(q, k, v, descales, causal, (window_left, window_right), softmax_scale)
        if plan is not None:  # the signature's launches, bound once (ops.plan)
            return plan(q, k, v, descales, softmax_scale)
    qb, kb, vb = (x.transpose(1, 2) for x in (q, k, v))
    if prefer_hopper_fp8(qb, kb, causal=causal, window=(window_left, window_right), plain=plain,
                         softmax_scale=softmax_scale):
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
        _, lse = fa3_forward_fp8(qb, kb, vb, (q_descale, k_descale, v_descale), softmax_scale=softmax_scale,
                                 causal=causal, out=out.transpose(1, 2))
        return out, lse
    from flashtile.ops.autograd import attention

    def dequantised(x, ds):  # (B, N, Hx, d) * ds[b, h // (Hx / Hk)]
        hx, hk = x.shape[2], ds.shape[1]
        return x.to(torch.float32) * ds.repeat_interleave(hx // hk, dim=1)[:, None, :, None]

    with torch.no_grad():
        out, lse, _ = attention(
            dequantised(q, q_descale), dequantised(k, k_descale), dequantised(v, v_descale), seq_major=True,
            softmax_scale=softmax_scale, causal=causal, window=(window_left, window_right), softcap=softcap,
            alibi_slopes=alibi_slopes, dropout_p=0.0, block_mask=None, deterministic=False,
        )
    # the Hopper kernel's descale rule, with device ops (no sync): a bad head outputs 0 and is recorded
    from flashtile.kernels.fa3_fwd import ERR_DESCALE
    from flashtile.runtime.decode import error_flags

    qk = q_descale * k_descale
    ok = (qk > 0) & torch.isfinite(qk) & torch.isfinite(v_descale)  # (B, Hk)
    ok_heads = ok.repeat_interleave(q.shape[2] // ok.shape[1], dim=1)  # (B, Hq)
    out = torch.where(ok_heads[:, None, :, None], out, 0.0)
    lse = torch.where(ok_heads[:, :, None], lse, float("-inf"))
    error_flags(q.device, "flash_attn_func")[1:].bitwise_or_((~ok).any().to(torch.int32) * ERR_DESCALE)
    return out.to(torch.bfloat16), lse


@flash_attn_fp8_fwd.register_fake
def _fp8_fake(q, k, v, q_descale, k_descale, v_descale, alibi_slopes, softmax_scale, causal, window_left,
              window_right, softcap):
    b, nq, hq, _ = q.shape
    return (torch.empty(q.shape, dtype=torch.bfloat16, device=q.device),
            torch.empty((b, hq, nq), dtype=torch.float32, device=q.device))


def fp8_forward(q, k, v, descales, *, softmax_scale, causal, window, softcap, alibi_slopes):
    """The op on checked arguments (``descales`` from :func:`check_fp8_inputs`); eager calls skip the
    ``torch.library`` dispatcher (~60 us of host time, as for the bf16 op in :mod:`flashtile.ops.autograd`)."""
    op = flash_attn_fp8_fwd if torch.compiler.is_compiling() else _fp8_impl
    return op(q, k, v, *descales, alibi_slopes, float(softmax_scale), bool(causal),
                              int(window[0]), int(window[1]), float(softcap))
