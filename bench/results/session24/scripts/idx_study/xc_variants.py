"""Cross-compile (sm_90) the original scoring kernel and idx_variant's variants, T=4 and T=1
(the real launch config), and print registers / spills / SASS counts of the page loop.
Usage: python xc_variants.py [T ...] [--only name,name] [--ttgir]"""
import sys
sys.path.insert(0, "/work/main/tmp_gpu/idx_study")
import xc_util as X  # noqa: E402
from dsv4_compile.kernels import indexer_topk as orig  # noqa: E402
import idx_variant as iv  # noqa: E402

argv = sys.argv[1:]
show = "--ttgir" in argv
only = None
if "--only" in argv:
    only = argv[argv.index("--only") + 1].split(",")
Ts = [int(a) for a in argv if a.isdigit()] or [4, 1]
for T in Ts:
    if only is None or "orig" in only:
        X.report(f"orig_T{T}", X.record(orig, T), show_ttgir=show, dump_dir="dumps")
    for name, epi in iv.VARIANTS.items():
        if only is not None and name not in only:
            continue
        try:
            X.report(f"{name}_T{T}", X.record(iv, T, epi=epi), show_ttgir=show, dump_dir="dumps")
        except Exception as exc:  # noqa: BLE001
            print(f"== {name}_T{T}: FAILED {type(exc).__name__}: {str(exc)[:400]}")
