"""Input checks shared by the PreFT trainers and recipes: one clear error per problem."""

from __future__ import annotations

import logging
from pathlib import Path

from peft import PeftConfig, PeftModel

from preft.families import FAMILIES, model_load_kwargs
from preft.tuners import PREFT_LORA, PREFT_REFT

logger = logging.getLogger(__name__)

#: PEFT types the trainers accept: the two PreFT methods and plain LoRA (the all-token baseline).
SUPPORTED_PEFT_TYPES = (PREFT_LORA, PREFT_REFT, "LORA")


def peft_config_of(model, peft_config: PeftConfig | None) -> PeftConfig:
    """The adapter config the trainer will train, refused unless it is a supported type."""
    if peft_config is None and isinstance(model, PeftModel):
        peft_config = model.active_peft_config
    if peft_config is None:
        raise ValueError(
            "PreFT trainers train adapters: pass peft_config= (PreftLoraConfig, PreftReftConfig, "
            "or peft.LoraConfig for the all-token baseline)"
        )
    peft_type = str(getattr(peft_config.peft_type, "value", peft_config.peft_type))
    if peft_type not in SUPPORTED_PEFT_TYPES:
        raise ValueError(
            f"unsupported PEFT type {peft_type!r}: the PreFT trainers support {', '.join(SUPPORTED_PEFT_TYPES)}"
        )
    return peft_config


def is_prefill_only(peft_config: PeftConfig) -> bool:
    return bool(getattr(peft_config, "prefill_only", False))


def check_model_path(model) -> None:
    """A model given as a path must be a local directory with a config.json (no hub downloads)."""
    if isinstance(model, (str, Path)):
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ValueError(f"model path {str(model)!r} does not exist or has no config.json")


def load_as_served(model, args) -> None:
    """A model given as a path loads with its family's attention (:func:`preft.families.model_load_kwargs`:
    eager for Gemma 2, whose soft-capping transformers' SDPA path drops), so the adapter is trained
    on the model vLLM serves; the user's own ``model_init_kwargs`` win. A loaded model that would
    compute another attention is told once in the log."""
    if isinstance(model, (str, Path)):
        wanted = model_load_kwargs(model)
        if wanted:
            args.model_init_kwargs = {**wanted, **(args.model_init_kwargs or {})}
        return
    config = getattr(model, "config", None)
    family = FAMILIES.get(getattr(config, "model_type", "") or "")
    used = getattr(config, "_attn_implementation", None)
    if family and family.attn_implementation and used != family.attn_implementation:
        logger.warning("this %s model computes attention with %r; vLLM serves it as transformers' %r does "
                       "(load it with attn_implementation=%r to train the model that is served)",
                       family.model_type, used, family.attn_implementation, family.attn_implementation)


def check_dataset(dataset, columns: tuple[str, ...], name: str) -> None:
    """Refuse a missing or empty data set, missing columns, and empty completions."""
    if dataset is None:
        return
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty")
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"{name} is missing column(s) {missing}; it has {dataset.column_names} (expected {list(columns)})"
        )
    if "completion" in columns:
        for index, completion in enumerate(dataset["completion"]):
            text = completion if isinstance(completion, str) else " ".join(
                str(m.get("content", "")) for m in completion
            )
            if not text.strip():
                raise ValueError(f"{name} row {index} has a prompt with no completion")
