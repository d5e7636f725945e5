"""dsv4::skinny_mm_partials (kernels/skinny_mm.py) against its torch reference."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from dsv4_compile.kernels.skinny_mm import (BLOCK_M, MAX_COLUMNS, MIN_CHUNK, TARGET_PROGRAMS, choose_splits,
                                            skinny_mm_partials_reference, skinny_mm_partials_triton)


def operands(rows, depth, columns, dtype, seed, transposed_b=True):
    """a [rows, depth] in `dtype` (mHC-like values, not normalised), b [depth, columns] f32 as the
    graph has it: the transpose of a contiguous [columns, depth] weight (or contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(rows, depth, generator=gen) * 3).to(dtype)
    w = torch.randn(columns, depth, generator=gen) * depth ** -0.5
    return a, (w.t() if transposed_b else w.t().contiguous())


def assert_partials_close(got, a, b, splits):
    """Each partial is an f32 sum over its chunk in another order than torch's: within 1e-5 of
    sum_k |a_k b_k| over the chunk. Any order's rounding error is at most ~chunk * 2**-24 of that
    sum (worst case; 2.4e-4 at 4,096 columns) and grows like sqrt(chunk) * 2**-24 (~4e-6 at 4,096)
    for random signs; 1e-5 is that typical size with margin."""
    want = skinny_mm_partials_reference(a, b, splits)
    bound = skinny_mm_partials_reference(a.float().abs(), b.abs(), splits) * 1e-5
    assert got.shape == want.shape and got.dtype == torch.float32
    assert ((got - want).abs() <= bound + 1e-30).all(), (got - want).abs().max()


def poisoned(splits, rows, columns):
    return torch.full((splits, rows, columns), float("nan"))


@given(rows=st.integers(1, 40), depth=st.integers(1, 700), columns=st.integers(1, MAX_COLUMNS),
       splits=st.integers(1, 9), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       transposed_b=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_matches_reference(rows, depth, columns, splits, dtype, transposed_b, seed):
    """Any sizes: partial row blocks, chunks that do not divide K and end past it (empty splits
    write zeros), N up to the limit, both layouts of b."""
    a, b = operands(rows, depth, columns, dtype, seed, transposed_b)
    out = skinny_mm_partials_triton(a, b, splits, out=poisoned(splits, rows, columns))
    assert_partials_close(out, a, b, splits)


@pytest.mark.parametrize("rows, columns", [(1, 24), (64, 24), (3, 4)])  # mHC layers at B=1 / 64, hyper head
def test_mhc_sizes(rows, columns):
    depth = 4 * 1024
    splits = choose_splits(rows, depth)
    a, b = operands(rows, depth, columns, torch.bfloat16, seed=rows)
    out = skinny_mm_partials_triton(a, b, splits, out=poisoned(splits, rows, columns))
    assert_partials_close(out, a, b, splits)
    torch.testing.assert_close(out.sum(0), a.float() @ b, rtol=1e-4, atol=1e-4)


def test_strided_a_rows():
    a, b = operands(6, 1024, 24, torch.float32, seed=7)
    wide = torch.randn(6, 3000)
    wide[:, 100:1124] = a
    view = wide[:, 100:1124]
    out = skinny_mm_partials_triton(view, b, 4, out=poisoned(4, 6, 24))
    assert_partials_close(out, a, b, 4)


@pytest.mark.parametrize("rows, depth, expected", [
    (1, 16384, TARGET_PROGRAMS),             # one row block: as many splits as the programs allow
    (64, 16384, TARGET_PROGRAMS // 4),        # four row blocks
    (256, 16384, TARGET_PROGRAMS // 16),
    (64, 1024, 1024 // MIN_CHUNK),            # short reduction: chunks of MIN_CHUNK
    (64, 100, 1),
])
def test_choose_splits(rows, depth, expected):
    assert choose_splits(rows, depth) == min(expected, max(1, depth // MIN_CHUNK))
    assert -(-rows // BLOCK_M) * choose_splits(rows, depth) <= max(TARGET_PROGRAMS, -(-rows // BLOCK_M))


def test_op_eager_and_fake():
    a, b = operands(5, 512, 24, torch.bfloat16, seed=3)
    out = torch.ops.dsv4.skinny_mm_partials(a, b, 2)
    assert_partials_close(out, a, b, 2)
    with FakeTensorMode() as mode:
        fake = torch.ops.dsv4.skinny_mm_partials(mode.from_tensor(a), mode.from_tensor(b), 3)
    assert fake.shape == (3, 5, 24) and fake.dtype == torch.float32


@pytest.mark.parametrize("a, b, splits, error, message", [
    (torch.randn(2, 8), torch.randn(8, 4, dtype=torch.float64), 1, ValueError, "b must be float32"),
    (torch.randn(2, 8).to(torch.int32), torch.randn(8, 4), 1, ValueError, "a must be float32, bfloat16"),
    (torch.randn(2, 8), torch.randn(9, 4), 1, ValueError, "disagree on K"),
    (torch.randn(2, 8), torch.randn(8, MAX_COLUMNS + 1), 1, ValueError, "at most"),
    (torch.randn(2, 8, 1), torch.randn(8, 4), 1, ValueError, "a must be 2-D"),
    (torch.randn(2, 8), torch.randn(8, 4), 0, ValueError, "splits must be an int >= 1"),
])
def test_bad_arguments_are_named(a, b, splits, error, message):
    with pytest.raises(error, match=message):
        torch.ops.dsv4.skinny_mm_partials(a, b, splits)
