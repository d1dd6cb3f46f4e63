"""`preft eval pipeline`: WavePP chunk sizing against fixed chunks for pipeline-parallel prefill,
in the pipeline simulator and on the real engine at PP=2.

    preft eval pipeline [--model 512x8] [--cost-model FILE] [--stages 2,4,8]
                        [--prompts 2048,4096,8192,16384,32768] [--fixed 128,256,512,1024,2048]
                        [--min-chunk 16] [--engine-requests 40] [--no-engine] [--out runs/eval]

**Simulator** (:mod:`preft.serving.scheduling.pipeline_simulator`): the stage cost is the served
step cost model of ``--model`` with no decodes, divided over ``S`` stages
(:class:`~preft.serving.scheduling.wavepp.StageCost`). For each ``S``, prompt length and cached
share (none, or half the prompt: a prefix-cache hit), one prompt's TTFT under every fixed chunk
and under WavePP; the ratio is against the best fixed chunk for that case. Then a stream (20 of
the longest prompts, half cached, queued at once): bubble fraction and prefill throughput. The
cost model was fitted on this machine's steps of at most 512 context tokens; longer prompts
extrapolate it (the form is the same, the coefficients are not measured there).

**Engine** (PP=2 on this machine's 2 cores): ``preft serve --pipeline-parallel-size 2
--scheduler fixed:C`` and ``--scheduler wavepp``, driven by ``vllm bench serve --dataset-name
timed_trace`` with long prompts (``--model``'s context) whose first half is one shared prefix,
arriving slowly enough that prompts do not queue (TTFT is the prefill's own). The simulator's
prediction for the same prompts is beside.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any


def _parse(text: str, kind, name: str) -> list:
    from preft.eval.common import parse_list

    return parse_list(str(text), kind, name)


def simulate_cases(cost_model, stages: list[int], prompts: list[int], fixed: list[int], min_chunk: int,
                   max_chunk: int) -> list[dict]:
    from preft.serving.scheduling.pipeline_simulator import FixedPrefillChunk, LongPrompt, simulate_pipeline
    from preft.serving.scheduling.wavepp import StageCost, WavePP

    rows = []
    for count in stages:
        stage_cost = StageCost(cost_model, count)
        for prompt in prompts:
            for cached in (0, prompt // 2):
                case = [LongPrompt("p", 0.0, prompt, cached)]
                fixed_ttft = {size: simulate_pipeline(case, FixedPrefillChunk(size), stage_cost, count).ttft_s["p"]
                              for size in fixed}
                wave = simulate_pipeline(case, WavePP(stage_cost, min_chunk, max_chunk), stage_cost, count)
                best = min(fixed_ttft, key=fixed_ttft.get)
                rows.append({"stages": count, "prompt": prompt, "cached": cached, "fixed_ttft_s": fixed_ttft,
                             "best_fixed": best, "wavepp_ttft_s": wave.ttft_s["p"], "wavepp_chunks": wave.chunks["p"],
                             "speedup": fixed_ttft[best] / wave.ttft_s["p"],
                             "wavepp_bubble": wave.bubble_fraction})
    return rows


def simulate_streams(cost_model, stages: list[int], prompt: int, fixed: list[int], min_chunk: int,
                     max_chunk: int) -> list[dict]:
    from preft.serving.scheduling.pipeline_simulator import FixedPrefillChunk, LongPrompt, simulate_pipeline
    from preft.serving.scheduling.wavepp import StageCost, WavePP

    rows = []
    for count in stages:
        stage_cost = StageCost(cost_model, count)
        stream = [LongPrompt(str(i), 0.0, prompt, prompt // 2) for i in range(20)]
        results = {f"fixed:{size}": simulate_pipeline(stream, FixedPrefillChunk(size), stage_cost, count)
                   for size in fixed}
        results["wavepp"] = simulate_pipeline(stream, WavePP(stage_cost, min_chunk, max_chunk), stage_cost, count)
        for name, result in results.items():
            rows.append({"stages": count, "policy": name, "bubble": result.bubble_fraction,
                         "tokens_per_s": result.prefill_tokens_per_s,
                         "mean_ttft_s": statistics.mean(result.ttft_s.values())})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = sorted({r["stages"] for r in rows})
    fig, axes = plt.subplots(1, len(stages), figsize=(3.6 * len(stages), 3.4), sharey=True)
    for ax, count in zip(axes if len(stages) > 1 else [axes], stages):
        for cached, style in ((False, "o-"), (True, "s--")):
            chosen = [r for r in rows if r["stages"] == count and bool(r["cached"]) == cached]
            ax.plot([r["prompt"] for r in chosen], [r["speedup"] for r in chosen], style,
                    label="half cached" if cached else "nothing cached")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"S = {count}", fontsize=10)
        ax.set_xlabel("prompt tokens")
    (axes[0] if len(stages) > 1 else axes).set_ylabel("TTFT: best fixed chunk / WavePP")
    (axes[0] if len(stages) > 1 else axes).legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(model: str = "512x8", cost_model: str | None = None, stages: str = "2,4,8",
         prompts: str = "2048,4096,8192,16384,32768", fixed: str = "128,256,512,1024,2048", min_chunk: int = 16,
         engine: bool = True, engine_requests: int = 40, out: str = "runs/eval") -> dict[str, Any]:
    import inspect

    from preft.eval import common

    from preft.eval import profile as eval_profile
    from preft.eval.results import command_line, save_run
    from preft.serving.scheduling.cost_model import StepCostModel

    arguments = dict(locals())
    values = {name: arguments[name] for name in inspect.signature(main).parameters}
    started = time.time()
    stage_list, prompt_list = _parse(stages, int, "stages"), _parse(prompts, int, "prompts")
    fixed_list = _parse(fixed, int, "fixed")
    if min(stage_list) < 1 or min(prompt_list) < 2 or min(fixed_list) < 1 or min_chunk < 1 or engine_requests < 1:
        raise ValueError("--stages, --fixed, --min-chunk and --engine-requests must be >= 1, --prompts >= 2")
    pipeline_dir = Path(out) / "pipeline"
    pipeline_dir.mkdir(parents=True, exist_ok=True)
    model_dir = common.model_dir(model, Path(out) / "profile")
    if cost_model is None:
        cost_model = eval_profile.served_cost_model(model, model_dir, out, "pipeline")
    model_cost = StepCostModel.load(cost_model)
    max_chunk = max(fixed_list)
    print("[pipeline] simulator: single prompts", flush=True)
    cases = simulate_cases(model_cost, stage_list, prompt_list, fixed_list, min_chunk, max_chunk)
    print("[pipeline] simulator: streams", flush=True)
    streams = simulate_streams(model_cost, stage_list, max(prompt_list), fixed_list, min_chunk, max_chunk)
    plot(cases, pipeline_dir / "pipeline_sim.png")
    result: dict[str, Any] = {"command": command_line("pipeline", main, values), "machine": common.machine(),
                              "cost_model": cost_model, "cases": cases, "streams": streams}
    lines = ["## Pipeline-parallel prefill: WavePP vs fixed chunks (`preft eval pipeline`)\n",
             f"Command: `{result['command']}` ({result['machine']}); stage cost = the served step cost model "
             f"`{Path(cost_model).name}` with no decodes, over S stages (fitted on contexts up to 512 tokens, "
             f"extrapolated beyond).\n", "![WavePP vs the best fixed chunk](pipeline_sim.png)\n",
             "**One long prompt, simulator**: TTFT of the best fixed chunk and of WavePP (s), and their ratio:\n",
             "| S | prompt | cached | best fixed | its TTFT | WavePP TTFT | best fixed / WavePP | WavePP chunks | "
             "WavePP bubble |", "|---|---|---|---|---|---|---|---|---|"]
    for r in cases:
        chunks = r["wavepp_chunks"]
        lines.append(f"| {r['stages']} | {r['prompt']} | {r['cached']} | {r['best_fixed']} | "
                     f"{r['fixed_ttft_s'][r['best_fixed']]:.2f} | {r['wavepp_ttft_s']:.2f} | {r['speedup']:.3f}x | "
                     f"{len(chunks)}: {chunks[0]}…{chunks[-1]} | {r['wavepp_bubble']:.1%} |")
    lines += ["", f"**A stream of 20 prompts of {max(prompt_list)} tokens, half cached, queued at once, simulator**:\n",
              "| S | policy | bubble fraction | prefill tokens/s | mean TTFT (s) |", "|---|---|---|---|---|"]
    for r in streams:
        lines.append(f"| {r['stages']} | {r['policy']} | {r['bubble']:.1%} | {r['tokens_per_s']:.0f} | "
                     f"{r['mean_ttft_s']:.1f} |")
    lines.append("")
    if engine:
        from preft.eval.pipeline_engine import engine_comparison

        result["engine"] = engine_comparison(model_cost, cost_model, model_dir, engine_requests, min_chunk,
                                             pipeline_dir)
        lines += result["engine"]["markdown"]
    result["wall_time_s"] = round(time.time() - started, 1)
    save_run(pipeline_dir, "pipeline", result, "\n".join(lines))
    return result


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    add_flags(parser, main, [
        ("--model", str, "base model: '512x8' (a random-init 27M Llama built here), 'default' or a local directory"),
        ("--cost-model", str, "step cost model JSON (default: OUT/profile/cost_model_MODEL_served.json)"),
        ("--stages", str, "comma-separated pipeline depths S (simulator)"),
        ("--prompts", str, "comma-separated prompt lengths (simulator)"),
        ("--fixed", str, "comma-separated fixed chunk sizes WavePP is compared with"),
        ("--min-chunk", int, "WavePP's smallest chunk"),
        ("--engine", bool, "run PP=2 on the real engine too"),
        ("--engine-requests", int, "long prompts per engine run"),
        ("--out", str, "results directory"),
    ])
