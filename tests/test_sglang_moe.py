"""The SGLang plugin's FP4 MoE routing (dsv4_compile/integrations/sglang_moe.py), against the real
sglang==0.5.23 package: its quantization configs, FusedMoE layer, weight loaders, dispatcher and
plugin loader.

The device architecture is faked only where SGLang's MoE-method selection reads it: its platform
facts (`get_platform().is_sm90/is_sm100/is_sm120/is_blackwell`), set with SGLang's own scoped
`override_platform`. Nothing else of SGLang is replaced.
"""
import importlib
import importlib.machinery
import sys
import types
from collections import defaultdict
from contextlib import contextmanager

import pytest
import torch

# dsv4_compile before sglang (see tests/test_sglang_plugin.py: transformers' hub-kernels check).
from dsv4_compile import fp4
from dsv4_compile.integrations import sglang as plugin
from dsv4_compile.integrations import sglang_moe
from dsv4_compile.kernels.fp4_moe import fp4_moe_reference
from helpers import make_experts

pytest.importorskip("sglang", reason="needs sglang")

pytestmark = pytest.mark.sglang

EXPERTS, HIDDEN, INTER, TOP_K, TOKENS = 8, 128, 128, 2, 5  # 128: SGLang's FP8 block size
SWIGLU_LIMIT = 0.5  # clamps part of the gate/up values of these weights
TARGET_PREFIX = "model.layers.3.mlp.experts"
DRAFT_PREFIX = "model.decoder.mlp.experts"  # SGLang's NextN name for the MTP layer
DRAFT_EXCLUDE = ["model.decoder*"]  # the NVFP4 checkpoint leaves the draft's MXFP4 experts out

ARCH = {
    "sm_120": dict(is_sm90=False, is_sm100=False, is_sm120=True, is_blackwell=True),
    "sm_100": dict(is_sm90=False, is_sm100=True, is_sm120=False, is_blackwell=True),
    "sm_90": dict(is_sm90=True, is_sm100=False, is_sm120=False, is_blackwell=False),
}


class _NoImageProcessors:
    """Stands in for transformers.AutoImageProcessor while SGLang's configs import: they register
    image processors at import time, which transformers < 5.2x refuses without torchvision. The
    MoE code under test uses no image processor."""

    @staticmethod
    def register(*args, **kwargs) -> None:
        return None


@contextmanager
def _image_processor_registry_off():
    import transformers

    saved = transformers.__dict__.get("AutoImageProcessor")
    transformers.AutoImageProcessor = _NoImageProcessors
    try:
        yield
    finally:
        transformers.AutoImageProcessor = saved


@contextmanager
def _torchvision_placeholder():
    """torchvision in sys.modules while SGLang's quantization modules import; restored after.

    Their import goes through sglang.srt.configs, whose multimodal configs (internvl_utils,
    deepseek_ocr) import torchvision.transforms at module level. torchvision cannot be installed
    next to the CPU torch wheel (its C++ ops do not load), and it is only used by SGLang's image
    preprocessing, never by the MoE code under test; the placeholder only answers those imports.
    """
    class InterpolationMode:  # the one name the configs import from torchvision.transforms
        BICUBIC = "bicubic"

    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "torchvision"}
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        placeholder = types.ModuleType(name)
        placeholder.__spec__ = importlib.machinery.ModuleSpec(name, None)
        placeholder.__path__ = []
        placeholder.InterpolationMode = InterpolationMode
        sys.modules[name] = placeholder
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.fixture(scope="module")
def sg():
    """SGLang's modules under test."""
    from transformers.utils import is_torchvision_available

    is_torchvision_available()  # cached as False before the placeholder exists
    names = dict(
        fp8="sglang.srt.layers.quantization.fp8",
        modelopt="sglang.srt.layers.quantization.modelopt_quant",
        mxfp4_trtllm="sglang.srt.layers.quantization.mxfp4_flashinfer_trtllm_moe",
        fused_moe="sglang.srt.layers.moe.fused_moe_triton",
        moe_utils="sglang.srt.layers.moe.utils",
        topk="sglang.srt.layers.moe.topk",
        dispatcher="sglang.srt.layers.moe.token_dispatcher",
        runtime="sglang.srt.runtime_context",
        server_args="sglang.srt.server_args",
        plugins="sglang.srt.plugins",
        hooks="sglang.srt.plugins.hook_registry",
        compile_decoration="sglang.srt.compilation.torch_compile_decoration",
        loader="sglang.srt.model_loader.loader",
        weight_updater="sglang.srt.model_executor.model_runner_components.weight_updater",
        forward_batch="sglang.srt.model_executor.forward_batch_info",
        eagle_info="sglang.srt.speculative.eagle_info",
    )
    with _torchvision_placeholder(), _image_processor_registry_off():
        return types.SimpleNamespace(**{key: importlib.import_module(name) for key, name in names.items()})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model config for SGLang's ServerArgs: its runtime context needs one to resolve; the
    MoE layers under test are built directly."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("sglang_model")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=128, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


@pytest.fixture
def plugin_loaded(sg, monkeypatch):
    """SGLang's load_plugins() has run our entry point; hooks and hooked classes restored afterwards."""
    registry = sg.hooks.HookRegistry
    monkeypatch.setattr(sg.plugins, "_plugins_loaded", False)
    monkeypatch.setattr(registry, "_hooks", defaultdict(list))
    monkeypatch.setattr(registry, "_patched", set())
    monkeypatch.setattr(sg.compile_decoration, "patch_model", sg.compile_decoration.patch_model)
    hooked = {cls: cls.__dict__["get_quant_method"] for cls in (sg.fp8.Fp8Config, sg.modelopt.HybridFp8NvFp4Config)}
    for cls, original in hooked.items():
        monkeypatch.setattr(cls, "get_quant_method", original)
    monkeypatch.setattr(plugin, "active_backend", None)
    for name in ("SGLANG_PLUGINS", "SGLANG_PLATFORM", plugin.DISABLE_ENV):
        monkeypatch.delenv(name, raising=False)
    sg.plugins.load_plugins()
    for cls, original in hooked.items():  # our AROUND hooks now wrap SGLang's selection
        assert cls.__dict__["get_quant_method"].__wrapped__ is original


@contextmanager
def sglang_runtime(sg, model_dir, moe_runner_backend):
    """SGLang's runtime context for one rank, with --moe-runner-backend `moe_runner_backend`."""
    args = sg.server_args.ServerArgs(model_path=str(model_dir), device="cpu", moe_runner_backend=moe_runner_backend)
    context = sg.runtime.create_context(args, role="test", ranks=sg.runtime.SpawnRanks(world_rank=0))
    with sg.runtime.use_context(context):
        sg.moe_utils.initialize_moe_config()
        yield


def dsv4_fp8_config(sg, dsv4=True):
    """DeepSeek-V4's FP8 config with native MXFP4 experts, as SGLang's loader sets it up."""
    config = sg.fp8.Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128], is_fp4_experts=True)
    config.is_dsv4_fp4_experts = dsv4  # the loader's is_deepseek_v4(hf_config)
    return config


def dsv4_hybrid_config(sg, dsv4=True):
    """nvidia/DeepSeek-V4-*-NVFP4's hybrid config: NVFP4 target experts, MXFP4 draft experts."""
    nvfp4 = sg.modelopt.ModelOptFp4Config(is_checkpoint_nvfp4_serialized=True, group_size=16,
                                          exclude_modules=DRAFT_EXCLUDE)
    return sg.modelopt.HybridFp8NvFp4Config(dsv4_fp8_config(sg, dsv4), nvfp4)


def build_layer(sg, config, prefix):
    """A real SGLang FusedMoE (bf16 activations) built on an sm_120 device."""
    with sg.runtime.override_platform(**ARCH["sm_120"]):
        return sg.fused_moe.FusedMoE(num_experts=EXPERTS, hidden_size=HIDDEN, intermediate_size=INTER, layer_id=0,
                                     top_k=TOP_K, quant_config=config, prefix=prefix, swiglu_limit=SWIGLU_LIMIT,
                                     params_dtype=torch.bfloat16)


def selected(sg, config, layer, prefix, arch):
    """SGLang's method selection for `layer` on `arch`: the method, or the error it raised."""
    with sg.runtime.override_platform(**ARCH[arch]):
        try:
            return config.get_quant_method(layer, prefix)
        except RuntimeError as error:
            return error


def assert_sglang_cutlass_choice(result):
    # SGLang's own sm_90/sm_120 choice: FlashInfer's CUTLASS method, which FlashInfer must back.
    assert isinstance(result, RuntimeError) and "Mxfp4FlashinferCutlassMoEMethod requires FlashInfer" in str(result)


def test_dsv4_mxfp4_experts_selection(sg, model_dir, plugin_loaded):
    config = dsv4_fp8_config(sg)
    with sglang_runtime(sg, model_dir, "flashinfer_mxfp4"):  # SGLang's DSV4 default for MXFP4 experts
        layer = build_layer(sg, config, TARGET_PREFIX)
        assert isinstance(layer.quant_method, sglang_moe.Dsv4Fp4MoEMethod) and layer.quant_method.fmt == "mxfp4"
        for prefix in (TARGET_PREFIX, DRAFT_PREFIX):  # the MTP draft's MoE shares the config
            ours = selected(sg, config, layer, prefix, "sm_120")
            assert isinstance(ours, sglang_moe.Dsv4Fp4MoEMethod) and ours.fmt == "mxfp4"
            assert type(selected(sg, config, layer, prefix, "sm_100")) is sg.mxfp4_trtllm.Mxfp4FlashinferTrtllmMoEMethod
            assert_sglang_cutlass_choice(selected(sg, config, layer, prefix, "sm_90"))
        # Another model's FP4 experts keep SGLang's choice on sm_120.
        assert_sglang_cutlass_choice(selected(sg, dsv4_fp8_config(sg, dsv4=False), layer, TARGET_PREFIX, "sm_120"))
    with sglang_runtime(sg, model_dir, "triton"):  # a runner SGLang gives no FP4 method: its FP8 method
        assert type(selected(sg, config, layer, TARGET_PREFIX, "sm_120")) is sg.fp8.Fp8MoEMethod


@pytest.mark.parametrize("runner", ["flashinfer_trtllm_routed", "auto"])  # SGLang's DSV4-NVFP4 default, and auto
def test_dsv4_nvfp4_target_and_mxfp4_draft_selection(sg, model_dir, plugin_loaded, runner):
    config = dsv4_hybrid_config(sg)
    with sglang_runtime(sg, model_dir, runner):
        layer = build_layer(sg, config, TARGET_PREFIX)
        assert isinstance(layer.quant_method, sglang_moe.Dsv4Fp4MoEMethod) and layer.quant_method.fmt == "nvfp4"
        target = selected(sg, config, layer, TARGET_PREFIX, "sm_120")
        draft = selected(sg, config, layer, DRAFT_PREFIX, "sm_120")
        assert isinstance(target, sglang_moe.Dsv4Fp4MoEMethod) and target.fmt == "nvfp4"
        assert isinstance(draft, sglang_moe.Dsv4Fp4MoEMethod) and draft.fmt == "mxfp4"
        assert type(selected(sg, config, layer, TARGET_PREFIX, "sm_100")) is sg.modelopt.ModelOptNvFp4FusedMoEMethod
        assert type(selected(sg, config, layer, DRAFT_PREFIX, "sm_100")) is sg.mxfp4_trtllm.Mxfp4FlashinferTrtllmMoEMethod
        other_model = dsv4_hybrid_config(sg, dsv4=False)
        assert type(selected(sg, other_model, layer, TARGET_PREFIX, "sm_120")) is sg.modelopt.ModelOptNvFp4FusedMoEMethod
        assert type(selected(sg, other_model, layer, DRAFT_PREFIX, "sm_120")) is sg.mxfp4_trtllm.Mxfp4FlashinferTrtllmMoEMethod


def random_checkpoint(fmt, seed):
    """Random FP4 experts as a checkpoint stores them: {(expert, shard, suffix): tensor}, plus the
    op-layout tensors [E, 2I, K/2] etc. that fp4_moe_reference takes.

    NVFP4 gate and up share one global scale per expert.
    """
    op_layout = make_experts(fmt, EXPERTS, HIDDEN, INTER, seed)
    q13, s13, g13 = op_layout["w13"], op_layout["w13_scale"], op_layout["w13_global"]
    q2, s2, g2 = op_layout["w2"], op_layout["w2_scale"], op_layout["w2_global"]
    ckpt = {}
    for e in range(EXPERTS):
        for shard, rows in (("w1", slice(0, INTER)), ("w3", slice(INTER, 2 * INTER)), ("w2", slice(None))):
            q, s = (q13, s13) if shard != "w2" else (q2, s2)
            if fmt == "mxfp4":  # DeepSeek-V4: int8-packed e2m1, ue8m0 scales
                ckpt[e, shard, "weight"] = q[e, rows].view(torch.int8)
                ckpt[e, shard, "weight_scale_inv"] = s[e, rows].view(torch.float8_e8m0fnu)
            else:  # ModelOpt NVFP4: uint8-packed e2m1, e4m3 block scales, f32 global and input scales
                glob = (g13 if shard != "w2" else g2)[e]
                ckpt[e, shard, "weight"] = q[e, rows]
                ckpt[e, shard, "weight_scale"] = s[e, rows]
                ckpt[e, shard, "weight_scale_2"] = glob
                ckpt[e, shard, "input_scale"] = torch.tensor(1.0)
    return ckpt, op_layout


def load_checkpoint(layer, ckpt):
    """Through FusedMoE.weight_loader, as SGLang's model loader calls it per checkpoint tensor."""
    params = dict(layer.named_parameters())
    for (expert, shard, suffix), tensor in ckpt.items():
        param = params[("w2" if shard == "w2" else "w13") + "_" + suffix]
        layer.weight_loader(param, tensor, f"experts.{expert}.{shard}.{suffix}", shard, expert)
    layer.quant_method.process_weights_after_loading(layer)


def run_layer(sg, layer, x, topk_ids, topk_weights):
    """FusedMoE.forward_impl's path without its TP all-reduce: dispatch, quant_method.apply, combine."""
    topk_output = sg.topk.StandardTopKOutput(topk_weights=topk_weights, topk_ids=topk_ids,
                                             router_logits=torch.zeros(x.shape[0], EXPERTS))
    dispatch_output = layer.dispatcher.dispatch(hidden_states=x, topk_output=topk_output)
    return layer.dispatcher.combine(combine_input=layer.run_moe_core(dispatch_output))


@pytest.mark.parametrize("fmt, make_config, prefix", [
    ("mxfp4", dsv4_fp8_config, TARGET_PREFIX),
    ("mxfp4", dsv4_hybrid_config, DRAFT_PREFIX),
    ("nvfp4", dsv4_hybrid_config, TARGET_PREFIX),
])
def test_apply_matches_reference_on_sglang_loaded_weights(sg, model_dir, plugin_loaded, fmt, make_config, prefix):
    runner = "flashinfer_mxfp4" if make_config is dsv4_fp8_config else "flashinfer_trtllm_routed"
    with sglang_runtime(sg, model_dir, runner):
        layer = build_layer(sg, make_config(sg), prefix)
        method = layer.quant_method
        assert isinstance(method, sglang_moe.Dsv4Fp4MoEMethod) and method.fmt == fmt
        ckpt, op_layout = random_checkpoint(fmt, seed=11)
        load_checkpoint(layer, ckpt)

        tensors = method.expert_tensors(layer)
        for name in ("w13", "w13_scale", "w2", "w2_scale"):  # what the op gets is SGLang's storage
            assert torch.equal(tensors[name].view(torch.uint8), op_layout[name].view(torch.uint8)), name
        scale_name = "w2_weight_scale_inv" if fmt == "mxfp4" else "w2_weight_scale"
        assert tensors["w13"].data_ptr() == layer.w13_weight.data_ptr()  # views, not copies
        assert tensors["w2_scale"].data_ptr() == getattr(layer, scale_name).data_ptr()

        gen = torch.Generator().manual_seed(12)
        x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16()
        topk_ids = torch.randint(0, EXPERTS, (TOKENS, TOP_K), generator=gen, dtype=torch.int32)
        topk_ids[1, 0] = -1  # a choice on another rank
        topk_weights = torch.rand(TOKENS, TOP_K, generator=gen) + 0.1
        got = run_layer(sg, layer, x, topk_ids, topk_weights)

    want = fp4_moe_reference(x, topk_ids, topk_weights, **op_layout, swiglu_limit=SWIGLU_LIMIT)
    # Under the Triton interpreter (conftest) the op runs the kernel with f32 dots; the output is
    # bf16, so the error is its rounding (2**-8 relative) plus summation order.
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    scale = want.float().abs().max()
    assert scale > 0.1
    assert (got.float() - want.float()).abs().max() <= 2e-2 * scale


def nvfp4_split_reference(x, topk_ids, topk_weights, op_layout, up_ratio):
    """fp4_moe's spec with the up rows' global `up_ratio` times the gate's: weights dequantised in
    f32 per half with their own global."""
    inter = op_layout["w13"].shape[1] // 2
    globals_ = torch.stack([op_layout["w13_global"], op_layout["w13_global"] * up_ratio], dim=1)
    w13 = torch.cat([fp4.dequantize_nvfp4(op_layout["w13"][:, half * inter:(half + 1) * inter],
                                          op_layout["w13_scale"][:, half * inter:(half + 1) * inter],
                                          globals_[:, half], torch.float32) for half in (0, 1)], dim=1)
    w2 = fp4.dequantize_nvfp4(op_layout["w2"], op_layout["w2_scale"], op_layout["w2_global"], torch.float32)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for token, choice in torch.nonzero(topk_ids >= 0).tolist():
        expert = int(topk_ids[token, choice])
        gate, up = (w13[expert] @ x[token].float()).chunk(2)
        hidden = torch.nn.functional.silu(gate.clamp(max=SWIGLU_LIMIT)) * up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
        out[token] += topk_weights[token, choice] * (w2[expert] @ hidden)
    return out


def test_nvfp4_untied_gate_and_up_globals_move_onto_the_larger(sg, model_dir, plugin_loaded, caplog):
    """Up globals 1.3x the gate's: the gate rows' e4m3 block scales are multiplied by 1 / 1.3 and
    rounded, both globals become the up one, and a second post-load pass changes nothing. The
    output equals the reference on the rescaled storage (kernel tolerance as above) and the split
    globals' own reference within e4m3's rounding of a block scale (2^-4 relative) of the output."""
    ratio = 1.3
    with sglang_runtime(sg, model_dir, "flashinfer_trtllm_routed"):
        layer = build_layer(sg, dsv4_hybrid_config(sg), TARGET_PREFIX)
        assert layer.w13_blockscale_swizzled is None and layer.w2_blockscale_swizzled is None
        ckpt, op_layout = random_checkpoint("nvfp4", seed=13)
        for e in range(EXPERTS):
            ckpt[e, "w3", "weight_scale_2"] = ckpt[e, "w3", "weight_scale_2"] * ratio
        with caplog.at_level("WARNING", logger="dsv4_compile"):
            load_checkpoint(layer, ckpt)
        assert f"in {EXPERTS} of {EXPERTS} experts" in caplog.text
        up_global = op_layout["w13_global"] * ratio
        assert torch.equal(getattr(layer, sglang_moe.W13_GLOBAL_PARAM), up_global)
        assert torch.equal(layer.w13_weight_scale_2.data, up_global[:, None].expand(-1, 2))
        gate_scales = (op_layout["w13_scale"][:, :INTER].float() * (op_layout["w13_global"] / up_global)[:, None, None])
        assert torch.equal(layer.w13_weight_scale.data[:, :INTER], gate_scales.to(torch.float8_e4m3fn))
        assert torch.equal(layer.w13_weight_scale.data[:, INTER:], op_layout["w13_scale"][:, INTER:])
        stored = {name: t.clone() for name, t in layer.quant_method.expert_tensors(layer).items()
                  if isinstance(t, torch.Tensor)}
        layer.quant_method.process_weights_after_loading(layer)
        assert all(torch.equal(t, layer.quant_method.expert_tensors(layer)[name]) for name, t in stored.items())

        x, topk_ids, topk_weights = layer_inputs(15)
        topk_ids[1, 0] = -1
        got = run_layer(sg, layer, x, topk_ids, topk_weights).float()
        on_storage = fp4_moe_reference(x, topk_ids, topk_weights, swiglu_limit=SWIGLU_LIMIT,
                                       **layer.quant_method.expert_tensors(layer)).float()
    split = nvfp4_split_reference(x, topk_ids, topk_weights, op_layout, ratio)
    scale = split.abs().max()
    assert scale > 0.1
    assert (got - on_storage).abs().max() <= 2e-2 * scale
    assert (got - split).abs().max() <= 2.0 ** -4 * scale


@pytest.mark.parametrize("up_scale, loads", [(lambda g: g * (1 + 2.0**-20), True), (lambda g: g * float("nan"), False),
                                             (lambda g: g * float("inf"), False)],
                         ids=["within_rtol", "nan", "inf"])
def test_nvfp4_gate_and_up_global_scales_close_enough(sg, model_dir, plugin_loaded, up_scale, loads):
    """Gate and up global scales a rounding apart load as they are (the gate's serves both, no block
    scale changes); not finite, they raise naming w13_weight_scale_2."""
    with sglang_runtime(sg, model_dir, "flashinfer_trtllm_routed"):
        layer = build_layer(sg, dsv4_hybrid_config(sg), TARGET_PREFIX)
        ckpt, op_layout = random_checkpoint("nvfp4", seed=14)
        for e in range(EXPERTS):
            ckpt[e, "w3", "weight_scale_2"] = up_scale(ckpt[e, "w3", "weight_scale_2"])
        if loads:
            load_checkpoint(layer, ckpt)
            assert torch.equal(getattr(layer, sglang_moe.W13_GLOBAL_PARAM), op_layout["w13_global"])
            assert torch.equal(layer.w13_weight_scale.data, op_layout["w13_scale"])
        else:
            with pytest.raises(ValueError, match="w13_weight_scale_2"):
                load_checkpoint(layer, ckpt)


def test_runner_settings_fp4_moe_does_not_implement_are_rejected():
    method = sglang_moe.Dsv4Fp4MoEMethod("mxfp4", object(), TARGET_PREFIX)
    base = dict(activation="silu", is_gated=True, gemm1_alpha=None, gemm1_beta=None, gemm1_clamp_limit=None,
                apply_router_weight_on_input=False, no_combine=False, swiglu_limit=None)
    for change in (dict(apply_router_weight_on_input=True), dict(no_combine=True), dict(gemm1_beta=1.0)):
        name = next(iter(change))
        with pytest.raises(ValueError, match=name):
            method.create_moe_runner(None, types.SimpleNamespace(**{**base, **change}))
    with pytest.raises(ValueError, match="params_dtype must be bfloat16 or float32"):
        method.create_weights(None, EXPERTS, HIDDEN, INTER, torch.float16)


def test_all_to_all_backends_and_fp8_dequant_keep_sglangs_choice(sg, model_dir, plugin_loaded, monkeypatch):
    """With an all-to-all backend (DeepEP here) the layer gets no standard dispatch output, and with
    dequant_fp4_to_fp8 SGLang dequantises the experts: both keep SGLang's own selection."""
    from sglang.srt.layers.moe import utils as moe_utils

    with sglang_runtime(sg, model_dir, "flashinfer_trtllm_routed"):
        config = dsv4_hybrid_config(sg)
        layer = build_layer(sg, config, TARGET_PREFIX)
        assert isinstance(selected(sg, config, layer, TARGET_PREFIX, "sm_120"), sglang_moe.Dsv4Fp4MoEMethod)
        config.dequant_fp4_to_fp8 = True
        assert not isinstance(selected(sg, config, layer, TARGET_PREFIX, "sm_120"), sglang_moe.Dsv4Fp4MoEMethod)
        config.dequant_fp4_to_fp8 = False
        monkeypatch.setattr(moe_utils, "get_moe_a2a_backend", lambda: moe_utils.MoeA2ABackend.DEEPEP)
        assert not isinstance(selected(sg, config, layer, TARGET_PREFIX, "sm_120"), sglang_moe.Dsv4Fp4MoEMethod)


def test_bad_format_is_rejected():
    with pytest.raises(ValueError, match="fmt must be 'mxfp4' or 'nvfp4'"):
        sglang_moe.Dsv4Fp4MoEMethod("fp8", object(), TARGET_PREFIX)


def test_other_activation_is_rejected(sg, model_dir, plugin_loaded):
    with sglang_runtime(sg, model_dir, "flashinfer_mxfp4"), sg.runtime.override_platform(**ARCH["sm_120"]):
        with pytest.raises(ValueError, match="activation must be gated 'silu', got 'gelu'"):
            sg.fused_moe.FusedMoE(num_experts=EXPERTS, hidden_size=HIDDEN, intermediate_size=INTER, layer_id=0,
                                  top_k=TOP_K, quant_config=dsv4_fp8_config(sg), prefix=TARGET_PREFIX,
                                  activation="gelu", params_dtype=torch.bfloat16)


class _ExpertsModel(torch.nn.Module):
    """What SGLang's weight loading sees of a model: a module with a quant_method, and load_weights
    sending checkpoint names to FusedMoE's weight loader through FusedMoE.make_expert_params_mapping,
    as DeepSeek-V4's load_weights does."""

    def __init__(self, sg, experts):
        super().__init__()
        self.experts = experts
        self.mapping = sg.fused_moe.FusedMoE.make_expert_params_mapping("w1", "w2", "w3", EXPERTS)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            param_prefix, weight_prefix, expert, shard = next(m for m in self.mapping if name.startswith(m[1]))
            self.experts.weight_loader(params[name.replace(weight_prefix, param_prefix)], tensor, name, shard, expert)


def named_weights(ckpt):
    """random_checkpoint's tensors under the checkpoint names SGLang's loaders see."""
    return [(f"experts.{expert}.{shard}.{suffix}", tensor) for (expert, shard, suffix), tensor in ckpt.items()]


def initial_load(sg, model, ckpt):
    """SGLang's start-up load: DefaultModelLoader.load_weights_and_postprocess."""
    sg.loader.DefaultModelLoader.load_weights_and_postprocess(model, iter(named_weights(ckpt)), torch.device("cpu"))


def reload_from_disk(sg, model, ckpt):
    """WeightUpdater.update_weights_from_disk's load: restore, then load and post-process."""
    sg.loader.DefaultModelLoader.restore_weights_before_loading(model, torch.device("cpu"))
    sg.loader.DefaultModelLoader.load_weights_and_postprocess(model, iter(named_weights(ckpt)), torch.device("cpu"))


def reload_in_session(sg, model, ckpt):
    """update_weights_from_tensor's session: WeightUpdater.begin_weight_update, the model's
    load_weights (load_format None), end_weight_update after a load."""
    updater = sg.weight_updater.WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={}, get_model=lambda: model,
        update_model_fields=None, recapture_cuda_graph=None, get_model_runner=None)
    updater.begin_weight_update()
    model.load_weights(named_weights(ckpt))
    updater.end_weight_update(run_post_load=False)


def layer_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16()
    topk_ids = torch.randint(0, EXPERTS, (TOKENS, TOP_K), generator=gen, dtype=torch.int32)
    return x, topk_ids, torch.rand(TOKENS, TOP_K, generator=gen) + 0.1


@pytest.mark.parametrize("reload", [reload_from_disk, reload_in_session], ids=["disk", "session"])
@pytest.mark.parametrize("fmt, make_config, prefix", [
    ("mxfp4", dsv4_fp8_config, TARGET_PREFIX),
    ("mxfp4", dsv4_hybrid_config, DRAFT_PREFIX),
    ("nvfp4", dsv4_hybrid_config, TARGET_PREFIX),
])
def test_in_place_reload_computes_like_a_fresh_load(sg, model_dir, plugin_loaded, fmt, make_config, prefix, reload):
    """After an in-place reload through SGLang's own paths the layer computes exactly as a layer
    freshly loaded with the new weights, on the same storage (what captured graphs read)."""
    runner = "flashinfer_mxfp4" if make_config is dsv4_fp8_config else "flashinfer_trtllm_routed"
    inputs = layer_inputs(31)
    with sglang_runtime(sg, model_dir, runner):
        model = _ExpertsModel(sg, build_layer(sg, make_config(sg), prefix))
        initial_load(sg, model, random_checkpoint(fmt, seed=32)[0])
        old = run_layer(sg, model.experts, *inputs)
        storage = {name: p.data_ptr() for name, p in model.experts.named_parameters()}

        reload(sg, model, random_checkpoint(fmt, seed=33)[0])
        reloaded = run_layer(sg, model.experts, *inputs)
        assert {name: p.data_ptr() for name, p in model.experts.named_parameters()} == storage

        fresh_model = _ExpertsModel(sg, build_layer(sg, make_config(sg), prefix))
        initial_load(sg, fresh_model, random_checkpoint(fmt, seed=33)[0])
        fresh = run_layer(sg, fresh_model.experts, *inputs)
    assert torch.equal(reloaded, fresh)
    assert not torch.equal(reloaded, old)


def test_failed_nvfp4_reload_leaves_no_stale_layer(sg, model_dir, plugin_loaded):
    """A reload whose gate and up globals are not finite raises; the layer then refuses to compute (its
    derived global, which captured graphs read, is NaN) until a valid reload, like SGLang's own
    rollback after a failed update_weights_from_disk."""
    inputs = layer_inputs(41)
    with sglang_runtime(sg, model_dir, "flashinfer_trtllm_routed"):
        model = _ExpertsModel(sg, build_layer(sg, dsv4_hybrid_config(sg), TARGET_PREFIX))
        initial_load(sg, model, random_checkpoint("nvfp4", seed=42)[0])
        before = run_layer(sg, model.experts, *inputs)
        bad = random_checkpoint("nvfp4", seed=43)[0]
        bad[3, "w1", "weight_scale_2"] = torch.tensor(float("nan"))
        with pytest.raises(ValueError, match="w13_weight_scale_2 holds non-finite values"):
            reload_from_disk(sg, model, bad)
        assert getattr(model.experts, sglang_moe.W13_GLOBAL_PARAM).isnan().all()
        with pytest.raises(RuntimeError, match="last weight load failed.*w13_weight_scale_2 holds non-finite"):
            run_layer(sg, model.experts, *inputs)
        reload_from_disk(sg, model, random_checkpoint("nvfp4", seed=42)[0])  # the rollback
        assert torch.equal(run_layer(sg, model.experts, *inputs), before)
