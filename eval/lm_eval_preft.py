"""lm-eval against ``preft serve``, scored by the rule: the ``preft-completions`` model.

EleutherAI's lm-eval scores a served model's log-likelihood of ``continuation`` given
``context`` by sending ``context + continuation`` with ``echo`` and ``logprobs`` and summing the
continuation's prompt log-probs (its ``local-completions`` model). Under PreFT the whole of that
input is prompt, so the adapter would run on the continuation too: an adapter scored as if it
were all-token. ``preft-completions`` is ``local-completions`` that sends each request's
boundary, ``vllm_xargs = {"preft_prompt_end": len(context)}``
(:mod:`preft.serving.prompt_end`), so the continuation is scored as the training loss sees it
(the adapter on the context only). One HTTP request per input (the boundary is per request;
``num_concurrent`` runs them in parallel); generation tasks are unchanged.

    preft lm-eval --model preft-completions \\
        --model_args base_url=http://127.0.0.1:8000/v1/completions,model=ADAPTER,tokenizer=BASE_DIR \\
        --tasks TASK --include_path DIR

``preft lm-eval`` is lm-eval's own command line with this model registered (lm-eval has no
plugin entry point for models); in Python, ``import preft.eval.lm_eval_preft`` registers it for
``lm_eval.simple_evaluate(model="preft-completions", ...)``.
"""

from __future__ import annotations

import sys

from lm_eval.api.registry import register_model
from lm_eval.models.openai_completions import LocalCompletionsAPI

from preft.constants import PROMPT_END_EXTRA_ARG

MODEL_NAME = "preft-completions"


@register_model(MODEL_NAME)
class PreftCompletionsAPI(LocalCompletionsAPI):
    """``local-completions`` with the prompt boundary on every log-likelihood request."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["batch_size"] = 1  # vllm_xargs is per HTTP request: one input, one boundary
        super().__init__(*args, **kwargs)
        self._context_lengths: dict[tuple[int, ...], list[int]] = {}  # input -> its boundaries, in order

    def batch_loglikelihood_requests(self, chunks):
        inputs, context_lengths, cache_keys = super().batch_loglikelihood_requests(chunks)
        for tokens, length in zip(inputs, context_lengths):
            self._context_lengths.setdefault(tuple(tokens), []).append(length)
        return inputs, context_lengths, cache_keys

    def _create_payload(self, messages, generate=False, gen_kwargs=None, seed: int = 1234, eos=None, **kwargs) -> dict:
        payload = super()._create_payload(messages, generate=generate, gen_kwargs=gen_kwargs, seed=seed, eos=eos,
                                          **kwargs)
        if not generate:
            (tokens,) = messages  # one input per request (batch_size 1)
            boundary = self._context_lengths[tuple(tokens)].pop(0)
            payload["vllm_xargs"] = {**payload.get("vllm_xargs", {}), PROMPT_END_EXTRA_ARG: boundary}
        return payload


def main(argv: list[str]) -> int:
    """lm-eval's command line (``lm_eval ...``) with ``preft-completions`` registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    cli_evaluate()
    return 0
