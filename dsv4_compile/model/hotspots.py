"""The three hot spots of a DeepSeek-V4 serving step, in plain torch.

They are written the way serving engines write their portable fallbacks: capture-safe (static
shapes, no host syncs) and deliberately unoptimised. The FX passes in `dsv4_compile.passes`
recognise the post-grad graphs of these functions (and of independently written equivalents)
and rewrite them to the dsv4 ops. Keep the math here in step with transformers' DeepseekV4.
"""
import torch
import torch.nn.functional as F


def indexer_topk_full_context(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_pages: torch.Tensor,
    page_table: torch.Tensor,
    visible: torch.Tensor,
    softmax_scale: float,
    topk: int,
) -> torch.Tensor:
    """Lightning-indexer top-k over EVERY compressed slot of max context.

    q [B, T, H, D] (model dtype), weights [B, T, H] f32 (index_n_heads**-0.5 folded in),
    k_pages [P, 64, D], page_table [B, max_pages] int, visible [B, T] int: the number of
    compressed slots query token t may see. Returns idx [B, T, topk] int32: logical slots of
    the top-`topk` scores `sum_h w[h] * relu(q[h] . k[s]) * softmax_scale`, -1 for slots
    that are not visible. Work is O(max_pages * 64) whatever the real length.
    """
    batch, _, _, head_dim = q.shape
    keys = k_pages[page_table.long()].reshape(batch, -1, head_dim)  # [B, S_max, D]
    logits = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1))  # [B, T, H, S]
    scores = F.relu(logits) * softmax_scale
    scores = (scores * weights.unsqueeze(-1)).sum(dim=2)  # [B, T, S]
    slots = torch.arange(scores.shape[-1], device=scores.device)
    hidden = slots.view(1, 1, -1) >= visible.unsqueeze(-1)
    scores = scores.masked_fill(hidden, float("-inf"))
    top = scores.topk(topk, dim=-1).indices
    return torch.where(top >= visible.unsqueeze(-1), -1, top).to(torch.int32)


def gather_rows(rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """rows [N, D], idx [B, T, K] int (-1 = none) -> [B, T, K, D]; -1 reads row 0 (masked later)."""
    return rows[idx.clamp(min=0).long()]


def sparse_attention_with_sink(
    q: torch.Tensor,
    kv: torch.Tensor,
    valid: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """MQA attention of T query tokens over gathered rows, with a per-head sink.

    q [B, T, H, D], kv [B, T, K, D] (K == V, one KV head), valid [B, T, K] bool, sink [H] f32.
    Returns [B, T, H, D] in q's dtype: softmax over (scale * q.k for valid rows, sink) @ v,
    the sink taking probability mass but giving no value (a row with nothing valid gives 0).
    """
    batch, tokens, heads, _ = q.shape
    logits = torch.matmul(q, kv.transpose(-1, -2)) * scale  # [B, T, H, K]
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    sinks = sink.view(1, 1, heads, 1).expand(batch, tokens, heads, 1)
    combined = torch.cat([logits, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(kv.dtype), kv)


def moe_experts_gathered(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """Routed experts, one weight gather per (token, choice), then the weighted sum.

    x [M, K], topk_ids [M, k] int, topk_weights [M, k] f32, w13 [E, 2I, K] (rows [0, I) gate,
    [I, 2I) up), w2 [E, K, I]; all weights in x's dtype. Returns [M, K] in x's dtype:
    sum_j w[m, j] * W2[e_j] @ (silu(min(gate, limit)) * clamp(up, -limit, limit)).
    """
    ids = topk_ids.long()
    return _routed_swiglu(x, w13[ids], w2[ids], topk_weights, swiglu_limit)


def moe_experts_fp4(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    fmt: str,
    w13_global: torch.Tensor | None,
    w2_global: torch.Tensor | None,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """Routed FP4 experts: gather the packed weights per (token, choice), dequantise, then the
    math of `moe_experts_gathered`.

    x [M, K], topk_ids [M, k] int in [0, E), topk_weights [M, k] f32; w13 [E, 2I, K/2] and
    w2 [E, K, I/2] uint8 packed e2m1; fmt "mxfp4" (scales uint8 ue8m0 [E, rows, cols/32],
    globals None) or "nvfp4" (scales e4m3 [E, rows, cols/16], globals [E] f32). w13 and w2 may
    both be in the tiled layout (dsv4_compile.fp4_tiles): the gathered tiles are put back in row
    order, each word's bits unswizzled, before dequantising.
    Returns [M, K] in x's dtype.
    """
    from dsv4_compile.fp4 import dequantize_mxfp4, dequantize_nvfp4
    from dsv4_compile.fp4_tiles import is_tiled, untile_fp4

    ids = topk_ids.long()
    w13_g, w2_g = w13[ids], w2[ids]
    if is_tiled(w13):
        w13_g, w2_g = untile_fp4(w13_g), untile_fp4(w2_g)
    if fmt == "mxfp4":
        gate_up_w = dequantize_mxfp4(w13_g, w13_scale[ids], x.dtype)
        down_w = dequantize_mxfp4(w2_g, w2_scale[ids], x.dtype)
    else:
        gate_up_w = dequantize_nvfp4(w13_g, w13_scale[ids], w13_global[ids], x.dtype)
        down_w = dequantize_nvfp4(w2_g, w2_scale[ids], w2_global[ids], x.dtype)
    return _routed_swiglu(x, gate_up_w, down_w, topk_weights, swiglu_limit)


def _routed_swiglu(x: torch.Tensor, gate_up_w: torch.Tensor, down_w: torch.Tensor,
                   topk_weights: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """x [M, K], per-(token, choice) weights gate_up_w [M, k, 2I, K], down_w [M, k, K, I]."""
    gate_up = torch.matmul(gate_up_w, x[:, None, :, None]).squeeze(-1)  # [M, k, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    hidden = F.silu(gate) * up
    out = torch.matmul(down_w, hidden.unsqueeze(-1)).squeeze(-1)  # [M, k, K]
    return (out * topk_weights.unsqueeze(-1)).to(x.dtype).sum(dim=1)
