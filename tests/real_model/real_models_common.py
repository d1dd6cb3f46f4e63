"""What the real-model tests share: the prepared models, their prompts, adapters and references."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import preft
from conftest import strengthen_reft
from preft.constants import ALL_PROJECTIONS
from preft.export import export_adapter
from preft.families import model_load_kwargs

QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.",
             "How many legs does a spider have?", "Write one sentence about the sea."]
#: a system message long enough that the prompts it opens fill a 128-token KV block (prefix hits)
LONG_SYSTEM = ("You are a careful assistant for a shipping company. Answer in one short sentence, name the unit of "
               "every number you give, never invent a fact, say so when you do not know, and keep a friendly tone "
               "with every customer, whether they write about parcels, letters, pallets, prices, delivery times, "
               "customs forms, lost items or the weather at the port. ") * 2


def prepared(name: str) -> str:
    """The model's prepared directory (prepared now if it is not: ``preft models get``)."""
    from preft import real_models

    try:
        return str(real_models.get(name, progress=lambda line: None))
    except real_models.ModelError as err:
        pytest.fail(f"{name} could not be prepared: {err}")


def load(model_dir: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **model_load_kwargs(model_dir)).eval()


def prompt_ids(tokenizer, question: str, system: str | None = None) -> list[int]:
    """The prompt a chat request sends (the chat template with its generation prompt), or the plain
    question for a model without a template."""
    if tokenizer.chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(ids["input_ids"])
    return tokenizer((system + " " if system else "") + question)["input_ids"]


ADAPTERS = {
    "lora_p": lambda layers: preft.PreftLoraConfig(r=8, lora_alpha=16, target_modules=list(ALL_PROJECTIONS),
                                                   init_lora_weights=False),
    "lora_p_start": lambda layers: preft.PreftLoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj",
                                                                                             "down_proj"],
                                                         init_lora_weights=False, adapter_start=3),
    "loreft_p": lambda layers: preft.PreftReftConfig(rank=4, layers=[1, layers // 2], intervention="loreft",
                                                     init_weights=False),
    "all_token": lambda layers: LoraConfig(r=8, lora_alpha=16, target_modules=list(ALL_PROJECTIONS),
                                           init_lora_weights=False),
}
KIND = {"lora_p": "lora", "lora_p_start": "lora", "loreft_p": "reft", "all_token": "lora"}


def make_adapters(model_dir: str, root) -> tuple[dict, dict]:
    """``(bundles, models)``: each of :data:`ADAPTERS` saved, exported and loaded as HF's PEFT
    model (random weights, seeded; ReFT's source scaled up so the edit shows in greedy tokens)."""
    layers = AutoModelForCausalLM.from_pretrained(model_dir).config.num_hidden_layers
    bundles, models = {}, {None: load(model_dir)}
    for seed, (name, make_config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(300 + seed)
        model = strengthen_reft(get_peft_model(load(model_dir), make_config(layers)))
        model.save_pretrained(root / name)
        export_adapter(root / name, model_dir, root / f"{name}.bundle")
        bundles[name] = str(root / f"{name}.bundle")
        models[name] = PeftModel.from_pretrained(load(model_dir), root / name).eval()
    return bundles, models


def tokenizer_of(model_dir: str):
    return AutoTokenizer.from_pretrained(model_dir)
