"""flashtile: the FlashAttention family, complete, in Python.

Layers (each importable on its own):

* :mod:`flashtile.reference` — exact float64 algorithms (softmax variants, Algorithm 0,
  FlashAttention-1/2, block-sparse, backward by recomputation, Flash-Decoding, FlashDecoding++),
  instrumented with HBM access and FLOP counts.
* :mod:`flashtile.iomodel` — closed forms for HBM traffic, FLOPs, the lower bound, rooflines.
* :mod:`flashtile.kernels` — Triton kernels (FA2 forward and backward).
* :mod:`flashtile.ops` — the PyTorch API re-exported here: flash-attn-compatible functions and an
  SDPA drop-in, differentiable and traceable by ``torch.compile``.
"""

from flashtile.ops import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    next_philox_state,
    scaled_dot_product_attention,
)
from flashtile.reference.masks import BlockMask

__version__ = "0.1.0"

__all__ = [
    "BlockMask",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "next_philox_state",
    "scaled_dot_product_attention",
]
