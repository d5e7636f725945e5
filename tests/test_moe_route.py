"""dsv4::moe_route against transformers' DeepseekV4TopKRouter / DeepseekV4HashRouter, and dsv4::route_topk (the
Triton kernel of the top-k router's selection) against its reference."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_compile.kernels import moe_route as route  # (registers the ops)


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
        (dict(tid2eid=torch.full((10, 2), 1.7), input_ids=torch.arange(4)), TypeError, "tid2eid"),
        (dict(tid2eid=torch.zeros(10, 2, dtype=torch.long), input_ids=torch.arange(4.0)), TypeError, "input_ids"),
        (dict(tid2eid=torch.zeros(10, 2, dtype=torch.long), input_ids=torch.tensor([0, 1, 10, 2])), ValueError,
         r"input_ids must lie in \[0, V=10\)"),
        (dict(tid2eid=torch.zeros(10, 2, dtype=torch.long), input_ids=torch.tensor([0, 1, -1, 2])), ValueError,
         "input_ids"),
        # a row the tokens pick holds expert 6 (E = 6); other rows may hold anything
        (dict(tid2eid=torch.tensor([[0, 1]] * 9 + [[2, 6]]), input_ids=torch.tensor([0, 9, 1, 2])), ValueError,
         "tid2eid"),
        (dict(routed_scaling=float("nan")), ValueError, "routed_scaling"),
    ],
)
def test_bad_input(kwargs, error, match):
    args = dict(hidden=torch.randn(4, 8), gate_weight=torch.randn(6, 8), bias=None, tid2eid=None, input_ids=None,
                top_k=2, routed_scaling=1.5)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        torch.ops.dsv4.moe_route(**args)


# --------------------------------------------------------------------------------------------
# dsv4::route_topk (Triton kernel; the interpreter on CPU) against route_topk_reference
# --------------------------------------------------------------------------------------------
_ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def assert_route_topk(scores, bias, top_k, eps, scaling, weights, ids):
    """ids: top_k distinct experts in [0, E) whose sums scores + bias (in the model's dtype) are the
    reference top-k's as a multiset (ties may pick other experts, never other values); weights: the
    reference formula on those ids in f32, rounded once to scores.dtype. The kernel adds the picked
    scores in another order than torch, so 2 ulps of the output dtype."""
    rows, experts = scores.shape
    assert ids.shape == (rows, top_k) and ids.dtype == torch.int64
    assert weights.shape == (rows, top_k) and weights.dtype == scores.dtype
    assert bool(((ids >= 0) & (ids < experts)).all()), ids
    assert all(row.unique().numel() == top_k for row in ids), ids
    select = scores + bias
    want_ids = route.route_topk_reference(scores, bias, top_k, eps, scaling)[1]
    got_sel = select.gather(1, ids).float().sort(dim=-1).values
    want_sel = select.gather(1, want_ids).float().sort(dim=-1).values
    assert torch.equal(got_sel, want_sel)
    picked = scores.gather(1, ids).float()
    want_w = picked / (picked.sum(dim=-1, keepdim=True) + eps) * scaling
    ulp = _ULP[scores.dtype]
    torch.testing.assert_close(weights.float(), want_w.to(scores.dtype).float(), rtol=2 * ulp,
                               atol=2 * ulp * abs(scaling))


@given(st.integers(1, 9), st.integers(1, 300), st.integers(1, 16),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.booleans(), st.integers(0, 2**31 - 1))
def test_route_topk_kernel_matches_reference(rows, experts, top_k, dtype, bias_dtype, strided, seed):
    top_k = min(top_k, experts)
    gen = torch.Generator().manual_seed(seed)
    # sqrt(softplus) scores are positive; a strided view is a column slice of a wider matrix
    wide = torch.randn(rows, experts + 3 * strided, generator=gen).abs().to(dtype)
    scores = wide[:, :experts]
    bias = (torch.randn(2 * experts, generator=gen) * 0.5).to(bias_dtype)[::2]  # a strided bias too
    weights = torch.full((rows, top_k), float("nan"), dtype=dtype)  # poisoned: every element is written
    ids = torch.full((rows, top_k), -7, dtype=torch.int64)
    route.route_topk_triton(scores, bias, top_k, 1e-20, 1.5, weights=weights, ids=ids)
    assert_route_topk(scores, bias, top_k, 1e-20, 1.5, weights, ids)
    w_op, ids_op = torch.ops.dsv4.route_topk(scores, bias, top_k, 1e-20, 1.5)
    assert_route_topk(scores, bias, top_k, 1e-20, 1.5, w_op, ids_op)


def test_route_topk_ties_and_nan_pick_distinct_experts():
    """All-equal sums pick top_k distinct experts; NaN sums are never picked while finite ones
    remain, and a row of NaN still gets distinct ids in range."""
    scores = torch.ones(3, 10)
    scores[1, :4] = float("nan")
    scores[2] = float("nan")
    bias = torch.zeros(10)
    weights, ids = route.route_topk_triton(scores, bias, 5, 1e-20, 1.0)
    for row in ids:
        assert row.unique().numel() == 5 and bool(((row >= 0) & (row < 10)).all())
    assert bool((ids[1] >= 4).all())
    torch.testing.assert_close(weights[0], torch.full((5,), 0.2))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(top_k=0), ValueError, "top_k"),
    (dict(top_k=17), ValueError, "top_k"),
    (dict(top_k=9), ValueError, "top_k"),
    (dict(bias=torch.zeros(7)), ValueError, "bias"),
    (dict(bias=torch.zeros(8, dtype=torch.float64)), TypeError, "bias"),
    (dict(scores=torch.zeros(4, 8, dtype=torch.int32)), TypeError, "scores"),
    (dict(scores=torch.zeros(4, 2, 8)), ValueError, "scores"),
    (dict(scaling=float("inf")), ValueError, "scaling"),
])
def test_route_topk_bad_input(kwargs, error, match):
    args = dict(scores=torch.rand(4, 8), bias=torch.zeros(8), top_k=2, eps=1e-20, scaling=1.5)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        torch.ops.dsv4.route_topk(**args)


def test_route_topk_opcheck():
    torch.library.opcheck(torch.ops.dsv4.route_topk.default, (torch.rand(5, 12), torch.randn(12), 3, 1e-20, 1.5),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("name, bad", [("weights", torch.empty(2, 4).t()), ("ids", torch.empty(4, 2, dtype=torch.int32)),
                                       ("ids", torch.empty(3, 2, dtype=torch.int64))])
def test_route_topk_out_tensors_that_do_not_fit_are_refused(name, bad):
    """Caller-given outputs must be contiguous [M, top_k] of the right dtype: the kernel writes them so."""
    scores, bias = torch.rand(4, 16), torch.zeros(16)
    with pytest.raises(ValueError, match=f"route_topk: {name} must be a contiguous"):
        route.route_topk_triton(scores, bias, 2, 1e-20, 1.0, **{name: bad})
