"""Session 22: the mma classes with rolling L2 prefetch hints (TileConfig.l2_ahead) against the default,
paired (CUDA-graph replays after an L2 flush, alternating), V4-Flash experts (tiled), both formats.
Usage: s22_l2.py ROUNDS AHEADS(comma) MS(comma)"""
import dataclasses, statistics, sys, time
import torch
sys.path[:0] = ["bench"]
import bench_fp4_moe as bench
from dsv4_compile.kernels import fp4_moe as moe
from dsv4_compile.kernels.moe_pairs import combine_pairs
from dsv4_compile.fp4_tiles import tile_fp4

E, K, I, TOPK = 256, 4096, 2048, 6
ROUNDS = int(sys.argv[1])
AHEADS = [int(a) for a in sys.argv[2].split(",")]
MS = [int(m) for m in sys.argv[3].split(",")]
gen = torch.Generator(device="cuda").manual_seed(22)
T0 = time.time()
print("torch", torch.__version__, "device", torch.cuda.get_device_name(), flush=True)
for fmt in ("mxfp4", "nvfp4"):
    w = bench.random_experts(fmt, E, K, I, "cuda", gen)
    w = dict(w, w13=tile_fp4(w["w13"]), w2=tile_fp4(w["w2"]))
    for tokens in MS:
        x = torch.randn(tokens, K, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand(tokens, E, device="cuda", generator=gen).topk(TOPK, dim=1).indices.to(torch.int32)
        weights = torch.rand(tokens, TOPK, device="cuda", generator=gen)
        base = moe.choose_config(tokens * TOPK, E, fmt)
        fns, outs = {}, {}
        for ahead in [0] + AHEADS:
            cfg = dataclasses.replace(base, l2_ahead=ahead)
            def run(cfg=cfg):
                return moe.fp4_moe_pairs_triton(*bench.op_args(x, ids, weights, w), config=cfg)
            outs[ahead] = run()
            fns[ahead] = bench.graph_replay(run)
        equal = {a: bool(torch.equal(o, outs[0])) for a, o in outs.items()}
        want = moe.fp4_moe_reference(x, ids, weights, *bench.op_args(x, ids, weights, w)[3:])
        got = combine_pairs(outs[0], ids, E, x.dtype)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        times = bench.paired_times(fns, ROUNDS)
        floor = bench.touched_bytes(ids, w, K) / 4.8e12 * 1e3
        print(f"[{time.time() - T0:.0f}s] {fmt} M={tokens} class={moe.size_class(tokens * TOPK, E, fmt)} "
              f"bit-equal={equal} ref rel err {err:.1e} floor {floor * 1e3:.1f} us")
        for ahead, t in times.items():
            diffs = sorted(a - b for a, b in zip(t, times[0]))
            q = statistics.quantiles(diffs, n=4)
            med = statistics.median(t)
            print(f"  l2_ahead={ahead:2d} {med * 1e3:8.1f} us HBM {floor / med:.3f} vs 0 {statistics.median(diffs) * 1e3:+7.1f} "
                  f"({q[0] * 1e3:+.1f} / {q[2] * 1e3:+.1f})", flush=True)
