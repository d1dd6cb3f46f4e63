"""ReFT-P in the vLLM engine: batched interventions on the residual stream, prompt tokens only.

A request uses a ReFT-P bundle through ``SamplingParams.extra_args = {"preft_reft": BUNDLE}``
(``preft serve`` sets it from the request's ``model``). Per engine step (worker process):

1. :func:`build_step` (after vLLM's ``_prepare_inputs``) gives every scheduled token the slot
   of its request's bundle in :class:`ReftBank` if its absolute position is in
   ``[adapter_start, P)``, else -1, and turns that into a
   :class:`~preft.serving.lora_ops.TilePlan` (rows tiled by slot, the layout the LoRA ops
   use). A decode-only step has no such token and no plan.
2. A forward hook on every decoder layer applies, to the plan's rows only, one batched update:
   ``h' = h + P_s^T (W_s h + b_s - k_s P_s h)`` with ``h`` the layer's output residual stream
   (vLLM returns it as ``hidden + residual``), ``P_s`` = R (LoReFT, ``k_s = 1``) or W2 (DiReFT,
   ``k_s = 0``). Weights of all bundles are stacked per layer and gathered per tile of rows:
   no Python loop over adapters in the hot path. Bundles of other ranks are zero-padded; a
   bundle that does not edit a layer has zero weights there.

Prefix caching: the plugin keys a ReFT-P request's KV blocks past its ``adapter_start`` by the
bundle (blocks before it are base-model KV and shared), so no cache salt is needed.

The step context is a module global, set and read in the same worker process (nano-vllm's
explicit context object).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from preft.export import read_manifest
from preft.serving.lora_ops import TilePlan, build_tile_plan

EXTRA_ARG = "preft_reft"


@functools.lru_cache(maxsize=4096)
def reft_adapter_start(bundle: str) -> int:
    """First position a ReFT-P bundle edits (0 for an all-token bundle)."""
    manifest = read_manifest(bundle)
    return int(manifest["adapter_start"]) if manifest["prefill_only"] else 0


STEP: TilePlan | None = None  # the current step's ReFT rows; None: no ReFT work this step


class ReftBank:
    """Stacked weights of every ReFT-P bundle this worker has seen, one slot per bundle."""

    def __init__(self, num_layers: int, hidden_size: int, device: torch.device) -> None:
        self.num_layers, self.hidden_size, self.device = num_layers, hidden_size, device
        self.slot_of: dict[str, int] = {}
        self.adapter_start: list[int] = []
        self.bundles: list[dict] = []
        # per layer: [slots, 2r, d] = [W_s; P_s] (one matmul gives W h and P h), [slots, r] b_s
        self.source_and_proj = self.source_bias = self.rh_sign = None

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
        self.rank = rank
        self.source_and_proj = torch.cat([source_weight, proj], dim=2).to(self.device)
        self.source_bias, self.rh_sign = source_bias.to(self.device), rh_sign.to(self.device)

    def apply(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor, plan: TilePlan) -> torch.Tensor:
        """``hidden`` with the ReFT edit of ``plan``'s rows added (``hidden + residual`` is the stream)."""
        rows = plan.num_rows
        stream = (hidden[:rows] + residual[:rows]).float()                              # [rows, d]
        r, weights, bias = self.rank, self.source_and_proj[layer], self.source_bias[layer]
        if plan.single_slot is not None:  # plain matmuls over every row, masked (the rank is small)
            slot = plan.single_slot
            both = stream @ weights[slot].t()                                            # [rows, 2r]
            edit = both[:, :r] + bias[slot] - self.rh_sign[slot] * both[:, r:]
            if plan.row_mask is not None:
                edit = edit * plan.row_mask
            delta = edit @ weights[slot, r:]                                             # [rows, d]
        else:
            tiles = stream.index_select(0, plan.gather).view(-1, plan.tile_rows, stream.shape[-1])
            tile_weights = weights.index_select(0, plan.tile_slots)                     # [tiles, 2r, d]
            both = torch.bmm(tiles, tile_weights.transpose(1, 2))                        # [tiles, T, 2r]
            sign = self.rh_sign.index_select(0, plan.tile_slots)[:, None, None]
            edit = both[..., :r] + bias.index_select(0, plan.tile_slots)[:, None, :] - sign * both[..., r:]
            delta = torch.bmm(edit * plan.tile_mask, tile_weights[:, r:])               # [tiles, T, d]
            delta = delta.view(-1, stream.shape[-1]).index_select(0, plan.untile)
        hidden[:rows] += delta.to(hidden.dtype)  # in place: a fresh activation, inference only
        return hidden


BANK: ReftBank | None = None


def _request_slot(state) -> tuple[int, int]:
    """``(slot, adapter_start)`` of a request's ReFT bundle, ``(-1, 0)`` without one; cached on
    vLLM's per-request state, which lives as long as the request."""
    cached = getattr(state, "preft_reft_slot", None)
    if cached is None:
        params = state.sampling_params
        bundle = (params.extra_args or {}).get(EXTRA_ARG) if params is not None else None
        if bundle:
            slot = BANK.slot(bundle)
            cached = (slot, BANK.adapter_start[slot])
        else:
            cached = (-1, 0)
        state.preft_reft_slot = cached
    return cached


def build_step(runner, num_scheduled_tokens: np.ndarray) -> None:
    """Set :data:`STEP` for the step vLLM just prepared (``runner`` is its model runner)."""
    global STEP
    STEP = None
    if BANK is None:
        return
    batch = runner.input_batch
    n = batch.num_reqs
    found = [_request_slot(runner.requests[req_id]) for req_id in batch.req_ids[:n]]
    slots = np.array([slot for slot, _ in found], dtype=np.int64)
    if n == 0 or (slots < 0).all():
        return
    start = np.array([start for _, start in found], dtype=np.int64)
    scheduled = np.asarray(num_scheduled_tokens[:n], dtype=np.int64)
    request = np.repeat(np.arange(n), scheduled)
    first = np.cumsum(scheduled) - scheduled
    position = batch.num_computed_tokens_cpu[:n].astype(np.int64)[request] + np.arange(request.size) - first[request]
    in_prompt = (position >= start[request]) & (position < batch.num_prompt_tokens[:n].astype(np.int64)[request])
    active = (slots[request] >= 0) & ((start[request] < 0) | in_prompt)  # start -1: an all-token bundle
    if active.any():
        STEP = build_tile_plan(torch.from_numpy(np.where(active, slots[request], -1)).to(BANK.device))


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
            plan = STEP
            if plan is None or not isinstance(output, tuple) or output[1] is None:
                return output
            hidden, residual = output
            return BANK.apply(layer_index, hidden, residual, plan), residual

        layer.register_forward_hook(hook)
