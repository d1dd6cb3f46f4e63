"""`preft eval prefix --parts conversations`: what the rule costs a multi-turn conversation.

Turn ``k + 1``'s prompt is turn ``k``'s prompt + its answer + a follow-up. The base model and an
all-token adapter reuse the KV of turn ``k``'s answer from the prefix cache (vLLM caches the
blocks a request fills while decoding). Under the rule a prefill-only adapter computed that KV
with the adapter *off* (decode), but in turn ``k + 1`` the same positions are prompt, adapter
*on*: the answer is prefilled again (:meth:`~preft.rule.AdapterRule.kv_adapter_span` keeps the
cache from reusing it). Per later turn PreFT prefills about

    recomputed(k + 1) = answer(k) + follow-up(k + 1) + the tail of turn k's prompt past its last full block

where the base model and all-token prefill ``follow-up + the tail of the answer past its last full
block``. What it buys: decode runs the base model (no adapter work per generated token), so
PreFT decodes as fast as the base model and batches across users.

Workload (:func:`~preft.serving.scheduling.workloads.conversation_workload`, seeded):
``--conversations`` conversations of 2-4 turns over 8 users' adapters, first turns Poisson at
``--conversation-rate``, each later turn sent ``think`` seconds (exponential, mean 0.5 s) after
the previous answer. A slot per user, or ``--slots S`` of them (``preft serve --max-adapters S``,
the simulator's ``max_loras``): the slot-limited regime, kept as a part of its own
(``conversations_slots``) beside the other.

- **Simulator**: the served step cost model of ``--model`` and a prefix cache of
  ``--engine-blocks`` blocks. PreFT (prefill-only keys from position 0), all-token (adapter-keyed)
  and the base model (no adapter) differ only in what the cache shares; the cost model does not
  carry an adapter's own compute, which the engine measures.
- **Engine**: ``preft serve`` with 8 LoRA-P bundles (PreFT, and base-model requests on the same
  server) and the same bundles with ``--all-token`` (all-token, and base beside); a closed-loop
  client (the ``openai`` client, streaming, token-id prompts, ``return_token_ids``) plays every
  conversation, each turn's prompt built from the answer's real token ids. Every run once a
  round over ``--engine-rounds`` rounds, rotated; ratios to base are per round, on the same
  server (the machine drifts). The prefix-cache hit rate is read from the server's ``/metrics``.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 128  # vLLM's CPU KV block
USERS = 8
RANK = 8
VARIANTS = ("base", "preft", "all-token")  # the simulator's and the engine's rows, in this order
SERVERS = {"preft": ("base", "preft"), "all-token": ("base", "all-token")}  # server -> variants run on it


def rules_of(variant: str) -> dict:
    """The simulator's adapter rules of a variant: ``{}`` keys by adapter (all-token)."""
    from preft.rule import AdapterRule

    return {f"user{i}": AdapterRule(prefill_only=True, adapter_start=0) for i in range(USERS)} \
        if variant == "preft" else {}


def as_variant(work: list, variant: str) -> list:
    """The base model's requests carry no adapter."""
    from dataclasses import replace

    return [replace(spec, adapter=None) for spec in work] if variant == "base" else work


def turn_metrics(specs: list, ttft_s: list[float], finish_s: list[float], output_tokens: list[int],
                 prefilled: list[int] | None = None) -> dict[str, Any]:
    """Per-turn TTFT p50 (turn 1 and later turns), output throughput over the run, and the mean
    prompt tokens a later turn prefilled (when known)."""
    later = [i for i, spec in enumerate(specs) if spec.turn > 1]
    first = [i for i, spec in enumerate(specs) if spec.turn == 1]
    start = min(spec.arrival_s for spec in specs)
    duration = max(finish_s) - start
    out = {"turns": len(specs), "duration_s": duration, "output_throughput": sum(output_tokens) / duration,
           "turns_per_s": len(specs) / duration,
           "ttft_ms_p50_turn1": 1e3 * statistics.median(ttft_s[i] for i in first),
           "ttft_ms_p50_later": 1e3 * statistics.median(ttft_s[i] for i in later) if later else float("nan")}
    if prefilled is not None and later:
        out["prefilled_tokens_later"] = statistics.mean(prefilled[i] for i in later)
        out["prompt_tokens_later"] = statistics.mean(specs[i].prompt_tokens for i in later)
    return out


def simulate(work: list, variant: str, cost_model, settings: dict) -> dict[str, Any]:
    from preft.serving.scheduling.chunk_policies import VllmDefault
    from preft.serving.scheduling.prefix_cache import PrefixCache
    from preft.serving.scheduling.simulator import Simulator

    simulator = Simulator(cost_model, VllmDefault(), max_num_seqs=settings["max_num_seqs"],
                          max_num_batched_tokens=settings["max_num_batched_tokens"],
                          prefix_cache=lambda: PrefixCache(settings["engine_blocks"], BLOCK_TOKENS),
                          adapter_rules=rules_of(variant), max_loras=settings["slots"] or None)
    result = simulator.run(as_variant(work, variant))
    return turn_metrics(result.specs, [t.ttft_s for t in result.timings], [t.finish_s for t in result.timings],
                        [t.output_tokens for t in result.timings],
                        [result.recomputed_tokens[spec.request_id] for spec in result.specs])


async def play(url: str, api_key: str, work: list, model_of, vocab: int, seed: int = 0,
               timeout_s: float = 300) -> list[dict[str, Any]]:
    """Every conversation of ``work`` against a live server, closed loop: a later turn is sent
    ``think_s`` after the previous answer, its prompt the previous prompt's token ids + the
    answer's (as the server returned them) + a seeded follow-up. ``model_of(spec)``: the model
    name to ask. One dict per turn: ``spec``, ``arrival_s``, ``ttft_s``, ``finish_s``,
    ``output_tokens``, ``prompt`` (the token ids sent), ``answer``."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=timeout_s)
    turns: dict[str, list] = {}
    for spec in work:
        turns.setdefault(spec.conversation, []).append(spec)
    started = time.perf_counter()

    async def one_turn(spec, prompt: list[int], arrival: float) -> dict[str, Any]:
        first = None
        answer: list[int] = []
        stream = await client.completions.create(
            model=model_of(spec), prompt=prompt, max_tokens=spec.output_tokens, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True, "min_tokens": spec.output_tokens, "return_token_ids": True})
        async for chunk in stream:
            ids = (chunk.choices[0].model_extra or {}).get("token_ids") if chunk.choices else None
            if ids:
                first = first if first is not None else time.perf_counter() - started
                answer += ids
        if len(answer) != spec.output_tokens:
            raise RuntimeError(f"{spec.request_id}: {len(answer)} tokens came back, {spec.output_tokens} asked")
        return {"spec": spec, "arrival_s": arrival, "ttft_s": first - arrival,
                "finish_s": time.perf_counter() - started, "output_tokens": len(answer), "prompt": prompt,
                "answer": answer}

    async def conversation(specs: list) -> list[dict[str, Any]]:
        rng = random.Random(f"{seed}-{specs[0].conversation}")
        await asyncio.sleep(max(0.0, specs[0].arrival_s - (time.perf_counter() - started)))
        prompt, done = [rng.randrange(3, vocab) for _ in range(specs[0].prompt_tokens)], []
        for index, spec in enumerate(specs):
            if index:
                await asyncio.sleep(spec.think_s)
                follow_up = spec.prompt_tokens - len(prompt) - len(done[-1]["answer"])
                prompt = prompt + done[-1]["answer"] + [rng.randrange(3, vocab) for _ in range(follow_up)]
            done.append(await one_turn(spec, prompt, time.perf_counter() - started))
        return done

    try:
        results = await asyncio.gather(*(conversation(sorted(specs, key=lambda s: s.turn))
                                         for specs in turns.values()))
    finally:
        await client.close()
    return [turn for conversation_turns in results for turn in conversation_turns]


def prefix_cache_counters(url: str) -> tuple[float, float]:
    """``(hits, queries)`` in tokens, from vLLM's ``/metrics``."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    values = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values["vllm:prefix_cache_hits_total"], values["vllm:prefix_cache_queries_total"]


def engine_rows(model_dir: str, work: list, settings: dict, out: Path) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    import preft
    from preft.eval.serve import make_bundles
    from preft.eval.harness.server_process import start_server, stop_server

    out.mkdir(parents=True, exist_ok=True)
    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    served_base = "base" if model_dir == preft.DEFAULT_BASE_MODEL else str(Path(model_dir))
    runs: dict[tuple[str, str], list[dict]] = {}
    # the bundles live as long as the servers (each copies them into its store): a rerun exports anew
    with tempfile.TemporaryDirectory(prefix="preft-eval-conversations-") as bundle_root:
        bundles = make_bundles(model_dir, "lora", USERS, RANK, Path(bundle_root))
        for server, variants in SERVERS.items():
            args = ["--model", "default" if served_base == "base" else model_dir,
                    "--max-model-len", str(settings["max_len"]), "--max-adapters", str(settings["slots"] or USERS),
                    "--max-rank", str(RANK),
                    *[a for i, bundle in enumerate(bundles) for a in ("--adapter", f"user{i}={bundle}")]]
            args += ["--all-token"] if server == "all-token" else []
            args += ["--", "--max-num-seqs", str(settings["max_num_seqs"]),
                     "--num-gpu-blocks-override", str(settings["engine_blocks"])]
            proc, url, _ = start_server(args, out / f"server-{server}.log")
            try:
                asyncio.run(play(url, "none", work[:USERS * 2], lambda s: s.adapter, vocab, seed=99))  # warm-up
                for round_index in range(settings["engine_rounds"]):
                    shift = round_index % len(variants)
                    for variant in variants[shift:] + variants[:shift]:
                        print(f"[prefix] conversations on the engine, round {round_index + 1}/"
                              f"{settings['engine_rounds']}: {variant} ({server} server), {len(work)} turns", flush=True)
                        hits0, queries0 = prefix_cache_counters(url)
                        turns = asyncio.run(play(url, "none", work, (lambda s: served_base) if variant == "base"
                                                 else (lambda s: s.adapter), vocab, seed=round_index))
                        hits1, queries1 = prefix_cache_counters(url)
                        row = turn_metrics([t["spec"] for t in turns], [t["ttft_s"] for t in turns],
                                           [t["finish_s"] for t in turns], [t["output_tokens"] for t in turns])
                        row["prefix_hit_rate"] = (hits1 - hits0) / max(1.0, queries1 - queries0)
                        runs.setdefault((server, variant), []).append(row)
            finally:
                stop_server(proc)
    rows = []
    for server, variants in SERVERS.items():
        for variant in variants:
            measured = runs[(server, variant)]
            ratios = [m["output_throughput"] / b["output_throughput"] for m, b in zip(measured, runs[(server, "base")])]
            ttft_ratios = [m["ttft_ms_p50_later"] / b["ttft_ms_p50_later"]
                           for m, b in zip(measured, runs[(server, "base")])]
            rows.append({"server": server, "variant": variant, "rounds": len(measured),
                         **{k: statistics.median(m[k] for m in measured) for k in measured[0]},
                         "vs_base": statistics.median(ratios), "vs_base_range": [min(ratios), max(ratios)],
                         "later_ttft_vs_base": statistics.median(ttft_ratios)})
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    sources = [("simulator", result["simulator"])]
    if result.get("engine"):
        sources.append(("engine", [r for r in result["engine"] if r["server"] == "preft" or r["variant"] != "base"]))
    width = 0.8 / len(VARIANTS)
    for ax, (key, label) in zip(axes, (("ttft_ms_p50_later", "TTFT p50 of turns 2-4 (ms)"),
                                       ("output_throughput", "output tokens/s"))):
        for index, variant in enumerate(VARIANTS):
            values = [next(r[key] for r in rows if r["variant"] == variant) for _, rows in sources]
            ax.bar([i + index * width for i in range(len(sources))], values, width, label=variant)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sources))], [name for name, _ in sources])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("multi-turn conversations: PreFT vs all-token vs base", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(result: dict) -> list[str]:
    settings = result["settings"]
    lines = [f"**Multi-turn conversations** ({settings['conversations']} conversations of 2-4 turns, "
             f"{settings['turns']} turns, over {USERS} users' rank-{RANK} LoRA adapters, first turns Poisson at "
             f"{settings['conversation_rate']:g}/s, think time 0.5 s mean; prefix cache {settings['engine_blocks']} "
             f"blocks of {BLOCK_TOKENS} tokens; " + (f"{settings['slots']} adapter slots for the {USERS} users, in "
                                                    "the engine and the simulator" if settings.get("slots") else
                                                    "a slot per user") + "):\n", "![conversations](conversations.png)\n",
             "| source | variant | TTFT p50 turn 1 (ms) | TTFT p50 turns 2-4 (ms) | output tok/s | vs base | "
             "prompt tokens prefilled per later turn (of) | prefix hit rate |", "|---|---|---|---|---|---|---|---|"]
    base = next(r for r in result["simulator"] if r["variant"] == "base")
    for row in result["simulator"]:
        lines.append(f"| simulator | {row['variant']} | {row['ttft_ms_p50_turn1']:.0f} | "
                     f"{row['ttft_ms_p50_later']:.0f} | {row['output_throughput']:.0f} | "
                     f"{row['output_throughput'] / base['output_throughput']:.2f}x | "
                     f"{row['prefilled_tokens_later']:.0f} ({row['prompt_tokens_later']:.0f}) | |")
    for row in result.get("engine", []):
        low, high = row["vs_base_range"]
        lines.append(f"| engine ({row['server']} server) | {row['variant']} | {row['ttft_ms_p50_turn1']:.0f} | "
                     f"{row['ttft_ms_p50_later']:.0f} ({row['later_ttft_vs_base']:.2f}x base) | "
                     f"{row['output_throughput']:.0f} | "
                     f"{row['vs_base']:.2f}x [{low:.2f}-{high:.2f}] | | {row['prefix_hit_rate']:.2f} |")
    lines += ["", *reading(result), ""]
    return lines


def reading(result: dict) -> list[str]:
    """What the table says, its numbers read off the result."""
    sim = {row["variant"]: row for row in result["simulator"]}
    text = (f"Under the rule a later turn prefills the previous answer again with the adapter on (its KV "
            f"was computed with the adapter off, while decoding): in the simulator PreFT's later turns "
            f"prefill {sim['preft']['prefilled_tokens_later']:.0f} of their {sim['preft']['prompt_tokens_later']:.0f} "
            f"prompt tokens where the base model prefills {sim['base']['prefilled_tokens_later']:.0f} and all-token "
            f"{sim['all-token']['prefilled_tokens_later']:.0f}; its cost model carries no adapter compute, so it "
            f"shows the re-prefill alone.")
    engine = {row["variant"]: row for row in result.get("engine", []) if row["variant"] != "base"}
    if {"preft", "all-token"} <= set(engine):
        bases = {row["server"]: row for row in result["engine"] if row["variant"] == "base"}
        preft, every = engine["preft"], engine["all-token"]
        text += (f" On the engine the prefix-cache hit rate is {preft['prefix_hit_rate']:.2f} for PreFT against "
                 f"{bases['preft']['prefix_hit_rate']:.2f} for the base model; later-turn TTFT p50 is "
                 f"{preft['later_ttft_vs_base']:.2f}x the base model's on the same server (all-token "
                 f"{every['later_ttft_vs_base']:.2f}x), output throughput {preft['vs_base']:.2f}x base "
                 f"[{preft['vs_base_range'][0]:.2f}-{preft['vs_base_range'][1]:.2f}] against all-token's "
                 f"{every['vs_base']:.2f}x [{every['vs_base_range'][0]:.2f}-{every['vs_base_range'][1]:.2f}].")
    return [text]


def run(model: str, out: Path, conversations: int, conversation_rate: float, engine: bool, engine_blocks: int,
        engine_rounds: int, slots: int = 0) -> dict[str, Any]:
    from transformers import AutoConfig

    from preft.eval import common

    from preft.eval import profile as eval_profile
    from preft.serving.scheduling import workloads
    from preft.serving.scheduling.cost_model import StepCostModel

    model_dir = common.model_dir(model, out.parent / "profile")
    cost_model = StepCostModel.load(eval_profile.served_cost_model(model, model_dir, out.parent, "prefix"))
    max_len = AutoConfig.from_pretrained(model_dir).max_position_embeddings
    work = workloads.conversation_workload(conversations, conversation_rate, seed=3, max_model_len=max_len,
                                           users=USERS)
    settings = {"conversations": conversations, "turns": len(work), "conversation_rate": conversation_rate,
                "engine_blocks": engine_blocks, "engine_rounds": engine_rounds, "max_len": max_len,
                "max_num_seqs": 64, "max_num_batched_tokens": 2048, "slots": slots}
    result: dict[str, Any] = {"settings": settings}
    result["simulator"] = [{"variant": v, **simulate(work, v, cost_model, settings)} for v in VARIANTS]
    for row in result["simulator"]:
        print(f"[prefix] conversations, simulator: {row['variant']:9s} later-turn TTFT p50 "
              f"{row['ttft_ms_p50_later']:.0f} ms, {row['output_throughput']:.0f} tok/s, "
              f"{row['prefilled_tokens_later']:.0f} of {row['prompt_tokens_later']:.0f} prompt tokens prefilled",
              flush=True)
    if engine:
        result["engine"] = engine_rows(model_dir, work, settings, out / "conversations")
    plot(result, out / "conversations.png")
    return result
