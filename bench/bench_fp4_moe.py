"""Benchmark dsv4::fp4_moe (MXFP4 / NVFP4 routed experts) at V4-Flash sizes.

    python bench/bench_fp4_moe.py --out DIR            # H200: E=256, K=4096, I=2048, k=6
    TRITON_INTERPRET=1 python bench/bench_fp4_moe.py --smoke --out DIR   # CPU check of this script
    python bench/bench_fp4_moe.py --sweep --out DIR    # H200: time each candidate TileConfig

--sweep checks every candidate tile configuration (SWEEP_CANDIDATES) against the reference and
times the correct ones paired, their CUDA-graph replays alternating for --rounds rounds, at M in
{1, 8, 64, 256}, both formats; it writes sweep.json and sweep.md (per-config times, the paired
differences against the default, HBM fraction, shared memory) and prints the table.

For each format and M in {1, 8, 64} (decode) and 256 (verify, 64 x 4 tokens):
1. correctness of the Triton op against the eager reference on random weights;
2. median times (triton.testing.do_bench) of the eager reference, torch.compile of the model's
   plain-torch form (moe_experts_fp4; gathered dequantised weights, so only where they fit), a
   bf16 grouped-GEMM baseline (torch._grouped_mm, else a per-expert bf16 loop), the op called
   eagerly, and the op replayed from a CUDA graph;
3. the byte floor (touched experts' weights + scales, x, out) / 4.8e12 and FLOP floor / 7.9e14;
4. shared memory of every compiled Triton config (asserted <= 101,376 B);
5. results.json and results.md in DIR; the table is printed last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import torch



def _importable_from_checkout() -> None:
    """Without `pip install -e .`, map the checkout's kernels/passes/lowerings folders into a
    temporary dsv4_compile package (the layout pyproject's package-dir gives)."""
    try:
        import dsv4_compile.kernels  # noqa: F401
        return
    except ImportError:
        pass
    import tempfile

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    shim = os.path.join(tempfile.mkdtemp(prefix="dsv4_shim_"), "dsv4_compile")
    os.makedirs(shim)
    for entry in os.listdir(os.path.join(root, "dsv4_compile")):
        os.symlink(os.path.abspath(os.path.join(root, "dsv4_compile", entry)), os.path.join(shim, entry))
    for folder in ("kernels", "passes", "lowerings"):
        os.symlink(os.path.abspath(os.path.join(root, folder)), os.path.join(shim, folder))
    for name in [m for m in sys.modules if m == "dsv4_compile" or m.startswith("dsv4_compile.")]:
        del sys.modules[name]
    sys.path.insert(0, os.path.dirname(shim))


_importable_from_checkout()

from dsv4_compile.kernels import fp4_moe as moe  # noqa: E402
from dsv4_compile.kernels.moe_pairs import combine_pairs, combine_pairs_triton  # noqa: E402
from dsv4_compile.fp4_tiles import experts_split_into_tiles, tile_fp4  # noqa: E402
from dsv4_compile.model.hotspots import moe_experts_fp4  # noqa: E402

HBM_BYTES_PER_S = 4.8e12
BF16_FLOPS = 7.9e14
SMEM_LIMIT = 101_376
SWIGLU_LIMIT = 10.0


def random_experts(fmt: str, experts: int, hidden: int, inter: int, device: str, gen: torch.Generator) -> dict:
    """Random packed FP4 experts (codes uniform, scales near 2**-7 so outputs stay O(1))."""
    def packed(rows, cols):
        return torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, device=device, generator=gen)

    group = moe.GROUP[fmt]

    def scale(rows, cols):
        if fmt == "mxfp4":
            return torch.randint(119, 122, (experts, rows, cols // group), dtype=torch.uint8, device=device,
                                 generator=gen)
        raw = 1.0 + torch.rand(experts, rows, cols // group, device=device, generator=gen)
        return raw.to(torch.float8_e4m3fn)

    glob = None
    if fmt == "nvfp4":
        glob = torch.full((experts,), 2.0 ** -8, device=device)
    return dict(w13=packed(2 * inter, hidden), w13_scale=scale(2 * inter, hidden),
                w2=packed(hidden, inter), w2_scale=scale(hidden, inter), fmt=fmt,
                w13_global=glob, w2_global=None if glob is None else glob.clone())


def tiled_experts(w: dict) -> dict | None:
    """The same experts in the tiled layout optimize() gives them (dsv4_compile.fp4_tiles), or None
    where the sizes do not split into tiles."""
    _, rows, half_cols = w["w13"].shape
    if not experts_split_into_tiles(2 * half_cols, rows // 2):
        return None
    return dict(w, w13=tile_fp4(w["w13"]), w2=tile_fp4(w["w2"]))


def op_args(x, ids, weights, w):
    return (x, ids, weights, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], w["fmt"],
            w["w13_global"], w["w2_global"], SWIGLU_LIMIT)


def dequantised_bf16(w: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """All experts dequantised once to bf16: [E, 2I, K], [E, K, I] (the bf16 baseline's weights)."""
    w13 = torch.stack([moe._dequantize(w["w13"][e], w["w13_scale"][e],
                                       None if w["w13_global"] is None else w["w13_global"][e], w["fmt"],
                                       torch.bfloat16) for e in range(w["w13"].shape[0])])
    w2 = torch.stack([moe._dequantize(w["w2"][e], w["w2_scale"][e],
                                      None if w["w2_global"] is None else w["w2_global"][e], w["fmt"],
                                      torch.bfloat16) for e in range(w["w2"].shape[0])])
    return w13, w2


def grouped_bf16(x, ids, weights, w13_bf16, w2_bf16):
    """bf16 grouped GEMM baseline: sort pairs by expert, torch._grouped_mm twice, weighted sum."""
    tokens, top_k = ids.shape
    experts = w13_bf16.shape[0]
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = x[order // top_k]
    gate_up = torch._grouped_mm(rows, w13_bf16.transpose(1, 2), offs=offs)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = torch.nn.functional.silu(gate.clamp(max=SWIGLU_LIMIT)) * up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
    down = torch._grouped_mm(hidden.contiguous(), w2_bf16.transpose(1, 2), offs=offs)
    per_pair = torch.empty_like(down)
    per_pair[order] = down
    return (per_pair.view(tokens, top_k, -1).float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def loop_bf16(x, ids, weights, w13_bf16, w2_bf16):
    """Fallback bf16 baseline where torch._grouped_mm is missing: a per-expert loop (host syncs)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(ids).tolist():
        token, choice = torch.nonzero(ids == expert, as_tuple=True)
        gate, up = (x[token] @ w13_bf16[expert].T).chunk(2, dim=-1)
        hidden = torch.nn.functional.silu(gate.clamp(max=SWIGLU_LIMIT)) * up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
        out.index_add_(0, token, (hidden @ w2_bf16[expert].T).float() * weights[token, choice, None])
    return out.to(x.dtype)


def touched_bytes(ids: torch.Tensor, w: dict, hidden: int) -> int:
    """Bytes a perfect kernel moves: the touched experts' packed weights and scales, x and out."""
    touched = torch.unique(ids).numel()
    per_expert = sum(w[name][0].numel() * w[name].element_size() for name in ("w13", "w13_scale", "w2", "w2_scale"))
    if w["w13_global"] is not None:
        per_expert += 8
    return touched * per_expert + 2 * ids.shape[0] * hidden * 2


EXPERT_KERNELS = (moe._gate_up_kernel, moe._down_kernel, moe._gate_up_gemv_kernel, moe._down_gemv_kernel,
                  moe._gate_up_mma_kernel, moe._down_mma_kernel)


def shared_memory_records() -> list[dict]:
    """kernel.metadata.shared of every compiled config of the expert kernels (both paths)."""
    records = []
    for kernel in EXPERT_KERNELS:
        caches = getattr(kernel, "device_caches", {})
        for device, cache in caches.items():
            compiled_by_key = cache[0] if isinstance(cache, tuple) else cache
            for key, compiled in compiled_by_key.items():
                meta = compiled.metadata
                records.append(dict(kernel=kernel.fn.__name__, device=str(device), shared=int(meta.shared),
                                    num_warps=int(meta.num_warps), num_stages=int(meta.num_stages),
                                    key=str(key)[:200], full_key=key))
    return records


def make_timer(smoke: bool):
    if smoke:
        def timer(fn):
            fn()
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return timer
    import triton.testing

    return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def graph_replay(fn):
    """Capture fn once in a CUDA graph and return the replay callable, which keeps fn (and the tensors
    it holds, which the graph reads by address) alive; `replay.output` is the tensor the graph writes
    fn's result to."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()

    def replay(captured=fn):
        graph.replay()
    replay.output = output
    return replay


REPLAY_CHECKS = 20


def replays_changed(replay, times: int = REPLAY_CHECKS) -> int:
    """How many of `times` further runs of `replay` (a callable with an `output` tensor, as graph_replay
    gives) write an output that differs bit for bit from its first run's, the output poisoned (all bits
    set) before each run: a race between an op's kernels would show here."""
    out = replay.output.view(torch.uint8)
    out.fill_(0xFF)
    replay()
    first = out.clone()
    changed = 0
    for _ in range(times):
        out.fill_(0xFF)
        replay()
        changed += int(not torch.equal(out, first))
    return changed


def paired_times(fns: dict, rounds: int, flush_l2: bool = True) -> dict[str, list[float]]:
    """ms of each callable in each round; every round runs them all in turn. CUDA: each between two
    events (after an L2 flush, a 256 MB write, with flush_l2), no host sync inside the loop, so the
    variants share any drift of the GPU's speed (blocks of replays, one variant after another, favoured whichever heavy
    case ran first by 3-6%: RESULTS.md, thirteenth session). CPU: the wall clock of each run."""
    if not torch.cuda.is_available():
        times = {label: [] for label in fns}
        for _ in range(rounds):
            for label, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[label].append((time.perf_counter() - start) * 1e3)
        return times
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if flush_l2 else None
    events = {label: [] for label in fns}
    torch.cuda.synchronize()
    for _ in range(rounds):
        for label, fn in fns.items():
            if flush is not None:
                flush.zero_()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            events[label].append((begin, end))
    torch.cuda.synchronize()
    return {label: [b.elapsed_time(e) for b, e in pairs] for label, pairs in events.items()}


def run_case(fmt, tokens, cfg, w, w_tiled, bf16_weights, timer, device, gen, compiled_form, results):
    experts, hidden, inter, top_k = cfg["E"], cfg["K"], cfg["I"], cfg["k"]
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
    scores = torch.rand(tokens, experts, device=device, generator=gen)
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    weights = torch.rand(tokens, top_k, device=device, generator=gen) / top_k * 1.5
    args = op_args(x, ids, weights, w)
    row = dict(fmt=fmt, M=tokens, E=experts, K=hidden, I=inter, k=top_k)

    want = moe.fp4_moe_reference(*args).float()
    got = torch.ops.dsv4.fp4_moe(*args).float()
    scale = want.abs().max().item()
    row["max_err_rel"] = (got - want).abs().max().item() / max(scale, 1e-6)
    # bf16 x, bf16 hidden activations and bf16 output: 2**-8 relative steps, summed over K/I.
    row["correct"] = bool(row["max_err_rel"] < 3e-2 and torch.isfinite(got).all())
    if fmt == "mxfp4" and device == "cuda" and tokens == 8:
        try:
            pairs = moe.fp4_moe_pairs_triton(*args, use_dot_scaled=True)
            forced = combine_pairs(pairs, ids, experts, x.dtype).float()
            row["dot_scaled_err_rel"] = (forced - want).abs().max().item() / max(scale, 1e-6)
        except Exception as exc:  # the sm_100 path may not build on this arch: record, do not abort
            row["dot_scaled_err_rel"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"

    times = {}
    times["reference_eager"] = timer(lambda: moe.fp4_moe_reference(*args))
    if compiled_form is not None and tokens * top_k * 3 * hidden * inter * 2 <= cfg["compile_bytes"]:
        try:
            times["compile_plain_torch"] = timer(lambda: compiled_form(*args))
        except Exception as exc:
            row["compile_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    if bf16_weights is not None:
        baseline = grouped_bf16 if hasattr(torch, "_grouped_mm") else loop_bf16
        try:
            base_out = baseline(x, ids, weights, *bf16_weights)
        except Exception as exc:  # e.g. _grouped_mm unsupported on this arch/version
            row["grouped_mm_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            baseline = loop_bf16
            base_out = baseline(x, ids, weights, *bf16_weights)
        row["bf16_baseline"] = baseline.__name__
        row["bf16_baseline_err_rel"] = (base_out.float() - want).abs().max().item() / max(scale, 1e-6)
        times["bf16_baseline"] = timer(lambda: baseline(x, ids, weights, *bf16_weights))
    times["fp4_moe_op"] = timer(lambda: torch.ops.dsv4.fp4_moe(*args))
    if device == "cuda":
        times["fp4_moe_graph"] = timer(graph_replay(lambda: torch.ops.dsv4.fp4_moe(*args)))
    if w_tiled is not None:  # the layout optimize() runs; the baselines above keep the row-major one
        tiled_args = op_args(x, ids, weights, w_tiled)
        tiled_out = torch.ops.dsv4.fp4_moe(*tiled_args).float()
        row["tiled_err_rel"] = (tiled_out - want).abs().max().item() / max(scale, 1e-6)
        row["correct"] = row["correct"] and bool(row["tiled_err_rel"] < 3e-2 and torch.isfinite(tiled_out).all())
        run_tiled = graph_replay(lambda: torch.ops.dsv4.fp4_moe(*tiled_args)) if device == "cuda" else (
            lambda: torch.ops.dsv4.fp4_moe(*tiled_args))
        times["fp4_moe_graph_tiled"] = timer(run_tiled)
    row["times_ms"] = times
    row["bytes"] = touched_bytes(ids, w, hidden)
    row["flops"] = 2 * tokens * top_k * 3 * hidden * inter
    row["byte_floor_ms"] = row["bytes"] / HBM_BYTES_PER_S * 1e3
    row["flop_floor_ms"] = row["flops"] / BF16_FLOPS * 1e3
    best = times.get("fp4_moe_graph_tiled", times.get("fp4_moe_graph", times["fp4_moe_op"]))
    row["floor_fraction"] = max(row["byte_floor_ms"], row["flop_floor_ms"]) / best
    row["hbm_fraction"] = row["byte_floor_ms"] / best
    if "bf16_baseline" in times:
        row["speedup_vs_bf16"] = times["bf16_baseline"] / best
    row["speedup_vs_reference"] = times["reference_eager"] / best
    results.append(row)
    return row


def markdown(rows: list[dict], smem: list[dict], meta: dict) -> str:
    lines = [f"# fp4_moe bench ({meta['date']}, torch {meta['torch']}, triton {meta['triton']}, {meta['device']})",
             "", f"command: `{meta['command']}`", "",
             "| fmt | M | ok (rel err) | ref eager ms | compile ms | bf16 ms | op ms | graph ms | tiled graph ms "
             "| byte floor ms | HBM frac | vs bf16 | vs ref |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def fmt_ms(value):
        return "-" if value is None else f"{value:.4f}"

    for r in rows:
        t = r["times_ms"]
        lines.append(
            f"| {r['fmt']} | {r['M']} | {r['correct']} ({r['max_err_rel']:.1e}) | {fmt_ms(t.get('reference_eager'))} "
            f"| {fmt_ms(t.get('compile_plain_torch'))} | {fmt_ms(t.get('bf16_baseline'))} "
            f"| {fmt_ms(t.get('fp4_moe_op'))} | {fmt_ms(t.get('fp4_moe_graph'))} "
            f"| {fmt_ms(t.get('fp4_moe_graph_tiled'))} | {r['byte_floor_ms']:.4f} "
            f"| {r['hbm_fraction']:.2f} | {r.get('speedup_vs_bf16', float('nan')):.2f} "
            f"| {r['speedup_vs_reference']:.1f} |")
    lines += ["", "| kernel | shared B | warps | stages |", "|---|---|---|---|"]
    lines += [f"| {s['kernel']} | {s['shared']} | {s['num_warps']} | {s['num_stages']} |" for s in smem]
    lines += ["", "op / graph: row-major experts; tiled graph: the tiled layout optimize() gives them (HBM frac, "
              "vs bf16 and vs ref use it where present). Targets: HBM frac >= 0.70 (touched experts' bytes), vs "
              "bf16 >= 3 at M=64, shared <= 101376 B."]
    return "\n".join(lines)


def _gemv(block_m, block_n, block_k, warps, prefetch=False):
    return moe.TileConfig("gemv", block_m, block_n, block_k, num_warps=warps, prefetch=prefetch)


def _dot(block_m, block_n, block_k, warps, stages):
    return moe.TileConfig("dot", block_m, block_n, block_k, num_warps=warps, num_stages=stages)


def _mma(block_m, block_n, block_k, warps, stages, prefetch=False, down=(0, 0), asm=False, caps=(0, 0), splits=1,
         direct=False, ready=False, relaxed=False):
    return moe.TileConfig("mma", block_m, block_n, block_k, num_warps=warps, num_stages=stages, prefetch=prefetch,
                          down_block_n=down[0], down_num_warps=down[1], scale_asm=asm, max_regs=caps[0],
                          down_max_regs=caps[1], k_splits=splits, direct_blocks=direct, ready_counts=ready,
                          relaxed_spin=relaxed)


# Candidates per M at V4-Flash sizes (E=256, k=6); the table marks the default (`choose_config`). M=1
# and 8 share their list (one size class) so they compile once. The mma entries are the swap-AB
# tensor-core path (fp4_moe's MMA path comment), all on one warp and without cp.async (every
# pipelined variant lost in the third to fifth sessions' sweeps): with prefetch=True two K steps a
# turn, each loaded a step ahead into registers (BLOCK_K 64 or 128, fewer weight rows for fewer
# registers), beside the plain loop with 256-column steps (the verify default). 80 (config, M,
# format) rows: some 2-3 minutes on the H200 with compiles. `ready`: the down kernel's per-block
# ready counts instead of its wait for the whole gate/up grid (TileConfig.ready_counts; the MXFP4
# default since the thirtieth session; at M=8 also with 32 gate/up columns a program, half the programs,
# which lost to 16); `relaxed`: their down programs spin on volatile loads and acquire once
# (TileConfig.relaxed_spin, not timed yet). At M=256 (six pairs an expert) 8-pair blocks read and decode the ~15% of
# experts with more than 8 pairs twice; 16-pair blocks on 128-column K steps needed 168-255 registers
# and lost (twenty-fourth session), and on 64-column steps (134 / 132 registers, no spills) lost by
# 245-287 us (thirtieth session). `down` gives the down kernel output columns and warps of its own: in the eleventh session's
# B=64 step, gate/up on 16 rows and down on 64 rows and 2 warps took 126 us less kernel time a step
# (its step time did not follow; bench/RESULTS.md). `asm`: the scale
# words by inline-asm loads (TileConfig.scale_asm; the default at 32 rows). `caps`: register caps of
# gate/up and down (TileConfig.max_regs / down_max_regs; 160 / none the default at 32 rows). Sweeps
# before the thirteenth session timed each candidate in its own block of replays, which favoured
# whichever heavy case ran first by 3-6%; the sweep now times them paired (`paired_times`), and the
# step-level check of a close call is bench/paired_step.py.
# At M=1 each program's K loop is a chain of dependent loads and decodes on one warp, with few warps an
# SM: `splits` (TileConfig.k_splits) shares gate/up's reduction among more programs (2, the default,
# gained 5%; 4 and 8 less).
_TOKEN = [_mma(8, 16, 128, 1, 1, True, splits=2), _mma(8, 16, 128, 1, 1, True), _mma(8, 16, 128, 1, 1, True, splits=4),
          _mma(8, 16, 128, 1, 1, True, splits=2, direct=True), _mma(8, 16, 128, 1, 1, True, direct=True),
          _mma(8, 16, 128, 1, 1, True, splits=4, direct=True), _mma(8, 16, 256, 1, 1, True, splits=2, direct=True)]
_SMALL = [_mma(8, 16, 128, 1, 1, True, down=(128, 4)), _mma(8, 16, 128, 1, 1, True, down=(128, 4), splits=2),
          _mma(8, 16, 128, 1, 1, True, down=(128, 4), direct=True),
          _mma(8, 16, 128, 1, 1, True, down=(128, 4), splits=2, direct=True),
          _mma(8, 16, 128, 1, 1, True, down=(128, 4), ready=True),
          _mma(8, 16, 128, 1, 1, True, down=(128, 4), ready=True, relaxed=True),
          _mma(8, 32, 128, 1, 1, True, down=(128, 4), ready=True)]
SWEEP_CANDIDATES = {
    1: _TOKEN,
    8: _SMALL,
    64: [_mma(8, 32, 128, 1, 1, True, asm=True, caps=(160, 112)), _mma(8, 32, 128, 1, 1, True, asm=True),
         _mma(8, 16, 128, 1, 1, True, down=(64, 2), asm=True),
         _mma(8, 32, 128, 1, 1, True), _mma(8, 32, 64, 1, 1, True),
         _mma(8, 16, 128, 1, 1, True),
         _mma(8, 64, 64, 1, 1, True), _mma(8, 64, 128, 2, 1, True), _mma(8, 32, 256, 1, 1),
         _mma(8, 16, 128, 1, 1, True, down=(64, 2)), _mma(8, 32, 128, 1, 1, True, down=(64, 2)),
         _mma(8, 16, 128, 1, 1, True, down=(128, 4)), _mma(8, 16, 128, 1, 1, True, down=(128, 4), ready=True),
         _mma(8, 16, 128, 1, 1, True, down=(128, 4), ready=True, relaxed=True)],
    256: [_mma(8, 32, 256, 1, 1), _mma(8, 32, 128, 1, 1, True, asm=True, caps=(160, 112)),
          _mma(8, 32, 128, 1, 1, True, asm=True), _mma(8, 32, 128, 1, 1, True),
          _mma(8, 32, 64, 1, 1, True),
          _mma(8, 16, 128, 1, 1, True), _mma(8, 32, 128, 1, 1, True, down=(128, 4)),
          _mma(8, 32, 128, 1, 1, True, down=(128, 4), asm=True, caps=(160, 0)),
          _mma(8, 16, 128, 1, 1, True, down=(128, 4)), _mma(8, 16, 128, 1, 1, True, down=(128, 4), ready=True),
          _mma(8, 32, 128, 1, 1, True, down=(128, 4), asm=True, caps=(160, 0), ready=True),
          _mma(8, 32, 128, 1, 1, True, down=(128, 4), asm=True, caps=(160, 0), ready=True, relaxed=True)],
}


def _compiled_keys() -> set:
    return {(kernel.fn.__name__, key) for kernel in EXPERT_KERNELS
            for cache in getattr(kernel, "device_caches", {}).values()
            for key in (cache[0] if isinstance(cache, tuple) else cache)}


def sweep_case(fmt, tokens, cfg, w, rounds, device, gen, candidates) -> list[dict]:
    """Check every candidate TileConfig at one (format, M), then time the correct ones paired
    (`paired_times`, CUDA-graph replays on a GPU): each row's median and the median and quartiles of
    its differences against the default candidate (the first one where the default is not among
    them); rows for sweep.md."""
    experts, hidden, top_k = cfg["E"], cfg["K"], cfg["k"]
    x = torch.randn(tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
    scores = torch.rand(tokens, experts, device=device, generator=gen)
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    weights = torch.rand(tokens, top_k, device=device, generator=gen) / top_k * 1.5
    args = op_args(x, ids, weights, w)
    want = moe.fp4_moe_reference(*args).float()
    scale = max(want.abs().max().item(), 1e-6)
    floor_ms = touched_bytes(ids, w, hidden) / HBM_BYTES_PER_S * 1e3
    default = moe.choose_config(tokens * top_k, experts, fmt, moe.native_fp4_dot(x, fmt))
    rows, fns = [], {}
    for index, config in enumerate(candidates):
        def run(config=config):
            pairs = moe.fp4_moe_pairs_triton(*args, config=config)
            return combine_pairs_triton(pairs, ids, experts, x.dtype)  # as the op

        before = _compiled_keys()
        row = dict(fmt=fmt, M=tokens, config=dataclasses.asdict(config), default=config == default)
        try:
            err = (run().float() - want).abs().max().item() / scale
        except Exception as exc:  # a config that does not build: record it, keep sweeping
            row.update(correct=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            rows.append(row)
            continue
        row["max_err_rel"] = err
        row["correct"] = bool(err < 3e-2)  # as run_case: bf16 x, hidden and output
        if row["correct"] and device == "cuda":
            replay = graph_replay(run)
            row["replays_changed"] = replays_changed(replay)
            row["correct"] = row["replays_changed"] == 0
            if row["correct"]:
                fns[index] = replay
        elif row["correct"]:
            fns[index] = run
        new = _compiled_keys() - before
        row["shared"] = [s["shared"] for s in shared_memory_records()
                         if (s["kernel"], s["full_key"]) in new]
        rows.append(dict(row, index=index))
    if fns:
        times = paired_times(fns, rounds)
        reference = next((i for i in fns if candidates[i] == default), next(iter(fns)))
        for row in rows:
            if row.get("index") in fns:
                mine = times[row["index"]]
                diffs = [a - b for a, b in zip(mine, times[reference])]
                quartiles = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else (diffs[0],) * 3
                row.update(ms=statistics.median(mine), paired_ms=statistics.median(diffs),
                           paired_quartiles_ms=(quartiles[0], quartiles[2]), paired_reference=reference == row["index"])
                row["hbm_fraction"] = floor_ms / row["ms"]
    return rows


def _down_cell(config: dict) -> str:
    """The down kernel's own shape (`TileConfig.down_shape`) where the config gives one, else empty."""
    if not (config["down_block_n"] or config["down_num_warps"]):
        return ""
    down_n, down_warps = moe.TileConfig(**config).down_shape()
    return f"{down_n} x {down_warps}"


def _splits_cell(config: dict) -> str:
    """gate/up's K splits where the config splits, 'direct' for one block a pair (no grouping kernels),
    'ready' for the down kernel's per-block ready counts."""
    cells = ([str(config["k_splits"])] if config["k_splits"] > 1 else []) + (["direct"] if config["direct_blocks"] else [])
    ready = ["ready, relaxed spin" if config["relaxed_spin"] else "ready"] if config["ready_counts"] else []
    return ", ".join(cells + ready)


def _caps_cell(config: dict) -> str:
    """Register caps (gate/up / down, '-' for the compiler's choice) where the config sets one."""
    caps = (config["max_regs"], config["down_max_regs"])
    return " / ".join(str(c or "-") for c in caps) if any(caps) else ""


def sweep_markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# fp4_moe tile sweep ({meta['date']}, torch {meta['torch']}, triton {meta['triton']}, {meta['device']})",
             "", f"command: `{meta['command']}`", "",
             "| fmt | M | path | BM | BN | BK | warps | stages | prefetch | down BN x warps | asm scales "
             "| register caps | K splits, blocks, ready counts | default | ok (rel err) | graph ms "
             "| paired vs reference ms (quartiles) | HBM frac | shared B |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["config"]
        ok = f"{r['correct']} ({r['max_err_rel']:.1e})" if "max_err_rel" in r else f"False ({r.get('error', '')[:60]})"
        if r.get("replays_changed"):
            ok += f", {r['replays_changed']} of {REPLAY_CHECKS} replays changed"
        ms = f"{r['ms']:.4f}" if "ms" in r else "-"
        paired = "-"
        if "paired_ms" in r:
            paired = "reference" if r["paired_reference"] else (
                f"{r['paired_ms']:+.4f} ({r['paired_quartiles_ms'][0]:+.4f} / {r['paired_quartiles_ms'][1]:+.4f})")
        frac = f"{r['hbm_fraction']:.2f}" if "hbm_fraction" in r else "-"
        shared = ",".join(str(v) for v in r.get("shared", [])) or "cached"
        lines.append(f"| {r['fmt']} | {r['M']} | {c['path']} | {c['block_m']} | {c['block_n']} | {c['block_k']} "
                     f"| {c['num_warps']} | {c['num_stages']} | {'yes' if c['prefetch'] else ''} "
                     f"| {_down_cell(c)} | {'yes' if c['scale_asm'] else ''} | {_caps_cell(c)} | {_splits_cell(c)} "
                     f"| {'*' if r['default'] else ''} | {ok} "
                     f"| {ms} | {paired} | {frac} | {shared} |")
    lines += ["", f"ok: within the tolerance of the reference and, on a GPU, every one of {REPLAY_CHECKS} further "
              "graph replays bit-equal to the first (outputs poisoned before each); graph ms: median of the paired "
              "rounds; paired: the median (and quartiles) of the round-by-round differences against the "
              "reference row (the default where it is a candidate). HBM frac: touched experts' bytes / 4.8 TB/s "
              "over the graph ms. 'cached': the kernels were compiled by an earlier row. Shared memory must stay "
              "<= 101376 B."]
    return "\n".join(lines)


def run_sweep(cfg, device, rounds, formats, out_dir, meta) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[dict] = []
    for fmt in formats:
        w = random_experts(fmt, cfg["E"], cfg["K"], cfg["I"], device, gen)
        w = tiled_experts(w) or w  # the layout optimize() runs, where the sizes split into tiles
        for tokens in cfg["Ms"]:
            rows += sweep_case(fmt, tokens, cfg, w, rounds, device, gen, cfg["candidates"][tokens])
        del w
        if device == "cuda":
            torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "sweep.json"), "w") as fh:
        json.dump(dict(meta=meta, config={k: v for k, v in cfg.items() if k != "candidates"}, rows=rows), fh, indent=1)
    table = sweep_markdown(rows, meta)
    with open(os.path.join(out_dir, "sweep.md"), "w") as fh:
        fh.write(table + "\n")
    print(table)
    assert all(r["correct"] for r in rows), "a swept configuration disagrees with the reference"
    assert all(v <= SMEM_LIMIT for r in rows for v in r.get("shared", [])), f"a config exceeds {SMEM_LIMIT} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for results.json and results.md")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--formats", default="mxfp4,nvfp4")
    parser.add_argument("--sweep", action="store_true", help="time each candidate tile config (SWEEP_CANDIDATES)")
    parser.add_argument("--rounds", type=int, default=None, help="--sweep's paired rounds (default 100, smoke 1)")
    parser.add_argument("--ms", default=None, help="comma list of M (tokens) to run, a subset of the defaults")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    if args.smoke:
        cfg = dict(E=8, K=64, I=32, k=2, Ms=(1, 4), compile_bytes=1 << 40,
                   candidates={m: [_gemv(1, 16, 64, 4), _gemv(2, 8, 32, 2), _gemv(2, 8, 32, 2, True),
                                       _dot(16, 32, 32, 4, 1), _mma(8, 16, 32, 1, 1), _mma(8, 16, 32, 1, 1, True),
                                       _mma(8, 16, 32, 1, 1, True, down=(32, 2))]
                               for m in (1, 4)})
        device = "cpu"
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs the kernels under the interpreter: set TRITON_INTERPRET=1")
    else:
        cfg = dict(E=256, K=4096, I=2048, k=6, Ms=(1, 8, 64, 256), compile_bytes=8 << 30,
                   candidates=SWEEP_CANDIDATES)
        device = "cuda"
        if not torch.cuda.is_available():
            raise SystemExit("needs CUDA (or --smoke with TRITON_INTERPRET=1)")
    if args.ms:
        chosen = tuple(int(m) for m in args.ms.split(","))
        if not set(chosen) <= set(cfg["Ms"]):
            parser.error(f"--ms takes values of {cfg['Ms']}; got {chosen}")
        cfg["Ms"] = chosen
    timer = make_timer(args.smoke)
    if args.sweep:
        import triton

        meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), torch=torch.__version__, triton=triton.__version__,
                    device=torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
                    command=" ".join(sys.argv))
        run_sweep(cfg, device, args.rounds or (1 if args.smoke else 100), args.formats.split(","), args.out, meta)
        return
    gen = torch.Generator(device=device).manual_seed(0)
    compiled_form = torch.compile(moe_experts_fp4)
    results: list[dict] = []
    for fmt in args.formats.split(","):
        w = random_experts(fmt, cfg["E"], cfg["K"], cfg["I"], device, gen)
        w_tiled = tiled_experts(w)
        bf16_weights = dequantised_bf16(w)
        for tokens in cfg["Ms"]:
            run_case(fmt, tokens, cfg, w, w_tiled, bf16_weights, timer, device, gen, compiled_form, results)
        del w, w_tiled, bf16_weights
        if device == "cuda":
            torch.cuda.empty_cache()

    smem = [{k: v for k, v in r.items() if k != "full_key"} for r in shared_memory_records()] if device == "cuda" else []
    import triton

    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(),
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
                command=" ".join(sys.argv))
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(dict(meta=meta, config={k: v for k, v in cfg.items() if k != "candidates"}, rows=results,
                       shared_memory=smem), fh, indent=1)
    table = markdown(results, smem, meta)
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write(table + "\n")
    print(table)
    assert all(r["correct"] for r in results), "fp4_moe disagrees with the reference"
    assert all(s["shared"] <= SMEM_LIMIT for s in smem), f"a config exceeds {SMEM_LIMIT} B of shared memory"


if __name__ == "__main__":
    main()
