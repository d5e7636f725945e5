"""optimize(): the compiled step equals the uncompiled step (tokens and logits), decode and verify,
with the dsv4 passes rewriting the hot spots (the model's experts are MXFP4)."""
import pytest
import torch

import dsv4_compile
from dsv4_compile.model.fp4_experts import quantize_experts_
from helpers import BmmToMmOnCpu, OnlineSoftmaxOnCpu, PadBmmAsInductorOnCuda, StepRecorder, compile_model, make_prompts

LENGTHS = (37, 22, 9)
NEW_TOKENS = 8
# fp32: inductor fuses and reorders reductions (~1e-6 of the logit scale).
REL_TOL = 1e-4


LAYERS = 4
CSA_LAYERS = 2
TOPK_ROUTED_LAYERS = 3  # the first MoE layer routes by hash
# hc_sinkhorn: attn_hc and ffn_hc of every layer (the HC head has no Sinkhorn).
EXPECTED_SITES = {"indexer": CSA_LAYERS, "sparse_mla": LAYERS, "fp4_moe": LAYERS, "moe_route": TOPK_ROUTED_LAYERS,
                  "hc_sinkhorn": 2 * LAYERS}


@pytest.fixture(scope="module")
def model():
    model = compile_model(seed=2)
    quantize_experts_(model, "mxfp4")
    return model


@pytest.fixture(scope="module")
def reference(model):
    engine = dsv4_compile.optimize(model, max_batch=4, max_context=256, verify_tokens=3, compile=False)
    prompts = make_prompts(LENGTHS, model.config.vocab_size, seed=2)
    return prompts, engine.generate(prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def compiled(model):
    return dsv4_compile.optimize(model, max_batch=4, max_context=256, verify_tokens=3)


def _assert_steps_match(recorder: StepRecorder, eager_step) -> None:
    assert recorder.calls
    for input_ids, start_pos, rows, logits in recorder.calls:
        expected = eager_step(input_ids, start_pos, rows).float()
        assert (logits - expected).abs().max() <= REL_TOL * expected.abs().max()


def test_compiled_decode_equals_uncompiled(model, reference, compiled):
    prompts, expected = reference
    recorder = StepRecorder(compiled.compiled_step)
    compiled.compiled_step = recorder
    try:
        assert compiled.generate(prompts, NEW_TOKENS) == expected
    finally:
        compiled.compiled_step = recorder.step
    assert all(ids.shape == (4, 1) for ids, *_ in recorder.calls)
    for name, sites in EXPECTED_SITES.items():
        assert compiled.report.count(name, "T=1") == sites, (name, compiled.report.format())
    eager = dsv4_compile.optimize(model, max_batch=4, max_context=256, verify_tokens=3, compile=False)
    eager.generate(prompts, 1)
    _assert_steps_match(recorder, eager.module)


def test_compiled_verify_equals_greedy(reference, compiled):
    """Drafts from the true continuation, wrong from the 2nd on: some accepted, some rejected."""
    prompts, expected = reference
    truth = {tuple(p): p + e for p, e in zip(prompts, expected)}

    def draft(tokens):
        for prompt, full in truth.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                following = full[len(tokens):len(tokens) + 3]
                return following[:1] + [(t + 1) % 256 for t in following[1:]]
        raise AssertionError("unknown request")

    assert compiled.generate(prompts, NEW_TOKENS, draft=draft) == expected
    assert 0 < compiled.last_acceptance < 1
    for name, sites in EXPECTED_SITES.items():
        assert compiled.report.count(name, "T=4") == sites, (name, compiled.report.format())


def test_step_on_host_inputs_equals_the_uncompiled_step(compiled):
    """Engine.step, the public entry: host inputs checked there and run through the compiled graph."""
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, compiled.vocab_size, (4, 1), generator=gen)
    start, rows = torch.tensor([40, 25, 12, 3]), torch.arange(4)
    logits = compiled.step(ids, start, rows).float()
    # the same step again, uncompiled: a step rewrites only positions >= start_pos, from the ones before
    expected = compiled.module(ids, start, rows).float()
    assert (logits - expected).abs().max() <= REL_TOL * expected.abs().max()


def test_every_site_matches_in_a_bf16_decode_graph():
    """bf16 models cast around the softmax and route in bf16: the passes must still match."""
    model = compile_model(seed=3, dtype=torch.bfloat16)
    quantize_experts_(model, "mxfp4")
    engine = dsv4_compile.optimize(model, max_batch=1, max_context=256, strict=True)
    engine.generate([[3, 1, 4, 1, 5]], 2)
    for name, sites in EXPECTED_SITES.items():
        assert engine.report.count(name, "T=1") == sites, (name, engine.report.format())


def test_every_site_matches_in_inductors_cuda_forms(model, reference, monkeypatch):
    """On CUDA inductor turns each softmax into prepare_softmax_online, batch-1 bmms into
    unsqueeze(mm(squeeze, squeeze), 0) (bmm_to_mm: at B = 1, T = 1 the indexer's and the attention's)
    and, where a benchmark says so, pads bmms off the alignment (pad_mm): all forced here on CPU (the
    compressor's softmax kept, see OnlineSoftmaxOnCpu; every bmm off the alignment padded). At B = 1
    every site still matches in the decode and the verify graph (the indexer's top-k readers among
    them: the attention over the selection as mms, padded, with the online softmax), and the steps
    equal the uncompiled ones."""
    online = OnlineSoftmaxOnCpu(monkeypatch, keep_files=("compressor.py",))
    bmm_to_mm = BmmToMmOnCpu(monkeypatch)
    padding = PadBmmAsInductorOnCuda()
    prompts, expected = reference
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True, post_grad_custom_pre_pass=padding):
        engine = dsv4_compile.optimize(model, max_batch=1, max_context=256, verify_tokens=3)
        recorder = StepRecorder(engine.compiled_step)
        engine.compiled_step = recorder
        assert engine.generate(prompts[:1], 3) == [expected[0][:3]]
        assert engine.generate(prompts[:1], 3, draft=lambda tokens: tokens[-3:]) == [expected[0][:3]]
    assert bmm_to_mm.rewrites >= CSA_LAYERS + 2 * LAYERS
    assert online.rewrites >= 2 * LAYERS  # each graph's attention softmaxes, at least
    assert padding.padded > 0
    assert {ids.shape for ids, *_ in recorder.calls} == {(1, 1), (1, 4)}
    for graph in ("T=1", "T=4"):
        for name, sites in EXPECTED_SITES.items():
            assert engine.report.count(name, graph) == sites, (name, graph, engine.report.format())
    eager = dsv4_compile.optimize(model, max_batch=1, max_context=256, verify_tokens=3, compile=False)
    eager.generate(prompts[:1], 1)
    _assert_steps_match(recorder, eager.module)
