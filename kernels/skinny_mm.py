"""Split-K partial products of a few-column f32 matmul: `torch.ops.dsv4.skinny_mm_partials`.

The mHC mapping of every DeepSeek-V4 layer multiplies its RMS-normalised streams [tokens, 4 *
hidden] by a [4 * hidden, 24] f32 weight (the hyper head by a [4 * hidden, 4] one). cuBLAS runs such
a product as one tile that walks the whole reduction alone, and inductor's reduction form re-reads
the activations once per output column. The kernel here gives each program a block of rows and one
chunk of the reduction, reads both operands once, and writes one partial product per chunk; the sum
over chunks is left to the graph, where inductor fuses it with what consumes the product.
"""
from __future__ import annotations

from numbers import Integral

import torch
import triton
import triton.language as tl

from dsv4_compile.kernels._runtime import triton_runs_on

MAX_COLUMNS = 64
BLOCK_M = 16
BLOCK_K = 64
NUM_WARPS = 4
# Splits are chosen for about this many programs (two waves of the H200's 132 SMs), with chunks of
# at least MIN_CHUNK reduction columns.
TARGET_PROGRAMS = 256
MIN_CHUNK = 256


# --------------------------------------------------------------------------------------------
# Torch reference (the spec)
# --------------------------------------------------------------------------------------------
def chunk_size(depth: int, splits: int) -> int:
    """Reduction columns per split: ceil(depth / splits); split s covers [s * chunk, (s + 1) * chunk)."""
    return -(-depth // splits)


def skinny_mm_partials_reference(a: torch.Tensor, b: torch.Tensor, splits: int) -> torch.Tensor:
    """a [M, K] (f32, bf16 or f16), b [K, N] f32 -> [splits, M, N] f32: partial s is
    a.float()[:, chunk s] @ b[chunk s, :] (chunk_size; chunks past K are zero)."""
    chunk = chunk_size(a.shape[1], splits)
    out = a.new_zeros((splits, a.shape[0], b.shape[1]), dtype=torch.float32)
    for s in range(splits):
        lo, hi = s * chunk, min((s + 1) * chunk, a.shape[1])
        if lo < hi:
            out[s] = a[:, lo:hi].float() @ b[lo:hi]
    return out


def choose_splits(rows: int, depth: int) -> int:
    """Splits of the reduction for an [rows, depth] operand: a power of two giving about
    TARGET_PROGRAMS programs, with chunks of at least MIN_CHUNK columns (at least one split)."""
    row_blocks = -(-rows // BLOCK_M)
    splits = 1
    while splits * 2 * row_blocks <= TARGET_PROGRAMS and depth // (splits * 2) >= MIN_CHUNK:
        splits *= 2
    return splits


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _partials_kernel(a_ptr, b_ptr, out_ptr, M, K, N,
                     stride_am, stride_ak, stride_bk, stride_bn,
                     CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (i, s): rows [i * BLOCK_M, ...) times reduction chunk s -> out[s, rows, :N]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, CHUNK, BLOCK_K):
        k = split * CHUNK + k0 + tl.arange(0, BLOCK_K)
        k_ok = (k < K) & (k0 + tl.arange(0, BLOCK_K) < CHUNK)
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + k[None, :] * stride_ak,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        b = tl.load(b_ptr + k[:, None].to(tl.int64) * stride_bk + cols[None, :] * stride_bn,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    offsets = (split.to(tl.int64) * M + rows[:, None]) * N + cols[None, :]
    tl.store(out_ptr + offsets, acc, mask=row_ok[:, None] & col_ok[None, :])


def skinny_mm_partials_triton(a: torch.Tensor, b: torch.Tensor, splits: int,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the kernel on checked arguments (as `skinny_mm_partials`); `out` may be a caller's
    contiguous [splits, M, N] f32 tensor (tests pass it poisoned)."""
    rows, depth = a.shape
    columns = b.shape[1]
    if out is None:
        out = torch.empty((splits, rows, columns), dtype=torch.float32, device=a.device)
    if rows == 0 or columns == 0:
        return out
    if depth == 0:
        return out.zero_()
    chunk = chunk_size(depth, splits)
    grid = (triton.cdiv(rows, BLOCK_M), splits)
    _partials_kernel[grid](a, b, out, rows, depth, columns, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                           CHUNK=chunk,
                           BLOCK_M=BLOCK_M, BLOCK_N=max(16, triton.next_power_of_2(columns)), BLOCK_K=BLOCK_K,
                           num_warps=NUM_WARPS)
    return out


# --------------------------------------------------------------------------------------------
# Op
# --------------------------------------------------------------------------------------------
def check_skinny_mm_args(a: torch.Tensor, b: torch.Tensor, splits: int) -> None:
    """ValueError / TypeError naming the argument that the op does not take."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"skinny_mm_partials: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"skinny_mm_partials: {name} must be 2-D, got shape {tuple(t.shape)}")
    if a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"skinny_mm_partials: a must be float32, bfloat16 or float16, got {a.dtype}")
    if b.dtype != torch.float32:
        raise ValueError(f"skinny_mm_partials: b must be float32, got {b.dtype}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"skinny_mm_partials: a [M, K] and b [K, N] disagree on K: {tuple(a.shape)} @ {tuple(b.shape)}")
    if b.shape[1] > MAX_COLUMNS:
        raise ValueError(f"skinny_mm_partials: b must have at most {MAX_COLUMNS} columns, got {b.shape[1]}")
    if a.device != b.device:
        raise ValueError(f"skinny_mm_partials: a and b must be on one device, got {a.device} and {b.device}")
    if isinstance(splits, bool) or not isinstance(splits, Integral) or splits < 1:
        raise ValueError(f"skinny_mm_partials: splits must be an int >= 1, got {splits!r}")


@torch.library.custom_op("dsv4::skinny_mm_partials", mutates_args=())
def skinny_mm_partials(a: torch.Tensor, b: torch.Tensor, splits: int) -> torch.Tensor:
    """Split-K partial products of a matmul with few columns.

    a [M, K] f32 / bf16 / f16, b [K, N] f32 with N <= MAX_COLUMNS (any strides), splits >= 1.
    Returns [splits, M, N] f32 whose sum over dim 0 is a.float() @ b accumulated in f32
    (`skinny_mm_partials_reference`). Static grid, no host syncs (CUDA-graph safe).
    """
    check_skinny_mm_args(a, b, splits)
    if triton_runs_on(a):
        return skinny_mm_partials_triton(a, b, splits)
    return skinny_mm_partials_reference(a, b, splits)


@skinny_mm_partials.register_fake
def _skinny_mm_partials_fake(a, b, splits):
    check_skinny_mm_args(a, b, splits)
    return a.new_empty((splits, a.shape[0], b.shape[1]), dtype=torch.float32)
