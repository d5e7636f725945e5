"""The bench's outputs: DIR/e2e.json, DIR/e2e.md (tables, targets) and PNG plots."""
from __future__ import annotations

import hashlib
import json
import logging
import math
import platform
import subprocess
import time
from pathlib import Path

import torch

log = logging.getLogger("dsv4_compile.bench")

REPO = Path(__file__).resolve().parent.parent
VARIANT_NAMES = {"eager": "eager", "compile_default": "torch.compile default", "optimize": "optimize()"}
FORM_NAMES = {"step_gpu_inputs": "Engine.step on GPU inputs", "compiled_step": "compiled_step"}
# (B, T, context, the least speed-up of optimize() over torch.compile default), max context 1M
SPEEDUP_TARGETS = ((64, 1, 512, 20.0), (64, 1, 131072, 2.0))
COMPILE_TARGET_S = 90.0


def _git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return commit + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout)"


def source_hash() -> str:
    """sha256 (12 hex digits) of the package and bench sources (*.py under dsv4_compile/, passes/,
    kernels/, lowerings/, bench/, by relative path): names the code that ran even where the
    checkout's git metadata is stale or missing (`python bench/report.py` prints it for a checkout)."""
    digest = hashlib.sha256()
    for folder in ("dsv4_compile", "passes", "kernels", "lowerings", "bench"):
        for path in sorted((REPO / folder).rglob("*.py")):
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def run_meta(command: str, device: torch.device) -> dict:
    """What identifies a run: command, date, commit, sources hash, versions, device."""
    import transformers
    import triton

    return {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "git_commit": _git_commit(),
            "source_hash": source_hash(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


def new_results(suite, command: str, device: torch.device) -> dict:
    """The results skeleton: meta (suite, command, date, commit, versions, device), tolerance, and
    empty setup / compile / cases / notes."""
    return {
        "meta": {
            "suite": suite.name, **run_meta(command, device),
            "contexts": list(suite.contexts), "groups": [[g.batch, g.tokens, list(g.variants)] for g in suite.groups],
        },
        "tolerance": {
            "median": suite.tolerance[0], "max": suite.tolerance[1],
            "rule": ("logits of each variant vs the reference (eager, else torch.compile default) on the "
                     "same step with decisive routing (every top-k router forced to fixed experts): every "
                     "value finite, and the per-token relative L2 error at most the median / max "
                     "tolerances; the same numbers with the model's own routing are reported, not judged "
                     "(bf16 near-ties can flip an expert choice); B=1 is also checked against row 0 of "
                     "the larger batch"),
        },
        "setup": {}, "compile": [], "cases": [], "notes": [], "kernel_benches": [],
    }


def _fmt_us(us: float | None) -> str:
    if us is None or (isinstance(us, float) and math.isnan(us)):
        return "-"
    return f"{us / 1000:.3f} ms" if us >= 1000 else f"{us:.1f} µs"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _forms_cell(case: dict) -> str:
    """The other forms of the optimize() step: time and ratio to torch.compile default."""
    ratios = case.get("speedup_forms_vs_compile_default", {})
    cells = [f"{FORM_NAMES[form]} {_fmt_us(us)} ({_ratio(ratios.get(form))})"
             for form, us in case.get("us_forms", {}).items()]
    cells += [f"{FORM_NAMES[form]} {status}" for form, status in case.get("forms_status", {}).items()]
    return "; ".join(cells) or "-"


def case_line(case: dict) -> str:
    """One line per finished case, for the console."""
    head = f"[B={case['B']} T={case['T']} ctx={case['ctx']}]"
    if "skipped" in case:
        return f"{head} skipped ({case['skipped']})"
    times = " | ".join(f"{VARIANT_NAMES[v]} {_fmt_us(us)}" for v, us in case["us"].items())
    worst = max((c.get("max_err", 0.0) for c in case["check"].values()), default=0.0)
    ratio = case.get("speedup_vs_compile_default")
    versus = "" if ratio is None else f" | x{ratio:.2f} vs torch.compile default"
    if case.get("us_forms") or case.get("forms_status"):
        versus += f" ({_forms_cell(case)})"
    return f"{head} {times}{versus} | correct: {'yes' if case['correct'] else 'NO'} (max token err {worst:.2e})"


def evaluate_targets(results: dict) -> list[dict]:
    """The issue's targets as {target, value, met (True / False / None when not measured)}."""
    rows = []
    for batch, tokens, context, minimum in SPEEDUP_TARGETS:
        case = next((c for c in results["cases"] if (c["B"], c["T"], c["ctx"]) == (batch, tokens, context)
                     and "skipped" not in c), None)
        name = f"B={batch} T={tokens} ctx={context} max ctx 1M: optimize() >= {minimum:g}x torch.compile default"
        ratio = None if case is None else case.get("speedup_vs_compile_default")
        if ratio is None:
            why = "case not run" if case is None else f"baseline status: {case['status'].get('compile_default')}"
            rows.append({"target": name, "value": f"not measured ({why})", "met": None})
        else:
            rows.append({"target": name, "value": f"{ratio:.2f}x", "met": ratio >= minimum and case["correct"]})
    compiles = [c for c in results["compile"] if c["variant"] == "optimize" and c["seconds"] is not None]
    name = f"compile time of each optimize() graph of the 4-layer slice <= {COMPILE_TARGET_S:g} s"
    if compiles:
        worst = max(compiles, key=lambda c: c["seconds"])
        rows.append({"target": name, "value": f"{worst['seconds']:.1f} s (B={worst['B']} T={worst['T']}, "
                                              f"the slowest of {len(compiles)})",
                     "met": worst["seconds"] <= COMPILE_TARGET_S})
    else:
        rows.append({"target": name, "value": "not measured", "met": None})
    configs = [r for b in results.get("kernel_benches") or [] for r in b["shared_memory"]]
    configs += results.get("sm120_check", [])
    if configs:
        met, summary = shared_memory_verdict(configs)
        rows.append({"target": "shared memory <= 101,376 B (sm_120) for every compiled kernel config",
                     "value": summary, "met": met})
    return rows


def _verdict(met: bool | None) -> str:
    return {True: "**met**", False: "**missed**", None: "not measured / not verified"}[met]


def _case_table(results: dict) -> list[str]:
    lines = ["| B | T | ctx | eager | torch.compile default | optimize() (Engine.step, host inputs) | vs default | "
             "vs eager | other forms of the optimize() step (vs default) | correct (per-token logits error vs the reference) | "
             "tok/s @43 layers: default | optimize |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in results["cases"]:
        if "skipped" in c:
            lines.append(f"| {c['B']} | {c['T']} | {c['ctx']} | skipped: {c['skipped']} | | | | | | | | |")
            continue
        cells = []
        for variant in ("eager", "compile_default", "optimize"):
            status = c["status"].get(variant)
            cells.append(_fmt_us(c["us"].get(variant)) if variant in c["us"]
                         else ("not run" if status is None else status.split(":")[0]))
        notes = [f"{VARIANT_NAMES[v]} median {ch['median_err']:.1e} max {ch['max_err']:.1e}"
                 for v, ch in c["check"].items() if "max_err" in ch]
        notes += [f"{VARIANT_NAMES[v]} row 0 vs larger B {ch['max_err']:.1e}"
                  for v, ch in c.get("batch_consistency", {}).items()]
        notes += [f"own routing: {VARIANT_NAMES[v]} {ch['tokens_within_max_tol']:.0%} of tokens within max, "
                  f"argmax {ch['argmax_agree']:.0%}" for v, ch in c["check_model_routing"].items() if "max_err" in ch]
        tok = c["tok_s_43_layers"]
        lines.append(
            f"| {c['B']} | {c['T']} | {c['ctx']} | {' | '.join(cells)} | "
            f"{_ratio(c.get('speedup_vs_compile_default'))} | {_ratio(c.get('speedup_vs_eager'))} | "
            f"{_forms_cell(c)} | "
            f"{'yes' if c['correct'] else '**NO**'} ({'; '.join(notes) or 'finite only'}) | "
            f"{tok.get('compile_default', float('nan')):,.0f} | {tok.get('optimize', float('nan')):,.0f} |")
    return lines


def _compile_table(results: dict) -> list[str]:
    lines = ["| B | T | variant | compile s (first call) | status | peak GB | cudagraph skips | dsv4 passes matched "
             "| compile phases, s (nested) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in results["compile"]:
        seconds = "-" if c["seconds"] is None else f"{c['seconds']:.1f}"
        passes = ", ".join(f"{k} {v}" for k, v in c.get("pass_matches", {}).items())
        if c.get("pass_declines"):
            passes += "; declined: " + "; ".join(c["pass_declines"])
        peak = f"{c['peak_gb']:.1f}" if "peak_gb" in c else "-"
        phases = ", ".join(f"{name} {t:.1f}" for name, t in c.get("phases_s", {}).items())
        lines.append(f"| {c['B']} | {c['T']} | {VARIANT_NAMES[c['variant']]} | {seconds} | {c['status']} | {peak} | "
                     f"{c.get('cudagraph_skips', '-')} | {passes or '-'} | {phases or '-'} |")
    return lines


def _idle_note(found: dict) -> str:
    """How long the GPU waited between kernels in the profiled calls (CUDA profiles only)."""
    if "gpu_idle_us_per_step" not in found:
        return ""
    return (f"; in the profiled calls the GPU was idle {_fmt_us(found['gpu_idle_us_per_step'])} of a "
            f"{_fmt_us(found['gpu_span_us_per_step'])} span per step")


def _breakdown_tables(results: dict, top: int = 8) -> list[str]:
    lines = []
    for c in results["cases"]:
        for variant, found in c.get("breakdown", {}).items():
            if "kernels" not in found:
                lines.append(f"- B={c['B']} T={c['T']} ctx={c['ctx']} {VARIANT_NAMES[variant]}: "
                             f"{found.get('error', 'no profile')}")
                continue
            lines += ["", f"**B={c['B']} T={c['T']} ctx={c['ctx']}, {VARIANT_NAMES[variant]}**: "
                          f"{_fmt_us(found['total_us_per_step'])} of kernel time per step "
                          f"(step median {_fmt_us(c['us'].get(variant))}){_idle_note(found)}", "",
                      "| kernel | per step | share |", "|---|---|---|"]
            lines += [f"| `{k['name'][:90]}` | {_fmt_us(k['us_per_step'])} | {k['share']:.1%} |"
                      for k in found["kernels"][:top]]
            shown = sum(k["share"] for k in found["kernels"][:top])
            lines.append(f"| (other) | | {1.0 - shown:.1%} |")
    return lines


def shared_memory_verdict(rows: list[dict]) -> tuple[bool | None, str]:
    """(met, summary) of the sm_120 shared-memory check over config rows: missed if any config
    is over 101,376 B, met if every one was checked and fits, else not verified."""
    checked = [r for r in rows if r["shared"] is not None]
    over = [r for r in rows if r["status"] == "over"]
    largest = max((r["shared"] for r in checked), default=0)
    summary = f"{len(checked)} of {len(rows)} configs checked, largest {largest:,} B, {len(over)} over the limit"
    if over:
        return False, summary
    if not rows or len(checked) < len(rows):
        return None, summary
    return True, summary


def _kernel_bench_sections(results: dict) -> list[str]:
    benches = results.get("kernel_benches") or []
    rows = [r for b in benches for r in b["shared_memory"]] + results.get("sm120_check", [])
    if not benches and not rows:
        return []
    lines = ["", "## Kernel floor tables and the sm_120 shared-memory check", ""]
    if benches:
        lines += ["Each bench's own command, checks and tables follow (raw outputs in kernel_benches.tar.gz).", "",
                  "| bench | status | seconds | compiled configs it reports |", "|---|---|---|---|"]
        lines += [f"| {b['name']} | {b['status']} | {b['seconds']} | {len(b['shared_memory'])} |" for b in benches]
    met, summary = shared_memory_verdict(rows)
    lines += ["", f"Shared memory <= 101,376 B for every compiled config (the benches' reports, and every config "
                  f"of the dsv4 kernels compiled in this run cross-compiled for sm_120): {_verdict(met)} ({summary})",
              "", "| source | config | shared B | registers / spill B (sm_120) | status |", "|---|---|---|---|---|"]
    lines += [f"| {r['bench']} | `{r['config']}` | {r['shared'] if r['shared'] is not None else '-'} | "
              f"{r.get('regs', '-')} / {r.get('spills', '-')} | {r['status']} |" for r in rows]
    for b in benches:
        if b["markdown"]:
            lines += ["", f"### {b['name']}", "", b["markdown"]]
    return lines


def markdown(results: dict) -> str:
    meta, setup = results["meta"], results["setup"]
    lines = [f"# End-to-end DeepSeek-V4 step ({meta['suite']})", "",
             f"- command: `{meta['command']}`",
             f"- date: {meta['date']}; git commit: {meta['git_commit']}; sources sha256 {meta.get('source_hash', '-')}",
             f"- torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}, "
             f"Python {meta['python']}; device: {meta['device']}"]
    if setup:
        caches = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in setup["cache_bytes"].items())
        lines += [f"- model: {setup['model']}; random weights",
                  f"- engine: max_batch {setup['max_batch']}, max_context {setup['max_context']:,}, "
                  f"verify_tokens {setup['verify_tokens']}; caches {setup['cache_gb']:.2f} GB ({caches}); "
                  f"weights {setup['weight_gb']:.2f} GB (+ {setup['fused_projection_copies_gb']:.2f} GB of fused "
                  f"projection copies)"
                  + (f"; free after set-up {setup['free_gb']:.1f} of {setup['total_gb']:.1f} GB" if "free_gb" in setup
                     else "")]
    tol = results["tolerance"]
    lines += [f"- correctness: {tol['rule']}; tolerances: median {tol['median']:g}, max {tol['max']:g}",
              "- times: medians of triton.testing.do_bench (L2 flushed before each run); the compiled "
              "variants replay CUDA graphs (graph trees); on CPU (smoke) wall clock, not a measurement",
              "- tok/s @43 layers is an extrapolation: (step - head) / 4 layers x 43 + head, head = eager "
              "embedding + hc_head + norm + lm_head at the same (B, T); T=4 counts all 4 tokens (an upper "
              "bound: every draft accepted)", "", "## Targets", ""]
    lines += [f"- {t['target']}: {t['value']} — {_verdict(t['met'])}" for t in evaluate_targets(results)]
    lines += ["", "## Step times", ""] + _case_table(results)
    lines += ["", "## Compile (first call: tracing, inductor, Triton builds, CUDA-graph warm-up)", ""]
    lines += _compile_table(results)
    lines += ["", "## Where the step time goes (torch.profiler, self time per kernel)"] + _breakdown_tables(results)
    lines += _kernel_bench_sections(results)
    if results.get("error"):
        lines += ["", "## The run stopped on an error", "", "```", results["error"], "```"]
    if results["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in results["notes"]]
    if results.get("pass_report"):
        lines += ["", "## dsv4 pass report", "", "```", results["pass_report"], "```"]
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, results: dict) -> None:
    """(Re)writes out/e2e.json and out/e2e.md from the results so far."""
    out.mkdir(parents=True, exist_ok=True)
    results["targets"] = evaluate_targets(results)
    (out / "e2e.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "e2e.md").write_text(markdown(results))


def write_plots(out: Path, results: dict) -> list[str]:
    """speedup_vs_context.png and step_breakdown.png; returns the files written, or a note that
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        note = "plots skipped: matplotlib is not installed"
        log.warning(note)
        results["notes"].append(note)
        return []
    cases = [c for c in results["cases"] if "skipped" not in c]
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, base in zip(axes, ("compile_default", "eager")):
        for batch, tokens in sorted({(c["B"], c["T"]) for c in cases}):
            points = [(c["ctx"], c[f"speedup_vs_{base}"]) for c in cases
                      if (c["B"], c["T"]) == (batch, tokens) and f"speedup_vs_{base}" in c]
            if points:
                ax.plot(*zip(*points), marker="o", label=f"B={batch} T={tokens}")
        ax.set(xscale="log", yscale="log", xlabel="context (tokens)",
               ylabel=f"optimize() speed-up over {VARIANT_NAMES[base]}", title=f"vs {VARIANT_NAMES[base]}")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no case with both variants", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_context.png", dpi=120)
    plt.close(fig)
    written.append("speedup_vs_context.png")

    profiled = [(c, c["breakdown"]["optimize"]) for c in cases
                if "kernels" in c.get("breakdown", {}).get("optimize", {})]
    if profiled:
        names = []
        for _, found in profiled:
            names += [k["name"] for k in found["kernels"][:5] if k["name"] not in names]
        fig, ax = plt.subplots(figsize=(13, 0.45 * len(profiled) + 2.5))
        labels = [f"B={c['B']} T={c['T']} ctx={c['ctx']} ({_fmt_us(found['total_us_per_step'])})"
                  for c, found in profiled]
        left = [0.0] * len(profiled)
        for name in names + ["(other)"]:
            shares = [next((k["share"] for k in found["kernels"] if k["name"] == name), 0.0) if name != "(other)"
                      else 1.0 - sum(k["share"] for k in found["kernels"] if k["name"] in names)
                      for _, found in profiled]
            # matplotlib leaves labels that start with "_" out of the legend (Triton kernel names do)
            ax.barh(labels, shares, left=left, label=name[:70].lstrip("_"))
            left = [a + b for a, b in zip(left, shares)]
        ax.set(xlabel="share of the step's kernel time (kernel time per step in brackets)", xlim=(0, 1),
               title="optimize() step time by kernel (torch.profiler)")
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        fig.savefig(out / "step_breakdown.png", dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append("step_breakdown.png")
    return written


if __name__ == "__main__":
    print(source_hash())
