"""Indexer scoring at B=64, ctx 128K, T=1: the key reads alone against the scoring kernel and the op.

read_pages: the scoring grid (B, splits), each program walks its pages as the scoring kernel
does (page split, split + splits, ...), loads the 64x128 fp8 key page (as int32 words) and its 64
f32 scales, keeps an xor of the bits (so nothing is dropped) and optionally writes 64 f32 per page
(the scores' bytes). flat_read: the same byte count read contiguously. Timing: CUDA graphs,
do_bench (L2 flushed before each replay), variants alternating over rounds, medians.
"""
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "bench")
import bench_indexer as bi  # noqa: E402
from dsv4_compile.kernels import indexer_topk as it  # noqa: E402

dev = torch.device("cuda")


@triton.jit
def read_pages(k_ptr, ks_ptr, pt_ptr, ws_ptr, out_ptr, n_pages, SPLITS, spt_b, ws_b,
               WRITE: tl.constexpr, STAGES: tl.constexpr):
    b = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, 64)
    cols = tl.arange(0, 32)
    acc = tl.zeros((64, 32), tl.int32)
    sacc = tl.zeros((64,), tl.int32)
    for page in tl.range(split, n_pages, SPLITS, num_stages=STAGES):
        phys = tl.load(pt_ptr + b * spt_b + page).to(tl.int64)
        words = tl.load(k_ptr + phys * 2048 + rows[:, None] * 32 + cols[None, :])
        scale = tl.load(ks_ptr + phys * 64 + rows)
        acc ^= words
        sacc ^= scale.to(tl.int32, bitcast=True)
        if WRITE:
            tl.store(ws_ptr + b * ws_b + page * 64 + rows, tl.sum(words, axis=1).to(tl.float32) * scale)
    tl.store(out_ptr + b * SPLITS + split, tl.sum(tl.sum(acc, axis=1) ^ sacc, axis=0))


@triton.jit
def flat_read(x_ptr, out_ptr, n_words, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.int32)
    for start in tl.range(pid * BLOCK, n_words, tl.num_programs(0) * BLOCK, num_stages=STAGES):
        acc ^= tl.load(x_ptr + start + tl.arange(0, BLOCK), mask=start + tl.arange(0, BLOCK) < n_words, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def chunk_read(x_ptr, out_ptr, words_per_program, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Each program reads its own contiguous run of words_per_program int32 words."""
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * words_per_program
    acc = tl.zeros((BLOCK,), tl.int32)
    for start in tl.range(0, words_per_program, BLOCK, num_stages=STAGES):
        acc ^= tl.load(base + start + tl.arange(0, BLOCK))
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


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


def main(rounds=7):
    B, CTX, T, H, D, MAXP, TOPK = 64, 131072, 1, 64, 128, 4097, 512
    gen = torch.Generator(device=dev).manual_seed(0)
    q, w, kc, ks, pt, lens = bi.make_inputs(B, CTX, T, H, D, MAXP, torch.float8_e4m3fn, dev, gen)
    n_pages = triton.cdiv(int(lens.max()), 64)
    nbytes = B * n_pages * (64 * D + 64 * 4)
    floor_us = nbytes / 4.8e12 * 1e6
    splits = it.default_splits(B, MAXP, dev)
    kw = kc.view(torch.int32)
    ws = torch.empty((B, T, MAXP * 64), dtype=torch.float32, device=dev)
    out = torch.empty((B * splits,), dtype=torch.int32, device=dev)
    pt_sorted = pt.clone()
    pt_sorted[:, :n_pages] = pt[:, :n_pages].sort(dim=1).values
    flat = torch.randint(0, 2**30, (nbytes // 4,), dtype=torch.int32, device=dev, generator=gen)
    fout = torch.empty((132 * 16 + 1,), dtype=torch.int32, device=dev)
    variants = {
        "op (score + select)": lambda: it.indexer_topk_triton(q, w, kc, ks, pt, lens, TOPK, workspace=ws),
        "scoring kernel alone": lambda: it.indexer_scores_triton(q, w, kc, ks, pt, lens, TOPK, workspace=ws),
    }
    for stages in (2, 3, 4):
        variants[f"page reads, {stages} stages"] = (
            lambda s=stages: read_pages[(B, splits)](kw, ks, pt, ws, out, n_pages, splits, pt.stride(0),
                                                     ws.stride(0), WRITE=False, STAGES=s, num_warps=4))
    variants["page reads + 64 f32 writes, 3 stages"] = (
        lambda: read_pages[(B, splits)](kw, ks, pt, ws, out, n_pages, splits, pt.stride(0), ws.stride(0),
                                        WRITE=True, STAGES=3, num_warps=4))
    variants["page reads, pages sorted, 3 stages"] = (
        lambda: read_pages[(B, splits)](kw, ks, pt_sorted, ws, out, n_pages, splits, pt.stride(0),
                                        ws.stride(0), WRITE=False, STAGES=3, num_warps=4))
    for progs in (132 * 4, 132 * 16):
        variants[f"flat read, {progs} programs"] = (
            lambda p=progs: flat_read[(p,)](flat, fout, flat.numel(), BLOCK=2048, STAGES=3, num_warps=4))
    read_bytes = {}
    for progs, block, warps in ((132 * 4, 2048, 4), (132 * 8, 2048, 4), (132 * 4, 4096, 8), (132 * 2, 8192, 8)):
        wpp = flat.numel() // progs // block * block
        name = f"contiguous runs, {progs} x {wpp * 4 // 1024} KB, {warps} warps"
        read_bytes[name] = progs * wpp * 4
        variants[name] = (
            lambda p=progs, bl=block, wa=warps, n=wpp: chunk_read[(p,)](flat, fout, n, BLOCK=bl, STAGES=3, num_warps=wa))
    graphs = {n: graph_of(f) for n, f in variants.items()}
    times = {n: [] for n in graphs}
    for _ in range(rounds):
        for n, g in graphs.items():
            times[n].append(triton.testing.do_bench(g.replay, warmup=5, rep=30, return_mode="median") * 1e3)
    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}")
    print(f"B={B} ctx={CTX} T={T}: {n_pages} pages a request, {nbytes / 1e6:.1f} MB of keys + scales, "
          f"floor {floor_us:.1f} us at 4.8 TB/s; scoring grid ({B}, {splits})")
    for n in graphs:
        m = statistics.median(times[n])
        f_us = read_bytes.get(n, nbytes) / 4.8e12 * 1e6
        print(f"{n:40s} {m:8.2f} us  floor/time {f_us / m:.3f}  (min {min(times[n]):.2f}, max {max(times[n]):.2f})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
