"""The dot paths (bf16 dequantisation, and tl.dot_scaled where Triton runs it) and the GEMV path on swizzled
tiled experts against the reference on the H200, V4-Flash widths, 16 experts."""
import sys
import torch
sys.path[:0] = ["bench"]
import bench_fp4_moe as bench
from dsv4_compile.kernels import fp4_moe as moe
from dsv4_compile.kernels.moe_pairs import combine_pairs
from dsv4_compile.fp4_tiles import tile_fp4
gen = torch.Generator(device="cuda").manual_seed(5)
for fmt in ("mxfp4", "nvfp4"):
    w = bench.random_experts(fmt, 16, 4096, 2048, "cuda", gen)
    wt = dict(w, w13=tile_fp4(w["w13"]), w2=tile_fp4(w["w2"]))
    for tokens, name, scaled, layout in ((64, "gemv", False, wt), (64, "dot16", False, wt), (256, "dot64", False, wt),
                                         (64, "dot16", True, wt), (64, "dot16", True, w)):
        if scaled and fmt != "mxfp4":
            continue
        x = torch.randn(tokens, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand(tokens, 16, device="cuda", generator=gen).topk(6, dim=1).indices.to(torch.int32)
        weights = torch.rand(tokens, 6, device="cuda", generator=gen)
        want = moe.fp4_moe_reference(*bench.op_args(x, ids, weights, w)).float()
        try:
            pairs = torch.full((tokens * 6, 4096), float("nan"), device="cuda")
            got = combine_pairs(moe.fp4_moe_pairs_triton(*bench.op_args(x, ids, weights, layout), pair_out=pairs,
                                                         config=moe.DEFAULT_CONFIGS[name], use_dot_scaled=scaled),
                                ids, 16, x.dtype).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            print(fmt, tokens, name, "dot_scaled" if scaled else "", "tiled" if layout is wt else "row-major", "max rel err", f"{err:.2e}", "OK" if err < 2e-2 else "FAIL")
        except Exception as e:
            print(fmt, tokens, name, "dot_scaled" if scaled else "", "ERROR", type(e).__name__, str(e)[:200])
