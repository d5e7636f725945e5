"""Session 13: what the empty expert blocks cost. expert_blocks sizes the block table for the worst case
(cdiv(M*k, block_m) + min(E, M*k) blocks); blocks past the used ones hold expert E and their programs
exit at once. Variant "trim": the same launch with the block table cut to the blocks in use (counted
once on the host before capture; valid because the routing is fixed across replays). Pair outputs
must be identical. Interleaved rounds of CUDA-graph replays."""
import os, sys, time
import torch, triton, triton.testing
sys.path.insert(0, "bench")
from dsv4_compile.kernels import fp4_moe as moe
import bench_fp4_moe as bfm

dev = "cuda"
E, K, I = 256, 4096, 2048
from dsv4_compile.kernels import moe_pairs
new_bound = moe_pairs.block_bound
old_bound = lambda pairs, experts, block_m: -(-pairs // block_m) + min(experts, pairs)
def use(bound):
    moe_pairs.block_bound = bound; moe.block_bound = bound
orig_blocks = moe.expert_blocks
gen = torch.Generator(device=dev).manual_seed(0)
results, keep = {}, []
for fmt in os.environ.get("FMTS", "mxfp4,nvfp4").split(","):
    w = bfm.tiled_experts(bfm.random_experts(fmt, E, K, I, dev, gen))
    for M in (1, 8, 64, 256):
        x = torch.randn(M, K, device=dev, generator=gen).to(torch.bfloat16)
        ids = torch.rand(M, E, device=dev, generator=gen).topk(6, dim=-1).indices.to(torch.int32)
        wts = torch.rand(M, 6, device=dev, generator=gen) / 4
        args = bfm.op_args(x, ids, wts, w)
        cfg = moe.choose_config(M * 6, E, fmt)
        order, be, bs, bend = orig_blocks(ids, E, cfg.block_m)
        used = int((be < E).sum())
        print(f"{fmt} M={M}: {be.numel()} blocks in the table, {used} used", flush=True)
        def trimmed(i, e, bm, used=used):
            o, a, b, c = orig_blocks(i, e, bm)
            return o, a[:used], b[:used], c[:used]
        ref = moe.fp4_moe_pairs_triton(*args, config=cfg).clone()
        moe.expert_blocks = trimmed
        got = moe.fp4_moe_pairs_triton(*args, config=cfg)
        moe.expert_blocks = orig_blocks
        valid = (ids >= 0).reshape(-1)
        print(f"  trimmed == default: {torch.equal(got[valid], ref[valid])}", flush=True)
        results[(fmt, M, "default")] = (bfm.graph_replay(lambda a=args, c=cfg: moe.fp4_moe_pairs_triton(*a, config=c)), [])
        moe.expert_blocks = trimmed
        results[(fmt, M, "trim")] = (bfm.graph_replay(lambda a=args, c=cfg: moe.fp4_moe_pairs_triton(*a, config=c)), [])
        moe.expert_blocks = orig_blocks
        keep.append((args, w))
for rnd in range(int(os.environ.get("ROUNDS", "7"))):
    for key, (fn, times) in results.items():
        times.append(triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e3)
print("| fmt | M | default us (min / median) | trimmed grid us (min / median) | trim / default |")
print("|---|---|---|---|---|")
for (fmt, M, v), (fn, t) in results.items():
    if v != "default":
        continue
    a = sorted(t); b = sorted(results[(fmt, M, "trim")][1])
    print(f"| {fmt} | {M} | {a[0]:.1f} / {a[len(a)//2]:.1f} | {b[0]:.1f} / {b[len(b)//2]:.1f} | {b[len(b)//2]/a[len(a)//2]:.3f} |")
