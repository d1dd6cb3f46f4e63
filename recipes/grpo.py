"""Recipe: GRPO for a prefill-only adapter on verifiable arithmetic.

    preft train recipes/configs/grpo_lora_p.yaml [key=value ...]

1. Data: ``data.task: arithmetic`` — ``preft.data.arithmetic_prompts``, ``add 31 54 =`` with a
   hidden exact answer; the reward is ``preft.data.exact_match_reward`` (1 if the first word of
   the completion is the answer). Or ``data.task: word_problems`` — a chat model's task
   (:mod:`preft.tasks`): one-step word problems as chat prompts, reward 1 where the answer's last
   number is right. Training starts from the base model (the adapter starts as the identity).
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


DATA_SECTIONS = {
    "arithmetic": {"task": str, "train_prompts": int, "eval_prompts": int, "max_value": int},
    "word_problems": {"task": str, "train_prompts": int, "eval_prompts": int},
}


def task_prompts(name: str, count: int, split: str) -> list[dict[str, Any]]:
    """A :mod:`preft.tasks` task as GRPO rows: the user's turn as a conversational prompt, the
    checker's ``target`` as a column the reward reads (never shown to the model)."""
    from preft.tasks import rows_of

    return [{"prompt": row["messages"][:-1], "target": row["target"]} for row in rows_of(name, count, split)]


def word_problem_reward(completions: list, target: list[int], **kwargs) -> list[float]:
    """TRL reward function: 1.0 where the completion's last number is the answer, else 0.0."""
    from preft.tasks import check

    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [1.0 if check("word_problems", text, value) else 0.0 for text, value in zip(texts, target)]


def build_datasets(data: dict[str, Any]) -> tuple[Dataset, Dataset]:
    task = data.get("task") if isinstance(data, dict) else None
    if task not in DATA_SECTIONS:
        raise ValueError(f"data.task {task!r} is not supported by the grpo recipe (use one of {sorted(DATA_SECTIONS)})")
    check_section(data, DATA_SECTIONS[task], "data")
    if task == "word_problems":
        return (Dataset.from_list(task_prompts(task, data["train_prompts"], "train")),
                Dataset.from_list(task_prompts(task, data["eval_prompts"], "held_out")))
    train = arithmetic_prompts(data["train_prompts"], seed=0, max_value=data["max_value"])
    held_out = arithmetic_prompts(data["eval_prompts"], seed=1, max_value=data["max_value"])
    return Dataset.from_list(train), Dataset.from_list(held_out)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: Dataset, max_new_tokens: int, reward=exact_match_reward) -> float:
    """The mean reward of greedy answers to ``rows`` (chat prompts through the chat template)."""
    was_training = model.training
    model.eval()
    prompts = list(rows["prompt"])
    if not isinstance(prompts[0], str):
        prompts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generate continues each row's end
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=isinstance(rows["prompt"][0], str)).to(model.device)
    tokenizer.padding_side = side
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    columns = {key: list(rows[key]) for key in rows.column_names if key != "prompt"}
    rewards = reward(texts, **columns)
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
    reward = word_problem_reward if config["data"]["task"] == "word_problems" else exact_match_reward
    trainer = PreftGRPOTrainer(model=model_path, reward_funcs=reward, args=args,
                               train_dataset=train_set, processing_class=tokenizer, peft_config=peft_config)

    max_new = args.max_completion_length
    initial_accuracy = greedy_accuracy(trainer.model, tokenizer, eval_set, max_new, reward)
    train(trainer, resume)
    final_accuracy = greedy_accuracy(trainer.model, tokenizer, eval_set, max_new, reward)

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
