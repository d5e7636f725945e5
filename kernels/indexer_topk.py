"""Length-bounded lightning-indexer top-k: `torch.ops.dsv4.indexer_topk`.

score[s] = k_scale[s] * sum_h weights[h] * relu(q[h] . k[s]) over the logical slots s < lens[b, t]
of a paged key cache (pages of 64 slots); the op returns the logical slot numbers of a top-`topk`
set, -1 past min(lens[b, t], topk), in no particular order.

Kernels, all on static grids (capture-safe):
  1. `_score_pages_kernel`, grid (B, splits): program (b, split) walks the logical pages
     split, split + splits, ... below the request's last NEEDED page, reads each key page once
     and scores it for all T query tokens of the request, writing f32 scores into a workspace
     [B, T, max_pages * 64] only for s < lens[b, t]. A token with lens <= topk needs no score
     (its answer is every visible slot), so it does not extend the pages read.
  2. the row top-k of kernels/topk_select.py: each row is split into chunks handled by separate
     programs (bin histograms over bins placed from a sample of the row, then a compaction of
     the sure picks and of the threshold bin's candidates), and one program per row finishes
     the selection among the few candidates.
Nothing past a request's valid pages is read; the workspace is never cleared.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_compile.kernels._runtime import device_capability, triton_runs_on
from dsv4_compile.kernels.topk_select import (DEFAULT_CHUNK, DEFAULT_SELECT_WARPS,
                                              DEFAULT_SPLIT_BLOCK, select_topk_triton)

PAGE_SIZE = 64
MAX_TOPK = 2048
MIN_HEADS, MAX_HEADS = 4, 128
MAX_HEAD_DIM = 256
_Q_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float32)
_K_DTYPES = (torch.float8_e4m3fn, torch.bfloat16, torch.float32)
# Register cap of the scoring kernel with fp8 dots, by compute capability and warps. Chosen on
# sm_90 (H=64, 2-3 stages) when T=1 at 4 warps took 79 uncapped (72 capped: 7 programs an SM
# instead of 6) and T=4 at 8 warps 150-154 (128: 2 instead of 1); bf16 dots spill 200+ B under
# them, so they run uncapped. Cross-compiled again in the twenty-ninth session for sm_90
# (B=64, H=64, D=128, 3 stages), it takes 72 / 127 uncapped, within the caps. Other GPUs run uncapped:
# under sm_90's caps sm_120 spills 124 B at T=1 and 8 B at T=4, sm_100 36 and 252 B, sm_89 88 and
# 24 B, and uncapped none spills; on sm_120 and sm_89 (about 100 KB of shared memory an SM) the
# kernel's 25 KB (T=1) and 57 KB (T=4) of shared memory hold an SM to 3 and 1 programs anyway.
FP8_SCORE_MAX_REGS = {(9, 0): {4: 72, 8: 128}}
# The scoring loop loads the next page's id while it scores the current page (the sm_90 TTGIR
# of the plain loop loads it right before the next page's key copy, exposing its latency).
DEFAULT_ID_AHEAD = True
# Whether the scoring loop loads the next page's key scales while it scores the current page
# (ids then go two pages ahead). Off, the sm_90 SASS (B=64, H=64, fp8, T=1 and 4) issues the
# scale load in the iteration that uses it (Triton's pipeliner only buffers loads that feed a
# dot) and, at T=1, moves each loaded id to a uniform register right after its load: two
# waits a page. On, every load of the loop is first used in the next iteration, 140-250
# instructions later. H200 (bench_indexer.py --sweep, B=64, 128K, fp8, bench/RESULTS.md "Sixth
# session"): T=1 116.3 us vs 121.0 off, T=4 270.6 vs 271.1; scoring alone (--sweep-score) 78.0 vs
# 81.8 and 176.6 vs 180.1 (with pin_ids; 79.9 / 210.9 without).
DEFAULT_SCALE_AHEAD = True
# With SCALE_AHEAD, the first use of each loaded page id comes after a CTA barrier: without it
# ptxas may hoist that use to the top of the next step, right behind the id load (at T=4 it
# does: 21 instructions of cover instead of 244).
DEFAULT_PIN_IDS = True
# Key pages in flight per scoring program with fp8 dots, minus one (2: one page loads while one
# is scored); without the id loaded ahead, Triton's pipeliner cannot buffer more than one page.
# Other dots keep 2 stages: their bf16 query tile leaves no shared memory for a third at T=4.
FP8_SCORE_STAGES = 3
# Query columns (tokens x heads) scored by one tl.dot; bounds registers and shared memory.
_MAX_DOT_ROWS = 256


# --------------------------------------------------------------------------------------------
# Torch reference (the spec)
# --------------------------------------------------------------------------------------------
def indexer_scores_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    page_table: torch.Tensor,
    lens: torch.Tensor,
) -> torch.Tensor:
    """f32 scores [B, T, max_pages * 64]; slots at or past lens[b, t] are -inf.

    Pages past a request's valid pages are replaced by physical page 0 before the gather (and
    their slots masked), so page-table entries there are never used as indices.
    """
    batch, tokens, heads, head_dim = q.shape
    max_pages = page_table.shape[1]
    slots = max_pages * PAGE_SIZE
    lens = lens.long().clamp(0, slots)
    top = lens.amax(dim=1) if tokens else lens.new_zeros(batch)  # [B]; no token reads no page
    valid_pages = (top + PAGE_SIZE - 1) // PAGE_SIZE
    logical = torch.arange(max_pages, device=q.device)
    physical = torch.where(logical < valid_pages[:, None], page_table.long(), 0)
    keys = k_cache[physical].float().reshape(batch, slots, head_dim)
    logits = torch.einsum("bthd,bsd->bths", q.float(), keys)
    scores = (torch.relu(logits) * weights.float()[..., None]).sum(dim=2)  # [B, T, S]
    if k_scale is not None:
        scores = scores * k_scale[physical].float().reshape(batch, 1, slots)
    visible = torch.arange(slots, device=q.device) < lens[..., None]
    return torch.where(visible, scores, float("-inf"))


def indexer_topk_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    page_table: torch.Tensor,
    lens: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    """idx [B, T, topk] int32: the top-`topk` logical slots by score (sorted), -1 past
    min(lens[b, t], topk). Shapes and dtypes as `indexer_topk`; assumes finite valid scores."""
    scores = indexer_scores_reference(q, weights, k_cache, k_scale, page_table, lens)
    batch, tokens, slots = scores.shape
    taken = min(topk, slots)
    top = scores.topk(taken, dim=-1).indices
    count = lens.long().clamp(0, slots).clamp(max=topk)[..., None]
    idx = torch.full((batch, tokens, topk), -1, dtype=torch.int32, device=q.device)
    rank = torch.arange(taken, device=q.device)
    idx[..., :taken] = torch.where(rank < count, top, -1).to(torch.int32)
    return idx


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _load_query_cols(q_ptr, w_ptr, b, t0, T, H, D,
                     sq_b, sq_t, sq_h, sq_d, sw_b, sw_t, sw_h,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     DOT_DTYPE: tl.constexpr):
    """Columns c = (t - t0) * BLOCK_H + h: q^T [BLOCK_D, BLOCK_T * BLOCK_H] and weights [cols]."""
    cols = tl.arange(0, BLOCK_T * BLOCK_H)
    t = t0 + cols // BLOCK_H
    h = cols % BLOCK_H
    d = tl.arange(0, BLOCK_D)
    col_ok = (t < T) & (h < H)
    q_ptrs = q_ptr + b * sq_b + t[None, :] * sq_t + h[None, :] * sq_h + d[:, None] * sq_d
    q_cols = tl.load(q_ptrs, mask=col_ok[None, :] & (d[:, None] < D), other=0.0)
    w_cols = tl.load(w_ptr + b * sw_b + t * sw_t + h * sw_h, mask=col_ok, other=0.0)
    return q_cols.to(DOT_DTYPE), w_cols.to(tl.float32)


@triton.jit
def _token_lens(lens_ptr, b, t0, T, S_MAX, sl_b, sl_t, BLOCK_T: tl.constexpr):
    """lens[b, t0 : t0 + BLOCK_T] clamped to [0, S_MAX] (0 past T)."""
    t = t0 + tl.arange(0, BLOCK_T)
    lens = tl.load(lens_ptr + b * sl_b + t * sl_t, mask=t < T, other=0)
    return tl.minimum(tl.maximum(lens, 0), S_MAX)


@triton.jit
def _score_and_store(q_cols, w_cols, keys, scale, ws_ptr, b, t0, T, page, lens, S_MAX,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr,
                     HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr):
    """Scores of one key page for tokens t0 ... t0 + BLOCK_T - 1, stored where slot < their
    clamped `lens`.

    Slots are the dot's M dimension and (token, head) its N dimension, so the sum over heads
    reduces along the accumulator's rows (mostly within a thread).
    """
    logits = tl.dot(keys, q_cols, input_precision=PRECISION)  # [PAGE, cols] f32
    weighted = tl.maximum(logits, 0.0) * w_cols[None, :]
    scores = tl.sum(tl.reshape(weighted, (PAGE, BLOCK_T, BLOCK_H)), axis=2)  # [PAGE, BLOCK_T]
    if HAS_SCALE:
        scores = scores * scale[:, None]
    t = t0 + tl.arange(0, BLOCK_T)
    slot = page * PAGE + tl.arange(0, PAGE)
    keep = (t[None, :] < T) & (slot[:, None] < lens[None, :])
    rows = (b * T + t).to(tl.int64)  # B * T * S_MAX may pass 2**31 (long verify or prefill lists)
    tl.store(ws_ptr + rows[None, :] * S_MAX + slot[:, None], scores, mask=keep)


@triton.jit
def _page_id(pt_ptr, b, page, n_pages, spt_b, spt_j, PAST: tl.constexpr = 0):
    """Physical id of logical page `page` of request b (PAST, unread, from n_pages on)."""
    return tl.load(pt_ptr + b * spt_b + page * spt_j, mask=page < n_pages, other=PAST)


@triton.jit
def _page_scale(ks_ptr, phys, P, sks_p, sks_s, PAGE: tl.constexpr, HAS_SCALE: tl.constexpr):
    """Key scales [PAGE] f32 of physical page `phys` (0 for an invalid id; zeros without
    scales)."""
    scale = tl.zeros((PAGE,), tl.float32)
    if HAS_SCALE:
        page_ok = (phys >= 0) & (phys < P)
        phys = tl.where(page_ok, phys, 0).to(tl.int64)
        scale = tl.load(ks_ptr + phys * sks_p + tl.arange(0, PAGE) * sks_s, mask=page_ok,
                        other=0.0).to(tl.float32)
    return scale


@triton.jit
def _score_page(page, phys, scale, lens0, q_cols, w_cols, q_ptr, w_ptr, k_ptr, ks_ptr,
                lens_ptr, ws_ptr, b, T, H, D, P, S_MAX,
                sq_b, sq_t, sq_h, sq_d, sw_b, sw_t, sw_h,
                sk_p, sk_s, sk_d, sks_p, sks_s, sl_b, sl_t,
                N_TBLOCKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_D: tl.constexpr, PAGE: tl.constexpr, HAS_SCALE: tl.constexpr,
                DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                SCALE_LOADED: tl.constexpr):
    """Read logical page `page` (physical id `phys`) of request b once and score it for all
    T tokens (lens0: the first token block's clamped lens); with SCALE_LOADED, `scale` holds
    the page's key scales (`_page_scale`), else they are loaded here."""
    slot_in_page = tl.arange(0, PAGE)
    d = tl.arange(0, BLOCK_D)
    page_ok = (phys >= 0) & (phys < P)  # only an unchecked (captured) call can fail this
    k_ptrs = (k_ptr + tl.where(page_ok, phys, 0).to(tl.int64) * sk_p
              + slot_in_page[:, None] * sk_s + d[None, :] * sk_d)
    keys = tl.load(k_ptrs, mask=page_ok & (d[None, :] < D), other=0.0).to(DOT_DTYPE)
    if not SCALE_LOADED:
        scale = _page_scale(ks_ptr, phys, P, sks_p, sks_s, PAGE, HAS_SCALE)
    if N_TBLOCKS == 1:
        _score_and_store(q_cols, w_cols, keys, scale, ws_ptr, b, 0, T, page,
                         lens0, S_MAX, BLOCK_T, BLOCK_H, PAGE,
                         HAS_SCALE, PRECISION)
    else:  # many tokens: the page stays on chip while the token blocks reload their queries
        for tb in range(0, N_TBLOCKS):
            qb, wb = _load_query_cols(q_ptr, w_ptr, b, tb * BLOCK_T, T, H, D, sq_b, sq_t,
                                      sq_h, sq_d, sw_b, sw_t, sw_h, BLOCK_T, BLOCK_H,
                                      BLOCK_D, DOT_DTYPE)
            lens = _token_lens(lens_ptr, b, tb * BLOCK_T, T, S_MAX, sl_b, sl_t, BLOCK_T)
            _score_and_store(qb, wb, keys, scale, ws_ptr, b, tb * BLOCK_T, T, page,
                             lens, S_MAX, BLOCK_T, BLOCK_H, PAGE,
                             HAS_SCALE, PRECISION)


@triton.jit
def _after_cta_barrier(x, PIN: tl.constexpr):
    """x (int32), passed through a CTA barrier (`bar.red.or`) that the compilers cannot see
    through: an operation that takes the result in cannot move above the barrier. Pure for
    Triton's pipeliner (which cannot predicate other inline asm); x keeps it in the loop.
    Without PIN (and in the interpreter, which has no asm) x itself."""
    if PIN:
        x = tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 z; setp.ne.u32 p, $1, $1; bar.red.or.pred p, 0, p; "
            "selp.u32 z, 1, 0, p; or.b32 $0, $1, z; }",
            "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    return x


@triton.jit
def _ids_ahead(pt_ptr, ks_ptr, b, page, n_pages, SPLITS, P, spt_b, spt_j, sks_p, sks_s, nxt2,
               PAGE: tl.constexpr, HAS_SCALE: tl.constexpr, PIN: tl.constexpr):
    """End of a SCALE_AHEAD step at logical page `page`: (the next page's id, the page after
    it's id, the next page's scales). nxt2, the next page's id, was loaded a step earlier."""
    # With PIN the first use of nxt2 comes after a barrier: ptxas would otherwise hoist it to
    # the top of the loop body, where it waits for the id load issued at the previous step's end.
    nxt2 = _after_cta_barrier(nxt2, PIN)
    # Not a plain copy of nxt2 (Triton's pipeliner skips loops that carry a value for two
    # iterations, a yield of a loop argument): -1 (nothing read) for an invalid id and past
    # the last page (-1 from the id load).
    nxt = tl.where((nxt2 >= 0) & (nxt2 < P), nxt2, -1)
    nxt2 = _page_id(pt_ptr, b, page + 2 * SPLITS, n_pages, spt_b, spt_j, -1)
    return nxt, nxt2, _page_scale(ks_ptr, nxt, P, sks_p, sks_s, PAGE, HAS_SCALE)


@triton.jit
def _page_turn(page, nxt, nxt2, nxt_scale, lens0, q_cols, w_cols, q_ptr, w_ptr, k_ptr, ks_ptr, pt_ptr,
               lens_ptr, ws_ptr, b, n_pages, T, H, D, P, S_MAX, SPLITS,
               sq_b, sq_t, sq_h, sq_d, sw_b, sw_t, sw_h, sk_p, sk_s, sk_d, sks_p, sks_s, spt_b, spt_j,
               sl_b, sl_t, N_TBLOCKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_D: tl.constexpr, PAGE: tl.constexpr, HAS_SCALE: tl.constexpr, DOT_DTYPE: tl.constexpr,
               PRECISION: tl.constexpr, ID_AHEAD: tl.constexpr, SCALE_AHEAD: tl.constexpr,
               PIN_IDS: tl.constexpr):
    """One step of the scoring loop at logical page `page`: score it and return the next step's
    (nxt, nxt2, nxt_scale) (see `_score_pages_kernel`)."""
    phys = nxt
    if ID_AHEAD and not SCALE_AHEAD:
        nxt = _page_id(pt_ptr, b, page + SPLITS, n_pages, spt_b, spt_j)
    elif not ID_AHEAD:
        phys = _page_id(pt_ptr, b, page, n_pages, spt_b, spt_j)
    _score_page(page, phys, nxt_scale, lens0, q_cols, w_cols, q_ptr, w_ptr, k_ptr,
                ks_ptr, lens_ptr, ws_ptr, b, T, H, D, P, S_MAX,
                sq_b, sq_t, sq_h, sq_d, sw_b, sw_t, sw_h,
                sk_p, sk_s, sk_d, sks_p, sks_s, sl_b, sl_t,
                N_TBLOCKS, BLOCK_T, BLOCK_H, BLOCK_D, PAGE, HAS_SCALE, DOT_DTYPE,
                PRECISION, SCALE_AHEAD)
    if SCALE_AHEAD:  # after this page's epilogue, in the registers it freed
        nxt, nxt2, nxt_scale = _ids_ahead(pt_ptr, ks_ptr, b, page, n_pages, SPLITS, P,
                                          spt_b, spt_j, sks_p, sks_s, nxt2, PAGE,
                                          HAS_SCALE, PIN_IDS)
    return nxt, nxt2, nxt_scale


@triton.jit
def _score_pages_kernel(
    q_ptr, w_ptr, k_ptr, ks_ptr, pt_ptr, lens_ptr, ws_ptr,
    T, H, D, P, S_MAX, SPLITS, TOPK,
    sq_b, sq_t, sq_h, sq_d, sw_b, sw_t, sw_h,
    sk_p, sk_s, sk_d, sks_p, sks_s, spt_b, spt_j, sl_b, sl_t,
    N_TBLOCKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, HAS_SCALE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, FOR_LOOPS: tl.constexpr,
    ID_AHEAD: tl.constexpr, SCALE_AHEAD: tl.constexpr, PIN_IDS: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    # The last slot any token of this request needs scored: only tokens with lens > TOPK.
    lens0 = _token_lens(lens_ptr, b, 0, T, S_MAX, sl_b, sl_t, BLOCK_T)  # kept for the loop
    needed = tl.max(tl.where(lens0 > TOPK, lens0, 0), axis=0)
    for tb in range(1, N_TBLOCKS):
        lens = _token_lens(lens_ptr, b, tb * BLOCK_T, T, S_MAX, sl_b, sl_t, BLOCK_T)
        needed = tl.maximum(needed, tl.max(tl.where(lens > TOPK, lens, 0), axis=0))
    n_pages = (needed + PAGE - 1) // PAGE

    if split < n_pages:  # most programs of a short request have no page: skip the q load
        q_cols = tl.zeros((BLOCK_D, BLOCK_T * BLOCK_H), DOT_DTYPE)
        w_cols = tl.zeros((BLOCK_T * BLOCK_H,), tl.float32)
        if N_TBLOCKS == 1:  # all tokens fit one dot: keep their queries in registers
            q_cols, w_cols = _load_query_cols(q_ptr, w_ptr, b, 0, T, H, D, sq_b, sq_t, sq_h,
                                              sq_d, sw_b, sw_t, sw_h, BLOCK_T, BLOCK_H, BLOCK_D,
                                              DOT_DTYPE)
        # With ID_AHEAD the next page's id is loaded while this page is scored, so the
        # pipelined key load for the next page does not first wait for its id. With
        # SCALE_AHEAD the next page's scales are loaded too, from its id loaded a page earlier
        # (ids two pages ahead: nxt is this page's id, nxt2 the next one's).
        nxt = _page_id(pt_ptr, b, split, n_pages, spt_b, spt_j)
        nxt2 = nxt
        nxt_scale = tl.zeros((PAGE,), tl.float32)
        if SCALE_AHEAD:
            nxt2 = _page_id(pt_ptr, b, split + SPLITS, n_pages, spt_b, spt_j, -1)
            nxt_scale = _page_scale(ks_ptr, nxt, P, sks_p, sks_s, PAGE, HAS_SCALE)
        if FOR_LOOPS:  # software-pipelined on the GPU
            for page in range(split, n_pages, SPLITS):
                nxt, nxt2, nxt_scale = _page_turn(
                    page, nxt, nxt2, nxt_scale, lens0, q_cols, w_cols, q_ptr, w_ptr, k_ptr, ks_ptr, pt_ptr,
                    lens_ptr, ws_ptr, b, n_pages, T, H, D, P, S_MAX, SPLITS,
                    sq_b, sq_t, sq_h, sq_d, sw_b, sw_t, sw_h, sk_p, sk_s, sk_d, sks_p, sks_s, spt_b, spt_j,
                    sl_b, sl_t, N_TBLOCKS, BLOCK_T, BLOCK_H, BLOCK_D, PAGE, HAS_SCALE, DOT_DTYPE, PRECISION,
                    ID_AHEAD, SCALE_AHEAD, PIN_IDS)
        else:  # the interpreter (numpy >= 2.4) cannot take its 1-element tensors as range()
            page = split
            while page < n_pages:
                nxt, nxt2, nxt_scale = _page_turn(
                    page, nxt, nxt2, nxt_scale, lens0, q_cols, w_cols, q_ptr, w_ptr, k_ptr, ks_ptr, pt_ptr,
                    lens_ptr, ws_ptr, b, n_pages, T, H, D, P, S_MAX, SPLITS,
                    sq_b, sq_t, sq_h, sq_d, sw_b, sw_t, sw_h, sk_p, sk_s, sk_d, sks_p, sks_s, spt_b, spt_j,
                    sl_b, sl_t, N_TBLOCKS, BLOCK_T, BLOCK_H, BLOCK_D, PAGE, HAS_SCALE, DOT_DTYPE, PRECISION,
                    ID_AHEAD, SCALE_AHEAD, PIN_IDS)
                page += SPLITS


# --------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------
def _dot_dtype(q: torch.Tensor, k_cache: torch.Tensor):
    """(Triton dtype of the q.k products, tl.dot input precision). fp8 values are exact in bf16.

    The interpreter computes bf16 dots wrongly (triton 3.6), so it always gets f32.
    """
    if torch.float32 in (q.dtype, k_cache.dtype) or not q.is_cuda:
        return tl.float32, "ieee"
    if q.dtype == k_cache.dtype == torch.float8_e4m3fn and q.is_cuda:
        return tl.float8e4nv, None
    return tl.bfloat16, None


def _token_block(tokens: int, heads_block: int) -> int:
    """Tokens per dot: at least 16 columns (tl.dot's minimum), at most _MAX_DOT_ROWS."""
    per_dot = max(1, _MAX_DOT_ROWS // heads_block)
    block = min(triton.next_power_of_2(tokens), per_dot)
    return max(block, triton.next_power_of_2(max(1, 16 // heads_block)))


def fp8_score_register_cap(capability: tuple[int, int] | None, warps: int) -> int:
    """The scoring kernel's register cap a thread with fp8 dots on a GPU of `capability` launched
    with `warps` warps (FP8_SCORE_MAX_REGS); 0 (no cap) where none was chosen."""
    return FP8_SCORE_MAX_REGS.get(capability, {}).get(warps, 0)


def default_splits(batch: int, max_pages: int, device: torch.device) -> int:
    """Programs per request in the scoring grid: about 16 per SM over the batch (measured on
    the H200: more programs keep more key pages in flight)."""
    if device.type != "cuda":
        return min(2, max_pages)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(max_pages, triton.cdiv(16 * sms, batch)))


def indexer_scores_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    page_table: torch.Tensor,
    lens: torch.Tensor,
    topk: int,
    *,
    splits: int | None = None,
    workspace: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    max_regs: int | None = None,
    id_ahead: bool = DEFAULT_ID_AHEAD,
    scale_ahead: bool = DEFAULT_SCALE_AHEAD,
    pin_ids: bool = DEFAULT_PIN_IDS,
):
    """Launch the scoring kernel; returns (workspace [B, T, max_pages * 64] f32, the kernel).

    workspace[b, t, s] holds the score of slot s for s < lens[b, t] on the pages read for
    request b: those below ceil(n / 64), n the largest lens[b, :] above topk (none if no token
    of the request has more than topk visible slots). Every other element is left unwritten.
    Arguments as `indexer_topk_triton`; `workspace` may be a caller's contiguous
    [B, T, max_pages * 64] f32 tensor; num_warps and num_stages (default FP8_SCORE_STAGES for
    fp8 dots, else 2) override the launch config.
    `max_regs` caps the registers a thread (default `fp8_score_register_cap` for fp8 dots,
    else none; 0: no cap);
    `id_ahead` loads each next page's id one page ahead; `scale_ahead` each next page's key
    scales one page ahead (and the ids two; `id_ahead` is then ignored), `pin_ids` keeps the
    ids' first use below a barrier (DEFAULT_PIN_IDS).
    """
    batch, tokens, heads, head_dim = q.shape
    max_pages = page_table.shape[1]
    s_max = max_pages * PAGE_SIZE
    if workspace is None:
        workspace = torch.empty((batch, tokens, s_max), dtype=torch.float32, device=q.device)
    block_h = triton.next_power_of_2(heads)
    block_t = _token_block(tokens, block_h)
    rows = block_t * block_h
    splits = splits or default_splits(batch, max_pages, q.device)
    dot_dtype, precision = _dot_dtype(q, k_cache)
    warps = num_warps or (8 if rows >= 128 else 4)
    fp8 = dot_dtype == tl.float8e4nv
    stages = num_stages or (FP8_SCORE_STAGES if fp8 else 2)
    if max_regs is None:
        max_regs = fp8_score_register_cap(device_capability(q), warps) if fp8 else 0
    has_scale = k_scale is not None
    ks = k_scale if has_scale else k_cache  # unused pointer when there is no scale
    ks_strides = (k_scale.stride(0), k_scale.stride(1)) if has_scale else (0, 0)
    kernel = _score_pages_kernel[(batch, splits)](
        q, weights, k_cache, ks, page_table, lens, workspace,
        tokens, heads, head_dim, k_cache.shape[0], s_max, splits, topk,
        *q.stride(), *weights.stride(), *k_cache.stride(), *ks_strides,
        *page_table.stride(), *lens.stride(),
        N_TBLOCKS=triton.cdiv(tokens, block_t), BLOCK_T=block_t, BLOCK_H=block_h,
        BLOCK_D=max(triton.next_power_of_2(head_dim), 32 if fp8 else 16),  # 8-bit dots need K >= 32
        PAGE=PAGE_SIZE, HAS_SCALE=has_scale,
        DOT_DTYPE=dot_dtype, PRECISION=precision, FOR_LOOPS=q.is_cuda,
        ID_AHEAD=id_ahead,
        SCALE_AHEAD=scale_ahead, PIN_IDS=pin_ids and q.is_cuda, num_warps=warps, num_stages=stages,
        maxnreg=max_regs or None,
    )
    return workspace, kernel


def indexer_topk_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    page_table: torch.Tensor,
    lens: torch.Tensor,
    topk: int,
    *,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    workspace: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
    select_warps: int = DEFAULT_SELECT_WARPS,
    split_block: int = DEFAULT_SPLIT_BLOCK,
    select_programs: int | None = None,
    score_warps: int | None = None,
    score_stages: int | None = None,
    score_max_regs: int | None = None,
    id_ahead: bool = DEFAULT_ID_AHEAD,
    scale_ahead: bool = DEFAULT_SCALE_AHEAD,
    pin_ids: bool = DEFAULT_PIN_IDS,
) -> tuple[torch.Tensor, list]:
    """Launch the scoring and selection kernels; returns (idx [B, T, topk] int32, the kernels).

    Arguments as `indexer_topk`, already validated (shapes and dtypes; lens and page ids are
    clamped in the kernels, so no value can cause an out-of-bounds read). `out` may be a
    pre-poisoned [B, T, topk] int32 contiguous tensor to write into, `workspace` a
    (pre-poisoned) contiguous [B, T, max_pages * 64] f32 score buffer; `splits` overrides the
    number of scoring programs per request, `chunk`, `select_warps` and `split_block` the
    selection's slots and warps per program and the split kernel's slots at a time,
    `select_programs` its programs per row (default `programs_per_row`); `score_warps`,
    `score_stages`, `score_max_regs`, `id_ahead`, `scale_ahead` and `pin_ids` override the
    scoring kernel's launch config.
    """
    batch, tokens = q.shape[:2]
    if out is None:
        out = torch.empty((batch, tokens, topk), dtype=torch.int32, device=q.device)
    if batch == 0 or tokens == 0:
        return out, []
    workspace, score = indexer_scores_triton(q, weights, k_cache, k_scale, page_table, lens,
                                             topk, splits=splits, workspace=workspace,
                                             num_warps=score_warps, num_stages=score_stages,
                                             max_regs=score_max_regs,
                                             id_ahead=id_ahead, scale_ahead=scale_ahead,
                                             pin_ids=pin_ids)
    select = select_topk_triton(workspace, lens, topk, out, chunk=chunk, num_warps=select_warps,
                                split_block=split_block, programs=select_programs)
    return out, [score, *select]


# --------------------------------------------------------------------------------------------
# Validation and registration
# --------------------------------------------------------------------------------------------
def check_indexer_args(q, weights, k_cache, k_scale, page_table, lens, topk) -> None:
    """Shapes, dtypes, devices and the supported ranges; ValueError/TypeError naming the argument."""
    tensors = dict(q=q, weights=weights, k_cache=k_cache, page_table=page_table, lens=lens)
    if k_scale is not None:
        tensors["k_scale"] = k_scale
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"indexer_topk: {name} must be a tensor, got {type(t).__name__}")
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"indexer_topk: topk must be an int in [1, {MAX_TOPK}], got {topk!r}")
    if q.dim() != 4:
        raise ValueError(f"indexer_topk: q must be [B, T, H, D], got shape {tuple(q.shape)}")
    batch, tokens, heads, head_dim = q.shape
    if q.dtype not in _Q_DTYPES:
        raise ValueError(f"indexer_topk: q dtype must be one of {_Q_DTYPES}, got {q.dtype}")
    if not MIN_HEADS <= heads <= MAX_HEADS:
        raise ValueError(f"indexer_topk: heads H={heads} of q must be in [{MIN_HEADS}, {MAX_HEADS}]")
    if head_dim % 16 or not 16 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"indexer_topk: head dim D={head_dim} of q must be a multiple of 16 in [16, {MAX_HEAD_DIM}]")
    if weights.shape != (batch, tokens, heads):
        raise ValueError(f"indexer_topk: weights must be [B, T, H] = {(batch, tokens, heads)} "
                         f"like q, got {tuple(weights.shape)}")
    if weights.dtype != torch.float32:
        raise ValueError(f"indexer_topk: weights must be float32, got {weights.dtype}")
    if k_cache.dim() != 3 or k_cache.shape[1] != PAGE_SIZE or k_cache.shape[2] != head_dim:
        raise ValueError(f"indexer_topk: k_cache must be [P, {PAGE_SIZE}, D={head_dim}] (D of q), "
                         f"got {tuple(k_cache.shape)}")
    if k_cache.shape[0] < 1:
        raise ValueError("indexer_topk: k_cache must hold at least one page")
    if k_cache.dtype not in _K_DTYPES:
        raise ValueError(f"indexer_topk: k_cache dtype must be one of {_K_DTYPES}, got {k_cache.dtype}")
    if k_scale is None:
        if k_cache.dtype == torch.float8_e4m3fn:
            raise ValueError("indexer_topk: fp8 k_cache needs k_scale [P, 64] float32, got None")
    elif k_scale.shape != k_cache.shape[:2] or k_scale.dtype != torch.float32:
        raise ValueError(f"indexer_topk: k_scale must be float32 [P, {PAGE_SIZE}] = "
                         f"{tuple(k_cache.shape[:2])} like k_cache, got {k_scale.dtype} "
                         f"{tuple(k_scale.shape)}")
    if page_table.dim() != 2 or page_table.shape[0] != batch or page_table.dtype != torch.int32:
        raise ValueError(f"indexer_topk: page_table must be int32 [B={batch}, max_pages] (B of q), "
                         f"got {page_table.dtype} {tuple(page_table.shape)}")
    if lens.shape != (batch, tokens) or lens.dtype != torch.int32:
        raise ValueError(f"indexer_topk: lens must be int32 [B, T] = {(batch, tokens)} like q, "
                         f"got {lens.dtype} {tuple(lens.shape)}")
    for name, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"indexer_topk: {name} is on {t.device}, q on {q.device}")


def check_indexer_values(k_cache, page_table, lens) -> None:
    """lens in [0, max_pages * 64] and valid pages' ids in [0, P) (one host sync)."""
    max_pages = page_table.shape[1]
    slots = max_pages * PAGE_SIZE
    if lens.numel() == 0:  # no query token: nothing is read
        return
    lens64 = lens.long()
    valid_pages = (lens64.clamp(0, slots).amax(dim=1, keepdim=True) + PAGE_SIZE - 1) // PAGE_SIZE
    used = torch.arange(max_pages, device=lens.device) < valid_pages
    bad_page = used & ((page_table < 0) | (page_table >= k_cache.shape[0]))
    bad_lens, bad_pages = torch.stack([((lens64 < 0) | (lens64 > slots)).any(),
                                       bad_page.any()]).tolist()
    if bad_lens:
        raise ValueError(f"indexer_topk: lens must lie in [0, max_pages * 64 = {slots}]")
    if bad_pages:
        raise ValueError(f"indexer_topk: page_table entries of valid pages must lie in "
                         f"[0, P = {k_cache.shape[0]})")


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


@torch.library.custom_op("dsv4::indexer_topk", mutates_args=())
def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    page_table: torch.Tensor,
    lens: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    """Length-bounded indexer top-k.

    q [B, T, H, D] bf16/fp8 e4m3/f32 (4 <= H <= 128, D a multiple of 16 up to 256),
    weights [B, T, H] f32, k_cache [P, 64, D] fp8 e4m3/bf16/f32 (any strides),
    k_scale [P, 64] f32 or None (required for fp8 keys), page_table [B, max_pages] int32,
    lens [B, T] int32 in [0, max_pages * 64], 1 <= topk <= 2048.
    Returns idx [B, T, topk] int32: logical slots of a top-`topk` set of
    k_scale[s] * sum_h weights[h] * relu(q[h] . k[s]) over s < lens[b, t], -1 past
    min(lens[b, t], topk); order unspecified. Value checks are skipped while a CUDA graph is
    being captured (the kernels clamp instead).
    """
    check_indexer_args(q, weights, k_cache, k_scale, page_table, lens, topk)
    if not _capturing(q):
        check_indexer_values(k_cache, page_table, lens)
    if triton_runs_on(q):
        return indexer_topk_triton(q, weights, k_cache, k_scale, page_table, lens, topk)[0]
    return indexer_topk_reference(q, weights, k_cache, k_scale, page_table, lens, topk)


@indexer_topk.register_fake
def _indexer_topk_fake(q, weights, k_cache, k_scale, page_table, lens, topk):
    batch, tokens = q.shape[:2]
    return q.new_empty((batch, tokens, topk), dtype=torch.int32)
