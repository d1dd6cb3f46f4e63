"""The tile plan of one engine step: rows with an adapter, grouped by adapter slot.

Every multi-adapter computation of a step (the CPU LoRA ops, the ReFT-P update, the Triton
kernels in ``preft.kernels``) reads its rows through one :class:`TilePlan`, built once per step
from the per-row slots (``-1`` = no adapter): the rows that have an adapter, sorted by slot,
cut into tiles of ``tile_rows`` rows that each belong to one slot. That is the layout of a
segmented GEMM (punica's SGMV): per tile, one gather of rows and one of weights, one ``bmm``.
Rows without an adapter take no part: they are not gathered, and results are added back
into the adapter rows alone (:meth:`TilePlan.add_into_rows`).
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

    Isolation: a row without an adapter is never computed with adapter weights, and nothing
    computed from adapter weights is ever written into it. The rows that have one are gathered
    (``rows``), computed, and added back into exactly those rows (``index_add_``): never a
    product with a 0/1 mask, which would turn one adapter's NaN or inf into every row's NaN.

    Single slot: ``rows`` (or every row, when ``rows`` is None) with that slot's weights, plain
    matmuls. Several slots: ``gather`` reads the rows with an adapter into tiles of
    ``tile_rows`` rows of one slot each (a group's last tile padded with copies of a row of
    the step: their results are computed and never read back), and ``positions`` says which
    tile position holds each of ``rows``.
    """

    num_rows: int
    single_slot: int | None          # set when every row with an adapter uses this slot
    rows: torch.Tensor | None        # [active] the rows with an adapter, in tile order; None: all (single slot)
    gather: torch.Tensor | None      # [tiles * tile_rows] row read at each tile position (several slots)
    positions: torch.Tensor | None   # [active] tile position of each of ``rows`` (several slots)
    tile_slots: torch.Tensor | None  # [tiles] slot of each tile (several slots)
    slots: frozenset[int] = frozenset()  # the slots the step uses
    tile_rows: int = MAX_TILE_ROWS

    @property
    def num_active(self) -> int:
        """How many rows have an adapter."""
        return self.num_rows if self.rows is None else self.rows.numel()

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of ``x`` ``[rows, in]`` that have an adapter, laid out for computing:
        ``[active, in]`` (single slot) or ``[tiles, tile_rows, in]``."""
        if self.single_slot is not None:
            return x if self.rows is None else x.index_select(0, self.rows)
        return x.index_select(0, self.gather).view(-1, self.tile_rows, x.shape[-1])

    def back_to_rows(self, computed: torch.Tensor) -> torch.Tensor:
        """``computed`` (in :meth:`rows_of`'s layout) as ``[active, out]`` in the order of
        ``rows``; a tile's padding positions are dropped here, unread."""
        if self.single_slot is not None:
            return computed
        return computed.reshape(-1, computed.shape[-1]).index_select(0, self.positions)

    def add_into_rows(self, target: torch.Tensor, values: torch.Tensor) -> None:
        """``target[rows] += values`` (``values`` from :meth:`back_to_rows`): the rows without
        an adapter are not touched."""
        if self.rows is None:
            target.add_(values)
        else:
            target.index_add_(0, self.rows, values)

    def real_positions(self) -> torch.Tensor:
        """``[tiles * tile_rows]`` bool: the tile positions that hold a row with an adapter (the
        kernels' store mask; the padding positions are computed and never written)."""
        real = torch.zeros(self.tile_slots.numel() * self.tile_rows, dtype=torch.bool, device=self.gather.device)
        real[self.positions] = True
        return real


def build_tile_plan(indices: torch.Tensor, tile_rows: int | None = None) -> TilePlan | None:
    """The plan for per-row slots ``indices`` (``-1`` = no adapter); ``None`` if no row has one.

    ``tile_rows`` defaults to the size (at most :data:`MAX_TILE_ROWS`) that computes the fewest
    padded rows plus :data:`TILE_OVERHEAD_ROWS` per tile: one tile per prompt chunk when the
    chunks are that short (33-token prompts get tiles of 33, not two tiles of 32), tiles of a
    row or two for decode.
    """
    indices = indices.reshape(-1)
    num_rows = indices.numel()
    active = (indices >= 0).nonzero().squeeze(1)
    if active.numel() == 0:
        return None
    slots = indices.index_select(0, active)
    first = int(slots[0])
    if bool((slots == first).all()):
        return TilePlan(num_rows, first, None if active.numel() == num_rows else active, None, None, None,
                        frozenset([first]))
    slots, order = torch.sort(slots, stable=True)
    rows = active.index_select(0, order)
    group_slots, group_sizes = torch.unique_consecutive(slots, return_counts=True)
    if tile_rows is None:
        tile_rows = _cheapest_tile_rows(group_sizes)
    group_tiles = (group_sizes + tile_rows - 1) // tile_rows
    tile_slots = group_slots.repeat_interleave(group_tiles)
    # rank of each row inside its slot's group -> (its group's first tile + rank // tile, rank % tile)
    group_first_row = torch.cumsum(group_sizes, 0) - group_sizes
    rank = torch.arange(rows.numel(), device=rows.device) - group_first_row.repeat_interleave(group_sizes)
    group_first_tile = torch.cumsum(group_tiles, 0) - group_tiles
    positions = (group_first_tile.repeat_interleave(group_sizes) + rank // tile_rows) * tile_rows + rank % tile_rows
    gather = rows[:1].repeat(tile_slots.numel() * tile_rows)  # padding reads a real row; never read back
    gather[positions] = rows
    return TilePlan(num_rows, None, rows, gather, positions, tile_slots, frozenset(group_slots.tolist()), tile_rows)


def _cheapest_tile_rows(group_sizes: torch.Tensor) -> int:
    sizes = torch.arange(1, MAX_TILE_ROWS + 1, device=group_sizes.device)
    tiles = (group_sizes[None, :] + sizes[:, None] - 1).div(sizes[:, None], rounding_mode="floor").sum(1)
    return int(sizes[torch.argmin(tiles * (sizes + TILE_OVERHEAD_ROWS))])
