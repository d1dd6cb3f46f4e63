"""`preft eval loss`: held-out loss by rank, PreFT against standard PEFT, on the user's model and data.

    preft eval loss [--model default] [--data FILE_OR_DIR] [--ranks 1,4,16,64]
                    [--methods lora,lora_p,loreft_p,direft_p] [--steps 300] [--seeds 0] [--out runs/eval]

Every (method, rank, seed) is one run of the SFT recipe (:mod:`preft.recipes.sft`, what
``preft train`` runs), from the method's shipped config (``sft_lora.yaml``, ``sft_lora_p.yaml``,
``sft_reft_p.yaml``) with the model, data, rank, steps and seed set. Rank means ``r`` with
``lora_alpha = 2r`` for LoRA, ``rank`` on every layer for ReFT. Each run has its own directory
under ``OUT/loss/runs/``: a finished run (its ``run_summary.json`` made from the same config) is
skipped, an interrupted one resumes from its newest complete checkpoint. The held-out loss is the
trainer's eval loss on the held-out rows; where the answers are short (a median of at most
``EXACT_MATCH_MAX_TOKENS`` tokens), exact match of greedy answers too (HF generate, which applies
the adapter to prompt tokens only for the PreFT methods).

Writes ``OUT/loss/results.json``, ``OUT/loss/loss.md`` (a table: loss and exact match by method and
rank, mean over seeds) and ``OUT/loss/loss_vs_rank.png``. Bad data fails before any training,
in one line (:mod:`preft.user_data`).
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

    run_dir = run_dir_for(runs, f"{method}-r{rank}-s{seed}", run_config(method, rank, seed, args, Path(".")))
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
               "exact_match": exact_match(model_path, summary["adapter_dir"], held_out),
               "train_rows": len(train_set), "held_out_rows": len(held_out), "wall_time_s": summary.get("wall_time_s")}
    metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def table(results: list[dict[str, Any]], methods: list[str], ranks: list[int]) -> str:
    """Markdown: held-out loss (and exact match) by method and rank, mean over seeds."""
    def cell(method, rank):
        runs = [r for r in results if r["method"] == method and r["rank"] == rank]
        loss = statistics.mean(r["eval_loss"] for r in runs)
        text = f"{loss:.3f}" + (f" (±{statistics.stdev(r['eval_loss'] for r in runs):.3f})" if len(runs) > 1 else "")
        matches = [r["exact_match"] for r in runs if r["exact_match"] is not None]
        return text + (f", EM {statistics.mean(matches):.0%}" if matches else "")

    lines = ["| method | " + " | ".join(f"r={r}" for r in ranks) + " |", "|---|" + "---|" * len(ranks)]
    lines += [f"| {LABELS[m]} | " + " | ".join(cell(m, r) for r in ranks) + " |" for m in methods]
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], methods: list[str], ranks: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method in methods:
        means = [statistics.mean(r["eval_loss"] for r in results if r["method"] == method and r["rank"] == rank)
                 for rank in ranks]
        ax.plot(ranks, means, marker="o", label=LABELS[method], linestyle="--" if method == "lora" else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks, [str(r) for r in ranks])
    ax.set_xlabel("rank")
    ax.set_ylabel("held-out loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(model: str = "default", data: str | None = None, ranks: str = "1,4,16,64",
         methods: str = "lora,lora_p,loreft_p,direft_p", steps: int = 300, seeds: str = "0",
         eval_examples: int = 128, batch_size: int = 16, learning_rate: float | None = None,
         lr_schedule: str | None = None,
         report_to: str = "none", out: str = "runs/eval") -> dict[str, Any]:
    from preft.recipes import sft
    from preft.recipes.common import resolve_model

    started = time.time()
    rank_list, seed_list = parse_list(ranks, int, "ranks"), parse_list(seeds, int, "seeds")
    method_list = parse_list(methods, str, "methods")
    unknown = [m for m in method_list if m not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown method(s) {unknown} (choose from {', '.join(METHODS)})")
    if any(r < 1 for r in rank_list) or steps < 1 or eval_examples < 1 or batch_size < 1:
        raise ValueError("--ranks, --steps, --eval-examples and --batch-size must be >= 1")
    if lr_schedule is not None:
        from transformers import SchedulerType

        schedules = [kind.value for kind in SchedulerType]
        if lr_schedule not in schedules:
            raise ValueError(f"--lr-schedule {lr_schedule!r} is not one of {', '.join(schedules)}")
    args = {"model": model, "data": data, "steps": steps, "eval_examples": eval_examples, "batch_size": batch_size,
            "learning_rate": learning_rate, "lr_schedule": lr_schedule, "report_to": report_to}
    # the data and the model are checked once, before any run: bad input costs no training
    from transformers import AutoConfig, AutoTokenizer

    model_path = resolve_model(model)
    tokenizer, context = AutoTokenizer.from_pretrained(model_path), AutoConfig.from_pretrained(model_path)
    probe = run_config(method_list[0], rank_list[0], seed_list[0], args, Path(out) / "loss" / "probe")
    train_set, held_out = sft.build_datasets(probe["data"], tokenizer, context.max_position_embeddings)

    loss_dir = Path(out) / "loss"
    runs = loss_dir / "runs"
    grid = [(m, r, s) for m in method_list for r in rank_list for s in seed_list]
    results = []
    for index, (method, rank, seed) in enumerate(grid, 1):
        print(f"[eval loss {index}/{len(grid)}] {LABELS[method]} rank {rank} seed {seed} "
              f"({time.time() - started:.0f} s so far)", flush=True)
        results.append(one_run(method, rank, seed, args, runs, (train_set, held_out)))

    source = data or "the synthetic personalisation task (preft.data.user_examples, user 0)"
    title = f"held-out loss by rank: {Path(model_path).name}, {Path(data).name if data else 'synthetic task'}"
    from preft.eval.results import command_line

    given = {"model": model, "data": data, "ranks": ranks, "methods": methods, "steps": steps, "seeds": seeds,
             "eval_examples": eval_examples, "batch_size": batch_size, "learning_rate": learning_rate,
             "lr_schedule": lr_schedule}
    result = {"command": command_line("loss", main, given, always=("model", "ranks", "methods", "steps", "seeds")),
              "learning_rate": learning_rate, "lr_schedule": lr_schedule, "batch_size": batch_size,
              "model": model, "data": source, "train_rows": len(train_set), "held_out_rows": len(held_out),
              "ranks": rank_list, "methods": method_list, "seeds": seed_list, "steps": steps,
              "runs": results, "wall_time_s": round(time.time() - started, 1)}
    loss_dir.mkdir(parents=True, exist_ok=True)
    markdown = (f"## Held-out loss by rank\n\nCommand: `{result['command']}`. Data: {source} "
                f"({len(train_set)} training rows, {len(held_out)} held out); {steps} steps per run, "
                f"seeds {seed_list}.\n\n{table(results, method_list, rank_list)}\n")
    plot(results, method_list, rank_list, loss_dir / "loss_vs_rank.png", title)
    save_run(loss_dir, "loss", result, markdown, also=(loss_dir / "loss_vs_rank.png",))
    print(f"written: {loss_dir / 'results.json'}, {loss_dir / 'loss.md'}, {loss_dir / 'loss_vs_rank.png'}")
    return result


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    add_flags(parser, main, [
        ("--model", str, "base model: 'default' (the embedded model), a prepared real model (preft models list) or a local model directory (Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3, OLMo 2)"),
        ("--data", str, "a local JSONL/Parquet/CSV file or directory (prompt/completion or messages); "
                        "default: the synthetic personalisation task"),
        ("--ranks", str, "comma-separated ranks"),
        ("--methods", str, f"comma-separated, of {', '.join(METHODS)}"),
        ("--steps", int, "training steps per run"),
        ("--seeds", str, "comma-separated seeds (each a separate run)"),
        ("--eval-examples", int, "rows held out when the data has no validation split"),
        ("--batch-size", int, "per-device training batch size"),
        ("--learning-rate", float, "learning rate for every run (default: each method's recipe config)"),
        ("--lr-schedule", str, "the trainer's lr_scheduler_type for every run, e.g. constant, linear, cosine "
                               "(default: each method's recipe config)"),
        ("--report-to", str, "the trainer's report_to ('none', or 'wandb': offline unless WANDB_MODE says)"),
        ("--out", str, "results directory"),
    ])
