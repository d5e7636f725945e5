"""Record the scoring kernel's launch as indexer_scores_triton would issue it on an H200 and
cross-compile it for sm_90 (no GPU): registers, TTGIR layout ops, SASS counts of the page loop.

Run WITHOUT TRITON_INTERPRET. Usage as a module: `records(mod, T)`, `compile_launch(launch)`,
`report(compiled)`.
"""
from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench")]
from bench_sparse_mla import compiled_stats, cross_compile  # noqa: E402

NV_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


class _Recorder:
    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches.append(types.SimpleNamespace(kernel=self.kernel, grid=grid,
                                                       args=args, meta=dict(meta)))
            return None
        return launch


def small_inputs(tokens, batch=2, heads=64, dim=128, max_pages=8, phys=32, seed=0):
    """fp8 q / keys, f32 scales; every request has max_pages valid pages (lens > topk)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, heads, dim, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(batch, tokens, heads, generator=gen) * heads ** -0.5
    k = torch.randn(phys, 64, dim, generator=gen).to(torch.float8_e4m3fn)
    ks = torch.rand(phys, 64, generator=gen) + 0.5
    pt = torch.stack([torch.randperm(phys, generator=gen)[:max_pages] for _ in range(batch)])
    lens = (max_pages * 64 - tokens + 1 + torch.arange(tokens)).clamp(max=max_pages * 64)
    lens = lens.expand(batch, tokens)
    return q, w, k, ks, pt.to(torch.int32).contiguous(), lens.to(torch.int32).contiguous()


def record(mod, tokens, kernel_name="_score_pages_kernel", splits=33, **kw):
    """The launch indexer_scores_triton of `mod` makes, with the constexprs / options a CUDA
    launch of fp8 q and keys would get (DOT_DTYPE fp8, PRECISION None, FOR_LOOPS, PIN_IDS,
    FP8_SCORE_STAGES, FP8_SCORE_MAX_REGS)."""
    orig = getattr(mod, kernel_name)
    rec = _Recorder(orig)
    setattr(mod, kernel_name, rec)
    try:
        mod.indexer_scores_triton(*small_inputs(tokens), 512, splits=splits, **kw)
    finally:
        setattr(mod, kernel_name, orig)
    (launch,) = rec.launches
    warps = launch.meta["num_warps"]
    launch.meta.update(DOT_DTYPE=tl.float8e4nv, PRECISION=None, FOR_LOOPS=True,
                       PIN_IDS=kw.get("pin_ids", mod.DEFAULT_PIN_IDS),
                       num_stages=kw.get("num_stages") or mod.FP8_SCORE_STAGES)
    max_regs = kw.get("max_regs")
    if max_regs is None:
        max_regs = mod.FP8_SCORE_MAX_REGS.get(warps, 0)
    launch.meta["maxnreg"] = max_regs or None
    return launch


def sass_of(compiled) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        return subprocess.run([str(NV_BIN / "nvdisasm"), "-c", str(cubin)], capture_output=True,
                              text=True, check=True).stdout


_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def parse_sass(text):
    """[(label or None, opcode, full text)] in order; labels become pseudo rows."""
    rows = []
    for line in text.splitlines():
        m = _LABEL.match(line)
        if m:
            rows.append((m.group(1), None, line))
            continue
        m = _INSN.match(line)
        if m:
            body = m.group(2).strip()
            body = re.sub(r"^@!?U?P\w+\s+", "", body)
            rows.append((None, body.split()[0], body))
    return rows


def loops(rows):
    """Backward branches: (start index of target label, index of branch)."""
    labels = {r[0]: i for i, r in enumerate(rows) if r[0]}
    out = []
    for i, (lab, op, body) in enumerate(rows):
        if op in ("BRA", "BRA.U") or (op and op.startswith("BRA")):
            m = re.search(r"(\.L_x_\d+)", body)
            if m and m.group(1) in labels and labels[m.group(1)] < i:
                out.append((labels[m.group(1)], i))
    return out


COUNT_OPS = ("SHFL", "FMNMX", "FMUL", "FADD", "FFMA", "HGMMA", "QGMMA", "WARPGROUP", "STS", "LDS",
             "LDSM", "STG", "LDG", "LDGSTS", "BAR", "SYNCS", "F2FP", "PRMT", "I2F", "F2I")


def op_counts(rows):
    c = collections.Counter()
    for lab, op, body in rows:
        if op is None:
            continue
        c["total"] += 1
        base = op.split(".")[0]
        c[base] += 1
    return c


def main_loop(rows):
    """The outermost backward-branch region that contains an HGMMA (the page loop)."""
    best = None
    for s, e in loops(rows):
        if any(op and "GMMA" in op for _, op, _ in rows[s:e + 1]):
            if best is None or (e - s) > (best[1] - best[0]):
                best = (s, e)
    return best


def ttgir_layout_ops(ttgir: str):
    """convert_layout / local_alloc / local_load / local_store lines (shortened)."""
    out = []
    for line in ttgir.splitlines():
        if re.search(r"ttg\.(convert_layout|local_alloc|local_load|local_store)|tt\.reshape|"
                     r"\"tt\.reduce\"|tt\.reduce|ttng\.warp_group_dot |ttg\.async_copy", line):
            out.append(line.strip()[:260])
    return out


def report(name, launch, show_ttgir=True, dump_dir=None):
    stats = compiled_stats(launch, 90)
    compiled = cross_compile(launch, 90)
    sass = sass_of(compiled)
    rows = parse_sass(sass)
    loop = main_loop(rows)
    whole = op_counts(rows)
    body = op_counts(rows[loop[0]:loop[1] + 1]) if loop else collections.Counter()
    print(f"== {name}: warps {launch.meta.get('num_warps')} stages {launch.meta.get('num_stages')} "
          f"maxnreg {launch.meta.get('maxnreg')} -> {stats}")
    keys = ["total"] + [k for k in COUNT_OPS if whole[k]]
    print("   whole kernel:", {k: whole[k] for k in keys})
    print("   page loop   :", {k: body[k] for k in keys}, f"(rows {loop})")
    lay = ttgir_layout_ops(compiled.asm["ttgir"])
    if show_ttgir:
        for line in lay:
            print("   ttgir:", line)
    if dump_dir:
        d = Path(dump_dir)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{name}.ttgir").write_text(compiled.asm["ttgir"])
        (d / f"{name}.ptx").write_text(compiled.asm["ptx"])
        (d / f"{name}.sass").write_text(sass)
    return compiled, stats, whole, body
