"""Session 13 (from session 12's s12_paired_call10.py): the 4-layer slice step at B (argv[1], default 64), T (argv[3]), ctx 512,
max context 1M, with variants (argv[2]) compiled one after another on the same model and caches:
  base, base2 : optimize() as committed (base2: the noise control, a second compile);
  oldbound : the expert-block table at its old size, cdiv(M*k, block_m) + min(E, M*k) (session 13);
  tiles, tilesnc : gate/up on 16 weight rows, down on 64 rows and 2 warps (session 11), with / without the caps;
  g160, g192, d112, g160d112, g128d112, g144d112, g176d112, g160d96 : the mma size class with register caps on gate/up (gN) and down (dN)
          (TileConfig.max_regs / down_max_regs).
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
variants = sys.argv[2].split(",") if len(sys.argv) > 2 else ["base", "g160d112", "base2"]
model = build_slice(dev)
gen = torch.Generator().manual_seed(1001)
T = int(sys.argv[3]) if len(sys.argv) > 3 else 1
ids = torch.randint(0, model.config.vocab_size, (B, T), generator=gen).to(dev)
start = torch.full((B,), 512, dtype=torch.int64, device=dev)
rows = torch.arange(B, dtype=torch.int64, device=dev)
defaults = dict(moe.DEFAULT_CONFIGS)
from dsv4_compile.kernels import moe_pairs
new_bound = moe_pairs.block_bound
old_bound = lambda pairs, experts, block_m: -(-pairs // block_m) + min(experts, pairs)
steps, logits = {}, {}
seen = 0
engine = None
for name in variants:
    torch._inductor.config.triton.enable_pdl = "ind_pdl" in name
    torch._inductor.config.max_autotune_gemm = "gemm_at" in name
    torch._inductor.config.coordinate_descent_tuning = "cdt" in name
    moe.DEFAULT_CONFIGS.clear(); moe.DEFAULT_CONFIGS.update(defaults)
    # "oldbound": expert_blocks' table at the twelfth session's size, cdiv(M*k, bm) + min(E, M*k)
    bound = old_bound if name.startswith("oldbound") else new_bound
    moe_pairs.block_bound = bound; moe.block_bound = bound
    shapes = {"g160d112": dict(max_regs=160, down_max_regs=112), "g160": dict(max_regs=160), "g192": dict(max_regs=192), "d112": dict(down_max_regs=112), "g128d112": dict(max_regs=128, down_max_regs=112), "g144d112": dict(max_regs=144, down_max_regs=112), "g176d112": dict(max_regs=176, down_max_regs=112), "g160d96": dict(max_regs=160, down_max_regs=96), "tiles": dict(block_n=16, down_block_n=64, down_num_warps=2), "tilesnc": dict(block_n=16, down_block_n=64, down_num_warps=2, max_regs=0, down_max_regs=0)}
    for key, change in shapes.items():
        if name.split("_")[0] == key:  # the mma size class only
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
