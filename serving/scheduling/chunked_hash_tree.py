"""The Chunked Hash Tree (CHT): which waiting request shares the most prefix with the running
batch, found in O(log W) (Feather, arXiv 2605.06046).

A request's prompt is cut into chunks of ``C`` tokens. Chunk ``k`` gets one digest of the
whole prefix so far, by a streaming hash::

    h_0 = seed(adapter identity if chunk 1 already carries the adapter, else nothing)
    h_k = H(h_{k-1}, tokens[(k-1)C : kC])            key_k = (k, h_k truncated to 64 bits)

so a match at level ``k`` implies every earlier level matches: the keys of two prompts agree
exactly on their common chunk-aligned prefix. The tree keeps, incrementally:

- per request its chunk keys;
- key -> waiting requests that have it;
- the working set: key -> how many active (running) requests have it;
- per waiting request ``missing`` = how many of its keys are not in the working set;
- a min-heap of ``(missing, arrival order, request)`` with lazy deletion (an entry is stale
  when its count no longer matches).

``insert`` / ``remove`` a waiting request, ``activate`` it (waiting -> running: its keys join the
working set, and the waiting requests sharing a key that was absent miss one chunk less),
``finish`` a running one (the reverse), ``deactivate`` a running one back to waiting (a preempted
request, or one the engine could not place this step; it keeps its arrival order), ``best_request`` (fewest missing chunks, oldest first
among equals). A key joining or leaving the working set touches only the waiting requests that
have that key.

**PreFT-aware keys** (:meth:`~preft.rule.AdapterRule.kv_adapter_span`): a chunk that ends at or
before a prefill-only adapter's ``adapter_start`` is base-model KV, so its digest is computed
without the adapter, and users of different adapters behind one shared system prompt are one
prefix group. From the first chunk whose KV the adapter changes, the adapter's identity enters
the digest (and, by chaining, every later one), as vLLM's prefix cache keys blocks by adapter;
a chunk that ends past the rule's ``P`` (a request's own prompt boundary, or tokens it
decoded) also takes ``P`` into its digest, since those positions ran without the adapter.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections import deque
from collections.abc import Sequence

import numpy as np

from preft.rule import AdapterRule

Key = tuple[int, bytes]


def chunk_keys(tokens: Sequence[int], chunk_tokens: int, adapter: str | None = None,
               rule: AdapterRule | None = None, prompt_length: int | None = None) -> list[Key]:
    """The CHT keys of a prompt's full chunks (a trailing partial chunk has none).

    ``adapter`` names the request's adapter (None: the base model); ``rule`` is its rule (None:
    the adapter changes every chunk, as an all-token adapter does); ``prompt_length`` is the
    rule's ``P`` (default: every token is prompt)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    data = np.asarray(tokens, dtype=np.int64).tobytes()
    width = 8 * chunk_tokens
    levels = len(tokens) // chunk_tokens
    rule = rule or AdapterRule()  # no rule: the adapter changes every chunk (all-token)
    prompt_length = len(tokens) if prompt_length is None else prompt_length
    digest, adapted = b"", False
    keys = []
    for level in range(1, levels + 1):
        step = hashlib.blake2b(digest, digest_size=8)
        span = None if adapter is None else rule.kv_adapter_span(level * chunk_tokens, prompt_length)
        if span is not None and not adapted:  # the first chunk whose KV the adapter changes
            adapted = True
            step.update(b"\x00adapter:" + adapter.encode())
        if span is not None and span[1] < level * chunk_tokens and rule.prefill_only:
            step.update(b"\x00prompt_end:%d" % span[1])  # positions past P ran without the adapter
        step.update(data[(level - 1) * width: level * width])
        digest = step.digest()
        keys.append((level, digest))
    return keys


class ChunkedHashTree:
    """The CHT's incremental state (see the module docstring)."""

    def __init__(self) -> None:
        self.keys: dict[str, list[Key]] = {}
        self.waiting_by_key: dict[Key, set[str]] = {}
        self.working: dict[Key, int] = {}
        self.missing: dict[str, int] = {}  # waiting requests only
        self.active: set[str] = set()
        self.order: dict[str, int] = {}
        self._heap: list[tuple[int, int, str]] = []
        self._fifo: deque[str] = deque()  # arrival order, left entries lazily dropped
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self.missing)

    def _push(self, request_id: str) -> None:
        heapq.heappush(self._heap, (self.missing[request_id], self.order[request_id], request_id))
        if len(self._heap) > 4 * len(self.missing) + 64:  # mostly stale: rebuild from the live counts
            self._heap = [(count, self.order[r], r) for r, count in self.missing.items()]
            heapq.heapify(self._heap)

    def insert(self, request_id: str, keys: list[Key]) -> None:
        """A new waiting request."""
        if request_id in self.keys:
            raise ValueError(f"request {request_id!r} is already in the tree")
        self.keys[request_id] = keys
        self.order[request_id] = next(self._arrivals)
        for key in keys:
            self.waiting_by_key.setdefault(key, set()).add(request_id)
        self.missing[request_id] = sum(1 for key in keys if not self.working.get(key))
        self._push(request_id)
        self._fifo.append(request_id)

    def _leave_waiting(self, request_id: str) -> None:
        for key in self.keys[request_id]:
            waiters = self.waiting_by_key[key]
            waiters.discard(request_id)
            if not waiters:
                del self.waiting_by_key[key]
        del self.missing[request_id]

    def remove(self, request_id: str) -> None:
        """A waiting request that leaves without running (aborted)."""
        if request_id not in self.missing:
            raise KeyError(f"request {request_id!r} is not waiting")
        self._leave_waiting(request_id)
        del self.keys[request_id], self.order[request_id]

    def activate(self, request_id: str) -> None:
        """Waiting -> running: its keys join the working set."""
        if request_id not in self.missing:
            raise KeyError(f"request {request_id!r} is not waiting")
        self._leave_waiting(request_id)
        self.active.add(request_id)
        for key in self.keys[request_id]:
            count = self.working.get(key, 0)
            self.working[key] = count + 1
            if count == 0:
                for waiter in self.waiting_by_key.get(key, ()):
                    self.missing[waiter] -= 1
                    self._push(waiter)

    def finish(self, request_id: str) -> None:
        """A running request is done: its keys leave the working set (when it held the last)."""
        if request_id not in self.active:
            raise KeyError(f"request {request_id!r} is not running")
        self.active.discard(request_id)
        for key in self.keys[request_id]:
            count = self.working[key] - 1
            if count:
                self.working[key] = count
                continue
            del self.working[key]
            for waiter in self.waiting_by_key.get(key, ()):
                self.missing[waiter] += 1
                self._push(waiter)
        del self.keys[request_id], self.order[request_id]

    def deactivate(self, request_id: str) -> None:
        """Running -> waiting again (preempted, or not placed after all), keeping its keys and
        its arrival order, so it is as old as it was."""
        keys, order = self.keys[request_id], self.order[request_id]
        self.finish(request_id)
        self.keys[request_id], self.order[request_id] = keys, order
        for key in keys:
            self.waiting_by_key.setdefault(key, set()).add(request_id)
        self.missing[request_id] = sum(1 for key in keys if not self.working.get(key))
        self._push(request_id)
        self._fifo.appendleft(request_id)  # the oldest waiting, as vLLM puts it back in front

    def best_request(self) -> str | None:
        """The waiting request missing the fewest chunks from the working set (oldest first among
        equals), or None when nothing waits. Stale heap entries are dropped as they surface."""
        while self._heap:
            missing, order, request_id = self._heap[0]
            if self.missing.get(request_id) == missing and self.order.get(request_id) == order:
                return request_id
            heapq.heappop(self._heap)
        return None

    def oldest_request(self) -> str | None:
        """The waiting request that arrived first (for an age bound), or None."""
        while self._fifo and self._fifo[0] not in self.missing:
            self._fifo.popleft()
        return self._fifo[0] if self._fifo else None

    def shared_chunks(self, request_id: str) -> int:
        """How many of a waiting request's chunks the working set already has."""
        return len(self.keys[request_id]) - self.missing[request_id]

    def waiting_sharing_first_chunk(self, request_id: str) -> int:
        """Other waiting requests with the same first chunk (its prefix group), for Feather's state."""
        keys = self.keys[request_id]
        if not keys:
            return 0
        return len(self.waiting_by_key.get(keys[0], ())) - (request_id in self.missing)
