"""Serving PreFT adapters on vLLM: the plugin (patches grouped by process), the scheduler
subclass, the CPU LoRA ops, ReFT-P in the engine, and ``preft serve``.

Importing this package does not import vLLM; :mod:`preft.serving.plugin` is loaded by vLLM
itself (entry point ``vllm.general_plugins``).
"""

#: pass as ``scheduler_cls`` to ``vllm.LLM`` / ``--scheduler-cls`` to ``vllm serve`` (``preft serve`` does)
SCHEDULER_CLS = "preft.serving.scheduler.PreftScheduler"
