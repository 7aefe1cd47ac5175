"""flashtile: the FlashAttention family, complete, in Python.

Layers (each importable on its own):

* :mod:`flashtile.reference` — exact float64 algorithms (softmax variants, Algorithm 0,
  FlashAttention-1/2, block-sparse, backward by recomputation, Flash-Decoding, FlashDecoding++),
  instrumented with HBM access and FLOP counts.
* :mod:`flashtile.iomodel` — closed forms for HBM traffic, FLOPs, the lower bound, rooflines.
* :mod:`flashtile.kernels` — Triton kernels (FA2 forward and backward, FA1 forward, online/safe softmax,
  split-KV decoding with a paged cache).
* :mod:`flashtile.runtime` — their host side: plans, launches bound once per signature, device buffers.
* :mod:`flashtile.ops` — the PyTorch API re-exported here: flash-attn-compatible functions and an
  SDPA drop-in, differentiable and traceable by ``torch.compile``.
* :mod:`flashtile.distributed` — context parallelism over ``torch.distributed``: ring attention and
  all-to-all (Ulysses) head parallelism on sequence shards.

The kernel-backed names are imported on first use: Triton reads ``TRITON_INTERPRET``
when a kernel module is imported, so a CPU-only program (the CLI, the tests) can
still switch the interpreter on after ``import flashtile``.
"""

from importlib import import_module

from flashtile.reference.masks import BlockMask

__version__ = "0.1.0"

_LAZY = {
    "cascade_attention_with_kvcache": "flashtile.ops.cascade",
    "check_errors": "flashtile.ops.kvcache",
    "contiguous_shard": "flashtile.distributed.sharding",
    "contiguous_unshard": "flashtile.distributed.sharding",
    "flash_attn_func": "flashtile.ops.flash_attn",
    "flash_attn_kvpacked_func": "flashtile.ops.flash_attn",
    "flash_attn_qkvpacked_func": "flashtile.ops.flash_attn",
    "flash_attn_varlen_func": "flashtile.ops.flash_attn",
    "flash_attn_varlen_kvpacked_func": "flashtile.ops.flash_attn",
    "flash_attn_varlen_qkvpacked_func": "flashtile.ops.flash_attn",
    "flash_attn_with_kvcache": "flashtile.ops.kvcache",
    "hadamard_rotate": "flashtile.fp8",
    "merge_attention_states": "flashtile.ops.cascade",
    "next_philox_state": "flashtile.ops.autograd",
    "quantize_per_block": "flashtile.fp8",
    "quantize_per_head": "flashtile.fp8",
    "quantize_per_tensor": "flashtile.fp8",
    "ring_flash_attn_func": "flashtile.distributed.ring",
    "ring_flash_attn_kvpacked_func": "flashtile.distributed.ring",
    "ring_flash_attn_qkvpacked_func": "flashtile.distributed.ring",
    "ring_flash_attn_varlen_func": "flashtile.distributed.ring_varlen",
    "scaled_dot_product_attention": "flashtile.ops.sdpa",
    "shard_packed": "flashtile.distributed.sharding",
    "ulysses_flash_attn_func": "flashtile.distributed.ulysses",
    "ulysses_flash_attn_varlen_func": "flashtile.distributed.ulysses",
    "unshard_packed": "flashtile.distributed.sharding",
    "zigzag_shard": "flashtile.distributed.sharding",
    "zigzag_unshard": "flashtile.distributed.sharding",
}

__all__ = ["BlockMask", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flashtile' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
