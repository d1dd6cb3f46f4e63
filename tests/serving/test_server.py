"""A live `preft serve` driven by the real `openai` client (one server for the module)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
import torch
from peft import PeftModel, get_peft_model

import preft
from conftest import load_base, strengthen_reft
from preft.export import export_adapter

NEW_TOKENS = 6
ADAPTERS = [f"user{i}" for i in range(8)]
REFT_ADAPTERS = ["reft0", "reft1"]  # reft1 is loaded at run time
PROMPTS = ["add 12 35 =", "reverse 3 1 4 =", "the quiet", "sort 8 2 1 9 =", "a=7 b=2 ; b ="]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    # user7 is not given at start: the tests load it at run time
    args = [sys.executable, "-m", "preft.cli", "serve", "--port", str(port), "--max-adapters", "4",
            "--max-model-len", "128", "--max-rank", "8", "--dtype", "float32"]
    for name in [*ADAPTERS[:-1], "reft0"]:
        args += ["--adapter", f"{name}={adapters / (name + '.bundle')}"]
    handle = open(log, "w")
    proc = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, env=dict(os.environ))
    started = time.time()
    url = f"http://127.0.0.1:{port}"
    while time.time() - started < 240:
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("preft serve died:\n" + log.read_text()[-4000:])
            time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("preft serve not ready in 240 s:\n" + log.read_text()[-4000:])
    yield {"url": url, "ready_s": time.time() - started, "log": log}
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    handle.close()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0, timeout=120)


def complete(server, model: str, prompt: str, **kwargs) -> str:
    response = client(server).completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS,
                                                 temperature=0.0, extra_body={"min_tokens": NEW_TOKENS}, **kwargs)
    return response.choices[0].text


def post(server, path: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(server["url"] + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
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
    with urllib.request.urlopen(server["url"] + "/metrics", timeout=10) as response:
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
    root = tmp_path_factory.mktemp("bad")
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
    async_client = openai.AsyncOpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0, timeout=300)

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
