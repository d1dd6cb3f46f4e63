"""`preft eval prefix`: what prefix-aware scheduling costs and what it can gain on this machine.

    preft eval prefix [--parts cost,decode-batch,scheduling,conversations] [--waiting 100,1000,10000]
                      [--model 512x8] [--requests 1000] [--groups 100] [--cache-blocks 160]
                      [--engine-requests 200] [--engine-rate 20] [--engine-blocks 120] [--engine-rounds 3]
                      [--conversations 32] [--conversation-rate 4] [--no-engine] [--out runs/eval]

- ``cost``: the CPU cost of finding the waiting request that shares the most prefix with the
  running batch, Chunked Hash Tree vs the radix-tree baseline
  (:mod:`preft.serving.scheduling.chunked_hash_tree`, :mod:`preft.serving.scheduling.radix_tree`).
  For each ``--waiting`` count W, W prompts of 1k-10k tokens in 20 prefix groups (each prompt
  its group's prefix, 50-90% of its length, then unique tokens) arrive. Then 20 selections
  are made, each activating the request it picks. Measured: per-request arrival cost (the CHT
  hashes its chunks once; the radix tree stores the sequence) and per-selection cost
  (CHT: heap top plus the incremental updates of the activation; radix: one match per waiting
  request). Token ids are below 256, so 10k prompts fit in memory as Python sequences.
- ``decode-batch``: what a prefix-homogeneous decode batch gains on this CPU attention path,
  measured directly on the real engine (prefix caching on, its core in-process). B requests
  whose prompts share one L-token prefix decode together, then B requests whose prompts are
  distinct, of the same length. The median decode step time of each is compared (the
  scheduler's step trace, decode-only steps). The simulator's cost model carries this effect
  only as far as this measures it.
- ``scheduling``: FCFS vs LPM vs Feather (vs Feather+SLOWeave) on the prefix workloads, in the
  simulator and on the real engine (:mod:`preft.eval.prefix_scheduling`); it uses the
  decode-batch measurement (this run's, or the last one in ``OUT/prefix/results.json``).
- ``conversations``: multi-turn chats over per-user adapters, PreFT vs all-token vs the base
  model, in the simulator and on the real engine: what re-prefilling an answer under the rule
  costs a later turn (:mod:`preft.eval.prefix_conversations`). Not in the default ``--parts``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from preft.eval.results import save_run

CHUNK_TOKENS = 256
GROUPS = 20
SELECTIONS = 20


def prompts_for(count: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 256, size=10_000).tolist() for _ in range(GROUPS)]
    prompts = []
    for _ in range(count):
        length = int(rng.integers(1_000, 10_001))
        shared = int(length * rng.uniform(0.5, 0.9))
        group = prefixes[int(rng.integers(0, GROUPS))]
        prompts.append(group[:shared] + rng.integers(0, 256, size=length - shared).tolist())
    return prompts


def measure_cost(waiting: int) -> dict[str, Any]:
    """One W: arrival and selection costs of both structures (seconds)."""
    from preft.serving.scheduling.chunked_hash_tree import ChunkedHashTree, chunk_keys
    from preft.serving.scheduling.radix_tree import RadixTree, adapter_sequence

    prompts = prompts_for(waiting)
    results: dict[str, Any] = {"waiting": waiting, "mean_prompt_tokens": statistics.mean(map(len, prompts))}
    for name in ("cht", "radix"):
        tree = ChunkedHashTree() if name == "cht" else RadixTree(CHUNK_TOKENS)
        started = time.perf_counter()
        for index, prompt in enumerate(prompts):
            if name == "cht":
                tree.insert(str(index), chunk_keys(prompt, CHUNK_TOKENS))
            else:
                tree.insert(str(index), adapter_sequence(prompt, CHUNK_TOKENS))
        arrival = (time.perf_counter() - started) / waiting
        picks, started = [], time.perf_counter()
        for _ in range(SELECTIONS):
            chosen = tree.best_request()
            tree.activate(chosen)
            picks.append(chosen)
        selection = (time.perf_counter() - started) / SELECTIONS
        results[name] = {"arrival_s": arrival, "selection_s": selection, "picks": picks}
        del tree
    results["same_picks"] = results["cht"]["picks"] == results["radix"]["picks"]
    results["selection_ratio"] = results["cht"]["selection_s"] / results["radix"]["selection_s"]
    return results


def _decode_child(spec_path: str) -> None:
    """The engine process of ``decode-batch``: B decoders sharing a prefix, then B distinct ones."""
    import random

    from vllm import LLM, SamplingParams

    from preft.serving import SCHEDULER_CLS

    spec = json.loads(Path(spec_path).read_text())
    batch, prefix, decode_tokens = spec["batch"], spec["prefix_tokens"], spec["decode_tokens"]
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=spec["max_model_len"], seed=0,
              max_num_seqs=batch, enable_prefix_caching=True, scheduler_cls=SCHEDULER_CLS)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    trace = Path(spec["trace"])
    phases = {}
    params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True, temperature=0)
    for repeat in range(spec["repeats"]):
        for phase in ("shared", "distinct"):
            shared = [rng.randrange(3, vocab) for _ in range(prefix)]
            prompts = []
            for _ in range(batch):
                body = shared if phase == "shared" else [rng.randrange(3, vocab) for _ in range(prefix)]
                prompts.append({"prompt_token_ids": body + [rng.randrange(3, vocab) for _ in range(8)]})
            before = trace.read_text().count("\n") if trace.exists() else 0
            llm.generate(prompts, params, use_tqdm=False)
            after = trace.read_text().count("\n")
            phases.setdefault(phase, []).append([before, after])
    Path(spec["phases"]).write_text(json.dumps(phases))


def measure_decode_batch(model: str, out: Path, batch: int, prefix_tokens: int, repeats: int = 3) -> dict[str, Any]:
    from transformers import AutoConfig

    from preft.eval.common import model_dir as _model_dir

    work = out / "decode_batch"
    work.mkdir(parents=True, exist_ok=True)
    model_dir = _model_dir(model, work)
    max_len = AutoConfig.from_pretrained(model_dir).max_position_embeddings
    decode_tokens = min(96, max_len - prefix_tokens - 16)
    if decode_tokens < 8:
        raise ValueError(f"--prefix-tokens {prefix_tokens} leaves no room to decode in the model's {max_len} tokens")
    trace, phases_path = work / "steps.jsonl", work / "phases.json"
    trace.unlink(missing_ok=True)
    spec = {"model": model_dir, "batch": batch, "prefix_tokens": prefix_tokens, "decode_tokens": decode_tokens,
            "max_model_len": max_len, "repeats": repeats, "trace": str(trace), "phases": str(phases_path)}
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PREFT_STEP_TRACE": str(trace),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    env.pop("PREFT_SCHEDULER", None)
    with open(work / "engine.log", "w") as log:
        child = subprocess.run([sys.executable, "-m", "preft.eval.prefix", "--decode-child",
                                str(work / "spec.json")], env=env, stdout=log, stderr=subprocess.STDOUT)
    if child.returncode != 0:
        raise RuntimeError(f"the decode-batch engine failed; see {work / 'engine.log'}")
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    phases = json.loads(phases_path.read_text())
    result = {"model": model, "batch": batch, "prefix_tokens": prefix_tokens, "decode_tokens": decode_tokens,
              "repeats": repeats}
    for phase, spans in phases.items():
        times = [s["seconds"] for first, last in spans for s in steps[first:last] if s["c"] == 0 and s["n"] == batch]
        result[phase] = {"decode_steps": len(times), "median_ms": 1e3 * statistics.median(times),
                         "per_round_median_ms": [1e3 * statistics.median(
                             [s["seconds"] for s in steps[first:last] if s["c"] == 0 and s["n"] == batch])
                             for first, last in spans]}
    result["shared_vs_distinct"] = result["shared"]["median_ms"] / result["distinct"]["median_ms"]
    return result


def previous_decode_batch(prefix_dir: Path, model: str) -> dict | None:
    path = prefix_dir / "results.json"
    if not path.is_file():
        return None
    decode = json.loads(path.read_text()).get("decode_batch")
    return decode if decode and decode.get("model") == model else None


def main(parts: str = "cost,decode-batch,scheduling", waiting: str = "100,1000,10000", model: str = "512x8",
         batch: int = 16, prefix_tokens: int = 384, requests: int = 1000, groups: int = 100,
         cache_blocks: int = 160, engine: bool = True, engine_requests: int = 200, engine_rate: float = 20.0,
         engine_blocks: int = 120, engine_rounds: int = 3, conversations: int = 32,
         conversation_rate: float = 4.0, slots: int = 0, out: str = "runs/eval") -> dict[str, Any]:
    import inspect

    from preft.eval.common import parse_list
    from preft.eval.common import machine as _machine
    from preft.eval.results import command_line

    arguments = dict(locals())
    values = {name: arguments[name] for name in inspect.signature(main).parameters}
    part_list = parse_list(parts, str, "parts")
    unknown = [p for p in part_list if p not in ("cost", "decode-batch", "scheduling", "conversations")]
    if unknown:
        raise ValueError(f"--parts: unknown part(s) {unknown} (choose from cost, decode-batch, scheduling, "
                         "conversations)")
    if conversations < 1 or conversation_rate <= 0 or slots < 0:
        raise ValueError("--conversations must be >= 1, --conversation-rate > 0 and --slots >= 0")
    if requests < 10 or not 1 <= groups <= 100 or cache_blocks < 8 or engine_requests < 10 or engine_rate <= 0 \
            or engine_blocks < 8 or engine_rounds < 1:
        raise ValueError("--requests and --engine-requests must be >= 10, --groups in 1..100, --cache-blocks and "
                         "--engine-blocks >= 8, --engine-rate > 0, --engine-rounds >= 1")
    counts = parse_list(waiting, int, "waiting")
    if any(c < SELECTIONS for c in counts) or batch < 1 or prefix_tokens < 16:
        raise ValueError(f"--waiting must be >= {SELECTIONS}, --batch >= 1, --prefix-tokens >= 16")
    prefix_dir = Path(out) / "prefix"
    prefix_dir.mkdir(parents=True, exist_ok=True)
    command = command_line("prefix", main, values)
    result: dict[str, Any] = {"machine": _machine()}
    if "cost" in part_list:
        rows = []
        for count in counts:
            print(f"[prefix] cost: {count} waiting requests", flush=True)
            rows.append(measure_cost(count))
        result["cost"] = rows
    if "decode-batch" in part_list:
        print(f"[prefix] decode-batch: {batch} decodes, {prefix_tokens}-token prefixes, {model}", flush=True)
        result["decode_batch"] = measure_decode_batch(model, prefix_dir, batch, prefix_tokens)
    if "scheduling" in part_list:
        from preft.eval import prefix_scheduling

        decode = result.get("decode_batch") or previous_decode_batch(prefix_dir, model)
        if decode is None:
            print("[prefix] scheduling needs the decode-batch measurement: measuring it first", flush=True)
            decode = result["decode_batch"] = measure_decode_batch(model, prefix_dir, batch, prefix_tokens)
        result["scheduling"] = prefix_scheduling.run(model, prefix_dir, decode, requests, groups, cache_blocks,
                                                     engine, engine_requests, engine_rate, engine_blocks,
                                                     engine_rounds)
    if "conversations" in part_list:
        from preft.eval import prefix_conversations

        print(f"[prefix] conversations: {conversations} conversations at {conversation_rate:g}/s", flush=True)
        # the slot-limited run is a part of its own: it keeps the one with a slot per user beside it
        part = "conversations_slots" if slots else "conversations"
        result[part] = prefix_conversations.run(model, prefix_dir, conversations, conversation_rate, engine,
                                                engine_blocks, engine_rounds, slots)
    result["commands"] = {part: command for part in PARTS if part in result}
    previous = prefix_dir / "results.json"
    if previous.is_file():  # parts not run this time keep their last results (and the commands that made them)
        kept = json.loads(previous.read_text())
        commands = {**kept.get("commands", {}), **result["commands"]}
        result = {**{k: v for k, v in kept.items() if k in PARTS}, **result, "commands": commands}
    save_run(prefix_dir, "prefix", result, "\n".join(render(result)))
    return result


PARTS = ("cost", "decode_batch", "scheduling", "conversations", "conversations_slots")


def render(result: dict) -> list[str]:
    """The markdown of every part in ``result``, each with the command that measured it."""
    commands = result.get("commands", {})
    lines = ["## Prefix-aware scheduling: what it costs, what it can gain (`preft eval prefix`)\n",
             f"Machine: {result['machine']}.\n"]
    if "cost" in result:
        lines += [f"**Selection cost, CHT vs radix tree** (`{commands.get('cost', 'preft eval prefix')}`; {GROUPS} "
                  f"prefix groups, prompts of 1k-10k tokens, chunks of {CHUNK_TOKENS} tokens; {SELECTIONS} "
                  f"selections, each activating its pick):\n",
                  "| waiting | mean prompt | CHT arrival (ms/request) | radix arrival (ms/request) | "
                  "CHT selection (ms) | radix selection (ms) | CHT / radix | same picks |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in result["cost"]:
            lines.append(f"| {r['waiting']} | {r['mean_prompt_tokens']:.0f} | {1e3 * r['cht']['arrival_s']:.3f} | "
                         f"{1e3 * r['radix']['arrival_s']:.3f} | {1e3 * r['cht']['selection_s']:.3f} | "
                         f"{1e3 * r['radix']['selection_s']:.1f} | 1/{1 / r['selection_ratio']:.0f} | "
                         f"{'yes' if r['same_picks'] else 'no'} |")
        lines.append("")
    if "decode_batch" in result:
        decode = result["decode_batch"]
        lines += [f"**A prefix-homogeneous decode batch on this CPU attention path** "
                  f"(`{commands.get('decode_batch', 'preft eval prefix')}`; {decode['model']}, {decode['batch']} "
                  f"requests decoding {decode['decode_tokens']} tokens after {decode['prefix_tokens']}-token prompts, "
                  f"prefix caching on, {decode['repeats']} rounds): median decode step "
                  f"{decode['shared']['median_ms']:.1f} ms when the prompts share one prefix, "
                  f"{decode['distinct']['median_ms']:.1f} ms when they are distinct (ratio "
                  f"{decode['shared_vs_distinct']:.3f}; per round "
                  f"{' / '.join(f'{v:.1f}' for v in decode['shared']['per_round_median_ms'])} vs "
                  f"{' / '.join(f'{v:.1f}' for v in decode['distinct']['per_round_median_ms'])} ms).\n"]
    if "scheduling" in result:
        from preft.eval import prefix_scheduling

        lines += [f"Admission orders: `{commands.get('scheduling', 'preft eval prefix --parts scheduling')}`.\n"]
        lines += prefix_scheduling.markdown(result["scheduling"])
    for part in ("conversations", "conversations_slots"):
        if part in result:
            from preft.eval import prefix_conversations

            lines += [f"Conversations: `{commands.get(part, 'preft eval prefix --parts conversations')}`.\n"]
            lines += prefix_conversations.markdown(result[part])
    return lines


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    add_flags(parser, main, [
        ("--parts", str, "comma-separated, of cost (CHT vs radix selection), decode-batch (shared-prefix decode "
                         "step), scheduling (admission orders), conversations (multi-turn cost of the rule)"),
        ("--waiting", str, "comma-separated waiting-request counts for the cost part"),
        ("--model", str, "base model of the decode-batch part: '512x8', 'default' or a local directory"),
        ("--batch", int, "decoding requests in the decode-batch part"),
        ("--prefix-tokens", int, "prompt length of the decode-batch part"),
        ("--requests", int, "requests per simulated point (scheduling part)"),
        ("--groups", int, "prefix groups of the shared workload (1-100)"),
        ("--cache-blocks", int, "the simulated prefix cache (blocks of 128 tokens)"),
        ("--engine", bool, "run the scheduling and conversations parts on the real engine too"),
        ("--engine-requests", int, "requests in each engine trace"),
        ("--engine-rate", float, "the engine traces' offered rate (req/s; above capacity: throughput)"),
        ("--engine-blocks", int, "the engine's KV cache (--num-gpu-blocks-override)"),
        ("--engine-rounds", int, "rounds of engine runs (the ratios to FCFS, or to base, are per round)"),
        ("--conversations", int, "conversations of the conversations part (2-4 turns each)"),
        ("--conversation-rate", float, "first turns per second of the conversations part"),
        ("--slots", int, "adapter slots of the conversations part (engine --max-adapters and the simulator's; "
                         "0 = one per user)"),
        ("--out", str, "results directory"),
    ])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--decode-child":
        _decode_child(sys.argv[2])
