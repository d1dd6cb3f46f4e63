"""A KV cache with prefix caching, as the simulator sees it: blocks keyed by chained chunk keys,
pinned while a request runs, kept (least recently used first out) after it finishes.

A request's prompt of ``P`` tokens has ``P // B`` full blocks with keys (the CHT's, one per
block, :func:`workload_keys`); it needs ``ceil((P + output) / B)`` blocks in all. Admitting it:

- ``hit`` = the leading keys already cached (keys chain, so hits are a prefix); its prefill
  starts at ``hit * B`` tokens (at most ``P - 1``: vLLM always computes the last prompt token);
- it needs ``blocks - hit`` new blocks; unpinned cached blocks are evicted, oldest use first,
  until they fit; if they cannot fit, the request waits (as vLLM's scheduler stops admitting).

Finishing a request unpins its keyed blocks (they stay cached) and frees the rest.
"""

from __future__ import annotations

from collections import OrderedDict

from preft.rule import AdapterRule


def workload_keys(spec, block_tokens: int, rule: AdapterRule | None = None) -> list[tuple]:
    """Chunk keys of a workload request (no token ids: its shared prefix is named by its group).

    Blocks wholly inside the group's shared prefix are keyed by the group; later ones by the
    request. With an adapter the key gains the adapter from the first block whose KV it changes
    (``rule.kv_adapter_span``; no rule: every block), so the keys chain as the CHT's do."""
    keys, adapted = [], False
    for level in range(1, spec.prompt_tokens // block_tokens + 1):
        end = level * block_tokens
        owner = (f"g{spec.prefix_group}" if spec.prefix_group is not None and end <= spec.prefix_tokens
                 else spec.request_id)
        if spec.adapter is not None and (rule or AdapterRule()).kv_adapter_span(end, spec.prompt_tokens) is not None:
            adapted = True  # (the keys cover the prompt's blocks, which end at or before P)
        # chained: a request-owned block makes every later block the request's own
        if keys and keys[-1][1] == spec.request_id:
            owner = spec.request_id
        keys.append((level, owner, spec.adapter if adapted else None))
    return keys


class PrefixCache:
    """Blocks of ``block_tokens`` tokens, ``capacity_blocks`` of them (see the module docstring)."""

    def __init__(self, capacity_blocks: int, block_tokens: int) -> None:
        self.capacity, self.block_tokens = capacity_blocks, block_tokens
        self.cached: OrderedDict[tuple, int] = OrderedDict()  # key -> pins, oldest use first
        self.private = 0  # blocks held by running requests' unkeyed tokens
        self.hits = self.lookups = 0

    def used(self) -> int:
        return len(self.cached) + self.private

    def hit_blocks(self, keys: list[tuple]) -> int:
        hit = 0
        for key in keys:
            if key not in self.cached:
                break
            hit += 1
        return hit

    def admit(self, keys: list[tuple], prompt_tokens: int, output_tokens: int) -> int | None:
        """Pin the request's blocks: the prompt tokens it need not compute, or None if it cannot fit."""
        hit = self.hit_blocks(keys)
        reused = set(keys[:hit])
        total = -(-(prompt_tokens + output_tokens) // self.block_tokens)
        needed = total - hit
        evictable = [k for k, pins in self.cached.items() if pins == 0 and k not in reused]
        if self.used() + needed - len(evictable) > self.capacity:
            return None
        for key in evictable:  # oldest use first
            if self.used() + needed <= self.capacity:
                break
            del self.cached[key]
        for key in keys[:hit]:
            self.cached[key] += 1
            self.cached.move_to_end(key)
        for key in keys[hit:]:
            self.cached[key] = 1
        self.private += total - len(keys)
        self.lookups += len(keys)
        self.hits += hit
        return min(hit * self.block_tokens, prompt_tokens - 1)

    def finish(self, keys: list[tuple], prompt_tokens: int, output_tokens: int) -> None:
        for key in keys:
            self.cached[key] -= 1
            self.cached.move_to_end(key)
        self.private -= -(-(prompt_tokens + output_tokens) // self.block_tokens) - len(keys)
