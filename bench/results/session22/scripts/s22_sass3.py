import sys, dataclasses
import torch, triton.language as tl
sys.path[:0] = ["bench", "tmp_gpu"]
from bench_sparse_mla import compiled_stats
from dsv4_compile.kernels import fp4_moe as moe
from s22_sass import launches_of
import s22_sass
R = dataclasses.replace
base = moe.DEFAULT_CONFIGS["mma"]
cands = {
  "mma down nocap": R(base, down_max_regs=0),
  "mma 8x32x64 down nocap": R(base, block_k=64, down_max_regs=0),
  "mma 8x32x64 down 128": R(base, block_k=64, down_max_regs=128),
  "mma_small": moe.DEFAULT_CONFIGS["mma_small"],
  "mma_token": moe.DEFAULT_CONFIGS["mma_token"],
}
for fmt in ("mxfp4", "nvfp4"):
    s22_sass.FMT = fmt
    s22_sass.GLOB = None if fmt == "mxfp4" else torch.ones(2)
    for name, config in cands.items():
        for launch in launches_of(config):
            launch.meta.update(DOT_DTYPE=tl.bfloat16, COMPILED=True, SCALE_ASM=config.scale_asm, K=4096, I=2048)
            caps = moe.register_caps(config, False)
            launch.meta.update(caps[0] if launch.kernel.fn.__name__ == "_gate_up_mma_kernel" else caps[1])
            print(fmt, name, launch.kernel.fn.__name__, compiled_stats(launch, 90), flush=True)
