"""Prototype (session 10): split-K kernels for [M, 16384] bf16 @ [16384, N<=32] f32 that accumulate with
register FMAs (no tl.dot: the f32 'ieee' dot of the dropped op goes through shared memory), against
inductor's mul+sum form and cuBLAS. Kernel-only and kernel+sum times, CUDA-graph replays."""
import os, sys, torch, triton, triton.language as tl, triton.testing

@triton.jit
def fma3d(a_ptr, b_ptr, out_ptr, M, K, N, sam, sak, sbk, sbn, CHUNK: tl.constexpr, BM: tl.constexpr,
          BK: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    split = tl.program_id(1)
    cols = tl.arange(0, BN)
    acc = tl.zeros((BM, BK, BN), dtype=tl.float32)
    for k0 in range(0, CHUNK, BK):
        kk = k0 + tl.arange(0, BK)
        k = split * CHUNK + kk
        kok = (k < K) & (kk < CHUNK)
        a = tl.load(a_ptr + rows[:, None] * sam + k[None, :] * sak, mask=(rows < M)[:, None] & kok[None, :], other=0.0).to(tl.float32)
        b = tl.load(b_ptr + k[:, None] * sbk + cols[None, :] * sbn, mask=kok[:, None] & (cols < N)[None, :], other=0.0)
        acc += a[:, :, None] * b[None, :, :]
    part = tl.sum(acc, axis=1)
    tl.store(out_ptr + (split * M + rows[:, None]) * N + cols[None, :], part, mask=(rows < M)[:, None] & (cols < N)[None, :])

@triton.jit
def fma2d(a_ptr, b_ptr, out_ptr, M, K, N, sam, sak, sbk, sbn, CHUNK: tl.constexpr, BM: tl.constexpr,
          BK: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    split = tl.program_id(1)
    cols = tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, CHUNK, BK):
        kk = k0 + tl.arange(0, BK)
        k = split * CHUNK + kk
        kok = (k < K) & (kk < CHUNK)
        a = tl.load(a_ptr + rows[:, None] * sam + k[None, :] * sak, mask=(rows < M)[:, None] & kok[None, :], other=0.0).to(tl.float32)
        b = tl.load(b_ptr + k[:, None] * sbk + cols[None, :] * sbn, mask=kok[:, None] & (cols < N)[None, :], other=0.0)
        acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    tl.store(out_ptr + (split * M + rows[:, None]) * N + cols[None, :], acc, mask=(rows < M)[:, None] & (cols < N)[None, :])

def launch(kernel, a, b, splits, BM, BK, warps, out):
    M, K = a.shape
    N = b.shape[1]
    chunk = -(-K // splits)
    kernel[(triton.cdiv(M, BM), splits)](a, b, out, M, K, N, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                         CHUNK=chunk, BM=BM, BK=BK, BN=max(16, triton.next_power_of_2(N)), num_warps=warps)
    return out

def main(small=False):
    dev = "cpu" if small else "cuda"
    shapes = [(3, 1000, 24), (5, 700, 4)] if small else [(1, 16384, 24), (64, 16384, 24), (256, 16384, 24), (64, 16384, 4)]
    for M, K, N in shapes:
        g = torch.Generator(device=dev).manual_seed(M)
        a = torch.randn(M, K, device=dev, generator=g).bfloat16()
        b = (torch.randn(N, K, device=dev, generator=g) * K ** -0.5).t()
        want = a.double() @ b.double()
        rows = []
        if not small:
            mulsum = torch.compile(lambda a, b: (a.float()[:, :, None] * b[None]).sum(1))
            cublas = torch.compile(lambda a, b: a.float() @ b)
            for name, f in (("inductor mul+sum", mulsum), ("cuBLAS", cublas)):
                err = (f(a, b).double() - want).abs().max().item()
                us = triton.testing.do_bench_cudagraph(lambda: f(a, b), rep=100) * 1e3
                rows.append((us, None, f"{name}: {us:.2f} us (err {err:.1e})"))
        variants = [("fma3d", fma3d, c) for c in ((2, 64, 2), (4, 64, 4), (8, 32, 4), (16, 32, 8))] + \
                   [("fma2d", fma2d, c) for c in ((4, 32, 4), (8, 32, 4))]
        for kname, kernel, (BM, BK, warps) in variants:
                blocks = -(-M // BM)
                for target in ((8,) if small else (256, 512)):
                    splits = 1
                    while splits * 2 * blocks <= target and K // (splits * 2) >= 128:
                        splits *= 2
                    out = torch.full((splits, M, N), float("nan"), device=dev)
                    try:
                        launch(kernel, a, b, splits, BM, BK, warps, out)
                    except Exception as exc:
                        print(f"{kname} BM{BM} BK{BK} w{warps}: {type(exc).__name__} {str(exc)[:100]}"); continue
                    err = (out.sum(0).double() - want).abs().max().item()
                    assert err < 1e-3, (kname, BM, BK, err)
                    if small:
                        print(f"{kname} BM{BM} BK{BK} ok err {err:.1e}"); continue
                    k_us = triton.testing.do_bench_cudagraph(lambda: launch(kernel, a, b, splits, BM, BK, warps, out), rep=100) * 1e3
                    ks_us = triton.testing.do_bench_cudagraph(lambda: launch(kernel, a, b, splits, BM, BK, warps, out).sum(0), rep=100) * 1e3
                    rows.append((ks_us, k_us, f"{kname} BM{BM} BK{BK} warps{warps} splits{splits} ({blocks * splits} programs): kernel {k_us:.2f} us, +sum {ks_us:.2f} us (err {err:.1e})"))
        for r in sorted(rows, key=lambda r: r[0])[:12]:
            print(f"M={M} K={K} N={N} {r[2]}", flush=True)

if __name__ == "__main__":
    main(small=len(sys.argv) > 1 and sys.argv[1] == "cpu")
