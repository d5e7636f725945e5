"""Indexer: the selection of one batch chunk on a side stream while the next chunk is scored.

Variants: chunks C in {1 (the library op's launches), 2, 3, 4}; scoring splits and select programs
sized for the chunk or for the whole batch. Each variant's answers are checked against the torch
reference's top-k scores first; timing: CUDA graphs (side stream captured as a graph branch)
replayed under do_bench (L2 flushed before each replay), variants alternating over ROUNDS.
"""
import math
import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, "bench")
import bench_indexer as bi  # noqa: E402
from dsv4_compile.kernels import indexer_topk as it  # noqa: E402
from dsv4_compile.kernels import topk_select as ts  # noqa: E402

dev = torch.device("cuda")
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 7
TOPK, H, D, MAX_PAGES = 512, 64, 128, 4097
SIDE = torch.cuda.Stream(priority=int(sys.argv[2]) if len(sys.argv) > 2 else 0)
print("side stream priority", SIDE.priority, flush=True)


def chunked(inputs, chunks, size_for_chunk):
    q, w, kc, ks, pt, lens = inputs
    B, T = q.shape[:2]
    out = torch.empty((B, T, TOPK), dtype=torch.int32, device=dev)
    ws = torch.empty((B, T, pt.shape[1] * 64), dtype=torch.float32, device=dev)
    if chunks == 1:
        it.indexer_topk_triton(q, w, kc, ks, pt, lens, TOPK, out=out, workspace=ws)
        return out
    main = torch.cuda.current_stream()
    bounds = [round(B * c / chunks) for c in range(chunks + 1)]
    n_chunks = triton.cdiv(ws.shape[2], ts.DEFAULT_CHUNK)
    for c in range(chunks):
        sl = slice(bounds[c], bounds[c + 1])
        nb = bounds[c + 1] - bounds[c]
        splits = it.default_splits(nb if size_for_chunk else B, MAX_PAGES, dev)
        progs = ts.programs_per_row(nb * T if size_for_chunk else B * T, n_chunks, dev)
        it.indexer_scores_triton(q[sl], w[sl], kc, ks, pt[sl], lens[sl], TOPK, splits=splits, workspace=ws[sl])
        ev = torch.cuda.Event()
        ev.record(main)
        SIDE.wait_event(ev)
        with torch.cuda.stream(SIDE):
            ts.select_topk_triton(ws[sl], lens[sl], TOPK, out[sl], programs=progs)
    main.wait_stream(SIDE)
    return out


VARIANTS = {"op (1 chunk)": (1, True), "2 chunks, chunk-sized": (2, True), "2 chunks, batch-sized": (2, False),
            "3 chunks, chunk-sized": (3, True), "4 chunks, chunk-sized": (4, True),
            "4 chunks, batch-sized": (4, False), "8 chunks, batch-sized": (8, False)}
CASES = [(64, 131072, 1), (64, 131072, 4), (64, 8192, 1)]


def graph_of(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        with torch.cuda.graph(g):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return g


print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()} rounds {ROUNDS}", flush=True)
t0 = time.time()
for B, ctx, T in CASES:
    gen = torch.Generator(device=dev).manual_seed(0)
    inputs = bi.make_inputs(B, ctx, T, H, D, MAX_PAGES, torch.float8_e4m3fn, dev, gen)
    scores = bi.reference_scores(inputs, it)
    graphs = {}
    for name, (c, per_chunk) in VARIANTS.items():
        holder = {}

        def fn(c=c, per_chunk=per_chunk, holder=holder):
            holder["out"] = chunked(inputs, c, per_chunk)
        g = graph_of(fn)
        holder["out"].fill_(-7)
        g.replay()
        torch.cuda.synchronize()
        err = bi.check_selection(holder["out"], inputs, TOPK, it, torch.float8_e4m3fn, scores)
        graphs[name] = g
    times = {n: [] for n in graphs}
    for _ in range(ROUNDS):
        for n, g in graphs.items():
            times[n].append(triton.testing.do_bench(g.replay, warmup=5, rep=30, return_mode="median") * 1e3)
    base = statistics.median(times["op (1 chunk)"])
    print(f"\n## B={B} ctx={ctx} T={T} (all variants checked)", flush=True)
    for n in graphs:
        m = statistics.median(times[n])
        d = sorted(y - x for x, y in zip(times["op (1 chunk)"], times[n]))
        print(f"{n:26s} {m:8.2f} us ({m - base:+7.2f}; paired {d[0]:+.2f}..{d[-1]:+.2f})", flush=True)
print(f"wall {time.time() - t0:.0f} s", flush=True)
