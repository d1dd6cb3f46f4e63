"""YAML recipe configs with ``key=value`` command-line overrides (torchtune style).

A config is a flat-or-nested YAML mapping. ``key=value`` overrides use dots for nesting
(``trainer.learning_rate=1e-3``); the value is parsed as YAML 1.2 (only ``true``/``false`` are
booleans, so ``trainer.save_strategy=no`` stays the string ``no``), so ``adapter.r=64`` is an
int and ``adapter.layers=[0,2]`` (in ``sft_reft_p.yaml``) a list. :func:`check_fields` then
checks every value of a section against the dataclass it configures, before anything is
written. Overriding a key the config does not define is an error: a typo must
not be silently ignored.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class _OverrideLoader(yaml.SafeLoader):
    """YAML 1.2's core booleans and floats: only ``true`` / ``false`` are booleans (YAML 1.1 also
    reads yes/no/on/off), and ``1e-3`` is a float (PyYAML's 1.1 rule wants ``1.0e-3``)."""


_OverrideLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:bool",
                                                                        "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_OverrideLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                      list("tTfF"))
_OverrideLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


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
    if keys == ["data", "path"] or (keys == ["data", "task"] and raw.strip() == "local"):
        _switch_to_own_data(config)
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
    try:
        node[keys[-1]] = yaml.load(raw, Loader=_OverrideLoader) if raw.strip() else None
    except yaml.YAMLError:
        raise RecipeConfigError(f"override {override!r}: the value is not valid YAML") from None


def _switch_to_own_data(config: dict[str, Any]) -> None:
    """``data.path=FILE`` (or ``data.task=local``) on a recipe whose data is a generated task: the
    data section becomes the user's own (``task: local``), keeping its ``eval_examples``; the
    generated task's other keys (``user``, ``train_examples``) go with it."""
    data = config.get("data")
    if isinstance(data, dict) and data.get("task") != "local":
        config["data"] = {"task": "local", "path": None, "eval_examples": data.get("eval_examples", 64)}


def _accepts(annotation: Any, value: Any) -> bool:
    """Whether ``value`` fits a dataclass field's type (containers: their kind only)."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(member, value) for member in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return isinstance(value, annotation) or value in [member.value for member in annotation]
    if annotation in (list, tuple, set) or origin in (list, tuple, set):
        return isinstance(value, (list, tuple))
    if annotation is dict or origin is dict:
        return isinstance(value, dict)
    return True  # a type this check does not know: the dataclass's own validation decides


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(member) for member in typing.get_args(annotation))
    return "null" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


#: fields that must be positive when given (a 0 batch size would fail only once training starts)
POSITIVE_FIELDS = {"per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                   "learning_rate", "num_generations", "r", "rank", "save_steps", "eval_steps", "logging_steps"}


def check_fields(config_cls: type, section: dict[str, Any], where: str) -> None:
    """Every key of ``section`` is a field of the dataclass ``config_cls`` and its value has the
    field's type (and is positive where it must be); one error naming the key otherwise."""
    fields = {field.name for field in dataclasses.fields(config_cls)}
    unknown = sorted(set(section) - fields)
    if unknown:
        raise RecipeConfigError(f"{where}: unknown {config_cls.__name__} field(s) {unknown}")
    hints = typing.get_type_hints(config_cls)
    for key, value in section.items():
        annotation = hints.get(key, Any)
        if not _accepts(annotation, value):
            raise RecipeConfigError(f"{where}.{key} must be {_type_name(annotation)}, got {value!r}")
        if key in POSITIVE_FIELDS and isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
            raise RecipeConfigError(f"{where}.{key} must be > 0, got {value!r}")


def check_section(section: Any, schema: dict[str, type | tuple[type, ...]], where: str) -> None:
    """A recipe's own section (``data``): exactly the keys of ``schema``, values of its types
    (integers >= 1 and floats > 0, unless listed as ``(int, 0)`` / ``(float, 0)``: >= 0); one
    error naming the key."""
    if not isinstance(section, dict):
        raise RecipeConfigError(f"{where} must be a mapping, got {section!r}")
    missing, unknown = sorted(set(schema) - set(section)), sorted(set(section) - set(schema))
    if missing:
        raise RecipeConfigError(f"{where}: missing key(s) {missing}")
    if unknown:
        raise RecipeConfigError(f"{where}: unknown key(s) {unknown} (known: {sorted(schema)})")
    for key, kind in schema.items():
        value, low = section[key], 1
        if isinstance(kind, tuple):
            kind, low = kind
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise RecipeConfigError(f"{where}.{key} must be an integer >= {low}, got {value!r}")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not (value >= low if low == 0 else value > 0)):
            raise RecipeConfigError(f"{where}.{key} must be a number {'>= 0' if low == 0 else '> 0'}, got {value!r}")
        if kind is str and not isinstance(value, str):
            raise RecipeConfigError(f"{where}.{key} must be a string, got {value!r}")
