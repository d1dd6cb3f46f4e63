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
"""

from __future__ import annotations

import re
from collections import deque

from preft.serving.scheduling.chunked_hash_tree import ChunkedHashTree
from preft.serving.scheduling.feather import FeatherAdmission, FeatherBandit


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


ADMISSIONS = ("fcfs", "lpm", "feather")
#: the prefill chunk policies by the form of their names (``cycle:`` is ``preft eval profile``'s)
CHUNK_POLICY_NAMES = re.compile(r"default|fixed:\d+|cycle:\d+(,\d+)*|sloweave|wavepp|sloweave\+wavepp")
#: what ``--scheduler`` takes, for its help and its errors
SCHEDULER_CHOICES = ("a prefill chunk policy (default, fixed:TOKENS, sloweave, wavepp, sloweave+wavepp; "
                     "cycle:TOKENS,TOKENS,... for profiling) and/or an admission order (fcfs, lpm, feather), "
                     "joined by '+', e.g. feather+sloweave")


def split_scheduler_name(name: str) -> tuple[str, str]:
    """``ADMISSION+CHUNK_POLICY`` (either part optional, in any order) -> (admission, chunk policy):
    ``feather`` -> (feather, default); ``feather+sloweave`` -> (feather, sloweave);
    ``fixed:256`` -> (fcfs, fixed:256); ``feather+sloweave+wavepp`` -> (feather, sloweave+wavepp)."""
    parts = [part for part in name.split("+")]
    if any(not part for part in parts):
        raise ValueError(f"scheduler {name!r}: an empty part (expected e.g. feather+sloweave)")
    admissions = [part for part in parts if part in ADMISSIONS]
    chunks = [part for part in parts if part not in ADMISSIONS]
    if sorted(chunks) == ["sloweave", "wavepp"]:  # a deadline budget per step, pipeline-sized chunks in it
        chunks = ["sloweave+wavepp"]
    if len(admissions) > 1 or len(chunks) > 1:
        raise ValueError(f"scheduler {name!r}: at most one admission order and one prefill chunk policy; "
                         f"expected {SCHEDULER_CHOICES}")
    chunk = (chunks or ["default"])[0]
    if not CHUNK_POLICY_NAMES.fullmatch(chunk):
        raise ValueError(f"unknown scheduler {name!r}" + (f" (its part {chunk!r})" if chunk != name else "")
                         + f": expected {SCHEDULER_CHOICES}")
    return (admissions or ["fcfs"])[0], chunk


def make_admission(name: str, cache=None, bandit: FeatherBandit | None = None, max_wait_s: float = 10.0,
                   learn: bool = True):
    """A fresh admission order by name; ``lpm`` needs ``cache`` (anything with ``hit_blocks(keys)``)."""
    if name == "fcfs":
        return FirstComeFirstServed()
    if name == "lpm":
        if cache is None:
            raise ValueError("the lpm admission order needs a prefix cache to match against")
        return LongestPrefixMatch(cache)
    if name == "feather":
        return FeatherOrder(bandit, max_wait_s=max_wait_s, learn=learn)
    raise ValueError(f"unknown admission order {name!r} (choose from {', '.join(ADMISSIONS)})")


def admission_from_spec(spec: dict, cache=None):
    """The admission order a scheduler spec names (``feather`` in ``feather+sloweave``), or None
    for ``fcfs`` (the engine keeps vLLM's own queue). Feather's table is read from
    ``feather_state`` when that file exists (else it starts empty)."""
    from pathlib import Path

    name = split_scheduler_name(spec.get("name", "default"))[0]
    if name != "feather" and ("feather_state" in spec or "feather_max_wait_s" in spec):
        raise ValueError(f"the Feather state and age bound are Feather's; scheduler {spec.get('name')!r} has none")
    if name == "fcfs":
        return None
    state = spec.get("feather_state")
    bandit = FeatherBandit.load(state) if state and Path(state).exists() else None
    return make_admission(name, cache=cache, bandit=bandit, max_wait_s=float(spec.get("feather_max_wait_s", 10.0)))
