"""PreFT's SGLang plugin without SGLang: the waiting-order hook on a stand-in scheduler that admits
as SGLang's ``get_new_batch_prefill`` does (from the front of ``waiting_queue`` while its token
budget lasts, the rest left waiting), ``preft serve --engine sglang``'s refusals, LoRA-P's token mask."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from preft.serving.scheduling.admission import FirstComeFirstServed, make_admission
from preft.serving.sglang.waiting_order import WaitingOrder, admit_in_order, reward


def req(rid: str, tokens: list[int]):
    return SimpleNamespace(rid=rid, origin_input_ids=tokens, lora_id=None)


class Scheduler:
    """What the hooks read of SGLang's Scheduler, and its admission: front first, while
    ``budget`` prompt tokens last (SGLang's PrefillAdder, simplified)."""

    def __init__(self, order, budget: int = 10**6, capacity: int = 64) -> None:
        self.waiting_queue, self.chunked_req, self.last_batch = [], None, None
        self.running_batch = SimpleNamespace(reqs=[])
        self.max_running_requests, self.budget = capacity, budget
        self.preft_waiting_order = WaitingOrder(order, chunk_tokens=4)
        self.seen_queues = []

    def get_new_batch_prefill(self, running_batch):
        self.seen_queues.append([r.rid for r in self.waiting_queue])
        admitted, used = [], 0
        for r in self.waiting_queue:
            if used + len(r.origin_input_ids) > self.budget:
                break
            admitted.append(r)
            used += len(r.origin_input_ids)
        self.waiting_queue = [r for r in self.waiting_queue if r not in admitted]
        running_batch.reqs.extend(admitted)
        return admitted

    def step(self):
        return admit_in_order(Scheduler.get_new_batch_prefill, self, self.running_batch)


def test_fcfs_through_the_hook_is_sglangs_own_fcfs():
    scheduler = Scheduler(FirstComeFirstServed(), budget=12)
    scheduler.waiting_queue = [req(f"r{i}", [i] * 5) for i in range(5)]
    assert [r.rid for r in scheduler.step()] == ["r0", "r1"]  # 12 tokens: two of 5
    assert [r.rid for r in scheduler.waiting_queue] == ["r2", "r3", "r4"]  # placed back, in order
    assert scheduler.preft_waiting_order.taken.keys() == {"r0", "r1"}
    assert [r.rid for r in scheduler.step()] == ["r2", "r3"]
    assert [r.rid for r in scheduler.step()] == ["r4"] and scheduler.waiting_queue == []


def test_feather_admits_the_request_sharing_the_batch_prefix_first():
    scheduler = Scheduler(make_admission("feather"), budget=10**6)
    shared = [7] * 8
    scheduler.waiting_queue = [req("a", shared + [1] * 4)]
    scheduler.step()
    # b arrived first but shares nothing; c and d share a's prefix: Feather takes them first
    scheduler.waiting_queue = [req("b", [9] * 12), req("c", shared + [2] * 4), req("d", shared + [3] * 4)]
    scheduler.step()
    assert scheduler.seen_queues[-1][:2] == ["c", "d"], scheduler.seen_queues


def test_a_stop_holds_the_rest_back_and_nothing_is_lost():
    order = make_admission("feather")
    order.admission.bandit.choose = lambda state: "stop"  # the bandit says STOP whenever it is asked
    scheduler = Scheduler(order)
    shared = [7] * 8
    scheduler.waiting_queue = [req("a", shared + [1] * 4)]
    scheduler.step()
    scheduler.waiting_queue = [req("c", shared + [2] * 4), req("x", [5] * 4 + shared)]
    admitted = scheduler.step()
    # c misses a chunk a's batch does not hold but shares one, so the bandit is asked: STOP
    assert admitted == [] and sorted(r.rid for r in scheduler.waiting_queue) == ["c", "x"]
    scheduler.running_batch.reqs.clear()  # a finished: an empty batch always admits
    assert [r.rid for r in scheduler.step()][:1] in (["c"], ["x"])
    assert "a" not in scheduler.preft_waiting_order.taken  # a left the working set


def test_requests_not_placed_are_requeued_and_aborted_ones_removed():
    scheduler = Scheduler(make_admission("feather"), budget=8)
    scheduler.waiting_queue = [req("a", [1] * 8), req("b", [2] * 8), req("c", [3] * 8)]
    scheduler.step()
    state = scheduler.preft_waiting_order
    assert set(state.taken) == {"a"} and set(state.waiting) == {"b", "c"}  # b, c picked but not placed
    scheduler.waiting_queue = [r for r in scheduler.waiting_queue if r.rid != "c"]  # c aborted
    scheduler.step()
    assert "c" not in state.waiting and "c" not in state.order.tree.keys
    assert set(state.taken) == {"a", "b"}


def test_a_retracted_request_waits_again_as_old_as_it_was():
    scheduler = Scheduler(make_admission("feather"))
    a = req("a", [1] * 8)
    scheduler.waiting_queue = [a]
    scheduler.step()
    arrived = scheduler.preft_waiting_order.taken["a"]
    scheduler.running_batch.reqs.remove(a)  # SGLang retracts it: back in the queue
    scheduler.waiting_queue = [req("b", [2] * 8), a]
    scheduler.step()
    assert scheduler.seen_queues[-1][0] == "a"  # the oldest goes first
    assert scheduler.preft_waiting_order.taken["a"] == arrived


@pytest.mark.parametrize("decode", [True, False])
def test_each_step_time_reaches_the_order(decode):
    seen = []
    scheduler = Scheduler(FirstComeFirstServed())
    scheduler.preft_waiting_order.order.reward = lambda *args: seen.append(args)
    batch = SimpleNamespace(reqs=[1, 2, 3], extend_num_tokens=40,
                            forward_mode=SimpleNamespace(is_decode=lambda: decode))
    reward(scheduler.preft_waiting_order, batch, 0.25)
    assert seen == [(3, 0.25, 0 if decode else 40)]


# ---------------------------------------------------------------- preft serve --engine sglang: refusals


@pytest.mark.parametrize("argv, message", [
    (["--allow-runtime-loading"], "--allow-runtime-loading is not available with --engine sglang"),
    (["--adapter", "a=/nowhere"], "adapter 'a': bundle directory not found"),
    (["--scheduler", "sloweave"], "--scheduler sloweave needs --tpot-ms"),
    (["--scheduler", "sloweave", "--tpot-ms", "30", "--", "--chunked-prefill-size", "64"],
     "drop --chunked-prefill-size"),
    (["--scheduler", "fixed:64"], "--scheduler fixed:64 does not run on SGLang"),
    (["--state-dir", "/tmp"], "--state-dir is not available with --engine sglang"),
    (["--scheduler", "lpm"], "--scheduler lpm does not run on SGLang"),
    (["--scheduler", "feather", "--", "--schedule-policy", "lpm"], "drop --schedule-policy"),
    (["--scheduler", "nonsense"], "--scheduler: unknown scheduler"),
    (["--tensor-parallel-size", "2"], "runs on one device here"),
])
def test_serve_on_sglang_refuses_what_it_cannot_run_in_one_line(argv, message, capsys, monkeypatch, tmp_path):
    from preft.cli import main as cli_main

    monkeypatch.setenv("PREFT_SGLANG_PYTHON", str(tmp_path / "python"))  # refused before it is needed
    assert cli_main(["serve", "--engine", "sglang", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_serve_on_sglang_without_its_venv_says_how_to_make_it(capsys, monkeypatch, tmp_path):
    from preft.cli import main as cli_main

    monkeypatch.setenv("PREFT_SGLANG_PYTHON", str(tmp_path / "python"))
    assert cli_main(["serve", "--engine", "sglang"]) == 2
    assert "run `make sglang`" in capsys.readouterr().err


def test_kv_cache_gib_becomes_sglangs_token_count(tmp_path):
    """SmolLM2's shape: 30 layers, 3 KV heads of 64; in bf16 a token's K and V take
    2 * 30 * 3 * 64 * 2 = 23,040 bytes, so 1 GiB holds 46,603 tokens."""
    import json

    from preft.serving.sglang.server import kv_tokens

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9,
                                                      "num_key_value_heads": 3, "hidden_size": 576,
                                                      "torch_dtype": "bfloat16"}))
    assert kv_tokens(tmp_path, 1, "auto") == 46603
    assert kv_tokens(tmp_path, 1, "float32") == 23301


# ---------------------------------------------------------------- LoRA-P's token mask on SGLang


def test_lora_p_token_mask_follows_the_rule_per_request():
    """Three requests in one step: a LoRA-P one (start 1, P 4) prefilling positions 0-5 (a
    recompute past its prompt), a base one (2 tokens), an all-token one (1 token at position 9)."""
    import torch

    from preft.rule import ALL_TOKEN, AdapterRule
    from preft.serving.sglang.lora_p import token_mask

    rules = {"p": AdapterRule(prefill_only=True, adapter_start=1), "all": ALL_TOKEN}
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 7, 8, 9])
    mask = token_mask(positions, [6, 2, 1], ["p", None, "all"], [4, 9, 3], rules)
    assert mask.tolist() == [False, True, True, True, False, False, True, True, True]
    assert token_mask(positions, [6, 2, 1], ["all", None, "all"], [4, 9, 3], rules) is None  # nothing to mask
    with pytest.raises(RuntimeError, match="do not match its tokens"):
        token_mask(positions, [5, 2, 1], ["p", None, "all"], [4, 9, 3], rules)


# ---------------------------------------------------------------- SLOWeave's chunk per step on SGLang


class MixedScheduler:
    """What the chunk hook reads of SGLang's Scheduler in mixed-chunk mode, and its prefill pass:
    prompt tokens from the front of ``waiting_queue`` (the chunked request first) while
    ``chunked_prefill_size`` less the running decodes lasts, the last one cut into a chunk
    (SGLang's PrefillAdder, simplified)."""

    is_mixed_chunk = True

    def __init__(self, chunk: int = 2048) -> None:
        self.waiting_queue, self.chunked_req, self.chunked_prefill_size = [], None, chunk
        self.prefilled: list[int] = []

    def get_new_batch_prefill(self, running_batch):
        left = self.chunked_prefill_size - len(running_batch.reqs)
        used = 0
        queue = ([self.chunked_req] if self.chunked_req else []) + self.waiting_queue
        self.chunked_req = None
        for r in list(queue):
            take = min(left - used, r.seqlen - r.extend_end)
            if take <= 0:
                break
            r.extend_end += take
            used += take
            if r in self.waiting_queue:
                self.waiting_queue.remove(r)
            if r.extend_end < r.seqlen:
                self.chunked_req = r
                break
        self.prefilled.append(used)
        return ("plan", used)


def sglang_req(rid: str, prompt: int, outputs: int = 0):
    return SimpleNamespace(rid=rid, seqlen=prompt + outputs, output_ids=[0] * outputs, extend_end=0,
                           finished=lambda: False, inflight_middle_chunks=0)


class Plan(SimpleNamespace):
    pass


class StepCost:
    """T(n, c, x) = 1 ms + 0.1 ms per prefill token: a 20 ms TPOT target leaves room for a chunk
    of (budget − 1 ms) / 0.1 ms tokens."""

    def __call__(self, n, c, x):
        return 1e-3 + 1e-4 * c


@pytest.mark.parametrize("since_last_ms, chunk", [(0.0, 190), (15.0, 40), (19.5, 0)])
def test_sloweave_sets_each_steps_chunk_from_the_earliest_deadline(since_last_ms, chunk):
    """The step's prefill is the largest chunk whose predicted time meets the earliest decode's
    next-token deadline: 20 ms after its last token (its mean TPOT is on target), so with t ms
    gone, c = (19 - t) / 0.1."""
    from preft.serving.scheduling.sloweave import SLOWeave
    from preft.serving.sglang.chunk_control import ChunkControl, sized_prefill

    control = ChunkControl(SLOWeave(StepCost(), tpot_s=0.020))
    scheduler = MixedScheduler()
    decode = sglang_req("d", 10, outputs=3)
    scheduler.waiting_queue = [sglang_req("p", 1000)]
    import time as clock

    control.last_token_s["d"] = clock.monotonic() - since_last_ms / 1e3
    control.first_token_s["d"] = control.last_token_s["d"] - 0.040  # 3 tokens on time: no slack to spend
    running = SimpleNamespace(reqs=[decode])
    result = sized_prefill(MixedScheduler.get_new_batch_prefill, scheduler, running, control, plan_class=Plan)
    if chunk == 0:  # no chunk fits before the deadline: a decode-only step, the request keeps waiting
        assert isinstance(result, Plan) and result.batch_to_run is None and result.running_batch is running
        assert scheduler.prefilled == [] and len(scheduler.waiting_queue) == 1
    else:
        assert abs(scheduler.prefilled[-1] - chunk) <= 2, scheduler.prefilled  # the clock moved a little
        assert scheduler.chunked_req.rid == "p"  # cut into a chunk, the rest goes on at a later step
    assert scheduler.chunked_prefill_size == 2048  # SGLang's own setting is back after the pass


def test_without_decodes_the_whole_prompt_goes_and_steps_reach_the_cost_model():
    from preft.serving.scheduling.chunk_policies import policy_from_spec
    from preft.serving.scheduling.spec import SchedulerSpec
    from preft.serving.sglang.chunk_control import ChunkControl, sized_prefill

    policy = policy_from_spec(SchedulerSpec.parse("sloweave", tpot_ms=20, max_chunk=512))
    control = ChunkControl(policy)
    assert control.cost_learner is policy.cost_model  # the online model SLOWeave's budgets rest on
    scheduler = MixedScheduler()
    done, chunked = sglang_req("a", 300), sglang_req("b", 300)
    scheduler.waiting_queue = [done, chunked]
    sized_prefill(MixedScheduler.get_new_batch_prefill, scheduler, SimpleNamespace(reqs=[]), control,
                  plan_class=Plan)
    assert scheduler.prefilled == [512] and scheduler.chunked_req is chunked  # no deadline: up to --max-chunk
    chunked.inflight_middle_chunks = 1
    mode = SimpleNamespace(is_idle=lambda: False, is_decode=lambda: False)
    batch = SimpleNamespace(forward_mode=mode, reqs=[done, chunked], decoding_reqs=None, extend_num_tokens=512,
                            prefix_lens=[0, 0])
    before = len(control.cost_learner.steps)
    control.record(batch, started_s=control.pass_started_s, now=control.pass_started_s + 0.05)
    assert list(control.cost_learner.steps)[before:] == [(0, 512, 0, pytest.approx(0.05))]
    assert "a" in control.last_token_s and chunked.rid not in control.last_token_s  # a middle chunk: no token
    decode_mode = SimpleNamespace(is_idle=lambda: False, is_decode=lambda: True)
    control.record(SimpleNamespace(forward_mode=decode_mode, reqs=[done]), started_s=1.0, now=1.02)
    assert list(control.cost_learner.steps)[-1] == (1, 0, 299, pytest.approx(0.02))


def test_sglang_chunks_eval_runs_sglangs_own_fixed_chunks_and_sloweave_in_mixed_mode():
    from preft.eval.sglang_chunking import policy_flags

    assert policy_flags("fixed:256", 80) == (["--scheduler", "default"],
                                             ["--chunked-prefill-size", "256", "--enable-mixed-chunk"])
    assert policy_flags("sloweave", 80) == (["--scheduler", "sloweave", "--tpot-ms", "80"], [])
    with pytest.raises(ValueError, match="unknown policy 'fixed:x'"):
        policy_flags("fixed:x", 80)


def test_sloweave_on_sglang_adds_mixed_chunks_up_to_max_chunk(tmp_path):
    import argparse

    from preft.serving.scheduling.spec import SchedulerSpec
    from preft.serving.sglang.server import sglang_arguments

    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8}')
    args = argparse.Namespace(host="127.0.0.1", port=1, dtype="float32", kv_cache_gib=0.01, max_model_len="auto",
                              served_model_name=None, model=str(tmp_path), vllm_args=[])
    argv = sglang_arguments(args, tmp_path, on_cpu=True, spec=SchedulerSpec.parse("sloweave", tpot_ms=50, max_chunk=512))
    assert argv[argv.index("--chunked-prefill-size") + 1] == "512" and "--enable-mixed-chunk" in argv
    plain = sglang_arguments(args, tmp_path, on_cpu=True, spec=SchedulerSpec.parse("feather"))
    assert "--enable-mixed-chunk" not in plain and "--chunked-prefill-size" not in plain
