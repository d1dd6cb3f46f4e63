"""The Chunked Hash Tree and the radix-tree baseline against a brute-force reference; the
admission orders' engine-side operations (requeue, remove) and scheduler names."""

from __future__ import annotations

import itertools
import random

import pytest

from preft.rule import AdapterRule
from preft.serving.scheduling.chunked_hash_tree import ChunkedHashTree, chunk_keys
from preft.serving.scheduling.radix_tree import RadixTree, adapter_sequence

CHUNK = 8


def brute_missing(keys: dict, active: set, request_id: str) -> int:
    working = {key for other in active for key in keys[other]}
    return sum(1 for key in keys[request_id] if key not in working)


def random_prompt(rng: random.Random, systems: list[list[int]]) -> list[int]:
    system = rng.choice(systems)
    return system[: rng.randrange(0, len(system) + 1)] + [rng.randrange(100) for _ in range(rng.randrange(0, 30))]


def test_cht_and_radix_tree_agree_with_brute_force_on_random_operations():
    rng = random.Random(0)
    systems = [[rng.randrange(100) for _ in range(64)] for _ in range(4)]
    adapters = [(None, None), ("alice", AdapterRule(prefill_only=True, adapter_start=32)),
                ("bob", AdapterRule(prefill_only=True, adapter_start=32)), ("carol", AdapterRule())]
    cht, radix = ChunkedHashTree(), RadixTree(CHUNK)
    keys, waiting, active, order = {}, [], set(), {}
    for step in range(3000):
        op = rng.random()
        if op < 0.35 or not (waiting or active):
            request_id = f"r{step}"
            tokens = random_prompt(rng, systems)
            adapter, rule = rng.choice(adapters)
            keys[request_id] = chunk_keys(tokens, CHUNK, adapter, rule)
            cht.insert(request_id, keys[request_id])
            radix.insert(request_id, adapter_sequence(tokens, CHUNK, adapter, rule))
            waiting.append(request_id)
            order[request_id] = step
        elif op < 0.65 and waiting:
            chosen = cht.best_request() if rng.random() < 0.5 else rng.choice(waiting)
            cht.activate(chosen)
            radix.activate(chosen)
            waiting.remove(chosen)
            active.add(chosen)
        elif op < 0.8 and active:
            chosen = rng.choice(sorted(active))
            cht.finish(chosen)
            radix.finish(chosen)
            active.discard(chosen)
        elif op < 0.9 and active:  # preempted: waiting again, as old as it was
            chosen = rng.choice(sorted(active))
            cht.deactivate(chosen)
            radix.deactivate(chosen)
            active.discard(chosen)
            waiting.append(chosen)
        elif waiting:
            chosen = rng.choice(waiting)
            cht.remove(chosen)
            radix.remove(chosen)
            waiting.remove(chosen)
        expected = {r: brute_missing(keys, active, r) for r in waiting}
        assert cht.missing == expected
        best = min(waiting, key=lambda r: (expected[r], order[r])) if waiting else None
        assert cht.best_request() == best
        if step % 10 == 0:
            assert radix.best_request() == best
            assert {r: radix.missing(r) for r in waiting} == expected


def test_keys_before_adapter_start_are_the_base_models():
    rng = random.Random(1)
    system = [rng.randrange(100) for _ in range(64)]  # 8 chunks of 8
    user = system + [rng.randrange(100) for _ in range(32)]
    late = AdapterRule(prefill_only=True, adapter_start=64)
    base = chunk_keys(user, CHUNK)
    alice, bob = chunk_keys(user, CHUNK, "alice", late), chunk_keys(user, CHUNK, "bob", late)
    # the system prompt's 8 chunks lie before adapter_start: one prefix group for everyone
    assert alice[:8] == bob[:8] == base[:8]
    assert len({alice[8], bob[8], base[8]}) == 3 and all(len({a, b}) == 2 for a, b in zip(alice[8:], bob[8:]))
    # a chunk that straddles adapter_start carries the adapter
    straddle = AdapterRule(prefill_only=True, adapter_start=60)
    assert chunk_keys(user, CHUNK, "alice", straddle)[:7] == base[:7] != chunk_keys(user, CHUNK, "alice", straddle)[:8]
    # all-token adapters (and adapter_start 0) change every chunk's KV
    assert chunk_keys(user, CHUNK, "alice")[0] != base[0]
    assert chunk_keys(user, CHUNK, "alice", AdapterRule(prefill_only=True))[0] != base[0]
    # a level-k match implies every earlier level: keys chain
    other = system[:40] + [999] + system[41:]
    assert chunk_keys(other, CHUNK)[:5] == base[:5] and all(a != b for a, b in zip(chunk_keys(other, CHUNK)[5:], base[5:]))
    assert len(chunk_keys(user[:20], CHUNK)) == 2  # a partial chunk has no key
    with pytest.raises(ValueError):
        chunk_keys(user, 0)


def test_the_tree_refuses_inconsistent_operations():
    cht = ChunkedHashTree()
    cht.insert("a", chunk_keys(list(range(16)), CHUNK))
    with pytest.raises(ValueError):
        cht.insert("a", [])
    with pytest.raises(KeyError):
        cht.finish("a")
    cht.activate("a")
    with pytest.raises(KeyError):
        cht.activate("a")
    assert cht.best_request() is None and len(cht) == 0


from preft.serving.scheduling.feather import ADD, STOP, FeatherAdmission, FeatherBandit, state_of  # noqa: E402


def test_feather_states_and_ucb_decisions_on_hand_built_tables(tmp_path):
    assert state_of(batch_size=3, missing=9, shared=1, sharing_waiting=0) == (2, 5, 0)  # lost clipped to 5
    assert state_of(batch_size=40, missing=0, shared=12, sharing_waiting=20)[1] == -5
    bandit = FeatherBandit(exploration=1.0)
    state = (2, 3, 1)
    assert bandit.choose(state) == ADD  # untried actions first, in order
    bandit.credit([(state, ADD)], 10.0)
    assert bandit.choose(state) == STOP
    bandit.credit([(state, STOP)], 50.0)
    assert bandit.choose(state) == STOP and bandit.greedy(state) == STOP  # 50 + bonus beats 10 + bonus
    for _ in range(3):
        bandit.credit([(state, STOP)], 0.0)  # STOP turns out badly: its mean falls to 12.5
    assert bandit.q[(state, STOP)] == pytest.approx(12.5) and bandit.greedy(state) == STOP
    bandit.credit([(state, ADD)], 30.0)
    assert bandit.greedy(state) == ADD and bandit.q[(state, ADD)] == pytest.approx(20.0)
    # a large exploration constant prefers the less tried action
    explorer = FeatherBandit(exploration=1e6)
    explorer.credit([(state, ADD)] * 50, 100.0)
    explorer.credit([(state, STOP)], 0.0)
    assert explorer.choose(state) == STOP
    again = FeatherBandit.load(bandit.save(tmp_path / "feather.json"))
    assert again.q == bandit.q and again.n == bandit.n
    (tmp_path / "bad.json").write_text("{\"exploration\": 1, \"table\": [[[1], \"jump\", 0, 1]]}")
    with pytest.raises(ValueError, match="Feather state"):
        FeatherBandit.load(tmp_path / "bad.json")


def test_feather_adds_what_shares_and_stops_where_it_learned_to():
    rng = random.Random(3)
    shared = [rng.randrange(100) for _ in range(64)]
    tree = ChunkedHashTree()
    tree.insert("first", chunk_keys(shared + [1, 2, 3], CHUNK))
    for i in range(3):
        tree.insert(f"same{i}", chunk_keys(shared + [10 + i] * 3, CHUNK))  # the same 8 chunks
    stranger = [rng.randrange(100) for _ in range(64)]
    tree.insert("other", chunk_keys(stranger, CHUNK))
    tree.insert("other2", chunk_keys(stranger + [7] * 8, CHUNK))  # a group of its own: the bandit's call
    bandit = FeatherBandit()
    stop_state = state_of(4, 8, 0, 1)
    bandit.q[(stop_state, STOP)], bandit.n[(stop_state, STOP)] = 1000.0, 100
    bandit.q[(stop_state, ADD)], bandit.n[(stop_state, ADD)] = 1.0, 100
    admission = FeatherAdmission(tree, bandit, max_wait_s=60.0)
    chosen = admission.admit(batch_size=0, capacity=8, waited_s=lambda r: 0.0)
    # the empty batch takes the first; the sharers lose nothing; the stranger is the bandit's call
    assert chosen == ["first", "same0", "same1", "same2"] and admission.pending == [(stop_state, STOP)]
    admission.reward(batch_size=4, step_s=0.2, prefill_tokens=300)  # the admitted prompts still prefill
    assert bandit.n[(stop_state, STOP)] == 100 and admission.pending == [(stop_state, STOP)]
    admission.reward(batch_size=4, step_s=0.01)  # the batch's first decode step: credited now
    assert bandit.n[(stop_state, STOP)] == 101 and admission.pending == []
    assert bandit.q[(stop_state, STOP)] == pytest.approx((1000.0 * 100 + 400.0) / 101)


def stranger_admitted_at(max_wait_s: float) -> int | None:
    """Adversarial arrivals: three requests sharing one prefix arrive each second, and one
    stranger at t=0; a bandit table says STOP to anything that loses chunks. When does the
    stranger get in (None: not within 40 s)?"""
    rng = random.Random(4)
    shared = [rng.randrange(100) for _ in range(64)]
    tree, bandit = ChunkedHashTree(), FeatherBandit()
    for state in itertools.product(range(9), range(1, 6), range(7)):
        bandit.q[(state, STOP)], bandit.q[(state, ADD)] = 1.0, 0.0
    admission = FeatherAdmission(tree, bandit, max_wait_s=max_wait_s, learn=False)
    tree.insert("seed", chunk_keys(shared, CHUNK))
    tree.activate("seed")  # the shared prefix is running
    arrived = {"stranger": 0.0}
    stranger = [rng.randrange(100) for _ in range(64)]
    tree.insert("stranger", chunk_keys(stranger, CHUNK))
    tree.insert("stranger-mate", chunk_keys(stranger + [9] * 8, CHUNK))  # a group: the bandit may STOP it
    running: list[str] = ["seed"]
    for now in range(40):
        for i in range(3):
            arrived[f"s{now}-{i}"] = float(now)
            tree.insert(f"s{now}-{i}", chunk_keys(shared + [now, i] * 4, CHUNK))
        chosen = admission.admit(len(running), capacity=4, waited_s=lambda r: now - arrived[r])
        if "stranger" in chosen:
            return now
        running += chosen
        while len(running) > 2:  # requests finish, making room
            tree.finish(running.pop(0))
    return None


def test_feather_adds_a_stranger_with_no_group_to_wait_for():
    rng = random.Random(5)
    tree, bandit = ChunkedHashTree(), FeatherBandit()
    for state in itertools.product(range(9), range(1, 6), range(7)):
        bandit.q[(state, STOP)], bandit.q[(state, ADD)] = 1.0, 0.0  # a table that would STOP it
    shared = [rng.randrange(100) for _ in range(64)]
    tree.insert("seed", chunk_keys(shared, CHUNK))
    tree.activate("seed")
    tree.insert("alone", chunk_keys([rng.randrange(100) for _ in range(64)], CHUNK))
    admission = FeatherAdmission(tree, bandit, max_wait_s=1e9, learn=False)
    assert admission.admit(1, capacity=4, waited_s=lambda r: 0.0) == ["alone"] and admission.pending == []


def test_feather_never_starves_a_request_whose_prefix_nobody_shares():
    # three sharers arrive a second and two are admitted, so at time t the candidate is the sharer
    # that arrived near 2t/3: the first step whose candidate arrived more than 5 s after the
    # stranger (t = 8) admits the stranger instead
    assert stranger_admitted_at(max_wait_s=5.0) == 8
    assert stranger_admitted_at(max_wait_s=2.0) == 4
    assert stranger_admitted_at(max_wait_s=1e9) is None  # without the age bound: starved


from preft.serving.scheduling import workloads  # noqa: E402
from preft.serving.scheduling.admission import FeatherOrder, FirstComeFirstServed, LongestPrefixMatch  # noqa: E402
from preft.serving.scheduling.chunk_policies import VllmDefault  # noqa: E402
from preft.serving.scheduling.cost_model import StepCostModel  # noqa: E402
from preft.serving.scheduling.prefix_cache import PrefixCache, workload_keys  # noqa: E402
from preft.serving.scheduling.simulator import Simulator  # noqa: E402


def test_workload_keys_share_the_group_prefix_and_honour_adapter_start():
    a = workloads.RequestSpec("a", 0.0, 100, 5, prefix_group=1, prefix_tokens=64)
    b = workloads.RequestSpec("b", 0.0, 90, 5, prefix_group=1, prefix_tokens=64)
    ka, kb = workload_keys(a, 16), workload_keys(b, 16)
    assert ka[:4] == kb[:4] and ka[4] != kb[4] and len(ka) == 6 and len(kb) == 5
    late = AdapterRule(prefill_only=True, adapter_start=64)
    alice = workload_keys(workloads.RequestSpec("c", 0.0, 100, 5, adapter="alice", prefix_group=1, prefix_tokens=64),
                          16, late)
    bob = workload_keys(workloads.RequestSpec("d", 0.0, 100, 5, adapter="bob", prefix_group=1, prefix_tokens=64),
                        16, late)
    assert alice[:4] == bob[:4] == ka[:4]  # before adapter_start: one group for every user
    all_token = workload_keys(workloads.RequestSpec("e", 0.0, 100, 5, adapter="alice", prefix_group=1,
                                                    prefix_tokens=64), 16)
    assert all_token[0] != ka[0]  # keyed by adapter from the first block, as vLLM's cache keys LoRA blocks


def test_the_prefix_cache_hits_pins_and_evicts_least_recently_used():
    cache = PrefixCache(capacity_blocks=10, block_tokens=16)
    first = [(1, "g0", None), (2, "g0", None), (3, "r1", None)]
    assert cache.admit(first, prompt_tokens=48, output_tokens=16) == 0 and cache.used() == 4
    second = [(1, "g0", None), (2, "g0", None), (3, "r2", None)]
    assert cache.admit(second, 48, 16) == 32 and cache.used() == 6  # two blocks shared, not copied
    big = [(level, "r3", None) for level in range(1, 7)]
    assert cache.admit(big, 96, 0) is None  # 6 blocks; 4 free and nothing unpinned to evict
    cache.finish(first, 48, 16)
    assert cache.used() == 5 and cache.admit(big, 96, 0) == 0  # r1's block evicted, g0's stay (pinned by r2)
    assert (3, "r1", None) not in cache.cached and (1, "g0", None) in cache.cached
    assert cache.admit([(1, "g0", None)], 16, 4) is None  # full: the hit block is there, its output's is not
    cache.finish(big, 96, 0)
    assert cache.admit([(1, "g0", None)], 16, 4) == 15  # a full hit still computes the last prompt token


def simulate_prefix(order, work, capacity_blocks=600, rules=None):
    cost = StepCostModel.synthetic()
    sim = Simulator(cost, VllmDefault(), max_num_seqs=64, max_num_batched_tokens=2304, admission=order,
                    prefix_cache=lambda: PrefixCache(capacity_blocks, 16), adapter_rules=rules or {})
    return sim.run(work)


def test_prefix_orders_in_the_simulator():
    work = workloads.prefix_workload("shared", 600, rate=300, groups=20, max_model_len=512)  # a queue forms
    results = {name: simulate_prefix(order, work) for name, order in
               (("fcfs", lambda c: FirstComeFirstServed()), ("lpm", lambda c: LongestPrefixMatch(c)),
                ("feather", lambda c: FeatherOrder()))}
    for result in results.values():
        assert sorted(t.arrival_s for t in result.timings) == [r.arrival_s for r in work]  # every request served
    # longest prefix match reorders for cache hits: with groups that do not all fit, fewer steps
    assert results["lpm"].steps < results["fcfs"].steps and results["lpm"].clock_s < results["fcfs"].clock_s
    control = workloads.prefix_workload("no-sharing", 300, rate=40, max_model_len=512)
    assert all(r.prefix_group is None for r in control)
    same = [simulate_prefix(order, control).clock_s for order in (lambda c: FirstComeFirstServed(),
                                                                  lambda c: LongestPrefixMatch(c))]
    assert same[0] == same[1]  # nothing shared: LPM is FCFS


def test_per_user_prefill_only_adapters_share_the_system_prompt():
    work = workloads.prefix_workload("per-user", 300, rate=40, adapters=8, max_model_len=512)
    start = 512 * 60 // 100
    assert {r.adapter for r in work} == {f"user{i}" for i in range(8)} and {r.prefix_tokens for r in work} == {start}
    prefill_only = {f"user{i}": AdapterRule(prefill_only=True, adapter_start=start) for i in range(8)}
    shared = simulate_prefix(lambda c: FirstComeFirstServed(), work, rules=prefill_only)
    keyed = simulate_prefix(lambda c: FirstComeFirstServed(), work, rules={})  # all-token: keyed by adapter
    assert shared.clock_s < keyed.clock_s  # the system prompt's KV is computed once for all users


def test_admission_orders_take_back_requeued_requests_and_forget_removed_ones():
    """What the engine's waiting queue tells an order besides arrive/take/finish: a taken request
    put back (preempted) is first in line again, as old as it was; a removed one is gone."""
    from preft.serving.scheduling.admission import FeatherOrder, FirstComeFirstServed, LongestPrefixMatch
    from preft.serving.scheduling.prefix_cache import PrefixCache

    shared = chunk_keys(list(range(32)), CHUNK)
    other = chunk_keys(list(range(100, 132)), CHUNK)
    for order in (FirstComeFirstServed(), LongestPrefixMatch(PrefixCache(64, CHUNK)), FeatherOrder(max_wait_s=5.0)):
        order.arrive("a", shared, 0.0)
        order.arrive("b", other, 1.0)
        order.arrive("c", shared, 2.0)
        first = order.candidate(3.0, 0, 8)
        assert first == "a", order.name
        order.take("a")
        order.requeue("a", shared, 0.0)
        assert order.candidate(3.0, 0, 8) == "a", order.name  # back in front
        order.remove("a")
        assert len(order) == 2
        assert order.candidate(3.0, 0, 8) == "b", order.name  # the oldest left (an empty batch: no sharing yet)
        order.take("b")
        assert order.candidate(8.0, 1, 8) == "c", order.name  # the one left (Feather's first try is ADD)
        with pytest.raises((KeyError, ValueError)):
            order.remove("a")


def test_scheduler_names_split_into_admission_order_and_chunk_policy():
    from preft.serving.scheduling.admission import admission_from_spec, split_scheduler_name

    assert split_scheduler_name("default") == ("fcfs", "default")
    assert split_scheduler_name("feather") == ("feather", "default")
    assert split_scheduler_name("sloweave+feather") == ("feather", "sloweave")
    assert split_scheduler_name("lpm+fixed:64") == ("lpm", "fixed:64")
    for bad in ("feather+lpm", "fixed:1+fixed:2", "+feather"):
        with pytest.raises(ValueError):
            split_scheduler_name(bad)
    assert admission_from_spec({"name": "fixed:64"}) is None  # vLLM's own queue
    assert admission_from_spec({"name": "feather", "feather_max_wait_s": 2}).admission.max_wait_s == 2
    with pytest.raises(ValueError, match="lpm admission order needs a prefix cache"):
        admission_from_spec({"name": "lpm"})
    with pytest.raises(ValueError, match="Feather's"):
        admission_from_spec({"name": "lpm", "feather_state": "x.json"})


def test_keys_past_the_prompt_boundary_differ_from_the_same_tokens_as_prompt():
    """Turn 1 decoded past its P (adapter off there); turn 2 holds the same tokens as prompt
    (adapter on): a prefill-only adapter's keys tell them apart, the base model's and an
    all-token adapter's do not, and chunks wholly inside both prompts stay shared."""
    tokens = list(range(80))  # 10 chunks of 8; turn 1's P = 20, inside the third chunk
    rule = AdapterRule(prefill_only=True)
    turn1, turn2 = chunk_keys(tokens, CHUNK, "alice", rule, prompt_length=20), chunk_keys(tokens, CHUNK, "alice", rule)
    assert turn1[:2] == turn2[:2] and all(a != b for a, b in zip(turn1[2:], turn2[2:]))
    assert chunk_keys(tokens, CHUNK, prompt_length=20) == chunk_keys(tokens, CHUNK)
    assert chunk_keys(tokens, CHUNK, "alice", prompt_length=20) == chunk_keys(tokens, CHUNK, "alice")  # all-token
    late = AdapterRule(prefill_only=True, adapter_start=40)  # the boundary before the adapter starts: base KV
    assert chunk_keys(tokens, CHUNK, "alice", late, prompt_length=24) == chunk_keys(tokens, CHUNK)
    seq1, seq2 = (adapter_sequence(tokens, CHUNK, "alice", rule, prompt_length=20),
                  adapter_sequence(tokens, CHUNK, "alice", rule))
    tree = RadixTree(CHUNK)
    tree.insert("turn1", seq1)
    tree.activate("turn1")  # running: its sequence is in the tree
    assert tree.match_length(seq2) == 20  # what turn 2 may reuse of turn 1: its prompt, no further
    assert tree.match_length(seq1) == 80


def test_a_conversation_workload_grows_each_prompt_by_the_answer_and_a_follow_up():
    work = workloads.conversation_workload(40, rate=2.0, seed=1, max_model_len=512, users=4)
    by_id = {spec.request_id: spec for spec in work}
    assert {spec.adapter for spec in work} == {f"user{i}" for i in range(4)}
    later = [spec for spec in work if spec.after is not None]
    assert later and all(spec.turn == by_id[spec.after].turn + 1 and spec.conversation == by_id[spec.after].conversation
                         for spec in later)
    for spec in later:
        previous = by_id[spec.after]
        assert spec.prompt_tokens > previous.prompt_tokens + previous.output_tokens  # + a follow-up
    assert all(spec.prompt_tokens + spec.output_tokens < 512 for spec in work)  # every turn fits the context
    assert {spec.turn for spec in work} >= {1, 2} and max(spec.turn for spec in work) <= 4
    with pytest.raises(ValueError, match="conversation workload"):
        workloads.conversation_workload(4, rate=0.0)


def test_a_later_turn_reuses_the_answer_blocks_only_when_their_kv_does_not_depend_on_the_boundary():
    """The simulator's keys of turn 1's decoded blocks (:func:`filled_keys`) against turn 2's
    prompt keys: the base model and an all-token adapter share them; a prefill-only adapter
    shares only the blocks wholly inside turn 1's prompt."""
    from preft.serving.scheduling.prefix_cache import filled_keys

    turn1 = workloads.RequestSpec("c-t1", 0.0, 40, 60, adapter="alice", conversation="c")
    turn2 = workloads.RequestSpec("c-t2", 0.0, 110, 8, adapter="alice", conversation="c", turn=2, after="c-t1")
    prefill_only = AdapterRule(prefill_only=True)
    for rule, shared in ((None, 6), (prefill_only, 2)):  # all-token (adapter-keyed); LoRA-P from position 0
        cached = workload_keys(turn1, 16, rule) + filled_keys(turn1, 16, rule)
        assert len(cached) == (40 + 60 - 1) // 16  # prompt blocks and the blocks the decode filled
        hits = PrefixCache(100, 16)
        for key in cached:
            hits.cached[key] = 0
        assert hits.hit_blocks(workload_keys(turn2, 16, rule)) == shared, rule
    base1, base2 = (workloads.RequestSpec(s.request_id, 0.0, s.prompt_tokens, s.output_tokens, conversation="c")
                    for s in (turn1, turn2))
    assert workload_keys(base2, 16)[:6] == workload_keys(base1, 16) + filled_keys(base1, 16)
    # another conversation never shares them
    other = workloads.RequestSpec("d-t2", 0.0, 110, 8, conversation="d", turn=2)
    assert not set(workload_keys(other, 16)) & set(workload_keys(base2, 16))


def test_the_cache_keeps_decoded_blocks_and_evicts_a_request_tail_first():
    cache = PrefixCache(capacity_blocks=4, block_tokens=16)
    prompt = [(1, "c", None)]
    filled = [(2, "c", None), (3, "c", None)]
    assert cache.admit(prompt, prompt_tokens=16, output_tokens=33) == 0 and cache.used() == 4
    cache.finish(prompt, 16, 33, filled)
    assert cache.used() == 3 and all(key in cache.cached for key in prompt + filled)  # the fourth block freed
    assert cache.admit([(1, "x", None)], 16, 16) == 0  # needs 2 blocks: 1 free, 1 evicted, the tail one
    assert (3, "c", None) not in cache.cached and (1, "c", None) in cache.cached and (2, "c", None) in cache.cached


def test_the_simulator_sends_a_later_turn_after_the_answer_and_preft_prefills_the_answer_again():
    cost = StepCostModel.synthetic()
    work = workloads.conversation_workload(24, rate=4.0, seed=2, max_model_len=512, users=4, think_s=0.2)
    results = {}
    for variant, rules in (("base", None), ("preft", {f"user{i}": AdapterRule(prefill_only=True) for i in range(4)}),
                           ("all-token", {})):
        specs = [workloads.RequestSpec(**{**s.__dict__, "adapter": None}) for s in work] if variant == "base" else work
        sim = Simulator(cost, VllmDefault(), max_num_seqs=64, max_num_batched_tokens=2048,
                        prefix_cache=lambda: PrefixCache(400, 128), adapter_rules=rules or {})
        results[variant] = sim.run(specs)
    result = results["preft"]
    finish = {spec.request_id: timing.finish_s for spec, timing in zip(result.specs, result.timings)}
    for spec, timing in zip(result.specs, result.timings):
        if spec.after is not None:  # a closed loop: sent think_s after the answer it follows
            assert timing.arrival_s == pytest.approx(finish[spec.after] + spec.think_s)
    assert len(result.timings) == len(work)

    by_id = {spec.request_id: spec for spec in work}
    for variant, run in results.items():  # a cache that evicts nothing: every turn hits exactly this
        for spec in run.specs:
            if spec.after is None:
                continue
            previous = by_id[spec.after]
            # base and all-token reuse every block the previous turn left, its decoded ones too;
            # PreFT only those wholly inside the previous prompt
            left = (previous.prompt_tokens + previous.output_tokens - 1) // 128 if variant != "preft" \
                else previous.prompt_tokens // 128
            reused = min(left, spec.prompt_tokens // 128) * 128
            assert run.recomputed_tokens[spec.request_id] == spec.prompt_tokens - min(reused, spec.prompt_tokens - 1)
    later = [s for s in work if s.turn > 1]
    extra = sum(results["preft"].recomputed_tokens[s.request_id] - results["base"].recomputed_tokens[s.request_id]
                for s in later)
    assert extra > 0  # the answers PreFT prefills again


def test_the_conversations_part_simulates_fewer_slots_than_users():
    """``preft eval prefix --parts conversations --slots S``: the simulator gives the 8 users' adapters
    S slots; all-token conversations, which hold a slot to their last token, lose more than PreFT's."""
    from preft.eval import prefix_conversations
    from preft.serving.scheduling.cost_model import StepCostModel

    work = workloads.conversation_workload(24, rate=8.0, seed=2, max_model_len=512, users=prefix_conversations.USERS)
    cost = StepCostModel([0.019, 0.0, 0.0003, 0.002, 0.0007, 0.0, 0.0, 0.0])
    settings = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "engine_blocks": 400}

    def throughput(variant, slots):
        return prefix_conversations.simulate(work, variant, cost, {**settings, "slots": slots})["output_throughput"]

    loss = {variant: throughput(variant, 1) / throughput(variant, 0) for variant in ("preft", "all-token")}
    assert loss["preft"] > 0.95 and loss["all-token"] < 0.9  # PreFT barely feels one slot; all-token does
