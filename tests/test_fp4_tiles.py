"""The tiled FP4 expert layout (dsv4_compile.fp4_tiles) and fp4_moe on tiled experts (interpreter on CPU)."""
import pytest
import torch

from dsv4_compile import fp4_tiles
from dsv4_compile.kernels import fp4_moe as moe
from dsv4_compile.kernels.moe_pairs import combine_pairs
from helpers import make_experts
from test_fp4_moe import _args, make_routing

def tiled_experts(w: dict) -> dict:
    return dict(w, w13=fp4_tiles.tile_fp4(w["w13"]), w2=fp4_tiles.tile_fp4(w["w2"]))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
def test_tile_layout_and_round_trip(dtype):
    """Element (r, c) sits at [r // 32, c // u, r % 32, c % u], each tile is contiguous, and
    untile_matrix inverts tile_matrix exactly."""
    units = 8
    t = torch.randint(0, 256, (2, 64, 24), dtype=torch.uint8).view(dtype)
    tiled = fp4_tiles.tile_matrix(t, units)
    assert tiled.shape == (2, 2, 3, 32, units) and tiled.is_contiguous()
    raw, tiled_raw = t.view(torch.uint8), tiled.view(torch.uint8)
    for e, r, c in [(0, 0, 0), (1, 63, 23), (0, 33, 9), (1, 17, 16)]:
        assert tiled_raw[e, r // 32, c // units, r % 32, c % units] == raw[e, r, c]
    assert torch.equal(fp4_tiles.untile_matrix(tiled).view(torch.uint8), raw)
    assert fp4_tiles.logical_shape(tiled) == tuple(t.shape)


def _pair_bits_row_major(words: torch.Tensor, q: int) -> torch.Tensor:
    """The mma decode's spec (kernels/fp4_moe.py `_e2m1_pair_bits`): codes q and q + 4 of row-major words
    (int64 holding uint32) as bf16 magnitude bits 6..8 and sign bit 15 of the low and high half."""
    nibbles = (words >> (4 * q)) & 0x000F000F
    return (((nibbles << 6) | (nibbles << 12)) & 0x81C081C0)


def _pair_bits_swizzled(words: torch.Tensor, q: int) -> torch.Tensor:
    """`_e2m1_pair_bits_swizzled`'s operations on the tiled layout's words (int64 holding uint32)."""
    if q == 0:
        return words & 0x81C081C0
    if q == 3:
        return (((words & 0x001B001B) * 0x1084) & 0xFFFFFFFF) & 0x81C081C0
    rotated = ((words >> (3 * q)) | (words << (32 - 3 * q))) & 0xFFFFFFFF
    return rotated & 0x81C081C0


def test_swizzled_words_decode_as_the_row_major_ones():
    """SWIZZLED_BIT is a permutation of the 32 bits, swizzle_words / unswizzle_words invert each other
    (also over more experts than one pass takes), tile_fp4 / untile_fp4 too, and the mma path's 9-operation
    decode of a swizzled word gives exactly the 13-operation decode of the row-major word, for each of the
    four code pairs (every bit pattern reaches each position across the random words)."""
    assert sorted(fp4_tiles.SWIZZLED_BIT) == list(range(32))
    gen = torch.Generator().manual_seed(11)
    packed = torch.randint(0, 256, (fp4_tiles.SWIZZLE_CHUNK + 3, 64, 128), dtype=torch.uint8, generator=gen)
    swizzled = fp4_tiles.swizzle_words(packed)
    assert not torch.equal(swizzled, packed)
    assert torch.equal(fp4_tiles.unswizzle_words(swizzled), packed)
    assert torch.equal(fp4_tiles.untile_fp4(fp4_tiles.tile_fp4(packed)), packed)
    one_tile_column = packed[:2, :, :64].contiguous()  # tile_matrix returns such a tensor itself
    before = one_tile_column.clone()
    assert torch.equal(fp4_tiles.untile_fp4(fp4_tiles.tile_fp4(one_tile_column)), before)
    assert torch.equal(one_tile_column, before)
    row_major = packed.view(torch.int32).long() & 0xFFFFFFFF
    tiled = swizzled.view(torch.int32).long() & 0xFFFFFFFF
    for q in range(4):
        assert torch.equal(_pair_bits_swizzled(tiled, q), _pair_bits_row_major(row_major, q)), q


def test_tile_rejects_partial_tiles():
    with pytest.raises(ValueError, match="tiles of 32 rows"):
        fp4_tiles.tile_matrix(torch.zeros(1, 48, 64, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="tiles of 32 rows"):
        fp4_tiles.tile_matrix(torch.zeros(1, 64, 96, dtype=torch.uint8), 64)


CONFIGS = [moe.TileConfig("mma", 8, 16, 32, num_warps=1, prefetch=True), moe.TileConfig("mma", 4, 32, 64, num_warps=1),
           moe.TileConfig("gemv", 2, 16, 64, num_warps=2, prefetch=True), moe.TileConfig("dot", 16, 32, 32)]


@pytest.mark.parametrize("config", CONFIGS, ids=["mma_prefetch", "mma", "gemv_prefetch", "dot"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_tiled_experts_give_the_same_outputs(config, fmt):
    """Each path on tiled experts writes exactly what it writes on the row-major ones (the same products
    in the same order: only the addresses and the exact decode of the swizzled words differ), and both
    match the reference."""
    experts, hidden, inter, tokens, top_k = 3, 128, 128, 4, 2
    w = make_experts(fmt, experts, hidden, inter, seed=31)
    tiled = tiled_experts(w)
    ids, weights = make_routing(tokens, top_k, experts, "random", seed=31)
    ids[0, 0], ids[1, 1] = -1, 2
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(32)).to(torch.bfloat16)
    outs = []
    for experts_in in (w, tiled):
        pair_out = torch.full((tokens * top_k, hidden), float("nan"))
        outs.append(moe.fp4_moe_pairs_triton(*_args(x, ids, weights, experts_in, 0.5), pair_out=pair_out,
                                             config=config))
    valid = ((ids >= 0) & (ids < experts)).reshape(-1)
    assert not outs[1][valid].isnan().any()
    assert torch.equal(outs[0][valid], outs[1][valid])
    want = moe.fp4_moe_reference(*_args(x, ids, weights, w, 0.5))
    assert torch.equal(moe.fp4_moe_reference(*_args(x, ids, weights, tiled, 0.5)), want)
    got = combine_pairs(outs[1], ids, experts, x.dtype).float()
    # bf16 output rounding (2**-8 relative): the test_fp4_moe tolerance for bf16 x
    assert (got - want.float()).abs().max() <= 2e-2 * want.float().abs().max()


def test_tiled_op_checks():
    w = make_experts("mxfp4", 2, 128, 128, seed=3)
    tiled = tiled_experts(w)
    x = torch.randn(3, 128)
    ids, weights = make_routing(3, 2, 2, "random", seed=3)
    mixed = dict(tiled, w2=w["w2"])
    with pytest.raises(ValueError, match="both be row-major or both tiled"):
        torch.ops.dsv4.fp4_moe(*_args(x, ids, weights, mixed, None))
    bad = dict(tiled, w13=tiled["w13"].reshape(2, 8, 1, 64, 32))
    with pytest.raises(ValueError, match="tiles of"):
        torch.ops.dsv4.fp4_moe(*_args(x, ids, weights, bad, None))
    tiled_scale = dict(tiled, w13_scale=fp4_tiles.tile_matrix(w["w13_scale"], 4))
    with pytest.raises(ValueError, match="w13_scale must be"):
        torch.ops.dsv4.fp4_moe(*_args(x, ids, weights, tiled_scale, None))
    got = torch.ops.dsv4.fp4_moe(*_args(x, ids, weights, tiled, None))
    want = moe.fp4_moe_reference(*_args(x, ids, weights, w, None))
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()  # f32 x: summation order only


def test_tiled_experts_take_the_dequantising_dot_path():
    """tl.dot_scaled reads the row-major packing, so on tiled (swizzled) experts the dot path dequantises
    even where dot_scaled is asked for (the interpreter cannot run tl.dot_scaled: it would raise)."""
    w = make_experts("mxfp4", 3, 128, 128, seed=41)
    ids, weights = make_routing(4, 2, 3, "random", seed=41)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(42))
    pair_out = torch.full((8, 128), float("nan"))
    pairs = moe.fp4_moe_pairs_triton(*_args(x, ids, weights, tiled_experts(w), None), pair_out=pair_out,
                                     use_dot_scaled=True, config=moe.TileConfig("dot", 16, 32, 32))
    want = moe.fp4_moe_reference(*_args(x, ids, weights, w, None))
    got = combine_pairs(pairs, ids, 3, x.dtype)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()  # f32 x: summation order only


def test_tiled_experts_are_launched_as_without_tl_dot_scaled(monkeypatch):
    """Where row-major MXFP4 takes tl.dot_scaled's size classes (native_fp4_dot: sm_100, forced here),
    tiled experts take the classes of other GPUs (the mma path), since tl.dot_scaled cannot read their
    swizzled words; both give the reference's answer."""
    monkeypatch.setattr(moe, "native_fp4_dot", lambda x, fmt: fmt == "mxfp4")
    chosen = []
    choose = moe.choose_config
    monkeypatch.setattr(moe, "choose_config", lambda *args, **kw: chosen.append(args[3]) or choose(*args, **kw))
    w = make_experts("mxfp4", 4, 128, 128, seed=43)
    ids, weights = make_routing(2, 2, 4, "random", seed=43)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(44))
    want = moe.fp4_moe_reference(*_args(x, ids, weights, w, None))
    for experts_in in (w, tiled_experts(w)):
        got = combine_pairs(moe.fp4_moe_pairs_triton(*_args(x, ids, weights, experts_in, None)), ids, 4, x.dtype)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()  # f32 x: summation order only
    assert chosen == [True, False]
