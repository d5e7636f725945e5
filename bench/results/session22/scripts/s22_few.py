"""Session 22: at 2 to 8 tokens, one block a pair (`mma_few`, the default) against expert blocks from the
one-program grouping (`mma_small`), paired (CUDA-graph replays after an L2 flush), tiled experts."""
import statistics, sys, time
import torch
sys.path[:0] = ["bench"]
import bench_fp4_moe as bench
from dsv4_compile.kernels import fp4_moe as moe
from dsv4_compile.kernels.moe_pairs import combine_pairs
from dsv4_compile.fp4_tiles import tile_fp4

E, K, I, TOPK = 256, 4096, 2048, 6
ROUNDS = int(sys.argv[1])
gen = torch.Generator(device="cuda").manual_seed(24)
for fmt in ("mxfp4", "nvfp4"):
    w = bench.random_experts(fmt, E, K, I, "cuda", gen)
    w = dict(w, w13=tile_fp4(w["w13"]), w2=tile_fp4(w["w2"]))
    for tokens in (2, 4, 8):
        x = torch.randn(tokens, K, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand(tokens, E, device="cuda", generator=gen).topk(TOPK, dim=1).indices.to(torch.int32)
        weights = torch.rand(tokens, TOPK, device="cuda", generator=gen)
        want = moe.fp4_moe_reference(x, ids, weights, *bench.op_args(x, ids, weights, w)[3:]).float()
        fns, outs = {}, {}
        for label in ("mma_few", "mma_small"):
            cfg = moe.DEFAULT_CONFIGS[label]
            def run(cfg=cfg):
                return moe.fp4_moe_pairs_triton(*bench.op_args(x, ids, weights, w), config=cfg)
            outs[label] = combine_pairs(run(), ids, E, x.dtype).float()
            fns[label] = bench.graph_replay(run)
        err = {k: ((o - want).abs().max() / want.abs().max()).item() for k, o in outs.items()}
        times = bench.paired_times(fns, ROUNDS)
        floor = bench.touched_bytes(ids, w, K) / 4.8e12 * 1e3
        print(f"{fmt} M={tokens} default={moe.size_class(tokens * TOPK, E, fmt)} touched {torch.unique(ids).numel()} "
              f"of {tokens * TOPK} pairs, floor {floor * 1e3:.1f} us, errors {err}")
        for label, t in times.items():
            diffs = sorted(a - b for a, b in zip(t, times["mma_few"]))
            q = statistics.quantiles(diffs, n=4)
            med = statistics.median(t)
            print(f"  {label:10s} {med * 1e3:8.1f} us HBM {floor / med:.3f} vs mma_few {statistics.median(diffs) * 1e3:+7.1f} "
                  f"({q[0] * 1e3:+.1f} / {q[2] * 1e3:+.1f})", flush=True)
