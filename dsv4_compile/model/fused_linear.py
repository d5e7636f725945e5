"""Several nn.Linear layers that read one input, computed as one matrix product per weight dtype.

At decode a layer's input [B*T, 4096] (1 to 64 rows) goes through up to seven small projections
(q_a, kv, the compressors' kv and gate, the indexer's kv, gate and head weights; the shared
expert's gate and up). Each of them alone is bound by launch and ramp-up, not bytes: cuBLAS took
~6-10 us for 0.5-17 MB weights on the H200, 11-36% of HBM, against 60-77% for 64 MB weights
(bench/RESULTS.md, ninth session). One product over the concatenated weights reads the same bytes
in one launch.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("dsv4_compile")


class FusedLinear(nn.Module):
    """`linears` (name -> nn.Linear, all of one in_features) as one product per weight dtype.

    Bias-free layers of one dtype share a concatenated weight, a copy taken here (the fused
    model serves the weights it was built with; the originals stay untouched); a layer with a
    bias, or alone in its dtype, runs as it is. forward(x [..., in_features]) -> {name: x @ W^T}
    in the layers' own dtypes, each a column slice of the fused output.
    """

    def __init__(self, linears: dict[str, nn.Linear]) -> None:
        super().__init__()
        widths = {lin.in_features for lin in linears.values()}
        if len(widths) != 1:
            raise ValueError(f"FusedLinear: the layers must share in_features, got {sorted(widths)}")
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, lin in linears.items():
            if lin.bias is None:
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
