"""SGLang plugin part: DeepSeek-V4's FP4 MoE on sm_120 runs `torch.ops.dsv4.fp4_moe`.

On an sm_120 GPU, SGLang 0.5.23 sends DeepSeek-V4's FP4 experts to FlashInfer kernels:
- native MXFP4 experts (`Fp8Config` with `is_fp4_experts`, runner `flashinfer_mxfp4`) go to
  `Mxfp4FlashinferCutlassMoEMethod` (it refuses to build without FlashInfer);
- a hybrid FP8 + NVFP4 checkpoint (`HybridFp8NvFp4Config`) sends the target's MoE to
  `ModelOptNvFp4FusedMoEMethod`, which picks FLASHINFER_TRTLLM on every Blackwell major, and the
  MTP/NextN draft's MXFP4 MoE (the NVFP4-excluded layers) to `Mxfp4FlashinferTrtllmMoEMethod`
  (`trtllm_fp4_block_scale_moe`). FlashInfer's TRT-LLM cubins target sm_100a/sm_103a.

AROUND hooks on `Fp8Config.get_quant_method` and `HybridFp8NvFp4Config.get_quant_method` return
`Dsv4Fp4MoEMethod` instead in exactly those cases, before SGLang builds its FlashInfer method.
The conditions mirror SGLang's own selection (fp8.py:397-473, modelopt_quant.py:1747-1764) plus:
the device is sm_120 (`get_platform().is_sm120`, the fact SGLang's selection reads), the
config belongs to a DeepSeek-V4 model (`is_dsv4_fp4_experts`, set by SGLang's loader from the
model's architecture) and no all-to-all backend is used (the method takes the standard dispatch
output; DeepEP, MegaMoE and the others keep SGLang's choice). Every other case calls SGLang's
original.

Weights keep SGLang's storage (its own `create_weights` and loaders), in the checkpoint layout:
- MXFP4: `w13_weight` int8 [E, 2I, K/2] (rows [0, I) gate, [I, 2I) up), `w2_weight` int8
  [E, K, I/2], `w*_weight_scale_inv` float8_e8m0fnu [E, rows, cols/32], as SGLang's CUTLASS
  method stores them. The op gets uint8 views of all four: no repacking.
- NVFP4: `w13_weight` uint8 [E, 2I, K/2], `w*_weight_scale` e4m3 [E, rows, cols/16] (views),
  `w13_weight_scale_2` [E, 2] f32 (gate, up) and `w2_weight_scale_2` [E] f32. The op takes one
  w13 global scale per expert: after each load it is derived into its own parameter
  `W13_GLOBAL_PARAM` [E] f32. Where an expert's gate and up globals differ (ModelOpt ties them on
  export; other quantisers may not), both halves move onto the larger one: the other half's e4m3
  block scales are multiplied by the ratio and rounded (at most 2^-4 relative a block scale), as
  SGLang's own TRT-LLM path does, and `w13_weight_scale_2` is tied in place. The swizzled
  block-scale copies SGLang allocates are dropped as soon as they are created. Activations stay
  bf16 (W4A16), so the checkpoint's input scales are not used.

In-place reloads (SGLang's update_weights_from_disk, and the begin/end_weight_update sessions of
update_weights_from_tensor / _distributed) rerun the loaders on the same parameters and then
`process_weights_after_loading`, as SGLang's own FP4 methods expect: every parameter a loader
writes keeps its checkpoint shape, so no restore step is needed (SGLang calls
`restore_weights_before_loading` only on QuantizeMethodBase subclasses), and the derived global is
rewritten in place, so graphs captured on its storage read the new values. A load whose gate or
up globals are not finite raises; until a valid load, the derived global is NaN and `apply` raises,
since some of SGLang's paths (the checkpoint-engine IPC hook) only log that error.

The routed scaling factor is folded into the top-k weights (`fuse_routed_scaling_factor_in_topk`),
as the op expects final routing weights.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

import dsv4_compile.kernels.fp4_moe  # noqa: F401  (registers torch.ops.dsv4.fp4_moe)

log = logging.getLogger("dsv4_compile")

RUNNER_BACKEND_NAME = "dsv4_fp4_moe"
GLOBAL_SCALE_RTOL = 2.0**-10
W13_GLOBAL_PARAM = "dsv4_w13_global_scale"  # NVFP4: fp4_moe's one w13 global scale per expert, [E] f32
FP8_CONFIG_TARGET = "sglang.srt.layers.quantization.fp8.Fp8Config.get_quant_method"
HYBRID_CONFIG_TARGET = "sglang.srt.layers.quantization.modelopt_quant.HybridFp8NvFp4Config.get_quant_method"


class Dsv4Fp4MoEMethod:
    """An SGLang FusedMoE quant method whose `apply` runs `torch.ops.dsv4.fp4_moe`.

    `weights_method` is the SGLang method whose `create_weights` (and weight loaders) this one
    reuses: `Fp8MoEMethod` for "mxfp4", `ModelOptNvFp4FusedMoEMethod` for "nvfp4".
    """

    fuse_routed_scaling_factor_in_topk = True
    load_up_proj_weight_first = False  # the loaders keep w13 as [gate; up], the op's layout

    def __init__(self, fmt: str, weights_method: Any, prefix: str):
        if fmt not in ("mxfp4", "nvfp4"):
            raise ValueError(f"Dsv4Fp4MoEMethod: fmt must be 'mxfp4' or 'nvfp4', got {fmt!r}")
        self.fmt = fmt
        self.prefix = prefix
        self._weights_method = weights_method
        if fmt == "nvfp4":
            # The two switches SGLang's NVFP4 create_weights reads to store the TRT-LLM layout
            # (padded I, [up; gate] rows, no swizzled scales); off, it stores the checkpoint layout.
            weights_method.enable_flashinfer_trtllm_moe = False
            weights_method.use_flashinfer_trtllm_weight_layout = False
        self.runner = None
        self.swiglu_limit: float | None = None
        self.load_error: str | None = None  # why the last NVFP4 load failed, until a load succeeds

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       with_bias: bool = False, **extra_weight_attrs: Any) -> None:
        """Registers SGLang's FP4 expert parameters on `layer` (shapes in the module docstring)."""
        if with_bias:
            raise ValueError(f"Dsv4Fp4MoEMethod ({self.prefix}): with_bias must be False; fp4_moe has no expert bias")
        if params_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"Dsv4Fp4MoEMethod ({self.prefix}): params_dtype must be bfloat16 or float32 (fp4_moe's "
                             f"activations), got {params_dtype}")
        extra = {"fp4_scale_dtype": torch.float8_e8m0fnu} if self.fmt == "mxfp4" else {}
        if self.fmt == "nvfp4":
            # FusedMoE's loaders pick their NVFP4 path by the layout method's class; this is
            # SGLang's hook for a wrapper that loads for another method (paged experts use it).
            layer.weight_load_method = self._weights_method
        self._weights_method.create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition,
                                            params_dtype, **extra, **extra_weight_attrs)
        if self.fmt == "nvfp4":  # swizzled copies for FlashInfer's CUTLASS kernels: never read here
            layer.w13_blockscale_swizzled = None
            layer.w2_blockscale_swizzled = None

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config: Any) -> None:
        """Checks the activation is fp4_moe's (gated SiLU, optional swiglu clamp); keeps the clamp."""
        if moe_runner_config.activation != "silu" or not moe_runner_config.is_gated:
            raise ValueError(f"Dsv4Fp4MoEMethod ({self.prefix}): activation must be gated 'silu', got "
                             f"{moe_runner_config.activation!r} (is_gated={moe_runner_config.is_gated})")
        for name in ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit"):
            if getattr(moe_runner_config, name, None) is not None:
                raise ValueError(f"Dsv4Fp4MoEMethod ({self.prefix}): {name} must be None; fp4_moe clamps with swiglu_limit")
        for name in ("apply_router_weight_on_input", "no_combine"):
            if getattr(moe_runner_config, name, False):
                raise ValueError(f"Dsv4Fp4MoEMethod ({self.prefix}): {name} must be False; fp4_moe weights each "
                                 f"expert's output and sums them")
        self.moe_runner_config = moe_runner_config
        self._weights_method.moe_runner_config = moe_runner_config  # read by its loader-layout properties
        self.swiglu_limit = moe_runner_config.swiglu_limit

    def get_moe_runner_backend(self, layer: torch.nn.Module) -> Any:
        """A backend name registered with SGLang, so that none of its kernel-specific paths fire."""
        from sglang.srt.layers.moe.utils import register_moe_runner_backend_name, resolve_moe_runner_backend

        try:
            return resolve_moe_runner_backend(RUNNER_BACKEND_NAME)
        except ValueError:
            register_moe_runner_backend_name(RUNNER_BACKEND_NAME)
            return resolve_moe_runner_backend(RUNNER_BACKEND_NAME)

    def get_moe_routing_method_type(self, layer: torch.nn.Module, requested_method: Any) -> Any:
        """SGLang's routing as requested: the op takes final top-k ids and weights."""
        return requested_method

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """NVFP4 only: derives `W13_GLOBAL_PARAM` [E] f32 from `w13_weight_scale_2` [E, 2] in place,
        tying gate and up globals that differ (module docstring). Raises ValueError (and poisons the
        layer) when they are not finite."""
        from sglang.srt.layers.utils.common import copy_or_rebind_param

        if self.fmt == "mxfp4":
            # Fp8MoEMethod's own post-load step is not run: for these experts (CUDA, no all-to-all)
            # it only re-views the weights as int8, and the op takes uint8 views of them anyway.
            return
        try:
            self._tie_w13_globals(layer.w13_weight_scale_2.data, layer.w13_weight_scale.data)
        except ValueError as error:
            self._poison(layer, str(error))
            raise
        # in place from the second load on
        copy_or_rebind_param(layer, W13_GLOBAL_PARAM, layer.w13_weight_scale_2.data[:, 0].float().contiguous())
        self.load_error = None

    def _tie_w13_globals(self, scale_2: torch.Tensor, block_scales: torch.Tensor) -> None:
        """scale_2 [E, 2] f32 (gate, up), block_scales [E, 2I, K/16] e4m3, in place: where an expert's
        two globals differ by more than GLOBAL_SCALE_RTOL relative (a rounding apart, the gate's
        serves both), the half with the smaller one gets its block scales times smaller / larger,
        rounded to e4m3, and both globals become the larger."""
        if not scale_2.isfinite().all():
            raise ValueError(f"Dsv4Fp4MoEMethod ({self.prefix}): w13_weight_scale_2 holds non-finite values")
        gate, up = scale_2[:, 0].float(), scale_2[:, 1].float()
        apart = (gate - up).abs() / gate.abs().clamp(min=torch.finfo(torch.float32).tiny)
        untied = apart > GLOBAL_SCALE_RTOL
        if not untied.any():
            return
        shared = torch.maximum(gate, up)
        ratios = torch.where(untied[:, None], torch.stack([gate, up], dim=1) / shared[:, None], 1.0)
        halves = block_scales.unflatten(1, (2, -1))  # [E, (gate, up), I, K/16]
        exact = halves.float() * ratios[:, :, None, None]
        halves.copy_(exact)
        error = float(((halves.float() - exact).abs() / exact.abs().clamp(min=torch.finfo(torch.float32).tiny)).max())
        scale_2.copy_(torch.where(untied[:, None], shared[:, None], scale_2.float()).to(scale_2.dtype))
        log.warning("dsv4: %s: gate and up global scales differ (up to %.3g relative) in %d of %d experts; their "
                    "w13 block scales were moved onto the larger global (e4m3 rounding, up to %.3g relative)",
                    self.prefix, float(apart.max()), int(untied.sum()), untied.numel(), error)

    def _poison(self, layer: torch.nn.Module, reason: str) -> None:
        """After a failed load the weights may be new and the derived global old: NaN makes graphs
        captured on it compute NaN rather than plausible values, and `apply` raises."""
        self.load_error = reason
        w13_global = getattr(layer, W13_GLOBAL_PARAM, None)
        if w13_global is not None:
            w13_global.data.fill_(float("nan"))

    def expert_tensors(self, layer: torch.nn.Module) -> dict[str, Any]:
        """The op's weight arguments, as views of `layer`'s parameters (see the module docstring)."""
        if self.fmt == "mxfp4":
            return dict(w13=layer.w13_weight.view(torch.uint8), w13_scale=layer.w13_weight_scale_inv.view(torch.uint8),
                        w2=layer.w2_weight.view(torch.uint8), w2_scale=layer.w2_weight_scale_inv.view(torch.uint8),
                        fmt="mxfp4", w13_global=None, w2_global=None)
        return dict(w13=layer.w13_weight.view(torch.uint8), w13_scale=layer.w13_weight_scale,
                    w2=layer.w2_weight.view(torch.uint8), w2_scale=layer.w2_weight_scale,
                    fmt="nvfp4", w13_global=getattr(layer, W13_GLOBAL_PARAM), w2_global=layer.w2_weight_scale_2)

    def apply(self, layer: torch.nn.Module, dispatch_output: Any) -> Any:
        """hidden_states [M, K] bf16 and a standard top-k output -> StandardCombineInput([M, K])."""
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
        from sglang.srt.layers.moe.topk import TopKOutputChecker

        if self.load_error is not None:
            raise RuntimeError(f"Dsv4Fp4MoEMethod ({self.prefix}): the last weight load failed and the layer holds "
                               f"no consistent weights; load valid weights first ({self.load_error})")
        topk_output = dispatch_output.topk_output
        if not TopKOutputChecker.format_is_standard(topk_output):
            raise ValueError(f"Dsv4Fp4MoEMethod ({self.prefix}): needs the standard top-k output, got {topk_output.format}")
        out = torch.ops.dsv4.fp4_moe(
            dispatch_output.hidden_states, topk_output.topk_ids.to(torch.int32), topk_output.topk_weights.float(),
            swiglu_limit=self.swiglu_limit, **self.expert_tensors(layer))
        return StandardCombineInput(hidden_states=out)


def _sm120_dsv4_fused_moe(config: Any, layer: torch.nn.Module) -> bool:
    """The cases common to both hooks: an sm_120 device, a DeepSeek-V4 config, a FusedMoE layer."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend
    from sglang.srt.runtime_context import get_platform

    return (bool(get_platform().is_sm120) and getattr(config, "is_dsv4_fp4_experts", False)
            and isinstance(layer, FusedMoE) and get_moe_a2a_backend().is_none())


def _mxfp4_method(config: Any, prefix: str) -> Dsv4Fp4MoEMethod:
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod

    return Dsv4Fp4MoEMethod("mxfp4", Fp8MoEMethod(config), prefix)


def fp8_config_get_quant_method(original: Callable, config: Any, layer: torch.nn.Module, prefix: str) -> Any:
    """AROUND hook on Fp8Config.get_quant_method: DeepSeek-V4's MXFP4 experts on sm_120 (where
    SGLang picks FlashInfer's CUTLASS method for runner flashinfer_mxfp4) -> Dsv4Fp4MoEMethod."""
    from sglang.srt.layers.moe.utils import get_moe_runner_backend
    from sglang.srt.layers.quantization.utils import is_layer_skipped

    if (_sm120_dsv4_fused_moe(config, layer) and config.is_fp4_experts and not config.dequant_fp4_to_fp8
            and get_moe_runner_backend().is_flashinfer_mxfp4()
            and not is_layer_skipped(prefix, config.ignored_layers, fused_mapping=config.packed_modules_mapping)):
        log.debug("dsv4_compile: %s MXFP4 experts -> dsv4::fp4_moe", prefix)
        return _mxfp4_method(config, prefix)
    return original(config, layer, prefix)


def hybrid_config_get_quant_method(original: Callable, config: Any, layer: torch.nn.Module, prefix: str) -> Any:
    """AROUND hook on HybridFp8NvFp4Config.get_quant_method, on sm_120 for DeepSeek-V4:
    NVFP4 experts that SGLang would run with TRT-LLM, and the MXFP4 experts of NVFP4-excluded
    (MTP/NextN draft) layers, which SGLang always sends to TRT-LLM -> Dsv4Fp4MoEMethod."""
    from sglang.srt.layers.moe.utils import get_moe_runner_backend
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod

    if _sm120_dsv4_fused_moe(config, layer) and not getattr(config, "dequant_fp4_to_fp8", False):
        if not config.nvfp4_config.is_layer_excluded(prefix):
            backend = get_moe_runner_backend()
            if backend.is_auto() or backend.is_flashinfer_trtllm() or backend.is_flashinfer_trtllm_routed():
                log.debug("dsv4_compile: %s NVFP4 experts -> dsv4::fp4_moe", prefix)
                return Dsv4Fp4MoEMethod("nvfp4", ModelOptNvFp4FusedMoEMethod(config.nvfp4_config), prefix)
        elif config.is_fp4_experts:
            log.debug("dsv4_compile: %s MXFP4 draft experts -> dsv4::fp4_moe", prefix)
            return _mxfp4_method(config, prefix)
    return original(config, layer, prefix)


def register_moe_hooks() -> None:
    """Registers both AROUND hooks with SGLang's HookRegistry (applied by its load_plugins())."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(FP8_CONFIG_TARGET, fp8_config_get_quant_method, HookType.AROUND)
    HookRegistry.register(HYBRID_CONFIG_TARGET, hybrid_config_get_quant_method, HookType.AROUND)
