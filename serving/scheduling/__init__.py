"""Scheduling policies as plain Python (never importing vLLM), so the simulator and the engine
run the same objects.

- :mod:`.cost_model` — ``T(num_decodes, prefill_tokens, context_tokens)`` for one engine step,
  fitted to measured steps, monotone in the chunk size.
- :mod:`.chunk_policies` — the per-step prefill budget interface and its baselines (vLLM's
  default, fixed chunks).
- :mod:`.sloweave` — SLOWeave: the largest chunk predicted to meet the earliest decode deadline.
- :mod:`.workloads` — seeded workloads (chat, mixed, long, bursty), also as ``vllm bench serve``
  timed traces.
- :mod:`.simulator` — the event-driven simulator; :mod:`.metrics` — TTFT, TPOT, goodput.

The engine side is :class:`preft.serving.scheduler.PreftScheduler`.
"""
