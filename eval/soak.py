"""`preft eval soak`: the soak benchmark (:mod:`preft.eval.bench.soak`: a live server behind
``--api-key`` under mixed load, runtime loads and unloads and bad requests, every answer checked
against HF) into the eval results directory.

    preft eval soak [--minutes 3] [--concurrency 16] [--out runs/eval]

Writes ``OUT/soak/results.json``, ``soak.md``, ``soak.png`` and the server's ``server.log``
(each unexpected failure is in the results with its cause); ``preft eval report`` gathers
them with the rest (``preft bench soak`` is the same run, published to docs/RESULTS.md).
"""

from __future__ import annotations

from pathlib import Path

from preft.eval.bench import soak as bench_soak
from preft.eval.results import save_run


def main(minutes: float = 3.0, concurrency: int = 16, seed: int = 0, out: str = "runs/eval") -> dict:
    if minutes <= 0 or concurrency < 1:
        raise ValueError("--minutes must be > 0 and --concurrency >= 1")
    soak_dir = Path(out) / "soak"
    soak_dir.mkdir(parents=True, exist_ok=True)
    result, run = bench_soak.measure(minutes, concurrency, seed, log_path=soak_dir / "server.log")
    result["command"] = result["command"].replace("preft bench soak", "preft eval soak", 1)
    bench_soak.plot(run, soak_dir / "soak.png", f"{result['command']}: {result['requests']} requests")
    save_run(soak_dir, "soak", result, bench_soak.soak_markdown(result, "soak.png") + "\n", also=(soak_dir / "soak.png",))
    return result


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    add_flags(parser, main, [
        ("--minutes", float, "how long the load runs"),
        ("--concurrency", int, "concurrent clients"),
        ("--seed", int, "the load's random seed"),
        ("--out", str, "results directory"),
    ])
