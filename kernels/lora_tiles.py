"""Triton kernels for the multi-adapter LoRA of one step, over the rows of a ``TilePlan``.

Torch reference: :func:`preft.serving.lora_ops.planned_lora_linear`, same arguments, same
result. The torch ops copy each tile's rows and weights, multiply, and copy the result back
into row order; these two kernels (punica's SGMV shrink/expand, fitted to the tile plan)
read the rows and the slot's weights where they lie and add into the output rows in place:

- ``_shrink_kernel``, one program per (tile, block of the shrunk width):
  ``shrunk[tile position] = scale * x[row] @ A[slot]^T`` for all of a layer's slices at
  once (``A`` = the A's side by side, :class:`~preft.serving.lora_ops.PlannedLoraWeights`);
- ``_expand_kernel``, one program per (tile, block of a slice's outputs):
  ``y[row, slice] += shrunk[tile position, slice's rank] @ B[slot]^T``. Every row with an
  adapter sits at exactly one tile position and column blocks do not overlap, so the
  read-add-write needs no atomics; padding positions write nothing.

Rows without an adapter (``-1``, every generated token under LoRA-P) are in no tile: never read,
never written (stores are masked by position, no 0/1 mask multiplies a value). On CPU the
kernels run only under ``TRITON_INTERPRET=1`` (for the tests); serving on CPU uses the torch
ops, and vLLM's GPU punica kernels serve LoRA on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from preft.serving.lora_ops import PlannedLoraWeights
from preft.serving.tile_plan import TilePlan

BLOCK_N = 32       # output columns per program
BLOCK_K_IN = 32    # input features per step of the shrink's loop
SINGLE_SLOT_TILE_ROWS = 64  # a one-slot plan has no tiles; these kernels cut its rows into tiles of 64


@triton.jit
def _this_tile(gather_ptr, mask_ptr, slots_ptr, tile_rows, BLOCK_M: tl.constexpr):
    """This program's tile: which positions exist, their rows, 1.0 where real, and the slot."""
    tile = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    in_tile = offs_m < tile_rows
    position = tile * tile_rows + offs_m
    rows = tl.load(gather_ptr + position, mask=in_tile, other=0)
    real = tl.load(mask_ptr + position, mask=in_tile, other=0.0)
    return in_tile, position, rows, real, tl.load(slots_ptr + tile)


@triton.jit
def _shrink_kernel(x_ptr, gather_ptr, mask_ptr, slots_ptr, a_ptr, out_ptr,
                   size_in, width, tile_rows, scale,
                   stride_xm, stride_xk, stride_as, stride_ak, stride_an,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    in_tile, position, rows, real, slot = _this_tile(gather_ptr, mask_ptr, slots_ptr, tile_rows, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, size_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=in_tile[:, None] & (offs_k[None, :] < size_in), other=0.0)
        a = tl.load(a_ptr + slot * stride_as + offs_k[:, None] * stride_ak + offs_n[None, :] * stride_an,
                    mask=(offs_k[:, None] < size_in) & (offs_n[None, :] < width), other=0.0)
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    acc = acc * scale  # padding positions too: computed, never written into a row
    tl.store(out_ptr + position[:, None] * width + offs_n[None, :], acc,
             mask=in_tile[:, None] & (offs_n[None, :] < width))


@triton.jit
def _expand_kernel(shrunk_ptr, gather_ptr, mask_ptr, slots_ptr, b_ptr, y_ptr,
                   rank, shrunk_width, first_column, size, tile_rows,
                   stride_bs, stride_bk, stride_bn, stride_ym, stride_yn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    in_tile, position, rows, real, slot = _this_tile(gather_ptr, mask_ptr, slots_ptr, tile_rows, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    shrunk = tl.load(shrunk_ptr + position[:, None] * shrunk_width + first_column + offs_k[None, :],
                     mask=in_tile[:, None] & (offs_k[None, :] < rank), other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                mask=(offs_k[:, None] < rank) & (offs_n[None, :] < size), other=0.0)
    expanded = tl.dot(shrunk, b.to(tl.float32), input_precision="ieee")
    write = (in_tile & (real > 0))[:, None] & (offs_n[None, :] < size)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    old = tl.load(y_ptrs, mask=write, other=0.0)
    tl.store(y_ptrs, (old.to(tl.float32) + expanded).to(y_ptr.dtype.element_ty), mask=write)


def _tiles_of(plan: TilePlan, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(gather, real, tile_slots, tile_rows)`` of ``plan``: the row read at each tile position,
    1.0 where that position holds a row with an adapter (the only positions written), each
    tile's slot; a one-slot plan's adapter rows are cut into tiles of 64 here."""
    if plan.single_slot is None:
        return plan.gather, plan.real_positions().float(), plan.tile_slots, plan.tile_rows
    tile_rows = SINGLE_SLOT_TILE_ROWS
    rows = plan.rows if plan.rows is not None else torch.arange(plan.num_rows, device=device)
    tiles = triton.cdiv(rows.numel(), tile_rows)
    gather = rows[:1].repeat(tiles * tile_rows)
    gather[: rows.numel()] = rows
    real = torch.zeros(tiles * tile_rows, dtype=torch.float32, device=device)
    real[: rows.numel()] = 1.0
    return gather, real, torch.full((tiles,), plan.single_slot, dtype=torch.long, device=device), tile_rows


def triton_planned_lora_linear(y, x, plan: TilePlan | None, weights: PlannedLoraWeights, scale: float) -> None:
    """``y[:, slice j] += scale * x @ A_j,slot^T @ B_j,slot^T`` for every row with an adapter (in place)."""
    if plan is None:
        return
    y = y.view(-1, y.shape[-1])[: plan.num_rows]
    x = x.view(-1, x.shape[-1])[: plan.num_rows]
    gather, mask, tile_slots, tile_rows = _tiles_of(plan, x.device)
    tiles, width, rank = tile_slots.numel(), weights.a.shape[1], weights.rank
    block_m = max(16, triton.next_power_of_2(tile_rows))
    shrunk = torch.empty(tiles * tile_rows, width, dtype=torch.float32, device=x.device)
    a = weights.a  # [slots, width, in]: the kernel reads it as A^T through the strides
    _shrink_kernel[(tiles, triton.cdiv(width, BLOCK_N))](
        x, gather, mask, tile_slots, a, shrunk, x.shape[-1], width, tile_rows, scale,
        x.stride(0), x.stride(1), a.stride(0), a.stride(2), a.stride(1),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K_IN)
    offset = 0
    for j, b in enumerate(weights.b):  # [slots, out_j, rank], read as B^T
        size = b.shape[1]
        target = y[:, offset: offset + size]
        _expand_kernel[(tiles, triton.cdiv(size, BLOCK_N))](
            shrunk, gather, mask, tile_slots, b, target, rank, width, j * rank, size, tile_rows,
            b.stride(0), b.stride(2), b.stride(1), target.stride(0), target.stride(1),
            BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=max(16, triton.next_power_of_2(rank)))
        offset += size
