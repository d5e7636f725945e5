"""The mHC projection's product and the sums of squares of its rows: `torch.ops.dsv4.mm_sumsq`.

Every mHC mapping of DeepSeek-V4 computes `rmsnorm(streams) @ fn^T` in f32: [tokens, 4 * hidden] @
[4 * hidden, 24] (9 a step in the 4-layer slice). The norm's row factor commutes with the product,
so the op takes the rows as they are (bf16 streams: half the bytes of the normalised f32 rows) and
returns `x @ w^T` and each row's sum of squares, both f32; the caller finishes with
`prod * rsqrt(sumsq / K + eps)`, which inductor fuses into the mixes' consumers.

Two Triton launches: one program per slice of SPLIT_COLS reduction columns multiplies on tensor
cores with three-pass TF32 (`input_precision="tf32x3"`: bf16 and f16 rows are exact in TF32 and the
f32 weight is split in a high and a low TF32 part, so the products keep about f32 accuracy) and
writes the slice's partial product and sums of squares; a second launch sums the slices of each
row in slice order (deterministic). Inductor's own mul + sum of this product re-reads the weight
for every row (bench/RESULTS.md, "Twentieth session").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_compile.kernels._runtime import triton_runs_on

ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_ROWS = 64  # one MMA tile of rows; more rows give a GEMM library enough output tiles
MAX_COLUMNS = 32
SPLIT_COLS = 128  # reduction columns a program (a slice); [16384] -> 128 slices
SUM_SLICES = 128  # slices the summing launch loads at a time
NUM_WARPS = 4


def num_slices(depth: int) -> int:
    """How many SPLIT_COLS slices cover a reduction of `depth` columns (at least 1)."""
    return max(1, triton.cdiv(depth, SPLIT_COLS))


# --------------------------------------------------------------------------------------------
# Torch reference (the spec)
# --------------------------------------------------------------------------------------------
def rms_mm_partials_reference(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K], weight [N, K] f32 -> (prod [S, M, N] f32, sumsq [S, M] f32), S = num_slices(K):
    slice s covers columns [s * SPLIT_COLS, (s + 1) * SPLIT_COLS) of K; prod[s] = x[:, slice] @
    weight[:, slice]^T and sumsq[s] = sum of x[:, slice]^2, both in f32."""
    rows, depth = x.shape
    slices = num_slices(depth)
    pad = slices * SPLIT_COLS - depth
    xs = torch.nn.functional.pad(x.float(), (0, pad)).view(rows, slices, SPLIT_COLS).transpose(0, 1)
    ws = torch.nn.functional.pad(weight.float(), (0, pad)).view(-1, slices, SPLIT_COLS).transpose(0, 1)
    return xs @ ws.transpose(1, 2), xs.pow(2).sum(-1)


def mm_sumsq_reference(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K], weight [N, K] f32 -> (x @ weight^T [M, N], sum of x^2 over K [M]), f32: the op's spec,
    summed slice by slice in slice order as the kernels do."""
    prod, sumsq = rms_mm_partials_reference(x, weight)
    return prod.sum(0), sumsq.sum(0)


def rms_mm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x.float()) @ weight^T, the norm unweighted with `eps`: [M, N] f32 (what the pass finishes to)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)) @ weight.float().t()


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _rms_mm_partials_kernel(x_ptr, w_ptr, prod_ptr, sumsq_ptr, M, N, K,
                            stride_xm, stride_xk, stride_wn, stride_wk,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """Program s: prod[s] = x[:, cols] @ w[:, cols]^T ([BLOCK_M, BLOCK_N] stored as [M, N]) and
    sumsq[s] = sum(x[:, cols]^2), cols = [s * SPLIT, (s + 1) * SPLIT) within K."""
    s = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    k = s * SPLIT + tl.arange(0, SPLIT)
    k_ok = k < K
    x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :].to(tl.int64) * stride_xk,
                mask=(rows < M)[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols[None, :] * stride_wn + k[:, None].to(tl.int64) * stride_wk,
                mask=(cols < N)[None, :] & k_ok[:, None], other=0.0)
    prod = tl.dot(x, w, input_precision="tf32x3")
    base = s.to(tl.int64) * M
    tl.store(prod_ptr + (base + rows[:, None]) * N + cols[None, :], prod,
             mask=(rows < M)[:, None] & (cols < N)[None, :])
    tl.store(sumsq_ptr + base + rows, tl.sum(x * x, axis=1), mask=rows < M)


@triton.jit
def _sum_slices_kernel(prod_part_ptr, sumsq_part_ptr, prod_ptr, sumsq_ptr, M, N, S,
                       BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program m: prod[m] = sum over slices of prod_part[:, m] ([S, M, N]), sumsq[m] likewise ([S, M]),
    BLOCK_S slices at a time, in slice order."""
    m = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    prod = tl.zeros([BLOCK_N], tl.float32)
    sumsq = tl.zeros([BLOCK_S], tl.float32)
    s0 = 0
    while s0 < S:  # while loops: the interpreter cannot range() over its scalar arguments
        slices = s0 + tl.arange(0, BLOCK_S)
        s_ok = slices < S
        part = tl.load(prod_part_ptr + (slices[:, None] * M + m) * N + cols[None, :],
                       mask=s_ok[:, None] & (cols < N)[None, :], other=0.0)
        prod += tl.sum(part, axis=0)
        sumsq += tl.load(sumsq_part_ptr + slices * M + m, mask=s_ok, other=0.0)
        s0 += BLOCK_S
    tl.store(prod_ptr + m * N + cols, prod, mask=cols < N)
    tl.store(sumsq_ptr + m, tl.sum(sumsq, axis=0))


def _f32_outputs(caller: str, device: torch.device, **given: tuple[torch.Tensor | None, tuple[int, ...]]
                 ) -> list[torch.Tensor]:
    """name=(tensor or None, shape) -> the tensors, each allocated where None, else checked to be a
    contiguous f32 tensor of that shape (ValueError naming it)."""
    out = []
    for name, (t, want) in given.items():
        if t is None:
            t = torch.empty(want, dtype=torch.float32, device=device)
        elif tuple(t.shape) != want or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{caller}: {name} must be a contiguous float32 {want} tensor, got {t.dtype} "
                             f"{tuple(t.shape)}")
        out.append(t)
    return out


def rms_mm_partials_triton(x: torch.Tensor, weight: torch.Tensor, prod: torch.Tensor | None = None,
                           sumsq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on arguments `check_rms_mm_args` accepts; prod / sumsq may be a caller's contiguous f32
    tensors of the result shapes (tests pass them poisoned)."""
    rows, depth = x.shape
    columns = weight.shape[0]
    slices = num_slices(depth)
    prod, sumsq = _f32_outputs("rms_mm_partials_triton", x.device, prod=(prod, (slices, rows, columns)),
                               sumsq=(sumsq, (slices, rows)))
    if rows == 0:
        return prod, sumsq
    if depth == 0:
        return prod.zero_(), sumsq.zero_()
    _rms_mm_partials_kernel[(slices,)](
        x, weight, prod, sumsq, rows, columns, depth, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=max(16, triton.next_power_of_2(columns)),
        SPLIT=SPLIT_COLS, num_warps=NUM_WARPS)
    return prod, sumsq


# --------------------------------------------------------------------------------------------
# Op
# --------------------------------------------------------------------------------------------
def check_rms_mm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    """ValueError / TypeError naming the argument that the op does not take."""
    if x.dtype not in ROW_DTYPES:
        raise TypeError(f"mm_sumsq: x must be one of {ROW_DTYPES}, got {x.dtype}")
    if weight.dtype != torch.float32:
        raise TypeError(f"mm_sumsq: weight must be float32, got {weight.dtype}")
    for name, t in (("x", x), ("weight", weight)):
        if t.dim() != 2:
            raise ValueError(f"mm_sumsq: {name} must be 2-D, got shape {tuple(t.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"mm_sumsq: x [M, K] and weight [N, K] must share K, got x {tuple(x.shape)} "
                         f"and weight {tuple(weight.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"mm_sumsq: x must have at most {MAX_ROWS} rows, got {x.shape[0]}")
    if not 1 <= weight.shape[0] <= MAX_COLUMNS:
        raise ValueError(f"mm_sumsq: weight must have 1 to {MAX_COLUMNS} rows, got {weight.shape[0]}")
    if x.device != weight.device:
        raise ValueError(f"mm_sumsq: x ({x.device}) and weight ({weight.device}) must be on one device")
    # Row and column offsets are 32-bit in the kernel (the K offsets are 64-bit).
    for name, size, stride in (("x", x.shape[0], x.stride(0)), ("weight", weight.shape[0], weight.stride(0))):
        if (size - 1) * stride >= 2**31:
            raise ValueError(f"mm_sumsq: {name}'s row offsets reach {(size - 1) * stride} elements, past "
                             f"the kernel's 32-bit range (< 2**31)")


def mm_sumsq_triton(x: torch.Tensor, weight: torch.Tensor, prod: torch.Tensor | None = None,
                    sumsq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both launches on arguments `check_rms_mm_args` accepts; prod [M, N] / sumsq [M] may be a
    caller's contiguous f32 tensors (tests pass them poisoned)."""
    rows, depth = x.shape
    columns = weight.shape[0]
    prod, sumsq = _f32_outputs("mm_sumsq_triton", x.device, prod=(prod, (rows, columns)), sumsq=(sumsq, (rows,)))
    prod_part, sumsq_part = rms_mm_partials_triton(x, weight)
    if rows == 0:
        return prod, sumsq
    slices = prod_part.shape[0]
    _sum_slices_kernel[(rows,)](prod_part, sumsq_part, prod, sumsq, rows, columns, slices,
                                BLOCK_S=min(SUM_SLICES, triton.next_power_of_2(slices)),
                                BLOCK_N=triton.next_power_of_2(columns),
                                num_warps=NUM_WARPS)
    return prod, sumsq


@torch.library.custom_op("dsv4::mm_sumsq", mutates_args=())
def mm_sumsq(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M <= 64, K] bf16/f16/f32, weight [N <= 32, K] f32 -> (x @ weight^T [M, N], sum of x^2 over K
    [M]), both f32 (`mm_sumsq_reference`). Static grids, no host syncs (CUDA-graph safe)."""
    check_rms_mm_args(x, weight)
    if triton_runs_on(x):
        return mm_sumsq_triton(x, weight)
    return mm_sumsq_reference(x, weight)


@mm_sumsq.register_fake
def _mm_sumsq_fake(x, weight):
    check_rms_mm_args(x, weight)
    return (x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32),
            x.new_empty(x.shape[0], dtype=torch.float32))
