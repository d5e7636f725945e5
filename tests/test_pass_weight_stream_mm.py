"""passes/weight_stream_mm.py: a few rows against a very large row-major weight -> dsv4::weight_stream_mm."""
import pytest
import torch
import torch.nn.functional as F

from dsv4_compile.passes import weight_stream_mm
from helpers import compile_with_probe
from test_weight_stream_mm import assert_close_rounded, make

aten = torch.ops.aten
OP = torch.ops.dsv4.weight_stream_mm.default

pytestmark = pytest.mark.usefixtures("fresh_inductor_cache")


def normed(hidden):
    return hidden * torch.rsqrt(hidden.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(hidden.dtype)


def lm_head(hidden, weight):
    """The decode head: RMS-normalised hidden states @ the vocabulary weight^T."""
    return F.linear(normed(hidden), weight)


@pytest.fixture
def small_thresholds(monkeypatch):
    """Weights of the tests' sizes count as large (the real thresholds need a 256 MB weight)."""
    monkeypatch.setattr(weight_stream_mm, "MIN_WEIGHT_BYTES", 64 * 200 * 2)
    monkeypatch.setattr(weight_stream_mm, "MIN_COLUMNS", 200)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_lm_head_rewritten_and_matches(small_thresholds, rows):
    compiled, report, probe = compile_with_probe(lm_head, weight_stream_mm)
    # the graph before the pass: inductor keeps the norm's product in f32 up to the mm's bf16 input,
    # so the eager head's rounding differs; both graphs give the product the same bf16 input
    before = torch.compile(lm_head, backend="inductor", fullgraph=True)
    for seed in range(2):
        hidden, weight = make(rows, 300, 64, torch.bfloat16, seed=10 * rows + seed)
        assert_close_rounded(compiled(hidden, weight), before(hidden, weight), normed(hidden), weight)
    assert report.count(weight_stream_mm.PASS_NAME) == 1 and probe.rewrites == 1
    assert OP in probe.targets and aten.mm.default not in probe.targets


def linear(x, w):
    return F.linear(x, w)


def matmul(x, w):
    return x @ w


@pytest.mark.parametrize("fn, shape_x, shape_w, dtype, reason", [
    (linear, (4, 64), (300, 64), torch.float32, None),  # f32: not a candidate
    (linear, (4, 128), (199, 128), torch.bfloat16, None),  # fewer columns than MIN_COLUMNS: not a candidate
    (linear, (4, 32), (300, 32), torch.bfloat16, None),  # fewer weight bytes than MIN_WEIGHT_BYTES: not a candidate
    (linear, (65, 64), (300, 64), torch.bfloat16, "65 rows > 64"),
    (matmul, (4, 64), (64, 300), torch.bfloat16, "not the transpose of a row-major [N, K] weight"),
])
def test_other_products_left_alone(small_thresholds, fn, shape_x, shape_w, dtype, reason):
    compiled, report, probe = compile_with_probe(fn, weight_stream_mm)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(*shape_x, generator=gen).to(dtype)
    w = (torch.randn(*shape_w, generator=gen) * 0.125).to(dtype)
    torch.testing.assert_close(compiled(x, w), fn(x, w), rtol=1e-2, atol=1e-2)
    assert report.count(weight_stream_mm.PASS_NAME) == 0 and OP not in probe.targets
    assert aten.mm.default in probe.targets
    declines = [r.reason for r in report.records if not r.matched]
    assert len(declines) == (reason is not None), declines
    if reason is not None:
        assert reason in declines[0]


def test_symbolic_rows_declined(small_thresholds):
    compiled, report, probe = compile_with_probe(linear, weight_stream_mm)
    for rows in (5, 7):
        x, w = make(rows, 300, 64, torch.bfloat16, seed=rows)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x, w), linear(x, w), rtol=1e-2, atol=1e-2)
    assert report.count(weight_stream_mm.PASS_NAME) == 0
    assert any(r.reason == "sizes are symbolic" for r in report.records)


def test_real_thresholds_take_the_lm_head_and_leave_q_b():
    """At the module's own thresholds: V4-Flash's LM head (129,280 x 4,096 bf16, 1 GB) is rewritten, its
    q_b projection (32,768 x 1,024, 64 MB) is not even a candidate. On fake tensors, weights seen as
    the transposes of row-major tensors as F.linear passes them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dsv4_compile.passes.report import PassReport

    graph = torch.fx.Graph()
    with FakeTensorMode():
        sizes = {"lm_head": (129280, 4096), "q_b": (32768, 1024)}
        products = []
        for name, (columns, depth) in sizes.items():
            x = graph.placeholder(f"x_{name}")
            x.meta["val"] = torch.empty(64, depth, dtype=torch.bfloat16)
            w = graph.placeholder(f"w_{name}")
            w.meta["val"] = torch.empty(columns, depth, dtype=torch.bfloat16).t()
            product = graph.call_function(aten.mm.default, (x, w))
            product.meta["val"] = torch.mm(x.meta["val"], w.meta["val"])
            products.append(product)
        graph.output(tuple(products))
        report = PassReport()
        assert weight_stream_mm.apply(graph, report) == 1
    assert [(r.matched, r.reason) for r in report.records] == [(True, "[64, 4096] @ [4096, 129280]")]
    assert [n.target for n in graph.nodes if n.op == "call_function"].count(aten.mm.default) == 1


def test_no_rewrite_where_the_kernel_cannot_run(small_thresholds, monkeypatch):
    """On a CPU without the Triton interpreter the op would be its reference (an f32 copy of the
    weight per call): the product stays an mm and nothing is recorded."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    compiled, report, probe = compile_with_probe(linear, weight_stream_mm)
    x, w = make(4, 300, 64, torch.bfloat16, seed=3)
    torch.testing.assert_close(compiled(x, w), linear(x, w), rtol=1e-2, atol=1e-2)
    assert report.records == [] and OP not in probe.targets and aten.mm.default in probe.targets
