"""The online step cost model (:mod:`preft.serving.scheduling.online_cost_model`): it learns the
engine's step cost from the steps it is shown, follows it when it changes, bounds its own
error, and keeps what it learned across a restart; SLOWeave without a file runs on it."""

from __future__ import annotations

import json
import random

import pytest

from preft.serving.scheduling import workloads
from preft.serving.scheduling.chunk_policies import make_policy, policy_from_spec
from preft.serving.scheduling.cost_model import StepCostModel
from preft.serving.scheduling.metrics import summarize
from preft.serving.scheduling.online_cost_model import OnlineCostModel, online_model_of
from preft.serving.scheduling.simulator import Simulator
from preft.serving.scheduling.spec import SchedulerSpec

# a CPU-like engine: 19 ms a step, 0.7 ms a prefill token, 0.3 ms a decode
CPU = StepCostModel([0.019, 0.0, 0.0003, 0.002, 0.0007, 0.0, 0.001, 0.0])


def shapes(count: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.choice([0, 1, 4, 16])
        yield n, rng.choice([0, 8, 64, 256, 512]) if n else rng.choice([16, 128, 512]), rng.randint(0, 4000)


def test_it_learns_a_cost_the_prior_did_not_know_and_stays_monotone():
    model = OnlineCostModel(OnlineCostModel.conservative_prior())
    assert model(4, 256, 1000) > 2 * CPU(4, 256, 1000)  # the prior is slow on purpose
    for n, c, x in shapes(200):
        model.observe(n, c, x, CPU(n, c, x))
    assert model.fits >= 5 and model.rich_enough()
    for n, c, x in shapes(50, seed=1):
        assert model(n, c, x) == pytest.approx(CPU(n, c, x), rel=0.01)
    assert all(model(4, c + 16, 500) >= model(4, c, 500) for c in range(0, 2048, 16))


def test_it_follows_the_engine_when_its_cost_changes():
    """Twice as slow (another tenant on the machine, a bigger batch): after a window of steps the
    model says so; a fixed model would keep its old answer."""
    model = OnlineCostModel(CPU, window=128, refit_every=16)
    for n, c, x in shapes(128):
        model.observe(n, c, x, CPU(n, c, x))
    before = model(8, 256, 2000)
    for n, c, x in shapes(160, seed=2):
        model.observe(n, c, x, 2 * CPU(n, c, x))
    assert before == pytest.approx(CPU(8, 256, 2000), rel=0.01)
    assert model(8, 256, 2000) == pytest.approx(2 * CPU(8, 256, 2000), rel=0.02)


def test_the_bound_covers_the_models_recent_error_per_shape():
    rng = random.Random(3)
    model = OnlineCostModel(CPU)
    measured = []
    for n, c, x in shapes(600, seed=4):
        seconds = CPU(n, c, x) * (1 + (rng.uniform(0, 0.3) if n and c else rng.uniform(0, 0.02)))
        measured.append(((n, c, x), seconds, model.upper(n, c, x)))
        model.observe(n, c, x, seconds)
    mixed = [(s, u) for (n, c, x), s, u in measured[300:] if n and c]
    assert sum(s <= u for s, u in mixed) / len(mixed) >= 0.9  # a 0.95 quantile, out of sample
    # the fit absorbs the mean (+15%); what is left is about ±15% on mixed steps, ±1% on the others
    assert model.error_quantile(4, 64) > 0.08 > 0.03 > model.error_quantile(4, 0)  # per shape class
    report = model.report()
    assert report["fits"] == model.fits and 0 < report["overhead_fraction"] < 1


class NoisyEngine:
    """The simulator's clock: ``CPU`` plus up to 30% more on steps that mix decodes and prefill."""

    meta: dict = {}

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, n: int, c: int, x: int = 0) -> float:
        return CPU(n, c, x) * (1 + (self.rng.uniform(0, 0.3) if n and c else 0.0))


def test_sloweave_on_the_online_model_misses_fewer_tpots_than_on_an_exact_mean():
    work = workloads.generate("mixed", 300, 6.0, seed=5, max_model_len=2048)
    tpot = 0.08
    misses = {}
    for label, cost_model in (("fixed model", CPU), ("online", OnlineCostModel(CPU))):
        policy = make_policy("sloweave", cost_model=cost_model, tpot_s=tpot, max_chunk=2048)
        result = Simulator(NoisyEngine(seed=6), policy, max_num_seqs=64).run(work)
        misses[label] = 1 - summarize(result.timings, 1e9, tpot)["slo_attainment"]
    assert misses["online"] < misses["fixed model"], misses


def test_its_state_survives_a_restart_and_a_corrupted_state_is_one_line(tmp_path):
    model = OnlineCostModel(OnlineCostModel.conservative_prior())
    for n, c, x in shapes(100):
        model.observe(n, c, x, CPU(n, c, x) * 1.1)
    path = model.save(tmp_path / "state.json")
    again = OnlineCostModel(OnlineCostModel.conservative_prior())
    again.restore(path)
    assert again.fits == model.fits and again.weights == model.weights and list(again.steps) == list(model.steps)
    assert again.upper(4, 64, 100) == model.upper(4, 64, 100)
    data = json.loads(path.read_text())
    assert data["report"]["fits"] == model.fits and set(data["report"]["error_quantile"]) == {"00", "01", "10", "11"}
    for broken in ("not json", json.dumps({**data, "steps": [[1, 2, "x", 0.1]]}),
                   json.dumps({**data, "residuals": {"00": [float("nan")]}}), json.dumps({"format": "other"})):
        path.write_text(broken)
        with pytest.raises(ValueError, match="online step cost state .* cannot be used") as err:
            OnlineCostModel(OnlineCostModel.conservative_prior()).restore(path)
        assert "\n" not in str(err.value)


def test_a_spec_without_a_cost_model_plans_on_an_online_model_that_learns(tmp_path):
    policy = policy_from_spec(SchedulerSpec.parse("sloweave", tpot_ms=100, cost_state=str(tmp_path / "s.json")))
    learner = online_model_of(policy)
    assert learner is not None and learner.prior.source == "conservative prior"
    work = workloads.generate("mixed", 200, 4.0, seed=7, max_model_len=2048)
    Simulator(CPU, policy, max_num_seqs=64).run(work)
    assert learner.fits > 0 and learner(4, 256, 1000) == pytest.approx(CPU(4, 256, 1000), rel=0.05)
    learner.save(tmp_path / "s.json")  # and a server restarted on the same state goes on from it
    restarted = online_model_of(policy_from_spec(SchedulerSpec.parse("sloweave+wavepp", tpot_ms=100, stages=2,
                                                                     cost_state=str(tmp_path / "s.json"))))
    assert restarted.weights == learner.weights
    seeded = online_model_of(policy_from_spec(SchedulerSpec.parse(
        "sloweave", tpot_ms=100, cost_model=str(CPU.save(tmp_path / "cpu.json")))))
    assert seeded.prior.weights == CPU.weights and seeded.fits == 0  # a --cost-model file seeds it
