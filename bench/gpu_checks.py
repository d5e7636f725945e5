"""GPU checks: transformers parity in fp32 and bf16; optimize() decode and verify under CUDA graph
trees with the dsv4 passes (MXFP4 experts), counting cudagraph skips; 1,000 mixed bucket steps
with no recompiles and no skips; n-gram speculative decoding against plain decode (tokens/s).

python bench/gpu_checks.py --out DIR     (needs CUDA; writes DIR/gpu_checks.json, prints a summary)
"""
import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import dsv4_compile  # noqa: E402
from dsv4_compile.model.fp4_experts import quantize_experts_  # noqa: E402
from dsv4_compile.tiny import FAST_COMPILE_OVERRIDES, tiny_model  # noqa: E402
from helpers import StepCounter, make_prompts, transformers_greedy  # noqa: E402

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
                        for name in ("indexer", "sparse_mla", "fp4_moe", "moe_route", "hc_sinkhorn")},
        "report": engine.report.format().splitlines(),
        "first_generate_s_incl_compile": round(compile_s, 1),
        "generate_ms_per_token_steady": round(steady_ms, 2),
    }


def bucket_steps(dtype: torch.dtype, device: str, steps_wanted: int = 1000) -> dict:
    """1,000 mixed decode and verify steps (batches 1..4 -> buckets 1, 2, 4; random prompts,
    lengths and drafts) of one optimize() engine with the dsv4 passes under CUDA graph trees:
    recompiles (fail_on_recompile) and cudagraph skips, a few results against the uncompiled step."""
    import random

    from torch._dynamo.utils import counters

    model = tiny_model(seed=6, dtype=dtype, device=device, **FAST_COMPILE_OVERRIDES)
    quantize_experts_(model, "mxfp4")
    engine = dsv4_compile.optimize(model, max_batch=4, max_context=512, verify_tokens=3)
    reference = dsv4_compile.optimize(model, max_batch=4, max_context=512, verify_tokens=3, compile=False)
    vocab = model.config.vocab_size
    steps = StepCounter(engine)
    counters.clear()
    start = time.perf_counter()
    for batch in (1, 2, 4):  # warm up every (bucket, T) graph
        engine.generate([[1, 2, 3]] * batch, 2)
        engine.generate([[1, 2, 3]] * batch, 3, draft=lambda tokens: [4, 5, 6])
    warm_s = time.perf_counter() - start
    graphs = counters["stats"]["unique_graphs"]
    rng = random.Random(0)
    matches, compared = 0, 0
    steps.calls = 0
    start = time.perf_counter()
    with torch.compiler.set_stance("fail_on_recompile"):
        while steps.calls < steps_wanted:
            batch = rng.randint(1, 4)
            prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 200))] for _ in range(batch)]
            new = rng.randint(1, 40)
            draft = rng.choice([None, "ngram", lambda tokens: [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]])
            got = engine.generate(prompts, new, draft=draft)
            assert [len(g) for g in got] == [new] * batch
            if compared < 4:
                compared += 1
                matches += got == reference.generate(prompts, new)
    return {
        "dtype": str(dtype), "steps": steps.calls, "graphs_after_warmup": graphs,
        "graphs_after_steps": counters["stats"]["unique_graphs"],
        "recompiles": counters["stats"]["unique_graphs"] - graphs,
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "generates_equal_to_uncompiled": f"{matches}/{compared}",
        "warmup_s_incl_compile": round(warm_s, 1), "steps_s": round(time.perf_counter() - start, 1),
    }


def ngram_speed(dtype: torch.dtype, device: str, new_tokens: int = 128) -> dict:
    """Plain greedy decode vs speculative decoding (verify width 4), one request on a repetitive
    prompt, the same compiled engine: tokens/s of whole generate() calls (the prefill is the same
    in each), acceptance and whether the tokens equal plain decoding. Drafts: "ngram" (prompt
    lookup), "oracle" (the plain run's own next tokens: every draft right, the upper bound) and
    "wrong" (never right: the cost of a useless verify)."""
    model = tiny_model(seed=0, dtype=dtype, device=device, **FAST_COMPILE_OVERRIDES)
    quantize_experts_(model, "mxfp4")
    engine = dsv4_compile.optimize(model, max_batch=1, max_context=1024, verify_tokens=3)
    vocab = model.config.vocab_size
    prompt = make_prompts((12,), vocab, seed=5)[0] * 8
    engine.generate([prompt], 8)
    engine.generate([prompt], 8, draft="ngram")

    def timed(draft):
        times, out = [], None
        for _ in range(3):
            start = time.perf_counter()
            out = engine.generate([prompt], new_tokens, draft=draft)
            times.append(time.perf_counter() - start)
        return out, sorted(times)[1], engine.last_acceptance

    plain, plain_s, _ = timed(None)
    truth = plain[0]

    def oracle(tokens: list[int]) -> list[int]:
        done = len(tokens) - len(prompt)
        return truth[done:done + 3]

    def wrong(tokens: list[int]) -> list[int]:
        done = len(tokens) - len(prompt)
        return [(t + 1) % vocab for t in truth[done:done + 3]]

    result = {"dtype": str(dtype), "prompt_tokens": len(prompt), "new_tokens": new_tokens,
              "plain_tokens_per_s": round(new_tokens / plain_s, 1)}
    for name, draft in (("ngram", "ngram"), ("oracle", oracle), ("wrong", wrong)):
        out, seconds, acceptance = timed(draft)
        result[name] = {"tokens_per_s": round(new_tokens / seconds, 1), "speedup": round(plain_s / seconds, 2),
                        "acceptance": acceptance, "tokens_equal": out == plain,
                        "first_mismatch": next((i for i, (a, b) in enumerate(zip(out[0], truth)) if a != b), None)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", default=None, help="comma list of check names")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"torch": torch.__version__, "device": args.device}
    checks = (("compiled_bf16", lambda: compiled_run(torch.bfloat16, args.device)),
              ("ngram_fp32", lambda: ngram_speed(torch.float32, args.device)),
              ("ngram_bf16", lambda: ngram_speed(torch.bfloat16, args.device)),
              ("buckets_bf16", lambda: bucket_steps(torch.bfloat16, args.device)),
              ("parity_fp32", lambda: parity(torch.float32, args.device)),
              ("parity_bf16", lambda: parity(torch.bfloat16, args.device)))
    only = set(args.only.split(",")) if args.only else None
    for name, check in checks:  # results are written after each check, so a timeout keeps them
        if only is not None and name not in only:
            continue
        try:
            results[name] = check()
        except Exception as exc:  # one failing check must not hide the others' results
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        (out / "gpu_checks.json").write_text(json.dumps(results, indent=2))
        print(name, json.dumps(results[name]), flush=True)


if __name__ == "__main__":
    main()
