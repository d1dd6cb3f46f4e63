"""ReFT-P adapters in the OpenAI server: requests name them in ``model`` like LoRA adapters.

vLLM's server knows base models and LoRA adapters only. An ASGI middleware in front of it
turns a request for ReFT-P adapter ``NAME`` into a request for the base model with
``vllm_xargs = {"preft_reft": BUNDLE}`` (:data:`preft.constants.REFT_EXTRA_ARG`), read by the
engine hooks (:mod:`preft.serving.reft`) and by the prefix-cache keys (blocks from
``adapter_start`` on are keyed by the bundle). ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` with a ReFT-P bundle register and drop names here; ``/v1/models``
lists them.

Active only under ``preft serve`` (which sets ``PREFT_SERVE_*``, :mod:`preft.envs`), in the API
server process (:mod:`preft.serving.api_server` installs it).
"""

from __future__ import annotations

import json
from pathlib import Path

from preft import envs
from preft.constants import REFT_EXTRA_ARG
from preft.export import ExportError, read_manifest

#: ReFT-P adapter name -> bundle directory, in the API server process
REFT_ADAPTERS: dict[str, str] = {}
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


def load_start_up_adapters() -> None:
    REFT_ADAPTERS.update(envs.PREFT_SERVE_REFT)


def is_reft_bundle(path: str) -> bool:
    try:
        return read_manifest(path).get("kind") == "reft"
    except ExportError:
        return False


async def _read_body(receive) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


async def _respond(send, status: int, payload) -> None:
    body = json.dumps(payload).encode() if not isinstance(payload, str) else json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _error(message: str, status: int) -> dict:
    return {"error": {"message": message, "type": "BadRequestError" if status == 400 else "NotFoundError",
                      "param": None, "code": status}}


class ReftRoutingMiddleware:
    """Pure ASGI middleware (the request body is read once and replayed)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") != "POST" or not (
            path in COMPLETION_PATHS or path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
        ):
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        try:
            data = json.loads(body) if body else None
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            if path in COMPLETION_PATHS and REFT_EXTRA_ARG in (data.get("vllm_xargs") or {}):
                # only the server picks bundles: a client-chosen path would reach the engine unchecked
                return await _respond(send, 400, _error(f"vllm_xargs.{REFT_EXTRA_ARG} is reserved; name a ReFT-P "
                                                        "adapter in 'model' instead", 400))
            if path in COMPLETION_PATHS and data.get("model") in REFT_ADAPTERS:
                bundle = REFT_ADAPTERS[data["model"]]
                data["model"] = envs.PREFT_SERVE_BASE_NAME or data["model"]
                data["vllm_xargs"] = {**(data.get("vllm_xargs") or {}), REFT_EXTRA_ARG: bundle}
                body = json.dumps(data).encode()
            elif path == "/v1/load_lora_adapter" and is_reft_bundle(str(data.get("lora_path", ""))):
                return await self._load(send, data)
            elif path == "/v1/unload_lora_adapter" and data.get("lora_name") in REFT_ADAPTERS:
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
        from preft.serving.server import check_bundle

        name, path = data.get("lora_name"), data["lora_path"]
        if not name:
            return await _respond(send, 400, _error("'lora_name' must be provided", 400))
        if name in REFT_ADAPTERS and not data.get("load_inplace"):
            return await _respond(send, 400, _error(f"The adapter '{name}' has already been loaded.", 400))
        try:
            check_bundle(name, path, Path(envs.PREFT_SERVE_BASE), envs.PREFT_SERVE_MAX_RANK)
        except ExportError as err:
            return await _respond(send, 400, _error(str(err), 400))
        REFT_ADAPTERS[name] = path
        return await _respond(send, 200, f"Success: ReFT-P adapter '{name}' added successfully.")
