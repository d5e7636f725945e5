"""Session 24: FP4 MoE launch-config variants timed against each size's default."""
import dataclasses
from dsv4_compile.kernels import fp4_moe as moe

R = dataclasses.replace
SMALL = moe.DEFAULT_CONFIGS["mma_small"]
DOWN128 = dict(down_block_n=128, down_num_warps=4, down_max_regs=0)
VARIANTS = {
    m: {"down 128x4w": lambda c: R(c, **DOWN128), "mma_small": lambda c: SMALL}
    for m in (96, 128, 256, 512, 682)
}
