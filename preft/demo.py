"""`make demo`: what a prefill-only adapter does, end to end on the embedded default model.

1. Load the default base model and show its greedy answers to ``sort`` prompts (ascending).
2. Train, side by side for the same steps, a LoRA-P adapter (prompt tokens only) and an
   all-token LoRA adapter (the standard-PEFT baseline) on a private rule: sort *descending*.
3. Report held-out loss and exact-match accuracy of base / LoRA-P / LoRA, and check the rule of
   PreFT on a live ``generate``: the adapter ran on every prompt token and on no generated token.
4. Save the LoRA-P adapter with ``save_pretrained`` and reload it with ``PeftModel.from_pretrained``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model
from rich.console import Console
from rich.table import Table
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import preft
from preft.constants import ALL_PROJECTIONS
from preft.data import encode_sft_batch

console = Console(width=110)


def descending_sort_example(rng: random.Random) -> dict[str, str]:
    """The demo user's private rule: ``sort`` answers in descending order."""
    items = [rng.randint(0, 9) for _ in range(rng.randint(3, 6))]
    return {"prompt": f"sort {' '.join(map(str, items))} =",
            "completion": " " + " ".join(map(str, sorted(items, reverse=True)))}


@torch.no_grad()
def exact_match(model, tokenizer, examples) -> float:
    batch = tokenizer([ex["prompt"] for ex in examples], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=16, do_sample=False)
    answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(a.strip() == ex["completion"].strip() for a, ex in zip(answers, examples)) / len(examples)


def train(model, tokenizer, train_set, steps: int, label: str, batch_size: int = 16, lr: float = 2e-3):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    rng = random.Random(0)
    model.train()
    bar = tqdm(range(steps), desc=f"train {label}", dynamic_ncols=True)
    for _ in bar:
        loss = model(**encode_sft_batch(tokenizer, rng.sample(train_set, batch_size))).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return model.eval()


@torch.no_grad()
def eval_loss(model, tokenizer, examples) -> float:
    return model(**encode_sft_batch(tokenizer, examples)).loss.item()


def main(steps: int = 300, output_dir: str = "runs/demo") -> dict[str, float]:
    started = time.time()
    torch.manual_seed(0)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    tokenizer = AutoTokenizer.from_pretrained(preft.DEFAULT_BASE_MODEL)
    rng = random.Random(0)
    train_set = [descending_sort_example(rng) for _ in range(2000)]
    held_out = [descending_sort_example(rng) for _ in range(64)]

    def fresh_base():
        return AutoModelForCausalLM.from_pretrained(preft.DEFAULT_BASE_MODEL, dtype=torch.float32)

    base = fresh_base().eval()
    console.rule("PreFT demo: the default base model")
    console.print(f"{preft.DEFAULT_BASE_MODEL}: Llama, {sum(p.numel() for p in base.parameters()):,} parameters, "
                  f"{base.config.num_hidden_layers} layers")
    batch = tokenizer([ex["prompt"] for ex in held_out[:3]], return_tensors="pt", padding=True)
    out = base.generate(**batch, max_new_tokens=12, do_sample=False)
    for ex, text in zip(held_out, tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)):
        console.print(f"  {ex['prompt']!r:28} base model -> {text.strip()!r:16} (the user wants {ex['completion'].strip()!r})")

    console.rule(f"Train the user's rule (sort descending), {steps} steps each")
    target = list(ALL_PROJECTIONS)
    lora_p = train(get_peft_model(fresh_base(), preft.PreftLoraConfig(r=16, lora_alpha=32, target_modules=target)),
                   tokenizer, train_set, steps, "LoRA-P (prompt tokens only)")
    lora = train(get_peft_model(fresh_base(), preft.PreftLoraConfig(r=16, lora_alpha=32, target_modules=target,
                                                                      prefill_only=False)),
                 tokenizer, train_set, steps, "LoRA (all tokens)")

    results = {
        "base": (eval_loss(base, tokenizer, held_out), exact_match(base, tokenizer, held_out)),
        "LoRA-P": (eval_loss(lora_p, tokenizer, held_out), exact_match(lora_p, tokenizer, held_out)),
        "LoRA (all-token)": (eval_loss(lora, tokenizer, held_out), exact_match(lora, tokenizer, held_out)),
    }
    table = Table(title=f"held-out: {len(held_out)} prompts of the user's rule")
    table.add_column("model")
    table.add_column("eval loss", justify="right")
    table.add_column("exact match", justify="right")
    for name, (loss, acc) in results.items():
        table.add_row(name, f"{loss:.3f}", f"{acc:.0%}")
    console.print(table)

    console.rule("The rule of PreFT, checked on a live generate()")
    tracker = lora_p.base_model.prefill_tracker
    active = []
    hook = lora_p.get_base_model().register_forward_hook(
        lambda *_: active.append(int(tracker.current.active_mask(0).sum()))
    )
    single = tokenizer([held_out[0]["prompt"]], return_tensors="pt")
    lora_p.generate(**single, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    hook.remove()
    prompt_tokens = single["input_ids"].shape[1]
    console.print(f"  prompt {held_out[0]['prompt']!r}: {prompt_tokens} prompt tokens, 8 generated")
    console.print(f"  tokens the adapter touched, per forward: {active}")
    assert active == [prompt_tokens] + [0] * 7, "the adapter must touch prompt tokens only"
    console.print("  -> prefill forward: every prompt token; each decode step: none (plain base model)")

    path = Path(output_dir) / "lora_p_adapter"
    lora_p.save_pretrained(path)
    reloaded = PeftModel.from_pretrained(fresh_base(), path).eval()
    same = torch.equal(reloaded.generate(**single, max_new_tokens=8, do_sample=False),
                       lora_p.generate(**single, max_new_tokens=8, do_sample=False))
    console.print(f"  saved to {path}; reloaded with PeftModel.from_pretrained: identical generation = {same}")
    console.print(f"done in {time.time() - started:.0f} s")
    return {name: acc for name, (_, acc) in results.items()}


if __name__ == "__main__":
    main()
