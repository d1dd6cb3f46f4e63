"""The HF PreFT model against the independent reference (``tests/reference/independent.py``:
plain forward hooks written from the formulas, nothing imported from ``preft``): greedy tokens
equal in float32 for LoRA-P (prefill-only and all-token), plain PEFT LoRA, LoReFT-P and DiReFT-P,
with ``adapter_start`` above 0, prompt ends before the prompt's last token, one row at a time,
in a left-padded batch of uneven rows and in a prefill of two chunks; and both the tuner's and
the reference's LoReFT and DiReFT on a case worked by hand."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file

import preft
from conftest import load_base, strengthen_reft
from preft.tuners.reft_p.layer import DiReFT, LoReFT, orthonormal_rows
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


@torch.no_grad()
@pytest.mark.parametrize("name", ["lora_p_start3", "loreft_p_start1", "direft_p"])
def test_chunked_prefill_of_uneven_rows_equals_the_independent_reference(saved, base_path, tokenizer, name):
    """The HF PreFT model fed a left-padded batch of uneven rows in two chunks (the KV of the
    first reused by the second), each row's ``P`` before its last token, has at every real
    position the logits of the independent reference run on that row alone."""
    hf = PeftModel.from_pretrained(load_base(base_path), saved / name).eval()
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    lengths = mask.sum(1)
    prompt_lengths = torch.clamp(lengths - torch.tensor([0, 2, 0, 1, 3]), min=1)
    split = ids.shape[1] // 2
    first = hf(input_ids=ids[:, :split], attention_mask=mask[:, :split], prompt_lengths=prompt_lengths,
               use_cache=True)
    second = hf(input_ids=ids[:, split:], attention_mask=mask, prompt_lengths=prompt_lengths,
                past_key_values=first.past_key_values, use_cache=True)
    chunked = torch.cat([first.logits, second.logits], dim=1)
    plain = load_base(base_path)
    adapter = Adapter(plain, saved / name)
    for row in range(len(PROMPTS)):
        real = mask[row].bool()
        row_ids = ids[row][real]
        adapter.mask = active_positions(len(row_ids), int(prompt_lengths[row]), adapter.adapter_start, True)
        want = plain(input_ids=row_ids[None]).logits[0]
        torch.testing.assert_close(chunked[row][real], want, atol=1e-4, rtol=1e-4, msg=f"{name} row {row}")
    # the control: the same rows without the adapter differ, so equality above is the adapter's
    adapter.remove()
    row_ids = ids[1][mask[1].bool()]
    assert not torch.allclose(chunked[1][mask[1].bool()], plain(input_ids=row_ids[None]).logits[0], atol=1e-3)


def _fake_reft_layer(proj_rows, source_weight, source_bias):
    proj = torch.nn.Linear(len(proj_rows[0]), len(proj_rows), bias=False)
    source = torch.nn.Linear(len(proj_rows[0]), len(proj_rows))
    with torch.no_grad():
        proj.weight.copy_(torch.tensor(proj_rows))
        source.weight.copy_(torch.tensor(source_weight))
        source.bias.copy_(torch.tensor(source_bias))
    return SimpleNamespace(reft_proj={"a": proj}, reft_source={"a": source}), proj, source


@torch.no_grad()
def test_loreft_and_direft_on_a_case_computed_by_hand(tmp_path):
    """pyreft pins transformers 4.45 and so does not install beside this project; the formulas
    are checked on numbers worked by hand instead, in the tuner and in the independent reference.

    ``h = (1, 2)``, saved rows ``(3, 4)``, ``W = (1, 1)``, ``b = 0.5``. QR orthonormalizes the row
    to ``R = -(0.6, 0.8)`` (Householder's sign, the convention adapters are trained and exported
    with). LoReFT: ``R h = -2.2``, ``W h + b = 3.5``, ``h + R^T (3.5 + 2.2) = (1, 2) - 5.7 (0.6,
    0.8) = (-2.42, -2.56)``. DiReFT: ``h + W2^T (W1 h + b) = (1, 2) + 3.5 (3, 4) = (11.5, 16)``."""
    h = torch.tensor([[1.0, 2.0]])
    layer, proj, source = _fake_reft_layer([[3.0, 4.0]], [[1.0, 1.0]], [0.5])
    torch.testing.assert_close(orthonormal_rows(proj.weight), torch.tensor([[-0.6, -0.8]]))
    torch.testing.assert_close(h + LoReFT.delta(layer, "a", h), torch.tensor([[-2.42, -2.56]]))
    torch.testing.assert_close(h + DiReFT.delta(layer, "a", h), torch.tensor([[11.5, 16.0]]))

    # the independent reference's hooks, on a one-layer "model" whose output is its input
    identity = torch.nn.Sequential(torch.nn.Identity())
    for intervention, want in (("loreft", [[-2.42, -2.56]]), ("direft", [[11.5, 16.0]])):
        folder = tmp_path / intervention
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "PREFT_REFT", "intervention": intervention, "prefill_only": True, "adapter_start": 0}))
        save_file({"base_model.model.0.reft_proj.weight": proj.weight.clone(),
                   "base_model.model.0.reft_source.weight": source.weight.clone(),
                   "base_model.model.0.reft_source.bias": source.bias.clone()},
                  str(folder / "adapter_model.safetensors"))
        adapter = Adapter(identity, folder)
        adapter.mask = active_positions(1, 1, 0, True)
        torch.testing.assert_close(identity(h[None])[0], torch.tensor(want))
        adapter.remove()
