"""Length-bounded row top-k over a score workspace, in one kernel launch.

Input: scores [R, S] f32 (row r = b * T + t of the indexer), valid where s < lens[b, t]; the
rest is never read. Output: out [R, topk] int32, the slots of a top-`topk` set of the valid
prefix (order unspecified), -1 past min(len, topk).

One kernel on a static grid (capture-safe), `programs` programs a row:
  - len <= topk: program 0 writes every valid slot and the -1s.
  - topk < len <= cap: program 0 selects over the row itself (`_radix_select`).
  - len > cap: every program draws the same evenly spaced sample of the row and takes as its
    threshold the 16-bit bucket of the sample's r-th largest score, r chosen so that about
    `candidate_target(topk)` scores of the row lie at or above it. Each program then copies the
    scores at or above the threshold in its chunks (chunks p, p + programs, ... of CHUNK slots
    below the row's length) to the row's candidate list, at places reserved with an atomic
    counter. The last program of the row to finish (a second counter) selects the top-k among
    the candidates, or over the whole row when the threshold missed: fewer than topk or more
    than `cap` candidates (a sample far from the row, or massive ties). Slower, never wrong.
The counters must be zero when the kernel starts; it leaves [candidates, programs] of each row
that took the sampled threshold in them.
The sample never decides what is selected, only how much work the exact selection does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

DEFAULT_CHUNK = 2048
DEFAULT_SELECT_WARPS = 8
SAMPLE_BLOCK = 1024  # samples a row drawn at a time
# Sample rank of the threshold at least this: the candidates above it then number
# candidate_target * Gamma(r) / r, below topk (a third of the target) with odds ~1e-9.
MIN_SAMPLE_RANK = 32
FINISH_BLOCK = 4096  # scores one selection pass holds in registers


def candidate_target(topk: int) -> int:
    """Candidates a row's sampled threshold aims at: three times topk."""
    return 3 * topk


def candidate_cap(topk: int) -> int:
    """Candidates kept per row (rows no longer than this are selected over directly)."""
    return max(FINISH_BLOCK, 8 * topk)


@triton.jit
def _row_len(lens_ptr, row, T, S_MAX, sl_b, sl_t):
    b = row // T
    t = row % T
    n = tl.load(lens_ptr + b * sl_b + t * sl_t)
    return tl.minimum(tl.maximum(n, 0), S_MAX)


@triton.jit
def _order_key(scores):
    """int32 keys whose signed order is the float order of `scores` (f32)."""
    bits = scores.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _load_keys(src, start, count, BLOCK: tl.constexpr, BYPASS_L1: tl.constexpr):
    """(order keys [BLOCK], valid mask) of the scores src[start : start + BLOCK] below count.
    BYPASS_L1: read through L2 only (data other programs of this launch wrote)."""
    offs = start + tl.arange(0, BLOCK)
    valid = offs < count
    if BYPASS_L1:
        x = tl.load(src + offs, mask=valid, other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(src + offs, mask=valid, other=0.0)
    return _order_key(x), valid


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
def _slots(slot_src, start, valid, BLOCK: tl.constexpr, FROM_LIST: tl.constexpr):
    """Slots of entries [start, start + BLOCK): the position, or read from the list."""
    slots = start + tl.arange(0, BLOCK)
    if FROM_LIST:
        slots = tl.load(slot_src + slots, mask=valid, other=-1, cache_modifier=".cg")
    return slots


@triton.jit
def _radix_select(src, slot_src, count, out_row, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                  FROM_LIST: tl.constexpr):
    """Write to out_row[:TOPK] the slots of the TOPK largest of the `count` (> TOPK) scores
    src[:count]: their positions, or with FROM_LIST (a candidate list this launch wrote) the
    slots slot_src[:count]. A radix select on the unsigned image u = key ^ 0x80000000, 8 bits a
    pass, high first: `prefix` holds the digits fixed so far, `remaining` how many to take at or
    below it."""
    prefix = 0
    remaining = TOPK + count * 0
    if count <= BLOCK:  # the usual case: the scores stay in registers
        key, valid = _load_keys(src, 0, count, BLOCK, FROM_LIST)
        lo = tl.min(tl.where(valid, key, 2147483647), axis=0) ^ -2147483648
        hi = tl.max(tl.where(valid, key, -2147483648), axis=0) ^ -2147483648
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            if (lo >> shift) == (hi >> shift):  # every score shares these digits
                prefix = prefix | (((hi >> shift) & 255) << shift)
            else:
                prefix, remaining = _next_digit(_digit_histogram(key, valid, prefix, p),
                                                prefix, remaining, p)
        _compact(key, valid, _slots(slot_src, 0, valid, BLOCK, FROM_LIST), out_row,
                 prefix ^ -2147483648, remaining, 0, 0)
    else:  # while loops: the interpreter cannot range() over its 1-element tensors
        for p in tl.static_range(4):
            hist = tl.zeros((256,), tl.int32)
            start = 0
            while start < count:
                key, valid = _load_keys(src, start, count, BLOCK, FROM_LIST)
                hist += _digit_histogram(key, valid, prefix, p)
                start += BLOCK
            prefix, remaining = _next_digit(hist, prefix, remaining, p)
        taken = 0
        ties_seen = 0
        start = 0
        while start < count:
            key, valid = _load_keys(src, start, count, BLOCK, FROM_LIST)
            taken, ties_seen = _compact(key, valid, _slots(slot_src, start, valid, BLOCK, FROM_LIST),
                                        out_row, prefix ^ -2147483648, remaining, taken, ties_seen)
            start += BLOCK


@triton.jit
def _sample_keys(row_ws, first, m, n, SAMPLE_BLOCK: tl.constexpr):
    """Order keys of samples first ... first + SAMPLE_BLOCK - 1 of m evenly spaced over [0, n)."""
    i = first + tl.arange(0, SAMPLE_BLOCK)
    pos = (i.to(tl.int64) * n) // m
    return _order_key(tl.load(row_ws + pos, mask=i < m, other=0.0)), i < m


@triton.jit
def _sampled_threshold(row_ws, n, TARGET: tl.constexpr, SAMPLE_BLOCK: tl.constexpr,
                       MIN_RANK: tl.constexpr):
    """The smallest order key of the 16-bit bucket (u = key ^ 0x80000000 cut to its high 16 bits)
    of the r-th largest of m samples of row_ws[:n] (n > TARGET), where m (whole SAMPLE_BLOCKs) and
    r = ceil(m * TARGET / n) make r >= MIN_RANK (m <= n): about TARGET scores lie at or above it."""
    n64 = n.to(tl.int64)
    blocks = tl.maximum((n64 * MIN_RANK + TARGET * SAMPLE_BLOCK - 1) // (TARGET * SAMPLE_BLOCK), 1)
    m = blocks * SAMPLE_BLOCK
    remaining = ((m * TARGET + n64 - 1) // n64).to(tl.int32)
    prefix = 0
    for p in tl.static_range(2):
        hist = tl.zeros((256,), tl.int32)
        first = m * 0
        while first < m:
            key, valid = _sample_keys(row_ws, first, m, n64, SAMPLE_BLOCK)
            hist += _digit_histogram(key, valid, prefix, p)
            first += SAMPLE_BLOCK
        prefix, remaining = _next_digit(hist, prefix, remaining, p)
    return prefix ^ -2147483648


@triton.jit
def _gpu_fence(COMPILED: tl.constexpr):
    """fence.acq_rel.gpu in every thread: its earlier writes are ordered before the CTA's next
    release, and the CTA's last acquire before its later reads (no-op in the interpreter)."""
    if COMPILED:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _select_kernel(ws_ptr, lens_ptr, out_ptr, cand_ptr, cand_slot_ptr, counters_ptr, T, S_MAX, PROGRAMS,
                   sl_b, sl_t, TOPK: tl.constexpr, TARGET: tl.constexpr, CAP: tl.constexpr,
                   CHUNK: tl.constexpr, SAMPLE_BLOCK: tl.constexpr, MIN_RANK: tl.constexpr,
                   BLOCK: tl.constexpr, COMPILED: tl.constexpr):
    row = tl.program_id(0)
    program = tl.program_id(1)
    n = _row_len(lens_ptr, row, T, S_MAX, sl_b, sl_t)
    row_ws = ws_ptr + row.to(tl.int64) * S_MAX
    out_row = out_ptr + row.to(tl.int64) * TOPK
    if n <= CAP:
        if program == 0:
            if n <= TOPK:  # every visible slot is selected
                for start in tl.static_range(0, TOPK, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    tl.store(out_row + offs, tl.where(offs < n, offs, -1), mask=offs < TOPK)
            else:
                _radix_select(row_ws, row_ws, n, out_row, TOPK, BLOCK, False)
    else:
        n_chunks = (n + CHUNK - 1) // CHUNK
        if program < n_chunks:
            threshold = _sampled_threshold(row_ws, n, TARGET, SAMPLE_BLOCK, MIN_RANK)
            counters = counters_ptr + row * 2  # [candidates, programs done]
            cand = cand_ptr + row.to(tl.int64) * CAP
            cand_slot = cand_slot_ptr + row.to(tl.int64) * CAP
            chunk = program
            while chunk < n_chunks:
                offs = chunk * CHUNK + tl.arange(0, CHUNK)
                valid = offs < n
                x = tl.load(row_ws + offs, mask=valid, other=0.0)
                take = (valid & (_order_key(x) >= threshold)).to(tl.int32)
                base = tl.atomic_add(counters, tl.sum(take, axis=0), sem="relaxed")
                pos = base + tl.cumsum(take, axis=0) - take
                keep = (take != 0) & (pos < CAP)
                tl.store(cand + pos, x, mask=keep)
                tl.store(cand_slot + pos, offs, mask=keep)
                chunk += PROGRAMS
            _gpu_fence(COMPILED)
            tl.debug_barrier()  # every thread's candidates before the arrival below
            done = tl.atomic_add(counters + 1, 1, sem="acq_rel")
            if done == tl.minimum(n_chunks, PROGRAMS) - 1:  # the row's last program
                _gpu_fence(COMPILED)
                count = tl.atomic_add(counters, 0)  # an L2 read
                if (count >= TOPK) & (count <= CAP):
                    _radix_select(cand, cand_slot, count, out_row, TOPK, BLOCK, True)
                else:
                    _radix_select(row_ws, row_ws, n, out_row, TOPK, BLOCK, False)


def programs_per_row(rows: int, n_chunks: int, device: torch.device) -> int:
    """Programs per row: about 8 per SM over all rows, at most one per chunk. Each walks chunks
    p, p + programs, ... so a short row in a long workspace costs few empty programs."""
    if device.type != "cuda":
        return min(n_chunks, 4)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_chunks, triton.cdiv(8 * sms, rows)))


def select_topk_triton(scores: torch.Tensor, lens: torch.Tensor, topk: int, out: torch.Tensor,
                       *, chunk: int = DEFAULT_CHUNK, num_warps: int = DEFAULT_SELECT_WARPS,
                       cap: int | None = None, programs: int | None = None,
                       counters: torch.Tensor | None = None) -> list:
    """Top-`topk` slots of each row of scores [B, T, S] f32 (valid where s < lens[b, t], never
    read elsewhere) into out [B, T, topk] int32 (contiguous); returns the launched kernel.

    `chunk` (a power of two >= 16) is the slots a program copies at a time, `num_warps` the
    kernel's warps, `programs` its programs per row (default `programs_per_row`), `cap` the
    candidates kept per row (default `candidate_cap`; at least 3 * topk, a power of two; tests
    force the whole-row fallback with a small one). `counters`: [B * T, 2] int32 zeros (the
    caller may zero them earlier, off the selection's path); allocated here when None.
    """
    batch, tokens, slots = scores.shape
    rows = batch * tokens
    cap = cap or candidate_cap(topk)
    if cap < candidate_target(topk) or cap & (cap - 1):
        raise ValueError(f"select_topk_triton: cap must be a power of two >= 3 * topk = "
                         f"{candidate_target(topk)}, got {cap}")
    n_chunks = max(1, triton.cdiv(slots, chunk))
    programs = min(programs or programs_per_row(rows, n_chunks, scores.device), n_chunks)
    dev = scores.device
    if counters is None:
        counters = torch.zeros((rows, 2), dtype=torch.int32, device=dev)
    cand = torch.empty((rows, cap), dtype=torch.float32, device=dev)
    cand_slot = torch.empty((rows, cap), dtype=torch.int32, device=dev)
    kernel = _select_kernel[(rows, programs)](
        scores, lens, out, cand, cand_slot, counters, tokens, slots, programs, *lens.stride(),
        TOPK=topk, TARGET=candidate_target(topk), CAP=cap, CHUNK=chunk, SAMPLE_BLOCK=SAMPLE_BLOCK,
        MIN_RANK=MIN_SAMPLE_RANK, BLOCK=min(FINISH_BLOCK, cap), COMPILED=scores.is_cuda,
        num_warps=num_warps)
    return [kernel]
