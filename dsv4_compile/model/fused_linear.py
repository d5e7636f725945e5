"""Several nn.Linear layers that read one input, computed as one matrix product per weight dtype.

At decode a layer's input [B*T, 4096] (1 to 64 rows) goes through up to seven small projections
(q_a, kv, the compressors' kv and gate, the indexer's kv, gate and head weights; the shared
expert's gate and up). Each of them alone is bound by launch and ramp-up more than by bytes:
cuBLAS took 6.6-10.2 us for 4-17 MB weights on the H200 (11-53% of HBM), against 58-75% for
64-67 MB weights (bench/RESULTS.md, ninth session). One product over the concatenated weights
reads the same bytes in one launch.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("dsv4_compile")


def _fusable(lin: nn.Module) -> bool:
    """A plain bias-free nn.Linear with a floating (not float8) weight and no hooks: its forward is
    F.linear(x, weight) and nothing else. Subclasses (FP8 layers with scales, adapters) are not."""
    return (type(lin) is nn.Linear and lin.bias is None and lin.weight.dtype.is_floating_point
            and lin.weight.element_size() >= 2 and not lin._forward_hooks and not lin._forward_pre_hooks)


class FusedLinear(nn.Module):
    """`linears` (name -> nn.Linear, all of one in_features) as one product per weight dtype.

    Plain bias-free layers of one dtype (see _fusable) share a concatenated weight, a copy taken
    here (the fused model serves the weights it was built with; the originals stay untouched);
    any other layer, or one alone in its dtype, runs its own forward. forward(x [..., in_features])
    -> {name: layer(x)}, the fused ones as column slices of one product.
    """

    def __init__(self, linears: dict[str, nn.Linear]) -> None:
        super().__init__()
        widths = {lin.in_features for lin in linears.values()}
        if len(widths) != 1:
            raise ValueError(f"FusedLinear: the layers must share in_features, got {sorted(widths)}")
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, lin in linears.items():
            if _fusable(lin):
                by_dtype.setdefault(lin.weight.dtype, []).append(name)
        self.groups: list[tuple[str, tuple[str, ...], tuple[int, ...]]] = []
        fused = set()
        for index, names in enumerate(n for n in by_dtype.values() if len(n) > 1):
            weight = torch.cat([linears[n].weight.detach() for n in names])
            self.register_buffer(f"weight_{index}", weight, persistent=False)
            self.groups.append((f"weight_{index}", tuple(names), tuple(linears[n].out_features for n in names)))
            fused.update(names)
            log.debug("dsv4: fused %s into one [%d, %d] %s product (%.1f MB copy)", ", ".join(names),
                      *weight.shape, weight.dtype, weight.numel() * weight.element_size() / 1e6)
        self.single = nn.ModuleDict({n: lin for n, lin in linears.items() if n not in fused})

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {name: lin(x) for name, lin in self.single.items()}
        for buffer, names, widths in self.groups:
            out.update(zip(names, F.linear(x, getattr(self, buffer)).split(widths, dim=-1)))
        return out
