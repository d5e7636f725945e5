"""Cross-compile the sparse-MLA tiles under register caps (sm_90, sm_120): registers, spills, shared."""
import sys, torch
sys.path.insert(0, "bench")
import bench_sparse_mla as b
from dsv4_compile.kernels import sparse_mla as sm
case = b.Case("csa-bf16", 2, 1, 64, "csa", "bf16", 512)
args = b.make_inputs(case, torch.device("cpu"))
for h, n, w, st, cap in [(16, 32, 4, 2, 0), (16, 32, 4, 2, 168), (16, 32, 4, 2, 128), (16, 64, 4, 2, 168), (16, 64, 4, 2, 128),
                         (16, 32, 4, 3, 168), (16, 32, 4, 3, 128), (16, 16, 4, 3, 128), (16, 32, 8, 2, 128), (32, 32, 8, 2, 128)]:
    cfg = sm.LaunchConfig(h, 0, n, 1, w, st, True, True)
    launch = sm.plan_sparse_mla(*args, out=torch.empty_like(args[0]), config=cfg)[0]
    if cap:
        launch.meta["maxnreg"] = cap
    row = []
    for arch in (90, 120):
        s = b.compiled_stats(launch, arch)
        row.append(f"sm{arch}: shared {s['shared']:6d} regs {s['regs']:3d} spill {s['spill_stores']}/{s['spill_loads']}")
    print((h, n, w, st, cap), " | ".join(row), flush=True)
