"""ReFT-P in the vLLM engine: batched interventions on the residual stream, prompt tokens only.

A request uses a ReFT-P bundle through ``SamplingParams.extra_args = {"preft_reft": BUNDLE}``
(:data:`preft.constants.REFT_EXTRA_ARG`; ``preft serve`` sets it from the request's ``model``).
Per engine step (worker process):

1. :func:`build_reft_plan` (called when the model runner has prepared the step) marks every
   scheduled token whose position the bundle's rule makes active (:mod:`preft.rule`), gives
   those tokens their bundle's slot in the :class:`ReftBank` (others -1) and turns that into a
   :class:`~preft.serving.tile_plan.TilePlan`, stored in the step context. A decode-only step
   of prefill-only requests has no such token and no plan.
2. A forward hook on every decoder layer applies, to the plan's rows only, one batched update:
   ``h' = h + P_s^T (W_s h + b_s - k_s P_s h)`` with ``h`` the layer's output residual stream
   (vLLM returns it as ``hidden + residual``), ``P_s`` = R (LoReFT, ``k_s = 1``) or W2 (DiReFT,
   ``k_s = 0``). Weights of the resident bundles are stacked per layer and gathered per tile
   of rows: no Python loop over adapters in the hot path. Bundles of lower rank are
   zero-padded; a bundle that does not edit a layer has zero weights there.

Prefix caching: the engine core keys a ReFT-P request's KV blocks from its ``adapter_start``
on by the bundle (:mod:`preft.serving.engine_core`); blocks before it are base-model KV.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from preft import envs
from preft.constants import REFT_EXTRA_ARG
from preft.bundle import check_finite, read_manifest
from preft.bundle import bundle_rule
from preft.rule import active_scheduled_tokens
from preft.serving import adapter_cache_stats
from preft.serving.bundle_store import NOT_SERVED, intact_store_copy, is_store_copy
from preft.serving.tile_plan import TilePlan, build_tile_plan

logger = logging.getLogger(__name__)
DEFAULT_SLOTS = 8


def reft_bundle_of(sampling_params) -> str | None:
    """The ReFT-P bundle a request names in its ``extra_args``, or None."""
    if sampling_params is None:
        return None
    return (sampling_params.extra_args or {}).get(REFT_EXTRA_ARG) or None


def reft_slots(lora_config) -> int:
    """How many ReFT-P bundles an engine holds at once: ``PREFT_REFT_SLOTS``, else the engine's
    ``max_loras`` (``--max-adapters`` of ``preft serve``), else 8. The scheduler admits at most
    this many distinct bundles' prompt tokens per step; the bank has this many slots."""
    configured = envs.PREFT_REFT_SLOTS
    if configured is not None:
        if configured < 1:
            raise ValueError(f"PREFT_REFT_SLOTS must be >= 1, got {configured}")
        return configured
    return lora_config.max_loras if lora_config is not None else DEFAULT_SLOTS


class ReftBank:
    """Stacked weights of the resident ReFT-P bundles, one slot per bundle, ``capacity`` slots.

    Per layer ``source_and_proj`` is ``[slots, 2r, d]`` = ``[W_s; P_s]`` (one matmul gives
    ``W h`` and ``P h``) and ``source_bias`` ``[slots, r]``, with ``r`` the largest rank
    resident. A bundle is written into its slot when a step first needs it (one slot's
    weights, not a re-stack of the bank); when every slot is taken, the least recently used
    bundle that the current step does not use gives up its slot. A step never needs more than
    ``capacity`` bundles when the engine runs :class:`~preft.serving.scheduler.PreftScheduler`;
    without it, such a step grows the bank (logged once).

    Host memory: the weights of up to ``host_capacity`` bundles (``--max-host-adapters``, like
    vLLM's LoRA host cache; least recently used out) are kept once read and checked, so a
    bundle that comes back into a slot (1,024 users on 8 slots: every prefill step) is not read
    and checked from its store copy again.
    """

    def __init__(self, num_layers: int, hidden_size: int, device: torch.device, capacity: int,
                 host_capacity: int | None = None) -> None:
        self.num_layers, self.hidden_size, self.device = num_layers, hidden_size, device
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # resident bundle -> slot, least recent first
        # bundle -> (manifest, checked weights in RAM), least recent first
        self.host: OrderedDict[str, tuple[dict, dict[str, torch.Tensor]]] = OrderedDict()
        self.host_capacity = max(host_capacity or capacity, capacity)
        self.rank = 0
        self.loads = 0  # bundles written into slots so far (eviction makes it exceed the bundles seen)
        self._allocate(capacity, rank=1)
        self._warned = False

    @property
    def capacity(self) -> int:
        return self.rh_sign.numel()

    def _allocate(self, capacity: int, rank: int) -> None:
        """(Re)allocate for ``capacity`` slots of rank ``rank``, keeping what is resident."""
        old = getattr(self, "source_and_proj", None)
        weights = torch.zeros(self.num_layers, capacity, 2 * rank, self.hidden_size, device=self.device)
        bias = torch.zeros(self.num_layers, capacity, rank, device=self.device)
        sign = torch.zeros(capacity, device=self.device)
        if old is not None:
            slots, r = old.shape[1], self.rank
            weights[:, :slots, :r], weights[:, :slots, rank: rank + r] = old[:, :, :r], old[:, :, r:]
            bias[:, :slots, :r], sign[:slots] = self.source_bias, self.rh_sign
        self.source_and_proj, self.source_bias, self.rh_sign, self.rank = weights, bias, sign, rank

    def acquire(self, bundles: list[str], failures: dict[str, str] | None = None) -> dict[str, int]:
        """Slots for one step's bundles, loading the ones not resident (LRU eviction). With
        ``failures``, a bundle that cannot be read gets no slot and its reason is put there
        (the engine fails its requests alone); without, the error is raised."""
        missing = [b for b in dict.fromkeys(bundles) if b not in self.slot_of]
        if len(set(bundles)) > self.capacity:
            if not self._warned:
                self._warned = True
                logger.warning("a step uses %d ReFT-P bundles, more than the bank's %d slots: growing it "
                               "(run PreftScheduler to keep steps within the slots)", len(set(bundles)), self.capacity)
            self._allocate(len(set(bundles)), self.rank)
        free = sorted(set(range(self.capacity)) - set(self.slot_of.values()))
        needed = set(bundles)
        for bundle in missing:
            if free:
                slot = free.pop(0)
            else:  # the least recently used bundle this step does not need
                victim = next(b for b in self.slot_of if b not in needed)
                slot = self.slot_of.pop(victim)
                adapter_cache_stats.record_evictions("slot", "reft", 1)
            start = time.perf_counter()
            try:
                self._write(bundle, slot)
            except Exception as err:  # noqa: BLE001 - a bad bundle costs its own requests, not the step
                if failures is None:
                    raise
                failures[bundle] = f"ReFT-P bundle {bundle} cannot be read: {err}"
                needed.discard(bundle)
                continue
            adapter_cache_stats.record_load("slot", "reft", time.perf_counter() - start)
            self.slot_of[bundle] = slot
        for bundle in needed:
            self.slot_of.move_to_end(bundle)
        return {bundle: self.slot_of[bundle] for bundle in needed}

    def _held(self, bundle: str) -> tuple[dict, dict[str, torch.Tensor]]:
        """The bundle's manifest and weights: from host memory, or read from its store copy,
        checked, and kept (the least recently used bundle out past ``host_capacity``)."""
        held = self.host.get(bundle)
        if held is not None:
            self.host.move_to_end(bundle)
            return held
        start = time.perf_counter()
        if not is_store_copy(bundle):
            raise ValueError(NOT_SERVED)
        if not intact_store_copy("reft", bundle):
            raise ValueError("the server's copy no longer holds the files that were checked")
        manifest = read_manifest(bundle)
        if manifest.get("kind") != "reft":
            raise ValueError(f"{bundle} is a {manifest.get('kind')} bundle, not ReFT-P")
        # copies in RAM: safetensors' tensors are views of a mapping of the file
        weights = {name: tensor.clone() for name, tensor in load_file(f"{bundle}/reft_weights.safetensors").items()}
        check_finite(weights)  # a NaN or inf stays out of the bank, whoever wrote the file
        held = self.host[bundle] = (manifest, weights)
        adapter_cache_stats.record_load("host", "reft", time.perf_counter() - start)
        while len(self.host) > self.host_capacity:
            self.host.popitem(last=False)
            adapter_cache_stats.record_evictions("host", "reft", 1)
        return held

    def _write(self, bundle: str, slot: int) -> None:
        manifest, weights = self._held(bundle)
        r = int(manifest["rank"])
        if r > self.rank:
            self._allocate(self.capacity, r)
        rank = self.rank
        self.source_and_proj[:, slot].zero_()
        self.source_bias[:, slot].zero_()
        for layer in manifest["layers"]:
            self.source_and_proj[layer, slot, :r] = weights[f"layers.{layer}.source_weight"].to(self.device)
            self.source_and_proj[layer, slot, rank: rank + r] = weights[f"layers.{layer}.proj"].to(self.device)
            self.source_bias[layer, slot, :r] = weights[f"layers.{layer}.source_bias"].to(self.device)
        self.rh_sign[slot] = 1.0 if manifest["intervention"] == "loreft" else 0.0
        self.loads += 1

    def apply(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor, plan: TilePlan) -> torch.Tensor:
        """``hidden`` with the ReFT edit of ``plan``'s rows added (``hidden + residual`` is the stream):
        the Triton kernel on CUDA (:func:`preft.kernels.reft_tiles.triton_reft_edit`), the torch
        reference :func:`reft_edit` elsewhere."""
        return self._edit(hidden, residual, plan, self.source_and_proj[layer], self.source_bias[layer],
                          self.rh_sign, self.rank)

    @property
    def _edit(self):
        if self.device.type == "cuda" and not envs.PREFT_TORCH_REFT:
            from preft.kernels.reft_tiles import triton_reft_edit  # Triton only where it compiles

            return triton_reft_edit
        return reft_edit


def reft_edit(hidden: torch.Tensor, residual: torch.Tensor, plan: TilePlan, weights: torch.Tensor,
              bias: torch.Tensor, sign: torch.Tensor, rank: int) -> torch.Tensor:
    """``hidden[row] += P_s^T (W_s h + b_s - k_s P_s h)`` for every row of ``plan``, with
    ``h = hidden[row] + residual[row]`` and ``s`` the row's slot, in place; returns ``hidden``.

    ``weights`` ``[slots, 2r, d]`` is ``[W_s; P_s]`` per slot, ``bias`` ``[slots, r]``, ``sign``
    ``[slots]`` is ``k_s`` (1 LoReFT, 0 DiReFT), ``rank`` is ``r``. Rows without a slot are
    neither computed with bank weights nor written. The torch reference of
    :func:`preft.kernels.reft_tiles.triton_reft_edit` (same arguments, same result)."""
    rows = plan.num_rows
    stream = (plan.rows_of(hidden[:rows]) + plan.rows_of(residual[:rows])).float()  # rows with a slot only
    r = rank
    if plan.single_slot is not None:  # plain matmuls over the slot's rows (the rank is small)
        slot = plan.single_slot
        both = stream @ weights[slot].t()                                                # [active, 2r]
        edit = both[:, :r] + bias[slot] - sign[slot] * both[:, r:]
        delta = edit @ weights[slot, r:]                                                 # [active, d]
    else:
        tile_weights = weights.index_select(0, plan.tile_slots)                         # [tiles, 2r, d]
        both = torch.bmm(stream, tile_weights.transpose(1, 2))                          # [tiles, T, 2r]
        tile_sign = sign.index_select(0, plan.tile_slots)[:, None, None]
        edit = both[..., :r] + bias.index_select(0, plan.tile_slots)[:, None, :] - tile_sign * both[..., r:]
        delta = plan.back_to_rows(torch.bmm(edit, tile_weights[:, r:]))      # [rows, d], zeros without a slot
    plan.add_into_rows(hidden[:rows], delta.to(hidden.dtype))  # in place: inference only
    return hidden


def build_reft_plan(bank: ReftBank, bundles: list[str | None], num_computed_tokens: np.ndarray,
                    num_prompt_tokens: np.ndarray, num_scheduled_tokens: np.ndarray,
                    failures: dict[int, str] | None = None) -> TilePlan | None:
    """The plan of one step's ReFT-P rows: per request its bundle (or None), where its scheduled
    tokens start, ``P`` and how many are scheduled. Slots are acquired only for bundles with an
    active token this step. With ``failures``, a request whose bundle cannot be read is put
    there (request index -> reason) and its rows get no edit; without, the error is raised."""
    if not any(bundles):
        return None
    bundles = list(bundles)
    rules = []
    for index, bundle in enumerate(bundles):
        if bundle and not is_store_copy(bundle):  # never read: fails its request alone
            if failures is None:
                raise ValueError(NOT_SERVED)
            failures[index], bundles[index] = NOT_SERVED, None
            rules.append(None)
            continue
        try:
            rules.append(bundle_rule(bundle) if bundle else None)
        except Exception as err:  # noqa: BLE001 - an unreadable manifest fails its request alone
            if failures is None:
                raise
            failures[index] = f"ReFT-P bundle {bundle} cannot be read: {err}"
            bundles[index] = None
            rules.append(None)
    has_bundle = np.array([bundle is not None for bundle in bundles], dtype=bool)
    request_of_token, token_active, _ = active_scheduled_tokens(
        np.array([rule is not None and rule.prefill_only for rule in rules], dtype=bool),
        np.array([rule.adapter_start if rule else 0 for rule in rules], dtype=np.int64),
        np.asarray(num_computed_tokens, dtype=np.int64), np.asarray(num_prompt_tokens, dtype=np.int64),
        num_scheduled_tokens,
    )
    token_active &= has_bundle[request_of_token]
    if not token_active.any():
        return None
    using = np.unique(request_of_token[token_active]).tolist()
    unreadable: dict[str, str] | None = {} if failures is not None else None
    slot_of = bank.acquire([bundles[r] for r in using], unreadable)
    request_slot = np.full(len(bundles), -1, dtype=np.int64)
    for r in using:
        if bundles[r] in slot_of:
            request_slot[r] = slot_of[bundles[r]]
        else:
            failures[r] = unreadable[bundles[r]]
    token_slot = np.where(token_active, request_slot[request_of_token], -1)
    if not (token_slot >= 0).any():
        return None
    return build_tile_plan(torch.from_numpy(token_slot).to(bank.device))


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder layers of a loaded vLLM model (the first ``ModuleList`` named ``layers``)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers":
            return module
    return None


def layer_returns_stream(layer: nn.Module) -> bool:
    """Whether a decoder layer returns the residual stream itself (a transformers layer, as vLLM's
    Transformers backend runs them: OLMo 2 in vLLM 0.32) rather than vLLM's ``(hidden, residual)``
    pair whose sum is the stream (vLLM's own model classes)."""
    return type(layer).__module__.startswith("transformers.")


def install_hooks(layers: nn.ModuleList, bank: ReftBank, step_plan) -> None:
    """Hook every decoder layer: apply ``bank``'s edit to the rows of ``step_plan()``, to the
    residual stream whichever way the layer returns it (:func:`layer_returns_stream`). A layer
    whose output is neither form fails the step loudly: an edit skipped would be a wrong answer."""
    for index, layer in enumerate(layers):
        if layer_returns_stream(layer):
            def hook(module, inputs, output, layer_index=index):
                plan = step_plan()
                if plan is None:
                    return output
                stream = output[0] if isinstance(output, tuple) else output
                if not isinstance(stream, torch.Tensor):
                    raise RuntimeError(f"preft: {type(module).__name__} returned {type(stream).__name__}, "
                                       "not the residual stream (ReFT-P hooks)")
                rows = stream[0] if stream.dim() == 3 else stream  # the backend's batch of one: [1, tokens, d]
                no_residual = rows.new_zeros(()).expand_as(rows)  # the stream is whole already
                bank.apply(layer_index, rows, no_residual, plan)  # edits the rows in place
                return output
        else:
            def hook(module, inputs, output, layer_index=index):
                plan = step_plan()
                if plan is None:
                    return output
                if not (isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], torch.Tensor)):
                    raise RuntimeError(f"preft: {type(module).__name__} no longer returns vLLM's (hidden, residual) "
                                       "pair (ReFT-P hooks): this vLLM version needs a new hook")
                hidden, residual = output
                if residual is None:
                    residual = hidden.new_zeros(()).expand_as(hidden)
                return bank.apply(layer_index, hidden, residual, plan), output[1]

        layer.register_forward_hook(hook)
