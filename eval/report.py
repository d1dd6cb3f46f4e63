"""`preft eval report`: every eval result in one report, and the trade-off in one picture.

    preft eval report [--out runs/eval] [--write-docs]

Reads what ``preft eval loss`` / ``serve`` / ``rl`` / ``soak`` / ``profile`` / ``goodput`` wrote
under ``OUT`` (``NAME/results.json``, ``profile/profile_MODEL.*``, ``goodput/goodput.md``; any may
be missing) and writes ``OUT/report.md``:
each section with the command, machine and versions that produced it, and the headline figure
``OUT/tradeoff.png``: one point per (method, rank), x = serving throughput relative to the base
model at N adapters (from ``eval serve``, its largest N at its first rate: LoRA-P and ReFT-P are its ``preft`` variant, all-token
LoRA its ``all-token`` variant), y = held-out loss (from ``eval loss``). Up and to the left is
worse; PreFT's argument is points far to the right at little extra loss.

``--write-docs`` also puts each section into ``docs/RESULTS.md`` (between its markers, through
:func:`preft.eval.results.write_result`) with the figures in ``docs/results/``: the only eval
command that writes into the source tree.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path
from typing import Any

#: eval-loss method -> (eval-serve adapter kind, variant) whose throughput it is served at
SERVED_AS = {"lora": ("lora", "all-token"), "lora_p": ("lora", "preft"), "loreft_p": ("reft", "preft"),
             "direft_p": ("reft", "preft")}
SECTIONS = {"loss": ("loss.md", "loss_vs_rank.png"), "serve": ("serve.md", "serve.png"),
            "rl": ("rl.md", "reward_vs_step.png"), "soak": ("soak.md", "soak.png")}


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def tradeoff_points(loss: dict[str, Any], serve: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """``(points, methods left out)``: per (method, rank) the mean held-out loss and the throughput
    ratio to base of the variant that serves it."""
    from preft.eval.serve import base_row

    rate = serve["rows"][0]["request_rate"]  # the first rate, the largest adapter count
    rows = [r for r in serve["rows"] if r["request_rate"] == rate]
    most = max((r["adapters"] for r in rows), default=0)
    points, missing = [], []
    for method in loss["methods"]:
        kind, variant = SERVED_AS[method]
        served = next((r for r in rows if r["variant"] == variant and r["kind"] == kind and r["adapters"] == most),
                      None)
        base = base_row(rows, served) if served else None
        if base is None:
            missing.append(method)
            continue
        for rank in loss["ranks"]:
            runs = [r["eval_loss"] for r in loss["runs"] if r["method"] == method and r["rank"] == rank]
            points.append({"method": method, "rank": rank, "eval_loss": statistics.mean(runs),
                           "throughput_vs_base": served["vs_base"],
                           "served_rank": served["rank"], "adapters": served["adapters"]})
    return points, missing


def plot_tradeoff(points: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from preft.eval.loss import LABELS

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for index, method in enumerate(dict.fromkeys(p["method"] for p in points)):
        mine = [p for p in points if p["method"] == method]
        ax.scatter([p["throughput_vs_base"] for p in mine], [p["eval_loss"] for p in mine], color=f"C{index}",
                   label=LABELS[method], marker="s" if method == "lora" else "o")
        for p in mine:
            ax.annotate(f"r={p['rank']}", (p["throughput_vs_base"], p["eval_loss"]), fontsize=7,
                        xytext=(4, 2), textcoords="offset points")
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("serving throughput relative to the base model alone")
    ax.set_ylabel("held-out loss")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(out: str = "runs/eval", write_docs: bool = False, docs_dir: str | None = None) -> dict[str, Any]:
    """The report of ``out``; with ``write_docs``, its sections into ``docs_dir`` (default: the
    repository's ``docs/``)."""
    root = Path(out)
    results = {name: _read(root / name / "results.json") for name in SECTIONS}
    if not any(results.values()) and not own_figure_sections(root):
        raise ValueError(f"{root}: no eval results found (run preft eval loss / serve / rl with --out {out} first)")
    parts = ["# PreFT eval report\n"]
    figure = None
    if results["loss"] and results["serve"]:
        points, missing = tradeoff_points(results["loss"], results["serve"])
        if points:
            figure = root / "tradeoff.png"
            serve_rank, adapters = points[0]["served_rank"], points[0]["adapters"]
            plot_tradeoff(points, figure, f"accuracy vs serving throughput: {adapters} adapters "
                                          f"(throughput measured at rank {serve_rank})")
            note = f" Left out (their serving variant was not measured): {', '.join(missing)}." if missing else ""
            parts.append("## The trade-off\n\n![trade-off](tradeoff.png)\n\nOne point per (method, rank): held-out "
                         f"loss from `{results['loss']['command']}`, throughput relative to the base model from "
                         f"`{results['serve']['command']}` (measured at rank {serve_rank} for every point).{note}\n")
            results["tradeoff"] = {"points": points, "left_out": missing}
    for name, (markdown, picture) in SECTIONS.items():
        if results[name] and (root / name / markdown).is_file():
            text = (root / name / markdown).read_text().strip()
            parts.append(text.replace("\n\n", f"\n\n![{name}]({name}/{picture})\n\n", 1)
                         if (root / name / picture).is_file() else text)
    # sections that name their own figures (``![..](FILE.png)``, FILE beside the markdown)
    own = own_figure_sections(root)
    for name, (markdown, pictures) in own.items():
        parts.append(_figures_at(markdown.read_text().strip(), pictures, f"{markdown.parent.name}/"))
    report = root / "report.md"
    report.write_text("\n\n".join(parts) + "\n")
    print(f"written: {report}" + (f" and {figure}" if figure else ""))
    if write_docs:
        from preft.eval.results import REPO, write_result

        docs_root = Path(docs_dir) if docs_dir else REPO / "docs"
        docs = docs_root / "results"
        docs.mkdir(parents=True, exist_ok=True)
        for name, (markdown, picture) in SECTIONS.items():
            if not results[name]:
                continue
            text = (root / name / markdown).read_text().strip()
            if (root / name / picture).is_file():
                shutil.copyfile(root / name / picture, docs / f"eval_{picture}")
                text = text.replace("\n\n", f"\n\n![{name}](results/eval_{picture})\n\n", 1)
            write_result(f"eval_{name}", results[name], text, docs_root)
        for name, (markdown, pictures) in own.items():
            for picture in pictures:
                shutil.copyfile(markdown.parent / picture, docs / f"eval_{picture}")
            data = _read(markdown.with_suffix(".json")) or _read(markdown.parent / "results.json") or {}
            write_result(f"eval_{name}", data,
                         _figures_at(markdown.read_text().strip(), pictures, "results/eval_"), docs_root)
        if figure:
            shutil.copyfile(figure, docs / "eval_tradeoff.png")
            write_result("eval_tradeoff", results["tradeoff"], parts[1].replace("(tradeoff.png)",
                                                                                "(results/eval_tradeoff.png)"), docs_root)
        print(f"written: {docs_root / 'RESULTS.md'} and {docs}/eval_*")
    return results


def own_figure_sections(root: Path) -> dict[str, tuple[Path, list[str]]]:
    """``name -> (markdown, its figures)`` for ``eval profile`` (one per model), ``eval goodput``,
    ``eval prefix``, ``eval pipeline``, ``eval plan``, ``eval capacity``, ``eval sglang`` and
    ``eval sglang-chunks``."""
    found = {}
    for markdown in sorted((root / "profile").glob("profile_*.md")):
        found[markdown.stem] = (markdown, [f"{markdown.stem}.png"])
    if (root / "goodput" / "goodput.md").is_file():
        found["goodput"] = (root / "goodput" / "goodput.md", ["goodput_sim.png", "goodput_engine.png"])
    if (root / "goodput" / "goodput_capacity.md").is_file():
        found["goodput_capacity"] = (root / "goodput" / "goodput_capacity.md", ["goodput_capacity.png"])
    if (root / "prefix" / "prefix.md").is_file():
        found["prefix"] = (root / "prefix" / "prefix.md", ["prefix_orders.png", "conversations.png"])
    if (root / "pipeline" / "pipeline.md").is_file():
        found["pipeline"] = (root / "pipeline" / "pipeline.md", ["pipeline_sim.png"])
    for markdown in sorted(root.glob("plan_*/plan.md")):  # one per model and GPU
        found[markdown.parent.name] = (markdown, sorted(p.name for p in markdown.parent.glob("plan_*.png")))
    if (root / "capacity" / "capacity.md").is_file():
        found["capacity"] = (root / "capacity" / "capacity.md", [])
    if (root / "sglang" / "sglang.md").is_file():
        found["sglang"] = (root / "sglang" / "sglang.md", ["sglang_orders.png"])
    if (root / "sglang_chunks" / "sglang_chunks.md").is_file():
        found["sglang_chunks"] = (root / "sglang_chunks" / "sglang_chunks.md", ["sglang_chunks.png"])
    return {name: (markdown, [p for p in pictures if (markdown.parent / p).is_file()])
            for name, (markdown, pictures) in found.items()}


def _figures_at(text: str, pictures: list[str], prefix: str) -> str:
    for picture in pictures:
        text = text.replace(f"]({picture})", f"]({prefix}{picture})")
    return text


def add_arguments(parser) -> None:
    parser.add_argument("--out", default="runs/eval", help="the results directory the eval commands wrote "
                                                           "(default runs/eval)")
    parser.add_argument("--write-docs", action="store_true",
                        help="also write each section into docs/RESULTS.md and its figures into docs/results/")
