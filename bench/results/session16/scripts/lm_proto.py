"""Prototype: wide bf16 products x[M, K] @ W[N, K]^T for M <= 64 (lm_head-like), Triton swap-AB
kernels (pointer loads or TMA descriptors) against cuBLAS, timed paired in CUDA graphs."""
import argparse
import itertools
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


@triton.jit
def _wide_mm_ptr(x_ptr, w_ptr, out_ptr, M, N, K: tl.constexpr, sxm, sxk, swn, swk, som, son,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * swn + offs_k[None, :] * swk
    x_cols = x_ptr + offs_m[None, :] * sxm + offs_k[:, None] * sxk
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(w_rows + k * swk, mask=n_ok[:, None], other=0.0)
        x = tl.load(x_cols + k * sxk, mask=m_ok[None, :], other=0.0)
        acc = tl.dot(w, x, acc)
    out = out_ptr + offs_m[None, :] * som + offs_n[:, None] * son
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _wide_mm_tma(x_desc, w_desc, out_ptr, M, N, K: tl.constexpr, som, son,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    n0 = pid * BLOCK_N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        w = w_desc.load([n0, k])
        x = x_desc.load([0, k])
        acc = tl.dot(w, x.T, acc)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    out = out_ptr + offs_m[None, :] * som + offs_n[:, None] * son
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])


def launch(kind, x, w, out, bn, bk, stages, warps):
    M, K = x.shape
    N = w.shape[0]
    bm = max(16, triton.next_power_of_2(M))
    grid = (triton.cdiv(N, bn),)
    if kind == "ptr":
        _wide_mm_ptr[grid](x, w, out, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                           out.stride(0), out.stride(1), BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk,
                           NUM_STAGES=stages, num_warps=warps)
    else:
        xd = TensorDescriptor.from_tensor(x, [bm, bk])
        wd = TensorDescriptor.from_tensor(w, [bn, bk])
        _wide_mm_tma[grid](xd, wd, out, M, N, K, out.stride(0), out.stride(1), BLOCK_N=bn, BLOCK_M=bm,
                           BLOCK_K=bk, NUM_STAGES=stages, num_warps=warps)
    return out


def graph_of(fn, calls):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    return g


def time_paired(graphs, calls, rounds):
    """Median us per call of each graph, replays alternating."""
    times = {k: [] for k in graphs}
    for _ in range(rounds):
        for k, g in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times[k].append(a.elapsed_time(b) * 1e3 / calls)
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="64x129280x4096,1x129280x4096,64x32768x1024")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    cfgs = [(bn, bk, st, wp) for (bn, bk, st, wp) in [
        (128, 64, 4, 4), (128, 64, 6, 4), (128, 128, 3, 4), (128, 128, 4, 8), (64, 128, 4, 4), (64, 256, 3, 4),
        (256, 64, 3, 8), (256, 64, 4, 8), (128, 64, 8, 4), (128, 128, 2, 4)]]
    rows = []
    for shape in args.shapes.split(","):
        M, N, K = (int(v) for v in shape.split("x"))
        wbytes = N * K * 2
        copies = max(1, (400 << 20) // wbytes)  # rotate weights past the 50 MB L2
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ref = (x.float() @ ws[0].float().t())
        calls = max(copies, min(64, (2_000_000_000 // wbytes) // copies * copies))
        variants = {"cublas": lambda i: torch.mm(x, ws[i % copies].t())}
        outs = {}
        for kind, (bn, bk, st, wp) in itertools.product(("ptr", "tma"), cfgs):
            name = f"{kind}_bn{bn}_bk{bk}_s{st}_w{wp}"
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            try:
                launch(kind, x, ws[0], out, bn, bk, st, wp)
                torch.cuda.synchronize()
            except Exception as e:  # record configs that do not build or launch
                rows.append({"shape": shape, "variant": name, "error": repr(e)[:200]})
                print(shape, name, "ERROR", repr(e)[:200], flush=True)
                continue
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            outs[name] = err
            o = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            variants[name] = (lambda kind, bn, bk, st, wp, o: lambda i: launch(kind, x, ws[i % copies], o, bn, bk, st, wp))(kind, bn, bk, st, wp, o)
        graphs = {}
        for k, fn in variants.items():
            try:
                graphs[k] = graph_of(fn, calls)
            except Exception as e:
                print(shape, k, "GRAPH ERROR", repr(e)[:200], flush=True)
        med = time_paired(graphs, calls, args.rounds)
        floor = (wbytes + M * K * 2 + M * N * 2) / 4.8e12 * 1e6
        for k, t in sorted(med.items(), key=lambda kv: kv[1]):
            row = {"shape": shape, "variant": k, "us": round(t, 2), "hbm_frac": round(floor / t, 3),
                   "vs_cublas": round(t - med["cublas"], 2), "rel_err": outs.get(k)}
            rows.append(row)
            print(row, flush=True)
        del ws, graphs
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
