"""lowerings/sparse_mla.py: under the dsv4 backend, dsv4::sparse_mla becomes an extern call to
dsv4::sparse_mla_partials plus the split-K combine, which inductor fuses with what consumes the
attention output in the model (the inverse RoPE of the rope slice, the cat with the nope slice,
the grouped output projection's input layout) into one generated kernel.

Tolerances. Partials: their lse is an f32 log-sum-exp of f32-accumulated logits (bf16 products
are exact in f32), so only summation order differs: 1e-4. Their outputs are convex combinations
of rows; with f32 q everything is f32 (1e-4); with bf16 q the GPU kernel rounds P to bf16 before
the PV dot (2^-9 relative per weight, rows |v| <= ~5 here, FP8 rows scaled by <= 2^2): atol 2e-2,
rtol 1e-2, as in test_sparse_mla.py. Compiled vs eager: f32 differs only by summation order and
exp vs exp2 (1e-5 relative to the output scale); bf16 rounds the attention output once in both
(the fused kernel casts the combine to bf16 exactly where the op does), then the RoPE in f32 and
the bf16 projection: one bf16 ulp (2^-8 relative) of |out| <= ~5 -> atol = rtol = 3e-2.
"""
import re

import pytest
import torch
from hypothesis import given, strategies as st
from torch._inductor.lowering import lowerings
from torch._inductor.utils import run_and_get_code
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear, apply_rotary_pos_emb

import dsv4_compile
from dsv4_compile.backend import Dsv4Backend
from dsv4_compile.kernels import sparse_mla as sm
from dsv4_compile.lowerings import sparse_mla as mla_lowering
from dsv4_compile.passes import manager
from dsv4_compile.passes.manager import PassConfig
from dsv4_compile.tiny import FAST_COMPILE_OVERRIDES, tiny_model
from helpers import StepRecorder, make_prompts
from test_sparse_mla import inputs

MODULE = "dsv4_compile.lowerings.sparse_mla"
PART_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}
LSE_TOL = dict(atol=1e-4, rtol=1e-4)
OUT_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
BATCH, TOKENS, HEADS, GROUPS = 1, 2, 4, 2


# ----------------------------------------------------------------------------- the partials op


def poisoned_partials(q, num_splits):
    batch, tokens, heads, head_dim = q.shape
    out = torch.full((batch, tokens, heads, num_splits, head_dim), float("nan"))
    lse = torch.full((batch, tokens, heads, num_splits), float("nan"))
    return out, lse


@given(
    seed=st.integers(0, 2**31 - 1),
    bt=st.sampled_from([(1, 1), (2, 1), (1, 3), (2, 4), (1, 8)]),
    heads=st.integers(1, 5),
    fmt=st.sampled_from(["bf16", "fp8", "f32"]),
    layer=st.sampled_from(["window", "csa", "hca"]),
    window=st.integers(1, 70),
    extra_len=st.integers(0, 70),
    num_splits=st.integers(1, 6),
)
def test_partials_match_reference(seed, bt, heads, fmt, layer, window, extra_len, num_splits):
    """Every split (empty ones included: S may exceed the tile count) against the spec."""
    q, kv, kv_scale, idx, ekv, esc, eidx, _, scale = inputs(seed, *bt, heads, fmt, layer, window, extra_len,
                                                          rope=64 if fmt == "fp8" else 16)
    out, lse = poisoned_partials(q, num_splits)
    got = sm.sparse_mla_partials_triton(q, kv, kv_scale, idx, ekv, esc, eidx, scale, num_splits, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    want_out, want_lse = sm.sparse_mla_partials_reference(q, kv, kv_scale, idx, ekv, esc, eidx, scale, num_splits)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(lse == float("-inf"), want_lse == float("-inf"))
    torch.testing.assert_close(lse, want_lse, **LSE_TOL)
    torch.testing.assert_close(out, want_out, **PART_TOL[q.dtype])


@pytest.mark.parametrize("layer", ["window", "csa", "hca"])
@pytest.mark.parametrize("with_sink", [True, False])
def test_combine_of_partials_is_the_op(layer, with_sink):
    """The two halves the lowering splits the op into compose to the op's own spec."""
    args = inputs(11, 2, 3, 4, "f32", layer, 50, 45, with_sink=with_sink, head_dim=64)
    q, kv, kv_scale, idx, ekv, esc, eidx, sink, scale = args
    for num_splits in (1, 2, 3, 5):
        parts = sm.sparse_mla_partials_reference(q, kv, kv_scale, idx, ekv, esc, eidx, scale, num_splits)
        got = sm.combine_partials_reference(*parts, sink, q.dtype)
        torch.testing.assert_close(got, sm.sparse_mla_reference(*args), atol=1e-5, rtol=1e-5)


def test_registered_partials_op_passes_opcheck():
    q, kv, kv_scale, idx, ekv, esc, eidx, _, scale = inputs(12, 1, 2, 3, "fp8", "csa", 40, 30, rope=64)
    args = (q, kv, kv_scale, idx, ekv, esc, eidx, scale, 3)
    out, lse = torch.ops.dsv4.sparse_mla_partials(*args)
    want_out, want_lse = sm.sparse_mla_partials_reference(*args)
    torch.testing.assert_close(lse, want_lse, **LSE_TOL)
    torch.testing.assert_close(out, want_out, **PART_TOL[torch.bfloat16])
    torch.library.opcheck(torch.ops.dsv4.sparse_mla_partials.default, args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("change, name", [
    (dict(num_splits=0), "num_splits"),
    (dict(num_splits=2000), "num_splits"),
    (dict(q="rank3"), "q"),
    (dict(idx="int64"), "idx"),
    (dict(kv_scale=None), "kv_scale"),
    (dict(extra_idx="tokens"), "extra_idx"),
])
def test_partials_bad_input_raises_value_error_naming_it(change, name):
    q, kv, kv_scale, idx, ekv, esc, eidx, _, scale = inputs(13, 1, 2, 2, "fp8", "csa", 8, 8, rope=32)
    args = dict(q=q, kv=kv, kv_scale=kv_scale, idx=idx, extra_kv=ekv, extra_kv_scale=esc, extra_idx=eidx,
                scale=scale, num_splits=2)
    bad = {"rank3": q[0], "int64": idx.long(), "tokens": eidx[:, :1]}
    args.update({k: bad.get(v, v) if isinstance(v, str) else v for k, v in change.items()})
    with pytest.raises(ValueError, match=name):
        torch.ops.dsv4.sparse_mla_partials(**args)


# ----------------------------------------------------------------------------- the lowering


def attention_tail(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, sink, cos, sin, proj, scale):
    """The model's attention output path (dsv4_compile/model/attention.py): the op, the inverse
    RoPE of the rope slice, the grouped output projection."""
    batch, tokens = q.shape[:2]
    out = torch.ops.dsv4.sparse_mla(q, kv, kv_scale, idx, extra_kv, extra_kv_scale, extra_idx, sink, scale)
    out = apply_rotary_pos_emb(out.transpose(1, 2), cos, -sin).transpose(1, 2)
    return proj(out.reshape(batch, tokens, GROUPS, -1)).flatten(2)


def tail_inputs(fmt, *, seed=0, window=40, extra_len=40, with_sink=True):
    args = inputs(seed, BATCH, TOKENS, HEADS, fmt, "csa", window, extra_len, rope=64 if fmt == "fp8" else 16,
                  with_sink=with_sink)
    q, idx, extra_idx = args[0], args[3], args[6]
    idx[:, 0] = extra_idx[:, 0] = -1  # token 0 selects nothing: its output is 0 (sink or not)
    gen = torch.Generator().manual_seed(seed + 1)
    rope_pairs = 32 if fmt == "fp8" else 8  # the RoPE covers the rows' rope slice
    cos = torch.randn(BATCH, TOKENS, rope_pairs, generator=gen)
    sin = torch.randn(BATCH, TOKENS, rope_pairs, generator=gen)
    torch.manual_seed(seed + 2)
    proj = DeepseekV4GroupedLinear(HEADS * q.shape[-1] // GROUPS, GROUPS * 16, GROUPS).to(q.dtype)
    return args[:8], (cos, sin, proj, args[8])


def compile_tail(op_args, rest):
    """(output, generated code) of attention_tail under the dsv4 backend, no FX passes."""
    compiled = torch.compile(attention_tail, backend=Dsv4Backend(PassConfig(passes=())), fullgraph=True)
    with torch.no_grad():
        out, code = run_and_get_code(compiled, *op_args, *rest)
    return out, "\n".join(code)


def wrapper_body(code):
    """The statements of the generated wrapper's call(): what runs at each step."""
    match = re.search(r"^    def call\(self, args\):\n(.*?)^\s+return ", code, flags=re.M | re.S)
    assert match, "no call() in the generated code"
    return match.group(1)


def kernel_calls(body):
    """(name, argument names) of every generated kernel called in the wrapper."""
    return [(name, re.findall(r"\w+", args))
            for name, args in re.findall(r"^\s+(cpp_fused_\w+|triton_\w+)\((.*)\)\s*$", body, flags=re.M)]


def partials_outputs(body):
    """[(out buffer, lse buffer, S)] of each sparse_mla_partials call (the extern's two outputs)."""
    calls = re.findall(r"^\s+(buf\d+) = torch\.ops\.dsv4\.sparse_mla_partials\.default\(", body, flags=re.M)
    found = []
    for result in calls:
        out = re.search(rf"^\s+(buf\d+) = {result}\[0\]\s*$", body, flags=re.M).group(1)
        lse = re.search(rf"^\s+(buf\d+) = {result}\[1\]\s*$", body, flags=re.M).group(1)
        size = re.search(rf"assert_size_stride\({lse}, \(([\d, ]+)\)", body).group(1)
        found.append((out, lse, int(size.split(",")[3])))
    return found


def full_size_buffers(body, numel):
    """Buffers the wrapper allocates with `numel` elements."""
    found = []
    for name, size in re.findall(r"^\s+(buf\d+) = empty_strided\w*\(\(([\d, ]+)\)", body, flags=re.M):
        dims = [int(d) for d in size.split(",") if d.strip()]
        if torch.Size(dims).numel() == numel:
            found.append(name)
    return found


def assert_combine_fused(body, expected_sites):
    """Each partials pair is read by exactly one kernel, which also runs the inverse RoPE."""
    sites = partials_outputs(body)
    assert len(sites) == expected_sites, body
    for out, lse, _ in sites:
        readers = [(name, args) for name, args in kernel_calls(body) if out in args or lse in args]
        assert len(readers) == 1, readers
        name, args = readers[0]
        assert out in args and lse in args
        # named after the aten ops it fuses (in a large graph the list omits some): the RoPE's
        # negated sine and its cat / stack
        assert "neg" in name and ("cat" in name or "stack" in name), name
    return sites


@pytest.mark.usefixtures("fresh_compile")
@pytest.mark.parametrize("fmt, with_sink", [("f32", True), ("bf16", True), ("fp8", True), ("f32", False)])
def test_combine_fuses_with_inverse_rope_and_projection_layout(fmt, with_sink):
    assert MODULE in manager.LOWERING_MODULES
    assert any(f.endswith("lowerings/sparse_mla.py") for f in manager._source_files())  # in the uuid
    op_args, rest = tail_inputs(fmt, with_sink=with_sink)
    out, code = compile_tail(op_args, rest)
    body = wrapper_body(code)
    assert "torch.ops.dsv4.sparse_mla.default(" not in body
    (_, _, splits), = assert_combine_fused(body, 1)
    # the same split count as the eager op picks for these inputs
    eager_plan = sm.plan_sparse_mla(*op_args, rest[-1], out=torch.empty(op_args[0].shape, dtype=op_args[0].dtype))
    assert splits == eager_plan[0].grid[1] > 1

    with torch.no_grad():
        expected = attention_tail(*op_args, *rest)
    assert out.dtype == expected.dtype and not out.isnan().any()
    torch.testing.assert_close(out, expected, **OUT_TOL[expected.dtype])


@pytest.mark.usefixtures("fresh_compile")
def test_combine_adds_no_attention_sized_buffer(monkeypatch):
    """With the lowering the wrapper allocates no more [B,T,H,Dh]-sized buffers than with the
    op as one extern call: the combine's result is never stored."""
    op_args, rest = tail_inputs("f32", seed=1)
    numel = op_args[0].numel()
    out, code = compile_tail(op_args, rest)
    lowered = full_size_buffers(wrapper_body(code), numel)

    mla_lowering.register()  # installed now, so the removal below is undone after the test
    monkeypatch.setattr(manager, "LOWERING_MODULES", tuple(m for m in manager.LOWERING_MODULES if m != MODULE))
    monkeypatch.delitem(lowerings, torch.ops.dsv4.sparse_mla.default)
    torch._dynamo.reset()
    plain_out, plain_code = compile_tail(op_args, rest)
    body = wrapper_body(plain_code)
    assert "torch.ops.dsv4.sparse_mla.default(" in body and "sparse_mla_partials" not in body
    assert len(lowered) <= len(full_size_buffers(body, numel)), (lowered, body)
    torch.testing.assert_close(out, plain_out, **OUT_TOL[torch.float32])


@pytest.mark.usefixtures("fresh_compile")
@pytest.mark.parametrize("fmt, case, max_inlined", [
    ("bf16", dict(seed=2, window=20, extra_len=10), None),  # a short index list gives S = 1
    ("f32", dict(seed=4), 1),  # S > MAX_INLINED_SPLITS: S partial rows read per element
], ids=["one-split", "too-many-splits"])
def test_plain_op_call_without_a_combine_to_inline(monkeypatch, fmt, case, max_inlined):
    """No combine is inlined for S = 1 or S > MAX_INLINED_SPLITS: the op's own kernels finish."""
    if max_inlined is not None:
        monkeypatch.setattr(mla_lowering, "MAX_INLINED_SPLITS", max_inlined)
    op_args, rest = tail_inputs(fmt, **case)
    out, code = compile_tail(op_args, rest)
    body = wrapper_body(code)
    assert "torch.ops.dsv4.sparse_mla.default(" in body and "sparse_mla_partials" not in body
    with torch.no_grad():
        expected = attention_tail(*op_args, *rest)
    torch.testing.assert_close(out, expected, **OUT_TOL[expected.dtype])


@pytest.mark.usefixtures("fresh_compile")
def test_compiled_bad_input_raises_value_error_naming_it():
    op_args, rest = tail_inputs("f32", seed=3)
    op_args = list(op_args)
    op_args[3] = op_args[3].long()  # idx must be int32
    with pytest.raises(ValueError, match="idx"):
        compile_tail(op_args, rest)


# ----------------------------------------------------------------------------- the model


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_compile")
def test_model_decode_fuses_combine_and_equals_uncompiled():
    """Tiny model, batch 1, context 1024, top-k 64: the CSA and HCA layers read 3 tiles of 32
    index positions and split in 2 (the sliding layer's 16 rows make one tile: S = 1)."""
    model = tiny_model(seed=4, **FAST_COMPILE_OVERRIDES, index_topk=64)
    engine = dsv4_compile.optimize(model, max_batch=1, max_context=1024)
    recorder = StepRecorder(engine.compiled_step)
    engine.compiled_step = recorder
    prompts = make_prompts((70,), model.config.vocab_size, seed=4)
    tokens, code = run_and_get_code(engine.generate, prompts, 3)
    body = wrapper_body("\n".join(code))

    layer_types = model.config.layer_types
    assert_combine_fused(body, sum(t != "sliding_attention" for t in layer_types))
    assert body.count("torch.ops.dsv4.sparse_mla.default(") == layer_types.count("sliding_attention")

    eager = dsv4_compile.optimize(model, max_batch=1, max_context=1024, compile=False)
    assert eager.generate(prompts, 3) == tokens
    for input_ids, start_pos, rows, logits in recorder.calls:
        expected = eager.module(input_ids, start_pos, rows).float()
        # f32: inductor fuses and reorders reductions (~1e-6 of the logit scale)
        assert (logits - expected).abs().max() <= 1e-4 * expected.abs().max()
