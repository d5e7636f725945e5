"""python -m bench --quick | --full | --smoke [--out DIR] [--budget-s S] [--parts e2e,kernels]

--quick  (H200) the end-to-end slice at B in {64, 1}, T in {1, 4}, ctx 512 / 8K / 128K, max context
         1M; about 500 s (--budget-s), the targets' cases first.
--full   (H200) B in {64, 1, 16}, five contexts up to 512K, then the kernel floor tables
         (bench_indexer, bench_sparse_mla, bench_fp4_moe). The device tool allows 600 s per
         command: split it, e.g. `--full --parts e2e --groups 64x1,64x4`, then
         `--groups 1x1,16x1`, `--groups 1x4,16x4`, and `--full --parts kernels`.
--smoke  (CPU) the tiny model, correctness only; what CI runs (tests/test_bench_smoke.py).

Writes DIR/e2e.json, DIR/e2e.md, PNG plots (with matplotlib) and, with kernels,
DIR/kernel_benches.tar.gz; the e2e tables are rewritten after every case. Run it from the
repository root; dsv4_compile is imported from its installation (`pip install --no-deps
--no-build-isolation -e .`) or PYTHONPATH, else the checkout's folders are mapped into it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    for name in ("quick", "full", "smoke"):
        mode.add_argument(f"--{name}", dest="suite", action="store_const", const=name)
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="output directory")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock cap from start (default: quick 500, full 560, smoke none)")
    parser.add_argument("--parts", default=None,
                        help="comma list of e2e,kernels (default: full both, otherwise e2e)")
    parser.add_argument("--groups", default=None,
                        help="only these (B x T) groups of the mode, run in the order given, e.g. 16x1,16x4 (to split --full over commands)")
    parser.add_argument("--contexts", default=None,
                        help="only these contexts of the mode, e.g. 512,131072 (the first one also times the baselines)")
    args = parser.parse_args(argv)
    parts = args.parts or ("e2e,kernels" if args.suite == "full" else "e2e")
    args.parts = [p.strip() for p in parts.split(",") if p.strip()]
    unknown = set(args.parts) - {"e2e", "kernels"}
    if unknown:
        parser.error(f"--parts takes e2e and/or kernels; got {sorted(unknown)}")
    return args


def _import_dsv4_compile() -> None:
    """dsv4_compile installed (pip install -e .) or on PYTHONPATH; else the checkout's folders
    mapped into a package, as bench_fp4_moe does on import."""
    try:
        import dsv4_compile.kernels  # noqa: F401
    except ImportError:
        import bench.bench_fp4_moe  # noqa: F401  (its import builds the mapping)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.suite == "smoke":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels import
    _import_dsv4_compile()
    import torch

    from bench import e2e, kernel_floors, report

    try:
        suite = e2e.select_contexts(e2e.select_groups(e2e.SUITES[args.suite], args.groups), args.contexts)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    budget_s = suite.default_budget_s if args.budget_s is None else args.budget_s
    command = "python -m bench " + " ".join(sys.argv[1:] if argv is None else argv)
    results = None
    if "e2e" in args.parts:
        results = e2e.run_suite(suite, args.out, budget_s, command, started)
    if "kernels" in args.parts:
        if results is None:
            results = report.new_results(suite, command, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        results["kernel_benches"] = kernel_floors.run_kernel_benches(args.out, started + budget_s,
                                                                     smoke=args.suite == "smoke")
    if torch.cuda.is_available() and args.suite != "smoke":
        results["sm120_check"] = kernel_floors.sm120_check(max(started + budget_s, time.monotonic() + 30.0))
    results["plots"] = report.write_plots(args.out, results) if results["cases"] else []
    report.write_outputs(args.out, results)
    print(report.markdown(results).split("## Compile")[0], flush=True)
    print(f"wrote {args.out}/e2e.md and e2e.json in {time.monotonic() - started:.0f} s", flush=True)
    if results.get("error"):
        print("the end-to-end run stopped on an error (traceback above and in e2e.json)", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
