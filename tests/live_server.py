"""One live `preft serve` for the whole test session, driven by the real `openai` client.

Shared by ``tests/serving/test_server.py`` (what a user does) and
``tests/reliability/test_hostile_server.py`` (what a hostile or careless one does): a server
start costs about 35 s. Its fixtures are imported by ``tests/conftest.py``. Tests may load,
replace and unload adapters, but leave the start-up names serving what they served (a test that
replaces a name uses one of its own). A test marked ``stops_live_server`` runs last and may stop
it (``tests/reliability/test_shutdown.py`` sends it SIGTERM under load). The tests that use it run one after another and it stops
after the last of them (``tests/conftest.py`` calls the two hooks below)."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
import torch
from peft import PeftModel, get_peft_model

import preft
from conftest import load_base, strengthen_reft
from preft.eval.harness.server_process import start_server, stop_server
from preft.export import export_adapter
from reference.independent import greedy_each

NEW_TOKENS = 6
API_KEY = "test-key-7f3a"  # the server runs behind vLLM's --api-key
ADAPTERS = [f"user{i}" for i in range(8)]
REFT_ADAPTERS = ["reft0", "reft1"]  # reft1 is loaded at run time
MAX_HOST_ADAPTERS = 8  # fewer than the LoRAs the tests use: the host cache evicts
MAX_MODEL_LEN = 512  # room for a conversation whose turn 1 decodes past a 128-token KV block
PROMPTS = ["add 12 35 =", "reverse 3 1 4 =", "the quiet", "sort 8 2 1 9 =", "a=7 b=2 ; b ="]


@pytest.fixture(scope="session")
def adapters(tmp_path_factory, base_path):
    root = tmp_path_factory.mktemp("served")
    for index, name in enumerate(ADAPTERS):
        torch.manual_seed(1000 + index)
        config = preft.PreftLoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"],
                                       init_lora_weights=False, adapter_start=index % 3)
        get_peft_model(load_base(base_path), config).save_pretrained(root / name)
        export_adapter(root / name, base_path, root / f"{name}.bundle")
    for index, name in enumerate(REFT_ADAPTERS):
        torch.manual_seed(2000 + index)
        config = preft.PreftReftConfig(rank=4, layers=[0, 2, 3], intervention=("loreft", "direft")[index],
                                       init_weights=False, adapter_start=index)
        model = strengthen_reft(get_peft_model(load_base(base_path), config))
        model.save_pretrained(root / name)
        export_adapter(root / name, base_path, root / f"{name}.bundle")
    return root


@pytest.fixture(scope="session")
def reference(adapters, base_path, tokenizer):
    """HF greedy text per (adapter, prompt); adapter None = the base model."""
    texts = {}
    with torch.no_grad():
        for name in [None, *ADAPTERS, *REFT_ADAPTERS]:
            model = load_base(base_path)
            if name:
                model = PeftModel.from_pretrained(model, adapters / name).eval()
            batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
            out = model.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            decoded = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
            texts.update({(name, p): t for p, t in zip(PROMPTS, decoded)})
    # the HF references equal the independent reference's (tests/reference: no code shared with preft)
    names = [None, *ADAPTERS, *REFT_ADAPTERS]
    cases = [(name, tokenizer(prompt)["input_ids"]) for name in names for prompt in PROMPTS]
    independent = greedy_each(load_base(base_path), {name: adapters / name for name in names if name}, cases,
                              NEW_TOKENS, never=(tokenizer.eos_token_id,))
    for (name, _), prompt, tokens in zip(cases, PROMPTS * len(names), independent):
        assert tokenizer.decode(tokens, skip_special_tokens=True) == texts[(name, prompt)], (name, prompt)
    # every adapter changes some prompt's text, so a server answering with another adapter (or none) fails
    same_as_base = [n for n in [*ADAPTERS, *REFT_ADAPTERS] if all(texts[(n, p)] == texts[(None, p)] for p in PROMPTS)]
    assert not same_as_base, f"adapters that change no prompt's greedy text: {same_as_base}"
    return texts


@pytest.fixture(scope="session")
def server(adapters, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    # user7 is not given at start: the tests load it at run time
    args = ["--max-adapters", "4", "--max-model-len", str(MAX_MODEL_LEN), "--max-rank", "8", "--dtype", "float32",
            "--allow-runtime-loading", "--adapter-root", str(adapters), "--resolve-adapters",
            "--max-host-adapters", str(MAX_HOST_ADAPTERS), "--metrics-top-adapters", "64"]
    for name in [*ADAPTERS[:-1], "reft0"]:
        args += ["--adapter", f"{name}={adapters / (name + '.bundle')}"]
    proc, url, ready_s = start_server([*args, "--", "--api-key", API_KEY], log)
    yield {"url": url, "ready_s": ready_s, "log": log, "proc": proc}
    if proc.poll() is None:
        stop_server(proc)


def group_server_tests(items) -> None:
    """Run the tests that use the live server one after another (where the first of them was),
    so that it can stop as soon as the last one is done (:func:`stop_after_last_user`)."""
    users = [item for item in items if "server" in getattr(item, "fixturenames", ())]
    # a test that stops the server itself (SIGTERM under load) is its last user
    users.sort(key=lambda item: item.get_closest_marker("stops_live_server") is not None)
    if users:
        first = items.index(users[0])
        others = [item for item in items if item not in users]
        items[:] = others[:first] + users + others[first:]


def stop_after_last_user(item, nextitem) -> None:
    """An idle server still costs a few % of a core and ~2 GB: stop it after its last test."""
    if "server" in getattr(item, "fixturenames", ()) and (
            nextitem is None or "server" not in getattr(nextitem, "fixturenames", ())):
        live = item.funcargs.get("server")
        if live and live["proc"].poll() is None:
            stop_server(live["proc"])


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def complete(server, model: str, prompt: str, **kwargs) -> str:
    response = client(server).completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS,
                                                 temperature=0.0, extra_body={"min_tokens": NEW_TOKENS}, **kwargs)
    return response.choices[0].text


def scrape(server) -> dict[tuple[str, tuple], float]:
    """``/metrics`` parsed by ``prometheus_client``: ``{(sample name, sorted labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server["url"] + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def post(server, path: str, body: dict, key: str | None = API_KEY) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(server["url"] + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


