"""Paired H200 timing of the indexer scoring kernel's epilogue variants (tmp_gpu/idx_study/idx_variant.py)
against the original `_score_pages_kernel` (dsv4_compile.kernels.indexer_topk).

Run from the repository root:
    PYTHONPATH=$PWD python tmp_gpu/idx_study/time_variants.py [--rounds 30] [--variants a,b,...]

Inputs: bench/bench_indexer.py's make_inputs at B=64, context 128K (lens 32,768 slots, 512 pages a
request), max context 1M (4,097 page-table columns), H=64, D=128, fp8 q and keys, f32 key scales,
topk 512, T in {1, 4}; default launch config (splits, warps, stages, register cap) for both.

1. Check: each variant's workspace (NaN-poisoned before the launch) against the original kernel's on
   the valid slots (s < lens[b, t]): max abs diff, and max diff / max |score| of the row. Exact
   variants (same f32 math; only the fp8 MMA shape or the f32 summation order may change) must be
   within 1e-5 of the row's largest |score| (expected 0: same per-thread order); mma_sum rounds the
   weighted terms to bf16 (reported, expected ~1e-3 relative, not asserted); abl_* are ablations
   with wrong scores (diff reported only). Slots past lens must stay NaN.
2. Time: one CUDA graph per kernel (one launch each); per round, in a rotating order, every graph is
   replayed once right after writing a 256 MB buffer (L2 flushed), timed by CUDA events around the
   replay alone. --rounds rounds; medians and the paired difference (variant - original, same
   round) with its 25-75% range. Prints one line per variant.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

if "--cpu-smoke" in sys.argv:  # the checks only, in the interpreter, tiny sizes
    os.environ["TRITON_INTERPRET"] = "1"

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "bench")]

import torch  # noqa: E402

import bench_indexer as bi  # noqa: E402
import idx_variant as iv  # noqa: E402
from dsv4_compile.kernels import indexer_topk as orig  # noqa: E402

B, CONTEXT, H, D, TOPK = 64, 131072, 64, 128, 512
MAX_PAGES = math.ceil(262_208 / bi.PAGE)  # 4097: 1M tokens of context, as bench_indexer
DEFAULT = {
    4: ["copy", "asm_store", "pair_dots", "pair_dots_asm", "token_dots", "mma_sum",
        "abl_norelu", "abl_dotonly"],
    # at T=1 (BLOCK_T=1) pair_dots / token_dots compile to the same kernel as copy
    1: ["copy", "asm_store", "mma_sum", "abl_norelu", "abl_dotonly"],
}
EXACT_TOL = 1e-5  # of the row's largest |score|


def build(tokens, device, batch=B, context=CONTEXT):
    gen = torch.Generator(device=device).manual_seed(0)
    return bi.make_inputs(batch, context, tokens, H, D, MAX_PAGES, torch.float8_e4m3fn, device, gen)


def check(tokens, names, dev, batch=B, context=CONTEXT):
    """Builds the inputs, launches the original and every variant once (compiling them) and
    checks the variants' workspaces; returns (inputs, launch fns, workspaces, info)."""
    inputs = build(tokens, dev, batch, context)
    lens = inputs[5]
    slots = MAX_PAGES * bi.PAGE
    valid = torch.arange(slots, device=dev) < lens[..., None]
    ws_ref = torch.full((batch, tokens, slots), float("nan"), device=dev)
    ws_var = torch.full_like(ws_ref, float("nan"))
    launch = {"orig": lambda ws=ws_ref: orig.indexer_scores_triton(*inputs, TOPK, workspace=ws)}
    for name in names:
        launch[name] = (lambda ws=ws_var, e=iv.VARIANTS[name]:
                        iv.indexer_scores_triton(*inputs, TOPK, workspace=ws, epi=e))
    _, k0 = launch["orig"]()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    ref = ws_ref[valid]
    assert bool(torch.isfinite(ref).all()), "original kernel left a valid slot unwritten"
    row_max = ws_ref.masked_fill(~valid, 0).abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    row_max = row_max.expand_as(ws_ref)[valid]
    info = {"orig": dict(regs=getattr(k0, "n_regs", "-"), spills=getattr(k0, "n_spills", "-"),
                         check="reference")}
    for name in names:
        ws_var.fill_(float("nan"))
        _, k = launch[name]()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        diff = (ws_var[valid] - ref).abs()
        dmax = diff.max().item() if diff.numel() else 0.0
        rel = (diff / row_max).max().item() if diff.numel() else 0.0
        untouched = bool(torch.isnan(ws_var[~valid]).all())
        finite = bool(torch.isfinite(ws_var[valid]).all())
        if name in iv.EXACT:
            verdict = "OK" if untouched and finite and rel <= EXACT_TOL else "FAIL"
        elif name.startswith("mma_sum"):
            verdict = "bf16 (inexact)" if untouched and finite else "FAIL"
        else:
            verdict = "ablation (wrong by design)" if untouched else "FAIL (writes past lens)"
        info[name] = dict(regs=getattr(k, "n_regs", "-"), spills=getattr(k, "n_spills", "-"),
                          check=f"max|d| {dmax:.3g}, /rowmax {rel:.2g}, {verdict}")
    return inputs, launch, (ws_ref, ws_var, valid), info


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--variants", default=None, help="comma list (default: per T, DEFAULT)")
    parser.add_argument("--tokens", default="4,1")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="no GPU: run the checks only, interpreter, B=2, context 4096")
    args = parser.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]

    if args.cpu_smoke:
        for tokens in token_counts:
            names = args.variants.split(",") if args.variants else DEFAULT[tokens]
            *_, info = check(tokens, names, torch.device("cpu"), batch=2, context=4096)
            for name, row in info.items():
                print(f"[cpu-smoke T={tokens}] {name:14s} {row['check']}", flush=True)
        return 0

    if not torch.cuda.is_available():
        small = build(token_counts[0], torch.device("cpu"), batch=2)
        print("no CUDA: built CPU inputs at B=2 to check the builder:",
              [(tuple(t.shape), str(t.dtype)) for t in small], "lens", small[5].tolist())
        print("variants:", {t: DEFAULT[t] for t in token_counts}, "known:", list(iv.VARIANTS))
        return 0

    dev = torch.device("cuda")
    t_start = time.perf_counter()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}; B={B} ctx={CONTEXT} H={H} D={D} fp8, "
          f"max_pages={MAX_PAGES}, topk={TOPK}, rounds={args.rounds}", flush=True)
    flush = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device=dev)  # 256 MB
    for tokens in token_counts:
        names = args.variants.split(",") if args.variants else DEFAULT[tokens]
        inputs, launch, (ws_ref, ws_var, valid), info = check(tokens, names, dev)
        print(f"[T={tokens}] checks done ({time.perf_counter() - t_start:.0f} s)", flush=True)

        # 2. graphs
        graphs = {}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for name, fn in launch.items():
                fn()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=stream):
                    fn()
                graphs[name] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        order = list(graphs)
        for name in order:  # warm
            for _ in range(2):
                graphs[name].replay()
        torch.cuda.synchronize()
        times = {name: [] for name in order}
        for r in range(args.rounds):
            rot = order[r % len(order):] + order[:r % len(order)]
            events = []
            for name in rot:
                flush.fill_(r)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                graphs[name].replay()
                e1.record()
                events.append((name, e0, e1))
            torch.cuda.synchronize()
            for name, e0, e1 in events:
                times[name].append(e0.elapsed_time(e1) * 1e3)
        base = times["orig"]
        med0 = statistics.median(base)
        print(f"[T={tokens}] orig: median {med0:.1f} us (min {min(base):.1f}), regs "
              f"{info['orig']['regs']}, spills {info['orig']['spills']}")
        for name in names:
            ts = times[name]
            d = sorted(t - b for t, b in zip(ts, base))
            q1, q3 = d[len(d) // 4], d[(3 * len(d)) // 4]
            md = statistics.median(d)
            print(f"[T={tokens}] {name:14s} median {statistics.median(ts):7.1f} us | paired "
                  f"d {md:+7.1f} us ({100 * md / med0:+5.1f}%) [25-75%: {q1:+.1f}, {q3:+.1f}] | "
                  f"regs {info[name]['regs']} spills {info[name]['spills']} | "
                  f"{info[name]['check']}", flush=True)
        del graphs, inputs, ws_ref, ws_var, valid
        torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
