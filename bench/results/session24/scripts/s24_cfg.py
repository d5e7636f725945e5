"""Session 24: FP4 MoE launch-config variants (s24_variants.py) against each size's default, paired (CUDA-graph
replays after an L2 flush, alternating), V4-Flash experts (tiled), both formats. Usage: s24_cfg.py ROUNDS MS"""
import statistics, sys, time
import torch
sys.path[:0] = ["bench", "tmp_gpu"]
import bench_fp4_moe as bench
from dsv4_compile.kernels import fp4_moe as moe
from dsv4_compile.kernels.moe_pairs import combine_pairs
from dsv4_compile.fp4_tiles import tile_fp4
from s24_variants import VARIANTS

E, K, I, TOPK = 256, 4096, 2048, 6
ROUNDS = int(sys.argv[1])
MS = [int(m) for m in sys.argv[2].split(",")]
gen = torch.Generator(device="cuda").manual_seed(24)
T0 = time.time()
print("torch", torch.__version__, "device", torch.cuda.get_device_name(), flush=True)
for fmt in ("mxfp4", "nvfp4"):
    w = bench.random_experts(fmt, E, K, I, "cuda", gen)
    w = dict(w, w13=tile_fp4(w["w13"]), w2=tile_fp4(w["w2"]))
    for tokens in MS:
        x = torch.randn(tokens, K, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand(tokens, E, device="cuda", generator=gen).topk(TOPK, dim=1).indices.to(torch.int32)
        weights = torch.rand(tokens, TOPK, device="cuda", generator=gen)
        counts = torch.bincount(ids.flatten().long(), minlength=E)
        print(f"{fmt} M={tokens}: experts touched {int((counts > 0).sum())}, with > 8 pairs {int((counts > 8).sum())}, "
              f"> 16 pairs {int((counts > 16).sum())}, max {int(counts.max())}", flush=True)
        base = moe.choose_config(tokens * TOPK, E, fmt)
        want = moe.fp4_moe_reference(x, ids, weights, *bench.op_args(x, ids, weights, w)[3:]).float()
        fns, errs, ref_out = {}, {}, None
        for label, change in {"default": None, **VARIANTS[tokens]}.items():
            cfg = base if change is None else change(base)
            def run(cfg=cfg):
                return moe.fp4_moe_pairs_triton(*bench.op_args(x, ids, weights, w), config=cfg)
            got = combine_pairs(run(), ids, E, x.dtype).float()
            errs[label] = ((got - want).abs().max() / want.abs().max()).item()
            ref_out = got if ref_out is None else ref_out
            errs[label] = (errs[label], torch.equal(got, ref_out))
            fns[label] = bench.graph_replay(run)
        times = bench.paired_times(fns, ROUNDS)
        floor = bench.touched_bytes(ids, w, K) / 4.8e12 * 1e3
        print(f"[{time.time() - T0:.0f}s] {fmt} M={tokens} class={moe.size_class(tokens * TOPK, E, fmt)} "
              f"floor {floor * 1e3:.1f} us", flush=True)
        for label, t in times.items():
            diffs = sorted(a - b for a, b in zip(t, times["default"]))
            q = statistics.quantiles(diffs, n=4)
            med = statistics.median(t)
            err, same = errs[label]
            print(f"  {label:22s} err {err:.1e} bit-equal {same!s:5} {med * 1e3:8.1f} us HBM {floor / med:.3f} "
                  f"vs default {statistics.median(diffs) * 1e3:+7.1f} ({q[0] * 1e3:+.1f} / {q[2] * 1e3:+.1f})",
                  flush=True)
