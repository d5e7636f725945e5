"""Session 24: registers / spills / shared memory of the candidate FP4 MoE configs at V4-Flash sizes
(cross-compiled for sm_90 and sm_120 on CPU). Usage: s24_regs.py mxfp4|nvfp4"""
import sys, dataclasses
import torch, triton.language as tl
sys.path[:0] = ["bench", "tmp_gpu"]
from bench_sparse_mla import compiled_stats
from dsv4_compile.kernels import fp4_moe as moe
import s22_sass
from s22_sass import launches_of
from s24_variants import VARIANTS

fmt = sys.argv[1]
s22_sass.FMT = fmt
s22_sass.GLOB = None if fmt == "mxfp4" else torch.ones(2)
seen = set()
for tokens, variants in VARIANTS.items():
    base = moe.choose_config(tokens * 6, 256, fmt)
    for name, change in {"default": None, **variants}.items():
        config = base if change is None else change(base)
        if config in seen:
            continue
        seen.add(config)
        for launch in launches_of(config):
            launch.meta.update(DOT_DTYPE=tl.bfloat16, COMPILED=True, SCALE_ASM=config.scale_asm, K=4096, I=2048)
            caps = moe.register_caps(config, False)
            launch.meta.update(caps[0] if launch.kernel.fn.__name__ == "_gate_up_mma_kernel" else caps[1])
            for cap in (90, 120):
                print(fmt, f"M={tokens}", name, launch.kernel.fn.__name__, f"sm_{cap}", compiled_stats(launch, cap),
                      flush=True)
