"""The embedded default base model: shipped files, HF loading, and vLLM loading with parity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from conftest import PROMPTS, hf_greedy, load_base


def test_default_model_is_shipped_small_and_documented(base_path):
    files = {p.name: p.stat().st_size for p in Path(base_path).iterdir()}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "training_summary.json"):
        assert name in files, name
    assert sum(files.values()) < 20 * 2**20
    config = AutoConfig.from_pretrained(base_path)
    assert config.model_type == "llama"
    summary = json.loads((Path(base_path) / "training_summary.json").read_text())
    assert summary["steps"] > 0 and summary["final_eval_loss"] < summary["history"][0]["eval_loss"]


@torch.no_grad()
def test_default_model_learned_the_corpus(base_path, tokenizer):
    """Not a random network: it completes easy corpus patterns."""
    model = load_base(base_path)
    prompts = ["copy 1 2 3 =", "a=4 b=8 ; b =", "reverse 5 6 7 =", "sort 3 1 2 ="]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=8, do_sample=False)
    answers = [a.strip() for a in tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)]
    assert answers == ["1 2 3", "8", "7 6 5", "1 2 3"]  # every one (its arithmetic is not learned: add 2 3 = 8)


@pytest.mark.slow
@torch.no_grad()
def test_default_model_in_vllm_matches_hf(base_path, tokenizer):
    from preft.eval.harness.engine_driver import EngineProcess

    new_tokens = 8
    with EngineProcess(base_path) as engine:
        from_vllm = engine.generate([{"prompt": prompt} for prompt in PROMPTS], new_tokens)["tokens"]

    model = load_base(base_path)
    for prompt, tokens in zip(PROMPTS, from_vllm):
        assert hf_greedy(model, tokenizer, prompt, new_tokens) == tokens, prompt
