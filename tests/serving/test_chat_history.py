"""A two-turn conversation through ``/v1/chat/completions`` with history (issue: conversations).

Turn 1 decodes 200 tokens, past the 128-token KV block, so the server caches a block whose KV it
computed while decoding (adapter off under the rule). Turn 2 sends the history back as messages:
its prompt holds turn 1's prompt and answer as the same tokens (checked: the control that the
cached decoded block is there to be reused), where the rule turns the adapter on. Turn 2's
answer must equal HF greedy on turn 2's prompt with the adapter on every prompt token, for
LoRA-P (``adapter_start`` 0 and 1), ReFT-P and the base model; the base model reuses turn 1's
decoded block, the prefill-only adapters must not.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from peft import PeftModel

from conftest import greedy_ids, load_base
from live_server import API_KEY, client

#: openings to try: the history goes back as text, and a random model's answer comes back as the
#: same tokens only sometimes (the template puts ": " before it; BPE may re-split it), so each
#: adapter's conversation opens with the first whose answer round-trips past the decoded block
OPENINGS = ["add 12 35 =", "add 1 2 = add 3 4 =", "the quiet", "sort 3 1 2 =", "reverse 3 1 4 1 5 9 2 6 =",
            "copy a b c d =", "a=7 b=2 ; b =", "count 1 1 2 =", "add 7 7 =", "sort 5 4 =", "add 99 1 =", "mul 3 4 ="]
FOLLOW_UP = "sort 8 2 1 9 ="
TURN1_TOKENS, TURN2_TOKENS, BLOCK = 200, 8, 128


def prefix_hits(server) -> float:
    request = urllib.request.Request(server["url"] + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    text = urllib.request.urlopen(request, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


def chat(server, name: str, messages: list[dict], tokens: int) -> tuple[list[int], list[int], str]:
    """``(prompt token ids, answer token ids, answer text)`` as the server saw and made them."""
    response = client(server).chat.completions.create(
        model=name, messages=messages, max_tokens=tokens, temperature=0.0,
        extra_body={"ignore_eos": True, "min_tokens": tokens, "return_token_ids": True})
    choice = response.choices[0]
    return response.model_extra["prompt_token_ids"], choice.model_extra["token_ids"], choice.message.content


def template_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def as_content(text: str) -> str:
    return text[1:] if text.startswith(" ") else text  # the template writes "assistant: " before it


def round_tripping_opening(model, tokenizer) -> str:
    """The first of :data:`OPENINGS` whose greedy answer, sent back as history, is the same
    tokens through the block turn 1 fills while decoding (so that block can be reused)."""
    for opening in OPENINGS:
        turn1 = template_ids(tokenizer, [{"role": "user", "content": opening}])
        answer = greedy_ids(model, turn1, TURN1_TOKENS)
        history = [{"role": "user", "content": opening},
                   {"role": "assistant", "content": as_content(tokenizer.decode(answer, skip_special_tokens=True))},
                   {"role": "user", "content": FOLLOW_UP}]
        if template_ids(tokenizer, history)[: (len(turn1) + TURN1_TOKENS - 1) // BLOCK * BLOCK] == \
                (turn1 + answer)[: (len(turn1) + TURN1_TOKENS - 1) // BLOCK * BLOCK]:
            return opening
    raise AssertionError("no opening's answer round-trips through a decoded block: add openings")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["base", "user0", "user1", "reft0"])
def test_a_chat_with_history_equals_the_rule(server, adapters, base_path, tokenizer, name):
    model = load_base(base_path)
    if name != "base":
        model = PeftModel.from_pretrained(model, adapters / name).eval()
    opening = round_tripping_opening(model, tokenizer)
    turn1, answer, text = chat(server, name, [{"role": "user", "content": opening}], TURN1_TOKENS)
    assert turn1 == template_ids(tokenizer, [{"role": "user", "content": opening}])
    assert answer == greedy_ids(model, turn1, TURN1_TOKENS)
    history = [{"role": "user", "content": opening}, {"role": "assistant", "content": as_content(text)},
               {"role": "user", "content": FOLLOW_UP}]
    before = prefix_hits(server)
    turn2, answer2, _ = chat(server, name, history, TURN2_TOKENS)
    hits = prefix_hits(server) - before
    decoded_blocks = (len(turn1) + TURN1_TOKENS - 1) // BLOCK
    shared = next((i for i, (a, b) in enumerate(zip(turn2, turn1 + answer)) if a != b), len(turn1 + answer))
    assert shared // BLOCK >= decoded_blocks > len(turn1) // BLOCK  # the control: a decoded block to reuse
    assert answer2 == greedy_ids(model, turn2, TURN2_TOKENS), name
    # the base model reuses the decoded block; a prefill-only adapter only what lies inside turn 1's prompt
    assert hits == BLOCK * (decoded_blocks if name == "base" else len(turn1) // BLOCK), (name, hits)


@pytest.mark.slow
def test_the_conversation_benchmark_client_plays_each_turn_on_the_previous_answer(server, tokenizer):
    """``preft eval prefix --parts conversations``'s closed-loop client on the live server: a
    later turn is sent after the previous answer, its prompt that turn's prompt + the answer's
    token ids as served + a follow-up of the workload's length."""
    import asyncio

    from preft.eval.prefix_conversations import play
    from preft.serving.scheduling.workloads import conversation_workload

    work = [spec for spec in conversation_workload(3, rate=20.0, seed=5, max_model_len=300, users=2, turns=(2, 2),
                                                   think_s=0.05)]
    turns = asyncio.run(play(server["url"], API_KEY, work, lambda spec: f"user{spec.adapter[-1]}", len(tokenizer)))
    assert sorted(t["spec"].request_id for t in turns) == sorted(spec.request_id for spec in work)
    by_id = {t["spec"].request_id: t for t in turns}
    for turn in turns:
        spec = turn["spec"]
        assert len(turn["prompt"]) == spec.prompt_tokens and len(turn["answer"]) == spec.output_tokens
        assert 0 < turn["ttft_s"] <= turn["finish_s"] - turn["arrival_s"]
        if spec.after is not None:
            previous = by_id[spec.after]
            assert turn["prompt"][: len(previous["prompt"]) + len(previous["answer"])] == \
                previous["prompt"] + previous["answer"]
            assert turn["arrival_s"] >= previous["finish_s"]  # closed loop
