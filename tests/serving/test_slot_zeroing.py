"""Slot writes skip vLLM's zeroing only where nothing it would zero survives (serving/slot_zeroing.py)."""

from __future__ import annotations

from inspect import unwrap

import torch

from preft.serving.slot_zeroing import reset_lora_when_needed, set_lora_filling


def merged_layer(real_resets: list[int], rank=4, size_in=6, outs=(5, 3), slots=3):
    """vLLM's merged-column LoRA layer (its own set_lora and reset_lora bodies) with the two
    wrappers around them, stacks allocated as vLLM does, and a record of the real resets."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.layers.column_parallel_linear import MergedColumnParallelLinearWithLoRA

    vllm_reset, vllm_set = unwrap(BaseLinearLayerWithLoRA.reset_lora), unwrap(MergedColumnParallelLinearWithLoRA.set_lora)

    def counted_reset(layer, index):
        real_resets.append(index)
        vllm_reset(layer, index)

    class Layer(MergedColumnParallelLinearWithLoRA):
        def reset_lora(self, index):
            return reset_lora_when_needed(counted_reset, self, index)

        def set_lora(self, index, lora_a, lora_b):
            return set_lora_filling(vllm_set, self, index, lora_a, lora_b)

    layer = Layer.__new__(Layer)
    torch.nn.Module.__init__(layer)
    layer.n_slices, layer.tp_size = len(outs), 1
    layer.lora_a_stacked = tuple(torch.zeros(slots, 1, rank, size_in) for _ in outs)
    layer.lora_b_stacked = tuple(torch.zeros(slots, 1, size, rank) for size in outs)
    return layer


def adapter(rank, size_in=6, outs=(5, 3)):
    return [torch.randn(rank, size_in) for _ in outs], [torch.randn(size, rank) for size in outs]


def slot(layer, index):
    return [t[index, 0].clone() for t in layer.lora_a_stacked + layer.lora_b_stacked]


def test_a_full_rank_write_skips_the_zeroing_and_a_smaller_one_still_zeroes_the_rest():
    torch.manual_seed(0)
    resets = []
    layer = merged_layer(resets)
    full_a, full_b = adapter(4)
    layer.set_lora(0, full_a, full_b)
    assert resets == [] and all(torch.equal(got, want) for got, want in zip(slot(layer, 0), full_a + full_b))
    small_a, small_b = adapter(2)
    layer.set_lora(0, small_a, small_b)  # rank 2 into a slot that held rank 4: the rest must be zero
    assert resets == [0]
    for got, want in zip(slot(layer, 0), small_a + small_b):
        expected = torch.zeros_like(got)
        expected[: want.shape[0], : want.shape[1]] = want
        assert torch.equal(got, expected)
    layer.set_lora(1, full_a, [full_b[0], None])  # a slice without B: not a full write
    assert resets == [0, 1]


def test_a_reset_is_skipped_only_while_nothing_was_written_since_the_last_one():
    torch.manual_seed(0)
    resets = []
    layer = merged_layer(resets)
    layer.reset_lora(1)
    layer.reset_lora(1)  # zero already
    assert resets == [1]
    layer.set_lora(2, *adapter(4))  # a write anywhere: the next reset is a real one
    layer.reset_lora(1)
    assert resets == [1, 1]
    layer.set_lora(1, *adapter(4))
    layer.reset_lora(1)  # the slot holds an adapter: zeroed for real
    assert resets == [1, 1, 1] and all(not t.any() for t in slot(layer, 1))
    layer.lora_a_stacked[0][1, 0, 0, 0] = 5.0  # anyone's write is seen too
    layer.reset_lora(1)
    assert resets == [1, 1, 1, 1] and all(not t.any() for t in slot(layer, 1))


def test_a_full_write_lands_in_the_stacks_after_the_planned_ops_reseat_them():
    """The planned LoRA ops re-seat a merged layer's A stacks onto one joined tensor; slot views
    kept from before that would write into the old memory, where no op reads."""
    from preft.serving.lora_ops import PlannedLoraWeights

    torch.manual_seed(0)
    layer = merged_layer([])
    layer.set_lora(0, *adapter(4))  # slot 0's views made on the stacks as vLLM allocated them
    weights = PlannedLoraWeights(layer.lora_a_stacked, layer.lora_b_stacked, (5, 3))  # re-seats the A's
    new_a, new_b = adapter(4)
    layer.set_lora(0, new_a, new_b)
    assert all(torch.equal(got, want) for got, want in zip(slot(layer, 0), new_a + new_b))
    assert torch.equal(weights.a[0], torch.cat(new_a))  # what the ops read
