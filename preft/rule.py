"""The one rule of PreFT, in one place.

For a sequence with prompt length ``P`` and an adapter with start ``s``, the adapter is active
at absolute token position ``p`` iff::

    s <= p < P                      (prefill-only adapter; an all-token adapter: always)

Every user of the rule calls this module: the HF prefill context (``preft.context``), the vLLM
LoRA mapping (``preft.serving.lora_mapping``), the ReFT-P rows (``preft.serving.reft``), the
prefix-cache keys (``preft.serving.engine_core``) and the scheduler's adapter slots
(``preft.serving.scheduler``). It keys on *position*, never on "this step is a prefill", so
chunked prefill, prefix-cache hits and recompute after preemption all agree with training.
A bundle's rule is read from its manifest by :func:`preft.bundle.bundle_rule`. This module
depends on numpy alone.

>>> import numpy as np
>>> is_active(np.arange(6), prompt_length=4, adapter_start=1).tolist()
[False, True, True, True, False, False]
>>> AdapterRule(prefill_only=True, adapter_start=2).kv_has_adapter(block_end=2)
False
>>> AdapterRule(prefill_only=True, adapter_start=2).kv_adapter_span(block_end=128, prompt_length=100)
(2, 100)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def is_active(positions, prompt_length, adapter_start):
    """``adapter_start <= positions < prompt_length``, elementwise (numpy arrays, torch tensors
    or ints; the arguments broadcast)."""
    return (positions >= adapter_start) & (positions < prompt_length)


@dataclass(frozen=True)
class AdapterRule:
    """How one adapter is applied: to prompt tokens from ``adapter_start`` on, or to every token."""

    prefill_only: bool = False
    adapter_start: int = 0

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> AdapterRule:
        """The rule a bundle's manifest (``preft export``) records."""
        if not manifest.get("prefill_only"):
            return ALL_TOKEN
        return cls(prefill_only=True, adapter_start=int(manifest.get("adapter_start", 0)))

    def active_in(self, first: int, end: int, prompt_length: int) -> bool:
        """Whether any position in ``[first, end)`` is active."""
        if not self.prefill_only:
            return first < end
        return bool(is_active(max(first, self.adapter_start), min(end, prompt_length), self.adapter_start))

    def active_count(self, first: int, end: int, prompt_length: int) -> int:
        """How many positions in ``[first, end)`` are active (a step's adapter tokens, for cost models)."""
        if not self.prefill_only:
            return max(0, end - first)
        return max(0, min(end, prompt_length) - max(first, self.adapter_start))

    def needs_adapter_from(self, position: int, prompt_length: int) -> bool:
        """Whether any position ``>= position`` is still active. False for a prefill-only
        request past its prompt: it decodes on the base model and needs no adapter slot."""
        return not self.prefill_only or self.active_in(position, prompt_length, prompt_length)

    def kv_has_adapter(self, block_end: int) -> bool:
        """Whether the KV of positions ``[0, block_end)`` can depend on the adapter (for some
        prompt length). Attention looks back only, so KV wholly before ``adapter_start`` is the
        base model's (and shared)."""
        return not self.prefill_only or block_end > self.adapter_start

    def kv_adapter_span(self, block_end: int, prompt_length: int) -> tuple[int, int] | None:
        """The positions of ``[0, block_end)`` whose computation had the adapter, which is what the
        KV of those positions depends on: ``[adapter_start, min(P, block_end))`` for a
        prefill-only adapter (None when empty: base-model KV, shared with the base model and
        every adapter), ``[0, block_end)`` for an all-token one. A prefix-cache key of that KV
        must carry it: a block that turn 1 filled while decoding (positions past its ``P``,
        adapter off) is prompt in turn 2 (adapter on), the same tokens under another span."""
        if not self.prefill_only:
            return (0, block_end)
        end = min(prompt_length, block_end)
        return (self.adapter_start, end) if end > self.adapter_start else None


ALL_TOKEN = AdapterRule()


def active_scheduled_tokens(prefill_only: np.ndarray, adapter_start: np.ndarray, num_computed_tokens: np.ndarray,
                            num_prompt_tokens: np.ndarray, num_scheduled_tokens: np.ndarray
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which scheduled tokens of one engine step the adapter of their request touches.

    Per request ``r`` (arrays of length R): its rule (``prefill_only``, ``adapter_start``),
    ``num_computed_tokens`` (the position of its first token scheduled this step), ``P`` and
    how many tokens are scheduled. Scheduled token ``j`` of ``r`` sits at position
    ``num_computed_tokens[r] + j``. Returns ``(request_of_token [T], token_active [T],
    last_active [R])``; ``last_active`` is the rule at each request's last scheduled position,
    the one whose logits give its sampled token.
    """
    num_scheduled_tokens = np.asarray(num_scheduled_tokens, dtype=np.int64)
    request_of_token = np.repeat(np.arange(len(num_scheduled_tokens)), num_scheduled_tokens)
    first_token = np.cumsum(num_scheduled_tokens) - num_scheduled_tokens
    position = num_computed_tokens[request_of_token] + np.arange(request_of_token.size) - first_token[request_of_token]

    def active(positions, requests):
        return ~prefill_only[requests] | is_active(positions, num_prompt_tokens[requests], adapter_start[requests])

    last_position = num_computed_tokens + num_scheduled_tokens - 1
    return (request_of_token, active(position, request_of_token),
            active(last_position, np.arange(len(num_scheduled_tokens))))

