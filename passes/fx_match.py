"""Small helpers shared by the hand-written FX matchers of the dsv4 passes."""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
from torch.fx import Graph, Node

aten = torch.ops.aten
prims = torch.ops.prims

RESHAPES = frozenset({aten.reshape.default, aten.view.default, aten._unsafe_view.default})
PASS_THROUGH = RESHAPES | {aten.expand.default, aten.clone.default, aten.unsqueeze.default,
                           prims.convert_element_type.default, aten.alias.default}


class Decline(Exception):
    """Not the form a matcher looks for; the message is the reason recorded in the report."""


def val(node):
    """The fake value recorded on a node (None for non-nodes)."""
    return node.meta.get("val") if isinstance(node, Node) else None


def shape(node) -> tuple:
    """The node's tensor shape (ints or SymInts); Decline if none was recorded."""
    value = val(node)
    if not isinstance(value, torch.Tensor):
        raise Decline(f"no shape recorded for {node}")
    return tuple(value.shape)


def expr(size):
    """A size (int or SymInt) as a sympy expression."""
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


def equal(a, b) -> bool:
    """Sizes equal for every value of their symbols (static ints or SymInts)."""
    return sympy.simplify(expr(a) - expr(b)) == 0


def is_call(node, *targets) -> bool:
    """Whether `node` is an FX call_function of one of `targets`."""
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def strip(node: Node, allowed=PASS_THROUGH) -> Node:
    """Follow the first argument through ops in `allowed`."""
    while is_call(node, *allowed):
        node = node.args[0]
    return node


def topk_dim_largest(node: Node) -> tuple[int, bool]:
    """(dim, largest) of an aten.topk call, defaults filled in."""
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    largest = node.args[3] if len(node.args) > 3 else node.kwargs.get("largest", True)
    return dim, largest


def require(cond: bool, reason: str) -> None:
    if not cond:
        raise Decline(reason)


def require_few_rows(mm: Node, max_rows: int) -> None:
    """Decline an mm whose row count is symbolic or above `max_rows` (a GEMM library then has enough
    output tiles)."""
    rows, _ = shape(mm.args[0])
    require(isinstance(rows, int), "sizes are symbolic")
    require(rows <= max_rows, f"{rows} rows > {max_rows}: enough output tiles for a GEMM")


def accepted_mms(graph: Graph, report, pass_name: str, is_candidate, check) -> list[Node]:
    """The aten.mm nodes of `graph` that `is_candidate` picks and `check` accepts. Each candidate is
    recorded under `pass_name`: declined with the reason `check` raises (Decline), or matched as
    "[M, K] @ [K, N]"."""
    accepted = []
    for mm in [n for n in graph.nodes if is_candidate(n)]:
        try:
            check(mm)
        except Decline as why:
            report.record(pass_name, mm, False, str(why))
            continue
        a, b = mm.args
        report.record(pass_name, mm, True, f"[{shape(a)[0]}, {shape(a)[1]}] @ [{shape(b)[0]}, {shape(b)[1]}]")
        accepted.append(mm)
    return accepted


def replace_with_mul_sum(graph: Graph, product: Node) -> Node:
    """Replaces `product` (aten.mm a [M, K] @ b [K, N], or aten.bmm a [G, M, K] @ b [G, K, N]) by
    sum(a[..., :, :, None] * b[..., None, :, :], dim=-2) and returns the new node."""
    a, b = product.args
    rank = 3 if product.target == aten.bmm.default else 2
    with graph.inserting_before(product):
        terms = call(graph, aten.mul.Tensor, (call(graph, aten.unsqueeze.default, (a, rank)),
                                              call(graph, aten.unsqueeze.default, (b, rank - 2))))
        total = call(graph, aten.sum.dim_IntList, (terms, [rank - 1]))
    product.replace_all_uses_with(total)
    graph.erase_node(product)
    return total


def call(graph: Graph, target, args: tuple) -> Node:
    """A new call_function node with its meta["val"] computed on the fake values of args."""
    node = graph.call_function(target, args)
    vals = [val(a) if isinstance(a, Node) else a for a in args]
    fake_mode = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with fake_mode:
        node.meta["val"] = target(*vals)
    return node


@dataclass(frozen=True)
class Bmm:
    """A batched matmul found in the graph: out [N, m, n] = mat1 [N, m, k] @ mat2 [N, k, n].
    `out` is the aten.bmm node, or the unsqueeze of inductor's batch-1 mm form."""

    out: Node
    mat1: Node
    mat2: Node


def _batch_squeezed(node) -> Node | None:
    """x of squeeze(x, 0) (aten.squeeze.dim or .dims) when x is [1, a, b]; else None."""
    if is_call(node, aten.squeeze.dim):
        dims = [node.args[1]]
    elif is_call(node, aten.squeeze.dims):
        dims = list(node.args[1])
    else:
        return None
    x = node.args[0]
    x_shape = shape(x)
    if len(x_shape) != 3 or [d % 3 for d in dims] != [0] or not equal(x_shape[0], 1):
        return None
    return x


def match_bmm(node, what: str) -> Bmm:
    """`node` as a batched matmul: an aten.bmm, or the form inductor's joint-graph pattern
    `bmm_to_mm` makes of a bmm whose batch is statically 1 (on GPUs only),
        unsqueeze(mm(squeeze(mat1, 0), squeeze(mat2, 0)), 0),
    given as its unsqueeze or as its mm. Raises Decline naming `what` for anything else.
    (inductor's pad_mm cannot pad that mm: both patterns run in one pattern pass over the nodes
    that existed before it, and bmm_to_mm is tried first on each bmm.)"""
    if is_call(node, aten.bmm.default):
        return Bmm(node, node.args[0], node.args[1])
    if is_call(node, aten.unsqueeze.default) and is_call(node.args[0], aten.mm.default):
        mm, out = node.args[0], node
    elif is_call(node, aten.mm.default):
        mm, users = node, list(node.users)
        require(len(users) == 1 and is_call(users[0], aten.unsqueeze.default),
                f"{what} are an mm whose result is not unsqueezed, not a batch-1 bmm")
        out = users[0]
    else:
        raise Decline(f"{what} do not come from a bmm")
    require(out.args[1] in (0, -3), f"{what} are an mm unsqueezed at dim {out.args[1]}, not a batch-1 bmm")
    mat1, mat2 = (_batch_squeezed(arg) for arg in mm.args)
    require(mat1 is not None and mat2 is not None,
            f"{what} are an mm of operands that are not squeeze([1, m, k], 0) and squeeze([1, k, n], 0), "
            "not a batch-1 bmm")
    return Bmm(out, mat1, mat2)


def is_bmm(node) -> bool:
    """Whether match_bmm accepts `node`."""
    try:
        match_bmm(node, "")
    except Decline:
        return False
    return True
