"""`preft eval plan`: the GPU regime in simulation, from a roofline cost model of a named GPU and
model, beside the papers' figures. Simulation, stated as such: no GPU runs here.

    preft eval plan [--hardware H100] [--model llama-3.1-8b] [--tp 1] [--adapters 1,64,512]
                    [--slots 16] [--requests 1000] [--out runs/eval]

The step cost is :class:`~preft.serving.scheduling.roofline.RooflineCostModel` (``--hardware``:
A100, H100, H200, H200-measured; ``--model``: a preset or a local model directory's
config.json), run through the same simulator and policy objects as the engine, with vLLM's GPU
defaults (256 running requests, 8192 tokens a step). First the roofline against published step
times (:func:`~preft.serving.scheduling.roofline.check_published`), then four parts:

- **adapters**: output tokens/s of the base model, PreFT (LoRA-P, LoReFT-P) and all-token
  multi-adapter serving (LoRA, LoReFT) with N = ``--adapters`` adapters on ``--slots`` slots
  (``min(N, slots)``), request i on adapter i % N, the ``mixed`` workload offered at twice the base
  model's capacity (throughput). A prefill-only request holds its slot until its prompt is done,
  an all-token one to its last token; the roofline charges each step its distinct adapters'
  weights and the tokens they touch. The paper: LoRA-P 1.87x and ReFT-P 1.9x all-token at 512
  adapters on Llama-3.1-70B, LoRA-P 1.83x on 8B.
- **sloweave**: goodput of SLOWeave against vLLM's default and fixed chunks on the ``mixed`` and
  ``long`` workloads at TPOT targets of 25 and 10 ms, at 0.5 / 0.75 / 1.0 / 1.25 of capacity
  (TTFT target: ten times the step that prefills the p95 prompt alone). The paper: +39% / +38%
  goodput at 25 ms, 3.3x / 2.4x at 10 ms.
- **feather**: output tokens/s of FCFS, LPM and Feather admission on the ``shared`` prefix
  workload (20 groups) and on ``no-sharing``, offered at once, with prefix caches of 1/4, 1/2,
  1, 2 and 8 times the groups' prefixes (the working set) and of what the GPU's memory holds
  beside the weights; the roofline reads a prefix shared by a step's decodes once. The paper:
  2-10x FCFS with sharing, no worse without.
- **wavepp**: the time to first token of one long prompt (8k and 32k tokens, nothing or half of
  it cached; ``--pipeline-prompts``) through S = 4 and 8 pipeline stages (:mod:`~preft.serving.scheduling.pipeline_simulator`),
  WavePP against the best fixed chunk of 256-8192, at a stage hand-off of 0, 1 and 3 ms. The
  stages run the roofline; WavePP plans on the roofline itself (its closed form,
  :meth:`~preft.serving.scheduling.roofline.RooflineCostModel.largest_prefill_chunk`: what the
  method can reach) and, beside it, on the 8-term fit of prefill-only steps (what a fitted cost
  model gives it). Beside each row, the bubbles the best fixed chunk leaves: the most any
  chunking could recover at the same work. The paper: >= 1.2x at S = 4.

Writes ``OUT/plan_SLUG/results.json``, ``plan.md`` and a figure per part, ``plan_SLUG_PART.png``
(``SLUG``: model, GPU and TP, e.g. ``llama-3.1-8b_H100``), so plans of several models and GPUs
sit side by side (``preft eval report`` puts each into docs/RESULTS.md).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from preft.eval.results import save_run

PAPER = {"adapters": "LoRA-P 1.87x, ReFT-P 1.9x all-token at 512 adapters (Llama-3.1-70B); LoRA-P 1.83x (8B)",
         "sloweave": "+39% (mixed) / +38% (long) goodput at 25 ms TPOT; 3.3x / 2.4x at 10 ms",
         "feather": "2-10x FCFS with shared prefixes, no worse without",
         "wavepp": ">= 1.2x the best fixed chunk's TTFT at S = 4 (a bar set here, not a figure of the paper)"}
#: GPU memory for the Feather part's prefix cache (data sheets: A100 80 or 40 GB, L4 24 GB, H100 80 GB, H200 141 GB)
FEATHER_MEMORY = {"A100": 80e9, "A100-40GB": 40e9, "L4": 24e9, "H100": 80e9, "H200": 141e9, "H200-measured": 141e9}
FIXED = ("default", "fixed:256", "fixed:512", "fixed:1024", "fixed:2048")
#: the Feather part's prefix caches, in multiples of the shared groups' prefix blocks (and the GPU's)
CACHE_MULTIPLES = (0.25, 0.5, 1.0, 2.0, 8.0)
PIPELINE = {"stages": (4, 8), "handoff_ms": (0.0, 1.0, 3.0), "fixed": (256, 512, 1024, 2048, 4096, 8192),
            "min_chunk": 16}
ENGINE = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_chunk": 8192}


def roofline(hardware: str, model: str, tp: int, adapter: str = "lora"):
    from preft.serving.scheduling.roofline import HARDWARE, MODELS, ModelShape, RooflineCostModel

    if hardware not in HARDWARE:
        raise ValueError(f"--hardware {hardware!r}: choose from {', '.join(HARDWARE)}")
    shape = MODELS.get(model.lower()) or (ModelShape.from_config(model) if Path(model).exists() else None)
    if shape is None:
        raise ValueError(f"--model {model!r}: a preset ({', '.join(MODELS)}) or a local model directory")
    return RooflineCostModel(shape, HARDWARE[hardware], tp=tp, adapter=adapter)


def simulate(cost_model, policy, work, rules: dict | None = None, slots: int | None = None):
    from preft.serving.scheduling.simulator import Simulator

    return Simulator(cost_model, policy, max_num_seqs=ENGINE["max_num_seqs"],
                     max_num_batched_tokens=ENGINE["max_num_batched_tokens"], adapter_rules=rules or {},
                     max_loras=slots).run(work)


def capacity(cost_model, kind: str, max_len: int, probe: int = 400) -> float:
    """The highest rate vLLM's default order and chunking serves in the simulator (eval goodput's test)."""
    from preft.eval.common import capacity as engine_capacity

    settings = {**ENGINE, "probe_requests": probe, "max_len": max_len}
    return engine_capacity(cost_model, kind, settings)


def on_adapters(work, count: int, rule) -> tuple[list, dict]:
    """``work`` with request i on adapter ``a{i % count}``, and every adapter under ``rule``."""
    from dataclasses import replace

    return ([replace(spec, adapter=f"a{i % count}") for i, spec in enumerate(work)],
            {f"a{i}": rule for i in range(count)})


def output_throughput(result) -> float:
    timings = result.timings
    return sum(t.output_tokens for t in timings) / (max(t.finish_s for t in timings) - min(t.arrival_s for t in timings))


def adapters_part(hardware: str, model: str, tp: int, counts: list[int], slots: int, requests: int,
                  max_len: int) -> list[dict[str, Any]]:
    from preft.rule import ALL_TOKEN, AdapterRule
    from preft.serving.scheduling import workloads
    from preft.serving.scheduling.chunk_policies import VllmDefault

    rows = []
    base_model = roofline(hardware, model, tp)
    rate = 2 * capacity(base_model, "mixed", max_len, probe=min(400, requests))
    work = workloads.generate("mixed", requests, rate, seed=7, max_model_len=max_len)
    base = output_throughput(simulate(base_model, VllmDefault(), work))
    for kind in ("lora", "reft"):
        cost_model = roofline(hardware, model, tp, adapter=kind)
        for count in counts:
            held = min(count, slots)
            row = {"adapter": kind, "adapters": count, "slots": held, "base_tok_s": base}
            for variant, rule in (("preft", AdapterRule(prefill_only=True)), ("all-token", ALL_TOKEN)):
                on, rules = on_adapters(work, count, rule)
                row[f"{variant}_tok_s"] = output_throughput(simulate(cost_model, VllmDefault(), on, rules, held))
            row["preft_vs_all_token"] = row["preft_tok_s"] / row["all-token_tok_s"]
            row["preft_vs_base"] = row["preft_tok_s"] / base
            rows.append(row)
            print(f"[plan] {kind} x{count} on {held} slots: PreFT {row['preft_vs_base']:.2f}x base, "
                  f"{row['preft_vs_all_token']:.2f}x all-token", flush=True)
    return rows


def sloweave_part(hardware: str, model: str, tp: int, requests: int, max_len: int) -> list[dict[str, Any]]:
    from preft.serving.scheduling import workloads
    from preft.serving.scheduling.chunk_policies import make_policy
    from preft.serving.scheduling.metrics import percentile

    cost_model = roofline(hardware, model, tp)
    rows = []
    for kind in ("mixed", "long"):
        rate0 = capacity(cost_model, kind, max_len, probe=min(400, requests))
        probe = workloads.generate(kind, 400, rate0, seed=98, max_model_len=max_len)
        ttft_s = 10 * cost_model(0, round(percentile([r.prompt_tokens for r in probe], 95)), 0)
        for tpot_ms in (25.0, 10.0):
            for load in (0.5, 0.75, 1.0, 1.25):
                work = workloads.generate(kind, requests, load * rate0, seed=0, max_model_len=max_len)
                goodput = {}
                for name in (*FIXED, "sloweave"):
                    policy = make_policy(name, cost_model=cost_model, tpot_s=tpot_ms / 1e3,
                                         max_chunk=ENGINE["max_chunk"])
                    goodput[name] = simulate(cost_model, policy, work).summary(ttft_s, tpot_ms / 1e3)["goodput"]
                best = max(FIXED, key=lambda n: goodput[n])
                rows.append({"workload": kind, "tpot_ms": tpot_ms, "load": load, "rate": load * rate0,
                             "capacity": rate0, "ttft_ms": 1e3 * ttft_s, "goodput": goodput, "best_fixed": best,
                             "sloweave_vs_best": goodput["sloweave"] / goodput[best] if goodput[best] else None,
                             "sloweave_vs_default": goodput["sloweave"] / goodput["default"] if goodput["default"]
                             else None})
            print(f"[plan] SLOWeave, {kind} at {tpot_ms:g} ms: " + ", ".join(
                f"{r['load']:g}: {r['sloweave_vs_best']:.2f}x" if r["sloweave_vs_best"] else f"{r['load']:g}: -"
                for r in rows[-4:]), flush=True)
    return rows


def feather_part(hardware: str, model: str, tp: int, requests: int, max_len: int) -> list[dict[str, Any]]:
    """FCFS, LPM and Feather on the shared-prefix and the no-sharing workloads, offered far past
    capacity (throughput), at prefix caches of :data:`CACHE_MULTIPLES` times the shared groups'
    prefix blocks and of what the GPU's memory holds beside the weights."""
    from preft.eval import prefix_scheduling
    from preft.serving.scheduling import workloads

    cost_model = roofline(hardware, model, tp)
    free = 0.9 * FEATHER_MEMORY.get(hardware, 80e9) * tp - cost_model.model.weight_bytes
    gpu_blocks = max(64, int(free / (cost_model.model.kv_bytes_per_token * prefix_scheduling.BLOCK_TOKENS)))
    shared = workloads.prefix_workload("shared", requests, rate=1e4, groups=20, seed=5, max_model_len=max_len)
    prefixes = {r.prefix_group: r.prefix_tokens for r in shared if r.prefix_group is not None}
    working_set = max(1, sum(prefixes.values()) // prefix_scheduling.BLOCK_TOKENS)
    caches = [(f"{m:g}x", max(16, int(m * working_set))) for m in CACHE_MULTIPLES] + [("GPU", gpu_blocks)]
    rows = []
    for variant in ("shared", "no-sharing"):
        work = shared if variant == "shared" else workloads.prefix_workload(variant, requests, rate=1e4, groups=20,
                                                                            seed=5, max_model_len=max_len)
        for label, blocks in caches:
            settings = {**ENGINE, "tpot_s": 1.0, "cache_blocks": blocks, "shared_context_cost": 1.0}
            throughput = {order: output_throughput(prefix_scheduling.simulate(order, work, cost_model, settings))
                          for order in ("fcfs", "lpm", "feather")}
            rows.append({"workload": variant, "cache": label, "cache_blocks": blocks, "working_set_blocks": working_set,
                         "tok_s": throughput, "feather_vs_fcfs": throughput["feather"] / throughput["fcfs"],
                         "lpm_vs_fcfs": throughput["lpm"] / throughput["fcfs"]})
            print(f"[plan] Feather, {variant}, cache {label} ({blocks} blocks): {rows[-1]['feather_vs_fcfs']:.2f}x "
                  f"FCFS (LPM {rows[-1]['lpm_vs_fcfs']:.2f}x)", flush=True)
    return rows


def wavepp_part(hardware: str, model: str, tp: int, prompts: list[int]) -> list[dict[str, Any]]:
    """WavePP against fixed chunks on one long prompt through a pipeline (module docstring)."""
    from preft.serving.scheduling.pipeline_simulator import FixedPrefillChunk, LongPrompt, simulate_pipeline
    from preft.serving.scheduling.wavepp import StageCost, WavePP

    cost_model = roofline(hardware, model, tp)
    planned = cost_model.as_step_cost_model(decodes=(0,))  # what a fitted cost model would plan with
    rows = []
    for stages in PIPELINE["stages"]:
        for handoff_ms in PIPELINE["handoff_ms"]:
            stage_cost = StageCost(cost_model, stages, handoff_ms / 1e3)
            plan_cost = StageCost(planned, stages, handoff_ms / 1e3)
            for prompt in prompts:
                for cached in (0, prompt // 2):
                    case = [LongPrompt("p", 0.0, prompt, cached)]
                    fixed = {size: simulate_pipeline(case, FixedPrefillChunk(size), stage_cost, stages)
                             for size in PIPELINE["fixed"]}
                    best = min(fixed, key=lambda size: fixed[size].ttft_s["p"])
                    wave = simulate_pipeline(case, WavePP(stage_cost, PIPELINE["min_chunk"], ENGINE["max_chunk"]),
                                             stage_cost, stages)
                    fitted = simulate_pipeline(case, WavePP(plan_cost, PIPELINE["min_chunk"], ENGINE["max_chunk"]),
                                               stage_cost, stages)
                    rows.append({"stages": stages, "handoff_ms": handoff_ms, "prompt": prompt, "cached": cached,
                                 "best_fixed": best, "best_fixed_ttft_s": fixed[best].ttft_s["p"],
                                 "best_fixed_bubble": fixed[best].bubble_fraction,
                                 "wavepp_ttft_s": wave.ttft_s["p"], "wavepp_chunks": len(wave.chunks["p"]),
                                 "wavepp_bubble": wave.bubble_fraction,
                                 "wavepp_vs_best": fixed[best].ttft_s["p"] / wave.ttft_s["p"],
                                 "wavepp_fitted_vs_best": fixed[best].ttft_s["p"] / fitted.ttft_s["p"]})
            print(f"[plan] WavePP, S = {stages}, hand-off {handoff_ms:g} ms: " + ", ".join(
                f"{r['prompt'] // 1024}k/{'half' if r['cached'] else 'none'} cached {r['wavepp_vs_best']:.2f}x"
                for r in rows[-2 * len(prompts):]), flush=True)
    return rows


def slug(cost_model) -> str:
    """``MODEL_GPU[_tpN]``: the name of one plan's directory, section and figures."""
    name = re.sub(r"[^a-z0-9.]+", "-", cost_model.model.name.lower()).strip("-")
    return f"{name}_{cost_model.hardware.name}" + (f"_tp{cost_model.tp}" if cost_model.tp > 1 else "")


def plot(result: dict, directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for kind, marker in (("lora", "o"), ("reft", "s")):
        rows = [r for r in result["adapters"] if r["adapter"] == kind]
        for variant, style in (("preft", "-"), ("all-token", "--")):
            ax.plot([r["adapters"] for r in rows], [r[f"{variant}_tok_s"] / r["base_tok_s"] for r in rows], style,
                    marker=marker, label=f"{variant} {kind}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("adapters (slots: min(N, %d))" % result["settings"]["slots"])
    ax.set_ylabel("output tok/s vs base")
    ax.set_title(result["title"], fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(directory / f"plan_{result['slug']}_adapters.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, kind in zip(axes, ("mixed", "long")):
        for tpot_ms, style in ((25.0, "-"), (10.0, "--")):
            rows = [r for r in result["sloweave"] if r["workload"] == kind and r["tpot_ms"] == tpot_ms]
            ax.plot([r["load"] for r in rows], [r["sloweave_vs_best"] or 0 for r in rows], style, marker="o",
                    label=f"TPOT {tpot_ms:g} ms")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(f"{kind}: SLOWeave goodput / best fixed chunk", fontsize=9)
        ax.set_xlabel("load (fraction of capacity)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(result["title"], fontsize=9)
    fig.tight_layout()
    paths.append(directory / f"plan_{result['slug']}_sloweave.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for variant, style in (("shared", "-"), ("no-sharing", "--")):
        rows = [r for r in result["feather"] if r["workload"] == variant]
        for order, marker in (("feather", "o"), ("lpm", "s")):
            ax.plot([r["cache_blocks"] / r["working_set_blocks"] for r in rows], [r[f"{order}_vs_fcfs"] for r in rows],
                    style, marker=marker, label=f"{order}, {variant}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prefix cache / the shared groups' prefixes (rightmost: what the GPU holds)")
    ax.set_ylabel("output tok/s vs FCFS")
    ax.set_title(result["title"], fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(directory / f"plan_{result['slug']}_feather.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    stages = sorted({r["stages"] for r in result["wavepp"]})
    fig, axes = plt.subplots(1, len(stages), figsize=(5 * len(stages), 3.6), sharey=True)
    for ax, count in zip(axes if len(stages) > 1 else [axes], stages):
        for prompt in sorted({r["prompt"] for r in result["wavepp"]}):
            for cached, style in ((False, "-"), (True, "--")):
                rows = [r for r in result["wavepp"] if r["stages"] == count and r["prompt"] == prompt
                        and bool(r["cached"]) == cached]
                ax.plot([r["handoff_ms"] for r in rows], [r["wavepp_vs_best"] for r in rows], style, marker="o",
                        label=f"{prompt // 1024}k, {'half' if cached else 'none'} cached")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(f"S = {count}: TTFT best fixed chunk / WavePP", fontsize=9)
        ax.set_xlabel("stage hand-off (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(result["title"], fontsize=9)
    fig.tight_layout()
    paths.append(directory / f"plan_{result['slug']}_wavepp.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def markdown(result: dict) -> str:
    lines = [f"## The GPU regime in simulation: {result['title']} (`preft eval plan`)\n",
             f"Command: `{result['command']}`. **Simulated**, not measured: a roofline step cost "
             f"(`serving/scheduling/roofline.py`; {result['hardware_source']}) through the engine's simulator and "
             f"policy objects, vLLM's GPU defaults (256 running requests, 8192 tokens a step).\n",
             *published_markdown(result["published"]),
             f"![adapters](plan_{result['slug']}_adapters.png)\n",
             f"**Adapters** (the `mixed` workload at twice the base model's capacity, {result['settings']['requests']} "
             f"requests; request i on adapter i % N; paper: {PAPER['adapters']}):\n",
             "| adapter | N | slots | PreFT vs base | all-token vs base | PreFT vs all-token |", "|---|---|---|---|---|---|"]
    for r in result["adapters"]:
        lines.append(f"| {r['adapter']} | {r['adapters']} | {r['slots']} | {r['preft_vs_base']:.2f}x | "
                     f"{r['all-token_tok_s'] / r['base_tok_s']:.2f}x | {r['preft_vs_all_token']:.2f}x |")
    lines += ["", f"![sloweave](plan_{result['slug']}_sloweave.png)\n",
              f"**SLOWeave** (goodput over the best of {', '.join(FIXED)}; paper: {PAPER['sloweave']}):\n",
              "| workload | TPOT | load | capacity (req/s) | best fixed | SLOWeave vs best | SLOWeave vs vLLM's default |",
              "|---|---|---|---|---|---|---|"]
    for r in result["sloweave"]:
        ratio = f"{r['sloweave_vs_best']:.2f}x" if r["sloweave_vs_best"] else "- (no goodput)"
        default = f"{r['sloweave_vs_default']:.2f}x" if r["sloweave_vs_default"] else "- (default: none)"
        lines.append(f"| {r['workload']} | {r['tpot_ms']:g} ms | {r['load']:g} | {r['capacity']:.1f} | "
                     f"{r['best_fixed']} | {ratio} | {default} |")
    lines += ["", f"![feather](plan_{result['slug']}_feather.png)\n",
              f"**Feather** (output tokens/s over FCFS, {result['settings']['requests']} requests offered at once, 20 "
              f"prefix groups of 40-70% of the context, whose prefixes take {result['feather'][0]['working_set_blocks']} "
              f"blocks of 128 tokens (the working set); the cache in multiples of it, and what the GPU holds beside the "
              f"weights; paper: {PAPER['feather']}):\n",
              "| workload | prefix cache (blocks) | LPM vs FCFS | Feather vs FCFS |", "|---|---|---|---|"]
    for r in result["feather"]:
        lines.append(f"| {r['workload']} | {r['cache']} ({r['cache_blocks']}) | {r['lpm_vs_fcfs']:.2f}x | "
                     f"{r['feather_vs_fcfs']:.2f}x |")
    lines += ["", f"![wavepp](plan_{result['slug']}_wavepp.png)\n",
              f"**WavePP** (TTFT of one prompt through S pipeline stages, best of fixed chunks "
              f"{', '.join(map(str, PIPELINE['fixed']))} over WavePP; the bubbles the best fixed chunk leaves bound what "
              f"any chunking recovers; paper: {PAPER['wavepp']}):\n",
              "| S | hand-off | prompt | cached | best fixed | its bubbles | WavePP chunks | WavePP vs best | "
              "planned on the 8-term fit |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["wavepp"]:
        lines.append(f"| {r['stages']} | {r['handoff_ms']:g} ms | {r['prompt']} | {r['cached']} | {r['best_fixed']} | "
                     f"{100 * r['best_fixed_bubble']:.1f}% | {r['wavepp_chunks']} | {r['wavepp_vs_best']:.2f}x | "
                     f"{r['wavepp_fitted_vs_best']:.2f}x |")
    return "\n".join(lines) + "\n"


def published_markdown(rows: list[dict]) -> list[str]:
    lines = ["**The roofline against published step times** (vLLM `bench serve` sweeps, closed loop, bf16; the time per "
             "output token at a fixed concurrency; a fit is within 25%):\n",
             "| model | GPU | decodes | measured | roofline | error | source |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['hardware']} | {r['decodes']} | {r['measured_ms']:.2f} ms | "
                     f"{r['predicted_ms']:.2f} ms | {100 * r['error']:+.0f}% | {r['source']} |")
    return lines + [""]


def main(hardware: str = "H100", model: str = "llama-3.1-8b", tp: int = 1, adapters: str = "1,64,512",
         slots: int = 16, requests: int = 1000, max_len: int = 4096, pipeline_prompts: str = "8192,32768",
         out: str = "runs/eval") -> dict[str, Any]:
    import inspect

    from preft.eval.common import parse_list
    from preft.eval.results import command_line
    from preft.serving.scheduling.roofline import check_published

    arguments = dict(locals())
    values = {name: arguments[name] for name in inspect.signature(main).parameters}
    started = time.time()
    counts = parse_list(adapters, int, "adapters")
    long_prompts = parse_list(pipeline_prompts, int, "pipeline-prompts")
    if min(counts) < 1 or slots < 1 or requests < 50 or tp < 1 or max_len < 256 or min(long_prompts) < 2:
        raise ValueError("--adapters and --slots must be >= 1, --requests >= 50, --tp >= 1, --max-len >= 256, "
                         "--pipeline-prompts >= 2")
    cost_model = roofline(hardware, model, tp)  # a bad name fails before anything runs
    title = cost_model.source
    result: dict[str, Any] = {"command": command_line("plan", main, values, always=("hardware", "model")),
                              "title": title, "slug": slug(cost_model), "hardware_source": cost_model.hardware.source or "measured",
                              "roofline": cost_model.to_json(),
                              "settings": {"requests": requests, "slots": slots, "max_len": max_len, **ENGINE},
                              "paper": PAPER, "published": check_published()}
    result["adapters"] = adapters_part(hardware, model, tp, counts, slots, requests, max_len)
    result["sloweave"] = sloweave_part(hardware, model, tp, requests, max_len)
    result["feather"] = feather_part(hardware, model, tp, requests, max_len)
    result["wavepp"] = wavepp_part(hardware, model, tp, long_prompts)
    directory = Path(out) / f"plan_{result['slug']}"
    directory.mkdir(parents=True, exist_ok=True)
    figures = plot(result, directory)
    result["wall_time_s"] = round(time.time() - started, 1)
    result["sloweave_best"] = {f"{kind}@{tpot:g}": max((r["sloweave_vs_best"] or 0) for r in result["sloweave"]
                                                       if r["workload"] == kind and r["tpot_ms"] == tpot)
                               for kind in ("mixed", "long") for tpot in (25.0, 10.0)}
    save_run(directory, "plan", result, markdown(result), also=tuple(figures))
    return result


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    add_flags(parser, main, [
        ("--hardware", str, "GPU preset: A100, A100-40GB, L4, H100, H200, H200-measured"),
        ("--model", str, "model preset (llama-3.1-8b, llama-3.1-70b, qwen2.5-0.5b, qwen3-8b) or a local model "
                         "directory (its config.json)"),
        ("--tp", int, "tensor-parallel GPUs"),
        ("--adapters", str, "comma-separated adapter counts"),
        ("--slots", int, "adapter slots (each count runs on min(N, slots))"),
        ("--requests", int, "requests per simulated run"),
        ("--max-len", int, "the longest prompt + output (the workloads' lengths scale with it)"),
        ("--pipeline-prompts", str, "comma-separated prompt lengths of the WavePP part"),
        ("--out", str, "results directory"),
    ])
