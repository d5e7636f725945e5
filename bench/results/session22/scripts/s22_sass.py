"""Session 22: cross-compile the mma kernels of each class with l2_ahead 0 / 4 for sm_90 and sm_120; registers,
spills, instructions, prefetches in the PTX. Usage: s22_sass.py mxfp4|nvfp4"""
import sys, types, dataclasses, subprocess, tempfile, os
import torch, triton, triton.language as tl
sys.path[:0] = ["bench"]
from bench_sparse_mla import cross_compile, compiled_stats
from dsv4_compile.kernels import fp4_moe as moe
from dsv4_compile.fp4_tiles import tile_fp4
FMT = sys.argv[1] if len(sys.argv) > 1 else "mxfp4"
GLOB = None if FMT == 'mxfp4' else torch.ones(2)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

def launches_of(config):
    launches = []
    def recorder(kernel):
        class Record:
            def __getitem__(self, grid):
                return lambda *args, **meta: launches.append(types.SimpleNamespace(kernel=kernel, args=args, meta=meta))
        return Record()
    saved = {n: getattr(moe, n) for n in ("_gate_up_mma_kernel", "_down_mma_kernel", "expert_blocks")}
    for n in ("_gate_up_mma_kernel", "_down_mma_kernel"):
        setattr(moe, n, recorder(saved[n]))
    moe.expert_blocks = lambda ids, experts, block_m: tuple(torch.zeros(n, dtype=torch.int32) for n in (12, 4, 4, 4))
    w13 = tile_fp4(torch.zeros(2, 256, 64, dtype=torch.uint8)); w2 = tile_fp4(torch.zeros(2, 128, 64, dtype=torch.uint8))
    dt = torch.uint8 if FMT == "mxfp4" else torch.float8_e4m3fn
    g = 4 if FMT == "mxfp4" else 8
    s13, s2 = torch.zeros(2, 256, g, dtype=dt), torch.zeros(2, 128, g, dtype=dt)
    try:
        moe.fp4_moe_pairs_triton(torch.zeros(2, 128, dtype=torch.bfloat16), torch.zeros(2, 6, dtype=torch.int32),
                                 torch.ones(2, 6), w13, s13, w2, s2, FMT, GLOB, GLOB, None, config=config)
    finally:
        for n, v in saved.items():
            setattr(moe, n, v)
    return launches

if __name__ == "__main__":
    for cname in ("mma_token", "mma_few", "mma"):
      for ahead in (0, 4):
          config = dataclasses.replace(moe.DEFAULT_CONFIGS[cname], l2_ahead=ahead)
          for launch in launches_of(config):
              launch.meta.update(DOT_DTYPE=tl.bfloat16, COMPILED=True, SCALE_ASM=config.scale_asm, K=4096, I=2048)
              caps = moe.register_caps(config, False)
              launch.meta.update(caps[0] if launch.kernel.fn.__name__ == "_gate_up_mma_kernel" else caps[1])
              for cap in (90, 120):
                  st = compiled_stats(launch, cap)
                  compiled = cross_compile(launch, cap)
                  ptx = compiled.asm["ptx"]
                  print(cname, ahead, launch.kernel.fn.__name__, cap, st, "prefetch", ptx.count("prefetch.global.L2"), flush=True)
