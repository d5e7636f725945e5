"""Timing, profiling and logits comparison for the end-to-end bench, on CUDA or on CPU."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

Step = Callable[[], Any]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_timer(device: torch.device) -> Callable[..., float]:
    """timer(fn, heavy=False) -> median microseconds of one call of fn.

    CUDA: triton.testing.do_bench medians (L2 flushed before each run; `heavy` uses fewer
    repetitions for steps of tens of milliseconds). CPU: the wall clock of one run of
    a step that has already run (the smoke mode only checks that the path works).
    """
    if device.type == "cuda":
        import triton.testing

        def cuda_timer(fn: Step, heavy: bool = False) -> float:
            warmup, rep = (5, 30) if heavy else (25, 100)
            return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3
        return cuda_timer

    def cpu_timer(fn: Step, heavy: bool = False) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    return cpu_timer


def timed_first_call(fn: Step, device: torch.device) -> tuple[Any, float]:
    """(fn's result, seconds) of one call, synchronised: for a compiled step this is its compile
    time (tracing, inductor, Triton builds and the CUDA-graph warm-up run)."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


def compile_phase_seconds() -> dict[str, float]:
    """Cumulative seconds of each phase torch times while compiling (dynamo's
    compilation_time_metrics: tracing, AOT, inductor lowering and codegen, waits on Triton and C++
    builds, the post-grad passes, ...). Phases nest, so they do not add up to the total."""
    from torch._dynamo.utils import compilation_time_metrics

    return {name: sum(times) for name, times in compilation_time_metrics.items()}


def _event_time_us(event: Any, device: torch.device) -> float:
    if device.type == "cuda":
        value = getattr(event, "self_device_time_total", None)
        return float(value if value is not None else event.self_cuda_time_total)
    return float(event.self_cpu_time_total)


def busy_and_span(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(time covered by the union of the [start, end] intervals, last end - first start); 0s if none."""
    ordered = sorted(intervals)
    if not ordered:
        return 0.0, 0.0
    busy, reach = 0.0, ordered[0][0]
    for start, end in ordered:
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return busy, reach - ordered[0][0]


def kernel_breakdown(fn: Step, device: torch.device, steps: int = 3, top: int = 40) -> dict:
    """Where the time of `steps` calls of fn goes, from torch.profiler.

    CUDA: every GPU kernel / memcpy / memset by self device time (kernels replayed inside CUDA
    graphs included). CPU: every op by self CPU time. Returns {"total_us_per_step",
    "kernels": [{"name", "us_per_step", "share"}] (the `top` largest, share of the total),
    "other_share"}; on CUDA also "gpu_span_us_per_step" (first kernel start to last kernel end
    over the calls, per call) and "gpu_idle_us_per_step" (the part of that span in which no
    kernel, copy or fill ran: launch gaps, and the host where the GPU waited for it).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        fn()  # a warm step right before the profiled ones (the CPU smoke skips it: its steps are slow)
        synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        synchronize(device)
    wanted = DeviceType.CUDA if device.type == "cuda" else DeviceType.CPU
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type != wanted or event.key.startswith("ProfilerStep"):
            continue
        spent = _event_time_us(event, device)
        if spent > 0:
            times[event.key] = times.get(event.key, 0.0) + spent
    total = sum(times.values())
    ranked = sorted(times.items(), key=lambda item: -item[1])[:top]
    kernels = [{"name": name, "us_per_step": spent / steps, "share": spent / total} for name, spent in ranked]
    found = {"total_us_per_step": total / steps, "kernels": kernels,
             "other_share": 1.0 - sum(k["share"] for k in kernels) if total else 0.0}
    if device.type == "cuda":
        busy, span = busy_and_span([(e.time_range.start, e.time_range.end) for e in prof.events()
                                    if e.device_type == wanted and e.time_range.end > e.time_range.start])
        found.update(gpu_span_us_per_step=span / steps, gpu_idle_us_per_step=(span - busy) / steps)
    return found


def compare_logits(got: torch.Tensor, ref: torch.Tensor, median_tol: float, max_tol: float) -> dict:
    """got, ref [B, T, V] logits. Per token: the relative L2 error ||got - ref|| / ||ref||.
    ok: every value finite, the median token error <= median_tol and the largest <= max_tol."""
    g = got.detach().float().flatten(0, -2)
    r = ref.detach().float().flatten(0, -2)
    err = (g - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    finite = bool(torch.isfinite(g).all() and torch.isfinite(r).all())
    max_err, median_err = float(err.max()), float(err.median())
    return {"ok": finite and median_err <= median_tol and max_err <= max_tol, "finite": finite,
            "median_tol": median_tol, "max_tol": max_tol, "max_err": max_err, "median_err": median_err,
            "tokens_within_max_tol": float((err <= max_tol).float().mean()),
            "argmax_agree": float((g.argmax(-1) == r.argmax(-1)).float().mean())}
