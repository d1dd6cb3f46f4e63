"""Recipe: GRPO for a prefill-only adapter on verifiable arithmetic.

    preft train recipes/configs/grpo_lora_p.yaml [key=value ...]

1. Data: ``preft.data.arithmetic_prompts`` — ``add 31 54 =`` with a hidden exact answer; the
   reward is ``preft.data.exact_match_reward`` (1 if the first word of the completion is the
   answer). Training starts from the base model (the adapter starts as the identity).
2. Adapter: ``adapter.type`` = ``lora_p`` | ``reft_p`` | ``lora`` (all-token baseline).
3. Train with ``PreftGRPOTrainer`` (TRL ``GRPOTrainer``, on-policy HF generation with the
   prefill mask); the ``trainer`` section is a ``trl.GRPOConfig``.
4. Greedy exact match on held-out prompts before and after, the adapter saved to
   ``OUTPUT_DIR/adapter``, and ``run_summary.json`` with the mean reward over training.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from rich.console import Console
from transformers import AutoTokenizer
from trl import GRPOConfig

from preft.data import arithmetic_prompts, exact_match_reward
from preft.recipe_config import check_section
from preft import precision
from preft.recipes.common import (
    build_adapter_config, build_trl_args, check_keys, claim_output_dir, is_main_process, resolve_model, resolve_resume,
    train, train_log, write_summary,
)
from preft.trainers import PreftGRPOTrainer


def build_datasets(data: dict[str, Any]) -> tuple[Dataset, Dataset]:
    check_section(data, {"task": str, "train_prompts": int, "eval_prompts": int, "max_value": int}, "data")
    if data["task"] != "arithmetic":
        raise ValueError(f"data.task {data['task']!r} is not supported by the grpo recipe (use 'arithmetic')")
    train = arithmetic_prompts(data["train_prompts"], seed=0, max_value=data["max_value"])
    held_out = arithmetic_prompts(data["eval_prompts"], seed=1, max_value=data["max_value"])
    return Dataset.from_list(train), Dataset.from_list(held_out)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: Dataset, max_new_tokens: int) -> float:
    was_training = model.training
    model.eval()
    batch = tokenizer(list(rows["prompt"]), return_tensors="pt", padding=True).to(model.device)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    rewards = exact_match_reward(texts, list(rows["answer"]))
    return sum(rewards) / len(rewards)


def main(config: dict[str, Any]) -> dict[str, Any]:
    started = time.time()
    check_keys(config, {"recipe", "output_dir", "model", "data", "adapter", "trainer"}, {"resume_from_checkpoint", "overwrite_output_dir", "precision"})
    output_dir = config["output_dir"]

    model_path = resolve_model(config["model"])
    train_set, eval_set = build_datasets(config["data"])
    peft_config = build_adapter_config(config["adapter"])
    chosen: list[str] = []
    trainer_section = precision.apply(config.get("precision", "auto"), config["trainer"], announce=chosen.append)
    args = build_trl_args(GRPOConfig, trainer_section, output_dir)
    if is_main_process():  # asked only now: accelerate's state must start from the trainer's own args
        print(f"preft train: {chosen[0]}")
    resume = resolve_resume(output_dir, config.get("resume_from_checkpoint"))
    claim_output_dir(config, "grpo", resuming=resume is not None)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    trainer = PreftGRPOTrainer(model=model_path, reward_funcs=exact_match_reward, args=args,
                               train_dataset=train_set, processing_class=tokenizer, peft_config=peft_config)

    max_new = args.max_completion_length
    initial_accuracy = greedy_accuracy(trainer.model, tokenizer, eval_set, max_new)
    train(trainer, resume)
    final_accuracy = greedy_accuracy(trainer.model, tokenizer, eval_set, max_new)

    adapter_dir = Path(output_dir) / "adapter"
    trainer.save_model(str(adapter_dir))
    rewards = train_log(trainer.state.log_history, "reward")
    quarter = max(1, len(rewards) // 4)
    summary = {
        "recipe": "grpo",
        "steps": trainer.state.global_step,
        "adapter_dir": str(adapter_dir),
        "mean_reward_first_quarter": sum(r for _, r in rewards[:quarter]) / quarter if rewards else None,
        "mean_reward_last_quarter": sum(r for _, r in rewards[-quarter:]) / quarter if rewards else None,
        "reward_history": rewards,
        "heldout_greedy_accuracy_before": initial_accuracy,
        "heldout_greedy_accuracy_after": final_accuracy,
        "config": config,
    }
    path = write_summary(output_dir, summary, started)
    if is_main_process():
        Console().print(
            f"[bold]grpo[/bold]: {summary['steps']} steps, mean reward {summary['mean_reward_first_quarter']} (first "
            f"quarter) -> {summary['mean_reward_last_quarter']} (last quarter); held-out greedy accuracy "
            f"{initial_accuracy:.3f} -> {final_accuracy:.3f}; adapter in {adapter_dir}, summary in {path}"
        )
    return summary


if __name__ == "__main__":
    import sys

    from preft.recipe_config import load_config

    main(load_config(sys.argv[1], sys.argv[2:]))
