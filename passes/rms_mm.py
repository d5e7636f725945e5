"""dsv4 pass: f32 products of RMS-normed rows with a few output columns become dsv4::mm_sumsq.

The mHC mappings project RMS-normed streams in f32 (`F.linear(rmsnorm(streams.float()), fn)`:
[tokens, 4 * hidden] @ [4 * hidden, 24], and the hyper head's 4 columns). The norm's row factor
commutes with the product, so the op reads the bf16 streams as they are and returns the product
and the rows' sums of squares (kernels/rms_mm.py), and the graph finishes with
`prod * rsqrt(sumsq / K + eps)`, which inductor fuses into the consumers. Without this pass,
skinny_mm (which runs after it) gives such products to inductor as mul + sum.

Matches skinny_mm's candidates (`aten.mm(a [M, K], b [K, N])`, both operands f32, static M <=
MAX_ROWS, N <= MAX_COLUMNS, K >= MIN_REDUCTION * N) whose `a` is a reshape of x32 * rsqrt(mean(x32
** 2, [-1], keepdim=True) + eps) with x32 = x (f32) or convert_element_type(x, f32) from bf16 / f16,
where the Triton kernel runs (CUDA, or the interpreter in CPU tests), with 1 to the op's MAX_COLUMNS
columns and at least MIN_ROWS rows (below that inductor's mul + sum is as fast). Symbolic rows or more
than the op's MAX_ROWS are declined with the reason in the report; every other mm is left alone
without a record.
"""
from __future__ import annotations

import logging
import operator

import torch
from torch.fx import Graph, Node

from dsv4_compile.kernels._runtime import triton_runs_on
from dsv4_compile.kernels.rms_mm import MAX_COLUMNS, MAX_ROWS

from .fx_match import RESHAPES, accepted_mms, aten, call, is_call, prims, require_few_rows, shape, strip, val
from .skinny_mm import is_skinny_f32_mm

PASS_NAME = "rms_mm"
# H200, [rows, 16384] @ [16384, 24] with the finish fused into a consumer, in CUDA graphs (bench/RESULTS.md
# "Twentieth session"): the op 5.6 / 6.1 / 6.2 / 7.4 us at 1 / 4 / 8 / 64 rows, inductor's mul + sum 5.2 /
# 5.6 / 6.4 / 16.7 us.
MIN_ROWS = 8

log = logging.getLogger("dsv4_compile")


def _rms_norm_source(a: Node) -> tuple[Node, float] | None:
    """(x, eps) when `a` is a reshape of x32 * rsqrt(mean(x32 ** 2, [-1], keepdim) + eps) with x32 =
    x (f32) or convert_element_type(x, f32) from bf16 / f16, over the K columns the mm reduces and
    on a device where the Triton kernel runs; else None."""
    node = strip(a, RESHAPES)
    if not is_call(node, aten.mul.Tensor) or val(node) is None or val(node).shape[-1] != shape(a)[1]:
        return None
    for x32, factor in (node.args, node.args[::-1]):
        if not (is_call(factor, aten.rsqrt.default) and is_call(factor.args[0], aten.add.Tensor)):
            continue
        mean, eps = factor.args[0].args
        if isinstance(mean, (int, float)):
            mean, eps = eps, mean
        if not (is_call(mean, aten.mean.dim) and isinstance(eps, (int, float))):
            continue
        dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")  # None: every dim
        keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
        if dims is None or list(dims) not in ([-1], [val(x32).dim() - 1]) or not keepdim:
            continue
        square = mean.args[0]
        if not ((is_call(square, aten.pow.Tensor_Scalar) and square.args == (x32, 2))
                or (is_call(square, aten.mul.Tensor) and square.args == (x32, x32))):
            continue
        x = x32
        if (is_call(x32, prims.convert_element_type.default)
                and val(x32.args[0]).dtype in (torch.bfloat16, torch.float16)):
            x = x32.args[0]
        if val(x32).dtype == torch.float32 and triton_runs_on(val(x)):
            return x, float(eps)
    return None


def _is_candidate(node: Node) -> bool:
    """A skinny f32 mm of RMS-normed rows with the columns the op takes and, where the rows are
    static, at least MIN_ROWS of them (fewer are left to skinny_mm, which is as fast there)."""
    if not is_skinny_f32_mm(node):
        return False
    rows, columns = shape(node.args[0])[0], shape(node.args[1])[1]
    few = isinstance(rows, int) and rows < MIN_ROWS
    return 1 <= columns <= MAX_COLUMNS and not few and _rms_norm_source(node.args[0]) is not None


def _check(mm: Node) -> None:
    """Decline (with the reason) symbolic rows or more than the op's MAX_ROWS."""
    require_few_rows(mm, MAX_ROWS)


def _replace(graph: Graph, mm: Node, x: Node, eps: float) -> None:
    """mm(rmsnorm(x), b) -> prod * rsqrt(sumsq / K + eps)[:, None], (prod, sumsq) = dsv4::mm_sumsq(x as
    [M, K], b^T)."""
    a, b = mm.args
    rows, depth = shape(a)
    with graph.inserting_before(mm):
        rows_2d = call(graph, aten.reshape.default, (x, [rows, depth]))
        weight = call(graph, aten.permute.default, (b, [1, 0]))
        parts = call(graph, torch.ops.dsv4.mm_sumsq.default, (rows_2d, weight))
        total, sumsq = (call(graph, operator.getitem, (parts, i)) for i in range(2))
        mean = call(graph, aten.div.Tensor, (sumsq, float(depth)))
        factor = call(graph, aten.rsqrt.default, (call(graph, aten.add.Tensor, (mean, eps)),))
        out = call(graph, aten.mul.Tensor, (total, call(graph, aten.unsqueeze.default, (factor, 1))))
    mm.replace_all_uses_with(out)
    graph.erase_node(mm)


def apply(graph: Graph, report) -> int:
    """Rewrites each matched mm to dsv4::mm_sumsq and its finish; records the candidates."""
    rewrites = 0
    for mm in accepted_mms(graph, report, PASS_NAME, _is_candidate, _check):
        _replace(graph, mm, *_rms_norm_source(mm.args[0]))
        rewrites += 1
    log.debug("rms_mm: %d rewrite(s)", rewrites)
    return rewrites
