"""How many prefill tokens one engine step may run: the policies SLOWeave is compared with.

Every policy answers one question per step, from a :class:`StepView`::

    prefill_budget(view) -> tokens      (0 = a decode-only step)

Decodes are never capped: each running decode gets its one token, and the budget applies to the
prefill chunk(s) only, handed out first come first served (running partial prefills, then
waiting requests), exactly as vLLM's scheduler hands out its token budget. The simulator
(:mod:`.simulator`) and the engine (:class:`preft.serving.scheduler.PreftScheduler`) ask the same
objects.

- :class:`VllmDefault`: no cap of its own (vLLM's ``max_num_batched_tokens`` alone; in the
  simulator that budget minus the step's decodes).
- :class:`FixedChunk`: at most ``C`` prefill tokens a step (Sarathi-style fixed budget).
- :class:`preft.serving.scheduling.sloweave.SLOWeave`: the largest chunk predicted to meet the
  earliest decode deadline.
- :class:`preft.serving.scheduling.wavepp.WavePP`: per request, chunks whose predicted pipeline
  stage times are equal (``prefill_chunk``); with SLOWeave, :class:`DeadlineAndWaves`.

:func:`make_policy` builds one from its name (``default``, ``fixed:256``, ``sloweave``; and
``cycle:16,64,256``, :class:`CyclingChunk`, which only calibrates the cost model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

UNLIMITED = 1 << 30


@dataclass(frozen=True)
class StepView:
    """What a chunk policy sees at the start of one step (times in seconds, one clock)."""

    now: float
    decode_last_token_times: tuple[float, ...]  # one per request decoding this step
    context_tokens: int  # KV already cached for the step's decodes and its first pending prefill
    pending_prefill_tokens: int  # prefill tokens left, over every request still to prefill
    # the decodes' first-token times and output tokens so far, in the order of their last-token
    # times (empty: unknown; SLOWeave then keeps every next token within TPOT of the last)
    decode_first_token_times: tuple[float, ...] = ()
    decode_output_tokens: tuple[int, ...] = ()
    # of context_tokens, the KV cached for the first pending prefill (its chunk attends to all of it)
    prefill_context_tokens: int = 0

    @property
    def num_decodes(self) -> int:
        return len(self.decode_last_token_times)


class VllmDefault:
    """vLLM's own chunked prefill: the step's token budget is the only limit."""

    name = "default"

    def prefill_budget(self, view: StepView) -> int:
        return view.pending_prefill_tokens


class FixedChunk:
    """At most ``chunk`` prefill tokens per step, whatever the decodes' deadlines."""

    def __init__(self, chunk: int) -> None:
        if chunk < 1:
            raise ValueError(f"a fixed prefill chunk must be >= 1 token, got {chunk}")
        self.chunk = chunk
        self.name = f"fixed:{chunk}"

    def prefill_budget(self, view: StepView) -> int:
        return min(self.chunk, view.pending_prefill_tokens)


class CyclingChunk:
    """Each step the next size of ``sizes``, in turn: a served engine's steps then cover small and
    large chunks beside whatever decodes the load brings (``preft eval profile --served``
    calibrates the cost model on them). Not a serving policy."""

    def __init__(self, sizes: list[int]) -> None:
        if not sizes or any(size < 1 for size in sizes):
            raise ValueError(f"a cycle of chunk sizes needs sizes >= 1, got {sizes}")
        self.sizes, self.step = list(sizes), 0
        self.name = "cycle:" + ",".join(map(str, sizes))

    def prefill_budget(self, view: StepView) -> int:
        self.step += 1
        return min(self.sizes[self.step % len(self.sizes)], view.pending_prefill_tokens)


class DeadlineAndWaves:
    """SLOWeave's per-step budget, and within it WavePP's per-request chunk sizes."""

    def __init__(self, sloweave, wavepp) -> None:
        self.sloweave, self.wavepp = sloweave, wavepp
        self.name, self.max_chunk = "sloweave+wavepp", sloweave.max_chunk

    def prefill_budget(self, view: StepView) -> int:
        return self.sloweave.prefill_budget(view)

    def prefill_chunk(self, request_id: str, computed: int, prompt_tokens: int) -> int:
        return self.wavepp.prefill_chunk(request_id, computed, prompt_tokens)


def make_policy(name: str, *, cost_model=None, tpot_s: float | None = None, max_chunk: int = 2048,
                margin_s: float = 0.0, stages: int = 1, min_chunk: int = 16):
    """``default`` | ``fixed:C`` | ``sloweave`` (which needs ``cost_model`` and ``tpot_s``) |
    ``wavepp`` (which needs ``cost_model``; ``stages`` is the pipeline's) | ``sloweave+wavepp``.

    A policy with ``prefill_chunk(request_id, computed, prompt_tokens)`` (WavePP) also caps each
    request's chunk, not only the step's prefill total."""
    if name == "default":
        return VllmDefault()
    if name.startswith("fixed:"):
        size = name.split(":", 1)[1]
        if not size.isdigit():
            raise ValueError(f"scheduler {name!r}: expected fixed:TOKENS, e.g. fixed:256")
        return FixedChunk(int(size))
    if name.startswith("cycle:"):
        sizes = name.split(":", 1)[1].split(",")
        if not all(size.isdigit() for size in sizes):
            raise ValueError(f"scheduler {name!r}: expected cycle:TOKENS,TOKENS,..., e.g. cycle:16,256")
        return CyclingChunk([int(size) for size in sizes])
    if name == "sloweave":
        from preft.serving.scheduling.sloweave import SLOWeave

        if cost_model is None or tpot_s is None:
            raise ValueError("the sloweave scheduler needs a step cost model and a TPOT target")
        return SLOWeave(cost_model, tpot_s=tpot_s, max_chunk=max_chunk, margin_s=margin_s)
    if name in ("wavepp", "sloweave+wavepp"):
        from preft.serving.scheduling.wavepp import StageCost, WavePP

        if cost_model is None:
            raise ValueError(f"the {name} scheduler needs a step cost model")
        wavepp = WavePP(StageCost(cost_model, stages), min_chunk=min_chunk, max_chunk=max_chunk)
        if name == "wavepp":
            return wavepp
        return DeadlineAndWaves(make_policy("sloweave", cost_model=cost_model, tpot_s=tpot_s, max_chunk=max_chunk,
                                            margin_s=margin_s), wavepp)
    raise ValueError(f"unknown scheduler {name!r} as a prefill chunk policy (choose from default, fixed:TOKENS, "
                     "sloweave, wavepp, sloweave+wavepp; cycle:TOKENS,TOKENS,... for profiling)")


def policy_from_spec(spec):
    """The prefill chunk policy a scheduler spec names (:class:`~preft.serving.scheduling.spec.
    SchedulerSpec`, or its JSON: ``{"name": "sloweave", "tpot_ms": 25, "cost_model": FILE,
    "max_chunk": 2048, "margin_ms": 0}``, as ``preft serve --scheduler`` writes it); of a name
    with an admission order too (``feather+sloweave``), its chunk part.

    SLOWeave and WavePP get an :class:`~preft.serving.scheduling.online_cost_model.OnlineCostModel`
    that learns from the steps it is shown (its ``observe``, called by the scheduler and the
    simulator): seeded by ``cost_model`` (a file)
    or the conservative prior, continued from ``cost_state`` when that file exists."""
    from preft.serving.scheduling.cost_model import StepCostModel
    from preft.serving.scheduling.online_cost_model import OnlineCostModel
    from preft.serving.scheduling.spec import SchedulerSpec

    spec = spec if isinstance(spec, SchedulerSpec) else SchedulerSpec.from_json(spec)
    cost_model = None
    if spec.sloweave or spec.wavepp:
        prior = StepCostModel.load(spec.cost_model) if spec.cost_model else OnlineCostModel.conservative_prior()
        cost_model = OnlineCostModel(prior)
        if spec.cost_state and Path(spec.cost_state).exists():
            cost_model.restore(spec.cost_state)
    tpot_s = spec.tpot_ms / 1e3 if spec.tpot_ms is not None else None
    return make_policy(spec.chunk_policy, cost_model=cost_model, tpot_s=tpot_s, max_chunk=spec.max_chunk,
                       margin_s=spec.margin_ms / 1e3, stages=spec.stages, min_chunk=spec.min_chunk)
