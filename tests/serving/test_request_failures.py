"""One request's adapter failing costs that request alone: the server's store checks and repairs
its copies, the engine refuses a request whose copy is gone, and the worker's per-request code
(LoRA loads, rules, ReFT-P bank writes) records a failure instead of raising. The live-server
side of this is in ``tests/reliability/test_hostile_server.py``."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from peft import get_peft_model

import preft
from conftest import load_base, strengthen_reft
from preft.bundle import ExportError
from preft.export import export_adapter
from preft.bundle import bundle_rule
from preft.serving.bundle_store import BundleStore, served_copy_problem
from preft.serving.reft import ReftBank, build_reft_plan


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, base_path):
    root = tmp_path_factory.mktemp("failures")
    torch.manual_seed(0)
    lora = preft.PreftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)
    get_peft_model(load_base(base_path), lora).save_pretrained(root / "lora")
    reft = preft.PreftReftConfig(rank=2, layers=[1], init_weights=False)
    strengthen_reft(get_peft_model(load_base(base_path), reft)).save_pretrained(root / "reft")
    for name in ("lora", "reft"):
        export_adapter(root / name, base_path, root / f"{name}.bundle")
    return {"lora": root / "lora.bundle", "reft": root / "reft.bundle"}


@pytest.fixture
def store(tmp_path, base_path, monkeypatch):
    monkeypatch.setenv("PREFT_SERVE_STORE", str(tmp_path / "store"))
    bundle_rule.cache_clear()
    yield BundleStore(tmp_path / "store", base_path, max_rank=8)
    bundle_rule.cache_clear()


def test_the_store_files_copies_by_content_and_repairs_a_damaged_one(store, bundles):
    copy, manifest = store.add("a", bundles["reft"])
    assert manifest["kind"] == "reft" and copy.parent == store.root and copy != bundles["reft"]
    assert store.add("b", bundles["reft"])[0] == copy  # same content, same copy
    (copy / "reft_weights.safetensors").write_bytes(b"damaged")
    again, _ = store.add("c", bundles["reft"])
    assert again == copy and (copy / "reft_weights.safetensors").read_bytes() == \
        (bundles["reft"] / "reft_weights.safetensors").read_bytes()
    assert sorted(p.name for p in store.root.iterdir()) == [copy.name]  # no staging or stale leftovers


@pytest.mark.parametrize("kind", ["lora", "reft"])
def test_a_copy_that_lost_a_file_is_named_as_the_problem(store, bundles, kind):
    copy, _ = store.add("a", bundles[kind])
    assert served_copy_problem(kind, str(copy)) is None
    (copy / ("adapter_model.safetensors" if kind == "lora" else "reft_weights.safetensors")).unlink()
    assert "is gone" in served_copy_problem(kind, str(copy))
    shutil.rmtree(copy)
    bundle_rule.cache_clear()
    assert served_copy_problem(kind, str(copy)) is not None


def test_a_store_copy_without_manifest_is_an_error_never_all_token(store, bundles, tmp_path):
    copy, _ = store.add("a", bundles["lora"])
    (copy / "preft_manifest.json").unlink()
    with pytest.raises(ExportError, match="lost its manifest"):
        bundle_rule(str(copy))
    # outside the store, a directory without a manifest is a plain vLLM LoRA (all-token)
    plain = tmp_path / "plain"
    shutil.copytree(copy, plain)
    assert not bundle_rule(str(plain)).prefill_only


def test_reft_plan_fails_the_requests_of_an_unreadable_bundle_and_plans_the_rest(bundles, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(bundles["reft"], broken)
    (broken / "reft_weights.safetensors").write_bytes(b"garbage")
    bank = ReftBank(4, 192, torch.device("cpu"), capacity=2)
    failures: dict[int, str] = {}
    plan = build_reft_plan(bank, [str(broken), str(bundles["reft"]), None], np.array([0, 0, 0]),
                           np.array([3, 3, 3]), np.array([3, 3, 3]), failures)
    assert list(failures) == [0] and "cannot be read" in failures[0]
    assert set(bank.slot_of) == {str(bundles["reft"])}
    slot = bank.slot_of[str(bundles["reft"])]
    assert plan.single_slot == slot and plan.rows.tolist() == [3, 4, 5]
    # only the broken bundle: no plan, the failure recorded; without a failures dict it raises
    assert build_reft_plan(bank, [str(broken)], np.array([0]), np.array([3]), np.array([3]), failures) is None
    from safetensors import SafetensorError

    with pytest.raises(SafetensorError, match="deserializing header"):
        build_reft_plan(bank, [str(broken)], np.array([0]), np.array([3]), np.array([3]))


def _batch(lora_ids):
    return SimpleNamespace(num_reqs=len(lora_ids), request_lora_mapping=np.array(lora_ids),
                           req_ids=[f"req{i}" for i in range(len(lora_ids))])


def test_a_lora_vllm_cannot_load_fails_its_requests_and_leaves_the_step_to_the_others():
    from vllm.lora.request import LoRARequest

    from preft.serving import worker
    from preft.serving.step_context import StepContext, get_step_context, reset_step_context, set_step_context

    good, bad = LoRARequest("good", 1, "/good"), LoRARequest("bad", 2, "/bad")

    class Manager:
        def add_adapter(self, request):
            if request.lora_int_id == 2:
                raise FileNotFoundError("/bad/adapter_model.safetensors")

    runner = SimpleNamespace(lora_manager=Manager(), input_batch=_batch([1, 2, 0, 2]))
    seen = {}

    def original(runner, prompt_mapping, token_mapping, lora_requests, *args):
        seen.update(prompt=prompt_mapping, token=token_mapping, requests=lora_requests)

    set_step_context(StepContext())
    try:
        worker.set_active_loras_guarded(original, runner, (1, 2, 0, 2), (1, 1, 2, 2, 0, 2), {good, bad})
        assert seen == {"prompt": (1, 0, 0, 0), "token": (1, 1, 0, 0, 0, 0), "requests": {good}}
        failed = get_step_context().failed_requests
        assert sorted(failed) == ["req1", "req3"] and "cannot be loaded" in failed["req1"]
    finally:
        reset_step_context()


def test_the_step_output_carries_the_failures_and_the_shared_empty_output_stays_untouched():
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    from preft.constants import FAILED_REQUESTS_ATTR
    from preft.serving import worker
    from preft.serving.step_context import StepContext, get_step_context, set_step_context

    set_step_context(StepContext(failed_requests={"req1": "broken"}))
    output = worker.finish_step(EMPTY_MODEL_RUNNER_OUTPUT)
    assert getattr(output, FAILED_REQUESTS_ATTR) == {"req1": "broken"}
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, FAILED_REQUESTS_ATTR)
    assert get_step_context().failed_requests == {}  # the step ended: the context is reset
    assert worker.finish_step(EMPTY_MODEL_RUNNER_OUTPUT) is EMPTY_MODEL_RUNNER_OUTPUT
