"""LoRA-P on SGLang's torch-native LoRA backend: the rule applied per token.

SGLang runs a LoRA as ``y = x W^T + (x A_s^T) B_s^T`` over segments of tokens that share an
adapter slot ``s`` (``sgemm_lora_a_fwd`` then ``sgemm_lora_b_fwd``). For a prefill-only
adapter, each token ``t`` of request ``i`` at absolute position ``p_t`` gets the mask

    m_t = 1  if  adapter_start_i <= p_t < P_i  else 0      (P_i: request i's prompt length)

and the A output row ``t`` is multiplied by ``m_t``, so B adds exactly nothing where the rule
says no (an all-token LoRA and the base model's rows, rank 0, are left as they are). Positions
come from SGLang's ``ForwardBatch.positions``, the requests' token counts from its
``extend_seq_lens_cpu`` (one token each in a decode step), the prompt lengths from the batch the
scheduler runs (:func:`remember_prompt_lengths`, one process: tensor parallel size 1), and each
adapter's rule from its bundle's manifest when SGLang loads it (:func:`remember_rule`).

SGLang's radix cache keys a LoRA request's KV by its adapter alone; KV computed for positions
past ``P`` (decoded tokens, without the adapter) would then be reused as a longer prompt's KV,
where the rule wants the adapter. A prefill-only adapter's requests are keyed by their prompt
length too (:func:`prefix_key`), as the vLLM path keys blocks past the prompt's end.

On a machine with no accelerator, SGLang's LoRA code asks for pinned host memory, which torch
refuses there (``pin_memory=True requires a CUDA or other accelerator backend``);
:func:`allow_unpinned` turns those requests into plain host memory in SGLang's LoRA modules
(there is no device copy to speed up).
"""

from __future__ import annotations

import functools

import torch

from preft.rule import ALL_TOKEN, AdapterRule, is_active

#: lora_id -> its rule (filled as SGLang loads adapters)
RULES: dict[str, AdapterRule] = {}
#: the prompt lengths of the requests of the batch being run, in batch order
STEP = {"prompt_lengths": None, "mask": None}


def rule_of_bundle(path: str) -> AdapterRule:
    from preft.bundle import bundle_rule, has_manifest

    return bundle_rule(path) if path and has_manifest(path) else ALL_TOKEN


def remember_rule(result, manager, lora_ref, *args, **kwargs):
    """AFTER hook on ``LoRAManager.load_lora_weights``."""
    RULES[lora_ref.lora_id] = rule_of_bundle(lora_ref.lora_path)
    return result


def prefix_key(result, req, *args, **kwargs):
    """AFTER hook on ``Req.__init__``: a prefill-only adapter's request keys its KV by its prompt
    length as well (the module docstring)."""
    rule = RULES.get(req.lora_id) if req.lora_id is not None else None
    if rule is not None and rule.prefill_only:
        req.extra_key = f"{req.extra_key or ''}|preft_prompt_end:{len(req.origin_input_ids)}"
    return result


def token_mask(positions: torch.Tensor, tokens_per_request: list[int], lora_ids: list, prompt_lengths: list[int],
               rules: dict[str, AdapterRule]) -> torch.Tensor | None:
    """``[tokens]`` 1/0: where a request's adapter applies (the module docstring's ``m_t``), or
    None when no request of the step has a prefill-only adapter (nothing to mask)."""
    if not any(lora_id is not None and rules.get(lora_id, ALL_TOKEN).prefill_only for lora_id in lora_ids):
        return None
    if len(tokens_per_request) != len(lora_ids) or len(prompt_lengths) != len(lora_ids) \
            or sum(tokens_per_request) != positions.numel():
        raise RuntimeError("preft LoRA-P on SGLang: the step's requests do not match its tokens "
                           f"({len(lora_ids)} requests, {len(prompt_lengths)} prompt lengths, "
                           f"{sum(tokens_per_request)} vs {positions.numel()} tokens)")
    starts, ends = [], []
    for lora_id, prompt_length in zip(lora_ids, prompt_lengths):
        rule = rules.get(lora_id, ALL_TOKEN) if lora_id is not None else ALL_TOKEN
        if rule.prefill_only:
            starts.append(rule.adapter_start)
            ends.append(prompt_length)
        else:  # every position (the base model's rows have rank 0: nothing is added either way)
            starts.append(0)
            ends.append(1 << 62)
    counts = torch.tensor(tokens_per_request, dtype=torch.long)
    start = torch.repeat_interleave(torch.tensor(starts, dtype=torch.long), counts)
    end = torch.repeat_interleave(torch.tensor(ends, dtype=torch.long), counts)
    return is_active(positions.to("cpu", torch.long), end, start)


def remember_prompt_lengths(batch) -> None:
    STEP["prompt_lengths"] = [len(req.origin_input_ids) for req in batch.reqs]


def mask_for_step(result, manager, forward_batch, *args, **kwargs):
    """AFTER hook on ``LoRAManager.prepare_lora_batch``: the step's token mask."""
    lora_ids = list(forward_batch.lora_ids or [])
    if forward_batch.forward_mode.is_decode():
        tokens = [1] * len(lora_ids)
    else:
        tokens = list(forward_batch.extend_seq_lens_cpu)
    mask = token_mask(forward_batch.positions, tokens, lora_ids, STEP["prompt_lengths"] or [], RULES)
    STEP["mask"] = None if mask is None else mask.to(forward_batch.positions.device)
    return result


def masked_lora_a(original, inputs, *args, **kwargs):
    """AROUND hook on the torch backend's ``sgemm_lora_a_fwd``: rows off the rule become 0."""
    output = original(inputs, *args, **kwargs)
    mask = STEP["mask"]
    if mask is not None:
        output = output * mask.to(output.dtype)[:, None]
    return output


#: the torch factory functions SGLang's LoRA code calls with ``pin_memory=True``
FACTORIES = frozenset({"empty", "zeros", "ones", "full", "tensor", "arange"})


def _unpinned(factory, *args, pin_memory: bool = False, **kwargs):
    return factory(*args, **kwargs)


class TorchWithoutPinning:
    """``torch`` as one module sees it, with ``pin_memory`` dropped from its factory functions."""

    def __getattr__(self, name: str):
        attr = getattr(torch, name)
        return functools.partial(_unpinned, attr) if name in FACTORIES else attr


def allow_unpinned(modules) -> None:
    """Without an accelerator, ``pin_memory=True`` gives plain host memory instead of an error:
    in ``modules`` (SGLang's LoRA layers and torch backend) through their own ``torch``, and in
    ``Tensor.pin_memory()``, which can only fail on such a machine."""
    if torch.cuda.is_available():
        return
    if not getattr(torch.Tensor.pin_memory, "preft_unpinned", False):
        def unpinned_method(tensor, *args, **kwargs):
            return tensor

        unpinned_method.preft_unpinned = True
        torch.Tensor.pin_memory = unpinned_method
    for module in modules:
        module.torch = TorchWithoutPinning()
