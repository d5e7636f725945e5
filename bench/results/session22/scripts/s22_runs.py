"""Session 22: direct blocks that group an expert's pairs in the kernels (this tree) against HEAD's one
block a pair and against table blocks (`mma_small`: the one-program grouping kernel), paired
(CUDA-graph replays after an L2 flush), tiled experts, M = 1, 2, 4, 8 (and 16: mma_small's range)."""
import statistics, sys, dataclasses
import torch
sys.path[:0] = ["bench", "tmp_gpu"]
import bench_fp4_moe as bench
from dsv4_compile.kernels import fp4_moe as moe
from dsv4_compile.kernels.moe_pairs import combine_pairs
from dsv4_compile.fp4_tiles import tile_fp4
import fp4_moe_head as head

E, K, I, TOPK = 256, 4096, 2048, 6
ROUNDS = int(sys.argv[1])
gen = torch.Generator(device="cuda").manual_seed(25)
for fmt in ("mxfp4", "nvfp4"):
    w = bench.random_experts(fmt, E, K, I, "cuda", gen)
    w = dict(w, w13=tile_fp4(w["w13"]), w2=tile_fp4(w["w2"]))
    for tokens in (1, 2, 4, 8, 16):
        x = torch.randn(tokens, K, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand(tokens, E, device="cuda", generator=gen).topk(TOPK, dim=1).indices.to(torch.int32)
        weights = torch.rand(tokens, TOPK, device="cuda", generator=gen)
        want = moe.fp4_moe_reference(x, ids, weights, *bench.op_args(x, ids, weights, w)[3:]).float()
        default = moe.size_class(tokens * TOPK, E, fmt)
        direct = moe.DEFAULT_CONFIGS[default] if default != "mma_small" else dataclasses.replace(
            moe.DEFAULT_CONFIGS["mma_small"], direct_blocks=True)
        variants = {"head direct": (head, direct), "runs (tree)": (moe, direct),
                    "table (mma_small)": (moe, moe.DEFAULT_CONFIGS["mma_small"])}
        fns, outs = {}, {}
        for label, (mod, cfg) in variants.items():
            def run(mod=mod, cfg=cfg):
                return mod.fp4_moe_pairs_triton(*bench.op_args(x, ids, weights, w), config=cfg)
            outs[label] = run()
            fns[label] = bench.graph_replay(run)
        valid = ids.reshape(-1) >= 0
        equal = {k: bool(torch.equal(o[valid], outs["head direct"][valid])) for k, o in outs.items()}
        err = {k: round(((combine_pairs(o, ids, E, x.dtype).float() - want).abs().max() / want.abs().max()).item(), 5)
               for k, o in outs.items()}
        times = bench.paired_times(fns, ROUNDS)
        floor = bench.touched_bytes(ids, w, K) / 4.8e12 * 1e3
        print(f"{fmt} M={tokens} default class {default}; touched {torch.unique(ids).numel()} of {tokens * TOPK} pairs; "
              f"floor {floor * 1e3:.1f} us; equal to head {equal}; rel err {err}")
        for label, t in times.items():
            diffs = sorted(a - b for a, b in zip(t, times["head direct"]))
            q = statistics.quantiles(diffs, n=4)
            med = statistics.median(t)
            print(f"  {label:18s} {med * 1e3:8.1f} us HBM {floor / med:.3f} vs head {statistics.median(diffs) * 1e3:+7.1f} "
                  f"({q[0] * 1e3:+.1f} / {q[2] * 1e3:+.1f})", flush=True)
