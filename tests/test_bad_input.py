"""Bad input to optimize() and generate() gives a clear error before any work is done."""
import pytest
import torch

import dsv4_compile
from dsv4_compile.tiny import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def engine(model):
    return dsv4_compile.optimize(model, max_batch=2, max_context=256, verify_tokens=2, compile=False)


def test_optimize_rejects_a_model_that_is_not_deepseek_v4():
    with pytest.raises(TypeError, match="DeepseekV4ForCausalLM; got Linear"):
        dsv4_compile.optimize(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("max_context, message", [
    (300, r"multiple of 4 x 64 indexer slots \(256\); got 300"),
    (0, r"max_context must be >= 1; got 0"),
])
def test_optimize_rejects_bad_max_context(model, max_context, message):
    with pytest.raises(ValueError, match=message):
        dsv4_compile.optimize(model, max_context=max_context)


def test_optimize_rejects_max_context_off_the_hca_rate(model):
    config = dict(model.config.compress_rates)
    model.config.compress_rates = {**config, "heavily_compressed_attention": 96}
    try:
        with pytest.raises(ValueError, match=r"multiple of the HCA rate \(96\); got 256"):
            dsv4_compile.optimize(model, max_context=256)
    finally:
        model.config.compress_rates = config


@pytest.mark.parametrize("kwargs, error, message", [
    ({"max_batch": 0}, ValueError, "max_batch must be >= 1; got 0"),
    ({"max_batch": 2.0}, TypeError, "max_batch must be an int; got float"),
    ({"verify_tokens": -1}, ValueError, r"verify_tokens must be \[0, 255\]; got -1"),
    ({"verify_tokens": 1000}, ValueError, r"verify_tokens must be \[0, 255\]; got 1000"),
    ({"passes": ""}, TypeError, "passes must be a tuple of pass names"),
    ({"passes": "indexer"}, TypeError, "passes must be a tuple of pass names"),
    ({"strict": "yes"}, TypeError, "strict must be a bool; got str"),
])
def test_optimize_rejects_bad_arguments(model, kwargs, error, message):
    with pytest.raises(error, match=message):
        dsv4_compile.optimize(model, max_context=256, **kwargs)


@pytest.mark.parametrize("prompts, new, error, message", [
    ([[1], [2], [3]], 1, ValueError, r"batch\) must be in \[1, max_batch=2\]; got 3"),
    ([], 1, ValueError, r"batch\) must be in \[1, max_batch=2\]; got 0"),
    ([[1, 2], []], 1, ValueError, r"prompts\[1\] is empty"),
    ([[1, 256]], 1, ValueError, r"token id 256; ids must be in \[0, 256\)"),
    ([[-1]], 1, ValueError, r"token id -1; ids must be in \[0, 256\)"),
    ([[1.5]], 1, TypeError, "token ids must be ints"),
    ("hello", 1, TypeError, "prompts must be a list of lists"),
    ([[1] * 250], 7, ValueError, r"max_new_tokens must be <= max_context=256; got 250 \+ 7"),
    ([[1]], -1, ValueError, "max_new_tokens must be >= 0; got -1"),
])
def test_generate_rejects_bad_input(engine, prompts, new, error, message):
    with pytest.raises(error, match=message):
        engine.generate(prompts, new)


def test_generate_rejects_too_many_drafts(engine):
    with pytest.raises(ValueError, match="at most verify_tokens=2 tokens; got 3"):
        engine.generate([[1, 2, 3]], 4, draft=lambda tokens: [1, 2, 3])


@pytest.mark.parametrize("proposal, error, message", [
    ([1, 256], ValueError, r"draft holds token id 256; ids must be in \[0, 256\)"),
    ([-5], ValueError, r"draft holds token id -5"),
    ([1.0], TypeError, "a draft's tokens must be ints; got a float"),
    ("ab", TypeError, "a draft's tokens must be ints; got a str"),
])
def test_generate_rejects_bad_draft_tokens(engine, proposal, error, message):
    with pytest.raises(error, match=message):
        engine.generate([[1, 2, 3]], 4, draft=lambda tokens: proposal)


def test_a_drafter_that_changes_its_list_changes_nothing(engine):
    """The drafter gets a copy of the request's tokens: appending to it does not reach the engine's."""
    plain = engine.generate([[7, 3, 9, 7, 3]], 8)
    assert engine.generate([[7, 3, 9, 7, 3]], 8, draft=lambda tokens: (tokens.append(1), [])[1]) == plain


def test_tuple_prompts_are_taken_as_lists(engine):
    assert engine.generate([(7, 3, 9)], 4) == engine.generate([[7, 3, 9]], 4)


def test_step_rejects_repeated_cache_rows(engine):
    """Two requests in one cache row would overwrite each other; only the scratch row may repeat."""
    with pytest.raises(ValueError, match="rows must be distinct"):
        engine.step(torch.tensor([[5], [9]]), torch.tensor([0, 0]), torch.tensor([1, 1]))
    scratch = engine.layout.scratch_row
    logits = engine.step(torch.tensor([[5], [9]]), torch.tensor([0, 0]), torch.tensor([scratch, scratch]))
    assert logits.shape[:2] == (2, 1)


def test_step_pads_a_batch_to_its_bucket(model):
    """A batch of 3 runs the bucket-of-4 graph (its fourth row in the scratch row) and returns 3 rows,
    equal to the step on those 3 rows alone."""
    engine = dsv4_compile.optimize(model, max_batch=4, max_context=256, compile=False)
    ids, start, rows = torch.tensor([[5], [9], [11]]), torch.tensor([0, 3, 1]), torch.tensor([2, 0, 1])
    seen = []
    step = engine.compiled_step
    engine.compiled_step = lambda *args: seen.append(tuple(a.shape[0] for a in args)) or step(*args)
    got = engine.step(ids, start, rows)
    assert seen == [(4, 4, 4)] and got.shape[:2] == (3, 1)
    # f32 products over 3 or 4 rows may block their sums differently (differences of ~1e-6)
    torch.testing.assert_close(got, engine.module(ids, start, rows), atol=1e-5, rtol=1e-5)


def test_compiled_step_budget_covers_every_step_shape(model):
    """step() may take any T up to step_tokens in every batch bucket: the recompile limit covers them
    all (a smaller one ends in a hard failure once used up, for generate too)."""
    with torch._dynamo.config.patch(recompile_limit=8):  # dynamo's default
        engine = dsv4_compile.optimize(model, max_batch=4, max_context=256, verify_tokens=2)  # compiles lazily
        assert torch._dynamo.config.recompile_limit >= 3 * engine.layout.step_tokens  # buckets 1, 2, 4


def test_generate_rejects_drafts_without_verify_tokens(model):
    plain = dsv4_compile.optimize(model, max_batch=1, max_context=256, compile=False)
    with pytest.raises(ValueError, match="verify_tokens >= 1; got verify_tokens=0"):
        plain.generate([[1, 2]], 2, draft="ngram")


def test_engine_still_works_after_bad_input(engine):
    with pytest.raises(ValueError):
        engine.generate([[1, 999]], 2)
    assert len(engine.generate([[1, 2, 3]], 3)[0]) == 3
