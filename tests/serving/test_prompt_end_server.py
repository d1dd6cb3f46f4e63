"""The per-request prompt boundary through the live server (issue: conversations):
``vllm_xargs={"preft_prompt_end": K}`` is checked (a 400 naming the field otherwise) on
completions and chat completions, and ``echo`` + ``logprobs`` on ``context + continuation`` with
``K = len(context)`` gives the continuation's log-probs as the training loss computes them."""

from __future__ import annotations

import openai
import pytest
import torch
from peft import PeftModel

from conftest import load_base
from live_server import client

CONTEXT = "reverse 3 1 4 1 5 ="
CONTINUATION = " 5 1 4 1 3"


@pytest.mark.slow
@pytest.mark.parametrize("end", ["7", 0, -1, 10_000, True, 2.5])
def test_a_bad_prompt_end_is_a_400_on_completions_and_chat(server, end):
    with pytest.raises(openai.BadRequestError, match="preft_prompt_end"):
        client(server).completions.create(model="user1", prompt=CONTEXT, max_tokens=2,
                                          extra_body={"vllm_xargs": {"preft_prompt_end": end}})
    with pytest.raises(openai.BadRequestError):
        client(server).chat.completions.create(model="user1", messages=[{"role": "user", "content": CONTEXT}],
                                               max_tokens=2, extra_body={"vllm_xargs": {"preft_prompt_end": end}})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["user1", "user2", "reft0", "base"])
def test_echoed_logprobs_with_the_boundary_equal_the_training_loss(server, adapters, base_path, tokenizer, name):
    context = tokenizer(CONTEXT)["input_ids"]
    continuation = tokenizer(CONTINUATION, add_special_tokens=False)["input_ids"]
    ids = context + continuation

    def served(xargs):
        response = client(server).completions.create(model=name, prompt=ids, max_tokens=1, echo=True, logprobs=0,
                                                     temperature=0.0, extra_body={"vllm_xargs": xargs} if xargs else {})
        return response.choices[0].logprobs.token_logprobs[len(context): len(ids)]

    model = load_base(base_path)
    if name != "base":
        model = PeftModel.from_pretrained(model, adapters / name).eval()
    batch = torch.tensor([ids])
    labels = batch.clone()
    labels[:, : len(context)] = -100
    with torch.no_grad():
        logits = model(input_ids=batch, attention_mask=torch.ones_like(batch), labels=labels).logits[0].float()
    expected = logits[len(context) - 1: -1].log_softmax(-1).gather(-1, torch.tensor(continuation)[:, None])[:, 0]
    bounded = torch.tensor(served({"preft_prompt_end": len(context)}))
    assert (bounded - expected).abs().max() < 1e-4, (bounded, expected)
    unbounded = torch.tensor(served(None))  # the whole input as prompt: the adapter on the continuation too
    if name == "base":
        assert (unbounded - expected).abs().max() < 1e-4
    else:
        assert (unbounded - expected).abs().max() > 1e-3
