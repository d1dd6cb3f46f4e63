"""Recipe: supervised finetuning of a prefill-only adapter on one synthetic user's rule.

    preft train recipes/configs/sft_lora_p.yaml [key=value ...]

1. Data: ``data.task: user_rule`` — ``preft.data.user_examples``: the user has a hidden
   word-substitution table; the adapter must learn it from ``rewrite <sentence> =`` ->
   ``<sentence, nouns substituted>`` pairs, and a separate seed gives held-out prompts for the
   eval loss. Or ``data.task: local`` with ``data.path`` — the user's own prompt/completion
   (or ``messages``) file or directory (:mod:`preft.user_data`), ``eval_examples`` rows held out
   unless it has a validation split; every row is checked to fit the model's context.
2. Adapter: ``adapter.type`` = ``lora_p`` | ``reft_p`` | ``lora`` (all-token baseline); every
   other key of the ``adapter`` section is a field of that PEFT config.
3. Train with ``PreftSFTTrainer`` (TRL ``SFTTrainer``); the ``trainer`` section is a
   ``trl.SFTConfig``. Checkpoints every ``save_steps``; ``resume_from_checkpoint=true`` resumes.
4. Save the adapter with ``save_pretrained`` to ``OUTPUT_DIR/adapter`` and a
   ``run_summary.json`` (config, steps, eval loss before/after, wall time).

Everything is checked before anything is written, so a bad config leaves no output behind.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from datasets import Dataset
from rich.console import Console
from transformers import AutoConfig, AutoTokenizer
from trl import SFTConfig

from preft.data import user_examples
from preft.user_data import load_user_data
from preft.recipe_config import check_section
from preft import precision
from preft.recipes.common import (
    LossBeforeTraining, build_adapter_config, build_trl_args, check_keys, claim_output_dir, is_main_process, resolve_model, resolve_resume,
    train, train_log, write_summary,
)
from preft.trainers import PreftSFTTrainer


DATA_SECTIONS = {
    "user_rule": {"task": str, "user": (int, 0), "train_examples": int, "eval_examples": int},
    "local": {"task": str, "path": str, "eval_examples": int},
}


def build_datasets(data: dict[str, Any], tokenizer=None, context: int | None = None) -> tuple[Dataset, Dataset]:
    """``(train, held_out)``; with ``tokenizer`` and ``context`` (the model's positions), the
    user's own rows are checked to fit (the synthetic task's always do)."""
    task = data.get("task") if isinstance(data, dict) else None
    if task not in DATA_SECTIONS:
        raise ValueError(f"data.task {task!r} is not supported by the sft recipe (use one of {sorted(DATA_SECTIONS)})")
    check_section(data, DATA_SECTIONS[task], "data")
    if task == "local":
        return load_user_data(data["path"], data["eval_examples"], tokenizer=tokenizer, context=context)
    train = user_examples(data["user"], data["train_examples"], seed=0)
    held_out = user_examples(data["user"], data["eval_examples"], seed=1)
    return Dataset.from_list(train), Dataset.from_list(held_out)


def main(config: dict[str, Any]) -> dict[str, Any]:
    started = time.time()
    check_keys(config, {"recipe", "output_dir", "model", "data", "adapter", "trainer"}, {"resume_from_checkpoint", "overwrite_output_dir", "precision"})
    output_dir = config["output_dir"]

    # 1-3. everything is validated before the first file is written
    model_path = resolve_model(config["model"])
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    context = AutoConfig.from_pretrained(model_path).max_position_embeddings
    train_set, eval_set = build_datasets(config["data"], tokenizer, context)
    peft_config = build_adapter_config(config["adapter"])
    chosen: list[str] = []
    trainer_section = precision.apply(config.get("precision", "auto"), config["trainer"], announce=chosen.append)
    args = build_trl_args(SFTConfig, trainer_section, output_dir)
    if is_main_process():  # asked only now: accelerate's state must start from the trainer's own args
        print(f"preft train: {chosen[0]}")
    resume = resolve_resume(output_dir, config.get("resume_from_checkpoint"))
    claim_output_dir(config, "sft", resuming=resume is not None)
    trainer = PreftSFTTrainer(model=model_path, args=args, train_dataset=train_set, eval_dataset=eval_set,
                              processing_class=tokenizer, peft_config=peft_config)

    before = LossBeforeTraining(trainer)
    train(trainer, resume)
    initial_eval = before.loss
    final_eval = trainer.evaluate()["eval_loss"]

    # 4. save
    adapter_dir = Path(output_dir) / "adapter"
    trainer.save_model(str(adapter_dir))
    train_losses = train_log(trainer.state.log_history, "loss")
    summary = {
        "recipe": "sft",
        "steps": trainer.state.global_step,
        "adapter_dir": str(adapter_dir),
        "initial_eval_loss": initial_eval,
        "final_eval_loss": final_eval,
        "final_train_loss": train_losses[-1][1] if train_losses else None,
        "eval_loss_history": train_log(trainer.state.log_history, "eval_loss"),
        "config": config,
    }
    path = write_summary(output_dir, summary, started)
    if is_main_process():
        Console().print(f"[bold]sft[/bold]: {summary['steps']} steps, eval loss {initial_eval} -> {final_eval:.4f}; "
                        f"adapter in {adapter_dir}, summary in {path}")
    return summary


if __name__ == "__main__":
    import sys

    from preft.recipe_config import load_config

    main(load_config(sys.argv[1], sys.argv[2:]))
