"""Host helpers shared by the kernel wrappers: execution mode, grids, strides, the dropout Philox state."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import warnings

import torch
import triton

from flashtile.kernels._common import _dropout_mask_kernel

# torch.cuda.current_device() without its lazy-init check (call it only once CUDA is initialised)
cuda_device_index = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def on_tensor_device(impl):
    """Run ``impl(*args)`` with the CUDA device of ``args[0]`` current: Triton launches on the
    current device.  The device is entered only when it is not current already; the check costs
    ~0.2 us per call (measured on CPU tensors; ``x.device.type`` alone measured 0.5 us)."""

    @functools.wraps(impl)
    def guarded(*args):
        index = args[0].get_device()  # -1 off CUDA
        if index >= 0 and index != cuda_device_index():
            with torch.cuda.device(index):
                return impl(*args)
        return impl(*args)

    return guarded


_CURRENT = contextlib.nullcontext()


def on_device(x: torch.Tensor):
    """A context manager making ``x``'s CUDA device current: a no-op one when it is already (or ``x`` is not
    on CUDA), which costs less host time than ``torch.cuda.device`` entering the current device again."""
    index = x.get_device()
    return _CURRENT if index < 0 or index == cuda_device_index() else torch.cuda.device(index)


def interpreting(device: torch.device | str | None = None) -> bool:
    """True when the kernels run through Triton's interpreter: TRITON_INTERPRET=1, or tensors on ``device`` = CPU."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return True
    return device is not None and torch.device(device).type == "cpu"


def pdl_supported(device: torch.device | str) -> bool:
    """Whether kernels on ``device`` may use programmatic dependent launch (Hopper and later).

    A kernel launched with ``launch_pdl=True`` is started while the kernel before
    it in the stream is still running; it must call ``gdc_wait()`` before it
    reads anything that kernel writes (``griddepcontrol`` is an sm_90 instruction)."""
    device = torch.device(device)
    if interpreting(device) or device.type != "cuda":
        return False
    return capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device ``index`` (queried once per device)."""
    return torch.cuda.get_device_capability(index)


def triton_release(version: str = triton.__version__) -> tuple[int, int]:
    """(major, minor) of a Triton version string ("3.6.0", "3.7.0+git1a2b": (3, 6), (3, 7)); (0, 0) if unparsable."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else (0, 0)


# Triton releases the Hopper kernels (tensor descriptors, warp specialisation, Gluon) were built and GPU-tested on.
# Gluon's API moves between releases (sm_90a compiles offline: the Gluon backward fails on 3.5, 3.7, 3.8 and 3.9,
# the forward on 3.5 and 3.9), so on any other release every call takes the FA2 kernels; FLASHTILE_ANY_TRITON=1
# tries the Hopper kernels anyway.
HOPPER_TRITONS = ((3, 6),)
HOPPER_TRITON = triton_release() in HOPPER_TRITONS or os.environ.get("FLASHTILE_ANY_TRITON", "0") == "1"
_warned = []
_WARN_LOCK = threading.Lock()


def hopper_target(cap: tuple[int, int]) -> bool:
    """Whether a device of compute capability ``cap`` runs the Hopper kernels: sm_90, and this Triton one they
    were tested on (``HOPPER_TRITON``; the first sm_90 call without it warns once)."""
    if cap != (9, 0):
        return False
    if not HOPPER_TRITON and not _warned:
        with _WARN_LOCK:
            first = not _warned
            _warned.append(True)
        if first:
            tested = ", ".join(f"{a}.{b}" for a, b in HOPPER_TRITONS)
            warnings.warn(f"flashtile's Hopper kernels are tested on Triton {tested}; this is Triton "
                          f"{triton.__version__}, so sm_90 runs the FA2 kernels (FLASHTILE_ANY_TRITON=1 tries the "
                          f"Hopper ones)", stacklevel=2)
    return HOPPER_TRITON


def require_hopper(what: str, index: int) -> None:
    """``NotImplementedError`` naming why ``what`` cannot run on CUDA device ``index``: not sm_90, or a Triton the
    Hopper kernels were not tested on (:func:`hopper_target`)."""
    if capability(index) != (9, 0):
        raise NotImplementedError(f"{what} needs an sm_90 (Hopper) CUDA device")
    if not HOPPER_TRITON:
        tested = ", ".join(f"{a}.{b}" for a, b in HOPPER_TRITONS)
        raise NotImplementedError(f"{what} is tested on Triton {tested}, got Triton {triton.__version__} "
                                  f"(FLASHTILE_ANY_TRITON=1 lifts this check)")


def check_device_mode(device: torch.device) -> None:
    """CPU tensors run only through the interpreter, and the interpreter only on CPU tensors."""
    env_on = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type == "cpu" and not env_on:
        raise ValueError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing flashtile.kernels")
    if device.type != "cpu" and env_on:
        raise ValueError(f"TRITON_INTERPRET=1 runs kernels on CPU tensors; got tensors on {device}")


# CUDA's grid limits: axis x up to 2^31 - 1 programs, axes y and z up to 65535
GRID_X_MAX = 2**31 - 1
GRID_YZ_MAX = 65535


def fold_grid(n_tiles: int, n_bh: int) -> tuple[int, int, int]:
    """Grid (tiles, Y, Z) for ``n_tiles`` tiles of each of ``n_bh`` (batch, head) pairs within
    CUDA's limits: program (x, y, z) owns tile x of pair z * Y + y
    (:func:`flashtile.kernels._common.unfold_pid`).  The tile index stays fastest and the pairs
    follow in order, as in a (tiles, pairs) grid; axis z carries the pairs past 65535 (the last
    z-row's programs past the last pair exit).  The tile index is program_id(0) itself, no division: a divided-out index is a value the kernel
    must keep live, where program_id is re-read for free (ptxas, sm_90a: larger spills)."""
    if n_tiles > GRID_X_MAX:
        raise ValueError(f"{n_tiles} tiles per (batch, head) exceed CUDA's {GRID_X_MAX} programs on grid axis x")
    if n_bh > GRID_X_MAX - GRID_YZ_MAX:  # the kernels index pairs, spare programs included, in int32
        raise ValueError(f"batch * heads = {n_bh} exceeds the {GRID_X_MAX - GRID_YZ_MAX} (batch, head) pairs the kernels index")
    y = min(n_bh, GRID_YZ_MAX)
    return n_tiles, y, -(-n_bh // y)  # y * z < n_bh + y <= 2^31 - 1, so z < 65535



# Triton offsets each program's global scratch (where in-kernel tensor descriptors are built) by program id x its
# bytes in int32, so a grid whose scratch reaches 2^31 bytes writes outside it (H100, Triton 3.6: 5.6M programs x
# 384 B faulted).  Bytes per program, bounds of offline sm_90a compiles: forward kernels 384-768 (Triton: 640)
DESC_SCRATCH_BYTES = 1024
# backward kernels 512-1408 (the wide Gluon kernel's 192-wide tiles with dQ through TMA: 11 descriptors)
DESC_SCRATCH_BWD_BYTES = 2048


def descriptor_grid_fits(programs: int, backward: bool = False) -> bool:
    """Whether ``programs`` programs of a forward (or ``backward``) kernel that build tensor descriptors in
    global scratch stay inside it."""
    return programs * (DESC_SCRATCH_BWD_BYTES if backward else DESC_SCRATCH_BYTES) < 2**31


def check_descriptor_grid(programs: int, what: str, backward: bool = False) -> None:
    """NotImplementedError unless :func:`descriptor_grid_fits` (for direct callers of the Hopper launchers;
    the public dispatch sends such problems to the FA2 kernels first)."""
    if not descriptor_grid_fits(programs, backward):
        scratch = DESC_SCRATCH_BWD_BYTES if backward else DESC_SCRATCH_BYTES
        raise NotImplementedError(
            f"{what}: a grid of {programs} programs, each building tensor descriptors in global scratch, exceeds "
            f"the {2**31 // scratch - 1} programs Triton's int32 scratch offsets allow; flash_attn_func / "
            "flash_attn_varlen_func run such problems on the FA2 kernels")


# Tiles are addressed from a 64-bit base plus 32-bit in-tile offsets (tile row x row stride,
# tiles of at most 256 rows): a row stride below this keeps those offsets under 2^31
TILE_ROW_STRIDE_MAX = 2**31 // 256


def wide_rows(*tensors: torch.Tensor) -> bool:
    """Whether some tensor's row stride (dim -2) would overflow 32-bit in-tile offsets: a bitwise
    OR bounds the maximum because the limit is a power of two."""
    acc = 0
    for x in tensors:
        acc |= x.stride(-2)
    return acc >= TILE_ROW_STRIDE_MAX


def unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """The kernels vectorise along the last dim: copy only when its stride is not 1."""
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def check_rng_state(rng_state, philox_seed: int, philox_offset: int, device: torch.device) -> torch.Tensor:
    """The int64 [seed, offset] tensor on ``device`` that the kernels read for dropout:
    ``rng_state`` itself when given, else one built from the two ints (a host-to-device copy:
    callers on a hot path or in a CUDA graph pass a device tensor)."""
    if rng_state is None:
        for name, x in (("philox_seed", philox_seed), ("philox_offset", philox_offset)):
            if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 2**63:
                raise ValueError(f"{name} must be an int in [0, 2^63), got {x!r}")
        return torch.tensor([philox_seed, philox_offset], dtype=torch.int64, device=device)
    if not isinstance(rng_state, torch.Tensor) or rng_state.dtype != torch.int64:
        got = rng_state.dtype if isinstance(rng_state, torch.Tensor) else type(rng_state).__name__
        raise TypeError(f"rng_state must be an int64 torch.Tensor [seed, offset], got {got}")
    if tuple(rng_state.shape) != (2,):
        raise ValueError(f"rng_state must have shape (2,) = [seed, offset], got {tuple(rng_state.shape)}")
    if rng_state.device != device:
        raise ValueError(f"rng_state must be on {device} (the device of q), got {rng_state.device}")
    if philox_seed or philox_offset:
        raise ValueError("pass either rng_state or philox_seed / philox_offset, not both")
    return rng_state if rng_state.stride(0) == 1 else rng_state.contiguous()


def dropout_keep_mask(
    philox_seed: int,
    philox_offset: int,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    dropout_p: float,
    device: torch.device | str,
) -> torch.Tensor:
    """Materialise the keep-mask the kernels use, shape (batch, heads, Nq, Nk) bool.

    For tests and debugging: feed it to the reference (``dropout_mask=``) to check
    a kernel's dropout element by element."""
    out = torch.empty(batch * heads, seqlen_q, seqlen_k, dtype=torch.int8, device=device)
    if out.numel():
        grid = fold_grid(-(-seqlen_q // 16), batch * heads)
        _dropout_mask_kernel[grid](
            out, philox_seed, philox_offset, batch * heads, seqlen_q, seqlen_k, float(dropout_p), BLOCK_M=16, BLOCK_N=32,
        )
    return out.view(batch, heads, seqlen_q, seqlen_k).bool()
