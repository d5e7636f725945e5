"""Sparse MLA at B=64, H=64, bf16 rows: register caps that fit more programs an SM (16 warps an SM
instead of 8 on the H200; on sm_120 two 50 KB programs instead of one 84 KB program).

Each variant is checked against the reference, then the variants are timed alternating over rounds
(CUDA graphs of 10 back-to-back launches, do_bench median per round, median over rounds).
"""
import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, "bench")
import bench_sparse_mla as b  # noqa: E402
from dsv4_compile.kernels import sparse_mla as sm  # noqa: E402

dev = torch.device("cuda")
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
# (h_block, block_n, warps, stages, q_in_loop, splits: None = heuristic)
# (h_block, block_n, warps, stages, register cap (0: none), splits: None = heuristic)
CFGS = {
    "default": None,
    "16/32/4w/2s cap128": (16, 32, 4, 2, 128, 1),
    "16/32/4w/2s cap168": (16, 32, 4, 2, 168, 1),
    "16/32/8w/2s": (16, 32, 8, 2, 0, 1),
    "16/32/4w/3s cap128": (16, 32, 4, 3, 128, 1),
    "16/16/4w/3s cap128": (16, 16, 4, 3, 128, 1),
    "32/32/8w/2s cap128": (32, 32, 8, 2, 128, 1),
    "16/64/4w/2s cap168": (16, 64, 4, 2, 168, 1),
}


def e2e_layer(kind, ctx=512, B=64, H=64, D=512, T=1):
    gen = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(B, T, H, D, device=dev, generator=gen).to(torch.bfloat16)
    sink = torch.randn(H, device=dev, generator=gen)
    ring = 128
    window = torch.randn(B * ring, D, device=dev, generator=gen).to(torch.bfloat16)
    idx = (torch.arange(B, device=dev).view(B, 1, 1) * ring + torch.arange(ring, device=dev)).to(torch.int32)
    idx = idx.expand(B, T, ring).contiguous()
    if kind == "sliding":
        return (q, window, None, idx, None, None, None, sink, D ** -0.5)
    if kind == "csa":
        stride, width, valid = max(4096, ctx // 4), 512, min(ctx // 4, 512)
    else:
        stride, width, valid = 8192, 8192, ctx // 128
    entries = torch.randn(B * stride, D, device=dev, generator=gen).to(torch.bfloat16)
    pos = torch.arange(width, device=dev).view(1, 1, -1)
    if kind == "csa":
        perm = torch.rand(B, T, max(valid, 1), device=dev, generator=gen).argsort(-1)
        slots = torch.full((B, T, width), -1, device=dev, dtype=torch.int64)
        slots[..., :valid] = perm[..., :valid] * (ctx // 4 // max(valid, 1))
    else:
        slots = torch.where(pos < valid, pos, -1).expand(B, T, width)
    base = torch.arange(B, device=dev).view(B, 1, 1) * stride
    eidx = torch.where(slots >= 0, base + slots, -1).to(torch.int32)
    return (q, window, None, idx, entries, None, eidx, sink, D ** -0.5)


def launches_for(name, args):
    q = args[0]
    out = torch.empty_like(q)
    if CFGS[name] is None:
        return out, sm.plan_sparse_mla(*args, out=out)
    h, n, w, st, cap, splits = CFGS[name]
    B, T, H, D = q.shape
    ntot = args[3].shape[2] + (args[6].shape[2] if args[6] is not None else 0)
    programs = B * T * triton.cdiv(H, h)
    ns = splits if splits is not None else sm.split_count(programs, ntot, dev)
    cfg = sm.LaunchConfig(h, 0, n, ns, w, st, True, True)
    launches = sm.plan_sparse_mla(*args, out=out, config=cfg)
    if cap:
        launches[0].meta["maxnreg"] = cap
    return out, launches


def graph_of(all_launches, reps=10):
    def fn():
        for launches in all_launches:
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


if __name__ == "__main__":
    CASES = {
        "CSA T=1 (bench)": [b.make_inputs(b.Case("csa-bf16", 64, 1, 64, "csa", "bf16", 512), dev)],
        "CSA T=4 (bench)": [b.make_inputs(b.Case("csa-bf16", 64, 4, 64, "csa", "bf16", 512), dev)],
        "HCA T=1 (bench 128K)": [b.make_inputs(b.Case("hca-bf16", 64, 1, 64, "hca", "bf16", 1024), dev)],
        "e2e ctx512 four layers": [e2e_layer(k) for k in ("sliding", "csa", "hca", "csa")],
    }


    t0 = time.time()
    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()} rounds {ROUNDS}", flush=True)
    for case, layer_args in CASES.items():
        refs = [sm.sparse_mla_reference(*a).float() for a in layer_args]
        graphs, info = {}, {}
        for name in CFGS:
            try:
                per = [launches_for(name, a) for a in layer_args]
                for (out, launches), a, ref in zip(per, layer_args, refs):
                    out.fill_(float("nan"))
                    compiled = None
                    for l in launches:
                        c = l.kernel[l.grid](*l.args, **l.meta)
                        compiled = compiled or c
                    torch.cuda.synchronize()
                    err = float((out.float() - ref).abs().max())
                    if not torch.allclose(out.float(), ref, atol=4e-2, rtol=2e-2):
                        raise RuntimeError(f"wrong: max err {err}")
                l0 = per[0][1][0]
                info[name] = (f"regs {compiled.n_regs} spill {compiled.n_spills} shared {compiled.metadata.shared} "
                              f"grid {l0.grid} err {err:.3g}")
                graphs[name] = graph_of([p[1] for p in per])
            except Exception as e:  # noqa: BLE001
                info[name] = f"FAILED {str(e)[:150]}"
        times = {n: [] for n in graphs}
        for _ in range(ROUNDS):
            for n, g in graphs.items():
                times[n].append(triton.testing.do_bench(g.replay, warmup=3, rep=15, return_mode="median") * 1e3 / 10)
        base = statistics.median(times["default"]) if "default" in times else float("nan")
        print(f"\n## {case}", flush=True)
        for n in CFGS:
            if n in times:
                m = statistics.median(times[n])
                print(f"{n:24s} {m:8.2f} us  ({m - base:+7.2f})  min {min(times[n]):7.2f}  {info[n]}", flush=True)
            else:
                print(f"{n:24s} {info[n]}", flush=True)
    print(f"\nwall {time.time() - t0:.0f} s", flush=True)
