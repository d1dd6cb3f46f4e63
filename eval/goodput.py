"""`preft eval goodput`: SLOWeave against fixed prefill chunks and vLLM's default, in the
simulator on four workloads and on the real engine, with the simulator's gap to the engine.

    preft eval goodput [--model 512x8] [--cost-model FILE] [--workloads chat,mixed,long,bursty]
                       [--policies default,fixed:64,fixed:256,fixed:1024,fixed:2048,sloweave]
                       [--tpot-scales 2,5] [--loads 0.25,0.5,0.75,1,1.25] [--requests 2000]
                       [--engine-policies default,fixed:64,fixed:256,sloweave] [--engine-workload mixed]
                       [--engine-load 0.5] [--engine-requests 300]
                       [--engine-rounds R --engine-loads 0.5,0.75] [--engine-seeded]
                       [--adapters N --slots S] [--out runs/eval]

**Scaled to this machine.** The step cost model is this machine's, calibrated on a served
engine under load (``--cost-model``, default the one ``preft eval profile --served`` writes,
run first if missing). For each workload:

- its capacity is the highest request rate vLLM's default policy sustains in the simulator
  (the last request finishes within 1/0.95 of the arrivals' span: served >= 95% of the offered
  rate; found by bisection), and the loads are fractions of it;
- its TPOT targets are ``--tpot-scales`` times the decode step at the workload's batch size
  (``T(n, 0, x) + gap`` at the median decodes ``n`` and context ``x`` per step of the default
  policy at 75% load); its TTFT target is ten times the step that prefills its p95 prompt alone.

**Simulator**: every (workload, TPOT target, load, policy) through
:class:`~preft.serving.scheduling.simulator.Simulator`, the same policy objects the engine runs.
Goodput-vs-load curves in ``goodput_sim.png``.

**Engine**: the ``--engine-workload`` at ``--engine-load`` as a ``timed_trace`` file, replayed
by ``vllm bench serve`` at its arrival times against ``preft serve --scheduler P`` for each
``--engine-policies`` (SLOWeave at the first TPOT target, as a user starts it: no cost model
file, its model learned online; ``--engine-seeded`` seeds it with the profile's), with the
scheduler's step trace on.
The same trace goes through the simulator twice: with the cost model (fitted on a separate
calibration run, so these runs are held out), and with one refitted on the steps these served
engines recorded (``in-situ``, the best a cost model of this form can do). The gap between
engine and simulator goodput is reported per policy, and whether the policies rank the same.

**Adapter slots** (``--adapters N --slots S``): request i of every workload is on LoRA-P adapter
``lora{i % N}``, the simulator gives the adapters ``S`` slots (a request holds one until its
prompt is done) and the engine serves N random rank-16 bundles with ``--max-adapters S``
(``vllm bench serve --lora-assignment round-robin`` sends the same assignment): the slot-limited
regime, simulator beside engine.

**Engine rounds** (``--engine-rounds R``, instead of that one run): every engine policy at every
``--engine-loads`` on a fresh server each time, R rounds, each round a new trace and the
policies in a rotated order; per round SLOWeave's goodput over the best other policy's, the
median and range over rounds, the simulator's figure for the same traces beside it, and the
online cost model's error on the steps it predicted (``goodput_rounds.png``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from preft.eval.common import capacity, serve_trace, simulate_policy
from preft.eval.results import save_run



def _parse(text: str, kind, name: str) -> list:
    from preft.eval.common import parse_list

    return parse_list(str(text), kind, name)


def targets(cost_model, kind: str, rate: float, settings: dict) -> dict[str, float]:
    """The workload's decode step at its batch size, and its TTFT target (seconds)."""
    from preft.serving.scheduling import workloads
    from preft.serving.scheduling.metrics import percentile

    work = workloads.generate(kind, settings["probe_requests"], 0.75 * rate, seed=98, max_model_len=settings["max_len"])
    shapes = [s for s in simulate_policy(cost_model, "default", work, settings, 1.0, record=True).step_shapes if s[0] > 0]
    n = statistics.median(s[0] for s in shapes)
    x = statistics.median(s[2] for s in shapes)
    decode_step = cost_model(round(n), 0, round(x)) + cost_model.meta.get("gap_s", 0.0)
    p95_prompt = percentile([r.prompt_tokens for r in work], 95)
    return {"decode_step_s": decode_step, "batch": n, "context": x,
            "ttft_s": 10 * (cost_model(0, round(p95_prompt), 0) + cost_model.meta.get("gap_s", 0.0))}


def run_simulations(cost_model, settings: dict) -> list[dict]:
    from preft.serving.scheduling import workloads

    rows = []
    for kind in settings["workloads"]:
        rate0 = capacity(cost_model, kind, settings)
        scale = targets(cost_model, kind, rate0, settings)
        print(f"[goodput] {kind}: capacity {rate0:.1f} req/s, decode step {1e3 * scale['decode_step_s']:.2f} ms "
              f"at {scale['batch']:.0f} decodes, TTFT target {1e3 * scale['ttft_s']:.0f} ms", flush=True)
        for tpot_scale in settings["tpot_scales"]:
            tpot = tpot_scale * scale["decode_step_s"]
            for load in settings["loads"]:
                work = workloads.generate(kind, settings["requests"], load * rate0, seed=0,
                                          max_model_len=settings["max_len"])
                for policy in settings["policies"]:
                    started = time.perf_counter()
                    result = simulate_policy(cost_model, policy, work, settings, tpot)
                    summary = result.summary(scale["ttft_s"], tpot)
                    rows.append({"workload": kind, "tpot_scale": tpot_scale, "load": load, "rate": load * rate0,
                                 "capacity": rate0, "policy": policy, "simulated_s": time.perf_counter() - started,
                                 **scale, **summary})
    return rows


def engine_runs(cost_model, cost_model_path: Path, model_dir: str, settings: dict, out: Path) -> dict[str, Any]:
    """Every engine policy on one trace through ``preft serve`` + ``vllm bench serve`` (module docstring)."""
    from preft.serving.scheduling import workloads
    from preft.serving.scheduling.metrics import summarize

    (kind,) = settings["engine_workloads"]  # one without --capacity (checked in main)
    rate0 = capacity(cost_model, kind, settings)
    scale = targets(cost_model, kind, rate0, settings)
    tpot = settings["tpot_scales"][0] * scale["decode_step_s"]
    rate = settings["engine_load"] * rate0
    work = workloads.generate(kind, settings["engine_requests"], rate, seed=1, max_model_len=settings["max_len"])
    engine_dir = out / "engine"
    engine_dir.mkdir(parents=True, exist_ok=True)
    trace = workloads.write_trace(work, engine_dir / f"{kind}.trace.jsonl")
    served = {}
    for policy in settings["engine_policies"]:
        policy_args = ["--scheduler", policy]
        if policy == "sloweave":
            policy_args += ["--tpot-ms", f"{1e3 * tpot:.3f}", "--max-chunk", str(settings["max_chunk"])]
            if settings["engine_seeded"]:
                policy_args += ["--cost-model", str(cost_model_path)]
        print(f"[goodput] engine: {policy} on {len(work)} {kind} requests at {rate:.1f} req/s", flush=True)
        timings, steps = serve_trace(model_dir, policy_args, trace, policy.replace(":", ""), engine_dir, settings,
                                     adapters=settings["bundles"], slots=settings["slots"])
        served[policy] = {"summary": summarize(timings, scale["ttft_s"], tpot), "failed": len(work) - len(timings),
                          "timings": timings, "steps": steps}
    return {"workload": kind, "capacity": rate0, "rate": rate, "tpot_s": tpot, "trace": str(trace), "work": work,
            **scale, "served": served}


def online_step_error(steps: list[dict]) -> dict[str, Any] | None:
    """The online cost model's error on the steps it predicted (the step trace's ``predicted_s``
    and ``upper_s`` against the measured ``seconds``): median and p95 relative error, and how
    often a step took longer than the bound SLOWeave planned with."""
    from preft.serving.scheduling.metrics import percentile

    known = [s for s in steps if s.get("predicted_s") and s["seconds"] > 0]
    if not known:
        return None
    errors = [abs(s["predicted_s"] - s["seconds"]) / s["seconds"] for s in known]
    return {"steps": len(known), "median": statistics.median(errors), "p95": percentile(errors, 95),
            "over_bound": sum(s["seconds"] > s["upper_s"] for s in known) / len(known)}


def run_engine_rounds(cost_model, cost_model_path: Path, model_dir: str, settings: dict, out: Path) -> dict[str, Any]:
    """``--engine-rounds R``: every engine policy at every ``--engine-loads`` on a fresh ``preft
    serve`` each time, R rounds (a new trace of the same workload and rate each round, the
    policies in a rotated order), side by side with the simulator on the same traces. SLOWeave
    runs as a user starts it: ``--scheduler sloweave --tpot-ms X`` and nothing else (its cost
    model learned online; ``--engine-seeded`` gives it the profile's file as a seed)."""
    from preft.serving.scheduling import workloads
    from preft.serving.scheduling.metrics import summarize

    (kind,), policies = settings["engine_workloads"], settings["engine_policies"]
    rate0 = capacity(cost_model, kind, settings)
    scale = targets(cost_model, kind, rate0, settings)
    tpot = settings["tpot_scales"][0] * scale["decode_step_s"]
    runs_dir = out / "engine_rounds"
    runs_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    total, done = len(settings["engine_loads"]) * settings["engine_rounds"] * len(policies), 0
    for load in settings["engine_loads"]:
        for round_index in range(settings["engine_rounds"]):
            work = workloads.generate(kind, settings["engine_requests"], load * rate0, seed=100 + round_index,
                                      max_model_len=settings["max_len"])
            trace = workloads.write_trace(work, runs_dir / f"{kind}-{load:g}-r{round_index}.trace.jsonl")
            shift = round_index % len(policies)
            for policy in policies[shift:] + policies[:shift]:
                policy_args = ["--scheduler", policy]
                if policy == "sloweave":
                    policy_args += ["--tpot-ms", f"{1e3 * tpot:.3f}"]
                    if settings["engine_seeded"]:
                        policy_args += ["--cost-model", str(cost_model_path)]
                done += 1
                print(f"[goodput] engine round {round_index + 1}/{settings['engine_rounds']}, load {load:g} "
                      f"({load * rate0:.1f} req/s), {policy} [{done}/{total}]", flush=True)
                label = f"{policy.replace(':', '')}-{load:g}-r{round_index}"
                timings, steps = serve_trace(model_dir, policy_args, trace, label, runs_dir, settings,
                                             adapters=settings["bundles"], slots=settings["slots"])
                engine = summarize(timings, scale["ttft_s"], tpot)
                simulated = summarize(simulate_policy(cost_model, policy, work, settings, tpot).timings,
                                      scale["ttft_s"], tpot)
                rows.append({"load": load, "round": round_index, "policy": policy, "failed": len(work) - len(timings),
                             "goodput": engine["goodput"], "slo_attainment": engine["slo_attainment"],
                             "tpot_ms_p50": engine["tpot_ms_p50"], "tpot_ms_p99": engine["tpot_ms_p99"],
                             "ttft_ms_p50": engine["ttft_ms_p50"], "simulated_goodput": simulated["goodput"],
                             "online_step_error": online_step_error(steps) if policy == "sloweave" else None})
    summary = {}
    for load in settings["engine_loads"]:
        at_load = [r for r in rows if r["load"] == load]
        for policy in policies:
            mine = [r for r in at_load if r["policy"] == policy]
            ratios = []
            for round_index in range(settings["engine_rounds"]):
                others = [r["goodput"] for r in at_load if r["round"] == round_index and r["policy"] != policy
                          and r["policy"] != "sloweave"]
                own = next(r["goodput"] for r in mine if r["round"] == round_index)
                if others and max(others) > 0:
                    ratios.append(own / max(others))
            goodputs = [r["goodput"] for r in mine]
            sims = [r["simulated_goodput"] for r in mine]
            summary[f"{policy}@{load:g}"] = {
                "policy": policy, "load": load, "goodput": statistics.median(goodputs),
                "goodput_range": [min(goodputs), max(goodputs)], "simulated_goodput": statistics.median(sims),
                "vs_best_fixed": statistics.median(ratios) if ratios else None,
                "vs_best_fixed_range": [min(ratios), max(ratios)] if ratios else None,
                "tpot_ms_p99": statistics.median(r["tpot_ms_p99"] for r in mine),
                "slo_attainment": statistics.median(r["slo_attainment"] for r in mine),
                "failed": sum(r["failed"] for r in mine)}
    return {"workload": kind, "capacity": rate0, "tpot_s": tpot, "ttft_s": scale["ttft_s"], "rows": rows,
            "summary": summary}


def plot_rounds(rounds: dict, path: Path, title: str) -> None:
    """Goodput per policy at each load: the median over rounds, the range as an error bar, and
    the simulator's figure for the same traces as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = list(rounds["summary"].values())
    loads = sorted({e["load"] for e in entries})
    policies = list(dict.fromkeys(e["policy"] for e in entries))
    width = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for index, policy in enumerate(policies):
        mine = [next(e for e in entries if e["policy"] == policy and e["load"] == load) for load in loads]
        xs = [k + (index - (len(policies) - 1) / 2) * width for k in range(len(loads))]
        medians = [e["goodput"] for e in mine]
        errors = [[m - e["goodput_range"][0] for m, e in zip(medians, mine)],
                  [e["goodput_range"][1] - m for m, e in zip(medians, mine)]]
        ax.bar(xs, medians, width, yerr=errors, capsize=3, label=policy)
        ax.plot(xs, [e["simulated_goodput"] for e in mine], "k_", markersize=12)
    ax.set_xticks(range(len(loads)), [f"load {load:g}" for load in loads])
    ax.set_ylabel("goodput (req/s), median of rounds")
    ax.legend(fontsize=8, title="bars: engine; -: simulator", title_fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rounds_table(rounds: dict, settings: dict) -> str:
    lines = ["| load | policy | goodput engine, median [range] (req/s) | simulator | vs the best other fixed policy, "
             "median [range] | SLO attainment | TPOT p99 (ms) |", "|---|---|---|---|---|---|---|"]
    for entry in rounds["summary"].values():
        ratio = entry["vs_best_fixed"]
        ratio_text = (f"{ratio:.2f}x [{entry['vs_best_fixed_range'][0]:.2f}-{entry['vs_best_fixed_range'][1]:.2f}]"
                      if ratio is not None else "-")
        low, high = entry["goodput_range"]
        lines.append(f"| {entry['load']:g} | {entry['policy']} | {entry['goodput']:.2f} [{low:.2f}-{high:.2f}] | "
                     f"{entry['simulated_goodput']:.2f} | {ratio_text} | {entry['slo_attainment']:.0%} | "
                     f"{entry['tpot_ms_p99']:.1f} |")
    errors = [r["online_step_error"] for r in rounds["rows"] if r["online_step_error"]]
    if errors:
        lines += ["", f"SLOWeave's online cost model on its served steps ({sum(e['steps'] for e in errors)} steps, "
                      f"{len(errors)} servers): median relative error "
                      f"{statistics.median(e['median'] for e in errors):.0%}, p95 "
                      f"{statistics.median(e['p95'] for e in errors):.0%}; steps longer than the bound it planned "
                      f"with: {statistics.median(e['over_bound'] for e in errors):.1%} (median over servers)."]
    return "\n".join(lines)


def fidelity(cost_model, engine: dict[str, Any], settings: dict) -> dict[str, Any]:
    """The engine's runs beside the simulator's on the same trace: profiled and in-situ cost models."""
    from preft.serving.scheduling.cost_model import StepCostModel
    from preft.serving.scheduling.metrics import percentile

    steps = [s for run in engine["served"].values() for s in run["steps"] if s.get("seconds")]
    gaps = [s["gap_s"] for s in steps if s.get("gap_s") is not None]
    in_situ = StepCostModel.fit([(s["n"], s["c"], s["x"]) for s in steps], [s["seconds"] for s in steps],
                                source="in-situ (served steps)",
                                meta={"gap_s": statistics.median(gaps) if gaps else 0.0, "steps": len(steps)})
    rows = []
    for policy, run in engine["served"].items():
        row = {"policy": policy, "engine": run["summary"], "failed": run["failed"]}
        for label, model in (("profiled", cost_model), ("in_situ", in_situ)):
            simulated = simulate_policy(model, policy, engine["work"], settings, engine["tpot_s"])
            row[label] = simulated.summary(engine["ttft_s"], engine["tpot_s"])
            row[f"{label}_ttft_ms"] = sorted(1e3 * t.ttft_s for t in simulated.timings)
            row[f"{label}_tpot_ms"] = sorted(1e3 * t.tpot_s for t in simulated.timings if t.tpot_s is not None)
        row["engine_ttft_ms"] = sorted(1e3 * t.ttft_s for t in run["timings"])
        row["engine_tpot_ms"] = sorted(1e3 * t.tpot_s for t in run["timings"] if t.tpot_s is not None)
        for label in ("profiled", "in_situ"):
            engine_goodput = run["summary"]["goodput"]
            row[f"{label}_goodput_gap"] = ((row[label]["goodput"] - engine_goodput) / engine_goodput
                                           if engine_goodput else None)
        served_steps = [s for s in run["steps"] if s.get("seconds")]
        errors = in_situ.relative_errors([(s["n"], s["c"], s["x"]) for s in served_steps],
                                         [s["seconds"] for s in served_steps])
        profiled_errors = cost_model.relative_errors([(s["n"], s["c"], s["x"]) for s in served_steps],
                                                     [s["seconds"] for s in served_steps])
        row["step_error"] = {"profiled_median": statistics.median(profiled_errors) if profiled_errors else None,
                             "profiled_p95": percentile(profiled_errors, 95),
                             "in_situ_median": statistics.median(errors) if errors else None,
                             "measured_median_ms": 1e3 * statistics.median(s["seconds"] for s in served_steps)
                             if served_steps else None}
        rows.append(row)

    def ranking(key):
        return [r["policy"] for r in sorted(rows, key=lambda r: -(r[key]["goodput"]))]

    return {"rows": rows, "in_situ_cost_model": in_situ.to_json(),
            "ranking": {"engine": ranking("engine"), "profiled": ranking("profiled"), "in_situ": ranking("in_situ")}}


def plot_simulation(rows: list[dict], settings: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds, scales = settings["workloads"], settings["tpot_scales"]
    fig, axes = plt.subplots(len(scales), len(kinds), figsize=(3.4 * len(kinds), 3.0 * len(scales)), squeeze=False)
    for i, scale in enumerate(scales):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            for policy in settings["policies"]:
                chosen = [r for r in rows if r["workload"] == kind and r["tpot_scale"] == scale and r["policy"] == policy]
                ax.plot([r["load"] for r in chosen], [r["goodput"] for r in chosen], marker="o", markersize=3,
                        label=policy, linewidth=2.2 if policy == "sloweave" else 1.2,
                        color="black" if policy == "sloweave" else None)
            tpot = next(r for r in rows if r["workload"] == kind and r["tpot_scale"] == scale)
            ax.set_title(f"{kind}, TPOT {scale:g}x decode step ({1e3 * scale * tpot['decode_step_s']:.1f} ms)",
                         fontsize=8)
            ax.set_xlabel("load (fraction of capacity)", fontsize=8)
            ax.set_ylabel("goodput (req/s)", fontsize=8)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fidelity(fid: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = fid["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    labels = [r["policy"] for r in rows]
    width = 0.27
    for offset, (key, name) in enumerate((("engine", "engine"), ("profiled", "simulator, cost model"),
                                          ("in_situ", "simulator, in-situ model"))):
        axes[0].bar([k + (offset - 1) * width for k in range(len(rows))], [r[key]["goodput"] for r in rows],
                    width, label=name)
    axes[0].set_xticks(range(len(rows)), labels, fontsize=8)
    axes[0].set_ylabel("goodput (req/s)")
    axes[0].legend(fontsize=7)
    for ax, metric in ((axes[1], "ttft_ms"), (axes[2], "tpot_ms")):
        for r, colour in zip(rows, plt.rcParams["axes.prop_cycle"].by_key()["color"]):
            for key, style in (("engine", "-"), ("profiled", "--")):
                values = r[f"{key}_{metric}"]
                if values:
                    ax.plot(values, [(k + 1) / len(values) for k in range(len(values))], style, color=colour,
                            label=f"{r['policy']} ({'engine' if key == 'engine' else 'sim'})", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel(metric.replace("_ms", " (ms)").upper())
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def simulation_table(rows: list[dict], settings: dict, load: float) -> str:
    lines = ["| workload | TPOT target | " + " | ".join(settings["policies"]) + " | SLOWeave vs the best other |",
             "|---|---|" + "---|" * (len(settings["policies"]) + 1)]
    for kind in settings["workloads"]:
        for scale in settings["tpot_scales"]:
            chosen = {r["policy"]: r for r in rows if r["workload"] == kind and r["tpot_scale"] == scale
                      and r["load"] == load}
            cells = [f"{chosen[p]['goodput']:.2f} ({chosen[p]['slo_attainment']:.0%})" for p in settings["policies"]]
            fixed = [chosen[p]["goodput"] for p in settings["policies"] if p.startswith("fixed:") or p == "default"]
            ratio = (f"{chosen['sloweave']['goodput'] / max(fixed):.2f}x" if "sloweave" in chosen and max(fixed)
                     else "-")
            tpot_ms = 1e3 * scale * next(iter(chosen.values()))["decode_step_s"]
            lines.append(f"| {kind} | {scale:g}x = {tpot_ms:.1f} ms | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def fidelity_table(fid: dict) -> str:
    lines = ["| policy | goodput engine / simulator / simulator in-situ (req/s) | simulator's gap (model, in-situ) | "
             "TTFT p50 / p99 engine vs simulator (ms) | TPOT p50 / p99 engine vs simulator (ms) | step time: median "
             "measured, the model's median error |", "|---|---|---|---|---|---|"]
    for r in fid["rows"]:
        e, p, s = r["engine"], r["profiled"], r["in_situ"]

        def gap(key):
            return f"{r[key]:+.0%}" if r[key] is not None else "-"

        step = r["step_error"]
        lines.append(f"| {r['policy']} | {e['goodput']:.2f} / {p['goodput']:.2f} / {s['goodput']:.2f} | "
                     f"{gap('profiled_goodput_gap')}, {gap('in_situ_goodput_gap')} | "
                     f"{e['ttft_ms_p50']:.0f} / {e['ttft_ms_p99']:.0f} vs {p['ttft_ms_p50']:.0f} / {p['ttft_ms_p99']:.0f} | "
                     f"{e['tpot_ms_p50']:.1f} / {e['tpot_ms_p99']:.1f} vs {p['tpot_ms_p50']:.1f} / {p['tpot_ms_p99']:.1f} | "
                     f"{step['measured_median_ms'] or 0:.1f} ms, {100 * (step['profiled_median'] or 0):.0f}% |")
    ranks = fid["ranking"]
    lines.append("")
    lines.append(f"Ranking by goodput: engine {ranks['engine']}; simulator {ranks['profiled']}; "
                 f"simulator in-situ {ranks['in_situ']}.")
    return "\n".join(lines)


def main(model: str = "512x8", cost_model: str | None = None, workloads: str = "chat,mixed,long,bursty",
         policies: str = "default,fixed:64,fixed:256,fixed:1024,fixed:2048,sloweave", tpot_scales: str = "2,5",
         loads: str = "0.25,0.5,0.75,1,1.25", requests: int = 2000, max_num_seqs: int = 64,
         engine_policies: str = "default,fixed:64,fixed:256,sloweave", engine_workload: str = "mixed",
         engine_load: float = 0.5, engine_requests: int = 300, engine_rounds: int = 0, engine_loads: str = "0.5,0.75",
         engine_seeded: bool = False, adapters: int = 0, slots: int = 0, capacity: bool = False,
         capacity_probes: int = 4, capacity_requests: int = 600, engine_tpot_scales: str = "",
         from_run: str = "", out: str = "runs/eval") -> dict[str, Any]:
    from transformers import AutoConfig

    from preft.eval import common

    from preft.eval import profile as eval_profile
    from preft.eval.results import command_line
    from preft.serving.scheduling import workloads as workload_module
    from preft.serving.scheduling.chunk_policies import make_policy
    from preft.serving.scheduling.cost_model import StepCostModel

    import inspect

    arguments = dict(locals())
    values = {name: arguments[name] for name in inspect.signature(main).parameters}
    started = time.time()
    if from_run:
        if not capacity:
            raise ValueError("--from-run makes a --capacity run's report again: give --capacity")
        goodput_dir = Path(out) / "goodput"
        goodput_dir.mkdir(parents=True, exist_ok=True)
        return capacity_report_again(from_run, values, goodput_dir, started)
    settings = {"workloads": _parse(workloads, str, "workloads"), "policies": _parse(policies, str, "policies"),
                "tpot_scales": _parse(tpot_scales, float, "tpot-scales"), "loads": _parse(loads, float, "loads"),
                "engine_policies": _parse(engine_policies, str, "engine-policies") if engine_policies else [],
                "requests": requests, "engine_requests": engine_requests,
                "engine_load": engine_load, "max_num_seqs": max_num_seqs, "probe_requests": min(requests, 1000),
                "engine_rounds": engine_rounds, "engine_loads": _parse(engine_loads, float, "engine-loads"),
                "engine_seeded": engine_seeded, "capacity_probes": capacity_probes,
                "capacity_requests": capacity_requests}
    settings["engine_tpot_scales"] = (_parse(engine_tpot_scales, float, "engine-tpot-scales") if engine_tpot_scales
                                      else settings["tpot_scales"])
    settings["engine_workloads"] = _parse(engine_workload, str, "engine-workload")
    for kind in settings["workloads"] + settings["engine_workloads"]:
        if kind not in workload_module.KINDS:
            raise ValueError(f"unknown workload {kind!r} (choose from {', '.join(workload_module.KINDS)})")
    if not capacity and len(settings["engine_workloads"]) > 1:
        raise ValueError("--engine-workload takes one workload (several only with --capacity)")
    if capacity and settings["engine_policies"]:
        missing = [kind for kind in settings["engine_workloads"] if kind not in settings["workloads"]]
        if missing:
            raise ValueError(f"--engine-workload {','.join(missing)} is not in --workloads: with --capacity the "
                             "engine searches the workloads the simulator runs")
    for name in settings["policies"] + settings["engine_policies"]:
        make_policy(name, cost_model=StepCostModel.synthetic(), tpot_s=1.0)  # a bad name fails here
    if requests < 10 or engine_requests < 1 or not settings["loads"] or min(settings["loads"]) <= 0:
        raise ValueError("--requests must be >= 10, --engine-requests >= 1 and every --loads > 0")
    if capacity and (capacity_probes < 1 or capacity_requests < 10):
        raise ValueError("--capacity-probes must be >= 1 and --capacity-requests >= 10")
    if adapters < 0 or slots < 0 or (slots and not adapters):
        raise ValueError("--adapters and --slots must be >= 0, and --slots needs --adapters N")
    settings.update(adapters=adapters, slots=slots or adapters, bundles={})
    goodput_dir = Path(out) / "goodput"
    goodput_dir.mkdir(parents=True, exist_ok=True)
    model_dir = common.model_dir(model, Path(out) / "profile")
    if cost_model is None:  # the served calibration: the engine as vllm bench serve meets it
        cost_model = eval_profile.served_cost_model(model, model_dir, out, "goodput")
    model_cost = StepCostModel.load(cost_model)
    settings["max_len"] = AutoConfig.from_pretrained(model_dir).max_position_embeddings
    settings["max_chunk"] = 2048
    settings["max_num_batched_tokens"] = 2048 + 256
    if adapters and settings["engine_policies"]:  # the engine serves N random LoRA-P bundles, rank 16
        from preft.eval.serve import make_bundles

        # they live as long as the servers that copy them (removed at the end, or when this exits)
        bundle_dir = tempfile.TemporaryDirectory(prefix="preft-goodput-bundles-")
        paths = make_bundles(model_dir, "lora", adapters, 16, Path(bundle_dir.name))
        settings["bundles"] = {f"lora{i}": path for i, path in enumerate(paths)}

    if capacity:
        return capacity_run(model_cost, cost_model, model_dir, settings, values, goodput_dir, started)
    rows = run_simulations(model_cost, settings)
    result: dict[str, Any] = {"command": command_line("goodput", main, values, always=("model",)), "model": model,
                              "cost_model": cost_model, "cost_model_weights": model_cost.weights,
                              "machine": common.machine(), "settings": settings, "simulation": rows}
    load_shown = min(settings["loads"], key=lambda load: abs(load - 0.75))
    markdown = [f"## Goodput: SLOWeave vs fixed prefill chunks (`preft eval goodput`)\n",
                f"![simulated goodput](goodput_sim.png)\n",
                f"Command: `{result['command']}` ({result['machine']}); cost model `{Path(cost_model).name}`. "
                f"Simulator, {requests} requests per point; goodput in requests/s meeting both targets (SLO attainment "
                f"in brackets) at {load_shown:g} of each workload's capacity. TPOT targets are multiples of the "
                f"workload's decode step at its batch size; TTFT target 10x the step that prefills its p95 prompt."
                + (f" Request i on LoRA-P adapter i % {adapters} with {settings['slots']} adapter slots (the "
                   f"simulator's `max_loras`; the engine's `--max-adapters`, random rank-16 bundles, every one in "
                   f"host memory)." if adapters else "") + "\n",
                simulation_table(rows, settings, load_shown), ""]
    plot_simulation(rows, settings, goodput_dir / "goodput_sim.png",
                    f"simulated goodput vs load, {model} cost model ({Path(cost_model).name})")
    if settings["engine_policies"] and settings["engine_rounds"]:
        rounds = run_engine_rounds(model_cost, Path(cost_model), model_dir, settings, goodput_dir)
        result["engine_rounds"] = rounds
        plot_rounds(rounds, goodput_dir / "goodput_rounds.png",
                    f"{rounds['workload']} on the real engine, {engine_rounds} rounds, fresh servers")
        markdown += [f"### On the real engine, side by side: {rounds['workload']}, {engine_requests} requests a "
                     f"round, {engine_rounds} rounds\n",
                     f"A fresh `preft serve --scheduler P` for every (load, round, policy), the policies in a rotated "
                     f"order each round, every round a new trace at the load's rate (capacity "
                     f"{rounds['capacity']:.1f} req/s in the simulator); SLOWeave as a user starts it, `--scheduler "
                     f"sloweave --tpot-ms {1e3 * rounds['tpot_s']:.1f}`"
                     + (" with the profile as a seed" if engine_seeded else " and no cost model file (learned online)")
                     + f"; TTFT target {1e3 * rounds['ttft_s']:.0f} ms. The ratio is per round, against the best "
                     f"of the other fixed policies in that round; the simulator runs the same traces with the "
                     f"profiled cost model.\n", "![engine rounds](goodput_rounds.png)\n",
                     rounds_table(rounds, settings), ""]
    elif settings["engine_policies"]:
        engine = engine_runs(model_cost, Path(cost_model), model_dir, settings, goodput_dir)
        fid = fidelity(model_cost, engine, settings)
        plot_fidelity(fid, goodput_dir / "goodput_engine.png",
                      f"{engine['workload']} at {engine['rate']:.1f} req/s on the real engine vs the simulator")
        result["engine"] = {k: v for k, v in engine.items() if k not in ("work", "served")}
        result["fidelity"] = {**fid, "rows": [{k: v for k, v in r.items() if not k.endswith("_ms")}
                                              for r in fid["rows"]]}
        markdown += [f"### Real engine vs simulator: {engine['workload']}, {len(engine['work'])} requests at "
                     f"{engine['rate']:.1f} req/s ({engine_load:g} of capacity)\n",
                     f"![engine vs simulator](goodput_engine.png)\n",
                     f"`preft serve --scheduler P` driven by `vllm bench serve --dataset-name timed_trace` at the "
                     f"trace's arrival times; SLOWeave at TPOT {1e3 * engine['tpot_s']:.1f} ms (the first target), "
                     f"TTFT target {1e3 * engine['ttft_s']:.0f} ms. The simulator replays the same trace with the "
                     f"cost model (calibrated on a separate served run) and with one refitted on these runs' own "
                     f"steps (in-situ).\n",
                     fidelity_table(fid), ""]
    settings["bundles"] = sorted(settings["bundles"])  # their names (the files were temporary)
    result["wall_time_s"] = round(time.time() - started, 1)
    save_run(goodput_dir, "goodput", result, "\n".join(markdown),
             also=tuple(goodput_dir / p for p in ("goodput_sim.png", "goodput_engine.png", "goodput_rounds.png")
                        if (goodput_dir / p).exists()))
    return result


def capacity_run(model_cost, cost_model: str, model_dir: str, settings: dict, values: dict, goodput_dir: Path,
                 started: float) -> dict[str, Any]:
    """``--capacity``: every policy's SLO capacity (:mod:`preft.eval.slo_capacity`), published as
    ``eval_goodput_capacity``."""
    from preft.eval import common, slo_capacity
    from preft.eval.results import command_line

    found = slo_capacity.run(model_cost, model_dir, settings, goodput_dir,
                             seed_cost_model=str(Path(cost_model).resolve()) if settings["engine_seeded"] else None)
    slo_capacity.recalibrate(found, settings, goodput_dir / "capacity")
    command = command_line("goodput", main, values, always=("model",))
    settings["bundles"] = sorted(settings["bundles"])
    return capacity_report(found, settings, command, values["model"], cost_model, model_cost, goodput_dir, started)


def capacity_report_again(run: str, values: dict, goodput_dir: Path, started: float) -> dict[str, Any]:
    """``--capacity --from-run DIR``: the report of the capacity run in ``DIR`` (its
    ``goodput/goodput_capacity.json`` and engine step logs) made again in ``--out``, with the
    simulator recalibrated on the engine's steps (:func:`preft.eval.slo_capacity.recalibrate`);
    nothing is served."""
    from preft.eval import slo_capacity
    from preft.eval.results import command_line
    from preft.serving.scheduling.cost_model import StepCostModel

    source = Path(run) / "goodput" / "goodput_capacity.json"
    try:
        previous = json.loads(source.read_text())
        found, settings = previous["capacity"], previous["settings"]
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"--from-run: {source} is not the result of `preft eval goodput --capacity` ({err})") from None
    model_cost = (StepCostModel.from_json(previous["cost_model_weights"], f"{source}'s cost_model_weights")
                  if "cost_model_weights" in previous else StepCostModel.load(previous["cost_model"]))
    slo_capacity.recalibrate(found, settings, source.parent / "capacity")
    command = command_line("goodput", main, values, always=("model",))
    return capacity_report(found, settings, f"{previous['command']}`, then `{command}", previous["model"],
                           previous["cost_model"], model_cost, goodput_dir, started)


def capacity_report(found: dict, settings: dict, command: str, model: str, cost_model: str, model_cost,
                    goodput_dir: Path, started: float) -> dict[str, Any]:
    """The capacity run's table, fidelity, brackets and figure, published as ``eval_goodput_capacity``."""
    from preft.eval import common, slo_capacity

    fidelity_rows = slo_capacity.fidelity(found)
    figure = goodput_dir / "goodput_capacity.png"
    slo_capacity.plot(found, figure)
    markdown = [
        "## SLO capacity: SLOWeave vs fixed prefill chunks (`preft eval goodput --capacity`)\n",
        f"Command: `{command}` ({common.machine()}); cost model `{Path(cost_model).name}` (the simulator's, and "
        "the targets'). A policy's SLO capacity is the highest Poisson rate at which at least "
        f"{slo_capacity.ATTAINMENT:.0%} of the requests meet both targets (a failed request misses). Simulator: "
        f"{settings['capacity_requests']} requests a probe, the rate searched to a few percent, and for the policies "
        "run on the engine again on the engine's traces. "
        + (f"Engine: {settings['engine_requests']} requests a probe, a fresh `preft serve --scheduler P` for each, at "
           f"most {settings['capacity_probes']} probes a search starting from the simulator's capacity on the engine's "
           "traces for the policy (SLOWeave as a user starts it: `--tpot-ms` and "
           + ("the profile as its cost model's seed, `--cost-model`). " if settings["engine_seeded"] else
              "no cost model file). ")
           if settings["engine_policies"] else "No engine runs. ")
        + f"{found['rounds']} rounds, each a new "
        "trace seed for the simulator and the engine alike; the ratio is per round. TPOT targets are multiples of "
        "the workload's decode step at its batch size, TTFT 10x the step that prefills its p95 prompt.\n",
        "![SLO capacity](goodput_capacity.png)\n",
        slo_capacity.table(found), ""]
    if any(r.get("recalibrated") is not None for r in found["rows"]):
        markdown.append("Recalibrated: for each engine search, the simulator with a cost model fitted on the steps "
                        "the engine ran in the other policies' probes of the same workload (none of the policy's "
                        "own).\n")
    if fidelity_rows:
        markdown += ["Simulator beside engine on the engine's traces, per policy: simulator / engine capacity "
                     "(medians over rounds; their gap); how far the simulator lies outside the engine search's "
                     "bracket [met, missed) ('in' inside it); the median gap in attainment at the engine's "
                     "probe rates:\n",
                     "| workload | TPOT scale | simulator | policy: simulator / engine (gap), outside the bracket, "
                     "attainment gap | same ranking |", "|---|---|---|---|---|"]

        def percent(value) -> str:
            return "-" if value is None else f"{100 * value:+.0f}%"

        def cells(policies: dict, gap: dict) -> str:
            return "; ".join(f"{p} {v['simulated']:.2f} / {served[p]:.2f} ({percent(gap[p])}), "
                             f"{'in' if v['bracket_gap'] == 0 else percent(v['bracket_gap'])}, "
                             f"{100 * v['attainment_gap']:.0f} pts" for p, v in policies.items())

        for entry in fidelity_rows:
            served = {p: v["served"] for p, v in entry["policies"].items()}
            markdown.append(f"| {entry['workload']} | {entry['tpot_scale']:g} | profiled | "
                            f"{cells(entry['policies'], entry['gap'])} | {'yes' if entry['same_ranking'] else 'no'} |")
            if "recalibrated_gap" in entry:
                recalibrated = {p: v["recalibrated"] for p, v in entry["policies"].items()}
                markdown.append(f"| {entry['workload']} | {entry['tpot_scale']:g} | recalibrated | "
                                f"{cells(recalibrated, entry['recalibrated_gap'])} | "
                                f"{'yes' if entry['recalibrated_same_ranking'] else 'no'} |")
        markdown.append("")
        markdown += ["Engine searches, per round (a bracket's ends: the highest rate that met both targets and the "
                     "lowest that missed; 'resolved' where SLOWeave's and the best fixed chunk's brackets do not "
                     "overlap, so the probes rank them):\n", slo_capacity.brackets_table(found), ""]
    result = {"command": command, "model": model, "cost_model": cost_model,
              "cost_model_weights": model_cost.to_json(), "machine": common.machine(),
              "settings": settings, "capacity": found, "fidelity": fidelity_rows,
              "wall_time_s": round(time.time() - started, 1)}
    save_run(goodput_dir, "goodput_capacity", result, "\n".join(markdown), also=(figure,), json_name="goodput_capacity.json")
    return result


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    add_flags(parser, main, [
        ("--model", str, "base model: '512x8' (a random-init 27M Llama built here), 'default' or a local directory"),
        ("--cost-model", str, "step cost model JSON (default: OUT/profile/cost_model_MODEL_served.json, from "
                              "`preft eval profile --served`, run first if missing)"),
        ("--workloads", str, "comma-separated, of chat, mixed, long, bursty (simulator)"),
        ("--policies", str, "comma-separated prefill chunk policies (simulator)"),
        ("--tpot-scales", str, "TPOT targets as multiples of the decode step at the workload's batch size"),
        ("--loads", str, "request rates as fractions of each workload's capacity"),
        ("--requests", int, "requests per simulated point"),
        ("--max-num-seqs", int, "the engine's (and simulator's) running-request limit"),
        ("--engine-policies", str, "policies run on the real engine ('' for none)"),
        ("--engine-workload", str, "the workload run on the real engine (with --capacity: comma-separated, of "
                                   "--workloads)"),
        ("--engine-load", float, "its rate as a fraction of capacity"),
        ("--engine-requests", int, "requests in the engine's trace"),
        ("--engine-rounds", int, "with R > 0: every engine policy at every --engine-loads, R rounds on fresh servers, "
                                 "instead of the one fidelity run"),
        ("--engine-loads", str, "the loads of the rounds, as fractions of capacity"),
        ("--engine-seeded", bool, "in the rounds and the --capacity searches, seed SLOWeave with the profile's "
                                  "cost model (default: none, learned online)"),
        ("--adapters", int, "with N > 0: request i on LoRA-P adapter i %% N (random rank-16 bundles on the engine)"),
        ("--slots", int, "adapter slots with --adapters (engine --max-adapters, the simulator's max_loras; "
                         "0 = one per adapter)"),
        ("--capacity", bool, "instead of goodput at fixed loads: each policy's SLO capacity (the highest rate with "
                             ">= 90%% of requests within both targets), simulator (--policies, --workloads) and "
                             "engine (--engine-policies on --engine-workload, --engine-rounds rounds)"),
        ("--capacity-probes", int, "with --capacity: engine servers per search"),
        ("--capacity-requests", int, "with --capacity: requests a simulator probe"),
        ("--engine-tpot-scales", str, "with --capacity: the TPOT targets searched on the engine (default: all)"),
        ("--from-run", str, "with --capacity: serve nothing; make the report of the capacity run in this --out "
                            "directory again (its results and engine step logs), in --out, with the simulator "
                            "recalibrated on the engine's steps"),
        ("--out", str, "results directory"),
    ])
