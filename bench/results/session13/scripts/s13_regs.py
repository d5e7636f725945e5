"""Cross-compile (sm_90, CPU) the MoE mma kernels with register caps: registers, spills, loop SASS size."""
import os, re, sys, types, collections, subprocess
import torch, triton, triton.language as tl
sys.path.insert(0, "bench")
from dsv4_compile.kernels import fp4_moe as moe
import bench_sparse_mla as bsm
import bench_fp4_moe as bfm

def record(cfg, fmt, M=64):
    launches = []
    saved = {}
    for name in ("_gate_up_mma_kernel", "_down_mma_kernel"):
        kern = getattr(moe, name); saved[name] = kern
        class Rec:
            def __getitem__(self, grid, kern=kern):
                return lambda *a, **m: launches.append(types.SimpleNamespace(kernel=kern, args=a, meta=m, grid=grid))
        setattr(moe, name, Rec())
    z = lambda n: torch.zeros(n, dtype=torch.int32)
    eb = moe.expert_blocks
    moe.expert_blocks = lambda ids, e, bm: (z(48), z(16), z(16), z(16))
    gen = torch.Generator().manual_seed(0)
    w = bfm.tiled_experts(bfm.random_experts(fmt, 8, 4096, 2048, "cpu", gen))
    x = torch.randn(8, 4096).to(torch.bfloat16)
    ids = torch.randint(0, 8, (8, 6), dtype=torch.int32)
    try:
        moe.fp4_moe_pairs_triton(*bfm.op_args(x, ids, torch.rand(8, 6), w), config=cfg)
    finally:
        for k, v in saved.items(): setattr(moe, k, v)
        moe.expert_blocks = eb
    for launch in launches:
        launch.meta.update(DOT_DTYPE=tl.bfloat16, COMPILED=True, SCALE_ASM=cfg.scale_asm)
        if launch.kernel.fn.__name__ == "_down_mma_kernel":
            launch.args = (torch.zeros(4, 8, dtype=torch.int32),) + tuple(launch.args[1:])
            launch.meta.update(PACKED=True)
    return launches

def stats(launch, maxnreg):
    meta = dict(launch.meta)
    if maxnreg:
        # cross_compile pops num_warps/num_stages; pass maxnreg through options
        pass
    orig = bsm.triton.compile
    def comp(src, target=None, options=None):
        options = dict(options or {})
        if maxnreg: options["maxnreg"] = maxnreg
        return orig(src, target=target, options=options)
    bsm.triton.compile = comp
    try:
        c = bsm.cross_compile(launch, 90)
    finally:
        bsm.triton.compile = orig
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    open("/tmp/k.ptx", "w").write(c.asm["ptx"])
    log = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", "/tmp/k.ptx", "-o", "/tmp/k.o"], capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log); sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return int(regs.group(1)), sp.group(0) if sp else "?", len(re.findall(r"maxnreg", c.asm["ptx"]))

for fmt in ("mxfp4",):
    for cname in ("mma",):
        for launch in record(moe.DEFAULT_CONFIGS[cname], fmt):
            for cap in (None, 168, 128, 112, 96, 80):
                print(fmt, cname, launch.kernel.fn.__name__, "maxnreg", cap, stats(launch, cap), flush=True)
