"""A live `preft serve` driven by the real `openai` client (one server for the module)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request

import openai
import pytest
import torch
from peft import PeftModel, get_peft_model

import preft
from conftest import load_base, strengthen_reft
from preft.serving.server_process import start_server, stop_server
from preft.export import export_adapter

NEW_TOKENS = 6
API_KEY = "test-key-7f3a"  # the module's server runs behind vLLM's --api-key
ADAPTERS = [f"user{i}" for i in range(8)]
REFT_ADAPTERS = ["reft0", "reft1"]  # reft1 is loaded at run time
PROMPTS = ["add 12 35 =", "reverse 3 1 4 =", "the quiet", "sort 8 2 1 9 =", "a=7 b=2 ; b ="]


@pytest.fixture(scope="module")
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


@pytest.fixture(scope="module")
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
    return texts


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    # user7 is not given at start: the tests load it at run time
    args = ["--max-adapters", "4", "--max-model-len", "128", "--max-rank", "8", "--dtype", "float32",
            "--allow-runtime-loading", "--adapter-root", str(adapters)]
    for name in [*ADAPTERS[:-1], "reft0"]:
        args += ["--adapter", f"{name}={adapters / (name + '.bundle')}"]
    proc, url, ready_s = start_server([*args, "--", "--api-key", API_KEY], log)
    yield {"url": url, "ready_s": ready_s, "log": log}
    stop_server(proc)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def complete(server, model: str, prompt: str, **kwargs) -> str:
    response = client(server).completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS,
                                                 temperature=0.0, extra_body={"min_tokens": NEW_TOKENS}, **kwargs)
    return response.choices[0].text


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


@pytest.mark.slow
def test_models_lists_the_adapters_and_server_binds_loopback(server):
    ids = {m.id for m in client(server).models.list().data}
    assert {"base", *ADAPTERS[:-1], "reft0"} <= ids
    assert server["url"].startswith("http://127.0.0.1:")
    with urllib.request.urlopen(server["url"] + "/metrics", timeout=10) as response:  # not under /v1: no key
        assert response.status == 200 and b"vllm:" in response.read()


@pytest.mark.slow
def test_completions_equal_hf_reference(server, reference):
    for name in [None, "user0", "user1", "user2"]:
        for prompt in PROMPTS:
            assert complete(server, name or "base", prompt) == reference[(name, prompt)], (name, prompt)


@pytest.mark.slow
def test_reft_p_adapters_by_name_equal_hf_reference(server, adapters, reference):
    for prompt in PROMPTS:
        assert complete(server, "reft0", prompt) == reference[("reft0", prompt)], prompt
    status, body = post(server, "/v1/load_lora_adapter",
                        {"lora_name": "reft1", "lora_path": str(adapters / "reft1.bundle")})
    assert status == 200, body
    assert "reft1" in {m.id for m in client(server).models.list().data}
    for prompt in PROMPTS:
        assert complete(server, "reft1", prompt) == reference[("reft1", prompt)], prompt
    # the same prompt for the base model afterwards: no ReFT KV leaks through the prefix cache
    assert complete(server, "base", PROMPTS[0]) == reference[(None, PROMPTS[0])]
    status, body = post(server, "/v1/completions", {"model": "base", "prompt": "x", "max_tokens": 2,
                                                    "vllm_xargs": {"preft_reft": "/etc"}})
    assert status == 400 and "reserved" in body
    status, body = post(server, "/v1/unload_lora_adapter", {"lora_name": "reft1"})
    assert status == 200, body
    with pytest.raises(openai.NotFoundError):
        complete(server, "reft1", PROMPTS[0])


@pytest.mark.slow
def test_chat_completions_work(server):
    response = client(server).chat.completions.create(
        model="user0", messages=[{"role": "user", "content": "add 2 3 ="}], max_tokens=4, temperature=0.0)
    assert response.choices[0].message.content is not None and response.usage.prompt_tokens > 0


@pytest.mark.slow
def test_bad_requests_are_refused_and_the_server_keeps_serving(server, reference):
    with pytest.raises(openai.NotFoundError):
        complete(server, "nobody", "add 1 2 =")
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model="user0", prompt="add 1 2 =", max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model="user0", prompt="add 1 2 = " * 200, max_tokens=4)
    assert complete(server, "user1", PROMPTS[0]) == reference[("user1", PROMPTS[0])]


@pytest.mark.slow
def test_runtime_load_and_unload(server, adapters, reference):
    status, body = post(server, "/v1/load_lora_adapter",
                        {"lora_name": "user7", "lora_path": str(adapters / "user7.bundle")})
    assert status == 200, body
    assert complete(server, "user7", PROMPTS[1]) == reference[("user7", PROMPTS[1])]
    status, body = post(server, "/v1/unload_lora_adapter", {"lora_name": "user7"})
    assert status == 200, body
    with pytest.raises(openai.NotFoundError):
        complete(server, "user7", PROMPTS[1])
    assert complete(server, "user2", PROMPTS[2]) == reference[("user2", PROMPTS[2])]


@pytest.fixture(scope="module")
def bad_bundles(adapters, tmp_path_factory, tokenizer):
    """Broken copies of a good bundle, one per way a bundle can be wrong."""
    import shutil

    from safetensors.torch import load_file, save_file
    root = adapters / "bad"  # under the server's adapter root
    root.mkdir()
    good = adapters / "user0.bundle"

    def copy(name):
        shutil.copytree(good, root / name)
        return root / name

    (copy("corrupt") / "adapter_model.safetensors").write_bytes(b"garbage")
    tensors = load_file(str(good / "adapter_model.safetensors"))
    key = sorted(tensors)[0]
    save_file({**tensors, key: torch.full_like(tensors[key], float("nan"))}, str(copy("nan") / "adapter_model.safetensors"))
    manifest = json.loads((good / "preft_manifest.json").read_text())
    (copy("wrong_base") / "preft_manifest.json").write_text(json.dumps({**manifest, "base": {**manifest["base"], "hidden_size": 64}}))
    (copy("rank_over") / "preft_manifest.json").write_text(json.dumps({**manifest, "rank": 32}))
    return {"missing": (root / "nope", "bundle directory not found"), "corrupt": (root / "corrupt", "corrupt"),
            "nan": (root / "nan", "NaN"), "wrong_base": (root / "wrong_base", "another base model"),
            "rank_over": (root / "rank_over", "over --max-rank 8")}


@pytest.mark.slow
@pytest.mark.parametrize("problem", ["missing", "corrupt", "nan", "wrong_base", "rank_over"])
def test_bad_bundle_load_is_400_with_the_reason(server, bad_bundles, reference, problem):
    path, reason = bad_bundles[problem]
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": f"bad_{problem}", "lora_path": str(path)})
    assert status == 400 and reason in body, body
    with pytest.raises(openai.NotFoundError):
        complete(server, f"bad_{problem}", PROMPTS[0])
    assert complete(server, "user3", PROMPTS[3]) == reference[("user3", PROMPTS[3])]


@pytest.mark.slow
def test_200_concurrent_requests_over_the_adapters_and_a_reft_adapter(server, adapters, reference):
    post(server, "/v1/load_lora_adapter", {"lora_name": "user7", "lora_path": str(adapters / "user7.bundle")})
    names = [*ADAPTERS, "reft0"]
    jobs = [(names[i % len(names)], PROMPTS[i % len(PROMPTS)]) for i in range(200)]
    async_client = openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

    async def one(model, prompt):
        response = await async_client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS,
                                                         temperature=0.0, extra_body={"min_tokens": NEW_TOKENS})
        return response.choices[0].text

    async def run_all():
        try:
            return await asyncio.gather(*(one(m, p) for m, p in jobs))
        finally:
            await async_client.close()

    answers = asyncio.run(run_all())
    wrong = [(m, p, a) for (m, p), a in zip(jobs, answers) if a != reference[(m, p)]]
    assert not wrong, wrong[:3]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--adapter", "alice=/nonexistent/bundle"], "bundle directory not found"),
        (["--adapter", "alice"], "not of the form NAME=BUNDLE_DIR"),
        (["--model", "/nonexistent/base"], "base model not found"),
    ],
)
def test_serve_refuses_bad_start_up_input_in_one_line(capsys, argv, message):
    from preft.cli import main as cli_main

    assert cli_main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


# ---------------------------------------------------------------- security and robustness


@pytest.mark.slow
@pytest.mark.parametrize("path, body", [
    ("/v1/load_lora_adapter", {"lora_name": "intruder", "lora_path": "reft1.bundle"}),
    ("/v1/load_lora_adapter", {"lora_name": "intruder", "lora_path": "user7.bundle"}),
    ("/v1/unload_lora_adapter", {"lora_name": "reft0"}),
    ("/v1/unload_lora_adapter", {"lora_name": "user0"}),
    ("/v1/completions", {"model": "reft0", "prompt": "x", "max_tokens": 2}),
])
@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_every_route_that_serves_or_changes_state_needs_the_api_key(server, adapters, reference, path, body, key):
    body = dict(body)
    if "lora_path" in body:
        body["lora_path"] = str(adapters / body["lora_path"])
    status, answer = post(server, path, body, key=key)
    assert status == 401, answer
    assert "intruder" not in {m.id for m in client(server).models.list().data}
    assert complete(server, "reft0", PROMPTS[0]) == reference[("reft0", PROMPTS[0])]
    assert complete(server, "user0", PROMPTS[0]) == reference[("user0", PROMPTS[0])]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["/etc", "{root}/../", "{root}/link_out", "/nonexistent/secret"])
def test_runtime_loads_only_read_under_the_adapter_root_and_say_nothing_of_elsewhere(server, adapters, where):
    link = adapters / "link_out"
    if not link.exists():
        link.symlink_to(adapters.parent)
    path = where.format(root=adapters)
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "outside", "lora_path": path})
    assert status == 400 and "outside the server's adapter root" in body, body
    assert path.rstrip("/") not in body and "nonexistent" not in body


@pytest.mark.slow
def test_names_are_unique_across_kinds_and_replacement_is_explicit(server, adapters, reference):
    reft_bundle, lora_bundle = str(adapters / "reft1.bundle"), str(adapters / "user7.bundle")
    for name, bundle in (("user1", reft_bundle), ("reft0", lora_bundle), ("user1", lora_bundle),
                         ("reft0", reft_bundle), ("base", reft_bundle)):
        status, body = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": bundle})
        assert status == 400, (name, bundle, body)
    assert complete(server, "user1", PROMPTS[0]) == reference[("user1", PROMPTS[0])]
    assert complete(server, "reft0", PROMPTS[0]) == reference[("reft0", PROMPTS[0])]
    # an explicit replacement: the LoRA name 'user5' now serves the ReFT-P bundle reft1, listed once
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "user5", "lora_path": reft_bundle,
                                                          "load_inplace": True})
    assert status == 200, body
    ids = [m.id for m in client(server).models.list().data]
    assert ids.count("user5") == 1 and len(ids) == len(set(ids))
    for prompt in PROMPTS[:3]:
        assert complete(server, "user5", prompt) == reference[("reft1", prompt)]
    # and back to a LoRA bundle (user6's weights) under the same name
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "user5", "lora_path": str(
        adapters / "user6.bundle"), "load_inplace": True})
    assert status == 200, body
    assert complete(server, "user5", PROMPTS[1]) == reference[("user6", PROMPTS[1])]
    ids = [m.id for m in client(server).models.list().data]
    assert ids.count("user5") == 1


@pytest.mark.slow
def test_a_bundle_deleted_or_rewritten_after_loading_changes_nothing(server, adapters, reference):
    """The server serves its own checked copy: deleting the bundle directory neither crashes the
    engine nor turns a LoRA-P adapter all-token, and a bundle re-exported in place and loaded
    under a new name serves its new weights while the old name keeps the old ones."""
    import shutil

    for kind, source in (("reft", "reft0"), ("lora", "user2")):
        shutil.copytree(adapters / f"{source}.bundle", adapters / f"doomed_{kind}")
        status, body = post(server, "/v1/load_lora_adapter", {"lora_name": f"doomed_{kind}",
                                                              "lora_path": str(adapters / f"doomed_{kind}")})
        assert status == 200, body
        shutil.rmtree(adapters / f"doomed_{kind}")
        for prompt in PROMPTS[:2]:
            assert complete(server, f"doomed_{kind}", prompt) == reference[(source, prompt)], (kind, prompt)
    shutil.copytree(adapters / "reft0.bundle", adapters / "swapped")
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "before",
                                                  "lora_path": str(adapters / "swapped")})[0] == 200
    shutil.rmtree(adapters / "swapped")
    shutil.copytree(adapters / "reft1.bundle", adapters / "swapped")
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "after",
                                                  "lora_path": str(adapters / "swapped")})[0] == 200
    for prompt in PROMPTS[:2]:
        assert complete(server, "before", prompt) == reference[("reft0", prompt)]
        assert complete(server, "after", prompt) == reference[("reft1", prompt)]


def test_serve_refuses_a_port_in_use_in_one_line_before_loading(capsys):
    from preft.cli import main as cli_main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.time()
        assert cli_main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"cannot listen on 127.0.0.1:{port}" in err, err
    assert time.time() - started < 10


@pytest.mark.parametrize("argv, message", [
    (["--allow-runtime-loading"], "needs --adapter-root"),
    (["--adapter", "a=x", "--adapter", "a=y"], "names must be unique"),
])
def test_serve_refuses_unsafe_or_ambiguous_settings(capsys, argv, message):
    from preft.cli import main as cli_main

    assert cli_main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err
