"""Cache reads and writes index in int64: at V4-Flash sizes (max_batch 64, max context 1M) the indexer key
pages hold more than 2**31 elements, and inductor's Triton scatter computes `page * page_stride`
in the dtype of the page id it loads, so an int32 id overflows (seen on the H200)."""
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import dsv4_compile
from dsv4_compile.tiny import tiny_model


INDEXING = {torch.ops.aten.index_put_.default: 1, torch.ops.aten.index_put.default: 1,
            torch.ops.aten.index.Tensor: 1, torch.ops.aten.gather.default: 2}  # op -> index argument


def test_every_indexing_op_uses_int64_indices():
    model = tiny_model(seed=0, num_hidden_layers=2,
                       layer_types=["sliding_attention", "compressed_sparse_attention"],
                       mlp_layer_types=["hash_moe", "moe"])
    engine = dsv4_compile.optimize(model, max_batch=2, max_context=256, verify_tokens=1, compile=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 2))
    graph = make_fx(engine.module)(ids, torch.tensor([37, 9]), torch.tensor([0, 1])).graph
    ops = [n for n in graph.nodes if n.target in INDEXING]
    writes = [n for n in ops if "index_put" in str(n.target)]
    assert len(writes) >= 4 and len(ops) > len(writes)  # window, compressor rings, c4 entries, key pages
    for node in ops:
        indices = node.args[INDEXING[node.target]]
        for index in indices if isinstance(indices, (list, tuple)) else [indices]:
            if index is not None:
                assert index.meta["val"].dtype == torch.int64, f"{node} indexes with {index.meta['val'].dtype}"
