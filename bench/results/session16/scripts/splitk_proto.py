"""Prototype: weight-streaming products with split-K (partials summed by torch) and groups, vs cuBLAS, M=64."""
import argparse, json, statistics
import torch, triton, triton.language as tl


@triton.jit
def _ws_kernel(x_ptr, w_ptr, out_ptr, M, N, K: tl.constexpr, SPLIT_K: tl.constexpr,
               sxg, sxm, sxk, swg, swn, swk, sog, sos, som, son,
               BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    KS: tl.constexpr = K // SPLIT_K
    k_lo = split * KS
    w_rows = w_ptr + g * swg + offs_n[:, None].to(tl.int64) * swn + (k_lo + offs_k)[None, :] * swk
    x_cols = x_ptr + g * sxg + offs_m[None, :] * sxm + (k_lo + offs_k)[:, None] * sxk
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, KS, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(w_rows + k0 * swk, mask=n_ok[:, None], other=0.0)
        x = tl.load(x_cols + k0 * sxk, mask=m_ok[None, :], other=0.0)
        acc = tl.dot(w, x, acc)
    out = out_ptr + g * sog + split * sos + offs_m[None, :] * som + offs_n[:, None] * son
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def launch(x, w, bn, bk, st, wp, split):
    """x [G, M, K], w [G, N, K] -> [G, M, N] bf16."""
    G, M, K = x.shape
    N = w.shape[1]
    bm = max(16, triton.next_power_of_2(M))
    if split == 1:
        out = torch.empty(G, 1, M, N, device=x.device, dtype=x.dtype)
    else:
        out = torch.empty(G, split, M, N, device=x.device, dtype=torch.float32)
    _ws_kernel[(triton.cdiv(N, bn), split, G)](x, w, out, M, N, K, split, x.stride(0), x.stride(1), x.stride(2),
        w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk, NUM_STAGES=st, num_warps=wp)
    if split == 1:
        return out[:, 0]
    return out.sum(1).to(x.dtype)


def graph_of(fn, calls):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    return g


def time_paired(graphs, calls, rounds):
    times = {k: [] for k in graphs}
    for _ in range(rounds):
        for k, g in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); g.replay(); b.record(); b.synchronize()
            times[k].append(a.elapsed_time(b) * 1e3 / calls)
    return {k: statistics.median(v) for k, v in times.items()}


SHAPES = {  # name: (G, N, K)
    "o_b": (1, 4096, 8192), "o_a": (8, 1024, 4096), "q_b": (1, 32768, 1024), "idx_q_b": (1, 8192, 1024),
    "shared_gate_up": (1, 4096, 4096), "shared_down": (1, 4096, 2048), "attn_in_csa": (1, 3072, 4096),
}


def main():
    p = argparse.ArgumentParser(); p.add_argument("--rounds", type=int, default=20); p.add_argument("--out")
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    M = 64
    for name, (G, N, K) in SHAPES.items():
        wbytes = G * N * K * 2
        copies = max(2, (512 << 20) // wbytes)
        ws = [torch.randn(G, N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(G, M, K, device="cuda", dtype=torch.bfloat16)
        ref = torch.bmm(x.float(), ws[0].float().transpose(1, 2))
        calls = copies * max(1, 32 // copies)
        if G == 1:
            variants = {"cublas": lambda i: torch.mm(x[0], ws[i % copies][0].t())}
        else:
            variants = {"cublas": lambda i: torch.bmm(x, ws[i % copies].transpose(1, 2))}
        errs = {}
        for bn in (64, 128):
            for split in (1, 2, 4, 8):
                if K // split < 256 or K % (split * 128):
                    continue
                for (bk, st, wp) in ((128, 2, 4), (64, 4, 4)):
                    tag = f"bn{bn}_bk{bk}_s{st}_split{split}"
                    try:
                        got = launch(x, ws[0], bn, bk, st, wp, split)
                        torch.cuda.synchronize()
                    except Exception as e:
                        print(name, tag, "ERR", repr(e)[:150]); continue
                    errs[tag] = ((got.float() - ref).abs().max() / ref.abs().max()).item()
                    variants[tag] = (lambda bn, bk, st, wp, split: lambda i: launch(x, ws[i % copies], bn, bk, st, wp, split))(bn, bk, st, wp, split)
        graphs = {k: graph_of(fn, calls) for k, fn in variants.items()}
        med = time_paired(graphs, calls, args.rounds)
        floor = (wbytes + G * M * K * 2 + G * M * N * 2) / 4.8e12 * 1e6
        for k, t in sorted(med.items(), key=lambda kv: kv[1])[:6]:
            row = dict(shape=name, G=G, N=N, K=K, variant=k, us=round(t, 2), hbm=round(floor / t, 3),
                       vs_cublas=round(t - med["cublas"], 2), err=errs.get(k))
            rows.append(row); print(row, flush=True)
        if "cublas" not in [r["variant"] for r in rows if r["shape"] == name]:
            print(dict(shape=name, variant="cublas", us=round(med["cublas"], 2), hbm=round(floor / med["cublas"], 3)))
        del ws, graphs; torch.cuda.empty_cache()
    if args.out:
        json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
