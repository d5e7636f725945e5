"""The kernels on pools of more than 2**31 elements, read near their end, where an int32 offset
would wrap. The Triton interpreter computes the kernels' integer offsets in their own dtypes, as
the GPU does, so an int32 `row * stride` reads the wrong place here too. Only the pages and rows
that are read are filled; the rest of each pool is never touched (torch.empty)."""
import torch
from test_indexer_topk import assert_topk_valid

from dsv4_compile.kernels import indexer_topk, sparse_mla
from dsv4_compile.kernels._runtime import triton_runs_on

PAGE = indexer_topk.PAGE_SIZE


def test_triton_kernels_run_here():
    assert triton_runs_on(torch.zeros(1)), "set TRITON_INTERPRET=1 on CPU (tests/conftest.py does)"


def test_indexer_reads_the_last_pages_of_a_2_31_element_cache():
    gen = torch.Generator().manual_seed(0)
    pages, dim, used_pages = 262_400, 128, 40  # 262,400 * 64 * 128 = 2.15e9 fp8 elements
    k_cache = torch.empty(pages, PAGE, dim, dtype=torch.float8_e4m3fn)
    k_scale = torch.empty(pages, PAGE)
    used = torch.arange(pages - used_pages, pages)
    k_cache[used] = torch.randn(used_pages, PAGE, dim, generator=gen).to(k_cache.dtype)
    k_scale[used] = torch.rand(used_pages, PAGE, generator=gen) + 0.5
    page_table = used.flip(0).view(1, used_pages).int().contiguous()
    q = torch.randn(1, 2, 16, dim, generator=gen).to(torch.bfloat16)
    weights = torch.randn(1, 2, 16, generator=gen) * 16 ** -0.5
    lens = torch.tensor([[used_pages * PAGE - 1, used_pages * PAGE]], dtype=torch.int32)
    out = torch.full((1, 2, 512), -7, dtype=torch.int32)  # poisoned
    idx, _ = indexer_topk.indexer_topk_triton(q, weights, k_cache, k_scale, page_table, lens, 512, out=out)
    scores = indexer_topk.indexer_scores_reference(q, weights, k_cache, k_scale, page_table, lens)
    assert_topk_valid(idx, scores, lens, 512)


def test_sparse_mla_reads_the_last_rows_of_a_2_31_element_pool():
    gen = torch.Generator().manual_seed(1)
    rows, head_dim, heads, window = 4_300_000, 512, 8, 64  # 4.3e6 * 512 = 2.2e9 bf16 elements
    extra_kv = torch.empty(rows, head_dim, dtype=torch.bfloat16)
    tail = torch.arange(rows - 1024, rows)
    extra_kv[tail] = torch.randn(1024, head_dim, generator=gen).to(torch.bfloat16)
    kv = torch.randn(2 * window, head_dim, generator=gen).to(torch.bfloat16)
    q = torch.randn(2, 2, heads, head_dim, generator=gen).to(torch.bfloat16)
    idx = torch.arange(2 * window).view(2, 1, window).expand(2, 2, window).int().contiguous()
    extra_idx = tail[torch.randint(0, 1024, (2, 2, 128), generator=gen)].int()
    extra_idx[0, 1, ::3] = -1
    sink = torch.randn(heads, generator=gen)
    args = (q, kv, None, idx, extra_kv, None, extra_idx, sink, head_dim ** -0.5)
    out = torch.full_like(q, float("nan"))  # poisoned
    sparse_mla.sparse_mla_triton(*args, out=out)
    # bf16 output of f32 softmax and accumulation: one bf16 ulp (2**-8 relative) of O(1) values.
    torch.testing.assert_close(out, sparse_mla.sparse_mla_reference(*args), atol=2 ** -7, rtol=2 ** -7)
