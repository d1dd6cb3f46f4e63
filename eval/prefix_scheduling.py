"""`preft eval prefix --parts scheduling`: FCFS vs LPM vs Feather (vs Feather+SLOWeave) on the
shared-prefix workloads, in the simulator and on the real engine.

**Simulator** (the served step cost model of ``--model``, a prefix cache of ``--cache-blocks``
blocks of 128 tokens, as vLLM's CPU blocks are, so the prefix groups do not all fit beside the
running requests). A decode whose prompt block another decode of the step also reads is costed
at ``shared_context_cost`` of a distinct one (:class:`~preft.serving.scheduling.simulator.Simulator`),
derived from the ``decode-batch`` measurement: the cost model is linear in the context ``x`` of
a decode-only step, so the measured ratio ``r`` of a B-request batch sharing an L-token prefix
to the same batch with distinct prompts gives

    shared_context_cost = 1 − (1 − r) · T(B, 0, x_distinct) / (∂T/∂x · (B − 1) · L)

Workloads (:func:`~preft.serving.scheduling.workloads.prefix_workload`, seeded): ``shared``
(``--groups`` prefix groups), ``per-user`` (one system prompt, 8 users' prefill-only adapters
starting at its end; also run with adapter-keyed prefixes, as all-token adapters must be), and
``no-sharing``. Each at two rates: overload (every request queued at once: throughput) and 0.8
of FCFS's throughput (goodput at TTFT/TPOT targets from the cost model: TTFT 10x the step that
prefills a 512-token prompt, TPOT 3x a 32-request decode step). Feather learns online from an
empty table, and again from a table pretrained on another seed of the same workload
(``feather_state.json``, usable as ``preft serve --feather-state``).

**Engine**: ``preft serve --scheduler P -- --num-gpu-blocks-override N`` driven by ``vllm bench
serve --dataset-name timed_trace`` with the ``shared`` and ``no-sharing`` workloads (prompts
rebuilt from the trace's hash ids, so the groups share real tokens) at overload; Feather starts
from the pretrained table. The simulator replays the same traces beside.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 128  # vLLM's CPU KV block
ORDERS = ("fcfs", "lpm", "feather", "feather+sloweave")


def shared_context_cost(cost_model, decode: dict) -> float:
    """From the ``decode-batch`` measurement (module docstring), clipped to [0, 1]."""
    batch, prefix = decode["batch"], decode["prefix_tokens"]
    context = batch * (prefix + 8 + decode["decode_tokens"] // 2)
    slope = cost_model(batch, 0, context + 1000) - cost_model(batch, 0, context)  # per 1000 tokens
    saved = (1.0 - decode["shared_vs_distinct"]) * cost_model(batch, 0, context)
    duplicated = (batch - 1) * prefix
    if slope <= 0 or duplicated <= 0:  # the model has no context term to discount: nothing carried
        return 1.0
    return min(1.0, max(0.0, 1.0 - saved / (slope * duplicated / 1000)))


def targets(cost_model) -> tuple[float, float]:
    gap = cost_model.meta.get("gap_s", 0.0)
    return 10 * (cost_model(0, 512, 0) + gap), 3 * (cost_model(32, 0, 32 * 300) + gap)


def simulate(order: str, work, cost_model, settings: dict, bandit=None, rules=None, cache_blocks=None):
    from preft.serving.scheduling.admission import make_admission
    from preft.serving.scheduling.chunk_policies import make_policy
    from preft.serving.scheduling.spec import SchedulerSpec
    from preft.serving.scheduling.prefix_cache import PrefixCache
    from preft.serving.scheduling.simulator import Simulator

    spec = SchedulerSpec.parse(order)
    admission, chunk = spec.admission, spec.chunk_policy
    policy = make_policy(chunk, cost_model=cost_model, tpot_s=settings["tpot_s"], max_chunk=settings["max_chunk"])
    blocks = cache_blocks or settings["cache_blocks"]
    simulator = Simulator(cost_model, policy, max_num_seqs=settings["max_num_seqs"],
                          max_num_batched_tokens=settings["max_num_batched_tokens"],
                          admission=lambda cache: make_admission(admission, cache=cache, bandit=bandit),
                          prefix_cache=lambda: PrefixCache(blocks, BLOCK_TOKENS), adapter_rules=rules or {},
                          shared_context_cost=settings["shared_context_cost"])
    return simulator.run(work)


def summary(result, settings: dict) -> dict:
    from preft.serving.scheduling.metrics import summarize

    out = summarize(result.timings, settings["ttft_s"], settings["tpot_s"])
    return {k: out[k] for k in ("request_throughput", "output_throughput", "goodput", "slo_attainment",
                                "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50")}


def pretrain_feather(cost_model, settings: dict, path: Path):
    """Feather's table learned in the simulator on another seed of the shared workload."""
    from preft.serving.scheduling import workloads
    from preft.serving.scheduling.feather import FeatherBandit

    bandit = FeatherBandit()
    for seed in (101, 102):
        work = workloads.prefix_workload("shared", settings["requests"], rate=1000.0, groups=settings["groups"],
                                         seed=seed, max_model_len=settings["max_len"])
        simulate("feather", work, cost_model, settings, bandit=bandit)
    bandit.save(path)
    return bandit


def simulator_rows(cost_model, settings: dict, state_path: Path) -> list[dict]:
    from preft.rule import AdapterRule
    from preft.serving.scheduling import workloads
    from preft.serving.scheduling.feather import FeatherBandit

    rows = []
    system = settings["max_len"] * 60 // 100
    prefill_only = {f"user{i}": AdapterRule(prefill_only=True, adapter_start=system) for i in range(8)}
    cases = [("shared", {}), ("per-user", prefill_only), ("per-user (adapter-keyed)", {}), ("no-sharing", {})]
    for label, rules in cases:
        variant = label.split(" ")[0]
        overload = workloads.prefix_workload(variant, settings["requests"], rate=1000.0, groups=settings["groups"],
                                             max_model_len=settings["max_len"])
        fcfs_rate = summary(simulate("fcfs", overload, cost_model, settings, rules=rules),
                            settings)["request_throughput"]
        loaded = workloads.prefix_workload(variant, settings["requests"], rate=0.8 * fcfs_rate,
                                           groups=settings["groups"], max_model_len=settings["max_len"])
        for order in (*ORDERS, "feather (pretrained)"):
            cells = {}
            for load, work in (("overload", overload), ("0.8", loaded)):
                bandit = FeatherBandit.load(state_path) if "pretrained" in order else FeatherBandit()
                result = simulate(order.split(" ")[0], work, cost_model, settings, bandit=bandit, rules=rules)
                cells[load] = summary(result, settings)
            rows.append({"workload": label, "order": order, "overload": cells["overload"], "loaded": cells["0.8"],
                         "loaded_rate": 0.8 * fcfs_rate})
            print(f"[prefix] simulator {label:26s} {order:22s} overload {cells['overload']['request_throughput']:.2f}"
                  f" req/s; at {0.8 * fcfs_rate:.2f} req/s goodput {cells['0.8']['goodput']:.2f}", flush=True)
    return rows


def engine_rows(cost_model, settings: dict, model_dir: str, state_path: Path, out: Path) -> list[dict]:
    """Every (workload, order) on the real engine, ``engine_rounds`` times; within a round each
    workload's orders run one after another (their order rotated each round), so a ratio to
    FCFS is taken between runs minutes apart, and the median over rounds is reported with the
    range of the per-round ratios."""
    import statistics

    from preft.eval.common import serve_trace
    from preft.serving.scheduling import workloads
    from preft.serving.scheduling.feather import FeatherBandit
    from preft.serving.scheduling.metrics import summarize
    from preft.serving.scheduling.spec import SchedulerSpec

    engine_dir = out / "engine"
    engine_dir.mkdir(parents=True, exist_ok=True)
    serve_settings = {"max_len": settings["max_len"], "max_num_seqs": settings["max_num_seqs"],
                      "max_num_batched_tokens": settings["max_num_batched_tokens"]}
    cases = (("shared", ORDERS), ("no-sharing", ("fcfs", "feather")))
    works, runs = {}, {}
    for variant, _ in cases:
        works[variant] = workloads.prefix_workload(variant, settings["engine_requests"], rate=settings["engine_rate"],
                                                   groups=settings["engine_groups"], seed=7,
                                                   max_model_len=settings["max_len"])
        workloads.write_trace(works[variant], engine_dir / f"{variant}.trace.jsonl")
    for round_index in range(settings["engine_rounds"]):
        for variant, orders in cases:
            shift = round_index % len(orders)
            for order in orders[shift:] + orders[:shift]:
                label = f"{variant}-{order.replace('+', '-')}-r{round_index}"
                args = ["--scheduler", "default" if order == "fcfs" else order]
                parsed = SchedulerSpec.parse(order)
                if parsed.sloweave:
                    args += ["--tpot-ms", f"{1e3 * settings['tpot_s']:.3f}", "--cost-model", settings["cost_model"],
                             "--max-chunk", str(settings["max_chunk"])]
                if parsed.admission == "feather":  # from the pretrained table; the run's copy learns on
                    copy = engine_dir / f"feather_state-{label}.json"
                    shutil.copyfile(state_path, copy)
                    args += ["--feather-state", str(copy)]
                print(f"[prefix] engine round {round_index + 1}/{settings['engine_rounds']}: {variant} {order}, "
                      f"{len(works[variant])} requests", flush=True)
                timings, steps = serve_trace(model_dir, args, engine_dir / f"{variant}.trace.jsonl", label,
                                             engine_dir, serve_settings,
                                             vllm_extra=("--num-gpu-blocks-override", str(settings["engine_blocks"])))
                runs.setdefault((variant, order), []).append(
                    (summarize(timings, settings["ttft_s"], settings["tpot_s"]), len(timings),
                     _median([s["n"] for s in steps if s["c"] == 0])))
    rows = []
    for variant, orders in cases:
        for order in orders:
            bandit = FeatherBandit.load(state_path) if SchedulerSpec.parse(order).admission == "feather" else None
            predicted = summary(simulate(order, works[variant], cost_model, settings, bandit=bandit,
                                         cache_blocks=settings["engine_blocks"]), settings)
            measured = runs[(variant, order)]
            ratios = [m[0]["request_throughput"] / f[0]["request_throughput"]
                      for m, f in zip(measured, runs[(variant, "fcfs")])]
            rows.append({"workload": variant, "order": order, "requests": [m[1] for m in measured],
                         "engine": {k: statistics.median(m[0][k] for m in measured) for k in predicted},
                         "simulator": predicted, "vs_fcfs": statistics.median(ratios),
                         "vs_fcfs_range": [min(ratios), max(ratios)],
                         "per_round_req_s": [m[0]["request_throughput"] for m in measured],
                         "median_decodes": statistics.median(m[2] for m in measured)})
    return rows


def _median(values: list) -> float:
    import statistics

    return statistics.median(values) if values else float("nan")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    orders = list(dict.fromkeys(r["order"] for r in rows))
    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    width = 0.8 / len(orders)
    for index, order in enumerate(orders):
        values = [next(r["overload"]["request_throughput"] for r in rows if r["workload"] == w and r["order"] == order)
                  for w in workloads]
        ax.bar([i + index * width for i in range(len(workloads))], values, width, label=order)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads, fontsize=8)
    ax.set_ylabel("throughput at overload (req/s)")
    ax.set_title("simulator: admission orders on the prefix workloads", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(result: dict) -> list[str]:
    settings = result["settings"]
    lines = [f"**Admission orders in the simulator** ({settings['requests']} requests per point, "
             f"{settings['groups']} prefix groups, prefix cache {settings['cache_blocks']} blocks of {BLOCK_TOKENS} "
             f"tokens, max {settings['max_num_seqs']} running; shared decode context costed at "
             f"{settings['shared_context_cost']:.2f} of distinct, from the decode-batch measurement; targets TTFT "
             f"{1e3 * settings['ttft_s']:.0f} ms, TPOT {1e3 * settings['tpot_s']:.0f} ms):\n",
             "![admission orders](prefix_orders.png)\n",
             "| workload | order | throughput at overload (req/s) | vs FCFS | goodput at 0.8 of FCFS (req/s) | "
             "TTFT p50 at 0.8 (ms) |", "|---|---|---|---|---|---|"]
    for row in result["simulator"]:
        fcfs = next(r for r in result["simulator"] if r["workload"] == row["workload"] and r["order"] == "fcfs")
        ratio = row["overload"]["request_throughput"] / fcfs["overload"]["request_throughput"]
        lines.append(f"| {row['workload']} | {row['order']} | {row['overload']['request_throughput']:.2f} | "
                     f"{ratio:.2f}x | {row['loaded']['goodput']:.2f} | {row['loaded']['ttft_ms_p50']:.0f} |")
    lines.append("")
    if result.get("engine"):
        lines += [f"**Admission orders on the real engine** (`preft serve --scheduler P -- --num-gpu-blocks-override "
                  f"{settings['engine_blocks']}`, {settings['engine_requests']} requests of {settings['engine_groups']}"
                  f" prefix groups offered at {settings['engine_rate']:g} req/s by `vllm bench serve --dataset-name "
                  f"timed_trace`, {settings['engine_rounds']} rounds: medians, per-round ratio range in brackets; "
                  f"Feather from the pretrained table; the simulator on the same trace beside):\n",
                  "| workload | order | engine req/s | simulator req/s | engine vs FCFS | engine TTFT p50 (ms) | "
                  "engine TPOT p50 (ms) | median decodes / step |", "|---|---|---|---|---|---|---|---|"]
        for row in result["engine"]:
            low, high = row["vs_fcfs_range"]
            lines.append(f"| {row['workload']} | {row['order']} | {row['engine']['request_throughput']:.2f} | "
                         f"{row['simulator']['request_throughput']:.2f} | {row['vs_fcfs']:.2f}x [{low:.2f}-{high:.2f}] | "
                         f"{row['engine']['ttft_ms_p50']:.0f} | {row['engine']['tpot_ms_p50']:.1f} | "
                         f"{row['median_decodes']:.0f} |")
        lines.append("")
    return lines


def run(model: str, out: Path, decode: dict, requests: int, groups: int, cache_blocks: int, engine: bool,
        engine_requests: int, engine_rate: float, engine_blocks: int, engine_rounds: int = 3) -> dict[str, Any]:
    from transformers import AutoConfig

    from preft.eval import common

    from preft.eval import profile as eval_profile
    from preft.serving.scheduling.cost_model import StepCostModel

    model_dir = common.model_dir(model, out.parent / "profile")
    cost_path = eval_profile.served_cost_model(model, model_dir, out.parent, "prefix")
    cost_model = StepCostModel.load(cost_path)
    ttft_s, tpot_s = targets(cost_model)
    settings = {"requests": requests, "groups": groups, "cache_blocks": cache_blocks, "max_num_seqs": 64,
                "max_num_batched_tokens": 2048 + 256, "max_chunk": 2048, "ttft_s": ttft_s, "tpot_s": tpot_s,
                "max_len": AutoConfig.from_pretrained(model_dir).max_position_embeddings,
                "shared_context_cost": shared_context_cost(cost_model, decode), "cost_model": str(cost_path),
                "engine_requests": engine_requests, "engine_rate": engine_rate, "engine_blocks": engine_blocks,
                "engine_rounds": engine_rounds,
                "engine_groups": max(1, min(groups, engine_requests // 10))}
    state_path = out / "feather_state.json"
    pretrain_feather(cost_model, settings, state_path)
    result: dict[str, Any] = {"settings": settings, "feather_state": str(state_path)}
    result["simulator"] = simulator_rows(cost_model, settings, state_path)
    plot(result["simulator"], out / "prefix_orders.png")
    if engine:
        result["engine"] = engine_rows(cost_model, settings, model_dir, state_path, out)
    return result
