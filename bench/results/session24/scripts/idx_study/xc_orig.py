import sys
sys.path.insert(0, "/work/main/tmp_gpu/idx_study")
import xc_util as X
from dsv4_compile.kernels import indexer_topk as mod
for T in (int(a) for a in (sys.argv[1:] or ["4", "1"])):
    launch = X.record(mod, T)
    print({k: v for k, v in launch.meta.items()}, launch.grid)
    X.report(f"orig_T{T}", launch, dump_dir="dumps")
