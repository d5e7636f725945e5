"""dsv4::hc_sinkhorn (kernels/hc_sinkhorn.py) against its torch reference, on comb matrices made
the way DeepSeek-V4's hyper-connections make them: softmax(logits, -1) + eps."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dsv4_compile.kernels.hc_sinkhorn import hc_sinkhorn_reference, hc_sinkhorn_triton

EPS = 1e-6
# The kernel does the reference's divisions (correctly rounded, in f32) in the same order, but
# tl.sum may add the n entries of a row or column in another order than torch.sum. Every entry
# is divided by the same sums, so the error is relative per entry. Reversing the summation order
# in the torch loop moved entries by at most 2.3e-6 relative (20 rounds, n = 4..16, 20,000
# matrices, logits of scale 1 and 4); 1e-5 leaves a margin of 4.
RTOL = 1e-5


def make_comb(leading: tuple[int, ...], n: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*leading, n, n, generator=gen) * scale
    return torch.softmax(logits, dim=-1) + EPS


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full(like.shape, float("nan"), dtype=like.dtype).contiguous()


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("iters", [1, 2, 20])
@pytest.mark.parametrize("leading", [(5,), (2, 3), (2, 1, 3)])
def test_kernel_matches_reference(n, iters, leading):
    comb = make_comb(leading, n, seed=n * 100 + iters)
    out = hc_sinkhorn_triton(comb, iters, EPS, out=poisoned(comb))
    torch.testing.assert_close(out, hc_sinkhorn_reference(comb, iters, EPS), rtol=RTOL, atol=0)


@pytest.mark.parametrize("n", [1, 16])
def test_smallest_and_largest_matrices(n):
    comb = make_comb((3,), n, seed=n)
    out = hc_sinkhorn_triton(comb, 20, EPS, out=poisoned(comb))
    torch.testing.assert_close(out, hc_sinkhorn_reference(comb, 20, EPS), rtol=RTOL, atol=0)


@pytest.mark.parametrize("block_m, num_warps", [(1, 1), (4, 1), (32, 4)])
def test_several_programs_and_a_partial_last_block(block_m, num_warps):
    comb = make_comb((70,), 4, seed=3)  # 70 matrices: 70 programs of 1 (default), 18 of 4 or 3 of 32
    out = hc_sinkhorn_triton(comb, 20, EPS, block_m=block_m, num_warps=num_warps, out=poisoned(comb))
    torch.testing.assert_close(out, hc_sinkhorn_reference(comb, 20, EPS), rtol=RTOL, atol=0)


def test_op_takes_strided_input_and_returns_contiguous():
    wide = make_comb((2, 3), 8, seed=4)
    comb = wide[..., :4, 2:6].transpose(0, 1)  # [3, 2, 4, 4], no contiguous layout
    assert not comb.is_contiguous()
    out = torch.ops.dsv4.hc_sinkhorn(comb, 20, EPS)
    assert out.shape == comb.shape and out.is_contiguous()
    torch.testing.assert_close(out, hc_sinkhorn_reference(comb, 20, EPS), rtol=RTOL, atol=0)


def test_other_eps_and_no_matrices():
    comb = make_comb((4,), 4, seed=5)
    torch.testing.assert_close(torch.ops.dsv4.hc_sinkhorn(comb, 3, 0.01), hc_sinkhorn_reference(comb, 3, 0.01),
                               rtol=RTOL, atol=0)
    assert torch.ops.dsv4.hc_sinkhorn(torch.empty(0, 4, 4), 20, EPS).shape == (0, 4, 4)


def test_fake_tensor_shape():
    with FakeTensorMode():
        out = torch.ops.dsv4.hc_sinkhorn(torch.empty(2, 3, 4, 4), 20, EPS)
    assert out.shape == (2, 3, 4, 4) and out.dtype == torch.float32


@pytest.mark.parametrize("comb, iters, eps, error, match", [
    (torch.rand(3, 4, 4, dtype=torch.bfloat16), 2, EPS, ValueError, "comb must be float32"),
    (torch.rand(3, 4, 8), 2, EPS, ValueError, r"comb must be \[\.\.\., n, n\]"),
    (torch.rand(3, 3, 3), 2, EPS, ValueError, r"n in \(1, 2, 4, 8, 16\)"),
    (torch.rand(32, 32), 2, EPS, ValueError, "comb must be"),
    (torch.rand(4), 2, EPS, ValueError, "comb must be"),
    (torch.rand(3, 4, 4), 0, EPS, ValueError, "iters must be an int >= 1"),
    (torch.rand(3, 4, 4), 2, -1.0, ValueError, "eps must be a finite float >= 0"),
    (torch.rand(3, 4, 4), 2, float("nan"), ValueError, "eps must be a finite float >= 0"),
])
def test_bad_input(comb, iters, eps, error, match):
    with pytest.raises(error, match=match):
        torch.ops.dsv4.hc_sinkhorn(comb, iters, eps)
    with FakeTensorMode(), pytest.raises(error, match=match):  # also while tracing
        torch.ops.dsv4.hc_sinkhorn(torch.empty(comb.shape, dtype=comb.dtype), iters, eps)


def test_non_tensor_comb():
    from dsv4_compile.kernels.hc_sinkhorn import check_hc_sinkhorn_args

    with pytest.raises(TypeError, match="comb must be a tensor"):
        check_hc_sinkhorn_args([[1.0]], 2, EPS)


@pytest.mark.parametrize("out", [torch.empty(4, 4, 3).permute(2, 0, 1), torch.empty(3, 4, 4, dtype=torch.float64),
                                 torch.empty(2, 4, 4)], ids=["strided", "float64", "shape"])
def test_out_that_does_not_fit_is_refused(out):
    """A caller's `out` must be contiguous float32 of comb's shape: the kernel writes it as such."""
    comb = torch.rand(3, 4, 4)
    with pytest.raises(ValueError, match="out must be a contiguous float32"):
        hc_sinkhorn_triton(comb, 5, EPS, out=out)
