"""``PreftScheduler``: vLLM's scheduler, aware that prefill-only requests decode without adapters.

Passed to vLLM as ``scheduler_cls`` (:data:`preft.serving.SCHEDULER_CLS`; ``preft serve`` and
:mod:`preft.eval.harness.engine_driver` do it; with ``vllm.LLM`` pass
``scheduler_cls=preft.serving.SCHEDULER_CLS``). It runs in the engine-core process and asks
the plain-Python policies of :mod:`preft.serving.scheduling` each step (below).

- **LoRA slots** (``max_loras``): a running prefill-only request with no active position left
  (:meth:`~preft.rule.AdapterRule.needs_adapter_from`) decodes on the base model, so its
  adapter is hidden from vLLM's ``max_loras`` admission check for the duration of
  ``schedule()``: ``--max-adapters`` bounds concurrent *prefills*, not concurrent requests.
  A preempted request is recomputed from its prompt and counts again.
- **ReFT-P slots**: at most :func:`~preft.serving.reft.reft_slots` distinct ReFT-P bundles
  have active tokens in one step (the worker's bank has that many slots). A request whose
  chunk would need one more is left for a later step (``_reserve_prefill_lookahead``
  returning 0: a running request waits a step; admission stops, first come first served).
- **One request's failure is its own.** A request whose bundle cannot be served (its copy in
  the server's store gone or unreadable, :func:`~preft.serving.bundle_store.served_copy_problem`)
  is failed when it arrives, before it reaches the worker; a request whose adapter the worker
  could not set up (:data:`~preft.constants.FAILED_REQUESTS_ATTR` on the step's output) is
  failed with that step's tokens dropped. Either way the client gets vLLM's error answer (HTTP
  500), the reason goes to the log, and every other request goes on.
- **Prefill chunk policy** (:mod:`preft.serving.scheduling`, ``PREFT_SCHEDULER``, set by
  ``preft serve --scheduler``): before each step the policy sees the step
  (:class:`~preft.serving.scheduling.chunk_policies.StepView`: each decode's last-token time,
  recorded here in ``update_from_output``; context and prefill tokens left) and returns the
  step's prefill budget; ``_reserve_prefill_lookahead`` hands it out to prefill chunks in
  vLLM's own order and never caps a decode. ``default`` leaves vLLM's scheduling untouched.
- **Admission order** (``preft serve --scheduler lpm|feather|groups``, combinable with a chunk
  policy: ``feather+sloweave``): ``self.waiting`` becomes an
  :class:`~preft.serving.admission_queue.AdmissionQueue`, so vLLM admits waiting requests in
  the order's order (LPM: most cached blocks first; Feather: the CHT's fewest missing chunks,
  the bandit's ADD/STOP, an age bound; groups: each step's adapter slots to the adapters with the
  most waiting requests, told after each step which adapters the step ran with, :meth:`step_loras`). After each step the order gets the step's reward
  (Feather: batch size / step time, at the batch's first decode-only step); Feather's table is
  written to ``feather_state`` (atomically) every 30 s and at shutdown. Every running request
  decodes every step, as in vLLM and in the simulator: the batch is what admission made it.
- **Online step cost model** (SLOWeave, WavePP): each step's shape and time (schedule start to
  output) go to the policy's :class:`~preft.serving.scheduling.online_cost_model.OnlineCostModel`,
  which refits itself and bounds its own error; it is written to the spec's ``cost_state``
  (``STATE_DIR/step_cost_online.json`` under ``preft serve --state-dir``) every 30 s and at
  shutdown, with its report (fit, error quantiles per shape class, overhead).
- ``PREFT_TRACE_SCHEDULER=FILE`` appends, per step, how many running requests and distinct LoRA
  adapters among them there are, and how many distinct LoRA adapters the step's tokens run
  with (the slots it uses; read by the tests and the slot-limited benchmarks).
  ``PREFT_STEP_TRACE=FILE`` one JSON line per step with its shape and time, and the online cost
  model's prediction and bound for it (``preft eval profile`` fits the step cost model on it).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from vllm.v1.core.sched.request_queue import create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from preft import envs
from preft.constants import FAILED_REQUESTS_ATTR
from preft.bundle import bundle_rule
from preft.rule import AdapterRule
from preft.serving.bundle_store import served_copy_problem
from preft.serving.patching import require
from preft.serving.prompt_end import rule_prompt_length
from preft.serving.reft import reft_bundle_of, reft_slots
from preft.serving.scheduling.admission import admission_from_spec
from preft.serving.scheduling.chunk_policies import StepView, VllmDefault, policy_from_spec
from preft.serving.scheduling.online_cost_model import online_model_of
from preft.serving.scheduling.spec import PREFIX_ADMISSIONS, SchedulerSpec

logger = logging.getLogger(__name__)

# the internals this subclass relies on (a vLLM release that moves them fails here, loudly)
for _name in ("schedule", "_reserve_prefill_lookahead", "update_from_output", "add_request", "finish_requests",
              "_free_request", "shutdown"):
    require(Scheduler, _name)
require(RequestStatus, "FINISHED_ERROR")


def bundle_problem(request) -> str | None:
    """Why ``request``'s adapter cannot be served now (see :func:`served_copy_problem`), or None."""
    if request.lora_request is not None:
        return served_copy_problem("lora", request.lora_request.lora_path)
    bundle = reft_bundle_of(getattr(request, "sampling_params", None))
    return served_copy_problem("reft", bundle) if bundle else None


def _is_decode(request, num_computed_tokens: int) -> bool:
    """Only the request's last token is left to compute: a decode (or a one-token final chunk,
    which costs the same), never capped by a prefill budget."""
    return num_computed_tokens >= request.num_tokens - 1


def _lora_rule(request) -> tuple[AdapterRule, int]:
    """The rule of ``request``'s LoRA and its ``P``, read once per request: neither changes while
    it lives, and with many users every step asks for every running request's."""
    lora, known = request.lora_request, request.__dict__.get("_preft_lora_rule")
    if known is None or known[0] is not lora:
        known = request.__dict__["_preft_lora_rule"] = (lora, bundle_rule(lora.lora_path), _rule_prompt_length(request))
    return known[1], known[2]


def _decoding_without_adapter(request) -> bool:
    if request.lora_request is None:
        return False
    rule, prompt_length = _lora_rule(request)
    return not rule.needs_adapter_from(request.num_computed_tokens, prompt_length)


def _rule_prompt_length(request) -> int:
    """The rule's ``P`` of ``request`` (its prompt length, or its ``preft_prompt_end``)."""
    return rule_prompt_length(getattr(request.sampling_params, "extra_args", None), request.num_prompt_tokens)


@dataclass
class SchedulerStep:
    """What :class:`PreftScheduler` knows of the step it is scheduling, made in one place at the
    start of ``schedule()`` (:meth:`PreftScheduler.new_step`) and read until the step's output:
    when it started, the chunk policy's prefill budget (as given, and what is left of it while
    vLLM hands out tokens; None: vLLM's own budget only), and the ReFT-P bundles that have a
    slot this step."""

    started_s: float | None = None
    budget_given: int | None = None
    prefill_budget_left: int | None = None
    reft_bundles: set[str] = field(default_factory=set)


class PreftScheduler(Scheduler):
    """vLLM's ``Scheduler`` with PreFT's adapter-slot accounting (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reft_slots = reft_slots(self.lora_config)
        self.preft_step = SchedulerStep()  # the step being scheduled (none yet)
        self.refused: dict[str, str] = {}  # request id -> why its adapter cannot be served (arrived so)
        self.failed_unreported: list = []  # requests failed since the last output was made
        self.admission = None  # the AdmissionQueue when an admission order is set (None: vLLM's FCFS queue)
        self.feather_state: str | None = None
        self.cost_learner = None  # SLOWeave's/WavePP's online cost model, when the chunk policy has one
        self.cost_state: str | None = None
        self.feather_saved_s = self.cost_saved_s = time.monotonic()
        self.set_policies(envs.PREFT_SCHEDULER)
        self.last_token_s: dict[str, float] = {}  # request id -> monotonic time of its latest token
        self.first_token_s: dict[str, float] = {}  # request id -> monotonic time of its first token
        self.last_output_s: float | None = None
        self.step_trace = envs.PREFT_STEP_TRACE
        logger.info("preft: prefill chunk policy %s", self.chunk_policy.name)

    def set_policies(self, spec: dict) -> None:
        """The chunk policy and admission order a scheduler spec names (``PREFT_SCHEDULER``; the
        engine driver switches them between batches, while nothing waits)."""
        from preft.serving.admission_queue import AdmissionQueue, EnginePrefixCache

        if self.waiting:
            raise RuntimeError("the scheduling policies change only while no request waits")
        spec = SchedulerSpec.from_json(spec) if isinstance(spec, dict) else spec
        if spec.wavepp:  # its chunks are sized for this engine's pipeline stages
            spec = spec.with_stages(self.vllm_config.parallel_config.pipeline_parallel_size)
        self.chunk_policy = policy_from_spec(spec)
        if getattr(self.chunk_policy, "max_chunk", 0) > self.max_num_scheduled_tokens:
            logger.warning("preft: the %s scheduler's largest chunk %d is over the engine's token budget %d "
                           "(--max-num-batched-tokens): chunks stop at the budget", self.chunk_policy.name,
                           self.chunk_policy.max_chunk, self.max_num_scheduled_tokens)
        self.save_feather_state()  # the outgoing order's table, if it learned one
        self.save_cost_state()  # and the outgoing online cost model
        slots = self.lora_config.max_loras if self.lora_config else None
        host = getattr(self.lora_config, "max_cpu_loras", None) if self.lora_config else None
        if spec.admission == "groups" and not self.lora_config:
            raise ValueError("the groups admission order ranks requests by their LoRA adapter: "
                             "it needs LoRA on (--enable-lora)")
        order = admission_from_spec(spec, cache=EnginePrefixCache(self.kv_cache_manager), adapter_of=self._lora_of,
                                    slots=slots, host=host)
        if spec.admission in PREFIX_ADMISSIONS and not self.cache_config.enable_prefix_caching:
            raise ValueError(f"the {order.name} admission order keys requests by their prefix-cache blocks: "
                             "it needs prefix caching on")
        self.admission = AdmissionQueue(order, self) if order is not None else None
        self.waiting = self.admission if order is not None else create_request_queue(self.policy)
        self.feather_state = spec.feather_state
        self.cost_learner = online_model_of(self.chunk_policy)
        self.cost_state = spec.cost_state if self.cost_learner is not None else None
        logger.info("preft: prefill chunk policy %s, admission %s", self.chunk_policy.name,
                    order.name if order is not None else "fcfs")

    def _lora_of(self, request_id: str) -> int | None:
        """The LoRA adapter id of a request (None: none; the adapter-group order's ``adapter_of``)."""
        request = self.admission.requests.get(request_id) if self.admission is not None else None
        request = request if request is not None else self.requests.get(request_id)  # (vLLM adds it after)
        lora = request.lora_request if request is not None else None
        return lora.lora_int_id if lora is not None else None

    def save_feather_state(self) -> None:
        """Feather's learned table to ``feather_state`` (atomically), when there is one."""
        if self.admission is None or self.feather_state is None or self.admission.order.name != "feather":
            return
        try:
            self.admission.order.admission.bandit.save(self.feather_state)
        except OSError as err:  # the server goes on; the table is kept in memory
            logger.error("preft: cannot write the Feather state %s: %s", self.feather_state, err)
        self.feather_saved_s = time.monotonic()

    def save_cost_state(self) -> None:
        """The online step cost model to ``cost_state`` (atomically), when there are both."""
        if self.cost_learner is not None and self.cost_state is not None:
            try:
                self.cost_learner.save(self.cost_state)
            except OSError as err:  # the server goes on; the model is kept in memory
                logger.error("preft: cannot write the online step cost state %s: %s", self.cost_state, err)
        self.cost_saved_s = time.monotonic()

    def shutdown(self) -> None:
        self.save_feather_state()
        self.save_cost_state()
        super().shutdown()

    def _free_request(self, request, *args, **kwargs):
        if self.admission is not None:
            self.admission.finished(request.request_id)
        return super()._free_request(request, *args, **kwargs)

    def add_request(self, request) -> None:
        super().add_request(request)
        problem = bundle_problem(request)
        if problem is not None:
            self.refused[request.request_id] = problem

    def fail_requests(self, reasons: dict[str, str]) -> None:
        """Finish these requests with an error (their KV freed; the next output tells their clients)."""
        for request in self.finish_requests(list(reasons), RequestStatus.FINISHED_ERROR):
            logger.error("preft: request %s failed: %s", request.request_id, reasons[request.request_id])
            self.failed_unreported.append(request)

    def schedule(self, *args, **kwargs):
        if self.refused:  # before scheduling: a refused request never reaches the worker
            self.fail_requests(self.refused)
            self.refused = {}
        self.preft_step = self.new_step(time.monotonic())
        if self.admission is not None:
            self.admission.new_step()
        hidden = []
        if self.lora_config:
            for request in self.running:
                if _decoding_without_adapter(request):
                    hidden.append((request, request.lora_request))
                    request.lora_request = None
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            for request, lora_request in hidden:
                request.lora_request = lora_request
        trace = envs.PREFT_TRACE_SCHEDULER
        slot_user = self.admission is not None and hasattr(self.admission.order, "used")
        if (trace and self.running) or slot_user:
            active = self.step_loras(output)
            if slot_user:  # the adapter-group order mirrors the worker's adapter caches
                self.admission.order.used(active)
            if trace and self.running:
                adapters = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
                with open(trace, "a") as handle:
                    handle.write(f"{len(self.running)} {len(adapters)} {len(active)}\n")
        return output

    def step_loras(self, output) -> set[int]:
        """The LoRA adapters a scheduled step's tokens run with (the worker activates these: what
        holds a slot), under each request's rule."""
        active = set()
        for request_id, scheduled in output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.lora_request is None:
                continue
            first = request.num_computed_tokens - scheduled  # vLLM advanced it while scheduling
            rule, prompt_length = _lora_rule(request)
            if rule.active_in(first, first + scheduled, prompt_length):
                active.add(request.lora_request.lora_int_id)
        return active

    def new_step(self, now: float) -> SchedulerStep:
        """The record of a step starting at ``now``: its prefill budget asked of the chunk policy."""
        budget = None if isinstance(self.chunk_policy, VllmDefault) else self.chunk_policy.prefill_budget(
            self.step_view(now))
        return SchedulerStep(started_s=now, budget_given=budget, prefill_budget_left=budget)

    def step_view(self, now: float) -> StepView:
        """What the chunk policy sees: running decodes (their last-token times), prefill left over
        running and waiting requests (prefix-cache hits not yet known count as prefill)."""
        last_times, first_times, outputs, context, first_pending, pending = [], [], [], 0, None, 0
        for request in self.running:
            if _is_decode(request, request.num_computed_tokens):
                last_times.append(self.last_token_s.get(request.request_id, now))
                first_times.append(self.first_token_s.get(request.request_id, last_times[-1]))
                outputs.append(max(1, request.num_output_tokens))
                context += request.num_computed_tokens
            else:
                pending += request.num_tokens - request.num_computed_tokens
                first_pending = request.num_computed_tokens if first_pending is None else first_pending
        for request in self.waiting:
            pending += request.num_tokens - request.num_computed_tokens
        return StepView(now=now, decode_last_token_times=tuple(last_times),
                        decode_first_token_times=tuple(first_times), decode_output_tokens=tuple(outputs),
                        context_tokens=context + (first_pending or 0), prefill_context_tokens=first_pending or 0,
                        pending_prefill_tokens=pending)

    def _record_step(self, scheduler_output, model_runner_output, now: float) -> None:
        """Each request that got a token this step: its last-token time. With ``PREFT_STEP_TRACE``,
        the step's shape and time (schedule start to output) and the gap before it."""
        sampled = model_runner_output.sampled_token_ids
        for request_id, index in model_runner_output.req_id_to_index.items():
            if index < len(sampled) and sampled[index]:
                self.last_token_s[request_id] = now
                self.first_token_s.setdefault(request_id, now)
        if len(self.last_token_s) > 2 * len(self.requests) + 64:  # forget finished requests
            self.last_token_s = {k: v for k, v in self.last_token_s.items() if k in self.requests}
            self.first_token_s = {k: v for k, v in self.first_token_s.items() if k in self.requests}
        if self.preft_step.started_s is None or not (self.step_trace or self.admission is not None
                                                     or self.cost_learner is not None):
            return
        decodes = prefill = context = 0
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None:
                continue
            computed_before = request.num_computed_tokens - scheduled  # vLLM advanced it at schedule time
            context += computed_before
            if scheduled == 1 and _is_decode(request, computed_before):
                decodes += 1
            else:
                prefill += scheduled
        seconds = now - self.preft_step.started_s
        predicted = upper = None
        if self.cost_learner is not None and scheduler_output.num_scheduled_tokens:
            if self.step_trace:  # what the model said of this step before it learns from it
                predicted = self.cost_learner(decodes, prefill, context)
                upper = self.cost_learner.upper(decodes, prefill, context)
            self.cost_learner.observe(decodes, prefill, context, seconds)
            if now - self.cost_saved_s > 30.0:
                self.save_cost_state()
        if self.admission is not None:  # the order's reward for the batch that ran (Feather learns from it)
            self.admission.order.reward(len(scheduler_output.num_scheduled_tokens), seconds, prefill)
            if self.feather_state and now - self.feather_saved_s > 30.0:
                self.save_feather_state()
        if not self.step_trace:
            return
        gap = None if self.last_output_s is None else self.preft_step.started_s - self.last_output_s
        with open(self.step_trace, "a") as handle:
            handle.write(json.dumps({"n": decodes, "c": prefill, "x": context,
                                     "seconds": seconds, "gap_s": gap, "predicted_s": predicted, "upper_s": upper,
                                     "budget": self.preft_step.budget_given, "policy": self.chunk_policy.name,
                                     "admission": self.admission.order.name if self.admission is not None else "fcfs",
                                     "waiting": len(self.waiting), "running": len(self.running)}) + "\n")

    def update_from_output(self, scheduler_output, model_runner_output):
        self._record_step(scheduler_output, model_runner_output, time.monotonic())
        # the worker's failures first: finished requests are skipped below, so their tokens are dropped
        failed = getattr(model_runner_output, FAILED_REQUESTS_ATTR, None)
        if failed:
            self.fail_requests(failed)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in self.failed_unreported:
            outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(
                EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                 finish_reason=request.get_finished_reason(), trace_headers=request.trace_headers))
        self.failed_unreported = []
        self.last_output_s = time.monotonic()
        return outputs

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        capped = self.preft_step.prefill_budget_left is not None and not _is_decode(request, num_computed_tokens)
        if capped:  # the chunk policy's budget for this step's prefill tokens
            num_new_tokens = min(num_new_tokens, self.preft_step.prefill_budget_left)
        sized = getattr(self.chunk_policy, "prefill_chunk", None)
        if sized is not None and num_new_tokens and not _is_decode(request, num_computed_tokens):
            # WavePP: this request's next chunk of its plan (a recomputed request: over all its tokens)
            num_new_tokens = min(num_new_tokens, sized(request.request_id, num_computed_tokens, request.num_tokens))
        num_new_tokens = self._reft_slot_allows(request, num_computed_tokens, num_new_tokens)
        if capped:
            self.preft_step.prefill_budget_left -= num_new_tokens
        return num_new_tokens

    def _reft_slot_allows(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        bundle = reft_bundle_of(getattr(request, "sampling_params", None))
        if not num_new_tokens or bundle is None or bundle in self.preft_step.reft_bundles:
            return num_new_tokens
        if not bundle_rule(bundle).active_in(num_computed_tokens, num_computed_tokens + num_new_tokens,
                                             _rule_prompt_length(request)):
            return num_new_tokens
        if len(self.preft_step.reft_bundles) >= self.reft_slots:
            return 0  # every ReFT-P slot of this step is taken: a later step
        self.preft_step.reft_bundles.add(bundle)
        return num_new_tokens
