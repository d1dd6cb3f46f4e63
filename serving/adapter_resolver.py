"""Adapters on first use: ``preft serve --adapter-root DIR --resolve-adapters``.

A request whose ``model`` names no loaded adapter but a bundle directory ``DIR/<model>`` (from
``preft export``) is served by loading that bundle on that request:

- **LoRA / LoRA-P** through vLLM's own ``LoRAResolver`` plugin interface
  (:class:`StoreResolver`, registered in vLLM's ``LoRAResolverRegistry``): vLLM asks it inside
  its per-name lock, after checking the name is not loaded, so concurrent first requests for a
  name load it once;
- **ReFT-P** in the routing middleware (:func:`resolve_reft`, under a per-name lock of its own),
  which then routes the request as for a ReFT-P adapter given at start-up.

Either way the bundle goes through the server's store (:class:`preft.serving.bundle_store.BundleStore`:
copied, checked, content-addressed), with the checks every other load runs, and from then on the
name serves that copy: a bundle changed on disk afterwards is picked up only by an explicit
reload (``/v1/load_lora_adapter`` with ``load_inplace``), never half-read. A bundle that is
present but cannot be served is a 400 naming the problem; a name with no bundle is vLLM's 404
("does not exist"), the same answer whether or not other names exist. Names are one path
component (:data:`NAME`): ``..`` or ``a/b`` never reach the disk. Both routes run after vLLM's
``--api-key`` check, so a caller without the key learns nothing of the directory.

Resolving needs vLLM's runtime LoRA updating on, so such a server also serves the load and
unload routes (behind the key). Host memory is bounded by vLLM's LRU LoRA cache
(``--max-host-adapters``); the store's copies are on disk.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from preft import envs
from preft.bundle import MANIFEST, BundleError, read_manifest

#: a name that may be resolved: one path component, no leading dot
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_reft_locks: dict[str, asyncio.Lock] = {}


def resolving() -> bool:
    return envs.PREFT_SERVE_RESOLVE and envs.PREFT_SERVE_ADAPTER_ROOT is not None


def bundle_path(name) -> Path | None:
    """``ROOT/name`` if ``name`` is a resolvable name and that directory holds a bundle manifest."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        return None
    path = Path(envs.PREFT_SERVE_ADAPTER_ROOT) / name
    return path if (path / MANIFEST).is_file() else None


def bundle_kind(path: Path) -> str | None:
    """The bundle's kind; a manifest that cannot be read is a :class:`BundleError` naming it."""
    return read_manifest(path).get("kind")


async def add_to_store(name: str, path: Path) -> Path:
    """The server's checked copy of ``path`` (the copy and checks run off the event loop, so
    other requests go on being served meanwhile)."""
    from preft.serving import reft_routing

    copy, _ = await asyncio.to_thread(reft_routing.add_runtime_bundle, name, str(path))
    return copy


def make_resolver():
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver

    class StoreResolver(LoRAResolver):
        """LoRA bundles under the adapter root, served from the server's store."""

        async def resolve_lora(self, base_model_name: str, lora_name: str):
            path = bundle_path(lora_name)
            if path is None or bundle_kind(path) != "lora":  # ReFT-P names never reach vLLM's resolver
                return None
            copy = await add_to_store(lora_name, path)
            # a placeholder id (LoRARequest wants one > 0): vLLM gives it its own before loading it
            return LoRARequest(lora_name=lora_name, lora_int_id=1, lora_path=str(copy))

    return StoreResolver()


async def resolve_reft(name) -> None:
    """Load the ReFT-P bundle ``ROOT/name`` into the routing table if there is one and the name
    is not taken; a bad bundle raises :class:`BundleError`."""
    from preft.serving import reft_routing

    if bundle_path(name) is None:
        return
    lock = _reft_locks.setdefault(name, asyncio.Lock())
    async with lock:
        if name in reft_routing.REFT_ADAPTERS or name in reft_routing.lora_names() \
                or name == envs.PREFT_SERVE_BASE_NAME:
            return
        path = bundle_path(name)
        if path is None or bundle_kind(path) != "reft":
            return
        copy = await add_to_store(name, path)
        reft_routing.REFT_ADAPTERS[name] = str(copy)


def patch() -> None:
    """Register :class:`StoreResolver` with vLLM, and make a bundle that cannot be served a 400
    naming the problem (vLLM's own answer to a resolver's error is a 500)."""
    from http import HTTPStatus

    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve import create_error_response
    from vllm.lora.resolver import LoRAResolverRegistry

    from preft.serving.patching import wrap

    LoRAResolverRegistry.register_resolver("preft-store", make_resolver())

    @wrap(OpenAIServingModels, "resolve_lora")
    async def resolve_lora(original, self, lora_name):
        try:
            return await original(self, lora_name)
        except BundleError as err:
            return create_error_response(message=str(err), err_type="BadRequestError",
                                         status_code=HTTPStatus.BAD_REQUEST)
