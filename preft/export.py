"""Export: check a PEFT-format adapter against its base model and write a serving bundle.

    preft export ADAPTER_DIR --base BASE_DIR -o BUNDLE_DIR [--max-rank 64]

Checks (each refusal names the problem): the adapter directory and its files exist and parse;
the PEFT type is one PreFT serves (``PREFT_LORA``, ``PREFT_REFT``, or plain ``LORA``, which is
served all-token as the baseline); every config field it reads has the right type and range
(``r``, ``lora_alpha``, ``rank``, ``intervention``, ``adapter_start``, ``prefill_only``); the base
is a decoder vLLM runs (Llama / Qwen2 / Mistral); every adapter tensor belongs to a module the
base has, with matching shapes (hidden size, layer count, target modules), and the tensor set is
complete (every LoRA A has its B, every ReFT layer its three tensors); the rank is at most
``--max-rank``; all weights are finite and of sane magnitude (at most :data:`MAX_ABS_WEIGHT`).

Output: the bundle is built in a temporary directory beside ``-o`` and renamed into place. An
existing ``-o`` is refused unless ``overwrite=True`` (``--overwrite``), and even then only if it
is a PreFT bundle that does not hold the adapter being exported. Exporting a bundle again (its
``adapter_config.json`` is plain LoRA) keeps the rule its manifest records.

Bundle layout (``preft_manifest.json`` says what the rest is):

- LoRA-P / LoRA: ``adapter_config.json`` (``peft_type: LORA``, so vLLM's LoRA loader accepts it)
  + ``adapter_model.safetensors`` (the PEFT weights, unchanged);
- ReFT-P: ``reft_weights.safetensors`` with, per edited layer ``i``, ``layers.i.proj``
  (``R`` with orthonormal rows for LoReFT, ``W2`` for DiReFT; rank x hidden), ``layers.i.source_weight``
  (``W``; rank x hidden) and ``layers.i.source_bias`` (``b``; rank).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from preft.tuners import PREFT_LORA, PREFT_REFT
from preft.tuners.reft_p.layer import orthonormal_rows

MANIFEST = "preft_manifest.json"
BUNDLE_FORMAT = "preft-bundle/1"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")
_LORA_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$")
_REFT_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.reft_(source|proj)\.(weight|bias)$")
#: largest |weight| and |lora_alpha / r| accepted: trained adapters are orders of magnitude below;
#: beyond this a bundle makes the model's activations overflow (empty or garbage answers)
MAX_ABS_WEIGHT = 1e4


class ExportError(ValueError):
    """The adapter cannot be served on this base; the message says why."""


def read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise ExportError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ExportError(f"{what} is not valid JSON: {path} ({err})") from None


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ExportError(f"adapter weights not found: {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ExportError(f"adapter weights are corrupt or unreadable: {path} ({err})") from None


def base_fingerprint(base_dir: Path) -> dict[str, Any]:
    """What the bundle records about its base, and the shapes of the base's weights."""
    config = read_json(base_dir / "config.json", "base model config")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ExportError(
            f"base model {base_dir} is a {model_type!r} model; PreFT serves {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for weights in sorted(base_dir.glob("*.safetensors")):
        with safe_open(str(weights), "pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    if not shapes:
        raise ExportError(f"base model {base_dir} has no *.safetensors weights")
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
        raise ExportError(f"adapter weights contain NaN or infinite values: {bad[:3]}{' ...' if len(bad) > 3 else ''}")
    huge = [k for k, v in tensors.items() if v.numel() and float(v.abs().max()) > MAX_ABS_WEIGHT]
    if huge:
        raise ExportError(f"adapter weights over {MAX_ABS_WEIGHT:g} in magnitude: {huge[:3]} (a broken adapter?)")


def _field(config: dict, key: str, kind: str, default: Any = ...) -> Any:
    """``config[key]`` checked: ``int`` (> 0), ``start`` (int >= 0), ``bool``, ``number`` (finite)."""
    if key not in config:
        if default is ...:
            raise ExportError(f"adapter config has no {key!r}")
        return default
    value = config[key]
    if kind in ("int", "start"):
        low = 1 if kind == "int" else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ExportError(f"adapter config: {key} must be an integer >= {low}, got {value!r}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise ExportError(f"adapter config: {key} must be true or false, got {value!r}")
    elif kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not torch.isfinite(torch.tensor(value)):
            raise ExportError(f"adapter config: {key} must be a finite number, got {value!r}")
    return value


def check_lora(tensors, config, base, max_rank) -> int:
    """Check a LoRA adapter's config and tensors against the base (:func:`base_fingerprint`); its rank."""
    rank = _field(config, "r", "int")
    alpha = _field(config, "lora_alpha", "number", default=8)
    if abs(alpha / rank) > MAX_ABS_WEIGHT:
        raise ExportError(f"adapter config: lora_alpha / r = {alpha / rank:g} is over {MAX_ABS_WEIGHT:g} "
                          "(a broken adapter?)")
    if rank > max_rank:
        raise ExportError(f"adapter rank r={rank} is over the server's max rank {max_rank}")
    if any(config.get(k) for k in ("rank_pattern", "alpha_pattern")):
        raise ExportError("rank_pattern / alpha_pattern are not supported for serving: use one r and lora_alpha")
    if not tensors:
        raise ExportError("adapter weights are empty")
    sides: dict[str, set[str]] = {}
    for key, tensor in tensors.items():
        match = _LORA_KEY.match(key)
        if match is None:
            raise ExportError(f"unexpected tensor {key!r}: PreFT serves LoRA on decoder-layer linear modules only")
        layer, block, module, side = int(match[1]), match[2], match[3], match[4]
        sides.setdefault(f"layers.{layer}.{block}.{module}", set()).add(side)
        if layer >= base["num_hidden_layers"]:
            raise ExportError(f"{key}: layer {layer} does not exist in the base ({base['num_hidden_layers']} layers)")
        base_key = f"model.layers.{layer}.{block}.{module}.weight"
        if base_key not in base["shapes"]:
            raise ExportError(f"{key}: the base has no module {base_key.removesuffix('.weight')} (wrong base model?)")
        out_features, in_features = base["shapes"][base_key]
        expected = (rank, in_features) if side == "A" else (out_features, rank)
        if tuple(tensor.shape) != expected:
            raise ExportError(
                f"{key}: shape {tuple(tensor.shape)} does not fit the base's {module} "
                f"(expected {expected}; wrong base model?)"
            )
    incomplete = sorted(module for module, found in sides.items() if found != {"A", "B"})
    if incomplete:
        raise ExportError(f"adapter weights are incomplete: {incomplete[:3]} lack lora_A or lora_B")
    return rank


def _reft_tensors(tensors, config, base, max_rank) -> dict[str, torch.Tensor]:
    rank = _field(config, "rank", "int")
    if config.get("intervention") not in ("loreft", "direft"):
        raise ExportError(f"adapter config: intervention must be 'loreft' or 'direft', got {config.get('intervention')!r}")
    if rank > max_rank:
        raise ExportError(f"adapter rank={rank} is over the server's max rank {max_rank}")
    hidden = base["hidden_size"]
    parts: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _REFT_KEY.match(key)
        if match is None:
            raise ExportError(f"unexpected tensor {key!r} in a ReFT adapter")
        parts.setdefault(int(match[1]), {})[f"{match[2]}_{match[3]}"] = tensor.float()
    out = {}
    for layer, part in sorted(parts.items()):
        if layer >= base["num_hidden_layers"]:
            raise ExportError(f"ReFT layer {layer} does not exist in the base ({base['num_hidden_layers']} layers)")
        if set(part) != {"source_weight", "source_bias", "proj_weight"}:
            raise ExportError(f"ReFT layer {layer} is incomplete: has {sorted(part)}")
        if tuple(part["source_weight"].shape) != (rank, hidden) or tuple(part["proj_weight"].shape) != (rank, hidden):
            raise ExportError(
                f"ReFT layer {layer}: weights of shape {tuple(part['source_weight'].shape)} do not fit hidden size "
                f"{hidden} at rank {rank} (wrong base model?)"
            )
        proj = part["proj_weight"]
        out[f"layers.{layer}.proj"] = orthonormal_rows(proj) if config["intervention"] == "loreft" else proj
        out[f"layers.{layer}.source_weight"] = part["source_weight"]
        out[f"layers.{layer}.source_bias"] = part["source_bias"]
    if not out:
        raise ExportError("adapter weights are empty")
    return out


def _check_output(output_dir: Path, adapter_dir: Path, overwrite: bool) -> None:
    """Refuse an ``-o`` that would destroy something: see the module docstring."""
    if output_dir.is_file() or output_dir.is_symlink():
        raise ExportError(f"-o {output_dir} is an existing file, not a bundle directory")
    if not output_dir.exists():
        return
    if not overwrite:
        raise ExportError(f"-o {output_dir} already exists: choose a new directory, or pass --overwrite to "
                          "replace the bundle there")
    if adapter_dir.resolve().is_relative_to(output_dir.resolve()):
        raise ExportError(f"-o {output_dir} holds the adapter being exported: choose another directory")
    if not has_manifest(output_dir):
        raise ExportError(f"-o {output_dir} exists and is not a PreFT bundle: refusing to replace it")


def _rule_of(adapter_dir: Path, config: dict[str, Any]) -> tuple[bool, int]:
    """``(prefill_only, adapter_start)``: from the PEFT config, or, for a bundle exported again,
    from its manifest (the bundle's config is plain LoRA and no longer says)."""
    if has_manifest(adapter_dir):
        manifest = read_manifest(adapter_dir)
        return (_field(manifest, "prefill_only", "bool", default=False),
                _field(manifest, "adapter_start", "start", default=0))
    return _field(config, "prefill_only", "bool", default=False), _field(config, "adapter_start", "start", default=0)


def export_adapter(adapter_dir: str | Path, base_dir: str | Path, output_dir: str | Path,
                   max_rank: int = 64, overwrite: bool = False) -> dict[str, Any]:
    """Check ``adapter_dir`` against ``base_dir`` and write a bundle to ``output_dir``.

    Returns the manifest. Nothing is written unless every check passes: the bundle is built in a
    temporary directory beside ``output_dir`` and renamed into place. An existing
    ``output_dir`` is replaced only with ``overwrite=True``, and only if it is a bundle.
    """
    adapter_dir, base_dir, output_dir = Path(adapter_dir), Path(base_dir), Path(output_dir)
    if not adapter_dir.is_dir():
        raise ExportError(f"adapter directory not found: {adapter_dir}")
    _check_output(output_dir, adapter_dir, overwrite)
    config = read_json(adapter_dir / "adapter_config.json", "adapter config")
    if not isinstance(config, dict):
        raise ExportError(f"adapter config must be a JSON object: {adapter_dir / 'adapter_config.json'}")
    peft_type = config.get("peft_type")
    if peft_type not in (PREFT_LORA, PREFT_REFT, "LORA"):
        raise ExportError(f"adapter peft_type {peft_type!r} is not servable (PREFT_LORA, PREFT_REFT or LORA)")
    prefill_only, adapter_start = _rule_of(adapter_dir, config)
    base = base_fingerprint(base_dir)
    tensors = load_tensors(adapter_dir / "adapter_model.safetensors")
    check_finite(tensors)

    manifest: dict[str, Any] = {
        "format": BUNDLE_FORMAT,
        "source_peft_type": peft_type,
        "adapter_start": adapter_start,
        "prefill_only": prefill_only,
        "base": {k: v for k, v in base.items() if k != "shapes"},
    }
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.preft-export-", dir=output_dir.parent))
    replaced = None
    try:
        if peft_type == PREFT_REFT:
            weights = _reft_tensors(tensors, config, base, max_rank)
            manifest.update(kind="reft", intervention=config["intervention"], rank=int(config["rank"]),
                            layers=sorted({int(k.split(".")[1]) for k in weights}))
            save_file(weights, str(staging / "reft_weights.safetensors"))
        else:
            rank = check_lora(tensors, config, base, max_rank)
            manifest.update(kind="lora", rank=rank)
            lora_config = {k: v for k, v in config.items() if k not in ("adapter_start", "prefill_only")}
            lora_config["peft_type"] = "LORA"  # what vLLM's LoRA loader reads
            (staging / "adapter_config.json").write_text(json.dumps(lora_config, indent=2) + "\n")
            shutil.copyfile(adapter_dir / "adapter_model.safetensors", staging / "adapter_model.safetensors")
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if output_dir.exists():  # an existing bundle, --overwrite (checked above): set aside first
            replaced = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.preft-replaced-", dir=output_dir.parent))
            os.rename(output_dir, replaced / "bundle")
        try:
            os.rename(staging, output_dir)
        except OSError:
            if replaced is not None:  # put the old bundle back
                os.rename(replaced / "bundle", output_dir)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if replaced is not None:  # the new bundle is in place: the one it replaced goes
        shutil.rmtree(replaced, ignore_errors=True)
    return manifest


def has_manifest(bundle_dir: str | Path) -> bool:
    """Whether ``bundle_dir`` holds a PreFT manifest (a plain PEFT/vLLM LoRA directory does not)."""
    return (Path(bundle_dir) / MANIFEST).is_file()


def read_manifest(bundle_dir: str | Path) -> dict[str, Any]:
    """The manifest of an exported bundle (refuses a directory that is not one)."""
    manifest = read_json(Path(bundle_dir) / MANIFEST, "PreFT bundle manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ExportError(f"{bundle_dir}: unknown bundle format {found!r} (expected {BUNDLE_FORMAT})")
    return manifest
