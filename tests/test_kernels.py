"""Triton kernels against their torch references (in Triton's interpreter where there is no GPU:
conftest.py sets TRITON_INTERPRET=1 before triton is imported)."""

import pytest
import torch

from preft.kernels.lora_tiles import triton_planned_lora_linear
from preft.serving import lora_ops
from preft.serving.tile_plan import build_tile_plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("indices, tile_rows", [
    ([3, 3, 3, -1, 0, 0, 1, 1, 1, 1, 1, -1, -1, 3, 2] * 5, 4),  # tiles of 4, padding, no-adapter rows
    ([3, 3, 3, -1, 0, 0, 1, 1, 1, 1, 1, -1, -1, 3, 2] * 5, None),
    ([2] * 70, None),                  # one slot, every row: cut into tiles of 64 by the wrapper
    ([-1, 2, 2, -1, 2, -1] * 3, None),  # one slot, some rows
    ([0, 1, 2, 3] * 8, None),          # decode-like: tiles of one row
], ids=["many-slots-tiles-of-4", "many-slots", "one-slot-all-rows", "one-slot-some-rows", "one-row-groups"])
def test_lora_tiles_kernels_equal_the_torch_ops(indices, tile_rows):
    torch.manual_seed(0)
    indices = torch.tensor(indices, device=DEVICE)
    rows, hidden, rank, slots, slices = indices.numel(), 40, 4, 4, (5, 3, 3)  # 40 > one 32-wide K step
    x = torch.randn(rows + 2, hidden, device=DEVICE)
    lora_a = tuple(torch.randn(slots, 1, rank, hidden, device=DEVICE) for _ in slices)
    lora_b = tuple(torch.randn(slots, 1, size + 1, rank, device=DEVICE) for size in slices)
    y = torch.randn(rows + 2, sum(slices), device=DEVICE)
    before = y.clone()
    plan = build_tile_plan(indices, tile_rows=tile_rows)
    expected = y.clone()
    lora_ops.planned_lora_linear(expected, x, plan, lora_ops.PlannedLoraWeights(lora_a, lora_b, slices), 0.5)
    triton_planned_lora_linear(y, x, plan, lora_ops.PlannedLoraWeights(lora_a, lora_b, slices), 0.5)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert (y - before)[:rows][indices >= 0].abs().min() > 0  # every row with an adapter got its term


def test_rows_without_an_adapter_are_left_exactly_alone():
    torch.manual_seed(0)
    indices = torch.tensor([-1, 1, 1, -1, 0, -1] * 4, device=DEVICE)
    x = torch.randn(indices.numel(), 16, device=DEVICE)
    lora_a = (torch.randn(2, 1, 4, 16, device=DEVICE),)
    lora_b = (torch.randn(2, 1, 8, 4, device=DEVICE),)
    y = torch.randn(indices.numel(), 8, device=DEVICE)
    before = y.clone()
    weights = lora_ops.PlannedLoraWeights(lora_a, lora_b, (8,))
    triton_planned_lora_linear(y, x, build_tile_plan(indices), weights, 1.0)
    untouched = indices < 0
    assert torch.equal(y[untouched], before[untouched])
    assert (y[~untouched] - before[~untouched]).abs().min() > 0


def reft_bank_tensors(slots: int, rank: int, hidden: int, ranks: list[int]):
    """A ReFT-P bank's per-layer tensors: ``[W; P]`` per slot, bias, k; slot i of rank ``ranks[i]``
    zero-padded to ``rank`` (as :class:`preft.serving.reft.ReftBank` stacks mixed ranks)."""
    weights = torch.randn(slots, 2 * rank, hidden, device=DEVICE) / hidden ** 0.5
    bias = torch.randn(slots, rank, device=DEVICE)
    for slot, own in enumerate(ranks):
        weights[slot, own:rank] = 0
        weights[slot, rank + own:] = 0
        bias[slot, own:] = 0
    sign = torch.tensor([1.0, 0.0] * (slots // 2), device=DEVICE)  # LoReFT and DiReFT slots
    return weights, bias, sign


@pytest.mark.parametrize("indices, tile_rows", [
    ([3, 3, 3, -1, 0, 0, 1, 1, 1, 1, 1, -1, -1, 3, 2] * 5, 4),  # tiles of 4, padding, no-slot rows
    ([3, 3, 3, -1, 0, 0, 1, 1, 1, 1, 1, -1, -1, 3, 2] * 5, None),
    ([2] * 70, None),                   # one slot for every row
    ([-1, 1, 1, -1, 1, -1] * 3, None),  # one slot, some rows
    ([0, 1, 2, 3] * 8, None),           # segments of length 1 (decode-like)
], ids=["many-slots-tiles-of-4", "many-slots", "one-slot-all-rows", "one-slot-some-rows", "segments-of-one"])
def test_reft_kernel_equals_the_torch_reference(indices, tile_rows):
    from preft.kernels.reft_tiles import triton_reft_edit
    from preft.serving.reft import reft_edit

    torch.manual_seed(0)
    indices = torch.tensor(indices, device=DEVICE)
    rows, hidden, rank = indices.numel(), 40, 4  # 40: past one 32-wide block of the hidden size
    weights, bias, sign = reft_bank_tensors(4, rank, hidden, ranks=[4, 2, 4, 1])  # mixed ranks
    stream, residual = torch.randn(rows + 3, hidden, device=DEVICE), torch.randn(rows + 3, hidden, device=DEVICE)
    plan = build_tile_plan(indices, tile_rows=tile_rows)
    expected = reft_edit(stream.clone(), residual, plan, weights, bias, sign, rank)
    got = triton_reft_edit(stream.clone(), residual, plan, weights, bias, sign, rank)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    edited = torch.zeros(rows + 3, dtype=torch.bool, device=DEVICE)
    edited[:rows] = indices >= 0
    assert torch.equal(got[~edited], stream[~edited])  # rows without a slot, and rows past the plan
    assert (got[edited] - stream[edited]).abs().amax(dim=1).min() > 0


def test_reft_kernel_in_bfloat16_and_without_rows():
    from preft.kernels.reft_tiles import triton_reft_edit
    from preft.serving.reft import reft_edit

    torch.manual_seed(1)
    indices = torch.tensor([0, 0, 1, -1, 1, 1, 0, -1] * 6, device=DEVICE)
    weights, bias, sign = reft_bank_tensors(2, 8, 64, ranks=[8, 4])
    stream = torch.randn(indices.numel(), 64, device=DEVICE).to(torch.bfloat16)
    residual = torch.randn(indices.numel(), 64, device=DEVICE).to(torch.bfloat16)
    plan = build_tile_plan(indices)
    exact = reft_edit(stream.float(), residual.float(), plan, weights, bias, sign, 8)
    got = triton_reft_edit(stream.clone(), residual, plan, weights, bias, sign, 8)
    reference = reft_edit(stream.clone(), residual, plan, weights, bias, sign, 8)
    # bf16 keeps 8 bits of mantissa: both round the float32 result once (|error| <= 2^-8 relative)
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(got, reference, rtol=2 ** -7, atol=2 ** -7)
    untouched = stream.clone()
    assert torch.equal(triton_reft_edit(untouched, residual, None, weights, bias, sign, 8), stream)  # no rows
    assert build_tile_plan(torch.full((5,), -1, device=DEVICE)) is None
