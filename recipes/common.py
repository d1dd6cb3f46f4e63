"""Small helpers the recipes share: model path, adapter config, TRL args, logging, summary."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from peft import LoraConfig
from transformers import TrainerCallback

import preft
from preft.output_dirs import check_claim, mark
from preft.recipe_config import check_fields
from preft.trainers.checks import check_model_path

#: the user's own WANDB_DIR, read once: otherwise each run's wandb files go to its output_dir
USER_WANDB_DIR = os.environ.get("WANDB_DIR")

ADAPTER_TYPES = {
    "lora_p": lambda **kw: preft.PreftLoraConfig(**kw),
    "reft_p": lambda **kw: preft.PreftReftConfig(**kw),
    "lora": lambda **kw: LoraConfig(**kw),  # the all-token baseline
}


def resolve_model(name: str) -> str:
    """``default`` is the embedded base model, a real model's short name its prepared directory
    (:func:`preft.real_models.resolve`); anything else must be a local HF directory."""
    from preft.real_models import resolve

    path = resolve(name)
    check_model_path(path)
    return path


ADAPTER_CLASSES = {"lora_p": preft.PreftLoraConfig, "reft_p": preft.PreftReftConfig, "lora": LoraConfig}


def build_adapter_config(section: dict[str, Any]):
    """``{"type": "lora_p", "r": 16, ...}`` -> a PEFT config; unknown types and fields, and values
    of the wrong type, are errors."""
    section = dict(section)
    kind = section.pop("type", None)
    if kind not in ADAPTER_TYPES:
        raise ValueError(f"adapter.type {kind!r} is not supported by this recipe (choose one of {sorted(ADAPTER_TYPES)})")
    check_fields(ADAPTER_CLASSES[kind], section, "adapter")
    try:
        return ADAPTER_TYPES[kind](task_type="CAUSAL_LM", **section)
    except TypeError as err:  # an unknown dataclass field
        raise ValueError(f"adapter ({kind}): {err}") from None


def build_trl_args(config_cls, section: dict[str, Any], output_dir: str):
    """A TRL config dataclass from the ``trainer`` section; unknown keys and values of the wrong
    type name themselves (:func:`preft.recipe_config.check_fields`), before anything is written."""
    check_fields(config_cls, section, "trainer")
    section = dict(section)
    if section.get("report_to") == "wandb":
        # offline unless the user chose otherwise; each run lands next to its own checkpoints
        # (several runs in one process, as `preft eval loss` makes, each get their own)
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ["WANDB_DIR"] = USER_WANDB_DIR or output_dir
        os.environ.setdefault("WANDB_PROJECT", "preft")
    try:
        return config_cls(output_dir=output_dir, **section)
    except (ValueError, TypeError) as err:  # the dataclass's own checks (combinations of fields)
        raise ValueError(f"trainer: {err}") from None


CHECKPOINT_FILES = ("trainer_state.json", "optimizer.pt", "scheduler.pt")


def _complete(checkpoint: Path) -> bool:
    weights = ("adapter_model.safetensors", "model.safetensors", "pytorch_model.bin")
    return all((checkpoint / name).is_file() for name in CHECKPOINT_FILES) and any(
        (checkpoint / name).is_file() for name in weights)


def resolve_resume(output_dir: str, resume: Any) -> str | None:
    """The checkpoint ``resume_from_checkpoint`` means: ``true`` = the newest *complete*
    checkpoint in ``output_dir`` (one that lost a file, say to a crash while saving, is skipped
    with a message); a path must be a complete checkpoint; ``null`` / ``false`` = none."""
    if resume in (None, False):
        return None
    if resume is True:
        found = sorted(Path(output_dir).glob("checkpoint-*"),
                       key=lambda p: int(p.name.split("-")[-1]) if p.name.split("-")[-1].isdigit() else -1)
        for checkpoint in reversed(found):
            if _complete(checkpoint):
                return str(checkpoint)
            print(f"resume: skipping incomplete {checkpoint} (missing one of {', '.join(CHECKPOINT_FILES)} "
                  "or its weights)")
        raise ValueError(f"resume_from_checkpoint=true, but {output_dir} has no complete checkpoint")
    if not isinstance(resume, str) or not _complete(Path(resume)):
        raise ValueError(f"resume_from_checkpoint {resume!r} is not a complete checkpoint directory")
    return resume


def claim_output_dir(config: dict[str, Any], recipe: str, resuming: bool) -> None:
    """``output_dir`` becomes this run's (:mod:`preft.output_dirs`): new or empty, this recipe's
    run being resumed, or ``overwrite_output_dir=true``; else one error, before anything is
    written. Every process checks; the main one writes the marker."""
    from accelerate import PartialState

    overwrite = config.get("overwrite_output_dir", False)
    if not isinstance(overwrite, bool):
        raise ValueError(f"overwrite_output_dir must be true or false, got {overwrite!r}")
    run_id = check_claim(config["output_dir"], f"train:{recipe}", resume=resuming, overwrite=overwrite,
                         how_to_overwrite="overwrite_output_dir=true", resume_unmarked=True)
    PartialState().wait_for_everyone()  # nobody writes before everyone has checked
    if is_main_process():
        mark(config["output_dir"], f"train:{recipe}", run_id)


def steps_done(checkpoint: str | None) -> int:
    """The global step a checkpoint was saved at (0 without one)."""
    if checkpoint is None:
        return 0
    return int(json.loads((Path(checkpoint) / "trainer_state.json").read_text()).get("global_step", 0))


def check_keys(config: dict[str, Any], required: set[str], optional: set[str], where: str = "recipe") -> None:
    missing = sorted(required - set(config))
    unknown = sorted(set(config) - required - optional)
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown} (known: {sorted(required | optional)})")


class LossBeforeTraining(TrainerCallback):
    """The held-out loss before the first step, measured when training starts.

    Not ``trainer.evaluate()`` before ``trainer.train()``: with transformers 5.19 and accelerate
    1.15 that marks the bare model "prepared" (evaluation mode, no DDP wrapper), ``train()``
    then skips the DDP wrap, and under ``accelerate launch`` every process trained its own copy
    on its own rows (measured: the two ranks' gradients differed). At ``on_train_begin`` the
    model is already wrapped."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.loss: float | None = None
        trainer.add_callback(self)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            self.loss = self.trainer.evaluate()["eval_loss"]


def is_main_process() -> bool:
    """True in the one process that writes the run's files and prints its summary (every process
    of a single-process run; rank 0 under ``accelerate launch``)."""
    from accelerate import PartialState

    return PartialState().is_main_process


def write_summary(output_dir: str, summary: dict[str, Any], started: float) -> Path:
    """``OUTPUT_DIR/run_summary.json``, written by the main process only, atomically (a temp
    file renamed over it)."""
    summary = dict(summary, wall_time_s=round(time.time() - started, 1))
    path = Path(output_dir) / "run_summary.json"
    if is_main_process():
        temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        os.replace(temp, path)
    return path


def train_log(log_history: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """``(step, value)`` pairs of one logged metric."""
    return [(entry["step"], entry[key]) for entry in log_history if key in entry]


def train(trainer, resume: str | None) -> None:
    """``trainer.train``, resuming from ``resume``; a run whose checkpoint already reached
    ``max_steps`` is not trained further (transformers would take one more step): its weights
    and state are restored from the checkpoint instead."""
    done, max_steps = steps_done(resume), trainer.args.max_steps
    if resume is None or max_steps <= 0 or done < max_steps:
        trainer.train(resume_from_checkpoint=resume)
        return
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import TrainerState

    print(f"resume: {resume} is at step {done} of max_steps {max_steps}: nothing left to train")
    set_peft_model_state_dict(trainer.model, load_file(str(Path(resume) / "adapter_model.safetensors")))
    trainer.state = TrainerState.load_from_json(str(Path(resume) / "trainer_state.json"))
