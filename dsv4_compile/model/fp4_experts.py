"""Routed experts in FP4 (MXFP4 or NVFP4) and how the step reads any expert storage."""
import torch
from torch import nn

from dsv4_compile.fp4 import (dequantize_mxfp4, dequantize_nvfp4, experts_from_transformers, quantize_mxfp4,
                              quantize_nvfp4)
from dsv4_compile.fp4_tiles import (TILE_COLS, TILE_ROWS, experts_split_into_tiles, is_tiled, tile_fp4,
                                    untile_fp4)

from .hotspots import moe_experts_fp4, moe_experts_gathered

FP4_FORMATS = ("mxfp4", "nvfp4")


class Fp4Experts(nn.Module):
    """A drop-in for transformers' DeepseekV4Experts whose weights are packed FP4.

    Buffers: w13 [E, 2I, K/2] and w2 [E, K, I/2] uint8 (e2m1 pairs), their scales (MXFP4:
    uint8 ue8m0 per 32; NVFP4: e4m3 per 16) and, for NVFP4, per-expert f32 global scales.
    `tile_()` moves the packed weights to the tiled layout (dsv4_compile.fp4_tiles), which the
    fp4_moe kernels stream faster; every path of the module reads either layout.
    forward(hidden [M, K], top_k_index [M, k], top_k_weights [M, k]) -> [M, K] dequantises the
    gathered experts in plain torch, so transformers' own forward can run it too.
    """

    def __init__(self, fmt: str, tensors: dict[str, torch.Tensor | None], limit: float | None) -> None:
        super().__init__()
        if fmt not in FP4_FORMATS:
            raise ValueError(f"fmt must be one of {FP4_FORMATS}; got {fmt!r}")
        self.fmt = fmt
        self.limit = limit
        for name in ("w13", "w13_scale", "w2", "w2_scale", "w13_global", "w2_global"):
            self.register_buffer(name, tensors.get(name))

    @classmethod
    def quantize(cls, experts: nn.Module, fmt: str) -> "Fp4Experts":
        """Quantises a dense DeepseekV4Experts (gate_up_proj [E, 2I, K], down_proj [E, K, I])."""
        tensors: dict[str, torch.Tensor | None] = {}
        for name, weight in (("w13", experts.gate_up_proj), ("w2", experts.down_proj)):
            if fmt == "mxfp4":
                tensors[name], tensors[f"{name}_scale"] = quantize_mxfp4(weight.detach().float())
                tensors[f"{name}_global"] = None
            else:
                tensors[name], tensors[f"{name}_scale"], tensors[f"{name}_global"] = quantize_nvfp4(
                    weight.detach().float())
        return cls(fmt, tensors, experts.limit)

    @property
    def tiled(self) -> bool:
        """Whether the packed weights are in the tiled layout (dsv4_compile.fp4_tiles)."""
        return is_tiled(self.w13)

    def can_tile(self) -> bool:
        """Whether the packed weights split into whole tiles (experts_split_into_tiles)."""
        _, two_inter, half_hidden = self.w13.shape
        return experts_split_into_tiles(2 * half_hidden, two_inter // 2)

    @torch.no_grad()
    def tile_(self) -> "Fp4Experts":
        """Converts w13 and w2 to the tiled layout in place (new buffers; the row-major ones are
        released unless referenced elsewhere; the scales stay row-major). Returns self."""
        if self.tiled:
            return self
        if not self.can_tile():
            raise ValueError(f"Fp4Experts.tile_: w13 {tuple(self.w13.shape)} does not split into "
                             f"{TILE_ROWS} x {TILE_COLS} tiles")
        self.w13, self.w2 = tile_fp4(self.w13), tile_fp4(self.w2)
        return self

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, K], down [E, K, I]) in `dtype`."""
        w13, w2 = (untile_fp4(self.w13), untile_fp4(self.w2)) if self.tiled else (self.w13, self.w2)
        if self.fmt == "mxfp4":
            return dequantize_mxfp4(w13, self.w13_scale, dtype), dequantize_mxfp4(w2, self.w2_scale, dtype)
        return (dequantize_nvfp4(w13, self.w13_scale, self.w13_global, dtype),
                dequantize_nvfp4(w2, self.w2_scale, self.w2_global, dtype))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return moe_experts_fp4(hidden_states, top_k_index, top_k_weights, self.w13, self.w13_scale,
                               self.w2, self.w2_scale, self.fmt, self.w13_global, self.w2_global, self.limit)


def quantize_experts_(model: nn.Module, fmt: str) -> None:
    """Replaces, in place, every dense routed-experts module of a DeepseekV4ForCausalLM by an
    Fp4Experts in `fmt` (the offline quantiser for tests and demos without FP4 checkpoints)."""
    for layer in model.model.layers:
        layer.mlp.experts = Fp4Experts.quantize(layer.mlp.experts, fmt).to(layer.mlp.experts.gate_up_proj.device)


def tile_fp4_experts_(model: nn.Module) -> int:
    """Moves, in place, the FP4 experts of a DeepseekV4ForCausalLM whose sizes split into tiles to
    the tiled layout (Fp4Experts.tile_). transformers' own FP4 FP8Experts become Fp4Experts first
    (their packed codes are re-laid out, their scales kept as views): the layer then holds an
    Fp4Experts, which transformers' forward runs as well. Returns how many modules are tiled now."""
    tiled = 0
    for layer in model.model.layers:
        experts = layer.mlp.experts
        if not isinstance(experts, Fp4Experts) and is_fp4(experts):
            views = experts_from_transformers(experts)
            converted = Fp4Experts(views["fmt"], views, views["swiglu_limit"])
            if converted.can_tile():
                layer.mlp.experts = experts = converted
        if isinstance(experts, Fp4Experts) and (experts.tiled or experts.can_tile()):
            experts.tile_()
            tiled += 1
    return tiled


def is_fp4(experts: nn.Module) -> bool:
    """Whether a routed-experts module holds FP4 weights (Fp4Experts or transformers' FP8Experts
    with int8-packed FP4)."""
    return isinstance(experts, Fp4Experts) or experts.gate_up_proj.dtype in (torch.int8, torch.uint8)


_DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _get(source: nn.Module | dict, name: str):
    return source[name] if isinstance(source, dict) else getattr(source, name)


class RoutedExperts(nn.Module):
    """The plain-torch routed-experts form for any expert storage:
    forward(x [M, K], topk_ids [M, k], topk_weights [M, k]) -> [M, K].

    Dense transformers experts, Fp4Experts, and transformers' FP8Experts holding FP4 weights
    (read as MXFP4 views, no copies) are understood. A module (not a function) so that the
    compiled graph's nodes know which layer they belong to.
    """

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts
        self.fp4_views = (experts_from_transformers(experts)
                          if is_fp4(experts) and not isinstance(experts, Fp4Experts) else None)
        source = experts if isinstance(experts, Fp4Experts) else self.fp4_views
        if source is None:
            dtypes = {experts.gate_up_proj.dtype, experts.down_proj.dtype}
            if not all(dtype in _DENSE_DTYPES for dtype in dtypes):
                names = " and ".join(sorted(map(str, dtypes)))
                raise TypeError(f"routed experts ({type(experts).__name__}) hold {names} weights; "
                                "supported: bf16, f16 or f32 experts, or FP4 ones (MXFP4 / NVFP4, int8- or "
                                "uint8-packed; transformers' FP8Experts with expert_dtype 'fp4')")
        if source is not None and _get(source, "fmt") == "mxfp4":
            from dsv4_compile.kernels.fp4_moe import check_mxfp4_scale_range, native_fp4_dot

            w13_scale, w2_scale = _get(source, "w13_scale"), _get(source, "w2_scale")
            if not native_fp4_dot(w13_scale, "mxfp4"):  # sm_100: tl.dot_scaled, no mma path, no limit
                check_mxfp4_scale_range(w13_scale=w13_scale, w2_scale=w2_scale)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        experts = self.experts
        if isinstance(experts, Fp4Experts):
            return experts(x, topk_ids, topk_weights)
        if self.fp4_views is not None:
            v = self.fp4_views
            return moe_experts_fp4(x, topk_ids, topk_weights, v["w13"], v["w13_scale"], v["w2"], v["w2_scale"],
                                   v["fmt"], v["w13_global"], v["w2_global"], v["swiglu_limit"])
        return moe_experts_gathered(x, topk_ids, topk_weights, experts.gate_up_proj, experts.down_proj,
                                    experts.limit)
