"""Where the first call of optimize()'s step spends its time (a diagnosis, not a benchmark).

python bench/compile_profile.py B T   (CUDA; builds the bench's full-width 4-layer slice, max context 1M)

Prints the first call's wall time (under cProfile, which slows dynamo and inductor), every Triton
JIT compile in this process with its seconds (the dsv4 kernels; inductor compiles its own kernels
in worker processes), and cProfile's top functions by cumulative and by own time.
"""
import cProfile
import io
import pstats
import sys
import time

import torch
from triton.runtime.jit import JITFunction

import dsv4_compile
from bench.slice_model import build_slice, fill_caches_


def _time_jit_compiles(log: list) -> None:
    """Wraps Triton's JIT compile entry (a private method of triton 3.6) to record each compile."""
    original = JITFunction._do_compile

    def timed(self, key, signature, device, constexprs, options, attrs, warmup):
        start = time.perf_counter()
        kernel = original(self, key, signature, device, constexprs, options, attrs, warmup)
        log.append((self.fn.__name__, time.perf_counter() - start, str(dict(constexprs))[:160]))
        return kernel

    JITFunction._do_compile = timed


def main() -> None:
    if len(sys.argv) != 3 or not torch.cuda.is_available():
        raise SystemExit("usage: python bench/compile_profile.py B T   (needs CUDA)")
    batch, tokens = int(sys.argv[1]), int(sys.argv[2])
    compiles: list = []
    _time_jit_compiles(compiles)
    model = build_slice(torch.device("cuda"))
    engine = dsv4_compile.optimize(model, max_batch=batch, max_context=1 << 20, verify_tokens=3)
    fill_caches_(engine.module)
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), device="cuda")
    start = torch.full((batch,), 512, dtype=torch.int64, device="cuda")
    rows = torch.arange(batch, device="cuda")
    profile = cProfile.Profile()
    began = time.perf_counter()
    profile.enable()
    torch.compiler.cudagraph_mark_step_begin()
    engine.step(ids, start, rows)
    torch.cuda.synchronize()
    profile.disable()
    first = time.perf_counter() - began
    print(f"first call {first:.1f} s (under cProfile)")
    print(f"in-process Triton JIT compiles: {len(compiles)}, {sum(t for _, t, _ in compiles):.1f} s")
    for name, seconds, constexprs in sorted(compiles, key=lambda row: -row[1]):
        print(f"  {seconds:6.2f} s  {name}  {constexprs}")
    for order, lines in (("cumulative", 45), ("tottime", 25)):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(lines)
        print(text.getvalue())


if __name__ == "__main__":
    main()
