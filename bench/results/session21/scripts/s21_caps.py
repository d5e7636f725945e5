"""Session 21: with the swizzled decode, the register caps and scale loads of the mma classes, paired
(CUDA-graph replays after an L2 flush, alternating), V4-Flash experts, both formats."""
import dataclasses, statistics, sys
import torch
sys.path[:0] = ["bench"]
import bench_fp4_moe as bench
from dsv4_compile.kernels import fp4_moe as moe
from dsv4_compile.fp4_tiles import tile_fp4

E, K, I, TOPK = 256, 4096, 2048, 6
gen = torch.Generator(device="cuda").manual_seed(22)
R = dataclasses.replace
CASES = {
    64: {"default (mma_small)": None,
         "asm scales": lambda c: R(c, scale_asm=True),
         "caps 128/96": lambda c: R(c, max_regs=128, down_max_regs=96),
         "32-row class (mma)": lambda c: moe.DEFAULT_CONFIGS["mma"]},
    256: {"default (mma, caps 160/112)": None,
          "caps 176/128": lambda c: R(c, max_regs=176, down_max_regs=128),
          "caps 144/104": lambda c: R(c, max_regs=144, down_max_regs=104),
          "no caps": lambda c: R(c, max_regs=0, down_max_regs=0),
          "tl.load scales": lambda c: R(c, scale_asm=False)},
}
for fmt in ("mxfp4", "nvfp4"):
    w = bench.random_experts(fmt, E, K, I, "cuda", gen)
    w = dict(w, w13=tile_fp4(w["w13"]), w2=tile_fp4(w["w2"]))
    for tokens, variants in CASES.items():
        x = torch.randn(tokens, K, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand(tokens, E, device="cuda", generator=gen).topk(TOPK, dim=1).indices.to(torch.int32)
        weights = torch.rand(tokens, TOPK, device="cuda", generator=gen)
        base = moe.choose_config(tokens * TOPK, E, fmt)
        fns, outs = {}, {}
        for label, change in variants.items():
            cfg = base if change is None else change(base)
            def run(cfg=cfg):
                return moe.fp4_moe_pairs_triton(*bench.op_args(x, ids, weights, w), config=cfg)
            outs[label] = run()
            fns[label] = bench.graph_replay(run)
        first = next(iter(outs))
        equal = {label: bool(torch.equal(o, outs[first])) for label, o in outs.items()}
        times = bench.paired_times(fns, 100)
        floor = bench.touched_bytes(ids, w, K) / 4.8e12 * 1e3
        print(f"{fmt} M={tokens} bit-equal={equal} floor {floor * 1e3:.1f} us")
        for label, t in times.items():
            diffs = sorted(a - b for a, b in zip(t, times[first]))
            q = statistics.quantiles(diffs, n=4)
            med = statistics.median(t)
            print(f"  {label:28s} {med * 1e3:8.1f} us HBM {floor / med:.3f} vs default {statistics.median(diffs) * 1e3:+7.1f} "
                  f"({q[0] * 1e3:+.1f} / {q[2] * 1e3:+.1f})", flush=True)
