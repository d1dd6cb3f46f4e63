"""Feather: a contextual bandit that decides, while a batch forms, whether to ADD the waiting
request sharing the most prefix with the batch or STOP (arXiv 2605.06046, "Requests of a
Feather Must Flock Together").

Each decision sees a bucketed state

    s = (batch size bucket, chunks lost by adding the candidate, waiting requests sharing its prefix bucket)

where *lost* = (candidate's chunks missing from the batch's working set) − (its chunks already
there), clipped to [-5, 5]: negative when the candidate mostly shares the batch's prefix. The
candidate comes from the :class:`~preft.serving.scheduling.chunked_hash_tree.ChunkedHashTree`
(fewest missing chunks). Rules before the bandit:

- nothing lost (the candidate misses no chunk), or an empty batch: always ADD;
- no prefix group to wait for (the candidate shares no chunk with the batch and no waiting
  request shares its first chunk): ADD. A STOP keeps the slot for a request that shares
  more, and the candidate, having the fewest missing chunks, shows none waits; without this
  rule the bandit's exploration cost 2% of the no-sharing workload's throughput in the
  simulator (1.82 vs FCFS 1.86 req/s) and nothing on the shared one;
- the age bound: the oldest waiting request goes first (whatever prefix it has) when the
  candidate arrived more than ``max_wait_s`` after it. No request is overtaken by one that
  arrived more than ``max_wait_s`` later, so none starves; and under overload, when every
  request has waited long, Feather still reorders within that window (a bound on the wait
  itself would turn it into FCFS exactly when the queue is long);
- the batch is full: STOP.

Otherwise tabular UCB picks the action::

    a = argmax_a  Q(s, a) + c · sqrt(ln N(s) / N(s, a))        (an untried action first)

with ``c`` the exploration constant (the paper's ~200, in the reward's units). When the batch
has run as a decode batch (its first step without prefill), its reward ``r = batch size /
measured step time`` (requests per second) is credited to every decision that formed it: ``Q(s, a) += (r − Q(s, a)) / N(s, a)``. Learning is online;
the table is saved and loaded as JSON (``--feather-state FILE``), and can be pretrained in the
simulator.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from preft.serving.scheduling.atomic_file import write_atomically

ADD, STOP = "add", "stop"
ACTIONS = (ADD, STOP)


def bucket(value: int, edges: tuple[int, ...]) -> int:
    """Index of the first edge ``>= value`` (the last bucket holds everything above)."""
    for index, edge in enumerate(edges):
        if value <= edge:
            return index
    return len(edges)


BATCH_EDGES = (1, 2, 4, 8, 16, 32, 64, 128)
SHARING_EDGES = (0, 1, 3, 7, 15, 31)


def state_of(batch_size: int, missing: int, shared: int, sharing_waiting: int) -> tuple[int, int, int]:
    """The bucketed state of one decision (see the module docstring)."""
    lost = max(-5, min(5, missing - shared))
    return bucket(batch_size, BATCH_EDGES), lost, bucket(sharing_waiting, SHARING_EDGES)


class FeatherBandit:
    """Tabular UCB over (state, action), rewards in requests per second."""

    def __init__(self, exploration: float = 200.0) -> None:
        self.exploration = exploration
        self.q: dict[tuple, float] = {}
        self.n: dict[tuple, int] = {}
        self.decisions = 0

    def choose(self, state: tuple) -> str:
        self.decisions += 1
        counts = [self.n.get((state, a), 0) for a in ACTIONS]
        for action, count in zip(ACTIONS, counts):
            if count == 0:
                return action
        total = math.log(sum(counts))
        return max(ACTIONS, key=lambda a: self.q[(state, a)]
                   + self.exploration * math.sqrt(total / self.n[(state, a)]))

    def credit(self, decisions: list[tuple[tuple, str]], reward: float) -> None:
        """The batch's reward to every decision that formed it (running mean per pair)."""
        for state, action in decisions:
            pair = (state, action)
            count = self.n.get(pair, 0) + 1
            self.n[pair] = count
            self.q[pair] = self.q.get(pair, 0.0) + (reward - self.q.get(pair, 0.0)) / count

    def greedy(self, state: tuple) -> str | None:
        """The learned action without exploration (None when untried)."""
        tried = [a for a in ACTIONS if (state, a) in self.q]
        return max(tried, key=lambda a: self.q[(state, a)]) if tried else None

    def to_json(self) -> dict:
        return {"exploration": self.exploration, "decisions": self.decisions,
                "table": [[list(state), action, self.q[(state, action)], self.n[(state, action)]]
                          for (state, action) in sorted(self.q, key=str)]}

    def save(self, path: str | Path) -> Path:
        """Atomically (:func:`.atomic_file.write_atomically`)."""
        return write_atomically(path, json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> FeatherBandit:
        try:
            data = json.loads(Path(path).read_text())
            bandit = cls(_number(data["exploration"], "exploration", low=0.0))
            bandit.decisions = int(_number(data.get("decisions", 0), "decisions", low=0))
            for state, action, q, n in data["table"]:
                if action not in ACTIONS:
                    raise ValueError(f"unknown action {action!r}")
                key = (tuple(state), action)
                bandit.q[key] = _number(q, f"the value of {key}")
                bandit.n[key] = int(_number(n, f"the count of {key}", low=0))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"cannot read the Feather state {path}: {err}") from None
        return bandit


def _number(value, what: str, low: float | None = None) -> float:
    """``value`` as a finite float (at least ``low``), or a ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{what} must be >= {low:g}, got {value!r}")
    return float(value)


class FeatherAdmission:
    """Forms the running batch from the waiting requests, one ADD/STOP decision at a time.

    ``admit(now, batch_size, capacity, waited_s)`` returns the requests to admit this step (in
    order) and remembers the decisions; ``reward(batch_size, step_s)`` credits them once the
    step has run. ``waited_s(request_id)`` is how long a request has waited."""

    def __init__(self, tree, bandit: FeatherBandit | None = None, max_wait_s: float = 10.0,
                 learn: bool = True) -> None:
        self.tree, self.bandit = tree, bandit or FeatherBandit()
        self.max_wait_s, self.learn = max_wait_s, learn
        self.pending: list[tuple[tuple, str]] = []
        self.name = "feather"

    def candidate(self, batch_size: int, capacity: int, waited_s) -> str | None:
        """The next request to admit into a batch of ``batch_size`` (not yet activated: see
        :meth:`take`), or None: the batch is full, nothing waits, or the bandit said STOP."""
        if batch_size >= capacity:
            return None
        candidate = self.tree.best_request()
        if candidate is None:
            return None
        oldest = self.tree.oldest_request()  # the age bound first: no request starves
        if oldest != candidate and waited_s(oldest) - waited_s(candidate) > self.max_wait_s:
            return oldest
        missing, shared = self.tree.missing[candidate], self.tree.shared_chunks(candidate)
        sharing_waiting = self.tree.waiting_sharing_first_chunk(candidate) if missing > 0 and batch_size > 0 else 0
        if missing > 0 and batch_size > 0 and (shared > 0 or sharing_waiting > 0):
            state = state_of(batch_size, missing, shared, sharing_waiting)
            action = self.bandit.choose(state) if self.learn else (self.bandit.greedy(state) or ADD)
            self.pending.append((state, action))
            if action == STOP:
                return None
        return candidate

    def take(self, request_id: str) -> None:
        self.tree.activate(request_id)

    def admit(self, batch_size: int, capacity: int, waited_s) -> list[str]:
        """Every request :meth:`candidate` admits, in order (each activated)."""
        chosen = []
        while (candidate := self.candidate(batch_size + len(chosen), capacity, waited_s)) is not None:
            self.take(candidate)
            chosen.append(candidate)
        return chosen

    def reward(self, batch_size: int, step_s: float, prefill_tokens: int = 0) -> None:
        """Credit the batch's decisions once it runs as a decode batch: a step that still
        prefills (the admitted requests' prompts) is not the batch's execution time, and
        crediting it would teach the bandit that admitting is slow."""
        if prefill_tokens > 0:
            return
        if self.pending and step_s > 0 and self.learn:
            self.bandit.credit(self.pending, batch_size / step_s)
        self.pending = []
