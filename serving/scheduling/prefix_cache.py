"""A KV cache with prefix caching, as the simulator sees it: blocks keyed by chained chunk keys,
pinned while a request runs, kept (least recently used first out) after it finishes.

A request's prompt of ``P`` tokens has ``P // B`` full blocks with keys (the CHT's, one per
block, :func:`workload_keys`); it needs ``ceil((P + output) / B)`` blocks in all. Admitting it:

- ``hit`` = the leading keys already cached (keys chain, so hits are a prefix); its prefill
  starts at ``hit * B`` tokens (at most ``P - 1``: vLLM always computes the last prompt token);
- it needs ``blocks - hit`` new blocks; unpinned cached blocks are evicted, oldest use first,
  until they fit; if they cannot fit, the request waits (as vLLM's scheduler stops admitting).

Finishing a request unpins its keyed blocks (they stay cached), keeps the blocks its decode
filled (:func:`filled_keys`: vLLM caches those too, which is what a conversation's next turn
can reuse) and frees the rest.
"""

from __future__ import annotations

from collections import OrderedDict

from preft.rule import ALL_TOKEN, AdapterRule


def workload_keys(spec, block_tokens: int, rule: AdapterRule | None = None, tokens: int | None = None
                  ) -> list[tuple]:
    """Chunk keys of the full blocks of a workload request's first ``tokens`` tokens (default: its
    prompt), without token ids: a block's tokens are named by who owns them.

    Owner: blocks wholly inside a prefix group's shared prefix belong to the group; a
    conversation's blocks to the conversation (each turn's prompt is the conversation so far, one
    stream); the rest to the request, and once a block is the request's own, every later one is
    (keys chain, as the CHT's do). With an adapter the key carries the positions of the block's
    prefix that had it, ``rule.kv_adapter_span(end, P)`` (no rule: the all-token one, every
    position), as the engine's keys do: a block turn 1 filled while decoding (adapter off under
    a prefill-only rule) is not turn 2's prompt block (adapter on)."""
    rule = rule or ALL_TOKEN
    keys = []
    for level in range(1, (spec.prompt_tokens if tokens is None else tokens) // block_tokens + 1):
        end = level * block_tokens
        if spec.prefix_group is not None and end <= spec.prefix_tokens:
            owner = f"g{spec.prefix_group}"
        else:
            owner = spec.conversation or spec.request_id
        if keys and keys[-1][1] == spec.request_id:
            owner = spec.request_id
        span = rule.kv_adapter_span(end, spec.prompt_tokens) if spec.adapter is not None else None
        keys.append((level, owner, None if span is None else (spec.adapter, span)))
    return keys


def filled_keys(spec, block_tokens: int, rule: AdapterRule | None = None) -> list[tuple]:
    """Keys of the blocks a request fills while decoding, which vLLM caches too: its prompt and
    ``output - 1`` generated tokens have KV (the last sampled token's is never computed)."""
    prompt_blocks = spec.prompt_tokens // block_tokens
    return workload_keys(spec, block_tokens, rule, spec.prompt_tokens + spec.output_tokens - 1)[prompt_blocks:]


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

    def finish(self, keys: list[tuple], prompt_tokens: int, output_tokens: int, filled: list[tuple] = ()) -> None:
        """Unpin the prompt's blocks and free the rest, keeping ``filled`` (the blocks its decode
        filled, :func:`filled_keys`) cached. vLLM frees a request's blocks tail first, so its
        later blocks are evicted before its earlier ones."""
        for key in keys:
            self.cached[key] -= 1
        self.private -= -(-(prompt_tokens + output_tokens) // self.block_tokens) - len(keys)
        for key in filled:  # freed blocks that stay cached, unpinned
            self.cached.setdefault(key, 0)
        for key in reversed([*keys, *filled]):
            self.cached.move_to_end(key)
