"""Rewrite the plain-torch FP4 MoE (gather packed experts, dequantise, SwiGLU GEMVs, weighted sum)
to torch.ops.dsv4.fp4_moe in inductor's post-grad graph.

Hand-written FX matching, keyed on the math rather than on one trace:
  out = sum_j(w[m, j] * bmm(W2', act(bmm(W13', x))))      (the anchor: sum over the choice dim)
where W13' / W2' are computed only from gathers `packed[ids]` of uint8 [E, rows, cols/2] graph
inputs or of their tiled form (dsv4_compile.fp4_tiles; put back in row order by views and a
copy, each word's bits by shifts and masks), plus their scales (and globals for NVFP4), by
unpack/decode/scale ops that compute the op's dequantisation on probe values, and
act = silu(min(gate, L)) * clamp(up, -L, L) (or silu(gate) * up without a limit). The format
comes from the scale dtype (uint8 ue8m0 -> mxfp4, e4m3 -> nvfp4). Anything else is declined
and recorded with its reason; bf16 experts (no packed gathers) are left alone. A bmm of batch
M * k = 1 (one token, top-1 routing) may be inductor's mm form of it on CUDA (fx_match.match_bmm).
"""
from __future__ import annotations

import logging
import math
import operator

import torch
from torch.fx import Graph, Node

from dsv4_compile.fp4 import MXFP4_BLOCK, NVFP4_BLOCK, dequantize_mxfp4, dequantize_nvfp4
from dsv4_compile.fp4_tiles import is_tiled, logical_shape, tile_fp4
from dsv4_compile.passes.fx_match import Decline, is_bmm, match_bmm
from dsv4_compile.passes.fx_probe import NoProbe, ReadsOutside, run_region

logger = logging.getLogger("dsv4_compile")

PASS_NAME = "fp4_moe"

aten = torch.ops.aten
prims = torch.ops.prims

_VIEWS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.squeeze.dim, aten.squeeze.default,
          aten.unsqueeze.default, aten.expand.default, aten.clone.default, prims.convert_element_type.default,
          aten.permute.default, aten.transpose.int}
# Views and dtype conversions that keep a tensor's row-major order (the top-k ids' (m, j) pairs).
_ORDER_KEEPING = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.squeeze.dim,
                  aten.squeeze.default, aten.unsqueeze.default, aten.clone.default, prims.convert_element_type.default}
# Ops allowed between the packed gathers and the dequantised weights.
_DEQUANT_OPS = _VIEWS | {
    aten.index.Tensor, aten.bitwise_and.Scalar, aten.__rshift__.Scalar, aten.bitwise_right_shift.Tensor_Scalar,
    aten.cat.default, aten.stack.default, aten.lift_fresh_copy.default, aten.sub.Tensor, aten.exp2.default,
    aten.mul.Tensor, aten.pow.Scalar, aten.arange.default, aten.arange.start, prims.iota.default,
    aten.unbind.int, operator.getitem, aten.select.int, aten.slice.Tensor, aten.where.self,
    # the tiled layout's bits put back in order (fp4_tiles.unswizzle_words)
    aten.view.dtype, aten.__lshift__.Scalar, aten.bitwise_left_shift.Tensor_Scalar, aten.bitwise_or.Tensor,
}
# Ops allowed in the activation between the gate/up split and the second GEMM.
_ACT_OPS = _VIEWS | {aten.clamp_max.default, aten.clamp_min.default, aten.clamp.default, aten.neg.default,
                     aten.exp.default, aten.add.Tensor, aten.div.Tensor, aten.mul.Tensor, aten.sigmoid.default,
                     aten.silu.default, aten.reciprocal.default}

# The probe's block of each gathered expert: its leading rows and columns (two tiles each way in the
# tiled layout, several scale groups) and the choices of the first tokens; of the pairs' activations
# and products, the first tokens' pairs and the leading columns.
_PROBE_ROWS, _PROBE_COLS, _PROBE_TOKENS = 64, 256, 2


def _val(node) -> torch.Tensor | None:
    return node.meta.get("val") if isinstance(node, Node) else None


def _strip(node: Node) -> Node:
    while isinstance(node, Node) and node.target in _VIEWS:
        node = node.args[0]
    return node


def _in_row_order(node: Node, what: str, experts: int | None = None) -> Node:
    """The [M, k] tensor (top-k ids or weights) that `node` reads through views and dtype conversions
    that keep its row-major order, the order of the op's (m, j) pairs; declines otherwise. With
    `experts` (ids), each dtype on the way must hold every id up to experts - 1 exactly."""
    while isinstance(node, Node) and node.target in _VIEWS:
        if node.target not in _ORDER_KEEPING:
            raise _Decline(f"the {what} are read through {node.target} (not in their [M, k] order)")
        dtype = _val(node).dtype if isinstance(_val(node), torch.Tensor) else None
        if experts is not None and not _holds_ids(dtype, experts):
            raise _Decline(f"the {what} are converted to {dtype}, which does not hold ids up to {experts - 1}")
        node = node.args[0]
    return node


def _holds_ids(dtype: torch.dtype | None, experts: int) -> bool:
    """Whether `dtype` represents every integer in [0, experts) exactly."""
    if dtype is None or dtype == torch.bool or dtype.is_complex:
        return False
    if dtype.is_floating_point:  # integers are exact up to 2 / eps (2**24 in f32, 256 in bf16)
        return experts - 1 <= min(2 / torch.finfo(dtype).eps, torch.finfo(dtype).max)
    return experts - 1 <= torch.iinfo(dtype).max


def _chain(start: Node, end: Node) -> list[Node]:
    """The nodes that compute `end` from `start`, in graph order (`start` excluded)."""
    region = _ancestors(end, {start})
    return [n for n in end.graph.nodes if n in region]


def _run_chain(start: Node, end: Node, probe: torch.Tensor, what: str) -> torch.Tensor:
    """`end` computed from a probe value (a leading block) of `start`; declines where it cannot be."""
    try:
        return run_region(_chain(start, end), {start: probe})[end]
    except ReadsOutside:
        raise _Decline(f"{what} read tensors other than their own input") from None
    except NoProbe as why:
        raise _Decline(f"{what} cannot be run on probe values ({why})") from None


def _pair_block(node: Node, tokens: int, top_k: int) -> tuple[int, ...]:
    """The probe block of a [M * k, ...] value: the pairs of the first tokens, every other dim whole."""
    return (top_k * min(tokens, _PROBE_TOKENS), *_val(node).shape[1:])


def _check_pair_inputs(x: Node, mat2: Node, top_k: int) -> None:
    """Runs the views from x [M, K] to the gate/up GEMM's activation operand on probe values (every
    token, the leading columns), and declines unless pair m * k + j reads token m's row: the op's
    pairing, which broadcasts that reorder the tokens (x[None] against [M, k] with M == k) break."""
    if not (_static(x) and _static(mat2)):
        return  # symbolic sizes: no probe values
    tokens, hidden = _val(x).shape
    gen = torch.Generator().manual_seed(1)
    probe = torch.randn(tokens, min(hidden, _PROBE_COLS), generator=gen).to(_val(x).dtype)
    got = _run_chain(x, mat2, probe, "the activations of the pairs")
    want = probe.repeat_interleave(top_k, 0).to(got.dtype)
    if got.numel() != want.numel() or not torch.equal(got.reshape(want.shape), want):
        raise _Decline("the gate/up GEMM's pairs do not read their own token's x (probe values differ)")


def _check_pair_outputs(out: Node, operand: Node, tokens: int, top_k: int, hidden: int) -> None:
    """Runs the views from the down GEMM's output [M * k, K, 1] to the summed operand on probe values,
    and declines unless the operand is [M, k, K] with pair m * k + j at [m, j]."""
    if tuple(_val(operand).shape) != (tokens, top_k, hidden):
        raise _Decline("the down products under the sum are not [M, k, K]")
    if not (_static(out) and _static(operand)):
        return
    block = list(_pair_block(out, tokens, top_k))
    block[1] = min(block[1], _PROBE_COLS)
    probe = torch.randn(block, generator=torch.Generator().manual_seed(2)).to(_val(out).dtype)
    got = _run_chain(out, operand, probe, "the down products")
    want = probe.reshape(-1, top_k, block[1]).to(got.dtype)
    if got.shape != want.shape or not torch.equal(got, want):
        raise _Decline("the down products are not summed in the op's (m, j) order (probe values differ)")


def _ancestors(node: Node, stop: set[Node]) -> set[Node]:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or n in stop:
            continue
        seen.add(n)
        todo.extend(a for a in n.all_input_nodes)
    return seen


def _weight_region(start: Node, stop: set[Node]) -> set[Node]:
    """Ancestors of `start` down to the gathers of graph inputs, whose ids are not followed
    (the router above them is not part of the weight path)."""
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        if n in seen or n in stop:
            continue
        seen.add(n)
        if n.target == aten.index.Tensor and _is_input(n.args[0]):
            todo.append(n.args[0])
        else:
            todo.extend(n.all_input_nodes)
    return seen


def _is_input(node: Node) -> bool:
    return node.op in ("placeholder", "get_attr")


class _Decline(Decline):
    pass


def _gathers(region: set[Node]) -> list[Node]:
    """index.Tensor(input, [ids]) nodes of the region that gather graph inputs."""
    return [n for n in region if n.target == aten.index.Tensor and _is_input(n.args[0])
            and len(n.args[1]) == 1 and isinstance(n.args[1][0], Node)]


def _expert_weights(region: set[Node], hidden: int, first: bool):
    """Find (packed, scale, global) gathered in `region` and the ids node; check the region is dequant-only."""
    bad = sorted({str(n.target) for n in region if n.op == "call_function" and n.target not in _DEQUANT_OPS})
    if bad:
        raise _Decline(f"weight path has non-dequantise ops {bad[:3]}")
    gathers = _gathers(region)
    shape = {g: logical_shape(_val(g.args[0])) for g in gathers}  # None: neither 3-D nor tiled
    packed = [g for g in gathers if _val(g.args[0]).dtype == torch.uint8 and shape[g] is not None
              and (2 * shape[g][2] == hidden if first else shape[g][1] == hidden)]
    if not packed:
        raise _Decline("no packed uint8 expert gather")
    # uint8 ue8m0 scales pass the filter too: the packed codes are the widest (cols/2 vs cols/32).
    packed = sorted(packed, key=lambda g: shape[g][2], reverse=True)
    if len(packed) > 2 or (len(packed) == 2 and shape[packed[1]][2] * 16 != shape[packed[0]][2]):
        raise _Decline("several packed uint8 expert gathers")
    if is_tiled(_val(packed[0].args[0])) and not any(n.target == aten.bitwise_or.Tensor for n in region):
        raise _Decline("tiled codes read without their words' bits unswizzled (fp4_tiles.untile_fp4)")
    ids = packed[0].args[1][0]
    rows, cols = shape[packed[0]][1], 2 * shape[packed[0]][2]
    scales = [g for g in gathers if g is not packed[0] and g.args[1][0] is ids and _val(g.args[0]).ndim == 3
              and shape[g][1] == rows]
    globs = [g for g in gathers if g.args[1][0] is ids and _val(g.args[0]).ndim == 1
             and _val(g.args[0]).dtype == torch.float32]
    if len(scales) != 1:
        raise _Decline("no block scale gathered with the packed weights")
    scale = scales[0].args[0]
    dtype, groups = _val(scale).dtype, shape[scales[0]][2]
    if dtype == torch.uint8 and groups * 32 == cols and not globs:
        return "mxfp4", packed[0].args[0], scale, None, ids
    if dtype == torch.float8_e4m3fn and groups * 16 == cols and len(globs) == 1:
        return "nvfp4", packed[0].args[0], scale, globs[0].args[0], ids
    raise _Decline(f"scale {dtype} x{groups} for {cols} columns is neither mxfp4 nor nvfp4")


def _check_dequant(out: Node, region: set[Node], fmt: str, packed: Node, scale: Node, glob: Node | None,
                   ids: Node) -> None:
    """Runs the weight path (`region`, gathers to `out`) on random codes, scales and globals of a few
    experts, and declines unless `out` is the op's dequantisation of the gathered experts, [pairs,
    rows, cols] in row order. Full-size experts are probed on a leading block of rows, columns and
    tokens (fx_probe.run_region), never on all experts. The op-kind checks alone let an extra factor, a
    transposed weight, swapped nibbles or another scale bias or grouping through."""
    if not all(_static(n) for n in region | {ids}):
        return  # symbolic sizes: no probe values (the op-kind checks stand)
    stored, codes, probe_ids = _probe_experts(fmt, packed, scale, glob, ids)
    scales = stored[scale][probe_ids]
    if fmt == "mxfp4":
        want = dequantize_mxfp4(codes[probe_ids], scales, torch.float32)
    else:
        want = dequantize_nvfp4(codes[probe_ids], scales, stored[glob][probe_ids], torch.float32)
    want = want.flatten(0, probe_ids.ndim - 1)
    try:
        got = _run_block(out, region, stored, ids, probe_ids)
    except NoProbe as why:
        raise _Decline(f"the weight path cannot be run on probe values ({why})") from None
    if fmt == "mxfp4":  # e2m1 values (2 significant bits) times powers of two: exact in bf16 and f16
        same = got.shape == want.shape and torch.equal(got.float(), want)
    else:
        # e2m1 value x e4m3 scale x f32 global rounds in f32 (the graph may multiply in another
        # order) and again to bf16 / f16 weights
        tolerance = 1e-5 if got.dtype == torch.float32 else 1e-2
        same = got.shape == want.shape and torch.allclose(got.float(), want, rtol=tolerance, atol=0.0)
    if not same:
        raise _Decline(f"the weight path is not the op's {fmt} dequantisation of the gathered experts "
                       "(probe values differ)")


def _static(node: Node) -> bool:
    """Whether `node`'s value (if a tensor) has int sizes only."""
    val = _val(node)
    return not isinstance(val, torch.Tensor) or all(isinstance(d, int) for d in val.shape)


def _probe_experts(fmt: str, packed: Node, scale: Node, glob: Node | None, ids: Node):
    """Random probe experts: ({packed, scale, glob input node: its probe value}, the row-major codes,
    the probe ids). The codes are all 16 values in both nibbles; scales and globals vary per block
    and expert, and each probe pair reads another expert where there are enough."""
    gen = torch.Generator().manual_seed(0)
    experts, rows, half_cols = logical_shape(_val(packed))
    rows, cols = min(rows, _PROBE_ROWS), min(2 * half_cols, _PROBE_COLS)
    id_shape = (min(_val(ids).shape[0], _PROBE_TOKENS), *_val(ids).shape[1:])
    pairs = math.prod(id_shape)
    experts = min(experts, pairs)
    probe_ids = ((torch.arange(pairs) + 1) % experts).reshape(id_shape)
    codes = torch.randint(0, 256, (experts, rows, cols // 2), generator=gen, dtype=torch.uint8)
    stored = {packed: tile_fp4(codes) if is_tiled(_val(packed)) else codes}
    if fmt == "mxfp4":
        stored[scale] = torch.randint(118, 137, (experts, rows, cols // MXFP4_BLOCK), generator=gen,
                                      dtype=torch.uint8)
    else:
        blocks = torch.rand(experts, rows, cols // NVFP4_BLOCK, generator=gen) * 8 + 0.25
        stored[scale] = blocks.to(torch.float8_e4m3fn)
        stored[glob] = torch.rand(experts, generator=gen) + 0.5
    return stored, codes, probe_ids


def _run_block(out: Node, region: set[Node], stored: dict, ids: Node, probe_ids: torch.Tensor) -> torch.Tensor:
    """`out` computed by the region's nodes from the probe experts gathered by `probe_ids`."""
    gathers = {n: stored[n.args[0]][probe_ids] for n in region
               if n.target == aten.index.Tensor and n.args[0] in stored and n.args[1][0] is ids}
    nodes = [n for n in out.graph.nodes if n in region and n not in stored and n not in gathers]
    try:
        return run_region(nodes, gathers)[out]
    except ReadsOutside:
        raise _Decline("the weight path reads tensors other than the gathered codes, scales and globals") from None


def _limit_of(region: set[Node], op, index: int = 1):
    values = {float(n.args[index]) for n in region if n.target == op and isinstance(n.args[index], (int, float))}
    return values


def _match(anchor: Node) -> dict:
    out_val = _val(anchor)
    if out_val is None or out_val.ndim != 2 or list(anchor.args[1]) != [1]:
        raise _Decline("not a sum over the choice dim of [M, k, K]")
    tokens, hidden = out_val.shape
    weighted = _strip(anchor.args[0])
    if weighted.target != aten.mul.Tensor:
        raise _Decline("sum input is not a routing-weight product")
    sides = [_strip(a) for a in weighted.args]
    bmm2 = next((s for s in sides if is_bmm(s)), None)
    others = [a for a, s in zip(weighted.args, sides) if s is not bmm2]
    if bmm2 is None or len(others) != 1:
        raise _Decline("no bmm times routing weights under the sum")
    operand = next(a for a, s in zip(weighted.args, sides) if s is bmm2)
    routing = _in_row_order(others[0], "routing weights")
    if _val(routing) is None or not _val(routing).is_floating_point():
        raise _Decline("no bmm times routing weights under the sum")
    bmm2 = match_bmm(bmm2, "the down projection")
    w2_side, h_side = bmm2.mat1, bmm2.mat2
    act = _strip(h_side)
    if act.target != aten.mul.Tensor:
        raise _Decline("second GEMM input is not a gated activation product")
    splits = _splits_feeding(act)
    if len(splits) != 1:
        raise _Decline("no single gate/up split")
    split = splits[0]
    bmm1 = match_bmm(_strip(split.args[0]), "gate/up")
    act_region = _ancestors(act, {split})
    bad = sorted({str(n.target) for n in act_region if n.op == "call_function" and n.target not in _ACT_OPS
                  and n.target is not operator.getitem})
    if bad:
        raise _Decline(f"activation has unsupported ops {bad[:3]}")
    if not any(n.target in (aten.exp.default, aten.sigmoid.default, aten.silu.default) for n in act_region):
        raise _Decline("activation is not SiLU")
    upper = _limit_of(act_region, aten.clamp_max.default)
    lower = _limit_of(act_region, aten.clamp_min.default)
    if not upper and not lower:
        limit = None
    elif len(upper) == 1 and lower == {-next(iter(upper))}:
        limit = next(iter(upper))
        if len([n for n in act_region if n.target == aten.clamp_max.default]) != 2:
            raise _Decline("swiglu clamp is not gate <= L and |up| <= L")
    else:
        raise _Decline(f"clamps {upper} / {lower} are not a symmetric swiglu limit")
    w13_side, x_side = bmm1.mat1, bmm1.mat2
    x = x_side
    while x.target in _VIEWS and tuple(_val(x).shape) != (tokens, hidden):
        x = x.args[0]
    if _val(x).ndim != 2 or tuple(_val(x).shape) != (tokens, hidden):
        raise _Decline("first GEMM activation is not x [M, K]")
    w13_region, w2_region = _weight_region(w13_side, {x}), _weight_region(w2_side, {act})
    fmt, w13, s13, g13, ids = _expert_weights(w13_region, hidden, first=True)
    fmt2, w2, s2, g2, ids2 = _expert_weights(w2_region, hidden, first=False)
    experts = logical_shape(_val(w13))[0]
    topk_ids = _in_row_order(ids, "expert ids", experts)
    if fmt2 != fmt or _in_row_order(ids2, "expert ids", experts) is not topk_ids:
        raise _Decline("gate/up and down experts differ in format or ids")
    if _val(topk_ids).ndim != 2 or _val(topk_ids).shape[0] != tokens or _val(routing).shape != _val(topk_ids).shape:
        raise _Decline("ids/routing weights are not [M, k]")
    top_k = _val(topk_ids).shape[1]
    with torch.no_grad():
        _check_dequant(w13_side, w13_region, fmt, w13, s13, g13, ids)
        _check_dequant(w2_side, w2_region, fmt, w2, s2, g2, ids2)
        _check_pair_inputs(x, x_side, top_k)
        _check_activation(bmm1.out, h_side, limit, tokens, top_k)
        _check_pair_outputs(bmm2.out, operand, tokens, top_k, hidden)
    if x.meta["val"].dtype != out_val.dtype:
        raise _Decline("output dtype differs from x dtype")
    return dict(x=x, ids=topk_ids, weights=routing, w13=w13, s13=s13, w2=w2, s2=s2, fmt=fmt, g13=g13, g2=g2,
                limit=limit)


def _check_activation(gate_up: Node, hidden: Node, limit: float | None, tokens: int, top_k: int) -> None:
    """Runs the path from the gate/up GEMM's output [M * k, 2I, 1] to the down GEMM's operand
    [M * k, I, 1] on probe values of the first tokens' pairs that reach past the clamp on both sides,
    and declines unless each pair's operand is the op's SwiGLU of its own gate/up rows: silu of rows
    [0, I) (clamped at limit) times rows [I, 2I) (clamped to [-limit, limit]). The op-kind checks
    alone let a swapped gate and up, a sigmoid gate, an extra factor or pairs in another order through."""
    if not (_static(gate_up) and _static(hidden)):
        return  # symbolic sizes: no probe values (the op-kind checks stand)
    block = _pair_block(gate_up, tokens, top_k)
    bound = 4.0 if limit is None else 2.0 * limit
    gen = torch.Generator().manual_seed(0)
    probe = ((torch.rand(block, generator=gen) * 2 - 1) * bound).to(_val(gate_up).dtype)
    got = _run_chain(gate_up, hidden, probe, "the activation")
    gate, up = probe.float().reshape(block[0], -1).chunk(2, dim=1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    want = torch.nn.functional.silu(gate) * up
    got = got.float()
    # the activation's own dtype rounds (bf16: 2**-8 relative, a few roundings deep)
    tolerance = 1e-5 if _val(gate_up).dtype == torch.float32 and _val(hidden).dtype == torch.float32 else 3e-2
    if got.numel() != want.numel() or not torch.allclose(got.reshape(want.shape), want, rtol=tolerance,
                                                         atol=tolerance * bound):
        raise _Decline("the activation is not silu(gate) * up of each pair's gate/up halves (probe values differ)")


def _splits_feeding(act: Node) -> list[Node]:
    """The split nodes reached from `act` through activation ops only (not the whole graph)."""
    found, seen, todo = [], set(), [act]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.target in (aten.split.Tensor, aten.split_with_sizes.default):
            found.append(n)
        elif n.target in _ACT_OPS or n.target is operator.getitem:
            todo.extend(n.all_input_nodes)
    return found


def _is_candidate(anchor: Node) -> bool:
    """A sum of (bmm * something): the shape of an MoE combine, worth a line in the report."""
    weighted = _strip(anchor.args[0])
    return weighted.target == aten.mul.Tensor and any(
        is_bmm(_strip(a)) for a in weighted.args if isinstance(a, Node))


def apply(graph: Graph, report) -> int:
    """Rewrite every FP4 MoE site of `graph` to dsv4::fp4_moe. Returns the number of rewrites."""
    import dsv4_compile.kernels.fp4_moe  # noqa: F401  (registers the op)

    rewrites = 0
    for anchor in list(graph.nodes):
        if anchor.target != aten.sum.dim_IntList:
            continue
        try:
            m = _match(anchor)
        except Decline as why:
            if _is_candidate(anchor):
                report.record(PASS_NAME, anchor, False, str(why))
            continue
        with graph.inserting_before(anchor):
            ids = m["ids"]
            if _val(ids).dtype != torch.int32:
                ids = graph.call_function(prims.convert_element_type.default, (ids, torch.int32))
                ids.meta["val"] = _val(m["ids"]).to(torch.int32)
            weights = m["weights"]
            if _val(weights).dtype != torch.float32:  # bf16 models route in bf16; the op takes f32
                weights = graph.call_function(prims.convert_element_type.default, (weights, torch.float32))
                weights.meta["val"] = _val(m["weights"]).to(torch.float32)
            new = graph.call_function(
                torch.ops.dsv4.fp4_moe.default,
                (m["x"], ids, weights, m["w13"], m["s13"], m["w2"], m["s2"], m["fmt"], m["g13"], m["g2"],
                 m["limit"]),
            )
            new.meta["val"] = anchor.meta["val"]
        anchor.replace_all_uses_with(new)
        report.record(PASS_NAME, anchor, True, f"{m['fmt']} limit={m['limit']}")
        rewrites += 1
    if rewrites:
        graph.eliminate_dead_code()
        logger.debug("fp4_moe: %d rewrites", rewrites)
    return rewrites
