"""Inductor lowering of dsv4::indexer_topk_physical: the top-k as an extern call, the
logical -> physical slot translation as inductor IR.

`torch.ops.dsv4.indexer_topk_physical` lowers to
  1. an extern (fallback) call to `dsv4::indexer_topk` -> logical slots [B, T, K] int32, and
  2. physical[b, t, j] = page_table[b, s // 64] * 64 + s % 64 for s = logical[b, t, j] >= 0,
     else -1, built as one inductor Pointwise node (an indirect load of the page table). The
     node stays unrealised, so inductor inlines it into whatever consumes the slots (SGLang's
     copy into its index buffer, the sparse attention's row gather): the translation costs no
     kernel and no [B, T, K] round trip of its own. The slots are int32: a consumer that
     multiplies them by a row stride must widen them first (`.long()`), or a pool of more than
     2**31 elements overflows the offset.

The math equals `kernels.indexer_physical.physical_slots`, the op's own eager epilogue.
"""
from __future__ import annotations

import torch
from torch._inductor import ir
from torch._inductor.lowering import fallback_handler
from torch._inductor.virtualized import ops

from dsv4_compile.kernels.indexer_physical import PAGE_SIZE  # also registers the ops
from dsv4_compile.lowerings.install import install_lowering

_PAGE_BITS = PAGE_SIZE.bit_length() - 1  # PAGE_SIZE is a power of two


def _translate(logical: ir.TensorBox, page_table: ir.TensorBox) -> ir.TensorBox:
    """logical [B, T, K] int32, page_table [B, max_pages] int32 -> unrealised Pointwise
    [B, T, K] int32 of physical slots (-1 kept)."""
    max_pages = page_table.get_size()[1]
    load_slot, load_page = logical.make_loader(), page_table.make_loader()

    def inner_fn(index):
        b, _, _ = index
        slot = load_slot(index)
        zero = ops.constant(0, torch.int32)
        valid = ops.ge(slot, zero)
        slot = ops.where(valid, slot, zero)  # -1 must not index the page table
        # slot >= 0 here, so // 64 and % 64 are a shift and a mask
        page = ops.bitwise_right_shift(slot, ops.constant(_PAGE_BITS, torch.int32))
        page = ops.indirect_indexing(page, max_pages, check=False)
        offset = ops.bitwise_and(slot, ops.constant(PAGE_SIZE - 1, torch.int32))
        physical = ops.bitwise_or(
            ops.bitwise_left_shift(load_page([b, page]), ops.constant(_PAGE_BITS, torch.int32)),
            offset)
        return ops.where(valid, physical, ops.constant(-1, torch.int32))

    return ir.Pointwise.create(device=logical.get_device(), dtype=torch.int32, inner_fn=inner_fn,
                               ranges=list(logical.get_size()))


def _lower_indexer_topk_physical(q, weights, k_cache, k_scale, page_table, lens, topk):
    logical = fallback_handler(torch.ops.dsv4.indexer_topk.default, add_to_fallback_set=False)(
        q, weights, k_cache, k_scale, page_table, lens, topk)
    return _translate(logical, page_table)


def register() -> None:
    """Install the dsv4::indexer_topk_physical lowering (idempotent)."""
    install_lowering(torch.ops.dsv4.indexer_topk_physical.default, _lower_indexer_topk_physical)
