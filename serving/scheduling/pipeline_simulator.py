"""Event-driven simulator of pipeline-parallel prefill: chunks of long prompts through ``S``
stages with vLLM's batch queue.

The engine with ``pipeline_parallel_size = S`` keeps up to ``S`` batches in flight
(``max_concurrent_batches``). It schedules the next batch as soon as one of them returns, and a
prompt's next chunk can be scheduled while its previous chunk is still in a later stage
(``num_computed_tokens`` advances at schedule time). Here one batch is one chunk of the oldest
request still prefilling (long prompts: a chunk fills the step), and batch ``j``:

    decided_j   = max(arrival of its request, done_{j−S})          (a batch-queue slot is free)
    start_{j,s} = max(done_{j,s−1}, free_s)    (decided_j for s = 0)
    done_{j,s}  = start_{j,s} + t(x_j, c_j)                        (free_s := done_{j,s})

with ``t`` the stage cost (:class:`~preft.serving.scheduling.wavepp.StageCost`) and ``x_j`` the
context before the chunk (the request's cached prefix plus its earlier chunks). A request's
first token exists when its last chunk leaves the last stage. Reported: TTFT per request, the
bubble fraction ``1 − Σ busy / (S · span)`` over the stages, and prefill throughput (tokens
computed per second of span).

A chunk policy is anything with ``prefill_chunk(request_id, computed, prompt_tokens)``
(:class:`~preft.serving.scheduling.wavepp.WavePP`, :class:`FixedPrefillChunk`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LongPrompt:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int = 0  # the prefix-cache hit: its KV exists, no stage computes it


@dataclass
class PipelineResult:
    ttft_s: dict[str, float]
    bubble_fraction: float
    prefill_tokens_per_s: float
    chunks: dict[str, list[int]]
    span_s: float


class FixedPrefillChunk:
    """Chunks of ``chunk`` tokens (the last one what is left)."""

    def __init__(self, chunk: int) -> None:
        if chunk < 1:
            raise ValueError(f"a fixed prefill chunk must be >= 1 token, got {chunk}")
        self.chunk, self.name = chunk, f"fixed:{chunk}"

    def prefill_chunk(self, request_id: str, computed: int, prompt_tokens: int) -> int:
        return min(self.chunk, prompt_tokens - computed)


def simulate_pipeline(prompts: list[LongPrompt], policy, stage_cost, stages: int) -> PipelineResult:
    if stages < 1:
        raise ValueError(f"a pipeline needs stages >= 1, got {stages}")
    order = sorted(prompts, key=lambda p: p.arrival_s)
    free = [0.0] * stages
    returned: list[float] = []  # done time at the last stage, per batch in schedule order
    busy = 0.0
    first_start = None
    ttft, chunks = {}, {}
    tokens = 0
    for prompt in order:
        computed = prompt.cached_tokens
        chunks[prompt.request_id] = []
        while computed < prompt.prompt_tokens:
            chunk = policy.prefill_chunk(prompt.request_id, computed, prompt.prompt_tokens)
            if not 1 <= chunk <= prompt.prompt_tokens - computed:
                raise ValueError(f"policy {getattr(policy, 'name', policy)} gave a chunk of {chunk} with "
                                 f"{prompt.prompt_tokens - computed} tokens left")
            slot = returned[-stages] if len(returned) >= stages else 0.0
            ready = max(prompt.arrival_s, slot)
            seconds = stage_cost(computed, chunk)
            for stage in range(stages):
                start = max(ready, free[stage])
                if first_start is None:
                    first_start = start
                ready = free[stage] = start + seconds
                busy += seconds
            returned.append(ready)
            chunks[prompt.request_id].append(chunk)
            computed += chunk
            tokens += chunk
        ttft[prompt.request_id] = (returned[-1] if chunks[prompt.request_id] else prompt.arrival_s) - prompt.arrival_s
    span = (max(free) - first_start) if first_start is not None else 0.0
    bubble = 1.0 - busy / (stages * span) if span > 0 else 0.0
    return PipelineResult(ttft, bubble, tokens / span if span > 0 else 0.0, chunks, span)
