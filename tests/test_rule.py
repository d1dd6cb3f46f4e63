"""The one rule (``preft.rule``) and everything that reads it agree: HF's prefill context, the
vLLM LoRA mapping, the ReFT rows, the prefix-cache keys, the scheduler's slot accounting."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from preft.context import PrefillContext
from preft.bundle import bundle_rule
from preft.rule import ALL_TOKEN, AdapterRule, active_scheduled_tokens, is_active

REPO = Path(__file__).resolve().parents[1]


def brute_force(position: int, prompt_length: int, rule: AdapterRule) -> bool:
    return not rule.prefill_only or rule.adapter_start <= position < prompt_length


RULES = [ALL_TOKEN, AdapterRule(True, 0), AdapterRule(True, 3), AdapterRule(True, 9)]


@pytest.mark.parametrize("rule", RULES, ids=str)
def test_every_form_of_the_rule_agrees_with_its_definition(rule):
    prompt_length = 6
    for first in range(10):
        for end in range(first, 12):
            want = any(brute_force(p, prompt_length, rule) for p in range(first, end))
            assert rule.active_in(first, end, prompt_length) == want, (first, end)
        assert rule.needs_adapter_from(first, prompt_length) == any(
            brute_force(p, prompt_length, rule) for p in range(first, 40))
        # KV of [0, end) depends on the adapter iff some position in it was ever active
        assert rule.kv_has_adapter(first) == (not rule.prefill_only or first > rule.adapter_start)


def test_hf_context_and_engine_tokens_use_the_same_rule():
    """The engine's per-token view of a step (chunk of request 0, decode of request 1) equals
    the HF context's mask at the same absolute positions."""
    starts, prompts = np.array([2, 0]), np.array([5, 3])
    computed, scheduled = np.array([1, 7]), np.array([6, 1])
    request_of_token, active, last = active_scheduled_tokens(np.array([True, True]), starts, computed, prompts,
                                                             scheduled)
    positions = [list(range(1, 7)), [7]]
    for row in range(2):
        context = PrefillContext(positions=torch.tensor([positions[row]]), prompt_lengths=torch.tensor([prompts[row]]))
        assert context.active_mask(int(starts[row]))[0].tolist() == active[request_of_token == row].tolist()
        assert bool(last[row]) == bool(is_active(positions[row][-1], prompts[row], starts[row]))
    assert active.tolist() == [False, True, True, True, False, False, False]


def test_bundle_rule_reads_the_manifest_once_and_all_token_covers_every_kind(tmp_path, monkeypatch):
    from preft.bundle import BUNDLE_FORMAT, MANIFEST

    for kind in ("lora", "reft"):
        bundle = tmp_path / kind
        bundle.mkdir()
        (bundle / MANIFEST).write_text(json.dumps({"format": BUNDLE_FORMAT, "kind": kind, "prefill_only": True,
                                                   "adapter_start": 4}))
        monkeypatch.delenv("PREFT_ALL_TOKEN", raising=False)
        bundle_rule.cache_clear()
        assert bundle_rule(bundle) == AdapterRule(True, 4)
        monkeypatch.setenv("PREFT_ALL_TOKEN", "1")
        bundle_rule.cache_clear()
        assert bundle_rule(bundle) == ALL_TOKEN
    monkeypatch.delenv("PREFT_ALL_TOKEN")
    bundle_rule.cache_clear()
    (tmp_path / "plain").mkdir()  # a plain vLLM LoRA directory: stock behaviour, every token
    assert bundle_rule(tmp_path / "plain") == ALL_TOKEN
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / MANIFEST).write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="unknown bundle format"):
        bundle_rule(tmp_path / "bad")


def test_prefix_keys_drop_the_adapter_only_before_its_start(tmp_path):
    from preft.bundle import BUNDLE_FORMAT, MANIFEST
    from preft.serving.engine_core import block_extra_keys

    for name, start in (("lora", 4), ("reft", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / MANIFEST).write_text(json.dumps({"format": BUNDLE_FORMAT, "kind": name,
                                                            "prefill_only": True, "adapter_start": start}))
    stock = lambda request, start, end, mm: ((("lora", 1),) if request.lora_request else None, mm)  # noqa: E731
    lora = SimpleNamespace(lora_request=SimpleNamespace(lora_path=str(tmp_path / "lora")), sampling_params=None,
                           num_prompt_tokens=20, request_id="a")
    assert block_extra_keys(stock, lora, 0, 4, 0) == (None, 0)            # wholly before start 4: base KV
    assert block_extra_keys(stock, lora, 4, 8, 0) == ((("lora", 1), ("preft_span", 4, 8)), 0)
    reft = SimpleNamespace(lora_request=None, num_prompt_tokens=20, request_id="b",
                           sampling_params=SimpleNamespace(extra_args={"preft_reft": str(tmp_path / "reft")}))
    assert block_extra_keys(stock, reft, 0, 2, 0) == (None, 0)
    assert block_extra_keys(stock, reft, 2, 4, 0) == ((("preft_reft", str(tmp_path / "reft"), 2, 4),), 0)


def test_prefix_keys_carry_the_prompt_boundary(tmp_path):
    """A block one request filled past its prompt (adapter off there) keys apart from the same
    tokens as prompt (adapter on): turn 1's decoded block is not turn 2's prompt block. Before,
    both keyed ("lora", 1) and vLLM reused turn 1's KV for turn 2."""
    from preft.bundle import BUNDLE_FORMAT, MANIFEST
    from preft.serving.engine_core import block_extra_keys

    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / MANIFEST).write_text(json.dumps({"format": BUNDLE_FORMAT, "kind": "lora",
                                                          "prefill_only": True, "adapter_start": 0}))
    stock = lambda request, start, end, mm: ((("lora", 1),), mm)  # noqa: E731

    def request(prompt_tokens, extra=None):
        return SimpleNamespace(lora_request=SimpleNamespace(lora_path=str(tmp_path / "lora")), request_id="r",
                               num_prompt_tokens=prompt_tokens, sampling_params=SimpleNamespace(extra_args=extra))

    turn1, turn2 = block_extra_keys(stock, request(9), 0, 128, 0), block_extra_keys(stock, request(217), 0, 128, 0)
    assert turn1 != turn2 and turn1[0][-1] == ("preft_span", 0, 9) and turn2[0][-1] == ("preft_span", 0, 128)
    # a block wholly inside both prompts is shared; a request's own boundary keys like a shorter prompt
    assert block_extra_keys(stock, request(200), 0, 128, 0) == turn2
    assert block_extra_keys(stock, request(217, {"preft_prompt_end": 9}), 0, 128, 0) == turn1


def test_kv_adapter_span_is_the_rule_on_the_block():
    rule = AdapterRule(prefill_only=True, adapter_start=3)
    assert rule.kv_adapter_span(3, 100) is None and rule.kv_adapter_span(128, 2) is None
    assert rule.kv_adapter_span(128, 100) == (3, 100) and rule.kv_adapter_span(64, 100) == (3, 64)
    assert AdapterRule().kv_adapter_span(128, 9) == (0, 128)  # all-token: P does not matter
    for end in range(0, 12):  # the span is exactly the active positions below the block's end
        for prompt in range(0, 12):
            active = [p for p in range(end) if rule.active_in(p, p + 1, prompt)]
            span = rule.kv_adapter_span(end, prompt)
            assert active == (list(range(*span)) if span else [])


def test_serve_all_token_reaches_every_process_and_the_scheduler_is_preft(tmp_path):
    from preft.cli import build_parser
    from preft.serving import SCHEDULER_CLS
    from preft.serving.server import server_environment, vllm_arguments

    args = build_parser().parse_args(["serve", "--all-token", "--max-adapters", "3"])
    env = server_environment(args, Path("base"), {})
    assert env["PREFT_ALL_TOKEN"] == "1" and env["PREFT_REFT_SLOTS"] == "3"
    args.lora_adapters = []
    argv = vllm_arguments(args, Path("base"))
    assert argv[argv.index("--scheduler-cls") + 1] == SCHEDULER_CLS
    plain = server_environment(build_parser().parse_args(["serve"]), Path("base"), {})
    assert "PREFT_ALL_TOKEN" not in plain


@pytest.mark.parametrize("native_bf16, requested, served", [
    (True, "auto", "auto"), (False, "auto", "float32"), (False, "bfloat16", "bfloat16"), (True, "float32", "float32")])
def test_serve_dtype_auto_is_float32_on_a_cpu_without_native_bf16(tmp_path, monkeypatch, native_bf16, requested,
                                                                  served):
    import torch

    from preft.cli import build_parser
    from preft.serving import server
    from preft.serving.sglang.server import sglang_arguments

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("preft.precision.cpu_has_native_bf16", lambda: native_bf16)
    args = build_parser().parse_args(["serve", "--dtype", requested])
    args.lora_adapters = []
    argv = server.vllm_arguments(args, Path("base"))
    assert argv[argv.index("--dtype") + 1] == served
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8}')
    args.kv_cache_gib = 0.01
    argv = sglang_arguments(args, tmp_path, on_cpu=True)
    assert argv[argv.index("--dtype") + 1] == served


def test_the_rule_and_the_manifest_name_live_in_one_module_each():
    """``adapter_start <= p < P`` is written once (preft/rule.py); the manifest's file name once
    (preft/bundle.py). Every other module calls them."""
    sources = [p for d in ("preft", "serving", "kernels", "eval", "recipes") for p in (REPO / d).rglob("*.py")]
    comparison = re.compile(r">=\s*[\w.\[\]]*start\b.*&.*<\s*[\w.\[\]]*prompt")
    with_rule = [p.relative_to(REPO) for p in sources
                 if any(comparison.search(line) for line in p.read_text().splitlines()
                        if not line.lstrip().startswith(("#", ">>>", "``", "-", "*")))]
    assert with_rule == [Path("preft/rule.py")]
    assert [p.relative_to(REPO) for p in sources if '"preft_manifest.json"' in p.read_text()] == [
        Path("preft/bundle.py")]
