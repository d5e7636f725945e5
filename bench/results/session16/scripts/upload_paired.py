"""Engine.step at B=64 T=1 on host inputs: the packed side-stream upload against the previous
per-tensor uploads on the current stream, paired; and compiled_step on device inputs."""
import statistics, sys, types
import torch
from bench.__main__ import _import_dsv4_compile
_import_dsv4_compile()
import dsv4_compile
from bench.bench_fp4_moe import paired_times
from bench.slice_model import build_slice, fill_caches_

model = build_slice(torch.device("cuda"))
engine = dsv4_compile.optimize(model, max_batch=64, max_context=1 << 20, verify_tokens=0)
fill_caches_(engine.module)
gen = torch.Generator().manual_seed(1001)
ids = torch.randint(0, model.config.vocab_size, (64, 1), generator=gen)
start = torch.full((64,), 512, dtype=torch.int64)
rows = torch.arange(64, dtype=torch.int64)
dev = tuple(t.cuda() for t in (ids, start, rows))

def old_to_device(self, *tensors):
    out = []
    for t in tensors:
        if t.device == self.device:
            out.append(t.contiguous())
        else:
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
            out.append(pinned.to(self.device, non_blocking=True))
    return tuple(out)

new_to_device = engine._to_device
old = types.MethodType(old_to_device, engine)

def step_new():
    engine._to_device = new_to_device
    return engine.step(ids, start, rows)

def step_old():
    engine._to_device = old
    return engine.step(ids, start, rows)

def compiled():
    torch.compiler.cudagraph_mark_step_begin()
    return engine.compiled_step(*dev)

with torch.no_grad():
    a = step_new().float(); b = step_old().float(); c = compiled().float()
    print("max |new - old|", (a - b).abs().max().item(), "max |new - compiled|", (a - c).abs().max().item())
    for _ in range(5):
        step_new(); step_old(); compiled()
    t = paired_times({"new": step_new, "old": step_old, "compiled_step": compiled}, 300, flush_l2=False)
us = {k: [v * 1e3 for v in vs] for k, vs in t.items()}
for k, v in us.items():
    d = [x - y for x, y in zip(v, us["new"])]
    q = statistics.quantiles(d, n=4)
    print(f"{k}: median {statistics.median(v):.1f} us, diff vs new {statistics.median(d):+.1f} ({q[0]:+.1f} / {q[2]:+.1f})")
