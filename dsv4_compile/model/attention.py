"""Static-cache DeepSeek-V4 attention for one layer: sliding window, CSA or HCA.

The KV of the window lives in a position-indexed ring, the compressed entries in per-row
arrays (c4 / c128) with one trash slot at the end, and the indexer's c4 keys in 64-slot pages
behind a page table. Index lists are laid out so that the T query tokens of a request share
rows: the window list and the HCA list are the same rows for every token, -1 where a token may
not look.
"""
import torch
from torch import nn

from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

from .compressor import StaticCompressor
from .fused_linear import FusedLinear
from .hotspots import gather_rows, indexer_topk_full_context, sparse_attention_with_sink
from .layout import INDEX_PAGE_SLOTS, StepLayout

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def _kv_dtype(norm: nn.Module, proj: nn.Linear) -> torch.dtype:
    """dtype of kv_norm(proj(x)): transformers' RMSNorm multiplies by its (maybe f32) weight."""
    return torch.promote_types(norm.weight.dtype, proj.weight.dtype)


class StaticAttention(nn.Module):
    """One DeepseekV4Attention (`module`, weights shared) served from static caches."""

    def __init__(self, module: nn.Module, layout: StepLayout, index_pages: int) -> None:
        super().__init__()
        self.attn = module
        self.layer_type = module.layer_type
        self.layout = layout
        config = module.config
        device = module.kv_proj.weight.device
        self.head_dim = config.head_dim
        kv_dtype = _kv_dtype(module.kv_norm, module.kv_proj)
        self.register_buffer(
            "window", torch.zeros(layout.rows, layout.window_ring, self.head_dim, dtype=kv_dtype, device=device),
            persistent=False)
        self.compressor: StaticCompressor | None = None
        self.index_compressor: StaticCompressor | None = None
        self.projections = FusedLinear(self._input_projections())
        if self.layer_type == SLIDING:
            return
        rate = layout.csa_rate if self.layer_type == CSA else layout.hca_rate
        overlap = self.layer_type == CSA
        comp = module.compressor
        comp_dtype = comp.kv_proj.weight.dtype
        self.compressor = StaticCompressor(comp, rate, self.head_dim, overlap, layout.rows,
                                           layout.compressor_ring(rate, overlap), comp_dtype)
        self.rate = rate
        self.max_entries = layout.entries(rate)
        entry_dtype = _kv_dtype(comp.kv_norm, comp.kv_proj)
        self.register_buffer(
            "entries", torch.zeros(layout.rows, self.max_entries + 1, self.head_dim, dtype=entry_dtype,
                                   device=device), persistent=False)
        if self.layer_type == CSA:
            indexer = comp.indexer
            self.index_compressor = StaticCompressor(
                indexer, rate, indexer.head_dim, True, layout.rows, layout.compressor_ring(rate, True),
                indexer.kv_proj.weight.dtype)
            pages = layout.rows * index_pages + 1  # every row's pages plus one trash page
            self.register_buffer(
                "index_keys", torch.zeros(pages, INDEX_PAGE_SLOTS, indexer.head_dim,
                                          dtype=_kv_dtype(indexer.kv_norm, indexer.kv_proj), device=device),
                persistent=False)

    def _input_projections(self) -> dict[str, nn.Linear]:
        """Every projection of the layer's input (see forward and the compressors)."""
        attn = self.attn
        linears = {"q_a": attn.q_a_proj, "kv": attn.kv_proj}
        if self.layer_type != SLIDING:
            linears.update(comp_kv=attn.compressor.kv_proj, comp_gate=attn.compressor.gate_proj)
        if self.layer_type == CSA:
            indexer = attn.compressor.indexer
            linears.update(index_kv=indexer.kv_proj, index_gate=indexer.gate_proj,
                           index_weights=indexer.scorer.weights_proj)
        return linears

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], page_table: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, hidden_size] (after input_layernorm), positions [B, T] int64,
        rows [B] int64, rope = (cos, sin) of this layer's rope type, page_table
        [rows, pages] int32 (the indexer key pages of each cache row). Returns [B, T, hidden_size]."""
        attn = self.attn
        batch, tokens, _ = hidden.shape
        cos, sin = rope
        proj = self.projections(hidden)
        q_residual = attn.q_a_norm(proj["q_a"])
        q = attn.q_b_proj(q_residual).view(batch, tokens, -1, self.head_dim).transpose(1, 2)
        q = apply_rotary_pos_emb(attn.q_b_norm(q), cos, sin).transpose(1, 2)  # [B, T, H, D]
        kv = attn.kv_norm(proj["kv"]).view(batch, tokens, 1, self.head_dim).transpose(1, 2)
        kv = apply_rotary_pos_emb(kv, cos, sin)[:, 0]  # [B, T, D]

        ring = self.window.shape[1]
        self.window[rows[:, None], positions % ring] = kv.to(self.window.dtype)
        window_idx = self._window_index(positions, rows)
        kv_rows = gather_rows(self.window.view(-1, self.head_dim), window_idx)
        valid = window_idx >= 0
        if self.compressor is not None:
            extra_idx = self._compressed_index(hidden, proj, q_residual, positions, rows, page_table)
            extra_rows = gather_rows(self.entries.view(-1, self.head_dim), extra_idx)
            kv_rows = torch.cat([kv_rows.to(extra_rows.dtype), extra_rows], dim=2)
            valid = torch.cat([valid, extra_idx >= 0], dim=2)
        out = sparse_attention_with_sink(q, kv_rows, valid, attn.sinks, attn.scaling)  # [B, T, H, D]

        out = apply_rotary_pos_emb(out.transpose(1, 2), cos, -sin).transpose(1, 2)
        grouped = attn.o_a_proj(out.reshape(batch, tokens, attn.config.o_groups, -1)).flatten(2)
        return attn.o_b_proj(grouped)

    def live_state(self, row: int, length: int, page_table: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every cache entry a later step of `row` can read once `length` tokens are in."""
        device = self.window.device
        window = torch.arange(max(0, length - self.layout.sliding_window), length, device=device)
        state = {"window": self.window[row, window % self.window.shape[1]]}
        if self.compressor is None:
            return state
        state["entries"] = self.entries[row, : length // self.rate]
        state.update({f"carry.{k}": v for k, v in self.compressor.live_state(row, length).items()})
        if self.index_compressor is not None:
            slots = torch.arange(length // self.rate, device=device)
            pages = page_table[row].long()[slots // INDEX_PAGE_SLOTS]
            state["index_keys"] = self.index_keys[pages, slots % INDEX_PAGE_SLOTS]
            state.update({f"index_carry.{k}": v
                          for k, v in self.index_compressor.live_state(row, length).items()})
        return state

    def _window_index(self, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[B, T, W + T - 1] window rows shared by the T tokens; -1 outside a token's window."""
        window = self.layout.sliding_window
        tokens = positions.shape[1]
        span = positions[:, :1] - window + 1 + torch.arange(window + tokens - 1, device=positions.device)
        query = positions[:, :, None]
        seen = (span[:, None, :] >= 0) & (span[:, None, :] <= query) & (span[:, None, :] > query - window)
        row_ids = rows[:, None] * self.window.shape[1] + span % self.window.shape[1]
        return torch.where(seen, row_ids[:, None, :], -1)

    def _compressed_index(self, hidden: torch.Tensor, proj: dict[str, torch.Tensor], q_residual: torch.Tensor,
                          positions: torch.Tensor, rows: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
        """Writes this step's compressed entries and returns [B, T, K] rows of `entries` to attend.
        proj: the projections of the layer input `hidden` (self.projections)."""
        stride = self.entries.shape[1]
        trash = self.max_entries
        compressed, entry_ids = self.compressor(proj["comp_kv"], proj["comp_gate"], positions, rows,
                                                self.max_entries)
        self.entries[rows[:, None], torch.where(entry_ids >= 0, entry_ids, trash)] = compressed.to(self.entries.dtype)
        visible = (positions + 1) // self.rate  # [B, T]
        if self.layer_type == HCA:
            slots = torch.arange(self.max_entries, device=positions.device)
            seen = slots.view(1, 1, -1) < visible[..., None]
            return torch.where(seen, rows[:, None, None] * stride + slots, -1)
        slots = self._indexer_topk(hidden, proj, q_residual, positions, rows, visible, page_table)
        return torch.where(slots >= 0, rows[:, None, None] * stride + slots, -1)

    def _indexer_topk(self, hidden: torch.Tensor, proj: dict[str, torch.Tensor], q_residual: torch.Tensor,
                      positions: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor,
                      page_table: torch.Tensor) -> torch.Tensor:
        """Writes the indexer keys of this step's closed windows; returns top-k slots [B, T, k]."""
        indexer = self.attn.compressor.indexer
        batch, tokens, _ = hidden.shape
        keys, entry_ids = self.index_compressor(proj["index_kv"], proj["index_gate"], positions, rows,
                                                self.max_entries)
        table = page_table[rows]  # [B, pages]
        # int64: inductor's Triton scatter multiplies the loaded page id by the page stride in the
        # id's own dtype, and past 2**31 / (64 * head_dim) pages an int32 product overflows.
        page = torch.gather(table, 1, entry_ids.clamp(min=0) // INDEX_PAGE_SLOTS).long()
        trash_page = self.index_keys.shape[0] - 1
        page = torch.where(entry_ids >= 0, page, trash_page)
        self.index_keys[page, entry_ids.clamp(min=0) % INDEX_PAGE_SLOTS] = keys.to(self.index_keys.dtype)

        cos, sin = indexer.rotary_emb(hidden, position_ids=positions, layer_type=indexer.rope_layer_type)
        q = indexer.q_b_proj(q_residual).view(batch, tokens, -1, indexer.head_dim).transpose(1, 2)
        q = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)  # [B, T, Hi, Di]
        scorer = indexer.scorer
        weights = proj["index_weights"].float() * scorer.weights_scaling
        topk = min(indexer.index_topk, self.max_entries)
        return indexer_topk_full_context(q, weights, self.index_keys, table, visible,
                                         scorer.softmax_scale, topk)
