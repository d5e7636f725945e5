"""Batch buckets: mixed decode and verify steps with changing lengths and batch compositions
inside the buckets never recompile (CPU covers the recompile half; CUDA-graph skips need a GPU)."""
import random

import torch
from torch._dynamo.utils import counters

import dsv4_compile
from dsv4_compile.engine import batch_bucket
from dsv4_compile.tiny import tiny_model
from helpers import StepCounter

STEPS = 1000


def test_batch_bucket_sizes():
    assert [batch_bucket(b, 64) for b in (1, 2, 3, 4, 5, 17, 64)] == [1, 2, 4, 4, 8, 32, 64]
    assert batch_bucket(5, 6) == 6


def test_mixed_steps_never_recompile():
    model = tiny_model(seed=6, num_hidden_layers=2,
                       layer_types=["sliding_attention", "compressed_sparse_attention"],
                       mlp_layer_types=["hash_moe", "moe"], hc_sinkhorn_iters=2)
    # Recompiles are decided by dynamo's guards, whatever the passes do: plain inductor keeps the
    # 1,000 CPU steps fast (the dsv4 kernels would run in the Triton interpreter).
    engine = dsv4_compile.optimize(model, max_batch=2, max_context=512, verify_tokens=2, passes=())
    reference = dsv4_compile.optimize(model, max_batch=2, max_context=512, verify_tokens=2, compile=False)
    steps = StepCounter(engine)
    for batch in (1, 2):  # warm up every (bucket, T) graph
        engine.generate([[1, 2, 3]] * batch, 2)
        engine.generate([[1, 2, 3]] * batch, 3, draft=lambda tokens: [4, 5])
    graphs = counters["stats"]["unique_graphs"]
    rng = random.Random(0)
    checked = 0
    with torch.compiler.set_stance("fail_on_recompile"):
        while steps.calls < STEPS:
            batch = rng.randint(1, 2)
            prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 90))] for _ in range(batch)]
            new = rng.randint(1, 40)
            draft = rng.choice([None, "ngram", lambda tokens: [rng.randrange(256) for _ in range(rng.randint(0, 2))]])
            got = engine.generate(prompts, new, draft=draft)
            assert [len(g) for g in got] == [new] * batch
            if checked < 3:  # a few full comparisons with the uncompiled step
                assert got == reference.generate(prompts, new)
                checked += 1
    assert counters["stats"]["unique_graphs"] == graphs


def test_engines_keep_their_own_graph_budget():
    """Dynamo counts graphs per code object: each engine's step has its own, so engines in one
    process do not share dynamo's recompile_limit, and an engine raises the limit to its graph count."""
    model = tiny_model(seed=1, num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    expected = dsv4_compile.optimize(model, max_batch=1, max_context=256, compile=False).generate([[1, 2, 3]], 2)
    engines = [dsv4_compile.optimize(model, max_batch=1, max_context=256, passes=()) for _ in range(2)]
    with torch._dynamo.config.patch(recompile_limit=1):  # the engines compile lazily, under this limit
        for engine in engines:  # on a shared code object the second engine's graph would exceed the limit
            assert engine.generate([[1, 2, 3]], 2) == expected
        engine = dsv4_compile.optimize(model, max_batch=64, max_context=256, verify_tokens=3, compile=True, passes=())
        # buckets 1..64 (7) x the step's T in 1..step_tokens (16: step() may take any of them)
        assert engine.layout.step_tokens == 16 and torch._dynamo.config.recompile_limit == 7 * 16
