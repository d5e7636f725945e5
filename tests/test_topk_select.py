"""kernels/topk_select.py: the chunked row top-k (interpreter on CPU) against torch.topk.

Small chunks (16-64 slots) make short rows span many chunk programs, and a small candidate
cap forces the whole-row fallback, so every path runs at interpreter-friendly sizes.
"""
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_compile.kernels import topk_select as sel


def assert_row_topk(out, scores, lens, topk):
    """-1 exactly past min(len, topk); distinct slots < len; the selected scores equal
    torch.topk's over the valid prefix exactly (the kernels copy scores, never compute them,
    so ties may pick other slots but never other values)."""
    batch, tokens, _ = scores.shape
    assert out.shape == (batch, tokens, topk) and out.dtype == torch.int32
    for b in range(batch):
        for t in range(tokens):
            n = int(lens[b, t])
            count = min(n, topk)
            row = out[b, t]
            assert bool((row[count:] == -1).all()), f"-1 placement in row {b, t}: {row}"
            chosen = row[:count].long()
            assert bool((chosen >= 0).all()) and bool((chosen < n).all()), f"slot >= len {b, t}"
            assert chosen.unique().numel() == count, f"repeated slot in row {b, t}"
            got = scores[b, t, chosen].sort(descending=True).values
            want = scores[b, t, :n].topk(count).values
            assert torch.equal(got, want), f"row {b, t}: {got} != {want}"


def make_scores(kind, shape, gen):
    """Random scores of one distribution: gaussian, few distinct values (ties), one sink per
    row (50 sigma: the bins stop at mean + 8 sigma), one huge outlier (1e30: the spread
    overflows, the bins stretch and the whole-row fallback runs), or all equal."""
    x = torch.randn(shape, generator=gen)
    if kind == "ties":
        x = torch.randint(-2, 3, shape, generator=gen).float()
    elif kind == "sink":
        x[..., 0] = 50.0
    elif kind == "outlier":
        x[..., 0] = 1e30
    elif kind == "constant":
        x = torch.full(shape, 0.25)
    return x


@pytest.fixture
def allocated(monkeypatch):
    """Every tensor torch.empty returns during the test, in order (the launcher's buffers)."""
    tensors = []
    empty = torch.empty

    def recording_empty(*args, **kwargs):
        tensors.append(empty(*args, **kwargs))
        return tensors[-1]

    monkeypatch.setattr(torch, "empty", recording_empty)
    return tensors


@st.composite
def select_cases(draw):
    batch = draw(st.integers(1, 2))
    tokens = draw(st.integers(1, 2))
    chunk = draw(st.sampled_from([16, 32, 64]))
    slots = draw(st.integers(1, 12)) * 32 + draw(st.sampled_from([0, 7]))
    topk = draw(st.sampled_from([1, 5, 40, 130]))
    len_choice = st.one_of(st.integers(0, slots),
                           st.sampled_from([0, topk, topk + 1, slots, chunk, chunk + 1]))
    lens = [[min(draw(len_choice), slots) for _ in range(tokens)] for _ in range(batch)]
    kind = draw(st.sampled_from(["gaussian", "gaussian", "ties", "sink", "outlier", "constant"]))
    cap = draw(st.sampled_from([None, None, 4]))
    programs = draw(st.sampled_from([None, 1, 3]))  # chunk programs per row
    split_block = draw(st.sampled_from([sel.DEFAULT_SPLIT_BLOCK, 8]))  # 8: blocks of a chunk
    return dict(batch=batch, tokens=tokens, chunk=chunk, slots=slots, topk=topk, lens=lens,
                kind=kind, cap=cap, programs=programs, split_block=split_block,
                seed=draw(st.integers(0, 2**31 - 1)))


@given(select_cases())
def test_chunked_select_matches_torch_topk(case):
    gen = torch.Generator().manual_seed(case["seed"])
    shape = (case["batch"], case["tokens"], case["slots"])
    scores = make_scores(case["kind"], shape, gen)
    lens = torch.tensor(case["lens"], dtype=torch.int32)
    poisoned = scores.clone()  # what lies past a row's length must never be read
    poisoned[torch.arange(case["slots"]) >= lens[..., None]] = float("nan")
    out = torch.full(shape[:2] + (case["topk"],), -7, dtype=torch.int32)
    with np.errstate(over="ignore"):  # the interpreter's f32 spread of a 1e30 outlier
        sel.select_topk_triton(poisoned, lens, case["topk"], out, chunk=case["chunk"],
                               cap=case["cap"], programs=case["programs"],
                               split_block=case["split_block"])
    assert_row_topk(out, scores, lens, case["topk"])


@pytest.mark.parametrize("kind, cap", [("gaussian", None), ("ties", None), ("sink", None),
                                       ("outlier", None), ("gaussian", 8)])
def test_more_chunks_than_one_tile(kind, cap):
    """70 chunks of 16 slots, 4 programs walking 18 chunks each: the row's histograms are
    summed over five tiles of 16."""
    gen = torch.Generator().manual_seed(5)
    scores = make_scores(kind, (1, 1, 1120), gen)
    lens = torch.tensor([[1111]], dtype=torch.int32)
    out = torch.full((1, 1, 50), -7, dtype=torch.int32)
    with np.errstate(over="ignore"):  # the interpreter's f32 spread of a 1e30 outlier
        sel.select_topk_triton(scores, lens, 50, out, chunk=16, cap=cap)
    assert_row_topk(out, scores, lens, 50)


def test_a_sample_that_misses_the_top_scores_costs_time_not_correctness(allocated):
    """The bins come from SAMPLES evenly spaced scores. Here every sampled slot holds a low score
    and every other slot a higher one: all of those land in bin 0, which overflows the
    candidate list (the split kernel records -1 for the row, in the launcher's last buffer), and
    the whole-row fallback still returns the exact top-k."""
    n, topk = 4 * sel.SAMPLES + 37, 30
    sampled = torch.zeros(n, dtype=torch.bool)
    sampled[(torch.arange(sel.SAMPLES) * n) // sel.SAMPLES] = True
    gen = torch.Generator().manual_seed(13)
    scores = torch.where(sampled, -5.0 + torch.rand(n, generator=gen),
                         10.0 + torch.rand(n, generator=gen)).view(1, 1, n)
    lens = torch.tensor([[n]], dtype=torch.int32)
    out = torch.full((1, 1, topk), -7, dtype=torch.int32)
    sel.select_topk_triton(scores, lens, topk, out, chunk=512, cap=256)
    assert allocated[-1][0, 0].item() == -1  # the row's [candidates or -1, sure picks]
    assert_row_topk(out, scores, lens, topk)


def test_lens_with_strides_and_out_of_range_values():
    """lens as a strided view; lens past S or negative are clamped to [0, S]."""
    gen = torch.Generator().manual_seed(9)
    scores = torch.randn(2, 2, 100, generator=gen)
    lens = torch.tensor([[100, 500, 3], [-4, 64, 0]], dtype=torch.int32)[:, ::2]
    out = torch.full((2, 2, 20), -7, dtype=torch.int32)
    sel.select_topk_triton(scores, lens, 20, out, chunk=32)
    assert_row_topk(out, scores, lens.clamp(0, 100), 20)


@pytest.mark.parametrize("kind, fits", [("gaussian", True), ("sink", True), ("outlier", False)])
def test_threshold_bin_is_small_unless_the_spread_overflows(kind, fits, allocated):
    """The fast path: a gaussian row, and one with a 50-sigma sink, leave a few dozen
    candidates in the threshold bin (of 1111 scores, topk 50); a 1e30 outlier overflows the
    list and takes the whole-row fallback. Reads the per-row [candidates or -1, sure picks]
    the split kernel records, the last buffer the launcher allocates. The row is longer than
    SAMPLES, so its bins are placed from a sample of it."""
    assert 1111 > sel.SAMPLES
    scores = make_scores(kind, (1, 1, 1120), torch.Generator().manual_seed(5))
    lens = torch.tensor([[1111]], dtype=torch.int32)
    out = torch.full((1, 1, 50), -7, dtype=torch.int32)
    with np.errstate(over="ignore"):
        sel.select_topk_triton(scores, lens, 50, out, chunk=16, cap=200)
    candidates, above = allocated[-1][0].tolist()
    if fits:
        assert 0 < candidates <= 40 and above < 50 <= above + candidates
    else:
        assert candidates == -1
    assert_row_topk(out, scores, torch.tensor([[1111]], dtype=torch.int32), 50)
