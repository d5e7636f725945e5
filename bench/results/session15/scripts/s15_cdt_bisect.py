"""Session 15: does inductor's coordinate descent tuning break the step on the tiny model too, and
which kernel is slow? bf16 tiny model with MXFP4 experts on CUDA, B=8 T=1 after a 40-token prefill.
Variants compile the same engine's step through compile_fx directly (the backend now refuses CDT)."""
import sys
import time

import torch
from torch._inductor.compile_fx import compile_fx

import dsv4_compile
from dsv4_compile.backend import DECODE_INDUCTOR_OPTIONS, DEFAULT_INDUCTOR_OPTIONS
from dsv4_compile.compiled_step import compile_step
from dsv4_compile.model.fp4_experts import quantize_experts_
from dsv4_compile.passes.manager import Dsv4PostGradPass, PassConfig, install_lowerings
from dsv4_compile.passes.report import PassReport
from dsv4_compile.tiny import FAST_COMPILE_OVERRIDES, tiny_model


def backend_with(passes, extra):
    config = PassConfig() if passes is None else PassConfig(passes=passes)

    def backend(gm, example_inputs):
        patches = {**DEFAULT_INDUCTOR_OPTIONS, **DECODE_INDUCTOR_OPTIONS, **extra, "triton.cudagraphs": True}
        patches["post_grad_custom_post_pass"] = Dsv4PostGradPass(config, PassReport(), "T=1")
        install_lowerings()
        return compile_fx(gm, example_inputs, config_patches=patches)
    return backend


def main():
    max_context = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    labels = sys.argv[2].split(",") if len(sys.argv) > 2 else ["base", "cdt"]
    variants = {"base": (None, {}), "cdt": (None, {"coordinate_descent_tuning": True}),
                "cdt_nopass": ((), {"coordinate_descent_tuning": True}), "nopass": ((), {})}
    model = tiny_model(seed=2, dtype=torch.bfloat16, device="cuda", **FAST_COMPILE_OVERRIDES)
    quantize_experts_(model, "mxfp4")
    engine = dsv4_compile.optimize(model, max_batch=8, max_context=max_context, verify_tokens=3, compile=False)
    gen = torch.Generator().manual_seed(0)
    batch, length = 8, 40
    for row in range(batch):
        engine._prefill(row, torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist())
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), generator=gen).cuda()
    start = torch.full((batch,), length, dtype=torch.int64, device="cuda")
    rows = torch.arange(batch, dtype=torch.int64, device="cuda")
    with torch.no_grad():
        ref = engine.module(ids, start, rows).float()
    print(f"max_context {max_context}, ref logits |max| {ref.abs().max().item():.3f}", flush=True)
    for label in labels:
        passes, extra = variants[label]
        torch._dynamo.reset()
        step = compile_step(engine.module, backend_with(passes, extra), 1)
        t0 = time.time()
        diffs = []
        with torch.no_grad():
            for _ in range(3):
                torch.compiler.cudagraph_mark_step_begin()
                diffs.append((step(ids, start, rows).float() - ref).abs().max().item())
            torch.cuda.synchronize()
            compile_s = time.time() - t0
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(20):
                torch.compiler.cudagraph_mark_step_begin()
                step(ids, start, rows)
            end.record()
            torch.cuda.synchronize()
            us = begin.elapsed_time(end) / 20 * 1e3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    torch.compiler.cudagraph_mark_step_begin()
                    step(ids, start, rows)
                torch.cuda.synchronize()
        print(f"[{label}] compile+3 runs {compile_s:.1f} s, step {us:.1f} us, max abs logits diff vs eager per run "
              f"{['%.3e' % d for d in diffs]}", flush=True)
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=6, max_name_column_width=110)
        print("\n".join(line[:200] for line in table.splitlines()), flush=True)


if __name__ == "__main__":
    main()
