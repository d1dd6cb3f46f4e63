"""Which waiting request joins the running batch next: FCFS, LPM and Feather, one interface.

The simulator asks, while a step has room::

    candidate(now, batch_size, capacity) -> request id | None     (None: admit no more this step)
    take(request_id)                                               (it was admitted)

and tells ``arrive``, ``finish`` and, after each step, ``reward(batch_size, step_s, prefill_tokens)``.
The engine (:mod:`preft.serving.admission_queue`) also tells ``requeue`` (a taken request is
waiting again: preempted, or not placed this step; it goes back in front, as old as it was) and
``remove`` (a waiting request left: aborted).

- :class:`FirstComeFirstServed`: arrival order (vLLM's default).
- :class:`LongestPrefixMatch`: the waiting request with the most blocks already in the prefix
  cache, oldest first among equals (SGLang's LPM). One cache walk per waiting request per
  selection, as SGLang does.
- :class:`FeatherOrder`: :class:`~preft.serving.scheduling.feather.FeatherAdmission` over a
  :class:`~preft.serving.scheduling.chunked_hash_tree.ChunkedHashTree` of the working set.
- :class:`~preft.serving.scheduling.adapter_groups.AdapterGroups`: each step's adapter slots to
  the adapters with the most waiting requests (those in a slot or host memory first among
  equals), with an age bound. It also hears ``new_step()`` before each step and
  ``used(adapters)`` after it: the adapters the step ran with.
"""

from __future__ import annotations

from collections import deque

from preft.serving.scheduling.chunked_hash_tree import ChunkedHashTree
from preft.serving.scheduling.feather import FeatherAdmission, FeatherBandit
from preft.serving.scheduling.spec import ADMISSIONS, SCHEDULER_CHOICES, SchedulerSpec, split_scheduler_name

__all__ = ["ADMISSIONS", "SCHEDULER_CHOICES", "FeatherOrder", "FirstComeFirstServed", "LongestPrefixMatch",
           "admission_from_spec", "make_admission", "split_scheduler_name"]


class FirstComeFirstServed:
    name = "fcfs"

    def __init__(self) -> None:
        self.queue: deque[str] = deque()

    def __len__(self) -> int:
        return len(self.queue)

    def arrive(self, request_id: str, keys: list, now: float) -> None:
        self.queue.append(request_id)

    def candidate(self, now: float, batch_size: int, capacity: int) -> str | None:
        return self.queue[0] if self.queue and batch_size < capacity else None

    def take(self, request_id: str) -> None:
        self.queue.popleft()

    def requeue(self, request_id: str, keys: list, arrived_s: float) -> None:
        self.queue.appendleft(request_id)

    def remove(self, request_id: str) -> None:
        self.queue.remove(request_id)

    def finish(self, request_id: str) -> None:
        pass

    def reward(self, batch_size: int, step_s: float, prefill_tokens: int = 0) -> None:
        pass


class LongestPrefixMatch(FirstComeFirstServed):
    name = "lpm"

    def __init__(self, cache) -> None:
        super().__init__()
        self.cache = cache
        self.keys: dict[str, list] = {}

    def arrive(self, request_id: str, keys: list, now: float) -> None:
        super().arrive(request_id, keys, now)
        self.keys[request_id] = keys

    def candidate(self, now: float, batch_size: int, capacity: int) -> str | None:
        if not self.queue or batch_size >= capacity:
            return None
        return max(self.queue, key=lambda r: self.cache.hit_blocks(self.keys[r]))  # max: the first of equals

    def take(self, request_id: str) -> None:
        self.queue.remove(request_id)
        del self.keys[request_id]

    def requeue(self, request_id: str, keys: list, arrived_s: float) -> None:
        super().requeue(request_id, keys, arrived_s)
        self.keys[request_id] = keys

    def remove(self, request_id: str) -> None:
        self.take(request_id)


class FeatherOrder:
    name = "feather"

    def __init__(self, bandit: FeatherBandit | None = None, max_wait_s: float = 10.0, learn: bool = True) -> None:
        self.tree = ChunkedHashTree()
        self.admission = FeatherAdmission(self.tree, bandit, max_wait_s=max_wait_s, learn=learn)
        self.arrived: dict[str, float] = {}
        self.now = 0.0

    def __len__(self) -> int:
        return len(self.tree)

    def arrive(self, request_id: str, keys: list, now: float) -> None:
        self.tree.insert(request_id, keys)
        self.arrived[request_id] = now

    def candidate(self, now: float, batch_size: int, capacity: int) -> str | None:
        return self.admission.candidate(batch_size, capacity, lambda r: now - self.arrived[r])

    def take(self, request_id: str) -> None:
        self.admission.take(request_id)
        del self.arrived[request_id]

    def requeue(self, request_id: str, keys: list, arrived_s: float) -> None:
        self.tree.deactivate(request_id)
        self.arrived[request_id] = arrived_s

    def remove(self, request_id: str) -> None:
        self.tree.remove(request_id)
        del self.arrived[request_id]

    def finish(self, request_id: str) -> None:
        self.tree.finish(request_id)

    def reward(self, batch_size: int, step_s: float, prefill_tokens: int = 0) -> None:
        self.admission.reward(batch_size, step_s, prefill_tokens)


def make_admission(name: str, cache=None, bandit: FeatherBandit | None = None, max_wait_s: float = 10.0,
                   learn: bool = True, adapter_of=None, slots: int | None = None, host: int | None = None):
    """A fresh admission order by name; ``lpm`` needs ``cache`` (anything with ``hit_blocks(keys)``);
    ``groups`` needs ``adapter_of`` (request id -> its LoRA adapter or None) and ``slots``
    (vLLM's ``max_loras``; ``host``: its ``max_cpu_loras``)."""
    if name == "fcfs":
        return FirstComeFirstServed()
    if name == "lpm":
        if cache is None:
            raise ValueError("the lpm admission order needs a prefix cache to match against")
        return LongestPrefixMatch(cache)
    if name == "feather":
        return FeatherOrder(bandit, max_wait_s=max_wait_s, learn=learn)
    if name == "groups":
        from preft.serving.scheduling.adapter_groups import AdapterGroups

        if adapter_of is None or not slots:
            raise ValueError("the groups admission order needs the requests' adapters and the engine's "
                             "adapter slots")
        return AdapterGroups(adapter_of, slots, host)
    raise ValueError(f"unknown admission order {name!r} (choose from {', '.join(ADMISSIONS)})")


def admission_from_spec(spec: SchedulerSpec | dict, cache=None, adapter_of=None, slots: int | None = None,
                        host: int | None = None):
    """The admission order a scheduler spec names (``feather`` in ``feather+sloweave``), or None
    for ``fcfs`` (the engine keeps vLLM's own queue). Feather's table is read from
    ``feather_state`` when that file exists (else it starts empty); ``adapter_of``, ``slots``
    and ``host`` are the adapter-group order's (:func:`make_admission`)."""
    from pathlib import Path

    spec = spec if isinstance(spec, SchedulerSpec) else SchedulerSpec.from_json(spec)
    if spec.admission == "fcfs":
        return None
    state = spec.feather_state
    bandit = FeatherBandit.load(state) if state and Path(state).exists() else None
    max_wait_s = spec.feather_max_wait_s if spec.feather_max_wait_s is not None else 10.0
    return make_admission(spec.admission, cache=cache, bandit=bandit, max_wait_s=max_wait_s, adapter_of=adapter_of,
                          slots=slots, host=host)
