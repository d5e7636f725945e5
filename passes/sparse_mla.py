"""Rewrite sparse MQA attention with a sink over gathered KV rows to torch.ops.dsv4.sparse_mla.

Hand-written FX matching on inductor's post-grad graph, keyed on the math:

    out[b,t,h] = sum_k P[b,t,h,k] * V[b,t,k,:]                 (anchor: the PV bmm)
    P = softmax over (L[b,t,h,:], sink[h]) without the sink column
    L = where(mask[b,t,k], scale * q[b,t,h] . V[b,t,k], -inf)  (the QK bmm reads the same V)

V (== K) is either gathered rows `rows[idx.clamp(min=0)]` of one pool, or a cat of two such
gathers along K (window + compressed pool): then the op reads the pools directly. Any other V
(e.g. SGLang's page-layout FP8 gather + dequantisation) is kept as it is, and the op runs over
the materialised rows with identity indices. The mask must be one per (b, t, k), broadcast over
heads, and derive from the gather's indices; a mask that is not exactly `idx >= 0` is folded into
the indices (`where(mask, idx.clamp(min=0), -1)`: a valid row at idx < 0 reads row 0, as the
gather does), which is exact.

Two normalisation forms are recognised:
  A. cat([L, sink column], -1), (optional max subtractions), exp, / sum, drop the last column
     (dsv4_compile.model.hotspots.sparse_attention_with_sink);
  B. exp(L - logsumexp(stack([logsumexp(L, -1), sink]), 0)), with an optional +inf fix-up of
     rows that have nothing valid and a zero fix-up of the output there (SGLang 0.5.23's torch
     sparse-decode fallback).
Plain softmax without a sink is left alone (its all-masked rows are NaN, the op's are 0).

On CUDA, inductor's pad_mm may have padded either bmm (chosen by benchmark, per shape: the window
of a verify step, W + T - 1 rows, is off the bf16 alignment of 8): its operands are then
constant_pad_nd(x, zeros at the end of dims) and its output is sliced back. The match looks
through that padding: zero rows of the contracted dim add nothing, and the slices drop the rest.
At B*T = 1 on CUDA, inductor's bmm_to_mm has made each bmm an mm of the squeezed operands; that
form is read as the bmm it came from (fx_match.match_bmm).

Shapes alone cannot tell q @ k^T from q @ k when K == D, nor a softmax over keys from one over
heads when H == K, and so on: every layout-only chain the match looks through (from q and the
gathered rows to both products' operands, from the q.k product to the masked logits, from the mask,
sink and row reductions to where they broadcast, and on to the output) is traced with labelled dims
(_dims_after) and must put each of b, t, h, k, d where the op's math has it.
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass

import torch
from torch._inductor import inductor_prims
from torch.fx import Graph, Node

import dsv4_compile.kernels.sparse_mla  # noqa: F401  (registers torch.ops.dsv4.sparse_mla)
from dsv4_compile.passes import dim_labels
from dsv4_compile.passes.fx_match import Decline, equal, is_bmm, match_bmm

logger = logging.getLogger("dsv4_compile")

PASS_NAME = "sparse_mla"

aten = torch.ops.aten
prims = torch.ops.prims

_LAYOUT = dim_labels.LAYOUT_OPS
_LETTERS = "abcdefgh"
_PREPARE_SOFTMAX_ONLINE = inductor_prims.prepare_softmax_online


class _Decline(Decline):
    """The site is not the attention form; the message is the reason recorded in the report."""


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def _shape(node) -> tuple:
    val = _val(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def _strip(node, extra=frozenset()):
    """Follows layout-only ops (and full slices) back to the producing node."""
    while isinstance(node, Node) and (node.target in _LAYOUT or node.target in extra or dim_labels.is_full_slice(node)):
        node = node.args[0]
    return node


def _layout_source_of_shape(node, shape: tuple):
    """Walks layout-only ops back from `node` to the first tensor of `shape` (q is often a
    transposed view: [B, H, T, D] -> [B, T, H, D]); else to the producing node."""
    while isinstance(node, Node) and not dim_labels.same_shape(_shape(node), shape) and (
            node.target in _LAYOUT or dim_labels.is_full_slice(node)):
        node = node.args[0]
    return node


def _same_shape_source(node):
    """Follows layout-only ops back from `node` while their input has node's shape: V under its zero
    fill, which may be a reshape of lower-rank rows (SGLang's single-pool gather is [N, D] rows)."""
    shape = _shape(node)
    while isinstance(node, Node) and (node.target in _LAYOUT or dim_labels.is_full_slice(node)) and \
            dim_labels.same_shape(_shape(node.args[0]), shape):
        node = node.args[0]
    return node


def _unpadded(node):
    """x of constant_pad_nd(x, pad, 0) that appends zeros at the end of dims (inductor's pad_mm
    of a bmm operand); else node itself."""
    if not (isinstance(node, Node) and node.target == aten.constant_pad_nd.default):
        return node
    pad = list(node.args[1])
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    if value == 0 and all(p == 0 for p in pad[0::2]) and all(p >= 0 for p in pad[1::2]):
        return node.args[0]
    return node


def _bmm_operands(bmm: Node, what: str = "the product") -> tuple:
    """(mat1, mat2) of a bmm with any pad_mm padding removed, or of inductor's batch-1 mm form of a
    bmm (given as its mm or its unsqueeze); Decline naming `what` for anything else."""
    if bmm.target == aten.bmm.default:
        return _unpadded(bmm.args[0]), _unpadded(bmm.args[1])
    product = match_bmm(bmm, what)
    return product.mat1, product.mat2


def _is_unpad_slice(node: Node) -> bool:
    """A slice from 0 along dim 1 or 2 of a [N, m, n] tensor: how pad_mm cuts a padded bmm's output back."""
    if node.target != aten.slice.Tensor or len(_shape(node.args[0])) != 3:
        return False
    dim, start = (list(node.args[1:]) + [0, None])[:2]
    return dim % 3 in (1, 2) and start in (0, None)


def _unpadded_bmm(node):
    """The bmm under pad_mm's output slices, when each slice only drops rows or columns that the
    padding of the bmm's operands added (the sliced shape is the unpadded product's); else node."""
    bmm = node
    while isinstance(bmm, Node) and _is_unpad_slice(bmm):
        bmm = bmm.args[0]
    if bmm is node or not (isinstance(bmm, Node) and bmm.target == aten.bmm.default):
        return node
    mat1, mat2 = _bmm_operands(bmm)
    a, b = _shape(mat1), _shape(mat2)
    return bmm if len(a) == len(b) == 3 and dim_labels.same_shape(_shape(node), (a[0], a[1], b[2])) else node


def _is_full_of(node, value: float) -> bool:
    if not isinstance(node, Node) or node.target != aten.full.default:
        return False
    fill = node.args[1]
    return fill == value or (math.isnan(value) and math.isnan(fill))


def _reduces_last(node: Node) -> bool:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    rank = len(_shape(node.args[0]))
    return len(dims) == 1 and dims[0] % rank == rank - 1


def _ancestors(node: Node, limit: int = 4000) -> set[Node]:
    seen, todo = set(), [node]
    while todo and len(seen) < limit:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen


# ----------------------------------------------------------------------------- dim labels


def _dims_after(node, source: Node, dims: list[str], sizes: dict, through=frozenset(),
                regroup_to: tuple | None = None) -> list[str] | None:
    """`node`'s dims as labels of `source`'s, when node is source through layout-only ops (and ops in
    `through`, elementwise), then read row-major as `regroup_to` if given: dims names source's dims
    (e.g. ["bt", "h", "d"], outer label first), sizes each label's size. Labels of size 1 are left
    out; dim_labels.BROADCAST marks a broadcast. None when node is not such a view of source, or a
    reshape cuts a label apart; _Decline when symbolic sizes leave that undecided."""
    start = tuple(tuple((c, sizes[c]) for c in dim if not dim_labels.is_one(sizes[c])) for dim in dims)
    products = [math.prod(s for _, s in dim) for dim in start]
    if not dim_labels.same_shape(products, _shape(source)):
        return None
    try:
        got = dim_labels.dims_through(source, start, node, through, full_slices=True)
        if regroup_to is not None:
            got = dim_labels.regrouped(got, regroup_to)
    except dim_labels.Undecidable as why:
        raise _Decline(str(why)) from None
    except Decline:
        return None
    return ["".join(dim_labels.labels_of(dim)) for dim in got]


def _show(dims) -> str:
    return "[" + ", ".join(d or "1" for d in dims) + "]"


def _require_dims(node, source: Node, dims: list[str], want: list[str], sizes: dict, what: str,
                  broadcast: bool = False, **trace) -> None:
    """Decline unless `node` is `source` (dims labelled `dims`) laid out as `want` (labels of size 1
    left out); with `broadcast`, broadcasts are allowed anywhere. `trace`: _dims_after's options."""
    got = _dims_after(node, source, dims, sizes, **trace)
    if got is not None and broadcast:
        got = [d.replace(dim_labels.BROADCAST, "") for d in got]
    want = ["".join(c for c in dim if not dim_labels.is_one(sizes[c])) for dim in want]
    if got != want:
        found = "not a layout of it" if got is None else _show(got)
        raise _Decline(f"{what} has dims {found}, not {_show(want)}")


def _letters(node) -> tuple[list[str], dict]:
    """One label per dim of `node`, and their sizes."""
    shape = _shape(node)
    labels = list(_LETTERS[:len(shape)])
    return labels, dict(zip(labels, shape))


def _require_same_layout(node, source: Node, what: str) -> None:
    """Decline unless `node` is `source` through ops that keep every element where it is."""
    labels, sizes = _letters(source)
    _require_dims(node, source, labels, labels, sizes, what)


def _is_same_layout(node, source: Node) -> bool:
    """Whether `node` is `source` through ops that keep every element where it is."""
    labels, sizes = _letters(source)
    return _dims_after(node, source, labels, sizes) == _kept(labels, sizes)


def _kept(labels: list[str], sizes: dict) -> list[str]:
    """The labels with those of size 1 left out (as _dims_after gives them)."""
    return [c if not dim_labels.is_one(sizes[c]) else "" for c in labels]


def _require_row_broadcast(node, red: Node, x: Node, dims: list[int], keepdim_at_use: bool, what: str) -> None:
    """Decline unless `node` is the reduction `red` of `x` over `dims` (with or without keepdim)
    laid out as that reduction over x's other dims: with the reduced dims kept as 1 where the result
    broadcasts back against x (`keepdim_at_use`), else without them."""
    labels, sizes = _letters(x)
    if not labels:
        raise _Decline(f"{what} reduces no tensor")
    _require_dims(node, red, _reduced(labels, dims, len(_shape(red)) == len(labels)),
                  _reduced(labels, dims, keepdim_at_use), sizes, what)


def _reduced(labels: list[str], dims: list[int], keepdim: bool) -> list[str]:
    """The labels of a reduction over `dims` of a tensor labelled `labels`."""
    reduced = {d % len(labels) for d in dims}
    return [("" if i in reduced else c) for i, c in enumerate(labels) if keepdim or i not in reduced]


# ----------------------------------------------------------------------------- normalisation


def _online_softmax_input(num, den) -> Node | None:
    """x of inductor's online softmax, exp(x - m) / s with (m, s) = prepare_softmax_online(x, dim),
    which inductor's own post-grad passes make of exp / sum on CUDA; None if (num, den) is not that.
    Raises _Decline when the softmax is not over the key axis."""
    if not (isinstance(num, Node) and num.target == aten.exp.default and isinstance(den, Node)
            and den.target == operator.getitem and den.args[1] == 1):
        return None
    stats = den.args[0]
    if not (isinstance(stats, Node) and stats.target == _PREPARE_SOFTMAX_ONLINE):
        return None
    x, dim = stats.args[:2]
    diff = num.args[0]
    if not (isinstance(diff, Node) and diff.target == aten.sub.Tensor and diff.args[0] is x
            and isinstance(diff.args[1], Node) and diff.args[1].target == operator.getitem
            and diff.args[1].args == (stats, 0)):
        return None
    rank = len(_shape(x))
    if dim % rank != rank - 1:
        raise _Decline(f"softmax over dim {dim}, not the key axis")
    _require_row_broadcast(diff.args[1], diff.args[1], x, [dim], True, "the softmax's row maximum")
    _require_same_layout(x, _strip(x), "the softmax's input")
    return _strip(x)


def _require_sink_layout(node, sink: Node, what: str, regroup_to: tuple | None = None) -> None:
    """Decline unless `node` (read as `regroup_to` if given) is [B, T, H, ...] holding sink [H] along
    its head dim, broadcast over the rest."""
    rank = len(_shape(node) if regroup_to is None else regroup_to)
    if len(_shape(sink)) != 1 or rank < 3:
        raise _Decline(f"{what} from a sink of shape {_shape(sink)} is not [B, T, H, ...] of [H]")
    want = ["", "", "h"] + [""] * (rank - 3)
    _require_dims(node, sink, ["h"], want, {"h": _shape(sink)[0]}, what, broadcast=True, regroup_to=regroup_to)


def _softmax_with_sink_column(p: Node):
    """Form A: returns (L, sink) or raises _Decline."""
    if p.target != aten.slice.Tensor:
        raise _Decline("probabilities are not a slice of a normalised tensor")
    dim, start, end = (list(p.args[1:]) + [0, None, None])[:3]
    norm = _strip(p.args[0])  # a low-precision softmax is computed in f32 and cast back
    _require_same_layout(p.args[0], norm, "the normalised tensor")
    rank = len(_shape(norm))
    width = _shape(norm)[-1] if rank else 0
    if dim % rank != rank - 1 or start not in (0, None) or end not in (-1, width - 1):
        raise _Decline("the sliced-off column is not the last one of the key axis")
    if norm.target != aten.div.Tensor:
        raise _Decline(f"normalisation by {norm.target}, not exp / sum")
    num, den_use = norm.args
    den = _strip(den_use)
    online = _online_softmax_input(num, den)
    if online is not None:
        x = online
    else:
        if not (isinstance(num, Node) and num.target == aten.exp.default and isinstance(den, Node)
                and den.target == aten.sum.dim_IntList and den.args[0] is num):
            raise _Decline("not exp(x) / sum(exp(x))")
        if not _reduces_last(den):
            raise _Decline(f"softmax over dim {den.args[1]}, not the key axis")
        x = _strip(num.args[0])
        _require_same_layout(num.args[0], x, "the softmax's input")
    _require_row_broadcast(den_use, den, num, [-1], True, "the softmax's row sum")
    while isinstance(x, Node) and x.target == aten.sub.Tensor:  # subtract row maxima (stabilisers)
        y, red_use = x.args
        red = _strip(red_use)
        row_max = red
        if isinstance(red, Node) and red.target == operator.getitem:
            red = red.args[0]
        if not (isinstance(red, Node) and red.target in (aten.amax.default, aten.max.dim)
                and red.args[0] is y and _reduces_last(red)):
            raise _Decline("a subtraction in the softmax that is not a row maximum over the key axis")
        _require_row_broadcast(red_use, row_max, y, [-1], True, "a row maximum subtracted in the softmax")
        x = _strip(y)
        _require_same_layout(y, x, "the softmax's input")
    if x.target != aten.cat.default or len(x.args[0]) != 2:
        raise _Decline("no sink column concatenated to the logits")
    cat_dim = x.args[1] if len(x.args) > 1 else 0
    if cat_dim % rank != rank - 1:
        raise _Decline("the sink is not concatenated along the key axis")
    logits_use, sink_col = x.args[0]
    logits = _strip(logits_use)
    _require_same_layout(logits_use, logits, "the logits in the softmax")
    sink = _strip(sink_col)
    _require_sink_layout(sink_col, sink, "the sink column")
    return logits, sink


def _logsumexp(node) -> tuple[Node, list]:
    """Matches logsumexp(X, dims) (decomposed or not); returns (X, dims) or raises _Decline."""
    if isinstance(node, Node) and node.target == aten.logsumexp.default:
        return node.args[0], list(node.args[1])
    if not (isinstance(node, Node) and node.target == aten.add.Tensor):
        raise _Decline("not a logsumexp")
    log, shift = node.args
    if not (isinstance(log, Node) and log.target == aten.log.default):
        log, shift = shift, log
    if not (isinstance(log, Node) and log.target == aten.log.default):
        raise _Decline("not a logsumexp")
    total = log.args[0]
    if total.target != aten.sum.dim_IntList or total.args[0].target != aten.exp.default:
        raise _Decline("not a logsumexp")
    diff = total.args[0].args[0]
    if diff.target != aten.sub.Tensor:
        raise _Decline("not a logsumexp")
    x, shift_full = diff.args
    if _strip(shift) is not shift_full:
        raise _Decline("logsumexp shift mismatch")
    m = shift_full.args[2] if shift_full.target == aten.where.self else shift_full  # where(|amax| == inf, 0, amax)
    dims = list(total.args[1])
    rank = len(_shape(x))
    if m.target != aten.amax.default or m.args[0] is not x:
        raise _Decline("logsumexp without its row maximum")
    if {d % rank for d in m.args[1]} != {d % rank for d in dims} or len(_shape(m)) != rank:
        raise _Decline("the logsumexp's row maximum is not over its summed dims, kept as 1")
    _require_row_broadcast(shift, shift_full, x, dims, False, "the logsumexp's shift")
    return x, dims


def _require_stack_of_two(stacked: Node, cat: Node) -> None:
    """Decline unless `stacked` is stack([a, b]) as torch decomposes it: cat([a, b], 0) of two equal
    shapes, reshaped (row-major) to [2, ...]."""
    a, b = cat.args[0]
    cat_dim = cat.args[1] if len(cat.args) > 1 else 0
    rank = len(_shape(cat))
    if cat_dim % max(rank, 1) != 0 or not dim_labels.same_shape(_shape(a), _shape(b)) or len(_shape(a)) != rank:
        raise _Decline("the normaliser's (lse, sink) are not stacked along a new leading dim")
    labels, sizes = _letters(a)
    sizes["s"] = 2
    part = "".join(_kept(labels, sizes))
    got = _dims_after(stacked, cat, ["s" + labels[0], *labels[1:]], sizes)
    if got is None or got[0] != "s" or "".join(got[1:]) != part:
        raise _Decline("the normaliser's (lse, sink) are not stacked along a new leading dim")


def _exp_minus_logsumexp_with_sink(p: Node):
    """Form B: returns (L, sink, lse of L or None) or raises _Decline."""
    if p.target != aten.exp.default or p.args[0].target != aten.sub.Tensor:
        raise _Decline("probabilities are neither a sliced softmax nor exp(x - lse)")
    logits, z_use = p.args[0].args
    z = _strip(z_use)
    _require_row_broadcast(z_use, z, logits, [-1], True, "the normaliser")
    lse_all = z
    if z.target == aten.index_put.default:  # rows with nothing valid get +inf: their weights are 0
        if not _is_full_of(z.args[2], float("inf")):
            raise _Decline("a fix-up of the normaliser that is not +inf")
        lse_all = z.args[0]
    stacked, dims = _logsumexp(lse_all)
    rows = _strip(stacked)
    if rows.target != aten.cat.default or len(rows.args[0]) != 2 or dims not in ([0], [-len(_shape(stacked))]):
        raise _Decline("the normaliser is not a logsumexp over (lse, sink)")
    _require_stack_of_two(stacked, rows)
    lse_use, sink_use = rows.args[0]
    lse_l = _strip(lse_use)
    x, ldims = _logsumexp(lse_l)
    if x is not logits:
        raise _Decline("the inner logsumexp is over other logits")
    if len(ldims) != 1 or ldims[0] % len(_shape(x)) != len(_shape(x)) - 1:
        raise _Decline(f"logsumexp over dims {ldims}, not the key axis")
    labels, sizes = _letters(x)
    rows_of = dict(regroup_to=_shape(stacked)[1:])
    _require_dims(lse_use, lse_l, _reduced(labels, ldims, len(_shape(lse_l)) == len(labels)), labels[:-1],
                  sizes, "the lse in the normaliser", **rows_of)
    sink = _strip(sink_use)
    _require_sink_layout(sink_use, sink, "the sink in the normaliser", **rows_of)
    if z is not lse_all and not (len(z.args[1]) == 1 and _is_lonely_rows(z.args[1][0], lse_l)):
        raise _Decline("the +inf fix-up of the normaliser is not on the rows with nothing valid")
    return logits, sink, lse_l


# ----------------------------------------------------------------------------- match


@dataclass
class _Match:
    form: str
    q: Node
    pools: list  # [(rows, idx)] for direct gathers, or [(materialised V, None)]
    mask: Node  # bool [B, T, K] over all pools
    mask_is_valid: bool  # True: the mask marks rows that count; False: rows to skip
    mask_is_index_mask: bool  # the mask is exactly idx >= 0 of the pools: pass the indices as they are
    sink: Node
    scale: float
    out: Node


def _mask(cond: Node, minus_inf_when_true: bool, shape: tuple) -> tuple[Node, bool]:
    """(mask node of `shape` or broadcastable to it, True if the mask marks valid rows)."""
    valid = not minus_inf_when_true
    node = cond
    while isinstance(node, Node):
        if node.target == aten.bitwise_not.default:
            valid = not valid
        elif node.target not in _LAYOUT or len(_shape(node)) == len(shape):
            break
        node = node.args[0]
    return node, valid


def _negations_to(node, source: Node) -> int | None:
    """How many bitwise_nots lie between `node` and `source` when node is source through layout-only
    ops and bitwise_not; None when it is not."""
    flips = 0
    while node is not source:
        if not (isinstance(node, Node) and (node.target in _LAYOUT or node.target == aten.bitwise_not.default
                                            or dim_labels.is_full_slice(node))):
            return None
        flips += node.target == aten.bitwise_not.default
        node = node.args[0]
    return flips


def _require_zeroes_skipped_rows(fill: Node, mask: Node, mask_is_valid: bool) -> None:
    """Decline unless the zero fill of the gathered rows writes exactly the rows the attention skips
    (the op never reads those; zeroing any other row changes the result)."""
    flips = _negations_to(fill.args[1][0], mask) if len(fill.args[1]) == 1 else None
    if flips is None:
        raise _Decline("rows are zeroed by a mask other than the attention mask")
    if (flips % 2 == 0) == mask_is_valid:  # the fill's index is true on the rows it zeroes
        raise _Decline("the zero fill writes the rows the attention reads")
    labels, sizes = _letters(mask)
    if _dims_after(fill.args[1][0], mask, labels, sizes, through={aten.bitwise_not.default}) != _kept(labels, sizes):
        raise _Decline("the rows' zero fill reads the attention mask in another layout")


def _gathers(v: Node):
    """[(rows, idx)] when V is rows[idx.clamp(min=0)] or a cat of two along K (each as it is), else None."""
    parts = v.args[0] if v.target == aten.cat.default and v.args[1] in (2, -2) else [v]
    pools = []
    for part_use in parts:
        part = _strip(part_use)
        if not (isinstance(part, Node) and part.target == aten.index.Tensor and len(part.args[1]) == 1
                and _is_same_layout(part_use, part)):
            return None
        rows, index = part.args[0], _strip(part.args[1][0])
        if not _is_same_layout(part.args[1][0], index):
            return None
        if not (isinstance(index, Node) and index.target in (aten.clamp_min.default, aten.clamp.default)
                and index.args[1] == 0 and (list(index.args) + [None])[2] is None
                and _is_same_layout(index.args[0], _strip(index.args[0]))):
            return None  # rows[idx] unclamped reads row N - 1 at idx = -1
        index = _strip(index.args[0])
        if len(_shape(rows)) != 2 or len(_shape(index)) != 3 or _val(index).dtype not in (torch.int32, torch.int64):
            return None
        pools.append((rows, index))
    return pools if len(pools) in (1, 2) else None


def _require_rows_layout(operand, rows: Node, fill: Node | None, want: list[str], sizes: dict, what: str) -> None:
    """Decline unless the product operand is the gathered rows [B, T, K, D] (through their zero
    fill, if that is what the operand reads) laid out as `want`."""
    source = rows
    if fill is not None and _strip(operand) is fill:
        _require_same_layout(fill.args[0], rows, "the zero-filled rows")
        source = fill
    _require_dims(operand, source, list("btkd"), want, sizes, what)


def _match(pv: Node) -> _Match:
    p_side, pv_rows = _bmm_operands(pv)
    p = _strip(p_side)
    v_side = _strip(pv_rows)
    zeroed_values = None  # V's own zero fill, which K may share (then it is the same node)
    if isinstance(v_side, Node) and v_side.target == aten.index_put.default and _is_full_of(v_side.args[2], 0.0):
        zeroed_values = v_side
        v_side = _same_shape_source(v_side.args[0])
    if len(_shape(v_side)) != 4:
        raise _Decline(f"values of rank {len(_shape(v_side))}, not [B, T, K, D]")
    lse_l = None
    if p.target == aten.div.Tensor:
        raise _Decline("a softmax without a sink column")
    if p.target == aten.slice.Tensor:
        logits, sink = _softmax_with_sink_column(p)
        form = "sink-column softmax"
    else:
        logits, sink, lse_l = _exp_minus_logsumexp_with_sink(p)
        form = "exp minus logsumexp with sink"
    batch, tokens, keys, dim = _shape(v_side)
    if len(_shape(logits)) != 4 or not dim_labels.same_shape(_shape(logits)[:2] + _shape(logits)[3:],
                                                             (batch, tokens, keys)):
        raise _Decline(f"logits {_shape(logits)} do not match values {_shape(v_side)}")
    heads = _shape(logits)[2]
    if not dim_labels.same_shape(_shape(sink), (heads,)):
        raise _Decline(f"sink of shape {_shape(sink)}, not [H={heads}]")

    if logits.target != aten.where.self:
        raise _Decline("logits are not masked with where(mask, -inf, ...)")
    cond, a, b = logits.args
    if _is_full_of(a, float("-inf")):
        scaled, minus_inf_when_true = b, True
    elif _is_full_of(b, float("-inf")):
        scaled, minus_inf_when_true = a, False
    else:
        raise _Decline("the mask does not fill with -inf")
    mask, mask_is_valid = _mask(cond, minus_inf_when_true, (batch, tokens, keys))
    if _val(mask).dtype != torch.bool:
        raise _Decline(f"the mask is {_val(mask).dtype}, not bool")
    if len(_shape(mask)) != 3 or any(not (dim_labels.is_one(m) or equal(m, s))
                                     for m, s in zip(_shape(mask), (batch, tokens, keys))):
        raise _Decline(f"mask of shape {_shape(mask)} is not one per (b, t, k) broadcast over heads")
    if not isinstance(scaled, Node) or scaled.target != aten.mul.Tensor:
        raise _Decline("no softmax scale multiplies the logits")
    scores, scale = scaled.args
    if not isinstance(scale, (int, float)):
        scores, scale = scale, scores
    if not isinstance(scale, (int, float)):
        raise _Decline("the softmax scale is not a constant")
    qk = _unpadded_bmm(_strip(scores))  # pad_mm's slices leave the product's dims as they are
    if not isinstance(qk, Node):
        raise _Decline("the logits are not a q.k product")
    q_side, qk_rows = _bmm_operands(qk, "the logits")
    q = _layout_source_of_shape(q_side, (batch, tokens, heads, dim))
    k_side = _strip(qk_rows)
    if isinstance(k_side, Node) and k_side.target == aten.index_put.default:
        if k_side is not zeroed_values:
            raise _Decline("the keys are written (index_put) apart from the values' zero fill")
        k_side = _same_shape_source(k_side.args[0])
    if k_side is not v_side:
        raise _Decline("keys and values are different tensors (the op needs K == V)")
    if not dim_labels.same_shape(_shape(q), (batch, tokens, heads, dim)):
        raise _Decline(f"q of shape {_shape(q)} does not match [B, T, H, D] = {(batch, tokens, heads, dim)}")
    if zeroed_values is not None:
        _require_zeroes_skipped_rows(zeroed_values, mask, mask_is_valid)
    sizes = dict(b=batch, t=tokens, h=heads, k=keys, d=dim)
    _require_dims(q_side, q, list("bthd"), ["bt", "h", "d"], sizes, "q in the q.k product")
    _require_rows_layout(qk_rows, v_side, zeroed_values, ["bt", "d", "k"], sizes,
                         "the keys in the q.k product (K transposed)")
    qk_out = _strip(scores)
    _require_dims(scores, qk_out, ["bt", "h", "k"][3 - len(_shape(qk_out)):], list("bthk"), sizes,
                  "the q.k product read as logits")
    _require_dims(cond, mask, list("btk"), ["b", "t", "", "k"], dict(sizes, **dict(zip("btk", _shape(mask)))),
                  "the mask applied to the logits", broadcast=True, through={aten.bitwise_not.default})
    _require_dims(p_side, p, list("bthk"), ["bt", "h", "k"], sizes, "the probabilities in the PV product")
    _require_rows_layout(pv_rows, v_side, zeroed_values, ["bt", "k", "d"], sizes, "the values in the PV product")

    pools = _gathers(v_side)
    index_inputs = {idx for _, idx in pools} if pools else {n for n in _ancestors(v_side)
                                                           if _val(n) is not None and not _val(n).is_floating_point()
                                                           and n.op == "placeholder"}
    if not index_inputs & _ancestors(mask):
        raise _Decline("the mask does not derive from the gather's indices")
    exact = False
    if pools and mask_is_valid:
        expected = [n for _, n in pools]
        parts = mask.args[0] if mask.target == aten.cat.default and len(pools) == 2 else [mask]
        exact = len(parts) == len(expected) and all(
            part.target == aten.ge.Scalar and part.args[1] == 0 and _is_same_layout(part.args[0], idx)
            for part, idx in zip(parts, expected))
    if pools is None:
        pools = [(v_side, None)]
    out = _output_node(pv, sizes, lse_l)
    return _Match(form, q, pools, mask, mask_is_valid, exact, sink, float(scale), out)


def _output_node(pv: Node, sizes: dict, lse_l: Node | None) -> Node:
    """The first node after the PV bmm (through layout ops, and pad_mm's slices when its operands
    are padded) holding out [B,T,H,D] as the op does."""
    shape = tuple(sizes[c] for c in "bthd")
    node = product = pv
    padded = pv.target == aten.bmm.default and _bmm_operands(pv) != tuple(pv.args[:2])
    while not dim_labels.same_shape(_shape(node), shape):
        users = list(node.users)
        if len(users) != 1 or not (users[0].target in _LAYOUT or (padded and _is_unpad_slice(users[0]))):
            raise _Decline("the attention output is not reshaped back to [B, T, H, D]")
        node = users[0]
        if padded and _is_unpad_slice(node):
            product = node  # pad_mm's slices leave the product's dims as they are
    _require_dims(node, product, ["bt", "h", "d"][3 - len(_shape(product)):], list("bthd"), sizes,
                  "the attention output")
    users = list(node.users)
    if lse_l is not None and len(users) == 1 and users[0].target == aten.index_put.default:
        fix = users[0]  # zero rows with nothing valid: the op already gives 0 there (else the fix stays)
        if _is_full_of(fix.args[2], 0.0) and len(fix.args[1]) == 1 and _is_lonely_rows(fix.args[1][0], lse_l):
            node = fix
    return node


def _is_lonely_rows(rows_use, lse: Node) -> bool:
    """Whether `rows_use` is lse == -inf (lse [B, T, H]: the rows with nothing valid), broadcast over
    any trailing dims."""
    lonely = _strip(rows_use)
    if not (isinstance(lonely, Node) and lonely.target == aten.eq.Scalar and lonely.args[1] == float("-inf")
            and _is_same_layout(lonely.args[0], lse)):
        return False
    labels, sizes = _letters(lonely)
    got = _dims_after(rows_use, lonely, labels, sizes)
    want = _kept(labels, sizes) + [""] * (len(_shape(rows_use)) - len(labels))
    return got is not None and [d.replace(dim_labels.BROADCAST, "") for d in got] == want


# ----------------------------------------------------------------------------- rewrite


def _emit(graph: Graph, fake_mode, target, *args, **kwargs) -> Node:
    node = graph.call_function(target, args, kwargs)
    fake_args = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    with fake_mode:
        node.meta["val"] = target(*fake_args[0], **fake_args[1])
    return node


def _rewrite(graph: Graph, m: _Match) -> None:
    q_val = _val(m.q)
    fake_mode = torch._guards.detect_fake_mode([q_val])
    batch, tokens, _, dim = q_val.shape
    with graph.inserting_before(m.out):
        rows_dtype = _val(m.pools[0][0]).dtype
        compute = rows_dtype if rows_dtype in (torch.float32, torch.bfloat16) else torch.float32
        q = m.q if q_val.dtype == compute else _emit(graph, fake_mode, prims.convert_element_type.default, m.q, compute)
        sink = m.sink if _val(m.sink).dtype == torch.float32 else _emit(
            graph, fake_mode, prims.convert_element_type.default, m.sink, torch.float32)
        skip = m.mask
        if not m.mask_is_index_mask and m.mask_is_valid:
            skip = _emit(graph, fake_mode, aten.bitwise_not.default, m.mask)
        pools = []
        offset = 0
        for rows, idx in m.pools:
            gathered = idx is not None
            if not gathered:  # materialised V: identity indices over its [B*T*K, D] rows
                keys = _val(rows).shape[2]
                rows = _emit(graph, fake_mode, aten.reshape.default, rows, [batch * tokens * keys, dim])
                idx = _emit(graph, fake_mode, prims.iota.default, batch * tokens * keys, start=0, step=1,
                            dtype=torch.int32, device=q_val.device, requires_grad=False)
                idx = _emit(graph, fake_mode, aten.reshape.default, idx, [batch, tokens, keys])
            keys = _val(idx).shape[2]
            if _val(rows).dtype != compute:
                rows = _emit(graph, fake_mode, prims.convert_element_type.default, rows, compute)
            if _val(idx).dtype != torch.int32:
                idx = _emit(graph, fake_mode, prims.convert_element_type.default, idx, torch.int32)
            if not m.mask_is_index_mask:  # fold the mask into the indices: exact
                part = _emit(graph, fake_mode, aten.slice.Tensor, skip, 2, offset, offset + keys)
                minus_one = _emit(graph, fake_mode, aten.full.default, [], -1, dtype=torch.int32,
                                  device=q_val.device)
                if gathered:
                    idx = _emit(graph, fake_mode, aten.clamp_min.default, idx, 0)
                idx = _emit(graph, fake_mode, aten.where.self, part, minus_one, idx)
            offset += keys
            pools.append((rows, idx))
        extra_rows, extra_idx = pools[1] if len(pools) == 2 else (None, None)
        out = _emit(graph, fake_mode, torch.ops.dsv4.sparse_mla.default, q, pools[0][0], None, pools[0][1],
                    extra_rows, None, extra_idx, sink, m.scale)
        if _val(m.out).dtype != compute:
            out = _emit(graph, fake_mode, prims.convert_element_type.default, out, _val(m.out).dtype)
    m.out.replace_all_uses_with(out)


def _candidates(graph: Graph) -> list[Node]:
    """bmm nodes (or inductor's batch-1 mm form of one, as its mm) whose left side is an exp-based
    probability tensor: attention PV products."""
    out = []
    for node in graph.nodes:
        if node.target != aten.bmm.default and not (node.target == aten.mm.default and is_bmm(node)):
            continue
        p = _strip(_bmm_operands(node)[0])
        if isinstance(p, Node) and p.target == aten.slice.Tensor:
            p = _strip(p.args[0])
        if isinstance(p, Node) and (p.target == aten.exp.default
                                    or (p.target == aten.div.Tensor and isinstance(p.args[0], Node)
                                        and p.args[0].target == aten.exp.default)
                                    or p.target in (aten._softmax.default, aten.amax.default)):
            out.append(node)
    return out


def apply(graph: Graph, report) -> int:
    """Rewrites every matched attention site to dsv4::sparse_mla; records each candidate site."""
    rewrites = 0
    for pv in _candidates(graph):
        try:
            match = _match(pv)
        except Decline as why:
            report.record(PASS_NAME, pv, False, str(why))
            logger.debug("sparse_mla: declined %s: %s", pv.name, why)
            continue
        _rewrite(graph, match)
        report.record(PASS_NAME, pv, True, match.form)
        rewrites += 1
    if rewrites:
        graph.eliminate_dead_code()
    return rewrites
