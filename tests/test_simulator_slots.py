"""Adapter slots in the simulator (``Simulator(max_loras=S)``): a request holds its adapter's
slot while any of its positions is active under its rule, so a prefill-only request frees it
when its prompt is done and an all-token one at its last token; a waiting request whose adapter
has no slot is passed over, as vLLM's scheduler does, and keeps its place."""

from __future__ import annotations

import pytest

from preft.rule import ALL_TOKEN, AdapterRule
from preft.serving.scheduling.chunk_policies import VllmDefault
from preft.serving.scheduling.cost_model import StepCostModel
from preft.serving.scheduling.simulator import Simulator
from preft.serving.scheduling.workloads import RequestSpec

COST = StepCostModel([0.019, 0.0, 0.0003, 0.002, 0.0007, 0.0, 0.0, 0.0])
PREFILL_ONLY = AdapterRule(prefill_only=True)


def many_users(adapters: int, requests: int) -> list[RequestSpec]:
    return [RequestSpec(f"r{i}", 0.0, 32, 64, adapter=f"user{i % adapters}") for i in range(requests)]


def run(rules: dict, slots: int | None, work: list[RequestSpec]):
    return Simulator(COST, VllmDefault(), max_num_seqs=64, record_shapes=True, adapter_rules=rules,
                     max_loras=slots).run(work)


@pytest.mark.parametrize("rule", [PREFILL_ONLY, ALL_TOKEN])
def test_no_step_has_more_active_adapters_than_slots(rule):
    work = many_users(16, 64)
    rules = {f"user{i}": rule for i in range(16)}
    result = run(rules, 4, work)
    assert len(result.timings) == 64 and max(result.step_adapters) == 4
    unlimited = run(rules, None, work)
    assert max(unlimited.step_adapters) == 16


def test_prefill_only_requests_give_their_slot_back_when_the_prompt_is_done():
    work = many_users(64, 64)
    prefill_only = run({f"user{i}": PREFILL_ONLY for i in range(64)}, 8, work)
    all_token = run({f"user{i}": ALL_TOKEN for i in range(64)}, 8, work)
    # all-token: 8 users at a time, each for its whole answer (8 waves); prefill-only: every
    # user's prompt in its own step of 8, then one decode batch of all 64
    assert all_token.clock_s > 3 * prefill_only.clock_s
    assert max(n for n, _, _ in prefill_only.step_shapes) == 64 and max(n for n, _, _ in all_token.step_shapes) <= 8
    with_slots_for_all = run({f"user{i}": ALL_TOKEN for i in range(64)}, 64, work)
    assert with_slots_for_all.clock_s == pytest.approx(run({}, None, work).clock_s)  # enough slots: no effect


def test_a_request_without_a_slot_is_passed_over_and_keeps_its_place():
    # one slot: r0 (user0) runs; r1 (user1) waits for the slot, r2 (user0's) passes it, and r1 runs
    # before r3 (user2's), which arrived after it
    work = [RequestSpec("r0", 0.0, 16, 8, adapter="user0"), RequestSpec("r1", 0.0, 16, 8, adapter="user1"),
            RequestSpec("r2", 0.0, 16, 8, adapter="user0"), RequestSpec("r3", 0.0, 16, 8, adapter="user2")]
    result = run({}, 1, work)
    first_token = {spec.request_id: timing.first_token_s for spec, timing in zip(result.specs, result.timings)}
    assert first_token["r0"] == first_token["r2"] < first_token["r1"] < first_token["r3"]
    assert max(result.step_adapters) == 1
    with pytest.raises(ValueError, match="max_loras"):
        Simulator(COST, VllmDefault(), max_loras=0)
