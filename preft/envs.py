"""Every environment variable PreFT reads, with its meaning (vLLM's ``envs.py`` style).

Read them as attributes (``from preft import envs; envs.PREFT_ALL_TOKEN``): each access reads
the environment again, so a test's ``monkeypatch.setenv`` and a spawned vLLM process both see
the current value. Nothing else in the project reads ``os.environ`` for a ``PREFT_*`` name.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

#: name -> (how to read it, what it means)
VARIABLES: dict[str, tuple[Callable[[], Any], str]] = {
    "PREFT_DEBUG": (lambda: os.environ.get("PREFT_DEBUG") == "1",
                    "1: the preft CLI shows the traceback of an error instead of one line"),
    "PREFT_MODELS_DIR": (lambda: os.environ.get("PREFT_MODELS_DIR") or os.path.join("~", ".cache", "preft", "models"),
                         "DIR: where `preft models get` keeps the real models it prepares (default "
                         "~/.cache/preft/models)"),
    "PREFT_ALL_TOKEN": (lambda: os.environ.get("PREFT_ALL_TOKEN") == "1",
                        "1: every bundle (LoRA and ReFT) is applied to every token, the standard multi-adapter "
                        "baseline (set by `preft serve --all-token`)"),
    "PREFT_STOCK_LORA_OPS": (lambda: os.environ.get("PREFT_STOCK_LORA_OPS") == "1",
                             "1: keep vLLM's own CPU LoRA ops (to measure them in the benchmarks; they are wrong "
                             "on steps that mix adapter and no-adapter tokens)"),
    "PREFT_TORCH_REFT": (lambda: os.environ.get("PREFT_TORCH_REFT") == "1",
                         "1: on CUDA, run the ReFT-P edit with the torch reference instead of the Triton kernel "
                         "(to measure the kernel against it)"),
    "PREFT_REFT_SLOTS": (lambda: int(os.environ["PREFT_REFT_SLOTS"]) if os.environ.get("PREFT_REFT_SLOTS") else None,
                         "ReFT-P bundles the engine holds at once (default: the engine's max_loras, else 8; "
                         "set by `preft serve --max-adapters`)"),
    "PREFT_TRACE_SCHEDULER": (lambda: os.environ.get("PREFT_TRACE_SCHEDULER") or None,
                              "FILE: the scheduler appends one line per step, '<running requests> <distinct "
                              "adapters> <distinct adapters the step runs with>' (the tests and the slot-limited "
                              "benchmarks read it)"),
    "PREFT_SCHEDULER": (lambda: json.loads(os.environ.get("PREFT_SCHEDULER") or "{}"),
                        "JSON {name, tpot_ms, cost_model, cost_state, max_chunk, margin_ms, min_chunk, stages, "
                        "feather_state, feather_max_wait_s}: the prefill chunk policy and admission order, a "
                        "preft.serving.scheduling.spec.SchedulerSpec (set by `preft serve --scheduler`; unset: "
                        "vLLM's default)"),
    "PREFT_STEP_TRACE": (lambda: os.environ.get("PREFT_STEP_TRACE") or None,
                         "FILE: the scheduler appends one JSON line per engine step: its shape (decodes, prefill "
                         "tokens, context tokens), its time and the gap before it (`preft eval profile` reads it)"),
    "PREFT_SERVE_BASE": (lambda: os.environ.get("PREFT_SERVE_BASE") or None,
                         "set by `preft serve`: the base model directory; runtime adapter loads are checked "
                         "against it, and its presence turns on the API-server patches"),
    "PREFT_SERVE_BASE_NAME": (lambda: os.environ.get("PREFT_SERVE_BASE_NAME") or None,
                              "set by `preft serve`: the base model's name in the API (ReFT-P requests are "
                              "rewritten to it)"),
    "PREFT_SERVE_MAX_RANK": (lambda: int(os.environ.get("PREFT_SERVE_MAX_RANK", "64")),
                             "set by `preft serve`: the largest adapter rank a runtime load may have"),
    "PREFT_SERVE_ADAPTER_ROOT": (lambda: os.environ.get("PREFT_SERVE_ADAPTER_ROOT") or None,
                                 "set by `preft serve --allow-runtime-loading --adapter-root DIR`: runtime loads are "
                                 "allowed, from bundles under DIR only (unset: no runtime loading)"),
    "PREFT_SERVE_RESOLVE": (lambda: os.environ.get("PREFT_SERVE_RESOLVE") == "1",
                            "1: a request naming an adapter that is not loaded but is a bundle under "
                            "PREFT_SERVE_ADAPTER_ROOT loads it (set by `preft serve --resolve-adapters`)"),
    "PREFT_METRICS_TOP_K": (lambda: int(os.environ.get("PREFT_METRICS_TOP_K") or 20),
                            "adapters with their own `adapter` label on /metrics, by finished requests; the rest "
                            "are summed under `_other` (set by `preft serve --metrics-top-adapters`; default 20)"),
    "PREFT_SERVE_STORE": (lambda: os.environ.get("PREFT_SERVE_STORE") or None,
                          "set by `preft serve`: the directory of the server's checked copies of its bundles"),
    "PREFT_SERVE_STORE_OWNER_PID": (lambda: int(os.environ.get("PREFT_SERVE_STORE_OWNER_PID") or 0) or None,
                                    "set by `preft serve` when it made the store itself (no --state-dir): the pid "
                                    "of the API server, which removes the store when it exits"),
    "PREFT_SERVE_LORA": (lambda: json.loads(os.environ.get("PREFT_SERVE_LORA") or "{}"),
                         "set by `preft serve`: JSON {name: copy in the store} of the LoRA adapters given at start-up "
                         "(already checked; vLLM loads them through the runtime-load check)"),
    "PREFT_SERVE_REFT": (lambda: json.loads(os.environ.get("PREFT_SERVE_REFT") or "{}"),
                         "set by `preft serve`: JSON {name: bundle dir} of the ReFT-P adapters given at start-up"),
    "PREFT_SCHEDULING_COST": (lambda: os.environ.get("PREFT_SCHEDULING_COST") or None,
                              "FILE: on SGLang, each scheduler process writes the time its admission passes spend "
                              "ordering the waiting queue (SGLang's and PreFT's) and in model steps, as JSON "
                              "(`preft eval sglang` reads it)"),
    "PREFT_SGLANG_LORA": (lambda: os.environ.get("PREFT_SGLANG_LORA") == "1",
                          "1: SGLang's LoRA layers follow each bundle's rule (LoRA-P: prompt tokens only; set by "
                          "`preft serve --engine sglang --adapter ...`)"),
    "PREFT_SGLANG_PYTHON": (lambda: os.environ.get("PREFT_SGLANG_PYTHON") or os.path.join(
                                os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-sglang", "bin",
                                "python"),
                            "FILE: the Python that runs SGLang for `preft serve --engine sglang` (default: the "
                            "source tree's .venv-sglang, made by `make sglang`)"),
}


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return VARIABLES[name][0]()
    raise AttributeError(f"module 'preft.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(VARIABLES)
