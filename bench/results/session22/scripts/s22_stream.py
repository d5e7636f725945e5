"""Session 22: how fast can the gate/up kernels' weight reads go, without decoding or MMAs? Streams the
tiled codes of the experts the way `_gate_up_mma_kernel` does (per program: 16 gate + 16 up rows of one
expert, 1 KB contiguous each per 128-column K step), XOR-reducing the words so the loads stay live:
  plain   : tl.load of the [16, 16] words of each step (one warp, no pipelining)
  plain-s3: the same in tl.range(num_stages=3) (Triton may turn the loads into cp.async stages)
  tma-sN  : a host TensorDescriptor over the codes as [rows, 16] int32, desc.load of [16, 16] boxes, N stages
  flat    : contiguous 32 KB a program, 4 warps (the access pattern at its best), same bytes
M=1 pattern: 6 experts, K split in 2 (grid 128 x 6 x 2); M=64 pattern: all 256 experts, unsplit.
CUDA-graph replays after an L2 flush, paired. Usage: s22_stream.py ROUNDS"""
import statistics, sys, time
import torch, triton, triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
sys.path[:0] = ["bench"]
import bench_fp4_moe as bench

E, K, I = 256, 4096, 2048
TR, TK, IT = 2 * I // 32, K // 128, I // 32


@triton.jit
def _rows(e, c, ks, TR: tl.constexpr, TK: tl.constexpr, IT: tl.constexpr):
    t = c // 2
    h = c % 2
    rg = ((e * TR + t) * TK + ks) * 32 + h * 16
    ru = ((e * TR + t + IT) * TK + ks) * 32 + h * 16
    return rg, ru


@triton.jit
def plain_kernel(w_ptr, ids_ptr, out_ptr, STEPS: tl.constexpr, TR: tl.constexpr, TK: tl.constexpr, IT: tl.constexpr,
                 STAGES: tl.constexpr):
    c = tl.program_id(0)
    e = tl.load(ids_ptr + tl.program_id(1)).to(tl.int64)
    split = tl.program_id(2)
    acc = tl.zeros([16, 16], tl.int32)
    offs = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    for s in tl.range(0, STEPS, num_stages=STAGES):
        rg, ru = _rows(e, c, split * STEPS + s, TR, TK, IT)
        acc ^= tl.load(w_ptr + rg * 16 + offs) ^ tl.load(w_ptr + ru * 16 + offs)
    pid = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + c
    tl.store(out_ptr + pid, tl.reduce(acc, None, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def tma_kernel(desc, ids_ptr, out_ptr, STEPS: tl.constexpr, TR: tl.constexpr, TK: tl.constexpr, IT: tl.constexpr,
               STAGES: tl.constexpr):
    c = tl.program_id(0)
    e = tl.load(ids_ptr + tl.program_id(1))
    split = tl.program_id(2)
    acc = tl.zeros([16, 16], tl.int32)
    for s in tl.range(0, STEPS, num_stages=STAGES):
        rg, ru = _rows(e, c, split * STEPS + s, TR, TK, IT)
        acc ^= desc.load([rg, 0]) ^ desc.load([ru, 0])
    pid = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + c
    tl.store(out_ptr + pid, tl.reduce(acc, None, _xor))


@triton.jit
def flat_kernel(w_ptr, ids_ptr, out_ptr, WORDS: tl.constexpr, EXPERT_WORDS: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    e = tl.load(ids_ptr + tl.program_id(1)).to(tl.int64)
    split = tl.program_id(2)
    base = w_ptr + e * EXPERT_WORDS + (split * tl.num_programs(0) + c) * WORDS
    acc = tl.zeros([BLOCK], tl.int32)
    for s in tl.range(0, WORDS, BLOCK):
        acc ^= tl.load(base + s + tl.arange(0, BLOCK))
    pid = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + c
    tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    gen = torch.Generator(device="cuda").manual_seed(5)
    words = torch.randint(-2**31, 2**31 - 1, (E * TR * TK * 32, 16), dtype=torch.int32, device="cuda", generator=gen)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    desc = TensorDescriptor.from_tensor(words, [16, 16])
    expert_words = TR * TK * 32 * 16
    for label, ids, splits in (("M=1 (6 experts, K in 2)", torch.randperm(E, device="cuda")[:6], 2),
                               ("M=64 (256 experts)", torch.arange(E, device="cuda"), 1)):
        ids = ids.to(torch.int32).contiguous()
        steps = TK // splits
        grid = (I // 16, ids.numel(), splits)
        out = torch.empty(grid[0] * grid[1] * grid[2], dtype=torch.int32, device="cuda")
        nbytes = ids.numel() * expert_words * 4
        fns = {
            "plain": lambda: plain_kernel[grid](words, ids, out, steps, TR, TK, IT, 1, num_warps=1),
            "plain-s3": lambda: plain_kernel[grid](words, ids, out, steps, TR, TK, IT, 3, num_warps=1),
            "tma-s2": lambda: tma_kernel[grid](desc, ids, out, steps, TR, TK, IT, 2, num_warps=1),
            "tma-s4": lambda: tma_kernel[grid](desc, ids, out, steps, TR, TK, IT, 4, num_warps=1),
            "tma-s8": lambda: tma_kernel[grid](desc, ids, out, steps, TR, TK, IT, 8, num_warps=1),
            "flat": lambda: flat_kernel[(grid[0] // 4, grid[1], grid[2])](
                words, ids, out, expert_words // (grid[0] // 4 * splits), expert_words, 1024, num_warps=4),
        }
        results = {}
        for name, fn in fns.items():
            fn()
            torch.cuda.synchronize()
            results[name] = out[: (grid[0] // 4 if name == "flat" else grid[0]) * grid[1] * grid[2]].clone()
        # every variant reads the same words of a program: the XOR of all outputs must agree per expert set
        totals = {}
        for name, r in results.items():
            x = r.clone()
            while x.numel() > 1:
                if x.numel() % 2:
                    x = torch.cat([x, torch.zeros(1, dtype=x.dtype, device=x.device)])
                x = x[0::2] ^ x[1::2]
            totals[name] = int(x.item())
        replays = {name: bench.graph_replay(fn) for name, fn in fns.items()}
        times = bench.paired_times(replays, rounds)
        print(f"{label}: {nbytes / 1e6:.1f} MB, floor {nbytes / 4.8e12 * 1e6:.1f} us, xor totals equal: "
              f"{len(set(totals.values())) == 1} {totals}", flush=True)
        for name, t in times.items():
            med = statistics.median(t)
            print(f"  {name:9s} {med * 1e3:8.1f} us  {nbytes / med / 1e9:6.2f} TB/s  HBM {nbytes / 4.8e12 / med * 1e3:.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
