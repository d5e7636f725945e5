"""Match SGLang's torch paged indexer (scores + top-k transform) for passes/indexer.py.

The form, in post-grad aten (T query rows; verify is flattened into rows, each with its own
length; W = 64 * (D + 4) bytes per page: 64 x D fp8 values, then 64 f32 scales):

    pages  = cache_u8 [P, W][page_table.clamp(min=0)]                       [T, NP, W]
    keys   = view_dtype(pages[..., :64*D], fp8) -> bf16 -> reshape [T, S, D]   S = NP * 64
    kscale = view_dtype(pages[..., 64*D:], f32) -> reshape [T, S]
    logits = bmm(keys, q[T, 1, H, D][:, 0] -> bf16 -> permute [T, D, H])     [T, S, H]
             (at T = 1 on GPU, inductor's mm form of the bmm: see fx_match.match_bmm)
    scores = sum_h(relu(logits) * weights[T, H][:, None]) * kscale          (then slots
             s >= lens masked with 0 or -inf; optional)
    raw    = topk(where(s >= lens, -inf, scores), K, dim=1).indices
    sel    = where(lens <= K, where(j >= lens, -1, j), raw)                 j = iota(K)
    valid  = where(lens <= K, j < lens, scores[row, sel] != -inf)
    out    = where(~valid, -1, (page_table[b, sel >> 6] << 6) | (sel & 63))
    logic  = where(~valid, -1, sel)                                         (optional: SGLang's
             out_raw_indices, the logical slots beside the physical ones)

becomes view(indexer_topk_physical(q, weights[:, None], k_cache, k_scale, page_table,
clamp(lens, 0, S)[:, None], K), [T, K]), where k_cache [P, 64, D] fp8 and k_scale [P, 64] f32
are strided views of the same cache bytes (never copies). With `logic`, both come from one call
instead: logic = view(indexer_topk(...), [T, K]) and out its translation to physical slots, so
they pair position by position as SGLang's do. `scores[row, sel] != -inf` is true
for every selected slot when lens > K and the scores are finite, which is the op's contract.
Rows stay aligned without following dims: every step from the page table and from q to the bmm
is pinned (the gather, a last-dim slice, a dtype view, one reshape to [T, S, D]; q[:, 0] permuted
[0, 2, 1]) and all of them have T rows. Who may read the top-k: passes/indexer.py.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

import dsv4_compile.kernels.indexer_topk as kernel
from dsv4_compile.passes.fx_match import (
    call,
    equal,
    is_call,
    match_bmm,
    require,
    shape,
    strip,
    topk_dim_largest,
    val,
)

aten = torch.ops.aten
prims = torch.ops.prims

_CONVERT = prims.convert_element_type.default
_VIEWS = {aten.unsqueeze.default, aten.expand.default, aten.clone.default, _CONVERT}
_PAGE_BITS = kernel.PAGE_SIZE.bit_length() - 1
_SCALE_BYTES = 4  # one f32 per slot


def _same(a: Node, b: Node) -> bool:
    return strip(a, _VIEWS) is strip(b, _VIEWS)


def _is_full(node, value) -> bool:
    return is_call(node, aten.full.default) and node.args[1] == value


def _iota(node: Node, size) -> bool:
    node = strip(node, _VIEWS)
    return is_call(node, prims.iota.default) and equal(node.args[0], size) \
        and node.kwargs.get("start", 0) == 0 and node.kwargs.get("step", 1) == 1


def _hidden(cond: Node, size) -> Node:
    """cond = (iota(size) >= lens[:, None]) or ~(iota(size) < lens[:, None]) -> lens."""
    if is_call(cond, aten.bitwise_not.default, aten.logical_not.default):
        inner = cond.args[0]
        require(is_call(inner, aten.lt.Tensor), "mask is not slot >= lens")
    else:
        require(is_call(cond, aten.ge.Tensor), "mask is not slot >= lens")
        inner = cond
    pos, lens = inner.args
    require(strip(pos, _VIEWS).op != "placeholder",
            "mask compares a graph input, not iota: slot numbers unknown at compile time "
            "(e.g. SGLang's _arange_cache was filled before this compile)")
    require(_iota(pos, size), "mask does not compare the slot number")
    require(is_call(lens, aten.unsqueeze.default) and lens.args[1] in (1, -1)
            and len(shape(lens.args[0])) == 1, "mask is not against lens[:, None]")
    return lens.args[0]


def _slice(node: Node) -> tuple[Node, int, int]:
    """node = slice(src, last dim, start, end) -> (src, start, end clamped to the dim's size)."""
    require(is_call(node, aten.slice.Tensor), "the page is not sliced into values and scales")
    src, dim, start, end = (list(node.args) + [0, None, None])[:4]
    require(dim in (-1, len(shape(src)) - 1), "the page is sliced along another dim")
    size = shape(src)[-1]
    end = size if end is None else min(end, size)
    return src, start or 0, end


def _page_bytes(node: Node, dtypes: tuple, what: str) -> tuple[Node, torch.dtype]:
    """node = reshape(cast?(view_dtype(clone?(slice of the page bytes)))) -> (slice, dtype)."""
    require(is_call(node, aten.reshape.default, aten.view.default),
            f"{what} are not a reshape of the page bytes")
    viewed = strip(node.args[0], {_CONVERT})
    require(is_call(viewed, aten.view.dtype) and viewed.args[1] in dtypes,
            f"{what} are not the page bytes viewed as {dtypes}")
    return strip(viewed.args[0], {aten.clone.default}), viewed.args[1]


def is_candidate(topk_node: Node) -> bool:
    """A [T, S] top-k whose input is set to -inf where something compares against lens[:, None]
    (so a decline of a near miss is recorded, while e.g. an MoE router's top-k is skipped)."""
    masked = topk_node.args[0]
    if not (is_call(masked, aten.where.self) and _is_full(masked.args[1], float("-inf"))):
        return False
    cond = masked.args[0]
    if is_call(cond, aten.bitwise_not.default, aten.logical_not.default):
        cond = cond.args[0]
    return is_call(cond, aten.lt.Tensor, aten.ge.Tensor) and is_call(cond.args[1], aten.unsqueeze.default)


class SglangMatch:
    """The pieces of one SGLang-form site, anchored at a [T, S] aten.topk."""

    def __init__(self, topk_node: Node):
        self.topk = topk_node
        masked, k = topk_node.args[:2]
        dim, largest = topk_dim_largest(topk_node)
        require(dim in (1, -1), f"topk over dim {dim}, not the slot dim")
        require(largest, "topk of the smallest scores")
        require(isinstance(k, int), "symbolic topk")
        self.k = k
        self.rows, self.slots = shape(masked)
        require(not isinstance(self.slots, torch.SymInt), "symbolic page-table width")
        require(k <= self.slots, f"topk {k} > slots {self.slots} (padded top-k)")
        self._match_scores(masked)
        self._match_tail()
        self._match_keys()
        self._check_sizes()

    # -- the scores: masked, weighted relu of a bmm, times the key scales --------------------
    def _match_scores(self, masked: Node):
        require(is_call(masked, aten.where.self) and _is_full(masked.args[1], float("-inf")),
                "top-k input is not the scores with hidden slots at -inf")
        self.lens = _hidden(masked.args[0], self.slots)
        scores = strip(masked.args[2], {aten.clone.default})
        self.scores = scores
        if is_call(scores, aten.where.self):  # the scorer's own mask (0 or -inf past lens)
            require(_is_full(scores.args[1], 0.0) or _is_full(scores.args[1], float("-inf")),
                    "scores are masked with a value other than 0 or -inf")
            require(_same(_hidden(scores.args[0], self.slots), self.lens),
                    "scores and top-k are masked with different lens")
            scores = scores.args[2]
        require(is_call(scores, aten.mul.Tensor), "scores are not scaled by the key scales")
        summed = [a for a in scores.args if is_call(a, aten.sum.dim_IntList)]
        require(len(summed) == 1, "scores are not a sum over heads times key scales")
        summed = summed[0]
        self.kscale = scores.args[1] if scores.args[0] is summed else scores.args[0]
        require(list(summed.args[1]) in ([2], [-1]) and not (len(summed.args) > 2 and summed.args[2]),
                f"sum over dims {list(summed.args[1])}, not the head dim")
        prod = summed.args[0]
        require(is_call(prod, aten.mul.Tensor), "summed term is not a weighted activation")
        weight_side = [x for x in prod.args if is_call(x, aten.unsqueeze.default)
                       and x.args[1] == 1 and len(shape(x.args[0])) == 2]
        require(len(weight_side) == 1, "head weights are not weights[:, None]")
        self.weights = weight_side[0].args[0]
        act = prod.args[1] if weight_side[0] is prod.args[0] else prod.args[0]
        require(is_call(act, aten.relu.default),
                f"activation {getattr(act, 'target', act)} is not relu")
        self.bmm = match_bmm(act.args[0], "logits")

    # -- the top-k transform: identity rows for lens <= K, then logical -> physical ---------
    def _match_tail(self):
        users = list(self.topk.users)
        require(len(users) == 1 and is_call(users[0], operator.getitem) and users[0].args[1] == 1,
                "top-k values are used")
        raw = users[0]
        if len(raw.users) == 1 and is_call(next(iter(raw.users)), _CONVERT):
            raw = next(iter(raw.users))
        pads = [u for u in raw.users if is_call(u, aten.constant_pad_nd.default)]
        require(not pads, f"topk {shape(pads[0])[-1] if pads else 0} > slots {self.slots} "
                          "(padded top-k)")
        picks = [u for u in raw.users if is_call(u, aten.where.self) and u.args[2] is raw]
        require(len(picks) == 1, "top-k indices are not merged with the short-row identity")
        sel = picks[0]
        short, identity = sel.args[:2]
        self._check_short_rows(short)
        require(is_call(identity, aten.where.self) and _is_full(identity.args[1], -1)
                and _iota(identity.args[2], self.k)
                and _same(_hidden(identity.args[0], self.k), self.lens),
                "short rows are not slots 0..lens-1 then -1")
        self.out = self._physical_of(sel)
        valid = self.out_valid
        require(is_call(valid, aten.where.self) and valid.args[0] is short,
                "the -1 mask is not chosen per short row")
        seq_valid, long_valid = valid.args[1:]
        require(is_call(seq_valid, aten.lt.Tensor) and _iota(seq_valid.args[0], self.k)
                and _same(seq_valid.args[1], self.lens),
                "short rows' -1 mask is not j >= lens")
        require(is_call(long_valid, aten.ne.Scalar) and long_valid.args[1] == float("-inf")
                and is_call(strip(long_valid.args[0], {aten.reshape.default, aten.view.default}),
                            aten.index.Tensor),
                "long rows' -1 mask is not selected score != -inf")
        gathered = strip(long_valid.args[0], {aten.reshape.default, aten.view.default})
        require(gathered.args[0] is self.scores, "long rows' -1 mask reads other scores")
        self.raw_out = self._logical_of(sel)

    @property
    def outs(self) -> list[Node]:
        """The results the rewrite replaces: the physical slots, and the logical ones if written."""
        return [self.out] + ([self.raw_out] if self.raw_out is not None else [])

    def _logical_of(self, sel: Node) -> Node | None:
        """SGLang's `out_raw_indices` (its indexer capture and HiSparse): the logical slots masked
        like the physical ones, where(~valid, -1, sel) with the same valid; None if not written."""
        raws = [u for u in sel.users if is_call(u, aten.where.self) and u.args[2] is sel
                and _is_full(u.args[1], -1)
                and is_call(u.args[0], aten.bitwise_not.default, aten.logical_not.default)
                and u.args[0].args[0] is self.out_valid]
        require(len(raws) <= 1, "the logical slots are masked and written more than once")
        return raws[0] if raws else None

    def _check_short_rows(self, short: Node):
        short = strip(short, _VIEWS)
        require(is_call(short, aten.le.Scalar) and short.args[1] == self.k
                and _same(short.args[0], self.lens), f"short rows are not lens <= {self.k}")

    def _physical_of(self, sel: Node) -> Node:
        """The final where(~valid, -1, (page_table[b, sel >> 6] << 6) | (sel & 63))."""
        shifts = [u for u in sel.users if is_call(u, aten.__rshift__.Scalar,
                                                    aten.bitwise_right_shift.Tensor_Scalar)]
        masks = [u for u in sel.users if is_call(u, aten.bitwise_and.Scalar)]
        require(len(shifts) == 1 and len(masks) == 1, "slots are not split into page and offset")
        bits, mask = shifts[0].args[1], masks[0].args[1]
        require(bits == _PAGE_BITS and mask == (1 << bits) - 1,
                f"translation page size {1 << bits} != {kernel.PAGE_SIZE}")
        gathers = [u for u in _users_through(shifts[0], {aten.clamp_min.default, _CONVERT})
                   if is_call(u, aten.gather.default)]
        require(len(gathers) == 1 and gathers[0].args[1] in (1, -1),
                "page numbers do not index the page table")
        self.page_table = gathers[0].args[0]
        page = list(gathers[0].users)
        require(len(page) == 1 and is_call(page[0], aten.__lshift__.Scalar,
                                           aten.bitwise_left_shift.Tensor_Scalar)
                and page[0].args[1] == bits, "physical pages are not shifted back by the page bits")
        page = page[0]
        combined = [u for u in page.users if is_call(u, aten.bitwise_or.Tensor, aten.add.Tensor)]
        require(len(combined) == 1 and masks[0] in combined[0].args,
                "physical page and offset are not combined")
        node = combined[0]
        if len(node.users) == 1 and is_call(next(iter(node.users)), _CONVERT):
            node = next(iter(node.users))
        outs = [u for u in node.users if is_call(u, aten.where.self) and u.args[2] is node
                and _is_full(u.args[1], -1)]
        require(len(outs) == 1, "physical slots are not masked with -1")
        out = outs[0]
        require(is_call(out.args[0], aten.bitwise_not.default, aten.logical_not.default),
                "physical slots are not masked where not valid")
        self.out_valid = out.args[0].args[0]
        return out

    # -- the keys: fp8 values and f32 scales of the same gathered pages ---------------------
    def _match_keys(self):
        keys, q_t = self.bmm.mat1, self.bmm.mat2
        values, self.value_dtype = _page_bytes(keys, (torch.float8_e4m3fn,), "keys")
        scales, _ = _page_bytes(self.kscale, (torch.float32,), "key scales")
        pages, v_start, v_end = _slice(values)
        pages_s, s_start, s_end = _slice(scales)
        require(pages is pages_s, "values and scales come from different page gathers")
        require(is_call(pages, aten.index.Tensor) and len(pages.args[1]) == 1,
                "pages are not cache[page_table]")
        self.cache = pages.args[0]
        require(_same(strip(pages.args[1][0], {aten.clamp_min.default}), self.page_table),
                "keys and the translation read different page tables")
        self.page_bytes = shape(pages)[-1]
        self.value_range, self.scale_range = (v_start, v_end), (s_start, s_end)
        require(is_call(q_t, aten.permute.default) and list(q_t.args[1]) == [0, 2, 1],
                "query is not transposed to [T, D, H]")
        q_row = strip(q_t.args[0], {_CONVERT})
        require(is_call(q_row, aten.select.int) and q_row.args[1:] == (1, 0),
                "query is not q[:, 0] of q [T, 1, H, D]")
        self.q = q_row.args[0]

    def _check_sizes(self):
        rows, one, heads, dim = (shape(self.q) + (None,) * 4)[:4]
        require(len(shape(self.q)) == 4 and equal(one, 1), "query is not [T, 1, H, D]")
        cache_shape = shape(self.cache)
        require(len(cache_shape) == 2 and val(self.cache).dtype in (torch.uint8, torch.int8),
                "the key cache is not [P, page bytes] of 8-bit ints")
        page = kernel.PAGE_SIZE
        require(not isinstance(dim, torch.SymInt), "symbolic head dim")
        require(dim == 128, f"head dim {dim} != 128 (SGLang's indexer layout)")
        n_pages = shape(self.page_table)[1]
        require(equal(self.slots, n_pages * page), "gathered width is not page-table columns x 64")
        require(equal(self.page_bytes, page * (dim + _SCALE_BYTES)),
                f"page of {self.page_bytes} B is not 64 slots x {dim + _SCALE_BYTES} B")
        require(self.value_range == (0, page * dim) and
                self.scale_range == (page * dim, page * (dim + _SCALE_BYTES)),
                "values and scales are not the page's first 64*D and last 64*4 bytes")
        require(all(equal(a, b) for a, b in ((rows, self.rows), (shape(self.weights)[0], rows),
                                             (shape(self.lens)[0], rows),
                                             (shape(self.page_table)[0], rows))),
                "query, weights, lens and page table disagree on the rows")
        require(equal(shape(self.weights)[1], heads), "weights are not [T, H]")
        require(all(equal(a, b) for a, b in zip(shape(self.bmm.out), (rows, self.slots, heads))),
                "logits are not [T, S, H]")
        require(not isinstance(heads, torch.SymInt) and kernel.MIN_HEADS <= heads <= kernel.MAX_HEADS,
                f"heads {heads} not in [{kernel.MIN_HEADS}, {kernel.MAX_HEADS}]")
        require(1 <= self.k <= kernel.MAX_TOPK, f"topk {self.k} > {kernel.MAX_TOPK}"
                if self.k > kernel.MAX_TOPK else f"topk {self.k} < 1")
        require(val(self.q).dtype in kernel._Q_DTYPES, f"q dtype {val(self.q).dtype} not supported")
        require(val(self.weights).dtype == torch.float32, "weights are not f32")


def _users_through(node: Node, allowed) -> list[Node]:
    """The users of `node`, looking through users that are ops in `allowed`."""
    out = []
    for user in node.users:
        out += _users_through(user, allowed) if is_call(user, *allowed) else [user]
    return out


def _physical(graph: Graph, logical: Node, page_table: Node) -> Node:
    """where(s >= 0, page_table[b, s >> 6] << 6 | s & 63, -1) of logical slots s [T, K] int32:
    kernels.indexer_physical.physical_slots as aten ops, which inductor fuses into the consumer."""
    valid = call(graph, aten.ge.Scalar, (logical, 0))
    slots = call(graph, aten.clamp_min.default, (logical, 0))
    pages = call(graph, aten.__rshift__.Scalar, (slots, _PAGE_BITS))
    pages = call(graph, _CONVERT, (pages, torch.int64))
    pages = call(graph, aten.gather.default, (page_table, 1, pages))
    pages = call(graph, aten.__lshift__.Scalar, (pages, _PAGE_BITS))
    offsets = call(graph, aten.bitwise_and.Scalar, (slots, kernel.PAGE_SIZE - 1))
    physical = call(graph, aten.bitwise_or.Tensor, (pages, offsets))
    return call(graph, aten.where.ScalarOther, (valid, physical, -1))


def _replace(graph: Graph, old: Node, new: Node) -> None:
    if val(old).dtype != val(new).dtype:
        with graph.inserting_before(old):
            new = call(graph, _CONVERT, (new, val(old).dtype))
    old.replace_all_uses_with(new)
    graph.erase_node(old)


def rewrite(graph: Graph, m: SglangMatch) -> None:
    """Replace the matched site's physical slots with dsv4::indexer_topk_physical on cache views;
    when the logical slots are written too, both come from one dsv4::indexer_topk call."""
    dim = shape(m.q)[3]
    page = kernel.PAGE_SIZE
    first = min(m.outs, key=list(graph.nodes).index)
    with graph.inserting_before(first):
        n_pages = shape(m.cache)[0]
        values = call(graph, aten.slice.Tensor, (m.cache, 1, 0, page * dim))
        values = call(graph, aten.view.dtype, (values, m.value_dtype))
        k_cache = call(graph, aten.view.default, (values, [n_pages, page, dim]))
        # Bytes -> f32 on the whole page rows, then the slice: a dtype view of a slice would
        # make inductor copy the scales into a contiguous buffer first.
        words = call(graph, aten.view.dtype, (m.cache, torch.float32))
        k_scale = call(graph, aten.slice.Tensor, (words, 1, page * dim // _SCALE_BYTES,
                                                  m.page_bytes // _SCALE_BYTES))
        weights = call(graph, aten.unsqueeze.default, (m.weights, 1))
        lens = call(graph, aten.clamp_min.default, (m.lens, 0))
        lens = call(graph, aten.clamp_max.default, (lens, m.slots))
        lens = call(graph, _CONVERT, (lens, torch.int32))
        lens = call(graph, aten.unsqueeze.default, (lens, 1))
        page_table = m.page_table
        if val(page_table).dtype != torch.int32:
            page_table = call(graph, _CONVERT, (page_table, torch.int32))
        args = (m.q, weights, k_cache, k_scale, page_table, lens, m.k)
        if m.raw_out is None:
            idx = call(graph, torch.ops.dsv4.indexer_topk_physical.default, args)
            physical = call(graph, aten.view.default, (idx, [m.rows, m.k]))
        else:
            logical = call(graph, torch.ops.dsv4.indexer_topk.default, args)
            logical = call(graph, aten.view.default, (logical, [m.rows, m.k]))
            physical = _physical(graph, logical, page_table)
    _replace(graph, m.out, physical)
    if m.raw_out is not None:
        _replace(graph, m.raw_out, logical)
