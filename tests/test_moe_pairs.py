"""kernels/moe_pairs.py: grouping pairs by expert, and the Triton combine against its torch form.
Under the Triton interpreter on CPU."""
import pytest
import torch

from dsv4_compile.kernels import moe_pairs
from helpers import check_expert_blocks


def test_blocks_cover_pairs():
    ids = torch.tensor([[2, 0], [2, -1], [2, 2], [7, 0]], dtype=torch.int32)
    order, expert, start, end = moe_pairs.expert_blocks(ids, experts=3, block_m=2)
    assert expert.numel() == 3 + (8 - 3) // 2  # min(E, pairs) + floor((pairs - min(E, pairs)) / block_m)
    real = expert < 3
    rows = [(int(e), list(range(s, min(s + 2, t)))) for e, s, t in zip(expert[real], start[real], end[real])]
    seen = sorted(int(order[r]) for _, rs in rows for r in rs)
    assert seen == [0, 1, 2, 4, 5, 7]  # every valid pair exactly once; never -1 or id 7 (pairs 3, 6)
    for e, rs in rows:
        assert all(int(ids.reshape(-1)[order[r]]) == e for r in rs)


@pytest.mark.parametrize("tokens, top_k, experts, block_m", [(1, 1, 1, 1), (5, 3, 4, 2), (64, 6, 32, 8),
                                                             (33, 6, 256, 1), (7, 6, 256, 16), (0, 6, 8, 8),
                                                             (400, 6, 256, 16), (256, 8, 256, 4)])
def test_expert_blocks_match_loop(tokens, top_k, experts, block_m):
    """The Triton grouping against the contract in Python, with ids -1 and >= E mixed in: `order` holds
    each expert's pairs in its row range (in any order within it), then the skipped pairs. Up to
    ONE_PROGRAM_PAIRS pairs one program groups them; 2,400 pairs take the two-launch path."""
    gen = torch.Generator().manual_seed(tokens * 131 + experts)
    ids = torch.randint(-1, experts + 2, (tokens, top_k), generator=gen).to(torch.int32)
    check_expert_blocks(ids.reshape(-1).tolist(), experts, block_m, *moe_pairs.expert_blocks(ids, experts, block_m))


@pytest.mark.parametrize("tokens, block_m", [(7, 8), (250, 1), (400, 8)])
def test_expert_blocks_zero_the_ready_counts(tokens, block_m):
    """The ready counts of the FP4 MoE's down kernel (`ready`, one a block) start poisoned and come out
    zeroed, by the one grouping program (42 pairs; 1,500 pairs in 1,500 blocks, zeroed 1,024 at a
    time) and by the two-launch path (2,400 pairs), with the same block table as without them."""
    ids = torch.randint(-1, 256, (tokens, 6), generator=torch.Generator().manual_seed(tokens)).to(torch.int32)
    bound = moe_pairs.block_bound(tokens * 6, 256, block_m)
    ready = torch.full((bound,), -7, dtype=torch.int32)
    with_ready = moe_pairs.expert_blocks(ids, 256, block_m, ready)
    assert bool((ready == 0).all())
    for got, want in zip(with_ready[1:], moe_pairs.expert_blocks(ids, 256, block_m)[1:]):  # the block table
        assert torch.equal(got, want)
    check_expert_blocks(ids.reshape(-1).tolist(), 256, block_m, *with_ready)


@pytest.mark.parametrize("ready, match", [(torch.zeros(5, dtype=torch.int32), r"shape \(6,\)"),
                                          (torch.zeros(6, dtype=torch.int64), "int32")])
def test_expert_blocks_reject_a_ready_buffer_that_does_not_fit(ready, match):
    with pytest.raises(ValueError, match=match):
        moe_pairs.expert_blocks(torch.zeros(1, 6, dtype=torch.int32), 8, 8, ready)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_one_program_fills_a_long_spare_table(dtype):
    """2,048 pairs (ONE_PROGRAM_PAIRS), all skipped but one: 2,047 spare blocks, written 1,024 at a
    time, each (E, 0, 0); int32 and int64 ids group alike."""
    assert moe_pairs.ONE_PROGRAM_PAIRS == 2048
    ids = torch.full((2048, 1), -1, dtype=dtype)
    ids[1000] = 3
    order, expert, start, end = moe_pairs.expert_blocks(ids, 8, 1)
    assert int(order[0]) == 1000 and sorted(order.tolist()) == list(range(2048))
    assert expert.numel() == 2048 and (int(expert[0]), int(start[0]), int(end[0])) == (3, 0, 1)
    assert bool((expert[1:] == 8).all() and (start[1:] == 0).all() and (end[1:] == 0).all())


@pytest.mark.parametrize("pairs, experts, block_m", [(6, 256, 8), (384, 256, 8), (1536, 256, 8), (9, 4, 2),
                                                      (1, 1, 1), (40, 3, 16), (0, 8, 8)])
def test_block_bound_holds_and_is_reached(pairs, experts, block_m):
    """block_bound is at least the blocks of any split of the pairs over the experts (random splits,
    all pairs on one expert, one pair per expert) and is reached by its worst case: every busy expert
    but one with a single pair, the last with the rest. There expert_blocks fills its whole table."""
    def blocks(counts):
        return sum(-(-c // block_m) for c in counts)

    bound = moe_pairs.block_bound(pairs, experts, block_m)
    gen = torch.Generator().manual_seed(pairs + experts)
    for _ in range(50):
        ids = torch.randint(0, experts, (pairs,), generator=gen)
        assert blocks(torch.bincount(ids, minlength=experts).tolist()) <= bound
    assert blocks([pairs]) <= bound and blocks([1] * min(pairs, experts)) <= bound
    busy = min(pairs, experts)
    worst = [1] * (busy - 1) + [pairs - busy + 1] if busy else []
    assert blocks(worst) == bound
    ids = torch.tensor([e for e, c in enumerate(worst) for _ in range(c)], dtype=torch.int32).view(-1, 1)
    order, expert, start, end = moe_pairs.expert_blocks(ids, experts, block_m)
    assert expert.numel() == bound and bool((expert < experts).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, top_k, experts, hidden",
                         [(1, 1, 1, 8), (5, 3, 4, 96), (9, 6, 8, 1500), (0, 6, 8, 96), (3, 2, 4, 0)])
def test_combine_pairs_triton_matches_torch(tokens, top_k, experts, hidden, dtype):
    """combine_pairs_triton == combine_pairs (the spec) with ids -1 and >= E mixed in and one token
    whose every choice is skipped (its row must come out 0). Skipped pairs' rows hold NaN, so
    reading one would show, and the output starts poisoned (NaN). Both add the valid choices in
    order in f32; torch may vectorise the sum in another order, so f32 allows one rounding of the
    largest partial sum per term (k * 2**-24 * max |partial|), and bf16 one bf16 step (2**-7
    relative), as the casts may round differently (the interpreter's f32 -> bf16 cast truncates)."""
    gen = torch.Generator().manual_seed(tokens * 7 + hidden)
    ids = torch.randint(-1, experts + 2, (tokens, top_k), generator=gen).to(torch.int32)
    if tokens:
        ids[-1] = torch.tensor([-1, experts] * top_k)[:top_k]
    pairs = torch.randn(tokens * top_k, hidden, generator=gen)
    pairs[((ids < 0) | (ids >= experts)).reshape(-1)] = float("nan")
    want = moe_pairs.combine_pairs(pairs, ids, experts, dtype)
    out = torch.full((tokens, hidden), float("nan"), dtype=dtype)
    got = moe_pairs.combine_pairs_triton(pairs, ids, experts, dtype, out=out)
    assert got is out and got.shape == (tokens, hidden)
    assert not got.isnan().any()
    if tokens and hidden:
        assert not got[-1].any()  # every choice skipped
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7)
    else:
        partial = pairs.nan_to_num(0.0).abs().view(tokens, top_k, hidden).sum(1).max() if got.numel() else 0.0
        torch.testing.assert_close(got, want, rtol=0, atol=top_k * 2 ** -24 * float(partial) + 1e-30)


def test_combine_pairs_triton_rejects_bad_arguments():
    ids = torch.zeros(2, 3, dtype=torch.int32)
    pairs = torch.randn(6, 32)
    with pytest.raises(ValueError, match="pair_out"):
        moe_pairs.combine_pairs_triton(pairs[:5], ids, 4, torch.float32)
    with pytest.raises(ValueError, match="pair_out"):
        moe_pairs.combine_pairs_triton(torch.randn(32, 6).t(), ids, 4, torch.float32)
    with pytest.raises(TypeError, match="pair_out"):
        moe_pairs.combine_pairs_triton(pairs.double(), ids, 4, torch.float32)
    with pytest.raises(TypeError, match="topk_ids"):
        moe_pairs.combine_pairs_triton(pairs, ids.float(), 4, torch.float32)
    with pytest.raises(ValueError, match="out must be"):
        moe_pairs.combine_pairs_triton(pairs, ids, 4, torch.float32, out=torch.empty(2, 32, dtype=torch.bfloat16))
    for bad_ids in (ids.bool(), ids.to(torch.complex64)):
        with pytest.raises(TypeError, match="topk_ids"):
            moe_pairs.combine_pairs_triton(pairs, bad_ids, 4, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        moe_pairs.combine_pairs_triton(pairs, ids, 4, torch.complex64)
    with pytest.raises(ValueError, match="device"):  # meta stands in for another device
        moe_pairs.combine_pairs_triton(pairs, ids.to("meta"), 4, torch.float32)
