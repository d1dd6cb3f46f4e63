"""Configuration of prefill-only LoRA (LoRA-P)."""

from __future__ import annotations

from dataclasses import dataclass, field

from peft import LoraConfig

PREFT_LORA = "PREFT_LORA"

# LoRA variants whose forward replaces the plain ``B(A(x))`` update: PreFT masks that update
# per token, so these would silently lose the mask. Refused by name.
_UNSUPPORTED_LORA_FIELDS = (
    "use_dora", "alora_invocation_tokens", "arrow_config", "use_bdlora", "velora_config",
    "monteclora_config", "mica", "kasa_config", "layer_replication",
)


@dataclass
class PreftLoraConfig(LoraConfig):
    """LoRA-P: ``y = W x + mask(p) * (alpha/r) * B A x``, ``mask(p) = adapter_start <= p < P``.

    Every :class:`peft.LoraConfig` field works as in PEFT (``r``, ``lora_alpha``,
    ``target_modules``, ``lora_dropout``, ``init_lora_weights``, ...). The adapter touches prompt
    tokens only; generated tokens run the base model (PreFT, arXiv 2605.14217).

    Example::

        >>> import preft
        >>> from peft import get_peft_model
        >>> from transformers import AutoModelForCausalLM
        >>> base = AutoModelForCausalLM.from_pretrained(preft.DEFAULT_BASE_MODEL)
        >>> model = get_peft_model(base, preft.PreftLoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
        >>> model.peft_config["default"].peft_type
        'PREFT_LORA'
    """

    adapter_start: int = field(
        default=0,
        metadata={"help": "First absolute token position the adapter touches; it is active at "
                          "positions adapter_start <= p < prompt length."},
    )
    prefill_only: bool = field(
        default=True,
        metadata={"help": "True: prompt tokens only (PreFT). False: every token, i.e. standard "
                          "LoRA through the same code (the baseline the eval harness compares)."},
    )

    def __post_init__(self):
        if self.peft_type not in (None, PREFT_LORA):
            raise ValueError(
                f"PreftLoraConfig.peft_type must be {PREFT_LORA!r} (or unset), got {self.peft_type!r}; "
                "use peft.LoraConfig for plain LoRA"
            )
        if not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"PreftLoraConfig.r must be a positive integer, got {self.r!r}")
        if not isinstance(self.adapter_start, int) or self.adapter_start < 0:
            raise ValueError(
                f"PreftLoraConfig.adapter_start must be an integer >= 0, got {self.adapter_start!r}"
            )
        for name in _UNSUPPORTED_LORA_FIELDS:
            if getattr(self, name, None):
                raise ValueError(
                    f"PreftLoraConfig.{name} is not supported: that LoRA variant replaces the update "
                    "the prefill mask applies to. Use plain LoRA fields (r, lora_alpha, ...)."
                )
        super().__post_init__()
        self.peft_type = PREFT_LORA
