"""Event-driven simulator of one engine: a workload replayed through a chunk policy, time
advanced by the step cost model.

The engine it models is vLLM's continuous batching, step by step:

1. Requests that have arrived join the waiting queue (first come first served).
2. The policy sees the step (:class:`.chunk_policies.StepView`: now, each decode's last token
   time, context tokens, prefill left) and returns the step's prefill budget.
3. Running requests are scheduled in admission order: a decode takes one token; a partial
   prefill takes what the token budget and the prefill budget leave. Waiting requests are then
   admitted while slots (``max_num_seqs``) and both budgets last.
4. The step takes ``T(n_decodes, prefill_tokens, context_tokens)`` (the cost model; a policy's
   online cost model is shown each step as it ran, as the engine's scheduler does). At its
   end every decode, and every prefill that completed its prompt, has one more token; the next
   step is decided ``gap_s`` later (the engine's measured time between a step's output and the
   next schedule, which the engine's SLOWeave also sees as time already gone).

A conversation's follow-up turn (``RequestSpec.after``) arrives ``think_s`` after the turn it
follows finishes (a closed loop, as a user waits for the answer before asking again).

Between steps nothing happens, so the clock jumps from step to step (and to the next arrival
when the engine is idle): 10k requests simulate in seconds. Not modelled: preemption, and KV
capacity unless a prefix cache is given.

With ``prefix_cache`` (:class:`.prefix_cache.PrefixCache`) a request's cached prefix blocks are
not computed again and admission waits for KV blocks; with ``admission`` (:mod:`.admission`)
the waiting requests join in that order (FCFS, LPM, Feather, adapter groups: it hears the
adapters each step ran with, as in the engine) instead of first come first served.

With ``max_loras`` (vLLM's adapter slots) at most that many distinct adapters are held at once:
a request holds its adapter's slot from its first prefill token while any of its positions is
still active under its rule (``adapter_rules``, default all-token): a prefill-only request gives
it back when its prompt is done, an all-token one at its last token. A waiting request whose
adapter would be one slot too many is passed over for this step and stays in its place, as
vLLM's scheduler skips it; ``step_adapters`` records, per step, the distinct adapters active in
it, and ``slot_loads`` / ``host_loads`` count the adapters a step had to bring into a slot / into
host memory (vLLM's two least-recently-used caches, ``max_loras`` and ``max_cpu_loras``:
``host_adapters``, default every adapter). Their cost is not modelled: the counts say how often
the engine would pay it.

``shared_context_cost`` (default 1: no effect) is what a decode's context token costs when
another decode of the same step reads the same prompt block (a prefix-homogeneous batch reads
that KV once into cache, and attention over it is cheaper). The step is then costed at

    x_eff = x − (1 − shared_context_cost) · duplicated_tokens

where ``duplicated_tokens`` counts the decodes' prompt blocks beyond each block's first reader.
``preft eval prefix`` sets it from its direct measurement on the engine (``decode-batch``), so
the simulator carries the effect exactly as far as it was measured.

With a :class:`~.roofline.RooflineCostModel` (``preft eval plan``) each step is costed from all
its terms instead (:meth:`Simulator.roofline_step`): the decodes' and the chunks' context
apart, a prompt block several decodes read counted once, and the distinct adapters active in
the step with the tokens they touch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace

from preft.rule import ALL_TOKEN
from preft.serving.scheduling.chunk_policies import StepView
from preft.serving.scheduling.cost_model import StepCostModel
from preft.serving.scheduling.metrics import RequestTiming
from preft.serving.scheduling.workloads import RequestSpec


@dataclass
class _Running:
    spec: RequestSpec
    computed: int = 0  # tokens whose KV exists (prompt, then generated)
    generated: int = 0
    first_token_s: float | None = None
    last_token_s: float = 0.0

    @property
    def prefilling(self) -> bool:
        return self.computed < self.spec.prompt_tokens


@dataclass
class SimulationResult:
    timings: list[RequestTiming]
    steps: int
    clock_s: float
    step_shapes: list[tuple[int, int, int]] = field(default_factory=list)  # (n, c, x) per step, when recorded
    specs: list[RequestSpec] = field(default_factory=list)  # the request of each timing (a follow-up turn
    # with the arrival it was given)
    recomputed_tokens: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens it prefilled
    step_adapters: list[int] = field(default_factory=list)  # distinct adapters active per step, when recorded
    slot_loads: int = 0  # adapters a step brought into a slot (with max_loras)
    host_loads: int = 0  # adapters a step brought into host memory (with max_loras)

    def summary(self, ttft_s: float, tpot_s: float) -> dict:
        from preft.serving.scheduling.metrics import summarize

        return {**summarize(self.timings, ttft_s, tpot_s), "steps": self.steps}


class Simulator:
    """One engine (see the module docstring). ``max_num_batched_tokens`` is vLLM's per-step token
    budget; ``gap_s`` the time between one step's tokens and the next step's decision."""

    def __init__(self, cost_model: StepCostModel, policy, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, gap_s: float | None = None, record_shapes: bool = False,
                 admission=None, prefix_cache=None, adapter_rules: dict | None = None,
                 shared_context_cost: float = 1.0, max_loras: int | None = None,
                 host_adapters: int | None = None) -> None:
        self.cost_model, self.policy = cost_model, policy
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.gap_s = cost_model.meta.get("gap_s", 0.0) if gap_s is None else gap_s
        self.record_shapes = record_shapes
        self.admission_factory = admission  # callable: a fresh admission order per run (None: FCFS)
        self.prefix_cache_factory = prefix_cache  # callable: a fresh PrefixCache per run (None: no cache)
        self.adapter_rules = adapter_rules or {}
        if not 0.0 <= shared_context_cost <= 1.0:
            raise ValueError(f"shared_context_cost must be in [0, 1], got {shared_context_cost}")
        self.shared_context_cost = shared_context_cost
        if max_loras is not None and max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self.host_adapters = host_adapters

    def holds_slot(self, request: _Running) -> bool:
        """Whether ``request`` still needs its adapter: some position from ``computed`` on is active."""
        if request.spec.adapter is None:
            return False
        rule = self.adapter_rules.get(request.spec.adapter) or ALL_TOKEN
        return rule.needs_adapter_from(request.computed, request.spec.prompt_tokens)

    def roofline_step(self, scheduled: list, keys: dict, block: int) -> float:
        """A step costed by a :class:`~.roofline.RooflineCostModel`: the decodes' and the chunks'
        context apart, the decodes' prompt blocks read more than once in the step (read once), and
        the adapters active in the step with the tokens they touch (under each request's rule)."""
        decodes = [(r, t) for r, t in scheduled if not r.prefilling]
        chunks = [(r, t) for r, t in scheduled if r.prefilling]
        blocks = [key for request, _ in decodes for key in keys[request.spec.request_id]]
        adapters, adapter_tokens = set(), 0
        for request, tokens in scheduled:
            if request.spec.adapter is None:
                continue
            rule = self.adapter_rules.get(request.spec.adapter) or ALL_TOKEN
            active = rule.active_count(request.computed, request.computed + tokens, request.spec.prompt_tokens)
            if active:
                adapters.add(request.spec.adapter)
                adapter_tokens += active
        return self.cost_model.step(len(decodes), sum(t for _, t in chunks),
                                    decode_context=sum(r.computed for r, _ in decodes),
                                    prefill_context=sum(r.computed for r, _ in chunks),
                                    shared_context=(len(blocks) - len(set(blocks))) * block,
                                    adapters=len(adapters), adapter_tokens=adapter_tokens)

    def run(self, workload: list[RequestSpec]) -> SimulationResult:
        from preft.serving.scheduling.admission import FirstComeFirstServed
        from preft.serving.scheduling.prefix_cache import filled_keys, workload_keys

        from preft.serving.scheduling.online_cost_model import online_model_of
        from preft.serving.scheduling.adapter_groups import LeastRecentlyUsed

        learner = online_model_of(self.policy)
        cache = self.prefix_cache_factory() if self.prefix_cache_factory else None
        admission = self.admission_factory(cache) if self.admission_factory else FirstComeFirstServed()
        block = cache.block_tokens if cache else 16
        keys: dict[str, list] = {}
        specs: dict[str, RequestSpec] = {}
        # follow-up turns wait for the turn they follow; the rest arrive when the workload says
        follow_ups: dict[str, list[RequestSpec]] = {}
        for spec in workload:
            if spec.after is not None:
                follow_ups.setdefault(spec.after, []).append(spec)
        arrivals = [(spec.arrival_s, index, spec) for index, spec in enumerate(workload) if spec.after is None]
        heapq.heapify(arrivals)
        released = len(workload)  # tie-breaker of released follow-ups
        finished_specs: list[RequestSpec] = []
        recomputed: dict[str, int] = {}
        waiting = admission  # the waiting requests live in the admission order
        running: list[_Running] = []
        timings: list[RequestTiming] = []
        shapes: list[tuple[int, int, int]] = []
        step_adapters: list[int] = []
        slot_cache = LeastRecentlyUsed(self.max_loras) if self.max_loras else None
        host_cache = LeastRecentlyUsed(max(self.max_loras, self.host_adapters)) if self.max_loras and \
            self.host_adapters else None
        slot_loads = host_loads = 0
        now, steps = 0.0, 0
        waiting_tokens = 0  # prompt tokens of the waiting queue, kept as it changes (no rescan per step)
        while arrivals or waiting or running:
            while arrivals and arrivals[0][0] <= now:
                spec = heapq.heappop(arrivals)[2]
                specs[spec.request_id] = spec
                keys[spec.request_id] = workload_keys(spec, block, self.adapter_rules.get(spec.adapter))
                admission.arrive(spec.request_id, keys[spec.request_id], spec.arrival_s)
                waiting_tokens += spec.prompt_tokens
            if not len(waiting) and not running:
                now = arrivals[0][0]
                continue
            decodes = [r for r in running if not r.prefilling]
            pending = [r for r in running if r.prefilling]
            first_context = pending[0].computed if pending else 0
            pending_tokens = sum(r.spec.prompt_tokens - r.computed for r in pending)
            pending_tokens += waiting_tokens
            view = StepView(now=now, decode_last_token_times=tuple(r.last_token_s for r in decodes),
                            decode_first_token_times=tuple(r.first_token_s for r in decodes),
                            decode_output_tokens=tuple(r.generated for r in decodes),
                            context_tokens=sum(r.computed for r in decodes) + first_context,
                            prefill_context_tokens=first_context, pending_prefill_tokens=pending_tokens)
            prefill_budget = self.policy.prefill_budget(view)
            if hasattr(admission, "new_step"):  # the adapter-group order ranks the waiting adapters
                admission.new_step()
            token_budget = self.max_num_batched_tokens
            scheduled: list[tuple[_Running, int]] = []
            context = 0
            for request in running:  # admission order, as vLLM's running list
                if token_budget <= 0:
                    break
                if not request.prefilling:
                    scheduled.append((request, 1))
                    token_budget -= 1
                    context += request.computed
                    continue
                chunk = min(request.spec.prompt_tokens - request.computed, token_budget, prefill_budget)
                if chunk > 0:
                    scheduled.append((request, chunk))
                    token_budget -= chunk
                    prefill_budget -= chunk
                    context += request.computed
            held = {r.spec.adapter for r in running if self.holds_slot(r)} if self.max_loras else set()
            passed_over: list[str] = []
            while token_budget > 0 and prefill_budget > 0:
                request_id = admission.candidate(now, len(running), self.max_num_seqs)
                if request_id is None:
                    break
                spec = specs[request_id]
                if self.max_loras and spec.adapter is not None and spec.adapter not in held \
                        and len(held) >= self.max_loras:  # no slot for its adapter: the next one may fit
                    admission.take(request_id)
                    passed_over.append(request_id)
                    continue
                if spec.adapter is not None:
                    held.add(spec.adapter)
                computed = 0
                if cache is not None:
                    computed = cache.admit(keys[request_id], spec.prompt_tokens, spec.output_tokens)
                    if computed is None:  # its blocks do not fit: admission waits, as vLLM's does
                        break
                admission.take(request_id)
                request = _Running(spec, computed=computed)
                recomputed[request_id] = spec.prompt_tokens - computed
                waiting_tokens -= spec.prompt_tokens
                running.append(request)
                chunk = min(spec.prompt_tokens - computed, token_budget, prefill_budget)
                scheduled.append((request, chunk))
                token_budget -= chunk
                prefill_budget -= chunk
            for request_id in reversed(passed_over):  # back in their places, as old as they were
                admission.requeue(request_id, keys[request_id], specs[request_id].arrival_s)
            if not scheduled:  # nothing could run: a policy that starves prefill, or a cache too small
                raise RuntimeError(f"policy {getattr(self.policy, 'name', self.policy)} scheduled nothing "
                                   f"at t={now:.3f}s with {len(waiting)} waiting and no decodes (a request "
                                   f"larger than the KV cache?)")
            n = sum(1 for request, tokens in scheduled if not request.prefilling)
            c = sum(tokens for request, tokens in scheduled if request.prefilling)
            if self.record_shapes or hasattr(admission, "used") or slot_cache is not None:
                active = {r.spec.adapter for r, _ in scheduled if self.holds_slot(r)}
                for adapter in sorted(active) if slot_cache is not None else ():  # as vLLM's worker caches them
                    slot_loads += slot_cache.touch(adapter)
                    host_loads += host_cache.touch(adapter) if host_cache is not None else 0
                if hasattr(admission, "used"):  # the adapter-group order: the adapters this step ran with
                    admission.used(active)
                if self.record_shapes:
                    shapes.append((n, c, context))
                    step_adapters.append(len(active))
            if self.shared_context_cost < 1.0:  # decodes reading one prompt block: the later readers cost less
                blocks = [key for request, _ in scheduled if not request.prefilling
                          for key in keys[request.spec.request_id]]
                context -= (1.0 - self.shared_context_cost) * (len(blocks) - len(set(blocks))) * block
            if hasattr(self.cost_model, "step"):  # a roofline model: every term of the step
                step_s = self.roofline_step(scheduled, keys, block)
            else:
                step_s = self.cost_model(n, c, context)
            if learner is not None:  # an online cost model learns from the step, as in the engine
                learner.observe(n, c, context, step_s)
            end = now + step_s  # the step's tokens exist at its end
            now = end + self.gap_s  # the next step is decided after the engine's gap
            steps += 1
            admission.reward(len(scheduled), step_s, c)
            for request, tokens in scheduled:
                request.computed += tokens
                if request.prefilling:
                    continue
                request.generated += 1
                request.last_token_s = end
                if request.first_token_s is None:
                    request.first_token_s = end
            still = []
            for request in running:
                if request.generated >= request.spec.output_tokens:
                    admission.finish(request.spec.request_id)
                    spec = request.spec
                    if cache is not None:
                        cache.finish(keys[spec.request_id], spec.prompt_tokens, spec.output_tokens,
                                     filled_keys(spec, block, self.adapter_rules.get(spec.adapter)))
                    timings.append(RequestTiming(spec.arrival_s, request.first_token_s, end, request.generated))
                    finished_specs.append(spec)
                    for follow_up in follow_ups.pop(spec.request_id, []):
                        released += 1
                        heapq.heappush(arrivals, (end + follow_up.think_s, released,
                                                  replace(follow_up, arrival_s=end + follow_up.think_s)))
                else:
                    still.append(request)
            running = still
        if follow_ups:  # they wait on a request the workload does not have
            raise ValueError(f"follow-up turns after requests not in the workload: {sorted(follow_ups)[:3]}")
        return SimulationResult(timings, steps, now, shapes, finished_specs, recomputed, step_adapters, slot_loads,
                                host_loads)
