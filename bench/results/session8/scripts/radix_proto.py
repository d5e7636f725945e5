"""Prototype: the whole-row radix select (topk_select._finish_kernel with no candidate list) as the
indexer's only select kernel, vs the chunked select, on the scoring kernel's real workspace."""
import sys, torch, triton
sys.path.insert(0, "bench")
import bench_indexer as bi
from dsv4_compile.kernels import topk_select as ts
from dsv4_compile.kernels.indexer_topk import indexer_scores_triton
gen = torch.Generator(device="cuda").manual_seed(0)

def check(out, ws, lens, topk):
    B, T, _ = out.shape
    for b in range(B):
        for t in range(T):
            n = int(lens[b, t]); row = out[b, t]
            k = min(n, topk)
            assert bool((row[k:] == -1).all()) and bool((row[:k] >= 0).all()) and bool((row[:k] < n).all())
            assert row[:k].unique().numel() == k
            got = ws[b, t][row[:k].long()].sort(descending=True).values
            want = ws[b, t, :n].topk(k).values
            assert torch.equal(got, want), (b, t)

def replay_us(fn):
    fn(); torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3

for B, ctx, T in [(64, 8192, 1), (64, 131072, 1), (64, 131072, 4), (16, 1048576, 1)]:
    inputs = bi.make_inputs(B, ctx, T, 64, 128, 4097, torch.float8_e4m3fn, "cuda", gen)
    lens = inputs[5]
    ws, _ = indexer_scores_triton(*inputs, 512)
    torch.cuda.synchronize()
    rows, S = B * T, ws.shape[-1]
    out = torch.empty((B, T, 512), dtype=torch.int32, device="cuda")
    out.fill_(-7); ts.select_topk_triton(ws, lens, 512, out); torch.cuda.synchronize(); check(out, ws, lens, 512)
    t_old = replay_us(lambda: ts.select_topk_triton(ws, lens, 512, out))
    print(f"B={B} ctx={ctx} T={T}: chunked select {t_old:.1f} us", flush=True)
    cand = torch.empty(1, dtype=torch.float32, device="cuda"); cand_slot = torch.empty(1, dtype=torch.int32, device="cuda")
    meta = torch.tensor([-1, 0], dtype=torch.int32, device="cuda").repeat(rows, 1).contiguous()
    for block, warps in [(8192, 8), (8192, 16), (16384, 16), (32768, 16), (32768, 32)]:
        launch = lambda: ts._finish_kernel[(rows,)](ws, lens, out, cand, cand_slot, meta, T, S, 1,
                                                    *lens.stride(), TOPK=512, BLOCK=block, num_warps=warps)
        try:
            out.fill_(-7); k = launch(); torch.cuda.synchronize(); check(out, ws, lens, 512)
            t = replay_us(launch)
            print(f"   whole-row radix BLOCK={block} warps={warps}: {t:.1f} us  regs {k.n_regs} spills {k.n_spills}", flush=True)
        except Exception as e:
            print(f"   whole-row radix BLOCK={block} warps={warps}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    del ws, inputs
    torch.cuda.empty_cache()
