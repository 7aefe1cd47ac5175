"""PyTorch-facing API over the FlashAttention-2 Triton kernels.

* :func:`flash_attn_func`, :func:`flash_attn_qkvpacked_func`,
  :func:`flash_attn_kvpacked_func`: flash-attn 2.x compatible, (B, N, H, d).
* :func:`flash_attn_varlen_func` (+ packed variants): packed batches of sequences of different lengths.
* :func:`scaled_dot_product_attention`: drop-in for torch's SDPA, (B, H, N, d).
* :func:`next_philox_state`: the dropout (seed, offset) the next call will draw.

All are differentiable through the ``flashtile::flash_attn_fwd`` /
``flashtile::flash_attn_bwd`` custom ops and trace under ``torch.compile``.
"""

from flashtile.ops.autograd import next_philox_state
from flashtile.ops.flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from flashtile.ops.kvcache import flash_attn_with_kvcache
from flashtile.ops.sdpa import scaled_dot_product_attention

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "scaled_dot_product_attention",
    "next_philox_state",
    "flash_attn_with_kvcache",
]
