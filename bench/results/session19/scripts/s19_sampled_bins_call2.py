"""Session 19 call 2: bins placed from a sample (no statistics kernel) vs HEAD's select."""
import math, sys, statistics, json
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

def paired(fns, rounds=7):
    res = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            res[k].append(g(fn))
    return {k: statistics.median(v) for k, v in res.items()}

def with_samples(n, fn):
    def run():
        keep = sel.SAMPLES
        sel.SAMPLES = n
        try:
            return fn()
        finally:
            sel.SAMPLES = keep
    return run

def meta_of(ws, lens, B, T):
    """[candidates or -1, sure picks] per row, from the select's last allocation."""
    got = []
    empty = torch.empty
    def rec(*a, **k):
        got.append(empty(*a, **k)); return got[-1]
    torch.empty = rec
    try:
        o = empty(B, T, TOPK, dtype=torch.int32, device=dev)
        sel.select_topk_triton(ws, lens, TOPK, o)
    finally:
        torch.empty = empty
    return got[-1]

out = []
for (B, ctx, T) in [(64, 131072, 1), (64, 131072, 4), (64, 8192, 1), (64, 512, 1), (1, 131072, 1), (16, 131072, 1)]:
    inp = make_inputs(B, ctx, T, 64, 128, MAXP, torch.float8_e4m3fn, dev, gen)
    scores = reference_scores(inp, new)
    lens = inp[5]
    errs = {}
    idx, _ = old.indexer_topk_triton(*inp, TOPK)
    errs["old"] = check_selection(idx, inp, TOPK, new, torch.float8_e4m3fn, scores=scores)
    fns = {"old": lambda: old.indexer_topk_triton(*inp, TOPK)}
    for s in (512, 256, 1024):
        f = with_samples(s, lambda: new.indexer_topk_triton(*inp, TOPK))
        errs[f"new s{s}"] = check_selection(f()[0], inp, TOPK, new, torch.float8_e4m3fn, scores=scores)
        fns[f"new s{s}"] = f
    ws, _ = new.indexer_scores_triton(*inp, TOPK)
    meta = meta_of(ws, lens, B, T)
    long_rows = lens.reshape(-1) > TOPK
    m = meta[long_rows]
    cand = m[:, 0].float()
    info = dict(fallback=int((m[:, 0] < 0).sum()) if m.numel() else None,
                cand_mean=cand[cand >= 0].mean().item() if m.numel() else None,
                cand_max=cand.max().item() if m.numel() else None)
    t = paired(fns)
    o = torch.empty(B, T, TOPK, dtype=torch.int32, device=dev)
    o2 = torch.empty_like(o)
    ows, _ = old.indexer_scores_triton(*inp, TOPK)
    st = paired({"old select": lambda: old.select_topk_triton(ows, lens, TOPK, o2),
                 "new select": lambda: sel.select_topk_triton(ws, lens, TOPK, o)})
    row = dict(B=B, ctx=ctx, T=T, times=t, select=st, errs=errs, **info)
    print(json.dumps(row), flush=True)
    out.append(row)
    del inp, scores, ws, ows
    torch.cuda.empty_cache()

print("\n| B | ctx | T | " + " | ".join(out[0]["times"]) + " | old select | new select | fallback rows | cand mean / max |")
print("|---" * (len(out[0]["times"]) + 8) + "|")
for r in out:
    print(f"| {r['B']} | {r['ctx']} | {r['T']} | " + " | ".join(f"{v:.1f}" for v in r["times"].values())
          + f" | {r['select']['old select']:.1f} | {r['select']['new select']:.1f} | {r['fallback']} | {r['cand_mean']} / {r['cand_max']} |")
