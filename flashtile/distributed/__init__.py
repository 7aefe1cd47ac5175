"""Context parallelism: attention over a sequence sharded across the ranks of a process group.

* :func:`ring_flash_attn_func` (+ packed variants): ring attention, K/V blocks rotating around
  the ring with point-to-point transfers overlapped with the FA2 kernels (:mod:`.ring`);
  :func:`ring_flash_attn_varlen_func` the same over packed variable-length batches (:mod:`.ring_varlen`);
* :func:`ulysses_flash_attn_func` (:func:`ulysses_flash_attn_varlen_func` for packed batches): all-to-all head
  parallelism (:mod:`.ulysses`);
* sharding helpers for the ``zigzag`` (causal-balanced) and ``contiguous`` layouts, of one sequence or of
  every sequence of a packed batch (:mod:`.sharding`).

Write-up: ``docs/distributed.md``.
"""

from importlib import import_module

_LAZY = {
    "ring_flash_attn_func": "flashtile.distributed.ring",
    "ring_flash_attn_qkvpacked_func": "flashtile.distributed.ring",
    "ring_flash_attn_kvpacked_func": "flashtile.distributed.ring",
    "merge_partial_": "flashtile.distributed.ring",
    "ring_flash_attn_varlen_func": "flashtile.distributed.ring_varlen",
    "ulysses_flash_attn_func": "flashtile.distributed.ulysses",
    "ulysses_flash_attn_varlen_func": "flashtile.distributed.ulysses",
    "shard_sequence": "flashtile.distributed.sharding",
    "unshard_sequence": "flashtile.distributed.sharding",
    "zigzag_shard": "flashtile.distributed.sharding",
    "zigzag_unshard": "flashtile.distributed.sharding",
    "contiguous_shard": "flashtile.distributed.sharding",
    "contiguous_unshard": "flashtile.distributed.sharding",
    "shard_packed": "flashtile.distributed.sharding",
    "unshard_packed": "flashtile.distributed.sharding",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    # kernel modules are imported on first use: Triton reads TRITON_INTERPRET when they are imported
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flashtile.distributed' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
