"""Small helpers the recipes share: model path, adapter config, TRL args, logging, summary."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from peft import LoraConfig

import preft
from preft.trainers.checks import check_model_path

ADAPTER_TYPES = {
    "lora_p": lambda **kw: preft.PreftLoraConfig(**kw),
    "reft_p": lambda **kw: preft.PreftReftConfig(**kw),
    "lora": lambda **kw: LoraConfig(**kw),  # the all-token baseline
}


def resolve_model(name: str) -> str:
    """``default`` is the embedded base model; anything else must be a local HF directory."""
    path = preft.DEFAULT_BASE_MODEL if name == "default" else name
    check_model_path(path)
    return path


def build_adapter_config(section: dict[str, Any]):
    """``{"type": "lora_p", "r": 16, ...}`` -> a PEFT config; unknown types and fields are errors."""
    section = dict(section)
    kind = section.pop("type", None)
    if kind not in ADAPTER_TYPES:
        raise ValueError(f"adapter.type {kind!r} is not supported by this recipe (choose one of {sorted(ADAPTER_TYPES)})")
    try:
        return ADAPTER_TYPES[kind](task_type="CAUSAL_LM", **section)
    except TypeError as err:  # an unknown dataclass field
        raise ValueError(f"adapter ({kind}): {err}") from None


def build_trl_args(config_cls, section: dict[str, Any], output_dir: str):
    """A TRL config dataclass from the ``trainer`` section; unknown keys name themselves."""
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(f"trainer: unknown {config_cls.__name__} field(s) {unknown}")
    section = dict(section)
    if section.get("report_to") == "wandb":
        # offline unless the user chose otherwise; runs land next to the checkpoints
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", output_dir)
        os.environ.setdefault("WANDB_PROJECT", "preft")
    return config_cls(output_dir=output_dir, **section)


def check_keys(config: dict[str, Any], required: set[str], optional: set[str], where: str = "recipe") -> None:
    missing = sorted(required - set(config))
    unknown = sorted(set(config) - required - optional)
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown} (known: {sorted(required | optional)})")


def write_summary(output_dir: str, summary: dict[str, Any], started: float) -> Path:
    summary = dict(summary, wall_time_s=round(time.time() - started, 1))
    path = Path(output_dir) / "run_summary.json"
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return path


def train_log(log_history: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """``(step, value)`` pairs of one logged metric."""
    return [(entry["step"], entry[key]) for entry in log_history if key in entry]
