"""Scheduling policies as plain Python (never importing vLLM), so the simulator and the engine
run the same objects.

- :mod:`.cost_model` — ``T(num_decodes, prefill_tokens, context_tokens)`` for one engine step,
  fitted to measured steps, monotone in the chunk size.
- :mod:`.chunk_policies` — the per-step prefill budget interface and its baselines (vLLM's
  default, fixed chunks).
- :mod:`.sloweave` — SLOWeave: the largest chunk predicted to meet the earliest decode deadline.
- :mod:`.spec` — ``--scheduler`` parsed once into a :class:`~.spec.SchedulerSpec` (admission
  order, chunk policy, their settings), which the server, the engine and the simulator take.
- :mod:`.workloads` — seeded workloads (chat, mixed, long, bursty; shared prefixes; multi-turn
  conversations), also as ``vllm bench serve`` timed traces.
- :mod:`.simulator` — the event-driven simulator (closed-loop conversation turns, decoded blocks
  kept in its :mod:`.prefix_cache`); :mod:`.metrics` — TTFT, TPOT, goodput.
- :mod:`.chunked_hash_tree` — the CHT: the waiting request sharing the most prefix with the
  running batch in O(log W), with PreFT-aware keys; :mod:`.radix_tree` — the radix-tree
  (longest-prefix-match) baseline behind the same interface.
- :mod:`.feather` — Feather's ADD/STOP bandit over the CHT while a batch forms; :mod:`.admission` —
  FCFS, LPM and Feather as admission orders; :mod:`.wavepp` — pipeline-sized chunks.

The engine side is :class:`preft.serving.scheduler.PreftScheduler`.
"""
