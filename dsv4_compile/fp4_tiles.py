"""The tiled layout of FP4 expert weights: packed codes stored tile by tile.

A matrix of FP4 values [R, C] (packed bytes [R, C/2]) is cut into tiles of TILE_ROWS rows x
TILE_COLS values, and each tile is stored contiguously: the tiled codes of E experts are
[E, R/TILE_ROWS, C/TILE_COLS, TILE_ROWS, TILE_COLS/2]; byte (r, b) of the row-major form is byte
(r // TILE_ROWS, b // (TILE_COLS/2), r % TILE_ROWS, b % (TILE_COLS/2)) of the tiled one. The block
scales stay row-major ([E, R, C/G]): a step reads a few bytes of each row, and the 32-byte sectors
that brings in serve the next steps from cache. (Scales tiled like the codes, a step's scales one
contiguous piece, made the mma kernels 1-7% slower on the H200: bench/RESULTS.md, twelfth session.)

Within each 32-bit word (8 codes: code j at bits 4j..4j+3 of the little-endian word in the row-major
form) the tiled layout also moves the 32 bits (`SWIZZLED_BIT`), so that the mma path decodes a word
with 9 integer operations instead of 13 (kernels/fp4_moe.py, `_e2m1_pair_bits_swizzled`). Words never
cross tile rows (a tile row is TILE_COLS / 8 words), so the two steps commute.

Why: the fp4_moe kernels read a few weight rows x TILE_COLS values per K step. In the row-major
layout those are 64-byte pieces of rows 2 KB apart; the H200 then streamed the weights at about
half of its bandwidth, and at about 0.7 of it when every step's rows were one contiguous 2 KB tile
(bench/RESULTS.md, sixth session). `Fp4Experts.tile_()` converts a model's experts in place and
`optimize()` does it for every experts module whose sizes split into tiles.
"""
from __future__ import annotations

import torch

TILE_ROWS = 32
TILE_COLS = 128  # a multiple of TILE_ROWS (experts_split_into_tiles)

# SWIZZLED_BIT[4 j + b]: the tiled word's bit that holds bit b (0: mantissa, 1 and 2: exponent, 3: sign)
# of code j. The mma decode needs codes Q and Q + 4 at bits 6..8 and 15, and 22..24 and 31 (two bf16
# magnitudes and signs, `_e2m1_pair_bits`): code pair 0 sits there already, pairs 1 and 2 sit there
# after a rotation right by 3 and 6 bits, and pair 3 in bits 0, 1, 3, 4 and 16, 17, 19, 20, which a
# multiply by 0x1084 (copies shifted by 2, 7 and 12 bits, no carries) takes there.
SWIZZLED_BIT = (6, 7, 8, 15, 9, 10, 11, 18, 12, 13, 14, 21, 4, 0, 1, 3,
                22, 23, 24, 31, 25, 26, 27, 2, 28, 29, 30, 5, 20, 16, 17, 19)
SWIZZLE_CHUNK = 16  # experts a swizzle pass takes at a time (bounds its int32 temporaries)


def _int32(value: int) -> int:
    """A 32-bit pattern as the signed int torch's int32 ops take."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _shift_groups(to_bit: tuple[int, ...]) -> list[tuple[int, int]]:
    """(shift, destination mask) for each distance the bit map moves bits by."""
    groups: dict[int, int] = {}
    for source, dest in enumerate(to_bit):
        groups[dest - source] = groups.get(dest - source, 0) | 1 << dest
    return sorted(groups.items())


_SWIZZLE = _shift_groups(SWIZZLED_BIT)
_UNSWIZZLE = _shift_groups(tuple(SWIZZLED_BIT.index(bit) for bit in range(32)))


def _move_bits(words: torch.Tensor, groups: list[tuple[int, int]]) -> torch.Tensor:
    """int32 words with every bit moved by its group's shift (left for > 0) into the group's mask."""
    out = None
    for shift, mask in groups:
        moved = (words << shift) if shift > 0 else (words >> -shift)  # >> sign-extends: the mask drops it
        moved = moved & _int32(mask)
        out = moved if out is None else out | moved
    return out


def _words(packed: torch.Tensor) -> torch.Tensor:
    """Packed codes uint8 [E, ..., B] (B a multiple of 4) -> the same memory as int32 [E, ..., B/4]
    (contiguous; a copy only where packed is not)."""
    if packed.dtype != torch.uint8 or packed.ndim < 2 or packed.shape[-1] % 4:
        raise ValueError(f"packed FP4 codes must be uint8 [experts, ..., bytes] with a multiple of 4 bytes a "
                         f"row, got {packed.dtype} {tuple(packed.shape)}")
    return packed.contiguous().view(torch.int32)


def swizzle_words(packed: torch.Tensor) -> torch.Tensor:
    """Packed codes uint8 [E, ..., C/2] (row-major bit order) -> a new tensor of the same shape with each
    32-bit word's bits in the tiled layout's order (SWIZZLED_BIT), made SWIZZLE_CHUNK experts at a time."""
    words = _words(packed)
    out = torch.empty_like(words)
    for start in range(0, words.shape[0], SWIZZLE_CHUNK):
        out[start:start + SWIZZLE_CHUNK] = _move_bits(words[start:start + SWIZZLE_CHUNK], _SWIZZLE)
    return out.view(torch.uint8)


def unswizzle_words(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of swizzle_words, in one pass of elementwise ops (the model's plain-torch MoE traces it)."""
    return _move_bits(_words(packed), _UNSWIZZLE).view(torch.uint8)


def experts_split_into_tiles(hidden: int, inter: int) -> bool:
    """Whether experts of hidden size K and intermediate size I split into whole tiles: K and I
    multiples of TILE_COLS (a multiple of TILE_ROWS, so the w13 rows, 2I, and its up half, which
    starts at row I, align to tiles too)."""
    return hidden % TILE_COLS == 0 and inter % TILE_COLS == 0


def is_tiled(packed: torch.Tensor) -> bool:
    """Whether a packed FP4 expert tensor is in the tiled layout (5-D) rather than [E, R, C/2]."""
    return packed.ndim == 5


def tile_matrix(t: torch.Tensor, units_per_tile_row: int) -> torch.Tensor:
    """[E, R, U] (U units per row, e.g. bytes) -> [E, R/TILE_ROWS, U/u, TILE_ROWS, u]
    contiguous, u = units_per_tile_row. R and U must be multiples of TILE_ROWS and u."""
    experts, rows, units = t.shape
    if rows % TILE_ROWS or units % units_per_tile_row:
        raise ValueError(f"tile_matrix: [{experts}, {rows}, {units}] does not split into tiles of "
                         f"{TILE_ROWS} rows x {units_per_tile_row} units")
    tiles = t.reshape(experts, rows // TILE_ROWS, TILE_ROWS, units // units_per_tile_row, units_per_tile_row)
    return tiles.transpose(2, 3).contiguous()


def untile_matrix(t: torch.Tensor) -> torch.Tensor:
    """The inverse of tile_matrix over the last four dims: [..., R/TR, U/u, TR, u] -> [..., R, U] (a copy)."""
    *lead, row_tiles, col_tiles, tile_rows, tile_units = t.shape
    return t.transpose(-3, -2).reshape(*lead, row_tiles * tile_rows, col_tiles * tile_units)


def logical_shape(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(E, R, U) of a row-major [E, R, U] tensor or of its tiled form; None for any other rank."""
    if t.ndim == 5:
        return t.shape[0], t.shape[1] * t.shape[3], t.shape[2] * t.shape[4]
    return tuple(t.shape) if t.ndim == 3 else None


def tile_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed codes uint8 [E, R, C/2] -> the tiled form (module docstring: tiles, bits swizzled). R must be
    a multiple of TILE_ROWS and C of TILE_COLS."""
    return swizzle_words(tile_matrix(packed, TILE_COLS // 2))  # tile_matrix may return packed itself


def untile_fp4(tiled: torch.Tensor) -> torch.Tensor:
    """The inverse of tile_fp4 over the last four dims: uint8 [..., R/TR, C/TC, TR, TC/2] -> [..., R, C/2]."""
    return untile_matrix(unswizzle_words(tiled))
