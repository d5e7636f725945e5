"""Session 26 proxy: FP8 rows dequantised into a bf16 staging buffer by one gather kernel, then
HEAD's bf16-row kernel over the staged rows, against HEAD's FP8-row kernel (both correct against the
reference first). CUDA graphs of 10 (staging + attention) launches, alternating rounds, paired."""
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "bench")
import bench_sparse_mla as b  # noqa: E402
from dsv4_compile.kernels import sparse_mla as sm  # noqa: E402

dev = torch.device("cuda")
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5


@triton.jit
def _stage(kv_ptr, rope_ptr, scale_ptr, stride_row, stride_rope_row, stride_scale_row, num_rows,
           idx_ptr, num_idx, out_ptr, out_idx_ptr, out_base,
           HEAD_DIM: tl.constexpr, NOPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    bt = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_list = pos < num_idx
    rows = tl.load(idx_ptr + bt * num_idx + pos, mask=in_list, other=-1)
    ok = (rows >= 0) & (rows < num_rows)
    vals = sm._load_rows(kv_ptr, rope_ptr, scale_ptr, rows.to(tl.int64), ok, 0, stride_row, 1, stride_rope_row,
                         stride_scale_row, HEAD_DIM, NOPE, True, tl.bfloat16, BLOCK_N, BLOCK_D)
    dst = out_base + bt * num_idx + pos
    d = tl.arange(0, BLOCK_D)
    tl.store(out_ptr + dst[:, None] * HEAD_DIM + d[None, :], vals, mask=(ok & in_list)[:, None] & (d < HEAD_DIM)[None, :])
    tl.store(out_idx_ptr + bt * num_idx + pos, tl.where(ok, dst, -1).to(tl.int32), mask=in_list)


def staged_launches(args, stage_rows=32, warps=4):
    q, kv, ks, idx, ekv, eks, eidx, sink, scale = args
    B, T, H, D = q.shape
    n1, n2 = idx.shape[2], (eidx.shape[2] if eidx is not None else 0)
    buf = torch.empty(B * T * (n1 + n2), D, device=dev, dtype=torch.bfloat16)
    sidx = torch.empty_like(idx)
    seidx = torch.empty_like(eidx) if eidx is not None else None
    launches = []
    for pool, scales, lst, out_idx, base in ((kv, ks, idx, sidx, 0), (ekv, eks, eidx, seidx, B * T * n1)):
        if lst is None:
            continue
        a = sm._pool_args(pool, scales, sm._Layout(head_dim=D, nope=D - 64, fp8=True, has_extra=True))
        grid = (B * T, triton.cdiv(lst.shape[2], stage_rows))
        launches.append(sm.KernelLaunch(_stage, grid, (a[0], a[1], a[2], a[3], a[5], a[6], a[7], lst.contiguous(),
                                                       lst.shape[2], buf, out_idx, base),
                                        dict(HEAD_DIM=D, NOPE=D - 64, BLOCK_N=stage_rows, BLOCK_D=triton.next_power_of_2(D),
                                             num_warps=warps)))
    out = torch.empty_like(q)
    launches += sm.plan_sparse_mla(q, buf, None, sidx, buf if eidx is not None else None, None, seidx, sink, scale, out=out)
    return out, launches, (buf, sidx, seidx)


def graph_of(launches, reps=10):
    def fn():
        for l in launches:
            l.kernel[l.grid](*l.args, **l.meta)
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
    return g


CASES = [("csa", 64, 1, 64), ("hca", 64, 1, 64), ("csa", 64, 4, 64), ("csa", 16, 1, 64), ("csa", 1, 1, 64),
         ("csa", 1, 4, 64), ("csa", 64, 1, 16), ("hca", 16, 4, 64), ("csa", 32, 1, 64), ("csa", 4, 4, 64)]
keep = []
print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()} rounds {ROUNDS}", flush=True)
for layer, bb, tt, hh in CASES:
    args = b.make_inputs(b.Case("x", bb, tt, hh, layer, "fp8", 512 if layer == "csa" else 1024), dev)
    ref = sm.sparse_mla_reference(*args).float()
    variants = {}
    out = torch.empty_like(args[0])
    variants["fp8 kernel"] = (out, sm.plan_sparse_mla(*args, out=out), None)
    for rows, w in ((32, 4), (16, 4), (64, 8)):
        variants[f"staged {rows}r {w}w"] = staged_launches(args, rows, w)
    graphs, info = {}, {}
    for name, (o, launches, extra) in variants.items():
        o.fill_(float("nan"))
        for l in launches:
            l.kernel[l.grid](*l.args, **l.meta)
        torch.cuda.synchronize()
        err = float((o.float() - ref).abs().max())
        assert torch.allclose(o.float(), ref, atol=4e-2, rtol=2e-2), (name, err)
        info[name] = f"err {err:.3g} launches {len(launches)}"
        graphs[name] = graph_of(launches)
        keep.append((o, launches, extra))
    times = {n: [] for n in graphs}
    stage_only = {}
    for _ in range(ROUNDS):
        for n, g in graphs.items():
            times[n].append(triton.testing.do_bench(g.replay, warmup=3, rep=15, return_mode="median") * 1e3 / 10)
    print(f"\n## FP8 {layer.upper()} B={bb} T={tt} H={hh}", flush=True)
    base = statistics.median(times["fp8 kernel"])
    for n in graphs:
        m = statistics.median(times[n])
        d = sorted(y - x for x, y in zip(times["fp8 kernel"], times[n]))
        print(f"{n:18s} {m:9.2f} us ({m - base:+8.2f}; paired {statistics.median(d):+.2f})  {info[n]}", flush=True)
    # the staging launches alone (32 rows, 4 warps)
    o, launches, extra = variants["staged 32r 4w"]
    g = graph_of([l for l in launches if l.kernel is _stage])
    keep.append(g)
    print(f"{'  staging alone':18s} {triton.testing.do_bench(g.replay, warmup=3, rep=15, return_mode='median') * 1e3 / 10:9.2f} us",
          flush=True)
