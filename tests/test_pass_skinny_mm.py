"""passes/skinny_mm.py: f32 mm with a few output columns and a long reduction -> mul + sum."""
import pytest
import torch
import torch.nn.functional as F

from dsv4_compile.passes import skinny_mm
from helpers import compile_with_probe

aten = torch.ops.aten


pytestmark = pytest.mark.usefixtures("fresh_inductor_cache")


def hc_mixes(streams, fn):
    """The mHC mapping's projection: RMS-normalised flattened streams (f32) @ fn^T."""
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)
    return F.linear(flat, fn.float())


def linear(x, w):
    return F.linear(x, w)


def _inputs(tokens, hidden, columns, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    streams = torch.randn(tokens, 4, hidden, generator=gen).to(torch.bfloat16)
    fn = (torch.randn(columns, 4 * hidden, generator=gen) * (4 * hidden) ** -0.5).to(dtype)
    return streams, fn


def _assert_close_f32(got, want, a, b):
    """f32 with a different summation order: within 1e-5 of sum_k |a_k b_k| per output. Any order's
    rounding error is at most ~K * 2**-24 of that sum in the worst case (2.4e-4 at K = 4096) and
    grows like sqrt(K) * 2**-24 (~4e-6) for random signs; 1e-5 is that typical size with margin."""
    bound = (a.abs() @ b.abs().t()) * 1e-5
    assert ((got - want).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("tokens, columns", [(1, 24), (64, 24), (3, 4)])  # mHC layers, hyper head
def test_hc_projection_rewritten_and_matches(tokens, columns):
    compiled, report, probe = compile_with_probe(hc_mixes, skinny_mm)
    for seed in range(2):
        streams, fn = _inputs(tokens, 1024, columns, seed)
        flat = streams.flatten(1).float()
        flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)
        _assert_close_f32(compiled(streams, fn), hc_mixes(streams, fn), flat, fn)
    assert report.count(skinny_mm.PASS_NAME) == 1
    assert aten.mm.default not in probe.targets and aten.sum.dim_IntList in probe.targets


@pytest.mark.parametrize(
    "shape_a, shape_w, dtype, reason",
    [((8, 4096), (24, 4096), torch.bfloat16, None),  # not f32: not a candidate
     ((8, 4096), (64, 4096), torch.float32, None),  # 64 columns: not a candidate
     ((8, 1024), (24, 1024), torch.float32, None),  # reduction < 64 x 24: not a candidate
     ((128, 4096), (24, 4096), torch.float32, "128 rows > 64")],
)
def test_other_products_left_alone(shape_a, shape_w, dtype, reason):
    compiled, report, probe = compile_with_probe(linear, skinny_mm)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(*shape_a, generator=gen).to(dtype)
    w = torch.randn(*shape_w, generator=gen).to(dtype)
    torch.testing.assert_close(compiled(x, w), linear(x, w), rtol=1e-2 if dtype == torch.bfloat16 else 1e-4,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-3)
    assert report.count(skinny_mm.PASS_NAME) == 0
    assert aten.mm.default in probe.targets
    declines = [r.reason for r in report.records if not r.matched]
    assert len(declines) == (reason is not None), declines
    if reason is not None:
        assert reason in declines[0]


def test_symbolic_rows_declined():
    compiled, report, probe = compile_with_probe(linear, skinny_mm)
    gen = torch.Generator().manual_seed(6)
    for rows in (5, 7):
        x, w = torch.randn(rows, 4096, generator=gen), torch.randn(24, 4096, generator=gen)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x, w), linear(x, w), rtol=1e-4, atol=1e-3)
    assert report.count(skinny_mm.PASS_NAME) == 0
    assert any(r.reason == "sizes are symbolic" for r in report.records)
