"""Unit tests of the engine-side pieces: the position-keyed LoRA mapping and the CPU LoRA ops."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from preft.serving import lora_ops
from preft.serving.tile_plan import build_tile_plan
from preft.rule import AdapterRule
from preft.serving.lora_mapping import prefill_only_mapping


def test_mapping_keys_on_position_not_on_step_kind():
    rules = {1: AdapterRule(prefill_only=True), 2: AdapterRule(prefill_only=True, adapter_start=2), 3: AdapterRule()}
    # request 0: adapter 1, P=5, second chunk (positions 3, 4, 5): 5 is past the prompt
    # request 1: adapter 2, P=4, whole prompt (0..3) with start 2
    # request 2: adapter 1, decoding at position 9 (one token)
    # request 3: adapter 3 (all-token), decoding
    # request 4: no adapter
    token_ids, sampled_ids = prefill_only_mapping(
        request_lora_ids=np.array([1, 2, 1, 3, 0]),
        num_computed_tokens=np.array([3, 0, 9, 7, 0]),
        num_prompt_tokens=np.array([5, 4, 6, 3, 2]),
        num_scheduled_tokens=np.array([3, 4, 1, 1, 2]),
        num_sampled_tokens=np.array([1, 1, 1, 1, 1]),
        rules=rules,
    )
    assert token_ids.tolist() == [1, 1, 0, 0, 0, 2, 2, 0, 3, 0, 0]
    # the sampled token follows the last scheduled position of its request
    assert sampled_ids.tolist() == [0, 2, 0, 3, 0]


def test_mapping_recompute_after_preemption_and_prefix_hit_agree():
    """Recomputing prompt + generated tokens from 0, or resuming after cached blocks, gives
    the same per-position ids as the first computation."""
    rules = {1: AdapterRule(prefill_only=True)}
    full, _ = prefill_only_mapping(np.array([1]), np.array([0]), np.array([6]), np.array([9]), np.array([1]), rules)
    resumed, _ = prefill_only_mapping(np.array([1]), np.array([4]), np.array([6]), np.array([5]), np.array([1]), rules)
    assert full.tolist() == [1] * 6 + [0] * 3 and resumed.tolist() == full[4:].tolist()


@pytest.mark.parametrize("add_inputs", [True, False])
def test_grouped_ops_match_a_per_row_reference_and_skip_no_adapter_rows(add_inputs):
    torch.manual_seed(0)
    tokens, hidden, rank, out, slots = 7, 12, 4, 10, 3
    x = torch.randn(tokens, hidden)
    lora_a = torch.randn(slots, 1, rank, hidden)
    lora_b = torch.randn(slots, 1, out, rank)
    indices = torch.tensor([0, -1, 2, 2, -1, 0, 1])

    shrunk = torch.full((tokens, rank), 7.0)
    lora_ops.bgmv_shrink(x, lora_a, shrunk, indices, scaling=0.5)
    base = torch.randn(tokens, out + 3)
    expanded = base.clone()
    lora_ops.bgmv_expand_slice(shrunk, lora_b, expanded, indices, 3, out, add_inputs)

    for row, slot in enumerate(indices.tolist()):
        if slot < 0:
            assert torch.equal(shrunk[row], torch.zeros(rank))
            expected = base[row, 3:] if add_inputs else torch.zeros(out)
        else:
            expected_shrunk = 0.5 * lora_a[slot, 0] @ x[row]
            assert torch.allclose(shrunk[row], expected_shrunk, atol=1e-5)
            delta = lora_b[slot, 0] @ expected_shrunk
            expected = base[row, 3:] + delta if add_inputs else delta
        assert torch.allclose(expanded[row, 3:], expected, atol=1e-4)
        assert torch.equal(expanded[row, :3], base[row, :3])


def test_sgmv_wrappers_explode_segments():
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    lora_a = torch.randn(2, 1, 3, 6)
    out = torch.zeros(5, 3)
    # segments: 2 tokens of slot 1, 3 tokens of no adapter
    lora_ops.sgmv_shrink(x, lora_a, out, torch.tensor([0, 2]), torch.tensor([2, 3]), torch.tensor([1, -1]),
                         2, 3, 5, 1.0)
    assert torch.allclose(out[:2], x[:2] @ lora_a[1, 0].T, atol=1e-5) and torch.equal(out[2:], torch.zeros(3, 3))


def _per_row_lora_reference(y, x, indices, lora_a, lora_b, scale, slices):
    expected = y.clone()
    for row, slot in enumerate(indices.tolist()):
        if slot < 0:
            continue
        offset = 0
        for a, b, size in zip(lora_a, lora_b, slices):
            expected[row, offset: offset + size] += b[slot, 0, :size] @ (scale * a[slot, 0] @ x[row])
            offset += size
    return expected


@pytest.mark.parametrize("indices", [
    # several slots, groups not a multiple of the tile, rows without an adapter in between
    [3, 3, 3, -1, 0, 0, 1, 1, 1, 1, 1, -1, -1, 3, 2] * 5,
    [1] * 9,                  # one slot, every row: plain matmuls
    [-1, 2, 2, -1, 2, -1],    # one slot, some rows
    [0, 1, 2, 3] * 8,         # decode-like: one row per request, tiles of 1
    [-1] * 7 + [0, 0, 1, 1, 2, -1, 2] + [-1] * 5,  # prompt chunks with adapters among decode rows
    [-1, 3, 3, -1, 0, 0, 3, -1],  # one tile per slot, slots not a run: the weights are gathered
    [-1] * 4 + [2] * 3 + [0] * 3 + [3] * 3 + [1] * 3 + [-1] * 3,  # equal prompt chunks in a span: rows in blocks
    [0] * 5 + [1] * 5 + [-1],  # rows in blocks, their slots a run
], ids=["many-slots", "one-slot-all-rows", "one-slot-some-rows", "one-row-groups", "chunks-among-decodes",
        "one-tile-per-slot-not-a-run", "rows-in-blocks", "rows-in-blocks-slot-run"])
def test_planned_lora_linear_matches_a_per_row_reference(indices):
    torch.manual_seed(0)
    indices = torch.tensor(indices)
    rows, hidden, rank, slots, slices = indices.numel(), 12, 4, 4, (5, 3, 3)
    x = torch.randn(rows + 2, hidden)  # 2 padding rows past the step's tokens: left alone
    lora_a = tuple(torch.randn(slots, 1, rank, hidden) for _ in slices)
    lora_b = tuple(torch.randn(slots, 1, size + 1, rank) for size in slices)  # B may be wider than the slice
    y = torch.randn(rows + 2, sum(slices))
    expected = _per_row_lora_reference(y, x, indices, lora_a, lora_b, 0.5, slices)
    plan = build_tile_plan(indices, tile_rows=4 if indices.numel() > 40 else None)
    weights = lora_ops.PlannedLoraWeights(lora_a, lora_b, slices)
    lora_ops.planned_lora_linear(y, x, plan, weights, 0.5)
    assert torch.allclose(y, expected, atol=1e-4)


@pytest.mark.parametrize("indices, blocks", [
    ([-1, -1, 2, 2, 2, 0, 0, 0, -1], [2, 0]),  # equal chunks side by side: blocks in row order
    ([-1, 2, 2, 2, -1, 0, 0, 0], None),          # a row without an adapter inside the span
    ([2, 2, 2, 0, 0, -1], None),                 # chunks of different lengths
    ([2, 2, 0, 0, 2, 2], None),                  # a slot's rows in two places
])
def test_rows_in_blocks_only_when_the_span_is_equal_chunks_of_one_slot_each(indices, blocks):
    plan = build_tile_plan(torch.tensor(indices))
    assert (None if plan.block_slots is None else plan.block_slots.tolist()) == blocks


def test_planned_weights_follow_vllm_writing_an_adapter_into_a_slot():
    """vLLM copies a newly activated adapter into its slot in place, through its own stacked
    tensors: the planned ops read those tensors (re-seated side by side, their values kept), so
    the next step uses the new adapter, for one slot or for every slot."""
    torch.manual_seed(0)
    rows, hidden, rank, slots, slices = 8, 6, 2, 3, (4, 4)
    lora_a = tuple(torch.randn(slots, 1, rank, hidden) for _ in slices)
    lora_b = tuple(torch.randn(slots, 1, size, rank) for size in slices)
    weights = lora_ops.PlannedLoraWeights(lora_a, lora_b, slices)
    x = torch.randn(rows, hidden)

    def step(indices):
        indices = torch.tensor(indices)
        y = torch.zeros(rows, sum(slices))
        lora_ops.planned_lora_linear(y, x, build_tile_plan(indices), weights, 1.0)
        return y, _per_row_lora_reference(torch.zeros(rows, sum(slices)), x, indices, lora_a, lora_b, 1.0, slices)

    for indices in ([0, 0, 1, 1, -1, 1, 0, 0], [1] * rows):
        got, expected = step(indices)
        assert torch.allclose(got, expected, atol=1e-5)
    for j in range(len(slices)):  # "activate" new adapters in slots 1 and 2, the way vLLM's set_lora writes them
        lora_a[j][1, 0].copy_(torch.randn(rank, hidden))
        lora_b[j][2, 0].copy_(torch.randn(slices[j], rank))
    for indices in ([1] * rows, [2, 2, 2, 1, 1, 1, 0, 0]):  # one rewritten slot, then several
        got, expected = step(indices)
        assert torch.allclose(got, expected, atol=1e-5)
    for j in range(len(slices)):  # every slot rewritten
        for slot in range(slots):
            lora_a[j][slot, 0].copy_(torch.randn(rank, hidden))
            lora_b[j][slot, 0].copy_(torch.randn(slices[j], rank))
    for indices in ([0, 1, 2, 0, 1, 2, -1, -1], [2] * rows):
        got, expected = step(indices)
        assert torch.allclose(got, expected, atol=1e-5)


def test_tile_plan_groups_rows_by_slot_with_little_padding():
    indices = torch.tensor([5] * 40 + [-1] * 3 + [2] * 7 + [5] * 24)
    plan = build_tile_plan(indices)
    assert plan.single_slot is None and plan.num_rows == indices.numel()
    assert plan.tile_rows == 32  # 7 + 64 rows: 3 tiles of 32 compute fewer rows than 2 of 64 or 5 of 16
    # slot 2: 1 tile, slot 5: 64 rows = 2 tiles, plus the trailing tile the rows without an adapter read
    assert plan.tile_slots.tolist() == [2, 5, 5, 2]
    with_adapter = [i for i, s in enumerate(indices.tolist()) if s >= 0]
    assert sorted(plan.rows.tolist()) == with_adapter  # the rows without an adapter are not gathered
    real = plan.real_positions()
    assert sorted(plan.gather[real].tolist()) == with_adapter
    trailing = (plan.tile_slots.numel() - 1) * plan.tile_rows  # the first position of the trailing tile
    for row, slot in enumerate(indices.tolist()):  # every row reads back a position of its own slot's tile
        if slot >= 0:
            assert plan.tile_slots[plan.untile[row] // plan.tile_rows] == slot and plan.gather[plan.untile[row]] == row
        else:
            assert plan.untile[row] >= trailing and not real[plan.untile[row]]
    assert build_tile_plan(torch.full((6,), -1)) is None  # a decode-only LoRA-P step: no work
    assert plan.slot_run is None  # slot 5 has two tiles: its weights are gathered per tile


def test_tile_weights_are_a_view_only_when_the_tiles_are_one_per_slot_of_a_run():
    weights = torch.arange(6.0).view(6, 1).expand(6, 3)
    run = build_tile_plan(torch.tensor([-1, 2, 2, 3, 3, 4, -1]))
    assert run.slot_run == (2, 5) and run.tile_weights(weights)[:, 0].tolist() == [2, 3, 4]
    assert run.tile_weights(weights).data_ptr() == weights[2:].data_ptr()  # as it lies, no copy
    for indices in ([-1, 1, 1, 3, 3], [2] * 5 + [1] * 70):  # slots 1 and 3 (a gap); slot 2 in two tiles
        plan = build_tile_plan(torch.tensor(indices))
        assert plan.slot_run is None
        assert plan.tile_weights(weights)[:, 0].tolist() == plan.tile_slots[:-1].float().tolist()


def test_tile_plan_reads_back_only_the_rows_from_the_first_adapter_row_to_the_last():
    """A prefill step of many users: decode rows, then the prompt chunks with adapters, then
    more rows. The values added back cover the chunks' span alone, zeros for its rows without
    an adapter, and the rows outside it are not written."""
    indices = torch.tensor([-1] * 6 + [1, 1, -1, 0, 0] + [-1] * 4)
    plan = build_tile_plan(indices)
    assert plan.span == (6, 11)
    computed = torch.arange(plan.tile_slots.numel() * plan.tile_rows, dtype=torch.float32)[:, None] + 1
    values = plan.back_to_rows(computed.clone())
    assert values.shape == (5, 1) and values[2].item() == 0.0  # row 8 has no adapter: an exact zero
    assert [values[i].item() for i in (0, 1, 3, 4)] == [computed[plan.untile[r]].item() for r in (6, 7, 9, 10)]
    target = torch.full((indices.numel(), 1), float("nan"))
    target[6:11] = 0.0
    plan.add_into_rows(target, values)
    assert target[:6].isnan().all() and target[11:].isnan().all()  # never read, never written
    assert torch.equal(target[6:11], values)


@pytest.mark.parametrize("group_rows, tile_rows", [
    ([33] * 64, 33),         # 33-token prompts, one adapter each: one tile per prompt, no padding
    ([1] * 40, 1),           # decode with all-token LoRA: one row per request
    ([262] * 8, 53),         # long groups: 5 tiles of 53 rows rather than 5 of 64
    ([200, 3, 3, 3], 40),    # one long chunk, a few short ones: no tiles of 64 for 3 rows
])
def test_tile_size_keeps_padding_small(group_rows, tile_rows):
    indices = torch.cat([torch.full((rows,), slot) for slot, rows in enumerate(group_rows)])
    plan = build_tile_plan(indices)
    assert plan.tile_rows == tile_rows
    tiles = sum(-(-rows // tile_rows) for rows in group_rows) + 1  # + the trailing tile
    assert plan.tile_slots.numel() == tiles


def test_workspace_buffers_follow_the_tensor_they_serve():
    """The planned ops write into ``out=`` buffers: a buffer on another device or in another dtype
    than the op's operand fails the op on a GPU (index_select out= on the CPU, inputs on CUDA).
    The meta device stands in for a second device on a CPU-only machine."""
    space = lora_ops.Workspace()
    on_cpu = space.get("tiles", 4, 3, like=torch.zeros(1, dtype=torch.float32))
    assert on_cpu.device.type == "cpu" and on_cpu.dtype == torch.float32 and on_cpu.shape == (4, 3)
    elsewhere = space.get("tiles", 4, 3, like=torch.empty(1, dtype=torch.bfloat16, device="meta"))
    assert elsewhere.device.type == "meta" and elsewhere.dtype == torch.bfloat16
    smaller = space.get("tiles", 2, 3, like=torch.empty(1, dtype=torch.bfloat16, device="meta"))
    assert smaller.shape == (2, 3) and smaller.device.type == "meta"  # reused, still where it was asked for


def _file_backed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory lies in a mapping of a file (``/proc/self/maps``)."""
    address = tensor.untyped_storage().data_ptr()
    for line in open("/proc/self/maps"):
        fields = line.split()
        start, end = (int(part, 16) for part in fields[0].split("-"))
        if start <= address < end:
            return len(fields) >= 6 and fields[5].startswith("/")
    return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_a_loaded_lora_is_held_in_process_memory_not_in_a_file_mapping(tmp_path):
    """vLLM's CPU LoRA load returns views of the safetensors file's memory map; the worker's host
    cache must own its copies (the kernel drops mapped file pages under memory pressure)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from vllm.lora.lora_weights import LoRALayerWeights

    from preft.serving.worker import resident_lora

    torch.manual_seed(0)
    saved = {"a": torch.randn(4, 64), "b": torch.randn(64, 4), "a2": torch.randn(4, 64)}
    save_file(saved, tmp_path / "adapter_model.safetensors")
    with safe_open(tmp_path / "adapter_model.safetensors", framework="pt") as f:
        loaded = {name: f.get_tensor(name) for name in saved}
    assert _file_backed(loaded["a"])  # what vLLM's loader hands over
    single = LoRALayerWeights("q_proj", 4, 8, loaded["a"], loaded["b"])
    packed = LoRALayerWeights("qkv_proj", 4, 8, [loaded["a"], None, loaded["a2"]], [loaded["b"], None, None])
    lora = SimpleNamespace(loras={"q_proj": single, "qkv_proj": packed})
    assert resident_lora(lora) is lora
    tensors = [single.lora_a, single.lora_b, packed.lora_a[0], packed.lora_a[2], packed.lora_b[0]]
    assert not any(_file_backed(t) for t in tensors)
    assert packed.lora_a[1] is None and packed.lora_b[1] is None
    assert torch.equal(single.lora_a, saved["a"]) and torch.equal(packed.lora_a[2], saved["a2"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a CUDA machine")
def test_a_lora_vllm_pinned_is_kept_as_it_is():
    """On a GPU machine vLLM copies a LoRA into pinned memory (fast copies into GPU slots): that
    copy is the process's own already, and replacing it by a pageable one would slow the slots."""
    from vllm.lora.lora_weights import LoRALayerWeights

    from preft.serving.worker import resident_lora

    pinned_a, pinned_b = torch.randn(4, 64).pin_memory(), torch.randn(64, 4).pin_memory()
    weights = LoRALayerWeights("q_proj", 4, 8, pinned_a, pinned_b)
    resident_lora(SimpleNamespace(loras={"q_proj": weights}))
    assert weights.lora_a is pinned_a and weights.lora_b is pinned_b


def test_the_embedding_op_is_skipped_only_where_every_slot_of_the_step_has_a_zero_b():
    from preft.serving.step_context import StepContext, reset_step_context, set_step_context

    torch.manual_seed(0)
    slots, hidden, rank = 3, 6, 4
    lora_b = torch.zeros(slots, 1, hidden, rank)
    calls = []

    def vllm_op(wrapper, y, x, b, add_inputs=True):
        calls.append(1)
        for row, slot in enumerate(wrapper.token_lora_indices[: x.shape[0]].tolist()):
            if slot >= 0:
                y[row] += x[row] @ b[slot, 0].T

    def embed(indices):
        indices = torch.tensor(indices)
        set_step_context(StepContext(lora_plan=build_tile_plan(indices)))
        try:
            wrapper = SimpleNamespace(token_lora_indices=indices)
            x, y = torch.randn(4, rank), torch.randn(4, hidden)
            before = y.clone()
            lora_ops.skip_zero_embeddings(vllm_op, wrapper, y, x, lora_b, add_inputs=True)
            return not torch.equal(y, before)
        finally:
            reset_step_context()

    assert not embed([0, -1, 2, 2]) and calls == []  # every slot's B zero: x @ 0 adds nothing
    lora_b[2, 0].copy_(torch.randn(hidden, rank))  # an adapter with embedding weights in slot 2
    assert embed([0, -1, 2, 2]) and len(calls) == 1
    assert not embed([0, 1, -1, 0]) and len(calls) == 1  # slot 2 not in the step
    assert not embed([-1, -1, -1, -1]) and len(calls) == 1  # no adapter row


def test_the_logits_op_is_skipped_only_where_every_sampled_slot_is_zero():
    torch.manual_seed(0)
    slots, vocab, rank, hidden = 3, 11, 4, 6
    lora_a, lora_b = torch.zeros(slots, 1, rank, hidden), torch.zeros(slots, 1, vocab, rank)
    calls = []

    def vllm_op(wrapper, y, x, a, b, scale):
        calls.append(wrapper.sampler_indices.tolist())
        for row, slot in enumerate(wrapper.sampler_indices[: x.shape[0]].tolist()):
            if slot >= 0:
                y[row] += scale * (x[row] @ a[slot, 0].T) @ b[slot, 0].T

    def logits(indices):
        wrapper = SimpleNamespace(sampler_indices=torch.tensor(indices))
        x, y = torch.randn(4, hidden), torch.randn(4, vocab)
        before = y.clone()
        lora_ops.skip_zero_logits(vllm_op, wrapper, y, x, lora_a, lora_b, 1.0)
        return not torch.equal(y, before)

    assert not logits([0, -1, 2, 2]) and calls == []  # every slot zero: nothing to add
    lora_a[2, 0].copy_(torch.randn(rank, hidden))  # vLLM writes an adapter with lm_head weights into slot 2
    lora_b[2, 0].copy_(torch.randn(vocab, rank))
    assert logits([0, -1, 2, 2]) and len(calls) == 1
    assert not logits([0, 1, -1, 0]) and len(calls) == 1  # slot 2 not sampled
    lora_a[2].zero_(), lora_b[2].zero_()  # and zeroed again when another adapter takes the slot
    assert not logits([2, 2, 2, 2]) and len(calls) == 1
    lora_b[1, 0, 0, 0] = float("nan")  # NaN is not zero: the op runs and shows it
    logits([1, -1, -1, -1])
    assert len(calls) == 2
