"""Hypothesis end to end: random tiny DeepSeek-V4 configs, batches, prompt lengths and drafts.
The static step (and, for a few draws, the compiled step) must equal transformers' generate."""
import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsv4_compile
from dsv4_compile.model.fp4_experts import quantize_experts_
from dsv4_compile.tiny import tiny_model
from helpers import transformers_greedy

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"


@st.composite
def configs(draw):
    layers = draw(st.lists(st.sampled_from(LAYER_TYPES), min_size=2, max_size=4))
    hash_layers = draw(st.integers(0, len(layers)))
    experts = draw(st.sampled_from([4, 8]))
    return {
        "num_hidden_layers": len(layers),
        "layer_types": layers,
        "mlp_layer_types": ["hash_moe"] * hash_layers + ["moe"] * (len(layers) - hash_layers),
        "num_attention_heads": draw(st.sampled_from([2, 4])),
        "hc_mult": draw(st.sampled_from([2, 4])),
        "hc_sinkhorn_iters": draw(st.integers(1, 4)),
        "index_topk": draw(st.integers(2, 8)),
        "sliding_window": draw(st.sampled_from([8, 16])),
        "compress_rates": {"compressed_sparse_attention": 4,
                           "heavily_compressed_attention": draw(st.sampled_from([8, 16]))},
        "n_routed_experts": experts,
        "num_experts_per_tok": draw(st.integers(1, 2)),
    }


@st.composite
def cases(draw):
    config = draw(configs())
    fmt = draw(st.sampled_from([None, "mxfp4", "nvfp4"]))
    prompts = draw(st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=60), min_size=1, max_size=3))
    verify = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**16))
    return config, fmt, prompts, verify, seed


def _model(config, fmt, seed):
    model = tiny_model(seed=seed, **config)
    if fmt is not None:
        quantize_experts_(model, fmt)
    return model


def _drafts(seed, verify):
    generator = torch.Generator().manual_seed(seed)
    return lambda tokens: torch.randint(0, 256, (int(torch.randint(0, verify + 1, (1,), generator=generator)),),
                                        generator=generator).tolist()


@given(cases())
def test_static_step_generates_like_transformers(case):
    config, fmt, prompts, verify, seed = case
    model = _model(config, fmt, seed)
    engine = dsv4_compile.optimize(model, max_batch=4, max_context=256, verify_tokens=verify, compile=False)
    new = 12
    got = engine.generate(prompts, new, draft=_drafts(seed, verify) if verify else None)
    assert got == [transformers_greedy(model, p, new) for p in prompts]


@settings(max_examples=20 if THOROUGH else 1)
@given(cases())
def test_compiled_step_generates_like_transformers(case):
    config, fmt, prompts, verify, seed = case
    model = _model(config, fmt, seed)
    engine = dsv4_compile.optimize(model, max_batch=4, max_context=256, verify_tokens=verify)
    new = 6
    got = engine.generate(prompts, new, draft=_drafts(seed, verify) if verify else None)
    assert got == [transformers_greedy(model, p, new) for p in prompts]
