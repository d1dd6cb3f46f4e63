"""`preft eval loss`: held-out loss and task accuracy by rank, PreFT against standard PEFT.

    preft eval loss [--model default] [--data FILE_OR_DIR | --tasks route,extract,house_style]
                    [--ranks 1,4,16,64] [--methods lora,lora_p,loreft_p,direft_p] [--steps 300]
                    [--seeds 0] [--precision auto] [--quick] [--out runs/eval]

Every (task, method, rank, seed) is one run of the SFT recipe (:mod:`preft.recipes.sft`, what
``preft train`` runs), from the method's shipped config (``sft_lora.yaml``, ``sft_lora_p.yaml``,
``sft_reft_p.yaml``) with the model, data, rank, steps and seed set. Rank means ``r`` with
``lora_alpha = 2r`` for LoRA, ``rank`` on every layer for ReFT. Each run has its own directory
under ``OUT/loss/runs/``: a finished run (its ``run_summary.json`` made from the same config) is
skipped, an interrupted one resumes from its newest complete checkpoint, so a long study is
rerun with the same command until it is complete.

The data is the user's (``--data``) or the study tasks (``--tasks``, :mod:`preft.tasks`: chat
rows generated with a fixed seed, written to ``OUT/loss/data/TASK/``). The held-out loss is the
trainer's eval loss on the held-out rows. For a study task, also: greedy accuracy under the
task's exact checker (HF generate, which applies the adapter to prompt tokens only for the
PreFT methods), the base model's accuracy, and the loss split by answer position
(:mod:`preft.eval.task_accuracy`: first answer token, tokens 2-4, tokens 5+), which says where a
prefill-only adapter loses. For ``--data`` with short answers (a median of at most
``EXACT_MATCH_MAX_TOKENS`` tokens), exact match of greedy answers.

``--precision auto`` (the default for a real model) trains in bf16 autocast where the machine is
faster in it. ``--quick`` is the smoke grid (house_style and route, LoRA vs LoRA-P at rank 4, 20
steps), about 8 minutes on 2 cores.

Writes ``OUT/loss/results.json``, ``OUT/loss/loss.md`` (tables: loss and accuracy by method and
rank, mean over seeds; loss by answer position) and ``loss_vs_rank.png`` (per task:
``loss_vs_rank_TASK.png``, loss and accuracy panels with the base model's accuracy). With
``--tasks`` the tables and figures cover every finished cell under ``OUT/loss`` (:func:`study`),
so a study run a grid at a time is reported whole by its last command. Bad data fails before any
training, in one line (:mod:`preft.user_data`).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import preft
from preft.eval.common import parse_list
from preft.recipe_config import load_config
from preft.eval.results import save_run
from preft.eval.task_accuracy import BUCKETS

CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "configs"
#: method -> (recipe config, adapter section overrides for rank r), the all-token baseline first
METHODS = {
    "lora": ("sft_lora.yaml", lambda r: {"r": r, "lora_alpha": 2 * r}),
    "lora_p": ("sft_lora_p.yaml", lambda r: {"r": r, "lora_alpha": 2 * r}),
    "loreft_p": ("sft_reft_p.yaml", lambda r: {"rank": r, "intervention": "loreft", "layers": None}),
    "direft_p": ("sft_reft_p.yaml", lambda r: {"rank": r, "intervention": "direft", "layers": None}),
}
LABELS = {"lora": "LoRA (all tokens)", "lora_p": "LoRA-P", "loreft_p": "LoReFT-P", "direft_p": "DiReFT-P"}
EXACT_MATCH_MAX_TOKENS = 16
EXACT_MATCH_ROWS = 64


def run_config(method: str, rank: int, seed: int, args: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The SFT recipe config of one run: the method's shipped config, with this run's settings."""
    config_file, adapter = METHODS[method]
    config = load_config(CONFIGS / config_file)
    config.update(output_dir=str(run_dir), model=args["model"], resume_from_checkpoint=None)
    if args["data"]:
        config["data"] = {"task": "local", "path": str(Path(args["data"]).resolve()),
                          "eval_examples": args["eval_examples"]}
    else:
        config["data"] = {**config["data"], "eval_examples": args["eval_examples"]}
    config["adapter"].update(adapter(rank))
    if args.get("precision"):
        config["precision"] = args["precision"]
    config["trainer"].update(max_steps=args["steps"], seed=seed, report_to=args["report_to"],
                             eval_steps=max(1, args["steps"] // 4), save_steps=max(1, args["steps"] // 2),
                             logging_steps=max(1, args["steps"] // 20),
                             per_device_train_batch_size=args["batch_size"])
    if args["learning_rate"] is not None:
        config["trainer"]["learning_rate"] = args["learning_rate"]
    if args["lr_schedule"] is not None:
        config["trainer"]["lr_scheduler_type"] = args["lr_schedule"]
    return config


@torch.no_grad()
def exact_match(model_path: str, adapter_dir: str, held_out) -> float | None:
    """Greedy exact match on up to ``EXACT_MATCH_ROWS`` held-out rows, or None where the answers
    are long (or conversational)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = held_out.select(range(min(EXACT_MATCH_ROWS, len(held_out))))
    if not isinstance(rows[0]["prompt"], str):
        return None
    from preft.families import model_load_kwargs

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")  # generate() continues each row's end
    answers = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in rows["completion"]]
    if statistics.median(len(a) for a in answers) > EXACT_MATCH_MAX_TOKENS:
        return None
    base = AutoModelForCausalLM.from_pretrained(model_path, **model_load_kwargs(model_path))
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    batch = tokenizer(list(rows["prompt"]), return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=max(len(a) for a in answers) + 1, do_sample=False)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(t.strip() == c.strip() for t, c in zip(texts, rows["completion"])) / len(rows)


def one_run(method: str, rank: int, seed: int, args: dict[str, Any], runs: Path, data) -> dict[str, Any]:
    """Train (or reuse, or resume) one run; its metrics. ``data``: ``(train, held_out)``, read once
    for the whole grid (every run of it trains on the same rows)."""
    from preft.recipes import sft
    from preft.recipes.common import resolve_resume

    from preft.eval.results import run_dir_for

    prefix = f"{args['task']}-" if args.get("task") else ""
    run_dir = run_dir_for(runs, f"{prefix}{method}-r{rank}-s{seed}", run_config(method, rank, seed, args, Path(".")))
    config = run_config(method, rank, seed, args, run_dir)
    summary_path, metrics_path = run_dir / "run_summary.json", run_dir / "eval_metrics.json"
    if summary_path.is_file() and metrics_path.is_file():
        def settings(c):  # what the run trained with (how it got there, resumed or not, aside)
            return {k: v for k, v in json.loads(json.dumps(c, default=str)).items() if k not in ("resume_from_checkpoint", "overwrite_output_dir")}

        if settings(json.loads(summary_path.read_text()).get("config", {})) == settings(config):
            print(f"  {run_dir.name}: done before, reused")
            return json.loads(metrics_path.read_text())
    if run_dir.is_dir() and any(run_dir.glob("checkpoint-*")):
        try:
            resolve_resume(str(run_dir), True)
            config["resume_from_checkpoint"] = True
        except ValueError:
            pass  # no complete checkpoint: train from the start
    # a run directory of this grid (inside the claimed --out) that is not resumed is trained anew over
    config["overwrite_output_dir"] = config.get("resume_from_checkpoint") is not True
    summary = sft.main(config)
    train_set, held_out = data
    from preft.real_models import resolve

    model_path = resolve(config["model"])
    metrics = {"method": method, "rank": rank, "seed": seed, "run_dir": str(run_dir), "steps": summary["steps"],
               "eval_loss": summary["final_eval_loss"], "initial_eval_loss": summary["initial_eval_loss"],
               "train_rows": len(train_set), "held_out_rows": len(held_out),
               "wall_time_s": json.loads(summary_path.read_text()).get("wall_time_s")}
    if args.get("task"):  # a study task: its checker on greedy answers, and the loss by answer position
        from preft.eval import task_accuracy
        from preft.tasks import task

        metrics.update(task=args["task"], exact_match=None, **task_accuracy.evaluate(
            model_path, summary["adapter_dir"], task(args["task"]), args["task_rows"], config.get("precision", "auto")))
    else:
        metrics["exact_match"] = exact_match(model_path, summary["adapter_dir"], held_out)
    metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def study(loss_dir: Path) -> dict[str, Any]:
    """Every finished cell of a ``preft eval loss --tasks`` study directory (``OUT/loss``), however
    many commands made them: a study run in parts (a grid at a time) is read whole."""
    runs = []
    for metrics in sorted(loss_dir.glob("runs/*/eval_metrics.json")):
        run = json.loads(metrics.read_text())
        if run.get("task") and run.get("accuracy") is not None:
            runs.append(run)
    if not runs:
        raise ValueError(f"{loss_dir}: no finished study-task run under runs/ (make them with preft eval loss --tasks ...)")
    tasks = list(dict.fromkeys(run["task"] for run in runs))
    base = {task: json.loads((loss_dir / "data" / task / "base_metrics.json").read_text())
            for task in tasks if (loss_dir / "data" / task / "base_metrics.json").is_file()}
    return {"tasks": tasks, "runs": runs, "base": base,
            "command": f"every finished run of preft eval loss --tasks under {loss_dir}"}


def table(results: list[dict[str, Any]], methods: list[str], ranks: list[int]) -> str:
    """Markdown: held-out loss (and exact match) by method and rank, mean over seeds."""
    def cell(method, rank):
        runs = [r for r in results if r["method"] == method and r["rank"] == rank]
        if not runs:  # a study made by several commands may lack this cell
            return ""
        loss = statistics.mean(r["eval_loss"] for r in runs)
        text = f"{loss:.3f}" + (f" (±{statistics.stdev(r['eval_loss'] for r in runs):.3f})" if len(runs) > 1 else "")
        if runs and runs[0].get("accuracy") is not None:
            return text + f", acc {statistics.mean(r['accuracy'] for r in runs):.0%}"
        matches = [r["exact_match"] for r in runs if r["exact_match"] is not None]
        return text + (f", EM {statistics.mean(matches):.0%}" if matches else "")

    lines = ["| method | " + " | ".join(f"r={r}" for r in ranks) + " |", "|---|" + "---|" * len(ranks)]
    lines += [f"| {LABELS[m]} | " + " | ".join(cell(m, r) for r in ranks) + " |" for m in methods
              if any(r["method"] == m for r in results)]
    return "\n".join(lines)


def position_table(results: list[dict[str, Any]], methods: list[str], ranks: list[int]) -> str:
    """Markdown: held-out NLL by answer-token position, per method and rank (mean over seeds)."""
    buckets = [name for name, _, _ in BUCKETS]
    lines = ["| method, rank | " + " | ".join(f"NLL, {b}" for b in buckets) + " |", "|---|" + "---|" * len(buckets)]
    for method in methods:
        for rank in ranks:
            runs = [r for r in results if r["method"] == method and r["rank"] == rank and r.get("loss_by_position")]
            if runs:
                cells = [f"{statistics.mean(r['loss_by_position'][b] for r in runs):.3f}" for b in buckets]
                lines.append(f"| {LABELS[method]} r={rank} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], methods: list[str], ranks: list[int], path: Path, title: str,
         base: dict[str, Any] | None = None) -> None:
    """Held-out loss by rank, and task accuracy beside it where the task has a checker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_accuracy = any(r.get("accuracy") is not None for r in results)
    fig, axes = plt.subplots(1, 2 if with_accuracy else 1, figsize=(11 if with_accuracy else 6.4, 4.2), squeeze=False)
    for ax, key, label in zip(axes[0], ("eval_loss", "accuracy"), ("held-out loss", "held-out task accuracy")):
        for method in methods:  # a study made by several commands may lack some (method, rank) cells
            cells = {rank: [r[key] for r in results if r["method"] == method and r["rank"] == rank] for rank in ranks}
            present = [rank for rank in ranks if cells[rank]]
            if present:
                ax.plot(present, [statistics.mean(cells[rank]) for rank in present], marker="o",
                        label=LABELS[method], linestyle="--" if method == "lora" else "-")
        if key == "accuracy" and base is not None:
            ax.axhline(base["accuracy"], color="grey", linestyle=":", label="base model")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ranks, [str(r) for r in ranks])
        ax.set_xlabel("rank")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


#: ``--quick``: a smoke grid (two tasks, all-token LoRA against LoRA-P at rank 4, 20 steps)
QUICK = {"tasks": "house_style,route", "methods": "lora,lora_p", "ranks": "4", "steps": 20, "seeds": "0",
         "eval_examples": 32, "batch_size": 8}


def write_task_data(name: str, directory: Path, train_rows: int, held_out_rows: int, seed: int = 0) -> list[dict]:
    """``DIRECTORY/train.jsonl`` and ``validation.jsonl`` of study task ``name`` (chat rows, as
    ``preft train`` reads a user's data); the held-out rows, with their checker targets."""
    import os

    from preft.tasks import rows_of

    directory.mkdir(parents=True, exist_ok=True)
    held_out = rows_of(name, held_out_rows, "held_out", seed)
    for file, rows in (("train.jsonl", rows_of(name, train_rows, "train", seed)), ("validation.jsonl", held_out)):
        temp = directory / f".{file}.{os.getpid()}.tmp"
        temp.write_text("".join(json.dumps({"messages": row["messages"]}) + "\n" for row in rows))
        os.replace(temp, directory / file)
    return held_out


def base_task_metrics(model_path: str, name: str, rows: list[dict], precision: str, directory: Path) -> dict:
    """The base model's accuracy and loss by position on task ``name`` (kept in ``DIRECTORY``)."""
    from preft.eval import task_accuracy
    from preft.tasks import task

    path = directory / "base_metrics.json"
    key = {"model": model_path, "rows": len(rows), "precision": precision}
    if path.is_file() and json.loads(path.read_text()).get("key") == key:
        return json.loads(path.read_text())
    metrics = {"key": key, **task_accuracy.evaluate(model_path, None, task(name), rows, precision)}
    path.write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def main(model: str = "default", data: str | None = None, tasks: str | None = None, ranks: str = "1,4,16,64",
         methods: str = "lora,lora_p,loreft_p,direft_p", steps: int = 300, seeds: str = "0",
         eval_examples: int = 128, train_rows: int = 400, batch_size: int = 16, learning_rate: float | None = None,
         lr_schedule: str | None = None, precision: str | None = None, quick: bool = False,
         report_to: str = "none", out: str = "runs/eval") -> dict[str, Any]:
    from preft.recipes import sft
    from preft.recipes.common import resolve_model

    started = time.time()
    given = {"model": model, "data": data, "tasks": tasks, "ranks": ranks, "methods": methods, "steps": steps,
             "seeds": seeds, "eval_examples": eval_examples, "train_rows": train_rows, "batch_size": batch_size,
             "learning_rate": learning_rate, "lr_schedule": lr_schedule, "precision": precision, "quick": quick}
    if quick:
        if data:
            raise ValueError("--quick runs the study tasks; give --data without --quick")
        given.update(QUICK)
        tasks, methods, ranks, steps, seeds = QUICK["tasks"], QUICK["methods"], QUICK["ranks"], QUICK["steps"], QUICK["seeds"]
        eval_examples, batch_size = QUICK["eval_examples"], QUICK["batch_size"]
    if tasks and data:
        raise ValueError("give --tasks (the study tasks) or --data (your own rows), not both")
    rank_list, seed_list = parse_list(ranks, int, "ranks"), parse_list(seeds, int, "seeds")
    method_list = parse_list(methods, str, "methods")
    unknown = [m for m in method_list if m not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown method(s) {unknown} (choose from {', '.join(METHODS)})")
    task_list = parse_list(tasks, str, "tasks") if tasks else [None]
    from preft.tasks import TASKS

    unknown = [t for t in task_list if t is not None and t not in TASKS]
    if unknown:
        raise ValueError(f"--tasks: unknown task(s) {unknown} (choose from {', '.join(TASKS)})")
    if any(r < 1 for r in rank_list) or steps < 1 or eval_examples < 1 or batch_size < 1 or train_rows < 1:
        raise ValueError("--ranks, --steps, --eval-examples, --train-rows and --batch-size must be >= 1")
    if lr_schedule is not None:
        from transformers import SchedulerType

        schedules = [kind.value for kind in SchedulerType]
        if lr_schedule not in schedules:
            raise ValueError(f"--lr-schedule {lr_schedule!r} is not one of {', '.join(schedules)}")
    if precision is None and model != "default":
        precision = "auto"  # a real model trains as the machine does best; the tiny default keeps its float32
    if precision is not None:
        from preft.precision import CHOICES

        if precision not in CHOICES:
            raise ValueError(f"--precision {precision!r} is not one of {', '.join(CHOICES)}")
    # the data and the model are checked once, before any run: bad input costs no training
    from transformers import AutoConfig, AutoTokenizer

    model_path = resolve_model(model)
    tokenizer, context = AutoTokenizer.from_pretrained(model_path), AutoConfig.from_pretrained(model_path)
    loss_dir = Path(out) / "loss"
    grid = [(t, m, r, s) for t in task_list for m in method_list for r in rank_list for s in seed_list]
    results, bases, sizes = [], {}, {}
    for task_name in task_list:
        args = {"model": model, "data": data, "steps": steps, "eval_examples": eval_examples,
                "batch_size": batch_size, "learning_rate": learning_rate, "lr_schedule": lr_schedule,
                "report_to": report_to, "precision": precision}
        if task_name:
            folder = loss_dir / "data" / task_name
            args.update(data=str(folder), task=task_name,
                        task_rows=write_task_data(task_name, folder, train_rows, eval_examples))
            bases[task_name] = base_task_metrics(model_path, task_name, args["task_rows"], precision or "auto", folder)
            print(f"[eval loss] {task_name}: base model accuracy {bases[task_name]['accuracy']:.0%}", flush=True)
        probe = run_config(method_list[0], rank_list[0], seed_list[0], args, loss_dir / "probe")
        train_set, held_out = sft.build_datasets(probe["data"], tokenizer, context.max_position_embeddings)
        sizes[task_name] = (len(train_set), len(held_out))
        for method in method_list:
            for rank in rank_list:
                for seed in seed_list:
                    index = grid.index((task_name, method, rank, seed)) + 1
                    print(f"[eval loss {index}/{len(grid)}] {task_name + ': ' if task_name else ''}{LABELS[method]} "
                          f"rank {rank} seed {seed} ({time.time() - started:.0f} s so far)", flush=True)
                    results.append(one_run(method, rank, seed, args, loss_dir / "runs", (train_set, held_out)))

    source = data or "the synthetic personalisation task (preft.data.user_examples, user 0)"
    from preft.eval.results import command_line

    result = {"command": command_line("loss", main, given, always=("model", "ranks", "methods", "steps", "seeds")),
              "learning_rate": learning_rate, "lr_schedule": lr_schedule, "batch_size": batch_size,
              "precision": precision, "model": model, "tasks": task_list if tasks else None,
              "data": None if tasks else source, "rows": {str(k): v for k, v in sizes.items()},
              "base": bases, "ranks": rank_list, "methods": method_list, "seeds": seed_list, "steps": steps,
              "runs": results, "wall_time_s": round(time.time() - started, 1)}
    if not tasks:
        result.update(train_rows=sizes[None][0], held_out_rows=sizes[None][1])
    loss_dir.mkdir(parents=True, exist_ok=True)
    figures, sections = [], []
    # a study task's tables and figure cover every finished cell under OUT/loss, made by this command
    # or an earlier one (a study is run a grid at a time); --data reports this command's grid
    finished = study(loss_dir)["runs"] if tasks else results
    for task_name in task_list:
        runs = [r for r in finished if r.get("task") == task_name]
        methods = [m for m in METHODS if any(r["method"] == m for r in runs)] if tasks else method_list
        ranks = sorted({r["rank"] for r in runs}) if tasks else rank_list
        label = task_name or (Path(data).name if data else "synthetic task")
        figure = loss_dir / (f"loss_vs_rank_{task_name}.png" if task_name else "loss_vs_rank.png")
        plot(runs, methods, ranks, figure, f"held-out loss by rank: {Path(model_path).name}, {label}",
             bases.get(task_name))
        figures.append(figure)
        rows = sizes[task_name]
        base = (f" Base model: accuracy {bases[task_name]['accuracy']:.0%}." if task_name else "")
        sections.append(f"### {label}\n\n{rows[0]} training rows, {rows[1]} held out; {steps} steps per run, "
                        f"seeds {sorted({r['seed'] for r in runs})}.{base}\n\n{table(runs, methods, ranks)}\n")
        if task_name:
            sections.append(position_table(runs, methods, ranks) + "\n")
    markdown = (f"## Held-out loss by rank\n\nCommand: `{result['command']}`. "
                + ("" if tasks else f"Data: {source}. ") + "\n\n" + "\n".join(sections))
    save_run(loss_dir, "loss", result, markdown, also=tuple(figures))
    return result


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    add_flags(parser, main, [
        ("--model", str, "base model: 'default' (the embedded model), a prepared real model (preft models list) or a local model directory (Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3, OLMo 2)"),
        ("--data", str, "a local JSONL/Parquet/CSV file or directory (prompt/completion or messages); "
                        "default: the synthetic personalisation task"),
        ("--tasks", str, "comma-separated study tasks instead of --data (preft/tasks.py: house_style, extract, "
                         "route, word_problems): loss, task accuracy and loss by answer position"),
        ("--ranks", str, "comma-separated ranks"),
        ("--methods", str, f"comma-separated, of {', '.join(METHODS)}"),
        ("--steps", int, "training steps per run"),
        ("--seeds", str, "comma-separated seeds (each a separate run)"),
        ("--eval-examples", int, "rows held out when the data has no validation split"),
        ("--batch-size", int, "per-device training batch size"),
        ("--learning-rate", float, "learning rate for every run (default: each method's recipe config)"),
        ("--lr-schedule", str, "the trainer's lr_scheduler_type for every run, e.g. constant, linear, cosine "
                               "(default: each method's recipe config)"),
        ("--train-rows", int, "training rows of each study task"),
        ("--precision", str, "auto, float32 or bf16 (default: auto for a real model, the recipe's float32 for "
                             "the tiny default model)"),
        ("--quick", bool, "the smoke grid: house_style and route, LoRA vs LoRA-P at rank 4, 20 steps"),
        ("--report-to", str, "the trainer's report_to ('none', or 'wandb': offline unless WANDB_MODE says)"),
        ("--out", str, "results directory"),
    ])
