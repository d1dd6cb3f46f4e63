"""How PreFT patches vLLM internals: every patch names what it replaces and fails loudly when
that is gone (an internal moved in a vLLM release the plugin was not written against)."""

from __future__ import annotations

import functools
from typing import Any, Callable


def require(owner: Any, name: str) -> Any:
    """``owner.name``, or a RuntimeError saying which vLLM internal moved."""
    if not hasattr(owner, name):
        where = getattr(owner, "__module__", "") + "." + getattr(owner, "__qualname__", getattr(owner, "__name__", ""))
        raise RuntimeError(f"vLLM internal {where.strip('.')}.{name} moved: update preft's vLLM plugin "
                           "(preft.serving) for this vLLM release")
    return getattr(owner, name)


def wrap(owner: Any, name: str) -> Callable[[Callable], Callable]:
    """Decorator: replace ``owner.name`` by ``patched(original, *args, **kwargs)``."""

    def install(patched: Callable) -> Callable:
        original = require(owner, name)

        @functools.wraps(original)
        def replacement(*args, **kwargs):
            return patched(original, *args, **kwargs)

        setattr(owner, name, replacement)
        return replacement

    return install
