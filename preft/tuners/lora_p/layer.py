"""LoRA-P layer: PEFT's LoRA ``Linear`` whose update is masked per token by position."""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear, LoraLayer, LoraVariant

from preft.context import PrefillTracker


class PrefillOnlyLinearVariant(LoraVariant):
    """``result + B(mask * (alpha/r) * A(dropout(x)))`` with ``mask`` from the prefill context.

    Picked for every adapter of a :class:`PreftLinear` (the PEFT ``LoraVariant`` mechanism, as
    DoRA and aLoRA use). Tokens outside ``[adapter_start, P)`` get exactly the base output; a
    forward with no active token (a decode step) skips the LoRA matmuls. The per-token mask and
    the scale multiply the rank-r intermediate, not the output: ``B`` is linear, so
    ``B(m * A x) = m * B(A x)``, at ``r / out_features`` of the cost.
    """

    @staticmethod
    def init(module: "PreftLinear", adapter_name: str, config=None, **kwargs) -> None:
        module.adapter_start[adapter_name] = config.adapter_start
        module.prefill_only[adapter_name] = config.prefill_only

    @staticmethod
    def forward(module: "PreftLinear", active_adapter: str, x: torch.Tensor, result: torch.Tensor,
                **kwargs) -> torch.Tensor:
        lora_A, lora_B = module.lora_A[active_adapter], module.lora_B[active_adapter]
        dropout, scaling = module.lora_dropout[active_adapter], module.scaling[active_adapter]
        if not module.prefill_only[active_adapter]:
            return result + lora_B(lora_A(dropout(x))) * scaling
        mask = module.token_mask(active_adapter, x)
        if not bool(mask.any()):
            return result
        context = module.prefill_tracker.current
        weights = context.weights(module.adapter_start[active_adapter], x.dtype)
        return result + lora_B(lora_A(dropout(x)) * (weights * scaling))

    # Merging is plain LoRA for all-token adapters and refused for prefill-only ones: merged
    # weights would apply the adapter to every token, including generated ones.
    @staticmethod
    def _delta_weight(module: "PreftLinear", active_adapter: str) -> torch.Tensor:
        if module.prefill_only[active_adapter]:
            raise ValueError(
                f"prefill-only LoRA adapter {active_adapter!r} cannot be merged into the base "
                "weights: merged weights apply it to every token, including generated ones. Serve "
                "it with `preft serve`, or train with prefill_only=False for an all-token adapter."
            )
        return module.get_delta_weight(active_adapter)

    @staticmethod
    def merge_safe(module, active_adapter, orig_weight):
        return orig_weight + PrefillOnlyLinearVariant._delta_weight(module, active_adapter).to(orig_weight.dtype)

    @staticmethod
    def merge_unsafe(module, active_adapter, orig_weight):
        orig_weight.data += PrefillOnlyLinearVariant._delta_weight(module, active_adapter).to(orig_weight.dtype)

    @staticmethod
    def unmerge(module, active_adapter, orig_weight):
        return orig_weight - PrefillOnlyLinearVariant._delta_weight(module, active_adapter).to(orig_weight.dtype)


class PreftLinear(Linear):
    """A LoRA ``Linear`` whose adapters read the prefill mask of the current forward."""

    def __init__(self, base_layer, adapter_name: str, prefill_tracker: PrefillTracker, **kwargs):
        # set before Linear.__init__, which initialises the first adapter through the variant
        object.__setattr__(self, "prefill_tracker", prefill_tracker)
        object.__setattr__(self, "adapter_start", {})
        object.__setattr__(self, "prefill_only", {})
        super().__init__(base_layer, adapter_name, **kwargs)

    @property
    def lora_variants(self):
        return {(): PrefillOnlyLinearVariant}

    def token_mask(self, adapter_name: str, x: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` bool mask of the tokens ``adapter_name`` is active on in this forward."""
        context = self.prefill_tracker.current
        if context is None:
            raise RuntimeError(
                "PreFT layer called outside a forward of its PEFT model: no prefill context. "
                "Call the PEFT model (or its base model), not a layer on its own."
            )
        mask = context.active_mask(self.adapter_start[adapter_name])
        if tuple(mask.shape) != tuple(x.shape[:2]):
            raise RuntimeError(
                f"prefill mask of shape {tuple(mask.shape)} does not match layer input "
                f"{tuple(x.shape)}: PreFT expects [batch, tokens, features] inputs"
            )
        return mask

    def _mixed_batch_forward(self, x: torch.Tensor, *args, adapter_names: list[str], **kwargs) -> torch.Tensor:
        """PEFT's mixed-adapter batch (``adapter_names``, one adapter per row; ``"__base__"`` for
        none) under the rule: row ``i``'s adapter adds ``B(m_i * (alpha/r) * A x_i)`` with ``m_i``
        that row's prefill mask, so a decode step (no row in its prompt) runs the base model
        alone and an all-token adapter (``prefill_only=False``) every token, as PEFT's LoRA does."""
        for key in ("alora_offsets",):  # PEFT's variant keywords: not the base layer's
            kwargs.pop(key, None)
        result = self.base_layer(x, *args, **kwargs)
        rows_of, used, prefill_only, starts = self.prefill_tracker.mixed_batch_plan(
            self, adapter_names, x.shape[0], x.device, self.lora_A)
        if used:
            self.token_mask(used[0], x)  # fails loudly outside a PEFT forward or on a shape mismatch
        context = self.prefill_tracker.current
        if prefill_only and not any(context.any_active(start) for start in starts):
            return result  # no row in its prompt (a decode step): the base model for the whole batch
        for name in used:
            lora_A, lora_B = self.lora_A[name], self.lora_B[name]
            index, scale = rows_of[name], self.scaling[name]
            if self.prefill_only[name]:
                weights = self.token_mask(name, x)[index]
                if not bool(weights.any()):
                    continue
                scale = weights.unsqueeze(-1).to(lora_A.weight.dtype) * scale
            delta = lora_B(lora_A(self.lora_dropout[name](x[index].to(lora_A.weight.dtype))) * scale)
            result[index] += delta.to(result.dtype)
        return result

    def update_layer(self, adapter_name, *args, **kwargs):
        self.__dict__.pop("_mixed_plan", None)  # the adapters changed: plan mixed batches again
        return super().update_layer(adapter_name, *args, **kwargs)

    def delete_adapter(self, adapter_name: str) -> None:
        self.__dict__.pop("_mixed_plan", None)
        super().delete_adapter(adapter_name)
        self.adapter_start.pop(adapter_name, None)
        self.prefill_only.pop(adapter_name, None)

    def __repr__(self) -> str:
        return "preft_" + super().__repr__()


__all__ = ["LoraLayer", "PreftLinear", "PrefillOnlyLinearVariant"]
