"""`flashtile bench fp8-error`: the FA3 paper's numerical-error experiment (Shah et al. 2024, Table 3), on a CPU.

Inputs as the paper's: every entry of q, k, v is ``N(0, 1) + N(0, 10²) · Bernoulli(0.001)``
(0.1% of entries get an outlier term of standard deviation 10).  Each method's
output is compared with exact float64 attention of those inputs by its RMSE,
``sqrt(mean((O - O_ref)²))``.  Every method is simulated by the float64 twin
:func:`flashtile.reference.fp8.fp8_attention`, which performs the roundings a
FlashAttention kernel performs and nothing else:

* ``fp16`` / ``bf16`` -- inputs rounded to the dtype, P rounded to it before P·V,
  output rounded to it (an FA2/FA3 kernel in that dtype);
* ``fp8 per-tensor`` -- q, k, v quantised to e4m3 with one scale each (the paper's
  "baseline FP8"), P~ (scaled by 2^8) rounded to e4m3, output rounded to bf16;
* ``fp8 block`` -- one scale per block of tokens per head (query tiles for q, key
  tiles for k and v);
* ``+ Hadamard`` -- incoherent processing first: q and k rotated by the same random
  ±1-signed Hadamard matrix (:func:`flashtile.fp8.hadamard_rotate`), then quantised.

With ``kernels=True`` (a CUDA GPU) the same inputs also run through real kernels:
our bf16 forward, our FP8 forward and FA3's (when ``fa3_fwd_interface`` imports), the
FP8 ones with FA3's API scales (one per (batch, head)), with and without the Hadamard
rotation -- measured, not simulated.

The paper reports RMSE 2.4e-2 for baseline FP8 and 9.1e-3 for block FP8 +
incoherent processing (2.6× lower); ``ratio`` here is per-tensor RMSE / the
method's RMSE.  docs/fp8.md records a run.
"""

from __future__ import annotations

from typing import Callable

import torch

from flashtile.bench.common import environment, write_json
from flashtile.fp8 import FP8, hadamard_rotate, quantize_per_block, quantize_per_tensor
from flashtile.reference.attention import standard_attention
from flashtile.reference.fp8 import fp8_attention

__all__ = ["METHODS", "KERNEL_METHODS", "outlier_inputs", "rmse", "run_fp8_error", "fp8_error_payload"]

METHODS = (
    "fp16",
    "bf16",
    "fp8 per-tensor",
    "fp8 per-tensor + Hadamard",
    "fp8 block",
    "fp8 block + Hadamard",
)
KERNEL_METHODS = (
    "kernel: flashtile bf16",
    "kernel: flashtile fp8 per-head",
    "kernel: flashtile fp8 per-head + Hadamard",
    "kernel: fa3 fp8 per-head",
    "kernel: fa3 fp8 per-head + Hadamard",
)
OUTLIER_FRAC = 0.001
OUTLIER_STD = 10.0


def outlier_inputs(
    batch: int, heads: int, seqlen: int, head_dim: int, *, seed: int = 0,
    outlier_frac: float = OUTLIER_FRAC, outlier_std: float = OUTLIER_STD,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, H, N, d) float64 with entries ``N(0, 1) + N(0, outlier_std²) · Bernoulli(outlier_frac)``."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seqlen, head_dim)

    def one() -> torch.Tensor:
        base = torch.randn(shape, generator=g, dtype=torch.float64)
        hit = torch.rand(shape, generator=g, dtype=torch.float64) < outlier_frac
        return base + hit * outlier_std * torch.randn(shape, generator=g, dtype=torch.float64)

    return one(), one(), one()


def rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``sqrt(mean((x - ref)²))`` in float64."""
    return float((x.double() - ref.double()).pow(2).mean().sqrt())


def _method(name: str, block_sizes: tuple[int, int], seed: int, causal: bool) -> Callable[..., torch.Tensor]:
    """The simulated forward of one method: (q, k, v) float64 -> output float64 (rounded to its output dtype)."""
    br, bc = block_sizes

    def low_precision(q, k, v, dtype):
        q, k, v = (x.to(dtype) for x in (q, k, v))
        res = fp8_attention(q, k, v, causal=causal, block_sizes=block_sizes, p_dtype=dtype, p_scale=1.0)
        return res.out.to(dtype).double()

    def fp8(q, k, v, *, block: bool, hadamard: bool):
        if hadamard:
            q, k, _ = hadamard_rotate(q, k, seed=seed)
        if block:
            (q8, qs), (k8, ks), (v8, vs) = quantize_per_block(q, br), quantize_per_block(k, bc), quantize_per_block(v, bc)
        else:
            (q8, qs), (k8, ks), (v8, vs) = quantize_per_tensor(q), quantize_per_tensor(k), quantize_per_tensor(v)
        res = fp8_attention(
            q8, k8, v8, qs, ks, vs, causal=causal, block_sizes=block_sizes,
            descale_blocks=(br, bc) if block else None, p_dtype=FP8,
        )
        return res.out.to(torch.bfloat16).double()  # FA3's FP8 forward writes bf16

    table = {
        "fp16": lambda q, k, v: low_precision(q, k, v, torch.float16),
        "bf16": lambda q, k, v: low_precision(q, k, v, torch.bfloat16),
        "fp8 per-tensor": lambda q, k, v: fp8(q, k, v, block=False, hadamard=False),
        "fp8 per-tensor + Hadamard": lambda q, k, v: fp8(q, k, v, block=False, hadamard=True),
        "fp8 block": lambda q, k, v: fp8(q, k, v, block=True, hadamard=False),
        "fp8 block + Hadamard": lambda q, k, v: fp8(q, k, v, block=True, hadamard=True),
    }
    return table[name]


def _kernel_method(name: str, seed: int, causal: bool) -> Callable[..., torch.Tensor]:
    """One real kernel on the GPU: (q, k, v) float64 (B, H, N, d) on the CPU -> its output, float64 on the CPU."""
    from flashtile.fp8 import quantize_per_head

    def run(q, k, v):
        if name.endswith("Hadamard"):
            q, k, _ = hadamard_rotate(q, k, seed=seed)
        q, k, v = (x.transpose(1, 2).float().cuda() for x in (q, k, v))  # flash layout (B, N, H, d)
        if name.endswith("bf16"):
            from flashtile import flash_attn_func

            out = flash_attn_func(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=causal)
        else:
            if "fa3" in name:
                import fa3_fwd_interface as fa3  # an optional peer; ImportError marks the row unsupported

                attn = fa3.flash_attn_func
            else:
                from flashtile import flash_attn_func as attn
            hk = k.shape[2]
            (q8, qs), (k8, ks), (v8, vs) = (quantize_per_head(q, layout="bnhd", kv_heads=hk),
                                            quantize_per_head(k, layout="bnhd"), quantize_per_head(v, layout="bnhd"))
            out = attn(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks, v_descale=vs)
            out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2).double().cpu()

    return run


def fp8_error_payload(
    *, batch: int = 1, heads: int = 4, seqlen: int = 1024, head_dim: int = 128, causal: bool = False,
    block_sizes: tuple[int, int] = (128, 128), seed: int = 0, methods: tuple[str, ...] = METHODS,
    progress: Callable[[str], None] | None = None, kernels: bool = False,
) -> dict:
    """Run the experiment; returns ``{"env", "config", "rows"}``, rows ``{method, rmse, ratio}`` (ratio = per-tensor
    RMSE / RMSE).  ``kernels``: add :data:`KERNEL_METHODS` (needs CUDA; a peer that is missing gets ``rmse`` None
    and a ``note``)."""
    if kernels and not torch.cuda.is_available():
        raise RuntimeError("kernels=True needs a CUDA GPU")
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"methods must be drawn from {METHODS}, got {m!r}")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two (Hadamard rotation), got {head_dim}")
    q, k, v = outlier_inputs(batch, heads, seqlen, head_dim, seed=seed)
    ref = standard_attention(q, k, v, causal=causal).out
    rows = []
    for name in methods:
        if progress:
            progress(name)
        rows.append({"method": name, "rmse": rmse(_method(name, block_sizes, seed, causal)(q, k, v), ref)})
    for name in KERNEL_METHODS if kernels else ():
        if progress:
            progress(name)
        try:
            rows.append({"method": name, "rmse": rmse(_kernel_method(name, seed, causal)(q, k, v), ref)})
        except ImportError as e:
            rows.append({"method": name, "rmse": None, "note": f"not importable: {e}"})
    base = next((r["rmse"] for r in rows if r["method"] == "fp8 per-tensor"), None)
    for r in rows:
        r["ratio"] = base / r["rmse"] if base and r["rmse"] else None
    config = dict(batch=batch, heads=heads, seqlen=seqlen, head_dim=head_dim, causal=causal,
                  block_sizes=list(block_sizes), seed=seed, outlier_frac=OUTLIER_FRAC, outlier_std=OUTLIER_STD,
                  compute="float64 twin on CPU (flashtile.reference.fp8)"
                  + ("; kernel rows: compiled kernels on the GPU" if kernels else ""))
    return {"env": environment(), "config": config, "rows": rows}


def run_fp8_error(out_dir: str = "bench/results", **kwargs) -> dict:
    """:func:`fp8_error_payload`, written as JSON under ``out_dir``; the payload gains ``path``."""
    payload = fp8_error_payload(**kwargs)
    payload["path"] = str(write_json(payload, out_dir, "fp8-error"))
    return payload
