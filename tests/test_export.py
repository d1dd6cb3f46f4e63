"""`preft export`: bundles for LoRA-P, ReFT-P and plain LoRA (its refusals of bad input:
``tests/reliability/test_hostile_cli.py``)."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file

from conftest import ADAPTER_CONFIGS
from preft.cli import main as cli_main
from preft.bundle import read_manifest
from preft.export import export_adapter


def test_export_lora_p_bundle_loads_as_plain_lora(saved_adapter, base_path, tmp_path):
    adapter = saved_adapter(ADAPTER_CONFIGS["lora_p"](adapter_start=2))
    manifest = export_adapter(adapter, base_path, tmp_path / "bundle")
    assert manifest["kind"] == "lora" and manifest["prefill_only"] and manifest["adapter_start"] == 2
    assert manifest["rank"] == 8 and manifest["base"]["num_hidden_layers"] == 4
    config = json.loads((tmp_path / "bundle" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and "adapter_start" not in config
    assert read_manifest(tmp_path / "bundle") == manifest
    # vLLM's own PEFT config check accepts the bundle
    from vllm.lora.peft_helper import PEFTHelper

    assert PEFTHelper.from_local_dir(str(tmp_path / "bundle"), max_position_embeddings=512).r == 8


@pytest.mark.parametrize("kind", ["loreft_p", "direft_p"])
def test_export_reft_bundle_holds_the_formula_weights(saved_adapter, base_path, tmp_path, kind):
    adapter = saved_adapter(ADAPTER_CONFIGS[kind]())
    manifest = export_adapter(adapter, base_path, tmp_path / "bundle")
    assert manifest["kind"] == "reft" and manifest["prefill_only"]
    weights = load_file(str(tmp_path / "bundle" / "reft_weights.safetensors"))
    layers = manifest["layers"]
    assert sorted(weights) == sorted(f"layers.{i}.{p}" for i in layers for p in ("proj", "source_weight", "source_bias"))
    proj = weights[f"layers.{layers[0]}.proj"]
    if manifest["intervention"] == "loreft":  # R is exported with orthonormal rows
        assert torch.allclose(proj @ proj.T, torch.eye(proj.shape[0]), atol=1e-5)


def test_plain_lora_is_exported_all_token(saved_adapter, base_path, tmp_path, capsys):
    adapter = saved_adapter(LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    assert cli_main(["export", str(adapter), "--base", "default", "-o", str(tmp_path / "b")]) == 0
    assert "prefill_only=False" in capsys.readouterr().out
    assert read_manifest(tmp_path / "b")["prefill_only"] is False


def test_exporting_a_bundle_again_keeps_its_rule(saved_adapter, base_path, tmp_path):
    adapter = saved_adapter(ADAPTER_CONFIGS["lora_p"](adapter_start=3))
    first = export_adapter(adapter, base_path, tmp_path / "b1")
    again = export_adapter(tmp_path / "b1", base_path, tmp_path / "b2")
    assert (again["prefill_only"], again["adapter_start"]) == (first["prefill_only"], first["adapter_start"]) == (True, 3)
