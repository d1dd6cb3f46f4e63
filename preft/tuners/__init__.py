"""PreFT tuners, one folder per method (PEFT layout): config.py, layer.py, model.py."""

from .lora_p import PREFT_LORA, PreftLoraConfig, PreftLoraModel
from .reft_p import PREFT_REFT, PreftReftConfig, PreftReftModel

__all__ = ["PREFT_LORA", "PREFT_REFT", "PreftLoraConfig", "PreftLoraModel", "PreftReftConfig", "PreftReftModel"]
