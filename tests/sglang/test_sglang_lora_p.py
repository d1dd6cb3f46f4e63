"""LoRA-P on SGLang (``preft serve --engine sglang --adapter ...``, float32, the embedded model):
base requests and requests on LoRA-P adapters (``adapter_start`` 2 and 0) and an all-token LoRA,
served together, get the independent reference's greedy tokens; the LoRA-P answers are not the
all-token ones of the same weights (so the rule is what made them equal); and a second turn sent
as the first turn's token ids plus more, on the same adapter, is exact too (SGLang's prefix cache
must not hand it KV decoded without the adapter for positions that are now prompt)."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
import torch
from peft import get_peft_model
from transformers import AutoTokenizer

import preft
from conftest import load_base
from preft.eval.harness.server_process import start_server, stop_server
from preft.export import export_adapter
from reference.independent import greedy_each

pytestmark = pytest.mark.sglang

NEW_TOKENS = 8
PROMPTS = ["add 12 35 =", "reverse 3 1 4 1 5 =", "the quiet", "a=7 b=2 c=9 ; c =", "sort 8 2 1 9 ="]
ADAPTERS = {"start2": dict(adapter_start=2), "start0": dict(adapter_start=0), "all_tokens": dict(prefill_only=False)}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_lora")
    for seed, (name, settings) in enumerate(ADAPTERS.items()):
        torch.manual_seed(11 + seed)
        config = preft.PreftLoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"],
                                       init_lora_weights=False, **settings)
        get_peft_model(load_base(preft.DEFAULT_BASE_MODEL), config).save_pretrained(root / name)
        export_adapter(root / name, preft.DEFAULT_BASE_MODEL, root / f"{name}.bundle")
    args = ["--engine", "sglang", "--model", "default", "--dtype", "float32"]
    for name in ADAPTERS:
        args += ["--adapter", f"{name}={root / (name + '.bundle')}"]
    proc, url, _ = start_server(args, root / "server.log", timeout_s=300)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield client, root
    stop_server(proc)


def complete(client, name, prompt, new_tokens=NEW_TOKENS) -> str:
    body = {"ignore_eos": True, **({"lora_path": name} if name else {})}
    return client.completions.create(model="base", prompt=prompt, max_tokens=new_tokens, temperature=0.0,
                                     extra_body=body).choices[0].text


def test_lora_p_on_sglang_equals_the_independent_reference(served):
    client, root = served
    tokenizer = AutoTokenizer.from_pretrained(preft.DEFAULT_BASE_MODEL)
    cases = [(name, prompt) for name in (None, *ADAPTERS) for prompt in PROMPTS]
    answers = [complete(client, name, prompt) for name, prompt in cases]
    model = load_base(preft.DEFAULT_BASE_MODEL)
    dirs = {name: root / name for name in ADAPTERS}
    reference = greedy_each(model, dirs, [(n, tokenizer(p)["input_ids"]) for n, p in cases], NEW_TOKENS)
    assert answers == [tokenizer.decode(t, skip_special_tokens=True) for t in reference]
    # the control: the same weights on every token answer otherwise, for each LoRA-P adapter
    for name in ("start2", "start0"):
        everywhere = root / f"{name}_everywhere"
        shutil.copytree(root / name, everywhere)
        config = json.loads((everywhere / "adapter_config.json").read_text())
        (everywhere / "adapter_config.json").write_text(json.dumps({**config, "prefill_only": False}))
        all_token = greedy_each(model, {name: everywhere}, [(name, tokenizer(p)["input_ids"]) for p in PROMPTS],
                                NEW_TOKENS)
        served_here = [a for (n, _), a in zip(cases, answers) if n == name]
        assert served_here != [tokenizer.decode(t, skip_special_tokens=True) for t in all_token], name


def test_a_second_turn_on_the_adapter_is_exact(served):
    client, root = served
    tokenizer = AutoTokenizer.from_pretrained(preft.DEFAULT_BASE_MODEL)
    model = load_base(preft.DEFAULT_BASE_MODEL)
    first = tokenizer("reverse 9 8 7 6 5 4 3 2 1 =")["input_ids"]
    answer = greedy_each(model, {"start2": root / "start2"}, [("start2", first)], 24)[0]
    assert tokenizer.decode(answer, skip_special_tokens=True) == complete(client, "start2", first, 24)
    second = first + answer + tokenizer(" ; add 4 5 =", add_special_tokens=False)["input_ids"]
    want = greedy_each(model, {"start2": root / "start2"}, [("start2", second)], NEW_TOKENS)[0]
    assert complete(client, "start2", second) == tokenizer.decode(want, skip_special_tokens=True)
