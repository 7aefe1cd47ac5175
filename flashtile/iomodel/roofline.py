"""Roofline model: is an attention algorithm limited by HBM bandwidth or by compute?

The roofline (Williams, Waterman & Patterson 2009) bounds the throughput of
a kernel of arithmetic intensity ``I = FLOPs / bytes moved`` by

    attainable(I) = min(peak FLOP/s, bandwidth * I)

The two meet at the ridge point ``I* = peak / bandwidth``: below it a
kernel is memory-bound, above it compute-bound.  Standard attention moves
Theta(N^2) elements for Theta(N^2 d) FLOPs, so its intensity is O(d) and it
stays memory-bound; FlashAttention moves Theta(N^2 d^2 / M) elements (FA1
Theorem 2), so its intensity grows like ``M / d`` and crosses the ridge.
That is the argument of FA1 Section 3.2, made numeric here for real GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from flashtile.iomodel.flops import attention_flops
from flashtile.iomodel.hbm import _int, fa1_hbm, fa2_hbm, standard_hbm

__all__ = [
    "Device",
    "A100",
    "H100",
    "H200",
    "DEVICES",
    "get_device",
    "arithmetic_intensity",
    "attainable_flops",
    "ridge_point",
    "ALGORITHMS",
    "attention_hbm_bytes",
    "attention_intensity",
    "RooflineRow",
    "roofline_table",
]

_DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "float8": "fp8",
    "float64": "fp64",
    "double": "fp64",
}


@dataclass(frozen=True)
class Device:
    """An accelerator for the roofline: dense peak FLOP/s per dtype, HBM bandwidth, SRAM.

    ``peak_flops`` maps a dtype name (``"bf16"``, ``"fp16"``, ``"tf32"``,
    ``"fp32"``, ``"fp8"``, ...) to dense tensor-core FLOP/s; ``bandwidth`` is
    HBM bytes/s; ``sram_bytes`` the shared memory of one SM (the ``M`` of the
    FA papers, in bytes); ``num_sms`` the number of SMs.
    """

    name: str
    peak_flops: dict[str, float]
    bandwidth: float
    sram_bytes: int
    num_sms: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Device.name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.peak_flops, dict) or not self.peak_flops:
            raise ValueError("Device.peak_flops must be a non-empty dict {dtype name: FLOP/s}")
        for k, v in self.peak_flops.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"Device.peak_flops must map dtype names to FLOP/s > 0, got {k!r}: {v!r}")
        if isinstance(self.bandwidth, bool) or not isinstance(self.bandwidth, (int, float)) or self.bandwidth <= 0:
            raise ValueError(f"Device.bandwidth must be bytes/s > 0, got {self.bandwidth!r}")
        _int("Device.sram_bytes", self.sram_bytes, 1)
        _int("Device.num_sms", self.num_sms, 1)

    def peak(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s for ``dtype`` (aliases like ``"bfloat16"`` accepted)."""
        key = _DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if key not in self.peak_flops:
            raise ValueError(f"dtype must be one of {sorted(self.peak_flops)} for {self.name}, got {dtype!r}")
        return float(self.peak_flops[key])

    def sram_elements(self, bytes_per_element: int = 2) -> int:
        """``M`` in elements: the SRAM of one SM divided by the element size."""
        return self.sram_bytes // _int("bytes_per_element", bytes_per_element, 1)


# Dense (no 2:4 sparsity) datasheet numbers.
A100 = Device(
    name="A100-SXM4-80GB",
    peak_flops={"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    bandwidth=2.039e12,
    sram_bytes=192 * 1024,
    num_sms=108,
)
H100 = Device(
    name="H100-SXM5-80GB",
    peak_flops={"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494e12, "fp32": 67e12},
    bandwidth=3.35e12,
    sram_bytes=228 * 1024,
    num_sms=132,
)
H200 = Device(
    name="H200-SXM-141GB",
    peak_flops=dict(H100.peak_flops),
    bandwidth=4.8e12,
    sram_bytes=228 * 1024,
    num_sms=132,
)
DEVICES: dict[str, Device] = {"a100": A100, "h100": H100, "h200": H200}


def get_device(name: str | Device) -> Device:
    """A preset by name (``"A100"``, ``"H100"``, ``"H200"``, case-insensitive); a Device is returned as is."""
    if isinstance(name, Device):
        return name
    if not isinstance(name, str) or name.lower() not in DEVICES:
        raise ValueError(f"device name must be one of {sorted(n.upper() for n in DEVICES)}, got {name!r}")
    return DEVICES[name.lower()]


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOPs per byte of HBM traffic."""
    if isinstance(flops, bool) or not isinstance(flops, (int, float)) or flops < 0:
        raise ValueError(f"flops must be a number >= 0, got {flops!r}")
    if isinstance(bytes_moved, bool) or not isinstance(bytes_moved, (int, float)) or bytes_moved <= 0:
        raise ValueError(f"bytes_moved must be a number > 0, got {bytes_moved!r}")
    return flops / bytes_moved


def attainable_flops(intensity: float, device: Device | str, dtype: str = "bf16") -> float:
    """Roofline bound ``min(peak, bandwidth * intensity)`` in FLOP/s."""
    if isinstance(intensity, bool) or not isinstance(intensity, (int, float)) or intensity < 0:
        raise ValueError(f"intensity must be a number >= 0 (FLOP/byte), got {intensity!r}")
    dev = get_device(device)
    return min(dev.peak(dtype), dev.bandwidth * intensity)


def ridge_point(device: Device | str, dtype: str = "bf16") -> float:
    """Intensity ``peak / bandwidth`` (FLOP/byte) where the memory and compute roofs meet."""
    dev = get_device(device)
    return dev.peak(dtype) / dev.bandwidth


ALGORITHMS = ("standard", "fa1", "fa2")


def attention_hbm_bytes(
    n: int,
    d: int,
    algorithm: str = "standard",
    *,
    sram_size: int | None = None,
    block_sizes: Sequence[int] | None = None,
    bytes_per_element: int = 2,
    device: Device | str = "A100",
) -> int:
    """HBM bytes of one head of self-attention (Nq = Nk = n) for ``algorithm``.

    ``"standard"``: :func:`standard_hbm`; ``"fa1"``: :func:`fa1_hbm` with
    tiles from ``sram_size`` (``M`` in elements; default: one SM of
    ``device``); ``"fa2"``: :func:`fa2_hbm` with ``block_sizes`` (default
    (64, 64)).  Elements are ``bytes_per_element`` bytes each.
    """
    bpe = _int("bytes_per_element", bytes_per_element, 1)
    if algorithm == "standard":
        elems = standard_hbm(n, n, d)
    elif algorithm == "fa1":
        m = get_device(device).sram_elements(bpe) if sram_size is None else sram_size
        elems = fa1_hbm(n, n, d, sram_size=m)
    elif algorithm == "fa2":
        elems = fa2_hbm(n, n, d, block_sizes=block_sizes)
    else:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    return elems * bpe


def attention_intensity(
    n: int,
    d: int,
    algorithm: str = "standard",
    *,
    sram_size: int | None = None,
    block_sizes: Sequence[int] | None = None,
    bytes_per_element: int = 2,
    device: Device | str = "A100",
) -> float:
    """Arithmetic intensity of the forward: ``4 n^2 d`` FLOPs over :func:`attention_hbm_bytes` bytes.

    Standard: ``4 n^2 d / (b (4 n d + 4 n^2)) -> d / b`` for large n (b bytes
    per element): bounded by the head dim.  FA1: about
    ``4 n^2 d / (b * 12 n^2 d^2 / M) = M / (3 b d)``, set by the SRAM size.
    """
    flops = attention_flops(1, 1, n, n, d)
    hbm = attention_hbm_bytes(
        n, d, algorithm, sram_size=sram_size, block_sizes=block_sizes, bytes_per_element=bytes_per_element, device=device
    )
    return arithmetic_intensity(flops, hbm)


class RooflineRow(NamedTuple):
    """One line of :func:`roofline_table`; ``attainable`` in FLOP/s, ``bound`` "memory" or "compute"."""

    algorithm: str
    n: int
    hbm_bytes: int
    flops: int
    intensity: float
    attainable: float
    bound: str


def roofline_table(
    device: Device | str = "A100",
    *,
    ns: Sequence[int] = (512, 1024, 2048, 4096, 8192, 16384),
    d: int = 64,
    algorithms: Sequence[str] = ALGORITHMS,
    dtype: str = "bf16",
    bytes_per_element: int = 2,
    sram_size: int | None = None,
    block_sizes: Sequence[int] | None = None,
) -> list[RooflineRow]:
    """Rows (algorithm, N, HBM bytes, FLOPs, intensity, attainable FLOP/s, bound) for one head.

    A row is ``"memory"``-bound when its intensity is below
    :func:`ridge_point` (bandwidth is the binding roof), else ``"compute"``.
    The model counts HBM traffic only: K/V tiles re-read by several query
    blocks are charged every time, although on a GPU many of those reads hit
    L2, so FA2's real intensity is higher than its row says (about
    ``2 Br / b`` FLOP/byte here, b bytes per element).
    """
    dev = get_device(device)
    ridge = ridge_point(dev, dtype)
    rows = []
    for algorithm in algorithms:
        for n in ns:
            hbm = attention_hbm_bytes(
                n, d, algorithm, sram_size=sram_size, block_sizes=block_sizes, bytes_per_element=bytes_per_element, device=dev
            )
            flops = attention_flops(1, 1, n, n, d)
            intensity = arithmetic_intensity(flops, hbm)
            bound = "memory" if intensity < ridge else "compute"
            rows.append(RooflineRow(algorithm, n, hbm, flops, intensity, attainable_flops(intensity, dev, dtype), bound))
    return rows
