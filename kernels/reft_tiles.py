"""Triton kernel for the ReFT-P edit of one step, over the rows of a ``TilePlan``.

Torch reference: :func:`preft.serving.reft.reft_edit`, same arguments, same result. For every
row with a bank slot ``s`` (prompt tokens whose position the rule makes active), in place:

    h      = hidden[row] + residual[row]            (the residual stream after the layer)
    hidden[row] += P_s^T (W_s h + b_s - k_s P_s h)   (LoReFT: P = R, k = 1; DiReFT: P = W2, k = 0)

One launch per layer, one program per tile of rows of one slot. A program loops twice over the
hidden size: first ``[W_s h ; P_s h]`` (the slot's ``[2r, d]`` block read once per tile of rows),
then ``edit @ P_s`` added to the tile's rows of ``hidden``. Each row with a slot sits at exactly
one tile position, so the read-add-write needs no atomics; padding positions write nothing.
Accumulation is in float32 whatever ``hidden``'s dtype. On CPU the kernel runs only under
``TRITON_INTERPRET=1`` (the tests); serving on CPU uses the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from preft.kernels.lora_tiles import _this_tile, _tiles_of
from preft.serving.tile_plan import TilePlan

BLOCK_D = 32  # hidden features per step of the two loops


@triton.jit
def _reft_kernel(hidden_ptr, residual_ptr, gather_ptr, mask_ptr, slots_ptr, w_ptr, bias_ptr, sign_ptr,
                 size, rank, tile_rows,
                 stride_hm, stride_hd, stride_rm, stride_rd, stride_ws, stride_wk, stride_wd, stride_bs,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    in_tile, position, rows, real, slot = _this_tile(gather_ptr, mask_ptr, slots_ptr, tile_rows, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    in_rank = offs_r < rank
    source = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)     # W_s h
    projected = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)  # P_s h
    w_base = w_ptr + slot * stride_ws
    for d0 in range(0, size, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        in_size = offs_d < size
        load_rows = in_tile[:, None] & in_size[None, :]
        h = tl.load(hidden_ptr + rows[:, None] * stride_hm + offs_d[None, :] * stride_hd, mask=load_rows, other=0.0)
        h = h.to(tl.float32) + tl.load(residual_ptr + rows[:, None] * stride_rm + offs_d[None, :] * stride_rd,
                                       mask=load_rows, other=0.0).to(tl.float32)
        block = in_size[:, None] & in_rank[None, :]
        w_t = tl.load(w_base + offs_r[None, :] * stride_wk + offs_d[:, None] * stride_wd, mask=block, other=0.0)
        p_t = tl.load(w_base + (rank + offs_r[None, :]) * stride_wk + offs_d[:, None] * stride_wd,
                      mask=block, other=0.0)
        source += tl.dot(h, w_t.to(tl.float32), input_precision="ieee")
        projected += tl.dot(h, p_t.to(tl.float32), input_precision="ieee")
    bias = tl.load(bias_ptr + slot * stride_bs + offs_r, mask=in_rank, other=0.0).to(tl.float32)
    sign = tl.load(sign_ptr + slot).to(tl.float32)
    edit = source + bias[None, :] - sign * projected  # padding positions: computed, never stored
    write = in_tile & (real > 0)
    for d0 in range(0, size, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        in_size = offs_d < size
        p = tl.load(w_base + (rank + offs_r[:, None]) * stride_wk + offs_d[None, :] * stride_wd,
                    mask=in_rank[:, None] & in_size[None, :], other=0.0)
        delta = tl.dot(edit, p.to(tl.float32), input_precision="ieee")
        pointers = hidden_ptr + rows[:, None] * stride_hm + offs_d[None, :] * stride_hd
        mask = write[:, None] & in_size[None, :]
        old = tl.load(pointers, mask=mask, other=0.0)
        tl.store(pointers, (old.to(tl.float32) + delta).to(hidden_ptr.dtype.element_ty), mask=mask)


def triton_reft_edit(hidden: torch.Tensor, residual: torch.Tensor, plan: TilePlan | None, weights: torch.Tensor,
                     bias: torch.Tensor, sign: torch.Tensor, rank: int) -> torch.Tensor:
    """``hidden[row] += P_s^T (W_s h + b_s - k_s P_s h)`` for every row of ``plan``, in place;
    the arguments of :func:`preft.serving.reft.reft_edit`."""
    if plan is None:
        return hidden
    gather, mask, tile_slots, tile_rows = _tiles_of(plan, hidden.device)
    tiles = tile_slots.numel()
    _reft_kernel[(tiles,)](
        hidden, residual, gather, mask, tile_slots, weights, bias, sign,
        hidden.shape[-1], rank, tile_rows,
        hidden.stride(0), hidden.stride(1), residual.stride(0), residual.stride(1),
        weights.stride(0), weights.stride(1), weights.stride(2), bias.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(tile_rows)), BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_D=BLOCK_D)
    return hidden
