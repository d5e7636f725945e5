"""Benchmark dsv4::decode_mm against cuBLAS (torch.mm) on the 4-layer slice's bf16 projections.

    python bench/bench_decode_mm.py --out DIR            # H200: every projection at M = 1, 16, 64
    python bench/bench_decode_mm.py --sweep --out DIR    # also time SWEEP_CONFIGS on SWEEP_SHAPES
    TRITON_INTERPRET=1 python bench/bench_decode_mm.py --smoke --out DIR   # CPU check of this script

Each product is x [M, K] @ W^T with W [N, K] contiguous (nn.Linear; o_a_proj is a bmm over 8
groups), checked against decode_mm_reference first. Times are CUDA-graph replays of calls that
cycle through enough copies of the weight (>= 256 MB in all) that each call reads its weight
from HBM, as in a model step, where the MoE's gigabytes flush the L2 between projections. The
floor is the weight's bytes / 4.8e12 B/s. Writes results.json and results.md in DIR.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fp4_moe import _importable_from_checkout  # noqa: E402

_importable_from_checkout()

from dsv4_compile.kernels import decode_mm as dm  # noqa: E402

HBM_BYTES_PER_S = 4.8e12
ROTATE_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class Shape:
    """One projection of the slice: `per_step` calls in the 4-layer step, weight [groups, N, K]."""

    name: str
    depth: int  # K
    cols: int  # N
    per_step: int
    groups: int = 1


SHAPES = (
    Shape("q_a_proj", 4096, 1024, 4),
    Shape("q_b_proj", 1024, 32768, 4),
    Shape("kv_proj", 4096, 512, 4),
    Shape("o_a_proj (bmm, 8 groups)", 4096, 1024, 4, groups=8),
    Shape("o_b_proj", 8192, 4096, 4),
    Shape("shared gate / up", 4096, 2048, 8),
    Shape("shared down", 2048, 4096, 4),
    Shape("compressor kv / gate", 4096, 1024, 4),
    Shape("indexer q_b", 1024, 8192, 2),
    Shape("lm_head", 4096, 129280, 1),
)
SMOKE_SHAPES = (Shape("smoke", 256, 96, 1), Shape("smoke bmm", 128, 64, 1, groups=2))
SWEEP_SHAPES = ("q_b_proj", "o_b_proj", "shared gate / up", "kv_proj", "lm_head")


def sweep_configs(shape: Shape, rows: int, sms: int) -> list[dm.DecodeMMConfig]:
    """Candidate launches: column blocks x reduction steps x warps/stages x programs per SM."""
    out = []
    for block_n, block_k, warps, stages in ((64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (128, 128, 8, 4),
                                            (32, 256, 4, 4)):
        programs = shape.groups * math.ceil(shape.cols / block_n)
        for per_sm in (2, 4):
            splits = max(1, min(shape.depth // (2 * block_k), math.ceil(per_sm * sms / programs)))
            out.append(dm.DecodeMMConfig(block_n, block_k, splits, warps, stages))
    if rows <= 4:
        out.append(dm.DecodeMMConfig(32, 128, max(1, min(8, math.ceil(2 * sms / (shape.cols / 32)))), 4, 1,
                                     use_dot=False))
    return sorted(set(out), key=lambda c: dataclasses.astuple(c))


def make_operands(shape: Shape, rows: int, device, gen, copies: int):
    """x and `copies` weights (each W^T [K, N] view of a contiguous [N, K], or [G, K, N] of [G, N, K])."""
    if shape.groups == 1:
        x = torch.randn(rows, shape.depth, device=device, generator=gen).to(torch.bfloat16)
        ws = [torch.randn(shape.cols, shape.depth, device=device, generator=gen).to(torch.bfloat16).t()
              for _ in range(copies)]
    else:
        x = torch.randn(shape.groups, rows, shape.depth, device=device, generator=gen).to(torch.bfloat16)
        ws = [torch.randn(shape.groups, shape.cols, shape.depth, device=device, generator=gen)
              .to(torch.bfloat16).transpose(1, 2) for _ in range(copies)]
    return x, ws


def graph_time_us(calls, smoke: bool) -> float:
    """Median us of one call of the list `calls` (run in turn), from CUDA-graph replays."""
    if smoke:
        for call in calls:
            call()
        return float("nan")
    import triton.testing

    def run_all():
        for call in calls:
            call()
    return triton.testing.do_bench_cudagraph(run_all, rep=200, return_mode="median") * 1e3 / len(calls)


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """bf16 outputs of one f32 sum: they differ by at most one bf16 rounding (2**-8 relative) plus
    f32 reordering noise, bounded here by 2**-7 of the largest |ref| of each output row."""
    scale = ref.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-3)
    err = ((out.float() - ref.float()).abs() / scale).max().item()
    if not math.isfinite(err) or err > 2 ** -7:
        raise AssertionError(f"{what}: max error {err:.3e} of the row scale > 2**-7")


def run_shape(shape: Shape, rows: int, device, gen, smoke: bool, configs: list) -> list[dict]:
    weight_bytes = shape.groups * shape.cols * shape.depth * 2
    copies = 1 if smoke else max(2, math.ceil(ROTATE_BYTES / weight_bytes))
    x, ws = make_operands(shape, rows, device, gen, copies)
    ref = dm.decode_mm_reference(x, ws[0])
    floor_us = weight_bytes / HBM_BYTES_PER_S * 1e6
    cublas = (torch.mm if shape.groups == 1 else torch.bmm)
    results = []

    def record(variant, calls, config=None):
        us = graph_time_us(calls, smoke)
        results.append(dict(shape=shape.name, M=rows, K=shape.depth, N=shape.cols, groups=shape.groups,
                            per_step=shape.per_step, variant=variant, config=config and dataclasses.asdict(config),
                            us=us, floor_us=floor_us, hbm_frac=floor_us / us if us == us else None))

    check(cublas(x, ws[0]), ref, f"{shape.name} M={rows} cuBLAS")
    record("cublas", [lambda w=w: cublas(x, w) for w in ws])
    out = torch.empty_like(ref)
    for config in [None] + configs:
        out.fill_(float("nan"))
        try:
            dm.decode_mm_triton(x, ws[0], config, out=out)
        except Exception as err:  # a swept config that does not fit (shared memory) is recorded, not fatal
            if config is None or "out of resource" not in str(err).lower():
                raise
            results.append(dict(shape=shape.name, M=rows, variant="decode_mm", config=dataclasses.asdict(config),
                                us=float("inf"), error=str(err)[:200], per_step=shape.per_step))
            continue
        check(out, ref, f"{shape.name} M={rows} {config}")
        record("decode_mm default" if config is None else "decode_mm", [
            lambda w=w: dm.decode_mm_triton(x, w, config) for w in ws], config or dm.pick_config(
                rows, shape.cols, shape.depth, shape.groups, x.device))
    return results


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# dsv4::decode_mm vs cuBLAS\n", f"- {meta}\n",
             "| projection | M | K x N (groups) | per step | cuBLAS us | HBM frac | decode_mm us | HBM frac | "
             "vs cuBLAS | best swept us | best config |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["shape"], r["M"]) for r in rows}, key=lambda k: (k[1], k[0]))
    totals: dict[int, list[float]] = {}
    for name, m in keys:
        group = [r for r in rows if r["shape"] == name and r["M"] == m]
        cub = next(r for r in group if r["variant"] == "cublas")
        ours = next(r for r in group if r["variant"] == "decode_mm default")
        swept = [r for r in group if r["variant"] == "decode_mm"]
        best = min(swept, key=lambda r: r["us"]) if swept else None
        t = totals.setdefault(m, [0.0, 0.0])
        t[0] += cub["us"] * cub["per_step"]
        t[1] += ours["us"] * ours["per_step"]
        lines.append(f"| {name} | {m} | {cub['K']} x {cub['N']} ({cub['groups']}) | {cub['per_step']} | "
                     f"{cub['us']:.1f} | {cub['hbm_frac'] or 0:.2f} | {ours['us']:.1f} | {ours['hbm_frac'] or 0:.2f} | "
                     f"{cub['us'] / ours['us']:.2f}x | {best['us'] if best else float('nan'):.1f} | "
                     f"{best['config'] if best else '-'} |")
    lines.append("\nPer 4-layer step (calls x time):")
    for m, (cub, ours) in sorted(totals.items()):
        lines.append(f"- M={m}: cuBLAS {cub:.1f} us, decode_mm {ours:.1f} us")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--sweep", action="store_true", help="also time sweep_configs on SWEEP_SHAPES")
    parser.add_argument("--rows", default="1,16,64")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    sms = 4 if args.smoke else torch.cuda.get_device_properties(device).multi_processor_count
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    rows_list = [1, 5] if args.smoke else [int(r) for r in args.rows.split(",")]
    results = []
    for rows in rows_list:
        for shape in shapes:
            configs = sweep_configs(shape, rows, sms) if (args.sweep and rows in (1, 5, 64) and (
                args.smoke or shape.name in SWEEP_SHAPES)) else []
            results += run_shape(shape, rows, device, gen, args.smoke, configs[:3] if args.smoke else configs)
            print(f"done {shape.name} M={rows}", flush=True)
    import triton
    meta = dict(torch=torch.__version__, triton=triton.__version__,
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    text = markdown(results, meta)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
