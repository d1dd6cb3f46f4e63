"""Adapters by name in the API server: ReFT-P routing, runtime loads, one namespace for all kinds.

vLLM's server knows base models and LoRA adapters only. An ASGI middleware, placed inside
vLLM's own middlewares (so ``--api-key`` is checked first), turns a request for ReFT-P adapter
``NAME`` into a request for the base model with ``vllm_xargs = {"preft_reft": COPY}``
(:data:`preft.constants.REFT_EXTRA_ARG`; ``COPY`` is the server's checked copy of the bundle,
:mod:`preft.serving.bundle_store`), read by the engine hooks (:mod:`preft.serving.reft`) and
by the prefix-cache keys. A client may not set that key itself: a JSON body that sets it in
any ``vllm_xargs`` object, on any route, is refused with a 400. ReFT-P names are routed on every
route whose request body takes ``vllm_xargs`` (:data:`XARGS_PATHS`, read from vLLM's routes at
start-up: completions, chat, ``/v1/messages``, ``/v1/responses``, ...). This is the API layer's
half; the engine's half is that it serves only the server's store copies
(:func:`preft.serving.bundle_store.is_store_copy`), whatever reaches it.

With runtime loading on (``preft serve --allow-runtime-loading --adapter-root DIR``),
``/v1/load_lora_adapter`` with a ReFT-P bundle under DIR registers its name here and
``/v1/unload_lora_adapter`` drops it; LoRA bundles go on to vLLM's own handler, which
:mod:`preft.serving.api_server` wraps with the same checks. Names are unique across kinds:
loading a name that exists (LoRA or ReFT-P) is a 400 unless ``load_inplace`` asks to replace
it; a replacement serves new requests, while requests already running finish on the copy
they started with.

Active only under ``preft serve`` (which sets ``PREFT_SERVE_*``, :mod:`preft.envs`), in the API
server process.
"""

from __future__ import annotations

import contextvars
import functools
import json
import time
import typing
from pathlib import Path

from preft import envs
from preft.constants import REFT_EXTRA_ARG
from preft.bundle import BundleError, read_manifest
from preft.serving import adapter_cache_stats, adapter_metrics, adapter_resolver
from preft.serving.bundle_store import BundleStore, resolve_under_root
from preft.serving.prompt_end import check_prompt_end

#: ReFT-P adapter name -> the server's copy of its bundle, in the API server process
REFT_ADAPTERS: dict[str, str] = {}
#: the ReFT-P name the request being handled gave in ``model`` (set by the middleware in the
#: request's task; the engine request carries only the bundle, which several names may share)
REQUESTED_REFT_NAME: contextvars.ContextVar[str | None] = contextvars.ContextVar("preft_reft_name", default=None)
#: vLLM's ``OpenAIServingModels`` of this server (its ``lora_requests`` are the LoRA names)
SERVING_MODELS = None
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
#: the POST routes whose request body takes ``vllm_xargs`` (:func:`find_xargs_routes` at start-up)
XARGS_PATHS: set[str] = set(COMPLETION_PATHS)
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def load_start_up_adapters() -> None:
    REFT_ADAPTERS.update(envs.PREFT_SERVE_REFT)


def lora_names() -> set[str]:
    return set(SERVING_MODELS.lora_requests) if SERVING_MODELS is not None else set()


def runtime_loading() -> bool:
    return envs.PREFT_SERVE_ADAPTER_ROOT is not None


@functools.cache
def bundle_store() -> BundleStore:
    """This server's store (one per API-server process; it reads the base model once)."""
    return BundleStore(envs.PREFT_SERVE_STORE, Path(envs.PREFT_SERVE_BASE), envs.PREFT_SERVE_MAX_RANK)


def add_runtime_bundle(name: str, path: str) -> tuple[Path, dict]:
    """The server's checked copy of the bundle a runtime load names (under the adapter root);
    counted as a store load on ``/metrics``."""
    if not isinstance(path, str) or not path:
        raise BundleError("'lora_path' must be provided")
    start = time.perf_counter()
    copy, manifest = bundle_store().add(name, resolve_under_root(path, Path(envs.PREFT_SERVE_ADAPTER_ROOT)))
    adapter_cache_stats.record_load("store", manifest["kind"], time.perf_counter() - start)
    return copy, manifest


def name_of_copy(copy: str) -> str | None:
    """The ReFT-P name serving the store copy ``copy`` (the first, if several share its content)."""
    return next((name for name, path in REFT_ADAPTERS.items() if path == copy), None)


def served_name(model) -> bool:
    """Whether ``model`` names something this server serves now (an adapter or the base model)."""
    return isinstance(model, str) and (model in REFT_ADAPTERS or model in lora_names()
                                       or model == envs.PREFT_SERVE_BASE_NAME)


def _kind_under_root(path) -> str | None:
    """The kind of the bundle a load names, or None (not a bundle, or outside the root: vLLM's
    wrapped handler then answers, without revealing anything)."""
    try:
        return read_manifest(resolve_under_root(str(path), Path(envs.PREFT_SERVE_ADAPTER_ROOT))).get("kind")
    except (BundleError, OSError, TypeError, ValueError):
        return None


def find_xargs_routes(app) -> set[str]:
    """The paths of ``app``'s POST routes whose request body model has a ``vllm_xargs`` field
    (a union of models counts if one of them has it)."""
    from fastapi.routing import APIRoute

    found = set()
    for route in app.routes:
        if not isinstance(route, APIRoute) or "POST" not in route.methods:
            continue
        for field in route.dependant.body_params:
            annotation = field.field_info.annotation
            for model in typing.get_args(annotation) or (annotation,):
                if "vllm_xargs" in (getattr(model, "model_fields", None) or {}):
                    found.add(route.path)
    return found


def sets_reserved_key(value) -> bool:
    """Whether any ``vllm_xargs`` object in the JSON ``value`` (nested ones too, as in a batch
    request) holds :data:`~preft.constants.REFT_EXTRA_ARG`."""
    if isinstance(value, dict):
        xargs = value.get("vllm_xargs")
        if isinstance(xargs, dict) and REFT_EXTRA_ARG in xargs:
            return True
        return any(sets_reserved_key(item) for item in value.values())
    if isinstance(value, list):
        return any(sets_reserved_key(item) for item in value)
    return False


def _is_json(scope) -> bool:
    content_type = dict(scope.get("headers", [])).get(b"content-type", b"")
    return content_type.split(b";")[0].strip().lower() in (b"application/json", b"")


async def _read_body(receive) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


async def _respond(send, status: int, payload) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _error(message: str, status: int) -> dict:
    return {"error": {"message": message, "type": "BadRequestError" if status == 400 else "NotFoundError",
                      "param": None, "code": status}}


def counting_errors(send, requested: list):
    """``send``, counting an answer with an HTTP error under the adapter the request named
    (``requested[0]``, known once the body is read; a name not served: ``_unknown``)."""
    async def send_counted(message):
        if message.get("type") == "http.response.start" and adapter_metrics.error_status(message.get("status", 200)) \
                and adapter_metrics.METRICS is not None:
            model = requested[0]
            adapter_metrics.METRICS.error(model if served_name(model) else adapter_metrics.UNKNOWN)
        await send(message)
    return send_counted


class ReftRoutingMiddleware:
    """Pure ASGI middleware (the request body is read once and replayed)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        admin = runtime_loading() and path in (LOAD, UNLOAD)
        if scope["type"] != "http" or scope.get("method") != "POST" or not (_is_json(scope) or admin):
            return await self.app(scope, receive, send)
        requested: list = [None]  # the model a completion-like request names, once read
        answer = counting_errors(send, requested) if path in XARGS_PATHS else send
        return await self._route(scope, receive, answer, path, admin, requested)

    async def _route(self, scope, receive, send, path, admin, requested):
        body = await _read_body(receive)
        try:
            data = json.loads(body) if body else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            data = None  # vLLM's own handler answers malformed JSON
        if sets_reserved_key(data):
            # only the server picks bundles: a client-chosen path would reach the engine unchecked
            return await _respond(send, 400, _error(f"vllm_xargs.{REFT_EXTRA_ARG} is reserved; name a ReFT-P "
                                                    "adapter in 'model' instead", 400))
        if isinstance(data, dict):
            xargs = data.get("vllm_xargs")
            if path in XARGS_PATHS and xargs is not None and not isinstance(xargs, dict):
                return await _respond(send, 400, _error(
                    f"vllm_xargs must be a JSON object, got {type(xargs).__name__}", 400))
            if path in XARGS_PATHS and isinstance(xargs, dict):
                try:
                    check_prompt_end(xargs)
                except ValueError as err:
                    return await _respond(send, 400, _error(str(err), 400))
            model = requested[0] = data.get("model")
            if path in XARGS_PATHS and adapter_resolver.resolving() and not served_name(model):
                try:
                    await adapter_resolver.resolve_reft(model)
                except BundleError as err:
                    return await _respond(send, 400, _error(str(err), 400))
            if path in XARGS_PATHS and isinstance(model, str) and model in REFT_ADAPTERS:
                bundle = REFT_ADAPTERS[model]
                REQUESTED_REFT_NAME.set(model)
                data["model"] = envs.PREFT_SERVE_BASE_NAME or model
                data["vllm_xargs"] = {**(xargs or {}), REFT_EXTRA_ARG: bundle}
                body = json.dumps(data).encode()
            elif path == LOAD and admin and _kind_under_root(data.get("lora_path")) == "reft":
                return await self._load(send, data)
            elif path == UNLOAD and admin and isinstance(data.get("lora_name"), str) \
                    and data["lora_name"] in REFT_ADAPTERS:
                del REFT_ADAPTERS[data["lora_name"]]
                return await _respond(send, 200, f"Success: ReFT-P adapter '{data['lora_name']}' removed.")

        sent = False

        async def replay():
            nonlocal sent
            if sent:  # after the body: wait for the client's disconnect, as the server would
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        scope = dict(scope)
        scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        scope["headers"].append((b"content-length", str(len(body)).encode()))
        return await self.app(scope, replay, send)

    async def _load(self, send, data) -> None:
        name = data.get("lora_name")
        if not isinstance(name, str) or not name:
            return await _respond(send, 400, _error("'lora_name' must be provided", 400))
        if name == envs.PREFT_SERVE_BASE_NAME:
            return await _respond(send, 400, _error(f"The adapter '{name}' conflicts with the served base model.", 400))
        if (name in REFT_ADAPTERS or name in lora_names()) and data.get("load_inplace") is not True:
            return await _respond(send, 400, _error(
                f"The adapter '{name}' has already been loaded. To replace it, set 'load_inplace' to true.", 400))
        try:
            copy, _ = add_runtime_bundle(name, data.get("lora_path"))
        except BundleError as err:
            return await _respond(send, 400, _error(str(err), 400))
        REFT_ADAPTERS[name] = str(copy)
        if SERVING_MODELS is not None:
            SERVING_MODELS.lora_requests.pop(name, None)  # the name now serves the ReFT-P bundle
        return await _respond(send, 200, f"Success: ReFT-P adapter '{name}' added successfully.")
