"""Benchmark of dsv4::indexer_topk (length-bounded) against the full-context indexer.

Run on the H200: `python bench/bench_indexer.py --out DIR` (about 2-3 minutes).
Check the script on CPU: `TRITON_INTERPRET=1 python bench/bench_indexer.py --smoke --out DIR`.
`--sweep` times the op's launch variants (SELECT_CONFIGS: selection chunk, warps and split
block, scoring register cap) instead, at B=64, contexts 512/128K, T=1/4, fp8;
`--sweep-score` the scoring kernel's launch variants (SCORE_CONFIGS) at B=64, 128K, fp8.

For each batch B, real context (tokens) and query tokens T, at max context 1M (4097 pages of 64
compressed slots), H=64 index heads, D=128, fp8 e4m3 keys with f32 scales:
  1. correctness first: the Triton op's selected scores against the torch reference's top-k;
  2. times (median of triton.testing.do_bench, L2 flushed between runs) of the eager
     full-context form (gather every page, score, mask, topk), torch.compile of it, and the
     Triton kernels (validation-free launcher: the op adds one host sync for its value checks);
  3. the byte floor (keys of the real length read once per request + q + weights + idx,
     / 4.8e12 B/s) and the FLOP floor (2*B*T*H*D*len / 7.9e14 FLOP/s) and the fraction reached;
  4. the shared memory of every compiled Triton config, asserted <= 101,376 B (sm_120);
  5. JSON + markdown into --out, the table printed last.
The full-context baselines do not depend on the real length, so they run once per (B, T).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

PAGE = 64
SMEM_LIMIT = 101_376
BYTES_PER_S = 4.8e12
FLOPS_PER_S = 7.9e14


def full_context_indexer(q, weights, k_cache, k_scale, page_table, lens, topk):
    """The O(max context) form: score every page-table column, mask by length, top-k."""
    batch, _, _, head_dim = q.shape
    pages = page_table.long()
    keys = k_cache[pages].float().reshape(batch, -1, head_dim)  # [B, S_max, D]
    logits = torch.matmul(q.float(), keys.transpose(-1, -2).unsqueeze(1))  # [B, T, H, S]
    scores = (torch.relu(logits) * weights.unsqueeze(-1)).sum(dim=2)
    scores = scores * k_scale[pages].reshape(batch, 1, -1)
    slots = torch.arange(scores.shape[-1], device=q.device)
    scores = scores.masked_fill(slots >= lens.unsqueeze(-1), float("-inf"))
    top = scores.topk(topk, dim=-1).indices
    return torch.where(top >= lens.unsqueeze(-1), -1, top).to(torch.int32)


def make_inputs(batch, context, tokens, heads, dim, max_pages, q_dtype, device, gen):
    """Random inputs: each request's valid pages are scattered physical pages; page-table
    columns past them point at other real pages (the full-context form reads them)."""
    slots = context // 4
    valid_pages = max(1, math.ceil(slots / PAGE))
    phys_pages = batch * valid_pages
    q = torch.randn(batch, tokens, heads, dim, generator=gen, device=device).to(q_dtype)
    weights = torch.randn(batch, tokens, heads, generator=gen, device=device) * heads ** -0.5
    k_cache = torch.randn(phys_pages, PAGE, dim, generator=gen, device=device)
    k_cache = k_cache.to(torch.float8_e4m3fn)
    k_scale = torch.rand(phys_pages, PAGE, generator=gen, device=device) + 0.5
    perm = torch.randperm(phys_pages, generator=gen, device=device).view(batch, valid_pages)
    page_table = torch.randint(0, phys_pages, (batch, max_pages), generator=gen, device=device)
    page_table[:, :valid_pages] = perm
    positions = context - tokens + torch.arange(tokens, device=device)
    lens = ((positions + 1) // 4).clamp(max=max_pages * PAGE).expand(batch, tokens)
    return (q, weights, k_cache, k_scale, page_table.to(torch.int32).contiguous(),
            lens.to(torch.int32).contiguous())


def reference_scores(inputs, ref_mod):
    """The torch reference's scores [B, T, S] over the valid pages (-inf past lens)."""
    q, weights, k_cache, k_scale, page_table, lens = inputs
    used = max(1, math.ceil(int(lens.max()) / PAGE))
    return ref_mod.indexer_scores_reference(q, weights, k_cache, k_scale,
                                            page_table[:, :used], lens)


def check_selection(idx, inputs, topk, ref_mod, q_dtype, scores=None):
    """Selected scores == the reference's top-k scores as sorted lists (within tolerance);
    -1 exactly past min(len, topk); no slot >= len; no duplicates. Returns the max error.
    `scores` may be the reference scores of these inputs, computed once for several checks."""
    lens = inputs[5]
    if scores is None:
        scores = reference_scores(inputs, ref_mod)
    count = lens.long().clamp(max=topk)
    rank = torch.arange(topk, device=idx.device)
    expect_valid = rank < count[..., None]
    assert torch.equal(idx >= 0, expect_valid), "-1 placement"
    assert bool((idx < lens[..., None]).all()), "slot >= len"
    sorted_idx = idx.sort(dim=-1).values
    dup = (sorted_idx[..., 1:] == sorted_idx[..., :-1]) & (sorted_idx[..., 1:] >= 0)
    assert not bool(dup.any()), "duplicate slot"
    picked = scores.gather(-1, idx.clamp(min=0).long()).masked_fill(~expect_valid, float("-inf"))
    best = scores.topk(min(topk, scores.shape[-1]), dim=-1).values
    picked = picked.sort(dim=-1, descending=True).values[..., : best.shape[-1]]
    finite = torch.isfinite(best)
    assert torch.equal(finite, torch.isfinite(picked)), "count of selected scores"
    # bf16/fp8 operands are exact in f32 products; f32 accumulation order differs (~1e-6
    # relative), and fp8 MMA accumulation on Hopper is coarser: 2e-3 of the row's largest score.
    tol = (2e-3 if q_dtype == torch.float8_e4m3fn else 1e-4)
    row_scale = best.masked_fill(~finite, 0).abs().amax(dim=-1, keepdim=True).clamp(min=1e-6)
    err = ((picked - best).abs() / row_scale).masked_fill(~finite, 0).max().item()
    assert err <= tol, f"selected scores differ from the reference top-k: {err:.3g} > {tol}"
    return err


def timer(device, graph_rep=50):
    """bench(fn, heavy=False, graph=False) -> median microseconds. On CUDA: do_bench (L2
    flushed before each run), or with graph=True the replay of a CUDA graph of fn (how a
    serving step runs it; no per-launch Python cost, L2 not flushed) over about graph_rep ms."""
    if device.type == "cuda":
        import triton.testing

        def bench(fn, heavy=False, graph=False):
            if graph:
                return triton.testing.do_bench_cudagraph(fn, rep=graph_rep,
                                                         return_mode="median") * 1e3
            warmup, rep = (5, 30) if heavy else (25, 100)
            return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3
        return bench

    def bench_cpu(fn, heavy=False, graph=False):
        fn()
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return statistics.median(runs) * 1e6
    return bench_cpu


def floors(batch, tokens, heads, dim, lens, topk, q_bytes):
    slots_read = batch * (math.ceil(int(lens.max()) / PAGE) * PAGE)
    bytes_moved = (slots_read * (dim + 4) + batch * tokens * heads * (dim * q_bytes + 4)
                   + batch * tokens * topk * 4)
    flops = 2 * heads * dim * int(lens.long().sum())
    return bytes_moved / BYTES_PER_S * 1e6, flops / FLOPS_PER_S * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU interpreter)")
    parser.add_argument("--topk", type=int, default=512)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--sweep", action="store_true",
                        help="only time the op's launch variants (SELECT_CONFIGS) at B=64, "
                             "contexts 512/128K, T=1/4, fp8")
    parser.add_argument("--sweep-score", action="store_true",
                        help="only time the scoring kernel's launch variants (SCORE_CONFIGS) "
                             "at B=64, 128K, fp8, T=1/4")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module imports
    from dsv4_compile.kernels import indexer_topk as mod

    if args.smoke:
        max_pages, batches, contexts, token_counts = 4, (1, 2), (128, 1000), (1, 2)
        heads, dim, topk = 4, 16, 16
    else:
        max_pages = math.ceil(262_208 / PAGE)  # 1M tokens of context
        batches, contexts, token_counts = (1, 16, 64), (512, 8192, 131072), (1, 4)
        heads, dim, topk = args.heads, args.dim, args.topk
    q_dtypes = (torch.bfloat16, torch.float8_e4m3fn)
    bench = timer(device, graph_rep=20 if args.sweep or args.sweep_score else 50)
    if args.sweep or args.sweep_score:
        run = sweep_select if args.sweep else sweep_score
        table = run(mod, bench, device, heads, dim, max_pages, topk, args.smoke)
        args.out.mkdir(parents=True, exist_ok=True)
        name = "bench_indexer_sweep.md" if args.sweep else "bench_indexer_sweep_score.md"
        (args.out / name).write_text(table)
        print(table)
        return 0
    compiled = torch.compile(full_context_indexer, dynamic=True)
    gen = torch.Generator(device=device).manual_seed(0)
    rows, configs = [], {}
    baseline_cache: dict = {}

    for batch in batches:
        for context in contexts:
            for tokens in token_counts:
                for q_dtype in q_dtypes:
                    inputs = make_inputs(batch, context, tokens, heads, dim, max_pages,
                                         q_dtype, device, gen)
                    idx, kernels = mod.indexer_topk_triton(*inputs, topk)
                    err = check_selection(idx, inputs, topk, mod, q_dtype)
                    op_idx = torch.ops.dsv4.indexer_topk(*inputs, topk)
                    check_selection(op_idx, inputs, topk, mod, q_dtype)
                    for kernel in kernels:
                        if kernel is None or not hasattr(kernel, "metadata"):
                            continue  # the interpreter compiles nothing
                        shared = kernel.metadata.shared
                        configs[kernel.hash] = dict(kernel=kernel.name, shared=shared,
                                                    num_warps=kernel.metadata.num_warps,
                                                    num_stages=kernel.metadata.num_stages)
                        assert shared <= SMEM_LIMIT, f"{kernel.name} uses {shared} B of smem"
                    triton_us = bench(lambda: mod.indexer_topk_triton(*inputs, topk), graph=True)
                    score_us = bench(lambda: mod.indexer_scores_triton(*inputs, topk), graph=True)
                    key = (batch, tokens)
                    if q_dtype == torch.bfloat16 and key not in baseline_cache:
                        baseline_cache[key] = time_baselines(bench, inputs, topk, compiled)
                    eager_us, compiled_us = baseline_cache.get(key, (math.nan, math.nan))
                    byte_us, flop_us = floors(batch, tokens, heads, dim, inputs[5], topk,
                                              inputs[0].element_size())
                    floor_us = max(byte_us, flop_us)
                    rows.append(dict(
                        B=batch, context=context, T=tokens, q=str(q_dtype).split(".")[-1],
                        slots=int(inputs[5].max()), eager_us=eager_us, compiled_us=compiled_us,
                        triton_us=triton_us, score_us=score_us,
                        speedup_vs_compiled=compiled_us / triton_us,
                        byte_floor_us=byte_us, flop_floor_us=flop_us,
                        floor_fraction=floor_us / triton_us, max_rel_err=err))
                    del inputs, idx, op_idx
        if device.type == "cuda":
            torch.cuda.empty_cache()

    for row in rows:  # T=4 against T=1 at the same (B, context, q dtype)
        base = next(r for r in rows if r["B"] == row["B"] and r["context"] == row["context"]
                    and r["q"] == row["q"] and r["T"] == min(token_counts))
        row["vs_T1"] = row["triton_us"] / base["triton_us"]

    meta = dict(torch=torch.__version__, triton=__import__("triton").__version__,
                device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                smoke=args.smoke, max_pages=max_pages, heads=heads, dim=dim, topk=topk,
                date=time.strftime("%Y-%m-%d %H:%M:%S"), command=" ".join(sys.argv))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_indexer.json").write_text(
        json.dumps(dict(meta=meta, rows=rows, kernel_configs=list(configs.values())), indent=1))
    table = markdown(rows, configs, meta)
    (args.out / "bench_indexer.md").write_text(table)
    print(table)
    return 0


# Launch variants of the whole op (keyword arguments of indexer_topk_triton) for --sweep; the
# first is the current default, the second the defaults before the page id loaded ahead and the
# split kernel's blocks.
SELECT_CONFIGS = (
    dict(),
    dict(chunk=2048, select_warps=4, split_block=2048, score_max_regs=0, id_ahead=False,
         score_stages=2),
    dict(score_stages=2),
    dict(score_stages=4),
    dict(score_max_regs=0),
    dict(split_block=256),
    dict(split_block=1024),
    dict(select_warps=8),
    dict(chunk=4096, select_warps=8),
    dict(chunk=1024),
    dict(select_programs=16),  # one program per chunk at 128K (2048-slot chunks)
    dict(select_programs=8),  # each program draws the row's bin sample: fewer draws a row
    dict(select_programs=4),
    dict(scale_ahead=True),  # scales a page ahead, ids two (first use behind a barrier)
    dict(scale_ahead=True, pin_ids=False),
)


def _config_name(kw: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in kw.items()) or "default"


def sweep_select(mod, bench, device, heads, dim, max_pages, topk, smoke) -> str:
    """At B=64, fp8 q and keys, contexts 512/128K x T=1/4: for each SELECT_CONFIGS variant,
    the whole op and the selection alone (on a fixed score workspace), as CUDA-graph replays,
    each variant's answer checked against the reference first; shared memory of every compiled
    kernel."""
    from dsv4_compile.kernels import topk_select

    batch, contexts = (2, (128, 1000)) if smoke else (64, (512, 131072))
    q_dtype = torch.float8_e4m3fn
    gen = torch.Generator(device=device).manual_seed(1)
    lines = ["| ctx | T | variant | op us | select us | op vs T=1 | byte floor us | rel err |",
             "|---|---|---|---|---|---|---|---|"]
    shared = {}
    t1_times = {}
    for context in contexts:
        for tokens in (1, 4):
            inputs = make_inputs(batch, context, tokens, heads, dim, max_pages, q_dtype, device,
                                 gen)
            scores = reference_scores(inputs, mod)
            lens = inputs[5]
            workspace, _ = mod.indexer_scores_triton(*inputs, topk)
            byte_us, _ = floors(batch, tokens, heads, dim, lens, topk, inputs[0].element_size())
            for index, kw in enumerate(SELECT_CONFIGS):
                idx, kernels = mod.indexer_topk_triton(*inputs, topk, **kw)
                err = check_selection(idx, inputs, topk, mod, q_dtype, scores=scores)
                for kernel in kernels:
                    if hasattr(kernel, "metadata"):
                        used = kernel.metadata.shared
                        shared[(kernel.name, kernel.hash)] = (index, used)
                        assert used <= SMEM_LIMIT, (kernel.name, kw, used)
                out = torch.empty_like(idx)
                select_kw = dict(chunk=kw.get("chunk", topk_select.DEFAULT_CHUNK),
                                 num_warps=kw.get("select_warps",
                                                  topk_select.DEFAULT_SELECT_WARPS),
                                 split_block=kw.get("split_block",
                                                    topk_select.DEFAULT_SPLIT_BLOCK),
                                 programs=kw.get("select_programs"))
                op_us = bench(lambda: mod.indexer_topk_triton(*inputs, topk, **kw), graph=True)
                select_us = bench(lambda: topk_select.select_topk_triton(
                    workspace, lens, topk, out, **select_kw), graph=True)
                if tokens == 1:
                    t1_times[(context, index)] = op_us
                vs_t1 = op_us / t1_times[(context, index)]
                lines.append(f"| {context} | {tokens} | {index}: {_config_name(kw)} | "
                             f"{op_us:.1f} | {select_us:.1f} | {vs_t1:.2f} | {byte_us:.1f} | "
                             f"{err:.1e} |")
            del inputs, scores, workspace
            if device.type == "cuda":
                torch.cuda.empty_cache()
    smem = ["", "| kernel | first variant | shared B (limit 101376) |", "|---|---|---|"]
    smem += [f"| {name} | {index} | {b} |" for (name, _), (index, b) in shared.items()]
    smem = smem if shared else smem + ["| (interpreter: nothing compiled) | | |"]
    return "\n".join(lines + smem) + "\n"


# Scoring kernel variants for --sweep-score (keyword arguments of indexer_scores_triton, with
# mult: splits as a multiple of the default); the first is
# the current default launch, the second the one before page ids loaded ahead. A variant that
# ptxas cannot build (a register cap below what it needs) is recorded as such.
_DEFAULT_SCORE = dict(max_regs=None, id_ahead=True, num_warps=None, num_stages=3, mult=1)
_SCALE_AHEAD = dict(_DEFAULT_SCORE, scale_ahead=True, pin_ids=True)
SCORE_CONFIGS = (
    _DEFAULT_SCORE,
    dict(max_regs=0, id_ahead=False, num_warps=None, num_stages=2, mult=1),
    dict(_DEFAULT_SCORE, id_ahead=False, num_stages=2, max_regs=0),
    dict(_DEFAULT_SCORE, id_ahead=False, num_stages=2),
    dict(_DEFAULT_SCORE, max_regs=0),
    _SCALE_AHEAD,
    dict(_SCALE_AHEAD, pin_ids=False),
    dict(_SCALE_AHEAD, num_stages=2),
    dict(_SCALE_AHEAD, num_stages=4),
    dict(_SCALE_AHEAD, mult=2),
) + tuple(dict(_DEFAULT_SCORE, num_warps=warps, num_stages=stages, mult=mult)
          for warps in (4, 8) for stages in (2, 3, 4) for mult in (1, 2))


def sweep_score(mod, bench, device, heads, dim, max_pages, topk, smoke) -> str:
    """Times of the scoring kernel's launch variants (SCORE_CONFIGS) at B=64, 128K, fp8,
    T=1/4, each checked against the default launch's scores first; shared memory and
    registers of each compiled variant."""
    from triton.runtime.errors import PTXASError

    batch, context = (2, 1000) if smoke else (64, 131072)
    gen = torch.Generator(device=device).manual_seed(1)
    lines = ["| T | variant | us | regs | shared B |", "|---|---|---|---|---|"]
    q_dtype = torch.float8_e4m3fn
    for tokens in (1, 4):
        inputs = make_inputs(batch, context, tokens, heads, dim, max_pages, q_dtype, device, gen)
        lens = inputs[5]
        base = mod.default_splits(batch, max_pages, device)
        ref_ws, _ = mod.indexer_scores_triton(*inputs, topk)
        valid = torch.arange(ref_ws.shape[-1], device=device) < lens[..., None]
        for config in SCORE_CONFIGS:
            kw = dict(config)
            kw["splits"] = base * kw.pop("mult")
            name = ", ".join(f"{k}={v}" for k, v in config.items())
            try:
                ws, kernel = mod.indexer_scores_triton(*inputs, topk, **kw)
            except PTXASError as exc:
                lines.append(f"| {tokens} | {name} | does not build: {str(exc).splitlines()[-1][:120]} | - | - |")
                continue
            # fp8 MMA accumulation order may differ between launch configs
            assert torch.allclose(ws[valid], ref_ws[valid], rtol=1e-3, atol=1e-2), config
            meta = getattr(kernel, "metadata", None)
            shared = meta.shared if meta else 0
            assert shared <= SMEM_LIMIT, (config, shared)
            us = bench(lambda: mod.indexer_scores_triton(*inputs, topk, **kw), graph=True)
            lines.append(f"| {tokens} | {name} | {us:.1f} | {getattr(kernel, 'n_regs', '-')} | "
                         f"{shared} |")
        del inputs, ref_ws
    return "\n".join(lines) + "\n"


def time_baselines(bench, inputs, topk, compiled):
    """(eager us, torch.compile us) of the full-context form; NaN where it runs out of memory."""
    times = []
    for fn in (full_context_indexer, compiled):
        try:
            fn(*inputs, topk)  # compile / warm up outside the timing
            times.append(bench(lambda: fn(*inputs, topk), heavy=True))
        except torch.OutOfMemoryError:
            times.append(math.nan)
        if inputs[0].is_cuda:
            torch.cuda.empty_cache()
    return tuple(times)


def markdown(rows, configs, meta) -> str:
    head = (f"indexer_topk: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
            f"max_pages {meta['max_pages']}, H={meta['heads']}, D={meta['dim']}, "
            f"topk={meta['topk']}, fp8 keys + f32 scales, {meta['date']}\n\n")
    lines = ["| B | ctx | T | q | slots | eager us | compiled us | triton us | (score us) "
             "| x compiled | byte floor us | flop floor us | floor frac | vs T=1 | rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['B']} | {r['context']} | {r['T']} | {r['q']} | {r['slots']} | "
            f"{r['eager_us']:.1f} | {r['compiled_us']:.1f} | {r['triton_us']:.1f} | "
            f"{r['score_us']:.1f} | "
            f"{r['speedup_vs_compiled']:.1f} | {r['byte_floor_us']:.2f} | "
            f"{r['flop_floor_us']:.2f} | {r['floor_fraction']:.2f} | {r['vs_T1']:.2f} | "
            f"{r['max_rel_err']:.1e} |")
    smem = ["", "| kernel | num_warps | num_stages | shared B (limit 101376) |", "|---|---|---|---|"]
    smem += [f"| {c['kernel']} | {c['num_warps']} | {c['num_stages']} | {c['shared']} |"
             for c in configs.values()] or ["| (interpreter: nothing compiled) | | | |"]
    return head + "\n".join(lines + smem) + "\n"


if __name__ == "__main__":
    sys.exit(main())
