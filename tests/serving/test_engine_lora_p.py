"""LoRA-P in the real vLLM engine equals the HF reference token for token (float32).

One batch mixes three LoRA-P adapters (one with adapter_start=3), an all-token LoRA and the
bare base model; run with default scheduling, with chunked prefill forced by a tiny token
budget, with fewer adapter slots than adapters, and twice (the second round hits the prefix
cache). The HF reference is itself checked against the independent one (``tests/reference``).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

import preft
from conftest import hf_greedy, load_base, strengthen_reft
from preft.constants import ALL_PROJECTIONS
from preft.export import export_adapter
from engine_pool import shared_pool
from reference.independent import greedy_each

NEW_TOKENS = 8
PROMPTS = ["add 12 35 =", "reverse 3 1 4 1 5 9 2 6 =", "the quiet", "a=7 b=2 c=9 d=4 ; c =", "sort 8 2 1 9 ="]
TARGETS = list(ALL_PROJECTIONS)
ADAPTERS = {
    "alice": lambda: preft.PreftLoraConfig(r=8, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False),
    "bob": lambda: preft.PreftLoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"],
                                         init_lora_weights=False),
    "carol": lambda: preft.PreftLoraConfig(r=4, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False,
                                           adapter_start=3),
    "dave_all_token": lambda: LoraConfig(r=8, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False),
}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, base_path):
    root = tmp_path_factory.mktemp("adapters")
    paths = {}
    for seed, (name, make_config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        get_peft_model(load_base(base_path), make_config()).save_pretrained(root / name)
        export_adapter(root / name, base_path, root / f"{name}.bundle")
        paths[name] = (root / name, root / f"{name}.bundle")
    return paths


@pytest.fixture(scope="module")
def requests_and_reference(bundles, base_path, tokenizer):
    requests, reference = [], []
    for index, prompt in enumerate(PROMPTS):
        for name in [*ADAPTERS, None]:
            if (index + len(name or "")) % 2 and name is not None and index > 1:
                continue  # a mixed batch, not the full cross product
            requests.append({"prompt": prompt, "adapter": name, "bundle": str(bundles[name][1]) if name else None})
    models = {None: load_base(base_path)}
    for name, (adapter_dir, _) in bundles.items():
        models[name] = PeftModel.from_pretrained(load_base(base_path), adapter_dir).eval()
    reference = [hf_greedy(models[r["adapter"]], tokenizer, r["prompt"], NEW_TOKENS) for r in requests]
    # the adapters matter: a prefill-only adapter's tokens differ from the base model's
    base_tokens = {r["prompt"]: t for r, t in zip(requests, reference) if r["adapter"] is None}
    assert any(t != base_tokens[r["prompt"]] for r, t in zip(requests, reference) if r["adapter"])
    # and the HF reference is the rule's: it equals the independent one (tests/reference), which
    # shares no code with the project, so a wrong rule cannot move the engine and this together
    cases = [(r["adapter"], tokenizer(r["prompt"])["input_ids"]) for r in requests]
    assert greedy_each(load_base(base_path), {name: dirs[0] for name, dirs in bundles.items()}, cases, NEW_TOKENS,
                       never=(tokenizer.eos_token_id,)) == reference
    return requests, reference


def run_engine(base_path, tmp_path, requests, engine, rounds=1, new_tokens=NEW_TOKENS, metrics=None,
               sequential=False, env=None, log=None):
    """Greedy tokens of ``requests`` from the session's engine of this configuration, its prefix
    cache emptied first (:mod:`engine_pool`; per round: the same batch again, hitting the prefix
    cache). A request names its adapter and bundle; ``reft`` marks a ReFT-P bundle. ``metrics``
    (a dict) receives what vLLM's counters moved by (needs ``disable_log_stats=False``); ``log``
    (a list) what the engine logged meanwhile."""
    pool = shared_pool()
    driver_requests = []
    for request in requests:
        entry = {"prompt": request["prompt"]}
        if request.get("reft"):
            entry["reft"] = request["bundle"]
        elif request.get("adapter"):
            entry["lora"] = [request["adapter"], pool.lora_id(request["bundle"]), request["bundle"]]
        driver_requests.append(entry)
    driver = pool.get(base_path, engine, env=env)
    before = driver.metrics() if metrics is not None else None
    logged_from = len(driver.log_tail(chars=10**9))
    results = [driver.generate(driver_requests, new_tokens, sequential=sequential)["tokens"] for _ in range(rounds)]
    if log is not None:
        log.append(driver.log_tail(chars=10**9)[logged_from:])
    if metrics is not None:
        after = driver.metrics()
        metrics.update({key: after[key] - before[key] for key in after})
    return results


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine, rounds",
    [
        ({"enable_lora": True, "max_loras": 4, "max_lora_rank": 8}, 2),
        # chunked prefill (8-token budget) with fewer adapter slots than adapters in flight
        ({"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_num_batched_tokens": 8,
          "max_num_seqs": 4}, 1),
    ],
    ids=["mixed-batch+prefix-cache", "chunked-prefill+2-slots"],
)
def test_engine_matches_hf_reference(requests_and_reference, base_path, tmp_path, engine, rounds):
    requests, reference = requests_and_reference
    results = run_engine(base_path, tmp_path, requests, engine, rounds)
    for round_tokens in results:
        mismatches = [(r["prompt"], r["adapter"], got, want)
                      for r, got, want in zip(requests, round_tokens, reference) if got != want]
        assert not mismatches, mismatches[:3]


@pytest.mark.slow
def test_without_the_plugin_the_engine_disagrees(requests_and_reference, base_path, tmp_path, monkeypatch):
    """The parity test has teeth: with the PreFT plugin filtered out (stock vLLM 0.32), the
    prefill-only requests come out different (the adapter runs on generated tokens too, and
    the stock CPU ops give 'no adapter' rows the last adapter's weights)."""
    requests, reference = requests_and_reference
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")  # every plugin but preft's
    tokens = run_engine(base_path, tmp_path, requests, {"enable_lora": True, "max_loras": 4, "max_lora_rank": 8})[0]
    prefill_only = [i for i, r in enumerate(requests) if r["adapter"] in ("alice", "bob", "carol")]
    assert any(tokens[i] != reference[i] for i in prefill_only)
    # the base model's requests, batched with adapter requests, got the last slot's adapter
    base_rows = [i for i, r in enumerate(requests) if r["adapter"] is None]
    assert base_rows and any(tokens[i] != reference[i] for i in base_rows)


@pytest.mark.slow
def test_preemption_recompute_keeps_the_rule(bundles, base_path, tokenizer, tmp_path):
    """A KV cache of 3 blocks (128 tokens each on CPU) for 8 requests that each grow past one
    block: running requests are preempted and recomputed (prompt and generated tokens at once);
    tokens still equal the HF reference."""
    new_tokens = 120
    names = ["alice", "carol", None, "bob"]
    requests = [{"prompt": PROMPTS[i % len(PROMPTS)], "adapter": names[i % 4],
                 "bundle": str(bundles[names[i % 4]][1]) if names[i % 4] else None} for i in range(8)]
    models = {None: load_base(base_path)}
    models.update({n: PeftModel.from_pretrained(load_base(base_path), bundles[n][0]).eval() for n in names if n})
    reference = [hf_greedy(models[r["adapter"]], tokenizer, r["prompt"], new_tokens) for r in requests]
    metrics: dict = {}
    engine = {"enable_lora": True, "max_loras": 3, "max_lora_rank": 8, "num_gpu_blocks_override": 3,
              "max_model_len": 256, "disable_log_stats": False}
    tokens = run_engine(base_path, tmp_path, requests, engine, new_tokens=new_tokens, metrics=metrics)[0]
    assert metrics["preemptions"] > 0, "the engine was expected to preempt"
    mismatches = [(r["prompt"], r["adapter"]) for r, got, want in zip(requests, tokens, reference) if got != want]
    assert not mismatches, mismatches


@pytest.mark.slow
def test_decoding_requests_hold_no_adapter_slot(bundles, base_path, tokenizer, tmp_path, monkeypatch):
    """With one adapter slot, stock vLLM runs one adapter's requests at a time; with PreFT a
    request that finished its prompt decodes on the base model and frees the slot, so several
    adapters' requests run at once, and every answer still equals the HF reference."""
    new_tokens = 40
    names = ["alice", "bob", "carol"]
    requests = [{"prompt": PROMPTS[i % len(PROMPTS)], "adapter": names[i % 3], "bundle": str(bundles[names[i % 3]][1])}
                for i in range(6)]
    models = {n: PeftModel.from_pretrained(load_base(base_path), bundles[n][0]).eval() for n in names}
    reference = [hf_greedy(models[r["adapter"]], tokenizer, r["prompt"], new_tokens) for r in requests]
    trace = tmp_path / "scheduler.trace"
    monkeypatch.setenv("PREFT_TRACE_SCHEDULER", str(trace))
    engine = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}
    tokens = run_engine(base_path, tmp_path, requests, engine, new_tokens=new_tokens)[0]
    assert tokens == reference
    steps = [[int(v) for v in line.split()] for line in trace.read_text().splitlines()]
    assert max(running for _, running, _ in steps) > 1, "decoding requests should not hold the single adapter slot"
    # what holds a slot is what the simulator counts: at most max_loras adapters still active
    assert max(active for _, _, active in steps) == 1
    # the adapter-group admission order (preft serve --scheduler groups) keeps the tokens and the bound
    driver = shared_pool().get(base_path, engine)
    trace.unlink()
    try:
        assert driver.set_scheduler({"name": "groups"})["admission"] == "groups"
        assert run_engine(base_path, tmp_path, requests, engine, new_tokens=new_tokens)[0] == reference
    finally:
        driver.set_scheduler({"name": "default"})
    steps = [[int(v) for v in line.split()] for line in trace.read_text().splitlines()]
    assert max(running for _, running, _ in steps) > 1 and max(active for _, _, active in steps) == 1


@pytest.mark.slow
def test_blocks_before_adapter_start_are_shared(base_path, tokenizer, tmp_path):
    """A 200-token prompt: its first KV block (128 tokens on CPU) lies wholly before
    adapter_start=128, so it is base-model KV, shared by the base model, LoRA-P and ReFT-P
    requests that start there; adapters starting at 0 get their own keyed blocks. Sequential
    requests, so every hit is counted: expect 4 block hits, and every answer equal to HF."""
    from preft.data import pretraining_corpus

    text = " ".join(pretraining_corpus(60, seed=11))
    prompt = tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:200])
    configs = {
        "lora_late": preft.PreftLoraConfig(r=8, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False,
                                           adapter_start=128),
        "lora_early": preft.PreftLoraConfig(r=8, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False),
        "reft_late": preft.PreftReftConfig(rank=4, init_weights=False, adapter_start=128),
        "reft_early": preft.PreftReftConfig(rank=4, init_weights=False),
    }
    models, bundle = {None: load_base(base_path)}, {}
    for seed, (name, config) in enumerate(configs.items()):
        torch.manual_seed(300 + seed)
        strengthen_reft(get_peft_model(load_base(base_path), config)).save_pretrained(tmp_path / name)
        export_adapter(tmp_path / name, base_path, tmp_path / f"{name}.bundle")
        bundle[name] = str(tmp_path / f"{name}.bundle")
        models[name] = PeftModel.from_pretrained(load_base(base_path), tmp_path / name).eval()
    order = [None, "lora_late", "lora_early", "lora_early", "reft_late", "reft_early", None]
    requests = [{"prompt": prompt, "adapter": n, "bundle": bundle.get(n), "reft": bool(n) and n.startswith("reft")}
                for n in order]
    reference = {name: hf_greedy(model, tokenizer, prompt, NEW_TOKENS) for name, model in models.items()}
    metrics: dict = {}
    engine = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_model_len": 512,
              "disable_log_stats": False}
    tokens = run_engine(base_path, tmp_path, requests, engine, metrics=metrics, sequential=True)[0]
    assert [t == reference[r["adapter"]] for r, t in zip(requests, tokens)] == [True] * len(order)
    hits = metrics["prefix_hits"]
    # hits: lora_late (base block), the second lora_early, reft_late (base block), the last base
    assert hits == 4 * 128
