"""SLO capacity: the highest request rate at which a scheduling policy still meets its targets.

    attainment(policy, rate) = requests finishing with TTFT <= ttft_target and TPOT <= tpot_target
                               / requests offered (a failed request counts as missed)
    capacity(policy)         = the highest Poisson rate with attainment >= ATTAINMENT (0.9)

Goodput at one fixed rate cannot rank policies at loads where every policy serves all that is
offered; the rate each can carry within its targets can (the DistServe and Sarathi-Serve papers'
measure). The search (:func:`search`) takes a starting rate, steps by ``factor`` up while the
policy meets the targets (down while it does not) until one rate meets and the next does not,
then halves that bracket geometrically with the probes left. Every probe of a search serves a
trace of the same seed (arrivals scaled to the rate), so attainment moves with the rate alone.

- :func:`simulated` probes the simulator (:class:`~preft.serving.scheduling.simulator.Simulator`);
- :func:`served` probes a fresh ``preft serve --scheduler P`` per rate, driven by ``vllm bench
  serve`` at the trace's arrival times (:func:`preft.eval.common.serve_trace`), starting from the
  simulator's capacity for that policy so that a few probes suffice. SLOWeave runs as a user
  starts it: its step cost model learned online from the prior, or with ``--engine-seeded`` from
  the profile (``--cost-model``, as after ``preft eval profile --served``). Its probes are kept in
  the run directory (:mod:`preft.eval.served_probes`): shared between the TPOT targets where the
  server is the same, read back when a run is resumed.

A capacity belongs to its trace's length as much as to the policy: near capacity the queue grows
for as long as requests keep arriving, so a short trace ends before the backlog that sinks a long
one (on ``mixed`` at a loose target, 80 requests a probe put a fixed chunk's capacity up to 1.45x
what 600 do). The simulator therefore searches twice: its own long traces (the steadier figure)
and the engine's very traces (``engine_requests`` requests, same seed), which is the figure the
engine is compared with; each engine probe also records the simulator's attainment on its trace.

A simulator is as good as its step cost model, and the served profile's model is fitted under
one bursty load, not the loads a search probes. :func:`recalibrate` therefore also runs the
simulator, for each policy, with a cost model fitted on the steps the engine ran in the *other*
policies' probes of the same workload (leave one policy out: no step of the policy it predicts).

``preft eval goodput --capacity`` runs both (:mod:`preft.eval.goodput`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

#: The fraction of requests that must meet both targets.
ATTAINMENT = 0.9


def search(attainment_at: Callable[[float], float], start: float, probes: int, factor: float = 1.5,
           known: list[tuple[float, float]] = (), spent: int = 0) -> dict[str, Any]:
    """The highest rate whose attainment is >= ATTAINMENT within ``probes`` calls of ``attainment_at``.

    ``known``: ``(rate, attainment)`` pairs measured before (:mod:`preft.eval.served_probes`),
    ``spent`` of them this search's own (a run resumed), the rest free (another target's probes
    of the same server). The search starts from the bracket they give (the lowest rate that
    missed, the highest below it that met), probing ``start`` first only where it lies on the
    side the bracket leaves open, and calls ``attainment_at`` at most ``probes - spent`` times.
    Returns ``capacity`` (the highest rate that met; 0.0 if none did), ``bracket`` (that rate and
    the lowest rate above it that did not meet: ``None`` where no probe failed) and every probe,
    known ones marked ``reused``."""
    if probes < 1 or start <= 0 or factor <= 1:
        raise ValueError("a capacity search needs probes >= 1, a start rate > 0 and a factor > 1")
    seen: list[dict[str, Any]] = [{"rate": rate, "attainment": value, "reused": True} for rate, value in sorted(known)]
    missed = [p["rate"] for p in seen if p["attainment"] < ATTAINMENT]
    high = min(missed) if missed else None
    met = [p["rate"] for p in seen if p["attainment"] >= ATTAINMENT and (high is None or p["rate"] < high)]
    low = max(met) if met else None
    left = probes - spent

    def probe(rate: float) -> bool:
        nonlocal left
        left -= 1
        value = attainment_at(rate)
        seen.append({"rate": rate, "attainment": value})
        return value >= ATTAINMENT

    open_side = (low is None and high is None) or (high is None and start > low) or (low is None and start < high)
    if left > 0 and open_side:
        if probe(start):
            low = start
        else:
            high = start
    while left > 0 and (low is None or high is None):
        if high is None:
            rate = low * factor
            low, high = (rate, None) if probe(rate) else (low, rate)
        else:
            rate = high / factor
            low, high = (rate, high) if probe(rate) else (None, rate)
    while left > 0 and low is not None and high is not None:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if probe(middle) else (low, middle)
    return {"capacity": low or 0.0, "bracket": [low or 0.0, high], "probes": seen}


def attainment(timings, offered: int, ttft_s: float, tpot_s: float) -> float:
    from preft.serving.scheduling.metrics import meets

    return sum(meets(t, ttft_s, tpot_s) for t in timings) / offered


def simulated_attainment(cost_model, policy: str, kind: str, settings: dict, tpot_s: float, ttft_s: float,
                         rate: float, seed: int, requests: int) -> float:
    """The simulator's attainment on the trace of ``requests`` requests of ``seed`` at ``rate``."""
    from preft.eval.common import simulate_policy
    from preft.serving.scheduling import workloads

    work = workloads.generate(kind, requests, rate, seed=seed, max_model_len=settings["max_len"])
    return attainment(simulate_policy(cost_model, policy, work, settings, tpot_s).timings, len(work), ttft_s, tpot_s)


def simulated(cost_model, policy: str, kind: str, settings: dict, tpot_s: float, ttft_s: float, start: float,
              seed: int, probes: int = 14, requests: int | None = None) -> dict[str, Any]:
    """The policy's SLO capacity in the simulator, ``requests`` a probe (default
    ``settings["capacity_requests"]``)."""
    requests = requests or settings["capacity_requests"]
    return search(lambda rate: simulated_attainment(cost_model, policy, kind, settings, tpot_s, ttft_s, rate, seed,
                                                    requests), start, probes)


def served(model_dir: str, policy_args: list[str], kind: str, settings: dict, tpot_s: float, ttft_s: float,
           start: float, seed: int, probes: int, run_dir: Path, label: str) -> dict[str, Any]:
    """The policy's SLO capacity on the engine: a fresh ``preft serve`` with ``policy_args`` per probe.
    Probes this server already ran on the same traces in ``run_dir`` are read back and judged
    against this target (:mod:`preft.eval.served_probes`): another TPOT target's (a fixed chunk's
    server is the same at both) free, this search's own (a run resumed in the same ``--out``)
    counted in ``probes``. Each probe names its step log (``step_log``)."""
    from preft.eval.common import serve_trace
    from preft.eval.served_probes import ServedProbes, search_key, timings_of, trace_digest
    from preft.serving.scheduling import workloads
    from preft.serving.scheduling.atomic_file import write_atomically

    store = ServedProbes(run_dir)
    key = search_key(model_dir, policy_args, kind, seed, settings)

    def work_at(rate: float) -> list:
        return workloads.generate(kind, settings["engine_requests"], rate, seed=seed, max_model_len=settings["max_len"])

    known, step_logs, own = {}, {}, set()
    for record in store.of_search(key):  # a record counts only while its trace is made again the same
        work = work_at(record["rate"])
        if trace_digest(workloads.trace_text(work)) == record["trace_sha256"]:
            known[record["rate"]] = attainment(timings_of(record), len(work), ttft_s, tpot_s)
            step_logs[record["rate"]] = record["step_log"]
            if record["label"] == label:  # this search's own, served before it was resumed
                own.add(record["rate"])
    if known:
        print(f"[capacity] {label}: {len(known)} probe(s) of this server read back from {store.path.name} "
              f"({len(own)} of this search)", flush=True)

    def at(rate: float) -> float:
        work = work_at(rate)
        text = workloads.trace_text(work)
        name = probe_name(label, key, rate)
        trace = write_atomically(run_dir / f"{name}.trace.jsonl", text)
        print(f"[capacity] {label}: {rate:.2f} req/s", flush=True)
        timings, _ = serve_trace(model_dir, policy_args, trace, name, run_dir, settings,
                                 adapters=settings["bundles"], slots=settings["slots"])
        step_logs[rate] = f"steps-{name}.jsonl"
        store.add(key, label, rate, text, timings, step_logs[rate])
        value = attainment(timings, len(work), ttft_s, tpot_s)
        print(f"[capacity] {label}: {rate:.2f} req/s -> {100 * value:.0f}% within the targets", flush=True)
        return value

    found = search(at, start, probes, known=list(known.items()), spent=len(own))
    for probe in found["probes"]:
        probe["step_log"] = step_logs[probe["rate"]]
    return found


def probe_label(kind: str, tpot_scale: float, round_index: int, policy: str) -> str:
    """An engine search's name; each of its probes' files adds the search key and the rate
    (:func:`probe_name`)."""
    return f"{kind}-t{tpot_scale:g}-r{round_index}-{policy.replace(':', '')}"


def probe_name(label: str, key: str, rate: float) -> str:
    """What one probe's files are named after (``NAME.trace.jsonl``, ``steps-NAME.jsonl``): its
    search's label, the start of its search key (two servers of one label, e.g. SLOWeave with and
    without a seed, in one ``--out``, keep their own files) and the rate."""
    return f"{label}-{key[:8]}-{rate:.3f}"


def probe_steps(run_dir: Path, name: str) -> list[dict[str, Any]]:
    """The steps the engine ran in one probe, from its step log ``name`` (:func:`step_log`), idle
    steps left out."""
    import json

    path = Path(run_dir) / name
    if not path.is_file():
        raise FileNotFoundError(f"no step log {path} for an engine probe: recalibrating needs the run's step logs")
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    return [step for step in steps if step["seconds"] > 0 and (step["n"] or step["c"])]


def step_log(row: dict[str, Any], probe: dict[str, Any]) -> str:
    """The file name of a probe's step log: the one it names, or (runs before probes named theirs)
    the search's label and the rate."""
    label = probe_label(row["workload"], row["tpot_scale"], row["round"], row["policy"])
    return probe.get("step_log") or f"steps-{label}-{probe['rate']:.3f}.jsonl"


def summarize(rows: list[dict[str, Any]], settings: dict, rounds: int) -> list[dict[str, Any]]:
    """Per workload, TPOT target and source (simulator, on the engine's traces, recalibrated,
    engine): each policy's capacity, median and range over rounds, and SLOWeave's over the best
    fixed chunk's, per round."""
    import statistics

    summary = []
    for kind in settings["workloads"]:
        for tpot_scale in settings["tpot_scales"]:
            here = [r for r in rows if r["workload"] == kind and r["tpot_scale"] == tpot_scale]
            for source in ("simulated", "simulated_engine_trace", "recalibrated", "served"):
                per_round = [{r["policy"]: r[source] for r in here if r["round"] == i and r.get(source) is not None}
                             for i in range(rounds)]
                if not any(per_round):
                    continue
                ratios = [ratio for ratio in map(best_fixed_ratio, per_round) if ratio is not None]
                entry = {"workload": kind, "tpot_scale": tpot_scale, "tpot_ms": here[0]["tpot_ms"],
                         "ttft_ms": here[0]["ttft_ms"], "source": source, "policies": {},
                         "sloweave_vs_best_fixed": statistics.median(ratios) if ratios else None,
                         "sloweave_vs_best_fixed_range": [min(ratios), max(ratios)] if ratios else None}
                for policy in dict.fromkeys(r["policy"] for r in here if r.get(source) is not None):
                    values = [c[policy] for c in per_round if policy in c]
                    entry["policies"][policy] = {"median": statistics.median(values),
                                                 "range": [min(values), max(values)]}
                summary.append(entry)
    return summary


def recalibrate(result: dict[str, Any], settings: dict, run_dir: Path) -> None:
    """For each engine search (of two or more policies on its workload): a cost model fitted on
    the engine's steps in the other policies' probes of that workload and round, and with it the
    simulator's capacity on the engine's traces and its attainment at every engine probe, in
    ``row["recalibrated"]`` (and ``..._search``, ``probe["recalibrated_attainment"]``); each
    model's weights in ``row["recalibrated_cost_model"]``. Without the run's step logs: nothing,
    and a line that says so."""
    import statistics

    from preft.serving.scheduling.cost_model import StepCostModel

    rows = [r for r in result["rows"] if r.get("served_search")]
    logs: dict[str, list[dict[str, Any]]] = {}  # each probe's log is read once, used by the other policies

    fitting = []  # (row, the other policies' rows, their steps): every log read before any row changes
    for row in rows:
        others = [r for r in rows if (r["workload"], r["round"]) == (row["workload"], row["round"])
                  and r["policy"] != row["policy"]]
        if not others:
            continue
        # a probe shared by two targets' searches (reused) is one probe: its steps count once
        names = {step_log(r, probe) for r in others for probe in r["served_search"]["probes"]}
        try:
            for name in names:
                if name not in logs:
                    logs[name] = probe_steps(run_dir, name)
            fitting.append((row, others, [step for name in names for step in logs[name]]))
        except FileNotFoundError as err:  # a report without it beats no report after an hour of probes
            print(f"[capacity] not recalibrated: {err}", flush=True)
            return
    for row, others, steps in fitting:
        gaps = [step["gap_s"] for step in steps if step.get("gap_s") is not None]
        model = StepCostModel.fit([(step["n"], step["c"], step["x"]) for step in steps],
                                  [step["seconds"] for step in steps],
                                  source="the engine's steps in the other policies' probes",
                                  meta={"gap_s": statistics.median(gaps) if gaps else 0.0, "steps": len(steps),
                                        "fitted_on": sorted({r["policy"] for r in others})})
        tpot_s, ttft_s, seed = row["tpot_ms"] / 1e3, row["ttft_ms"] / 1e3, 100 + row["round"]
        found = simulated(model, row["policy"], row["workload"], settings, tpot_s, ttft_s,
                          row.get("simulated_engine_trace") or row["simulated"], seed,
                          requests=settings["engine_requests"])
        row.update(recalibrated=found["capacity"], recalibrated_search=found, recalibrated_cost_model=model.to_json())
        for probe in row["served_search"]["probes"]:
            probe["recalibrated_attainment"] = simulated_attainment(
                model, row["policy"], row["workload"], settings, tpot_s, ttft_s, probe["rate"], seed,
                settings["engine_requests"])
        print(f"[capacity] {row['workload']}, TPOT {row['tpot_ms']:.1f} ms, {row['policy']}: recalibrated on "
              f"{len(steps)} engine steps of {', '.join(model.meta['fitted_on'])}: {found['capacity']:.2f} req/s",
              flush=True)
    result["summary"] = summarize(result["rows"], settings, result["rounds"])


def policy_args(policy: str, tpot_s: float, seed_cost_model: str | None = None) -> list[str]:
    """``preft serve`` arguments for ``policy`` as a user starts it: SLOWeave its target and, with
    ``seed_cost_model``, that file as its online model's seed (else it learns from the prior)."""
    if policy != "sloweave":
        return ["--scheduler", policy]
    return ["--scheduler", policy, "--tpot-ms", f"{1e3 * tpot_s:.3f}"] + (
        ["--cost-model", str(seed_cost_model)] if seed_cost_model else [])


def best_fixed_ratio(capacities: dict[str, float]) -> float | None:
    """SLOWeave's capacity over the best fixed chunk's (``fixed:N`` policies), or None."""
    fixed = [value for policy, value in capacities.items() if policy.startswith("fixed:")]
    if "sloweave" not in capacities or not fixed or max(fixed) <= 0:
        return None
    return capacities["sloweave"] / max(fixed)


def run(cost_model, model_dir: str, settings: dict, out: Path, seed_cost_model: str | None = None) -> dict[str, Any]:
    """Every simulator policy on every workload and TPOT target, and every engine policy on the
    engine workloads at the engine's TPOT targets, ``rounds`` rounds (a new trace seed each);
    the engine's SLOWeave seeded with the file ``seed_cost_model`` when given."""
    from preft.eval.common import capacity as throughput_capacity
    from preft.eval.goodput import targets

    rounds = max(1, settings["engine_rounds"])
    run_dir = out / "capacity"
    run_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for kind in settings["workloads"]:
        rate0 = throughput_capacity(cost_model, kind, settings)
        scale = targets(cost_model, kind, rate0, settings)
        for tpot_scale in settings["tpot_scales"]:
            tpot = tpot_scale * scale["decode_step_s"]
            engine_here = kind in settings["engine_workloads"] and tpot_scale in settings["engine_tpot_scales"]
            for round_index in range(rounds):
                seed = 100 + round_index
                policies = settings["policies"] + [p for p in settings["engine_policies"] if p not in settings["policies"]]
                for policy in policies:
                    sim = simulated(cost_model, policy, kind, settings, tpot, scale["ttft_s"], rate0, seed)
                    print(f"[capacity] simulator: {kind}, TPOT {1e3 * tpot:.1f} ms, round {round_index + 1}, "
                          f"{policy}: {sim['capacity']:.2f} req/s", flush=True)
                    row = {"workload": kind, "tpot_scale": tpot_scale, "tpot_ms": 1e3 * tpot,
                           "ttft_ms": 1e3 * scale["ttft_s"], "round": round_index, "policy": policy,
                           "throughput_capacity": rate0, "simulated": sim["capacity"], "simulated_search": sim,
                           "served": None, "simulated_engine_trace": None}
                    if engine_here and policy in settings["engine_policies"] and sim["capacity"] > 0:
                        # the engine's traces in the simulator: what the engine's capacity is compared with
                        short = simulated(cost_model, policy, kind, settings, tpot, scale["ttft_s"], rate0, seed,
                                          requests=settings["engine_requests"])
                        label = probe_label(kind, tpot_scale, round_index, policy)
                        engine = served(model_dir, policy_args(policy, tpot, seed_cost_model), kind, settings, tpot,
                                        scale["ttft_s"], short["capacity"] or sim["capacity"], seed,
                                        settings["capacity_probes"], run_dir, label)
                        for probe in engine["probes"]:
                            probe["simulated_attainment"] = simulated_attainment(
                                cost_model, policy, kind, settings, tpot, scale["ttft_s"], probe["rate"], seed,
                                settings["engine_requests"])
                        row.update(served=engine["capacity"], served_search=engine,
                                   simulated_engine_trace=short["capacity"], simulated_engine_trace_search=short)
                    rows.append(row)
    return {"rounds": rounds, "rows": rows, "summary": summarize(rows, settings, rounds)}


def resolved(first: list, second: list) -> bool:
    """Whether two searches' brackets ``[met, missed)`` separate the policies: one met a rate above
    the rate the other missed. A search that steps from each policy's own start by the same
    factor can hand two policies the ratio of their starts whatever the engine did; then only
    disjoint brackets rank them."""
    (low_a, high_a), (low_b, high_b) = first, second
    return (high_b is not None and low_a >= high_b) or (high_a is not None and low_b >= high_a)


def sloweave_resolved(rows: list[dict[str, Any]]) -> bool | None:
    """In one round's engine rows: do the searches separate SLOWeave from the best fixed chunk?"""
    searches = {r["policy"]: r["served_search"] for r in rows if r.get("served_search")}
    fixed = [p for p in searches if p.startswith("fixed:")]
    if "sloweave" not in searches or not fixed:
        return None
    best = max(fixed, key=lambda p: searches[p]["capacity"])
    return resolved(searches["sloweave"]["bracket"], searches[best]["bracket"])


def brackets_table(result: dict[str, Any]) -> str:
    """Every engine search's bracket per round: the highest rate that met and the lowest that missed."""
    served_rows = [r for r in result["rows"] if r.get("served_search")]
    lines = ["| workload | TPOT target (ms) | round | policy: met [missed] (req/s) | SLOWeave vs best fixed resolved |",
             "|---|---|---|---|---|"]
    for key in dict.fromkeys((r["workload"], r["tpot_scale"], r["round"]) for r in served_rows):
        here = [r for r in served_rows if (r["workload"], r["tpot_scale"], r["round"]) == key]
        cells = "; ".join(
            f"{r['policy']} {r['served_search']['bracket'][0]:.2f} "
            f"[{'-' if r['served_search']['bracket'][1] is None else format(r['served_search']['bracket'][1], '.2f')}]"
            for r in here)
        verdict = sloweave_resolved(here)
        lines.append(f"| {key[0]} | {here[0]['tpot_ms']:.1f} | {key[2] + 1} | {cells} | "
                     f"{'-' if verdict is None else 'yes' if verdict else 'no'} |")
    return "\n".join(lines)


WHERE = {"simulated": "simulator", "simulated_engine_trace": "simulator, the engine's traces",
         "recalibrated": "simulator, the engine's traces, recalibrated on the other policies' engine steps",
         "served": "engine"}


def table(result: dict[str, Any]) -> str:
    """The capacity table: simulator and engine side by side, SLOWeave over the best fixed chunk."""
    lines = ["| workload | TPOT target (ms) | where | " + "policy: SLO capacity, median [range] (req/s) | "
             "SLOWeave / best fixed, median [range] |", "|---|---|---|---|---|"]
    for entry in result["summary"]:
        cells = "; ".join(f"{policy} {v['median']:.2f} [{v['range'][0]:.2f}-{v['range'][1]:.2f}]"
                          for policy, v in entry["policies"].items())
        ratio = entry["sloweave_vs_best_fixed"]
        ratio_text = (f"{ratio:.2f}x [{entry['sloweave_vs_best_fixed_range'][0]:.2f}-"
                      f"{entry['sloweave_vs_best_fixed_range'][1]:.2f}]" if ratio is not None else "-")
        where = WHERE[entry["source"]]
        lines.append(f"| {entry['workload']} | {entry['tpot_ms']:.1f} | {where} | {cells} | {ratio_text} |")
    return "\n".join(lines)


def fidelity(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (workload, target, policy) run on the engine: the simulator's capacity on the engine's
    traces over the engine's (median over rounds), how far it lies outside the engine search's
    bracket ``[met, missed)`` (:func:`bracket_gap`), the median gap in attainment between the two
    at the engine's probe rates, and whether the policies rank the same in both; the same for
    the recalibrated simulator where it ran."""
    import statistics

    out = []
    served_rows = [r for r in result["rows"] if r["served"] is not None]
    for key in dict.fromkeys((r["workload"], r["tpot_scale"]) for r in served_rows):
        here = [r for r in served_rows if (r["workload"], r["tpot_scale"]) == key]
        by_policy = {}
        for policy in dict.fromkeys(r["policy"] for r in here):
            mine = [r for r in here if r["policy"] == policy]
            probes = [p for r in mine for p in r["served_search"]["probes"]]
            by_policy[policy] = {
                "served": statistics.median(r["served"] for r in mine),
                "simulated": statistics.median(r["simulated_engine_trace"] for r in mine),
                "bracket_gap": statistics.median(bracket_gap(r["simulated_engine_trace"], r["served_search"]["bracket"])
                                                 for r in mine),
                "attainment_gap": statistics.median(abs(p["simulated_attainment"] - p["attainment"]) for p in probes)}
            if all(r.get("recalibrated") is not None for r in mine):
                by_policy[policy]["recalibrated"] = {
                    "simulated": statistics.median(r["recalibrated"] for r in mine),
                    "bracket_gap": statistics.median(bracket_gap(r["recalibrated"], r["served_search"]["bracket"])
                                                     for r in mine),
                    "attainment_gap": statistics.median(abs(p["recalibrated_attainment"] - p["attainment"])
                                                        for p in probes)}
        rank = lambda value: sorted(by_policy, key=lambda p: -value(by_policy[p]))  # noqa: E731
        entry = {"workload": key[0], "tpot_scale": key[1], "policies": by_policy,
                 "gap": {p: v["simulated"] / v["served"] - 1 if v["served"] else None for p, v in by_policy.items()},
                 "same_ranking": rank(lambda v: v["served"]) == rank(lambda v: v["simulated"])}
        if all("recalibrated" in v for v in by_policy.values()):
            entry["recalibrated_gap"] = {p: v["recalibrated"]["simulated"] / v["served"] - 1 if v["served"] else None
                                         for p, v in by_policy.items()}
            entry["recalibrated_same_ranking"] = rank(lambda v: v["served"]) == rank(
                lambda v: v["recalibrated"]["simulated"])
        out.append(entry)
    return out


def bracket_gap(rate: float, bracket: list) -> float:
    """How far ``rate`` lies outside an engine search's ``[met, missed)``, relative to the nearer
    end: 0 inside it (the engine's capacity is somewhere in it; ``missed`` None: no probe missed),
    ``rate / met - 1`` below it, ``rate / missed - 1`` above it."""
    low, high = bracket
    if rate < low:
        return rate / low - 1
    if high is not None and rate >= high:
        return rate / high - 1
    return 0.0


def plot(result: dict[str, Any], path: Path) -> None:
    """SLO capacity per policy, median and range over rounds: bars for the engine and markers for
    the simulator, or bars for the simulator where no engine ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((e["workload"], e["tpot_ms"]) for e in result["summary"]))
    served = any(e["source"] == "served" for e in result["summary"])
    fig, axes = plt.subplots(1, len(groups), figsize=(3.4 * len(groups), 3.6), squeeze=False)
    for ax, (kind, tpot_ms) in zip(axes[0], groups):
        entries = {e["source"]: e for e in result["summary"] if (e["workload"], e["tpot_ms"]) == (kind, tpot_ms)}
        # with the engine: its policies, each beside the simulator on the engine's traces
        engine_here = "served" in entries
        policies = list(entries["served" if engine_here else "simulated"]["policies"])
        for index, policy in enumerate(policies):
            bar = entries["served" if engine_here else "simulated"]["policies"][policy]
            if engine_here:
                ax.plot(index, entries["simulated_engine_trace"]["policies"][policy]["median"], "k_", markersize=14)
                recalibrated = entries.get("recalibrated", {}).get("policies", {}).get(policy)
                if recalibrated:
                    ax.plot(index, recalibrated["median"], "rx", markersize=8)
            if bar:
                ax.bar(index, bar["median"], 0.6, yerr=[[bar["median"] - bar["range"][0]],
                                                        [bar["range"][1] - bar["median"]]], capsize=3,
                       color="tab:orange" if policy == "sloweave" else "tab:blue")
        ax.set_xticks(range(len(policies)), policies, rotation=30, fontsize=7)
        ax.set_title(f"{kind}, TPOT {tpot_ms:.0f} ms", fontsize=9)
        ax.set_ylabel("SLO capacity (req/s)", fontsize=8)
        ax.set_ylim(bottom=0)
    where = ("bars: engine, or the simulator where no engine ran; -: simulator on the engine's traces, "
             "x: recalibrated on the other policies' engine steps" if served else "simulator, no engine runs")
    fig.suptitle(f"highest rate with >= {ATTAINMENT:.0%} of requests within both targets\n"
                 f"({where}; median and range over rounds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
