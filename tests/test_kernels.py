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
