"""bench/bench_fp4_moe.py --sweep on CPU (interpreter, tiny experts): every candidate is checked against
the reference, the correct ones are timed paired against the default, and the table has their rows."""
import dataclasses

import torch

from helpers import bench_module


def test_sweep_case_times_correct_candidates_paired_against_the_default():
    bench = bench_module("bench_fp4_moe")
    moe = bench.moe
    cfg = dict(E=8, K=64, I=32, k=2)
    tokens = 4
    default = moe.choose_config(tokens * cfg["k"], cfg["E"], "mxfp4")
    other = dataclasses.replace(default, block_n=2 * default.block_n)
    short_steps = moe.TileConfig("mma", 8, 16, 32, num_warps=1)
    gen = torch.Generator().manual_seed(3)
    w = bench.random_experts("mxfp4", cfg["E"], cfg["K"], cfg["I"], "cpu", gen)
    rows = bench.sweep_case("mxfp4", tokens, cfg, w, 2, "cpu", gen, [other, default, short_steps])
    assert [r["default"] for r in rows] == [False, True, False]
    for row in rows:
        assert row["correct"], row
        assert len(row["paired_quartiles_ms"]) == 2 and row["ms"] > 0 and row["hbm_fraction"] > 0
    reference = [r for r in rows if r["paired_reference"]]
    assert len(reference) == 1 and reference[0]["default"] and reference[0]["paired_ms"] == 0.0
    table = bench.sweep_markdown(rows, dict(date="d", torch="t", triton="tr", device="cpu", command="c"))
    assert table.count("| mxfp4 | 4 |") == 3 and "reference" in table


def test_replays_changed_counts_runs_that_differ_from_the_first():
    """The sweep's race check: further runs whose output differs bit for bit from the first run's (the
    output poisoned before each) are counted; a run that writes the same values every time counts none."""
    bench = bench_module("bench_fp4_moe")
    out = torch.empty(64)
    values = torch.randn(64, generator=torch.Generator().manual_seed(5))
    runs = []

    def steady():
        out.copy_(values)

    def racy():  # every third run writes one element wrong
        runs.append(None)
        out.copy_(values)
        if len(runs) % 3 == 0:
            out[7] = float("nan")

    steady.output = racy.output = out
    assert bench.replays_changed(steady, 12) == 0
    assert bench.replays_changed(racy, 12) == 4  # runs 3, 6, 9, 12 of 13 differ from run 1
