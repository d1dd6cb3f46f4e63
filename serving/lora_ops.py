"""Correct, grouped CPU LoRA ops for vLLM's punica wrapper (drop-in for ``lora/ops/torch_ops``).

vLLM 0.32's CPU ops gather one weight matrix *per token* (``weights[indices]``) and einsum: slot
``-1`` ("no adapter") silently selects the last adapter, and the gather copies ``tokens x out x
in`` floats. Prefill-only serving mixes adapter and no-adapter tokens in nearly every step, so
these replacements group the rows by slot: one matmul per adapter present, rows with ``-1``
untouched (or zeroed where the op overwrites its output).
"""

from __future__ import annotations

import torch


def _slot_rows(indices: torch.Tensor):
    """``(slot, rows)`` for every adapter slot >= 0 present in ``indices``."""
    indices = indices.reshape(-1)
    slots = torch.unique(indices)
    for slot in slots.tolist():
        if slot < 0:
            continue
        if slots.numel() == 1:
            yield slot, None  # every row uses this slot: no gather needed
        else:
            yield slot, (indices == slot).nonzero().squeeze(1)


def _weight(weights: torch.Tensor, slot: int) -> torch.Tensor:
    weight = weights[slot]
    return weight.squeeze(0) if weight.dim() == 3 else weight  # [out, in]


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    rank = lora_a_weights.shape[-2]
    rows_out = output_tensor[: inputs.shape[0], :rank]
    indices = lora_indices_tensor[: inputs.shape[0]]
    if (indices < 0).any():
        rows_out.zero_()
    for slot, rows in _slot_rows(indices):
        weight = _weight(lora_a_weights, slot).to(output_tensor.dtype)
        x = inputs if rows is None else inputs.index_select(0, rows)
        result = scaling * (x.to(output_tensor.dtype) @ weight.t())
        if rows is None:
            rows_out.copy_(result)
        else:
            rows_out.index_copy_(0, rows, result)


def _expand(inputs, lora_b_weights, output_tensor, indices, offset, size, add_inputs):
    indices = indices[: inputs.shape[0]]
    target = output_tensor[: inputs.shape[0], offset: offset + size]
    if not add_inputs and (indices < 0).any():
        target.zero_()
    for slot, rows in _slot_rows(indices):
        weight = _weight(lora_b_weights, slot).to(output_tensor.dtype)[:size]
        x = inputs if rows is None else inputs.index_select(0, rows)
        result = x.to(output_tensor.dtype) @ weight.t()
        if rows is None:
            target.add_(result) if add_inputs else target.copy_(result)
        elif add_inputs:
            target.index_add_(0, rows, result)
        else:
            target.index_copy_(0, rows, result)


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
