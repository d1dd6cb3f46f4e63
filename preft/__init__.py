"""PreFT: prefill-only finetuning. Adapters touch prompt tokens only; decoding runs the base model.

>>> import preft
>>> from peft import get_peft_model
>>> from transformers import AutoModelForCausalLM
>>> model = get_peft_model(AutoModelForCausalLM.from_pretrained(preft.DEFAULT_BASE_MODEL),
...                        preft.PreftLoraConfig(r=8))
"""

from __future__ import annotations

from pathlib import Path

from preft import source_tree

source_tree.install()  # preft.eval, .serving, .kernels, .recipes from a source tree on PYTHONPATH

from preft import data  # noqa: E402
from preft.context import PrefillContext, PrefillTracker  # noqa: E402
from preft.registration import register_with_peft  # noqa: E402
from preft.tuners import PREFT_LORA, PREFT_REFT, PreftLoraConfig, PreftLoraModel, PreftReftConfig, PreftReftModel

__version__ = "0.1.0"

#: Path of the embedded default base model (a small Llama built by recipes/pretrain_base.py).
DEFAULT_BASE_MODEL = str(Path(__file__).parent / "default_base")

register_with_peft()

_TRAINERS = ("PreftSFTTrainer", "PreftGRPOTrainer")


def __getattr__(name: str):
    """``preft.PreftSFTTrainer`` / ``preft.PreftGRPOTrainer``, imported on first use (TRL is slow
    to import, and serving processes never need it)."""
    if name in _TRAINERS:
        from preft import trainers

        return getattr(trainers, name)
    raise AttributeError(f"module 'preft' has no attribute {name!r}")


__all__ = [
    "DEFAULT_BASE_MODEL", "data", "PREFT_LORA", "PREFT_REFT", "PrefillContext", "PrefillTracker",
    "PreftLoraConfig", "PreftLoraModel", "PreftReftConfig", "PreftReftModel", *_TRAINERS,
]
