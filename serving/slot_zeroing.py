"""Adapter slot writes without zeroing what is zero already or about to be overwritten.

vLLM activates an adapter in slot ``i`` of every LoRA layer with ``set_lora(i, A, B)``, which
zeroes the slot first (``reset_lora(i)``) and then copies ``A`` and ``B`` into its leading
``[:rank, :in]`` and ``[:out, :rank]`` corner; a layer the adapter does not touch (the
``lm_head``, for every PreFT adapter) gets ``reset_lora(i)`` alone. With 1,024 users on 8 slots
every prefill step activates up to 8 adapters, and that zeroing moved as many bytes as the
copies (a py-spy profile of such a run: ~25 ms a step on SmolLM2, rank 8). Two cases need none:

- **the slot is zero already**: ``reset_lora(i)`` again, with nothing written to the layer's
  stacked tensors since its last real reset (their version counters unchanged: any write, by
  anyone, makes the next reset a real one);
- **the write fills the slot**: ``set_lora(i, A, B)`` where every slice's ``A`` and ``B`` have
  the slot's full shape (an adapter of the engine's ``--max-rank``), so every value the zeroing
  would write is overwritten in the same call.

Everything else is vLLM's own reset. Installed for the LoRA linear layers and the logits
layer (:func:`install`); the tokens are the same either way (the engine parity tests run with it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from preft.serving.patching import require, wrap


@dataclass
class SlotState:
    """What one layer knows about its slots: which are zero since ``versions``, and the slot a
    ``set_lora`` call in progress overwrites whole."""

    zero: set[int] = field(default_factory=set)
    versions: tuple[int, ...] = ()
    overwriting: int | None = None


def _per_slice(value) -> list:
    """vLLM's per-slice value (a tuple or list of them, or one for a single-slice layer) as a list."""
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _versions(layer) -> tuple[int, ...]:
    """The version counters of the layer's stacked adapter tensors (any in-place write bumps one)."""
    return tuple(t._version for name in ("lora_a_stacked", "lora_b_stacked") for t in _per_slice(getattr(layer, name)))


def _state(layer) -> SlotState:
    state = layer.__dict__.get("_preft_slot_state")
    if state is None:
        state = layer.__dict__["_preft_slot_state"] = SlotState()
    return state


def fills_every_slice(layer, lora_a, lora_b) -> bool:
    """Whether ``set_lora``'s copy of ``lora_a`` / ``lora_b`` covers each slice's whole slot."""
    if getattr(layer, "tp_size", 1) != 1:  # sharded: vLLM slices the weights first
        return False
    stacks_a, stacks_b = _per_slice(layer.lora_a_stacked), _per_slice(layer.lora_b_stacked)
    lora_a, lora_b = _per_slice(lora_a), _per_slice(lora_b)
    if not len(lora_a) == len(lora_b) == len(stacks_a) == len(stacks_b):
        return False
    return all(a is not None and b is not None and stack_a.dim() == 4 and stack_b.dim() == 4
               and tuple(a.shape) == tuple(stack_a.shape[2:]) and tuple(b.shape) == tuple(stack_b.shape[2:])
               for a, b, stack_a, stack_b in zip(lora_a, lora_b, stacks_a, stacks_b))


def reset_lora_when_needed(original, layer, index: int, *args, **kwargs):
    """``reset_lora``, skipped when slot ``index`` is zero already or is being overwritten whole."""
    state = _state(layer)
    if state.overwriting == index:
        return None
    if _versions(layer) != state.versions:  # something wrote to the stacks: no slot is known to be zero
        state.zero = set()
    if index in state.zero:
        return None
    result = original(layer, index, *args, **kwargs)
    state.zero.add(index)
    state.versions = _versions(layer)
    return result


def set_lora_filling(original, layer, index: int, lora_a, lora_b, *args, **kwargs):
    """``set_lora``, its zeroing of slot ``index`` skipped when the copy fills the slot."""
    state = _state(layer)
    outer = state.overwriting
    state.overwriting = index if fills_every_slice(layer, lora_a, lora_b) else None
    try:
        return original(layer, index, lora_a, lora_b, *args, **kwargs)
    finally:
        state.overwriting = outer


def install() -> None:
    """Wrap ``reset_lora`` of the LoRA linear and logits layers, and every ``set_lora`` of theirs
    that calls it (a subclass's own ``set_lora`` left unwrapped would only zero as vLLM does)."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.layers.column_parallel_linear import (MergedColumnParallelLinearVariableSliceWithLoRA,
                                                         MergedColumnParallelLinearWithLoRA)
    from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA

    for owner in (BaseLinearLayerWithLoRA, LogitsProcessorWithLoRA):
        wrap(owner, "reset_lora")(reset_lora_when_needed)
    for owner in (BaseLinearLayerWithLoRA, MergedColumnParallelLinearWithLoRA,
                  MergedColumnParallelLinearVariableSliceWithLoRA, LogitsProcessorWithLoRA):
        require(owner, "set_lora")
        if "set_lora" in vars(owner):
            wrap(owner, "set_lora")(set_lora_filling)
