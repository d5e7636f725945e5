"""dsv4::moe_route: DeepSeek-V4 expert routing (top-k and hash), reference-only.

The op has no Triton kernel: its work is one small [M, K] x [K, E] GEMM plus an [M, E] top-k,
which inductor already compiles well once the op is decomposed by tracing; the op exists so the
routing has one spec and one name. The math follows transformers' DeepseekV4TopKRouter and
DeepseekV4HashRouter (5.17):
  scores  = sqrt(softplus(hidden @ gate_weight^T))
  ids     = topk(scores + bias, top_k)            (top-k router; the bias only selects)
          = tid2eid[input_ids]                     (hash router)
  weights = scores[ids] / (sum(scores[ids]) + 1e-20) * routed_scaling
The logits are computed in f32 (transformers uses the module dtype; the two agree for f32
models, and in bf16 only near-ties of the selection can differ).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _check(hidden, gate_weight, bias, tid2eid, input_ids, top_k):
    if hidden.ndim != 2 or not hidden.dtype.is_floating_point:
        raise TypeError(f"moe_route: hidden must be [M, K] floating, got {tuple(hidden.shape)} {hidden.dtype}")
    if gate_weight.ndim != 2 or gate_weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"moe_route: gate_weight must be [E, K={hidden.shape[1]}], got {tuple(gate_weight.shape)}")
    experts = gate_weight.shape[0]
    if not 1 <= top_k <= experts:
        raise ValueError(f"moe_route: top_k must be in [1, E={experts}], got {top_k}")
    if bias is not None and (tuple(bias.shape) != (experts,) or bias.dtype != torch.float32):
        raise TypeError(f"moe_route: bias must be [E={experts}] float32, got {tuple(bias.shape)} {bias.dtype}")
    if (tid2eid is None) != (input_ids is None):
        raise ValueError("moe_route: tid2eid and input_ids go together (hash routing) or are both None")
    if tid2eid is not None:
        if bias is not None:
            raise ValueError("moe_route: hash routing (tid2eid) takes no correction bias")
        if tid2eid.ndim != 2 or tid2eid.shape[1] != top_k:
            raise ValueError(f"moe_route: tid2eid must be [V, top_k={top_k}], got {tuple(tid2eid.shape)}")
        if tuple(input_ids.shape) != (hidden.shape[0],):
            raise ValueError(f"moe_route: input_ids must be [M={hidden.shape[0]}], got {tuple(input_ids.shape)}")


def moe_route_reference(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    top_k: int,
    routed_scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [M, K], gate_weight [E, K], bias [E] f32 | None, tid2eid [V, k] int | None,
    input_ids [M] int | None -> (topk_ids [M, k] int32, topk_weights [M, k] f32). Capture-safe."""
    scores = F.softplus(F.linear(hidden.float(), gate_weight.float())).sqrt()
    if tid2eid is not None:
        ids = tid2eid[input_ids.long()].long()
    else:
        select = scores if bias is None else scores + bias
        ids = torch.topk(select, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids.to(torch.int32), weights * routed_scaling


@torch.library.custom_op("dsv4::moe_route", mutates_args=())
def moe_route(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    top_k: int,
    routed_scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert routing, see the module docstring. Runs the torch reference on every device."""
    _check(hidden, gate_weight, bias, tid2eid, input_ids, top_k)
    return moe_route_reference(hidden, gate_weight, bias, tid2eid, input_ids, top_k, routed_scaling)


@moe_route.register_fake
def _(hidden, gate_weight, bias, tid2eid, input_ids, top_k, routed_scaling):
    shape = (hidden.shape[0], top_k)
    return (hidden.new_empty(shape, dtype=torch.int32), hidden.new_empty(shape, dtype=torch.float32))
