"""``preft serve`` on a hub-style checkpoint directory of each family, as a user runs it.

For a family's directory (bfloat16 shards with an index; the chat template inside
``tokenizer_config.json``; Qwen2/Qwen3 directories load Qwen2's tokenizer, which splits digits one
by one): ``preft serve --model DIR`` with its defaults (but ``--dtype float32``, for parity with
HF), a LoRA-P and a ReFT-P bundle trained by ``preft train`` and exported by ``preft export``,
asked through the ``openai`` client on ``/v1/completions`` and ``/v1/chat/completions``. Every
answer equals HF greedy (float32) on the prompt the server tokenized, which is the prompt HF's
tokenizer of that directory makes (plain and chat-templated); the same LoRA weights all-token
answer otherwise (control).

One family's run costs about 80 s on 2 cores (two `preft train` runs and a server start of about
50 s), so every family's run is in ``make test-families`` (the ``families`` marker, deselected by
default); ``make test`` serves the default model over HTTP (``tests/live_server.py``) and runs
the engine path of Llama and Phi-3 (``test_engine_families.py``).
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from peft import PeftModel

from conftest import greedy_ids
from family_models import family_dir, family_params, load_family_model, load_family_tokenizer
from preft.cli import main as cli_main
from preft.eval.harness.server_process import start_server, stop_server
from test_engine_families import all_token_copy

NEW_TOKENS = 8
PROMPTS = ["add 12 35 =", "reverse 3 1 4 =", "the quiet"]
CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "configs"


def trained(recipe: str, path: str, out) -> str:
    """``preft train`` (a few steps of the shipped recipe) and ``preft export``: the bundle."""
    assert cli_main(["train", str(CONFIGS / recipe), f"model={path}", f"output_dir={out}", "trainer.max_steps=3",
                     "trainer.save_steps=3", "trainer.report_to=none", "data.train_examples=24",
                     "data.eval_examples=8", "trainer.per_device_train_batch_size=8", "trainer.learning_rate=0.05",
                     "trainer.per_device_eval_batch_size=8"]) == 0
    assert cli_main(["export", str(out / "adapter"), "--base", path, "-o", str(out) + ".bundle"]) == 0
    return str(out) + ".bundle"


@pytest.mark.slow
@pytest.mark.parametrize("family", family_params(in_make_test=()))
def test_preft_serve_answers_a_family_checkpoint_token_exact(tmp_path, family):
    path = family_dir(family)
    tokenizer = load_family_tokenizer(path)
    bundles = {"lora": trained("sft_lora_p.yaml", path, tmp_path / "lora"),
               "reft": trained("sft_reft_p.yaml", path, tmp_path / "reft")}
    all_token_copy(tmp_path / "lora" / "adapter", tmp_path / "lora_all_token")
    assert cli_main(["export", str(tmp_path / "lora_all_token"), "--base", path, "-o",
                     str(tmp_path / "lora_all_token.bundle")]) == 0
    bundles["lora_all_token"] = str(tmp_path / "lora_all_token.bundle")
    models = {None: load_family_model(path)}
    for name, adapter in (("lora", tmp_path / "lora" / "adapter"), ("reft", tmp_path / "reft" / "adapter"),
                          ("lora_all_token", tmp_path / "lora_all_token")):
        models[name] = PeftModel.from_pretrained(load_family_model(path), adapter).eval()

    args = ["--model", path, "--dtype", "float32"]
    for name, bundle in bundles.items():
        args += ["--adapter", f"{name}={bundle}"]
    proc, url, _ = start_server(args, tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        served = client.models.list().data[0].id  # the base model's name: the directory
        answers, references = {}, {}
        for name in models:
            for prompt in PROMPTS:
                response = client.completions.create(
                    model=name or served, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0,
                    extra_body={"min_tokens": NEW_TOKENS, "return_token_ids": True})
                choice = response.choices[0]
                assert choice.model_extra["prompt_token_ids"] == tokenizer(prompt)["input_ids"]
                answers[name, prompt] = choice.model_extra["token_ids"]
                references[name, prompt] = greedy_ids(models[name], tokenizer(prompt)["input_ids"], NEW_TOKENS)
            messages = [{"role": "user", "content": PROMPTS[0]}]
            response = client.chat.completions.create(
                model=name or served, messages=messages, max_tokens=NEW_TOKENS, temperature=0.0,
                extra_body={"min_tokens": NEW_TOKENS, "return_token_ids": True})
            templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            templated = list(templated if isinstance(templated, list) else templated["input_ids"])
            assert response.model_extra["prompt_token_ids"] == templated  # the template of tokenizer_config.json
            answers[name, "chat"] = response.choices[0].model_extra["token_ids"]
            references[name, "chat"] = greedy_ids(models[name], templated, NEW_TOKENS)
    finally:
        stop_server(proc)
    wrong = [key for key in answers if answers[key] != references[key]]
    assert not wrong, wrong
    # the adapters were trained enough to matter, and all-token is another answer (the control)
    assert any(references["lora", k] != references[None, k] for k in [*PROMPTS, "chat"])
    assert any(references["reft", k] != references[None, k] for k in [*PROMPTS, "chat"])
    assert any(references["lora", k] != references["lora_all_token", k] for k in [*PROMPTS, "chat"])
    if family in ("qwen2", "qwen3"):  # Qwen2's tokenizer, not the project's
        assert len(tokenizer("12", add_special_tokens=False)["input_ids"]) == 2
