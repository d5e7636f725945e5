"""Sparse MLA: loads issued by hand one tile ahead (prefetch) against the defaults, bf16 and FP8 rows.

Every variant checked against the reference; CUDA graphs of 10 launches, variants alternating over
ROUNDS rounds (do_bench median per round), medians; registers / spills / shared of the compiled kernel.
"""
import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, "bench")
sys.path.insert(0, "tmp_gpu")
import bench_sparse_mla as b  # noqa: E402
from dsv4_compile.kernels import sparse_mla as sm  # noqa: E402
from s23_smla import e2e_layer, graph_of  # noqa: E402

dev = torch.device("cuda")
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
# name -> (h_block, block_n, warps, prefetch) or None for pick_config's default
CFGS = {
    "default": None,
    "pf 16/16/4w": (16, 16, 4, True),
    "pf 16/32/4w": (16, 32, 4, True),
    "pf 16/32/8w": (16, 32, 8, True),
    "pf 16/64/8w": (16, 64, 8, True),
    "pf 32/32/8w": (32, 32, 8, True),
}


def launches_for(name, args):
    out = torch.empty_like(args[0])
    if CFGS[name] is None:
        return out, sm.plan_sparse_mla(*args, out=out)
    h, n, w, pf = CFGS[name]
    B, T, H, D = args[0].shape
    ntot = args[3].shape[2] + (args[6].shape[2] if args[6] is not None else 0)
    ns = sm.split_count(B * T * triton.cdiv(H, h), ntot, dev)
    cfg = sm.LaunchConfig(h, 0, n, ns, w, 1, True, True, pf)
    return out, sm.plan_sparse_mla(*args, out=out, config=cfg)


def main():
    cases = {}
    for fmt in ("fp8", "bf16"):
        cases[f"CSA {fmt} B=64 T=1"] = [b.make_inputs(b.Case("c", 64, 1, 64, "csa", fmt, 512), dev)]
        cases[f"CSA {fmt} B=64 T=4"] = [b.make_inputs(b.Case("c", 64, 4, 64, "csa", fmt, 512), dev)]
        cases[f"HCA {fmt} B=64 T=1"] = [b.make_inputs(b.Case("h", 64, 1, 64, "hca", fmt, 1024), dev)]
        cases[f"CSA {fmt} B=1 T=1"] = [b.make_inputs(b.Case("c", 1, 1, 64, "csa", fmt, 512), dev)]
        cases[f"CSA {fmt} B=16 T=2"] = [b.make_inputs(b.Case("c", 16, 2, 64, "csa", fmt, 512), dev)]
    cases["e2e ctx512 four layers bf16"] = [e2e_layer(k) for k in ("sliding", "csa", "hca", "csa")]
    t0 = time.time()
    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()} rounds {ROUNDS}", flush=True)
    for case, layer_args in cases.items():
        refs = [sm.sparse_mla_reference(*a).float() for a in layer_args]
        graphs, info = {}, {}
        for name in CFGS:
            try:
                per = [launches_for(name, a) for a in layer_args]
                for (out, launches), ref in zip(per, refs):
                    out.fill_(float("nan"))
                    cs = [l.kernel[l.grid](*l.args, **l.meta) for l in launches]
                    torch.cuda.synchronize()
                    err = float((out.float() - ref).abs().max())
                    if not torch.allclose(out.float(), ref, atol=4e-2, rtol=2e-2):
                        raise RuntimeError(f"wrong: max err {err}")
                c = cs[0]
                info[name] = (f"regs {c.n_regs} spill {c.n_spills} shared {c.metadata.shared} "
                              f"grid {per[0][1][0].grid} err {err:.3g}")
                graphs[name] = graph_of([p[1] for p in per])
            except Exception as e:  # noqa: BLE001
                info[name] = f"FAILED {str(e)[:200]}"
        times = {n: [] for n in graphs}
        for _ in range(ROUNDS):
            for n, g in graphs.items():
                times[n].append(triton.testing.do_bench(g.replay, warmup=3, rep=15, return_mode="median") * 1e3 / 10)
        base = statistics.median(times["default"])
        print(f"\n## {case}", flush=True)
        for n in CFGS:
            if n in times:
                m = statistics.median(times[n])
                d = sorted(y - x for x, y in zip(times["default"], times[n]))
                print(f"{n:14s} {m:8.2f} us ({m - base:+8.2f}; paired {d[0]:+.2f}..{d[-1]:+.2f})  {info[n]}", flush=True)
            else:
                print(f"{n:14s} {info[n]}", flush=True)
    print(f"\nwall {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
