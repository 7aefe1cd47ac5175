"""The IO lab: measure what the IO model of the FlashAttention papers predicts (GPU only).

Four experiments, each a function returning a JSON-able dict:

* :func:`fa1_vs_fa2` -- FA1 Algorithm 1 (:func:`flashtile.runtime.fa1_fwd.fa1_forward`),
  FA2 (:func:`flashtile.runtime.fa2_fwd.fa2_forward`) and PyTorch SDPA's flash
  backend on the same bf16 inputs; TFLOP/s with the convention 4 B H N^2 d.
* :func:`softmax_bandwidth` -- the online softmax (2 reads + 1 write per element)
  against the safe one (3 reads + 1 write) and ``torch.softmax``; GB/s counted
  as the ideal 2 bytes x (1 read + 1 write) per element, so the ratio
  online / safe should approach the access ratio 4 / 3 on long rows.
* :func:`ncu_fa1_dram` -- Nsight Compute's DRAM (and L2) bytes of single FA1
  and block-sparse FA2 launches against the closed forms of
  :mod:`flashtile.iomodel` (:func:`fa1_model_bytes`, :func:`fa2_model_bytes`).
* :func:`roofline_plot` -- the measured roofline (copy bandwidth and bf16 GEMM
  rate measured in the same run) with each kernel placed at its model
  intensity and achieved TFLOP/s.

:func:`run_io_lab` runs them all and writes ``io_lab_<device>.json`` and
a PNG next to it.  Every experiment records its own failure (``"error"``)
instead of losing the others' results.

Byte models.  FA1 keeps O, l, m in HBM as fp32 (4 bytes) and reads Q, K, V in
the input dtype; its element accesses are exactly
``fa1_hbm(block_sizes=fa1_tiles(M, d)) + fa1_init_writes`` (line 2 of
Algorithm 1 runs inside the kernel), their bytes are counted per tensor in
:func:`fa1_model_bytes`.  ``fa1_hbm(sram_size=M) * 2`` (the paper's tiles, all
2-byte) is recorded next to it as ``paper_bytes``.  The FA2 forward writes its
LSE in fp32; the rest is in the input dtype.

DRAM vs L2.  The model counts traffic between the SMs and "HBM".  On an H100,
50 MB of L2 sit in between: when a head's O, l, m (N d fp32) stay in L2, the
re-reads of Algorithm 1 never reach DRAM and ``dram__bytes`` falls far below
the model.  The L2 sectors requested by the SMs
(``lts__t_sectors_srcunit_tex_op_{read,write}``, 32 bytes each) are what the
model predicts; both are recorded.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from flashtile.bench.common import environment, median_ms, rel_err, write_json
from flashtile.iomodel import H100, attention_flops, fa1_hbm, fa1_init_writes, fa2_hbm
from flashtile.reference.masks import BlockMask

__all__ = [
    "fa1_vs_fa2",
    "softmax_bandwidth",
    "fa1_model_bytes",
    "fa2_model_bytes",
    "parse_ncu_csv",
    "ncu_fa1_dram",
    "measure_roof",
    "roofline_points",
    "roofline_plot",
    "run_io_lab",
]

NCU_METRICS = (
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "lts__t_sectors_srcunit_tex_op_read.sum",
    "lts__t_sectors_srcunit_tex_op_write.sum",
)
SECTOR_BYTES = 32
# nonmatmul flops per element of the two softmax kernels, from the table of
# flashtile/reference/softmax.py: the online kernel is its "block online" variant
# (7, plus a per-block merge, negligible for blocks of thousands), the safe one 7
SOFTMAX_FLOPS_PER_ELEM = {"online": 7, "safe": 7}
SOFTMAX_ACCESSES_PER_ELEM = {"online": 3, "safe": 4}
_FP32 = 4


def _need_gpu(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA GPU")


def _error(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


# --------------------------------------------------------------------------- #
# (a) FA1 vs FA2 vs SDPA flash
# --------------------------------------------------------------------------- #
def _sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def fa1_vs_fa2(
    seqlens: tuple[int, ...] = (1024, 2048, 4096, 8192),
    *,
    total_tokens: int = 16384,
    hidden: int = 2048,
    d: int = 64,
    sram_elems: int = H100.sram_elements(2),
) -> dict:
    """Forward TFLOP/s of fa1_forward, fa2_forward and SDPA-flash, bf16, B N = total_tokens, H d = hidden.

    Each row also holds the model bytes of every provider (for the roofline;
    SDPA-flash is charged FA2's bytes at our FA2 tiles) and the relative error
    of our two kernels against SDPA-flash.
    """
    _need_gpu("fa1_vs_fa2")
    from flashtile.runtime.fa1_fwd import fa1_forward, fa1_tiles
    from flashtile.runtime.fa2_fwd import fa2_forward, fwd_config

    heads = hidden // d
    scale = d**-0.5
    rows = []
    for n in seqlens:
        b = max(1, total_tokens // n)
        torch.manual_seed(n)
        q, k, v = (torch.randn(b, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fa2_tiles = fwd_config(d, torch.bfloat16, False, n, n, "cuda")[:2]
        fns = {
            "fa1": lambda: fa1_forward(q, k, v, sram_elems=sram_elems, softmax_scale=scale),
            "fa2": lambda: fa2_forward(q, k, v, softmax_scale=scale)[0],
            "sdpa-flash": lambda: _sdpa_flash(q, k, v),
        }
        flops = attention_flops(b, heads, n, n, d)
        fa2_bytes = fa2_model_bytes(n, n, d, block_sizes=fa2_tiles, batch=b, heads=heads)
        row = {
            "seqlen": n, "batch": b, "heads": heads, "head_dim": d, "flops": flops,
            "fa1_tiles": fa1_tiles(sram_elems, d), "fa2_tiles": fa2_tiles, "sram_elems": sram_elems,
            "model_bytes": {
                "fa1": fa1_model_bytes(n, n, d, fa1_tiles(sram_elems, d), batch=b, heads=heads)["total"],
                "fa2": fa2_bytes,
                "sdpa-flash": fa2_bytes,
            },
            "ms": {}, "tflops": {}, "rel_err_vs_sdpa": {},
        }
        with torch.no_grad():
            ref = None
            try:
                ref = fns["sdpa-flash"]()
            except Exception as e:  # no flash backend on this GPU / build
                row["sdpa_error"] = _error(e)
            for name, fn in fns.items():
                try:
                    out = fn()
                    if ref is not None and name != "sdpa-flash":
                        row["rel_err_vs_sdpa"][name] = rel_err(out, ref)
                    ms = median_ms(fn)
                except Exception as e:
                    row["ms"][name] = None
                    row.setdefault("errors", {})[name] = _error(e)
                    continue
                row["ms"][name] = ms
                row["tflops"][name] = flops / (ms * 1e-3) / 1e12
        rows.append(row)
        del q, k, v, ref
        torch.cuda.empty_cache()
    return {"flops_convention": "4*B*H*N^2*d (forward, non-causal)", "dtype": "bf16", "rows": rows}


# --------------------------------------------------------------------------- #
# (b) softmax bandwidth
# --------------------------------------------------------------------------- #
def softmax_bandwidth(
    ns: tuple[int, ...] = (1024, 4096, 16384, 65536),
    *,
    total_elems: int = 256 * 2**20,
) -> dict:
    """GB/s of softmax_online, softmax_safe and torch.softmax on (total_elems / n, n) bf16.

    ``gbps`` counts the ideal traffic, 2 bytes x (read + write) per element,
    so it compares times directly; ``model_gbps`` counts each kernel's own
    accesses (online 3, safe 4 per element) and should sit near the copy
    bandwidth for both when they are memory-bound.
    """
    _need_gpu("softmax_bandwidth")
    from flashtile.runtime.softmax import softmax_online, softmax_safe

    fns = {"online": softmax_online, "safe": softmax_safe, "torch": lambda x: torch.softmax(x, dim=-1)}
    rows = []
    for n in ns:
        r = max(1, total_elems // n)
        torch.manual_seed(n)
        x = torch.randn(r, n, device="cuda", dtype=torch.bfloat16)
        elems = r * n
        ref = torch.softmax(x.float(), dim=-1)
        row = {"n": n, "rows": r, "ms": {}, "gbps": {}, "model_gbps": {}, "max_abs_err": {}}
        for name, fn in fns.items():
            try:
                row["max_abs_err"][name] = float((fn(x).float() - ref).abs().max())
                ms = median_ms(lambda: fn(x))
            except Exception as e:
                row.setdefault("errors", {})[name] = _error(e)
                continue
            row["ms"][name] = ms
            row["gbps"][name] = 2 * 2 * elems / (ms * 1e-3) / 1e9
            if name in SOFTMAX_ACCESSES_PER_ELEM:
                row["model_gbps"][name] = 2 * SOFTMAX_ACCESSES_PER_ELEM[name] * elems / (ms * 1e-3) / 1e9
        g = row["gbps"]
        row["ratio_online_over_safe"] = g["online"] / g["safe"] if "online" in g and "safe" in g else None
        rows.append(row)
        del x, ref
        torch.cuda.empty_cache()
    return {"dtype": "bf16", "gbps_convention": "2 bytes * (1 read + 1 write) per element", "expected_ratio": 4 / 3, "rows": rows}


# --------------------------------------------------------------------------- #
# (c) Nsight Compute: measured DRAM bytes against the IO model
# --------------------------------------------------------------------------- #
def fa1_model_bytes(
    nq: int, nk: int, d: int, tiles: tuple[int, int], *, in_bytes: int = 2, batch: int = 1, heads: int = 1
) -> dict:
    """Bytes fa1_forward moves, per tensor, for the kernel's tiles ``(Br, Bc)``.

    Per (batch, head), with ``Tc = ceil(Nk / Bc)`` (Algorithm 1):

        K, V (line 6)          2 Nk d       x in_bytes
        Q_i (line 8)           Tc Nq d      x in_bytes
        O_i read (line 8)      Tc Nq d      x 4
        O_i write (line 12)    (Tc - 1) Nq d x 4  +  Nq d x in_bytes (last step: the output)
        l, m read + write      4 Tc Nq      x 4
        init (line 2)          Nq d x 4 + 2 Nq x 4

    ``accesses`` is the element count, ``fa1_hbm + fa1_init_writes``.
    """
    bh = batch * heads
    tc = -(-nk // tiles[1])
    parts = {
        "kv": 2 * nk * d * in_bytes,
        "q": tc * nq * d * in_bytes,
        "o_read": tc * nq * d * _FP32,
        "o_write": (tc - 1) * nq * d * _FP32 + nq * d * in_bytes,
        "lm": 4 * tc * nq * _FP32,
        "init": (nq * d + 2 * nq) * _FP32,
    }
    parts = {k: bh * v for k, v in parts.items()}
    accesses = fa1_hbm(nq, nk, d, block_sizes=tiles, batch=batch, heads=heads) + fa1_init_writes(nq, d, batch=batch, heads=heads)
    return {**parts, "total": sum(parts.values()), "accesses": accesses}


def fa2_model_bytes(nq: int, nk: int, d: int, *, in_bytes: int = 2, lse_bytes: int = _FP32, **tiling) -> int:
    """Bytes of the FA2 forward: :func:`flashtile.iomodel.fa2_hbm` with the LSE (Nq per head) in fp32.

    ``tiling``: ``block_sizes`` / ``block_mask`` / ``batch`` / ``heads`` as for fa2_hbm."""
    bh = (tiling.get("batch") or 1) * (tiling.get("heads") or 1)
    elements = fa2_hbm(nq, nk, d, **tiling)
    return (elements - bh * nq) * in_bytes + bh * nq * lse_bytes


_UNIT_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30}


def _unit_scale(unit: str) -> float:
    """Multiplier of an ncu unit to its base (``Mbyte`` -> 1e6, ``sector`` -> 1)."""
    for base in ("byte", "sector"):
        if unit.endswith(base):
            return _UNIT_PREFIX.get(unit[: -len(base)], 1.0)
    return 1.0


def _number(cell: str) -> float | None:
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return None


def parse_ncu_csv(text: str, metrics: tuple[str, ...] = NCU_METRICS) -> list[dict]:
    """Rows of ``ncu --csv --page raw`` output: ``{"id", "kernel", metric: value in base units}``.

    Lines before the header (``"ID",...``) and ncu's ``==PROF==`` messages are
    skipped; a units row (empty ID) rescales values given in Kbyte/Mbyte/...;
    thousands separators are removed; a metric missing from the header is None.
    """
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return []
    table = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, body = table[0], table[1:]
    col = {name: i for i, name in enumerate(header)}
    scale = {m: 1.0 for m in metrics}
    if body and body[0] and body[0][0] == "":  # units row
        scale = {m: _unit_scale(body[0][col[m]]) if m in col and col[m] < len(body[0]) else 1.0 for m in metrics}
        body = body[1:]
    rows = []
    for cells in body:
        if len(cells) != len(header):
            continue
        row = {"id": cells[col["ID"]] if "ID" in col else None, "kernel": cells[col["Kernel Name"]] if "Kernel Name" in col else ""}
        for m in metrics:
            v = _number(cells[col[m]]) if m in col else None
            row[m] = None if v is None else v * scale[m]
        rows.append(row)
    return rows


_NCU_SCRIPT = """\
import sys
import torch
from flashtile.runtime.fa1_fwd import fa1_forward
from flashtile.runtime.fa2_fwd import fa2_forward
from flashtile.reference.masks import BlockMask

for c in torch.load(sys.argv[1]):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, c["heads"], c["n"], c["d"], device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    if c["kind"] == "fa1":
        fa1_forward(q, k, v, sram_elems=c["sram"])
    else:
        fa2_forward(q, k, v, softmax_scale=c["d"] ** -0.5, block_mask=BlockMask(c["mask"], tuple(c["block"])))
    torch.cuda.synchronize()
"""


def _ncu_configs(seqlens, srams, densities, d, heads, sparse_n, block) -> list[dict]:
    from flashtile.runtime.fa1_fwd import fa1_tiles

    cfgs = []
    for n in seqlens:
        for m in srams:
            tiles = fa1_tiles(m, d)
            model = fa1_model_bytes(n, n, d, tiles, heads=heads)
            paper = 2 * heads * (fa1_hbm(n, n, d, sram_size=m) + fa1_init_writes(n, d))
            cfgs.append(dict(kind="fa1", n=n, d=d, heads=heads, sram=m, tiles=tiles, model_bytes=model["total"],
                             model_accesses=model["accesses"], paper_bytes=paper))
    for i, s in enumerate(densities):
        mask = BlockMask.random(sparse_n, sparse_n, s, block, generator=torch.Generator().manual_seed(i))
        cfgs.append(dict(kind="fa2", n=sparse_n, d=d, heads=heads, density=s, measured_density=mask.density,
                         mask=mask.mask, block=list(mask.block_size),
                         model_bytes=fa2_model_bytes(sparse_n, sparse_n, d, block_mask=mask, heads=heads)))
    return cfgs


def _run_ncu(ncu: str, script: Path, cfg_path: Path, log: Path, timeout_s: int, base_units: bool) -> subprocess.CompletedProcess:
    cmd = [ncu, "--clock-control", "none", "--metrics", ",".join(NCU_METRICS),
           "--kernel-name", "regex:_fa[12]_fwd_kernel", "--csv", "--page", "raw", "--log-file", str(log)]
    if base_units:
        cmd += ["--print-units", "base"]
    cmd += [sys.executable, str(script), str(cfg_path)]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the directory holding the flashtile package
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)


def _attach(cfgs: list[dict], rows: list[dict]) -> list[dict]:
    """Pair the profiled kernels with the configs, in launch order, kind by kind."""
    out = []
    for kind in ("fa1", "fa2"):
        want = [c for c in cfgs if c["kind"] == kind]
        got = [r for r in rows if f"_{kind}_fwd_kernel" in r["kernel"]]
        for c, r in zip(want, got):
            res = {k: v for k, v in c.items() if k != "mask"}
            rd, wr = r[NCU_METRICS[0]], r[NCU_METRICS[1]]
            lr, lw = r[NCU_METRICS[2]], r[NCU_METRICS[3]]
            res["dram_bytes"] = None if rd is None or wr is None else rd + wr
            res["dram_read"], res["dram_write"] = rd, wr
            res["l2_bytes"] = None if lr is None or lw is None else (lr + lw) * SECTOR_BYTES
            for key in ("dram_bytes", "l2_bytes"):
                res[key.replace("bytes", "over_model")] = res[key] / c["model_bytes"] if res[key] else None
            out.append(res)
        if len(want) != len(got):
            out.append({"kind": kind, "error": f"expected {len(want)} {kind} kernels in the ncu output, found {len(got)}"})
    return out


def ncu_fa1_dram(
    seqlens: tuple[int, ...] = (1024, 2048, 4096),
    srams: tuple[int, ...] = (4 * 64 * 16, 4 * 64 * 32, 4 * 64 * 64, 4 * 64 * 128),
    densities: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0),
    *,
    d: int = 64,
    heads: int = 1,
    sparse_n: int = 4096,
    sparse_block: tuple[int, int] = (128, 64),
    ncu: str = "ncu",
    timeout_s: int = 1800,
) -> dict:
    """Nsight Compute DRAM / L2 bytes of one fa1_forward launch per (N, M) and one
    block-sparse fa2_forward launch per density, fp16, against the model bytes.

    The FA2 mask blocks (128, 64) equal the FA2 kernel's tiles at d = 64, so the
    kernel visits exactly the tiles :func:`flashtile.iomodel.fa2_hbm` counts.
    Returns the per-launch comparison and the raw ncu text; an absent or failing
    ncu is recorded in ``"error"``.
    """
    _need_gpu("ncu_fa1_dram")
    result: dict = {"metrics": list(NCU_METRICS), "heads": heads, "head_dim": d, "dtype": "fp16"}
    exe = shutil.which(ncu)
    if exe is None:
        return {**result, "error": f"{ncu!r} not found on PATH"}
    cfgs = _ncu_configs(seqlens, srams, densities, d, heads, sparse_n, sparse_block)
    with tempfile.TemporaryDirectory() as tmp:
        script, cfg_path, log = Path(tmp) / "launch.py", Path(tmp) / "configs.pt", Path(tmp) / "ncu.csv"
        script.write_text(_NCU_SCRIPT)
        torch.save([{k: v for k, v in c.items() if k not in ("model_bytes", "paper_bytes")} for c in cfgs], cfg_path)
        try:
            proc = _run_ncu(exe, script, cfg_path, log, timeout_s, base_units=True)
            if proc.returncode != 0 and "print-units" in (proc.stderr + proc.stdout):  # older ncu
                proc = _run_ncu(exe, script, cfg_path, log, timeout_s, base_units=False)
        except (OSError, subprocess.SubprocessError) as e:
            return {**result, "error": _error(e)}
        raw = log.read_text() if log.exists() else ""
    result["raw"] = raw
    result["returncode"] = proc.returncode
    result["stderr_tail"] = proc.stderr[-4000:]
    if proc.returncode != 0:
        result["error"] = f"ncu exited with {proc.returncode} (see stderr_tail)"
    result["launches"] = _attach(cfgs, parse_ncu_csv(raw))
    return result


# --------------------------------------------------------------------------- #
# (d) roofline
# --------------------------------------------------------------------------- #
def measure_roof(copy_bytes: int = 2**30, gemm_n: int = 8192) -> dict:
    """Measured HBM bandwidth (a ``copy_bytes`` device copy: read + write) and
    bf16 GEMM rate (``gemm_n``^3 matmul, 2 n^3 FLOPs); the ridge is their ratio."""
    _need_gpu("measure_roof")
    src = torch.empty(copy_bytes // 2, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    bw = 2 * copy_bytes / (median_ms(lambda: dst.copy_(src)) * 1e-3)
    del src, dst
    a, b = (torch.randn(gemm_n, gemm_n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flops = 2 * gemm_n**3 / (median_ms(lambda: a @ b) * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return {"bandwidth_Bps": bw, "bf16_flops": flops, "ridge_flop_per_byte": flops / bw,
            "copy_bytes": copy_bytes, "gemm_n": gemm_n}


def roofline_points(results: dict) -> list[dict]:
    """(label, intensity = FLOPs / model bytes, achieved TFLOP/s) for every timed kernel."""
    pts = []
    for row in (results.get("fa1_vs_fa2") or {}).get("rows", []):
        for name, tf in row["tflops"].items():
            if tf:
                pts.append({"label": f"{name} N={row['seqlen']}", "kind": name,
                            "intensity": row["flops"] / row["model_bytes"][name], "tflops": tf})
    for row in (results.get("softmax") or {}).get("rows", []):
        elems = row["n"] * row["rows"]
        for name, flops_per in SOFTMAX_FLOPS_PER_ELEM.items():
            ms = row["ms"].get(name)
            if ms:
                pts.append({"label": f"softmax-{name} n={row['n']}", "kind": f"softmax-{name}",
                            "intensity": flops_per / (2 * SOFTMAX_ACCESSES_PER_ELEM[name]),
                            "tflops": flops_per * elems / (ms * 1e-3) / 1e12})
    return pts


def roofline_plot(results: dict, path: str | os.PathLike) -> dict:
    """Draw the roofline ``min(peak, bandwidth x I)`` from ``results["roof"]`` (measured
    now if absent) with :func:`roofline_points`; writes a PNG to ``path``, returns the roof and points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roof = results.get("roof") or measure_roof()
    pts = roofline_points(results)
    bw, peak = roof["bandwidth_Bps"], roof["bf16_flops"]
    ridge = peak / bw
    lo = min([0.5] + [p["intensity"] / 2 for p in pts])
    hi = max([ridge * 8] + [p["intensity"] * 2 for p in pts])
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ax.plot(xs, [min(peak, bw * x) / 1e12 for x in xs], color="black", linewidth=2, label="roof (measured)")
    ax.axvline(ridge, color="gray", linestyle=":", label=f"ridge {ridge:.0f} FLOP/B")
    markers = {"fa1": "o", "fa2": "s", "sdpa-flash": "^", "softmax-online": "D", "softmax-safe": "v"}
    for kind in sorted({p["kind"] for p in pts}):
        sel = [p for p in pts if p["kind"] == kind]
        ax.scatter([p["intensity"] for p in sel], [p["tflops"] for p in sel], marker=markers.get(kind, "x"), label=kind)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / model byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"IO lab roofline: {bw / 1e12:.2f} TB/s copy, {peak / 1e12:.0f} TFLOP/s bf16 GEMM")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"roof": roof, "points": pts, "path": str(path)}


# --------------------------------------------------------------------------- #
# everything
# --------------------------------------------------------------------------- #
def _section(fn, *args, **kwargs) -> dict:
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # one failed experiment must not lose the others
        return {"error": _error(e)}


def run_io_lab(out_dir: str | os.PathLike, *, ncu: str = "ncu") -> dict:
    """Run (a)-(d); write ``io_lab_<device>.json`` and ``.png`` to ``out_dir``; return the payload."""
    _need_gpu("the IO lab")
    payload: dict = {"env": environment()}
    payload["roof"] = _section(measure_roof)
    payload["fa1_vs_fa2"] = _section(fa1_vs_fa2)
    payload["softmax"] = _section(softmax_bandwidth)
    payload["ncu"] = _section(ncu_fa1_dram, ncu=ncu)
    json_path = write_json(payload, out_dir, "io_lab")  # first write: keep the numbers even if plotting fails
    png = json_path.with_suffix(".png")
    if "error" in payload["roof"]:
        payload["roofline"] = {"error": "no measured roof: " + payload["roof"]["error"]}
    else:
        payload["roofline"] = _section(roofline_plot, payload, png)
    json_path.write_text(json.dumps(payload, indent=1, default=str))
    payload["json_path"] = str(json_path)
    return payload


if __name__ == "__main__":  # pragma: no cover - manual use: python -m flashtile.bench.io_lab OUT_DIR
    res = run_io_lab(sys.argv[1] if len(sys.argv) > 1 else "bench/results")
    print(res["json_path"], math.nan if "error" in res["roof"] else res["roof"]["ridge_flop_per_byte"])
