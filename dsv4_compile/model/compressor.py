"""Static-cache form of DeepSeek-V4's KV compressors (CSA, HCA and the indexer's).

All state is indexed by absolute token position, so a step never depends on how earlier tokens
were split into steps, and rolling back rejected drafts needs no work: what they wrote is
unreachable until the real tokens at those positions overwrite it.

- The carry state is a ring of the projected (kv, gate) rows of the latest tokens: the tokens
  buffered for the open window and, for overlapping (CSA) compressors, the previous window
  whose Ca slice the next entry needs.
- A step of T tokens can close at most ceil(T / rate) windows. Each candidate window is
  computed; the ones that did not close (or lie past max_context) are written to a trash slot.
"""
import torch
from torch import nn

from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb


class StaticCompressor(nn.Module):
    """Wraps one transformers compressor (HCA, CSA or indexer) with a position-indexed ring.

    `module` is the transformers compressor whose weights are used as they are (no copies).
    `overlap` is True for the two-series (Ca, Cb) CSA and indexer compressors.
    """

    def __init__(self, module: nn.Module, rate: int, head_dim: int, overlap: bool, rows: int,
                 ring: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.rate = rate
        self.head_dim = head_dim
        self.overlap = overlap
        width = (2 if overlap else 1) * head_dim
        device = module.kv_proj.weight.device
        if ring % rate:
            raise ValueError(f"ring: {ring} slots must be whole windows of {rate}")
        self.register_buffer("ring_kv", torch.zeros(rows, ring, width, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("ring_gate", torch.zeros(rows, ring, width, dtype=dtype, device=device),
                             persistent=False)

    def forward(self, kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                max_entries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers T new tokens and computes every window that may close in this step.

        kv, gate [B, T, width]: the module's kv_proj and gate_proj of the T tokens' hidden states,
        positions [B, T] int64 (consecutive per request),
        rows [B] int64 cache rows. Returns (entries [B, C, head_dim], entry_ids [B, C] int64)
        with C = ceil(T / rate); entry_ids is -1 where the window did not close in this step
        or lies at or past `max_entries`.
        """
        ring = self.ring_kv.shape[1]
        slot = positions % ring
        self.ring_kv[rows[:, None], slot] = kv.to(self.ring_kv.dtype)
        self.ring_gate[rows[:, None], slot] = gate.to(self.ring_gate.dtype)

        tokens = positions.shape[1]
        candidates = -(-tokens // self.rate)
        first = positions[:, :1]
        entry = first // self.rate + torch.arange(candidates, device=positions.device)  # [B, C]
        closes = (entry + 1) * self.rate - 1 <= positions[:, -1:]
        entry_ids = torch.where(closes & (entry < max_entries), entry, -1)

        if self.overlap:
            window_kv, window_gate = self._overlapping_windows(entry, rows)
        else:
            window_kv = self._window(self.ring_kv, rows, entry)
            window_gate = self._window(self.ring_gate, rows, entry) + self.module.position_bias
        weights = window_gate.softmax(dim=2, dtype=torch.float32).to(window_kv.dtype)
        compressed = self.module.kv_norm((window_kv * weights).sum(dim=2))  # [B, C, head_dim]
        cos, sin = self.module.rotary_emb(compressed, position_ids=entry * self.rate,
                                          layer_type=self.module.rope_layer_type)
        compressed = apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin)[:, 0]
        return compressed, entry_ids

    def live_state(self, row: int, length: int) -> dict[str, torch.Tensor]:
        """The carry rows a later step of `row` can read once `length` tokens are in."""
        start = max(0, (length // self.rate - (1 if self.overlap else 0)) * self.rate)
        slots = torch.arange(start, length, device=self.ring_kv.device) % self.ring_kv.shape[1]
        return {"kv": self.ring_kv[row, slots], "gate": self.ring_gate[row, slots]}

    def _window(self, ring_rows: torch.Tensor, rows: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """ring_rows [R, ring, W] -> the `rate` slots of window `window` [B, C] of rows [B]: [B, C, rate, W].

        The ring holds whole windows, so a window is one block: the gather indexes (row, block) and
        leaves the slots and columns to plain strides, which inductor reduces over coalesced."""
        blocks = ring_rows.view(ring_rows.shape[0], -1, self.rate, ring_rows.shape[2])
        return blocks[rows[:, None], window % blocks.shape[1]]

    def _overlapping_windows(self, entry: torch.Tensor, rows: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Entry w [B, C] mixes window w-1's Ca slice with window w's Cb slice: [B, C, 2*rate, D]."""
        dim = self.head_dim
        bias = self.module.position_bias
        ca_kv = self._window(self.ring_kv, rows, entry - 1)[..., :dim]
        ca_gate = (self._window(self.ring_gate, rows, entry - 1) + bias)[..., :dim]
        cb_kv = self._window(self.ring_kv, rows, entry)[..., dim:]
        cb_gate = (self._window(self.ring_gate, rows, entry) + bias)[..., dim:]
        before_start = (entry < 1)[..., None, None]  # window -1 does not exist: weight 0
        ca_kv = torch.where(before_start, torch.zeros_like(ca_kv), ca_kv)
        ca_gate = torch.where(before_start, torch.full_like(ca_gate, float("-inf")), ca_gate)
        return torch.cat([ca_kv, cb_kv], dim=2), torch.cat([ca_gate, cb_gate], dim=2)
