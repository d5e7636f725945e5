"""FP8 rows of the sparse MLA pools: their dequantisation (torch reference and Triton loader) and
their staging into rows of q's dtype.

An FP8 row is `nope` e4m3 values then `rope` bf16 values stored as byte pairs; each 64-dim group of
the nope values has a ue8m0 exponent e in the row's exponent row (value = e4m3 * 2^(e - 127)).

Staging gathers the rows that each query token's index list selects, dequantised, into a buffer of
q's dtype: token (b, t)'s list of K positions owns K consecutive buffer rows, in list order, and a
new index list points at them (-1 where the original skips). e4m3 times a power of two has 4
significant bits and the rope values are bf16, so the staged rows hold the dequantised values
exactly (for exponents e >= 10; below, values fall under bf16's normal range, as in sparse_mla's
FP8 tile) and attention over them equals attention over the FP8 rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SCALE_GROUP = 64  # nope dims per ue8m0 exponent


def dequantize_fp8_rows(rows: torch.Tensor, scales: torch.Tensor, head_dim: int) -> torch.Tensor:
    """FP8 rows [N, nope + 2*rope] uint8 + exponents [N, >= nope/64] uint8 -> [N, head_dim] f32.

    nope = 2*head_dim - row_bytes e4m3 values, each times 2^(e-127) of its 64-dim group, then
    rope = row_bytes - head_dim bf16 values stored as little-endian byte pairs.
    """
    rope = rows.shape[1] - head_dim
    nope = head_dim - rope
    nope_vals = rows[:, :nope].contiguous().view(torch.float8_e4m3fn).float()
    exps = scales[:, : nope // SCALE_GROUP].float() - 127.0
    nope_vals = nope_vals * torch.exp2(exps).repeat_interleave(SCALE_GROUP, dim=1)
    rope_vals = rows[:, nope:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope_vals, rope_vals], dim=1)


def stage_fp8_rows_reference(rows: torch.Tensor, scales: torch.Tensor, idx: torch.Tensor, head_dim: int,
                             base: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec of staging: FP8 rows [N, row_bytes] uint8, exponents [N, >= nope/64] uint8 and
    idx [B, T, K] int32 -> (staged [B*T*K, head_dim] f32, staged_idx [B, T, K] int32).

    staged_idx[b, t, k] = base + (b*T + t)*K + k where idx[b, t, k] selects a row (0 <= idx < N), else -1;
    staged row base + j (its row j here) holds that row's values; rows of skipped positions are
    unspecified (zero here; the kernel leaves them unwritten).
    """
    batch, tokens, k = idx.shape
    ok = (idx >= 0) & (idx < rows.shape[0])
    vals = dequantize_fp8_rows(rows, scales, head_dim)
    staged = vals[torch.where(ok, idx, 0).long()] * ok.unsqueeze(-1)
    dst = base + torch.arange(batch * tokens * k, device=idx.device, dtype=torch.int64).view(batch, tokens, k)
    return staged.reshape(-1, head_dim), torch.where(ok, dst, -1).to(torch.int32)


# ----------------------------------------------------------------------------- Triton


@triton.jit
def _load_rows(kv_ptr, rope_ptr, scale_ptr, rows, row_ok, col0,
               stride_row, stride_col, stride_rope_row, stride_scale_row,
               HEAD_DIM: tl.constexpr, NOPE: tl.constexpr, FP8: tl.constexpr, OUT_DTYPE: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """Columns [col0, col0 + BLOCK_W) of rows `rows` [BN] (int64) of a pool -> [BN, BLOCK_W] OUT_DTYPE.

    Lanes not row_ok (and columns >= HEAD_DIM) are 0 and unread. FP8 rows need col0 % 64 == 0.
    """
    rows2 = rows[:, None]
    d2 = col0 + tl.arange(0, BLOCK_W)[None, :]
    if FP8:
        nope_mask = row_ok[:, None] & (d2 < NOPE)
        e4m3 = tl.load(kv_ptr + rows2 * stride_row + d2, mask=nope_mask, other=0.0)
        # one exponent per 64 dims: load [BN, BLOCK_W/64] and broadcast, not one load per element
        groups = col0 // 64 + tl.arange(0, BLOCK_W // 64)
        exps = tl.load(scale_ptr + rows2 * stride_scale_row + groups[None, :],
                       mask=row_ok[:, None] & (groups[None, :] < NOPE // 64), other=127)
        # e4m3 (4 significant bits) times a power of two is exact in bf16: no f32 tile is needed
        mult = tl.exp2(exps.to(tl.float32) - 127.0).to(OUT_DTYPE)
        mult = tl.reshape(tl.broadcast_to(mult[:, :, None], (BLOCK_N, BLOCK_W // 64, 64)), (BLOCK_N, BLOCK_W))
        nope = e4m3.to(OUT_DTYPE) * mult
        rope_mask = row_ok[:, None] & (d2 >= NOPE) & (d2 < HEAD_DIM)
        rope = tl.load(rope_ptr + rows2 * stride_rope_row + (d2 - NOPE), mask=rope_mask, other=0.0)
        vals = tl.where(d2 < NOPE, nope, rope.to(OUT_DTYPE))
    else:
        vals = tl.load(kv_ptr + rows2 * stride_row + d2 * stride_col,
                       mask=row_ok[:, None] & (d2 < HEAD_DIM), other=0.0)
    return vals.to(OUT_DTYPE)


@triton.jit
def _stage_fp8_rows_kernel(kv_ptr, rope_ptr, scale_ptr, stride_row, stride_rope_row, stride_scale_row, num_rows,
                           idx_ptr, stride_ib, stride_it, stride_ik, num_idx, out_idx_ptr, base,
                           ekv_ptr, erope_ptr, escale_ptr, e_stride_row, e_stride_rope_row, e_stride_scale_row,
                           e_num_rows, eidx_ptr, e_stride_ib, e_stride_it, e_stride_ik, e_num_idx, e_out_idx_ptr,
                           e_base, T, out_ptr,
                           HEAD_DIM: tl.constexpr, NOPE: tl.constexpr, VAL_DTYPE: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program: BLOCK_N positions of one token's list -> their staged rows and staged indices.

    Program blocks [0, cdiv(num_idx, BLOCK_N)) stage the first list (the main pool's), the rest the
    second (the extra pool's, e_*), so that both pools take one launch.
    """
    bt = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    main_blocks = tl.cdiv(num_idx, BLOCK_N)
    in_extra = blk >= main_blocks
    k = tl.where(in_extra, e_num_idx, num_idx)
    pos = tl.where(in_extra, blk - main_blocks, blk) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_list = pos < k
    lst = tl.where(in_extra, eidx_ptr, idx_ptr) + (bt // T) * tl.where(in_extra, e_stride_ib, stride_ib) \
        + (bt % T) * tl.where(in_extra, e_stride_it, stride_it)
    rows = tl.load(lst + pos * tl.where(in_extra, e_stride_ik, stride_ik), mask=in_list, other=-1)
    ok = (rows >= 0) & (rows < tl.where(in_extra, e_num_rows, num_rows))  # -1 and out of range: never read
    vals = _load_rows(tl.where(in_extra, ekv_ptr, kv_ptr), tl.where(in_extra, erope_ptr, rope_ptr),
                      tl.where(in_extra, escale_ptr, scale_ptr), rows.to(tl.int64), ok, 0,
                      tl.where(in_extra, e_stride_row, stride_row), 1,
                      tl.where(in_extra, e_stride_rope_row, stride_rope_row),
                      tl.where(in_extra, e_stride_scale_row, stride_scale_row),
                      HEAD_DIM, NOPE, True, VAL_DTYPE, BLOCK_N, BLOCK_D)
    dst = tl.where(in_extra, e_base, base) + bt * k + pos
    d = tl.arange(0, BLOCK_D)
    tl.store(out_ptr + dst[:, None] * HEAD_DIM + d[None, :], vals.to(out_ptr.dtype.element_ty),
             mask=ok[:, None] & (d < HEAD_DIM)[None, :])
    tl.store(tl.where(in_extra, e_out_idx_ptr, out_idx_ptr) + bt * k + pos, tl.where(ok, dst, -1).to(tl.int32),
             mask=in_list)


# Positions a staging program, on STAGE_WARPS warps. H200, each against the FP8 tile in one run
# ("Twenty-sixth session"): 4 on 4 warps within 0.25 us of the best of 4 on 2 and 8 on 4 or 8 at
# B=64 T=1, up to 3.5 us faster at T=4 (14 at FlashMLA's config); 16 and 32 a program lost 2-30 us.
STAGE_ROWS = 4
STAGE_WARPS = 4


def stage_fp8_rows_launch(jobs: list[tuple], head_dim: int, nope: int, out: torch.Tensor) -> tuple:
    """(kernel, grid, args, meta) of one launch staging one or two lists.

    jobs: 1 or 2 of (pool, idx, out_idx, base): pool = (e4m3 view, rope view, exponents, row stride,
    1, rope row stride, exponent row stride, N) of FP8 rows (sparse_mla's `_pool_args`), idx
    [B, T, K] int32 (any strides; the same B, T in both), out_idx [B, T, K] contiguous int32, base:
    its first row in out [rows, head_dim] (contiguous bf16 or f32, rows >= base + B*T*K). The grid's
    second axis holds both lists' blocks of STAGE_ROWS positions (CUDA allows at most 65,535).
    """
    batch, tokens = jobs[0][1].shape[:2]
    first = jobs[0]
    # one list: the second is the first's pool with no positions (no program blocks)
    second = jobs[1] if len(jobs) > 1 else (first[0], first[1][:, :, :0], first[2], 0)

    def job_args(job):
        pool, idx, out_idx, base = job
        e4m3, rope, scales, stride_row, _, stride_rope_row, stride_scale_row, num_rows = pool
        return (e4m3, rope, scales, stride_row, stride_rope_row, stride_scale_row, num_rows,
                idx, *idx.stride(), idx.shape[2], out_idx, base)

    blocks = sum(triton.cdiv(job[1].shape[2], STAGE_ROWS) for job in (first, second))
    # bf16 holds the values exactly; the interpreter computes in f32 (it has no bf16 arithmetic)
    val_dtype = tl.bfloat16 if out.dtype == torch.bfloat16 and out.is_cuda else tl.float32
    return (_stage_fp8_rows_kernel, (batch * tokens, blocks), (*job_args(first), *job_args(second), tokens, out),
            dict(HEAD_DIM=head_dim, NOPE=nope, VAL_DTYPE=val_dtype, BLOCK_N=STAGE_ROWS,
                 BLOCK_D=triton.next_power_of_2(head_dim), num_warps=STAGE_WARPS))
