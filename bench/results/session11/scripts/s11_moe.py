"""Session 11, call 1: FP4 MoE on the H200 (tiled experts, uniform routing):
(a) programmatic dependent launch of the down kernel (pdl_steps -1 = off, 0 = PDL only, n = L2 hints of n K steps);
(b) down-only and gate/up-only tile variants (the other kernel at the default).
Every variant is checked against the reference; times are CUDA-graph replays, round-robin, min of 3 medians."""
import dataclasses, sys, time
import torch, triton.testing
sys.path.insert(0, "bench")
import bench_fp4_moe as B
from dsv4_compile.kernels import fp4_moe as moe
from dsv4_compile.kernels.moe_pairs import combine_pairs_triton

dev = "cuda"
E, K, I, k = 256, 4096, 2048, 6
T0 = time.time()


class Override:
    """Wraps a Triton kernel: launches it with other BLOCK_N / BLOCK_K / warps, grid axis 0 rescaled."""
    def __init__(self, kernel, block_n=None, block_k=None, warps=None, prefetch=None):
        self.kernel, self.block_n, self.block_k, self.warps, self.prefetch = kernel, block_n, block_k, warps, prefetch

    def __getitem__(self, grid):
        def launch(*args, **kw):
            kw = dict(kw)
            tiles, blocks = grid
            if self.block_n:
                cols = tiles * kw["BLOCK_N"]
                kw["BLOCK_N"] = self.block_n
                tiles = -(-cols // self.block_n)
            if self.block_k:
                kw["BLOCK_K"] = self.block_k
            if self.warps:
                kw["NUM_WARPS"] = kw["num_warps"] = self.warps
            if self.prefetch is not None:
                kw["PREFETCH"] = self.prefetch
            return self.kernel[(tiles, blocks)](*args, **kw)
        return launch


def case(fmt, tokens, w, gen):
    x = torch.randn(tokens, K, device=dev, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, E, device=dev, generator=gen).topk(k, dim=-1).indices.to(torch.int32)
    weights = torch.rand(tokens, k, device=dev, generator=gen) / k * 1.5
    args = B.op_args(x, ids, weights, w)
    want = moe.fp4_moe_reference(*args).float()
    floor_ms = B.touched_bytes(ids, w, K) / B.HBM_BYTES_PER_S * 1e3
    return x, ids, args, want, floor_ms


def run_variants(fmt, tokens, w, gen, variants):
    x, ids, args, want, floor_ms = case(fmt, tokens, w, gen)
    scale = want.abs().max().item()
    replays, errs = {}, {}
    for name, (config, gate_up, down) in variants.items():
        def run(config=config, gate_up=gate_up, down=down):
            saved = moe._gate_up_mma_kernel, moe._down_mma_kernel
            moe._gate_up_mma_kernel = gate_up or saved[0]
            moe._down_mma_kernel = down or saved[1]
            try:
                pairs = moe.fp4_moe_pairs_triton(*args, config=config)
            finally:
                moe._gate_up_mma_kernel, moe._down_mma_kernel = saved
            return combine_pairs_triton(pairs, ids, E, x.dtype)
        try:
            err = (run().float() - want).abs().max().item() / scale
        except Exception as exc:
            print(f"{fmt} M={tokens} {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        errs[name] = err
        if err >= 3e-2:
            print(f"{fmt} M={tokens} {name}: WRONG rel err {err:.2e}", flush=True)
            continue
        replays[name] = B.graph_replay(run)
    times = {n: [] for n in replays}
    for _ in range(3):
        for n, fn in replays.items():
            times[n].append(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    base = min(times[next(iter(times))])
    for n, ts in times.items():
        t = min(ts)
        print(f"{fmt} M={tokens:4d} {n:34s} {t * 1e3:8.1f} us  HBM {floor_ms / t:.3f}  vs first {t / base:.3f}"
              f"  err {errs[n]:.1e}  spread {(max(ts) - t) / t * 100:.1f}%", flush=True)


def default_for(tokens):
    return moe.choose_config(tokens * k, E, "mxfp4")


gen = torch.Generator(device=dev).manual_seed(0)
part = sys.argv[1] if len(sys.argv) > 1 else "ab"
for fmt in ("mxfp4", "nvfp4"):
    w = B.tiled_experts(B.random_experts(fmt, E, K, I, dev, gen))
    print(f"[{time.time() - T0:.0f}s] {fmt} experts ready", flush=True)
    if "a" in part:
        for tokens in (1, 8, 64, 256):
            base = default_for(tokens)
            variants = {f"default {base.block_n}x{base.block_k}": (base, None, None)}
            for steps in (0, 2, 4, 16):
                variants[f"pdl_steps={steps}"] = (dataclasses.replace(base, pdl_steps=steps), None, None)
            run_variants(fmt, tokens, w, gen, variants)
            print(f"[{time.time() - T0:.0f}s]", flush=True)
    if "c" in part:
        for tokens in ((64, 256, 8) if fmt == "mxfp4" else (64,)):
            base = default_for(tokens)
            g16 = Override(moe._gate_up_mma_kernel, 16, None, None, None)
            d64 = Override(moe._down_mma_kernel, 64, None, 2, None)
            variants = {"default": (base, None, None), "gate_up 16": (base, g16, None), "down 64 w2": (base, None, d64),
                        "both": (base, g16, d64), "default again": (base, None, None)}
            run_variants(fmt, tokens, w, gen, variants)
            print(f"[{time.time() - T0:.0f}s]", flush=True)
    if "b" in part and fmt == "mxfp4":
        for tokens in (64, 256, 8):
            base = default_for(tokens)
            variants = {"default": (base, None, None)}
            for bn, bk, wp, pf in ((64, 128, 1, True), (64, 128, 2, True), (16, 128, 1, True), (32, 256, 1, False),
                                   (64, 64, 1, True), (128, 128, 4, True), (128, 128, 2, True), (32, 64, 1, True)):
                variants[f"down {bn}x{bk} w{wp} pf{int(pf)}"] = (base, None, Override(moe._down_mma_kernel, bn, bk, wp, pf))
            for bn, bk, wp, pf in ((64, 128, 1, True), (64, 128, 2, True), (16, 128, 1, True), (32, 256, 1, False),
                                   (128, 128, 4, True)):
                variants[f"gate_up {bn}x{bk} w{wp} pf{int(pf)}"] = (base, Override(moe._gate_up_mma_kernel, bn, bk, wp, pf), None)
            run_variants(fmt, tokens, w, gen, variants)
            print(f"[{time.time() - T0:.0f}s]", flush=True)
    del w
    torch.cuda.empty_cache()
