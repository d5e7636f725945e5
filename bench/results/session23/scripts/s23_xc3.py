import sys, torch
sys.path.insert(0, "bench")
import bench_sparse_mla as b
from dsv4_compile.kernels import sparse_mla as sm
for fmt in ("fp8", "bf16"):
    case = b.Case("csa", 2, 1, 64, "csa", fmt, 512)
    args = b.make_inputs(case, torch.device("cpu"))
    for h, n, w in [(16, 32, 4), (16, 32, 8), (16, 64, 4), (16, 64, 8), (32, 32, 8), (32, 64, 8), (16, 16, 4)]:
        cfg = sm.LaunchConfig(h, 0, n, 1, w, 1, True, True, True)
        launch = sm.plan_sparse_mla(*args, out=torch.empty_like(args[0]), config=cfg)[0]
        row = []
        for cap in (90, 120):
            try:
                s = b.compiled_stats(launch, cap)
                row.append(f"sm{cap}: shared {s['shared']:6d} regs {s['regs']:3d} spill {s['spill_stores']}/{s['spill_loads']}")
            except Exception as e:
                row.append(f"sm{cap}: FAIL {str(e)[:100]}")
        print(fmt, (h, n, w), " | ".join(row), flush=True)
