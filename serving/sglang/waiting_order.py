"""SGLang's waiting queue in an admission order's order (Feather; FCFS for tests).

SGLang builds each prefill batch in ``Scheduler.get_new_batch_prefill``: it sorts
``scheduler.waiting_queue`` (``--schedule-policy``: fcfs keeps arrival order), then adds requests
from its front while the token budget and the running batch have room, and keeps the rest
waiting. :func:`admit_in_order` wraps that call. Before it, the order picks the requests this
step may admit, one ``candidate`` at a time as the simulator asks (batch size = SGLang's running
batch plus those already picked, capacity = ``max_running_requests``); SGLang then sees only
those, in that order, so a STOP (Feather) ends the step's admissions. After it, the picked
requests SGLang could not place are ``requeue``\\ d, and the rest of the queue comes back behind
them.

Between calls the queue is SGLang's again (arrivals, aborts, retractions), so each call first
catches up with it: a new request ``arrive``\\ s (keyed by the chunk hashes of its prompt,
:func:`~preft.serving.scheduling.chunked_hash_tree.chunk_keys`), a waiting one gone without
running is ``remove``\\ d (aborted), a taken one back in the queue is ``requeue``\\ d (retracted),
and a taken one neither running nor waiting ``finish``\\ es. :func:`reward` hands each
step's time to the order (Feather learns from decode steps).

The order never changes tokens: which requests share a batch, not what any of them computes.
"""

from __future__ import annotations

import time

from preft.serving.scheduling.chunked_hash_tree import chunk_keys

#: tokens per Chunked Hash Tree key: SGLang's radix cache is per token; Feather's keys are per chunk
CHUNK_TOKENS = 16


class WaitingOrder:
    """One scheduler's bookkeeping between SGLang's requests and an admission order."""

    def __init__(self, order, chunk_tokens: int = CHUNK_TOKENS) -> None:
        self.order, self.chunk_tokens = order, chunk_tokens
        self.waiting: dict[str, float] = {}  # rid -> arrival time, as the order knows it waiting
        self.taken: dict[str, float] = {}  # rid -> arrival time, picked (in the working set)
        self.keys: dict[str, list] = {}
        self.own_s = 0.0  # time spent ordering, outside SGLang's own call

    def _keys(self, req) -> list:
        if req.rid not in self.keys:
            self.keys[req.rid] = chunk_keys(req.origin_input_ids, self.chunk_tokens, getattr(req, "lora_id", None))
        return self.keys[req.rid]

    def catch_up(self, waiting_queue: list, running_rids: set[str], now: float) -> None:
        queued = {req.rid for req in waiting_queue}
        for req in waiting_queue:
            if req.rid in self.taken:  # retracted after it ran: waiting again, as old as it was
                arrived = self.taken.pop(req.rid)
                self.order.requeue(req.rid, self._keys(req), arrived)
                self.waiting[req.rid] = arrived
            elif req.rid not in self.waiting:
                self.order.arrive(req.rid, self._keys(req), now)
                self.waiting[req.rid] = now
        for rid in [rid for rid in self.waiting if rid not in queued]:  # aborted while waiting
            self.order.remove(rid)
            del self.waiting[rid], self.keys[rid]
        for rid in [rid for rid in self.taken if rid not in queued and rid not in running_rids]:
            self.order.finish(rid)
            del self.taken[rid], self.keys[rid]

    def pick(self, batch_size: int, capacity: int, now: float) -> list[str]:
        """The requests this step may admit, in order (each taken)."""
        picked = []
        while (rid := self.order.candidate(now, batch_size + len(picked), capacity)) is not None:
            self.order.take(rid)
            self.taken[rid] = self.waiting.pop(rid)
            picked.append(rid)
        return picked

    def not_placed(self, req) -> None:
        """A picked request SGLang kept waiting this step."""
        arrived = self.taken.pop(req.rid)
        self.order.requeue(req.rid, self._keys(req), arrived)
        self.waiting[req.rid] = arrived


def running_request_ids(scheduler) -> set[str]:
    """The running batch's requests, the last step's (a request just prefilled) and the one in a
    chunked prefill."""
    rids = {req.rid for req in scheduler.running_batch.reqs}
    if getattr(scheduler, "last_batch", None) is not None:
        rids.update(req.rid for req in scheduler.last_batch.reqs)
    if scheduler.chunked_req is not None:
        rids.add(scheduler.chunked_req.rid)
    return rids


def admit_in_order(original, scheduler, *args, **kwargs):
    """AROUND hook on ``Scheduler.get_new_batch_prefill``: SGLang admits from the requests the
    scheduler's :class:`WaitingOrder` picks, in its order; the rest wait for a later step. The
    hook's own time (not SGLang's call) is added to the order's ``own_s``. With nothing waiting
    the pass is SGLang's alone (its loop asks on every turn, idle ones included); the order
    catches up with finished requests at the next pass that has a request to place."""
    if not scheduler.waiting_queue:
        return original(scheduler, *args, **kwargs)
    started = time.perf_counter()
    state: WaitingOrder = scheduler.preft_waiting_order
    running_batch = args[0] if args else kwargs["running_batch"]
    now = time.monotonic()
    state.catch_up(scheduler.waiting_queue, running_request_ids(scheduler), now)
    by_rid = {req.rid: req for req in scheduler.waiting_queue}
    picked = state.pick(len(running_batch.reqs), scheduler.max_running_requests, now)
    chosen = set(picked)
    held_back = [req for req in scheduler.waiting_queue if req.rid not in chosen]
    scheduler.waiting_queue = [by_rid[rid] for rid in picked]
    state.own_s += time.perf_counter() - started
    try:
        return original(scheduler, *args, **kwargs)
    finally:
        started = time.perf_counter()
        left = scheduler.waiting_queue  # picked but not placed (and anything SGLang put back)
        for req in reversed(left):  # each goes back in front: the last first keeps their order
            if req.rid in state.taken:
                state.not_placed(req)
        scheduler.waiting_queue = left + held_back
        state.own_s += time.perf_counter() - started


def reward(state: WaitingOrder, batch, step_s: float) -> None:
    """A step's time to the order (Feather learns from decode steps only)."""
    prefill_tokens = 0 if batch.forward_mode.is_decode() else int(batch.extend_num_tokens or 0)
    state.order.reward(len(batch.reqs), step_s, prefill_tokens)
