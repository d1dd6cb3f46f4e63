"""Each model family's small random-init model, saved as real checkpoints are laid out.

:func:`family_dir` builds :func:`preft.families.tiny_model` of a family with the project's
tokenizer and saves it once per session the way checkpoints on a hub look:

- bfloat16 weights in several safetensors shards with ``model.safetensors.index.json``;
- ``generation_config.json``;
- the chat template inside ``tokenizer_config.json`` (no ``chat_template.jinja``);
- no ``tokenizer_class``, so the tokenizer's class follows ``model_type`` as in a hub directory
  (a Qwen2 or Qwen3 directory loads a Qwen2 tokenizer, which splits digits one by one), where that
  class can read the project's vocabulary (Gemma's tokenizer class needs an ``<unk>`` token the
  project's tokenizer lacks: those directories keep ``tokenizer_class``); references are computed
  with :func:`load_family_tokenizer`, the tokenizer the server loads.

:func:`load_family_model` loads it in float32 (the references; bf16 weights are exact in float32).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import preft
from preft.families import FAMILIES, model_load_kwargs, tiny_model

FAMILY_NAMES = list(FAMILIES)
#: the families whose engine parity test runs in ``make test``: Llama (the default base model's
#: family) and Phi-3 (packed ``qkv_proj`` / ``gate_up_proj``, the one family whose LoRA layers vLLM
#: slices). The rest carry the ``families`` marker and run in ``make test-families``.
IN_MAKE_TEST = ("llama", "phi3")
_ROOT: Path | None = None


def family_params(in_make_test=IN_MAKE_TEST) -> list:
    """Every family as a pytest parameter, those outside ``in_make_test`` marked ``families``."""
    import pytest

    return [name if name in in_make_test else pytest.param(name, marks=pytest.mark.families)
            for name in FAMILY_NAMES]


def family_dir(model_type: str) -> str:
    """The session's checkpoint directory of ``model_type``'s tiny model (built on first use)."""
    global _ROOT
    if _ROOT is None:
        _ROOT = Path(tempfile.mkdtemp(prefix="preft-families-"))
    out = _ROOT / model_type
    if (out / "config.json").is_file():
        return str(out)
    tokenizer = AutoTokenizer.from_pretrained(preft.DEFAULT_BASE_MODEL)
    model = tiny_model(model_type, len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="300KB")
    tokenizer.save_pretrained(out)
    template = (out / "chat_template.jinja").read_text()
    (out / "chat_template.jinja").unlink()
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    as_saved = dict(config)
    config.pop("tokenizer_class", None)
    config_path.write_text(json.dumps(config, indent=2))
    try:
        AutoTokenizer.from_pretrained(out)("12 ab")
    except Exception:  # noqa: BLE001 - the family's class cannot read this vocabulary
        config_path.write_text(json.dumps(as_saved, indent=2))
    assert (out / "model.safetensors.index.json").is_file() and (out / "generation_config.json").is_file()
    return str(out)


def load_family_model(path: str):
    """The family's model in float32, loaded as PreFT's trainers load it."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **model_load_kwargs(path)).eval()


def load_family_tokenizer(path: str):
    return AutoTokenizer.from_pretrained(path)
