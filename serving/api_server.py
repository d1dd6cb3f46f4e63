"""Patches that run in vLLM's API-server process, under ``preft serve`` only.

1. ``/v1/load_lora_adapter`` (present only with ``--allow-runtime-loading``): the bundle must lie
   under ``--adapter-root``; it is copied into the server's store and checked there
   (:mod:`preft.serving.bundle_store`), and vLLM loads the copy. A name that a ReFT-P adapter
   holds is refused unless ``load_inplace``; a replaced LoRA gets a new engine id, so requests
   already running finish on the old weights. Refusals are 400s with the reason.
2. ReFT-P adapters are routed by name: the ASGI middleware of :mod:`preft.serving.reft_routing`
   is placed innermost among vLLM's middlewares, behind its ``--api-key`` check, on every route
   whose body takes ``vllm_xargs`` (read from the app's routes when it is built).
3. ``/v1/models`` lists the ReFT-P adapters beside the LoRA adapters (names are unique).
4. ``get_max_tokens`` (vLLM's output-length limit, imported by name into each serving module:
   every importer is patched): a prompt that fills the whole context leaves no room for a token.
   vLLM let it through to "max_tokens must be at least 1, got 0" even with ``max_tokens=1``;
   it is now the same context-length 400 as a prompt one token longer, saying how long a
   prompt may be.
5. ``/metrics`` gains the per-adapter figures and the adapter caches' loads
   (:mod:`preft.serving.adapter_metrics`), fed by vLLM's output processor.
6. With ``--resolve-adapters``: a request naming a bundle under ``--adapter-root`` that is not
   loaded loads it (:mod:`preft.serving.adapter_resolver`; LoRA through vLLM's resolver registry).
"""

from __future__ import annotations

import logging
import weakref
from http import HTTPStatus

from preft import envs
from preft.bundle import BundleError
from preft.serving import adapter_metrics, adapter_resolver, reft_routing
from preft.serving.patching import require, wrap

logger = logging.getLogger(__name__)


def patch_load_checks() -> None:
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve import create_error_response

    def refuse(message: str):
        return create_error_response(message=message, err_type="BadRequestError", status_code=HTTPStatus.BAD_REQUEST)

    @wrap(OpenAIServingModels, "__init__")
    def init(original, self, *args, **kwargs):
        original(self, *args, **kwargs)
        reft_routing.SERVING_MODELS = weakref.proxy(self)

    @wrap(OpenAIServingModels, "_check_load_lora_adapter_request")
    async def checked(original, self, request):
        name = request.lora_name
        if name in reft_routing.REFT_ADAPTERS and not request.load_inplace:
            return refuse(f"The adapter '{name}' has already been loaded. To replace it, set 'load_inplace' to true.")
        error = await original(self, request)
        if error is not None:
            return error
        if envs.PREFT_SERVE_LORA.get(name) == request.lora_path:  # a start-up adapter: already in the store
            return None
        try:
            copy, manifest = reft_routing.add_runtime_bundle(name, request.lora_path)
        except BundleError as err:
            return refuse(str(err))
        if manifest["kind"] != "lora":
            return refuse(f"adapter {name!r} is a {manifest['kind']} bundle, not a LoRA bundle")
        request.lora_path = str(copy)
        self.lora_requests.pop(name, None)  # a replacement gets a new id: running requests keep the old adapter
        reft_routing.REFT_ADAPTERS.pop(name, None)
        return None


def patch_reft_routing() -> None:
    from starlette.middleware import Middleware
    from vllm.entrypoints.launchers.api_server import entry

    reft_routing.load_start_up_adapters()

    @wrap(entry, "build_app")
    def build_app(original, *args, **kwargs):
        app = original(*args, **kwargs)
        reft_routing.XARGS_PATHS = reft_routing.find_xargs_routes(app) | set(reft_routing.COMPLETION_PATHS)
        logger.info("preft: ReFT-P names are routed on %s", ", ".join(sorted(reft_routing.XARGS_PATHS)))
        # innermost of the app's middlewares: vLLM's authentication (and CORS, ...) run first
        require(app, "user_middleware").append(Middleware(reft_routing.ReftRoutingMiddleware))
        app.middleware_stack = None  # rebuilt with it on the first request
        return app


def patch_model_list() -> None:
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelPermission

    @wrap(OpenAIServingModels, "show_available_models")
    async def show_available_models(original, self):
        model_list = await original(self)
        model_list.data.extend(
            ModelCard(id=name, root=path, parent=self.base_model_paths[0].name, permission=[ModelPermission()])
            for name, path in reft_routing.REFT_ADAPTERS.items()
        )
        return model_list


#: the serving modules that import vLLM's ``get_max_tokens`` by name
MAX_TOKENS_IMPORTERS = (
    "vllm.entrypoints.openai.completion.serving", "vllm.entrypoints.openai.chat_completion.serving",
    "vllm.entrypoints.openai.chat_completion.batch_serving", "vllm.entrypoints.openai.responses.serving",
    "vllm.entrypoints.scale_out.render.serving", "vllm.entrypoints.scale_out.token_in_token_out.serving",
)


def room_for_one_token(original, max_model_len, max_tokens, input_length, *args, **kwargs):
    """``get_max_tokens``, refusing a prompt that leaves no position for an output token."""
    limit = original(max_model_len, max_tokens, input_length, *args, **kwargs)
    if limit < 1 and max_model_len <= input_length:
        raise ValueError(f"Input length ({input_length}) leaves no room for an output token in the model's maximum "
                         f"context length ({max_model_len}): a prompt may be at most {max_model_len - 1} tokens.")
    return limit


def patch_max_tokens() -> None:
    import functools
    import importlib

    from vllm.entrypoints.serve.utils import api_utils

    original = require(api_utils, "get_max_tokens")
    patched = functools.wraps(original)(functools.partial(room_for_one_token, original))
    api_utils.get_max_tokens = patched
    for name in MAX_TOKENS_IMPORTERS:
        module = importlib.import_module(name)
        if require(module, "get_max_tokens") is original:
            module.get_max_tokens = patched


def remove_temporary_store_at_exit() -> None:
    """The store ``preft serve`` made for itself goes with the server (only the API-server
    process, which keeps ``preft serve``'s pid, removes it; a ``--state-dir`` is the user's)."""
    import atexit
    import os
    import shutil

    if envs.PREFT_SERVE_STORE_OWNER_PID == os.getpid() and envs.PREFT_SERVE_STORE:
        atexit.register(shutil.rmtree, envs.PREFT_SERVE_STORE, True)


def adapter_of_request(request) -> str:
    """The adapter a request to the engine is for, as the client named it: its LoRA's name, the
    ReFT-P name of the bundle in its extra arguments, or the base model's name."""
    from preft.constants import REFT_EXTRA_ARG

    if request.lora_request is not None:
        return request.lora_request.lora_name
    bundle = (getattr(request.sampling_params, "extra_args", None) or {}).get(REFT_EXTRA_ARG)
    if bundle:  # the name this request's handler was routed under, else a name serving that copy
        named = reft_routing.REQUESTED_REFT_NAME.get()
        return named if reft_routing.REFT_ADAPTERS.get(named) == bundle else (
            reft_routing.name_of_copy(bundle) or adapter_metrics.UNKNOWN)
    return envs.PREFT_SERVE_BASE_NAME or "base"


def patch() -> None:
    remove_temporary_store_at_exit()
    adapter_metrics.install(envs.PREFT_METRICS_TOP_K, adapter_of_request)
    if adapter_resolver.resolving():
        adapter_resolver.patch()
    patch_load_checks()
    patch_reft_routing()
    patch_model_list()
    patch_max_tokens()
