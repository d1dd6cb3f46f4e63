"""Benchmark: SFT step time, LoRA-P vs all-token LoRA (tiny models), or by precision (a real model).

    preft bench sft-step [--repeats N]                                   (also part of `make bench`)
    preft bench sft-step --model smollm2-135m-instruct [--steps 16] [--rounds 2]

Without ``--model``: both adapters have the same rank and targets and train on the same batch;
steps alternate (A, B, A, B, ...) so machine noise hits both sides alike, and the ratio of medians
is reported. Two models: the embedded default base, and a larger random-init Llama (hidden 512, 8
layers) where the adapter's matmuls are a visible share of the step.

With ``--model`` (a real model, :mod:`preft.real_models`): the SFT recipe's own trainer
(``PreftSFTTrainer``, LoRA-P r=16 on every linear module, 8 chat rows a step: the tour's persona
data) trains ``--steps`` steps in each variant (``PRECISIONS``), the variants taking turns for
``--rounds`` rounds: ``float32`` or ``bf16`` (:mod:`preft.precision`: bfloat16 base weights and
autocast, float32 adapter), each with TRL's own CPU step (``fast_cpu_step=False``) and with
:mod:`preft.trainers.cpu_step`, and the fastest without gradient checkpointing. It reports the
median step time (the first two steps of a run left out) and each variant's loss curve, the same
seed and rows for all, so a faster step that learned less would show.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import preft
from preft.constants import ALL_PROJECTIONS
from preft.data import encode_sft_batch, user_examples
from preft.eval.results import default_of, publish, torch_machine
from preft.models import larger_random_llama

TARGETS = list(ALL_PROJECTIONS)


def step_timer(model, batch):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()

    def step() -> float:
        started = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    return step


def compare(name: str, build_base, batch, rank: int, repeats: int) -> dict:
    torch.manual_seed(0)
    preft_lora = get_peft_model(build_base(), preft.PreftLoraConfig(r=rank, target_modules=TARGETS))
    torch.manual_seed(0)
    lora = get_peft_model(build_base(), LoraConfig(r=rank, target_modules=TARGETS))
    steps = {"LoRA-P": step_timer(preft_lora, batch), "LoRA": step_timer(lora, batch)}
    for step in steps.values():  # warm-up
        step(), step()
    times = {key: [] for key in steps}
    for _ in tqdm(range(repeats), desc=f"sft step, {name}"):
        for key, step in steps.items():
            times[key].append(step())
    median = {key: statistics.median(values) for key, values in times.items()}
    return {
        "model": name,
        "batch_shape": list(batch["input_ids"].shape),
        "rank": rank,
        "repeats": repeats,
        "median_step_s": median,
        "ratio_lora_p_over_lora": median["LoRA-P"] / median["LoRA"],
    }


PRECISIONS = {  # name -> (recipe precision, PreftSFTTrainer's fast_cpu_step, gradient checkpointing)
    "float32, TRL's CPU step": ("float32", False, True),
    "bf16 weights + autocast, TRL's CPU step": ("bf16", False, True),
    "float32, fast CPU step": ("float32", True, True),
    "bf16 weights + autocast, fast CPU step": ("bf16", True, True),
    "bf16 weights + autocast, fast CPU step, no gradient checkpointing": ("bf16", True, False),
}


def precision_run(model_dir: str, name: str, steps: int, out: Path) -> dict:
    """One training run of ``steps`` steps in precision ``name``: step times and losses."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig

    from preft import demo_users, precision
    from preft.trainers import PreftSFTTrainer
    from preft.user_data import to_prompt_completion

    chosen, fast_cpu_step, gradient_checkpointing = PRECISIONS[name]
    rows = [to_prompt_completion({"messages": row["messages"]}) for row in demo_users.chat_rows("alice", 8 * steps)]
    section = {"max_steps": steps, "per_device_train_batch_size": 8, "learning_rate": 2e-3, "warmup_steps": 2,
               "logging_steps": 1, "report_to": "none", "save_strategy": "no", "seed": 0,
               "gradient_checkpointing": gradient_checkpointing}
    section = precision.apply(chosen, section, announce=lambda line: None)
    run_dir = out / "".join(c if c.isalnum() else "_" for c in name)
    trainer = PreftSFTTrainer(model=model_dir, args=SFTConfig(output_dir=str(run_dir), **section),
                              train_dataset=Dataset.from_list(rows), fast_cpu_step=fast_cpu_step,
                              peft_config=preft.PreftLoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                                task_type="CAUSAL_LM"))
    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.started)

    trainer.add_callback(StepTimes())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    tokens = next(iter(trainer.get_train_dataloader()))["input_ids"].shape
    return {"step_s": times[2:], "losses": losses, "batch_shape": list(tokens)}


def precisions(model: str, steps: int = 16, rounds: int = 2) -> dict:
    """The real-model comparison (see the module docstring); published as ``sft_step_MODEL``."""
    import tempfile

    from preft.real_models import resolve

    model_dir = resolve(model)
    runs: dict[str, list[dict]] = {name: [] for name in PRECISIONS}
    with tempfile.TemporaryDirectory(prefix="preft-sft-step-") as out:
        for round_index in range(rounds):
            order = list(PRECISIONS)[round_index % len(PRECISIONS):] + list(PRECISIONS)[:round_index % len(PRECISIONS)]
            for name in order:
                print(f"round {round_index + 1}/{rounds}: {name}", file=sys.stderr, flush=True)
                runs[name].append(precision_run(model_dir, name, steps, Path(out)))
    rows = []
    for name, done in runs.items():
        step_times = [t for run in done for t in run["step_s"]]
        rows.append({"precision": name, "median_step_s": statistics.median(step_times),
                     "round_medians_s": [statistics.median(run["step_s"]) for run in done],
                     "losses_first_round": done[0]["losses"], "batch_shape": done[0]["batch_shape"]})
    baseline = rows[0]["round_medians_s"]
    for row in rows:  # within each round (the variants moments apart), then the median over rounds
        per_round = [base / mine for base, mine in zip(baseline, row["round_medians_s"])]
        row["speedup_vs_float32"], row["speedup_range"] = statistics.median(per_round), [min(per_round), max(per_round)]
    command = f"preft bench sft-step --model {model} --steps {steps} --rounds {rounds}"
    result = {"command": command, **torch_machine(), "model": model, "steps": steps, "rounds": rounds, "rows": rows}
    shape = rows[0]["batch_shape"]
    table = ["| precision, step | median step (s) | per round (s) | vs float32 | loss at steps 1 / 4 / 8 / last |",
             "|---|---|---|---|---|"]
    for row in rows:
        losses = row["losses_first_round"]
        picks = " / ".join(f"{losses[i]:.2f}" for i in (0, 3, 7) if i < len(losses)) + f" / {losses[-1]:.2f}"
        table.append(f"| {row['precision']} | {row['median_step_s']:.2f} | "
                     f"{', '.join(f'{t:.2f}' for t in row['round_medians_s'])} | {row['speedup_vs_float32']:.2f}x "
                     f"[{row['speedup_range'][0]:.2f}-{row['speedup_range'][1]:.2f}] | "
                     f"{picks} |")
    markdown = "\n".join([
        f"## SFT step time on a real model by precision and CPU step ({model})",
        "",
        f"Command: `{command}` ({result['machine']}, torch {result['torch']}). The SFT recipe's trainer, LoRA-P",
        f"r=16 on every linear module, {shape[0]} chat rows of up to {shape[1]} tokens a step (the tour's persona",
        f"data), {steps} steps a run, the variants taking turns for {rounds} rounds; median step time without each",
        "run's first two steps; the ratio to float32 with TRL's CPU step (the toolkit's step before the fast",
        "one) is taken within each round, its median and range over rounds given. `fast CPU step` is `PreftSFTTrainer` on a CPU (`preft.trainers.cpu_step`: the head on labelled",
        "positions only, short rows' attention in float32, no adapter input casts under autocast); `TRL's CPU",
        "step` is `fast_cpu_step=False`. `bf16 weights + autocast, fast CPU step` is what `precision: auto`",
        "picks on a CPU with native bf16 (AVX512-BF16 or AMX). Gradient checkpointing (TRL's default) recomputes",
        "each layer's forward in the backward; `recipes/configs/sft_own_data.yaml` and the tour turn it off.",
        "",
        *table,
    ])
    publish(f"sft_step_{model}", result, markdown)
    return result


def main(repeats: int = 30, rank: int = 16) -> dict:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    tokenizer = AutoTokenizer.from_pretrained(preft.DEFAULT_BASE_MODEL)
    batch = encode_sft_batch(tokenizer, user_examples(0, 16, seed=3))
    rows = [
        compare("default base (1.7M)", lambda: AutoModelForCausalLM.from_pretrained(preft.DEFAULT_BASE_MODEL),
                batch, rank, repeats),
        compare("random Llama 512x8 (27M)", lambda: larger_random_llama(len(tokenizer)), batch, rank, repeats),
    ]
    command = "preft bench sft-step" + (f" --repeats {repeats}" if repeats != default_of(main, "repeats") else "")
    result = {"command": command, **torch_machine(), "rows": rows}
    table = ["| model | batch | LoRA step (ms) | LoRA-P step (ms) | LoRA-P / LoRA |", "|---|---|---|---|---|"]
    for row in rows:
        table.append(f"| {row['model']} | {row['batch_shape'][0]}x{row['batch_shape'][1]} tokens, r={row['rank']} "
                     f"| {row['median_step_s']['LoRA'] * 1e3:.1f} | {row['median_step_s']['LoRA-P'] * 1e3:.1f} "
                     f"| {row['ratio_lora_p_over_lora']:.3f}x |")
    markdown = "\n".join([
        "## SFT step time: LoRA-P vs all-token LoRA",
        "",
        f"Command: `{command}` ({result['machine']}, torch {result['torch']}). Forward + backward +",
        f"AdamW step on the same batch, the two adapters alternating, median of {repeats} steps each.",
        "LoRA-P's mask adds one multiply per adapted layer, so its step should be within 1.05x of LoRA's.",
        "",
        *table,
    ])
    publish("sft_step", result, markdown)
    return result


if __name__ == "__main__":
    main()


def add_arguments(parser) -> None:
    parser.add_argument("--repeats", type=int, default=default_of(main, "repeats"),
                        help="timed steps per side (default %(default)s)")
    parser.add_argument("--model", default=None,
                        help="a real model (preft models list) or model directory: step time by precision instead")
    parser.add_argument("--steps", type=int, default=default_of(precisions, "steps"),
                        help="with --model: training steps per run (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=default_of(precisions, "rounds"),
                        help="with --model: runs per precision, taking turns (default %(default)s)")
    parser.set_defaults(bench=lambda args: precisions(args.model, args.steps, args.rounds) if args.model
                        else main(repeats=args.repeats))
