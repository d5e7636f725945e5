"""Session 21: cross-compile the mma kernels (the HEAD module on plain tiles vs this tree on swizzled tiles) for
sm_90 and count SASS instructions (cuobjdump), registers and spills (ptxas -v). Usage: s21_sass.py mxfp4|nvfp4"""
import sys, types, dataclasses, subprocess, tempfile, os, importlib.util
import torch, triton, triton.language as tl
sys.path[:0] = ["bench", "tmp_gpu"]
from bench_sparse_mla import cross_compile, compiled_stats
from dsv4_compile.kernels import fp4_moe as new
from dsv4_compile.fp4_tiles import tile_matrix, tile_fp4, TILE_COLS
import fp4_moe_head as old
FMT = sys.argv[1]
GLOB = None if FMT == 'mxfp4' else torch.ones(2)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

def launches_of(mod, tile, config):
    launches = []
    def recorder(kernel):
        class Record:
            def __getitem__(self, grid):
                return lambda *args, **meta: launches.append(types.SimpleNamespace(kernel=kernel, args=args, meta=meta))
        return Record()
    saved = {n: getattr(mod, n) for n in ("_gate_up_mma_kernel", "_down_mma_kernel", "expert_blocks")}
    for n in ("_gate_up_mma_kernel", "_down_mma_kernel"):
        setattr(mod, n, recorder(saved[n]))
    mod.expert_blocks = lambda ids, experts, block_m: tuple(torch.zeros(n, dtype=torch.int32) for n in (12, 4, 4, 4))
    w13 = tile(torch.zeros(2, 256, 64, dtype=torch.uint8)); w2 = tile(torch.zeros(2, 128, 64, dtype=torch.uint8))
    dt = torch.uint8 if FMT == "mxfp4" else torch.float8_e4m3fn
    g = 4 if FMT == "mxfp4" else 8
    s13, s2 = torch.zeros(2, 256, g, dtype=dt), torch.zeros(2, 128, g, dtype=dt)
    try:
        mod.fp4_moe_pairs_triton(torch.zeros(2, 128, dtype=torch.bfloat16), torch.zeros(2, 6, dtype=torch.int32),
                                 torch.ones(2, 6), w13, s13, w2, s2, FMT, GLOB, GLOB, None, config=config)
    finally:
        for n, v in saved.items():
            setattr(mod, n, v)
    return launches

for label, mod, tile in (("head", old, lambda t: tile_matrix(t, TILE_COLS // 2)), ("new", new, tile_fp4)):
    for cname in ("mma", "mma_small", "mma_small+asm"):
        config = mod.DEFAULT_CONFIGS[cname.split("+")[0]]
        if cname.endswith("+asm"):
            config = dataclasses.replace(config, scale_asm=True)
        for launch in launches_of(mod, tile, config):
            launch.meta.update(DOT_DTYPE=tl.bfloat16, COMPILED=True, SCALE_ASM=config.scale_asm)
            caps = mod.register_caps(config, False)
            launch.meta.update(caps[0] if launch.kernel.fn.__name__ == "_gate_up_mma_kernel" else caps[1])
            st = compiled_stats(launch, 90)
            compiled = cross_compile(launch, 90)
            with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
                f.write(compiled.asm["cubin"])
            sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
            ins = [l for l in sass.splitlines() if l.strip().startswith("/*") and ";" in l]
            ops = {}
            for l in ins:
                op = l.split("*/", 1)[1].strip().split()[0].split(".")[0]
                if op.startswith("@"):
                    op = l.split("*/", 1)[1].strip().split()[1].split(".")[0]
                ops[op] = ops.get(op, 0) + 1
            top = sorted(ops.items(), key=lambda kv: -kv[1])[:12]
            print(label, cname, launch.kernel.fn.__name__, "instr", len(ins), FMT, st,
                  "shf.r.wrap" in compiled.asm["ptx"], top)
