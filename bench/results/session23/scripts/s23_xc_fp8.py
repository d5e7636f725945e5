"""Cross-compile FP8-row tile configs (sm_90, sm_120): registers, spills, shared memory."""
import sys, torch
sys.path.insert(0, "bench")
import bench_sparse_mla as b
from dsv4_compile.kernels import sparse_mla as sm
case = b.Case("csa-fp8", 2, 1, 64, "csa", "fp8", 512)
args = b.make_inputs(case, torch.device("cpu"))
for h, n, w, st, asm, halves in [(16, 32, 8, 1, False, True), (16, 32, 8, 2, True, True), (16, 32, 4, 2, True, True),
                                 (16, 64, 8, 1, False, True), (16, 64, 8, 2, True, True), (16, 64, 4, 2, True, True),
                                 (16, 32, 8, 3, True, True), (16, 16, 8, 3, True, True), (16, 32, 8, 2, True, False),
                                 (16, 64, 8, 2, True, False), (32, 32, 8, 2, True, True), (16, 64, 8, 3, True, True)]:
    cfg = sm.LaunchConfig(h, 0, n, 1, w, st, asm, halves)
    launch = sm.plan_sparse_mla(*args, out=torch.empty_like(args[0]), config=cfg)[0]
    row = []
    for arch in (90, 120):
        s = b.compiled_stats(launch, arch)
        row.append(f"sm{arch}: shared {s['shared']:6d} regs {s['regs']:3d} spill {s['spill_stores']}/{s['spill_loads']}")
    print((h, n, w, st, asm, halves), " | ".join(row), flush=True)
