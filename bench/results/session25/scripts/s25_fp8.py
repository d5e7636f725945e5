"""Session 25: what the FP8-row tile of sparse MLA waits on. HEAD's kernel with other launch shapes
(2 stages, a 128-register cap, 4 warps), a variant that loads each element's exponent (no broadcast
reshape), and two ablations that give wrong answers on purpose and are timed only: the e4m3 codes
converted as integers (no fp8 conversion, no exponent), and the exponents not applied.

Variant modules are kernels/sparse_mla.py up to its registration section, with one edit, loaded beside it.
Every non-ablation variant is checked against the reference; CUDA graphs of 10 launches (outputs and
workspaces kept alive), variants alternating over ROUNDS rounds, do_bench medians, paired differences."""
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, "bench")
import bench_sparse_mla as b  # noqa: E402
from dsv4_compile.kernels import sparse_mla as sm  # noqa: E402

dev = torch.device("cuda")
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
SRC = Path(sm.__file__).read_text()
SRC = SRC[:SRC.index("# ----------------------------------------------------------------------------- registration")]
SRC = SRC.replace("from ._runtime import triton_runs_on", "from dsv4_compile.kernels._runtime import triton_runs_on")

DEQUANT = """        mult = tl.exp2(exps.to(tl.float32) - 127.0).to(OUT_DTYPE)
        mult = tl.reshape(tl.broadcast_to(mult[:, :, None], (BLOCK_N, BLOCK_W // 64, 64)), (BLOCK_N, BLOCK_W))
        nope = e4m3.to(OUT_DTYPE) * mult
"""
assert SRC.count(DEQUANT) == 1
EDITS = {
    "exp per element": (
        """        groups = col0 // 64 + tl.arange(0, BLOCK_W // 64)
        exps = tl.load(scale_ptr + rows2 * stride_scale_row + groups[None, :],
                       mask=row_ok[:, None] & (groups[None, :] < NOPE // 64), other=127)
        # e4m3 (4 significant bits) times a power of two is exact in bf16: no f32 tile is needed
""" + DEQUANT,
        """        exps = tl.load(scale_ptr + rows2 * stride_scale_row + d2 // 64, mask=nope_mask, other=127)
        nope = e4m3.to(OUT_DTYPE) * tl.exp2(exps.to(tl.float32) - 127.0).to(OUT_DTYPE)
"""),
    "ABL int codes": (DEQUANT, "        nope = e4m3.to(tl.uint8, bitcast=True).to(OUT_DTYPE)\n"),
    "ABL no exps": (DEQUANT, "        nope = e4m3.to(OUT_DTYPE)\n"),
}


def variant_module(name):
    old, new = EDITS[name]
    assert SRC.count(old) == 1, name
    path = Path(f"/tmp/smla_{abs(hash(name))}.py")
    path.write_text(SRC.replace(old, new))
    spec = importlib.util.spec_from_file_location(f"smla_{abs(hash(name))}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# name -> (module, (h_block, block_n, warps, stages, cap) or None for pick_config's tile)
CFGS = {"HEAD default": (sm, None),
        "HEAD 32h 2 stages": (sm, (32, 32, 8, 2, 0)),
        "HEAD 32h 4 warps": (sm, (32, 32, 4, 1, 0)),
        "HEAD 16h cap 128": (sm, (16, 32, 8, 1, 128)),
        "HEAD 16h 64 rows": (sm, (16, 64, 8, 1, 0))}
MODE = sys.argv[2] if len(sys.argv) > 2 else "variants"
if MODE == "variants":
    for _name in EDITS:
        CFGS[_name] = (variant_module(_name), None)
elif MODE == "splits":  # call 5: split counts of the 4-warp tiles at T=1
    CFGS = {"HEAD default": (sm, None),
            "32h 4w 2 splits": (sm, (32, 32, 4, 1, 0, True, 2)),
            "32h 4w 4 splits": (sm, (32, 32, 4, 1, 0, True, 4)),
            "32h 4w 6 splits": (sm, (32, 32, 4, 1, 0, True, 6)),
            "16h 4w 1 split": (sm, (16, 32, 4, 1, 0, True, 1)),
            "16h 4w 2 splits": (sm, (16, 32, 4, 1, 0, True, 2))}
elif MODE == "h16":  # call 9: the 16-head FP8 tile on 4 warps where it is the default
    CFGS = {"HEAD default": (sm, None),
            "16h 4 warps": (sm, "16h4w")}
elif MODE == "final":  # call 10: the final rule's warps against the other count
    CFGS = {"HEAD default": (sm, None), "4 warps": (sm, "w4"), "8 warps": (sm, "w8")}
elif MODE == "verify":  # call 6: the one-wave split rule against the ceiling, both row formats
    CFGS = {"HEAD default": (sm, None), "ceil splits": (sm, "ceil"), "floor splits": (sm, "floor")}
else:  # call 2: four warps across grids
    CFGS = {"HEAD default": (sm, None),
            "32h 4 warps": (sm, (32, 32, 4, 1, 0)),
            "32h 8 warps": (sm, (32, 32, 8, 1, 0)),
            "16h 4 warps": (sm, (16, 32, 4, 1, 0)),
            "32h 4 warps no halves": (sm, (32, 32, 4, 1, 0, False)),
            "32h 4 warps 16 rows": (sm, (32, 16, 4, 1, 0))}


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


def launches_for(name, args):
    mod, spec = CFGS[name]
    out = torch.empty_like(args[0])
    if spec is None:
        return out, mod.plan_sparse_mla(*args, out=out)
    if isinstance(spec, str):  # pick_config's tile with the split count of one rule
        from dataclasses import replace
        B, T, H, D = args[0].shape
        ntot = args[3].shape[2] + (args[6].shape[2] if args[6] is not None else 0)
        cfg = mod.pick_config(B, T, H, D, ntot, dev, fp8_rows=args[1].dtype == torch.uint8)
        if spec in ("16h4w", "w4", "w8"):
            return out, mod.plan_sparse_mla(*args, out=out, config=replace(cfg, num_warps=8 if spec == "w8" else 4))
        ns = mod.split_count(B * T * triton.cdiv(H, cfg.h_block), ntot, dev, one_wave=spec == "floor")
        return out, mod.plan_sparse_mla(*args, out=out, config=replace(cfg, num_splits=ns))
    h, n, w, st, cap, halves, forced = (*spec, True, None)[:7] if len(spec) == 5 else (*spec, None)[:7]
    B, T, H, _ = args[0].shape
    ntot = args[3].shape[2] + (args[6].shape[2] if args[6] is not None else 0)
    ns = forced or mod.split_count(B * T * triton.cdiv(H, h), ntot, dev)
    launches = mod.plan_sparse_mla(*args, out=out, config=mod.LaunchConfig(h, 0, n, ns, w, st, False, halves))
    if cap:
        launches[0].meta["maxnreg"] = cap
    return out, launches


def main():
    cases = {} if MODE == "variants" else {
        f"{layer.upper()} fp8 B={bb} T={tt} H={hh}": b.make_inputs(b.Case("x", bb, tt, hh, layer, "fp8", 512 if layer == "csa" else 1024), dev)
        for layer, bb, tt, hh in [("csa", 1, 4, 64), ("csa", 2, 2, 64), ("hca", 1, 4, 64), ("csa", 2, 4, 64),
                                  ("csa", 64, 1, 16), ("csa", 16, 1, 16), ("csa", 64, 1, 64), ("csa", 3, 1, 64)]
    } if MODE == "final" else {
        f"{layer.upper()} fp8 B={bb} T={tt} H={hh}": b.make_inputs(b.Case("x", bb, tt, hh, layer, "fp8", 512 if layer == "csa" else 1024), dev)
        for layer, bb, tt, hh in [("csa", 64, 1, 16), ("csa", 64, 4, 16), ("hca", 64, 1, 16), ("hca", 64, 4, 16),
                                  ("csa", 32, 1, 16), ("csa", 16, 1, 16), ("csa", 1, 1, 64), ("csa", 2, 1, 64),
                                  ("csa", 1, 2, 64), ("hca", 1, 1, 64), ("csa", 3, 1, 64), ("csa", 8, 1, 16)]
    } if MODE == "h16" else {
        f"{layer.upper()} {fmt} B={bb} T={tt}": b.make_inputs(b.Case("x", bb, tt, 64, layer, fmt, 512 if layer == "csa" else 1024), dev)
        for layer, fmt, bb, tt in [("csa", "fp8", 64, 1), ("hca", "fp8", 64, 1), ("csa", "fp8", 48, 1), ("csa", "fp8", 32, 1),
                                   ("csa", "fp8", 24, 1), ("csa", "fp8", 16, 1), ("csa", "fp8", 8, 1), ("csa", "fp8", 16, 2),
                                   ("csa", "fp8", 8, 4), ("csa", "fp8", 2, 4), ("hca", "fp8", 16, 1),
                                   ("csa", "bf16", 32, 1), ("csa", "bf16", 16, 1), ("csa", "bf16", 8, 1), ("csa", "bf16", 48, 1),
                                   ("hca", "bf16", 16, 1), ("hca", "bf16", 32, 1), ("csa", "bf16", 8, 2), ("csa", "bf16", 4, 1)]
    } if MODE == "verify" else {
        f"{layer.upper()} fp8 B={bb} T={tt}": b.make_inputs(b.Case("x", bb, tt, 64, layer, "fp8", 512 if layer == "csa" else 1024), dev)
        for layer, bb, tt in [("csa", 64, 1), ("hca", 64, 1), ("csa", 32, 1), ("csa", 48, 1)]} if MODE == "splits" else {
        f"{layer.upper()} fp8 B={bb} T={tt}": b.make_inputs(b.Case("x", bb, tt, 64, layer, "fp8", 512 if layer == "csa" else 1024), dev)
        for layer, bb, tt in [("csa", 64, 2), ("hca", 64, 4), ("csa", 32, 1), ("csa", 32, 4), ("csa", 16, 1),
                              ("csa", 16, 2), ("csa", 16, 4), ("csa", 8, 4), ("csa", 4, 4), ("csa", 64, 1), ("csa", 64, 4)]}
    cases = cases or {
        "CSA fp8 B=64 T=1": b.make_inputs(b.Case("c", 64, 1, 64, "csa", "fp8", 512), dev),
        "HCA fp8 B=64 T=1": b.make_inputs(b.Case("h", 64, 1, 64, "hca", "fp8", 1024), dev),
        "CSA fp8 B=64 T=4": b.make_inputs(b.Case("c", 64, 4, 64, "csa", "fp8", 512), dev),
        "CSA fp8 B=1 T=1": b.make_inputs(b.Case("c", 1, 1, 64, "csa", "fp8", 512), dev),
    }
    t0 = time.time()
    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()} rounds {ROUNDS}", flush=True)
    props = torch.cuda.get_device_properties(dev)
    print({k: getattr(props, k) for k in dir(props) if "shared" in k or "regs" in k or "multi_processor" in k}, flush=True)
    keep = []
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
                if not name.startswith("ABL") and not torch.allclose(out.float(), ref, atol=4e-2, rtol=2e-2):
                    raise RuntimeError(f"wrong: max err {err}")
                c = cs[0]
                info[name] = (f"regs {c.n_regs} spill {c.n_spills} shared {c.metadata.shared} "
                              f"grid {launches[0].grid} err {err:.3g}")
                graphs[name] = graph_of(launches)
                keep.append((out, launches))
            except Exception as e:  # noqa: BLE001
                info[name] = f"FAILED {str(e)[:300]}"
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
                print(f"{n:22s} {m:9.2f} us ({m - base:+8.2f}; paired {d[0]:+.2f}..{d[-1]:+.2f})  {info[n]}", flush=True)
            else:
                print(f"{n:22s} {info[n]}", flush=True)
    print(f"\nwall {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
