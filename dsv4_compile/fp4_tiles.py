"""The tiled layout of FP4 expert weights: packed codes stored tile by tile.

A matrix of FP4 values [R, C] (packed bytes [R, C/2]) is cut into tiles of TILE_ROWS rows x
TILE_COLS values, and each tile is stored contiguously: the tiled codes of E experts are
[E, R/TILE_ROWS, C/TILE_COLS, TILE_ROWS, TILE_COLS/2]; byte (r, b) of the row-major form is byte
(r // TILE_ROWS, b // (TILE_COLS/2), r % TILE_ROWS, b % (TILE_COLS/2)) of the tiled one. The block
scales stay row-major ([E, R, C/G]): a step reads a few bytes of each row, and the 32-byte sectors
that brings in serve the next steps from cache. (Scales tiled like the codes, a step's scales one
contiguous piece, made the mma kernels 1-7% slower on the H200: bench/RESULTS.md, twelfth session.)

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
    """Packed codes uint8 [E, R, C/2] -> the tiled form (module docstring). R must be a multiple of
    TILE_ROWS and C of TILE_COLS."""
    return tile_matrix(packed, TILE_COLS // 2)
