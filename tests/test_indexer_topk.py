"""dsv4::indexer_topk: the Triton kernels (interpreter on CPU) against the torch reference."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_compile.kernels import indexer_topk as mod

PAGE = mod.PAGE_SIZE
FP8 = torch.float8_e4m3fn


def make_keys(pages, dim, k_dtype, gen, packed=True):
    """k_cache [P, 64, D] (+ k_scale [P, 64] f32 for fp8) as strided views into packed pages:
    fp8 pages are SGLang's byte layout [64 * D fp8 | 64 f32 scales]; others carry padding."""
    values = torch.randn(pages, PAGE, dim, generator=gen)
    if k_dtype == FP8:
        row = PAGE * dim + PAGE * 4
        buf = torch.empty(pages, row, dtype=torch.uint8)
        k_cache = buf[:, : PAGE * dim].view(FP8).view(pages, PAGE, dim)
        k_scale = buf[:, PAGE * dim:].view(torch.float32)
        k_cache.copy_(values.to(FP8))
        k_scale.copy_(torch.rand(pages, PAGE, generator=gen) + 0.5)
        return k_cache, k_scale
    pad = 16 if packed else 0
    base = torch.empty(pages, PAGE, dim + pad, dtype=k_dtype)
    k_cache = base[:, :, :dim]
    k_cache.copy_(values.to(k_dtype))
    return k_cache, None


def assert_topk_valid(idx, scores, lens, topk):
    """Properties of a valid answer, against reference scores [B, T, S] (-inf past lens):
    -1 exactly past min(len, topk); every slot < len, no repeats; the selected scores equal the
    reference top-k scores as a multiset. Tolerance: both sides accumulate f32 products of
    exactly-representable operands in different orders (about 1e-6 relative); near-ties may
    swap slots whose scores differ by that much, so 1e-4 of the row's largest |score|."""
    batch, tokens, slots = scores.shape
    assert idx.shape == (batch, tokens, topk) and idx.dtype == torch.int32
    count = lens.long().clamp(0, slots).clamp(max=topk)
    rank = torch.arange(topk)
    assert torch.equal(idx >= 0, rank < count[..., None]), "-1 placement"
    assert torch.equal(idx == -1, rank >= count[..., None]), "invalid sentinel"
    assert bool((idx < lens[..., None]).all()), "slot >= len returned"
    for b in range(batch):
        for t in range(tokens):
            n = int(count[b, t])
            chosen = idx[b, t, :n].long()
            assert chosen.unique().numel() == n, "repeated slot"
            got = scores[b, t, chosen].sort(descending=True).values
            want = scores[b, t].topk(n).values if n else got
            assert bool(torch.isfinite(got).all())
            tol = 1e-4 * float(want.abs().max()) + 1e-6 if n else 0.0
            torch.testing.assert_close(got, want, rtol=0, atol=tol)


@st.composite
def indexer_cases(draw):
    batch = draw(st.integers(1, 3))
    tokens = draw(st.integers(1, max(1, 6 // batch)))
    heads = draw(st.sampled_from([4, 8, 12, 32]))
    dim = draw(st.sampled_from([16, 32, 48]))
    max_pages = draw(st.integers(1, 4))
    pages = draw(st.integers(1, 6))
    slots = max_pages * PAGE
    topk = draw(st.sampled_from([1, 3, 16, 50, 64, 200, 2048]))
    len_choice = st.one_of(
        st.integers(0, slots), st.sampled_from([0, 1, slots, PAGE, topk, topk + 1]),
        st.builds(lambda m: m * PAGE, st.integers(0, max_pages)))
    lens = [[min(draw(len_choice), slots) for _ in range(tokens)] for _ in range(batch)]
    q_dtype = draw(st.sampled_from([torch.bfloat16, FP8, torch.float32]))
    k_dtype = draw(st.sampled_from([FP8, torch.bfloat16, torch.float32]))
    strided_q = draw(st.booleans())
    chunk = draw(st.sampled_from([32, mod.DEFAULT_CHUNK]))  # 32: rows span several chunks
    split_block = draw(st.sampled_from([16, mod.DEFAULT_SPLIT_BLOCK]))
    id_ahead = draw(st.booleans())
    scale_ahead = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(batch=batch, tokens=tokens, heads=heads, dim=dim, max_pages=max_pages,
                pages=pages, topk=topk, lens=lens, q_dtype=q_dtype, k_dtype=k_dtype,
                strided_q=strided_q, chunk=chunk, split_block=split_block,
                id_ahead=id_ahead, scale_ahead=scale_ahead, seed=seed)


def build(case):
    gen = torch.Generator().manual_seed(case["seed"])
    b, t, h, d = case["batch"], case["tokens"], case["heads"], case["dim"]
    q = torch.randn(b, t, h, d, generator=gen).to(case["q_dtype"])
    if case["strided_q"]:  # [B, T, H, D] view of a [B, H, T, D] buffer
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    weights = torch.randn(b, t, h, generator=gen)
    k_cache, k_scale = make_keys(case["pages"], d, case["k_dtype"], gen)
    lens = torch.tensor(case["lens"], dtype=torch.int32)
    # Shared and scattered pages; columns past a request's valid pages point nowhere.
    page_table = torch.randint(0, case["pages"], (b, case["max_pages"]), generator=gen,
                               dtype=torch.int32)
    valid_pages = (lens.long().amax(dim=1) + PAGE - 1) // PAGE
    past = torch.arange(case["max_pages"]) >= valid_pages[:, None]
    page_table[past] = case["pages"] + 1000
    return q, weights, k_cache, k_scale, page_table, lens


@given(indexer_cases())
def test_kernel_matches_reference(case):
    args = build(case)
    topk = case["topk"]
    b, t = case["batch"], case["tokens"]
    slots = case["max_pages"] * PAGE
    out = torch.full((b, t, topk), -7, dtype=torch.int32)  # poison: every element is written
    workspace = torch.full((b, t, slots), float("nan"))  # unwritten scores must not be read
    idx, _ = mod.indexer_topk_triton(*args, topk, out=out, workspace=workspace,
                                     chunk=case["chunk"], split_block=case["split_block"],
                                     id_ahead=case["id_ahead"],
                                     scale_ahead=case["scale_ahead"])
    assert idx.data_ptr() == out.data_ptr()
    scores = mod.indexer_scores_reference(*args)
    assert_topk_valid(idx, scores, args[5], topk)
    # The op (value checks + dispatch) gives a valid answer too, and so does the reference.
    assert_topk_valid(torch.ops.dsv4.indexer_topk(*args, topk), scores, args[5], topk)
    assert_topk_valid(mod.indexer_topk_reference(*args, topk), scores, args[5], topk)


@pytest.mark.parametrize("id_ahead, scale_ahead", [(True, False), (False, False), (True, True)])
@given(st.integers(0, 2**31 - 1), st.sampled_from([FP8, torch.bfloat16, torch.float32]))
def test_scores_match_reference(id_ahead, scale_ahead, seed, k_dtype):
    """The scoring kernel writes the reference scores for s < lens on the pages it reads, and
    reads no page for a request whose tokens all have lens <= topk."""
    case = dict(batch=3, tokens=2, heads=8, dim=32, max_pages=3, pages=5, topk=10,
                lens=[[192, 70], [5, 150], [8, 3]], q_dtype=torch.bfloat16, k_dtype=k_dtype,
                strided_q=False, seed=seed)
    args = build(case)
    ws = torch.full((3, 2, 3 * PAGE), float("nan"))
    mod.indexer_scores_triton(*args, 10, workspace=ws, id_ahead=id_ahead, scale_ahead=scale_ahead)
    ref = mod.indexer_scores_reference(*args)
    for (b, t), n in {(0, 0): 192, (0, 1): 70, (1, 0): 5, (1, 1): 150}.items():
        # f32 products of bf16/fp8 operands are exact; only the summation order differs.
        torch.testing.assert_close(ws[b, t, :n], ref[b, t, :n], rtol=1e-5, atol=1e-5)
        assert bool(ws[b, t, n:].isnan().all()), "score written past lens"
    assert bool(ws[2].isnan().all()), "scores written for a request that needs none"


def test_many_tokens_share_each_page():
    """T * H above one dot's columns (H=128, T=3): token blocks loop inside the page loop."""
    case = dict(batch=2, tokens=3, heads=128, dim=16, max_pages=2, pages=3, topk=20,
                lens=[[128, 100, 37], [64, 128, 90]], q_dtype=torch.bfloat16, k_dtype=FP8,
                strided_q=True, seed=3)
    args = build(case)
    idx, _ = mod.indexer_topk_triton(*args, 20)
    assert_topk_valid(idx, mod.indexer_scores_reference(*args), args[5], 20)


@pytest.mark.parametrize("scale_ahead", [True, False])
@pytest.mark.parametrize("chunk", [mod.DEFAULT_CHUNK, 16])
@pytest.mark.parametrize("k_dtype", [FP8, torch.bfloat16])
def test_pages_past_the_length_are_never_read(k_dtype, chunk, scale_ahead):
    """NaN in every physical page no valid logical page references, in the slots of the last
    valid page past the length, and out-of-range ids past the valid pages: same answer (with
    16-slot chunks, the rows span up to 10 chunk programs)."""
    gen = torch.Generator().manual_seed(7)
    batch, tokens, heads, dim, max_pages, topk = 2, 2, 8, 32, 5, 24
    pages = batch * max_pages + 3
    q = torch.randn(batch, tokens, heads, dim, generator=gen).bfloat16()
    weights = torch.randn(batch, tokens, heads, generator=gen)
    k_cache, k_scale = make_keys(pages, dim, k_dtype, gen)
    lens = torch.tensor([[150, 100], [64, 30]], dtype=torch.int32)  # 3 and 1 valid pages
    page_table = torch.randperm(pages, generator=gen)[: batch * max_pages]
    page_table = page_table.view(batch, max_pages).to(torch.int32)
    clean = mod.indexer_topk_triton(q, weights, k_cache, k_scale, page_table, lens, topk,
                                    chunk=chunk, scale_ahead=scale_ahead)[0]
    assert_topk_valid(clean, mod.indexer_scores_reference(
        q, weights, k_cache, k_scale, page_table, lens), lens, topk)

    referenced = torch.zeros(pages, dtype=torch.bool)
    referenced[page_table[0, :3].long()] = True
    referenced[page_table[1, :1].long()] = True
    # e4m3fn has no inf; 0x7F is its NaN.
    raw, nan = (k_cache.view(torch.uint8), 0x7F) if k_dtype == FP8 else (k_cache, float("nan"))
    raw[~referenced] = nan
    raw[page_table[0, 2].long(), 150 - 2 * PAGE:] = nan
    if k_scale is not None:
        k_scale[~referenced] = float("nan")
    page_table[0, 3:] = pages + 1000
    page_table[1, 1:] = -5
    poisoned = mod.indexer_topk_triton(q, weights, k_cache, k_scale, page_table, lens, topk,
                                       chunk=chunk, scale_ahead=scale_ahead)[0]
    assert torch.equal(poisoned, clean)
    assert torch.equal(torch.ops.dsv4.indexer_topk(q, weights, k_cache, k_scale, page_table,
                                                   lens, topk), clean)


@pytest.mark.parametrize("chunk", [mod.DEFAULT_CHUNK, 16])
def test_all_ties_take_exactly_topk(chunk):
    """Identical keys give identical scores: exactly topk distinct slots, none past len."""
    q = torch.randn(1, 1, 4, 16)
    weights = torch.rand(1, 1, 4)
    k_cache = torch.randn(1, PAGE, 16)[:, :1].expand(1, PAGE, 16).contiguous()
    page_table = torch.zeros(1, 3, dtype=torch.int32)
    lens = torch.tensor([[150]], dtype=torch.int32)
    idx, _ = mod.indexer_topk_triton(q, weights, k_cache, None, page_table, lens, 40,
                                     chunk=chunk)
    assert_topk_valid(idx, mod.indexer_scores_reference(q, weights, k_cache, None, page_table,
                                                        lens), lens, 40)


def test_opcheck_and_fake():
    case = dict(batch=1, tokens=2, heads=4, dim=16, max_pages=2, pages=2, topk=8,
                lens=[[70, 5]], q_dtype=torch.bfloat16, k_dtype=torch.bfloat16,
                strided_q=False, seed=1)  # opcheck's schema mode cannot compare fp8 on CPU
    args = build(case)
    torch.library.opcheck(torch.ops.dsv4.indexer_topk.default, (*args, 8),
                          test_utils=("test_schema", "test_faketensor"))


def _good_args():
    case = dict(batch=2, tokens=2, heads=4, dim=16, max_pages=2, pages=3, topk=8,
                lens=[[70, 5], [128, 0]], q_dtype=torch.bfloat16, k_dtype=FP8,
                strided_q=False, seed=2)
    return list(build(case)) + [8]


def _replace(i, value):
    args = _good_args()
    args[i] = value(args) if callable(value) else value
    return args


@pytest.mark.parametrize("args, match", [
    (_replace(6, 0), "topk"),
    (_replace(6, 2049), "topk"),
    (_replace(6, -3), "topk"),
    (_replace(0, lambda a: torch.randn(2, 2, 4, 40).bfloat16()), "head dim"),
    (_replace(0, lambda a: torch.randn(2, 2, 4, 272).bfloat16()), "head dim"),
    (_replace(0, lambda a: torch.randn(2, 2, 2, 16).bfloat16()), "heads"),
    (_replace(0, lambda a: torch.randn(2, 2, 4, 16).half()), "q dtype"),
    (_replace(2, lambda a: a[2].view(torch.int8)), "k_cache dtype"),
    (_replace(2, lambda a: torch.randn(3, 32, 16).to(FP8)), "k_cache"),
    (_replace(3, None), "k_scale"),
    (_replace(3, lambda a: torch.rand(3, 32)), "k_scale"),
    (_replace(1, lambda a: torch.randn(2, 2, 5)), "weights"),
    (_replace(1, lambda a: torch.randn(1, 2, 4)), "weights"),
    (_replace(5, lambda a: torch.zeros(2, 3, dtype=torch.int32)), "lens"),
    (_replace(5, lambda a: a[5].long()), "lens"),
    (_replace(4, lambda a: torch.zeros(3, 2, dtype=torch.int32)), "page_table"),
    (_replace(4, lambda a: a[4].long()), "page_table"),
    (_replace(5, lambda a: torch.tensor([[129, 5], [1, 1]], dtype=torch.int32)), "lens"),
    (_replace(5, lambda a: torch.tensor([[-1, 5], [1, 1]], dtype=torch.int32)), "lens"),
    (_replace(4, lambda a: torch.tensor([[0, 3], [1, 2]], dtype=torch.int32)), "page_table"),
])
def test_bad_input_raises(args, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.dsv4.indexer_topk(*args)


def test_no_query_tokens_gives_an_empty_answer():
    """T = 0 with B > 0: the op (value checks, kernels) and the reference return [B, 0, topk]."""
    case = dict(batch=2, tokens=1, heads=4, dim=16, max_pages=2, pages=3, topk=8,
                lens=[[70], [5]], q_dtype=torch.bfloat16, k_dtype=FP8, strided_q=False, seed=4)
    q, weights, k_cache, k_scale, page_table, lens = build(case)
    args = (q[:, :0], weights[:, :0], k_cache, k_scale, page_table, lens[:, :0], 8)
    assert torch.ops.dsv4.indexer_topk(*args).shape == (2, 0, 8)
    assert mod.indexer_topk_reference(*args).shape == (2, 0, 8)


_FP8_SCORING_LAUNCHES = """
import sys, torch, triton.language as tl
sys.path[:0] = ["bench"]
from bench_sparse_mla import compiled_stats, cross_compile, launch_recorder
from dsv4_compile.kernels import indexer_topk as mod
print("module", mod.__file__)
launches = []
mod._score_pages_kernel = launch_recorder(mod._score_pages_kernel, launches)
mod._dot_dtype = lambda q, k_cache: (tl.float8e4nv, None)  # fp8 q and keys, as on a GPU
"""
_FP8_SCORING_CROSS_COMPILE = _FP8_SCORING_LAUNCHES + """
for dim in (16, 32, 128):
    launches.clear()
    q = torch.zeros(1, 1, 4, dim).to(torch.float8_e4m3fn)
    mod.indexer_scores_triton(q, torch.zeros(1, 1, 4), torch.zeros(2, 64, dim).to(torch.float8_e4m3fn),
                              torch.ones(2, 64), torch.zeros(1, 2, dtype=torch.int32),
                              torch.full((1, 1), 100, dtype=torch.int32), 8)
    launch = launches[0]
    launch.meta.update(FOR_LOOPS=True)
    for cap in (90, 120):
        cross_compile(launch, cap)
        print(dim, cap, launch.meta["BLOCK_D"])
"""


def test_fp8_scoring_compiles_for_small_head_dims():
    """fp8 q with fp8 keys take an 8-bit tl.dot, whose reduction must span at least 32 values: a head
    dim of 16 is scored over 32 columns (the loads mask the rest), and compiles for sm_90 and sm_120
    (the interpreter always dots in f32, so only a compile shows this)."""
    from helpers import run_compiled_script
    rows = run_compiled_script(_FP8_SCORING_CROSS_COMPILE, mod.__file__)
    assert rows == [[str(d), str(c), str(max(d, 32))] for d in (16, 32, 128) for c in (90, 120)]


_FP8_SCORING_REGISTERS = _FP8_SCORING_LAUNCHES + """
fp8 = torch.float8_e4m3fn
for cap in (90, 120):
    mod.device_capability = lambda q: (cap // 10, cap % 10)  # the launcher's plan on that GPU
    for tokens in (1, 4):
        launches.clear()
        batch, heads, dim = 64, 64, 128
        mod.indexer_scores_triton(torch.zeros(batch, tokens, heads, dim).to(fp8), torch.zeros(batch, tokens, heads),
                                  torch.zeros(8, 64, dim).to(fp8), torch.ones(8, 64),
                                  torch.zeros(batch, 2048, dtype=torch.int32),
                                  torch.full((batch, tokens), 100, dtype=torch.int32), 512)
        launch = launches[0]
        launch.meta.update(FOR_LOOPS=True, PIN_IDS=True)
        stats = compiled_stats(launch, cap)
        print(cap, tokens, launch.meta["num_warps"], launch.meta["maxnreg"], stats["regs"], stats["spill_stores"])
"""


def test_fp8_scoring_register_caps_do_not_spill():
    """The scoring kernel's register cap with fp8 dots at real size (B=64, H=64, D=128, T=1 and 4), as
    the launcher plans it for sm_90 and sm_120, cross-compiled (ptxas -v): sm_90 takes its caps
    (FP8_SCORE_MAX_REGS) and sm_120 none, and neither spills (sm_90's caps on sm_120 spilled 124 B at
    T=1). Only a compile shows registers; the interpreter has none."""
    from helpers import run_compiled_script
    rows = run_compiled_script(_FP8_SCORING_REGISTERS, mod.__file__)
    caps = {(int(cap), int(tokens)): maxnreg for cap, tokens, _, maxnreg, _, _ in rows}
    assert caps == {(90, 1): "72", (90, 4): "128", (120, 1): "None", (120, 4): "None"}
    for cap, tokens, warps, maxnreg, regs, spills in rows:
        assert mod.fp8_score_register_cap((int(cap) // 10, int(cap) % 10), int(warps)) == (
            0 if maxnreg == "None" else int(maxnreg))
        assert int(spills) == 0, (cap, tokens, regs)
