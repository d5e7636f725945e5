"""passes/hc_sinkhorn.py: transformers' mHC Sinkhorn chain becomes one dsv4::hc_sinkhorn call with
the same result, chains used part-way are split, and chains that are not that math stay as they
are, with the reason recorded. (The counts inside the model's decode and verify graphs are
checked by tests/test_compiled_step.py.)"""
import pytest
import torch

from dsv4_compile.passes import hc_sinkhorn as hc_pass
from dsv4_compile.passes import manager
from dsv4_compile.passes.report import PassReport
from dsv4_compile.tiny import tiny_model
from helpers import PassProbe

EPS = 1e-6
OP = torch.ops.dsv4.hc_sinkhorn.default
# f32: the op's sums may add in another order than inductor's (tests/test_hc_sinkhorn.py), and
# inductor reorders the other reductions of the module (~1e-6 relative).
RTOL, ATOL = 1e-5, 1e-6


pytestmark = pytest.mark.usefixtures("fresh_inductor_cache")


class CallProbe(PassProbe):
    """PassProbe that also keeps the (iters, eps) of every hc_sinkhorn call after the pass:
    near convergence, iters - 1 rounds give almost the same matrices, so outputs cannot tell."""

    def __init__(self) -> None:
        super().__init__(hc_pass, PassReport())
        self.calls: list[tuple] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        super().__call__(graph)
        self.calls += [tuple(n.args[1:]) for n in graph.nodes if n.target == OP]


def compile_with_pass(fn):
    torch._dynamo.reset()
    probe = CallProbe()
    compiled = torch.compile(fn, backend="inductor", fullgraph=True,
                             options={"post_grad_custom_post_pass": probe})
    return compiled, probe, probe.report


def comb_input(*leading, n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*leading, n, n, generator=gen) * 3, dim=-1) + EPS


def normalise(x, dim, eps=EPS, keepdim=True):
    return x / (x.sum(dim=dim, keepdim=keepdim) + eps)


def sinkhorn(x, dims, eps=EPS):
    for dim in dims:
        x = normalise(x, dim, eps)
    return x


def declines(report):
    return [r.reason for r in report.records if not r.matched]


@pytest.mark.parametrize("iters", [2, 3, 20])
def test_transformers_hyper_connection_is_rewritten(iters):
    model = tiny_model(seed=iters, num_hidden_layers=1, layer_types=["sliding_attention"],
                       mlp_layer_types=["hash_moe"], hc_sinkhorn_iters=iters)
    module = model.model.layers[0].attn_hc
    hidden = torch.randn(2, 3, 4, 64, generator=torch.Generator().manual_seed(iters))
    compiled, probe, report = compile_with_pass(module)
    with torch.no_grad():
        got, want = compiled(hidden), module(hidden)
    assert probe.rewrites == 1 and report.count(hc_pass.PASS_NAME) == 1, report.format()
    assert probe.targets.count(OP) == 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL)
    assert probe.calls == [(iters, model.config.hc_eps)]


def test_single_column_normalisation_is_left_to_inductor():
    """hc_sinkhorn_iters = 1: one column step is no chain; nothing is recorded."""
    compiled, probe, report = compile_with_pass(lambda x: normalise(x, -2))
    x = comb_input(3)
    torch.testing.assert_close(compiled(x), normalise(x, -2))
    assert probe.rewrites == 0 and not report.records


@pytest.mark.parametrize("dims, iters", [((1, 2, 1), 2), ((-1, -2, -1, -2, -1, -2), 3)],
                         ids=["positive dims", "leading row"])
def test_positive_dims_and_a_leading_row_step(dims, iters):
    """Dims may be given as positive numbers; a leading row step stays a plain step before the call."""
    x = comb_input(3)
    compiled, probe, report = compile_with_pass(lambda x: sinkhorn(x, dims))
    torch.testing.assert_close(compiled(x), sinkhorn(x, dims), rtol=RTOL, atol=0)
    assert probe.rewrites == 1 and probe.targets.count(OP) == 1
    assert probe.calls == [(iters, EPS)]


def test_trailing_row_step_stays_plain():
    x = comb_input(5)
    dims = (-2, -1, -2, -1)
    compiled, probe, report = compile_with_pass(lambda x: sinkhorn(x, dims))
    torch.testing.assert_close(compiled(x), sinkhorn(x, dims), rtol=RTOL, atol=0)
    assert probe.rewrites == 1
    assert probe.calls == [(2, EPS)]


@pytest.mark.parametrize("used_after", [3, 4], ids=["after a column step", "after a row step"])
def test_intermediate_read_elsewhere_splits_the_chain(used_after):
    """Seven steps (4 rounds) whose step `used_after` is also returned: the chain ends there, so
    that value is still produced, and the rest is a chain of its own. Both parts are rewritten."""
    dims = (-2, -1, -2, -1, -2, -1, -2)

    def fn(x):
        middle = sinkhorn(x, dims[:used_after])
        return sinkhorn(middle, dims[used_after:]), middle

    x = comb_input(2, 3)
    compiled, probe, report = compile_with_pass(fn)
    for got, want in zip(compiled(x), fn(x)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
    assert probe.rewrites == 2 and probe.targets.count(OP) == 2, report.format()
    assert probe.calls == [(2, EPS), (2, EPS)]


def test_chain_after_a_rewritten_chain_reads_its_call():
    """A chain that starts at the end of another, rewritten one (read elsewhere too) reads that
    chain's call: no plain step of the first chain is left in the graph."""
    dims = (-2, -1, -2)

    def fn(x):
        first = sinkhorn(x, dims)
        return sinkhorn(first, dims), first

    x = comb_input(3)
    compiled, probe, report = compile_with_pass(fn)
    for got, want in zip(compiled(x), fn(x)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
    assert probe.rewrites == 2 and probe.targets.count(OP) == 2, report.format()
    assert torch.ops.aten.div.Tensor not in probe.targets


def test_different_eps_declined():
    fn = lambda x: normalise(normalise(normalise(x, -2), -1, eps=1e-5), -2)  # noqa: E731
    x = comb_input(3)
    compiled, probe, report = compile_with_pass(fn)
    torch.testing.assert_close(compiled(x), fn(x))
    assert probe.rewrites == 0 and OP not in probe.targets
    assert declines(report) == ["the steps use different eps (1e-06, 1e-05)"]


@pytest.mark.parametrize("eps", [-1e-3, float("inf")])
def test_eps_outside_the_ops_range_declined(eps):
    """eps < 0 or not finite: the op would refuse it, so the chain stays (compiling must not fail)."""
    fn = lambda x: sinkhorn(x, (-2, -1, -2), eps=eps)  # noqa: E731
    x = comb_input(3)
    compiled, probe, report = compile_with_pass(fn)
    torch.testing.assert_close(compiled(x), fn(x), equal_nan=True)
    assert probe.rewrites == 0 and OP not in probe.targets
    assert declines(report) == [f"eps {eps!r} is not a finite float >= 0 (the op's range)"]


def _no_keepdim(x):
    return normalise(normalise(normalise(x, -2), -1, keepdim=False), -2)


def _same_dim_twice(x):
    return sinkhorn(x, (-2, -2, -1, -2))


def _non_matrix_dim(x):
    return sinkhorn(x, (-2, 0, -2))


@pytest.mark.parametrize("fn, shape, dtype, reason", [
    (_no_keepdim, (4, 4, 4), torch.float32, "sums without keepdim"),  # [4, 4] broadcasts
    (_same_dim_twice, (3, 4, 4), torch.float32, "two consecutive normalisations over the same dim"),
    (_non_matrix_dim, (3, 4, 4), torch.float32, "normalises dim 0, not a matrix dim"),
    (lambda x: sinkhorn(x, (-2, -1, -2)), (3, 4, 8), torch.float32, "matrices are 4 x 8, not square"),
    (lambda x: sinkhorn(x, (-2, -1, -2)), (3, 32, 32), torch.float32, "n = 32 not in (1, 2, 4, 8, 16)"),
    (lambda x: sinkhorn(x, (-2, -1, -2)), (3, 4, 4), torch.bfloat16, "matrices are torch.bfloat16, not float32"),
    (lambda x: sinkhorn(x, (-2, -1)), (3, 4, 4), torch.float32, "fewer than two column normalisations"),
], ids=["no keepdim", "same dim twice", "non-matrix dim", "non-square", "n 32", "bf16", "one round"])
def test_other_math_declined(fn, shape, dtype, reason):
    gen = torch.Generator().manual_seed(1)
    x = (torch.rand(shape, generator=gen) + 0.1).to(dtype)
    compiled, probe, report = compile_with_pass(fn)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # inductor computes bf16 math in f32, eager rounds each step
    torch.testing.assert_close(compiled(x), fn(x), rtol=tol, atol=tol)
    assert probe.rewrites == 0 and OP not in probe.targets
    assert len(declines(report)) == 1 and reason in declines(report)[0], report.format()


def test_pass_sources_are_in_the_cache_key():
    files = {path.rsplit("/", 2)[-2] + "/" + path.rsplit("/", 1)[-1] for path in manager._source_files()}
    assert {"passes/hc_sinkhorn.py", "kernels/hc_sinkhorn.py"} <= files
    assert "dsv4_compile.passes.hc_sinkhorn" in manager.PassConfig().passes
