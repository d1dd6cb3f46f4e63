"""The tile plan of one engine step: rows with an adapter, grouped by adapter slot.

Every multi-adapter computation of a step (the CPU LoRA ops, the ReFT-P update, the Triton
kernels in ``preft.kernels``) reads its rows through one :class:`TilePlan`, built once per step
from the per-row slots (``-1`` = no adapter): the rows that have an adapter, sorted by slot,
cut into tiles of ``tile_rows`` rows that each belong to one slot. That is the layout of a
segmented GEMM (punica's SGMV): per tile, one gather of rows and one of weights, one ``bmm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TILE_ROWS = 64  # rows per tile at most; fewer when the step's groups are small (decode)
# What one tile costs beyond its rows, in rows: its weight gather moves about rank x (in + out)
# floats, as much as 16 rows' (in + out) at rank 16.
TILE_OVERHEAD_ROWS = 16


@dataclass(frozen=True)
class TilePlan:
    """How the rows of one step with an adapter are grouped for batched matmuls.

    Single slot: every row is computed with that slot's weights and ``row_mask`` zeroes the
    rows without an adapter (cheaper than gathering them: the rank is small). Several slots:
    ``gather`` reads the rows into tiles of ``tile_rows`` rows of one slot each (a trailing
    tile of padding included), and ``untile`` reads the result back in row order, where a row
    without an adapter reads a padding position, whose shrunk value was zeroed by
    ``tile_mask``. No scatter: both moves are contiguous ``index_select`` s.
    """

    num_rows: int
    single_slot: int | None          # set when every row with an adapter uses this slot
    row_mask: torch.Tensor | None    # [num_rows, 1] (single slot, some rows without an adapter)
    gather: torch.Tensor | None      # [tiles * tile_rows] row read at each tile position
    tile_mask: torch.Tensor | None   # [tiles, tile_rows, 1] 1.0 at real positions, 0.0 at padding
    tile_slots: torch.Tensor | None  # [tiles] slot of each tile
    untile: torch.Tensor | None      # [num_rows] tile position of each row (a padding one if none)
    slots: frozenset[int] = frozenset()  # the slots the step uses
    tile_rows: int = MAX_TILE_ROWS


def build_tile_plan(indices: torch.Tensor, tile_rows: int | None = None) -> TilePlan | None:
    """The plan for per-row slots ``indices`` (``-1`` = no adapter); ``None`` if no row has one.

    ``tile_rows`` defaults to the size (at most :data:`MAX_TILE_ROWS`) that computes the fewest
    padded rows plus :data:`TILE_OVERHEAD_ROWS` per tile: one tile per prompt chunk when the
    chunks are that short (33-token prompts get tiles of 33, not two tiles of 32), tiles of a
    row or two for decode.
    """
    indices = indices.reshape(-1)
    num_rows = indices.numel()
    has_adapter = indices >= 0
    active = has_adapter.nonzero().squeeze(1)
    if active.numel() == 0:
        return None
    slots = indices.index_select(0, active)
    first = int(slots[0])
    if bool((slots == first).all()):
        mask = None if active.numel() == num_rows else has_adapter.to(torch.float32)[:, None]
        return TilePlan(num_rows, first, mask, None, None, None, None, frozenset([first]))
    slots, order = torch.sort(slots, stable=True)
    rows = active.index_select(0, order)
    group_slots, group_sizes = torch.unique_consecutive(slots, return_counts=True)
    if tile_rows is None:
        tile_rows = _cheapest_tile_rows(group_sizes)
    group_tiles = (group_sizes + tile_rows - 1) // tile_rows
    # one trailing tile of padding (slot 0, zero input) for the rows without an adapter to read
    tile_slots = torch.cat([group_slots.repeat_interleave(group_tiles), group_slots[:1]])
    # rank of each row inside its slot's group -> (its group's first tile + rank // tile, rank % tile)
    group_first_row = torch.cumsum(group_sizes, 0) - group_sizes
    rank = torch.arange(rows.numel(), device=rows.device) - group_first_row.repeat_interleave(group_sizes)
    group_first_tile = torch.cumsum(group_tiles, 0) - group_tiles
    position = (group_first_tile.repeat_interleave(group_sizes) + rank // tile_rows) * tile_rows + rank % tile_rows
    size = tile_slots.numel() * tile_rows
    gather = rows[:1].repeat(size)  # a padding position reads a real row; its shrunk value is zeroed
    gather[position] = rows
    tile_mask = torch.zeros(size, 1, dtype=torch.float32, device=rows.device)
    tile_mask[position] = 1.0
    untile = torch.full((num_rows,), size - 1, dtype=torch.long, device=rows.device)
    untile[rows] = position
    return TilePlan(num_rows, None, None, gather, tile_mask.view(-1, tile_rows, 1), tile_slots, untile,
                    frozenset(group_slots.tolist()), tile_rows)


def _cheapest_tile_rows(group_sizes: torch.Tensor) -> int:
    sizes = torch.arange(1, MAX_TILE_ROWS + 1, device=group_sizes.device)
    tiles = (group_sizes[None, :] + sizes[:, None] - 1).div(sizes[:, None], rounding_mode="floor").sum(1)
    return int(sizes[torch.argmin(tiles * (sizes + TILE_OVERHEAD_ROWS))])
