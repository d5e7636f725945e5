"""Session 20 call 7: the HCA window pool on rings stored [rows, windows, width, slot] (slots innermost),
compiled three times without caches: chosen reduction config and time, against the [rows, slot, width] ring."""
import re
import torch
from torch._inductor.utils import run_and_get_code
import torch._inductor.config as icfg

B, R, D, RATE = 64, 65, 512, 128
torch.manual_seed(0)
rows = torch.randperm(R, device="cuda")[:B]
positions = torch.randint(0, 100000, (B, 1), device="cuda")
bias = torch.randn(RATE, D, device="cuda").to(torch.bfloat16)
ring_t = [torch.randn(R, 2, D, RATE, device="cuda").to(torch.bfloat16) for _ in range(2)]
ring_s = [t.transpose(2, 3).contiguous().view(R, 2 * RATE, D) for t in ring_t]


def pool_t(kv_ring, gate_ring, bias, rows, positions):
    entry = positions[:, :1] // RATE
    kv = kv_ring[rows[:, None], entry % 2]
    g = gate_ring[rows[:, None], entry % 2] + bias.t()
    w = g.softmax(dim=-1, dtype=torch.float32).to(kv.dtype)
    return (kv * w).sum(dim=-1)


def pool_s(kv_ring, gate_ring, bias, rows, positions):
    entry = positions[:, :1] // RATE
    kv = kv_ring.view(R, 2, RATE, D)[rows[:, None], entry % 2]
    g = gate_ring.view(R, 2, RATE, D)[rows[:, None], entry % 2] + bias
    w = g.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
    return (kv * w).sum(dim=2)


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


ref = pool_s(*ring_s, bias, rows, positions).float()
icfg.force_disable_caches = True
for name, fn, rings in (("slots innermost", pool_t, ring_t), ("width innermost", pool_s, ring_s)) * 3:
    torch._dynamo.reset()
    cfn = torch.compile(fn, dynamic=False)
    out, code = run_and_get_code(cfn, *rings, bias, rows, positions)
    hint = re.findall(r"reduction_hint=ReductionHint\.(\w+)", code[0])
    err = (out.float() - ref).abs().max().item()
    print(f"{name}: {graph_us(lambda: cfn(*rings, bias, rows, positions)):.2f} us, hint {hint}, max diff {err:.2e}",
          flush=True)
