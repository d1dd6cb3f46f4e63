"""`preft export`: bundles for LoRA-P, ReFT-P and plain LoRA, and every refusal."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from conftest import ADAPTER_CONFIGS, load_base
from preft.cli import main as cli_main
from preft.export import ExportError, export_adapter, read_manifest


@pytest.fixture
def saved_adapter(tmp_path, base_path):
    def save(config, name="adapter"):
        torch.manual_seed(0)
        model = get_peft_model(load_base(base_path), config)
        model.save_pretrained(tmp_path / name)
        return tmp_path / name

    return save


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


def test_export_refusals(saved_adapter, base_path, tmp_path, tokenizer):
    adapter = saved_adapter(ADAPTER_CONFIGS["lora_p"]())
    out = tmp_path / "bundle"

    with pytest.raises(ExportError, match="adapter directory not found"):
        export_adapter(tmp_path / "missing", base_path, out)
    with pytest.raises(ExportError, match="over the server's max rank 4"):
        export_adapter(adapter, base_path, out, max_rank=4)

    # wrong base: a Qwen2 with another hidden size
    from transformers import Qwen2Config, Qwen2ForCausalLM

    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
                     ).save_pretrained(tmp_path / "other_base")
    with pytest.raises(ExportError, match="wrong base model"):
        export_adapter(adapter, tmp_path / "other_base", out)

    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    first = sorted(tensors)[0]
    save_file({**tensors, first: torch.full_like(tensors[first], float("nan"))}, str(weights))
    with pytest.raises(ExportError, match="NaN or infinite"):
        export_adapter(adapter, base_path, out)

    weights.write_bytes(b"not a safetensors file")
    with pytest.raises(ExportError, match="corrupt or unreadable"):
        export_adapter(adapter, base_path, out)
    weights.unlink()
    with pytest.raises(ExportError, match="adapter weights not found"):
        export_adapter(adapter, base_path, out)

    (adapter / "adapter_config.json").write_text("{ not json")
    with pytest.raises(ExportError, match="adapter config is not valid JSON"):
        export_adapter(adapter, base_path, out)
    assert not out.exists()  # nothing half-written


def test_cli_export_error_is_one_line(tmp_path, capsys):
    assert cli_main(["export", str(tmp_path / "nope"), "--base", "default", "-o", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "adapter directory not found" in err


def test_export_never_destroys_what_it_did_not_create(saved_adapter, base_path, tmp_path, capsys):
    adapter = saved_adapter(ADAPTER_CONFIGS["lora_p"](adapter_start=1))
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists"):
        export_adapter(adapter, base_path, precious)
    with pytest.raises(ExportError, match="not a PreFT bundle"):
        export_adapter(adapter, base_path, precious, overwrite=True)
    with pytest.raises(ExportError, match="holds the adapter being exported"):  # -o above the source
        export_adapter(adapter, base_path, tmp_path, overwrite=True)
    (tmp_path / "a_file").write_text("x")
    assert cli_main(["export", str(adapter), "--base", "default", "-o", str(tmp_path / "a_file")]) == 2
    assert "is an existing file" in capsys.readouterr().err
    assert (precious / "notes.txt").read_text() == "mine" and (tmp_path / "a_file").read_text() == "x"
    assert (adapter / "adapter_model.safetensors").is_file()
    # an existing bundle is replaced with --overwrite, and only then; no temporary directory is left
    export_adapter(adapter, base_path, tmp_path / "bundle")
    with pytest.raises(ExportError, match="already exists"):
        export_adapter(adapter, base_path, tmp_path / "bundle")
    assert cli_main(["export", str(adapter), "--base", "default", "-o", str(tmp_path / "bundle"), "--overwrite"]) == 0
    assert not [p for p in tmp_path.iterdir() if "preft-" in p.name]


def test_exporting_a_bundle_again_keeps_its_rule(saved_adapter, base_path, tmp_path):
    adapter = saved_adapter(ADAPTER_CONFIGS["lora_p"](adapter_start=3))
    first = export_adapter(adapter, base_path, tmp_path / "b1")
    again = export_adapter(tmp_path / "b1", base_path, tmp_path / "b2")
    assert (again["prefill_only"], again["adapter_start"]) == (first["prefill_only"], first["adapter_start"]) == (True, 3)


@pytest.mark.parametrize("edit, message", [
    (lambda c, t: c.pop("r"), "has no 'r'"),
    (lambda c, t: c.update(r="8"), "r must be an integer >= 1"),
    (lambda c, t: c.update(adapter_start=-5), "adapter_start must be an integer >= 0"),
    (lambda c, t: c.update(prefill_only="false"), "prefill_only must be true or false"),
    (lambda c, t: c.update(lora_alpha=1e30), "lora_alpha / r"),
    (lambda c, t: [t.pop(k) for k in [k for k in t if "lora_B" in k]], "lack lora_A or lora_B"),
    (lambda c, t: t.update({k: v * 1e6 for k, v in t.items()}), "magnitude"),
])
def test_hand_edited_lora_configs_are_refused_with_the_field_named(saved_adapter, base_path, tmp_path, edit, message):
    adapter = saved_adapter(ADAPTER_CONFIGS["lora_p"]())
    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    edit(config, tensors)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(ExportError, match=message):
        export_adapter(adapter, base_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("intervention"), "intervention must be 'loreft' or 'direft'"),
    (lambda c: c.pop("rank"), "has no 'rank'"),
])
def test_hand_edited_reft_configs_are_refused(saved_adapter, base_path, tmp_path, edit, message):
    adapter = saved_adapter(ADAPTER_CONFIGS["loreft_p"]())
    config = json.loads((adapter / "adapter_config.json").read_text())
    edit(config)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=message):
        export_adapter(adapter, base_path, tmp_path / "out")


def test_a_config_that_is_not_an_object_is_refused(saved_adapter, base_path, tmp_path):
    adapter = saved_adapter(ADAPTER_CONFIGS["lora_p"]())
    (adapter / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(ExportError, match="must be a JSON object"):
        export_adapter(adapter, base_path, tmp_path / "out")
