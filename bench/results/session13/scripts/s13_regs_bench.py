"""Session 13: register caps (TileConfig.max_regs / down_max_regs, Triton's maxnreg) for the FP4 MoE
mma kernels. For each format and M: the size class's default config and capped variants; pair outputs
checked bit-identical to the default's (a cap changes register allocation only); compiled registers and
spills of every kernel variant; interleaved rounds of CUDA-graph replays (median of rounds)."""
import dataclasses, os, sys, time
import torch, triton, triton.testing
sys.path.insert(0, "bench")
from dsv4_compile.kernels import fp4_moe as moe
import bench_fp4_moe as bfm

dev = "cuda"
E, K, I = 256, 4096, 2048
VARIANTS = {  # name -> (gate/up cap, down cap)
    "default": (0, 0), "g192": (192, 0), "g160": (160, 0), "g128": (128, 0), "d112": (0, 112),
    "g160d112": (160, 112),
}
ONE_VARIANTS = {"default": (0, 0), "g112d96": (112, 96)}
keep = os.environ.get("VARS")
gen = torch.Generator(device=dev).manual_seed(0)
results, keep_alive = {}, []
T0 = time.time()
for fmt in os.environ.get("FMTS", "mxfp4,nvfp4").split(","):
    w = bfm.tiled_experts(bfm.random_experts(fmt, E, K, I, dev, gen))
    for M in tuple(int(m) for m in os.environ.get("MS", "1,8,64,256").split(",")):
        x = torch.randn(M, K, device=dev, generator=gen).to(torch.bfloat16)
        ids = torch.rand(M, E, device=dev, generator=gen).topk(6, dim=-1).indices.to(torch.int32)
        wts = torch.rand(M, 6, device=dev, generator=gen) / 4
        args = bfm.op_args(x, ids, wts, w)
        cls = moe.size_class(M * 6, E, fmt)
        base = moe.DEFAULT_CONFIGS[cls]
        variants = ONE_VARIANTS if cls == "mma_one" else VARIANTS
        ref = None
        for name, (g, d) in variants.items():
            if keep and name not in keep.split(",") and name != "default":
                continue
            cfg = dataclasses.replace(base, max_regs=g, down_max_regs=d)
            out = moe.fp4_moe_pairs_triton(*args, config=cfg)
            torch.cuda.synchronize()
            if ref is None:
                ref = out.clone()
            same = torch.equal(out, ref)
            fn = bfm.graph_replay(lambda args=args, c=cfg: moe.fp4_moe_pairs_triton(*args, config=c))
            keep_alive.append((args, w))
            results[(fmt, M, cls, name)] = (fn, [])
            print(f"[{time.time()-T0:.0f}s] {fmt} M={M} {cls} {name}: {cfg} identical to default: {same}", flush=True)
# compiled registers / spills of every mma kernel variant
for kern in (moe._gate_up_mma_kernel, moe._down_mma_kernel):
    for cache in kern.device_caches.values():
        for key, ck in cache[0].items():
            md = ck.metadata
            print(f"{kern.fn.__name__}: maxnreg {getattr(md, 'maxnreg', None)} num_warps {md.num_warps} "
                  f"regs {ck.n_regs} spills {ck.n_spills} shared {md.shared}", flush=True)
for rnd in range(int(os.environ.get("ROUNDS", "5"))):
    for key, (fn, times) in results.items():
        times.append(triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e3)
    print(f"[{time.time()-T0:.0f}s] round {rnd} done", flush=True)
print("| fmt | M | class | variant (gate/up cap, down cap) | us min / median of rounds | vs default (medians) |")
print("|---|---|---|---|---|---|")
for (fmt, M, cls, name), (fn, times) in results.items():
    t = sorted(times); b = sorted(results[(fmt, M, cls, "default")][1])
    print(f"| {fmt} | {M} | {cls} | {name} | {t[0]:.1f} / {t[len(t)//2]:.1f} | {t[len(t)//2] / b[len(b)//2]:.3f} |", flush=True)
