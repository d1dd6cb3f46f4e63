"""Names and values shared across the package (one place each)."""

#: Every linear projection of a Llama / Qwen2 / Mistral decoder layer: the benchmarks' and the
#: demo's LoRA targets.
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: ``SamplingParams.extra_args`` key (``vllm_xargs`` over HTTP) that names a request's ReFT-P
#: bundle directory; only `preft serve` sets it (a client-chosen value is refused).
REFT_EXTRA_ARG = "preft_reft"

#: attribute of a worker's ``ModelRunnerOutput`` listing the requests whose per-request adapter
#: work failed this step (``{request_id: reason}``); the scheduler fails those requests alone
FAILED_REQUESTS_ATTR = "preft_failed_requests"

#: ``SamplingParams.extra_args`` key (``vllm_xargs`` over HTTP) of a request's own prompt boundary
#: ``K``: positions ``>= K`` are adapter-off although they are prompt (the rule's ``P`` is ``K``)
PROMPT_END_EXTRA_ARG = "preft_prompt_end"
