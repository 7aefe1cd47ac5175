"""Offline sm_90a compile of fa3_gluon_kernel with Triton 3.6 (no GPU): registers, spills, shared memory.

usage: python3 scratch/cc_gluon.py d,block_n,stages,causal,intra,pingpong,consumer_regs,producer_regs[,num_wg,skip_mask0,o_store,lpt_group] ..."""
import os, re, subprocess, sys, tempfile, time
sys.path.insert(0, "/tmp/t36"); sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from flashtile.kernels.fa3_gluon import fa3_gluon_kernel

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")


def build(d, bn, stages, causal, intra, pingpong, creg, preg, nwg=2, skip0=1, ostore=0, lpt=0, dt="bf16"):
    sig = {"Q": f"*{dt}", "K": f"*{dt}", "V": f"*{dt}", "Out": f"*{dt}", "LSE": "*fp32", "qk_scale": "fp32"}
    for n in ("stride_qb stride_qh stride_qm stride_kb stride_kh stride_kn stride_vb stride_vh stride_vn "
              "stride_ob stride_oh stride_om n_heads kv_group seqlen_q seqlen_k num_m_tiles").split():
        sig[n] = "i32"
    ce = dict(HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), NUM_WG=nwg, BLOCK_N=bn, NUM_STAGES=stages,
              CAUSAL=causal, INTRA=intra, PINGPONG=pingpong, CONSUMER_REGS=creg, PRODUCER_REGS=preg,
              SKIP_MASK0=bool(skip0), O_STORE=ostore, LPT_GROUP=lpt)
    for k in ce:
        sig[k] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(4)}
    src = GluonASTSource(fn=fa3_gluon_kernel, signature=sig, constexprs=ce, attrs=attrs)
    t = time.time()
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = c.asm["ptx"]
    if os.environ.get("DUMP"):
        open(os.environ["DUMP"], "w").write(ptx)
        open(os.environ["DUMP"] + ".ttgir", "w").write(c.asm["ttgir"])
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    info = r.stderr
    return dict(t=round(time.time() - t, 1), regs=re.findall(r"Used (\d+) registers", info),
                spill=re.findall(r"(\d+) bytes spill stores", info), smem=c.metadata.shared,
                scratch=getattr(c.metadata, "global_scratch_size", None), warps=c.metadata.num_warps,
                setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx))),
                wgmma=ptx.count("wgmma.mma_async"), wgmma_wait=re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx),
                tma=ptx.count("cp.async.bulk.tensor"), serialized="serialized" in info,
                warn=[l for l in info.splitlines() if "arning" in l][:3],
                err=("" if r.returncode == 0 else info[-400:]))


for a in sys.argv[1:]:
    d, bn, st, causal, intra, pp, creg, preg, *rest = (int(x) for x in a.split(","))
    try:
        print(a, build(d, bn, st, bool(causal), bool(intra), bool(pp), creg, preg, *rest), flush=True)
    except Exception as e:
        print(a, "FAIL", type(e).__name__, str(e)[-1500:].replace("\n", " | "), flush=True)
