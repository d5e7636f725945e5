"""Per-kernel device time of the indexer op's CUDA-graph replay, B=64, fp8 keys, max ctx 1M."""
import sys, torch, triton
sys.path.insert(0, "bench")
import bench_indexer as bi
from dsv4_compile.kernels.indexer_topk import indexer_topk_triton
from torch.profiler import profile, ProfilerActivity
gen = torch.Generator(device="cuda").manual_seed(0)
for ctx, T, kw in [(512, 1, {}), (131072, 1, {}), (131072, 1, dict(fuse_stats=True)), (131072, 4, {}),
                   (131072, 1, dict(select_programs=8)), (131072, 1, dict(chunk=4096))]:
    inputs = bi.make_inputs(64, ctx, T, 64, 128, 4097, torch.float8_e4m3fn, "cuda", gen)
    out = torch.empty((64, T, 512), dtype=torch.int32, device="cuda")
    ws = torch.empty((64, T, 4097 * 64), dtype=torch.float32, device="cuda")
    fn = lambda: indexer_topk_triton(*inputs, 512, out=out, workspace=ws, **kw)
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            fn()
    torch.cuda.synchronize()
    t = triton.testing.do_bench(g.replay, rep=200) * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(20): g.replay()
        torch.cuda.synchronize()
    print(f"== ctx={ctx} T={T} {kw}: do_bench {t:.1f} us")
    tot = 0
    for e in sorted(p.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total > 0:
            per = e.device_time_total / 20; tot += per
            print(f"   {e.key[:60]:60s} {per:8.1f} us  x{e.count/20:.0f}")
    print(f"   sum {tot:.1f} us")
