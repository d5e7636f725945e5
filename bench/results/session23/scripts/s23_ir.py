import sys, torch
sys.path.insert(0, "bench")
import bench_sparse_mla as b
from dsv4_compile.kernels import sparse_mla as sm
case = b.Case("csa-bf16", 2, 1, 64, "csa", "bf16", 512)
args = b.make_inputs(case, torch.device("cpu"))
c = sm.LaunchConfig(16, 0, 64, 1, 4, 2, True, True)
launch = sm.plan_sparse_mla(*args, out=torch.empty_like(args[0]), config=c)[0]
k = b.cross_compile(launch, 90)
open("/tmp/smla.ttgir", "w").write(k.asm["ttgir"])
open("/tmp/smla.ptx", "w").write(k.asm["ptx"])
