"""SGLang's prefill chunk set per step by a PreFT chunk policy (SLOWeave), from the same online
cost model the vLLM scheduler runs.

SGLang builds each step in ``Scheduler.get_new_batch_prefill``: with ``--enable-mixed-chunk`` the
running decodes join the prefill batch, and a ``PrefillAdder`` admits prefill tokens until
``scheduler.chunked_prefill_size`` minus the step's decode tokens is spent. :func:`sized_prefill`
wraps that call. Before it, the policy is asked for the step's prefill budget ``c`` from a
:class:`~preft.serving.scheduling.chunk_policies.StepView` of SGLang's state:

    decodes    the running batch's requests, each with its last- and first-token times (kept
               here, :meth:`ChunkControl.record`) and output tokens so far
    context    their cached tokens (``seqlen - 1`` each) plus the chunked request's computed ones
    pending    the chunked request's prompt left plus every waiting request's tokens (a prefix-
               cache hit is not known before SGLang matches it: it counts as prefill)

and SGLang's chunk for that one call is ``c + n`` (``n`` decodes share the budget in a mixed
step), so the step prefills at most ``c`` tokens. ``c = 0`` with decodes running is a decode-only
step: the pass returns no prefill batch, as SGLang's own ``--prefill-decode-interval`` does
(a chunked request keeps its place and goes on at a later pass).

After each step (:meth:`ChunkControl.record`, from the ``Scheduler.run_batch`` hook), every
request that got a token has its token time, and the step's shape and time,

    n = decodes, c = prefill tokens (a mixed batch's extend tokens less its decodes),
    x = cached tokens read (prefix lengths; a decode's ``seqlen - 1``),
    seconds = from the pass that built the step to the end of its forward,

go to the online cost model's ``observe`` (what the policy's next budgets rest on). A request in
a middle chunk (``inflight_middle_chunks > 0``) gets no token.

The policy only sizes chunks: which tokens each request computes, and so its tokens, do not change.
"""

from __future__ import annotations

import logging
import time

from preft.serving.scheduling.chunk_policies import StepView

logger = logging.getLogger(__name__)


class ChunkControl:
    """One SGLang scheduler's chunk policy and the token times it reads (see the module docstring)."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.cost_learner = getattr(policy, "cost_model", None)
        if not hasattr(self.cost_learner, "observe"):
            self.cost_learner = None
        self.last_token_s: dict[str, float] = {}
        self.first_token_s: dict[str, float] = {}
        self.pass_started_s: float | None = None
        self.logged: set[str] = set()  # the first cut chunk and the first decode-only step are logged

    def log_once(self, what: str, message: str, *args) -> None:
        if what not in self.logged:
            self.logged.add(what)
            logger.info(message, *args)

    def step_view(self, scheduler, running_batch, now: float) -> StepView:
        last, first, outputs, context = [], [], [], 0
        for req in running_batch.reqs:
            if req.finished():
                continue
            last.append(self.last_token_s.get(req.rid, now))
            first.append(self.first_token_s.get(req.rid, last[-1]))
            outputs.append(max(1, len(req.output_ids)))
            context += req.seqlen - 1
        pending, chunk_context = 0, 0
        chunked = scheduler.chunked_req
        if chunked is not None:
            chunk_context = chunked.extend_end or 0
            pending += max(0, chunked.seqlen - chunk_context)
        pending += sum(req.seqlen for req in scheduler.waiting_queue)
        return StepView(now=now, decode_last_token_times=tuple(last), decode_first_token_times=tuple(first),
                        decode_output_tokens=tuple(outputs), context_tokens=context + chunk_context,
                        pending_prefill_tokens=pending, prefill_context_tokens=chunk_context)

    def record(self, batch, started_s: float, now: float) -> None:
        """A step that ran: its requests' token times, its shape and time to the cost model."""
        mode = batch.forward_mode
        if mode.is_idle() or not batch.reqs:
            return
        for req in batch.reqs:
            if getattr(req, "inflight_middle_chunks", 0) > 0:  # a middle chunk: no token yet
                continue
            self.last_token_s[req.rid] = now
            self.first_token_s.setdefault(req.rid, now)
        if len(self.last_token_s) > 4 * len(batch.reqs) + 256:  # forget finished requests
            live = {req.rid for req in batch.reqs}
            self.last_token_s = {rid: t for rid, t in self.last_token_s.items() if rid in live}
            self.first_token_s = {rid: t for rid, t in self.first_token_s.items() if rid in live}
        if mode.is_decode():
            decodes, prefill, context = len(batch.reqs), 0, sum(req.seqlen - 1 for req in batch.reqs)
        else:
            decodes = len(batch.decoding_reqs or ())
            prefill, context = int(batch.extend_num_tokens) - decodes, int(sum(batch.prefix_lens))
        if self.cost_learner is not None:
            self.cost_learner.observe(decodes, prefill, context, now - started_s)


def sized_prefill(original, scheduler, running_batch, control: ChunkControl, plan_class):
    """SGLang's ``get_new_batch_prefill`` with this step's chunk set by ``control``'s policy; its
    plan, or a ``plan_class`` (SGLang's ``NextBatchPlan``) with no prefill batch when the policy
    gives the step no prefill token."""
    control.pass_started_s = now = time.monotonic()
    if not scheduler.waiting_queue and scheduler.chunked_req is None:
        return original(scheduler, running_batch)
    view = control.step_view(scheduler, running_batch, now)
    budget = control.policy.prefill_budget(view)
    if 0 < budget < view.pending_prefill_tokens:
        control.log_once("cut", "preft: %s gave a step %d of %d prefill tokens beside %d decodes",
                         control.policy.name, budget, view.pending_prefill_tokens, view.num_decodes)
    if budget <= 0 and view.num_decodes > 0:
        control.log_once("decode-only", "preft: %s gave a step no prefill (decode only) beside %d decodes",
                         control.policy.name, view.num_decodes)
        return plan_class(batch_to_run=None, running_batch=running_batch)
    saved = scheduler.chunked_prefill_size
    # in a mixed step the running decodes take their tokens out of SGLang's chunk
    scheduler.chunked_prefill_size = max(1, budget) + (len(running_batch.reqs) if scheduler.is_mixed_chunk else 0)
    try:
        return original(scheduler, running_batch)
    finally:
        scheduler.chunked_prefill_size = saved
