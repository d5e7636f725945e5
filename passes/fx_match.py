"""Small helpers shared by the hand-written FX matchers of the indexer passes."""
from __future__ import annotations

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


def call(graph: Graph, target, args: tuple) -> Node:
    """A new call_function node with its meta["val"] computed on the fake values of args."""
    node = graph.call_function(target, args)
    vals = [val(a) if isinstance(a, Node) else a for a in args]
    fake_mode = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with fake_mode:
        node.meta["val"] = target(*vals)
    return node
