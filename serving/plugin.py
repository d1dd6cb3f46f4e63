"""The PreFT vLLM plugin: loaded in every vLLM process through ``vllm.general_plugins``.

``register()`` applies PreFT's patches once per process, grouped by the process they serve
(vLLM loads general plugins in each of them, and on CPU always spawns processes):

- **worker** (:mod:`preft.serving.worker`): position-keyed LoRA mapping, LoRA segment room,
  the CPU LoRA ops, ReFT-P hooks, the per-step context;
- **config** (:mod:`preft.serving.engine_config`), where vLLM builds its configuration: async
  scheduling off under PreFT's scheduler;
- **frontend** (:mod:`preft.serving.frontend`), where prompts become engine requests (the API
  server, or a script's ``vllm.LLM``): the per-request prompt boundary is checked;
- **engine core** (:mod:`preft.serving.engine_core`): prefix-cache keys. The scheduler is a
  subclass, :class:`preft.serving.scheduler.PreftScheduler`, passed as ``scheduler_cls``;
- **API server** (:mod:`preft.serving.api_server`), under ``preft serve`` only: runtime-load
  checks, ReFT-P routing by name, ``/v1/models``.

Every patch targets private internals of vLLM 0.32 and fails loudly if one moved
(:mod:`preft.serving.patching`).
"""

from __future__ import annotations

from preft import envs

SUPPORTED_VLLM = ("0.32.",)
_PATCHED = False


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    global _PATCHED
    if _PATCHED:
        return
    import vllm

    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"preft's vLLM plugin supports vLLM {SUPPORTED_VLLM}, found {vllm.__version__}: "
            "its patches target private internals of that release"
        )
    from preft.serving import engine_config, engine_core, frontend, worker

    engine_config.patch()
    frontend.patch()
    worker.patch()
    engine_core.patch()
    if envs.PREFT_SERVE_BASE:
        from preft.serving import api_server

        api_server.patch()
    _PATCHED = True
