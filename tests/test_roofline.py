"""The roofline step cost model against public figures, and the properties the policies need."""

from __future__ import annotations

import pytest

from preft.serving.scheduling.roofline import HARDWARE, MODELS, ModelShape, RooflineCostModel

LLAMA_8B_H100 = RooflineCostModel(MODELS["llama-3.1-8b"], HARDWARE["H100"])


def test_a_decode_step_at_batch_one_is_the_weights_over_the_bandwidth():
    # Llama-3.1-8B in bf16: ~15 GB of decoder and LM-head weights (its 8.03B parameters less the
    # embedding table, which a step reads only rows of), over the H100's 3.35 TB/s: about 5 ms
    weights = MODELS["llama-3.1-8b"].weight_bytes
    assert 14.5e9 < weights < 16.1e9
    bound = weights / 3.35e12
    step = LLAMA_8B_H100(1, 0, 0)
    assert bound < step < 1.25 * bound + HARDWARE["H100"].step_overhead_s
    terms = LLAMA_8B_H100.terms(1, 0)
    assert terms["memory"] > 100 * terms["compute"]  # batch 1 is memory-bound


def test_a_long_prefill_is_near_its_flop_bound():
    # 4k prompt tokens: 2 * 7.5e9 linear parameters * 4096 tokens is the bulk of the FLOPs
    step = LLAMA_8B_H100(0, 4096, 0)
    flop_bound = 2 * 8.03e9 * 4096 / 989e12
    assert flop_bound < step < 1.4 * flop_bound
    terms = LLAMA_8B_H100.terms(0, 4096)
    assert terms["compute"] > 10 * terms["memory"]


def test_it_is_monotone_in_the_chunk_and_in_context():
    for n, x in ((0, 0), (32, 20000), (256, 500000)):
        values = [LLAMA_8B_H100(n, c, x) for c in range(0, 8193, 64)]
        assert all(b >= a for a, b in zip(values, values[1:]))
    assert LLAMA_8B_H100(64, 0, 64 * 4000) > LLAMA_8B_H100(64, 0, 64 * 1000)


def test_decode_turns_compute_bound_past_the_ridge():
    # the batch at which the linear layers' FLOPs catch up with the weight read: ~ peak / bandwidth
    terms = [LLAMA_8B_H100.terms(n, 0) for n in (16, 1024)]
    assert terms[0]["memory"] > terms[0]["compute"] and terms[1]["compute"] > terms[1]["memory"]


def test_a_prefix_shared_in_a_step_is_read_once_and_adapters_cost_bytes():
    m = LLAMA_8B_H100
    distinct = m.step(64, 0, decode_context=64 * 8000)
    shared = m.step(64, 0, decode_context=64 * 8000, shared_context=63 * 8000)
    assert shared < 0.5 * distinct
    base = m.step(64, 0, decode_context=64 * 1000)
    one = m.step(64, 0, decode_context=64 * 1000, adapters=1, adapter_tokens=64)
    many = m.step(64, 0, decode_context=64 * 1000, adapters=64, adapter_tokens=64)
    assert base < one < many
    # a rank-16 adapter on every projection of Llama-3.1-8B: ~42M parameters, 84 MB in bf16
    assert 80e6 < 2 * 16 * MODELS["llama-3.1-8b"].lora_dims() < 90e6


def test_tensor_parallel_splits_the_work_and_adds_all_reduces():
    seventy = MODELS["llama-3.1-70b"]
    one, four, eight = (RooflineCostModel(seventy, HARDWARE["H100"], tp=t)(32, 0, 32 * 2000) for t in (1, 4, 8))
    assert one > four > eight > one / 8
    with pytest.raises(ValueError, match="tensor-parallel size 3"):
        RooflineCostModel(seventy, HARDWARE["H100"], tp=3)


def test_shapes_come_from_a_transformers_config(tmp_path):
    import json

    config = {"model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14,
              "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.from_config(tmp_path)
    assert (shape.layers, shape.dh, shape.kv_heads) == (24, 64, 2)
    assert shape.linear_params == MODELS["qwen2.5-0.5b"].linear_params
    with pytest.raises(ValueError, match="no 'vocab_size' field"):
        ModelShape.from_config({k: v for k, v in config.items() if k != "vocab_size"})


def test_its_fitted_form_follows_it_on_prefill_steps_for_wavepp():
    fitted = LLAMA_8B_H100.as_step_cost_model(decodes=(0,))
    for shape in ((0, 1024, 8192), (0, 2048, 0), (0, 4096, 60000), (0, 8192, 0)):  # past the ridge
        assert fitted(*shape) == pytest.approx(LLAMA_8B_H100(*shape), rel=0.1)
    assert HARDWARE["H100"].calibrated(700e12, 3.0e12).flops_efficiency == 1.0


def test_against_published_step_times():
    """The goal: within 25% of published single-GPU step times. Every prediction is below the
    measurement (a roofline is a lower bound plus an assumed overhead); at batch 1 each is within
    25%. The L4 at 32 decodes is not: its step grew 2.0 ms from batch 1 to 32 where the roofline
    adds 0.46 ms (KV and logits), a per-request cost the roofline has no term for."""
    from preft.serving.scheduling.roofline import PUBLISHED_STEPS, check_published

    rows = check_published()
    assert len(rows) == len(PUBLISHED_STEPS) >= 4
    assert all(r["error"] < 0 for r in rows)
    single = [r for r in rows if r["decodes"] == 1]
    assert {r["hardware"] for r in single} == {"A100-40GB", "H100", "L4"}
    assert all(abs(r["error"]) <= 0.25 for r in single), single
    batched = next(r for r in rows if r["decodes"] == 32)
    assert -0.4 < batched["error"] < -0.25  # outside the goal, stated in README and RESULTS


def test_the_largest_prefill_chunk_is_the_search_answer():
    """WavePP's closed form on the roofline equals a binary search of the step itself."""
    from preft.serving.scheduling.wavepp import StageCost, binary_search_chunk

    for model in (LLAMA_8B_H100, RooflineCostModel(MODELS["llama-3.1-70b"], HARDWARE["H100"], tp=8)):
        for stages, handoff in ((1, 0.0), (4, 1e-3)):
            stage = StageCost(model, stages, handoff)
            for context in (0, 3000, 60000):
                for target in (0.6e-3, 2e-3, 7e-3, 30e-3, 200e-3):
                    expected = binary_search_chunk(stage, context, 8192, target)
                    assert stage.largest_chunk(context, 8192, target) == expected, (context, target)


def test_sloweave_on_the_roofline_keeps_the_tpot_of_long_prompts():
    """SLOWeave plans each step with the chunk's own cached context apart (the chunk attends to all
    of it): on long prompts every request's mean TPOT stays within the target. With the 3-term
    T(n, c, x) the steps ran past it (TPOT p50 26.0 ms against 25 at full load)."""
    from preft.serving.scheduling import workloads
    from preft.serving.scheduling.chunk_policies import make_policy
    from preft.serving.scheduling.simulator import Simulator

    work = workloads.generate("long", 300, 20.0, seed=0, max_model_len=4096)
    policy = make_policy("sloweave", cost_model=LLAMA_8B_H100, tpot_s=0.025, max_chunk=8192)
    result = Simulator(LLAMA_8B_H100, policy, max_num_seqs=256, max_num_batched_tokens=8192).run(work)
    tpots = [t.tpot_s for t in result.timings if t.tpot_s is not None]
    assert len(tpots) > 250 and max(tpots) <= 0.025 * 1.0001
