"""A request's own prompt boundary: the rule's ``P`` of a served request.

By default ``P`` is the request's prompt length. A request may set
``vllm_xargs = {"preft_prompt_end": K}`` (:data:`~preft.constants.PROMPT_END_EXTRA_ARG`) with
``0 < K <= prompt length``; then positions ``>= K`` run without the adapter although they are
in the prompt::

    P = min(K, prompt length)        adapter active at p iff adapter_start <= p < P

Use: scoring a continuation by the rule. ``echo`` + ``logprobs`` (or ``prompt_logprobs``) on
``context + continuation`` with ``K = len(context)`` gives the continuation's log-probs as the
training loss computes them (labels on the continuation: ``P`` = where the labels start).
Every user of a served request's ``P`` reads it here: the worker's LoRA mapping and ReFT-P
plan, the scheduler's adapter slots, the prefix-cache keys (the boundary is part of what a
block's KV depends on). ``K`` is checked when the request is made (:func:`check_prompt_end`,
a 400 over HTTP: its JSON type in the API server's middleware, before vLLM's request model
would turn ``true`` into 1; its range once the prompt is tokenized).

>>> rule_prompt_length({"preft_prompt_end": 5}, 9), rule_prompt_length(None, 9)
(5, 9)
"""

from __future__ import annotations

from preft.constants import PROMPT_END_EXTRA_ARG


def prompt_end_of(extra_args) -> int | None:
    """The request's boundary ``K``, or None when it sets none."""
    return (extra_args or {}).get(PROMPT_END_EXTRA_ARG)


def rule_prompt_length(extra_args, num_prompt_tokens: int) -> int:
    """``P`` for the rule: ``min(K, prompt length)``, or the prompt length."""
    end = prompt_end_of(extra_args)
    return num_prompt_tokens if end is None else min(int(end), num_prompt_tokens)


def check_prompt_end(extra_args, num_prompt_tokens: int | None = None) -> None:
    """A ``ValueError`` naming what is wrong with the request's ``preft_prompt_end``, if anything
    (with ``num_prompt_tokens`` None, before tokenization: its type and sign only)."""
    end = prompt_end_of(extra_args)
    if end is None:
        return
    if isinstance(end, bool) or not isinstance(end, int):
        raise ValueError(f"vllm_xargs.{PROMPT_END_EXTRA_ARG} must be an integer, got {end!r}")
    if num_prompt_tokens is None:
        if end < 1:
            raise ValueError(f"vllm_xargs.{PROMPT_END_EXTRA_ARG} must be at least 1, got {end}")
        return
    if not 0 < end <= num_prompt_tokens:
        raise ValueError(f"vllm_xargs.{PROMPT_END_EXTRA_ARG} must be in 1..{num_prompt_tokens} (the prompt's "
                         f"length in tokens), got {end}")
