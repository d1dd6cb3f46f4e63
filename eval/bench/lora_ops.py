"""Benchmark: the CPU multi-LoRA ops on one prefill step, against the base layers' matmuls.

    preft bench lora-ops [--repeats N]          (also part of `make bench`)

One prefill step of 64 prompts of 33 tokens (the throughput benchmark's prompts: 32 tokens
plus BOS) through every LoRA layer of a model (q/k/v, o, gate/up, down in each decoder
layer), rank 16, with 1, 8 or 64 adapters in the step. Timed side by side, in rotated order:

- base matmuls: ``x @ W^T`` for each layer, the work the adapter is added to;
- vLLM's stock CPU ops (``vllm.lora.ops.torch_ops``: ``bgmv_shrink`` / ``bgmv_expand_slice``,
  which gather one weight matrix per token);
- PreFT's planned ops (``preft.serving.lora_ops.planned_lora_linear``);
- the same ops on tiles of a power of two near the mean rows per adapter (the earlier rule,
  kept as an ablation of how the plan sizes its tiles).

The two LoRA paths are checked against each other before timing. Reported: each path's time
as a fraction of the base matmuls' (what LoRA adds to a prefill step's linear layers) and
the planned ops' speed-up over stock. The engine-level numbers are the throughput benchmark's.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from tqdm import tqdm

from preft.eval.results import default_of, publish, torch_machine
from preft.serving import lora_ops
from preft.serving.tile_plan import MAX_TILE_ROWS, build_tile_plan

RANK = 16
PROMPTS, PROMPT_TOKENS = 64, 33
MODELS = {  # hidden, intermediate, kv width, decoder layers
    "default base (192x4)": (192, 512, 64, 4),
    "random Llama 512x8": (512, 1408, 128, 8),
}


class LoraLayers:
    """Every LoRA layer of one model with ``slots`` adapter slots, in vLLM's stacked layout."""

    def __init__(self, hidden: int, intermediate: int, kv: int, layers: int, slots: int) -> None:
        torch.manual_seed(0)
        shapes = [(hidden, (hidden, kv, kv)), (hidden, (hidden,)), (hidden, (intermediate, intermediate)),
                  (intermediate, (hidden,))] * layers
        self.layers = []
        for size_in, slices in shapes:
            lora_a = tuple(torch.randn(slots, 1, RANK, size_in) / size_in ** 0.5 for _ in slices)
            lora_b = tuple(torch.randn(slots, 1, size, RANK) / RANK ** 0.5 for size in slices)
            base = torch.randn(sum(slices), size_in) / size_in ** 0.5
            self.layers.append((size_in, slices, base, lora_a, lora_b,
                                lora_ops.PlannedLoraWeights(lora_a, lora_b, slices)))
        rows = PROMPTS * PROMPT_TOKENS
        self.inputs = {size: torch.randn(rows, size) for size in (hidden, intermediate)}
        self.outputs = [torch.zeros(rows, sum(slices)) for _, slices, *_ in self.layers]
        self.workspace = lora_ops.Workspace()

    def base(self, _indices, _plan) -> None:
        for (size_in, _, base, *_), y in zip(self.layers, self.outputs):
            y.copy_(self.inputs[size_in] @ base.t())  # a fresh output, as vLLM's linear layers make

    def stock(self, indices, _plan) -> None:
        from vllm.lora.ops import torch_ops

        for (size_in, slices, _, lora_a, lora_b, _), y in zip(self.layers, self.outputs):
            x, offset = self.inputs[size_in], 0
            shrunk = torch.zeros(len(slices), x.shape[0], RANK)
            for j, size in enumerate(slices):
                torch_ops.bgmv_shrink(x, lora_a[j], shrunk[j], indices, 1.0)
                torch_ops.bgmv_expand_slice(shrunk[j], lora_b[j], y, indices, offset, size, True)
                offset += size

    def planned(self, _indices, plan) -> None:
        for (size_in, _, _, _, _, weights), y in zip(self.layers, self.outputs):
            lora_ops.planned_lora_linear(y, self.inputs[size_in], plan, weights, 1.0, self.workspace)

    def check(self, indices, plan) -> None:
        """The planned ops add what vLLM's stock ops add (no row here is without an adapter)."""
        for y in self.outputs:
            y.zero_()
        self.stock(indices, plan)
        expected = [y.clone() for y in self.outputs]
        for y in self.outputs:
            y.zero_()
        self.planned(indices, plan)
        for got, want in zip(self.outputs, expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def step_indices(count: int) -> torch.Tensor:
    """The step's per-row adapter slots: prompt i (``PROMPT_TOKENS`` rows) on adapter i % count."""
    return (torch.arange(PROMPTS * PROMPT_TOKENS) // PROMPT_TOKENS) % count


def power_of_two_tile_rows(indices: torch.Tensor) -> int:
    """The earlier tile size: the power of two nearest the mean rows per adapter, at most 64."""
    mean_rows = indices.numel() / indices.unique().numel()
    return min(MAX_TILE_ROWS, 1 << max(0, round(math.log2(mean_rows))))


def measure(name: str, dims, adapter_counts, repeats: int) -> list[dict]:
    layers = LoraLayers(*dims, slots=max(adapter_counts) + 1)
    rows = []
    for count in adapter_counts:
        indices = step_indices(count)
        plan = build_tile_plan(indices)
        layers.check(indices, plan)
        power_of_two_plan = build_tile_plan(indices, tile_rows=power_of_two_tile_rows(indices))
        paths = {"base": layers.base, "stock": layers.stock, "planned": layers.planned,
                 "power_of_two_tiles": lambda i, _plan: layers.planned(i, power_of_two_plan)}
        times = {key: [] for key in paths}
        for repeat in tqdm(range(repeats + 1), desc=f"lora ops, {name}, {count} adapters"):
            order = list(paths)[repeat % len(paths):] + list(paths)[: repeat % len(paths)]
            for key in order:
                started = time.perf_counter()
                paths[key](indices, plan)
                if repeat:  # the first round warms caches and buffers
                    times[key].append(time.perf_counter() - started)
        median = {key: statistics.median(values) for key, values in times.items()}
        rows.append({"model": name, "adapters": count, "median_s": median,
                     "stock_over_base": median["stock"] / median["base"],
                     "planned_over_base": median["planned"] / median["base"],
                     "power_of_two_tiles_over_base": median["power_of_two_tiles"] / median["base"],
                     "planned_speedup_over_stock": median["stock"] / median["planned"]})
    return rows


def main(repeats: int = 15, adapter_counts: tuple[int, ...] = (1, 8, 64)) -> dict:
    rows = [row for name, dims in MODELS.items() for row in measure(name, dims, adapter_counts, repeats)]
    command = "preft bench lora-ops" + (f" --repeats {repeats}" if repeats != default_of(main, "repeats") else "")
    result = {"command": command, **torch_machine(), "rank": RANK, "rows_per_step": PROMPTS * PROMPT_TOKENS,
              "rows": rows}
    table = ["| model | adapters | base matmuls (ms) | stock ops (x base) | planned ops (x base) "
             "| planned, power-of-two tiles (x base) | planned vs stock |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        table.append(f"| {row['model']} | {row['adapters']} | {row['median_s']['base'] * 1e3:.1f} "
                     f"| {row['stock_over_base']:.2f}x | {row['planned_over_base']:.2f}x "
                     f"| {row['power_of_two_tiles_over_base']:.2f}x "
                     f"| {row['planned_speedup_over_stock']:.1f}x faster |")
    markdown = "\n".join([
        "## CPU LoRA ops on one prefill step",
        "",
        f"Command: `{command}` ({result['machine']}, torch {result['torch']}). One prefill step of",
        f"{PROMPTS} prompts x {PROMPT_TOKENS} tokens through every LoRA layer of the model (rank {RANK},",
        "prompt i on adapter i % N); the time LoRA adds, as a multiple of the base layers' matmul time.",
        f"Paths alternate in rotated order, median of {repeats} rounds each. The engine-level effect is in",
        "the throughput sections: there prefill is one part of the run, and decode steps under LoRA-P",
        "do no LoRA work. The power-of-two column is the same ops with the earlier tile-size rule: the",
        "prompts are 33 tokens, which that rule cut into two tiles of 32.",
        "",
        *table,
    ])
    publish("lora_ops", result, markdown)
    return result


if __name__ == "__main__":
    main()


def add_arguments(parser) -> None:
    parser.add_argument("--repeats", type=int, default=default_of(main, "repeats"),
                        help="timed rounds (default %(default)s)")
    parser.set_defaults(bench=lambda args: main(repeats=args.repeats))
