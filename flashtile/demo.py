"""`flashtile demo`: every algorithm on fresh random inputs, with its error and its IO.

Part 1 runs the float64 reference layer and prints, per algorithm, the max
relative error against a dense float64 oracle, the HBM accesses it counted
(and whether they equal the closed form of :mod:`flashtile.iomodel`), FLOPs
and extra memory.  Part 2 prints the IO model's tables (HBM vs SRAM size M,
vs N, the M = 4d² boundary, block-sparse patterns, a roofline).  Part 3 runs
the Triton kernels: compiled on a GPU, through Triton's interpreter on a CPU.
"""

from __future__ import annotations

import math
import time

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from flashtile import iomodel as io
from flashtile.reference import attention as ra
from flashtile.reference import backward as rb
from flashtile.reference import decoding as rd
from flashtile.reference import softmax as rs
from flashtile.reference.masks import BlockMask, allowed_mask


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    den = ref.norm().item()
    return (x - ref).norm().item() / den if den else (x - ref).norm().item()


def _oracle(q, k, v, *, causal=False, block_mask=None):
    """Dense float64 attention straight from the definition (masked softmax)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    ok = allowed_mask(q.shape[-2], k.shape[-2], causal=causal, block_mask=block_mask, device=q.device)
    s = s.masked_fill(~ok, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v


def _fmt(n) -> str:
    if n is None:
        return "—"
    if isinstance(n, str):
        return n
    n = float(n)
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _reference_rows(seed: int):
    """Yield (name, max rel err, counts, closed-form HBM or None, note)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731

    x = rnd(64, 1024) * 4
    ref = torch.softmax(x, dim=-1)
    for name, fn in (("softmax naive", rs.naive_softmax), ("softmax safe", rs.safe_softmax),
                     ("softmax online", rs.online_softmax)):
        r = fn(x)
        yield name, _rel(r.y, ref), r.counts, io.softmax_accesses(1024, name.split()[1], rows=64), "64 rows × 1024"
    r = rs.block_online_softmax(x, 100, order=list(reversed(range(11))))
    yield "softmax block-online", _rel(r.y, ref), r.counts, io.softmax_accesses(1024, "block_online", rows=64), "blocks of 100, reversed"

    b, h, n, d = 1, 4, 512, 64
    q, k, v = rnd(b, h, n, d), rnd(b, h, n, d), rnd(b, h, n, d)
    full, causal = _oracle(q, k, v), _oracle(q, k, v, causal=True)
    m = 8192
    r = ra.standard_attention(q, k, v)
    yield "Algorithm 0 (standard)", _rel(r.out, full), r.counts, io.standard_hbm(n, n, d, heads=h), "S, P in HBM"
    r = ra.flash_attn1(q, k, v, sram_size=m)
    br, bc = io.fa1_block_sizes(m, d)
    yield "Algorithm 1 (FA1)", _rel(r.out, full), r.counts, io.fa1_hbm(n, n, d, sram_size=m, heads=h), f"M={m}: Br={br}, Bc={bc}"
    r = ra.flash_attn2(q, k, v, block_sizes=(64, 64))
    yield "FA2", _rel(r.out, full), r.counts, io.fa2_hbm(n, n, d, block_sizes=(64, 64), heads=h), "64×64 tiles"
    r = ra.flash_attn2(q, k, v, block_sizes=(64, 64), causal=True)
    yield ("FA2 causal", _rel(r.out, causal), r.counts,
           io.fa2_hbm(n, n, d, block_sizes=(64, 64), causal=True, heads=h), f"skipped {r.counts.skipped_blocks} blocks")
    bm = BlockMask.global_local(n, n, global_blocks=1, local_blocks=1, block_size=64)
    r = ra.block_sparse_flash_attn(q, k, v, bm)
    yield ("Algorithm 5 (block-sparse)", _rel(r.out, _oracle(q, k, v, block_mask=bm)), r.counts,
           io.block_sparse_hbm(bm, d, n, n, heads=h), f"global+local, s={bm.density:.2f}")

    q1, k1, v1 = q[0, 0, :128], k[0, 0, :128], v[0, 0, :128]
    ref1 = _oracle(q1, k1, v1)
    yield "online softmax rows (scalar)", _rel(ra.attention_online_softmax_rows(q1, k1, v1).out, ref1), None, None, "1 head, N=128"
    yield "SubSum recurrence (scalar)", _rel(ra.attention_subsum(q1, k1, v1).out, ref1), None, None, "o'_j recurrence"
    yield "SubSum blocked", _rel(ra.attention_subsum_blocked(q1, k1, v1, 32).out, ref1), None, None, "tiles of 32 keys"

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = _oracle(qg, kg, vg, causal=True)
    dout = rnd(*out.shape)
    out.backward(dout)
    fwd = ra.flash_attn2(q, k, v, causal=True)
    r = rb.flash_attn_backward(q, k, v, fwd.out, dout, fwd.lse, causal=True)
    err = max(_rel(r.dq, qg.grad), _rel(r.dk, kg.grad), _rel(r.dv, vg.grad))
    yield ("Algorithm 4 (backward)", err, r.counts,
           io.backward_hbm(n, n, d, causal=True, heads=h), "causal, vs autograd")

    bq, hq, hk, length = 2, 8, 2, 4096
    qd, kc, vc = rnd(bq, hq, 1, d), rnd(bq, hk, length, d), rnd(bq, hk, length, d)
    refd = _oracle(qd, kc.repeat_interleave(hq // hk, 1), vc.repeat_interleave(hq // hk, 1))
    r = rd.flash_decoding(qd, kc, vc, num_splits=8)
    yield ("Flash-Decoding", _rel(r.out, refd), r.counts,
           io.decoding_hbm(1, length, d, 8) * bq * hq, "8 splits, GQA 8/2, L=4096")
    s = (qd @ kc.repeat_interleave(hq // hk, 1).transpose(-1, -2)) / math.sqrt(d)
    phi = rd.estimate_phi(s)
    r, info = rd.flashdecoding_pp(qd, kc, vc, phi=phi, num_splits=8)
    yield "FlashDecoding++ (unified max)", _rel(r.out, refd), r.counts, None, f"φ={phi:.2f}, {info.num_recomputed} rows recomputed"


def _reference_table(console: Console, seed: int) -> None:
    table = Table(title="Reference algorithms (float64) vs a dense float64 oracle")
    for col in ("algorithm", "max rel err", "HBM accesses", "= closed form", "FLOPs (matmul)", "non-matmul", "extra mem", "note"):
        table.add_column(col, justify="left" if col in ("algorithm", "note") else "right")
    rows = []
    with Progress(console=console, transient=True) as prog:
        task = prog.add_task("reference algorithms", total=17)
        for row in _reference_rows(seed):
            rows.append(row)
            prog.advance(task)
    for name, err, counts, closed, note in rows:
        if counts is None:
            table.add_row(name, f"{err:.1e}", "—", "—", "—", "—", "—", note)
            continue
        match = "—" if closed is None else ("✓" if counts.hbm == closed else f"✗ {closed}")
        table.add_row(name, f"{err:.1e}", _fmt(counts.hbm), match, _fmt(counts.flops), _fmt(counts.nonmatmul_flops),
                      _fmt(counts.extra_memory), note)
    console.print(table)


def _io_tables(console: Console) -> None:
    n, d = 4096, 64
    t = Table(title=f"HBM accesses vs SRAM size M (N={n}, d={d}, per head)")
    for col in ("M (elements)", "Br×Bc", "Algorithm 0", "Algorithm 1 (Thm 2)", "lower bound N²d²/M", "FA1 / bound"):
        t.add_column(col, justify="right")
    for m in (1024, 4096, 16384, 65536, 262144):
        br, bc = io.fa1_block_sizes(m, d)
        f1 = io.fa1_hbm(n, n, d, sram_size=m)
        lb = io.lower_bound_hbm(n, d, m)
        t.add_row(str(m), f"{br}×{bc}", _fmt(io.standard_hbm(n, n, d)), _fmt(f1), _fmt(lb), f"{f1 / lb:.1f}")
    console.print(t)

    m = 24576
    t = Table(title=f"HBM accesses vs N (M={m} elements ≈ 96 KiB fp32, d={d})")
    for col in ("N", "Algorithm 0", "Algorithm 1", "FA2 64×64", "Alg 0 / Alg 1"):
        t.add_column(col, justify="right")
    for nn in (512, 1024, 2048, 4096, 8192, 16384):
        a0, a1 = io.standard_hbm(nn, nn, d), io.fa1_hbm(nn, nn, d, sram_size=m)
        t.add_row(str(nn), _fmt(a0), _fmt(a1), _fmt(io.fa2_hbm(nn, nn, d, block_sizes=(64, 64))), f"{a0 / a1:.1f}×")
    console.print(t)

    t = Table(title=f"The two SRAM cases around M = 4d² = {4 * d * d} (N={n}, d={d}): both Θ(N²d²/M)")
    for col in ("M", "case", "Br", "Bc", "HBM", "HBM / (N²d²/M)"):
        t.add_column(col, justify="right")
    for m in (2048, 4096, 8192, 16384, 32768, 65536, 131072):
        br, bc = io.fa1_block_sizes(m, d)
        f1 = io.fa1_hbm(n, n, d, sram_size=m)
        t.add_row(str(m), "M ≤ 4d²" if m <= 4 * d * d else "M > 4d²", str(br), str(bc), _fmt(f1),
                  f"{f1 / io.lower_bound_hbm(n, d, m):.2f}")
    console.print(t)

    nb = 4096
    t = Table(title=f"Block-sparse FlashAttention (Algorithm 5), N={nb}, d={d}, blocks 64×64")
    for col in ("pattern", "s (kept)", "HBM", "vs dense"):
        t.add_column(col, justify="right")
    dense = io.block_sparse_hbm(BlockMask.dense(nb, nb, 64), d, nb, nb)
    pats = {
        "dense": BlockMask.dense(nb, nb, 64),
        "causal": BlockMask.causal(nb, nb, 64),
        "sliding window 512": BlockMask.sliding_window(nb, nb, (256, 256), 64),
        "global 1 + local 2": BlockMask.global_local(nb, nb, global_blocks=1, local_blocks=2, block_size=64),
        "strided 8": BlockMask.strided(nb, nb, stride=8, block_size=64),
        "causal & strided 4": BlockMask.causal(nb, nb, 64) & BlockMask.strided(nb, nb, stride=4, block_size=64, local_blocks=1),
    }
    for name, bm in pats.items():
        h = io.block_sparse_hbm(bm, d, nb, nb)
        t.add_row(name, f"{bm.density:.3f}", _fmt(h), f"{h / dense:.3f}")
    console.print(t)

    t = Table(title="Roofline model, one head, d=64, bf16 on an H100 (HBM traffic only, no L2)")
    for col in ("algorithm", "N", "FLOP/byte", "attainable TFLOP/s", "bound"):
        t.add_column(col, justify="right")
    for row in io.roofline_table("H100", ns=(1024, 4096, 16384), d=64, sram_size=24576):
        t.add_row(row.algorithm, str(row.n), f"{row.intensity:.1f}", f"{row.attainable / 1e12:.0f}", row.bound)
    console.print(t)


def _kernel_table(console: Console, seed: int) -> None:
    from flashtile import flash_attn_func

    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    b, n, h, d = (2, 2048, 16, 128) if gpu else (1, 48, 2, 32)
    g = torch.Generator(device=dev).manual_seed(seed)
    q, k, v = (torch.randn(b, n, h, d, device=dev, dtype=dtype, generator=g) for _ in range(3))
    dout = torch.randn(b, n, h, d, device=dev, dtype=dtype, generator=g)
    t = Table(title=f"Triton FA2 kernels ({'compiled on ' + torch.cuda.get_device_name() if gpu else 'Triton interpreter on the CPU'}), "
                    f"{str(dtype).replace('torch.', '')}, B={b} N={n} H={h} d={d}")
    for col in ("kernel", "causal", "rel err out", "rel err dq/dk/dv", "time"):
        t.add_column(col, justify="right")
    for causal in (False, True):
        q64, k64, v64 = (x.double().transpose(1, 2).requires_grad_() for x in (q, k, v))
        ref = _oracle(q64, k64, v64, causal=causal)
        ref.backward(dout.double().transpose(1, 2))
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        t0 = time.perf_counter()
        out = flash_attn_func(qg, kg, vg, causal=causal)
        out.backward(dout)
        if gpu:
            torch.cuda.synchronize()
        el = time.perf_counter() - t0
        e_out = _rel(out.transpose(1, 2), ref)
        e_grad = max(_rel(qg.grad.transpose(1, 2), q64.grad), _rel(kg.grad.transpose(1, 2), k64.grad),
                     _rel(vg.grad.transpose(1, 2), v64.grad))
        timing = "—"
        if gpu:
            from flashtile.bench.common import median_ms

            with torch.no_grad():
                ms = median_ms(lambda: flash_attn_func(q, k, v, causal=causal))
                sd = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal))
            timing = f"fwd {ms:.3f} ms (SDPA {sd:.3f} ms)"
        else:
            timing = f"{el:.1f} s interpreted"
        t.add_row("flash_attn_func fwd+bwd", "yes" if causal else "no", f"{e_out:.1e}", f"{e_grad:.1e}", timing)
    console.print(t)
    _teaching_kernels(console, seed)


def _teaching_kernels(console: Console, seed: int) -> None:
    """FA1 (Algorithm 1 in Triton), the two softmax kernels and split-KV decoding, vs float64."""
    from flashtile import flash_attn_with_kvcache
    from flashtile.runtime.fa1_fwd import fa1_forward
    from flashtile.runtime.softmax import softmax_online, softmax_safe

    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    dtype = torch.float16 if gpu else torch.float32
    g = torch.Generator(device=dev).manual_seed(seed + 1)
    t = Table(title="Teaching and decoding kernels vs float64 references")
    for col in ("kernel", "shape", "rel err", "time"):
        t.add_column(col, justify="right")

    def timed(fn):
        if not gpu:
            t0 = time.perf_counter()
            fn()
            return f"{time.perf_counter() - t0:.1f} s interpreted"
        from flashtile.bench.common import median_ms

        return f"{median_ms(fn):.3f} ms"

    b, h, n, d = (1, 8, 2048, 64) if gpu else (1, 2, 48, 16)
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=dtype, generator=g) for _ in range(3))
    m = 16 * 1024 if gpu else 4 * 16 * 16
    ref = _oracle(q.double(), k.double(), v.double(), causal=True)
    out = fa1_forward(q, k, v, sram_elems=m, causal=True)
    t.add_row(f"FA1 (Algorithm 1), M={m}", f"B={b} H={h} N={n} d={d}", f"{_rel(out, ref):.1e}",
              timed(lambda: fa1_forward(q, k, v, sram_elems=m, causal=True)))
    x = torch.randn(256 if gpu else 8, 8192 if gpu else 300, device=dev, dtype=dtype, generator=g) * 3
    sref = torch.softmax(x.double(), dim=-1)
    for name, fn in (("online softmax (2 reads + 1 write)", softmax_online), ("safe softmax (3 reads + 1 write)", softmax_safe)):
        t.add_row(name, "×".join(map(str, x.shape)), f"{_rel(fn(x), sref):.1e}", timed(lambda fn=fn: fn(x)))
    bq, hq, hk, cache = (4, 32, 8, 4096) if gpu else (2, 4, 2, 100)
    qd = torch.randn(bq, 1, hq, d, device=dev, dtype=dtype, generator=g)
    kc, vc = (torch.randn(bq, cache, hk, d, device=dev, dtype=dtype, generator=g) for _ in range(2))
    lens = torch.full((bq,), cache, dtype=torch.int32, device=dev)
    rd_out = rd.flash_decoding(*(x.transpose(1, 2).cpu() for x in (qd, kc, vc)), num_splits=1).out.to(dev)
    got = flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, causal=False)
    t.add_row("split-KV decoding (Flash-Decoding)", f"B={bq} Hq={hq} Hk={hk} L={cache}",
              f"{_rel(got.transpose(1, 2), rd_out):.1e}",
              timed(lambda: flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, causal=False)))
    console.print(t)


def _console() -> Console:
    """A console wide enough for the tables when output is piped (rich then assumes 80 columns)."""
    c = Console()
    return c if c.is_terminal else Console(width=140)


def run_demo(seed: int = 0, kernels: bool = True) -> int:
    console = _console()
    gpu = torch.cuda.is_available()
    console.rule("[bold]flashtile demo")
    console.print(f"torch {torch.__version__}; device: {torch.cuda.get_device_name() if gpu else 'CPU (kernels through the Triton interpreter)'}")
    _reference_table(console, seed)
    _io_tables(console)
    if kernels:
        _kernel_table(console, seed)
    return 0
