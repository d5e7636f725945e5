"""The models the end-to-end bench runs, and the cache state it times them on.

- `build_slice`: a full-width DeepSeek-V4-Flash slice (4 layers: sliding, CSA, HCA, CSA; hash
  MoE then top-k MoE) with random weights, built on the meta device and materialised on the GPU,
  its routed experts random packed MXFP4 (the dense bf16 experts are never allocated).
- `smoke_model`: the tiny CPU model of the tests, with MXFP4 experts.
- `cache_buffers` / `fill_caches_`: the step's position-indexed caches, filled with random
  values so that a step at start_pos = context reads a full context without a prefill.
- `decisive_routing`: a context in which every top-k router picks fixed experts, so that a
  bf16 near-tie cannot flip a routing choice between two implementations.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from dsv4_compile.model.fp4_experts import Fp4Experts, quantize_experts_

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
SLICE_LAYER_TYPES = (SLIDING, CSA, HCA, CSA)
SLICE_MLP_TYPES = ("hash_moe", "moe", "moe", "moe")
FULL_MODEL_LAYERS = 43  # V4-Flash; the tokens/s columns extrapolate the slice to this depth
MXFP4_BLOCK = 32
# ue8m0 bytes 119..121 = scales 2**-8..2**-6: with uniform e2m1 codes (rms 2.9) the expert
# outputs stay O(1) for unit-scale inputs at K = 4096 (a scale near 2**-3 would saturate the
# SwiGLU clamp at 10 on every element).
MXFP4_SCALE_BYTES = (119, 122)
CACHE_BUFFERS = ("window", "entries", "index_keys", "ring_kv", "ring_gate")


def slice_config():
    """DeepseekV4Config of the 4-layer V4-Flash slice: V4-Flash widths and the full vocabulary
    (129,280), rope left at the transformers defaults (which do not change the work of a step)."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=129280, hidden_size=4096, num_hidden_layers=len(SLICE_LAYER_TYPES),
        layer_types=list(SLICE_LAYER_TYPES), mlp_layer_types=list(SLICE_MLP_TYPES),
        num_attention_heads=64, head_dim=512, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
        index_n_heads=64, index_head_dim=128, index_topk=512, n_routed_experts=256,
        moe_intermediate_size=2048, num_experts_per_tok=6, hc_mult=4, sliding_window=128,
        compress_rates={CSA: 4, HCA: 128}, max_position_embeddings=1 << 20)


def _meta_fp4_experts(config, limit: float | None) -> Fp4Experts:
    """MXFP4 experts of the config's shape on the meta device (materialised by to_empty)."""
    experts, hidden, inter = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    with torch.device("meta"):
        tensors = {
            "w13": torch.empty(experts, 2 * inter, hidden // 2, dtype=torch.uint8),
            "w13_scale": torch.empty(experts, 2 * inter, hidden // MXFP4_BLOCK, dtype=torch.uint8),
            "w2": torch.empty(experts, hidden, inter // 2, dtype=torch.uint8),
            "w2_scale": torch.empty(experts, hidden, inter // MXFP4_BLOCK, dtype=torch.uint8),
        }
    return Fp4Experts("mxfp4", tensors, limit)


@torch.no_grad()
def _init_random_(model: nn.Module, generator: torch.Generator) -> None:
    """Random values, in place, for every parameter and buffer after to_empty: projections
    N(0, fan_in^-1), norms 1, sinks / biases N(0, 0.25), hyper-connection scales 1 + N(0, 0.01),
    hash tables distinct experts per token, MXFP4 codes uniform with MXFP4_SCALE_BYTES scales,
    rotary tables as transformers computes them."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    device = model.lm_head.weight.device
    for name, param in model.named_parameters():
        if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
            param.normal_(0.0, 0.5, generator=generator)
        elif name.endswith(("scale", "hc_scale")):
            param.normal_(1.0, 0.1, generator=generator)
        elif param.dim() >= 2:
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
        else:
            param.fill_(1.0)
    for module in model.modules():
        if isinstance(module, Fp4Experts):
            for name in ("w13", "w2"):
                getattr(module, name).random_(0, 256, generator=generator)
                getattr(module, f"{name}_scale").random_(*MXFP4_SCALE_BYTES, generator=generator)
        elif isinstance(module, DeepseekV4RotaryEmbedding):
            fresh = DeepseekV4RotaryEmbedding(module.config)  # f32 tables, as in a checkpoint
            for name, buf in fresh.named_buffers():
                setattr(module, name, buf.to(device))
        elif hasattr(module, "tid2eid"):
            table = module.tid2eid
            noise = torch.rand(table.shape[0], module.num_experts, device=table.device, generator=generator)
            table.copy_(noise.topk(table.shape[1], dim=1).indices)
        elif hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.normal_(0.0, 0.1, generator=generator)


def build_slice(device: torch.device) -> nn.Module:
    """The 4-layer V4-Flash slice as a transformers DeepseekV4ForCausalLM on `device`, eval mode.

    Every parameter is bf16 (also those transformers keeps in f32 when it loads a checkpoint),
    so every cache is bf16. Routed experts are Fp4Experts (MXFP4): w13 [256, 4096, 2048] and
    w2 [256, 4096, 1024] uint8 plus ue8m0 scales, about 3.4 GB per layer.
    """
    from transformers import DeepseekV4ForCausalLM

    config = slice_config()
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    for layer in model.model.layers:
        layer.mlp.experts = _meta_fp4_experts(config, config.swiglu_limit)
    model = model.to(dtype=torch.bfloat16).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    _init_random_(model, generator)
    model.requires_grad_(False)
    return model.eval()


class ExpertLayouts:
    """Both layouts of every Fp4Experts of a model, for side-by-side runs: the baselines run the
    row-major experts a user's model holds, optimize() the tiled ones it converts them to.

    Made before optimize() (it keeps the row-major tensors alive); `capture_tiled()` after it;
    `use(tiled)` sets the buffers of every module to one layout (a no-op when it is set already).
    """

    NAMES = ("w13", "w2")

    def __init__(self, model: nn.Module) -> None:
        self.modules = [layer.mlp.experts for layer in model.model.layers if isinstance(layer.mlp.experts, Fp4Experts)]
        self.row_major = [{n: getattr(m, n) for n in self.NAMES} for m in self.modules]
        self.tiled = self.row_major
        self.current = False

    def capture_tiled(self) -> None:
        self.tiled = [{n: getattr(m, n) for n in self.NAMES} for m in self.modules]
        self.current = True

    def use(self, tiled: bool) -> None:
        if tiled == self.current:
            return
        for module, tensors in zip(self.modules, self.tiled if tiled else self.row_major):
            for name, tensor in tensors.items():
                setattr(module, name, tensor)
        self.current = tiled


def smoke_model() -> nn.Module:
    """The tiny CPU model of the compile tests (every layer type, both MoE kinds), f32, with
    its routed experts quantised to MXFP4."""
    from dsv4_compile.tiny import FAST_COMPILE_OVERRIDES, tiny_model

    model = tiny_model(**FAST_COMPILE_OVERRIDES)
    quantize_experts_(model, "mxfp4")
    model.requires_grad_(False)
    return model


def cache_buffers(step: nn.Module) -> dict[str, torch.Tensor]:
    """The cache buffers of a DeepseekV4Step by qualified name: sliding-window rings, compressed
    entries (c4 in CSA layers, c128 in HCA layers), indexer key pages and compressor rings."""
    found = {}
    for index, attention in enumerate(step.attention):
        for name, buf in attention.named_buffers():
            if name.rsplit(".", 1)[-1] in CACHE_BUFFERS and not name.startswith("attn."):
                found[f"layers.{index}.{attention.layer_type}.{name}"] = buf
    return found


def cache_bytes_by_kind(step: nn.Module) -> dict[str, int]:
    """Bytes of the caches grouped by kind (e.g. 'compressed_sparse_attention.entries')."""
    totals: dict[str, int] = {}
    for name, buf in cache_buffers(step).items():
        kind = ".".join(name.split(".")[2:])
        totals[kind] = totals.get(kind, 0) + buf.numel() * buf.element_size()
    return totals


@torch.no_grad()
def fill_caches_(step: nn.Module, seed: int = 0) -> None:
    """Fills every cache buffer in place with N(0, 1) values (the scale of kv_norm outputs), so
    that any start_pos reads a full context of distinct, finite entries."""
    for buf in cache_buffers(step).values():
        generator = torch.Generator(device=buf.device).manual_seed(seed)
        buf.normal_(0.0, 1.0, generator=generator)
        seed += 1


@contextlib.contextmanager
def decisive_routing(model: nn.Module, seed: int = 0) -> Iterator[None]:
    """Within the context every top-k router's correction bias is raised by 100 on top_k random
    experts, so every token selects exactly them whatever the bf16 rounding of its scores (the
    routing weights still come from the scores); the biases are restored on exit. Hash routers
    are already exact (tid2eid[input_ids])."""
    generator = torch.Generator().manual_seed(seed)
    saved = []
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if not hasattr(gate, "e_score_correction_bias"):
                continue
            bias = gate.e_score_correction_bias
            saved.append((bias, bias.clone()))
            chosen = torch.randperm(bias.shape[0], generator=generator)[: gate.top_k].to(bias.device)
            bias[chosen] += 100.0
    try:
        yield
    finally:
        with torch.no_grad():
            for bias, original in saved:
                bias.copy_(original)
