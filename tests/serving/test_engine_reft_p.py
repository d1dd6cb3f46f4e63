"""ReFT-P in the real vLLM engine equals the HF reference token for token (float32).

One batch mixes a LoReFT-P bundle, a DiReFT-P bundle with adapter_start=2, three LoRA-P bundles
and the bare base model; with default scheduling (twice: the second round hits the prefix
cache, ReFT-P blocks keyed by their bundle) and with chunked prefill forced by an 8-token step budget.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel, get_peft_model

import preft
from conftest import hf_greedy, load_base, strengthen_reft
from reference.independent import greedy_each
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
    # the HF reference equals the independent one (tests/reference), which shares no code with
    # the project: a wrong rule or formula cannot move the engine and this together
    cases = [(r["adapter"], tokenizer(r["prompt"])["input_ids"]) for r in requests]
    assert greedy_each(load_base(base_path), {name: root / name for name in ADAPTERS}, cases, NEW_TOKENS,
                       never=(tokenizer.eos_token_id,)) == reference
    return requests, reference


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine, rounds",
    [
        ({"enable_lora": True, "max_loras": 4, "max_lora_rank": 8}, 2),  # the LoRA-P parity test's engine
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


def all_token(model):
    """The same adapter applied to every token (what `preft serve --all-token` serves)."""
    from preft.tuners.reft_p.layer import ReftLayer

    for module in model.modules():
        if isinstance(module, ReftLayer):
            module.prefill_only = {name: False for name in module.prefill_only}
    return model


@pytest.mark.slow
def test_all_token_applies_to_reft_p_bundles(tmp_path, base_path, tokenizer):
    """``PREFT_ALL_TOKEN=1`` (``preft serve --all-token``) serves a ReFT-P bundle on every
    token, like LoRA bundles; without it the same bundle is prefill-only. Each run equals its
    own HF reference, and the two references differ (the flag has an effect to check)."""
    torch.manual_seed(7)
    config = preft.PreftReftConfig(rank=4, layers=[0, 1, 2, 3], intervention="loreft", init_weights=False,
                                   adapter_start=1)
    strengthen_reft(get_peft_model(load_base(base_path), config)).save_pretrained(tmp_path / "reft")
    export_adapter(tmp_path / "reft", base_path, tmp_path / "reft.bundle")
    model = PeftModel.from_pretrained(load_base(base_path), tmp_path / "reft").eval()
    prefill_only = [hf_greedy(model, tokenizer, prompt, NEW_TOKENS) for prompt in PROMPTS]
    every_token = [hf_greedy(all_token(model), tokenizer, prompt, NEW_TOKENS) for prompt in PROMPTS]
    assert prefill_only != every_token
    requests = [{"prompt": p, "adapter": "reft", "reft": True, "bundle": str(tmp_path / "reft.bundle")}
                for p in PROMPTS]
    engine = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_num_batched_tokens": 8,
              "max_num_seqs": 4}  # chunked prefill too (the chunked-prefill parity tests' engine)
    assert run_engine(base_path, tmp_path, requests, engine)[0] == prefill_only
    assert run_engine(base_path, tmp_path, requests, engine, env={"PREFT_ALL_TOKEN": "1"})[0] == every_token


@pytest.mark.slow
def test_more_reft_bundles_than_slots(tmp_path, base_path, tokenizer):
    """Five ReFT-P bundles on a 2-slot engine (``PREFT_REFT_SLOTS=2``): the scheduler lets at most
    two bundles' prompt tokens into a step, the bank evicts the least recently used bundle for
    the next (never growing), and every answer equals HF's, over two rounds."""
    requests, reference = [], []
    for index in range(5):
        torch.manual_seed(400 + index)
        config = preft.PreftReftConfig(rank=2 + index % 3, layers=[index % 4, (index + 2) % 4],
                                       intervention=("loreft", "direft")[index % 2], init_weights=False,
                                       adapter_start=index % 2)
        strengthen_reft(get_peft_model(load_base(base_path), config)).save_pretrained(tmp_path / f"r{index}")
        export_adapter(tmp_path / f"r{index}", base_path, tmp_path / f"r{index}.bundle")
        model = PeftModel.from_pretrained(load_base(base_path), tmp_path / f"r{index}").eval()
        for prompt in PROMPTS[index % 2::2]:
            requests.append({"prompt": prompt, "adapter": f"r{index}", "reft": True,
                             "bundle": str(tmp_path / f"r{index}.bundle")})
            reference.append(hf_greedy(model, tokenizer, prompt, NEW_TOKENS))
    log: list[str] = []
    rounds = run_engine(base_path, tmp_path, requests, {"max_num_seqs": 8}, rounds=2, env={"PREFT_REFT_SLOTS": "2"},
                        log=log)
    for tokens in rounds:
        mismatches = [(r["adapter"], r["prompt"]) for r, got, want in zip(requests, tokens, reference) if got != want]
        assert not mismatches, mismatches
    assert log and "growing it" not in log[0]
