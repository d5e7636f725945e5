"""Where the host time of an optimize() step goes (H200): engine.step vs the bare compiled call."""
import cProfile, io, pstats, statistics, sys, time
import torch, triton.testing
sys.path.insert(0, "bench")
import dsv4_compile
from dsv4_compile.validation import check_step_inputs
from bench.slice_model import build_slice

dev = torch.device("cuda")
model = build_slice(dev)
for B in [int(b) for b in sys.argv[1].split(",")]:
    engine = dsv4_compile.optimize(model, max_batch=B, max_context=1 << 20)
    ids = torch.randint(0, 1000, (B, 1), device=dev)
    start = torch.full((B,), 512, dtype=torch.int64, device=dev)
    rows = torch.arange(B, dtype=torch.int64, device=dev)
    t0 = time.perf_counter(); engine.step(ids, start, rows); torch.cuda.synchronize()
    print(f"B={B} compile {time.perf_counter()-t0:.1f}s", flush=True)
    for _ in range(5):
        engine.step(ids, start, rows)
    @torch.no_grad()
    def direct():
        torch.compiler.cudagraph_mark_step_begin()
        return engine.compiled_step(ids, start, rows)
    @torch.no_grad()
    def direct_skip():
        torch.compiler.cudagraph_mark_step_begin()
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return engine.compiled_step(ids, start, rows)
    def lay():
        return check_step_inputs(ids, start, rows, max_batch=engine.layout.max_batch, step_tokens=engine.layout.step_tokens,
                                 max_context=engine.layout.max_context, vocab_size=engine.vocab_size, device=engine.device)
    res = {}
    res["engine.step (do_bench, L2 flush)"] = triton.testing.do_bench(lambda: engine.step(ids, start, rows), rep=300, return_mode="median") * 1e3
    res["compiled_step only (do_bench, L2 flush)"] = triton.testing.do_bench(direct, rep=300, return_mode="median") * 1e3
    # GPU time of one replay: back-to-back calls, no flush, long enough that the host keeps ahead
    torch.cuda.synchronize(); s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(50):
        direct()
    e.record(); torch.cuda.synchronize(); res["back-to-back compiled_step, per call (GPU+host overlap)"] = s.elapsed_time(e) * 1e3 / 50
    def host(fn, n=50):
        ts = []
        for _ in range(n):
            torch.cuda.synchronize(); t = time.perf_counter(); fn(); ts.append((time.perf_counter() - t) * 1e6)
        return statistics.median(ts)
    res["host: check_step_inputs (GPU idle)"] = host(lay)
    res["host: compiled_step call returns (GPU idle)"] = host(direct)
    res["host: compiled_step, guards skipped, returns (GPU idle)"] = host(direct_skip)
    res["host: engine.step returns (GPU idle)"] = host(lambda: engine.step(ids, start, rows))
    out = direct()
    res["host: logits clone"] = host(lambda: out.clone())
    res["host: cudagraph_mark_step_begin"] = host(torch.compiler.cudagraph_mark_step_begin)
    for k, v in res.items():
        print(f"B={B} {k}: {v:.1f} us", flush=True)
    pr = cProfile.Profile()
    for _ in range(100):
        torch.cuda.synchronize()
        pr.enable(); direct(); pr.disable()
    sio = io.StringIO(); pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(25); print(sio.getvalue()[:6000])
    sio = io.StringIO(); pstats.Stats(pr, stream=sio).sort_stats("cumulative").print_stats(30); print(sio.getvalue()[:6000])
    del engine
    torch.cuda.empty_cache()
