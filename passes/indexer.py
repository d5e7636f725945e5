"""Rewrite the full-context lightning-indexer top-k to torch.ops.dsv4.indexer_topk.

Hand-written FX matching on inductor's post-grad graph, anchored on `aten.topk` and keyed on
the math (dsv4_compile.model.hotspots.indexer_topk_full_context):

    keys   = k_pages[page_table]                      index -> reshape [B, S, D], S = NP * 64
    logits = q [B,T,H,D] @ keys^T                     bmm over (B or B*T), reshaped [B, T, H, S]
                                                      (or a batch-1 bmm as inductor's mm form, on GPU)
    scores = sum_h (relu(logits) * c) * weights[..., None]     (c: an optional constant)
    scores = where(slot >= visible[..., None], -inf, scores)   slot = iota(S)
    top    = topk(scores, k, dim=-1).indices
    out    = where(top >= visible[..., None], -1, top)         (optionally cast)

becomes indexer_topk(q, weights * c, k_pages, None, page_table.int(),
clamp(visible, 0, S).int(), k) (cast like `out`).
Declines (recorded with the reason): another activation or reduction, a page size other than
64, a head count or head dim the op does not take, topk > 2048, a topk over another dim, a
top-k whose values are used, and:

Batch order. The query and the gathered keys are followed dim by dim through their layout ops
to the logits bmm, whose row n must pair the query (b, t) = divmod(n, T) with the keys of
request b (keys broadcast over T before B would score request t's keys for the query (b, t),
with sizes that still fit when B == T).

Order of the top-k. The op returns a row's k indices in no particular order (a permutation of
torch.topk's, ties aside), with the -1s last like the matched form. So:
  - nothing but the rewritten result may read the top-k: a second reader (SGLang's raw indices,
    written next to the physical ones position by position) would pair torch.topk's order with
    the op's;
  - a sorted top-k (torch.topk's default; the model's hot spot) is rewritten only when every
    reader of the result is order-free over k. Readers are followed node by node: layout ops,
    pointwise ops whose other operands are constant along k, rows gathered by the indices,
    concatenation, slices and padding that keep the k positions whole, and matmuls, up to a
    reduction over k (a sum, a max, the softmax's, a matmul contracting k on both operands in the
    same order), where the order stops mattering. The model's decode and verify graphs read the
    indices only so (gather_rows, then sparse_attention_with_sink over window + selected rows).
    A graph output, or a copy into a graph input, takes the op's order as it is: the caller then
    gets the op's contract (the hot spot compiled alone; the model's step returns none). Any
    other reader declines: idx[..., 0] as "the best", a slice of some positions, a cumsum, a
    tensor varying along k combined with the indices, a reduction over the rows...;
  - an unsorted top-k (SGLang's transform calls topk(sorted=False)) leaves the order unspecified
    in the graph itself: any order the op gives is one the graph allows, so its readers (SGLang's
    attention backends, through c4_sparse_page_indices) are not followed.

A [T, S] top-k whose input hides slots >= lens with -inf is matched as SGLang's paged torch
indexer instead (passes/indexer_sglang.py) and becomes dsv4::indexer_topk_physical.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
from torch._inductor import inductor_prims
from torch.fx import Graph, Node

import dsv4_compile.kernels.indexer_topk as kernel
from dsv4_compile.passes import indexer_sglang
from dsv4_compile.passes.dim_labels import (BROADCAST, LAYOUT_OPS, broadcast_dim, dims_after_op, dims_through,
                                            expanded, is_one, labelled, labels_of, same_dim)
from dsv4_compile.passes.fx_match import (PASS_THROUGH, RESHAPES, Decline, call, equal, is_call, match_bmm, require,
                                          shape, strip, topk_dim_largest, val)

logger = logging.getLogger("dsv4_compile")

PASS_NAME = "indexer"

aten = torch.ops.aten
prims = torch.ops.prims


def _last_dim(dim, rank) -> bool:
    return dim in (-1, rank - 1)


def _constant_scale(node: Node) -> tuple[Node, float]:
    """node = x * c (c a python number, either side) -> (x, c); otherwise (node, 1.0)."""
    if is_call(node, aten.mul.Tensor, aten.mul.Scalar):
        a, b = node.args
        if isinstance(b, (int, float)):
            return a, float(b)
        if isinstance(a, (int, float)):
            return b, float(a)
    return node, 1.0


def _visible_of(mask_ref: Node, slots: Node | None = None) -> Node:
    """unsqueeze(visible, -1) -> visible (the per-token count of visible slots)."""
    require(is_call(mask_ref, aten.unsqueeze.default) and mask_ref.args[1] in (-1, 2),
             "mask is not against visible[..., None]")
    return mask_ref.args[0]


def _is_slot_iota(node: Node, slots) -> bool:
    node = strip(node, RESHAPES)
    if is_call(node, prims.iota.default):
        return equal(node.args[0], slots) and node.kwargs.get("start", 0) == 0 \
            and node.kwargs.get("step", 1) == 1
    if is_call(node, aten.arange.default, aten.arange.start):
        return node.target == aten.arange.default and equal(node.args[0], slots)
    return False


class _Match:
    """The pieces of one matched site."""

    def __init__(self, topk_node: Node):
        self.topk = topk_node
        scores, k = topk_node.args[:2]
        dim, largest = topk_dim_largest(topk_node)
        rank = len(shape(scores))
        require(rank == 3, f"top-k input is rank {rank}, not [B, T, S]")
        require(_last_dim(dim, rank), f"topk over dim {dim}, not the slot dim")
        require(largest, "topk of the smallest scores")
        require(isinstance(k, int), "symbolic topk")
        self.k = k
        self._match_tail()
        self._match_mask(scores)
        self._match_scores()
        self._match_keys()
        self._match_query()
        self._check_sizes()
        self._check_batch_order()

    def _match_tail(self):
        users = list(self.topk.users)
        require(all(is_call(u, operator.getitem) for u in users), "top-k result used whole")
        require(all(u.args[1] == 1 for u in users), "top-k values are used")
        require(len(users) == 1, "top-k indices read more than once")
        top_idx = users[0]
        where = [u for u in top_idx.users if is_call(u, aten.where.self)]
        require(len(top_idx.users) == 2 and len(where) == 1,
                 "top-k indices are not masked with -1 past the visible count")
        where = where[0]
        cond, fill, other = where.args
        require(other is top_idx and is_call(cond, aten.ge.Tensor) and cond.args[0] is top_idx,
                 "top-k indices are not masked with where(idx >= visible, -1, idx)")
        require(is_call(fill, aten.full.default) and fill.args[1] == -1,
                 "masked top-k indices are not filled with -1")
        self.tail_visible = _visible_of(cond.args[1])
        self.out = where
        if len(where.users) == 1:
            (user,) = where.users
            if is_call(user, prims.convert_element_type.default):
                self.out = user

    def _match_mask(self, scores: Node):
        require(is_call(scores, aten.where.self), "top-k input is not masked by the visible count")
        cond, fill, raw = scores.args
        require(is_call(fill, aten.full.default) and fill.args[1] == float("-inf"),
                 "masked scores are not filled with -inf")
        require(is_call(cond, aten.ge.Tensor), "mask is not slot >= visible")
        slots = shape(scores)[2]
        require(_is_slot_iota(cond.args[0], slots), "mask does not compare the slot number")
        visible = _visible_of(cond.args[1])
        require(visible is self.tail_visible or strip(visible) is strip(self.tail_visible),
                 "score mask and index mask use different visible counts")
        self.visible = visible
        self.scores = raw

    def _match_scores(self):
        s = self.scores
        require(is_call(s, aten.sum.dim_IntList), "scores are not a sum over heads")
        require(list(s.args[1]) in ([2], [-2]) and not (len(s.args) > 2 and s.args[2]),
                 f"sum over dims {list(s.args[1])}, not the head dim")
        prod = s.args[0]
        require(is_call(prod, aten.mul.Tensor), "summed term is not a weighted activation")
        a, b = prod.args
        weight_side = [x for x in (a, b) if is_call(x, aten.unsqueeze.default)
                       and x.args[1] in (-1, 3) and len(shape(x.args[0])) == 3]
        require(len(weight_side) == 1, "head weights are not weights[..., None]")
        self.weights = weight_side[0].args[0]
        act = b if weight_side[0] is a else a
        act, scale = _constant_scale(act)
        require(is_call(act, aten.relu.default),
                 f"activation {getattr(act, 'target', act)} is not relu")
        logits, inner = _constant_scale(act.args[0])
        require(inner > 0, "a non-positive scale inside relu")
        self.scale = scale * inner
        require(is_call(logits, *RESHAPES), "logits are not a reshaped bmm")
        self.bmm = match_bmm(logits.args[0], "logits")
        self.logits_shape = shape(logits)

    def _match_keys(self):
        node = self.bmm.mat2
        last_two = shape(node)[-2:]
        while is_call(node, *PASS_THROUGH):
            require(tuple(shape(node)[-2:]) == tuple(last_two),
                     "keys are reshaped across the (D, S) dims")
            if is_call(node, prims.convert_element_type.default):
                require(node.args[1] == torch.float32, "keys cast to a type other than f32")
            node = node.args[0]
        require(is_call(node, aten.permute.default, aten.transpose.int), "keys are not transposed")
        if node.target == aten.permute.default:
            require(list(node.args[1]) == [0, 2, 1], "keys permuted other than [0, 2, 1]")
        else:
            require(sorted(d % 3 for d in node.args[1:3]) == [1, 2], "keys transposed wrongly")
        flat = strip(node.args[0], {prims.convert_element_type.default})
        require(is_call(flat, *RESHAPES), "transposed keys are not a reshape of the gather")
        gathered = strip(flat.args[0], {prims.convert_element_type.default})
        require(is_call(gathered, aten.index.Tensor) and len(gathered.args[1]) == 1,
                 "keys are not k_pages[page_table]")
        self.k_pages = gathered.args[0]
        self.page_table = strip(gathered.args[1][0], {prims.convert_element_type.default})
        self.gathered_shape = shape(gathered)  # [B, NP, page, D]
        self.flat = flat  # [B, S, D]
        self.flat_shape = shape(flat)

    def _match_query(self):
        node = self.bmm.mat1
        while is_call(node, *PASS_THROUGH) and len(shape(node)) != 4:
            node = node.args[0]
        query_shape = shape(node)
        node = strip(node, {aten.expand.default, aten.clone.default,
                             prims.convert_element_type.default})
        require(len(shape(node)) == 4, "query is not [B, T, H, D]")
        require(all(equal(a, b) for a, b in zip(shape(node), query_shape)),
                 "query is broadcast, not [B, T, H, D]")
        self.q = node

    def _check_sizes(self):
        batch, tokens, heads, dim = shape(self.q)
        pages_shape = shape(self.k_pages)
        require(len(pages_shape) == 3, "k_pages is not [P, page, D]")
        page = pages_shape[1]
        require(equal(page, kernel.PAGE_SIZE), f"page size {page} != {kernel.PAGE_SIZE}")
        g_batch, n_pages, _, g_dim = self.gathered_shape
        slots = self.flat_shape[1]
        require(equal(slots, n_pages * kernel.PAGE_SIZE),
                 "gathered width is not page-table columns x 64")
        require(equal(g_batch, batch) and equal(g_dim, dim) and equal(pages_shape[2], dim),
                 "keys and query disagree on B or D")
        lb, lt, lh, ls = self.logits_shape
        require(all(equal(x, y) for x, y in ((lb, batch), (lt, tokens), (lh, heads),
                                               (ls, slots))),
                 "logits are not [B, T, H, S]")
        require(equal(shape(self.bmm.mat1)[-1], dim), "bmm does not contract the head dim")
        require(tuple(shape(self.weights)) == (batch, tokens, heads), "weights are not [B, T, H]")
        require(tuple(shape(self.visible)) == (batch, tokens), "visible is not [B, T]")
        require(not val(self.visible).dtype.is_floating_point and val(self.visible).dtype != torch.bool,
                 f"visible is {val(self.visible).dtype}, not an integer count")
        require(1 <= self.k <= kernel.MAX_TOPK, f"topk {self.k} > {kernel.MAX_TOPK}"
                 if self.k > kernel.MAX_TOPK else f"topk {self.k} < 1")
        for name, size, lo, hi in (("heads", heads, kernel.MIN_HEADS, kernel.MAX_HEADS),
                                   ("head dim", dim, 16, kernel.MAX_HEAD_DIM)):
            require(not isinstance(size, torch.SymInt), f"symbolic {name}")
            require(lo <= size <= hi, f"{name} {size} not in [{lo}, {hi}]")
        require(dim % 16 == 0, f"head dim {dim} is not a multiple of 16")
        require(not isinstance(slots, torch.SymInt), "symbolic page-table width")
        self.slots = slots
        for name, node, dtypes in (("q", self.q, kernel._Q_DTYPES),
                                   ("k_pages", self.k_pages, kernel._K_DTYPES)):
            dtype = val(node).dtype
            require(dtype in dtypes, f"{name} dtype {dtype} not supported")

    def _check_batch_order(self):
        """The bmm's row n must pair the query (b, t) = divmod(n, T) with the keys of request b:
        the query [B, T, H, D] and the gathered keys [B, S, D] reach it through layout ops, which
        are followed dim by dim (a reshape or expand that puts T before B would mix requests,
        with sizes that still fit when B == T)."""
        batch, tokens = shape(self.q)[:2]
        rows = tuple(a for a in (("b", batch), ("t", tokens)) if not is_one(a[1]))
        q_dims = dims_through(self.q, labelled(shape(self.q), "bthd"), self.bmm.mat1)
        require(len(q_dims) == 3 and same_dim(q_dims[0], rows) and labels_of(q_dims[1]) == ("h",)
                and labels_of(q_dims[2]) == ("d",), "the bmm's query rows are not the queries (b, t) in order")
        key_rows = tuple(a for a in (("b", batch), (BROADCAST, tokens)) if not is_one(a[1]))
        k_dims = dims_through(self.flat, labelled(shape(self.flat), "bsd"), self.bmm.mat2)
        require(len(k_dims) == 3 and same_dim(k_dims[0], key_rows) and labels_of(k_dims[1]) == ("d",)
                and labels_of(k_dims[2]) == ("s",),
                "the bmm's key rows are not the keys of request b for each query (b, t): requests mixed")


def _rewrite(graph: Graph, m: _Match) -> None:
    convert = prims.convert_element_type.default
    with graph.inserting_before(m.out):
        weights = m.weights
        if val(weights).dtype != torch.float32:
            weights = call(graph, convert, (weights, torch.float32))
        if m.scale != 1.0:
            weights = call(graph, aten.mul.Tensor, (weights, m.scale))
        lens = call(graph, aten.clamp_min.default, (m.visible, 0))
        lens = call(graph, aten.clamp_max.default, (lens, m.slots))
        lens = call(graph, convert, (lens, torch.int32))
        page_table = m.page_table
        if val(page_table).dtype != torch.int32:
            page_table = call(graph, convert, (page_table, torch.int32))
        idx = call(graph, torch.ops.dsv4.indexer_topk.default,
                    (m.q, weights, m.k_pages, None, page_table, lens, m.k))
        if val(m.out).dtype != torch.int32:
            idx = call(graph, convert, (idx, val(m.out).dtype))
    m.out.replace_all_uses_with(idx)
    graph.erase_node(m.out)


# -- readers of the top-k order -----------------------------------------------------------------
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


def check_order_free(topk: Node, out: Node, k: int) -> None:
    """Declines unless the rewrite's result `out` ([rows..., k]) is all that reads the top-k and,
    for a sorted top-k, no reader depends on the order of a row's k indices (module docstring)."""
    _check_read_only_through(topk, out)
    if k == 1 or not _sorted(topk):
        return
    rows = [f"row{i}" for i in range(len(shape(out)) - 1)]
    state = {out: _Permuted(labelled(shape(out), rows + [_K]), (0, k))}
    node = out.next
    while node.op != "root":
        if any(a in state for a in node.all_input_nodes):
            permuted = _read(node, state)
            if permuted is not None:
                state[node] = permuted
        node = node.next


def _sorted(topk: Node) -> bool:
    return topk.args[4] if len(topk.args) > 4 else topk.kwargs.get("sorted", True)


def _check_read_only_through(topk: Node, out: Node) -> None:
    """Everything that reads the top-k leads to `out`: after the rewrite nothing else may read
    torch.topk's order (it would be paired with the op's)."""
    order = {node: i for i, node in enumerate(topk.graph.nodes)}
    leads, todo = {out}, [out]
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
            if user is not out and user not in seen:
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


def apply(graph: Graph, report) -> int:
    """Rewrite every full-context indexer top-k in `graph`; returns the number rewritten."""
    rewrites = 0
    for node in list(graph.nodes):
        if not is_call(node, aten.topk.default):
            continue
        rank = node.args[0].meta["val"].dim()
        if rank == 3:
            match, rewrite = _Match, _rewrite
        elif rank == 2 and indexer_sglang.is_candidate(node):
            match, rewrite = indexer_sglang.SglangMatch, indexer_sglang.rewrite
        else:
            continue  # e.g. an MoE router's top-k: not a candidate
        try:
            match = match(node)
            check_order_free(match.topk, match.out, match.k)
        except Decline as why:
            report.record(PASS_NAME, node, False, str(why))
            logger.debug("indexer pass declined %s: %s", node.name, why)
            continue
        rewrite(graph, match)
        report.record(PASS_NAME, node, True)
        rewrites += 1
    if rewrites:
        graph.eliminate_dead_code()
    return rewrites
