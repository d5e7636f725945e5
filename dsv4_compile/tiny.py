"""A tiny random DeepSeek-V4 for the demo and the tests: every layer type, both MoE kinds."""
from typing import Any

import torch

TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "num_attention_heads": 4,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 32,
    "index_head_dim": 16,
    "index_topk": 8,
    "sliding_window": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                        "beta_fast": 32, "beta_slow": 1},
}


# Fewer layers (still every layer type and both MoE kinds) and Sinkhorn steps: inductor's CPU
# codegen time grows with the graph, and the demo and the compile tests run on 2 CPU cores.
FAST_COMPILE_OVERRIDES: dict[str, Any] = {
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "hc_sinkhorn_iters": 2,
}


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               **overrides: Any) -> torch.nn.Module:
    """A random transformers DeepseekV4ForCausalLM from TINY_CONFIG (+ overrides), eval mode.

    Parameters that transformers initialises to constants (sinks, biases, tid2eid) are drawn at
    random too, so that every path of the model matters.
    """
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(**{**TINY_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            elif name.endswith(("scale", "hc_scale")):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                experts = config.n_routed_experts
                picks = torch.stack([torch.randperm(experts, generator=generator)[: buf.shape[1]]
                                     for _ in range(buf.shape[0])])
                buf.copy_(picks)
            elif name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=generator))
    return model.to(device=device, dtype=dtype).eval()
