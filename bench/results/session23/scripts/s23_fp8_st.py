"""FP8 rows: QK as K q^T (rows on the MMA's M side; the tree) against HEAD's q K^T, and tile configs.

Every variant checked against the reference; CUDA graphs of 10 launches, variants alternating over ROUNDS
rounds (do_bench median per round), medians; registers / spills / shared memory of the compiled kernel.
"""
import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, "bench")
sys.path.insert(0, "tmp_gpu")
import bench_sparse_mla as b  # noqa: E402
import smla_head  # noqa: E402
from dsv4_compile.kernels import sparse_mla as sm  # noqa: E402
from s23_smla import graph_of  # noqa: E402

dev = torch.device("cuda")
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
# name -> (module, (h_block, block_n, warps, stages, idx_asm, register cap) or None for pick_config)
CFGS = {
    "HEAD default": (smla_head, None),
    "tree default (16/32/8w/1s)": (sm, None),
    "tree 16/32/8w/1s cap128": (sm, (16, 32, 8, 1, False, 128)),
    "tree 16/16/8w/1s": (sm, (16, 16, 8, 1, False, 0)),
    "tree 32/32/8w/1s": (sm, (32, 32, 8, 1, False, 0)),
    "tree 16/16/8w/2s asm": (sm, (16, 16, 8, 2, True, 0)),
    "tree 16/32/8w/1s asm": (sm, (16, 32, 8, 1, True, 0)),
}


def launches_for(name, args):
    mod, spec = CFGS[name]
    out = torch.empty_like(args[0])
    if spec is None:
        return out, mod.plan_sparse_mla(*args, out=out)
    h, n, w, st, asm, cap = spec
    B, T, H, D = args[0].shape
    ntot = args[3].shape[2] + (args[6].shape[2] if args[6] is not None else 0)
    ns = mod.split_count(B * T * triton.cdiv(H, h), ntot, dev)
    launches = mod.plan_sparse_mla(*args, out=out, config=mod.LaunchConfig(h, 0, n, ns, w, st, asm, True))
    if cap:
        launches[0].meta["maxnreg"] = cap
    return out, launches


def main():
    cases = {
        "CSA fp8 B=64 T=1": b.make_inputs(b.Case("c", 64, 1, 64, "csa", "fp8", 512), dev),
        "CSA fp8 B=64 T=4": b.make_inputs(b.Case("c", 64, 4, 64, "csa", "fp8", 512), dev),
        "HCA fp8 B=64 T=1": b.make_inputs(b.Case("h", 64, 1, 64, "hca", "fp8", 1024), dev),
        "CSA fp8 B=1 T=1": b.make_inputs(b.Case("c", 1, 1, 64, "csa", "fp8", 512), dev),
        "CSA fp8 B=16 T=2": b.make_inputs(b.Case("c", 16, 2, 64, "csa", "fp8", 512), dev),
        "CSA fp8 B=64 T=1 H=16": b.make_inputs(b.Case("c", 64, 1, 16, "csa", "fp8", 512), dev),
        "FlashMLA cfg fp8": b.make_inputs(b.Case("f", 128, 2, 128, "topk", "fp8", 2048, window=0), dev),
    }
    t0 = time.time()
    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()} rounds {ROUNDS}", flush=True)
    for case, args in cases.items():
        ref = sm.sparse_mla_reference(*args).float()
        graphs, info = {}, {}
        for name in CFGS:
            try:
                out, launches = launches_for(name, args)
                out.fill_(float("nan"))
                cs = [l.kernel[l.grid](*l.args, **l.meta) for l in launches]
                torch.cuda.synchronize()
                err = float((out.float() - ref).abs().max())
                if not torch.allclose(out.float(), ref, atol=4e-2, rtol=2e-2):
                    raise RuntimeError(f"wrong: max err {err}")
                c = cs[0]
                info[name] = (f"regs {c.n_regs} spill {c.n_spills} shared {c.metadata.shared} "
                              f"grid {launches[0].grid} err {err:.3g}")
                graphs[name] = graph_of([launches])
            except Exception as e:  # noqa: BLE001
                info[name] = f"FAILED {str(e)[:200]}"
        times = {n: [] for n in graphs}
        for _ in range(ROUNDS):
            for n, g in graphs.items():
                times[n].append(triton.testing.do_bench(g.replay, warmup=3, rep=15, return_mode="median") * 1e3 / 10)
        base = statistics.median(times["HEAD default"])
        print(f"\n## {case}", flush=True)
        for n in CFGS:
            if n in times:
                m = statistics.median(times[n])
                d = sorted(y - x for x, y in zip(times["HEAD default"], times[n]))
                print(f"{n:28s} {m:9.2f} us ({m - base:+8.2f}; paired {d[0]:+.2f}..{d[-1]:+.2f})  {info[n]}", flush=True)
            else:
                print(f"{n:28s} {info[n]}", flush=True)
    print(f"\nwall {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
