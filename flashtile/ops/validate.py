"""Every argument check of the public attention API, in one module.

The public functions (:mod:`flashtile.ops.flash_attn`, :mod:`flashtile.ops.sdpa`)
call these before anything reaches a custom op, so a bad call fails with a
message that names the argument and the accepted values, instead of deep
inside a Triton launch; the FA2 kernel wrappers (:mod:`flashtile.runtime.fa2_fwd`,
:mod:`flashtile.runtime.fa2_bwd`) trust these checks and repeat none of them.  Conventions: a wrong *type or dtype* raises
``TypeError``; a wrong *value, shape or device* raises ``ValueError``.

The checks only read Python scalars, shapes, dtypes and devices, so
``torch.compile(fullgraph=True)`` traces them without graph breaks (a
``window_size`` passed as a tensor is read back, which does break the graph).
Where a number is meant, NumPy scalars are accepted like Python ones and
bools are not (eagerly: ``torch.compile`` traces NumPy values as arrays, so
compiled callers pass Python numbers).  Each check takes the caller's
argument name, so the SDPA wrapper's errors say ``scale`` where flash-attn's
say ``softmax_scale``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np
import torch

from flashtile.reference.masks import BlockMask
from flashtile.runtime.common import interpreting

__all__ = [
    "SUPPORTED_DTYPES",
    "check_dense",
    "check_has_data",
    "MAX_HEAD_DIM",
    "MAX_SEQLEN",
    "AttnDims",
    "check_qkv_tensors",
    "check_dims",
    "check_window",
    "unbind_window",
    "check_softmax_scale",
    "check_softcap",
    "check_dropout",
    "check_alibi",
    "check_block_mask",
    "check_attn_mask",
    "check_varlen_dims",
    "check_cu_seqlens",
    "check_max_seqlen",
    "check_block_table",
    "check_cu_seqlens_values",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# longest sequence (and cache) a call may pass: the kernels' tile starts, tile-range and window bounds are int32
# sums of a length and a tile or of two lengths (a query length of 2^31 + 1 wrapped a tile start negative)
MAX_SEQLEN = 2**30
_DTYPE_NAMES = "torch.float16, torch.bfloat16 or torch.float32"


class AttnDims(NamedTuple):
    """Sizes of one attention call: q is (B, Hq, Nq, d), k and v are (B, Hk, Nk, d)."""

    batch: int
    heads_q: int
    heads_k: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int


def check_dense(x: torch.Tensor, name: str) -> None:
    """``x`` has memory the kernels can address: a strided layout (not sparse / mkldnn).  A meta tensor (no data)
    fails the device checks beside q's (q itself: :func:`check_has_data`)."""
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")


def check_has_data(x: torch.Tensor, name: str) -> None:
    """``x`` is not a meta tensor (shapes without data)."""
    if x.is_meta:
        raise ValueError(f"{name} is a meta tensor (no data): pass one on a CUDA device (or CPU under "
                         "TRITON_INTERPRET=1)")


def check_qkv_tensors(names: Sequence[str], *tensors: object) -> None:
    """q, k, v (under ``names``) are tensors of one supported dtype on one usable device."""
    for name, x in zip(names, tensors):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        check_dense(x, name)
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must have dtype {_DTYPE_NAMES}, got {x.dtype}")
    first = tensors[0]
    for name, x in zip(names[1:], tensors[1:]):
        if x.dtype != first.dtype:
            raise TypeError(
                f"{names[0]} and {name} must have the same dtype ({_DTYPE_NAMES}); got {first.dtype} and {x.dtype}"
            )
        if x.device != first.device:
            raise ValueError(f"{names[0]} and {name} must be on the same device; got {first.device} and {x.device}")
    check_has_data(first, names[0])  # one device by now
    if first.device.type == "cpu" and not interpreting():
        raise ValueError(
            f"{names[0]} is a CPU tensor: the Triton kernels need a CUDA device. Move the tensors to CUDA "
            "(x.cuda()) or set TRITON_INTERPRET=1 (before importing flashtile) to run them on CPU through "
            "Triton's interpreter"
        )


def check_dims(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq_major: bool, names: Sequence[str] = ("q", "k", "v")
) -> AttnDims:
    """Shapes of a call: (B, N, H, d) when ``seq_major`` (flash-attn layout), else (B, H, N, d).

    Checks 4-D inputs, 1 <= d <= 256 and equal head dims, k and v of one shape,
    one batch, and Hq a multiple of Hk (GQA / MQA).
    """
    layout = "(batch, seqlen, heads, head_dim)" if seq_major else "(batch, heads, seqlen, head_dim)"
    for name, x in zip(names, (q, k, v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(x.shape)}")
    h_ax, n_ax = (2, 1) if seq_major else (1, 2)
    b, hq, nq, d = q.shape[0], q.shape[h_ax], q.shape[n_ax], q.shape[3]
    hk, nk = k.shape[h_ax], k.shape[n_ax]
    _check_heads(names, q, k, v, hq, hk)
    for name, x in zip(names[1:], (k, v)):
        if x.shape[0] != b:
            raise ValueError(f"batch of {name} ({x.shape[0]}) must equal batch of {names[0]} ({b})")
    check_seqlen(nq, names[0])
    check_seqlen(nk, names[1])
    return AttnDims(b, hq, hk, nq, nk, d)


def check_seqlen(n: int, name: str) -> None:
    """A sequence length (or cache capacity) of ``name`` the kernels address: at most ``MAX_SEQLEN``."""
    if n > MAX_SEQLEN:
        raise ValueError(f"seqlen of {name} must be at most 2^30 = {MAX_SEQLEN} (the kernels' int32 tile ranges), "
                         f"got {n}")


def _check_heads(names: Sequence[str], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hq: int, hk: int) -> None:
    """What every layout shares: 1 <= head_dim (the last axis) <= 256 and equal in q, k, v; k and v of one
    shape; Hq a multiple of Hk (GQA / MQA)."""
    d = q.shape[-1]
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim of {names[0]} must be in 1..{MAX_HEAD_DIM}, got {d}")
    for name, x in zip(names[1:], (k, v)):
        if x.shape[-1] != d:
            raise ValueError(f"head_dim of {name} ({x.shape[-1]}) must equal head_dim of {names[0]} ({d})")
    if k.shape != v.shape:
        raise ValueError(f"{names[1]} shape {tuple(k.shape)} must equal {names[2]} shape {tuple(v.shape)}")
    if hk == 0 or hq % hk != 0:
        raise ValueError(
            f"number of heads of {names[0]} ({hq}) must be a multiple of the heads of {names[1]}/{names[2]} "
            f"({hk}) (GQA/MQA: head h of {names[0]} reads head h // (Hq // Hk) of {names[1]}/{names[2]})"
        )


def _is_int(x: object) -> bool:
    """A Python or NumPy integer, not a bool (Python ints are tested first: no NumPy check under tracing)."""
    if isinstance(x, int):
        return not isinstance(x, bool)
    return isinstance(x, np.integer)


def _pair_of_ints(window_size: object) -> tuple[object, ...] | None:
    """The two entries of a tuple / list, or of a 2-element integer tensor or NumPy array; None otherwise."""
    if isinstance(window_size, (tuple, list)):
        entries = tuple(window_size)
    elif isinstance(window_size, torch.Tensor) and not window_size.is_floating_point() and window_size.dtype != torch.bool:
        # a device tensor is read back: one host sync, only for this form of the argument
        entries = tuple(window_size.tolist()) if window_size.dim() == 1 else ()
    elif isinstance(window_size, np.ndarray) and np.issubdtype(window_size.dtype, np.integer):
        entries = tuple(window_size.tolist()) if window_size.ndim == 1 else ()
    else:
        return None
    return entries if len(entries) == 2 and all(_is_int(w) for w in entries) else None


def check_window(
    causal: object, window_size: object, *, names: tuple[str, str] = ("causal", "window_size")
) -> tuple[int, int]:
    """(left, right) with -1 unbounded; ``causal`` sets right = 0 (bottom-right aligned), as flash-attn does.

    ``window_size``: a pair of ints (Python or NumPy), or a 2-element integer
    tensor / NumPy array; any entry below -1 is refused.  With ``causal`` a
    right bound > 0 is replaced by 0 (flash-attn's rule), not an error.
    """
    causal_name, window_name = names
    if not isinstance(causal, bool):
        raise TypeError(f"{causal_name} must be a bool, got {type(causal).__name__}")
    entries = _pair_of_ints(window_size)
    if entries is None or min(entries) < -1:
        raise ValueError(
            f"{window_name} must be a pair of ints (left, right), each >= -1 (-1 = unbounded), got {window_size!r}"
        )
    left, right = int(entries[0]), int(entries[1])
    return left, (0 if causal else right)


def unbind_window(left: int, right: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """A bound that cannot exclude any key becomes -1 (unbounded): left >= Nk, right >= Nq.

    Key j is visible to query i iff i + Nk - Nq - left <= j <= i + Nk - Nq + right with 0 <= i < Nq,
    0 <= j < Nk, so such a bound never binds; the kernels' tile ranges then never see values near
    2^31 (a bound of 2^31 - 1 would overflow their int32 range arithmetic)."""
    return (-1 if left >= seqlen_k else left), (-1 if right >= seqlen_q else right)


def _real(x: object, name: str) -> float:
    """A Python or NumPy real scalar as a float; bools and tensors are refused (a tensor would need a sync)."""
    if isinstance(x, (int, float)):
        ok = not isinstance(x, bool)
    else:
        ok = isinstance(x, (np.floating, np.integer))
    if not ok:
        raise TypeError(f"{name} must be a float (a Python or NumPy real scalar), got {type(x).__name__}")
    return float(x)


def _finite(x: float) -> bool:
    """``math.isfinite`` by comparisons (NaN fails both), which torch.compile traces on a symbolic float."""
    return -math.inf < x < math.inf


def check_softmax_scale(scale: object, head_dim: int, *, name: str = "softmax_scale") -> float:
    """None -> 1/sqrt(d); otherwise a finite real number.  ``name``: the caller's argument name."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    s = _real(scale, name)
    if not _finite(s):
        raise ValueError(f"{name} must be a finite float (or None for 1/sqrt(head_dim)), got {s}")
    return s


SOFTCAP_MAX = 1e30  # s / c underflows fp32 below |s| ~ 1e-8 here; c * log2(e) must stay finite in fp32


def check_softcap(softcap: object, *, name: str = "softcap") -> float:
    """0 <= softcap <= SOFTCAP_MAX; 0 disables it (s = softcap * tanh(s / softcap) otherwise).  A larger cap
    changes no score below 1e26 at fp32 precision (relative change s^2 / 3c^2): 0 is the same, exactly."""
    c = _real(softcap, name)
    if not (c >= 0.0 and _finite(c)):
        raise ValueError(f"{name} must be a finite float >= 0 (0 disables it), got {c}")
    if c > SOFTCAP_MAX:
        raise ValueError(f"{name} must be at most {SOFTCAP_MAX:g} (a larger cap changes no fp32 score below 1e26: "
                         f"pass 0 to disable it), got {c:g}")
    return c


def check_dropout(dropout_p: object, *, name: str = "dropout_p") -> float:
    """dropout_p in [0, 1): p = 1 would drop everything and scale by 1/0."""
    p = _real(dropout_p, name)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p}")
    return p


def check_alibi(slopes: object, q: torch.Tensor, dims: AttnDims) -> None:
    """alibi_slopes: float32 of shape (Hq,) or (B, Hq) on q's device, no gradient."""
    b, hq = dims.batch, dims.heads_q
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(
            f"alibi_slopes must be a torch.Tensor of shape ({hq},) or ({b}, {hq}), got {type(slopes).__name__}"
        )
    check_dense(slopes, "alibi_slopes")
    if slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must have dtype torch.float32, got {slopes.dtype}")
    if tuple(slopes.shape) not in ((hq,), (b, hq)):
        raise ValueError(
            f"alibi_slopes must have shape (nheads,) = ({hq},) or (batch, nheads) = ({b}, {hq}), "
            f"got {tuple(slopes.shape)}"
        )
    if slopes.device != q.device:
        raise ValueError(f"alibi_slopes must be on the device of q ({q.device}), got {slopes.device}")
    if slopes.requires_grad:
        raise ValueError("alibi_slopes does not support gradients: pass alibi_slopes.detach()")


def check_block_mask(block_mask: object, dims: AttnDims) -> None:
    """A BlockMask whose grid covers (Nq, Nk), blocks multiples of 16, leading dims broadcasting to (B, Hq)."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must be a flashtile.reference.masks.BlockMask or None, got {type(block_mask).__name__}"
        )
    check_dense(block_mask.mask, "block_mask.mask")
    check_has_data(block_mask.mask, "block_mask.mask")  # copied to q's device: any device with data
    br, bc = block_mask.block_size
    if br % 16 or bc % 16:
        raise ValueError(
            f"block_mask.block_size must be multiples of 16 (the kernel tiles divide them), got {(br, bc)}"
        )
    block_mask.check_seqlens(dims.seqlen_q, dims.seqlen_k)
    lead = tuple(block_mask.mask.shape[:-2])
    want = (dims.batch, dims.heads_q)
    ok = len(lead) <= 2 and all(m in (1, w) for m, w in zip(reversed(lead), reversed(want)))
    if not ok:
        raise ValueError(
            f"block_mask.mask leading dims {lead} must broadcast to (batch, heads) = {want}: "
            "each of them 1 or the full size, at most 2 of them"
        )


def check_attn_mask(mask: object, q: torch.Tensor, dims: AttnDims, query_dim: int) -> None:
    """SDPA attn_mask: bool (True = take part) or float (added), broadcastable to (B, H, Nq, Nk)."""
    full = (dims.batch, dims.heads_q, dims.seqlen_q, dims.seqlen_k)[4 - query_dim :]
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    check_dense(mask, "attn_mask")
    if mask.dtype not in (torch.bool, torch.float32, q.dtype):  # torch's rule; others would be rounded silently
        raise TypeError(
            f"attn_mask must be bool (True = take part), float32 or of query's dtype {q.dtype} (added), got "
            f"{mask.dtype}"
        )
    if mask.device != q.device:
        raise ValueError(f"attn_mask must be on the device of query ({q.device}), got {mask.device}")
    shape = tuple(mask.shape)
    if len(shape) > len(full) or any(m not in (1, f) for m, f in zip(reversed(shape), reversed(full))):
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)} is not broadcastable to {full}")
    if mask.requires_grad:
        raise ValueError(
            "attn_mask requires grad, but gradients with respect to attn_mask are not supported: "
            "pass attn_mask.detach()"
        )


# --------------------------------------------------------------------------- #
# Packed (variable-length) batches
# --------------------------------------------------------------------------- #
def check_varlen_dims(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, paged: bool, names: Sequence[str] = ("q", "k", "v")
) -> tuple[int, int, int, int, int, int]:
    """(total_q, Hq, Hk, total_k, d, page_size) of packed q / k / v; k and v paged when ``paged``."""
    if q.dim() != 3:
        raise ValueError(f"{names[0]} must be 3-D (total_q, nheads, head_dim), got shape {tuple(q.shape)}")
    layout = "(num_pages, page_size, nheads_k, head_dim)" if paged else "(total_k, nheads_k, head_dim)"
    for name, x in zip(names[1:], (k, v)):
        if x.dim() != (4 if paged else 3):
            raise ValueError(f"{name} must be {4 if paged else 3}-D {layout}, got shape {tuple(x.shape)}")
    total_q, hq, d = q.shape
    hk = k.shape[-2]
    _check_heads(names, q, k, v, hq, hk)
    page_size = 0
    if paged:
        page_size = k.shape[1]
        if k.shape[0] < 1 or page_size < 16 or page_size % 16:
            raise ValueError(
                f"paged {names[1]} must have at least one page and a page_size that is a multiple of 16, "
                f"got shape {tuple(k.shape)}"
            )
    total_k = k.shape[0] * k.shape[1] if paged else k.shape[0]
    return total_q, hq, hk, total_k, d, page_size


def check_cu_seqlens(cu_seqlens_q: object, cu_seqlens_k: object, q: torch.Tensor, names=("cu_seqlens_q", "cu_seqlens_k")) -> int:
    """Types, shapes and devices of the two cumulative-length tensors (no value is read): int32, 1-D,
    the same length B + 1 >= 1, on q's device.  Returns B."""
    for name, cu in zip(names, (cu_seqlens_q, cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be an int32 torch.Tensor of shape (batch + 1,), got {type(cu).__name__}")
        check_dense(cu, name)
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be 1-D of shape (batch + 1,), got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"{names[0]} and {names[1]} must have the same length (batch + 1), got {cu_seqlens_q.shape[0]} "
            f"and {cu_seqlens_k.shape[0]}"
        )
    return cu_seqlens_q.shape[0] - 1


def check_max_seqlen(x: object, name: str) -> int:
    """A non-negative Python or NumPy int (a tensor would need a host sync)."""
    if not _is_int(x):
        raise TypeError(f"{name} must be an int (the longest sequence's length), got {type(x).__name__}")
    if int(x) < 0 or int(x) > MAX_SEQLEN:
        raise ValueError(f"{name} must be in [0, 2^30] (the kernels' int32 tile ranges), got {int(x)}")
    return int(x)


def check_block_table(block_table: object, q: torch.Tensor, batch: int) -> None:
    """block_table: int32 (batch, max_pages) on q's device."""
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be an int32 torch.Tensor (batch, max_pages), got {type(block_table).__name__}")
    check_dense(block_table, "block_table")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must have dtype torch.int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(
            f"block_table must have shape (batch, max_pages) = ({batch}, >= 1), got {tuple(block_table.shape)}"
        )
    if block_table.device != q.device:
        raise ValueError(f"block_table must be on the device of q ({q.device}), got {block_table.device}")


def check_cu_seqlens_values(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    total_q: int,
    total_k: int | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_table: torch.Tensor | None = None,
    num_pages: int = 0,
    page_size: int = 0,
    names: tuple[str, str] = ("cu_seqlens_q", "cu_seqlens_k"),
    max_names: tuple[str, str] = ("max_seqlen_q", "max_seqlen_k"),
) -> None:
    """The values the kernels clamp instead of trusting, checked on the host with one device-to-host copy:
    each cu_seqlens starts at 0, never decreases and ends at the packed length (``total_k`` None: paged K/V,
    whose lengths must fit the block table instead), no sequence is longer than its max_seqlen, and every
    block-table entry a sequence uses names a page of the pool."""
    parts = [cu_seqlens_q, cu_seqlens_k] + ([block_table.reshape(-1)] if block_table is not None else [])
    flat = torch.cat([p.reshape(-1).to(torch.int64) for p in parts]).tolist()  # the one sync
    n = cu_seqlens_q.shape[0]
    cus = (flat[:n], flat[n : 2 * n])
    for name, cu, total, max_len, max_name in (
        (names[0], cus[0], total_q, max_seqlen_q, max_names[0]),
        (names[1], cus[1], total_k, max_seqlen_k, max_names[1]),
    ):
        if cu[0] != 0:
            raise ValueError(f"{name}[0] must be 0, got {cu[0]}")
        lens = [b - a for a, b in zip(cu, cu[1:])]
        if any(length < 0 for length in lens):
            at = next(i for i, length in enumerate(lens) if length < 0)
            raise ValueError(f"{name} must be non-decreasing, got {name}[{at}] = {cu[at]} > {name}[{at + 1}] = {cu[at + 1]}")
        if total is not None and cu[-1] != total:
            raise ValueError(f"{name}[-1] must equal the number of packed tokens ({total}), got {cu[-1]}")
        if lens and max(lens) > max_len:
            raise ValueError(f"{max_name} ({max_len}) is smaller than the longest sequence in {name} ({max(lens)})")
    if block_table is not None:
        table = torch.tensor(flat[2 * n :], dtype=torch.int64).view(block_table.shape)
        for b, (k0, k1) in enumerate(zip(cus[1], cus[1][1:])):
            pages = -(-(k1 - k0) // page_size)
            if pages > table.shape[1]:
                raise ValueError(
                    f"sequence {b} has {k1 - k0} keys in cu_seqlens_k: more than block_table's "
                    f"{table.shape[1]} pages of {page_size} hold"
                )
            used = table[b, :pages]
            bad = ((used < 0) | (used >= num_pages)).nonzero()
            if bad.numel():
                j = int(bad[0, 0])
                raise ValueError(f"block_table[{b}, {j}] = {int(used[j])} is not a page of the pool (0..{num_pages - 1})")
