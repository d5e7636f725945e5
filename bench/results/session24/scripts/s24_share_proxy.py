"""Session 24: would a program that serves the T tokens of a request from one gathered tile (M = T x heads) be
faster at T=4? Proxy with HEAD's kernel: HCA at 128K (1,024 c128 entries + window), B=64, one token whose 256
heads stand for 4 tokens x 64 heads with the same rows, tiles of 16 / 32 / 64 heads a program, against the real
T=4, H=64 case at its default. CUDA graphs of 10 launches, alternating rounds, us a launch."""
import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, "bench")
sys.path.insert(0, "tmp_gpu")
import bench_sparse_mla as b  # noqa: E402
from dsv4_compile.kernels import sparse_mla as sm  # noqa: E402
from s24_fp8_gap import graph_of  # noqa: E402

dev = torch.device("cuda")
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5


def main():
    t0 = time.time()
    cases = {
        "T=4 H=64 (real)": (b.Case("h", 64, 4, 64, "hca", "bf16", 1024), [None]),
        "T=1 H=64": (b.Case("h", 64, 1, 64, "hca", "bf16", 1024), [None]),
        "T=1 H=256 (proxy)": (b.Case("h", 64, 1, 256, "hca", "bf16", 1024), [
            None,
            sm.LaunchConfig(16, 0, 64, 1, 4, 2, True, True),
            sm.LaunchConfig(32, 0, 32, 1, 4, 2, True, True),
            sm.LaunchConfig(32, 0, 64, 1, 8, 2, True, True),
            sm.LaunchConfig(64, 0, 32, 1, 8, 2, True, True),
            sm.LaunchConfig(64, 0, 16, 1, 8, 2, True, True),
            sm.LaunchConfig(64, 0, 32, 1, 8, 3, True, True),
            sm.LaunchConfig(64, 0, 32, 1, 16, 2, True, True),
        ]),
    }
    for name, (case, cfgs) in cases.items():
        args = b.make_inputs(case, dev)
        ref = sm.sparse_mla_reference(*args).float()
        graphs, info, alive = {}, {}, {}
        for i, cfg in enumerate(cfgs):
            out = torch.empty_like(args[0])
            try:
                launches = sm.plan_sparse_mla(*args, out=out, config=cfg)
                out.fill_(float("nan"))
                cs = [l.kernel[l.grid](*l.args, **l.meta) for l in launches]
                torch.cuda.synchronize()
                err = float((out.float() - ref).abs().max())
                assert torch.allclose(out.float(), ref, atol=4e-2, rtol=2e-2), err
                c = cs[0]
                label = "default" if cfg is None else f"{cfg.h_block}h/{cfg.block_n}r/{cfg.num_warps}w/{cfg.num_stages}s"
                info[label] = f"regs {c.n_regs} spill {c.n_spills} shared {c.metadata.shared} grid {launches[0].grid}"
                graphs[label] = graph_of(launches)
                alive[label] = (out, launches)
            except Exception as e:  # noqa: BLE001
                print(f"{name} {cfg}: FAILED {str(e)[:300]}", flush=True)
        times = {k: [] for k in graphs}
        for _ in range(ROUNDS):
            for k, g in graphs.items():
                times[k].append(triton.testing.do_bench(g.replay, warmup=3, rep=15, return_mode="median") * 1e3 / 10)
        for k in graphs:
            print(f"{name:18s} {k:18s} {statistics.median(times[k]):8.1f} us  {info[k]}", flush=True)
    print(f"wall {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
