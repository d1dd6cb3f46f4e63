"""Shared fixtures: the embedded default base model, its tokenizer, PreFT model factories."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every vLLM LLM a test starts (engine processes, eval profile's child, the benchmarks' engines)
# runs its engine core in its own process: 13 s to start on 2 cores instead of 30-36 s. Only
# vLLM's LLMEngine reads it; `preft serve` (AsyncLLM) keeps its engine-core process.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on CPU; triton reads this when it is first
    # imported (peft and transformers import it below), so it is set before anything else.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import preft  # noqa: E402  (registers the PreFT methods with PEFT)
from peft import get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

PROMPTS = [
    "add 12 35 =",
    "reverse 3 1 4 1 5 9 2 6 =",
    "the quiet",
    "a=7 b=2 c=9 d=4 ; c =",
]


@pytest.fixture(scope="session")
def base_path() -> str:
    return preft.DEFAULT_BASE_MODEL


@pytest.fixture(scope="session")
def tokenizer(base_path):
    tok = AutoTokenizer.from_pretrained(base_path)
    assert tok.padding_side == "left"
    return tok


def load_base(path: str, dtype=torch.float32):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.no_grad()
def hf_greedy(model, tokenizer, prompt: str, new_tokens: int) -> list[int]:
    """The HF reference: ``new_tokens`` greedy tokens (EOS never picked) for one prompt."""
    batch = tokenizer([prompt], return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, batch["input_ids"].shape[1]:].tolist()


@torch.no_grad()
def greedy_ids(model, ids: list[int], new_tokens: int) -> list[int]:
    """:func:`hf_greedy` on token ids (a prompt built from another turn's tokens)."""
    batch = torch.tensor([ids])
    out = model.generate(input_ids=batch, attention_mask=torch.ones_like(batch), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def strengthen_reft(model):
    """Random ReFT inits are mild; scale the source weights so the edit shows in greedy tokens."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "reft_source" in name:
                param.mul_(4.0)
    return model


@pytest.fixture
def make_peft_model(base_path):
    """Build a fresh PEFT model on the default base; weights depend only on ``seed``."""

    def build(config, seed: int = 0, dtype=torch.float32):
        base = load_base(base_path, dtype)
        torch.manual_seed(seed)
        return strengthen_reft(get_peft_model(base, config)).to(dtype).eval()

    return build


@pytest.fixture
def prompt_batch(tokenizer):
    """The PROMPTS as one left-padded batch (different lengths)."""
    return tokenizer(PROMPTS, return_tensors="pt", padding=True)


# Adapters initialised randomly (init_*=False) so that they visibly change the model.
ADAPTER_CONFIGS = {
    "lora_p": lambda **kw: preft.PreftLoraConfig(
        r=8, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
        init_lora_weights=False, task_type="CAUSAL_LM", **kw),
    "loreft_p": lambda **kw: preft.PreftReftConfig(
        rank=4, layers=[0, 2], intervention="loreft", init_weights=False, task_type="CAUSAL_LM", **kw),
    "direft_p": lambda **kw: preft.PreftReftConfig(
        rank=4, layers=[1, 3], intervention="direft", init_weights=False, task_type="CAUSAL_LM", **kw),
}


@pytest.fixture(params=sorted(ADAPTER_CONFIGS))
def adapter_kind(request) -> str:
    return request.param


@pytest.fixture
def saved_adapter(tmp_path, base_path):
    """Save a fresh PEFT adapter of ``config`` on the default base (seed 0) under tmp_path."""

    def save(config, name="adapter"):
        torch.manual_seed(0)
        model = get_peft_model(load_base(base_path), config)
        model.save_pretrained(tmp_path / name)
        return tmp_path / name

    return save


# the session's live `preft serve` (tests/serving/test_server.py, tests/reliability/test_hostile_server.py)
from live_server import adapters, group_server_tests, reference, server, stop_after_last_user  # noqa: E402,F401


@pytest.hookimpl(wrapper=True)  # before every other hook: pytest-xdist's worker reads the groups
def pytest_collection_modifyitems(session, config, items):
    group_server_tests(items)
    group_for_workers(items)
    return (yield)


def worker_group(item) -> str:
    """The tests that must share one pytest process under ``pytest -n`` (pytest-xdist's
    ``--dist loadgroup``): the live server's users, the users of the shared engine pool, and
    each module's own tests (its module-scoped fixtures are built once)."""
    if "server" in getattr(item, "fixturenames", ()):
        return "live_server"
    if getattr(item.module, "shared_pool", None) is not None:
        return "engine_pool"
    return item.nodeid.split("::", 1)[0]


def group_for_workers(items) -> None:
    """Mark each test with its :func:`worker_group` and put the heaviest groups first (a slow test
    counts as ten), so that the last group a worker takes is a short one; within a group the
    order is kept. Without ``-n`` the marks do nothing and only the order changes."""
    groups: dict[str, list] = {}
    for item in items:
        name = worker_group(item)
        item.add_marker(pytest.mark.xdist_group(name))
        groups.setdefault(name, []).append(item)
    weight = {name: sum(10 if item.get_closest_marker("slow") else 1 for item in members)
              for name, members in groups.items()}
    items[:] = [item for name in sorted(groups, key=lambda name: -weight[name]) for item in groups[name]]


def pytest_runtest_teardown(item, nextitem):
    stop_after_last_user(item, nextitem)


def pytest_sessionfinish(session, exitstatus):
    from engine_pool import close_shared_pool

    close_shared_pool()
