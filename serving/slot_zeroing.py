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

Everything else is vLLM's own reset. A write that fills the slot of a LoRA linear layer on one
rank does not go through vLLM's ``set_lora`` at all (:func:`write_filling_slot`): what is left of
it is one copy per slice of ``A`` and of ``B``, made in one ``torch._foreach_copy_`` into slot
views kept per layer. The generic path around those copies (its reset call, the slicing, the
checks for packed and sharded weights, a dispatch per copy) cost more than the copies of a small
model's adapter (one-off timing in one process on the default model, 16 layers: 0.5 ms an
adapter through vLLM's path, 0.33 ms this way). Installed for the LoRA linear, logits and
embedding layers (:func:`install`); the tokens are the same either way (the engine parity tests
run with it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from preft.serving.patching import require, wrap


@dataclass
class SlotState:
    """What one layer knows about its slots: which are zero since ``versions``, the slot a
    ``set_lora`` call in progress overwrites whole, the shape of one slot of each stacked
    tensor (``None``: not a layer whose slots :func:`fills_every_slice` can judge) and, per slot,
    its views into the stacked tensors with the data pointers they were made for."""

    zero: set[int] = field(default_factory=set)
    versions: tuple[int, ...] = ()
    overwriting: int | None = None
    slot_shapes: tuple | None = None
    slot_views: dict = field(default_factory=dict)


def _per_slice(value) -> list:
    """vLLM's per-slice value (a tuple or list of them, or one for a single-slice layer) as a list."""
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _stacks(layer) -> list:
    """The layer's stacked adapter tensors: every slice's A, then every slice's B."""
    return _per_slice(layer.lora_a_stacked) + _per_slice(layer.lora_b_stacked)


def _versions(layer) -> tuple[int, ...]:
    """The version counters of the layer's stacked adapter tensors (any in-place write bumps one)."""
    return tuple(t._version for t in _stacks(layer))


def _state(layer) -> SlotState:
    state = layer.__dict__.get("_preft_slot_state")
    if state is None:
        state = layer.__dict__["_preft_slot_state"] = SlotState()
        stacks_a, stacks_b = _per_slice(layer.lora_a_stacked), _per_slice(layer.lora_b_stacked)
        # sharded (vLLM slices the weights first) or not vLLM's [slots, 1, rows, cols] stacks: never judged
        if getattr(layer, "tp_size", 1) == 1 and len(stacks_a) == len(stacks_b) and all(
                t.dim() == 4 for t in stacks_a + stacks_b):
            state.slot_shapes = tuple(t.shape[2:] for t in stacks_a + stacks_b)
    return state


def fills_every_slice(layer, lora_a, lora_b) -> bool:
    """Whether ``set_lora``'s copy of ``lora_a`` / ``lora_b`` covers each slice's whole slot."""
    shapes = _state(layer).slot_shapes
    if shapes is None:
        return False
    lora_a, lora_b = _per_slice(lora_a), _per_slice(lora_b)
    if not 2 * len(lora_a) == 2 * len(lora_b) == len(shapes):
        return False
    return all(value is not None and value.shape == shape for value, shape in zip(lora_a + lora_b, shapes))


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


def write_filling_slot(layer, index: int, lora_a, lora_b) -> None:
    """What vLLM's ``set_lora`` of a LoRA linear layer on one rank leaves to do when the adapter
    fills slot ``index`` of every slice (:func:`fills_every_slice`): each slice's ``A`` and ``B``
    copied over the slot whole; the zeroing it would do first is all overwritten."""
    stacks, state = _stacks(layer), _state(layer)
    pointers = tuple(t.data_ptr() for t in stacks)  # a stack re-seated on new memory gets new views
    known = state.slot_views.get(index)
    if known is None or known[0] != pointers:
        known = state.slot_views[index] = (pointers, [t[index, 0] for t in stacks])
    # one call for every slice's copy: per-copy dispatch, not bytes, is what a small adapter costs
    torch._foreach_copy_(known[1], _per_slice(lora_a) + _per_slice(lora_b), non_blocking=True)


def _is_linear_layer(layer) -> bool:
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    return isinstance(layer, BaseLinearLayerWithLoRA)


def set_lora_filling(original, layer, index: int, lora_a, lora_b, *args, **kwargs):
    """``set_lora``, its zeroing of slot ``index`` skipped when the copy fills the slot; for a LoRA
    linear layer such a write is the copies alone (:func:`write_filling_slot`)."""
    fills = fills_every_slice(layer, lora_a, lora_b)
    if fills and not args and not kwargs and _is_linear_layer(layer):
        write_filling_slot(layer, index, lora_a, lora_b)
        return None
    state = _state(layer)
    outer = state.overwriting
    state.overwriting = index if fills else None
    try:
        return original(layer, index, lora_a, lora_b, *args, **kwargs)
    finally:
        state.overwriting = outer


def install() -> None:
    """Wrap ``reset_lora`` of the LoRA linear, logits and embedding layers, and every ``set_lora``
    of the linear and logits layers that calls it (a subclass's own ``set_lora`` left unwrapped
    would only zero as vLLM does). The embedding layer's ``set_lora`` (a transposed, partial
    copy) keeps vLLM's zeroing whenever its slot is not zero already."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.layers.column_parallel_linear import (MergedColumnParallelLinearVariableSliceWithLoRA,
                                                         MergedColumnParallelLinearWithLoRA)
    from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA
    from vllm.lora.layers.vocab_parallel_embedding import VocabParallelEmbeddingWithLoRA

    for owner in (BaseLinearLayerWithLoRA, LogitsProcessorWithLoRA, VocabParallelEmbeddingWithLoRA):
        wrap(owner, "reset_lora")(reset_lora_when_needed)
    for owner in (BaseLinearLayerWithLoRA, MergedColumnParallelLinearWithLoRA,
                  MergedColumnParallelLinearVariableSliceWithLoRA, LogitsProcessorWithLoRA):
        require(owner, "set_lora")
        if "set_lora" in vars(owner):
            wrap(owner, "set_lora")(set_lora_filling)
