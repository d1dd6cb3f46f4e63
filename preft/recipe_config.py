"""YAML recipe configs with ``key=value`` command-line overrides (torchtune style).

A config is a flat-or-nested YAML mapping. ``key=value`` overrides use dots for nesting
(``trainer.learning_rate=1e-3``); the value is parsed as YAML, so ``adapter.r=64`` is an int
and ``adapter.layers=[0,2]`` (in ``sft_reft_p.yaml``) a list. Overriding a key the config does not define is an error: a typo must
not be silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class RecipeConfigError(ValueError):
    """A recipe config is malformed or an override names an unknown key."""


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Read ``path`` and apply ``key=value`` overrides; returns a plain dict."""
    path = Path(path)
    if not path.is_file():
        raise RecipeConfigError(f"recipe config not found: {path}")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise RecipeConfigError(f"{path}: not valid YAML ({err})") from err
    if not isinstance(config, dict):
        raise RecipeConfigError(f"{path}: expected a mapping of keys to values at the top level")
    for override in overrides:
        apply_override(config, override)
    return config


def apply_override(config: dict[str, Any], override: str) -> None:
    """Apply one ``dotted.key=value`` override in place."""
    if "=" not in override:
        raise RecipeConfigError(f"override {override!r} is not of the form key=value")
    dotted, raw = override.split("=", 1)
    keys = dotted.strip().split(".")
    node = config
    for depth, key in enumerate(keys):
        if not isinstance(node, dict) or key not in node:
            known = sorted(node) if isinstance(node, dict) else []
            where = ".".join(keys[:depth]) or "the config"
            raise RecipeConfigError(
                f"unknown recipe key {dotted!r}: {where} has no key {key!r} (known: {', '.join(known)})"
            )
        if depth < len(keys) - 1:
            node = node[key]
    node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else None
