"""Every model family PreFT supports (:mod:`preft.families`): HF generation keeps the rule,
gradient checkpointing keeps the mask, the SFT recipe trains LoRA-P and ReFT-P on the family's
checkpoint directory, and export checks the family's modules and records it.

The models are :func:`preft.families.tiny_model` saved as hub checkpoints are laid out
(:mod:`family_models`: bfloat16 shards with an index, the chat template in
``tokenizer_config.json``, the tokenizer class following ``model_type``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

import preft
from conftest import strengthen_reft
from family_models import FAMILY_NAMES, family_dir, load_family_model, load_family_tokenizer
from preft.bundle import BundleError
from preft.export import export_adapter
from preft.cli import main as cli_main
from test_prefill_generation import manual_greedy

PROMPTS = ["add 12 35 =", "reverse 3 1 4 1 5 9 2 6 = and some words past the sliding window of sixteen", "the quiet"]
NEW_TOKENS = 6
CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "configs"
ADAPTERS = {
    "lora_p": lambda: preft.PreftLoraConfig(r=8, lora_alpha=32, target_modules="all-linear", init_lora_weights=False),
    "loreft_p": lambda: preft.PreftReftConfig(rank=4, layers=[0, 2], intervention="loreft", init_weights=False),
    "direft_p": lambda: preft.PreftReftConfig(rank=4, layers=[1, 3], intervention="direft", init_weights=False),
}


def adapted(path, kind, seed=0):
    base = load_family_model(path)
    torch.manual_seed(seed)
    return strengthen_reft(get_peft_model(base, ADAPTERS[kind]())).eval()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_checkpoint_layout_and_tokenizer_follow_the_family(family):
    """The tiny checkpoints look like hub ones; a Qwen2 or Qwen3 directory loads Qwen2's tokenizer,
    which splits "12" into two digits where the project's own keeps it whole."""
    path = family_dir(family)
    config = json.loads(open(f"{path}/config.json").read())
    assert config["model_type"] == family and config["dtype"] == "bfloat16"
    tokenizer = load_family_tokenizer(path)
    assert tokenizer.chat_template and "{%" in tokenizer.chat_template
    digits = len(tokenizer("12", add_special_tokens=False)["input_ids"])
    assert digits == (2 if family in ("qwen2", "qwen3") else 1), type(tokenizer).__name__


@torch.no_grad()
@pytest.mark.parametrize("kind", sorted(ADAPTERS))
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_generate_keeps_the_rule_on_every_family(family, kind):
    """HF generate == prefill with the adapter, then decode without it; the adapter matters, and
    the all-token baseline (adapter on generated tokens too) answers otherwise."""
    path = family_dir(family)
    tokenizer = load_family_tokenizer(path)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    width = batch["input_ids"].shape[1]
    model = adapted(path, kind)
    out = model.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)[:, width:]
    assert torch.equal(out, manual_greedy(model, batch, NEW_TOKENS))
    with model.disable_adapter():
        base = model.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    assert not torch.equal(out, base[:, width:])
    if kind == "lora_p":
        torch.manual_seed(0)
        config = LoraConfig(r=8, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
        every_token = get_peft_model(load_family_model(path), config).eval()
        assert every_token.state_dict().keys() == model.state_dict().keys()
        every_token.load_state_dict(model.state_dict())
        all_token = every_token.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                         do_sample=False)[:, width:]
        assert not torch.equal(all_token, out)


@pytest.mark.parametrize("kind", ["lora_p", "loreft_p"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_gradient_checkpointing_keeps_the_mask_on_every_family(family, kind):
    path = family_dir(family)
    tokenizer = load_family_tokenizer(path)
    batch = dict(tokenizer(["add 12 35 = 47", "reverse 1 2 3 = 3 2 1"], return_tensors="pt", padding=True))
    width = batch["input_ids"].shape[1]
    prompt_end = (width - batch["attention_mask"].sum(-1)) + torch.tensor([5, 6])
    batch["labels"] = batch["input_ids"].masked_fill(torch.arange(width) < prompt_end[:, None], -100)
    model = adapted(path, kind)
    checkpointed = copy.deepcopy(model)
    grads = []
    for candidate, checkpointing in ((model, False), (checkpointed, True)):
        if checkpointing:
            candidate.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        candidate.train()
        candidate(**batch).loss.backward()
        grads.append({n: p.grad for n, p in candidate.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        assert torch.allclose(grads[1][name], grad, atol=1e-6, rtol=1e-5), name


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_preft_train_and_export_lora_p_and_reft_p(family, tmp_path):
    """``preft train`` (the shipped SFT recipes, defaults but for size) on the family's directory:
    LoRA-P on every linear module (``all-linear``, whatever the family names them) and LoReFT-P;
    then ``preft export``: the bundle records the family and the rule."""
    path = family_dir(family)
    for kind, recipe in (("lora", "sft_lora_p.yaml"), ("reft", "sft_reft_p.yaml")):
        out = tmp_path / kind
        assert cli_main(["train", str(CONFIGS / recipe), f"model={path}", f"output_dir={out}", "trainer.max_steps=2",
                         "trainer.save_steps=2", "trainer.report_to=none", "data.train_examples=16",
                         "data.eval_examples=8", "trainer.per_device_train_batch_size=4",
                         "trainer.per_device_eval_batch_size=8"]) == 0
        summary = json.loads((out / "run_summary.json").read_text())
        assert summary["steps"] == 2 and summary["final_eval_loss"] != summary["initial_eval_loss"]
        assert cli_main(["export", str(out / "adapter"), "--base", path, "-o", str(tmp_path / f"{kind}.bundle")]) == 0
        manifest = json.loads((tmp_path / f"{kind}.bundle" / "preft_manifest.json").read_text())
        assert manifest["kind"] == kind and manifest["base"]["model_type"] == family
        assert manifest["prefill_only"] is True


def test_trainers_load_gemma2_with_the_attention_vllm_serves(tmp_path):
    """transformers' SDPA path drops Gemma 2's attention soft-capping (vLLM applies it): a model
    given by path trains with eager attention, unless the user says otherwise (SDPA, which a CPU
    step computes as ``preft_cpu_sdpa``)."""
    from datasets import Dataset
    from trl import SFTConfig

    from preft.trainers import PreftSFTTrainer, cpu_step

    data = Dataset.from_list(preft.data.user_examples(0, 8))
    for init_kwargs, expected in ((None, "eager"), ({"attn_implementation": "sdpa"}, cpu_step.CPU_SDPA)):
        args = SFTConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, max_steps=1,
                         model_init_kwargs=init_kwargs)
        trainer = PreftSFTTrainer(model=family_dir("gemma2"), args=args, train_dataset=data,
                                  peft_config=ADAPTERS["lora_p"]())
        assert trainer.model.config._attn_implementation == expected


def test_export_checks_the_family_modules(tmp_path):
    """A Llama-named LoRA does not fit Phi-3 (packed ``qkv_proj``): one line naming the module;
    Phi-3's packed LoRA exports against Phi-3; a family PreFT does not serve gets one line."""
    llama_lora = tmp_path / "llama_lora"
    torch.manual_seed(0)
    get_peft_model(load_family_model(family_dir("llama")), ADAPTERS["lora_p"]()).save_pretrained(llama_lora)
    wrong = r"the base has no module model\.layers\.0\.\w+\.(q|k|v|gate|up)_proj \(wrong base model\?\)"
    with pytest.raises(BundleError, match=wrong):
        export_adapter(llama_lora, family_dir("phi3"), tmp_path / "wrong.bundle")
    phi_lora = tmp_path / "phi_lora"
    get_peft_model(load_family_model(family_dir("phi3")), ADAPTERS["lora_p"]()).save_pretrained(phi_lora)
    manifest = export_adapter(phi_lora, family_dir("phi3"), tmp_path / "phi.bundle")
    weights = json.loads((tmp_path / "phi.bundle" / "adapter_config.json").read_text())["target_modules"]
    assert manifest["base"]["model_type"] == "phi3" and any("qkv_proj" in t for t in weights)
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(BundleError, match=r"is a 'gpt2' model; PreFT serves llama, qwen2, qwen3, mistral, "
                                          r"gemma2, gemma3_text, phi3, olmo2$"):
        export_adapter(phi_lora, other, tmp_path / "gpt2.bundle")
