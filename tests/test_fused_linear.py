"""FusedLinear: one product over several projections of one input, and its use in the step."""
import pytest
import torch
from torch import nn

import dsv4_compile
from dsv4_compile.model.fused_linear import FusedLinear
from dsv4_compile.tiny import tiny_model
from helpers import make_prompts

# bf16: the fused and the separate products both sum in f32 and round once, but the CPU GEMM may
# block the reduction differently for the wider weight: at most one bf16 rounding step apart,
# 2**-7 of the output's scale (bf16 has 8 significant bits).
BF16_TOL = 2 ** -7


def _linear(fan_in: int, fan_out: int, dtype: torch.dtype, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(fan_in, fan_out, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_outputs_equal_each_layer(dtype):
    linears = {"a": _linear(64, 48, dtype, seed=1), "b": _linear(64, 16, dtype, seed=2),
               "c": _linear(64, 80, dtype, seed=3)}
    fused = FusedLinear(linears)
    assert len(fused.groups) == 1 and len(fused.single) == 0
    x = torch.randn(5, 3, 64).to(dtype)
    out = fused(x)
    assert set(out) == set(linears)
    for name, lin in linears.items():
        expected = lin(x)
        assert out[name].shape == expected.shape and out[name].dtype == expected.dtype
        tol = 1e-5 if dtype == torch.float32 else BF16_TOL
        assert (out[name] - expected).abs().max() <= tol * expected.abs().max()


def test_bias_and_lone_dtype_layers_run_as_they_are():
    linears = {"a": _linear(32, 8, torch.bfloat16, seed=1), "b": _linear(32, 8, torch.bfloat16, seed=2),
               "biased": _linear(32, 8, torch.bfloat16, bias=True, seed=3),
               "f32": _linear(32, 8, torch.float32, seed=4)}
    fused = FusedLinear(linears)
    assert [names for _, names, _ in fused.groups] == [("a", "b")]
    assert set(fused.single) == {"biased", "f32"}
    del linears["f32"]  # one input has one dtype: call it without the f32 layer
    fused = FusedLinear(linears)
    x = torch.randn(4, 32).bfloat16()
    out = fused(x)
    assert torch.equal(out["biased"], linears["biased"](x))
    for name in ("a", "b"):
        assert (out[name] - linears[name](x)).abs().max() <= BF16_TOL * linears[name](x).abs().max()


class _ScaledLinear(nn.Linear):
    """A Linear subclass whose forward is not F.linear(x, weight) (as an FP8 layer with scales)."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_only_plain_linears_are_fused():
    """Subclasses, layers with hooks and float8 weights run their own forward."""
    torch.manual_seed(0)
    scaled = _ScaledLinear(32, 8, bias=False)
    hooked = _linear(32, 8, torch.float32, seed=5)
    hooked.register_forward_hook(lambda module, args, out: out + 1)
    fp8 = _linear(32, 8, torch.float32, seed=6)
    fp8.weight.data = fp8.weight.data.to(torch.float8_e4m3fn)
    linears = {"a": _linear(32, 8, torch.float32, seed=1), "b": _linear(32, 8, torch.float32, seed=2),
               "scaled": scaled, "hooked": hooked, "fp8": fp8}
    fused = FusedLinear(linears)
    assert [names for _, names, _ in fused.groups] == [("a", "b")]
    assert set(fused.single) == {"scaled", "hooked", "fp8"}
    del fused.single["fp8"]  # F.linear has no float8 kernel on CPU; it only had to stay unfused
    x = torch.randn(4, 32)
    out = fused(x)
    for name in ("scaled", "hooked"):
        assert torch.equal(out[name], linears[name](x))


def test_layers_of_different_widths_are_refused():
    with pytest.raises(ValueError, match="in_features"):
        FusedLinear({"a": _linear(32, 8, torch.float32), "b": _linear(16, 8, torch.float32)})


def test_step_calls_no_fused_projection_layer():
    """In steps of the tiny model (every layer type), the input projections of attention, the
    compressors and the indexer, and the shared experts' gate and up, run only as fused products
    (none of those layers' forwards is called). That each fused output feeds its layer's consumer
    is test_model_parity's check: the step's logits against transformers' in fp32."""
    model = tiny_model(seed=0)
    engine = dsv4_compile.optimize(model, max_batch=2, max_context=256, compile=False)
    fused_layers = []
    for attention in engine.module.attention:
        fused_layers += [lin for _, names, _ in attention.projections.groups
                         for lin in (attention._input_projections()[n] for n in names)]
    for shared in engine.module.shared:
        fused_layers += [shared.mlp.gate_proj, shared.mlp.up_proj]
    layer_types = {a.layer_type for a in engine.module.attention}
    assert len(layer_types) == 3, layer_types
    # q_a + kv per layer, 2 more per compressed layer, 3 more per CSA layer, 2 per shared expert
    expected = sum(2 + 2 * (a.compressor is not None) + 3 * (a.index_compressor is not None)
                   for a in engine.module.attention) + 2 * len(engine.module.shared)
    assert len(fused_layers) == expected
    calls = []
    hooks = [lin.register_forward_hook(lambda *_: calls.append(1)) for lin in fused_layers]
    try:
        prompts = make_prompts((20, 9), model.config.vocab_size, seed=1)
        tokens = engine.generate(prompts, 3)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == []
    assert all(len(t) == 3 for t in tokens)
