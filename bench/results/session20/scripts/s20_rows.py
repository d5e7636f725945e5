"""Session 20 call 5: the mHC projection (rmsnorm(streams) @ fn^T, f32, K = 16384, 24 columns) compiled
with passes/rms_mm (dsv4::mm_sumsq) against passes/skinny_mm (inductor's mul + sum), by rows."""
import torch
import torch.nn.functional as F
from dsv4_compile.backend import Dsv4Backend
from dsv4_compile.passes.manager import PassConfig


def mixes(streams, fn):
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)
    return F.linear(flat, fn) * 2.0  # a consumer the finish fuses into


def graph_us(fn, reps=20):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(40):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1000 / reps)
    return sorted(times)[len(times) // 2]


fn = torch.randn(24, 16384, device="cuda") * 16384 ** -0.5
for rows in (1, 2, 4, 8, 16, 32, 64):
    streams = torch.randn(rows, 4, 4096, device="cuda").to(torch.bfloat16)
    res = {}
    for name in ("rms_mm", "skinny_mm"):
        torch._dynamo.reset()
        backend = Dsv4Backend(PassConfig(passes=(f"dsv4_compile.passes.{name}",)), cudagraphs=False)
        compiled = torch.compile(mixes, backend=backend, dynamic=False)
        out = compiled(streams, fn)
        res[name] = (graph_us(lambda: compiled(streams, fn)), out)
    err = (res["rms_mm"][1] - res["skinny_mm"][1]).abs().max().item()
    print(f"rows {rows}: mm_sumsq {res['rms_mm'][0]:.2f} us, mul + sum {res['skinny_mm'][0]:.2f} us, "
          f"max diff {err:.2e}", flush=True)
