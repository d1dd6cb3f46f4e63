"""PEFT's mixed-adapter batches (``adapter_names=``, one adapter per row) for every PreFT kind:
token-exact in float32 with each row generated alone, prefill chunks of uneven prompt lengths,
and one clear error for bad names."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from conftest import ADAPTER_CONFIGS, PROMPTS, hf_greedy, load_base, strengthen_reft

NAMES = ["a", "b", "__base__", "c"]  # one per PROMPTS row
NEW_TOKENS = 8


def three_adapters(base_path, kind: str):
    torch.manual_seed(0)
    model = get_peft_model(load_base(base_path), ADAPTER_CONFIGS[kind](), adapter_name="a")
    for seed, name in ((1, "b"), (2, "c")):
        torch.manual_seed(seed)
        model.add_adapter(name, ADAPTER_CONFIGS[kind]())
    with torch.no_grad():  # DiReFT's W2 starts small too: scaled so that every kind changes greedy tokens
        for key, param in model.named_parameters():
            if "reft_proj" in key:
                param.mul_(4.0)
    return strengthen_reft(model).eval()


def alone(model, tokenizer, prompt: str, name: str) -> list[int]:
    if name == "__base__":
        with model.disable_adapter():
            return hf_greedy(model, tokenizer, prompt, NEW_TOKENS)
    model.set_adapter(name)
    return hf_greedy(model, tokenizer, prompt, NEW_TOKENS)


@torch.no_grad()
def test_generate_with_adapter_names_equals_each_row_alone(base_path, tokenizer, prompt_batch, adapter_kind):
    model = three_adapters(base_path, adapter_kind)
    out = model.generate(**prompt_batch, adapter_names=NAMES, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False)
    mixed = out[:, prompt_batch["input_ids"].shape[1]:].tolist()
    expected = [alone(model, tokenizer, prompt, name) for prompt, name in zip(PROMPTS, NAMES)]
    assert mixed == expected
    # the control: the adapters change the tokens, so equality above is not the base model's
    with model.disable_adapter():
        base = [hf_greedy(model, tokenizer, prompt, NEW_TOKENS) for prompt in PROMPTS]
    assert sum(m != b for m, b in zip(mixed, base)) >= 2


@torch.no_grad()
def test_chunked_prefill_with_uneven_prompt_lengths_matches_one_forward(base_path, prompt_batch, adapter_kind):
    """Teacher forcing in two chunks with per-row prompt lengths (some rows past their prompt,
    where their adapter is off) gives the logits of one forward, row by row and per adapter."""
    model = three_adapters(base_path, adapter_kind)
    ids, mask = prompt_batch["input_ids"], prompt_batch["attention_mask"]
    lengths = mask.sum(1)
    prompt_lengths = torch.clamp(lengths - torch.tensor([0, 3, 1, 2]), min=1)  # P before each row's end
    whole = model(input_ids=ids, attention_mask=mask, prompt_lengths=prompt_lengths, adapter_names=NAMES).logits
    split = ids.shape[1] // 2 + 1
    first = model(input_ids=ids[:, :split], attention_mask=mask[:, :split], prompt_lengths=prompt_lengths,
                  adapter_names=NAMES, use_cache=True)
    second = model(input_ids=ids[:, split:], attention_mask=mask, prompt_lengths=prompt_lengths, adapter_names=NAMES,
                   past_key_values=first.past_key_values, use_cache=True)
    chunked = torch.cat([first.logits, second.logits], dim=1)
    real = mask.bool()
    torch.testing.assert_close(chunked[real], whole[real], atol=1e-4, rtol=1e-4)
    for row, name in enumerate(NAMES):  # each row as it would be alone
        if name == "__base__":
            with model.disable_adapter():
                single = model(input_ids=ids[row:row + 1][:, real[row]], prompt_lengths=[int(prompt_lengths[row])])
        else:
            model.set_adapter(name)
            single = model(input_ids=ids[row:row + 1][:, real[row]], prompt_lengths=[int(prompt_lengths[row])])
        torch.testing.assert_close(whole[row][real[row]], single.logits[0], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_all_token_lora_mixed_batch_equals_peft_lora(base_path, prompt_batch):
    """With prefill_only=False a PreFT LoRA mixed batch is PEFT's own (the all-token baseline)."""
    import preft

    models = []
    for config in (LoraConfig, lambda **kw: preft.PreftLoraConfig(prefill_only=False, **kw)):
        torch.manual_seed(0)
        model = get_peft_model(load_base(base_path), config(r=4, target_modules=["q_proj", "v_proj"],
                                                             init_lora_weights=False), adapter_name="a")
        torch.manual_seed(1)
        model.add_adapter("b", config(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        models.append(model.eval())
    names = ["a", "b", "__base__", "b"]
    peft_out, preft_out = (m.generate(**prompt_batch, adapter_names=names, max_new_tokens=NEW_TOKENS,
                                      min_new_tokens=NEW_TOKENS, do_sample=False) for m in models)
    assert peft_out.tolist() == preft_out.tolist()


def test_bad_adapter_names_are_one_clear_error(base_path, prompt_batch, adapter_kind):
    model = three_adapters(base_path, adapter_kind)
    with pytest.raises(ValueError, match="non-existing adapter.*zed"):
        model.generate(**prompt_batch, adapter_names=["a", "zed", "b", "c"], max_new_tokens=2)
    with pytest.raises(ValueError, match="adapter_names"):
        model.generate(**prompt_batch, adapter_names=["a", "b"], max_new_tokens=2)
    model.train()
    with pytest.raises(ValueError, match="training mode"):
        model(**prompt_batch, adapter_names=NAMES)
