"""The demo: a tiny random DeepSeek-V4, generated with transformers eager and with optimize()."""
import logging
import time

import torch

from .engine import optimize
from .model.fp4_experts import quantize_experts_
from .tiny import FAST_COMPILE_OVERRIDES, tiny_model

log = logging.getLogger("dsv4_compile")


def run_demo(new_tokens: int = 32, device: str | None = None) -> bool:
    """Generates `new_tokens` greedy tokens for two prompts both ways, logs the comparison,
    the time per step and the pass report; returns whether the tokens match."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = tiny_model(seed=0, device=device, **FAST_COMPILE_OVERRIDES)
    quantize_experts_(model, "mxfp4")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist() for n in (40, 25)]

    log.info("[1/3] transformers eager generate on %s (%d new tokens per prompt, MXFP4 experts)",
             device, new_tokens)
    start = time.perf_counter()
    reference = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        reference.append(out[0, len(prompt):].tolist())
    eager_step = (time.perf_counter() - start) / (len(prompts) * new_tokens)

    log.info("[2/3] optimize(): compiling the decode step (about a minute or two on a CPU)")
    engine = optimize(model, max_batch=2, max_context=256)
    start = time.perf_counter()
    engine.generate(prompts, 2)
    log.info("      compiled in %.1f s", time.perf_counter() - start)

    log.info("[3/3] optimize() generate")
    start = time.perf_counter()
    got = engine.generate(prompts, new_tokens)
    compiled_step = (time.perf_counter() - start) / new_tokens

    match = got == reference
    log.info("tokens match transformers: %s", match)
    log.info("time per step: transformers eager %.2f ms (one prompt per step), "
             "optimize() %.2f ms (both prompts per step, prefill included)",
             1e3 * eager_step, 1e3 * compiled_step)
    log.info("pass report (every expected dsv4 site):")
    _log_sites(engine)
    return match


def _log_sites(engine) -> bool:
    """Logs one line per expected site and graph; returns whether all matched."""
    rows = engine.site_status()
    for row in rows:
        verdict = "matched" if row.matched else f"NOT matched: {row.reason}"
        log.info("  %-5s layer %d  %-10s  %s", row.graph, row.layer, row.pass_name, verdict)
    return all(row.matched for row in rows)


def run_report(experts: str = "mxfp4", device: str | None = None) -> bool:
    """Compiles the tiny model's decode (T=1) and verify (T=4) graphs and logs every expected
    dsv4 site per layer and graph; returns whether all of them matched."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = tiny_model(seed=0, device=device, **FAST_COMPILE_OVERRIDES)
    if experts != "bf16":
        quantize_experts_(model, experts)
    engine = optimize(model, max_batch=1, max_context=256, verify_tokens=3)
    log.info("compiling the decode and verify graphs of the tiny model (%s experts) on %s", experts, device)
    engine.generate([[1, 2, 3, 1, 2]], 2)
    engine.generate([[1, 2, 3, 1, 2]], 4, draft="ngram")
    return _log_sites(engine)
