"""dsv4 pass: matrix products with a reduction of at most 8 become a broadcast multiply and a sum.

Every mHC layer mixes its residual streams with `torch.matmul(comb^T, streams)`: per token a
[4, 4] @ [4, hidden] product (two per layer). It reaches cuBLAS as a batched GEMM of B*T tiny
problems whose transposed [4, 4] operand has a 4-element leading dimension, and cuBLAS runs it as
an sm80 wmma kernel for 2-element-aligned operands: 127 µs a step at B=64, T=1 and 441 µs at T=4
in the 4-layer slice on the H200 (bench/RESULTS.md), for 2-8 MB read per call. As
`sum(a[..., :, :, None] * b[..., None, :, :], dim=-2)` inductor makes it one pointwise-sized kernel
that reads the streams once and fuses with the residual add that follows.

Matches `aten.bmm(a [G, M, K], b [G, K, N])` and `aten.mm(a [M, K], b [K, N])` (inductor's
batch-1 `bmm_to_mm` form) with floating operands and a static K <= MAX_REDUCTION; every other
product (a symbolic K included: the decode graphs' reductions are weight or head sizes) is left
alone. The sum accumulates in f32 for bf16/f16 operands (inductor's reduction dtype), as the GEMM
does, and rounds once to the output dtype.
"""
from __future__ import annotations

import logging

import torch
from torch.fx import Graph, Node

from .fx_match import aten, replace_with_mul_sum, shape, val

PASS_NAME = "short_bmm"
MAX_REDUCTION = 8

log = logging.getLogger("dsv4_compile")

_PRODUCTS = (aten.bmm.default, aten.mm.default)


def _is_candidate(node: Node) -> bool:
    if node.op != "call_function" or node.target not in _PRODUCTS:
        return False
    a, b = (val(x) for x in node.args)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if not (a.dtype.is_floating_point and a.dtype == b.dtype):
        return False
    depth = a.shape[-1]
    return isinstance(depth, int) and depth <= MAX_REDUCTION


def apply(graph: Graph, report) -> int:
    """Rewrites each matched mm / bmm to mul + sum over the reduction dim and records it."""
    rewrites = 0
    for product in [n for n in graph.nodes if _is_candidate(n)]:
        a, b = product.args
        report.record(PASS_NAME, product, True, f"{list(shape(a))} @ {list(shape(b))}")
        replace_with_mul_sum(graph, product)
        rewrites += 1
    log.debug("short_bmm: %d rewrite(s)", rewrites)
    return rewrites
