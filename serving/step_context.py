"""The worker's per-step context: what the adapter code of one engine step needs to know.

As in nano-vllm (``nanovllm/utils/context.py``): one explicit object, made when a step starts
(the model runner's ``execute_model``), filled when the runner has prepared the step's inputs
(:func:`preft.serving.worker.prepare_step`), read by the layers during the forward (the CPU
LoRA ops, the ReFT-P hooks), and reset when the step's output is made (``execute_model`` or
``sample_tokens``), so nothing of one step can leak into the next or into a dummy/profiling
run (which never prepares inputs and so sees an empty context: no adapter work).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from preft.serving.tile_plan import TilePlan


@dataclass(frozen=True)
class StepContext:
    """``lora_plan``: the rows of this step with a LoRA slot (CPU ops only; ``None``: no LoRA
    work). ``reft_plan``: the rows with a ReFT-P bank slot (``None``: no ReFT work).
    ``failed_requests``: ``{request id: reason}`` of the requests whose adapter could not be set
    up this step (their rows run without it; the scheduler fails them and drops their tokens).
    ``num_active_loras``: how many LoRAs have a token this step by the rule (``None``: the step
    has not mapped its LoRAs); a decode-only step of prefill-only requests has 0, and vLLM's
    CUDA-graph dispatch takes the no-LoRA graph for it."""

    lora_plan: TilePlan | None = None
    reft_plan: TilePlan | None = None
    failed_requests: dict[str, str] = field(default_factory=dict)
    num_active_loras: int | None = None


_CONTEXT = StepContext()


def get_step_context() -> StepContext:
    return _CONTEXT


def set_step_context(context: StepContext) -> None:
    global _CONTEXT
    _CONTEXT = context


def reset_step_context() -> None:
    global _CONTEXT
    _CONTEXT = StepContext()
