"""dsv4 pass: f32 matrix products with a few output columns and a long reduction become split-K
partial products (`dsv4::skinny_mm_partials`) summed in the graph.

The mHC mixing projections of every layer (`F.linear(rmsnorm(streams), fn)`: [tokens, 4 * hidden] @
[4 * hidden, 24] in f32, and the hyper head's [tokens, 4 * hidden] @ [4 * hidden, 4]) reach cuBLAS
as one f32 GEMM tile that walks the whole reduction alone: 256 µs a step at batch 1 on the H200 (9
calls in the 4-layer slice). Inductor's own reduction form of the product re-reads the activations
once per output column (73 µs a step at 64 rows). The op reads each operand once per row block; the
sum over its splits is left in the graph, where inductor fuses it with the consumers.

Where the left operand is `x * r` with one factor per row (the RMS norm's rsqrt) the pass moves that
factor after the product (`r * (x @ b)`), and where x is an upcast of bf16 / f16 it gives the op the
narrow source: the op reads 2 bytes an element and the normalised f32 copy is never written.

Matches `aten.mm(a [M, K], b [K, N])` with both operands f32 and static sizes N <= MAX_COLUMNS,
M <= MAX_ROWS and K >= MIN_REDUCTION * N. f32 products with such N and K but more rows or symbolic
sizes are declined with the reason in the report; every other mm is left alone without a record.
"""
from __future__ import annotations

import logging
import math

import torch
from torch.fx import Graph, Node

from dsv4_compile.kernels.skinny_mm import choose_splits

from .fx_match import RESHAPES, Decline, aten, call, is_call, prims, require, shape, strip, val

PASS_NAME = "skinny_mm"
MAX_COLUMNS = 32
# The compiled steps have at most max_batch x (verify tokens + 1) rows; 1024 covers B = 64 with up
# to 15 draft tokens. Larger products (prefill-sized) have enough row tiles for cuBLAS.
MAX_ROWS = 1024
MIN_REDUCTION = 64

log = logging.getLogger("dsv4_compile")


def _static(sizes: tuple) -> bool:
    return all(isinstance(s, int) for s in sizes)


def _check(mm: Node) -> None:
    a, b = mm.args
    rows, _ = shape(a)
    require(isinstance(rows, int), "sizes are symbolic")
    require(rows <= MAX_ROWS, f"{rows} rows > {MAX_ROWS}: enough output tiles for a GEMM")


def _is_candidate(node: Node) -> bool:
    if node.op != "call_function" or node.target != aten.mm.default:
        return False
    a, b = (val(x) for x in node.args)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype == torch.float32):
        return False
    depth, columns = b.shape
    return _static((depth, columns)) and columns <= MAX_COLUMNS and depth >= MIN_REDUCTION * columns


def _row_scaled(a: Node, rows: int, depth: int) -> tuple[Node, Node] | None:
    """(x, r) when `a` is a reshape of `x * r` to [rows, depth] in which r holds one value per
    row (x [..., depth], r [..., 1] with the same leading sizes); else None."""
    product = strip(a, RESHAPES)
    if not is_call(product, aten.mul.Tensor):
        return None
    out = shape(product)
    if not (_static(out) and out[-1] == depth and math.prod(out[:-1]) == rows):
        return None
    for x, r in (product.args, product.args[::-1]):
        x_val, r_val = val(x), val(r)
        if (isinstance(x_val, torch.Tensor) and isinstance(r_val, torch.Tensor) and tuple(x_val.shape) == out
                and tuple(r_val.shape) == out[:-1] + (1,) and r_val.dtype == torch.float32):
            return x, r
    return None


def _narrow_source(x: Node) -> Node:
    """The bf16 / f16 tensor that `x` upcasts to f32, else x itself."""
    if is_call(x, prims.convert_element_type.default):
        source = val(x.args[0])
        if isinstance(source, torch.Tensor) and source.dtype in (torch.bfloat16, torch.float16):
            return x.args[0]
    return x


def _rewrite(graph: Graph, mm: Node, scaled: tuple[Node, Node] | None) -> None:
    """Replaces mm by the summed partial products, times the row factor of `scaled` = (x, r)."""
    a, b = mm.args
    rows, depth = shape(a)
    with graph.inserting_before(mm):
        left, factor = a, None
        if scaled is not None:
            x, r = scaled
            left = call(graph, aten.reshape.default, (_narrow_source(x), [rows, depth]))
            factor = call(graph, aten.reshape.default, (r, [rows, 1]))
        partials = call(graph, torch.ops.dsv4.skinny_mm_partials.default, (left, b, choose_splits(rows, depth)))
        product = call(graph, aten.sum.dim_IntList, (partials, [0]))
        if factor is not None:
            product = call(graph, aten.mul.Tensor, (product, factor))
    mm.replace_all_uses_with(product)
    graph.erase_node(mm)


def apply(graph: Graph, report) -> int:
    """Rewrites each matched f32 mm to the op's summed partials; records the candidates."""
    rewrites = 0
    for mm in [n for n in graph.nodes if _is_candidate(n)]:
        try:
            _check(mm)
        except Decline as why:
            report.record(PASS_NAME, mm, False, str(why))
            continue
        a, b = mm.args
        (rows, depth), (_, columns) = shape(a), shape(b)
        scaled = _row_scaled(a, rows, depth)
        report.record(PASS_NAME, mm, True, f"[{rows}, {depth}] @ [{depth}, {columns}]"
                      + (", row factor moved after the product" if scaled else ""))
        _rewrite(graph, mm, scaled)
        rewrites += 1
    log.debug("skinny_mm: %d rewrite(s)", rewrites)
    return rewrites
