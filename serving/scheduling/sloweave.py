"""SLOWeave: each step, the largest prefill chunk predicted to finish before the earliest decode
deadline (arXiv 2609.07883).

For every active decode ``i`` with ``k_i`` output tokens, the first at ``f_i`` and the latest at
``l_i``, the next token is due at

    d_i = max(l_i + TPOT, f_i + k_i · TPOT)

TPOT as vLLM's benchmark and the SLO count it is a request's mean time per output token after
the first, ``(t_{k+1} − f_i) / k``: it stays within the target while token ``k + 1`` comes by
``f_i + k · TPOT``, so the slack a request built up (its tokens came faster than the target)
may be spent on a larger prefill chunk; a request behind its mean is still given ``TPOT`` from
its last token (never less, or one late request would hold every prefill back). Without first-
token times in the view, ``d_i = l_i + TPOT``. With ``n`` decodes in the step and ``x``
context tokens, the step's prefill chunk is

    B  = max(0, min_i d_i - now)
    c* = max { c <= min(C_max, remaining prefill) :  U(n, c, x) + margin <= B }

found by binary search over ``c`` (``T`` is monotone in ``c``, :mod:`.cost_model`), so
``O(log C_max)`` model calls a step. No decodes: the whole remaining prefill, up to ``C_max``.
No chunk fits (even ``U(n, 1, x)`` misses): ``0``, a decode-only step. A cost model that
takes the chunk's own cached context ``x_p`` apart (the roofline's ``step_with_prefill_context``:
the chunk attends to all ``x_p`` tokens, ``c · x_p`` in its attention, where a decode reads each
context token once) is given it; on long prompts the 3-term ``T(n, c, x)`` of the roofline
under-predicts such a step by the chunk's attention. ``U`` is the cost model's upper bound: for an :class:`.online_cost_model.OnlineCostModel` (what ``preft serve``
runs) ``T · (1 + q)``, with ``q`` the model's recent relative error on steps of this shape;
for a plain :class:`.cost_model.StepCostModel`, ``T``. With an accurate monotone ``T`` the
chunk meets every active deadline and is the largest that does; with a one-sided error no
larger than the bound (plus the fixed ``margin``, default 0) it still meets them.

The policy only sizes chunks; the simulator and :class:`preft.serving.scheduler.PreftScheduler`
record the per-request last-token times it reads (:class:`.chunk_policies.StepView`).
"""

from __future__ import annotations

from preft.serving.scheduling.chunk_policies import StepView
from preft.serving.scheduling.cost_model import StepCostModel


class SLOWeave:
    """The SLOWeave chunk controller (see the module docstring). Times in seconds."""

    def __init__(self, cost_model: StepCostModel, tpot_s: float, max_chunk: int = 2048, margin_s: float = 0.0) -> None:
        if tpot_s <= 0 or max_chunk < 1 or margin_s < 0:
            raise ValueError(f"SLOWeave needs tpot > 0, max_chunk >= 1 and margin >= 0 "
                             f"(got {tpot_s}, {max_chunk}, {margin_s})")
        self.cost_model, self.tpot_s, self.max_chunk, self.margin_s = cost_model, tpot_s, max_chunk, margin_s
        self.predict = getattr(cost_model, "upper", cost_model)  # U: the model's bound, or T itself
        # a model that charges the chunk's attention over its own cached context apart (the roofline)
        self.split = getattr(cost_model, "step_with_prefill_context", None)
        self.name = "sloweave"
        self.model_calls = 0  # over the policy's life: the O(log C_max) claim is checked by the tests

    def budget_s(self, view: StepView) -> float:
        """``B = max(0, min_i d_i - now)``."""
        deadlines = [last + self.tpot_s for last in view.decode_last_token_times]
        if view.decode_first_token_times:  # the mean over the request's tokens: its slack may be spent
            deadlines = [max(due, first + tokens * self.tpot_s) for due, first, tokens in
                         zip(deadlines, view.decode_first_token_times, view.decode_output_tokens)]
        return max(0.0, min(deadlines) - view.now)

    def prefill_budget(self, view: StepView) -> int:
        upper = min(self.max_chunk, view.pending_prefill_tokens)
        if upper <= 0:
            return 0
        if view.num_decodes == 0:
            return upper
        n, x, budget = view.num_decodes, view.context_tokens, self.budget_s(view)
        x_p = view.prefill_context_tokens

        def fits(chunk: int) -> bool:
            self.model_calls += 1
            predicted = self.split(n, chunk, x, x_p) if self.split else self.predict(n, chunk, x)
            return predicted + self.margin_s <= budget

        if not fits(1):
            return 0
        low, high = 1, upper  # fits(low) holds; find the largest such c
        while low < high:
            middle = (low + high + 1) // 2
            if fits(middle):
                low = middle
            else:
                high = middle - 1
        return low
