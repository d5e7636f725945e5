"""Session 12 experiment: MXFP4/NVFP4 block scales stored tile by tile (32 rows x 128 values, like the
codes) so that a K step's scales for its rows are one contiguous 128/256-byte piece, instead of a
few bytes of each of 32 rows 128 B apart. The mma loader's scale address is patched in a copy of
fp4_moe.py loaded as a second module (no op registration); its scale buffers hold the tiled bytes
viewed as [E, R, C/G] (same numbers of bytes). Correctness: its pair outputs against the default's
(bit-identical expected) and the default against the reference on CPU. Timing (CUDA): interleaved
rounds of CUDA-graph replays of the pair kernels, variants x tile shapes."""
import dataclasses, importlib, os, sys, time
from pathlib import Path
import torch
sys.path.insert(0, "bench")
import dsv4_compile.kernels as kpkg
from dsv4_compile.kernels import fp4_moe as moe
from dsv4_compile.fp4_tiles import tile_matrix, TILE_COLS

OLD = "    s_words = tl.load(s_ptr + row * stride_s + first // 4 + j, mask=row_ok, other=0)\n"
# Compiled: the scale words through inline asm, which Triton's coalescer leaves in the layout the decode
# uses (a tl.load of the tiled addresses was re-laid out and converted through shared memory).
NEW = """    s_off = _at(row, first // 4 + j, stride_s, TILED, 4 * GROUP)
    if _SCALE_ASM:
        s_words = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.nc.b32 $0, [$1]; }",
            "=r,l,r", [s_ptr + s_off, (row_ok & (s_off >= 0)).to(tl.int32)], dtype=tl.int32, is_pure=True, pack=1)
    else:
        s_words = tl.load(s_ptr + s_off, mask=row_ok, other=0)
"""


def load_patched(tiled=True):
    """tiled: scale words at tiled addresses; else row-major addresses, only the asm load differs."""
    src = Path(moe.__file__).read_text()
    assert src.count(OLD) == 1, "scale load line not found"
    new = NEW if tiled else NEW.replace("_at(row, first // 4 + j, stride_s, TILED, 4 * GROUP)", "row * stride_s + first // 4 + j")
    src = src.replace(OLD, new).replace("_TILE_ROWS = tl.constexpr(TILE_ROWS)\n",
        "_TILE_ROWS = tl.constexpr(TILE_ROWS)\nimport os\n_SCALE_ASM = tl.constexpr(os.environ.get('TRITON_INTERPRET', '0') != '1')\n").split("# ----------------------------------------------------------------------------- registration")[0]
    name = "fp4_moe_ts" if tiled else "fp4_moe_asm"
    path = Path(kpkg.__file__).parent / f"{name}.py"
    path.write_text(src)
    return importlib.import_module(f"dsv4_compile.kernels.{name}")


def tiled_scales(scale: torch.Tensor, group: int) -> torch.Tensor:
    """[E, R, C/G] -> the same bytes tile by tile (32 rows x TILE_COLS/G bytes), viewed as [E, R, C/G]."""
    raw = scale.view(torch.uint8)
    return tile_matrix(raw, TILE_COLS // group).reshape(raw.shape).view(scale.dtype)


def main():
    ts = load_patched()
    asm = load_patched(tiled=False)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    import bench_fp4_moe as bfm
    small = dev == "cpu"
    E, K, I = (8, 256, 128) if small else (256, 4096, 2048)
    gen = torch.Generator(device=dev).manual_seed(0)
    ms_list = (1, 5) if small else tuple(int(m) for m in os.environ.get("MS", "1,8,64,256").split(","))
    base_cfgs = {"default": None}
    if not small:
        mma = moe.DEFAULT_CONFIGS["mma"]
        base_cfgs.update(g16=dataclasses.replace(mma, block_n=16, down_block_n=32),
                         d64=dataclasses.replace(mma, down_block_n=64, down_num_warps=2),
                         both=dataclasses.replace(mma, block_n=16, down_block_n=64, down_num_warps=2))
    results, keep_alive = {}, []
    keep = os.environ.get("CFGS")
    if keep:
        base_cfgs = {k: v for k, v in base_cfgs.items() if k in keep.split(",")}
    for fmt in os.environ.get("FMTS", "mxfp4,nvfp4").split(","):
        w = bfm.tiled_experts(bfm.random_experts(fmt, E, K, I, dev, gen))
        g = moe.GROUP[fmt]
        wt = dict(w, w13_scale=tiled_scales(w["w13_scale"], g), w2_scale=tiled_scales(w["w2_scale"], g))
        for M in ms_list:
            x = torch.randn(M, K, device=dev, generator=gen).to(torch.bfloat16 if dev == "cuda" else torch.float32)
            ids = torch.rand(M, E, device=dev, generator=gen).topk(6, dim=-1).indices.to(torch.int32)
            wts = torch.rand(M, 6, device=dev, generator=gen) / 4
            args, args_t = bfm.op_args(x, ids, wts, w), bfm.op_args(x, ids, wts, wt)
            for cname, cfg in base_cfgs.items():
                if cfg is None:
                    size_cls = moe.size_class(M * 6, E, fmt)
                    cfg_used = moe.DEFAULT_CONFIGS[size_cls]
                else:
                    if M * 6 // E >= 4:  # the mma class only
                        continue
                    cfg_used = cfg
                if cfg_used.path != "mma":
                    continue
                a = moe.fp4_moe_pairs_triton(*args, config=cfg_used)
                b = ts.fp4_moe_pairs_triton(*args_t, config=cfg_used)
                c = asm.fp4_moe_pairs_triton(*args, config=cfg_used)
                valid = (ids >= 0).reshape(-1)
                same = torch.equal(a[valid], b[valid]) and torch.equal(a[valid], c[valid])
                err = ""
                if small:
                    ref = moe.fp4_moe_reference(x, ids, wts, *args[3:])
                    from dsv4_compile.kernels.moe_pairs import combine_pairs
                    got = combine_pairs(b, ids, E, x.dtype)
                    err = f" max|tiled-scales - ref| {float((got - ref).abs().max()):.3e} (ref max {float(ref.abs().max()):.2f})"
                print(f"{fmt} M={M} {cname} {cfg_used}: tiled-scale pairs == default pairs: {same}{err}", flush=True)
                if small or os.environ.get("NCU") == "1":
                    continue
                fa = bfm.graph_replay(lambda args=args, c=cfg_used: moe.fp4_moe_pairs_triton(*args, config=c))
                fb = bfm.graph_replay(lambda args=args_t, c=cfg_used: ts.fp4_moe_pairs_triton(*args, config=c))
                keep_alive.append((args, args_t, w, wt))  # the graphs hold raw pointers to these
                results[(fmt, M, cname, "rowmajor")] = (fa, [])
                results[(fmt, M, cname, "tiledscales")] = (fb, [])
                fc = bfm.graph_replay(lambda args=args, c=cfg_used: asm.fp4_moe_pairs_triton(*args, config=c))
                results[(fmt, M, cname, "asmload")] = (fc, [])
    if small or os.environ.get("NCU") == "1":
        return
    import triton.testing
    for rnd in range(int(os.environ.get("ROUNDS", "5"))):
        for key, (fn, times) in results.items():
            if rnd == 0:
                print("first replay of", key, flush=True)
                fn(); torch.cuda.synchronize()
            times.append(triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e3)
        print(f"round {rnd} done", flush=True)
    print("| fmt | M | tiles | scales row-major us (min / median of rounds) | row-major, asm load | tiled, asm load | tiled / row-major (medians) |")
    print("|---|---|---|---|---|---|---|")
    for (fmt, M, cname, kind), (fn, times) in results.items():
        if kind != "rowmajor":
            continue
        t0 = sorted(times); t1 = sorted(results[(fmt, M, cname, "tiledscales")][1])
        t2 = sorted(results[(fmt, M, cname, "asmload")][1])
        m0, m1, m2 = t0[len(t0) // 2], t1[len(t1) // 2], t2[len(t2) // 2]
        print(f"| {fmt} | {M} | {cname} | {t0[0]:.1f} / {m0:.1f} | {t2[0]:.1f} / {m2:.1f} | {t1[0]:.1f} / {m1:.1f} | {m1 / m0:.3f} |")


if __name__ == "__main__":
    main()
