"""Run a region of an FX graph on probe values.

The probe inputs may be leading blocks of their nodes' values (a few of many rows, say); every
node's value is then computed as the leading block of its own value (its meta["val"]), and a node
whose block is not the op applied to its inputs' blocks raises NoProbe.
"""
from __future__ import annotations

import math
import operator

import torch
from torch.fx import Node

from dsv4_compile.passes.fx_match import val

aten = torch.ops.aten


class NoProbe(Exception):
    """A node's leading block is not computed from the leading blocks of its inputs."""


class ReadsOutside(Exception):
    """A node of the region reads a value that is neither a probe input nor computed by the region."""


def run_region(nodes: list[Node], inputs: dict[Node, torch.Tensor]) -> dict[Node, object]:
    """{node: value} of `inputs` (probe values of some nodes, leading blocks of their values, on one
    device) and of `nodes` (in graph order) computed from them: call_function nodes by their op,
    get_attr nodes read from the graph's module. Device kwargs (arange, iota) name the graph's
    device; they are run on the inputs'. Raises NoProbe where a node's block is not its op on its
    inputs' blocks (a slice past the block), ReadsOutside where a node reads a value neither given
    nor computed."""
    device = next(iter(inputs.values())).device
    env = dict(inputs)
    for node, value in inputs.items():
        _check_block(node, value)
    for node in nodes:
        if node.op == "get_attr":  # a constant of the graph (a lookup table)
            env[node] = operator.attrgetter(node.target)(node.graph.owning_module).detach().to(device)
        elif node.op != "call_function" or any(a not in env for a in node.all_input_nodes):
            raise ReadsOutside(node.name)
        else:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
            if "device" in kwargs:
                kwargs = {**kwargs, "device": device}
            target, args = _block_args(node, args)
            env[node] = target(*args, **kwargs)
        _check_block(node, env[node])
    return env


def _block_args(node: Node, args: tuple):
    """(target, args) computing the leading block of `node`'s value from leading blocks of its
    inputs: reshape and expand sizes cut to the block; a slice, select, unbind, cat or index that
    would read a cut dim past its block, or operands whose blocks no longer broadcast where the
    whole ones do, raise NoProbe."""
    target, x = node.target, (args[0] if args else None)
    if target == aten.index.Tensor:  # the indices broadcast together, not with the indexed tensor
        _check_broadcast(node, node.args[1], args[1])
    else:
        _check_broadcast(node, node.args, args)
    if target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        return aten.reshape.default, (x, _block_reshape(val(node.args[0]).shape, x.shape, val(node).shape))
    if target == aten.expand.default:
        full_in, full_out = val(node.args[0]).shape, val(node).shape
        lead = len(full_out) - x.ndim
        return target, (x, [x.shape[d - lead] if d >= lead and full_in[d - lead] == full_out[d] else full_out[d]
                            for d in range(len(full_out))])
    if target in (aten.slice.Tensor, aten.select.int, aten.unbind.int):
        dim = (args[1] if len(args) > 1 else 0) % x.ndim
        start = args[2] if len(args) > 2 else None
        if x.shape[dim] != val(node.args[0]).shape[dim] and (
                target == aten.unbind.int or (target == aten.slice.Tensor and start not in (None, 0))
                or (target == aten.select.int and not 0 <= start < x.shape[dim])):
            raise NoProbe(f"{node.name} reads a cut dim past its block")
    if target == aten.cat.default:
        dim = args[1] if len(args) > 1 else 0
        if any(p.shape[dim] != val(n).shape[dim] for p, n in zip(x, node.args[0])):
            raise NoProbe(f"{node.name} concatenates along a cut dim")
    if target == aten.index.Tensor:
        full = val(node.args[0]).shape
        if any(i is not None and x.shape[d] != full[d] for d, i in enumerate(args[1])):
            raise NoProbe(f"{node.name} indexes a cut dim")
    return target, args


def _check_broadcast(node: Node, operands, blocks) -> None:
    """Raises NoProbe if the tensors among `operands` (args of `node`) broadcast together but
    their `blocks` do not (a cut dim against a whole one)."""
    full, cut = [], []
    for a, b in zip(operands, blocks):
        for n, v in zip(a, b) if isinstance(a, (list, tuple)) else [(a, b)]:
            if isinstance(v, torch.Tensor) and isinstance(val(n), torch.Tensor):
                full.append(val(n).shape)
                cut.append(v.shape)
    if len(cut) < 2:
        return
    try:
        torch.broadcast_shapes(*full)
    except RuntimeError:
        return  # operands that do not broadcast together (cat's)
    try:
        torch.broadcast_shapes(*cut)
    except RuntimeError:
        raise NoProbe(f"{node.name} combines a cut dim with a whole one") from None


def _block_reshape(full_in, block_in, full_out) -> list[int]:
    """Sizes of the block of a reshape's output that is the leading block `block_in` of its input:
    each group of dims that the reshape merges or splits may be cut in its first dim only."""
    src = [(f, b) for f, b in zip(full_in, block_in) if f != 1]
    dst = [d for d, f in enumerate(full_out) if f != 1]
    sizes, i, j = [1] * len(full_out), 0, 0
    while i < len(src):
        ii, jj, have, want = i + 1, j + 1, src[i][0], full_out[dst[j]]
        while have != want:
            if have < want:
                have, ii = have * src[ii][0], ii + 1
            else:
                want, jj = want * full_out[dst[jj]], jj + 1
        if any(b != f for f, b in src[i + 1:ii]):
            raise NoProbe("a reshape merges a cut dim with the dims before it")
        count = math.prod(b for _, b in src[i:ii])
        for d in reversed(dst[j + 1:jj]):
            if count % full_out[d]:
                raise NoProbe("a reshape splits a cut dim across its block")
            sizes[d], count = full_out[d], count // full_out[d]
        sizes[dst[j]] = count
        i, j = ii, jj
    return sizes


def _check_block(node: Node, value) -> None:
    """Raises NoProbe unless `value` has `node`'s rank and dtype and is a leading block of it with
    the same unit dims (a dim cut to 1 would broadcast where the full one does not)."""
    full = val(node)
    pairs = zip(value, full) if isinstance(full, (list, tuple)) else [(value, full)]
    for got, want in pairs:
        if not isinstance(want, torch.Tensor):
            continue
        if (not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.ndim != want.ndim
                or any(b > f or (b == 1) != (f == 1) for b, f in zip(got.shape, want.shape))):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise NoProbe(f"{node.name} is {shape} of {tuple(want.shape)}")
