"""passes/indexer.py on SGLang 0.5.23's own torch indexer: `fp8_paged_mqa_logits_torch` (or its
`_sm120` variant) followed by `topk_transform_pytorch_vectorized`, run from the installed
package (tests/sglang_source.py), in SGLang's layouts: cache [pages, 64 * 132] uint8 (64 x 128 fp8 values, then 64 f32 scales per
page), q [T, 1, 64, 128] fp8, weights [T, 64] f32, one length per row (verify = bs x draft rows),
physical slots out (page_table[b, i >> 6] << 6 | i & 63, -1 for none).
"""
import re
import types

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from dsv4_compile.backend import Dsv4Backend
from dsv4_compile.integrations.sglang_aranges import trace_sglang_aranges
from dsv4_compile.passes import indexer
from dsv4_compile.passes.manager import PassConfig
from dsv4_compile.passes.report import PassReport

pytest.importorskip("sglang", reason="needs the sglang package (tests/requirements: sglang==0.5.23 --no-deps)")
from helpers import BmmToMmOnCpu, TargetsBefore, compile_with_probe  # noqa: E402
from sglang_source import sglang_indexer_functions  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("fresh_compile")]

DIM, PAGE = 128, 64


@pytest.fixture
def sgl():
    """SGLang's functions, with `_arange_cache` made to always miss as the plugin must do (see
    dsv4_compile/integrations/sglang_aranges.py and test_filled_arange_cache_declined)."""
    functions = sglang_indexer_functions()
    holder = types.SimpleNamespace(_arange_cache={})
    trace_sglang_aranges(holder)
    functions.__globals__["_arange_cache"] = holder._arange_cache
    return functions


def sglang_step(sgl, q, cache, weights, lens, page_table, topk, scorer="fp8_paged_mqa_logits_torch"):
    """SGLang's call sequence (forward_c4_indexer with a torch scorer and the torch top-k)."""
    kv = cache.view(cache.shape[0], PAGE, 1, DIM + 4)
    logits = getattr(sgl, scorer)(q, kv, weights, lens, page_table, None,
                                  page_table.shape[1] * PAGE, False)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32)
    sgl.topk_transform_pytorch_vectorized(logits, lens, page_table, out, PAGE)
    return out


def sglang_inputs(requests, draft, seed, heads=64, n_pages=4, pool=9, max_len=None):
    """Rows = requests x draft (verify flattened); a request's rows share its page-table row and
    see consecutive lengths. Each request holds distinct pages of a small pool, in random
    order (scattered); requests share pages. Lengths cover 0, fewer than topk, a page multiple and the full width."""
    gen = torch.Generator().manual_seed(seed)
    rows = requests * draft
    q = torch.randn(rows, 1, heads, DIM, generator=gen).to(torch.float8_e4m3fn)
    weights = torch.randn(rows, heads, generator=gen) * heads ** -0.5
    values = (torch.randn(pool, PAGE, DIM, generator=gen) * 2).to(torch.float8_e4m3fn)
    scales = torch.rand(pool, PAGE, generator=gen) + 0.25
    cache = torch.cat([values.view(torch.uint8).reshape(pool, -1),
                       scales.view(torch.uint8).reshape(pool, -1)], dim=1).contiguous()
    tables = torch.stack([torch.randperm(pool, generator=gen)[:n_pages] for _ in range(requests)]).int()
    slots = n_pages * PAGE
    ends = torch.randint(0, (max_len or slots) + 1, (requests,), generator=gen)
    ends[:4] = torch.tensor([draft - 1, 2 * PAGE, slots, 7])[:requests]
    lens = (ends[:, None] - draft + 1 + torch.arange(draft)).clamp(min=0).flatten().int()
    return q, cache, weights, lens, tables.repeat_interleave(draft, dim=0)


def physical_scores(q, cache, weights):
    """f32 score of every (row, physical slot): k_scale * sum_h w[h] * relu(q[h] . k)."""
    pool = cache.shape[0]
    keys = cache[:, :PAGE * DIM].contiguous().view(torch.float8_e4m3fn).float().view(pool * PAGE, DIM)
    k_scale = cache[:, PAGE * DIM:].contiguous().view(torch.float32).flatten()
    logits = torch.einsum("thd,sd->ths", q[:, 0].float(), keys)
    return (torch.relu(logits) * weights[..., None]).sum(1) * k_scale, \
        (logits.abs() * weights.abs()[..., None]).sum(1) * k_scale


def assert_same_selection(got, want, q, cache, weights, lens, page_table):
    """Per row: -1 exactly past min(lens, topk), every slot on one of the row's visible pages,
    and the selected scores equal as a multiset. SGLang rounds each q.k to bf16 (2^-8
    relative) before relu, so scores move by at most 2^-8 * k_scale * sum_h |w| |q.k| and the
    sorted selected scores by twice that; the bound is checked per row."""
    topk = want.shape[1]
    scores, magnitude = physical_scores(q, cache, weights)
    for r in range(want.shape[0]):
        n = min(max(int(lens[r]), 0), topk)
        for idx in (got[r], want[r]):
            assert (idx[n:] == -1).all() and (idx[:n] >= 0).all()
            chosen = idx[idx >= 0].long()
            assert chosen.unique().numel() == n
            visible = {int(page_table[r, s // PAGE]) * PAGE + s % PAGE for s in range(int(lens[r]))}
            assert set(chosen.tolist()) <= visible
        bound = 2 * 2.0 ** -8 * magnitude[r].max()
        torch.testing.assert_close(scores[r, got[r][got[r] >= 0].long()].sort().values,
                                   scores[r, want[r][want[r] >= 0].long()].sort().values,
                                   rtol=0, atol=float(bound))


def compile_with_pass(fn):
    return compile_with_probe(fn, indexer)


@pytest.mark.parametrize("scorer", ["fp8_paged_mqa_logits_torch", "fp8_paged_mqa_logits_torch_sm120"])
@pytest.mark.parametrize("requests, draft", [(4, 1), (3, 4)])  # decode, verify (bs x draft rows)
def test_sglang_form_rewritten_and_matches_sglang(sgl, requests, draft, scorer):
    topk = 32
    fn = lambda *a: sglang_step(sgl, *a, topk, scorer)  # noqa: E731
    compiled, report, hook = compile_with_pass(fn)
    for seed in range(3):  # fresh data; eager SGLang calls in between
        args = sglang_inputs(requests, draft, seed)
        got = compiled(*args)
        assert_same_selection(got, fn(*args), *args)
    # The first call stores its aranges in the cache; dynamo guards the dict's keys, so the
    # second call recompiles once. Every graph is rewritten.
    assert 1 <= report.count(indexer.PASS_NAME) == len(report.records) <= 2
    assert torch.ops.dsv4.indexer_topk_physical.default in hook.targets
    assert torch.ops.aten.topk.default not in hook.targets
    assert torch.ops.aten.bmm.default not in hook.targets


def test_one_row_bmm_made_mm_by_inductor_is_rewritten(sgl, monkeypatch):
    """A decode of one request: on CUDA inductor turns the T=1 logits bmm into
    unsqueeze(mm(squeeze(keys), squeeze(q^T)), 0)."""
    topk = 32
    fn = lambda *a: sglang_step(sgl, *a, topk)  # noqa: E731
    bmm_to_mm = BmmToMmOnCpu(monkeypatch)
    before = TargetsBefore()
    compiled, report, hook = compile_with_pass(fn)
    q, cache, weights, lens, page_table = sglang_inputs(2, 1, seed=4)
    args = (q[1:], cache, weights[1:], lens[1:], page_table[1:])  # row 1 sees 2 pages: more than topk
    with torch._inductor.config.patch(post_grad_custom_pre_pass=before):
        got = compiled(*args)
    assert_same_selection(got, fn(*args), *args)
    assert bmm_to_mm.rewrites == 1
    assert torch.ops.aten.mm.default in before.targets and torch.ops.aten.bmm.default not in before.targets
    assert report.count(indexer.PASS_NAME) == 1
    assert torch.ops.dsv4.indexer_topk_physical.default in hook.targets
    assert torch.ops.aten.mm.default not in hook.targets


def test_sglang_form_under_dsv4_backend_fuses_translation(sgl):
    """The whole chain: pass -> indexer_topk_physical -> lowering. The generated wrapper calls
    dsv4::indexer_topk on strided views of the cache bytes (no copy of the cache, no
    indexer_topk_physical, no aten.topk) and one kernel writes the physical slots."""
    topk = 32
    fn = lambda *a: sglang_step(sgl, *a, topk)  # noqa: E731
    report = PassReport()
    compiled = torch.compile(fn, backend=Dsv4Backend(PassConfig(), report=report), fullgraph=True)
    args = sglang_inputs(3, 2, seed=7)
    got, code = run_and_get_code(compiled, *args)
    body = re.search(r"def call\(self, args\):\n(.*?)\n\s+return ", "\n".join(code), re.S).group(1)
    ops = re.findall(r"torch\.ops\.[\w.]+\(", body)
    assert ops.count("torch.ops.dsv4.indexer_topk.default(") == 1
    assert "indexer_topk_physical.default(" not in ops and "aten.topk" not in body
    assert "reinterpret_tensor(arg0_1, " in body  # the fp8 values: a strided view of the cache
    assert not re.search(r"\w+\(arg0_1, buf\d+\)", body)  # no kernel copies cache bytes
    assert report.count(indexer.PASS_NAME) == 1
    assert_same_selection(got, fn(*args), *args)


@pytest.mark.parametrize("change, reason", [
    (dict(page_size=32), "translation page size 32 != 64"),
    (dict(topk=4096, n_pages=64), "topk 4096 > 2048"),
    (dict(topk=512, n_pages=4), "topk 512 > slots 256"),
    (dict(heads=2), "heads 2 not in [4, 128]"),
])
def test_other_forms_declined(sgl, change, reason):
    topk, page_size = change.get("topk", 16), change.get("page_size", PAGE)

    def fn(q, cache, weights, lens, page_table):
        kv = cache.view(cache.shape[0], PAGE, 1, DIM + 4)
        logits = sgl.fp8_paged_mqa_logits_torch(q, kv, weights, lens, page_table, None,
                                                page_table.shape[1] * PAGE, False)
        out = torch.full((q.shape[0], topk), -1, dtype=torch.int32)
        sgl.topk_transform_pytorch_vectorized(logits, lens, page_table, out, page_size)
        return out

    compiled, report, hook = compile_with_pass(fn)
    args = sglang_inputs(2, 1, seed=3, heads=change.get("heads", 8),
                         n_pages=change.get("n_pages", 4), pool=change.get("n_pages", 4) + 2)
    assert torch.equal(compiled(*args).sort(-1).values, fn(*args).sort(-1).values)  # untouched
    assert report.count(indexer.PASS_NAME) == 0
    assert torch.ops.dsv4.indexer_topk_physical.default not in hook.targets
    (record,) = [r for r in report.records if r.pass_name == indexer.PASS_NAME]
    assert not record.matched and reason in record.reason, record.reason


def test_indices_written_into_a_graph_input_are_rewritten(sgl):
    """SGLang writes the top-k into the first rows of a metadata buffer (`c4_sparse_page_indices`),
    a graph input that its attention backend reads: the site is rewritten, the other rows kept."""
    topk = 32

    def fn(q, cache, weights, lens, page_table, buffer):
        kv = cache.view(cache.shape[0], PAGE, 1, DIM + 4)
        logits = sgl.fp8_paged_mqa_logits_torch(q, kv, weights, lens, page_table, None,
                                                page_table.shape[1] * PAGE, False)
        sgl.topk_transform_pytorch_vectorized(logits, lens, page_table, buffer[:q.shape[0]], PAGE)

    compiled, report, hook = compile_with_pass(fn)
    args = sglang_inputs(3, 2, seed=9)
    got, want = torch.zeros(8, topk, dtype=torch.int32), torch.zeros(8, topk, dtype=torch.int32)
    compiled(*args, got)
    fn(*args, want)
    assert_same_selection(got[:6], want[:6], *args)
    assert (got[6:] == 0).all()
    assert report.count(indexer.PASS_NAME) == 1
    assert torch.ops.dsv4.indexer_topk_physical.default in hook.targets


def sglang_step_with_logical(sgl, q, cache, weights, lens, page_table, topk=32):
    """SGLang's transform with `out_raw_indices` (its indexer capture, HiSparse): the logical slots
    are written too, position by position beside the physical ones."""
    kv = cache.view(cache.shape[0], PAGE, 1, DIM + 4)
    logits = sgl.fp8_paged_mqa_logits_torch(q, kv, weights, lens, page_table, None,
                                            page_table.shape[1] * PAGE, False)
    out, raw = (torch.full((q.shape[0], topk), -1, dtype=torch.int32) for _ in range(2))
    sgl.topk_transform_pytorch_vectorized(logits, lens, page_table, out, PAGE, raw)
    return out, raw


@pytest.mark.parametrize("requests, draft", [(3, 1), (2, 4)])
def test_logical_slots_also_written_rewritten_from_one_call(sgl, requests, draft):
    """Both results come from one dsv4::indexer_topk call: the physical slots are the logical
    ones translated position by position, as SGLang's pairs them."""
    compiled, report, hook = compile_with_pass(lambda *a: sglang_step_with_logical(sgl, *a))
    args = sglang_inputs(requests, draft, seed=3, heads=8)
    q, cache, weights, lens, page_table = args
    (got, got_raw), (want, want_raw) = compiled(*args), sglang_step_with_logical(sgl, *args)
    assert_same_selection(got, want, *args)
    valid = got_raw >= 0
    assert torch.equal(valid, got >= 0)
    rows = torch.arange(got.shape[0])[:, None].expand_as(got_raw)
    translated = page_table[rows, got_raw.clamp(min=0) // PAGE] * PAGE + got_raw.clamp(min=0) % PAGE
    assert torch.equal(got[valid], translated[valid])
    assert (got_raw < lens[:, None]).all()
    assert torch.equal(valid, want_raw >= 0)
    assert report.count(indexer.PASS_NAME) == 1
    assert torch.ops.dsv4.indexer_topk.default in hook.targets
    assert torch.ops.dsv4.indexer_topk_physical.default not in hook.targets


def test_logical_slots_masked_otherwise_declined(sgl):
    """A second reader of the logical slots that is not masked like the physical ones (here its
    mask is replaced by the short rows' one before the pass) would keep torch.topk's order
    beside the op's: the pass declines."""

    def retarget_logical_mask(graph, report):
        buffers = [n for n in graph.nodes if n.op == "placeholder"]
        (raw,) = [n for n in graph.nodes if n.op == "call_function"
                  and n.target == torch.ops.aten.copy_.default and n.args[0] is buffers[-1]]
        where = raw.args[1]  # where(~valid, -1, logical); valid = where(short, slot < lens, ...)
        short_valid = where.args[0].args[0].args[1]
        with graph.inserting_before(where):
            not_valid = graph.call_function(torch.ops.aten.bitwise_not.default, (short_valid,))
        not_valid.meta["val"] = short_valid.meta["val"]
        where.replace_input_with(where.args[0], not_valid)
        return indexer.apply(graph, report)

    def fn(q, cache, weights, lens, page_table, out, raw):
        kv = cache.view(cache.shape[0], PAGE, 1, DIM + 4)
        logits = sgl.fp8_paged_mqa_logits_torch(q, kv, weights, lens, page_table, None,
                                                page_table.shape[1] * PAGE, False)
        sgl.topk_transform_pytorch_vectorized(logits, lens, page_table, out, PAGE, raw)

    retargeted = types.SimpleNamespace(apply=retarget_logical_mask, __name__="indexer_logical_mask_retargeted")
    compiled, report, hook = compile_with_probe(fn, retargeted)
    args = sglang_inputs(2, 1, seed=3, heads=8)
    buffers = [torch.full((2, 32), -1, dtype=torch.int32) for _ in range(2)]
    compiled(*args, *buffers)
    assert torch.ops.dsv4.indexer_topk.default not in hook.targets
    (record,) = report.records
    assert not record.matched and "the top-k is also read by" in record.reason, record.reason


def test_filled_arange_cache_declined(sgl):
    """With SGLang's own `_arange_cache` (a plain dict) filled by an eager call, dynamo passes
    the cached aranges as graph inputs: the slot numbers are unknown to the pass, which declines
    with that reason instead of guessing."""
    sgl.__globals__["_arange_cache"] = {}
    fn = lambda *a: sglang_step(sgl, *a, 16)  # noqa: E731
    args = sglang_inputs(2, 1, seed=4, heads=8)
    want = fn(*args)  # fills the cache
    compiled, report, _ = compile_with_pass(fn)
    assert torch.equal(compiled(*args).sort(-1).values, want.sort(-1).values)
    (record,) = report.records
    assert not record.matched and "slot numbers unknown at compile time" in record.reason


def test_head_dim_other_than_128_declined(sgl):
    """SGLang's scorers assert D == 128, so this scorer is written here: the same paged layout
    with D = 64 (pages of 64 x 68 B), followed by SGLang's own top-k transform."""
    dim, topk = 64, 16

    def fn(q, cache, weights, lens, page_table):
        rows, n_pages = page_table.shape
        pages = cache[page_table.clamp(min=0)]
        keys = pages[..., :PAGE * dim].contiguous().view(torch.float8_e4m3fn).to(torch.bfloat16)
        scale = pages[..., PAGE * dim:].contiguous().view(torch.float32).reshape(rows, -1)
        logits = torch.bmm(keys.reshape(rows, n_pages * PAGE, dim),
                           q[:, 0].to(torch.bfloat16).transpose(1, 2))
        scores = (torch.relu(logits) * weights.unsqueeze(1)).sum(dim=2) * scale
        out = torch.full((rows, topk), -1, dtype=torch.int32)
        sgl.topk_transform_pytorch_vectorized(scores, lens, page_table, out, PAGE)
        return out

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 8, dim, generator=gen).to(torch.float8_e4m3fn)
    values = torch.randn(4, PAGE * dim, generator=gen).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = (torch.rand(4, PAGE, generator=gen) + 0.5).view(torch.uint8)
    args = (q, torch.cat([values, scales], dim=1), torch.randn(2, 8, generator=gen),
            torch.tensor([10, 200], dtype=torch.int32), torch.tensor([[3, 1, 0, 2]] * 2).int())
    compiled, report, hook = compile_with_pass(fn)
    assert torch.equal(compiled(*args).sort(-1).values, fn(*args).sort(-1).values)
    assert torch.ops.dsv4.indexer_topk_physical.default not in hook.targets
    (record,) = report.records
    assert not record.matched and "head dim 64 != 128" in record.reason, record.reason
