"""The kernels on pools of more than 2**31 elements, read near their end, where an int32 offset
would wrap. The Triton interpreter computes the kernels' integer offsets in their own dtypes, as
the GPU does, so an int32 `row * stride` reads the wrong place here too. Only the pages and rows
that are read are filled; the rest of each pool is never touched (torch.empty)."""
import torch
from helpers import large_indexer_inputs, large_sparse_mla_inputs
from test_indexer_topk import assert_topk_valid

from dsv4_compile.kernels import indexer_topk, sparse_mla
from dsv4_compile.kernels._runtime import triton_runs_on


def test_triton_kernels_run_here():
    assert triton_runs_on(torch.zeros(1)), "set TRITON_INTERPRET=1 on CPU (tests/conftest.py does)"


def test_indexer_reads_the_last_pages_of_a_2_31_element_cache():
    args = large_indexer_inputs(16, "cpu", torch.Generator().manual_seed(0))
    out = torch.full((1, 2, 512), -7, dtype=torch.int32)  # poisoned
    idx, _ = indexer_topk.indexer_topk_triton(*args, 512, out=out)
    assert_topk_valid(idx, indexer_topk.indexer_scores_reference(*args), args[-1], 512)


def test_sparse_mla_reads_the_last_rows_of_a_2_31_element_pool():
    args = large_sparse_mla_inputs(8, "cpu", torch.Generator().manual_seed(1))
    out = torch.full_like(args[0], float("nan"))  # poisoned
    sparse_mla.sparse_mla_triton(*args, out=out)
    # bf16 output of f32 softmax and accumulation: one bf16 ulp (2**-8 relative) of O(1) values.
    torch.testing.assert_close(out, sparse_mla.sparse_mla_reference(*args), atol=2 ** -7, rtol=2 ** -7)
