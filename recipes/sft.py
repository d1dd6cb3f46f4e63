"""Recipe: supervised finetuning of a prefill-only adapter on one synthetic user's rule.

    preft train recipes/configs/sft_lora_p.yaml [key=value ...]

1. Data: ``preft.data.user_examples`` — the user has a hidden word-substitution table; the
   adapter must learn it from ``rewrite <sentence> =`` -> ``<sentence, nouns substituted>``
   pairs. A separate seed gives held-out prompts for the eval loss.
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
from transformers import AutoTokenizer
from trl import SFTConfig

from preft.data import user_examples
from preft.recipe_config import check_section
from preft.recipes.common import (
    build_adapter_config, build_trl_args, check_keys, resolve_model, resolve_resume, train, train_log,
    write_summary,
)
from preft.trainers import PreftSFTTrainer


def build_datasets(data: dict[str, Any]) -> tuple[Dataset, Dataset]:
    check_section(data, {"task": str, "user": (int, 0), "train_examples": int, "eval_examples": int}, "data")
    if data["task"] != "user_rule":
        raise ValueError(f"data.task {data['task']!r} is not supported by the sft recipe (use 'user_rule')")
    train = user_examples(data["user"], data["train_examples"], seed=0)
    held_out = user_examples(data["user"], data["eval_examples"], seed=1)
    return Dataset.from_list(train), Dataset.from_list(held_out)


def main(config: dict[str, Any]) -> dict[str, Any]:
    started = time.time()
    check_keys(config, {"recipe", "output_dir", "model", "data", "adapter", "trainer"}, {"resume_from_checkpoint"})
    output_dir = config["output_dir"]

    # 1-3. everything is validated before the first file is written
    model_path = resolve_model(config["model"])
    train_set, eval_set = build_datasets(config["data"])
    peft_config = build_adapter_config(config["adapter"])
    args = build_trl_args(SFTConfig, config["trainer"], output_dir)
    resume = resolve_resume(output_dir, config.get("resume_from_checkpoint"))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    trainer = PreftSFTTrainer(model=model_path, args=args, train_dataset=train_set, eval_dataset=eval_set,
                              processing_class=tokenizer, peft_config=peft_config)

    initial_eval = None if resume else trainer.evaluate()["eval_loss"]
    train(trainer, resume)
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
    Console().print(f"[bold]sft[/bold]: {summary['steps']} steps, eval loss {initial_eval} -> {final_eval:.4f}; "
                    f"adapter in {adapter_dir}, summary in {path}")
    return summary


if __name__ == "__main__":
    import sys

    from preft.recipe_config import load_config

    main(load_config(sys.argv[1], sys.argv[2:]))
