"""An independent reference for the rule, LoRA-P and ReFT-P: written from the formulas, importing
nothing from ``preft`` (nor its serving code), so a wrong rule in the project cannot move it.

The rule: for a row with prompt length ``P``, the adapter is active at absolute position ``p``
iff ``adapter_start <= p < P`` (every position when the adapter is not prefill-only).

- LoRA on a linear layer: ``y += (x A^T B^T) * alpha / r`` at the active positions
  (``* alpha / sqrt(r)`` with rsLoRA), by a forward hook on the base model's module.
- LoReFT on a decoder layer's output ``h``: ``h + R^T (W h + b - R h)``, ``R`` the orthonormal
  rows spanning the saved ``reft_proj`` rows (the Q of a QR factorization of its transpose, the
  convention the adapter was trained with); DiReFT: ``h + W2^T (W1 h + b)``.

Weights are read from the saved adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``). :func:`greedy` decodes one row at a time with no cache: each
step runs the whole sequence, prompt then generated tokens, with the adapter at the rule's
positions. That is what a KV cache computed under the rule holds, with nothing cached to get
wrong.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file


def read_adapter(adapter_dir) -> tuple[dict, dict[str, torch.Tensor]]:
    adapter_dir = Path(adapter_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    return config, load_file(str(adapter_dir / "adapter_model.safetensors"))


def _module_name(key: str, suffix: str) -> str:
    """``base_model.model.<module path>.<suffix>`` -> the module path in the bare HF model."""
    assert key.startswith("base_model.model.") and key.endswith(suffix), key
    return key[len("base_model.model."): -len(suffix)]


def active_positions(length: int, prompt_length: int, adapter_start: int, prefill_only: bool) -> torch.Tensor:
    """``[length]`` bool: where the adapter applies in a sequence of ``length`` tokens."""
    positions = torch.arange(length)
    if not prefill_only:
        return torch.ones(length, dtype=torch.bool)
    return (positions >= adapter_start) & (positions < prompt_length)


class Adapter:
    """Forward hooks that add one saved LoRA or ReFT adapter to a plain HF model, for one row at
    a time (batch size 1), at the positions :attr:`mask` says."""

    def __init__(self, model: torch.nn.Module, adapter_dir) -> None:
        self.config, self.tensors = read_adapter(adapter_dir)
        self.model, self.mask, self.handles = model, None, []
        modules = dict(model.named_modules())
        kind = self.config["peft_type"]
        if kind in ("LORA", "PREFT_LORA"):
            rank = self.config["r"]
            scale = self.config["lora_alpha"] / (math.sqrt(rank) if self.config.get("use_rslora") else rank)
            for key in self.tensors:
                if key.endswith(".lora_A.weight"):
                    name = _module_name(key, ".lora_A.weight")
                    a, b = self.tensors[key], self.tensors[key.replace("lora_A", "lora_B")]
                    self.handles.append(modules[name].register_forward_hook(self._lora_hook(a, b, scale)))
        elif kind == "PREFT_REFT":
            for key in self.tensors:
                if key.endswith(".reft_proj.weight"):
                    name = _module_name(key, ".reft_proj.weight")
                    proj = self.tensors[key]
                    w1, bias = self.tensors[f"base_model.model.{name}.reft_source.weight"], \
                        self.tensors[f"base_model.model.{name}.reft_source.bias"]
                    hook = self._loreft_hook(proj, w1, bias) if self.config["intervention"] == "loreft" \
                        else self._direft_hook(proj, w1, bias)
                    self.handles.append(modules[name].register_forward_hook(hook))
        else:
            raise ValueError(f"no reference for peft_type {kind}")
        assert self.handles, "the adapter names no module of the model"

    @property
    def adapter_start(self) -> int:
        return int(self.config.get("adapter_start", 0))

    @property
    def prefill_only(self) -> bool:
        return bool(self.config.get("prefill_only", False))

    def _where(self, shape) -> torch.Tensor:
        assert self.mask is not None and shape[0] == 1 and shape[1] == self.mask.numel(), (shape, self.mask)
        return self.mask.view(1, -1, 1)

    def _lora_hook(self, a, b, scale):
        def hook(module, inputs, output):
            x = inputs[0]
            delta = (x.float() @ a.float().t() @ b.float().t()) * scale
            return output + torch.where(self._where(output.shape), delta, torch.zeros_like(delta)).to(output.dtype)
        return hook

    def _edit_output(self, output, delta_of):
        hidden = output[0] if isinstance(output, tuple) else output
        h = hidden.float()
        edited = hidden + torch.where(self._where(hidden.shape), delta_of(h), torch.zeros_like(h)).to(hidden.dtype)
        return (edited, *output[1:]) if isinstance(output, tuple) else edited

    def _loreft_hook(self, proj, w1, bias):
        q, _ = torch.linalg.qr(proj.float().t())
        rotation = q.t()  # rank x hidden, orthonormal rows

        def hook(module, inputs, output):
            return self._edit_output(output, lambda h: (h @ w1.float().t() + bias.float() - h @ rotation.t())
                                     @ rotation)
        return hook

    def _direft_hook(self, proj, w1, bias):
        def hook(module, inputs, output):
            return self._edit_output(output, lambda h: (h @ w1.float().t() + bias.float()) @ proj.float())
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def greedy(model, adapter: Adapter | None, prompt_ids: list[int], new_tokens: int,
           prompt_length: int | None = None, never: tuple[int, ...] = ()) -> list[int]:
    """Greedy tokens for one row. ``prompt_length`` is ``P`` (default: the prompt's length; a
    request may end the adapter's span earlier, as ``preft_prompt_end`` does); ``never``: token
    ids never picked (EOS, as ``generate(min_new_tokens=...)`` does)."""
    tokens = list(prompt_ids)
    end = len(prompt_ids) if prompt_length is None else prompt_length
    for _ in range(new_tokens):
        if adapter is not None:
            adapter.mask = active_positions(len(tokens), end, adapter.adapter_start, adapter.prefill_only)
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1].float()
        logits[list(never)] = -math.inf
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt_ids):]


def greedy_each(model, adapter_dirs: dict, cases: list[tuple], new_tokens: int,
                never: tuple[int, ...] = ()) -> list[list[int]]:
    """:func:`greedy` for each ``(adapter name or None, prompt ids)`` case, ``adapter_dirs[name]``
    the saved adapter; one adapter's hooks are on ``model`` at a time, removed afterwards."""
    answers: list = [None] * len(cases)
    for name in dict.fromkeys(case[0] for case in cases):
        hooks = Adapter(model, adapter_dirs[name]) if name is not None else None
        try:
            for index, (case_name, ids) in enumerate(cases):
                if case_name == name:
                    answers[index] = greedy(model, hooks, ids, new_tokens, never=never)
        finally:
            if hooks is not None:
                hooks.remove()
    return answers
