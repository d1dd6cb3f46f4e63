"""Write benchmark results: a JSON file and a marked section of docs/RESULTS.md.

Numbers reach the docs only through here, never typed by hand: each section is replaced
between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` markers, with the command that
produced it.
"""

from __future__ import annotations

import datetime
import inspect
import json
import os
import platform
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def write_result(name: str, result: dict[str, Any], markdown: str, docs_dir: Path | None = None) -> Path:
    docs = docs_dir or REPO / "docs"
    (docs / "results").mkdir(parents=True, exist_ok=True)
    json_path = docs / "results" / f"{name}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    results_md = docs / "RESULTS.md"
    text = results_md.read_text() if results_md.exists() else "# Measured results\n"
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{markdown.strip()}\n\nPublished {datetime.date.today().isoformat()}.\n{end}"
    if start in text and end in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    temp = results_md.with_name(f".{results_md.name}.{os.getpid()}.tmp")  # a reader never sees half a file
    temp.write_text(text)
    os.replace(temp, results_md)
    return json_path


def save_run(directory: Path, name: str, result: dict[str, Any], markdown: str, also: tuple[Path, ...] = (),
             json_name: str = "results.json") -> None:
    """``DIRECTORY/results.json`` (or ``json_name``) and ``DIRECTORY/NAME.md`` of one ``preft eval``
    command, each written atomically (a temp file renamed over it); the markdown printed, then what
    was written (and ``also``, the figures). Every ``preft eval`` command writes its results here."""
    import os

    directory.mkdir(parents=True, exist_ok=True)
    for path, text in ((directory / json_name, json.dumps(result, indent=2, default=str) + "\n"),
                       (directory / f"{name}.md", markdown)):
        temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temp.write_text(text)
        os.replace(temp, path)
    print(markdown)
    print("written: " + ", ".join(str(p) for p in (directory / json_name, directory / f"{name}.md", *also)))


def torch_machine() -> dict[str, str]:
    """Where a torch benchmark ran: CPU architecture, torch's threads, torch's version."""
    return {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__}


def publish(name: str, result: dict[str, Any], markdown: str) -> Path:
    """:func:`write_result`, then show the section on stdout and say where it went."""
    path = write_result(name, result, markdown)
    print(markdown)
    print(f"written: {path} and docs/RESULTS.md", file=sys.stderr)
    return path


def run_dir_for(runs: Path, name: str, config: dict[str, Any]) -> Path:
    """``runs/NAME-DIGEST``: one directory per training setting (the digest is over the run's
    config less its output directory), so a rerun with another learning rate, step count or data
    file never reuses or resumes a run trained otherwise."""
    import hashlib

    settings = {k: v for k, v in config.items() if k not in ("output_dir", "resume_from_checkpoint")}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return runs / f"{name}-{digest}"


def command_line(name: str, function, values: dict[str, Any], always: tuple[str, ...] = ()) -> str:
    """``preft eval NAME --flag value ...`` for the arguments in ``always`` and every other one of
    ``function``'s that differs from its default: the recorded command reruns the measurement."""
    given = [(k, v) for k, v in values.items()
             if v is not None and (k in always or v != default_of(function, k))]
    def flag(key: str, value: Any) -> str:
        if isinstance(value, bool):  # a switch (add_flags): --x or --no-x
            return f"--{'' if value else 'no-'}{key.replace('_', '-')}"
        return f"--{key.replace('_', '-')} {shlex.quote(str(value))}"

    return " ".join([f"preft eval {name}", *(flag(k, v) for k, v in given)])


def default_of(function, name: str) -> Any:
    """The default of ``function``'s keyword ``name``: a benchmark's defaults live in its
    ``main()`` alone, and its command-line flags and recorded command read them from there."""
    return inspect.signature(function).parameters[name].default


def add_flags(parser, function, flags: list[tuple[str, type, str]]) -> None:
    """One ``--flag`` per ``(flag, type, help)``, its default read from ``function``'s keyword of
    the same name (``--eval-examples`` -> ``eval_examples``) and shown in the help; a ``bool``
    flag is a switch (``--no-flag`` when it is on by default)."""
    for flag, kind, what in flags:
        key = flag[2:].replace("-", "_")
        default = default_of(function, key)
        if kind is bool:  # a switch: --no-x turns off what is on by default, --x turns on what is off
            switch = f"--no-{flag[2:]}" if default else flag
            parser.add_argument(switch, dest=key, action="store_false" if default else "store_true",
                                help=f"{'do not ' if default else ''}{what}")
            continue
        parser.add_argument(flag, type=kind, default=default, help=f"{what} (default {default})")
