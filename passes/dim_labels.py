"""Labelled dims of a tensor through layout-only ops.

A tensor's dims are written as the source dims each one holds, major to minor: a dim is a tuple of
atoms (label, size). Labels name the dims a matcher follows (a request, a token, a head, ...);
BROADCAST is a dim whose entries do not depend on them (a broadcast, or data not followed). Sizes
statically 1 carry no order and are left out, so a dim of size 1 is (). Sizes may be SymInts: they
are compared with fx_match.equal (equal for every value of their symbols), and a reshape whose
regrouping that cannot prove is declined as Undecidable rather than guessed.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from dsv4_compile.passes.fx_match import RESHAPES, Decline, equal, is_call, require, shape

aten = torch.ops.aten
prims = torch.ops.prims

BROADCAST = "."
LAYOUT_OPS = RESHAPES | {aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                         aten.squeeze.default, aten.permute.default, aten.transpose.int, aten.clone.default,
                         aten.alias.default, prims.convert_element_type.default}


class Undecidable(Decline):
    """Symbolic sizes leave a layout check undecided."""

    def __init__(self) -> None:
        super().__init__("symbolic sizes the layout check cannot decide")


def is_one(size) -> bool:
    return isinstance(size, int) and size == 1


def is_symbolic(sizes) -> bool:
    return any(not isinstance(s, int) for s in sizes)


def same_shape(a, b) -> bool:
    """Shapes equal for every value of their symbols."""
    return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))


def labelled(shape_, labels) -> tuple:
    """The dims of a tensor of `shape_` whose dim i is labelled labels[i]."""
    return tuple(() if is_one(s) else ((label, s),) for s, label in zip(shape_, labels))


def same_dim(got: tuple, want: tuple) -> bool:
    """Dims with the same atoms, sizes compared symbolically."""
    return len(got) == len(want) and all(a == b and equal(x, y) for (a, x), (b, y) in zip(got, want))


def broadcast_dim(size) -> tuple:
    return () if is_one(size) else ((BROADCAST, size),)


def labels_of(dim) -> tuple:
    return tuple(label for label, _ in dim)


def is_full_slice(node) -> bool:
    """A slice that keeps its whole dim."""
    if not is_call(node, aten.slice.Tensor):
        return False
    dim, start, end = (list(node.args[1:]) + [0, None, None])[:3]
    return start in (0, None) and (end is None or (isinstance(end, int) and end >= 2**62)
                                   or equal(end, shape(node.args[0])[dim]))


def regrouped(dims: tuple, out_shape) -> tuple:
    """The dims read row-major as `out_shape` (the atoms keep their order and are regrouped);
    Decline if that splits an atom, or if symbolic sizes leave it undecided."""
    atoms = [a for dim in dims for a in dim]
    out, i = [], 0
    for size in out_shape:
        group, total = [], 1
        while not is_one(size) and not equal(total, size):
            if i == len(atoms):
                _split(atoms, out_shape)
            group.append(atoms[i])
            total *= atoms[i][1]
            i += 1
        out.append(tuple(group))
    if i != len(atoms):
        _split(atoms, out_shape)
    return tuple(out)


def _split(atoms: list, out_shape) -> None:
    if is_symbolic([s for _, s in atoms] + list(out_shape)):
        raise Undecidable()
    raise Decline("a reshape splits a dim")


def expanded(dims: tuple, out_shape) -> tuple:
    """The dims after an expand to `out_shape` (new and size-1 dims become broadcast dims)."""
    dims = ((),) * (len(out_shape) - len(dims)) + tuple(dims)
    return tuple(broadcast_dim(s) if dim == () else dim for dim, s in zip(dims, out_shape))


def dims_after_op(node: Node, dims: tuple) -> tuple:
    """The dims of `node` (a layout op, an elementwise op or a full slice) on a tensor with `dims`."""
    target, args = node.target, node.args
    if target in RESHAPES:
        return regrouped(dims, shape(node))
    if target == aten.expand.default:
        return expanded(dims, shape(node))
    if target == aten.unsqueeze.default:
        at = args[1] % (len(dims) + 1)
        return dims[:at] + ((),) + dims[at:]
    if target in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        listed = args[1] if len(args) > 1 else range(len(dims))
        gone = {d % len(dims) for d in (listed if isinstance(listed, (list, tuple, range)) else [listed])}
        require(all(dims[d] == () or isinstance(shape(args[0])[d], int) for d in gone),
                "a squeeze of a dim that may be 1")
        return tuple(dim for d, dim in enumerate(dims) if not (d in gone and dim == ()))
    if target == aten.permute.default:
        return tuple(dims[p % len(dims)] for p in args[1])
    if target == aten.transpose.int:
        a, b = (d % len(dims) for d in args[1:3])
        swapped = list(dims)
        swapped[a], swapped[b] = dims[b], dims[a]
        return tuple(swapped)
    return dims  # clone, alias, convert_element_type, elementwise, full slice


def dims_through(start: Node, start_dims: tuple, end, through=frozenset(), full_slices: bool = False) -> tuple:
    """The dims of `end`, reached from `start` (whose dims are `start_dims`) along first arguments
    through layout ops (and ops in `through`, elementwise; and full slices if `full_slices`);
    Decline when end is not such a view of start."""
    chain = []
    while end is not start:
        require(is_call(end, *LAYOUT_OPS, *through) or (full_slices and is_full_slice(end)),
                f"{getattr(end, 'name', end)} ({getattr(end, 'target', end)}) is not a layout op")
        chain.append(end)
        end = end.args[0]
    dims = start_dims
    for node in reversed(chain):
        dims = dims_after_op(node, dims)
    return dims
