"""`preft eval profile` and `preft eval goodput` in tiny configurations, on the real engine."""

from __future__ import annotations

import json

import pytest

from preft.eval import goodput as eval_goodput, profile as eval_profile
from preft.serving.scheduling.cost_model import StepCostModel


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    return out, eval_profile.main(model="default", decodes="0,2,6", chunks="16,64,256", repeats=1, served=True,
                                  served_requests=24, out=str(out))


@pytest.mark.slow
def test_profile_fits_a_monotone_cost_model_on_measured_steps(profile):
    out, result = profile
    model = StepCostModel.load(result["cost_model_path"])
    steps = json.loads((out / "profile" / "steps_default.json").read_text())
    assert len(steps) == result["steps"] > 30
    # the grid was run: every decode count and chunk size appears among the measured shapes
    assert {s["n"] for s in steps} >= {0, 2, 6} and {s["c"] for s in steps} >= {0, 16, 64, 256}
    assert all(s["seconds"] > 0 for s in steps) and any(s["held_out"] for s in steps)
    assert result["median_relative_error"] >= 0 and result["p95_relative_error"] >= result["median_relative_error"]
    values = [model(2, c, 200) for c in range(0, 512, 16)]
    assert all(b >= a for a, b in zip(values, values[1:]))
    assert model(0, 256, 0) > model(0, 16, 0)  # a bigger prefill costs more on the real engine
    assert (out / "profile" / "profile_default.png").stat().st_size > 1000
    assert "held out" in (out / "profile" / "profile_default.md").read_text()
    # --served: a real server under a bursty load, its chunk sizes cycling through --chunks
    served = result["served"]
    calibration = json.loads((out / "profile" / "steps_default_served.json").read_text())
    assert len(calibration) == served["steps"] > 10 and {s["policy"] for s in calibration} == {"cycle:16,64,256"}
    assert {s["c"] for s in calibration} & {16, 64} and max(s["c"] for s in calibration) <= 256
    assert StepCostModel.load(served["cost_model_path"]).meta["label"] == "default, served under load"
    assert "--served" in served["command"] and served["offline_model_error_on_served_steps"] >= 0


@pytest.mark.slow
def test_goodput_runs_the_simulator_and_the_real_engine_side_by_side(profile, tmp_path):
    out, profiled = profile
    result = eval_goodput.main(model="default", cost_model=profiled["cost_model_path"], workloads="chat,long",
                               policies="default,fixed:16,sloweave", tpot_scales="2", loads="0.5,1.5", requests=60,
                               engine_policies="sloweave", engine_workload="mixed", engine_load=0.5,
                               engine_requests=24, adapters=4, slots=2, out=str(tmp_path))
    rows = result["simulation"]
    assert {(r["workload"], r["load"], r["policy"]) for r in rows} == {
        (w, l, p) for w in ("chat", "long") for l in (0.5, 1.5) for p in ("default", "fixed:16", "sloweave")}
    for r in rows:
        assert r["requests"] == 60 and 0 <= r["slo_attainment"] <= 1 and r["goodput"] <= r["request_throughput"] + 1e-9
    # load matters: past capacity the default policy's TTFT grows
    ttft = {r["load"]: r["ttft_ms_p50"] for r in rows if r["workload"] == "long" and r["policy"] == "default"}
    assert ttft[1.5] > ttft[0.5]
    fidelity = {r["policy"]: r for r in result["fidelity"]["rows"]}
    assert set(fidelity) == {"sloweave"}  # one server keeps the test short; fixed chunks: test_chunk_policies_engine
    # the slot-limited regime: 4 LoRA-P adapters on 2 slots, on the engine and in the simulator
    assert result["settings"]["slots"] == 2 and result["settings"]["bundles"] == [f"lora{i}" for i in range(4)]
    for policy, row in fidelity.items():
        assert row["failed"] == 0 and row["engine"]["requests"] == 24  # every request answered by the real server
        assert row["profiled"]["requests"] == row["in_situ"]["requests"] == 24
        assert row["step_error"]["measured_median_ms"] > 0
    weave = [json.loads(line) for line in (tmp_path / "goodput" / "engine" / "steps-sloweave.jsonl").read_text().splitlines()]
    assert weave and all(s["policy"] == "sloweave" and s["c"] <= s["budget"] for s in weave)
    markdown = (tmp_path / "goodput" / "goodput.md").read_text()
    assert "| chat |" in markdown and "Ranking by goodput" in markdown
    for figure in ("goodput_sim.png", "goodput_engine.png"):
        assert (tmp_path / "goodput" / figure).stat().st_size > 1000
    # the report gathers the goodput section with both figures (and the docs copy points at its copies)
    from preft.eval import report as eval_report

    eval_report.main(out=str(tmp_path), write_docs=True, docs_dir=str(tmp_path / "docs"))
    docs = (tmp_path / "docs" / "RESULTS.md").read_text()
    assert "<!-- bench:eval_goodput -->" in docs and "(results/eval_goodput_engine.png)" in docs
    assert (tmp_path / "docs" / "results" / "eval_goodput_sim.png").is_file()
    assert "(goodput/goodput_sim.png)" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_prefix_eval_measures_both_structures_and_a_shared_prefix_decode_batch(tmp_path):
    from preft.eval import prefix as eval_prefix

    result = eval_prefix.main(parts="cost,decode-batch", waiting="20,60", model="default", batch=4,
                              prefix_tokens=64, out=str(tmp_path))
    for row in result["cost"]:
        assert row["same_picks"] and len(row["cht"]["picks"]) == eval_prefix.SELECTIONS
        assert row["cht"]["selection_s"] > 0 and row["radix"]["selection_s"] > 0
    assert [row["waiting"] for row in result["cost"]] == [20, 60]
    decode = result["decode_batch"]
    for phase in ("shared", "distinct"):
        assert decode[phase]["decode_steps"] > 0 and len(decode[phase]["per_round_median_ms"]) == decode["repeats"]
    assert decode["shared_vs_distinct"] == pytest.approx(decode["shared"]["median_ms"] / decode["distinct"]["median_ms"])
    assert "| 60 |" in (tmp_path / "prefix" / "prefix.md").read_text()
    with pytest.raises(ValueError, match="unknown part"):
        eval_prefix.main(parts="speed", out=str(tmp_path))
