"""Sinkhorn-Knopp normalisation of the mHC comb matrices: `torch.ops.dsv4.hc_sinkhorn`.

DeepSeek-V4's hyper-connections turn every token's [n, n] comb logits (n = hc_mult = 4) into a
near doubly-stochastic matrix: softmax over the last dim plus eps, then one column normalisation
and `iters - 1` rounds of (row, column) normalisations, each x / (x.sum(dim, keepdim) + eps).
Inductor inlines the alternating sums into pointwise kernels that recompute them (their work
grows with the step count) and that cost the same at any batch (~143 us each on the H200 at
iters = 20). The kernel here keeps each matrix in the registers of one warp, runs every step
there and writes once.
"""
from __future__ import annotations

import math
from numbers import Integral, Real

import torch
import triton
import triton.language as tl

from dsv4_compile.kernels._runtime import triton_runs_on

MATRIX_SIZES = (1, 2, 4, 8, 16)
# One matrix per one-warp program: the kernel is a chain of 2 * iters - 1 dependent normalisations,
# and more matrices per program lengthened it. H200, iters 20, 64 or 256 matrices of 4 x 4: 3.6 us
# vs 12.6 us for 32 matrices on 4 warps, 6.6 us for 8 on one warp (bench/RESULTS.md, eighth
# session); prefill-sized batches were not timed.
DEFAULT_BLOCK_M = 1
DEFAULT_WARPS = 1


# --------------------------------------------------------------------------------------------
# Torch reference (the spec)
# --------------------------------------------------------------------------------------------
def hc_sinkhorn_reference(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., n, n] f32 (after softmax + eps) -> the same shape: one column normalisation,
    then `iters - 1` (row, column) rounds, each x / (x.sum(dim, keepdim=True) + eps)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _sinkhorn_kernel(comb_ptr, out_ptr, M, eps,
                     N: tl.constexpr, ITERS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program p normalises matrices p * BLOCK_M ... (contiguous [M, N, N] f32) in registers."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    i = tl.arange(0, N)
    offsets = m[:, None, None].to(tl.int64) * (N * N) + i[None, :, None] * N + i[None, None, :]
    mask = (m < M)[:, None, None]
    x = tl.load(comb_ptr + offsets, mask=mask, other=1.0)
    # div_rn: torch's f32 division is correctly rounded; Triton's `/` is not on the GPU.
    x = tl.div_rn(x, tl.sum(x, axis=1, keep_dims=True) + eps)
    for _ in range(ITERS - 1):
        x = tl.div_rn(x, tl.sum(x, axis=2, keep_dims=True) + eps)
        x = tl.div_rn(x, tl.sum(x, axis=1, keep_dims=True) + eps)
    tl.store(out_ptr + offsets, x, mask=mask)


def hc_sinkhorn_triton(comb: torch.Tensor, iters: int, eps: float, *, block_m: int = DEFAULT_BLOCK_M,
                       num_warps: int = DEFAULT_WARPS, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the kernel on checked arguments (as `hc_sinkhorn`); returns out [..., n, n] f32,
    contiguous. block_m (matrices per program, a power of two) and num_warps override the
    launch config; `out` may be a caller's contiguous tensor of comb's shape."""
    n = comb.shape[-1]
    comb = comb.contiguous()
    if out is None:
        out = torch.empty_like(comb)
    elif out.shape != comb.shape or out.dtype != torch.float32 or not out.is_contiguous() or out.device != comb.device:
        raise ValueError(f"hc_sinkhorn: out must be a contiguous float32 tensor of comb's shape {tuple(comb.shape)} "
                         f"on {comb.device}, got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    matrices = comb.numel() // (n * n)
    if matrices == 0:
        return out
    _sinkhorn_kernel[(triton.cdiv(matrices, block_m),)](
        comb, out, matrices, float(eps), N=n, ITERS=iters, BLOCK_M=block_m, num_warps=num_warps)
    return out


# --------------------------------------------------------------------------------------------
# Op
# --------------------------------------------------------------------------------------------
def check_hc_sinkhorn_args(comb: torch.Tensor, iters: int, eps: float) -> None:
    """ValueError / TypeError naming the argument that the op does not take."""
    if not isinstance(comb, torch.Tensor):
        raise TypeError(f"hc_sinkhorn: comb must be a tensor, got {type(comb).__name__}")
    if comb.dtype != torch.float32:
        raise ValueError(f"hc_sinkhorn: comb must be float32, got {comb.dtype}")
    if comb.dim() < 2 or comb.shape[-1] != comb.shape[-2] or comb.shape[-1] not in MATRIX_SIZES:
        raise ValueError(f"hc_sinkhorn: comb must be [..., n, n] with n in {MATRIX_SIZES}, "
                         f"got shape {tuple(comb.shape)}")
    if isinstance(iters, bool) or not isinstance(iters, Integral) or iters < 1:
        raise ValueError(f"hc_sinkhorn: iters must be an int >= 1, got {iters!r}")
    if isinstance(eps, bool) or not isinstance(eps, Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"hc_sinkhorn: eps must be a finite float >= 0, got {eps!r}")


@torch.library.custom_op("dsv4::hc_sinkhorn", mutates_args=())
def hc_sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp normalisation of a batch of small square matrices.

    comb [..., n, n] f32 (any leading shape and strides; n in 1, 2, 4, 8, 16), iters >= 1,
    eps finite >= 0. Returns a contiguous f32 tensor of comb's shape:
    `hc_sinkhorn_reference(comb, iters, eps)` (one column normalisation, then iters - 1 row and
    column rounds). Static grid, no host syncs (CUDA-graph safe).
    """
    check_hc_sinkhorn_args(comb, iters, eps)
    if triton_runs_on(comb):
        return hc_sinkhorn_triton(comb, iters, eps)
    return hc_sinkhorn_reference(comb, iters, eps).contiguous()


@hc_sinkhorn.register_fake
def _hc_sinkhorn_fake(comb, iters, eps):
    check_hc_sinkhorn_args(comb, iters, eps)
    return comb.new_empty(comb.shape)
