"""Session 11: the 4-layer slice step at B (argv[1], default 64), T=1, ctx 512, max_context 1M, with
variants compiled one after another on the same model and caches:
  base      : optimize() as committed;
  ind_pdl   : inductor's programmatic dependent launch (config.triton.enable_pdl);
  moe_pdl=N : the FP4 MoE down kernel as a programmatic dependent (TileConfig.pdl_steps=N);
Logits of each variant vs base; times: do_bench of compiled_step (L2 flushed, as the e2e bench) and a
back-to-back loop of 100 steps (CUDA events), round-robin, min of 3."""
import dataclasses, gc, sys, time
import torch, triton.testing
sys.path.insert(0, "bench")
import dsv4_compile
from dsv4_compile.kernels import fp4_moe as moe
from bench.slice_model import build_slice, fill_caches_

T0 = time.time()
dev = torch.device("cuda")
B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
variants = sys.argv[2].split(",") if len(sys.argv) > 2 else ["base", "ind_pdl", "tiles", "ind_pdl+tiles"]
model = build_slice(dev)
gen = torch.Generator().manual_seed(1001)
ids = torch.randint(0, model.config.vocab_size, (B, 1), generator=gen).to(dev)
start = torch.full((B,), 512, dtype=torch.int64, device=dev)
rows = torch.arange(B, dtype=torch.int64, device=dev)
defaults = dict(moe.DEFAULT_CONFIGS)
KERNELS = moe._gate_up_mma_kernel, moe._down_mma_kernel


class Override:
    """A Triton kernel launched with other BLOCK_N / BLOCK_K / warps (grid axis 0 rescaled), only where
    the launcher asked for BLOCK_N == only_block_n."""
    def __init__(self, kernel, block_n=None, block_k=None, warps=None, prefetch=None, only_block_n=None):
        self.kernel, self.block_n, self.block_k, self.warps, self.prefetch = kernel, block_n, block_k, warps, prefetch
        self.only_block_n = only_block_n
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kw):
            kw = dict(kw)
            tiles, blocks = grid
            if self.only_block_n is not None and kw["BLOCK_N"] != self.only_block_n:
                return self.kernel[grid](*args, **kw)
            self.launches += 1
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
steps, logits = {}, {}
engine = None
for name in variants:
    torch._inductor.config.triton.enable_pdl = "ind_pdl" in name
    torch._inductor.config.max_autotune_gemm = "gemm_at" in name
    torch._inductor.config.coordinate_descent_tuning = "cdt" in name
    moe.DEFAULT_CONFIGS.clear(); moe.DEFAULT_CONFIGS.update(defaults)
    moe._gate_up_mma_kernel, moe._down_mma_kernel = KERNELS
    if "tiles" in name or "g16" in name:  # gate/up 16 rows a program (the mma config only)
        moe._gate_up_mma_kernel = Override(KERNELS[0], 16, None, None, None, only_block_n=32)
    if "tiles" in name or "d64" in name:  # down 64 rows on 2 warps (the mma config only)
        moe._down_mma_kernel = Override(KERNELS[1], 64, None, 2, None, only_block_n=32)
    if "moe_pdl=" in name:
        n = int(name.split("moe_pdl=")[1])
        for key in ("mma", "mma_one"):
            moe.DEFAULT_CONFIGS[key] = dataclasses.replace(defaults[key], pdl_steps=n)
    if engine is None:
        engine = dsv4_compile.optimize(model, max_batch=B, max_context=1 << 20)
        fill_caches_(engine.module)
    else:  # a fresh compile of the same module and caches
        engine.compiled_step = dsv4_compile.compiled_step.compile_step(engine.module, engine.backend, 2)
    t = time.time()
    with torch.no_grad():
        torch.compiler.cudagraph_mark_step_begin()
        logits[name] = engine.compiled_step(ids, start, rows).float().clone()
    torch.cuda.synchronize()
    print(f"[{time.time() - T0:.0f}s] {name}: compiled in {time.time() - t:.1f}s, pdl={torch._inductor.config.triton.enable_pdl}", flush=True)

    def run(fn=engine.compiled_step):
        with torch.no_grad():
            torch.compiler.cudagraph_mark_step_begin()
            return fn(ids, start, rows)
    for _ in range(3):
        run()
    steps[name] = run
    if any(t in name for t in ("tiles", "g16", "d64")):
        print(f"  overridden launches: gate_up {getattr(moe._gate_up_mma_kernel, 'launches', '-')}, down {getattr(moe._down_mma_kernel, 'launches', '-')}", flush=True)
    err = (logits[name] - logits[variants[0]]).abs().max().item()
    print(f"  max |logits - {variants[0]}| = {err:.3e} (logit scale {logits[variants[0]].abs().max().item():.2f})", flush=True)

res = {n: {"do_bench": [], "b2b": []} for n in steps}
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
import os
for _ in range(int(os.environ.get("ROUNDS", "3"))):
    for n, fn in steps.items():
        res[n]["do_bench"].append(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3)
        torch.cuda.synchronize(); s.record()
        for _ in range(100):
            fn()
        e.record(); torch.cuda.synchronize()
        res[n]["b2b"].append(s.elapsed_time(e) * 10)
base = res[variants[0]]
for n, r in res.items():
    print(f"B={B} {n:22s} do_bench {min(r['do_bench']):8.1f} us ({min(r['do_bench']) / min(base['do_bench']):.4f})"
          f"  back-to-back {min(r['b2b']):8.1f} us ({min(r['b2b']) / min(base['b2b']):.4f})"
          f"  runs {[round(v) for v in r['do_bench']]} b2b runs {[round(v) for v in r['b2b']]}", flush=True)
from torch.profiler import ProfilerActivity, profile
for n, fn in steps.items():
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    sums, total = {}, 0.0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us = ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
            total += us
            key = (ev.name if "mma_kernel" in ev.name else "cublas" if ("nvjet" in ev.name or "cublas" in ev.name or "gemm" in ev.name.lower())
                   else "triton_mm" if ev.name.startswith("triton_tem") or "_mm_" in ev.name else
                   "inductor" if ev.name.startswith("triton_") else "other")
            sums[key] = sums.get(key, 0.0) + us
    print(f"B={B} {n:22s} kernel us/step: total {total / 20:.1f} " +
          " ".join(f"{k} {v / 20:.1f}" for k, v in sorted(sums.items())), flush=True)
print(f"[{time.time() - T0:.0f}s] done", flush=True)
