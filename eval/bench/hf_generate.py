"""Benchmark: HF ``generate`` of N users' adapters in one batch (PEFT's ``adapter_names``), PreFT
against PEFT's own all-token LoRA and the base model. Torch, transformers and PEFT only (no
vLLM): it is also part of the torch-only GPU check (``preft eval gpu --engine hf``).

    preft bench hf-generate [--model default] [--adapters 1,16,64,256] [--rounds 3]

A batch of N rows, row i on adapter i (N different adapters, rank ``--rank`` on q/v, random
weights, adapter i seeded with i: the same weights for PEFT's LoRA and LoRA-P), prompts of
``--prompt-tokens`` / 2 to ``--prompt-tokens`` random tokens (left-padded), ``--output-tokens``
greedy tokens each (EOS never ends a row early). Variants:

- ``base``: the base model, no adapter;
- ``PEFT LoRA (all-token)``: ``peft.LoraConfig``, PEFT's mixed batch: every row's adapter on
  every token, prompt and decode;
- ``LoRA-P``: ``preft.PreftLoraConfig``, the same adapters on each row's prompt only: the decode
  steps run the base model for the whole batch;
- ``LoReFT-P``: ``preft.PreftReftConfig`` (rank ``--rank`` on every layer), prompt only.

Each variant is its own model with all N_max adapters loaded. Per round, per N, every variant
generates the same batch once, in an order rotated each round; round 0 warms up and is dropped.
Ratios (output tokens/s vs base, vs PEFT's) are taken within a round and the median over rounds
is reported. Writes ``docs/results/hf_generate[_MODEL].json`` and its section of
``docs/RESULTS.md`` (``--out DIR`` writes there instead, for a machine whose tree is read-only).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

VARIANTS = ("base", "PEFT LoRA (all-token)", "LoRA-P", "LoReFT-P")
MODELS = {"default": "the embedded default model (1.7M parameters, hidden 192 x 4 layers)",
          "512x8": "a random-init Llama (27M parameters, hidden 512 x 8 layers, 2 KV heads)",
          "0.5B": "a random-init Llama (hidden 1280 x 24 layers, 20 heads, 4 KV heads, vocabulary 32000)",
          "1B": "a random-init Llama (hidden 2048 x 20 layers, 16 heads, 4 KV heads, vocabulary 32000)"}
TARGETS = ["q_proj", "v_proj"]  # PEFT's default LoRA targets for Llama


def base_model(name: str):
    """A fresh copy of the base model ``name`` (float32, eval mode); the same weights every call."""
    from transformers import AutoModelForCausalLM

    import preft
    from preft.models import larger_random_llama, random_llama

    if name == "default":
        return AutoModelForCausalLM.from_pretrained(preft.DEFAULT_BASE_MODEL).eval()
    if name == "512x8":
        torch.manual_seed(0)
        return larger_random_llama(1024).eval()
    from preft.eval.calibrate import MODELS as SHAPES

    hidden, layers, heads, kv_heads, intermediate, vocab = SHAPES[name]
    return random_llama(vocab, hidden, layers, heads, kv_heads, intermediate).eval()


def adapter_configs(rank: int) -> dict:
    """variant -> a function making its adapter config (LoRA on q/v, LoReFT-P on every layer)."""
    from peft import LoraConfig

    import preft

    return {"PEFT LoRA (all-token)": lambda: LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                        init_lora_weights=False),
            "LoRA-P": lambda: preft.PreftLoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                    init_lora_weights=False),
            "LoReFT-P": lambda: preft.PreftReftConfig(rank=rank, init_weights=False)}


def with_adapters(model, variant: str, count: int, rank: int):
    """``model`` with ``count`` adapters ``a0..`` of ``variant``, adapter i seeded with i."""
    from peft import get_peft_model

    if variant == "base":
        return model
    configs = adapter_configs(rank)
    torch.manual_seed(0)
    peft_model = get_peft_model(model, configs[variant](), adapter_name="a0")
    add_adapters(peft_model, [f"a{index}" for index in range(1, count)], configs[variant])
    return peft_model.eval()


def add_adapters(peft_model, names: list[str], make_config) -> None:
    """``peft_model.add_adapter(name, make_config())`` for every name (adapter ``names[i]`` seeded
    with ``i + 1``), in time linear in their number. PEFT's ``add_adapter`` walks every module of
    the model, adapters included, so adding N of them one by one is quadratic (hours for 512 on
    a 1B model); here each new adapter goes straight into the tuner layers the first one created,
    through the tuner's own ``_create_and_replace`` (which calls each layer's ``update_layer``
    with the arguments of the installed PEFT version)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    tuner = peft_model.base_model
    layers = [(key, module) for key, module in tuner.model.named_modules() if isinstance(module, BaseTunerLayer)]
    for index, name in enumerate(names, start=1):
        torch.manual_seed(index)
        config = make_config()
        if hasattr(config, "layers"):  # ReFT-P: its targets are decoder-layer names
            config = tuner._prepare_adapter_config(config, tuner.model.config.to_dict())
        peft_model.peft_config[name] = config
        for key, module in layers:
            parent_name, _, target_name = key.rpartition(".")
            tuner._create_and_replace(config, name, module, target_name, tuner.model.get_submodule(parent_name),
                                      current_key=key)


def make_batch(count: int, prompt_tokens: int, vocab: int, device) -> dict[str, torch.Tensor]:
    """``count`` left-padded rows of random tokens, lengths between half and all of ``prompt_tokens``."""
    generator = torch.Generator().manual_seed(count)
    lengths = torch.randint(max(1, prompt_tokens // 2), prompt_tokens + 1, (count,), generator=generator)
    ids = torch.randint(3, vocab, (count, prompt_tokens), generator=generator)
    mask = torch.arange(prompt_tokens)[None, :] >= (prompt_tokens - lengths)[:, None]
    return {"input_ids": ids.masked_fill(~mask, 0).to(device), "attention_mask": mask.long().to(device)}


@torch.no_grad()
def generate_once(model, variant: str, batch: dict, count: int, output_tokens: int, device) -> float:
    """Seconds for one ``generate`` of the batch (every row ``output_tokens`` new tokens)."""
    extra = {} if variant == "base" else {"adapter_names": [f"a{i}" for i in range(count)]}
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(**batch, max_new_tokens=output_tokens, min_new_tokens=output_tokens, do_sample=False,
                         pad_token_id=0, **extra)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert out.shape[1] == batch["input_ids"].shape[1] + output_tokens
    return elapsed


def measure(model_name: str, counts: list[int], variants: list[str], rank: int, prompt_tokens: int,
            output_tokens: int, rounds: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """``{variant: {N: [tokens/s per measured round]}}`` (module docstring)."""
    models = {}
    for variant in variants:
        started = time.perf_counter()
        models[variant] = with_adapters(base_model(model_name), variant, max(counts), rank).to(device=device,
                                                                                              dtype=dtype)
        print(f"[hf-generate] {variant}: {max(counts)} adapters built in {time.perf_counter() - started:.0f} s",
              flush=True)
    vocab = models["base"].config.vocab_size
    batches = {count: make_batch(count, prompt_tokens, vocab, device) for count in counts}
    rates: dict[str, dict[int, list[float]]] = {v: {c: [] for c in counts} for v in variants}
    for round_index in range(rounds + 1):
        for count in counts:
            order = variants[round_index % len(variants):] + variants[:round_index % len(variants)]
            for variant in order:
                seconds = generate_once(models[variant], variant, batches[count], count, output_tokens, device)
                if round_index:  # round 0 warms up
                    rates[variant][count].append(count * output_tokens / seconds)
        print(f"[hf-generate] round {round_index}{' (warm-up)' if not round_index else ''} done", flush=True)
    return rates


def summarize(rates: dict, counts: list[int]) -> dict[str, Any]:
    """Per variant and N: median tokens/s, and the medians of the per-round ratios to base and to PEFT."""
    summary = {}
    for variant, by_count in rates.items():
        row = {"tokens_per_s": {}, "vs_base": {}, "vs_peft": {}}
        for count in counts:
            row["tokens_per_s"][str(count)] = statistics.median(by_count[count])
            row["vs_base"][str(count)] = statistics.median(
                a / b for a, b in zip(by_count[count], rates["base"][count]))
            if "PEFT LoRA (all-token)" in rates:
                row["vs_peft"][str(count)] = statistics.median(
                    a / b for a, b in zip(by_count[count], rates["PEFT LoRA (all-token)"][count]))
        summary[variant] = row
    return summary


def describe(result: dict) -> str:
    """The setting of one run, in a sentence."""
    return (f"{MODELS[result['model']]}; N rows, row i on adapter i (rank {result['rank']}; LoRA on q/v, LoReFT-P on "
            f"every layer), prompts of {result['prompt_tokens'] // 2}-{result['prompt_tokens']} tokens, "
            f"{result['output_tokens']} new tokens per row, {result['dtype']}; {result['rounds']} interleaved rounds "
            f"after a warm-up, medians of per-round ratios.")


def table(result: dict) -> list[str]:
    counts = result["adapter_counts"]
    lines = [f"| variant | output tok/s (N = {' / '.join(counts)}) | vs base | vs PEFT LoRA (all-token) |",
             "|---|---|---|---|"]
    for variant, row in result["summary"].items():
        rates = " / ".join(f"{row['tokens_per_s'][c]:.0f}" for c in counts)
        vs_base = " / ".join(f"{row['vs_base'][c]:.2f}x" for c in counts)
        vs_peft = " / ".join(f"{row['vs_peft'][c]:.2f}x" for c in counts) if row["vs_peft"] else "-"
        lines.append(f"| {variant} | {rates} | {vs_base} | {vs_peft} |")
    return lines


def markdown(result: dict) -> str:
    lines = [f"## HF `generate` with N users' adapters in one batch: {result['model']} model on {result['device']}",
             "", f"Command: `{result['command']}`; {result['machine']}, torch {result['torch']}, transformers "
                 f"{result['transformers']}, peft {result['peft']}. {describe(result)}", "", *table(result)]
    return "\n".join(lines) + "\n"


def run(model: str = "default", adapters: str = "1,16,64,256", variants: str = ",".join(VARIANTS), rank: int = 16,
        prompt_tokens: int = 32, output_tokens: int = 64, rounds: int = 3, device: str = "auto") -> dict[str, Any]:
    """The measurement as a result dict (no files written): ``main`` and the GPU check call it."""
    import peft
    import transformers

    from preft.eval.common import parse_list
    from preft.eval.results import torch_machine

    if model not in MODELS:
        raise ValueError(f"--model {model!r}: choose from {', '.join(MODELS)}")
    counts = parse_list(adapters, int, "adapters")
    chosen = parse_list(variants, str, "variants")
    if min(counts) < 1 or rank < 1 or prompt_tokens < 2 or output_tokens < 1 or rounds < 1:
        raise ValueError("--adapters and --rank must be >= 1, --prompt-tokens >= 2, --output-tokens and --rounds >= 1")
    if "base" not in chosen or set(chosen) - set(VARIANTS):
        raise ValueError(f"--variants {variants!r}: choose from {', '.join(VARIANTS)}, base included")
    where = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                         "cpu" if device == "auto" else device)
    dtype = torch.bfloat16 if where.type == "cuda" else torch.float32
    rates = measure(model, counts, [v for v in VARIANTS if v in chosen], rank, prompt_tokens, output_tokens, rounds,
                    where, dtype)
    keys = [str(c) for c in counts]
    return {"model": model, "adapter_counts": keys, "rank": rank, "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "rounds": rounds, "dtype": str(dtype).removeprefix("torch."),
            "device": torch.cuda.get_device_name(where) if where.type == "cuda" else "CPU",
            "transformers": transformers.__version__, "peft": peft.__version__, **torch_machine(),
            "summary": summarize(rates, counts),
            "rounds_measured": {v: {str(c): r for c, r in by.items()} for v, by in rates.items()}}


def main(model: str = "default", adapters: str = "1,16,64,256", variants: str = ",".join(VARIANTS), rank: int = 16,
         prompt_tokens: int = 32, output_tokens: int = 64, rounds: int = 3, device: str = "auto",
         out: str | None = None) -> dict[str, Any]:
    import inspect

    from preft.eval.results import default_of, publish, write_result

    values = dict(locals())
    result = run(model, adapters, variants, rank, prompt_tokens, output_tokens, rounds, device)
    flags = [f"--{k.replace('_', '-')} {v}" for k, v in values.items()
             if k in inspect.signature(main).parameters and v != default_of(main, k)]
    result["command"] = " ".join(["preft bench hf-generate", *flags])
    name = "hf_generate" if model == "default" else f"hf_generate_{model}"
    if out:
        write_result(name, result, markdown(result), Path(out))
        print(markdown(result))
    else:
        publish(name, result, markdown(result))
    return result


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    add_flags(parser, main, [
        ("--model", str, f"base model: {', '.join(MODELS)}"),
        ("--adapters", str, "comma-separated N: rows and adapters in the batch"),
        ("--variants", str, f"comma-separated variants ({', '.join(VARIANTS)}); base is required"),
        ("--rank", int, "adapter rank"),
        ("--prompt-tokens", int, "the longest prompt (each row: half of it to all of it)"),
        ("--output-tokens", int, "new tokens per row"),
        ("--rounds", int, "measured rounds after a warm-up round"),
        ("--device", str, "auto (CUDA when present), cpu or cuda"),
        ("--out", str, "write NAME.json and RESULTS.md under this directory instead of docs/"),
    ])
    import inspect

    names = list(inspect.signature(main).parameters)
    parser.set_defaults(bench=lambda args: main(**{name: getattr(args, name) for name in names}))
