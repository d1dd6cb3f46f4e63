"""HF generation and teacher forcing honour the prefill rule ``start <= p < P``."""

from __future__ import annotations

import torch

from conftest import ADAPTER_CONFIGS, PROMPTS

NEW_TOKENS = 8


def manual_greedy(model, batch, new_tokens: int) -> torch.Tensor:
    """Reference: prefill forward with the adapter, then a decode loop with it disabled.

    EOS is never picked, as ``generate(min_new_tokens=...)`` does.
    """
    eos = model.generation_config.eos_token_id

    def pick(logits):
        return logits[:, -1].index_fill(-1, torch.tensor([eos]), float("-inf")).argmax(-1)

    mask = batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions, use_cache=True)
    cache, token = out.past_key_values, pick(out.logits)
    tokens = [token]
    with model.disable_adapter():
        for _ in range(new_tokens - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                        past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, pick(out.logits)
            tokens.append(token)
    return torch.stack(tokens, dim=1)


def greedy(model, batch, new_tokens: int = NEW_TOKENS, **kwargs):
    return model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, **kwargs)


@torch.no_grad()
def test_generate_equals_manual_prefill_only_reference(make_peft_model, prompt_batch, adapter_kind):
    model = make_peft_model(ADAPTER_CONFIGS[adapter_kind]())
    width = prompt_batch["input_ids"].shape[1]
    generated = greedy(model, prompt_batch)[:, width:]
    reference = manual_greedy(model, prompt_batch, NEW_TOKENS)
    assert torch.equal(generated, reference)
    # the adapter matters: with it off everywhere the completions differ
    with model.disable_adapter():
        base = greedy(model, prompt_batch)[:, width:]
    assert not torch.equal(generated, base)


@torch.no_grad()
def test_left_padded_batch_matches_single_prompts(make_peft_model, tokenizer, prompt_batch, adapter_kind):
    model = make_peft_model(ADAPTER_CONFIGS[adapter_kind]())
    width = prompt_batch["input_ids"].shape[1]
    batched = greedy(model, prompt_batch)[:, width:]
    for row, prompt in enumerate(PROMPTS):
        single = tokenizer([prompt], return_tensors="pt")
        alone = greedy(model, single)[:, single["input_ids"].shape[1]:]
        assert torch.equal(alone[0], batched[row]), prompt


@torch.no_grad()
def test_teacher_forced_logits_equal_generation_logits(make_peft_model, prompt_batch, tokenizer, adapter_kind):
    # float64: in float32 the *base model alone* differs by up to ~5e-5 between a full forward
    # and incremental decoding (different reduction orders), so a 1e-5 bound would test BLAS,
    # not the mask. A wrong mask moves logits by O(0.1).
    model = make_peft_model(ADAPTER_CONFIGS[adapter_kind](), dtype=torch.float64)
    width = prompt_batch["input_ids"].shape[1]
    out = greedy(model, prompt_batch, output_logits=True, return_dict_in_generate=True)
    gen_logits = torch.stack(out.logits, dim=1).double()  # [B, n, V]; generate returns float32

    # left-padded teacher forcing: prompt masked out of the labels
    full = out.sequences
    mask = torch.cat([prompt_batch["attention_mask"], torch.ones_like(full[:, width:])], dim=1)
    labels = full.masked_fill(torch.arange(full.shape[1]) < width, -100)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate() builds them
    logits = model(input_ids=full, attention_mask=mask, position_ids=positions, labels=labels).logits
    assert torch.allclose(logits[:, width - 1:-1], gen_logits, atol=1e-5, rtol=0)

    # right-padded teacher forcing (TRL's layout): the same logits row by row
    rows, row_labels = [], []
    for row in range(full.shape[0]):
        real = full[row][mask[row].bool()]
        prompt_len = int(prompt_batch["attention_mask"][row].sum())
        rows.append(real)
        row_labels.append(torch.cat([torch.full((prompt_len,), -100), real[prompt_len:]]))
    length = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.stack([torch.cat([r, torch.full((length - len(r),), pad)]) for r in rows])
    rmask = torch.stack([torch.cat([torch.ones(len(r)), torch.zeros(length - len(r))]).long() for r in rows])
    rlabels = torch.stack([torch.cat([r, torch.full((length - len(r),), -100)]) for r in row_labels])
    rlogits = model(input_ids=ids, attention_mask=rmask, labels=rlabels).logits
    for row in range(full.shape[0]):
        prompt_len = int(prompt_batch["attention_mask"][row].sum())
        got = rlogits[row, prompt_len - 1: prompt_len - 1 + NEW_TOKENS]
        assert torch.allclose(got, gen_logits[row], atol=1e-5, rtol=0)


@torch.no_grad()
def test_explicit_prompt_lengths_equal_labels(make_peft_model, tokenizer, adapter_kind):
    model = make_peft_model(ADAPTER_CONFIGS[adapter_kind]())
    batch = tokenizer(["add 1 2 = 3", "sort 4 2 9 = 2 4 9"], return_tensors="pt", padding=True)
    prompt_lengths = torch.tensor([5, 7])
    width = batch["input_ids"].shape[1]
    pad = width - batch["attention_mask"].sum(-1)  # left padding per row
    index = torch.arange(width)
    labels = batch["input_ids"].masked_fill(index < (pad + prompt_lengths)[:, None], -100)
    by_labels = model(**batch, labels=labels).logits
    by_lengths = model(**batch, prompt_lengths=prompt_lengths).logits
    assert torch.equal(by_labels, by_lengths)
    everything = model(**batch).logits  # no labels: the whole input is prompt
    assert not torch.allclose(everything, by_lengths)
