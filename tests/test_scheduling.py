"""The plain-Python scheduling policies: cost model, SLOWeave, workloads, simulator, metrics."""

from __future__ import annotations

import itertools
import json
import math
import random

import numpy as np
import pytest

from preft.serving.scheduling import workloads
from preft.serving.scheduling.chunk_policies import FixedChunk, StepView, VllmDefault, make_policy, policy_from_spec
from preft.serving.scheduling.cost_model import FEATURES, StepCostModel, features, nonnegative_least_squares
from preft.serving.scheduling.metrics import RequestTiming, percentile, summarize
from preft.serving.scheduling.simulator import Simulator
from preft.serving.scheduling.sloweave import SLOWeave


def test_nonnegative_least_squares_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(30, 3))
    b = a @ np.array([1.0, -2.0, 0.5]) + 0.01 * rng.normal(size=30)
    w = nonnegative_least_squares(a, b)
    assert (w >= 0).all() and w[1] == 0.0  # the negative weight is clamped, the others refitted
    best = min((np.linalg.norm(a @ np.array(c) - b), c)
               for c in itertools.product(np.linspace(0, 2, 81), [0.0], np.linspace(0, 2, 81)))
    assert np.linalg.norm(a @ w - b) <= best[0] + 1e-9


def test_the_fit_recovers_a_known_cost_and_stays_monotone_in_the_chunk():
    truth = StepCostModel([1e-3, 2e-3, 5e-5, 1e-3, 2e-5, 1e-5, 3e-5, 4e-6])
    rng = random.Random(0)
    shapes = [(rng.choice([0, 1, 4, 16, 64]), rng.choice([0, 16, 64, 256, 1024]), rng.randrange(0, 4000))
              for _ in range(300)]
    fitted = StepCostModel.fit(shapes, [truth(*s) for s in shapes])
    assert np.allclose(fitted.weights, truth.weights, rtol=1e-6, atol=1e-12)
    # data that says "bigger chunks are faster" cannot make the model say so
    odd = StepCostModel.fit([(0, c, 0) for c in range(0, 512, 8)], [0.01 - 1e-5 * c for c in range(0, 512, 8)])
    values = [odd(4, c, 100) for c in range(0, 1024, 8)]
    assert all(b >= a for a, b in zip(values, values[1:]))


def test_cost_model_files_round_trip_and_a_bad_file_is_one_clear_error(tmp_path):
    model = StepCostModel([0.001 * (i + 1) for i in range(len(FEATURES))], meta={"gap_s": 0.0004})
    path = model.save(tmp_path / "sub" / "cost.json")
    again = StepCostModel.load(path)
    assert again.weights == model.weights and again.meta["gap_s"] == 0.0004
    assert again(3, 100, 500) == pytest.approx(np.dot(model.weights, features(3, 100, 500)))
    assert [p.name for p in path.parent.iterdir()] == ["cost.json"]  # no temporary file left
    (tmp_path / "bad.json").write_text(json.dumps({"weights": [1, 2]}))
    with pytest.raises(ValueError, match="not a step cost model"):
        StepCostModel.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="cannot read"):
        StepCostModel.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="non-negative"):
        StepCostModel([-1.0] + [0.0] * (len(FEATURES) - 1))


def view(now=0.0, last=(), context=0, pending=0):
    return StepView(now=now, decode_last_token_times=tuple(last), context_tokens=context, pending_prefill_tokens=pending)


def test_sloweave_picks_the_largest_chunk_that_meets_the_earliest_deadline():
    cost = StepCostModel.synthetic()
    policy = SLOWeave(cost, tpot_s=0.010, max_chunk=2048)
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randrange(1, 64)
        now = rng.uniform(0.0, 1.0)
        last = [now - rng.uniform(0.0, 0.012) for _ in range(n)]
        pending = rng.randrange(1, 5000)
        calls = policy.model_calls
        chunk = policy.prefill_budget(view(now, last, 100, pending))
        budget = max(0.0, min(last) + 0.010 - now)
        assert policy.model_calls - calls <= math.ceil(math.log2(2048)) + 2  # O(log C_max)
        if chunk == 0:
            assert cost(n, 1, 100) > budget
            continue
        assert chunk <= min(2048, pending) and cost(n, chunk, 100) <= budget
        assert chunk == min(2048, pending) or cost(n, chunk + 1, 100) > budget
    # no decodes: the whole prefill, up to C_max; nothing pending: 0
    assert policy.prefill_budget(view(pending=5000)) == 2048
    assert policy.prefill_budget(view(pending=300)) == 300
    assert policy.prefill_budget(view(last=[0.0], pending=0)) == 0
    # a margin makes it more careful
    careful = SLOWeave(cost, tpot_s=0.010, margin_s=0.002)
    assert careful.prefill_budget(view(0.001, [0.0], 0, 5000)) < policy.prefill_budget(view(0.001, [0.0], 0, 5000))


def test_sloweave_spends_the_slack_a_request_built_up_under_its_mean_tpot():
    """TPOT is a request's mean time per token after its first: a request whose 20 tokens came at
    half the target has 100 ms in hand, and SLOWeave gives it to a larger chunk; a request behind
    its mean still gets TPOT from its last token, never less."""
    cost = StepCostModel.synthetic()
    policy = SLOWeave(cost, tpot_s=0.010, max_chunk=2048)
    now = 1.0
    strict = policy.prefill_budget(view(now, [now - 0.004], 100, 5000))
    ahead = StepView(now=now, decode_last_token_times=(now - 0.004,), context_tokens=100, pending_prefill_tokens=5000,
                     decode_first_token_times=(now - 0.1,), decode_output_tokens=(20,))
    assert policy.budget_s(ahead) == pytest.approx(0.1)  # f + k * TPOT - now = 0.9 + 0.2 - 1.0
    assert policy.prefill_budget(ahead) == 2048 > 2 * strict  # C_max, where one token from the last allows less
    behind = StepView(now=now, decode_last_token_times=(now - 0.004,), context_tokens=100, pending_prefill_tokens=5000,
                      decode_first_token_times=(now - 0.5,), decode_output_tokens=(20,))
    assert policy.prefill_budget(behind) == strict


def test_policies_by_name_and_their_errors(tmp_path):
    assert isinstance(make_policy("default"), VllmDefault)
    assert make_policy("fixed:256").prefill_budget(view(pending=1000)) == 256
    assert make_policy("fixed:256").prefill_budget(view(pending=10)) == 10
    cycle = make_policy("cycle:16,256")
    assert [cycle.prefill_budget(view(pending=1000)) for _ in range(4)] == [256, 16, 256, 16]
    assert cycle.prefill_budget(view(pending=5)) == 5
    for bad, message in (("cycle:16,x", "cycle:TOKENS"), ("cycle:0", ">= 1"), ("fixed:x", "fixed:TOKENS"), ("fixed:0", ">= 1"), ("lpm", "unknown scheduler"),
                         ("sloweave", "cost model")):
        with pytest.raises(ValueError, match=message):
            make_policy(bad)
    path = StepCostModel.synthetic().save(tmp_path / "c.json")
    policy = policy_from_spec({"name": "sloweave", "tpot_ms": 20, "cost_model": str(path), "max_chunk": 512})
    assert isinstance(policy, SLOWeave) and policy.tpot_s == 0.02 and policy.max_chunk == 512
    with pytest.raises(ValueError, match="unknown key"):
        policy_from_spec({"name": "default", "tpot": 3})


def test_workloads_are_seeded_fit_the_context_and_round_trip_as_vllm_timed_traces(tmp_path):
    for kind in workloads.KINDS:
        first = workloads.generate(kind, 300, rate=10, seed=3, max_model_len=512)
        assert first == workloads.generate(kind, 300, rate=10, seed=3, max_model_len=512)
        assert first != workloads.generate(kind, 300, rate=10, seed=4, max_model_len=512)
        assert all(r.prompt_tokens + r.output_tokens < 512 and r.output_tokens >= 1 for r in first)
        arrivals = [r.arrival_s for r in first]
        assert arrivals == sorted(arrivals) and 300 / arrivals[-1] == pytest.approx(10, rel=0.25)
    chat = workloads.generate("chat", 500, 10, max_model_len=512)
    long = workloads.generate("long", 500, 10, max_model_len=512)
    assert max(r.prompt_tokens for r in chat) < min(r.prompt_tokens for r in long)
    bursty = workloads.generate("bursty", 600, 10, max_model_len=512)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(bursty, bursty[1:])]
    assert max(gaps) > 1.5  # the "off" stretches (2 s of 3 s cycles at 10 req/s)
    path = workloads.write_trace(chat[:50], tmp_path / "chat.jsonl")
    assert workloads.read_trace(path) == chat[:50]
    for line, request in zip(path.read_text().splitlines(), chat):
        entry = json.loads(line)
        assert entry["timestamp"] == request.arrival_s and entry["input_length"] == request.prompt_tokens
        assert len(entry["hash_ids"]) == -(-request.prompt_tokens // workloads.TRACE_BLOCK_TOKENS)
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.generate("chatty", 10, 1)


def test_metrics_follow_vllms_definitions():
    timings = [RequestTiming(0.0, 0.1, 1.1, 11), RequestTiming(0.5, 1.5, 2.0, 6), RequestTiming(1.0, 1.2, 1.2, 1)]
    assert timings[0].tpot_s == pytest.approx(0.1) and timings[2].tpot_s is None
    summary = summarize(timings, ttft_s=0.5, tpot_s=0.1)
    assert summary["duration_s"] == 2.0 and summary["goodput"] == 1.0  # the second misses its TTFT
    assert summary["slo_attainment"] == pytest.approx(2 / 3)
    values = [random.random() for _ in range(101)]
    assert percentile(values, 90) == pytest.approx(np.percentile(values, 90))


def one_request(prompt, output, arrival=0.0):
    return [workloads.RequestSpec("r", arrival, prompt, output)]


def test_the_simulator_steps_one_request_exactly():
    cost = StepCostModel.synthetic()
    result = Simulator(cost, VllmDefault(), gap_s=0.001).run(one_request(100, 4, arrival=2.0))
    timing = result.timings[0]
    assert timing.ttft_s == pytest.approx(cost(0, 100, 0))  # the token exists at the step's end
    contexts = [100, 101, 102]  # each decode reads the KV so far
    assert timing.finish_s - timing.first_token_s == pytest.approx(sum(cost(1, 0, x) + 0.001 for x in contexts))
    chunked = Simulator(cost, FixedChunk(32), gap_s=0.0, record_shapes=True).run(one_request(100, 1))
    assert chunked.step_shapes == [(0, 32, 0), (0, 32, 32), (0, 32, 64), (0, 4, 96)]
    assert chunked.timings[0].ttft_s == pytest.approx(sum(cost(*shape) for shape in chunked.step_shapes))


def test_sloweave_meets_the_tpot_target_where_a_fixed_chunk_cannot():
    cost = StepCostModel.synthetic()
    work = workloads.generate("long", 400, rate=40, seed=0, max_model_len=4096)
    tpot = 0.010
    results = {}
    for name in ("fixed:2048", "sloweave"):
        policy = make_policy(name, cost_model=cost, tpot_s=tpot, max_chunk=2048)
        results[name] = Simulator(cost, policy, max_num_seqs=128, max_num_batched_tokens=4096, gap_s=0.0).run(work)
    tpots = {name: [t.tpot_s for t in r.timings if t.tpot_s is not None] for name, r in results.items()}
    assert max(tpots["sloweave"]) <= tpot + 1e-9  # an exact cost model: every deadline met
    assert max(tpots["fixed:2048"]) > tpot
    goodput = {name: r.summary(ttft_s=1.0, tpot_s=tpot)["goodput"] for name, r in results.items()}
    assert goodput["sloweave"] > goodput["fixed:2048"]
    assert sorted(t.arrival_s for t in results["sloweave"].timings) == [r.arrival_s for r in work]  # all finish


def test_ten_thousand_requests_simulate():
    cost = StepCostModel.synthetic()
    work = workloads.generate("mixed", 10_000, rate=30, seed=0, max_model_len=2048)
    result = Simulator(cost, SLOWeave(cost, tpot_s=0.02), max_num_seqs=128, max_num_batched_tokens=4096).run(work)
    assert len(result.timings) == 10_000 and result.steps > 10_000


def test_preft_serve_checks_its_scheduler_flags_before_anything_starts(tmp_path, capsys):
    from preft.cli import build_parser, main
    from preft.serving.server import server_environment, vllm_arguments

    cost = StepCostModel.synthetic().save(tmp_path / "cost.json")
    args = build_parser().parse_args(["serve", "--scheduler", "sloweave", "--tpot-ms", "40", "--cost-model", str(cost),
                                      "--max-chunk", "512"])
    spec = json.loads(server_environment(args, tmp_path, {})["PREFT_SCHEDULER"])
    assert spec == {"name": "sloweave", "max_chunk": 512, "tpot_ms": 40.0, "cost_model": str(cost), "margin_ms": 0.0}
    args.lora_adapters = []
    argv = vllm_arguments(args, tmp_path)
    assert argv[argv.index("--max-num-batched-tokens") + 1] == str(512 + 256)
    plain = build_parser().parse_args(["serve"])
    plain.lora_adapters = []
    assert "--max-num-batched-tokens" not in vllm_arguments(plain, tmp_path)
    assert json.loads(server_environment(plain, tmp_path, {})["PREFT_SCHEDULER"])["name"] == "default"
    combined = build_parser().parse_args(["serve", "--scheduler", "feather+fixed:256", "--feather-state",
                                          str(tmp_path / "feather.json"), "--feather-max-wait-s", "3"])
    combined.lora_adapters = []
    spec = json.loads(server_environment(combined, tmp_path, {})["PREFT_SCHEDULER"])
    assert spec["name"] == "feather+fixed:256" and spec["feather_max_wait_s"] == 3.0
    assert spec["feather_state"] == str(tmp_path / "feather.json")  # absent is fine: Feather starts empty
    argv = vllm_arguments(combined, tmp_path)
    assert argv[argv.index("--max-num-batched-tokens") + 1] == str(256 + 256)
    alone = build_parser().parse_args(["serve", "--scheduler", "feather"])
    alone.lora_adapters = []
    assert "--max-num-batched-tokens" not in vllm_arguments(alone, tmp_path)  # vLLM's chunking is kept
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    learned = build_parser().parse_args(["serve", "--scheduler", "sloweave", "--tpot-ms", "40", "--state-dir",
                                         str(state_dir)])
    learned.lora_adapters = []  # no --cost-model: SLOWeave learns one, kept in the state directory
    spec = json.loads(server_environment(learned, tmp_path, {})["PREFT_SCHEDULER"])
    assert spec == {"name": "sloweave", "max_chunk": 2048, "tpot_ms": 40.0, "margin_ms": 0.0,
                    "cost_state": str(state_dir.resolve() / "step_cost_online.json")}
    (tmp_path / "junk.json").write_text("{}")
    (state_dir / "step_cost_online.json").write_text('{"format": "preft-online-step-cost/1", "steps": [[1, 2]]}')
    for flags, message in ((["--scheduler", "sloweave"], "needs --tpot-ms MS"),
                           (["--scheduler", "sloweave", "--tpot-ms", "40", "--state-dir", str(state_dir)],
                            "online step cost state"),  # a corrupted state: one line, before start-up
                           (["--scheduler", "sloweave", "--tpot-ms", "40", "--cost-model", str(tmp_path / "junk.json")],
                            "not a step cost model"),
                           (["--scheduler", "fixed:0"], ">= 1"),
                           (["--scheduler", "fifo"], "unknown scheduler"),
                           (["--scheduler", "feather+lpm"], "at most one admission order"),
                           (["--scheduler", "feather+"], "an empty part"),
                           (["--scheduler", "lpm", "--feather-state", str(tmp_path / "f.json")], "Feather's"),
                           (["--scheduler", "feather", "--feather-state", str(tmp_path / "junk.json")],
                            "cannot read the Feather state"),
                           (["--scheduler", "feather", "--feather-state", str(tmp_path / "no" / "f.json")],
                            "existing directory"),
                           (["--scheduler", "feather", "--feather-max-wait-s", "0"], "must be > 0"),
                           (["--scheduler", "feather", "--", "--no-enable-prefix-caching"], "needs prefix caching"),
                           (["--", "--async-scheduling"], "--async-scheduling cannot run with PreFT's scheduler"),
                           (["--tpot-ms", "40"], "SLOWeave's")):
        assert main(["serve", "--port", "1", *flags]) == 2  # (after --, --port would be vLLM's: refused)
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
