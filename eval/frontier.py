"""`preft eval frontier`: the accuracy–throughput picture the PreFT paper argues from, one plot per task.

    preft eval frontier --loss runs/study/loss
                        --serve runs/serve-r4/serve/results.json,runs/serve-r16/serve/results.json
                        [--adapters 64] [--out runs/eval]

A point per (method, rank): x is the served output throughput with that method's adapters at
that rank, as a fraction of the base model's in the same ``preft eval serve`` run (a ratio
within one run: machines drift between runs), y the held-out task accuracy from ``preft eval
loss --tasks`` (mean over seeds): its ``results.json``, or its ``OUT/loss`` directory, which
reads every finished run there, so a study made by several commands is plotted whole. Methods
map to served variants: all-token LoRA is ``all-token`` ``lora``, LoRA-P ``preft`` ``lora``,
LoReFT-P and DiReFT-P ``preft`` ``reft`` (the served ReFT is LoReFT; DiReFT's cost differs by
one d x r product). A (method, rank) without a
served measurement is listed and left off the plot. (``preft eval report``'s trade-off figure is
the loss-axis view of one served rank; this is the accuracy view, rank by rank.)

Writes ``OUT/frontier/results.json``, ``frontier.md`` and ``frontier_TASK.png``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from preft.eval.loss import LABELS, study
from preft.eval.report import SERVED_AS  # method -> (adapter kind, variant) of `preft eval serve`'s rows
from preft.eval.results import save_run


def _read(path: str) -> dict[str, Any]:
    file = Path(path)
    if file.is_dir() and (file / "runs").is_dir() and (file / "data").is_dir():
        return study(file)
    if file.is_dir():
        file = file / "results.json"
    if not file.is_file():
        raise ValueError(f"no results file at {path} (give a results.json or the directory holding it)")
    return json.loads(file.read_text())


def throughputs(serve_results: list[dict[str, Any]], adapters: int) -> dict[tuple[str, int], dict[str, float]]:
    """``(method, rank) -> {"vs_base", "output_throughput"}`` at ``adapters`` adapters."""
    out = {}
    for result in serve_results:
        for row in result["rows"]:
            if row.get("adapters") != adapters or row.get("vs_base") is None:
                continue
            for method, (kind, variant) in SERVED_AS.items():
                if row["variant"] == variant and row["kind"] == kind:
                    out[(method, row["rank"])] = {"vs_base": row["vs_base"],
                                                  "output_throughput": row["output_throughput"]}
    return out


def points(loss: dict[str, Any], served: dict[tuple[str, int], dict[str, float]]) -> list[dict[str, Any]]:
    """One point per (task, method, rank) of the loss study, its throughput where served."""
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for run in loss["runs"]:
        if run.get("accuracy") is not None:
            groups.setdefault((run["task"], run["method"], run["rank"]), []).append(run)
    return [{"task": task, "method": method, "rank": rank, "seeds": len(runs),
             "accuracy": statistics.mean(r["accuracy"] for r in runs),
             "eval_loss": statistics.mean(r["eval_loss"] for r in runs),
             **served.get((method, rank), {"vs_base": None, "output_throughput": None})}
            for (task, method, rank), runs in sorted(groups.items())]


def plot(task: str, rows: list[dict[str, Any]], base_accuracy: float | None, path: Path, adapters: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, method in enumerate(SERVED_AS):
        mine = sorted((r for r in rows if r["method"] == method and r["vs_base"] is not None), key=lambda r: r["rank"])
        if not mine:
            continue
        ax.plot([r["vs_base"] for r in mine], [r["accuracy"] for r in mine], marker="o", color=f"C{i}",
                label=LABELS[method], linestyle="--" if method == "lora" else "-")
        for r in mine:
            ax.annotate(f"r={r['rank']}", (r["vs_base"], r["accuracy"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
    if base_accuracy is not None:
        ax.scatter([1.0], [base_accuracy], color="grey", marker="s", label="base model (no adapter)")
    ax.set_xlabel(f"served output throughput, fraction of the base model's ({adapters} adapters)")
    ax.set_ylabel("held-out task accuracy")
    ax.set_title(f"accuracy against throughput: {task}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(loss: str = "runs/eval/loss/results.json", serve: str = "runs/eval/serve/results.json", adapters: int = 64,
         out: str = "runs/eval") -> dict[str, Any]:
    loss_result = _read(loss)
    if not loss_result.get("tasks"):
        raise ValueError(f"{loss}: not a study-task run (make it with preft eval loss --tasks ...)")
    serve_results = [_read(path) for path in serve.split(",") if path]
    rows = points(loss_result, throughputs(serve_results, adapters))
    frontier_dir = Path(out) / "frontier"
    frontier_dir.mkdir(parents=True, exist_ok=True)
    figures, sections = [], []
    for task in loss_result["tasks"]:
        mine = [r for r in rows if r["task"] == task]
        base = (loss_result.get("base") or {}).get(task, {}).get("accuracy")
        figure = frontier_dir / f"frontier_{task}.png"
        plot(task, mine, base, figure, adapters)
        figures.append(figure)
        lines = [f"### {task}", "", "| method | rank | accuracy | held-out loss | throughput vs base |",
                 "|---|---|---|---|---|"]
        lines += [f"| {LABELS[r['method']]} | {r['rank']} | {r['accuracy']:.0%} | {r['eval_loss']:.3f} | "
                  + (f"{r['vs_base']:.2f}x |" if r["vs_base"] is not None else "not served |") for r in mine]
        sections.append("\n".join(lines) + "\n")
    commands = [loss_result.get("command", "")] + [s.get("command", "") for s in serve_results]
    command = f"preft eval frontier --loss {loss} --serve {serve} --adapters {adapters}"
    result = {"command": command, "from": commands, "adapters": adapters, "points": rows}
    markdown = (f"## Accuracy against served throughput\n\nCommand: `{command}`, over "
                + ", ".join(f"`{c}`" for c in commands if c) + ".\n\n" + "\n".join(sections))
    save_run(frontier_dir, "frontier", result, markdown, also=tuple(figures))
    return result


def add_arguments(parser) -> None:
    from preft.eval.results import add_flags

    add_flags(parser, main, [
        ("--loss", str, "preft eval loss --tasks results: its results.json, or its OUT/loss directory (every finished run there)"),
        ("--serve", str, "comma-separated preft eval serve results (results.json or directories), one per rank"),
        ("--adapters", int, "the adapter count whose throughput is read"),
        ("--out", str, "results directory"),
    ])
