"""dsv4::sparse_mla: Triton kernel (interpreter on CPU) against its torch reference.

Tolerances. The reference computes in f32. With bf16 q/rows the kernel's output is a convex
combination of bf16-exact rows rounded once to bf16 (relative error 2^-9 ~ 0.002), and on GPU P
is also rounded to bf16 before the PV dot (relative 2^-9 per weight, so at most 2^-9 * max|v|
absolute): |v| <= ~5 here, hence atol 2e-2, rtol 1e-2. With f32 everything is f32 (ieee dots);
only the summation order and exp2-vs-exp differ: atol = rtol = 1e-4.
"""
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, strategies as st

from dsv4_compile.kernels import sparse_mla as sparse_mla_module
from dsv4_compile.kernels.sparse_mla import (
    COMBINE_SPLITS,
    LaunchConfig,
    combine_launch,
    combine_partials_reference,
    pick_config,
    plan_sparse_mla,
    sparse_mla_partials_reference,
    sparse_mla_reference,
    sparse_mla_triton,
    split_count,
)
from helpers import run_compiled_script

TOL = {torch.bfloat16: dict(atol=2e-2, rtol=1e-2), torch.float32: dict(atol=1e-4, rtol=1e-4)}
FP8_SPLITS = [(64, 16), (64, 32), (64, 64)]  # (nope, rope) -> head_dim 80, 96, 128


def make_rows(num: int, head_dim: int, fmt: str, gen: torch.Generator, rope: int = 0):
    """Random rows: bf16/f32 [num, head_dim], or FP8 rows + exponents for (nope, rope)."""
    if fmt in ("bf16", "f32"):
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
        return torch.randn(num, head_dim, generator=gen).to(dtype), None
    nope = head_dim - rope
    e4m3 = (torch.randn(num, nope, generator=gen) * 2).to(torch.float8_e4m3fn).view(torch.uint8)
    rope_bytes = torch.randn(num, rope, generator=gen).to(torch.bfloat16).view(torch.uint8)
    rows = torch.cat([e4m3, rope_bytes], dim=1)
    scales = torch.randint(124, 130, (num, nope // 64 + 1), generator=gen, dtype=torch.uint8)
    return rows, scales


def shared_layout_idx(batch, tokens, width, num_rows, gen, *, fill_lo=0, holes=0.2):
    """Window/HCA layout: idx[b, t, j] is u[b, j] or -1 (causal per token, plus random holes)."""
    u = torch.randint(0, max(num_rows, 1), (batch, width), generator=gen)
    limit = torch.randint(fill_lo, width + 1, (batch, 1), generator=gen) + torch.arange(tokens).view(1, tokens)
    visible = torch.arange(width).view(1, 1, width) < limit.unsqueeze(-1)  # token t sees one more row
    visible &= torch.rand(batch, 1, width, generator=gen) >= holes
    return torch.where(visible, u.unsqueeze(1), -1).to(torch.int32)


def topk_idx(batch, tokens, width, num_rows, gen, *, share=0.5):
    """CSA layout: per-token rows (some tokens copy token 0's list: duplicates across tokens), -1 tails."""
    idx = torch.randint(0, max(num_rows, 1), (batch, tokens, width), generator=gen)
    copy = torch.rand(batch, tokens, 1, generator=gen) < share
    idx = torch.where(copy, idx[:, :1], idx)
    count = torch.randint(0, width + 1, (batch, tokens, 1), generator=gen)
    return torch.where(torch.arange(width).view(1, 1, width) < count, idx, -1).to(torch.int32)


def inputs(seed, batch, tokens, heads, fmt, layer, window, extra_len, *, rope=16, head_dim=64,
           with_sink=True, all_skip=False):
    gen = torch.Generator().manual_seed(seed)
    if fmt == "fp8":
        head_dim = sum(FP8_SPLITS[[r for _, r in FP8_SPLITS].index(rope)])
    dtype = torch.float32 if fmt == "f32" else torch.bfloat16
    q = torch.randn(batch, tokens, heads, head_dim, generator=gen).to(dtype)
    num_rows = 40
    kv, kv_scale = make_rows(num_rows, head_dim, fmt, gen, rope)
    idx = shared_layout_idx(batch, tokens, window, num_rows, gen, fill_lo=0)
    extra_kv = extra_scale = extra_idx = None
    if layer != "window":
        num_extra = 24
        extra_kv, extra_scale = make_rows(num_extra, head_dim, fmt, gen, rope)
        if layer == "csa":
            extra_idx = topk_idx(batch, tokens, extra_len, num_extra, gen)
        else:
            extra_idx = shared_layout_idx(batch, tokens, extra_len, num_extra, gen, fill_lo=0, holes=0.1)
    if all_skip:
        idx = torch.full_like(idx, -1)
        if extra_idx is not None:
            extra_idx = torch.full_like(extra_idx, -1)
    sink = torch.randn(heads, generator=gen) if with_sink else None
    return q, kv, kv_scale, idx, extra_kv, extra_scale, extra_idx, sink, head_dim ** -0.5


def check(args, num_splits=None):
    q = args[0]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)  # poisoned: every element must be written
    got = sparse_mla_triton(*args, out=out, num_splits=num_splits)
    assert got.data_ptr() == out.data_ptr()
    want = sparse_mla_reference(*args)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, **TOL[q.dtype])
    return got


@given(
    seed=st.integers(0, 2**31 - 1),
    bt=st.sampled_from([(1, 1), (2, 1), (1, 2), (1, 3), (2, 4), (1, 8), (3, 2), (8, 1)]),
    heads=st.integers(1, 5),
    fmt=st.sampled_from(["bf16", "fp8", "f32"]),
    layer=st.sampled_from(["window", "csa", "hca"]),
    window=st.integers(1, 40),
    extra_len=st.integers(0, 40),
    rope=st.sampled_from([16, 32, 64]),
    with_sink=st.booleans(),
    num_splits=st.sampled_from([None, 1, 2, 3]),
)
def test_kernel_matches_reference(seed, bt, heads, fmt, layer, window, extra_len, rope, with_sink, num_splits):
    args = inputs(seed, *bt, heads, fmt, layer, window, extra_len, rope=rope, with_sink=with_sink,
                  head_dim=128 if fmt == "f32" else 64)
    check(args, num_splits)


@pytest.mark.parametrize("layer", ["window", "csa", "hca"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_all_indices_skipped_gives_zeros(layer, num_splits):
    args = inputs(1, 2, 2, 3, "bf16", layer, 20, 20, all_skip=True)
    got = check(args, num_splits)
    assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("splits", [1, 5, COMBINE_SPLITS, COMBINE_SPLITS + 1, 3 * COMBINE_SPLITS + 7])
@pytest.mark.parametrize("with_sink", [True, False])
def test_combine_kernel_matches_reference_and_skips_empty_splits(splits, with_sink):
    """The combine kernel, BLOCK_S splits at a time, vs combine_partials_reference. The partial rows
    of empty splits (lse -inf; zeros by the partials' contract) hold NaN here: reading one would
    poison the output. f32 output: exp2 vs exp and the summation order differ by a few ulp."""
    gen = torch.Generator().manual_seed(splits * 2 + with_sink)
    batch, tokens, heads, dim = 2, 3, 3, 48  # dim 48: BLOCK_D 64, masked columns
    empty = torch.rand(batch, tokens, heads, splits, generator=gen) < 0.6
    empty[0, 0, 0] = True  # a row with no selected position at all
    lse = (torch.randn(batch, tokens, heads, splits, generator=gen) * 3).masked_fill(empty, float("-inf"))
    parts = torch.randn(batch, tokens, heads, splits, dim, generator=gen).masked_fill(empty[..., None], 0.0)
    sink = torch.randn(heads, generator=gen) if with_sink else None
    want = combine_partials_reference(parts, lse, sink, torch.float32)
    out = torch.full((batch, tokens, heads, dim), float("nan"))
    launch = combine_launch(lse, parts.masked_fill(empty[..., None], float("nan")), sink, out)
    launch.kernel[launch.grid](*launch.args, **launch.meta)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    if not with_sink:
        assert torch.equal(out[0, 0, 0], torch.zeros(dim))


def test_many_splits_over_a_long_mostly_empty_list():
    """More splits than the combine merges at a time, most of them over -1 positions only (as an
    HCA list over max context at a short real length)."""
    q, kv, kv_scale, idx, ekv, escale, eidx, sink, scale = inputs(5, 1, 2, 3, "bf16", "hca", 20, 20)
    tail = torch.full((1, 2, 40 * 32), -1, dtype=torch.int32)
    check((q, kv, kv_scale, idx, ekv, escale, torch.cat([eidx, tail], dim=2), sink, scale),
          num_splits=2 * COMBINE_SPLITS + 3)


@pytest.mark.parametrize("extra_len", [0, 16])
def test_window_only_equals_window_plus_empty_extra(extra_len):
    """extra None, an extra pool with zero entries, and one with only -1 all give the window answer."""
    q, kv, kv_scale, idx, _, _, _, sink, scale = inputs(2, 2, 3, 4, "bf16", "window", 24, 0)
    want = check((q, kv, kv_scale, idx, None, None, None, sink, scale))
    extra_kv = torch.randn(10, q.shape[-1]).to(q.dtype)
    extra_idx = torch.full((2, 3, extra_len), -1, dtype=torch.int32)
    got = check((q, kv, kv_scale, idx, extra_kv, None, extra_idx, sink, scale), num_splits=2)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_fully_matching_and_fully_mismatching_tokens():
    """Verify tokens that share every row, and tokens whose rows differ at every position."""
    gen = torch.Generator().manual_seed(3)
    q, kv, _, _, ekv, _, _, sink, scale = inputs(3, 1, 4, 2, "bf16", "csa", 16, 16)
    same = torch.randint(0, 24, (1, 1, 32), generator=gen).expand(1, 4, 32).to(torch.int32).contiguous()
    diff = (torch.arange(4).view(1, 4, 1) * 5 + torch.arange(32).view(1, 1, 32)) % 24
    window = shared_layout_idx(1, 4, 16, 40, gen)
    for extra_idx in (same, diff.to(torch.int32)):
        check((q, kv, None, window, ekv, None, extra_idx, sink, scale), num_splits=2)


def test_out_of_range_indices_are_skipped_and_never_read():
    """Rows past N hold NaN in the backing buffer: reading any of them would poison the output."""
    q, kv, _, idx, ekv, _, eidx, sink, scale = inputs(4, 2, 2, 3, "bf16", "hca", 20, 20)
    backing = torch.cat([kv, torch.full((8, kv.shape[1]), float("nan"), dtype=kv.dtype)])
    rows = backing[: kv.shape[0]]
    bad = idx.clone()
    bad[:, :, ::3] = kv.shape[0] + 2  # past the end: skip
    bad[:, :, 1::5] = -7  # any negative: skip
    got = check((q, rows, None, bad, ekv, None, eidx, sink, scale))
    cleaned = torch.where((bad >= 0) & (bad < kv.shape[0]), bad, -1)
    torch.testing.assert_close(got, sparse_mla_triton(q, kv, None, cleaned, ekv, None, eidx, sink, scale),
                               atol=0, rtol=0)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_strided_row_views(fmt):
    """kv as a view with a row stride wider than a row (a page layout); padding holds NaN / 0xFF."""
    q, kv, kv_scale, idx, ekv, esc, eidx, sink, scale = inputs(5, 2, 3, 3, fmt, "csa", 24, 24, rope=32)
    pad = 16 if fmt == "fp8" else 8
    def widen(rows):
        fill = 0xFF if rows.dtype == torch.uint8 else float("nan")  # 0xFF is an e4m3 NaN
        wide = torch.full((rows.shape[0], rows.shape[1] + pad), fill, dtype=rows.dtype)
        wide[:, : rows.shape[1]] = rows
        return wide[:, : rows.shape[1]]
    view, eview = widen(kv), widen(ekv)
    assert not view.is_contiguous()
    got = check((q, view, kv_scale, idx, eview, esc, eidx, sink, scale))
    torch.testing.assert_close(got, sparse_mla_triton(q, kv, kv_scale, idx, ekv, esc, eidx, sink, scale),
                               atol=0, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_strided_sink(num_splits):
    """sink as a strided view (every other element of a longer tensor, the rest NaN): the forward
    tile (one split) and the split-K combine (two) read the view's values."""
    q, kv, kv_scale, idx, ekv, esc, eidx, sink, scale = inputs(12, 2, 2, 4, "bf16", "csa", 12, 12)
    wide = torch.full((2 * sink.shape[0],), float("nan"))
    wide[::2] = sink
    view = wide[::2]
    assert view.stride(0) == 2 and torch.equal(view, sink)
    got = check((q, kv, kv_scale, idx, ekv, esc, eidx, view, scale), num_splits=num_splits)
    torch.testing.assert_close(got, sparse_mla_triton(q, kv, kv_scale, idx, ekv, esc, eidx, sink, scale,
                                                      num_splits=num_splits), atol=0, rtol=0)


def test_reference_matches_the_models_plain_torch_form():
    """The spec agrees with hotspots.sparse_attention_with_sink (f32, where both are defined)."""
    from dsv4_compile.model.hotspots import gather_rows, sparse_attention_with_sink

    q, kv, _, idx, ekv, _, eidx, sink, scale = inputs(6, 2, 3, 4, "f32", "hca", 20, 30, head_dim=128)
    gathered = torch.cat([gather_rows(kv, idx), gather_rows(ekv, eidx)], dim=2)
    valid = torch.cat([idx >= 0, eidx >= 0], dim=2)
    want = sparse_attention_with_sink(q, gathered, valid, sink, scale)
    got = sparse_mla_reference(q, kv, None, idx, ekv, None, eidx, sink, scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fp8_dequantisation_of_a_known_row():
    """Exponent 130 scales e4m3 by 2^3; the rope bytes are read back as bf16."""
    from dsv4_compile.kernels.sparse_mla import dequantize_fp8_rows

    nope_vals = torch.tensor([[1.5, -0.25] * 32])
    rope_vals = torch.tensor([[3.0, -7.5]], dtype=torch.bfloat16)
    rows = torch.cat([nope_vals.to(torch.float8_e4m3fn).view(torch.uint8), rope_vals.view(torch.uint8)], dim=1)
    got = dequantize_fp8_rows(rows, torch.tensor([[130, 0]], dtype=torch.uint8), head_dim=66)
    assert torch.equal(got[0, :64], nope_vals[0] * 8)
    assert torch.equal(got[0, 64:], rope_vals[0].float())


def test_registered_op_runs_the_kernel_and_passes_opcheck():
    args = inputs(7, 1, 2, 2, "fp8", "csa", 12, 12, rope=64)
    got = torch.ops.dsv4.sparse_mla(*args)
    torch.testing.assert_close(got, sparse_mla_reference(*args), **TOL[torch.bfloat16])
    torch.library.opcheck(torch.ops.dsv4.sparse_mla.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def _odd_offset(rows):
    """The same FP8 rows (uint8) starting one byte into their buffer, with an even row stride."""
    buf = torch.zeros(rows.shape[0], rows.shape[1] + 2, dtype=torch.uint8)
    view = buf[:, 1:rows.shape[1] + 1]
    view.copy_(rows)
    return view


def _bad_inputs():
    q, kv, kv_scale, idx, ekv, esc, eidx, sink, scale = inputs(8, 1, 2, 2, "fp8", "csa", 8, 8, rope=32)
    good = dict(q=q, kv=kv, kv_scale=kv_scale, idx=idx, extra_kv=ekv, extra_kv_scale=esc, extra_idx=eidx,
                sink=sink, scale=scale)
    bf = inputs(8, 1, 2, 2, "bf16", "csa", 8, 8)
    cases = {
        "q_rank": (dict(q=q[0]), "q"),
        "q_dtype": (dict(q=q.half()), "q"),
        "q_head_dim": (dict(q=q[..., :40]), "q"),
        "kv_head_dim": (dict(q=bf[0], kv=bf[1][:, :48], kv_scale=None, extra_kv=bf[4], extra_kv_scale=None), "kv"),
        "kv_dtype": (dict(q=bf[0], kv=bf[1].float(), kv_scale=None, extra_kv=bf[4], extra_kv_scale=None), "kv"),
        "fp8_width": (dict(kv=kv[:, :100]), "kv"),
        "fp8_no_scale": (dict(kv_scale=None), "kv_scale"),
        "fp8_short_scale": (dict(kv_scale=kv_scale[:, :0]), "kv_scale"),
        "idx_dtype": (dict(idx=idx.long()), "idx"),
        "idx_batch": (dict(idx=idx.expand(2, -1, -1)), "idx"),
        "idx_tokens": (dict(idx=idx[:, :1]), "idx"),
        "extra_idx_tokens": (dict(extra_idx=eidx[:, :1]), "extra_idx"),
        "extra_without_idx": (dict(extra_idx=None), "extra_kv and extra_idx"),
        "extra_format": (dict(extra_kv=bf[4], extra_kv_scale=None), "extra_kv"),
        "sink_shape": (dict(sink=sink[:1]), "sink"),
        "sink_dtype": (dict(sink=sink.double()), "sink"),
        "scale_nan": (dict(scale=math.nan), "scale"),
        # exponents read at a column stride other than 1 (the kernels take a row stride only)
        "fp8_scale_columns": (dict(kv_scale=kv_scale.t().contiguous().t()), "kv_scale"),
        "extra_fp8_scale_columns": (dict(extra_kv_scale=esc.t().contiguous().t()), "extra_kv_scale"),
        # FP8 rows at an odd byte offset: their rope values are read as bf16
        "fp8_odd_offset": (dict(kv=_odd_offset(kv)), "kv"),
        "extra_scale_alone": (dict(extra_kv=None, extra_idx=None), "extra_kv_scale"),
    }
    return good, cases


@pytest.mark.parametrize("case", list(_bad_inputs()[1]))
def test_bad_input_raises_value_error_naming_the_argument(case):
    good, cases = _bad_inputs()
    change, name = cases[case]
    args = {**good, **change}
    with pytest.raises(ValueError, match=name):
        torch.ops.dsv4.sparse_mla(**args)
    with pytest.raises(ValueError, match=name):
        sparse_mla_triton(**args)


# ----------------------------------------------------------------------------- forced configs

# (h_block, value-column blocks, block_n, num_warps, num_stages, idx_asm, kv_halves):
# pick_config's FP8-row tiles of wide grids (32 heads, 8 warps, 1 stage) and the bench's sweep
# shapes. The interpreter skips the inline-asm index loads (GPU-only PTX): idx_asm
# here checks the plumbing and that the compiled path's tile loop bounds are the same code;
# test_gpu_only_paths_cross_compile checks the PTX. kv_halves changes the arithmetic (two column
# halves) and runs here.
FORCED = [(64, 2, 32, 8, 2, False, False), (16, 1, 32, 8, 1, False, False),
          (32, 1, 32, 8, 1, False, True), (16, 1, 32, 4, 2, False, False), (16, 1, 16, 8, 4, False, False),
          (16, 2, 64, 8, 1, False, False), (64, 1, 16, 8, 3, False, False),
          (16, 1, 32, 4, 3, True, True), (16, 1, 16, 8, 3, True, True)]


def forced_inputs(seed, fmt, layer, heads, extra_len):
    """2 requests x 3 tokens; token (1, 2) selects nothing; holes, duplicates across tokens."""
    args = list(inputs(seed, 2, 3, heads, fmt, layer, 20, extra_len, rope=32, head_dim=96))
    for pos in (3, 6):
        if args[pos] is not None:
            args[pos] = args[pos].clone()
            args[pos][1, 2] = -1
    return tuple(args)


@pytest.mark.parametrize("cfg", FORCED, ids=lambda c: "h{}dv{}n{}w{}s{}a{:d}k{:d}".format(*c))
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("layer, extra_len", [("csa", 40), ("hca", 33), ("csa", 0)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_forced_config_matches_reference(cfg, fmt, layer, extra_len, num_splits):
    """Each config on fresh inputs, heads not a multiple of h_block; tolerance: TOL (module doc)."""
    h_block, dv_blocks, block_n, warps, stages, idx_asm, kv_halves = cfg
    args = forced_inputs(hash(cfg) % 1000 + num_splits, fmt, layer, h_block + 3, extra_len)
    block_d = 128  # head_dim 96 (FP8 split 64 + 32) and the bf16 rows alike
    config = LaunchConfig(h_block, block_d // dv_blocks, block_n, num_splits, warps, stages, idx_asm, kv_halves)
    q = args[0]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    got = sparse_mla_triton(*args, out=out, config=config)
    torch.testing.assert_close(got, sparse_mla_reference(*args), **TOL[q.dtype])
    assert torch.equal(got[1, 2], torch.zeros_like(got[1, 2]))


@pytest.mark.parametrize("cfg", FORCED[:2] + FORCED[-4:], ids=lambda c: "h{}dv{}n{}w{}s{}a{:d}k{:d}".format(*c))
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_forced_config_partials_match_reference(cfg, fmt):
    """The split-K pass alone (dsv4::sparse_mla_partials' contract) under each config: every
    value-column block writes its columns, one writes the lse; splits own whole SPLIT_TILE runs
    of positions whatever block_n is (64 here too). f32 partials of bf16-exact rows
    with f32 dots on CPU: atol = rtol = 1e-4 (summation order and exp2 only)."""
    h_block, dv_blocks, block_n, warps, stages, idx_asm, kv_halves = cfg
    args = forced_inputs(7, fmt, "csa", h_block + 3, 40)
    q, kv, kv_scale, idx, ekv, esc, eidx, _, scale = args
    batch, tokens, heads, head_dim = q.shape
    splits = 3
    out = torch.full((batch, tokens, heads, splits, head_dim), float("nan"))
    lse = torch.full((batch, tokens, heads, splits), float("nan"))
    config = LaunchConfig(h_block, 128 // dv_blocks, block_n, splits, warps, stages, idx_asm, kv_halves)
    for launch in plan_sparse_mla(q, kv, kv_scale, idx, ekv, esc, eidx, None, scale, None, config=config,
                                  partials=(out, lse)):
        launch.kernel[launch.grid](*launch.args, **launch.meta)
    want_out, want_lse = sparse_mla_partials_reference(q, kv, kv_scale, idx, ekv, esc, eidx, scale, splits)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layer, extra_len", [("csa", 40), ("hca", 33), ("csa", 0)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("chunk_bytes", [None, 1])
def test_staged_fp8_rows_match_reference(monkeypatch, layer, extra_len, num_splits, chunk_bytes):
    """FP8 rows staged into bf16 rows (stage_fp8) then attended by a bf16 tile, in one chunk or (a
    STAGE_MAX_BYTES of 1) one request a chunk; tolerance: TOL (the staged rows are exact)."""
    if chunk_bytes is not None:
        monkeypatch.setattr(sparse_mla_module, "STAGE_MAX_BYTES", chunk_bytes)
    args = forced_inputs(11 + num_splits, "fp8", layer, 19, extra_len)
    config = LaunchConfig(16, 128, 32, num_splits, 4, 2, False, True, stage_fp8=True)
    q = args[0]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    launches = plan_sparse_mla(*args, out=out, config=config)
    stagings = sum(launch.kernel.fn.__name__ == "_stage_fp8_rows_kernel" for launch in launches)
    assert stagings == (2 if chunk_bytes else 1)  # one launch a chunk stages both pools
    for launch in launches:
        launch.kernel[launch.grid](*launch.args, **launch.meta)
    torch.testing.assert_close(out, sparse_mla_reference(*args), **TOL[q.dtype])
    assert torch.equal(out[1, 2], torch.zeros_like(out[1, 2]))


def test_staged_fp8_rows_partials_match_reference(monkeypatch):
    """The split-K pass alone over staged FP8 rows, one request a chunk: f32 partials, atol = rtol =
    1e-4 (f32 dots on CPU; summation order and exp2 only)."""
    monkeypatch.setattr(sparse_mla_module, "STAGE_MAX_BYTES", 1)
    q, kv, kv_scale, idx, ekv, esc, eidx, _, scale = forced_inputs(5, "fp8", "csa", 19, 40)
    batch, tokens, heads, head_dim = q.shape
    out = torch.full((batch, tokens, heads, 3, head_dim), float("nan"))
    lse = torch.full((batch, tokens, heads, 3), float("nan"))
    config = LaunchConfig(16, 128, 32, 3, 4, 2, False, True, stage_fp8=True)
    for launch in plan_sparse_mla(q, kv, kv_scale, idx, ekv, esc, eidx, None, scale, None, config=config,
                                  partials=(out, lse)):
        launch.kernel[launch.grid](*launch.args, **launch.meta)
    want_out, want_lse = sparse_mla_partials_reference(q, kv, kv_scale, idx, ekv, esc, eidx, scale, 3)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("batch, tokens, heads, width, staged", [
    (64, 1, 64, 640, True), (64, 4, 64, 640, True), (1, 1, 64, 640, True), (3, 1, 20, 640, True),
    (64, 1, 32, 1152, True), (128, 2, 128, 2048, True), (2, 1, 64, 4096, True),
    (1, 1, 64, 8320, True), (32, 1, 64, 8320, True), (8, 4, 64, 4097, True),
    (64, 4, 16, 640, False), (1, 1, 16, 640, False), (33, 1, 64, 4097, False), (64, 1, 64, 8320, False),
    (16, 4, 64, 8320, False), (1, 1024, 64, 640, False), (1, 1, 64, 300_000, False)])
def test_fp8_rows_staged_where_the_rule_says(monkeypatch, batch, tokens, heads, width, staged):
    """More than 16 heads, and index lists of at most STAGE_MAX_POSITIONS positions a token or at most
    STAGE_LONG_MAX_TOKENS tokens: staged, with the bf16 tile of one chunk's requests; else (also where
    one request's staged rows exceed STAGE_MAX_BYTES) the FP8 tile; allow_staging=False always gives
    the FP8 tile."""
    monkeypatch.setattr(sparse_mla_module, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    cfg = pick_config(batch, tokens, heads, 512, width, cpu, fp8_rows=True)
    assert cfg.stage_fp8 == staged
    direct = pick_config(batch, tokens, heads, 512, width, cpu, fp8_rows=True, allow_staging=False)
    assert not direct.stage_fp8
    if staged:
        chunk = sparse_mla_module.stage_chunk(batch, tokens, width, 512)
        assert cfg == replace(pick_config(chunk, tokens, heads, 512, width, cpu), stage_fp8=True)
    else:
        assert cfg == direct


@pytest.mark.parametrize("layer, q_dtype", [("csa", torch.bfloat16), ("window", torch.float32),
                                            ("hca", torch.float32)])
def test_default_path_stages_fp8_rows_above_16_heads(monkeypatch, layer, q_dtype):
    """The op's own choice at 17 heads (pick_config stages, in an uneven 2 + 1 chunking of 3 requests)
    through dsv4::sparse_mla and dsv4::sparse_mla_partials, with a strided main list, against the
    references: TOL by q's dtype (the staged rows are exact), partials atol = rtol = 1e-4."""
    q, kv, kv_scale, idx, ekv, esc, eidx, sink, scale = inputs(4, 3, 2, 17, "fp8", layer, 20, 40, rope=32,
                                                               head_dim=96)
    q = q.to(q_dtype)
    idx = torch.stack([idx, idx.flip(2)], dim=3).flatten(2)[:, :, ::2]  # the same list, stride 2
    width = idx.shape[2] + (eidx.shape[2] if eidx is not None else 0)
    monkeypatch.setattr(sparse_mla_module, "STAGE_MAX_BYTES", 2 * 2 * width * 96 * q.element_size())
    args = (q, kv, kv_scale, idx, ekv, esc, eidx, sink, scale)
    launches = plan_sparse_mla(*args, out=torch.empty_like(q))
    stagings = [launch for launch in launches if launch.kernel.fn.__name__ == "_stage_fp8_rows_kernel"]
    assert [launch.grid[0] for launch in stagings] == [4, 2]  # tokens of each chunk
    got = torch.ops.dsv4.sparse_mla(*args)
    torch.testing.assert_close(got, sparse_mla_reference(*args), **TOL[q_dtype])
    parts, lse = torch.ops.dsv4.sparse_mla_partials(q, kv, kv_scale, idx, ekv, esc, eidx, scale, 3)
    want_parts, want_lse = sparse_mla_partials_reference(q, kv, kv_scale, idx, ekv, esc, eidx, scale, 3)
    torch.testing.assert_close(parts, want_parts, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)


def test_staging_keeps_a_token_s_blocks_within_the_grid_axis(monkeypatch):
    """A token's lists of more than (MAX_GRID_Y - 1) * STAGE_ROWS positions would overflow the staging
    grid's second axis: not staged even with the byte cap lifted."""
    monkeypatch.setattr(sparse_mla_module, "STAGE_MAX_BYTES", 1 << 40)
    limit = (sparse_mla_module.MAX_GRID_Y - 1) * sparse_mla_module.STAGE_ROWS
    assert sparse_mla_module.stages_fp8_rows(1, 1, 64, 512, limit)
    assert not sparse_mla_module.stages_fp8_rows(1, 1, 64, 512, limit + 1)


def test_stage_chunk_spreads_requests_within_the_cap(monkeypatch):
    """Chunks hold at most STAGE_MAX_BYTES of staged rows (one request when a request exceeds it),
    spread evenly over the fewest chunks."""
    per_request = 4 * 1152 * 512 * 2  # HCA at 128K, T=4, bf16
    monkeypatch.setattr(sparse_mla_module, "STAGE_MAX_BYTES", 256 << 20)
    assert sparse_mla_module.stage_chunk(64, 4, 1152, 512) == 32  # 56 fit: two chunks of 32
    assert sparse_mla_module.stage_chunk(16, 4, 1152, 512) == 16
    monkeypatch.setattr(sparse_mla_module, "STAGE_MAX_BYTES", per_request - 1)
    assert sparse_mla_module.stage_chunk(5, 4, 1152, 512) == 1


def test_bad_value_column_block_raises():
    args = forced_inputs(0, "fp8", "csa", 4, 8)
    with pytest.raises(ValueError, match="block_dv"):
        sparse_mla_triton(*args, config=LaunchConfig(16, 32, 32, 1, 4, 1))  # FP8 needs multiples of 64


def test_kv_halves_needs_all_value_columns():
    args = forced_inputs(0, "bf16", "csa", 4, 8)
    with pytest.raises(ValueError, match="kv_halves"):
        sparse_mla_triton(*args, config=LaunchConfig(16, 64, 32, 1, 4, 2, kv_halves=True))


@pytest.mark.parametrize("fp8_rows, batch, tokens, heads, want, splits", [
    # bf16 rows, one wave: 16 heads, 64-row tiles; 83,968 B
    (False, 64, 1, 64, (16, 512, 64, 4, 2, True, True), 1),
    # bf16 rows, four waves at 16 heads: 32 heads, 32-row tiles
    (False, 64, 4, 64, (32, 512, 32, 4, 2, True, True), 1),
    # FP8 rows (not staged), 16 or more programs at 16 heads (a tenth of the SMs or more): 32 heads a
    # program, 1 stage, two halves, 98,304 B; 128 programs at T=1 split the positions in 2 (256
    # programs: within two an SM), 64 in 4
    (True, 64, 1, 64, (32, 512, 32, 8, 1, False, True), 2),
    (True, 64, 4, 64, (32, 512, 32, 8, 1, False, True), 1),
    (True, 4, 1, 64, (32, 512, 32, 8, 1, False, True), 10),
    (True, 64, 1, 32, (32, 512, 32, 8, 1, False, True), 4),
    # FP8 rows, 16 heads a program: four or eight programs (B=1, 2), or no more than 16 heads
    (True, 1, 1, 64, (16, 512, 32, 8, 1, False, True), 10),
    (True, 2, 1, 64, (16, 512, 32, 8, 1, False, True), 10),
    (True, 64, 1, 16, (16, 512, 32, 8, 1, False, True), 4),
])
def test_pick_config_at_real_size(monkeypatch, fp8_rows, batch, tokens, heads, want, splits):
    """Dh=512, window 128 + top-k 512 on 132 SMs of sm_120's shared memory (one FP8 32-head
    tile an SM): the documented choice (FP8 rows' own tiles, as where they are not staged)."""
    monkeypatch.setattr(sparse_mla_module, "_sm_count", lambda device: 132)
    monkeypatch.setattr(sparse_mla_module, "_shared_per_sm", lambda device: 102_400)
    cfg = pick_config(batch, tokens, heads, 512, 640, torch.device("cpu"), fp8_rows=fp8_rows, allow_staging=False)
    assert (cfg.h_block, cfg.block_dv, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.idx_asm,
            cfg.kv_halves) == want
    assert cfg.num_splits == splits
    assert not cfg.stage_fp8


@pytest.mark.parametrize("shared_per_sm, fits", [
    (233_472, {16, 32}),  # H100, H200, B200: two of either tile
    (2 * (98_304 + 1_024), {16, 32}),
    (2 * (98_304 + 1_024) - 1, {16}),
    (167_936, {16}),  # A100: two 16-head tiles only
    (2 * (81_920 + 1_024) - 1, set()),
    (102_400, set()),  # sm_120, sm_89
])
@pytest.mark.parametrize("batch, tokens, heads, h_block, splits, programs", [
    (64, 1, 64, 32, 2, 256), (48, 1, 64, 32, 2, 192), (32, 1, 64, 32, 4, 256), (64, 4, 64, 32, 1, 512),
    (4, 4, 64, 32, 8, 256), (1, 4, 64, 32, 10, 80),
    (64, 1, 16, 16, 4, 256), (16, 1, 16, 16, 10, 160), (8, 1, 16, 16, 10, 80), (1, 1, 64, 16, 10, 40),
    (3, 1, 64, 16, 10, 120)])
def test_fp8_tiles_take_four_warps_where_two_share_an_sm(monkeypatch, shared_per_sm, fits, batch, tokens, heads,
                                                         h_block, splits, programs):
    """An FP8 tile (not staged) runs on PAIRED_WARPS where its split grid holds more programs than the 132 SMs and
    an SM's shared memory holds two of it (FP8_TILE_SHARED plus the per-block reserve each), else on
    8; nothing else of it changes (its splits keep the grid within 264 programs, two an SM)."""
    monkeypatch.setattr(sparse_mla_module, "_sm_count", lambda device: 132)
    monkeypatch.setattr(sparse_mla_module, "_shared_per_sm", lambda device: shared_per_sm)
    cfg = pick_config(batch, tokens, heads, 512, 640, torch.device("cpu"), fp8_rows=True, allow_staging=False)
    warps = 4 if programs > 132 and h_block in fits else 8
    assert (cfg.h_block, cfg.block_dv, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.idx_asm,
            cfg.kv_halves, cfg.num_splits) == (h_block, 512, 32, warps, 1, False, True, splits)
    assert batch * tokens * (heads // h_block) * splits == programs
    bf16 = pick_config(batch, tokens, heads, 512, 640, torch.device("cpu"))
    assert bf16.num_warps == 4  # bf16 tiles keep their own warps


def test_split_count_heuristic_and_cap():
    """CPU counts 4 SMs: one program gets about two a SM (8 splits of 20 tiles), max_splits caps the
    heuristic only, a forced count is kept (up to the tile count), big grids never split."""
    cpu = torch.device("cpu")
    assert split_count(1, 640, cpu) == 8
    assert split_count(1, 640, cpu, max_splits=2) == 2
    assert split_count(1, 640, cpu, num_splits=5, max_splits=2) == 5
    assert split_count(1, 40, cpu, num_splits=5) == 2
    assert split_count(64, 640, cpu, max_splits=2) == 1
    # within one wave of two programs an SM (4 SMs: 8), not past it: 3 programs take 2 splits, not 3
    assert [split_count(p, 640, cpu) for p in (1, 2, 3)] == [8, 4, 2]


_CROSS_COMPILE = """
import sys, torch
sys.path[:0] = ["bench", "tests"]
import bench_sparse_mla as bench
from test_sparse_mla import forced_inputs
print("module", bench.sm.__file__)
for fmt in ("bf16", "fp8"):
    args = forced_inputs(0, fmt, "hca", 19, 40)
    cfg = bench.sm.LaunchConfig(16, 128, 16, 1, 4, 3, idx_asm=True, kv_halves=True)
    launch = bench.sm.plan_sparse_mla(*args, out=torch.empty_like(args[0]), config=cfg)[0]
    for cap in (90, 120):
        compiled = bench.cross_compile(launch, cap)
        print(fmt, cap, compiled.metadata.shared, compiled.asm["ptx"].count("ld.global.nc.b32"))
"""


def test_gpu_only_paths_cross_compile_for_sm90_and_sm120():
    """The inline-asm index loads are PTX the interpreter never runs: compile them (no GPU needed,
    in a process without TRITON_INTERPRET) for both targets; they must emit their loads and stay
    within sm_120's 101,376 B of shared memory."""
    lines = run_compiled_script(_CROSS_COMPILE, sparse_mla_module.__file__, timeout=600)
    assert sorted((fmt, cap) for fmt, cap, _, _ in lines) == sorted(
        (fmt, cap) for fmt in ("bf16", "fp8") for cap in ("90", "120"))
    for _, _, shared, count in lines:
        assert int(shared) <= 101_376 and int(count) > 0


_DEFAULTS_SM120 = """
import sys, torch
from dataclasses import replace
sys.path[:0] = ["bench", "tests"]
import bench_sparse_mla as bench
print("module", bench.sm.__file__)
bench.sm._sm_count = lambda device: 132
cpu = torch.device("cpu")
for fmt in ("bf16", "fp8"):
    for tokens in (1, 4):
        cfg = bench.sm.pick_config(64, tokens, 64, 512, 640, cpu, fp8_rows=fmt == "fp8", allow_staging=False)
        args = bench.make_inputs(bench.Case("csa", 2, tokens, 64, "csa", fmt, 512), cpu)
        launch = bench.sm.plan_sparse_mla(*args, out=torch.empty_like(args[0]), config=replace(cfg, num_splits=1))[0]
        print(fmt, tokens, cfg.h_block, bench.cross_compile(launch, 120).metadata.shared)
        if fmt == "fp8":  # the staging of FP8 rows (its first launch) where pick_config stages them
            staged = bench.sm.pick_config(64, tokens, 64, 512, 640, cpu, fp8_rows=True)
            launch = bench.sm.plan_sparse_mla(*args, out=torch.empty_like(args[0]), config=staged)[0]
            print("staging", tokens, 0, bench.cross_compile(launch, 120).metadata.shared)
        if fmt == "fp8" and tokens == 4:  # the FP8 tiles on 4 warps, where two share an SM (sm_90)
            for h_block in (16, 32):
                four = bench.sm.plan_sparse_mla(*args, out=torch.empty_like(args[0]),
                                                config=replace(cfg, h_block=h_block, num_splits=1, num_warps=4))[0]
                print("fp8_4w", tokens, h_block, bench.cross_compile(four, 90).metadata.shared)
"""


def test_default_tiles_fit_sm120_shared_memory():
    """pick_config's tiles at real size (B=64, H=64, Dh=512, T=1 and 4, both row formats; the wide
    grids' 32-head tiles and the staging of FP8 rows included) compiled for sm_120 stay within its
    101,376 B of shared memory;
    the FP8 tiles take FP8_TILE_SHARED there and, on 4 warps, for sm_90 (pick_config's rule for 4
    warps counts on it)."""
    lines = run_compiled_script(_DEFAULTS_SM120, sparse_mla_module.__file__, timeout=600)
    assert sorted((fmt, tokens, h_block) for fmt, tokens, h_block, _ in lines) == sorted(
        [("bf16", "1", "16"), ("bf16", "4", "32"), ("fp8", "1", "32"), ("fp8", "4", "32"), ("fp8_4w", "4", "16"),
         ("fp8_4w", "4", "32"), ("staging", "1", "0"), ("staging", "4", "0")])
    for fmt, _, h_block, shared in lines:
        assert int(shared) <= 101_376
        if fmt.startswith("fp8"):
            assert int(shared) == sparse_mla_module.FP8_TILE_SHARED[int(h_block)]
