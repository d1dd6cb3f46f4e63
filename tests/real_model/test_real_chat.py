"""SmolLM2-135M-Instruct behind ``preft serve`` (float32), asked through the ``openai`` client's chat.

- **The generation prompt lies inside P, in training and in serving alike.** The SFT trainer's
  collated row of a chat example has its first completion label right after the chat template's
  ``<|im_start|>assistant\\n``; the server's prompt for the same messages is exactly those
  tokens. So the adapter is on the same positions, the generation prompt included, both ways.
- **A two-turn conversation** through ``/v1/chat/completions``, with LoRA-P and LoReFT-P
  adapters: each turn's answer equals HF greedy (the adapter on the prompt's tokens only) on the
  prompt the server built, turn 2's prompt holding turn 1's question and answer.
"""

from __future__ import annotations

import pytest
import torch

from conftest import greedy_ids
from real_models_common import load, make_adapters, prepared, prompt_ids, tokenizer_of

MODEL = "smollm2-135m-instruct"
TOKENS = 12


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    from preft.eval.harness.server_process import start_server, stop_server

    model_dir = prepared(MODEL)
    root = tmp_path_factory.mktemp("real_chat")
    bundles, models = make_adapters(model_dir, root)
    args = ["--model", MODEL, "--dtype", "float32", "--max-adapters", "2", "--max-rank", "8",
            *[a for name in ("lora_p", "loreft_p") for a in ("--adapter", f"{name}={bundles[name]}")]]
    proc, url, _ = start_server(args, root / "server.log")
    try:
        yield {"url": url, "model_dir": model_dir, "models": models, "log": root / "server.log"}
    finally:
        stop_server(proc)


def chat(server, name: str, messages: list[dict]) -> tuple[list[int], list[int], str]:
    import openai

    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0, timeout=120)
    response = client.chat.completions.create(
        model=name, messages=messages, max_tokens=TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True, "min_tokens": TOKENS, "return_token_ids": True})
    choice = response.choices[0]
    return response.model_extra["prompt_token_ids"], choice.model_extra["token_ids"], choice.message.content


@pytest.mark.slow
@pytest.mark.real_model
def test_generation_prompt_is_inside_p_in_training_and_serving(chat_server, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig

    import preft
    from preft.context import prompt_lengths_from_labels
    from preft.trainers import PreftSFTTrainer
    from preft.user_data import to_prompt_completion

    tokenizer = tokenizer_of(chat_server["model_dir"])
    messages = [{"role": "user", "content": "What is the capital of Peru?"}]
    row = to_prompt_completion({"messages": [*messages, {"role": "assistant", "content": "Ahoy! Lima, arr."}]})
    trainer = PreftSFTTrainer(model=chat_server["model_dir"], train_dataset=Dataset.from_list([row]),
                              args=SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False),
                              peft_config=preft.PreftLoraConfig(r=4, task_type="CAUSAL_LM"))
    batch = trainer.data_collator([trainer.train_dataset[0]])
    trained_p = int(prompt_lengths_from_labels(batch["labels"], batch["attention_mask"])[0])
    expected = prompt_ids(tokenizer, messages[0]["content"])
    assert tokenizer.decode(expected).endswith("<|im_start|>assistant\n")
    assert batch["input_ids"][0, :trained_p].tolist() == expected, "training's P is not the template's prompt"
    served_prompt, _, _ = chat(chat_server, "lora_p", messages)
    assert served_prompt == expected, "the server's chat prompt is not the one the adapter was trained on"


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("name", ["lora_p", "loreft_p", None])
def test_two_turn_chat_equals_hf(chat_server, name):
    model = chat_server["models"][name]
    messages = [{"role": "user", "content": "Name a large animal that lives in the sea."}]
    prompt1, answer1, text1 = chat(chat_server, name or MODEL, messages)
    assert answer1 == greedy_ids(model, prompt1, TOKENS), (name, "turn 1")
    messages += [{"role": "assistant", "content": text1}, {"role": "user", "content": "Where does it sleep?"}]
    prompt2, answer2, _ = chat(chat_server, name or MODEL, messages)
    assert len(prompt2) > len(prompt1) + TOKENS // 2 and prompt2[:len(prompt1)] == prompt1, "turn 2 holds turn 1"
    assert answer2 == greedy_ids(model, prompt2, TOKENS), (name, "turn 2")
    if name is not None:  # the adapter mattered: the base model answers otherwise
        assert answer2 != greedy_ids(chat_server["models"][None], prompt2, TOKENS) or \
            answer1 != greedy_ids(chat_server["models"][None], prompt1, TOKENS)
