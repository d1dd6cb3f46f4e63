"""`preft eval serve`: online serving, PreFT against all-token adapters and the base model alone,
driven by vLLM's own benchmark client.

    preft eval serve [--adapters 1,8] [--rank 16] [--kinds lora] [--variants preft,all-token,base]
                     [--request-rate inf,16] [--num-prompts 128] [--input-len 32] [--output-len 64]
                     [--slo ttft:2000,tpot:100] [--slots S] [--host-adapters H]
                     [--lora-assignment round-robin|random] [--schedulers default,groups]
                     [--model default] [--out runs/eval]

For each adapter kind (``lora``: rank-R LoRA on every projection; ``reft``: rank-R LoReFT on
every layer) it exports N bundles with random weights against the base model, then for each
variant starts a real ``preft serve`` (``preft``: adapters on prompt tokens only;
``all-token``: the same bundles with ``--all-token``, standard multi-adapter serving) and runs
``vllm bench serve`` against it (:mod:`preft.eval.vllm_bench`). ``base`` is the same benchmark
with every request for the base model, on each of those servers just before its adapter runs
(the same engine, its adapters unused, so every ratio to base is measured side by side; a server
of its own when no adapter variant is asked for). The benchmark uses vLLM's
``random`` data set of ``--input-len`` / ``--output-len`` tokens (``--ignore-eos``), Poisson
arrivals at each ``--request-rate``, and per-request adapters through its ``--lora-modules`` with
``--lora-assignment round-robin``, so request i uses adapter i % N; one server per variant
serves every adapter count N of ``--adapters`` (its first N adapters). (ReFT-P adapters are named
in ``model`` like LoRA ones: ``preft serve`` routes them.) Goodput is vLLM's ``--goodput``
from ``--slo``: the rate of requests meeting every SLO.

``--slots S`` gives the engine S adapter slots (``--max-adapters S``) for N > S adapters, all
kept in host memory (vLLM's ``--max-cpu-loras N``; ``--host-adapters H``: H of them, the rest
read from disk when needed): a prefill-only request gives its slot back when its prompt is done,
an all-token one holds it to its last token. The scheduler's trace gives the distinct LoRA
adapters active in each step (mean and max per run). ``--lora-assignment random`` draws each
request's adapter (vLLM's seeded draw) instead of request i using adapter i % N.
``--schedulers`` runs the PreFT variant once per ``preft serve --scheduler`` named (each its
own server, e.g. ``default,groups``: vLLM's order against the adapter-group admission order).

Every run is repeated ``--rounds`` times, the order rotated each round, because these machines'
speed drifts by tens of percent within minutes: the figures are medians over the rounds, and a
ratio to base is the median of per-round ratios (runs moments apart), with its range. Each run's
full vLLM result JSON is kept in ``OUT/serve/vllm/``; ``OUT/serve/results.json`` and
``serve.md`` put throughput, TTFT/TPOT percentiles and goodput side by side, with ratios to base,
and ``serve.png`` plots them. The offline counterpart is ``preft bench throughput``.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import preft
from preft.eval.common import warm_up
from preft.eval.results import save_run
from preft.serving.scheduling.spec import SchedulerSpec

VARIANTS = {"preft": "PreFT (prompt tokens only)", "all-token": "all-token (standard multi-adapter)",
            "base": "base model alone"}
KINDS = {"lora": "LoRA", "reft": "LoReFT"}
METRICS = ("request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
           "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_e2el_ms", "completed", "failed",
           "total_output_tokens", "duration")


def parse_slo(text: str) -> dict[str, float]:
    """``ttft:MS,tpot:MS`` (any of vLLM's ttft, tpot, e2el) -> ``{"ttft": MS, ...}``."""
    slo = {}
    for part in str(text).split(","):
        name, sep, value = part.partition(":")
        try:
            if not sep or name.strip() not in ("ttft", "tpot", "e2el") or float(value) <= 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"--slo {text!r}: expected comma-separated NAME:MS with NAME one of ttft, tpot, e2el "
                             "and MS > 0") from None
        slo[name.strip()] = float(value)
    return slo


def make_bundles(model_path: str, kind: str, count: int, rank: int, root: Path) -> list[str]:
    """``count`` bundles of ``kind`` with random weights (seeded by index), exported against the base."""
    from preft.eval.bench.throughput import make_bundles as export_random

    if kind == "lora":
        def make():
            # every linear module of the decoder, whatever the family calls them (Phi-3's are packed)
            return preft.PreftLoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                         init_lora_weights=False)
    else:
        def make():
            return preft.PreftReftConfig(rank=rank, intervention="loreft", init_weights=False)
    return export_random(model_path, count, make, root, kind)


def bench_serve(url: str, model_name: str, tokenizer: str, adapters: list[str], rate: float,
                settings: dict[str, Any], result_dir: Path, result_name: str, log: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` run at ``rate`` requests/s over ``adapters`` (none: the base model),
    in this process (:func:`~preft.eval.vllm_bench.serve_in_process`); its result JSON."""
    from preft.eval.vllm_bench import serve_in_process

    slo = settings["slo"]
    command = ["--backend", "openai", "--base-url", url,
               "--endpoint", "/v1/completions", "--model", model_name, "--tokenizer", tokenizer,
               "--dataset-name", "random", "--random-input-len", str(settings["input_len"]),
               "--random-output-len", str(settings["output_len"]), "--num-prompts", str(settings["num_prompts"]),
               "--request-rate", f"{rate:g}", "--ignore-eos", "--seed", str(settings["seed"]),
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
               "--goodput", *[f"{name}:{ms:g}" for name, ms in slo.items()],
               "--save-result", "--result-dir", str(result_dir), "--result-filename", result_name,
               "--disable-tqdm"]
    if settings["max_concurrency"]:
        command += ["--max-concurrency", str(settings["max_concurrency"])]
    if adapters:
        command += ["--lora-modules", *adapters, "--lora-assignment", settings["lora_assignment"]]
    serve_in_process(command, log, settings["timeout_s"])
    return json.loads((result_dir / result_name).read_text())


def serve_and_bench(variant: str, kind: str | None, bundles: list[str], settings: dict[str, Any], out: Path,
                    with_base: bool, scheduler: str = "default") -> list[dict]:
    """Start ``preft serve`` for ``variant`` with ``bundles`` and run the benchmark for every adapter
    count N (requests over its first N adapters) and rate and, if ``with_base``, per rate with
    requests for the base model on the same server (a like-for-like base: the same engine, the
    adapters unused). Every run happens once per round, ``settings["rounds"]`` rounds, the order
    rotated each round; a row holds the median of each metric over the rounds and, for an adapter
    run, ``vs_base``: the median over rounds of its throughput over that round's base run (the
    machine's speed drifts: ratios are taken moments apart)."""
    from preft.eval.harness.server_process import start_server, stop_server

    names = [f"{kind}{i}" for i in range(len(bundles))]
    slots = settings["slots"] or max(1, len(bundles))  # --slots S: fewer adapter slots than adapters
    args = ["--model", settings["model"], "--max-model-len", str(settings["input_len"] + settings["output_len"] + 8),
            "--max-adapters", str(slots), "--max-rank", str(settings["rank"]),
            "--kv-cache-gib", str(settings["kv_cache_gib"]), "--dtype", settings["dtype"]]
    for name, bundle in zip(names, bundles):
        args += ["--adapter", f"{name}={bundle}"]
    if variant == "all-token":
        args.append("--all-token")
    if scheduler != "default":
        args += ["--scheduler", scheduler]
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    label = (f"{kind}-{variant}" if kind else "base") + (f"-{scheduler}" if scheduler != "default" else "")
    # every adapter stays in host memory (preft serve --max-host-adapters, vLLM's --max-cpu-loras;
    # --host-adapters: that many) while only `slots` of them are in the engine at once: the regime
    # of a GPU whose memory holds a few adapters' weights
    if bundles:
        args += ["--max-host-adapters", str(max(slots, settings["host_adapters"] or len(bundles)))]
    step_trace = logs / f"slots-{label}.trace"
    step_trace.unlink(missing_ok=True)
    # preft serve copies and checks every bundle into its store before vLLM starts: 1,024 SmolLM2
    # r=16 bundles (19 MB each) took longer than the 240 s a server without adapters is given
    proc, url, ready_s = start_server([*args, "--", "--max-num-seqs", str(settings["max_num_seqs"])],
                                      logs / f"server-{label}.log", timeout_s=240 + 0.5 * len(bundles),
                                      env={"PREFT_TRACE_SCHEDULER": str(step_trace)})
    from preft.real_models import resolve, served_name as short_name

    tokenizer = resolve(settings["model"])
    served_name = short_name(settings["model"]) or str(Path(settings["model"]))  # as preft serve names it
    runs = []  # (variant, kind, adapter names, rate)
    for rate in settings["rates"]:
        runs += [("base", None, [], rate)] if with_base else []
        runs += [(variant, kind, names[:count], rate) for count in settings["counts"]] if kind else []
    results: dict[int, list[dict]] = {index: [] for index in range(len(runs))}
    try:
        warm_up(url, [served_name, *names])
        for round_index in range(settings["rounds"]):  # every run once a round, the order rotated
            shift = round_index % len(runs)
            for index in list(range(len(runs)))[shift:] + list(range(len(runs)))[:shift]:
                run_variant, run_kind, run_names, rate = runs[index]
                run_label = (f"{label}-{'base' if run_kind is None and kind else 'n' + str(len(run_names))}"
                             f"-rate{rate:g}-round{round_index}")
                seen = trace_lines(step_trace)
                results[index].append(bench_serve(url, served_name, tokenizer, run_names, rate, settings,
                                                  out / "vllm", f"{run_label}.json", logs / f"bench-{run_label}.log")
                                      | {"result_file": f"vllm/{run_label}.json",
                                         "active_adapters": active_adapters(step_trace, seen)})
    finally:
        stop_server(proc)
    rows = []
    for index, (run_variant, run_kind, run_names, rate) in enumerate(runs):
        rows.append({"variant": run_variant, "kind": run_kind, "server": label, "adapters": len(run_names),
                     "scheduler": scheduler,
                     "request_rate": rate, "rank": settings["rank"] if run_kind else None,
                     "slots": slots if run_kind else None,
                     "active_adapters_mean": median(r["active_adapters"]["mean"] for r in results[index]),
                     "active_adapters_max": max((r["active_adapters"]["max"] for r in results[index]
                                                 if r["active_adapters"]["max"] is not None), default=None),
                     "server_ready_s": round(ready_s, 1), "rounds": len(results[index]),
                     "result_files": [r["result_file"] for r in results[index]],
                     **{m: median(r.get(m) for r in results[index]) for m in METRICS}})
        if run_variant != "base" and with_base:  # per round, to the base run of that round
            base_index = runs.index(("base", None, [], rate))
            ratios = [r["output_throughput"] / b["output_throughput"] for r, b in zip(results[index],
                                                                                      results[base_index])]
            rows[-1].update(vs_base=statistics.median(ratios), vs_base_range=[min(ratios), max(ratios)])
    return rows


def trace_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def active_adapters(path: Path, skip: int) -> dict[str, float | None]:
    """Over one run's engine steps (the scheduler's trace after its first ``skip`` lines): the
    distinct LoRA adapters each step runs with (the slots it uses), mean and max; ReFT-P
    requests hold no LoRA slot and count 0 here."""
    lines = path.read_text().splitlines()[skip:] if path.exists() else []
    active = [int(line.split()[2]) for line in lines if len(line.split()) == 3]
    return {"mean": statistics.mean(active) if active else None, "max": max(active) if active else None}


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def base_row(rows: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any] | None:
    """The base model's row on ``row``'s server at its rate (measured in the same rounds)."""
    return next((r for r in rows if r["variant"] == "base" and r["server"] == row["server"]
                 and r["request_rate"] == row["request_rate"]), None)


def active_text(row: dict[str, Any]) -> str:
    if row.get("active_adapters_mean") is None or row["kind"] != "lora":
        return "-"
    return f"{row['active_adapters_mean']:.1f} / {row['active_adapters_max']}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| variant | adapters | rate (req/s) | output tok/s | vs base | req/s | goodput req/s | "
            "TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | active adapters per step |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "1.00x" if r["variant"] == "base" else (
            f"{r['vs_base']:.2f}x [{r['vs_base_range'][0]:.2f}-{r['vs_base_range'][1]:.2f}]" if "vs_base" in r else "-")
        name = VARIANTS[r["variant"]] + (f", {KINDS[r['kind']]} r={r['rank']}" if r["kind"] else "")
        name += f", --scheduler {r['scheduler']}" if r.get("scheduler", "default") != "default" and \
            r["variant"] != "base" else ""
        name += f" (on the {r['server']} server)" if r["variant"] == "base" and r["server"] != "base" else ""
        lines.append(f"| {name} | {r['adapters']} | {r['request_rate']:g} | {r['output_throughput']:.1f} | {ratio} | "
                     f"{r['request_throughput']:.2f} | {(r['request_goodput'] or 0):.2f} | "
                     f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                     f"{r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} | {active_text(r)} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [(f"{r['kind']} {r['variant']}" if r["kind"] else f"base ({r['server']})") +
              f"\nN={r['adapters']}, {r['request_rate']:g}/s" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(max(11, 1.1 * len(rows) * 3), 3.8))
    panels = [("output_throughput", "output tokens/s"), ("median_ttft_ms", "TTFT p50 (ms)"),
              ("median_tpot_ms", "TPOT p50 (ms)")]
    for ax, (key, name) in zip(axes, panels):
        ax.bar(labels, [r[key] for r in rows], color=["C0" if r["variant"] == "preft" else "C1" if r["variant"] ==
                                                      "all-token" else "C7" for r in rows])
        ax.set_title(name, fontsize=10)
        ax.tick_params(axis="x", rotation=30, labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(model: str = "default", adapters: str = "8", rank: int = 16, kinds: str = "lora",
         variants: str = "preft,all-token,base", request_rate: str = "inf", num_prompts: int = 128,
         input_len: int = 32, output_len: int = 64, max_concurrency: int = 0, slo: str = "ttft:2000,tpot:100",
         rounds: int = 3, seed: int = 0, slots: int = 0, host_adapters: int = 0,
         lora_assignment: str = "round-robin", schedulers: str = "default", dtype: str = "auto",
         out: str = "runs/eval") -> dict[str, Any]:
    from preft.eval.common import parse_list
    from preft.recipes.common import resolve_model

    started = time.time()
    variant_list, kind_list = parse_list(variants, str, "variants"), parse_list(kinds, str, "kinds")
    counts = parse_list(str(adapters), int, "adapters")
    rates = parse_list(str(request_rate), float, "request-rate")
    for given, known, flag in ((variant_list, VARIANTS, "variants"), (kind_list, KINDS, "kinds")):
        unknown = [v for v in given if v not in known]
        if unknown:
            raise ValueError(f"--{flag}: unknown {unknown} (choose from {', '.join(known)})")
    if min(*counts, rank, num_prompts, input_len, output_len, rounds) < 1 or max_concurrency < 0 or min(rates) <= 0 \
            or slots < 0 or host_adapters < 0:
        raise ValueError("--adapters, --rank, --num-prompts, --input-len, --output-len, --rounds and --request-rate must be "
                         "> 0 (--max-concurrency, --slots and --host-adapters >= 0)")
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype {dtype!r}: choose auto, float32, bfloat16 or float16")
    if lora_assignment not in ("round-robin", "random"):
        raise ValueError(f"--lora-assignment {lora_assignment!r}: choose round-robin or random")
    scheduler_list = parse_list(schedulers, str, "schedulers")
    for name in scheduler_list:
        try:  # a bad name fails before any server starts
            spec = SchedulerSpec.parse(name)
        except ValueError as err:
            raise ValueError(f"--schedulers: {err}") from None
        if spec.sloweave:
            raise ValueError(f"--schedulers {name}: SLOWeave needs a TPOT target; use preft eval goodput")
    settings = {"model": model, "rank": rank, "slo": parse_slo(slo), "input_len": input_len, "output_len": output_len,
                "num_prompts": num_prompts, "counts": counts, "rates": rates, "max_concurrency": max_concurrency,
                "seed": seed, "rounds": rounds, "slots": slots, "max_num_seqs": max(8, min(num_prompts, 256)),
                "host_adapters": host_adapters, "lora_assignment": lora_assignment,
                "kv_cache_gib": 1, "timeout_s": 1800, "dtype": dtype}
    model_path = resolve_model(model)
    serve_dir = Path(out) / "serve"
    serve_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="preft-eval-serve-") as tmp:
        # one server per (kind, adapter variant); the base model is measured on each of them, just
        # before its adapter runs (the same engine, requests without adapters: ratios side by side),
        # or alone if no adapter variant is asked for
        servers = [(v, k, s) for k in kind_list for v in variant_list if v != "base"
                   for s in (scheduler_list if v == "preft" else ["default"])] or [("base", None, "default")]
        with_base = "base" in variant_list
        for index, (variant, kind, scheduler) in enumerate(servers, 1):
            bundles = []
            if kind is not None:
                kind_dir = Path(tmp) / kind
                if not kind_dir.is_dir():
                    kind_dir.mkdir()
                    make_bundles(model_path, kind, max(counts), rank, kind_dir)
                bundles = sorted((str(p) for p in kind_dir.glob(f"{kind}_bundle*")),
                                 key=lambda p: int(p.rsplit("bundle", 1)[1]))
            print(f"[eval serve {index}/{len(servers)}] {VARIANTS[variant]}" + (
                f", {len(bundles)} {KINDS[kind]} adapters" if kind else "") + (
                " (and the base model on the same server)" if with_base and kind else "") +
                (f", --scheduler {scheduler}" if scheduler != "default" else "") +
                f" ({time.time() - started:.0f} s so far)", flush=True)
            rows += serve_and_bench(variant, kind, bundles, settings, serve_dir, with_base=with_base,
                                    scheduler=scheduler)
    command = (f"preft eval serve --adapters {adapters} --rank {rank} --kinds {kinds} --variants {variants} "
               f"--request-rate {request_rate} --num-prompts {num_prompts} --input-len {input_len} "
               f"--output-len {output_len} --slo {slo} --rounds {rounds}" + (f" --max-concurrency {max_concurrency}"
                                                            if max_concurrency else "")
               + (f" --slots {slots}" if slots else "") + (f" --host-adapters {host_adapters}" if host_adapters else "")
               + (f" --lora-assignment {lora_assignment}" if lora_assignment != "round-robin" else "")
               + (f" --schedulers {schedulers}" if scheduler_list != ["default"] else "")
               + (f" --dtype {dtype}" if dtype != "auto" else "") + f" --model {model}")
    import platform

    import vllm

    result = {"command": command, "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
              "vllm": vllm.__version__, "settings": {k: v for k, v in settings.items() if k != "timeout_s"},
              "rows": rows, "wall_time_s": round(time.time() - started, 1)}
    markdown = (f"## Online serving: PreFT vs all-token vs base (`vllm bench serve`)\n\nCommand: `{command}` "
                f"({result['machine']}, vLLM {result['vllm']}). " + (
                    "With N adapters request i uses adapter i % N (`--lora-assignment round-robin`)"
                    if lora_assignment == "round-robin" else "Each request's adapter drawn at random of the N "
                    "(`--lora-assignment random`, seeded)") + f"; goodput: requests meeting {slo}. {rounds} rounds, every run once "
                f"a round in a rotated order; each figure is the median over the rounds, and each ratio the median "
                f"of per-round ratios to the base model on the same server at the same rate [their range]."
                + (f" {slots} adapter slots (`--max-adapters {slots}`; " + (
                    f"{max(slots, host_adapters)} adapters kept in host memory, vLLM's `--max-cpu-loras`, the others "
                    "read from disk when a step needs them" if host_adapters else
                    "every adapter kept in host memory, vLLM's `--max-cpu-loras`") + "); active adapters: the distinct LoRA adapters holding a slot per engine "
                   f"step, mean / max over the run." if slots else "") + f"\n\n{table(rows)}\n")
    plot(rows, serve_dir / "serve.png", f"rank {rank}, {num_prompts} requests of {input_len}+{output_len} tokens "
                                        "per run")
    save_run(serve_dir, "serve", result, markdown, also=(serve_dir / "serve.png",))
    return result


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    add_flags(parser, main, [
        ("--model", str, "base model: 'default', a prepared real model (preft models list) or a local model directory (Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3, OLMo 2)"),
        ("--adapters", str, "comma-separated adapter counts N (request i uses adapter i %% N)"),
        ("--rank", int, "adapter rank"),
        ("--kinds", str, f"comma-separated adapter kinds, of {', '.join(KINDS)}"),
        ("--variants", str, f"comma-separated, of {', '.join(VARIANTS)}"),
        ("--request-rate", str, "comma-separated requests per second (Poisson arrivals; inf = all at once)"),
        ("--num-prompts", int, "requests per run"),
        ("--input-len", int, "prompt tokens per request"),
        ("--output-len", int, "output tokens per request (EOS ignored)"),
        ("--max-concurrency", int, "most requests in flight (0 = no limit)"),
        ("--slots", int, "adapter slots in the engine (--max-adapters; 0 = one per adapter); fewer slots than "
                         "adapters is the GPU norm"),
        ("--host-adapters", int, "with --slots: adapters kept in host memory (--max-cpu-loras; 0 = every one)"),
        ("--lora-assignment", str, "round-robin (request i: adapter i %% N) or random (seeded)"),
        ("--schedulers", str, "comma-separated preft serve --scheduler names for the PreFT variant (one server "
                              "each), e.g. default,groups"),
        ("--slo", str, "goodput SLOs, NAME:MS comma-separated (ttft, tpot, e2el)"),
        ("--rounds", int, "rounds: each run once a round, order rotated; medians over rounds"),
        ("--seed", int, "the random data set's seed"),
        ("--dtype", str, "the servers' dtype (preft serve --dtype; auto: bfloat16 on a CPU with native bfloat16, "
                         "else float32)"),
        ("--out", str, "results directory"),
    ])
