"""dsv4::sparse_mla: sparse MQA attention with a per-head sink, for decode and verify (T >= 1).

One KV head (K == V) of head_dim Dh; each query token attends the rows of a main pool (the
sliding window) and optionally of an extra pool (c4 top-k or all c128 entries) chosen by index
lists, with -1 meaning "skip". Rows are bf16/f32, or FP8 rows (e4m3 nope with one ue8m0 exponent
per 64 dims, then the rope dims as bf16 bytes).

The Triton kernel is MQA-shaped: a program owns up to H_BLOCK heads of one query token (the M dim
of both dots), gathers each tile of BLOCK_N selected rows once for all of them and uses the same
gathered rows for QK and PV (K == V); the head blocks of a token run in adjacent programs, so
their gathers after the first hit L2. Each token walks its own index list, so CSA verify tokens
with different top-k lists cost no extra dots; the T tokens of a request run in adjacent programs,
so rows they share come from L2. One tile loop walks the main list, then the extra list, each up
to its last selected position (HCA lists have -1 tails), so both pools share one pipeline fill.
The loop carries the next tile's indices, so Triton's pipeliner gives the gather num_stages - 1
shared-memory buffers; with the index loads in inline asm (idx_asm) its wait keeps num_stages - 2
gathers in flight while a tile is attended. kv_halves splits the head dims in two halves: two
independent QK MMA chains, and the halves share each row's address arithmetic. For small
grids the index positions are split across programs (split-K): each split writes its normalised
partial output and log-sum-exp (`dsv4::sparse_mla_partials`, whose reference is the spec of the
split), and a combine kernel merges them and adds the sink. FP8 rows of more than 16 heads (over
lists of bounded capacity, or in small grids) are first staged (`fp8_rows`: the selected rows dequantised, exactly,
into rows of q's dtype by one gather launch) and the bf16 tile attends the staged rows: faster on
the H200 than the FP8 tile, whose dequantisation in the tile loop costs registers and occupancy
(`stages_fp8_rows`).

Out-of-range indices (idx < 0 or idx >= number of rows of the pool) are treated as skip by both
the kernel and the reference: they are never read, and no host sync is needed to validate them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ._runtime import MAX_GRID_Y, pdl_launch, triton_runs_on, wait_for_producers
from .fp8_rows import SCALE_GROUP, STAGE_ROWS, _load_rows, dequantize_fp8_rows, stage_fp8_rows_launch

LOG2E = 1.4426950408889634
SPLIT_TILE = 32  # index positions per tile; split-K hands each split a run of whole tiles
# Splits the combine kernel merges at a time: [16, 512] f32 partial rows are 64 values a thread on
# 4 warps. All splits at once spilled ~5.8 KB a thread (sm_90 ptxas) at B=1, T=1 on the H200, where
# an HCA layer over max context (8,320 positions) has 66 splits.
COMBINE_SPLITS = 16


# ----------------------------------------------------------------------------- reference


def _pool_logits_and_values(q32, rows, scales, idx, scale):
    """q32 [B,T,H,D] f32, rows of one pool, idx [B,T,K] -> logits [B,T,H,K] f32 (-inf = skip), values."""
    head_dim = q32.shape[-1]
    vals = dequantize_fp8_rows(rows, scales, head_dim) if rows.dtype == torch.uint8 else rows.float()
    ok = (idx >= 0) & (idx < rows.shape[0])
    gathered = vals[torch.where(ok, idx, 0).long()]  # [B, T, K, D]
    logits = torch.einsum("bthd,btkd->bthk", q32, gathered) * scale
    logits = logits.masked_fill(~ok.unsqueeze(2), float("-inf"))
    return logits, gathered


def sparse_mla_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_scale: torch.Tensor | None,
    idx: torch.Tensor,
    extra_kv: torch.Tensor | None,
    extra_kv_scale: torch.Tensor | None,
    extra_idx: torch.Tensor | None,
    sink: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The spec, in f32: out[b,t,h] = softmax(scale * q.k over the selected rows, sink) @ v.

    q [B,T,H,D] bf16/f32; kv [N,D] (q's dtype) or FP8 rows [N, nope+2*rope] uint8 with kv_scale;
    idx [B,T,Kw] int (-1 or out of range = skip); the extra_* the same for a second pool or None;
    sink [H] f32 or None (exp(sink) joins the denominator, adds no value). Returns [B,T,H,D] in
    q's dtype; a token with no selected row (and any sink) gives zeros.
    """
    q32 = q.float()
    logits, values = _pool_logits_and_values(q32, kv, kv_scale, idx, scale)
    if extra_kv is not None:
        e_logits, e_values = _pool_logits_and_values(q32, extra_kv, extra_kv_scale, extra_idx, scale)
        logits = torch.cat([logits, e_logits], dim=-1)
        values = torch.cat([values, e_values], dim=2)
    batch, tokens, heads, _ = q.shape
    if sink is None:
        sink_col = torch.full((batch, tokens, heads, 1), float("-inf"), device=q.device)
    else:
        sink_col = sink.float().view(1, 1, heads, 1).expand(batch, tokens, heads, 1)
    full = torch.cat([logits, sink_col], dim=-1)
    top = full.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(full - top)
    denom = weights.sum(dim=-1, keepdim=True)
    probs = torch.where(denom > 0, weights / denom, torch.zeros_like(weights))[..., :-1]
    return torch.einsum("bthk,btkd->bthd", probs, values).to(q.dtype)


def split_of_positions(num_idx: int, num_extra: int, num_splits: int, device: torch.device) -> torch.Tensor:
    """The split that owns each index position: [num_idx + num_extra] int64, main list first.

    Each pool's positions form tiles of SPLIT_TILE (the main pool's tiles first, then the extra
    pool's); split s owns tiles [s * per, (s + 1) * per) with per = max(1, ceil(tiles / num_splits)),
    so trailing splits may own nothing.
    """
    tiles_main = -(-num_idx // SPLIT_TILE)
    tiles = tiles_main + -(-num_extra // SPLIT_TILE)
    per = max(1, -(-tiles // num_splits))
    main = torch.arange(num_idx, device=device) // SPLIT_TILE
    extra = tiles_main + torch.arange(num_extra, device=device) // SPLIT_TILE
    return torch.cat([main, extra]) // per


def sparse_mla_partials_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_scale: torch.Tensor | None,
    idx: torch.Tensor,
    extra_kv: torch.Tensor | None,
    extra_kv_scale: torch.Tensor | None,
    extra_idx: torch.Tensor | None,
    scale: float,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec of one split-K pass, in f32 (arguments as `sparse_mla_reference`, no sink).

    Returns out [B,T,H,S,D] f32 = softmax(scale * q.k) @ v over the selected rows at the
    positions split s owns (`split_of_positions`), and lse [B,T,H,S] f32 = log(sum exp(scale * q.k))
    over them; a split with no selected row gives zeros and -inf.
    """
    q32 = q.float()
    logits, values = _pool_logits_and_values(q32, kv, kv_scale, idx, scale)
    num_extra = 0
    if extra_kv is not None:
        e_logits, e_values = _pool_logits_and_values(q32, extra_kv, extra_kv_scale, extra_idx, scale)
        logits = torch.cat([logits, e_logits], dim=-1)
        values = torch.cat([values, e_values], dim=2)
        num_extra = extra_idx.shape[2]
    owner = split_of_positions(idx.shape[2], num_extra, num_splits, q.device)
    mine = owner.view(1, -1) == torch.arange(num_splits, device=q.device).view(-1, 1)  # [S, K]
    per_split = logits.unsqueeze(3).masked_fill(~mine, float("-inf"))  # [B, T, H, S, K]
    lse = torch.logsumexp(per_split, dim=-1)
    probs = torch.exp(per_split - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    return torch.einsum("bthsk,btkd->bthsd", probs, values), lse


def combine_partials_reference(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None,
                               dtype: torch.dtype) -> torch.Tensor:
    """The split-K combine: partials out [B,T,H,S,D] f32 and lse [B,T,H,S] f32, sink [H] f32 or
    None -> [B,T,H,D] of `dtype`: sum_s w_s * out_s / (sum_s w_s + exp(sink)), w_s = exp(lse_s),
    computed relative to the largest term; 0 where every term is 0."""
    terms = lse
    if sink is not None:
        terms = torch.cat([lse, sink.float().view(1, 1, -1, 1).expand(*lse.shape[:3], 1)], dim=-1)
    top = terms.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(terms - top)
    denom = weights.sum(dim=-1, keepdim=True)
    weights = torch.where(denom > 0, weights / denom, torch.zeros_like(weights))[..., : lse.shape[-1]]
    return torch.einsum("bths,bthsd->bthd", weights, out).to(dtype)


# ----------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class _Layout:
    """Facts about the inputs that the launcher needs (derived from shapes only)."""

    head_dim: int
    nope: int  # FP8 rows only (else == head_dim)
    fp8: bool
    has_extra: bool


def _check_pool(name: str, rows, scales, idx, q: torch.Tensor) -> tuple[bool, int]:
    """Validates one pool; returns (is_fp8, nope)."""
    batch, tokens, _, head_dim = q.shape
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor of rows, got {getattr(rows, 'shape', rows)}")
    if rows.device != q.device:
        raise ValueError(f"{name}: on {rows.device}, q is on {q.device}")
    sname = f"{name}_scale" if name == "kv" else "extra_kv_scale"
    iname = "idx" if name == "kv" else "extra_idx"
    if rows.dtype == torch.uint8:
        rope = rows.shape[1] - head_dim
        nope = head_dim - rope
        if rope < 0 or nope <= 0 or nope % SCALE_GROUP:
            raise ValueError(
                f"{name}: FP8 rows of {rows.shape[1]} bytes do not fit head_dim {head_dim}: need "
                f"nope + 2*rope bytes with nope + rope = head_dim and nope a positive multiple of 64")
        if rows.stride(1) != 1 or rows.stride(0) % 2 or rows.storage_offset() % 2:
            raise ValueError(f"{name}: FP8 rows need unit column stride, an even row stride and an even byte offset "
                             f"(their rope values are read as bf16), got strides {rows.stride()}, offset "
                             f"{rows.storage_offset()}")
        if (not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 or scales.dim() != 2
                or scales.shape[0] != rows.shape[0] or scales.shape[1] < nope // SCALE_GROUP):
            raise ValueError(
                f"{sname}: FP8 rows need uint8 exponents [{rows.shape[0]}, >= {nope // SCALE_GROUP}], "
                f"got {getattr(scales, 'dtype', None)} {getattr(scales, 'shape', None)}")
        if scales.device != q.device:
            raise ValueError(f"{sname}: on {scales.device}, q is on {q.device}")
        if scales.shape[1] > 1 and scales.stride(1) != 1:
            raise ValueError(f"{sname}: exponents need unit column stride (any row stride), got strides "
                             f"{scales.stride()}")
        fp8 = True
    else:
        if rows.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {rows.dtype} must be uint8 (FP8 rows) or q's dtype {q.dtype}")
        if rows.shape[1] != head_dim:
            raise ValueError(f"{name}: head dim {rows.shape[1]} != q's head dim {head_dim}")
        if scales is not None:
            raise ValueError(f"{sname}: must be None for {rows.dtype} rows")
        fp8, nope = False, head_dim
    if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int32 or idx.dim() != 3:
        raise ValueError(f"{iname}: expected int32 [B, T, K], got {getattr(idx, 'dtype', idx)} "
                         f"{getattr(idx, 'shape', '')}")
    if tuple(idx.shape[:2]) != (batch, tokens):
        raise ValueError(f"{iname}: shape {tuple(idx.shape)} disagrees with q's [B, T] = [{batch}, {tokens}]")
    if idx.device != q.device:
        raise ValueError(f"{iname}: on {idx.device}, q is on {q.device}")
    return fp8, nope


def validate_sparse_mla_inputs(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, sink, scale) -> _Layout:
    """Raises ValueError naming the bad argument; returns the layout. Never syncs with the device."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q: expected [B, T, H, Dh], got {getattr(q, 'shape', q)}")
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"q: dtype {q.dtype} unsupported; use bfloat16 or float32")
    batch, tokens, heads, head_dim = q.shape
    if min(batch, tokens, heads) < 1 or head_dim < 16 or head_dim % 16:
        raise ValueError(f"q: shape {tuple(q.shape)} needs B, T, H >= 1 and Dh a positive multiple of 16")
    fp8, nope = _check_pool("kv", kv, kv_scale, idx, q)
    has_extra = extra_kv is not None or extra_idx is not None or extra_kv_scale is not None
    if has_extra:
        if extra_kv is None or extra_idx is None:
            raise ValueError("extra_kv and extra_idx: give both or neither (extra_kv_scale only with them, for "
                             "FP8 rows)")
        extra_fp8, extra_nope = _check_pool("extra_kv", extra_kv, extra_kv_scale, extra_idx, q)
        if (extra_fp8, extra_nope, extra_kv.dtype) != (fp8, nope, kv.dtype):
            raise ValueError(f"extra_kv: format {extra_kv.dtype} {tuple(extra_kv.shape)} differs from kv's "
                             f"{kv.dtype} {tuple(kv.shape)}; both pools must share one row format")
    if sink is not None:
        if not isinstance(sink, torch.Tensor) or sink.dtype != torch.float32 or tuple(sink.shape) != (heads,):
            raise ValueError(f"sink: expected float32 [{heads}], got {getattr(sink, 'dtype', sink)} "
                             f"{getattr(sink, 'shape', '')}")
        if sink.device != q.device:
            raise ValueError(f"sink: on {sink.device}, q is on {q.device}")
    if not isinstance(scale, (float, int)) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float, got {scale!r}")
    return _Layout(head_dim=head_dim, nope=nope, fp8=fp8, has_extra=has_extra)


# ----------------------------------------------------------------------------- Triton kernels


@triton.jit
def _tile_rows(idx_ptr, stride_ik, start, pos_hi, num_rows, BLOCK_N: tl.constexpr, IDX_ASM: tl.constexpr):
    """Rows [BN] int64 of index positions [start, start + BN) and which of them to read (none past pos_hi).

    IDX_ASM (GPU only): the index load is an inline-asm ld.global.nc, which Triton's pipeliner does
    not turn into a cp.async; as a cp.async it joins the gathers' commit groups and the loop's
    wait then drains every group (num = 0), the next tile's gather included.
    """
    offs_n = start + tl.arange(0, BLOCK_N)
    if IDX_ASM:
        rows = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, -1; @p ld.global.nc.b32 $0, [$1]; }",
            "=r,l,r", [idx_ptr + offs_n * stride_ik, (offs_n < pos_hi).to(tl.int32)], dtype=tl.int32,
            is_pure=True, pack=1)
    else:
        rows = tl.load(idx_ptr + offs_n * stride_ik, mask=offs_n < pos_hi, other=-1)
    ok = (rows >= 0) & (rows < num_rows)  # -1 and out of range: skipped, never read
    return rows.to(tl.int64), ok


@triton.jit
def _attend_rows(q, m_i, l_i, acc, rows, ok, col0,
                 kv_ptr, rope_ptr, scale_ptr, stride_row, stride_col, stride_rope_row, stride_scale_row,
                 qk_scale_log2,
                 HEAD_DIM: tl.constexpr, NOPE: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 KV_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Gathers rows [BN] (lanes not ok: unread) and takes one online-softmax step of the program's heads.

    The gathered rows serve both dots (K == V); with BLOCK_DV < BLOCK_D the PV dot takes only the
    program's value columns, re-read from the same rows (an L1/L2 hit).
    """
    k = _load_rows(kv_ptr, rope_ptr, scale_ptr, rows, ok, 0, stride_row, stride_col, stride_rope_row,
                   stride_scale_row, HEAD_DIM, NOPE, FP8, KV_DTYPE, BLOCK_N, BLOCK_D)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [H_BLOCK, BN]
    s = tl.where(ok[None, :], s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if BLOCK_DV == BLOCK_D:
        v = k
    else:
        v = _load_rows(kv_ptr, rope_ptr, scale_ptr, rows, ok, col0, stride_row, stride_col, stride_rope_row,
                       stride_scale_row, HEAD_DIM, NOPE, FP8, KV_DTYPE, BLOCK_N, BLOCK_DV)
    acc = acc * alpha[:, None] + tl.dot(p.to(KV_DTYPE), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_rows_halves(q0, q1, m_i, l_i, acc0, acc1, rows, ok,
                        kv_ptr, rope_ptr, scale_ptr, stride_row, stride_col, stride_rope_row, stride_scale_row,
                        qk_scale_log2,
                        HEAD_DIM: tl.constexpr, NOPE: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr,
                        HALF: tl.constexpr, KV_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """`_attend_rows` with the head dims in two halves of HALF columns (q0/q1, acc0/acc1, two
    gathers): QK is two independent dot chains of HALF/16 MMAs instead of one of 2 HALF/16."""
    k0 = _load_rows(kv_ptr, rope_ptr, scale_ptr, rows, ok, 0, stride_row, stride_col, stride_rope_row,
                    stride_scale_row, HEAD_DIM, NOPE, FP8, KV_DTYPE, BLOCK_N, HALF)
    k1 = _load_rows(kv_ptr, rope_ptr, scale_ptr, rows, ok, HALF, stride_row, stride_col, stride_rope_row,
                    stride_scale_row, HEAD_DIM, NOPE, FP8, KV_DTYPE, BLOCK_N, HALF)
    # scaled before the sum: Triton folds dot(a, b, 0) + c into dot(a, b, c), one chain again
    s = (tl.dot(q0, tl.trans(k0), input_precision=DOT_PRECISION) * qk_scale_log2
         + tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION) * qk_scale_log2)  # [H_BLOCK, BN]
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(KV_DTYPE)
    acc0 = acc0 * alpha[:, None] + tl.dot(p, k0, input_precision=DOT_PRECISION)
    acc1 = acc1 * alpha[:, None] + tl.dot(p, k1, input_precision=DOT_PRECISION)
    return m_new, l_i, acc0, acc1


@triton.jit
def _attend_step(q0, q1, m_i, l_i, acc0, acc1, rows, ok, col0,
                 kv_ptr, rope_ptr, scale_ptr, stride_row, stride_col, stride_rope_row, stride_scale_row,
                 qk_scale_log2,
                 HEAD_DIM: tl.constexpr, NOPE: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, KV_HALVES: tl.constexpr,
                 KV_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One tile: `_attend_rows_halves` when KV_HALVES, else `_attend_rows` on (q0, acc0) (q1, acc1 unused)."""
    if KV_HALVES:
        m_i, l_i, acc0, acc1 = _attend_rows_halves(
            q0, q1, m_i, l_i, acc0, acc1, rows, ok, kv_ptr, rope_ptr, scale_ptr, stride_row, stride_col,
            stride_rope_row, stride_scale_row, qk_scale_log2, HEAD_DIM, NOPE, FP8, BLOCK_N, BLOCK_D // 2,
            KV_DTYPE, DOT_PRECISION)
    else:
        m_i, l_i, acc0 = _attend_rows(
            q0, m_i, l_i, acc0, rows, ok, col0,
            kv_ptr, rope_ptr, scale_ptr, stride_row, stride_col, stride_rope_row, stride_scale_row,
            qk_scale_log2, HEAD_DIM, NOPE, FP8, BLOCK_N, BLOCK_D, BLOCK_DV, KV_DTYPE, DOT_PRECISION)
    return m_i, l_i, acc0, acc1


@triton.jit
def _selected_end(idx_ptr, stride_ik, num_idx, num_rows, BLOCK_K: tl.constexpr):
    """1 + the last index position of a list that selects a row (0 when none does): the tile loop
    stops there, so long -1 tails (HCA lists) cost one vector load, not tiles."""
    offs_k = tl.arange(0, BLOCK_K)
    all_idx = tl.load(idx_ptr + offs_k * stride_ik, mask=offs_k < num_idx, other=-1)
    return tl.max(tl.where((all_idx >= 0) & (all_idx < num_rows), offs_k, -1), axis=0) + 1


@triton.jit
def _tile_of(i, n_main, m_lo, m_hi, e_lo, e_hi, idx_ptr, stride_ik, num_rows, eidx_ptr, e_stride_ik,
             e_num_rows, BLOCK_N: tl.constexpr, IDX_ASM: tl.constexpr):
    """Tile i of the walk (n_main tiles of the main list's [m_lo, m_hi), then the extra list's
    [e_lo, e_hi)) -> (rows [BN] int64, ok [BN], whether the rows are the extra pool's)."""
    in_extra = i >= n_main
    start = tl.where(in_extra, e_lo + (i - n_main) * BLOCK_N, m_lo + i * BLOCK_N)
    rows, ok = _tile_rows(tl.where(in_extra, eidx_ptr, idx_ptr), tl.where(in_extra, e_stride_ik, stride_ik),
                          start, tl.where(in_extra, e_hi, m_hi), tl.where(in_extra, e_num_rows, num_rows),
                          BLOCK_N, IDX_ASM)
    return rows, ok, in_extra


@triton.jit
def _attend_tile(q0, q1, m_i, l_i, acc0, acc1, rows, ok, in_extra, col0,
                 kv_ptr, rope_ptr, scale_ptr, stride_row, stride_col, stride_rope_row, stride_scale_row,
                 ekv_ptr, erope_ptr, escale_ptr, e_stride_row, e_stride_col, e_stride_rope_row, e_stride_scale_row,
                 qk_scale_log2,
                 HEAD_DIM: tl.constexpr, NOPE: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, KV_HALVES: tl.constexpr,
                 KV_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """`_attend_step` on the rows of the extra pool (in_extra) or of the main pool."""
    return _attend_step(
        q0, q1, m_i, l_i, acc0, acc1, rows, ok, col0,
        tl.where(in_extra, ekv_ptr, kv_ptr), tl.where(in_extra, erope_ptr, rope_ptr),
        tl.where(in_extra, escale_ptr, scale_ptr), tl.where(in_extra, e_stride_row, stride_row),
        tl.where(in_extra, e_stride_col, stride_col), tl.where(in_extra, e_stride_rope_row, stride_rope_row),
        tl.where(in_extra, e_stride_scale_row, stride_scale_row),
        qk_scale_log2, HEAD_DIM, NOPE, FP8, BLOCK_N, BLOCK_D, BLOCK_DV, KV_HALVES, KV_DTYPE, DOT_PRECISION)


@triton.jit
def _attend_pools(q0, q1, m_i, l_i, acc0, acc1, m_lo, m_hi, e_lo, e_hi, col0,
                  kv_ptr, rope_ptr, scale_ptr, stride_row, stride_col, stride_rope_row, stride_scale_row,
                  idx_ptr, stride_ik, num_rows,
                  ekv_ptr, erope_ptr, escale_ptr, e_stride_row, e_stride_col, e_stride_rope_row, e_stride_scale_row,
                  eidx_ptr, e_stride_ik, e_num_rows, qk_scale_log2,
                  HEAD_DIM: tl.constexpr, NOPE: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  KV_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
                  NUM_STAGES: tl.constexpr, IDX_ASM: tl.constexpr, KV_HALVES: tl.constexpr):
    """Online softmax over index positions [m_lo, m_hi) of the main list, then [e_lo, e_hi) of the
    extra list, in one tile loop (one pipeline fill for both pools); empty ranges take no tile.

    Inside a tile, lanes with -1 are masked and cost no memory traffic. KV_HALVES: q0/acc0 and
    q1/acc1 are the two column halves (`_attend_rows_halves`), else q0/acc0 are all of them and
    q1/acc1 pass through.
    """
    n_main = tl.cdiv(tl.maximum(m_hi - m_lo, 0), BLOCK_N)
    n_tiles = n_main + tl.cdiv(tl.maximum(e_hi - e_lo, 0), BLOCK_N)
    # The next tile's rows travel in the loop state, so the gather's addresses do not come from a
    # load in the same iteration: Triton's pipeliner then multi-buffers the gather (num_stages - 1
    # buffers); loading the indices in the iteration that gathers keeps a single buffer. The
    # gathers stay in flight across the loop's wait only with IDX_ASM (see `_tile_rows`).
    ASM_IDX: tl.constexpr = IDX_ASM and not INTERPRETED  # the interpreter runs no inline asm
    rows, ok, in_extra = _tile_of(0, n_main, m_lo, m_hi, e_lo, e_hi, idx_ptr, stride_ik, num_rows, eidx_ptr,
                                  e_stride_ik, e_num_rows, BLOCK_N, ASM_IDX)
    if INTERPRETED:  # the interpreter (numpy >= 2.4) cannot take range() bounds from its scalars
        i = 0
        while i < n_tiles:
            m_i, l_i, acc0, acc1 = _attend_tile(
                q0, q1, m_i, l_i, acc0, acc1, rows, ok, in_extra, col0,
                kv_ptr, rope_ptr, scale_ptr, stride_row, stride_col, stride_rope_row, stride_scale_row,
                ekv_ptr, erope_ptr, escale_ptr, e_stride_row, e_stride_col, e_stride_rope_row, e_stride_scale_row,
                qk_scale_log2, HEAD_DIM, NOPE, FP8, BLOCK_N, BLOCK_D, BLOCK_DV, KV_HALVES, KV_DTYPE,
                DOT_PRECISION)
            rows, ok, in_extra = _tile_of(i + 1, n_main, m_lo, m_hi, e_lo, e_hi, idx_ptr, stride_ik, num_rows,
                                          eidx_ptr, e_stride_ik, e_num_rows, BLOCK_N, ASM_IDX)
            i += 1
    else:
        for i in tl.range(0, n_tiles, num_stages=NUM_STAGES):
            m_i, l_i, acc0, acc1 = _attend_tile(
                q0, q1, m_i, l_i, acc0, acc1, rows, ok, in_extra, col0,
                kv_ptr, rope_ptr, scale_ptr, stride_row, stride_col, stride_rope_row, stride_scale_row,
                ekv_ptr, erope_ptr, escale_ptr, e_stride_row, e_stride_col, e_stride_rope_row, e_stride_scale_row,
                qk_scale_log2, HEAD_DIM, NOPE, FP8, BLOCK_N, BLOCK_D, BLOCK_DV, KV_HALVES, KV_DTYPE,
                DOT_PRECISION)
            rows, ok, in_extra = _tile_of(i + 1, n_main, m_lo, m_hi, e_lo, e_hi, idx_ptr, stride_ik, num_rows,
                                          eidx_ptr, e_stride_ik, e_num_rows, BLOCK_N, ASM_IDX)
    return m_i, l_i, acc0, acc1


@triton.jit
def _sparse_mla_fwd(
    q_ptr, stride_qb, stride_qt, stride_qh, stride_qd,
    kv_ptr, rope_ptr, scale_ptr, stride_row, stride_col, stride_rope_row, stride_scale_row, num_rows,
    idx_ptr, stride_ib, stride_it, stride_ik, num_idx,
    ekv_ptr, erope_ptr, escale_ptr, e_stride_row, e_stride_col, e_stride_rope_row, e_stride_scale_row,
    e_num_rows, eidx_ptr, e_stride_ib, e_stride_it, e_stride_ik, e_num_idx,
    sink_ptr, out_ptr, part_lse_ptr, part_out_ptr,
    T, H, num_hblocks, num_splits, tiles_per_split, qk_scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, NOPE: tl.constexpr,
    FP8: tl.constexpr, H_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_TILE: tl.constexpr,
    HAS_EXTRA: tl.constexpr, HAS_SINK: tl.constexpr, SPLIT: tl.constexpr,
    KV_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr, E_BLOCK_K: tl.constexpr,
    INTERPRETED: tl.constexpr, NUM_STAGES: tl.constexpr, IDX_ASM: tl.constexpr, KV_HALVES: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: H_BLOCK heads x BLOCK_DV value columns of one query token, over one split.

    The heads share every gathered row (MQA); QK always spans all BLOCK_D dims. Writes the
    normalised output (SPLIT false) or the split's normalised partial output [B,T,H,S,Dh] f32
    and its log-sum-exp [B,T,H,S] f32 (SPLIT true; a combine finishes).
    """
    wait_for_producers(PDL)
    NUM_DV: tl.constexpr = BLOCK_D // BLOCK_DV
    pid = tl.program_id(0)
    split = tl.program_id(1)
    dvb = pid % NUM_DV  # the value-column blocks of one head block run next to each other (L2 reuse)
    rest = pid // NUM_DV
    hb = rest % num_hblocks
    bt = (rest // num_hblocks).to(tl.int64)
    b = bt // T
    t = bt % T
    head = hb * H_BLOCK + tl.arange(0, H_BLOCK)
    head_ok = head < H
    col0 = dvb * BLOCK_DV
    offs_dv = col0 + tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM

    # KV_HALVES (BLOCK_DV == BLOCK_D): q and the accumulator in two column halves (_attend_rows_halves)
    Q_COLS: tl.constexpr = BLOCK_D // 2 if KV_HALVES else BLOCK_D
    q_rows = q_ptr + b * stride_qb + t * stride_qt + head[:, None] * stride_qh
    offs_q = tl.arange(0, Q_COLS)
    q0 = tl.load(q_rows + offs_q[None, :] * stride_qd, mask=head_ok[:, None] & (offs_q < HEAD_DIM)[None, :],
                 other=0.0).to(KV_DTYPE)
    q1 = q0
    acc1 = tl.zeros([H_BLOCK, 1], tl.float32)
    if KV_HALVES:
        q1 = tl.load(q_rows + (Q_COLS + offs_q)[None, :] * stride_qd,
                     mask=head_ok[:, None] & (Q_COLS + offs_q < HEAD_DIM)[None, :], other=0.0).to(KV_DTYPE)
        acc1 = tl.zeros([H_BLOCK, Q_COLS], tl.float32)
    m_i = tl.full([H_BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([H_BLOCK], tl.float32)
    acc = tl.zeros([H_BLOCK, BLOCK_DV // 2 if KV_HALVES else BLOCK_DV], tl.float32)

    # split s owns whole SPLIT_TILE tiles [lo, hi) of the main list's tiles followed by the extra's
    tiles_main = tl.cdiv(num_idx, SPLIT_TILE)
    tiles_all = tiles_main
    if HAS_EXTRA:
        tiles_all += tl.cdiv(e_num_idx, SPLIT_TILE)
    lo = split * tiles_per_split
    hi = tl.minimum(lo + tiles_per_split, tiles_all)
    idx_row = idx_ptr + b * stride_ib + t * stride_it
    eidx_row = eidx_ptr + b * e_stride_ib + t * e_stride_it
    # Both lists' ends are found before either is walked, so the two scans' loads overlap.
    m_hi = tl.minimum(tl.minimum(tl.minimum(hi, tiles_main) * SPLIT_TILE, num_idx),
                      _selected_end(idx_row, stride_ik, num_idx, num_rows, BLOCK_K))
    e_lo = 0
    e_hi = 0
    if HAS_EXTRA:
        e_lo = tl.maximum(lo - tiles_main, 0) * SPLIT_TILE
        e_hi = tl.minimum(tl.minimum((hi - tiles_main) * SPLIT_TILE, e_num_idx),
                          _selected_end(eidx_row, e_stride_ik, e_num_idx, e_num_rows, E_BLOCK_K))
    m_i, l_i, acc, acc1 = _attend_pools(
        q0, q1, m_i, l_i, acc, acc1, lo * SPLIT_TILE, m_hi, e_lo, e_hi, col0,
        kv_ptr, rope_ptr, scale_ptr, stride_row, stride_col, stride_rope_row, stride_scale_row,
        idx_row, stride_ik, num_rows,
        ekv_ptr, erope_ptr, escale_ptr, e_stride_row, e_stride_col, e_stride_rope_row, e_stride_scale_row,
        eidx_row, e_stride_ik, e_num_rows, qk_scale_log2,
        HEAD_DIM, NOPE, FP8, BLOCK_N, BLOCK_D, BLOCK_DV, KV_DTYPE, DOT_PRECISION, INTERPRETED, NUM_STAGES,
        IDX_ASM, KV_HALVES)

    bth = bt * H + head  # flat (b, t, h) of each row
    if SPLIT:
        part = bth * num_splits + split
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=head_ok & (dvb == 0))  # every dvb has the same lse
        if KV_HALVES:
            offs_h = tl.arange(0, BLOCK_D // 2)
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_h[None, :], acc / l_safe[:, None],
                     mask=head_ok[:, None] & (offs_h < HEAD_DIM)[None, :])
            offs_h += BLOCK_D // 2
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_h[None, :], acc1 / l_safe[:, None],
                     mask=head_ok[:, None] & (offs_h < HEAD_DIM)[None, :])
        else:
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_dv[None, :], acc / l_safe[:, None],
                     mask=head_ok[:, None] & dv_ok[None, :])
    else:
        if HAS_SINK:
            sink = tl.load(sink_ptr + head, mask=head_ok, other=float("-inf")) * 1.4426950408889634
            m_all = tl.maximum(m_i, sink)
            m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
            acc_w = tl.exp2(m_i - m_all)
            denom = l_i * acc_w + tl.exp2(sink - m_all)
        else:
            acc_w = tl.full([H_BLOCK], 1.0, tl.float32)
            denom = l_i
        factor = tl.where(denom > 0, acc_w / tl.where(denom > 0, denom, 1.0), 0.0)
        if KV_HALVES:
            offs_h = tl.arange(0, BLOCK_D // 2)
            tl.store(out_ptr + bth[:, None] * HEAD_DIM + offs_h[None, :],
                     (acc * factor[:, None]).to(out_ptr.dtype.element_ty),
                     mask=head_ok[:, None] & (offs_h < HEAD_DIM)[None, :])
            offs_h += BLOCK_D // 2
            tl.store(out_ptr + bth[:, None] * HEAD_DIM + offs_h[None, :],
                     (acc1 * factor[:, None]).to(out_ptr.dtype.element_ty),
                     mask=head_ok[:, None] & (offs_h < HEAD_DIM)[None, :])
        else:
            out = acc * factor[:, None]
            tl.store(out_ptr + bth[:, None] * HEAD_DIM + offs_dv[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=head_ok[:, None] & dv_ok[None, :])


@triton.jit
def _sparse_mla_combine(part_lse_ptr, part_out_ptr, sink_ptr, out_ptr, H, num_splits,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                        HAS_SINK: tl.constexpr, PDL: tl.constexpr):
    """One program per (b, t, h): merges the split partials (`combine_partials_reference`),
    BLOCK_S splits at a time; the partial rows of splits with lse = -inf (no selected row) are
    never read, so a long index list with few valid positions costs what its valid splits do."""
    wait_for_producers(PDL)
    bth = tl.program_id(0).to(tl.int64)
    lse_row = part_lse_ptr + bth * num_splits
    m_all = -float("inf")
    if HAS_SINK:
        sink = tl.load(sink_ptr + bth % H) * 1.4426950408889634
        m_all = sink
    s0 = 0
    while s0 < num_splits:  # while loops: the interpreter cannot range() over its scalar arguments
        offs_s = s0 + tl.arange(0, BLOCK_S)
        lse_s = tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        m_all = tl.maximum(m_all, tl.max(lse_s * 1.4426950408889634, axis=0))
        s0 += BLOCK_S
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    denom = 0.0
    if HAS_SINK:
        denom = tl.exp2(sink - m_all)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    out = tl.zeros((BLOCK_D,), dtype=tl.float32)
    s0 = 0
    while s0 < num_splits:
        offs_s = s0 + tl.arange(0, BLOCK_S)
        lse_s = tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        w_s = tl.exp2(lse_s * 1.4426950408889634 - m_all)
        denom += tl.sum(w_s, axis=0)
        rows = part_out_ptr + (bth * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
        acc_s = tl.load(rows, mask=(w_s > 0)[:, None] & d_ok[None, :], other=0.0)
        out += tl.sum(acc_s * w_s[:, None], axis=0)
        s0 += BLOCK_S
    out = tl.where(denom > 0, out / tl.where(denom > 0, denom, 1.0), 0.0)
    tl.store(out_ptr + bth * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


# ----------------------------------------------------------------------------- launcher


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and grid of one launch; a function of shapes and device only (capture-safe).

    A program covers h_block heads x block_dv value columns of one query token (block_dv = 0
    means all of them); block_n index positions per tile; idx_asm: the tile
    loop's index loads are inline asm, out of the pipeliner's reach, so that its waits keep
    num_stages - 2 gathers in flight (see `_tile_rows`; 2 stages keep none either way); kv_halves:
    the head dims in two column halves, two independent QK dot chains (all value columns only);
    stage_fp8: FP8 rows are first staged into rows of q's dtype (`fp8_rows`), which this tile then
    attends.
    """

    h_block: int
    block_dv: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    idx_asm: bool = False
    kv_halves: bool = False
    stage_fp8: bool = False


_SM_PROPS: dict[int, tuple[int, int]] = {}


def _sm_props(device: torch.device) -> tuple[int, int]:
    """(SM count, shared memory bytes per SM) of a CUDA device, read once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_PROPS:
        props = torch.cuda.get_device_properties(index)
        _SM_PROPS[index] = (props.multi_processor_count, props.shared_memory_per_multiprocessor)
    return _SM_PROPS[index]


def _sm_count(device: torch.device) -> int:
    """The SM count of a CUDA device; 4 on CPU (the interpreter), so that CPU tests exercise split-K."""
    return _sm_props(device)[0] if device.type == "cuda" else 4


def _shared_per_sm(device: torch.device) -> int:
    """Shared memory bytes per SM of a CUDA device (H200 233,472, sm_120 102,400); 0 on CPU."""
    return _sm_props(device)[1] if device.type == "cuda" else 0


def split_count(programs: int, num_idx_total: int, device: torch.device, num_splits: int | None = None,
                max_splits: int | None = None) -> int:
    """Splits of the index positions for a grid of `programs` (None: as many as keep the grid within
    two programs per SM, at most max_splits), capped at the SPLIT_TILE tiles of num_idx_total
    positions. Within, not past: a grid a little over that wave leaves most SMs idle in its tail
    (H200, paired: see pick_config)."""
    num_tiles = max(1, triton.cdiv(num_idx_total, SPLIT_TILE))
    if num_splits is None:
        sms = _sm_count(device)
        num_splits = 1 if programs >= sms else min((2 * sms) // programs, triton.cdiv(num_tiles, 2))
        num_splits = min(num_splits, max_splits or num_splits)
    return max(1, min(num_splits, num_tiles))


# pick_config's tiles per row format: (h_block, block_dv (0: all columns), block_n, num_warps,
# num_stages, max_splits (0: the split-K heuristic uncapped), idx_asm, kv_halves), as in
# the bench's SWEEP_CONFIGS.
DEFAULT_TILES = {
    "bf16": (16, 0, 64, 4, 2, 0, True, True),
    # bf16 rows on grids of more than one wave at 16 heads (about two programs an SM): 32 heads a
    # program halve the programs and each gathered row serves twice the heads (64-row tiles would
    # take 102,400 B of shared memory, over sm_120's 101,376).
    "bf16_wide": (32, 0, 32, 4, 2, 0, True, True),
    "fp8": (16, 0, 32, 8, 1, 0, False, True),
    # FP8 rows on grids of at least a tenth of the SMs at 16 heads, more than 16 heads: 32 heads a
    # program (98,304 B of shared memory, 240-245 registers on sm_90 and sm_120, no spills).
    "fp8_wide": (32, 0, 32, 8, 1, 0, False, True),
}
# FP8 tiles run on PAIRED_WARPS instead where their grid holds more programs than the GPU has SMs
# and an SM's shared memory holds two of them (the H200's, not sm_120's): at 255 registers (a few
# to 44 spilled) two programs then share an SM. FP8_TILE_SHARED: their shared memory by heads a
# program at head dim 512 (less below it; either warp count; sm_90 and sm_120 alike, a CPU test
# checks it); BLOCK_RESERVED_SHARED: what the hardware reserves per block (sm_80 and later).
PAIRED_WARPS = 4
FP8_TILE_SHARED = {16: 81_920, 32: 98_304}
BLOCK_RESERVED_SHARED = 1_024
# FP8 rows are staged (dequantised into rows of q's dtype by one gather launch, then attended by the
# bf16 tile) when a token has more than STAGE_MIN_HEADS heads, and its index lists (both pools) hold
# at most STAGE_MAX_POSITIONS positions or the grid at most STAGE_LONG_MAX_TOKENS tokens; requests
# are staged in chunks of at most STAGE_MAX_BYTES of staged rows (a transient workspace sized by the
# lists' capacity, not their valid entries). Staging also needs one request's rows to fit there and
# a token's blocks of STAGE_ROWS positions to fit the staging grid's second axis (MAX_GRID_Y).
STAGE_MIN_HEADS = 16
STAGE_MAX_POSITIONS = 4096
STAGE_LONG_MAX_TOKENS = 32
STAGE_MAX_BYTES = 256 << 20


def stages_fp8_rows(batch: int, tokens: int, heads: int, head_dim: int, num_idx_total: int,
                    value_bytes: int = 2) -> bool:
    """Whether FP8 rows are staged before attention (see STAGE_MIN_HEADS); value_bytes: q's element size.

    H200, paired against the FP8 tile ("Twenty-sixth session", us; one staging launch of 4-position
    programs for both pools): H=64 CSA B=64 T=1 62.2 against 88.9, T=4 207.7 against 283.0, HCA at
    128K T=1 102.9 against 145.6, T=4 (two chunks) 348.7 against 485.4, B=1 to 16 -1.5 to -9.6;
    FlashMLA's config (B=128, h=128, s_q=2, top-k 2048; two chunks) 1,024 against 1,726; H=20 to
    48 -1.2 to -3.6; but H=16 B=64 +8.6 (B=1 -2.0). Staging walks the lists' whole capacity: over
    HCA lists of max context 1M (8,320 positions, 1,152 selected) it won up to 32 tokens (B=1 to 32
    T=1 -5.1 to -95.7, B=4 and 8 T=4 -76.2 and -8.1) and lost from 64 (B=64 T=1 +87.5, B=16 T=4
    +114.5).
    """
    blocks = triton.cdiv(num_idx_total, STAGE_ROWS) + 1  # two lists: at most one more partial block
    return (heads > STAGE_MIN_HEADS and blocks <= MAX_GRID_Y
            and _staged_bytes_per_request(tokens, num_idx_total, head_dim, value_bytes) <= STAGE_MAX_BYTES
            and (num_idx_total <= STAGE_MAX_POSITIONS or batch * tokens <= STAGE_LONG_MAX_TOKENS))


def pick_config(batch: int, tokens: int, heads: int, head_dim: int, num_idx_total: int,
                device: torch.device, num_splits: int | None = None, fp8_rows: bool = False,
                allow_staging: bool = True, value_bytes: int = 2) -> LaunchConfig:
    """The launch config for these shapes: DEFAULT_TILES of the row format (16 heads of one token a
    program, all value columns; "bf16_wide" for bf16 rows on grids wider than one wave, "fp8_wide"
    for FP8 rows on grids of at least a tenth of the SMs' count with more than 16 heads; FP8 tiles
    on PAIRED_WARPS where two share an SM, see FP8_TILE_SHARED). FP8 rows that `stages_fp8_rows`
    (unless not allow_staging) take the bf16 tile of one staging chunk's requests, stage_fp8 set;
    value_bytes: q's element size (the staged rows').

    H200, B=64, H=64, Dh 512, bf16 rows, one tile loop over both pools (bench/RESULTS.md
    "Seventeenth session"): BLOCK_N 64 on 2 stages against the sixth session's 32 on 3, CSA at
    128K: 41.1 against 47.1 us at T=1, 145.3 against 182.3 at T=4; at T=4 (four waves at 16 heads)
    32 heads a program on 32-row tiles: 128.0 (2 stages, 67,584 B), 127.4 (3 stages, 100,352 B);
    at T=1, where 16 heads fill one wave, 32 heads lost (41.8). Earlier sweeps ("Fifth session",
    "Sixth session"): index loads outside the pipeliner (idx_asm) and two 256-column halves (kv_halves, two
    shorter QK chains) won; 8 warps, 64 heads in one program (wgmma) and BLOCK_N 16 lost. FP8 rows:
    8 warps, 1 stage (81,920 B), kv_halves: 155.7 / 567.2 us (186.5 / 697.3 without; at 2
    stages the tile outgrows sm_120's shared memory: 131,072 B, and at 4 warps it spills too).
    32 heads on FP8 rows (98,304 B at 1 stage, no spills), paired against 16 ("Twenty-third
    session", us): CSA B=64 T=1 111.7 against 146.3, T=4 368.7 against 580.3, HCA at 128K B=64
    T=1 184.8 against 266.0, CSA B=16 T=2 71.1 against 81.5 (128 programs at 16 heads); lost at
    B=1 (16.7 against 13.5: 4 programs) and with H=16 (68.2 against 55.5). Grids of 8 to 128
    programs at 16 heads, each tile with its own split count ("Twenty-fourth session"): 32 heads
    lost at 8 (+3.0 us), tied at 32, won at 16, 48 and 64 to 128 (-5.7 to -36.8 us). FP8 tiles on
    4 warps (two an SM), paired against 8 on the H200 ("Twenty-fifth session", us): 32 heads CSA
    B=64 T=4 283.3 against 369.7, T=2 144.9 against 188.7, HCA at 128K B=64 T=4 483.0 against
    647.7, B=32 T=4 142.1 against 185.4, B=4 T=4 and B=16 T=1 -5.2, other grids of 256-512 split
    programs -2.5 to -3.0, tied at B=64 T=1 (+0.2, 3 splits then); 16 heads (H=16) B=64 T=1 34.8
    against 45.8, T=4 115.8 against 156.4, HCA T=4 194.9 against 270.7, B=16 T=1 (160 programs)
    -5.2; but +0.5 to +0.8 on grids of 40 to 120 programs (B=1 to 3 at H=64, B=8 at H=16), where
    an SM holds one program either way and 8 warps give it more. Small grids split the index
    positions (split-K) as far as one wave of two programs an SM holds (`split_count`:
    the floor of twice the SMs over the programs; it was the ceiling). Paired on the H200 (us;
    "Twenty-fifth session"), where the two differ: FP8 rows (4-warp tile) CSA B=64 T=1 88.5
    against 113.2, HCA B=64 145 against 185, B=48 84.8 against 97.9, B=32 49.7 against 69.6, B=16
    T=2 48.9 against 68.6, B=8 T=4 47.9 against 67.4, HCA B=16 49.4 against 65.7, B=16 and B=24
    -1.1 to -1.2; bf16 rows CSA B=32 T=1 26.0 against 35.3, HCA 41.1 against 52.8, CSA and HCA
    B=16 and CSA B=8 T=2 -4.3 to -4.5; where they agree, equal.
    """
    if fp8_rows and allow_staging and stages_fp8_rows(batch, tokens, heads, head_dim, num_idx_total, value_bytes):
        chunk = stage_chunk(batch, tokens, num_idx_total, head_dim, value_bytes)
        return replace(pick_config(chunk, tokens, heads, head_dim, num_idx_total, device, num_splits),
                       stage_fp8=True)
    key = "fp8" if fp8_rows else "bf16"
    programs16 = batch * tokens * triton.cdiv(heads, DEFAULT_TILES[key][0])
    if key == "bf16" and programs16 > 2 * _sm_count(device):
        key = "bf16_wide"
    elif key == "fp8" and heads > DEFAULT_TILES[key][0] and 10 * programs16 >= _sm_count(device):
        key = "fp8_wide"
    h_block, block_dv, block_n, num_warps, num_stages, max_splits, idx_asm, kv_halves = DEFAULT_TILES[key]
    block_d = triton.next_power_of_2(head_dim)
    block_dv = min(block_dv or block_d, block_d)
    # Halves of at least 32 columns (a tl.dot reduction of 16 or more per MMA k-step pair), and
    # whole 64-dim scale groups for FP8 rows.
    kv_halves = kv_halves and block_dv == block_d and block_d >= 64 and not (fp8_rows and block_d % (2 * SCALE_GROUP))
    programs = batch * tokens * triton.cdiv(heads, h_block) * (block_d // block_dv)
    num_splits = split_count(programs, num_idx_total, device, num_splits, max_splits or None)
    if (fp8_rows and programs * num_splits > _sm_count(device)
            and _shared_per_sm(device) >= 2 * (FP8_TILE_SHARED[h_block] + BLOCK_RESERVED_SHARED)):
        num_warps = PAIRED_WARPS
    return LaunchConfig(h_block, block_dv, block_n, num_splits, num_warps, num_stages, idx_asm, kv_halves)


def _pool_args(rows: torch.Tensor, scales: torch.Tensor | None, layout: _Layout):
    """(values ptr, rope ptr, scale ptr, row stride, col stride, rope row stride, scale row stride, N)."""
    if layout.fp8:
        e4m3 = rows.view(torch.float8_e4m3fn)
        rope = rows.view(torch.bfloat16)[:, layout.nope // 2:]
        return (e4m3, rope, scales, rows.stride(0), 1, rope.stride(0), scales.stride(0), rows.shape[0])
    return (rows, rows, rows, rows.stride(0), rows.stride(1), 0, 0, rows.shape[0])


@dataclass
class KernelLaunch:
    """One kernel launch: the jit function, its grid, positional args and constexpr/launch kwargs."""

    kernel: object
    grid: tuple
    args: tuple
    meta: dict


def combine_launch(part_lse: torch.Tensor, part_out: torch.Tensor, sink: torch.Tensor | None,
                   out: torch.Tensor) -> KernelLaunch:
    """The combine kernel's launch for partials out [B,T,H,S,D] f32 and lse [B,T,H,S] f32 (both
    contiguous), sink [H] f32 or None, into out [B,T,H,D] (contiguous)."""
    batch, tokens, heads, splits, head_dim = part_out.shape
    return KernelLaunch(
        _sparse_mla_combine,
        (batch * tokens * heads,),
        (part_lse, part_out, sink if sink is not None else part_lse, out, heads, splits),
        dict(HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
             BLOCK_S=min(triton.next_power_of_2(splits), COMBINE_SPLITS), HAS_SINK=sink is not None,
             num_warps=4, **pdl_launch(out, release=False)),
    )


def plan_sparse_mla(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, sink, scale,
                    out: torch.Tensor | None, num_splits: int | None = None,
                    config: LaunchConfig | None = None,
                    partials: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[KernelLaunch]:
    """The launches (forward, then combine when split) that compute `out`; allocates split workspaces.

    config overrides `pick_config` (for tuning). partials = (out [B,T,H,S,Dh], lse [B,T,H,S]) f32
    contiguous: only the forward, writing the S splits of `split_of_positions` there (out unused).
    """
    layout = _layout_of(q, kv, extra_kv)
    batch, tokens, heads, head_dim = q.shape
    if sink is not None:
        sink = sink.contiguous()  # the kernels read sink[h] at h (any stride is accepted)
    num_extra = extra_idx.shape[2] if layout.has_extra else 0
    cfg = config or pick_config(batch, tokens, heads, head_dim, idx.shape[2] + num_extra, q.device, num_splits,
                                layout.fp8, value_bytes=q.element_size())
    if layout.fp8 and cfg.stage_fp8:
        return _staged_plan(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, sink, scale, out,
                            replace(cfg, stage_fp8=False), partials, layout)
    if partials is not None:  # exactly the caller's S (pick_config caps S at the tile count)
        if out is not None:
            raise ValueError("plan_sparse_mla: give out or partials, not both")
        cfg = replace(cfg, num_splits=partials[1].shape[3])
    block_d = triton.next_power_of_2(head_dim)
    block_dv = cfg.block_dv or block_d
    if block_d % block_dv or (layout.fp8 and block_dv % SCALE_GROUP):
        raise ValueError(f"config.block_dv: {cfg.block_dv} must divide {block_d} (and be a multiple of 64 "
                         f"for FP8 rows)")
    if cfg.kv_halves and (block_dv != block_d or (layout.fp8 and block_d % (2 * SCALE_GROUP))):
        raise ValueError(f"config.kv_halves: needs all value columns (block_dv {cfg.block_dv}) and, for FP8 "
                         f"rows, halves of whole 64-dim groups (block_d {block_d})")
    num_tiles = triton.cdiv(idx.shape[2], SPLIT_TILE) + triton.cdiv(num_extra, SPLIT_TILE)
    tiles_per_split = max(1, triton.cdiv(num_tiles, cfg.num_splits))
    split = cfg.num_splits > 1 or partials is not None
    if partials is not None:
        part_out, part_lse = partials
        out = part_out
    elif split:
        part_lse = torch.empty((batch, tokens, heads, cfg.num_splits), dtype=torch.float32, device=q.device)
        part_out = torch.empty((batch, tokens, heads, cfg.num_splits, head_dim), dtype=torch.float32,
                               device=q.device)
    else:
        part_lse = part_out = out
    main = _pool_args(kv, kv_scale, layout)
    extra = _pool_args(extra_kv, extra_kv_scale, layout) if layout.has_extra else main
    eidx = extra_idx if layout.has_extra else idx
    sink_arg = sink if sink is not None else q
    num_hblocks = triton.cdiv(heads, cfg.h_block)
    # The Triton 3.6 interpreter multiplies bf16 dot operands as raw 16-bit integers, so on CPU the
    # dots run in f32 (rows are bf16-exact either way; only P's bf16 rounding is not exercised).
    f32_dots = q.dtype == torch.float32 or not q.is_cuda
    fwd = KernelLaunch(
        _sparse_mla_fwd,
        (batch * tokens * num_hblocks * (block_d // block_dv), cfg.num_splits),
        (q, *q.stride(),
         *main, idx, *idx.stride(), idx.shape[2],
         *extra, eidx, *eidx.stride(), num_extra,
         sink_arg, out, part_lse, part_out,
         tokens, heads, num_hblocks, cfg.num_splits, tiles_per_split, float(scale) * LOG2E),
        dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_DV=block_dv, NOPE=layout.nope, FP8=layout.fp8,
             H_BLOCK=cfg.h_block, BLOCK_N=cfg.block_n, SPLIT_TILE=SPLIT_TILE,
             HAS_EXTRA=layout.has_extra, HAS_SINK=sink is not None, SPLIT=split,
             KV_DTYPE=tl.float32 if f32_dots else tl.bfloat16, DOT_PRECISION="ieee" if f32_dots else "tf32",
             BLOCK_K=triton.next_power_of_2(max(idx.shape[2], 1)),
             E_BLOCK_K=triton.next_power_of_2(max(num_extra, 1)),
             INTERPRETED=not q.is_cuda, NUM_STAGES=cfg.num_stages,
             IDX_ASM=cfg.idx_asm, KV_HALVES=cfg.kv_halves,
             num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(q, release=split and partials is None)),
    )
    if not split or partials is not None:
        return [fwd]
    return [fwd, combine_launch(part_lse, part_out, sink, out)]


def _staged_bytes_per_request(tokens: int, num_idx_total: int, head_dim: int, value_bytes: int) -> int:
    """Bytes of one request's staged rows (the lists' capacity; at least one position)."""
    return tokens * max(num_idx_total, 1) * head_dim * value_bytes


def stage_chunk(batch: int, tokens: int, num_idx_total: int, head_dim: int, value_bytes: int = 2) -> int:
    """Requests a staging chunk takes: as many as keep its staged rows within STAGE_MAX_BYTES (at
    least one), spread evenly over the fewest chunks."""
    per_request = _staged_bytes_per_request(tokens, num_idx_total, head_dim, value_bytes)
    chunks = triton.cdiv(batch, max(1, min(batch, STAGE_MAX_BYTES // per_request)))
    return triton.cdiv(batch, chunks)


def _staged_plan(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, sink, scale, out, cfg: LaunchConfig,
                 partials, layout: _Layout) -> list[KernelLaunch]:
    """`plan_sparse_mla` of FP8 rows staged into rows of q's dtype, `stage_chunk` requests at a time:
    per chunk, one launch staging both pools into one buffer (main list's rows first, the buffer
    shared by the chunks) and the tile `cfg` over the staged rows."""
    batch, tokens = idx.shape[:2]
    lists = [(kv, kv_scale, idx)] + ([(extra_kv, extra_kv_scale, extra_idx)] if layout.has_extra else [])
    width = sum(lst.shape[2] for _, _, lst in lists)
    chunk = stage_chunk(batch, tokens, width, layout.head_dim, q.element_size())
    buf = torch.empty((max(chunk * tokens * width, 1), layout.head_dim), dtype=q.dtype, device=q.device)
    launches = []
    for b0 in range(0, batch, chunk):
        rows_of = slice(b0, min(batch, b0 + chunk))
        staged_idx, jobs, base = [], [], 0
        for rows, scales, lst in lists:
            out_idx = torch.empty(lst[rows_of].shape, dtype=torch.int32, device=q.device)
            if out_idx.numel():  # an empty list has nothing to stage
                jobs.append((_pool_args(rows, scales, layout), lst[rows_of], out_idx, base))
            staged_idx.append(out_idx)
            base += out_idx.numel()
        if jobs:
            launches.append(KernelLaunch(*stage_fp8_rows_launch(jobs, layout.head_dim, layout.nope, buf)))
        extra = (buf, None, staged_idx[1]) if layout.has_extra else (None, None, None)
        launches += plan_sparse_mla(
            q[rows_of], buf, None, staged_idx[0], *extra, sink, scale, None if out is None else out[rows_of],
            config=cfg, partials=None if partials is None else (partials[0][rows_of], partials[1][rows_of]))
    return launches


def sparse_mla_triton(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, sink, scale,
                      *, out: torch.Tensor | None = None, num_splits: int | None = None,
                      validate: bool = True, config: LaunchConfig | None = None) -> torch.Tensor:
    """Launches the Triton kernels (same arguments as `sparse_mla_reference`); returns out.

    out: optional [B,T,H,Dh] contiguous tensor of q's dtype to write (tests pass one poisoned);
    num_splits: force the split-K factor (None = heuristic); validate=False skips the (sync-free)
    argument checks when the caller already ran them; config overrides the tile/grid heuristic.
    """
    if validate:
        validate_sparse_mla_inputs(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, sink, scale)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous {q.dtype} {tuple(q.shape)}")
    for launch in plan_sparse_mla(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, sink, scale,
                                  out, num_splits, config):
        launch.kernel[launch.grid](*launch.args, **launch.meta)
    return out


def sparse_mla_partials_triton(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, scale,
                               num_splits: int, *, out: torch.Tensor | None = None,
                               lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the split-K forward only (arguments as `sparse_mla_partials_reference`).

    out [B,T,H,S,Dh] / lse [B,T,H,S]: optional contiguous f32 tensors to write (tests pass them
    poisoned). Inputs must already be validated. Returns (out, lse).
    """
    batch, tokens, heads, head_dim = q.shape
    shapes = {"out": (batch, tokens, heads, num_splits, head_dim), "lse": (batch, tokens, heads, num_splits)}
    given = {"out": out, "lse": lse}
    for name, shape in shapes.items():
        if given[name] is None:
            given[name] = torch.empty(shape, dtype=torch.float32, device=q.device)
        elif tuple(given[name].shape) != shape or given[name].dtype != torch.float32 or not given[name].is_contiguous():
            raise ValueError(f"{name}: expected contiguous float32 {shape}")
    partials = (given["out"], given["lse"])
    for launch in plan_sparse_mla(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, None, scale,
                                  None, partials=partials):
        launch.kernel[launch.grid](*launch.args, **launch.meta)
    return partials


def _layout_of(q, kv, extra_kv) -> _Layout:
    head_dim = q.shape[-1]
    fp8 = kv.dtype == torch.uint8
    nope = 2 * head_dim - kv.shape[1] if fp8 else head_dim
    return _Layout(head_dim=head_dim, nope=nope, fp8=fp8, has_extra=extra_kv is not None)


# ----------------------------------------------------------------------------- registration


@torch.library.custom_op("dsv4::sparse_mla", mutates_args=())
def sparse_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_scale: torch.Tensor | None,
    idx: torch.Tensor,
    extra_kv: torch.Tensor | None,
    extra_kv_scale: torch.Tensor | None,
    extra_idx: torch.Tensor | None,
    sink: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Sparse MQA attention with sink over one or two pools; see the module docstring.

    q [B,T,H,Dh] bf16/f32 -> out [B,T,H,Dh] in q's dtype. Validates its inputs (ValueError)
    without any device sync; out-of-range indices are skipped, never read.
    """
    validate_sparse_mla_inputs(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, sink, scale)
    if triton_runs_on(q):
        return sparse_mla_triton(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, sink, scale,
                                 validate=False)
    return sparse_mla_reference(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, sink, scale)


@sparse_mla.register_fake
def _sparse_mla_fake(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, sink, scale):
    return q.new_empty(q.shape)


def _check_num_splits(num_splits) -> None:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits: expected an int in [1, 1024], got {num_splits!r}")


@torch.library.custom_op("dsv4::sparse_mla_partials", mutates_args=())
def sparse_mla_partials(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_scale: torch.Tensor | None,
    idx: torch.Tensor,
    extra_kv: torch.Tensor | None,
    extra_kv_scale: torch.Tensor | None,
    extra_idx: torch.Tensor | None,
    scale: float,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K half of dsv4::sparse_mla (no sink): see `sparse_mla_partials_reference`.

    Returns out [B,T,H,S,Dh] f32 and lse [B,T,H,S] f32, S = num_splits; the inductor lowering of
    dsv4::sparse_mla adds the combine (`combine_partials_reference`) as fusable inductor IR.
    """
    validate_sparse_mla_inputs(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, None, scale)
    _check_num_splits(num_splits)
    if triton_runs_on(q):
        return sparse_mla_partials_triton(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, scale,
                                          num_splits)
    return sparse_mla_partials_reference(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, scale,
                                         num_splits)


@sparse_mla_partials.register_fake
def _sparse_mla_partials_fake(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, scale, num_splits):
    batch, tokens, heads, head_dim = q.shape
    return (q.new_empty((batch, tokens, heads, num_splits, head_dim), dtype=torch.float32),
            q.new_empty((batch, tokens, heads, num_splits), dtype=torch.float32))
