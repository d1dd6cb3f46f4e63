"""SLO capacity (`preft eval goodput --capacity`): the search, and a simulator run end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from preft.eval import slo_capacity


def step_at(threshold: float):
    calls = []

    def attainment(rate: float) -> float:
        calls.append(rate)
        return 1.0 if rate <= threshold else 0.5

    return attainment, calls


@pytest.mark.parametrize("start", [0.2, 3.0, 50.0])
def test_the_search_brackets_the_capacity_from_below_or_above(start):
    attainment, calls = step_at(3.7)
    found = slo_capacity.search(attainment, start, probes=14)
    low, high = found["bracket"]
    assert len(calls) == 14 and low <= 3.7 < high and found["capacity"] == low
    assert high / low < 1.02  # 14 probes narrow a factor-1.5 bracket to about 1%
    assert [p["rate"] for p in found["probes"]] == calls


def test_the_search_reports_zero_when_no_rate_meets_and_none_above_when_every_rate_does():
    never = slo_capacity.search(lambda rate: 0.0, 1.0, probes=4)
    assert never["capacity"] == 0.0 and never["bracket"][1] == pytest.approx(1 / 1.5 ** 3)
    always = slo_capacity.search(lambda rate: 1.0, 1.0, probes=4)
    assert always["capacity"] == pytest.approx(1.5 ** 3) and always["bracket"][1] is None
    exactly = slo_capacity.search(lambda rate: slo_capacity.ATTAINMENT, 1.0, probes=1)
    assert exactly["capacity"] == 1.0  # at least 90% meets
    with pytest.raises(ValueError, match="probes >= 1"):
        slo_capacity.search(lambda rate: 1.0, 1.0, probes=0)


def test_best_fixed_ratio_compares_sloweave_with_the_best_fixed_chunk_only():
    assert slo_capacity.best_fixed_ratio({"fixed:64": 2.0, "fixed:256": 4.0, "default": 9.0, "sloweave": 5.0}) == 1.25
    assert slo_capacity.best_fixed_ratio({"fixed:64": 2.0}) is None


def test_goodput_capacity_in_the_simulator(tmp_path):
    from preft.eval import goodput
    from preft.serving.scheduling.cost_model import StepCostModel

    cost = StepCostModel.synthetic().save(tmp_path / "cost.json")
    result = goodput.main(model="default", cost_model=str(cost), workloads="mixed", policies="fixed:16,fixed:256,sloweave",
                          tpot_scales="1.5,4", requests=200, capacity=True, capacity_requests=120, engine_policies="",
                          engine_rounds=2, out=str(tmp_path))
    found = result["capacity"]
    assert found["rounds"] == 2 and len(found["rows"]) == 2 * 2 * 3
    for row in found["rows"]:
        search = row["simulated_search"]
        assert row["served"] is None and row["simulated"] == search["capacity"]
        met = [p["rate"] for p in search["probes"] if p["attainment"] >= slo_capacity.ATTAINMENT]
        assert row["simulated"] == (max(met) if met else 0.0)
    # a looser TPOT target is met at higher rates by every policy
    for policy in ("fixed:16", "fixed:256", "sloweave"):
        capacity = {e["tpot_scale"]: e["policies"][policy]["median"] for e in found["summary"]}
        assert capacity[4] >= capacity[1.5]
    markdown = (tmp_path / "goodput" / "goodput_capacity.md").read_text()
    assert "| mixed |" in markdown and "SLOWeave / best fixed" in markdown
    assert json.loads((tmp_path / "goodput" / "goodput_capacity.json").read_text())["command"].split().count("--capacity") == 1
    assert (tmp_path / "goodput" / "goodput_capacity.png").stat().st_size > 1000


def test_goodput_engine_workloads_are_checked(tmp_path):
    from preft.eval import goodput

    with pytest.raises(ValueError, match="engine-workload takes one workload"):
        goodput.main(model="default", workloads="mixed,long", engine_workload="mixed,long", out=str(tmp_path))
    with pytest.raises(ValueError, match="long is not in --workloads"):
        goodput.main(model="default", workloads="mixed", engine_workload="mixed,long", capacity=True, out=str(tmp_path))
    with pytest.raises(ValueError, match="unknown workload 'lon'"):
        goodput.main(model="default", workloads="mixed", engine_workload="lon", capacity=True, out=str(tmp_path))


def test_only_disjoint_engine_brackets_rank_two_policies():
    # both searches stepped by the same factor from their own starts: met 1.5x start, missed 2.25x
    assert not slo_capacity.resolved([9.06, 13.60], [10.24, 15.36])
    assert slo_capacity.resolved([1.81, 2.22], [1.23, 1.51])
    assert slo_capacity.resolved([1.0, 1.2], [1.5, None])
    assert not slo_capacity.resolved([1.0, None], [1.5, None])
    rows = [{"workload": "long", "tpot_scale": 5, "tpot_ms": 139.0, "round": 0, "policy": policy,
             "served_search": {"capacity": bracket[0], "bracket": bracket}}
            for policy, bracket in [("fixed:64", [3.24, 3.97]), ("fixed:256", [2.35, 2.88]),
                                    ("sloweave", [3.81, 4.66])]]
    assert slo_capacity.sloweave_resolved(rows) is False  # 3.81 < 3.97: fixed:64 may reach it
    rows[2]["served_search"] = {"capacity": 4.0, "bracket": [4.0, 4.66]}
    assert slo_capacity.sloweave_resolved(rows) is True
    table = slo_capacity.brackets_table({"rows": rows})
    assert "| long | 139.0 | 1 | fixed:64 3.24 [3.97]; fixed:256 2.35 [2.88]; sloweave 4.00 [4.66] | yes |" in table


def test_goodput_capacity_reports_each_engine_search_bracket(tmp_path, monkeypatch):
    from preft.eval import goodput
    from preft.serving.scheduling.cost_model import StepCostModel

    engine_capacity = {"fixed:16": 3.0, "sloweave": 5.0}  # a stand-in engine: meets below these rates

    def served(model_dir, policy_args, kind, settings, tpot_s, ttft_s, start, seed, probes, run_dir, label):
        policy = policy_args[1]
        return slo_capacity.search(lambda rate: 1.0 if rate <= engine_capacity[policy] else 0.0, start, probes)

    monkeypatch.setattr(slo_capacity, "served", served)
    cost = StepCostModel.synthetic().save(tmp_path / "cost.json")
    result = goodput.main(model="default", cost_model=str(cost), workloads="mixed", policies="fixed:16,sloweave",
                          tpot_scales="4", capacity=True, capacity_requests=120, engine_policies="fixed:16,sloweave",
                          engine_workload="mixed", engine_rounds=1, capacity_probes=14, out=str(tmp_path))
    rows = {r["policy"]: r for r in result["capacity"]["rows"]}
    for policy, capacity in engine_capacity.items():
        low, high = rows[policy]["served_search"]["bracket"]
        assert low <= capacity < high and rows[policy]["served"] == low
    markdown = (tmp_path / "goodput" / "goodput_capacity.md").read_text()
    searches = markdown.split("Engine searches, per round")[1]
    number = r"\d+\.\d\d"
    assert re.search(rf"\| mixed \| [\d.]+ \| 1 \| fixed:16 {number} \[{number}\]; sloweave {number} \[{number}\] "
                     rf"\| yes \|", searches), searches


@pytest.mark.parametrize("seeded", [False, True])
def test_engine_seeded_gives_sloweave_s_servers_the_profile_as_their_cost_model_seed(tmp_path, monkeypatch, seeded):
    from preft.eval import goodput
    from preft.serving.scheduling.cost_model import StepCostModel

    servers = {}

    def served(model_dir, policy_args, kind, settings, tpot_s, ttft_s, start, seed, probes, run_dir, label):
        servers[policy_args[1]] = policy_args
        return slo_capacity.search(lambda rate: 1.0 if rate <= 3.0 else 0.0, start, probes)

    monkeypatch.setattr(slo_capacity, "served", served)
    cost = StepCostModel.synthetic().save(tmp_path / "cost.json")
    goodput.main(model="default", cost_model=str(cost), workloads="mixed", policies="fixed:16,sloweave",
                 tpot_scales="4", capacity=True, capacity_requests=120, engine_policies="fixed:16,sloweave",
                 engine_workload="mixed", engine_rounds=1, capacity_probes=3, engine_seeded=seeded, out=str(tmp_path))
    assert servers["fixed:16"] == ["--scheduler", "fixed:16"]
    sloweave = servers["sloweave"]
    assert sloweave[:3] == ["--scheduler", "sloweave", "--tpot-ms"]
    assert sloweave[4:] == (["--cost-model", str(Path(cost).resolve())] if seeded else [])
    markdown = (tmp_path / "goodput" / "goodput_capacity.md").read_text()
    assert ("the profile as its cost model's seed" in markdown) == seeded


def test_the_engine_is_compared_with_the_simulator_on_the_engine_s_own_traces(tmp_path, monkeypatch):
    from preft.eval import goodput
    from preft.serving.scheduling.cost_model import StepCostModel

    cost_model = StepCostModel.synthetic()
    # a stand-in engine that behaves exactly as the simulator does on the traces it is sent
    def served(model_dir, policy_args, kind, settings, tpot_s, ttft_s, start, seed, probes, run_dir, label):
        policy = policy_args[1]
        return slo_capacity.search(lambda rate: slo_capacity.simulated_attainment(
            cost_model, policy, kind, settings, tpot_s, ttft_s, rate, seed, settings["engine_requests"]), start, probes)

    monkeypatch.setattr(slo_capacity, "served", served)
    cost = cost_model.save(tmp_path / "cost.json")
    result = goodput.main(model="default", cost_model=str(cost), workloads="mixed", policies="fixed:16,fixed:256",
                          tpot_scales="4", capacity=True, capacity_requests=300, engine_requests=30,
                          engine_policies="fixed:16,fixed:256", engine_workload="mixed", engine_rounds=1,
                          capacity_probes=4, out=str(tmp_path))
    rows = result["capacity"]["rows"]
    # short traces end before the backlog of long ones builds: the two simulator figures differ
    assert any(r["simulated_engine_trace"] != r["simulated"] for r in rows)
    for row in rows:
        assert row["simulated_engine_trace"] == row["simulated_engine_trace_search"]["capacity"]
        assert all(p["simulated_attainment"] == p["attainment"] for p in row["served_search"]["probes"])
    for policy, entry in result["fidelity"][0]["policies"].items():
        assert entry["attainment_gap"] == 0.0 and entry["simulated"] == next(
            r["simulated_engine_trace"] for r in rows if r["policy"] == policy)
    assert result["cost_model_weights"]["weights"] == cost_model.weights
    markdown = (tmp_path / "goodput" / "goodput_capacity.md").read_text()
    assert "| mixed | 4 | profiled | fixed:16 " in markdown and "0 pts" in markdown
    assert "simulator, the engine's traces" in markdown


def test_recalibrating_on_the_engine_s_steps_of_the_other_policies_recovers_the_engine_s_step_cost(tmp_path,
                                                                                                   monkeypatch):
    import json as json_module

    from preft.eval import goodput
    from preft.eval.common import simulate_policy
    from preft.serving.scheduling import workloads
    from preft.serving.scheduling.cost_model import StepCostModel

    synthetic = StepCostModel.synthetic()
    engine_cost = StepCostModel([0.6 * w for w in synthetic.weights])  # the engine runs faster than profiled

    # a stand-in engine: the simulator with the engine's step cost, writing a step log per probe as serve_trace does
    def served(model_dir, policy_args, kind, settings, tpot_s, ttft_s, start, seed, probes, run_dir, label):
        def at(rate):
            work = workloads.generate(kind, settings["engine_requests"], rate, seed=seed, max_model_len=settings["max_len"])
            result = simulate_policy(engine_cost, policy_args[1], work, settings, tpot_s, record=True)
            with open(run_dir / f"steps-{label}-{rate:.3f}.jsonl", "w") as log:
                for n, c, x in result.step_shapes:
                    log.write(json_module.dumps({"n": n, "c": c, "x": x, "seconds": engine_cost(n, c, x),
                                                 "gap_s": 0.0}) + "\n")
            return slo_capacity.attainment(result.timings, len(work), ttft_s, tpot_s)
        return slo_capacity.search(at, start, probes)

    monkeypatch.setattr(slo_capacity, "served", served)
    cost = synthetic.save(tmp_path / "cost.json")
    arguments = dict(model="default", cost_model=str(cost), workloads="mixed", policies="fixed:16,fixed:256",
                     tpot_scales="4", capacity=True, capacity_requests=100, engine_requests=40,
                     engine_policies="fixed:16,fixed:256", engine_workload="mixed", engine_rounds=1,
                     capacity_probes=4)
    result = goodput.main(**arguments, out=str(tmp_path / "run"))
    logs = tmp_path / "run" / "goodput" / "capacity"
    for row in result["capacity"]["rows"]:
        model = row["recalibrated_cost_model"]
        other = "fixed:256" if row["policy"] == "fixed:16" else "fixed:16"
        assert model["fitted_on"] == [other]  # leave one policy out: the other's steps alone
        assert model["steps"] == sum(len(path.read_text().splitlines())
                                     for path in logs.glob(f"steps-mixed-*-{other.replace(':', '')}-*.jsonl"))
        fitted = StepCostModel(model["weights"])  # and from them alone it finds the engine's cost
        assert all(abs(fitted(n, c, x) - engine_cost(n, c, x)) < 1e-3 * engine_cost(n, c, x)
                   for n, c, x in [(0, 64, 0), (8, 0, 900), (16, 200, 3000)])
    (entry,) = result["fidelity"]
    for policy, values in entry["policies"].items():  # the engine's 4 probes bracket its capacity coarsely
        assert values["recalibrated"]["attainment_gap"] <= 0.01 and values["recalibrated"]["bracket_gap"] == 0
        # the profiled model is slower than the engine: the simulator underestimates its capacity
        assert values["attainment_gap"] > 0.1 and values["bracket_gap"] < 0 and entry["gap"][policy] < 0
    markdown = (tmp_path / "run" / "goodput" / "goodput_capacity.md").read_text()
    assert "| mixed | 4 | recalibrated | fixed:16 " in markdown and ", in, 0 pts" in markdown

    # a step log missing: no row is recalibrated, rather than some rows on part of the steps
    found = {**result["capacity"], "rows": [{k: v for k, v in row.items() if not k.startswith("recalibrated")}
                                            for row in result["capacity"]["rows"]]}
    partial = tmp_path / "partial"
    partial.mkdir()
    kept = sorted(logs.glob("steps-*.jsonl"))
    for path in kept[1:]:
        (partial / path.name).write_text(path.read_text())
    slo_capacity.recalibrate(found, result["settings"], partial)
    assert not any("recalibrated" in row for row in found["rows"])

    # the report made again from the run's files alone, serving nothing
    monkeypatch.setattr(slo_capacity, "served", None)
    again = goodput.main(**arguments, from_run=str(tmp_path / "run"), out=str(tmp_path / "again"))
    assert again["fidelity"] == result["fidelity"] and "--from-run" in again["command"]
    with pytest.raises(ValueError, match="is not the result of"):
        goodput.main(**arguments, from_run=str(tmp_path / "nothing"), out=str(tmp_path / "again"))


def test_a_rate_outside_the_engine_s_bracket_is_measured_from_its_nearer_end():
    assert slo_capacity.bracket_gap(3.0, [2.0, 4.0]) == 0.0 and slo_capacity.bracket_gap(9.0, [2.0, None]) == 0.0
    assert slo_capacity.bracket_gap(1.5, [2.0, 4.0]) == pytest.approx(-0.25)
    assert slo_capacity.bracket_gap(4.4, [2.0, 4.0]) == pytest.approx(0.10)


def test_known_probes_are_free_and_start_the_search_from_their_bracket():
    attainment, calls = step_at(3.7)
    # a bracket known already: only bisection, no probe at the start, and the probe budget all new
    known = [(2.0, 1.0), (6.0, 0.4), (9.0, 0.2), (8.0, 1.0)]  # 8.0 met above a miss: noise, not the bracket
    found = slo_capacity.search(attainment, start=5.0, probes=3, known=known)
    assert len(calls) == 3 and all(2.0 < rate < 6.0 for rate in calls)
    assert [p["rate"] for p in found["probes"] if p.get("reused")] == [2.0, 6.0, 8.0, 9.0]
    low, high = found["bracket"]
    assert low <= 3.7 < high and high / low < 6.0 / 2.0
    # only rates that met known: the start is probed first when it lies above them, then up from there
    attainment, calls = step_at(3.7)
    slo_capacity.search(attainment, start=3.0, probes=2, known=[(1.0, 1.0)])
    assert calls == [3.0, 4.5]
    # ... and not when it lies below them: the search steps up from the highest known rate
    attainment, calls = step_at(3.7)
    slo_capacity.search(attainment, start=0.5, probes=1, known=[(1.0, 1.0)])
    assert calls == [1.5]
    # only misses known: down from the lowest, the start first when it lies below it
    attainment, calls = step_at(3.7)
    slo_capacity.search(attainment, start=4.0, probes=2, known=[(6.0, 0.0)])
    assert calls == [4.0, 4.0 / 1.5]


def test_a_fixed_chunk_s_probes_serve_both_targets_and_a_run_again_reads_them_back(tmp_path, monkeypatch):
    from preft.eval import common, goodput
    from preft.serving.scheduling import workloads
    from preft.serving.scheduling.cost_model import StepCostModel
    from preft.serving.scheduling.metrics import meets

    cost_model = StepCostModel.synthetic()
    served_traces = []
    real_generate = workloads.generate

    # a stand-in server: the simulator on the trace it is sent, writing its step log as serve_trace does
    def serve_trace(model_dir, policy_args, trace, label, run_dir, settings, adapters=None, slots=0):
        served_traces.append((tuple(policy_args), trace.read_text()))
        tpot_s = float(policy_args[3]) / 1e3 if "--tpot-ms" in policy_args else 1.0
        result = common.simulate_policy(cost_model, policy_args[1], workloads.read_trace(trace), settings, tpot_s,
                                        record=True)
        (run_dir / f"steps-{label}.jsonl").write_text("".join(
            json.dumps({"n": n, "c": c, "x": x, "seconds": cost_model(n, c, x), "gap_s": 0.0}) + "\n"
            for n, c, x in result.step_shapes))
        return result.timings, []

    monkeypatch.setattr(common, "serve_trace", serve_trace)
    cost = cost_model.save(tmp_path / "cost.json")
    arguments = dict(model="default", cost_model=str(cost), workloads="mixed", policies="fixed:16,sloweave",
                     tpot_scales="1.5,4", capacity=True, capacity_requests=100, engine_requests=30,
                     engine_policies="fixed:16,sloweave", engine_workload="mixed", engine_rounds=1,
                     capacity_probes=3, out=str(tmp_path / "run"))
    result = goodput.main(**arguments)
    rows = {(r["policy"], r["tpot_scale"]): r for r in result["capacity"]["rows"]}
    run_dir = tmp_path / "run" / "goodput" / "capacity"

    def probes(policy, scale, reused):
        return [p for p in rows[policy, scale]["served_search"]["probes"] if bool(p.get("reused")) == reused]

    # the looser target's fixed-chunk search starts from the tighter one's probes ...
    assert [p["rate"] for p in probes("fixed:16", 4, True)] == sorted(p["rate"] for p in probes("fixed:16", 1.5, False))
    # ... each judged against the looser target on the timings that probe served
    row = rows["fixed:16", 4]
    for probe in probes("fixed:16", 4, True):
        work = workloads.generate("mixed", 30, probe["rate"], seed=100, max_model_len=result["settings"]["max_len"])
        timings = common.simulate_policy(cost_model, "fixed:16", work, result["settings"], 1.0).timings
        expected = sum(meets(t, row["ttft_ms"] / 1e3, row["tpot_ms"] / 1e3) for t in timings) / len(work)
        assert probe["attainment"] == pytest.approx(expected)
    # SLOWeave's server takes the target: nothing shared; every trace served once, each probe's log kept
    assert not probes("sloweave", 4, True) and len(probes("fixed:16", 4, False)) == 3
    assert len(served_traces) == len(set(served_traces)) == sum(len(probes(p, s, False)) for p, s in rows)
    for (policy, scale), row in rows.items():
        assert all((run_dir / p["step_log"]).is_file() for p in row["served_search"]["probes"])
    # recalibrating SLOWeave counts a shared probe's steps once
    fixed_logs = {p["step_log"] for s in (1.5, 4) for p in rows["fixed:16", s]["served_search"]["probes"]}
    assert rows["sloweave", 4]["recalibrated_cost_model"]["steps"] == sum(
        len((run_dir / name).read_text().splitlines()) for name in fixed_logs)

    # the same run again in the same --out, after a crash that lost one search's last probe: that
    # probe alone is served again; each search keeps its probes and may know more (the other
    # target's probes of its server), so its bracket lies within the first run's
    store = run_dir / "probes.jsonl"
    records = store.read_text().splitlines()
    last = json.loads(records[-1])
    store.write_text("".join(line + "\n" for line in records[:-1]))
    served_traces.clear()
    again = goodput.main(**arguments)
    assert len(served_traces) == 1 and served_traces[0][1] == (
        run_dir / f"{slo_capacity.probe_name(last['label'], last['search'], last['rate'])}.trace.jsonl").read_text()
    for row in again["capacity"]["rows"]:
        (low, high), (first_low, first_high) = row["served_search"]["bracket"], rows[
            row["policy"], row["tpot_scale"]]["served_search"]["bracket"]
        assert first_low <= low and (first_high is None or (high is not None and high <= first_high))
        if row["policy"] == "sloweave":  # it shares nothing: the same probes, the same bracket
            first = rows["sloweave", row["tpot_scale"]]["served_search"]
            assert row["served_search"]["bracket"] == first["bracket"] and sorted(
                p["rate"] for p in row["served_search"]["probes"]) == sorted(p["rate"] for p in first["probes"])
    # SLOWeave seeded in the same --out: a server of its own, served anew, its files beside the
    # unseeded one's, which stay as they were; the fixed chunks' servers are read back
    logs = {p["step_log"]: (run_dir / p["step_log"]).read_text()
            for s in (1.5, 4) for p in rows["sloweave", s]["served_search"]["probes"]}
    served_traces.clear()
    seeded = goodput.main(**arguments, engine_seeded=True)
    assert served_traces and all(args[:2] == ("--scheduler", "sloweave") and "--cost-model" in args
                                 for args, _ in served_traces)
    assert all((run_dir / name).read_text() == text for name, text in logs.items())
    for row in seeded["capacity"]["rows"]:
        if row["policy"] == "sloweave":
            assert not {p["step_log"] for p in row["served_search"]["probes"]} & set(logs)
    # a changed trace is not read back: another seed for the rounds' workload serves anew
    monkeypatch.setattr(workloads, "generate", lambda *args, seed, **kwargs: real_generate(*args, seed=seed + 1, **kwargs))
    served_traces.clear()
    goodput.main(**arguments)
    assert len(served_traces) == 4 * 3
