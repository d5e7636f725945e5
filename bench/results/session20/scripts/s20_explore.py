"""Session 20 call 1: the HCA compressor's window pool as inductor compiles it (code + time) against
alternatives; the MoE pair-grouping kernels' time at B=64 and B=1."""
import sys
import torch
import triton
import triton.language as tl
from torch._inductor.utils import run_and_get_code

torch.manual_seed(0)
dev = "cuda"
B, R, RING, D, RATE = 64, 65, 131, 512, 128
ring_kv = torch.randn(R, RING, D, device=dev, dtype=torch.bfloat16)
ring_gate = torch.randn(R, RING, D, device=dev, dtype=torch.bfloat16)
bias = torch.randn(RATE, D, device=dev, dtype=torch.bfloat16)
rows = torch.randperm(R, device=dev)[:B]
positions = torch.randint(0, 100000, (B, 1), device=dev)


def pool_v0(ring_kv, ring_gate, bias, rows, positions):
    entry = positions[:, :1] // RATE + torch.arange(1, device=positions.device)
    current = entry[..., None] * RATE + torch.arange(RATE, device=positions.device)
    kv = ring_kv[rows[:, None, None], current % RING]
    g = ring_gate[rows[:, None, None], current % RING] + bias
    w = g.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
    return (kv * w).sum(dim=2)


def pool_v2(ring_kv, ring_gate, bias, rows, positions):  # the slot dim last
    entry = positions[:, :1] // RATE + torch.arange(1, device=positions.device)
    current = entry[..., None] * RATE + torch.arange(RATE, device=positions.device)
    kv = ring_kv[rows[:, None, None], current % RING].transpose(-1, -2)
    g = (ring_gate[rows[:, None, None], current % RING] + bias).transpose(-1, -2)
    w = g.softmax(dim=-1, dtype=torch.float32).to(kv.dtype)
    return (kv * w).sum(dim=-1)


ring2_kv = torch.randn(R, 2 * RATE, D, device=dev, dtype=torch.bfloat16)
ring2_gate = torch.randn(R, 2 * RATE, D, device=dev, dtype=torch.bfloat16)


def pool_v3(ring_kv, ring_gate, bias, rows, positions):  # a ring of two whole windows: a window is a block
    entry = positions[:, :1] // RATE + torch.arange(1, device=positions.device)
    half = entry % 2
    kv = ring_kv.view(ring_kv.shape[0], 2, RATE, -1)[rows[:, None], half]
    g = ring_gate.view(ring_gate.shape[0], 2, RATE, -1)[rows[:, None], half] + bias
    w = g.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
    return (kv * w).sum(dim=2)


def pool_v3_eager_check():
    entry = positions[:, :1] // RATE
    slots = (entry[..., None] * RATE + torch.arange(RATE, device=dev)) % (2 * RATE)
    kv = ring2_kv[rows[:, None, None], slots]
    g = ring2_gate[rows[:, None, None], slots] + bias
    w = g.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
    return (kv * w).sum(dim=2)


@triton.jit
def _pool_kernel(kv_ptr, g_ptr, bias_ptr, rows_ptr, pos_ptr, out_ptr, ring, s_row, s_slot,
                 RATE: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, RB: tl.constexpr):
    b = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    row = tl.load(rows_ptr + b).to(tl.int64)
    start = (tl.load(pos_ptr + b) // RATE) * RATE
    m = tl.full([BD], float("-inf"), tl.float32)
    l = tl.zeros([BD], tl.float32)
    acc = tl.zeros([BD], tl.float32)
    for r0 in tl.range(0, RATE, RB):
        r = r0 + tl.arange(0, RB)
        slot = (start + r) % ring
        off = row * s_row + slot[:, None] * s_slot + d[None, :]
        kv = tl.load(kv_ptr + off).to(tl.float32)
        g = (tl.load(g_ptr + off) + tl.load(bias_ptr + r[:, None] * D + d[None, :])).to(tl.float32)
        m_new = tl.maximum(m, tl.max(g, 0))
        a = tl.exp(m - m_new)
        p = tl.exp(g - m_new[None, :])
        l = l * a + tl.sum(p, 0)
        acc = acc * a + tl.sum(p * kv, 0)
        m = m_new
    tl.store(out_ptr + b * D + d, (acc / l).to(tl.bfloat16))


def pool_triton(ring_kv, ring_gate, bias, rows, positions, BD=128, RB=32, warps=4):
    out = torch.empty(rows.shape[0], 1, D, device=dev, dtype=torch.bfloat16)
    _pool_kernel[(rows.shape[0], D // BD)](ring_kv, ring_gate, bias, rows, positions, out, RING,
                                           ring_kv.stride(0), ring_kv.stride(1), RATE=RATE, D=D, BD=BD, RB=RB,
                                           num_warps=warps)
    return out


def graph_us(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(30):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1000 / reps)
    times.sort()
    return times[len(times) // 2]


args = (ring_kv, ring_gate, bias, rows, positions)
ref = pool_v0(*args).float()
print("== HCA window pool, B=64, 128 slots x 512, bf16 ring", flush=True)
for name, fn in (("v0 model form", pool_v0), ("v2 slots last", pool_v2)):
    torch._dynamo.reset()
    cfn = torch.compile(fn, dynamic=False)
    out, code = run_and_get_code(cfn, *args)
    err = (out.float() - ref).abs().max().item()
    us = graph_us(lambda: cfn(*args))
    print(f"{name}: {us:.2f} us, max err vs eager {err:.3e}")
    if name.startswith("v0"):
        src = code[0]
        i = src.find("@triton_heuristics")
        print(src[i:i + 5000])
ref3 = pool_v3_eager_check().float()
args3 = (ring2_kv, ring2_gate, bias, rows, positions)
torch._dynamo.reset()
cfn = torch.compile(pool_v3, dynamic=False)
out, code = run_and_get_code(cfn, *args3)
print(f"v3 two-window ring: {graph_us(lambda: cfn(*args3)):.2f} us, max err vs eager {(out.float() - ref3).abs().max().item():.3e}")
src = code[0]
i = src.find("@triton_heuristics")
print(src[i:i + 3000])
for bd, rb, w in ((128, 32, 4), (64, 32, 2), (128, 16, 4), (256, 16, 4), (64, 64, 4)):
    out = pool_triton(*args, BD=bd, RB=rb, warps=w)
    err = (out.float() - ref).abs().max().item()
    us = graph_us(lambda: pool_triton(*args, BD=bd, RB=rb, warps=w))
    print(f"triton BD={bd} RB={rb} warps={w}: {us:.2f} us, max err {err:.3e}")

print("== MoE pair grouping (expert_blocks), E=256", flush=True)
from dsv4_compile.kernels import moe_pairs
for m in (64, 256, 16):
    ids = torch.stack([torch.randperm(256, device=dev)[:6] for _ in range(m)]).int()
    for bm in (16, 32):
        want = None
        for label, limit in (("two launches + zeros", 0), ("one program", 2048), ("two launches + zeros", 0),
                             ("one program", 2048)):
            moe_pairs.ONE_PROGRAM_PAIRS = limit
            got = moe_pairs.expert_blocks(ids, 256, bm)
            blocks = [t.tolist() for t in got[1:]]
            first = {}
            for e, s, t in zip(*blocks):
                if e < 256:
                    first[e] = (min(s, first.get(e, (s, t))[0]), t)
            groups = (sorted((e, sorted(got[0][s:t].tolist())) for e, (s, t) in first.items()),
                      sorted(zip(*blocks)))
            want = want or groups
            assert groups == want, label
            us = graph_us(lambda: moe_pairs.expert_blocks(ids, 256, bm))
            print(f"M={m} k=6 block_m={bm} {label}: {us:.2f} us a call")
