"""Rewrite Sinkhorn-Knopp chains over small square matrices to torch.ops.dsv4.hc_sinkhorn.

Hand-written FX matching on inductor's post-grad graph. One normalisation step is

    y = div(x, add(sum(x, [d], keepdim=True), eps))        x [..., n, n] f32, d one of the last two dims

(the add may be add.Tensor or add.Scalar, eps on either side). A chain is a maximal sequence of
steps in which each step reads the previous step's output and nothing else does. DeepSeek-V4's
hyper-connections (transformers' `DeepseekV4HyperConnection.forward`) make one chain of
2 * hc_sinkhorn_iters - 1 steps per call: column, then (row, column) rounds.

A chain becomes one `hc_sinkhorn(x, iters, eps)` call from its first column step to its last
column step: a leading or trailing row step stays as it is. An intermediate that something
else reads ends the chain there (it is still produced: by the call that ends at it, or by the
plain step), and the rest is matched as a chain of its own.

Declines (recorded with the reason, graph left as it was): a chain whose matrices are not f32,
not square, or larger than 16 x 16 (or n not a power of two), a step over a dim other than the
last two, a sum without keepdim, two consecutive steps over the same dim, different eps
constants, and a chain with fewer than two column steps (one column normalisation is cheap for
inductor; the call would only add a launch).
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch
from torch.fx import Graph, Node

import dsv4_compile.kernels.hc_sinkhorn as kernel
from dsv4_compile.passes.fx_match import Decline, call, is_call, require, shape, val

logger = logging.getLogger("dsv4_compile")

PASS_NAME = "hc_sinkhorn"

aten = torch.ops.aten
_ADDS = (aten.add.Tensor, aten.add.Scalar)
ROW, COLUMN = "row", "column"


@dataclasses.dataclass(frozen=True)
class _Step:
    """One normalisation y = x / (sum(x, [dim], keepdim) + eps)."""

    out: Node
    x: Node
    total: Node
    dim: int
    keepdim: bool
    eps: float

    def kind(self) -> str | None:
        """ROW (sum over the last dim), COLUMN (the one before) or None (another dim)."""
        rank = len(shape(self.x))
        return {rank - 1: ROW, rank - 2: COLUMN}.get(self.dim % rank) if rank >= 2 else None


def _as_step(node: Node) -> _Step | None:
    """The step `node` computes, or None if it is no x / (sum(x, [d]) + eps)."""
    if not is_call(node, aten.div.Tensor):
        return None
    x, denominator = node.args
    if not is_call(denominator, *_ADDS) or denominator.kwargs.get("alpha", 1) != 1:
        return None
    summed = [a for a in denominator.args if is_call(a, aten.sum.dim_IntList)]
    consts = [a for a in denominator.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    if len(summed) != 1 or len(consts) != 1:
        return None
    total = summed[0]
    dims = total.args[1] if len(total.args) > 1 else total.kwargs.get("dim")
    if total.args[0] is not x or dims is None or len(dims) != 1 or total.kwargs.get("dtype") is not None:
        return None
    keepdim = bool(total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False))
    return _Step(node, x, total, int(dims[0]), keepdim, float(consts[0]))


def _links(prev: _Step, nxt: _Step) -> bool:
    """Whether `nxt` continues `prev`: it reads prev's output, which nothing else reads."""
    return nxt.x is prev.out and set(prev.out.users) <= {nxt.out, nxt.total}


def _chains(graph: Graph) -> list[list[_Step]]:
    """Every maximal chain of two or more linked steps, in graph order."""
    steps = {node: step for node in graph.nodes if (step := _as_step(node)) is not None}
    following: dict[Node, _Step] = {}
    for step in steps.values():
        prev = steps.get(step.x)
        if prev is not None and _links(prev, step):
            following[prev.out] = step
    continuing = {step.out for step in following.values()}
    chains = []
    for step in steps.values():
        if step.out in continuing:
            continue
        chain = [step]
        while chain[-1].out in following:
            chain.append(following[chain[-1].out])
        if len(chain) >= 2:
            chains.append(chain)
    return chains


def _check(chain: list[_Step]) -> list[_Step]:
    """The steps to replace (first to last column step) of a chain; Decline if it is not one
    the op computes."""
    x = chain[0].x
    dims = shape(x)
    dtype = val(x).dtype
    require(dtype == torch.float32, f"matrices are {dtype}, not float32")
    require(len(dims) >= 2, f"input is rank {len(dims)}, not [..., n, n]")
    rows, cols = dims[-2:]
    require(isinstance(rows, int) and isinstance(cols, int), "symbolic matrix size")
    require(rows == cols, f"matrices are {rows} x {cols}, not square")
    require(cols in kernel.MATRIX_SIZES, f"n = {cols} not in {kernel.MATRIX_SIZES}")
    for step in chain:
        require(step.kind() is not None, f"{step.out.name} normalises dim {step.dim}, not a matrix dim")
        require(step.keepdim, f"{step.out.name} sums without keepdim")
    kinds = [step.kind() for step in chain]
    require(all(a != b for a, b in zip(kinds, kinds[1:])), "two consecutive normalisations over the same dim")
    eps = {step.eps for step in chain}
    require(len(eps) == 1, f"the steps use different eps ({', '.join(map(repr, sorted(eps)))})")
    value = next(iter(eps))
    require(math.isfinite(value) and value >= 0, f"eps {value!r} is not a finite float >= 0 (the op's range)")
    first = kinds.index(COLUMN)
    last = len(kinds) - 1 - kinds[::-1].index(COLUMN)
    replaced = chain[first:last + 1]
    require(len(replaced) >= 3, "fewer than two column normalisations")
    return replaced


def _rewrite(graph: Graph, steps: list[_Step]) -> None:
    iters = (len(steps) + 1) // 2
    end = steps[-1].out
    # The first step's live input, not steps[0].x: when an earlier chain ending there was rewritten,
    # its users (this step among them) were moved to that chain's call.
    source = steps[0].out.args[0]
    with graph.inserting_before(end):
        out = call(graph, torch.ops.dsv4.hc_sinkhorn.default, (source, iters, steps[0].eps))
    end.replace_all_uses_with(out)


def apply(graph: Graph, report) -> int:
    """Rewrite every Sinkhorn chain in `graph`; returns the number rewritten."""
    rewrites = 0
    for chain in _chains(graph):
        site = chain[0].out
        try:
            steps = _check(chain)
        except Decline as why:
            report.record(PASS_NAME, site, False, str(why))
            logger.debug("hc_sinkhorn pass declined %s: %s", site.name, why)
            continue
        _rewrite(graph, steps)
        report.record(PASS_NAME, site, True)
        rewrites += 1
    if rewrites:
        graph.eliminate_dead_code()
    return rewrites
