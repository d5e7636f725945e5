"""dsv4 pass: a product of a few rows with a very large row-major weight becomes dsv4::weight_stream_mm.

The LM head at decode (`F.linear(hidden, lm_head.weight)`: [B*T, 4096] @ [4096, 129280] in bf16)
reaches cuBLAS, which streamed its 1 GB weight at 0.78 of 4.8 TB/s at 64 rows on the H200 against
0.86 for dsv4::weight_stream_mm (bench/RESULTS.md, sixteenth session: 288 -> 258 us). On a 64 MB
weight (q_b_proj, 1024 x 32768) the two were even, so only weights of MIN_WEIGHT_BYTES and up with
at least MIN_COLUMNS output columns (enough 128-column programs to fill the GPU) are rewritten.

Matches `aten.mm(a [M, K], b [K, N])` with a and b bf16 or f16 and static K, N past those sizes, where
the kernel runs (CUDA, or the Triton interpreter in CPU tests: elsewhere the op would be its torch
reference, an f32 copy of the weight per call).
Such a product is declined, with the reason in the report, when M is symbolic or above MAX_ROWS, or
when b is not the transpose of a row-major [N, K] weight (strides (1, K)); every other mm is left
alone without a record.
"""
from __future__ import annotations

import logging

import torch
from torch.fx import Graph, Node

from dsv4_compile.kernels._runtime import triton_runs_on
from dsv4_compile.kernels.weight_stream_mm import DTYPES, MAX_ROWS

from .fx_match import accepted_mms, aten, call, require, require_few_rows, shape, val

PASS_NAME = "weight_stream_mm"
MIN_WEIGHT_BYTES = 256 << 20
MIN_COLUMNS = 16384

log = logging.getLogger("dsv4_compile")


def _is_candidate(node: Node) -> bool:
    if node.op != "call_function" or node.target != aten.mm.default:
        return False
    a, b = (val(x) for x in node.args)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.dtype in DTYPES and triton_runs_on(a)):
        return False
    depth, columns = b.shape
    if not (isinstance(depth, int) and isinstance(columns, int)):
        return False
    return columns >= MIN_COLUMNS and depth * columns * b.element_size() >= MIN_WEIGHT_BYTES


def _check(mm: Node) -> None:
    require_few_rows(mm, MAX_ROWS)
    b = mm.args[1]
    depth, _ = shape(b)
    require(tuple(val(b).stride()) == (1, depth),
            f"the weight operand has strides {tuple(val(b).stride())}, not the transpose of a row-major [N, K] weight")


def apply(graph: Graph, report) -> int:
    """Rewrites each matched mm to dsv4::weight_stream_mm(a, b^T); records the candidates."""
    rewrites = 0
    for mm in accepted_mms(graph, report, PASS_NAME, _is_candidate, _check):
        a, b = mm.args
        with graph.inserting_before(mm):
            weight = call(graph, aten.permute.default, (b, [1, 0]))
            product = call(graph, torch.ops.dsv4.weight_stream_mm.default, (a, weight))
        mm.replace_all_uses_with(product)
        graph.erase_node(mm)
        rewrites += 1
    log.debug("weight_stream_mm: %d rewrite(s)", rewrites)
    return rewrites
