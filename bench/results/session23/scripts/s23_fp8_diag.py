"""One FP8-row variant on one case, in its own process: check against the reference, then 20 graph replays
(CUDA_LAUNCH_BLOCKING=1 in the caller) and the replay time. argv: module (head | tree), config, case."""
import sys

import torch
import triton

sys.path.insert(0, "bench")
sys.path.insert(0, "tmp_gpu")
import bench_sparse_mla as b  # noqa: E402

dev = torch.device("cuda")
mod_name, cfg_name, case_name = sys.argv[1:4]
if mod_name == "head":
    import smla_head as mod  # noqa: E402
else:
    from dsv4_compile.kernels import sparse_mla as mod  # noqa: E402
CFGS = {"default": None, "32/32/8w": (32, 32, 8, 1, 0), "16/32/8w cap128": (16, 32, 8, 1, 128)}
CASES = {"hca1": ("hca", 1024, 1), "csa1": ("csa", 512, 1), "csa4": ("csa", 512, 4), "hca4": ("hca", 1024, 4)}
layer, extra, T = CASES[case_name]
args = b.make_inputs(b.Case("x", 64, T, 64, layer, "fp8", extra), dev)
out = torch.full_like(args[0], float("nan"))
spec = CFGS[cfg_name]
if spec is None:
    launches = mod.plan_sparse_mla(*args, out=out)
else:
    h, n, w, st, cap = spec
    ntot = args[3].shape[2] + args[6].shape[2]
    ns = mod.split_count(64 * T * triton.cdiv(64, h), ntot, dev)
    launches = mod.plan_sparse_mla(*args, out=out, config=mod.LaunchConfig(h, 0, n, ns, w, st, False, True))
    if cap:
        launches[0].meta["maxnreg"] = cap


def run():
    for l in launches:
        l.kernel[l.grid](*l.args, **l.meta)


run()
torch.cuda.synchronize()
ref = mod.sparse_mla_reference(*args).float()
err = float((out.float() - ref).abs().max())
ok = bool(torch.allclose(out.float(), ref, atol=4e-2, rtol=2e-2))
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    with torch.cuda.graph(g):
        run()
torch.cuda.current_stream().wait_stream(s)
for _ in range(20):
    g.replay()
torch.cuda.synchronize()
us = triton.testing.do_bench(g.replay, warmup=3, rep=20, return_mode="median") * 1e3
print(f"{mod_name:4s} {cfg_name:16s} {case_name}: correct {ok} (max err {err:.3g}), grid {launches[0].grid}, "
      f"{len(launches)} launches, {us:.1f} us", flush=True)
