"""`preft eval sglang`: Feather (PreFT's plugin ordering SGLang's waiting queue) against SGLang's
own FCFS, LPM and DFS-weight, on SGLang, with what each costs in scheduling CPU time.

    preft eval sglang [--model 512x8] [--requests 200] [--rate 20] [--groups 20] [--rounds 3]
                      [--kv-tokens 15360] [--out runs/eval]

Each run is a fresh ``preft serve --engine sglang`` (float32, 64 running requests at most,
prefill chunks of 2,048 tokens, ``--kv-tokens`` of KV so that the prefix groups do not all fit
beside the running requests, as the vLLM runs of ``preft eval prefix`` hold 120 blocks of 128),
driven by ``vllm bench serve --dataset-name timed_trace`` with the ``shared`` (``--groups``
prefix groups) and ``no-sharing`` workloads of
:func:`~preft.serving.scheduling.workloads.prefix_workload` (prompts rebuilt from the trace's
hash ids, so a group shares real tokens). Feather learns online from an empty table. Within a
round every policy runs on the same trace, in an order rotated each round; a ratio to FCFS is
per round, reported as the median and range over rounds.

Scheduling cost (:mod:`preft.serving.sglang.scheduling_cost`): per admission pass, the time in
SGLang's ``SchedulePolicy.calc_priority`` (LPM's and DFS-weight's radix matching) plus, for
Feather, the plugin's own ordering (the Chunked Hash Tree and the bandit), and that time as a
share of the time in model steps.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

POLICIES = ("fcfs", "lpm", "dfs-weight", "feather")
WORKLOADS = ("shared", "no-sharing")


def run_one(policy: str, model_dir: str, trace: Path, label: str, out: Path, settings: dict) -> dict[str, Any]:
    from preft.eval.common import serve_trace
    from preft.serving.scheduling.metrics import summarize

    cost_file = out / f"cost-{label}.json"
    cost_file.unlink(missing_ok=True)
    own = ["--schedule-policy", policy] if policy != "feather" else []
    timings, _ = serve_trace(model_dir, ["--scheduler", "feather" if policy == "feather" else "default"], trace, label,
                             out, settings, vllm_extra=(*own, "--max-total-tokens", str(settings["kv_tokens"])),
                             engine="sglang", env={"PREFT_SCHEDULING_COST": str(cost_file)})
    cost = json.loads(cost_file.read_text()) if cost_file.is_file() else {}
    ordering = cost.get("sglang_order_s", 0.0) + cost.get("preft_order_s", 0.0)
    return {"summary": summarize(timings, settings["ttft_s"], settings["tpot_s"]), "requests": len(timings),
            "order_us_per_pass": 1e6 * ordering / cost["admissions"] if cost.get("admissions") else None,
            "order_share_of_steps": ordering / cost["step_s"] if cost.get("step_s") else None,
            "cost": cost}


def run(model: str, out: Path, requests: int, rate: float, groups: int, rounds: int, kv_tokens: int) -> dict[str, Any]:
    from transformers import AutoConfig

    from preft.eval import common
    from preft.serving.scheduling import workloads

    model_dir = common.model_dir(model, out / "model")
    max_len = AutoConfig.from_pretrained(model_dir).max_position_embeddings
    settings = {"requests": requests, "rate": rate, "groups": groups, "rounds": rounds, "kv_tokens": kv_tokens,
                "max_len": max_len, "max_num_seqs": 64, "max_num_batched_tokens": 2048,
                # goodput targets are not this comparison's; throughput and latencies are
                "ttft_s": 1e9, "tpot_s": 1e9}
    traces = {}
    for variant in WORKLOADS:
        work = workloads.prefix_workload(variant, requests, rate=rate, groups=groups, seed=7, max_model_len=max_len)
        traces[variant] = out / f"{variant}.trace.jsonl"
        workloads.write_trace(work, traces[variant])
    runs: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(rounds):
        for variant in WORKLOADS:
            shift = round_index % len(POLICIES)
            for policy in POLICIES[shift:] + POLICIES[:shift]:
                print(f"[sglang] round {round_index + 1}/{rounds}: {variant} {policy}, {requests} requests", flush=True)
                label = f"{variant}-{policy}-r{round_index}"
                runs.setdefault((variant, policy), []).append(
                    run_one(policy, model_dir, traces[variant], label, out, settings))
    rows = []
    for variant in WORKLOADS:
        for policy in POLICIES:
            measured = runs[(variant, policy)]
            ratios = [m["summary"]["request_throughput"] / f["summary"]["request_throughput"]
                      for m, f in zip(measured, runs[(variant, "fcfs")])]
            costs = [m["order_us_per_pass"] for m in measured if m["order_us_per_pass"] is not None]
            shares = [m["order_share_of_steps"] for m in measured if m["order_share_of_steps"] is not None]
            rows.append({"workload": variant, "policy": policy, "requests": [m["requests"] for m in measured],
                         "req_s": statistics.median(m["summary"]["request_throughput"] for m in measured),
                         "ttft_p50_ms": statistics.median(m["summary"]["ttft_ms_p50"] for m in measured),
                         "tpot_p50_ms": statistics.median(m["summary"]["tpot_ms_p50"] for m in measured),
                         "vs_fcfs": statistics.median(ratios), "vs_fcfs_range": [min(ratios), max(ratios)],
                         "order_us_per_pass": statistics.median(costs) if costs else None,
                         "order_share_of_steps": statistics.median(shares) if shares else None,
                         "per_round_req_s": [m["summary"]["request_throughput"] for m in measured]})
    return {"settings": settings, "rows": rows}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for axis, variant in zip(axes, WORKLOADS):
        chosen = [r for r in rows if r["workload"] == variant]
        ratios = [r["vs_fcfs"] for r in chosen]
        low = [r["vs_fcfs"] - r["vs_fcfs_range"][0] for r in chosen]
        high = [r["vs_fcfs_range"][1] - r["vs_fcfs"] for r in chosen]
        axis.bar([r["policy"] for r in chosen], ratios, yerr=[low, high], capsize=4,
                 color=["#888888", "#4c72b0", "#55a868", "#dd8452"][:len(chosen)])
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_title(f"{variant}: throughput vs SGLang's FCFS")
        axis.set_ylim(0, max(1.2, max(r["vs_fcfs_range"][1] for r in chosen) * 1.1))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def markdown(result: dict) -> str:
    settings = result["settings"]
    lines = [
        "## Feather on SGLang: against SGLang's own policies (`preft eval sglang`)", "",
        f"Command: `{result['command']}` ({result['machine']}); SGLang {result['sglang']} on the CPU (plain-torch "
        f"attention, no compiled kernels). A fresh `preft serve --engine sglang` per run (float32, 64 running "
        f"requests at most, prefill chunks of 2,048 tokens, {settings['kv_tokens']:,} tokens of KV), driven by "
        f"`vllm bench serve` with {settings['requests']} requests at {settings['rate']:g} req/s; `shared`: "
        f"{settings['groups']} prefix groups; `no-sharing`: the same lengths, every prompt unique. "
        f"{settings['rounds']} rounds, every policy on the same trace within a round, in a rotated order; the ratio "
        "to FCFS is per round (median [range]). Feather learns online from an empty table. Ordering cost: per "
        "admission pass, SGLang's `calc_priority` (LPM's and DFS-weight's radix matching) plus Feather's own "
        "ordering in the plugin, and that time over the time in model steps.", "",
        "![Feather on SGLang](sglang_orders.png)", "",
        "| workload | policy | req/s | vs FCFS | TTFT p50 (s) | TPOT p50 (ms) | ordering per pass (µs) | "
        "ordering / step time |",
        "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        cost = f"{row['order_us_per_pass']:.0f}" if row["order_us_per_pass"] is not None else "-"
        share = f"{100 * row['order_share_of_steps']:.2f}%" if row["order_share_of_steps"] is not None else "-"
        lines.append(f"| {row['workload']} | {row['policy']} | {row['req_s']:.2f} | {row['vs_fcfs']:.2f}x "
                     f"[{row['vs_fcfs_range'][0]:.2f}-{row['vs_fcfs_range'][1]:.2f}] | {row['ttft_p50_ms'] / 1e3:.2f} | "
                     f"{row['tpot_p50_ms']:.0f} | {cost} | {share} |")
    return "\n".join(lines) + "\n"


def main(model: str = "512x8", requests: int = 200, rate: float = 20.0, groups: int = 20, rounds: int = 3,
         kv_tokens: int = 15360, out: str = "runs/eval") -> dict:
    import platform
    import os

    from preft.eval.results import default_of, save_run
    from preft.serving.sglang.server import sglang_python

    if requests < 10 or rate <= 0 or not 1 <= groups <= 100 or rounds < 1 or kv_tokens < 1024:
        raise ValueError("--requests must be >= 10, --rate > 0, --groups in 1..100, --rounds >= 1, "
                         "--kv-tokens >= 1024")
    python = sglang_python()  # `make sglang` first: one line if it is missing
    import subprocess

    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                             capture_output=True, text=True).stdout.strip()
    root = Path(out) / "sglang"
    root.mkdir(parents=True, exist_ok=True)
    result = run(model, root, requests, rate, groups, rounds, kv_tokens)
    flags = (("model", model), ("requests", requests), ("rate", rate), ("groups", groups), ("rounds", rounds),
             ("kv_tokens", kv_tokens), ("out", out))
    result["command"] = "preft eval sglang" + "".join(
        f" --{key.replace('_', '-')} {value}" for key, value in flags if value != default_of(main, key))
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} cores"
    result["sglang"] = version
    plot(result["rows"], root / "sglang_orders.png")
    save_run(root, "sglang", result, markdown(result), also=(root / "sglang_orders.png",))
    return result


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    add_flags(parser, main, [
        ("--model", str, "base model: '512x8' (a random-init Llama), 'default', a prepared real model or a directory"),
        ("--requests", int, "requests per run"),
        ("--rate", float, "Poisson arrival rate (req/s)"),
        ("--groups", int, "prefix groups of the shared workload (1-100)"),
        ("--rounds", int, "rounds; every policy runs once a round"),
        ("--kv-tokens", int, "SGLang's --max-total-tokens (KV for this many tokens)"),
        ("--out", str, "results directory"),
    ])
