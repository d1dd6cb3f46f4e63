"""A prefill chunk policy changes timing, never tokens.

One engine (its core in-process, so the test switches the policy between batches) serves one
mixed batch (LoRA-P, LoRA-P starting at position 3, all-token LoRA, ReFT-P, the base model;
short and 150-token prompts) under vLLM's default, fixed chunks and SLOWeave with a tight and a
very tight TPOT target. Every policy's greedy tokens equal the HF reference (float32), and the
engine's step trace shows each policy did what it says: fixed chunks never exceed their size,
and SLOWeave runs decode-only steps while prefill waits when no chunk fits its deadline.
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

import preft
from conftest import hf_greedy, load_base, strengthen_reft
from preft.constants import ALL_PROJECTIONS
from preft.data import pretraining_corpus
from preft.export import export_adapter
from preft.serving.engine_driver import EngineProcess
from preft.serving.scheduling.cost_model import StepCostModel

NEW_TOKENS = 12
TARGETS = list(ALL_PROJECTIONS)
CONFIGS = {
    "lora_p": lambda: preft.PreftLoraConfig(r=8, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False),
    "lora_p_late": lambda: preft.PreftLoraConfig(r=8, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False,
                                                 adapter_start=3),
    "lora_all": lambda: LoraConfig(r=8, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False),
    "reft_p": lambda: preft.PreftReftConfig(rank=4, init_weights=False),
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory, base_path, tokenizer):
    root = tmp_path_factory.mktemp("policies")
    models, bundles = {None: load_base(base_path)}, {}
    for seed, (name, make) in enumerate(CONFIGS.items()):
        torch.manual_seed(500 + seed)
        strengthen_reft(get_peft_model(load_base(base_path), make())).save_pretrained(root / name)
        export_adapter(root / name, base_path, root / f"{name}.bundle")
        bundles[name] = str(root / f"{name}.bundle")
        models[name] = PeftModel.from_pretrained(load_base(base_path), root / name).eval()
    text = " ".join(pretraining_corpus(80, seed=21))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = ["add 12 35 =", "the quiet", tokenizer.decode(ids[:150]), "sort 8 2 1 9 =", tokenizer.decode(ids[150:300])]
    names = [None, *CONFIGS]
    requests, driver_requests = [], []
    for index in range(10):
        prompt, name = prompts[index % len(prompts)], names[index % len(names)]
        requests.append((prompt, name))
        entry = {"prompt": prompt}
        if name == "reft_p":
            entry["reft"] = bundles[name]
        elif name:
            entry["lora"] = [name, 1 + list(CONFIGS).index(name), bundles[name]]
        driver_requests.append(entry)
    reference = [hf_greedy(models[name], tokenizer, prompt, NEW_TOKENS) for prompt, name in requests]
    cost_models = {"synthetic": str(StepCostModel.synthetic().save(root / "synthetic_cost.json")),
                   # 10 ms per prefill token, nothing else: at a 500 ms TPOT about 49 tokens fit
                   "per_token": str(StepCostModel([0, 0, 0, 0, 0.01, 0, 0, 0]).save(root / "per_token_cost.json"))}
    return driver_requests, reference, cost_models


POLICIES = [
    {"name": "default"},
    {"name": "fixed:16"},
    {"name": "fixed:3"},
    {"name": "sloweave", "tpot_ms": 500.0, "max_chunk": 64, "cost_model": "per_token"},
    {"name": "sloweave", "tpot_ms": 0.5, "cost_model": "synthetic"},  # no chunk fits beside a decode
]


@pytest.mark.slow
def test_every_chunk_policy_gives_the_default_tokens(batch, base_path, tmp_path):
    requests, reference, cost_models = batch
    trace = tmp_path / "steps.jsonl"
    engine = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 8, "max_model_len": 256, "max_num_seqs": 16}
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PREFT_STEP_TRACE": str(trace)}
    steps = {}
    with EngineProcess(base_path, engine, env=env, log_path=tmp_path / "engine.log") as driver:
        for spec in POLICIES:
            spec = {**spec, "cost_model": cost_models[spec["cost_model"]]} if "cost_model" in spec else spec
            trace.unlink(missing_ok=True)
            name = driver.set_scheduler(spec)["scheduler"]
            tokens = driver.generate(requests, NEW_TOKENS)["tokens"]
            mismatches = [i for i, (got, want) in enumerate(zip(tokens, reference)) if got != want]
            assert not mismatches, f"{spec}: requests {mismatches} differ from HF"
            steps[f"{name}@{spec.get('tpot_ms')}"] = [json.loads(line) for line in trace.read_text().splitlines()]
    assert max(s["c"] for s in steps["default@None"]) > 100  # the long prompts go in at once
    for size in (16, 3):
        chunks = [s["c"] for s in steps[f"fixed:{size}@None"]]
        assert max(chunks) == size and all(c <= size for c in chunks)
    assert len(steps["fixed:3@None"]) > len(steps["fixed:16@None"]) > len(steps["default@None"])
    tight = steps["sloweave@0.5"]
    waited = [s for s in tight if s["n"] > 0 and s["budget"] == 0 and s["c"] == 0]
    assert waited, "with a 0.5 ms TPOT no chunk fits beside a decode: decode-only steps expected"
    assert all(s["c"] <= (s["budget"] or 0) for s in tight if s["n"] > 0)
    moderate = steps["sloweave@500.0"]
    beside = [s for s in moderate if s["n"] > 0 and s["c"] > 0]
    assert beside and all(0 < s["budget"] < 64 for s in beside)  # sized by the deadline, under C_max
    assert all(s["c"] <= s["budget"] for s in moderate)
