"""Keep SGLang's torch indexer traceable: its module-level arange cache must always miss.

SGLang 0.5.23's torch indexer (`fp8_paged_mqa_logits_torch`, `_topk_transform_vectorized` in
`sglang.srt.layers.attention.dsv4.indexer`) keeps its slot aranges in a module dict
`_arange_cache`. Once an eager call or a compiled call has filled it, dynamo passes the cached
tensors into every later graph as inputs (and a compiled graph traced with an empty cache fails
its own guard and recompiles): the slot numbers are then unknown at compile time, and the
indexer pass has to decline. With `TracedArangeCache` installed every lookup misses, so each
graph builds its aranges itself and the pass can prove the masks compare slot numbers. (Entries
are still stored: the first compiled call adds keys, and dynamo, which guards the dict's keys,
recompiles once; that graph is rewritten too.)
"""
from __future__ import annotations

import types


class TracedArangeCache(dict):
    """A dict whose `in` test is always False: callers rebuild (and overwrite) every entry."""

    def __contains__(self, key: object) -> bool:
        return False


def trace_sglang_aranges(indexer_module: types.ModuleType) -> None:
    """Replace `indexer_module._arange_cache` (SGLang's dsv4 indexer module) by a
    TracedArangeCache; a no-op if the module has no such cache."""
    if isinstance(getattr(indexer_module, "_arange_cache", None), dict):
        indexer_module._arange_cache = TracedArangeCache()
