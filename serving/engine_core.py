"""Patches that run in vLLM's engine-core process (the scheduler's process).

Prefix-cache keys (``generate_block_hash_extra_keys``), by the rule's
:meth:`~preft.rule.AdapterRule.kv_adapter_span`: the key of a block says which of its positions
had the adapter, ``[adapter_start, min(P, end))``. A block that lies wholly before a
prefill-only adapter's ``adapter_start`` holds base-model KV (its positions never saw the
adapter, and attention looks back only), so its key drops the LoRA and it is shared with the
base model and every other adapter; later blocks get ``("preft_span", first, end)`` (and a
ReFT-P request ``("preft_reft", bundle, first, end)``), so a block that one request filled past
its prompt (adapter off there) is never reused where the same positions are prompt. A bundle that is not one of the server's store copies is never read here (the
scheduler fails its request, :func:`~preft.serving.bundle_store.is_store_copy`): its blocks get a
key of their own request, shared with nothing. The scheduler is not patched: it is the subclass
:class:`preft.serving.scheduler.PreftScheduler`, passed to vLLM as ``scheduler_cls``.
"""

from __future__ import annotations

from preft.constants import REFT_EXTRA_ARG
from preft.bundle import bundle_rule
from preft.serving.bundle_store import is_store_copy
from preft.serving.patching import require
from preft.serving.prompt_end import rule_prompt_length
from preft.serving.reft import reft_bundle_of


def block_extra_keys(original, request, start_token_idx, end_token_idx, start_mm_idx):
    """``generate_block_hash_extra_keys`` with PreFT's adapter keys (same signature and result).

    The key of the block ending at ``end_token_idx`` carries which of its positions had the
    adapter, :meth:`~preft.rule.AdapterRule.kv_adapter_span` (with the request's prompt length):
    a block turn 1 filled while decoding is not reused for turn 2's prompt, where the rule puts
    the adapter on those positions; a block wholly before ``adapter_start`` drops the adapter."""
    keys, next_mm_idx = original(request, start_token_idx, end_token_idx, start_mm_idx)
    keys = list(keys or ())
    lora = request.lora_request
    bundle = reft_bundle_of(getattr(request, "sampling_params", None))
    if (lora is not None and not is_store_copy(lora.lora_path)) or (bundle and not is_store_copy(bundle)):
        return (*keys, ("preft_refused", request.request_id)), next_mm_idx  # read nothing, share nothing
    prompt_length = rule_prompt_length(getattr(request.sampling_params, "extra_args", None), request.num_prompt_tokens)
    if lora is not None:
        span = bundle_rule(lora.lora_path).kv_adapter_span(end_token_idx, prompt_length)
        if span is None:  # base-model KV: shared with the base model and every adapter
            keys = [key for key in keys if not (isinstance(key, tuple) and key[:1] == ("lora",))]
        else:
            keys.append(("preft_span", *span))
    if bundle:
        span = bundle_rule(bundle).kv_adapter_span(end_token_idx, prompt_length)
        if span is not None:
            keys.append((REFT_EXTRA_ARG, bundle, *span))
    return (tuple(keys) if keys else None), next_mm_idx


def patch() -> None:
    from vllm.v1.core import block_pool, kv_cache_utils

    original = require(kv_cache_utils, "generate_block_hash_extra_keys")
    require(block_pool, "generate_block_hash_extra_keys")

    def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
        return block_extra_keys(original, request, start_token_idx, end_token_idx, start_mm_idx)

    kv_cache_utils.generate_block_hash_extra_keys = generate_block_hash_extra_keys
    block_pool.generate_block_hash_extra_keys = generate_block_hash_extra_keys
