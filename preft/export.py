"""Export: check a PEFT-format adapter against its base model and write a serving bundle.

    preft export ADAPTER_DIR --base BASE_DIR -o BUNDLE_DIR [--max-rank 64]

Checks (each refusal names the problem): the adapter directory and its files exist and parse;
the PEFT type is one PreFT serves (``PREFT_LORA``, ``PREFT_REFT``, or plain ``LORA``, which is
served all-token as the baseline); the base is a decoder vLLM runs (Llama / Qwen2 / Mistral);
every adapter tensor belongs to a module the base has, with matching shapes (hidden size,
layer count, target modules); the rank is at most ``--max-rank``; all weights are finite.

Bundle layout (``preft_manifest.json`` says what the rest is):

- LoRA-P / LoRA: ``adapter_config.json`` (``peft_type: LORA``, so vLLM's LoRA loader accepts it)
  + ``adapter_model.safetensors`` (the PEFT weights, unchanged);
- ReFT-P: ``reft_weights.safetensors`` with, per edited layer ``i``, ``layers.i.proj``
  (``R`` with orthonormal rows for LoReFT, ``W2`` for DiReFT; rank x hidden), ``layers.i.source_weight``
  (``W``; rank x hidden) and ``layers.i.source_bias`` (``b``; rank).
"""

from __future__ import annotations

import json
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


class ExportError(ValueError):
    """The adapter cannot be served on this base; the message says why."""


def _read_json(path: Path, what: str) -> dict[str, Any]:
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
    config = _read_json(base_dir / "config.json", "base model config")
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
    bad = [k for k, v in tensors.items() if not torch.isfinite(v).all()]
    if bad:
        raise ExportError(f"adapter weights contain NaN or infinite values: {bad[:3]}{' ...' if len(bad) > 3 else ''}")


def _check_lora(tensors, config, base, max_rank) -> int:
    rank = int(config["r"])
    if rank > max_rank:
        raise ExportError(f"adapter rank r={rank} is over the server's max rank {max_rank}")
    if any(config.get(k) for k in ("rank_pattern", "alpha_pattern")):
        raise ExportError("rank_pattern / alpha_pattern are not supported for serving: use one r and lora_alpha")
    if not tensors:
        raise ExportError("adapter weights are empty")
    for key, tensor in tensors.items():
        match = _LORA_KEY.match(key)
        if match is None:
            raise ExportError(f"unexpected tensor {key!r}: PreFT serves LoRA on decoder-layer linear modules only")
        layer, block, module, side = int(match[1]), match[2], match[3], match[4]
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
    return rank


def _reft_tensors(tensors, config, base, max_rank) -> dict[str, torch.Tensor]:
    rank = int(config["rank"])
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


def export_adapter(adapter_dir: str | Path, base_dir: str | Path, output_dir: str | Path,
                   max_rank: int = 64) -> dict[str, Any]:
    """Check ``adapter_dir`` against ``base_dir`` and write a bundle to ``output_dir``.

    Returns the manifest. Nothing is written unless every check passes (the bundle is built
    in a temporary directory and moved into place).
    """
    adapter_dir, base_dir, output_dir = Path(adapter_dir), Path(base_dir), Path(output_dir)
    if not adapter_dir.is_dir():
        raise ExportError(f"adapter directory not found: {adapter_dir}")
    config = _read_json(adapter_dir / "adapter_config.json", "adapter config")
    peft_type = config.get("peft_type")
    if peft_type not in (PREFT_LORA, PREFT_REFT, "LORA"):
        raise ExportError(f"adapter peft_type {peft_type!r} is not servable (PREFT_LORA, PREFT_REFT or LORA)")
    base = base_fingerprint(base_dir)
    tensors = load_tensors(adapter_dir / "adapter_model.safetensors")
    check_finite(tensors)

    manifest: dict[str, Any] = {
        "format": BUNDLE_FORMAT,
        "source_peft_type": peft_type,
        "adapter_start": int(config.get("adapter_start", 0)),
        "prefill_only": bool(config.get("prefill_only", False)),
        "base": {k: v for k, v in base.items() if k != "shapes"},
    }
    staging = Path(tempfile.mkdtemp(prefix=".preft-export-", dir=output_dir.parent if output_dir.parent.exists() else None))
    try:
        if peft_type == PREFT_REFT:
            weights = _reft_tensors(tensors, config, base, max_rank)
            manifest.update(kind="reft", intervention=config["intervention"], rank=int(config["rank"]),
                            layers=sorted({int(k.split(".")[1]) for k in weights}))
            save_file(weights, str(staging / "reft_weights.safetensors"))
        else:
            rank = _check_lora(tensors, config, base, max_rank)
            manifest.update(kind="lora", rank=rank)
            lora_config = {k: v for k, v in config.items() if k not in ("adapter_start", "prefill_only")}
            lora_config["peft_type"] = "LORA"  # what vLLM's LoRA loader reads
            (staging / "adapter_config.json").write_text(json.dumps(lora_config, indent=2) + "\n")
            shutil.copyfile(adapter_dir / "adapter_model.safetensors", staging / "adapter_model.safetensors")
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if output_dir.exists():
            shutil.rmtree(output_dir)
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging), str(output_dir))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def has_manifest(bundle_dir: str | Path) -> bool:
    """Whether ``bundle_dir`` holds a PreFT manifest (a plain PEFT/vLLM LoRA directory does not)."""
    return (Path(bundle_dir) / MANIFEST).is_file()


def read_manifest(bundle_dir: str | Path) -> dict[str, Any]:
    """The manifest of an exported bundle (refuses a directory that is not one)."""
    manifest = _read_json(Path(bundle_dir) / MANIFEST, "PreFT bundle manifest")
    if manifest.get("format") != BUNDLE_FORMAT:
        raise ExportError(f"{bundle_dir}: unknown bundle format {manifest.get('format')!r} (expected {BUNDLE_FORMAT})")
    return manifest
