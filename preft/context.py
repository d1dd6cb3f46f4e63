"""The prefill context: which tokens of a batch are prompt tokens.

The one rule of PreFT (:mod:`preft.rule`): for a sequence with prompt length ``P`` and adapter
start ``s``, the adapter is active at absolute token position ``p`` iff ``s <= p < P``. Everything here keys on
*position* (never on "this forward is a prefill"), so teacher forcing, HF ``generate`` and a
manual decode loop agree token for token.

Per forward of a PEFT model, :class:`PrefillTracker` (installed by the PreFT tuners as hooks
on the wrapped transformers model) builds a :class:`PrefillContext`:

- ``positions`` ``[B, T]``: the absolute position of each input token in its own sequence,
  taken from ``position_ids``, else from the attention mask (left or right padding), else
  ``cache length + offset``.
- ``prompt_lengths`` ``[B]``: ``P`` per row, from the first of
  1. an explicit ``prompt_lengths=`` keyword of the forward (int, list or tensor);
  2. ``labels``: the position of the first label != -100 (TRL's completion mask);
  3. the KV cache: a forward that continues a cache this tracker saw being filled reuses that
     cache's ``P`` (this is how ``generate``'s decode steps see ``p >= P``);
  4. otherwise every real token of the input is a prompt token (a prefill).

The context reaches the adapter layers through :attr:`PrefillTracker.current` and, for models
whose forward forwards ``**kwargs`` to the decoder layers (Llama, Qwen2, ...), as the
``preft_context`` keyword of each decoder-layer call. The second route is what keeps the mask
right under gradient checkpointing: the checkpoint replays the layer call with the same
keywords during ``backward()``, so the recomputed layer sees its own forward's context even if
other forwards ran in between.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from preft.rule import is_active

IGNORE_INDEX = -100
CONTEXT_KWARG = "preft_context"


@dataclass
class PrefillContext:
    """Per-forward batch facts: token positions and per-row prompt lengths.

    ``prompt_lengths`` is ``None`` when the whole input is prompt (a plain prefill).

    >>> ctx = PrefillContext(positions=torch.tensor([[0, 1, 2, 3]]), prompt_lengths=torch.tensor([3]))
    >>> ctx.active_mask(adapter_start=1).tolist()
    [[False, True, True, False]]
    """

    positions: torch.Tensor
    prompt_lengths: torch.Tensor | None
    _masks: dict[Any, torch.Tensor] = field(default_factory=dict, repr=False)

    def active_mask(self, adapter_start: int = 0) -> torch.Tensor:
        """``[B, T]`` bool: True where ``adapter_start <= position < P`` (:func:`preft.rule.is_active`)."""
        if adapter_start not in self._masks:
            everything = torch.iinfo(self.positions.dtype).max  # no P: the whole input is prompt
            prompt_lengths = everything if self.prompt_lengths is None else self.prompt_lengths[:, None]
            self._masks[adapter_start] = is_active(self.positions, prompt_lengths, adapter_start)
        return self._masks[adapter_start]

    def any_active(self, adapter_start: int = 0) -> bool:
        """Whether any token of this forward is active (cached: a decode step asks once per layer)."""
        key = ("any", adapter_start)
        if key not in self._masks:
            self._masks[key] = bool(self.active_mask(adapter_start).any())
        return self._masks[key]

    def weights(self, adapter_start: int, dtype: torch.dtype) -> torch.Tensor:
        """``active_mask`` as ``[B, T, 1]`` of ``dtype`` (cached: every adapter layer multiplies by it)."""
        key = (adapter_start, dtype)
        if key not in self._masks:
            self._masks[key] = self.active_mask(adapter_start).unsqueeze(-1).to(dtype)
        return self._masks[key]


def _as_lengths(value: Any, batch_size: int, device: torch.device) -> torch.Tensor:
    lengths = torch.as_tensor(value, dtype=torch.long, device=device).reshape(-1)
    if lengths.numel() == 1:
        lengths = lengths.expand(batch_size)
    if lengths.numel() != batch_size:
        raise ValueError(
            f"prompt_lengths has {lengths.numel()} entries but the batch has {batch_size} rows"
        )
    if (lengths < 0).any():
        raise ValueError(f"prompt_lengths must be >= 0, got {lengths.tolist()}")
    return lengths


def prompt_lengths_from_labels(labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                               positions: torch.Tensor | None = None) -> torch.Tensor:
    """``P`` per row: the absolute position of the first label != -100 (TRL's layout).

    Positions count real tokens (``attention_mask``) unless given, so left and right padding
    both work; a row without any completion label is all prompt.
    """
    real = torch.ones_like(labels, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if positions is None:
        positions = real.long().cumsum(-1) - 1
    is_completion = (labels != IGNORE_INDEX) & real
    first = is_completion.int().argmax(dim=1)
    at_first = positions.gather(1, first[:, None]).squeeze(1)
    all_prompt = positions.masked_fill(~real, -1).amax(dim=1) + 1
    return torch.where(is_completion.any(dim=1), at_first, all_prompt)


def _cache_length(past_key_values: Any) -> int:
    if past_key_values is None:
        return 0
    if hasattr(past_key_values, "get_seq_length"):
        return int(past_key_values.get_seq_length())
    return int(past_key_values[0][0].shape[-2])  # legacy tuple-of-tuples cache


class PrefillTracker:
    """Builds a :class:`PrefillContext` for every forward of one transformers model.

    Installed once per PEFT model by the PreFT tuners (:meth:`install`); adapter layers read
    :attr:`current`.
    """

    def __init__(self) -> None:
        self.current: PrefillContext | None = None
        # cache object -> P of the sequences it holds (weak: caches die with their generate call)
        self._cache_prompt_lengths: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._forwards_kwargs = False
        self._warned_no_prompt = False
        self._rows: tuple[Any, dict[str, torch.Tensor]] | None = None  # ((names, device), name -> its rows)

    # ---------------------------------------------------------------- hooks
    def install(self, model: nn.Module) -> None:
        """Hook ``model`` (the transformers model) and its gradient-checkpointing layers."""
        if self._handles:
            return
        self._forwards_kwargs = any(
            p.kind is inspect.Parameter.VAR_KEYWORD
            for p in inspect.signature(model.forward).parameters.values()
        )
        self._handles.append(model.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._after_forward, with_kwargs=True))
        from transformers.modeling_layers import GradientCheckpointingLayer

        for module in model.modules():
            if isinstance(module, GradientCheckpointingLayer):
                self._handles.append(
                    module.register_forward_pre_hook(self._before_layer, with_kwargs=True)
                )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.current = None

    def _before_layer(self, module, args, kwargs):
        context = kwargs.pop(CONTEXT_KWARG, None)
        if context is not None:
            self.current = context
        return args, kwargs

    def _before_forward(self, module, args, kwargs):
        kwargs = dict(kwargs)
        explicit = kwargs.pop("prompt_lengths", None)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        reference = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        if reference is None:
            raise ValueError("PreFT needs input_ids or inputs_embeds to place the prefill mask")
        batch_size, length = reference.shape[0], reference.shape[1]
        device = reference.device
        past = kwargs.get("past_key_values")
        positions, real = self._positions(kwargs, batch_size, length, _cache_length(past), device)

        if explicit is not None:
            prompt_lengths = _as_lengths(explicit, batch_size, device)
        elif kwargs.get("labels") is not None:
            prompt_lengths = self._prompt_lengths_from_labels(kwargs["labels"], positions, real)
        elif past is not None and past in self._cache_prompt_lengths and _cache_length(past) > 0:
            prompt_lengths = self._cache_prompt_lengths[past]
            if prompt_lengths.shape[0] != batch_size:
                raise ValueError(
                    f"the KV cache was filled for {prompt_lengths.shape[0]} rows, this forward has {batch_size}"
                )
        else:  # a prefill: every real token is a prompt token
            prompt_lengths = positions.masked_fill(~real, -1).amax(dim=1) + 1

        self.current = PrefillContext(positions=positions, prompt_lengths=prompt_lengths)
        if self._forwards_kwargs:
            kwargs[CONTEXT_KWARG] = self.current
        return args, kwargs

    def _after_forward(self, module, args, kwargs, output):
        cache = getattr(output, "past_key_values", None)
        if cache is not None and self.current is not None:
            self._cache_prompt_lengths[cache] = self.current.prompt_lengths
        return output

    def rows_by_adapter(self, adapter_names: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        """``name -> the rows it is on`` of a mixed-adapter batch (PEFT's ``adapter_names``), built
        once for a run of forwards with the same names (every layer of every step of a ``generate``)."""
        key = (tuple(adapter_names), device)
        if self._rows is None or self._rows[0] != key:
            rows: dict[str, list[int]] = {}
            for row, name in enumerate(adapter_names):
                rows.setdefault(name, []).append(row)
            self._rows = (key, {name: torch.tensor(r, device=device) for name, r in rows.items()})
        return self._rows[1]

    def mixed_batch_plan(self, layer: nn.Module, adapter_names: list[str], batch_size: int, device: torch.device,
                         adapters) -> tuple[dict[str, torch.Tensor], list[str], bool, set[int]]:
        """For one PreFT layer (``adapter_start`` and ``prefill_only`` per adapter; ``adapters``: the
        names it holds) and a mixed-adapter batch: ``(rows by adapter, the adapters of the batch this
        layer has, whether all are prefill-only, their adapter starts)``. Kept on the layer until
        the names change (the layer drops it when its adapters change), so a decode step costs a
        lookup. ``"__base__"`` and adapters the layer lacks leave their rows to the base output."""
        if len(adapter_names) != batch_size:
            raise ValueError(f"adapter_names has {len(adapter_names)} entries but the batch has {batch_size} rows")
        rows_of = self.rows_by_adapter(adapter_names, device)
        plan = layer.__dict__.get("_mixed_plan")
        if plan is None or plan[0] is not rows_of:
            used = [name for name in rows_of if name in adapters]
            plan = (rows_of, used, all(layer.prefill_only[n] for n in used), {layer.adapter_start[n] for n in used})
            object.__setattr__(layer, "_mixed_plan", plan)
        return plan

    # -------------------------------------------------------------- helpers
    @staticmethod
    def _positions(kwargs, batch_size, length, past_length, device):
        """Absolute positions ``[B, T]`` and a ``[B, T]`` mask of real (non-pad) tokens."""
        attention_mask = kwargs.get("attention_mask")
        real = torch.ones(batch_size, length, dtype=torch.bool, device=device)
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            real = attention_mask[:, -length:].bool()
        position_ids = kwargs.get("position_ids")
        if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2:
            return position_ids.expand(batch_size, length).long(), real
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            counted = attention_mask.long().cumsum(-1) - 1
            # an attention mask covering only the new tokens continues after the cache
            offset = past_length if attention_mask.shape[1] == length else 0
            return (counted[:, -length:] + offset).clamp(min=0), real
        positions = torch.arange(past_length, past_length + length, device=device)
        return positions.expand(batch_size, length), real

    def _prompt_lengths_from_labels(self, labels, positions, real):
        prompt_lengths = prompt_lengths_from_labels(labels, real, positions)
        if not self._warned_no_prompt and bool((prompt_lengths == 0).all()):
            self._warned_no_prompt = True
            warnings.warn(
                "PreFT: every row's first label is a real token, so no row has prompt tokens and "
                "a prefill-only adapter is inactive. Mask the prompt in `labels` with -100 or pass "
                "`prompt_lengths=`.",
                stacklevel=2,
            )
        return prompt_lengths
