"""The ops benchmark compares like with like: PreFT's planned ops add what vLLM's stock ops add."""

import pytest

from preft.eval.bench import lora_ops as bench_lora_ops
from preft.serving.tile_plan import build_tile_plan


@pytest.mark.parametrize("count", [1, 3, 64])
def test_planned_ops_equal_vllm_stock_ops_on_the_benchmark_step(count):
    layers = bench_lora_ops.LoraLayers(hidden=16, intermediate=24, kv=8, layers=1, slots=65)
    indices = bench_lora_ops.step_indices(count)
    layers.check(indices, build_tile_plan(indices))  # raises on any difference
    assert all(y.abs().sum() > 0 for y in layers.outputs)


def test_a_wrong_planned_result_is_caught():
    layers = bench_lora_ops.LoraLayers(hidden=16, intermediate=24, kv=8, layers=1, slots=9)
    indices = bench_lora_ops.step_indices(8)
    wrong = indices.roll(1)  # off by one row: the planned ops use another row's adapter
    with pytest.raises(AssertionError):
        layers.check(indices, build_tile_plan(wrong))
