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



def test_adapter_groups_bring_fewer_adapters_in_and_starve_no_one():
    """Requests over 32 adapters arriving faster than 4 slots turn over (a queue forms): the
    adapter-group order gives each step's slots to the adapters with the most waiting requests,
    so the steps bring fewer adapters in (into a slot, into host memory) than vLLM's order
    (the oldest requests' adapters), and its age bound keeps every request's wait bounded."""
    import random

    from preft.serving.scheduling.adapter_groups import AdapterGroups

    rng = random.Random(3)
    work = [RequestSpec(f"r{i}", 0.004 * i, 32, 16, adapter=f"user{rng.randrange(32)}") for i in range(600)]
    work.append(RequestSpec("rare", 0.5, 32, 16, adapter="rare"))  # one request, once the queue has formed
    adapter_of = {spec.request_id: spec.adapter for spec in work}.get
    rules = {**{f"user{i}": PREFILL_ONLY for i in range(32)}, "rare": PREFILL_ONLY}

    def simulate(admission):
        return Simulator(COST, VllmDefault(), max_num_seqs=64, record_shapes=True, adapter_rules=rules, max_loras=4,
                         host_adapters=8, admission=admission).run(work)

    fcfs = simulate(None)
    groups = simulate(lambda cache: AdapterGroups(adapter_of, slots=4, host=8, max_wait_s=1.0))
    assert len(groups.timings) == len(fcfs.timings) == 601
    assert max(groups.step_adapters) <= 4 and max(fcfs.step_adapters) <= 4
    assert groups.slot_loads < 0.9 * fcfs.slot_loads and groups.host_loads < 0.9 * fcfs.host_loads

    def wait_of_rare(result):
        return next(t.first_token_s - t.arrival_s for spec, t in zip(result.specs, result.timings)
                    if spec.request_id == "rare")

    # the age bound: the lone request is not overtaken by requests that arrived over max_wait_s
    # after it (without the bound, max_wait_s=1e9, it waits for the whole queue: 18.5 s against
    # 5.8 s in vLLM's order)
    assert wait_of_rare(groups) <= wait_of_rare(fcfs) + 1.0


def test_eval_commands_simulate_the_slots_they_serve():
    """``preft eval goodput --adapters N --slots S`` (and ``eval prefix --slots``): request i on
    adapter i % N, as vLLM's benchmark client sends it, and S slots in the simulator."""
    from preft.eval.common import simulate_policy, with_adapters

    work = [RequestSpec(f"r{i}", 0.0, 32, 16) for i in range(64)]
    assert [s.adapter for s in with_adapters(work, {"adapters": 16})[:18:17]] == ["lora0", "lora1"]
    assert with_adapters(work, {}) is work
    settings = {"max_chunk": 2048, "max_num_seqs": 64, "max_num_batched_tokens": 2048, "adapters": 16}
    unlimited = simulate_policy(COST, "default", work, settings, 1.0, record=True)
    limited = simulate_policy(COST, "default", work, {**settings, "slots": 4}, 1.0, record=True)
    assert max(unlimited.step_adapters) == 16 and max(limited.step_adapters) == 4
    assert limited.clock_s > unlimited.clock_s  # 16 prompts' adapters through 4 slots take more steps
