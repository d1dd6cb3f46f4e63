"""ReFT-P in the vLLM engine: batched interventions on the residual stream, prompt tokens only.

A request uses a ReFT-P bundle through ``SamplingParams.extra_args = {"preft_reft": BUNDLE}``
(``preft serve`` sets it from the request's ``model``). Per engine step (worker process):

1. :func:`build_step` (after vLLM's ``_prepare_inputs``) lists the scheduled tokens whose
   request uses a ReFT bundle and whose absolute position is in ``[adapter_start, P)``, with
   the bundle's slot in :class:`ReftBank`. A decode-only step lists none.
2. A forward hook on every decoder layer applies, to those rows only, one batched update:
   ``h' = h + P_s^T (W_s h + b_s - k_s P_s h)`` with ``h`` the layer's output residual stream
   (vLLM returns it as ``hidden + residual``), ``P_s`` = R (LoReFT, ``k_s = 1``) or W2 (DiReFT,
   ``k_s = 0``). Weights of all bundles are stacked per layer and gathered by slot: no Python
   loop over adapters in the hot path. Bundles of other ranks are zero-padded; a bundle that
   does not edit a layer has zero weights there.

Prefix caching: the plugin keys a ReFT-P request's KV blocks past its ``adapter_start`` by the
bundle (blocks before it are base-model KV and shared), so no cache salt is needed.

The step context is a module global, set and read in the same worker process (nano-vllm's
explicit context object).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from preft.export import read_manifest

EXTRA_ARG = "preft_reft"


@functools.lru_cache(maxsize=4096)
def reft_adapter_start(bundle: str) -> int:
    """First position a ReFT-P bundle edits (0 for an all-token bundle)."""
    manifest = read_manifest(bundle)
    return int(manifest["adapter_start"]) if manifest["prefill_only"] else 0


@dataclass
class ReftStep:
    rows: torch.Tensor   # [n] indices into the step's flattened tokens
    slots: torch.Tensor  # [n] ReftBank slot of each row
    single_slot: int | None = None  # set when every row uses one bundle: plain matmuls, no gather


STEP: ReftStep | None = None


class ReftBank:
    """Stacked weights of every ReFT-P bundle this worker has seen, one slot per bundle."""

    def __init__(self, num_layers: int, hidden_size: int, device: torch.device) -> None:
        self.num_layers, self.hidden_size, self.device = num_layers, hidden_size, device
        self.slot_of: dict[str, int] = {}
        self.adapter_start: list[int] = []
        self.bundles: list[dict] = []
        self.proj = self.source_weight = self.source_bias = self.rh_sign = None

    def slot(self, bundle: str) -> int:
        if bundle not in self.slot_of:
            manifest = read_manifest(bundle)
            if manifest.get("kind") != "reft":
                raise ValueError(f"{bundle} is a {manifest.get('kind')} bundle, not ReFT-P")
            weights = load_file(f"{bundle}/reft_weights.safetensors")
            self.bundles.append({"manifest": manifest, "weights": weights})
            self.adapter_start.append(int(manifest["adapter_start"]) if manifest["prefill_only"] else -1)
            self.slot_of[bundle] = len(self.bundles) - 1
            self._restack()
        return self.slot_of[bundle]

    def _restack(self) -> None:
        slots, rank = len(self.bundles), max(b["manifest"]["rank"] for b in self.bundles)
        shape = (self.num_layers, slots, rank, self.hidden_size)
        proj, source_weight = torch.zeros(shape), torch.zeros(shape)
        source_bias = torch.zeros(self.num_layers, slots, rank)
        rh_sign = torch.zeros(slots)
        for slot, bundle in enumerate(self.bundles):
            manifest, weights, r = bundle["manifest"], bundle["weights"], bundle["manifest"]["rank"]
            rh_sign[slot] = 1.0 if manifest["intervention"] == "loreft" else 0.0
            for layer in manifest["layers"]:
                proj[layer, slot, :r] = weights[f"layers.{layer}.proj"]
                source_weight[layer, slot, :r] = weights[f"layers.{layer}.source_weight"]
                source_bias[layer, slot, :r] = weights[f"layers.{layer}.source_bias"]
        to = dict(device=self.device)
        self.proj, self.source_weight = proj.to(**to), source_weight.to(**to)
        self.source_bias, self.rh_sign = source_bias.to(**to), rh_sign.to(**to)

    def apply(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor, step: ReftStep) -> torch.Tensor:
        """``hidden`` with the ReFT edit of ``step``'s rows added (``hidden + residual`` is the stream)."""
        rows, slots = step.rows, step.slots
        h = (hidden.index_select(0, rows) + residual.index_select(0, rows)).float()   # [n, d]
        if step.single_slot is not None:
            slot = step.single_slot
            proj = self.proj[layer, slot]                                              # [r, d]
            edit = h @ self.source_weight[layer, slot].t() + self.source_bias[layer, slot]
            edit = edit - self.rh_sign[slot] * (h @ proj.t())
            return hidden.index_add(0, rows, (edit @ proj).to(hidden.dtype))
        proj = self.proj[layer].index_select(0, slots)                                 # [n, r, d]
        source = torch.bmm(self.source_weight[layer].index_select(0, slots), h[:, :, None]).squeeze(-1)
        source = source + self.source_bias[layer].index_select(0, slots)               # W h + b
        projected = torch.bmm(proj, h[:, :, None]).squeeze(-1)                          # R h
        edit = source - self.rh_sign.index_select(0, slots)[:, None] * projected
        delta = torch.bmm(proj.transpose(1, 2), edit[:, :, None]).squeeze(-1)           # R^T (...)
        return hidden.index_add(0, rows, delta.to(hidden.dtype))


BANK: ReftBank | None = None


def build_step(runner, num_scheduled_tokens: np.ndarray) -> None:
    """Set :data:`STEP` for the step vLLM just prepared (``runner`` is its model runner)."""
    global STEP
    STEP = None
    if BANK is None:
        return
    batch = runner.input_batch
    rows, slots = [], []
    offset = 0
    for index, req_id in enumerate(batch.req_ids[: batch.num_reqs]):
        count = int(num_scheduled_tokens[index])
        params = runner.requests[req_id].sampling_params
        bundle = (params.extra_args or {}).get(EXTRA_ARG) if params is not None else None
        if bundle:
            slot = BANK.slot(bundle)
            start = BANK.adapter_start[slot]
            first = int(batch.num_computed_tokens_cpu[index])
            positions = np.arange(first, first + count)
            if start < 0:  # an all-token bundle
                active = np.ones(count, dtype=bool)
            else:
                active = (positions >= start) & (positions < int(batch.num_prompt_tokens[index]))
            picked = offset + np.nonzero(active)[0]
            rows.extend(picked.tolist())
            slots.extend([slot] * len(picked))
        offset += count
    if rows:
        device = BANK.device
        single = slots[0] if len(set(slots)) == 1 else None
        STEP = ReftStep(torch.tensor(rows, device=device), torch.tensor(slots, device=device), single)


def install_hooks(model: nn.Module, config) -> None:
    """Hook every decoder layer of a loaded vLLM model (once per worker)."""
    global BANK
    layers = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers":
            layers = module
            break
    if layers is None:
        return
    device = next(model.parameters()).device
    BANK = ReftBank(len(layers), config.hidden_size, device)

    for index, layer in enumerate(layers):
        def hook(module, inputs, output, layer_index=index):
            step = STEP
            if step is None or not isinstance(output, tuple) or output[1] is None:
                return output
            hidden, residual = output
            return BANK.apply(layer_index, hidden, residual, step), residual

        layer.register_forward_hook(hook)
