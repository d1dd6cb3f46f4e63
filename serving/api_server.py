"""Patches that run in vLLM's API-server process, under ``preft serve`` only.

1. ``/v1/load_lora_adapter`` runs the same bundle checks as start-up
   (:func:`preft.serving.server.check_bundle`: manifest, kind, rank, base model, finite
   weights) and answers 400 with the reason, before the engine sees the adapter.
2. ReFT-P adapters are routed by name: an ASGI middleware (:mod:`preft.serving.reft_routing`)
   sits outermost in the app vLLM builds.
3. ``/v1/models`` lists the ReFT-P adapters beside the LoRA adapters.
"""

from __future__ import annotations

from http import HTTPStatus
from pathlib import Path

from preft import envs
from preft.export import ExportError
from preft.serving import reft_routing
from preft.serving.patching import require, wrap


def patch_load_checks() -> None:
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve import create_error_response

    from preft.serving.server import check_bundle

    @wrap(OpenAIServingModels, "_check_load_lora_adapter_request")
    async def checked(original, self, request):
        error = await original(self, request)
        if error is not None:
            return error
        try:
            check_bundle(request.lora_name, request.lora_path, Path(envs.PREFT_SERVE_BASE), envs.PREFT_SERVE_MAX_RANK)
        except ExportError as err:
            return create_error_response(message=str(err), err_type="BadRequestError",
                                         status_code=HTTPStatus.BAD_REQUEST)
        return None


def patch_reft_routing() -> None:
    from vllm.entrypoints.launchers.api_server import entry

    reft_routing.load_start_up_adapters()

    @wrap(entry, "build_app")
    def build_app(original, *args, **kwargs):
        app = original(*args, **kwargs)
        # outermost layer of the ASGI stack (vLLM may have built the stack already)
        build_stack = require(app, "build_middleware_stack")
        app.build_middleware_stack = lambda: reft_routing.ReftRoutingMiddleware(build_stack())
        if app.middleware_stack is not None:
            app.middleware_stack = reft_routing.ReftRoutingMiddleware(app.middleware_stack)
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


def patch() -> None:
    patch_load_checks()
    patch_reft_routing()
    patch_model_list()
