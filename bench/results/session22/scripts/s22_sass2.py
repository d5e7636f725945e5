"""Session 22: registers / spills of candidate M=256 configs at real shapes (cross-compiled, sm_90 and sm_120)."""
import sys, types, dataclasses
import torch, triton.language as tl
sys.path[:0] = ["bench", "tmp_gpu"]
from bench_sparse_mla import compiled_stats
from dsv4_compile.kernels import fp4_moe as moe
from s22_sass import launches_of
import s22_sass
R = dataclasses.replace
base = moe.DEFAULT_CONFIGS["mma"]
cands = {
  "default 8x32x128 caps160/112": base,
  "8x64x64 caps160/112": R(base, block_n=64, block_k=64),
  "8x64x64 nocaps": R(base, block_n=64, block_k=64, max_regs=0, down_max_regs=0),
  "8x64x64 caps192/128": R(base, block_n=64, block_k=64, max_regs=192, down_max_regs=128),
  "8x32x64 caps160/112": R(base, block_k=64),
  "8x32x128 down128": R(base, down_max_regs=128),
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
