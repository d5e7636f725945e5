"""Session 26: sparse MLA with each tile's global loads issued together.

Variants are whole copies of kernels/sparse_mla.py (tmp_gpu/, loaded beside the package):
  HEAD  the landed kernel (b3e13fa)
  v1    FP8 halves: all of the tile's e4m3 / exponent / rope loads before any dequantisation
  v2    v1 + the next tile's indices loaded at the top of the iteration (both row formats)
  v3    v2 + the tile's exponents in one load, first
  wt    the working tree's package (call 3: FP8 rows staged into bf16 rows where `stages_fp8_rows` says)
  wt-staged  the working tree with staging forced (the bf16 tile's pick_config), for cases over the rule
  wt-rRwW    the working tree with staging programs of R positions on W warps (call 4)
  two   d73b4f0's kernels (tmp_gpu/sparse_mla_two.py, fp8_rows_two.py): one staging launch a pool (call 10)
Each variant's default launch (its own pick_config) is checked against the reference, then timed:
CUDA graphs of 10 launches (outputs and workspaces kept alive), variants alternating over ROUNDS
rounds, do_bench medians, paired differences against HEAD."""
import importlib.util
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import triton

sys.path.insert(0, "bench")
import bench_sparse_mla as b  # noqa: E402
from dsv4_compile.kernels import fp8_rows, sparse_mla as sm  # noqa: E402

STAGE_DEFAULT = (fp8_rows.STAGE_ROWS, fp8_rows.STAGE_WARPS)

dev = torch.device("cuda")
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
NAMES = sys.argv[2].split(",") if len(sys.argv) > 2 else ["head", "v1", "v2", "v3"]


def load_variant(name):
    src = Path(f"tmp_gpu/sparse_mla_{name}.py").read_text()
    src = src[:src.index("# ----------------------------------------------------------------------------- registration")]
    src = src.replace("from ._runtime import triton_runs_on", "from dsv4_compile.kernels._runtime import triton_runs_on")
    rows_src = Path(f"tmp_gpu/fp8_rows_{name}.py")
    if rows_src.exists():  # the variant's own FP8 row module, loaded beside it
        Path(f"/tmp/fp8_rows26_{name}.py").write_text(rows_src.read_text())
        rspec = importlib.util.spec_from_file_location(f"fp8_rows26_{name}", f"/tmp/fp8_rows26_{name}.py")
        rmod = importlib.util.module_from_spec(rspec)
        sys.modules[rspec.name] = rmod
        rspec.loader.exec_module(rmod)
        src = src.replace("from .fp8_rows import", f"from fp8_rows26_{name} import")
    else:
        src = src.replace("from .fp8_rows import", "from dsv4_compile.kernels.fp8_rows import")
    path = Path(f"/tmp/smla26_{name}.py")
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"smla26_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


MODS = {n: sm if n.startswith("wt") else load_variant(n) for n in NAMES}


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


CASES = [("csa", "fp8", 64, 1, 64), ("hca", "fp8", 64, 1, 64), ("csa", "fp8", 64, 4, 64), ("hca", "fp8", 64, 4, 64),
         ("csa", "fp8", 32, 1, 64), ("csa", "fp8", 16, 1, 64), ("csa", "fp8", 8, 1, 64), ("csa", "fp8", 4, 2, 64),
         ("csa", "fp8", 2, 4, 64), ("csa", "fp8", 4, 4, 64), ("csa", "fp8", 1, 4, 64), ("csa", "fp8", 4, 1, 64),
         ("csa", "fp8", 64, 1, 16), ("csa", "fp8", 64, 1, 32), ("hca", "fp8", 16, 4, 64), ("topk", "fp8", 128, 2, 128),
         ("csa", "bf16", 64, 1, 64), ("csa", "bf16", 1, 1, 64)]
BOUNDARY = [("csa", "fp8", 64, 1, 32), ("csa", "fp8", 64, 4, 32), ("hca", "fp8", 64, 1, 32), ("csa", "fp8", 16, 1, 32),
            ("csa", "fp8", 64, 1, 16), ("csa", "fp8", 1, 4, 64), ("csa", "fp8", 4, 1, 64), ("csa", "fp8", 2, 2, 64),
            ("csa", "fp8", 6, 1, 64), ("csa", "fp8", 3, 2, 64), ("hca", "fp8", 1, 4, 64), ("csa", "fp8", 64, 1, 48)]
SMALL = [("csa", "fp8", 1, 1, 64), ("csa", "fp8", 2, 1, 64), ("csa", "fp8", 1, 2, 64), ("csa", "fp8", 3, 1, 64),
         ("hca", "fp8", 1, 1, 64), ("csa", "fp8", 1, 1, 32), ("csa", "fp8", 4, 1, 32), ("csa", "fp8", 64, 1, 24),
         ("hca", "fp8", 2, 1, 64), ("csa", "fp8", 8, 1, 32)]
MERGED = [("csa", "fp8", 64, 1, 64), ("hca", "fp8", 64, 1, 64), ("csa", "fp8", 64, 4, 64), ("hca", "fp8", 64, 4, 64),
          ("csa", "fp8", 16, 1, 64), ("csa", "fp8", 8, 1, 64), ("csa", "fp8", 4, 1, 64), ("csa", "fp8", 1, 4, 64),
          ("csa", "fp8", 2, 2, 64), ("csa", "fp8", 1, 1, 64), ("csa", "fp8", 2, 1, 64), ("csa", "fp8", 3, 1, 64),
          ("hca", "fp8", 1, 1, 64), ("csa", "fp8", 8, 1, 32), ("csa", "fp8", 64, 1, 32), ("topk", "fp8", 128, 2, 128)]
EDGES = [("csa", "fp8", 1, 1, 24), ("csa", "fp8", 64, 1, 24), ("csa", "fp8", 4, 1, 32), ("csa", "fp8", 1, 1, 32),
         ("csa", "fp8", 1, 1, 20), ("csa", "fp8", 64, 1, 16), ("csa", "fp8", 1, 1, 16),
         ("hcalong", "fp8", 1, 1, 64), ("hcalong", "fp8", 1, 4, 64), ("hcalong", "fp8", 16, 1, 64),
         ("hcalong", "fp8", 64, 1, 64), ("csa", "fp8", 2, 1, 48)]
LONG = [("hcalong", "fp8", 8, 1, 64), ("hcalong", "fp8", 16, 1, 64), ("hcalong", "fp8", 24, 1, 64),
        ("hcalong", "fp8", 32, 1, 64), ("hcalong", "fp8", 4, 4, 64), ("hcalong", "fp8", 8, 4, 64),
        ("hcalong", "fp8", 16, 4, 64), ("hcalong", "fp8", 2, 1, 64)]
if len(sys.argv) > 3 and sys.argv[3] == "long":  # call 13: HCA lists over max context 1M by grid size
    CASES = LONG
elif len(sys.argv) > 3 and sys.argv[3] == "edges":  # call 11: heads 16 to 32, HCA lists over max context 1M
    CASES = EDGES
elif len(sys.argv) > 3 and sys.argv[3] == "merged":  # call 10: one staging launch for both pools
    CASES = MERGED
elif len(sys.argv) > 3 and sys.argv[3] == "boundary":  # call 7: the staging rule's edges, 4-position programs
    CASES = BOUNDARY
elif len(sys.argv) > 3 and sys.argv[3] == "small":  # call 8: one to three tokens, 24 and 32 heads
    CASES = SMALL
elif len(sys.argv) > 3:
    CASES = [c for c in CASES if sys.argv[3] in c or (sys.argv[3] == "main" and c[2] * c[3] >= 8 and c[4] >= 64)]


def main():
    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()} rounds {ROUNDS}",
          flush=True)
    keep = []
    t0 = time.time()
    for layer, fmt, bb, tt, hh in CASES:
        extra = {"csa": 512, "hca": 1024, "topk": 2048, "hcalong": 1024}[layer]
        args = b.make_inputs(b.Case("x", bb, tt, hh, layer.replace("long", ""), fmt, extra,
                                    window=0 if layer == "topk" else 128), dev)
        if layer == "hcalong":  # an HCA list over max context 1M (8,192 c128 positions), 1,024 of them valid
            args = list(args)
            args[6] = torch.cat([args[6], torch.full((bb, tt, 7168), -1, dtype=torch.int32, device=dev)], dim=2)
        ref = sm.sparse_mla_reference(*args).float()
        graphs, info = {}, {}
        for name, mod in MODS.items():
            try:
                out = torch.empty_like(args[0])
                config = None
                if name == "wt-staged":
                    B, T, H, D = args[0].shape
                    ntot = args[3].shape[2] + (args[6].shape[2] if args[6] is not None else 0)
                    config = replace(mod.pick_config(B, T, H, D, ntot, dev), stage_fp8=True)
                if name.startswith("wt-r"):
                    r, w = name[4:].split("w")
                    fp8_rows.STAGE_ROWS, fp8_rows.STAGE_WARPS = int(r), int(w)
                launches = mod.plan_sparse_mla(*args, out=out, config=config)
                fp8_rows.STAGE_ROWS, fp8_rows.STAGE_WARPS = STAGE_DEFAULT
                out.fill_(float("nan"))
                cs = [l.kernel[l.grid](*l.args, **l.meta) for l in launches]
                torch.cuda.synchronize()
                err = float((out.float() - ref).abs().max())
                if not torch.allclose(out.float(), ref, atol=4e-2, rtol=2e-2):
                    raise RuntimeError(f"wrong: max err {err}")
                c = cs[0]
                info[name] = (f"regs {c.n_regs} spill {c.n_spills} shared {c.metadata.shared} "
                              f"grid {launches[0].grid} warps {launches[0].meta.get('num_warps')} err {err:.3g}")
                graphs[name] = graph_of(launches)
                keep.append((out, launches))
            except Exception as e:  # noqa: BLE001
                info[name] = f"FAILED {str(e)[:300]}"
        times = {n: [] for n in graphs}
        for _ in range(ROUNDS):
            for n, g in graphs.items():
                times[n].append(triton.testing.do_bench(g.replay, warmup=3, rep=15, return_mode="median") * 1e3 / 10)
        print(f"\n## {layer.upper()} {fmt} B={bb} T={tt} H={hh}", flush=True)
        base = statistics.median(times["head"]) if "head" in times else float("nan")
        for n in MODS:
            if n in times:
                m = statistics.median(times[n])
                d = sorted(y - x for x, y in zip(times["head"], times[n])) if "head" in times else [0.0]
                print(f"{n:6s} {m:9.2f} us ({m - base:+8.2f}; paired {statistics.median(d):+.2f} "
                      f"[{d[0]:+.2f}..{d[-1]:+.2f}])  {info[n]}", flush=True)
            else:
                print(f"{n:6s} {info[n]}", flush=True)
    print(f"\ntotal {time.time() - t0:.0f} s", flush=True)


main()
