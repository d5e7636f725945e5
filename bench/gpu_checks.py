"""GPU checks for the foundation: transformers parity in fp32 and bf16, and one optimize() decode
and verify under CUDA graph trees with the dsv4 passes (MXFP4 experts), counting cudagraph skips.

python bench/gpu_checks.py --out DIR     (needs CUDA; writes DIR/gpu_checks.json, prints a summary)
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import dsv4_compile  # noqa: E402
from dsv4_compile.model.fp4_experts import quantize_experts_  # noqa: E402
from dsv4_compile.tiny import FAST_COMPILE_OVERRIDES, tiny_model  # noqa: E402
from helpers import make_prompts, transformers_greedy  # noqa: E402

LENGTHS = (70, 41, 23)
NEW = 32


def parity(dtype: torch.dtype, device: str) -> dict:
    """Uncompiled static step vs transformers generate (the 5-layer tiny model): tokens per prompt."""
    model = tiny_model(seed=0, dtype=dtype, device=device)
    engine = dsv4_compile.optimize(model, max_batch=4, max_context=256, compile=False)
    prompts = make_prompts(LENGTHS, model.config.vocab_size, seed=3)
    got = engine.generate(prompts, NEW)
    expected = [transformers_greedy(model, p, NEW) for p in prompts]
    first_diff = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), None) for g, e in zip(got, expected)]
    return {"dtype": str(dtype), "tokens_match": got == expected, "first_mismatch_per_prompt": first_diff}


def compiled_run(dtype: torch.dtype, device: str) -> dict:
    """optimize() with MXFP4 experts under CUDA graph trees: decode and verify tokens vs the
    uncompiled engine, cudagraph skips, pass counts, compile and step times."""
    from torch._dynamo.utils import counters

    model = tiny_model(seed=2, dtype=dtype, device=device, **FAST_COMPILE_OVERRIDES)
    quantize_experts_(model, "mxfp4")
    prompts = make_prompts((37, 22, 9), model.config.vocab_size, seed=2)
    eager = dsv4_compile.optimize(model, max_batch=4, max_context=256, verify_tokens=3, compile=False)
    expected = eager.generate(prompts, 16)
    counters.clear()
    engine = dsv4_compile.optimize(model, max_batch=4, max_context=256, verify_tokens=3)
    start = time.perf_counter()
    first = engine.generate(prompts, 16)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    again = engine.generate(prompts, 16)
    steady_ms = 1e3 * (time.perf_counter() - start) / 16
    spec = engine.generate(prompts, 16, draft="ngram")
    return {
        "dtype": str(dtype),
        "decode_tokens_match_uncompiled": first == expected and again == expected,
        "ngram_verify_tokens_match": spec == expected,
        "acceptance": engine.last_acceptance,
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "pass_counts": {name: {g: engine.report.count(name, g) for g in ("T=1", "T=4")}
                        for name in ("indexer", "sparse_mla", "fp4_moe")},
        "first_generate_s_incl_compile": round(compile_s, 1),
        "generate_ms_per_token_steady": round(steady_ms, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"torch": torch.__version__, "device": args.device}
    checks = (("compiled_bf16", lambda: compiled_run(torch.bfloat16, args.device)),
              ("parity_fp32", lambda: parity(torch.float32, args.device)),
              ("parity_bf16", lambda: parity(torch.bfloat16, args.device)))
    for name, check in checks:  # results are written after each check, so a timeout keeps them
        results[name] = check()
        (out / "gpu_checks.json").write_text(json.dumps(results, indent=2))
        print(name, json.dumps(results[name]), flush=True)


if __name__ == "__main__":
    main()
