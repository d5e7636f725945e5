"""bench/paired_step.py: variant parsing, the paired statistics, and a smoke run on CPU (tiny model)."""
import dataclasses
import json

import pytest

from dsv4_compile.kernels import fp4_moe
from helpers import bench_module


def test_parse_variant_replaces_fields_of_one_size_class():
    module = bench_module("paired_step")
    defaults = dict(fp4_moe.DEFAULT_CONFIGS)
    assert module.parse_variant("base", defaults) == module.Variant("base", {}, {})
    variant = module.parse_variant("nocaps: mma.max_regs=0; mma.down_max_regs=0;mma_token.block_n=32", defaults)
    assert variant.label == "nocaps" and set(variant.configs) == {"mma", "mma_token"} and variant.inductor == {}
    assert variant.configs["mma"] == dataclasses.replace(defaults["mma"], max_regs=0, down_max_regs=0)
    assert variant.configs["mma_token"] == dataclasses.replace(defaults["mma_token"], block_n=32)
    assert fp4_moe.DEFAULT_CONFIGS == defaults  # parsing changes nothing


def test_parse_variant_takes_inductor_options():
    """`inductor.<option>` (dotted options too) goes to the variant's inductor options, beside size
    class fields; the names are checked against the installed inductor's config."""
    module = bench_module("paired_step")
    variant = module.parse_variant("x: inductor.combo_kernels=True; inductor.triton.autotune_pointwise=True;"
                                   "mma.max_regs=0", dict(fp4_moe.DEFAULT_CONFIGS))
    assert variant.inductor == {"combo_kernels": True, "triton.autotune_pointwise": True}
    assert set(variant.configs) == {"mma"}
    assert "inductor.combo_kernels=True" in variant.describe()


def test_parse_variant_leaves_passes_out():
    module = bench_module("paired_step")
    variant = module.parse_variant("cublas_head: passes.weight_stream_mm=False", dict(fp4_moe.DEFAULT_CONFIGS))
    assert variant.passes_off == ("weight_stream_mm",) and variant.configs == {} and variant.inductor == {}
    assert "passes.weight_stream_mm=False" in variant.describe()


def test_parse_variant_turns_programmatic_dependent_launch_off():
    module = bench_module("paired_step")
    variant = module.parse_variant("nopdl: runtime.pdl=False", dict(fp4_moe.DEFAULT_CONFIGS))
    assert variant.pdl is False and variant.configs == {} and variant.inductor == {} and variant.passes_off == ()
    assert variant.describe() == "runtime.pdl=False"
    assert module.parse_variant("base", dict(fp4_moe.DEFAULT_CONFIGS)).pdl is True


@pytest.mark.parametrize("spec, match", [
    (":mma.max_regs=0", "label"), ("x:mma.max_regs", "class.field=value"), ("x:max_regs=0", "class.field=value"),
    ("x:huge.max_regs=0", "unknown size class"), ("x:mma.regs=0", "no field"), ("x:mma.max_regs=oops", "literal"),
    ("x:mma.max_regs=999", "max_regs"), ("x:mma.block_n=48", "block_n"),
    ("x:inductor.no_such_option=1", "no config option"), ("x:inductor.combo_kernels=yes", "literal"),
    ("x:passes.no_such_pass=False", "passes.name=False"), ("x:passes.skinny_mm=True", "passes.name=False"),
    ("x:runtime.pdl=0", "runtime.pdl=True or False"), ("x:runtime.launch=False", "runtime.pdl=True or False"),
])
def test_parse_variant_rejects_bad_specs_naming_them(spec, match):
    with pytest.raises(ValueError, match=match) as err:
        bench_module("paired_step").parse_variant(spec, dict(fp4_moe.DEFAULT_CONFIGS))
    assert repr(spec) in str(err.value)


def test_paired_summary_takes_medians_of_differences():
    rows = bench_module("paired_step").paired_summary({"a": [10.0, 11.0, 30.0, 10.0, 12.0], "b": [8.0, 10.0, 40.0, 7.0, 11.0]})
    assert [r["variant"] for r in rows] == ["a", "b"]
    assert rows[0]["diff_median_us"] == 0.0 and rows[0]["median_us"] == 11.0
    # differences -2, -1, +10, -3, -1: median -1 (their mean, +0.6, would follow the outlier round)
    assert rows[1]["diff_median_us"] == -1.0 and rows[1]["median_us"] == 10.0
    assert rows[1]["diff_q1_us"] <= -1.0 <= rows[1]["diff_q3_us"] and rows[1]["rounds"] == 5


def test_smoke_run_compiles_each_variant_with_its_configs(tmp_path, monkeypatch):
    """Three compiles of the tiny model's step (B=2, T=1: the 'mma_token' class): the defaults, a variant
    that sends that class down the GEMV path, and the control; a fourth variant, with an inductor
    option and a pass left out, whose compile raises is reported and left out. The variant's configs reach
    the op (a spy on choose_config sees both paths), the option the backend and the pass its config, the control's logits equal the first's
    exactly, the GEMV path's agree within f32 rounding of K=64 / I=32 products, DEFAULT_CONFIGS is left
    as it was, and the reports are written. (Only the failing variant has an option: any option is a
    new inductor compile, which the others share from the FX cache.)"""
    from dsv4_compile.backend import Dsv4Backend

    module = bench_module("paired_step")
    defaults = dict(fp4_moe.DEFAULT_CONFIGS)
    seen, options_seen = [], []
    choose = fp4_moe.choose_config

    def spy(*args, **kwargs):
        config = choose(*args, **kwargs)
        seen.append(config.path)
        return config
    monkeypatch.setattr(fp4_moe, "choose_config", spy)
    backend_call = Dsv4Backend.__call__

    def backend_spy(self, gm, example_inputs, **kwargs):
        options_seen.append((kwargs.get("options"), self.config.passes))
        if (kwargs.get("options") or {}).get("benchmark_kernel"):
            raise RuntimeError("this variant does not build")
        return backend_call(self, gm, example_inputs, **kwargs)
    monkeypatch.setattr(Dsv4Backend, "__call__", backend_spy)
    variants = ("base,gemv:mma_token.path='gemv';mma_token.k_splits=1;mma_token.direct_blocks=False,"
                "broken:mma_token.block_n=32;inductor.benchmark_kernel=True;passes.skinny_mm=False")
    assert module.main(["--smoke", "--out", str(tmp_path), "--variants", variants]) == 0
    assert fp4_moe.DEFAULT_CONFIGS == defaults
    assert {"mma", "gemv"} <= set(seen)
    broken_passes = [passes for options, passes in options_seen if (options or {}).get("benchmark_kernel")]
    assert broken_passes and all("dsv4_compile.passes.skinny_mm" not in p and "dsv4_compile.passes.fp4_moe" in p
                                 for p in broken_passes)
    result = json.loads((tmp_path / "paired.json").read_text())
    assert [r["variant"] for r in result["rows"]] == ["base", "gemv", "control"]
    assert "does not build" in result["meta"]["failed"]["broken"]
    broken_row = next(line for line in (tmp_path / "paired.md").read_text().splitlines() if line.startswith("| broken"))
    assert "failed:" in broken_row and "does not build" in broken_row
    assert all(len(times) == 1 for times in result["times_us"].values())  # smoke: one round
    diffs = result["logits_max_abs_diff"]
    assert diffs["base"] == 0.0 and diffs["control"] == 0.0
    assert 0.0 <= diffs["gemv"] <= 1e-4
    assert (tmp_path / "paired.md").read_text().startswith("# Paired step timing (smoke)")
