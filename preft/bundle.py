"""The serving bundle: what ``preft export`` writes and ``preft serve`` reads, in one module.

A bundle is a directory; ``preft_manifest.json`` says what the rest is:

- LoRA-P / LoRA: ``adapter_config.json`` (``peft_type: LORA``, so vLLM's LoRA loader accepts it)
  + ``adapter_model.safetensors`` (the PEFT weights, unchanged);
- ReFT-P: ``reft_weights.safetensors`` with, per edited layer ``i``, ``layers.i.proj``
  (``R`` with orthonormal rows for LoReFT, ``W2`` for DiReFT; rank x hidden),
  ``layers.i.source_weight`` (``W``; rank x hidden) and ``layers.i.source_bias`` (``b``; rank).

The manifest (format :data:`BUNDLE_FORMAT`) records ``kind``, ``rank``, the rule
(``prefill_only``, ``adapter_start``; :meth:`~preft.rule.AdapterRule.from_manifest`), the base
model it was exported for (``model_type``, sizes) and, for ReFT, ``intervention`` and ``layers``.

Here: the format's constants, :func:`read_manifest` (which checks the recorded rule too),
:func:`bundle_rule`, and the checks of a bundle's weights against a base
(:func:`base_fingerprint`): :func:`check_lora` and :func:`check_reft`, one copy each, used by the
writer (:mod:`preft.export`) and by the server's store (:mod:`preft.serving.bundle_store`).
Every refusal is a :class:`BundleError` naming the problem.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from preft import envs
from preft.families import FAMILIES, UnsupportedFamily, family_of
from preft.rule import ALL_TOKEN, AdapterRule

MANIFEST = "preft_manifest.json"
BUNDLE_FORMAT = "preft-bundle/1"
#: the base models' ``model_type`` a bundle may be exported for: the families the tests cover
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
#: the files of a bundle besides its manifest, by kind (``preft export`` writes exactly these)
BUNDLE_FILES = {"lora": ("adapter_config.json", "adapter_model.safetensors"), "reft": ("reft_weights.safetensors",)}
INTERVENTIONS = ("loreft", "direft")
#: largest |weight| and |lora_alpha / r| accepted: trained adapters are orders of magnitude below;
#: beyond this a bundle makes the model's activations overflow (empty or garbage answers)
MAX_ABS_WEIGHT = 1e4
LORA_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$")
#: a ReFT-P bundle's tensors, per layer: name -> shape given (rank, hidden)
REFT_PARTS = {"proj": lambda rank, hidden: (rank, hidden), "source_weight": lambda rank, hidden: (rank, hidden),
              "source_bias": lambda rank, hidden: (rank,)}


class BundleError(ValueError):
    """The adapter or bundle cannot be served on this base; the message says why."""


ExportError = BundleError  # the name ``preft export``'s callers know


def read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise BundleError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise BundleError(f"{what} is not valid JSON: {path} ({err})") from None


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise BundleError(f"adapter weights not found: {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise BundleError(f"adapter weights are corrupt or unreadable: {path} ({err})") from None


def config_field(config: dict, key: str, kind: str, default: Any = ..., what: str = "adapter config") -> Any:
    """``config[key]`` checked: ``int`` (> 0), ``start`` (int >= 0), ``bool``, ``number`` (finite)."""
    if key not in config:
        if default is ...:
            raise BundleError(f"{what} has no {key!r}")
        return default
    value = config[key]
    if kind in ("int", "start"):
        low = 1 if kind == "int" else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise BundleError(f"{what}: {key} must be an integer >= {low}, got {value!r}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise BundleError(f"{what}: {key} must be true or false, got {value!r}")
    elif kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BundleError(f"{what}: {key} must be a finite number, got {value!r}")
    return value


def has_manifest(bundle_dir: str | Path) -> bool:
    """Whether ``bundle_dir`` holds a PreFT manifest (a plain PEFT/vLLM LoRA directory does not)."""
    return (Path(bundle_dir) / MANIFEST).is_file()


def read_manifest(bundle_dir: str | Path) -> dict[str, Any]:
    """The manifest of an exported bundle: refuses a directory that is not one, and a manifest
    whose rule (``prefill_only``, ``adapter_start``) is not a rule."""
    manifest = read_json(Path(bundle_dir) / MANIFEST, "PreFT bundle manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise BundleError(f"{bundle_dir}: unknown bundle format {found!r} (expected {BUNDLE_FORMAT})")
    what = f"{bundle_dir}: the bundle manifest"
    config_field(manifest, "prefill_only", "bool", default=False, what=what)
    config_field(manifest, "adapter_start", "start", default=0, what=what)
    return manifest


@functools.lru_cache(maxsize=4096)
def bundle_rule(bundle_dir: str | Path) -> AdapterRule:
    """The rule of the bundle at ``bundle_dir``, read once from its manifest. A directory without
    a manifest is a plain LoRA: every token, as stock vLLM does. ``PREFT_ALL_TOKEN=1`` (``preft
    serve --all-token``) makes every bundle all-token, LoRA and ReFT alike: the standard
    multi-adapter baseline.

    Cached per bundle for the life of the process (the engine asks for it per request per
    step, and a server's environment and bundle copies do not change): ``bundle_rule.cache_clear()``
    after changing either in-process. A copy in ``preft serve``'s store without its manifest is
    an error, never all-token; errors are not cached."""
    if not has_manifest(bundle_dir):
        store = envs.PREFT_SERVE_STORE
        if store and Path(bundle_dir).resolve().is_relative_to(Path(store).resolve()):
            # a copy in preft serve's store always has one: guessing "all-token" would serve wrong answers
            raise BundleError(f"{bundle_dir}: the server's copy of this bundle lost its manifest")
        return ALL_TOKEN  # a plain vLLM LoRA directory
    if envs.PREFT_ALL_TOKEN:
        return ALL_TOKEN
    return AdapterRule.from_manifest(read_manifest(bundle_dir))


def base_fingerprint(base_dir: Path) -> dict[str, Any]:
    """What a bundle records about its base, and the shapes of the base's weights."""
    config = read_json(base_dir / "config.json", "base model config")
    model_type = config.get("model_type")
    try:
        family_of(model_type, f"base model {base_dir}")
    except UnsupportedFamily as err:
        raise BundleError(str(err)) from None
    shapes: dict[str, tuple[int, ...]] = {}
    for weights in sorted(base_dir.glob("*.safetensors")):
        with safe_open(str(weights), "pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    if not shapes:
        raise BundleError(f"base model {base_dir} has no *.safetensors weights")
    return {
        "model_type": model_type,
        "hidden_size": config["hidden_size"],
        "num_hidden_layers": config["num_hidden_layers"],
        "vocab_size": config["vocab_size"],
        "shapes": shapes,
    }


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """Every weight finite and at most :data:`MAX_ABS_WEIGHT` in magnitude."""
    bad = [k for k, v in tensors.items() if not torch.isfinite(v).all()]
    if bad:
        raise BundleError(f"adapter weights contain NaN or infinite values: {bad[:3]}{' ...' if len(bad) > 3 else ''}")
    huge = [k for k, v in tensors.items() if v.numel() and float(v.abs().max()) > MAX_ABS_WEIGHT]
    if huge:
        raise BundleError(f"adapter weights over {MAX_ABS_WEIGHT:g} in magnitude: {huge[:3]} (a broken adapter?)")


def check_lora(tensors, config, base, max_rank) -> int:
    """Check a LoRA adapter's config and tensors against the base (:func:`base_fingerprint`); its rank."""
    rank = config_field(config, "r", "int")
    alpha = config_field(config, "lora_alpha", "number", default=8)
    if abs(alpha / rank) > MAX_ABS_WEIGHT:
        raise BundleError(f"adapter config: lora_alpha / r = {alpha / rank:g} is over {MAX_ABS_WEIGHT:g} "
                          "(a broken adapter?)")
    if rank > max_rank:
        raise BundleError(f"adapter rank r={rank} is over the server's max rank {max_rank}")
    if any(config.get(k) for k in ("rank_pattern", "alpha_pattern")):
        raise BundleError("rank_pattern / alpha_pattern are not supported for serving: use one r and lora_alpha")
    if not tensors:
        raise BundleError("adapter weights are empty")
    sides: dict[str, set[str]] = {}
    for key, tensor in tensors.items():
        match = LORA_KEY.match(key)
        if match is None:
            raise BundleError(f"unexpected tensor {key!r}: PreFT serves LoRA on decoder-layer linear modules only")
        layer, block, module, side = int(match[1]), match[2], match[3], match[4]
        sides.setdefault(f"layers.{layer}.{block}.{module}", set()).add(side)
        if layer >= base["num_hidden_layers"]:
            raise BundleError(f"{key}: layer {layer} does not exist in the base ({base['num_hidden_layers']} layers)")
        base_key = f"model.layers.{layer}.{block}.{module}.weight"
        if base_key not in base["shapes"]:
            raise BundleError(f"{key}: the base has no module {base_key.removesuffix('.weight')} (wrong base model?)")
        out_features, in_features = base["shapes"][base_key]
        expected = (rank, in_features) if side == "A" else (out_features, rank)
        if tuple(tensor.shape) != expected:
            raise BundleError(
                f"{key}: shape {tuple(tensor.shape)} does not fit the base's {module} "
                f"(expected {expected}; wrong base model?)"
            )
    incomplete = sorted(module for module, found in sides.items() if found != {"A", "B"})
    if incomplete:
        raise BundleError(f"adapter weights are incomplete: {incomplete[:3]} lack lora_A or lora_B")
    return rank


def check_reft(fields: dict, tensors: dict[str, torch.Tensor], base: dict, max_rank: int) -> None:
    """A ReFT-P bundle's manifest ``fields`` (``intervention``, ``rank``, ``layers``) and its
    tensors (:data:`REFT_PARTS` per layer) agree with each other and with the base: every layer
    exists in the base and has its three tensors, of shapes (rank, hidden), (rank, hidden), (rank)."""
    if fields.get("intervention") not in INTERVENTIONS:
        raise BundleError(f"intervention must be 'loreft' or 'direft', got {fields.get('intervention')!r}")
    rank = config_field(fields, "rank", "int")
    if rank > max_rank:
        raise BundleError(f"adapter rank={rank} is over the server's max rank {max_rank}")
    layers, hidden = fields.get("layers"), base["hidden_size"]
    if not isinstance(layers, list) or not layers:
        raise BundleError("adapter weights are empty" if layers == [] else f"the layers {layers!r} are not a list")
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < base["num_hidden_layers"]:
            raise BundleError(f"ReFT layer {layer!r} does not exist in the base ({base['num_hidden_layers']} layers)")
        found = sorted(part for part in REFT_PARTS if f"layers.{layer}.{part}" in tensors)
        if len(found) != len(REFT_PARTS):
            raise BundleError(f"ReFT layer {layer} is incomplete: has {found}")
        for part, shape_of in REFT_PARTS.items():
            shape = tuple(tensors[f"layers.{layer}.{part}"].shape)
            if shape != shape_of(rank, hidden):
                raise BundleError(f"ReFT layer {layer}: {part} of shape {shape} does not fit hidden size {hidden} at "
                                  f"rank {rank} (expected {shape_of(rank, hidden)}; wrong base model?)")
    expected = {f"layers.{layer}.{part}" for layer in layers for part in REFT_PARTS}
    extra = sorted(set(tensors) - expected)
    if extra:
        raise BundleError(f"unexpected tensor {extra[0]!r}: not a part of the bundle's layers {layers}")
