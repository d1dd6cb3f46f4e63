"""A scheduling policy changes timing, never tokens.

One engine (its core in-process, so the tests switch the policies between batches; a KV cache
of 10 blocks of 128 tokens) serves:

- one mixed batch (LoRA-P, LoRA-P starting at position 3, all-token LoRA, ReFT-P, the base
  model; short and 150-token prompts) under vLLM's default, fixed chunks and SLOWeave with a
  tight and a very tight TPOT target, and with no cost model file (learned online). Every
  policy's greedy tokens equal the HF reference (float32), and the engine's step trace shows each policy did what it says: fixed chunks never
  exceed their size, and SLOWeave runs decode-only steps while prefill waits when no chunk fits
  its deadline;
- one prefix batch (prompts behind two shared 128-token system prompts, and prompts that grow
  past a block while decoding, more than the cache holds) under the admission orders FCFS,
  LPM, Feather and Feather+SLOWeave: the tokens equal HF's, each run had prefix-cache hits (and,
  but for SLOWeave's, preemptions), and Feather's learned table is written to its state file.
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
from reference.independent import greedy_each
from preft.eval.harness.engine_driver import EngineProcess
from preft.serving.scheduling.cost_model import StepCostModel
from preft.serving.scheduling.online_cost_model import OnlineCostModel

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
    # the HF reference is the rule's: it equals the independent one (tests/reference)
    cases = [(name, tokenizer(prompt)["input_ids"]) for prompt, name in requests]
    assert greedy_each(load_base(base_path), {n: root / n for n in CONFIGS}, cases, NEW_TOKENS,
                       never=(tokenizer.eos_token_id,)) == reference
    cost_models = {"synthetic": str(StepCostModel.synthetic().save(root / "synthetic_cost.json")),
                   # 10 ms per prefill token, nothing else: at a 500 ms TPOT about 49 tokens fit
                   "per_token": str(StepCostModel([0, 0, 0, 0, 0.01, 0, 0, 0]).save(root / "per_token_cost.json"))}
    return driver_requests, reference, cost_models


POLICIES = [
    {"name": "default"},
    {"name": "fixed:16"},
    {"name": "fixed:3"},
    {"name": "sloweave", "tpot_ms": 500.0, "max_chunk": 64, "cost_model": "per_token"},
    {"name": "sloweave", "tpot_ms": 400.0, "max_chunk": 64, "cost_state": "online"},  # no file: learned online
    {"name": "sloweave", "tpot_ms": 0.5, "cost_model": "synthetic"},  # no chunk fits beside a decode
]


@pytest.fixture(scope="module")
def engine(base_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("policy_engine")
    trace = root / "steps.jsonl"
    engine = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 8, "max_model_len": 256, "max_num_seqs": 16,
              "num_gpu_blocks_override": 10, "disable_log_stats": False}
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PREFT_STEP_TRACE": str(trace)}
    with EngineProcess(base_path, engine, env=env, log_path=root / "engine.log") as driver:
        yield driver, trace


@pytest.mark.slow
def test_every_chunk_policy_gives_the_default_tokens(batch, engine):
    requests, reference, cost_models = batch
    driver, trace = engine
    steps = {}
    for spec in POLICIES:
        spec = {**spec, "cost_model": cost_models[spec["cost_model"]]} if "cost_model" in spec else spec
        spec = {**spec, "cost_state": str(trace.with_name("online_cost.json"))} if "cost_state" in spec else spec
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
    # sized by the deadline: about 49 tokens fit a request's next-token deadline, more once its mean
    # TPOT has built up slack (decode steps here take ~15 ms of the 500), never past C_max
    assert beside and all(0 < s["budget"] <= 64 for s in beside)
    assert all(s["c"] <= s["budget"] for s in moderate)
    # SLOWeave with no cost model file: its online model left the conservative prior for a fit of
    # this engine's steps (written when the next policy took over), which predicts them better
    online = steps["sloweave@400.0"]
    state = json.loads(trace.with_name("online_cost.json").read_text())
    prior = OnlineCostModel.conservative_prior()
    assert state["fits"] >= 1 and state["weights"] != prior.weights and 0 < len(state["steps"]) <= len(online)
    assert all(s["c"] <= s["budget"] for s in online if s["budget"] is not None)
    fitted = [s for s in online[len(online) // 2:] if s["c"] or s["n"]]

    def median_error(predict):
        errors = sorted(abs(predict(s) - s["seconds"]) / s["seconds"] for s in fitted)
        return errors[len(errors) // 2]

    assert median_error(lambda s: s["predicted_s"]) < median_error(lambda s: prior(s["n"], s["c"], s["x"]))


@pytest.fixture(scope="module")
def prefix_batch(batch, tokenizer):
    """Prompts behind two shared system prompts of one full block or more (prefix hits), and
    prompts of 116-126 tokens that cross a 128-token block while decoding (preemptions)."""
    driver_requests, _, _ = batch
    entries = {entry["lora"][0] if "lora" in entry else ("reft_p" if "reft" in entry else None): entry
               for entry in driver_requests}
    text = " ".join(pretraining_corpus(160, seed=33))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    systems = [tokenizer.decode(ids[0:140]), tokenizer.decode(ids[140:280])]
    assert all(len(tokenizer(s)["input_ids"]) >= 130 for s in systems)
    suffixes = ["add 1 2 =", "sort 3 1 =", "the cat", "b=4 ; b ="]
    crossing = []
    start = 300
    while len(crossing) < 4:
        prompt = tokenizer.decode(ids[start:start + 120])
        if 116 <= len(tokenizer(prompt)["input_ids"]) <= 126:
            crossing.append(prompt)
        start += 120
    prompts = [f"{systems[i % 2]} {suffixes[i % 4]}" for i in range(12)] + crossing
    adapters = [None, "lora_p", "lora_p_late", "reft_p"]
    requests = []
    for index, prompt in enumerate(prompts):
        entry = dict(entries[adapters[index % 4]]) if adapters[index % 4] else {}
        requests.append({**{k: v for k, v in entry.items() if k != "prompt"}, "prompt": prompt})
    return requests


ADMISSION_ORDERS = [
    {"name": "default"},
    {"name": "lpm"},
    {"name": "feather", "feather_state": "STATE"},
    {"name": "feather+sloweave", "tpot_ms": 500.0, "max_chunk": 64, "cost_model": "per_token"},
]


@pytest.mark.slow
def test_every_admission_order_gives_the_default_tokens(batch, prefix_batch, engine, base_path, tokenizer,
                                                        tmp_path):
    _, _, cost_models = batch
    driver, trace = engine
    models = {None: load_base(base_path)}
    reference = []
    for request in prefix_batch:
        name = request.get("lora", [None])[0] if "lora" in request else ("reft" if "reft" in request else None)
        if name not in models:
            path = request["lora"][2] if "lora" in request else request["reft"]
            models[name] = PeftModel.from_pretrained(load_base(base_path), path.replace(".bundle", "")).eval()
        reference.append(hf_greedy(models[name], tokenizer, request["prompt"], NEW_TOKENS))
    state = tmp_path / "feather.json"
    for spec in ADMISSION_ORDERS:
        spec = {**spec, "cost_model": cost_models[spec["cost_model"]]} if "cost_model" in spec else spec
        spec = {**spec, "cost_state": str(trace.with_name("online_cost.json"))} if "cost_state" in spec else spec
        spec = {**spec, "feather_state": str(state)} if "feather_state" in spec else spec
        trace.unlink(missing_ok=True)
        before = driver.metrics()
        answer = driver.set_scheduler(spec)
        tokens = driver.generate(prefix_batch, NEW_TOKENS)["tokens"]
        after = driver.metrics()
        mismatches = [i for i, (got, want) in enumerate(zip(tokens, reference)) if got != want]
        assert not mismatches, f"{spec}: requests {mismatches} differ from HF"
        assert after["prefix_hits"] > before["prefix_hits"], f"{spec}: no prefix-cache hit"
        if "+" not in spec["name"]:  # (SLOWeave's small chunks admit slowly: fewer decodes to preempt)
            assert after["preemptions"] > before["preemptions"], f"{spec}: no preemption"
        steps = [json.loads(line) for line in trace.read_text().splitlines()]
        assert {s["admission"] for s in steps} == {answer["admission"]} == {spec["name"].split("+")[0]
                                                                             .replace("default", "fcfs")}
        if "sloweave" in spec["name"]:
            assert all(s["c"] <= s["budget"] for s in steps)
    driver.set_scheduler({"name": "default"})  # the outgoing Feather order writes its table
    table = json.loads(state.read_text())["table"]
    assert table and all(n > 0 for _, _, _, n in table), "Feather made and credited no decision"
