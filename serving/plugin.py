"""The PreFT vLLM plugin: loaded in every vLLM process through ``vllm.general_plugins``.

``register()`` patches two things, both idempotently (vLLM may call it several times per
process) and only on vLLM 0.32, whose internals they were written against:

1. ``InputBatch.make_lora_inputs`` -> :func:`preft.serving.lora_mapping.prefill_only_mapping`:
   per-token LoRA ids by absolute position, with each adapter's rule read from the
   ``preft_manifest.json`` of its bundle (``preft export``). Adapters without a manifest, and
   every adapter under ``PREFT_ALL_TOKEN=1`` (``preft serve --all-token``), are applied to
   every token, exactly as stock vLLM does. A LoRA whose request has no active token
   this step is not asked for, so it needs no adapter slot.
2. ``PunicaWrapperBase.__init__``: room for 3 LoRA segments per request. vLLM sizes its
   segment buffers for one run of equal LoRA ids per request; keyed on position, a request can
   have three (before ``adapter_start``, the adapter's span, after ``P``).
3. The CPU punica ops -> :mod:`preft.serving.lora_ops` (rows tiled by slot, ``-1`` = no
   adapter, one plan per step, no LoRA work in a step without adapter rows), unless
   ``PREFT_STOCK_LORA_OPS=1`` (used to measure stock vLLM in the benchmarks).
4. ``Scheduler.schedule``: a running prefill-only request whose prompt is fully computed is
   decoding with the base model, so it does not count against ``max_loras`` when vLLM admits
   new requests: ``--max-adapters`` bounds concurrent *prefills*, not concurrent requests.
   (Its ``lora_request`` is hidden for the duration of ``schedule()`` and put back after.)
   ``PREFT_TRACE_SCHEDULER=FILE`` appends, per step, how many running requests and distinct
   adapters there are (used by the tests).
5. ReFT-P (:mod:`preft.serving.reft`): ``load_model`` of the model runners also hooks the
   decoder layers, and ``_prepare_inputs`` also builds the step's ReFT rows.
   Prefix-cache keys (``generate_block_hash_extra_keys``): a block that lies wholly before a
   prefill-only adapter's ``adapter_start`` holds base-model KV, so its key drops the LoRA and
   it is shared with the base model and every other adapter; a ReFT-P request's blocks past
   its start get a ``("preft_reft", bundle)`` key (instead of a salt on the whole prompt).
6. Under ``preft serve``: ReFT-P adapters are routed by name (:mod:`preft.serving.reft_routing`)
   and listed in ``/v1/models``.
7. Under ``preft serve`` (``PREFT_SERVE_BASE`` set): ``/v1/load_lora_adapter`` runs the same
   bundle checks as start-up (manifest, kind, rank, base model, finite weights) and answers
   400 with the reason, before the engine sees the adapter.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np

from preft.serving.lora_mapping import AdapterRule, prefill_only_mapping

SUPPORTED_VLLM = ("0.32.",)
_PATCHED = False


@functools.lru_cache(maxsize=4096)
def adapter_rule(lora_path: str) -> AdapterRule:
    """The rule of the bundle at ``lora_path`` (no manifest: an all-token LoRA)."""
    manifest = Path(lora_path) / "preft_manifest.json"
    if not manifest.is_file() or os.environ.get("PREFT_ALL_TOKEN") == "1":
        return AdapterRule()
    data = json.loads(manifest.read_text())
    return AdapterRule(prefill_only=bool(data.get("prefill_only")), adapter_start=int(data.get("adapter_start", 0)))


def make_lora_inputs(self, num_scheduled_tokens: np.ndarray, num_sampled_tokens: np.ndarray):
    """Replacement for ``InputBatch.make_lora_inputs`` (same signature and return types)."""
    n = self.num_reqs
    request_ids = self.request_lora_mapping[:n]
    rules = {lora_id: adapter_rule(request.lora_path) for lora_id, request in self.lora_id_to_lora_request.items()}
    token_ids, sampled_ids = prefill_only_mapping(
        request_ids, self.num_computed_tokens_cpu[:n].astype(np.int64), self.num_prompt_tokens[:n].astype(np.int64),
        np.asarray(num_scheduled_tokens), np.asarray(num_sampled_tokens), rules,
    )
    used = set(np.unique(token_ids).tolist()) | set(np.unique(sampled_ids).tolist())
    active_requests = {request for lora_id, request in self.lora_id_to_lora_request.items() if lora_id in used}
    return tuple(sampled_ids.tolist()), tuple(token_ids.tolist()), active_requests


def check_runtime_loads() -> None:
    """Wrap vLLM's load-request check with the bundle checks of ``preft serve``."""
    from http import HTTPStatus

    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve import create_error_response

    from preft.export import ExportError
    from preft.serving.server import check_bundle

    original = OpenAIServingModels._check_load_lora_adapter_request

    @functools.wraps(original)
    async def checked(self, request):
        error = await original(self, request)
        if error is not None:
            return error
        try:
            check_bundle(request.lora_name, request.lora_path, Path(os.environ["PREFT_SERVE_BASE"]),
                         int(os.environ["PREFT_SERVE_MAX_RANK"]))
        except ExportError as err:
            return create_error_response(message=str(err), err_type="BadRequestError",
                                         status_code=HTTPStatus.BAD_REQUEST)
        return None

    OpenAIServingModels._check_load_lora_adapter_request = checked

    # ReFT-P adapters: routed by an ASGI middleware, listed beside the LoRA adapters
    from vllm.entrypoints.launchers.api_server import entry
    from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelPermission

    from preft.serving import reft_routing

    reft_routing.load_start_up_adapters()
    original_build_app = entry.build_app

    @functools.wraps(original_build_app)
    def build_app(*args, **kwargs):
        app = original_build_app(*args, **kwargs)
        # outermost layer of the ASGI stack (vLLM may have built the stack already)
        build_stack = app.build_middleware_stack
        app.build_middleware_stack = lambda: reft_routing.ReftRoutingMiddleware(build_stack())
        if app.middleware_stack is not None:
            app.middleware_stack = reft_routing.ReftRoutingMiddleware(app.middleware_stack)
        return app

    entry.build_app = build_app
    original_models = OpenAIServingModels.show_available_models

    @functools.wraps(original_models)
    async def show_available_models(self):
        model_list = await original_models(self)
        model_list.data.extend(
            ModelCard(id=name, root=path, parent=self.base_model_paths[0].name, permission=[ModelPermission()])
            for name, path in reft_routing.REFT_ADAPTERS.items()
        )
        return model_list

    OpenAIServingModels.show_available_models = show_available_models


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group."""
    global _PATCHED
    if _PATCHED:
        return
    import vllm

    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"preft's vLLM plugin supports vLLM {SUPPORTED_VLLM}, found {vllm.__version__}: "
            "its patches target private internals of that release"
        )
    from vllm.v1.worker.gpu_input_batch import InputBatch

    InputBatch.make_lora_inputs = make_lora_inputs

    from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase

    original_init = PunicaWrapperBase.__init__

    @functools.wraps(original_init)
    def init_with_segment_room(self, max_num_batched_tokens, max_batches, device, *args, **kwargs):
        original_init(self, max_num_batched_tokens, 3 * max_batches, device, *args, **kwargs)

    PunicaWrapperBase.__init__ = init_with_segment_room
    if os.environ.get("PREFT_STOCK_LORA_OPS") != "1":
        from vllm.lora.punica_wrapper import punica_cpu

        from preft.serving import lora_ops

        for name in ("bgmv_expand", "bgmv_expand_slice", "bgmv_shrink", "sgmv_expand", "sgmv_expand_slice",
                     "sgmv_shrink"):
            if not hasattr(punica_cpu, name):
                raise RuntimeError(f"vllm.lora.punica_wrapper.punica_cpu.{name} moved: update preft's plugin")
            setattr(punica_cpu, name, getattr(lora_ops, name))
        lora_ops.install_planned_lora_linear(punica_cpu.PunicaWrapperCPU)
    if os.environ.get("PREFT_SERVE_BASE"):
        check_runtime_loads()
    patch_model_runners()
    patch_scheduler()
    patch_block_keys()
    _PATCHED = True


def patch_block_keys() -> None:
    from vllm.v1.core import block_pool, kv_cache_utils

    from preft.serving.reft import EXTRA_ARG, reft_adapter_start

    original = kv_cache_utils.generate_block_hash_extra_keys

    @functools.wraps(original)
    def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
        keys, next_mm_idx = original(request, start_token_idx, end_token_idx, start_mm_idx)
        keys = list(keys or ())
        lora = request.lora_request
        if lora is not None:
            rule = adapter_rule(lora.lora_path)
            if rule.prefill_only and end_token_idx <= rule.adapter_start:  # base-model KV
                keys = [key for key in keys if not (isinstance(key, tuple) and key[:1] == ("lora",))]
        params = getattr(request, "sampling_params", None)
        bundle = (params.extra_args or {}).get(EXTRA_ARG) if params is not None else None
        if bundle and end_token_idx > reft_adapter_start(bundle):
            keys.append((EXTRA_ARG, bundle))
        return (tuple(keys) if keys else None), next_mm_idx

    kv_cache_utils.generate_block_hash_extra_keys = generate_block_hash_extra_keys
    block_pool.generate_block_hash_extra_keys = generate_block_hash_extra_keys


def _decoding_prefill_only(request) -> bool:
    lora = request.lora_request
    if lora is None or request.num_computed_tokens < request.num_prompt_tokens:
        return False
    return adapter_rule(lora.lora_path).prefill_only


def patch_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.schedule

    @functools.wraps(original)
    def schedule(self, *args, **kwargs):
        hidden = []
        if self.lora_config:
            for request in self.running:
                if _decoding_prefill_only(request):
                    hidden.append((request, request.lora_request))
                    request.lora_request = None
        try:
            output = original(self, *args, **kwargs)
        finally:
            for request, lora_request in hidden:
                request.lora_request = lora_request
        trace = os.environ.get("PREFT_TRACE_SCHEDULER")
        if trace and self.running:
            adapters = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
            with open(trace, "a") as handle:
                handle.write(f"{len(self.running)} {len(adapters)}\n")
        return output

    Scheduler.schedule = schedule


def patch_model_runners() -> None:
    """Install the ReFT-P hooks after model load and build the ReFT step after input prep."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from preft.serving import reft

    runners = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        runners.append(CPUModelRunner)
    except ImportError:  # a CUDA build without the CPU runner
        pass
    for runner in runners:
        if "load_model" in vars(runner):
            original_load = vars(runner)["load_model"]

            @functools.wraps(original_load)
            def load_model(self, *args, _original=original_load, **kwargs):
                result = _original(self, *args, **kwargs)
                reft.install_hooks(self.get_model(), self.model_config.hf_config)
                return result

            runner.load_model = load_model

    original_prepare = GPUModelRunner._prepare_inputs

    @functools.wraps(original_prepare)
    def prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        result = original_prepare(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        reft.build_step(self, num_scheduled_tokens)
        return result

    GPUModelRunner._prepare_inputs = prepare_inputs
