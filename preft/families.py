"""The model families PreFT trains, exports and serves, and a small random-init model of each.

A family is a transformers ``model_type``. What differs between families, for PreFT:

- the decoder's linear modules (what a LoRA may target): Llama-style ``q/k/v/o_proj`` and
  ``gate/up/down_proj``, or Phi-3's packed ``qkv_proj`` and ``gate_up_proj``; the recipes'
  ``target_modules="all-linear"`` lets PEFT resolve them, and export checks them against the base;
- how vLLM runs it: a native class (``Qwen3ForCausalLM``, ``Gemma2ForCausalLM``, ...) or, for a
  family vLLM has no class for (OLMo 2 in vLLM 0.32), its Transformers backend, whose decoder
  layers are the transformers ones (the ReFT-P hooks tell the two apart:
  :func:`preft.serving.reft.layer_returns_stream`);
- the attention transformers must use to compute what vLLM computes (:attr:`Family.attn_implementation`).

The families listed in :data:`FAMILIES` are the ones the test suite trains, exports and serves
token-exact (``tests/test_families.py``, ``tests/serving/test_engine_families.py``);
:data:`preft.bundle.SUPPORTED_ARCHITECTURES` is read from here. :func:`tiny_model` builds the
tests' models: shapes small enough for CI, each family's peculiarities switched on (Qwen3's and
Gemma 3's q/k norms, Gemma's logit soft-capping, sliding windows shorter than the prompts,
embedding scaling and tied embeddings, OLMo 2's norms after attention and MLP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

@dataclass(frozen=True)
class Family:
    model_type: str
    #: settings of the tiny test model beyond the shared shape (see :func:`tiny_config`)
    tiny: tuple[tuple[str, object], ...] = ()
    #: the transformers attention that computes what vLLM computes, when the default does not
    #: (transformers' SDPA path drops Gemma 2's attention soft-capping: training and HF references
    #: would follow another model than the one served)
    attn_implementation: str | None = None

    def load_kwargs(self) -> dict:
        """``from_pretrained`` / ``from_config`` keywords that load the family as vLLM serves it."""
        return {"attn_implementation": self.attn_implementation} if self.attn_implementation else {}


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama"),
    Family("qwen2"),
    Family("qwen3"),
    Family("mistral", (("sliding_window", 16),)),
    Family("gemma2", (
        ("sliding_window", 16), ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
        ("query_pre_attn_scalar", 32)), attn_implementation="eager"),
    Family("gemma3_text", (
        ("sliding_window", 16), ("query_pre_attn_scalar", 32),
        ("layer_types", ["sliding_attention", "full_attention"] * 2))),
    Family("phi3"),
    Family("olmo2"),
)}


class UnsupportedFamily(ValueError):
    """A base model of a family PreFT does not serve."""


def family_of(model_type: str | None, where: str = "the base model") -> Family:
    """The :class:`Family` of ``model_type``, or one line naming the families PreFT serves."""
    family = FAMILIES.get(model_type or "")
    if family is None:
        raise UnsupportedFamily(f"{where} is a {model_type!r} model; PreFT serves {', '.join(FAMILIES)}")
    return family


def model_load_kwargs(model_dir) -> dict:
    """What ``from_pretrained`` needs to load ``model_dir`` as PreFT serves it: the family's
    :attr:`Family.attn_implementation`, if any (nothing for a family PreFT does not know)."""
    import json
    from pathlib import Path

    config = Path(model_dir) / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    family = FAMILIES.get(model_type or "")
    return family.load_kwargs() if family else {}


def tiny_config(model_type: str, vocab_size: int, bos_token_id: int = 0, eos_token_id: int = 1,
                pad_token_id: int = 2):
    """A 4-layer, 128-wide config of the family (4 query heads of 32, the smallest head vLLM's CPU
    attention takes; 2 KV heads), 512 positions."""
    from transformers import AutoConfig  # here: the bundle module reads FAMILIES in vLLM's processes

    family = family_of(model_type)
    return AutoConfig.for_model(
        model_type, vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        **dict(family.tiny))


def tiny_model(model_type: str, vocab_size: int, seed: int = 0, **token_ids):
    """A random-init float32 model of the family (:func:`tiny_config`), the same for the same seed.
    Random norm weights, so a norm left out anywhere shows in the tokens."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size, **token_ids), dtype=torch.float32,
                                             **family_of(model_type).load_kwargs())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()
