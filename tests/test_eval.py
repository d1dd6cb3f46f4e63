"""`preft eval`: each subcommand in a tiny configuration, on data and settings the tests choose,
its outputs well-formed and taken from the run (an input changed shows in the numbers)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from family_models import family_dir
from preft.cli import main as cli_main
from preft.eval import loss as eval_loss, report as eval_report, rl as eval_rl, serve as eval_serve
from preft.user_data import DataError


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def sort_rows(count: int, seed: int = 0) -> list[dict]:
    """A user's own task: sort two digits descending."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"sort {a} {b} =", "completion": f" {max(a, b)} {min(a, b)}"})
    return rows


@pytest.fixture(scope="module")
def eval_out(tmp_path_factory):
    """One results directory with a tiny `eval loss` on a user JSONL and a tiny `eval serve`, each
    on a local model directory of another family than the embedded model's (Gemma 2: eager
    attention; Phi-3: packed projections, which the benchmark's all-linear LoRA bundles target)."""
    root = tmp_path_factory.mktemp("eval")
    data = write_jsonl(root / "mine.jsonl", sort_rows(48))
    loss = eval_loss.main(model=family_dir("gemma2"), data=data, ranks="2,8", methods="lora,lora_p", steps=3,
                          eval_examples=8, batch_size=4, out=str(root / "out"))
    serve = eval_serve.main(model=family_dir("phi3"), adapters=2, rank=8, variants="preft,base", num_prompts=6,
                            input_len=16, output_len=4, rounds=2, out=str(root / "out"))
    return {"root": root, "out": root / "out", "data": data, "loss": loss, "serve": serve}


@pytest.mark.slow
def test_eval_loss_trains_every_method_and_rank_on_the_users_file(eval_out):
    loss, out = eval_out["loss"], eval_out["out"] / "loss"
    assert {(r["method"], r["rank"]) for r in loss["runs"]} == {("lora", 2), ("lora", 8), ("lora_p", 2), ("lora_p", 8)}
    assert loss["train_rows"] == 40 and loss["held_out_rows"] == 8  # 48 rows, 8 held out
    for run in loss["runs"]:
        assert run["steps"] == 3 and run["eval_loss"] > 0 and 0.0 <= run["exact_match"] <= 1.0
        assert Path(run["run_dir"]).parent == out / "runs"
        summary = json.loads((Path(run["run_dir"]) / "run_summary.json").read_text())
        assert summary["final_eval_loss"] == run["eval_loss"]  # the table's number is the run's
        assert summary["config"]["data"]["path"] == eval_out["data"]
    by = {(r["method"], r["rank"]): r["eval_loss"] for r in loss["runs"]}
    assert by[("lora_p", 2)] != by[("lora_p", 8)] and by[("lora", 8)] != by[("lora_p", 8)]  # rank and method matter
    assert json.loads((out / "results.json").read_text())["runs"] == loss["runs"]
    table = (out / "loss.md").read_text()
    assert "| LoRA-P |" in table and "r=8" in table and f"{by[('lora_p', 8)]:.3f}" in table
    assert (out / "loss_vs_rank.png").stat().st_size > 1000


@pytest.mark.parametrize("rows, message", [
    ([{"question": "q", "answer": "a"}] * 20, "expected 'prompt' and 'completion', or 'messages'"),
    ([], "is empty"),
    ([{"prompt": "sort 1 2 =", "completion": " "}] * 20, "empty completion"),
    ([{"prompt": "sort 1 2 = " * 200, "completion": " 2 1"}] + sort_rows(19), "row 0: the prompt is"),
    (sort_rows(5), "too few to hold out"),
])
def test_eval_loss_refuses_bad_data_in_one_line_before_any_training(tmp_path, capsys, rows, message):
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    code = cli_main(["eval", "loss", "--data", data, "--ranks", "2", "--steps", "1", "--eval-examples", "4",
                     "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out" / "loss" / "runs").exists()


def test_conversational_user_data_becomes_prompt_completion(tmp_path):
    from preft.user_data import load_user_data

    rows = [{"messages": [{"role": "user", "content": f"sort {i} 0 ="}, {"role": "assistant", "content": f"{i} 0"}]}
            for i in range(12)]
    train, held_out = load_user_data(write_jsonl(tmp_path / "chat.jsonl", rows), eval_examples=4)
    assert len(train) == 8 and len(held_out) == 4
    assert train[0]["prompt"][0]["role"] == "user" and train[0]["completion"][0]["role"] == "assistant"
    with pytest.raises(DataError, match="end with the assistant"):
        bad = [{"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]}] * 12
        load_user_data(write_jsonl(tmp_path / "bad.jsonl", bad), eval_examples=4)


@pytest.mark.parametrize("argv, message", [
    (["loss", "--ranks", "four"], "--ranks 'four' is not a comma-separated list of ints"),
    (["loss", "--methods", "prefix_tuning"], "unknown method(s) ['prefix_tuning']"),
    (["serve", "--slo", "ttft=5"], "--slo 'ttft=5'"),
    (["serve", "--variants", "fast"], "--variants: unknown ['fast']"),
    (["serve", "--dtype", "fp8"], "--dtype 'fp8': choose auto, float32, bfloat16 or float16"),
    (["rl", "--methods", "dpo"], "unknown method(s) ['dpo']"),
    (["report", "--out", "/nonexistent/eval"], "no eval results found"),
    (["loss", "--tasks", "poems"], "--tasks: unknown task(s) ['poems']"),
    (["loss", "--tasks", "route", "--data", "mine.jsonl"], "give --tasks (the study tasks) or --data"),
    (["loss", "--quick", "--data", "mine.jsonl"], "--quick runs the study tasks"),
    (["loss", "--precision", "fp8"], "--precision 'fp8' is not one of auto, float32, bf16"),
    (["rl", "--task", "chess"], "--task 'chess' is not one of arithmetic, word_problems"),
    (["frontier", "--loss", "/nonexistent/loss"], "no results file at /nonexistent/loss"),
])
def test_eval_refuses_bad_arguments_in_one_line(capsys, argv, message):
    assert cli_main(["eval", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.slow
def test_eval_serve_drives_preft_serve_with_vllms_benchmark_client(eval_out):
    rows = {row["variant"]: row for row in eval_out["serve"]["rows"]}
    assert set(rows) == {"preft", "base"} and rows["preft"]["adapters"] == 2 and rows["base"]["adapters"] == 0
    assert all(row["request_rate"] == float("inf") for row in rows.values())
    for row in rows.values():  # vLLM's own numbers, from its result files
        runs = [json.loads((eval_out["out"] / "serve" / f).read_text()) for f in row["result_files"]]
        assert row["rounds"] == 2 and len(runs) == 2
        assert row["completed"] == 6 and row["failed"] == 0 and row["total_output_tokens"] == 6 * 4
        assert row["output_throughput"] == pytest.approx(sum(r["output_throughput"] for r in runs) / 2)
        assert row["output_throughput"] > 0
        assert row["median_ttft_ms"] > 0 and row["request_goodput"] is not None
    table = (eval_out["out"] / "serve" / "serve.md").read_text()
    assert "vllm bench serve" in table and f"{rows['preft']['output_throughput']:.1f}" in table
    assert (eval_out["out"] / "serve" / "serve.png").stat().st_size > 1000


@pytest.mark.slow
def test_eval_report_gathers_the_results_and_draws_the_trade_off(eval_out, tmp_path):
    results = eval_report.main(out=str(eval_out["out"]), write_docs=True, docs_dir=str(tmp_path / "docs"))
    rows = {row["variant"]: row for row in eval_out["serve"]["rows"]}
    points = results["tradeoff"]["points"]
    assert results["tradeoff"]["left_out"] == ["lora"]  # its all-token variant was not served
    assert {(p["method"], p["rank"]) for p in points} == {("lora_p", 2), ("lora_p", 8)}
    preft_runs, base_runs = ([json.loads((eval_out["out"] / "serve" / f).read_text())["output_throughput"]
                              for f in rows[v]["result_files"]] for v in ("preft", "base"))
    ratio = sum(p / b for p, b in zip(preft_runs, base_runs)) / 2  # the median of two per-round ratios
    assert all(p["throughput_vs_base"] == pytest.approx(ratio) for p in points)
    report = (eval_out["out"] / "report.md").read_text()
    assert "![trade-off](tradeoff.png)" in report and "Held-out loss by rank" in report and "vllm bench" in report
    assert (eval_out["out"] / "tradeoff.png").stat().st_size > 1000
    docs = (tmp_path / "docs" / "RESULTS.md").read_text()
    assert "<!-- bench:eval_loss -->" in docs and "<!-- bench:eval_tradeoff -->" in docs
    assert (tmp_path / "docs" / "results" / "eval_tradeoff.png").is_file()


@pytest.mark.slow
def test_eval_rl_runs_grpo_per_method_and_plots_the_reward(tmp_path):
    result = eval_rl.main(methods="lora,lora_p", rank=4, steps=2, seeds="0", batch_size=16, out=str(tmp_path))
    assert [(r["method"], r["steps"]) for r in result["runs"]] == [("lora", 2), ("lora_p", 2)]
    for run in result["runs"]:
        assert run["reward_history"] and all(0.0 <= reward <= 1.0 for _, reward in run["reward_history"])
        assert 0.0 <= run["heldout_greedy_accuracy_after"] <= 1.0
    assert "| LoRA-P |" in (tmp_path / "rl" / "rl.md").read_text()
    assert (tmp_path / "rl" / "reward_vs_step.png").stat().st_size > 1000


@pytest.mark.slow
def test_eval_loss_reuses_finished_runs_and_retrains_when_an_input_changes(eval_out, capsys):
    """Last in the module: it rewrites the shared directory's loss results."""
    tiny = {"model": family_dir("gemma2"), "ranks": "2", "methods": "lora_p", "steps": 3, "eval_examples": 8,
            "batch_size": 4}
    again = eval_loss.main(data=eval_out["data"], out=str(eval_out["out"]), **tiny)
    assert "done before, reused" in capsys.readouterr().out
    assert again["runs"][0] == next(r for r in eval_out["loss"]["runs"] if (r["method"], r["rank"]) == ("lora_p", 2))
    other = write_jsonl(eval_out["root"] / "other.jsonl", sort_rows(48, seed=5))
    changed = eval_loss.main(data=other, out=str(eval_out["root"] / "out2"), **tiny)
    assert changed["runs"][0]["eval_loss"] != again["runs"][0]["eval_loss"]
    # another learning rate into the same directory: a run of its own, the first one left as it was
    faster = eval_loss.main(data=eval_out["data"], learning_rate=0.05, out=str(eval_out["out"]), **tiny)
    assert "done before" not in capsys.readouterr().out and "--learning-rate 0.05" in faster["command"]
    assert faster["runs"][0]["run_dir"] != again["runs"][0]["run_dir"]
    assert faster["runs"][0]["eval_loss"] != again["runs"][0]["eval_loss"]
    first = json.loads((Path(again["runs"][0]["run_dir"]) / "run_summary.json").read_text())
    assert first["final_eval_loss"] == again["runs"][0]["eval_loss"]


def test_eval_frontier_puts_each_method_and_rank_at_its_own_served_throughput(tmp_path):
    """Accuracy from the loss study, throughput from the serve run of the same rank, as a ratio
    to that run's base; a (method, rank) nobody served is listed and left off the plot."""
    from preft.eval import frontier

    def run(method, rank, seed, accuracy):
        return {"task": "route", "method": method, "rank": rank, "seed": seed, "accuracy": accuracy,
                "eval_loss": 1.0 - accuracy}

    loss = {"command": "preft eval loss --tasks route", "tasks": ["route"], "base": {"route": {"accuracy": 0.0}},
            "runs": [run("lora", 4, 0, 0.9), run("lora_p", 4, 0, 0.6), run("lora_p", 4, 1, 0.8),
                     run("lora_p", 64, 0, 0.9)]}

    def serve(rank, preft, all_token):
        rows = [{"variant": "preft", "kind": "lora", "adapters": 64, "rank": rank, "vs_base": preft,
                 "output_throughput": 100 * preft},
                {"variant": "all-token", "kind": "lora", "adapters": 64, "rank": rank, "vs_base": all_token,
                 "output_throughput": 100 * all_token},
                {"variant": "preft", "kind": "lora", "adapters": 8, "rank": rank, "vs_base": 0.99,
                 "output_throughput": 99}]
        return {"command": f"preft eval serve --rank {rank}", "rows": rows}

    (tmp_path / "loss.json").write_text(json.dumps(loss))
    (tmp_path / "s4.json").write_text(json.dumps(serve(4, 0.9, 0.5)))
    result = frontier.main(loss=str(tmp_path / "loss.json"), serve=str(tmp_path / "s4.json"), out=str(tmp_path))
    points = {(p["method"], p["rank"]): p for p in result["points"]}
    assert points[("lora_p", 4)]["accuracy"] == pytest.approx(0.7) and points[("lora_p", 4)]["seeds"] == 2
    assert points[("lora_p", 4)]["vs_base"] == 0.9 and points[("lora", 4)]["vs_base"] == 0.5
    assert points[("lora_p", 64)]["vs_base"] is None  # rank 64 was not served
    table = (tmp_path / "frontier" / "frontier.md").read_text()
    assert "| LoRA-P | 64 | 90% | 0.100 | not served |" in table and "| LoRA-P | 4 | 70% |" in table
    assert (tmp_path / "frontier" / "frontier_route.png").stat().st_size > 1000


def test_eval_frontier_reads_a_study_made_by_several_commands_whole(tmp_path):
    """Given the study's OUT/loss directory, every finished run there counts (two grids, two
    commands), unfinished ones (no eval_metrics.json) do not, and the base model's accuracy comes
    from the task's data folder."""
    from preft.eval import frontier

    study = tmp_path / "loss"
    for name, run in {"route-lora-r4-s0-aa": ("route", "lora", 4, 0.9), "route-lora_p-r64-s0-bb": ("route", "lora_p", 64, 0.5),
                      "extract-lora_p-r4-s0-cc": ("extract", "lora_p", 4, 1.0)}.items():
        (study / "runs" / name).mkdir(parents=True)
        task, method, rank, accuracy = run
        (study / "runs" / name / "eval_metrics.json").write_text(json.dumps(
            {"task": task, "method": method, "rank": rank, "seed": 0, "accuracy": accuracy, "eval_loss": 0.1}))
    (study / "runs" / "route-lora_p-r4-s0-dd").mkdir()  # interrupted: no metrics yet
    (study / "data" / "route").mkdir(parents=True)
    (study / "data" / "route" / "base_metrics.json").write_text(json.dumps({"accuracy": 0.25}))
    serve = {"rows": [{"variant": "preft", "kind": "lora", "adapters": 64, "rank": 64, "vs_base": 0.8,
                       "output_throughput": 80.0}]}
    (tmp_path / "s64.json").write_text(json.dumps(serve))
    result = frontier.main(loss=str(study), serve=str(tmp_path / "s64.json"), out=str(tmp_path))
    assert sorted((p["task"], p["method"], p["rank"]) for p in result["points"]) == [
        ("extract", "lora_p", 4), ("route", "lora", 4), ("route", "lora_p", 64)]
    assert {p["rank"]: p["vs_base"] for p in result["points"] if p["task"] == "route"} == {4: None, 64: 0.8}
    assert (tmp_path / "frontier" / "frontier_extract.png").is_file()
    with pytest.raises(ValueError, match="no finished study-task run"):
        (tmp_path / "empty" / "runs").mkdir(parents=True)
        (tmp_path / "empty" / "data").mkdir()
        frontier.main(loss=str(tmp_path / "empty"), serve=str(tmp_path / "s64.json"), out=str(tmp_path))


def test_loss_plot_draws_a_study_with_missing_cells(tmp_path):
    """A study made by several commands lacks some (method, rank) cells: each method is drawn at
    the ranks it has."""
    from preft.eval.loss import plot

    runs = [{"method": "lora", "rank": 4, "eval_loss": 0.1, "accuracy": 0.9},
            {"method": "lora", "rank": 16, "eval_loss": 0.05, "accuracy": 1.0},
            {"method": "lora_p", "rank": 16, "eval_loss": 0.07, "accuracy": 1.0}]
    path = tmp_path / "loss_vs_rank.png"
    plot(runs, ["lora", "lora_p", "loreft_p"], [4, 16], path, "partial grid", {"accuracy": 0.0})
    assert path.stat().st_size > 1000


def test_a_published_section_carries_its_date_and_replaces_the_previous_one(tmp_path):
    import datetime

    from preft.eval.results import write_result

    (tmp_path / "RESULTS.md").write_text("# Measured results\n\n## Kept\n\nhand-written\n")
    write_result("demo_bench", {"x": 1}, "## Demo bench\n\nfirst figures", docs_dir=tmp_path)
    write_result("demo_bench", {"x": 2}, "## Demo bench\n\nsecond figures", docs_dir=tmp_path)
    text = (tmp_path / "RESULTS.md").read_text()
    assert "hand-written" in text and "first figures" not in text and text.count("## Demo bench") == 1
    assert f"second figures\n\nPublished {datetime.date.today().isoformat()}.\n<!-- /bench:demo_bench -->" in text
    assert json.loads((tmp_path / "results" / "demo_bench.json").read_text()) == {"x": 2}
    assert not list(tmp_path.glob(".*.tmp"))


def test_loss_table_leaves_a_missing_cell_empty_and_a_method_without_cells_out():
    from preft.eval.loss import table

    runs = [{"method": "lora", "rank": 4, "eval_loss": 0.1, "accuracy": 0.9},
            {"method": "lora_p", "rank": 16, "eval_loss": 0.2, "accuracy": 0.5},
            {"method": "lora_p", "rank": 16, "eval_loss": 0.4, "accuracy": 1.0}]
    lines = table(runs, ["lora", "lora_p", "loreft_p"], [4, 16]).splitlines()
    assert lines[2] == "| LoRA (all tokens) | 0.100, acc 90% |  |"
    assert lines[3] == "| LoRA-P |  | 0.300 (±0.141), acc 75% |" and len(lines) == 4
