"""Matrix products with few rows (decode and verify tokens) against a large weight: `torch.ops.dsv4.decode_mm`.

At decode the model's projections are [M, K] @ [K, N] with M = batch x tokens (1 to 64) and a bf16
weight of 0.5 to 1,000 MB: the time is the weight's bytes. cuBLAS reached 44-78% of HBM on the
4-layer slice's projections at M = 64 on the H200 (split-K tiles plus a separate reduction kernel;
bench/RESULTS.md, ninth session). The kernel here streams the weight once: a program owns BLOCK_N
weight columns (the M side of the MMA, so that tensor-core tiles are full at any token count) and
one split of the reduction, the tokens are the MMA's N side (padded to 16), and with more than one
split the f32 partial products go to a workspace that a second kernel sums.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4_compile.kernels._runtime import triton_runs_on

DTYPES = (torch.bfloat16, torch.float16)
MAX_ROWS = 64  # the tokens are one MMA operand tile; more rows have enough output tiles for a GEMM library


# --------------------------------------------------------------------------------------------
# Torch reference (the spec)
# --------------------------------------------------------------------------------------------
def decode_mm_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] or [G, M, K], b [K, N] or [G, K, N] (same float dtype) -> a @ b accumulated in
    f32, rounded once to the inputs' dtype, contiguous."""
    return torch.matmul(a.float(), b.float()).to(a.dtype).contiguous()


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _decode_mm_kernel(a_ptr, b_ptr, out_ptr, M, N, K,
                      stride_ag, stride_am, stride_ak, stride_bg, stride_bk, stride_bn,
                      stride_og, stride_os, stride_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_STEPS: tl.constexpr,
                      EVEN_K: tl.constexpr, USE_DOT: tl.constexpr, F32_DOT: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Program (n block, split, group): out[g, split, :M, n block] = a[g, :M, split's K] @ b[g, split's K, n block],
    accumulated in f32 as [BLOCK_N, BLOCK_M] (weight columns x tokens)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    group = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_lo = split * (SPLIT_STEPS * BLOCK_K)
    a_rows = a_ptr + group * stride_ag + offs_m[None, :] * stride_am
    b_cols = b_ptr + group * stride_bg + offs_n[:, None].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # the last split may reach past K: its steps there load zeros (masked), unless EVEN_K
    for step in tl.range(0, SPLIT_STEPS, num_stages=NUM_STAGES):
        offs_k = k_lo + step * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(b_cols + offs_k[None, :] * stride_bk, mask=n_ok[:, None], other=0.0)
            x = tl.load(a_rows + offs_k[:, None] * stride_ak, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K
            w = tl.load(b_cols + offs_k[None, :] * stride_bk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(a_rows + offs_k[:, None] * stride_ak, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        if F32_DOT:
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
        elif USE_DOT:
            acc = tl.dot(w, x, acc)
        else:
            acc += tl.sum(w.to(tl.float32)[:, :, None] * x.to(tl.float32)[None, :, :], axis=1)
    out = out_ptr + group * stride_og + split * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, elements, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum_s part[s, i] for i < elements (part [G, S, M, N] f32 seen as [G, S, M*N])."""
    group = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < elements
    part = part_ptr + group * SPLITS * elements + offs
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLITS):
        total += tl.load(part + s * elements, mask=ok, other=0.0)
    tl.store(out_ptr + group * elements + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class DecodeMMConfig:
    """One launch: block_n weight columns and block_k reduction columns a step per program,
    `splits` programs along K (1: no workspace), use_dot: tensor cores (else f32 multiply-adds)."""

    block_n: int
    block_k: int
    splits: int
    num_warps: int = 4
    num_stages: int = 4
    use_dot: bool = True


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; 4 on CPU (the interpreter), so that CPU tests exercise split-K."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def pick_config(rows: int, cols: int, depth: int, groups: int, device: torch.device) -> DecodeMMConfig:
    """The launch for [rows, depth] @ [depth, cols] x `groups`: 64-column blocks, 128-deep steps,
    and enough K splits for about two programs per SM (each split at least 4 steps deep)."""
    block_n, block_k = 64, 128
    programs = groups * triton.cdiv(cols, block_n)
    max_splits = max(1, depth // (4 * block_k))
    splits = max(1, min(max_splits, triton.cdiv(2 * _sm_count(device), programs)))
    return DecodeMMConfig(block_n, block_k, splits)


def decode_mm_triton(a: torch.Tensor, b: torch.Tensor, config: DecodeMMConfig | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch on checked arguments (see `decode_mm`); `config` overrides pick_config; `out` may be
    a caller's contiguous tensor of the result's shape and dtype."""
    batched = a.dim() == 3
    a3 = a if batched else a.unsqueeze(0)
    b3 = b if batched else b.unsqueeze(0)
    groups, rows, depth = a3.shape
    cols = b3.shape[2]
    out = torch.empty(groups, rows, cols, dtype=a.dtype, device=a.device) if out is None else out.view(groups, rows, cols)
    if out.numel() == 0 or depth == 0:
        out.zero_()
        return out if batched else out[0]
    cfg = config or pick_config(rows, cols, depth, groups, a.device)
    block_m = max(16, triton.next_power_of_2(rows))
    k_per_split = triton.cdiv(triton.cdiv(depth, cfg.splits), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(depth, k_per_split)
    target = out if splits == 1 else torch.empty(groups, splits, rows, cols, dtype=torch.float32, device=a.device)
    stride_os = 0 if splits == 1 else target.stride(1)
    grid = (triton.cdiv(cols, cfg.block_n), splits, groups)
    _decode_mm_kernel[grid](
        a3, b3, target, rows, cols, depth,
        a3.stride(0), a3.stride(1), a3.stride(2), b3.stride(0), b3.stride(1), b3.stride(2),
        target.stride(0), stride_os, target.stride(-2),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_STEPS=k_per_split // cfg.block_k, EVEN_K=depth % k_per_split == 0,
        # the Triton 3.6 interpreter multiplies bf16 dot operands as raw 16-bit integers
        USE_DOT=cfg.use_dot, F32_DOT=cfg.use_dot and not a.is_cuda, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps)
    if splits > 1:
        elements = rows * cols
        block = 1024
        _sum_splits_kernel[(triton.cdiv(elements, block), groups)](target, out, elements, SPLITS=splits, BLOCK=block,
                                                                   num_warps=4)
    return out if batched else out[0]


# --------------------------------------------------------------------------------------------
# Op
# --------------------------------------------------------------------------------------------
def check_decode_mm_args(a: torch.Tensor, b: torch.Tensor) -> None:
    """ValueError / TypeError naming the argument that the op does not take."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"decode_mm: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise ValueError(f"decode_mm: {name} must be bfloat16 or float16, got {t.dtype}")
    if a.dtype != b.dtype:
        raise ValueError(f"decode_mm: a and b must have one dtype, got {a.dtype} and {b.dtype}")
    if a.dim() not in (2, 3) or b.dim() != a.dim():
        raise ValueError(f"decode_mm: a [M, K] with b [K, N], or a [G, M, K] with b [G, K, N]; "
                         f"got a {tuple(a.shape)}, b {tuple(b.shape)}")
    if a.shape[-1] != b.shape[-2] or (a.dim() == 3 and a.shape[0] != b.shape[0]):
        raise ValueError(f"decode_mm: a {tuple(a.shape)} and b {tuple(b.shape)} disagree on K or G")
    if not 1 <= a.shape[-2] <= MAX_ROWS:
        raise ValueError(f"decode_mm: a must have 1..{MAX_ROWS} rows (M), got {a.shape[-2]}")
    if a.device != b.device:
        raise ValueError(f"decode_mm: a and b must be on one device, got {a.device} and {b.device}")


@torch.library.custom_op("dsv4::decode_mm", mutates_args=())
def decode_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] (or a [G, M, K] @ b [G, K, N]), bf16 or fp16, M in 1..64, any strides.

    Returns a contiguous tensor of a's dtype: `decode_mm_reference(a, b)` (f32 accumulation, one
    rounding). Static grid and workspace sizes, no host syncs (CUDA-graph safe).
    """
    check_decode_mm_args(a, b)
    if triton_runs_on(a):
        return decode_mm_triton(a, b)
    return decode_mm_reference(a, b)


@decode_mm.register_fake
def _decode_mm_fake(a, b):
    check_decode_mm_args(a, b)
    return a.new_empty((*a.shape[:-1], b.shape[-1]))

