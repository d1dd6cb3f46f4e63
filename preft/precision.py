"""Where and in what precision a recipe trains: the machine decides unless the recipe says.

``precision`` (a recipe key) is one of:

- ``float32``: float32 weights and arithmetic;
- ``bf16``: the frozen base model's weights in bfloat16 and bf16 autocast (the trainer's
  ``bf16=True``); the adapter's weights stay float32 (PEFT keeps them so), and so do AdamW's
  states. On SmolLM2-135M on a 2-core CPU with AVX512-BF16, with the trainer's fast CPU step
  (:mod:`preft.trainers.cpu_step`), a step takes 1.69 s against float32's 3.85 s with TRL's own
  step, 2.41x (``preft bench sft-step --model smollm2-135m-instruct``, docs/RESULTS.md), with half
  the base model's memory;
- ``auto`` (default): ``bf16`` on a CUDA GPU that supports it or on a CPU with native bf16
  arithmetic (AVX512-BF16 or AMX-BF16), else ``float32``.

The device is the trainer's own choice (a GPU when there is one; ``use_cpu`` is set only where
there is none, as transformers needs for bf16 on a CPU); a recipe's ``trainer.use_cpu``,
``trainer.bf16`` or ``trainer.fp16`` wins over ``precision``, and so does a ``dtype`` in
``trainer.model_init_kwargs``. :func:`apply` prints one line saying what was chosen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CHOICES = ("auto", "float32", "bf16")


def cpu_has_native_bf16() -> bool:
    """True on an x86 CPU with AVX512-BF16 or AMX-BF16 (what oneDNN's bf16 matmuls run on)."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def resolve(precision: str, use_cpu: bool = False) -> tuple[str, str, str]:
    """``(precision, device, why)`` for ``precision`` on this machine."""
    if precision not in CHOICES:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(CHOICES)}")
    on_gpu = torch.cuda.is_available() and not use_cpu
    device = "cuda" if on_gpu else "cpu"
    if precision != "auto":
        return precision, device, "as the recipe says"
    if on_gpu:
        if torch.cuda.is_bf16_supported():
            return "bf16", device, "a GPU with bf16"
        return "float32", device, "a GPU without bf16"
    if cpu_has_native_bf16():
        return "bf16", device, "a CPU with native bf16 (AVX512-BF16 or AMX)"
    return "float32", device, "a CPU without native bf16"


def apply(precision: str, trainer: dict[str, Any], announce=print) -> dict[str, Any]:
    """The ``trainer`` section with ``precision`` applied (a new dict; the recipe's own
    ``bf16`` / ``fp16`` / ``model_init_kwargs.dtype`` kept as given)."""
    trainer = dict(trainer)
    user_set = [key for key in ("bf16", "fp16") if key in trainer]
    init = dict(trainer.get("model_init_kwargs") or {})
    chosen, device, why = resolve(precision, bool(trainer.get("use_cpu")))
    if not torch.cuda.is_available():
        trainer.setdefault("use_cpu", True)  # transformers refuses bf16 on a machine without a GPU otherwise
    if user_set or "dtype" in init:
        said = ", ".join(f"trainer.{k}={trainer[k]}" for k in user_set) or f"model_init_kwargs.dtype={init['dtype']}"
        announce(f"precision: as the recipe's {said} say, on {device}")
        return trainer
    trainer["bf16"] = chosen == "bf16"
    if chosen == "bf16":
        trainer["model_init_kwargs"] = {**init, "dtype": "bfloat16"}
        announce(f"precision: bf16 (bfloat16 base weights, bf16 autocast, float32 adapter) on {device}: {why}")
    else:
        announce(f"precision: float32 on {device}: {why}")
    return trainer
