"""Whether anything reads the order of a top-k's indices, for a rewrite to an op that returns each
row's k indices in no particular order (a permutation of torch.topk's, ties aside).

  - nothing but the rewritten results may read the top-k: a reader left in place would pair
    torch.topk's order with the op's. Several results may be rewritten from one call of the op
    (SGLang's logical and physical slots, written side by side position by position), as they
    are permuted alike;
  - a sorted top-k is accepted only when every reader of the result is order-free over k. Readers
    are followed node by node: layout ops, pointwise ops whose other operands are constant along k,
    rows gathered by the indices, concatenation, slices and padding that keep the k positions
    whole, and matmuls, up to a reduction over k (a sum, a max, the softmax's, a matmul contracting
    k on both operands in the same order), where the order stops mattering. A graph output, or a
    copy into a graph input, takes the op's order as it is. Any other reader declines;
  - an unsorted top-k leaves the order unspecified in the graph itself: its readers are not
    followed.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch._inductor import inductor_prims
from torch.fx import Node

from dsv4_compile.passes.dim_labels import BROADCAST, LAYOUT_OPS, broadcast_dim, dims_after_op, expanded, is_one, \
    labelled, labels_of
from dsv4_compile.passes.fx_match import require, shape, val

aten = torch.ops.aten

_K = "k"
_REDUCTIONS = {aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.amax.default, aten.amin.default,
               aten.any.dim, aten.any.dims, aten.all.dim, aten.prod.dim_int, aten.logsumexp.default,
               aten.max.dim, aten.min.dim, inductor_prims.prepare_softmax_online}
_POSITION_OUTPUTS = {aten.max.dim, aten.min.dim}  # output 1: where the extreme lies


@dataclass(frozen=True)
class _Permuted:
    """A tensor that, on the op's indices instead of torch.topk's, holds its values permuted along
    its top-k dim, positions [block) only, by one permutation per row (the rows: the atoms of the
    indices' other dims)."""

    dims: tuple
    block: tuple

    @property
    def k_dim(self) -> int:
        return next(d for d, dim in enumerate(self.dims) if _K in labels_of(dim))

    def followed(self, rank: int) -> tuple:
        """Per dim, broadcast to `rank`, the followed atoms (rows and the top-k axis)."""
        dims = ((),) * (rank - len(self.dims)) + self.dims
        return tuple(tuple(key for key in labels_of(dim) if key != BROADCAST) for dim in dims)

    def with_dim(self, dim: int, label: tuple, shift=0) -> "_Permuted":
        dims = self.dims[:dim] + (label,) + self.dims[dim + 1:]
        return _Permuted(dims, (self.block[0] + shift, self.block[1] + shift))


def check_order_free(topk: Node, outs: list[Node], k: int) -> None:
    """Declines unless the rewrite's results `outs` (each [rows..., k], all taken from one call of
    the op, so permuted alike) are all that reads the top-k and, for a sorted top-k, no reader
    depends on the order of a row's k indices (module docstring)."""
    order = {node: i for i, node in enumerate(topk.graph.nodes)}
    _check_read_only_through(topk, outs, order)
    if k == 1 or not _sorted(topk):
        return
    rows = [f"row{i}" for i in range(len(shape(outs[0])) - 1)]
    state = {out: _Permuted(labelled(shape(out), rows + [_K]), (0, k)) for out in outs}
    node = min(outs, key=order.__getitem__).next
    while node.op != "root":
        if any(a in state for a in node.all_input_nodes):
            permuted = _read(node, state)
            if permuted is not None:
                state[node] = permuted
        node = node.next


def _sorted(topk: Node) -> bool:
    return topk.args[4] if len(topk.args) > 4 else topk.kwargs.get("sorted", True)


def _check_read_only_through(topk: Node, outs: list[Node], order: dict[Node, int]) -> None:
    """Everything that reads the top-k leads to one of `outs`: after the rewrite nothing else may
    read torch.topk's order (it would be paired with the op's). `order`: each node's graph position."""
    leads, todo = set(outs), list(outs)
    while todo:
        for arg in todo.pop().all_input_nodes:
            if order[arg] > order[topk] and arg not in leads:
                leads.add(arg)
                todo.append(arg)
    seen, todo = set(), [topk]
    while todo:
        for user in todo.pop().users:
            require(user in leads, f"the top-k is also read by {user.name} ({user.target}), "
                                   "besides the rewritten result")
            if user not in outs and user not in seen:
                seen.add(user)
                todo.append(user)


def _read(node: Node, state: dict) -> _Permuted | None:
    """What `node`, a reader of a permuted tensor, makes of it: permuted again (returned), or
    unaffected by the order (None). Declines any reader that may depend on it."""
    if node.op == "output":
        return None  # the caller gets the op's contract: a set of indices per row
    target = getattr(node, "target", None)
    reason = f"the top-k indices reach {node.name} ({target}), which may depend on their order"
    require(node.op == "call_function", reason)
    if target == operator.getitem:
        return state[node.args[0]]
    if target == aten.copy_.default:
        dst, src = node.args[:2]
        require(dst not in state and dst.op == "placeholder",
                f"{node.name} copies the top-k indices into {dst.name}, not into a graph input")
        return None
    handler = _READERS.get(target)
    if handler is not None:
        return handler(node, state)
    require(isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags, reason)
    return _merged(node, shape(node), node.all_input_nodes, state)


def _merged(node: Node, out_shape, operands, state: dict) -> _Permuted:
    """Broadcasting `operands` to `out_shape`: the permuted ones must agree on the rows and the
    top-k positions, the others must not vary along the top-k dim."""
    rank = len(out_shape)
    permuted = [state[a] for a in operands if a in state]
    first = permuted[0]
    for other in permuted[1:]:
        require(other.followed(rank) == first.followed(rank) and other.block == first.block,
                f"{node.name} combines top-k indices of different rows or positions")
    k_dim = first.k_dim + rank - len(first.dims)
    for arg in operands:
        if arg not in state and isinstance(val(arg), torch.Tensor):
            arg_shape = shape(arg)
            at = k_dim - (rank - len(arg_shape))
            require(at < 0 or is_one(arg_shape[at]),
                    f"{node.name} combines the top-k indices with {arg.name}, which varies along the top-k dim")
    dims = ((),) * (rank - len(first.dims)) + first.dims
    dims = tuple(dim if any(key != BROADCAST for key in labels_of(dim)) else broadcast_dim(size)
                 for dim, size in zip(dims, out_shape))
    return _Permuted(dims, first.block)


def _read_layout(node: Node, state: dict) -> _Permuted:
    permuted = state[node.args[0]]
    out = _Permuted(dims_after_op(node, permuted.dims), permuted.block)
    require(len(out.dims[out.k_dim]) == 1, f"{node.name} merges the top-k dim with another dim")
    return out


def _read_reduction(node: Node, state: dict) -> _Permuted | None:
    permuted = state[node.args[0]]
    rank = len(permuted.dims)
    target, args = node.target, node.args
    if target == inductor_prims.prepare_softmax_online:
        dims, keepdim = [args[1]], True
    else:
        dims, keepdim = _arg(node, 1, "dim", None), _arg(node, 2, "keepdim", False)
    if not isinstance(dims, (list, tuple)):
        dims = range(rank) if dims is None else [dims]
    elif not dims:
        dims = range(rank)
    reduced = {d % rank for d in dims}
    if permuted.k_dim in reduced:
        require(target not in _POSITION_OUTPUTS or not any(u.args[1] == 1 for u in node.users),
                f"{node.name} takes the position of the extreme along the top-k dim")
        return None
    require(not any(permuted.followed(rank)[d] for d in reduced), f"{node.name} reduces over the rows of the top-k")
    dims = tuple(() if d in reduced else dim for d, dim in enumerate(permuted.dims) if keepdim or d not in reduced)
    return _Permuted(dims, permuted.block)


def _read_matmul(node: Node, state: dict) -> _Permuted | None:
    """bmm a [N, M, C] @ b [N, C, P] (mm: without N)."""
    a, b = node.args[:2]
    batch = int(node.target == aten.bmm.default)
    pa, pb = state.get(a), state.get(b)
    rank, out_shape = batch + 2, shape(node)
    if (pa is not None and pa.k_dim == batch + 1) or (pb is not None and pb.k_dim == batch):
        require(pa is not None and pb is not None and pa.k_dim == batch + 1 and pb.k_dim == batch
                and pa.block == pb.block, f"{node.name} sums the top-k dim against a tensor in a fixed order")
        require(pa.followed(rank)[:batch] == pb.followed(rank)[:batch] and not pa.followed(rank)[batch]
                and not pb.followed(rank)[batch + 1], f"{node.name} pairs top-k indices of different rows")
        return None
    require(pa is None or pb is None, f"{node.name} multiplies two top-k dims")
    permuted, contracted = (pa, batch + 1) if pa is not None else (pb, batch)
    require(permuted.k_dim >= batch and not permuted.followed(rank)[contracted],
            f"{node.name} sums over the rows of the top-k")
    if pa is not None:
        return _Permuted(pa.dims[:batch + 1] + (broadcast_dim(out_shape[-1]),), pa.block)
    return _Permuted(pb.dims[:batch] + (broadcast_dim(out_shape[-2]), pb.dims[batch + 1]), pb.block)


def _read_index(node: Node, state: dict) -> _Permuted:
    """src[indices]: the top-k indices (or values derived from them) pick rows of src."""
    src, indices = node.args[:2]
    require(src not in state, f"{node.name} reads the top-k indices by position")
    require(all(isinstance(i, Node) and val(i).dtype not in (torch.bool, torch.uint8) for i in indices),
            f"{node.name} indexes with a mask or a slice besides the top-k indices")
    out_shape = shape(node)
    lead = len(out_shape) - (len(shape(src)) - len(indices))
    picked = _merged(node, out_shape[:lead], indices, state)
    return _Permuted(picked.dims + tuple(broadcast_dim(s) for s in out_shape[lead:]), picked.block)


def _read_gather(node: Node, state: dict) -> _Permuted:
    src, dim, index = node.args[:3]
    permuted = state.get(index)
    require(src not in state and permuted is not None and dim % len(permuted.dims) == permuted.k_dim,
            f"{node.name} gathers the top-k indices by position")
    return permuted


def _read_cat(node: Node, state: dict) -> _Permuted:
    tensors = node.args[0]
    out_shape = shape(node)
    dim = _arg(node, 1, "dim", 0) % len(out_shape)
    permuted = [t for t in tensors if t in state]
    first = state[permuted[0]]
    if first.k_dim == dim:
        require(len(permuted) == 1, f"{node.name} concatenates two top-k dims")
        offset = sum(shape(t)[dim] for t in tensors[:tensors.index(permuted[0])])
        require(isinstance(offset, int), f"{node.name} places the top-k indices at a symbolic offset")
        return first.with_dim(dim, ((_K, out_shape[dim]),), offset)
    require(len(permuted) == len(tensors) and not first.followed(len(out_shape))[dim]
            and all(state[t].followed(len(out_shape)) == first.followed(len(out_shape)) for t in permuted),
            f"{node.name} concatenates top-k indices with other values along another dim")
    return first.with_dim(dim, broadcast_dim(out_shape[dim]))


def _slice_bounds(size, start, end, step) -> tuple:
    start, end = 0 if start is None else start, size if end is None else end
    require(all(isinstance(x, int) for x in (size, start, end, step)), "a symbolic slice of the top-k dim")
    start, end = (x + size if x < 0 else x for x in (start, end))
    return start, min(end, size)


def _arg(node: Node, i: int, name: str, default):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _slice_args(node: Node, first: int) -> tuple:
    """(dim, start, end, step) of a slice or slice_scatter whose dim is argument `first`."""
    return tuple(_arg(node, first + i, name, default)
                 for i, (name, default) in enumerate((("dim", 0), ("start", None), ("end", None), ("step", 1))))


def _read_slice(node: Node, state: dict) -> _Permuted:
    return _placed(node, state[node.args[0]], *_slice_args(node, 1), shape(node.args[0]), -1)


def _read_slice_scatter(node: Node, state: dict) -> _Permuted:
    base, src = node.args[:2]
    require(base not in state, f"{node.name} writes into the top-k indices")
    return _placed(node, state[src], *_slice_args(node, 2), shape(base), 1)


def _placed(node: Node, permuted: _Permuted, dim, start, end, step, full_shape, sign: int) -> _Permuted:
    """A slice (sign -1) of a permuted tensor, or one written into a slice (sign 1) of another."""
    out_shape = shape(node)
    dim %= len(out_shape)
    if dim == permuted.k_dim:
        start, end = _slice_bounds(full_shape[dim], start, end, step)
        if sign < 0:
            require(step == 1 and start <= permuted.block[0] and end >= permuted.block[1],
                    f"{node.name} takes part of the top-k indices by position")
        else:
            require(step == 1, f"{node.name} spreads the top-k indices with a step")
        return permuted.with_dim(dim, ((_K, out_shape[dim]),), sign * start)
    if permuted.followed(len(out_shape))[dim]:
        require((start is None or isinstance(start, int) and start == 0) and step == 1
                and len(permuted.dims[dim]) == 1,
                f"{node.name} moves the rows of the top-k")
        return permuted.with_dim(dim, ((permuted.dims[dim][0][0], out_shape[dim]),))
    return permuted.with_dim(dim, broadcast_dim(out_shape[dim]))


def _read_copy(node: Node, state: dict) -> _Permuted | None:
    """copy(dst, src): src broadcast to dst's shape, all of dst's values overwritten."""
    src = state.get(node.args[1])
    return None if src is None else _Permuted(expanded(src.dims, shape(node)), src.block)


def _read_pad(node: Node, state: dict) -> _Permuted:
    permuted = state[node.args[0]]
    pads, out_shape = node.args[1], shape(node)
    for i in range(len(pads) // 2):
        dim, low, high = len(out_shape) - 1 - i, pads[2 * i], pads[2 * i + 1]
        if dim == permuted.k_dim:
            require(permuted.block[0] + low >= 0 and permuted.block[1] + low <= out_shape[dim],
                    f"{node.name} crops the top-k indices")
            permuted = permuted.with_dim(dim, ((_K, out_shape[dim]),), low)
        elif permuted.followed(len(out_shape))[dim]:
            require(low == high == 0, f"{node.name} pads the rows of the top-k")
        else:
            permuted = permuted.with_dim(dim, broadcast_dim(out_shape[dim]))
    return permuted


_READERS = {**{op: _read_layout for op in LAYOUT_OPS}, **{op: _read_reduction for op in _REDUCTIONS},
            aten.bmm.default: _read_matmul, aten.mm.default: _read_matmul, aten.index.Tensor: _read_index,
            aten.gather.default: _read_gather, aten.cat.default: _read_cat, aten.slice.Tensor: _read_slice,
            aten.slice_scatter.default: _read_slice_scatter, aten.constant_pad_nd.default: _read_pad,
            aten.copy.default: _read_copy}
