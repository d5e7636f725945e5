"""Session 13: the expert-block table at block_bound's size (min(E, M*k) + floor((M*k - min(E, M*k)) /
block_m)) against the old cdiv(M*k, block_m) + min(E, M*k): the op's pair kernels (expert_blocks +
gate/up + down), interleaved rounds of CUDA-graph replays; outputs must be identical."""
import os, sys
import torch, triton, triton.testing
sys.path.insert(0, "bench")
from dsv4_compile.kernels import fp4_moe as moe, moe_pairs
import bench_fp4_moe as bfm

new_bound = moe_pairs.block_bound
old_bound = lambda pairs, experts, block_m: -(-pairs // block_m) + min(experts, pairs)
def use(bound):
    moe_pairs.block_bound = bound; moe.block_bound = bound
dev, E, K, I = "cuda", 256, 4096, 2048
gen = torch.Generator(device=dev).manual_seed(0)
results, keep = {}, []
for fmt in ("mxfp4", "nvfp4"):
    w = bfm.tiled_experts(bfm.random_experts(fmt, E, K, I, dev, gen))
    for M in (1, 8, 64, 256):
        x = torch.randn(M, K, device=dev, generator=gen).to(torch.bfloat16)
        ids = torch.rand(M, E, device=dev, generator=gen).topk(6, dim=-1).indices.to(torch.int32)
        wts = torch.rand(M, 6, device=dev, generator=gen) / 4
        args = bfm.op_args(x, ids, wts, w)
        outs = {}
        for name, bound in (("old", old_bound), ("new", new_bound)):
            use(bound)
            outs[name] = moe.fp4_moe_pairs_triton(*args).clone()
            results[(fmt, M, name)] = (bfm.graph_replay(lambda a=args: moe.fp4_moe_pairs_triton(*a)), [])
            print(f"{fmt} M={M} {name}: table {bound(M * 6, E, moe.choose_config(M * 6, E, fmt).block_m)} blocks", flush=True)
        valid = (ids >= 0).reshape(-1)
        print(f"  identical: {torch.equal(outs['old'][valid], outs['new'][valid])}", flush=True)
        keep.append((args, w))
use(new_bound)
for rnd in range(int(os.environ.get("ROUNDS", "9"))):
    for key, (fn, times) in results.items():
        times.append(triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e3)
print("| fmt | M | old table us (min / median) | block_bound table us (min / median) | new / old (medians) |")
print("|---|---|---|---|---|")
for (fmt, M, v), (fn, t) in results.items():
    if v == "old":
        a = sorted(t); b = sorted(results[(fmt, M, "new")][1])
        print(f"| {fmt} | {M} | {a[0]:.1f} / {a[len(a)//2]:.1f} | {b[0]:.1f} / {b[len(b)//2]:.1f} | {b[len(b)//2]/a[len(a)//2]:.3f} |")
