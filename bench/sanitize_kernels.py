"""Each dsv4 kernel once at real sizes, for `compute-sanitizer --tool memcheck` (needs CUDA).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python bench/sanitize_kernels.py

Without the caching allocator every tensor is its own allocation, so a read or write past a
tensor is outside any allocation and memcheck reports it. The cases put the edges where a
kernel could go wrong: lengths of 0, below top-k, at a page multiple and at max context; index
lists with -1 holes, out-of-range rows and whole rows of -1; expert ids of -1 and every pair on
one expert; pools of more than 2**31 elements read near their end. Each output is compared with the torch reference, so the run also checks results at
these sizes. Prints one line per case and exits non-zero on a mismatch.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time
from pathlib import Path

import torch

from bench import bench_fp4_moe, bench_indexer, bench_sparse_mla
from dsv4_compile.kernels import (fp4_moe, hc_sinkhorn, indexer_topk, moe_pairs, moe_route, rms_mm, sparse_mla,
                                  weight_stream_mm)
from dsv4_compile.kernels.moe_pairs import combine_pairs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import (LARGE_INDEX_PAGES, LARGE_POOL_ROWS, check_expert_blocks, large_indexer_inputs,  # noqa: E402
                     large_sparse_mla_inputs)

DEVICE = "cuda"
MAX_PAGES = 4097  # 262,208 c4 slots: max context 1M


def indexer_cases(gen: torch.Generator) -> None:
    """H=64, D=128, top-k 512, max context 1M; fp8 and bf16 keys; T in {1, 4}."""
    for key_dtype in (torch.float8_e4m3fn, torch.bfloat16):
        for tokens in (1, 4):
            batch = 4
            q, weights, k_cache, k_scale, page_table, _ = bench_indexer.make_inputs(
                batch, 8192, tokens, 64, 128, MAX_PAGES, torch.bfloat16, DEVICE, gen)
            # Request 3 owns the whole max context; the others are 0, < top-k and a page multiple.
            pages = k_cache.shape[0]
            extra = MAX_PAGES - (pages - 1)
            more_keys = torch.randn(extra, 64, 128, generator=gen, device=DEVICE).to(k_cache.dtype)
            k_cache = torch.cat([k_cache, more_keys])
            k_scale = torch.cat([k_scale, torch.rand(extra, 64, generator=gen, device=DEVICE) + 0.5])
            page_table[3] = torch.randperm(k_cache.shape[0], generator=gen, device=DEVICE)[:MAX_PAGES].int()
            lens = torch.tensor([0, 300, 64 * 40, MAX_PAGES * 64], device=DEVICE, dtype=torch.int32)
            lens = (lens[:, None] - (tokens - 1) + torch.arange(tokens, device=DEVICE)).clamp(min=0).int()
            if key_dtype == torch.bfloat16:
                k_cache, k_scale = (k_cache.float() * k_scale[..., None]).to(torch.bfloat16), None
            idx = indexer_topk.indexer_topk(q, weights, k_cache, k_scale, page_table, lens, 512)
            torch.cuda.synchronize()
            scale = k_scale if k_scale is not None else torch.ones(k_cache.shape[:2], device=DEVICE)
            err = bench_indexer.check_selection(idx, (q, weights, k_cache, scale, page_table, lens), 512,
                                                indexer_topk, torch.bfloat16)
            print(f"indexer keys={key_dtype} T={tokens} lens={lens[:, -1].tolist()}: ok (err {err:.2e})",
                  flush=True)


def _sparse_mla_checked(args: list) -> tuple[torch.Tensor, float]:
    """(out, max abs error) of the op on `args` against its reference (which also skips out-of-range
    rows); bf16 output of f32 softmax/accumulation: within 1 bf16 ulp of O(1) values, 2**-7 abs."""
    out = sparse_mla.sparse_mla(*args)
    torch.cuda.synchronize()
    ref = sparse_mla.sparse_mla_reference(*args)
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 2 ** -7 * max(1.0, ref.float().abs().max().item()), f"sparse_mla err {err}"
    return out, err


def sparse_mla_cases() -> None:
    """Dh=512, H=64, window 128 + CSA top-k 512 or HCA 1,024 entries; bf16 and FP8 rows; T in {1, 4};
    with -1 holes, out-of-range rows and one token with nothing selected; then an HCA list over max
    context with few valid positions (many splits), and B=64 (the wide-grid tiles of both row formats)."""
    for layer, extra_len in (("csa", 512), ("hca", 1024)):
        for fmt in ("bf16", "fp8"):
            for tokens in (1, 4):
                case = bench_sparse_mla.Case("sanitize", 2, tokens, 64, layer, fmt, extra_len)
                args = list(bench_sparse_mla.make_inputs(case, DEVICE))
                idx, eidx = args[3].clone(), args[6].clone()
                idx[0, :, ::7] = -1
                eidx[0, :, ::5] = -1
                eidx[1, 0, :3] = args[4].shape[0] + 17  # out of range: treated as skipped
                idx[1, -1] = -1
                eidx[1, -1] = -1  # this token selects nothing -> zeros
                args[3], args[6] = idx, eidx
                out, err = _sparse_mla_checked(args)
                assert bool((out[1, -1] == 0).all()), "a token with nothing selected must give zeros"
                print(f"sparse_mla {layer} {fmt} T={tokens}: ok (max abs err {err:.2e})", flush=True)
    # HCA over max context at a short real length (B=1): 8,192 c128 positions, the last 7,168 of them
    # -1, so the split-K pass has many splits (66 at T=1, 17 at T=4 on the H200) and the combine
    # skips the empty splits' partial rows.
    for tokens in (1, 4):
        case = bench_sparse_mla.Case("sanitize", 1, tokens, 64, "hca", "bf16", 1024)
        args = list(bench_sparse_mla.make_inputs(case, DEVICE))
        args[6] = torch.cat([args[6], torch.full((1, tokens, 7168), -1, dtype=torch.int32, device=DEVICE)], dim=2)
        _, err = _sparse_mla_checked(args)
        print(f"sparse_mla hca bf16 B=1 T={tokens} over 8,192 positions: ok (max abs err {err:.2e})", flush=True)
    # Grids wider than one wave at 16 heads a program (B=64): the "bf16_wide" tiles (T=4); FP8 rows
    # staged into bf16 rows (CSA T=1 and 4, with split-K at T=1; HCA T=4 in two chunks of
    # STAGE_MAX_BYTES; H=32; B=2 over an HCA list of max context 1M, 8,192 c128 positions); FP8 rows'
    # own tiles where they are not staged: the "fp8_wide" tile over such a list at B=64 (beyond
    # STAGE_MAX_POSITIONS and STAGE_LONG_MAX_TOKENS), the "fp8" tile at 16 heads (split in 4), each on 4
    # warps where two share an SM, and at B=1 on 8 warps; with holes.
    for fmt, batch, tokens, heads, layer, pad in (("bf16", 64, 4, 64, "csa", 0), ("fp8", 64, 1, 64, "csa", 0),
                                                  ("fp8", 64, 4, 64, "csa", 0), ("fp8", 64, 4, 64, "hca", 0),
                                                  ("fp8", 64, 1, 32, "csa", 0), ("fp8", 2, 1, 64, "hca", 7168),
                                                  ("fp8", 64, 1, 64, "hca", 7168), ("fp8", 64, 1, 16, "csa", 0),
                                                  ("fp8", 1, 1, 16, "csa", 0)):
        case = bench_sparse_mla.Case("sanitize", batch, tokens, heads, layer, fmt, 512 if layer == "csa" else 1024)
        args = list(bench_sparse_mla.make_inputs(case, DEVICE))
        args[3], args[6] = args[3].clone(), args[6].clone()
        args[3][::3, :, ::7] = -1
        args[6][::2, :, ::5] = -1
        if pad:
            args[6] = torch.cat([args[6], torch.full((batch, tokens, pad), -1, dtype=torch.int32, device=DEVICE)], dim=2)
        _, err = _sparse_mla_checked(args)
        print(f"sparse_mla {layer} {fmt} B={batch} T={tokens} H={heads} list {args[6].shape[2]}: ok "
              f"(max abs err {err:.2e})", flush=True)


# Forced configs besides the op's default launch: the GEMV loop that loads one K step ahead (its last
# step's masked loads point past the last expert's rows: every pair on expert 255 at M=64, where
# memcheck sees a missing mask), and the mma path with its cp.async-pipelined weight and scale-word
# loads, in wgmma (BLOCK_M 16) and mma.sync (BLOCK_M 8) operand order, the one-step register loop at
# every M, and the two-steps-a-turn loop with 256-column steps (masked loads past the last K step, as
# the GEMV one; the defaults run it with 128-column steps); a down kernel with a shape of its own; and the
# scale words by inline-asm loads on a shape the default (32 rows, which has them) does not run.
FORCED_CONFIGS = {
    "prefetch": fp4_moe.TileConfig("gemv", 1, 16, 512, num_warps=4, prefetch=True),
    "mma16": fp4_moe.TileConfig("mma", 16, 128, 128, num_warps=4, num_stages=3),
    "mma_staged": fp4_moe.TileConfig("mma", 8, 16, 512, num_warps=1, num_stages=2),
    "mma_plain": fp4_moe.TileConfig("mma", 8, 32, 256, num_warps=1, num_stages=1),
    "mma_prefetch": fp4_moe.TileConfig("mma", 8, 16, 256, num_warps=1, num_stages=1, prefetch=True),
    "mma_down_shape": fp4_moe.TileConfig("mma", 8, 16, 128, num_warps=1, num_stages=1, prefetch=True,
                                         down_block_n=64, down_num_warps=2),
    "mma_scale_asm": fp4_moe.TileConfig("mma", 8, 16, 256, num_warps=1, num_stages=1, prefetch=True,
                                        down_block_n=64, down_num_warps=2, scale_asm=True),
    # split-K gate/up (f32 partial sums over 8 K ranges, finished by the SwiGLU kernel; the default
    # for one token's choices splits in 2)
    "mma_split": fp4_moe.TileConfig("mma", 8, 16, 128, num_warps=1, num_stages=1, prefetch=True,
                                    down_block_n=128, down_num_warps=4, k_splits=8),
    # one block a pair, read from the ids (-1 ids, and at M=64 every pair on one expert)
    "mma_direct": fp4_moe.TileConfig("mma", 8, 16, 128, num_warps=1, num_stages=1, prefetch=True, k_splits=2,
                                     direct_blocks=True),
    # the down kernel waiting on per-block ready counts instead of the whole gate/up grid, for both
    # formats (the defaults take them for MXFP4 only): the 32-row class and the 16-column class (M=8, 64)
    "mma_ready": dataclasses.replace(fp4_moe.DEFAULT_CONFIGS["mma"], ready_counts=True),
    "mma_small_ready": dataclasses.replace(fp4_moe.DEFAULT_CONFIGS["mma_small"], ready_counts=True),
    # the same, spinning on volatile loads with one acquire (TileConfig.relaxed_spin)
    "mma_ready_relaxed": dataclasses.replace(fp4_moe.DEFAULT_CONFIGS["mma"], ready_counts=True, relaxed_spin=True),
    "mma_small_ready_relaxed": dataclasses.replace(fp4_moe.DEFAULT_CONFIGS["mma_small"], ready_counts=True,
                                                   relaxed_spin=True),
}
# On the tiled experts optimize() gives the model (dsv4_compile.fp4_tiles): the default launch and one
# config of each path (the dot path's prefill tile among them), whose loads all address tiles.
TILED_FORCED = ("prefetch", "mma_prefetch", "mma_down_shape", "mma_scale_asm", "mma_split", "mma_direct", "mma_ready",
                "mma_small_ready", "mma_ready_relaxed", "mma_small_ready_relaxed", "dot64")


def fp4_moe_cases(gen: torch.Generator, configs: set[str] | None = None) -> None:
    """V4-Flash experts (E=256, K=4096, I=2048), top-6, both formats; M in {1, 64, 256};
    -1 ids and, at M=64, every pair on one expert. Each case runs the op (its default launch)
    and each of FORCED_CONFIGS, on row-major experts, and TILED_FORCED on tiled ones; `configs`
    keeps only those names of FORCED_CONFIGS and TILED_FORCED (the default launches always run)."""
    forced = {n: c for n, c in FORCED_CONFIGS.items() if configs is None or n in configs}
    tiled_forced = [n for n in TILED_FORCED if configs is None or n in configs]
    for fmt in ("mxfp4", "nvfp4"):
        weights = bench_fp4_moe.random_experts(fmt, 256, 4096, 2048, DEVICE, gen)
        tiled = bench_fp4_moe.tiled_experts(weights)
        for tokens in (1, 64, 256):
            x = torch.randn(tokens, 4096, device=DEVICE, generator=gen).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(256, generator=gen, device=DEVICE)[:6] for _ in range(tokens)]).int()
            if tokens == 64:
                ids[:] = 255
                ids[:, 1:] = -1
            ids[0, -1] = -1
            topk_weights = torch.rand(tokens, 6, device=DEVICE, generator=gen)
            args = bench_fp4_moe.op_args(x, ids, topk_weights, weights)
            ref = fp4_moe.fp4_moe_reference(*args)
            scale = ref.float().abs().max().item()
            outs = {"default": fp4_moe.fp4_moe(*args)}
            for name, config in forced.items():
                pairs = fp4_moe.fp4_moe_pairs_triton(*args, config=config)
                outs[name] = combine_pairs(pairs, ids, 256, x.dtype)
            tiled_args = bench_fp4_moe.op_args(x, ids, topk_weights, tiled)
            outs["tiled default"] = fp4_moe.fp4_moe(*tiled_args)
            if tokens == 256:
                # The routing that fills expert_blocks' whole table (moe_pairs.block_bound): 255 experts
                # with one pair each, expert 255 with the rest.
                full = torch.cat([torch.arange(255, device=DEVICE), torch.full((tokens * 6 - 255,), 255, device=DEVICE)])
                full_args = bench_fp4_moe.op_args(x, full.view(tokens, 6).int(), topk_weights, tiled)
                full_ref = fp4_moe.fp4_moe_reference(*full_args)
                full_err = (fp4_moe.fp4_moe(*full_args).float() - full_ref.float()).abs().max().item()
                full_scale = full_ref.float().abs().max().item()
                assert full_err <= 2 ** -7 * max(full_scale, 1.0), f"fp4_moe {fmt} full block table err {full_err}"
                print(f"fp4_moe {fmt} M={tokens} tiled default, full block table: ok (max abs err {full_err:.2e})",
                      flush=True)
            for name in tiled_forced:
                config = FORCED_CONFIGS.get(name) or fp4_moe.DEFAULT_CONFIGS[name]
                pairs = fp4_moe.fp4_moe_pairs_triton(*tiled_args, config=config)
                outs[f"tiled {name}"] = combine_pairs(pairs, ids, 256, x.dtype)
            for name, out in outs.items():
                torch.cuda.synchronize()
                # bf16 output of an f32-accumulated K=4096/I=2048 product: 2**-7 of the output scale.
                err = (out.float() - ref.float()).abs().max().item()
                assert err <= 2 ** -7 * max(scale, 1.0), f"fp4_moe {fmt} M={tokens} {name} err {err} (scale {scale})"
                print(f"fp4_moe {fmt} M={tokens} {name}: ok (max abs err {err:.2e}, output scale {scale:.2f})",
                      flush=True)
        del weights, tiled


def large_pool_cases(gen: torch.Generator) -> None:
    """Pools of more than 2**31 elements, read near their end (where an int32 offset wraps):
    indexer keys of 262,400 fp8 pages and a sparse-MLA extra pool of 4.3M bf16 rows of 512."""
    args = large_indexer_inputs(64, DEVICE, gen)
    idx = indexer_topk.indexer_topk(*args, 512)
    torch.cuda.synchronize()
    err = bench_indexer.check_selection(idx, args, 512, indexer_topk, torch.bfloat16)
    print(f"indexer, {LARGE_INDEX_PAGES} pages (2**31 + elements), last pages: ok (err {err:.2e})", flush=True)
    del args, idx

    args = large_sparse_mla_inputs(64, DEVICE, gen)
    out = sparse_mla.sparse_mla(*args)
    torch.cuda.synchronize()
    ref = sparse_mla.sparse_mla_reference(*args)
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 2 ** -7 * max(1.0, ref.float().abs().max().item()), f"sparse_mla large pool err {err}"
    print(f"sparse_mla, extra pool of {LARGE_POOL_ROWS} rows (2**31 + elements), last rows: ok "
          f"(max abs err {err:.2e})", flush=True)


def hc_sinkhorn_cases(gen: torch.Generator) -> None:
    """The mHC comb matrices (4 x 4, 20 rounds) of 1, 64 and 257 tokens, and 16 x 16 ones."""
    for matrices, n in ((1, 4), (64, 4), (257, 4), (5, 16)):
        comb = torch.softmax(torch.randn(matrices, n, n, device=DEVICE, generator=gen), dim=-1) + 1e-6
        out = hc_sinkhorn.hc_sinkhorn(comb, 20, 1e-6)
        torch.cuda.synchronize()
        # f32 throughout, correctly rounded divisions: a few ulp of values below 1.
        err = (out - hc_sinkhorn.hc_sinkhorn_reference(comb, 20, 1e-6)).abs().max().item()
        assert err <= 1e-6, f"hc_sinkhorn err {err}"
        print(f"hc_sinkhorn {matrices} x {n}x{n}: ok (max abs err {err:.2e})", flush=True)


def weight_stream_mm_cases(gen: torch.Generator) -> None:
    """V4-Flash's LM head (129,280 x 4,096 bf16) at 1, 17 and 64 rows, and a weight whose size ends
    in partial blocks (N = 1,000, K = 1,000) seen through a row stride of 1,024."""
    for rows, columns, depth, stride in ((1, 129280, 4096, 4096), (17, 129280, 4096, 4096), (64, 129280, 4096, 4096),
                                         (64, 1000, 1000, 1024)):
        weight = (torch.randn(columns, stride, device=DEVICE, generator=gen) * depth ** -0.5).to(torch.bfloat16)
        weight = weight[:, :depth]
        x = torch.randn(rows, depth, device=DEVICE, generator=gen).to(torch.bfloat16)
        out = weight_stream_mm.weight_stream_mm(x, weight)
        torch.cuda.synchronize()
        ref = weight_stream_mm.weight_stream_mm_reference(x, weight)
        # f32 sums in another order, each rounded once to bf16: at most about one bf16 ulp apart
        err = ((out.float() - ref.float()).abs() / ref.float().abs().clamp(min=1.0)).max().item()
        assert err <= 2 ** -7, f"weight_stream_mm err {err}"
        print(f"weight_stream_mm [{rows}, {depth}] @ [{columns}, {depth}]^T (row stride {stride}): ok "
              f"(max rel err {err:.2e})", flush=True)


def moe_route_cases(gen: torch.Generator) -> None:
    """The top-k router's selection over V4-Flash's 256 experts, top-6, bf16 scores and an f32 bias,
    at 1, 64 and 257 tokens, with a row of NaN scores (still 6 distinct experts in range)."""
    for rows in (1, 64, 257):
        scores = torch.rand(rows, 256, device=DEVICE, generator=gen).to(torch.bfloat16)
        scores[-1] = float("nan")
        bias = torch.randn(256, device=DEVICE, generator=gen) * 0.1
        weights, ids = moe_route.route_topk(scores, bias, 6, 1e-20, 1.5)
        torch.cuda.synchronize()
        assert bool(((ids >= 0) & (ids < 256)).all()) and all(row.unique().numel() == 6 for row in ids)
        if rows > 1:
            want = moe_route.route_topk_reference(scores[:-1], bias, 6, 1e-20, 1.5)[1]
            select = scores[:-1].float() + bias
            got_sel = select.gather(1, ids[:-1]).sort(dim=-1).values
            assert torch.equal(got_sel, select.gather(1, want).sort(dim=-1).values), "route_topk selection"
        print(f"route_topk {rows} x 256, top-6: ok", flush=True)


def moe_pairs_cases(gen: torch.Generator) -> None:
    """expert_blocks over 256 experts at 6, 384 and 1,536 pairs (one program) and 2,400 (two launches),
    with ids -1 and 256 mixed in, and with every pair on one expert; checked against the contract
    (tests/helpers.py: the order by expert and the whole block table)."""
    for pairs in (6, 384, 1536, 2400):
        for skew in (False, True):
            ids = torch.randint(-1, 257, (pairs,), device=DEVICE, generator=gen).int()
            if skew:
                ids[:] = 7
            for block_m in (1, 16):
                blocks = moe_pairs.expert_blocks(ids.view(-1, 1), 256, block_m)
                torch.cuda.synchronize()
                check_expert_blocks(ids.tolist(), 256, block_m, *(t.cpu() for t in blocks))
                print(f"expert_blocks {pairs} pairs, block_m {block_m}{', one expert' if skew else ''}: ok", flush=True)


def rms_mm_cases(gen: torch.Generator) -> None:
    """dsv4::mm_sumsq at the mHC projections: [1 | 64, 16384] bf16 rows against [24 | 4, 16384] f32 (128
    slices), and a reduction of 1,000 (a short last slice) over rows with a stride of 2,048."""
    for rows, columns, depth, stride in ((1, 24, 16384, 16384), (64, 24, 16384, 16384), (64, 4, 16384, 16384),
                                         (17, 24, 1000, 2048)):
        x = torch.randn(rows, stride, device=DEVICE, generator=gen).to(torch.bfloat16)[:, :depth]
        weight = torch.randn(columns, depth, device=DEVICE, generator=gen) * depth ** -0.5
        prod, sumsq = rms_mm.mm_sumsq(x, weight)
        torch.cuda.synchronize()
        want_prod, want_sumsq = rms_mm.mm_sumsq_reference(x, weight)
        abs_prod, abs_sq = rms_mm.mm_sumsq_reference(x.float().abs(), weight.abs())
        # 3xTF32 products and f32 sums in another order: within 1e-5 of the sum of |terms|
        err = max(((prod - want_prod).abs() / abs_prod.clamp(min=1e-30)).max().item(),
                  ((sumsq - want_sumsq).abs() / abs_sq.clamp(min=1e-30)).max().item())
        assert err <= 1e-5, f"mm_sumsq err {err}"
        print(f"mm_sumsq [{rows}, {depth}] (row stride {stride}) x [{columns}, {depth}]: ok "
              f"(max err / sum of |terms| {err:.2e})", flush=True)


CASES = {"indexer": indexer_cases, "moe_pairs": moe_pairs_cases, "sparse_mla": lambda gen: sparse_mla_cases(),
         "fp4_moe": fp4_moe_cases, "large_pools": large_pool_cases, "hc_sinkhorn": hc_sinkhorn_cases,
         "weight_stream_mm": weight_stream_mm_cases, "moe_route": moe_route_cases,
         "rms_mm": rms_mm_cases}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CASES),
                        help=f"comma list of case groups to run (default all: {','.join(CASES)})")
    parser.add_argument("--fp4-configs", default=None,
                        help=f"comma list: fp4_moe runs only these forced configs beside its default launches "
                             f"(default all: {','.join(FORCED_CONFIGS)}, dot64)")
    args = parser.parse_args()
    groups = [g.strip() for g in args.only.split(",") if g.strip()]
    unknown = set(groups) - set(CASES)
    if unknown:
        parser.error(f"--only takes {sorted(CASES)}; got {sorted(unknown)}")
    fp4_configs = None if args.fp4_configs is None else {c.strip() for c in args.fp4_configs.split(",") if c.strip()}
    if fp4_configs is not None and fp4_configs - set(FORCED_CONFIGS) - set(TILED_FORCED):
        parser.error(f"--fp4-configs takes {sorted(set(FORCED_CONFIGS) | set(TILED_FORCED))}; "
                     f"got {sorted(fp4_configs - set(FORCED_CONFIGS) - set(TILED_FORCED))}")
    cases = {**CASES, "fp4_moe": functools.partial(fp4_moe_cases, configs=fp4_configs)}
    started = time.monotonic()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for group in groups:
        cases[group](gen)
    print(f"all kernels ran in {math.ceil(time.monotonic() - started)} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
