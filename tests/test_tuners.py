"""PEFT integration of the PreFT tuners: adapter_start, save/load, gradient checkpointing,
merging, the all-token mode and config validation."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model

import preft
from conftest import ADAPTER_CONFIGS, load_base


@torch.no_grad()
def test_positions_before_adapter_start_are_base_model(make_peft_model, tokenizer, adapter_kind):
    start = 4
    model = make_peft_model(ADAPTER_CONFIGS[adapter_kind](adapter_start=start))
    batch = tokenizer(["reverse 3 1 4 1 5 9 2 6 ="], return_tensors="pt")
    adapted = model(**batch, output_hidden_states=True)
    with model.disable_adapter():
        base = model(**batch, output_hidden_states=True)
    for layer, (a, b) in enumerate(zip(adapted.hidden_states, base.hidden_states)):
        assert torch.equal(a[:, :start], b[:, :start]), f"hidden state {layer} differs before start"
    assert torch.equal(adapted.logits[:, :start], base.logits[:, :start])
    assert not torch.allclose(adapted.logits[:, start:], base.logits[:, start:])


@torch.no_grad()
def test_save_load_round_trip(make_peft_model, tokenizer, base_path, tmp_path, adapter_kind):
    config = ADAPTER_CONFIGS[adapter_kind](adapter_start=1)
    model = make_peft_model(config)
    batch = tokenizer(["add 12 35 =", "the quiet"], return_tensors="pt", padding=True)
    expected = model.generate(**batch, max_new_tokens=6, do_sample=False)
    model.save_pretrained(tmp_path)

    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["peft_type"] == config.peft_type and saved["adapter_start"] == 1
    loaded_config = PeftConfig.from_pretrained(tmp_path)
    assert type(loaded_config) is type(config)

    loaded = PeftModel.from_pretrained(load_base(base_path), tmp_path).eval()
    assert torch.equal(loaded.generate(**batch, max_new_tokens=6, do_sample=False), expected)
    assert torch.equal(loaded(**batch).logits, model(**batch).logits)


def _adapter_grads(model, batches):
    model.train()
    for batch in batches:
        model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_gradient_checkpointing_gives_same_gradients(make_peft_model, tokenizer, adapter_kind):
    texts = ["add 12 35 = 47", "reverse 1 2 3 = 3 2 1", "the old cat sees a dog today ."]
    batch = dict(tokenizer(texts, return_tensors="pt", padding=True))
    width = batch["input_ids"].shape[1]
    # different prompt lengths per row; padding and prompt masked out of the labels
    prompt_end = (width - batch["attention_mask"].sum(-1)) + torch.tensor([5, 6, 4])
    batch["labels"] = batch["input_ids"].masked_fill(torch.arange(width) < prompt_end[:, None], -100)
    # a second batch whose forward runs between the first forward and its backward
    other = dict(batch, labels=batch["input_ids"].masked_fill(torch.arange(width) < width - 1, -100))

    model = make_peft_model(ADAPTER_CONFIGS[adapter_kind]())
    for p in model.parameters():  # dropout-free, so the two runs are comparable
        p.grad = None
    checkpointed = copy.deepcopy(model)
    reference = _adapter_grads(model, [batch])

    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed.train()
    loss = checkpointed(**batch).loss
    checkpointed(**other)  # overwrites the "current" context; the recompute must not see it
    loss.backward()
    grads = {n: p.grad for n, p in checkpointed.named_parameters() if p.requires_grad}
    assert reference.keys() == grads.keys() and reference
    for name, grad in reference.items():
        assert torch.allclose(grads[name], grad, atol=1e-6, rtol=1e-5), name


def test_merge_is_refused_for_prefill_only(make_peft_model, adapter_kind):
    model = make_peft_model(ADAPTER_CONFIGS[adapter_kind]())
    with pytest.raises(ValueError, match="merge"):
        model.merge_and_unload()
    with pytest.raises(ValueError, match="merge"):
        model.merge_adapter()
    base = model.unload()  # dropping the adapter is fine
    assert not any("lora_" in n or "reft_" in n for n, _ in base.named_parameters())


@torch.no_grad()
def test_all_token_mode_equals_plain_peft_lora(base_path, tokenizer):
    batch = tokenizer(["add 12 35 =", "the quiet"], return_tensors="pt", padding=True)
    kwargs = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    plain = get_peft_model(load_base(base_path), LoraConfig(**kwargs)).eval()
    torch.manual_seed(0)
    all_token = get_peft_model(load_base(base_path), preft.PreftLoraConfig(prefill_only=False, **kwargs)).eval()
    all_token.load_state_dict(plain.state_dict())
    gen = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(all_token.generate(**batch, **gen), plain.generate(**batch, **gen))
    merged = all_token.merge_and_unload()  # all-token adapters merge like LoRA
    assert torch.allclose(merged(**batch).logits, plain(**batch).logits, atol=1e-5)


@torch.no_grad()
def test_decode_steps_skip_the_adapter(make_peft_model, tokenizer):
    model = make_peft_model(ADAPTER_CONFIGS["lora_p"]())
    active_tokens = []
    tracker = model.base_model.prefill_tracker
    hook = model.get_base_model().register_forward_hook(
        lambda *_: active_tokens.append(int(tracker.current.active_mask(0).sum()))
    )
    batch = tokenizer(["add 12 35 ="], return_tensors="pt")
    model.generate(**batch, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    hook.remove()
    assert active_tokens == [batch["input_ids"].shape[1], 0, 0, 0, 0]


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: preft.PreftLoraConfig(r=0), "r"),
        (lambda: preft.PreftLoraConfig(r=-4), "r"),
        (lambda: preft.PreftLoraConfig(adapter_start=-1), "adapter_start"),
        (lambda: preft.PreftLoraConfig(peft_type="LORA"), "peft_type"),
        (lambda: preft.PreftLoraConfig(use_dora=True), "use_dora"),
        (lambda: preft.PreftReftConfig(rank=0), "rank"),
        (lambda: preft.PreftReftConfig(adapter_start=-2), "adapter_start"),
        (lambda: preft.PreftReftConfig(layers=[-1]), "layers"),
        (lambda: preft.PreftReftConfig(intervention="noreft"), "intervention"),
        (lambda: preft.PreftReftConfig(peft_type="PREFT_LORA"), "peft_type"),
    ],
)
def test_bad_config_names_the_field(build, field):
    with pytest.raises(ValueError, match=rf"\.{field}\b"):
        build()


def test_reft_layers_out_of_range(base_path):
    with pytest.raises(ValueError, match=r"layers \[7\] out of range.*4 decoder layers"):
        get_peft_model(load_base(base_path), preft.PreftReftConfig(layers=[1, 7]))


def test_lora_on_unsupported_module_type_is_refused(base_path):
    with pytest.raises(ValueError, match="torch.nn.Linear target modules only"):
        get_peft_model(load_base(base_path), preft.PreftLoraConfig(target_modules=["embed_tokens"]))


@torch.no_grad()
def test_any_local_qwen2_directory_works(tmp_path, tokenizer):
    """The tuners are not tied to the default model: a local Qwen2 directory works the same."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from test_prefill_generation import greedy, manual_greedy

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    batch = tokenizer(["add 1 2 =", "reverse 4 5 6 7 ="], return_tensors="pt", padding=True)
    for peft_config in (preft.PreftLoraConfig(r=4, init_lora_weights=False),
                        preft.PreftReftConfig(rank=2, layers=[1], init_weights=False)):
        torch.manual_seed(0)
        model = get_peft_model(load_base(str(tmp_path)), peft_config).eval()
        width = batch["input_ids"].shape[1]
        assert torch.equal(greedy(model, batch, 6)[:, width:], manual_greedy(model, batch, 6))
