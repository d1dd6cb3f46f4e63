"""Register the PreFT methods with PEFT (runs on ``import preft``).

PEFT resolves a method from the ``peft_type`` string through three tables; adding our entries
makes ``get_peft_model``, ``PeftConfig.from_pretrained`` and ``PeftModel.from_pretrained`` work
for ``PREFT_LORA`` and ``PREFT_REFT`` without patching PEFT itself.
"""

from __future__ import annotations

from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_PREFIX_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING

from preft.tuners import PREFT_LORA, PREFT_REFT, PreftLoraConfig, PreftLoraModel, PreftReftConfig, PreftReftModel

METHODS = {
    PREFT_LORA: (PreftLoraConfig, PreftLoraModel),
    PREFT_REFT: (PreftReftConfig, PreftReftModel),
}


def register_with_peft() -> None:
    """Idempotently add the PreFT methods to PEFT's type tables."""
    for peft_type, (config_cls, model_cls) in METHODS.items():
        PEFT_TYPE_TO_CONFIG_MAPPING[peft_type] = config_cls
        PEFT_TYPE_TO_TUNER_MAPPING[peft_type] = model_cls
        PEFT_TYPE_TO_PREFIX_MAPPING[peft_type] = model_cls.prefix
