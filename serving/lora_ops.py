"""Correct, batched CPU LoRA ops for vLLM's punica wrapper (drop-in for ``lora/ops/torch_ops``).

vLLM 0.32's CPU ops gather one weight matrix *per token* (``weights[indices]``) and einsum: slot
``-1`` ("no adapter") silently selects the last adapter, and the gather copies ``tokens x out x
in`` floats. Prefill-only serving mixes adapter and no-adapter tokens in nearly every step.

These ops work from a :class:`TilePlan` of the step instead (the layout of a segmented-GEMM
kernel such as punica's SGMV, written with torch ops): the rows that have an adapter, sorted
by slot, cut into tiles of ``tile_rows`` rows that each belong to one slot. Per LoRA layer:
one gather of the rows, the weights *per tile* (not per token; as they lie when the tiles are
one per slot of a run of slots, else gathered), one ``bmm``
shrink shared by the layer's slices (q/k/v, gate/up), one ``bmm`` expand per slice and one
gather of its result back into row order (the rows from the first with an adapter to the
last: a prefill step's many decode rows are not touched), whatever the number of adapters in
the step; where the rows with an adapter are equal prompt chunks side by side (the plan's
``block_slots``) they are read and written in place instead (:func:`_lora_linear_in_blocks`).
The logits and embedding layers' ops (:func:`skip_zero_logits`, :func:`skip_zero_embeddings`)
are skipped when no row's slot holds ``lm_head`` or embedding weights (PEFT's ``all-linear``
leaves both out). Rows with ``-1`` are never computed with adapter weights and get exact zeros
added (or written, where an op overwrites its output): no 0/1 mask multiplies them, so one
adapter's NaN or inf cannot reach another request's rows. A step whose rows all use one slot runs plain
matmuls over its adapter rows. The plan depends
only on the step's per-token slots, so the worker builds it once per step into the step
context (:mod:`preft.serving.step_context`) and every LoRA layer of the step reuses it
(:func:`add_lora_linear`); each layer reads vLLM's stacked tensors where they lie, through a
:class:`PlannedLoraWeights`.
"""

from __future__ import annotations

import math

import torch

from preft.serving.step_context import get_step_context
from preft.serving.tile_plan import TilePlan, build_tile_plan

# One op at a time, straight from vLLM's stacked weights: the pieces of vLLM's op signatures
# further down (embeddings, logits, sharded layers). LoRA linear layers use planned_lora_linear.


def _weights(stacked: torch.Tensor, plan: TilePlan, dtype: torch.dtype) -> torch.Tensor:
    """Stacked weights ``[slots, (1,) out, in]`` as ``[out, in]`` (single slot) or ``[tiles, out, in]``."""
    stacked = stacked.flatten(0, 1) if stacked.dim() == 4 else stacked
    if plan.single_slot is not None:
        return stacked[plan.single_slot].to(dtype)
    return stacked.index_select(0, plan.tile_slots).to(dtype)


class PlannedLoraWeights:
    """One LoRA layer's stacked adapter weights as the planned ops read them: vLLM's own
    tensors, never a copy.

    vLLM keeps ``lora_a_stacked[j]`` as ``[slots, 1, rank, in]`` and ``lora_b_stacked[j]`` as
    ``[slots, 1, out_j, rank]`` per output slice, and writes an adapter into its slot in place
    when it activates it. The slices of a merged layer (q/k/v, gate/up) share one shrink when
    their A's sit side by side, so the first time a layer is seen its A tensors are re-seated
    (``Tensor.set_``) as views of one ``a`` ``[slots, slices * rank, in]``: the same tensor
    objects with the same values, and every later slot write of vLLM's lands in ``a``. B's are
    read where they lie, ``b[j]`` ``[slots, out_j, rank]``. Nothing is copied per step (a
    transposed copy kept in step cost more to refresh, when a prefill step brings 8 new
    adapters, than it saved in the matmuls).
    """

    def __init__(self, lora_a_stacked, lora_b_stacked, output_slices):
        self.lora_a, self.lora_b = tuple(lora_a_stacked), tuple(lora_b_stacked)
        self.rank = self.lora_a[0].shape[2]
        self.a = _side_by_side(self.lora_a)
        self.b = [lora_b.flatten(0, 1)[:, :size, :] for lora_b, size in zip(self.lora_b, output_slices)]


def _side_by_side(lora_a: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The slices' A's ``[slots, 1, rank, in]`` as one ``[slots, slices * rank, in]``, re-seating
    them as its views (their values kept) unless they already are."""
    slots, _, rank, size_in = lora_a[0].shape
    width = rank * len(lora_a)
    first = lora_a[0]
    if all(a.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           and a.storage_offset() == first.storage_offset() + j * rank * size_in
           and a.stride() == (width * size_in, a.stride(1), size_in, 1) for j, a in enumerate(lora_a)):
        return torch.as_strided(first, (slots, width, size_in), (width * size_in, size_in, 1))
    joined = torch.empty(slots, width, size_in, dtype=first.dtype, device=first.device)
    for j, a in enumerate(lora_a):
        joined[:, j * rank: (j + 1) * rank].copy_(a[:, 0])
    for j, a in enumerate(lora_a):
        a.set_(joined.untyped_storage(), j * rank * size_in, (slots, 1, rank, size_in),
               (width * size_in, rank * size_in, size_in, 1))
    return joined


class Workspace:
    """Reusable scratch tensors for the planned ops, one growable buffer per name.

    A prefill step's temporaries are megabytes each; freshly allocated, glibc hands them out
    as new pages and every step pays the page faults (measured: up to 2x the ops' time on
    these VMs). The same few shapes recur for every layer of a step, so they are kept.
    """

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, *shape: int, like: torch.Tensor) -> torch.Tensor:
        """A ``shape`` view of buffer ``name``, on ``like``'s device and in its dtype (what the
        ``out=`` of an op on ``like`` must be)."""
        size = math.prod(shape)
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < size or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = self.buffers[name] = torch.empty(size, dtype=like.dtype, device=like.device)
        return buffer[:size].view(shape)


def planned_lora_linear(y, x, plan: TilePlan | None, weights: PlannedLoraWeights, scale: float,
                        workspace: Workspace | None = None) -> None:
    """``y[:, slice j] += scale * x @ A_j,slot^T @ B_j,slot^T`` for every row with an adapter.

    One shrink for all slices (their A's side by side), then one expand per slice, in float32
    (like vLLM's shrink buffers). Several slots: the rows are tiled per :class:`TilePlan`, the
    weights gathered per tile and the expanded rows added back into their rows; one slot: plain
    matmuls (into ``y`` in place when every row has the adapter). Rows without an adapter are
    neither read nor written.
    """
    if plan is None:
        return
    y = y.view(-1, y.shape[-1])[: plan.num_rows]
    x = x.view(-1, x.shape[-1])[: plan.num_rows].float()
    rank, offset = weights.rank, 0
    if plan.single_slot is not None:
        shrunk = torch.mm(plan.rows_of(x), weights.a[plan.single_slot].float().t()).mul_(scale)
        for j, b in enumerate(weights.b):
            size = b.shape[1]
            part, b = shrunk[:, j * rank: (j + 1) * rank].to(y.dtype), b[plan.single_slot].to(y.dtype).t()
            if plan.rows is None:  # every row: accumulate in place, one pass over the output
                y[:, offset: offset + size].addmm_(part, b)
            else:
                y[:, offset: offset + size].index_add_(0, plan.rows, torch.mm(part, b))
            offset += size
        return
    # in blocks, the expand adds into ``y`` directly, which needs ``y`` in the float32 of the
    # computation (a bfloat16 engine keeps the tiled path, which casts what it adds)
    if plan.block_slots is not None and y.dtype == x.dtype:
        _lora_linear_in_blocks(y, x, plan, weights, scale)
        return
    space = workspace or Workspace()
    num_tiles, tile_rows, size_in = plan.num_real_tiles, plan.tile_rows, x.shape[-1]
    width, (first, end) = weights.a.shape[1], plan.span
    tiles = torch.index_select(x, 0, plan.gather[: num_tiles * tile_rows],
                               out=space.get("tiles", num_tiles * tile_rows, size_in, like=x))
    a = plan.tile_weights(weights.a, out=space.get("a", num_tiles, width, size_in, like=weights.a)).float()
    shrunk = torch.bmm(tiles.view(num_tiles, tile_rows, size_in), a.transpose(1, 2),
                       out=space.get("shrunk", num_tiles, tile_rows, width, like=x)).mul_(scale)
    for j, b in enumerate(weights.b):
        size = b.shape[1]
        b = plan.tile_weights(b, out=space.get("b", num_tiles, size, rank, like=b)).float()
        expanded = space.get("expanded", num_tiles + 1, tile_rows, size, like=x)
        torch.bmm(shrunk[..., j * rank: (j + 1) * rank], b.transpose(1, 2), out=expanded[:num_tiles])
        expanded[-1].zero_()  # the trailing tile, read by the rows without an adapter: exact zeros
        rows = torch.index_select(expanded.view(-1, size), 0, plan.untile[first:end],
                                  out=space.get("rows", end - first, size, like=x))
        y[first:end, offset: offset + size].add_(rows.to(y.dtype))
        offset += size


def _lora_linear_in_blocks(y, x, plan: TilePlan, weights: PlannedLoraWeights, scale: float) -> None:
    """:func:`planned_lora_linear` where the rows with an adapter are the plan's span, in blocks
    of ``tile_rows`` rows of one slot each (:attr:`TilePlan.block_slots`): the span's rows are
    read and written where they lie, as ``[blocks, tile_rows, ...]`` views, and the weights are
    taken in block order instead, so no row is gathered, no result is read back through a
    padded tile, and each slice's expand adds into ``y`` in the same op (``baddbmm_``)."""
    first, end = plan.span
    blocks, tile_rows, rank = plan.block_slots.numel(), plan.tile_rows, weights.rank
    span_rows = x[first:end].view(blocks, tile_rows, x.shape[-1])
    shrunk = torch.bmm(span_rows, plan.block_weights(weights.a).float().transpose(1, 2))
    offset = 0
    for j, b in enumerate(weights.b):
        size = b.shape[1]
        target = y[first:end, offset: offset + size].view(blocks, tile_rows, size)
        target.baddbmm_(shrunk[..., j * rank: (j + 1) * rank], plan.block_weights(b).float().transpose(1, 2),
                        alpha=scale)
        offset += size


# vLLM's op signatures, for the punica wrapper's other callers (embeddings, logits, sharded layers)


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    rank = lora_a_weights.shape[-2]
    target = output_tensor[: inputs.shape[0], :rank]
    target.zero_()  # rows without an adapter shrink to zero (what vLLM's expand then adds nothing from)
    plan = build_tile_plan(lora_indices_tensor[: inputs.shape[0]])
    if plan is None:
        return
    weight = _weights(lora_a_weights, plan, output_tensor.dtype).transpose(-1, -2)
    shrunk = torch.matmul(plan.rows_of(inputs).to(output_tensor.dtype), weight).mul_(scaling)
    plan.add_into_rows(target, plan.back_to_rows(shrunk))


def _expand(inputs, lora_b_weights, output_tensor, indices, offset, size, add_inputs):
    target = output_tensor[: inputs.shape[0], offset: offset + size]
    if not add_inputs:
        target.zero_()
    plan = build_tile_plan(indices[: inputs.shape[0]])
    if plan is None:
        return
    weight = _weights(lora_b_weights, plan, target.dtype)[..., :size, :].transpose(-1, -2)
    expanded = torch.matmul(plan.rows_of(inputs).to(target.dtype), weight)  # ``inputs``: already shrunk rows
    plan.add_into_rows(target, plan.back_to_rows(expanded))


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    size = min(lora_b_weights.shape[-2], output_tensor.shape[1])
    _expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, 0, size, add_inputs)


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):
    _expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs)


def _explode(lora_indices_tensor, seq_len_tensor):
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, scaling):
    bgmv_shrink(inputs, lora_a_weights, output_tensor, _explode(lora_indices_tensor[:batches], seq_len_tensor[:batches]),
                scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, add_inputs=False):
    bgmv_expand(inputs, lora_b_weights, output_tensor,
                _explode(lora_indices_tensor[:batches], seq_len_tensor[:batches]), add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor,
                      _explode(lora_indices_tensor[:batches], seq_len_tensor[:batches]), slice_offset, slice_size,
                      add_inputs)


class PlannedWeightsCache:
    """The :class:`PlannedLoraWeights` of every LoRA layer of this worker (by the identity of
    the layer's first stacked A tensor) and the scratch :class:`Workspace` they share: state
    that lives as long as the worker, unlike the step's plan (:mod:`preft.serving.step_context`)."""

    def __init__(self) -> None:
        self.layers: dict[int, PlannedLoraWeights] = {}
        self.workspace = Workspace()

    def weights_of(self, lora_a_stacked, lora_b_stacked, output_slices) -> PlannedLoraWeights:
        weights = self.layers.get(id(lora_a_stacked[0]))
        if weights is None or weights.lora_a[0] is not lora_a_stacked[0]:
            weights = self.layers[id(lora_a_stacked[0])] = PlannedLoraWeights(lora_a_stacked, lora_b_stacked,
                                                                              output_slices)
        return weights


PLANNED_WEIGHTS = PlannedWeightsCache()


def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, **kwargs):
    """Replacement for ``PunicaWrapperCPU.add_lora_linear`` (same signature): every LoRA linear
    layer of a step runs from the step's one plan; a step with no adapter row (every decode
    step under LoRA-P) has none and does no LoRA work at all."""
    plan = get_step_context().lora_plan
    if plan is None:
        return
    weights = PLANNED_WEIGHTS.weights_of(lora_a_stacked, lora_b_stacked, output_slices)
    planned_lora_linear(y, x, plan, weights, scale, PLANNED_WEIGHTS.workspace)


class ZeroSlots:
    """Which slots of a stacked adapter tensor hold anything but zeros, read once and again only
    after the tensor is written (its version counter, which every in-place write to it or a view
    of it bumps: vLLM's slot writes, and the zeroing of :mod:`preft.serving.slot_zeroing` skips
    only writes that would change nothing)."""

    def __init__(self) -> None:
        self.known: dict[int, tuple[torch.Tensor, int, frozenset[int]]] = {}

    def nonzero(self, stacked: torch.Tensor) -> frozenset[int]:
        entry = self.known.get(id(stacked))
        if entry is None or entry[0] is not stacked or entry[1] != stacked._version:
            slots = stacked.flatten(1).ne(0).any(dim=1).nonzero().flatten().tolist()  # NaN counts as nonzero
            entry = self.known[id(stacked)] = (stacked, stacked._version, frozenset(slots))
        return entry[2]


ZERO_SLOTS = ZeroSlots()


def skip_zero_logits(original, self, y, x, lora_a_stacked, lora_b_stacked, scale, *args, **kwargs):
    """``PunicaWrapperCPU.add_lora_logits`` (vLLM's, as ``original``), skipped when every sampled
    row's slot holds zeros in both the ``lm_head`` A and B, where it would add exact zeros: an
    adapter without ``lm_head`` weights (PEFT's ``all-linear`` leaves it out) gets a zeroed
    slot. With many users every prefill step samples rows of up to 8 adapters, and the op
    gathered each one's ``[vocab, rank]`` B (12.6 MB a step on a 49k vocabulary at rank 8) to
    add nothing."""
    plan = build_tile_plan(self.sampler_indices[: x.view(-1, x.shape[-1]).shape[0]])
    if plan is None or not plan.slots & (ZERO_SLOTS.nonzero(lora_a_stacked) | ZERO_SLOTS.nonzero(lora_b_stacked)):
        return None
    return original(self, y, x, lora_a_stacked, lora_b_stacked, scale, *args, **kwargs)


def skip_zero_embeddings(original, self, y, x, lora_b_stacked, *args, **kwargs):
    """``PunicaWrapperCPU.add_lora_embedding`` (vLLM's, as ``original``: ``y += x @ B`` per token
    row, ``x`` the row's lookup in the slot's embedding A), skipped when no row of the step has
    an adapter or every slot the step's rows use holds a zero ``B``, where it would add
    ``x @ 0``. No PreFT adapter has embedding weights; the op built a plan and multiplied by
    zeros in every step with an adapter row. The rows are the step's tokens, whose slots the
    step's plan holds (:func:`preft.serving.worker.prepare_step`)."""
    plan = get_step_context().lora_plan
    if plan is None or not plan.slots & ZERO_SLOTS.nonzero(lora_b_stacked):
        return None
    return original(self, y, x, lora_b_stacked, *args, **kwargs)
