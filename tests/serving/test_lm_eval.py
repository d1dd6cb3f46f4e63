"""lm-eval against the live ``preft serve`` (issue: conversations): ``preft-completions`` scores a
local multiple-choice task (a YAML task over a JSONL the test writes; nothing downloaded) by the
rule, so each choice's log-likelihood equals HF's teacher-forced one with labels on the choice
(the training loss); lm-eval's own ``local-completions`` runs the adapter on the choice too and
scores differently."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel

from conftest import load_base
from live_server import API_KEY

DOCS = [{"context": "reverse 3 1 4 =", "choices": [" 4 1 3", " 3 1 4", " 1 4 3"], "label": 0},
        {"context": "sort 8 2 1 9 =", "choices": [" 9 8 2 1", " 1 2 8 9"], "label": 0},
        {"context": "add 12 35 =", "choices": [" 47", " 46", " 74"], "label": 0}]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_task")
    (root / "docs.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (root / "preft_toy.yaml").write_text("\n".join([
        "task: preft_toy", "dataset_path: json", "dataset_kwargs:", "  data_files:",
        f"    test: {root / 'docs.jsonl'}", "test_split: test", "output_type: multiple_choice",
        'doc_to_text: "{{context}}"', 'doc_to_choice: "{{choices}}"', 'doc_to_target: "{{label}}"',
        "target_delimiter: \"\"", "metric_list:", "  - metric: acc", ""]))
    return root


def _lm_eval(server, task_dir, model_name: str, adapter: str, base_path: str, monkeypatch) -> list[list[float]]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import preft.eval.lm_eval_preft  # noqa: F401  (registers preft-completions)

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model=model_name, tasks=["preft_toy"],  # lm-eval's own tasks left unindexed: 6 s a call
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        model_args=f"base_url={server['url']}/v1/completions,model={adapter},tokenizer={base_path},"
                   "tokenizer_backend=huggingface,tokenized_requests=True,max_retries=1",
        log_samples=True)
    samples = sorted(results["samples"]["preft_toy"], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in sample["resps"]] for sample in samples]


@torch.no_grad()
def _training_scores(model, tokenizer) -> list[list[float]]:
    scores = []
    for doc in DOCS:
        # as lm-eval encodes a pair for a causal model: no BOS, the whole encoded, then split
        context = tokenizer(doc["context"], add_special_tokens=False)["input_ids"]
        row = []
        for choice in doc["choices"]:
            continuation = tokenizer(doc["context"] + choice, add_special_tokens=False)["input_ids"][len(context):]
            ids = torch.tensor([context + continuation])
            labels = ids.clone()
            labels[:, : len(context)] = -100
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).logits[0].float()
            logprobs = logits[len(context) - 1: -1].log_softmax(-1)
            row.append(float(logprobs.gather(-1, torch.tensor(continuation)[:, None]).sum()))
        scores.append(row)
    return scores


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["user1", "reft0"])
def test_lm_eval_scores_a_served_adapter_by_the_rule(server, adapters, base_path, tokenizer, task_dir, monkeypatch,
                                                     adapter):
    expected = _training_scores(PeftModel.from_pretrained(load_base(base_path), adapters / adapter).eval(), tokenizer)
    by_rule = _lm_eval(server, task_dir, "preft-completions", adapter, base_path, monkeypatch)
    stock = _lm_eval(server, task_dir, "local-completions", adapter, base_path, monkeypatch)
    for got, want in zip(by_rule, expected):
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (got, want)
    assert max(abs(a - b) for g, w in zip(stock, expected) for a, b in zip(g, w)) > 1e-3  # scored all-token
