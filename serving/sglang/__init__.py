"""SGLang as the second engine: ``preft serve --engine sglang`` and PreFT's SGLang plugin.

- :mod:`.server`: builds SGLang's server command (``sglang.launch_server`` on a CPU: plain-torch
  attention, the overlap scheduler off) in the venv ``make sglang`` makes, with the plugin on.
- :mod:`.plugin`: loaded by SGLang itself (entry point ``sglang.srt.plugins``) in its scheduler
  process; hooks SGLang's prefill admission through its ``HookRegistry``.
- :mod:`.waiting_order`: SGLang's waiting queue in the order of one of
  :mod:`preft.serving.scheduling.admission`'s objects (Feather over the Chunked Hash Tree), the
  same objects vLLM and the simulator run.
- ``standin/sgl_kernel``: the stand-in for SGLang's kernel package on a CPU (not a preft module).

Importing this package imports neither engine.
"""
