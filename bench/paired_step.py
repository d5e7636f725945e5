"""Paired A/B timing of optimize()'s step under variants of the FP4 MoE launch configs and inductor options.

    python -m bench.paired_step --batch 64 --tokens 1 --out DIR \\
        --variants "base,nocaps:mma.max_regs=0;mma.down_max_regs=0"     # GPU: the full-width slice
    python -m bench.paired_step --smoke --out DIR                         # CPU: the tiny model

A variant is `label` (fp4_moe's DEFAULT_CONFIGS as they are) or `label:class.field=value;...`, which
replaces TileConfig fields of DEFAULT_CONFIGS[class] (values are Python literals); `inductor.option=value`
passes an inductor config option to the backend for that variant's compile (for example
`combo:inductor.combo_kernels=True`), `passes.name=False` compiles without that dsv4 pass (for
example `cublas_head:passes.weight_stream_mm=False`), and `runtime.pdl=False` launches the ops' kernels
without programmatic dependent launch (`dsv4_compile.kernels._runtime.set_pdl`). Each variant compiles the step again on the same model and caches,
with its configs in place while it compiles, records its CUDA graph and runs; its logits are compared
with the first variant's. A variant whose compile or first run raises is reported and left out. A
second compile of the first variant joins as the noise control. The steps then alternate for --rounds
rounds, each between two CUDA events, without an L2 flush or a host sync inside the loop, so a drift of
the GPU's speed reaches every variant alike. The report gives each variant's median step and the median
and quartiles of its paired differences against the first. (Blocks of do_bench replays, one variant
after another, favoured whichever heavy case ran first by 3-6%: bench/RESULTS.md, thirteenth session.)
On CPU the times are wall clock and not a measurement.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

CONTROL = "control"
INDUCTOR = "inductor"
PASSES = "passes"
RUNTIME = "runtime"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compile of the step: fp4_moe size classes replaced (class -> TileConfig), inductor options,
    dsv4 passes left out (their short names), and whether the ops' kernels take programmatic dependent
    launch."""

    label: str
    configs: dict
    inductor: dict
    passes_off: tuple[str, ...] = ()
    pdl: bool = True

    def describe(self) -> str:
        parts = [f"{c}: {cfg}" for c, cfg in self.configs.items()]
        parts += [f"{INDUCTOR}.{option}={value!r}" for option, value in self.inductor.items()]
        parts += [f"{PASSES}.{name}=False" for name in self.passes_off]
        parts += [] if self.pdl else [f"{RUNTIME}.pdl=False"]
        return "; ".join(parts)


def parse_variant(spec: str, configs: dict) -> Variant:
    """`label` or `label:class.field=value;...` (class `inductor`: an option of the installed torch's
    inductor config; class `passes`: a dsv4 pass's short name, value False; `runtime.pdl`: True or
    False) -> Variant. configs: fp4_moe's DEFAULT_CONFIGS.

    Raises ValueError naming the spec for a missing label, an unknown size class, field, inductor
    option or pass, a value that is not a Python literal, or one TileConfig rejects."""
    import torch._inductor.config

    from dsv4_compile.passes.manager import PASS_MODULES

    label, _, changes = spec.partition(":")
    label = label.strip()
    if not label:
        raise ValueError(f"variant {spec!r}: needs a label before ':'")
    inductor_options = torch._inductor.config.get_config_copy()
    fields = {f.name for f in dataclasses.fields(next(iter(configs.values())))}
    pass_names = [module.rsplit(".", 1)[-1] for module in PASS_MODULES]
    wanted: dict[str, dict] = {}
    inductor: dict = {}
    passes_off: list[str] = []
    pdl = True
    for change in filter(None, (c.strip() for c in changes.split(";"))):
        target, eq, raw = change.partition("=")
        size_class, dot, field = target.strip().partition(".")
        if not (eq and dot):
            raise ValueError(f"variant {spec!r}: {change!r} is not class.field=value")
        if size_class == INDUCTOR:
            if field not in inductor_options:
                raise ValueError(f"variant {spec!r}: inductor has no config option {field!r}")
        elif size_class == PASSES:
            if field not in pass_names or raw.strip() != "False":
                raise ValueError(f"variant {spec!r}: {change!r} must be passes.name=False, name one of {pass_names}")
            passes_off.append(field)
            continue
        elif size_class == RUNTIME:
            if field != "pdl" or raw.strip() not in ("True", "False"):
                raise ValueError(f"variant {spec!r}: {change!r} must be {RUNTIME}.pdl=True or False")
            pdl = raw.strip() == "True"
            continue
        elif size_class not in configs:
            raise ValueError(f"variant {spec!r}: unknown size class {size_class!r}; one of "
                             f"{sorted(configs) + [INDUCTOR, PASSES, RUNTIME]}")
        elif field not in fields:
            raise ValueError(f"variant {spec!r}: TileConfig has no field {field!r}; fields: {sorted(fields)}")
        try:
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"variant {spec!r}: {raw.strip()!r} is not a Python literal") from None
        if size_class == INDUCTOR:
            inductor[field] = value
        else:
            wanted.setdefault(size_class, {})[field] = value
    try:
        replaced = {c: dataclasses.replace(configs[c], **f) for c, f in wanted.items()}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"variant {spec!r}: {exc}") from None
    return Variant(label, replaced, inductor, tuple(passes_off), pdl)


def paired_summary(times_us: dict[str, list[float]]) -> list[dict]:
    """Per variant (the first is the reference): median step and the median and quartiles of its
    paired differences against the first, all in microseconds. times_us: label -> one time per round."""
    first = next(iter(times_us.values()))
    rows = []
    for label, times in times_us.items():
        diffs = [t - r for t, r in zip(times, first, strict=True)]
        low, _, high = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else (diffs[0], None, diffs[0])
        rows.append(dict(variant=label, median_us=statistics.median(times), diff_median_us=statistics.median(diffs),
                         diff_q1_us=low, diff_q3_us=high, rounds=len(times)))
    return rows


def markdown(meta: dict, rows: list[dict], logits: dict[str, float]) -> str:
    lines = [f"# Paired step timing ({meta['mode']})", "",
             f"- command: `{meta['command']}`",
             f"- date: {meta['date']}; git commit: {meta['git_commit']}; sources sha256 {meta['source_hash']}",
             f"- torch {meta['torch']}, triton {meta['triton']}; device: {meta['device']}",
             f"- B={meta['batch']} T={meta['tokens']} ctx {meta['context']}, max context {meta['max_context']}, "
             f"{meta['rounds']} rounds; '{CONTROL}': a second compile of the first variant",
             "", "| variant | changes | median step | paired diff vs first (median) | quartiles | max abs logits diff vs first |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['variant']} | {meta['changes'].get(row['variant'], '') or '-'} | {row['median_us']:.1f} us "
                     f"| {row['diff_median_us']:+.1f} us | {row['diff_q1_us']:+.1f} / {row['diff_q3_us']:+.1f} "
                     f"| {logits[row['variant']]:.3e} |")
    for label, why in meta["failed"].items():
        lines.append(f"| {label} | {meta['changes'].get(label, '') or '-'} | failed: {why} | | | |")
    if meta["mode"] == "smoke":
        lines += ["", "CPU wall clock: checks the harness, not a measurement."]
    return "\n".join(lines) + "\n"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.paired_step", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: the tiny model (TRITON_INTERPRET=1)")
    parser.add_argument("--batch", type=int, default=None, help="B (default: 64 on a GPU, 2 in smoke)")
    parser.add_argument("--tokens", type=int, default=1, help="T: 1 decode, more for verify")
    parser.add_argument("--context", type=int, default=None, help="start position (default: 512, smoke 8)")
    parser.add_argument("--variants", default="base", help="comma list of variants (see above)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default: 300, smoke 1)")
    parser.add_argument("--out", type=Path, required=True, help="directory for paired.json and paired.md")
    args = parser.parse_args(argv)
    args.batch = args.batch or (2 if args.smoke else 64)
    args.context = 8 if args.smoke and args.context is None else (args.context or 512)
    args.rounds = args.rounds or (1 if args.smoke else 300)
    if args.batch < 1 or args.tokens < 1 or args.rounds < 1:
        parser.error("--batch, --tokens and --rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels import
    from bench.__main__ import _import_dsv4_compile
    _import_dsv4_compile()
    import torch

    import dsv4_compile
    from bench import report
    from bench.bench_fp4_moe import paired_times
    from bench.slice_model import build_slice, fill_caches_, smoke_model
    from dsv4_compile.backend import Dsv4Backend
    from dsv4_compile.compiled_step import compile_step
    from dsv4_compile.kernels import _runtime, fp4_moe
    from dsv4_compile.passes.manager import PASS_MODULES, PassConfig
    from dsv4_compile.passes.report import PassReport

    defaults = dict(fp4_moe.DEFAULT_CONFIGS)
    try:
        variants = [parse_variant(spec, defaults) for spec in args.variants.split(",") if spec.strip()]
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels) or CONTROL in labels:
        raise SystemExit(f"--variants: labels must be distinct and not {CONTROL!r}, got {labels}")
    variants.append(dataclasses.replace(variants[0], label=CONTROL))

    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("paired_step needs a CUDA GPU; --smoke runs on CPU")
    max_context = 256 if args.smoke else 1 << 20
    model = smoke_model() if args.smoke else build_slice(device)
    engine = dsv4_compile.optimize(model, max_batch=args.batch, max_context=max_context,
                                   verify_tokens=max(args.tokens - 1, 0))
    fill_caches_(engine.module)
    gen = torch.Generator().manual_seed(1000 + args.tokens)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.tokens), generator=gen).to(device)
    start = torch.full((args.batch,), args.context, dtype=torch.int64, device=device)
    rows = torch.arange(args.batch, dtype=torch.int64, device=device)

    steps, logits, failed = {}, {}, {}
    for index, variant in enumerate(variants):
        if index == 0 and not (variant.inductor or variant.passes_off or not variant.pdl):
            compiled = engine.compiled_step
        else:
            backend = engine.backend
            if variant.passes_off:
                kept = tuple(m for m in PASS_MODULES if m.rsplit(".", 1)[-1] not in variant.passes_off)
                backend = Dsv4Backend(PassConfig(passes=kept), PassReport(), cudagraphs=device.type == "cuda")
            compiled = compile_step(engine.module, functools.partial(backend, options=variant.inductor), 1)

        def step(compiled=compiled, configs=variant.configs, pdl=variant.pdl):
            # The ops read DEFAULT_CONFIGS and the PDL switch when they launch: while a CUDA graph
            # records, and at every call on CPU, where nothing is recorded.
            fp4_moe.DEFAULT_CONFIGS.update(defaults)
            fp4_moe.DEFAULT_CONFIGS.update(configs)
            _runtime.set_pdl(pdl)
            if device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad():
                return compiled(ids, start, rows)
        began = time.perf_counter()
        try:
            logits[variant.label] = step().float().clone()
            for _ in range(3 if device.type == "cuda" else 0):  # the CUDA graph tree records on a later call
                step()
        except Exception as exc:  # one variant that does not build must not cost the others' device time
            if index == 0:
                raise
            failed[variant.label] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            logits.pop(variant.label, None)
            print(f"[{variant.label}] failed: {failed[variant.label]}", flush=True)
            continue
        print(f"[{variant.label}] compiled and recorded in {time.perf_counter() - began:.1f} s", flush=True)
        steps[variant.label] = step
    fp4_moe.DEFAULT_CONFIGS.update(defaults)
    first = logits[labels[0]]
    logits_diff = {label: (value - first).abs().max().item() for label, value in logits.items()}

    # No L2 flush between steps: a serving engine runs them back to back.
    times = {label: [ms * 1e3 for ms in run] for label, run in paired_times(steps, args.rounds, flush_l2=False).items()}

    command = "python -m bench.paired_step " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = dict(report.run_meta(command, device), mode="smoke" if args.smoke else "gpu", batch=args.batch, tokens=args.tokens, context=args.context,
                max_context=max_context, rounds=args.rounds, changes={v.label: v.describe() for v in variants},
                failed=failed)
    rows_out = paired_summary(times)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "paired.json").write_text(json.dumps(dict(meta=meta, rows=rows_out, logits_max_abs_diff=logits_diff,
                                                          times_us=times), indent=1))
    table = markdown(meta, rows_out, logits_diff)
    (args.out / "paired.md").write_text(table)
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
