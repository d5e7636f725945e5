"""mHC projection rmsnorm(streams) @ fn^T on the H200: cuBLAS (no pass), the old mul+sum form,
and the skinny_mm pass's split-K op; CUDA-graph replays (do_bench_cudagraph), L2 warm."""
import sys, torch, triton.testing
import torch.nn.functional as F
sys.path.insert(0, "tests")
from helpers import compile_with_probe
from dsv4_compile.passes import skinny_mm

def hc(streams, fn):
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)
    return F.linear(flat, fn.float())

def hc_mulsum(streams, fn):
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (flat[:, :, None] * fn.float().t()[None]).sum(1)

for rows, cols in ((1, 24), (64, 24), (256, 24), (64, 4)):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    streams = torch.randn(rows, 4, 4096, device="cuda", generator=gen).bfloat16()
    fn = torch.randn(cols, 16384, device="cuda", generator=gen) * 16384 ** -0.5
    want = hc(streams.double().float(), fn.double().float())
    res = {}
    for name, f in (("cublas", torch.compile(hc)), ("mul_sum", torch.compile(hc_mulsum)),
                    ("split_k_op", compile_with_probe(hc, skinny_mm)[0])):
        torch._dynamo.reset()
        out = f(streams, fn)
        err = (out - want).abs().max().item()
        us = triton.testing.do_bench_cudagraph(lambda: f(streams, fn), rep=200) * 1e3
        res[name] = us
        print(f"rows {rows} cols {cols} {name}: {us:.2f} us (max abs err vs eager {err:.1e})", flush=True)
