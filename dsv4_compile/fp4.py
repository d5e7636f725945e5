"""FP4 (e2m1) weight formats of DeepSeek-V4's routed experts, in plain torch.

Two block-scaled formats over packed e2m1 codes (two codes per byte, element 2j in the low
nibble, element 2j+1 in the high nibble):

- MXFP4: one ue8m0 scale per 32 values, stored as a uint8 byte s meaning 2**(s - 127).
- NVFP4: one fp8 e4m3 scale per 16 values times one f32 global scale per matrix
  (per expert for [E, R, N] weights): value = e2m1 * e4m3 * global.

The quantisers are offline tools (they may sync with the host); the dequantisers are
capture-safe and are what the model runs on the gathered expert weights.
"""
from __future__ import annotations

import torch

MXFP4_BLOCK = 32
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
UE8M0_BIAS = 127

# e2m1 code -> value; bit 3 is the sign, bits 0-2 index (0, .5, 1, 1.5, 2, 3, 4, 6).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Midpoints between consecutive positive e2m1 magnitudes.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_table(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 e2m1 values indexed by code, [16] of `dtype`."""
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., N] (values 0..15, N even) -> packed uint8 [..., N/2], element 2j low."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dim of codes must be even, got {codes.shape[-1]}")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., N/2] -> codes uint8 [..., N] (element 2j from the low nibble)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round f32 values to the nearest e2m1 code (ties to the even code, |x| saturates at 6).

    x [...] f32 -> codes uint8 [...].
    """
    mag = x.abs().clamp(max=E2M1_MAX)
    bounds = torch.tensor(_E2M1_MIDPOINTS, dtype=mag.dtype, device=mag.device)
    code = torch.bucketize(mag, bounds)  # a tie lands on the lower code
    on_bound = mag == bounds[code.clamp(max=len(_E2M1_MIDPOINTS) - 1)]
    code = code + (on_bound & (code % 2 == 1)).to(code.dtype)  # tie -> even code
    negative = torch.signbit(x) & (code > 0)
    return (code + 8 * negative.to(code.dtype)).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes uint8 [...] -> values [...] of `dtype`."""
    return e2m1_table(codes.device, dtype)[codes.long()]


def _check_finite(w: torch.Tensor, name: str) -> None:
    if not torch.isfinite(w).all():
        raise ValueError(f"{name}: weights must be finite")


def _blocks(w: torch.Tensor, block: int, name: str) -> torch.Tensor:
    if w.ndim < 1 or w.shape[-1] % block:
        raise ValueError(f"{name}: last dim must be a multiple of {block}, got shape {tuple(w.shape)}")
    return w.float().unflatten(-1, (-1, block))


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4-quantise w [..., N] (N a multiple of 32).

    Returns (packed uint8 [..., N/2], scale uint8 ue8m0 [..., N/32]). The block scale is the
    smallest power of two 2**e with amax <= 6 * 2**e, so no value is clipped and every value
    is within half an e2m1 step (times the scale) of the original.
    """
    _check_finite(w, "quantize_mxfp4")
    blocks = _blocks(w, MXFP4_BLOCK, "quantize_mxfp4")
    amax = blocks.abs().amax(dim=-1)
    exp = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-UE8M0_BIAS, UE8M0_BIAS)
    # log2 of a rounded quotient can be off by one: fix it so 6 * 2**(e-1) < amax <= 6 * 2**e.
    exp = exp + (amax > E2M1_MAX * torch.exp2(exp)).float()
    exp = exp - (amax <= E2M1_MAX * torch.exp2(exp - 1)).float()
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -UE8M0_BIAS)).clamp(-UE8M0_BIAS, UE8M0_BIAS)
    codes = encode_e2m1(blocks * torch.exp2(-exp).unsqueeze(-1))
    return pack_e2m1(codes.flatten(-2)), (exp + UE8M0_BIAS).to(torch.uint8)


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes uint8 [...] -> f32 [...] = 2**(s - 127)."""
    return torch.exp2(scale.float() - UE8M0_BIAS)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """packed uint8 [..., N/2], scale uint8 ue8m0 [..., N/32] -> weights [..., N] of `dtype`."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"dequantize_mxfp4: packed and scale must be uint8, got {packed.dtype}, {scale.dtype}")
    values = decode_e2m1(unpack_e2m1(packed)).unflatten(-1, (-1, MXFP4_BLOCK))
    return (values * ue8m0_to_float(scale).unsqueeze(-1)).flatten(-2).to(dtype)


def _round_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4-quantise w [..., R, N] (N a multiple of 16).

    Returns (packed uint8 [..., R, N/2], scale fp8 e4m3 [..., R, N/16], global f32 [...]):
    one global scale per matrix (per expert for [E, R, N]). The global scale is the power of
    two that puts the largest block scale in (224, 448]. Each block scale is the e4m3 value,
    among round(amax/6), round(amax/4) and round(amax/3) (over the global), that gives the
    smallest block error, so a dequantised tensor re-quantises to itself exactly, unless rounding
    brought its largest |value| down to half the top of the global range (6 * 448 * global / 2):
    then the global scale halves and blocks that need a scale above 448 re-round.
    """
    _check_finite(w, "quantize_nvfp4")
    if w.ndim < 2:
        raise ValueError(f"quantize_nvfp4: needs [..., R, N], got shape {tuple(w.shape)}")
    blocks = _blocks(w, NVFP4_BLOCK, "quantize_nvfp4")  # [..., R, N/16, 16]
    amax_blocks = blocks.abs().amax(dim=-1)  # [..., R, N/16]
    amax = amax_blocks.flatten(-2).amax(dim=-1)  # [...]
    glob = torch.exp2(torch.ceil(torch.log2(amax / (E2M1_MAX * E4M3_MAX))))
    glob = torch.where(amax > 0, glob, torch.ones_like(glob))
    glob = glob * (amax > E2M1_MAX * E4M3_MAX * glob).float().add(1)  # log2 rounding fix-up
    unit = amax_blocks / glob[..., None, None]
    best_err = best_codes = best_scale = None
    for top in (E2M1_MAX, 4.0, 3.0):
        scale = _round_e4m3(unit / top)
        step = (scale * glob[..., None, None]).unsqueeze(-1)
        codes = encode_e2m1(torch.where(step > 0, blocks / step, torch.zeros_like(blocks)))
        err = (decode_e2m1(codes) * scale.unsqueeze(-1) * glob[..., None, None, None] - blocks).square().sum(-1)
        if best_err is None:
            best_err, best_codes, best_scale = err, codes, scale
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_codes = torch.where(better.unsqueeze(-1), codes, best_codes)
            best_scale = torch.where(better, scale, best_scale)
    packed = pack_e2m1(best_codes.flatten(-2))
    return packed, best_scale.to(torch.float8_e4m3fn), glob.float()


def dequantize_nvfp4(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """packed uint8 [..., R, N/2], scale e4m3 [..., R, N/16], global f32 [...] -> [..., R, N] of `dtype`."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
        raise TypeError(
            f"dequantize_nvfp4: packed must be uint8 and scale float8_e4m3fn, got {packed.dtype}, {scale.dtype}"
        )
    values = decode_e2m1(unpack_e2m1(packed)).unflatten(-1, (-1, NVFP4_BLOCK))
    block_scale = scale.float() * global_scale.float()[..., None, None]
    return (values * block_scale.unsqueeze(-1)).flatten(-2).to(dtype)


def _float_scale_to_ue8m0(scale: torch.Tensor, name: str) -> torch.Tensor:
    mantissa, exponent = torch.frexp(scale.float())
    if not ((mantissa == 0.5) & (exponent - 1 >= -UE8M0_BIAS) & (exponent - 1 <= UE8M0_BIAS)).all():
        raise ValueError(f"{name}: f32 scales must be powers of two in [2**-127, 2**127] to be ue8m0")
    return (exponent - 1 + UE8M0_BIAS).to(torch.uint8)


def _ue8m0_bytes(scale: torch.Tensor, name: str) -> torch.Tensor:
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if e8m0 is not None and scale.dtype == e8m0:
        return scale.view(torch.uint8)  # same bits: 2**(byte - 127)
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype == torch.float32:
        return _float_scale_to_ue8m0(scale, name)
    raise TypeError(f"{name}: unsupported scale dtype {scale.dtype} (float8_e8m0fnu, uint8 or float32)")


def experts_from_transformers(module: torch.nn.Module) -> dict[str, object]:
    """Our fp4_moe weight layout from a transformers `FP8Experts` module holding FP4 experts.

    transformers 5.17 (`integrations/finegrained_fp8.py`, `config.expert_dtype == "fp4"`) stores
    gate_up_proj int8 [E, 2I, K/2] (rows [0, I) gate, [I, 2I) up, low nibble = element 2j),
    gate_up_proj_scale_inv [E, 2I, K/32] (float8_e8m0fnu when scale_fmt="ue8m0", else f32),
    down_proj int8 [E, K, I/2] and down_proj_scale_inv [E, K, I/32]: that is MXFP4 in our
    layout. Weights become uint8 views (no copy); e8m0 scales become uint8 views (no copy);
    f32 scales (which must be powers of two) are converted to ue8m0 bytes (a copy).

    Returns {"w13", "w13_scale", "w2", "w2_scale", "fmt": "mxfp4", "w13_global": None,
    "w2_global": None, "swiglu_limit"}.
    """
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if gate_up is None or down is None:
        raise TypeError(f"experts_from_transformers: {type(module).__name__} has no fused gate_up_proj/down_proj")
    for name, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
        if weight.dtype not in (torch.int8, torch.uint8):
            raise TypeError(f"experts_from_transformers: {name} is {weight.dtype}, not int8-packed FP4")
    if getattr(module, "swiglu_alpha", None) is not None:
        raise ValueError("experts_from_transformers: swiglu_alpha (gpt-oss gate) is not the fp4_moe activation")
    for name in ("gate_softcap", "up_softcap"):
        if getattr(module, name, None) is not None:
            raise ValueError(f"experts_from_transformers: {name} (a softcapped SwiGLU) is not the fp4_moe activation")
    num_experts, two_inter, half_hidden = gate_up.shape
    hidden, inter = 2 * half_hidden, two_inter // 2
    if tuple(down.shape) != (num_experts, hidden, inter // 2):
        raise ValueError(
            f"experts_from_transformers: down_proj shape {tuple(down.shape)} != {(num_experts, hidden, inter // 2)}"
        )
    w13_scale = _ue8m0_bytes(module.gate_up_proj_scale_inv.data, "gate_up_proj_scale_inv")
    w2_scale = _ue8m0_bytes(module.down_proj_scale_inv.data, "down_proj_scale_inv")
    if tuple(w13_scale.shape) != (num_experts, two_inter, hidden // MXFP4_BLOCK):
        raise ValueError(f"experts_from_transformers: gate_up_proj_scale_inv shape {tuple(w13_scale.shape)}")
    if tuple(w2_scale.shape) != (num_experts, hidden, inter // MXFP4_BLOCK):
        raise ValueError(f"experts_from_transformers: down_proj_scale_inv shape {tuple(w2_scale.shape)}")
    return {
        "w13": gate_up.data.view(torch.uint8),
        "w13_scale": w13_scale,
        "w2": down.data.view(torch.uint8),
        "w2_scale": w2_scale,
        "fmt": "mxfp4",
        "w13_global": None,
        "w2_global": None,
        "swiglu_limit": getattr(module, "limit", None),
    }
