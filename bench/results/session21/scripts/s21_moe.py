"""Session 21: the FP4 MoE kernels, HEAD (plain tiles) vs this tree (swizzled tiles), each with the
default scale loads and with the inline-asm scale loads; bit-equality first, then paired CUDA-graph
replays after an L2 flush (bench_fp4_moe.paired_times)."""
import dataclasses, statistics, sys, time
import torch
sys.path[:0] = ["bench", "tmp_gpu"]
import bench_fp4_moe as bench
from dsv4_compile.kernels import fp4_moe as new
from dsv4_compile.kernels.moe_pairs import combine_pairs
from dsv4_compile.fp4_tiles import tile_matrix, tile_fp4, TILE_COLS
import fp4_moe_head as old

E, K, I, TOPK = 256, 4096, 2048, 6
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 150
gen = torch.Generator(device="cuda").manual_seed(21)
print("torch", torch.__version__, "device", torch.cuda.get_device_name())
for fmt in ("mxfp4", "nvfp4"):
    w = bench.random_experts(fmt, E, K, I, "cuda", gen)
    w_old = dict(w, w13=tile_matrix(w["w13"], TILE_COLS // 2), w2=tile_matrix(w["w2"], TILE_COLS // 2))
    w_new = dict(w, w13=tile_fp4(w["w13"]), w2=tile_fp4(w["w2"]))
    for tokens in (1, 8, 64, 256):
        x = torch.randn(tokens, K, device="cuda", generator=gen).to(torch.bfloat16)
        scores = torch.rand(tokens, E, device="cuda", generator=gen)
        ids = scores.topk(TOPK, dim=1).indices.to(torch.int32)
        weights = torch.rand(tokens, TOPK, device="cuda", generator=gen)
        pairs = tokens * TOPK
        base = new.choose_config(pairs, E, fmt)
        cls = new.size_class(pairs, E, fmt)
        asm = dataclasses.replace(base, scale_asm=True)
        variants = {}
        for label, mod, ww, cfg in (("head", old, w_old, base), ("swz", new, w_new, base)):
            def run(mod=mod, ww=ww, cfg=cfg):
                return mod.fp4_moe_pairs_triton(*bench.op_args(x, ids, weights, ww), config=cfg)
            variants[label] = run
        outs = {label: fn() for label, fn in variants.items()}
        ref = outs["head"]
        equal = {label: bool(torch.equal(o, ref)) for label, o in outs.items()}
        want = new.fp4_moe_reference(x, ids, weights, *bench.op_args(x, ids, weights, w_new)[3:])
        got = combine_pairs(outs["swz"], ids, E, x.dtype)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        replays = {label: bench.graph_replay(fn) for label, fn in variants.items()}
        times = bench.paired_times(replays, ROUNDS)
        floor = bench.touched_bytes(ids, w, K) / 4.8e12 * 1e3
        line = [f"{fmt} M={tokens} class={cls} bit-equal={equal} ref max rel err={err:.2e} floor {floor * 1e3:.1f} us"]
        for label, t in times.items():
            med = statistics.median(t)
            diffs = sorted(a - b for a, b in zip(t, times["head"]))
            q = statistics.quantiles(diffs, n=4)
            line.append(f"  {label:9s} {med * 1e3:8.1f} us  HBM {floor / med:.3f}  vs head {statistics.median(diffs) * 1e3:+7.1f} "
                        f"({q[0] * 1e3:+.1f} / {q[2] * 1e3:+.1f})")
        print("\n".join(line), flush=True)
