"""dsv4::fp4_moe: Triton kernel (interpreter on CPU) against the torch reference, and its errors."""
import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_compile.kernels import fp4_moe as moe
from dsv4_compile.kernels.moe_pairs import combine_pairs
from dsv4_compile.model.hotspots import moe_experts_fp4
from helpers import make_experts, run_compiled_script


def make_routing(tokens, top_k, experts, routing, seed):
    gen = torch.Generator().manual_seed(seed)
    if routing == "one_expert":  # every choice on one expert: most experts empty, a long block run
        ids = torch.full((tokens, top_k), experts - 1, dtype=torch.int32)
    elif routing == "skewed":  # only experts 0 and 1 (0 alone when E=1), some choices on other ranks (-1)
        ids = torch.randint(-1, min(2, experts), (tokens, top_k), generator=gen).to(torch.int32)
    else:
        ids = torch.randint(-1, experts, (tokens, top_k), generator=gen).to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return ids, weights


def _args(x, ids, weights, w, limit):
    return (x, ids, weights, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], w["fmt"],
            w["w13_global"], w["w2_global"], limit)


# Tolerances: f32 x runs the kernel's dots in f32 (the interpreter): only summation order
# differs from the reference, so 1e-4 relative to the output scale. bf16 x: the output is
# rounded to bf16 (2**-8 relative) and on GPU the hidden activations are bf16 as well.
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

# Small tiles so that the tiny shapes span several programs or K steps on each path (the
# interpreter's time grows with programs x K steps, so not both at their smallest).
FORCED_CONFIGS = [
    None,
    moe.TileConfig("gemv", 1, 32, 32),
    moe.TileConfig("gemv", 2, 16, 128, num_warps=2),
    moe.TileConfig("gemv", 4, 32, 64),
    moe.TileConfig("dot", 16, 32, 32, num_stages=2),
    moe.TileConfig("gemv", 1, 32, 32, prefetch=True),
    moe.TileConfig("gemv", 2, 16, 64, num_warps=2, prefetch=True),
    moe.TileConfig("mma", 16, 64, 64, num_stages=2),  # wgmma operand order (KPACK 1)
    moe.TileConfig("mma", 4, 16, 32, num_warps=1),  # mma.sync operand order (KPACK 2), one word per lane
    moe.TileConfig("mma", 8, 16, 32, num_warps=1, prefetch=True),  # two K steps a turn: 1, 2 or 4 steps
    moe.TileConfig("mma", 4, 16, 32, num_warps=1, prefetch=True, ready_counts=True),  # per-block ready counts
    # split-K: up to 4 gate/up splits (fewer where K has fewer 32-column steps)
    moe.TileConfig("mma", 8, 16, 32, num_warps=1, prefetch=True, k_splits=4),
    moe.TileConfig("mma", 4, 16, 32, num_warps=1, k_splits=2),
    # one block a pair, read from the ids (duplicates and -1 included), split and not
    moe.TileConfig("mma", 8, 16, 32, num_warps=1, prefetch=True, k_splits=2, direct_blocks=True),
    moe.TileConfig("mma", 4, 16, 32, num_warps=1, direct_blocks=True),
]


def assert_close_scaled(got, want, dtype):
    scale = want.float().abs().max().clamp(min=1e-3)
    err = (got.float() - want.float()).abs().max()
    assert err <= TOL[dtype] * scale, f"max error {err} vs scale {scale}"


def check_pairs_against_reference(x, ids, weights, w, limit, config, tol_dtype):
    """Runs the launcher with `config` into NaN-poisoned pair rows: every valid pair row must be
    written and the combined output must equal the reference (tolerance of `tol_dtype`).
    Returns the reference output [M, K]."""
    tokens, top_k = ids.shape
    experts = w["w13"].shape[0]
    pair_out = torch.full((tokens * top_k, x.shape[1]), float("nan"))
    pairs = moe.fp4_moe_pairs_triton(*_args(x, ids, weights, w, limit), pair_out=pair_out, config=config)
    valid = ((ids >= 0) & (ids < experts)).reshape(-1)
    assert not pairs[valid].isnan().any()
    want = moe.fp4_moe_reference(*_args(x, ids, weights, w, limit))
    assert_close_scaled(combine_pairs(pairs, ids, experts, x.dtype), want, tol_dtype)
    return want


@given(
    tokens=st.integers(1, 9),
    experts=st.integers(1, 5),
    top_k=st.integers(1, 3),
    inter=st.sampled_from([32, 64]),
    hidden=st.sampled_from([32, 64, 128]),
    fmt=st.sampled_from(["mxfp4", "nvfp4"]),
    routing=st.sampled_from(["random", "one_expert", "skewed"]),
    limit=st.sampled_from([None, 0.05]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    config=st.sampled_from(FORCED_CONFIGS),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_matches_reference(tokens, experts, top_k, inter, hidden, fmt, routing, limit, dtype, config, seed):
    """Each drawn config forces its path; None runs the selection rule, and then the op as well."""
    w = make_experts(fmt, experts, hidden, inter, seed)
    ids, weights = make_routing(tokens, top_k, experts, routing, seed)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    want = check_pairs_against_reference(x, ids, weights, w, limit, config, dtype)
    if config is None:  # the op takes the same launch; run it once per rule-chosen example only
        got = torch.ops.dsv4.fp4_moe(*_args(x, ids, weights, w, limit))
        assert got.dtype == dtype and got.shape == x.shape
        assert_close_scaled(got, want, dtype)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("config", [
    moe.TileConfig("mma", 8, 16, 32, num_warps=1, prefetch=True, down_block_n=64, down_num_warps=2),
    # gate/up in mma.sync operand order (KPACK 2), down in wgmma order (KPACK 1)
    moe.TileConfig("mma", 16, 16, 64, num_warps=1, down_block_n=64, down_num_warps=4),
])
@pytest.mark.parametrize("tiled", [False, True])
def test_down_kernel_with_a_shape_of_its_own_matches_reference(fmt, config, tiled):
    """TileConfig.down_block_n / down_num_warps launch the down kernel with other output columns
    and warps than gate/up (its own grid), on row-major and tiled experts; every valid pair row is
    written (NaN-poisoned before) and the combined output equals the reference."""
    from dsv4_compile.fp4_tiles import tile_fp4

    tokens, experts, top_k, hidden, inter = 6, 3, 2, 128, 128
    w = make_experts(fmt, experts, hidden, inter, seed=11)
    if tiled:
        w = dict(w, w13=tile_fp4(w["w13"]), w2=tile_fp4(w["w2"]))
    ids, weights = make_routing(tokens, top_k, experts, "skewed", seed=11)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(12))
    check_pairs_against_reference(x, ids, weights, w, 0.05, config, torch.float32)


@pytest.mark.parametrize("fmt, tiled", [("mxfp4", False), ("nvfp4", True)])
def test_split_k_and_direct_blocks_match_reference(fmt, tiled):
    """k_splits: gate/up sums over 2 K ranges finished by `_swiglu_partials_kernel`, on table blocks
    and on one block a pair (direct_blocks), with choices on other ranks (-1) and an expert chosen by
    two tokens: every valid pair row is written (NaN-poisoned before) and the combined output equals
    the reference. Row-major and tiled experts (the smallest sizes that tile)."""
    from dsv4_compile.fp4_tiles import tile_fp4

    tokens, experts, top_k, hidden, inter = 3, 3, 2, 128, 128
    w = make_experts(fmt, experts, hidden, inter, seed=21)
    if tiled:
        w = dict(w, w13=tile_fp4(w["w13"]), w2=tile_fp4(w["w2"]))
    ids = torch.tensor([[0, 2], [2, -1], [1, 0]], dtype=torch.int32)
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(21)) + 0.1
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(22))
    for direct in (False, True):
        config = moe.TileConfig("mma", 8, 16, 64, num_warps=1, prefetch=True, k_splits=2, direct_blocks=direct)
        check_pairs_against_reference(x, ids, weights, w, 0.05, config, torch.float32)


def test_fit_splits_keeps_whole_k_steps():
    """Splits are lowered to the largest power of two that cuts the reduction into whole BLOCK_K steps."""
    assert moe._fit_splits(4, 4096, 128) == 4
    assert moe._fit_splits(4, 64, 32) == 2
    assert moe._fit_splits(4, 32, 32) == 1
    assert moe._fit_splits(8, 96, 32) == 1  # 3 steps
    assert moe._fit_splits(2, 2048, 128) == 2


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_reference_matches_gather_dequantise_form(fmt):
    """The reference (loop over hit experts) against the model's plain-torch form (dequantise the
    gathered weights, dense math): two independent computations of the same spec."""
    w = make_experts(fmt, 6, 64, 32, seed=3)
    ids, weights = make_routing(7, 3, 6, "random", seed=3)
    ids = ids.clamp(min=0)  # the plain-torch form has no "other rank" choices
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(4))
    want = moe.fp4_moe_reference(*_args(x, ids, weights, w, 0.3))
    got = moe_experts_fp4(*_args(x, ids, weights, w, 0.3))
    assert_close_scaled(got, want, torch.float32)


def test_all_skipped_gives_zero():
    w = make_experts("mxfp4", 3, 32, 32, seed=1)
    ids = torch.full((4, 2), -1, dtype=torch.int32)
    x = torch.randn(4, 32)
    out = torch.ops.dsv4.fp4_moe(*_args(x, ids, torch.rand(4, 2), w, None))
    assert torch.equal(out, torch.zeros_like(x))


def _good():
    w = make_experts("nvfp4", 2, 64, 32, seed=0)
    ids, weights = make_routing(3, 2, 2, "random", seed=0)
    return torch.randn(3, 64), ids.clamp(min=0), weights, w


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda a: a.update(fmt="fp8"), ValueError, "fmt"),
        (lambda a: a.update(w13=a["w13"][:, :, :16]), ValueError, "w13"),
        (lambda a: a.update(w2=a["w2"][:, :32]), ValueError, "w2"),
        (lambda a: a.update(w13_scale=a["w13_scale"].view(torch.uint8)), TypeError, "w13_scale"),
        (lambda a: a.update(w2_scale=a["w2_scale"][..., :1]), ValueError, "w2_scale"),
        (lambda a: a.update(w2_global=None), TypeError, "w2_global"),
        (lambda a: a.update(ids=a["ids"] + 2), ValueError, "topk_ids"),
        (lambda a: a.update(ids=a["ids"].long()), TypeError, "topk_ids"),
        (lambda a: a.update(x=a["x"].half()), TypeError, "x"),
        (lambda a: a.update(limit=float("nan")), ValueError, "swiglu_limit"),
        (lambda a: a.update(limit=-1.0), ValueError, "swiglu_limit"),
        (lambda a: a.update(w13=a["w13"][:0], w13_scale=a["w13_scale"][:0], w2=a["w2"][:0], w2_scale=a["w2_scale"][:0],
                            w13_global=a["w13_global"][:0], w2_global=a["w2_global"][:0], ids=a["ids"] * 0 - 1),
         ValueError, "at least one expert"),
    ],
)
def test_bad_input(mutate, error, match):
    x, ids, weights, w = _good()
    a = dict(w, x=x, ids=ids, limit=None)
    mutate(a)
    with pytest.raises(error, match=match):
        torch.ops.dsv4.fp4_moe(a["x"], a["ids"], weights, a["w13"], a["w13_scale"], a["w2"], a["w2_scale"],
                               a["fmt"], a["w13_global"], a["w2_global"], a["limit"])


def test_tensors_on_another_device_are_named():
    """Every tensor must be on x's device (a meta tensor stands in for another device here: the op itself
    would dispatch a call with one to its fake implementation)."""
    x, ids, weights, w = _good()
    for name in ("topk_ids", "w13_scale", "w2_global"):
        args = dict(x=x, topk_ids=ids, topk_weights=weights, w13=w["w13"], w13_scale=w["w13_scale"], w2=w["w2"],
                    w2_scale=w["w2_scale"], fmt=w["fmt"], w13_global=w["w13_global"], w2_global=w["w2_global"])
        args[name] = args[name].to("meta")
        with pytest.raises(ValueError, match=f"{name} is on meta"):
            moe.check_fp4_moe_inputs(**args)


def _other_strides(t):
    """The same values in a layout whose last two dimensions' strides are swapped (not contiguous)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("config", [moe.TileConfig("dot", 16, 32, 32), moe.TileConfig("gemv", 2, 16, 32),
                                    moe.TileConfig("mma", 8, 16, 32, num_warps=1, prefetch=True)],
                         ids=["dot", "gemv", "mma"])
@pytest.mark.parametrize("fmt, tiled", [("nvfp4", False), ("mxfp4", False), ("nvfp4", True)])
def test_experts_in_any_layout(config, fmt, tiled):
    """Codes, scales and (nvfp4) global scales that are not contiguous: the same values in other strides
    (for globals every other element of a longer tensor, the rest NaN) give the same outputs as the
    contiguous tensors (the kernels read last dimensions at unit stride; the launcher copies others)."""
    from dsv4_compile.fp4_tiles import tile_fp4

    experts, hidden, inter, tokens, top_k = 3, 128, 128, 5, 2  # whole tiles of 128 values a row
    w = make_experts(fmt, experts, hidden, inter, seed=61)
    if tiled:
        w.update(w13=tile_fp4(w["w13"]), w2=tile_fp4(w["w2"]))
    ids, weights = make_routing(tokens, top_k, experts, "random", seed=61)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(62))
    want = moe.fp4_moe_pairs_triton(*_args(x, ids, weights, w, None), config=config)
    odd = dict(w, w13=_other_strides(w["w13"]), w2=_other_strides(w["w2"]), w13_scale=_other_strides(w["w13_scale"]),
               w2_scale=_other_strides(w["w2_scale"]))
    for name in ("w13_global", "w2_global"):
        if w[name] is not None:
            wide = torch.full((2 * experts,), float("nan"))
            wide[::2] = w[name]
            odd[name] = wide[::2]
    assert not any(odd[n].is_contiguous() for n in ("w13", "w2", "w13_scale", "w2_scale"))
    got = moe.fp4_moe_pairs_triton(*_args(x, ids, weights, odd, None), config=config)
    valid = ((ids >= 0) & (ids < experts)).reshape(-1)
    torch.testing.assert_close(got[valid], want[valid], atol=0, rtol=0)


def test_mxfp4_scale_dtype_checked():
    w = make_experts("mxfp4", 2, 32, 32, seed=0)
    w["w13_scale"] = w["w13_scale"].view(torch.float8_e4m3fn)
    x, ids, weights = torch.randn(2, 32), torch.zeros(2, 1, dtype=torch.int32), torch.rand(2, 1)
    with pytest.raises(TypeError, match="w13_scale"):
        torch.ops.dsv4.fp4_moe(*_args(x, ids, weights, w, None))


def test_out_of_range_ids_skipped_by_kernel():
    """Without the eager check (the compiled path) an id >= E drops that choice."""
    w = make_experts("mxfp4", 2, 32, 32, seed=2)
    x = torch.randn(2, 32)
    ids = torch.tensor([[1, 5]], dtype=torch.int32).expand(2, 2).contiguous()
    weights = torch.rand(2, 2) + 0.1
    pairs = moe.fp4_moe_pairs_triton(*_args(x, ids, weights, w, None))
    got = combine_pairs(pairs, ids, 2, x.dtype)
    want = moe.fp4_moe_reference(*_args(x, torch.tensor([[1, -1]] * 2, dtype=torch.int32), weights, w, None))
    assert_close_scaled(got, want, torch.float32)


def test_fake_and_compile():
    w = make_experts("mxfp4", 3, 32, 32, seed=5)
    ids, weights = make_routing(4, 2, 3, "random", seed=5)
    x = torch.randn(4, 32)
    compiled = torch.compile(lambda *a: torch.ops.dsv4.fp4_moe(*a) * 2, backend="aot_eager", fullgraph=True)
    got = compiled(*_args(x, ids, weights, w, 1.0))
    assert_close_scaled(got, 2 * moe.fp4_moe_reference(*_args(x, ids, weights, w, 1.0)), torch.float32)


@pytest.mark.parametrize(
    "path_config",
    [moe.TileConfig("gemv", 2, 32, 64), moe.TileConfig("dot", 16, 32, 64),
     moe.TileConfig("gemv", 2, 32, 32, prefetch=True), moe.TileConfig("gemv", 1, 16, 64, prefetch=True),
     moe.TileConfig("mma", 16, 128, 64, num_stages=3), moe.TileConfig("mma", 8, 32, 128, num_warps=2),
     moe.TileConfig("mma", 8, 32, 32, num_warps=1, prefetch=True),
     moe.TileConfig("mma", 8, 16, 64, num_warps=1, prefetch=True)],
    ids=["gemv", "dot", "gemv_prefetch", "gemv_prefetch_one_down_step", "mma_wgmma_order", "mma_sync_order",
         "mma_prefetch", "mma_prefetch_one_down_step"],
)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_each_path_matches_reference(path_config, fmt):
    """Both paths regardless of the selection rule: -1 ids, an expert with more rows than one block
    (skewed), empty experts, swiglu_limit; poisoned outputs; K and I that span several K steps (the
    prefetching GEMV loop also with a single step over I = BLOCK_K, where it only loads past the end,
    masked; the mma path with two row repeats per warp and rows past the last weight row (BLOCK_N =
    128 > I), and with one K step of two words per lane over I; the prefetching mma loop with several
    K steps and with one, only loading past the end)."""
    experts, hidden, inter, tokens, top_k = 8, 128, 64, 7, 3
    w = make_experts(fmt, experts, hidden, inter, seed=11)
    ids, weights = make_routing(tokens, top_k, experts, "skewed", seed=11)
    ids[0, 0], ids[1, 2] = 7, -1  # one token on a third expert, one choice on another rank
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(12))
    check_pairs_against_reference(x, ids, weights, w, 0.5, path_config, torch.float32)


@pytest.mark.parametrize("name", ["mma_token", "mma_few", "mma_small", "mma"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_mma_several_scale_groups_per_lane(fmt, name):
    """The default mma tiles at K = I = their BLOCK_K (128): each quad lane's 4 words span a whole
    MXFP4 scale group or two NVFP4 ones, bytes of one scale word."""
    experts, tokens, top_k = 3, 5, 2
    hidden = inter = moe.DEFAULT_CONFIGS[name].block_k
    w = make_experts(fmt, experts, hidden, inter, seed=21)
    ids, weights = make_routing(tokens, top_k, experts, "random", seed=21)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(22))
    pair_out = torch.full((tokens * top_k, hidden), float("nan"))
    config = moe.DEFAULT_CONFIGS[name]
    assert config.block_k == hidden
    pairs = moe.fp4_moe_pairs_triton(*_args(x, ids, weights, w, None), pair_out=pair_out, config=config)
    want = moe.fp4_moe_reference(*_args(x, ids, weights, w, None))
    assert_close_scaled(combine_pairs(pairs, ids, experts, x.dtype), want, torch.float32)


@pytest.mark.parametrize("fmt, relaxed", [("mxfp4", False), ("nvfp4", False), ("mxfp4", True)])
def test_gate_up_counts_each_blocks_programs(monkeypatch, fmt, relaxed):
    """Ready counts: each gate/up program adds 1 to its block's count after its hidden rows, and the
    down kernel waits for READY = gate/up's programs a block. After a call (skewed routing: an expert
    over several blocks, empty blocks at the table's end) every used block's count is that number and
    every empty block's is 0 (the buffer starts poisoned; the grouping zeroes it), and the outputs
    match the reference (under the interpreter a down program whose count is not READY writes NaN).
    relaxed_spin changes only the compiled spin (test_pdl.py); here it runs through the launcher."""
    config = moe.TileConfig("mma", 4, 16, 32, num_warps=1, prefetch=True, ready_counts=True, relaxed_spin=relaxed)
    experts, hidden, inter, tokens, top_k = 8, 64, 64, 7, 3
    w = make_experts(fmt, experts, hidden, inter, seed=51)
    ids, weights = make_routing(tokens, top_k, experts, "skewed", seed=51)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(52))
    grouping, seen = moe.expert_blocks, {}

    def poisoned_grouping(topk_ids, experts, block_m, ready=None):
        ready.fill_(-7)
        seen["ready"] = ready
        seen["table"] = grouping(topk_ids, experts, block_m, ready)
        return seen["table"]

    monkeypatch.setattr(moe, "expert_blocks", poisoned_grouping)
    check_pairs_against_reference(x, ids, weights, w, None, config, torch.float32)
    used = seen["table"][1] < experts
    assert bool((~used).any()) and len(set(seen["table"][1][used].tolist())) < int(used.sum())  # an expert's 2+ blocks
    assert seen["ready"][used].tolist() == [inter // config.block_n] * int(used.sum())
    assert bool((seen["ready"][~used] == 0).all())


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_mma_small_down_block_wider_than_hidden(fmt):
    """`mma_small`'s down kernel writes 128 output columns a program: at the tiny model's hidden size
    (64) half of them are past the hidden size, masked on load and store (NaN-poisoned pair rows)."""
    experts, hidden, inter, tokens, top_k = 8, 64, 128, 8, 2
    config = moe.DEFAULT_CONFIGS["mma_small"]
    assert config.down_shape()[0] > hidden and moe.size_class(tokens * top_k, experts, fmt) == "mma_small"
    w = make_experts(fmt, experts, hidden, inter, seed=41)
    ids, weights = make_routing(tokens, top_k, experts, "random", seed=41)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(42))
    check_pairs_against_reference(x, ids, weights, w, 0.5, config, torch.float32)


@pytest.mark.parametrize(
    "config",
    [moe.TileConfig("gemv", 4, 16, 32), moe.TileConfig("gemv", 4, 16, 32, prefetch=True),
     moe.TileConfig("mma", 4, 32, 32, num_warps=2)],
    ids=["gemv", "gemv_prefetch", "mma"],
)
def test_all_tokens_on_one_expert(config):
    """Every pair on one expert: one run of blocks, all other experts empty (bf16 x)."""
    w = make_experts("nvfp4", 4, 64, 32, seed=13)
    ids, weights = make_routing(9, 2, 4, "one_expert", seed=13)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    pairs = moe.fp4_moe_pairs_triton(*_args(x, ids, weights, w, None), config=config)
    want = moe.fp4_moe_reference(*_args(x, ids, weights, w, None))
    assert_close_scaled(combine_pairs(pairs, ids, 4, x.dtype), want, torch.bfloat16)


@pytest.mark.parametrize(
    "tokens, mxfp4, nvfp4, mxfp4_native",
    [(1, "mma_token", "mma_token", "gemv"), (2, "mma_few", "mma_few", "gemv"),
     (4, "mma_few", "mma_few", "gemv"), (5, "mma_small", "mma_small", "gemv"), (8, "mma_small", "mma_small", "gemv"),
     (42, "mma_small", "mma_small", "gemv"),
     (43, "mma_small", "mma_small", "gemv"), (64, "mma_small", "mma_small", "gemv"),
     (85, "mma_small", "mma_small", "gemv"),
     (86, "mma", "mma_small", "dot16"), (256, "mma", "mma_small", "dot16"), (682, "mma", "mma_small", "dot16"),
     (683, "dot64", "dot64", "dot64"), (4096, "dot64", "dot64", "dot64")],
)
def test_size_class_rule(tokens, mxfp4, nvfp4, mxfp4_native):
    """V4-Flash (E=256, k=6): decode and verify take the mma path (16 weight rows a program and a
    one-warp down for one token's 6 pairs; 16 for gate/up and 128 rows on 4 warps for down up to two
    pairs per expert, M <= 85, with one block a pair up to 24 pairs; then up to 16 pairs per expert 32 rows for
    MXFP4's gate/up, 16 for NVFP4's), except MXFP4 on GPUs with FP4 tensor
    cores (GEMV up to 2 pairs, then tl.dot_scaled; row-major experts only, the launcher passes native=False
    for tiled ones); prefill takes 64-row dot blocks. NVFP4 never uses tl.dot_scaled, so `native` leaves
    it alone."""
    pairs, experts = tokens * 6, 256
    cases = (("mxfp4", False, mxfp4), ("nvfp4", False, nvfp4), ("mxfp4", True, mxfp4_native),
             ("nvfp4", True, nvfp4))
    for fmt, native, expected in cases:
        assert moe.size_class(pairs, experts, fmt, native) == expected, (fmt, native)
        config = moe.choose_config(pairs, experts, fmt, native)
        assert dataclasses.replace(config, ready_counts=False) == dataclasses.replace(moe.DEFAULT_CONFIGS[expected],
                                                                                      ready_counts=False)
        assert config.path == expected[:3] if expected != "gemv" else config.path == "gemv"
        # per-block ready counts: MXFP4's expert-block mma classes (timed faster on the H200), never NVFP4
        assert config.ready_counts == (fmt == "mxfp4" and expected in ("mma_small", "mma")), (fmt, expected)


@pytest.mark.parametrize("capability, dot_scaled", [((9, 0), False), ((10, 0), True), ((10, 3), True),
                                                    ((12, 0), False), ((12, 1), False), ((8, 9), False)])
def test_row_major_mxfp4_takes_tl_dot_scaled_on_sm100_only(monkeypatch, capability, dot_scaled):
    """native_fp4_dot: tl.dot_scaled's size classes for row-major MXFP4 on sm_100 only. sm_120 compiles
    tl.dot_scaled with bf16 x to the bf16 mma.sync its mma path uses (test_tl_dot_scaled_compiles_to_bf16_mmas), so it
    takes the mma path like the H200; NVFP4 and CPU tensors never take tl.dot_scaled."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda_like = type("CudaLike", (), {"is_cuda": True, "device": "cuda:0"})()
    assert moe.native_fp4_dot(cuda_like, "mxfp4") == dot_scaled
    assert not moe.native_fp4_dot(cuda_like, "nvfp4")
    assert not moe.native_fp4_dot(torch.zeros(1), "mxfp4")


@pytest.mark.parametrize("capability, sm90", [((9, 0), True), ((12, 0), False), ((10, 0), False), ((8, 9), False)])
def test_prefill_class_off_sm90_takes_64_column_k_steps(monkeypatch, capability, sm90):
    """Off sm_90 the 64-row dot class (prefill) takes OFF_SM90_CONFIGS (64-column K steps; see
    test_dot64_configs_do_not_spill); every other class, sm_90 and the interpreter keep DEFAULT_CONFIGS."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda_like = type("CudaLike", (), {"is_cuda": True, "device": "cuda:0"})()
    assert moe.takes_sm90_configs(cuda_like) == sm90
    assert moe.takes_sm90_configs(torch.zeros(1))
    for pairs in (6, 48, 384, 1536, 4098, 24576):
        for fmt, native in (("mxfp4", False), ("nvfp4", False), ("mxfp4", True)):
            name = moe.size_class(pairs, 256, fmt, native)
            config = moe.choose_config(pairs, 256, fmt, native, sm90=sm90)
            off = not sm90 and name == "dot64"
            expected = moe.OFF_SM90_CONFIGS[name] if off else moe.DEFAULT_CONFIGS[name]
            expected = dataclasses.replace(expected, ready_counts=expected.ready_counts and fmt == "mxfp4")
            assert config == expected, (pairs, fmt, native)
    assert dataclasses.replace(moe.OFF_SM90_CONFIGS["dot64"], block_k=128) == moe.DEFAULT_CONFIGS["dot64"]


@pytest.mark.parametrize("pairs, experts, expected", [(8, 256, "mma_token"), (9, 256, "mma_few"),
                                                      (24, 256, "mma_few"), (25, 256, "mma_small"),
                                                      (48, 256, "mma_small"),
                                                      (9, 35, "mma_small"), (9, 36, "mma_few"),
                                                      (8, 4, "mma_token"), (9, 4, "above 2"), (8, 2, "above 2"),
                                                      (0, 256, "mma_token")])
def test_size_class_token_boundary(pairs, experts, expected):
    """One decode token's choices (at most TOKEN_MAX_PAIRS pairs) keep the one-warp down unless the
    experts are so few that the average is above 2 pairs: then the class of that average (the 32-row
    class for MXFP4, the 16-row one for NVFP4). Up to FEW_MAX_PAIRS pairs over at least 4x as many
    experts, one block a pair (`mma_few`)."""
    assert moe.TOKEN_MAX_PAIRS == 8 and moe.FEW_MAX_PAIRS == 24
    above_two = {"mxfp4": "mma", "nvfp4": "mma_small"}
    for fmt in ("mxfp4", "nvfp4"):
        want = above_two[fmt] if expected == "above 2" else expected
        assert moe.size_class(pairs, experts, fmt) == want, fmt


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(path="tiles"), "path"), (dict(block_n=24), "block_n"), (dict(block_k=0), "block_k"),
     (dict(path="dot", block_m=8), "block_m"), (dict(path="dot", block_m=16, prefetch=True), "prefetch"),
     (dict(path="mma", block_n=32), "block_n"), (dict(path="mma", block_n=64, num_stages=2, prefetch=True), "prefetch"),
     (dict(path="mma", block_n=64, block_k=16), "block_k"), (dict(down_block_n=32), "down_block_n"),
     (dict(path="mma", num_warps=1, down_block_n=48), "down_block_n"),
     (dict(path="mma", num_warps=1, down_num_warps=3), "down_num_warps"),
     (dict(path="mma", num_warps=1, down_block_n=16, down_num_warps=2), "down kernel"),
     (dict(scale_asm=True), "scale_asm"), (dict(path="dot", block_m=16, scale_asm=True), "scale_asm"),
     (dict(max_regs=16), "max_regs"), (dict(max_regs=256), "max_regs"), (dict(down_max_regs=-1), "down_max_regs"),
     (dict(k_splits=2), "k_splits"), (dict(path="mma", num_warps=1, k_splits=3), "k_splits"),
     (dict(path="mma", num_warps=1, k_splits=0), "k_splits"), (dict(direct_blocks=True), "direct_blocks"),
     (dict(ready_counts=True), "ready_counts"), (dict(path="mma", num_warps=1, ready_counts=True), "ready_counts"),
     (dict(path="mma", num_warps=1, prefetch=True, direct_blocks=True, ready_counts=True), "ready_counts"),
     (dict(path="mma", num_warps=1, prefetch=True, k_splits=2, ready_counts=True), "ready_counts"),
     (dict(path="mma", num_warps=1, prefetch=True, relaxed_spin=True), "relaxed_spin")],
)
def test_tile_config_rejects_bad_values(kwargs, match):
    base = dict(path="gemv", block_m=1, block_n=16, block_k=64)
    with pytest.raises(ValueError, match=match):
        moe.TileConfig(**{**base, **kwargs})


def test_mma_config_beyond_the_grid_limit_is_refused():
    """The mma kernels put expert blocks on the grid's second axis (at most 65535): a forced mma
    config with more blocks is refused at call time, naming the config, before anything runs."""
    w = make_experts("mxfp4", 1, 32, 32, seed=0)
    tokens = moe.MAX_GRID_Y + 1  # block_m 1: up to one block a pair, 65536 blocks
    x, ids, weights = torch.randn(tokens, 32), torch.zeros(tokens, 1, dtype=torch.int32), torch.rand(tokens, 1)
    with pytest.raises(ValueError, match="config"):
        moe.fp4_moe_pairs_triton(*_args(x, ids, weights, w, None), config=moe.TileConfig("mma", 1, 16, 32, num_warps=1))


def test_word_views(caplog):
    """The GEMV and mma paths' views: word-major activations, int32 weight words from any uint8 view,
    int32 scale words (rows padded to whole words)."""
    a = torch.arange(32.0).reshape(2, 16)
    assert torch.equal(moe.word_major(a)[1, 3], torch.tensor([19.0, 27.0]))  # a[1, 8j + 3]
    strided = torch.randint(0, 256, (2, 3, 21), dtype=torch.uint8)[:, :, 1:17]
    misaligned = torch.randint(0, 256, (97,), dtype=torch.uint8)[1:].view(2, 3, 16)  # contiguous, offset 1
    for packed in (strided, misaligned):
        words = moe._as_words(packed)
        assert words.dtype == torch.int32 and words.shape == (2, 3, 4) and words.data_ptr() % 16 == 0
        assert torch.equal(words.view(torch.uint8), packed)
    assert "misaligned" in caplog.text
    scales = torch.randint(0, 256, (2, 3, 5), dtype=torch.uint8)  # rows of 5 bytes: padded to 2 words
    scale_words = moe._scale_words(scales)
    assert scale_words.dtype == torch.int32 and scale_words.shape == (2, 3, 2)
    assert torch.equal(scale_words.view(torch.uint8)[..., :5], scales)
    assert "padded" in caplog.text


def test_mma_path_needs_multiples_of_32():
    w = make_experts("nvfp4", 2, 48, 32, seed=15)
    ids, weights = make_routing(3, 2, 2, "random", seed=15)
    x = torch.randn(3, 48)
    with pytest.raises(ValueError, match="multiples of 32"):
        moe.fp4_moe_pairs_triton(*_args(x, ids, weights, w, None), config=moe.TileConfig("mma", 8, 16, 64, num_warps=1))


def test_nvfp4_default_config_with_k_and_i_odd_multiples_of_16():
    """NVFP4 allows K and I multiples of 16; where they are not multiples of 32 the default launch
    avoids the mma path (which needs 32) at every size class, through the op."""
    w = make_experts("nvfp4", 8, 48, 48, seed=31)
    # 2 pairs, 2 and 10 pairs per expert: the NVFP4 mma size classes at K, I multiples of 32
    for tokens, mma_class in ((1, "mma_token"), (8, "mma_small"), (40, "mma_small")):
        ids, weights = make_routing(tokens, 2, 8, "random", seed=31 + tokens)
        x = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(tokens))
        assert moe.size_class(tokens * 2, 8, "nvfp4") == mma_class
        got = torch.ops.dsv4.fp4_moe(*_args(x, ids, weights, w, None))
        assert_close_scaled(got, moe.fp4_moe_reference(*_args(x, ids, weights, w, None)), torch.float32)


@pytest.mark.parametrize("code, finite", [(moe.MMA_MAX_UE8M0, True), (moe.MMA_MAX_UE8M0 + 1, False)])
def test_mma_path_scale_limit(code, finite):
    """MMA_MAX_UE8M0 is the mma path's real limit: down-projection scales of 2**65 give the reference's
    result, 2**66 overflows the path's bf16 scale factor (the reference stays finite)."""
    w = make_experts("mxfp4", 2, 64, 64, seed=33)
    w["w2_scale"] = torch.full_like(w["w2_scale"], code)
    ids, weights = make_routing(5, 2, 2, "random", seed=33)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(34))
    want = moe.fp4_moe_reference(*_args(x, ids, weights, w, None))
    assert want.isfinite().all()
    config = moe.TileConfig("mma", 8, 16, 32, num_warps=1)
    got = combine_pairs(moe.fp4_moe_pairs_triton(*_args(x, ids, weights, w, None), config=config), ids, 2,
                            x.dtype)
    if finite:
        assert_close_scaled(got, want, torch.float32)
    else:
        assert not got.isfinite().all()


def _planned_launches_script(kernels: tuple[str, ...], body: str) -> str:
    """A script for run_compiled_script: the FP4 MoE's `kernels` record their launches in `launches`
    instead of running (the launches only, planned on CPU: the grouping kernels, Triton with no driver
    here, give int32 tables), then `body` runs."""
    return f"""
import dataclasses, re, sys, torch, triton.language as tl
sys.path[:0] = ["bench"]
from bench_sparse_mla import compiled_stats, cross_compile, launch_recorder
from dsv4_compile.fp4_tiles import tile_fp4
from dsv4_compile.kernels import fp4_moe as moe
print("module", moe.__file__)
launches = []
for name in {kernels!r}:
    setattr(moe, name, launch_recorder(getattr(moe, name), launches))
moe.expert_blocks = lambda ids, experts, block_m, ready=None: tuple(torch.zeros(n, dtype=torch.int32)
                                                                    for n in (12, 4, 4, 4))
""" + body


_MMA_CROSS_COMPILE = _planned_launches_script(("_gate_up_mma_kernel", "_down_mma_kernel"), """
for fmt in ("mxfp4", "nvfp4"):
    group = moe.GROUP[fmt]
    w13 = torch.zeros(2, 256, 64, dtype=torch.uint8)
    w2 = torch.zeros(2, 128, 64, dtype=torch.uint8)
    dtype = torch.uint8 if fmt == "mxfp4" else torch.float8_e4m3fn
    s13, s2 = torch.zeros(2, 256, 128 // group, dtype=dtype), torch.zeros(2, 128, 128 // group, dtype=dtype)
    glob = None if fmt == "mxfp4" else torch.ones(2)
    for asm, tiled in ((False, True), (True, False), (True, True)):
        launches.clear()
        config = dataclasses.replace(moe.DEFAULT_CONFIGS["mma"], scale_asm=asm)
        codes13, codes2 = (tile_fp4(w13), tile_fp4(w2)) if tiled else (w13, w2)
        moe.fp4_moe_pairs_triton(torch.zeros(2, 128, dtype=torch.bfloat16), torch.zeros(2, 6, dtype=torch.int32),
                                 torch.ones(2, 6), codes13, s13, codes2, s2, fmt, glob, glob, None, config=config)
        gate_up_caps, down_caps = moe.register_caps(config, interpreted=False)
        for launch in launches:
            # as the launcher passes them on a GPU (planned on CPU, it passes the interpreter's)
            launch.meta.update(DOT_DTYPE=tl.bfloat16, COMPILED=True, SCALE_ASM=asm)
            launch.meta.update(gate_up_caps if launch.kernel.fn.__name__ == "_gate_up_mma_kernel" else down_caps)
            for cap in (90, 120):
                compiled = cross_compile(launch, cap)
                ptx = compiled.asm["ptx"]
                maxnreg = ptx.split(".maxnreg", 1)[1].split()[0] if ".maxnreg" in ptx else "none"
                print(fmt, asm, tiled, launch.kernel.fn.__name__, cap, compiled.metadata.shared,
                      ptx.count("ld.global.nc.b32"), maxnreg)
""")


def test_mma_defaults_cross_compile_for_sm90_and_sm120():
    """What the interpreter never runs (the launcher turns both off there): TileConfig.scale_asm's
    inline-asm scale loads and the 32-row class's gate/up register cap. Compile both mma kernels of that class
    with and without the asm loads (no GPU needed, in a process without TRITON_INTERPRET) for sm_90 and
    sm_120, with the launch options the launcher gives a GPU, on tiled experts (the swizzled decode) and
    row-major ones (with the asm loads). With the asm loads the PTX holds them,
    without them none; the PTX caps gate/up's registers at its config's cap (.maxnreg), the down kernel's
    not at all (it has no cap since the twenty-fourth session); all stay
    within sm_120's 101,376 B of shared memory. (The H200 checked the outputs of both forms bit for bit
    against the plain ones: bench/RESULTS.md, twelfth and thirteenth sessions.)"""
    rows = run_compiled_script(_MMA_CROSS_COMPILE, moe.__file__)
    assert sorted(tuple(r[:5]) for r in rows) == sorted(
        (fmt, asm, tiled, kernel, cap) for fmt in ("mxfp4", "nvfp4")
        for asm, tiled in (("False", "True"), ("True", "False"), ("True", "True"))
        for kernel in ("_gate_up_mma_kernel", "_down_mma_kernel") for cap in ("90", "120"))
    config = moe.DEFAULT_CONFIGS["mma"]
    assert config.max_regs and not config.down_max_regs
    want_caps = {"_gate_up_mma_kernel": str(config.max_regs), "_down_mma_kernel": "none"}
    for fmt, asm, _, kernel, cap, shared, asm_loads, maxnreg in rows:
        assert int(shared) <= 101_376
        assert (int(asm_loads) > 0) == (asm == "True"), (fmt, asm, kernel, cap, asm_loads)
        assert maxnreg == want_caps[kernel], (fmt, asm, kernel, cap, maxnreg)


_DOT64_CROSS_COMPILE = _planned_launches_script(("_gate_up_kernel", "_down_kernel"), """
hidden, inter = 4096, 2048  # V4-Flash's expert sizes, two experts
for fmt in ("mxfp4", "nvfp4"):
    group, dtype = moe.GROUP[fmt], torch.uint8 if fmt == "mxfp4" else torch.float8_e4m3fn
    w13 = torch.zeros(2, 2 * inter, hidden // 2, dtype=torch.uint8)
    w2 = torch.zeros(2, hidden, inter // 2, dtype=torch.uint8)
    s13 = torch.zeros(2, 2 * inter, hidden // group, dtype=dtype)
    s2 = torch.zeros(2, hidden, inter // group, dtype=dtype)
    glob = None if fmt == "mxfp4" else torch.ones(2)
    # sm_100 takes tl.dot_scaled on row-major MXFP4 (native_fp4_dot); sm_90 and sm_120 dequantise
    for cap, dot_scaled in ((90, False), (120, False)) + (((100, True),) if fmt == "mxfp4" else ()):
        launches.clear()
        config = moe.choose_config(24576, 256, fmt, dot_scaled, sm90=cap == 90)
        moe.fp4_moe_pairs_triton(torch.zeros(2, hidden, dtype=torch.bfloat16), torch.zeros(2, 6, dtype=torch.int32),
                                 torch.ones(2, 6), w13, s13, w2, s2, fmt, glob, glob, None, config=config,
                                 use_dot_scaled=dot_scaled)
        for launch in launches:
            launch.meta.update(DOT_DTYPE=tl.bfloat16)  # as the launcher passes it on a GPU
            stats = compiled_stats(launch, cap)
            print(fmt, cap, dot_scaled, launch.kernel.fn.__name__, config.block_k, stats["spill_stores"],
                  stats["shared"])
""")


def test_dot64_configs_do_not_spill():
    """The prefill class (64-row dot blocks) at V4-Flash's expert sizes, compiled (ptxas -v) with the
    config each GPU takes: DEFAULT_CONFIGS' 128-column K steps on sm_90 (wgmma), OFF_SM90_CONFIGS' 64
    on sm_120 (dequantised) and sm_100 (tl.dot_scaled on row-major MXFP4). No kernel spills
    (128-column steps spilled up to 628 B on sm_120, 84 B on sm_100) and all fit sm_120's 101,376 B of
    shared memory."""
    rows = run_compiled_script(_DOT64_CROSS_COMPILE, moe.__file__)
    assert sorted(tuple(r[:4]) for r in rows) == sorted(
        (fmt, cap, scaled, kernel) for fmt, cap, scaled in (("mxfp4", "90", "False"), ("mxfp4", "120", "False"),
                                                            ("mxfp4", "100", "True"), ("nvfp4", "90", "False"),
                                                            ("nvfp4", "120", "False"))
        for kernel in ("_gate_up_kernel", "_down_kernel"))
    for fmt, cap, scaled, kernel, block_k, spills, shared in rows:
        assert int(block_k) == (128 if cap == "90" else 64)
        assert int(spills) == 0, (fmt, cap, scaled, kernel)
        assert int(shared) <= 101_376


_DOT_SCALED_PTX = _planned_launches_script(("_gate_up_kernel", "_down_kernel"), """
w13, w2 = torch.zeros(2, 256, 128, dtype=torch.uint8), torch.zeros(2, 256, 64, dtype=torch.uint8)
s13, s2 = torch.zeros(2, 256, 8, dtype=torch.uint8), torch.zeros(2, 256, 4, dtype=torch.uint8)
moe.fp4_moe_pairs_triton(torch.zeros(2, 256, dtype=torch.bfloat16), torch.zeros(2, 6, dtype=torch.int32),
                         torch.ones(2, 6), w13, s13, w2, s2, "mxfp4", None, None, None,
                         config=moe.DEFAULT_CONFIGS["dot16"], use_dot_scaled=True)
for launch in launches:
    launch.meta.update(DOT_DTYPE=tl.bfloat16)  # bf16 x, as on a GPU
    for cap in (100, 120):
        ptx = cross_compile(launch, cap).asm["ptx"]
        kinds = sorted(set(re.findall(r"(?:mma\\.sync\\.aligned|tcgen05\\.mma)[\\w.:]*", ptx)))
        print(launch.kernel.fn.__name__, cap, ",".join(kinds))
""")


def test_tl_dot_scaled_compiles_to_bf16_mmas():
    """Why sm_120 does not take tl.dot_scaled (native_fp4_dot): with bf16 x, Triton compiles both dot-path
    kernels' tl.dot_scaled to bf16 MMAs on the decoded codes, not to FP4 ones: mma.sync m16n8k16 bf16 on
    sm_120 (the instruction of the mma path's one-warp tiles), tcgen05 kind::f16 on sm_100. Should a
    Triton upgrade emit FP4 MMAs (kind::mxf4...), this fails and the choice is to be measured again."""
    rows = run_compiled_script(_DOT_SCALED_PTX, moe.__file__)
    assert sorted(tuple(r[:2]) for r in rows) == sorted(
        (kernel, cap) for kernel in ("_gate_up_kernel", "_down_kernel") for cap in ("100", "120"))
    for kernel, cap, kinds in rows:
        want = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" if cap == "120"
                else "tcgen05.mma.cta_group::1.kind::f16")
        assert kinds == want, (kernel, cap, kinds)


@pytest.mark.parametrize("config, interpreted, want", [
    (moe.TileConfig("mma", 8, 32, 128, num_warps=1, max_regs=160, down_max_regs=112), False,
     ({"maxnreg": 160}, {"maxnreg": 112})),
    (moe.TileConfig("mma", 8, 32, 128, num_warps=1, max_regs=160), False, ({"maxnreg": 160}, {"maxnreg": None})),
    (moe.TileConfig("mma", 8, 32, 128, num_warps=1, max_regs=160, down_max_regs=112), True, ({}, {})),
])
def test_register_caps_become_launch_options(config, interpreted, want):
    """A config's register caps are the kernels' maxnreg launch options on a GPU; 0 leaves the compiler
    its choice (None), and the interpreter gets none."""
    assert moe.register_caps(config, interpreted) == want


def test_interpreter_widens_only_the_default_mma_tiles(monkeypatch):
    """Under the interpreter a default mma config runs with column tiles as wide as I (gate/up) and
    K (down), up to INTERPRETER_MAX_BLOCK_N, and no split-K: the same kernels in fewer programs.
    Nothing else of the config changes; dot and gemv configs, and a config the caller passes, launch
    as given (the defaults themselves run as given in test_mma_several_scale_groups_per_lane)."""
    token = moe.DEFAULT_CONFIGS["mma_token"]
    wide = moe.interpreter_shape(token, hidden=64, inter=32)
    assert (wide.block_n, wide.down_shape(), wide.k_splits) == (32, (64, 1), 1)
    assert dataclasses.replace(wide, block_n=token.block_n, down_block_n=token.down_block_n, k_splits=2) == token
    large = moe.interpreter_shape(moe.DEFAULT_CONFIGS["mma"], hidden=4096, inter=2048)
    assert (large.block_n, large.down_shape()) == (moe.INTERPRETER_MAX_BLOCK_N, (128, 4))
    for name in ("gemv", "dot16", "dot64"):
        assert moe.interpreter_shape(moe.DEFAULT_CONFIGS[name], 4096, 2048) is moe.DEFAULT_CONFIGS[name]

    grids = []

    def recorder(name):
        class Record:
            def __getitem__(self, grid):
                return lambda *args, **meta: grids.append((name, grid, meta.get("BLOCK_N")))
        return Record()

    for name in ("_gate_up_mma_kernel", "_swiglu_partials_kernel", "_down_mma_kernel"):
        monkeypatch.setattr(moe, name, recorder(name))
    experts, hidden, inter = 8, 64, 32
    w = make_experts("mxfp4", experts, hidden, inter, seed=51)
    ids, weights = make_routing(2, 2, experts, "random", seed=51)
    x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(52))
    assert moe.size_class(4, experts, "mxfp4") == "mma_token"
    moe.fp4_moe_pairs_triton(*_args(x, ids, weights, w, None))
    assert grids == [("_gate_up_mma_kernel", (1, 4, 1), 32), ("_down_mma_kernel", (1, 4, 1), 64)]
    grids.clear()
    moe.fp4_moe_pairs_triton(*_args(x, ids, weights, w, None), config=token)
    assert [(name, grid) for name, grid, _ in grids] == [
        ("_gate_up_mma_kernel", (2, 4, 2)), ("_swiglu_partials_kernel", (1, 4)), ("_down_mma_kernel", (4, 4, 1))]
