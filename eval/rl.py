"""`preft eval rl`: GRPO reward curves and held-out accuracy, all-token LoRA against LoRA-P and ReFT-P.

    preft eval rl [--methods lora,lora_p,reft_p] [--rank 16] [--steps 100] [--seeds 0] [--model default]
                  [--out runs/eval]

Every (method, seed) is one run of the GRPO recipe (:mod:`preft.recipes.grpo`, what ``preft
train`` runs) from the shipped configs (``grpo_lora.yaml``, ``grpo_lora_p.yaml``; ReFT-P: the
LoRA-P config with a rank-R LoReFT-P adapter on every layer) on the verifiable arithmetic task,
starting from the base model. Runs live in ``OUT/rl/runs/`` (a finished run with the same config
is reused). Writes ``OUT/rl/results.json``, ``rl.md`` (held-out greedy accuracy before/after,
mean reward in the first and last quarter of training) and ``reward_vs_step.png`` (one line per
method and seed).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from preft.recipe_config import load_config
from preft.eval.results import save_run

CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "configs"
METHODS = {
    "lora": ("grpo_lora.yaml", lambda r: {"type": "lora", "r": r, "lora_alpha": 2 * r}),
    "lora_p": ("grpo_lora_p.yaml", lambda r: {"type": "lora_p", "r": r, "lora_alpha": 2 * r}),
    "reft_p": ("grpo_lora_p.yaml", lambda r: {"type": "reft_p", "rank": r, "intervention": "loreft",
                                              "layers": None, "adapter_start": 0}),
}
LABELS = {"lora": "LoRA (all tokens)", "lora_p": "LoRA-P", "reft_p": "LoReFT-P"}


#: task -> (data section, trainer overrides): the tiny model's arithmetic, or a chat model's word problems
TASKS = {
    "arithmetic": (None, {}),
    "word_problems": ({"task": "word_problems", "train_prompts": 2000, "eval_prompts": 100},
                      {"max_completion_length": 32, "num_generations": 8}),
}


def run_config(method: str, rank: int, seed: int, steps: int, batch: int, model: str, run_dir: Path,
               task: str = "arithmetic", precision: str | None = None) -> dict:
    config_file, adapter = METHODS[method]
    config = load_config(CONFIGS / config_file)
    # a run directory of the eval (inside its claimed --out), trained anew
    config.update(output_dir=str(run_dir), model=model, resume_from_checkpoint=None, overwrite_output_dir=True)
    data, trainer = TASKS[task]
    if data is not None:
        config["data"] = dict(data)
    config["trainer"].update(trainer)
    if precision is not None:
        config["precision"] = precision
    section = adapter(rank)
    if section["type"] == "reft_p":
        config["adapter"] = section
    else:
        config["adapter"].update({k: v for k, v in section.items() if k != "type"})
    generations = config["trainer"]["num_generations"]
    config["trainer"].update(max_steps=steps, seed=seed, report_to="none", logging_steps=max(1, steps // 25),
                             save_steps=max(1, steps // 2), per_device_train_batch_size=max(generations, batch))
    return config


def one_run(method: str, rank: int, seed: int, steps: int, batch: int, model: str, runs: Path,
            task: str = "arithmetic", precision: str | None = None) -> dict[str, Any]:
    from preft.recipes import grpo

    from preft.eval.results import run_dir_for

    prefix = "" if task == "arithmetic" else f"{task}-"
    settings = (method, rank, seed, steps, batch, model)
    run_dir = run_dir_for(runs, f"{prefix}{method}-r{rank}-s{seed}", run_config(*settings, Path("."), task, precision))
    config = run_config(*settings, run_dir, task, precision)
    summary_path = run_dir / "run_summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        if summary.get("config") == json.loads(json.dumps(config, default=str)):
            print(f"  {run_dir.name}: done before, reused")
            return {"method": method, "rank": rank, "seed": seed, **_metrics(summary)}
    return {"method": method, "rank": rank, "seed": seed, **_metrics(grpo.main(config))}


def _metrics(summary: dict[str, Any]) -> dict[str, Any]:
    return {key: summary[key] for key in ("steps", "reward_history", "mean_reward_first_quarter",
                                          "mean_reward_last_quarter", "heldout_greedy_accuracy_before",
                                          "heldout_greedy_accuracy_after")}


def table(results: list[dict[str, Any]], methods: list[str]) -> str:
    lines = ["| method | held-out accuracy before → after | mean reward, first → last quarter | seeds |",
             "|---|---|---|---|"]
    for method in methods:
        runs = [r for r in results if r["method"] == method]

        def mean(key):
            values = [r[key] for r in runs if r[key] is not None]
            return statistics.mean(values) if values else float("nan")

        lines.append(f"| {LABELS[method]} | {mean('heldout_greedy_accuracy_before'):.3f} → "
                     f"{mean('heldout_greedy_accuracy_after'):.3f} | {mean('mean_reward_first_quarter'):.3f} → "
                     f"{mean('mean_reward_last_quarter'):.3f} | {len(runs)} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    colors = {method: f"C{i}" for i, method in enumerate(METHODS)}
    for run in results:
        history = run["reward_history"]
        ax.plot([s for s, _ in history], [r for _, r in history], color=colors[run["method"]], alpha=0.8,
                label=f"{LABELS[run['method']]} (seed {run['seed']})")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (exact answer)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


#: ``--quick``: a smoke run (LoRA vs LoRA-P, one seed, 4 steps)
QUICK = {"methods": "lora,lora_p", "steps": 4, "seeds": "0"}


def main(methods: str = "lora,lora_p,reft_p", rank: int = 16, steps: int = 100, seeds: str = "0",
         batch_size: int = 64, model: str = "default", task: str | None = None, precision: str | None = None,
         quick: bool = False, out: str = "runs/eval") -> dict[str, Any]:
    from preft.eval.common import parse_list
    from preft.recipes.common import resolve_model

    started = time.time()
    if quick:
        methods, steps, seeds = QUICK["methods"], QUICK["steps"], QUICK["seeds"]
    if task is None:  # the tiny model's own arithmetic; a chat model's word problems
        task = "arithmetic" if model == "default" else "word_problems"
    if task not in TASKS:
        raise ValueError(f"--task {task!r} is not one of {', '.join(TASKS)}")
    if precision is None and model != "default":
        precision = "auto"  # a real model trains as the machine does best; the tiny default keeps its float32
    if precision is not None:
        from preft.precision import CHOICES

        if precision not in CHOICES:
            raise ValueError(f"--precision {precision!r} is not one of {', '.join(CHOICES)}")
    method_list, seed_list = parse_list(methods, str, "methods"), parse_list(seeds, int, "seeds")
    unknown = [m for m in method_list if m not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown method(s) {unknown} (choose from {', '.join(METHODS)})")
    if min(rank, steps, batch_size) < 1:
        raise ValueError("--rank, --steps and --batch-size must be >= 1")
    resolve_model(model)
    rl_dir = Path(out) / "rl"
    grid = [(m, s) for m in method_list for s in seed_list]
    results = []
    for index, (method, seed) in enumerate(grid, 1):
        print(f"[eval rl {index}/{len(grid)}] {LABELS[method]} seed {seed} ({time.time() - started:.0f} s so far)",
              flush=True)
        results.append(one_run(method, rank, seed, steps, batch_size, model, rl_dir / "runs", task, precision))
    command = (f"preft eval rl --methods {methods} --rank {rank} --steps {steps} --seeds {seeds} "
               f"--batch-size {batch_size} --model {model} --task {task}"
               + (f" --precision {precision}" if precision else ""))
    result = {"command": command, "runs": results, "wall_time_s": round(time.time() - started, 1)}
    rl_dir.mkdir(parents=True, exist_ok=True)
    what = ("verifiable arithmetic (reward 1 for the exact answer)" if task == "arithmetic" else
            "one-step word problems as chat prompts (reward 1 where the answer's last number is right)")
    markdown = (f"## GRPO: reward and held-out accuracy by method\n\nCommand: `{command}`. Task: {what}; "
                f"rank {rank}, {steps} steps from the base model.\n\n"
                f"{table(results, method_list)}\n")
    plot(results, rl_dir / "reward_vs_step.png", f"GRPO reward, rank {rank}, {steps} steps")
    save_run(rl_dir, "rl", result, markdown, also=(rl_dir / "reward_vs_step.png",))
    print(markdown)
    print(f"written: {rl_dir / 'results.json'}, {rl_dir / 'rl.md'}, {rl_dir / 'reward_vs_step.png'}")
    return result


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    add_flags(parser, main, [
        ("--methods", str, f"comma-separated, of {', '.join(METHODS)}"),
        ("--rank", int, "adapter rank"),
        ("--steps", int, "GRPO steps per run"),
        ("--seeds", str, "comma-separated seeds (each a separate run)"),
        ("--batch-size", int, "completions per step (prompts x num_generations)"),
        ("--model", str, "base model: 'default', a prepared real model (preft models list) or a local model directory (Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3, OLMo 2)"),
        ("--task", str, "arithmetic (the tiny model's) or word_problems (a chat model's; preft/tasks.py); "
                        "default: by the model"),
        ("--precision", str, "auto, float32 or bf16 (default: auto for a real model, float32 for the tiny one)"),
        ("--quick", bool, "the smoke run: LoRA vs LoRA-P, one seed, 4 steps"),
        ("--out", str, "results directory"),
    ])
