"""dsv4::mm_sumsq and its split-K partials (kernels/rms_mm.py) against their torch references."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from dsv4_compile.kernels.rms_mm import (MAX_COLUMNS, MAX_ROWS, SPLIT_COLS, SUM_SLICES, mm_sumsq_reference,
                                         mm_sumsq_triton,
                                         num_slices, rms_mm_partials_reference, rms_mm_partials_triton,
                                         rms_mm_reference)


def assert_close_f32(got, want, bound_terms):
    """f32 sums of one slice in another order (and, on the GPU, 3xTF32 products, whose error is a few
    2**-22 of each |term|): within 1e-5 of the slice's sum of |terms| (test_pass_skinny_mm's bound)."""
    assert got.dtype == torch.float32 and got.shape == want.shape and got.is_contiguous()
    assert ((got - want).abs() <= 1e-5 * bound_terms + 1e-30).all(), (got - want).abs().max()


def make(rows, columns, depth, dtype, seed, strided=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * depth if strided else depth, generator=gen).to(dtype)
    x = x[:, ::2] if strided else x
    weight = torch.randn(columns, depth, generator=gen) * depth ** -0.5
    return x, weight


def poisoned(rows, columns, depth):
    slices = num_slices(depth)
    return (torch.full((slices, rows, columns), float("nan")), torch.full((slices, rows), float("nan")))


def check(x, weight):
    """The partials and the op's totals (both launches) against their references."""
    prod, sumsq = rms_mm_partials_triton(x, weight, *poisoned(x.shape[0], weight.shape[0], x.shape[1]))
    want_prod, want_sumsq = rms_mm_partials_reference(x, weight)
    abs_prod, abs_sq = rms_mm_partials_reference(x.float().abs(), weight.abs())
    assert_close_f32(prod, want_prod, abs_prod)
    assert_close_f32(sumsq, want_sumsq, abs_sq)
    rows, columns = x.shape[0], weight.shape[0]
    total, total_sq = mm_sumsq_triton(x, weight, torch.full((rows, columns), float("nan")),
                                      torch.full((rows,), float("nan")))
    want_total, want_total_sq = mm_sumsq_reference(x, weight)
    assert_close_f32(total, want_total, abs_prod.sum(0))
    assert_close_f32(total_sq, want_total_sq, abs_sq.sum(0))
    return total, total_sq


@given(rows=st.integers(1, MAX_ROWS), columns=st.integers(1, MAX_COLUMNS), depth=st.integers(1, 3 * SPLIT_COLS + 5),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), strided=st.booleans(),
       seed=st.integers(0, 2**16))
def test_kernel_matches_reference(rows, columns, depth, dtype, strided, seed):
    check(*make(rows, columns, depth, dtype, seed, strided))


@pytest.mark.parametrize("rows, columns", [(64, 24), (1, 24), (3, 4)])
def test_mhc_size_finishes_to_the_normed_product(rows, columns):
    """[M, 16384] bf16 streams, 128 slices; the pass's finish of the totals equals rmsnorm(x) @ w^T."""
    x, weight = make(rows, columns, 16384, torch.bfloat16, seed=rows)
    prod, sumsq = check(x, weight)
    got = prod * torch.rsqrt(sumsq / 16384 + 1e-6)[:, None]
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert_close_f32(got, rms_mm_reference(x, weight, 1e-6), normed.abs() @ weight.abs().t())


def test_more_slices_than_one_summing_load():
    """SUM_SLICES + 3 slices (and a short last one): the summing launch loops over its loads."""
    check(*make(3, 5, SPLIT_COLS * (SUM_SLICES + 3) - 7, torch.bfloat16, seed=7))


def test_reference_slices():
    """The spec's slices: columns [s * SPLIT_COLS, (s + 1) * SPLIT_COLS), the last one short."""
    x, weight = make(2, 3, SPLIT_COLS + 7, torch.float32, seed=0)
    prod, sumsq = rms_mm_partials_reference(x, weight)
    assert prod.shape == (2, 2, 3) and sumsq.shape == (2, 2)
    torch.testing.assert_close(prod[1], x[:, SPLIT_COLS:] @ weight[:, SPLIT_COLS:].t(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sumsq[0], x[:, :SPLIT_COLS].pow(2).sum(-1), rtol=0, atol=1e-5)


def test_op_fake_and_empty_sizes():
    x, weight = make(3, 5, 300, torch.bfloat16, seed=1)
    prod, sumsq = torch.ops.dsv4.mm_sumsq(x, weight)
    assert prod.shape == (3, 5) and sumsq.shape == (3,)
    with FakeTensorMode() as mode:
        fake = torch.ops.dsv4.mm_sumsq(mode.from_tensor(x), mode.from_tensor(weight))
    assert [tuple(t.shape) for t in fake] == [(3, 5), (3,)] and all(t.dtype == torch.float32 for t in fake)
    assert torch.ops.dsv4.mm_sumsq(x[:0], weight)[0].shape == (0, 5)
    no_depth = torch.ops.dsv4.mm_sumsq(x[:, :0], weight[:, :0])
    assert torch.equal(no_depth[0], torch.zeros(3, 5)) and torch.equal(no_depth[1], torch.zeros(3))


@pytest.mark.parametrize("x, weight, error, name", [
    (torch.zeros(2, 8, dtype=torch.int32), torch.zeros(3, 8), TypeError, "x must be one of"),
    (torch.zeros(2, 8), torch.zeros(3, 8, dtype=torch.bfloat16), TypeError, "weight must be float32"),
    (torch.zeros(2, 8, 1), torch.zeros(3, 8), ValueError, "x must be 2-D"),
    (torch.zeros(2, 8), torch.zeros(3, 9), ValueError, "must share K"),
    (torch.zeros(MAX_ROWS + 1, 8), torch.zeros(3, 8), ValueError, f"at most {MAX_ROWS} rows"),
    (torch.zeros(2, 8), torch.zeros(MAX_COLUMNS + 1, 8), ValueError, f"1 to {MAX_COLUMNS} rows"),
    (torch.zeros(2, 8), torch.zeros(0, 8), ValueError, f"1 to {MAX_COLUMNS} rows"),
])
def test_bad_input(x, weight, error, name):
    with pytest.raises(error, match=name):
        torch.ops.dsv4.mm_sumsq(x, weight)


def test_row_offsets_past_32_bits():
    """Checked on the meta device (no storage): the fake runs the same checks as the op."""
    x = torch.empty_strided((2, 8), (2**31, 1), device="meta")
    with pytest.raises(ValueError, match="x's row offsets"):
        torch.ops.dsv4.mm_sumsq(x, torch.empty(3, 8, device="meta"))
