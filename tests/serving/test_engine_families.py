"""LoRA-P and ReFT-P in the real vLLM engine on every model family, token for token equal to HF
(float32, from the families' bfloat16 checkpoint layouts: :mod:`family_models`).

Per family one engine (a tight token budget, so prompts prefill in chunks; KV blocks too few for
the batch, so requests are preempted and recomputed) serves, in one batch, a LoRA-P adapter on
every linear module (Phi-3's packed ``qkv_proj`` / ``gate_up_proj`` included), a ReFT-P adapter
(LoReFT or DiReFT, alternating by family), the *same* LoRA exported all-token (the control: it
must answer otherwise, and equal HF's all-token LoRA) and the bare base model. Then the
longest prompt once more per adapter, one request at a time: its first KV block (128 tokens on
CPU) comes from the prefix cache, and the answers still equal HF's. OLMo 2 runs through vLLM's
Transformers backend, the others through vLLM's own model classes. ``make test`` runs Llama and
Phi-3 (:data:`family_models.IN_MAKE_TEST`), ``make test-families`` the other six.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import PeftModel, get_peft_model

import preft
from conftest import greedy_ids, strengthen_reft
from engine_pool import shared_pool
from family_models import FAMILY_NAMES, family_dir, family_params, load_family_model, load_family_tokenizer
from preft.data import pretraining_corpus
from preft.export import export_adapter
from reference.independent import greedy_each

NEW_TOKENS = 24
SHORT_PROMPTS = ["add 12 35 =", "reverse 3 1 4 1 5 9 2 6 = and some words past the sliding window"]
#: chunked prefill (16 tokens a step), 4 requests at once, 5 KV blocks: the four 110-token
#: requests at once need 8
ENGINE = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_num_batched_tokens": 16,
          "max_num_seqs": 4, "num_gpu_blocks_override": 5, "max_model_len": 256, "disable_log_stats": False}


def all_token_copy(adapter_dir, out):
    """The same LoRA weights as a plain (all-token) PEFT LoRA adapter."""
    shutil.copytree(adapter_dir, out)
    config = json.loads((out / "adapter_config.json").read_text())
    for key in ("prefill_only", "adapter_start"):
        config.pop(key, None)
    config["peft_type"] = "LORA"
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", family_params())
def test_family_serves_lora_p_and_reft_p_token_exact(family, tmp_path):
    path = family_dir(family)
    tokenizer = load_family_tokenizer(path)  # the tokenizer vLLM loads from the directory
    corpus = tokenizer(" ".join(pretraining_corpus(40, seed=5)))["input_ids"]
    # 110 tokens: the answer crosses into a second KV block while decoding (where preemption
    # strikes); 150: the prompt fills a whole block (what the prefix cache can hand out)
    long_ids = corpus[:150]
    prompts = [tokenizer(p)["input_ids"] for p in SHORT_PROMPTS] + [corpus[:110], long_ids]

    torch.manual_seed(11)
    lora = get_peft_model(load_family_model(path), preft.PreftLoraConfig(
        r=8, lora_alpha=32, target_modules="all-linear", init_lora_weights=False))
    lora.save_pretrained(tmp_path / "lora_p")
    all_token_copy(tmp_path / "lora_p", tmp_path / "lora_all_token")
    torch.manual_seed(12)
    intervention = ("loreft", "direft")[FAMILY_NAMES.index(family) % 2]
    reft = strengthen_reft(get_peft_model(load_family_model(path), preft.PreftReftConfig(
        rank=4, layers=[0, 2, 3], intervention=intervention, init_weights=False)))
    reft.save_pretrained(tmp_path / "reft_p")
    bundles, models = {}, {None: load_family_model(path)}
    for name in ("lora_p", "lora_all_token", "reft_p"):
        manifest = export_adapter(tmp_path / name, path, tmp_path / f"{name}.bundle")
        assert manifest["base"]["model_type"] == family
        bundles[name] = str(tmp_path / f"{name}.bundle")
        models[name] = PeftModel.from_pretrained(load_family_model(path), tmp_path / name).eval()
    reference = {(name, i): greedy_ids(model, ids, NEW_TOKENS)
                 for name, model in models.items() for i, ids in enumerate(prompts)}
    # the control has teeth: on every prompt the all-token LoRA answers otherwise than LoRA-P
    assert all(reference["lora_p", i] != reference["lora_all_token", i] for i in range(len(prompts)))
    assert any(reference["reft_p", i] != reference[None, i] for i in range(len(prompts)))
    # the HF reference is the rule's on this family too: it equals the independent one (tests/reference)
    cases = [(name, ids) for name in ("lora_p", "reft_p") for ids in prompts]
    plain = load_family_model(path)
    eos = plain.generation_config.eos_token_id  # what generate(min_new_tokens=...) never picks
    never = tuple(eos) if isinstance(eos, list) else (eos,) if eos is not None else ()
    independent = greedy_each(plain, {n: tmp_path / n for n in ("lora_p", "reft_p")}, cases, NEW_TOKENS, never=never)
    assert independent == [reference[name, i] for name in ("lora_p", "reft_p") for i in range(len(prompts))], family

    pool = shared_pool()

    def request(name, ids):
        entry = {"prompt_token_ids": ids}
        if name == "reft_p":
            entry["reft"] = bundles[name]
        elif name:
            entry["lora"] = [name, pool.lora_id(bundles[name]), bundles[name]]
        return entry

    engine = pool.get(path, ENGINE)
    before = engine.metrics()
    batch = [(name, i) for i in range(len(prompts)) for name in models]
    tokens = engine.generate([request(name, prompts[i]) for name, i in batch], NEW_TOKENS)["tokens"]
    moved = {key: value - before[key] for key, value in engine.metrics().items()}
    assert moved["preemptions"] > 0, "5 KV blocks for four requests needing 2 each: the engine should preempt"
    wrong = [(name, i) for (name, i), got in zip(batch, tokens) if got != reference[name, i]]
    assert not wrong, f"{family}: {wrong} differ from HF"

    # the long prompt again, one request at a time: each adapter's second request reuses its first's block
    again = [name for name in models for _ in range(2)]
    before = engine.metrics()
    tokens = engine.generate([request(name, long_ids) for name in again], NEW_TOKENS, sequential=True)["tokens"]
    hits = engine.metrics()["prefix_hits"] - before["prefix_hits"]
    assert hits >= len(models) * 128, f"{family}: {hits} prefix-hit tokens"
    assert [got == reference[name, len(prompts) - 1] for name, got in zip(again, tokens)] == [True] * len(again)
