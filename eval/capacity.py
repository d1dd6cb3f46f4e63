"""`preft eval capacity`: a capacity planner for users, in simulation. For a model, a GPU, a
number of adapters, a workload and an SLO: how many requests a second one GPU serves within the
SLO for the base model, PreFT and all-token multi-adapter serving, with which chunk policy, and
how many adapters one GPU holds at a given rate per adapter.

    preft eval capacity --hardware H100 --model llama-3.1-8b --adapters 512 --workload mixed \\
        --ttft-ms 1000 --tpot-ms 25 --rate-per-adapter 0.02

The step cost is the roofline of ``preft eval plan`` (:mod:`preft.eval.plan`, simulation stated
as such), through the engine's simulator and policy objects with vLLM's GPU defaults. The
workload is a named one (:mod:`~preft.serving.scheduling.workloads`: chat, mixed, long, ...) or
a timed trace (``vllm bench serve``'s ``timed_trace`` JSON lines: ``timestamp``,
``input_length``, ``output_length``) whose arrivals are scaled to each rate tried. Request i
goes to adapter i % N; an adapter holds one of ``--slots`` slots while it is active (PreFT: to
the end of the prompt; all-token: to the last token).

- **SLO capacity** of a variant under a policy: the highest offered rate at which at least
  ``--attainment`` of the requests meet both TTFT and TPOT targets (bisection on the rate; the
  attainment falls with the rate). The policy used is the one with the highest capacity among
  vLLM's default chunking, fixed chunks and SLOWeave.
- **Adapters per GPU** (with ``--rate-per-adapter r``): the largest ``n`` such that ``n``
  adapters offering ``n · r`` req/s meet the SLO (bisection on ``n`` under the variant's
  policy); the base model's is its capacity over ``r``. GPUs for ``--adapters N``:
  ``ceil(N / n)``. Beside it, the host memory the ``n`` adapters' weights take (vLLM keeps the
  adapters not in a slot in host memory, ``--max-cpu-loras``); the planner does not limit ``n``
  by it.

Writes ``OUT/capacity/results.json`` and ``capacity.md``.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

POLICIES = ("default", "fixed:512", "fixed:2048", "sloweave")
VARIANTS = ("base", "preft", "all-token")
BISECTION_STEPS = 7
MAX_REQUESTS = 2000


def load_workload(workload: str, requests: int, max_len: int, ttft_s: float):
    """``rate -> [RequestSpec]``: a named workload drawn at that rate, or a trace with its arrivals
    scaled to it (its request count kept). A named workload spans at least ten TTFT targets
    (``requests`` or more, at most :data:`MAX_REQUESTS`): a run shorter than that would let an
    overloaded server drain its whole queue within the target and look as if it kept up."""
    from preft.serving.scheduling import workloads

    if Path(workload).is_file():
        trace = workloads.read_trace(workload)
        if len(trace) < 2:
            raise ValueError(f"--workload {workload}: a trace needs at least 2 requests, it has {len(trace)}")
        start = min(r.arrival_s for r in trace)
        span = max(r.arrival_s for r in trace) - start
        if span <= 0:
            raise ValueError(f"--workload {workload}: every request arrives at once, so there is no rate to scale")
        native = (len(trace) - 1) / span
        return lambda rate: [replace(r, request_id=str(i), arrival_s=(r.arrival_s - start) * native / rate,
                                     adapter=None) for i, r in enumerate(trace)]
    if workload not in workloads.KINDS:
        raise ValueError(f"--workload {workload!r}: a named workload ({', '.join(workloads.KINDS)}) or a trace file")
    return lambda rate: workloads.generate(workload, min(MAX_REQUESTS, max(requests, math.ceil(10 * ttft_s * rate))),
                                           rate, seed=11, max_model_len=max_len)


class Planner:
    """One model on one GPU, one workload, one SLO: :meth:`attainment` of a (variant, policy,
    adapters, rate), and the searches over it (module docstring)."""

    def __init__(self, cost_model, work_at, slots: int, ttft_s: float, tpot_s: float, target: float) -> None:
        self.cost_model, self.work_at, self.slots = cost_model, work_at, slots
        self.ttft_s, self.tpot_s, self.target = ttft_s, tpot_s, target
        self.simulations = 0

    def attainment(self, variant: str, policy_name: str, adapters: int, rate: float) -> float:
        from preft.eval.plan import ENGINE, on_adapters, simulate
        from preft.rule import ALL_TOKEN, AdapterRule
        from preft.serving.scheduling.chunk_policies import make_policy

        work, rules, slots = self.work_at(rate), {}, None
        if variant != "base":
            rule = AdapterRule(prefill_only=True) if variant == "preft" else ALL_TOKEN
            work, rules = on_adapters(work, adapters, rule)
            slots = min(adapters, self.slots)
        policy = make_policy(policy_name, cost_model=self.cost_model, tpot_s=self.tpot_s, max_chunk=ENGINE["max_chunk"])
        self.simulations += 1
        return simulate(self.cost_model, policy, work, rules, slots).summary(self.ttft_s, self.tpot_s)["slo_attainment"]

    def meets(self, variant: str, policy_name: str, adapters: int, rate: float) -> bool:
        return self.attainment(variant, policy_name, adapters, rate) >= self.target

    def capacity(self, variant: str, policy_name: str, adapters: int) -> float:
        """The highest rate (req/s) meeting the SLO, to 2^-BISECTION_STEPS of the bracket (0: none)."""
        low, high = 0.0, 1.0
        while self.meets(variant, policy_name, adapters, high):
            low, high = high, 2 * high
            if high > 1e6:
                raise ValueError("the SLO is met at every rate tried up to 1e6 req/s: check --ttft-ms / --tpot-ms")
        for _ in range(BISECTION_STEPS):
            middle = (low + high) / 2
            low, high = (middle, high) if self.meets(variant, policy_name, adapters, middle) else (low, middle)
        return low

    def adapters_per_gpu(self, variant: str, policy_name: str, rate_per_adapter: float) -> int:
        """The largest n whose n adapters at ``n · rate_per_adapter`` req/s meet the SLO (0: not one)."""
        if not self.meets(variant, policy_name, 1, rate_per_adapter):
            return 0
        low, high = 1, 2
        while self.meets(variant, policy_name, high, high * rate_per_adapter):
            low, high = high, 2 * high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self.meets(variant, policy_name, middle, middle * rate_per_adapter) \
                else (low, middle)
        return low


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"## Capacity plan: {result['title']} (`preft eval capacity`)\n",
             f"Command: `{result['command']}`. **Simulated** with the roofline step cost (not measured). Workload "
             f"`{s['workload']}`, {s['adapters']} adapters ({s['adapter']}) on {s['slots']} slots, SLO: TTFT "
             f"{s['ttft_ms']:g} ms and TPOT {s['tpot_ms']:g} ms for {100 * s['attainment']:.0f}% of requests.\n",
             "| variant | best chunk policy | SLO capacity (req/s) | vs base |"
             + (" adapters per GPU | their weights in host memory | GPUs for all |" if s["rate_per_adapter"] else ""),
             "|---|---|---|---|" + ("---|---|---|" if s["rate_per_adapter"] else "")]
    base = result["variants"]["base"]["capacity"]
    for name, row in result["variants"].items():
        line = (f"| {name} | {row['policy']} | {row['capacity']:.1f} | "
                f"{row['capacity'] / base:.2f}x |" if base else f"| {name} | {row['policy']} | {row['capacity']:.1f} | - |")
        if s["rate_per_adapter"]:
            memory = f"{row['adapters_per_gpu'] * s['adapter_bytes'] / 1e9:.1f} GB" if name != "base" else "-"
            line += f" {row['adapters_per_gpu']} | {memory} | {row['gpus'] if row['gpus'] is not None else '-'} |"
        lines.append(line)
    lines += ["", "Capacity by chunk policy (req/s): " + "; ".join(
        f"{name}: " + ", ".join(f"{p} {c:.1f}" for p, c in row["by_policy"].items())
        for name, row in result["variants"].items()), ""]
    lines.append(result["advice"])
    return "\n".join(lines) + "\n"


def main(hardware: str = "H100", model: str = "llama-3.1-8b", tp: int = 1, adapters: int = 512, slots: int = 16,
         adapter: str = "lora", workload: str = "mixed", ttft_ms: float = 1000.0, tpot_ms: float = 25.0,
         attainment: float = 0.9, rate_per_adapter: float = 0.0, policies: str = ",".join(POLICIES),
         requests: int = 300, max_len: int = 4096, out: str = "runs/eval") -> dict[str, Any]:
    import inspect

    from preft.eval.common import parse_list
    from preft.eval.plan import roofline
    from preft.eval.results import command_line, save_run
    from preft.serving.scheduling.chunk_policies import make_policy

    arguments = dict(locals())
    values = {name: arguments[name] for name in inspect.signature(main).parameters}
    if adapters < 1 or slots < 1 or requests < 50 or ttft_ms <= 0 or tpot_ms <= 0 or not 0 < attainment <= 1 \
            or rate_per_adapter < 0:
        raise ValueError("--adapters and --slots must be >= 1, --requests >= 50, --ttft-ms and --tpot-ms > 0, "
                         "--attainment in (0, 1], --rate-per-adapter >= 0")
    names = parse_list(policies, str, "policies")
    cost_model = roofline(hardware, model, tp, adapter=adapter)  # bad names fail before anything runs
    for name in names:
        make_policy(name, cost_model=cost_model, tpot_s=tpot_ms / 1e3, max_chunk=8192)
    planner = Planner(cost_model, load_workload(workload, requests, max_len, ttft_ms / 1e3), slots, ttft_ms / 1e3, tpot_ms / 1e3,
                      attainment)
    started = time.time()
    variants = {}
    for variant in VARIANTS:
        by_policy = {name: planner.capacity(variant, name, adapters) for name in names}
        best = max(names, key=lambda name: by_policy[name])
        row = {"policy": best, "capacity": by_policy[best], "by_policy": by_policy}
        if rate_per_adapter:
            row["adapters_per_gpu"] = (int(by_policy[best] / rate_per_adapter) if variant == "base"
                                       else planner.adapters_per_gpu(variant, best, rate_per_adapter))
            row["gpus"] = math.ceil(adapters / row["adapters_per_gpu"]) if row["adapters_per_gpu"] else None
        variants[variant] = row
        print(f"[capacity] {variant}: {row['capacity']:.1f} req/s with {best} ({time.time() - started:.0f} s, "
              f"{planner.simulations} simulations)", flush=True)
    preft, all_token = variants["preft"], variants["all-token"]
    advice = (f"Serve PreFT with `preft serve --scheduler {preft['policy']}`: {preft['capacity']:.1f} req/s within the "
              f"SLO at {adapters} adapters, {preft['capacity'] / all_token['capacity']:.2f}x all-token's "
              f"{all_token['capacity']:.1f}." if all_token["capacity"] else
              f"Serve PreFT with `preft serve --scheduler {preft['policy']}` ({preft['capacity']:.1f} req/s within the "
              f"SLO); all-token serving meets it at no rate tried.")
    if rate_per_adapter and preft["adapters_per_gpu"]:
        gpus = f"{preft['gpus']} GPU" + ("s" if preft["gpus"] != 1 else "")
        advice += (f" At {rate_per_adapter:g} req/s per adapter one GPU holds {preft['adapters_per_gpu']} PreFT "
                   f"adapters ({gpus} for {adapters}) against {all_token['adapters_per_gpu']} all-token.")
    result = {"command": command_line("capacity", main, values, always=("hardware", "model", "adapters", "workload")),
              "title": cost_model.source, "roofline": cost_model.to_json(),
              "settings": {"workload": workload, "adapters": adapters, "adapter": adapter, "slots": slots,
                           "ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "attainment": attainment,
                           "rate_per_adapter": rate_per_adapter, "requests": requests, "max_len": max_len,
                           "adapter_bytes": cost_model.model.bytes_per_value * cost_model.adapter_shape()[1]},
              "variants": variants, "advice": advice, "simulations": planner.simulations,
              "wall_time_s": round(time.time() - started, 1)}
    save_run(Path(out) / "capacity", "capacity", result, markdown(result))
    return result


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    add_flags(parser, main, [
        ("--hardware", str, "GPU preset (preft eval plan's)"),
        ("--model", str, "model preset or a local model directory (its config.json)"),
        ("--tp", int, "tensor-parallel GPUs"),
        ("--adapters", int, "adapters to serve"),
        ("--slots", int, "adapter slots on the GPU (vLLM's --max-loras)"),
        ("--adapter", str, "adapter kind: lora or reft"),
        ("--workload", str, "a named workload (chat, mixed, long, ...) or a timed-trace JSON-lines file"),
        ("--ttft-ms", float, "the SLO's time to first token"),
        ("--tpot-ms", float, "the SLO's mean time per output token"),
        ("--attainment", float, "the fraction of requests that must meet the SLO"),
        ("--rate-per-adapter", float, "requests/s each adapter's users send (0: skip adapters per GPU)"),
        ("--policies", str, "comma-separated chunk policies to compare"),
        ("--requests", int, "requests per simulated run (a named workload; a trace keeps its own)"),
        ("--max-len", int, "the longest prompt + output (a named workload's lengths scale with it)"),
        ("--out", str, "results directory"),
    ])
