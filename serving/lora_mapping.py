"""Per-token LoRA ids for one engine step, keyed on absolute position (the PreFT rule).

vLLM builds the LoRA mapping of a step in ``InputBatch.make_lora_inputs``: every scheduled
token of a request gets the request's LoRA id. For a prefill-only adapter the id must be
"none" (0) for every token whose absolute position ``p`` is outside ``[adapter_start, P)``.
Position of scheduled token ``j`` of request ``r`` = ``num_computed_tokens[r] + j``, so a
chunked prefill, a prefix-cache hit (computed tokens skipped) and a recompute after
preemption (generated tokens recomputed at ``p >= P``) all get the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AdapterRule:
    """How one adapter is applied: prompt tokens from ``adapter_start`` on, or every token."""

    prefill_only: bool = False
    adapter_start: int = 0


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
    num_requests = len(request_lora_ids)
    prefill_only = np.zeros(num_requests, dtype=bool)
    start = np.zeros(num_requests, dtype=np.int64)
    for index, lora_id in enumerate(request_lora_ids):
        rule = rules.get(int(lora_id))
        if rule is not None and rule.prefill_only:
            prefill_only[index], start[index] = True, rule.adapter_start

    request_of_token = np.repeat(np.arange(num_requests), num_scheduled_tokens)
    first_token = np.cumsum(num_scheduled_tokens) - num_scheduled_tokens
    offset = np.arange(request_of_token.size) - first_token[request_of_token]
    position = num_computed_tokens[request_of_token] + offset

    def active(positions, requests):
        inside = (positions >= start[requests]) & (positions < num_prompt_tokens[requests])
        return ~prefill_only[requests] | inside

    token_ids = np.where(active(position, request_of_token), request_lora_ids[request_of_token], 0)
    requests = np.arange(num_requests)
    last_position = num_computed_tokens + num_scheduled_tokens - 1
    sampled = np.where(active(last_position, requests), request_lora_ids, 0)
    return token_ids.astype(np.int64), np.repeat(sampled, num_sampled_tokens).astype(np.int64)
