"""hc_sinkhorn at the step's sizes: the op's kernel vs layout / division variants (graph replay)."""
import torch, triton, triton.language as tl
from dsv4_compile.kernels.hc_sinkhorn import hc_sinkhorn_reference, hc_sinkhorn_triton

@triton.jit
def _sk_var(comb_ptr, out_ptr, M, eps, N: tl.constexpr, ITERS: tl.constexpr, BLOCK_M: tl.constexpr, RECIP: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    i = tl.arange(0, N)
    offsets = m[:, None, None].to(tl.int64) * (N * N) + i[None, :, None] * N + i[None, None, :]
    mask = (m < M)[:, None, None]
    x = tl.load(comb_ptr + offsets, mask=mask, other=1.0)
    if RECIP:
        x = x * tl.div_rn(1.0, tl.sum(x, axis=1, keep_dims=True) + eps)
        for _ in range(ITERS - 1):
            x = x * tl.div_rn(1.0, tl.sum(x, axis=2, keep_dims=True) + eps)
            x = x * tl.div_rn(1.0, tl.sum(x, axis=1, keep_dims=True) + eps)
    else:
        x = tl.div_rn(x, tl.sum(x, axis=1, keep_dims=True) + eps)
        for _ in range(ITERS - 1):
            x = tl.div_rn(x, tl.sum(x, axis=2, keep_dims=True) + eps)
            x = tl.div_rn(x, tl.sum(x, axis=1, keep_dims=True) + eps)
    tl.store(out_ptr + offsets, x, mask=mask)

for M in (1, 64, 256):
    comb = torch.softmax(torch.randn(M, 4, 4, device="cuda"), -1) + 1e-6
    want = hc_sinkhorn_reference(comb, 20, 1e-6)
    out = torch.empty_like(comb)
    t = triton.testing.do_bench_cudagraph(lambda: hc_sinkhorn_triton(comb, 20, 1e-6, out=out), rep=50, return_mode="median") * 1e3
    print(f"M={M}: op kernel {t:.2f} us  err {(out - want).abs().max().item():.2e}")
    for bm, w, recip in [(32, 4, False), (32, 1, False), (8, 1, False), (1, 1, False), (32, 1, True), (8, 1, True), (1, 1, True)]:
        bm = min(bm, triton.next_power_of_2(M))
        f = lambda: _sk_var[(triton.cdiv(M, bm),)](comb, out, M, 1e-6, N=4, ITERS=20, BLOCK_M=bm, RECIP=recip, num_warps=w)
        out.fill_(float("nan")); f(); torch.cuda.synchronize()
        err = (out - want).abs().max().item()
        t = triton.testing.do_bench_cudagraph(f, rep=50, return_mode="median") * 1e3
        print(f"   block_m={bm} warps={w} recip={recip}: {t:.2f} us  err {err:.2e}")
