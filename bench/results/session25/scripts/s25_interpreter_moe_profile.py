import os, sys, time, collections, dataclasses
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/tests")
import torch
from triton.runtime import interpreter
acc = collections.defaultdict(float); cnt = collections.Counter()
orig = interpreter.InterpretedFunction.run
def run(self, *a, **k):
    t = time.perf_counter(); r = orig(self, *a, **k)
    n = self.fn.__name__; acc[n] += time.perf_counter() - t; cnt[n] += 1; return r
interpreter.InterpretedFunction.run = run
import dsv4_compile
from dsv4_compile.kernels import fp4_moe as m
WIDE = len(sys.argv) > 1
if WIDE:
    for k, c in list(m.DEFAULT_CONFIGS.items()):
        if c.path == "mma":
            m.DEFAULT_CONFIGS[k] = dataclasses.replace(c, block_n=int(sys.argv[1]), down_block_n=int(sys.argv[2]), down_num_warps=1, num_warps=1, k_splits=1)
from bench.slice_model import smoke_model
from helpers import make_prompts
model = smoke_model()
eng = dsv4_compile.optimize(model, max_batch=2, max_context=256, verify_tokens=3)
prompts = make_prompts((20, 11), model.config.vocab_size, seed=1)
t = time.perf_counter(); out1 = eng.generate(prompts, 2); print("first (compile)", time.perf_counter() - t)
acc.clear(); cnt.clear()
t = time.perf_counter(); out = eng.generate(prompts, 3); tot = time.perf_counter() - t; print("3 tokens", tot, out)
for n, s in sorted(acc.items(), key=lambda x: -x[1])[:4]: print(f"{s:8.2f} s {cnt[n]:4d} {n}")
