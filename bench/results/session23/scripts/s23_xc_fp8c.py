"""Cross-compile FP8-row tile configs of HEAD's kernel (q K^T) with register caps."""
import sys, torch
sys.path.insert(0, "bench")
import bench_sparse_mla as b
from dsv4_compile.kernels import sparse_mla as sm
case = b.Case("csa-fp8", 2, 1, 64, "csa", "fp8", 512)
args = b.make_inputs(case, torch.device("cpu"))
for h, n, w, st, asm, cap in [(16, 32, 8, 1, False, 0), (16, 32, 8, 1, False, 128), (32, 32, 8, 1, False, 0),
                              (32, 32, 8, 1, False, 168), (32, 32, 8, 1, False, 128), (32, 16, 8, 1, False, 0),
                              (16, 16, 8, 1, False, 0), (32, 32, 4, 1, False, 0), (64, 16, 8, 1, False, 0)]:
    cfg = sm.LaunchConfig(h, 0, n, 1, w, st, asm, True)
    launch = sm.plan_sparse_mla(*args, out=torch.empty_like(args[0]), config=cfg)[0]
    if cap:
        launch.meta["maxnreg"] = cap
    row = []
    for arch in (90, 120):
        s = b.compiled_stats(launch, arch)
        row.append(f"sm{arch}: shared {s['shared']:6d} regs {s['regs']:3d} spill {s['spill_stores']}/{s['spill_loads']}")
    print((h, n, w, st, asm, cap), " | ".join(row), flush=True)
