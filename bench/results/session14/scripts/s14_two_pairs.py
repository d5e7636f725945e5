"""Session 14: tile shapes for ~2 pairs an expert (M=48/64/80 at k=6, E=256), paired kernel timings."""
import os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from bench import bench_fp4_moe as b
from bench.bench_fp4_moe import _mma

CANDS = [_mma(8, 32, 128, 1, 1, True, asm=True, caps=(160, 112)),
         _mma(8, 16, 128, 1, 1, True, down=(32, 1), asm=True, caps=(0, 112)),
         _mma(8, 16, 128, 1, 1, True, down=(32, 1), caps=(0, 112)),
         _mma(8, 16, 128, 1, 1, True, down=(64, 2), asm=True),
         _mma(8, 16, 128, 1, 1, True, down=(64, 2)),
         _mma(8, 16, 128, 1, 1, True, down=(32, 1), asm=True, caps=(0, 0))]
cfg = dict(E=256, K=4096, I=2048, k=6, Ms=(48, 64, 80), compile_bytes=8 << 30, candidates={m: CANDS for m in (48, 64, 80)})
meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), torch=torch.__version__, triton="3.6.0", device=torch.cuda.get_device_name(),
            command="tmp_gpu/s14_two_pairs.py")
b.run_sweep(cfg, "cuda", 300, ["mxfp4", "nvfp4"], sys.argv[1], meta)
