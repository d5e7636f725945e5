"""Cross-compile sparse-MLA variants (sm_90, sm_120): shared, regs, spills. CPU only."""
import sys, torch
sys.path.insert(0, "bench")
import bench_sparse_mla as b
from dsv4_compile.kernels import sparse_mla as sm
case = b.Case("csa-bf16", 2, 1, 64, "csa", "bf16", 512)
args = b.make_inputs(case, torch.device("cpu"))
CFGS = [(16,64,4,2,False),(16,64,4,2,True),(16,32,4,2,True),(16,32,4,3,True),(32,64,4,2,True),(32,64,8,2,True),
        (32,32,8,2,True),(32,32,8,3,True),(32,64,8,2,False),(64,32,8,2,True),(64,64,8,2,True),(64,32,16,2,True),(32,32,4,2,False)]
for h, n, w, st, qil in CFGS:
    cfg = sm.LaunchConfig(h, 0, n, 1, w, st, True, True, qil)
    launch = sm.plan_sparse_mla(*args, out=torch.empty_like(args[0]), config=cfg)[0]
    row = []
    for cap in (90, 120):
        try:
            s = b.compiled_stats(launch, cap)
            row.append(f"sm{cap}: shared {s['shared']:6d} regs {s['regs']:3d} spill {s['spill_stores']}/{s['spill_loads']}")
        except Exception as e:
            row.append(f"sm{cap}: FAIL {str(e)[:80]}")
    print((h, n, w, st, qil), " | ".join(row), flush=True)
