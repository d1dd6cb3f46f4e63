"""`preft eval profile`: measure engine steps on the real engine and fit the step cost model.

    preft eval profile [--model default|512x8|DIR] [--decodes 0,1,2,4,8,16,32]
                       [--chunks 16,32,64,128,256,448] [--repeats 2] [--served] [--out runs/eval]

One vLLM engine (PreFT's scheduler, float32, eager, prefix caching off so every token is
computed) runs in a child process with its engine core in-process, so the profile sets the
scheduler's chunk policy itself. For each decode count ``n`` it starts ``n`` long-running
requests and, once they decode, prefills one prompt of random tokens with a fixed chunk ``c``
for each ``c`` of ``--chunks``: the prompt's chunks run beside the ``n`` decodes with context
growing chunk by chunk, then two decode-only steps. The scheduler records every step's shape
``(n, c, x)`` and time (``PREFT_STEP_TRACE``), and
:meth:`~preft.serving.scheduling.cost_model.StepCostModel.fit` fits ``T(n, c, x)`` on them.

Error is reported on held-out shapes: every fourth ``(n, c)`` cell of the grid is left out of
the fit and predicted (median and p95 relative error). Written to ``OUT/profile/``:
``cost_model_<model>.json`` (``preft serve --cost-model``, the simulator), ``steps_<model>.json``
(every measured step), ``profile_<model>.md`` and ``profile_<model>.png`` (measured vs
predicted).

``--served`` then calibrates where the model is used: a real ``preft serve`` (chunk sizes
cycling through ``--chunks``, :class:`~preft.serving.scheduling.chunk_policies.CyclingChunk`)
under a bursty ``vllm bench serve`` load, its steps traced. On 2 cores the API server and the
load generator take CPU from the engine, so served steps are slower than the engine's alone;
this model (``cost_model_<model>_served.json``, held-out error on every fourth step) is the one
to give ``preft serve --scheduler sloweave --cost-model``.
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

from preft.eval import common
from preft.eval.results import save_run

HELD_OUT_EVERY = 4
WARMUP_STEPS = 8


def _child(spec_path: str) -> None:
    """The engine process: run the grid and write the phase of each step beside the trace."""
    import random

    from vllm import LLM, SamplingParams

    from preft.serving import SCHEDULER_CLS
    from preft.serving.scheduling.chunk_policies import FixedChunk, VllmDefault

    spec = json.loads(Path(spec_path).read_text())
    decodes, chunks, repeats, max_len = spec["decodes"], spec["chunks"], spec["repeats"], spec["max_model_len"]
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=max_len, seed=0,
              max_num_seqs=max(decodes) + 2, max_num_batched_tokens=max(chunks) + max(decodes) + 16,
              enable_prefix_caching=False, scheduler_cls=SCHEDULER_CLS)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # in-process engine core (the parent's env)
    trace = Path(spec["trace"])
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    phases: list[dict[str, Any]] = []
    counter = iter(range(1 << 30))

    def run_until(done, phase) -> None:
        while True:
            before = trace.read_text().count("\n") if trace.exists() else 0
            outputs = engine.step()
            after = trace.read_text().count("\n") if trace.exists() else 0
            phases.extend([phase] * (after - before))
            if done(outputs):
                return

    def add(prompt_len: int, max_tokens: int) -> str:
        request_id = f"r{next(counter)}"
        prompt = {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]}
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))
        return request_id

    for n in decodes:
        scheduler.chunk_policy = VllmDefault()
        decoders = [add(16, max_len - 17) for _ in range(n)]
        if decoders:  # until every decoder has its first token
            started: set[str] = set()

            def all_started(outputs) -> bool:
                started.update(o.request_id for o in outputs if o.outputs and o.outputs[0].token_ids)
                return started >= set(decoders)

            run_until(all_started, None)
        for repeat in range(repeats):
            for c in chunks:
                scheduler.chunk_policy = FixedChunk(c)
                prompt_len = max(c, (max_len - 24) // c * c)
                target = add(prompt_len, 1)
                run_until(lambda outs: any(o.request_id == target and o.finished for o in outs),
                          {"n": n, "chunk": c, "repeat": repeat})
                if decoders:
                    for _ in range(2):
                        run_until(lambda outs: True, {"n": n, "chunk": 0, "repeat": repeat})
            print(f"[profile] decodes {n}: repeat {repeat + 1}/{repeats} done", file=sys.stderr, flush=True)
        if decoders:
            engine.abort_request(decoders)
            scheduler.chunk_policy = VllmDefault()
            while engine.has_unfinished_requests():
                engine.step()
    Path(spec["phases"]).write_text(json.dumps(phases))


def served_cost_model(model: str, model_dir: str, out: str | Path, tag: str) -> str:
    """``OUT/profile/cost_model_MODEL_served.json``, the cost model calibrated on a served engine
    under load; profiled first (``preft eval profile --served``) when it is missing."""
    name = model if model in ("default", "512x8") else Path(model_dir).name
    path = Path(out) / "profile" / f"cost_model_{name}_served.json"
    if not path.is_file():
        print(f"[{tag}] no served cost model for {model} yet: profiling it first", flush=True)
        main(model=model, served=True, out=str(out))
    return str(path)


def plot(steps: list[dict], cost_model, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 5.0))
    for held, colour, label in ((False, "tab:blue", "fitted on"), (True, "tab:orange", "held-out shapes")):
        chosen = [s for s in steps if s["held_out"] == held]
        ax.scatter([1e3 * s["seconds"] for s in chosen], [1e3 * cost_model(s["n"], s["c"], s["x"]) for s in chosen],
                   s=9, alpha=0.6, color=colour, label=f"{label} ({len(chosen)} steps)")
    low = min(1e3 * s["seconds"] for s in steps)
    high = max(1e3 * s["seconds"] for s in steps)
    ax.plot([low, high], [low, high], color="grey", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):  # decade labels only: the minor ones collide
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted T(n, c, x) (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fit_and_report(steps: list[dict], gaps: list[float], held_description: str, label: str, file_stem: str,
                   profile_dir: Path, command: str, extra: dict) -> dict[str, Any]:
    """Fit on the steps not held out, measure the error on the held-out ones, then fit the model
    that is kept on every step; write the model, the steps, the plot and the section."""
    from preft.serving.scheduling.cost_model import StepCostModel
    from preft.serving.scheduling.metrics import percentile

    fitted_on = [s for s in steps if not s["held_out"]]
    held = [s for s in steps if s["held_out"]]
    gap_s = statistics.median(gaps) if gaps else 0.0

    def shapes(rows):
        return [(s["n"], s["c"], s["x"]) for s in rows]

    check = StepCostModel.fit(shapes(fitted_on), [s["seconds"] for s in fitted_on])
    errors = check.relative_errors(shapes(held), [s["seconds"] for s in held])
    # the model served and simulated is fitted on every step; its error is the held-out one above
    cost_model = StepCostModel.fit(shapes(steps), [s["seconds"] for s in steps], source=f"preft eval profile ({label})",
                                   meta={"label": label, "gap_s": gap_s, "steps": len(steps),
                                         "held_out_median_relative_error": statistics.median(errors),
                                         "held_out_p95_relative_error": percentile(errors, 95)})
    model_path = cost_model.save(profile_dir / f"cost_model_{file_stem}.json")
    result = {"command": command, "label": label, "machine": common.machine(), "steps": len(steps),
              "held_out_steps": len(held), "median_relative_error": statistics.median(errors),
              "p95_relative_error": percentile(errors, 95), "gap_ms": 1e3 * gap_s,
              "cost_model": cost_model.to_json(), "cost_model_path": str(model_path), **extra}
    (profile_dir / f"steps_{file_stem}.json").write_text(json.dumps(steps) + "\n")
    plot(steps, check, profile_dir / f"profile_{file_stem}.png",
         f"{label}: step time, measured vs fitted (held-out median error {result['median_relative_error']:.0%})")
    weights = ", ".join(f"{f}: {1e3 * w:.4g}" for f, w in zip(cost_model.to_json()["features"], cost_model.weights))
    markdown = (f"## Step cost model: {label}\n\n![profile](profile_{file_stem}.png)\n\n"
                f"Command: `{command}` ({result['machine']}). {len(steps)} measured steps; {len(held)} of them "
                f"held out ({held_description}) and predicted by a fit on the rest: relative error median "
                f"{result['median_relative_error']:.1%}, p95 {result['p95_relative_error']:.1%}. Between steps the "
                f"engine spends a median {result['gap_ms']:.2f} ms (the simulator adds it).\n\n"
                f"Weights (ms per unit): {weights}.\n")
    save_run(profile_dir, f"profile_{file_stem}", result, markdown, json_name=f"profile_{file_stem}.json",
             also=(model_path, profile_dir / f"profile_{file_stem}.png"))
    return result


def served_steps(model_dir: str, offline, chunk_list: list[int], max_len: int, requests: int,
                 work_dir: Path) -> tuple[list[dict], list[float], float]:
    """A served engine's steps under load: ``preft serve --scheduler cycle:CHUNKS`` driven by
    ``vllm bench serve`` with a bursty timed trace at the offline model's capacity (busy and
    idle stretches: many batch sizes and contexts). ``(steps, gaps, rate)``."""
    from preft.serving.scheduling import workloads

    settings = {"max_len": max_len, "max_num_seqs": 64, "max_chunk": 2048, "max_num_batched_tokens": 2048 + 256,
                "probe_requests": 600}
    # at the engine-alone capacity a served engine is overloaded in the bursts and idle between
    # them: its steps cover small and large batches and long contexts, as serving near capacity does
    rate = common.capacity(offline, "bursty", settings)
    trace = workloads.write_trace(workloads.generate("bursty", requests, rate, seed=7, max_model_len=max_len),
                                  work_dir / "calibration.trace.jsonl")
    print(f"[profile] served: {requests} bursty requests at {rate:.1f} req/s through preft serve "
          f"--scheduler cycle:{','.join(map(str, chunk_list))}", flush=True)
    policy = ["--scheduler", "cycle:" + ",".join(map(str, chunk_list))]
    _, steps = common.serve_trace(model_dir, policy, trace, "calibration", work_dir, settings)
    gaps = [s["gap_s"] for s in steps if s.get("gap_s") is not None]
    kept = [{**s, "held_out": index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1}
            for index, s in enumerate(steps) if s["seconds"] > 0 and (s["n"] or s["c"])]
    return kept, gaps, rate


def main(model: str = "default", decodes: str = "0,1,2,4,8,16,32", chunks: str = "16,32,64,128,256,448",
         repeats: int = 2, served: bool = False, served_requests: int = 400, out: str = "runs/eval") -> dict[str, Any]:
    from transformers import AutoConfig

    from preft.eval.common import parse_list
    from preft.eval.results import command_line
    from preft.serving.scheduling.cost_model import StepCostModel

    started = time.time()
    decode_list, chunk_list = parse_list(decodes, int, "decodes"), parse_list(chunks, int, "chunks")
    if any(n < 0 for n in decode_list) or any(c < 1 for c in chunk_list) or repeats < 1 or served_requests < 10:
        raise ValueError("--decodes must be >= 0, --chunks and --repeats >= 1, --served-requests >= 10")
    profile_dir = Path(out) / "profile"
    profile_dir.mkdir(parents=True, exist_ok=True)
    model_dir = common.model_dir(model, profile_dir)
    max_len = AutoConfig.from_pretrained(model_dir).max_position_embeddings
    if max(chunk_list) > max_len - 24:
        raise ValueError(f"--chunks: {max(chunk_list)} does not fit the model's context of {max_len} tokens")
    name = Path(model_dir).name if model not in ("default", "512x8") else model
    work = profile_dir / f"work_{name}"
    work.mkdir(exist_ok=True)
    trace, phases_path = work / "steps.jsonl", work / "phases.json"
    trace.unlink(missing_ok=True)
    spec = {"model": model_dir, "decodes": decode_list, "chunks": chunk_list, "repeats": repeats,
            "max_model_len": max_len, "trace": str(trace), "phases": str(phases_path)}
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PREFT_STEP_TRACE": str(trace),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    env.pop("PREFT_SCHEDULER", None)
    print(f"[profile] {model}: {len(decode_list)} decode counts x {len(chunk_list)} chunks x {repeats} repeats "
          f"(engine log: {work / 'engine.log'})", flush=True)
    with open(work / "engine.log", "w") as log:
        child = subprocess.run([sys.executable, "-m", "preft.eval.profile", "--child", str(work / "spec.json")],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    if child.returncode != 0:
        raise RuntimeError(f"the profiling engine failed (exit {child.returncode}); see {work / 'engine.log'}")

    phases = json.loads(phases_path.read_text())
    measured = [json.loads(line) for line in trace.read_text().splitlines()]
    cells = sorted({(p["n"], p["chunk"]) for p in phases if p})
    held_cells = set(cells[HELD_OUT_EVERY - 1::HELD_OUT_EVERY])
    steps = []
    for index, (step, phase) in enumerate(zip(measured, phases)):
        if phase is None or index < WARMUP_STEPS:
            continue
        steps.append({**step, "cell": [phase["n"], phase["chunk"]],
                      "held_out": (phase["n"], phase["chunk"]) in held_cells})
    gaps = [s["gap_s"] for s in measured if s.get("gap_s") is not None]
    command = command_line("profile", main, {"model": model, "decodes": decodes, "chunks": chunks,
                                             "repeats": repeats, "served": served,
                                             "served_requests": served_requests}, always=("model",))
    command = command.replace("--served True", "--served")
    result = fit_and_report(steps, gaps, f"the (n, c) cells {sorted(held_cells)}", f"{model}, the engine alone",
                            name, profile_dir, command, {"model": model, "held_out_cells": sorted(held_cells)})
    if served:
        offline = StepCostModel.load(result["cost_model_path"])
        calibration, served_gaps, rate = served_steps(model_dir, offline, chunk_list, max_len, served_requests, work)
        result["served"] = fit_and_report(
            calibration, served_gaps, "every fourth step", f"{model}, served under load", f"{name}_served",
            profile_dir, command, {"model": model, "rate": rate, "requests": served_requests,
                                   "offline_model_error_on_served_steps": statistics.median(
                                       offline.relative_errors([(s["n"], s["c"], s["x"]) for s in calibration],
                                                               [s["seconds"] for s in calibration]))})
    result["wall_time_s"] = round(time.time() - started, 1)
    return result


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    parser.add_argument("--served", action="store_true",
                        help="also calibrate on a served engine under load (preft serve + vllm bench serve; the API "
                             "server and the client share the CPU): cost_model_MODEL_served.json")
    add_flags(parser, main, [
        ("--model", str, "base model: 'default', '512x8' (a random-init 27M Llama built here) or a local directory"),
        ("--decodes", str, "comma-separated decode counts to profile"),
        ("--chunks", str, "comma-separated prefill chunk sizes to profile"),
        ("--repeats", int, "passes over the grid"),
        ("--served-requests", int, "requests in the --served calibration run"),
        ("--out", str, "results directory"),
    ])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(sys.argv[2])
