"""Session 27: programmatic dependent launch (PDL) between each op's own kernels as landed, timed paired
against the same kernels launched without it (calls 3 on; s27_pdl_variants.py timed the variants). Each op is captured in a CUDA graph per variant (outputs checked
against the torch reference, and bit for bit between variants), then the graphs are replayed
alternately, each replay after an L2 flush (bench_fp4_moe.paired_times). Sections: moe, indexer, smla."""
import statistics
import sys

import torch
import triton

sys.path.insert(0, "bench")
import bench_fp4_moe as bm  # noqa: E402
import bench_indexer as bi  # noqa: E402
import bench_sparse_mla as bs  # noqa: E402
from dsv4_compile.kernels import _runtime  # noqa: E402
from dsv4_compile.kernels import fp4_moe as moe  # noqa: E402
from dsv4_compile.kernels import indexer_topk as it  # noqa: E402
from dsv4_compile.kernels import moe_pairs  # noqa: E402
from dsv4_compile.kernels import sparse_mla as sm  # noqa: E402

dev = torch.device("cuda")
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 30
PARTS = sys.argv[2].split(",") if len(sys.argv) > 2 else ["moe", "indexer", "smla"]

keep = []


def capture(fn, pdl: bool, l2_tiles: int = 0):
    """(replay, output) of fn captured with PDL on or off (l2_tiles: call 6's experiment, the down
    kernel's L2 prefetch of that many tile columns before its wait)."""
    _runtime.set_pdl(pdl)
    moe._DOWN_L2_TILES = l2_tiles
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn()
    finally:
        _runtime.set_pdl(True)
        moe._DOWN_L2_TILES = 0
    keep.append((g, out, fn))
    return g.replay, out


def report(title, variants, check, rounds=ROUNDS):
    """variants: name -> (replay, out). check(out) raises if wrong; outputs must equal the first's bits."""
    names = list(variants)
    first = None
    for name in names:
        replay, out = variants[name]
        out.view(torch.uint8).fill_(0xFF)  # poison (NaN / -1) before the replay writes it
        replay()
        torch.cuda.synchronize()
        err = check(out)
        same = "" if first is None else ("bit-equal" if torch.equal(out.view(torch.uint8), first.view(torch.uint8))
                                         else "DIFFERS")
        if first is None:
            first = out.clone()
        print(f"  {name:14s} check {err} {same}", flush=True)
    times = bm.paired_times({n: variants[n][0] for n in names}, rounds)
    base = times[names[0]]
    print(f"### {title}", flush=True)
    for n in names:
        us = [1e3 * v for v in times[n]]
        d = sorted(1e3 * (y - x) for x, y in zip(base, times[n]))
        q1, q3 = d[len(d) // 4], d[3 * len(d) // 4]
        print(f"  {n:14s} {statistics.median(us):9.2f} us  paired {statistics.median(d):+7.2f} ({q1:+.2f} / {q3:+.2f})",
              flush=True)


print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()} rounds {ROUNDS}", flush=True)

if "moe" in PARTS:
    gen = torch.Generator(device="cuda").manual_seed(0)
    E, K, I, k = 256, 4096, 2048, 6
    for fmt in ("mxfp4", "nvfp4"):
        w = bm.tiled_experts(bm.random_experts(fmt, E, K, I, "cuda", gen))
        for tokens in (1, 8, 64, 256):
            x = torch.randn(tokens, K, device=dev, generator=gen).to(torch.bfloat16)
            ids = torch.rand(tokens, E, device=dev, generator=gen).topk(k, dim=-1).indices.to(torch.int32)
            wts = torch.rand(tokens, k, device=dev, generator=gen) / k * 1.5
            args = bm.op_args(x, ids, wts, w)
            want = moe.fp4_moe_reference(*args).float()
            scale = want.abs().max().item()

            def op(args=args, ids=ids, x=x):
                pairs = moe.fp4_moe_pairs_triton(*args)
                return moe_pairs.combine_pairs_triton(pairs, ids, E, x.dtype)

            def check(out, want=want, scale=scale):
                err = (out.float() - want).abs().max().item() / scale
                assert err < 3e-2, err  # bf16 activations and output over K, I sums (bench_fp4_moe's bound)
                return f"{err:.2e}"
            cls = moe.size_class(tokens * k, E, fmt)
            variants = {"no pdl": capture(op, False), "pdl": capture(op, True)}
            if "l2" in sys.argv[3:]:
                variants.update({"pdl+l2x4": capture(op, True, 4), "pdl+l2x8": capture(op, True, 8)})
            print(f"\n{fmt} M={tokens} ({cls}), {bm.touched_bytes(ids, w, K) / 1e6:.1f} MB touched", flush=True)
            report(f"MoE {fmt} M={tokens}", variants, check)
        del w
        torch.cuda.empty_cache()

if "indexer" in PARTS:
    gen = torch.Generator(device="cuda").manual_seed(1)
    MAX_PAGES, TOPK = 4097, 512
    for batch, context, tokens in ((64, 131072, 1), (64, 131072, 4), (64, 512, 1), (1, 131072, 1), (16, 8192, 1)):
        inputs = bi.make_inputs(batch, context, tokens, 64, 128, MAX_PAGES, torch.float8_e4m3fn, dev, gen)
        scores = bi.reference_scores(inputs, it)

        def op(inputs=inputs):
            return it.indexer_topk_triton(*inputs, TOPK)[0]

        def check(out, inputs=inputs, scores=scores):
            return f"{bi.check_selection(out, inputs, TOPK, it, torch.float8_e4m3fn, scores):.2e}"
        print(f"\nindexer B={batch} ctx={context} T={tokens}", flush=True)
        variants = {"no pdl": capture(op, False), "pdl": capture(op, True)}
        report(f"indexer B={batch} ctx={context} T={tokens}", variants, check)
        del scores

if "smla" in PARTS:
    for layer, fmt, batch, tokens in (("csa", "bf16", 64, 1), ("csa", "bf16", 1, 1), ("hca", "bf16", 1, 1),
                                      ("csa", "fp8", 64, 1), ("csa", "fp8", 64, 4), ("hca", "fp8", 64, 1),
                                      ("csa", "fp8", 1, 1), ("csa", "fp8", 4, 4)):
        case = bs.Case("x", batch, tokens, 64, layer, fmt, 512 if layer == "csa" else 1024)
        args = bs.make_inputs(case, dev)
        ref = sm.sparse_mla_reference(*args).float()
        plan = sm.plan_sparse_mla(*args, out=torch.empty_like(args[0]))
        kinds = [launch.kernel.fn.__name__ for launch in plan]

        def op(args=args):
            return sm.sparse_mla_triton(*args, validate=False)

        def check(out, ref=ref):
            err = (out.float() - ref).abs().max().item()
            # bf16 output and P; FP8 rows' values reach ~10 (bench_sparse_mla's tolerance)
            assert torch.allclose(out.float(), ref, atol=4e-2, rtol=2e-2), err
            return f"{err:.2e}"
        print(f"\nsparse MLA {fmt} {layer} B={batch} T={tokens}: {kinds}", flush=True)
        variants = {"no pdl": capture(op, False), "pdl": capture(op, True)}
        report(f"sparse MLA {fmt} {layer} B={batch} T={tokens}", variants, check)
