"""ReFT-P tuner: wraps the chosen decoder layers of a transformers model."""

from __future__ import annotations

from contextlib import contextmanager

from peft.tuners.tuners_utils import BaseTuner
from torch import nn

from preft.context import PrefillTracker

from .layer import ReftLayer


def decoder_layer_names(model: nn.Module) -> list[str]:
    """Module names of the decoder blocks (the ``*.layers`` ModuleList of a HF decoder)."""
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] in ("layers", "h") and (
            num_layers is None or len(module) == num_layers
        ):
            return [f"{name}.{i}" for i in range(len(module))]
    raise ValueError(
        f"could not find the decoder layers of {type(model).__name__}: ReFT-P expects a "
        "transformers decoder with a `layers` ModuleList (Llama, Qwen2, Mistral, ...)"
    )


class PreftReftModel(BaseTuner):
    """Creates a ReFT-P model (LoReFT-P or DiReFT-P) from a transformers decoder.

    Registered with PEFT for ``peft_type="PREFT_REFT"``: ``get_peft_model``,
    ``save_pretrained`` and ``PeftModel.from_pretrained`` work as for any PEFT method.

    Example::

        >>> import preft
        >>> from peft import get_peft_model
        >>> from transformers import AutoModelForCausalLM
        >>> base = AutoModelForCausalLM.from_pretrained(preft.DEFAULT_BASE_MODEL)
        >>> model = get_peft_model(base, preft.PreftReftConfig(rank=4, intervention="direft"))
        >>> model.print_trainable_parameters()  # doctest: +SKIP
    """

    prefix: str = "reft_"
    tuner_layer_cls = ReftLayer
    target_module_mapping: dict = {}

    def __init__(self, model, config, adapter_name, **kwargs):
        object.__setattr__(self, "prefill_tracker", PrefillTracker())
        super().__init__(model, config, adapter_name, **kwargs)
        self.prefill_tracker.install(self.model)

    def _prepare_adapter_config(self, peft_config, model_config):
        num_layers = model_config.get("num_hidden_layers")
        if peft_config.layers is not None and num_layers is not None:
            bad = [i for i in peft_config.layers if i >= num_layers]
            if bad:
                raise ValueError(
                    f"PreftReftConfig.layers {bad} out of range: the model has {num_layers} decoder "
                    f"layers (valid indices 0..{num_layers - 1})"
                )
        names = decoder_layer_names(self.model)
        selected = range(len(names)) if peft_config.layers is None else peft_config.layers
        peft_config.target_modules = [names[i] for i in selected]
        return peft_config

    def _check_target_module_exists(self, peft_config, key: str) -> bool:
        return key in peft_config.target_modules

    def _create_and_replace(self, peft_config, adapter_name, target, target_name, parent, current_key):
        if isinstance(target, ReftLayer):
            target.update_layer(adapter_name, peft_config)
            return
        hidden_size = self.model.config.hidden_size
        new_module = ReftLayer(target, adapter_name, peft_config, hidden_size, self.prefill_tracker)
        if adapter_name not in self.active_adapters:
            new_module.requires_grad_(False)
        self._replace_module(parent, target_name, new_module, target)

    def _replace_module(self, parent, child_name, new_module, child):
        setattr(parent, child_name, new_module)
        if not isinstance(child, ReftLayer):  # keep the adapter weights on the layer's device
            weight = next(child.parameters(), None)
            if weight is not None:
                for name, module in new_module.named_modules():
                    if self.prefix in name:
                        module.to(weight.device)

    @contextmanager
    def _enable_peft_forward_hooks(self, *args, **kwargs):
        """PEFT's mixed-adapter batch (``adapter_names=``, one adapter per row, ``"__base__"`` for
        none) for ``forward`` and ``generate``, checked as PEFT checks LoRA's: inference only,
        every name an adapter of this model; repeated per beam under beam search. Each ReFT-P
        layer gets the names as a keyword (:meth:`ReftLayer._mixed_batch`)."""
        adapter_names = kwargs.get("adapter_names")
        if adapter_names is None:
            yield
            return
        if self.training:
            raise ValueError("Cannot pass `adapter_names` when the model is in training mode.")
        if isinstance(adapter_names, str) or not all(isinstance(name, str) for name in adapter_names):
            raise TypeError(f"adapter_names must be a list of adapter names (str), one per row; got {adapter_names!r}")
        layers = [module for module in self.model.modules() if isinstance(module, ReftLayer)]
        known = {name for layer in layers for name in layer.reft_source}
        unknown = sorted({name for name in adapter_names if name != "__base__"} - known)
        if unknown:
            raise ValueError(f"Trying to infer with non-existing adapter(s): {', '.join(unknown)} "
                             f"(this model has {', '.join(sorted(known))}; '__base__' for none)")
        beams = kwargs.get("num_beams")
        if isinstance(beams, int) and beams > 1:
            adapter_names = [name for name in adapter_names for _ in range(beams)]

        def inject(module, args, layer_kwargs):
            layer_kwargs["adapter_names"] = adapter_names
            return args, layer_kwargs
        handles = [layer.register_forward_pre_hook(inject, with_kwargs=True) for layer in layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _check_merge_allowed(self):
        raise ValueError(
            "ReFT-P adapters cannot be merged into the base weights (they edit hidden states, and "
            "prefill-only ones touch prompt tokens only); use unload() to drop them"
        )

    def _unload_and_optionally_merge(self, merge=True, progressbar=False, safe_merge=False, adapter_names=None):
        if merge:
            self._check_merge_allowed()
        for name in decoder_layer_names(self.model):
            parent_name, _, child_name = name.rpartition(".")
            parent = self.model.get_submodule(parent_name)
            child = getattr(parent, child_name)
            if isinstance(child, ReftLayer):
                setattr(parent, child_name, child.get_base_layer())
        self.prefill_tracker.remove()
        if hasattr(self.model, "peft_config"):
            del self.model.peft_config
        return self.model
