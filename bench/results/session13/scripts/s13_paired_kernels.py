"""Session 13: register caps on the mma size class, timed paired at the kernel level: CUDA-graph replays
of the default and the capped config alternate, each between two CUDA events, L2 flushed before each
(a 256 MB write), for ROUNDS rounds; the median of paired differences. (Blocks of do_bench per variant
favoured whichever ran first after a lighter case.)"""
import dataclasses, os, statistics, sys
import torch
sys.path.insert(0, "bench")
from dsv4_compile.kernels import fp4_moe as moe
import bench_fp4_moe as bfm

dev, E, K, I = "cuda", 256, 4096, 2048
gen = torch.Generator(device=dev).manual_seed(0)
flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
caps = [tuple(int(v) for v in c.split("/")) for c in os.environ.get("CAPS", "160/112").split(",")]
rounds = int(os.environ.get("ROUNDS", "200"))
for fmt in ("mxfp4", "nvfp4"):
    w = bfm.tiled_experts(bfm.random_experts(fmt, E, K, I, dev, gen))
    for M in (64, 256):
        x = torch.randn(M, K, device=dev, generator=gen).to(torch.bfloat16)
        ids = torch.rand(M, E, device=dev, generator=gen).topk(6, dim=-1).indices.to(torch.int32)
        wts = torch.rand(M, 6, device=dev, generator=gen) / 4
        args = bfm.op_args(x, ids, wts, w)
        base = moe.choose_config(M * 6, E, fmt)
        cfgs = {"default": base}
        cfgs.update({f"g{g}d{d}": dataclasses.replace(base, max_regs=g, down_max_regs=d) for g, d in caps})
        fns = {n: bfm.graph_replay(lambda a=args, c=c: moe.fp4_moe_pairs_triton(*a, config=c)) for n, c in cfgs.items()}
        ev = {n: [] for n in fns}
        for _ in range(rounds):
            for n, fn in fns.items():
                flush.zero_()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); fn(); e.record(); ev[n].append((s, e))
        torch.cuda.synchronize()
        t = {n: [s.elapsed_time(e) * 1e3 for s, e in v] for n, v in ev.items()}
        for n in fns:
            d = [a - b for a, b in zip(t[n], t["default"])]
            q = statistics.quantiles(d, n=4)
            print(f"{fmt} M={M} {n:10s} median {statistics.median(t[n]):8.1f} us  paired diff vs default "
                  f"{statistics.median(d):+7.1f} us (quartiles {q[0]:+.1f} / {q[2]:+.1f})", flush=True)
