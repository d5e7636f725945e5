"""The static-cache DeepSeek-V4 serving step built on a transformers DeepseekV4ForCausalLM."""
import torch
from torch import nn

from .attention import StaticAttention
from .fp4_experts import RoutedExperts
from .fused_linear import FusedLinear
from .layout import StepLayout


class SharedExpert(nn.Module):
    """transformers' DeepseekV4MLP (`mlp`, weights shared) with gate_proj and up_proj as one product."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp
        self.gate_up = FusedLinear({"gate": mlp.gate_proj, "up": mlp.up_proj})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> down(act(min(gate, limit)) * clamp(up, -limit, limit)), as the MLP."""
        mlp = self.mlp
        proj = self.gate_up(x)
        gate = proj["gate"].clamp(max=mlp.limit)
        up = proj["up"].clamp(min=-mlp.limit, max=mlp.limit)
        return mlp.down_proj(mlp.act_fn(gate) * up)


def _moe(block: nn.Module, experts: RoutedExperts, shared: SharedExpert, hidden: torch.Tensor,
         input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' DeepseekV4SparseMoeBlock without host syncs. hidden [B, T, K]."""
    batch, tokens, width = hidden.shape
    if block.is_hash:
        _, weights, ids = block.gate(hidden, input_ids)
    else:
        _, weights, ids = block.gate(hidden)
    routed = experts(hidden.reshape(-1, width), ids, weights)
    return routed.view(batch, tokens, width) + shared(hidden)


class DeepseekV4Step(nn.Module):
    """step(input_ids [B, T] int64, start_pos [B] int64, rows [B] int64) -> logits [B, T, V].

    Token t of request b sits at position start_pos[b] + t and reads and writes cache row
    rows[b]. T = 1 is decode, T = 1 + drafts is verify, larger T a prefill chunk. Caches are
    module buffers sized by `layout`; the weights are those of `model` (shared, not copied).
    """

    def __init__(self, model: nn.Module, layout: StepLayout) -> None:
        super().__init__()
        self.hf = model
        self.layout = layout
        inner = model.model
        device = inner.embed_tokens.weight.device
        pages = layout.index_pages
        table = torch.arange(layout.rows * pages, dtype=torch.int32, device=device).view(layout.rows, pages)
        self.register_buffer("page_table", table, persistent=False)
        self.attention = nn.ModuleList(
            StaticAttention(layer.self_attn, layout, pages) for layer in inner.layers)
        self.routed = nn.ModuleList(RoutedExperts(layer.mlp.experts) for layer in inner.layers)
        self.shared = nn.ModuleList(SharedExpert(layer.mlp.shared_experts) for layer in inner.layers)

    def live_state(self, row: int, length: int) -> dict[str, torch.Tensor]:
        """Every cache entry a later step of cache row `row` can read once `length` tokens are
        in, by layer. Entries beyond that (a rejected draft's writes) are unreachable."""
        state = {}
        for i, attention in enumerate(self.attention):
            for name, value in attention.live_state(row, length, self.page_table).items():
                state[f"layers.{i}.{name}"] = value
        return state

    def forward(self, input_ids: torch.Tensor, start_pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        inner = self.hf.model
        config = inner.config
        tokens = input_ids.shape[1]
        positions = start_pos[:, None] + torch.arange(tokens, device=input_ids.device)
        embeds = inner.embed_tokens(input_ids)
        hidden = embeds.unsqueeze(2).expand(-1, -1, config.hc_mult, -1).contiguous()
        rope = {kind: inner.rotary_emb(embeds, position_ids=positions, layer_type=kind)
                for kind in ("main", "compress")}
        for layer, attention, experts, shared in zip(inner.layers, self.attention, self.routed, self.shared):
            dtype = hidden.dtype
            post, comb, collapsed = layer.attn_hc(hidden)
            kind = "main" if attention.layer_type == "sliding_attention" else "compress"
            attn_out = attention(layer.input_layernorm(collapsed), positions, rows, rope[kind], self.page_table)
            hidden = post.to(dtype).unsqueeze(-1) * attn_out.unsqueeze(-2) + torch.matmul(
                comb.to(dtype).transpose(-1, -2), hidden)
            post, comb, collapsed = layer.ffn_hc(hidden)
            mlp_out = _moe(layer.mlp, experts, shared, layer.post_attention_layernorm(collapsed), input_ids)
            hidden = post.to(dtype).unsqueeze(-1) * mlp_out.unsqueeze(-2) + torch.matmul(
                comb.to(dtype).transpose(-1, -2), hidden)
        return self.hf.lm_head(inner.norm(inner.hc_head(hidden)))
