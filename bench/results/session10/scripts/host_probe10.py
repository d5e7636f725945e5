"""Host time of Engine.step on host inputs (session 10): where it goes, at B=1 and B=64."""
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
    ids_h = torch.randint(0, 1000, (B, 1))
    start_h = torch.full((B,), 512, dtype=torch.int64)
    rows_h = torch.arange(B, dtype=torch.int64)
    ids, start, rows = (t.to(dev) for t in (ids_h, start_h, rows_h))
    t0 = time.perf_counter(); engine.step(ids_h, start_h, rows_h); torch.cuda.synchronize()
    print(f"B={B} compile {time.perf_counter()-t0:.1f}s", flush=True)
    for _ in range(5):
        engine.step(ids_h, start_h, rows_h)
    @torch.no_grad()
    def direct():
        torch.compiler.cudagraph_mark_step_begin()
        return engine.compiled_step(ids, start, rows)
    def lay():
        return check_step_inputs(ids_h, start_h, rows_h, max_batch=engine.layout.max_batch, step_tokens=engine.layout.step_tokens,
                                 max_context=engine.layout.max_context, vocab_size=engine.vocab_size, device=engine.device)
    res = {}
    res["do_bench engine.step host inputs"] = triton.testing.do_bench(lambda: engine.step(ids_h, start_h, rows_h), rep=300, return_mode="median") * 1e3
    res["do_bench compiled_step"] = triton.testing.do_bench(direct, rep=300, return_mode="median") * 1e3
    torch.cuda.synchronize(); s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    for name, fn in (("back-to-back engine.step host inputs", lambda: engine.step(ids_h, start_h, rows_h)), ("back-to-back compiled_step", direct)):
        torch.cuda.synchronize(); t = time.perf_counter(); s.record()
        for _ in range(50):
            fn()
        e.record(); host = (time.perf_counter() - t) * 1e6 / 50; torch.cuda.synchronize()
        res[name + " (GPU per call)"] = s.elapsed_time(e) * 1e3 / 50
        res[name + " (host per call, enqueue)"] = host
    def host(fn, n=50):
        ts = []
        for _ in range(n):
            torch.cuda.synchronize(); t = time.perf_counter(); fn(); ts.append((time.perf_counter() - t) * 1e6)
        return statistics.median(ts)
    res["host idle: check (host values)"] = host(lay)
    res["host idle: _to_device"] = host(lambda: engine._to_device(ids_h, start_h, rows_h))
    res["host idle: compiled_step"] = host(direct)
    res["host idle: engine.step host inputs"] = host(lambda: engine.step(ids_h, start_h, rows_h))
    res["host idle: engine.step GPU inputs"] = host(lambda: engine.step(ids, start, rows))
    for k, v in res.items():
        print(f"B={B} {k}: {v:.1f} us", flush=True)
    pr = cProfile.Profile()
    for _ in range(50):
        pr.enable(); engine.step(ids_h, start_h, rows_h); pr.disable()
    torch.cuda.synchronize()
    sio = io.StringIO(); pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(20); print(sio.getvalue()[:5000])
    del engine
    torch.cuda.empty_cache()
