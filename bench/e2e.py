"""End-to-end decode (T=1) and verify (T=4) step times of a DeepSeek-V4 slice, three variants:

- eager: the uncompiled step module (`engine.module`);
- compile_default: `torch.compile(engine.module, mode="reduce-overhead", fullgraph=True,
  dynamic=False)`: inductor with CUDA graphs, no dsv4 passes, one static graph per (B, T);
- optimize: `engine.step` of `dsv4_compile.optimize(...)` (the dsv4 passes, CUDA graph trees) on
  host inputs, as a serving scheduler holds them: checked on the host and copied to the GPU without
  a sync. Two other forms are timed beside it (`OPTIMIZE_FORMS`): `engine.step` on GPU inputs (its
  check syncs with the host) and `engine.compiled_step` (no check, logits copy or site check, on GPU
  inputs, as the baselines run).

The three share one step module and so one set of caches. Before each case the caches are
filled with the same random values and the step runs at start_pos = context: every cache is
indexed by absolute position and a step reads only positions < start_pos + T, so no prefill is
needed, and a step only rewrites positions >= start_pos with values that depend on the earlier
ones, so repeated steps and the three variants all see the same state.

Per case (B, T, context): correctness first (logits of every variant against the reference on
the same step, once with decisive routing, which is the pass/fail check, and once with the
model's own routing, reported), then medians of the step time, the kernel breakdown of the
optimize step from torch.profiler, and tokens/s extrapolated to 43 layers.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import dsv4_compile
from dsv4_compile.model.fused_linear import FusedLinear
from bench import report
from bench.measure import (compare_logits, compile_phase_seconds, kernel_breakdown, make_timer, synchronize,
                           timed_first_call)
from bench.slice_model import (FULL_MODEL_LAYERS, ExpertLayouts, build_slice, cache_bytes_by_kind, decisive_routing,
                               fill_caches_, smoke_model)

# other forms of the optimize() step, timed beside it on the same graph
OPTIMIZE_FORMS = ("step_gpu_inputs", "compiled_step")

VARIANTS = ("eager", "compile_default", "optimize")
VERIFY_TOKENS = 3
# Per-token relative L2 error of the logits, (median, max) over the tokens of a step.
# bf16: inductor keeps f32 intermediates where eager rounds each op to bf16 (2**-9). On the
# tiny model in bf16 (CPU, decisive routing, every compressed entry selected) eager vs
# torch.compile default gave median 2.2e-2 and max 6.3e-2 over 32 tokens, so (5e-2, 0.15) leave
# ~2.3x margin; a wrong kernel changes a whole layer's output, >= ~0.3 on every token. With the
# model's own routing a near-tie can flip an expert (the row is reported, not judged); at full
# width an indexer flip moves one of ~640 attended rows.
BF16_TOLERANCE = (5e-2, 0.15)
# f32: inductor reorders and fuses reductions, ~1e-6 relative.
F32_TOLERANCE = (1e-4, 1e-4)
MIN_FREE_FRACTION = 0.9  # a baseline whose estimated peak exceeds this share of free memory is skipped


@dataclass(frozen=True)
class Group:
    """A batch size and step width (one compiled graph per variant) and the variants it runs."""

    batch: int
    tokens: int
    variants: tuple[str, ...] = VARIANTS


@dataclass(frozen=True)
class Suite:
    """What one mode runs: its groups in order, the contexts of each, the engine's sizes, the
    correctness tolerance, the profiled steps per case and the default time budget."""

    name: str
    groups: tuple[Group, ...]
    contexts: tuple[int, ...]
    max_batch: int
    max_context: int
    tolerance: tuple[float, float]  # (median, max) per-token relative L2 error
    profile_steps: int
    default_budget_s: float


SUITES = {
    # The targets' cases first (B=64), then B=1; a group not started in the budget is recorded.
    "quick": Suite("quick", (Group(64, 1), Group(64, 4), Group(1, 1), Group(1, 4)),
                   (512, 8192, 131072), 64, 1 << 20, BF16_TOLERANCE, 3, 500.0),
    "full": Suite("full", (Group(64, 1), Group(64, 4), Group(1, 1), Group(16, 1), Group(1, 4), Group(16, 4)),
                  (512, 8192, 32768, 131072, 524288), 64, 1 << 20, BF16_TOLERANCE, 3, 560.0),
    # Two compiled graphs (inductor's CPU codegen takes about a minute each on 2 cores, and CI's
    # 20 minutes are spent): optimize at T=1 and T=4, at B=2, against eager; B=1 runs eager and is
    # checked against row 0 of B=2 (on the GPU every variant that ran at B=64 is, at B=1, and
    # compile_default runs there).
    "smoke": Suite("smoke", (Group(2, 1, ("eager", "optimize")), Group(2, 4, ("eager", "optimize")),
                             Group(1, 1, ("eager",)), Group(1, 4, ("eager",))),
                   (8, 40), 2, 256, F32_TOLERANCE, 1, math.inf),
}


def _baseline_peak_bytes(variant: str, batch: int, tokens: int, config, max_context: int) -> int:
    """A rough peak of the transient memory of the plain-torch hot spots (the largest two).

    MoE: the gathered experts, a = M * k * 2I * K values; eager unpacks them to uint8 codes,
    indexes an int64 copy and multiplies f32 values (~13a bytes); inductor fuses the dequant
    into bf16 weights, w13 then w2 (~2a; more if it materialises the unpacked codes, and then
    the OOM is caught). Indexer: f32 scores [B, T, H, S] over every slot of max context (eager
    keeps about three of them and the f32 keys, inductor one and the keys).
    """
    if variant == "optimize":
        return 0
    a = batch * tokens * config.num_experts_per_tok * 2 * config.moe_intermediate_size * config.hidden_size
    slots = max_context // config.compress_rates["compressed_sparse_attention"]
    scores = batch * tokens * config.index_n_heads * slots * 4
    keys = batch * slots * config.index_head_dim * 4
    if variant == "eager":
        return max(13 * a, 3 * scores + 2 * keys)
    return max(2 * a, scores + keys)


class E2EBench:
    """Runs one Suite and keeps its results (a JSON-able dict) up to date in `out`."""

    def __init__(self, suite: Suite, out: Path, budget_s: float, command: str, started: float) -> None:
        self.suite = suite
        self.out = out
        self.deadline = started + budget_s - 20.0  # keep 20 s for the reports and plots
        self.smoke = suite.name == "smoke"
        if not self.smoke and not torch.cuda.is_available():
            raise SystemExit(f"--{suite.name} needs a CUDA GPU; --smoke runs on CPU")
        self.device = torch.device("cpu" if self.smoke else "cuda")
        self.timer = make_timer(self.device)
        self.results = report.new_results(suite, command, self.device)
        # (variant, T, ctx) -> row 0 of the logits of the first group that ran it: a later,
        # smaller batch with the same row-0 inputs and state must give the same logits.
        self.first_rows: dict[tuple[str, int, int], torch.Tensor] = {}

    # ------------------------------------------------------------------ set-up

    def build(self) -> None:
        start = time.perf_counter()
        self.model = smoke_model() if self.smoke else build_slice(self.device)
        self.layouts = ExpertLayouts(self.model)
        max_batch = self.suite.max_batch
        while True:
            try:
                self.engine = dsv4_compile.optimize(self.model, max_batch=max_batch,
                                                    max_context=self.suite.max_context,
                                                    verify_tokens=VERIFY_TOKENS)
                self.layouts.capture_tiled()
                break
            except torch.OutOfMemoryError:
                if max_batch == 1:
                    raise
                max_batch //= 2
                gc.collect()
                torch.cuda.empty_cache()
                self.results["notes"].append(f"caches for max_batch={max_batch * 2} did not fit: "
                                             f"max_batch lowered to {max_batch}")
        self.compile_default = torch.compile(self.engine.module, mode="reduce-overhead", fullgraph=True,
                                             dynamic=False)
        self.results["setup"] = self._setup_record(max_batch, time.perf_counter() - start)
        setup = self.results["setup"]
        print(f"[setup] {setup['model']}; caches {setup['cache_gb']:.1f} GB, weights {setup['weight_gb']:.1f} GB "
              f"(+ {setup['fused_projection_copies_gb']:.2f} GB of fused projection copies), "
              f"free {setup.get('free_gb', float('nan')):.1f} GB, built in {setup['build_s']:.0f} s", flush=True)

    def _setup_record(self, max_batch: int, build_s: float) -> dict:
        config = self.model.config
        caches = cache_bytes_by_kind(self.engine.module)
        weights = sum(t.numel() * t.element_size() for t in self.model.parameters())
        weights += sum(t.numel() * t.element_size() for t in self.model.buffers())
        fused = sum(b.numel() * b.element_size() for m in self.engine.module.modules()
                    if isinstance(m, FusedLinear) for b in m.buffers(recurse=False))
        record = {
            "model": (f"{config.num_hidden_layers} layers {list(config.layer_types)}, mlp "
                      f"{list(config.mlp_layer_types)}, hidden {config.hidden_size}, {config.num_attention_heads} "
                      f"heads x {config.head_dim}, q_lora {config.q_lora_rank}, o_groups {config.o_groups} x "
                      f"{config.o_lora_rank}, indexer {config.index_n_heads} x {config.index_head_dim} top-"
                      f"{config.index_topk}, {config.n_routed_experts} experts x {config.moe_intermediate_size} "
                      f"top-{config.num_experts_per_tok} MXFP4, hc_mult {config.hc_mult}, window "
                      f"{config.sliding_window}, compress rates {dict(config.compress_rates)}, vocab "
                      f"{config.vocab_size}, {self.model.lm_head.weight.dtype}"),
            "max_batch": max_batch, "max_context": self.suite.max_context, "verify_tokens": VERIFY_TOKENS,
            "cache_bytes": caches, "cache_gb": sum(caches.values()) / 1e9, "weight_gb": weights / 1e9,
            "fused_projection_copies_gb": fused / 1e9,
            "build_s": round(build_s, 1),
        }
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            record.update(free_gb=free / 1e9, total_gb=total / 1e9,
                          allocated_gb=torch.cuda.memory_allocated(self.device) / 1e9)
        return record

    # ------------------------------------------------------------------ running

    def run(self) -> dict:
        torch._dynamo.reset()  # no earlier compiles of the step's code count towards the recompile limit
        self.build()
        last_group_s = 0.0
        with torch.no_grad():
            for index, group in enumerate(self.suite.groups):
                if group.batch > self.engine.layout.max_batch:
                    self._skip_group(group, f"B > max_batch {self.engine.layout.max_batch}")
                    continue
                if index and time.monotonic() + last_group_s > self.deadline:
                    self._skip_group(group, f"budget: the last group took {last_group_s:.0f} s")
                    continue
                start = time.monotonic()
                self._run_group(group)
                last_group_s = time.monotonic() - start
        self.results["pass_report"] = self.engine.report.format()
        report.write_outputs(self.out, self.results)
        return self.results

    def release(self) -> None:
        """Frees the model, the caches and the compiled graphs (the kernel benches run next)."""
        for name in ("compile_default", "engine", "layouts", "model"):
            self.__dict__.pop(name, None)
        self.first_rows.clear()
        torch._dynamo.reset()
        self._release_memory()

    def _skip_group(self, group: Group, reason: str) -> None:
        for context in self.suite.contexts:
            self.results["cases"].append({"B": group.batch, "T": group.tokens, "ctx": context, "skipped": reason})
        print(f"[B={group.batch} T={group.tokens}] skipped ({reason})", flush=True)
        report.write_outputs(self.out, self.results)

    def _step_fn(self, variant: str, inputs: tuple[torch.Tensor, ...], host_inputs: tuple[torch.Tensor, ...]) -> Callable:
        """One call of `variant` (or of an `OPTIMIZE_FORMS` form); optimize gets the host inputs."""
        # The baselines run the row-major experts a user's model holds; optimize() the tiled ones.
        tiled = variant == "optimize" or variant in OPTIMIZE_FORMS
        ids, start, rows = host_inputs if variant == "optimize" else inputs
        if variant == "eager":
            def eager():
                self.layouts.use(tiled)
                return self.engine.module(ids, start, rows)
            return eager
        compiled = {"compile_default": self.compile_default, "optimize": self.engine.step,
                    "step_gpu_inputs": self.engine.step, "compiled_step": self.engine.compiled_step}[variant]

        def step():
            self.layouts.use(tiled)
            if self.device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            return compiled(ids, start, rows)
        return step

    def _inputs(self, group: Group, context: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids [B, T] (row b the same for every B), start_pos [B] = context, rows [B]."""
        generator = torch.Generator().manual_seed(1000 + group.tokens)
        ids = torch.randint(0, self.model.config.vocab_size, (self.suite.max_batch, group.tokens), generator=generator)
        ids = ids[: group.batch].to(self.device)
        start = torch.full((group.batch,), context, dtype=torch.int64, device=self.device)
        rows = torch.arange(group.batch, dtype=torch.int64, device=self.device)
        return ids, start, rows

    def _head_us(self, group: Group) -> float:
        """Median time of the eager model head (embedding, hc_head, norm, lm_head) at (B, T)."""
        inner = self.model.model
        config = self.model.config
        ids, _, _ = self._inputs(group, 0)
        hidden = torch.randn(group.batch, group.tokens, config.hc_mult, config.hidden_size,
                             dtype=self.model.lm_head.weight.dtype, device=self.device)

        def head():
            inner.embed_tokens(ids)
            return self.model.lm_head(inner.norm(inner.hc_head(hidden)))
        return self.timer(head)

    def _memory_skips(self, group: Group) -> dict[str, str]:
        if self.device.type != "cuda":
            return {}
        gc.collect()
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(self.device)[0]
        skips = {}
        for variant in group.variants:
            need = _baseline_peak_bytes(variant, group.batch, group.tokens, self.model.config, self.suite.max_context)
            if need > MIN_FREE_FRACTION * free:
                skips[variant] = (f"skipped: its plain-torch hot spots need ~{need / 1e9:.0f} GB, "
                                  f"{free / 1e9:.0f} GB free")
        return skips

    def _run_group(self, group: Group) -> None:
        status = {v: "ok" for v in group.variants}
        status.update(self._memory_skips(group))
        steps = {}
        inputs = self._inputs(group, self.suite.contexts[0])
        host_inputs = tuple(t.cpu() for t in inputs)
        # optimize first: its graph is recorded before a baseline can run out of memory.
        for variant in sorted(group.variants, key=("optimize", "compile_default", "eager").index):
            if status[variant] != "ok":
                self._record_compile(group, variant, None, status[variant], {})
                continue
            steps[variant] = self._step_fn(variant, inputs, host_inputs)
            status[variant] = self._compile(group, variant, steps[variant])
        head_us = self._head_us(group)
        forms = {form: self._step_fn(form, inputs, host_inputs) for form in OPTIMIZE_FORMS} \
            if status.get("optimize") == "ok" else {}
        last_case_s = 0.0
        for context in self.suite.contexts:
            if time.monotonic() + last_case_s > self.deadline:
                self.results["cases"].append({"B": group.batch, "T": group.tokens, "ctx": context,
                                              "skipped": "budget"})
                continue
            for start in (inputs[1], host_inputs[1]):
                start.fill_(context)
            case_start = time.monotonic()
            self._run_case(group, context, steps, forms, status, head_us)
            last_case_s = time.monotonic() - case_start
        steps.clear()
        forms.clear()
        torch._dynamo.reset()  # drops this group's graphs and CUDA-graph pools
        self._release_memory()

    def _compile(self, group: Group, variant: str, step: Callable) -> str:
        """First call (the compile) and two more (CUDA-graph recording); returns the status."""
        from torch._dynamo.utils import counters

        records_before = len(self.engine.report.records)
        skips_before = counters["inductor"]["cudagraph_skips"]
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        phases_before = compile_phase_seconds()
        try:
            _, seconds = timed_first_call(step, self.device)
            for _ in range(2 if self.device.type == "cuda" else 0):  # CUDA-graph trees record on a later call
                step()
            synchronize(self.device)
            outcome = "ok"
        except torch.OutOfMemoryError as exc:
            seconds, outcome = None, f"OOM: {str(exc).splitlines()[0][:200]}"
        except Exception as exc:  # recorded; the other variants still run
            seconds, outcome = None, f"error: {type(exc).__name__}: {str(exc)[:300]}"
        extra = {"cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips_before,
                 "phases_s": compile_phases(phases_before, compile_phase_seconds(), seconds)}
        if self.device.type == "cuda":
            extra["peak_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
        if variant == "optimize":
            new = self.engine.report.records[records_before:]
            extra["pass_matches"] = {name: sum(r.matched for r in new if r.pass_name == name)
                                     for name in dict.fromkeys(r.pass_name for r in new)}
            extra["pass_declines"] = sorted({f"{r.pass_name}: {r.reason}" for r in new if not r.matched})
        self._record_compile(group, variant, seconds, outcome, extra)
        if outcome != "ok":
            self._release_memory()
        return outcome

    def _record_compile(self, group: Group, variant: str, seconds: float | None, outcome: str, extra: dict) -> None:
        self.results["compile"].append({"B": group.batch, "T": group.tokens, "variant": variant,
                                        "seconds": seconds, "status": outcome, **extra})
        shown = "-" if seconds is None else f"{seconds:.1f} s"
        print(f"[compile B={group.batch} T={group.tokens}] {variant}: {shown} ({outcome})", flush=True)
        report.write_outputs(self.out, self.results)

    def _logits(self, steps: dict, status: dict, wall_us: dict | None = None) -> dict[str, torch.Tensor]:
        """One step of every live variant: f32 copies of the logits (CUDA-graph outputs are
        overwritten by the next replay). wall_us, if given, gets each step's wall clock (CPU)."""
        logits = {}
        for variant, step in steps.items():
            if status[variant] != "ok":
                continue
            try:
                start = time.perf_counter()
                logits[variant] = step().to(torch.float32, copy=True)
                if wall_us is not None:
                    wall_us[variant] = (time.perf_counter() - start) * 1e6
            except Exception as exc:  # noqa: BLE001 - recorded (an OOM too), the variant stops for this group
                status[variant] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
                self._release_memory()
        return logits

    def _release_memory(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check(self, logits: dict[str, torch.Tensor]) -> dict:
        """Every variant against the reference (eager, else compile_default); a variant with no
        baseline to compare with (the baselines ran out of memory) is checked for finite logits."""
        checks = {}
        reference = next((v for v in ("eager", "compile_default") if v in logits), None)
        for variant, values in logits.items():
            if variant == reference or reference is None:
                finite = bool(torch.isfinite(values).all())
                checks[variant] = {"reference": variant == reference, "finite": finite, "ok": finite}
            else:
                checks[variant] = {"against": reference,
                                   **compare_logits(values, logits[reference], *self.suite.tolerance)}
        return checks

    def _run_case(self, group: Group, context: int, steps: dict, forms: dict[str, Callable], status: dict,
                  head_us: float) -> None:
        case = {"B": group.batch, "T": group.tokens, "ctx": context}
        # The same state for every case: a step at a smaller context rewrites entries that a
        # larger context reads (its positions, and the compressed entries that close there).
        fill_caches_(self.engine.module)
        with decisive_routing(self.model):
            decisive = self._logits(steps, status)
        case["check"] = self._check(decisive)
        # On CPU a time is the wall clock of one run (make_timer): the smoke mode takes this run's,
        # as the interpreted optimize() step takes seconds.
        wall_us = {} if self.smoke else None
        case["check_model_routing"] = self._check(self._logits(steps, status, wall_us))
        case["batch_consistency"] = {}
        for variant, values in decisive.items():
            key = (variant, group.tokens, context)
            if key in self.first_rows:
                case["batch_consistency"][variant] = compare_logits(
                    values[:1], self.first_rows[key].to(values.device), *self.suite.tolerance)
            else:
                self.first_rows[key] = values[:1].cpu()
        del decisive
        case["correct"] = all(c["ok"] for c in case["check"].values()) and \
            all(c["ok"] for c in case["batch_consistency"].values())

        times = dict(wall_us or {})
        for variant, step in steps.items():
            if status[variant] != "ok" or variant in times:
                continue
            try:
                times[variant] = self.timer(step, heavy=variant == "eager")
            except Exception as exc:  # noqa: BLE001 - an OOM mid-run is a result, not a crash
                status[variant] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
                self._release_memory()
        case["us"] = times
        # The smoke mode runs the other forms of the step at its first context only (the same code
        # at the next).
        if "optimize" in times and not (self.smoke and context != self.suite.contexts[0]):
            case["us_forms"], case["forms_status"] = {}, {}
            for form, step in forms.items():
                try:
                    case["us_forms"][form] = self.timer(step)
                except Exception as exc:  # noqa: BLE001 - as for the variants above
                    case["forms_status"][form] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
                    self._release_memory()
            if "compile_default" in times:
                case["speedup_forms_vs_compile_default"] = {
                    form: times["compile_default"] / us for form, us in case["us_forms"].items()}
        case["status"] = dict(status)
        case["head_us"] = head_us
        layers = self.model.config.num_hidden_layers
        case["tok_s_43_layers"] = {
            v: group.batch * group.tokens / ((max(us - head_us, 0.0) / layers * FULL_MODEL_LAYERS + head_us) * 1e-6)
            for v, us in times.items()}
        if "optimize" in times:
            for base in ("compile_default", "eager"):
                if base in times:
                    case[f"speedup_vs_{base}"] = times[base] / times["optimize"]
        case["breakdown"] = self._breakdowns(group, context, steps, status)
        self.results["cases"].append(case)
        report.write_outputs(self.out, self.results)
        print(report.case_line(case), flush=True)

    def _breakdowns(self, group: Group, context: int, steps: dict, status: dict) -> dict:
        """optimize at every case; compile_default at the first context (its work is that of
        max context whatever the real length)."""
        wanted = ["optimize"] + (["compile_default"] if context == self.suite.contexts[0] else [])
        found = {}
        for variant in wanted:
            if variant in steps and status[variant] == "ok":
                try:
                    found[variant] = kernel_breakdown(steps[variant], self.device, self.suite.profile_steps)
                except Exception as exc:  # noqa: BLE001 - the profiler is diagnostics only
                    found[variant] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        return found


def run_suite(suite: Suite, out: Path, budget_s: float, command: str, started: float) -> dict:
    """Runs `suite`, writing out/e2e.json and out/e2e.md after every case; returns the results
    (with "error": the traceback, if the run stopped on an exception)."""
    out.mkdir(parents=True, exist_ok=True)
    patches: dict = {}
    if suite.name == "smoke":
        # Scalar C++ and in-process builds: inductor's CPU compile of the tiny step is faster.
        patches = {"cpp.vec_isa_ok": False, "compile_threads": 1}
    bench = E2EBench(suite, out, budget_s, command, started)
    try:
        with torch._inductor.config.patch(patches):
            bench.run()
    except Exception:  # the partial results and the traceback are kept; the caller reports the failure
        traceback.print_exc()
        bench.results["error"] = traceback.format_exc()[-4000:]
        report.write_outputs(out, bench.results)
    finally:
        bench.release()
    return bench.results


# torch's timed compile phases worth reading side by side (names of torch 2.11-2.13; nested: the
# inductor ones run inside call_user_compiler, which runs inside compile_inner)
COMPILE_PHASES = (
    ("_compile.compile_inner", "dynamo total"),
    ("bytecode_tracing", "tracing"),
    ("OutputGraph.call_user_compiler", "AOT + inductor"),
    ("pass.post_grad_passes.post_grad_custom_post_pass", "dsv4 passes"),
    ("GraphLowering.compile_to_module", "inductor codegen + load"),
    ("async_compile.wait", "waiting for kernel builds"),
)


def compile_phases(before: dict[str, float], after: dict[str, float], first_call_s: float | None) -> dict[str, float]:
    """Seconds of COMPILE_PHASES between two compile_phase_seconds() snapshots, and of the first
    call outside dynamo's compile (the graph's first runs and the CUDA-graph warm-up)."""
    grown = {label: round(after[name] - before.get(name, 0.0), 1) for name, label in COMPILE_PHASES if name in after}
    phases = {label: t for label, t in grown.items() if t >= 0.05}
    if first_call_s is not None and "dynamo total" in grown:
        phases["outside dynamo"] = round(max(0.0, first_call_s - grown["dynamo total"]), 1)
    return phases


def select_groups(suite: Suite, wanted: str | None) -> Suite:
    """The suite restricted to the groups named in `wanted` ("64x1,1x4": B x T), run in that order."""
    if not wanted:
        return suite
    names = list(dict.fromkeys(name.strip() for name in wanted.split(",") if name.strip()))
    by_name = {f"{g.batch}x{g.tokens}": g for g in suite.groups}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise ValueError(f"--groups must name groups of --{suite.name} ({sorted(by_name)}); got {unknown}")
    return dataclasses.replace(suite, groups=tuple(by_name[name] for name in names))


def select_contexts(suite: Suite, wanted: str | None) -> Suite:
    """The suite restricted to the contexts in `wanted` ("512,131072"), in the suite's order."""
    if not wanted:
        return suite
    names = {name.strip() for name in wanted.split(",") if name.strip()}
    unknown = sorted(names - {str(c) for c in suite.contexts})
    if unknown:
        raise ValueError(f"--contexts must name contexts of --{suite.name} {list(suite.contexts)}; got {unknown}")
    return dataclasses.replace(suite, contexts=tuple(c for c in suite.contexts if str(c) in names))
