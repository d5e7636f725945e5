"""Rewrite the top-k router's selection and weights to torch.ops.dsv4.route_topk.

Hand-written FX matching on inductor's post-grad graph, of transformers' DeepseekV4TopKRouter
after its gate GEMM and score function (whatever computes `scores` stays as it is):

    idx = topk(add(scores, bias), k, dim=-1, largest=True, sorted=False)[1]   scores [M, E], bias [E]
    g = gather(scores, 1, idx)
    weights = mul(div(g, add(sum(g, [-1], keepdim=True), eps)), scaling)   (the mul may be absent)

becomes `weights, ids = route_topk(scores, bias, k, eps, scaling)`: one launch for what was an aten
top-k and two pointwise kernels. Other readers of idx (the experts) read ids. A top-k whose input
is not such an add, or whose sum is not shaped like a router's, is not a candidate and is not
recorded (the indexer's top-k over slots, for one). A candidate is declined, with the reason
recorded, when the top-k is not the largest along the last dim or promises sorted ids, k or E are
symbolic or out of the op's range, eps or the scaling is not a finite constant, the gather reads
another tensor, or an intermediate (the top-k values, the gathered scores, their sum) has another
reader.
"""
from __future__ import annotations

import logging
import math
import operator
from numbers import Real

import torch
from torch.fx import Graph, Node

import dsv4_compile.kernels.moe_route as kernel
from dsv4_compile.passes.fx_match import Decline, call, equal, is_call, require, shape, topk_dim_largest, val

logger = logging.getLogger("dsv4_compile")

PASS_NAME = "moe_route"

aten = torch.ops.aten
_ADDS = (aten.add.Tensor, aten.add.Scalar)


def _finite_constant(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def _router_operands(topk: Node) -> tuple[Node, Node] | None:
    """(scores, bias) when the top-k reads add(scores [M, E], bias [E]); else None (no candidate)."""
    source = topk.args[0]
    if not is_call(source, aten.add.Tensor) or source.kwargs.get("alpha", 1) != 1:
        return None
    a, b = source.args[:2]
    if not (isinstance(val(a), torch.Tensor) and isinstance(val(b), torch.Tensor)):
        return None
    for scores, bias in ((a, b), (b, a)):
        if val(scores).dim() == 2 and val(bias).dim() == 1 and equal(shape(bias)[0], shape(scores)[1]):
            return scores, bias
    return None


def _only_user(node: Node, what: str) -> Node:
    users = list(node.users)
    require(len(users) == 1, f"{what} has {len(users)} readers, not one")
    return users[0]


def _match(topk: Node, scores: Node, bias: Node) -> tuple[Node, Node, int, float, float]:
    """(idx, weights node, k, eps, scaling) of a router site; Decline otherwise."""
    dim, largest = topk_dim_largest(topk)
    experts = shape(scores)[1]
    require(largest, "the top-k takes the smallest")
    sort = topk.args[4] if len(topk.args) > 4 else topk.kwargs.get("sorted", True)
    require(not sort, "the top-k's ids are sorted (the op's are in no particular order)")
    require(dim in (-1, 1), f"the top-k runs along dim {dim}, not the experts")
    k = topk.args[1]
    require(isinstance(k, int) and isinstance(experts, int), "k or the expert count is symbolic")
    require(1 <= k <= min(kernel.MAX_TOP_K, experts), f"k = {k} outside [1, min({kernel.MAX_TOP_K}, E={experts})]")
    require(experts <= kernel.MAX_EXPERTS, f"E = {experts} > {kernel.MAX_EXPERTS}")
    require(val(scores).dtype in kernel.SCORE_DTYPES and val(bias).dtype in kernel.SCORE_DTYPES,
            f"scores {val(scores).dtype} / bias {val(bias).dtype} not among {kernel.SCORE_DTYPES}")
    outputs = {user.args[1]: user for user in topk.users if is_call(user, operator.getitem)}
    require(set(outputs) == {1} and len(topk.users) == 1, "the top-k values are read")
    idx = outputs[1]
    gathers = [u for u in idx.users if is_call(u, aten.gather.default) and u.args[0] is scores]
    require(len(gathers) == 1, f"{len(gathers)} gathers of the scores at the top-k ids, not one")
    gathered = gathers[0]
    require(gathered.args[1] in (1, -1), f"the gather runs along dim {gathered.args[1]}")
    readers = set(gathered.users)
    sums = [u for u in readers if is_call(u, aten.sum.dim_IntList)]
    divs = [u for u in readers if is_call(u, aten.div.Tensor) and u.args[0] is gathered]
    require(len(sums) == 1 and len(divs) == 1 and len(readers) == 2,
            "the gathered scores are read by something other than their sum and the division")
    total, division = sums[0], divs[0]
    dims = total.args[1] if len(total.args) > 1 else total.kwargs.get("dim")
    keepdim = total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False)
    require(dims is not None and list(dims) in ([-1], [1]) and keepdim and total.kwargs.get("dtype") is None,
            "the sum is not over the choices with keepdim")
    denominator = _only_user(total, "the sum")
    require(is_call(denominator, *_ADDS) and denominator is division.args[1]
            and denominator.kwargs.get("alpha", 1) == 1, "the sum is not added to eps and divided by")
    eps = [a for a in denominator.args if a is not total]
    require(len(eps) == 1 and _finite_constant(eps[0]), "eps is not a finite constant")
    _only_user(denominator, "sum + eps")
    weights, scaling = division, 1.0
    users = list(division.users)
    if len(users) == 1 and is_call(users[0], aten.mul.Tensor):  # the routed scaling
        factor = [a for a in users[0].args if a is not division]
        if len(factor) == 1 and _finite_constant(factor[0]):
            weights, scaling = users[0], float(factor[0])
    require(val(weights).dtype == val(scores).dtype,
            f"the weights are {val(weights).dtype}, the scores {val(scores).dtype}")
    return idx, weights, k, float(eps[0]), scaling


def _rewrite(graph: Graph, scores: Node, bias: Node, idx: Node, weights: Node, k: int, eps: float,
             scaling: float) -> None:
    with graph.inserting_before(idx.next):  # where idx's readers can see ids
        routed = call(graph, torch.ops.dsv4.route_topk.default, (scores, bias, k, eps, scaling))
        new_weights = call(graph, operator.getitem, (routed, 0))
        ids = call(graph, operator.getitem, (routed, 1))
    weights.replace_all_uses_with(new_weights)
    idx.replace_all_uses_with(ids)


def apply(graph: Graph, report) -> int:
    """Rewrite every top-k router site in `graph`; returns the number rewritten."""
    rewrites = 0
    for topk in [n for n in graph.nodes if is_call(n, aten.topk.default)]:
        operands = _router_operands(topk)
        if operands is None:
            continue
        try:
            idx, weights, k, eps, scaling = _match(topk, *operands)
        except Decline as why:
            report.record(PASS_NAME, topk, False, str(why))
            logger.debug("moe_route pass declined %s: %s", topk.name, why)
            continue
        _rewrite(graph, *operands, idx, weights, k, eps, scaling)
        report.record(PASS_NAME, topk, True, f"top-{k} of {shape(operands[0])[1]} experts")
        rewrites += 1
    if rewrites:
        graph.eliminate_dead_code()
    return rewrites
