"""An adapter (or the base model) on a study task's held-out chat rows: task accuracy and where
in the answer the loss is.

    accuracy = mean_i check(greedy_answer_i, target_i)
    loss[bucket] = mean NLL of the answer tokens whose index k (0 = first answer token) is in bucket

The prompt is the chat template up to the assistant's turn, the answer the rest of the
templated conversation (its closing tokens included, as TRL trains on them). HF ``generate``
runs the adapter under the rule (a PreFT adapter on prompt tokens only); the teacher-forced
forward passes ``labels``, from which the PreFT tracker reads each row's prompt length.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

#: answer-token index buckets for the loss: the first token, the next three, the rest
BUCKETS = (("first token", 0, 1), ("tokens 2-4", 1, 4), ("tokens 5+", 4, 1 << 30))
BATCH = 32


def load(model_path: str, adapter_dir: str | None, precision: str):
    """The model for evaluation: bf16 weights where ``precision`` resolves to bf16, on the device
    the machine has (:mod:`preft.precision`)."""
    from transformers import AutoModelForCausalLM

    from preft import precision as precisions

    chosen, device, _ = precisions.resolve(precision)
    dtype = torch.bfloat16 if chosen == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def _split(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if not full.startswith(prompt):
        raise ValueError("the chat template does not render the conversation as prompt + answer")
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return encode(prompt), encode(full[len(prompt):])


@torch.no_grad()
def accuracy(model, tokenizer, task, rows: list[dict[str, Any]]) -> float:
    """Greedy answers to the rows' questions, checked by the task."""
    tokenizer.padding_side = "left"  # generate continues each row's last prompt token
    right = 0
    for start in range(0, len(rows), BATCH):
        chunk = rows[start:start + BATCH]
        prompts = [_split(tokenizer, row["messages"])[0] for row in chunk]
        batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(model.device)
        out = model.generate(**batch, max_new_tokens=task.max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        right += sum(task.check(text, row["target"]) for text, row in zip(texts, chunk))
    return right / len(rows)


@torch.no_grad()
def loss_by_position(model, tokenizer, rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean NLL of the answer tokens per :data:`BUCKETS` bucket (teacher forcing)."""
    sums = {name: [] for name, _, _ in BUCKETS}
    for start in range(0, len(rows), BATCH):
        pairs = [_split(tokenizer, row["messages"]) for row in rows[start:start + BATCH]]
        width = max(len(p) + len(a) for p, a in pairs)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(pairs), width), pad)
        labels = torch.full((len(pairs), width), -100)
        mask = torch.zeros((len(pairs), width), dtype=torch.long)
        for i, (prompt, answer) in enumerate(pairs):  # right padding: positions start at 0
            n = len(prompt) + len(answer)
            ids[i, :n] = torch.tensor(prompt + answer)
            labels[i, len(prompt):n] = torch.tensor(answer)
            mask[i, :n] = 1
        device = model.device
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).logits
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels[:, 1:].to(device),
                                                reduction="none", ignore_index=-100).cpu()
        for i, (prompt, answer) in enumerate(pairs):
            row_nll = nll[i, len(prompt) - 1:len(prompt) - 1 + len(answer)].tolist()
            for name, low, high in BUCKETS:
                sums[name].extend(row_nll[low:high])
    return {name: statistics.mean(values) for name, values in sums.items() if values}


def evaluate(model_path: str, adapter_dir: str | None, task, rows: list[dict[str, Any]], precision: str) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = load(model_path, adapter_dir, precision)
    return {"accuracy": accuracy(model, tokenizer, task, rows),
            "loss_by_position": loss_by_position(model, tokenizer, rows)}
