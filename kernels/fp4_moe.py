"""dsv4::fp4_moe: routed experts with FP4 (MXFP4 / NVFP4) weights, dequantised in the kernel.

out[m] = sum_j topk_weights[m, j] * W2[e_j] @ (silu(min(gate, L)) * clamp(up, -L, L)),
[gate, up] = W13[e_j] @ x[m], for every choice j with 0 <= e_j < E (-1 = expert on another rank).

Launch (capture-safe: static shapes, no host syncs):
1. The M*k (token, choice) pairs are grouped by expert (`expert_blocks`: one small Triton launch up
   to 2,048 pairs, two past that); each expert's pairs are cut into blocks of BLOCK_M rows. At most
   min(E, M*k) + floor((M*k - min(E, M*k)) / BLOCK_M) blocks exist (`block_bound`), so the grid is
   that static bound and surplus blocks exit at once. For one decode token's choices
   (TileConfig.direct_blocks) each pair is its own block, read from the ids, and this step
   launches nothing.
2. `_gate_up_kernel`: per (block, I tile): x rows @ dequant(W13 gate/up tile)^T, clamped
   SwiGLU -> hidden [M*k, I] in sorted-pair order. With TileConfig.k_splits the mma kernel splits
   the K reduction over programs and `_swiglu_partials_kernel` sums the splits and applies SwiGLU.
3. `_down_kernel`: per (block, K tile): hidden rows @ dequant(W2 tile)^T times the routing
   weight -> per-pair outputs [M*k, K] f32 at the pair's own index.
4. out[m] = sum over the valid choices of m (kernels/moe_pairs.py: `combine_pairs`, the torch form
   the lowering fuses with what follows, e.g. the shared-expert add; the eager op runs
   `combine_pairs_triton`, one launch).

Steps 2 and 3 have three kernel pairs behind one launcher: a GEMV path (`_gate_up_gemv_kernel`,
`_down_gemv_kernel`; no tl.dot) for a few pairs per expert on average (decode),
an mma path (`_gate_up_mma_kernel`, `_down_mma_kernel`: tl.dot with the weight rows as its M
side, for blocks of a few pairs; decode and verify) and the dot path below (prefill, and MXFP4
on sm_100, see native_fp4_dot); `choose_config` picks by average pairs per expert and format,
`TileConfig` overrides it (tests, bench --sweep). The mma kernels are launched column tile first
(grid (tiles, blocks)), the others block first.

On the dot path weights are dequantised to the dot dtype (bf16 for bf16 x on GPU, f32 for f32 x
and under the interpreter) before tl.dot; on sm_100 MXFP4 in the row-major layout uses
tl.dot_scaled on the packed codes instead. Tiled experts (whose words hold their bits swizzled,
dsv4_compile/fp4_tiles.py) are launched as on other GPUs.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import torch
import triton
import triton.language as tl

from dsv4_compile.fp4 import dequantize_mxfp4, dequantize_nvfp4
from dsv4_compile.fp4_tiles import TILE_COLS, TILE_ROWS, is_tiled, logical_shape, untile_fp4

from ._runtime import (MAX_GRID_Y, await_count, count_done, device_capability, pdl_launch, release_in_mode,
                       triton_runs_on, wait_for_producers, wait_without_release)
from .moe_pairs import block_bound, combine_pairs_triton, expert_blocks

logger = logging.getLogger("dsv4_compile")

FORMATS = ("mxfp4", "nvfp4")
GROUP = {"mxfp4": 32, "nvfp4": 16}


# ----------------------------------------------------------------------------- validation
def check_fp4_moe_inputs(
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
    swiglu_limit: float | None = None,
) -> tuple[int, int, int, int, int]:
    """Shape/dtype/device checks that need no host sync. Returns (M, K, E, I, k)."""
    if fmt not in FORMATS:
        raise ValueError(f"fp4_moe: fmt must be one of {FORMATS}, got {fmt!r}")
    if swiglu_limit is not None and not (isinstance(swiglu_limit, (int, float)) and swiglu_limit >= 0):
        raise ValueError(f"fp4_moe: swiglu_limit must be None or a number >= 0 (inf: no clamp), got {swiglu_limit!r}")
    if x.ndim != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"fp4_moe: x must be [M, K] bf16 or f32, got {tuple(x.shape)} {x.dtype}")
    tokens, hidden = x.shape
    if topk_ids.ndim != 2 or topk_ids.shape[0] != tokens or topk_ids.dtype != torch.int32:
        raise TypeError(f"fp4_moe: topk_ids must be [M={tokens}, k] int32, got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    top_k = topk_ids.shape[1]
    if tuple(topk_weights.shape) != (tokens, top_k) or topk_weights.dtype != torch.float32:
        raise TypeError(
            f"fp4_moe: topk_weights must be [{tokens}, {top_k}] float32, got {tuple(topk_weights.shape)} {topk_weights.dtype}"
        )
    for name, w in (("w13", w13), ("w2", w2)):
        if w.ndim not in (3, 5) or w.dtype != torch.uint8:
            raise TypeError(f"fp4_moe: {name} must be [E, rows, cols/2] uint8 (or its tiled form, 5-D), "
                            f"got {tuple(w.shape)} {w.dtype}")
    _check_tiling(w13, w2)
    experts, two_inter, half_hidden = logical_shape(w13)
    if experts < 1:
        raise ValueError(f"fp4_moe: w13 must hold at least one expert, got {tuple(w13.shape)}")
    inter = two_inter // 2
    group = GROUP[fmt]
    if 2 * half_hidden != hidden or hidden % group:
        raise ValueError(f"fp4_moe: w13 packs K={2 * half_hidden} per row, x has K={hidden} (K must be a multiple of {group})")
    if two_inter % 2 or inter % group:
        raise ValueError(f"fp4_moe: w13 rows 2I={two_inter}: I must be a multiple of {group}")
    if logical_shape(w2) != (experts, hidden, inter // 2):
        raise ValueError(f"fp4_moe: w2 must be [E={experts}, K={hidden}, I/2={inter // 2}], got {tuple(w2.shape)}")
    scale_dtype = torch.uint8 if fmt == "mxfp4" else torch.float8_e4m3fn
    for name, scale, shape in (
        ("w13_scale", w13_scale, (experts, two_inter, hidden // group)),
        ("w2_scale", w2_scale, (experts, hidden, inter // group)),
    ):
        if scale.dtype != scale_dtype:
            raise TypeError(f"fp4_moe: {name} must be {scale_dtype} for {fmt}, got {scale.dtype}")
        if tuple(scale.shape) != shape:
            raise ValueError(f"fp4_moe: {name} must be {list(shape)} for {fmt}, got {list(scale.shape)}")
    for name, glob in (("w13_global", w13_global), ("w2_global", w2_global)):
        if fmt == "mxfp4" and glob is not None:
            raise ValueError(f"fp4_moe: {name} must be None for mxfp4")
        if fmt == "nvfp4" and (glob is None or tuple(glob.shape) != (experts,) or glob.dtype != torch.float32):
            got = None if glob is None else (tuple(glob.shape), glob.dtype)
            raise TypeError(f"fp4_moe: {name} must be [E={experts}] float32 for nvfp4, got {got}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w13", w13), ("w13_scale", w13_scale),
                    ("w2", w2), ("w2_scale", w2_scale), ("w13_global", w13_global), ("w2_global", w2_global)):
        if t is not None and t.device != x.device:
            raise ValueError(f"fp4_moe: {name} is on {t.device}, x on {x.device}")
    return tokens, hidden, experts, inter, top_k


def _check_tiling(w13: torch.Tensor, w2: torch.Tensor) -> None:
    """w13 and w2 are both row-major (3-D) or both tiled (5-D) with the tile shape of
    dsv4_compile.fp4_tiles; tiled w13 also needs I a multiple of TILE_ROWS (the up rows start a tile)."""
    if w13.ndim != w2.ndim:
        raise ValueError(f"fp4_moe: w13 and w2 must both be row-major or both tiled; got {tuple(w13.shape)} "
                         f"and {tuple(w2.shape)}")
    if w13.ndim == 3:
        return
    for name, t in (("w13", w13), ("w2", w2)):
        if tuple(t.shape[3:]) != (TILE_ROWS, TILE_COLS // 2):
            raise ValueError(f"fp4_moe: tiled {name} must end in tiles of [{TILE_ROWS}, {TILE_COLS // 2}], "
                             f"got {tuple(t.shape)}")
    if w13.shape[1] % 2:
        raise ValueError(f"fp4_moe: tiled w13 needs I a multiple of {TILE_ROWS}, got 2I={w13.shape[1] * TILE_ROWS}")


def check_expert_ids(topk_ids: torch.Tensor, experts: int) -> None:
    """Eager-only id range check (a host sync): ids must be in [-1, E).

    Skipped while a CUDA graph is being captured, and absent from the lowered compiled path
    (dsv4::fp4_moe_pairs): those rely on the router producing in-range ids; the kernels treat
    any id outside [0, E) as "skip", so a bad id there drops the choice rather than reading
    out of bounds.
    """
    if topk_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    if topk_ids.numel() and (int(topk_ids.min()) < -1 or int(topk_ids.max()) >= experts):
        raise ValueError(
            f"fp4_moe: topk_ids must be in [-1, {experts}), got range "
            f"[{int(topk_ids.min())}, {int(topk_ids.max())}]"
        )


# ----------------------------------------------------------------------------- reference
def _dequantize(packed, scale, glob, fmt, dtype):
    if fmt == "mxfp4":
        return dequantize_mxfp4(packed, scale, dtype)
    return dequantize_nvfp4(packed, scale, glob, dtype)


def fp4_moe_reference(
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
    """The spec, in f32: loops over the experts that receive tokens (host syncs; eager only).

    Shapes as in the op (tiled experts are untiled first). Returns [M, K] in x's dtype.
    """
    if is_tiled(w13):
        w13, w2 = untile_fp4(w13), untile_fp4(w2)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < w13.shape[0])
    for expert in torch.unique(ids[valid]).tolist():
        token, choice = torch.nonzero(ids == expert, as_tuple=True)
        g13 = None if w13_global is None else w13_global[expert]
        g2 = None if w2_global is None else w2_global[expert]
        gate_up = x[token].float() @ _dequantize(w13[expert], w13_scale[expert], g13, fmt, torch.float32).T
        gate, up = gate_up.chunk(2, dim=-1)
        if swiglu_limit is not None:
            gate = gate.clamp(max=swiglu_limit)
            up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
        hidden = torch.nn.functional.silu(gate) * up
        down = hidden @ _dequantize(w2[expert], w2_scale[expert], g2, fmt, torch.float32).T
        out.index_add_(0, token, down * topk_weights[token, choice, None])
    return out.to(x.dtype)


# ----------------------------------------------------------------------------- Triton
_TILE_ROWS = tl.constexpr(TILE_ROWS)
_TILE_COLS = tl.constexpr(TILE_COLS)


@triton.jit
def _at(row, col, row_step, TILED: tl.constexpr, VALUES_PER_UNIT: tl.constexpr):
    """Offset, in units of VALUES_PER_UNIT FP4 values (2 a byte, 8 an int32 word), of (row, col) of
    packed codes in a row-major matrix with row stride `row_step`, or, TILED, in the tiled form
    (dsv4_compile.fp4_tiles), whose rows then hold `row_step` units."""
    if TILED:
        TC: tl.constexpr = _TILE_COLS // VALUES_PER_UNIT
        tile = (row // _TILE_ROWS) * (row_step // TC) + col // TC
        return tile * (_TILE_ROWS * TC) + (row % _TILE_ROWS) * TC + col % TC
    return row * row_step + col


@triton.jit
def _e2m1_times_2pow_minus14(codes):
    """e2m1 codes (0..15) -> f32 value * 2**-14: the 3 magnitude bits become an fp16 exponent/mantissa
    (e=0 lands on an fp16 subnormal, which is exact), the sign moves to bit 15."""
    c = codes.to(tl.int16)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _block_scale(s_raw, IS_MX: tl.constexpr, TIMES: tl.constexpr):
    """Scale bytes -> f32 scale * TIMES: ue8m0 2**(s-127) (s=0 reads as 0), or e4m3 via fp16 bits
    (whose 2**-8 the same multiply undoes)."""
    if IS_MX:
        return (s_raw.to(tl.int32) << 23).to(tl.float32, bitcast=True) * TIMES
    s = s_raw.to(tl.int32)
    bits = ((s & 0x7F) << 7) | ((s & 0x80) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * (TIMES * 256.0)


@triton.jit
def _dequant_tile(w_ptr, s_ptr, rows, row_mask, k0, stride_w, stride_s,
                  BLOCK_K: tl.constexpr, GROUP: tl.constexpr, IS_MX: tl.constexpr, DOT_DTYPE: tl.constexpr, TILED: tl.constexpr):
    """Rows `rows` [BN] x K columns [k0, k0+BLOCK_K) of a packed FP4 matrix (uint8, `stride_w` bytes a
    logical row; TILED: the tiled layout, read as words) -> [BN, BLOCK_K] DOT_DTYPE (without the nvfp4
    global scale)."""
    if TILED:  # whole words, their bits in the tiled layout's order
        jw = tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + _at(rows[:, None], (k0 // 8 + jw)[None, :], stride_w // 4,
                                                                   TILED, 8), mask=row_mask[:, None], other=0)
        c0, c4, c1, c5, c2, c6, c3, c7 = _decode_words(words, True)
        # tl.join appends its dim last: [BN, W, a, b, c] holds code 4a + 2b + c, the K order
        values = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    else:
        half = tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_ptr + _at(rows[:, None], (k0 // 2 + half)[None, :], stride_w, False, 2),
                         mask=row_mask[:, None], other=0)
        values = _e2m1_times_2pow_minus14(tl.join(packed & 0xF, packed >> 4))
    groups = tl.arange(0, BLOCK_K // GROUP)
    s_raw = tl.load(s_ptr + rows[:, None] * stride_s + (k0 // GROUP + groups)[None, :], mask=row_mask[:, None], other=0)
    scale = _block_scale(s_raw, IS_MX, 16384.0)
    values = tl.reshape(values, (rows.shape[0], BLOCK_K // GROUP, GROUP))
    return tl.reshape(values * scale[:, :, None], (rows.shape[0], BLOCK_K)).to(DOT_DTYPE)


@triton.jit
def _scaled_dot(acc, a, w_ptr, s_ptr, rows, row_mask, k0, stride_w, stride_s, BLOCK_K: tl.constexpr):
    """acc += a [BM, BLOCK_K] @ MXFP4 rows^T via tl.dot_scaled on the packed codes (sm_100; row-major
    experts only: the tiled layout's words hold their bits swizzled)."""
    half = tl.arange(0, BLOCK_K // 2)
    packed_t = tl.load(w_ptr + _at(rows[None, :], (k0 // 2 + half)[:, None], stride_w, False, 2),
                       mask=row_mask[None, :], other=0)
    groups = tl.arange(0, BLOCK_K // 32)
    s_raw = tl.load(s_ptr + rows[:, None] * stride_s + (k0 // 32 + groups)[None, :], mask=row_mask[:, None], other=0)
    return tl.dot_scaled(a.to(tl.bfloat16), None, "bf16", packed_t, s_raw, "e2m1", acc)


@triton.jit
def _swiglu(gate, up, LIMIT, HAS_LIMIT: tl.constexpr):
    """silu(min(gate, LIMIT)) * clamp(up, -LIMIT, LIMIT) in f32 (no clamps without HAS_LIMIT)."""
    if HAS_LIMIT:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _block_rows(block, block_expert_ptr, block_start_ptr, block_end_ptr, BLOCK_M: tl.constexpr,
                DIRECT: tl.constexpr, FROM_L2: tl.constexpr = False):
    """(expert id, rows [BLOCK_M], row mask) of expert block `block` of the table (`expert_blocks`), or
    with DIRECT of pair `block` alone (one block a pair; block_expert_ptr then points at the flat ids,
    which may be -1 or >= E)."""
    CACHE: tl.constexpr = ".cg" if FROM_L2 else ""
    expert = tl.load(block_expert_ptr + block, cache_modifier=CACHE)
    if DIRECT:
        start = block
        end = block + 1
    else:
        start = tl.load(block_start_ptr + block, cache_modifier=CACHE)
        end = tl.load(block_end_ptr + block, cache_modifier=CACHE)
    rows = start + tl.arange(0, BLOCK_M)
    return expert, rows, rows < end


@triton.jit
def _pair_of(order_ptr, rows, row_mask, DIRECT: tl.constexpr):
    """The pair index of each row: `order` of the block table, or the row itself with DIRECT."""
    if DIRECT:
        return rows
    return tl.load(order_ptr + rows, mask=row_mask, other=0)


@triton.jit
def _gate_up_kernel(
    x_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr,
    w13_ptr, s13_ptr, g13_ptr, hidden_ptr,
    E,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h,
    LIMIT,
    K: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
    HAS_LIMIT: tl.constexpr, IS_MX: tl.constexpr, USE_DOT_SCALED: tl.constexpr,
    GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TILED: tl.constexpr,
):
    tl.static_assert(not (USE_DOT_SCALED and TILED), "tl.dot_scaled reads row-major codes only")
    expert, rows, row_mask = _block_rows(tl.program_id(0), block_expert_ptr, block_start_ptr, block_end_ptr,
                                         BLOCK_M, False)
    if expert >= E:
        return
    pair = _pair_of(order_ptr, rows, row_mask, False)
    token = pair // TOP_K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < I
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    s_base = s13_ptr + expert.to(tl.int64) * stride_se
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kk = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(x_ptr + token[:, None] * stride_x + (k0 + kk)[None, :], mask=row_mask[:, None], other=0.0)
        if USE_DOT_SCALED:
            acc_gate = _scaled_dot(acc_gate, a, w_base, s_base, cols, col_mask, k0, stride_wn, stride_sn, BLOCK_K)
            acc_up = _scaled_dot(acc_up, a, w_base, s_base, cols + I, col_mask, k0, stride_wn, stride_sn, BLOCK_K)
        else:
            a = a.to(DOT_DTYPE)
            gate_w = _dequant_tile(w_base, s_base, cols, col_mask, k0, stride_wn, stride_sn,
                                   BLOCK_K, GROUP, IS_MX, DOT_DTYPE, TILED)
            acc_gate = tl.dot(a, tl.trans(gate_w), acc_gate, input_precision="ieee")
            up_w = _dequant_tile(w_base, s_base, cols + I, col_mask, k0, stride_wn, stride_sn,
                                 BLOCK_K, GROUP, IS_MX, DOT_DTYPE, TILED)
            acc_up = tl.dot(a, tl.trans(up_w), acc_up, input_precision="ieee")
    if not IS_MX:
        glob = tl.load(g13_ptr + expert)
        acc_gate = acc_gate * glob
        acc_up = acc_up * glob
    act = _swiglu(acc_gate, acc_up, LIMIT, HAS_LIMIT)
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(hidden_ptr + rows[:, None] * stride_h + cols[None, :], act.to(hidden_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _down_kernel(
    hidden_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, weights_ptr,
    w2_ptr, s2_ptr, g2_ptr, pair_out_ptr,
    E,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    K: tl.constexpr, I: tl.constexpr,
    IS_MX: tl.constexpr, USE_DOT_SCALED: tl.constexpr,
    GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TILED: tl.constexpr,
):
    tl.static_assert(not (USE_DOT_SCALED and TILED), "tl.dot_scaled reads row-major codes only")
    expert, rows, row_mask = _block_rows(tl.program_id(0), block_expert_ptr, block_start_ptr, block_end_ptr,
                                         BLOCK_M, False)
    if expert >= E:
        return
    pair = _pair_of(order_ptr, rows, row_mask, False)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < K
    w_base = w2_ptr + expert.to(tl.int64) * stride_we
    s_base = s2_ptr + expert.to(tl.int64) * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kk = tl.arange(0, BLOCK_K)
    for k0 in range(0, I, BLOCK_K):
        a = tl.load(hidden_ptr + rows[:, None] * stride_h + (k0 + kk)[None, :], mask=row_mask[:, None], other=0.0)
        if USE_DOT_SCALED:
            acc = _scaled_dot(acc, a, w_base, s_base, cols, col_mask, k0, stride_wn, stride_sn, BLOCK_K)
        else:
            w = _dequant_tile(w_base, s_base, cols, col_mask, k0, stride_wn, stride_sn,
                              BLOCK_K, GROUP, IS_MX, DOT_DTYPE, TILED)
            acc = tl.dot(a.to(DOT_DTYPE), tl.trans(w), acc, input_precision="ieee")
    routing = tl.load(weights_ptr + pair, mask=row_mask, other=0.0)
    if not IS_MX:
        routing = routing * tl.load(g2_ptr + expert)
    acc = acc * routing[:, None]
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(pair_out_ptr + pair[:, None].to(tl.int64) * stride_o + cols[None, :], acc, mask=out_mask)


# GEMV path: the rows of one expert block are few (decode), so no tl.dot. Each program streams a
# [BLOCK_N, BLOCK_K] tile of packed weights as int32 words (8 codes each), decodes two codes per
# instruction sequence (codes q and q+4 of a word sit 16 bits apart, so one shift-and-mask builds
# an f16 pair; tiled words: `_e2m1_pair_bits_swizzled`, then one shift-and-mask) once per K step, then for each of its BLOCK_M rows multiplies them with that row's
# activations and sums each scale group in registers; the group scale is applied once per group
# and the cross-thread reduction over K happens once, after the K loop. Each row's activations are
# loaded as their own [1, 1, BLOCK_K // 8] tensor: a [BLOCK_M, ...] activation load would make
# Triton spread warps over rows and move the decoded weights through shared memory instead.
# TileConfig.prefetch (PREFETCH) issues the next K step's weight and scale loads before decoding the
# current step. Triton 3.6 does not pipeline loops without tl.dot, and ptxas places loads late, next
# to their first use: in the sm_90 SASS of the plain loop a thread's 4 LDG.128 of weights are issued
# and awaited one after another (16 bytes in flight per thread), and even loop-carried prefetch
# loads are sunk to the end of the loop body. A CTA barrier right after them keeps them at the top,
# so they are in flight during the whole decode (one more bar.sync per step; the loop has two).
# The activations are read in "word-major" order, act[m, q, j] = a[m, 8j + q]
# (`word_major`), so the q-th codes of consecutive words meet contiguous activations. Parallelism
# comes from N: at M=1 the 6 experts x 4096 rows give 24576 rows, some 1500 programs with
# BLOCK_N=16 for 132 SMs, so no split over K is needed.
def word_major(a: torch.Tensor) -> torch.Tensor:
    """a [R, C] (C % 8 == 0) -> [R, 8, C/8] with out[r, q, j] = a[r, 8j + q] (contiguous)."""
    return a.reshape(a.shape[0], -1, 8).transpose(1, 2).contiguous()


def _as_words(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [E, R, C] (C % 4 == 0) -> the same bytes as int32 [E, R, C/4], 16-byte aligned."""
    packed = packed.contiguous()
    if packed.data_ptr() % 16:  # a view at an odd offset: the vector loads need aligned words
        logger.warning("fp4_moe: packed weights at a misaligned address are copied on every call")
        packed = packed.clone()
    return packed.view(torch.int32)


@triton.jit
def _e2m1_pair_times_2pow_minus14(words, Q: tl.constexpr, SWIZZLED: tl.constexpr):
    """int32 words of 8 e2m1 codes (bits in the tiled layout's order where SWIZZLED) -> (code Q, code Q+4)
    of each word as f32 value * 2**-14, Q in 0..3.

    As in `_e2m1_times_2pow_minus14`, a code's 3 magnitude bits go to fp16 bits 9..11 and its sign to
    bit 15; codes Q and Q+4 land in the low and high half of one 32-bit lane at once.
    """
    w = words.to(tl.uint32, bitcast=True)
    if SWIZZLED:  # from the mma path's bf16 places (magnitude at bits 6..8) to fp16's
        pair = _e2m1_pair_bits_swizzled(w, Q, 0)
        bits = ((pair & 0x01C001C0) << 3) | (pair & 0x80008000)
    else:
        if Q < 3:
            magnitude = (w << (9 - 4 * Q)) & 0x0E000E00
        else:
            magnitude = (w >> 3) & 0x0E000E00
        bits = magnitude | ((w << (12 - 4 * Q)) & 0x80008000)
    low = (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (bits >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def _load_words(w_ptr, rows, row_mask, k0, stride_w, BLOCK_K: tl.constexpr, TILED: tl.constexpr):
    """FP4 rows `rows` [BN] (int32 words, row stride `stride_w` words), columns [k0, k0 + BLOCK_K) ->
    int32 words [1, BN, BLOCK_K // 8], zeros where not row_mask.

    The words are loaded as [1, BN, BLOCK_K // 8] so that their layout (contiguous words per thread)
    is the layout of every product below: the weights never move between threads.
    """
    jw = tl.arange(0, BLOCK_K // 8)
    return tl.load(w_ptr + _at(rows[None, :, None], (k0 // 8 + jw)[None, None, :], stride_w, TILED, 8),
                   mask=row_mask[None, :, None], other=0)


@triton.jit
def _load_scales(s_ptr, rows, row_mask, k0, stride_s, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """Scale bytes of rows [BN], columns [k0, k0 + BLOCK_K) -> [1, BN, BLOCK_K // GROUP] uint8."""
    offs = rows[None, :, None] * stride_s + (k0 // GROUP + tl.arange(0, BLOCK_K // GROUP))[None, None, :]
    return tl.load(s_ptr + offs, mask=row_mask[None, :, None], other=0)


@triton.jit
def _decode_words(words, SWIZZLED: tl.constexpr):
    """int32 words [..., W] (bits in the tiled layout's order where SWIZZLED) -> 8 tensors [..., W] f32
    (value * 2**-14): codes 0, 4, 1, 5, 2, 6, 3, 7."""
    c0, c4 = _e2m1_pair_times_2pow_minus14(words, 0, SWIZZLED)
    c1, c5 = _e2m1_pair_times_2pow_minus14(words, 1, SWIZZLED)
    c2, c6 = _e2m1_pair_times_2pow_minus14(words, 2, SWIZZLED)
    c3, c7 = _e2m1_pair_times_2pow_minus14(words, 3, SWIZZLED)
    return c0, c4, c1, c5, c2, c6, c3, c7


@triton.jit
def _row_group_sums(c0, c4, c1, c5, c2, c6, c3, c7, act_ptr, act_q_stride, act_ok,
                    BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """One activation row (word-major at act_ptr, q-th codes act_q_stride apart; zeros where not
    act_ok) times the decoded codes -> per scale group partial dots [1, BN, BLOCK_K // GROUP]."""
    jw = tl.arange(0, BLOCK_K // 8)[None, None, :]
    # One FFMA per code: separate adds so each contracts with its multiply.
    prod = c0 * tl.load(act_ptr + jw, mask=act_ok, other=0.0)
    prod += c4 * tl.load(act_ptr + 4 * act_q_stride + jw, mask=act_ok, other=0.0)
    prod += c1 * tl.load(act_ptr + act_q_stride + jw, mask=act_ok, other=0.0)
    prod += c5 * tl.load(act_ptr + 5 * act_q_stride + jw, mask=act_ok, other=0.0)
    prod += c2 * tl.load(act_ptr + 2 * act_q_stride + jw, mask=act_ok, other=0.0)
    prod += c6 * tl.load(act_ptr + 6 * act_q_stride + jw, mask=act_ok, other=0.0)
    prod += c3 * tl.load(act_ptr + 3 * act_q_stride + jw, mask=act_ok, other=0.0)
    prod += c7 * tl.load(act_ptr + 7 * act_q_stride + jw, mask=act_ok, other=0.0)
    groups: tl.constexpr = BLOCK_K // GROUP
    return tl.sum(tl.reshape(prod, (1, prod.shape[1], groups, GROUP // 8)), axis=3)


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr,
    w13_ptr, s13_ptr, g13_ptr, hidden_ptr,
    E,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h,
    LIMIT,
    K: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
    HAS_LIMIT: tl.constexpr, IS_MX: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
    TILED: tl.constexpr,
):
    """x word-major f32 [M, 8, K/8], w13 as int32 words -> hidden word-major f32 [M*k, 8, I/8]
    (rows in sorted-pair order)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= E:
        return
    start = tl.load(block_start_ptr + block)
    end = tl.load(block_end_ptr + block)
    # One [2 * BLOCK_N] stream of W13 rows: BLOCK_N gate rows, then the matching BLOCK_N up rows.
    lane = tl.arange(0, 2 * BLOCK_N)
    cols = tl.program_id(1) * BLOCK_N + lane % BLOCK_N
    w_rows = cols + (lane // BLOCK_N) * I
    col_mask = cols < I
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    s_base = s13_ptr + expert.to(tl.int64) * stride_se
    row_id = tl.arange(0, BLOCK_M)[:, None, None]
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N, BLOCK_K // GROUP), dtype=tl.float32)
    if PREFETCH:
        words = _load_words(w_base, w_rows, col_mask, 0, stride_wn, BLOCK_K, TILED)
        s_raw = _load_scales(s_base, w_rows, col_mask, 0, stride_sn, BLOCK_K, GROUP)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:  # see the GEMV path comment
            next_mask = col_mask & (k0 + BLOCK_K < K)
            cur_words, cur_s = words, s_raw
            words = _load_words(w_base, w_rows, next_mask, k0 + BLOCK_K, stride_wn, BLOCK_K, TILED)
            s_raw = _load_scales(s_base, w_rows, next_mask, k0 + BLOCK_K, stride_sn, BLOCK_K, GROUP)
            tl.debug_barrier()
            c0, c4, c1, c5, c2, c6, c3, c7 = _decode_words(cur_words, TILED)
            scale = _block_scale(cur_s, IS_MX, 16384.0)
        else:
            words = _load_words(w_base, w_rows, col_mask, k0, stride_wn, BLOCK_K, TILED)
            c0, c4, c1, c5, c2, c6, c3, c7 = _decode_words(words, TILED)
            s_raw = _load_scales(s_base, w_rows, col_mask, k0, stride_sn, BLOCK_K, GROUP)
            scale = _block_scale(s_raw, IS_MX, 16384.0)
        for r in tl.static_range(BLOCK_M):
            row_ok = start + r < end
            token = tl.load(order_ptr + start + r, mask=row_ok, other=0) // TOP_K
            act = x_ptr + token.to(tl.int64) * stride_x + k0 // 8
            sums = _row_group_sums(c0, c4, c1, c5, c2, c6, c3, c7, act, K // 8, row_ok, BLOCK_K, GROUP)
            acc += tl.where(row_id == r, sums * scale, 0.0)
    gate_up = tl.sum(acc, axis=2)
    if not IS_MX:
        gate_up = gate_up * tl.load(g13_ptr + expert)
    gate, up = tl.split(tl.permute(tl.reshape(gate_up, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    act = _swiglu(gate, up, LIMIT, HAS_LIMIT)
    rows = start + tl.arange(0, BLOCK_M)
    out_cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_mask = (rows < end)[:, None] & (out_cols < I)[None, :]
    word_major_col = (out_cols % 8) * (I // 8) + out_cols // 8
    tl.store(hidden_ptr + rows[:, None] * stride_h + word_major_col[None, :], act, mask=out_mask)


@triton.jit
def _down_gemv_kernel(
    hidden_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, weights_ptr,
    w2_ptr, s2_ptr, g2_ptr, pair_out_ptr,
    E,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    K: tl.constexpr, I: tl.constexpr, IS_MX: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
    TILED: tl.constexpr,
):
    """hidden word-major f32 [M*k, 8, I/8], w2 as int32 words -> weighted pair outputs [M*k, K] f32."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= E:
        return
    start = tl.load(block_start_ptr + block)
    end = tl.load(block_end_ptr + block)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < K
    w_base = w2_ptr + expert.to(tl.int64) * stride_we
    s_base = s2_ptr + expert.to(tl.int64) * stride_se
    row_id = tl.arange(0, BLOCK_M)[:, None, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // GROUP), dtype=tl.float32)
    if PREFETCH:
        words = _load_words(w_base, cols, col_mask, 0, stride_wn, BLOCK_K, TILED)
        s_raw = _load_scales(s_base, cols, col_mask, 0, stride_sn, BLOCK_K, GROUP)
    for k0 in range(0, I, BLOCK_K):
        if PREFETCH:  # see the GEMV path comment
            next_mask = col_mask & (k0 + BLOCK_K < I)
            cur_words, cur_s = words, s_raw
            words = _load_words(w_base, cols, next_mask, k0 + BLOCK_K, stride_wn, BLOCK_K, TILED)
            s_raw = _load_scales(s_base, cols, next_mask, k0 + BLOCK_K, stride_sn, BLOCK_K, GROUP)
            tl.debug_barrier()
            c0, c4, c1, c5, c2, c6, c3, c7 = _decode_words(cur_words, TILED)
            scale = _block_scale(cur_s, IS_MX, 16384.0)
        else:
            words = _load_words(w_base, cols, col_mask, k0, stride_wn, BLOCK_K, TILED)
            c0, c4, c1, c5, c2, c6, c3, c7 = _decode_words(words, TILED)
            s_raw = _load_scales(s_base, cols, col_mask, k0, stride_sn, BLOCK_K, GROUP)
            scale = _block_scale(s_raw, IS_MX, 16384.0)
        for r in tl.static_range(BLOCK_M):
            act = hidden_ptr + (start + r).to(tl.int64) * stride_h + k0 // 8
            sums = _row_group_sums(c0, c4, c1, c5, c2, c6, c3, c7, act, I // 8, start + r < end, BLOCK_K, GROUP)
            acc += tl.where(row_id == r, sums * scale, 0.0)
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    pair = tl.load(order_ptr + rows, mask=row_mask, other=0)
    out = tl.sum(acc, axis=2)
    routing = tl.load(weights_ptr + pair, mask=row_mask, other=0.0)
    if not IS_MX:
        routing = routing * tl.load(g2_ptr + expert)
    out = out * routing[:, None]
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(pair_out_ptr + pair[:, None].to(tl.int64) * stride_o + cols[None, :], out, mask=out_mask)


# MMA path: the dot path with A and B swapped for expert blocks of a few rows (decode, verify). The
# BLOCK_N weight rows are the M side of tl.dot and the block's BLOCK_M pair rows its N side, so
# padding a block of a few pairs to BLOCK_M costs tensor-core work only. Each thread loads its own
# packed words as 16-byte vectors (cp.async into shared memory, pipelined by num_stages, and read back
# by the same thread), decodes them in registers straight into the MMA's A-operand layout and
# multiplies by the group scale. In the sm_90 SASS the K loop issued about 6 instructions per weight
# byte per thread (4.3 of them decoding; the GEMV loop issues about 10) before the swizzled words.
# Four choices make that work:
# - e2m1 -> bf16 two codes at a time (`_e2m1_pair_bits`): the masked nibbles times 2**6 + 2**12 put a
#   code's magnitude at bf16 bits 6..8 and its sign at bit 15 (tiled experts hold each word's bits where
#   `_e2m1_pair_bits_swizzled` finds them in fewer operations, fp4_tiles.SWIZZLED_BIT) (value * 2**-126; code 0.5 lands on a
#   bf16 subnormal, exact) in each half of a 32-bit word; one bf16 multiply by scale * 2**62 (packed,
#   `_scaled_pair`) makes the weight value * scale * 2**-64 (exact for ue8m0 scales in [2**-61, 2**65]
#   and every finite e4m3 scale; a ue8m0 scale above 2**65 overflows to inf, NaN for code 0, where the
#   other paths stay finite up to 2**113), and the epilogue multiplies by 2**64.
# - The reduction order inside a BLOCK_K tile is permuted so that the codes a thread holds in the MMA
#   layout are the codes of its own contiguous words: thread q of a quad holds words
#   [q * BLOCK_K / 32, (q + 1) * BLOCK_K / 32) of its rows. The activations (x, and the hidden rows,
#   both stored in their natural column order) are loaded in the same order (`_mma_load_act`, `_mma_act_operand`): each
#   thread loads the 8 * BLOCK_K / 32 contiguous values its words meet as 16-byte vectors and permutes
#   them in registers. (Loading a plain [BLOCK_K, BLOCK_M] tile of a host-permuted x instead went
#   through an 8-byte-per-thread shared-memory layout change and took 168 registers a thread in the
#   gate/up kernel at 8x16x512 on 1 warp, against 123 now.) KPACK is how many code pairs the MMA
#   layout keeps adjacent per thread: 1 for sm_90's wgmma, 2 for mma.sync (`_mma_kpack`).
# - The words are loaded as [quad lane, row in 8, warp, row half, repeat, word]: Triton's coalescer then
#   gives the lanes and warps exactly the rows and columns the MMA layout gives them, so the final
#   convert to the dot operand is a register renaming. A different Triton layout choice would only cost
#   a layout conversion, never correctness.
# - The scales come as int32 words of 4 scale bytes (cp.async needs 4 bytes); each thread loads the
#   words holding its own bytes once and shifts them out (loading a word per scale byte read each word
#   up to 4 times and, for NVFP4, doubled the scale traffic through L1).
# With num_stages=1 there is no cp.async and, where the per-thread words are one 16-byte vector or
# fewer per (quad lane, row) pair of tiles, no shared memory at all (sm_90 builds of 8x32x256 and
# 8x64x128 on 1 warp). TileConfig.prefetch then runs two K steps a turn, each loaded into registers a
# step ahead (load b; decode and multiply a; load the next a; decode and multiply b), which the H200
# profile of a one-step loop showed is what it takes for the loads to stay in flight: with one
# buffer, ptxas copied each loaded register into the loop-carried one at the end of the iteration
# (waiting for the load there), and carried bf16 activations as 16-bit halves it had to unpack, also
# at the end (36% of the stall samples sat on one such unpack). With two buffers a buffer's
# registers are free when its next load is issued; the activations are loaded and carried as int32
# words of two values (`_mma_load_act`); and `_cta_zero` keeps each step's decode below the barrier
# that follows the other buffer's loads (ptxas otherwise moved the decode above the loads).


@functools.lru_cache(maxsize=None)
def _warn_padded_scales(row_bytes: int) -> None:
    logger.warning("fp4_moe: scale rows of %d bytes are padded to whole words on every call (mma path)",
                   row_bytes)


def _scale_words(scale: torch.Tensor) -> torch.Tensor:
    """uint8 scales [E, R, C] -> int32 words [E, R, cdiv(C, 4)] (rows padded to whole words)."""
    if scale.shape[-1] % 4:
        _warn_padded_scales(scale.shape[-1])
        scale = torch.nn.functional.pad(scale, (0, -scale.shape[-1] % 4))
    return _as_words(scale)


def _mma_kpack(x: torch.Tensor, block_m: int, block_n: int, num_warps: int) -> int:
    """Code pairs per thread that the MMA operand layout of a [block_n, block_m] tile on num_warps keeps
    adjacent: 1 where Triton uses sm_90's wgmma (operand kWidth 2), 2 for mma.sync (kWidth 4). The
    interpreter follows the sm_90 rule."""
    wgmma = block_m >= 16 and block_n % 64 == 0 and num_warps % 4 == 0
    if x.is_cuda:
        wgmma = wgmma and torch.cuda.get_device_capability(x.device)[0] == 9
    return 1 if wgmma else 2


@triton.jit
def _e2m1_pair_bits(words, Q: tl.constexpr, zero):
    """uint32 words of 8 e2m1 codes -> uint32 with codes Q and Q + 4 (Q in 0..3) as the bf16 bits of
    value * 2**-126 in the low and high half. The masked nibbles times 2**6 + 2**12 (the two copies do
    not overlap) put each code's magnitude at bits 6..8 and its sign at bit 15 of its half. `zero`
    (0 at run time) enters the first operation on the words (see `_cta_zero`)."""
    w = words
    if Q >= 2:
        w = words >> (8 + zero)
    if Q % 2 == 0:
        bits = ((w & (0x000F000F | zero)) * 0x1040) & 0x81C081C0
    else:
        bits = ((w & (0x00F000F0 | zero)) * 0x0104) & 0x81C081C0
    return bits


@triton.jit
def _e2m1_pair_bits_swizzled(words, Q: tl.constexpr, zero):
    """`_e2m1_pair_bits` for uint32 words in the tiled layout's bit order (fp4_tiles.SWIZZLED_BIT): codes
    Q and Q + 4 sit where a masking (Q = 0), a rotation and a masking (Q = 1, 2) or a masking, a multiply
    and a masking (Q = 3) put them; with the `zero` taken in once, 9 integer operations a word
    against 13."""
    live = words | zero
    if Q == 0:
        bits = live & 0x81C081C0
    elif Q == 3:
        bits = ((live & 0x001B001B) * 0x1084) & 0x81C081C0
    else:
        bits = ((live >> (3 * Q)) | (live << (32 - 3 * Q))) & 0x81C081C0
    return bits


@triton.jit
def _pair_bits(words, Q: tl.constexpr, zero, SWIZZLED: tl.constexpr):
    """`_e2m1_pair_bits_swizzled` for words of the tiled layout (SWIZZLED), else `_e2m1_pair_bits`."""
    if SWIZZLED:
        bits = _e2m1_pair_bits_swizzled(words, Q, zero)
    else:
        bits = _e2m1_pair_bits(words, Q, zero)
    return bits


@triton.jit
def _scaled_pair(bits, scale, DOT_DTYPE: tl.constexpr):
    """Pair bits from `_e2m1_pair_bits` or `_e2m1_pair_bits_swizzled` [...] times scale [..., 1] -> [..., 2] DOT_DTYPE (low, high)."""
    if DOT_DTYPE == tl.bfloat16:
        # As (low, high) bf16 pairs: ptxas issues one packed bf16 multiply per 32-bit word.
        low = (bits & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        high = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        pair = tl.join(low, high) * scale.to(tl.bfloat16)
    else:
        # f32 operands (f32 x, and the interpreter, whose bf16 emulation has no arithmetic and flushes
        # bf16 subnormals): the same values as f32 (a bf16 is the high half of an f32).
        low = (bits << 16).to(tl.float32, bitcast=True)
        high = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
        pair = tl.join(low, high) * scale
    return pair


@triton.jit
def _mma_load_weights(w_ptr, s_ptr, row0, n_rows, k0, stride_w, stride_s,
                      GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_WARPS: tl.constexpr,
                      TILED: tl.constexpr, SCALE_ASM: tl.constexpr):
    """The packed words and scale words of rows [row0, row0 + BLOCK_N) (zeros at and past n_rows) x the
    BLOCK_K tile at k0 of an FP4 matrix (int32 words, int32 scale words), as each thread holds them:
    words [4, 8, NUM_WARPS, 2, REP, U], scale words [4, 8, NUM_WARPS, 2, REP, SWQ] (`_mma_decode_weights`).

    SCALE_ASM (GPU only): the scale words by inline-asm loads. Triton's coalescer gives a tl.load of
    them a layout of its own, converted to this one in registers; the asm load is left in this layout
    (sm_90, 8x32x128 tiles: gate/up 212 -> 166 registers a thread, down 162 -> 124)."""
    U: tl.constexpr = BLOCK_K // 32  # words per quad lane and row
    WPG: tl.constexpr = GROUP // 8  # words per scale group
    REP: tl.constexpr = BLOCK_N // (16 * NUM_WARPS)
    SPQ: tl.constexpr = U // WPG if U >= WPG else 1  # scales per quad lane and row
    # Each thread loads the scale words holding its SPQ bytes once (SWQ words).
    SWQ: tl.constexpr = SPQ // 4 if SPQ >= 4 else 1
    q = tl.arange(0, 4)[:, None, None, None, None, None]
    lane_row = tl.arange(0, 8)[None, :, None, None, None, None]
    warp = tl.arange(0, NUM_WARPS)[None, None, :, None, None, None]
    half = tl.arange(0, 2)[None, None, None, :, None, None]
    rep = tl.arange(0, REP)[None, None, None, None, :, None]
    row = row0 + rep * (16 * NUM_WARPS) + warp * 16 + half * 8 + lane_row
    row_ok = row < n_rows
    u = tl.arange(0, U)[None, None, None, None, None, :]
    words = tl.load(w_ptr + _at(row, k0 // 8 + q * U + u, stride_w, TILED, 8), mask=row_ok, other=0)
    first = k0 // GROUP + (q * U) // WPG  # a multiple of 4 where SPQ >= 4; else its bytes share one word
    j = tl.arange(0, SWQ)[None, None, None, None, None, :]
    s_ptrs = s_ptr + row * stride_s + first // 4 + j
    if SCALE_ASM:
        s_words = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.nc.b32 $0, [$1]; }",
            "=r,l,r", [s_ptrs, tl.broadcast_to(row_ok, s_ptrs.shape).to(tl.int32)], dtype=tl.int32,
            is_pure=True, pack=1)
    else:
        s_words = tl.load(s_ptrs, mask=row_ok, other=0)
    return words, s_words


@triton.jit
def _mma_decode_weights(words, s_words, k0, zero,
                        IS_MX: tl.constexpr, GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, NUM_WARPS: tl.constexpr, KPACK: tl.constexpr, SWIZZLED: tl.constexpr):
    """`_mma_load_weights`' words and scale words of the tile at k0 -> [BLOCK_N, BLOCK_K] DOT_DTYPE
    value * scale * 2**-64 (without the nvfp4 global scale), columns in the MMA path's order; SWIZZLED:
    the words of the tiled layout (fp4_tiles.SWIZZLED_BIT). `zero`: see `_cta_zero`."""
    U: tl.constexpr = BLOCK_K // 32
    WPG: tl.constexpr = GROUP // 8
    REP: tl.constexpr = BLOCK_N // (16 * NUM_WARPS)
    SPQ: tl.constexpr = U // WPG if U >= WPG else 1
    SWQ: tl.constexpr = SPQ // 4 if SPQ >= 4 else 1
    BPW: tl.constexpr = SPQ // SWQ  # scale bytes used of each scale word
    q = tl.arange(0, 4)[:, None, None, None, None, None]
    s_word = s_words >> (((k0 // GROUP + (q * U) // WPG) % 4) * 8 + zero)
    # Bytes split with joins (a new register dimension) rather than a broadcast, which Triton would
    # lay out differently from the words and convert through shared memory.
    if BPW == 1:
        s_raw = s_word & 0xFF
    elif BPW == 2:
        s_raw = tl.join(s_word & 0xFF, (s_word >> 8) & 0xFF)
    else:
        s_raw = tl.join(tl.join(s_word & 0xFF, (s_word >> 16) & 0xFF),
                        tl.join((s_word >> 8) & 0xFF, (s_word >> 24) & 0xFF))
    scale = _block_scale(tl.reshape(s_raw, (4, 8, NUM_WARPS, 2, REP, SPQ)), IS_MX, 2.0**62)
    scale = tl.reshape(scale, (4, 8, NUM_WARPS, 2, REP, SPQ, 1, 1))
    w = tl.reshape(words.to(tl.uint32, bitcast=True), (4, 8, NUM_WARPS, 2, REP, SPQ, U // SPQ))
    pairs = tl.join(tl.join(_scaled_pair(_pair_bits(w, 0, zero, SWIZZLED), scale, DOT_DTYPE),
                            _scaled_pair(_pair_bits(w, 1, zero, SWIZZLED), scale, DOT_DTYPE)),
                    tl.join(_scaled_pair(_pair_bits(w, 2, zero, SWIZZLED), scale, DOT_DTYPE),
                            _scaled_pair(_pair_bits(w, 3, zero, SWIZZLED), scale, DOT_DTYPE)))
    pairs = tl.reshape(pairs, (4, 8, NUM_WARPS, 2, REP, U, 2, 2, 2))  # [q, lane_row, warp, half, rep, u, a, b, c]
    if KPACK == 1:
        pairs = tl.permute(pairs, (4, 2, 3, 1, 5, 8, 7, 0, 6))  # rows (rep, warp, half, lane_row), k (u, c, b, q, a)
    else:
        pairs = tl.permute(pairs, (4, 2, 3, 1, 5, 8, 0, 7, 6))  # k (u, c, q, b, a)
    return tl.reshape(pairs, (BLOCK_N, BLOCK_K))


@triton.jit
def _mma_load_act(a_ptr, a_rows, row_mask, k0, stride_a, BLOCK_K: tl.constexpr, PACKED: tl.constexpr,
                  FROM_L2: tl.constexpr = False):
    """Activation rows `a_rows` [BLOCK_M] (zeros where not row_mask) x columns [k0, k0 + BLOCK_K) of a
    row-major matrix, as the threads hold them: [quad lane q, row, word u, 8 values] with column
    k0 + 8 (q U + u) + v, U = BLOCK_K / 32. The 8 values of a word are one 16-byte vector and Triton's
    coalescer gives the quad lanes and rows to the lanes as the MMA operand layout does, so each thread
    loads exactly the activations its own weight words meet. PACKED: a_ptr is a bf16 matrix seen as
    int32 (two values a word, stride_a in words), returned as [q, row, u, 4] words (`_mma_act_operand`).
    FROM_L2: the loads skip L1 (.cg)."""
    U: tl.constexpr = BLOCK_K // 32
    V: tl.constexpr = 4 if PACKED else 8
    q = tl.arange(0, 4)[:, None, None, None]
    u = tl.arange(0, U)[None, None, :, None]
    v = tl.arange(0, V)[None, None, None, :]
    offs = a_rows[None, :, None, None].to(tl.int64) * stride_a + ((k0 * V) // 8 + V * (q * U + u) + v)
    CACHE: tl.constexpr = ".cg" if FROM_L2 else ""
    return tl.load(a_ptr + offs, mask=row_mask[None, :, None, None], other=0, cache_modifier=CACHE)


@triton.jit
def _cta_zero(COMPILED: tl.constexpr):
    """A CTA barrier that returns int32 0, which the compilers cannot see through: the loop's later
    loads cannot move above it (a barrier orders memory operations), and the decoding that takes
    the 0 into its first operation cannot move above it either, so a K step loaded before the barrier
    stays in flight while the previous step is decoded (see the MMA path comment)."""
    if COMPILED:
        zero = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $1, $1; bar.red.or.pred p, 0, p; selp.u32 $0, 1, 0, p; }",
            "=r,r", [tl.program_id(0)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        zero = 0
    return zero


@triton.jit
def _mma_act_operand(raw, zero, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, KPACK: tl.constexpr,
                     PACKED: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """`_mma_load_act`'s tile -> [BLOCK_K, BLOCK_M] DOT_DTYPE, the reduction index in the MMA path's
    order (the order in which `_mma_decode_weights` returns a quad lane's codes); in registers.
    `zero`: see `_cta_zero`."""
    if PACKED:
        words = raw.to(tl.uint32, bitcast=True)
        if DOT_DTYPE == tl.bfloat16:
            low = (words & (0xFFFF | zero)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            high = (words >> (16 + zero)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:  # exact: a bf16 is the high half of an f32 (the interpreter's path: not pinned)
            low = (words << 16).to(tl.float32, bitcast=True)
            high = (words & 0xFFFF0000).to(tl.float32, bitcast=True)
        vals = tl.join(low, high)  # [q, row, u, 4, 2]: value 2 * word + half
    else:
        vals = raw.to(DOT_DTYPE)
    vals = tl.reshape(vals, (4, BLOCK_M, BLOCK_K // 32, 2, 2, 2))  # [q, row, u, a, c, b]: v = 4a + 2c + b
    if KPACK == 1:
        vals = tl.permute(vals, (2, 4, 5, 0, 3, 1))  # k (u, c, b, q, a)
    else:
        vals = tl.permute(vals, (2, 4, 0, 5, 3, 1))  # k (u, c, q, b, a)
    return tl.reshape(vals, (BLOCK_K, BLOCK_M))


@triton.jit
def _gate_up_mma_loads(x_ptr, token, row_mask, w_base, s_base, u_base, us_base, col0, k0, live,
                       stride_x, stride_wn, stride_sn, I: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, NUM_WARPS: tl.constexpr, PACKED: tl.constexpr, TILED: tl.constexpr,
                       SCALE_ASM: tl.constexpr):
    """One K step's activations, gate words and scale words, up words and scale words (zeros where
    not `live`)."""
    x_raw = _mma_load_act(x_ptr, token, row_mask & live, k0, stride_x, BLOCK_K, PACKED)
    n_rows = tl.where(live, I, 0)
    g_words, g_scales = _mma_load_weights(w_base, s_base, col0, n_rows, k0, stride_wn, stride_sn,
                                          GROUP, BLOCK_N, BLOCK_K, NUM_WARPS, TILED, SCALE_ASM)
    u_words, u_scales = _mma_load_weights(u_base, us_base, col0, n_rows, k0, stride_wn, stride_sn,
                                          GROUP, BLOCK_N, BLOCK_K, NUM_WARPS, TILED, SCALE_ASM)
    return x_raw, g_words, g_scales, u_words, u_scales


@triton.jit
def _gate_up_mma_step(acc_gate, acc_up, x_raw, g_words, g_scales, u_words, u_scales, k0, zero,
                      IS_MX: tl.constexpr, GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_WARPS: tl.constexpr, KPACK: tl.constexpr,
                      PACKED: tl.constexpr, TILED: tl.constexpr):
    """Both accumulators [BLOCK_N, BLOCK_M] plus the K step at k0 of `_gate_up_mma_loads`' tiles."""
    xt = _mma_act_operand(x_raw, zero, BLOCK_M, BLOCK_K, KPACK, PACKED, DOT_DTYPE)
    gate_w = _mma_decode_weights(g_words, g_scales, k0, zero, IS_MX, GROUP, DOT_DTYPE, BLOCK_N, BLOCK_K, NUM_WARPS, KPACK,
                                 TILED)
    acc_gate = tl.dot(gate_w, xt, acc_gate, input_precision="ieee")
    up_w = _mma_decode_weights(u_words, u_scales, k0, zero, IS_MX, GROUP, DOT_DTYPE, BLOCK_N, BLOCK_K, NUM_WARPS, KPACK,
                               TILED)
    acc_up = tl.dot(up_w, xt, acc_up, input_precision="ieee")
    return acc_gate, acc_up


@triton.jit
def _gate_up_mma_kernel(
    x_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr,
    w13_ptr, s13_ptr, g13_ptr, hidden_ptr,
    E,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h,
    LIMIT,
    part_ptr, stride_ps, stride_pr, ready_ptr,
    K: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
    HAS_LIMIT: tl.constexpr, IS_MX: tl.constexpr, GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_WARPS: tl.constexpr, KPACK: tl.constexpr, PREFETCH: tl.constexpr, PACKED: tl.constexpr,
    COMPILED: tl.constexpr,
    TILED: tl.constexpr,
    SCALE_ASM: tl.constexpr,
    K_SPLITS: tl.constexpr,
    DIRECT: tl.constexpr,
    PDL: tl.constexpr,
    COUNT_READY: tl.constexpr,
):
    """x [M, K] (int32 pairs where PACKED), w13 / scales as int32 words -> hidden [M*k, I] (rows in
    sorted-pair order, or pair order with DIRECT). With K_SPLITS > 1, program_id(2) sums K / K_SPLITS
    of the reduction and stores its gate and up sums, f32, at part[split, row, :I] and [I:]
    (`_swiglu_partials_kernel` finishes them). COUNT_READY: each program adds 1 to ready[block] once
    its hidden rows are stored (the down kernel's ready counts)."""
    tl.static_assert(not COUNT_READY or K_SPLITS == 1, "ready counts need whole gate/up sums (K_SPLITS == 1)")
    wait_for_producers(PDL)
    expert, rows, row_mask = _block_rows(tl.program_id(1), block_expert_ptr, block_start_ptr, block_end_ptr,
                                         BLOCK_M, DIRECT)
    if (expert < 0) | (expert >= E):
        return
    token = _pair_of(order_ptr, rows, row_mask, DIRECT) // TOP_K
    col0 = tl.program_id(0) * BLOCK_N
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    s_base = s13_ptr + expert.to(tl.int64) * stride_se
    u_base, us_base = w_base + I * stride_wn, s_base + I * stride_sn
    acc_gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    K_SPAN: tl.constexpr = K // K_SPLITS
    if K_SPLITS == 1:
        k_begin = 0
    else:
        k_begin = tl.program_id(2) * K_SPAN
    if PREFETCH:  # two K steps a turn, each loaded a step ahead (see the MMA path comment)
        xa, ga, gsa, ua, usa = _gate_up_mma_loads(x_ptr, token, row_mask, w_base, s_base, u_base, us_base, col0,
                                                  k_begin, True, stride_x, stride_wn, stride_sn, I, GROUP, BLOCK_N,
                                                  BLOCK_K, NUM_WARPS, PACKED, TILED, SCALE_ASM)
        for kk in range(0, K_SPAN, 2 * BLOCK_K):
            k0 = k_begin + kk
            xb, gb, gsb, ub, usb = _gate_up_mma_loads(x_ptr, token, row_mask, w_base, s_base, u_base, us_base, col0,
                                                      k0 + BLOCK_K, kk + BLOCK_K < K_SPAN, stride_x, stride_wn,
                                                      stride_sn, I, GROUP, BLOCK_N, BLOCK_K, NUM_WARPS, PACKED, TILED, SCALE_ASM)
            zero = _cta_zero(COMPILED)
            acc_gate, acc_up = _gate_up_mma_step(acc_gate, acc_up, xa, ga, gsa, ua, usa, k0, zero, IS_MX, GROUP,
                                                 DOT_DTYPE, BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, KPACK, PACKED, TILED)
            xa, ga, gsa, ua, usa = _gate_up_mma_loads(x_ptr, token, row_mask, w_base, s_base, u_base, us_base, col0,
                                                      k0 + 2 * BLOCK_K, kk + 2 * BLOCK_K < K_SPAN, stride_x, stride_wn,
                                                      stride_sn, I, GROUP, BLOCK_N, BLOCK_K, NUM_WARPS, PACKED, TILED, SCALE_ASM)
            zero = _cta_zero(COMPILED)
            acc_gate, acc_up = _gate_up_mma_step(acc_gate, acc_up, xb, gb, gsb, ub, usb, k0 + BLOCK_K, zero, IS_MX,
                                                 GROUP, DOT_DTYPE, BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, KPACK, PACKED, TILED)
    else:
        for kk in range(0, K_SPAN, BLOCK_K):
            k0 = k_begin + kk
            xa, ga, gsa, ua, usa = _gate_up_mma_loads(x_ptr, token, row_mask, w_base, s_base, u_base, us_base, col0,
                                                      k0, True, stride_x, stride_wn, stride_sn, I, GROUP, BLOCK_N,
                                                      BLOCK_K, NUM_WARPS, PACKED, TILED, SCALE_ASM)
            acc_gate, acc_up = _gate_up_mma_step(acc_gate, acc_up, xa, ga, gsa, ua, usa, k0, 0, IS_MX, GROUP,
                                                 DOT_DTYPE, BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, KPACK, PACKED, TILED)
    fix = 2.0**64  # the 2**-64 of the decoded weights
    if not IS_MX:
        fix = fix * tl.load(g13_ptr + expert)
    gate = acc_gate * fix
    up = acc_up * fix
    cols = col0 + tl.arange(0, BLOCK_N)
    out_mask = (cols < I)[:, None] & row_mask[None, :]
    if K_SPLITS == 1:
        act = _swiglu(gate, up, LIMIT, HAS_LIMIT)
        tl.store(hidden_ptr + rows[None, :] * stride_h + cols[:, None], act.to(hidden_ptr.dtype.element_ty),
                 mask=out_mask)
        if COUNT_READY:
            count_done(ready_ptr + tl.program_id(1))
    else:
        part = part_ptr + tl.program_id(2) * stride_ps + rows[None, :].to(tl.int64) * stride_pr + cols[:, None]
        tl.store(part, gate, mask=out_mask)
        tl.store(part + I, up, mask=out_mask)


@triton.jit
def _swiglu_partials_kernel(
    part_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, hidden_ptr,
    E, stride_ps, stride_pr, stride_h, LIMIT,
    I: tl.constexpr, SPLITS: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
    DIRECT: tl.constexpr, PDL: tl.constexpr,
):
    """Split gate/up sums part [SPLITS, M*k, 2I] f32 -> hidden [M*k, I] = clamped SwiGLU of their sums
    (in split order), for the rows of block program_id(1) (`_block_rows`), columns tile program_id(0)."""
    wait_for_producers(PDL)
    expert, rows, row_mask = _block_rows(tl.program_id(1), block_expert_ptr, block_start_ptr, block_end_ptr,
                                         BLOCK_M, DIRECT)
    if (expert < 0) | (expert >= E):
        return
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = row_mask[:, None] & (cols < I)[None, :]
    offs = rows[:, None].to(tl.int64) * stride_pr + cols[None, :]
    gate = tl.zeros((BLOCK_M, BLOCK), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        gate += tl.load(part_ptr + s * stride_ps + offs, mask=mask, other=0.0)
        up += tl.load(part_ptr + s * stride_ps + offs + I, mask=mask, other=0.0)
    act = _swiglu(gate, up, LIMIT, HAS_LIMIT)
    tl.store(hidden_ptr + rows[:, None].to(tl.int64) * stride_h + cols[None, :], act.to(hidden_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _down_mma_loads(h_ptr, rows, row_mask, w_base, s_base, col0, k0, live, stride_h, stride_wn, stride_sn,
                    K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    NUM_WARPS: tl.constexpr, PACKED: tl.constexpr, TILED: tl.constexpr, SCALE_ASM: tl.constexpr,
                    H_FROM_L2: tl.constexpr = False):
    """One K step's hidden rows (past L1 with H_FROM_L2), w2 words and scale words (zeros where not
    `live`)."""
    h_raw = _mma_load_act(h_ptr, rows, row_mask & live, k0, stride_h, BLOCK_K, PACKED, H_FROM_L2)
    words, scales = _mma_load_weights(w_base, s_base, col0, tl.where(live, K, 0), k0, stride_wn, stride_sn,
                                      GROUP, BLOCK_N, BLOCK_K, NUM_WARPS, TILED, SCALE_ASM)
    return h_raw, words, scales


@triton.jit
def _down_mma_step(acc, h_raw, words, scales, k0, zero, IS_MX: tl.constexpr, GROUP: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   NUM_WARPS: tl.constexpr, KPACK: tl.constexpr, PACKED: tl.constexpr, TILED: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] plus the K step at k0 of `_down_mma_loads`' tiles."""
    ht = _mma_act_operand(h_raw, zero, BLOCK_M, BLOCK_K, KPACK, PACKED, DOT_DTYPE)
    w = _mma_decode_weights(words, scales, k0, zero, IS_MX, GROUP, DOT_DTYPE, BLOCK_N, BLOCK_K, NUM_WARPS, KPACK, TILED)
    return tl.dot(w, ht, acc, input_precision="ieee")


@triton.jit
def _down_mma_kernel(
    hidden_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr, weights_ptr,
    w2_ptr, s2_ptr, g2_ptr, pair_out_ptr,
    E,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_o, ready_ptr,
    K: tl.constexpr, I: tl.constexpr, IS_MX: tl.constexpr, GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_WARPS: tl.constexpr, KPACK: tl.constexpr, PREFETCH: tl.constexpr, PACKED: tl.constexpr,
    COMPILED: tl.constexpr,
    TILED: tl.constexpr,
    SCALE_ASM: tl.constexpr,
    DIRECT: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr,
    READY: tl.constexpr,
    RELAXED_SPIN: tl.constexpr,
):
    """hidden [M*k, I] (int32 pairs where PACKED), w2 / scales as int32 words -> weighted pair
    outputs [M*k, K] f32 (blocks as in `_block_rows`).

    EARLY (with PDL and PREFETCH, on weights read in place): the programs read their block and their
    first K step's weights before they wait for the hidden rows. They launch once every program of
    the kernel before (gate/up, or the split sums) has passed its own wait, so the kernels that wrote
    the block table or the ids have finished: those are read from L2, past L1 (FROM_L2). The model's
    weights are not written while a step runs; a copy the launcher made of them (padded scale rows,
    misaligned codes) would be new data at a possibly reused address, so it turns EARLY off.

    READY (with PREFETCH; gate/up's programs a block, 0 = off): a program waits for its own block's
    hidden rows only, ready[block] reaching READY (gate/up's COUNT_READY), not for the whole gate/up
    grid, and reads them from L2; it then lets the next kernel launch, and waits for gate/up's end only
    before its store, so that this kernel still ends after its producers. A block whose count ends
    above READY (a miscount) writes NaN outputs; under the interpreter, which reads the count once
    after gate/up's grid, so does one below it. Compiled, a count below READY would spin forever: the
    counting and the waiting must agree on READY (`cdiv(I, gate/up BLOCK_N)`, one add a program).

    The block table and `ready` come from the grouping kernel, which this kernel reads before any wait
    of its own: gate/up's programs pass their wait only once the grouping has ended, and they let this
    kernel launch right after it (moving that release later would need this argument, and the one
    against a deadlock, made again)."""
    tl.static_assert(READY == 0 or PREFETCH, "ready counts are awaited in the PREFETCH loop's preamble")
    AHEAD: tl.constexpr = EARLY or READY > 0
    H_FROM_L2: tl.constexpr = READY > 0
    if not AHEAD:
        wait_for_producers(PDL)
    expert, rows, row_mask = _block_rows(tl.program_id(1), block_expert_ptr, block_start_ptr, block_end_ptr,
                                         BLOCK_M, DIRECT, AHEAD)
    if (expert < 0) | (expert >= E):
        if AHEAD:  # the wait keeps this kernel's end after its producers' (kernels after it rely on that)
            wait_for_producers(PDL)
        return
    col0 = tl.program_id(0) * BLOCK_N
    w_base = w2_ptr + expert.to(tl.int64) * stride_we
    s_base = s2_ptr + expert.to(tl.int64) * stride_se
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PREFETCH:  # as in _gate_up_mma_kernel
        if AHEAD:
            wa, sa = _mma_load_weights(w_base, s_base, col0, K, 0, stride_wn, stride_sn,
                                       GROUP, BLOCK_N, BLOCK_K, NUM_WARPS, TILED, SCALE_ASM)
            if READY > 0:
                complete = await_count(ready_ptr + tl.program_id(1), READY, COMPILED, RELAXED_SPIN)
                release_in_mode(PDL)
            else:
                wait_for_producers(PDL)
            ha = _mma_load_act(hidden_ptr, rows, row_mask, 0, stride_h, BLOCK_K, PACKED, H_FROM_L2)
        else:
            ha, wa, sa = _down_mma_loads(hidden_ptr, rows, row_mask, w_base, s_base, col0, 0, True, stride_h,
                                         stride_wn, stride_sn, K, GROUP, BLOCK_N, BLOCK_K, NUM_WARPS, PACKED, TILED,
                                         SCALE_ASM)
        for k0 in range(0, I, 2 * BLOCK_K):
            hb, wb, sb = _down_mma_loads(hidden_ptr, rows, row_mask, w_base, s_base, col0, k0 + BLOCK_K,
                                         k0 + BLOCK_K < I, stride_h, stride_wn, stride_sn, K, GROUP, BLOCK_N, BLOCK_K,
                                         NUM_WARPS, PACKED, TILED, SCALE_ASM, H_FROM_L2)
            zero = _cta_zero(COMPILED)
            acc = _down_mma_step(acc, ha, wa, sa, k0, zero, IS_MX, GROUP, DOT_DTYPE, BLOCK_M, BLOCK_N, BLOCK_K,
                                 NUM_WARPS, KPACK, PACKED, TILED)
            ha, wa, sa = _down_mma_loads(hidden_ptr, rows, row_mask, w_base, s_base, col0, k0 + 2 * BLOCK_K,
                                         k0 + 2 * BLOCK_K < I, stride_h, stride_wn, stride_sn, K, GROUP, BLOCK_N,
                                         BLOCK_K, NUM_WARPS, PACKED, TILED, SCALE_ASM, H_FROM_L2)
            zero = _cta_zero(COMPILED)
            acc = _down_mma_step(acc, hb, wb, sb, k0 + BLOCK_K, zero, IS_MX, GROUP, DOT_DTYPE, BLOCK_M, BLOCK_N,
                                 BLOCK_K, NUM_WARPS, KPACK, PACKED, TILED)
    else:
        for k0 in range(0, I, BLOCK_K):
            ha, wa, sa = _down_mma_loads(hidden_ptr, rows, row_mask, w_base, s_base, col0, k0, True, stride_h,
                                         stride_wn, stride_sn, K, GROUP, BLOCK_N, BLOCK_K, NUM_WARPS, PACKED, TILED, SCALE_ASM)
            acc = _down_mma_step(acc, ha, wa, sa, k0, 0, IS_MX, GROUP, DOT_DTYPE, BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS,
                                 KPACK, PACKED, TILED)
    pair = _pair_of(order_ptr, rows, row_mask, DIRECT)
    routing = tl.load(weights_ptr + pair, mask=row_mask, other=0.0) * 2.0**64
    if not IS_MX:
        routing = routing * tl.load(g2_ptr + expert)
    if READY > 0:
        routing = tl.where(complete, routing, float("nan"))
    acc = acc * routing[None, :]
    cols = col0 + tl.arange(0, BLOCK_N)
    out_mask = (cols < K)[:, None] & row_mask[None, :]
    if READY > 0:
        wait_without_release(PDL)
    tl.store(pair_out_ptr + pair[None, :].to(tl.int64) * stride_o + cols[:, None], acc, mask=out_mask)


def native_fp4_dot(x: torch.Tensor, fmt: str) -> bool:
    """Whether row-major MXFP4 takes tl.dot_scaled's size classes (GEMV, then the dot path): on sm_100.

    With x in bf16, Triton 3.6 compiles tl.dot_scaled to bf16 MMAs on the decoded codes, not FP4 ones
    (cross-compiled PTX, twenty-ninth session): tcgen05 kind::f16 on sm_100, mma.sync m16n8k16 bf16 on
    sm_120. On sm_120 that is the instruction the mma path's one-warp tiles use on the H200 too, where
    the mma path beat GEMV by 17-26% at M=1 and 8 (bench/RESULTS.md, sixth session), so sm_120 takes
    the mma path (not timed on sm_120); sm_100 keeps tl.dot_scaled (not timed either)."""
    capability = device_capability(x)
    return fmt == "mxfp4" and capability is not None and capability[0] == 10


MIN_REG_CAP, MAX_REG_CAP = 24, 255  # what ptxas accepts as a thread's register cap


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One launch configuration of the two expert kernels.

    path: "gemv" (no tl.dot; for expert blocks of a few rows), "dot" (tl.dot / tl.dot_scaled) or "mma"
    (tl.dot with the weight rows as the M side, see the MMA path comment; block_n a multiple of
    16 * num_warps, block_k >= 32, K and I multiples of 32).
    block_m: pair rows per expert block; block_n: output columns per program; block_k: reduction
    columns per loop step (clamped to what divides K and I, see `_fit_block_k`); prefetch (GEMV path, and
    mma path with num_stages=1): load the next K step's weights before decoding the current one (see the
    GEMV path and MMA path comments). down_block_n, down_num_warps (mma path; 0 = as block_n, num_warps):
    the down kernel's own output columns per program and warps. scale_asm (mma path, GPU only): the
    scale words by inline-asm loads (`_mma_load_weights`). max_regs, down_max_regs (GPU only; 0 = the
    compiler's choice): a register cap a thread for the gate/up and the down kernel (Triton's maxnreg),
    so that more programs fit on an SM. k_splits (mma path): programs that share each gate/up product's
    K reduction (split-K; their f32 sums are finished by `_swiglu_partials_kernel`), lowered where K has
    fewer BLOCK_K steps (`_fit_splits`). direct_blocks (mma path): one expert block a (token, choice) pair,
    in pair order, read from the ids themselves, without `expert_blocks`' grouping kernels (for a decode
    token's choices, which are distinct experts: an expert chosen twice is read twice). ready_counts
    (mma path with prefetch, expert blocks, no split-K): each down program waits for its own block's
    gate/up programs (ready counts, `_down_mma_kernel`'s READY) instead of the whole gate/up grid;
    taken where the down kernel launches early (EARLY) and under the interpreter, where a wrong count
    shows as NaN outputs. On by default for MXFP4 only (READY_COUNTS_FORMATS). relaxed_spin (with
    ready_counts): a down program whose count is short spins on volatile loads and acquires once
    (`await_count`'s RELAXED); not timed yet, so off by default.
    """

    path: str
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    prefetch: bool = False
    down_block_n: int = 0
    down_num_warps: int = 0
    scale_asm: bool = False
    max_regs: int = 0
    down_max_regs: int = 0
    k_splits: int = 1
    direct_blocks: bool = False
    ready_counts: bool = False
    relaxed_spin: bool = False

    def __post_init__(self):
        if self.path not in ("gemv", "dot", "mma"):
            raise ValueError(f"TileConfig.path must be 'gemv', 'dot' or 'mma', got {self.path!r}")
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two, got {value}")
        if self.path == "dot" and self.block_m < 16:
            raise ValueError(f"TileConfig.block_m must be >= 16 for the dot path (tl.dot), got {self.block_m}")
        if self.path == "mma" and self.block_k < 32:
            raise ValueError(f"TileConfig.block_k must be >= 32 for the mma path (a word per quad lane), "
                             f"got {self.block_k}")
        if self.path == "mma" and self.block_n % (16 * self.num_warps):
            raise ValueError(f"TileConfig.block_n must be a multiple of 16 * num_warps = {16 * self.num_warps} "
                             f"for the mma path, got {self.block_n}")
        for name in ("down_block_n", "down_num_warps"):
            value = getattr(self, name)
            if value and (self.path != "mma" or value < 0 or value & (value - 1)):
                raise ValueError(f"TileConfig.{name} applies to the mma path and must be 0 or a power of two, "
                                 f"got {value} for path {self.path!r}")
        for name in ("max_regs", "down_max_regs"):
            value = getattr(self, name)
            if value and not MIN_REG_CAP <= value <= MAX_REG_CAP:
                raise ValueError(f"TileConfig.{name} must be 0 (no cap) or in [{MIN_REG_CAP}, {MAX_REG_CAP}], "
                                 f"got {value}")
        if self.scale_asm and self.path != "mma":
            raise ValueError(f"TileConfig.scale_asm applies to the mma path, got path {self.path!r}")
        down_n, down_warps = self.down_shape()
        if self.path == "mma" and down_n % (16 * down_warps):
            raise ValueError(f"TileConfig: the down kernel's block_n {down_n} must be a multiple of 16 * its "
                             f"num_warps = {16 * down_warps} for the mma path")
        if self.k_splits < 1 or self.k_splits & (self.k_splits - 1) or (self.k_splits > 1 and self.path != "mma"):
            raise ValueError(f"TileConfig.k_splits must be a power of two, above 1 only for the mma path, "
                             f"got {self.k_splits} for path {self.path!r}")
        if self.direct_blocks and self.path != "mma":
            raise ValueError(f"TileConfig.direct_blocks applies to the mma path, got path {self.path!r}")
        if self.ready_counts and not (self.path == "mma" and self.prefetch and not self.direct_blocks
                                      and self.k_splits == 1):
            raise ValueError("TileConfig.ready_counts applies to the mma path with prefetch, expert blocks "
                             "(not direct_blocks) and k_splits=1")
        if self.relaxed_spin and not self.ready_counts:
            raise ValueError("TileConfig.relaxed_spin applies with ready_counts")
        if self.prefetch and not (self.path == "gemv" or (self.path == "mma" and self.num_stages == 1)):
            raise ValueError("TileConfig.prefetch applies to the gemv path and to the mma path with num_stages=1 "
                             "(the others pipeline with num_stages)")

    def down_shape(self) -> tuple[int, int]:
        """(output columns per program, warps) of the down kernel."""
        return self.down_block_n or self.block_n, self.down_num_warps or self.num_warps


# The path by average pairs per expert (M*k / E; a static shape fact, so the choice is
# capture-safe), from the H200 sweeps (bench/bench_fp4_moe.py --sweep, V4-Flash E=256, k=6, tiled
# experts, bench/RESULTS.md "Sixth session"). Up to 16 pairs per expert both formats take the mma path
# with 8-pair blocks, one warp a program, no shared-memory pipeline and two K steps of 128 columns a
# turn, each loaded ahead into registers (the MMA path comment): 16 weight rows at 1 pair per expert
# (M=1: MXFP4 0.072 ms vs 0.087 for the one-row GEMV blocks; M=8 0.240 vs 0.318), 32 above for MXFP4 (then
# M=64: MXFP4 0.849 ms, NVFP4 0.880; M=256: 1.25 / 1.30 vs 1.46 / 1.55 for 256-column steps without
# prefetch). The 32-row class loads its scale words by inline asm (scale_asm): in the B=64 step, timed
# paired against the tl.load form, -74 us of 4,269 (-1.7%); the 16-row class keeps tl.load (+5 us at
# B=1, +18 us at B=8; RESULTS.md "Twelfth session"). The 32-row class also caps gate/up's registers at
# 160: an SM holds more of the one-warp programs (RESULTS.md "Thirteenth session"). Its down kernel takes
# 128 rows on 4 warps, uncapped (168 registers, no spills), as the 16-row class's: timed paired at
# M=96..682 against the one-warp 32-row down capped at 112 (which spilled 260 / 332 bytes), MXFP4 -10.8
# to -34.6 us, NVFP4 -7.0 to -32.2, and -67 us of 6,846 in the B=64 T=4 step, logits bit-equal
# (RESULTS.md "Twenty-fourth session"). NVFP4, whose 32-row gate/up spills 28 bytes at 160, takes the
# whole 16-row class above 2 pairs per expert as well: -65 / -52 / -48 / -31 / -25 us at M=96 / 128 /
# 256 / 512 / 682 against the 32-row class (MXFP4 gained at M <= 256 and lost 18-36 us at 512 and 682).
# At 2 pairs per expert (M = 43..85 at k=6: the B=64 decode step) gate/up took 16 weight rows and
# down 64 rows on 2 warps, without asm scales or caps: timed paired against the 32-row class at M=48,
# 64, 80, MXFP4 -1.7 / -1.3 / -0.4%, NVFP4 -2.8 / -3.3 / -2.3%, and in the B=64 T=1 step -41 us of
# 4,280 (RESULTS.md "Fourteenth session"). At 6 pairs (T=4) 16-row gate/up did not win (step +30 and
# +43 us with asm scales, within its noise; kernels at M=256 +3 to +6%). Up to 2 pairs per expert the
# down kernel now takes 128 rows on 4 warps (`mma_small`): paired kernels against 64 x 2 at M=48, 64,
# 80, MXFP4 -2.0 / -3.2 / -3.3 us, NVFP4 -3.4 / -3.9 / -4.6 (-0.3 to -0.5%), and against the
# one-warp 16-row down at M=2, 4, 8, 16, 32, MXFP4 -1.8 / -3.8 / -6.0 / -14.3 / -24.7 us, NVFP4 -2.5 /
# -4.8 / -7.2 / -18.2 / -33.8 (-2 to -5%); but +2.8 / +1.5 us (+5 / +3%) at M=1 (6 pairs), so up to
# TOKEN_MAX_PAIRS pairs (one decode token's choices; `mma_token`) keep the one-warp down (RESULTS.md
# "Fifteenth session"; the step itself was not re-timed). `mma_token` splits gate/up's K in two
# (k_splits) and takes one block a pair straight from the ids (direct_blocks: no grouping kernels, and
# a decode token's choices are distinct experts). Paired at M=1 against the unsplit table launch: split
# alone MXFP4 -2.9 us of 56.4, NVFP4 -3.5 of 59.4 (4 and 8 splits less, M=8 none); with direct blocks
# a further -9.3 / -10.0 us (43.7 / 46.2 us, 0.38 of HBM); the B=1 step -10.2 us of 1,182 (split),
# then -36.5 of 1,166 (direct; logits bit-equal) (RESULTS.md "Eighteenth session"). Direct blocks
# also won at M=8 (48 pairs over 256 experts, of which a few share an expert and are read twice):
# MXFP4 -8.1 us of 212.5, NVFP4 -8.9 of 226.8, paired (with gate/up split in two only -4.5 / -7.1), so
# `mma_few` is `mma_small` with direct blocks up to FEW_MAX_PAIRS pairs while the experts are at
# least 4x the pairs (a kernel measurement; no step was timed at B=2..8). Since the grouping takes one
# program (twentieth session), the expert blocks win back from 48 pairs (M=8: -5.5 to -10.8 us of
# 186-199, paired in two runs; 3-6 of 48 pairs shared an expert and were read twice with direct
# blocks), while direct blocks still win at 12 and 24 pairs (M=2, 4: 3.3 to 5.4 us); so FEW_MAX_PAIRS is
# 24 (RESULTS.md "Twenty-second session"; 30 to 42 pairs not timed). With the tiled layout's
# swizzled words (twenty-first session) these defaults stayed best, timed paired at M=64 (asm scales,
# caps 128 / 96, the 32-row class) and M=256 (caps 176 / 128, 144 / 104, none, tl.load scales).
# Beyond 16 pairs per expert (prefill) both formats
# take 64-row dot blocks. On sm_100
# (native_fp4_dot) row-major MXFP4 takes GEMV up to GEMV_MAX_ROWS and the dot path above,
# which uses tl.dot_scaled there (as do K or I that are not multiples of 32). The mma path's exactness
# range is in the MMA path comment (ue8m0 scales up to 2**65; the model's experts are checked once,
# see check_mxfp4_scale_range).
GEMV_MAX_ROWS = 2
DENSE_MIN_ROWS = 17
TOKEN_MAX_PAIRS = 8  # measured: 6 pairs lose with the 128-row down, 12 gain
FEW_MAX_PAIRS = 24  # measured: direct blocks win at 12 and 24 pairs, expert blocks at 48
DEFAULT_CONFIGS = {
    "gemv": TileConfig("gemv", 1, 16, 512, num_warps=4, prefetch=True),
    "mma_token": TileConfig("mma", 8, 16, 128, num_warps=1, num_stages=1, prefetch=True, k_splits=2,
                            direct_blocks=True),
    "mma_few": TileConfig("mma", 8, 16, 128, num_warps=1, num_stages=1, prefetch=True, down_block_n=128,
                          down_num_warps=4, direct_blocks=True),
    "mma_small": TileConfig("mma", 8, 16, 128, num_warps=1, num_stages=1, prefetch=True, down_block_n=128,
                            down_num_warps=4, ready_counts=True),
    "mma": TileConfig("mma", 8, 32, 128, num_warps=1, num_stages=1, prefetch=True, down_block_n=128,
                      down_num_warps=4, scale_asm=True, max_regs=160, ready_counts=True),
    "dot16": TileConfig("dot", 16, 64, 128, num_warps=4, num_stages=2),
    "dot64": TileConfig("dot", 64, 64, 128, num_warps=4, num_stages=2),
}
# The formats whose down kernels wait on their own block's ready counts (TileConfig.ready_counts) where
# the default config has them. Timed paired on the H200 (tiled experts, PDL; RESULTS.md "Thirtieth
# session"): MXFP4 -7.6 / -10.2 / -18.2 us at M=8 / 64 / 256 and the B=64 T=1 step -31 us of 3,748
# (logits bit-equal); NVFP4 -2.3 / +6.3 / +13.1 us, so NVFP4 waits for the whole gate/up grid.
READY_COUNTS_FORMATS = ("mxfp4",)
# The configs that differ off sm_90, where tl.dot has no wgmma (the H200 chose DEFAULT_CONFIGS with it).
# The dot path's 64-row class on 128-column K steps, cross-compiled at K=4096, I=2048 (twenty-ninth
# session), spills on sm_120 (gate/up 628 B MXFP4 / 188 B NVFP4 dequantised, 44 B with tl.dot_scaled;
# down 32-116 B), sm_89 and sm_80 (up to 688 B), and sm_100's tl.dot_scaled down kernel (84 B); on
# 64-column steps none spills there (sm_89's MXFP4 gate/up 20 B). Not timed on any of these GPUs.
OFF_SM90_CONFIGS = {"dot64": TileConfig("dot", 64, 64, 64, num_warps=4, num_stages=2)}


def size_class(pairs: int, experts: int, fmt: str, native_fp4: bool = False, mma_fits: bool = True) -> str:
    """The DEFAULT_CONFIGS key for M*k = `pairs` (token, choice) pairs over `experts` experts in
    format `fmt`; `native_fp4`: row-major MXFP4 takes tl.dot_scaled (see native_fp4_dot); `mma_fits`: K
    and I are multiples of 32, which the mma path needs (NVFP4 allows multiples of 16)."""
    average = max(1, -(-pairs // experts))
    if average >= DENSE_MIN_ROWS:
        return "dot64"
    if (fmt == "mxfp4" and native_fp4) or not mma_fits:
        return "gemv" if average <= GEMV_MAX_ROWS else "dot16"
    if average > 2:
        return "mma" if fmt == "mxfp4" else "mma_small"
    if pairs <= TOKEN_MAX_PAIRS:
        return "mma_token"
    return "mma_few" if pairs <= FEW_MAX_PAIRS and 4 * pairs <= experts else "mma_small"


def takes_sm90_configs(x: torch.Tensor) -> bool:
    """Whether launches on x's device take DEFAULT_CONFIGS unchanged: on sm_90, and under the interpreter."""
    return device_capability(x) in (None, (9, 0))


def choose_config(pairs: int, experts: int, fmt: str, native_fp4: bool = False,
                  mma_fits: bool = True, sm90: bool = True) -> TileConfig:
    """The launch configuration for M*k = `pairs` pairs over `experts` experts (see size_class);
    `sm90`: the GPU is sm_90 (or the interpreter runs the kernels), else OFF_SM90_CONFIGS apply; ready
    counts only for READY_COUNTS_FORMATS."""
    name = size_class(pairs, experts, fmt, native_fp4, mma_fits)
    config = DEFAULT_CONFIGS[name] if sm90 else OFF_SM90_CONFIGS.get(name, DEFAULT_CONFIGS[name])
    if config.ready_counts and fmt not in READY_COUNTS_FORMATS:
        config = dataclasses.replace(config, ready_counts=False)
    return config


# The mma path applies a ue8m0 scale as a bf16 factor scale * 2**62 (MMA path comment), finite up to
# scale 2**65: exponent code 127 + 65.
MMA_MAX_UE8M0 = 192


def check_mxfp4_scale_range(**scales: torch.Tensor) -> None:
    """Raise ValueError naming the tensor when an MXFP4 ue8m0 scale tensor (uint8) holds an exponent
    code above MMA_MAX_UE8M0 (scale > 2**65), which the mma path would turn into inf. Meant for load
    time (one reduction per tensor and a host sync), not for the captured step."""
    for name, scale in scales.items():
        if scale.device.type == "meta" or scale.numel() == 0:
            continue
        top = int(scale.view(torch.uint8).max())
        if top > MMA_MAX_UE8M0:
            raise ValueError(f"{name} holds a ue8m0 scale 2**{top - 127} (code {top}); dsv4's MXFP4 mma path "
                             f"accepts scales up to 2**{MMA_MAX_UE8M0 - 127} (code {MMA_MAX_UE8M0})")


FINISH_BLOCK = 256  # hidden columns per `_swiglu_partials_kernel` program


def _row_step(t: torch.Tensor) -> int:
    """Packed codes' row argument of the kernels: their row stride, or, tiled (5-D), their units per row."""
    return t.stride(1) if t.ndim == 3 else t.shape[2] * t.shape[4]


def register_caps(config: TileConfig, interpreted: bool) -> tuple[dict, dict]:
    """The gate/up and down kernels' launch options for config's register caps (Triton's maxnreg);
    none under the interpreter, which has no registers."""
    if interpreted:
        return {}, {}
    return {"maxnreg": config.max_regs or None}, {"maxnreg": config.down_max_regs or None}


def _fit_block_k(block_k: int, hidden: int, inter: int, group: int) -> int:
    """The largest power of two <= block_k dividing both K and I (both are multiples of `group`)."""
    common = min(hidden & -hidden, inter & -inter)
    return max(min(block_k, common), group)


# Widest column tiles the interpreter takes for the default configs (see `interpreter_shape`).
INTERPRETER_MAX_BLOCK_N = 128


def interpreter_shape(config: TileConfig, hidden: int, inter: int) -> TileConfig:
    """`config` as the Triton interpreter runs a default: one program at a time in Python, at a cost
    set by how many tl operations it executes rather than by their width. So an mma config takes
    column tiles as wide as I (gate/up) and K (down), up to INTERPRETER_MAX_BLOCK_N, and no split-K:
    the same kernels and code paths in a fraction of the programs (the CPU tests' tiny models run
    their MoE about 3x faster). Other paths, and configs a caller passes, are not changed."""
    if config.path != "mma":
        return config
    down_n, _ = config.down_shape()

    def widest(block_n: int, columns: int) -> int:  # powers of two: still a multiple of 16 x warps
        return max(block_n, min(triton.next_power_of_2(columns), INTERPRETER_MAX_BLOCK_N))

    return dataclasses.replace(config, block_n=widest(config.block_n, inter),
                               down_block_n=widest(down_n, hidden), k_splits=1)


def _fit_splits(splits: int, length: int, block_k: int) -> int:
    """The largest power of two <= splits dividing length / block_k (each split a whole number of K steps)."""
    steps = length // block_k
    return min(splits, steps & -steps)


def fp4_moe_pairs_triton(
    x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, fmt, w13_global, w2_global, swiglu_limit,
    pair_out: torch.Tensor | None = None, use_dot_scaled: bool | None = None, config: TileConfig | None = None,
) -> torch.Tensor:
    """Launch both kernels. Returns pair_out [M*k, K] f32, rows of skipped pairs left unwritten.

    `pair_out` may be passed pre-poisoned (tests); `use_dot_scaled` overrides the arch choice of
    the dot path for row-major experts (tiled ones never take it); `config` overrides `choose_config`
    (tests force a path, the bench sweeps).
    """
    tokens, hidden = x.shape
    # The kernels read the scales' and globals' last dimension, and the dot path the codes', at unit
    # stride (tiled codes wholly contiguous): other layouts are copied here; the model's are not.
    w2_pointers = (w2.data_ptr(), w2_scale.data_ptr())
    w13, w2, w13_scale, w2_scale = (t.contiguous() for t in (w13, w2, w13_scale, w2_scale))
    w13_global, w2_global = (None if g is None else g.contiguous() for g in (w13_global, w2_global))
    experts, two_inter, _ = logical_shape(w13)
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    tiled = is_tiled(w13)
    pairs = tokens * top_k
    interpreted = not x.is_cuda
    dot_dtype = tl.float32 if (interpreted or x.dtype == torch.float32) else tl.bfloat16
    # tl.dot_scaled takes the row-major packing; tiled words hold their bits swizzled, so tiled experts
    # are launched as on GPUs other than sm_100 (on the H200 a tiled dot_scaled operand rebuilt in
    # registers gave wrong sums: bench/RESULTS.md, twenty-first session).
    native_fp4 = native_fp4_dot(x, fmt) and not tiled
    if use_dot_scaled is None:
        use_dot_scaled = native_fp4
    use_dot_scaled = use_dot_scaled and not tiled
    if config is None:
        config = choose_config(pairs, experts, fmt, native_fp4, mma_fits=hidden % 32 == 0 and inter % 32 == 0,
                               sm90=takes_sm90_configs(x))
        if interpreted:
            config = interpreter_shape(config, hidden, inter)
    group = GROUP[fmt]
    blocks_bound = pairs if config.direct_blocks else block_bound(pairs, experts, config.block_m)
    if config.path == "mma" and blocks_bound > MAX_GRID_Y:  # the default configs take mma up to 3E blocks
        raise ValueError(f"fp4_moe: config {config} would put {blocks_bound} expert blocks on the grid's second "
                         f"axis (at most {MAX_GRID_Y}); use a dot or gemv config for M*k = {pairs} pairs")
    x = x.contiguous()
    pdl = pdl_launch(x, release=True)  # the mma kernels (and the split sums) follow each other
    # the down kernel's ready counts, zeroed by the grouping: where it launches early (PDL; it then also
    # needs weights read in place, known below) and under the interpreter (one grid after another)
    wants_counts = config.ready_counts and (bool(pdl["PDL"]) or interpreted)
    ready = torch.empty(blocks_bound, dtype=torch.int32, device=x.device) if wants_counts else None
    if config.direct_blocks:  # one block a pair: the kernels read the ids and need no table
        order = block_expert = block_start = block_end = topk_ids.reshape(-1).contiguous()
    else:
        order, block_expert, block_start, block_end = expert_blocks(topk_ids, experts, config.block_m, ready)
    if ready is None:
        ready = block_expert  # a stand-in pointer, never read
    # The GEMV path keeps its activations in f32: converting bf16 in the K loop costs two
    # instructions per value per thread, comparable to decoding the weights it meets.
    hidden_dtype = torch.float32 if (dot_dtype == tl.float32 or config.path == "gemv") else x.dtype
    hidden_rows = torch.empty(pairs, inter, dtype=hidden_dtype, device=x.device)
    if pair_out is None:
        pair_out = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    if pairs == 0:
        return pair_out
    block_k = _fit_block_k(config.block_k, hidden, inter, group)
    if config.path == "mma" and block_k < 32:
        raise ValueError(f"fp4_moe: the mma path needs K and I multiples of 32, got K={hidden}, I={inter}")
    # Scales are read as raw bytes; the nvfp4 e4m3 bytes are decoded in the kernel.
    s13, s2 = w13_scale.view(torch.uint8), w2_scale.view(torch.uint8)
    g13 = w13_global if w13_global is not None else s13  # unused pointer for mxfp4
    g2 = w2_global if w2_global is not None else s2
    weights = topk_weights.contiguous()
    common = dict(IS_MX=fmt == "mxfp4", GROUP=group, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
                  TILED=tiled, num_warps=config.num_warps, num_stages=config.num_stages)
    if config.path == "gemv":
        gate_up, down = _gate_up_gemv_kernel, _down_gemv_kernel
        common.update(PREFETCH=config.prefetch)
        x, w13, w2 = word_major(x.float()), _as_words(w13), _as_words(w2)
    elif config.path == "mma":
        gate_up, down = _gate_up_mma_kernel, _down_mma_kernel
        kpack = _mma_kpack(x, config.block_m, config.block_n, config.num_warps)
        common.update(DOT_DTYPE=dot_dtype, NUM_WARPS=config.num_warps, KPACK=kpack, PREFETCH=config.prefetch,
                      COMPILED=not interpreted, SCALE_ASM=config.scale_asm and not interpreted,
                      DIRECT=config.direct_blocks)
        w13, w2 = _as_words(w13), _as_words(w2)
        s13, s2 = _scale_words(s13), _scale_words(s2)
        w2_in_place = (w2.data_ptr(), s2.data_ptr()) == w2_pointers  # no copy (see _down_mma_kernel's EARLY)
        # bf16 activations travel as int32 words of two values (see `_mma_load_act`).
        x_in, x_packed = (x.view(torch.int32), True) if x.dtype == torch.bfloat16 else (x, False)
        h_in, h_packed = ((hidden_rows.view(torch.int32), True) if hidden_rows.dtype == torch.bfloat16
                          else (hidden_rows, False))
        down_n, down_warps = config.down_shape()
        k_splits = _fit_splits(config.k_splits, hidden, block_k)
        # the split gate/up sums (hidden_rows stands in, unused, without a split)
        part = (torch.empty(k_splits, pairs, 2 * inter, dtype=torch.float32, device=x.device) if k_splits > 1
                else hidden_rows)
        gate_up_extra = dict(PACKED=x_packed, K_SPLITS=k_splits, part_ptr=part, stride_ps=part.stride(0),
                             stride_pr=part.stride(1), ready_ptr=ready)
        down_extra = dict(PACKED=h_packed, BLOCK_N=down_n, NUM_WARPS=down_warps, num_warps=down_warps,
                          KPACK=_mma_kpack(x, config.block_m, down_n, down_warps), ready_ptr=ready)
    else:
        gate_up, down = _gate_up_kernel, _down_kernel
        common.update(USE_DOT_SCALED=use_dot_scaled, DOT_DTYPE=dot_dtype)
    if config.path != "mma":
        x_in, h_in, gate_up_extra, down_extra, k_splits = x, hidden_rows, {}, {}, 1
    gate_up_args, down_args = {**common, **gate_up_extra}, {**common, **down_extra}
    gate_up_caps, down_caps = register_caps(config, interpreted)
    gate_up_args.update(gate_up_caps)
    down_args.update(down_caps)
    num_blocks = block_expert.numel()
    # The mma kernels take the column tile as program_id(0): launch order then runs an expert's
    # tiles together and the empty blocks (at the table's end) last, where their programs only fill
    # the final wave's free slots instead of taking slots in every wave.
    def grid(columns: int, args: dict, splits: int = 1) -> tuple[int, ...]:
        tiles = triton.cdiv(columns, args["BLOCK_N"])
        return (tiles, num_blocks, splits) if config.path == "mma" else (num_blocks, tiles)

    limit = float(swiglu_limit) if swiglu_limit is not None else 0.0
    if config.path == "mma":
        early = bool(pdl["PDL"]) and config.prefetch and w2_in_place
        counted = wants_counts and (early if pdl["PDL"] else interpreted)
        gate_up_args.update(pdl, COUNT_READY=counted)
        down_args.update(pdl, EARLY=early, READY=triton.cdiv(inter, gate_up_args["BLOCK_N"]) if counted else 0,
                         RELAXED_SPIN=counted and config.relaxed_spin)
    # K, I, k are constexpr: fixed per model, and loop bounds the interpreter (numpy >= 2.4) accepts.
    gate_up[grid(inter, gate_up_args, k_splits)](
        x_in, order, block_expert, block_start, block_end, w13, s13, g13, hidden_rows,
        experts,
        x_in.stride(0), w13.stride(0), _row_step(w13), s13.stride(0), s13.stride(1), hidden_rows.stride(0),
        limit,
        K=hidden, I=inter, TOP_K=top_k, HAS_LIMIT=swiglu_limit is not None, **gate_up_args,
    )
    if k_splits > 1:
        finish_block = min(FINISH_BLOCK, triton.next_power_of_2(inter))
        _swiglu_partials_kernel[(triton.cdiv(inter, finish_block), num_blocks)](
            part, block_expert, block_start, block_end, hidden_rows,
            experts, part.stride(0), part.stride(1), hidden_rows.stride(0), limit,
            I=inter, SPLITS=k_splits, HAS_LIMIT=swiglu_limit is not None, BLOCK_M=config.block_m,
            BLOCK=finish_block, DIRECT=config.direct_blocks, num_warps=4, **pdl,
        )
    down[grid(hidden, down_args)](
        h_in, order, block_expert, block_start, block_end, weights, w2, s2, g2, pair_out,
        experts,
        h_in.stride(0), w2.stride(0), _row_step(w2), s2.stride(0), s2.stride(1), pair_out.stride(0),
        K=hidden, I=inter, **down_args,
    )
    return pair_out


# ----------------------------------------------------------------------------- registration
@torch.library.custom_op("dsv4::fp4_moe_pairs", mutates_args=())
def fp4_moe_pairs(
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
    """The expert part of fp4_moe: [M*k, K] f32 weighted per-pair outputs (rows of skipped pairs
    are unspecified; `combine_pairs` masks them). Used by the fp4_moe lowering."""
    check_fp4_moe_inputs(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, fmt, w13_global, w2_global,
                         swiglu_limit)
    if triton_runs_on(x):
        return fp4_moe_pairs_triton(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, fmt,
                                    w13_global, w2_global, swiglu_limit)
    tokens, top_k = topk_ids.shape
    out = torch.zeros(tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    for j in range(top_k):  # one choice at a time through the reference keeps the spec in one place
        ids = torch.full_like(topk_ids, -1)
        ids[:, j] = topk_ids[:, j]
        out.view(tokens, top_k, -1)[:, j] = fp4_moe_reference(
            x.float(), ids, topk_weights, w13, w13_scale, w2, w2_scale, fmt, w13_global, w2_global, swiglu_limit
        )
    return out


@fp4_moe_pairs.register_fake
def _(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, fmt, w13_global, w2_global, swiglu_limit):
    return x.new_empty((topk_ids.shape[0] * topk_ids.shape[1], x.shape[1]), dtype=torch.float32)


@torch.library.custom_op("dsv4::fp4_moe", mutates_args=())
def fp4_moe(
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
    """Routed FP4 experts. x [M, K] bf16/f32, topk_ids [M, k] int32 (-1 = skip), topk_weights
    [M, k] f32, packed weights/scales as in the module docstring -> [M, K] in x's dtype.

    Eager calls check every argument, including the id range (a host sync); see check_expert_ids.
    MXFP4 scales must stay at or below 2**65 (ue8m0 code MMA_MAX_UE8M0) where the mma path runs
    (decode and verify sizes, except row-major experts on sm_100); the model's experts are checked
    once when optimize() builds the step (check_mxfp4_scale_range), the op does not check values.
    """
    check_fp4_moe_inputs(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, fmt, w13_global, w2_global,
                         swiglu_limit)
    check_expert_ids(topk_ids, w13.shape[0])
    if not triton_runs_on(x):
        return fp4_moe_reference(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, fmt,
                                 w13_global, w2_global, swiglu_limit)
    pair_out = fp4_moe_pairs_triton(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, fmt,
                                    w13_global, w2_global, swiglu_limit)
    return combine_pairs_triton(pair_out, topk_ids, w13.shape[0], x.dtype)


@fp4_moe.register_fake
def _(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, fmt, w13_global, w2_global, swiglu_limit):
    return torch.empty_like(x)
