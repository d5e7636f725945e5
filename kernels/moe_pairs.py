"""Grouping the (token, choice) pairs of a routed MoE by expert, and combining their outputs.

`expert_blocks` cuts the M*k pairs into per-expert blocks for the expert kernels of
kernels/fp4_moe.py; `combine_pairs` (torch, the spec) and `combine_pairs_triton` sum each token's
per-pair outputs. Both run on static shapes without host syncs (capture-safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._runtime import pdl_launch, release_dependents, uses_pdl, wait_for_producers

# expert_blocks without a torch.sort and some 30 small torch kernels. Up to ONE_PROGRAM_PAIRS pairs
# (every decode and verify batch of V4-Flash at k=6) one program does it all (`_group_pairs_kernel`);
# past that, two launches plus zeroed counts: `_count_pairs_kernel` counts the pairs per expert with
# atomics, whose returned old counts are each pair's rank within its expert; `_place_pairs_kernel`
# scans the counts in every program (E + 1 values) and writes each pair's row and the block table.
# Either way the order within an expert is the atomics' order; no kernel depends on it (each pair's
# output is its own column or row of every product, with the same reduction order wherever it sits).
# H200, E=256, in CUDA graphs (bench/RESULTS.md "Twentieth session"): one program 4.4 us a call at
# 384 pairs, 7.7 at 1,536, 3.5 at 96, against 8.3-9.8 us for the two launches and the zeroing.
ONE_PROGRAM_PAIRS = 2048
ONE_PROGRAM_WARPS = 4
GROUP_PAIRS = 32  # pairs (and blocks) per program of the two-launch path
# H200, E=256 (E_PAD 512), in a CUDA graph: 4 warps 5.5-6.7 us a launch, 8 warps 7.4-8.0, 2 warps
# 9.9-10.6; 64 pairs a program 11.5-36.7 (bench/RESULTS.md "Seventh session").
PLACE_WARPS = 4


@triton.jit
def _bucket(ids, E):
    """Expert ids -> buckets: ids outside [0, E) (other ranks) go to bucket E, past every expert."""
    return tl.where((ids >= 0) & (ids < E), ids, E)


@triton.jit
def _count_pairs_kernel(ids_ptr, counts_ptr, rank_ptr, P, E, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < P
    bucket = _bucket(tl.load(ids_ptr + offs, mask=live, other=-1), E)
    rank = tl.atomic_add(counts_ptr + bucket, 1, mask=live, sem="relaxed")
    tl.store(rank_ptr + offs, rank, mask=live)


@triton.jit
def _place_pairs_kernel(ids_ptr, counts_ptr, rank_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr,
                        P, NB, E, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + e, mask=e <= E, other=0)
    row_start = tl.cumsum(counts, 0) - counts
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < P
    bucket = _bucket(tl.load(ids_ptr + offs, mask=live, other=-1), E)
    rank = tl.load(rank_ptr + offs, mask=live, other=0)
    first_row = tl.sum(tl.where(bucket[:, None] == e[None, :], row_start[None, :], 0), axis=1)
    tl.store(order_ptr + first_row + rank, offs, mask=live)
    # Blocks: expert e owns blocks [block_end[e] - blocks[e], block_end[e]); past the last one, E.
    blocks = tl.where(e < E, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    block_end = tl.cumsum(blocks, 0)
    block = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.sum(((block_end[None, :] <= block[:, None]) & (e[None, :] < E)).to(tl.int32), axis=1)
    own = e[None, :] == expert[:, None]
    first_block = tl.sum(tl.where(own, block_end - blocks, 0), axis=1)
    start = tl.sum(tl.where(own, row_start, 0), axis=1)
    count = tl.sum(tl.where(own, counts, 0), axis=1)
    real = expert < E
    in_range = block < NB
    tl.store(block_expert_ptr + block, expert, mask=in_range)
    tl.store(block_start_ptr + block, tl.where(real, start + (block - first_block) * BLOCK_M, 0), mask=in_range)
    tl.store(block_end_ptr + block, tl.where(real, start + count, 0), mask=in_range)


@triton.jit
def _group_pairs_kernel(ids_ptr, scratch_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_end_ptr,
                        ready_ptr, P, NB, E, BLOCK_M: tl.constexpr, P_PAD: tl.constexpr, E_PAD: tl.constexpr,
                        NB_CHUNK: tl.constexpr, RELEASE: tl.constexpr, HAS_READY: tl.constexpr):
    """expert_blocks in one program: counts by histogram, ranks by atomics on a scratch the program
    zeroes itself, each expert's first row through the scratch, blocks scattered per expert; with
    HAS_READY, ready [NB] zeroed too."""
    release_dependents(RELEASE)  # the expert kernels' programs may take their SM slots meanwhile
    e = tl.arange(0, E_PAD)
    tl.store(scratch_ptr + e, 0)
    offs = tl.arange(0, P_PAD)
    live = offs < P
    bucket = _bucket(tl.load(ids_ptr + offs, mask=live, other=-1), E).to(tl.int32)  # <= E: int64 ids too
    tl.debug_barrier()  # the zeroed counts before any atomic
    rank = tl.atomic_add(scratch_ptr + bucket, 1, mask=live, sem="relaxed", scope="cta")
    counts = tl.histogram(bucket, E_PAD, mask=live)
    row_start = tl.cumsum(counts, 0) - counts
    tl.store(scratch_ptr + E_PAD + e, row_start)
    tl.debug_barrier()  # each expert's first row, read back by the pairs
    first_row = tl.load(scratch_ptr + E_PAD + bucket, mask=live, other=0)
    tl.store(order_ptr + first_row + rank, offs, mask=live)
    # Expert e owns blocks [first_block[e], first_block[e] + blocks[e]): written expert-parallel, one
    # block of every expert at a time (an expert has at most cdiv(P, BLOCK_M) blocks).
    blocks = tl.where(e < E, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    first_block = tl.cumsum(blocks, 0) - blocks
    row_end = row_start + counts
    most = tl.max(blocks, 0)
    j = 0
    while j < most:  # while loops: the interpreter cannot range() over its scalars
        has = j < blocks
        tl.store(block_expert_ptr + first_block + j, e, mask=has)
        tl.store(block_start_ptr + first_block + j, row_start + j * BLOCK_M, mask=has)
        tl.store(block_end_ptr + first_block + j, row_end, mask=has)
        j += 1
    used = tl.sum(blocks, 0)
    b0 = used
    while b0 < NB:  # the surplus blocks past the last expert's: expert E, rows [0, 0)
        blk = b0 + tl.arange(0, NB_CHUNK)
        spare = blk < NB
        tl.store(block_expert_ptr + blk, tl.full([NB_CHUNK], 0, tl.int32) + E, mask=spare)
        tl.store(block_start_ptr + blk, tl.zeros([NB_CHUNK], tl.int32), mask=spare)
        tl.store(block_end_ptr + blk, tl.zeros([NB_CHUNK], tl.int32), mask=spare)
        b0 += NB_CHUNK
    if HAS_READY:
        b0 = 0
        while b0 < NB:
            blk = b0 + tl.arange(0, NB_CHUNK)
            tl.store(ready_ptr + blk, tl.zeros([NB_CHUNK], tl.int32), mask=blk < NB)
            b0 += NB_CHUNK


def block_bound(pairs: int, experts: int, block_m: int) -> int:
    """The most blocks of `block_m` rows that `pairs` (token, choice) pairs over `experts` experts can
    fill: n experts with pairs make sum_e cdiv(c_e, block_m) <= n + floor((pairs - n) / block_m), which
    grows with n, so n = min(E, pairs) bounds it; reached when all but one of those experts get one pair.
    The static size of expert_blocks' table and of the expert kernels' grids."""
    busy = min(experts, pairs)
    return busy + (pairs - busy) // block_m


def expert_blocks(topk_ids: torch.Tensor, experts: int, block_m: int,
                  ready: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, choice) pairs by expert into blocks of `block_m` rows, on device, without host
    syncs or a sort.

    topk_ids [M, k] int32 -> (order [M*k] int32: the pair indices grouped by expert in ascending expert
    order, in no particular order within an expert (see above),
    block_expert / block_start / block_end [NB] int32: each block's expert (E = empty block, its start
    and end 0) and its row range in `order`), NB = block_bound(M*k, E, block_m). Ids outside
    [0, E) are grouped past every expert and never read. `ready` [NB] int32, if given, is zeroed on the
    device before the table is used (the expert kernels' ready counts, kernels/fp4_moe.py).
    """
    ids = topk_ids.reshape(-1).contiguous()
    pairs = ids.numel()
    device = ids.device
    num_blocks = block_bound(pairs, experts, block_m)
    order = torch.empty(pairs, dtype=torch.int32, device=device)
    block_expert, block_start, block_end = (torch.empty(num_blocks, dtype=torch.int32, device=device)
                                            for _ in range(3))
    if ready is not None and (ready.shape != (num_blocks,) or ready.dtype != torch.int32):
        raise ValueError(f"expert_blocks: ready must be an int32 tensor of shape ({num_blocks},), "
                         f"got {ready.dtype} {tuple(ready.shape)}")
    if pairs == 0:
        return order, block_expert, block_start, block_end
    if pairs <= ONE_PROGRAM_PAIRS:
        e_pad = triton.next_power_of_2(experts + 1)
        scratch = torch.empty(2 * e_pad, dtype=torch.int32, device=device)
        _group_pairs_kernel[(1,)](ids, scratch, order, block_expert, block_start, block_end,
                                  order if ready is None else ready, pairs, num_blocks,
                                  experts, BLOCK_M=block_m, P_PAD=triton.next_power_of_2(pairs), E_PAD=e_pad,
                                  NB_CHUNK=min(1024, triton.next_power_of_2(max(num_blocks, 1))),
                                  RELEASE=uses_pdl(ids), HAS_READY=ready is not None, num_warps=ONE_PROGRAM_WARPS)
        return order, block_expert, block_start, block_end
    if ready is not None:
        ready.zero_()
    counts = torch.zeros(experts + 1, dtype=torch.int32, device=device)
    rank = torch.empty(pairs, dtype=torch.int32, device=device)
    _count_pairs_kernel[(triton.cdiv(pairs, GROUP_PAIRS),)](ids, counts, rank, pairs, experts, BLOCK=GROUP_PAIRS)
    _place_pairs_kernel[(triton.cdiv(max(pairs, num_blocks), GROUP_PAIRS),)](
        ids, counts, rank, order, block_expert, block_start, block_end, pairs, num_blocks, experts,
        BLOCK_M=block_m, E_PAD=triton.next_power_of_2(experts + 1), BLOCK=GROUP_PAIRS, num_warps=PLACE_WARPS,
    )
    return order, block_expert, block_start, block_end


def combine_pairs(pair_out: torch.Tensor, topk_ids: torch.Tensor, experts: int, dtype: torch.dtype) -> torch.Tensor:
    """pair_out [M*k, K] f32 (rows of skipped pairs unwritten) -> out [M, K] of `dtype`."""
    tokens, top_k = topk_ids.shape
    valid = ((topk_ids >= 0) & (topk_ids < experts)).unsqueeze(-1)
    per_pair = pair_out.view(tokens, top_k, pair_out.shape[1])
    return torch.where(valid, per_pair, 0.0).sum(dim=1).to(dtype)


@triton.jit
def _combine_pairs_kernel(pair_ptr, ids_ptr, out_ptr, E, K, stride_p, stride_o,
                          TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < K
    total = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(TOP_K):  # in choice order, as combine_pairs sums
        expert = tl.load(ids_ptr + m * TOP_K + j)
        valid = (expert >= 0) & (expert < E)
        total += tl.load(pair_ptr + (m * TOP_K + j) * stride_p + cols, mask=col_ok & valid, other=0.0)
    tl.store(out_ptr + m * stride_o + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


COMBINE_BLOCK = 1024


def combine_pairs_triton(pair_out: torch.Tensor, topk_ids: torch.Tensor, experts: int, dtype: torch.dtype,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """`combine_pairs` in one Triton launch: pair_out [M*k, K] f32 (unit column stride), topk_ids
    [M, k] integer -> [M, K] of `dtype`; rows of skipped pairs are never read. `out` may be passed
    pre-poisoned (tests): a contiguous [M, K] tensor of `dtype`, returned."""
    integer = not (topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool)
    if topk_ids.ndim != 2 or not integer:
        raise TypeError(f"combine_pairs_triton: topk_ids must be a 2-D integer tensor [M, k], "
                        f"got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"combine_pairs_triton: dtype must be float32, bfloat16 or float16, got {dtype}")
    if topk_ids.device != pair_out.device or (out is not None and out.device != pair_out.device):
        raise ValueError(f"combine_pairs_triton: topk_ids and out must be on pair_out's device {pair_out.device}")
    tokens, top_k = topk_ids.shape
    if pair_out.dtype != torch.float32 or pair_out.ndim != 2:
        raise TypeError(f"combine_pairs_triton: pair_out must be a 2-D float32 tensor [M*k, K], "
                        f"got {pair_out.dtype} {tuple(pair_out.shape)}")
    if pair_out.shape[0] != tokens * top_k or (pair_out.shape[1] > 1 and pair_out.stride(1) != 1):
        raise ValueError(f"combine_pairs_triton: pair_out must be [M*k, K] = [{tokens * top_k}, K] with unit "
                         f"column stride, got shape {tuple(pair_out.shape)}, strides {pair_out.stride()}")
    hidden = pair_out.shape[1]
    if out is None:
        out = torch.empty(tokens, hidden, dtype=dtype, device=pair_out.device)
    elif out.shape != (tokens, hidden) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"combine_pairs_triton: out must be a contiguous [{tokens}, {hidden}] {dtype} tensor, "
                         f"got {out.dtype} {tuple(out.shape)}")
    if tokens == 0 or hidden == 0:
        return out
    block = min(COMBINE_BLOCK, triton.next_power_of_2(hidden))
    _combine_pairs_kernel[(tokens, triton.cdiv(hidden, block))](
        pair_out, topk_ids.contiguous(), out, experts, hidden, pair_out.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK=block, num_warps=4, **pdl_launch(pair_out, release=False))
    return out
