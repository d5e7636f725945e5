"""`python -m bench --smoke`: the end-to-end bench's harness on CPU with the tiny model.

Three compiled graphs (torch.compile default at T=1, optimize() at T=1 and T=4, B=2), eager at
B=1 and B=2, contexts 8 and 40. It checks what the harness itself decides: every planned case
ran, the three variants agree and every logit is finite, B=1 equals row 0 of B=2, and the
reports are written. Timings on CPU are not measurements and are not asserted.
"""
import json
from pathlib import Path

import pytest

from helpers import bench_module

ROOT = Path(__file__).resolve().parent.parent


def _from_bench(module: str, name: str):
    return getattr(bench_module(module), name)


def test_smoke_mode_runs_every_case_and_the_variants_agree(tmp_path):
    main = _from_bench("__main__", "main")
    forms = _from_bench("e2e", "OPTIMIZE_FORMS")
    assert main(["--smoke", "--out", str(tmp_path)]) == 0

    results = json.loads((tmp_path / "e2e.json").read_text())
    assert (tmp_path / "e2e.md").read_text().startswith("# End-to-end DeepSeek-V4 step (smoke)")
    cases = results["cases"]
    planned = {(b, t, ctx) for b, t, _ in results["meta"]["groups"] for ctx in results["meta"]["contexts"]}
    assert {(c["B"], c["T"], c["ctx"]) for c in cases} == planned == {
        (b, t, ctx) for b in (1, 2) for t in (1, 4) for ctx in (8, 40)}
    assert not [c for c in cases if "skipped" in c]
    for case in cases:
        assert case["correct"], case
        assert all(check["finite"] for check in case["check"].values())
        assert set(case["us"]) == set(case["check"])
    ran = {(c["B"], c["T"]): set(c["check"]) for c in cases}
    assert ran[(2, 1)] == ran[(2, 4)] == {"eager", "optimize"}
    assert ran[(1, 1)] == ran[(1, 4)] == {"eager"}
    first_context = results["meta"]["contexts"][0]
    for case in cases:  # optimize() is also timed on GPU inputs and as its bare compiled_step (smoke: first context)
        timed_forms = "optimize" in case["us"] and case["ctx"] == first_context
        assert set(case.get("us_forms", {})) == (set(forms) if timed_forms else set()), case
        assert set(case.get("speedup_forms_vs_compile_default", {})) == (
            set(forms) if timed_forms and "compile_default" in case["us"] else set()), case
    for case in cases:
        if case["B"] == 1:  # against row 0 of B=2: the same inputs and state
            assert set(case["batch_consistency"]) == {"eager"} and case["batch_consistency"]["eager"]["ok"], case
        for variant, check in case["check"].items():
            if variant != "eager":
                assert check["against"] == "eager" and check["max_err"] <= results["tolerance"]["max"]
    optimize_graphs = [c for c in results["compile"] if c["variant"] == "optimize"]
    assert [c["T"] for c in optimize_graphs] == [1, 4]
    for graph in optimize_graphs:
        assert graph["status"] == "ok"
        # the hyper head's f32 projection of its RMS-normed streams (K = 4 x 64 = 64 x its 4 columns):
        # skinny_mm at B=2 T=1 (2 rows, fewer than rms_mm takes), rms_mm at T=4 (8 rows); the layers'
        # mHC projections (24 columns) are too short in the smoke model; short_bmm: the two mHC
        # residual mixes (comb^T @ streams, a reduction of 4) of every layer
        head = {"skinny_mm": 1} if graph["T"] == 1 else {"rms_mm": 1}
        assert graph["pass_matches"] == {"indexer": 2, "sparse_mla": 4, "fp4_moe": 4, "moe_route": 3, "hc_sinkhorn": 8,
                                         "short_bmm": 8, **head}
        phases = graph["phases_s"]
        assert {"dynamo total", "tracing", "outside dynamo"} <= set(phases), phases
        assert all(0 <= t <= graph["seconds"] + 0.1 for t in phases.values()), phases
    assert all(c["breakdown"]["optimize"]["kernels"] for c in cases if c["B"] == 2)


def test_groups_run_in_the_order_named_and_unknown_ones_are_refused(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import e2e

    quick = e2e.SUITES["quick"]
    chosen = e2e.select_groups(quick, "1x4, 64x4,1x4")
    assert [(g.batch, g.tokens) for g in chosen.groups] == [(1, 4), (64, 4)]
    assert e2e.select_groups(quick, None) is quick
    try:
        e2e.select_groups(quick, "64x1,16x1")
    except ValueError as exc:
        assert "16x1" in str(exc) and "--quick" in str(exc)
    else:
        raise AssertionError("16x1 is not a --quick group and must be refused")


def test_contexts_keep_the_suite_order_and_unknown_ones_are_refused(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from bench import e2e

    full = e2e.SUITES["full"]
    assert e2e.select_contexts(full, "131072, 512").contexts == (512, 131072)
    assert e2e.select_contexts(full, None) is full
    with pytest.raises(ValueError, match="--contexts"):
        e2e.select_contexts(full, "512,1000")


def test_expert_layouts_switch_between_row_major_and_tiled():
    """The e2e harness runs its baselines on the row-major experts a user's model holds and
    optimize() on the tiled ones: ExpertLayouts keeps both and sets every module to one."""
    ExpertLayouts = _from_bench("slice_model", "ExpertLayouts")
    from dsv4_compile.model.fp4_experts import quantize_experts_, tile_fp4_experts_
    from dsv4_compile.tiny import tiny_model

    model = tiny_model(seed=3, hidden_size=128, moe_intermediate_size=128)
    quantize_experts_(model, "mxfp4")
    layouts = ExpertLayouts(model)
    row_major = [layer.mlp.experts.w13 for layer in model.model.layers]
    assert tile_fp4_experts_(model) == len(row_major)
    layouts.capture_tiled()
    for tiled in (False, True, True, False):
        layouts.use(tiled)
        for layer, original in zip(model.model.layers, row_major):
            experts = layer.mlp.experts
            assert experts.tiled == tiled and experts.w2.ndim == (5 if tiled else 3)
            assert (experts.w13 is original) == (not tiled)


@pytest.mark.parametrize("intervals, busy, span", [
    ([], 0.0, 0.0),
    ([(0.0, 4.0)], 4.0, 4.0),
    ([(5.0, 7.0), (0.0, 2.0)], 4.0, 7.0),  # disjoint, unsorted: 3 idle between them
    ([(0.0, 4.0), (1.0, 2.0), (3.0, 6.0)], 6.0, 6.0),  # nested and overlapping: no idle
    ([(0.0, 1.0), (1.0, 2.0), (2.5, 3.0)], 2.5, 3.0),  # touching, then a 0.5 gap
])
def test_busy_and_span_counts_the_union_of_kernel_intervals(intervals, busy, span):
    assert _from_bench("measure", "busy_and_span")(intervals) == (busy, span)


def test_breakdown_table_reports_gpu_idle_only_where_profiled():
    idle_note = _from_bench("report", "_idle_note")
    assert idle_note({"total_us_per_step": 10.0, "kernels": []}) == ""
    note = idle_note({"gpu_idle_us_per_step": 160.0, "gpu_span_us_per_step": 4120.0})
    assert note == "; in the profiled calls the GPU was idle 160.0 µs of a 4.120 ms span per step"


_SM120_RECOMPILE = """
import sys, torch, triton.language as tl
sys.path[:0] = ["."]  # bench as a package, as `python -m bench` imports it (its __init__ drops "." again)
from bench import kernel_floors
from bench.bench_sparse_mla import compiled_stats, cross_compile, launch_recorder
from dsv4_compile.kernels import indexer_topk as mod
print("module", mod.__file__)
launches = []
mod._score_pages_kernel = launch_recorder(mod._score_pages_kernel, launches)
mod._dot_dtype = lambda q, k_cache: (tl.float8e4nv, None)  # fp8 dots, as on a GPU
mod.device_capability = lambda q: (9, 0)  # planned as on the H200: a register cap of 72
fp8 = torch.float8_e4m3fn
mod.indexer_scores_triton(torch.zeros(64, 1, 64, 128).to(fp8), torch.zeros(64, 1, 64), torch.zeros(8, 64, 128).to(fp8),
                          torch.ones(8, 64), torch.zeros(64, 2048, dtype=torch.int32),
                          torch.full((64, 1), 100, dtype=torch.int32), 512)
launch = launches[0]
launch.meta.update(FOR_LOOPS=True, PIN_IDS=True)
again = kernel_floors.sm120_stats(cross_compile(launch, 90))
direct = compiled_stats(launch, 120)
print(again["regs"], again["spill_stores"], again["shared"], direct["regs"], direct["spill_stores"], direct["shared"])
"""


def test_sm120_recompile_keeps_the_register_cap():
    """kernel_floors.sm120_stats recompiles a kernel compiled for one GPU (here cross-compiled for
    sm_90 with the H200's register cap of 72) for sm_120 with its launch options, the cap included:
    the same registers, spills and shared memory as compiling the launch for sm_120 directly (the
    cap then spills there, which the report shows)."""
    from helpers import run_compiled_script
    from dsv4_compile.kernels import indexer_topk
    [row] = run_compiled_script(_SM120_RECOMPILE, indexer_topk.__file__)
    regs, spills, shared = row[:3]
    assert row[:3] == row[3:]
    assert int(regs) <= 72 and int(spills) > 0 and int(shared) <= 101_376
