"""The engine half of `preft eval pipeline`: PP=2 on this machine, fixed chunks vs WavePP.

Each policy gets its own ``preft serve --pipeline-parallel-size 2 --scheduler P`` and the same
``timed_trace``: long prompts (the model's context less a few output tokens) whose first half is
one shared prefix, so every request after the first has a prefix-cache hit of whole 128-token
blocks, arriving one at a time (spaced at twice the slowest predicted TTFT) so that TTFT is the
prefill's own. The pipeline simulator predicts the same prompts with the same cached share.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

FIXED = (64, 128, 256)
OUTPUT_TOKENS = 4
BLOCK_TOKENS = 128


def engine_comparison(cost_model, cost_model_path: str, model_dir: str, requests: int, min_chunk: int,
                      out: Path) -> dict[str, Any]:
    from transformers import AutoConfig

    from preft.eval.common import serve_trace
    from preft.serving.scheduling import workloads
    from preft.serving.scheduling.pipeline_simulator import FixedPrefillChunk, LongPrompt, simulate_pipeline
    from preft.serving.scheduling.wavepp import StageCost, WavePP

    max_len = AutoConfig.from_pretrained(model_dir).max_position_embeddings
    prompt = max_len - OUTPUT_TOKENS - 8
    shared = prompt // 2
    cached = shared // BLOCK_TOKENS * BLOCK_TOKENS
    stage_cost = StageCost(cost_model, 2)
    policies = {f"fixed:{size}": FixedPrefillChunk(size) for size in FIXED}
    policies["wavepp"] = WavePP(stage_cost, min_chunk, max(FIXED) * 4)
    predicted = {}
    for name, policy in policies.items():
        first = simulate_pipeline([LongPrompt("first", 0.0, prompt)], policy, stage_cost, 2).ttft_s["first"]
        later = simulate_pipeline([LongPrompt("later", 0.0, prompt, cached)], policy, stage_cost, 2).ttft_s["later"]
        predicted[name] = {"first_s": first, "cached_s": later}
    spacing = 2 * max(max(p.values()) for p in predicted.values()) + 0.5
    work = [workloads.RequestSpec(f"pp-{i}", round(i * spacing, 6), prompt, OUTPUT_TOKENS, prefix_group=0,
                                  prefix_tokens=shared) for i in range(requests)]
    engine_dir = out / "engine"
    trace = workloads.write_trace(work, engine_dir / "long_prompts.trace.jsonl")
    settings = {"max_len": max_len, "max_num_seqs": 8, "max_num_batched_tokens": max(FIXED) * 4 + 256}
    rows = []
    for name in policies:
        args = ["--pipeline-parallel-size", "2", "--scheduler", name]
        if name == "wavepp":
            args += ["--cost-model", cost_model_path, "--min-chunk", str(min_chunk), "--max-chunk",
                     str(max(FIXED) * 4)]
        print(f"[pipeline] engine PP=2 {name}: {requests} prompts of {prompt} tokens", flush=True)
        timings, steps = serve_trace(model_dir, args, trace, name.replace(":", "-"), engine_dir, settings)
        ttfts = sorted(timings, key=lambda t: t.arrival_s)
        later = [t.ttft_s for t in ttfts[1:]]  # the first has no cached prefix
        rows.append({"policy": name, "requests": len(timings), "engine_ttft_s": statistics.median(later),
                     "engine_ttft_p90_s": sorted(later)[int(0.9 * (len(later) - 1))],
                     "predicted_ttft_s": predicted[name]["cached_s"],
                     "max_chunk_seen": max((s["c"] for s in steps), default=0)})
    best_fixed = min((r for r in rows if r["policy"] != "wavepp"), key=lambda r: r["engine_ttft_s"])
    wave = next(r for r in rows if r["policy"] == "wavepp")
    best_predicted = min((r for r in rows if r["policy"] != "wavepp"), key=lambda r: r["predicted_ttft_s"])
    summary = {"engine_ratio": best_fixed["engine_ttft_s"] / wave["engine_ttft_s"],
               "predicted_ratio": best_predicted["predicted_ttft_s"] / wave["predicted_ttft_s"],
               "best_fixed_engine": best_fixed["policy"], "best_fixed_predicted": best_predicted["policy"]}
    markdown = [f"**Real engine, PP=2** (`preft serve --pipeline-parallel-size 2 --scheduler P`, {requests} prompts "
                f"of {prompt} tokens, the first {shared} shared ({cached} cached after the first), one at a time "
                f"every {spacing:.1f} s through `vllm bench serve --dataset-name timed_trace`; TTFT of the cached "
                f"requests, median and p90, with the simulator's prediction):\n",
                "| policy | engine TTFT p50 (ms) | engine TTFT p90 (ms) | simulator TTFT (ms) |", "|---|---|---|---|"]
    for r in rows:
        markdown.append(f"| {r['policy']} | {1e3 * r['engine_ttft_s']:.0f} | {1e3 * r['engine_ttft_p90_s']:.0f} | "
                        f"{1e3 * r['predicted_ttft_s']:.0f} |")
    markdown += ["", f"Best fixed chunk / WavePP TTFT: engine {summary['engine_ratio']:.3f}x (best fixed "
                     f"{summary['best_fixed_engine']}), simulator {summary['predicted_ratio']:.3f}x (best fixed "
                     f"{summary['best_fixed_predicted']}).\n"]
    return {"rows": rows, "predicted": predicted, "summary": summary, "prompt_tokens": prompt,
            "cached_tokens": cached, "spacing_s": spacing, "markdown": markdown}
