"""Inductor lowering of dsv4::fp4_moe: the experts as an extern call, the combine as inductor IR.

`torch.ops.dsv4.fp4_moe` lowers to
  1. an extern (fallback) call to `dsv4::fp4_moe_pairs` -> pairs [M*k, K] f32, already weighted by
     topk_weights; rows of skipped pairs (ids outside [0, E)) are unspecified, and
  2. out[m, n] = sum_j where(0 <= ids[m, j] < E, pairs[m*k + j, n], 0), cast to x's dtype, built
     as one inductor Pointwise node with the k terms unrolled (k is static and small: 6 in
     DeepSeek-V4). The node stays unrealised, so inductor inlines it into what consumes the MoE
     output (the shared-expert add, the hyper-connection combine) and the combine costs no
     kernel and no [M, K] round trip of its own.

The math equals `kernels.moe_pairs.combine_pairs` (the spec of the eager op's epilogue, which runs
`combine_pairs_triton`).
"""
from __future__ import annotations

import torch
from torch._inductor import ir
from torch._inductor.lowering import fallback_handler
from torch._inductor.virtualized import ops

import dsv4_compile.kernels.fp4_moe  # noqa: F401  (registers dsv4::fp4_moe and dsv4::fp4_moe_pairs)
from dsv4_compile.lowerings.install import install_lowering


def _combine(pairs: ir.TensorBox, topk_ids: ir.TensorBox, experts: int, dtype: torch.dtype) -> ir.TensorBox:
    """pairs [M*k, K] f32, topk_ids [M, k] int32 -> unrealised Pointwise [M, K] of `dtype`."""
    tokens, top_k = topk_ids.get_size()
    top_k = int(top_k)
    hidden = pairs.get_size()[1]
    load_pair, load_id = pairs.make_loader(), topk_ids.make_loader()

    def inner_fn(index):
        m, n = index
        total = None
        for j in range(top_k):
            expert = load_id([m, j])
            valid = ops.and_(ops.ge(expert, ops.constant(0, torch.int32)),
                             ops.lt(expert, ops.constant(experts, torch.int32)))
            term = ops.where(valid, load_pair([m * top_k + j, n]), ops.constant(0.0, torch.float32))
            total = term if total is None else ops.add(total, term)
        return ops.to_dtype(total, dtype)

    return ir.Pointwise.create(device=pairs.get_device(), dtype=dtype, inner_fn=inner_fn,
                               ranges=[tokens, hidden])


def _lower_fp4_moe(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, fmt, w13_global, w2_global,
                   swiglu_limit):
    pairs = fallback_handler(torch.ops.dsv4.fp4_moe_pairs.default, add_to_fallback_set=False)(
        x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, fmt, w13_global, w2_global, swiglu_limit)
    return _combine(pairs, topk_ids, int(w13.get_size()[0]), x.get_dtype())


def register() -> None:
    """Install the dsv4::fp4_moe lowering (idempotent)."""
    install_lowering(torch.ops.dsv4.fp4_moe.default, _lower_fp4_moe)
