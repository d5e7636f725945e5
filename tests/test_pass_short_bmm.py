"""passes/short_bmm.py: products with a reduction of at most 8 -> broadcast multiply + sum."""
import pytest
import torch

from dsv4_compile.passes import short_bmm
from helpers import BmmToMmOnCpu, compile_with_probe

aten = torch.ops.aten

pytestmark = pytest.mark.usefixtures("fresh_inductor_cache")


def hc_mix(post, attn, comb, streams):
    """transformers' mHC residual update: post (x) attn + comb^T @ streams, per token."""
    return post.unsqueeze(-1) * attn.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)


def product(a, b):
    return torch.matmul(a, b)


def _mix_inputs(batch, tokens, hc, hidden, seed):
    gen = torch.Generator().manual_seed(seed)
    post = torch.rand(batch, tokens, hc, generator=gen) * 2
    attn = torch.randn(batch, tokens, hidden, generator=gen)
    comb = torch.softmax(torch.randn(batch, tokens, hc, hc, generator=gen), dim=-1)
    streams = torch.randn(batch, tokens, hc, hidden, generator=gen)
    return [t.to(torch.bfloat16) for t in (post, attn, comb, streams)]


def _assert_within_bf16(got, inputs):
    """Against the f32 evaluation of the same bf16 inputs. Eager rounds to bf16 (relative 2**-9)
    three times (post * attn, the matmul, the sum), the rewritten graph once or twice: at most
    three roundings of terms no larger than |post * attn| + sum_j |comb| |streams|, so the bound
    is 2**-7 of that magnitude."""
    post, attn, comb, streams = (t.float() for t in inputs)
    want = hc_mix(post, attn, comb, streams)
    magnitude = (post.unsqueeze(-1) * attn.unsqueeze(-2)).abs() + comb.abs().transpose(-1, -2) @ streams.abs()
    assert ((got.float() - want).abs() <= magnitude * 2.0 ** -7 + 1e-6).all()


@pytest.mark.parametrize("batch, tokens", [(3, 1), (2, 4)])  # decode and verify
def test_hc_mix_rewritten_and_matches(batch, tokens):
    compiled, report, probe = compile_with_probe(hc_mix, short_bmm)
    for seed in range(2):
        inputs = _mix_inputs(batch, tokens, 4, 256, seed)
        got = compiled(*inputs)
        _assert_within_bf16(got, inputs)
        _assert_within_bf16(hc_mix(*inputs), inputs)  # eager meets the same bound
    assert report.count(short_bmm.PASS_NAME) == 1
    assert aten.bmm.default not in probe.targets and aten.sum.dim_IntList in probe.targets


def test_batch_one_mm_form_rewritten(monkeypatch):
    """On CUDA inductor turns a batch-1 bmm into mm (bmm_to_mm); forced on CPU here."""
    bmm_to_mm = BmmToMmOnCpu(monkeypatch)
    compiled, report, probe = compile_with_probe(hc_mix, short_bmm)
    inputs = _mix_inputs(1, 1, 4, 128, seed=3)
    _assert_within_bf16(compiled(*inputs), inputs)
    assert bmm_to_mm.rewrites >= 1
    assert report.count(short_bmm.PASS_NAME) == 1
    assert aten.mm.default not in probe.targets and aten.bmm.default not in probe.targets


@pytest.mark.parametrize("k", [2, 8])
def test_f32_products_up_to_max_reduction(k):
    compiled, report, _ = compile_with_probe(product, short_bmm)
    gen = torch.Generator().manual_seed(k)
    a, b = torch.randn(5, 7, k, generator=gen), torch.randn(5, k, 33, generator=gen)
    # f32, at most 8 terms in another order: within a few f32 ulps of sum |a||b|
    bound = (a.abs() @ b.abs()) * 2.0 ** -20
    assert ((compiled(a, b) - a @ b).abs() <= bound).all()
    assert report.count(short_bmm.PASS_NAME) == 1


@pytest.mark.parametrize("k, dynamic_k", [(9, False), (64, False), (4, True)])
def test_other_products_left_alone(k, dynamic_k):
    compiled, report, probe = compile_with_probe(product, short_bmm)
    gen = torch.Generator().manual_seed(11)
    for depth in ((k, k + 1) if dynamic_k else (k,)):
        a, b = torch.randn(3, 6, depth, generator=gen), torch.randn(3, depth, 10, generator=gen)
        if dynamic_k:
            torch._dynamo.mark_dynamic(a, 2)
            torch._dynamo.mark_dynamic(b, 1)
        torch.testing.assert_close(compiled(a, b), a @ b, rtol=1e-5, atol=1e-5)
    assert report.count(short_bmm.PASS_NAME) == 0 and not report.records
    assert aten.bmm.default in probe.targets


def test_integer_products_left_alone():
    compiled, report, probe = compile_with_probe(product, short_bmm)
    gen = torch.Generator().manual_seed(12)
    a, b = torch.randint(-9, 9, (2, 3, 4), generator=gen), torch.randint(-9, 9, (2, 4, 5), generator=gen)
    assert torch.equal(compiled(a, b), a @ b)
    assert report.count(short_bmm.PASS_NAME) == 0
