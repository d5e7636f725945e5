"""passes/indexer.py: the full-context indexer top-k -> torch.ops.dsv4.indexer_topk."""
import pytest
import torch
import torch.nn.functional as F

import dsv4_compile.kernels.indexer_topk  # noqa: F401  (registers the op)
from dsv4_compile.model.hotspots import gather_rows, indexer_topk_full_context, sparse_attention_with_sink
from dsv4_compile.passes import indexer
from helpers import BmmToMmOnCpu, TargetsBefore, compile_with_probe

SCALE = 128 ** -0.5


pytestmark = pytest.mark.usefixtures("fresh_inductor_cache")


def compile_with_pass(fn, **kwargs):
    return compile_with_probe(fn, indexer, **kwargs)


def model_step(q, weights, k_pages, page_table, positions, topk=16):
    """The model's call: visible = (positions + 1) // 4 computed outside the hot spot."""
    visible = (positions + 1) // 4
    return indexer_topk_full_context(q, weights, k_pages, page_table, visible, SCALE, topk)


def make_inputs(batch, tokens, dtype, seed, heads=8, dim=32, pages=7, max_pages=3, page=64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, heads, dim, generator=gen).to(dtype)
    weights = torch.randn(batch, tokens, heads, generator=gen) * heads ** -0.5
    k_pages = torch.randn(pages, page, dim, generator=gen).to(dtype)
    page_table = torch.randint(0, pages, (batch, max_pages), generator=gen, dtype=torch.int32)
    # Positions from nothing visible to past the page-table width (the op's lens are clamped).
    last = torch.randint(0, 4 * max_pages * page + 8, (batch, 1), generator=gen)
    positions = (last + torch.arange(tokens)).clamp(max=4 * max_pages * page + 8)
    positions[0] = torch.arange(tokens)  # request 0: at most one visible slot
    return q, weights, k_pages, page_table, positions


def same_selection(got, want):
    """The op's order is unspecified: compare the per-row index sets (random f32 data has no
    near-ties at this size, so the sets agree exactly) and the -1 count."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values)


@pytest.mark.parametrize("tokens", [1, 3])  # decode and verify
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_form_rewritten_and_matches_eager(tokens, dtype):
    compiled, report, hook = compile_with_pass(model_step)
    for seed in range(2):  # the second call reuses the compiled graph on fresh data
        args = make_inputs(2, tokens, dtype, seed)
        same_selection(compiled(*args), model_step(*args))
    assert report.count(indexer.PASS_NAME) == 1
    assert torch.ops.dsv4.indexer_topk.default in hook.targets
    assert torch.ops.aten.topk.default not in hook.targets
    assert torch.ops.aten.bmm.default not in hook.targets


def test_dynamic_batch_matches_with_symbolic_sizes():
    compiled, report, _ = compile_with_pass(model_step)
    args = make_inputs(3, 2, torch.float32, 5)
    for i in (0, 1, 3, 4):
        torch._dynamo.mark_dynamic(args[i], 0)
    same_selection(compiled(*args), model_step(*args))
    assert report.count(indexer.PASS_NAME) == 1


def _masked(top, visible):
    return torch.where(top >= visible.unsqueeze(-1), -1, top).to(torch.int32)


def _variant(activation=F.relu, sum_dim=2, topk_dim=-1, keys_at=1, tail=_masked, sort=True):
    """The hot spot with one piece changed; keys_at: where keys^T [B, D, S] gets the dim that
    broadcasts over the tokens (0: request t's keys score the query (b, t), legal when B == T)."""
    def step(q, weights, k_pages, page_table, positions, topk=16):
        visible = (positions + 1) // 4
        batch, _, _, head_dim = q.shape
        keys = k_pages[page_table.long()].reshape(batch, -1, head_dim)
        logits = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(keys_at))
        scores = activation(logits) * SCALE
        scores = (scores * weights.unsqueeze(-1)).sum(dim=sum_dim)
        slots = torch.arange(scores.shape[-1], device=scores.device)
        scores = scores.masked_fill(slots.view(1, 1, -1) >= visible.unsqueeze(-1), float("-inf"))
        top = scores.topk(topk, dim=topk_dim, sorted=sort).indices
        return tail(top, visible)
    return step


def _mask_too(top, visible):
    """The indices and the mask of the hidden ones, the mask in torch.topk's order."""
    hidden = top >= visible.unsqueeze(-1)
    return torch.where(hidden, -1, top).to(torch.int32), hidden


def _reading(reader):
    """model_step whose indices are read by `reader`."""
    return lambda *args: reader(model_step(*args))


@pytest.mark.parametrize("fn, kwargs, reason", [
    (_variant(activation=F.gelu), {}, "is not relu"),
    (_variant(sum_dim=1), dict(tokens=1), "sum over dims [1]"),
    (_variant(topk_dim=1), dict(tokens=16), "topk over dim 1"),
    (model_step, dict(page=32), "page size 32 != 64"),
    (model_step, dict(heads=2), "heads 2 not in [4, 128]"),
    (model_step, dict(dim=40), "head dim 40"),
    # B == T: the keys of request t score the query (b, t)
    (_variant(keys_at=0), {}, "requests mixed"),
    # readers of the top-k that depend on its order (the op's order is unspecified)
    (_reading(lambda idx: idx[..., 0]), {}, "aten.select.int"),
    (_reading(lambda idx: idx[..., :4]), {}, "takes part of the top-k indices by position"),
    (_reading(lambda idx: (idx >= 0).int().cumsum(-1)), {}, "aten.cumsum"),
    (_reading(lambda idx: idx * torch.arange(16)), {}, "varies along the top-k dim"),
    (_variant(tail=_mask_too), {}, "the top-k is also read by"),
])
def test_other_forms_declined(fn, kwargs, reason):
    compiled, report, hook = compile_with_pass(fn)
    opts = dict(batch=2, tokens=2, dtype=torch.float32, seed=3)
    opts.update(kwargs)
    args = make_inputs(**opts)
    for got, want in zip(*(torch.utils._pytree.tree_leaves(out) for out in (compiled(*args), fn(*args)))):
        assert torch.equal(got, want)  # untouched: inductor's own code, same order
    assert report.count(indexer.PASS_NAME) == 0
    assert torch.ops.dsv4.indexer_topk.default not in hook.targets
    (record,) = [r for r in report.records if r.pass_name == indexer.PASS_NAME]
    assert not record.matched and reason in record.reason, record.reason


def attend_step(q, weights, k_pages, page_table, positions, rows, sink):
    """The model's reader of the indices: attention over the selected rows (order-free)."""
    idx = model_step(q, weights, k_pages, page_table, positions)
    return sparse_attention_with_sink(q, gather_rows(rows, idx), idx >= 0, sink, SCALE)


@pytest.mark.parametrize("tokens", [1, 3])
def test_attention_over_the_selection_is_rewritten(tokens):
    compiled, report, hook = compile_with_pass(attend_step)
    gen = torch.Generator().manual_seed(8)
    args = make_inputs(2, tokens, torch.float32, 8) + (torch.randn(3 * 64, 32, generator=gen),
                                                   torch.randn(8, generator=gen))
    torch.testing.assert_close(compiled(*args), attend_step(*args))
    assert report.count(indexer.PASS_NAME) == 1
    assert torch.ops.dsv4.indexer_topk.default in hook.targets


def test_indices_written_into_a_graph_input_are_rewritten():
    """A copy into (part of) a graph input is an output: the caller gets the op's order."""
    def fn(q, weights, k_pages, page_table, positions, buffer):
        buffer[:, :q.shape[1]] = model_step(q, weights, k_pages, page_table, positions)

    compiled, report, hook = compile_with_pass(fn)
    args = make_inputs(2, 2, torch.float32, 9)
    got, want = torch.zeros(2, 4, 16, dtype=torch.int32), torch.zeros(2, 4, 16, dtype=torch.int32)
    compiled(*args, got)
    fn(*args, want)
    same_selection(got, want)
    assert report.count(indexer.PASS_NAME) == 1
    assert torch.ops.dsv4.indexer_topk.default in hook.targets


def test_unsorted_topk_readers_are_not_followed():
    """topk(sorted=False) leaves the order to the implementation: even idx[..., 0] may take the op's."""
    fn = _variant(sort=False, tail=lambda top, visible: _masked(top, visible)[..., 0])
    compiled, report, _ = compile_with_pass(fn)
    compiled(*make_inputs(2, 2, torch.float32, 3))
    assert report.count(indexer.PASS_NAME) == 1


def test_topk_above_2048_declined_with_reason():
    compiled, report, _ = compile_with_pass(lambda *a: model_step(*a, topk=4096))
    args = make_inputs(1, 1, torch.float32, 4, heads=4, dim=16, pages=64, max_pages=64)
    compiled(*args)
    (record,) = report.records
    assert not record.matched and record.reason == "topk 4096 > 2048"


def test_batch_one_bmm_made_mm_by_inductor_is_rewritten(monkeypatch):
    """On CUDA inductor turns the B=1 logits bmm into unsqueeze(mm(squeeze(q), squeeze(keys)), 0)."""
    bmm_to_mm = BmmToMmOnCpu(monkeypatch)
    before = TargetsBefore()
    compiled, report, hook = compile_with_pass(model_step)
    with torch._inductor.config.patch(post_grad_custom_pre_pass=before):
        for seed in range(2):
            args = make_inputs(1, 1, torch.bfloat16, seed)
            same_selection(compiled(*args), model_step(*args))
    assert bmm_to_mm.rewrites == 1
    assert torch.ops.aten.mm.default in before.targets and torch.ops.aten.bmm.default not in before.targets
    assert report.count(indexer.PASS_NAME) == 1
    assert torch.ops.dsv4.indexer_topk.default in hook.targets
    assert torch.ops.aten.mm.default not in hook.targets


def _mm_variant(squeeze_dim, unsqueeze_dim):
    """The B=1, T=1 logits as an mm that is not a batch-1 bmm's: q [1, 1, H, D] is squeezed at
    `squeeze_dim` of [H, 1, D] (1: a head-major view, not the batch), or the product is
    unsqueezed at `unsqueeze_dim`."""
    def step(q, weights, k_pages, page_table, positions, topk=16):
        visible = (positions + 1) // 4
        _, _, heads, head_dim = q.shape
        keys = k_pages[page_table.long()].reshape(1, -1, head_dim)
        query = q.reshape(heads, 1, head_dim) if squeeze_dim == 1 else q.reshape(1, heads, head_dim)
        logits = torch.mm(query.squeeze(squeeze_dim), keys.transpose(1, 2).squeeze(0))
        logits = logits.unsqueeze(unsqueeze_dim).reshape(1, 1, heads, -1)
        scores = (torch.relu(logits) * SCALE * weights.unsqueeze(-1)).sum(dim=2)
        slots = torch.arange(scores.shape[-1], device=scores.device)
        scores = scores.masked_fill(slots.view(1, 1, -1) >= visible.unsqueeze(-1), float("-inf"))
        top = scores.topk(topk, dim=-1).indices
        return torch.where(top >= visible.unsqueeze(-1), -1, top).to(torch.int32)
    return step


@pytest.mark.parametrize("squeeze_dim, unsqueeze_dim, reason", [
    (1, 0, "logits are an mm of operands that are not squeeze([1, m, k], 0)"),
    (0, 1, "logits are an mm unsqueezed at dim 1"),
])
def test_mm_that_is_not_a_batch_one_bmm_declined(squeeze_dim, unsqueeze_dim, reason):
    fn = _mm_variant(squeeze_dim, unsqueeze_dim)
    compiled, report, hook = compile_with_pass(fn)
    args = make_inputs(1, 1, torch.float32, 6)
    assert torch.equal(compiled(*args), fn(*args))
    assert torch.ops.dsv4.indexer_topk.default not in hook.targets
    (record,) = report.records
    assert not record.matched and reason in record.reason, record.reason


def test_a_float_visible_count_is_declined():
    """visible as a float (2.5 visible slots): the op takes integer lengths, so the pass declines (it
    would truncate to 2) and the compiled graph equals eager."""
    import torch.nn.functional as F
    from dsv4_compile.passes import indexer as indexer_pass
    from helpers import compile_with_probe

    def fn(q, weights, k_pages, page_table, positions):
        visible = ((positions + 1) // 4).float() + 0.5
        batch, _, _, head_dim = q.shape
        keys = k_pages[page_table.long()].reshape(batch, -1, head_dim)
        logits = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1))
        scores = (F.relu(logits) * weights.unsqueeze(-1)).sum(dim=2)
        slots = torch.arange(scores.shape[-1], device=scores.device)
        scores = scores.masked_fill(slots.view(1, 1, -1) >= visible.unsqueeze(-1), float("-inf"))
        top = scores.topk(16, dim=-1).indices
        return torch.where(top >= visible.unsqueeze(-1), -1, top).to(torch.int32)

    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 2, 8, 32, generator=gen), torch.randn(2, 2, 8, generator=gen),
            torch.randn(7, 64, 32, generator=gen), torch.randint(0, 7, (2, 3), generator=gen, dtype=torch.int32),
            torch.tensor([[10, 13], [21, 30]]))
    torch._dynamo.reset()
    compiled, report, probe = compile_with_probe(fn, indexer_pass)
    assert torch.equal(compiled(*args).sort(-1).values, fn(*args).sort(-1).values)
    assert probe.rewrites == 0
    assert any("not an integer count" in r.reason for r in report.records if not r.matched)
