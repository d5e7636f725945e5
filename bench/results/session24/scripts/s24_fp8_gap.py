"""Session 24: FP8 rows on grids of 8-128 programs at 16 heads (pick_config's "fp8" / "fp8_wide" threshold,
2 x programs16 >= SMs): the 16-head tile against the 32-head one, each with the split count pick_config would
give its own grid. Every variant checked against the reference; CUDA graphs of 10 launches, variants
alternating over ROUNDS rounds (do_bench median per round), medians and paired differences (us a launch)."""
import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, "bench")
import bench_sparse_mla as b  # noqa: E402
from dsv4_compile.kernels import sparse_mla as sm  # noqa: E402

dev = torch.device("cuda")
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 7


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


def config_for(key, args):
    """pick_config's LaunchConfig had it chosen `key`."""
    h_block, block_dv, block_n, warps, stages, max_splits, asm, halves = sm.DEFAULT_TILES[key]
    B, T, H, _ = args[0].shape
    ntot = args[3].shape[2] + (args[6].shape[2] if args[6] is not None else 0)
    ns = sm.split_count(B * T * triton.cdiv(H, h_block), ntot, dev, None, max_splits or None)
    return sm.LaunchConfig(h_block, block_dv, block_n, ns, warps, stages, asm, halves)


def main():
    cases = [("csa", 1, b_) for b_ in (2, 4, 8, 12, 16, 20, 24, 32)] + [("csa", 2, b_) for b_ in (4, 8, 12)] + \
            [("csa", 4, b_) for b_ in (2, 4)] + [("hca", 1, b_) for b_ in (8, 16, 24)]
    t0 = time.time()
    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()} "
          f"SMs {torch.cuda.get_device_properties(0).multi_processor_count} rounds {ROUNDS}", flush=True)
    for layer, tokens, batch in cases:
        args = b.make_inputs(b.Case(layer, batch, tokens, 64, layer, "fp8", 512 if layer == "csa" else 1024), dev)
        ref = sm.sparse_mla_reference(*args).float()
        picked = sm.pick_config(batch, tokens, 64, 512, args[3].shape[2] + args[6].shape[2], dev, fp8_rows=True)
        graphs, info, alive = {}, {}, {}
        for key in ("fp8", "fp8_wide"):
            cfg = config_for(key, args)
            out = torch.empty_like(args[0])
            launches = sm.plan_sparse_mla(*args, out=out, config=cfg)
            out.fill_(float("nan"))
            for l in launches:
                l.kernel[l.grid](*l.args, **l.meta)
            torch.cuda.synchronize()
            err = float((out.float() - ref).abs().max())
            assert torch.allclose(out.float(), ref, atol=4e-2, rtol=2e-2), (layer, tokens, batch, key, err)
            info[key] = f"{cfg.h_block} heads, {cfg.num_splits} splits, grid {launches[0].grid}, err {err:.2g}"
            graphs[key] = graph_of(launches)
            alive[key] = (out, launches)  # the graph replays write out and the split workspaces
        times = {k: [] for k in graphs}
        for _ in range(ROUNDS):
            for k, g in graphs.items():
                times[k].append(triton.testing.do_bench(g.replay, warmup=3, rep=15, return_mode="median") * 1e3 / 10)
        m16, m32 = statistics.median(times["fp8"]), statistics.median(times["fp8_wide"])
        d = statistics.median(y - x for x, y in zip(times["fp8"], times["fp8_wide"]))
        programs16 = batch * tokens * 4
        print(f"{layer} T={tokens} B={batch:3d} programs16 {programs16:4d}: 16 heads {m16:7.1f} us | 32 heads "
              f"{m32:7.1f} us | paired {d:+6.1f} | picked {picked.h_block} heads | {info['fp8']} | {info['fp8_wide']}",
              flush=True)
    print(f"wall {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
