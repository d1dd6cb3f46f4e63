"""Patches that run where vLLM builds its configuration (the process that makes the ``LLM``, or
``preft serve``'s API server), applied by the plugin like the others.

1. ``VllmConfig.__post_init__``: async scheduling off when the scheduler is PreFT's
   (:func:`resolve_async_scheduling`). :class:`~preft.serving.scheduler.PreftScheduler`
   subclasses vLLM's synchronous ``Scheduler``; ``AsyncScheduler`` schedules step n+1 before
   step n's tokens are back, with output placeholders the subclass does not keep. On CUDA
   vLLM turns async scheduling on by default, and with a custom ``Scheduler`` subclass it only
   warns of "degraded performance". PreFT turns it off with a log line saying why, and refuses
   an explicit ``async_scheduling=True`` with one clear error. (On CPU vLLM 0.32 leaves it off.)
"""

from __future__ import annotations

import logging

from preft.serving.patching import wrap

logger = logging.getLogger(__name__)


def _is_preft_scheduler(scheduler_cls) -> bool:
    from preft.serving import SCHEDULER_CLS

    if scheduler_cls is None:
        return False
    name = scheduler_cls if isinstance(scheduler_cls, str) else f"{scheduler_cls.__module__}.{scheduler_cls.__qualname__}"
    return name == SCHEDULER_CLS


def resolve_async_scheduling(scheduler_config) -> None:
    """Async scheduling off for PreFT's scheduler: ``None`` (vLLM would choose) becomes ``False``;
    ``True`` is an error naming the problem. Other schedulers are left as they are."""
    if not _is_preft_scheduler(scheduler_config.scheduler_cls):
        return
    if scheduler_config.async_scheduling:
        raise ValueError(
            "async scheduling cannot run with PreFT's scheduler (PreftScheduler subclasses vLLM's synchronous "
            "Scheduler): drop --async-scheduling / async_scheduling=True")
    if scheduler_config.async_scheduling is None:
        logger.info("preft: async scheduling off (PreftScheduler is a synchronous Scheduler subclass)")
        scheduler_config.async_scheduling = False


def patch() -> None:
    from vllm.config import VllmConfig

    @wrap(VllmConfig, "__post_init__")
    def post_init(original, self, *args, **kwargs):
        resolve_async_scheduling(self.scheduler_config)
        return original(self, *args, **kwargs)
