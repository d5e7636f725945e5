import sys, torch
sys.path.insert(0, "bench"); sys.path.insert(0, "tmp_gpu")
import bench_sparse_mla as b
import smla_head
from dsv4_compile.kernels import sparse_mla as sm
case = b.Case("csa-bf16", 2, 1, 64, "csa", "bf16", 512)
args = b.make_inputs(case, torch.device("cpu"))
for mod in (smla_head, sm):
    for cfg in [(16,0,64,4,2,0,True,True),(32,0,32,4,2,0,True,True),(16,0,32,8,1,0,False,True)]:
        c = mod.LaunchConfig(cfg[0], cfg[1], cfg[2], 1, cfg[3], cfg[4], cfg[6], cfg[7])
        launch = mod.plan_sparse_mla(*args, out=torch.empty_like(args[0]), config=c)[0]
        for cap in (90, 120):
            s = b.compiled_stats(launch, cap)
            print(mod.__name__, cfg, cap, s, flush=True)
