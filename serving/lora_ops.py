"""Correct, batched CPU LoRA ops for vLLM's punica wrapper (drop-in for ``lora/ops/torch_ops``).

vLLM 0.32's CPU ops gather one weight matrix *per token* (``weights[indices]``) and einsum: slot
``-1`` ("no adapter") silently selects the last adapter, and the gather copies ``tokens x out x
in`` floats. Prefill-only serving mixes adapter and no-adapter tokens in nearly every step.

These ops work from a :class:`TilePlan` of the step instead (the layout of a segmented-GEMM
kernel such as punica's SGMV, written with torch ops): the rows that have an adapter, sorted
by slot, cut into tiles of ``tile_rows`` rows that each belong to one slot. Per op: one
gather of the rows, one gather of the weights *per tile* (not per token), one ``bmm`` and one
gather of the result back into row order, whatever the number of adapters in the step; rows
with ``-1`` get nothing added (or zeros where the op overwrites its output). A step whose rows
all use one slot runs plain matmuls, accumulating into the output in place. The plan depends only on the step's per-token slots, so the punica wrapper builds it
once per step (:func:`install_planned_lora_linear`) and every LoRA layer of the step reuses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_TILE_ROWS = 64  # rows per tile at most; fewer when the step's groups are small (decode)


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
    tile_rows: int = MAX_TILE_ROWS


def build_tile_plan(indices: torch.Tensor, tile_rows: int | None = None) -> TilePlan | None:
    """The plan for per-row slots ``indices`` (``-1`` = no adapter); ``None`` if no row has one.

    ``tile_rows`` defaults to the power of two nearest the mean rows per slot (at most
    :data:`MAX_TILE_ROWS`): big tiles for prefill chunks, tiles of 1-2 rows for decode, so
    padding stays small either way.
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
        return TilePlan(num_rows, first, mask, None, None, None, None)
    slots, order = torch.sort(slots, stable=True)
    rows = active.index_select(0, order)
    group_slots, group_sizes = torch.unique_consecutive(slots, return_counts=True)
    if tile_rows is None:
        mean_rows = rows.numel() / group_slots.numel()
        tile_rows = min(MAX_TILE_ROWS, 1 << max(0, round(math.log2(mean_rows))))
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
    return TilePlan(num_rows, None, None, gather, tile_mask.view(-1, tile_rows, 1), tile_slots, untile, tile_rows)


def _weights(stacked: torch.Tensor, plan: TilePlan, dtype: torch.dtype) -> torch.Tensor:
    """Stacked weights ``[slots, (1,) out, in]`` as ``[out, in]`` (single slot) or ``[tiles, out, in]``."""
    stacked = stacked.flatten(0, 1) if stacked.dim() == 4 else stacked
    if plan.single_slot is not None:
        return stacked[plan.single_slot].to(dtype)
    return stacked.index_select(0, plan.tile_slots).to(dtype)


def tile_rows_of(x: torch.Tensor, plan: TilePlan) -> torch.Tensor:
    """``x`` ``[rows, in]`` as the plan computes it: as is (single slot) or ``[tiles, tile_rows, in]``."""
    if plan.single_slot is not None:
        return x
    return x.index_select(0, plan.gather).view(-1, plan.tile_rows, x.shape[-1])


def lora_shrink(tiled_x: torch.Tensor, lora_a: torch.Tensor, plan: TilePlan, scaling: float,
                dtype: torch.dtype) -> torch.Tensor:
    """``scaling * x @ A_slot^T``, zero for rows without an adapter, from ``tile_rows_of(x)``."""
    shrunk = torch.matmul(tiled_x.to(dtype), _weights(lora_a, plan, dtype).transpose(-1, -2))
    mask = plan.row_mask if plan.single_slot is not None else plan.tile_mask
    return shrunk.mul_(scaling if mask is None else mask * scaling)


def lora_expand_into(target: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, plan: TilePlan,
                     add: bool) -> None:
    """``target (+)= shrunk @ B_slot^T`` for every row (``shrunk`` from :func:`lora_shrink`)."""
    size = target.shape[-1]
    weight = _weights(lora_b, plan, target.dtype)[..., :size, :]
    shrunk = shrunk.to(target.dtype)
    if plan.single_slot is not None:  # accumulate in place: one pass over the output
        target.addmm_(shrunk, weight.t(), beta=1.0 if add else 0.0)
        return
    expanded = torch.bmm(shrunk, weight.transpose(1, 2)).view(-1, size).index_select(0, plan.untile)
    target.add_(expanded) if add else target.copy_(expanded)


def planned_lora_linear(y, x, plan: TilePlan | None, lora_a_stacked, lora_b_stacked, scale: float,
                        output_slices) -> None:
    """``y[:, slices] += scale * x @ A_slot^T @ B_slot^T`` for every row with an adapter (all slices)."""
    if plan is None:
        return
    y = y.view(-1, y.shape[-1])[: plan.num_rows]
    x = x.view(-1, x.shape[-1])[: plan.num_rows]
    tiled_x = tile_rows_of(x, plan)  # shared by the slices (q/k/v, gate/up)
    offset = 0
    for lora_a, lora_b, size in zip(lora_a_stacked, lora_b_stacked, output_slices):
        shrunk = lora_shrink(tiled_x, lora_a, plan, scale, torch.float32)  # float32 like vLLM's buffers
        lora_expand_into(y[:, offset: offset + size], shrunk, lora_b, plan, add=True)
        offset += size


# vLLM's op signatures, for the punica wrapper's other callers (embeddings, logits, sharded layers)


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    rank = lora_a_weights.shape[-2]
    target = output_tensor[: inputs.shape[0], :rank]
    plan = build_tile_plan(lora_indices_tensor[: inputs.shape[0]])
    if plan is None:
        target.zero_()
        return
    shrunk = lora_shrink(tile_rows_of(inputs, plan), lora_a_weights, plan, scaling, output_tensor.dtype)
    target.copy_(shrunk if plan.single_slot is not None else shrunk.view(-1, rank).index_select(0, plan.untile))


def _expand(inputs, lora_b_weights, output_tensor, indices, offset, size, add_inputs):
    target = output_tensor[: inputs.shape[0], offset: offset + size]
    plan = build_tile_plan(indices[: inputs.shape[0]])
    if plan is None:
        if not add_inputs:
            target.zero_()
        return
    mask = plan.row_mask if plan.single_slot is not None else plan.tile_mask
    shrunk = tile_rows_of(inputs, plan)  # already shrunk rows, tiled the way lora_shrink does
    shrunk = shrunk if mask is None else shrunk * mask
    lora_expand_into(target, shrunk, lora_b_weights, plan, add=add_inputs)


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    size = min(lora_b_weights.shape[-2], output_tensor.shape[1])
    _expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, 0, size, add_inputs)


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):
    _expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs)


def _explode(lora_indices_tensor, seq_len_tensor):
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, scaling):
    bgmv_shrink(inputs, lora_a_weights, output_tensor, _explode(lora_indices_tensor[:batches], seq_len_tensor[:batches]),
                scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, add_inputs=False):
    bgmv_expand(inputs, lora_b_weights, output_tensor,
                _explode(lora_indices_tensor[:batches], seq_len_tensor[:batches]), add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor,
                      _explode(lora_indices_tensor[:batches], seq_len_tensor[:batches]), slice_offset, slice_size,
                      add_inputs)


def install_planned_lora_linear(wrapper_cls) -> None:
    """Make ``wrapper_cls`` (vLLM's ``PunicaWrapperCPU``) build a :class:`TilePlan` per step and
    run every LoRA linear layer from it: a step with no adapter row (decode under LoRA-P) does
    no LoRA work at all."""
    original_update = wrapper_cls.update_metadata

    def update_metadata(self, *args, **kwargs):
        original_update(self, *args, **kwargs)
        self.preft_plan = build_tile_plan(self.token_lora_indices)

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, **kwargs):
        planned_lora_linear(y, x, getattr(self, "preft_plan", None), lora_a_stacked, lora_b_stacked, scale,
                            output_slices)

    wrapper_cls.update_metadata = update_metadata
    wrapper_cls.add_lora_linear = add_lora_linear
