"""Offline sm_90 compile (Triton 3.6) of the FA2 forward and decode kernels as a launch specialises them,
for the tree given as argv[1]; prints PTX size and vector-load counts per case (compare old vs new tree)."""
import os, re, sys
sys.path.insert(0, "/tmp/t36"); sys.path.insert(1, sys.argv[1])
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)


def compile_call(fn, args, options, label):
    """Specialise ``args`` as JITFunction.run would (do_not_specialize honoured), compile for sm_90."""
    sig, ce, attrs = {}, {}, {}
    dns = {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
    for i, (p, a) in enumerate(zip(fn.params, args)):
        if p.is_constexpr:
            sig[p.name] = "constexpr"; ce[(i,)] = a; continue
        ty, spec = native_specialize_impl(BaseBackend, a, False, p.name not in dns, True)
        sig[p.name] = ty
        if ty == "constexpr":
            ce[(i,)] = spec if spec is not None else a
        elif isinstance(spec, str) and spec:
            attrs[(i,)] = BACKEND.parse_attr(spec)
    src = ASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs)
    c = triton.compile(src, target=TARGET, options=options)
    ptx = c.asm["ptx"]
    import os
    out = os.environ.get("PTX_DIR")
    if out:
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, re.sub(r"\W+", "_", label) + ".ptx"), "w").write(ptx)
    n_instr = sum(1 for line in ptx.splitlines() if line.strip().endswith(";") and not line.strip().startswith("."))
    v4 = len(re.findall(r"ld\.global[\w.]*\.v4", ptx))
    sizes = re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x\w+|\d+)", ptx)
    cp16 = sum(1 for x in sizes if int(x, 0) == 16)
    cpall = len(sizes)
    print(f"{label:48s} instr {n_instr:6d}  ld.v4 {v4:4d}  cp.async16 {cp16:4d}/{cpall:4d}  regs/shared {c.metadata.shared}", flush=True)


def fa2_cases():
    from flashtile.runtime import fa2_fwd as rf
    rf.interpreting = lambda *a, **k: False
    calls = []
    rf.launch = lambda kernel, grid, dynamic, static, **kw: calls.append((kernel, dynamic + static, kw))
    for b, hq, hk, nq, nk, d, causal in ((2, 32, 8, 1, 4096, 64, True), (2, 32, 8, 1, 4133, 64, True),
                                         (1, 16, 16, 2048, 2048, 128, True), (1, 16, 16, 2048, 2048, 64, False)):
        q = torch.empty(b, hq, nq, d, dtype=torch.bfloat16)
        k = torch.empty(b, hk, nk, d, dtype=torch.bfloat16)
        calls.clear()
        rf.fa2_forward(q, k, k, softmax_scale=0.125, causal=causal)
        kernel, args, kw = calls[0]
        compile_call(kernel, args, dict(num_warps=kw["num_warps"], num_stages=kw["num_stages"]),
                     f"fa2 b{b} hq{hq} hk{hk} nq{nq} nk{nk} d{d} causal={causal}")
    # packed (IS_VARLEN) and paged forwards: the same per-call slots
    cu = torch.tensor([0, 700, 1500], dtype=torch.int32)
    q = torch.empty(1500, 16, 128, dtype=torch.bfloat16)
    for paged in (False, True):
        k = torch.empty(64, 256, 4, 128, dtype=torch.bfloat16) if paged else torch.empty(1500, 4, 128, dtype=torch.bfloat16)
        bt = torch.zeros(2, 8, dtype=torch.int32) if paged else None
        calls.clear()
        rf.fa2_forward(q, k, k, softmax_scale=0.1, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=800,
                       max_seqlen_k=800, block_table=bt)
        kernel, args, kw = calls[0]
        compile_call(kernel, args, dict(num_warps=kw["num_warps"], num_stages=kw["num_stages"]),
                     f"fa2 varlen paged={paged} d128 causal")


def decode_cases():
    from flashtile.runtime import decode as rd
    rd.interpreting = lambda *a, **k: False
    for nk, splits in ((4096, 0), (4133, 0), (4096, 1)):
        q = torch.empty(2, 1, 32, 64, dtype=torch.bfloat16)
        kc = torch.empty(2, 8, nk, 64, dtype=torch.bfloat16).transpose(1, 2)  # HF DynamicCache layout
        lens = torch.empty(2, dtype=torch.int32)
        plan, launch = rd.decode_launch(q, kc, kc, None, None, left=-1, right=0, softcap=0.0, unified=False,
                                        num_splits=splits, seqlens_k=lens)
        for key, ka in launch.arguments.items():
            fn = ka.kernel
            values = dict(ka.static)
            # per-call ints of the split kernel (absent from the old tree's dynamic names)
            values.update(stride_kb=kc.stride(0), stride_kh=kc.stride(2), stride_vb=kc.stride(0),
                          stride_vh=kc.stride(2), capacity=kc.shape[1])
            dyn = {"sm_scale": 0.125, "softcap": 0.0, "phi2": 0.0, "lo2": 0.0, "hi2": 0.0}
            args = []
            for n in ka.names():
                if n in values:
                    args.append(values[n])
                elif n in dyn:
                    args.append(dyn[n])
                elif n in ("Q", "K", "V", "Out"):
                    args.append(q)
                elif n in ("FPart",):
                    args.append(torch.empty(16, dtype=torch.int8))
                elif n in ("BlockTable", "SeqlensK", "Err", "Count", "Flags", "CacheBatchIdx", "LeftPad", "CuSeqlensQ"):
                    args.append(lens)
                else:
                    args.append(torch.empty(16, dtype=torch.float32))
            compile_call(fn, args, dict(num_warps=plan.num_warps if key != "merge" else 1, num_stages=plan.num_stages),
                         f"decode nk{nk} splits={plan.n_splits} {key}")


if os.environ.get("NO_HINT"):  # the per-call strides without KV_ALIGNED: what the hint buys
    from flashtile.runtime import decode as _rd, fa2_fwd as _rf
    _rd.aligned16 = _rf.aligned16 = lambda *a: False
fa2_cases()
decode_cases()
