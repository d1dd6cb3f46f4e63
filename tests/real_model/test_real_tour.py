"""The tour (`preft demo`) and the precision benchmark (`preft bench sft-step --model`) on
SmolLM2-135M-Instruct, as a user runs them: what they print is what they measured."""

from __future__ import annotations

import pytest

from preft import demo
from preft.eval.bench import sft_step

MODEL = "smollm2-135m-instruct"


@pytest.mark.slow
@pytest.mark.real_model
def test_the_tour_teaches_each_user_their_behaviour_and_the_base_model_shows_none(tmp_path):
    """The tour's training defaults (20 steps of 8 rows per user; a smaller closing benchmark):
    every user's held-out loss falls, their checker finds the behaviour in most answers of their
    adapter and in few of the base model's, and the closing benchmark serves PreFT faster than the
    same adapters all-token."""
    result = demo.main(output_dir=str(tmp_path / "demo"), eval_adapters=4, eval_slots=2)
    assert set(result["scores"]) == set(demo.USERS)
    for name, (before, after) in result["losses"].items():
        assert after < 0.5 * before, (name, before, after)
        adapter, base = result["scores"][name]["adapter"], result["scores"][name]["base"]
        assert adapter[0] >= 0.8 * demo.ASKED and base[0] <= 0.2 * demo.ASKED, (name, adapter, base)
    rows = {row["variant"]: row for row in result["serve"]["rows"]}
    assert {"preft", "all-token", "base"} <= set(rows)
    assert rows["preft"]["output_throughput"] > rows["all-token"]["output_throughput"]
    assert (tmp_path / "demo" / "bundles" / "carol").is_dir()


@pytest.mark.slow
@pytest.mark.real_model
def test_sft_step_by_precision_runs_every_variant_on_the_same_rows(monkeypatch):
    """Every precision variant trains on the same seed and rows (the first loss agrees to bf16's
    precision), the float32 variants' first losses agree exactly, and the published ratio is the
    median of per-round ratios of the round medians."""
    published = {}
    monkeypatch.setattr(sft_step, "publish", lambda name, result, markdown: published.update(
        name=name, result=result, markdown=markdown))
    result = sft_step.precisions(MODEL, steps=4, rounds=2)
    rows = {row["precision"]: row for row in result["rows"]}
    assert list(rows) == list(sft_step.PRECISIONS)
    first = {name: row["losses_first_round"][0] for name, row in rows.items()}
    assert first["float32, TRL's CPU step"] == pytest.approx(first["float32, fast CPU step"], rel=1e-4)
    assert all(loss == pytest.approx(first["float32, TRL's CPU step"], rel=0.01) for loss in first.values()), first
    for row in rows.values():
        assert len(row["losses_first_round"]) == 4 and len(row["round_medians_s"]) == 2
        baseline = rows["float32, TRL's CPU step"]["round_medians_s"]
        per_round = sorted(b / mine for b, mine in zip(baseline, row["round_medians_s"]))
        assert row["speedup_vs_float32"] == pytest.approx(sum(per_round) / 2)
        assert row["speedup_range"] == pytest.approx(per_round)
    assert published["name"] == f"sft_step_{MODEL}"
    assert f"preft bench sft-step --model {MODEL} --steps 4 --rounds 2" in published["markdown"]
