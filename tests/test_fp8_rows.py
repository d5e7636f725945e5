"""FP8 rows' staging kernel (interpreter on CPU) against `stage_fp8_rows_reference`.

The staged values are exact (e4m3 times a power of two, bf16 rope bytes), so the staged rows must
equal the reference bit for bit; rows of skipped positions and rows outside the staged range must
keep their poison (never written)."""
import pytest
import torch

from dsv4_compile.kernels.fp8_rows import STAGE_ROWS, stage_fp8_rows_launch, stage_fp8_rows_reference
from dsv4_compile.kernels.sparse_mla import _Layout, _pool_args
from test_sparse_mla import make_rows


def staged(lists, head_dim, nope, buf):
    """Stages lists [(rows, scales, idx, base)] in one launch; returns their poisoned-then-written out_idx."""
    layout = _Layout(head_dim=head_dim, nope=nope, fp8=True, has_extra=False)
    jobs = [(_pool_args(rows, scales, layout), idx, torch.full(idx.shape, 12345, dtype=torch.int32), base)
            for rows, scales, idx, base in lists]
    kernel, grid, args, meta = stage_fp8_rows_launch(jobs, head_dim, nope, buf)
    kernel[grid](*args, **meta)
    return [job[2] for job in jobs]


@pytest.mark.parametrize("nope, rope", [(64, 16), (64, 32), (128, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("strided", [False, True])
def test_staging_matches_reference(nope, rope, dtype, strided):
    """2 requests x 3 tokens x K = 2 * STAGE_ROWS + 5 positions (a partial last program) with -1 holes,
    out-of-range rows (N and beyond, and below -1) and a token that selects nothing; a base offset;
    the index list as a strided view when `strided`."""
    gen = torch.Generator().manual_seed(nope + rope + strided)
    head_dim, num_rows, k, base = nope + rope, 50, 2 * STAGE_ROWS + 5, 7
    rows, scales = make_rows(num_rows, head_dim, "fp8", gen, rope)
    idx = torch.randint(0, num_rows, (2, 3, k), generator=gen, dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=gen) < 0.2] = -1
    idx[0, 1, :4] = torch.tensor([num_rows, num_rows + 9, -7, 2**31 - 1], dtype=torch.int32)
    idx[1, 2] = -1
    if strided:
        idx = torch.stack([idx, idx.flip(2)], dim=3).flatten(2)[:, :, ::2]  # the same list, stride 2
        assert not idx.is_contiguous()
    buf = torch.full((base + idx.numel() + 3, head_dim), float("nan"), dtype=dtype)
    (out_idx,) = staged([(rows, scales, idx, base)], head_dim, nope, buf)
    want_rows, want_idx = stage_fp8_rows_reference(rows, scales, idx, head_dim, base)
    assert torch.equal(out_idx, want_idx)
    ok = want_idx.flatten() >= 0
    written = base + torch.nonzero(ok).flatten()
    assert torch.equal(buf[written].float(), want_rows[ok])
    unwritten = torch.ones(buf.shape[0], dtype=torch.bool)
    unwritten[written] = False
    assert torch.isnan(buf[unwritten].float()).all()
    assert int(unwritten[:base].sum()) == base and int(unwritten[base + idx.numel():].sum()) == 3


@pytest.mark.parametrize("widths", [(9, 2 * STAGE_ROWS + 3), (STAGE_ROWS, 1), (13, 0)])
def test_two_lists_stage_in_one_launch(widths):
    """Two pools of different sizes, strides and list widths in one launch: each list's rows land at
    its own base and its staged indices point there; an empty second list stages nothing."""
    gen = torch.Generator().manual_seed(sum(widths))
    nope, rope = 128, 64
    head_dim = nope + rope
    pools = [make_rows(n, head_dim, "fp8", gen, rope) for n in (30, 70)]
    lists = []
    base = 0
    for (rows, scales), width in zip(pools, widths):
        idx = torch.randint(-1, rows.shape[0] + 2, (2, 3, width), generator=gen, dtype=torch.int32)
        lists.append((rows, scales, idx, base))
        base += idx.numel()
    buf = torch.full((base + 1, head_dim), float("nan"), dtype=torch.bfloat16)
    got = staged(lists, head_dim, nope, buf)
    for (rows, scales, idx, start), out_idx in zip(lists, got):
        want_rows, want_idx = stage_fp8_rows_reference(rows, scales, idx, head_dim, start)
        assert torch.equal(out_idx, want_idx)
        ok = want_idx.flatten() >= 0
        assert torch.equal(buf[start + torch.nonzero(ok).flatten()].float(), want_rows[ok])
    assert torch.isnan(buf[-1].float()).all()


def test_reference_dequantises_each_selected_row():
    """The reference itself on a hand-made row: e4m3 codes times 2^(e - 127) per 64 dims, rope bytes as
    bf16; a skipped position gives -1 and a zero row."""
    nope, rope = 128, 64
    rows = torch.zeros(2, nope + 2 * rope, dtype=torch.uint8)
    rows[1, :nope] = torch.full((nope,), 1.5).to(torch.float8_e4m3fn).view(torch.uint8)
    rows[1, nope:] = torch.full((rope,), -2.25).to(torch.bfloat16).view(torch.uint8)
    scales = torch.tensor([[127, 127, 0], [128, 125, 0]], dtype=torch.uint8)
    got, got_idx = stage_fp8_rows_reference(rows, scales, torch.tensor([[[1, -1]]], dtype=torch.int32), nope + rope, 4)
    assert got_idx.tolist() == [[[4, -1]]]
    assert torch.equal(got[0], torch.cat([torch.full((64,), 3.0), torch.full((64,), 0.375), torch.full((64,), -2.25)]))
    assert torch.equal(got[1], torch.zeros(nope + rope))
