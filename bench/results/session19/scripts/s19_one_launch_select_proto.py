"""Session 19 call: the one-launch sampled-threshold select vs the four-kernel select (HEAD)."""
import math, sys, time, statistics, json
sys.path.insert(0, "tmp_gpu/old")
import torch, triton
import triton.testing as tt
from dsv4_compile.kernels import indexer_topk as new
from dsv4_compile.kernels import topk_select as sel
import old_indexer_topk as old
sys.path.insert(0, "bench")
from bench_indexer import make_inputs, check_selection, reference_scores

dev = torch.device("cuda")
MAXP = math.ceil(262_208 / 64)
TOPK = 512
gen = torch.Generator(device=dev).manual_seed(0)

def g(fn):
    return tt.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3

def paired(fns, rounds=5):
    res = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            res[k].append(g(fn))
    return {k: statistics.median(v) for k, v in res.items()}

VARIANTS = {
    "new": {},
    "new w4": dict(select_warps=4),
    "new chunk1024": dict(chunk=1024),
    "new chunk4096": dict(chunk=4096),
    "new prog/2": "half",
}
out = []
for (B, ctx, T) in [(64, 131072, 1), (64, 131072, 4), (64, 8192, 1), (64, 512, 1), (1, 131072, 1), (1, 131072, 4), (16, 131072, 1)]:
    inp = make_inputs(B, ctx, T, 64, 128, MAXP, torch.float8_e4m3fn, dev, gen)
    scores = reference_scores(inp, new)
    rows = B * T
    fns = {"old": lambda: old.indexer_topk_triton(*inp, TOPK)}
    errs = {}
    idx, _ = old.indexer_topk_triton(*inp, TOPK)
    errs["old"] = check_selection(idx, inp, TOPK, new, torch.float8_e4m3fn, scores=scores)
    for name, kw in VARIANTS.items():
        if kw == "half":
            n_chunks = triton.cdiv(MAXP * 64, 2048)
            kw = dict(select_programs=max(1, sel.programs_per_row(rows, n_chunks, dev) // 2))
        idx, _ = new.indexer_topk_triton(*inp, TOPK, **kw)
        errs[name] = check_selection(idx, inp, TOPK, new, torch.float8_e4m3fn, scores=scores)
        fns[name] = (lambda kw=kw: new.indexer_topk_triton(*inp, TOPK, **kw))
    # fast-path statistics of the default select on the scores workspace
    ws, _ = new.indexer_scores_triton(*inp, TOPK)
    o = torch.empty(B, T, TOPK, dtype=torch.int32, device=dev)
    cnt = torch.zeros(rows, 2, dtype=torch.int32, device=dev)
    sel.select_topk_triton(ws, inp[5], TOPK, o, counters=cnt)
    c = cnt[:, 0][inp[5].reshape(-1) > sel.candidate_cap(TOPK)]
    fast = ((c >= TOPK) & (c <= sel.candidate_cap(TOPK))).float().mean().item() if c.numel() else float("nan")
    cand = (c.float().mean().item(), c.min().item(), c.max().item()) if c.numel() else None
    t = paired(fns)
    # selection alone, same workspace
    o2 = torch.empty_like(o)
    ows, _ = old.indexer_scores_triton(*inp, TOPK)
    cnt2 = torch.zeros(rows, 2, dtype=torch.int32, device=dev)
    def new_sel():
        cnt2.zero_()
        sel.select_topk_triton(ws, inp[5], TOPK, o, counters=cnt2)
    sel_t = paired({"old select": lambda: old.select_topk_triton(ows, inp[5], TOPK, o2),
                    "new select (+zero_)": new_sel,
                    "score only": lambda: new.indexer_scores_triton(*inp, TOPK)})
    row = dict(B=B, ctx=ctx, T=T, times=t, select=sel_t, errs=errs, fast=fast, cand=cand)
    print(json.dumps(row), flush=True)
    out.append(row)
    del inp, scores, ws, ows
    torch.cuda.empty_cache()

print("\n| B | ctx | T | " + " | ".join(out[0]["times"]) + " | old sel | new sel | score | fast | cand mean/min/max |")
for r in out:
    print(f"| {r['B']} | {r['ctx']} | {r['T']} | " + " | ".join(f"{v:.1f}" for v in r["times"].values())
          + f" | {r['select']['old select']:.1f} | {r['select']['new select (+zero_)']:.1f} | {r['select']['score only']:.1f} | {r['fast']} | {r['cand']} |")
try:
    for kk in sel._select_kernel.device_caches[0][0].values():
        print("select kernel:", kk.n_regs, kk.n_spills, kk.metadata.shared, kk.metadata.num_warps)
except Exception as exc:
    print("no kernel info", exc)
