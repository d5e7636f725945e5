"""Length-bounded row top-k over a score workspace, spread over chunks of each row.

Input: scores [R, S] f32 (row r = b * T + t of the indexer), valid where s < lens[b, t]; the
rest is never read. Output: out [R, topk] int32, the slots of a top-`topk` set of the valid
prefix (order unspecified), -1 past min(len, topk).

Rows with len <= topk take every valid slot (no score is read). Longer rows go through three
kernels on static grids (capture-safe). The two chunk kernels run `programs` programs per
row, program p taking chunks p, p + programs, ... of CHUNK slots; chunks at or past the row's
length are skipped, so the work follows the real length, not the workspace's width.
  1. `_chunk_hist_kernel`: histogram of each chunk over NUM_BINS equal bins placed from
     SAMPLES evenly spaced scores of the row (`_sampled_grid`; bin 0 holds the largest scores,
     scores beyond the bins land in the end bins).
     Every program of a row draws the same sample, so all place the bins alike.
  2. `_chunk_split_kernel`: every program sums the row's chunk histograms and finds the
     threshold bin, the one where the count from the top reaches topk. Scores above it are
     written straight to `out` (at the count of such scores in earlier chunks plus their rank
     within the chunk, `split_block` slots at a time); scores in it are copied, with their
     slots, into a candidate list of at most `cap` per row.
  3. `_finish_kernel`, one program per row: a radix select (8 bits a pass, `tl.histogram`) of
     the missing ones among the candidates. When the threshold bin holds more than `cap`
     scores (many ties, or most scores packed in a sliver of the binned range), it runs over
     the whole row instead and writes all of `out` itself: slower, never wrong.
Only the bin of a score decides where it goes, and kernel 2 bins with the row's (top, scale)
that kernel 1 stored and the same elementwise code, so their counts agree exactly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._runtime import pdl_launch, wait_for_producers

NUM_BINS = 64
DEFAULT_CHUNK = 2048
# H200 sweep (bench/bench_indexer.py --sweep, B=64, H=64, top-k 512): chunk 2048 with 4 warps was the
# fastest at 128K (137 vs 149 us with 8 warps) and at ctx 512; at 8K all configs were within 3%.
DEFAULT_SELECT_WARPS = 4
SPREAD = 8.0  # the bins stop this many standard deviations from the sample's mean
# Scores a row's bins are placed from: enough for its spread, few enough that the chunk programs'
# repeated draws (each reads its own copy, 32 bytes of L2 a sample) stay cheap.
SAMPLES = 512
# Slots the split kernel handles at a time (bounds its registers; 167 a thread at 2048 slots).
DEFAULT_SPLIT_BLOCK = 512
_HIST_TILE = 16  # chunk histograms per [chunks, NUM_BINS] load when a kernel sums them
_FINISH_BLOCK = 1024


@triton.jit
def _row_len(lens_ptr, row, T, S_MAX, sl_b, sl_t):
    b = row // T
    t = row % T
    n = tl.load(lens_ptr + b * sl_b + t * sl_t)
    return tl.minimum(tl.maximum(n, 0), S_MAX)


@triton.jit
def _sampled_grid(ws_ptr, row, n, S_MAX, NUM_BINS: tl.constexpr, SPREAD: tl.constexpr,
                  SAMPLES: tl.constexpr):
    """(top, scale) of the row's bins, bin(x) = (top - x) * scale, from SAMPLES evenly spaced
    scores of its n valid ones (every score when n <= SAMPLES): they span from the sample's min
    to twice its max's distance above its mean, cut to its mean -/+ SPREAD standard deviations,
    so that a few outliers (an attention sink) do not stretch them. Scores beyond land in the
    end bins. The sample's max is only about the row's (n / SAMPLES)-th largest score: capped
    there, a long row's top-k would share bin 0 with every score above it (a numpy model of
    these bins, Gaussian rows of 262,208 scores, top-k 512: 2.7% of rows then overflow a list of
    2,048; 0% with the doubled reach, and about 190 against 120 candidates at 32K)."""
    i = tl.arange(0, SAMPLES)
    pos = (i.to(tl.int64) * n) // SAMPLES
    x = tl.load(ws_ptr + row.to(tl.int64) * S_MAX + pos)
    mean = tl.sum(x, axis=0) / SAMPLES
    dev = x - mean
    spread = SPREAD * tl.sqrt(tl.sum(dev * dev, axis=0) / SAMPLES)
    top = tl.minimum(2.0 * tl.max(x, axis=0) - mean, mean + spread)
    width = top - tl.maximum(tl.min(x, axis=0), mean - spread)
    scale = tl.where(width > 0, NUM_BINS / tl.where(width > 0, width, 1.0), 0.0)
    return top, scale


@triton.jit
def _score_bin(x, top, scale, NUM_BINS: tl.constexpr):
    """Bin of each score: 0 for the largest, NUM_BINS - 1 for the smallest (monotone)."""
    f = tl.minimum(tl.maximum((top - x) * scale, 0.0), NUM_BINS - 1.0)
    return tl.minimum(tl.maximum(f.to(tl.int32), 0), NUM_BINS - 1)


@triton.jit
def _chunk_hist_kernel(ws_ptr, lens_ptr, hist_ptr, grid_ptr, T, S_MAX, N_CHUNKS, PROGRAMS,
                       sl_b, sl_t, TOPK: tl.constexpr, CHUNK: tl.constexpr,
                       NUM_BINS: tl.constexpr, SPREAD: tl.constexpr, SAMPLES: tl.constexpr,
                       PDL: tl.constexpr):
    wait_for_producers(PDL)
    row = tl.program_id(0)
    n = _row_len(lens_ptr, row, T, S_MAX, sl_b, sl_t)
    n_chunks = tl.where(n > TOPK, (n + CHUNK - 1) // CHUNK, 0)
    chunk = tl.program_id(1)
    if chunk < n_chunks:
        top, scale = _sampled_grid(ws_ptr, row, n, S_MAX, NUM_BINS, SPREAD, SAMPLES)
        if chunk == 0:  # the split kernel bins with these very values (its own reductions
            tl.store(grid_ptr + row * 2, top)  # could round the last bit differently)
            tl.store(grid_ptr + row * 2 + 1, scale)
        while chunk < n_chunks:
            offs = chunk * CHUNK + tl.arange(0, CHUNK)
            valid = offs < n
            x = tl.load(ws_ptr + row.to(tl.int64) * S_MAX + offs, mask=valid, other=0.0)
            hist = tl.histogram(_score_bin(x, top, scale, NUM_BINS), NUM_BINS, mask=valid)
            tl.store(hist_ptr + (row * N_CHUNKS + chunk) * NUM_BINS + tl.arange(0, NUM_BINS),
                     hist)
            chunk += PROGRAMS


@triton.jit
def _split_chunk(ws_ptr, hist_row, out_ptr, cand_ptr, cand_slot_ptr, row, chunk, n, d, top,
                 scale, S_MAX, CAP, TOPK: tl.constexpr, CHUNK: tl.constexpr,
                 NUM_BINS: tl.constexpr, HIST_TILE: tl.constexpr, SUB: tl.constexpr):
    """Write one chunk's scores above bin d to the row's output and those in it to the
    candidate list, after what earlier chunks wrote (counted from their histograms).

    The chunk goes SUB slots at a time (fewer live registers); one prefix sum per block
    ranks both kinds, packed as take + (tie << 16) (a block's counts stay below 2**16).
    """
    bins = tl.arange(0, NUM_BINS)
    above_before = 0
    ties_before = 0
    first = 0
    while first < chunk:
        ch = first + tl.arange(0, HIST_TILE)
        h = tl.load(hist_row + ch[:, None] * NUM_BINS + bins[None, :],
                    mask=(ch < chunk)[:, None], other=0)
        above_before += tl.sum(tl.sum(tl.where(bins[None, :] < d, h, 0), axis=1), axis=0)
        ties_before += tl.sum(tl.sum(tl.where(bins[None, :] == d, h, 0), axis=1), axis=0)
        first += HIST_TILE
    row_ws = ws_ptr + row.to(tl.int64) * S_MAX
    row_out = out_ptr + row.to(tl.int64) * TOPK
    row_cand = row.to(tl.int64) * CAP
    for sub in range(0, CHUNK, SUB):
        offs = chunk * CHUNK + sub + tl.arange(0, SUB)
        valid = offs < n
        x = tl.load(row_ws + offs, mask=valid, other=0.0)
        b = _score_bin(x, top, scale, NUM_BINS)
        packed = (valid & (b < d)).to(tl.int32) + ((valid & (b == d)).to(tl.int32) << 16)
        before = tl.cumsum(packed, axis=0) - packed
        take = (packed & 0xFFFF) != 0
        tl.store(row_out + above_before + (before & 0xFFFF), offs, mask=take)
        tie = packed >= 65536
        cpos = row_cand + ties_before + (before >> 16)
        tl.store(cand_ptr + cpos, x, mask=tie)
        tl.store(cand_slot_ptr + cpos, offs, mask=tie)
        counts = tl.sum(packed, axis=0)
        above_before += counts & 0xFFFF
        ties_before += counts >> 16


@triton.jit
def _chunk_split_kernel(ws_ptr, lens_ptr, grid_ptr, hist_ptr, out_ptr, cand_ptr, cand_slot_ptr,
                        meta_ptr, T, S_MAX, N_CHUNKS, PROGRAMS, CAP, sl_b, sl_t,
                        TOPK: tl.constexpr, CHUNK: tl.constexpr, NUM_BINS: tl.constexpr,
                        HIST_TILE: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    row = tl.program_id(0)
    n = _row_len(lens_ptr, row, T, S_MAX, sl_b, sl_t)
    n_chunks = tl.where(n > TOPK, (n + CHUNK - 1) // CHUNK, 0)
    chunk = tl.program_id(1)
    if chunk < n_chunks:
        top = tl.load(grid_ptr + row * 2)
        scale = tl.load(grid_ptr + row * 2 + 1)
        bins = tl.arange(0, NUM_BINS)
        hist_row = hist_ptr + row * N_CHUNKS * NUM_BINS
        total = tl.zeros((NUM_BINS,), tl.int32)
        first = 0
        while first < n_chunks:  # one small tile of chunk histograms live at a time
            ch = first + tl.arange(0, HIST_TILE)
            h = tl.load(hist_row + ch[:, None] * NUM_BINS + bins[None, :],
                        mask=(ch < n_chunks)[:, None], other=0)
            total += tl.sum(h, axis=0)
            first += HIST_TILE
        # Threshold bin d: the first (from the top) where the running count reaches TOPK.
        d = tl.sum((tl.cumsum(total, axis=0) < TOPK).to(tl.int32), axis=0)
        above = tl.sum(tl.where(bins < d, total, 0), axis=0)
        ties = tl.sum(tl.where(bins == d, total, 0), axis=0)
        fits = ties <= CAP
        if chunk == 0:
            tl.store(meta_ptr + row * 2, tl.where(fits, ties, -1))
            tl.store(meta_ptr + row * 2 + 1, above)
        if fits:
            while chunk < n_chunks:
                _split_chunk(ws_ptr, hist_row, out_ptr, cand_ptr, cand_slot_ptr, row, chunk, n,
                             d, top, scale, S_MAX, CAP, TOPK, CHUNK, NUM_BINS, HIST_TILE, SUB)
                chunk += PROGRAMS


@triton.jit
def _order_key(scores):
    """int32 keys whose signed order is the float order of `scores` (f32)."""
    bits = scores.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _load_keys(src, start, count, BLOCK: tl.constexpr):
    """(order keys [BLOCK], valid mask) of the scores src[start : start + BLOCK] below count."""
    offs = start + tl.arange(0, BLOCK)
    valid = offs < count
    return _order_key(tl.load(src + offs, mask=valid, other=0.0)), valid


@triton.jit
def _digit_histogram(key, valid, prefix, PASS: tl.constexpr):
    """Histogram [256] of digit PASS (8 bits, high first) of the unsigned images
    u = key ^ 0x80000000 that agree with `prefix` on the higher digits."""
    shift: tl.constexpr = 24 - 8 * PASS
    u = key ^ -2147483648
    if PASS > 0:
        valid = valid & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
    return tl.histogram((u >> shift) & 255, 256, mask=valid)


@triton.jit
def _next_digit(hist, prefix, remaining, PASS: tl.constexpr):
    """Fix digit PASS: the largest whose count at or above it reaches `remaining`; returns the
    extended prefix and how many are still to take at or below it."""
    digits = tl.arange(0, 256)
    at_or_above = tl.cumsum(hist, axis=0, reverse=True)
    digit = tl.max(tl.where(at_or_above >= remaining, digits, 0), axis=0)
    remaining -= tl.sum(tl.where(digits > digit, hist, 0), axis=0)
    return prefix | (digit << (24 - 8 * PASS)), remaining


@triton.jit
def _compact(key, valid, slots, out_row, threshold, remaining, taken, ties_seen):
    """Write the slots whose key is above `threshold`, and ties while fewer than `remaining`
    ties were taken, after `taken` earlier ones; returns the updated (taken, ties_seen)."""
    above = (valid & (key > threshold)).to(tl.int32)
    tie = (valid & (key == threshold)).to(tl.int32)
    tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
    take = above | (tie & (tie_rank < remaining).to(tl.int32))
    pos = taken + tl.cumsum(take, axis=0) - take
    tl.store(out_row + pos, slots, mask=take != 0)
    return taken + tl.sum(take, axis=0), ties_seen + tl.sum(tie, axis=0)


@triton.jit
def _slots(slot_src, from_list, start, valid, BLOCK: tl.constexpr):
    """Slots of entries [start, start + BLOCK): the position, or read from the list."""
    slots = start + tl.arange(0, BLOCK)
    if from_list:
        slots = tl.load(slot_src + slots, mask=valid, other=-1)
    return slots


@triton.jit
def _finish_kernel(ws_ptr, lens_ptr, out_ptr, cand_ptr, cand_slot_ptr, meta_ptr, T, S_MAX, CAP,
                   sl_b, sl_t, TOPK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    row = tl.program_id(0)
    n = _row_len(lens_ptr, row, T, S_MAX, sl_b, sl_t)
    out_row = out_ptr + row.to(tl.int64) * TOPK
    if n <= TOPK:  # every visible slot is selected
        for start in tl.static_range(0, TOPK, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(out_row + offs, tl.where(offs < n, offs, -1), mask=offs < TOPK)
    else:
        listed = tl.load(meta_ptr + row * 2)
        from_list = listed >= 0
        if from_list:  # pick the rest among the threshold bin's candidates
            src = cand_ptr + row.to(tl.int64) * CAP
            slot_src = cand_slot_ptr + row.to(tl.int64) * CAP
            count = listed
            base = tl.load(meta_ptr + row * 2 + 1)
        else:  # the bin overflowed the list: select over the whole row
            src = ws_ptr + row.to(tl.int64) * S_MAX
            slot_src = cand_slot_ptr  # unused
            count = n
            base = n * 0
        # Radix select on the unsigned image u = key ^ 0x80000000, 8 bits per pass, high first:
        # `prefix` holds the digits fixed so far, `remaining` how many to take at or below it.
        prefix = 0
        remaining = TOPK - base
        out_rest = out_row + base
        if count <= BLOCK:  # the usual case: the candidates stay in registers
            key, valid = _load_keys(src, 0, count, BLOCK)
            lo = tl.min(tl.where(valid, key, 2147483647), axis=0) ^ -2147483648
            hi = tl.max(tl.where(valid, key, -2147483648), axis=0) ^ -2147483648
            for p in tl.static_range(4):
                shift = 24 - 8 * p
                if (lo >> shift) == (hi >> shift):  # one bin's candidates share the high digits
                    prefix = prefix | (((hi >> shift) & 255) << shift)
                else:
                    prefix, remaining = _next_digit(_digit_histogram(key, valid, prefix, p),
                                                    prefix, remaining, p)
            _compact(key, valid, _slots(slot_src, from_list, 0, valid, BLOCK), out_rest,
                     prefix ^ -2147483648, remaining, 0, 0)
        else:  # while loops: the interpreter cannot range() over its 1-element tensors
            for p in tl.static_range(4):
                hist = tl.zeros((256,), tl.int32)
                start = 0
                while start < count:
                    key, valid = _load_keys(src, start, count, BLOCK)
                    hist += _digit_histogram(key, valid, prefix, p)
                    start += BLOCK
                prefix, remaining = _next_digit(hist, prefix, remaining, p)
            taken = 0
            ties_seen = 0
            start = 0
            while start < count:
                key, valid = _load_keys(src, start, count, BLOCK)
                taken, ties_seen = _compact(key, valid, _slots(slot_src, from_list, start, valid,
                                                               BLOCK),
                                            out_rest, prefix ^ -2147483648, remaining, taken,
                                            ties_seen)
                start += BLOCK


def candidate_cap(topk: int) -> int:
    """Candidates kept per row: the threshold bin usually holds a few hundred scores."""
    return max(2048, 2 * topk)


def programs_per_row(rows: int, n_chunks: int, device: torch.device) -> int:
    """Chunk programs per row: about 8 per SM over all rows, at most one per chunk. Each walks
    chunks p, p + programs, ... so a short row in a long workspace costs few empty programs."""
    if device.type != "cuda":
        return min(n_chunks, 4)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_chunks, triton.cdiv(8 * sms, rows)))


def select_topk_triton(scores: torch.Tensor, lens: torch.Tensor, topk: int, out: torch.Tensor,
                       *, chunk: int = DEFAULT_CHUNK, num_warps: int = DEFAULT_SELECT_WARPS,
                       split_block: int = DEFAULT_SPLIT_BLOCK, cap: int | None = None,
                       programs: int | None = None) -> list:
    """Top-`topk` slots of each row of scores [B, T, S] f32 (valid where s < lens[b, t], never
    read elsewhere) into out [B, T, topk] int32 (contiguous); returns the launched kernels.

    `chunk` (a power of two >= 16) is the slots per chunk, `num_warps` the warps of the chunk
    kernels, `split_block` (a power of two) the slots the split kernel handles at a time,
    `programs` their programs per row (default `programs_per_row`), `cap` the candidates kept
    per row (tests force the whole-row fallback with a small one).
    """
    batch, tokens, slots = scores.shape
    rows = batch * tokens
    n_chunks = triton.cdiv(slots, chunk)
    programs = min(programs or programs_per_row(rows, n_chunks, scores.device), n_chunks)
    cap = cap or candidate_cap(topk)
    dev = scores.device
    hist = torch.empty((rows, n_chunks, NUM_BINS), dtype=torch.int32, device=dev)
    cand = torch.empty((rows, cap), dtype=torch.float32, device=dev)
    cand_slot = torch.empty((rows, cap), dtype=torch.int32, device=dev)
    bin_grid = torch.empty((rows, 2), dtype=torch.float32, device=dev)
    meta = torch.empty((rows, 2), dtype=torch.int32, device=dev)
    common = (tokens, slots, n_chunks, programs)
    grid = (rows, programs)
    # Each waits for the kernel before it, which does not let it launch early: these latency-bound grids
    # need their programs spread over the SMs (see _runtime).
    pdl = pdl_launch(scores, release=False)
    return [
        _chunk_hist_kernel[grid](scores, lens, hist, bin_grid, *common, *lens.stride(), TOPK=topk,
                                 CHUNK=chunk, NUM_BINS=NUM_BINS, SPREAD=SPREAD, SAMPLES=SAMPLES,
                                 num_warps=num_warps, **pdl),
        _chunk_split_kernel[grid](scores, lens, bin_grid, hist, out, cand, cand_slot, meta,
                                  *common, cap, *lens.stride(), TOPK=topk, CHUNK=chunk,
                                  NUM_BINS=NUM_BINS, HIST_TILE=_HIST_TILE,
                                  SUB=min(split_block, chunk), num_warps=num_warps, **pdl),
        _finish_kernel[(rows,)](scores, lens, out, cand, cand_slot, meta, tokens, slots, cap,
                                *lens.stride(), TOPK=topk, BLOCK=_FINISH_BLOCK, num_warps=8, **pdl),
    ]
