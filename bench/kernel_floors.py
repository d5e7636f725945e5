"""The kernel floor tables: runs bench_indexer, bench_sparse_mla and bench_fp4_moe (their own
`main()` with `--out`) and collects the shared memory of every compiled config they report;
then cross-compiles for sm_120 every config of the dsv4 Triton kernels this process compiled
(the benches' and the end-to-end steps') and checks it against the sm_120 limit."""
from __future__ import annotations

import contextlib
import importlib
import json
import pkgutil
import shutil
import sys
import tarfile
import time
import traceback
from pathlib import Path
from typing import Iterator

SM120_SHARED_LIMIT = 101_376
# (name, module in bench/, the JSON it writes, its usual runtime on the H200 in seconds)
KERNEL_BENCHES = (
    ("indexer", "bench_indexer", "bench_indexer.json", 180.0),
    ("sparse_mla", "bench_sparse_mla", "sparse_mla.json", 180.0),
    ("fp4_moe", "bench_fp4_moe", "results.json", 150.0),
)
RAW_ARCHIVE = "kernel_benches.tar.gz"


@contextlib.contextmanager
def _argv(args: list[str]) -> Iterator[None]:
    saved = sys.argv
    sys.argv = args
    try:
        yield
    finally:
        sys.argv = saved


def shared_memory_rows(name: str, data: dict) -> list[dict]:
    """[{bench, config, shared, status}] from one kernel bench's JSON. status: "ok" (<= the
    sm_120 limit), "over", or "unchecked: <why>" where the bench recorded no byte count."""
    if name == "indexer":
        raw = [(f"{c['kernel']} warps={c['num_warps']} stages={c['num_stages']}", c["shared"])
               for c in data.get("kernel_configs", [])]
    elif name == "sparse_mla":
        raw = list(data.get("shared", {}).items())
    else:
        raw = [(f"{c['kernel']} {c['device']} warps={c['num_warps']} stages={c['num_stages']}", c["shared"])
               for c in data.get("shared_memory", [])]
    rows = []
    for config, shared in raw:
        if isinstance(shared, int):
            status = "ok" if shared <= SM120_SHARED_LIMIT else "over"
        else:
            status, shared = f"unchecked: {shared}", None
        rows.append({"bench": name, "config": config, "shared": shared, "status": status})
    return rows


def run_kernel_benches(out: Path, deadline: float, smoke: bool = False) -> list[dict]:
    """Runs each kernel bench into out/kernels/<name>/ while the deadline (time.monotonic())
    leaves its usual runtime; returns one record per bench: {name, status, seconds, markdown,
    shared_memory}. The raw outputs are then packed into out/RAW_ARCHIVE (the device tool
    returns at most 8 files)."""
    records = []
    raw_dir = out / "kernels"
    for name, module_name, json_name, usual_s in KERNEL_BENCHES:
        record = {"name": name, "status": "", "seconds": 0.0, "markdown": "", "shared_memory": []}
        records.append(record)
        if time.monotonic() + usual_s > deadline:
            record["status"] = f"skipped: less than its usual {usual_s:.0f} s left in the budget"
            print(f"[kernels] {name}: {record['status']}", flush=True)
            continue
        target = raw_dir / name
        target.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        try:
            module = importlib.import_module(f"bench.{module_name}")
            with _argv([module.__file__, "--out", str(target)] + (["--smoke"] if smoke else [])):
                code = module.main()
            record["status"] = "ok" if not code else f"exit code {code}"
        except (Exception, SystemExit) as exc:  # a failing bench is recorded; the suite goes on
            record["status"] = f"failed: {type(exc).__name__}: {exc}"
            record["traceback"] = traceback.format_exc()[-4000:]
        record["seconds"] = round(time.monotonic() - start, 1)
        written = target / json_name
        if written.exists():
            record["shared_memory"] = shared_memory_rows(name, json.loads(written.read_text()))
        for table in sorted(target.glob("*.md")):
            record["markdown"] += table.read_text()
        print(f"[kernels] {name}: {record['status']} in {record['seconds']} s, "
              f"{len(record['shared_memory'])} compiled configs", flush=True)
    if raw_dir.exists():
        with tarfile.open(out / RAW_ARCHIVE, "w:gz") as archive:
            archive.add(raw_dir, arcname="kernels")
        shutil.rmtree(raw_dir)
    return records


def _jit_functions() -> list[tuple[str, object]]:
    """(module.name, JIT function) of every Triton kernel in dsv4_compile.kernels that holds
    compiled configs (autotuners are unwrapped; the interpreter compiles nothing)."""
    import dsv4_compile.kernels as package

    found: dict[int, tuple[str, object]] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            while obj is not None and not hasattr(obj, "device_caches") and hasattr(obj, "fn"):
                obj = obj.fn
            if getattr(obj, "device_caches", None):
                found.setdefault(id(obj), (f"{info.name}.{name}", obj))
    return list(found.values())


def sm120_stats(compiled) -> dict:
    """One compiled Triton kernel (its source and launch options, register cap included) compiled
    again for sm_120: {shared (bytes), regs, spill_stores, spill_loads} (bench_sparse_mla.ptxas_stats)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from bench.bench_sparse_mla import ptxas_stats

    meta = compiled.metadata
    options = {key: getattr(meta, key) for key in ("num_warps", "num_stages", "num_ctas", "maxnreg")
               if getattr(meta, key, None) is not None}
    again = triton.compile(compiled.src, target=GPUTarget("cuda", 120, 32), options=options)
    return {"shared": int(again.metadata.shared), **ptxas_stats(again.asm["ptx"], 120)}


def sm120_check(deadline: float) -> list[dict]:
    """Every config of the dsv4 kernels compiled in this process, compiled again for sm_120
    while time.monotonic() < deadline: [{bench, config, shared, regs, spills (spill-store bytes a
    thread), status}] (status as in shared_memory_rows; regs and spills where it compiled). These are
    the configs this GPU chose: an sm_120 GPU chooses some of its own (the indexer's scoring kernel
    takes no register cap there, the FP4 MoE's prefill class 64-column K steps)."""
    rows = []
    for name, function in _jit_functions():
        for cache in function.device_caches.values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for compiled in kernels.values():
                meta = compiled.metadata
                row = {"bench": "sm_120 cross-compile", "config": f"{name} warps={meta.num_warps} "
                       f"stages={meta.num_stages} local shared={meta.shared}", "shared": None}
                if time.monotonic() > deadline:
                    row["status"] = "unchecked: time budget spent"
                else:
                    try:
                        stats = sm120_stats(compiled)
                        row.update(shared=stats["shared"], regs=stats["regs"], spills=stats["spill_stores"])
                        row["status"] = "ok" if row["shared"] <= SM120_SHARED_LIMIT else "over"
                    except Exception as exc:  # noqa: BLE001 - recorded as unchecked, not hidden
                        row["status"] = f"unchecked: sm_120 compile failed: {type(exc).__name__}: {str(exc)[:200]}"
                rows.append(row)
    return rows
