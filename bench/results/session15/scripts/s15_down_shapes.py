"""Session 15: the down kernel's shape at M=64 (MXFP4, E=256, k=6; the B=64 decode step), paired kernel timings."""
import os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from bench import bench_fp4_moe as b
from bench.bench_fp4_moe import _mma

CANDS = [_mma(8, 16, 128, 1, 1, True),   # the mma_one default
         _mma(8, 16, 128, 1, 1, True, down=(128, 4)),
         ]
cfg = dict(E=256, K=4096, I=2048, k=6, Ms=(2, 4, 16), compile_bytes=8 << 30, candidates={m: CANDS for m in (2, 4, 16)})
meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), torch=torch.__version__, triton="3.6.0", device=torch.cuda.get_device_name(),
            command="tmp_gpu/s15_down_shapes.py (fifth set: mma_one)")
b.run_sweep(cfg, "cuda", 300, ["mxfp4", "nvfp4"], sys.argv[1], meta)
