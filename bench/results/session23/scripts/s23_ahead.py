"""HEAD's sparse MLA (tmp_gpu/smla_head.py) against the tree's (index loads two tiles ahead), paired.

Default configs of each module (pick_config), every case checked against the reference first;
CUDA graphs of 10 back-to-back launches, alternating modules over ROUNDS rounds, medians.
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
from s23_smla import e2e_layer, graph_of  # noqa: E402

dev = torch.device("cuda")
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 7
MODS = {"head": smla_head, "ahead": sm}
CASES = {
    "CSA bf16 B=64 T=1": [b.make_inputs(b.Case("c", 64, 1, 64, "csa", "bf16", 512), dev)],
    "CSA bf16 B=64 T=2": [b.make_inputs(b.Case("c", 64, 2, 64, "csa", "bf16", 512), dev)],
    "CSA bf16 B=64 T=4": [b.make_inputs(b.Case("c", 64, 4, 64, "csa", "bf16", 512), dev)],
    "HCA bf16 B=64 T=1": [b.make_inputs(b.Case("h", 64, 1, 64, "hca", "bf16", 1024), dev)],
    "HCA bf16 B=64 T=4": [b.make_inputs(b.Case("h", 64, 4, 64, "hca", "bf16", 1024), dev)],
    "CSA fp8 B=64 T=1": [b.make_inputs(b.Case("c", 64, 1, 64, "csa", "fp8", 512), dev)],
    "CSA fp8 B=64 T=4": [b.make_inputs(b.Case("c", 64, 4, 64, "csa", "fp8", 512), dev)],
    "CSA bf16 B=16 T=1": [b.make_inputs(b.Case("c", 16, 1, 64, "csa", "bf16", 512), dev)],
    "CSA bf16 B=1 T=1": [b.make_inputs(b.Case("c", 1, 1, 64, "csa", "bf16", 512), dev)],
    "CSA bf16 B=64 T=1 H=16": [b.make_inputs(b.Case("c", 64, 1, 16, "csa", "bf16", 512), dev)],
    "e2e ctx512 four layers": [e2e_layer(k) for k in ("sliding", "csa", "hca", "csa")],
    "e2e ctx512 four layers T=4": [e2e_layer(k, T=4) for k in ("sliding", "csa", "hca", "csa")],
    "FlashMLA cfg bf16": [b.make_inputs(b.Case("f", 128, 2, 128, "topk", "bf16", 2048, window=0), dev)],
}

t0 = time.time()
print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()} rounds {ROUNDS}", flush=True)
for case, layer_args in CASES.items():
    refs = [sm.sparse_mla_reference(*a).float() for a in layer_args]
    graphs, info = {}, {}
    for name, mod in MODS.items():
        per = []
        for a, ref in zip(layer_args, refs):
            out = torch.full_like(a[0], float("nan"))
            launches = mod.plan_sparse_mla(*a, out=out)
            cs = [l.kernel[l.grid](*l.args, **l.meta) for l in launches]
            torch.cuda.synchronize()
            err = float((out.float() - ref).abs().max())
            assert torch.allclose(out.float(), ref, atol=4e-2, rtol=2e-2), (case, name, err)
            per.append(launches)
        c = cs[0]
        info[name] = f"regs {c.n_regs} spill {c.n_spills} shared {c.metadata.shared} grid {per[0][0].grid} err {err:.3g}"
        graphs[name] = graph_of(per)
    times = {n: [] for n in graphs}
    for _ in range(ROUNDS):
        for n, g in graphs.items():
            times[n].append(triton.testing.do_bench(g.replay, warmup=3, rep=15, return_mode="median") * 1e3 / 10)
    h, a = statistics.median(times["head"]), statistics.median(times["ahead"])
    diffs = sorted(y - x for x, y in zip(times["head"], times["ahead"]))
    print(f"{case:30s} head {h:8.2f}  ahead {a:8.2f}  diff {a - h:+7.2f} (paired {diffs[0]:+.2f}..{diffs[-1]:+.2f})"
          f"  | head {info['head']} | ahead {info['ahead']}", flush=True)
print(f"wall {time.time() - t0:.0f} s", flush=True)
