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
    (["--scheduler", "sloweave"], "--scheduler sloweave does not run on SGLang"),
    (["--scheduler", "sloweave", "--tpot-ms", "30"], "--tpot-ms is not available with --engine sglang"),
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
