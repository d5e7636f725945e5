"""Session 22: (A) what a pure read of M=1's expert bytes costs under the MoE bench's timing (CUDA-graph
replay between events, after an L2 flush): an empty kernel, one streaming read of all the bytes, two
dependent reads (gate/up bytes, then down bytes), against the op; (B) the op's kernels one by one
(torch.profiler over graph replays) at M = 1, 8, 64, 256, each kernel's bytes over its time."""
import statistics, sys, time
import torch, triton, triton.language as tl
sys.path[:0] = ["bench"]
import bench_fp4_moe as bench
from measure import kernel_breakdown
from dsv4_compile.kernels import fp4_moe as moe
from dsv4_compile.fp4_tiles import tile_fp4

E, K, I, TOPK = 256, 4096, 2048, 6


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def read_kernel(w_ptr, out_ptr, WORDS: tl.constexpr, BLOCK: tl.constexpr):
    """Program p XOR-reduces words [p * WORDS, (p + 1) * WORDS) of w (4 warps, BLOCK words a step)."""
    base = w_ptr + tl.program_id(0).to(tl.int64) * WORDS
    acc = tl.zeros([BLOCK], tl.int32)
    for s in tl.range(0, WORDS, BLOCK):
        acc ^= tl.load(base + s + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.program_id(0), tl.reduce(acc, 0, _xor))


@triton.jit
def empty_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 0)


def reader(nbytes, out, buf):
    words_per_prog = 8192  # 32 KB a program
    progs = nbytes // (4 * words_per_prog)
    view = buf[: progs * words_per_prog]
    return lambda: read_kernel[(progs,)](view, out, words_per_prog, 1024, num_warps=4), progs * words_per_prog * 4


def main():
    gen = torch.Generator(device="cuda").manual_seed(7)
    print("torch", torch.__version__, "device", torch.cuda.get_device_name(), flush=True)
    ws = {fmt: bench.random_experts(fmt, E, K, I, "cuda", gen) for fmt in ("mxfp4", "nvfp4")}
    ws = {fmt: dict(w, w13=tile_fp4(w["w13"]), w2=tile_fp4(w["w2"])) for fmt, w in ws.items()}
    # (A) M=1 bound
    w = ws["mxfp4"]
    per = {n: w[n][0].numel() * w[n].element_size() for n in ("w13", "w13_scale", "w2", "w2_scale")}
    gu_bytes, dn_bytes = 6 * (per["w13"] + per["w13_scale"]), 6 * (per["w2"] + per["w2_scale"])
    buf = torch.randint(-2**31, 2**31 - 1, ((gu_bytes + dn_bytes) // 4 + 8192,), dtype=torch.int32, device="cuda",
                        generator=gen)
    buf2 = torch.randint(-2**31, 2**31 - 1, (dn_bytes // 4 + 8192,), dtype=torch.int32, device="cuda", generator=gen)
    out = torch.empty(1 << 16, dtype=torch.int32, device="cuda")
    one, one_b = reader(gu_bytes + dn_bytes, out, buf)
    gu, gu_b = reader(gu_bytes, out, buf)
    dn, dn_b = reader(dn_bytes, out[32768:], buf2)
    x = torch.randn(1, K, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(1, E, device="cuda", generator=gen).topk(TOPK, dim=1).indices.to(torch.int32)
    weights = torch.rand(1, TOPK, device="cuda", generator=gen)
    fns = {"empty kernel": lambda: empty_kernel[(1,)](out),
           "one read (all M=1 bytes)": one,
           "two dependent reads": lambda: (gu(), dn()),
           "op M=1 (mxfp4)": lambda: moe.fp4_moe_pairs_triton(*bench.op_args(x, ids, weights, w))}
    floor_bytes = bench.touched_bytes(ids, w, K)
    replays = {k: bench.graph_replay(f) for k, f in fns.items()}
    times = bench.paired_times(replays, 100)
    print(f"(A) M=1 mxfp4: touched bytes {floor_bytes / 1e6:.1f} MB (gate/up {gu_bytes / 1e6:.1f}, down {dn_bytes / 1e6:.1f}), "
          f"floor {floor_bytes / 4.8e12 * 1e6:.1f} us; read bytes one {one_b / 1e6:.1f}, two {(gu_b + dn_b) / 1e6:.1f}")
    for k, t in times.items():
        med = statistics.median(t)
        print(f"  {k:26s} {med * 1e3:7.1f} us   floor / time {floor_bytes / 4.8e12 / med * 1e3:.3f}", flush=True)
    # (B) the op's kernels one by one
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for fmt in ("mxfp4", "nvfp4"):
        w = ws[fmt]
        per = {n: w[n][0].numel() * w[n].element_size() for n in ("w13", "w13_scale", "w2", "w2_scale")}
        for tokens in (1, 8, 64, 256):
            x = torch.randn(tokens, K, device="cuda", generator=gen).to(torch.bfloat16)
            ids = torch.rand(tokens, E, device="cuda", generator=gen).topk(TOPK, dim=1).indices.to(torch.int32)
            weights = torch.rand(tokens, TOPK, device="cuda", generator=gen)
            touched = torch.unique(ids).numel()
            replay = bench.graph_replay(lambda: moe.fp4_moe_pairs_triton(*bench.op_args(x, ids, weights, w)))

            def step():
                flush.zero_()
                replay()
            found = kernel_breakdown(step, torch.device("cuda"), steps=20)
            gu_b = touched * (per["w13"] + per["w13_scale"])
            dn_b = touched * (per["w2"] + per["w2_scale"])
            print(f"(B) {fmt} M={tokens} class={moe.size_class(tokens * TOPK, E, fmt)} touched {touched} experts; "
                  f"GPU span {found['gpu_span_us_per_step']:.1f} us, idle {found['gpu_idle_us_per_step']:.1f} us a replay (flush included)")
            for k in found["kernels"]:
                name = k["name"]
                frac = ""
                if "gate_up" in name:
                    frac = f"  gate/up bytes / time: HBM {gu_b / 4.8e12 / (k['us_per_step'] * 1e-6):.3f}"
                elif "down" in name:
                    frac = f"  down bytes / time: HBM {dn_b / 4.8e12 / (k['us_per_step'] * 1e-6):.3f}"
                print(f"    {name[:60]:60s} {k['us_per_step']:8.1f} us{frac}", flush=True)


if __name__ == "__main__":
    main()
