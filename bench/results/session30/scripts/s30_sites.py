"""Session 30: do the passes' new checks (sessions 28-29) still match every expected dsv4 site of the
H200's graphs? The full-width 4-layer slice at B in {64, 1} x T in {1, 4}, ctx 512, max context 1M:
optimize() against eager (the e2e bench's groups, baselines other than eager left out), then per group
the expected sites (engine.expected_sites) counted on that group's own pass records, then the sm_120
recompile of every kernel config this process compiled (registers, spills, shared memory).

    python bench/results/session30/scripts/s30_sites.py OUT_DIR BUDGET_S
"""
import sys
import time
from pathlib import Path

started = time.monotonic()
from bench.__main__ import _import_dsv4_compile  # noqa: E402

_import_dsv4_compile()
import torch  # noqa: E402

from bench import e2e, kernel_floors, report  # noqa: E402
from dsv4_compile.passes.report import PassReport  # noqa: E402

out, budget = Path(sys.argv[1]), float(sys.argv[2])
groups = tuple(e2e.Group(b, t, ("eager", "optimize")) for b, t in ((64, 1), (64, 4), (1, 1), (1, 4)))
suite = e2e.Suite("quick", groups, (512,), 64, 1 << 20, e2e.BF16_TOLERANCE, 1, budget)
bench = e2e.E2EBench(suite, out, budget, "s30_sites.py", started)
per_group = []
run_group = bench._run_group


def counted(group):
    before = len(bench.engine.report.records)
    run_group(group)
    mine = PassReport(records=bench.engine.report.records[before:])
    expected = bench.engine.expected_sites()
    for graph in mine.graphs():
        rows = mine.status(expected, graph)
        missed = [r for r in rows if not r.matched]
        per_group.append((group.batch, group.tokens, graph, len(rows) - len(missed), len(rows), missed))


bench._run_group = counted
results = bench.run()
print("\n## expected sites per compiled graph", flush=True)
for batch, tokens, graph, ok, total, missed in per_group:
    print(f"B={batch} T={tokens} graph {graph!r}: {ok} / {total} expected sites matched", flush=True)
    for r in missed:
        print(f"   MISSED {r.pass_name} layer {r.layer}: {r.reason}", flush=True)
print("\n## pass report\n" + results["pass_report"], flush=True)
bench.release()
results["sm120_check"] = kernel_floors.sm120_check(time.monotonic() + 100.0)
report.write_outputs(out, results)
print(report.markdown(results).split("## Compile")[0], flush=True)
print(f"done in {time.monotonic() - started:.0f} s", flush=True)
