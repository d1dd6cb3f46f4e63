"""A short soak of a live server (`preft eval soak`, the same run as `preft bench soak`): every
answer equals HF's (whose answers equal the independent reference's), every bad request gets its
expected status, and the server survives runtime loads and unloads."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import preft
from preft.eval.bench import soak as bench_soak
from preft.eval.soak import main as soak
from reference.independent import greedy_each


def check_against_the_independent_reference(build):
    """``build`` (the soak's adapters and HF references), with its references checked against
    :func:`greedy_each`, which shares no code with preft."""
    def checked(root):
        reference = build(root)
        tokenizer = AutoTokenizer.from_pretrained(preft.DEFAULT_BASE_MODEL)
        model = AutoModelForCausalLM.from_pretrained(preft.DEFAULT_BASE_MODEL, dtype=torch.float32).eval()
        names = list(reference)  # "base" and every adapter
        cases = [(None if name == "base" else name, tokenizer(prompt)["input_ids"])
                 for name in names for prompt in bench_soak.PROMPTS]
        independent = greedy_each(model, {name: root / "adapters" / name for name in names if name != "base"},
                                  cases, bench_soak.NEW_TOKENS, never=(tokenizer.eos_token_id,))
        texts = iter(tokenizer.decode(tokens, skip_special_tokens=True) for tokens in independent)
        for name in names:
            for prompt in bench_soak.PROMPTS:
                assert next(texts) == reference[name][prompt], (name, prompt)
        return reference
    return checked


@pytest.mark.slow
def test_short_soak_has_no_mismatch_and_no_unexpected_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_soak, "build", check_against_the_independent_reference(bench_soak.build))
    result = soak(minutes=0.25, concurrency=8, seed=1, out=str(tmp_path))
    assert result["mismatches"] == 0, result
    assert result["unexpected_failures"] == 0, result["unexpected"]
    assert result["by_kind"].get("completion", 0) > 40 and result["by_kind"].get("bad request", 0) > 5
    assert result["by_kind"].get("load", 0) + result["by_kind"].get("unload", 0) > 0
    assert json.loads((tmp_path / "soak" / "results.json").read_text())["requests"] == result["requests"]
    assert f"| {result['requests']} (" in (tmp_path / "soak" / "soak.md").read_text()
    assert (tmp_path / "soak" / "soak.png").stat().st_size > 1000
    assert "Application startup complete" in (tmp_path / "soak" / "server.log").read_text()  # the log is kept
