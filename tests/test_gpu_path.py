"""The CUDA-specific parts of the engine path, tested where they can run on CPU (their logic),
and on a GPU only where they need one (skipped here with the reason):

- the LoRA count vLLM's CUDA-graph dispatch sees is the rule's: a decode-only step of
  prefill-only requests counts 0 (the base model's graph), an all-token LoRA still counts;
- async scheduling is off under PreFT's scheduler, and an explicit request for it is refused;
- the ReFT-P edit runs the Triton kernel on CUDA and the torch reference elsewhere, and nothing
  of the kernel is imported on CPU.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from preft.rule import ALL_TOKEN, AdapterRule
from preft.serving import SCHEDULER_CLS, worker
from preft.serving.engine_config import resolve_async_scheduling
from preft.serving.step_context import StepContext, get_step_context, reset_step_context, set_step_context

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check runs it)")


class FakeLoraRequest:  # hashable, as vLLM's LoRARequest
    def __init__(self, lora_id: int) -> None:
        self.lora_name, self.lora_path = f"l{lora_id}", f"bundle{lora_id}"


def fake_batch(lora_ids, computed, prompt, rules):
    requests = {i: FakeLoraRequest(i) for i in set(lora_ids) if i}
    return SimpleNamespace(num_reqs=len(lora_ids), request_lora_mapping=np.array(lora_ids),
                           lora_id_to_lora_request=requests, num_computed_tokens_cpu=np.array(computed),
                           num_prompt_tokens=np.array(prompt), rules=rules)


@pytest.fixture
def step(monkeypatch):
    rules = {}
    monkeypatch.setattr(worker, "bundle_rule", lambda path: rules[path])
    set_step_context(StepContext())
    yield rules
    reset_step_context()


def active_loras_of(batch, scheduled, step_rules):
    step_rules.update({f"bundle{i}": rule for i, rule in batch.rules.items()})
    set_step_context(StepContext())
    _, tokens, active = worker.make_lora_inputs(batch, np.array(scheduled), np.ones(len(scheduled), dtype=int))
    return get_step_context().num_active_loras, tokens, active


def test_the_graph_dispatch_counts_loras_by_the_rule(step):
    prefill_only = AdapterRule(prefill_only=True)
    # two LoRA-P requests decoding (computed = P): no LoRA token, vLLM alone would count 2
    decode = fake_batch([1, 2], computed=[20, 31], prompt=[20, 31], rules={1: prefill_only, 2: prefill_only})
    count, tokens, active = active_loras_of(decode, [1, 1], step)
    assert count == 0 and set(tokens) == {0} and not active
    # one of them still in its prompt: one LoRA
    mixed = fake_batch([1, 2], computed=[20, 16], prompt=[20, 31], rules={1: prefill_only, 2: prefill_only})
    assert active_loras_of(mixed, [1, 8], step)[0] == 1
    # an all-token LoRA counts while decoding
    all_token = fake_batch([1, 3], computed=[20, 40], prompt=[20, 31], rules={1: prefill_only, 3: ALL_TOKEN})
    assert active_loras_of(all_token, [1, 1], step)[0] == 1


def test_dispatch_is_given_the_step_count_unless_told_one():
    seen = []

    def original(runner, **kwargs):
        seen.append(kwargs)

    set_step_context(StepContext(num_active_loras=0))
    worker.dispatch_with_active_loras(original, None, num_tokens=8)
    worker.dispatch_with_active_loras(original, None, num_tokens=8, force_has_lora=True, force_num_active_loras=4)
    set_step_context(StepContext(num_active_loras=3))
    worker.dispatch_with_active_loras(original, None, num_tokens=8)
    reset_step_context()  # no step mapped (a dummy run): vLLM's own count
    worker.dispatch_with_active_loras(original, None, num_tokens=8)
    assert seen[0] == {"num_tokens": 8, "force_num_active_loras": 0, "force_has_lora": False}
    assert seen[1]["force_num_active_loras"] == 4 and seen[1]["force_has_lora"] is True  # capture: untouched
    assert seen[2]["force_num_active_loras"] == 3 and seen[2]["force_has_lora"] is True
    assert seen[3] == {"num_tokens": 8}


def test_async_scheduling_is_off_under_the_preft_scheduler():
    chosen = SimpleNamespace(scheduler_cls=SCHEDULER_CLS, async_scheduling=None)
    resolve_async_scheduling(chosen)
    assert chosen.async_scheduling is False
    with pytest.raises(ValueError, match="async scheduling cannot run with PreFT's scheduler"):
        resolve_async_scheduling(SimpleNamespace(scheduler_cls=SCHEDULER_CLS, async_scheduling=True))
    other = SimpleNamespace(scheduler_cls=None, async_scheduling=None)
    resolve_async_scheduling(other)
    assert other.async_scheduling is None  # vLLM's own scheduler: vLLM decides


def test_reft_on_cpu_runs_the_torch_reference_and_imports_no_kernel():
    code = ("import sys, torch; from preft.serving.reft import ReftBank, reft_edit; "
            "from preft.serving.tile_plan import build_tile_plan; "
            "bank = ReftBank(2, 8, torch.device('cpu'), 2); assert bank._edit is reft_edit; "
            "h = torch.randn(4, 8); bank.apply(0, h, torch.zeros_like(h), build_tile_plan(torch.tensor([0, -1, 0, 1]))); "
            "assert 'preft.kernels.reft_tiles' not in sys.modules and 'preft.kernels.lora_tiles' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_compiled_or_graph_captured_engine_refuses_reft_rather_than_skipping_it():
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    eager = CompilationConfig(mode=CompilationMode.NONE, cudagraph_mode=CUDAGraphMode.NONE)
    assert worker.reft_unavailable_reason(eager) is None
    for config in (CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.NONE),
                   CompilationConfig(mode=CompilationMode.NONE, cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY)):
        assert "ReFT-P needs an eager engine" in worker.reft_unavailable_reason(config)


@CUDA
def test_reft_on_cuda_runs_the_triton_kernel():
    from preft.kernels.reft_tiles import triton_reft_edit
    from preft.serving.reft import ReftBank

    assert ReftBank(2, 8, torch.device("cuda"), 2)._edit is triton_reft_edit
