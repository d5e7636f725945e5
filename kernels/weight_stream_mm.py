"""A few rows against a very large weight: `torch.ops.dsv4.weight_stream_mm`.

At decode the LM head is x [M, K] @ W[N, K]^T with M = batch x tokens <= 64 and a bf16 weight of
about 1 GB (V4-Flash: 129,280 x 4,096): its time is the weight's bytes. cuBLAS streamed it at 0.78 of
4.8 TB/s at M = 64 (0.86 at M = 1). The kernel here gives each program 128 weight rows, the M side
of the MMA (swap-AB, so that the tensor-core tile is full at any row count), walks the whole
reduction in 128-deep steps two stages deep, and keeps the x rows as the MMA's N side (padded to
16). On the H200 that reached 0.86-0.87 of HBM at M = 64 (bench/RESULTS.md, sixteenth session).
Shared memory: 98,304 B compiled for sm_90 (two stages of the 128 x 128 weight and 128 x 64 x
tiles), 49,152 B cross-compiled for sm_120 (limit 101,376 B).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_compile.kernels._runtime import triton_runs_on

DTYPES = (torch.bfloat16, torch.float16)
MAX_ROWS = 64  # the rows are one MMA operand tile; more rows give a GEMM library enough output tiles
BLOCK_N = 128
BLOCK_K = 128
NUM_STAGES = 2
NUM_WARPS = 4


# --------------------------------------------------------------------------------------------
# Torch reference (the spec)
# --------------------------------------------------------------------------------------------
def weight_stream_mm_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T accumulated in f32, rounded once to x's dtype: [M, N] contiguous."""
    return (x.float() @ weight.float().t()).to(x.dtype)


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _weight_stream_mm_kernel(x_ptr, w_ptr, out_ptr, M, N, K: tl.constexpr,
                             stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                             BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                             NUM_STAGES: tl.constexpr, DOT_F32: tl.constexpr):
    """Program n: out[:M, n block] = (w[n block, :] @ x[:M, :]^T)^T, accumulated as
    [BLOCK_N, BLOCK_M] (weight rows x x rows). K is constexpr: fixed per weight, and a loop bound
    the interpreter (numpy >= 2.4) accepts."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
    x_cols = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None] * stride_xk
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if K % BLOCK_K == 0:
            w = tl.load(w_rows + k0 * stride_wk, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_cols + k0 * stride_xk, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + offs_k) < K
            w = tl.load(w_rows + k0 * stride_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_cols + k0 * stride_xk, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_F32:  # the interpreter computes bf16 dots wrongly (triton 3.6)
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc)
        else:
            acc = tl.dot(w, x, acc)
    out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def weight_stream_mm_triton(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch on arguments `check_weight_stream_mm_args` accepts (see `weight_stream_mm`); returns [M, N]
    in x's dtype, contiguous. `out` may be a caller's contiguous tensor of that shape and dtype."""
    rows, depth = x.shape
    columns = weight.shape[0]
    if out is None:
        out = torch.empty(rows, columns, dtype=x.dtype, device=x.device)
    elif out.shape != (rows, columns) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"weight_stream_mm_triton: out must be a contiguous [{rows}, {columns}] {x.dtype} tensor, "
                         f"got {out.dtype} {tuple(out.shape)} with strides {out.stride()}")
    if rows == 0 or columns == 0:
        return out
    if depth == 0:
        return out.zero_()
    _weight_stream_mm_kernel[(triton.cdiv(columns, BLOCK_N),)](
        x, weight, out, rows, columns, depth, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        out.stride(0), out.stride(1), BLOCK_N=BLOCK_N, BLOCK_M=max(16, triton.next_power_of_2(rows)),
        BLOCK_K=BLOCK_K, NUM_STAGES=NUM_STAGES, DOT_F32=not x.is_cuda, num_warps=NUM_WARPS)
    return out


# --------------------------------------------------------------------------------------------
# Op
# --------------------------------------------------------------------------------------------
def check_weight_stream_mm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    """ValueError / TypeError naming the argument that the op does not take."""
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in DTYPES:
            raise TypeError(f"weight_stream_mm: {name} must be one of {DTYPES}, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"weight_stream_mm: {name} must be 2-D, got shape {tuple(t.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"weight_stream_mm: x ({x.dtype}) and weight ({weight.dtype}) must have one dtype")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"weight_stream_mm: x [M, K] and weight [N, K] must share K, got x {tuple(x.shape)} "
                         f"and weight {tuple(weight.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"weight_stream_mm: x must have at most {MAX_ROWS} rows, got {x.shape[0]}")
    if x.device != weight.device:
        raise ValueError(f"weight_stream_mm: x ({x.device}) and weight ({weight.device}) must be on one device")
    # The kernel computes these offsets in 32 bits (the weight's row offsets are 64-bit).
    rows, depth = x.shape
    for name, what, size, stride in (("x", "row", rows, x.stride(0)), ("x", "K", depth, x.stride(1)),
                                     ("weight", "K", depth, weight.stride(1)), ("the output", "row", rows, weight.shape[0])):
        if (size - 1) * stride >= 2**31:
            raise ValueError(f"weight_stream_mm: {name}'s {what} offsets reach {(size - 1) * stride} elements, past the "
                             f"kernel's 32-bit range (< 2**31); pass a row-major weight and contiguous rows")


@torch.library.custom_op("dsv4::weight_stream_mm", mutates_args=())
def weight_stream_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T for M <= 64 rows: [M, N] in x's dtype, contiguous.

    x and weight are bf16 or f16 (one dtype), any strides whose offsets stay below 2**31 elements
    (the weight's row stride is free); the product accumulates in f32 and is
    rounded once (`weight_stream_mm_reference`). Static grid, no host syncs (CUDA-graph safe).
    """
    check_weight_stream_mm_args(x, weight)
    if triton_runs_on(x):
        return weight_stream_mm_triton(x, weight)
    return weight_stream_mm_reference(x, weight)


@weight_stream_mm.register_fake
def _weight_stream_mm_fake(x, weight):
    check_weight_stream_mm_args(x, weight)
    return x.new_empty(x.shape[0], weight.shape[0])
