"""Inductor lowering of dsv4::sparse_mla: the split-K pass as an extern call, the combine as inductor IR.

With S = the kernel's own split count for these static shapes (`pick_config`, the choice the
eager op makes), `torch.ops.dsv4.sparse_mla` lowers to
  1. an extern (fallback) call to `dsv4::sparse_mla_partials` -> out [B,T,H,S,Dh] f32 and
     lse [B,T,H,S] f32 (each split normalised on its own, no sink), and
  2. the combine `kernels.sparse_mla.combine_partials_reference` (the S splits weighted by
     exp(lse), the sink in the denominator, the cast to q's dtype) as one inductor Pointwise
     over [B,T,H,Dh] with the S terms unrolled. It stays unrealised, so inductor inlines it into
     what consumes the attention output (in the model: the inverse RoPE of the rope slice, the
     cat with the nope slice and the grouped output projection's input layout): the combine
     costs no kernel and no [B,T,H,Dh] round trip of its own.
With S = 1 there is nothing to combine: the op stays one extern call (its kernel finishes the
softmax and writes q's dtype, fewer bytes than an f32 partial). Above MAX_INLINED_SPLITS the op
stays one call too: each reader of an inlined combine reads S partial rows of f32 and computes S
exponentials per element (S reaches 66 at B=1 on the H200 over an HCA layer's 8,320 positions), which costs
more than the op's own combine kernel and makes inductor's generated code grow with S.
"""
from __future__ import annotations

import sympy
import torch
from torch._inductor import ir
from torch._inductor.lowering import fallback_handler
from torch._inductor.virtualized import ops

from dsv4_compile.kernels.sparse_mla import pick_config
from dsv4_compile.lowerings.install import install_lowering

MAX_INLINED_SPLITS = 16


class _RecomputedStorage(ir.StorageBox):
    """A StorageBox that stays unrealised when its value has several readers.

    Inductor materialises a multi-reader Pointwise that calls exp (on CPU) or has many ops; the
    combine's readers (the RoPE's nope slice, rope slice and its rotated pairs) each read only
    part of it, so recomputing the few exp per element is cheaper than a [B,T,H,Dh] round trip.
    A consumer that needs a buffer (an extern kernel, a reduction) still realises it.
    """

    def should_realize_on_reuse(self, users, *args, **kwargs) -> bool:
        return False

    def mark_reuse(self, users, *args, **kwargs) -> None:
        return None


def _static(sizes) -> list[int] | None:
    """The sizes as ints, or None when any is symbolic."""
    if not all(isinstance(s, (int, sympy.Integer)) for s in sizes):
        return None
    return [int(s) for s in sizes]


def num_splits_for(q: ir.TensorBox, kv: ir.TensorBox, idx: ir.TensorBox,
                   extra_idx: ir.TensorBox | None) -> int | None:
    """The split count the eager op picks for these shapes on q's device; None if any is symbolic."""
    q_size = _static(q.get_size())
    widths = _static([idx.get_size()[2]] + ([extra_idx.get_size()[2]] if extra_idx is not None else []))
    if q_size is None or widths is None:
        return None
    batch, tokens, heads, head_dim = q_size
    return pick_config(batch, tokens, heads, head_dim, sum(widths), q.get_device(),
                       fp8_rows=kv.get_dtype() == torch.uint8, value_bytes=q.get_dtype().itemsize).num_splits


def _combine(parts: ir.TensorBox, lse: ir.TensorBox, sink: ir.TensorBox | None, dtype: torch.dtype) -> ir.TensorBox:
    """parts [B,T,H,S,D] f32, lse [B,T,H,S] f32, sink [H] f32 or None -> unrealised [B,T,H,D] of `dtype`."""
    batch, tokens, heads, splits, head_dim = parts.get_size()
    splits = int(splits)
    load_part, load_lse = parts.make_loader(), lse.make_loader()
    load_sink = sink.make_loader() if sink is not None else None

    def inner_fn(index):
        b, t, h, d = index
        logs = [load_lse([b, t, h, s]) for s in range(splits)]
        if load_sink is not None:
            logs.append(load_sink([h]))
        top = logs[0]
        for value in logs[1:]:
            top = ops.maximum(top, value)
        zero = ops.constant(0.0, torch.float32)
        top = ops.where(ops.eq(top, ops.constant(float("-inf"), torch.float32)), zero, top)
        weights = [ops.exp(ops.sub(value, top)) for value in logs]
        denom = weights[0]
        for w in weights[1:]:
            denom = ops.add(denom, w)
        total = None
        for s in range(splits):
            term = ops.mul(weights[s], load_part([b, t, h, s, d]))
            total = term if total is None else ops.add(total, term)
        nonzero = ops.gt(denom, zero)
        value = ops.truediv(total, ops.where(nonzero, denom, ops.constant(1.0, torch.float32)))
        return ops.to_dtype(ops.where(nonzero, value, zero), dtype)

    pointwise = ir.Pointwise(device=parts.get_device(), dtype=dtype, inner_fn=inner_fn,
                             ranges=[batch, tokens, heads, head_dim])
    return ir.TensorBox(_RecomputedStorage(pointwise))


def _lower_sparse_mla(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, sink, scale):
    splits = num_splits_for(q, kv, idx, extra_idx)
    if splits is None or not 1 < splits <= MAX_INLINED_SPLITS:
        return fallback_handler(torch.ops.dsv4.sparse_mla.default, add_to_fallback_set=False)(
            q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, sink, scale)
    parts, lse = fallback_handler(torch.ops.dsv4.sparse_mla_partials.default, add_to_fallback_set=False)(
        q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, scale, splits)
    return _combine(parts, lse, sink, q.get_dtype())


def register() -> None:
    """Install the dsv4::sparse_mla lowering (idempotent)."""
    install_lowering(torch.ops.dsv4.sparse_mla.default, _lower_sparse_mla)
