"""The engine's waiting queue in an admission order's order (FCFS, LPM, Feather or adapter groups).

vLLM's ``Scheduler.schedule()`` admits waiting requests through four calls on
``self.waiting`` (a ``RequestQueue``): ``bool(queue)`` (anything to admit?), ``peek_request``,
``pop_request`` (admitted, or skipped for this step) and ``prepend_request(s)`` (a preempted
request, or the step's skipped ones, back in front). :class:`AdmissionQueue` answers them
from one of :mod:`preft.serving.scheduling.admission`'s orders, the same objects the simulator
runs:

- ``bool`` / ``peek`` ask the order for its candidate given the running batch (its size is
  ``len(scheduler.running)``, its capacity ``max_num_seqs``). The answer is kept until the
  candidate is popped, so each admission decision is made once. When the order says STOP
  (Feather) the queue reads as empty for the rest of the step, and vLLM admits no more.
- ``pop`` is ``take`` (Feather: the request's chunks join the working set), ``prepend`` of a
  taken request is ``requeue``, ``remove`` (an abort) is ``remove``; a request that finishes
  (:meth:`finished`, from the scheduler's ``_free_request``) leaves the working set.

A request's keys are vLLM's own prefix-cache block hashes (``request.block_hashes``: chained,
so equal keys mean an equal prefix, and PreFT-aware: a block before a prefill-only adapter's
``adapter_start`` is keyed without the adapter, :mod:`preft.serving.engine_core`). So the
LPM and Feather need prefix caching on (``preft serve`` checks; the adapter-group order ranks by adapter). LPM matches them against the engine's
block pool (:class:`EnginePrefixCache`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.core.sched.request_queue import RequestQueue

from preft.serving.patching import require

for _name in ("peek_request", "pop_request", "prepend_request", "prepend_requests", "remove_requests"):
    require(RequestQueue, _name)


class EnginePrefixCache:
    """``hit_blocks(keys)`` over vLLM's block pool: how many leading block hashes are cached."""

    def __init__(self, kv_cache_manager) -> None:
        self.block_pool = require(kv_cache_manager, "block_pool")
        self.cached = require(self.block_pool, "cached_block_hash_to_block")
        self.group_id = 0  # one KV cache group: the decoder models served here have one

    def hit_blocks(self, keys: list) -> int:
        hits = 0
        for key in keys:
            if not self.cached.get_one_block(make_block_hash_with_group_id(key, self.group_id)):
                break
            hits += 1
        return hits


class AdmissionQueue(RequestQueue):
    """``self.waiting`` for :class:`~preft.serving.scheduler.PreftScheduler` (see the module docstring)."""

    def __init__(self, order, scheduler) -> None:
        self.order, self.scheduler = order, scheduler
        self.requests: dict[str, object] = {}  # waiting requests, front first
        self.keys: dict[str, list] = {}  # every request the order knows (waiting or taken)
        self.taken: set[str] = set()  # admitted and not finished: in the order's working set
        self.pick = None
        self.picked = False

    # -- the order's candidate, asked once per admission --------------------------------------
    def new_step(self) -> None:
        """A new step's batch: ask the order again."""
        self.picked, self.pick = False, None
        if hasattr(self.order, "new_step"):  # the adapter-group order ranks the waiting adapters
            self.order.new_step()

    def _candidate(self):
        if not self.picked:
            request_id = self.order.candidate(time.time(), len(self.scheduler.running),
                                              self.scheduler.max_num_running_reqs)
            self.pick = self.requests.get(request_id) if request_id is not None else None
            self.picked = True
        return self.pick

    def __bool__(self) -> bool:
        return self._candidate() is not None

    def peek_request(self):
        request = self._candidate()
        if request is None:
            raise IndexError("no waiting request to admit now")
        return request

    def pop_request(self):
        request = self.peek_request()
        self.order.take(request.request_id)
        del self.requests[request.request_id]
        self.taken.add(request.request_id)
        self.picked = False
        return request

    # -- arrivals, returns, aborts, finishes ---------------------------------------------------
    def add_request(self, request) -> None:
        request_id = request.request_id
        self.keys[request_id] = list(request.block_hashes)  # the prompt's full blocks
        self.requests[request_id] = request
        self.order.arrive(request_id, self.keys[request_id], request.arrival_time)
        self.picked = False

    def prepend_request(self, request) -> None:
        request_id = request.request_id
        self.requests = {request_id: request, **self.requests}  # first: an order may look the request up
        if request_id in self.taken:
            self.taken.discard(request_id)
            self.order.requeue(request_id, self.keys[request_id], request.arrival_time)
        elif request_id not in self.keys:
            self.keys[request_id] = list(request.block_hashes)
            self.order.arrive(request_id, self.keys[request_id], request.arrival_time)
        self.picked = False

    def prepend_requests(self, requests: Iterable) -> None:
        for request in reversed(list(requests)):  # the first given ends up in front
            self.prepend_request(request)

    def remove_request(self, request) -> None:
        request_id = request.request_id
        if request_id in self.requests:
            del self.requests[request_id]
            self.order.remove(request_id)
            del self.keys[request_id]
            self.picked = False

    def remove_requests(self, requests: Iterable) -> None:
        for request in requests:
            self.remove_request(request)

    def finished(self, request_id: str) -> None:
        """A request left the engine: a taken one leaves the order's working set."""
        if request_id in self.taken:
            self.taken.discard(request_id)
            self.order.finish(request_id)
            del self.keys[request_id]

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator:
        return iter(list(self.requests.values()))
