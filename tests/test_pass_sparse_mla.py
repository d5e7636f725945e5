"""The sparse_mla FX pass: the model's gather + attention-with-sink form (window, CSA, HCA; decode
and verify) and SGLang 0.5.23's torch sparse-decode fallback become torch.ops.dsv4.sparse_mla;
variants with other math stay.

Tolerances: the model's plain-torch form rounds its logits and probabilities to bf16, the op keeps
f32 logits and rounds P once (2^-9 relative): outputs (|v| <= ~4) differ by up to ~1e-2, so
bf16 cases use atol = rtol = 3e-2. f32 cases differ only by summation order: 1e-4.
"""
import pytest
import torch
from torch._inductor import inductor_prims
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

from dsv4_compile.backend import Dsv4Backend
from dsv4_compile.model.hotspots import gather_rows, sparse_attention_with_sink
from dsv4_compile.passes import sparse_mla as sparse_mla_pass
from dsv4_compile.passes.fx_match import Decline
from dsv4_compile.passes.manager import PassConfig
from dsv4_compile.passes.report import PassReport
from helpers import BmmToMmOnCpu, PadBmmAsInductorOnCuda, TargetsBefore

PASS = "dsv4_compile.passes.sparse_mla"
TOL = {torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float32: dict(atol=1e-4, rtol=1e-4)}


pytestmark = pytest.mark.usefixtures("fresh_compile")


def compile_with_pass(fn, *args):
    """(compiled output, generated code, report) with only the sparse_mla pass installed."""
    report = PassReport()
    compiled = torch.compile(fn, backend=Dsv4Backend(PassConfig(passes=(PASS,)), report), fullgraph=True)
    out, code = run_and_get_code(compiled, *args)
    return out, "\n".join(code), report


def window_attention(q, kv, idx, sink):
    return sparse_attention_with_sink(q, gather_rows(kv, idx), idx >= 0, sink, q.shape[-1] ** -0.5)


def two_pool_attention(q, kv, idx, extra_kv, extra_idx, sink):
    rows = torch.cat([gather_rows(kv, idx), gather_rows(extra_kv, extra_idx)], dim=2)
    valid = torch.cat([idx >= 0, extra_idx >= 0], dim=2)
    return sparse_attention_with_sink(q, rows, valid, sink, q.shape[-1] ** -0.5)


def model_inputs(layer, tokens, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch, heads, dim, window = 2, 4, 64, 16
    q = torch.randn(batch, tokens, heads, dim, generator=gen).to(dtype)
    kv = torch.randn(40, dim, generator=gen).to(dtype)
    ring = torch.randint(0, 40, (batch, 1, window), generator=gen)
    # window not yet full for request 1; each verify token sees one more row
    limit = torch.tensor([[window - tokens], [5]]).view(batch, 1, 1) + torch.arange(tokens).view(1, tokens, 1)
    idx = torch.where(torch.arange(window).view(1, 1, -1) <= limit, ring, -1).to(torch.int32)
    sink = torch.randn(heads, generator=gen)
    if layer == "window":
        return q, kv, idx, sink
    extra_kv = torch.randn(30, dim, generator=gen).to(dtype)
    if layer == "csa":  # per-token top-k, -1 tail
        extra_idx = torch.randint(0, 30, (batch, tokens, 12), generator=gen)
        extra_idx[:, :, 9:] = -1
    else:  # hca: every c128 entry, shared by the tokens, -1 past each token's causal range
        extra_idx = torch.where(torch.arange(12).view(1, 1, -1) < 8 + torch.arange(tokens).view(1, -1, 1),
                                torch.arange(12).view(1, 1, -1), -1).expand(batch, tokens, 12)
    return q, kv, idx, extra_kv, extra_idx.to(torch.int32).contiguous(), sink


@pytest.mark.parametrize("tokens", [1, 3], ids=["decode", "verify"])
@pytest.mark.parametrize("layer", ["window", "csa", "hca"])
def test_model_form_is_rewritten(layer, tokens):
    args = model_inputs(layer, tokens)
    fn = window_attention if layer == "window" else two_pool_attention
    out, code, report = compile_with_pass(fn, *args)
    assert report.count("sparse_mla") == 1
    assert "dsv4.sparse_mla" in code and "bmm" not in code  # both attention bmms are gone
    torch.testing.assert_close(out, fn(*args), **TOL[torch.bfloat16])


def test_model_form_f32_is_exact_up_to_summation_order():
    args = model_inputs("hca", 2, dtype=torch.float32)
    out, _, report = compile_with_pass(two_pool_attention, *args)
    assert report.count("sparse_mla") == 1
    torch.testing.assert_close(out, two_pool_attention(*args), **TOL[torch.float32])


def online_softmax_attention(q, kv, idx, sink):
    """The model's form as inductor's own post-grad passes leave it on CUDA (online softmax):
    exp(x - m) / s with (m, s) = prepare_softmax_online(x), in f32, cast back."""
    rows = gather_rows(kv, idx)
    batch, tokens, heads, dim = q.shape
    logits = torch.matmul(q, rows.transpose(-1, -2)) * dim ** -0.5
    logits = logits.masked_fill(~(idx >= 0).unsqueeze(2), float("-inf"))
    combined = torch.cat([logits, sink.view(1, 1, heads, 1).expand(batch, tokens, heads, 1).to(q.dtype)], dim=-1)
    combined = (combined - combined.max(dim=-1, keepdim=True).values).float()
    row_max, row_sum = inductor_prims.prepare_softmax_online(combined, -1)
    probs = (torch.exp(combined - row_max) / row_sum).to(q.dtype)[..., :-1]
    return torch.matmul(probs, rows)


@pytest.mark.parametrize("tokens", [1, 3], ids=["decode", "verify"])
def test_online_softmax_form_is_rewritten(tokens):
    args = model_inputs("window", tokens)
    out, code, report = compile_with_pass(online_softmax_attention, *args)
    assert report.count("sparse_mla") == 1
    assert "dsv4.sparse_mla" in code and "bmm" not in code
    torch.testing.assert_close(out, online_softmax_attention(*args), **TOL[torch.bfloat16])


def index_and_causal_mask(q, kv, idx, sink):
    keys = idx.shape[-1]
    causal = torch.arange(keys).view(1, 1, keys) < (keys // 2 + torch.arange(idx.shape[1]).view(1, -1, 1))
    return sparse_attention_with_sink(q, gather_rows(kv, idx), (idx >= 0) & causal, sink, 0.125)


def test_a_mask_beyond_idx_ge_0_is_folded_into_the_indices():
    args = model_inputs("window", 3)
    out, code, report = compile_with_pass(index_and_causal_mask, *args)
    assert report.count("sparse_mla") == 1 and "bmm" not in code
    torch.testing.assert_close(out, index_and_causal_mask(*args), **TOL[torch.bfloat16])


@pytest.mark.parametrize("tokens", [1, 3], ids=["decode", "verify"])
@pytest.mark.parametrize("layer", ["window", "csa", "hca"])
def test_bmms_padded_by_inductor_are_rewritten(layer, tokens):
    # 4 heads and 16 + 12 keys are off bf16's alignment of 8: both bmms get padded operands and
    # sliced outputs (on the H200 a verify step's window of W + T - 1 rows did this).
    args = model_inputs(layer, tokens)
    fn = window_attention if layer == "window" else two_pool_attention
    padding = PadBmmAsInductorOnCuda()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=padding):
        out, code, report = compile_with_pass(fn, *args)
    assert padding.padded == 2
    assert report.count("sparse_mla") == 1
    assert "dsv4.sparse_mla" in code and "bmm" not in code
    torch.testing.assert_close(out, fn(*args), **TOL[torch.bfloat16])


@pytest.mark.parametrize("layer", ["window", "csa", "hca"])
def test_batch_one_bmms_made_mm_by_inductor_are_rewritten(layer, monkeypatch):
    # At B*T = 1 on CUDA inductor turns both attention bmms into unsqueeze(mm(squeeze, squeeze), 0).
    args = tuple(a[:1] if isinstance(a, torch.Tensor) and a.dim() >= 3 else a for a in model_inputs(layer, 1))
    fn = window_attention if layer == "window" else two_pool_attention
    bmm_to_mm = BmmToMmOnCpu(monkeypatch)
    before = TargetsBefore()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=before):
        out, code, report = compile_with_pass(fn, *args)
    assert bmm_to_mm.rewrites == 2
    assert before.targets.count(torch.ops.aten.mm.default) == 2 and torch.ops.aten.bmm.default not in before.targets
    assert report.count("sparse_mla") == 1
    assert "dsv4.sparse_mla" in code and "mm(" not in code
    torch.testing.assert_close(out, fn(*args), **TOL[torch.bfloat16])


def qk_as_mm_over_heads(q, kv, idx, sink):
    """B = T = 1 attention whose q.k is an mm unsqueezed at the head dim, not a batch-1 bmm."""
    rows = gather_rows(kv, idx)
    logits = torch.mm(q[0, 0], rows[0, 0].t()).unsqueeze(1).view(1, 1, q.shape[2], -1) * 0.125
    logits = logits.masked_fill(~(idx >= 0).unsqueeze(2), float("-inf"))
    sinks = sink.view(1, 1, -1, 1).expand(*logits.shape[:3], 1).to(logits.dtype)
    probs = torch.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(kv.dtype), rows)


def test_qk_mm_that_is_not_a_batch_one_bmm_stays(monkeypatch):
    BmmToMmOnCpu(monkeypatch)  # the PV product is a batch-1 bmm made mm: a candidate
    q, kv, idx, sink = model_inputs("window", 1, dtype=torch.float32)
    args = (q[:1], kv, idx[:1], sink)
    out, code, report = compile_with_pass(qk_as_mm_over_heads, *args)
    assert report.count("sparse_mla") == 0 and "dsv4.sparse_mla" not in code
    (record,) = [r for r in report.records if r.pass_name == "sparse_mla"]
    assert "the logits are an mm unsqueezed at dim 1" in record.reason, record.reason
    torch.testing.assert_close(out, qk_as_mm_over_heads(*args), **TOL[torch.float32])


def padded_with_ones(q, kv, idx, sink):
    """Both PV operands padded with ones: the padding adds to every output (not pad_mm's zeros)."""
    rows = gather_rows(kv, idx)
    logits = (torch.matmul(q, rows.transpose(-1, -2)) * 0.125).masked_fill(~(idx >= 0).unsqueeze(2), float("-inf"))
    sinks = sink.view(1, 1, -1, 1).expand(*logits.shape[:3], 1).to(logits.dtype)
    probs = torch.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(torch.nn.functional.pad(probs, (0, 2), value=1.0),
                        torch.nn.functional.pad(rows, (0, 0, 0, 2), value=1.0))


def test_operands_padded_with_nonzero_values_stay():
    args = model_inputs("window", 2, dtype=torch.float32)
    out, code, report = compile_with_pass(padded_with_ones, *args)
    assert report.count("sparse_mla") == 0 and "dsv4.sparse_mla" not in code
    torch.testing.assert_close(out, padded_with_ones(*args), **TOL[torch.float32])


# ----------------------------------------------------------------------------- variants that stay


def no_sink(q, kv, idx, sink):
    logits = torch.matmul(q, gather_rows(kv, idx).transpose(-1, -2)) * 0.125
    logits = logits.masked_fill(~(idx >= 0).unsqueeze(2), float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1).to(kv.dtype), gather_rows(kv, idx))


def softmax_over_heads(q, kv, idx, sink):
    rows = gather_rows(kv, idx)
    logits = (torch.matmul(q, rows.transpose(-1, -2)) * 0.125).masked_fill(~(idx >= 0).unsqueeze(2), float("-inf"))
    sinks = sink.view(1, 1, -1, 1).expand(*logits.shape[:3], 1)
    probs = torch.softmax(torch.cat([logits, sinks], dim=-1), dim=2)[..., :-1]
    return torch.matmul(probs.to(kv.dtype), rows)


def positional_mask(q, kv, idx, sink):
    keys = idx.shape[-1]
    causal = torch.arange(keys).view(1, 1, keys) < (keys // 2 + torch.arange(idx.shape[1]).view(1, -1, 1))
    return sparse_attention_with_sink(q, gather_rows(kv, idx), causal.expand(idx.shape), sink, 0.125)


@pytest.mark.parametrize("fn, reason", [
    (no_sink, "without a sink"),
    (softmax_over_heads, "softmax over dim"),
    (positional_mask, "does not derive from the gather's indices"),
])
def test_variants_stay_and_the_decline_is_recorded(fn, reason):
    args = model_inputs("window", 2, dtype=torch.float32)
    out, code, report = compile_with_pass(fn, *args)
    assert report.count("sparse_mla") == 0
    assert "dsv4.sparse_mla" not in code
    declined = [r for r in report.records if r.pass_name == "sparse_mla" and not r.matched]
    assert declined and all(reason in r.reason for r in declined), report.records
    torch.testing.assert_close(out, fn(*args), equal_nan=True, **TOL[torch.float32])


# ----------------------------------------------------------------------------- SGLang's fallback


@pytest.fixture
def sglang_sm120():
    pytest.importorskip("sglang", reason="needs the sglang package (tests/requirements: sglang==0.5.23 --no-deps)")
    return pytest.importorskip("sglang.kernels.ops.attention.flash_mla_sm120")


def sglang_decode(module, q, k_cache, idx, sink, extra_k_cache, extra_idx, extra_len=None):
    out, _ = module._sm120_sparse_decode_fwd(q, k_cache, idx, None, sink, 512, 0.05, extra_k_cache, extra_idx,
                                             extra_len)
    return out


@pytest.mark.sglang
@pytest.mark.parametrize("pools", [2, 1], ids=["two-pools", "window-only"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_sglang_fallback_is_rewritten(sglang_sm120, monkeypatch, tokens, pools):
    """SGLang's attention math over bf16 rows: its page-layout reader is swapped for a plain row gather.
    Window-only layers (compress ratio 0) pass extra_k_cache=None."""
    monkeypatch.setattr(sglang_sm120, "_gather_and_dequant",
                        lambda cache, safe_idx, page_size: cache.reshape(-1, cache.shape[-1])[safe_idx.long()])
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, tokens, 2, 512, generator=gen).to(torch.bfloat16)
    cache = torch.randn(4, 16, 1, 512, generator=gen).to(torch.bfloat16)
    extra = torch.randn(2, 32, 1, 512, generator=gen).to(torch.bfloat16)
    idx = torch.randint(-1, 64, (1, tokens, 16), generator=gen, dtype=torch.int32)
    extra_idx = torch.randint(-1, 64, (1, tokens, 16), generator=gen, dtype=torch.int32)
    extra_idx[0, 0] = -1
    idx[0, 0] = -1  # token 0 has nothing valid: SGLang's "lonely" rows give 0, so does the op
    extra_len = torch.tensor([11], dtype=torch.int32)  # SGLang's top-k length: a mask beyond idx < 0
    args = (q, cache, idx, torch.randn(2, generator=gen), extra, extra_idx, extra_len)
    if pools == 1:
        args = args[:4] + (None, None, None)
    fn = lambda *a: sglang_decode(sglang_sm120, *a)  # noqa: E731
    out, code, report = compile_with_pass(fn, *args)
    assert report.count("sparse_mla") == 1
    assert "dsv4.sparse_mla" in code and "bmm" not in code
    torch.testing.assert_close(out, fn(*args), **TOL[torch.bfloat16])


class _RunPassAndKeepGraph(CustomGraphPass):
    def __init__(self, report):
        self.report, self.graph = report, None

    def __call__(self, graph):
        sparse_mla_pass.apply(graph, self.report)
        self.graph = torch.fx.GraphModule(graph.owning_module, graph)  # its constants included

    def uuid(self):
        return b"test_pass_sparse_mla"


@pytest.mark.sglang
@pytest.mark.parametrize("pools", [2, 1], ids=["two-pools", "window-only"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_sglang_fallback_with_its_fp8_page_layout(sglang_sm120, tokens, pools):
    """The real FP8 page-layout gather + dequantisation stays; the attention over it becomes the op.
    Window-only layers (compress ratio 0) pass extra_k_cache=None: V is then the gather's [N, 512]
    rows reshaped to [B, T, K, 512].

    Inductor's CPU C++ codegen has no float8_e8m0fnu (SGLang views the scale bytes as it), so on
    CPU compilation stops after the post-grad passes; the rewritten post-grad graph is run instead.
    """
    gen = torch.Generator().manual_seed(2)
    page = 64
    page_bytes = -(-page * 584 // 576) * 576
    pages = torch.randint(0, 256, (3, page_bytes), generator=gen, dtype=torch.uint8)
    for p in range(3):  # e4m3 values (no NaN codes) + bf16 rope, then exponents near 2^0
        data = pages[p, : page * 576].view(page, 576)
        data[:, :448] = torch.randn(page, 448, generator=gen).to(torch.float8_e4m3fn).view(torch.uint8)
        data[:, 448:] = torch.randn(page, 64, generator=gen).to(torch.bfloat16).view(torch.uint8)
        pages[p, page * 576: page * 584] = torch.randint(124, 130, (page * 8,), generator=gen, dtype=torch.uint8)
    cache = pages.as_strided((3, page, 1, 576), (page_bytes, 576, 576, 1)).view(torch.float8_e4m3fn)
    q = torch.randn(1, tokens, 2, 512, generator=gen).to(torch.bfloat16)
    idx = torch.randint(-1, 3 * page, (1, tokens, 8), generator=gen, dtype=torch.int32)
    extra_idx = torch.randint(-1, 3 * page, (1, tokens, 16), generator=gen, dtype=torch.int32)
    args = (q, cache, idx, torch.randn(2, generator=gen), cache, extra_idx)
    if pools == 1:
        args = args[:4] + (None, None)
    fn = lambda *a: sglang_decode(sglang_sm120, *a)  # noqa: E731
    report = PassReport()
    keeper = _RunPassAndKeepGraph(report)
    compiled = torch.compile(fn, backend="inductor", options={"post_grad_custom_post_pass": keeper})
    try:
        compiled(*args)
    except torch._inductor.exc.InductorError as err:
        assert "float8_e8m0fnu" in str(err)
    assert report.count("sparse_mla") == 1
    assert any(n.target == torch.ops.dsv4.sparse_mla.default for n in keeper.graph.graph.nodes)
    assert not any(n.target == torch.ops.aten.bmm.default for n in keeper.graph.graph.nodes)
    # dynamo dedups the repeated cache and orders inputs itself: map them back by shape and dtype
    inputs = {(tuple(a.shape), a.dtype): a for a in args if a is not None}
    graph_args = [inputs[(tuple(n.meta["val"].shape), n.meta["val"].dtype)]
                  for n in keeper.graph.graph.nodes if n.op == "placeholder"]
    (got,) = keeper.graph(*graph_args)
    torch.testing.assert_close(got, fn(*args), **TOL[torch.bfloat16])


def _declined_with_sink_softmax(logits_of):
    """Compiles sparse attention with a sink column whose logits are `logits_of(q, rows, idx)` (masked
    with -inf past the valid rows, values `rows`) with the sparse_mla pass alone; asserts that the pass
    declined and the compiled graph equals eager. Returns the pass report."""
    import torch.nn.functional as F
    from dsv4_compile.model.hotspots import gather_rows
    from dsv4_compile.passes import sparse_mla as smla_pass
    from helpers import compile_with_probe

    def fn(q, kv, idx, sink):
        rows = gather_rows(kv, idx)
        batch, tokens, heads, _ = q.shape
        logits = logits_of(q, rows, idx)
        sinks = sink.view(1, 1, heads, 1).expand(batch, tokens, heads, 1)
        probs = F.softmax(torch.cat([logits, sinks], -1), dim=-1)[..., :-1]
        return torch.matmul(probs, rows)

    gen = torch.Generator().manual_seed(0)
    q, kv = torch.randn(2, 2, 4, 64, generator=gen), torch.randn(40, 64, generator=gen)
    idx = torch.randint(0, 40, (2, 2, 16), generator=gen).to(torch.int32)
    idx[:, :, -3:] = -1
    sink = torch.randn(4, generator=gen)
    torch._dynamo.reset()
    compiled, report, probe = compile_with_probe(fn, smla_pass)
    torch.testing.assert_close(compiled(q, kv, idx, sink), fn(q, kv, idx, sink), rtol=1e-5, atol=1e-5)
    assert probe.rewrites == 0
    return report


def test_a_float_mask_is_declined():
    """A mask that is float before its cast to bool (`valid.bool()`): the pass declines rather than
    emit a where on a float predicate (compiling used to fail)."""
    def logits_of(q, rows, idx):
        valid = (idx >= 0).float()
        logits = torch.matmul(q, rows.transpose(-1, -2)) * 0.125
        return logits.masked_fill(~(valid.unsqueeze(2).bool()), float("-inf"))

    report = _declined_with_sink_softmax(logits_of)
    assert any("not bool" in r.reason for r in report.records if not r.matched)


def test_keys_written_apart_from_the_values_are_declined():
    """Keys that differ from the values in some valid rows (an index_put on the keys alone): the op
    needs K == V, so the pass declines."""
    def logits_of(q, rows, idx):
        keys = rows.clone()
        keys[(idx % 2 == 0) & (idx >= 0)] = 1.0
        logits = torch.matmul(q, keys.transpose(-1, -2)) * 0.125
        return logits.masked_fill(~(idx >= 0).unsqueeze(2), float("-inf"))

    report = _declined_with_sink_softmax(logits_of)
    assert any("keys are written" in r.reason for r in report.records if not r.matched)


# ----------------------------------------------------------------------------- sizes that coincide
# With K == D, H == K, T == H (or H == K + 1 against a row reduction's kept dim) shapes cannot tell
# the layouts apart: a transposed operand or a reduction broadcast along the wrong dim still fits.

EQUAL = dict(batch=2, tokens=16, heads=16, keys=16, dim=16)  # T == H == K == D (the op needs D % 16 == 0)
HEADS_KEYS_PLUS_ONE = dict(batch=2, tokens=2, heads=5, keys=4, dim=16)  # H == K + 1: [B,T,1,H] fits [B,T,H,K+1]
ONE_BATCH = dict(batch=1, tokens=4, heads=4, keys=4, dim=16)  # B == 1, T == H


def coinciding_inputs(batch, tokens, heads, keys, dim, seed=0):
    """f32 (q, kv, idx, sink) at the given sizes; idx has -1 entries, token 0 of request 0 has none valid."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, 40, (batch, tokens, keys), generator=gen).to(torch.int32)
    idx[0, 0] = -1
    return (torch.randn(batch, tokens, heads, dim, generator=gen), torch.randn(40, dim, generator=gen), idx,
            torch.randn(heads, generator=gen))


def sink_column_attention(q, kv, idx, sink, variant=""):
    """The model's form (sink column, exp / sum with a row maximum), written out; `variant` lays one
    piece out wrongly where sizes coincide."""
    rows = gather_rows(kv, idx)
    batch, tokens, heads, _ = q.shape
    logits = torch.matmul(q, rows if variant == "keys" else rows.transpose(-1, -2))
    logits = (logits.transpose(-1, -2) if variant == "logits" else logits) * 0.125
    valid = idx >= 0
    logits = logits.masked_fill(~(valid.unsqueeze(-1) if variant == "mask" else valid.unsqueeze(2)), float("-inf"))
    sinks = sink.view(1, heads, 1, 1) if variant == "sink" else sink.view(1, 1, heads, 1)
    combined = torch.cat([logits, sinks.expand(batch, tokens, heads, 1)], dim=-1)
    row_max = combined.amax(-1, keepdim=True)
    weights = torch.exp(combined - (row_max.transpose(-1, -2) if variant == "max" else row_max))
    total = weights.sum(-1, keepdim=True)
    probs = (weights / (total.transpose(-1, -2) if variant == "sum" else total))[..., :-1]
    values = rows.transpose(-1, -2) if variant == "values" else rows
    if variant == "output":  # B == 1: a [T, H, D] product read back as [1, H, T, D]
        return torch.matmul(probs.squeeze(0), values.squeeze(0)).transpose(0, 1).unsqueeze(0)
    return torch.matmul(probs, values)


def lse_sink_attention(q, kv, idx, sink, variant=""):
    """SGLang's normalisation written out: zero-filled rows, exp(L - logsumexp(stack(lse, sink))) with
    +inf on rows that have nothing valid; `variant` lays one piece out wrongly where sizes coincide
    (or, for "fixup", puts the +inf on other rows)."""
    invalid = idx < 0
    rows = gather_rows(kv, idx)
    rows[invalid.transpose(1, 2) if variant == "fill" else invalid] = 0.0
    logits = (torch.matmul(q, rows.transpose(-1, -2)) * 0.125).masked_fill(invalid.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    sinks = (sink.view(1, -1, 1) if variant == "sink" else sink.view(1, 1, -1)).expand_as(lse)
    norm = torch.logsumexp(torch.stack([lse.transpose(1, 2) if variant == "lse" else lse, sinks]), dim=0)
    norm[lse > 0 if variant == "fixup" else lse == float("-inf")] = float("inf")
    shift = norm.unsqueeze(-2) if variant == "normaliser" else norm.unsqueeze(-1)
    return torch.matmul(torch.exp(logits - shift), rows)


def assert_declined(fn, args, reason):
    """The pass declines every site of fn with `reason` and the compiled fn computes as eager."""
    out, code, report = compile_with_pass(fn, *args)
    assert report.count("sparse_mla") == 0 and "dsv4.sparse_mla" not in code
    declined = [r for r in report.records if r.pass_name == "sparse_mla" and not r.matched]
    assert declined and all(reason in r.reason for r in declined), report.records
    torch.testing.assert_close(out, fn(*args), **TOL[torch.float32])


def assert_rewritten(fn, args):
    out, code, report = compile_with_pass(fn, *args)
    assert report.count("sparse_mla") == 1 and "dsv4.sparse_mla" in code and "bmm" not in code, report.records
    torch.testing.assert_close(out, fn(*args), **TOL[torch.float32])


@pytest.mark.parametrize("fn", [sink_column_attention, lse_sink_attention, window_attention])
@pytest.mark.parametrize("sizes", [EQUAL, HEADS_KEYS_PLUS_ONE, ONE_BATCH], ids=["equal", "h=k+1", "b=1"])
def test_coinciding_sizes_in_the_right_layout_are_rewritten(fn, sizes):
    assert_rewritten(fn, coinciding_inputs(**sizes))


def test_output_read_back_in_the_right_layout_is_rewritten():
    assert_rewritten(sink_column_attention, coinciding_inputs(**ONE_BATCH))


@pytest.mark.parametrize("variant, sizes, reason", [
    ("keys", EQUAL, "the keys in the q.k product (K transposed) has dims [bt, k, d], not [bt, d, k]"),
    ("values", EQUAL, "the values in the PV product has dims [bt, d, k], not [bt, k, d]"),
    ("logits", EQUAL, "the q.k product read as logits has dims [b, t, k, h], not [b, t, h, k]"),
    ("mask", EQUAL, "the mask applied to the logits has dims"),
    ("sink", EQUAL, "the sink column has dims"),
    ("max", HEADS_KEYS_PLUS_ONE, "a row maximum subtracted in the softmax has dims"),
    ("sum", HEADS_KEYS_PLUS_ONE, "the softmax's row sum has dims"),
    ("output", ONE_BATCH, "the attention output has dims [1, h, t, d], not [1, t, h, d]"),
])
def test_sink_column_form_laid_out_otherwise_is_declined(variant, sizes, reason):
    fn = lambda *a: sink_column_attention(*a, variant=variant)  # noqa: E731
    assert_declined(fn, coinciding_inputs(**sizes), reason)


@pytest.mark.parametrize("variant, reason", [
    ("fill", "the rows' zero fill reads the attention mask in another layout"),
    ("lse", "the lse in the normaliser has dims [a, c, b], not [a, b, c]"),
    ("sink", "the sink in the normaliser has dims"),
    ("normaliser", "the normaliser has dims [a, b, 1, c], not [a, b, c, 1]"),
    ("fixup", "the +inf fix-up of the normaliser is not on the rows with nothing valid"),
])
def test_lse_form_laid_out_otherwise_is_declined(variant, reason):
    fn = lambda *a: lse_sink_attention(*a, variant=variant)  # noqa: E731
    assert_declined(fn, coinciding_inputs(**EQUAL), reason)


def gather_with_transposed_indices(q, kv, idx, sink):
    """T == K: rows[b, t, k] = kv[idx[b, k, t]], valid where idx[b, k, t] >= 0."""
    rows = kv[idx.transpose(1, 2).clamp(min=0).long()]
    return sparse_attention_with_sink(q, rows, (idx >= 0).transpose(1, 2), sink, 0.125)


def mask_of_transposed_indices(q, kv, idx, sink):
    """T == K: rows gathered by idx as they are, masked where idx[b, k, t] < 0."""
    return sparse_attention_with_sink(q, gather_rows(kv, idx), idx.transpose(1, 2) >= 0, sink, 0.125)


@pytest.mark.parametrize("fn", [gather_with_transposed_indices, mask_of_transposed_indices])
def test_indices_read_in_another_layout_are_not_passed_as_they_are(fn):
    # The rows (or the mask) read idx transposed: the op runs over the materialised rows (or with the
    # mask folded into the indices) instead of reading the pool through idx as it is.
    assert_rewritten(fn, coinciding_inputs(**EQUAL))


def zero_filled_window_attention(q, kv, idx, sink, zeroed="skipped"):
    """The model's form over rows zero-filled where the mask (written as the valid rows) skips them,
    or, wrongly, where it reads them (`zeroed="valid"`: then every logit is 0 and every value 0)."""
    valid = idx >= 0
    rows = gather_rows(kv, idx).clone()
    rows[~valid if zeroed == "skipped" else valid] = 0.0
    return sparse_attention_with_sink(q, rows, valid, sink, 0.125)


def test_rows_zeroed_where_the_mask_skips_them_are_rewritten():
    assert_rewritten(zero_filled_window_attention, coinciding_inputs(**ONE_BATCH))


def test_rows_zeroed_where_the_mask_reads_them_are_declined():
    fn = lambda *a: zero_filled_window_attention(*a, zeroed="valid")  # noqa: E731
    assert_declined(fn, coinciding_inputs(**ONE_BATCH), "the zero fill writes the rows the attention reads")


@pytest.mark.parametrize("layer", ["window", "csa"])
def test_symbolic_batch_and_tokens_are_rewritten(layer):
    """A recompile for a second batch size makes B and T symbolic: the layout checks decide on them."""
    args = model_inputs(layer, 3)
    for arg in args:
        if arg.dim() >= 3:  # q and the indices: [B, T, ...]
            torch._dynamo.mark_dynamic(arg, 0)
            torch._dynamo.mark_dynamic(arg, 1)
    fn = window_attention if layer == "window" else two_pool_attention
    out, code, report = compile_with_pass(fn, *args)
    assert report.count("sparse_mla") == 1, report.records
    assert "dsv4.sparse_mla" in code and "bmm" not in code
    torch.testing.assert_close(out, fn(*args), **TOL[torch.bfloat16])


def test_a_reshape_symbolic_sizes_cannot_decide_is_declined_as_such():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from dsv4_compile.passes import dim_labels

    env = ShapeEnv()
    batch = env.create_symintnode(env.create_symbol(4, ConstantSource("batch")), hint=4)
    dims = dim_labels.labelled((batch, 4), "bt")
    assert dim_labels.regrouped(dims, (batch * 4,)) == ((("b", batch), ("t", 4)),)
    with pytest.raises(dim_labels.Undecidable, match="symbolic sizes the layout check cannot decide"):
        dim_labels.regrouped(dims, (batch * 2, 2))
    with pytest.raises(Decline, match="a reshape splits a dim"):
        dim_labels.regrouped(dim_labels.labelled((3, 4), "bt"), (6, 2))
