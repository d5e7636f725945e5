"""dsv4::indexer_topk_physical (kernels/indexer_physical.py) and its lowering
(lowerings/indexer.py): under the dsv4 backend the op becomes an extern call to
dsv4::indexer_topk plus the logical -> physical translation, which inductor fuses into the
consumer (here the sparse attention's row gather `rows[idx.clamp(min=0)] * (idx >= 0)`)."""
import re

import pytest
import torch
from hypothesis import given
from torch._inductor.lowering import lowerings
from torch._inductor.utils import run_and_get_code

from dsv4_compile.backend import Dsv4Backend
from dsv4_compile.kernels.indexer_physical import physical_slots
from dsv4_compile.kernels.indexer_topk import indexer_scores_reference
from dsv4_compile.lowerings import indexer as indexer_lowering
from dsv4_compile.passes import manager
from dsv4_compile.passes.manager import PassConfig
from test_indexer_topk import FP8, PAGE, assert_topk_valid, build, indexer_cases

MODULE = "dsv4_compile.lowerings.indexer"


def case(**change):
    base = dict(batch=2, tokens=3, heads=4, dim=32, max_pages=3, pages=8, topk=40,
                lens=[[5, 64, 150], [192, 0, 100]], q_dtype=torch.bfloat16, k_dtype=FP8,
                strided_q=False, seed=0)
    base.update(change)
    return build(base)


def test_physical_slots_is_the_page_table_lookup():
    gen = torch.Generator().manual_seed(0)
    page_table = torch.randint(0, 50, (2, 3), generator=gen, dtype=torch.int32)
    idx = torch.randint(-1, 3 * PAGE, (2, 4, 7), generator=gen, dtype=torch.int32)
    want = torch.full_like(idx, -1)
    for (b, t, j), s in zip(torch.cartesian_prod(*map(torch.arange, idx.shape)).tolist(),
                            idx.flatten().tolist()):
        if s >= 0:
            want[b, t, j] = int(page_table[b, s // PAGE]) * PAGE + s % PAGE
    got = physical_slots(idx, page_table)
    assert got.dtype == torch.int32 and torch.equal(got, want)


@given(indexer_cases())
def test_op_is_indexer_topk_then_translation(case_):
    args = build(case_)
    topk = case_["topk"]
    logical = torch.ops.dsv4.indexer_topk(*args, topk)
    assert_topk_valid(logical, indexer_scores_reference(*args), args[5], topk)
    physical = torch.ops.dsv4.indexer_topk_physical(*args, topk)
    assert torch.equal(physical, physical_slots(logical, args[4]))  # same kernels, same order


def test_opcheck_and_fake():
    args = case(k_dtype=torch.bfloat16)  # opcheck's schema mode cannot compare fp8 on CPU
    torch.library.opcheck(torch.ops.dsv4.indexer_topk_physical.default, (*args, 16),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("index, value, name", [
    (1, lambda a: torch.randn(2, 3, 5), "weights"),
    (4, lambda a: a[4].long(), "page_table"),
    (4, lambda a: torch.zeros(3, 3, dtype=torch.int32), "page_table"),
    (5, lambda a: torch.zeros(2, 2, dtype=torch.int32), "lens"),
    (3, lambda a: None, "k_scale"),
    (6, lambda a: 4096, "topk"),
])
def test_bad_input_names_the_tensor(index, value, name):
    args = list(case()) + [16]
    args[index] = value(args)
    with pytest.raises(ValueError, match=name):
        torch.ops.dsv4.indexer_topk_physical(*args)


def gather_rows(q, weights, k_cache, k_scale, page_table, lens, rows):
    idx = torch.ops.dsv4.indexer_topk_physical(q, weights, k_cache, k_scale, page_table, lens, 40)
    return rows[idx.clamp(min=0).long()] * (idx >= 0).unsqueeze(-1)  # int64 offsets, as a real pool needs


def compile_and_run(*args):
    compiled = torch.compile(gather_rows, backend=Dsv4Backend(PassConfig(passes=())), fullgraph=True)
    out, code = run_and_get_code(compiled, *args)
    code = "\n".join(code)
    body = re.search(r"^    def call\(self, args\):\n(.*?)^\s+return ", code, flags=re.M | re.S)
    assert body, "no call() in the generated code"
    return out, body.group(1)


def inputs(seed=0):
    args = case(seed=seed)
    rows = torch.randn(8 * PAGE, 16, generator=torch.Generator().manual_seed(seed))
    return (*args, rows)


@pytest.mark.usefixtures("fresh_compile")
def test_translation_fuses_into_the_consumer():
    assert MODULE in manager.LOWERING_MODULES
    args = inputs()
    out, body = compile_and_run(*args)
    # the only op call is the logical top-k; the translation is no kernel and no buffer of its own
    assert re.findall(r"torch\.ops\.[\w.]+\(", body) == ["torch.ops.dsv4.indexer_topk.default("]
    logical = set(re.findall(r"^\s+(buf\d+) = torch\.ops\.dsv4\.indexer_topk\.default\(", body, re.M))
    for alias, source in re.findall(r"^\s+(buf\d+) = (buf\d+)\s*(?:;.*)?$", body, flags=re.M):
        if source in logical:
            logical.add(alias)
    calls = re.findall(r"^\s+(cpp_fused_\w+|triton_\w+)\((.*)\)\s*$", body, flags=re.M)
    assert len(calls) == 1, calls  # translation, clamp, gather and mask: one kernel
    name, kernel_args = calls[0]
    assert "indexer_topk_physical" in name
    assert logical & set(re.findall(r"\w+", kernel_args))  # reads the logical slots directly
    torch.testing.assert_close(out, gather_rows(*args), rtol=0, atol=0)  # a gather: exact


@pytest.mark.usefixtures("fresh_compile")
def test_without_lowering_calls_the_op(monkeypatch):
    indexer_lowering.register()  # installed now, so the removal below is undone after the test
    monkeypatch.setattr(manager, "LOWERING_MODULES", ())
    monkeypatch.delitem(lowerings, torch.ops.dsv4.indexer_topk_physical.default)
    args = inputs(seed=1)
    out, body = compile_and_run(*args)
    assert "torch.ops.dsv4.indexer_topk_physical.default(" in body
    assert "torch.ops.dsv4.indexer_topk.default(" not in body
    torch.testing.assert_close(out, gather_rows(*args), rtol=0, atol=0)
