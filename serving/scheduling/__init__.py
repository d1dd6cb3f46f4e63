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
- :mod:`.chunked_hash_tree` — the CHT: the waiting request sharing the most prefix with the
  running batch in O(log W), with PreFT-aware keys; :mod:`.radix_tree` — the radix-tree
  (longest-prefix-match) baseline behind the same interface.
- :mod:`.feather` — Feather's ADD/STOP bandit over the CHT while a batch forms.

The engine side is :class:`preft.serving.scheduler.PreftScheduler`.
"""
