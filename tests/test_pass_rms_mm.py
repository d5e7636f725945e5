"""passes/rms_mm.py: f32 products of RMS-normed rows with a few columns -> dsv4::mm_sumsq."""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4UnweightedRMSNorm

from dsv4_compile.passes import rms_mm
from helpers import compile_with_probe

aten = torch.ops.aten
OP = torch.ops.dsv4.mm_sumsq.default

pytestmark = pytest.mark.usefixtures("fresh_inductor_cache")


def hc_mixes(streams, fn):
    """The mHC mapping's projection: RMS-normalised flattened streams (f32) @ fn^T."""
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)
    return F.linear(flat, fn.float())


_NORM = DeepseekV4UnweightedRMSNorm(eps=1e-6)


def transformers_mixes(streams, fn):
    """transformers' own mHC norm module (square, then .to(dtype)) as DeepseekV4HyperConnection and
    the hyper head call it on the flattened f32 streams."""
    return F.linear(_NORM(streams.flatten(1).float()), fn.float())


def f32_rows_mixes(rows, fn):
    """An RMS norm of f32 rows (no conversion), another eps, and the square as a product."""
    return F.linear(rows * torch.rsqrt((rows * rows).mean(-1, keepdim=True) + 1e-5), fn)


def weighted_norm_mixes(streams, fn, gamma):
    """A weighted RMS norm: not the unweighted form the op finishes."""
    flat = streams.flatten(1).float()
    return F.linear(flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma, fn)


def mean_over_rows_mixes(streams, fn):
    """The statistics over the rows (dim 0), not over the K columns the mm reduces."""
    flat = streams.flatten(1).float()
    return F.linear(flat * torch.rsqrt(flat.pow(2).mean(0, keepdim=True) + 1e-6), fn)


def plain_mixes(streams, fn):
    """No norm at all."""
    return F.linear(streams.flatten(1).float(), fn)


def mean_over_all_mixes(streams, fn):
    """The statistics over every element (aten.mean.dim with dim None), not per row."""
    flat = streams.flatten(1).float()
    return F.linear(flat * torch.rsqrt(flat.pow(2).mean(dim=None, keepdim=True) + 1e-6), fn)


def _inputs(tokens, hidden, columns, seed):
    gen = torch.Generator().manual_seed(seed)
    streams = torch.randn(tokens, 4, hidden, generator=gen).to(torch.bfloat16)
    fn = torch.randn(columns, 4 * hidden, generator=gen) * (4 * hidden) ** -0.5
    return streams, fn


def _assert_close_f32(got, want, a, b):
    """f32 with another summation order (3xTF32 products on the GPU, f32 dots in the interpreter):
    within 1e-5 of sum_k |a_k b_k| per output, as test_pass_skinny_mm states it."""
    bound = (a.abs() @ b.abs().t()) * 1e-5
    assert ((got - want).abs() <= bound + 1e-30).all()


def _normed(streams, eps=1e-6):
    flat = streams.flatten(1).float()
    return flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("fn_under_test", [hc_mixes, transformers_mixes])
@pytest.mark.parametrize("tokens, columns", [(8, 24), (64, 24), (9, 4)])  # mHC layers, hyper head
def test_mhc_projection_rewritten_and_matches(fn_under_test, tokens, columns):
    compiled, report, probe = compile_with_probe(fn_under_test, rms_mm)
    for seed in range(2):
        streams, fn = _inputs(tokens, 1024, columns, seed)
        _assert_close_f32(compiled(streams, fn), fn_under_test(streams, fn), _normed(streams), fn)
    assert report.count(rms_mm.PASS_NAME) == 1
    assert aten.mm.default not in probe.targets and OP in probe.targets


def batched_swapped_mixes(streams, fn):
    """[B, T, 4, hidden] streams (F.linear on 3-D rows: a reshape before the mm), eps before the mean,
    the norm's factor as the product's first operand."""
    flat = streams.flatten(2).float()
    return F.linear(torch.rsqrt(1e-6 + flat.pow(2).mean(-1, keepdim=True)) * flat, fn)


def test_batched_rows_and_swapped_operands():
    compiled, report, probe = compile_with_probe(batched_swapped_mixes, rms_mm)
    streams, fn = _inputs(12, 512, 24, 17)
    streams = streams.view(3, 4, 4, 512)
    got = compiled(streams, fn)
    assert got.shape == (3, 4, 24)
    _assert_close_f32(got.view(12, 24), batched_swapped_mixes(streams, fn).view(12, 24),
                      _normed(streams.view(12, 4, 512)), fn)
    assert report.count(rms_mm.PASS_NAME) == 1 and OP in probe.targets


def test_f32_rows_and_another_eps():
    compiled, report, probe = compile_with_probe(f32_rows_mixes, rms_mm)
    gen = torch.Generator().manual_seed(11)
    rows, fn = torch.randn(10, 2048, generator=gen), torch.randn(24, 2048, generator=gen) * 2048 ** -0.5
    normed = rows * torch.rsqrt((rows * rows).mean(-1, keepdim=True) + 1e-5)
    _assert_close_f32(compiled(rows, fn), f32_rows_mixes(rows, fn), normed, fn)
    assert report.count(rms_mm.PASS_NAME) == 1 and OP in probe.targets


@pytest.mark.parametrize("fn_under_test", [weighted_norm_mixes, mean_over_rows_mixes, plain_mixes,
                                           mean_over_all_mixes])
def test_other_rows_left_alone(fn_under_test):
    compiled, report, probe = compile_with_probe(fn_under_test, rms_mm)
    streams, fn = _inputs(12, 512, 24, 12)
    args = (streams, fn) if fn_under_test is not weighted_norm_mixes else (
        streams, fn, torch.rand(2048, generator=torch.Generator().manual_seed(13)) + 0.5)
    torch.testing.assert_close(compiled(*args), fn_under_test(*args), rtol=1e-4, atol=1e-4)
    assert report.count(rms_mm.PASS_NAME) == 0 and not report.records
    assert OP not in probe.targets and aten.mm.default in probe.targets


@pytest.mark.parametrize("tokens, columns, reason", [(128, 24, "128 rows > 64"), (8, 64, None), (8, 24, None),
                                                    (rms_mm.MIN_ROWS - 1, 24, None), (1, 4, None)])
def test_sizes_outside_the_op(tokens, columns, reason):
    """128 rows: declined; 64 columns: not a candidate; K = 4 x 96 < 64 x 24: not a candidate; fewer
    than MIN_ROWS rows (one decode token; the hyper head at B=1): not a candidate, left to skinny_mm."""
    compiled, report, probe = compile_with_probe(hc_mixes, rms_mm)
    short = columns == 24 and reason is None and tokens == 8
    streams, fn = _inputs(tokens, 96 if short else 1024, columns, 14)
    _assert_close_f32(compiled(streams, fn), hc_mixes(streams, fn), _normed(streams), fn)
    assert report.count(rms_mm.PASS_NAME) == 0 and OP not in probe.targets
    declines = [r.reason for r in report.records if not r.matched]
    assert len(declines) == (reason is not None) and all(reason in d for d in declines), declines


def test_no_columns_left_alone():
    """A weight of zero rows: no product for the op (which takes 1 to MAX_COLUMNS), and no crash."""
    compiled, report, probe = compile_with_probe(hc_mixes, rms_mm)
    streams, fn = _inputs(12, 512, 0, 16)
    assert compiled(streams, fn).shape == (12, 0)
    assert report.count(rms_mm.PASS_NAME) == 0 and OP not in probe.targets


def test_symbolic_rows_declined():
    compiled, report, probe = compile_with_probe(hc_mixes, rms_mm)
    for tokens in (5, 7):
        streams, fn = _inputs(tokens, 512, 24, tokens)
        torch._dynamo.mark_dynamic(streams, 0)
        _assert_close_f32(compiled(streams, fn), hc_mixes(streams, fn), _normed(streams), fn)
    assert report.count(rms_mm.PASS_NAME) == 0
    assert any(r.reason == "sizes are symbolic" for r in report.records)


def test_without_triton_left_alone(monkeypatch):
    """No CUDA and no interpreter: the op would be its torch reference, so the pass does not match."""
    monkeypatch.delenv("TRITON_INTERPRET")
    compiled, report, probe = compile_with_probe(hc_mixes, rms_mm)
    streams, fn = _inputs(12, 512, 24, 15)
    _assert_close_f32(compiled(streams, fn), hc_mixes(streams, fn), _normed(streams), fn)
    assert report.count(rms_mm.PASS_NAME) == 0 and OP not in probe.targets
