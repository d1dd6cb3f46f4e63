"""LoRA-P: LoRA applied to prompt (prefill) tokens only."""

from .config import PREFT_LORA, PreftLoraConfig
from .layer import PreftLinear, PrefillOnlyLinearVariant
from .model import PreftLoraModel

__all__ = ["PREFT_LORA", "PreftLoraConfig", "PreftLinear", "PrefillOnlyLinearVariant", "PreftLoraModel"]
