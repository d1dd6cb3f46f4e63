"""ReFT-P in the real vLLM engine equals the HF reference token for token (float32).

One batch mixes a LoReFT-P bundle, a DiReFT-P bundle with adapter_start=2, three LoRA-P bundles
and the bare base model; with default scheduling (twice: the second round hits the prefix
cache for the unsalted requests) and with chunked prefill forced by an 8-token step budget.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model

import preft
from conftest import hf_greedy, load_base, strengthen_reft
from preft.export import export_adapter
from test_engine_lora_p import NEW_TOKENS, PROMPTS, run_engine

ADAPTERS = {
    "lo": (lambda: preft.PreftReftConfig(rank=4, layers=[0, 2], intervention="loreft", init_weights=False), True),
    "di": (lambda: preft.PreftReftConfig(rank=2, layers=[1, 3], intervention="direft", init_weights=False,
                                         adapter_start=2), True),
    "lora": (lambda: preft.PreftLoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False), False),
    "lora2": (lambda: preft.PreftLoraConfig(r=4, lora_alpha=32, target_modules=["o_proj", "down_proj"],
                                            init_lora_weights=False, adapter_start=1), False),
    "lora3": (lambda: preft.PreftLoraConfig(r=8, lora_alpha=16, init_lora_weights=False), False),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, base_path, tokenizer):
    root = tmp_path_factory.mktemp("reft")
    models = {None: load_base(base_path)}
    for seed, (name, (make_config, _)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(200 + seed)
        model = strengthen_reft(get_peft_model(load_base(base_path), make_config()))
        model.save_pretrained(root / name)
        export_adapter(root / name, base_path, root / f"{name}.bundle")
        models[name] = PeftModel.from_pretrained(load_base(base_path), root / name).eval()
    requests, reference = [], []
    for prompt in PROMPTS:
        for name in [*ADAPTERS, None]:
            is_reft = bool(name) and ADAPTERS[name][1]
            requests.append({"prompt": prompt, "adapter": name, "reft": is_reft,
                             "bundle": str(root / f"{name}.bundle") if name else None})
            reference.append(hf_greedy(models[name], tokenizer, prompt, NEW_TOKENS))
    base = {r["prompt"]: t for r, t in zip(requests, reference) if r["adapter"] is None}
    assert any(t != base[r["prompt"]] for r, t in zip(requests, reference) if r["reft"])
    return requests, reference


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine, rounds",
    [
        ({"enable_lora": True, "max_loras": 3, "max_lora_rank": 8}, 2),
        ({"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_num_batched_tokens": 8,
          "max_num_seqs": 4}, 1),
    ],
    ids=["mixed-batch+prefix-cache", "chunked-prefill"],
)
def test_engine_reft_matches_hf_reference(setup, base_path, tmp_path, engine, rounds):
    requests, reference = setup
    for round_tokens in run_engine(base_path, tmp_path, requests, engine, rounds):
        mismatches = [(r["prompt"], r["adapter"], got, want)
                      for r, got, want in zip(requests, round_tokens, reference) if got != want]
        assert not mismatches, mismatches[:3]
