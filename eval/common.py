"""Helpers that several ``preft eval`` commands share (one copy each).

- :func:`parse_list`: a comma-separated flag value, checked;
- :func:`model_dir`: the base model a command measures (``default``, ``512x8`` or a local directory);
- :func:`machine`: the machine line every result records;
- :func:`simulate_policy` and :func:`capacity`: a chunk policy in the simulator, and the highest
  rate vLLM's default policy sustains there (``eval goodput`` and ``eval profile --served``);
- :func:`warm_up` and :func:`serve_trace`: a real ``preft serve`` warmed up, and driven by
  ``vllm bench serve --dataset-name timed_trace`` with the step trace on (``eval goodput``,
  ``eval profile --served``, ``eval prefix``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: a rate is sustained when the simulator serves it within 1/0.95 of the time it was offered
CAPACITY_SERVED = 0.95


def parse_list(text: str, kind=int, name: str = "list") -> list:
    try:
        values = [kind(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--{name} {text!r} is not a comma-separated list of {kind.__name__}s") from None
    if not values:
        raise ValueError(f"--{name} is empty")
    return values


def model_dir(model: str, root: Path) -> str:
    """The base model's directory: the embedded default, a 512x8 random Llama saved under ``root``,
    or a local directory."""
    from preft.eval.bench.throughput import base_model_dir
    from preft.recipes.common import resolve_model

    if model in ("default", "512x8"):
        return base_model_dir(model, root)
    return resolve_model(model)


def machine() -> str:
    """``x86_64, 2 cores, vLLM 0.32.0``: what every result says it was measured on."""
    import platform

    import vllm

    return f"{platform.machine()}, {os.cpu_count()} cores, vLLM {vllm.__version__}"


def simulate_policy(cost_model, policy_name: str, work, settings: dict, tpot_s: float, record: bool = False):
    """``work`` through the simulator under the chunk policy ``policy_name`` (FCFS admission);
    with ``settings["slots"]`` (adapter slots, :func:`with_adapters`) the requests' prefill-only
    adapters share that many."""
    from preft.rule import AdapterRule
    from preft.serving.scheduling.chunk_policies import make_policy
    from preft.serving.scheduling.simulator import Simulator

    policy = make_policy(policy_name, cost_model=cost_model, tpot_s=tpot_s, max_chunk=settings["max_chunk"])
    work = with_adapters(work, settings)
    rules = {adapter: AdapterRule(prefill_only=True) for adapter in {spec.adapter for spec in work} if adapter}
    return Simulator(cost_model, policy, max_num_seqs=settings["max_num_seqs"],
                     max_num_batched_tokens=settings["max_num_batched_tokens"], record_shapes=record,
                     adapter_rules=rules, max_loras=settings.get("slots") or None).run(work)


def with_adapters(work, settings: dict):
    """``work`` with request i on adapter ``lora{i % N}`` when ``settings["adapters"]`` is N > 0
    (what ``vllm bench serve --lora-assignment round-robin`` sends to the engine), else as it is."""
    from dataclasses import replace

    count = settings.get("adapters") or 0
    return [replace(spec, adapter=f"lora{index % count}") for index, spec in enumerate(work)] if count else work


def capacity(cost_model, kind: str, settings: dict) -> float:
    """The highest rate (req/s) vLLM's default policy serves in the simulator (see the module docstring)."""
    from preft.serving.scheduling import workloads

    def sustained(rate: float) -> bool:
        work = with_adapters(workloads.generate(kind, settings["probe_requests"], rate, seed=99,
                                                max_model_len=settings["max_len"]), settings)
        result = simulate_policy(cost_model, "default", work, settings, tpot_s=1.0)
        offered = work[-1].arrival_s - work[0].arrival_s  # the sample's own rate, not the nominal one
        return result.clock_s - work[0].arrival_s <= offered / CAPACITY_SERVED

    low, high = 0.0, 1.0
    while sustained(high):
        low, high = high, high * 2
    for _ in range(12):
        middle = (low + high) / 2
        low, high = (middle, high) if sustained(middle) else (low, middle)
    return low


#: more model names than this: the warm-up sends one request per name
MANY_NAMES = 64


def warm_up(url: str, models: list[str], rounds: int = 4) -> None:
    """Short requests for every model name, all at once, a few rounds, before timing: each adapter
    is loaded into the engine and the first batched steps' one-time costs (buffers, weight copies)
    are paid, so that neither variant's timed run pays them. Past :data:`MANY_NAMES` names, each name
    gets one request in one round: 16 requests in flight already make batched steps, and four
    rounds of four per adapter would cost more than the timed runs (16,400 requests for 1,024
    adapters: over 30 minutes on a real model on 2 cores)."""
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    def one(model: str) -> None:
        body = json.dumps({"model": model, "prompt": "add 1 2 = add 3 4 = add 5 6 =", "max_tokens": 8}).encode()
        request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()

    each_round, rounds = (models, 1) if len(models) > MANY_NAMES else (models * 4, rounds)
    with ThreadPoolExecutor(max_workers=16) as pool:
        for _ in range(rounds):
            list(pool.map(one, each_round))


def bench_trace(url: str, model_dir: str, trace: Path, label: str, run_dir: Path,
                adapters: dict[str, str] | None = None) -> list:
    """``vllm bench serve --dataset-name timed_trace`` against the server at ``url``, at ``trace``'s
    arrival times (request i on the i % N-th of ``adapters``), in this process
    (:func:`~preft.eval.vllm_bench.serve_in_process`): the per-request timings."""
    from preft.eval.vllm_bench import serve_in_process
    from preft.serving.scheduling.metrics import RequestTiming

    result_name = f"bench-{label}.json"
    count = sum(1 for line in trace.read_text().splitlines() if line.strip())
    command = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", model_dir,
               "--tokenizer", model_dir, "--dataset-name", "timed_trace", "--dataset-path", str(trace),
               "--num-prompts", str(count), "--save-result", "--save-detailed",
               "--result-dir", str(run_dir), "--result-filename", result_name, "--disable-tqdm",
               "--percentile-metrics", "ttft,tpot,itl,e2el"]
    if adapters:
        command += ["--lora-modules", *adapters, "--lora-assignment", "round-robin"]
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    log = run_dir / "logs" / f"bench-{label}.log"
    log.unlink(missing_ok=True)
    serve_in_process(command, log, timeout_s=1800)
    bench = json.loads((run_dir / result_name).read_text())
    return [RequestTiming(start, start + ttft, start + ttft + sum(itl), length)
            for start, ttft, itl, length in zip(bench["start_times"], bench["ttfts"], bench["itls"],
                                                bench["output_lens"]) if ttft is not None and ttft > 0]


def serve_trace(model_dir: str, policy_args: list[str], trace: Path, label: str, run_dir: Path,
                settings: dict, vllm_extra: tuple[str, ...] = (), adapters: dict[str, str] | None = None,
                slots: int = 0, engine: str = "vllm", env: dict[str, str] | None = None) -> tuple[list, list[dict]]:
    """``preft serve`` with ``policy_args`` (``--scheduler ...``) and the step trace on, driven by
    ``vllm bench serve --dataset-name timed_trace`` at ``trace``'s arrival times:
    ``(per-request timings, the engine's steps)``. The warm-up's steps are not kept.
    ``vllm_extra``: more vLLM arguments (e.g. ``--num-gpu-blocks-override N``). ``adapters``
    (name -> bundle): served with ``slots`` adapter slots (every adapter in host memory), request i
    of the trace on the i % N-th (``--lora-assignment round-robin``). ``engine="sglang"``: ``preft
    serve --engine sglang``, ``settings``' batch limits as SGLang's flags and ``vllm_extra`` as more
    of SGLang's (no step trace: the steps come back empty); ``env``: more of the server's environment."""
    adapters = adapters or {}
    if adapters:
        policy_args = [*policy_args, "--max-adapters", str(slots or len(adapters)), "--max-rank", "16",
                       "--max-host-adapters", str(len(adapters)),
                       *[a for name, bundle in adapters.items() for a in ("--adapter", f"{name}={bundle}")]]
    from preft.eval.harness.server_process import start_server, stop_server

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    step_trace = run_dir / f"steps-{label}.jsonl"
    step_trace.unlink(missing_ok=True)
    if engine == "sglang":
        # SGLang's own chunk unless a flag of vllm_extra sets it or the plugin sets it per step (SLOWeave)
        from preft.serving.scheduling.spec import SchedulerSpec

        scheduler = policy_args[policy_args.index("--scheduler") + 1] if "--scheduler" in policy_args else "default"
        chunk_given = (any(a.startswith("--chunked-prefill-size") for a in vllm_extra)
                       or SchedulerSpec.parse(scheduler).sloweave)
        args = ["--engine", "sglang", "--model", model_dir, "--dtype", "float32", "--max-model-len",
                str(settings["max_len"]), *policy_args, "--", "--max-running-requests", str(settings["max_num_seqs"]),
                *([] if chunk_given else ["--chunked-prefill-size", str(settings["max_num_batched_tokens"])]),
                *vllm_extra]
    else:
        args = ["--model", model_dir, "--dtype", "float32", "--max-model-len", str(settings["max_len"]),
                "--kv-cache-gib", "1", *policy_args, "--", "--max-num-seqs", str(settings["max_num_seqs"]),
                "--max-num-batched-tokens", str(settings["max_num_batched_tokens"]), *vllm_extra]
    proc, url, _ = start_server(args, run_dir / "logs" / f"server-{label}.log",
                                env={"PREFT_STEP_TRACE": str(step_trace), **(env or {})}, timeout_s=300)
    try:
        warm_up(url, [model_dir], rounds=2)
        step_trace.unlink(missing_ok=True)
        timings = bench_trace(url, model_dir, trace, label, run_dir, adapters)
    finally:
        stop_server(proc)
    steps = [json.loads(line) for line in step_trace.read_text().splitlines()] if step_trace.exists() else []
    return timings, steps
