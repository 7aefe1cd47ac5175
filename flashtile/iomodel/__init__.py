"""Analytic IO model: closed-form HBM accesses, FLOPs and the roofline.

:mod:`~flashtile.iomodel.hbm` counts element accesses of every algorithm
(exactly what the instrumented references report), :mod:`~flashtile.iomodel.flops`
the matmul FLOPs, and :mod:`~flashtile.iomodel.roofline` turns both into
arithmetic intensity and attainable throughput on A100 / H100 / H200.
"""

from flashtile.iomodel.flops import FLOP_MODES, attention_flops, causal_pairs, exact_causal_fraction
from flashtile.iomodel.hbm import (
    BYTES_PER_ELEMENT,
    SOFTMAX_VARIANTS,
    ReadsWrites,
    backward_hbm,
    block_sparse_hbm,
    block_sparse_hbm_bound,
    decoding_hbm,
    decoding_reads_writes,
    fa1_block_sizes,
    fa1_hbm,
    fa1_hbm_theorem2,
    fa1_init_writes,
    fa2_hbm,
    fa2_visited_blocks,
    lower_bound_hbm,
    softmax_accesses,
    standard_hbm,
    to_bytes,
)
from flashtile.iomodel.roofline import (
    A100,
    ALGORITHMS,
    DEVICES,
    H100,
    H200,
    Device,
    RooflineRow,
    arithmetic_intensity,
    attainable_flops,
    attention_hbm_bytes,
    attention_intensity,
    get_device,
    ridge_point,
    roofline_table,
)

__all__ = [
    "FLOP_MODES",
    "attention_flops",
    "causal_pairs",
    "exact_causal_fraction",
    "BYTES_PER_ELEMENT",
    "SOFTMAX_VARIANTS",
    "ReadsWrites",
    "backward_hbm",
    "block_sparse_hbm",
    "block_sparse_hbm_bound",
    "decoding_hbm",
    "decoding_reads_writes",
    "fa1_block_sizes",
    "fa1_hbm",
    "fa1_hbm_theorem2",
    "fa1_init_writes",
    "fa2_hbm",
    "fa2_visited_blocks",
    "lower_bound_hbm",
    "softmax_accesses",
    "standard_hbm",
    "to_bytes",
    "A100",
    "ALGORITHMS",
    "DEVICES",
    "H100",
    "H200",
    "Device",
    "RooflineRow",
    "arithmetic_intensity",
    "attainable_flops",
    "attention_hbm_bytes",
    "attention_intensity",
    "get_device",
    "ridge_point",
    "roofline_table",
]
