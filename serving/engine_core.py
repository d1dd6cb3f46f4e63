"""Patches that run in vLLM's engine-core process (the scheduler's process).

Prefix-cache keys (``generate_block_hash_extra_keys``), by the rule's
:meth:`~preft.rule.AdapterRule.kv_has_adapter`: a block that lies wholly before a prefill-only
adapter's ``adapter_start`` holds base-model KV (its positions never saw the adapter, and
attention looks back only), so its key drops the LoRA and it is shared with the base model and
every other adapter; a ReFT-P request's blocks from its start on get a ``("preft_reft",
bundle)`` key. A bundle that is not one of the server's store copies is never read here (the
scheduler fails its request, :func:`~preft.serving.bundle_store.is_store_copy`): its blocks get a
key of their own request, shared with nothing. The scheduler is not patched: it is the subclass
:class:`preft.serving.scheduler.PreftScheduler`, passed to vLLM as ``scheduler_cls``.
"""

from __future__ import annotations

from preft.constants import REFT_EXTRA_ARG
from preft.rule import bundle_rule
from preft.serving.bundle_store import is_store_copy
from preft.serving.patching import require
from preft.serving.reft import reft_bundle_of


def block_extra_keys(original, request, start_token_idx, end_token_idx, start_mm_idx):
    """``generate_block_hash_extra_keys`` with PreFT's adapter keys (same signature and result)."""
    keys, next_mm_idx = original(request, start_token_idx, end_token_idx, start_mm_idx)
    keys = list(keys or ())
    lora = request.lora_request
    bundle = reft_bundle_of(getattr(request, "sampling_params", None))
    if (lora is not None and not is_store_copy(lora.lora_path)) or (bundle and not is_store_copy(bundle)):
        return (*keys, ("preft_refused", request.request_id)), next_mm_idx  # read nothing, share nothing
    if lora is not None and not bundle_rule(lora.lora_path).kv_has_adapter(end_token_idx):
        keys = [key for key in keys if not (isinstance(key, tuple) and key[:1] == ("lora",))]
    if bundle and bundle_rule(bundle).kv_has_adapter(end_token_idx):
        keys.append((REFT_EXTRA_ARG, bundle))
    return (tuple(keys) if keys else None), next_mm_idx


def patch() -> None:
    from vllm.v1.core import block_pool, kv_cache_utils

    original = require(kv_cache_utils, "generate_block_hash_extra_keys")
    require(block_pool, "generate_block_hash_extra_keys")

    def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
        return block_extra_keys(original, request, start_token_idx, end_token_idx, start_mm_idx)

    kv_cache_utils.generate_block_hash_extra_keys = generate_block_hash_extra_keys
    block_pool.generate_block_hash_extra_keys = generate_block_hash_extra_keys
