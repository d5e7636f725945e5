"""Random bad input to every public entry gives a TypeError/ValueError that names the argument,
never a crash deep inside torch or a silent result, and the engine keeps working afterwards."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dsv4_compile
from dsv4_compile.tiny import tiny_model

MAX_BATCH, MAX_CONTEXT, VERIFY = 2, 256, 2


@pytest.fixture(scope="module")
def engine():
    model = tiny_model(seed=0)
    return dsv4_compile.optimize(model, max_batch=MAX_BATCH, max_context=MAX_CONTEXT, verify_tokens=VERIFY,
                                 compile=False)


@pytest.fixture(scope="module")
def good(engine):
    return engine.generate([[5, 6, 7]], 3)


def _bad_token():
    return st.one_of(st.integers(max_value=-1), st.integers(min_value=256), st.floats(), st.text(max_size=2),
                     st.booleans())


@st.composite
def bad_generate_calls(draw):
    """(prompts, max_new_tokens, draft, the argument name the error must contain)."""
    kind = draw(st.sampled_from(["token", "empty", "batch", "length", "new", "draft", "prompts_type"]))
    prompt = draw(st.lists(st.integers(0, 255), min_size=1, max_size=20))
    if kind == "token":
        bad = list(prompt)
        bad.insert(draw(st.integers(0, len(bad))), draw(_bad_token()))
        return [bad], 2, None, "prompts[0]"
    if kind == "empty":
        return [prompt, []][: draw(st.integers(1, 2))] + [[]], 2, None, "prompts"
    if kind == "batch":
        return [prompt] * draw(st.integers(MAX_BATCH + 1, 6)), 2, None, "max_batch"
    if kind == "length":
        return [prompt], MAX_CONTEXT - len(prompt) + draw(st.integers(1, 50)), None, "max_context"
    if kind == "new":
        return [prompt], draw(st.one_of(st.integers(max_value=-1), st.floats(), st.text(max_size=1))), None, \
            "max_new_tokens"
    if kind == "draft":
        count = draw(st.integers(VERIFY + 1, 6))
        return [prompt], 3, (lambda tokens: [1] * count), "verify_tokens"
    return draw(st.one_of(st.text(max_size=3), st.integers(), st.just(None))), 2, None, "prompts"


@given(bad_generate_calls())
def test_generate_rejects_random_bad_input(engine, good, call):
    prompts, new, draft, name = call
    with pytest.raises((TypeError, ValueError), match=name.replace("[", r"\[").replace("]", r"\]")):
        engine.generate(prompts, new, draft=draft)
    assert engine.generate([[5, 6, 7]], 3) == good


@st.composite
def bad_step_calls(draw):
    """(input_ids, start_pos, rows, argument name) with exactly one thing wrong."""
    batch = draw(st.integers(1, MAX_BATCH))
    tokens = draw(st.integers(1, VERIFY + 1))
    ids = torch.randint(0, 256, (batch, tokens))
    start = torch.zeros(batch, dtype=torch.int64)
    rows = torch.arange(batch)
    kind = draw(st.sampled_from(["ids_dtype", "ids_value", "ids_rank", "start_value", "rows_value", "rows_shape",
                                 "batch", "tokens", "device", "not_tensor"]))
    if kind == "ids_dtype":
        return ids.to(draw(st.sampled_from([torch.int32, torch.float32]))), start, rows, "input_ids"
    if kind == "ids_value":
        ids[0, 0] = draw(st.one_of(st.integers(-1000, -1), st.integers(256, 10**6)))
        return ids, start, rows, "input_ids"
    if kind == "ids_rank":
        return ids.view(-1), start, rows, "input_ids"
    if kind == "start_value":
        start[0] = draw(st.one_of(st.integers(-1000, -1), st.integers(MAX_CONTEXT - tokens + 1, 10**6)))
        return ids, start, rows, "start_pos"
    if kind == "rows_value":
        rows[0] = draw(st.one_of(st.integers(-100, -1), st.integers(MAX_BATCH + 1, 1000)))
        return ids, start, rows, "rows"
    if kind == "rows_shape":
        return ids, start, torch.arange(batch + 1), "rows"
    if kind == "batch":
        extra = MAX_BATCH + draw(st.integers(1, 3))
        return torch.zeros(extra, 1, dtype=torch.int64), torch.zeros(extra, dtype=torch.int64), \
            torch.arange(extra), "batch"
    if kind == "tokens":
        wide = draw(st.integers(17, 40))  # the engine's step_tokens is max(16, VERIFY + 1) = 16
        return torch.zeros(1, wide, dtype=torch.int64), start[:1], rows[:1], "tokens per step"
    if kind == "device":  # meta: neither the host nor the engine's device (the engine is on the host here)
        moved = draw(st.integers(0, 2))
        call = [t.to("meta") if i == moved else t for i, t in enumerate((ids, start, rows))]
        return (*call, f"{('input_ids', 'start_pos', 'rows')[moved]} on meta")
    return ids.tolist(), start, rows, "input_ids"


@given(bad_step_calls())
def test_step_rejects_random_bad_input(engine, good, call):
    ids, start, rows, name = call
    with pytest.raises((TypeError, ValueError), match=name):
        engine.step(ids, start, rows)
    assert engine.generate([[5, 6, 7]], 3) == good


def test_eager_ops_name_the_bad_tensor():
    q = torch.randn(2, 1, 4, 16)
    with pytest.raises(ValueError, match="weights"):
        torch.ops.dsv4.indexer_topk(q, torch.randn(3, 1, 4), torch.randn(4, 64, 16), None,
                                    torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 1, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="idx"):
        torch.ops.dsv4.sparse_mla(torch.randn(1, 1, 2, 16), torch.randn(8, 16), None,
                                  torch.zeros(1, 2, 3, dtype=torch.int32), None, None, None, None, 0.25)
