"""passes/fp4_moe.py: the plain-torch FP4 MoE becomes dsv4::fp4_moe in decode and verify graphs,
computes the same result, and variants that are not that math stay as they are."""
import types

import pytest
import torch
import torch.nn.functional as F

from dsv4_compile import fp4, fp4_tiles
from dsv4_compile.fp4_tiles import tile_fp4
from dsv4_compile.model.hotspots import moe_experts_fp4, moe_experts_gathered
from dsv4_compile.passes import fp4_moe as fp4_pass, fx_probe
from helpers import BmmToMmOnCpu, compile_with_probe, make_experts

EXPERTS, HIDDEN, INTER, TOP_K = 4, 64, 32, 2


pytestmark = pytest.mark.usefixtures("fresh_inductor_cache")


def compile_with_pass(fn):
    torch._dynamo.reset()
    compiled, report, probe = compile_with_probe(fn, fp4_pass)
    return compiled, probe, report


def experts(fmt, seed=0, hidden=HIDDEN, inter=INTER):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(EXPERTS, hidden, inter, generator=gen) * 0.1
    if fmt == "mxfp4":
        (a, b), (c, d) = fp4.quantize_mxfp4(w13), fp4.quantize_mxfp4(w2)
        return a, b, c, d, fmt, None, None
    (a, b, g13), (c, d, g2) = fp4.quantize_nvfp4(w13), fp4.quantize_nvfp4(w2)
    return a, b, c, d, fmt, g13, g2


def routing(tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, EXPERTS, (tokens, TOP_K), generator=gen, dtype=torch.int32)
    return ids, torch.rand(tokens, TOP_K, generator=gen) + 0.1


def moe_step(x, ids, weights, w13, s13, w2, s2, fmt, g13, g2, limit):
    """A model-shaped call: [B, T, K] hidden flattened to M = B*T rows, plus a residual add."""
    batch, tokens, hidden = x.shape
    routed = moe_experts_fp4(x.reshape(-1, hidden), ids, weights, w13, s13, w2, s2, fmt, g13, g2, limit)
    return routed.view(batch, tokens, hidden) + x


# bf16: the pass swaps the bf16 plain-torch math (bf16 weights, bf16 GEMVs) for the op's f32
# accumulation; both round the output to bf16, so 3e-2 of the output scale. f32: 1e-4.
TOL = {torch.bfloat16: 3e-2, torch.float32: 1e-4}


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("batch, tokens", [(2, 1), (2, 3)], ids=["decode", "verify"])
@pytest.mark.parametrize("limit, dtype", [(10.0, torch.bfloat16), (None, torch.float32)])
def test_rewrites_and_matches_eager(fmt, batch, tokens, limit, dtype):
    weights_args = experts(fmt)
    ids, weights = routing(batch * tokens, seed=batch + tokens)
    x = torch.randn(batch, tokens, HIDDEN, generator=torch.Generator().manual_seed(7)).to(dtype)
    compiled, hook, report = compile_with_pass(moe_step)
    got = compiled(x, ids, weights, *weights_args, limit)
    want = moe_step(x, ids, weights, *weights_args, limit)
    assert hook.rewrites == 1 and report.count(fp4_pass.PASS_NAME) == 1
    assert torch.ops.dsv4.fp4_moe.default in hook.targets
    assert torch.ops.aten.bmm.default not in hook.targets  # the dense expert GEMVs are gone
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= TOL[dtype] * scale


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("tokens", [1, 3], ids=["decode", "verify"])
def test_tiled_experts_rewritten(fmt, tokens):
    """Experts in the tiled layout (dsv4_compile.fp4_tiles; the plain-torch form puts the gathered
    tiles back in row order with a permute and a copy) are rewritten as well, to the op on the tiled
    tensors."""
    w = make_experts(fmt, 2, 128, 128, seed=5)
    weights_args = (tile_fp4(w["w13"]), w["w13_scale"], tile_fp4(w["w2"]), w["w2_scale"], fmt, w["w13_global"],
                    w["w2_global"])
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, 2, (2 * tokens, TOP_K), generator=gen, dtype=torch.int32)
    weights = torch.rand(2 * tokens, TOP_K, generator=gen) + 0.1
    x = torch.randn(2, tokens, 128, generator=gen)
    compiled, hook, report = compile_with_pass(moe_step)
    got = compiled(x, ids, weights, *weights_args, None)
    want = moe_step(x, ids, weights, *weights_args, None)
    assert hook.rewrites == 1 and report.count(fp4_pass.PASS_NAME) == 1
    assert torch.ops.dsv4.fp4_moe.default in hook.targets
    assert (got - want).abs().max() <= TOL[torch.float32] * want.abs().max()


@pytest.mark.parametrize("fmt, tiled", [("mxfp4", True), ("nvfp4", False)])
def test_larger_experts_rewritten(fmt, tiled):
    """Experts beyond the dequantisation probe's block (64 rows x 256 columns, two tokens) are
    checked on that block and rewritten."""
    w = make_experts(fmt, 4, 512, 256, seed=9)
    layout = tile_fp4 if tiled else (lambda packed: packed)
    weights_args = (layout(w["w13"]), w["w13_scale"], layout(w["w2"]), w["w2_scale"], fmt, w["w13_global"],
                    w["w2_global"])
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 4, (3, TOP_K), generator=gen, dtype=torch.int32)
    weights = torch.rand(3, TOP_K, generator=gen) + 0.1
    x = torch.randn(1, 3, 512, generator=gen)
    compiled, hook, report = compile_with_pass(moe_step)
    got = compiled(x, ids, weights, *weights_args, 10.0)
    want = moe_step(x, ids, weights, *weights_args, 10.0)
    assert hook.rewrites == 1 and report.count(fp4_pass.PASS_NAME) == 1
    assert (got - want).abs().max() <= TOL[torch.float32] * want.abs().max()


def test_tiled_codes_without_the_unswizzle_are_declined(monkeypatch):
    """5-D codes put back in row order by views and a copy alone (no word unswizzle) do not hold the
    tiled layout's bits the kernels decode: the pass declines and says why, and the graph keeps its math."""
    monkeypatch.setattr(fp4_tiles, "untile_fp4", fp4_tiles.untile_matrix)
    w = make_experts("mxfp4", 2, 128, 128, seed=6)
    tiled = (fp4_tiles.tile_matrix(w["w13"], 64), w["w13_scale"], fp4_tiles.tile_matrix(w["w2"], 64),
             w["w2_scale"], "mxfp4", None, None)
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 2, (2, TOP_K), generator=gen, dtype=torch.int32)
    weights = torch.rand(2, TOP_K, generator=gen) + 0.1
    x = torch.randn(2, 1, 128, generator=gen)
    compiled, hook, report = compile_with_pass(moe_step)
    got = compiled(x, ids, weights, *tiled, None)
    assert hook.rewrites == 0 and "unswizzled" in str(report)
    want = moe_step(x, ids, weights, *tiled, None)
    assert (got - want).abs().max() <= TOL[torch.float32] * want.abs().max()


def test_top1_token_bmms_made_mm_by_inductor_are_rewritten(monkeypatch):
    """One token routed to one expert: both expert GEMMs have batch M * k = 1, which inductor turns
    into unsqueeze(mm(squeeze, squeeze), 0) on CUDA."""
    weights_args = experts("mxfp4")
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, EXPERTS, (1, 1), generator=gen, dtype=torch.int32)
    weights = torch.rand(1, 1, generator=gen) + 0.1
    x = torch.randn(1, 1, HIDDEN, generator=gen)
    bmm_to_mm = BmmToMmOnCpu(monkeypatch)
    compiled, hook, report = compile_with_pass(moe_step)
    got = compiled(x, ids, weights, *weights_args, None)
    want = moe_step(x, ids, weights, *weights_args, None)
    assert bmm_to_mm.rewrites == 2
    assert hook.rewrites == 1 and report.count(fp4_pass.PASS_NAME) == 1
    assert torch.ops.aten.mm.default not in hook.targets
    assert (got - want).abs().max() <= TOL[torch.float32] * want.abs().max()


def test_bf16_experts_not_rewritten():
    gen = torch.Generator().manual_seed(1)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen)
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen)
    ids, weights = routing(3, seed=1)
    compiled, hook, report = compile_with_pass(moe_experts_gathered)
    compiled(torch.randn(3, HIDDEN), ids, weights, w13, w2, 10.0)
    assert hook.rewrites == 0
    declines = [r for r in report.records if not r.matched]
    assert declines and "no packed uint8 expert gather" in declines[0].reason


def _gelu_variant(x, ids, weights, w13, s13, w2, s2, fmt, g13, g2, limit):
    idx = ids.long()
    gate_up = torch.matmul(fp4.dequantize_mxfp4(w13[idx], s13[idx], x.dtype), x[:, None, :, None]).squeeze(-1)
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.matmul(fp4.dequantize_mxfp4(w2[idx], s2[idx], x.dtype), (F.gelu(gate) * up).unsqueeze(-1))
    return (out.squeeze(-1) * weights.unsqueeze(-1)).sum(dim=1)


def _one_sided_clamp_variant(x, ids, weights, w13, s13, w2, s2, fmt, g13, g2, limit):
    idx = ids.long()
    gate_up = torch.matmul(fp4.dequantize_mxfp4(w13[idx], s13[idx], x.dtype), x[:, None, :, None]).squeeze(-1)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = F.silu(gate.clamp(max=limit)) * up.clamp(min=-2 * limit, max=limit)
    out = torch.matmul(fp4.dequantize_mxfp4(w2[idx], s2[idx], x.dtype), hidden.unsqueeze(-1))
    return (out.squeeze(-1) * weights.unsqueeze(-1)).sum(dim=1)


def _dequantize(packed, scale, glob, dtype):
    """The model's dequantisation of gathered experts (glob None: MXFP4)."""
    if glob is None:
        return fp4.dequantize_mxfp4(packed, scale, dtype)
    return fp4.dequantize_nvfp4(packed, scale, glob, dtype)


def _swiglu(gate, up, limit):
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def _same(t):
    return t


def _variant(activation=_swiglu, gate_up_weights=_dequantize, down_weights=_dequantize,
             gather_index=torch.Tensor.long, routing_weights=_same, token_rows=lambda x: x[:, None, :, None],
             gate_up_order=_same, product_order=_same):
    """The MoE form with `activation(gate, up, limit)` in place of the clamped SwiGLU,
    `*_weights(packed, scale, glob, dtype)` dequantising the gathered experts, `gather_index(ids)`
    the index of the gathers, `routing_weights(weights)` the weights of the sum, `token_rows(x)` the
    activations broadcast over the pairs, and `gate_up_order` / `product_order` applied to the [M, k, .]
    gate/up products and down products."""
    def variant(x, ids, weights, w13, s13, w2, s2, fmt, g13, g2, limit):
        idx = gather_index(ids)
        g13, g2 = (None, None) if g13 is None else (g13[idx], g2[idx])
        gate_up_w = gate_up_weights(w13[idx], s13[idx], g13, x.dtype)
        gate_up = gate_up_order(torch.matmul(gate_up_w, token_rows(x)).squeeze(-1))
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = activation(gate, up, limit)
        out = product_order(torch.matmul(down_weights(w2[idx], s2[idx], g2, x.dtype), hidden.unsqueeze(-1)).squeeze(-1))
        return (out * routing_weights(weights).unsqueeze(-1)).sum(dim=1)
    return variant


@pytest.mark.parametrize("variant, reason", [
    (_gelu_variant, "activation"),
    (_one_sided_clamp_variant, "swiglu limit"),
    # ops the activation may hold, computing something else: only the probe values tell
    (_variant(lambda g, u, lim: F.silu(u) * g), "probe values differ"),
    (_variant(lambda g, u, lim: torch.sigmoid(g) * u), "probe values differ"),
    (_variant(lambda g, u, lim: F.silu(g) * u * 0.5), "probe values differ"),
    (_variant(lambda g, u, lim: F.silu(g.clamp(-lim, lim)) * u.clamp(max=lim)), "probe values differ"),
], ids=["gelu", "one-sided clamp", "swapped halves", "sigmoid gate", "extra factor", "clamps swapped"])
def test_other_math_declined(variant, reason):
    ids, weights = routing(3, seed=2)
    x = torch.randn(3, HIDDEN)
    args = (x, ids, weights, *experts("mxfp4"), 5.0)
    compiled, hook, report = compile_with_pass(variant)
    got = compiled(*args)
    assert hook.rewrites == 0
    assert any(not r.matched and reason in r.reason for r in report.records), report.records
    torch.testing.assert_close(got, variant(*args), rtol=1e-4, atol=1e-4)


def _mxfp4_weights(codes, block_scale, dtype):
    """Decoded codes [..., C] times one f32 scale a block of 32, [..., C/32] (the model's grouping)."""
    return (fp4.decode_e2m1(codes).unflatten(-1, (-1, 32)) * block_scale.unsqueeze(-1)).flatten(-2).to(dtype)


def _swapped_nibbles(packed, scale, glob, dtype):
    codes = torch.stack([packed >> 4, packed & 0xF], dim=-1).flatten(-2)
    return _mxfp4_weights(codes, fp4.ue8m0_to_float(scale), dtype)


def _scale_bias_126(packed, scale, glob, dtype):
    return _mxfp4_weights(fp4.unpack_e2m1(packed), torch.exp2(scale.float() - 126), dtype)


def _scales_cycled(packed, scale, glob, dtype):
    """Column c scaled by block c % (C/32) rather than c // 32."""
    values, block_scale = fp4.decode_e2m1(fp4.unpack_e2m1(packed)), fp4.ue8m0_to_float(scale)
    cycled = block_scale.unsqueeze(-2).expand(*block_scale.shape[:-1], 32, block_scale.shape[-1]).flatten(-2)
    return (values * cycled).to(dtype)


def _halved_columns(packed, scale, glob, dtype):
    """Every other column times 0.5, a constant of the graph."""
    return _dequantize(packed, scale, glob, dtype) * torch.tensor([0.5, 1.0] * packed.shape[-1])


def _up_rows_first(packed, scale, glob, dtype):
    weights = _dequantize(packed, scale, glob, dtype)
    half = weights.shape[-2] // 2
    return torch.cat([weights[..., half:, :], weights[..., :half, :]], dim=-2)


def _transposed(packed, scale, glob, dtype):
    return _dequantize(packed, scale, glob, dtype).transpose(-1, -2)


def _first_global_times(x, ids, weights, w13, s13, w2, s2, fmt, g13, g2, limit):
    """The gate/up weights also times expert 0's global (read whole, not gathered)."""
    return _variant(gate_up_weights=lambda *a: _dequantize(*a) * g13[0])(x, ids, weights, w13, s13, w2, s2, fmt,
                                                                         g13, g2, limit)


_DIFFER = "probe values differ"
# name: (format, hidden, inter, MoE form, reason): weight paths of the ops the dequantisation may
# hold that compute other weights; the op kinds alone do not tell.
_OTHER_DEQUANTISATIONS = {
    "times 2": ("mxfp4", HIDDEN, INTER, _variant(gate_up_weights=lambda *a: _dequantize(*a) * 2), _DIFFER),
    # MXFP4 dequantises exactly: a factor within any rounding tolerance differs all the same
    "times 1 + 2**-20": ("mxfp4", HIDDEN, INTER, _variant(down_weights=lambda *a: _dequantize(*a) * (1 + 2**-20)),
                         _DIFFER),
    "times a constant": ("mxfp4", HIDDEN, INTER, _variant(down_weights=_halved_columns), _DIFFER),
    "global twice": ("nvfp4", HIDDEN, INTER,
                     _variant(gate_up_weights=lambda p, s, g, dt: _dequantize(p, s, g, dt) * g[..., None, None]),
                     _DIFFER),
    "first global": ("nvfp4", HIDDEN, INTER, _first_global_times,
                     "reads tensors other than the gathered codes, scales and globals"),
    "swapped nibbles": ("mxfp4", HIDDEN, INTER, _variant(gate_up_weights=_swapped_nibbles), _DIFFER),
    "scale bias 126": ("mxfp4", HIDDEN, INTER, _variant(down_weights=_scale_bias_126), _DIFFER),
    "scales cycled": ("mxfp4", HIDDEN, INTER, _variant(gate_up_weights=_scales_cycled), _DIFFER),
    "down transposed, I == K": ("nvfp4", HIDDEN, HIDDEN, _variant(down_weights=_transposed), _DIFFER),
    "up rows first": ("mxfp4", HIDDEN, INTER, _variant(gate_up_weights=_up_rows_first), _DIFFER),
    # full-size experts are probed on a block of rows and columns (64 x 256)
    "down transposed, I == K = 512": ("mxfp4", 512, 512, _variant(down_weights=_transposed), _DIFFER),
    "up rows first, 2I = 512": ("mxfp4", 128, 256, _variant(gate_up_weights=_up_rows_first),
                                "cannot be run on probe values"),
}


@pytest.mark.parametrize("name", list(_OTHER_DEQUANTISATIONS))
def test_other_dequantisation_declined(name):
    """Weight paths of dequantise-only ops that are not the op's dequantisation stay as they are."""
    fmt, hidden, inter, variant, reason = _OTHER_DEQUANTISATIONS[name]
    ids, weights = routing(3, seed=3)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(3))
    args = (x, ids, weights, *experts(fmt, hidden=hidden, inter=inter), 5.0)
    compiled, hook, report = compile_with_pass(variant)
    got = compiled(*args)
    assert hook.rewrites == 0
    assert any(not r.matched and reason in r.reason for r in report.records), report.records
    torch.testing.assert_close(got, variant(*args), rtol=1e-4, atol=1e-4)


def _column_scales(packed, scale, glob, dtype):
    """MXFP4 with each column's block scale looked up by an arange (column >> 5)."""
    values = fp4.decode_e2m1(fp4.unpack_e2m1(packed))
    block = torch.arange(values.shape[-1], device=packed.device) >> 5
    return (values * fp4.ue8m0_to_float(scale)[..., block]).to(dtype)


def _on_another_device(graph, report):
    """fp4_pass.apply on `graph` with its device kwargs moved to the meta device, as a GPU graph's
    arange / iota carry a device other than the CPU probe's."""
    for node in graph.nodes:
        if "device" in node.kwargs:
            node.kwargs = {**node.kwargs, "device": torch.device("meta")}
    return fp4_pass.apply(graph, report)


def test_device_kwargs_run_on_the_probe_device():
    """A weight path whose arange carries another device than the probe's is probed and rewritten
    (its nodes are gone with the rewrite, so the compiled graph runs on CPU)."""
    variant = _variant(gate_up_weights=_column_scales)
    ids, weights = routing(3, seed=4)
    args = (torch.randn(3, HIDDEN), ids, weights, *experts("mxfp4"), 5.0)
    torch._dynamo.reset()
    on_meta = types.SimpleNamespace(apply=_on_another_device, __name__="fp4_moe_on_meta")
    compiled, report, hook = compile_with_probe(variant, on_meta)
    got = compiled(*args)
    assert hook.rewrites == 1 and report.count(fp4_pass.PASS_NAME) == 1, report.records
    torch.testing.assert_close(got, variant(*args), rtol=1e-4, atol=1e-4)


def test_errors_inside_the_probe_propagate(monkeypatch):
    """An error of the probe's own (a bug in the pass) is raised, not recorded as a decline."""
    def broken(node, value):
        raise RuntimeError("a bug in the probe")
    monkeypatch.setattr(fx_probe, "_check_block", broken)
    ids, weights = routing(3, seed=4)
    args = (torch.randn(3, HIDDEN), ids, weights, *experts("mxfp4"), 5.0)
    compiled, hook, report = compile_with_pass(_variant())
    with pytest.raises(Exception, match="a bug in the probe"):
        compiled(*args)
    assert not report.records


@pytest.mark.parametrize("variant, reason", [
    (_variant(gather_index=lambda ids: ids.long().t()), "expert ids are read through"),
    (_variant(routing_weights=torch.Tensor.t), "routing weights are read through"),
    (_variant(token_rows=lambda x: x[None, :, :, None]), "their own token's x"),
    (_variant(gate_up_order=lambda t: t.transpose(0, 1)), "each pair's gate/up halves"),
    (_variant(product_order=lambda t: t.transpose(0, 1)), "the op's (m, j) order"),
], ids=["ids", "routing weights", "tokens", "gate/up products", "down products"])
def test_pairs_in_another_order_declined(variant, reason):
    """With M == k the shapes are those of the op's [M, k] pairs, and only the layout tells: gathers by
    ids.t() pair token m with the experts of ids[:, m], weights.t() weigh its choice j by weights[j, m],
    x[None] broadcast over the pairs gives (m, j) token j, and a transpose of the [M, k, .] gate/up or
    down products pairs the experts of (m, j) with (j, m)."""
    ids, weights = routing(TOP_K, seed=5)
    args = (torch.randn(TOP_K, HIDDEN), ids, weights, *experts("mxfp4"), 5.0)
    compiled, hook, report = compile_with_pass(variant)
    got = compiled(*args)
    assert hook.rewrites == 0
    assert any(not r.matched and reason in r.reason for r in report.records), report.records
    torch.testing.assert_close(got, variant(*args), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype, declined", [(torch.uint8, True), (torch.bfloat16, True), (torch.float32, False)])
def test_ids_converted_to_a_dtype_that_loses_some_declined(dtype, declined):
    """300 experts: ids converted to uint8 wrap past 255 and bf16 rounds ids past 256 in the graph, where
    the op would read the right experts; f32 holds every id, and the site is rewritten."""
    experts_count, gen = 300, torch.Generator().manual_seed(7)
    (w13, s13), (w2, s2) = (fp4.quantize_mxfp4(torch.randn(experts_count, rows, cols, generator=gen) * 0.1)
                            for rows, cols in ((2 * INTER, HIDDEN), (HIDDEN, INTER)))
    ids = torch.randint(257, experts_count, (3, TOP_K), generator=gen, dtype=torch.int32)
    weights = torch.rand(3, TOP_K, generator=gen) + 0.1
    variant = _variant(gather_index=lambda i: i.to(dtype).long())
    args = (torch.randn(3, HIDDEN, generator=gen), ids, weights, w13, s13, w2, s2, "mxfp4", None, None, 5.0)
    compiled, hook, report = compile_with_pass(variant)
    got = compiled(*args)
    assert hook.rewrites == (0 if declined else 1)
    if declined:
        assert any(not r.matched and f"converted to {dtype}" in r.reason for r in report.records), report.records
    torch.testing.assert_close(got, variant(*args), rtol=1e-4, atol=1e-4)
