"""dsv4::weight_stream_mm (kernels/weight_stream_mm.py) against its torch reference."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from dsv4_compile.kernels.weight_stream_mm import MAX_ROWS, weight_stream_mm_reference, weight_stream_mm_triton


def assert_close_rounded(got, want, x, weight):
    """Both sides accumulate in f32 and round once to the dtype, in different orders. Two roundings
    of nearly equal sums differ by at most one unit in the last place (eps * |want| bounds it), and
    the f32 sums differ by their order's rounding, ~sqrt(K) * 2**-24 of sum_k |x_k w_k| for random
    signs (1e-5 of that sum leaves a margin, as in test_pass_skinny_mm)."""
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    scale = x.float().abs() @ weight.float().abs().t()
    bound = torch.finfo(want.dtype).eps * want.float().abs() + 1e-5 * scale
    assert ((got.float() - want.float()).abs() <= bound).all(), (got.float() - want.float()).abs().max()


def make(rows, columns, depth, dtype, seed, weight_layout="rows"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=gen).to(dtype)
    if weight_layout == "rows":
        weight = torch.randn(columns, depth, generator=gen).to(dtype)
    elif weight_layout == "transposed":  # a [K, N] tensor seen as [N, K]
        weight = torch.randn(depth, columns, generator=gen).to(dtype).t()
    else:  # every other column of a wider tensor
        weight = torch.randn(columns, 2 * depth, generator=gen).to(dtype)[:, ::2]
    return x, weight * depth ** -0.5


def poisoned(rows, columns, dtype):
    return torch.full((rows, columns), float("nan"), dtype=dtype)


@given(rows=st.integers(1, MAX_ROWS), columns=st.integers(1, 300), depth=st.integers(1, 300),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       layout=st.sampled_from(["rows", "transposed", "strided"]), seed=st.integers(0, 2**16))
def test_kernel_matches_reference(rows, columns, depth, dtype, layout, seed):
    x, weight = make(rows, columns, depth, dtype, seed, layout)
    got = weight_stream_mm_triton(x, weight, out=poisoned(rows, columns, dtype))
    assert_close_rounded(got, weight_stream_mm_reference(x, weight), x, weight)


@pytest.mark.parametrize("rows", [1, 17, 64])
def test_lm_head_depth_and_a_partial_last_block(rows):
    # 4096 = 32 full 128-deep steps (the LM head's K); 130 columns end in a 2-column block
    x, weight = make(rows, 130, 4096, torch.bfloat16, seed=rows)
    got = weight_stream_mm_triton(x, weight, out=poisoned(rows, 130, torch.bfloat16))
    assert_close_rounded(got, weight_stream_mm_reference(x, weight), x, weight)


def test_op_and_empty_sizes():
    x, weight = make(3, 40, 64, torch.bfloat16, seed=1)
    assert_close_rounded(torch.ops.dsv4.weight_stream_mm(x, weight), weight_stream_mm_reference(x, weight), x, weight)
    assert torch.ops.dsv4.weight_stream_mm(x[:0], weight).shape == (0, 40)
    assert torch.ops.dsv4.weight_stream_mm(x, weight[:0]).shape == (3, 0)
    no_depth = torch.ops.dsv4.weight_stream_mm(x[:, :0], weight[:, :0])
    assert no_depth.shape == (3, 40) and (no_depth == 0).all()


def test_fake_gives_the_output_shape():
    with FakeTensorMode():
        out = torch.ops.dsv4.weight_stream_mm(torch.empty(5, 96, dtype=torch.float16),
                                              torch.empty(700, 96, dtype=torch.float16))
    assert out.shape == (5, 700) and out.dtype == torch.float16


@pytest.mark.parametrize("x, weight, error, words", [
    (torch.zeros(2, 8), torch.zeros(4, 8), TypeError, "x must be one of"),
    (torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.float16), TypeError, "one dtype"),
    (torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 9, dtype=torch.bfloat16), ValueError, "share K"),
    (torch.zeros(MAX_ROWS + 1, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16), ValueError,
     f"at most {MAX_ROWS} rows"),
    (torch.zeros(2, 2, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16), ValueError, "x must be 2-D"),
    (torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8), TypeError, "weight must be one of"),
    (torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(1, 4, 8, dtype=torch.bfloat16), ValueError,
     "weight must be 2-D"),
    # offsets past 2**31 elements (meta tensors: nothing is allocated)
    (torch.empty(2, 2**20, dtype=torch.bfloat16, device="meta"),
     torch.empty_strided((4, 2**20), (1, 4096), dtype=torch.bfloat16, device="meta"), ValueError, "weight's K offsets"),
    (torch.empty_strided((64, 8), (2**26, 1), dtype=torch.bfloat16, device="meta"),
     torch.empty(4, 8, dtype=torch.bfloat16, device="meta"), ValueError, "x's row offsets"),
    (torch.empty(64, 8, dtype=torch.bfloat16, device="meta"),
     torch.empty(2**26, 8, dtype=torch.bfloat16, device="meta"), ValueError, "the output's row offsets"),
])
def test_bad_input_is_refused_naming_the_argument(x, weight, error, words):
    with pytest.raises(error, match=words):
        torch.ops.dsv4.weight_stream_mm(x, weight)


@pytest.mark.parametrize("out", [torch.empty(3, 41, dtype=torch.bfloat16), torch.empty(3, 40),
                                 torch.empty(40, 3, dtype=torch.bfloat16).t()])
def test_a_wrong_out_is_refused(out):
    x, weight = make(3, 40, 64, torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        weight_stream_mm_triton(x, weight, out=out)


def test_a_row_major_weight_of_any_row_stride_is_taken():
    """Only the weight's K offsets are 32-bit: a weight seen through a row stride past 2**31 / N is fine."""
    x = torch.empty(64, 8, dtype=torch.bfloat16, device="meta")
    weight = torch.empty_strided((129280, 8), (2**20, 1), dtype=torch.bfloat16, device="meta")
    assert torch.ops.dsv4.weight_stream_mm(x, weight).shape == (64, 129280)
