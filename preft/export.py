"""Export: check a PEFT-format adapter against its base model and write a serving bundle.

    preft export ADAPTER_DIR --base BASE_DIR -o BUNDLE_DIR [--max-rank 64]

Checks (each refusal names the problem): the adapter directory and its files exist and parse;
the PEFT type is one PreFT serves (``PREFT_LORA``, ``PREFT_REFT``, or plain ``LORA``, which is
served all-token as the baseline); every config field it reads has the right type and range
(``r``, ``lora_alpha``, ``rank``, ``intervention``, ``adapter_start``, ``prefill_only``); the base
is a decoder vLLM runs (Llama / Qwen2 / Mistral); every adapter tensor belongs to a module the
base has, with matching shapes (hidden size, layer count, target modules), and the tensor set is
complete (every LoRA A has its B, every ReFT layer its three tensors); the rank is at most
``--max-rank``; all weights are finite and of sane magnitude (at most :data:`preft.bundle.MAX_ABS_WEIGHT`).

Output: the bundle is built in a temporary directory beside ``-o`` and renamed into place. An
existing ``-o`` is refused unless ``overwrite=True`` (``--overwrite``), and even then only if it
is a PreFT bundle that does not hold the adapter being exported. Exporting a bundle again (its
``adapter_config.json`` is plain LoRA) keeps the rule its manifest records.

The bundle's layout, its manifest and the weight checks live in :mod:`preft.bundle`; this
module is the writer: it reads the PEFT adapter, converts ReFT-P's PEFT tensors to the bundle's
(LoReFT's ``R`` orthonormalized once here), checks them there and writes the bundle.
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
from safetensors.torch import save_file

from preft.bundle import (BUNDLE_FORMAT, MANIFEST, ExportError, base_fingerprint, check_finite, check_lora,
                          check_reft, config_field, has_manifest, load_tensors, read_json, read_manifest)
from preft.tuners import PREFT_LORA, PREFT_REFT

__all__ = ["ExportError", "export_adapter", "read_manifest", "BUNDLE_FORMAT", "MANIFEST"]

#: ReFT-P's PEFT tensor names -> the bundle's (:data:`preft.bundle.REFT_PARTS`)
_REFT_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.reft_(source|proj)\.(weight|bias)$")
_REFT_PART = {("source", "weight"): "source_weight", ("source", "bias"): "source_bias", ("proj", "weight"): "proj"}


def reft_bundle_tensors(tensors: dict[str, torch.Tensor], config: dict, base: dict, max_rank: int
                        ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A ReFT-P adapter's PEFT tensors as the bundle's, checked (:func:`preft.bundle.check_reft`):
    ``(tensors, manifest fields)``; LoReFT's ``R`` is stored with orthonormal rows."""
    from preft.tuners.reft_p.layer import orthonormal_rows

    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        match = _REFT_KEY.match(key)
        if match is None or (match[2], match[3]) not in _REFT_PART:
            raise ExportError(f"unexpected tensor {key!r} in a ReFT adapter")
        out[f"layers.{int(match[1])}.{_REFT_PART[match[2], match[3]]}"] = tensor.float()
    fields = {"intervention": config.get("intervention"), "layers": sorted({int(key.split(".")[1]) for key in out})}
    if "rank" in config:  # (absent: check_reft names it)
        fields["rank"] = config["rank"]
    check_reft(fields, out, base, max_rank)
    if fields["intervention"] == "loreft":
        out.update({key: orthonormal_rows(value) for key, value in out.items() if key.endswith(".proj")})
    return out, fields


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
        return manifest.get("prefill_only", False), manifest.get("adapter_start", 0)  # checked by read_manifest
    return (config_field(config, "prefill_only", "bool", default=False),
            config_field(config, "adapter_start", "start", default=0))


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
            weights, fields = reft_bundle_tensors(tensors, config, base, max_rank)
            manifest.update(kind="reft", **fields)
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

