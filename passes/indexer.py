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
torch.topk's, ties aside), with the -1s last like the matched form: passes/topk_readers.py
declines a site where anything else reads the top-k, or where a sorted top-k's result reaches a
reader that depends on their order. The model's decode and verify graphs read the indices only
order-free (gather_rows, then sparse_attention_with_sink over window + selected rows); SGLang's
transform calls topk(sorted=False), whose order the graph itself leaves unspecified.

A [T, S] top-k whose input hides slots >= lens with -inf is matched as SGLang's paged torch
indexer instead (passes/indexer_sglang.py) and becomes dsv4::indexer_topk_physical.
"""
from __future__ import annotations

import logging
import operator

import torch
from torch.fx import Graph, Node

import dsv4_compile.kernels.indexer_topk as kernel
from dsv4_compile.passes import indexer_sglang, topk_readers
from dsv4_compile.passes.dim_labels import BROADCAST, dims_through, is_one, labelled, labels_of, same_dim
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

    @property
    def outs(self) -> list[Node]:
        return [self.out]

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
            topk_readers.check_order_free(match.topk, match.outs, match.k)
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
