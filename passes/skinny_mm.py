"""dsv4 pass: f32 matrix products with a few output columns and a long reduction become a sum.

The mHC mixing projections of every layer (`F.linear(rmsnorm(streams), fn)`: [tokens, 4 * hidden] @
[4 * hidden, 24] in f32, and the hyper head's [tokens, 4 * hidden] @ [4 * hidden, 4]) reach cuBLAS
as one f32 GEMM tile that walks the whole reduction alone: 256 µs a step at batch 1 on the H200
(9 calls in the 4-layer slice). As `sum(a[:, :, None] * b[None], dim=1)` inductor compiles them
to a split reduction spread over the GPU: below the profile's top 12 (< 29 µs a step) at batch 1,
72 µs at 64 rows with the RMS norm fused in. At 256 rows (B=64, T=4) that reduction took 254 µs
against cuBLAS's 145 µs, hence MAX_ROWS. passes/rms_mm.py, which runs first, takes those products
of 8 to 64 RMS-normed rows (each row re-reads the weight in this form); fewer rows stay here.

Matches `aten.mm(a [M, K], b [K, N])` with both operands f32 and static sizes N <= MAX_COLUMNS,
M <= MAX_ROWS and K >= MIN_REDUCTION * N. f32 products with such N and K but more rows or symbolic
sizes are declined with the reason in the report; every other mm is left alone without a record.
"""
from __future__ import annotations

import logging

import torch
from torch.fx import Graph, Node

from .fx_match import accepted_mms, aten, replace_with_mul_sum, require_few_rows, val

PASS_NAME = "skinny_mm"
MAX_COLUMNS = 32
MAX_ROWS = 64
MIN_REDUCTION = 64

log = logging.getLogger("dsv4_compile")


def _static(sizes: tuple) -> bool:
    return all(isinstance(s, int) for s in sizes)


def _check(mm: Node) -> None:
    require_few_rows(mm, MAX_ROWS)


def is_skinny_f32_mm(node: Node) -> bool:
    """Whether `node` is an aten.mm of f32 operands with static K, N <= MAX_COLUMNS and K >= MIN_REDUCTION * N."""
    if node.op != "call_function" or node.target != aten.mm.default:
        return False
    a, b = (val(x) for x in node.args)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype == torch.float32):
        return False
    depth, columns = b.shape
    return _static((depth, columns)) and columns <= MAX_COLUMNS and depth >= MIN_REDUCTION * columns


def apply(graph: Graph, report) -> int:
    """Rewrites each matched f32 mm to mul + sum over the reduction dim; records the candidates."""
    rewrites = 0
    for mm in accepted_mms(graph, report, PASS_NAME, is_skinny_f32_mm, _check):
        replace_with_mul_sum(graph, mm)
        rewrites += 1
    log.debug("skinny_mm: %d rewrite(s)", rewrites)
    return rewrites
