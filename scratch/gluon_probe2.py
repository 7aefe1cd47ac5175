"""H100 probe 2 of the Gluon FA3 forward: every candidate config checked, then TFLOP/s against the Triton
Hopper kernel (runtime.fa3_fwd), the FA2 kernel (runtime.fa2_fwd) and FA3 (fa3_fwd_interface, optional).

Run from the repository root on the GPU machine:  python3 scratch/gluon_probe2.py   (JSON: $OUT/gluon_probe2.json)

Phase 1 (<= 140 s): one child process per (d, config) and per reference kernel, 16 at a time, each with a
timeout: the Gluon children check correctness (float64 reference on row slices, NaN-poisoned outputs, LSE,
GQA, ragged, 1 query, causal both ways) and then call the timing shapes once; the reference children only
call the timing shapes.  Both fill Triton's on-disk cache, so phase 2 compiles nothing.
Phase 2: TFLOP/s (bf16, B * N = 16k tokens, H = 2048 // d) for d in (128, 64, 256, 96, 192) x N in (4k, 16k,
1k) x causal, in that order, under a watchdog; a config is timed only where all its checks passed; points
are skipped once the budget is spent.  Then the host time per call (bound launch vs kernel[grid]), and last
a table: the best Gluon config per point and its ratio to FA3.
"""
import json, os, subprocess, sys, tempfile, threading, time
from dataclasses import asdict, replace

sys.path.insert(0, os.getcwd())
import torch
import triton

from flashtile.runtime import fa3_gluon as G
from flashtile.runtime.fa3_gluon import GluonConfig, block_d, fa3_gluon_forward, gluon_config, smem_bytes

T0 = time.time()
TOTAL_BUDGET_S = 225  # the whole script (the lead's call: 4 minutes)
PHASE1_BUDGET_S = 140
OUT = os.environ.get("OUT", ".")
DT = torch.bfloat16
DEV = "cuda"
DS = (128, 64, 256, 96, 192)
NS = (4096, 16384, 1024)
JSON_PATH = os.path.join(OUT, "gluon_probe2.json")


def say(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def candidates(d):
    """name -> GluonConfig, per block_d bucket; 'default' is gluon_config's."""
    base = gluon_config(d, False)
    bd = block_d(d)
    if bd <= 64:
        c = {"default": base, "both": replace(base, intra=True, pingpong=True),
             "3wg-intra": GluonConfig(128, 3, pingpong=False, num_wg=3),
             "3wg-intra-s4": GluonConfig(128, 4, pingpong=False, num_wg=3),
             "3wg-both": GluonConfig(128, 3, num_wg=3),
             "coalesced": replace(base, o_coalesced=True), "lpt16": replace(base, lpt_group=16)}
    elif bd == 128:
        c = {"default": base, "neither": replace(base, intra=False, pingpong=False),
             "lpt8": replace(base, lpt_group=8), "tma-store": replace(base, o_tma=True),
             "coalesced-s2": replace(base, num_stages=2, o_coalesced=True), "2-stage": replace(base, num_stages=2),
             "mask-tile-0": replace(base, skip_mask0=False)}
    else:
        c = {"default": base, "bn32-s4": replace(base, block_n=32, num_stages=4),
             "neither": replace(base, intra=False, pingpong=False), "lpt8": replace(base, lpt_group=8),
             "tma-store": replace(base, o_tma=True), "coalesced": replace(base, o_coalesced=True)}
    return {k: v for k, v in c.items() if smem_bytes(v, d) <= G.SMEM_LIMIT}


def shape(n, d):
    return 16384 // n, max(1, 2048 // d)  # (B, H)


def make(b, hq, hk, nq, nk, d, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, device=DEV, dtype=DT, generator=g)
                 for h, n in ((hq, nq), (hk, nk), (hk, nk)))


def ref_rows(q, k, v, b, h, rows, causal, scale):
    """float64 attention of query rows ``rows`` of (b, h): (out, lse); LSE -inf and out 0 on empty rows."""
    nq, nk = q.shape[2], k.shape[2]
    hk = h // (q.shape[1] // k.shape[1])
    s = scale * q[b, h, rows].double() @ k[b, hk].double().T
    if causal:
        j = torch.arange(nk, device=q.device)
        s = s.masked_fill(j[None, :] > (rows[:, None] + nk - nq), float("-inf"))
    lse = torch.logsumexp(s, dim=1)
    p = torch.where(torch.isinf(lse)[:, None], 0.0, torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[:, None]))
    return p @ v[b, hk].double(), lse


CASES = [("1q x 4k", 2, 4, 4, 1, 4096), ("ragged 333x517 gqa", 2, 4, 2, 333, 517),
         ("ragged 517x333 gqa", 2, 4, 2, 517, 333), ("4k", 1, 2, 2, 4096, 4096), ("16k", 1, 1, 1, 16384, 16384)]


def check(cfg, d, causal, name, b, hq, hk, nq, nk):
    q, k, v = make(b, hq, hk, nq, nk, d, seed=nq + d)
    scale = d ** -0.5
    out = torch.full_like(q, float("nan"))
    o, lse = fa3_gluon_forward(q, k, v, softmax_scale=scale, causal=causal, out=out, config=cfg)
    torch.cuda.synchronize()
    nan_o, nan_l = int(torch.isnan(o).sum()), int(torch.isnan(lse).sum())
    rows = torch.tensor(sorted({*range(min(nq, 200)), *range(max(0, nq - 200), nq),
                                *range(max(0, nq // 2 - 5), min(nq, nq // 2 + 5))}), device=DEV)
    err_o = err_l = 0.0
    for bb, hh in ((0, 0), (b - 1, hq - 1)):
        ro, rl = ref_rows(q, k, v, bb, hh, rows, causal, scale)
        err_o = max(err_o, float((o[bb, hh, rows].double() - ro).abs().nan_to_num(nan=1e9).max()))
        gl_ = lse[bb, hh, rows].double()
        dl = torch.where(torch.isinf(rl) & (gl_ == rl), 0.0, (gl_ - rl).abs()).nan_to_num(nan=1e9, posinf=1e9)
        err_l = max(err_l, float(dl.max()))
    ok = nan_o == 0 and nan_l == 0 and err_o < 2e-2 and err_l < 1e-2
    return dict(case=name, d=d, causal=causal, ok=ok, err_o=err_o, err_lse=err_l, nan=[nan_o, nan_l])


def child_gluon(d, cname):
    cfg = candidates(d)[cname]
    for causal in (False, True):
        for case in CASES:
            try:
                rec = check(cfg, d, causal, *case)
            except Exception as e:
                rec = dict(case=case[0], d=d, causal=causal, ok=False, error=f"{type(e).__name__}: {str(e)[-600:]}")
            print("REC " + json.dumps(dict(rec, config=cname)), flush=True)
            if "error" in rec and ("Compil" in rec["error"] or "OutOfResources" in rec["error"]):
                break
    for n in NS:  # warm Triton's cache with the timing shapes' specialisation
        b, h = shape(n, d)
        q, k, v = make(b, h, h, n, n, d)
        for causal in (False, True):
            fa3_gluon_forward(q, k, v, softmax_scale=d ** -0.5, causal=causal, config=cfg)
    torch.cuda.synchronize()


def ref_fns(q, k, v, d, causal):
    from flashtile.runtime.fa2_fwd import fa2_forward
    from flashtile.runtime.fa3_fwd import fa3_forward
    scale = d ** -0.5
    return {"triton-fa3": lambda: fa3_forward(q, k, v, softmax_scale=scale, causal=causal),
            "fa2": lambda: fa2_forward(q, k, v, softmax_scale=scale, causal=causal)}


def child_ref(d):
    for n in NS:
        b, h = shape(n, d)
        q, k, v = make(b, h, h, n, n, d)
        for causal in (False, True):
            for name, fn in ref_fns(q, k, v, d, causal).items():
                try:
                    fn()
                except Exception as e:
                    print("ERR " + json.dumps(f"warm {name} d={d} n={n} causal={causal}: {type(e).__name__}: {e}"[:600]),
                          flush=True)
    torch.cuda.synchronize()


if len(sys.argv) > 1 and sys.argv[1] == "--child":
    if sys.argv[2] == "ref":
        child_ref(int(sys.argv[3]))
    else:
        child_gluon(int(sys.argv[2]), sys.argv[3])
    sys.exit(0)

results = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
           "configs": {d: {n: asdict(c) for n, c in candidates(d).items()} for d in DS},
           "correct": [], "perf": [], "host_us": {}, "best": [], "errors": []}


def dump():
    json.dump(results, open(JSON_PATH, "w"), indent=1)


# ---------------------------------------------------------------- phase 1: children, 14 at a time
jobs = [("ref", str(d)) for d in DS] + [(str(d), c) for d in DS for c in candidates(d)]
pending, running, failed = list(jobs), {}, set()
CHILD_TIMEOUT_S = 100
while pending or running:
    while pending and len(running) < 16 and time.time() - T0 < PHASE1_BUDGET_S - 30:
        j = pending.pop(0)
        log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty child never blocks on a full pipe
        running[j] = (subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", *j],
                                       stdout=log, stderr=subprocess.STDOUT, text=True), time.time(), log)
    if pending and time.time() - T0 >= PHASE1_BUDGET_S - 30:
        for j in pending:
            results["errors"].append(f"phase 1 budget: {j} not run")
            failed.add(j)
        pending = []
    time.sleep(0.5)
    for j, (p, t, log) in list(running.items()):
        late = time.time() - t > CHILD_TIMEOUT_S or time.time() - T0 > PHASE1_BUDGET_S
        if p.poll() is None and not late:
            continue
        if p.poll() is None:
            p.kill()
            failed.add(j)
            results["errors"].append(f"child {j}: killed after {time.time() - t:.0f} s (deadlock or slow compile)")
        p.wait()
        log.seek(0)
        out = log.read()
        log.close()
        del running[j]
        for line in out.splitlines():
            if line.startswith("REC "):
                rec = json.loads(line[4:])
                results["correct"].append(rec)
                if not rec["ok"]:
                    failed.add(j)
                    say("BAD", j, rec)
            elif line.startswith("ERR "):
                results["errors"].append(json.loads(line[4:]))
        if p.returncode not in (0, None) and j not in failed:
            failed.add(j)
            results["errors"].append(f"child {j}: exit {p.returncode}: {out[-600:]}")
        n_ok = sum(r["ok"] for r in results["correct"] if str(r["d"]) == j[0] and r["config"] == j[1])
        say("done", j, "failed" if j in failed else "ok", f"checks ok: {n_ok}" if j[0] != "ref" else "")
dump()
bad = [r for r in results["correct"] if not r["ok"]]
say(f"correctness: {len(results['correct']) - len(bad)}/{len(results['correct'])} checks ok")

# ---------------------------------------------------------------- phase 2: timing under a watchdog
CURRENT = {"what": "start", "since": time.time()}


def watchdog():
    while True:
        time.sleep(2)
        if time.time() - CURRENT["since"] > 45:
            results["errors"].append(f"timing hung at {CURRENT['what']}; probe stopped")
            dump()
            print("HUNG in timing at", CURRENT["what"], flush=True)
            os._exit(2)


threading.Thread(target=watchdog, daemon=True).start()
try:
    import fa3_fwd_interface as fa3
except Exception as e:
    fa3 = None
    results["errors"].append(f"fa3 import: {e!r}")


def tflops(ms, b, h, n, d, causal):
    return 4 * b * h * n * n * d / (2 if causal else 1) / (ms * 1e-3) / 1e12


for n in NS:
    for d in DS:
        for causal in (False, True):
            if time.time() - T0 > TOTAL_BUDGET_S - 25:
                results["errors"].append(f"time budget: skipped n={n} d={d} causal={causal}")
                continue
            b, h = shape(n, d)
            q, k, v = make(b, h, h, n, n, d)
            scale = d ** -0.5
            row = dict(n=n, d=d, causal=causal, B=b, H=h)
            fns = {}
            for name, cfg in candidates(d).items():
                if (str(d), name) not in failed:
                    fns[name] = lambda cfg=cfg: fa3_gluon_forward(q, k, v, softmax_scale=scale, causal=causal, config=cfg)
            if ("ref", str(d)) not in failed:
                fns.update(ref_fns(q, k, v, d, causal))
            if fa3 is not None:
                qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                fns["FA3"] = lambda: fa3.flash_attn_func(qt, kt, vt, causal=causal)
            for name, fn in fns.items():
                CURRENT.update(what=f"{name} n={n} d={d} causal={causal}", since=time.time())
                try:
                    row[name] = round(tflops(triton.testing.do_bench(fn, warmup=5, rep=25), b, h, n, d, causal), 1)
                except Exception as e:
                    row[name] = None
                    results["errors"].append(f"perf {name} n={n} d={d} causal={causal}: {type(e).__name__}: {str(e)[-300:]}")
            CURRENT.update(what="between rows", since=time.time())
            results["perf"].append(row)
            say("PERF", row)
            dump()

# host time per call: a tiny problem, many calls, one sync (GPU time << host time)
if time.time() - T0 < TOTAL_BUDGET_S - 10:
    from flashtile.runtime.fa3_fwd import fa3_forward
    q, k, v = make(1, 1, 1, 128, 128, 128)
    for name, fn in {"gluon-bound": lambda: fa3_gluon_forward(q, k, v, softmax_scale=0.1),
                     "triton-fa3": lambda: fa3_forward(q, k, v, softmax_scale=0.1)}.items():
        for bind in ((True, False) if name.startswith("gluon") else (True,)):
            G.BIND_LAUNCH = bind
            key = name if bind else "gluon-kernel[grid]"
            CURRENT.update(what=f"host {key}", since=time.time())
            try:
                fn(); torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(300):
                    fn()
                torch.cuda.synchronize()
                results["host_us"][key] = round((time.perf_counter() - t) / 300 * 1e6, 1)
            except Exception as e:
                results["errors"].append(f"host {key}: {type(e).__name__}: {str(e)[-300:]}")
    G.BIND_LAUNCH = True
    say("host µs per call", results["host_us"])

# ---------------------------------------------------------------- summary
print("\nbest Gluon config per point (TFLOP/s), vs FA3, triton-fa3, fa2")
print(f"{'n':>6} {'d':>4} {'c':>2} {'best':>14} {'tflops':>7} {'FA3':>6} {'xFA3':>5} {'triton':>7} {'fa2':>6}  default xFA3")
refs = {"n", "d", "causal", "B", "H", "triton-fa3", "fa2", "FA3"}
for r in results["perf"]:
    gl_ = {k: v for k, v in r.items() if k not in refs and v is not None}
    if not gl_:
        continue
    best = max(gl_, key=gl_.get)
    fa3v = r.get("FA3")
    ratio = round(gl_[best] / fa3v, 3) if fa3v else None
    dflt = round(gl_["default"] / fa3v, 3) if fa3v and "default" in gl_ else None
    results["best"].append(dict(n=r["n"], d=r["d"], causal=r["causal"], best=best, tflops=gl_[best], FA3=fa3v,
                                ratio_fa3=ratio, default_ratio_fa3=dflt, triton=r.get("triton-fa3"), fa2=r.get("fa2")))
    print(f"{r['n']:>6} {r['d']:>4} {int(r['causal']):>2} {best:>14} {gl_[best]:>7} {fa3v or '-':>6} "
          f"{ratio or '-':>5} {r.get('triton-fa3') or '-':>7} {r.get('fa2') or '-':>6}  {dflt or '-'}")
for e in results["errors"][:25]:
    print("ERR", str(e)[:300])
say("end")
dump()
