"""The static-cache step against transformers' DeepseekV4ForCausalLM (fp32, CPU, uncompiled)."""
import pytest
import torch

import dsv4_compile
from dsv4_compile.tiny import tiny_model
from helpers import StepRecorder, make_prompts, transformers_greedy, transformers_logits

NEW_TOKENS = 32
# Prompt lengths cross several c4 (4) and HCA (16) windows and wrap the 16-token window.
LENGTHS = (70, 41, 23)
# fp32 throughout: the step and transformers sum in different orders, which moves logits by
# ~1e-6 of their scale; 1e-4 of the scale leaves room and still catches any real difference.
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.mark.parametrize("lengths", [LENGTHS[:1], LENGTHS], ids=["batch1", "batch3"])
def test_greedy_tokens_match_transformers(model, lengths):
    engine = dsv4_compile.optimize(model, max_batch=4, max_context=256, compile=False)
    prompts = make_prompts(lengths, model.config.vocab_size, seed=len(lengths))
    got = engine.generate(prompts, NEW_TOKENS)
    for prompt, tokens in zip(prompts, got):
        assert len(tokens) == NEW_TOKENS
        assert tokens == transformers_greedy(model, prompt, NEW_TOKENS)


def test_decode_logits_match_transformers(model):
    engine = dsv4_compile.optimize(model, max_batch=4, max_context=256, compile=False)
    recorder = StepRecorder(engine.compiled_step)
    engine.compiled_step = recorder
    prompts = make_prompts(LENGTHS, model.config.vocab_size, seed=7)
    new = engine.generate(prompts, 12)
    references = [transformers_logits(model, p + n[:-1]) for p, n in zip(prompts, new)]
    assert len(recorder.calls) == 11
    for _, start_pos, _, logits in recorder.calls:
        for b, reference in enumerate(references):
            expected = reference[int(start_pos[b])]
            assert (logits[b, 0] - expected).abs().max() <= REL_TOL * expected.abs().max()


def _prefilled_engine(model, prompts, verify_tokens):
    engine = dsv4_compile.optimize(model, max_batch=4, max_context=256, verify_tokens=verify_tokens,
                                   compile=False)
    first = engine.generate(prompts, 1)  # prefill only
    return engine, [f[0] for f in first]


@torch.no_grad()
def test_verify_step_equals_decode_steps(model):
    prompts = make_prompts(LENGTHS, model.config.vocab_size, seed=3)
    decode, first = _prefilled_engine(model, prompts, 0)
    verify, _ = _prefilled_engine(model, prompts, 3)
    batch = len(prompts)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.cat([torch.tensor(first)[:, None],
                        torch.randint(0, model.config.vocab_size, (batch, 3), generator=generator)], 1)
    start = torch.tensor([len(p) for p in prompts])
    rows = torch.arange(batch)
    stepwise = torch.cat([decode.module(tokens[:, t:t + 1], start + t, rows) for t in range(4)], 1)
    at_once = verify.module(tokens, start, rows)
    assert (at_once - stepwise).abs().max() <= REL_TOL * stepwise.abs().max()
    for b, prompt in enumerate(prompts):
        expected = transformers_logits(model, prompt + tokens[b].tolist())[len(prompt):]
        assert (at_once[b] - expected).abs().max() <= REL_TOL * expected.abs().max()


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
@torch.no_grad()
def test_rollback_after_verify_equals_decoding_the_accepted_drafts(model, accepted):
    """Verify [x, d1, d2, d3], keep d1..d_accepted: the cache must read as if x, d1..d_accepted
    had been decoded one by one, and the next step must agree."""
    prompts = make_prompts(LENGTHS, model.config.vocab_size, seed=11)
    decode, first = _prefilled_engine(model, prompts, 0)
    verify, _ = _prefilled_engine(model, prompts, 3)
    batch = len(prompts)
    generator = torch.Generator().manual_seed(accepted)
    drafts = torch.randint(0, model.config.vocab_size, (batch, 3), generator=generator)
    fed = torch.cat([torch.tensor(first)[:, None], drafts], 1)
    start = torch.tensor([len(p) for p in prompts])
    rows = torch.arange(batch)
    verify.module(fed, start, rows)
    for t in range(accepted + 1):
        decode.module(fed[:, t:t + 1], start + t, rows)
    for b, prompt in enumerate(prompts):
        length = len(prompt) + accepted + 1
        after_decode = decode.module.live_state(b, length)
        after_verify = verify.module.live_state(b, length)
        assert after_decode.keys() == after_verify.keys()
        for name, value in after_decode.items():
            torch.testing.assert_close(after_verify[name], value, rtol=1e-5, atol=1e-5, msg=name)
    following = torch.randint(0, model.config.vocab_size, (batch, 1), generator=generator)
    next_start = start + accepted + 1
    expected = decode.module(following, next_start, rows)
    got = verify.module(following, next_start, rows)
    assert (got - expected).abs().max() <= REL_TOL * expected.abs().max()
