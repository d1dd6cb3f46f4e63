"""Adapters on first use (``preft serve --resolve-adapters``) and the per-adapter ``/metrics``,
on the live server: its adapter root holds a thousand LoRA-P bundles that it was never told of."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from conftest import load_base
from live_server import MAX_HOST_ADAPTERS, PROMPTS, client, complete, post, scrape

MANY = 1000
SAMPLE = (0, 517, 999)  # the bundles compared with HF
TEMPLATE = "user0"  # a LoRA-P adapter of the live server's root: its config, other weights


def perturbed(tensors: dict, index: int) -> dict:
    generator = torch.Generator().manual_seed(index)
    return {key: value + 0.5 * value.std() * torch.randn(value.shape, generator=generator)
            for key, value in tensors.items()}


@pytest.fixture(scope="module")
def many(adapters, tmp_path_factory, base_path, tokenizer):
    """``r0000`` .. ``r0999`` under the server's adapter root, each user0's bundle with its own
    weights; the HF reference of the sampled ones (from PEFT directories with the same weights)."""
    bundle, trained = adapters / f"{TEMPLATE}.bundle", adapters / TEMPLATE
    weights = load_file(str(bundle / "adapter_model.safetensors"))
    assert weights.keys() == load_file(str(trained / "adapter_model.safetensors")).keys()
    peft_dirs = tmp_path_factory.mktemp("many_peft")
    for index in range(MANY):
        target = adapters / f"r{index:04d}"
        target.mkdir()
        for name in ("preft_manifest.json", "adapter_config.json"):
            shutil.copyfile(bundle / name, target / name)
        own = perturbed(weights, index)
        save_file(own, str(target / "adapter_model.safetensors"))
        if index in SAMPLE:
            shutil.copytree(trained, peft_dirs / f"r{index:04d}")
            save_file(own, str(peft_dirs / f"r{index:04d}" / "adapter_model.safetensors"))
    reference = {}
    with torch.no_grad():
        for index in SAMPLE:
            model = PeftModel.from_pretrained(load_base(base_path), peft_dirs / f"r{index:04d}").eval()
            for prompt in PROMPTS[:2]:
                ids = tokenizer(prompt, return_tensors="pt")
                out = model.generate(**ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
                reference[(f"r{index:04d}", prompt)] = tokenizer.decode(out[0, ids["input_ids"].shape[1]:],
                                                                       skip_special_tokens=True)
    return reference


def metric(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.slow
def test_a_thousand_bundles_on_disk_are_served_on_first_use_with_the_right_tokens(server, many, reference, tokenizer):
    before = scrape(server)
    # eight concurrent first requests for one name load it once
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: complete(server, "r0517", PROMPTS[0]), range(8)))
    assert answers == [many[("r0517", PROMPTS[0])]] * 8
    for name in ("r0000", "r0999", "r0517"):
        for prompt in PROMPTS[:2]:
            assert complete(server, name, prompt) == many[(name, prompt)], (name, prompt)
    assert any(many[(name, PROMPTS[0])] != reference[(None, PROMPTS[0])] for name in ("r0000", "r0517", "r0999"))
    after = scrape(server)
    assert metric(after, "preft_adapter_cache_loads_total", cache="store", kind="lora") \
        - metric(before, "preft_adapter_cache_loads_total", cache="store", kind="lora") == 3
    assert metric(after, "preft_adapter_requests_total", adapter="r0517") == 10
    assert metric(after, "preft_adapter_requests_total", adapter="r0000") == 2
    assert metric(after, "preft_adapter_prompt_tokens_total", adapter="r0000") == sum(
        len(tokenizer(prompt)["input_ids"]) for prompt in PROMPTS[:2])
    assert metric(after, "preft_adapter_generation_tokens_total", adapter="r0517") == 10 * 6
    assert metric(after, "preft_adapter_time_to_first_token_seconds_count", adapter="r0517") == 10
    assert metric(after, "preft_adapter_time_per_output_token_seconds_count", adapter="r0517") == 10
    assert 0 < metric(after, "preft_adapter_time_to_first_token_seconds_sum", adapter="r0517") < 10 * 60
    assert "r0001" not in {model.id for model in client(server).models.list().data}  # only what was used


@pytest.mark.slow
def test_the_host_cache_and_slots_evict_and_a_reused_adapter_still_answers_right(server, many, reference):
    names = [f"user{i}" for i in range(7)] + ["r0000", "r0517", "r0999"]  # more LoRAs than host cache and slots
    assert len(names) > MAX_HOST_ADAPTERS
    for name in names:
        complete(server, name, PROMPTS[0])
    assert complete(server, "r0000", PROMPTS[1]) == many[("r0000", PROMPTS[1])]
    assert complete(server, "user0", PROMPTS[1]) == reference[("user0", PROMPTS[1])]
    samples = scrape(server)
    for cache in ("host", "slot"):
        assert metric(samples, "preft_adapter_cache_loads_total", cache=cache, kind="lora") >= len(names)
        assert metric(samples, "preft_adapter_cache_evictions_total", cache=cache, kind="lora") >= 1
        assert metric(samples, "preft_adapter_cache_load_seconds_count", cache=cache, kind="lora") \
            == metric(samples, "preft_adapter_cache_loads_total", cache=cache, kind="lora")


@pytest.mark.slow
def test_a_reft_p_bundle_resolves_too(server, adapters, reference):
    shutil.copytree(adapters / "reft1.bundle", adapters / "rz_reft")
    for prompt in PROMPTS[:2]:
        assert complete(server, "rz_reft", prompt) == reference[("reft1", prompt)]
    assert "rz_reft" in {model.id for model in client(server).models.list().data}
    samples = scrape(server)
    assert metric(samples, "preft_adapter_requests_total", adapter="rz_reft") == 2
    assert metric(samples, "preft_adapter_cache_loads_total", cache="slot", kind="reft") >= 1


@pytest.mark.slow
def test_resolving_honours_the_key_and_says_nothing_of_the_disk(server, many, adapters):
    before = metric(scrape(server), "preft_adapter_cache_loads_total", cache="store", kind="lora")
    status, body = post(server, "/v1/completions", {"model": "r0001", "prompt": "x", "max_tokens": 2}, key=None)
    assert status == 401, body
    status, body = post(server, "/v1/completions", {"model": "r0002", "prompt": "x", "max_tokens": 2},
                        key="wrong")
    assert status == 401, body
    assert metric(scrape(server), "preft_adapter_cache_loads_total", cache="store", kind="lora") == before
    for name in ("r5000", "../r0001", "bad", ".stats"):  # none, outside, a folder without a bundle, hidden
        status, body = post(server, "/v1/completions", {"model": name, "prompt": "x", "max_tokens": 2})
        assert status == 404, (name, body)
        assert str(adapters) not in body
    assert metric(scrape(server), "preft_adapter_cache_loads_total", cache="store", kind="lora") == before
    assert {"r0001", "r0002"}.isdisjoint(model.id for model in client(server).models.list().data)


@pytest.mark.slow
def test_a_bad_bundle_on_disk_is_a_400_naming_the_problem_and_others_go_on(server, many, adapters, reference):
    target = adapters / "r_nan"
    shutil.copytree(adapters / "r0004", target)
    tensors = load_file(str(target / "adapter_model.safetensors"))
    key = sorted(tensors)[0]
    save_file({**tensors, key: torch.full_like(tensors[key], float("nan"))}, str(target / "adapter_model.safetensors"))
    with pytest.raises(openai.BadRequestError, match="NaN"):
        complete(server, "r_nan", PROMPTS[0])
    (adapters / "r_rank").mkdir()
    manifest = json.loads((adapters / "r0005" / "preft_manifest.json").read_text())
    (adapters / "r_rank" / "preft_manifest.json").write_text(json.dumps({**manifest, "kind": "lora"}))
    with pytest.raises(openai.BadRequestError, match="no adapter_config.json"):
        complete(server, "r_rank", PROMPTS[0])
    assert complete(server, "user1", PROMPTS[0]) == reference[("user1", PROMPTS[0])]
    samples = scrape(server)
    assert metric(samples, "preft_adapter_request_errors_total", adapter="_unknown") >= 2


@pytest.mark.slow
def test_a_bundle_changed_on_disk_is_served_only_after_an_explicit_reload(server, many, adapters):
    name = "r0999"
    assert complete(server, name, PROMPTS[0]) == many[(name, PROMPTS[0])]
    shutil.copyfile(adapters / "r0000" / "adapter_model.safetensors", adapters / name / "adapter_model.safetensors")
    for prompt in PROMPTS[:2]:
        assert complete(server, name, prompt) == many[(name, prompt)]
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters / name),
                                                          "load_inplace": True})
    assert status == 200, body
    for prompt in PROMPTS[:2]:
        assert complete(server, name, prompt) == many[("r0000", prompt)]
