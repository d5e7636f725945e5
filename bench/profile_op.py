"""Run one dsv4 op at a benchmark size a few times, for a profiler (ncu, nsys) to attach to.

    ncu --set detailed -k regex:_sparse_mla_fwd --launch-skip 2 --launch-count 1 \
        python bench/profile_op.py sparse_mla --batch 64 --tokens 1 --layer csa
    python bench/profile_op.py indexer --batch 64 --tokens 4 --context 131072
    python bench/profile_op.py fp4_moe --tokens 64 --fmt nvfp4

Inputs come from the kernel benches' builders (bench_sparse_mla.make_inputs,
bench_indexer.make_inputs, bench_fp4_moe.random_experts), so a profile matches a bench row.
Every call is checked against nothing: run the bench for correctness.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def sparse_mla_call(args):
    import bench_sparse_mla as bsm

    case = bsm.Case("profile", args.batch, args.tokens, args.heads, args.layer, args.rows,
                    512 if args.layer == "csa" else 1024)
    op_args = bsm.make_inputs(case, "cuda")
    return lambda: torch.ops.dsv4.sparse_mla(*op_args)


def indexer_call(args):
    import bench_indexer as bi

    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = bi.make_inputs(args.batch, args.context, args.tokens, 64, 128, 4097, torch.float8_e4m3fn,
                            "cuda", gen)
    from dsv4_compile.kernels.indexer_topk import indexer_topk_triton
    return lambda: indexer_topk_triton(*inputs, 512)


def fp4_moe_call(args):
    import bench_fp4_moe as bfm

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = bfm.random_experts(args.fmt, 256, 4096, 2048, "cuda", gen)
    x = torch.randn(args.tokens, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(args.tokens, 256, device="cuda", generator=gen).topk(6, dim=-1).indices.to(torch.int32)
    weights = torch.rand(args.tokens, 6, device="cuda", generator=gen) / 4
    op_args = bfm.op_args(x, ids, weights, w)
    return lambda: torch.ops.dsv4.fp4_moe(*op_args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op", choices=("sparse_mla", "indexer", "fp4_moe"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1, help="T per request (fp4_moe: M rows)")
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--layer", choices=("csa", "hca"), default="csa")
    parser.add_argument("--rows", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--fmt", choices=("mxfp4", "nvfp4"), default="mxfp4")
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()
    call = {"sparse_mla": sparse_mla_call, "indexer": indexer_call, "fp4_moe": fp4_moe_call}[args.op](args)
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
