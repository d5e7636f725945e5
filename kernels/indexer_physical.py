"""`torch.ops.dsv4.indexer_topk_physical`: the indexer top-k in physical slot ids.

SGLang's paged indexer hands the sparse attention physical slots of its key pool,
`page_table[b, s // 64] * 64 + s % 64` for logical slot s (and -1 for none). This op is
`dsv4::indexer_topk` followed by that translation. Eagerly the translation is the torch code
below (the spec); under the dsv4 backend, lowerings/indexer.py lowers it to an extern call to
`dsv4::indexer_topk` plus the translation as inductor IR that fuses into the consumer.
"""
from __future__ import annotations

import torch

from dsv4_compile.kernels.indexer_topk import PAGE_SIZE, check_indexer_args, indexer_topk


def physical_slots(idx: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """Logical -> physical slots. idx [B, T, K] int32 (-1 = none), page_table [B, max_pages]
    int32. Returns [B, T, K] int32: page_table[b, s // 64] * 64 + s % 64, -1 kept."""
    valid = idx >= 0
    logical = torch.where(valid, idx, 0).long()
    pages = torch.gather(page_table.long(), 1, (logical // PAGE_SIZE).flatten(1))
    physical = pages.view_as(idx) * PAGE_SIZE + logical % PAGE_SIZE
    return torch.where(valid, physical, -1).to(torch.int32)


@torch.library.custom_op("dsv4::indexer_topk_physical", mutates_args=())
def indexer_topk_physical(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    page_table: torch.Tensor,
    lens: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    """`dsv4::indexer_topk` (same arguments and checks) with the selected slots translated to
    physical ones: idx [B, T, topk] int32, page_table[b, s // 64] * 64 + s % 64, -1 past
    min(lens[b, t], topk); order unspecified."""
    check_indexer_args(q, weights, k_cache, k_scale, page_table, lens, topk)
    logical = indexer_topk(q, weights, k_cache, k_scale, page_table, lens, topk)
    return physical_slots(logical, page_table)


@indexer_topk_physical.register_fake
def _indexer_topk_physical_fake(q, weights, k_cache, k_scale, page_table, lens, topk):
    check_indexer_args(q, weights, k_cache, k_scale, page_table, lens, topk)
    batch, tokens = q.shape[:2]
    return q.new_empty((batch, tokens, topk), dtype=torch.int32)
