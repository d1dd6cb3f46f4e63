"""The ReFT-P bank: a fixed number of slots, incremental slot writes, least-recently-used eviction."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from peft import get_peft_model

import preft
from conftest import load_base, strengthen_reft
from preft.export import export_adapter
from preft.serving.reft import ReftBank, build_reft_plan
from preft.serving.tile_plan import build_tile_plan


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, base_path):
    root = tmp_path_factory.mktemp("bank")
    paths = []
    for index in range(4):
        torch.manual_seed(index)
        config = preft.PreftReftConfig(rank=1 + index, layers=[index % 4], init_weights=False,
                                       intervention=("loreft", "direft")[index % 2], adapter_start=index % 2)
        strengthen_reft(get_peft_model(load_base(base_path), config)).save_pretrained(root / f"a{index}")
        export_adapter(root / f"a{index}", base_path, root / f"b{index}")
        paths.append(str(root / f"b{index}"))
    return paths


def edit(bank: ReftBank, bundle: str, stream: torch.Tensor, layer: int) -> torch.Tensor:
    """The bank's edit of ``stream`` (every row with ``bundle``) at ``layer``."""
    slot = bank.acquire([bundle])[bundle]
    hidden = stream.clone()
    return bank.apply(layer, hidden, torch.zeros_like(stream), build_tile_plan(torch.full((len(stream),), slot)))


def test_bank_keeps_its_slots_and_evicts_the_least_recently_used(bundles):
    torch.manual_seed(0)
    stream = torch.randn(5, 192)
    bank = ReftBank(num_layers=4, hidden_size=192, device=torch.device("cpu"), capacity=2)
    alone = {b: ReftBank(4, 192, torch.device("cpu"), capacity=1) for b in bundles}
    expected = {(b, layer): edit(alone[b], b, stream, layer) for b in bundles for layer in range(4)}

    assert bank.acquire([bundles[0], bundles[1]]) == {bundles[0]: 0, bundles[1]: 1}
    bank.acquire([bundles[0]])                       # bundle 1 is now the least recently used
    assert bank.acquire([bundles[2]]) == {bundles[2]: 1}
    assert set(bank.slot_of) == {bundles[0], bundles[2]} and bank.capacity == 2
    assert bank.acquire([bundles[2], bundles[3]]) == {bundles[2]: 1, bundles[3]: 0}  # bundle 0 goes
    # every resident bundle, whatever slot and rank padding it got, edits as it does alone
    for bundle in (bundles[2], bundles[3], bundles[1], bundles[0]):
        for layer in range(4):
            torch.testing.assert_close(edit(bank, bundle, stream, layer), expected[(bundle, layer)])
    assert bank.capacity == 2 and bank.loads == 6


def test_a_step_over_capacity_grows_the_bank_and_stays_correct(bundles):
    bank = ReftBank(4, 192, torch.device("cpu"), capacity=2)
    slots = bank.acquire(bundles)
    assert bank.capacity == 4 and sorted(slots.values()) == [0, 1, 2, 3]


def test_reft_plan_acquires_slots_only_for_active_tokens(bundles):
    """A decode step of prefill-only bundles needs no slot; a prompt chunk does (rule by position)."""
    bank = ReftBank(4, 192, torch.device("cpu"), capacity=2)
    # request 0: bundle 0 (start 0) decoding at position 9 of a 6-token prompt; request 1: no bundle;
    # request 2: bundle 1 (start 1) prefilling positions 0..3 of a 4-token prompt
    plan = build_reft_plan(bank, [bundles[0], None, bundles[1]], np.array([9, 0, 0]), np.array([6, 3, 4]),
                           np.array([1, 3, 4]))
    assert set(bank.slot_of) == {bundles[1]}
    slot = bank.slot_of[bundles[1]]
    assert plan.single_slot == slot and plan.rows.tolist() == [5, 6, 7]
    assert build_reft_plan(bank, [bundles[0]], np.array([9]), np.array([6]), np.array([1])) is None


class PairLayer(torch.nn.Module):
    """vLLM's convention: ``(hidden, residual)``, the stream their sum."""

    def forward(self, x):
        return 0.25 * x, 0.75 * x


class StreamLayer(torch.nn.Module):
    """A transformers decoder layer's convention (vLLM's Transformers backend): the stream itself."""

    def forward(self, x):
        return x.clone()


StreamLayer.__module__ = "transformers.models.olmo2.modeling_olmo2"


class MovedLayer(torch.nn.Module):
    """A vLLM layer whose output changed shape: one tensor, not the pair."""

    def forward(self, x):
        return x.clone()


def test_hooks_edit_the_stream_whichever_way_a_layer_returns_it(bundles):
    from preft.serving.reft import install_hooks

    torch.manual_seed(0)
    stream = torch.randn(5, 192)
    bank = ReftBank(4, 192, torch.device("cpu"), capacity=2)
    expected = edit(ReftBank(4, 192, torch.device("cpu"), capacity=1), bundles[0], stream, 0)
    slot = bank.acquire([bundles[0]])[bundles[0]]
    plan = build_tile_plan(torch.full((5,), slot))
    layers = [PairLayer(), StreamLayer(), MovedLayer()]
    for layer in layers:  # each as layer 0 of a model, the layer the bundle edits
        install_hooks(torch.nn.ModuleList([layer]), bank, lambda: plan)
    hidden, residual = layers[0](stream)
    torch.testing.assert_close(hidden + residual, expected)
    torch.testing.assert_close(layers[1](stream), expected)
    torch.testing.assert_close(layers[1](stream[None])[0], expected)  # the backend's [1, tokens, d]
    with pytest.raises(RuntimeError, match="MovedLayer no longer returns vLLM's \\(hidden, residual\\) pair"):
        layers[2](stream)
    assert not torch.equal(expected, stream)  # the edit is there to be seen


def test_a_bundle_back_in_a_slot_comes_from_host_memory_until_evicted_there(bundles, tmp_path):
    """1 slot, room for 2 bundles in host memory: a bundle that re-enters its slot is not read
    from disk again; once pushed out of host memory it is read (and checked) again."""
    import shutil

    copies = [tmp_path / f"c{i}" for i in range(3)]
    for source, copy in zip(bundles, copies):
        shutil.copytree(source, copy)
    copies = [str(c) for c in copies]
    bank = ReftBank(4, 192, torch.device("cpu"), capacity=1, host_capacity=2)
    stream = torch.randn(5, 192)
    first = edit(bank, copies[0], stream, 0)
    edit(bank, copies[1], stream, 1)  # takes the one slot: copies[0] leaves it, stays in host memory
    weights = Path(copies[0]) / "reft_weights.safetensors"
    weights.write_bytes(b"not a safetensors file")  # what a second read from disk would meet
    assert torch.allclose(edit(bank, copies[0], stream, 0), first, atol=1e-5)  # back in its slot, from host memory
    assert list(bank.host) == [copies[1], copies[0]]
    edit(bank, copies[2], stream, 2)  # host memory holds 2: copies[1], the least recent, goes
    assert list(bank.host) == [copies[0], copies[2]]
    edit(bank, copies[1], stream, 1)  # read from disk again; pushes copies[0] out of host memory
    assert copies[0] not in bank.host
    with pytest.raises(Exception, match="deserializing header"):  # now read from disk: the changed file is found
        edit(bank, copies[0], stream, 0)
