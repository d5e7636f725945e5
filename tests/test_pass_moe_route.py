"""passes/moe_route.py: transformers' top-k router after its gate GEMM becomes one dsv4::route_topk
call with the same choices and weights, in decode- and verify-shaped batches; routers that are not
that math stay as they are, with the reason recorded where the top-k looked like a router's. (The
counts inside the model's decode and verify graphs are checked by tests/test_compiled_step.py.)"""
import pytest
import torch

from dsv4_compile.passes import moe_route as route_pass
from dsv4_compile.tiny import TINY_CONFIG
from helpers import compile_with_probe

OP = torch.ops.dsv4.route_topk.default
# Weights: the op and inductor both compute in f32 and round once to the scores' dtype, adding the
# picked scores in other orders: 2 ulps of that dtype.
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8}


pytestmark = pytest.mark.usefixtures("fresh_inductor_cache")


def compile_with_pass(fn):
    torch._dynamo.reset()
    return compile_with_probe(fn, route_pass)


def router(cls_name, dtype, seed=0, f32_bias=False):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as modeling

    torch.manual_seed(seed)
    module = getattr(modeling, cls_name)(DeepseekV4Config(**TINY_CONFIG))
    torch.nn.init.normal_(module.weight)
    if cls_name == "DeepseekV4TopKRouter":
        module.e_score_correction_bias.normal_()
    else:
        module.tid2eid.copy_(torch.stack([torch.randperm(module.num_experts)[:module.top_k] for _ in range(256)]))
    module = module.to(dtype).eval()
    if f32_bias:  # as transformers loads the model: the correction bias stays f32
        module.e_score_correction_bias.data = module.e_score_correction_bias.float()
    return module


def assert_same_routing(got, want, dtype):
    """The same experts per token (as sets; the op's order is unspecified) and their weights."""
    (_, got_w, got_ids), (_, want_w, want_ids) = got, want
    got_order, want_order = got_ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(got_ids.gather(1, got_order), want_ids.gather(1, want_order))
    ulp = 2 * ULP[dtype]
    torch.testing.assert_close(got_w.gather(1, got_order).float(), want_w.gather(1, want_order).float(),
                               rtol=ulp, atol=ulp)


@pytest.mark.parametrize("dtype, f32_bias", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)],
                         ids=["bf16_f32_bias", "bf16", "f32"])
@pytest.mark.parametrize("batch, tokens", [(3, 1), (2, 3)], ids=["decode", "verify"])
def test_topk_router_rewritten_with_the_same_result(dtype, f32_bias, batch, tokens):
    module = router("DeepseekV4TopKRouter", dtype, f32_bias=f32_bias)
    hidden = torch.randn(batch, tokens, TINY_CONFIG["hidden_size"], generator=torch.Generator().manual_seed(3))
    hidden = hidden.to(dtype)
    compiled, report, probe = compile_with_pass(module)
    with torch.no_grad():
        got, want = compiled(hidden), module(hidden)
    assert probe.rewrites == 1 and report.count("moe_route") == 1, report.format()
    assert OP in probe.targets and torch.ops.aten.topk.default not in probe.targets
    assert report.records[0].reason == "top-2 of 8 experts"
    assert_same_routing(got, want, dtype)


def test_hash_router_has_no_site():
    module = router("DeepseekV4HashRouter", torch.float32)
    hidden, input_ids = torch.randn(4, 1, TINY_CONFIG["hidden_size"]), torch.randint(0, 256, (4, 1))
    compiled, report, probe = compile_with_pass(module)
    with torch.no_grad():
        got, want = compiled(hidden, input_ids), module(hidden, input_ids)
    assert probe.rewrites == 0 and not report.records and OP not in probe.targets
    torch.testing.assert_close(got[1], want[1])


def _router_math(scores, bias, k=2, largest=True, keep_values=False, other=None, sorted_ids=False, sum_dim=-1,
                 gathered_read=False):
    """The router after its score function, with one part changed per negative case."""
    top = torch.topk(scores + bias, k, dim=-1, largest=largest, sorted=sorted_ids)
    gathered = (scores if other is None else other).gather(1, top.indices)
    weights = gathered / (gathered.sum(dim=sum_dim, keepdim=True) + 1e-20)
    out = (weights * 1.5, top.indices)
    if gathered_read:
        out += (gathered.exp(),)
    return out + (top.values,) if keep_values else out


@pytest.mark.parametrize("kwargs, reason", [
    (dict(largest=False), "smallest"),
    (dict(keep_values=True), "values are read"),
    (dict(k=17), "k = 17 outside"),
    (dict(sorted_ids=True), "sorted"),
    (dict(sum_dim=None), "keepdim"),
    (dict(gathered_read=True), "read by something other"),
], ids=["smallest", "values_read", "k_too_large", "sorted", "sum_of_all", "gathered_read"])
def test_router_variants_are_declined_with_the_reason(kwargs, reason):
    experts = 32
    scores = torch.rand(4, experts, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(experts, generator=torch.Generator().manual_seed(2))
    compiled, report, probe = compile_with_pass(lambda s, b: _router_math(s, b, **kwargs))
    got = compiled(scores, bias)
    want = _router_math(scores, bias, **kwargs)
    assert probe.rewrites == 0 and OP not in probe.targets
    assert [r.matched for r in report.records] == [False] and reason in report.records[0].reason, report.format()
    torch.testing.assert_close(got[0], want[0])


def test_unscaled_weights_read_twice_are_rewritten_without_the_scaling():
    """The division feeds two readers: the op takes scaling 1 and both read its weights."""
    def fn(scores, bias):
        top = torch.topk(scores + bias, 3, dim=-1, sorted=False)
        gathered = scores.gather(1, top.indices)
        weights = gathered / (gathered.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * 2.5, weights.exp(), top.indices

    scores, bias = torch.rand(5, 16), torch.randn(16)
    compiled, report, probe = compile_with_pass(fn)
    got, want = compiled(scores, bias), fn(scores, bias)
    assert probe.rewrites == 1 and OP in probe.targets, report.format()
    order, want_order = got[2].argsort(dim=-1), want[2].argsort(dim=-1)
    assert torch.equal(got[2].gather(1, order), want[2].gather(1, want_order))
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a.gather(1, order), b.gather(1, want_order), rtol=1e-6, atol=1e-6)


def test_gather_of_another_tensor_is_declined():
    scores, bias, other = torch.rand(4, 8), torch.randn(8), torch.rand(4, 8)
    compiled, report, probe = compile_with_pass(lambda s, b, o: _router_math(s, b, other=o))
    got = compiled(scores, bias, other)
    assert probe.rewrites == 0 and "gathers of the scores" in report.records[0].reason, report.format()
    torch.testing.assert_close(got[0], _router_math(scores, bias, other=other)[0])


def test_a_topk_without_a_bias_is_no_candidate():
    """topk(scores) alone (a router with no correction bias, or the indexer's top-k over slots)."""
    def fn(scores):
        ids = torch.topk(scores, 2, dim=-1).indices
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), ids

    compiled, report, probe = compile_with_pass(fn)
    compiled(torch.rand(4, 8))
    assert probe.rewrites == 0 and not report.records
