"""Per-token LoRA ids for one engine step, keyed on absolute position (:mod:`preft.rule`).

vLLM builds the LoRA mapping of a step in ``InputBatch.make_lora_inputs``: every scheduled
token of a request gets the request's LoRA id. For a prefill-only adapter the id must be
"none" (0) for every token whose absolute position ``p`` is outside ``[adapter_start, P)``.
Position of scheduled token ``j`` of request ``r`` = ``num_computed_tokens[r] + j``, so a
chunked prefill, a prefix-cache hit (computed tokens skipped) and a recompute after
preemption (generated tokens recomputed at ``p >= P``) all get the same answer.
"""

from __future__ import annotations

import numpy as np

from preft.rule import ALL_TOKEN, AdapterRule, active_scheduled_tokens


def prefill_only_mapping(
    request_lora_ids: np.ndarray,      # [R] LoRA int id per request (0 = no adapter)
    num_computed_tokens: np.ndarray,   # [R] position of the first token scheduled this step
    num_prompt_tokens: np.ndarray,     # [R] P per request
    num_scheduled_tokens: np.ndarray,  # [R]
    num_sampled_tokens: np.ndarray,    # [R]
    rules: dict[int, AdapterRule],     # LoRA int id -> rule; ids not listed are all-token
) -> tuple[np.ndarray, np.ndarray]:
    """``(token_lora_ids [sum scheduled], sampled_lora_ids [sum sampled])`` for one step.

    A sampled token takes the id of the position that produces it: the last scheduled token of
    its request.
    """
    request_lora_ids = np.asarray(request_lora_ids, dtype=np.int64)
    request_rules = [rules.get(int(lora_id), ALL_TOKEN) for lora_id in request_lora_ids]
    request_of_token, token_active, last_active = active_scheduled_tokens(
        np.array([rule.prefill_only for rule in request_rules], dtype=bool),
        np.array([rule.adapter_start for rule in request_rules], dtype=np.int64),
        np.asarray(num_computed_tokens, dtype=np.int64), np.asarray(num_prompt_tokens, dtype=np.int64),
        num_scheduled_tokens,
    )
    token_ids = np.where(token_active, request_lora_ids[request_of_token], 0)
    sampled = np.where(last_active, request_lora_ids, 0)
    return token_ids.astype(np.int64), np.repeat(sampled, num_sampled_tokens).astype(np.int64)
