"""WavePP chunk sizing and the pipeline simulator (plain Python, no engine)."""

from __future__ import annotations

import random

import pytest

from preft.serving.scheduling.cost_model import StepCostModel
from preft.serving.scheduling.pipeline_simulator import FixedPrefillChunk, LongPrompt, simulate_pipeline
from preft.serving.scheduling.wavepp import StageCost, WavePP, plan_chunks, predicted_ttft


class MonotoneTable:
    """A random cost table, monotone in context and chunk: t(x, c) = a + b·c + e·c·x + g·c²."""

    def __init__(self, rng: random.Random) -> None:
        self.a, self.b = rng.uniform(0, 0.02), rng.uniform(1e-5, 1e-3)
        self.e, self.g = rng.uniform(0, 1e-7), rng.uniform(0, 1e-7)

    def __call__(self, context: int, chunk: int) -> float:
        return self.a + self.b * chunk + self.e * chunk * context + self.g * chunk * chunk


def test_sizing_equalises_stage_times_within_bounds_on_random_monotone_tables():
    rng = random.Random(0)
    for trial in range(25):
        cost = MonotoneTable(rng)
        prompt = rng.randrange(64, 8_000)
        start = rng.randrange(0, prompt)
        min_chunk, max_chunk = rng.choice([1, 16, 64]), rng.choice([512, 2048, 8192])
        stages = rng.choice([2, 4, 8])
        chunks = plan_chunks(cost, start, prompt, stages, min_chunk, max_chunk)
        assert sum(chunks) == prompt - start  # covers exactly what is not cached
        assert all(c <= max_chunk for c in chunks)
        assert all(c >= min_chunk for c in chunks[:-1]) and 1 <= chunks[-1]  # the last: what is left
        times, context = [], start
        for chunk in chunks:
            times.append(cost(context, chunk))
            context += chunk
        full = [t for t, c in zip(times[:-1], chunks[:-1]) if c > min_chunk and c < max_chunk]
        if len(full) >= 2:  # chunks sized by the target: equal to within one token's increment
            step = max(cost(prompt, c + 1) - cost(prompt, c) for c in chunks)
            assert max(full) - min(full) <= step + 1e-12, (trial, chunks)
        # no plan of equal-size chunks is predicted faster
        for size in (64, 256, 1024, 4096):
            size = min(max(size, min_chunk), max_chunk)
            equal = [size] * ((prompt - start) // size) + ([(prompt - start) % size] if (prompt - start) % size else [])
            assert predicted_ttft(cost, start, chunks, stages) <= predicted_ttft(cost, start, equal, stages) + 1e-9


def test_an_all_cached_prompt_needs_no_chunk_and_bad_bounds_are_refused():
    cost = MonotoneTable(random.Random(1))
    assert plan_chunks(cost, 500, 500, 4) == []
    with pytest.raises(ValueError):
        plan_chunks(cost, 0, 100, 4, min_chunk=0)
    with pytest.raises(ValueError):
        WavePP(StageCost(StepCostModel.synthetic(), 4), min_chunk=64, max_chunk=32)


def test_the_policy_follows_its_plan_and_replans_off_it():
    policy = WavePP(StageCost(StepCostModel.synthetic(), 4), min_chunk=16, max_chunk=1024)
    first = policy.prefill_chunk("r", 1000, 5000)
    assert 16 <= first <= 1024
    second = policy.prefill_chunk("r", 1000 + first, 5000)
    assert second == policy.plans["r"][1][1] - policy.plans["r"][1][0]
    cut = policy.prefill_chunk("r", 1000 + first + 3, 5000)  # vLLM gave 3 tokens fewer: a new plan from there
    assert policy.plans["r"][0] == 1000 + first + 3 and cut >= 16


def test_pipeline_simulator_flow_shop_times_and_bubbles():
    cost = lambda context, chunk: 0.001 * chunk  # noqa: E731  (no context effect: every chunk alike)
    one = [LongPrompt("a", 0.0, 4000)]
    result = simulate_pipeline(one, FixedPrefillChunk(1000), cost, stages=4)
    assert result.chunks["a"] == [1000] * 4
    assert result.ttft_s["a"] == pytest.approx((4 + 4 - 1) * 1.0)  # (k + S - 1) tau
    assert result.bubble_fraction == pytest.approx(1 - 4 / 7)
    cached = simulate_pipeline([LongPrompt("a", 0.0, 4000, cached_tokens=2000)], FixedPrefillChunk(1000), cost, 4)
    assert cached.chunks["a"] == [1000, 1000] and cached.ttft_s["a"] == pytest.approx(5.0)
    # a stream of prompts keeps the stages busy: bubbles only at the ends
    stream = [LongPrompt(str(i), 0.0, 4000) for i in range(20)]
    busy = simulate_pipeline(stream, FixedPrefillChunk(1000), cost, 4)
    assert busy.bubble_fraction == pytest.approx(1 - 80 / 83)
    assert busy.prefill_tokens_per_s == pytest.approx(80_000 / 83.0)


def test_wavepp_beats_equal_chunks_when_context_makes_later_chunks_slower():
    cost = lambda context, chunk: 0.002 + 1e-4 * chunk + 4e-8 * chunk * context  # noqa: E731
    prompts = [LongPrompt("long", 0.0, 16_000, cached_tokens=8_000)]
    wave = simulate_pipeline(prompts, WavePP(cost_with_stages(cost, 4), min_chunk=16, max_chunk=4096), cost, 4)
    best_fixed = min(simulate_pipeline(prompts, FixedPrefillChunk(size), cost, 4).ttft_s["long"]
                     for size in (128, 256, 512, 1024, 2048, 4096))
    assert wave.ttft_s["long"] < best_fixed


def cost_with_stages(cost, stages):
    """A stage cost table with the ``stages`` attribute WavePP reads."""
    class Table:
        def __call__(self, context, chunk):
            return cost(context, chunk)

    table = Table()
    table.stages = stages
    return table


def test_the_closed_form_chunk_equals_the_binary_search():
    from preft.serving.scheduling.wavepp import largest_chunk

    rng = random.Random(2)
    for _ in range(200):
        weights = [rng.choice([0.0, rng.uniform(0, 0.02)]) for _ in range(4)] + \
                  [rng.uniform(1e-6, 1e-3), rng.choice([0.0, rng.uniform(0, 1e-3)]), rng.uniform(0, 0.01),
                   rng.choice([0.0, rng.uniform(0, 0.01)])]
        stage = StageCost(StepCostModel(weights), rng.choice([1, 2, 4, 8]), handoff_s=rng.choice([0.0, 1e-4]))
        context, limit = rng.randrange(0, 40_000), rng.randrange(1, 8192)
        target = stage(context, rng.randrange(1, 8192)) * rng.uniform(0.5, 1.5)
        searched = largest_chunk(lambda x, c: stage(x, c), context, limit, target)  # no closed form: search
        assert stage.largest_chunk(context, limit, target) == searched


def test_preft_eval_pipeline_simulator_part(tmp_path):
    """`preft eval pipeline --no-engine`: every case's WavePP plan covers the uncached prompt and
    its TTFT is compared with every fixed chunk's; the table and figure are written."""
    from preft.eval.pipeline import main

    cost = StepCostModel([0.01, 0, 0, 0.002, 5e-4, 2e-5, 0.002, 0.02]).save(tmp_path / "cost.json")
    result = main(model="default", cost_model=str(cost), stages="2,4", prompts="1024,4096", fixed="128,512",
                  engine=False, out=str(tmp_path))
    assert len(result["cases"]) == 2 * 2 * 2
    for case in result["cases"]:
        assert sum(case["wavepp_chunks"]) == case["prompt"] - case["cached"]
        assert case["speedup"] == min(case["fixed_ttft_s"].values()) / case["wavepp_ttft_s"]
        assert case["speedup"] >= 1.0 - 1e-9  # never worse than the best fixed chunk of those tried, here
    assert {r["policy"] for r in result["streams"]} == {"fixed:128", "fixed:512", "wavepp"}
    text = (tmp_path / "pipeline" / "pipeline.md").read_text()
    assert "best fixed / WavePP" in text and (tmp_path / "pipeline" / "pipeline_sim.png").is_file()
