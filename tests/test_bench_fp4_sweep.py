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
