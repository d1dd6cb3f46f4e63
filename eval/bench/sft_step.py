"""Benchmark: SFT step time of LoRA-P vs all-token LoRA on the same batch (goal <= 1.05x).

    preft bench sft-step [--repeats N]          (also part of `make bench`)

Both adapters have the same rank and targets and train on the same batch; steps alternate
(A, B, A, B, ...) so machine noise hits both sides alike, and the ratio of medians is reported.
Two models: the embedded default base, and a larger random-init Llama (hidden 512, 8 layers)
where the adapter's matmuls are a visible share of the step.
"""

from __future__ import annotations

import statistics
import time

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
        "Goal: LoRA-P <= 1.05x LoRA.",
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
    parser.set_defaults(bench=lambda args: main(repeats=args.repeats))
