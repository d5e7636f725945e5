"""lowerings/fp4_moe.py: under the dsv4 backend, dsv4::fp4_moe becomes an extern call to
dsv4::fp4_moe_pairs plus a masked sum over the k choices that inductor fuses with the consumer
(here `+ shared`, as in the model's `routed + shared_expert(x)`) into one generated kernel.

The pairs rows of skipped choices are poisoned with NaN (the op leaves them unspecified), so a
lowering that forgot the -1 mask fails the comparison.
"""
import re

import pytest
import torch
from torch._inductor.lowering import lowerings
from torch._inductor.utils import run_and_get_code

from dsv4_compile.backend import Dsv4Backend
from dsv4_compile.kernels import fp4_moe as fp4_kernels
from dsv4_compile.lowerings import fp4_moe as fp4_lowering
from dsv4_compile.passes import manager
from dsv4_compile.passes.manager import PassConfig
from helpers import make_experts

EXPERTS, HIDDEN, INTER, TOKENS, TOP_K = 4, 64, 32, 3, 6
MODULE = "dsv4_compile.lowerings.fp4_moe"
# f32: the lowering and the eager op add the same f32 per-pair rows, only the order may differ.
# bf16: eager rounds the MoE output to bf16 and then the sum with `shared`; the fused kernel keeps
# the MoE sum in f32 through the add and rounds once. Two roundings of at most 2^-8 relative each: 2e-2
# relative (plus 2e-2 absolute for outputs near 0) is a loose bound that still fails on a NaN row
# or on most elements of a dropped choice (one choice's row averages 0.02 to 0.4 in |value| here).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


pytestmark = pytest.mark.usefixtures("fresh_compile")


@pytest.fixture(autouse=True)
def nan_poisoned_pairs(monkeypatch):
    """Every fp4_moe_pairs launch writes into a NaN-filled buffer: unwritten rows stay NaN."""
    launch = fp4_kernels.fp4_moe_pairs_triton

    def poisoned(x, topk_ids, *args, **kwargs):
        pairs = torch.full((topk_ids.numel(), x.shape[1]), float("nan"), device=x.device)
        return launch(x, topk_ids, *args, pair_out=pairs, **kwargs)

    monkeypatch.setattr(fp4_kernels, "fp4_moe_pairs_triton", poisoned)


def moe_inputs(fmt, dtype, seed=0):
    w = make_experts(fmt, EXPERTS, HIDDEN, INTER, seed)
    w13, s13, w2, s2, g13, g2 = (w[k] for k in ("w13", "w13_scale", "w2", "w2_scale", "w13_global", "w2_global"))
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype)
    ids = torch.randint(0, EXPERTS, (TOKENS, TOP_K), generator=gen, dtype=torch.int32)
    ids[0, 1] = ids[2, 0] = ids[2, 5] = -1  # experts on another rank
    weights = torch.rand(TOKENS, TOP_K, generator=gen) + 0.1
    shared = torch.randn(TOKENS, HIDDEN, generator=gen).to(dtype)
    return (x, ids, weights, w13, s13, w2, s2, fmt, g13, g2), shared


def routed_plus_shared(x, ids, weights, w13, s13, w2, s2, fmt, g13, g2, shared):
    return torch.ops.dsv4.fp4_moe(x, ids, weights, w13, s13, w2, s2, fmt, g13, g2, 10.0) + shared


def compile_and_run(moe_args, shared):
    """(output, generated code) under the dsv4 backend with no FX passes (the op is already there)."""
    compiled = torch.compile(routed_plus_shared, backend=Dsv4Backend(PassConfig(passes=())), fullgraph=True)
    out, code = run_and_get_code(compiled, *moe_args, shared)
    return out, "\n".join(code)


def wrapper_body(code):
    """The statements of the generated wrapper's call(): what runs at each step."""
    match = re.search(r"^    def call\(self, args\):\n(.*?)^\s+return ", code, flags=re.M | re.S)
    assert match, "no call() in the generated code"
    return match.group(1)


def kernel_calls(code):
    """Names and argument lists of the generated kernels called in the wrapper."""
    return re.findall(r"^\s+(cpp_fused_\w+|triton_\w+)\((.*)\)\s*$", code, flags=re.M)


def pairs_buffers(code):
    """The buffer names bound to fp4_moe_pairs' output, aliases included."""
    names = set(re.findall(r"^\s+(buf\d+) = torch\.ops\.dsv4\.fp4_moe_pairs\.default\(", code, flags=re.M))
    for alias, source in re.findall(r"^\s+(buf\d+) = (buf\d+)\s*$", code, flags=re.M):
        if source in names:
            names.add(alias)
    return names


@pytest.mark.parametrize("fmt, dtype", [("mxfp4", torch.float32), ("nvfp4", torch.bfloat16)])
def test_sum_fuses_with_consumer(fmt, dtype):
    assert MODULE in manager.LOWERING_MODULES
    moe_args, shared = moe_inputs(fmt, dtype)
    out, code = compile_and_run(moe_args, shared)

    body = wrapper_body(code)
    # the only op call is the experts; nothing else (no fp4_moe, no aten fallback) is extern
    assert re.findall(r"torch\.ops\.[\w.]+\(", body) == ["torch.ops.dsv4.fp4_moe_pairs.default("]
    assert "extern_kernels." not in body
    calls = kernel_calls(body)
    assert len(calls) == 1, calls  # the masked sum, the cast and the add: one kernel
    name, args = calls[0]
    assert "fp4_moe" in name and "add" in name
    assert pairs_buffers(body) & set(re.findall(r"\w+", args))  # it reads the pairs directly

    expected = routed_plus_shared(*moe_args, shared)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, expected, **TOL[dtype])
    reference = fp4_kernels.fp4_moe_reference(*moe_args, 10.0).float() + shared.float()
    torch.testing.assert_close(out.float(), reference, **TOL[dtype])


def test_without_lowering_calls_the_op(monkeypatch):
    fp4_lowering.register()  # installed now, so the removal below is undone after the test
    monkeypatch.setattr(manager, "LOWERING_MODULES", ())
    monkeypatch.delitem(lowerings, torch.ops.dsv4.fp4_moe.default)
    moe_args, shared = moe_inputs("mxfp4", torch.float32, seed=1)
    out, code = compile_and_run(moe_args, shared)

    body = wrapper_body(code)
    assert "torch.ops.dsv4.fp4_moe.default(" in body
    assert "fp4_moe_pairs" not in code
    torch.testing.assert_close(out, routed_plus_shared(*moe_args, shared), **TOL[torch.float32])
