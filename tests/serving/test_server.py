"""`preft serve` as a user drives it: the `openai` client against the session's live server
(``tests/live_server.py``), completions equal to HF, runtime loads, concurrency."""

from __future__ import annotations

import asyncio
import urllib.request

import openai
import pytest

from live_server import ADAPTERS, API_KEY, NEW_TOKENS, PROMPTS, client, complete, post

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
        (["--max-rank", "0"], "--max-rank and --max-adapters must be >= 1"),
        (["--max-rank", "1000"], "over vLLM's largest LoRA rank 512"),
    ],
)
def test_serve_refuses_bad_start_up_input_in_one_line(capsys, argv, message):
    from preft.cli import main as cli_main

    assert cli_main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


