"""Session 22: tile-config variants of the mma classes against each size's default, paired (CUDA-graph
replays after an L2 flush, alternating), V4-Flash experts (tiled), both formats. Usage: s22_cfg.py ROUNDS MS"""
import dataclasses, statistics, sys, time
import torch
sys.path[:0] = ["bench"]
import bench_fp4_moe as bench
from dsv4_compile.kernels import fp4_moe as moe
from dsv4_compile.kernels.moe_pairs import combine_pairs
from dsv4_compile.fp4_tiles import tile_fp4

E, K, I, TOPK = 256, 4096, 2048, 6
ROUNDS = int(sys.argv[1])
MS = [int(m) for m in sys.argv[2].split(",")]
R = dataclasses.replace
VARIANTS = {
    256: {"8x32x64 caps 160/112": lambda c: R(c, block_k=64),
          "8x32x64 caps 160/128": lambda c: R(c, block_k=64, down_max_regs=128),
          "8x32x64 no caps": lambda c: R(c, block_k=64, max_regs=0, down_max_regs=0),
          "8x32x128 caps 160/none": lambda c: R(c, down_max_regs=0)},
    64: {"8x16x64": lambda c: R(c, block_k=64)},
    8: {"8x16x64": lambda c: R(c, block_k=64)},
    1: {"8x16x64": lambda c: R(c, block_k=64)},
}
gen = torch.Generator(device="cuda").manual_seed(23)
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
        want = moe.fp4_moe_reference(x, ids, weights, *bench.op_args(x, ids, weights, w)[3:]).float()
        fns, errs = {}, {}
        for label, change in {"default": None, **VARIANTS[tokens]}.items():
            cfg = base if change is None else change(base)
            def run(cfg=cfg):
                return moe.fp4_moe_pairs_triton(*bench.op_args(x, ids, weights, w), config=cfg)
            got = combine_pairs(run(), ids, E, x.dtype).float()
            errs[label] = ((got - want).abs().max() / want.abs().max()).item()
            fns[label] = bench.graph_replay(run)
        times = bench.paired_times(fns, ROUNDS)
        floor = bench.touched_bytes(ids, w, K) / 4.8e12 * 1e3
        print(f"[{time.time() - T0:.0f}s] {fmt} M={tokens} class={moe.size_class(tokens * TOPK, E, fmt)} floor {floor * 1e3:.1f} us")
        for label, t in times.items():
            diffs = sorted(a - b for a, b in zip(t, times["default"]))
            q = statistics.quantiles(diffs, n=4)
            med = statistics.median(t)
            print(f"  {label:24s} err {errs[label]:.1e} {med * 1e3:8.1f} us HBM {floor / med:.3f} vs default "
                  f"{statistics.median(diffs) * 1e3:+7.1f} ({q[0] * 1e3:+.1f} / {q[2] * 1e3:+.1f})", flush=True)
