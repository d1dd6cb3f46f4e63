"""WavePP chunk sizing: chunks of a long prompt whose predicted pipeline-stage times are equal
(after *WavePP: High-Throughput Pipeline Parallel LLM Prefill under Prefix Reuse*).

With pipeline parallelism over ``S`` stages, the chunks of one prompt flow through the stages in
waves. A chunk of ``c`` tokens after ``x`` tokens of context (cached prefix plus earlier chunks)
takes ``t(x, c)`` on every stage, so the prompt's prefill ends after

    TTFT = Σ_i t(x_i, c_i) + (S − 1) · max_i t(x_i, c_i)

(a flow shop whose stages are equal per job). Equal-size chunks get slower as the context
grows, so the slowest sets the pace and the faster ones leave bubbles. For a target stage time
``τ`` the sizing takes, chunk after chunk, the largest ``c`` with ``t(x, c) <= τ`` (binary
search, ``t`` being monotone in ``c``; a closed form for the cost model's quadratic), at least ``min_chunk``, at most what is left of the
prompt. Every chunk but the last then takes ``τ`` (to one token), and with ``k`` chunks
``TTFT ≈ (k + S − 1) · τ``. For a chunk count ``k`` the least ``τ`` that covers the prompt in
``k`` chunks is found by bisection; the count (at most :data:`MAX_CHUNKS`) is searched for the
least predicted TTFT: a few more chunks shrink the ``(S − 1) · τ`` fill, each costs a step's
fixed time.

``t`` is :class:`StageCost`: the step cost model (:mod:`preft.serving.scheduling.cost_model`)
(:class:`~preft.serving.scheduling.cost_model.StepCostModel`, ``T(n, c, x)``) with no decodes,
divided over the stages (each holds ``1/S`` of the layers), plus a per-stage hand-off.
:class:`WavePP` is the chunk policy the engine and the pipeline simulator ask per request:
``prefill_chunk(request_id, computed, prompt_tokens)`` returns the next chunk of that
request's plan, made when its first chunk is asked for (``computed`` then includes the
prefix-cache hit ``L``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from preft.serving.scheduling.chunk_policies import StepView

MAX_CHUNKS = 1024  # per prompt: beyond it a step's fixed cost outweighs any smaller fill


class StageCost:
    """``t(x, c)``: one pipeline stage's time for a ``c``-token chunk after ``x`` context tokens."""

    def __init__(self, cost_model, stages: int, handoff_s: float = 0.0) -> None:
        if stages < 1 or handoff_s < 0:
            raise ValueError(f"a pipeline needs stages >= 1 and handoff >= 0 (got {stages}, {handoff_s})")
        self.cost_model, self.stages, self.handoff_s = cost_model, stages, handoff_s

    def __call__(self, context: int, chunk: int) -> float:
        return self.cost_model(0, chunk, context) / self.stages + self.handoff_s

    def largest_chunk(self, context: int, limit: int, target_s: float) -> int:
        """Closed form for the step cost model's form: with no decodes, ``S·(t − handoff)`` is
        ``a·c² + b·c + k`` (``a = w5/10³``, ``b = w4 + w7·x/10⁶``, ``k = w0 + w3 + w6·x/10³``), so
        the largest chunk is the root of a quadratic, checked against the model to one token.
        A cost model with its own closed form (the roofline's ``largest_prefill_chunk``) is asked
        for it; one of another form is searched."""
        own = getattr(self.cost_model, "largest_prefill_chunk", None)
        if own is not None:
            return own(context, limit, (target_s - self.handoff_s) * self.stages)
        w = getattr(self.cost_model, "weights", None)
        if w is None:
            return binary_search_chunk(self, context, limit, target_s)
        budget = (target_s - self.handoff_s) * self.stages - (w[0] + w[3] + w[6] * context / 1e3)
        a, b = w[5] / 1e3, w[4] + w[7] * context / 1e6
        if limit < 1 or a + b > budget:
            return 0
        if a > 0:
            chunk = (-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a)
        else:
            chunk = budget / b if b > 0 else limit
        chunk = max(0, min(limit, int(chunk)))
        while chunk < limit and self(context, chunk + 1) <= target_s:  # float rounding, either way
            chunk += 1
        while chunk > 0 and self(context, chunk) > target_s:
            chunk -= 1
        return chunk


def largest_chunk(stage_cost: Callable[[int, int], float], context: int, limit: int, target_s: float) -> int:
    """The largest ``c <= limit`` with ``t(context, c) <= target_s`` (0 when not even one token
    fits): the stage cost's own closed form when it has one, else binary search."""
    closed_form = getattr(stage_cost, "largest_chunk", None)
    if closed_form is not None:
        return closed_form(context, limit, target_s)
    return binary_search_chunk(stage_cost, context, limit, target_s)


def binary_search_chunk(stage_cost: Callable[[int, int], float], context: int, limit: int, target_s: float) -> int:
    """:func:`largest_chunk` by binary search (``t`` is monotone in ``c``)."""
    if limit < 1 or stage_cost(context, 1) > target_s:
        return 0
    low, high = 1, limit
    while low < high:
        middle = (low + high + 1) // 2
        if stage_cost(context, middle) <= target_s:
            low = middle
        else:
            high = middle - 1
    return low


def sized_chunks(stage_cost, start: int, prompt_tokens: int, target_s: float, min_chunk: int,
                 max_chunk: int) -> list[int]:
    """The chunks from ``start`` to ``prompt_tokens`` whose stage time is at most ``target_s``
    (raised to ``min_chunk`` where fewer tokens fit, never past the prompt's end)."""
    chunks, context = [], start
    while context < prompt_tokens:
        left = prompt_tokens - context
        chunk = largest_chunk(stage_cost, context, min(left, max_chunk), target_s)
        chunk = min(left, max(chunk, min_chunk))
        chunks.append(chunk)
        context += chunk
    return chunks


def predicted_ttft(stage_cost, start: int, chunks: list[int], stages: int) -> float:
    """``Σ t_i + (S − 1) · max t_i`` (the module docstring)."""
    times, context = [], start
    for chunk in chunks:
        times.append(stage_cost(context, chunk))
        context += chunk
    return sum(times) + (stages - 1) * max(times) if times else 0.0


def least_target_plan(stage_cost, start: int, prompt_tokens: int, count: int, min_chunk: int, max_chunk: int,
                      upper_s: float) -> list[int]:
    """The plan of the least target ``τ`` that covers the prompt in at most ``count`` chunks."""
    low, high = 0.0, upper_s
    for _ in range(32):  # τ to 2^-32 of the largest stage time
        middle = (low + high) / 2
        if len(sized_chunks(stage_cost, start, prompt_tokens, middle, min_chunk, max_chunk)) <= count:
            high = middle
        else:
            low = middle
    return sized_chunks(stage_cost, start, prompt_tokens, high, min_chunk, max_chunk)


def plan_chunks(stage_cost, start: int, prompt_tokens: int, stages: int, min_chunk: int = 16,
                max_chunk: int = 2048) -> list[int]:
    """WavePP's chunk sizes for a prompt of ``prompt_tokens`` whose first ``start`` are cached.

    The chunk count ``k`` is searched, not scanned: predicted TTFT against ``k`` falls while the
    (S − 1) · τ fill shrinks and rises once the per-chunk fixed cost dominates, so a geometric
    sweep of ``k`` finds the basin and a ternary search on the integers around it the best."""
    if min_chunk < 1 or max_chunk < min_chunk or stages < 1:
        raise ValueError(f"WavePP needs 1 <= min_chunk <= max_chunk and stages >= 1 "
                         f"(got {min_chunk}, {max_chunk}, {stages})")
    left = prompt_tokens - start
    if left <= 0:
        return []
    upper = stage_cost(prompt_tokens, min(left, max_chunk))  # any chunk fits under this
    fewest = -(-left // max_chunk)
    most = max(fewest, min(-(-left // min_chunk), MAX_CHUNKS))
    plans: dict[int, tuple[float, list[int]]] = {}

    def ttft(count: int) -> float:
        if count not in plans:
            chunks = least_target_plan(stage_cost, start, prompt_tokens, count, min_chunk, max_chunk, upper)
            plans[count] = (predicted_ttft(stage_cost, start, chunks, stages), chunks)
        return plans[count][0]

    sweep, count = [], fewest
    while count < most:
        sweep.append(count)
        count = max(count + 1, int(count * 1.25))
    sweep.append(most)
    best = min(sweep, key=ttft)
    position = sweep.index(best)
    low, high = sweep[max(0, position - 1)], sweep[min(len(sweep) - 1, position + 1)]
    while high - low > 2:  # ternary search between the sweep's neighbours of its best
        left_third, right_third = low + (high - low) // 3, high - (high - low) // 3
        if ttft(left_third) <= ttft(right_third):
            high = right_third
        else:
            low = left_third
    for count in range(low, high + 1):
        ttft(count)
    best = min(plans, key=lambda k: (plans[k][0], k))
    return plans[best][1]


class WavePP:
    """The chunk policy (see the module docstring): per request, the next chunk of its plan."""

    def __init__(self, stage_cost: StageCost, min_chunk: int = 16, max_chunk: int = 2048) -> None:
        if min_chunk < 1 or max_chunk < min_chunk:
            raise ValueError(f"WavePP needs 1 <= min_chunk <= max_chunk (got {min_chunk}, {max_chunk})")
        self.stage_cost, self.min_chunk, self.max_chunk = stage_cost, min_chunk, max_chunk
        self.plans: dict[str, tuple[int, list[int]]] = {}  # request id -> (start, chunk ends)
        self.name = "wavepp"

    def prefill_budget(self, view: StepView) -> int:
        return view.pending_prefill_tokens  # the step as vLLM forms it; chunks are sized per request

    def prefill_chunk(self, request_id: str, computed: int, prompt_tokens: int) -> int:
        """How many tokens of this request's prompt the step may take from ``computed`` on."""
        plan = self.plans.get(request_id)
        if plan is None or (computed != plan[0] and computed not in plan[1]):
            # first asked, or off the plan (a chunk cut short by the step's budget, or a
            # preempted request recomputed): plan again from here, the context known
            chunks = plan_chunks(self.stage_cost, computed, prompt_tokens, self.stage_cost.stages,
                                 self.min_chunk, self.max_chunk)
            ends, position = [], computed
            for chunk in chunks:
                position += chunk
                ends.append(position)
            plan = self.plans[request_id] = (computed, ends)
            if len(self.plans) > 4096:  # forget the oldest plans (finished requests)
                for key in list(self.plans)[:2048]:
                    del self.plans[key]
        following = next((end for end in plan[1] if end > computed), prompt_tokens)
        return max(1, min(following, prompt_tokens) - computed)
