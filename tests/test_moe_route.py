"""dsv4::moe_route against transformers' DeepseekV4TopKRouter / DeepseekV4HashRouter."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_compile.kernels import moe_route  # noqa: F401  (registers the op)


def _config(experts, top_k, hidden):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(hidden_size=hidden, num_local_experts=experts, num_experts_per_tok=top_k,
                            vocab_size=50, routed_scaling_factor=1.5)


def _sorted_pairs(ids, weights):
    order = ids.long().argsort(dim=-1)
    return ids.long().gather(1, order), weights.float().gather(1, order)


@given(st.integers(1, 6), st.integers(2, 16), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_topk_router_matches_transformers(tokens, experts, top_k, seed):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    top_k = min(top_k, experts)
    torch.manual_seed(seed)
    router = DeepseekV4TopKRouter(_config(experts, top_k, 32))
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.normal_()
    hidden = torch.randn(tokens, 32)
    _, want_w, want_ids = router(hidden)
    ids, weights = torch.ops.dsv4.moe_route(hidden, router.weight.data, router.e_score_correction_bias, None, None,
                                            top_k, 1.5)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    got_ids, got_w = _sorted_pairs(ids, weights)
    want_ids, want_w = _sorted_pairs(want_ids, want_w)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-6)  # same f32 math, same order


def test_hash_router_matches_transformers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter

    torch.manual_seed(0)
    router = DeepseekV4HashRouter(_config(8, 3, 32))
    torch.nn.init.normal_(router.weight)
    router.tid2eid.copy_(torch.stack([torch.randperm(8)[:3] for _ in range(50)]))
    hidden, input_ids = torch.randn(5, 32), torch.randint(0, 50, (5,))
    _, want_w, want_ids = router(hidden, input_ids)
    ids, weights = torch.ops.dsv4.moe_route(hidden, router.weight.data, None, router.tid2eid, input_ids, 3, 1.5)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weights.sum(-1), torch.full((5,), 1.5), rtol=1e-5, atol=1e-5)


def test_bias_selects_but_does_not_weight():
    hidden, gate = torch.randn(4, 8), torch.randn(6, 8)
    bias = torch.zeros(6)
    bias[5] = 1e4  # expert 5 always selected
    ids, weights = torch.ops.dsv4.moe_route(hidden, gate, bias, None, None, 2, 1.0)
    assert (ids == 5).any(dim=-1).all()
    assert (weights < 1.0).all()  # normalised scores, no bias in them


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(top_k=7), ValueError, "top_k"),
        (dict(bias=torch.zeros(6, dtype=torch.float64)), TypeError, "bias"),
        (dict(gate_weight=torch.randn(6, 9)), ValueError, "gate_weight"),
        (dict(tid2eid=torch.zeros(10, 2, dtype=torch.long)), ValueError, "input_ids"),
    ],
)
def test_bad_input(kwargs, error, match):
    args = dict(hidden=torch.randn(4, 8), gate_weight=torch.randn(6, 8), bias=None, tid2eid=None, input_ids=None,
                top_k=2, routed_scaling=1.5)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        torch.ops.dsv4.moe_route(**args)
