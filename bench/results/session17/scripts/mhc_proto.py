"""Prototype: the mHC projection rmsnorm(x) @ w^T ([M, 16384] bf16 x [24, 16384] f32) as a split-K
tensor-core product with 3xTF32 dots (f32-level accuracy), against inductor's mul + sum and cuBLAS.

out = (x @ w^T) * rsqrt(mean(x^2) + eps): the row factor after the product, so the kernel reads bf16.
Variants: partials [S, M, 32] + sum (the sum would fuse into the consumer), or f32 atomics.
"""
import os
import sys
import time

import torch
import triton
import triton.language as tl

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
dev = "cpu" if INTERP else "cuda"


@triton.jit
def _proj_partials(x_ptr, w_ptr, part_ptr, ss_ptr, M, K, N, stride_xm, stride_wn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STEPS: tl.constexpr,
                   PRECISION: tl.constexpr, ATOMIC: tl.constexpr):
    split = tl.program_id(0)
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    ss = tl.zeros([BM], tl.float32)
    for step in range(STEPS):
        k = (split * STEPS + step) * BK + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows < M)[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + k[:, None], mask=(cols < N)[None, :] & (k < K)[:, None],
                    other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        ss += tl.sum(x * x, axis=1)
    if ATOMIC:
        tl.atomic_add(part_ptr + rows[:, None] * BN + cols[None, :], acc, mask=(rows < M)[:, None] & (cols < N)[None, :],
                      sem="relaxed")
        tl.atomic_add(ss_ptr + rows, ss, mask=rows < M, sem="relaxed")
    else:
        tl.store(part_ptr + split * BM * BN + rows[:, None] * BN + cols[None, :], acc)
        tl.store(ss_ptr + split * BM + rows, ss)


def reference(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)) @ w.t()


def mul_sum(x, w, eps):
    xf = x.float()
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xn[:, :, None] * w.t()[None]).sum(1)


def proto(x, w, eps, bk, steps, warps, precision, atomic):
    M, K = x.shape
    N = w.shape[0]
    BM, BN = max(16, triton.next_power_of_2(M)), max(16, triton.next_power_of_2(N))
    splits = triton.cdiv(K, bk * steps)
    if atomic:
        part = torch.zeros(BM, BN, device=x.device)
        ss = torch.zeros(BM, device=x.device)
    else:
        part = torch.empty(splits, BM, BN, device=x.device)
        ss = torch.empty(splits, BM, device=x.device)
    _proj_partials[(splits,)](x, w, part, ss, M, K, N, x.stride(0), w.stride(0), BM=BM, BN=BN, BK=bk, STEPS=steps,
                              PRECISION=precision, ATOMIC=atomic, num_warps=warps)
    if not atomic:
        part, ss = part.sum(0), ss.sum(0)
    return part[:M, :N] * torch.rsqrt(ss[:M, None] / K + eps)


def bench(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return triton.testing.do_bench(g.replay, warmup=10, rep=50, return_mode="median") * 1e3 / reps


def main():
    torch.manual_seed(0)
    K, N, eps = (256, 24, 1e-6) if INTERP else (16384, 24, 1e-6)
    for M in ((1, 5) if INTERP else (1, 64)):
        x = torch.randn(M, K, device=dev).to(torch.bfloat16)
        w = torch.randn(N, K, device=dev) * 0.01
        want64 = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)) @ w.double().t()
        cands = [(64, 1, 4, "tf32x3", False), (64, 2, 4, "tf32x3", False), (128, 1, 4, "tf32x3", False),
                 (64, 1, 4, "tf32x3", True), (128, 1, 4, "tf32x3", True), (64, 2, 4, "tf32x3", True),
                 (64, 1, 4, "ieee", False), (64, 1, 4, "tf32", False)]
        if INTERP:
            cands = [(64, 1, 4, "ieee", False), (64, 2, 4, "ieee", True)]
        rows = []
        if not INTERP:
            compiled = torch.compile(mul_sum)
            for name, fn in (("inductor mul+sum", lambda: compiled(x, w, eps)), ("cuBLAS f32", lambda: reference(x, w, eps))):
                got = fn()
                rows.append((name, bench(fn), (got.double() - want64).abs().max().item()))
        for bk, steps, warps, prec, atomic in cands:
            fn = lambda: proto(x, w, eps, bk, steps, warps, prec, atomic)  # noqa: E731
            got = fn()
            err = (got.double() - want64).abs().max().item()
            t = bench(fn) if not INTERP else float("nan")
            kernel_only = float("nan")
            if not INTERP:
                BM, BN = max(16, triton.next_power_of_2(M)), 32
                splits = triton.cdiv(K, bk * steps)
                part = torch.zeros(splits, BM, BN, device=dev)
                ss = torch.zeros(splits, BM, device=dev)
                kernel_only = bench(lambda: _proj_partials[(splits,)](
                    x, w, part, ss, M, K, N, x.stride(0), w.stride(0), BM=BM, BN=BN, BK=bk, STEPS=steps,
                    PRECISION=prec, ATOMIC=False, num_warps=warps))
            rows.append((f"split-K bk{bk} steps{steps} w{warps} {prec} {'atomic' if atomic else 'partials+sum'}",
                         t, err, kernel_only))
        scale = want64.abs().max().item()
        for r in rows:
            print(f"M={M} {r[0]}: {r[1]:.2f} us" + (f" (kernel alone {r[3]:.2f})" if len(r) > 3 else "")
                  + f", max err {r[2]:.2e} (|out| max {scale:.2e})", flush=True)


if __name__ == '__main__':
    main()
