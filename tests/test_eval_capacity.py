"""`preft eval capacity`: the capacity planner in a small configuration (roofline, simulator)."""

from __future__ import annotations

import json

import pytest

from preft.eval import capacity as eval_capacity


def test_the_plan_ranks_the_variants_and_its_capacity_is_the_edge_of_the_slo(tmp_path):
    result = eval_capacity.main(hardware="H100", model="llama-3.1-8b", adapters=16, slots=4,
                                policies="default,fixed:512", requests=60, rate_per_adapter=1.0, out=str(tmp_path))
    rows = result["variants"]
    assert set(rows) == {"base", "preft", "all-token"}
    assert rows["base"]["capacity"] >= rows["preft"]["capacity"] > rows["all-token"]["capacity"] > 0
    assert rows["preft"]["adapters_per_gpu"] >= rows["all-token"]["adapters_per_gpu"] >= 1
    assert rows["preft"]["gpus"] == -(-16 // rows["preft"]["adapters_per_gpu"])
    # the capacity meets the SLO and a quarter more does not, under the policy the plan names
    planner = eval_capacity.Planner(*_planner_args(result))
    for variant in ("preft", "all-token"):
        row = rows[variant]
        assert planner.meets(variant, row["policy"], 16, row["capacity"])
        assert not planner.meets(variant, row["policy"], 16, 1.25 * row["capacity"])
        assert row["capacity"] == max(row["by_policy"].values())
    saved = json.loads((tmp_path / "capacity" / "results.json").read_text())
    assert saved["advice"].startswith(f"Serve PreFT with `preft serve --scheduler {rows['preft']['policy']}`")
    assert "adapters per GPU" in (tmp_path / "capacity" / "capacity.md").read_text()


def _planner_args(result):
    from preft.eval.plan import roofline

    s = result["settings"]
    work = eval_capacity.load_workload(s["workload"], s["requests"], s["max_len"], s["ttft_ms"] / 1e3)
    return (roofline("H100", "llama-3.1-8b", 1), work, s["slots"], s["ttft_ms"] / 1e3, s["tpot_ms"] / 1e3,
            s["attainment"])


def test_a_trace_is_scaled_to_each_rate_and_bad_input_is_one_error(tmp_path):
    from preft.serving.scheduling import workloads

    trace = workloads.write_trace(workloads.generate("chat", 40, 5.0, seed=3), tmp_path / "trace.jsonl")
    at = eval_capacity.load_workload(str(trace), 0, 0, 1.0)
    slow, fast = at(5.0), at(20.0)
    assert len(slow) == len(fast) == 40
    assert fast[-1].arrival_s == pytest.approx(slow[-1].arrival_s / 4)
    assert [r.prompt_tokens for r in fast] == [r.prompt_tokens for r in slow]
    once = workloads.write_trace([workloads.RequestSpec(str(i), 0.0, 100, 10) for i in range(3)], tmp_path / "once.jsonl")
    with pytest.raises(ValueError, match="arrives at once"):
        eval_capacity.load_workload(str(once), 0, 0, 1.0)
    with pytest.raises(ValueError, match="--workload 'nope'"):
        eval_capacity.main(workload="nope", out=str(tmp_path))
    with pytest.raises(ValueError, match="unknown chunk policy|policy"):
        eval_capacity.main(policies="default,bogus", out=str(tmp_path))
    with pytest.raises(ValueError, match="--attainment"):
        eval_capacity.main(attainment=1.5, out=str(tmp_path))
