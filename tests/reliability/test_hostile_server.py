"""The live server under hostile or careless use (issue: reliability and security): no key, paths
outside the adapter root, name takeovers, broken and vanishing bundles, bad requests, a
request whose adapter fails inside the engine. Every refusal is checked to change nothing, and
the server to go on answering correctly. The session's server: ``tests/live_server.py``."""

from __future__ import annotations

import json
import shutil
import socket
import time
import urllib.request

import openai
import pytest
import torch

from live_server import MAX_MODEL_LEN, PROMPTS, client, complete, post

@pytest.mark.slow
def test_bad_requests_are_refused_and_the_server_keeps_serving(server, reference):
    with pytest.raises(openai.NotFoundError):
        complete(server, "nobody", "add 1 2 =")
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model="user0", prompt="add 1 2 =", max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model="user0", prompt="add 1 2 = " * 200, max_tokens=4)
    assert complete(server, "user1", PROMPTS[0]) == reference[("user1", PROMPTS[0])]


@pytest.fixture(scope="module")
def bad_bundles(adapters, tmp_path_factory, tokenizer):
    """Broken copies of a good bundle, one per way a bundle can be wrong."""
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
    # an explicit replacement: a LoRA name ('swap', user6's weights) now serves the ReFT-P bundle
    # reft1, listed once, and then user6's LoRA again
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": str(
        adapters / "user6.bundle")})
    assert status == 200, body
    # a prompt on which the three weights this name serves give three texts: serving the wrong one fails
    telling = [p for p in PROMPTS if len({reference[(name, p)] for name in (None, "user6", "reft1")}) == 3]
    assert telling, "no prompt tells the base model, user6 and reft1 apart"
    prompt = telling[0]
    assert complete(server, "swap", prompt) == reference[("user6", prompt)]
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": reft_bundle,
                                                          "load_inplace": True})
    assert status == 200, body
    ids = [m.id for m in client(server).models.list().data]
    assert ids.count("swap") == 1 and len(ids) == len(set(ids))
    for p in (prompt, *PROMPTS[:3]):
        assert complete(server, "swap", p) == reference[("reft1", p)]
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": str(
        adapters / "user6.bundle"), "load_inplace": True})
    assert status == 200, body
    assert complete(server, "swap", prompt) == reference[("user6", prompt)]
    ids = [m.id for m in client(server).models.list().data]
    assert ids.count("swap") == 1


@pytest.mark.slow
def test_a_bundle_deleted_or_rewritten_after_loading_changes_nothing(server, adapters, reference):
    """The server serves its own checked copy: deleting the bundle directory neither crashes the
    engine nor turns a LoRA-P adapter all-token, and a bundle re-exported in place and loaded
    under a new name serves its new weights while the old name keeps the old ones."""

    texts = {name: [reference[(name, p)] for p in PROMPTS] for name in (None, "reft0", "reft1", "user2")}
    assert len({tuple(t) for t in texts.values()}) == 4  # the answers below tell which weights served them
    for kind, source in (("reft", "reft0"), ("lora", "user2")):
        shutil.copytree(adapters / f"{source}.bundle", adapters / f"doomed_{kind}")
        status, body = post(server, "/v1/load_lora_adapter", {"lora_name": f"doomed_{kind}",
                                                              "lora_path": str(adapters / f"doomed_{kind}")})
        assert status == 200, body
        shutil.rmtree(adapters / f"doomed_{kind}")
        for prompt in PROMPTS:
            assert complete(server, f"doomed_{kind}", prompt) == reference[(source, prompt)], (kind, prompt)
    shutil.copytree(adapters / "reft0.bundle", adapters / "swapped")
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "before",
                                                  "lora_path": str(adapters / "swapped")})[0] == 200
    shutil.rmtree(adapters / "swapped")
    shutil.copytree(adapters / "reft1.bundle", adapters / "swapped")
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "after",
                                                  "lora_path": str(adapters / "swapped")})[0] == 200
    for prompt in PROMPTS:
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
    (["--resolve-adapters"], "--resolve-adapters needs --adapter-root"),
    (["--max-host-adapters", "0"], "--max-host-adapters must be >= 1"),
    (["--", "--max-cpu-loras", "9"], "use preft serve's --max-host-adapters"),
    (["--adapter", "a=x", "--adapter", "a=y"], "names must be unique"),
    # before: vLLM's own parallel flag after -- died in vLLM with a traceback (no CPU thread binding)
    (["--", "--pipeline-parallel-size", "2"], "use preft serve's --pipeline-parallel-size (before --)"),
    (["--", "-tp=2"], "use preft serve's --tensor-parallel-size"),
    (["--", "--max-loras", "9"], "use preft serve's --max-adapters"),
])
def test_serve_refuses_unsafe_or_ambiguous_settings(capsys, argv, message):
    from preft.cli import main as cli_main

    assert cli_main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def _fresh_copy(adapters, source: str, name: str):
    """A copy of bundle ``source`` that serves the same weights, its manifest noting ``name`` (the
    store files copies by content: this one gets a store copy of its own)."""
    copy = adapters / name
    shutil.copytree(adapters / f"{source}.bundle", copy)
    manifest = copy / "preft_manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "note": name}))
    return copy


def _store_copy(server, name: str):
    from pathlib import Path

    return Path(next(m.root for m in client(server).models.list().data if m.id == name))


def _fails_alone(server, reference, name: str) -> None:
    """A request for ``name`` gets an error answer at once; the server goes on serving everyone else."""
    started = time.time()
    with pytest.raises(openai.InternalServerError):
        complete(server, name, PROMPTS[0])
    assert time.time() - started < 30
    for other in ("reft0", "user1", None):
        assert complete(server, other or "base", PROMPTS[2]) == reference[(other, PROMPTS[2])], other
    with urllib.request.urlopen(server["url"] + "/health", timeout=10) as response:
        assert response.status == 200


@pytest.mark.slow
@pytest.mark.parametrize("kind, source", [("reft", "reft1"), ("lora", "user4")])
def test_a_copy_removed_from_the_store_fails_its_requests_not_the_engine(server, adapters, reference, kind, source):
    """Behind the server's back, the server's own copy goes: the engine refuses the request when
    it arrives (before the worker could crash on it, or serve a LoRA-P all-token)."""
    name = f"vanished_{kind}"
    bundle = _fresh_copy(adapters, source, name)
    assert post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(bundle)})[0] == 200
    store_copy = _store_copy(server, name)
    assert store_copy != bundle and store_copy.is_dir()
    shutil.rmtree(store_copy)
    _fails_alone(server, reference, name)
    assert "the bundle's preft_manifest.json is gone" in server["log"].read_text() \
        or "lost its manifest" in server["log"].read_text()


@pytest.mark.slow
def test_a_bundle_the_worker_cannot_read_fails_its_requests_not_the_engine(server, adapters, reference):
    """The store copy's weights are corrupted after the load (the manifest still reads): only the
    worker finds out, when it first writes the bundle into its bank. That request fails; the
    requests in the same steps and after it are served."""
    name = "corrupted_reft"
    bundle = _fresh_copy(adapters, "reft1", name)
    assert post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(bundle)})[0] == 200
    (_store_copy(server, name) / "reft_weights.safetensors").write_bytes(b"not a safetensors file")
    _fails_alone(server, reference, name)
    assert "cannot be read" in server["log"].read_text()
    # the bank slot it did not get is free again: every other ReFT-P adapter still serves
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "reft1_again", "lora_path": str(
        _fresh_copy(adapters, "reft1", "reft1_again"))})
    assert status == 200, body
    assert complete(server, "reft1_again", PROMPTS[1]) == reference[("reft1", PROMPTS[1])]


# ---------------------------------------------------------------- reliability II: the reserved key, everywhere


def _reserved_key_bodies(bundle: str) -> dict[str, dict]:
    """A request per route vLLM serves that takes ``vllm_xargs``, each setting the reserved key."""
    xargs = {"vllm_xargs": {"preft_reft": bundle}}
    chat = [{"role": "user", "content": "add 1 2 ="}]
    return {
        "/v1/completions": {"model": "base", "prompt": "add 1 2 =", "max_tokens": 2, **xargs},
        "/v1/chat/completions": {"model": "base", "messages": chat, "max_tokens": 2, **xargs},
        "/v1/messages": {"model": "base", "messages": chat, "max_tokens": 2, **xargs},
        "/v1/responses": {"model": "base", "input": "add 1 2 =", "max_output_tokens": 2, **xargs},
        "/v1/chat/completions/batch": {"model": "base", "messages": [chat], "max_tokens": 2, **xargs},
        "/v1/some/future/route": {"model": "base", "requests": [{"prompt": "x", **xargs}]},
    }


@pytest.mark.slow
def test_the_reserved_key_is_refused_on_every_route_and_says_nothing_of_the_path(server, adapters, reference):
    """Before: /v1/messages and /v1/responses took ``vllm_xargs.preft_reft`` and the engine served
    any ReFT-P bundle on disk, unchecked (a NaN one made every later answer empty); a path with
    no bundle gave 500 where a bundle gave 200."""
    answers = {}
    for bundle in (str(adapters / "reft1.bundle"), "/nonexistent/secret"):
        for path, body in _reserved_key_bodies(bundle).items():
            status, text = post(server, path, body)
            assert status == 400 and "vllm_xargs.preft_reft is reserved" in text, (path, status, text)
            assert bundle not in text
            answers.setdefault(path, set()).add(text)
    assert all(len(texts) == 1 for texts in answers.values())  # the same answer whatever the path held
    for name in (None, "user1", "reft0"):
        assert complete(server, name or "base", PROMPTS[2]) == reference[(name, PROMPTS[2])]


def test_the_routes_that_take_vllm_xargs_are_read_from_vllms_routers():
    """ReFT-P names are routed on every route whose body takes vllm_xargs, found from the app's
    routes (a route vLLM adds later is found the same way)."""
    from fastapi import FastAPI
    from vllm.entrypoints.anthropic.api_router import router as messages
    from vllm.entrypoints.openai.chat_completion.api_router import router as chat
    from vllm.entrypoints.openai.completion.api_router import router as completion
    from vllm.entrypoints.openai.responses.api_router import router as responses

    from preft.serving.reft_routing import find_xargs_routes

    app = FastAPI()
    for router in (completion, chat, messages, responses):
        app.include_router(router)
    found = find_xargs_routes(app)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"} <= found, found
    assert "/v1/messages/count_tokens" not in found and "/v1/responses/{response_id}/cancel" not in found


@pytest.mark.slow
@pytest.mark.parametrize("xargs", [["preft_reft", "/etc"], "preft_reft", 7])
def test_a_non_object_vllm_xargs_is_a_clean_400_that_keeps_the_connection(server, reference, xargs):
    """Before: a ReFT-P request whose vllm_xargs was a list or a string raised inside the ASGI
    middleware; the connection dropped and the client's next request on it failed."""
    import http.client
    from urllib.parse import urlparse

    from live_server import API_KEY, NEW_TOKENS

    url = urlparse(server["url"])
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    try:
        bad = {"model": "reft0", "prompt": PROMPTS[0], "max_tokens": 2, "vllm_xargs": xargs}
        connection.request("POST", "/v1/completions", json.dumps(bad), headers)
        response = connection.getresponse()
        text = response.read().decode()
        assert response.status == 400 and "vllm_xargs must be a JSON object" in text, text
        good = {"model": "reft0", "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "min_tokens": NEW_TOKENS,
                "temperature": 0.0}
        connection.request("POST", "/v1/completions", json.dumps(good), headers)  # the same connection
        response = connection.getresponse()
        assert response.status == 200
        assert json.loads(response.read())["choices"][0]["text"] == reference[("reft0", PROMPTS[0])]
    finally:
        connection.close()
    assert "Exception in ASGI application" not in server["log"].read_text()


@pytest.mark.slow
def test_a_prompt_that_fills_the_context_is_a_clear_400(server, reference):
    """Before: a prompt of exactly --max-model-len tokens with max_tokens=1 got "max_tokens must
    be at least 1, got 0"; one token longer got the context message."""
    for length, message in ((MAX_MODEL_LEN, "leaves no room for an output token"),
                            (MAX_MODEL_LEN + 1, f"maximum context length is {MAX_MODEL_LEN} tokens")):
        with pytest.raises(openai.BadRequestError, match=message):
            client(server).completions.create(model="user0", prompt=[5] * length, max_tokens=1)
    one_short = client(server).completions.create(model="user0", prompt=[5] * (MAX_MODEL_LEN - 1), max_tokens=1)
    assert one_short.usage.completion_tokens == 1  # a prompt one token shorter is answered
    assert complete(server, "user1", PROMPTS[0]) == reference[("user1", PROMPTS[0])]


@pytest.mark.parametrize("argv, message", [
    (["--scheduler", "sloweave", "--tpot-ms", "nan", "--cost-model", "x.json"], "--tpot-ms must be > 0 and finite"),
    (["--scheduler", "sloweave", "--tpot-ms", "-5", "--cost-model", "x.json"], "--tpot-ms must be > 0 and finite"),
    (["--scheduler", "feather", "--feather-max-wait-s", "nan"], "--feather-max-wait-s must be > 0 and finite"),
    (["--scheduler", "fixed:64", "--margin-ms", "inf"], "--margin-ms must be >= 0 and finite"),
    (["--scheduler", "feather", "--feather-state", "/proc/feather.json"], "its directory is not writable"),
    (["--scheduler", "bogus"], "unknown scheduler 'bogus': expected a prefill chunk policy (default, fixed:TOKENS"),
    (["--scheduler", "feather+unknown"], "unknown scheduler 'feather+unknown' (its part 'unknown')"),
])
def test_serve_refuses_meaningless_scheduler_settings_before_start_up(capsys, argv, message):
    """Before: NaN targets and age bounds were accepted (the bound never applied), an unwritable
    Feather state passed start-up and the table was lost at exit, and an unknown scheduler's
    message ended in a garbled "cycle:TOKENS,... calibrates" without the admission orders."""
    from preft.cli import main as cli_main

    assert cli_main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    if "unknown scheduler" in message:
        assert "fcfs, lpm, feather" in err and "calibrates" not in err


@pytest.mark.parametrize("change, message", [
    ({"exploration": -5}, "exploration must be >= 0"),
    ({"exploration": "lots"}, "exploration must be a finite number"),
    ({"decisions": -1}, "decisions must be >= 0"),
])
def test_serve_refuses_a_meaningless_feather_state_file(tmp_path, capsys, change, message):
    from preft.cli import main as cli_main
    from preft.serving.scheduling.feather import FeatherBandit

    state = FeatherBandit().save(tmp_path / "feather.json")
    state.write_text(json.dumps({**json.loads(state.read_text()), **change}))
    assert cli_main(["serve", "--scheduler", "feather", "--feather-state", str(state)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
