"""Patches in the process that turns prompts into engine requests (the API server, or a
script's ``vllm.LLM``).

1. ``InputProcessor.process_inputs``: a request's ``vllm_xargs.preft_prompt_end`` is checked
   against its tokenized prompt (:func:`preft.serving.prompt_end.check_prompt_end`): an integer,
   ``0 < K <= prompt length``, else vLLM's validation error (HTTP 400 from the server) naming
   the field, before the request reaches the engine.
"""

from __future__ import annotations

from preft.serving.patching import wrap
from preft.serving.prompt_end import check_prompt_end


def checked_prompt_end(original, processor, *args, **kwargs):
    from vllm.exceptions import VLLMValidationError

    request = original(processor, *args, **kwargs)
    params = getattr(request, "sampling_params", None)
    if params is not None and params.extra_args:
        try:
            check_prompt_end(params.extra_args, len(request.prompt_token_ids or ()))
        except ValueError as err:
            raise VLLMValidationError(str(err), parameter="vllm_xargs") from None
    return request


def patch() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    wrap(InputProcessor, "process_inputs")(checked_prompt_end)
