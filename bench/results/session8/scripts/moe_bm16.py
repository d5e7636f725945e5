"""MoE sweep rows with 16-pair blocks beside the default, tiled experts."""
import sys, os, time, torch, triton
sys.path.insert(0, "bench")
import bench_fp4_moe as b
out = sys.argv[1]; os.makedirs(out, exist_ok=True)
cand = {64: [b._mma(8, 32, 128, 1, 1, True), b._mma(16, 32, 128, 1, 1, True), b._mma(16, 16, 128, 1, 1, True)],
        256: [b._mma(8, 32, 128, 1, 1, True), b._mma(16, 32, 128, 1, 1, True), b._mma(16, 16, 128, 1, 1, True),
              b._mma(16, 32, 64, 1, 1, True)]}
cfg = dict(E=256, K=4096, I=2048, k=6, Ms=(64, 256), compile_bytes=8 << 30, candidates=cand)
meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), torch=torch.__version__, triton=triton.__version__,
            device=torch.cuda.get_device_name(), command="tmp_gpu/moe_bm16.py")
b.run_sweep(cfg, "cuda", b.make_timer(False), ["mxfp4", "nvfp4"], out, meta)
