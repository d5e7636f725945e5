"""Session 14: the step's bf16 projections by layout, paired CUDA-graph replays with an L2 flush."""
import statistics, sys, os
import torch
import torch.nn.functional as F
sys.path.insert(0, os.getcwd())
from bench.bench_fp4_moe import graph_replay, paired_times

torch.manual_seed(0)
dev = "cuda"
SHAPES = {"lm_head": (4096, 129280), "q_b": (1024, 32768), "o_b": (8192, 4096), "shared_gate_up": (4096, 4096),
          "shared_down": (2048, 4096)}
print(torch.__version__, torch.cuda.get_device_name())
for M in (1, 64, 256):
    for name, (K, N) in SHAPES.items():
        if M == 1 and name != "lm_head":
            continue
        W = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 64
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x, W).float()
        fns = {"linear": lambda: F.linear(x, W), "mm_Wxt": lambda: torch.mm(W, x.t()),
               "mm_Wxt_copy": lambda: torch.mm(W, x.t()).t().contiguous()}
        for label, fn in fns.items():
            out = fn()
            out = out.t() if label == "mm_Wxt" else out
            err = (out.float() - ref).abs().max().item()
            assert err < 0.05 * ref.abs().max().item(), (name, label, err)
        times = paired_times({k: graph_replay(f) for k, f in fns.items()}, 200)
        base = times["linear"]
        floor_us = (N * K * 2 + M * K * 2 + M * N * 2) / 4.8e12 * 1e6
        cells = []
        for k, t in times.items():
            d = [a - b for a, b in zip(t, base)]
            cells.append(f"{k} {statistics.median(t)*1e3:.1f}us ({statistics.median(d)*1e3:+.1f}) hbm {floor_us/(statistics.median(t)*1e3):.2f}")
        print(f"M={M} {name} K={K} N={N} floor {floor_us:.1f}us | " + " | ".join(cells), flush=True)
        del W
# q_b of attention and of the indexer share their input (CSA layers): fused vs separate
for M in (64, 256):
    x = torch.randn(M, 1024, device=dev, dtype=torch.bfloat16)
    Wq = torch.randn(32768, 1024, device=dev, dtype=torch.bfloat16) / 32
    Wi = torch.randn(8192, 1024, device=dev, dtype=torch.bfloat16) / 32
    Wc = torch.cat([Wq, Wi])
    fns = {"separate": lambda: (F.linear(x, Wq), F.linear(x, Wi)), "fused": lambda: F.linear(x, Wc).split([32768, 8192], -1)}
    times = paired_times({k: graph_replay(f) for k, f in fns.items()}, 300)
    d = [a - b for a, b in zip(times["fused"], times["separate"])]
    q = statistics.quantiles(d, n=4)
    print(f"M={M} q_b+idx_q_b separate {statistics.median(times['separate'])*1e3:.1f}us fused {statistics.median(times['fused'])*1e3:.1f}us paired {statistics.median(d)*1e3:+.1f} ({q[0]*1e3:+.1f}/{q[2]*1e3:+.1f})", flush=True)
