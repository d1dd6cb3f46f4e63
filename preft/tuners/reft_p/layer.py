"""ReFT-P layer: wraps a decoder layer and edits its output hidden state on prompt tokens."""

from __future__ import annotations

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from preft.context import CONTEXT_KWARG, PrefillTracker


def orthonormal_rows(matrix: torch.Tensor) -> torch.Tensor:
    """``R`` with orthonormal rows spanning the rows of ``matrix`` (rank x hidden), via QR."""
    q, _ = torch.linalg.qr(matrix.t().float())
    return q.t().to(matrix.dtype)


class LoReFT:
    """``delta = R^T (W h + b - R h)``; ``R = orthonormal_rows(reft_proj)`` (pyreft's LoReFT)."""

    @staticmethod
    def init(layer: "ReftLayer", adapter: str, init_weights: bool) -> None:
        proj, source = layer.reft_proj[adapter], layer.reft_source[adapter]
        nn.init.orthogonal_(proj.weight)
        if init_weights:  # W = R, b = 0: the edit starts as the identity
            with torch.no_grad():
                source.weight.copy_(orthonormal_rows(proj.weight))
                source.bias.zero_()

    @staticmethod
    def delta(layer: "ReftLayer", adapter: str, h: torch.Tensor) -> torch.Tensor:
        rotation = orthonormal_rows(layer.reft_proj[adapter].weight)
        edit = layer.reft_source[adapter](h) - h @ rotation.t()
        return edit @ rotation


class DiReFT:
    """``delta = W2^T (W1 h + b)``; ``W2 = reft_proj``, ``(W1, b) = reft_source``."""

    @staticmethod
    def init(layer: "ReftLayer", adapter: str, init_weights: bool) -> None:
        if init_weights:  # W2 = 0: the edit starts as the identity
            nn.init.zeros_(layer.reft_proj[adapter].weight)

    @staticmethod
    def delta(layer: "ReftLayer", adapter: str, h: torch.Tensor) -> torch.Tensor:
        return layer.reft_source[adapter](h) @ layer.reft_proj[adapter].weight


INTERVENTION_CLASSES = {"loreft": LoReFT, "direft": DiReFT}


class ReftLayer(nn.Module, BaseTunerLayer):
    """A decoder layer plus per-adapter interventions on its output hidden state.

    ``output = layer(h_in); h = output + mask(p) * delta(output)`` for each active adapter, with
    ``mask(p) = adapter_start <= p < P`` read from the prefill context of this forward; with
    ``adapter_names`` (PEFT's mixed-adapter batch, injected by the tuner's hooks) each row by its
    own adapter instead.
    """

    adapter_layer_names = ("reft_source", "reft_proj")
    other_param_names = ("rank", "intervention", "adapter_start", "prefill_only", "reft_dropout")

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, hidden_size: int,
                 prefill_tracker: PrefillTracker) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.hidden_size = hidden_size
        object.__setattr__(self, "prefill_tracker", prefill_tracker)
        self.reft_source = nn.ModuleDict()  # W h + b   (rank x hidden, with bias)
        self.reft_proj = nn.ModuleDict()    # R (LoReFT) or W2 (DiReFT), rank x hidden
        self.reft_dropout = nn.ModuleDict()
        self.rank: dict[str, int] = {}
        self.intervention: dict[str, str] = {}
        self.adapter_start: dict[str, int] = {}
        self.prefill_only: dict[str, bool] = {}
        self._disable_adapters = False
        self.merged_adapters = []
        self._active_adapter = adapter_name
        # PEFT's disable_input_dtype_casting switches this on every tuner layer; the edit casts the
        # hidden state to its own weights' dtype itself, so the flag has nothing to switch here
        self.cast_input_dtype_enabled: bool = True
        self.update_layer(adapter_name, config)

    def update_layer(self, adapter_name: str, config) -> None:
        self.__dict__.pop("_mixed_plan", None)  # the adapters changed: plan mixed batches again
        weight = self.get_base_layer_weight_example()
        self.rank[adapter_name] = config.rank
        self.intervention[adapter_name] = config.intervention
        self.adapter_start[adapter_name] = config.adapter_start
        self.prefill_only[adapter_name] = config.prefill_only
        self.reft_source[adapter_name] = nn.Linear(self.hidden_size, config.rank, bias=True)
        self.reft_proj[adapter_name] = nn.Linear(self.hidden_size, config.rank, bias=False)
        self.reft_dropout[adapter_name] = nn.Dropout(config.dropout) if config.dropout else nn.Identity()
        INTERVENTION_CLASSES[config.intervention].init(self, adapter_name, config.init_weights)
        if weight is not None:
            self.reft_source[adapter_name].to(device=weight.device)
            self.reft_proj[adapter_name].to(device=weight.device)
        self.set_adapter(self.active_adapters)

    def get_base_layer_weight_example(self) -> torch.Tensor | None:
        return next(self.base_layer.parameters(), None)

    def forward(self, *args, adapter_names: list[str] | None = None, **kwargs):
        context = kwargs.get(CONTEXT_KWARG)
        output = self.base_layer(*args, **kwargs)
        if self.disable_adapters:
            return output
        hidden = output[0] if isinstance(output, tuple) else output
        context = context or self.prefill_tracker.current
        if adapter_names is None:
            for adapter in self.active_adapters:
                if adapter in self.reft_source:
                    hidden = self._intervene(adapter, hidden, context)
        else:
            hidden = self._mixed_batch(hidden, adapter_names, context)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    def _mixed_batch(self, hidden: torch.Tensor, adapter_names: list[str], context) -> torch.Tensor:
        """PEFT's mixed-adapter batch: row ``i`` edited by ``adapter_names[i]`` alone (``"__base__"``:
        no edit), under the rule for that row (the module docstring's ``mask``)."""
        rows_of, used, prefill_only, starts = self.prefill_tracker.mixed_batch_plan(
            self, adapter_names, hidden.shape[0], hidden.device, self.reft_source)
        if context is not None and prefill_only and not any(context.any_active(start) for start in starts):
            return hidden  # no row in its prompt (a decode step)
        edited = hidden
        for name in used:
            index = rows_of[name]
            if edited is hidden:
                edited = hidden.clone()
            edited[index] = self._intervene(name, hidden[index], context, index)
        return edited

    def _intervene(self, adapter: str, hidden: torch.Tensor, context, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden`` edited by ``adapter`` on its active tokens; ``rows``: which rows of the
        forward's batch ``hidden`` holds (all when None)."""
        intervention = INTERVENTION_CLASSES[self.intervention[adapter]]
        h = self.reft_dropout[adapter](hidden).to(self.reft_source[adapter].weight.dtype)
        if not self.prefill_only[adapter]:
            return hidden + intervention.delta(self, adapter, h).to(hidden.dtype)
        if context is None:
            raise RuntimeError(
                "ReFT-P layer called outside a forward of its PEFT model: no prefill context"
            )
        mask = context.active_mask(self.adapter_start[adapter])
        mask = mask if rows is None else mask[rows]
        if tuple(mask.shape) != tuple(hidden.shape[:2]):
            raise RuntimeError(
                f"prefill mask {tuple(mask.shape)} does not match hidden state {tuple(hidden.shape)}"
            )
        if not bool(mask.any()):  # a decode step: nothing to edit
            return hidden
        delta = intervention.delta(self, adapter, h).to(hidden.dtype)
        return hidden + delta * mask.unsqueeze(-1).to(hidden.dtype)

    def delete_adapter(self, adapter_name: str, *args, **kwargs) -> None:
        self.__dict__.pop("_mixed_plan", None)
        super().delete_adapter(adapter_name, *args, **kwargs)

    def merge(self, *args, **kwargs) -> None:
        raise ValueError(
            "ReFT interventions edit hidden states and cannot be merged into weights; "
            "use unload() to drop them"
        )

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "base_layer":
                raise
            # transformers reads attributes such as `attention_type` off its decoder layers
            return getattr(self.base_layer, name)

    def __repr__(self) -> str:
        return "preft_reft." + super().__repr__()
