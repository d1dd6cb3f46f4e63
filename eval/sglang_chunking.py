"""`preft eval sglang-chunks`: SLOWeave setting SGLang's prefill chunk each step (PreFT's plugin)
against SGLang's own fixed ``--chunked-prefill-size``, by SLO capacity, on SGLang.

    preft eval sglang-chunks [--model 512x8] [--workload mixed] [--tpot-ms 120] [--ttft-s 10]
                             [--chunks 64,256,1024] [--requests 40] [--start-rate 1] [--probes 4]
                             [--rounds 2] [--out runs/eval]

For each policy, its SLO capacity (:mod:`preft.eval.slo_capacity`):

    capacity = the highest Poisson rate at which >= 90% of requests meet TTFT <= ttft and
               TPOT <= tpot (a failed request counts as a miss)

found by :func:`~preft.eval.slo_capacity.search` (up or down by 1.5x from ``--start-rate`` until
one rate meets and the next does not, then halving the bracket), each probe a ``--workload``
trace of ``--requests`` requests of the same seed, its arrivals scaled to the rate, driven by
``vllm bench serve``. Every policy runs SGLang in mixed-chunk mode (``--enable-mixed-chunk``:
a step carries the running decodes and a prefill chunk, as vLLM's steps do): ``fixed:C`` is
SGLang's own ``--chunked-prefill-size C``, ``sloweave`` is ``preft serve --engine sglang
--scheduler sloweave --tpot-ms T`` (its online cost model starts from the conservative prior).
One server per policy and round serves that search's probes one after another, SGLang's cache
flushed between them (the probes share prompts); SLOWeave's cost model goes on learning across
them, as it does on a server that keeps running. A round uses a new trace seed; policies run in
an order rotated each round; the ratio of SLOWeave's capacity to the best fixed chunk's is per
round, reported as the median and range over rounds.
"""

from __future__ import annotations

import json
import re
import statistics
import urllib.request
from pathlib import Path
from typing import Any


def policy_flags(policy: str, tpot_ms: float) -> tuple[list[str], list[str]]:
    """``(preft serve flags, SGLang flags after --)`` for ``policy``: ``fixed:C`` or ``sloweave``."""
    if policy == "sloweave":
        return ["--scheduler", "sloweave", "--tpot-ms", f"{tpot_ms:g}"], []
    if policy.startswith("fixed:") and policy.split(":", 1)[1].isdigit():
        return ["--scheduler", "default"], ["--chunked-prefill-size", policy.split(":", 1)[1], "--enable-mixed-chunk"]
    raise ValueError(f"unknown policy {policy!r} for SGLang's chunks (fixed:TOKENS or sloweave)")


def flush_cache(url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", method="POST"), timeout=60) as response:
        response.read()


def prefill_tokens_per_step(log: Path) -> list[int]:
    """The new prompt tokens of every prefill step SGLang logged (``Prefill batch, ... #new-token: N``)."""
    found = re.findall(r"Prefill batch, .*?#new-token: (\d+)", log.read_text(errors="replace"))
    return [int(tokens) for tokens in found]


def latency_at(run_dir: Path, label: str, rate: float) -> dict[str, float] | None:
    """TTFT p90 (s) and TPOT p50 (ms) of the probe of ``label`` at ``rate``, from the result file
    ``vllm bench serve`` saved for it (None if that rate was not probed)."""
    path = run_dir / f"bench-{label}-{rate:.3f}.json"
    if not path.is_file():
        return None
    bench = json.loads(path.read_text())
    ttfts = sorted(t for t in bench["ttfts"] if t)
    tpots = sorted(sum(itl) / len(itl) for itl in bench["itls"] if itl)
    if not ttfts or not tpots:
        return None
    return {"ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], "tpot_p50_ms": 1e3 * statistics.median(tpots)}


def search_on_one_server(policy: str, model_dir: str, settings: dict, seed: int, run_dir: Path,
                         label: str) -> dict[str, Any]:
    """The policy's SLO capacity, every probe on one ``preft serve --engine sglang``."""
    from preft.eval.common import bench_trace, warm_up
    from preft.eval.harness.server_process import start_server, stop_server
    from preft.eval.slo_capacity import attainment, search
    from preft.serving.scheduling import workloads

    own, sglang = policy_flags(policy, settings["tpot_ms"])
    args = ["--engine", "sglang", "--model", model_dir, "--dtype", "float32", "--max-model-len",
            str(settings["max_len"]), *own, "--", "--max-running-requests", str(settings["max_running"]),
            "--max-total-tokens", str(settings["kv_tokens"]), *sglang]
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    log = run_dir / "logs" / f"server-{label}.log"
    proc, url, _ = start_server(args, log, timeout_s=300)
    tpot_s, ttft_s = settings["tpot_ms"] / 1e3, settings["ttft_s"]
    try:
        warm_up(url, [model_dir], rounds=2)

        def at(rate: float) -> float:
            work = workloads.generate(settings["workload"], settings["requests"], rate, seed=seed,
                                      max_model_len=settings["max_len"])
            trace = workloads.write_trace(work, run_dir / f"{label}-{rate:.3f}.trace.jsonl")
            flush_cache(url)
            timings = bench_trace(url, model_dir, trace, f"{label}-{rate:.3f}", run_dir)
            value = attainment(timings, len(work), ttft_s, tpot_s)
            print(f"[sglang-chunks] {label}: {rate:.2f} req/s -> {100 * value:.0f}% within the targets", flush=True)
            return value

        found = search(at, settings["start_rate"], settings["probes"])
    finally:
        stop_server(proc)
    chunks = prefill_tokens_per_step(log)
    found["prefill_steps"] = len(chunks)
    found["prefill_tokens_per_step_median"] = statistics.median(chunks) if chunks else None
    return found


def run(model: str, out: Path, settings: dict) -> dict[str, Any]:
    from transformers import AutoConfig

    from preft.eval import common

    model_dir = common.model_dir(model, out / "model")
    settings["max_len"] = AutoConfig.from_pretrained(model_dir).max_position_embeddings
    policies = settings["policies"]
    rows = []
    for round_index in range(settings["rounds"]):
        shift = round_index % len(policies)
        for policy in policies[shift:] + policies[:shift]:
            print(f"[sglang-chunks] round {round_index + 1}/{settings['rounds']}: {policy}", flush=True)
            label = f"r{round_index}-{policy.replace(':', '')}"
            found = search_on_one_server(policy, model_dir, settings, 100 + round_index, out, label)
            rows.append({"round": round_index, "policy": policy, "capacity": found["capacity"], "search": found,
                         "bracketed": found["bracket"][1] is not None})  # else a probe above it might have met too
    summary = {}
    for policy in policies:
        values = [r["capacity"] for r in rows if r["policy"] == policy]
        chunks = [r["search"]["prefill_tokens_per_step_median"] for r in rows if r["policy"] == policy
                  and r["search"].get("prefill_tokens_per_step_median") is not None]
        summary[policy] = {"median": statistics.median(values), "range": [min(values), max(values)],
                           "prefill_tokens_per_step": statistics.median(chunks) if chunks else None,
                           "lower_bound": not all(r["bracketed"] for r in rows if r["policy"] == policy)}
    ratios = []
    for round_index in range(settings["rounds"]):
        here = {r["policy"]: r["capacity"] for r in rows if r["round"] == round_index}
        best_fixed = max((value for policy, value in here.items() if policy.startswith("fixed:")), default=0.0)
        if "sloweave" in here and best_fixed > 0:
            ratios.append(here["sloweave"] / best_fixed)
    last = settings["rounds"] - 1
    probed = [{p["rate"] for p in r["search"]["probes"]} for r in rows if r["round"] == last]
    common = max(set.intersection(*probed)) if probed and set.intersection(*probed) else None
    for policy in policies:  # what each policy's requests saw at one rate every policy served
        summary[policy]["at_common_rate"] = (latency_at(out, f"r{last}-{policy.replace(':', '')}", common)
                                             if common else None)
    return {"settings": settings, "rows": rows, "summary": summary, "common_rate": common,
            "sloweave_vs_best_fixed": statistics.median(ratios) if ratios else None,
            "sloweave_vs_best_fixed_range": [min(ratios), max(ratios)] if ratios else None}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    names = list(summary)
    medians = [summary[n]["median"] for n in names]
    low = [summary[n]["median"] - summary[n]["range"][0] for n in names]
    high = [summary[n]["range"][1] - summary[n]["median"] for n in names]
    figure, axis = plt.subplots(figsize=(6, 3.6))
    axis.bar(names, medians, yerr=[low, high], capsize=4,
             color=["#dd8452" if name == "sloweave" else "#888888" for name in names])
    settings = result["settings"]
    axis.set_ylabel("SLO capacity (req/s)")
    axis.set_title(f"SGLang, {settings['workload']}: TPOT <= {settings['tpot_ms']:g} ms, TTFT <= {settings['ttft_s']:g} s")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def markdown(result: dict) -> str:
    settings = result["settings"]
    ratio = result["sloweave_vs_best_fixed"]
    lines = [
        "## SLOWeave on SGLang: against SGLang's fixed prefill chunks, by SLO capacity (`preft eval sglang-chunks`)",
        "",
        f"Command: `{result['command']}` ({result['machine']}); SGLang {result['sglang']} on the CPU (plain-torch "
        f"attention), float32, {settings['max_running']} running requests at most, {settings['kv_tokens']:,} tokens "
        f"of KV, every policy in SGLang's mixed-chunk mode. SLO capacity: the highest Poisson rate at which at least "
        f"90% of requests meet TPOT <= {settings['tpot_ms']:g} ms and TTFT <= {settings['ttft_s']:g} s, searched over "
        f"{settings['probes']} rates from {settings['start_rate']:g} req/s, each probe {settings['requests']} "
        f"`{settings['workload']}` requests driven by `vllm bench serve`. `fixed:C` is SGLang's own "
        "`--chunked-prefill-size C`; `sloweave` is `preft serve --engine sglang --scheduler sloweave --tpot-ms "
        f"{settings['tpot_ms']:g}` (online cost model from the conservative prior). One server per policy and round, "
        f"its cache flushed between probes; {settings['rounds']} rounds (a new trace seed each), median [range].", "",
        "![SLOWeave on SGLang](sglang_chunks.png)", "",
        f"| policy | SLO capacity (req/s) | prompt tokens per prefill step (median) | TTFT p90 (s) / TPOT p50 (ms) at "
        f"{result.get('common_rate') or 0:.2f} req/s, last round | probes (req/s: share within the targets), last round |",
        "|---|---|---|---|---|"]
    last = max(r["round"] for r in result["rows"])
    for policy, entry in result["summary"].items():
        probes = next(r["search"]["probes"] for r in result["rows"] if r["policy"] == policy and r["round"] == last)
        seen = ", ".join(f"{p['rate']:.2f}: {100 * p['attainment']:.0f}%" for p in probes)
        at_least = "at least " if entry["lower_bound"] else ""  # no probe of some round failed
        chunk = entry.get("prefill_tokens_per_step")
        there = entry.get("at_common_rate")
        latency = f"{there['ttft_p90_s']:.2f} / {there['tpot_p50_ms']:.0f}" if there else "-"
        lines.append(f"| {policy} | {at_least}{entry['median']:.2f} [{entry['range'][0]:.2f}-{entry['range'][1]:.2f}] "
                     f"| {f'{chunk:.0f}' if chunk is not None else '-'} | {latency} | {seen} |")
    if ratio is not None:
        low, high = result["sloweave_vs_best_fixed_range"]
        lines += ["", f"SLOWeave over the best fixed chunk, per round: **{ratio:.2f}x** [{low:.2f}-{high:.2f}]"
                  + (" (SLOWeave's capacity a lower bound: no probe of its search failed)."
                     if result["summary"].get("sloweave", {}).get("lower_bound") else ".")]
    return "\n".join(lines) + "\n"


def main(model: str = "512x8", workload: str = "mixed", tpot_ms: float = 120.0, ttft_s: float = 10.0,
         chunks: str = "64,256,1024", requests: int = 40, start_rate: float = 1.0, probes: int = 4,
         rounds: int = 2, max_running: int = 32, kv_tokens: int = 32768, out: str = "runs/eval") -> dict:
    import os
    import platform
    import subprocess

    from preft.eval.results import default_of, save_run
    from preft.serving.scheduling.workloads import KINDS
    from preft.serving.sglang.server import sglang_python

    sizes = [size.strip() for size in chunks.split(",") if size.strip()]
    if workload not in KINDS or not sizes or not all(size.isdigit() and int(size) > 0 for size in sizes):
        raise ValueError(f"--workload must be one of {', '.join(KINDS)} and --chunks positive token counts, "
                         f"e.g. 64,256,1024 (got {workload!r}, {chunks!r})")
    if tpot_ms <= 0 or ttft_s <= 0 or requests < 10 or start_rate <= 0 or probes < 1 or rounds < 1 \
            or max_running < 1 or kv_tokens < 1024:
        raise ValueError("--tpot-ms and --ttft-s must be > 0, --requests >= 10, --start-rate > 0, --probes and "
                         "--rounds >= 1, --max-running >= 1, --kv-tokens >= 1024")
    python = sglang_python()  # `make sglang` first: one line if it is missing
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                             capture_output=True, text=True).stdout.strip()
    settings = {"workload": workload, "tpot_ms": tpot_ms, "ttft_s": ttft_s, "requests": requests,
                "start_rate": start_rate, "probes": probes, "rounds": rounds, "max_running": max_running,
                "kv_tokens": kv_tokens, "policies": [f"fixed:{size}" for size in sizes] + ["sloweave"]}
    root = Path(out) / "sglang_chunks"
    root.mkdir(parents=True, exist_ok=True)
    result = run(model, root, settings)
    flags = (("model", model), ("workload", workload), ("tpot_ms", tpot_ms), ("ttft_s", ttft_s), ("chunks", chunks),
             ("requests", requests), ("start_rate", start_rate), ("probes", probes), ("rounds", rounds),
             ("max_running", max_running), ("kv_tokens", kv_tokens), ("out", out))
    result["command"] = "preft eval sglang-chunks" + "".join(
        f" --{key.replace('_', '-')} {value}" for key, value in flags if value != default_of(main, key))
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} cores"
    result["sglang"] = version
    plot(result, root / "sglang_chunks.png")
    save_run(root, "sglang_chunks", result, markdown(result), also=(root / "sglang_chunks.png",))
    return result


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    add_flags(parser, main, [
        ("--model", str, "base model: '512x8' (a random-init Llama), 'default', a prepared real model or a directory"),
        ("--workload", str, "workload kind (chat, mixed, long, bursty)"),
        ("--tpot-ms", float, "TPOT target (ms): SLOWeave's and the SLO's"),
        ("--ttft-s", float, "TTFT target (s)"),
        ("--chunks", str, "SGLang's fixed --chunked-prefill-size values to compare, comma-separated"),
        ("--requests", int, "requests per probe"),
        ("--start-rate", float, "the first rate probed (req/s)"),
        ("--probes", int, "rates probed per search"),
        ("--rounds", int, "rounds; every policy is searched once a round"),
        ("--max-running", int, "SGLang's --max-running-requests"),
        ("--kv-tokens", int, "SGLang's --max-total-tokens (KV for this many tokens)"),
        ("--out", str, "results directory"),
    ])
