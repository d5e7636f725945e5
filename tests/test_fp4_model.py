"""FP4 experts in the model: transformers with Fp4Experts == the static step, both formats."""
import pytest
import torch

import dsv4_compile
from dsv4_compile.model.fp4_experts import Fp4Experts, quantize_experts_
from dsv4_compile.tiny import tiny_model
from helpers import make_prompts, transformers_greedy

NEW_TOKENS = 12


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_experts_generate_like_transformers(fmt):
    model = tiny_model(seed=4)
    dense = [layer.mlp.experts.gate_up_proj.detach().clone() for layer in model.model.layers]
    quantize_experts_(model, fmt)
    for layer, before in zip(model.model.layers, dense):
        experts = layer.mlp.experts
        assert isinstance(experts, Fp4Experts) and experts.w13.dtype == torch.uint8
        gate_up, _ = experts.dequantized(torch.float32)
        # e2m1 keeps 1 mantissa bit: the round trip is within a quarter of each block's scale
        # of 6 * 2**-2 relative at worst; 0.25 of the block max is a loose but failing bound.
        assert (gate_up - before).abs().max() <= 0.25 * before.abs().max()
    engine = dsv4_compile.optimize(model, max_batch=2, max_context=256, compile=False)
    prompts = make_prompts((45, 20), model.config.vocab_size, seed=4)
    got = engine.generate(prompts, NEW_TOKENS)
    for prompt, tokens in zip(prompts, got):
        assert tokens == transformers_greedy(model, prompt, NEW_TOKENS)


@pytest.mark.parametrize("name", ["w13_scale", "w2_scale"])
def test_mxfp4_scale_beyond_kernel_range_rejected_at_optimize(name):
    """A ue8m0 scale above 2**65 (code 192; the mma path's bf16 scale factor overflows past it) is a
    ValueError naming the tensor when optimize() builds the step; 2**65 itself is accepted."""
    from helpers import make_experts
    from dsv4_compile.model.fp4_experts import RoutedExperts

    tensors = make_experts("mxfp4", experts=4, hidden=64, inter=32, seed=5)
    tensors[name].view(-1)[7] = 192
    RoutedExperts(Fp4Experts("mxfp4", tensors, None))
    tensors[name].view(-1)[7] = 193
    with pytest.raises(ValueError, match=rf"{name} holds a ue8m0 scale 2\*\*66 \(code 193\)"):
        RoutedExperts(Fp4Experts("mxfp4", tensors, None))
    model = tiny_model(seed=4)
    quantize_experts_(model, "mxfp4")
    model.model.layers[1].mlp.experts.w2_scale.view(-1)[3] = 255
    with pytest.raises(ValueError, match="w2_scale holds a ue8m0 scale 2\\*\\*128"):
        dsv4_compile.optimize(model, max_batch=2, max_context=256, compile=False)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_optimize_tiles_experts_in_place(fmt):
    """optimize() moves Fp4Experts whose sizes split into tiles to the tiled layout, in place; the
    weights they hold are unchanged, the step generates what transformers' own forward generates
    (which runs the module's plain-torch path on the tiled buffers), and tile_experts=False or
    sizes that do not split (the tiny model's 64 x 32) keep the row-major layout."""
    model = tiny_model(seed=6, hidden_size=128, moe_intermediate_size=128)
    quantize_experts_(model, fmt)
    before = [layer.mlp.experts.dequantized(torch.float32) for layer in model.model.layers]
    engine = dsv4_compile.optimize(model, max_batch=2, max_context=256, compile=False)
    for layer, (gate_up, down) in zip(model.model.layers, before):
        experts = layer.mlp.experts
        assert experts.tiled and experts.w13.ndim == 5 and experts.w2.ndim == 5 and experts.w2_scale.ndim == 3
        got_gate_up, got_down = experts.dequantized(torch.float32)
        assert torch.equal(got_gate_up, gate_up) and torch.equal(got_down, down)
    prompts = make_prompts((30, 17), model.config.vocab_size, seed=6)
    for prompt, tokens in zip(prompts, engine.generate(prompts, NEW_TOKENS)):
        assert tokens == transformers_greedy(model, prompt, NEW_TOKENS)
    kept = tiny_model(seed=6, hidden_size=128, moe_intermediate_size=128)
    quantize_experts_(kept, fmt)
    dsv4_compile.optimize(kept, max_batch=2, max_context=256, compile=False, tile_experts=False)
    small = tiny_model(seed=6)
    quantize_experts_(small, fmt)
    dsv4_compile.optimize(small, max_batch=2, max_context=256, compile=False)
    assert not any(layer.mlp.experts.tiled for model_ in (kept, small) for layer in model_.model.layers)


def test_optimize_tiles_transformers_fp4_experts():
    """transformers' own FP4 FP8Experts whose sizes split into tiles become tiled Fp4Experts at
    optimize(): the step generates the tokens the row-major views give (tile_experts=False keeps
    the FP8Experts, read through views)."""
    from transformers.integrations.finegrained_fp8 import FP8Experts

    from helpers import transformers_fp4_experts

    models = []
    for _ in range(2):
        model = tiny_model(seed=7, hidden_size=128, moe_intermediate_size=128)
        for index, layer in enumerate(model.model.layers):
            layer.mlp.experts = transformers_fp4_experts(model.config, "ue8m0", seed=index)
        models.append(model)
    kept = dsv4_compile.optimize(models[0], max_batch=2, max_context=256, compile=False, tile_experts=False)
    tiled = dsv4_compile.optimize(models[1], max_batch=2, max_context=256, compile=False)
    assert all(isinstance(layer.mlp.experts, FP8Experts) for layer in models[0].model.layers)
    assert all(isinstance(layer.mlp.experts, Fp4Experts) and layer.mlp.experts.tiled
               for layer in models[1].model.layers)
    prompts = make_prompts((21, 9), models[0].config.vocab_size, seed=7)
    assert tiled.generate(prompts, NEW_TOKENS) == kept.generate(prompts, NEW_TOKENS)


def test_optimize_rejects_fp8_experts():
    """transformers' FP8Experts with e4m3 experts (expert_dtype "fp8") is neither dense nor FP4:
    optimize() names it instead of failing at the first step."""
    from transformers.integrations.finegrained_fp8 import FP8Experts

    model = tiny_model(seed=2)
    layer = model.model.layers[1]
    layer.mlp.experts = FP8Experts(model.config, block_size=(32, 32), expert_dtype="fp8")
    with pytest.raises(TypeError, match=r"routed experts \(FP8Experts\) hold torch.float8_e4m3fn weights"):
        dsv4_compile.optimize(model, max_batch=2, max_context=256, compile=False)
