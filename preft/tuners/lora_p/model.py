"""LoRA-P tuner: PEFT's ``LoraModel`` with prefill-masked layers and a prefill tracker."""

from __future__ import annotations

import torch
from peft.tuners.lora import LoraModel
from peft.tuners.tuners_utils import BaseTunerLayer

from preft.context import PrefillTracker

from .layer import PreftLinear


class PreftLoraModel(LoraModel):
    """Creates a LoRA-P model: LoRA on ``target_modules``, active on prompt tokens only.

    Registered with PEFT for ``peft_type="PREFT_LORA"``, so ``get_peft_model(model,
    PreftLoraConfig(...))`` builds it. Saved weights use LoRA's names (``lora_A``/``lora_B``).
    Mixed-adapter batches work as in PEFT (``model.generate(..., adapter_names=[...])``, one
    adapter per row, ``"__base__"`` for none): each row's adapter on its own prompt tokens
    (:meth:`PreftLinear._mixed_batch_forward`), PEFT's hooks checking the names.

    Example::

        >>> import preft, torch
        >>> from peft import get_peft_model
        >>> from transformers import AutoModelForCausalLM, AutoTokenizer
        >>> tok = AutoTokenizer.from_pretrained(preft.DEFAULT_BASE_MODEL)
        >>> base = AutoModelForCausalLM.from_pretrained(preft.DEFAULT_BASE_MODEL)
        >>> model = get_peft_model(base, preft.PreftLoraConfig(r=8))
        >>> out = model.generate(**tok(["add 2 3 ="], return_tensors="pt"), max_new_tokens=3)
    """

    prefix: str = "lora_"

    def __init__(self, model, config, adapter_name, **kwargs):
        object.__setattr__(self, "prefill_tracker", PrefillTracker())
        super().__init__(model, config, adapter_name, **kwargs)
        self.prefill_tracker.install(self.model)

    def _create_new_module(self, lora_config, adapter_name, target, **kwargs):
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if not isinstance(base, torch.nn.Linear):
            raise ValueError(
                f"PreFT LoRA supports torch.nn.Linear target modules only; got {type(base).__name__} "
                f"(target_name={kwargs.get('target_name')!r}). Adjust target_modules."
            )
        for key in ("device_map", "parameter_name"):
            kwargs.pop(key, None)
        return PreftLinear(target, adapter_name, self.prefill_tracker, config=lora_config, **kwargs)

    def _check_merge_allowed(self):
        prefill_only = [name for name, cfg in self.peft_config.items() if getattr(cfg, "prefill_only", False)]
        if prefill_only:
            raise ValueError(
                f"cannot merge PreFT adapter(s) {prefill_only}: they are prefill-only, and merged "
                "weights would apply them to every token, including generated ones. Use unload() "
                "to drop them, or serve them with `preft serve`."
            )
        super()._check_merge_allowed()

    def _unload_and_optionally_merge(self, merge=True, *args, **kwargs):
        if merge:
            self._check_merge_allowed()
        model = super()._unload_and_optionally_merge(merge, *args, **kwargs)
        self.prefill_tracker.remove()
        return model
