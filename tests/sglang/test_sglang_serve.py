"""``preft serve --engine sglang`` on the embedded model in float32, driven by the ``openai``
client: under Feather (PreFT's plugin ordering SGLang's waiting queue) 24 concurrent requests
with shared prefixes get the tokens they get under SGLang's own FCFS, and both equal the
independent reference's greedy tokens (a plain HF forward per token, no cache); so do they
under SLOWeave (PreFT's plugin setting SGLang's prefill chunk per step)."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
from transformers import AutoTokenizer

import preft
from conftest import load_base
from preft.eval.harness.server_process import start_server, stop_server
from reference.independent import greedy_each

pytestmark = pytest.mark.sglang

NEW_TOKENS = 12
PREFIXES = ["add 12 35 = 47 ; add 3 4 = 7 ; add 20 22 = 42 ; ", "reverse 3 1 4 = 4 1 3 ; sort 8 2 1 = 1 2 8 ; "]
TAILS = ["add 5 9 =", "sort 4 4 2 =", "reverse 9 8 1 =", "add 31 11 =", "a=7 b=2 ; b =", "copy 4 4 2 ="]
PROMPTS = [PREFIXES[i % 2] * 2 + tail for i, tail in enumerate(TAILS * 4)]


def served_texts(scheduler: str, log, *flags: str) -> tuple[list[str], str]:
    proc, url, _ = start_server(["--engine", "sglang", "--model", "default", "--dtype", "float32",
                                 "--scheduler", scheduler, *flags], log, timeout_s=300)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

        def complete(prompt: str) -> str:
            return client.completions.create(model=preft.DEFAULT_BASE_MODEL, prompt=prompt, max_tokens=NEW_TOKENS,
                                             temperature=0.0, extra_body={"ignore_eos": True}).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # all at once: the queue orders them
            return list(pool.map(complete, PROMPTS)), log.read_text()
    finally:
        stop_server(proc)


def test_feather_on_sglang_serves_fcfs_tokens_equal_to_the_reference(tmp_path):
    fcfs, _ = served_texts("default", tmp_path / "fcfs.log")
    feather, log = served_texts("feather", tmp_path / "feather.log")
    assert "preft: SGLang admits in feather order" in log  # the plugin's hooks were on
    assert feather == fcfs
    tokenizer = AutoTokenizer.from_pretrained(preft.DEFAULT_BASE_MODEL)
    reference = greedy_each(load_base(preft.DEFAULT_BASE_MODEL), {}, [(None, tokenizer(p)["input_ids"]) for p in PROMPTS],
                            NEW_TOKENS)
    assert fcfs == [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in reference]
    assert len(set(fcfs)) > 4  # the prompts' answers differ: equality is not one repeated text


def test_sloweave_on_sglang_serves_the_reference_tokens(tmp_path):
    """SLOWeave with a TPOT target no step of this CPU keeps (5 ms) gives steps to the decodes
    alone, and with --max-chunk 16 cuts every prompt into chunks; the tokens stay the reference's."""
    sloweave, log = served_texts("sloweave", tmp_path / "sloweave.log", "--tpot-ms", "5", "--max-chunk", "16")
    assert "preft: SGLang's prefill chunk set each step by sloweave" in log
    assert "preft: sloweave gave a step no prefill (decode only)" in log
    assert "preft: sloweave gave a step" in log and "prefill tokens beside" in log  # a prompt cut into chunks
    tokenizer = AutoTokenizer.from_pretrained(preft.DEFAULT_BASE_MODEL)
    reference = greedy_each(load_base(preft.DEFAULT_BASE_MODEL), {}, [(None, tokenizer(p)["input_ids"]) for p in PROMPTS],
                            NEW_TOKENS)
    assert sloweave == [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in reference]
