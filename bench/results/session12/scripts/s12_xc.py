"""Cross-compile (sm_90, CPU) the mma kernels with row-major vs tiled scale addresses: registers,
spills, shared memory and TTGIR convert_layout / local_alloc counts."""
import importlib.util, re, sys, types
import torch, triton.language as tl
sys.path.insert(0, "bench")
from dsv4_compile.kernels import fp4_moe as moe
from bench_sparse_mla import compiled_stats, cross_compile
import bench_fp4_moe as bfm
spec = importlib.util.spec_from_file_location("s12", "tmp_gpu/s12_scales.py")
s12 = importlib.util.module_from_spec(spec); spec.loader.exec_module(s12)
ts = s12.load_patched()
asm = s12.load_patched(tiled=False)


def record(mod, cfg, fmt):
    launches = []
    for name in ("_gate_up_mma_kernel", "_down_mma_kernel"):
        if not hasattr(mod, "_orig" + name):
            setattr(mod, "_orig" + name, getattr(mod, name))
    for name in ("_gate_up_mma_kernel", "_down_mma_kernel"):
        kern = getattr(mod, '_orig' + name)
        class Rec:
            def __getitem__(self, grid, kern=kern):
                def call(*args, **meta):
                    launches.append(types.SimpleNamespace(kernel=kern, args=args, meta=meta, grid=grid))
                return call
        setattr(mod, name, Rec())
    z = lambda n: torch.zeros(n, dtype=torch.int32)
    mod.expert_blocks = lambda ids, e, bm: (z(48), z(16), z(16), z(16))
    gen = torch.Generator().manual_seed(0)
    w = bfm.tiled_experts(bfm.random_experts(fmt, 8, 4096, 2048, "cpu", gen))
    x = torch.randn(8, 4096).to(torch.bfloat16)
    ids = torch.randint(0, 8, (8, 6), dtype=torch.int32)
    mod.fp4_moe_pairs_triton(*bfm.op_args(x, ids, torch.rand(8, 6), w), config=cfg)
    for launch in launches:
        launch.meta.update(DOT_DTYPE=tl.bfloat16, COMPILED=True)
    return launches


for fmt in ("mxfp4", "nvfp4"):
    for cname in ("mma", "mma_one"):
        cfg = moe.DEFAULT_CONFIGS[cname]
        for label, mod in (("row-major", moe), ("rm-asm", asm), ("tiled", ts)):
            for launch in record(mod, cfg, fmt):
                c = cross_compile(launch, 90)
                ttgir = c.asm["ttgir"]
                st = compiled_stats(launch, 90)
                print(f"{fmt} {cname} {label:9s} {launch.kernel.fn.__name__:20s} regs {st['regs']} spills {st['spill_stores']} "
                      f"shared {st['shared']} convert_layout {len(re.findall('convert_layout', ttgir))} "
                      f"local_alloc {len(re.findall('local_alloc', ttgir))} ld.global {len(re.findall('ld.global', c.asm['ptx']))}", flush=True)
