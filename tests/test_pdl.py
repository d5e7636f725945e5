"""Programmatic dependent launch (kernels/_runtime.py): which of the ops' kernels take it, in which
mode, and what their compiled code does with it. The interpreter runs none of it (CPU tensors never
take PDL); the launches are planned on CPU as a GPU with PDL plans them, and compiled for sm_90 and
sm_120 without a GPU. The H200 checked the outputs of every op bit for bit with and without PDL
(bench/RESULTS.md, twenty-seventh session)."""
import pytest
import torch

from dsv4_compile.kernels import _runtime
from dsv4_compile.kernels import fp4_moe as moe
from helpers import run_compiled_script


def test_cpu_tensors_never_take_pdl():
    cpu = torch.zeros(1)
    assert not _runtime.uses_pdl(cpu)
    assert _runtime.pdl_launch(cpu, release=True) == {"PDL": _runtime.PDL_OFF}


@pytest.mark.parametrize("release, mode", [(True, _runtime.PDL_WAIT_RELEASE), (False, _runtime.PDL_WAIT)])
def test_pdl_launch_options_follow_the_switch(monkeypatch, release, mode):
    """With PDL available the launch takes `launch_pdl` and the kernel its mode; set_pdl(False) (or
    DSV4_PDL=0 at import) turns it off for launches from then on."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    cuda_like = type("CudaLike", (), {"is_cuda": True, "device": "cuda:0"})()
    try:
        assert _runtime.pdl_launch(cuda_like, release) == {"launch_pdl": True, "PDL": mode}
        _runtime.set_pdl(False)
        assert _runtime.pdl_launch(cuda_like, release) == {"PDL": _runtime.PDL_OFF}
    finally:
        _runtime.set_pdl(True)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert _runtime.pdl_launch(cuda_like, release) == {"PDL": _runtime.PDL_OFF}  # ROCm: no griddepcontrol
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert _runtime.pdl_launch(cuda_like, release) == {"PDL": _runtime.PDL_OFF}  # sm_80 has no PDL


_ENVIRONMENT = """
import torch
from dsv4_compile.kernels import _runtime
print("module", _runtime.__file__)
torch.cuda.get_device_capability = lambda device=None: (9, 0)
torch.version.hip = None
cuda_like = type("CudaLike", (), {"is_cuda": True, "device": "cuda:0"})()
print(_runtime.pdl_launch(cuda_like, True).get("launch_pdl", False))
"""


@pytest.mark.parametrize("value, takes_pdl", [(None, "True"), ("1", "True"), ("0", "False")])
def test_dsv4_pdl_environment_variable(monkeypatch, value, takes_pdl):
    if value is None:
        monkeypatch.delenv("DSV4_PDL", raising=False)
    else:
        monkeypatch.setenv("DSV4_PDL", value)
    assert run_compiled_script(_ENVIRONMENT, _runtime.__file__) == [[takes_pdl]]


def test_dsv4_pdl_other_values_raise_naming_it(monkeypatch):
    monkeypatch.setenv("DSV4_PDL", "yes")
    with pytest.raises(AssertionError, match="DSV4_PDL must be unset, 0 or 1, got 'yes'"):
        run_compiled_script(_ENVIRONMENT, _runtime.__file__)


_PDL_CROSS_COMPILE = """
import dataclasses, sys, torch, triton.language as tl
sys.path[:0] = ["bench"]
from bench_sparse_mla import Case, cross_compile, launch_recorder, make_inputs
from dsv4_compile.kernels import _runtime, fp4_moe as moe, indexer_topk, moe_pairs, sparse_mla as sm, topk_select
print("module", _runtime.__file__)
_runtime.uses_pdl = moe_pairs.uses_pdl = lambda t: True  # plan as on a GPU with PDL
launches = []
for module, names in ((moe, ("_gate_up_mma_kernel", "_swiglu_partials_kernel", "_down_mma_kernel")),
                      (moe_pairs, ("_group_pairs_kernel", "_combine_pairs_kernel")),
                      (topk_select, ("_chunk_hist_kernel", "_chunk_split_kernel", "_finish_kernel")),
                      (indexer_topk, ("_score_pages_kernel",))):
    for name in names:
        setattr(module, name, launch_recorder(getattr(module, name), launches))
# FP4 MoE, K=256 and I=128: one decode token's class (split gate/up sums, direct blocks), then the
# 32-row class (the grouping kernel), and the combine
x = torch.zeros(2, 256, dtype=torch.bfloat16)
w13, w2 = torch.zeros(2, 256, 128, dtype=torch.uint8), torch.zeros(2, 256, 64, dtype=torch.uint8)
s13, s2 = torch.zeros(2, 256, 8, dtype=torch.uint8), torch.zeros(2, 256, 4, dtype=torch.uint8)
ids = torch.zeros(2, 6, dtype=torch.int32)
for config in (moe.DEFAULT_CONFIGS["mma_token"], dataclasses.replace(moe.DEFAULT_CONFIGS["mma"], ready_counts=False),
               dataclasses.replace(moe.DEFAULT_CONFIGS["mma"], ready_counts=True),
               dataclasses.replace(moe.DEFAULT_CONFIGS["mma"], ready_counts=True, relaxed_spin=True)):
    pairs = moe.fp4_moe_pairs_triton(x, ids, torch.ones(2, 6), w13, s13, w2, s2, "mxfp4", None, None, None,
                                     config=config)
# down codes at a misaligned address: the launcher copies them, and the down kernel then waits first
odd = torch.zeros(2 * 256 * 64 + 1, dtype=torch.uint8)[1:].view(2, 256, 64)
moe.fp4_moe_pairs_triton(x, ids, torch.ones(2, 6), w13, s13, odd, s2, "mxfp4", None, None, None,
                         config=dataclasses.replace(moe.DEFAULT_CONFIGS["mma"], ready_counts=False))
moe_pairs.combine_pairs_triton(pairs, ids, 2, torch.bfloat16)
# the indexer: scoring, then the three selection kernels
q = torch.zeros(1, 1, 4, 32)
indexer_topk.indexer_topk_triton(q, torch.zeros(1, 1, 4), torch.zeros(2, 64, 32), None,
                                 torch.zeros(1, 2, dtype=torch.int32), torch.full((1, 1), 100, dtype=torch.int32), 8)
# sparse MLA: split (tile then combine) and unsplit bf16 rows, staged FP8 rows
for fmt, splits in (("bf16", 3), ("bf16", 1), ("fp8", 1)):
    args = make_inputs(Case("csa", 2, 1, 32, "csa", fmt, 64), torch.device("cpu"))
    cfg = sm.pick_config(2, 1, 32, 512, 192, torch.device("cpu"), splits, fmt == "fp8")
    if fmt == "fp8":
        cfg = sm.replace(cfg, stage_fp8=True)
    launches += sm.plan_sparse_mla(*args, out=torch.empty_like(args[0]), config=cfg)
for launch in launches:
    name = launch.kernel.fn.__name__
    mode = launch.meta.get("PDL", launch.meta.get("RELEASE", "none"))
    if name == "_down_mma_kernel":
        mode = f"{mode},early={launch.meta['EARLY']},ready={launch.meta['READY']},relaxed={launch.meta['RELAXED_SPIN']}"
    if name == "_gate_up_mma_kernel":
        mode = f"{mode},count={launch.meta['COUNT_READY']}"
    if name == "_score_pages_kernel":  # not compiled: it takes no PDL
        print(name, launch.meta.get("launch_pdl", False), mode, "-", "-", "-", "-", "-", "-")
        continue
    if name in ("_gate_up_mma_kernel", "_down_mma_kernel"):  # as the launcher passes them on a GPU
        launch.meta.update(DOT_DTYPE=tl.bfloat16, COMPILED=True)
    for cap in (90, 120):
        ptx = cross_compile(launch, cap).asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        cg = ptx.find("ld.global.cg")
        # the ready counts: gate/up's release adds and the down kernel's acquire loads, and their
        # order: gate/up's last store, then a barrier, then the add, and no store after it; the down
        # kernel's last acquire before its first hidden-row load (a 16-byte vector past L1), its last
        # wait after its last hidden-row load and before its store
        release = ptx.find("atom.global.gpu.release.add")
        acquire = ptx.rfind("ld.global.gpu.acquire")
        hidden, last_wait = ptx.find("ld.global.cg.v4"), ptx.rfind("griddepcontrol.wait")
        if release >= 0:
            order = 0 <= ptx.rfind("st.global", 0, release) < ptx.rfind("bar.sync", 0, release) and (
                ptx.find("st.global", release) < 0)
        elif acquire >= 0:
            order = acquire < hidden and ptx.rfind("ld.global.cg.v4") < last_wait < ptx.rfind("st.global")
        else:
            order = "-"
        print(name, launch.meta.get("launch_pdl", False), mode, cap, ptx.count("griddepcontrol.wait"),
              ptx.count("griddepcontrol.launch_dependents"), 0 <= cg < wait,
              f"{ptx.count('atom.global.gpu.release.add')}/{ptx.count('ld.global.gpu.acquire')}"
              f"/{ptx.count('ld.volatile.global')}", order)
"""


def test_each_kernel_takes_its_pdl_mode_and_compiles_it():
    """Planned as on a GPU with PDL and compiled for sm_90 and sm_120 (no GPU needed):
    - the FP4 MoE's grouping kernel lets the expert kernels launch early without waiting itself (it
      is launched plainly); gate/up, the split sums and the down kernel wait, then let the next launch;
      the down kernel reads its block table past L1 (ld.global.cg) before its wait, except on a copy
      of its weights (misaligned codes here), where it waits first; the combine waits;
    - with ready counts (the 32-row class's config with ready_counts), gate/up adds to its block's
      count (a release) after its rows, and the down kernel acquires its block's count before it reads
      the hidden rows, lets the next kernel launch, and waits for gate/up's end before its store; with
      relaxed_spin its spin reads the count by volatile loads and acquires it once after;
    - the indexer's scoring takes no PDL and its three selection kernels wait without letting the
      next launch early (on the H200 an early launch cost 1-10 us there);
    - sparse MLA's tile waits, and lets its combine launch early only when split; the combine
      waits; the FP8 staging kernel takes no PDL.
    Every waiting kernel is launched with launch_pdl, and its PTX waits exactly where its mode says."""
    rows = run_compiled_script(_PDL_CROSS_COMPILE, _runtime.__file__)
    got = {}
    for name, launch_pdl, mode, cap, waits, releases, cg_first, counts, count_order in rows:
        got.setdefault((name, launch_pdl, mode), set()).add((cap, waits, releases, cg_first, counts, count_order))
    wait_release = {(cap, "1", "1", "False", "0/0/0", "-") for cap in ("90", "120")}
    wait_only = {(cap, "1", "0", "False", "0/0/0", "-") for cap in ("90", "120")}
    ready_32 = 128 // moe.DEFAULT_CONFIGS["mma"].block_n  # gate/up's programs a block: I = 128, 32 columns each
    assert got == {
        ("_group_pairs_kernel", "False", "True"): {(cap, "0", "1", "False", "0/0/0", "-") for cap in ("90", "120")},
        ("_gate_up_mma_kernel", "True", "2,count=False"): wait_release,
        # a release add on the block's ready count after the hidden rows
        ("_gate_up_mma_kernel", "True", "2,count=True"): {(cap, "1", "1", "False", "1/0/0", "True")
                                                          for cap in ("90", "120")},
        ("_swiglu_partials_kernel", "True", "2"): wait_release,
        # without ready counts (after the split sums, or the 32-row class without them): a wait (and
        # release) on each path, before the hidden rows or before leaving an empty block
        ("_down_mma_kernel", "True", "2,early=True,ready=0,relaxed=False"): {(cap, "2", "2", "True", "0/0/0", "-")
                                                                for cap in ("90", "120")},
        # the 32-row class with ready counts: the block's ready count acquired (in the spin and its
        # first check) before the hidden rows; a wait and release leaving an empty block, a release
        # after the count, and a wait before the store
        ("_down_mma_kernel", "True", f"2,early=True,ready={ready_32},relaxed=False"):
            {(cap, "2", "2", "True", "0/2/0", "True") for cap in ("90", "120")},
        # relaxed_spin: the spin reads the count by volatile loads, acquired in its first check and once after
        ("_down_mma_kernel", "True", f"2,early=True,ready={ready_32},relaxed=True"):
            {(cap, "2", "2", "True", "0/2/1", "True") for cap in ("90", "120")},
        ("_down_mma_kernel", "True", "2,early=False,ready=0,relaxed=False"): wait_release,
        ("_combine_pairs_kernel", "True", "1"): wait_only,
        ("_score_pages_kernel", "False", "none"): {("-",) * 6},
        ("_chunk_hist_kernel", "True", "1"): wait_only,
        ("_chunk_split_kernel", "True", "1"): wait_only,
        ("_finish_kernel", "True", "1"): wait_only,
        ("_sparse_mla_fwd", "True", "2"): wait_release,
        ("_sparse_mla_fwd", "True", "1"): wait_only,
        ("_sparse_mla_combine", "True", "1"): wait_only,
        ("_stage_fp8_rows_kernel", "False", "none"): {(cap, "0", "0", "False", "0/0/0", "-") for cap in ("90", "120")},
    }, got
