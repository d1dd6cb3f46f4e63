"""The HF PreFT model against the independent reference (``tests/reference/independent.py``:
plain forward hooks written from the formulas, nothing imported from ``preft``): greedy tokens
equal in float32 for LoRA-P (prefill-only and all-token), plain PEFT LoRA, LoReFT-P and DiReFT-P,
with ``adapter_start`` above 0, prompt ends before the prompt's last token, one row at a time
and in a left-padded batch of uneven rows."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

import preft
from conftest import load_base, strengthen_reft
from reference.independent import Adapter, active_positions, greedy

NEW_TOKENS = 6
PROMPTS = ["add 12 35 =", "reverse 3 1 4 1 5 9 2 6 =", "the", "a=7 b=2 ; b =", "sort 8 2 1 9 4 4 ="]
LORA_MODULES = ["q_proj", "v_proj", "down_proj", "gate_proj"]
CONFIGS = {
    "lora_p": lambda: preft.PreftLoraConfig(r=4, lora_alpha=32, target_modules=LORA_MODULES, init_lora_weights=False),
    "lora_p_start3": lambda: preft.PreftLoraConfig(r=4, lora_alpha=32, target_modules=LORA_MODULES,
                                                   init_lora_weights=False, adapter_start=3),
    "lora_p_all_tokens": lambda: preft.PreftLoraConfig(r=4, lora_alpha=32, target_modules=LORA_MODULES,
                                                       init_lora_weights=False, prefill_only=False),
    "peft_lora": lambda: LoraConfig(r=4, lora_alpha=32, target_modules=LORA_MODULES, init_lora_weights=False),
    "loreft_p_start1": lambda: preft.PreftReftConfig(rank=4, layers=[0, 2, 3], intervention="loreft",
                                                     init_weights=False, adapter_start=1),
    "direft_p": lambda: preft.PreftReftConfig(rank=4, layers=[1, 3], intervention="direft", init_weights=False),
}


def test_the_reference_rule_by_hand():
    assert active_positions(6, 4, 1, True).tolist() == [False, True, True, True, False, False]
    assert active_positions(3, 4, 0, True).tolist() == [True, True, True]
    assert active_positions(5, 2, 0, False).tolist() == [True] * 5


@pytest.fixture(scope="module")
def saved(tmp_path_factory, base_path):
    root = tmp_path_factory.mktemp("independent")
    for seed, (name, make) in enumerate(CONFIGS.items()):
        torch.manual_seed(500 + seed)
        model = get_peft_model(load_base(base_path), make())
        if name.startswith(("loreft", "direft")):
            model = strengthen_reft(model)
        model.save_pretrained(root / name)
    return root


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_preft_model_equals_the_independent_reference(saved, base_path, tokenizer, name):
    hf = PeftModel.from_pretrained(load_base(base_path), saved / name).eval()
    plain = load_base(base_path)
    adapter = Adapter(plain, saved / name)
    never = (tokenizer.eos_token_id,)
    base_tokens, adapted = {}, []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        want = greedy(plain, adapter, ids, NEW_TOKENS, never=never)
        batch = tokenizer([prompt], return_tensors="pt")
        with torch.no_grad():
            out = hf.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert out[0, len(ids):].tolist() == want, (name, prompt)
        adapter.remove()
        base_tokens[prompt] = greedy(plain, None, ids, NEW_TOKENS, never=never)
        adapter = Adapter(plain, saved / name)
        adapted.append(want != base_tokens[prompt])
    assert any(adapted), f"{name} changes no prompt's tokens: the comparison would show nothing"
    # a left-padded batch of uneven rows gives each row its own tokens
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = hf.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    for row, prompt in enumerate(PROMPTS):
        assert out[row, batch["input_ids"].shape[1]:].tolist() == greedy(
            plain, adapter, tokenizer(prompt)["input_ids"], NEW_TOKENS, never=never), (name, "batched", prompt)


def test_a_shifted_rule_is_caught(saved, base_path, tokenizer):
    """The comparison has teeth: the reference with the adapter one position past the prompt
    (``p <= P``, the rule's most likely slip) disagrees with it for some prompt."""
    plain = load_base(base_path)
    adapter = Adapter(plain, saved / "lora_p")
    never = (tokenizer.eos_token_id,)
    differs = False
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        right = greedy(plain, adapter, ids, NEW_TOKENS, never=never)
        shifted = greedy(plain, adapter, ids, NEW_TOKENS, prompt_length=len(ids) + 1, never=never)
        differs |= right != shifted
    assert differs
