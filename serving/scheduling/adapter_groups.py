"""Adapter-group admission: with fewer adapter slots than adapters, give each step's slots to the
adapters with the most waiting requests, those the engine already holds first among equals.

A step of vLLM computes with at most ``max_loras`` distinct LoRA adapters, and its scheduler,
once a waiting request's adapter has a slot, admits every other waiting request of that adapter
in the same step. So what a step prefills is set by *which* adapters get its slots: vLLM gives
them to the adapters of the oldest waiting requests. This order ranks the waiting adapters,
once per step, by

    rank(a) = (waiting(a), tier(a), -arrival of a's oldest waiting request)      (max first)

    tier(a) = 2  if a is in a slot (no copy)
              1  if a is in host memory (a copy into a slot, no read from disk)
              0  otherwise

and offers the waiting requests adapter by adapter in that order, oldest first within one:
more prompts per slot, and fewer adapters brought in. Requests for the base model need no slot
and come first. A request waiting ``max_wait_s`` or longer goes before all of them (oldest
first), so no adapter's requests starve. vLLM's worker keeps the slots and host memory as two
least-recently-used caches (``max_loras``, ``max_cpu_loras``); the order mirrors both from the
adapters each step ran with (:meth:`AdapterGroups.used`, which the scheduler and the simulator
call with the set the scheduler's trace counts: a prefill-only request's adapter leaves that set
when its prompt is done).

The order does not enforce ``max_loras`` itself: the scheduler skips a candidate whose adapter
would be one too many, as for any order, and asks again.

>>> adapters = {"a": "x", "b": "y", "c": "y", "d": "x", "e": None}
>>> order = AdapterGroups(adapter_of=adapters.get, slots=1, host=2, max_wait_s=5.0)
>>> for request_id, now in (("a", 0.0), ("b", 0.1), ("c", 0.2), ("e", 0.3)):
...     order.arrive(request_id, [], now)
>>> order.new_step()
>>> order.candidate(1.0, 0, 8)  # the base model's request needs no slot
'e'
>>> order.take("e"); order.candidate(1.0, 1, 8)  # y has two requests waiting, x one
'b'
>>> order.candidate(6.0, 1, 8)  # but a has waited 6 s: it goes first
'a'
>>> order.used({"x"}); order.arrive("d", [], 1.1); order.new_step()  # x is in the slot, two wait
>>> order.candidate(2.0, 1, 8)  # two each: x is in a slot
'a'
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

__all__ = ["AdapterGroups", "LeastRecentlyUsed"]


class LeastRecentlyUsed:
    """The keys of a cache of ``capacity`` entries evicting the least recently used (vLLM's)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a cache needs capacity >= 1, got {capacity}")
        self.capacity = capacity
        self.keys: OrderedDict[Hashable, None] = OrderedDict()

    def touch(self, key: Hashable) -> bool:
        """``key`` used now; whether it had to be brought in (it was not held)."""
        missing = key not in self.keys
        self.keys[key] = None
        self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)
        return missing

    def __contains__(self, key: Hashable) -> bool:
        return key in self.keys


class AdapterGroups:
    """Adapter-group admission (see the module docstring). ``adapter_of(request_id)``: the
    request's LoRA adapter (None: the base model); ``slots`` and ``host``: vLLM's ``max_loras``
    and ``max_cpu_loras`` (None: as many as slots, vLLM's default)."""

    name = "groups"

    def __init__(self, adapter_of: Callable[[str], Hashable | None], slots: int, host: int | None = None,
                 max_wait_s: float = 10.0) -> None:
        if max_wait_s <= 0:
            raise ValueError(f"max_wait_s must be > 0, got {max_wait_s}")
        self.adapter_of = adapter_of
        self.slots = LeastRecentlyUsed(slots)
        self.host = LeastRecentlyUsed(max(slots, host or slots))
        self.max_wait_s = max_wait_s
        self.arrived: OrderedDict[str, float] = OrderedDict()  # waiting request -> arrival, front first
        self.adapter: dict[str, Hashable | None] = {}  # waiting request -> its adapter (asked once, on arrival)
        self.groups: dict[Hashable | None, OrderedDict[str, None]] = {}  # adapter -> its waiting requests
        self.ranking: list = []  # this step's adapters, best first
        self.offered = 0  # how far this step's ranking has been handed out

    def __len__(self) -> int:
        return len(self.arrived)

    def tier(self, adapter: Hashable) -> int:
        return 2 if adapter in self.slots else (1 if adapter in self.host else 0)

    def new_step(self) -> None:
        """Rank the waiting adapters for the step about to be scheduled."""
        def rank(adapter):
            oldest = self.arrived[next(iter(self.groups[adapter]))]
            return (adapter is None, len(self.groups[adapter]), self.tier(adapter) if adapter is not None else 3,
                    -oldest)

        self.ranking = sorted(self.groups, key=rank, reverse=True)
        self.offered = 0

    def candidate(self, now: float, batch_size: int, capacity: int) -> str | None:
        if not self.arrived or batch_size >= capacity:
            return None
        oldest, arrived = next(iter(self.arrived.items()))
        if now - arrived >= self.max_wait_s:
            return oldest
        while self.offered < len(self.ranking):
            group = self.groups.get(self.ranking[self.offered])
            if group:
                return next(iter(group))
            self.offered += 1
        # arrivals since the ranking (the simulator admits between its own steps): oldest first
        return oldest

    def _add(self, request_id: str, arrived_s: float, front: bool) -> None:
        self.arrived[request_id] = arrived_s
        adapter = self.adapter[request_id] = self.adapter_of(request_id)
        group = self.groups.setdefault(adapter, OrderedDict())
        group[request_id] = None
        if front:
            self.arrived.move_to_end(request_id, last=False)
            group.move_to_end(request_id, last=False)

    def arrive(self, request_id: str, keys: list, now: float) -> None:
        self._add(request_id, now, front=False)

    def take(self, request_id: str) -> None:
        del self.arrived[request_id]
        adapter = self.adapter.pop(request_id)
        group = self.groups[adapter]
        del group[request_id]
        if not group:
            del self.groups[adapter]

    def requeue(self, request_id: str, keys: list, arrived_s: float) -> None:
        self._add(request_id, arrived_s, front=True)

    def remove(self, request_id: str) -> None:
        self.take(request_id)

    def finish(self, request_id: str) -> None:
        pass

    def reward(self, batch_size: int, step_s: float, prefill_tokens: int = 0) -> None:
        pass

    def used(self, adapters) -> None:
        """A step ran with these adapters: the most recently used, in slots and host memory."""
        for adapter in adapters:
            self.host.touch(adapter)
            self.slots.touch(adapter)
