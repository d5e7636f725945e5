"""Interpreter check of idx_variant's epilogue variants against indexer_scores_reference and the
original kernel's workspace (TRITON_INTERPRET=1, f32 dots). Usage: python check_interp.py [variant...]"""
import os
import sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from dsv4_compile.kernels import indexer_topk as orig  # noqa: E402
import idx_variant as iv  # noqa: E402

CASES = [  # (B, T, H, D, max_pages, phys, seed)
    (2, 4, 64, 128, 6, 16, 1),
    (2, 1, 64, 128, 6, 16, 2),
    (2, 3, 64, 128, 5, 16, 3),   # a masked token column
    (1, 8, 64, 64, 4, 8, 4),     # two token blocks (N_TBLOCKS = 2)
    (2, 4, 16, 64, 4, 8, 5),     # H = 16: 64 columns
]


def inputs(B, T, H, D, max_pages, phys, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(B, T, H, generator=g) * H ** -0.5
    k = torch.randn(phys, 64, D, generator=g).to(torch.float8_e4m3fn)
    ks = torch.rand(phys, 64, generator=g) + 0.5
    pt = torch.stack([torch.randperm(phys, generator=g)[:max_pages] for _ in range(B)]).to(torch.int32)
    # lens: per request different, > topk for most tokens, not page aligned
    base = torch.randint(max_pages * 64 // 2, max_pages * 64 - T + 1, (B, 1), generator=g)
    lens = (base + torch.arange(T)).clamp(max=max_pages * 64).to(torch.int32)
    return q, w, k, ks, pt.contiguous(), lens.contiguous()


names = sys.argv[1:] or list(iv.VARIANTS)
topk = 64
for case in CASES:
    args = inputs(*case)
    lens = args[5]
    S = args[4].shape[1] * 64
    ref = orig.indexer_scores_reference(*args)
    valid = torch.arange(S) < lens[..., None]
    ws0 = torch.full((case[0], case[1], S), float("nan"))
    orig.indexer_scores_triton(*args, topk, workspace=ws0)
    e0 = (ws0[valid] - ref[valid]).abs().max().item()
    scale = ref[valid].abs().max().item()
    print(f"case B,T,H,D,pages={case[:5]}: orig vs ref max abs {e0:.3g} (|ref| max {scale:.3g})")
    for name in names:
        ws = torch.full_like(ws0, float("nan"))
        iv.indexer_scores_triton(*args, topk, workspace=ws, epi=iv.VARIANTS[name])
        d_ref = (ws[valid] - ref[valid]).abs().max().item()
        d_orig = (ws[valid] - ws0[valid]).abs().max().item()
        untouched = bool(torch.isnan(ws[~valid]).all())
        exact = "exact" if name in iv.EXACT else "inexact/ablation"
        ok = (d_ref <= 1e-5 * max(scale, 1.0) and untouched) if name in iv.EXACT else untouched
        print(f"   {name:16s} vs ref {d_ref:.3g}  vs orig {d_orig:.3g}  invalid slots untouched "
              f"{untouched}  [{exact}] {'OK' if ok else 'FAIL'}", flush=True)
