"""Prepared in session 11 for the next: the 4-layer slice step at B (argv[1], default 64), T=1, ctx 512,
max context 1M, with variants (argv[2]) compiled one after another on the same model and caches:
  base  : optimize() as committed;
  tiles : the mma size class with gate/up on 16 weight rows and down on 64 rows and 2 warps
          (TileConfig.down_block_n / down_num_warps);
  g16   : gate/up on 16 rows only;   d64: down on 64 rows and 2 warps only;
  ind_pdl, gemm_at, cdt : inductor options (enable_pdl, max_autotune_gemm, coordinate_descent_tuning).
Prints each compile's pass records, each variant's logits vs the first, do_bench and back-to-back
times (round-robin), per-kernel profiles, and paired timings (below)."""
import dataclasses, gc, sys, time
import torch, triton.testing
sys.path.insert(0, "bench")
import dsv4_compile
from dsv4_compile.kernels import fp4_moe as moe
from bench.slice_model import build_slice, fill_caches_

T0 = time.time()
dev = torch.device("cuda")
B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
variants = sys.argv[2].split(",") if len(sys.argv) > 2 else ["base", "tiles", "g16", "d64"]
model = build_slice(dev)
gen = torch.Generator().manual_seed(1001)
T = int(sys.argv[3]) if len(sys.argv) > 3 else 1
ids = torch.randint(0, model.config.vocab_size, (B, T), generator=gen).to(dev)
start = torch.full((B,), 512, dtype=torch.int64, device=dev)
rows = torch.arange(B, dtype=torch.int64, device=dev)
defaults = dict(moe.DEFAULT_CONFIGS)
steps, logits = {}, {}
seen = 0
engine = None
for name in variants:
    torch._inductor.config.triton.enable_pdl = "ind_pdl" in name
    torch._inductor.config.max_autotune_gemm = "gemm_at" in name
    torch._inductor.config.coordinate_descent_tuning = "cdt" in name
    moe.DEFAULT_CONFIGS.clear(); moe.DEFAULT_CONFIGS.update(defaults)
    shapes = {"tiles": dict(block_n=16, down_block_n=64, down_num_warps=2), "g16": dict(block_n=16, down_block_n=32),
              "d64": dict(down_block_n=64, down_num_warps=2), "tlload": dict(scale_asm=False)}
    for key, change in shapes.items():
        if key in name:  # the mma size class only (B=64: 2 pairs an expert)
            moe.DEFAULT_CONFIGS["mma"] = dataclasses.replace(defaults["mma"], **change)
            print(f"  mma config: {moe.DEFAULT_CONFIGS['mma']}", flush=True)
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
    fresh = engine.report.records[seen:]
    seen = len(engine.report.records)
    matched = sum(r.matched for r in fresh)
    print(f"  pass records of this compile: {matched} matched of {len(fresh)}; declined: "
          f"{[(r.pass_name, r.reason[:80]) for r in fresh if not r.matched][:6]}", flush=True)
    print(f"[{time.time() - T0:.0f}s] {name}: compiled in {time.time() - t:.1f}s, pdl={torch._inductor.config.triton.enable_pdl}", flush=True)

    def run(fn=engine.compiled_step):
        with torch.no_grad():
            torch.compiler.cudagraph_mark_step_begin()
            return fn(ids, start, rows)
    for _ in range(3):
        run()
    steps[name] = run
    err = (logits[name] - logits[variants[0]]).abs().max().item()
    print(f"  max |logits - {variants[0]}| = {err:.3e} (logit scale {logits[variants[0]].abs().max().item():.2f})", flush=True)


# Paired timing: the variants' steps alternate, each step between two CUDA events, no L2 flush and no
# host sync inside the loop, so a drift of the GPU's speed over the run (4.6% within one kernel bench
# in session 11) reaches every variant alike.
import os, statistics
rounds = int(os.environ.get("PAIRED_ROUNDS", "300"))
events = {n: [] for n in steps}
for fn in steps.values():
    fn()
torch.cuda.synchronize()
for _ in range(rounds):
    for n, fn in steps.items():
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record()
        events[n].append((s, e))
torch.cuda.synchronize()
times = {n: [s.elapsed_time(e) * 1e3 for s, e in pairs] for n, pairs in events.items()}
first = variants[0]
for n, ts in times.items():
    diffs = [t - b for t, b in zip(ts, times[first])]
    print(f"B={B} T={T} {n:22s} median {statistics.median(ts):8.1f} us  paired median diff vs {first} "
          f"{statistics.median(diffs):+7.1f} us  (quartiles {statistics.quantiles(diffs, n=4)[0]:+.1f} / "
          f"{statistics.quantiles(diffs, n=4)[2]:+.1f})", flush=True)
print(f"[{time.time() - T0:.0f}s] done", flush=True)
